//! `generate --spec ngram` and `--draft-model` through the binary: the summary line counts
//! the rounds, sampling speculates too, a draft model of another vocabulary is refused,
//! and bad flags are refused before the model loads.

mod common;

use common::tessera;

fn model() -> String {
    tessera_engine::store::default_model_path()
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn ngram_speculation_reports_its_rounds() {
    let prompt = "one two three four five six seven eight nine ten. ".repeat(8);
    let (code, out, err) = tessera(&[
        "generate",
        "--model",
        &model(),
        "--prompt",
        &prompt,
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--spec",
        "ngram:2",
        "--draft-tokens",
        "5",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.trim().is_empty());
    let line = err.lines().last().unwrap_or_default();
    assert!(line.contains("generated 24 tokens"), "{line}");
    assert!(
        line.contains("spec ngram:2:") && line.contains("accepted"),
        "{line}"
    );
    // The prompt repeats one line: drafts of it are made, and some are accepted (how many
    // depends on how well the base model keeps counting; tessera-engine's speculative.rs
    // pins exactness and acceptance on a copying prompt).
    let accepted: usize = line
        .split(" accepted")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(accepted >= 1, "{line}");
}

#[test]
fn what_speculation_cannot_do_is_refused_with_the_flag_named() {
    for (args, needle) in [
        (
            vec!["--spec", "ngram", "--draft-model", "x.gguf"],
            "--draft-model",
        ),
        (
            vec!["--spec", "ngram", "--draft-tokens", "65"],
            "--draft-tokens",
        ),
        (
            vec!["--spec", "draft", "--temperature", "0"],
            "--spec draft",
        ),
        (vec!["--spec", "ngram:0", "--temperature", "0"], "N must be"),
        (
            vec![
                "--spec",
                "ngram",
                "--draft-tokens",
                "0",
                "--temperature",
                "0",
            ],
            "--draft-tokens",
        ),
    ] {
        let mut all = vec!["generate", "--model", "/nonexistent.gguf", "--prompt", "hi"];
        all.extend(args);
        let (code, _, err) = tessera(&all);
        assert_eq!(code, 1, "{err}");
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{needle}: {err}"
        );
        assert!(
            !err.contains("not found"),
            "refused before the model loads: {err}"
        );
    }
}

/// The last stderr line of a generate run with `args`, which must succeed.
fn summary(args: &[&str]) -> (String, String) {
    let model = model();
    let mut all = vec!["generate", "--model", model.as_str()];
    all.extend_from_slice(args);
    let (code, out, err) = tessera(&all);
    assert_eq!(code, 0, "{err}");
    (out, err.lines().last().unwrap_or_default().to_string())
}

#[test]
fn sampling_and_a_draft_model_speculate_and_report() {
    let prompt = "one two three four five six seven eight nine ten. ".repeat(8);
    // Sampling: the rejection rule keeps some drafts (the line repeats).
    let (out, line) = summary(&[
        "--prompt",
        &prompt,
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--max-tokens",
        "24",
        "--spec",
        "ngram",
    ]);
    assert!(!out.trim().is_empty());
    assert!(
        line.contains("generated 24 tokens") && line.contains("spec ngram:3:"),
        "{line}"
    );
    // The model drafting for itself: every draft holds.
    let (_, line) = summary(&[
        "--prompt",
        &prompt,
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--draft-model",
        &model(),
        "--draft-tokens",
        "4",
    ]);
    assert!(line.contains("spec draft gemma-3-270m"), "{line}");
    assert!(
        line.contains("(100%)") && line.contains("accepted by position % [100 100 100 100]"),
        "{line}"
    );
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused() {
    let qwen = common::qwen();
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        &model(),
        "--prompt",
        "hi",
        "--draft-model",
        qwen.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("--draft-model") && err.contains("vocabulary"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
