//! `tessera serve` against the official `openai` Python client (tests/openai_client.py,
//! `pip install openai`, which .ci/run does), `/metrics`, `n`, logprobs, prompt forms and a
//! client leaving mid-stream while another stream goes on. The real binary on 127.0.0.1
//! with the default model; every server is killed when its test ends.

mod common;

use common::{completion, generate_greedy, model, qwen, sse_events, Response, Server, KEY};
use serde_json::{json, Value};
use std::io::Read;
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PROMPT: &str = "The capital of France is";

/// An OpenAI-shaped 400 naming `param`.
fn assert_bad(r: &Response, param: &str) {
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(e["type"], "invalid_request_error", "{v}");
    assert_eq!(e["param"], param, "{v}");
    assert!(e.get("code").is_some(), "{v}");
}

/// Polls `until` every 50 ms for at most `limit`.
fn wait_for(limit: Duration, what: &str, mut until: impl FnMut() -> bool) {
    let t = Instant::now();
    while !until() {
        assert!(t.elapsed() < limit, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_openai_python_client_gets_what_raw_requests_get() {
    let server = Server::start_with(&model(), &["--api-key", KEY, "--max-batch", "4"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let base_url = format!("http://127.0.0.1:{}/v1", server.port);
    let out = Command::new("python3")
        .arg(&script)
        .args([base_url.as_str(), KEY])
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run python3 ({e}); the test needs python3 with `pip install openai`")
        });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("No module named 'openai'"),
        "the `openai` Python package is missing: pip install openai (as .ci/run does)\n{stderr}"
    );
    assert!(out.status.success(), "{script:?} failed:\n{stderr}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let v: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("the script's JSON ({e}): {stdout:?}\n{stderr}"));
    eprintln!("openai {}", v["openai_version"]);

    // The client's greedy texts are what a raw request to the same server gets.
    let raw = server
        .post("/v1/completions", &completion(PROMPT, 8))
        .json();
    assert_eq!(v["completion"]["text"], raw["choices"][0]["text"], "{v}");
    assert_eq!(
        v["completion"]["finish_reason"],
        raw["choices"][0]["finish_reason"]
    );
    let raw = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Name three colors."}],
                    "max_tokens": 12, "temperature": 0}),
        )
        .json();
    assert_eq!(
        v["chat"]["text"], raw["choices"][0]["message"]["content"],
        "{v}"
    );
    assert_eq!(
        v["chat"]["usage"]["completion"],
        raw["usage"]["completion_tokens"]
    );
    // And the completion is `tessera generate`'s.
    assert_eq!(
        generate_greedy(PROMPT, 8),
        v["completion"]["text"].as_str().unwrap()
    );
    // The logprobs' tokens spell the greedy reply.
    let spelled: String = v["chat_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t[0].as_str().unwrap().to_string())
        .collect();
    assert_eq!(spelled, v["chat"]["text"].as_str().unwrap());
    assert!(v["model"].as_str().unwrap().contains("gemma-3-270m"), "{v}");
    assert!(v["errors"]["temperature"]
        .as_str()
        .unwrap()
        .contains("temperature"));
}

#[test]
fn metrics_prompt_forms_n_and_logprobs_over_raw_http() {
    // f32 weights, so that choices batched together equal their prompts run alone.
    let server = Server::start_with(
        &model(),
        &["--max-batch", "4", "--kv-budget", "64", "--f32-weights"],
    );
    // Before any request: every metric present, zero.
    let r = server.request("GET", "/metrics", None);
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/plain; version=0.0.4"),
        "{:?}",
        r.header("content-type")
    );
    for name in [
        "tessera_requests_running",
        "tessera_requests_waiting",
        "tessera_kv_bytes_allocated",
        "tessera_kv_bytes_reserved",
        "tessera_kv_budget_bytes",
        "tessera_prefix_cache_bytes",
        "tessera_requests_total",
        "tessera_prompt_tokens_total",
        "tessera_generation_tokens_total",
        "tessera_prefix_cache_hits_total",
        "tessera_prefix_cache_tokens_total",
        "tessera_time_to_first_token_seconds",
        "tessera_inter_token_latency_seconds",
        "tessera_prefill_seconds_total",
        "tessera_prefill_tokens_total",
        "tessera_decode_seconds_total",
        "tessera_decode_submit_seconds_total",
        "tessera_decode_steps_total",
        "tessera_decode_row_steps_total",
    ] {
        assert!(r.text().contains(&format!("# HELP {name} ")), "{name}");
        assert!(r.text().contains(&format!("# TYPE {name} ")), "{name}");
    }
    assert_eq!(server.metric("tessera_kv_budget_bytes"), (64 << 20) as f64);
    assert_eq!(server.metric("tessera_requests_running"), 0.0);

    // One completion: the counters move by its usage.
    let v = server
        .post("/v1/completions", &completion(PROMPT, 6))
        .json();
    let usage = &v["usage"];
    let finish = v["choices"][0]["finish_reason"].as_str().unwrap();
    let m = server.metrics();
    let get = |name: &str| m.iter().find(|(n, _)| n == name).map(|(_, v)| *v);
    assert_eq!(
        get(&format!(
            "tessera_requests_total{{finish_reason=\"{finish}\"}}"
        )),
        Some(1.0)
    );
    assert_eq!(
        get("tessera_prompt_tokens_total"),
        usage["prompt_tokens"].as_f64()
    );
    assert_eq!(
        get("tessera_generation_tokens_total"),
        usage["completion_tokens"].as_f64()
    );
    assert_eq!(get("tessera_time_to_first_token_seconds_count"), Some(1.0));
    // The engine's own counts: the prompt read (less what a stored prefix gave), and one
    // decode step per token after the first (one more where a stop token ended it).
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_f64()
        .unwrap();
    assert_eq!(
        get("tessera_prefill_tokens_total"),
        Some(usage["prompt_tokens"].as_f64().unwrap() - cached)
    );
    let steps = usage["completion_tokens"].as_f64().unwrap() - 1.0
        + if finish == "stop" { 1.0 } else { 0.0 };
    assert_eq!(get("tessera_decode_steps_total"), Some(steps));
    assert_eq!(get("tessera_decode_row_steps_total"), Some(steps));
    let seconds = |name: &str| get(name).unwrap_or(-1.0);
    assert!(seconds("tessera_prefill_seconds_total") > 0.0);
    assert!(
        seconds("tessera_decode_seconds_total") >= seconds("tessera_decode_submit_seconds_total")
            && seconds("tessera_decode_submit_seconds_total") > 0.0
    );
    assert_eq!(
        get("tessera_inter_token_latency_seconds_count"),
        Some(usage["completion_tokens"].as_f64().unwrap() - 1.0)
    );
    assert_eq!(
        get("tessera_time_to_first_token_seconds_bucket{le=\"+Inf\"}"),
        Some(1.0)
    );
    assert_eq!(get("tessera_requests_running"), Some(0.0));
    assert_eq!(get("tessera_kv_bytes_reserved"), Some(0.0));

    // Prompt forms: a list of strings, token ids, lists of ids; n fans out per prompt.
    let text0 = v["choices"][0]["text"].as_str().unwrap().to_string();
    let mut body = completion(PROMPT, 6);
    body["prompt"] = json!([PROMPT, "Once upon a time"]);
    body["n"] = json!(2);
    let r = server.post("/v1/completions", &body).json();
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{r}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{r}");
    }
    assert_eq!(choices[0]["text"], text0);
    assert_eq!(choices[1]["text"], text0);
    assert_eq!(choices[2]["text"], choices[3]["text"]);
    let alone = server
        .post("/v1/completions", &completion("Once upon a time", 6))
        .json();
    assert_eq!(choices[2]["text"], alone["choices"][0]["text"]);
    assert_eq!(
        r["usage"]["prompt_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap()
            + alone["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        r["usage"]["completion_tokens"].as_u64().unwrap(),
        2 * usage["completion_tokens"].as_u64().unwrap()
            + 2 * alone["usage"]["completion_tokens"].as_u64().unwrap()
    );

    // Token ids: Gemma's BOS (2) and a few ids; one list and a list of lists agree.
    let mut body = completion(PROMPT, 4);
    body["prompt"] = json!([2, 818, 5279, 529]);
    let one = server.post("/v1/completions", &body);
    assert_eq!(one.status, 200, "{}", one.text());
    let one = one.json();
    assert_eq!(one["usage"]["prompt_tokens"], 4);
    body["prompt"] = json!([[2, 818, 5279, 529], [2, 818]]);
    let two = server.post("/v1/completions", &body).json();
    assert_eq!(two["choices"][0]["text"], one["choices"][0]["text"]);
    assert_eq!(two["usage"]["prompt_tokens"], 6);
    body["prompt"] = json!([2, 999_999_999]);
    assert_bad(&server.post("/v1/completions", &body), "prompt");
    for bad in [json!([2, "a"]), json!(3), json!([]), json!({"a": 1})] {
        body["prompt"] = bad;
        assert_bad(&server.post("/v1/completions", &body), "prompt");
    }

    // Streamed n = 2: every chunk names its choice; both finish; one usage chunk.
    let mut body = json!({"messages": [{"role": "user", "content": "Say hi."}],
                          "max_tokens": 6, "temperature": 0, "n": 2, "stream": true,
                          "stream_options": {"include_usage": true}});
    let events = sse_events(server.post("/v1/chat/completions", &body).text());
    let mut texts = [String::new(), String::new()];
    let mut finished = [0, 0];
    let mut roles = [0, 0];
    for e in &events[..events.len() - 1] {
        let c = &e["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        texts[i] += c["delta"]["content"].as_str().unwrap_or("");
        finished[i] += c["finish_reason"].is_string() as usize;
        roles[i] += (c["delta"]["role"] == "assistant") as usize;
    }
    assert_eq!((finished, roles), ([1, 1], [1, 1]), "{events:?}");
    assert_eq!(texts[0], texts[1]);
    let usage = &events[events.len() - 1]["usage"];
    body["stream"] = json!(false);
    body["n"] = json!(1);
    let single = server.post("/v1/chat/completions", &body).json();
    assert_eq!(texts[0], single["choices"][0]["message"]["content"]);
    assert_eq!(usage["prompt_tokens"], single["usage"]["prompt_tokens"]);
    assert_eq!(
        usage["completion_tokens"].as_u64().unwrap(),
        2 * single["usage"]["completion_tokens"].as_u64().unwrap()
    );

    // Completion logprobs, streamed: offsets run on across chunks.
    let mut body = completion(PROMPT, 6);
    body["logprobs"] = json!(3);
    body["stream"] = json!(true);
    let events = sse_events(server.post("/v1/completions", &body).text());
    let mut text = String::new();
    let mut offsets = Vec::new();
    for e in &events {
        let c = &e["choices"][0];
        if let Some(lp) = c["logprobs"].as_object() {
            offsets.extend(lp["text_offset"].as_array().unwrap().iter().cloned());
            for t in lp["top_logprobs"].as_array().unwrap() {
                assert_eq!(t.as_object().unwrap().len(), 3, "{e}");
            }
        }
        text += c["text"].as_str().unwrap();
    }
    assert_eq!(text, text0);
    assert!(!offsets.is_empty());
    assert_eq!(offsets[0], 0);
    assert!(
        offsets.windows(2).all(|w| w[0].as_u64() < w[1].as_u64()),
        "{offsets:?}"
    );

    // Bad values name their field.
    for (field, value) in [
        ("n", json!(9)),
        ("n", json!("2")),
        ("logprobs", json!(21)),
        ("frequency_penalty", json!(-2.5)),
        ("min_p", json!(1.5)),
        ("top_k", json!(-3)),
        ("max_tokens", json!(-1)),
        ("stop", json!([1, 2])),
        ("echo", json!(true)),
    ] {
        let mut body = completion(PROMPT, 2);
        body[field] = value;
        assert_bad(&server.post("/v1/completions", &body), field);
    }
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        server.post("/v1/chat/completions", &body)
    };
    assert_bad(
        &chat(json!({"logprobs": true, "top_logprobs": 21})),
        "top_logprobs",
    );
    assert_bad(&chat(json!({"top_logprobs": 2})), "top_logprobs");
    assert_bad(&chat(json!({"logprobs": "yes"})), "logprobs");
    assert_bad(&chat(json!({"messages": "hi"})), "messages");
    assert_bad(&chat(json!({"temperature": 2.5})), "temperature");
    let ok = chat(json!({"logprobs": true, "presence_penalty": -2, "frequency_penalty": 2}));
    assert_eq!(ok.status, 200, "{}", ok.text());
    let content = &ok.json()["choices"][0]["logprobs"]["content"];
    assert!(
        content.as_array().is_some_and(|c| !c.is_empty()),
        "{content}"
    );
    assert_eq!(content[0]["top_logprobs"], json!([]));
}

/// Reads an SSE stream from `s` until `[DONE]`; returns the concatenated text and the
/// finish reason.
fn read_stream(mut s: TcpStream, first: &mut Option<mpsc::Sender<()>>) -> (String, String) {
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).expect("reads the stream");
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if String::from_utf8_lossy(&raw).contains("data: {") {
            if let Some(tx) = first.take() {
                let _ = tx.send(());
            }
        }
    }
    let r = Response::parse(&raw);
    assert_eq!(r.status, 200, "{}", r.text());
    let mut text = String::new();
    let mut finish = String::new();
    for e in sse_events(r.text()) {
        let c = &e["choices"][0];
        text += c["text"].as_str().unwrap_or("");
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish)
}

