//! GGUF loading on top of candle's reader: validation that names what is wrong with a bad
//! file, typed metadata access, and the lossless Q5_0 → Q8_0 re-encoding.
//!
//! Why re-encode: candle's CPU Q5_0 dot product is scalar, while its Q8_0 path is
//! vectorized. A Q5_0 block (f16 scale `d`, 32 five-bit codes in `qs` + `qh`) holds integers
//! −16…15 times `d`; a Q8_0 block holds 32 int8 times the same `d`, so every weight survives
//! bit for bit (see ../shared/reference/candle-cpu.md).

use crate::ModelError;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// An opened, validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Opens `path` and checks that the header parses and every tensor's data lies inside
    /// the file, so a truncated download fails here with the tensor it cuts.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        if !path.exists() {
            return Err(ModelError::NotFound {
                path: path.to_path_buf(),
            });
        }
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::new(file);
        let corrupt = |reason: String| ModelError::Corrupt {
            path: path.to_path_buf(),
            reason,
        };
        // candle's reader panics on some headers (a `general.alignment` of 0 divides by
        // zero): a panic there is a corrupt file, not a crash.
        let read =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(&mut reader)));
        let content = match read {
            Ok(Ok(content)) => content,
            Ok(Err(e)) => return Err(corrupt(first_line(&e.to_string()))),
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                let alignment = content_alignment_hint(path);
                return Err(corrupt(format!(
                    "the GGUF reader failed on its header{alignment}: {}",
                    first_line(&what)
                )));
            }
        };
        for (name, info) in &content.tensor_infos {
            let dims = info.shape.dims();
            let Some(elems) = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) else {
                return Err(corrupt(format!(
                    "tensor `{name}` has shape {dims:?}, whose element count overflows"
                )));
            };
            let block = info.ggml_dtype.block_size();
            if elems % block != 0 {
                return Err(corrupt(format!(
                    "tensor `{name}` has {elems} elements, not a multiple of its block size {block}"
                )));
            }
            let Some(bytes) = (elems / block).checked_mul(info.ggml_dtype.type_size()) else {
                return Err(corrupt(format!(
                    "tensor `{name}` of shape {dims:?} overflows its byte count"
                )));
            };
            let bytes = bytes as u64;
            let needed = content
                .tensor_data_offset
                .saturating_add(info.offset)
                .saturating_add(bytes);
            if needed > len {
                return Err(ModelError::Truncated {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    needed,
                    len,
                });
            }
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn architecture(&self) -> Result<String, ModelError> {
        self.string("general.architecture")
    }

    pub fn metadata(&self) -> &std::collections::HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn missing(key: &str) -> ModelError {
        ModelError::MissingMetadata {
            key: key.to_string(),
        }
    }

    /// Integer key `key`: `None` when absent, an error naming the value when it is not an
    /// integer in `0..=u32::MAX`.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, ModelError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let wide: Option<i128> = match v {
            Value::U8(x) => Some(*x as i128),
            Value::I8(x) => Some(*x as i128),
            Value::U16(x) => Some(*x as i128),
            Value::I16(x) => Some(*x as i128),
            Value::U32(x) => Some(*x as i128),
            Value::I32(x) => Some(*x as i128),
            Value::U64(x) => Some(*x as i128),
            Value::I64(x) => Some(*x as i128),
            _ => None,
        };
        match wide {
            Some(x) => u32::try_from(x)
                .map(Some)
                .map_err(|_| bad_metadata(key, v, "not in 0..=4294967295")),
            None => Err(bad_metadata(key, v, "expected an unsigned integer")),
        }
    }

    pub fn u32(&self, key: &str) -> Result<u32, ModelError> {
        self.opt_u32(key)?.ok_or_else(|| Self::missing(key))
    }

    /// Float key `key`: `None` when absent, an error naming the value when it is not a float.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x)),
            Some(Value::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(bad_metadata(key, v, "expected a float")),
        }
    }

    pub fn f32(&self, key: &str) -> Result<f32, ModelError> {
        self.opt_f32(key)?.ok_or_else(|| Self::missing(key))
    }

    pub fn string(&self, key: &str) -> Result<String, ModelError> {
        match self.get(key).ok_or_else(|| Self::missing(key))? {
            Value::String(s) => Ok(s.clone()),
            _ => Err(Self::missing(key)),
        }
    }

    pub fn bool_or(&self, key: &str, default: bool) -> bool {
        match self.get(key) {
            Some(Value::Bool(b)) => *b,
            _ => default,
        }
    }

    pub fn array(&self, key: &str) -> Result<&Vec<Value>, ModelError> {
        match self.get(key).ok_or_else(|| Self::missing(key))? {
            Value::Array(a) => Ok(a),
            _ => Err(Self::missing(key)),
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A sha256 (hex) of everything the file declares: every metadata value (the
    /// tokenizer's vocabulary, merges and template among them) and every tensor's name,
    /// type, shape and offset, in a canonical byte form. Two files with one fingerprint
    /// build the same model graph over the same tokenizer; a prompt cache records it so a
    /// cache is never read into another model. (The weights' bytes are not hashed: that
    /// would read the whole file at every load.)
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"tessera-gguf-fingerprint-1\0");
        let meta: BTreeMap<_, _> = self.content.metadata.iter().collect();
        for (key, value) in meta {
            hash_bytes(&mut h, key.as_bytes());
            hash_value(&mut h, value);
        }
        let tensors: BTreeMap<_, _> = self.content.tensor_infos.iter().collect();
        for (name, info) in tensors {
            hash_bytes(&mut h, name.as_bytes());
            hash_bytes(&mut h, format!("{:?}", info.ggml_dtype).as_bytes());
            let dims = info.shape.dims();
            h.update((dims.len() as u64).to_le_bytes());
            for &d in dims {
                h.update((d as u64).to_le_bytes());
            }
            h.update(info.offset.to_le_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Count of tensors per storage type, e.g. `Q5_0: 81`.
    pub fn tensor_types(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for info in self.content.tensor_infos.values() {
            *counts.entry(format!("{:?}", info.ggml_dtype)).or_insert(0) += 1;
        }
        counts
    }

    /// Reads tensor `name`, checking its shape (candle's order: outermost first).
    pub fn tensor(
        &mut self,
        name: &str,
        expected: &[usize],
        device: &Device,
    ) -> Result<QTensor, ModelError> {
        let info =
            self.content
                .tensor_infos
                .get(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    name: name.to_string(),
                })?;
        if info.shape.dims() != expected {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                got: info.shape.dims().to_vec(),
                expected: expected.to_vec(),
            });
        }
        self.content
            .tensor(&mut self.reader, name, device)
            .map_err(|e| ModelError::Corrupt {
                path: self.path.clone(),
                reason: format!("tensor `{name}`: {}", first_line(&e.to_string())),
            })
    }
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// A metadata value as an error message shows it: scalars in full, strings and arrays cut.
pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("an array of {} values", a.len()),
        Value::String(s) if s.chars().count() > 40 => {
            format!("{:?}…", s.chars().take(40).collect::<String>())
        }
        Value::String(s) => format!("{s:?}"),
        other => format!("{other:?}"),
    }
}

