//! tessera-models: GGUF loading, the tokenizer, and one file per model architecture.
//!
//! [`Model::load`] opens a GGUF file ([`gguf::GgufFile`], which validates it), picks the
//! architecture from `general.architecture` and builds its graph; [`Tokenizer`] is built
//! from the same file's vocabulary. A model declares its layers as
//! [`tessera_kv::LayerSpec`]s and runs every attention read through a
//! [`tessera_kv::KvCache`] the caller owns: models hold no mutable state.

mod activation;
pub mod decoder;
pub mod device_weights;
mod error;
pub mod gguf;
pub mod kquant;
pub mod q8;
mod q8_amx;
mod q8_x16;
mod q8_x8;
mod row_matmul;
mod shares;
pub mod step_graph;
pub mod synth;
mod tokenizer;

pub use error::ModelError;
pub use gguf::GgufFile;
pub use tokenizer::{SpecialTokens, Tokenizer};

use candle_core::{Device, Tensor};
use std::path::Path;
use tessera_kv::{Isa, KvCache, LayerSpec};

/// Which positions a forward returns logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// Only the last position of each row (generation).
    Last,
    /// Every position (perplexity).
    All,
}

/// How weights are prepared when loading.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Re-encode Q5_0 matrices as Q8_0 (lossless; much faster on CPU).
    pub reencode_q5_0: bool,
    /// Dequantize every matrix to f32 at load. Slow and large, but free of the int8
    /// re-quantization of activations that candle's quantized matmuls do, whose noise can
    /// flip near-tied tokens; numerical reference tests use it.
    pub dequantize: bool,
    /// The MLP activation; only conformance tests change it.
    pub mlp_activation: MlpActivation,
    /// The vector instruction level of the CPU kernels (capped to what this CPU runs): the
    /// Q8_0 matmul of [`q8::Q8Matrix`] and the Q4_K / Q6_K one of [`kquant::KMatrix`] from
    /// [`Isa::Avx2`] (wider paths at [`Isa::Avx512Vnni`]), candle's quantized matmul below
    /// it; gelu's AVX2 + FMA loop from [`Isa::Avx2`].
    pub isa: Isa,
    /// On a GPU, hand quantized matrices to the installed weight backend
    /// ([`device_weights`]) where it takes them; off, they all run candle's quantized
    /// matmuls (to compare the two).
    pub device_weights: bool,
    /// On a GPU, run decode steps as device graphs where a graph backend is installed
    /// ([`step_graph`]): everything but the KV cache's work captured once per row count and
    /// replayed; off, every step launches each kernel itself (to compare the two).
    pub step_graphs: bool,
    /// The most rows a graphed decode step has; steps of more rows launch eagerly (16 by
    /// default: past that a step's launches are a small share of it). Each row count
    /// captures its own graphs on its first step.
    pub step_graph_rows: usize,
    /// With step graphs, capture a decode step whole, the KV cache's writes and reads
    /// included, where the cache keeps its positions in device memory (`decoder/live.rs`:
    /// full-attention layers on planes that take live steps); off, the cache's work runs
    /// between per-layer graphs (to compare the two).
    pub live_step_graphs: bool,
    /// With step graphs, run every replayed decode step eagerly as well and compare the two
    /// bit for bit ([`Model::step_graph_checks`]): the logits of a whole-step graph (the
    /// cache's positions set back between the two runs), each part's outputs of per-layer
    /// graphs. A row count or cache layout whose replay differs is never replayed again.
    /// Each step runs twice: a check of a GPU, a driver or a kernel change, not for serving.
    pub check_step_graphs: bool,
}

/// Token ids (rows, 1) that [`Model::choose_greedy`] picked on the device over the model's
/// own logits: within its vocabulary by construction.
pub struct ChosenIds(Tensor);

impl ChosenIds {
    /// These ids' rows `keep`, in that order (rows leaving a batch).
    pub fn select(&self, keep: &[usize]) -> Result<ChosenIds, ModelError> {
        let at: Vec<u32> = keep.iter().map(|&r| r as u32).collect();
        let at = Tensor::from_vec(at, keep.len(), self.0.device())?;
        Ok(ChosenIds(self.0.index_select(&at, 0)?))
    }
}

/// What [`LoadOptions::check_step_graphs`] found so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepGraphChecks {
    /// Replayed steps compared with their eager run.
    pub compared: usize,
    /// Of those, steps where some output differed.
    pub differed: usize,
    /// The first difference: which graph and which output.
    pub first_difference: Option<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            reencode_q5_0: true,
            dequantize: false,
            mlp_activation: MlpActivation::Architecture,
            isa: Isa::detected(),
            device_weights: true,
            step_graphs: true,
            step_graph_rows: 16,
            live_step_graphs: true,
            check_step_graphs: false,
        }
    }
}

/// Which activation the MLP gate uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpActivation {
    /// The architecture's own (gelu-tanh for Gemma 3).
    Architecture,
    /// SiLU instead: candle-transformers' quantized_gemma3 (0.11) uses it for Gemma 3, so
    /// the conformance test against candle swaps it in to compare everything else.
    Silu,
}

