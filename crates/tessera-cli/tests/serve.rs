//! `tessera serve` end to end: the real binary on 127.0.0.1 with the default model, driven
//! by a small HTTP/1.1 client over `TcpStream`; every server is killed when its test ends.

mod common;

use common::{
    completion, generate_greedy, read_until_first_event, sse_events, Response, Server, KEY,
};
use serde_json::{json, Value};
use std::io::Read;
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

const PROMPT: &str = "The capital of France is";

/// An OpenAI-shaped error body with this status.
fn assert_error(r: &Response, status: u16) -> Value {
    assert_eq!(r.status, status, "body: {}", r.text());
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    v
}

fn check_usage(u: &Value) {
    let p = u["prompt_tokens"].as_u64().unwrap();
    let c = u["completion_tokens"].as_u64().unwrap();
    assert_eq!(u["total_tokens"].as_u64().unwrap(), p + c);
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached <= p, "{cached} cached of {p} prompt tokens");
}

#[test]
fn health_models_and_api_key() {
    let server = Server::start(&["--api-key", KEY]);
    let r = server.request_with("GET", "/health", None, None);
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"status": "ok"}));

    let r = server.request("GET", "/v1/models", None);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["object"], "model");
    let name = v["data"][0]["id"].as_str().unwrap();
    assert!(name.contains("gemma-3-270m"), "{v}");
    // One model by its id, as the list gives it; another id is 404.
    let r = server.request("GET", &format!("/v1/models/{name}"), None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json(), v["data"][0]);
    let v = assert_error(&server.request("GET", "/v1/models/gpt-4o", None), 404);
    assert_eq!(v["error"]["code"], "model_not_found");
    let r = server.request_with(
        "GET",
        &format!("/v1/models/{name}"),
        None,
        Some("Bearer nope"),
    );
    assert_error(&r, 401);

    let body = completion(PROMPT, 2).to_string();
    for auth in [None, Some("Bearer wrong"), Some(KEY)] {
        let r = server.request_with("POST", "/v1/completions", Some(body.as_bytes()), auth);
        let v = assert_error(&r, 401);
        assert_eq!(v["error"]["code"], "invalid_api_key");
    }
    let r = server.request_with("GET", "/v1/models", None, Some("Bearer nope"));
    assert_error(&r, 401);
    let r = server.request("POST", "/v1/completions", Some(body.as_bytes()));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_greedy_completion_equals_tessera_generate() {
    let server = Server::start(&[]);
    let r = server.post("/v1/completions", &completion(PROMPT, 8));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("application/json"));
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert!(v["created"].is_u64());
    assert!(v["model"].is_string());
    let choice = &v["choices"][0];
    assert_eq!(choice["index"], 0);
    let text = choice["text"].as_str().unwrap();
    check_usage(&v["usage"]);
    let completion_tokens = v["usage"]["completion_tokens"].as_u64().unwrap();
    match choice["finish_reason"].as_str().unwrap() {
        "length" => assert_eq!(completion_tokens, 8),
        "stop" => assert!(completion_tokens < 8),
        other => panic!("finish_reason {other}"),
    }

    assert_eq!(generate_greedy(PROMPT, 8), text);

    // A stop string from inside that text: cut before it, finish_reason "stop".
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "{text:?}");
    let stop: String = chars[2..4].iter().collect();
    let expected = &text[..text.find(&stop).unwrap()];
    let mut body = completion(PROMPT, 8);
    body["stop"] = json!(["\u{1}never", stop]);
    let v = server.post("/v1/completions", &body).json();
    assert_eq!(
        v["choices"][0]["text"], expected,
        "stop {stop:?} in {text:?}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // And streamed: the same text, the stop string never sent.
    body["stream"] = json!(true);
    let r = server.post("/v1/completions", &body);
    let streamed: String = sse_events(r.text())
        .iter()
        .map(|e| e["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, expected);
}

/// A choice cut by a stop string ends in the engine like any other: its usage reports the
/// prompt tokens a stored prefix gave (it used to report 0), and the row is kept for the
/// next request. Stops common enough in English that 16 greedy tokens meet one.
#[test]
fn a_choice_ended_by_a_stop_string_reports_its_cached_prompt_tokens() {
    let server = Server::start(&["--prefix-cache", "64"]);
    let r = server.post("/v1/completions", &completion(PROMPT, 16));
    assert_eq!(r.status, 200, "{}", r.text());
    let stops = [" ", "e", "a", "\n"];
    for stream in [false, true] {
        let mut body = completion(PROMPT, 16);
        body["stop"] = json!(stops);
        body["stream"] = json!(stream);
        body["stream_options"] = json!({"include_usage": true});
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let (text, finish, usage) = if stream {
            let events = sse_events(r.text());
            let text: String = events
                .iter()
                .filter_map(|e| e["choices"][0]["text"].as_str().map(str::to_string))
                .collect();
            let finish = events.iter().find_map(|e| {
                e["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string)
            });
            let usage = events
                .last()
                .map(|e| e["usage"].clone())
                .unwrap_or_default();
            (text, finish, usage)
        } else {
            let v = r.json();
            (
                v["choices"][0]["text"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"]
                    .as_str()
                    .map(str::to_string),
                v["usage"].clone(),
            )
        };
        assert_eq!(finish.as_deref(), Some("stop"), "stream {stream}: {text:?}");
        assert!(stops.iter().all(|s| !text.contains(s)), "{text:?}");
        check_usage(&usage);
        let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
        assert!(cached.is_some_and(|c| c > 0), "stream {stream}: {usage}");
    }
}

#[test]
fn a_streamed_chat_completion_is_framed_as_openai_does() {
    let server = Server::start(&[]);
    let mut body = json!({
        "model": "x",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 12,
        "temperature": 0,
        "some_unknown_field": {"ignored": true},
    });
    let whole = server.post("/v1/chat/completions", &body);
    assert_eq!(whole.status, 200, "{}", whole.text());
    let whole = whole.json();
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    check_usage(&whole["usage"]);

    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = sse_events(r.text());
    assert!(events.len() >= 3, "{events:?}");
    let id = &events[0]["id"];
    for e in &events {
        assert_eq!(e["object"], "chat.completion.chunk");
        assert_eq!(&e["id"], id);
    }
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let (usage, chunks) = events.split_last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    check_usage(&usage["usage"]);
    assert_eq!(usage["usage"], whole["usage"]);
    let (last, middle) = chunks.split_last().unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    for e in middle {
        assert!(e["choices"][0]["finish_reason"].is_null());
        assert!(e["usage"].is_null());
    }
    let content: String = middle
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, whole["choices"][0]["message"]["content"]);

    // Without include_usage: no usage chunk.
    body["stream_options"] = json!({"include_usage": false});
    let events = sse_events(server.post("/v1/chat/completions", &body).text());
    assert!(events
        .iter()
        .all(|e| e["choices"].as_array().unwrap().len() == 1));
    assert!(events.iter().all(|e| e.get("usage").is_none()));
}

#[test]
fn four_concurrent_requests_are_all_answered() {
    let server = Server::start(&["--max-batch", "4"]);
    let prompts = [
        "Once upon a time",
        "The quick brown fox",
        "In 1492, Columbus",
        "def fibonacci(n):",
    ];
    let alone: Vec<Value> = prompts
        .iter()
        .map(|p| server.post("/v1/completions", &completion(p, 6)).json())
        .collect();
    let together: Vec<Value> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let server = &server;
                s.spawn(move || server.post("/v1/completions", &completion(p, 6)))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let r = h.join().unwrap();
                assert_eq!(r.status, 200, "{}", r.text());
                r.json()
            })
            .collect()
    });
    for (a, t) in alone.iter().zip(&together) {
        check_usage(&t["usage"]);
        assert!(t["usage"]["completion_tokens"].as_u64().unwrap() <= 6);
        assert_eq!(a["usage"]["prompt_tokens"], t["usage"]["prompt_tokens"]);
        assert!(t["choices"][0]["text"].is_string());
    }
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let server = Server::start(&[]);
    for body in [
        &b"{\"prompt\": "[..],
        b"not json",
        b"{\"prompt\": 5}",
        b"{\"prompt\": \"hi\", \"max_tokens\": -1}",
        b"{\"prompt\": \"hi\", \"temperature\": \"hot\"}",
        b"{\"max_tokens\": 3}",
        b"[]",
    ] {
        let r = server.request("POST", "/v1/completions", Some(body));
        let v = assert_error(&r, 400);
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let r = server.request("POST", "/v1/chat/completions", Some(b"{\"messages\": {}}"));
    assert_error(&r, 400);
    let r = server.post("/v1/chat/completions", &json!({"messages": []}));
    assert_error(&r, 400);

    // Past the context: 400 naming both counts.
    let r = server.post("/v1/completions", &completion(PROMPT, 1_000_000));
    let v = assert_error(&r, 400);
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("1000000"), "{message}");
    let prompt_tokens = server
        .post("/v1/completions", &completion(PROMPT, 1))
        .json()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        message.contains(&format!("({prompt_tokens} in the")),
        "{message}"
    );
    let r = server.post("/v1/completions", &completion(&"word ".repeat(40_000), 4));
    assert_error(&r, 400);

    let r = server.request("GET", "/nope", None);
    assert_error(&r, 404);

    // Still serving.
    assert_eq!(server.request("GET", "/health", None).status, 200);
    let r = server.post("/v1/completions", &completion(PROMPT, 3));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["usage"]["completion_tokens"].as_u64().unwrap() <= 3);
}

