//! `generate --spec ngram` through the binary: the summary line counts the rounds, and
//! what it cannot do yet is refused before the model loads.

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
            vec!["--spec", "ngram", "--temperature", "0.7"],
            "--temperature 0",
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
