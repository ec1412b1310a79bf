//! The prompt cache file's header: its fields, how it is read out of the safetensors
//! metadata, and the checks it must pass against a model and a scheme before any tensor
//! is read.

use super::{bad, window_of, FORMAT, FORMAT_VERSION, HEADER_CRC_KEY, HEADER_KEY, MAX_ROWS};
use crate::EngineError;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tessera_kv::{Codec, KvCache, KvScheme, QueryMoments};
use tessera_models::Model;

/// The metadata of a prompt cache file (JSON under the key `tessera`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    pub format: String,
    pub version: u32,
    /// [`tessera_kv::STATE_VERSION`] of the planes' layout.
    pub state_version: u32,
    /// The tessera version that wrote the file (informational).
    pub writer: String,
    pub model: ModelId,
    /// The token ids each row holds, oldest first.
    pub tokens: Vec<Vec<u32>>,
    pub left_pad: Vec<usize>,
    /// The cache's reuse floor: a prefix shorter than this is not reused.
    pub minimum_reusable_offset: Option<usize>,
    pub layers: Vec<LayerHeader>,
}

/// Which model a cache belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelId {
    pub architecture: String,
    pub layers: usize,
    /// [`Model::fingerprint`]: a sha256 of the GGUF's metadata and tensor table.
    pub fingerprint: String,
}

/// One layer's state, less its plane bytes (which are tensors).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerHeader {
    /// `KvCache::signatures`' entry: retention and codec, e.g. `kv:window512:bf16-first:affine:4:64`.
    pub signature: String,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    /// The sliding window's size; `None` for a full-attention layer.
    pub window: Option<usize>,
    pub slack: usize,
    /// The codec the planes hold now (bf16 before a quantized layer converts).
    pub codec: String,
    /// The quantized codec a bf16-first layer converts to.
    pub target: Option<String>,
    pub quantized_kv_start: usize,
    pub minimum_reusable_offset: Option<usize>,
    pub ends: Vec<usize>,
    pub held_from: Vec<usize>,
    pub round: Option<Vec<usize>>,
    pub capacity: usize,
    pub buffers: Vec<BufferHeader>,
    /// The queries a layer still to convert has seen (its TurboQuant key scales are fitted
    /// on them at conversion); absent where none (files before this field read as none).
    #[serde(default, skip_serializing_if = "QueryMoments::is_empty")]
    pub queries: QueryMoments,
}

/// One plane buffer: its size and CRC-32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BufferHeader {
    pub bytes: usize,
    pub crc32: u32,
}

/// Our header inside a safetensors header's JSON text.
pub(super) fn header_of(text: &[u8]) -> Result<Header, EngineError> {
    #[derive(Deserialize)]
    struct Outer {
        #[serde(rename = "__metadata__")]
        metadata: Option<HashMap<String, String>>,
    }
    let outer: Outer = serde_json::from_slice(text)
        .map_err(|e| bad(format!("the safetensors header is not valid JSON: {e}")))?;
    let meta = outer.metadata.unwrap_or_default();
    let json = meta
        .get(HEADER_KEY)
        .ok_or_else(|| bad("not a tessera prompt cache (no `tessera` metadata)"))?;
    let crc = meta.get(HEADER_CRC_KEY).and_then(|c| c.parse::<u32>().ok());
    if crc != Some(crc32fast::hash(json.as_bytes())) {
        return Err(bad("header checksum mismatch (corrupt header)"));
    }
    let header: Header = serde_json::from_str(json)
        .map_err(|e| bad(format!("the tessera header does not parse: {e}")))?;
    if header.format != FORMAT {
        return Err(bad(format!(
            "format: `{}`, expected `{FORMAT}`",
            header.format
        )));
    }
    if header.version != FORMAT_VERSION {
        return Err(bad(format!(
            "version: {} (this build reads version {FORMAT_VERSION})",
            header.version
        )));
    }
    Ok(header)
}

