//! Byte-level BPE vocabularies (Llama 3's `llama-bpe`, Qwen's `qwen2`) against llama.cpp's
//! own tokenizer tests: llama.cpp ships vocabulary-only GGUF files with an input file of
//! test strings and the token ids the models' reference tokenizers give for each
//! (models/ggml-vocab-*.gguf{,.inp,.out}). They come from the llama-cpp-python sdist on
//! PyPI, fetched beforehand into $TESSERA_HOME/vocab by `tessera model fetch-vocab` (`.ci/run`
//! does it): these tests only read them, and fail if they are missing.

use std::path::PathBuf;
use tessera_models::{GgufFile, Tokenizer};

/// What separates the test strings of an `.inp` file (most files also end with one).
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// The folder holding the fetched vocabularies and their test files.
fn vocab_dir() -> PathBuf {
    let dir = tessera_engine::store::tessera_home().join("vocab");
    if let Err(why) = tessera_engine::store::check_test_vocabularies(&dir) {
        panic!(
            "llama.cpp's test vocabularies are not in {} ({why}): run `{}` first (from the \
             checkout: `cargo run --release -p tessera-cli -- model fetch-vocab`)",
            dir.display(),
            tessera_engine::store::TEST_VOCAB_FETCH_COMMAND
        );
    }
    dir
}

/// The test strings of an `.inp` file, in order.
fn test_strings(text: &str) -> Vec<&str> {
    let mut strings: Vec<&str> = text.split(SEPARATOR).collect();
    if text.ends_with(SEPARATOR) {
        // The piece after the last separator is not a test string.
        strings.pop();
    }
    strings
}

fn check(vocab: &str) {
    let dir = vocab_dir();
    let path = dir.join(vocab);
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let inputs = std::fs::read_to_string(dir.join(format!("{vocab}.inp"))).unwrap();
    let outputs = std::fs::read_to_string(dir.join(format!("{vocab}.out"))).unwrap();
    let inputs = test_strings(&inputs);
    let outputs: Vec<&str> = outputs.lines().collect();
    // Every test string has its line of expected ids, and there are tests at all (the
    // comparison below zips the two).
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{vocab}: {} test strings but {} expected-output lines",
        inputs.len(),
        outputs.len()
    );
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
