//! Architecture `qwen2` (Qwen 2 and 2.5) against an independent graph, candle-transformers
//! 0.11's `quantized_qwen2`, which reads the same GGUF tensors (the q/k/v biases included)
//! and runs NeoX RoPE, SiLU and plain causal attention:
//!
//! - a synthetic tiny qwen2 (random weights and biases, f32), a prompt prefilled through our
//!   cache in two chunks, then greedy decode steps: every step's logits agree;
//! - Qwen2.5-Coder-0.5B-Instruct with every matrix in f32 (ours through
//!   `LoadOptions::dequantize`; candle on a copy of the GGUF with every tensor stored as F32,
//!   which its QMatMul runs as a plain matmul, so no environment variable is needed): the
//!   logits of a short prompt and of 16 greedy steps agree, and the greedy tokens are equal;
//! - the shipped (quantized) weights generate greedy text for a coding prompt, printed;
//! - metadata the decoder cannot run (a short sliding window, a missing bias) is refused
//!   with an error naming the key or tensor.

mod common;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_qwen2::ModelWeights;
use std::io::Write;
use std::path::Path;
use tessera_engine::{argmax, Generation, SamplerConfig, Session};
use tessera_kv::KvScheme;
use tessera_models::synth::{parse_dtype, preset, write_model};
use tessera_models::{LoadOptions, LogitsMode, Model, ModelError};

/// Greedy steps compared on the real model.
const STEPS: usize = 16;

/// Largest logit difference allowed against candle on the synthetic model, as a fraction of
/// the largest logit: about twice the measured worst, 4.1e-7 (the same graph without its
/// biases lands 1.4 off).
const SYNTH_TOLERANCE: f32 = 1e-6;

/// The same on Qwen2.5-Coder-0.5B in f32, over both prompts' 16 steps: about twice the
/// measured worst, 9.2e-7 (f32 summation order and candle's f32 RoPE tables).
const REAL_TOLERANCE: f32 = 2e-6;

fn write_gguf(path: &Path, metadata: &[(&str, &gguf_file::Value)], tensors: &[(&str, &QTensor)]) {
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    gguf_file::write(&mut w, metadata, tensors).unwrap();
    w.flush().unwrap();
}

fn candle_qwen2(path: &Path) -> ModelWeights {
    let mut file = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    ModelWeights::from_gguf(content, &mut file, &Device::Cpu).unwrap()
}

