//! Per-channel preparation of the keys a TurboQuant plane encodes: an optional mean (per
//! KV head) subtracted and optional per-channel scales divided out before the rotation,
//! both fitted once on what the bf16 stage holds at conversion and folded back in the
//! reads (the query is multiplied by the scales; softmax ignores the mean's constant).
//!
//! Why scales help: the rotation spreads a stored vector's quantization error evenly over
//! its coordinates, so a score `q · k` computed as `(q ∘ s) · (k / s)` has error variance
//! ∝ |q ∘ s|² |k / s|². With queries of even channels that is smallest when
//! `s_c = rms_c^½` (Cauchy–Schwarz), `rms_c` the channel's RMS over the fitted keys: large
//! channels are shrunk before quantizing and the query grows there instead.

/// Mean and scales per KV head (`heads × dim` each), for one plane.
#[derive(Debug, Clone, Default)]
pub(crate) struct ChannelPrep {
    dim: usize,
    mean: Option<Vec<f32>>,
    scale: Option<Vec<f32>>,
}

impl ChannelPrep {
    /// Fits on `x`, `rows × heads × n` vectors of `dim` (row-major), per head.
    pub fn fit(x: &[f32], heads: usize, n: usize, dim: usize, center: bool, scale: bool) -> Self {
        let count = (x.len() / dim / heads).max(1) as f32;
        let head_of = |i: usize| (i / n.max(1)) % heads;
        let mut mean = vec![0f32; heads * dim];
        if center {
            for (i, v) in x.chunks_exact(dim).enumerate() {
                let m = &mut mean[head_of(i) * dim..][..dim];
                m.iter_mut().zip(v).for_each(|(m, v)| *m += v);
            }
            mean.iter_mut().for_each(|m| *m /= count);
        }
        let scale = scale.then(|| {
            let mut power = vec![0f32; heads * dim];
            for (i, v) in x.chunks_exact(dim).enumerate() {
                let h = head_of(i);
                let (m, p) = (&mean[h * dim..][..dim], &mut power[h * dim..][..dim]);
                for ((p, v), m) in p.iter_mut().zip(v).zip(m) {
                    *p += (v - m) * (v - m);
                }
            }
            let mut s: Vec<f32> = power
                .iter()
                .map(|p| (p / count).sqrt().max(1e-6).sqrt())
                .collect();
            // Geometric mean 1 per head: the norm stored per vector carries the overall size.
            for head in s.chunks_exact_mut(dim) {
                let g = (head.iter().map(|s| s.ln()).sum::<f32>() / dim as f32).exp();
                head.iter_mut().for_each(|s| *s /= g);
            }
            s
        });
        ChannelPrep {
            dim,
            mean: center.then_some(mean),
            scale,
        }
    }

    pub fn centered(&self) -> bool {
        self.mean.is_some()
    }

    pub fn scaled(&self) -> bool {
        self.scale.is_some()
    }

    /// The fitted means and scales, `heads × dim` each, where fitted.
    pub fn tables(&self) -> (Option<&[f32]>, Option<&[f32]>) {
        (self.mean.as_deref(), self.scale.as_deref())
    }

    /// `out = (x − mean) / scale` for a vector of `head`.
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
