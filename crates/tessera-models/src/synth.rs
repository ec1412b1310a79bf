//! `tessera model synth`: GGUF files with random weights in a real architecture's shapes,
//! so speed and memory can be measured at the sizes users run without downloading them
//! (the device machine reaches no network, and one call carries at most 64 MiB). The
//! weights are uniform with unit-variance outputs per layer, the vocabulary is synthetic
//! (controls, the 256 byte tokens, then placeholder pieces), and everything the loader
//! and tokenizer read is there, so the file runs through the whole engine.

use crate::ModelError;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::path::Path;

/// The shapes of one Gemma 3 model size (from the published configurations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemma3Shape {
    pub name: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub sliding_window: usize,
}

const fn gemma3(
    name: &'static str,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
) -> Gemma3Shape {
    Gemma3Shape {
        name,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        ffn,
        vocab: 262_144,
        sliding_window: 512,
    }
}

/// Gemma 3 sizes, 270M to 27B; `tiny` is for tests.
pub const GEMMA3_PRESETS: &[Gemma3Shape] = &[
    Gemma3Shape {
        name: "tiny",
        hidden: 64,
        layers: 6,
        heads: 2,
        kv_heads: 1,
        head_dim: 32,
        ffn: 128,
        vocab: 512,
        sliding_window: 16,
    },
    gemma3("gemma3-270m", 640, 18, 4, 1, 256, 2048),
    gemma3("gemma3-1b", 1152, 26, 4, 1, 256, 6912),
    gemma3("gemma3-4b", 2560, 34, 8, 4, 256, 10240),
    gemma3("gemma3-12b", 3840, 48, 16, 8, 256, 15360),
    gemma3("gemma3-27b", 5376, 62, 32, 16, 128, 21504),
];

/// Architectures `synth` knows; only those the engine loads can be written.
pub const SYNTH_ARCHITECTURES: &str = "gemma3";

/// The preset `name` of `arch`, or an error listing what exists.
pub fn preset(arch: &str, name: &str) -> Result<Gemma3Shape, ModelError> {
    if arch != "gemma3" {
        return Err(ModelError::Synth(format!(
            "architecture `{arch}`: synth writes {SYNTH_ARCHITECTURES} (the architectures this \
             engine loads; llama and qwen3 shapes come with their loaders)"
        )));
    }
    GEMMA3_PRESETS
        .iter()
        .find(|p| p.name == name)
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = GEMMA3_PRESETS.iter().map(|p| p.name).collect();
            ModelError::Synth(format!(
                "unknown preset `{name}` for gemma3 (have: {})",
                names.join(", ")
            ))
        })
}

/// Weight storage types synth writes.
pub fn parse_dtype(name: &str) -> Result<GgmlDType, ModelError> {
    match name.to_ascii_lowercase().as_str() {
        "q8_0" => Ok(GgmlDType::Q8_0),
        "q4_0" => Ok(GgmlDType::Q4_0),
        "f16" => Ok(GgmlDType::F16),
        "f32" => Ok(GgmlDType::F32),
        _ => Err(ModelError::Synth(format!(
            "weight type `{name}`: synth writes q8_0, q4_0, f16 or f32"
        ))),
    }
}

impl Gemma3Shape {
    /// Parameters, embeddings included.
    pub fn parameters(&self) -> usize {
        let attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads);
        let mlp = 3 * self.hidden * self.ffn;
        let norms = 4 * self.hidden + 2 * self.head_dim;
        self.vocab * self.hidden + self.layers * (attn + mlp + norms) + self.hidden
    }
}

/// Uniform values in ±√3·`std` (so of standard deviation `std`), from a seeded stream.
fn uniform(shape: (usize, usize), std: f32, seed: &mut u64) -> Result<Tensor, ModelError> {
    let n = shape.0 * shape.1;
    let a = std * 3f32.sqrt();
    let data: Vec<f32> = (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
        })
        .collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// The synthetic vocabulary: `(tokens, scores, types)` in the SentencePiece GGUF form.
fn vocabulary(size: usize) -> (Vec<String>, Vec<f32>, Vec<i32>) {
    const NORMAL: i32 = 1;
    const UNKNOWN: i32 = 2;
    const CONTROL: i32 = 3;
    const BYTE: i32 = 6;
    let mut tokens = vec![
        "<pad>".to_string(),
        "<eos>".into(),
        "<bos>".into(),
        "<unk>".into(),
    ];
    let mut types = vec![CONTROL, CONTROL, CONTROL, UNKNOWN];
    tokens.extend(["<start_of_turn>".to_string(), "<end_of_turn>".into()]);
    types.extend([CONTROL, CONTROL]);
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(BYTE);
    }
    let mut i = 0;
    while tokens.len() < size {
        tokens.push(format!("\u{2581}w{i}"));
        types.push(NORMAL);
        i += 1;
    }
    tokens.truncate(size);
    types.truncate(size);
    let scores = (0..size).map(|i| -(i as f32)).collect();
    (tokens, scores, types)
}

