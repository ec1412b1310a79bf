//! Per-layer KV bit widths from measured sensitivity (`tessera kv-config auto`).
//!
//! Layers differ in what a quantized cache costs them: in Gemma 3 the sliding-window
//! layers carry several times the KL of the global ones, and keys far more than values.
//! So each layer's keys and values are probed on a calibration text: one run per (layer,
//! keys or values) with only that part TurboQuant-coded at [`PROBE_BITS`], every other
//! layer bf16, scored by KL against the bf16 cache. A part's KL at other widths is
//! predicted as the probe's KL times the ratio of the codebook's mean squared error at
//! those widths (small cache errors change the logits linearly, so KL grows with the
//! error's energy), and parts' KLs add. Bits are then bought greedily where they remove the
//! most predicted KL per byte, until the next purchase would pass the budget of bits per
//! stored element, all in (codes, norms). The predicted curves are convex in the width, so
//! the greedy choice is the cheapest allocation for that prediction.
//!
//! With pair codebooks (`:pairs`, the default) the widths that have one (2–4 bits) are
//! predicted from the pair codebook's error instead: ~8–13% less than the scalar one's at
//! the same bits, which keeps the curve convex (the steps shrink from 2 to 8 bits).

use crate::eval::{evaluate, EvalMode};
use crate::EngineError;
use tessera_kv::codec::pairs::{PairBook, PAIR_BITS};
use tessera_kv::codec::turbo::Codebook;
use tessera_kv::{Codec, KvCache, KvScheme, LayerSpec, PlainDType, TurboPrep};
use tessera_models::Model;

/// The width a probe codes one part at.
pub const PROBE_BITS: u8 = 4;
/// The widths an allocation chooses from (TurboQuant's).
pub const MIN_BITS: u8 = 2;
pub const MAX_BITS: u8 = 8;

/// KL against bf16 with one layer's keys (or values) alone coded at [`PROBE_BITS`].
#[derive(Debug, Clone, PartialEq)]
pub struct Sensitivity {
    pub key: Vec<f64>,
    pub value: Vec<f64>,
}

/// Key and value widths per layer, and whether the layers code pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub bits: Vec<(u8, u8)>,
    pub pairs: bool,
}

fn turbo(kbits: u8, vbits: u8, pairs: bool) -> Codec {
    Codec::Turbo {
        kbits,
        vbits,
        prep: TurboPrep {
            pairs,
            ..TurboPrep::ALL
        },
    }
}

/// The scheme that codes `layer` alone, every other layer bf16.
fn probe_scheme(layer: usize, codec: Codec, kv_start: usize) -> KvScheme {
    KvScheme {
        per_layer: vec![(layer, codec)],
        quantized_kv_start: kv_start,
        ..KvScheme::uniform(Codec::Plain(PlainDType::Bf16))
    }
}

/// Runs the probes on `tokens` (see the module's text): 2 × layers runs of the model
/// besides the bf16 reference.
pub fn measure(
    model: &Model,
    tokens: &[u32],
    mode: EvalMode,
    bos: Option<u32>,
    kv_start: usize,
) -> Result<Sensitivity, EngineError> {
    let layers = model.layer_specs().len();
    let mut probes = Vec::with_capacity(2 * layers);
    for layer in 0..layers {
        // The other part at 8 bits: its error is 1/256 of the probed part's at 4.
        probes.push((
            format!("k{layer}"),
            probe_scheme(layer, turbo(PROBE_BITS, MAX_BITS, false), kv_start),
        ));
        probes.push((
            format!("v{layer}"),
            probe_scheme(layer, turbo(MAX_BITS, PROBE_BITS, false), kv_start),
        ));
    }
    let results = evaluate(model, tokens, &probes, mode, bos)?;
    let kl = |i: usize| results[i].kl_vs_bf16.unwrap_or(0.0).max(0.0);
    Ok(Sensitivity {
        key: (0..layers).map(|l| kl(2 * l)).collect(),
        value: (0..layers).map(|l| kl(2 * l + 1)).collect(),
    })
}

/// The codebooks' error at each width relative to the probes' (scalar, [`PROBE_BITS`]), for
/// vectors of `dim`, with pair codebooks where `pairs` asks and the width has one (indexed
/// by width; each computed once per process).
fn relative_errors(dim: usize, pairs: bool) -> [f64; MAX_BITS as usize + 1] {
    type Table = [f64; MAX_BITS as usize + 1];
    static TABLES: std::sync::Mutex<Vec<((usize, bool), Table)>> =
        std::sync::Mutex::new(Vec::new());
    let mut tables = TABLES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, t)) = tables.iter().find(|(k, _)| *k == (dim, pairs)) {
        return *t;
    }
    let at = |b: u8| match pairs && PAIR_BITS.contains(&b) {
        true => PairBook::shared(dim, b).coordinate_mse(dim),
        false => Codebook::shared(dim, b).coordinate_mse(dim),
    };
    let probe = Codebook::shared(dim, PROBE_BITS).coordinate_mse(dim);
    let mut t = [0.0; MAX_BITS as usize + 1];
    for b in MIN_BITS..=MAX_BITS {
        t[b as usize] = at(b) / probe;
    }
    tables.push(((dim, pairs), t));
    t
}

