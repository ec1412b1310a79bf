//! Every vocabulary llama.cpp tests its tokenizers with, against those tests: llama.cpp ships
//! vocabulary-only GGUF files (models/ggml-vocab-*.gguf) with an input file of test strings
//! and the token ids the models' reference (Hugging Face) tokenizers give for each
//! (`.gguf.inp`, `.gguf.out`). They come from the llama-cpp-python sdist on PyPI, fetched
//! beforehand into $TESSERA_HOME/vocab by `tessera model fetch-vocab` (`.ci/run` does it):
//! these tests only read them, and fail if they are missing.
//!
//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) vocabularies are found in the folder,
//! so each one fetched is tested, whatever its `tokenizer.ggml.pre`; SentencePiece
//! (`"llama"`) ones likewise. Not tested, as this build does not read them:
//! - `bert` (bert-bge): WordPiece (WPM);
//! - `t5` (nomic-bert-moe): Unigram (UGM), with a precompiled normalizer charmap;
//! - `gemma4` (gemma-4): BPE over raw UTF-8 with `▁` spaces and `<0xNN>` byte tokens, not
//!   the byte alphabet.
//!
//! (Vocabularies without test files, such as aquila, baichuan and gpt-neox, only load.)

use candle_core::quantized::gguf_file::{self, Content, Value};
use std::path::{Path, PathBuf};
use tessera_models::{GgufFile, ModelError, Tokenizer};

/// What separates the test strings of an `.inp` file (most files also end with one).
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// Byte-level vocabularies the folder must hold (with their test files).
const BYTE_LEVEL: [&str; 10] = [
    "llama-bpe",
    "qwen2",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "gpt-2",
    "mpt",
];

/// SentencePiece vocabularies the folder must hold (with their test files).
const SENTENCEPIECE: [&str; 2] = ["llama-spm", "phi-3"];

/// Tokenizer models this build does not read, and why.
const UNSUPPORTED: [(&str, &str); 3] = [
    ("bert", "WordPiece"),
    ("t5", "Unigram"),
    ("gemma4", "BPE over raw UTF-8"),
];

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

/// The vocabularies in `dir` (`ggml-vocab-NAME.gguf`: NAME) whose tokenizer model is
/// `model`, with whether each has its two test files.
fn vocabularies(dir: &Path, model: &str) -> Vec<(String, bool)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let file = entry.unwrap().file_name().into_string().unwrap();
        let Some(name) = file
            .strip_prefix("ggml-vocab-")
            .and_then(|f| f.strip_suffix(".gguf"))
        else {
            continue;
        };
        let gguf = GgufFile::open(&dir.join(&file)).unwrap();
        let kind = gguf.string("tokenizer.ggml.model").unwrap();
        if kind == model {
            let tested = ["inp", "out"]
                .iter()
                .all(|ext| dir.join(format!("{file}.{ext}")).exists());
            found.push((name.to_string(), tested));
        } else if !["gpt2", "llama"].contains(&kind.as_str()) {
            assert!(
                UNSUPPORTED.iter().any(|(m, _)| *m == kind),
                "{file}: tokenizer model `{kind}` is neither tested nor listed as unsupported"
            );
        }
    }
    found.sort();
    found
}

/// Runs the tests of `ggml-vocab-{name}.gguf`: (test strings, those that differ, described).
fn check(dir: &Path, name: &str) -> (usize, Vec<String>) {
    let file = format!("ggml-vocab-{name}.gguf");
    let gguf = GgufFile::open(&dir.join(&file)).unwrap();
    let tok = Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{file}: {e}"));
    // SentencePiece text gains a leading space (llama.cpp's default, and the reference
    // tokenizers'), which decoding keeps.
    let prefix = if gguf.string("tokenizer.ggml.model").unwrap() == "llama"
        && gguf.bool_or("tokenizer.ggml.add_space_prefix", true)
    {
        " "
    } else {
        ""
    };
    let inputs = std::fs::read_to_string(dir.join(format!("{file}.inp"))).unwrap();
    let outputs = std::fs::read_to_string(dir.join(format!("{file}.out"))).unwrap();
    let inputs = test_strings(&inputs);
    let outputs: Vec<&str> = outputs.lines().collect();
    // Every test string has its line of expected ids, and there are tests at all (the
    // comparison below zips the two).
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{file}: {} test strings but {} expected-output lines",
        inputs.len(),
        outputs.len()
    );
    assert!(!inputs.is_empty(), "{file}: no test strings");
    let mut failures = Vec::new();
    for (text, want) in inputs.iter().zip(&outputs) {
        let want: Vec<u32> = want
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        // Without BOS, as llama.cpp's test-tokenizer-0 (and the reference's
        // `add_special_tokens=False`).
        let got = tok.encode(text, false).unwrap();
        if got != want {
            failures.push(format!("{name}: {text:?}: got {got:?}, want {want:?}"));
        } else {
            // Decoding gives the text back (these strings hold no control tokens).
            let back = tok.decode(&got).unwrap();
            // (An empty text is no tokens, with no prefix.)
            let prefix = if text.is_empty() { "" } else { prefix };
            if back != format!("{prefix}{text}") {
                failures.push(format!("{name}: {text:?} decodes to {back:?}"));
            }
        }
    }
    (inputs.len(), failures)
}

