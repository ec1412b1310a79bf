//! `tessera serve --spec ngram`: speculation inside the running batch (every row drafts by
//! prompt lookup, one forward verifies every row's draft, each row keeps its own count).
//! Greedy replies equal a plain server's, `/metrics` counts the drafts, sampling and
//! logprobs work through the rounds, and bad flags are refused before anything loads.
//!
//! Both servers dequantize weights to f32 (`--f32-weights`): with the shipped
//! int8-activation matmuls a chunk's sums differ from a step's in the last bits, which can
//! flip a greedy near-tie (see serve_concurrency.rs); what is tested here is the rounds.

mod common;

use common::{sse_events, tessera, Server};
use serde_json::{json, Value};
use std::sync::Barrier;

/// Four that copy their prompt and one that does not, on a batch of at most 4 rows (the
/// fifth joins a speculating batch as a row leaves).
const REQUESTS: usize = 5;

/// Paragraphs of Pride and Prejudice (lines joined) of 200 to 400 characters.
fn paragraphs() -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/corpus/pride-and-prejudice.txt");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (the evaluation texts)", path.display()));
    text.split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|p| (200..=400).contains(&p.len()))
        .collect()
}

/// Request `i` < 4: its own paragraph twice, then the paragraph's first words again, so the
/// greedy continuation copies the prompt (every draft accepted); 24 to 48 tokens out.
/// Request 4: a paragraph once, then 40 tokens of free text, whose drafts (repeated
/// phrases) are partly rejected.
fn request(paragraphs: &[String], i: usize) -> Value {
    let p = &paragraphs[3 * i];
    let head: Vec<&str> = p.split_whitespace().take(8).collect();
    let prompt = if i < 4 {
        format!("{p}\n\n{p}\n\n{}", head.join(" "))
    } else {
        format!("{p}\n\n")
    };
    json!({
        "prompt": prompt,
        "max_tokens": if i < 4 { 24 + 8 * i } else { 40 },
        "temperature": 0,
    })
}

/// The reply's text and completion token count.
fn reply(status: u16, body: &Value, i: usize) -> (String, u64) {
    assert_eq!(status, 200, "request {i}: {body}");
    let text = body["choices"][0]["text"].as_str().expect("a text");
    let tokens = body["usage"]["completion_tokens"]
        .as_u64()
        .expect("a count");
    (text.to_string(), tokens)
}

/// The requests sent together (released by one barrier), replies in request order.
fn concurrently(server: &Server, requests: &[Value]) -> Vec<(String, u64)> {
    let start = Barrier::new(requests.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .enumerate()
            .map(|(i, body)| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let r = server.post("/v1/completions", body);
                    reply(r.status, &r.json(), i)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a client thread"))
            .collect()
    })
}

/// `name{position="i"}` values from /metrics, by position.
fn by_position(metrics: &[(String, f64)], name: &str) -> Vec<f64> {
    let mut v: Vec<(usize, f64)> = metrics
        .iter()
        .filter_map(|(n, x)| {
            let rest = n.strip_prefix(name)?.strip_prefix("{position=\"")?;
            Some((rest.strip_suffix("\"}")?.parse().ok()?, *x))
        })
        .collect();
    v.sort_by_key(|&(i, _)| i);
    assert!(
        v.iter().enumerate().all(|(k, &(i, _))| k == i),
        "{name}: {v:?}"
    );
    v.into_iter().map(|(_, x)| x).collect()
}

fn metric(metrics: &[(String, f64)], name: &str) -> f64 {
    metrics
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
        .1
}

