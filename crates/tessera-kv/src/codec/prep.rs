//! Per-channel preparation of the keys a TurboQuant plane encodes: an optional mean (per
//! row and KV head) subtracted and optional per-channel scales divided out before the rotation,
//! both fitted once on what the bf16 stage holds at conversion and folded back in the
//! reads (the query is multiplied by the scales; softmax ignores the mean's constant).
//!
//! Why scales help: the rotation spreads a stored vector's quantization error evenly over
//! its coordinates, so a score `q · k` computed as `(q ∘ s) · (k / s)` has error variance
//! ∝ |q ∘ s|² |k / s|². With queries of even channels that is smallest when
//! `s_c = rms_c^½` (Cauchy–Schwarz), `rms_c` the channel's RMS over the fitted keys: large
//! channels are shrunk before quantizing and the query grows there instead.

use std::ops::Range;

/// Mean and scales per (row, KV head) block (`blocks × dim` each), for one plane. Each row
/// has its own, fitted on that row's own keys, so rows of caches converted apart can share
/// one batch (merge) and leave it (filter, extract) with the codes they were stored with.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ChannelPrep {
    dim: usize,
    mean: Option<Vec<f32>>,
    scale: Option<Vec<f32>>,
}

impl ChannelPrep {
    /// The identity preparation of `blocks` blocks, with the tables `center` / `scale` ask
    /// for (to be fitted or adopted per row).
    pub fn identity(blocks: usize, dim: usize, center: bool, scale: bool) -> Self {
        ChannelPrep {
            dim,
            mean: center.then(|| vec![0.0; blocks * dim]),
            scale: scale.then(|| vec![1.0; blocks * dim]),
        }
    }

    /// Fits on `x`, `rows × heads × n` vectors of `dim` (row-major), each (row, head) block
    /// on its positions `live[row]` only (padding is no key).
    pub fn fit(
        x: &[f32],
        heads: usize,
        n: usize,
        dim: usize,
        live: &[Range<usize>],
        center: bool,
        scale: bool,
    ) -> Self {
        let blocks = live.len() * heads;
        let mut prep = ChannelPrep::identity(blocks, dim, center, scale);
        for b in 0..blocks {
            let span = live[b / heads].clone();
            let count = span.len().max(1) as f32;
            let vectors = || span.clone().map(|i| &x[(b * n + i) * dim..][..dim]);
            let mut mean = vec![0f32; dim];
            if center {
                for v in vectors() {
                    mean.iter_mut().zip(v).for_each(|(m, v)| *m += v);
                }
                mean.iter_mut().for_each(|m| *m /= count);
            }
            if let Some(table) = prep.scale.as_mut() {
                let mut power = vec![0f32; dim];
                for v in vectors() {
                    for ((p, v), m) in power.iter_mut().zip(v).zip(&mean) {
                        *p += (v - m) * (v - m);
                    }
                }
                let mut s: Vec<f32> = power
                    .iter()
                    .map(|p| (p / count).sqrt().max(1e-6).sqrt())
                    .collect();
                // Geometric mean 1 per block: the norm stored per vector carries the overall size.
                let g = (s.iter().map(|s| s.ln()).sum::<f32>() / dim as f32).exp();
                s.iter_mut().for_each(|s| *s /= g);
                table[b * dim..][..dim].copy_from_slice(&s);
            }
            if let Some(table) = prep.mean.as_mut() {
                table[b * dim..][..dim].copy_from_slice(&mean);
            }
        }
        prep
    }

    /// Takes over `src`'s tables of row `src_row` into row `dst_row` (`heads` blocks each).
    pub fn adopt(&mut self, src: &ChannelPrep, src_row: usize, dst_row: usize, heads: usize) {
        let span = heads * self.dim;
        for (dst, from) in [(&mut self.mean, &src.mean), (&mut self.scale, &src.scale)] {
            if let (Some(d), Some(s)) = (dst.as_mut(), from.as_ref()) {
                d[dst_row * span..][..span].copy_from_slice(&s[src_row * span..][..span]);
            }
        }
    }

    /// Replaces the tables (`blocks × dim` each, empty for none), as a state gave them.
    pub fn load(&mut self, mean: Vec<f32>, scale: Vec<f32>) -> Result<(), String> {
        let want = |t: &Option<Vec<f32>>| t.as_ref().map_or(0, Vec::len);
        if mean.len() != want(&self.mean) || scale.len() != want(&self.scale) {
            return Err(format!(
                "key preparation tables of {} and {} values, expected {} and {}",
                mean.len(),
                scale.len(),
                want(&self.mean),
                want(&self.scale)
            ));
        }
        self.mean = self.mean.as_ref().map(|_| mean);
        self.scale = self.scale.as_ref().map(|_| scale);
        Ok(())
    }

    pub fn centered(&self) -> bool {
        self.mean.is_some()
    }

    pub fn scaled(&self) -> bool {
        self.scale.is_some()
    }

    /// The fitted means and scales, `blocks × dim` each, where fitted.
    pub fn tables(&self) -> (Option<&[f32]>, Option<&[f32]>) {
        (self.mean.as_deref(), self.scale.as_deref())
    }

    /// `out = (x − mean) / scale` for a vector of block `head` (row · heads + head).
    pub fn encode(&self, head: usize, x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(x);
        if let Some(m) = &self.mean {
            let m = &m[head * self.dim..];
            out.iter_mut().zip(m).for_each(|(o, m)| *o -= m);
        }
        if let Some(s) = &self.scale {
            let s = &s[head * self.dim..];
            out.iter_mut().zip(s).for_each(|(o, s)| *o /= s);
        }
    }

    /// Inverse of [`Self::encode`], in place.
    pub fn decode(&self, head: usize, x: &mut [f32]) {
        self.rescale(head, x);
        if let Some(m) = &self.mean {
            let m = &m[head * self.dim..];
            x.iter_mut().zip(m).for_each(|(x, m)| *x += m);
        }
    }

    /// `x ∘ scale`: a query's side of `(q ∘ s) · (k / s)`, or the scales put back on an
    /// attention output (whose mean a caller adds separately, if wanted).
    pub fn rescale(&self, head: usize, x: &mut [f32]) {
        if let Some(s) = &self.scale {
            let s = &s[head * self.dim..];
            x.iter_mut().zip(s).for_each(|(x, s)| *x *= s);
        }
    }

    /// Bytes held (the fitted mean and scales).
    pub fn bytes(&self) -> usize {
        4 * (self.mean.as_ref().map_or(0, Vec::len) + self.scale.as_ref().map_or(0, Vec::len))
    }
}
