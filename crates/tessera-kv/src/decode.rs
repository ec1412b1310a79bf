//! The fused decode read: one query position per row, attended straight from the stored
//! planes of any codec. Work is split into pieces of at most [`CHUNK`] positions of one
//! (row, KV head) across the CPU pool, and the partial softmax states are merged (the
//! flash-decoding scheme). A piece's keys and values are decoded by its [`TileSource`] into
//! f32 sub-tiles of [`SUB_TILE`] positions (never the whole cache); every query head of the
//! KV head (GQA folded) is scored per key load, and values are accumulated with the
//! accumulators held in registers across positions.

use candle_core::{CpuStorage, Storage, Tensor};
use std::ops::Range;

/// Element types plain planes hold.
pub(crate) trait Element: Copy + Send + Sync {
    fn f32(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

impl Element for half::bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Element for half::f16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

/// The visible slots of one row: up to two ranges (a ring that wrapped).
#[derive(Debug, Clone)]
pub(crate) struct RowSlots {
    pub ranges: Vec<std::ops::Range<usize>>,
}

/// Geometry of one fused decode.
pub(crate) struct DecodeShape {
    pub rows: usize,
    pub kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    /// Slots per (row, head) in the planes.
    pub capacity: usize,
}

const LANES: usize = 16;

/// Positions decoded into f32 at a time inside a piece: a tile of 32 rows of 256 stays in L1.
const SUB_TILE: usize = 32;

/// Partial softmax state over a span of positions for the `group` query heads of one KV head.
pub(crate) struct Partial {
    pub max: Vec<f32>,
    pub sum: Vec<f32>,
    pub acc: Vec<f32>, // (group, value_dim)
}

/// Turns `g` rows of `n` scores into `exp(score − row max)` in place; returns each row's max
/// and sum (the partial softmax state).
#[inline(always)]
pub(crate) fn exponentiate(scores: &mut [f32], g: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut max = vec![f32::NEG_INFINITY; g];
    let mut sum = vec![0f32; g];
    for h in 0..g {
        let row = &mut scores[h * n..(h + 1) * n];
        max[h] = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        for v in row.iter_mut() {
            *v = exp_nonpositive(*v - max[h]);
        }
        sum[h] = row.iter().sum();
    }
    (max, sum)
}

/// `e^x` for `x ≤ 0` within 1e-6 relative error, in plain arithmetic that vectorizes (libm's
/// `expf` is a call per score and was 15–20% of a decode read). Below −87 the result is
/// that of −87 (≈ 1.6e-38), which a softmax sum cannot tell from 0.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0);
    // e^x = 2^k · e^r with |r| ≤ ln2 / 2; e^r by its Taylor series to r^6 (error < 3e-7).
    let k = (x * std::f32::consts::LOG2_E).round();
    let r = k.mul_add(-LN2_LO, k.mul_add(-LN2_HI, x));
    let mut p: f32 = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    f32::from_bits(((k as i32 + 127) as u32) << 23) * p
}

fn merge(parts: Vec<Partial>, group: usize, dv: usize) -> Vec<f32> {
    let mut out = vec![0f32; group * dv];
    for h in 0..group {
        let max = parts
            .iter()
            .map(|p| p.max[h])
            .fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0f32;
        for p in &parts {
            let w = (p.max[h] - max).exp();
            total += p.sum[h] * w;
            for (o, a) in out[h * dv..(h + 1) * dv]
                .iter_mut()
                .zip(&p.acc[h * dv..(h + 1) * dv])
            {
                *o += a * w;
            }
        }
        for o in &mut out[h * dv..(h + 1) * dv] {
            *o /= total;
        }
    }
    out
}

/// Positions per work item: small enough to use both cores at moderate depth, large
/// enough that the merge stays negligible.
const CHUNK: usize = 256;

/// Splits every (row, KV head) over its visible slots into pieces of at most [`CHUNK`]
/// positions, runs `kernel` on each piece across the CPU pool and merges the partial softmax
/// states. Returns `(rows, kv_heads, group, value_dim)` row-major.
pub(crate) fn run_pieces<K>(rows: &[RowSlots], s: &DecodeShape, kernel: K) -> Vec<f32>
where
    K: Fn(usize, usize, std::ops::Range<usize>) -> Partial + Sync,
{
    let (g, dv) = (s.group, s.value_dim);
    let mut items = Vec::new();
    for (r, slots) in rows.iter().enumerate() {
        for h in 0..s.kv_heads {
            for range in &slots.ranges {
                let mut start = range.start;
                while start < range.end {
                    let end = (start + CHUNK).min(range.end);
                    items.push((r, h, start..end));
                    start = end;
                }
            }
        }
    }
    let parts: Vec<std::sync::Mutex<Option<Partial>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
        for i in range {
            let (r, h, ref slots) = items[i];
            *parts[i].lock().unwrap() = Some(kernel(r, h, slots.clone()));
        }
    });
    let mut out = vec![0f32; s.rows * s.kv_heads * g * dv];
    let mut parts = parts.into_iter().map(|p| p.into_inner().unwrap().unwrap());
    let mut items = items.into_iter().peekable();
    while let Some((r, h, _)) = items.next() {
        let mut group_parts = vec![parts.next().unwrap()];
        while items.peek().is_some_and(|(r2, h2, _)| (*r2, *h2) == (r, h)) {
            items.next();
            group_parts.push(parts.next().unwrap());
        }
        let merged = merge(group_parts, g, dv);
        out[(r * s.kv_heads + h) * g * dv..][..g * dv].copy_from_slice(&merged);
    }
    out
}

