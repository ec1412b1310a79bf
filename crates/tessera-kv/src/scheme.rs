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
    /// Affine-quantized (mlx's layout and rounding; see [`crate::codec::affine`]), held in bf16
    /// until the layer holds `quantized_kv_start` positions.
    Affine { bits: u8, group: u16 },
    /// TurboQuant (see [`crate::codec::turbo`]): per vector a norm and the Lloyd–Max codes of its
    /// rotated coordinates, `kbits` for keys and `vbits` for values; bf16-first like affine.
    /// `prep`: what is fitted per layer at conversion and applied before encoding.
    Turbo {
        kbits: u8,
        vbits: u8,
        prep: TurboPrep,
    },
}

/// A turbo layer's options: the per-channel preparations it fits on what its bf16 stage
/// holds at conversion (see `turbo_prep`), each on unless the scheme names it off, and
/// whether it codes pairs (off unless named).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurboPrep {
    /// Keys centred on the layer's mean key per KV head (off: `:nomean`).
    pub key_mean: bool,
    /// Keys divided by per-channel scales, queries multiplied by them (off: `:noscale`).
    pub key_scale: bool,
    /// Rotated coordinates coded two at a time against a 2-D codebook, at the widths that
    /// have one (2–4 bits; see [`crate::codec::pairs`]). Off unless named: `:pairs`.
    pub pairs: bool,
}

impl TurboPrep {
    /// The default: every key preparation on, scalar codebooks.
    pub const ALL: TurboPrep = TurboPrep {
        key_mean: true,
        key_scale: true,
        pairs: false,
    };

    /// The scheme-name suffixes of what differs from [`TurboPrep::ALL`].
    fn suffix(&self) -> String {
        let mut s = String::new();
        for (on, name) in [(self.key_mean, ":nomean"), (self.key_scale, ":noscale")] {
            if !on {
                s.push_str(name);
            }
        }
        if self.pairs {
            s.push_str(":pairs");
        }
        s
    }
}

impl Codec {
    /// Whether this codec quantizes (and so starts in bf16 and converts).
    pub fn is_quantized(&self) -> bool {
        !matches!(self, Codec::Plain(_))
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::Plain(d) => f.write_str(d.name()),
            Codec::Affine { bits, group } => write!(f, "affine:{bits}:{group}"),
            Codec::Turbo { kbits, vbits, prep } => {
                write!(f, "turbo:{kbits}:{vbits}{}", prep.suffix())
            }
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

/// The KV storage scheme of a whole model: a default codec, a codec for sliding-window
/// layers where they differ, per-layer overrides (which win over both), and the number of
/// positions held in bf16 before a quantized codec takes over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvScheme {
    pub default: Codec,
    /// Set by the `:global` suffix (`turbo:4:global`: sliding-window layers stay bf16,
    /// the seeds' choice for TurboQuant) or a config file's `"sliding"`.
    pub sliding: Option<Codec>,
    pub per_layer: Vec<(usize, Codec)>,
    pub quantized_kv_start: usize,
}

/// The scheme suffix that keeps sliding-window layers bf16.
const GLOBAL_ONLY: &str = ":global";

/// Bit widths turbo keys and values accept.
const TURBO_BITS: std::ops::RangeInclusive<u32> = 2..=8;

const SUPPORTED: &str =
    "bf16, f16, f32, affine:BITS[:GROUP], turbo:KBITS[:VBITS][:nomean][:noscale][:pairs]";

impl KvScheme {
    pub fn uniform(codec: Codec) -> Self {
        KvScheme {
            default: codec,
            sliding: None,
            per_layer: Vec::new(),
            quantized_kv_start: 0,
        }
    }

    /// Parses a `--kv` value such as `bf16`, `affine:4`, `affine:8:32` or `turbo:4:global`
    /// (`:global`: the codec on full-attention layers only, sliding-window layers bf16).
    pub fn parse(text: &str) -> Result<Self, KvError> {
        let trimmed = text.trim();
        let lower = trimmed.to_ascii_lowercase();
        match lower.strip_suffix(GLOBAL_ONLY) {
            Some(codec) => Ok(KvScheme {
                sliding: Some(Codec::Plain(PlainDType::Bf16)),
                ..Self::uniform(Codec::parse(codec)?)
            }),
            None => Ok(Self::uniform(Codec::parse(trimmed)?)),
        }
    }

