//! Prompt caches on disk: a prefilled [`KvCache`] and the tokens it holds, saved once and
//! read back into any later run of the same model (`tessera cache save`, then
//! `--prompt-cache` on generate / chat / bench, and the server's `--prompt-cache-dir`).
//!
//! The file is safetensors: one `U8` tensor per plane buffer (`layers.L.B`), exactly the
//! bytes [`KvCache::state`] gives (codes, scales and biases, norms, turbo key
//! preparations, in the host layout, so a device cache saves through the host and loads
//! onto any device), and under the metadata key `tessera` one JSON [`Header`]: the format
//! version, the model's fingerprint (architecture, layer count, [`Model::fingerprint`]),
//! each layer's shape, signature, codec, rows and ring state, a CRC-32 of every buffer, the
//! token ids each row holds and the reuse floor; `tessera.crc32` holds the CRC-32 of that
//! JSON text. Saving writes a temporary file in the
//! same folder, fsyncs it and renames it over the target, so a reader sees the old file or
//! the new one, never half of one.
//!
//! Loading checks the whole header against the file and the model before it builds
//! anything: buffer sizes and checksums against the header, shapes against the model's
//! layer specs, signatures against the requested scheme, the fingerprint against the
//! loaded model. A mismatch is one [`EngineError::PromptCache`] line naming the field; a
//! truncated, corrupt or foreign file is an error, never a panic or a half-built cache.

mod header;

use header::header_of;
pub use header::{check_header, BufferHeader, Header, LayerHeader, ModelId};

use crate::sequence::Sequence;
use crate::{EngineError, Session};
use safetensors::tensor::{Dtype, TensorView};
use serde::Deserialize;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::Path;
use tessera_kv::planes::{PlaneGeometry, PlanesState};
use tessera_kv::{Codec, KvCache, KvScheme, LayerSpec, LayerState, Retention};
use tessera_models::Model;

/// What a prompt cache file says it is.
pub const FORMAT: &str = "tessera-prompt-cache";
/// The layout version this build reads and writes.
pub const FORMAT_VERSION: u32 = 1;
/// The file name extension the CLI suggests.
pub const EXTENSION: &str = "tpc";
/// The safetensors metadata key that holds the [`Header`].
const HEADER_KEY: &str = "tessera";
/// The key of the header text's CRC-32 (decimal): a changed token id or position in the
/// header is as corrupt as a changed code in a plane.
const HEADER_CRC_KEY: &str = "tessera.crc32";
/// safetensors refuses headers above 100 MB; so do we, before reading one.
const MAX_HEADER_BYTES: u64 = 100_000_000;
/// More rows than any batch this engine runs: a header claiming them is corrupt.
const MAX_ROWS: usize = 1 << 16;

/// A loaded prompt cache: the cache, the tokens each row holds, and the scheme it was
/// checked against (the caller's, or the file's own).
pub struct PromptCache {
    pub tokens: Vec<Vec<u32>>,
    pub cache: KvCache,
    pub scheme: KvScheme,
}

/// What [`PromptCache::resume`] reused (the rule is [`crate::sequence::reuse_of`]).
pub use crate::sequence::{Reuse, ReuseLimit};

fn bad(reason: impl Into<String>) -> EngineError {
    EngineError::PromptCache(reason.into())
}

fn tensor_name(layer: usize, buffer: usize) -> String {
    format!("layers.{layer}.{buffer}")
}

fn window_of(spec: &LayerSpec) -> Option<usize> {
    match spec.retention {
        Retention::Full => None,
        Retention::Window { size } => Some(size),
    }
}