/// Decodes stored positions of one (row, KV head) block into f32 rows.
pub(crate) trait TileSource: Sync {
    fn keys(&self, block: usize, slots: Range<usize>, out: &mut [f32]);
    fn values(&self, block: usize, slots: Range<usize>, out: &mut [f32]);
    /// Maps one query head vector (`head_dim`) into the space the key rows are decoded in
    /// (an order of their own that unpacks faster, a rotation). Linear and orthogonal, so
    /// scores are unchanged. Default: as is.
    /// `kv_head` is the KV head the query attends.
    fn prepare_query(&self, _kv_head: usize, _q: &mut [f32]) {}
    /// Maps one output head vector (`value_dim`) from the space the value rows are decoded
    /// in back to element order, once per read. Default: as is.
    fn finish_output(&self, _kv_head: usize, _out: &mut [f32]) {}
}

/// Plain planes `(rows, kv_heads, capacity, dim)` of one element type.
struct PlainSource<'a, E> {
    keys: &'a [E],
    values: &'a [E],
    capacity: usize,
    head_dim: usize,
    value_dim: usize,
}

#[inline(always)]
fn widen<E: Element>(src: &[E], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(src) {
        *o = x.f32();
    }
}

impl<E: Element> TileSource for PlainSource<'_, E> {
    #[inline(always)]
    fn keys(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let d = self.head_dim;
        let base = block * self.capacity;
        widen(
            &self.keys[(base + slots.start) * d..(base + slots.end) * d],
            out,
        );
    }

    #[inline(always)]
    fn values(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let d = self.value_dim;
        let base = block * self.capacity;
        widen(
            &self.values[(base + slots.start) * d..(base + slots.end) * d],
            out,
        );
    }
}

/// Scores of `G` query heads (`q`: G × d, pre-scaled) against `n` key rows into
/// `out[h * stride + i]`.
#[inline(always)]
fn score_tile<const G: usize>(
    q: &[f32],
    keys: &[f32],
    n: usize,
    d: usize,
    out: &mut [f32],
    stride: usize,
) {
    for (i, k) in keys.chunks_exact(d).take(n).enumerate() {
        // One accumulator set per head: every loaded key chunk feeds all G heads.
        let mut acc = [[0f32; LANES]; G];
        for c in (0..d - d % LANES).step_by(LANES) {
            let kc = &k[c..c + LANES];
            for (h, a) in acc.iter_mut().enumerate() {
                let qc = &q[h * d + c..h * d + c + LANES];
                for l in 0..LANES {
                    a[l] = qc[l].mul_add(kc[l], a[l]);
                }
            }
        }
        for (h, a) in acc.iter().enumerate() {
            let mut total: f32 = a.iter().sum();
            for c in d - d % LANES..d {
                total += q[h * d + c] * k[c];
            }
            out[h * stride + i] = total;
        }
    }
}

/// `out (G × dv) += Σ_i weights[h * stride + i] · values[i]` over `n` value rows,
/// accumulators held across positions for one chunk of output dimensions at a time.
#[inline(always)]
fn accumulate_tile<const G: usize>(
    weights: &[f32],
    stride: usize,
    values: &[f32],
    n: usize,
    dv: usize,
    out: &mut [f32],
) {
    for c in (0..dv - dv % LANES).step_by(LANES) {
        let mut acc = [[0f32; LANES]; G];
        for (h, a) in acc.iter_mut().enumerate() {
            a.copy_from_slice(&out[h * dv + c..h * dv + c + LANES]);
        }
        for i in 0..n {
            let vc = &values[i * dv + c..i * dv + c + LANES];
            for (h, a) in acc.iter_mut().enumerate() {
                let w = weights[h * stride + i];
                for l in 0..LANES {
                    a[l] = w.mul_add(vc[l], a[l]);
                }
            }
        }
        for (h, a) in acc.iter().enumerate() {
            out[h * dv + c..h * dv + c + LANES].copy_from_slice(a);
        }
    }
    for c in dv - dv % LANES..dv {
        for h in 0..G {
            out[h * dv + c] += (0..n)
                .map(|i| weights[h * stride + i] * values[i * dv + c])
                .sum::<f32>();
        }
    }
}

