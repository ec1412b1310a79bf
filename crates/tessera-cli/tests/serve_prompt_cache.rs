//! `tessera serve --prompt-cache-dir`: the prefix store's rows saved to a folder outlive
//! the process, so the first request of a new server on the folder reuses a prefix the
//! previous one kept; the flag is refused without `--prefix-cache`, or on a file, before
//! the model loads.

mod common;

use common::{completion, Server};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A folder removed when dropped, also when the test fails.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir(tag: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!(
        "tessera-serve-prompt-cache-{}-{tag}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    TempDir(dir)
}

fn tpc_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "tpc"))
        .collect()
}

/// `tessera serve` with `args`, expected to exit by itself: its status and stderr.
fn serve_exits(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .arg("serve")
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn a_prefix_kept_on_disk_is_reused_by_the_next_server() {
    let dir = tempdir("reuse");
    let d = dir.0.to_str().unwrap();
    let system = "You are a careful assistant who answers in one short sentence. ".repeat(12);
    {
        // The folder does not exist yet: the server creates it.
        let server = Server::start(&["--prefix-cache", "64", "--prompt-cache-dir", d]);
        let first = server.post(
            "/v1/completions",
            &completion(&format!("{system}What is rain?"), 4),
        );
        assert_eq!(first.status, 200, "{}", first.text());
        let u = &first.json()["usage"];
        assert_eq!(
            u["prompt_tokens_details"]["cached_tokens"], 0,
            "an empty folder"
        );
        // Saved on the engine thread before the reply went out.
        let files = tpc_files(&dir.0);
        assert_eq!(files.len(), 1, "the finished row is saved: {files:?}");
    }
    let server = Server::start(&["--prefix-cache", "64", "--prompt-cache-dir", d]);
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
        "the new process's first request: {cached} of {prompt} prompt tokens cached"
    );
    assert!(v["choices"][0]["text"].is_string());
    assert_eq!(server.metric("tessera_prefix_cache_hits_total"), 1.0);
    assert_eq!(tpc_files(&dir.0).len(), 2, "both rows kept");
}

#[test]
fn the_folder_needs_a_prefix_cache_and_must_be_a_folder() {
    // A model that does not exist: each refusal comes before loading one.
    let dir = tempdir("refused");
    let d = dir.0.to_str().unwrap();
    for extra in [&[][..], &["--prefix-cache", "0"][..]] {
        let mut args = vec!["--model", "/nonexistent/m.gguf", "--prompt-cache-dir", d];
        args.extend_from_slice(extra);
        let (code, err) = serve_exits(&args);
        assert!(code.is_some_and(|c| c != 0), "{code:?}: {err}");
        assert!(
            err.contains("--prompt-cache-dir") && err.contains("--prefix-cache"),
            "{err}"
        );
        assert!(!dir.0.exists(), "nothing is created when refused");
    }
    std::fs::create_dir_all(&dir.0).unwrap();
    let file = dir.0.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let (code, err) = serve_exits(&[
        "--model",
        "/nonexistent/m.gguf",
        "--prefix-cache",
        "64",
        "--prompt-cache-dir",
        file.to_str().unwrap(),
    ]);
    assert!(code.is_some_and(|c| c != 0), "{code:?}: {err}");
    assert!(
        err.contains("is not a folder") && err.contains("a-file"),
        "{err}"
    );
}
