//! Composition: which codec each layer's cache uses (the seeds' `KvStorageScheme`), parsed
//! from the CLI's `--kv SCHEME`. This slice knows the plain dtypes; the quantized codecs
//! (`affine:…`, `turbo:…`) extend [`Codec`] and [`KvScheme::parse`].

use crate::KvError;
use candle_core::DType;
use std::fmt;
use std::str::FromStr;

/// Element type of plain (unquantized) storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlainDType {
    Bf16,
    F16,
    F32,
}

impl PlainDType {
    pub fn dtype(self) -> DType {
        match self {
            PlainDType::Bf16 => DType::BF16,
            PlainDType::F16 => DType::F16,
            PlainDType::F32 => DType::F32,
        }
    }

    pub fn size_in_bytes(self) -> usize {
        self.dtype().size_in_bytes()
    }

    pub fn name(self) -> &'static str {
        match self {
            PlainDType::Bf16 => "bf16",
            PlainDType::F16 => "f16",
            PlainDType::F32 => "f32",
        }
    }
}

/// How a position is encoded into storage planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// Keys and values stored as they come, in one float dtype.
    Plain(PlainDType),
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::Plain(d) => f.write_str(d.name()),
        }
    }
}

/// Which positions a layer keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Every position, for full-attention layers.
    Full,
    /// The last `size` positions in a ring, for sliding-window layers.
    Window { size: usize },
}

/// What a model declares about one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub retention: Retention,
}

/// The KV storage scheme of a whole model: a default codec, per-layer overrides, and the
/// number of positions held in bf16 before a quantized codec takes over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvScheme {
    pub default: Codec,
    pub per_layer: Vec<(usize, Codec)>,
    pub quantized_kv_start: usize,
}

const SUPPORTED: &str = "bf16, f16, f32";

impl KvScheme {
    pub fn uniform(codec: Codec) -> Self {
        KvScheme {
            default: codec,
            per_layer: Vec::new(),
            quantized_kv_start: 0,
        }
    }

    /// Parses a `--kv` value such as `bf16`.
    pub fn parse(text: &str) -> Result<Self, KvError> {
        let codec = match text.trim().to_ascii_lowercase().as_str() {
            "bf16" => Codec::Plain(PlainDType::Bf16),
            "f16" | "fp16" => Codec::Plain(PlainDType::F16),
            "f32" | "fp32" => Codec::Plain(PlainDType::F32),
            _ => {
                return Err(KvError::UnknownScheme {
                    given: text.to_string(),
                    supported: SUPPORTED,
                })
            }
        };
        Ok(Self::uniform(codec))
    }

    /// The codec layer `layer` uses.
    pub fn codec_for(&self, layer: usize) -> Codec {
        self.per_layer
            .iter()
            .rev()
            .find(|(l, _)| *l == layer)
            .map(|(_, c)| *c)
            .unwrap_or(self.default)
    }
}

impl FromStr for KvScheme {
    type Err = KvError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for KvScheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_schemes_and_rejects_unknown() {
        assert_eq!(
            KvScheme::parse("bf16").unwrap().default,
            Codec::Plain(PlainDType::Bf16)
        );
        assert_eq!(
            KvScheme::parse("F32").unwrap().default,
            Codec::Plain(PlainDType::F32)
        );
        let err = KvScheme::parse("q4_0").unwrap_err();
        assert!(
            err.to_string().contains("unknown KV scheme `q4_0`"),
            "{err}"
        );
    }

    #[test]
    fn per_layer_override_wins() {
        let mut s = KvScheme::uniform(Codec::Plain(PlainDType::Bf16));
        s.per_layer.push((3, Codec::Plain(PlainDType::F32)));
        assert_eq!(s.codec_for(3), Codec::Plain(PlainDType::F32));
        assert_eq!(s.codec_for(2), Codec::Plain(PlainDType::Bf16));
    }
}