pub const SUPPORTED_ARCHITECTURES: &str = "gemma3, llama, qwen2, qwen3";

/// A loaded model of one of the supported architectures (all decoder-only transformers
/// of one graph, see [`decoder`]).
pub enum Model {
    Decoder(decoder::Decoder),
}

impl Model {
    /// Opens, validates and loads the GGUF file at `path`, with its tokenizer.
    pub fn load(
        path: &Path,
        options: &LoadOptions,
        device: &Device,
    ) -> Result<(Model, Tokenizer), ModelError> {
        let mut gguf = GgufFile::open(path)?;
        let arch = gguf.architecture()?;
        let Some(kind) = decoder::Arch::from_name(&arch) else {
            return Err(ModelError::UnknownArchitecture {
                arch,
                supported: SUPPORTED_ARCHITECTURES,
            });
        };
        let model = Model::Decoder(decoder::Decoder::load(&mut gguf, kind, options, device)?);
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        step_graph::prepare(device)?;
        Ok((model, tokenizer))
    }

    pub fn forward(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Tensor, ModelError> {
        match self {
            Model::Decoder(m) => m.forward(tokens, cache, mode),
        }
    }

    /// Each row's greedy token of `logits` ((rows, vocab) f32, as [`Self::forward`] gives
    /// with [`LogitsMode::Last`] squeezed) picked on the model's device, where a device
    /// backend does that: the ids stay there as the next step's input
    /// ([`Self::forward_chosen`]) while their copy to the host is under way. `None`: pick
    /// them on the host. The rule is the engine's greedy one (the first index of the
    /// largest value; a NaN never wins, a row that starts with one gives 0).
    pub fn choose_greedy(
        &self,
        logits: &Tensor,
    ) -> Result<Option<(ChosenIds, Box<dyn step_graph::HostIds>)>, ModelError> {
        let (_, vocab) = logits.dims2()?;
        if vocab != self.vocab_size() {
            return Err(candle_core::Error::Msg(format!(
                "greedy tokens of logits {vocab} wide, the vocabulary is {}",
                self.vocab_size()
            ))
            .into());
        }
        let Some(backend) = step_graph::backend(self.device()) else {
            return Ok(None);
        };
        Ok(backend
            .greedy_ids(logits)?
            .map(|(ids, host)| (ChosenIds(ids), host)))
    }

    /// [`Self::forward`] of ids the device chose ([`Self::choose_greedy`]), read there as
    /// they are.
    pub fn forward_chosen(
        &self,
        ids: &ChosenIds,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Tensor, ModelError> {
        match self {
            Model::Decoder(m) => {
                let input = m.prepare_ids(&ids.0, cache, false)?;
                m.forward_prepared(&input, cache, mode)
            }
        }
    }

    /// The host side of [`Self::forward`] (see [`decoder::Decoder::prepare`]).
    pub fn prepare(
        &self,
        tokens: &Tensor,
        cache: &KvCache,
    ) -> Result<decoder::StepInput, ModelError> {
        match self {
            Model::Decoder(m) => m.prepare(tokens, cache),
        }
    }

    /// The device side of [`Self::forward`]: only queues work on the model's device.
    pub fn forward_prepared(
        &self,
        input: &decoder::StepInput,
        cache: &mut KvCache,
        mode: LogitsMode,
    ) -> Result<Tensor, ModelError> {
        match self {
            Model::Decoder(m) => m.forward_prepared(input, cache, mode),
        }
    }

    /// Turns decode-step graphs on or off ([`LoadOptions::step_graphs`]).
    pub fn set_step_graphs(&self, on: bool) {
        match self {
            Model::Decoder(m) => m.set_step_graphs(on),
        }
    }

    /// What the replayed steps' checks against eager steps found
    /// ([`LoadOptions::check_step_graphs`]; all zero when it is off).
    pub fn step_graph_checks(&self) -> StepGraphChecks {
        match self {
            Model::Decoder(m) => m.step_graph_checks(),
        }
    }

    pub fn layer_specs(&self) -> Vec<LayerSpec> {
        match self {
            Model::Decoder(m) => m.config().layer_specs(),
        }
    }

    pub fn context_length(&self) -> usize {
        match self {
            Model::Decoder(m) => m.config().context_length,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Model::Decoder(m) => m.config().vocab,
        }
    }

    pub fn device(&self) -> &Device {
        match self {
            Model::Decoder(m) => m.device(),
        }
    }

    /// The vector instruction level the model's CPU kernels run at; caches made for it
    /// read at the same level (`KvCache::with_isa`).
    pub fn isa(&self) -> Isa {
        match self {
            Model::Decoder(m) => m.isa(),
        }
    }

    /// The sha256 of the GGUF's metadata and tensor table ([`GgufFile::fingerprint`]).
    pub fn fingerprint(&self) -> &str {
        match self {
            Model::Decoder(m) => m.fingerprint(),
        }
    }

    pub fn architecture(&self) -> &'static str {
        match self {
            Model::Decoder(m) => m.config().arch.name(),
        }
    }
}
