//! The fused decode read: one query position per row, attended straight from the stored
//! planes of any codec. Each (row, KV head) is cut into pieces ([`crate::read::piece`], the
//! reduction order every CPU read shares) attended across the CPU pool and folded in
//! position order (the flash-decoding scheme). A piece's keys and values are decoded by its
//! [`TileSource`] into f32 sub-tiles (never the whole cache); every query head of the KV
//! head (GQA folded) is scored per key load, and values are accumulated with the
//! accumulators held in registers across positions. This file holds the tile kernels.

use crate::planes::PlaneGeometry;
pub(crate) use crate::planes::RowSlots;
use crate::read::piece::{pieces, Dims, PieceReader, Softmax};
use crate::{Isa, KvError};
use candle_core::{Device, Tensor};
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

impl DecodeShape {
    /// The geometry of a decode read of `q` `(rows, q_heads, 1, head_dim)` over planes of
    /// `geometry` and `capacity` slots, or the error naming the mismatch.
    pub fn of(q: &Tensor, geometry: PlaneGeometry, capacity: usize) -> Result<Self, KvError> {
        let (b, qh, n, d) = q.dims4()?;
        let g = geometry;
        if b != g.rows || d != g.head_dim || n != 1 || qh % g.heads != 0 {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("a decode read over planes {g:?}"),
            });
        }
        Ok(DecodeShape {
            rows: b,
            kv_heads: g.heads,
            group: qh / g.heads,
            head_dim: d,
            value_dim: g.value_dim,
            capacity,
        })
    }

    /// A kernel's `(rows, kv_heads, group, value_dim)` output as `(rows, q_heads, 1, value_dim)`.
    pub fn output(&self, out: Vec<f32>, device: &Device) -> Result<Tensor, KvError> {
        Ok(Tensor::from_vec(
            out,
            (self.rows, self.kv_heads * self.group, 1, self.value_dim),
            device,
        )?)
    }
}

const LANES: usize = 16;

/// `e^x` for `x ≤ 0` within 1e-6 relative error, in plain arithmetic that vectorizes (libm's
/// `expf` is a call per score and was 15–20% of a decode read). Below −87 the result is
/// that of −87 (≈ 1.6e-38), which a softmax sum cannot tell from 0.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.max(-87.0);
    // e^x = 2^k · e^r with |r| ≤ ln2 / 2; e^r by its Taylor series to r^6 (error < 3e-7).
    let k = (x * std::f32::consts::LOG2_E).round();
    // Products and sums rounded apart, not fused: x86-64's baseline has no fused
    // multiply-add, and `mul_add` there is a libm call per element (60% of a portable read).
    // `k · LN2_HI` is exact (LN2_HI has 16 significant bits, |k| < 2^7).
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let mut p: f32 = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p * r + c;
    }
    f32::from_bits(((k as i32 + 127) as u32) << 23) * p
}

/// Decodes stored positions of one (row, KV head) block into f32 rows.
pub(crate) trait TileSource: Sync {
    fn keys(&self, block: usize, slots: Range<usize>, out: &mut [f32]);
    fn values(&self, block: usize, slots: Range<usize>, out: &mut [f32]);
    /// Maps one query head vector (`head_dim`) into the space the key rows are decoded in
    /// (an order of their own that unpacks faster, a rotation). Linear and orthogonal, so
    /// scores are unchanged. Default: as is.
    /// `block` is the (row · kv_heads + KV head) the query attends.
    fn prepare_query(&self, _block: usize, _q: &mut [f32]) {}
    /// Maps one output head vector (`value_dim`) from the space the value rows are decoded
    /// in back to element order, once per read. Default: as is.
    fn finish_output(&self, _block: usize, _out: &mut [f32]) {}
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
                    a[l] += qc[l] * kc[l];
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
                    a[l] += w * vc[l];
                }
            }
        }
        for (h, a) in acc.iter().enumerate() {
            out[h * dv + c..h * dv + c + LANES].copy_from_slice(a);
        }
    }
    // The columns past the last whole vector: the same chain, one position at a time.
    for c in dv - dv % LANES..dv {
        for h in 0..G {
            for i in 0..n {
                out[h * dv + c] += weights[h * stride + i] * values[i * dv + c];
            }
        }
    }
}

