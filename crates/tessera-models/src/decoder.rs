//! The decoder-only transformer, written against the tessera-kv cache API, for the
//! architectures that share its shape: pre-norm blocks of GQA attention with RoPE and a gated
//! MLP. What differs is stated once, in [`Arch`]'s traits:
//!
//! - Gemma 3 (Google's report; Hugging Face `modeling_gemma3`, mlx-lm `gemma3_text.py`):
//!   QK-norm, four RMSNorms per block, gelu-tanh MLP, tied embeddings scaled by sqrt(hidden),
//!   sliding-window layers with their own RoPE base, every sixth layer global. GGUF files
//!   written by llama.cpp store its norm weights already shifted by one (`x · w`).
//! - Llama (2, 3, 3.x): two RMSNorms per block, SiLU MLP, every layer global. llama.cpp's
//!   converter permutes the Q and K rows so that RoPE rotates adjacent pairs (2i, 2i+1)
//!   (llama.cpp's "normal" RoPE); Llama 3.1+ files carry `rope_freqs.weight`, factors that
//!   divide the RoPE frequencies.
//! - Qwen 3: Llama's block plus QK-norm, RoPE over the two halves of each head (NeoX).
//! - Qwen 2 and 2.5 (Hugging Face `modeling_qwen2`, llama.cpp's `LLM_ARCH_QWEN2`): Llama's
//!   block with biases on the query, key and value projections (`blk.N.attn_{q,k,v}.bias`,
//!   added after the stacked matmul), no QK-norm, NeoX RoPE. Every layer is global: Hugging
//!   Face's `use_sliding_window` is off in every released checkpoint, and llama.cpp neither
//!   writes nor reads a window for `qwen2`; a file declaring a window shorter than its
//!   context is refused rather than silently run unwindowed ([`DecoderConfig::from_gguf`]).

use crate::device_weights::PairRope;
use crate::gguf::{q5_0_as_q8_0, GgufFile};
use crate::q8::{Linear, Projections};
use crate::{LoadOptions, LogitsMode, MlpActivation, ModelError};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::sync::Mutex;
use tessera_kv::{AttentionCache, Isa, KvCache, LayerSpec, Retention};

mod graphed;
mod live;

/// The architectures this decoder runs (`general.architecture` in GGUF).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Gemma3,
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "gemma3" => Some(Arch::Gemma3),
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Gemma3 => "gemma3",
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    /// RMSNorm of each head's queries and keys before RoPE.
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Gemma3 | Arch::Qwen3)
    }

    /// Biases on the query, key and value projections (`blk.N.attn_{q,k,v}.bias`).
    pub fn qkv_bias(self) -> bool {
        self == Arch::Qwen2
    }

    /// RMSNorms on the attention and MLP outputs, before the residual adds.
    pub fn post_norms(self) -> bool {
        self == Arch::Gemma3
    }

    /// Token embeddings multiplied by sqrt(hidden).
    pub fn embed_scale(self) -> bool {
        self == Arch::Gemma3
    }

    /// gelu-tanh gate (else SiLU).
    pub fn gelu(self) -> bool {
        self == Arch::Gemma3
    }

    /// RoPE over adjacent pairs (2i, 2i+1) rather than the halves (i, i + d/2).
    pub fn rope_interleaved(self) -> bool {
        self == Arch::Llama
    }
}

// ---------------------------------------------------------------------------------------
// Config

/// Hyperparameters, from GGUF metadata where present.
#[derive(Debug, Clone)]
pub struct DecoderConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub ffn: usize,
    pub rms_eps: f64,
    pub rope_base_global: f32,
    pub rope_base_local: f32,
    /// Window of the sliding layers (Gemma 3); `None`: every layer is global.
    pub sliding_window: Option<usize>,
    /// Every `sliding_pattern`-th layer (1-based) is global.
    pub sliding_pattern: usize,
    pub query_pre_attn_scalar: f64,
    pub context_length: usize,
    pub vocab: usize,
}

/// Values the GGUF does not carry; llama.cpp hard-codes the same for Gemma 3
/// (see ../shared/reference/gemma3-270m.md).
pub const DEFAULT_SLIDING_PATTERN: usize = 6;
pub const DEFAULT_ROPE_BASE_LOCAL: f32 = 10_000.0;

/// The most layers a config may declare (Llama 3.1 405B has 126): bounds what
/// [`DecoderConfig::layer_specs`] allocates before any tensor is read.
pub const MAX_LAYERS: usize = 1 << 16;