#[test]
fn a_client_leaving_mid_stream_frees_its_row_and_the_other_stream_goes_on() {
    // f32 weights: with quantized ones, the int8 activations round differently as rows
    // come and go, so "the same text as alone" would not hold (continuous_batching.rs).
    let server = Server::start_with(&model(), &["--max-batch", "4", "--f32-weights"]);
    let mut survivor = completion("Once upon a time, in a small village by the sea,", 40);
    survivor["stream"] = json!(true);
    let survivor = survivor.to_string();
    let (alone, alone_finish) = read_stream(
        server.send("POST", "/v1/completions", Some(survivor.as_bytes())),
        &mut None,
    );
    assert!(!alone.is_empty());

    // A long stream, read until its first token, then ...
    let mut doomed = completion(PROMPT, 20_000);
    doomed["stream"] = json!(true);
    let mut d = server.send(
        "POST",
        "/v1/completions",
        Some(doomed.to_string().as_bytes()),
    );
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = d.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    // ... the survivor starts beside it.
    let (tx, rx) = mpsc::channel();
    let s = server.send("POST", "/v1/completions", Some(survivor.as_bytes()));
    let reader = std::thread::spawn(move || read_stream(s, &mut Some(tx)));
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the survivor's first token");
    wait_for(Duration::from_secs(60), "two running requests", || {
        server.metric("tessera_requests_running") == 2.0
    });
    let finished = |server: &Server| {
        server.metric("tessera_requests_total{finish_reason=\"stop\"}")
            + server.metric("tessera_requests_total{finish_reason=\"length\"}")
    };
    let before = finished(&server);
    assert_eq!(before, 1.0, "the survivor's run alone");

    drop(d);
    // The engine notices, cancels and frees the row; one snapshot shows it all.
    let mut snapshot = Vec::new();
    wait_for(Duration::from_secs(30), "the cancelled request", || {
        snapshot = server.metrics();
        snapshot
            .iter()
            .any(|(n, v)| n == "tessera_requests_total{finish_reason=\"cancelled\"}" && *v == 1.0)
    });
    let get = |name: &str| {
        snapshot
            .iter()
            .find(|(n, _)| n == name)
            .map_or(-1.0, |(_, v)| *v)
    };
    let survivor_done = get("tessera_requests_total{finish_reason=\"stop\"}")
        + get("tessera_requests_total{finish_reason=\"length\"}")
        - before;
    assert_eq!(
        get("tessera_requests_running"),
        1.0 - survivor_done,
        "running = the survivor's count: {snapshot:?}"
    );
    eprintln!(
        "after the cancel: running {}, survivor finished: {}",
        get("tessera_requests_running"),
        survivor_done == 1.0
    );

    let (text, finish) = reader.join().unwrap();
    assert_eq!(text, alone, "the survivor's text");
    assert_eq!(finish, alone_finish);
    wait_for(Duration::from_secs(30), "an idle batch", || {
        server.metric("tessera_requests_running") == 0.0
            && server.metric("tessera_kv_bytes_allocated") == 0.0
    });
    assert_eq!(
        server.metric("tessera_requests_total{finish_reason=\"cancelled\"}"),
        1.0
    );
    assert_eq!(finished(&server), 2.0);
}

