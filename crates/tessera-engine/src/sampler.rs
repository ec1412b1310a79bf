//! Token sampling: greedy, or temperature with top-k, top-p and min-p filters, a
//! repetition penalty (as in llama.cpp's and mlx-lm's samplers) and OpenAI's presence and
//! frequency penalties. Seeded and reproducible.

use crate::EngineError;
use candle_core::{CpuStorage, Storage, Tensor, D};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

/// Sampling settings. `temperature == 0` is greedy.
#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    /// Divides positive (multiplies negative) logits of tokens already seen; 1.0 is off.
    pub repetition_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    pub repetition_window: usize,
    /// Subtracted from the logit of every token this sampler has already picked (OpenAI's
    /// `presence_penalty`, -2 to 2; 0 is off).
    pub presence_penalty: f32,
    /// Subtracted once per earlier pick of the token (OpenAI's `frequency_penalty`).
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl SamplerConfig {
    /// Checks every setting; the error names the setting as the CLI and OpenAI's API
    /// spell it (`top_p`, …), so both front ends report the same thing.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |what: &str| Err(EngineError::Invalid(what.to_string()));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature must be a finite number >= 0");
        }
        if self.top_k == Some(0) {
            return bad("top_k must be at least 1 when set");
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad("top_p must be in (0, 1]");
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return bad("min_p must be in [0, 1]");
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty must be a finite number > 0");
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(EngineError::Invalid(format!("{name} must be in [-2, 2]")));
            }
        }
        Ok(())
    }
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: 1.0,
            repetition_window: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

pub struct Sampler {
    config: SamplerConfig,
    state: u64,
    /// How often each token was picked (for the presence and frequency penalties).
    picked: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Self {
        let state = config.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler {
            config,
            state,
            picked: HashMap::new(),
        }
    }

    /// SplitMix64: small, fast, and good enough for sampling. A uniform draw in [0, 1).
    pub(crate) fn uniform(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Picks the next token from `logits`, given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let dist = self.distribution(logits, history, &[]);
        let token = self.draw(&dist);
        self.record(token);
        token
    }

    /// A token from `dist` (no randomness spent on a single candidate, so greedy output
    /// never depends on the seed).
    pub fn draw(&mut self, dist: &Dist) -> u32 {
        if dist.ids.len() == 1 {
            return dist.ids[0];
        }
        let u = self.uniform();
        dist.draw(u)
    }

    /// Counts `token` as picked (the presence and frequency penalties' memory).
    pub fn record(&mut self, token: u32) {
        if self.config.presence_penalty != 0.0 || self.config.frequency_penalty != 0.0 {
            *self.picked.entry(token).or_default() += 1;
        }
    }

    /// The distribution the next token is drawn from: the penalties, temperature and
    /// filters applied to `logits`, given the tokens so far (`history`, for the repetition
    /// penalty) and `pending` tokens that count as picked without having been recorded yet
    /// (a speculative round's earlier drafts). Greedy is a single candidate.
    pub fn distribution(&self, logits: &[f32], history: &[u32], pending: &[u32]) -> Dist {
        let c = &self.config;
        let penalized = c.presence_penalty != 0.0 || c.frequency_penalty != 0.0;
        if c.temperature <= 0.0
            && c.repetition_penalty == 1.0
            && (!penalized || (self.picked.is_empty() && pending.is_empty()))
        {
            // Greedy with nothing to penalize: no copy of the vocabulary's logits (a
            // megabyte per row per step at Gemma's 262k).
            return Dist::point(argmax(logits));
        }
        let mut logits = logits.to_vec();
        if penalized {
            let mut picked = self.picked.clone();
            for &t in pending {
                *picked.entry(t).or_default() += 1;
            }
            for (&id, &count) in &picked {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= c.presence_penalty + c.frequency_penalty * count as f32;
                }
            }
        }
        if c.repetition_penalty != 1.0 {
            let start = history.len().saturating_sub(c.repetition_window);
            let mut seen: Vec<u32> = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / c.repetition_penalty
                    } else {
                        *l * c.repetition_penalty
                    };
                }
            }
        }
        if c.temperature <= 0.0 {
            return Dist::point(argmax(&logits));
        }
        // Candidates sorted by logit, best first; filters cut the tail.
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = c.top_k.unwrap_or(logits.len()).clamp(1, logits.len());
        if k < idx.len() {
            idx.select_nth_unstable_by(k - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
            idx.truncate(k);
        }
        idx.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let max = logits[idx[0] as usize];
        let mut probs: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i as usize] - max) / c.temperature).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        let mut keep = probs.len();
        if let Some(min_p) = c.min_p {
            let floor = probs[0] * min_p;
            keep = keep.min(probs.iter().position(|&p| p < floor).unwrap_or(keep).max(1));
        }
        if let Some(top_p) = c.top_p {
            let mut acc = 0.0;
            for (i, p) in probs.iter().enumerate().take(keep) {
                acc += p;
                if acc >= top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        idx.truncate(keep);
        probs.truncate(keep);
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        Dist { ids: idx, probs }
    }
}