impl DecoderConfig {
    /// The hyperparameters of `g`, validated ([`DecoderConfig::validate`]): a bad value is
    /// an error naming its key, never a panic later.
    pub fn from_gguf(g: &GgufFile, arch: Arch) -> Result<Self, ModelError> {
        let key = |k: &str| format!("{}.{k}", arch.name());
        let req = |k: &str| g.u32(&key(k)).map(|x| x as usize);
        let opt = |k: &str| g.opt_u32(&key(k)).map(|x| x.map(|x| x as usize));
        let opt_f = |k: &str| g.opt_f32(&key(k));
        let heads = req("attention.head_count")?;
        let hidden = req("embedding_length")?;
        if heads == 0 {
            return Err(bad(&key("attention.head_count"), 0, "must be positive"));
        }
        let head_dim = match opt("attention.key_length")? {
            Some(d) => d,
            None if hidden % heads != 0 => {
                return Err(bad(
                    &key("embedding_length"),
                    hidden,
                    format!(
                        "with no {} it must be a multiple of {} = {heads}",
                        key("attention.key_length"),
                        key("attention.head_count")
                    ),
                ))
            }
            None => hidden / heads,
        };
        let vocab = g.array("tokenizer.ggml.tokens").map(|a| a.len())?;
        let gemma = arch == Arch::Gemma3;
        let c = DecoderConfig {
            arch,
            hidden,
            layers: req("block_count")?,
            heads,
            kv_heads: opt("attention.head_count_kv")?.unwrap_or(heads),
            head_dim,
            value_dim: opt("attention.value_length")?.unwrap_or(head_dim),
            ffn: req("feed_forward_length")?,
            rms_eps: opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6) as f64,
            rope_base_global: opt_f("rope.freq_base")?.unwrap_or(if gemma {
                1_000_000.0
            } else {
                10_000.0
            }),
            rope_base_local: DEFAULT_ROPE_BASE_LOCAL,
            sliding_window: if gemma {
                Some(opt("attention.sliding_window")?.unwrap_or(512))
            } else {
                None
            },
            sliding_pattern: DEFAULT_SLIDING_PATTERN,
            query_pre_attn_scalar: head_dim as f64,
            context_length: opt("context_length")?.unwrap_or(32768),
            vocab,
        };
        if arch == Arch::Qwen2 {
            c.qwen2_window_is_off(g)?;
        }
        // This decoder rotates every dimension of a head.
        if let Some(rot) = opt("rope.dimension_count")? {
            if rot != c.head_dim {
                return Err(bad(
                    &key("rope.dimension_count"),
                    rot,
                    format!(
                        "this decoder rotates whole heads of {} dimensions (partial RoPE is not supported)",
                        c.head_dim
                    ),
                ));
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Qwen 2 runs every layer global. Its Hugging Face config can declare sliding-window
    /// layers (`use_sliding_window`, `sliding_window`, `max_window_layers`), but every
    /// released Qwen 2 / 2.5 checkpoint has `use_sliding_window: false`, and llama.cpp's
    /// converter writes no window for `qwen2` (nor does its loader read one). A file that
    /// does carry one is accepted when the window spans the whole context (the same
    /// attention) and refused otherwise, since which layers would slide is not recorded.
    fn qwen2_window_is_off(&self, g: &GgufFile) -> Result<(), ModelError> {
        let key = |k: &str| format!("{}.{k}", self.arch.name());
        if let Some(w) = g.opt_u32(&key("attention.sliding_window"))? {
            if (w as usize) < self.context_length {
                return Err(bad(
                    &key("attention.sliding_window"),
                    w,
                    format!(
                        "qwen2 runs every layer global (Qwen 2 / 2.5 ship with sliding windows \
                         off); a window shorter than {} = {} is not supported",
                        key("context_length"),
                        self.context_length
                    ),
                ));
            }
        }
        let pattern = key("attention.sliding_window_pattern");
        if let Some(v) = g.get(&pattern) {
            use candle_core::quantized::gguf_file::Value;
            let off = match v {
                Value::Bool(b) => Some(!b),
                Value::Array(a) => a
                    .iter()
                    .map(|x| match x {
                        Value::Bool(b) => Some(!b),
                        _ => None,
                    })
                    .collect::<Option<Vec<bool>>>()
                    .map(|all| all.into_iter().all(|off| off)),
                _ => None,
            };
            if off != Some(true) {
                return Err(crate::gguf::bad_metadata(
                    &pattern,
                    v,
                    "qwen2 runs every layer global: only an all-false pattern is supported",
                ));
            }
        }
        Ok(())
    }

    /// Checks every value the loader and the forward rely on (positive sizes, heads that
    /// divide into KV groups, even RoPE dimensions, shapes whose element counts fit,
    /// finite positive epsilon and RoPE bases), and the [`LayerSpec`]s made from them.
    /// The error names the GGUF key and its value.
    pub fn validate(&self) -> Result<(), ModelError> {
        let key = |k: &str| format!("{}.{k}", self.arch.name());
        let positive = |k: &str, v: usize| {
            if v == 0 {
                Err(bad(&key(k), v, "must be positive"))
            } else {
                Ok(())
            }
        };
        positive("embedding_length", self.hidden)?;
        positive("block_count", self.layers)?;
        if self.layers > MAX_LAYERS {
            return Err(bad(
                &key("block_count"),
                self.layers,
                format!("more than {MAX_LAYERS} layers"),
            ));
        }
        positive("attention.head_count", self.heads)?;
        positive("attention.head_count_kv", self.kv_heads)?;
        if self.heads % self.kv_heads != 0 {
            return Err(bad(
                &key("attention.head_count_kv"),
                self.kv_heads,
                format!(
                    "{} = {} is not a multiple of it",
                    key("attention.head_count"),
                    self.heads
                ),
            ));
        }
        positive("attention.key_length", self.head_dim)?;
        if self.head_dim % 2 != 0 {
            return Err(bad(
                &key("attention.key_length"),
                self.head_dim,
                "RoPE rotates pairs of dimensions: the head size must be even",
            ));
        }
        positive("attention.value_length", self.value_dim)?;
        positive("feed_forward_length", self.ffn)?;
        positive("context_length", self.context_length)?;
        if self.vocab == 0 || self.vocab > u32::MAX as usize {
            return Err(ModelError::BadMetadata {
                key: "tokenizer.ggml.tokens".into(),
                value: format!("an array of {} values", self.vocab),
                reason: "the vocabulary needs 1 to 2^32 - 1 tokens".into(),
            });
        }
        if let Some(w) = self.sliding_window {
            positive("attention.sliding_window", w)?;
        }
        if self.sliding_pattern == 0 {
            return Err(bad("sliding pattern (built in)", 0, "must be positive"));
        }
        let float = |k: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(ModelError::BadMetadata {
                    key: key(k),
                    value: format!("{v}"),
                    reason: "must be finite and positive".into(),
                })
            }
        };
        float("attention.layer_norm_rms_epsilon", self.rms_eps)?;
        float("rope.freq_base", self.rope_base_global as f64)?;
        float("rope.freq_base (local)", self.rope_base_local as f64)?;
        float("query_pre_attn_scalar", self.query_pre_attn_scalar)?;
        // Every matrix the loader expects, as (rows, cols): neither the rows nor the
        // element count may wrap.
        let (h, kd, vd) = (self.heads, self.kv_heads, self.value_dim);
        let shapes = [
            (
                "attention.head_count × attention.key_length",
                h.checked_mul(self.head_dim),
                self.hidden,
            ),
            (
                "attention.head_count_kv × attention.key_length",
                kd.checked_mul(self.head_dim),
                self.hidden,
            ),
            (
                "attention.head_count_kv × attention.value_length",
                kd.checked_mul(vd),
                self.hidden,
            ),
            (
                "attention.head_count × attention.value_length",
                h.checked_mul(vd),
                self.hidden,
            ),
            ("feed_forward_length", Some(self.ffn), self.hidden),
            ("tokenizer.ggml.tokens", Some(self.vocab), self.hidden),
        ];
        for (what, rows, cols) in shapes {
            if rows.and_then(|r| r.checked_mul(cols)).is_none() {
                return Err(ModelError::BadMetadata {
                    key: key(what),
                    value: format!("{rows:?} rows of {cols}"),
                    reason: "the matrix's element count overflows".into(),
                });
            }
        }
        let specs = self.layer_specs();
        for (i, s) in specs.iter().enumerate() {
            let window = match s.retention {
                Retention::Window { size } => Some(size),
                _ => None,
            };
            if s.kv_heads == 0 || s.head_dim == 0 || s.value_dim == 0 || window == Some(0) {
                return Err(ModelError::BadMetadata {
                    key: format!("layer {i}"),
                    value: format!("{s:?}"),
                    reason: "a layer needs KV heads, key and value dimensions and a window".into(),
                });
            }
        }
        Ok(())
    }

