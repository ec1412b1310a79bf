//! Bad input gets a clear one-line error and a non-zero exit, never a panic or a hang.

use std::path::PathBuf;
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

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tessera-cli-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn model() -> PathBuf {
    std::env::var_os("TESSERA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(tessera_engine::store::default_model_path)
}

fn assert_clean_error(code: i32, stderr: &str, needle: &str) {
    assert_eq!(code, 1, "stderr: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr}");
    assert!(stderr.contains(needle), "expected {needle:?} in {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn missing_model_file() {
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        "/nonexistent/m.gguf",
        "--prompt",
        "hi",
    ]);
    assert_clean_error(code, &err, "not found");
}

#[test]
fn corrupt_model_file() {
    let path = scratch("corrupt.gguf");
    std::fs::write(&path, b"this is not a gguf file at all, just text").unwrap();
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        path.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert_clean_error(code, &err, "not a readable GGUF");
}

#[test]
fn truncated_model_file() {
    let bytes = std::fs::read(model()).expect("default model present (tessera model fetch)");
    let path = scratch("truncated.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 3]).unwrap();
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        path.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert_clean_error(code, &err, "truncated");
    let path = scratch("header-cut.gguf");
    std::fs::write(&path, &bytes[..4096]).unwrap();
    let (code, _, err) = tessera(&["model", "info", "--model", path.to_str().unwrap()]);
    assert_clean_error(code, &err, "GGUF");
}

#[test]
fn unknown_architecture() {
    use candle_core::quantized::gguf_file::{write, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    let path = scratch("mamba.gguf");
    let t = QTensor::quantize(
        &candle_core::Tensor::zeros((4, 32), candle_core::DType::F32, &candle_core::Device::Cpu)
            .unwrap(),
        GgmlDType::F32,
    )
    .unwrap();
    let arch = Value::String("mamba".into());
    let mut f = std::fs::File::create(&path).unwrap();
    write(
        &mut f,
        &[("general.architecture", &arch)],
        &[("token_embd.weight", &t)],
    )
    .unwrap();
    drop(f);
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        path.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert_clean_error(code, &err, "unsupported model architecture `mamba`");
}

#[test]
fn unknown_kv_scheme() {
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        model().to_str().unwrap(),
        "--prompt",
        "hi",
        "--kv",
        "q3_weird",
    ]);
    assert_clean_error(code, &err, "unknown KV scheme `q3_weird`");
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        model().to_str().unwrap(),
        "--prompt",
        "hi",
        "--kv",
        "affine:7",
    ]);
    assert_clean_error(code, &err, "7 bits and group 64 is not supported");
}

#[test]
fn prompt_longer_than_context() {
    let path = scratch("long-prompt.txt");
    std::fs::write(&path, "word ".repeat(40_000)).unwrap();
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        model().to_str().unwrap(),
        "--prompt-file",
        path.to_str().unwrap(),
        "--max-tokens",
        "1",
    ]);
    assert_clean_error(code, &err, "context is 32768");
}

#[test]
fn bad_sampling_settings() {
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        model().to_str().unwrap(),
        "--prompt",
        "hi",
        "--top-p",
        "1.5",
    ]);
    assert_clean_error(code, &err, "--top-p");
}

#[test]
fn generate_streams_text_and_reports_timing() {
    let (code, out, err) = tessera(&[
        "generate",
        "--model",
        model().to_str().unwrap(),
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.trim().len() > 5, "generated text: {out:?}");
    assert!(err.contains("tok/s"), "{err}");
}

#[test]
fn eval_json_has_the_documented_shape() {
    let text = scratch("text.txt");
    let corpus = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/corpus/pride-and-prejudice.txt"),
    )
    .unwrap();
    std::fs::write(&text, corpus.chars().take(3000).collect::<String>()).unwrap();
    let (code, out, err) = tessera(&[
        "eval",
        "--model",
        model().to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--kv",
        "bf16,f32",
        "--prefill",
        "64",
        "--tokens",
        "16",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let schemes = v["schemes"].as_array().unwrap();
    assert_eq!(schemes.len(), 2);
    assert_eq!(schemes[0]["kv"], "bf16");
    assert!(schemes[0]["kl_vs_bf16"].is_null());
    assert_eq!(schemes[1]["kv"], "f32");
    assert!(schemes[1]["kl_vs_bf16"].as_f64().unwrap() >= 0.0);
    assert_eq!(schemes[1]["tokens_scored"], 16);
    let ppl = schemes[0]["ppl"].as_f64().unwrap();
    assert!(ppl > 1.0 && ppl < 200.0, "ppl {ppl}");
}

#[test]
fn kv_config_files_are_checked() {
    let model = model();
    let model = model.to_str().unwrap();
    let cfg = |name: &str, text: &str| {
        let path = scratch(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let unknown_layer = cfg(
        "far.json",
        r#"{"default": "affine:4", "layers": [{"layer": 40, "scheme": "bf16"}]}"#,
    );
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--kv-config",
        unknown_layer.to_str().unwrap(),
    ]);
    assert_clean_error(code, &err, "layer 40, but the model has 18 layers");
    let bad_json = cfg("bad.json", r#"{"default": "affine:4", "layer": []}"#);
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--kv-config",
        bad_json.to_str().unwrap(),
    ]);
    assert_clean_error(code, &err, "unknown field `layer`");
    let bad_bits = cfg(
        "bits.json",
        r#"{"default": "affine:4", "layers": [{"layer": 2, "scheme": "affine:9"}]}"#,
    );
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "hi",
        "--kv-config",
        bad_bits.to_str().unwrap(),
    ]);
    assert_clean_error(code, &err, "layer 2");
    let good = cfg(
        "good.json",
        r#"{"default": "affine:8", "layers": [{"layer": 5, "scheme": "bf16"}]}"#,
    );
    let (code, out, err) = tessera(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "4",
        "--kv-config",
        good.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.trim().is_empty());
}

#[test]
fn eval_plot_refuses_png_before_loading() {
    // A model path that does not exist: the refusal must come first.
    let (code, _, err) = tessera(&[
        "eval",
        "--model",
        "/nonexistent/m.gguf",
        "--text",
        "/nonexistent/t.txt",
        "--kv",
        "bf16,affine:4",
        "--plot",
        "out.png",
    ]);
    assert_clean_error(code, &err, "SVG only");
}

#[test]
fn unknown_or_unavailable_device() {
    let (code, _, err) = tessera(&["bench", "--device", "tpu", "--gen-tokens", "1"]);
    assert_clean_error(code, &err, "expected cpu, cuda or cuda:N");
    let (code, _, err) = tessera(&["bench", "--device", "cuda:x", "--gen-tokens", "1"]);
    assert_clean_error(code, &err, "not a GPU number");
    // CI's build has no CUDA: the error says how to get it.
    if !cfg!(feature = "cuda") {
        let (code, _, err) = tessera(&["bench", "--device", "cuda", "--gen-tokens", "1"]);
        assert_clean_error(code, &err, "--features cuda");
    }
}
