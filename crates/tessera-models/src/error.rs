use std::path::PathBuf;
use thiserror::Error;

/// Everything that can go wrong loading or running a model. Each variant names the file,
/// key or tensor at fault.
#[derive(Debug, Error)]
pub enum ModelError {
    #[error("model file {path} not found")]
    NotFound { path: PathBuf },

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },

    #[error("{path} is not a readable GGUF file: {reason}")]
    Corrupt { path: PathBuf, reason: String },

    #[error(
        "{path} is truncated: tensor `{tensor}` needs bytes up to {needed}, the file has {len}"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        needed: u64,
        len: u64,
    },

    #[error("unsupported model architecture `{arch}` (supported: {supported})")]
    UnknownArchitecture {
        arch: String,
        supported: &'static str,
    },

    #[error("GGUF metadata key `{key}` is missing or has the wrong type")]
    MissingMetadata { key: String },

    #[error("GGUF metadata `{key}` = {value}: {reason}")]
    BadMetadata {
        key: String,
        value: String,
        reason: String,
    },

    #[error("GGUF tensor `{name}` is missing")]
    MissingTensor { name: String },

    #[error("GGUF tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A byte-level BPE vocabulary whose `tokenizer.ggml.pre` names no pre-tokenizer this
    /// build knows.
    #[error(
        "tokenizer: byte-level BPE pre-tokenizer `{}` (`tokenizer.ggml.pre`) is not supported: {reason}",
        pre.escape_debug()
    )]
    UnknownPreTokenizer { pre: String, reason: &'static str },

    #[error("model synth: {0}")]
    Synth(String),

    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },

    #[error("the KV cache has {cache} layers, the model {model}")]
    CacheLayers { cache: usize, model: usize },

    #[error("a forward needs at least one row and one token, got ({rows}, {tokens})")]
    EmptyInput { rows: usize, tokens: usize },

    #[error(transparent)]
    Kv(#[from] tessera_kv::KvError),

    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
}