/// Writes `cache` (whose row `r` holds `tokens[r]`) for `model` to `path`, atomically:
/// a temporary file in the same folder, fsynced, renamed over `path`. Returns the bytes
/// written. Refuses a cache in the middle of a prefill or a speculative round.
pub fn save(
    path: &Path,
    model: &Model,
    tokens: &[Vec<u32>],
    cache: &KvCache,
) -> Result<u64, EngineError> {
    let state = cache.state()?;
    if state.prefill.is_some() {
        return Err(bad(
            "a cache in the middle of a batched prefill cannot be saved",
        ));
    }
    if state.layers.iter().any(|l| l.round.is_some()) {
        return Err(bad("a cache inside a speculative round cannot be saved"));
    }
    let offsets = cache.offsets();
    if tokens.len() != offsets.len() || tokens.iter().zip(&offsets).any(|(t, &o)| t.len() != o) {
        return Err(bad(format!(
            "the cache's rows hold {offsets:?} positions, the tokens given {:?}",
            tokens.iter().map(Vec::len).collect::<Vec<_>>()
        )));
    }
    let signatures = cache.signatures();
    let layers = state
        .layers
        .iter()
        .zip(signatures)
        .map(|(l, signature)| LayerHeader {
            signature,
            kv_heads: l.spec.kv_heads,
            head_dim: l.spec.head_dim,
            value_dim: l.spec.value_dim,
            window: window_of(&l.spec),
            slack: l.slack,
            codec: l.planes.codec.to_string(),
            target: l.target.map(|t| t.to_string()),
            quantized_kv_start: l.quantized_kv_start,
            minimum_reusable_offset: l.minimum_reusable_offset,
            ends: l.ends.clone(),
            held_from: l.held_from.clone(),
            round: None,
            capacity: l.planes.capacity,
            queries: l.queries.clone(),
            buffers: l
                .planes
                .buffers
                .iter()
                .map(|b| BufferHeader {
                    bytes: b.len(),
                    crc32: crc32fast::hash(b),
                })
                .collect(),
        })
        .collect();
    let header = Header {
        format: FORMAT.into(),
        version: FORMAT_VERSION,
        state_version: state.version,
        writer: env!("CARGO_PKG_VERSION").into(),
        model: ModelId {
            architecture: model.architecture().into(),
            layers: model.layer_specs().len(),
            fingerprint: model.fingerprint().into(),
        },
        tokens: tokens.to_vec(),
        left_pad: state.left_pad.clone(),
        minimum_reusable_offset: cache.minimum_reusable_offset(),
        layers,
    };
    let json = serde_json::to_string(&header).map_err(|e| bad(e.to_string()))?;
    let mut views = Vec::new();
    for l in &state.layers {
        for (j, b) in l.planes.buffers.iter().enumerate() {
            let view =
                TensorView::new(Dtype::U8, vec![b.len()], b).map_err(|e| bad(e.to_string()))?;
            views.push((tensor_name(l.layer, j), view));
        }
    }
    let meta = HashMap::from([
        (
            HEADER_CRC_KEY.to_string(),
            crc32fast::hash(json.as_bytes()).to_string(),
        ),
        (HEADER_KEY.to_string(), json),
    ]);
    let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| bad(e.to_string()))?;
    write_atomically(path, &bytes)
        .map_err(|e| bad(format!("cannot write {}: {e}", path.display())))?;
    Ok(bytes.len() as u64)
}

/// `bytes` into `path` through a temporary sibling, fsynced, then renamed (and the folder
/// fsynced, so the rename itself survives a crash).
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("not a file name"))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The header of the file at `path`, reading only the header's bytes (`tessera cache
/// info`, the server's index of a cache folder), and the file's length, which must be what
/// the header describes. The tensors' bytes are not read here.
pub fn read_header(path: &Path) -> Result<(Header, u64), EngineError> {
    let (_, len, text) = open(path)?;
    let header = header_of(&text).map_err(|e| named(path, e))?;
    // The tensors' offsets say how long the file is: a cut one is refused here already.
    tensor_table(&text, len).map_err(|e| named(path, e))?;
    Ok((header, len))
}

/// `e` with the file's path in front of its text.
fn named(path: &Path, e: EngineError) -> EngineError {
    match e {
        EngineError::PromptCache(m) => bad(format!("{}: {m}", path.display())),
        e => e,
    }
}

/// The file at `path` opened, its length, and its safetensors header's text.
fn open(path: &Path) -> Result<(std::fs::File, u64, Vec<u8>), EngineError> {
    let io = |e: std::io::Error| bad(format!("{}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let text = read_header_text(&mut f, len).map_err(|e| named(path, e))?;
    Ok((f, len, text))
}

/// Reads the prompt cache at `path` for `model`. `scheme`: the scheme the caller runs
/// (the file must have been made with it); `None` takes the file's own. Only the header
/// is read whole; each plane buffer is then read from its offset into its own memory
/// (layers in parallel) and checked against its CRC.
pub fn load(
    path: &Path,
    model: &Model,
    scheme: Option<&KvScheme>,
) -> Result<PromptCache, EngineError> {
    use std::os::unix::fs::FileExt;
    let (f, len, text) = open(path)?;
    let read = |at: u64, n: usize| -> std::io::Result<Vec<u8>> {
        let mut buf = vec![0u8; n];
        f.read_exact_at(&mut buf, at)?;
        Ok(buf)
    };
    decode_with(&text, len, read, model, scheme).map_err(|e| named(path, e))
}

/// [`load`] from the file's bytes.
pub fn decode(
    bytes: &[u8],
    model: &Model,
    scheme: Option<&KvScheme>,
) -> Result<PromptCache, EngineError> {
    let len = bytes.len() as u64;
    let text = read_header_text(&mut &bytes[..], len)?;
    let read = |at: u64, n: usize| -> std::io::Result<Vec<u8>> {
        usize::try_from(at)
            .ok()
            .and_then(|at| bytes.get(at..at.checked_add(n)?))
            .map(<[u8]>::to_vec)
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))
    };
    decode_with(&text, len, read, model, scheme)
}

