//! Token sampling: greedy, or temperature with top-k, top-p and min-p filters, and a
//! repetition penalty (as in llama.cpp's and mlx-lm's samplers). Seeded and reproducible.

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
    pub seed: u64,
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
            seed: 0,
        }
    }
}

pub struct Sampler {
    config: SamplerConfig,
    state: u64,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Self {
        let state = config.seed ^ 0x9E37_79B9_7F4A_7C15;
        Sampler { config, state }
    }

    /// SplitMix64: small, fast, and good enough for sampling.
    fn next_f32(&mut self) -> f32 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Picks the next token from `logits`, given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let c = &self.config;
        let mut logits = logits.to_vec();
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
            return argmax(&logits);
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
        let total: f32 = probs[..keep].iter().sum();
        let mut r = self.next_f32() * total;
        for i in 0..keep {
            r -= probs[i];
            if r <= 0.0 {
                return idx[i];
            }
        }
        idx[keep - 1]
    }
}

pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
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
}
