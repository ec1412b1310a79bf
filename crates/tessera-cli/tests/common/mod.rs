//! What the CLI tests share: the binary run to completion ([`tessera`]), and for the
//! `tessera serve` tests the real binary started on 127.0.0.1 (port 0, the port read from
//! its "listening on" line) and killed by its pid on drop, and a small HTTP/1.1 client over
//! `TcpStream`.
#![allow(dead_code)] // each test binary uses its own part

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub const KEY: &str = "sk-test-key";

/// Runs the `tessera` binary with `args` to its end: exit status, stdout, stderr.
pub fn tessera(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// The default model (or `TESSERA_MODEL`).
pub fn model() -> PathBuf {
    std::env::var_os("TESSERA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(tessera_engine::store::default_model_path)
}

/// Qwen2.5-Coder-0.5B-Instruct (a byte-level vocabulary and a ChatML template of its own),
/// which `.ci/run` fetches.
pub fn qwen() -> PathBuf {
    let path = tessera_engine::store::models_dir().join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `tessera model fetch qwen2.5-coder-0.5b-instruct`",
        path.display()
    );
    path
}

/// A running `tessera serve`, killed (by its pid) on drop.
pub struct Server {
    pub child: Child,
    pub port: u16,
    /// Sent as a Bearer token where `--api-key` was given.
    pub key: Option<&'static str>,
}

impl Server {
    /// The default model with `extra` flags.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_with(&model(), extra)
    }

    pub fn start_with(model: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
            .args(["serve", "--port", "0", "--model", model.to_str().unwrap()])
            .args(extra)
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
        let key = extra.iter().position(|&a| a == "--api-key").map(|_| KEY);
        let mut server = Server {
            child,
            port: 0,
            key,
        };
        let mut seen = Vec::new();
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

    pub fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(("127.0.0.1", self.port)).expect("connects");
        s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
        s
    }

    /// Sends the request head and body with this server's key; the caller reads.
    pub fn send(&self, method: &str, path: &str, body: Option<&[u8]>) -> TcpStream {
        let auth = self.key.map(|k| format!("Bearer {k}"));
        self.send_with(method, path, body, auth.as_deref())
    }

    /// Sends with `auth` as the Authorization header (or none).
    pub fn send_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        auth: Option<&str>,
    ) -> TcpStream {
        let mut s = self.connect();
        let mut head =
            format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
        if let Some(a) = auth {
            head.push_str(&format!("Authorization: {a}\r\n"));
        }
        if let Some(b) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        if let Some(b) = body {
            s.write_all(b).unwrap();
        }
        s
    }

    pub fn request(&self, method: &str, path: &str, body: Option<&[u8]>) -> Response {
        read_response(self.send(method, path, body))
    }

    pub fn request_with(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        auth: Option<&str>,
    ) -> Response {
        read_response(self.send_with(method, path, body, auth))
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.request("POST", path, Some(body.to_string().as_bytes()))
    }

    /// `/metrics` as (sample name with labels, value) pairs.
    pub fn metrics(&self) -> Vec<(String, f64)> {
        let r = self.request("GET", "/metrics", None);
        assert_eq!(r.status, 200, "{}", r.text());
        r.text()
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| {
                let (name, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("{l:?}"));
                (
                    name.to_string(),
                    value.parse().unwrap_or_else(|_| panic!("{l:?}")),
                )
            })
            .collect()
    }

    pub fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
            .1
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn read_response(mut s: TcpStream) -> Response {
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("reads the response");
    Response::parse(&raw)
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn parse(raw: &[u8]) -> Response {
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a header block");
        let head = std::str::from_utf8(&raw[..split]).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let mut body = raw[split + 4..].to_vec();
        if headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
        {
            body = dechunk(&body);
        }
        Response {
            status,
            headers,
            body,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("UTF-8 body")
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("JSON body ({e}): {:?}", self.text()))
    }
}

/// A chunked transfer-encoded body, joined.
pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = b.windows(2).position(|w| w == b"\r\n").expect("chunk size");
        let size = std::str::from_utf8(&b[..eol]).unwrap();
        let size = usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).unwrap();
        b = &b[eol + 2..];
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// The SSE events of `body`, checked byte for byte: `data: ` + JSON + `\n\n` each, and a
/// final `data: [DONE]\n\n`.
pub fn sse_events(body: &str) -> Vec<Value> {
    assert!(body.ends_with("data: [DONE]\n\n"), "{body:?}");
    let events = &body[..body.len() - "data: [DONE]\n\n".len()];
    assert!(events.ends_with("\n\n"), "{body:?}");
    events[..events.len() - 2]
        .split("\n\n")
        .map(|e| {
            let json = e.strip_prefix("data: ").unwrap_or_else(|| panic!("{e:?}"));
            assert!(!json.contains('\n'), "one line per event: {e:?}");
            serde_json::from_str(json).unwrap_or_else(|err| panic!("{err}: {json:?}"))
        })
        .collect()
}

/// `tessera generate`'s greedy text for `prompt` with the default model (its trailing
/// newline dropped).
pub fn generate_greedy(prompt: &str, max_tokens: usize) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "generate",
            "--model",
            model().to_str().unwrap(),
            "--prompt",
            prompt,
        ])
        .args([
            "--temperature",
            "0",
            "--max-tokens",
            &max_tokens.to_string(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_suffix('\n')
        .unwrap_or_else(|| panic!("{text:?}"))
        .to_string()
}

/// Reads a streaming response until its first SSE event has arrived; returns what came.
pub fn read_until_first_event(s: &mut TcpStream) -> Vec<u8> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    seen
}

/// A greedy text completion request.
pub fn completion(prompt: &str, max_tokens: usize) -> Value {
    json!({"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
}