/// The safetensors header's JSON text of a file of `len` bytes (its 8-byte length first,
/// checked against the file before anything is allocated).
fn read_header_text(r: &mut impl Read, len: u64) -> Result<Vec<u8>, EngineError> {
    let mut n = [0u8; 8];
    r.read_exact(&mut n)
        .map_err(|_| bad("shorter than a safetensors header"))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES || n > len.saturating_sub(8) {
        return Err(bad(format!(
            "not a valid safetensors file: a header of {n} bytes in a file of {len} bytes"
        )));
    }
    let mut text = vec![0u8; n as usize];
    r.read_exact(&mut text)
        .map_err(|e| bad(format!("reading the header: {e}")))?;
    Ok(text)
}

/// One tensor of the safetensors header.
#[derive(Deserialize)]
struct TensorEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// The tensors the safetensors header lists, by name, each checked to lie inside a data
/// section that ends exactly at the end of the file.
fn tensor_table(text: &[u8], len: u64) -> Result<HashMap<String, TensorEntry>, EngineError> {
    let entries: HashMap<String, serde_json::Value> = serde_json::from_slice(text)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let data = len - 8 - text.len() as u64;
    let mut table = HashMap::with_capacity(entries.len());
    let mut end = 0;
    for (name, v) in entries {
        if name == "__metadata__" {
            continue;
        }
        let t: TensorEntry =
            serde_json::from_value(v).map_err(|e| bad(format!("tensor {name}: {e}")))?;
        let (a, b) = t.data_offsets;
        if a > b || b > data {
            return Err(bad(format!(
                "tensor {name}: bytes {a}..{b} of a data section of {data} (truncated or corrupt)"
            )));
        }
        end = end.max(b);
        table.insert(name, t);
    }
    if end != data {
        return Err(bad(format!(
            "the header describes {} bytes, the file has {len} (truncated or padded)",
            8 + text.len() as u64 + end
        )));
    }
    Ok(table)
}

