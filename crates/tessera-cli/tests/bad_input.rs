//! Bad input gets a clear one-line error and a non-zero exit, never a panic or a hang.

mod common;

use common::tessera;

use std::path::PathBuf;

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

/// The default model's greedy continuation of "The capital of France is" (BOS first), its
/// weights loaded as the CLI loads them on the CPU: checked below against the uncached
/// reference forward as well as the CLI.
const FRANCE_GREEDY: [u32; 8] = [506, 5279, 529, 506, 2891, 529, 7001, 236761];

/// Greedy tokens after `prompt` from the model's uncached reference forward (one full pass
/// per token, explicit causal mask, no KV cache), and the tokenizer.
fn uncached_greedy(prompt: &str, n: usize) -> (Vec<u32>, tessera_models::Tokenizer) {
    use tessera_models::{LoadOptions, Model};
    let (model, tok) =
        Model::load(&model(), &LoadOptions::default(), &candle_core::Device::Cpu).unwrap();
    let Model::Decoder(decoder) = &model;
    let mut ids = tok.encode(prompt, true).unwrap();
    let start = ids.len();
    for _ in 0..n {
        let logits = decoder.forward_uncached(&ids).unwrap();
        let last: Vec<f32> = logits
            .get(0)
            .unwrap()
            .get(ids.len() - 1)
            .unwrap()
            .to_vec1()
            .unwrap();
        ids.push(tessera_engine::argmax(&last));
    }
    (ids[start..].to_vec(), tok)
}

#[test]
fn generate_streams_text_and_reports_timing() {
    let model = model();
    let generate = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            // Sampling is on by default (llama.cpp's settings); the pinned tokens are greedy.
            "--temperature",
            "0",
        ];
        args.extend_from_slice(extra);
        tessera(&args)
    };
    let (code, out, err) = generate(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("tok/s"), "{err}");
    let (reference, tok) = uncached_greedy("The capital of France is", 8);
    println!("uncached greedy: {reference:?}");
    assert_eq!(reference, FRANCE_GREEDY, "the uncached reference's tokens");
    assert_eq!(
        out,
        tok.decode(&FRANCE_GREEDY).unwrap() + "\n",
        "generated text"
    );
    assert!(err.contains("generated 8 tokens"), "{err}");
    // Waiting for each step's tokens (the GPU's default is to run ahead) decodes the same.
    let (code, waited, err) = generate(&["--no-steps-ahead"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(waited, out, "generated text with --no-steps-ahead");
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
    assert_eq!(schemes[1]["tokens_scored"], 16);
    // Measured: KL 0.00749, bf16 ppl 14.72; bounded within a factor of two either way.
    let kl = schemes[1]["kl_vs_bf16"].as_f64().unwrap();
    assert!(
        (0.0037..0.015).contains(&kl),
        "f32 vs bf16 KL {kl} (measured 0.00749)"
    );
    let ppl = schemes[0]["ppl"].as_f64().unwrap();
    assert!((7.4..29.5).contains(&ppl), "ppl {ppl} (measured 14.72)");
}

/// A tiny synthetic Llama whose vocabulary adds no BOS and has none (as byte-level BPE
/// vocabularies often do), written once per test process.
fn bos_less_model() -> PathBuf {
    use candle_core::quantized::gguf_file::{self, Value};
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let synth = scratch("tiny-llama.gguf");
        let (code, _, err) = tessera(&[
            "model",
            "synth",
            "--arch",
            "llama",
            "--preset",
            "tiny",
            "--dtype",
            "f32",
            "--out",
            synth.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let mut file = std::fs::File::open(&synth).unwrap();
        let content = gguf_file::Content::read(&mut file).unwrap();
        let mut metadata: Vec<(&str, Value)> = content
            .metadata
            .iter()
            .filter(|(k, _)| k.as_str() != "tokenizer.ggml.bos_token_id")
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        metadata.retain(|(k, _)| *k != "tokenizer.ggml.add_bos_token");
        metadata.push(("tokenizer.ggml.add_bos_token", Value::Bool(false)));
        let tensors: Vec<(&str, candle_core::quantized::QTensor)> = content
            .tensor_infos
            .keys()
            .map(|name| {
                let t = content
                    .tensor(&mut file, name, &candle_core::Device::Cpu)
                    .unwrap();
                (name.as_str(), t)
            })
            .collect();
        let path = scratch("tiny-llama-no-bos.gguf");
        let mut out = std::fs::File::create(&path).unwrap();
        let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        let ts: Vec<(&str, &candle_core::quantized::QTensor)> =
            tensors.iter().map(|(k, t)| (*k, t)).collect();
        gguf_file::write(&mut out, &md, &ts).unwrap();
        path
    })
    .clone()
}

#[test]
fn eval_refuses_texts_too_short_to_score() {
    let empty = scratch("empty.txt");
    std::fs::write(&empty, "").unwrap();
    // Without BOS, an empty text has no tokens at all.
    let no_bos = bos_less_model();
    for m in [&no_bos, &model()] {
        let have = if *m == no_bos { 0 } else { 1 };
        let (code, _, err) = tessera(&[
            "eval",
            "--model",
            m.to_str().unwrap(),
            "--text",
            empty.to_str().unwrap(),
        ]);
        assert_clean_error(
            code,
            &err,
            &format!("the text has {have} tokens; eval needs at least 2"),
        );
    }
    let text = scratch("short.txt");
    std::fs::write(&text, "a few words of text for the tiny model to read").unwrap();
    let text = text.to_str().unwrap();
    let no_bos = no_bos.to_str().unwrap();
    // A --tokens so large that prefill + tokens wraps around must not get past the check.
    let (code, _, err) = tessera(&[
        "eval",
        "--model",
        no_bos,
        "--text",
        text,
        "--prefill",
        "2",
        "--tokens",
        &usize::MAX.to_string(),
    ]);
    assert_clean_error(code, &err, "this evaluation needs at least");
    let (code, _, err) = tessera(&[
        "eval", "--model", no_bos, "--text", text, "--ctx", "4", "--chunks", "0",
    ]);
    assert_clean_error(code, &err, "--chunks must be at least 1");
    let (code, _, err) = tessera(&["eval", "--model", no_bos, "--text", text, "--ctx", "200000"]);
    assert_clean_error(
        code,
        &err,
        "--ctx 200000 is longer than the model's context of 131072",
    );
    let (code, _, err) = tessera(&[
        "generate",
        "--model",
        no_bos,
        "--prompt",
        "hi",
        "--repetition-penalty",
        "NaN",
    ]);
    assert_clean_error(code, &err, "--repetition-penalty");
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

/// `--isa` names a level or is refused; a level reaches the model and its caches (the bench
/// header says which ran).
#[test]
fn isa_levels_are_parsed_and_reach_the_run() {
    let (code, _, err) = tessera(&["generate", "--isa", "sse9", "--prompt", "hi"]);
    assert_clean_error(code, &err, "--isa \"sse9\": unknown level");
    let model = model();
    let (code, out, err) = tessera(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--isa",
        "portable",
        "--prompt-tokens",
        "8",
        "--gen-tokens",
        "2",
        "--repeat",
        "1",
    ]);
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.contains("| isa portable"), "{out}");
}