/// The two tile kernels with AVX2 + FMA intrinsics: the portable loops above do not
/// vectorize across heads.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The lane sums of four vectors, as the four lanes of the result. Each sum is taken in
    /// one order (lanes (0 + 2) + (1 + 3) of each 128-bit half, then the halves) whatever
    /// the other vectors hold, so a key row's score does not depend on its neighbours.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum4(v: [__m256; 4]) -> __m128 {
        let t0 = _mm256_add_ps(
            _mm256_unpacklo_ps(v[0], v[1]),
            _mm256_unpackhi_ps(v[0], v[1]),
        );
        let t1 = _mm256_add_ps(
            _mm256_unpacklo_ps(v[2], v[3]),
            _mm256_unpackhi_ps(v[2], v[3]),
        );
        let (t0, t1) = (_mm256_castps_pd(t0), _mm256_castps_pd(t1));
        let u = _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(t0, t1)),
            _mm256_castpd_ps(_mm256_unpackhi_pd(t0, t1)),
        );
        _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1))
    }

    /// See [`super::score_tile`]; `d` must be a multiple of 16. Key rows go four at a
    /// time (the last block repeats the last row and drops its extra sums), heads two at a
    /// time: each q load feeds four rows and each key load two heads, and four rows' sums
    /// come out of one transposed reduction.
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
        assert!(q.len() >= G * d && keys.len() >= n * d && d.is_multiple_of(16));
        assert!(n == 0 || out.len() > (G - 1) * stride + n - 1);
        let (qp, kp) = (q.as_ptr(), keys.as_ptr());
        for i in (0..n).step_by(4) {
            let k: [*const f32; 4] = std::array::from_fn(|r| kp.add((i + r).min(n - 1) * d));
            let valid = (n - i).min(4);
            for h0 in (0..G).step_by(2) {
                let heads = (G - h0).min(2);
                let mut acc = [[_mm256_setzero_ps(); 4]; 2];
                for c in (0..d).step_by(8) {
                    let kv: [__m256; 4] = std::array::from_fn(|r| _mm256_loadu_ps(k[r].add(c)));
                    for (h, a) in acc.iter_mut().enumerate().take(heads) {
                        let qv = _mm256_loadu_ps(qp.add((h0 + h) * d + c));
                        for r in 0..4 {
                            a[r] = _mm256_fmadd_ps(qv, kv[r], a[r]);
                        }
                    }
                }
                for (h, a) in acc.iter().enumerate().take(heads) {
                    let mut sums = [0f32; 4];
                    _mm_storeu_ps(sums.as_mut_ptr(), hsum4(*a));
                    out[(h0 + h) * stride + i..][..valid].copy_from_slice(&sums[..valid]);
                }
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

    /// [`hsum4`] of 512-bit vectors: lanes (0 + 2) + (1 + 3) of each 128-bit quarter, then
    /// quarters (0 + 2) + (1 + 3), one order for every vector.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn hsum4_512(v: [__m512; 4]) -> __m128 {
        let t0 = _mm512_add_ps(
            _mm512_unpacklo_ps(v[0], v[1]),
            _mm512_unpackhi_ps(v[0], v[1]),
        );
        let t1 = _mm512_add_ps(
            _mm512_unpacklo_ps(v[2], v[3]),
            _mm512_unpackhi_ps(v[2], v[3]),
        );
        let (t0, t1) = (_mm512_castps_pd(t0), _mm512_castps_pd(t1));
        let u = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t1)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t1)),
        );
        let w = _mm512_add_ps(u, _mm512_shuffle_f32x4::<0b01_00_11_10>(u, u));
        let w = _mm512_add_ps(w, _mm512_shuffle_f32x4::<0b10_11_00_01>(w, w));
        _mm512_castps512_ps128(w)
    }

    /// [`score_tile`] with 512-bit vectors, four key rows and up to four heads at a time (as
    /// the AVX2 kernel); `d` must be a multiple of 16.
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
        assert!(q.len() >= G * d && keys.len() >= n * d && d.is_multiple_of(16));
        assert!(n == 0 || out.len() > (G - 1) * stride + n - 1);
        let (qp, kp) = (q.as_ptr(), keys.as_ptr());
        for i in (0..n).step_by(4) {
            let k: [*const f32; 4] = std::array::from_fn(|r| kp.add((i + r).min(n - 1) * d));
            let valid = (n - i).min(4);
            for h0 in (0..G).step_by(4) {
                let heads = (G - h0).min(4);
                let mut acc = [[_mm512_setzero_ps(); 4]; 4];
                for c in (0..d).step_by(16) {
                    let kv: [__m512; 4] = std::array::from_fn(|r| _mm512_loadu_ps(k[r].add(c)));
                    for (h, a) in acc.iter_mut().enumerate().take(heads) {
                        let qv = _mm512_loadu_ps(qp.add((h0 + h) * d + c));
                        for r in 0..4 {
                            a[r] = _mm512_fmadd_ps(qv, kv[r], a[r]);
                        }
                    }
                }
                for (h, a) in acc.iter().enumerate().take(heads) {
                    let mut sums = [0f32; 4];
                    _mm_storeu_ps(sums.as_mut_ptr(), hsum4_512(*a));
                    out[(h0 + h) * stride + i..][..valid].copy_from_slice(&sums[..valid]);
                }
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

/// The tile kernels a decode runs: the widest its [`Isa`] and dimensions allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tiles {
    Portable,
    /// AVX2 + FMA: key and value rows are multiples of 16 wide.
    Avx2,
    /// AVX-512 F: key and value rows are multiples of 32 wide.
    Avx512,
}

impl Tiles {
    /// The kernels for `isa` over `d`-wide keys and `dv`-wide values. Built only here, with
    /// `isa` capped to the CPU's level, so an x86 variant means the CPU runs its kernels.
    pub(crate) fn new(isa: Isa, d: usize, dv: usize) -> Tiles {
        let isa = isa.capped();
        if isa.avx512() && d % 32 == 0 && dv % 32 == 0 {
            Tiles::Avx512
        } else if isa.avx2() && d % 16 == 0 && dv % 16 == 0 {
            Tiles::Avx2
        } else {
            Tiles::Portable
        }
    }
}

/// [`score_tile`] by the kernels `tiles` names.
#[inline(always)]
pub(crate) fn score<const G: usize>(
    tiles: Tiles,
    q: &[f32],
    keys: &[f32],
    n: usize,
    d: usize,
    out: &mut [f32],
    stride: usize,
) {
    // SAFETY (both): `Tiles::new` names an x86 kernel only at a level capped to the CPU's;
    // the kernels assert the shapes they index.
    match tiles {
        #[cfg(target_arch = "x86_64")]
        Tiles::Avx512 => unsafe { x86::score_tile512::<G>(q, keys, n, d, out, stride) },
        #[cfg(target_arch = "x86_64")]
        Tiles::Avx2 => unsafe { x86::score_tile::<G>(q, keys, n, d, out, stride) },
        _ => score_tile::<G>(q, keys, n, d, out, stride),
    }
}

/// [`accumulate_tile`] by the kernels `tiles` names.
#[inline(always)]
pub(crate) fn accumulate<const G: usize>(
    tiles: Tiles,
    weights: &[f32],
    stride: usize,
    values: &[f32],
    n: usize,
    dv: usize,
    out: &mut [f32],
) {
    // SAFETY (both): as in [`score`].
    match tiles {
        #[cfg(target_arch = "x86_64")]
        Tiles::Avx512 => unsafe {
            x86::accumulate_tile512::<G>(weights, stride, values, n, dv, out)
        },
        #[cfg(target_arch = "x86_64")]
        Tiles::Avx2 => unsafe { x86::accumulate_tile::<G>(weights, stride, values, n, dv, out) },
        _ => accumulate_tile::<G>(weights, stride, values, n, dv, out),
    }
}

/// Attends `q` (rows × kv_heads × group × head_dim, f32) over `source`, each row over its
/// visible slots, with the kernels of `isa` (capped to the CPU's); returns `(rows, kv_heads,
/// group, value_dim)` row-major. Every (row, KV head) is cut into pieces
/// ([`crate::read::piece`]) attended across the CPU pool, then folded in position order. A
/// source with an order of its own must have chosen it for the same `isa`.
pub(crate) fn attend_source<S: TileSource>(
    q: &[f32],
    source: &S,
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
    isa: Isa,
) -> Vec<f32> {
    let (g, d, dv) = (s.group, s.head_dim, s.value_dim);
    let reader = PieceReader::new(
        isa,
        Dims {
            group: g,
            head_dim: d,
            value_dim: dv,
        },
    );
    let mut q: Vec<f32> = q.iter().map(|x| x * scale).collect();
    q.chunks_exact_mut(d)
        .enumerate()
        .for_each(|(i, head)| source.prepare_query(i / g, head));
    let cuts: Vec<_> = rows
        .iter()
        .map(|slots| pieces(&slots.ranges, slots.first_position))
        .collect();
    let mut items = Vec::new();
    for (r, cut) in cuts.iter().enumerate() {
        for h in 0..s.kv_heads {
            items.extend(cut.iter().map(|parts| (r * s.kv_heads + h, parts)));
        }
    }
    let states: Vec<std::sync::Mutex<Option<Softmax>>> =
        items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
        for i in range {
            let (block, parts) = items[i];
            let n: usize = parts.iter().map(|p| p.len()).sum();
            let qh = &q[block * g * d..][..g * d];
            let state = reader
                .attend(source, block, parts, qh, &[0..n])
                .pop()
                .flatten();
            *states[i].lock().unwrap_or_else(|e| e.into_inner()) = state;
        }
    });
    let mut out = vec![0f32; s.rows * s.kv_heads * g * dv];
    let mut folded: Vec<Softmax> = (0..s.rows * s.kv_heads)
        .map(|_| Softmax::empty(reader.dims))
        .collect();
    for ((block, _), state) in items.iter().zip(states) {
        if let Some(state) = state.into_inner().unwrap_or_else(|e| e.into_inner()) {
            folded[*block].fold(&state);
        }
    }
    for (block, state) in folded.iter().enumerate() {
        state.output(&mut out[block * g * dv..(block + 1) * g * dv]);
    }
    out.chunks_exact_mut(dv)
        .enumerate()
        .for_each(|(i, head)| source.finish_output(i / g, head));
    out
}