/// Runs every tested vocabulary of `model` in the folder; `required` must be among them.
fn check_all(model: &str, required: &[&str]) {
    let dir = vocab_dir();
    let found = vocabularies(&dir, model);
    let tested: Vec<&str> = found
        .iter()
        .filter(|(_, t)| *t)
        .map(|(n, _)| n.as_str())
        .collect();
    for name in required {
        assert!(
            tested.contains(name),
            "ggml-vocab-{name}.gguf (tokenizer model `{model}`, with .inp and .out) is not in \
             {}: run `{}` again (the fetch holds: {tested:?})",
            dir.display(),
            tessera_engine::store::TEST_VOCAB_FETCH_COMMAND
        );
    }
    let mut failures = Vec::new();
    for (name, has_tests) in &found {
        if !has_tests {
            // No test strings: the vocabulary loads and tokenizes.
            let file = dir.join(format!("ggml-vocab-{name}.gguf"));
            let tok = Tokenizer::from_gguf(&GgufFile::open(&file).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            assert!(!tok.encode("Hello world 123", false).unwrap().is_empty());
            eprintln!("{name}: loads (no test strings)");
            continue;
        }
        let (count, failed) = check(&dir, name);
        eprintln!("{name}: {} of {count} match", count - failed.len());
        failures.extend(failed);
    }
    assert!(
        failures.is_empty(),
        "{} test strings differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_byte_level_vocabulary_matches_llama_cpp_tests() {
    check_all("gpt2", &BYTE_LEVEL);
}

#[test]
fn every_sentencepiece_vocabulary_matches_llama_cpp_tests() {
    check_all("llama", &SENTENCEPIECE);
}

/// `src` rewritten to `dst` with `edit` applied to its metadata (and its tensors, if any,
/// copied as they are).
fn rewrite(src: &Path, dst: &Path, edit: impl FnOnce(&mut Vec<(String, Value)>)) {
    let mut file = std::fs::File::open(src).unwrap();
    let content = Content::read(&mut file).unwrap();
    let mut md: Vec<(String, Value)> = content.metadata.clone().into_iter().collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let ts: Vec<(String, _)> = names
        .into_iter()
        .map(|n| {
            let t = content
                .tensor(&mut file, n, &candle_core::Device::Cpu)
                .unwrap();
            (n.clone(), t)
        })
        .collect();
    edit(&mut md);
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, _)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut w = std::io::BufWriter::new(std::fs::File::create(dst).unwrap());
    gguf_file::write(&mut w, &md, &ts).unwrap();
}

#[test]
fn an_unknown_pre_tokenizer_is_a_one_line_error_naming_it() {
    let dir = vocab_dir();
    let tmp = std::env::temp_dir().join(format!("tessera-pretok-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for (pre, shown, reason) in [
        ("no-such-pre", "no-such-pre", "does not name it"),
        ("two\nlines", "two\\nlines", "does not name it"),
        ("gemma4", "gemma4", "raw UTF-8"),
    ] {
        let dst = tmp.join("vocab.gguf");
        rewrite(&dir.join("ggml-vocab-gpt-2.gguf"), &dst, |md| {
            md.retain(|(k, _)| k != "tokenizer.ggml.pre");
            md.push(("tokenizer.ggml.pre".into(), Value::String(pre.into())));
        });
        let e = Tokenizer::from_gguf(&GgufFile::open(&dst).unwrap())
            .err()
            .unwrap_or_else(|| panic!("`{pre}` loaded"));
        assert!(
            matches!(&e, ModelError::UnknownPreTokenizer { pre: p, .. } if p == pre),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("pre-tokenizer `{shown}`")) && msg.contains(reason),
            "{msg}"
        );
        assert!(!msg.contains('\n'), "not one line: {msg:?}");
    }
    // The same file with its own `gpt-2` loads.
    let dst = tmp.join("vocab.gguf");
    rewrite(&dir.join("ggml-vocab-gpt-2.gguf"), &dst, |_| {});
    Tokenizer::from_gguf(&GgufFile::open(&dst).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&tmp);
}
