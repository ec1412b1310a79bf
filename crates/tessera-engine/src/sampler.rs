//! Token sampling: greedy, or temperature with top-k, top-p and min-p filters, a
//! repetition penalty (as in llama.cpp's and mlx-lm's samplers) and OpenAI's presence and
//! frequency penalties. Seeded and reproducible.

use crate::EngineError;
use candle_core::{CpuStorage, Storage, Tensor, D};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use tessera_kv::exp_nonpositive;

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
        let mut logits = Cow::Borrowed(logits);
        if penalized {
            let logits = logits.to_mut();
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
            let logits = logits.to_mut();
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
        filtered(&logits, c)
    }
}

/// The temperature and the filters over `logits`, in a pass or a few over the vocabulary:
/// only a `top_p` cut sorts, and only the candidates it may keep (a full sort of Gemma's
/// 262k ids was ≈ 7 ms a row a step on two cores).
fn filtered(logits: &[f32], c: &SamplerConfig) -> Dist {
    let n = logits.len();
    if n == 0 {
        return Dist::point(0);
    }
    // Candidates: every id, or the top_k best; each one's weight against the best one's
    // (which is 1): e^((l − max) / T).
    let mut ids: Vec<u32> = (0..n as u32).collect();
    let k = c.top_k.unwrap_or(n).clamp(1, n);
    let weights = if k < n {
        ids.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        ids.truncate(k);
        let chosen: Vec<f32> = ids.iter().map(|&i| logits[i as usize]).collect();
        weights_of(&chosen, c.temperature)
    } else {
        weights_of(logits, c.temperature)
    };
    // min_p: the candidates at least min_p times as likely as the best.
    let floor = c.min_p.unwrap_or(0.0);
    let above = |t: f32| -> Vec<usize> { (0..ids.len()).filter(|&j| weights[j] >= t).collect() };
    let kept: Option<Vec<usize>> = match c.top_p.filter(|&p| p < 1.0) {
        // top_p: the fewest best candidates (of min_p's) whose probability among all the
        // candidates reaches top_p. They are among those above some weight t: the first t
        // of 1e-2, 1e-5, … whose candidates hold that much, so only those are sorted.
        Some(top_p) => {
            let target = top_p * weights.iter().sum::<f32>();
            let mut t = floor.max(1e-2);
            let mut head = above(t);
            while t > floor && head.iter().map(|&j| weights[j]).sum::<f32>() < target {
                t = if t > 1e-8 {
                    (t * 1e-3).max(floor)
                } else {
                    floor
                };
                head = above(t);
            }
            head.sort_unstable_by(|&a, &b| weights[b].total_cmp(&weights[a]));
            let mut acc = 0.0;
            if let Some(end) = head.iter().position(|&j| {
                acc += weights[j];
                acc >= target
            }) {
                head.truncate(end + 1);
            }
            Some(head)
        }
        None if floor > 0.0 => Some(above(floor)),
        None => None,
    };
    let (ids, mut probs) = match kept {
        // Nothing passed (logits of ±inf or NaN leave no weight of 1): the best id.
        Some(kept) if kept.is_empty() => return Dist::point(argmax(logits)),
        Some(kept) => (
            kept.iter().map(|&j| ids[j]).collect::<Vec<u32>>(),
            kept.iter().map(|&j| weights[j]).collect::<Vec<f32>>(),
        ),
        None => (ids, weights),
    };
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    Dist { ids, probs }
}

/// `e^((l − max) / t)` of every logit: at AVX2 with FMA where the CPU has them (without,
/// each `mul_add` of the exponential is a library call: 5 ms a row at 262k ids), the same
/// bits either way (a fused multiply-add is exact in both).
pub(crate) fn weights_of(logits: &[f32], t: f32) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { weights_fma(logits, t) };
    }
    weights_portable(logits, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weights_fma(logits: &[f32], t: f32) -> Vec<f32> {
    weights_portable(logits, t)
}

#[inline(always)]
fn weights_portable(logits: &[f32], t: f32) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    logits
        .iter()
        .map(|&l| exp_nonpositive((l - max) / t))
        .collect()
}

