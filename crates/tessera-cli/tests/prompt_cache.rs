//! `tessera cache save` / `cache info` and `--prompt-cache` through the binary with the real
//! default model: a prompt extending the cached one reuses it and generates the cold run's
//! greedy text, and bad cache files get one clear line each.

use std::path::{Path, PathBuf};
use std::process::Command;

fn tessera(args: &[&str]) -> (i32, String, String) {
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
    let out = dir.path(name);
    let (code, stdout, err) = tessera(&[
        "cache",
        "save",
        "--model",
        &model(),
        "--prompt",
        prompt,
        "--out",
        &out,
        "--kv",
        kv,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("tokens"), "{stdout}");
    out
}

fn info_json(file: &str) -> serde_json::Value {
    let (code, stdout, err) = tessera(&["cache", "info", file, "--json"]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn a_prompt_extending_the_cache_reuses_it_and_generates_the_cold_text() {
    let dir = Scratch::new("extend");
    let question = format!("{DOCUMENT} Who is the single man?");
    for kv in ["bf16", "affine:4", "turbo:4"] {
        let file = save(&dir, &format!("{}.tpc", kv.replace(':', "_")), kv, DOCUMENT);
        let info = info_json(&file);
        let held = info["rows"][0].as_u64().unwrap() as usize;
        assert!(held > 40, "{info}");
        assert_eq!(info["architecture"], "gemma3");
        assert_eq!(info["layers"], 18);
        assert_eq!(
            info["bytes"].as_u64().unwrap(),
            std::fs::metadata(&file).unwrap().len()
        );
        // The cached prompt was read as one chunk of `held` tokens; the cold run reads the
        // same chunk first (--prefill-chunk held), so every matmul has the same shapes.
        let chunk = held.to_string();
        let run = |cache: Option<&str>| {
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
                &chunk,
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