    pub fn is_sliding(&self, layer: usize) -> bool {
        self.sliding_window.is_some()
            && (layer + 1)
                .checked_rem(self.sliding_pattern)
                .is_some_and(|r| r != 0)
    }

    pub fn layer_specs(&self) -> Vec<LayerSpec> {
        (0..self.layers)
            .map(|i| LayerSpec {
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
                value_dim: self.value_dim,
                retention: match self.sliding_window {
                    Some(size) if self.is_sliding(i) => Retention::Window { size },
                    _ => Retention::Full,
                },
            })
            .collect()
    }

    /// RoPE inverse frequencies for `base`, each divided by its factor where the file
    /// carries them.
    fn inverse_frequencies(&self, base: f32, factors: Option<&[f32]>) -> Vec<f64> {
        let half = self.head_dim / 2;
        (0..half)
            .map(|i| {
                let f = (base as f64).powf(-((2 * i) as f64) / self.head_dim as f64);
                f / factors.map_or(1.0, |x| x[i] as f64)
            })
            .collect()
    }
}

/// A metadata value the decoder cannot run with.
fn bad(key: &str, value: impl std::fmt::Display, reason: impl Into<String>) -> ModelError {
    ModelError::BadMetadata {
        key: key.to_string(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

// ---------------------------------------------------------------------------------------
// Layers

pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f32,
}

impl RmsNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        crate::device_weights::rms_norm(x, &self.weight, self.eps)
    }
}

/// The residual stream: `x`, plus the last block part's output `pending` where it is not
/// added yet. The norm that reads the stream next adds it ([`Linear::forward_normed`]), so a
/// device backend folds every residual add into a matmul's input launch (the last into the
/// output layer's).
pub(crate) struct Residual {
    pub(crate) x: Tensor,
    pub(crate) pending: Option<Tensor>,
}