/// A sampling distribution: the candidates left after the filters, best first, with
/// probabilities that sum to 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Dist {
    pub ids: Vec<u32>,
    pub probs: Vec<f32>,
}

impl Dist {
    /// All mass on `id` (greedy, or a deterministic draft).
    pub fn point(id: u32) -> Self {
        Dist {
            ids: vec![id],
            probs: vec![1.0],
        }
    }

    /// The probability of `id` (0 outside the candidates).
    pub fn prob(&self, id: u32) -> f32 {
        self.ids
            .iter()
            .position(|&i| i == id)
            .map_or(0.0, |at| self.probs[at])
    }

    /// The candidate where the cumulative probability passes `u` in [0, 1).
    pub fn draw(&self, u: f32) -> u32 {
        let mut r = u;
        for (&id, &p) in self.ids.iter().zip(&self.probs) {
            r -= p;
            if r < 0.0 {
                return id;
            }
        }
        // Rounding left `u` past the sum: the last candidate with any mass.
        self.ids
            .iter()
            .zip(&self.probs)
            .rev()
            .find(|(_, &p)| p > 0.0)
            .map_or(self.ids[0], |(&id, _)| id)
    }
}

pub fn argmax(values: &[f32]) -> u32 {
    // The first index of the largest value, as a scan that keeps the first strictly greater
    // value would find it (a NaN is never greater: a row that starts with one gives 0). The
    // largest value comes from 16 independent lanes, so the loop vectorizes; a maximum is
    // exact in any order.
    let Some(&first) = values.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut blocks = values.chunks_exact(16);
    for block in &mut blocks {
        for (m, &v) in lanes.iter_mut().zip(block) {
            if v > *m {
                *m = v;
            }
        }
    }
    for &v in blocks.remainder() {
        if v > lanes[0] {
            lanes[0] = v;
        }
    }
    let top = lanes.iter().fold(first, |m, &v| if v > m { v } else { m });
    values.iter().position(|&v| v == top).unwrap_or(0) as u32
}

/// The argmax of every row of `logits` `(rows, vocab)`, on the logits' device, ties to the
/// lowest id as [`argmax`]. One reduction over a whole row runs in one block of threads on a
/// GPU (0.11 ms at a 128k vocabulary, a tenth of a batch-1 step); so the rows are cut into
/// up to 256 equal chunks reduced in parallel, and the host picks among the chunks' maxima.
/// Host logits are scanned where they lie ([`argmax`] per row: candle's two reductions took
/// a fifth of a 16-row Gemma step on two cores).
pub fn argmax_rows(logits: &Tensor) -> candle_core::Result<Vec<u32>> {
    let (rows, vocab) = logits.dims2()?;
    {
        let (storage, layout) = logits.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            let data = &data[start..end];
            // Rows spread over the matmuls' thread pool (its workers spin between jobs).
            let chosen: Vec<AtomicU32> = (0..rows).map(|_| AtomicU32::new(0)).collect();
            candle_core::utils::barrier_pool().execute_chunked(rows, |range| {
                for r in range {
                    let row = &data[r * vocab..(r + 1) * vocab];
                    chosen[r].store(argmax(row), Ordering::Relaxed);
                }
            });
            return Ok(chosen.into_iter().map(AtomicU32::into_inner).collect());
        }
    }
    argmax_rows_by_chunks(logits, rows, vocab)
}

