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

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Barrier};
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

fn model() -> PathBuf {
    std::env::var_os("TESSERA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(tessera_engine::store::default_model_path)
}

/// A running `tessera serve`, killed (by its pid) on drop.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start(kv: &str) -> Server {
        let model = model();
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["serve", "--port", "0", "--model", model.to_str().unwrap()])
            .args(["--f32-weights", "--kv", kv, "--max-batch", "8"])
            .args(["--prefill-chunk", "16", "--max-queue", "64"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("tessera serve starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut seen = Vec::new();
        let mut server = Server { child, port: 0 };
        loop {
            match rx.recv_timeout(Duration::from_secs(180)) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("listening on http://127.0.0.1:") {
                        server.port = rest.trim().parse().expect("a port");
                        return server;
                    }
                    seen.push(line);
                }
                Err(_) => panic!("no `listening on` line; stderr: {seen:?}"),
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// POSTs `body` to `/v1/completions` on `port`; returns the status and the JSON body.
fn complete(port: u16, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("reads the response");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a header block");
    let status = std::str::from_utf8(&raw[..split])
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let json = serde_json::from_slice(&raw[split + 4..]).unwrap_or(Value::Null);
    (status, json)
}

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
    let server = Server::start(kv);
    let alone: Vec<(String, u64)> = (0..REQUESTS)
        .map(|i| {
            let (status, body) = complete(server.port, &request(i));
            reply(status, &body, i)
        })
        .collect();
    // All at once, released together, so most wait for a row and join as others leave.
    let start = Arc::new(Barrier::new(REQUESTS));
    let port = server.port;
    let handles: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                // Staggered a little so arrivals fall on different steps.
                std::thread::sleep(Duration::from_millis(15 * (i as u64 % 8)));
                complete(port, &request(i))
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (status, body) = h.join().expect("a client thread");
        let got = reply(status, &body, i);
        assert_eq!(got, alone[i], "{kv}: request {i} batched vs alone");
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
