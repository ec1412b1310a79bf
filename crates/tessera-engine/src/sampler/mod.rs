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
        let bad = |field: &'static str, rule: &str| {
            Err(EngineError::field(field, format!("{field} {rule}")))
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", "must be a finite number >= 0");
        }
        if self.top_k == Some(0) {
            return bad("top_k", "must be at least 1 when set");
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad("top_p", "must be in (0, 1]");
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return bad("min_p", "must be in [0, 1]");
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", "must be a finite number > 0");
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(name, "must be in [-2, 2]");
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
mod tests;
