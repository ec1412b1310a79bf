//! `tessera kv-config auto` through the binary with the real default model: the config it
//! writes for a budget stays within it, reads back through `eval --kv-config`, and on
//! another text has less KL against bf16 than the uniform TurboQuant presets of the same
//! budget; bad arguments get one clear line.

mod common;

use common::{model, tessera};
use std::path::PathBuf;

fn corpus(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/corpus")
        .join(name)
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn an_auto_config_within_its_budget_beats_the_uniform_presets_on_another_text() {
    let out = std::env::temp_dir().join(format!("tessera-kv-auto-{}.json", std::process::id()));
    let out_s = out.to_str().unwrap().to_string();
    let m = model();
    let m = m.to_str().unwrap();
    // Small calibration (one 256-token chunk per probe) to keep the test short.
    let (code, _, stderr) = tessera(&[
        "kv-config",
        "auto",
        "--model",
        m,
        "--text",
        &corpus("pride-and-prejudice.txt"),
        "--budget",
        "4.5",
        "--ctx",
        "256",
        "--chunks",
        "1",
        "--out",
        &out_s,
    ]);
    assert_eq!(code, 0, "{stderr}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let layers = config["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 18, "{config}");
    // The widths differ between layers: the probes found the layers unequal.
    let schemes: std::collections::BTreeSet<&str> = layers
        .iter()
        .map(|l| l["scheme"].as_str().unwrap())
        .collect();
    assert!(schemes.len() > 1, "{config}");
    // Pair codebooks by default, at the widths that have one.
    assert!(schemes.iter().all(|s| s.ends_with(":pairs")), "{config}");

    let (code, stdout, stderr) = tessera(&[
        "eval",
        "--model",
        m,
        "--f32-weights",
        "--text",
        &corpus("sense-and-sensibility.txt"),
        "--ctx",
        "256",
        "--chunks",
        "3",
        "--kv",
        "turbo:5:3,turbo:4,turbo:5:3:pairs,turbo:4:pairs",
        "--kv-config",
        &out_s,
        "--json",
    ]);
    let _ = std::fs::remove_file(&out);
    assert_eq!(code, 0, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let rows = report["schemes"].as_array().unwrap();
    let (auto, uniform) = rows.split_last().unwrap();
    assert_eq!(auto["kv"].as_str(), Some(out_s.as_str()));
    let bits = auto["bits_per_element"].as_f64().unwrap();
    assert!(bits <= 4.5, "{bits} bits over the budget");
    let kl = auto["kl_vs_bf16"].as_f64().unwrap();
    for u in uniform {
        let u_kl = u["kl_vs_bf16"].as_f64().unwrap();
        assert!(u["bits_per_element"].as_f64().unwrap() <= 4.5);
        assert!(kl < u_kl, "auto {kl} against {} {u_kl}", u["kv"]);
    }
}

#[test]
fn bad_budgets_get_one_clear_line() {
    let m = model();
    let m = m.to_str().unwrap();
    let text = corpus("pride-and-prejudice.txt");
    for (budget, needle) in [("1.5", "below the smallest"), ("nan", "--budget")] {
        let (code, _, stderr) = tessera(&[
            "kv-config",
            "auto",
            "--model",
            m,
            "--text",
            &text,
            "--budget",
            budget,
            "--ctx",
            "64",
            "--chunks",
            "1",
        ]);
        assert_eq!(code, 1, "{stderr}");
        let last = stderr.trim_end().lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: ") && last.contains(needle),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