#[test]
fn speculative_batches_reply_as_plain_ones_and_count_their_drafts() {
    let paragraphs = paragraphs();
    assert!(
        paragraphs.len() >= 3 * REQUESTS,
        "{} paragraphs",
        paragraphs.len()
    );
    let requests: Vec<Value> = (0..REQUESTS).map(|i| request(&paragraphs, i)).collect();

    let plain = {
        let server = Server::start(&["--f32-weights", "--max-batch", "4"]);
        let replies = concurrently(&server, &requests);
        let m = server.metrics();
        for name in [
            "tessera_spec_rounds_total",
            "tessera_spec_plain_steps_total",
            "tessera_spec_drafted_tokens_total",
            "tessera_spec_accepted_tokens_total",
        ] {
            assert_eq!(metric(&m, name), 0.0, "{name} without --spec");
        }
        replies
    };

    let server = Server::start(&[
        "--f32-weights",
        "--max-batch",
        "4",
        "--spec",
        "ngram",
        "--draft-tokens",
        "6",
    ]);
    let spec = concurrently(&server, &requests);
    for (i, (got, want)) in spec.iter().zip(&plain).enumerate() {
        assert_eq!(
            got, want,
            "request {i} ({}): --spec vs plain",
            requests[i]["prompt"]
        );
        assert!(want.1 > 0, "request {i} generated nothing");
    }

    let m = server.metrics();
    let drafted = metric(&m, "tessera_spec_drafted_tokens_total");
    let accepted = metric(&m, "tessera_spec_accepted_tokens_total");
    let rounds = metric(&m, "tessera_spec_rounds_total");
    assert!(drafted > 0.0 && accepted > 0.0 && rounds > 0.0, "{m:?}");
    // The free text's drafts are not all accepted: rejections happened, and still every
    // reply equals the plain one.
    assert!(
        accepted < drafted,
        "{accepted} accepted of {drafted} drafted"
    );
    // A round decides its accepted drafts and one token more: fewer rounds than tokens.
    let generated: u64 = spec.iter().map(|(_, n)| n).sum();
    assert!(rounds + accepted <= generated as f64 + 1e-9, "{m:?}");
    let drafted_at = by_position(&m, "tessera_spec_drafted_by_position_total");
    let accepted_at = by_position(&m, "tessera_spec_accepted_by_position_total");
    assert!(
        !drafted_at.is_empty() && drafted_at.len() <= 6,
        "{drafted_at:?}"
    );
    assert_eq!(drafted_at.len(), accepted_at.len());
    assert_eq!(drafted_at.iter().sum::<f64>(), drafted);
    assert_eq!(accepted_at.iter().sum::<f64>(), accepted);
    assert_eq!(drafted_at[0], rounds, "every round drafts position 0");
    for (i, (a, d)) in accepted_at.iter().zip(&drafted_at).enumerate() {
        assert!(a <= d, "position {i}: {a} accepted of {d} drafted");
    }

    // Streamed: the same text in pieces (a round may send several tokens at once).
    let mut body = requests[0].clone();
    body["stream"] = json!(true);
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let streamed: String = sse_events(r.text())
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, plain[0].0);

    // Sampled: the rejection rule, through the same rounds.
    let mut body = requests[1].clone();
    body["temperature"] = json!(0.8);
    body["seed"] = json!(7);
    let r = server.post("/v1/completions", &body);
    let v = r.json();
    let (_, n) = reply(r.status, &v, 1);
    let max = body["max_tokens"].as_u64().unwrap();
    match v["choices"][0]["finish_reason"].as_str() {
        Some("length") => assert_eq!(n, max, "{v}"),
        Some("stop") => assert!(n < max, "{v}"),
        other => panic!("finish_reason {other:?}: {v}"),
    }

    // Logprobs: one entry per completion token, accepted drafts included.
    for temperature in [0.0, 0.8] {
        let mut body = requests[2].clone();
        body["temperature"] = json!(temperature);
        body["seed"] = json!(3);
        body["logprobs"] = json!(2);
        let r = server.post("/v1/completions", &body);
        let v = r.json();
        let (text, n) = reply(r.status, &v, 2);
        if temperature == 0.0 {
            assert_eq!((&text, n), (&plain[2].0, plain[2].1), "with logprobs");
        }
        let lp = &v["choices"][0]["logprobs"];
        for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let len = lp[field].as_array().map(Vec::len);
            assert_eq!(
                len,
                Some(n as usize),
                "{field} at temperature {temperature}: {v}"
            );
        }
        let tokens: String = lp["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(tokens, text, "temperature {temperature}");
        assert!(lp["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l.as_f64().is_some_and(|l| l <= 0.0)));
    }
}

#[test]
fn bad_speculation_flags_are_refused_before_anything_loads() {
    for (args, needle) in [
        (vec!["--spec", "foo"], "--spec foo"),
        (vec!["--spec", "ngram:0"], "--spec ngram:0"),
        (
            vec!["--spec", "ngram", "--draft-tokens", "0"],
            "--draft-tokens",
        ),
        (
            vec!["--spec", "ngram", "--draft-tokens", "65"],
            "--draft-tokens",
        ),
        (
            vec!["--draft-model", "/nonexistent-draft.gguf"],
            "--draft-model",
        ),
    ] {
        let mut all = vec!["serve", "--port", "0", "--model", "/nonexistent.gguf"];
        all.extend(&args);
        let (code, _, err) = tessera(&all);
        assert_ne!(code, 0, "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{args:?}: {needle} in {err:?}"
        );
        assert_eq!(err.lines().count(), 1, "one line: {err:?}");
        assert!(
            !err.contains("nonexistent.gguf"),
            "refused before the model loads: {err}"
        );
    }
}

#[test]
fn a_draft_model_serves_every_row_of_the_batch_and_replies_as_plain() {
    // The model drafting for itself (its own file as --draft-model), one cache per row:
    // greedy replies equal a plain server's on a 16-bit and a 4-bit cache, sampled and
    // streamed requests go through the same rounds.
    let paragraphs = paragraphs();
    let requests: Vec<Value> = (0..REQUESTS).map(|i| request(&paragraphs, i)).collect();
    let draft = common::model();
    for kv in ["bf16", "affine:4"] {
        let plain = {
            let server = Server::start(&["--max-batch", "4", "--kv", kv]);
            concurrently(&server, &requests)
        };
        let server = Server::start(&[
            "--max-batch",
            "4",
            "--kv",
            kv,
            "--draft-model",
            draft.to_str().unwrap(),
            "--draft-tokens",
            "4",
        ]);
        let spec = concurrently(&server, &requests);
        for (i, (got, want)) in spec.iter().zip(&plain).enumerate() {
            assert_eq!(got, want, "{kv}: request {i}: --draft-model vs plain");
        }
        let m = server.metrics();
        let drafted = metric(&m, "tessera_spec_drafted_tokens_total");
        let accepted = metric(&m, "tessera_spec_accepted_tokens_total");
        assert!(drafted > 0.0 && accepted > 0.0, "{kv}: {m:?}");
        let mut body = requests[1].clone();
        body["temperature"] = json!(0.8);
        body["seed"] = json!(11);
        body["stream"] = json!(true);
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{kv}: {}", r.text());
        let events = sse_events(r.text());
        assert!(
            events
                .iter()
                .any(|e| e["choices"][0]["finish_reason"].is_string()),
            "{kv}: {}",
            r.text()
        );
    }
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused_at_serve() {
    let qwen = common::qwen();
    let model = common::model();
    let (code, _, err) = tessera(&[
        "serve",
        "--port",
        "0",
        "--model",
        model.to_str().unwrap(),
        "--draft-model",
        qwen.to_str().unwrap(),
    ]);
    assert_ne!(code, 0, "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("--draft-model") && err.contains("vocabulary"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