fn relative_error(dim: usize, bits: u8, pairs: bool) -> f64 {
    relative_errors(dim, pairs)[bits as usize]
}

/// Predicted KL of `allocation` under `sens`.
pub fn predicted_kl(specs: &[LayerSpec], sens: &Sensitivity, allocation: &Allocation) -> f64 {
    specs
        .iter()
        .zip(&allocation.bits)
        .enumerate()
        .map(|(l, (spec, &(k, v)))| {
            sens.key[l] * relative_error(spec.head_dim, k, allocation.pairs)
                + sens.value[l] * relative_error(spec.value_dim, v, allocation.pairs)
        })
        .sum()
}

/// The allocation as a scheme: every layer listed.
pub fn scheme(allocation: &Allocation, kv_start: usize) -> KvScheme {
    // The default is never used (every layer is listed); the file names the same one.
    let pairs = allocation.pairs;
    let mut s = KvScheme::uniform(turbo(PROBE_BITS, PROBE_BITS, pairs));
    s.per_layer = allocation
        .bits
        .iter()
        .enumerate()
        .map(|(l, &(k, v))| (l, turbo(k, v, pairs)))
        .collect();
    s.quantized_kv_start = kv_start;
    s
}

/// Bytes per position of each layer at each pair of widths, from the cache's own count
/// (one single-layer cache per distinct layer shape and pair).
pub struct Costs {
    /// `[layer][k][v]`, widths indexed from 0.
    bytes: Vec<Vec<Vec<usize>>>,
    elements: usize,
}

impl Costs {
    pub fn new(specs: &[LayerSpec]) -> Result<Self, EngineError> {
        // Tables already built, by (kv_heads, head_dim, value_dim).
        type Table = Vec<Vec<usize>>;
        let mut seen: Vec<((usize, usize, usize), Table)> = Vec::new();
        let mut bytes = Vec::with_capacity(specs.len());
        for spec in specs {
            let shape = (spec.kv_heads, spec.head_dim, spec.value_dim);
            if let Some((_, table)) = seen.iter().find(|(s, _)| *s == shape) {
                bytes.push(table.clone());
                continue;
            }
            let mut table = vec![vec![0; MAX_BITS as usize + 1]; MAX_BITS as usize + 1];
            for k in MIN_BITS..=MAX_BITS {
                for v in MIN_BITS..=MAX_BITS {
                    // Pair codes are packed as the scalar ones: the same bytes either way.
                    let scheme = KvScheme::uniform(turbo(k, v, false));
                    let cache = KvCache::new(&[*spec], &scheme, vec![0])?;
                    table[k as usize][v as usize] = cache.bytes_per_token();
                }
            }
            seen.push((shape, table.clone()));
            bytes.push(table);
        }
        let elements = specs
            .iter()
            .map(|s| s.kv_heads * (s.head_dim + s.value_dim))
            .sum();
        Ok(Costs { bytes, elements })
    }

    /// An error unless `budget` affords at least [`MIN_BITS`] on every part.
    pub fn check(&self, budget: f64) -> Result<(), EngineError> {
        let floor = self.bits_per_element(&Allocation {
            bits: vec![(MIN_BITS, MIN_BITS); self.bytes.len()],
            pairs: false,
        });
        if budget.is_nan() || budget < floor {
            return Err(EngineError::Invalid(format!(
                "a budget of {budget} bits per element is below the smallest allocation's \
                 {floor:.3} ({MIN_BITS}-bit keys and values)"
            )));
        }
        Ok(())
    }

    /// Bits per stored K or V element, all in (codes, norms), of `allocation`.
    pub fn bits_per_element(&self, allocation: &Allocation) -> f64 {
        let bytes: usize = allocation
            .bits
            .iter()
            .zip(&self.bytes)
            .map(|(&(k, v), table)| table[k as usize][v as usize])
            .sum();
        bytes as f64 * 8.0 / self.elements.max(1) as f64
    }
}