pub(crate) fn bad_metadata(key: &str, v: &Value, reason: impl Into<String>) -> ModelError {
    ModelError::BadMetadata {
        key: key.to_string(),
        value: describe(v),
        reason: reason.into(),
    }
}

/// `, general.alignment = 0` when the header (its first 64 MiB) carries that key with an
/// integer value of 0, the one known way to make candle's reader panic, so the message
/// names it; else empty. Runs only after a panic.
fn content_alignment_hint(path: &Path) -> String {
    use std::io::Read;
    let mut bytes = Vec::new();
    let read = File::open(path).and_then(|f| f.take(64 << 20).read_to_end(&mut bytes));
    if read.is_err() {
        return String::new();
    }
    let key = b"general.alignment";
    let Some(at) = bytes.windows(key.len()).position(|w| w == key) else {
        return String::new();
    };
    // The key, a u32 value type, then the value in that type's width.
    let rest = &bytes[at + key.len()..];
    let Some(kind) = rest
        .get(..4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    else {
        return String::new();
    };
    let width = match kind {
        0 | 1 => 1,
        2 | 3 => 2,
        4 | 5 => 4,
        10 | 11 => 8,
        _ => return String::new(),
    };
    match rest.get(4..4 + width) {
        Some(v) if v.iter().all(|&b| b == 0) => ", general.alignment = 0".to_string(),
        _ => String::new(),
    }
}

const Q5_0_BLOCK_BYTES: usize = 22;
const Q8_0_BLOCK_BYTES: usize = 34;

/// Re-encodes a Q5_0 tensor as Q8_0, value for value; other types pass through unchanged.
pub fn q5_0_as_q8_0(tensor: QTensor) -> Result<QTensor, ModelError> {
    if tensor.dtype() != GgmlDType::Q5_0 {
        return Ok(tensor);
    }
    let data = tensor.data()?;
    let blocks = data.len() / Q5_0_BLOCK_BYTES;
    let mut out = vec![0u8; blocks * Q8_0_BLOCK_BYTES];
    for (src, dst) in data
        .chunks_exact(Q5_0_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(Q8_0_BLOCK_BYTES))
    {
        dst[..2].copy_from_slice(&src[..2]); // the same f16 scale
        let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
        let qs = &src[6..22];
        for j in 0..16 {
            let lo = (qs[j] & 0x0f) as i32 | ((((qh >> j) & 1) as i32) << 4);
            let hi = (qs[j] >> 4) as i32 | ((((qh >> (j + 16)) & 1) as i32) << 4);
            dst[2 + j] = (lo - 16) as i8 as u8;
            dst[2 + j + 16] = (hi - 16) as i8 as u8;
        }
    }
    let storage = QStorage::from_data(
        std::borrow::Cow::Owned(out),
        &tensor.device(),
        GgmlDType::Q8_0,
    )?;
    Ok(QTensor::new(storage, tensor.shape().clone())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    #[test]
    fn q5_0_reencodes_to_identical_q8_0_values() {
        let device = Device::Cpu;
        let values: Vec<f32> = (0..64 * 32)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0)
            .collect();
        let t = Tensor::from_vec(values, (64, 32), &device).unwrap();
        let q5 = QTensor::quantize(&t, GgmlDType::Q5_0).unwrap();
        let before: Vec<f32> = q5
            .dequantize(&device)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let q8 = q5_0_as_q8_0(q5).unwrap();
        assert_eq!(q8.dtype(), GgmlDType::Q8_0);
        let after: Vec<f32> = q8
            .dequantize(&device)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(before, after);
    }
}

/// A length-prefixed byte string, so no two sequences of fields hash alike.
fn hash_bytes(h: &mut Sha256, b: &[u8]) {
    h.update((b.len() as u64).to_le_bytes());
    h.update(b);
}

/// One metadata value as a type tag and its little-endian bytes.
fn hash_value(h: &mut Sha256, v: &Value) {
    let (tag, bytes): (u8, Vec<u8>) = match v {
        Value::U8(x) => (0, x.to_le_bytes().to_vec()),
        Value::I8(x) => (1, x.to_le_bytes().to_vec()),
        Value::U16(x) => (2, x.to_le_bytes().to_vec()),
        Value::I16(x) => (3, x.to_le_bytes().to_vec()),
        Value::U32(x) => (4, x.to_le_bytes().to_vec()),
        Value::I32(x) => (5, x.to_le_bytes().to_vec()),
        Value::U64(x) => (6, x.to_le_bytes().to_vec()),
        Value::I64(x) => (7, x.to_le_bytes().to_vec()),
        Value::F32(x) => (8, x.to_le_bytes().to_vec()),
        Value::F64(x) => (9, x.to_le_bytes().to_vec()),
        Value::Bool(x) => (10, vec![*x as u8]),
        Value::String(x) => {
            h.update([11]);
            hash_bytes(h, x.as_bytes());
            return;
        }
        Value::Array(items) => {
            h.update([12]);
            h.update((items.len() as u64).to_le_bytes());
            for item in items {
                hash_value(h, item);
            }
            return;
        }
    };
    h.update([tag]);
    h.update(bytes);
}