/// Attends `q` (rows × kv_heads × group × head_dim) over plain planes `(rows, kv_heads,
/// capacity, dim)` of one element type, each row over its visible slots; returns `(rows,
/// kv_heads, group, value_dim)` row-major.
pub(crate) fn attend_plain<E: Element>(
    q: &[f32],
    keys: &[E],
    values: &[E],
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
    isa: Isa,
) -> Vec<f32> {
    let source = PlainSource {
        keys,
        values,
        capacity: s.capacity,
        head_dim: s.head_dim,
        value_dim: s.value_dim,
    };
    attend_source(q, &source, rows, s, scale, isa)
}

/// The fused chunk read of plain planes `(rows, kv_heads, capacity, dim)`: the causal
/// window of `q` attended tile by tile across the CPU pool ([`crate::read::chunk`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn chunk_plain<E: Element>(
    q: &candle_core::Tensor,
    keys: &[E],
    values: &[E],
    capacity: usize,
    head_dim: usize,
    value_dim: usize,
    geometry: &crate::planes::ChunkGeometry,
    scale: f32,
    isa: Isa,
) -> candle_core::Result<candle_core::Tensor> {
    let source = PlainSource {
        keys,
        values,
        capacity,
        head_dim,
        value_dim,
    };
    crate::read::chunk::attend_source(q, &source, geometry, scale, isa)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `n` pseudo-random words from `seed` (splitmix64): test data without a generator crate.
    pub(crate) fn random_words(seed: u64, n: usize) -> Vec<u32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) as u32
            })
            .collect()
    }

    /// `n` pseudo-random values in [-1, 1) from `seed`.
    pub(crate) fn values(seed: u64, n: usize) -> Vec<f32> {
        random_words(seed, n)
            .into_iter()
            .map(|w| (w >> 8) as f32 / (1 << 23) as f32 - 1.0)
            .collect()
    }

    #[test]
    fn tiles_follow_the_level_and_the_dimensions() {
        for isa in Isa::supported() {
            // What each level runs where both dimensions are multiples of 32, and of 16 only.
            let (wide, narrow) = match isa {
                Isa::Portable => (Tiles::Portable, Tiles::Portable),
                Isa::Avx2 => (Tiles::Avx2, Tiles::Avx2),
                Isa::Avx512 | Isa::Avx512Vnni | Isa::Amx => (Tiles::Avx512, Tiles::Avx2),
            };
            assert_eq!(Tiles::new(isa, 64, 256), wide, "{isa}");
            assert_eq!(Tiles::new(isa, 64, 48), narrow, "{isa}");
            assert_eq!(Tiles::new(isa, 24, 32), Tiles::Portable, "{isa}");
        }
    }

    /// Holds [`score`] and [`accumulate`] for `G` heads, at every level this CPU runs, to the
    /// sums written out in f64.
    fn check_tiles<const G: usize>() {
        // Scores and weights of head h sit at h * stride: a stride wider than the rows.
        let (n, stride) = (7, 11);
        for isa in Isa::supported() {
            for d in [16, 24, 32, 64, 256] {
                let tiles = Tiles::new(isa, d, d);
                let what = format!("{isa} ({tiles:?}), {G} heads, d {d}");
                let (q, keys) = (values(1, G * d), values(2, n * d));
                let mut scores = vec![f32::NAN; (G - 1) * stride + n];
                score::<G>(tiles, &q, &keys, n, d, &mut scores, stride);
                for h in 0..G {
                    for i in 0..n {
                        let terms = (0..d).map(|c| q[h * d + c] as f64 * keys[i * d + c] as f64);
                        let want: f64 = terms.clone().sum();
                        let bound = 1e-6 * terms.map(f64::abs).sum::<f64>() + 1e-6;
                        let got = scores[h * stride + i] as f64;
                        assert!(
                            (got - want).abs() <= bound,
                            "score, {what}, head {h}, key {i}: {got} vs {want}"
                        );
                    }
                }
                let (weights, rows) = (values(3, (G - 1) * stride + n), values(4, n * d));
                let start = values(5, G * d);
                let mut out = start.clone();
                accumulate::<G>(tiles, &weights, stride, &rows, n, d, &mut out);
                for h in 0..G {
                    for c in 0..d {
                        let want = start[h * d + c] as f64
                            + (0..n)
                                .map(|i| weights[h * stride + i] as f64 * rows[i * d + c] as f64)
                                .sum::<f64>();
                        let got = out[h * d + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5,
                            "accumulate, {what}, head {h}, column {c}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn tile_kernels_match_f64_sums_at_every_level() {
        check_tiles::<1>();
        check_tiles::<2>();
        check_tiles::<3>();
        check_tiles::<4>();
        check_tiles::<8>();
    }

    /// Softmax attention of one query head over rows `positions` of `keys` (`d` wide) and
    /// `values` (`dv` wide), in f64 from its definition.
    fn attention_f64(
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        positions: &[usize],
        scale: f32,
    ) -> Vec<f64> {
        let (d, dv) = (q.len(), values.len() / (keys.len() / q.len()));
        let scores: Vec<f64> = positions
            .iter()
            .map(|&p| {
                let k = &keys[p * d..][..d];
                let dot: f64 = q.iter().zip(k).map(|(a, b)| *a as f64 * *b as f64).sum();
                scale as f64 * dot
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        (0..dv)
            .map(|c| {
                let weighted = positions.iter().zip(&weights);
                weighted
                    .map(|(&p, w)| w * values[p * dv + c] as f64)
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    /// The whole decode (pieces, tiles, softmax, merge) at every level this CPU runs, for
    /// group sizes with and without their own instance, against softmax attention in f64.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one range per row is the common case
    fn attend_source_matches_f64_attention_at_every_level() {
        let (rows, kv_heads, capacity) = (2, 2, 300);
        // Row 0 spans two pieces (folded); row 1 is a wrapped ring.
        let visible = [vec![3..300], vec![250..300, 0..20]];
        let slots: Vec<RowSlots> = visible
            .iter()
            .map(|r| RowSlots {
                ranges: r.clone(),
                first_position: r[0].start,
            })
            .collect();
        let dims = [
            (16, 16),
            (24, 24),
            (32, 32),
            (64, 64),
            (256, 256),
            (64, 16),
            (32, 256),
        ];
        for isa in Isa::supported() {
            for group in [1, 2, 3, 4, 8] {
                for (d, dv) in dims {
                    let s = DecodeShape {
                        rows,
                        kv_heads,
                        group,
                        head_dim: d,
                        value_dim: dv,
                        capacity,
                    };
                    let keys = values(6, rows * kv_heads * capacity * d);
                    let vals = values(7, rows * kv_heads * capacity * dv);
                    let q = values(8, rows * kv_heads * group * d);
                    let scale = 3.0 / (d as f32).sqrt();
                    let source = PlainSource {
                        keys: &keys[..],
                        values: &vals[..],
                        capacity,
                        head_dim: d,
                        value_dim: dv,
                    };
                    let got = attend_source(&q, &source, &slots, &s, scale, isa);
                    for head in 0..rows * kv_heads * group {
                        let (block, r) = (head / group, head / group / kv_heads);
                        let positions: Vec<usize> = visible[r].iter().cloned().flatten().collect();
                        let want = attention_f64(
                            &q[head * d..][..d],
                            &keys[block * capacity * d..][..capacity * d],
                            &vals[block * capacity * dv..][..capacity * dv],
                            &positions,
                            scale,
                        );
                        for (c, want) in want.into_iter().enumerate() {
                            let out = got[head * dv + c] as f64;
                            assert!(
                                (out - want).abs() <= 2e-5,
                                "{isa}, group {group}, d {d}, dv {dv}, query head {head}, \
                                 column {c}: {out} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

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