/// Non-ASCII text with Qwen's byte-level vocabulary: every token's `bytes`, joined, are
/// the reply's UTF-8 even where a token holds part of a character.
#[test]
fn logprob_bytes_spell_the_reply_with_a_byte_level_vocabulary() {
    let qwen = qwen();
    let server = Server::start_with(&qwen, &[]);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content":
                "Translate to Japanese and add an emoji: good morning"}],
                "max_tokens": 16, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!content.is_ascii(), "{content:?}");
    let tokens = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|t| t["bytes"].as_array().unwrap().iter())
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), content, "{v}");
    for t in tokens {
        assert_eq!(t["top_logprobs"].as_array().unwrap().len(), 2);
        assert_eq!(t["token"], t["top_logprobs"][0]["token"], "{t}");
    }
}

/// Two request fields other clients send, on an instruct model that ends its replies: a
/// `developer` message is the `system` one (the same prompt, the same greedy reply), and
/// `ignore_eos` (vLLM's and llama-server's, from load generators) decodes past the end of
/// the reply up to `max_tokens`, the reply's tokens unchanged before it.
#[test]
fn developer_messages_are_system_ones_and_ignore_eos_runs_to_max_tokens() {
    let qwen = qwen();
    let server = Server::start_with(&qwen, &[]);
    let chat = |role: &str, extra: Value| {
        let mut body = json!({"messages": [
                {"role": role, "content": "Answer in one short sentence."},
                {"role": "user", "content": "Say hi"}],
            "max_tokens": 40, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = server.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let system = chat("system", json!({}));
    let developer = chat("developer", json!({}));
    assert_eq!(
        developer["usage"]["prompt_tokens"],
        system["usage"]["prompt_tokens"]
    );
    let reply = system["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(developer["choices"][0]["message"]["content"], reply);
    assert_eq!(system["choices"][0]["finish_reason"], "stop", "{system}");
    let ended = system["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(ended < 40, "{system}");

    let longer = chat("system", json!({"ignore_eos": true}));
    assert_eq!(longer["choices"][0]["finish_reason"], "length", "{longer}");
    assert_eq!(longer["usage"]["completion_tokens"], 40);
    let text = longer["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        text.starts_with(reply) && text.len() > reply.len(),
        "{text:?} after {reply:?}"
    );
    let r = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": 1}),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["param"], "ignore_eos");
}