impl Header {
    /// The scheme that builds this cache's layers: each layer's own codec (its target, for
    /// a bf16-first layer) and its `quantized_kv_start`.
    pub fn scheme(&self) -> Result<KvScheme, EngineError> {
        let codec = |l: &LayerHeader| {
            Codec::parse(l.target.as_deref().unwrap_or(&l.codec))
                .map_err(|e| bad(format!("codec: {e}")))
        };
        let first = self.layers.first().ok_or_else(|| bad("layers: none"))?;
        Ok(KvScheme {
            default: codec(first)?,
            sliding: None,
            per_layer: self
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| Ok((i, codec(l)?)))
                .collect::<Result<_, EngineError>>()?,
            quantized_kv_start: self
                .layers
                .iter()
                .map(|l| l.quantized_kv_start)
                .max()
                .unwrap_or(0),
        })
    }

    /// One line per distinct layer signature, with how many layers have it.
    pub fn layer_summary(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = Vec::new();
        for l in &self.layers {
            match out.iter_mut().find(|(s, _)| *s == l.signature) {
                Some((_, n)) => *n += 1,
                None => out.push((l.signature.clone(), 1)),
            }
        }
        out
    }
}

/// Whether a cache with `header` can be read into `model` under `scheme`: the model's
/// fingerprint and layer shapes, each layer's signature and `quantized_kv_start`, the rows
/// and the token ids. [`super::decode`] checks this and then the tensors; a store of cache
/// files (the server's `--prompt-cache-dir`) can check it from [`super::read_header`] alone.
pub fn check_header(header: &Header, model: &Model, scheme: &KvScheme) -> Result<(), EngineError> {
    check_model(header, model)?;
    let rows = header.tokens.len();
    if rows == 0 || rows > MAX_ROWS || header.left_pad.len() != rows {
        return Err(bad(format!(
            "rows: {rows} token lists and {} paddings",
            header.left_pad.len()
        )));
    }
    let expected = KvCache::new(&model.layer_specs(), scheme, vec![0; rows])
        .map_err(|e| bad(format!("scheme: {e}")))?
        .signatures();
    for (i, (l, want)) in header.layers.iter().zip(&expected).enumerate() {
        if l.signature != *want {
            return Err(bad(format!(
                "layer {i} signature: the file holds {}, the requested scheme makes {want}",
                l.signature
            )));
        }
        if l.quantized_kv_start != scheme.quantized_kv_start {
            return Err(bad(format!(
                "layer {i} quantized_kv_start: the file's {}, the requested scheme's {}",
                l.quantized_kv_start, scheme.quantized_kv_start
            )));
        }
    }
    let vocab = model.vocab_size();
    for (r, row) in header.tokens.iter().enumerate() {
        if let Some(&id) = row.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad(format!(
                "tokens: row {r} holds id {id}, outside the model's vocabulary of {vocab}"
            )));
        }
    }
    Ok(())
}

/// The model fields of `header` against `model`, then each layer's shape.
fn check_model(header: &Header, model: &Model) -> Result<(), EngineError> {
    let specs = model.layer_specs();
    let m = &header.model;
    if m.architecture != model.architecture() {
        return Err(bad(format!(
            "model architecture: the file was made for {}, this model is {}",
            m.architecture,
            model.architecture()
        )));
    }
    if m.layers != specs.len() || header.layers.len() != specs.len() {
        return Err(bad(format!(
            "model layers: the file has {} ({} described), this model {}",
            m.layers,
            header.layers.len(),
            specs.len()
        )));
    }
    if m.fingerprint != model.fingerprint() {
        return Err(bad(format!(
            "model fingerprint: the file was made for {}…, this model is {}… (another GGUF)",
            m.fingerprint.get(..12).unwrap_or(&m.fingerprint),
            &model.fingerprint()[..12]
        )));
    }
    for (i, (l, spec)) in header.layers.iter().zip(&specs).enumerate() {
        let fields = [
            ("kv_heads", l.kv_heads, spec.kv_heads),
            ("head_dim", l.head_dim, spec.head_dim),
            ("value_dim", l.value_dim, spec.value_dim),
        ];
        for (field, file, ours) in fields {
            if file != ours {
                return Err(bad(format!(
                    "layer {i} {field}: the file's {file}, the model's {ours}"
                )));
            }
        }
        if l.window != window_of(spec) {
            return Err(bad(format!(
                "layer {i} window: the file's {:?}, the model's {:?}",
                l.window,
                window_of(spec)
            )));
        }
    }
    Ok(())
}