/// The two tile kernels with AVX2 + FMA intrinsics: the portable loops above do not
/// vectorize across heads.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// See [`super::score_tile`]; `d` must be a multiple of 16.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn score_tile<const G: usize>(
        q: &[f32],
        keys: &[f32],
        n: usize,
        d: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        assert!(q.len() >= G * d && keys.len() >= n * d && d % 16 == 0);
        assert!(n == 0 || out.len() > (G - 1) * stride + n - 1);
        let (qp, kp) = (q.as_ptr(), keys.as_ptr());
        for i in 0..n {
            let k = kp.add(i * d);
            let mut acc = [[_mm256_setzero_ps(); 2]; G];
            for c in (0..d).step_by(16) {
                let k0 = _mm256_loadu_ps(k.add(c));
                let k1 = _mm256_loadu_ps(k.add(c + 8));
                for (h, a) in acc.iter_mut().enumerate() {
                    let qh = qp.add(h * d + c);
                    a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), k0, a[0]);
                    a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(qh.add(8)), k1, a[1]);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                out[h * stride + i] = hsum(_mm256_add_ps(a[0], a[1]));
            }
        }
    }

    /// See [`super::accumulate_tile`]; `dv` must be a multiple of 16.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn accumulate_tile<const G: usize>(
        weights: &[f32],
        stride: usize,
        values: &[f32],
        n: usize,
        dv: usize,
        out: &mut [f32],
    ) {
        assert!(values.len() >= n * dv && out.len() >= G * dv && dv % 16 == 0);
        assert!(n == 0 || weights.len() > (G - 1) * stride + n - 1);
        let (wp, vp, op) = (weights.as_ptr(), values.as_ptr(), out.as_mut_ptr());
        for c in (0..dv).step_by(16) {
            let mut acc = [[_mm256_setzero_ps(); 2]; G];
            for (h, a) in acc.iter_mut().enumerate() {
                a[0] = _mm256_loadu_ps(op.add(h * dv + c));
                a[1] = _mm256_loadu_ps(op.add(h * dv + c + 8));
            }
            for i in 0..n {
                let v = vp.add(i * dv + c);
                let (v0, v1) = (_mm256_loadu_ps(v), _mm256_loadu_ps(v.add(8)));
                for (h, a) in acc.iter_mut().enumerate() {
                    let w = _mm256_set1_ps(*wp.add(h * stride + i));
                    a[0] = _mm256_fmadd_ps(w, v0, a[0]);
                    a[1] = _mm256_fmadd_ps(w, v1, a[1]);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(op.add(h * dv + c), a[0]);
                _mm256_storeu_ps(op.add(h * dv + c + 8), a[1]);
            }
        }
    }

    /// [`score_tile`] with 512-bit vectors; `d` must be a multiple of 32.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn score_tile512<const G: usize>(
        q: &[f32],
        keys: &[f32],
        n: usize,
        d: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        assert!(q.len() >= G * d && keys.len() >= n * d && d % 32 == 0);
        assert!(n == 0 || out.len() > (G - 1) * stride + n - 1);
        let (qp, kp) = (q.as_ptr(), keys.as_ptr());
        for i in 0..n {
            let k = kp.add(i * d);
            let mut acc = [[_mm512_setzero_ps(); 2]; G];
            for c in (0..d).step_by(32) {
                let k0 = _mm512_loadu_ps(k.add(c));
                let k1 = _mm512_loadu_ps(k.add(c + 16));
                for (h, a) in acc.iter_mut().enumerate() {
                    let qh = qp.add(h * d + c);
                    a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(qh), k0, a[0]);
                    a[1] = _mm512_fmadd_ps(_mm512_loadu_ps(qh.add(16)), k1, a[1]);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                out[h * stride + i] = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
            }
        }
    }

    /// [`accumulate_tile`] with 512-bit vectors; `dv` must be a multiple of 32.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn accumulate_tile512<const G: usize>(
        weights: &[f32],
        stride: usize,
        values: &[f32],
        n: usize,
        dv: usize,
        out: &mut [f32],
    ) {
        assert!(values.len() >= n * dv && out.len() >= G * dv && dv % 32 == 0);
        assert!(n == 0 || weights.len() > (G - 1) * stride + n - 1);
        let (wp, vp, op) = (weights.as_ptr(), values.as_ptr(), out.as_mut_ptr());
        for c in (0..dv).step_by(32) {
            let mut acc = [[_mm512_setzero_ps(); 2]; G];
            for (h, a) in acc.iter_mut().enumerate() {
                a[0] = _mm512_loadu_ps(op.add(h * dv + c));
                a[1] = _mm512_loadu_ps(op.add(h * dv + c + 16));
            }
            for i in 0..n {
                let v = vp.add(i * dv + c);
                let (v0, v1) = (_mm512_loadu_ps(v), _mm512_loadu_ps(v.add(16)));
                for (h, a) in acc.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*wp.add(h * stride + i));
                    a[0] = _mm512_fmadd_ps(w, v0, a[0]);
                    a[1] = _mm512_fmadd_ps(w, v1, a[1]);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(op.add(h * dv + c), a[0]);
                _mm512_storeu_ps(op.add(h * dv + c + 16), a[1]);
            }
        }
    }
}

