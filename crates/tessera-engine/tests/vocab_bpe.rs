//! Byte-level BPE vocabularies (Llama 3's `llama-bpe`, Qwen's `qwen2`) against llama.cpp's
//! own tokenizer tests: llama.cpp ships vocabulary-only GGUF files with an input file of
//! test strings and the token ids the models' reference tokenizers give for each
//! (models/ggml-vocab-*.gguf{,.inp,.out}). They come from the llama-cpp-python sdist on
//! PyPI, fetched once into $TESSERA_HOME/vocab.

use std::path::{Path, PathBuf};
use std::process::Command;
use tessera_models::{GgufFile, Tokenizer};

const SDIST: &str = "llama-cpp-python==0.3.36";
const VOCABS: [&str; 2] = ["ggml-vocab-llama-bpe.gguf", "ggml-vocab-qwen2.gguf"];

/// The directory holding the vocabularies and their test files, fetched if missing (once:
/// the tests of this file run on parallel threads).
fn vocab_dir() -> PathBuf {
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tessera_engine::store::tessera_home().join("vocab");
    let have = |d: &Path| {
        VOCABS.iter().all(|v| {
            ["", ".inp", ".out"]
                .iter()
                .all(|e| d.join(format!("{v}{e}")).exists())
        })
    };
    if have(&dir) {
        return dir;
    }
    let tmp = std::env::temp_dir().join(format!("tessera-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let ok = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            SDIST,
        ])
        .arg("-d")
        .arg(&tmp)
        .status()
        .expect("python3 runs")
        .success();
    assert!(ok, "pip download {SDIST} failed");
    let sdist = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with(".tar.gz"))
        .expect("the sdist");
    let mut tar = Command::new("tar");
    tar.arg("-xzf")
        .arg(&sdist)
        .arg("-C")
        .arg(&tmp)
        .arg("--wildcards");
    for v in VOCABS {
        tar.arg(format!("*/vendor/llama.cpp/models/{v}*"));
    }
    assert!(
        tar.status().expect("tar runs").success(),
        "extracting the vocabularies"
    );
    std::fs::create_dir_all(&dir).unwrap();
    let models = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .expect("the unpacked sdist")
        .join("vendor/llama.cpp/models");
    for v in VOCABS {
        for e in ["", ".inp", ".out"] {
            let name = format!("{v}{e}");
            std::fs::copy(models.join(&name), dir.join(&name)).unwrap();
        }
    }
    std::fs::remove_dir_all(&tmp).unwrap();
    assert!(have(&dir));
    dir
}

fn check(vocab: &str) {
    let dir = vocab_dir();
    let path = dir.join(vocab);
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let inputs = std::fs::read_to_string(dir.join(format!("{vocab}.inp"))).unwrap();
    let outputs = std::fs::read_to_string(dir.join(format!("{vocab}.out"))).unwrap();
    let inputs: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
    let outputs: Vec<&str> = outputs.lines().collect();
    assert!(inputs.len() > 20, "{vocab}: {} test strings", inputs.len());
    let mut failures = Vec::new();
    for (text, want) in inputs.iter().zip(&outputs) {
        let want: Vec<u32> = want
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        let got = tok.encode(text, false).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        // Decoding gives the text back (these strings hold no control tokens).
        assert_eq!(tok.decode(&got).unwrap(), *text, "{vocab}: round trip");
    }
    assert!(
        failures.is_empty(),
        "{vocab}: {} of {} differ:\n{}",
        failures.len(),
        inputs.len(),
        failures.join("\n")
    );
}

#[test]
fn llama3_bpe_matches_llama_cpp_tests() {
    check("ggml-vocab-llama-bpe.gguf");
}

#[test]
fn qwen2_bpe_matches_llama_cpp_tests() {
    check("ggml-vocab-qwen2.gguf");
}
