//! 32 concurrent greedy requests through the real `tessera serve`: different prompts and
//! lengths, joining a running batch of at most 8 rows as others leave (prompts read in
//! 16-token chunks between decode steps), and each reply equals the same request served
//! alone by the same server — for bf16, affine:4 and turbo:4 caches.
//!
//! Weights are dequantized to f32 (`--f32-weights`), whose decode steps multiply each row
//! on its own: with the shipped int8-activation matmuls a row's sums depend on how many
//! rows share the matmul (m = 1, m < 16 and m ≥ 16 take different kernels), and a last-bit
//! difference can flip an activation's int8 code, a quantized cache's code, and then a
//! greedy near-tie (measured in BENCHMARKS.md, "Serving"). What is tested here is the
//! batching and the caches: every reply must be the same tokens.

mod common;

use common::Server;
use serde_json::{json, Value};
use std::sync::Barrier;
use std::time::Duration;

const REQUESTS: usize = 32;

/// Our own words, cut at different places into prompts of different lengths.
const TEXT: &str = "The harbour was quiet in the early morning, and the fishing boats rocked \
    gently against the wooden pier. An old man sat on an upturned crate, mending a net with \
    quick and practised fingers, while gulls circled above the market stalls that were only \
    beginning to open. Further along the quay a baker carried trays of bread to a small cafe \
    where two students argued about a book they had both pretended to read. The tide was \
    turning, the wind had shifted to the west, and somewhere behind the hills a train whistled \
    as it left the valley for the city.";

/// Request `i`: a prompt of 6 to 66 words from its own place in `TEXT`, 2 to 12 tokens out.
fn request(i: usize) -> Value {
    let words: Vec<&str> = TEXT.split_whitespace().collect();
    let start = (i * 7) % (words.len() / 2);
    let len = 6 + (i * 13) % 61;
    let prompt = words[start..(start + len).min(words.len())].join(" ");
    json!({
        "prompt": prompt,
        "max_tokens": 2 + (i * 5) % 11,
        "temperature": 0,
    })
}

/// The reply's text and completion token count.
fn reply(status: u16, body: &Value, i: usize) -> (String, u64) {
    assert_eq!(status, 200, "request {i}: {body}");
    let text = body["choices"][0]["text"]
        .as_str()
        .expect("a text")
        .to_string();
    let tokens = body["usage"]["completion_tokens"]
        .as_u64()
        .expect("a count");
    (text, tokens)
}

fn concurrent_equals_alone(kv: &str) {
    let server = Server::start(&[
        "--f32-weights",
        "--kv",
        kv,
        "--max-batch",
        "8",
        "--prefill-chunk",
        "16",
        "--max-queue",
        "64",
    ]);
    let complete = |i: usize| {
        let r = server.post("/v1/completions", &request(i));
        reply(r.status, &r.json(), i)
    };
    let alone: Vec<(String, u64)> = (0..REQUESTS).map(complete).collect();
    // All at once, released together, so most wait for a row and join as others leave.
    let start = Barrier::new(REQUESTS);
    let batched: Vec<(String, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..REQUESTS)
            .map(|i| {
                let (start, complete) = (&start, &complete);
                s.spawn(move || {
                    start.wait();
                    // Staggered a little so arrivals fall on different steps.
                    std::thread::sleep(Duration::from_millis(15 * (i as u64 % 8)));
                    complete(i)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a client thread"))
            .collect()
    });
    for (i, got) in batched.iter().enumerate() {
        assert_eq!(got, &alone[i], "{kv}: request {i} batched vs alone");
    }
    // Every reply generated something, so the comparison compared tokens.
    assert!(alone.iter().all(|(_, n)| *n > 0), "{alone:?}");
}

#[test]
fn thirty_two_concurrent_requests_equal_each_served_alone_bf16() {
    concurrent_equals_alone("bf16");
}

#[test]
fn thirty_two_concurrent_requests_equal_each_served_alone_affine4() {
    concurrent_equals_alone("affine:4");
}

#[test]
fn thirty_two_concurrent_requests_equal_each_served_alone_turbo4() {
    concurrent_equals_alone("turbo:4");
}