/// Writes a Gemma 3 GGUF of `shape` with random weights stored as `dtype` to `out`.
pub fn write_gemma3(
    shape: &Gemma3Shape,
    dtype: GgmlDType,
    seed: u64,
    out: &Path,
) -> Result<(), ModelError> {
    if shape.vocab < 262 + 16 {
        return Err(ModelError::Synth(format!(
            "vocabulary of {} is too small for the control and byte tokens",
            shape.vocab
        )));
    }
    let mut seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let s = *shape;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut matrix =
        |name: String, rows: usize, cols: usize, seed: &mut u64| -> Result<(), ModelError> {
            let t = uniform((rows, cols), 1.0 / (cols as f32).sqrt(), seed)?;
            tensors.push((name, QTensor::quantize(&t, dtype)?));
            Ok(())
        };
    matrix("token_embd.weight".into(), s.vocab, s.hidden, &mut seed)?;
    let mut norms: Vec<(String, usize)> = vec![("output_norm.weight".into(), s.hidden)];
    for i in 0..s.layers {
        let p = |x: &str| format!("blk.{i}.{x}.weight");
        matrix(p("attn_q"), s.heads * s.head_dim, s.hidden, &mut seed)?;
        matrix(p("attn_k"), s.kv_heads * s.head_dim, s.hidden, &mut seed)?;
        matrix(p("attn_v"), s.kv_heads * s.head_dim, s.hidden, &mut seed)?;
        matrix(p("attn_output"), s.hidden, s.heads * s.head_dim, &mut seed)?;
        matrix(p("ffn_gate"), s.ffn, s.hidden, &mut seed)?;
        matrix(p("ffn_up"), s.ffn, s.hidden, &mut seed)?;
        matrix(p("ffn_down"), s.hidden, s.ffn, &mut seed)?;
        for (n, dim) in [
            ("attn_norm", s.hidden),
            ("post_attention_norm", s.hidden),
            ("ffn_norm", s.hidden),
            ("post_ffw_norm", s.hidden),
            ("attn_q_norm", s.head_dim),
            ("attn_k_norm", s.head_dim),
        ] {
            norms.push((p(n), dim));
        }
    }
    for (name, dim) in norms {
        let ones = Tensor::ones(dim, candle_core::DType::F32, &Device::Cpu)?;
        tensors.push((name, QTensor::quantize(&ones, GgmlDType::F32)?));
    }

    use gguf_file::Value;
    let (tokens, scores, types) = vocabulary(s.vocab);
    let u = |x: usize| Value::U32(x as u32);
    let metadata: Vec<(String, Value)> = vec![
        (
            "general.architecture".into(),
            Value::String("gemma3".into()),
        ),
        (
            "general.name".into(),
            Value::String(format!("synthetic {}", s.name)),
        ),
        ("gemma3.embedding_length".into(), u(s.hidden)),
        ("gemma3.block_count".into(), u(s.layers)),
        ("gemma3.attention.head_count".into(), u(s.heads)),
        ("gemma3.attention.head_count_kv".into(), u(s.kv_heads)),
        ("gemma3.attention.key_length".into(), u(s.head_dim)),
        ("gemma3.attention.value_length".into(), u(s.head_dim)),
        ("gemma3.feed_forward_length".into(), u(s.ffn)),
        ("gemma3.context_length".into(), u(131_072)),
        (
            "gemma3.attention.sliding_window".into(),
            u(s.sliding_window),
        ),
        (
            "gemma3.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-6),
        ),
        ("gemma3.rope.freq_base".into(), Value::F32(1_000_000.0)),
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.scores".into(),
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), u(2)),
        ("tokenizer.ggml.eos_token_id".into(), u(1)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
    ];
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tmp = out.with_extension("gguf.partial");
    let file = std::fs::File::create(&tmp)
        .map_err(|e| ModelError::Synth(format!("{}: {e}", tmp.display())))?;
    let mut w = std::io::BufWriter::new(file);
    gguf_file::write(&mut w, &md, &ts)?;
    use std::io::Write;
    w.flush()
        .map_err(|e| ModelError::Synth(format!("{}: {e}", tmp.display())))?;
    drop(w);
    // Written whole or not at all: a partial file never carries the final name.
    std::fs::rename(&tmp, out).map_err(|e| ModelError::Synth(format!("{}: {e}", out.display())))?;
    Ok(())
}