/// One piece: `g` query heads of one KV head over `slots`. `LEVEL`: which x86 kernels the
/// caller checked the CPU for (0 none, 1 AVX2 + FMA, 2 AVX-512 too).
#[inline(always)]
fn tile_span<S: TileSource, const G: usize, const LEVEL: u8>(
    source: &S,
    block: usize,
    q: &[f32],
    slots: Range<usize>,
    s: &DecodeShape,
) -> Partial {
    let (g, d, dv, n) = (s.group, s.head_dim, s.value_dim, slots.len());
    let mut tile = vec![0f32; SUB_TILE * d.max(dv)];
    let mut scores = vec![0f32; g * n];
    let mut acc = vec![0f32; g * dv];
    let level = match LEVEL {
        2 if d % 32 == 0 && dv % 32 == 0 => 2,
        1 | 2 if d % 16 == 0 && dv % 16 == 0 => 1,
        _ => 0,
    };
    // A group size without its own instance runs one head at a time.
    let (heads, per_call) = if G == g { (1, G) } else { (g, 1) };
    for t0 in (0..n).step_by(SUB_TILE) {
        let m = SUB_TILE.min(n - t0);
        let sub = slots.start + t0..slots.start + t0 + m;
        source.keys(block, sub, &mut tile[..m * d]);
        for h in 0..heads {
            let (q, out) = (&q[h * d..], &mut scores[h * n + t0..]);
            // SAFETY (both): the caller checked the CPU; shapes are asserted inside.
            #[cfg(target_arch = "x86_64")]
            match (level, per_call) {
                (2, 1) => unsafe { x86::score_tile512::<1>(q, &tile, m, d, out, n) },
                (2, _) => unsafe { x86::score_tile512::<G>(q, &tile, m, d, out, n) },
                (1, 1) => unsafe { x86::score_tile::<1>(q, &tile, m, d, out, n) },
                (1, _) => unsafe { x86::score_tile::<G>(q, &tile, m, d, out, n) },
                _ => {}
            }
            if level > 0 {
                continue;
            }
            match per_call {
                1 => score_tile::<1>(q, &tile, m, d, out, n),
                _ => score_tile::<G>(q, &tile, m, d, out, n),
            }
        }
    }
    let (max, sum) = exponentiate(&mut scores, g, n);
    for t0 in (0..n).step_by(SUB_TILE) {
        let m = SUB_TILE.min(n - t0);
        let sub = slots.start + t0..slots.start + t0 + m;
        source.values(block, sub, &mut tile[..m * dv]);
        for h in 0..heads {
            let (w, out) = (&scores[h * n + t0..], &mut acc[h * dv..]);
            // SAFETY (both): as above.
            #[cfg(target_arch = "x86_64")]
            match (level, per_call) {
                (2, 1) => unsafe { x86::accumulate_tile512::<1>(w, n, &tile, m, dv, out) },
                (2, _) => unsafe { x86::accumulate_tile512::<G>(w, n, &tile, m, dv, out) },
                (1, 1) => unsafe { x86::accumulate_tile::<1>(w, n, &tile, m, dv, out) },
                (1, _) => unsafe { x86::accumulate_tile::<G>(w, n, &tile, m, dv, out) },
                _ => {}
            }
            if level > 0 {
                continue;
            }
            match per_call {
                1 => accumulate_tile::<1>(w, n, &tile, m, dv, out),
                _ => accumulate_tile::<G>(w, n, &tile, m, dv, out),
            }
        }
    }
    Partial { max, sum, acc }
}

