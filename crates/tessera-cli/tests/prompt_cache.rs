//! `tessera cache save` / `cache info` and `--prompt-cache` through the binary with the real
//! default model: a prompt extending the cached one reuses it and generates the cold run's
//! greedy text, and bad cache files get one clear line each.

mod common;

use common::tessera;

use std::path::{Path, PathBuf};
use std::process::Command;

struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tessera-pc-cli-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).to_str().unwrap().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn model() -> String {
    std::env::var_os("TESSERA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(tessera_engine::store::default_model_path)
        .to_str()
        .unwrap()
        .to_string()
}

fn assert_clean_error(code: i32, stderr: &str, needles: &[&str]) {
    assert_eq!(code, 1, "stderr: {stderr}");
    let last = stderr.trim_end().lines().last().unwrap_or_default();
    assert!(last.starts_with("error: "), "{stderr}");
    for needle in needles {
        assert!(last.contains(needle), "expected {needle:?} in {last}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

const DOCUMENT: &str = "It is a truth universally acknowledged, that a single man in possession \
of a good fortune, must be in want of a wife. However little known the feelings or views of such \
a man may be on his first entering a neighbourhood, this truth is so well fixed in the minds of \
the surrounding families, that he is considered the rightful property of some one or other of \
their daughters.";

fn save(dir: &Scratch, name: &str, kv: &str, prompt: &str) -> String {
    save_with(dir, name, kv, prompt, &[])
}

fn save_with(dir: &Scratch, name: &str, kv: &str, prompt: &str, extra: &[&str]) -> String {
    let out = dir.path(name);
    let gguf = model();
    let mut args = vec![
        "cache", "save", "--model", &gguf, "--prompt", prompt, "--out", &out, "--kv", kv,
    ];
    args.extend_from_slice(extra);
    let (code, stdout, err) = tessera(&args);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("tokens"), "{stdout}");
    out
}

fn info_json(file: &str) -> serde_json::Value {
    let (code, stdout, err) = tessera(&["cache", "info", file, "--json"]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&stdout).unwrap()
}

/// A document longer than a quantized cache's first append (`tessera_kv::FIRST_APPEND`,
/// 512 tokens): the first chapters of the shared corpus's novel.
fn long_document() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/corpus/pride-and-prejudice.txt");
    let text = std::fs::read_to_string(&path).expect("../shared/corpus is readable");
    let start = text
        .find("It is a truth universally")
        .expect("the novel's first line");
    text[start..start + 3200].to_string()
}

/// A cached prompt that another prompt extends is reused, and the greedy text is the cold
/// run's whatever the chunk sizes (the cold run reads other chunks than the saved one).
#[test]
fn a_prompt_extending_the_cache_reuses_it_and_generates_the_cold_text() {
    let dir = Scratch::new("extend");
    let document = long_document();
    let question = format!("{document} Who is the single man?");
    for kv in ["bf16", "affine:4", "turbo:4"] {
        let file = save(
            &dir,
            &format!("{}.tpc", kv.replace(':', "_")),
            kv,
            &document,
        );
        let info = info_json(&file);
        let held = info["rows"][0].as_u64().unwrap() as usize;
        assert!(held > tessera_kv::FIRST_APPEND, "{info}");
        assert_eq!(info["architecture"], "gemma3");
        assert_eq!(info["layers"], 18);
        assert_eq!(
            info["bytes"].as_u64().unwrap(),
            std::fs::metadata(&file).unwrap().len()
        );
        let run = |cache: Option<&str>, chunk: &str| {
            let mut args = vec![
                "generate",
                "--model",
                &model(),
                "--prompt",
                &question,
                "--max-tokens",
                "16",
                "--temperature",
                "0",
                "--prefill-chunk",
                chunk,
            ]
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>();
            match cache {
                Some(f) => args.extend(["--prompt-cache".into(), f.into()]),
                None => args.extend(["--kv".into(), kv.into()]),
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, out, err) = tessera(&args);
            assert_eq!(code, 0, "{err}");
            (out, err)
        };
        let (cold, _) = run(None, "100");
        let (warm, err) = run(Some(&file), "512");
        assert!(
            err.contains(&format!("{held} tokens loaded"))
                && err.contains(&format!("{held} of the prompt's")),
            "{kv}: {err}"
        );
        assert!(
            err.contains(&format!("({held} from the prompt cache)")),
            "{err}"
        );
        assert_eq!(warm, cold, "{kv}: the greedy text");
        assert!(!cold.trim().is_empty());
    }
}

/// A quantized cache of a prompt shorter than the first append had its codec fitted on that
/// whole prompt, which no longer prompt's cold run would be: it is not reused (and the
/// line says why), so the text is still the cold run's. A bf16 one is.
#[test]
fn a_short_quantized_cache_is_not_reused() {
    let dir = Scratch::new("short");
    let question = format!("{DOCUMENT} Who is the single man?");
    for (kv, reused) in [("affine:4", false), ("bf16", true)] {
        let file = save(&dir, &format!("{}.tpc", kv.replace(':', "_")), kv, DOCUMENT);
        let held = info_json(&file)["rows"][0].as_u64().unwrap() as usize;
        let run = |cache: Option<&str>| {
            let mut args = vec![
                "generate",
                "--model",
                &model(),
                "--prompt",
                &question,
                "--max-tokens",
                "8",
                "--temperature",
                "0",
            ]
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>();
            match cache {
                Some(f) => args.extend(["--prompt-cache".into(), f.into()]),
                None => args.extend(["--kv".into(), kv.into()]),
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, out, err) = tessera(&args);
            assert_eq!(code, 0, "{err}");
            (out, err)
        };
        let (cold, _) = run(None);
        let (warm, err) = run(Some(&file));
        if reused {
            assert!(
                err.contains(&format!("{held} of the prompt's")),
                "{kv}: {err}"
            );
        } else {
            assert!(
                err.contains("0 of the prompt's")
                    && err.contains("fitted on a prompt shorter than 512"),
                "{kv}: {err}"
            );
        }
        assert_eq!(warm, cold, "{kv}: the greedy text");
    }
}

#[test]
fn cache_info_describes_the_file_without_the_model() {
    let dir = Scratch::new("info");
    let file = save(&dir, "a.tpc", "affine:4", DOCUMENT);
    let (code, out, err) = tessera(&["cache", "info", &file]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("tessera-prompt-cache version 1"), "{out}");
    assert!(
        out.contains("15 × kv:window512:bf16-first:affine:4:64"),
        "{out}"
    );
    assert!(out.contains("3 × kv:bf16-first:affine:4:64"), "{out}");
    assert!(out.contains("gemma3, 18 layers"), "{out}");
}

/// `bytes` of the good file with `f` applied, written to `name`.
fn variant(dir: &Scratch, good: &str, name: &str, f: impl Fn(&mut Vec<u8>)) -> String {
    let mut bytes = std::fs::read(good).unwrap();
    f(&mut bytes);
    let path = dir.path(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn bad_cache_files_get_one_clear_line() {
    let dir = Scratch::new("bad");
    let good = save(&dir, "good.tpc", "affine:4", DOCUMENT);
    let header =
        u64::from_le_bytes(std::fs::read(&good).unwrap()[..8].try_into().unwrap()) as usize;
    let flipped = variant(&dir, &good, "flipped.tpc", |b| {
        let at = b.len() - 1000;
        b[at] ^= 0x10;
    });
    let truncated = variant(&dir, &good, "truncated.tpc", |b| b.truncate(b.len() / 2));
    let header_cut = variant(&dir, &good, "header.tpc", |b| b.truncate(8 + header / 2));
    let text = dir.path("text.tpc");
    std::fs::write(&text, "this is not a prompt cache").unwrap();
    let missing = dir.path("missing.tpc");
    let gguf = model();
    let generate = |file: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            &gguf,
            "--prompt",
            "Hello",
            "--max-tokens",
            "2",
            "--prompt-cache",
            file,
        ];
        args.extend_from_slice(extra);
        tessera(&args)
    };
    let cases: Vec<(&str, Vec<&str>, Vec<&str>)> = vec![
        (&flipped, vec![], vec!["flipped.tpc", "checksum mismatch"]),
        (&truncated, vec![], vec!["truncated.tpc", "truncated"]),
        (
            &header_cut,
            vec![],
            vec!["header.tpc", "not a valid safetensors file"],
        ),
        (&text, vec![], vec!["text.tpc"]),
        (&missing, vec![], vec!["missing.tpc", "No such file"]),
        // Another scheme than the file's, named explicitly.
        (
            &good,
            vec!["--kv", "turbo:4"],
            vec!["layer 0 signature", "turbo:4:4"],
        ),
        (
            &good,
            vec!["--kv", "affine:4", "--kv-start", "64"],
            vec!["quantized_kv_start"],
        ),
    ];
    for (file, extra, needles) in cases {
        let (code, _, err) = generate(file, &extra);
        assert_clean_error(code, &err, &needles);
    }
    for file in [&truncated, &header_cut, &text] {
        let (code, _, err) = tessera(&["cache", "info", file]);
        assert_clean_error(code, &err, &["prompt cache"]);
    }
    // A cache from another model of the same architecture.
    let tiny = dir.path("tiny.gguf");
    let (code, _, err) = tessera(&["model", "synth", "--preset", "tiny", "--out", &tiny]);
    assert_eq!(code, 0, "{err}");
    let other = dir.path("tiny.tpc");
    let (code, _, err) = tessera(&[
        "cache", "save", "--model", &tiny, "--prompt", "a b c d", "--out", &other,
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = generate(&other, &[]);
    assert_clean_error(code, &err, &["tiny.tpc", "model layers"]);
    // An --out that cannot be written is refused before the model loads.
    let (code, _, err) = tessera(&[
        "cache",
        "save",
        "--prompt",
        "x",
        "--out",
        "/nonexistent/dir/c.tpc",
    ]);
    assert_clean_error(code, &err, &["no directory /nonexistent/dir"]);
    assert!(Path::new(&good).exists());
}

/// `eval --prompt-cache` scores the tokens after the prefix the text shares with the cache;
/// its perplexity is the cold decode regime's from the same point within 0.5% (the cached
/// prompt's last token is read again as a decode step, the cold run reads it in its chunk;
/// f32 weights, so that this shape change is not amplified by int8 activation rounding).
#[test]
fn eval_from_a_prompt_cache_matches_the_cold_decode_regime() {
    let dir = Scratch::new("eval");
    let file = save_with(&dir, "doc.tpc", "bf16", DOCUMENT, &["--f32-weights"]);
    let held = info_json(&file)["rows"][0].as_u64().unwrap();
    let text = dir.path("text.txt");
    std::fs::write(
        &text,
        format!("{DOCUMENT} Mr. Bennet replied that he had not, and his wife went on to tell him everything Mrs. Long had said about the young man."),
    )
    .unwrap();
    let model_path = model();
    let run = |args: &[&str]| {
        let mut all = vec![
            "eval",
            "--model",
            &model_path,
            "--text",
            &text,
            "--json",
            "--f32-weights",
        ];
        all.extend_from_slice(args);
        let (code, out, err) = tessera(&all);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let cached = run(&["--prompt-cache", &file, "--tokens", "16"]);
    assert_eq!(cached["cached_tokens"], held - 1);
    assert_eq!(cached["tokens_scored"], 16);
    let held_s = held.to_string();
    let cold = run(&["--prefill", &held_s, "--tokens", "16"]);
    let cold = &cold["schemes"][0];
    assert_eq!(cold["tokens_scored"], 16);
    let (a, b) = (
        cached["ppl"].as_f64().unwrap(),
        cold["ppl"].as_f64().unwrap(),
    );
    assert!((a - b).abs() / b < 0.005, "cached {a}, cold {b}");
    // A list of schemes is refused: a prompt cache has one.
    let (code, _, err) = tessera(&[
        "eval",
        "--model",
        &model_path,
        "--text",
        &text,
        "--prompt-cache",
        &file,
        "--kv",
        "bf16,affine:4",
    ]);
    assert_clean_error(code, &err, &["at most one --kv"]);
}

#[test]
fn bench_times_the_first_token_from_the_cache_and_cold() {
    let dir = Scratch::new("bench");
    let file = save(&dir, "doc.tpc", "turbo:4", &long_document());
    let held = info_json(&file)["rows"][0].as_u64().unwrap();
    let (code, out, err) = tessera(&[
        "bench",
        "--model",
        &model(),
        "--prompt-cache",
        &file,
        "--suffix-tokens",
        "4",
        "--repeat",
        "1",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["reused_tokens"], held);
    assert_eq!(v["prompt_tokens"], held + 4);
    assert_eq!(v["first_token_agrees"], true);
    assert_eq!(
        v["file_bytes"].as_u64().unwrap(),
        std::fs::metadata(&file).unwrap().len()
    );
    for key in ["ttft_cached_s", "ttft_cold_s", "load_s", "load_gb_s"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
}

/// `chat --prompt-cache` starts the conversation from the file, and `/reset` returns to it:
/// the same first turn gets the same greedy reply both times.
#[test]
fn chat_starts_from_the_cache_and_reset_returns_to_it() {
    use std::io::Write;
    let dir = Scratch::new("chat");
    let file = save(&dir, "doc.tpc", "affine:4", DOCUMENT);
    let mut child = Command::new(env!("CARGO_BIN_EXE_tessera"))
        .args([
            "chat",
            "--model",
            &model(),
            "--prompt-cache",
            &file,
            "--temperature",
            "0",
            "--max-tokens",
            "8",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Who wants a wife?\n/reset\nWho wants a wife?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("doc.tpc") && stderr.contains("tokens"),
        "{stderr}"
    );
    let replies: Vec<&str> = stdout
        .split("> ")
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .collect();
    assert_eq!(replies.len(), 2, "{stdout}");
    assert_eq!(replies[0], replies[1], "{stdout}");
}