impl Residual {
    /// `x + pending`.
    pub(crate) fn sum(&self) -> candle_core::Result<Tensor> {
        crate::device_weights::residual_sum(&self.x, self.pending.as_ref())
    }
}

/// RoPE tables for one forward: `(rows, tokens, head_dim / 2)`, for each base in use.
pub(crate) struct Rope {
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

impl Rope {
    /// `positions[row][i]` is the RoPE position of token `i` of row `row`.
    fn new(
        positions: &[Vec<usize>],
        inv: &[f64],
        interleaved: bool,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let half = inv.len();
        let (b, n) = (positions.len(), positions[0].len());
        let mut cos = Vec::with_capacity(b * n * half);
        let mut sin = Vec::with_capacity(b * n * half);
        for row in positions {
            for &p in row {
                for &f in inv {
                    let a = p as f64 * f;
                    cos.push(a.cos() as f32);
                    sin.push(a.sin() as f32);
                }
            }
        }
        Ok(Rope {
            cos: Tensor::from_vec(cos, (b, n, half), device)?,
            sin: Tensor::from_vec(sin, (b, n, half), device)?,
            interleaved,
        })
    }

    /// The tables as [`PairRope`]'s `(rows, half)`, where this RoPE is over adjacent pairs
    /// (the only kind a matmul's epilogue folds: a pair's two values are neighbouring rows).
    fn pair_tables(&self) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        if !self.interleaved {
            return Ok(None);
        }
        let (b, n, half) = self.cos.dims3()?;
        Ok(Some((
            self.cos.reshape((b * n, half))?,
            self.sin.reshape((b * n, half))?,
        )))
    }

    fn apply(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = x.contiguous()?;
        if self.interleaved {
            candle_nn::rotary_emb::rope_i(&x, &self.cos, &self.sin)
        } else {
            candle_nn::rotary_emb::rope(&x, &self.cos, &self.sin)
        }
    }
}

struct Attention {
    /// Query, key and value projections, stacked into one matmul where possible.
    qkv: Projections,
    /// The query, key and value biases concatenated, where the architecture has them.
    qkv_bias: Option<Tensor>,
    o: Linear,
    /// Per-head RMSNorms of queries and keys, where the architecture has them.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    value_dim: usize,
    scale: f32,
}

/// Queries, keys and values of one attention layer before the read.
struct Projected {
    q: Tensor, // (b, heads, n, head_dim)
    k: Tensor, // (b, kv_heads, n, head_dim)
    v: Tensor, // (b, kv_heads, n, value_dim)
    /// `(b, heads + kv_heads, n, head_dim)`, where `q` and `k` are its views (roped as one):
    /// a step graph copies it out whole, in one launch (views of several rows are strided).
    qk: Option<Tensor>,
}

impl Attention {
    /// Projections of `norm(s)`, with the stream's sum `s`. Queries and keys take one RoPE
    /// op together (their heads side by side), unless they take norms of their own first.
    fn project(
        &self,
        s: &Residual,
        norm: &RmsNorm,
        rope: &Rope,
    ) -> candle_core::Result<(Tensor, Projected)> {
        let (b, n, _) = s.x.dims3()?;
        let split = |t: Tensor, heads: usize, dim: usize| {
            t.reshape((b, n, heads, dim))?.transpose(1, 2)?.contiguous()
        };
        let bias = self.qkv_bias.as_ref();
        let missing = || candle_core::Error::Msg("attention needs three projections".into());
        let (x, q, k, v, qk) = match &self.qk_norm {
            // Heads of one width: the stacked output is transposed to heads-major once, and
            // q|k (roped as one) and v are views of it. A prefill chunk makes one copy of
            // q|k|v rather than a reshape copy and a transpose copy of q|k and of v each.
            // RoPE over adjacent pairs is folded into a device matmul where there is one
            // (no bias to add first).
            None if self.value_dim == self.head_dim => {
                let heads = self.heads + self.kv_heads;
                let folded = match (bias, rope.pair_tables()?) {
                    (None, Some((cos, sin))) => {
                        let pairs = PairRope {
                            cos: &cos,
                            sin: &sin,
                            columns: heads * self.head_dim,
                        };
                        self.qkv.forward_normed_roped(s, norm, &[3], &pairs)?
                    }
                    _ => None,
                };
                let roped = folded.is_some();
                let (x, parts) = match folded {
                    Some(f) => f,
                    None => self.qkv.forward_normed(s, norm, bias, &[3])?,
                };
                let [qkv]: [Tensor; 1] = parts.try_into().map_err(|_| missing())?;
                let qkv = split(qkv, heads + self.kv_heads, self.head_dim)?;
                let qk = qkv.narrow(1, 0, heads)?;
                let qk = if roped {
                    qk.contiguous()?
                } else {
                    rope.apply(&qk)?
                };
                let q = qk.narrow(1, 0, self.heads)?;
                let k = qk.narrow(1, self.heads, self.kv_heads)?;
                let v = qkv.narrow(1, heads, self.kv_heads)?.contiguous()?;
                let qk = Some(qk);
                return Ok((x, Projected { q, k, v, qk }));
            }
            None => {
                let (x, parts) = self.qkv.forward_normed(s, norm, bias, &[2, 1])?;
                let [qk, v]: [Tensor; 2] = parts.try_into().map_err(|_| missing())?;
                let heads = self.heads + self.kv_heads;
                let qk = rope.apply(&split(qk, heads, self.head_dim)?)?;
                let q = qk.narrow(1, 0, self.heads)?;
                let k = qk.narrow(1, self.heads, self.kv_heads)?;
                (x, q, k, v, Some(qk))
            }
            Some((qn, kn)) => {
                let (x, parts) = self.qkv.forward_normed(s, norm, bias, &[1, 1, 1])?;
                let [q, k, v]: [Tensor; 3] = parts.try_into().map_err(|_| missing())?;
                let q = rope.apply(&qn.forward(&split(q, self.heads, self.head_dim)?)?)?;
                let k = rope.apply(&kn.forward(&split(k, self.kv_heads, self.head_dim)?)?)?;
                (x, q, k, v, None)
            }
        };
        let v = split(v, self.kv_heads, self.value_dim)?;
        Ok((x, Projected { q, k, v, qk }))
    }