#[inline(always)]
fn tile_span_any<S: TileSource, const LEVEL: u8>(
    source: &S,
    block: usize,
    q: &[f32],
    slots: Range<usize>,
    s: &DecodeShape,
) -> Partial {
    match s.group {
        2 => tile_span::<S, 2, LEVEL>(source, block, q, slots, s),
        4 => tile_span::<S, 4, LEVEL>(source, block, q, slots, s),
        8 => tile_span::<S, 8, LEVEL>(source, block, q, slots, s),
        _ => tile_span::<S, 1, LEVEL>(source, block, q, slots, s),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_span_avx2<S: TileSource>(
    source: &S,
    block: usize,
    q: &[f32],
    slots: Range<usize>,
    s: &DecodeShape,
) -> Partial {
    tile_span_any::<S, 1>(source, block, q, slots, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn tile_span_avx512<S: TileSource>(
    source: &S,
    block: usize,
    q: &[f32],
    slots: Range<usize>,
    s: &DecodeShape,
) -> Partial {
    tile_span_any::<S, 2>(source, block, q, slots, s)
}

/// Attends `q` (rows × kv_heads × group × head_dim, f32) over `source`, each row over its
/// visible slots; returns `(rows, kv_heads, group, value_dim)` row-major.
pub(crate) fn attend_source<S: TileSource>(
    q: &[f32],
    source: &S,
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
) -> Vec<f32> {
    let (g, d, dv) = (s.group, s.head_dim, s.value_dim);
    let mut q: Vec<f32> = q.iter().map(|x| x * scale).collect();
    q.chunks_exact_mut(d)
        .enumerate()
        .for_each(|(i, head)| source.prepare_query((i / g) % s.kv_heads, head));
    #[cfg(target_arch = "x86_64")]
    let level = {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        let avx512 =
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512vl");
        avx2 as u8 + (avx2 && avx512) as u8
    };
    let out = run_pieces(rows, s, |r, h, slots| {
        let block = r * s.kv_heads + h;
        let qh = &q[block * g * d..][..g * d];
        // SAFETY (both): the features were detected above.
        #[cfg(target_arch = "x86_64")]
        match level {
            2 => return unsafe { tile_span_avx512(source, block, qh, slots, s) },
            1 => return unsafe { tile_span_avx2(source, block, qh, slots, s) },
            _ => {}
        }
        tile_span_any::<S, 0>(source, block, qh, slots, s)
    });
    let mut out = out;
    out.chunks_exact_mut(dv)
        .enumerate()
        .for_each(|(i, head)| source.finish_output((i / g) % s.kv_heads, head));
    out
}

/// Attends `q` `(rows, kv_heads * group, 1, head_dim)` over plain `keys`/`values` planes
/// `(rows, kv_heads, capacity, dim)`, each row over its visible slots.
pub(crate) fn attend(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let (ks, kl) = keys.storage_and_layout();
    let (vs, vl) = values.storage_and_layout();
    let (ko, vo) = (kl.start_offset(), vl.start_offset());
    fn source<'a, E>(k: &'a [E], v: &'a [E], s: &DecodeShape) -> PlainSource<'a, E> {
        PlainSource {
            keys: k,
            values: v,
            capacity: s.capacity,
            head_dim: s.head_dim,
            value_dim: s.value_dim,
        }
    }
    let out = match (&*ks, &*vs) {
        (Storage::Cpu(CpuStorage::BF16(k)), Storage::Cpu(CpuStorage::BF16(v))) => {
            attend_source(&qv, &source(&k[ko..], &v[vo..], s), rows, s, scale)
        }
        (Storage::Cpu(CpuStorage::F16(k)), Storage::Cpu(CpuStorage::F16(v))) => {
            attend_source(&qv, &source(&k[ko..], &v[vo..], s), rows, s, scale)
        }
        (Storage::Cpu(CpuStorage::F32(k)), Storage::Cpu(CpuStorage::F32(v))) => {
            attend_source(&qv, &source(&k[ko..], &v[vo..], s), rows, s, scale)
        }
        _ => candle_core::bail!("fused decode read needs CPU planes of one float type"),
    };
    Tensor::from_vec(
        out,
        (s.rows, s.kv_heads * s.group, 1, s.value_dim),
        q.device(),
    )
}

#[cfg(test)]
mod tests {
    use super::exp_nonpositive;

    #[test]
    fn fast_exp_matches_f64_exp() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1000.0) < 1e-37);
    }
}