/// The widths of least predicted KL whose bits per element stay within `budget`, with
/// pair codebooks or without.
pub fn allocate(
    specs: &[LayerSpec],
    costs: &Costs,
    sens: &Sensitivity,
    budget: f64,
    pairs: bool,
) -> Result<Allocation, EngineError> {
    let layers = specs.len();
    if sens.key.len() != layers || sens.value.len() != layers {
        return Err(EngineError::Invalid(format!(
            "sensitivities of {} / {} layers for a model of {layers}",
            sens.key.len(),
            sens.value.len()
        )));
    }
    costs.check(budget)?;
    let mut current = Allocation {
        bits: vec![(MIN_BITS, MIN_BITS); layers],
        pairs,
    };
    loop {
        // The purchase (one more bit on one part) that removes the most predicted KL per
        // byte and still fits.
        let mut best: Option<(f64, Allocation)> = None;
        for (l, spec) in specs.iter().enumerate() {
            for key in [true, false] {
                let (k, v) = current.bits[l];
                let (bits, dim, s) = if key {
                    (k, spec.head_dim, sens.key[l])
                } else {
                    (v, spec.value_dim, sens.value[l])
                };
                if bits >= MAX_BITS {
                    continue;
                }
                let mut next = current.clone();
                next.bits[l] = if key { (k + 1, v) } else { (k, v + 1) };
                let cost = (spec.kv_heads * dim) as f64;
                let gain =
                    s * (relative_error(dim, bits, pairs) - relative_error(dim, bits + 1, pairs));
                let rate = gain / cost;
                if best.as_ref().is_some_and(|(r, _)| *r >= rate) {
                    continue;
                }
                if costs.bits_per_element(&next) <= budget {
                    best = Some((rate, next));
                }
            }
        }
        match best {
            Some((_, next)) => current = next,
            None => return Ok(current),
        }
    }
}

/// The allocation as a `--kv-config` file: every layer listed with its `turbo:K:V`.
pub fn config_json(allocation: &Allocation, kv_start: usize) -> serde_json::Value {
    let layers: Vec<serde_json::Value> = allocation
        .bits
        .iter()
        .enumerate()
        .map(|(l, &(k, v))| {
            serde_json::json!({ "layer": l, "scheme": turbo(k, v, allocation.pairs).to_string() })
        })
        .collect();
    serde_json::json!({
        "default": turbo(PROBE_BITS, PROBE_BITS, allocation.pairs).to_string(),
        "quantized_kv_start": kv_start,
        "layers": layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kv::Retention;

    fn specs(n: usize) -> Vec<LayerSpec> {
        (0..n)
            .map(|_| LayerSpec {
                kv_heads: 1,
                head_dim: 64,
                value_dim: 64,
                retention: Retention::Full,
            })
            .collect()
    }

    /// Against every allocation of a small model, enumerated: the greedy one is the
    /// cheapest in predicted KL among those within the budget, and within it.
    #[test]
    fn greedy_allocation_is_the_best_within_budget() {
        let specs = specs(2);
        let sens = Sensitivity {
            key: vec![0.05, 0.004],
            value: vec![0.002, 0.01],
        };
        let costs = Costs::new(&specs).unwrap();
        let widths = MIN_BITS..=MAX_BITS;
        for pairs in [false, true] {
            let mut every = Vec::new();
            for a in widths.clone() {
                for b in widths.clone() {
                    for c in widths.clone() {
                        for d in widths.clone() {
                            let other = Allocation {
                                bits: vec![(a, b), (c, d)],
                                pairs,
                            };
                            let bits = costs.bits_per_element(&other);
                            every.push((predicted_kl(&specs, &sens, &other), bits, other));
                        }
                    }
                }
            }
            for budget in [2.6, 3.3, 4.0, 4.5, 6.0] {
                let got = allocate(&specs, &costs, &sens, budget, pairs).unwrap();
                let got_bits = costs.bits_per_element(&got);
                assert!(got_bits <= budget, "{got_bits} over {budget}");
                let got_kl = predicted_kl(&specs, &sens, &got);
                for (kl, bits, other) in &every {
                    if *bits <= budget {
                        assert!(
                            got_kl <= kl * (1.0 + 1e-9),
                            "budget {budget}: {got:?} ({got_kl}) vs {other:?} ({kl})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_budget_below_two_bits_is_refused() {
        let sens = Sensitivity {
            key: vec![0.1; 3],
            value: vec![0.1; 3],
        };
        let specs = specs(3);
        let costs = Costs::new(&specs).unwrap();
        let err = allocate(&specs, &costs, &sens, 2.0, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("below the smallest"), "{err}");
    }

    #[test]
    fn the_config_file_reads_back_as_the_same_scheme() {
        for pairs in [false, true] {
            let allocation = Allocation {
                bits: vec![(6, 3), (4, 4), (8, 2)],
                pairs,
            };
            let text = config_json(&allocation, 1).to_string();
            assert_eq!(text.contains(":pairs"), pairs, "{text}");
            let parsed = KvScheme::from_config_json(&text).unwrap();
            assert_eq!(parsed, scheme(&allocation, 1));
        }
    }
}