#[test]
fn a_full_queue_answers_429() {
    // One row and one waiting place: of six requests sent at once, one runs, one waits,
    // and the others are refused with an OpenAI-shaped 429.
    let server = Server::start(&["--max-batch", "1", "--max-queue", "1"]);
    let responses: Vec<Response> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..6)
            .map(|_| {
                let server = &server;
                s.spawn(move || server.post("/v1/completions", &completion(PROMPT, 16)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let statuses: Vec<u16> = responses.iter().map(|r| r.status).collect();
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(statuses.contains(&429), "{statuses:?}");
    for r in &responses {
        match r.status {
            200 => check_usage(&r.json()["usage"]),
            _ => {
                let v = assert_error(r, 429);
                assert_eq!(v["error"]["code"], "rate_limit_exceeded");
            }
        }
    }
    // And it serves again once the queue drains.
    let r = server.post("/v1/completions", &completion(PROMPT, 2));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[test]
fn a_client_that_leaves_mid_stream_frees_its_row() {
    // One row: a long stream whose client goes away must be cancelled, or the next request
    // would wait for all its tokens.
    let server = Server::start(&["--max-batch", "1"]);
    let mut body = completion(PROMPT, 20_000);
    body["stream"] = json!(true);
    let body = body.to_string();
    let mut s = server.send("POST", "/v1/completions", Some(body.as_bytes()));
    read_until_first_event(&mut s);
    drop(s);
    let t = std::time::Instant::now();
    let r = server.post("/v1/completions", &completion(PROMPT, 2));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "waited {:?}",
        t.elapsed()
    );
}

/// With `--prefix-cache`, a request sharing a long prefix with a finished one reads only the
/// rest, and says so in `usage.prompt_tokens_details.cached_tokens` (that the tokens equal a
/// run without reuse is tested in tessera-engine's continuous_batching.rs).
#[test]
fn a_shared_prefix_is_reported_as_cached() {
    let server = Server::start(&["--prefix-cache", "64"]);
    let system = "You are a careful assistant who answers in one short sentence. ".repeat(12);
    let first = server.post(
        "/v1/completions",
        &completion(&format!("{system}What is rain?"), 4),
    );
    assert_eq!(first.status, 200, "{}", first.text());
    let u = &first.json()["usage"];
    assert_eq!(
        u["prompt_tokens_details"]["cached_tokens"], 0,
        "nothing stored yet"
    );
    let second = server.post(
        "/v1/completions",
        &completion(&format!("{system}What is snow?"), 4),
    );
    assert_eq!(second.status, 200, "{}", second.text());
    let v = second.json();
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached > 100 && cached < prompt,
        "{cached} of {prompt} prompt tokens cached"
    );
    assert!(v["choices"][0]["text"].is_string());
}

/// SIGTERM: the listener closes, a stream in flight still ends with `[DONE]`, and the
/// process exits 0.
#[test]
fn sigterm_lets_the_stream_in_flight_finish_then_exits_0() {
    let mut server = Server::start(&[]);
    let mut body = completion(PROMPT, 48);
    body["stream"] = json!(true);
    let body = body.to_string();
    let mut s = server.send("POST", "/v1/completions", Some(body.as_bytes()));
    let mut seen = read_until_first_event(&mut s);
    let pid = server.child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    s.read_to_end(&mut seen).expect("the rest of the stream");
    let r = Response::parse(&seen);
    let events = sse_events(r.text());
    let last = &events[events.len() - 1]["choices"][0];
    assert!(last["finish_reason"].is_string(), "{events:?}");
    let t = std::time::Instant::now();
    let status = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status;
        }
        assert!(t.elapsed() < Duration::from_secs(40), "still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(TcpStream::connect(("127.0.0.1", server.port)).is_err());
}