/// [`load`] and [`decode`]: `text` is the safetensors header of a file of `len` bytes,
/// `read(offset, n)` reads `n` bytes at `offset` of the file.
fn decode_with(
    text: &[u8],
    len: u64,
    read: impl Fn(u64, usize) -> std::io::Result<Vec<u8>> + Sync,
    model: &Model,
    scheme: Option<&KvScheme>,
) -> Result<PromptCache, EngineError> {
    use rayon::prelude::*;
    let header = header_of(text)?;
    let tensors = tensor_table(text, len)?;
    let data_start = 8 + text.len() as u64;
    let scheme = match scheme {
        Some(s) => s.clone(),
        None => header.scheme()?,
    };
    check_header(&header, model, &scheme)?;
    let specs = model.layer_specs();
    let rows = header.tokens.len();
    let buffers_named: usize = header.layers.iter().map(|l| l.buffers.len()).sum();
    if buffers_named != tensors.len() {
        return Err(bad(format!(
            "{} tensors, the header names {buffers_named}",
            tensors.len()
        )));
    }
    let layer = |(i, (l, spec)): (usize, (&LayerHeader, &LayerSpec))| {
        if l.ends.len() != rows || l.held_from.len() != rows {
            return Err(bad(format!(
                "layer {i}: {} ends and {} oldest positions for {rows} rows",
                l.ends.len(),
                l.held_from.len()
            )));
        }
        for (r, row) in header.tokens.iter().enumerate() {
            let held = l.ends[r].checked_sub(header.left_pad[r]);
            if held != Some(row.len()) {
                return Err(bad(format!(
                    "layer {i} ends: row {r} ends at {} after {} padding, but holds {} tokens",
                    l.ends[r],
                    header.left_pad[r],
                    row.len()
                )));
            }
        }
        let codec = Codec::parse(&l.codec).map_err(|e| bad(format!("layer {i} codec: {e}")))?;
        let target = l
            .target
            .as_deref()
            .map(Codec::parse)
            .transpose()
            .map_err(|e| bad(format!("layer {i} target: {e}")))?;
        let mut buffers = Vec::with_capacity(l.buffers.len());
        for (j, b) in l.buffers.iter().enumerate() {
            let name = tensor_name(i, j);
            let t = tensors
                .get(&name)
                .ok_or_else(|| bad(format!("tensor {name}: missing")))?;
            let (a, z) = t.data_offsets;
            if t.dtype != "U8" || t.shape != [b.bytes as u64] || z - a != b.bytes as u64 {
                return Err(bad(format!(
                    "tensor {name}: {} {:?} at bytes {a}..{z}, the header says U8 of {}",
                    t.dtype, t.shape, b.bytes
                )));
            }
            // The size is backed: it lies inside the file (`tensor_table`).
            let data =
                read(data_start + a, b.bytes).map_err(|e| bad(format!("tensor {name}: {e}")))?;
            if crc32fast::hash(&data) != b.crc32 {
                return Err(bad(format!(
                    "tensor {name}: checksum mismatch (corrupt data)"
                )));
            }
            buffers.push(data);
        }
        Ok(LayerState {
            layer: i,
            spec: *spec,
            slack: l.slack,
            target,
            quantized_kv_start: l.quantized_kv_start,
            minimum_reusable_offset: l.minimum_reusable_offset,
            left_pad: header.left_pad.clone(),
            ends: l.ends.clone(),
            held_from: l.held_from.clone(),
            round: l.round.clone(),
            queries: l.queries.clone(),
            planes: PlanesState {
                codec,
                geometry: PlaneGeometry {
                    rows,
                    heads: spec.kv_heads,
                    head_dim: spec.head_dim,
                    value_dim: spec.value_dim,
                },
                capacity: l.capacity,
                buffers,
            },
        })
    };
    let layers = header
        .layers
        .par_iter()
        .zip(&specs)
        .enumerate()
        .map(layer)
        .collect::<Result<Vec<_>, EngineError>>()?;
    let state = tessera_kv::CacheState {
        version: header.state_version,
        layers,
        left_pad: header.left_pad.clone(),
        prefill: None,
    };
    let cache = KvCache::from_state(&state, model.device())
        .map_err(|e| bad(e.to_string()))?
        .with_isa(model.isa());
    if cache.minimum_reusable_offset() != header.minimum_reusable_offset {
        return Err(bad(format!(
            "minimum_reusable_offset: the header says {:?}, the layers {:?}",
            header.minimum_reusable_offset,
            cache.minimum_reusable_offset()
        )));
    }
    Ok(PromptCache {
        tokens: header.tokens,
        cache,
        scheme,
    })
}

impl PromptCache {
    /// The tokens of a one-row cache (a session's), or the error naming the rows.
    fn one_row(&self) -> Result<Vec<u32>, EngineError> {
        match self.tokens.as_slice() {
            [row] => Ok(row.clone()),
            rows => Err(bad(format!(
                "a cache of {} rows; a session takes one",
                rows.len()
            ))),
        }
    }

    /// A session holding the whole cache (one row), e.g. a chat whose turns then keep
    /// what they share with it.
    pub fn into_session(
        self,
        model: &Model,
        prefill_chunk: usize,
    ) -> Result<Session<'_>, EngineError> {
        let tokens = self.one_row()?;
        Session::with_cache(model, &self.scheme, self.cache, tokens, prefill_chunk)
    }

    /// A session over this cache (one row) ready to read the rest of `prompt`: the cache
    /// cut back to the longest prefix it shares with `prompt`, short of `prompt`'s last
    /// token (whose logits the caller needs), and never below the reuse floor or further
    /// back than a ring still holds (then nothing is reused: a fresh cache of `scheme`).
    /// Feed `prompt[reuse.tokens..]` next.
    pub fn resume<'m>(
        self,
        model: &'m Model,
        scheme: &KvScheme,
        prompt: &[u32],
        prefill_chunk: usize,
    ) -> Result<(Session<'m>, Reuse), EngineError> {
        let held = self.one_row()?;
        let reuse = crate::sequence::reuse_of(&held, &self.cache, prompt);
        if reuse.tokens == 0 {
            return Ok((Session::new(model, scheme, prefill_chunk)?, reuse));
        }
        let mut sequence = Sequence::new(held, self.cache)?;
        sequence.cut_to(reuse.tokens)?;
        let (tokens, cache) = sequence.into_parts();
        let session = Session::with_cache(model, &self.scheme, cache, tokens, prefill_chunk)?;
        Ok((session, reuse))
    }
}
