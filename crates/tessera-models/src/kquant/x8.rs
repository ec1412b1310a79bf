//! Q4_K and Q6_K rows interleaved in groups of eight, for the AVX2 decode kernels.
//!
//! Why: at AVX2 a decode matmul over the file's own blocks is bound by its arithmetic, not
//! by memory (on a 2-core AMD EPYC: Q4_K at 11 GB/s where two threads stream 20), and a
//! third of that arithmetic is per row and block: unpacking the 6-bit scales, two f16
//! conversions, the minima's dot, a float multiply-add, a horizontal sum at the end. With
//! eight rows side by side every such step is one vector op for all eight: each 32-byte
//! load holds four bytes of each row, one `maddubs` against the activation's four codes
//! broadcast gives two i16 lanes per row, and the sums land one i32 lane per row, so the
//! results are stored as they are. The per-sub-block scales are applied once per 32
//! elements (the `maddubs` sums of a sub-block add up in i16 first), not once per vector.
//!
//! Layout of one group of eight rows and one 256-element superblock (rows `r`, sub-blocks
//! `s`, all sizes in bytes; a group's superblocks follow each other, then the next group's):
//! - Q4_K, 1184 bytes (1152 in the file): `d[8]`, `dmin[8]` (f16); the scales, then the
//!   minima, as `[pair p][row r][2]` = sub-blocks (2p, 2p + 1) of row r (64 bytes each);
//!   then 1024 bytes of codes: for sub-block pair p and 4-element step v, 32 bytes
//!   `[row r][t]` whose low nibble is element 4v + t of sub-block 2p, the high nibble the same
//!   of 2p + 1 (the file's own byte `qs[32p + 4v + t]`).
//! - Q6_K, 1680 bytes (as the file): `d[8]` (f16); the scales as `[run R][row r][2]` = the
//!   two 16-element halves of 32-element run R (128 bytes); the low nibbles as for Q4_K
//!   with runs (2p, 2p + 1) in place of sub-blocks (1024 bytes); the high bit pairs as
//!   `[quad i][step v][row r][t]`, runs 4i + u at bits 2u (512 bytes).

use super::{Acts, Q4Block, Q6Block, QK};

pub(super) const GROUP: usize = 8;
pub(super) const Q4X8_BYTES: usize = 1184;
pub(super) const Q6X8_BYTES: usize = 1680;
const Q4_SCALES: usize = 32;
const Q4_MINS: usize = 96;
const Q4_QS: usize = 160;
const Q6_SCALES: usize = 16;
const Q6_QL: usize = 144;
const Q6_QH: usize = 1168;

/// The whole groups of eight rows of one part, interleaved.
pub(super) struct Interleaved {
    bytes: Vec<u8>,
    kb: usize,
    q4: bool,
}

impl Interleaved {
    /// The whole groups of `blocks` (`kb` a row), `size` bytes per group and superblock,
    /// each written by `fill(out, r, block)` for its eight rows `r`.
    fn build<B>(
        blocks: &[B],
        kb: usize,
        size: usize,
        fill: impl Fn(&mut [u8], usize, &B),
    ) -> Vec<u8> {
        let groups = blocks.len() / kb / GROUP;
        let mut bytes = vec![0u8; groups * kb * size];
        for (at, out) in bytes.chunks_exact_mut(size).enumerate() {
            let (g, b) = (at / kb, at % kb);
            for r in 0..GROUP {
                fill(out, r, &blocks[(g * GROUP + r) * kb + b]);
            }
        }
        bytes
    }