    fn output(&self, attended: &Tensor) -> candle_core::Result<Tensor> {
        // (b, heads, n, value_dim) -> (b, n, heads * value_dim)
        let (b, _, n, _) = attended.dims4()?;
        self.o.forward(
            &attended
                .transpose(1, 2)?
                .reshape((b, n, self.heads * self.value_dim))?,
        )
    }

    /// The cache's part of the layer: `p`'s keys and values appended, its queries' read
    /// `(b, heads, n, value_dim)`.
    fn read(&self, p: &Projected, cache: &mut impl AttentionCache) -> Result<Tensor, ModelError> {
        cache.observe_queries(&p.q)?;
        let read = if p.q.dims()[2] == 1 {
            cache.append_decode(&p.k, &p.v)?
        } else {
            cache.append_window(&p.k, &p.v)?
        };
        Ok(read.attend(&p.q, self.scale)?)
    }
}

struct Mlp {
    /// Gate and up projections, stacked into one matmul where possible.
    gate_up: Projections,
    down: Linear,
    /// gelu-tanh (else SiLU).
    gelu: bool,
    /// The level gelu runs at.
    isa: Isa,
}

impl Mlp {
    /// The MLP of `norm(s)`, with the stream's sum `s`.
    fn forward(&self, s: &Residual, norm: &RmsNorm) -> candle_core::Result<(Tensor, Tensor)> {
        let (x, gate_up) = self.gate_up.forward_normed(s, norm, None, &[1, 1])?;
        let [gate, up]: [Tensor; 2] = gate_up
            .try_into()
            .map_err(|_| candle_core::Error::Msg("the MLP needs two projections".into()))?;
        let y = if self.gelu {
            let gate = crate::activation::gelu_tanh(&gate, self.isa)?;
            self.down.forward(&(gate * up)?)?
        } else {
            self.down.forward_silu_gated(&gate, &up)?
        };
        Ok((x, y))
    }
}

struct Block {
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    mlp: Mlp,
    /// Norms of the attention and MLP outputs, where the architecture has them.
    post_norms: Option<(RmsNorm, RmsNorm)>,
    sliding: bool,
}

impl Block {
    /// This block's table among [`Decoder::ropes`].
    fn rope<'r>(&self, ropes: &'r [Option<Rope>; 2]) -> candle_core::Result<&'r Rope> {
        ropes[usize::from(!self.sliding)]
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("no RoPE table for a layer's kind".into()))
    }

    /// The block up to its attention read: the stream's sum and the projections, roped.
    fn project(&self, s: &Residual, rope: &Rope) -> candle_core::Result<(Tensor, Projected)> {
        self.attn.project(s, &self.attn_norm, rope)
    }

    /// The block after its attention read `attended` `(b, heads, n, value_dim)`, given the
    /// stream's sum `x`: the output projection, the MLP, and the norms. Each part's output
    /// is left pending in the stream, so that a device backend can fold the add and the
    /// norm into the next matmul's input launch.
    fn finish(&self, x: Tensor, attended: &Tensor) -> candle_core::Result<Residual> {
        let post = |h: Tensor, i: usize| -> candle_core::Result<Tensor> {
            match &self.post_norms {
                Some(norms) => [&norms.0, &norms.1][i].forward(&h),
                None => Ok(h),
            }
        };
        let s = Residual {
            x,
            pending: Some(post(self.attn.output(attended)?, 0)?),
        };
        let (x, h) = self.mlp.forward(&s, &self.ffn_norm)?;
        Ok(Residual {
            x,
            pending: Some(post(h, 1)?),
        })
    }

    /// The whole block, its attention read given as a closure of the projections (so the
    /// cached and the uncached reference forward share everything else).
    fn forward(
        &self,
        s: &Residual,
        rope: &Rope,
        read: impl FnOnce(&Projected) -> Result<Tensor, ModelError>,
    ) -> Result<Residual, ModelError> {
        let (x, p) = self.project(s, rope)?;
        let attended = read(&p)?;
        Ok(self.finish(x, &attended)?)
    }
}

