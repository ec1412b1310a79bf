//! Per-channel preparation of the keys a TurboQuant plane encodes: an optional mean (per
//! row and KV head) subtracted and optional per-channel scales divided out before the rotation,
//! both fitted once on what the bf16 stage holds at conversion and folded back in the
//! reads (the query is multiplied by the scales; softmax ignores the mean's constant).
//!
//! Why scales help: the rotation spreads a stored vector's quantization error evenly over
//! its coordinates, so a score `q · k` computed as `(q ∘ s) · (k / s)` has error variance
//! ∝ Σ_c E[q_c²] s_c² · Σ_c rms_c² / s_c². By Cauchy–Schwarz that is smallest when
//! `s_c = (rms_c² / E[q_c²])^¼`, `rms_c` the channel's RMS over the fitted keys: channels
//! large in the keys are shrunk before quantizing, channels the queries weigh heavily are
//! grown (their error shrinks where it costs the most). The query moments are what the
//! layer saw before it converted ([`QueryMoments`]); with none, queries count as even
//! (`s_c = rms_c^½`).

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
    /// on its positions `live[row]` only (padding is no key), the scales weighted by
    /// `queries` (`blocks × dim` mean squares per channel) where given.
    #[allow(clippy::too_many_arguments)]
    pub fn fit(
        x: &[f32],
        heads: usize,
        n: usize,
        dim: usize,
        live: &[Range<usize>],
        center: bool,
        scale: bool,
        queries: Option<&[f32]>,
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
                if let Some(q) = queries {
                    let q = &q[b * dim..][..dim];
                    s.iter_mut()
                        .zip(q)
                        .for_each(|(s, q)| *s /= q.max(1e-12).sqrt().sqrt());
                }
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

    /// Rows of `heads` blocks kept (`keep`, as [`crate::planes::keeps_in_place`] takes it)
    /// and `added` identity rows after them ([`crate::planes::Planes::resize_rows`]).
    pub fn resize_rows(&mut self, heads: usize, keep: &[usize], added: usize) {
        let span = heads * self.dim;
        if let Some(m) = self.mean.as_mut() {
            crate::planes::resize_rows(m, span, keep, added, 0.0);
        }
        if let Some(s) = self.scale.as_mut() {
            crate::planes::resize_rows(s, span, keep, added, 1.0);
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

/// Running mean squares of the queries a layer read with, per row, KV head and channel (the
/// query heads of a group pooled onto their KV head). Per row, like the key preparation, so
/// that a row's codes never depend on the rows it shares a batch with.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryMoments {
    /// `rows × kv_heads × dim` sums of squares.
    sums: Vec<f64>,
    /// Query positions seen per row (per query head).
    counts: Vec<usize>,
    kv_heads: usize,
    q_heads: usize,
}

/// Pseudo-count of even channels the moments are shrunk towards: a handful of queries (a
/// short first prompt) must not set scales on their own.
const PRIOR_QUERIES: f64 = 16.0;

impl QueryMoments {
    /// Adds `q`, `rows × q_heads × n` vectors of `dim` (row-major), query head `h` read
    /// against KV head `h / (q_heads / kv_heads)`, row `r` at its positions `live[r]` only
    /// (padding is no query).
    pub fn observe(
        &mut self,
        q: &[f32],
        (q_heads, n, dim): (usize, usize, usize),
        kv_heads: usize,
        live: &[Range<usize>],
    ) {
        let rows = live.len();
        if kv_heads == 0
            || !q_heads.is_multiple_of(kv_heads)
            || dim == 0
            || q.len() != rows * q_heads * n * dim
        {
            return;
        }
        if self.kv_heads != kv_heads
            || self.q_heads != q_heads
            || self.sums.len() != rows * kv_heads * dim
        {
            *self = QueryMoments {
                sums: vec![0.0; rows * kv_heads * dim],
                counts: vec![0; rows],
                kv_heads,
                q_heads,
            };
        }
        let group = q_heads / kv_heads;
        for (r, span) in live.iter().enumerate() {
            let span = span.start.min(n)..span.end.min(n);
            // Position by position, so the sums' order (their last bits) is the same
            // however the positions were chunked.
            for t in span.clone() {
                for h in 0..q_heads {
                    let sums = &mut self.sums[(r * kv_heads + h / group) * dim..][..dim];
                    let v = &q[((r * q_heads + h) * n + t) * dim..][..dim];
                    sums.iter_mut()
                        .zip(v)
                        .for_each(|(s, v)| *s += f64::from(*v) * f64::from(*v));
                }
            }
            self.counts[r] += span.len();
        }
    }

    /// Whether no query has been seen.
    pub fn is_empty(&self) -> bool {
        self.counts.iter().all(|c| *c == 0)
    }

    /// The moments of row `row` of each source, in order (a merge, filter or extract).
    pub fn gather<'a>(sources: impl IntoIterator<Item = (&'a QueryMoments, usize)>) -> Self {
        let sources: Vec<_> = sources.into_iter().collect();
        let Some(shape) = sources.iter().find(|(m, _)| !m.is_empty()).map(|(m, _)| *m) else {
            return QueryMoments::default();
        };
        let span = shape.sums.len() / shape.counts.len().max(1);
        let mut out = QueryMoments {
            sums: Vec::with_capacity(sources.len() * span),
            counts: Vec::with_capacity(sources.len()),
            kv_heads: shape.kv_heads,
            q_heads: shape.q_heads,
        };
        for &(m, row) in &sources {
            let fits = m.kv_heads == shape.kv_heads
                && m.q_heads == shape.q_heads
                && row < m.counts.len()
                && m.sums.len() == m.counts.len() * span;
            if fits {
                out.sums.extend_from_slice(&m.sums[row * span..][..span]);
                out.counts.push(m.counts[row]);
            } else {
                out.sums.extend(std::iter::repeat_n(0.0, span));
                out.counts.push(0);
            }
        }
        out
    }

    /// Checks moments a state gave against the layer's `rows`, `kv_heads` and `dim`.
    pub fn check(&self, rows: usize, kv_heads: usize, dim: usize) -> Result<(), String> {
        if self.sums.is_empty() && self.counts.is_empty() {
            return Ok(());
        }
        let fits = self.kv_heads == kv_heads
            && self.counts.len() == rows
            && self.sums.len() == rows * kv_heads * dim
            && self.q_heads > 0
            && self.q_heads.is_multiple_of(kv_heads);
        if !fits {
            return Err(format!(
                "query moments of {} sums over {} rows, {} query and {} KV heads, expected \
                 {rows} rows of {kv_heads} KV heads of {dim}",
                self.sums.len(),
                self.counts.len(),
                self.q_heads,
                self.kv_heads,
            ));
        }
        if self.sums.iter().any(|s| !s.is_finite() || *s < 0.0) {
            return Err("query moments that are negative or not finite".into());
        }
        Ok(())
    }

    /// The mean squares, `rows × kv_heads × dim`, each shrunk towards its (row, head)'s
    /// channel average by [`PRIOR_QUERIES`] positions, then rounded to bf16's precision (so
    /// the order the queries were summed in never changes a code); all 1 (no weighting)
    /// for a row that saw none. `None` before any query.
    pub fn weights(&self) -> Option<Vec<f32>> {
        if self.is_empty() || self.kv_heads == 0 || self.counts.is_empty() {
            return None;
        }
        let span = self.sums.len() / self.counts.len();
        let dim = span / self.kv_heads;
        let group = (self.q_heads / self.kv_heads) as f64;
        let mut out = Vec::with_capacity(self.sums.len());
        for (row, &count) in self.sums.chunks_exact(span).zip(&self.counts) {
            let seen = count as f64;
            for head in row.chunks_exact(dim) {
                let per_channel = (seen * group).max(1.0);
                let average = head.iter().sum::<f64>() / (dim as f64 * per_channel);
                out.extend(head.iter().map(|s| {
                    let w =
                        (s / per_channel * seen + PRIOR_QUERIES * average) / (seen + PRIOR_QUERIES);
                    if count == 0 || w <= 0.0 {
                        1.0
                    } else {
                        half::bf16::from_f64(w).to_f32()
                    }
                }));
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The moments pool each query head onto its KV head (GQA), per row and over that row's
    /// live positions only, and shrink towards the (row, head)'s channel average by the
    /// prior's pseudo-count: checked against the definition, written out for 2 rows (the
    /// second's first position padding), 4 query heads on 2 KV heads, 3 positions, dim 2,
    /// seen in two appends; a gather reorders rows.
    #[test]
    fn query_moments_pool_heads_per_row_and_shrink() {
        let (rows, q_heads, n, dim, kv_heads) = (2, 4, 3, 2, 2);
        let q: Vec<f32> = (0..rows * q_heads * n * dim)
            .map(|i| ((i * 7919) % 13) as f32 - 6.0)
            .collect();
        let mut moments = QueryMoments::default();
        assert_eq!(moments.weights(), None);
        let part = |lo: usize, hi: usize| -> Vec<f32> {
            let mut part = Vec::new();
            for r in 0..rows {
                for h in 0..q_heads {
                    for t in lo..hi {
                        let at = ((r * q_heads + h) * n + t) * dim;
                        part.extend_from_slice(&q[at..at + dim]);
                    }
                }
            }
            part
        };
        moments.observe(&part(0, 1), (q_heads, 1, dim), kv_heads, &[0..1, 1..1]);
        moments.observe(&part(1, 3), (q_heads, 2, dim), kv_heads, &[0..2, 0..2]);
        let got = moments.weights().unwrap();
        assert_eq!(got.len(), rows * kv_heads * dim);
        for r in 0..rows {
            let live = if r == 0 { 0..n } else { 1..n };
            let seen = live.len() as f64;
            for kv in 0..kv_heads {
                let mut mean = [0f64; 2];
                for h in kv * 2..kv * 2 + 2 {
                    for t in live.clone() {
                        for (c, m) in mean.iter_mut().enumerate() {
                            let v = q[((r * q_heads + h) * n + t) * dim + c] as f64;
                            *m += v * v / (seen * 2.0);
                        }
                    }
                }
                let average = (mean[0] + mean[1]) / 2.0;
                for (c, m) in mean.iter().enumerate() {
                    let want = (seen * m + PRIOR_QUERIES * average) / (seen + PRIOR_QUERIES);
                    let g = got[(r * kv_heads + kv) * dim + c] as f64;
                    assert!(
                        (g - want).abs() <= want / 128.0,
                        "row {r} head {kv} channel {c}: {g} vs {want}"
                    );
                }
            }
        }
        let swapped = QueryMoments::gather([(&moments, 1), (&moments, 0)])
            .weights()
            .unwrap();
        let span = kv_heads * dim;
        assert_eq!(&swapped[..span], &got[span..]);
        assert_eq!(&swapped[span..], &got[..span]);
    }

    /// The fitted scales are `(rms_c² / E[q_c²])^¼`, normalized to a geometric mean of 1:
    /// checked against the formula on two channels (keys ±2 and ±1, query weights 1 and 4).
    #[test]
    fn query_weighted_scales_follow_the_formula() {
        let x = [2.0, 1.0, -2.0, -1.0];
        let prep = ChannelPrep::fit(&x, 1, 2, 2, &[0..2], true, true, Some(&[1.0, 4.0]));
        let (_, scale) = prep.tables();
        let raw = [(4.0f64 / 1.0).powf(0.25), (1.0f64 / 4.0).powf(0.25)];
        let g = (raw[0] * raw[1]).sqrt();
        for (got, want) in scale.unwrap().iter().zip(raw.map(|r| r / g)) {
            assert!(((*got as f64) - want).abs() < 1e-5, "{got} vs {want}");
        }
    }
}