/// candle's last-position logits for `tokens` at position `pos`.
fn candle_forward(m: &mut ModelWeights, tokens: &[u32], pos: usize) -> Vec<f32> {
    let x = Tensor::new(tokens, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    m.forward(&x, pos)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn tiny_qwen2(path: &Path, dtype: &str) {
    let shape = preset("qwen2", "tiny").unwrap();
    write_model(&shape, parse_dtype(dtype).unwrap(), 3, path).unwrap();
}

#[test]
fn synthetic_qwen2_matches_candle_quantized_qwen2() {
    let file = common::temp_gguf("qwen2-tiny");
    tiny_qwen2(&file.0, "f32");
    let (model, _) = Model::load(&file.0, &LoadOptions::default(), &Device::Cpu).unwrap();
    assert_eq!(model.architecture(), "qwen2");
    assert!(model
        .layer_specs()
        .iter()
        .all(|s| s.retention == tessera_kv::Retention::Full));
    let mut reference = candle_qwen2(&file.0);

    let prompt: Vec<u32> = (0..40).map(|i| 2 + (i * 37 % 500) as u32).collect();
    let scheme = KvScheme::parse("f32").unwrap();
    // Prefill chunks of 16: the prompt goes in as three appends.
    let mut session = Session::new(&model, &scheme, 16).unwrap();
    let mut ours = session.feed(&prompt).unwrap();
    let mut theirs = candle_forward(&mut reference, &prompt, 0);
    let mut worst = 0f32;
    for step in 0..12 {
        let gap = common::relative_gap(&ours, &theirs);
        worst = worst.max(gap);
        assert!(
            gap <= SYNTH_TOLERANCE,
            "step {step}: logits differ by {gap} of the largest"
        );
        assert_eq!(argmax(&ours), argmax(&theirs), "step {step}");
        let next = argmax(&ours);
        ours = session.forward(&[next], LogitsMode::Last).unwrap();
        theirs = candle_forward(&mut reference, &[next], prompt.len() + step);
    }
    println!("synthetic qwen2: worst relative logit gap {worst:e}");

    // The biases matter: the same file without them lands far from both.
    let mut f = std::fs::File::open(&file.0).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut tensors = Vec::new();
    for name in content.tensor_infos.keys() {
        let mut t = content.tensor(&mut f, name, &Device::Cpu).unwrap();
        if name.ends_with(".bias") {
            let zeros = t.dequantize(&Device::Cpu).unwrap().zeros_like().unwrap();
            t = QTensor::quantize(&zeros, GgmlDType::F32).unwrap();
        }
        tensors.push((name.clone(), t));
    }
    let unbiased = common::temp_gguf("qwen2-tiny-unbiased");
    let md: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    write_gguf(&unbiased.0, &md, &ts);
    let (model, _) = Model::load(&unbiased.0, &LoadOptions::default(), &Device::Cpu).unwrap();
    let mut session = Session::new(&model, &scheme, 16).unwrap();
    let without = session.feed(&prompt).unwrap();
    let gap = common::relative_gap(&without, &candle_forward(&mut reference, &prompt, 0));
    println!("synthetic qwen2 with zeroed biases: relative logit gap {gap}");
    assert!(
        gap > 100.0 * SYNTH_TOLERANCE,
        "zeroed biases change nothing ({gap})"
    );
}

#[test]
fn qwen2_metadata_and_tensors_are_validated() {
    let file = common::temp_gguf("qwen2-validate");
    tiny_qwen2(&file.0, "q8_0");
    let mut f = std::fs::File::open(&file.0).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let load = |extra: &[(&str, gguf_file::Value)], drop_tensor: Option<&str>| {
        let out = common::temp_gguf("qwen2-validate-variant");
        let mut md: Vec<(&str, &gguf_file::Value)> = content
            .metadata
            .iter()
            .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
            .map(|(k, v)| (k.as_str(), v))
            .collect();
        md.extend(extra.iter().map(|(k, v)| (*k, v)));
        let ts: Vec<(&str, &QTensor)> = tensors
            .iter()
            .filter(|(k, _)| Some(k.as_str()) != drop_tensor)
            .map(|(k, t)| (k.as_str(), t))
            .collect();
        write_gguf(&out.0, &md, &ts);
        Model::load(&out.0, &LoadOptions::default(), &Device::Cpu).map(|_| ())
    };
    use gguf_file::Value;
    let ctx = content.metadata["qwen2.context_length"].to_u32().unwrap();
    // A window that spans the context is the same attention; a shorter one is refused.
    load(&[("qwen2.attention.sliding_window", Value::U32(ctx))], None).unwrap();
    let e = load(
        &[("qwen2.attention.sliding_window", Value::U32(4096))],
        None,
    )
    .unwrap_err();
    assert!(
        matches!(&e, ModelError::BadMetadata { key, .. } if key == "qwen2.attention.sliding_window"),
        "{e}"
    );
    println!("{e}");
    let pattern = |b: [bool; 4]| Value::Array(b.iter().map(|&x| Value::Bool(x)).collect());
    load(
        &[(
            "qwen2.attention.sliding_window_pattern",
            pattern([false; 4]),
        )],
        None,
    )
    .unwrap();
    let e = load(
        &[(
            "qwen2.attention.sliding_window_pattern",
            pattern([true, false, true, false]),
        )],
        None,
    )
    .unwrap_err();
    assert!(
        matches!(&e, ModelError::BadMetadata { key, .. } if key == "qwen2.attention.sliding_window_pattern"),
        "{e}"
    );
    let e = load(&[("qwen2.rope.freq_base", Value::F32(-1.0))], None).unwrap_err();
    assert!(
        matches!(&e, ModelError::BadMetadata { key, .. } if key == "qwen2.rope.freq_base"),
        "{e}"
    );
    let e = load(
        &[("qwen2.attention.layer_norm_rms_epsilon", Value::F32(0.0))],
        None,
    )
    .unwrap_err();
    assert!(
        matches!(&e, ModelError::BadMetadata { key, .. } if key == "qwen2.attention.layer_norm_rms_epsilon"),
        "{e}"
    );
    let e = load(&[], Some("blk.2.attn_k.bias")).unwrap_err();
    assert!(
        matches!(&e, ModelError::MissingTensor { name } if name == "blk.2.attn_k.bias"),
        "{e}"
    );
}

/// candle-transformers' quantized_qwen2 on f32 weights: loaded from a copy of `path` with
/// every tensor stored as F32 (a temporary file, removed once loaded).
fn candle_qwen2_f32(path: &Path) -> ModelWeights {
    let tmp = common::f32_gguf_copy(path, "qwen2-f32");
    candle_qwen2(&tmp.0)
}

#[test]
fn qwen2_5_coder_f32_matches_candle_quantized_qwen2() {
    let path = common::qwen_path();
    let (model, tok) = Model::load(
        &path,
        &LoadOptions {
            dequantize: true,
            ..Default::default()
        },
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(model.architecture(), "qwen2");
    let mut reference = candle_qwen2_f32(&path);
    let scheme = KvScheme::parse("f32").unwrap();

    let prompts = ["def fibonacci(n):\n", "The capital of France is"];
    let mut worst = 0f32;
    for prompt in prompts {
        let ids = tok.encode(prompt, true).unwrap();
        // candle's greedy run, with the logits at every step.
        let mut steps: Vec<(u32, Vec<f32>)> = Vec::new();
        let mut logits = candle_forward(&mut reference, &ids, 0);
        for step in 0..STEPS {
            let next = argmax(&logits);
            steps.push((next, logits));
            logits = candle_forward(&mut reference, &[next], ids.len() + step);
        }
        let expected: Vec<u32> = steps.iter().map(|(t, _)| *t).collect();

        // Ours step by step on candle's tokens: logits close at every step.
        let mut session = Session::new(&model, &scheme, 512).unwrap();
        let mut ours = session.feed(&ids).unwrap();
        for (step, (token, theirs)) in steps.iter().enumerate() {
            let gap = common::relative_gap(&ours, theirs);
            worst = worst.max(gap);
            assert!(
                gap < REAL_TOLERANCE,
                "{prompt:?} step {step}: logits differ by {gap} of the largest"
            );
            ours = session.feed(&[*token]).unwrap();
        }

        // Ours free-running, as a user sees it: the same tokens.
        let mut session = Session::new(&model, &scheme, 512).unwrap();
        let greedy: Vec<u32> =
            Generation::new(&mut session, &ids, SamplerConfig::default(), STEPS, vec![])
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
        println!(
            "{prompt:?} -> {:?} {greedy:?}",
            tok.decode(&greedy).unwrap()
        );
        assert_eq!(
            greedy, expected,
            "{prompt:?}: greedy tokens differ from candle's"
        );
    }
    println!("qwen2.5-coder-0.5b f32: worst relative logit gap {worst:e}");
}

#[test]
fn qwen2_5_coder_shipped_weights_write_code() {
    let (model, tok) =
        Model::load(&common::qwen_path(), &LoadOptions::default(), &Device::Cpu).unwrap();
    let prompt =
        "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is a prime number.\"\"\"\n";
    let ids = tok.encode(prompt, true).unwrap();
    let mut session = Session::new(&model, &KvScheme::parse("f32").unwrap(), 512).unwrap();
    let mut stop = vec![tok.special().eos];
    stop.extend(tok.token_id("<|endoftext|>"));
    let out: Vec<u32> = Generation::new(&mut session, &ids, SamplerConfig::default(), 64, stop)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(!out.is_empty());
    println!(
        "--- greedy continuation (shipped weights) ---\n{prompt}{}",
        tok.decode(&out).unwrap()
    );
}