/// [`argmax_rows`] on the logits' device: each row's chunks reduced there.
fn argmax_rows_by_chunks(
    logits: &Tensor,
    rows: usize,
    vocab: usize,
) -> candle_core::Result<Vec<u32>> {
    let chunks = (1..=256.min(vocab))
        .rev()
        .find(|c| vocab % c == 0)
        .unwrap_or(1);
    let width = vocab / chunks;
    let split = logits.reshape((rows, chunks, width))?;
    let (maxima, within) = (split.max(D::Minus1)?, split.argmax(D::Minus1)?);
    let (maxima, within): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (maxima.to_vec2()?, within.to_vec2()?);
    Ok(maxima
        .iter()
        .zip(&within)
        .map(|(m, w)| {
            let c = argmax(m) as usize;
            (c * width) as u32 + w[c]
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_and_penalty_changes_it() {
        let logits = [0.1, 2.0, 1.9, -1.0];
        assert_eq!(
            Sampler::new(SamplerConfig::default()).sample(&logits, &[]),
            1
        );
        let cfg = SamplerConfig {
            repetition_penalty: 1.5,
            ..Default::default()
        };
        assert_eq!(Sampler::new(cfg).sample(&logits, &[1]), 2);
    }

    #[test]
    fn top_k_one_is_greedy_and_seeds_reproduce() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.3).collect();
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_k: Some(1),
            ..Default::default()
        };
        assert_eq!(Sampler::new(cfg).sample(&logits, &[]), argmax(&logits));
        let cfg = SamplerConfig {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..20).map(|_| s.sample(&logits, &[])).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg);
            (0..20).map(|_| s.sample(&logits, &[])).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&t| t != a[0]),
            "temperature 1 should not always pick one token"
        );
    }

    #[test]
    fn presence_and_frequency_penalties_count_earlier_picks() {
        // Greedy over fixed logits: without penalties token 0 forever; a frequency penalty
        // of 0.6 against a lead of 1.0 makes the sampler alternate once token 0 was picked
        // twice (2 × 0.6 > 1.0), a presence penalty of 1.5 after one pick.
        let logits = [3.0, 2.0, -1.0];
        let run = |cfg: SamplerConfig| {
            let mut s = Sampler::new(cfg);
            (0..6).map(|_| s.sample(&logits, &[])).collect::<Vec<u32>>()
        };
        assert_eq!(run(SamplerConfig::default()), vec![0; 6]);
        let freq = SamplerConfig {
            frequency_penalty: 0.6,
            ..Default::default()
        };
        assert_eq!(run(freq), vec![0, 0, 1, 0, 1, 0]);
        let presence = SamplerConfig {
            presence_penalty: 1.5,
            ..Default::default()
        };
        assert_eq!(run(presence), vec![0, 1, 0, 0, 0, 0]);
    }

    #[test]
    fn validation_names_the_setting() {
        let ok = SamplerConfig::default();
        assert!(ok.validate().is_ok());
        let cases = [
            (
                SamplerConfig {
                    temperature: -1.0,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                SamplerConfig {
                    temperature: f32::NAN,
                    ..ok.clone()
                },
                "temperature",
            ),
            (
                SamplerConfig {
                    top_p: Some(0.0),
                    ..ok.clone()
                },
                "top_p",
            ),
            (
                SamplerConfig {
                    min_p: Some(1.5),
                    ..ok.clone()
                },
                "min_p",
            ),
            (
                SamplerConfig {
                    top_k: Some(0),
                    ..ok.clone()
                },
                "top_k",
            ),
            (
                SamplerConfig {
                    repetition_penalty: 0.0,
                    ..ok.clone()
                },
                "repetition_penalty",
            ),
            (
                SamplerConfig {
                    presence_penalty: 2.5,
                    ..ok.clone()
                },
                "presence_penalty",
            ),
            (
                SamplerConfig {
                    frequency_penalty: -3.0,
                    ..ok.clone()
                },
                "frequency_penalty",
            ),
        ];
        for (cfg, name) in cases {
            let err = cfg.validate().expect_err(name).to_string();
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        let logits = [10.0, 9.9, 0.0, -5.0];
        let cfg = SamplerConfig {
            temperature: 1.0,
            min_p: Some(0.5),
            seed: 3,
            ..Default::default()
        };
        let mut s = Sampler::new(cfg);
        for _ in 0..50 {
            assert!(s.sample(&logits, &[]) < 2);
        }
        let cfg = SamplerConfig {
            temperature: 1.0,
            top_p: Some(0.4),
            seed: 3,
            ..Default::default()
        };
        let mut s = Sampler::new(cfg);
        for _ in 0..50 {
            assert_eq!(s.sample(&logits, &[]), 0);
        }
    }
    #[test]
    fn argmax_rows_matches_the_plain_argmax_with_ties_across_chunks() {
        // Vocabularies with many, few and no divisors up to 256; ties planted inside one
        // chunk and across chunks, and a row whose maximum is its last id.
        for vocab in [1000usize, 1187, 997, 262] {
            let mut rows = Vec::new();
            for r in 0..5 {
                let mut l: Vec<f32> = (0..vocab)
                    .map(|i| (((i * 7919 + r * 104729) % 1009) as f32) * 0.01 - 5.0)
                    .collect();
                match r {
                    1 => {
                        l[vocab / 3] = 50.0;
                        l[vocab / 3 + 1] = 50.0;
                    }
                    2 => {
                        l[vocab - 2] = 60.0;
                        l[7] = 60.0;
                    }
                    3 => l[vocab - 1] = 70.0,
                    _ => {}
                }
                rows.push(l);
            }
            let flat: Vec<f32> = rows.concat();
            let t = Tensor::from_vec(flat, (5, vocab), &candle_core::Device::Cpu).unwrap();
            let want: Vec<u32> = rows.iter().map(|l| first_greatest(l)).collect();
            assert_eq!(argmax_rows(&t).unwrap(), want, "vocab {vocab}");
            assert_eq!(
                argmax_rows_by_chunks(&t, 5, vocab).unwrap(),
                want,
                "vocab {vocab}, by chunks"
            );
            // A view that is not contiguous takes the chunked path.
            let wide = Tensor::cat(&[&t, &t], 1)
                .unwrap()
                .narrow(1, vocab, vocab)
                .unwrap();
            assert_eq!(argmax_rows(&wide).unwrap(), want, "vocab {vocab}, a view");
        }
    }

    /// The definition: a scan that moves only to a strictly greater value.
    fn first_greatest(values: &[f32]) -> u32 {
        let mut best = 0;
        for (i, v) in values.iter().enumerate() {
            if *v > values[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_is_the_first_strictly_greatest_value() {
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        let cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![nan, 5.0, 7.0],
            vec![1.0, nan, 7.0, nan],
            vec![-0.0, 0.0],
            vec![-1.0, 0.0, -0.0, 0.0],
            vec![f32::NEG_INFINITY; 40],
            vec![-inf, nan, nan, -inf],
            vec![3.0, inf, 2.0, inf],
        ];
        for c in &cases {
            assert_eq!(argmax(c), first_greatest(c), "{c:?}");
        }
        // Lengths around the 16 lanes, the maximum in the lanes, the rest and at ties.
        for len in [1usize, 15, 16, 17, 31, 33, 100, 1003] {
            for at in [0, len / 2, len - 1] {
                let mut v: Vec<f32> = (0..len)
                    .map(|i| ((i * 7919) % 101) as f32 * 0.5 - 20.0)
                    .collect();
                v[at] = 99.0;
                assert_eq!(argmax(&v), first_greatest(&v), "len {len}, max at {at}");
                v[len - 1] = 99.0;
                v[len / 3] = 99.0;
                assert_eq!(argmax(&v), first_greatest(&v), "len {len}, ties");
            }
        }
    }
}