    /// The codec layer `layer` (declared by `spec`) uses.
    pub fn codec_for(&self, layer: usize, spec: &LayerSpec) -> Codec {
        let by_kind = match (spec.retention, self.sliding) {
            (Retention::Window { .. }, Some(sliding)) => sliding,
            _ => self.default,
        };
        self.per_layer
            .iter()
            .rev()
            .find(|(l, _)| *l == layer)
            .map(|(_, c)| *c)
            .unwrap_or(by_kind)
    }
}

impl Codec {
    /// Parses one codec name: `bf16`, `f16`, `f32`, `affine:BITS[:GROUP]` (group 64 by
    /// default), `turbo:KBITS[:VBITS][:nomean][:noscale][:pairs]` (values as keys by
    /// default; the key preparations on unless named off, pair codebooks off unless named).
    pub fn parse(text: &str) -> Result<Self, KvError> {
        let unknown = || KvError::UnknownScheme {
            given: text.to_string(),
            supported: SUPPORTED,
        };
        let lower = text.trim().to_ascii_lowercase();
        let mut parts = lower.split(':');
        let codec = match parts.next().unwrap_or("") {
            "bf16" => Codec::Plain(PlainDType::Bf16),
            "f16" | "fp16" => Codec::Plain(PlainDType::F16),
            "f32" | "fp32" => Codec::Plain(PlainDType::F32),
            "affine" => {
                let bits: u32 = parts
                    .next()
                    .and_then(|b| b.parse().ok())
                    .ok_or_else(unknown)?;
                let group: u32 = match parts.next() {
                    Some(g) => g.parse().map_err(|_| unknown())?,
                    None => 64,
                };
                if !crate::codec::affine::AFFINE_BITS.contains(&(bits.min(255) as u8))
                    || !crate::codec::affine::AFFINE_GROUPS.contains(&(group.min(65535) as u16))
                {
                    return Err(KvError::UnsupportedAffine { bits, group });
                }
                Codec::Affine {
                    bits: bits as u8,
                    group: group as u16,
                }
            }
            "turbo" => {
                let mut fields: Vec<&str> = parts.by_ref().collect();
                let mut prep = TurboPrep::ALL;
                while let Some(&last) = fields.last() {
                    // Each flag names the value it sets; a flag named twice is refused.
                    let (flag, set) = match last {
                        "nomean" => (&mut prep.key_mean, false),
                        "noscale" => (&mut prep.key_scale, false),
                        "pairs" => (&mut prep.pairs, true),
                        _ => break,
                    };
                    if *flag == set {
                        return Err(unknown());
                    }
                    *flag = set;
                    fields.pop();
                }
                let kbits: u32 = fields
                    .first()
                    .and_then(|b| b.parse().ok())
                    .ok_or_else(unknown)?;
                let vbits: u32 = match fields.get(1) {
                    Some(v) => v.parse().map_err(|_| unknown())?,
                    None => kbits,
                };
                if fields.len() > 2 {
                    return Err(unknown());
                }
                if !(TURBO_BITS.contains(&kbits) && TURBO_BITS.contains(&vbits)) {
                    return Err(KvError::UnsupportedTurbo { kbits, vbits });
                }
                Codec::Turbo {
                    kbits: kbits as u8,
                    vbits: vbits as u8,
                    prep,
                }
            }
            _ => return Err(unknown()),
        };
        if parts.next().is_some() {
            return Err(unknown());
        }
        Ok(codec)
    }
}

/// The JSON form of a per-layer scheme (`--kv-config FILE`):
/// `{"default": "affine:4", "sliding": "bf16", "layers": [{"layer": 5, "scheme": "bf16"}],
/// "quantized_kv_start": 0}`. Unknown keys are rejected; all but `default` may be left out.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KvConfigFile {
    default: String,
    #[serde(default)]
    sliding: Option<String>,
    #[serde(default)]
    layers: Vec<LayerOverride>,
    #[serde(default)]
    quantized_kv_start: Option<usize>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerOverride {
    layer: usize,
    scheme: String,
}

impl KvScheme {
    /// Parses a `kv_config.json` text. Layer indices are checked against the model when the
    /// cache is built ([`crate::KvCache::new`]).
    pub fn from_config_json(text: &str) -> Result<Self, KvError> {
        let file: KvConfigFile = serde_json::from_str(text).map_err(|e| KvError::BadConfig {
            reason: e.to_string(),
        })?;
        let mut scheme = KvScheme::parse(&file.default)?;
        if let Some(sliding) = file.sliding {
            scheme.sliding = Some(Codec::parse(&sliding).map_err(|e| KvError::BadConfig {
                reason: format!("sliding: {e}"),
            })?);
        }
        for o in file.layers {
            let codec = Codec::parse(&o.scheme).map_err(|e| KvError::BadConfig {
                reason: format!("layer {}: {e}", o.layer),
            })?;
            if scheme.per_layer.iter().any(|(l, _)| *l == o.layer) {
                return Err(KvError::BadConfig {
                    reason: format!("layer {} is listed twice", o.layer),
                });
            }
            scheme.per_layer.push((o.layer, codec));
        }
        if let Some(start) = file.quantized_kv_start {
            scheme.quantized_kv_start = start;
        }
        Ok(scheme)
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
        write!(f, "{}", self.default)?;
        match self.sliding {
            Some(Codec::Plain(PlainDType::Bf16)) => f.write_str(GLOBAL_ONLY),
            Some(other) => write!(f, " (sliding {other})"),
            None => Ok(()),
        }
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
    fn config_json_parses_and_rejects_bad_input() {
        let s = KvScheme::from_config_json(r#"{"default": "affine:4", "layers": [{"layer": 5, "scheme": "bf16"}, {"layer": 0, "scheme": "affine:8:32"}]}"#).unwrap();
        let full = LayerSpec {
            kv_heads: 1,
            head_dim: 64,
            value_dim: 64,
            retention: Retention::Full,
        };
        assert_eq!(s.codec_for(5, &full), Codec::Plain(PlainDType::Bf16));
        assert_eq!(s.codec_for(0, &full), Codec::Affine { bits: 8, group: 32 });
        assert_eq!(s.codec_for(3, &full), Codec::Affine { bits: 4, group: 64 });
        for (bad, needle) in [
            (
                r#"{"default": "affine:4", "extra": 1}"#,
                "unknown field `extra`",
            ),
            (
                r#"{"default": "affine:4", "layers": [{"layer": 1, "scheme": "affine:7"}]}"#,
                "layer 1",
            ),
            (
                r#"{"default": "affine:4", "layers": [{"layer": 1, "scheme": "bf16", "bits": 4}]}"#,
                "unknown field `bits`",
            ),
            (
                r#"{"default": "affine:4", "layers": [{"layer": 1, "scheme": "bf16"}, {"layer": 1, "scheme": "f16"}]}"#,
                "listed twice",
            ),
            (r#"{"default": "q4_0"}"#, "unknown KV scheme"),
            (r#"{"default": "turbo:4", "sliding": "turbo:9"}"#, "sliding"),
            (r#"{"default": "affine:4""#, "kv config"),
        ] {
            let err = KvScheme::from_config_json(bad).unwrap_err().to_string();
            assert!(err.contains(needle), "{bad}: {err}");
        }
    }

    fn spec(retention: Retention) -> LayerSpec {
        LayerSpec {
            kv_heads: 1,
            head_dim: 64,
            value_dim: 64,
            retention,
        }
    }

    #[test]
    fn per_layer_override_wins() {
        let mut s = KvScheme::parse("turbo:4:global").unwrap();
        s.per_layer.push((3, Codec::Plain(PlainDType::F32)));
        let window = spec(Retention::Window { size: 512 });
        let full = spec(Retention::Full);
        assert_eq!(s.codec_for(3, &window), Codec::Plain(PlainDType::F32));
        assert_eq!(s.codec_for(3, &full), Codec::Plain(PlainDType::F32));
        assert_eq!(s.codec_for(2, &window), Codec::Plain(PlainDType::Bf16));
        assert_eq!(
            s.codec_for(2, &full),
            KvScheme::parse("turbo:4").unwrap().default
        );
    }

    #[test]
    fn global_suffix_keeps_sliding_layers_bf16() {
        let s = KvScheme::parse("Affine:4:32:GLOBAL").unwrap();
        let window = spec(Retention::Window { size: 512 });
        assert_eq!(s.codec_for(0, &window), Codec::Plain(PlainDType::Bf16));
        assert_eq!(
            s.codec_for(0, &spec(Retention::Full)),
            Codec::Affine { bits: 4, group: 32 }
        );
        assert_eq!(s.to_string(), "affine:4:32:global");
        assert_eq!(KvScheme::parse(&s.to_string()).unwrap(), s);
        assert!(KvScheme::parse("turbo:4:global:global").is_err());
        assert!(KvScheme::parse(":global").is_err());
        let json = KvScheme::from_config_json(r#"{"default": "turbo:6:3", "sliding": "affine:8"}"#)
            .unwrap();
        assert_eq!(
            json.codec_for(0, &window),
            Codec::Affine { bits: 8, group: 64 }
        );
    }
}
