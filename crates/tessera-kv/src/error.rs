use thiserror::Error;

/// Everything that can go wrong in KV storage. Each variant names what was wrong.
#[derive(Debug, Error)]
pub enum KvError {
    #[error("unknown KV scheme `{given}` (supported: {supported})")]
    UnknownScheme {
        given: String,
        supported: &'static str,
    },

    #[error("affine KV with {bits} bits and group {group} is not supported (bits: 2, 3, 4, 5, 6, 8; groups: 32, 64, 128)")]
    UnsupportedAffine { bits: u32, group: u32 },

    #[error("turbo KV with {kbits}-bit keys and {vbits}-bit values is not supported (bits: 2 to 8 each)")]
    UnsupportedTurbo { kbits: u32, vbits: u32 },

    #[error("layer {layer}: turbo KV needs a power-of-two head dimension for its Hadamard rotation, got {dim}")]
    TurboDim { layer: usize, dim: usize },

    #[error(
        "layer {layer}: head dimension {dim} is not divisible by the quantization group {group}"
    )]
    GroupDoesNotDivide {
        layer: usize,
        dim: usize,
        group: usize,
    },

    #[error("layer {layer}: cannot trim {requested} positions, only {held} are held")]
    TrimTooFar {
        layer: usize,
        requested: usize,
        held: usize,
    },

    #[error("layer {layer}: append of shape {got:?} does not match the cache's (rows {rows}, kv_heads {kv_heads}, head_dim {head_dim})")]
    ShapeMismatch {
        layer: usize,
        got: Vec<usize>,
        rows: usize,
        kv_heads: usize,
        head_dim: usize,
    },

    #[error("bad kv config: {reason}")]
    BadConfig { reason: String },

    #[error("kv config names layer {layer}, but the model has {layers} layers")]
    UnknownLayer { layer: usize, layers: usize },

    #[error("left padding has {given} rows but the cache was built for {rows}")]
    RowCount { given: usize, rows: usize },

    #[error("query of shape {got:?} does not fit this read ({detail})")]
    QueryShape { got: Vec<usize>, detail: String },

    #[error("KV {codec} is not available on {device}: {reason}")]
    DeviceCodec {
        codec: String,
        device: String,
        reason: String,
    },

    #[error("the KV cache is on {device}, but no device backend is installed for it (build with the `cuda` feature and install tessera-kernels' backend)")]
    NoDeviceBackend { device: String },

    #[error("device kernel failed: {0}")]
    Device(String),

    #[error("layer {layer}: row {row} cannot roll back to {wanted} positions: its sliding window of {window} needs position {needed}, but the ring (of {slots} slots) has overwritten everything before {held}; give the cache round slack (KvCache::with_round_slack) of at least the longest round")]
    RingOverwritten {
        layer: usize,
        row: usize,
        wanted: usize,
        window: usize,
        slots: usize,
        needed: usize,
        held: usize,
    },

    #[error("row operation: {0}")]
    Rows(String),

    #[error("planes of {expected} cannot take codes of {got}")]
    CodecMismatch { expected: String, got: String },

    #[error("layer {layer}: the {read} read is not served by {codec} storage (only plain storage serves it)")]
    ReadNotServed {
        layer: usize,
        read: &'static str,
        codec: String,
    },

    #[error("bad cache state: {0}")]
    BadState(String),

    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
}