    /// Rows `0..8 · (rows / 8)` of Q4_K blocks (`kb` a row).
    pub(super) fn q4(blocks: &[Q4Block], kb: usize) -> Self {
        let bytes = Self::build(blocks, kb, Q4X8_BYTES, |out, r, blk| {
            out[2 * r..2 * r + 2].copy_from_slice(&blk.d.to_le_bytes());
            out[16 + 2 * r..18 + 2 * r].copy_from_slice(&blk.dmin.to_le_bytes());
            for s in 0..8 {
                let (scale, min) = super::q4k_scale_min(s, &blk.packed);
                let at = 16 * (s / 2) + 2 * r + s % 2;
                out[Q4_SCALES + at] = scale;
                out[Q4_MINS + at] = min;
            }
            for p in 0..4 {
                for v in 0..8 {
                    let at = Q4_QS + 256 * p + 32 * v + 4 * r;
                    out[at..at + 4].copy_from_slice(&blk.qs[32 * p + 4 * v..][..4]);
                }
            }
        });
        Interleaved {
            bytes,
            kb,
            q4: true,
        }
    }

    /// Rows `0..8 · (rows / 8)` of Q6_K blocks (`kb` a row).
    pub(super) fn q6(blocks: &[Q6Block], kb: usize) -> Self {
        let bytes = Self::build(blocks, kb, Q6X8_BYTES, |out, r, blk| {
            out[2 * r..2 * r + 2].copy_from_slice(&blk.d.to_le_bytes());
            for run in 0..8 {
                for half in 0..2 {
                    out[Q6_SCALES + 16 * run + 2 * r + half] = blk.scales[2 * run + half] as u8;
                }
            }
            // Element l of run R = 4h + q: low 4 bits from `ql`, high 2 from `qh`.
            let code = |run: usize, l: usize| {
                let (h, q) = (run / 4, run % 4);
                let low = blk.ql[64 * h + 32 * (q % 2) + l];
                let low = if q < 2 { low & 15 } else { low >> 4 };
                (low, (blk.qh[32 * h + l] >> (2 * q)) & 3)
            };
            for v in 0..8 {
                for t in 0..4 {
                    let l = 4 * v + t;
                    for p in 0..4 {
                        let (a, _) = code(2 * p, l);
                        let (b2, _) = code(2 * p + 1, l);
                        out[Q6_QL + 256 * p + 32 * v + 4 * r + t] = a | (b2 << 4);
                    }
                    for i in 0..2 {
                        let mut high = 0u8;
                        for u in 0..4 {
                            high |= code(4 * i + u, l).1 << (2 * u);
                        }
                        out[Q6_QH + 256 * i + 32 * v + 4 * r + t] = high;
                    }
                }
            }
        });
        Interleaved {
            bytes,
            kb,
            q4: false,
        }
    }

    /// Whole groups held.
    pub(super) fn groups(&self) -> usize {
        let size = if self.q4 { Q4X8_BYTES } else { Q6X8_BYTES };
        self.bytes.len() / (self.kb * size)
    }

    /// Group `g` (rows 8g .. 8g + 8 of the part) against activation rows `acts_rows`, into
    /// `out[i * n + c]` for c in 0..8.
    ///
    /// # Safety
    /// The CPU runs AVX2, FMA and F16C; `g < self.groups()`; `out` is valid for those writes.
    #[cfg(target_arch = "x86_64")]
    pub(super) unsafe fn run(
        &self,
        acts: &Acts,
        g: usize,
        acts_rows: std::ops::Range<usize>,
        out: *mut f32,
        n: usize,
    ) {
        let size = if self.q4 { Q4X8_BYTES } else { Q6X8_BYTES };
        let group = self.bytes.as_ptr().add(g * self.kb * size);
        crate::q8_x8::row_tiles(acts_rows, 3, |i, mr| {
            let o = out.add(i * n);
            match (self.q4, mr) {
                (true, 3) => kernels::q4_3(acts, i, group, self.kb, o, n),
                (true, 2) => kernels::q4_2(acts, i, group, self.kb, o, n),
                (true, _) => kernels::q4_1(acts, i, group, self.kb, o, n),
                (false, 3) => kernels::q6_3(acts, i, group, self.kb, o, n),
                (false, 2) => kernels::q6_2(acts, i, group, self.kb, o, n),
                (false, _) => kernels::q6_1(acts, i, group, self.kb, o, n),
            }
        });
    }