// ---------------------------------------------------------------------------------------
// Model

/// A forward's device inputs, built by [`Decoder::prepare`]: the tokens' embeddings
/// `(rows, n, hidden)` and the RoPE tables of their positions.
pub struct StepInput {
    x: Tensor,
    ropes: [Option<Rope>; 2],
    shape: (usize, usize),
}

pub struct Decoder {
    config: DecoderConfig,
    /// RoPE inverse frequencies of the sliding (local) and global layers.
    rope_local: Vec<f64>,
    rope_global: Vec<f64>,
    /// Token embeddings, unless the tied output layer's repacked rows serve lookups.
    embed: Option<QTensor>,
    output: Linear,
    blocks: Vec<Block>,
    final_norm: RmsNorm,
    device: Device,
    /// The vector instruction level its CPU kernels run at (also the level its caches
    /// should read at: [`Decoder::isa`]).
    isa: Isa,
    /// The GGUF's fingerprint ([`GgufFile::fingerprint`]).
    fingerprint: String,
    /// Decode steps' device graphs by row count, where a graph backend serves the device
    /// ([`crate::step_graph`]).
    graphs: Mutex<graphed::StepGraphs>,
}

impl Decoder {
    pub fn load(
        g: &mut GgufFile,
        arch: Arch,
        options: &LoadOptions,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let c = DecoderConfig::from_gguf(g, arch)?;
        let eps = c.rms_eps as f32;
        let matrix = |g: &mut GgufFile,
                      name: String,
                      rows: usize,
                      cols: usize|
         -> Result<Linear, ModelError> {
            let t = g.tensor(&name, &[rows, cols], device)?;
            let t = if options.reencode_q5_0 {
                q5_0_as_q8_0(t)?
            } else {
                t
            };
            as_matmul(t, options)
        };
        let norm = |g: &mut GgufFile, name: String, dim: usize| -> Result<RmsNorm, ModelError> {
            Ok(RmsNorm {
                weight: g.tensor(&name, &[dim], device)?.dequantize(device)?,
                eps,
            })
        };
        let mut blocks = Vec::new();
        for i in 0..c.layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let qk_norm = if arch.qk_norm() {
                Some((
                    norm(g, p("attn_q_norm"), c.head_dim)?,
                    norm(g, p("attn_k_norm"), c.head_dim)?,
                ))
            } else {
                None
            };
            let post_norms = if arch.post_norms() {
                Some((
                    norm(g, p("post_attention_norm"), c.hidden)?,
                    norm(g, p("post_ffw_norm"), c.hidden)?,
                ))
            } else {
                None
            };
            let (q_rows, k_rows, v_rows) = (
                c.heads * c.head_dim,
                c.kv_heads * c.head_dim,
                c.kv_heads * c.value_dim,
            );
            let qkv_bias = if arch.qkv_bias() {
                let mut parts = Vec::with_capacity(3);
                for (part, rows) in [("attn_q", q_rows), ("attn_k", k_rows), ("attn_v", v_rows)] {
                    let name = format!("blk.{i}.{part}.bias");
                    parts.push(g.tensor(&name, &[rows], device)?.dequantize(device)?);
                }
                Some(Tensor::cat(&parts, 0)?)
            } else {
                None
            };
            let attn = Attention {
                qkv: Projections::new(vec![
                    matrix(g, p("attn_q"), q_rows, c.hidden)?,
                    matrix(g, p("attn_k"), k_rows, c.hidden)?,
                    matrix(g, p("attn_v"), v_rows, c.hidden)?,
                ])?,
                qkv_bias,
                o: matrix(g, p("attn_output"), c.hidden, c.heads * c.value_dim)?,
                qk_norm,
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: c.head_dim,
                value_dim: c.value_dim,
                scale: (1.0 / c.query_pre_attn_scalar.sqrt()) as f32,
            };
            blocks.push(Block {
                attn_norm: norm(g, p("attn_norm"), c.hidden)?,
                attn,
                ffn_norm: norm(g, p("ffn_norm"), c.hidden)?,
                mlp: Mlp {
                    gate_up: Projections::new(vec![
                        matrix(g, p("ffn_gate"), c.ffn, c.hidden)?,
                        matrix(g, p("ffn_up"), c.ffn, c.hidden)?,
                    ])?,
                    down: matrix(g, p("ffn_down"), c.hidden, c.ffn)?,
                    gelu: match options.mlp_activation {
                        MlpActivation::Architecture => arch.gelu(),
                        MlpActivation::Silu => false,
                    },
                    isa: options.isa.capped(),
                },
                post_norms,
                sliding: c.is_sliding(i),
            });
        }
        let final_norm = norm(g, "output_norm.weight".into(), c.hidden)?;
        // Tied output layer unless the file carries its own. A tied Q5_0 table is
        // re-encoded like every other matrix, so the largest matmul runs the Q8_0 kernel and
        // lookups read its rows (no second copy of the table).
        let tied = !g.has_tensor("output.weight");
        let output_name = if tied {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let output = matrix(g, output_name.into(), c.vocab, c.hidden)?;
        let embed = if tied && output.has_rows() {
            None
        } else {
            Some(g.tensor("token_embd.weight", &[c.vocab, c.hidden], device)?)
        };
        // Llama 3.1+ files carry RoPE frequency factors (one per rotated pair).
        let factors = if g.has_tensor("rope_freqs.weight") {
            let t = g.tensor("rope_freqs.weight", &[c.head_dim / 2], &Device::Cpu)?;
            Some(t.dequantize(&Device::Cpu)?.to_vec1::<f32>()?)
        } else {
            None
        };
        Ok(Decoder {
            rope_local: c.inverse_frequencies(c.rope_base_local, factors.as_deref()),
            rope_global: c.inverse_frequencies(c.rope_base_global, factors.as_deref()),
            config: c,
            embed,
            output,
            blocks,
            final_norm,
            device: device.clone(),
            isa: options.isa.capped(),
            fingerprint: g.fingerprint(),
            graphs: Mutex::new(graphed::StepGraphs::new(
                options.step_graphs,
                options.step_graph_rows,
                options.live_step_graphs,
                options.check_step_graphs,
            )),
        })
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn embed(&self, tokens: &Tensor, check: bool) -> Result<Tensor, ModelError> {
        let host_ids = || -> Result<Vec<u32>, ModelError> {
            let ids: Vec<u32> = tokens.flatten_all()?.to_vec1()?;
            if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.config.vocab) {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab: self.config.vocab,
                });
            }
            Ok(ids)
        };
        if check {
            host_ids()?;
        }
        let x = match (&self.embed, &self.output) {
            (Some(table), _) => table.embedding(tokens)?, // (b, n, hidden)
            (None, output) => {
                let ids = host_ids()?;
                let mut rows = Vec::with_capacity(ids.len() * self.config.hidden);
                for &id in &ids {
                    let Some(row) = output.row(id as usize) else {
                        return Err(candle_core::Error::Msg(
                            "no embedding table: kept unless the output matrix serves lookups"
                                .into(),
                        )
                        .into());
                    };
                    rows.extend(row);
                }
                let (b, n) = tokens.dims2()?;
                Tensor::from_vec(rows, (b, n, self.config.hidden), &self.device)?
            }
        };
        if !self.config.arch.embed_scale() {
            return Ok(x);
        }
        Ok((x * (self.config.hidden as f64).sqrt())?)
    }

    /// The RoPE tables of the sliding and the global layers, each built (and uploaded) only
    /// where some layer takes it.
    fn ropes(&self, positions: &[Vec<usize>]) -> candle_core::Result<[Option<Rope>; 2]> {
        let pairs = self.config.arch.rope_interleaved();
        let table = |sliding: bool, inv: &[f64]| {
            self.blocks
                .iter()
                .any(|b| b.sliding == sliding)
                .then(|| Rope::new(positions, inv, pairs, &self.device))
                .transpose()
        };
        Ok([
            table(true, &self.rope_local)?,
            table(false, &self.rope_global)?,
        ])
    }

    fn logits(&self, s: &Residual, mode: LogitsMode) -> candle_core::Result<Tensor> {
        let last = |t: &Tensor| -> candle_core::Result<Tensor> {
            match mode {
                LogitsMode::Last => {
                    let (_, n, _) = t.dims3()?;
                    t.narrow(1, n.saturating_sub(1), 1)
                }
                LogitsMode::All => Ok(t.clone()),
            }
        };
        let s = Residual {
            x: last(&s.x)?,
            pending: s.pending.as_ref().map(last).transpose()?,
        };
        Ok(self.output.forward_normed(&s, &self.final_norm)?.1)
    }

    /// Whether decode steps run as device graphs where a graph backend serves the device
    /// (on by default: [`LoadOptions::step_graphs`]). Turning it off drops the graphs.
    pub fn set_step_graphs(&self, on: bool) {
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        graphs.enabled = on;
        graphs.clear();
    }

    /// [`crate::Model::step_graph_checks`].
    pub fn step_graph_checks(&self) -> crate::StepGraphChecks {
        let graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        graphs.checks.clone()
    }

    /// Runs `tokens` `(rows, n)` through the model, appending to `cache`: a prefill chunk
    /// when `n > 1`, a decode step when `n == 1`. Returns logits `(rows, n or 1, vocab)`.
    pub fn forward(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Tensor, ModelError> {
        let input = self.prepare(tokens, cache)?;
        self.forward_prepared(&input, cache, mode)
    }

    /// The host side of a forward: checks, the ids' embeddings and the positions' RoPE
    /// tables (read and uploaded here). What [`Self::forward_prepared`] then does only
    /// queues device work, the part of a step a CUDA graph can capture.
    pub fn prepare(&self, tokens: &Tensor, cache: &KvCache) -> Result<StepInput, ModelError> {
        self.prepare_ids(tokens, cache, true)
    }

    /// [`Self::prepare`], the ids checked against the vocabulary on the host (`check`), or
    /// not: ids the device chose over this model's logits (`ChosenIds`) are in range by
    /// construction, and reading them back would wait for the step that chose them.
    pub(crate) fn prepare_ids(
        &self,
        tokens: &Tensor,
        cache: &KvCache,
        check: bool,
    ) -> Result<StepInput, ModelError> {
        let (b, n) = tokens.dims2()?;
        if b == 0 || n == 0 {
            return Err(ModelError::EmptyInput { rows: b, tokens: n });
        }
        if cache.layers().len() != self.blocks.len() {
            return Err(ModelError::CacheLayers {
                cache: cache.layers().len(),
                model: self.blocks.len(),
            });
        }
        if cache.batch() != b {
            return Err(ModelError::Kv(tessera_kv::KvError::RowCount {
                given: b,
                rows: cache.batch(),
            }));
        }
        cache.check_append(n)?;
        // Each row's positions are written at its own physical end; a position's RoPE
        // position is its physical position less the row's left padding (padding positions,
        // which no real query attends, all take 0).
        let positions: Vec<Vec<usize>> = cache
            .ends()
            .iter()
            .zip(cache.left_pad())
            .map(|(&end, &pad)| (end..end + n).map(|p| p.saturating_sub(pad)).collect())
            .collect();
        Ok(StepInput {
            ropes: self.ropes(&positions)?,
            x: self.embed(tokens, check)?,
            shape: (b, n),
        })
    }

    /// The forward of a prepared input, which must be `cache`'s next (its rows and ends
    /// as when prepared).
    pub fn forward_prepared(
        &self,
        input: &StepInput,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Tensor, ModelError> {
        let (b, n) = input.shape;
        if cache.batch() != b {
            return Err(ModelError::Kv(tessera_kv::KvError::RowCount {
                given: b,
                rows: cache.batch(),
            }));
        }
        cache.check_append(n)?;
        let graphed = self
            .graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .serves(b);
        let backend = crate::step_graph::backend(&self.device);
        if let (1, true, Some(backend)) = (n, graphed, backend) {
            if let Some(logits) = self.forward_live(backend, input, cache, mode)? {
                return Ok(logits);
            }
            return self.forward_graphed(backend, input, cache, mode);
        }
        self.forward_eager(input, cache, mode)
    }

    /// [`Self::forward_prepared`] as ordinary launches.
    fn forward_eager(
        &self,
        input: &StepInput,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Tensor, ModelError> {
        let mut s = Residual {
            x: input.x.clone(),
            pending: None,
        };
        for (i, block) in self.blocks.iter().enumerate() {
            let rope = block.rope(&input.ropes)?;
            let layer = cache.layer_mut(i);
            s = block.forward(&s, rope, |p| block.attn.read(p, layer))?;
        }
        Ok(self.logits(&s, mode)?)
    }

    /// One pass over a whole single sequence with no cache: attention computed directly
    /// with an explicit causal (and, on sliding layers, windowed) mask. This is the
    /// independent reference the cached path is tested against; it is not used to serve.
    pub fn forward_uncached(&self, tokens: &[u32]) -> Result<Tensor, ModelError> {
        let n = tokens.len();
        if n == 0 {
            return Err(ModelError::EmptyInput { rows: 1, tokens: 0 });
        }
        let ids = Tensor::from_slice(tokens, (1, n), &self.device)?;
        let positions = vec![(0..n).collect::<Vec<_>>()];
        let ropes = self.ropes(&positions)?;
        let mut s = Residual {
            x: self.embed(&ids, true)?,
            pending: None,
        };
        for block in &self.blocks {
            let rope = block.rope(&ropes)?;
            let window = self.config.sliding_window.filter(|_| block.sliding);
            s = block.forward(&s, rope, |p| {
                let a = &block.attn;
                let mut mask = vec![0f32; n * n];
                for q in 0..n {
                    for k in 0..n {
                        if k > q || window.is_some_and(|w| q - k >= w) {
                            mask[q * n + k] = f32::NEG_INFINITY;
                        }
                    }
                }
                let mask = Tensor::from_vec(mask, (n, n), &self.device)?;
                let group = a.heads / a.kv_heads;
                let k = repeat_kv(&p.k, group)?;
                let v = repeat_kv(&p.v, group)?;
                let scores = (p.q.matmul(&k.t()?)? * a.scale as f64)?.broadcast_add(&mask)?;
                let probs = candle_nn::ops::softmax_last_dim(&scores)?;
                Ok(probs.matmul(&v)?)
            })?;
        }
        Ok(self.logits(&s, LogitsMode::All)?)
    }
}

fn as_matmul(t: QTensor, options: &LoadOptions) -> Result<Linear, ModelError> {
    if options.device_weights && !options.dequantize {
        if let Some(m) = crate::device_weights::matrix(&t)? {
            return Ok(Linear::Device(m));
        }
    }
    Ok(Linear::new(t, options.dequantize, options.isa)?)
}

/// `(b, kv_heads, n, d)` -> `(b, kv_heads * group, n, d)`, each KV head repeated for its group.
fn repeat_kv(x: &Tensor, group: usize) -> candle_core::Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let (b, h, n, d) = x.dims4()?;
    x.unsqueeze(2)?
        .expand((b, h, group, n, d))?
        .reshape((b, h * group, n, d))
}