/// A sampling distribution: the candidates left after the filters (best first where a top_p
/// cut sorted them, else in id order or top_k's selection order), with probabilities that
/// sum to 1.
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
    /// The filters from their definitions, in f64 over every id sorted best first (ties by
    /// id): top_k's best, then softmax at the temperature, then min_p against the best's
    /// probability, then top_p's shortest prefix reaching it; renormalized.
    fn reference(logits: &[f32], c: &SamplerConfig) -> Vec<(u32, f64)> {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        ids.truncate(c.top_k.unwrap_or(ids.len()));
        let max = logits[ids[0] as usize] as f64;
        let w: Vec<f64> = ids
            .iter()
            .map(|&i| ((logits[i as usize] as f64 - max) / c.temperature as f64).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let p: Vec<f64> = w.iter().map(|w| w / total).collect();
        let mut keep = p
            .iter()
            .take_while(|&&q| q >= p[0] * c.min_p.unwrap_or(0.0) as f64)
            .count();
        if let Some(top_p) = c.top_p {
            let mut acc = 0.0;
            if let Some(end) = p[..keep].iter().position(|q| {
                acc += q;
                acc >= top_p as f64
            }) {
                keep = end + 1;
            }
        }
        let kept: f64 = p[..keep].iter().sum();
        ids[..keep]
            .iter()
            .zip(&p)
            .map(|(&i, q)| (i, q / kept))
            .collect()
    }

    #[test]
    fn filters_match_their_definition() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        for vocab in [50usize, 3001, 40_000] {
            // Logits spread as a model's are: most far below the best few.
            let logits: Vec<f32> = (0..vocab).map(|_| next() * 20.0 - 12.0 * next()).collect();
            for temperature in [0.3f32, 1.0, 1.7] {
                for top_k in [None, Some(1), Some(7), Some(300)] {
                    for top_p in [None, Some(0.1f32), Some(0.5), Some(0.9), Some(0.999)] {
                        for min_p in [None, Some(0.01f32), Some(0.2)] {
                            let c = SamplerConfig {
                                temperature,
                                top_k,
                                top_p,
                                min_p,
                                ..Default::default()
                            };
                            let mut got: Vec<(u32, f32)> = {
                                let d = Sampler::new(c.clone()).distribution(&logits, &[], &[]);
                                d.ids.into_iter().zip(d.probs).collect()
                            };
                            got.sort_by_key(|&(i, _)| i);
                            let mut want = reference(&logits, &c);
                            want.sort_by_key(|&(i, _)| i);
                            // top_p's last candidate may differ where f32 and f64 sums
                            // straddle the target; the distributions may not.
                            if top_p.is_none() {
                                let got_ids: Vec<u32> = got.iter().map(|g| g.0).collect();
                                let want_ids: Vec<u32> = want.iter().map(|w| w.0).collect();
                                assert_eq!(got_ids, want_ids, "vocab {vocab}, {c:?}");
                            }
                            let mut tv = 0.0;
                            let (mut g, mut w) = (got.iter().peekable(), want.iter().peekable());
                            loop {
                                match (g.peek(), w.peek()) {
                                    (Some(a), Some(b)) if a.0 == b.0 => {
                                        tv += (a.1 as f64 - b.1).abs();
                                        g.next();
                                        w.next();
                                    }
                                    (Some(a), b) if b.is_none_or(|b| a.0 < b.0) => {
                                        tv += a.1 as f64;
                                        g.next();
                                    }
                                    (_, Some(b)) => {
                                        tv += b.1;
                                        w.next();
                                    }
                                    (_, None) => break,
                                }
                            }
                            assert!(
                                tv / 2.0 < 1e-3,
                                "total variation {tv}, vocab {vocab}, {c:?}"
                            );
                        }
                    }
                }
            }
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