    /// Groups `g` and `g + 1` side by side in 512-bit registers (each op of [`Self::run`]
    /// once for sixteen rows), into `out[i * n + c]` for c in 0..16. Each row's arithmetic
    /// is [`Self::run`]'s, so its outputs are the same bits.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and BW, FMA and F16C; `g + 1 < self.groups()`; `out` is valid
    /// for those writes.
    #[cfg(target_arch = "x86_64")]
    pub(super) unsafe fn run_pair(
        &self,
        acts: &Acts,
        g: usize,
        acts_rows: std::ops::Range<usize>,
        out: *mut f32,
        n: usize,
    ) {
        let size = if self.q4 { Q4X8_BYTES } else { Q6X8_BYTES };
        let group = self.bytes.as_ptr().add(g * self.kb * size);
        let stride = self.kb * size;
        crate::q8_x8::row_tiles(acts_rows, 3, |i, mr| {
            let o = out.add(i * n);
            let kb = self.kb;
            match (self.q4, mr) {
                (true, 3) => wide::q4_3(acts, i, group, stride, kb, o, n),
                (true, 2) => wide::q4_2(acts, i, group, stride, kb, o, n),
                (true, _) => wide::q4_1(acts, i, group, stride, kb, o, n),
                (false, 3) => wide::q6_3(acts, i, group, stride, kb, o, n),
                (false, 2) => wide::q6_2(acts, i, group, stride, kb, o, n),
                (false, _) => wide::q6_1(acts, i, group, stride, kb, o, n),
            }
        });
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod kernels {
    use super::*;
    use crate::q8_x8::prefetch_ahead as prefetch;
    use std::arch::x86_64::*;

    /// Four activation codes, broadcast to every row's four bytes.
    #[inline(always)]
    unsafe fn codes4(p: *const i8) -> __m256i {
        _mm256_set1_epi32((p as *const i32).read_unaligned())
    }

    /// Two i16 sums (sub-blocks or halves 2p and 2p + 1) broadcast to every row's pair.
    #[inline(always)]
    unsafe fn sums2(p: *const i16) -> __m256i {
        _mm256_set1_epi32((p as *const i32).read_unaligned())
    }

    /// For a vector of `[row][2]` i16 pairs: the first of each pair in both lanes
    /// (`EVEN`), or the second (`ODD`).
    pub(super) const EVEN: [i8; 32] = [
        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12,
        13, 12, 13,
    ];
    pub(super) const ODD: [i8; 32] = [
        2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10,
        11, 14, 15, 14, 15,
    ];

    #[inline(always)]
    unsafe fn q4<const MR: usize>(
        a: &Acts,
        i0: usize,
        group: *const u8,
        kb: usize,
        out: *mut f32,
        n: usize,
    ) {
        let k = a.k;
        let mask = _mm256_set1_epi8(0x0F);
        let even = _mm256_loadu_si256(EVEN.as_ptr() as *const __m256i);
        let odd = _mm256_loadu_si256(ODD.as_ptr() as *const __m256i);
        let mut accf = [_mm256_setzero_ps(); MR];
        let mut accm = [_mm256_setzero_ps(); MR];
        for b in 0..kb {
            let blk = group.add(b * Q4X8_BYTES);
            prefetch(blk, Q4X8_BYTES);
            let mut acc = [_mm256_setzero_si256(); MR];
            for p in 0..4 {
                let pairs = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                    blk.add(Q4_SCALES + 16 * p) as *const __m128i
                ));
                let s_lo = _mm256_shuffle_epi8(pairs, even);
                let s_hi = _mm256_shuffle_epi8(pairs, odd);
                let mut sum_lo = [_mm256_setzero_si256(); MR];
                let mut sum_hi = [_mm256_setzero_si256(); MR];
                for v in 0..8 {
                    let w = _mm256_loadu_si256(blk.add(Q4_QS + 256 * p + 32 * v) as *const __m256i);
                    let lo = _mm256_and_si256(w, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                    for r in 0..MR {
                        let aq = a.q.as_ptr().add((i0 + r) * k + b * QK + 64 * p + 4 * v);
                        // At most 8 · 2 · 15 · 127 = 30480: exact in i16.
                        sum_lo[r] =
                            _mm256_add_epi16(sum_lo[r], _mm256_maddubs_epi16(lo, codes4(aq)));
                        sum_hi[r] = _mm256_add_epi16(
                            sum_hi[r],
                            _mm256_maddubs_epi16(hi, codes4(aq.add(32))),
                        );
                    }
                }
                for r in 0..MR {
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(sum_lo[r], s_lo));
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(sum_hi[r], s_hi));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i));
            let mut mins = [_mm256_setzero_si256(); 4];
            for p in 0..4 {
                mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                    blk.add(Q4_MINS + 16 * p) as *const __m128i
                ));
            }
            for r in 0..MR {
                let at = (i0 + r) * kb + b;
                let da = _mm256_set1_ps(*a.d.get_unchecked(at));
                accf[r] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(d, da), accf[r]);
                let s32 = a.sums32.as_ptr().add(at * 8);
                let mut m = _mm256_madd_epi16(mins[0], sums2(s32));
                for p in 1..4 {
                    m = _mm256_add_epi32(m, _mm256_madd_epi16(mins[p], sums2(s32.add(2 * p))));
                }
                accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, da), accm[r]);
            }
        }
        for r in 0..MR {
            _mm256_storeu_ps(out.add(r * n), _mm256_sub_ps(accf[r], accm[r]));
        }
    }

    /// Run `run`'s two scales per row, as `[row][2]` i16 pairs.
    #[inline(always)]
    unsafe fn run_scales(blk: *const u8, run: usize) -> __m256i {
        _mm256_cvtepi8_epi16(_mm_loadu_si128(
            blk.add(Q6_SCALES + 16 * run) as *const __m128i
        ))
    }

    #[inline(always)]
    unsafe fn q6<const MR: usize>(
        a: &Acts,
        i0: usize,
        group: *const u8,
        kb: usize,
        out: *mut f32,
        n: usize,
    ) {
        let k = a.k;
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x30);
        let even = _mm256_loadu_si256(EVEN.as_ptr() as *const __m256i);
        let odd = _mm256_loadu_si256(ODD.as_ptr() as *const __m256i);
        let mut accf = [_mm256_setzero_ps(); MR];
        for b in 0..kb {
            let blk = group.add(b * Q6X8_BYTES);
            prefetch(blk, Q6X8_BYTES);
            // The codes are stored + 32: start from −32 · Σ scale · (sum of 16 codes).
            let mut acc = [_mm256_setzero_si256(); MR];
            for run in 0..8 {
                let pairs = run_scales(blk, run);
                for r in 0..MR {
                    let s16 = a.sums16.as_ptr().add(((i0 + r) * kb + b) * 16 + 2 * run);
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, sums2(s16)));
                }
            }
            for r in 0..MR {
                acc[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(acc[r], 5));
            }
            for p in 0..4 {
                // Runs 2p (low nibbles) and 2p + 1 (high), their high bits at pairs u, u + 1.
                let u = 2 * (p % 2);
                let (first, second) = (run_scales(blk, 2 * p), run_scales(blk, 2 * p + 1));
                let scales = [
                    _mm256_shuffle_epi8(first, even),
                    _mm256_shuffle_epi8(first, odd),
                    _mm256_shuffle_epi8(second, even),
                    _mm256_shuffle_epi8(second, odd),
                ];
                for half in 0..2 {
                    let mut sum_lo = [_mm256_setzero_si256(); MR];
                    let mut sum_hi = [_mm256_setzero_si256(); MR];
                    for step in 0..4 {
                        let v = 4 * half + step;
                        let w =
                            _mm256_loadu_si256(blk.add(Q6_QL + 256 * p + 32 * v) as *const __m256i);
                        let h = _mm256_loadu_si256(
                            blk.add(Q6_QH + 256 * (p / 2) + 32 * v) as *const __m256i
                        );
                        let (h_lo, h_hi) = if u == 0 {
                            (_mm256_slli_epi16(h, 4), _mm256_slli_epi16(h, 2))
                        } else {
                            (h, _mm256_srli_epi16(h, 2))
                        };
                        let lo =
                            _mm256_or_si256(_mm256_and_si256(w, m4), _mm256_and_si256(h_lo, m2));
                        let hi = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(w, 4), m4),
                            _mm256_and_si256(h_hi, m2),
                        );
                        for r in 0..MR {
                            let aq = a.q.as_ptr().add((i0 + r) * k + b * QK + 64 * p + 4 * v);
                            sum_lo[r] =
                                _mm256_add_epi16(sum_lo[r], _mm256_maddubs_epi16(lo, codes4(aq)));
                            sum_hi[r] = _mm256_add_epi16(
                                sum_hi[r],
                                _mm256_maddubs_epi16(hi, codes4(aq.add(32))),
                            );
                        }
                        // Two steps at most 2 · 2 · 63 · 127 = 32004: then weigh them.
                        if step % 2 == 1 {
                            for r in 0..MR {
                                acc[r] = _mm256_add_epi32(
                                    acc[r],
                                    _mm256_madd_epi16(sum_lo[r], scales[half]),
                                );
                                acc[r] = _mm256_add_epi32(
                                    acc[r],
                                    _mm256_madd_epi16(sum_hi[r], scales[2 + half]),
                                );
                                sum_lo[r] = _mm256_setzero_si256();
                                sum_hi[r] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            for r in 0..MR {
                let da = _mm256_set1_ps(*a.d.get_unchecked((i0 + r) * kb + b));
                accf[r] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(d, da), accf[r]);
            }
        }
        for r in 0..MR {
            _mm256_storeu_ps(out.add(r * n), accf[r]);
        }
    }

    macro_rules! entry {
        ($name:ident, $body:ident, $mr:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name(
                a: &Acts,
                i0: usize,
                group: *const u8,
                kb: usize,
                out: *mut f32,
                n: usize,
            ) {
                $body::<$mr>(a, i0, group, kb, out, n)
            }
        };
    }

    entry!(q4_1, q4, 1);
    entry!(q4_2, q4, 2);
    entry!(q4_3, q4, 3);
    entry!(q6_1, q6, 1);
    entry!(q6_2, q6, 2);
    entry!(q6_3, q6, 3);
}

