//! `tessera model synth`: GGUF files with random weights in a real architecture's shapes,
//! so speed and memory can be measured at the sizes users run without downloading them
//! (the device machine reaches no network, and one call carries at most 64 MiB). The
//! weights are uniform with unit-variance outputs per layer, the vocabulary is synthetic
//! (controls, the 256 byte tokens, then placeholder pieces), and everything the loader
//! and tokenizer read is there, so the file runs through the whole engine.

use crate::decoder::Arch;
use crate::ModelError;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::path::Path;

/// The shapes of one model size (from the published configurations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthShape {
    pub arch: Arch,
    pub name: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    /// Gemma 3's sliding window (unused by the others).
    pub sliding_window: usize,
}

#[allow(clippy::too_many_arguments)]
const fn shape(
    arch: Arch,
    name: &'static str,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
) -> SynthShape {
    SynthShape {
        arch,
        name,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        ffn,
        vocab,
        sliding_window: 512,
    }
}

const G: Arch = Arch::Gemma3;
const L: Arch = Arch::Llama;
const Q: Arch = Arch::Qwen3;
const Q2: Arch = Arch::Qwen2;

/// Gemma 3 (270M to 27B), Llama 3.x (1B to 70B), Qwen 2.5 (0.5B to 7B) and Qwen 3 (0.6B
/// to 32B) sizes; each architecture's `tiny` is for tests.
pub const PRESETS: &[SynthShape] = &[
    SynthShape {
        sliding_window: 16,
        ..shape(G, "tiny", 64, 6, 2, 1, 32, 128, 512)
    },
    shape(G, "gemma3-270m", 640, 18, 4, 1, 256, 2048, 262_144),
    shape(G, "gemma3-1b", 1152, 26, 4, 1, 256, 6912, 262_144),
    shape(G, "gemma3-4b", 2560, 34, 8, 4, 256, 10240, 262_144),
    shape(G, "gemma3-12b", 3840, 48, 16, 8, 256, 15360, 262_144),
    shape(G, "gemma3-27b", 5376, 62, 32, 16, 128, 21504, 262_144),
    shape(L, "tiny", 64, 4, 4, 2, 16, 128, 512),
    // Every matrix width a multiple of 256, the K-quants' block: for every weight type.
    shape(L, "tiny-256", 256, 2, 4, 2, 64, 512, 512),
    shape(L, "llama3.2-1b", 2048, 16, 32, 8, 64, 8192, 128_256),
    shape(L, "llama3.2-3b", 3072, 28, 24, 8, 128, 8192, 128_256),
    shape(L, "llama3-8b", 4096, 32, 32, 8, 128, 14336, 128_256),
    shape(L, "llama3-70b", 8192, 80, 64, 8, 128, 28672, 128_256),
    shape(Q2, "tiny", 64, 4, 4, 2, 16, 128, 512),
    shape(Q2, "tiny-256", 256, 2, 4, 2, 64, 512, 512),
    shape(Q2, "qwen2.5-0.5b", 896, 24, 14, 2, 64, 4864, 151_936),
    shape(Q2, "qwen2.5-1.5b", 1536, 28, 12, 2, 128, 8960, 151_936),
    shape(Q2, "qwen2.5-7b", 3584, 28, 28, 4, 128, 18944, 152_064),
    shape(Q, "tiny", 64, 4, 4, 2, 16, 128, 512),
    shape(Q, "qwen3-0.6b", 1024, 28, 16, 8, 128, 3072, 151_936),
    shape(Q, "qwen3-4b", 2560, 36, 32, 8, 128, 9728, 151_936),
    shape(Q, "qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151_936),
    shape(Q, "qwen3-32b", 5120, 64, 64, 8, 128, 25600, 151_936),
];

/// Architectures `synth` writes: those the engine loads.
pub const SYNTH_ARCHITECTURES: &str = "gemma3, llama, qwen2, qwen3";

/// The preset `name` of `arch`, or an error listing what exists.
pub fn preset(arch: &str, name: &str) -> Result<SynthShape, ModelError> {
    let Some(kind) = Arch::from_name(arch) else {
        return Err(ModelError::Synth(format!(
            "architecture `{arch}`: synth writes {SYNTH_ARCHITECTURES}"
        )));
    };
    let of_arch = || PRESETS.iter().filter(move |p| p.arch == kind);
    of_arch().find(|p| p.name == name).copied().ok_or_else(|| {
        let names: Vec<&str> = of_arch().map(|p| p.name).collect();
        ModelError::Synth(format!(
            "unknown preset `{name}` for {arch} (have: {})",
            names.join(", ")
        ))
    })
}

/// Weight storage types synth writes: every type candle runs on CPU, by llama.cpp's names.
pub const SYNTH_DTYPES: &[(&str, GgmlDType)] = &[
    ("f32", GgmlDType::F32),
    ("f16", GgmlDType::F16),
    ("bf16", GgmlDType::BF16),
    ("q4_0", GgmlDType::Q4_0),
    ("q4_1", GgmlDType::Q4_1),
    ("q5_0", GgmlDType::Q5_0),
    ("q5_1", GgmlDType::Q5_1),
    ("q8_0", GgmlDType::Q8_0),
    ("q2_k", GgmlDType::Q2K),
    ("q3_k", GgmlDType::Q3K),
    ("q4_k", GgmlDType::Q4K),
    ("q5_k", GgmlDType::Q5K),
    ("q6_k", GgmlDType::Q6K),
];

/// The weight type called `name` (case-insensitive), or an error listing those synth writes.
pub fn parse_dtype(name: &str) -> Result<GgmlDType, ModelError> {
    let lower = name.to_ascii_lowercase();
    SYNTH_DTYPES
        .iter()
        .find(|(n, _)| *n == lower)
        .map(|&(_, t)| t)
        .ok_or_else(|| {
            let names: Vec<&str> = SYNTH_DTYPES.iter().map(|(n, _)| *n).collect();
            ModelError::Synth(format!(
                "weight type `{name}`: synth writes {}",
                names.join(", ")
            ))
        })
}

impl SynthShape {
    /// Parameters, embeddings included (tied, as synth writes them).
    pub fn parameters(&self) -> usize {
        let mut attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads);
        if self.arch.qkv_bias() {
            attn += self.head_dim * (self.heads + 2 * self.kv_heads);
        }
        let mlp = 3 * self.hidden * self.ffn;
        let norms = self
            .norms()
            .iter()
            .map(|(_, hidden)| if *hidden { self.hidden } else { self.head_dim })
            .sum::<usize>();
        self.vocab * self.hidden + self.layers * (attn + mlp + norms) + self.hidden
    }

    /// Each block's norm tensors, and whether each spans the hidden size (else a head).
    fn norms(&self) -> Vec<(&'static str, bool)> {
        let mut n = vec![("attn_norm", true), ("ffn_norm", true)];
        if self.arch.post_norms() {
            n.extend([("post_attention_norm", true), ("post_ffw_norm", true)]);
        }
        if self.arch.qk_norm() {
            n.extend([("attn_q_norm", false), ("attn_k_norm", false)]);
        }
        n
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

/// Writes a GGUF of `shape` with random weights stored as `dtype` to `out`.
pub fn write_model(
    shape: &SynthShape,
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
    let s = *shape;
    // A quantized row is whole blocks (256 values for the K-quants): say so before candle
    // refuses the first matrix.
    let block = dtype.block_size();
    for (what, width) in [
        ("hidden size", s.hidden),
        ("attention width (heads × head_dim)", s.heads * s.head_dim),
        ("feed-forward size", s.ffn),
    ] {
        if width % block != 0 {
            return Err(ModelError::Synth(format!(
                "{dtype:?} stores rows in blocks of {block}, but preset `{}` has a {what} of \
                 {width}; the `tiny-256` presets of llama and qwen2 fit every type",
                s.name
            )));
        }
    }
    let mut seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut matrix =
        |name: String, rows: usize, cols: usize, seed: &mut u64| -> Result<(), ModelError> {
            let t = uniform((rows, cols), 1.0 / (cols as f32).sqrt(), seed)?;
            tensors.push((name, QTensor::quantize(&t, dtype)?));
            Ok(())
        };
    matrix("token_embd.weight".into(), s.vocab, s.hidden, &mut seed)?;
    let mut norms: Vec<(String, usize)> = vec![("output_norm.weight".into(), s.hidden)];
    let mut biases: Vec<(String, Tensor)> = Vec::new();
    for i in 0..s.layers {
        let p = |x: &str| format!("blk.{i}.{x}.weight");
        matrix(p("attn_q"), s.heads * s.head_dim, s.hidden, &mut seed)?;
        matrix(p("attn_k"), s.kv_heads * s.head_dim, s.hidden, &mut seed)?;
        matrix(p("attn_v"), s.kv_heads * s.head_dim, s.hidden, &mut seed)?;
        matrix(p("attn_output"), s.hidden, s.heads * s.head_dim, &mut seed)?;
        matrix(p("ffn_gate"), s.ffn, s.hidden, &mut seed)?;
        matrix(p("ffn_up"), s.ffn, s.hidden, &mut seed)?;
        matrix(p("ffn_down"), s.hidden, s.ffn, &mut seed)?;
        for (n, hidden) in s.norms() {
            norms.push((p(n), if hidden { s.hidden } else { s.head_dim }));
        }
        if s.arch.qkv_bias() {
            // Random, so a test sees a bias dropped or misplaced; F32, as llama.cpp stores them.
            for (part, heads) in [
                ("attn_q", s.heads),
                ("attn_k", s.kv_heads),
                ("attn_v", s.kv_heads),
            ] {
                let b = uniform((1, heads * s.head_dim), 0.5, &mut seed)?.flatten_all()?;
                biases.push((format!("blk.{i}.{part}.bias"), b));
            }
        }
    }
    for (name, b) in biases {
        tensors.push((name, QTensor::quantize(&b, GgmlDType::F32)?));
    }
    for (name, dim) in norms {
        let ones = Tensor::ones(dim, candle_core::DType::F32, &Device::Cpu)?;
        tensors.push((name, QTensor::quantize(&ones, GgmlDType::F32)?));
    }

    use gguf_file::Value;
    let (tokens, scores, types) = vocabulary(s.vocab);
    let u = |x: usize| Value::U32(x as u32);
    let arch = s.arch.name();
    let k = |key: &str| format!("{arch}.{key}");
    let rope_base = match s.arch {
        Arch::Llama => 500_000.0,
        Arch::Gemma3 | Arch::Qwen2 | Arch::Qwen3 => 1_000_000.0,
    };
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String(format!("synthetic {}", s.name)),
        ),
        (k("embedding_length"), u(s.hidden)),
        (k("block_count"), u(s.layers)),
        (k("attention.head_count"), u(s.heads)),
        (k("attention.head_count_kv"), u(s.kv_heads)),
        (k("attention.key_length"), u(s.head_dim)),
        (k("attention.value_length"), u(s.head_dim)),
        (k("rope.dimension_count"), u(s.head_dim)),
        (k("feed_forward_length"), u(s.ffn)),
        (k("context_length"), u(131_072)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
        (k("rope.freq_base"), Value::F32(rope_base)),
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
        // As Gemma's GGUFs say; without the key llama.cpp (and so we) prefix a space.
        ("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false)),
    ];
    if s.arch == Arch::Gemma3 {
        metadata.push((k("attention.sliding_window"), u(s.sliding_window)));
    }
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