/// The kernels of `kernels` over two neighbouring groups at once: every 256-bit operand of
/// group g there is the low half of a 512-bit one here, group g + 1's (`stride` bytes on)
/// the high half. The byte shuffles work within 128-bit lanes, so their patterns repeat.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod wide {
    use super::kernels::{EVEN, ODD};
    use super::*;
    use crate::q8_x8::prefetch_ahead as prefetch;
    use std::arch::x86_64::*;

    /// 32 bytes at `p` (group g) and at `p + stride` (group g + 1).
    #[inline(always)]
    unsafe fn pair32(p: *const u8, stride: usize) -> __m512i {
        let lo = _mm256_loadu_si256(p as *const __m256i);
        let hi = _mm256_loadu_si256(p.add(stride) as *const __m256i);
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    }

    /// 16 bytes at `p` and at `p + stride`, as one 256-bit vector.
    #[inline(always)]
    unsafe fn pair16(p: *const u8, stride: usize) -> __m256i {
        let lo = _mm_loadu_si128(p as *const __m128i);
        let hi = _mm_loadu_si128(p.add(stride) as *const __m128i);
        _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1)
    }

    #[inline(always)]
    unsafe fn codes4(p: *const i8) -> __m512i {
        _mm512_set1_epi32((p as *const i32).read_unaligned())
    }

    #[inline(always)]
    unsafe fn sums2(p: *const i16) -> __m512i {
        _mm512_set1_epi32((p as *const i32).read_unaligned())
    }

    /// `kernels`' EVEN / ODD pair shuffles, one per 128-bit lane.
    #[inline(always)]
    unsafe fn lanes(pattern: &[i8; 32]) -> __m512i {
        _mm512_broadcast_i32x4(_mm_loadu_si128(pattern.as_ptr() as *const __m128i))
    }

    #[inline(always)]
    unsafe fn q4<const MR: usize>(
        a: &Acts,
        i0: usize,
        group: *const u8,
        stride: usize,
        kb: usize,
        out: *mut f32,
        n: usize,
    ) {
        let k = a.k;
        let mask = _mm512_set1_epi8(0x0F);
        let (even, odd) = (lanes(&EVEN), lanes(&ODD));
        let mut accf = [_mm512_setzero_ps(); MR];
        let mut accm = [_mm512_setzero_ps(); MR];
        for b in 0..kb {
            let blk = group.add(b * Q4X8_BYTES);
            prefetch(blk, Q4X8_BYTES);
            prefetch(blk.add(stride), Q4X8_BYTES);
            let mut acc = [_mm512_setzero_si512(); MR];
            for p in 0..4 {
                let pairs = _mm512_cvtepu8_epi16(pair16(blk.add(Q4_SCALES + 16 * p), stride));
                let s_lo = _mm512_shuffle_epi8(pairs, even);
                let s_hi = _mm512_shuffle_epi8(pairs, odd);
                let mut sum_lo = [_mm512_setzero_si512(); MR];
                let mut sum_hi = [_mm512_setzero_si512(); MR];
                for v in 0..8 {
                    let w = pair32(blk.add(Q4_QS + 256 * p + 32 * v), stride);
                    let lo = _mm512_and_si512(w, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask);
                    for r in 0..MR {
                        let aq = a.q.as_ptr().add((i0 + r) * k + b * QK + 64 * p + 4 * v);
                        sum_lo[r] =
                            _mm512_add_epi16(sum_lo[r], _mm512_maddubs_epi16(lo, codes4(aq)));
                        sum_hi[r] = _mm512_add_epi16(
                            sum_hi[r],
                            _mm512_maddubs_epi16(hi, codes4(aq.add(32))),
                        );
                    }
                }
                for r in 0..MR {
                    acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(sum_lo[r], s_lo));
                    acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(sum_hi[r], s_hi));
                }
            }
            let d = _mm512_cvtph_ps(pair16(blk, stride));
            let dmin = _mm512_cvtph_ps(pair16(blk.add(16), stride));
            let mut mins = [_mm512_setzero_si512(); 4];
            for p in 0..4 {
                mins[p] = _mm512_cvtepu8_epi16(pair16(blk.add(Q4_MINS + 16 * p), stride));
            }
            for r in 0..MR {
                let at = (i0 + r) * kb + b;
                let da = _mm512_set1_ps(*a.d.get_unchecked(at));
                accf[r] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, da), accf[r]);
                let s32 = a.sums32.as_ptr().add(at * 8);
                let mut m = _mm512_madd_epi16(mins[0], sums2(s32));
                for p in 1..4 {
                    m = _mm512_add_epi32(m, _mm512_madd_epi16(mins[p], sums2(s32.add(2 * p))));
                }
                accm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dmin, da), accm[r]);
            }
        }
        for r in 0..MR {
            _mm512_storeu_ps(out.add(r * n), _mm512_sub_ps(accf[r], accm[r]));
        }
    }

    #[inline(always)]
    unsafe fn run_scales(blk: *const u8, stride: usize, run: usize) -> __m512i {
        _mm512_cvtepi8_epi16(pair16(blk.add(Q6_SCALES + 16 * run), stride))
    }

    #[inline(always)]
    unsafe fn q6<const MR: usize>(
        a: &Acts,
        i0: usize,
        group: *const u8,
        stride: usize,
        kb: usize,
        out: *mut f32,
        n: usize,
    ) {
        let k = a.k;
        let m4 = _mm512_set1_epi8(0x0F);
        let m2 = _mm512_set1_epi8(0x30);
        let (even, odd) = (lanes(&EVEN), lanes(&ODD));
        let mut accf = [_mm512_setzero_ps(); MR];
        for b in 0..kb {
            let blk = group.add(b * Q6X8_BYTES);
            prefetch(blk, Q6X8_BYTES);
            prefetch(blk.add(stride), Q6X8_BYTES);
            let mut acc = [_mm512_setzero_si512(); MR];
            for run in 0..8 {
                let pairs = run_scales(blk, stride, run);
                for r in 0..MR {
                    let s16 = a.sums16.as_ptr().add(((i0 + r) * kb + b) * 16 + 2 * run);
                    acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(pairs, sums2(s16)));
                }
            }
            for r in 0..MR {
                acc[r] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(acc[r], 5));
            }
            for p in 0..4 {
                let u = 2 * (p % 2);
                let (first, second) = (
                    run_scales(blk, stride, 2 * p),
                    run_scales(blk, stride, 2 * p + 1),
                );
                let scales = [
                    _mm512_shuffle_epi8(first, even),
                    _mm512_shuffle_epi8(first, odd),
                    _mm512_shuffle_epi8(second, even),
                    _mm512_shuffle_epi8(second, odd),
                ];
                for half in 0..2 {
                    let mut sum_lo = [_mm512_setzero_si512(); MR];
                    let mut sum_hi = [_mm512_setzero_si512(); MR];
                    for step in 0..4 {
                        let v = 4 * half + step;
                        let w = pair32(blk.add(Q6_QL + 256 * p + 32 * v), stride);
                        let h = pair32(blk.add(Q6_QH + 256 * (p / 2) + 32 * v), stride);
                        let (h_lo, h_hi) = if u == 0 {
                            (_mm512_slli_epi16(h, 4), _mm512_slli_epi16(h, 2))
                        } else {
                            (h, _mm512_srli_epi16(h, 2))
                        };
                        let lo =
                            _mm512_or_si512(_mm512_and_si512(w, m4), _mm512_and_si512(h_lo, m2));
                        let hi = _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16(w, 4), m4),
                            _mm512_and_si512(h_hi, m2),
                        );
                        for r in 0..MR {
                            let aq = a.q.as_ptr().add((i0 + r) * k + b * QK + 64 * p + 4 * v);
                            sum_lo[r] =
                                _mm512_add_epi16(sum_lo[r], _mm512_maddubs_epi16(lo, codes4(aq)));
                            sum_hi[r] = _mm512_add_epi16(
                                sum_hi[r],
                                _mm512_maddubs_epi16(hi, codes4(aq.add(32))),
                            );
                        }
                        if step % 2 == 1 {
                            for r in 0..MR {
                                acc[r] = _mm512_add_epi32(
                                    acc[r],
                                    _mm512_madd_epi16(sum_lo[r], scales[half]),
                                );
                                acc[r] = _mm512_add_epi32(
                                    acc[r],
                                    _mm512_madd_epi16(sum_hi[r], scales[2 + half]),
                                );
                                sum_lo[r] = _mm512_setzero_si512();
                                sum_hi[r] = _mm512_setzero_si512();
                            }
                        }
                    }
                }
            }
            let d = _mm512_cvtph_ps(pair16(blk, stride));
            for r in 0..MR {
                let da = _mm512_set1_ps(*a.d.get_unchecked((i0 + r) * kb + b));
                accf[r] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, da), accf[r]);
            }
        }
        for r in 0..MR {
            _mm512_storeu_ps(out.add(r * n), accf[r]);
        }
    }

    macro_rules! entry {
        ($name:ident, $body:ident, $mr:expr) => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            pub(super) unsafe fn $name(
                a: &Acts,
                i0: usize,
                group: *const u8,
                stride: usize,
                kb: usize,
                out: *mut f32,
                n: usize,
            ) {
                $body::<$mr>(a, i0, group, stride, kb, out, n)
            }
        };
    }

    entry!(q4_1, q4, 1);
    entry!(q4_2, q4, 2);
    entry!(q4_3, q4, 3);
    entry!(q6_1, q6, 1);
    entry!(q6_2, q6, 2);
    entry!(q6_3, q6, 3);
}
