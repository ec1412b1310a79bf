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
        let kb = self.kb;
        crate::q8_x8::row_tiles(acts_rows, 3, |i, mr| {
            let o = out.add(i * n);
            match (self.q4, mr) {
                (true, 3) => kernels::q4_3(acts, i, group, 0, kb, o, n),
                (true, 2) => kernels::q4_2(acts, i, group, 0, kb, o, n),
                (true, _) => kernels::q4_1(acts, i, group, 0, kb, o, n),
                (false, 3) => kernels::q6_3(acts, i, group, 0, kb, o, n),
                (false, 2) => kernels::q6_2(acts, i, group, 0, kb, o, n),
                (false, _) => kernels::q6_1(acts, i, group, 0, kb, o, n),
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
                (true, 3) => kernels::pair_q4_3(acts, i, group, stride, kb, o, n),
                (true, 2) => kernels::pair_q4_2(acts, i, group, stride, kb, o, n),
                (true, _) => kernels::pair_q4_1(acts, i, group, stride, kb, o, n),
                (false, 3) => kernels::pair_q6_3(acts, i, group, stride, kb, o, n),
                (false, 2) => kernels::pair_q6_2(acts, i, group, stride, kb, o, n),
                (false, _) => kernels::pair_q6_1(acts, i, group, stride, kb, o, n),
            }
        });
    }
}

/// The vector width a group kernel runs at: one group of eight rows in 256-bit registers
/// ([`Group`]), or two neighbouring groups side by side in 512-bit ones ([`Pair`]: every
/// operand of group g is the low half, group g + 1's, `stride` bytes on, the high half). The
/// kernels are written once over it, so each row's arithmetic is the same at both widths.
/// The byte shuffles work within 128-bit lanes, so their patterns repeat.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::missing_safety_doc)]
mod width {
    use std::arch::x86_64::*;

    pub(super) trait Width {
        type I: Copy;
        type F: Copy;
        /// 32 bytes of each group at `p`.
        unsafe fn load(p: *const u8, stride: usize) -> Self::I;
        /// 16 unsigned (signed) bytes of each group at `p`, widened to i16.
        unsafe fn u8_i16(p: *const u8, stride: usize) -> Self::I;
        unsafe fn i8_i16(p: *const u8, stride: usize) -> Self::I;
        /// 8 f16 of each group at `p`, as f32.
        unsafe fn f16_f32(p: *const u8, stride: usize) -> Self::F;
        /// The four bytes (or two i16) at `p` broadcast to every 32-bit lane.
        unsafe fn splat4(p: *const u8) -> Self::I;
        /// A 16-byte shuffle pattern in every 128-bit lane.
        unsafe fn pattern(p: &[i8; 32]) -> Self::I;
        unsafe fn bytes(b: i8) -> Self::I;
        unsafe fn zero() -> Self::I;
        unsafe fn and(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn or(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn srli16_4(a: Self::I) -> Self::I;
        unsafe fn srli16_2(a: Self::I) -> Self::I;
        unsafe fn slli16_4(a: Self::I) -> Self::I;
        unsafe fn slli16_2(a: Self::I) -> Self::I;
        /// −32 · a, per i32.
        unsafe fn neg_times32(a: Self::I) -> Self::I;
        unsafe fn shuffle(a: Self::I, pattern: Self::I) -> Self::I;
        unsafe fn maddubs(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn add16(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn madd(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn add32(a: Self::I, b: Self::I) -> Self::I;
        unsafe fn zero_f() -> Self::F;
        unsafe fn splat_f(x: f32) -> Self::F;
        unsafe fn to_f(a: Self::I) -> Self::F;
        unsafe fn mul(a: Self::F, b: Self::F) -> Self::F;
        unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
        unsafe fn sub_f(a: Self::F, b: Self::F) -> Self::F;
        unsafe fn store(p: *mut f32, a: Self::F);
    }

    /// One group of eight rows, 256-bit (AVX2).
    pub(super) struct Group;
    /// Two neighbouring groups, 512-bit (AVX-512 F and BW).
    pub(super) struct Pair;

    /// Trait methods that are one intrinsic each, of the same arguments (and, for the
    /// shifts, a constant count).
    macro_rules! one_op {
        ($($name:ident($($arg:ident: $t:ty),*) -> $r:ty = $op:ident $(, $count:literal)?;)*) => {
            $(
                #[inline(always)]
                unsafe fn $name($($arg: $t),*) -> $r {
                    $op($($arg),* $(, $count)?)
                }
            )*
        };
    }

    impl Width for Group {
        type I = __m256i;
        type F = __m256;
        #[inline(always)]
        unsafe fn load(p: *const u8, _: usize) -> __m256i {
            _mm256_loadu_si256(p as *const __m256i)
        }
        #[inline(always)]
        unsafe fn u8_i16(p: *const u8, _: usize) -> __m256i {
            _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i))
        }
        #[inline(always)]
        unsafe fn i8_i16(p: *const u8, _: usize) -> __m256i {
            _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i))
        }
        #[inline(always)]
        unsafe fn f16_f32(p: *const u8, _: usize) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
        #[inline(always)]
        unsafe fn splat4(p: *const u8) -> __m256i {
            _mm256_set1_epi32((p as *const i32).read_unaligned())
        }
        #[inline(always)]
        unsafe fn pattern(p: &[i8; 32]) -> __m256i {
            _mm256_loadu_si256(p.as_ptr() as *const __m256i)
        }
        #[inline(always)]
        unsafe fn neg_times32(a: __m256i) -> __m256i {
            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(a, 5))
        }
        one_op! {
            bytes(b: i8) -> __m256i = _mm256_set1_epi8;
            srli16_4(a: __m256i) -> __m256i = _mm256_srli_epi16, 4;
            srli16_2(a: __m256i) -> __m256i = _mm256_srli_epi16, 2;
            slli16_4(a: __m256i) -> __m256i = _mm256_slli_epi16, 4;
            slli16_2(a: __m256i) -> __m256i = _mm256_slli_epi16, 2;
            zero() -> __m256i = _mm256_setzero_si256;
            and(a: __m256i, b: __m256i) -> __m256i = _mm256_and_si256;
            or(a: __m256i, b: __m256i) -> __m256i = _mm256_or_si256;
            shuffle(a: __m256i, b: __m256i) -> __m256i = _mm256_shuffle_epi8;
            maddubs(a: __m256i, b: __m256i) -> __m256i = _mm256_maddubs_epi16;
            add16(a: __m256i, b: __m256i) -> __m256i = _mm256_add_epi16;
            madd(a: __m256i, b: __m256i) -> __m256i = _mm256_madd_epi16;
            add32(a: __m256i, b: __m256i) -> __m256i = _mm256_add_epi32;
            zero_f() -> __m256 = _mm256_setzero_ps;
            splat_f(x: f32) -> __m256 = _mm256_set1_ps;
            to_f(a: __m256i) -> __m256 = _mm256_cvtepi32_ps;
            mul(a: __m256, b: __m256) -> __m256 = _mm256_mul_ps;
            fmadd(a: __m256, b: __m256, c: __m256) -> __m256 = _mm256_fmadd_ps;
            sub_f(a: __m256, b: __m256) -> __m256 = _mm256_sub_ps;
            store(p: *mut f32, a: __m256) -> () = _mm256_storeu_ps;
        }
    }

    /// 16 bytes at `p` and at `p + stride`, as one 256-bit vector.
    #[inline(always)]
    unsafe fn pair16(p: *const u8, stride: usize) -> __m256i {
        let lo = _mm_loadu_si128(p as *const __m128i);
        let hi = _mm_loadu_si128(p.add(stride) as *const __m128i);
        _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1)
    }

    impl Width for Pair {
        type I = __m512i;
        type F = __m512;
        #[inline(always)]
        unsafe fn load(p: *const u8, stride: usize) -> __m512i {
            let lo = _mm256_loadu_si256(p as *const __m256i);
            let hi = _mm256_loadu_si256(p.add(stride) as *const __m256i);
            _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
        }
        #[inline(always)]
        unsafe fn u8_i16(p: *const u8, stride: usize) -> __m512i {
            _mm512_cvtepu8_epi16(pair16(p, stride))
        }
        #[inline(always)]
        unsafe fn i8_i16(p: *const u8, stride: usize) -> __m512i {
            _mm512_cvtepi8_epi16(pair16(p, stride))
        }
        #[inline(always)]
        unsafe fn f16_f32(p: *const u8, stride: usize) -> __m512 {
            _mm512_cvtph_ps(pair16(p, stride))
        }
        #[inline(always)]
        unsafe fn splat4(p: *const u8) -> __m512i {
            _mm512_set1_epi32((p as *const i32).read_unaligned())
        }
        #[inline(always)]
        unsafe fn pattern(p: &[i8; 32]) -> __m512i {
            _mm512_broadcast_i32x4(_mm_loadu_si128(p.as_ptr() as *const __m128i))
        }
        #[inline(always)]
        unsafe fn neg_times32(a: __m512i) -> __m512i {
            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(a, 5))
        }
        one_op! {
            bytes(b: i8) -> __m512i = _mm512_set1_epi8;
            srli16_4(a: __m512i) -> __m512i = _mm512_srli_epi16, 4;
            srli16_2(a: __m512i) -> __m512i = _mm512_srli_epi16, 2;
            slli16_4(a: __m512i) -> __m512i = _mm512_slli_epi16, 4;
            slli16_2(a: __m512i) -> __m512i = _mm512_slli_epi16, 2;
            zero() -> __m512i = _mm512_setzero_si512;
            and(a: __m512i, b: __m512i) -> __m512i = _mm512_and_si512;
            or(a: __m512i, b: __m512i) -> __m512i = _mm512_or_si512;
            shuffle(a: __m512i, b: __m512i) -> __m512i = _mm512_shuffle_epi8;
            maddubs(a: __m512i, b: __m512i) -> __m512i = _mm512_maddubs_epi16;
            add16(a: __m512i, b: __m512i) -> __m512i = _mm512_add_epi16;
            madd(a: __m512i, b: __m512i) -> __m512i = _mm512_madd_epi16;
            add32(a: __m512i, b: __m512i) -> __m512i = _mm512_add_epi32;
            zero_f() -> __m512 = _mm512_setzero_ps;
            splat_f(x: f32) -> __m512 = _mm512_set1_ps;
            to_f(a: __m512i) -> __m512 = _mm512_cvtepi32_ps;
            mul(a: __m512, b: __m512) -> __m512 = _mm512_mul_ps;
            fmadd(a: __m512, b: __m512, c: __m512) -> __m512 = _mm512_fmadd_ps;
            sub_f(a: __m512, b: __m512) -> __m512 = _mm512_sub_ps;
            store(p: *mut f32, a: __m512) -> () = _mm512_storeu_ps;
        }
    }
}

/// The group kernels at either [`width::Width`], and their entry points per width and row
/// count (each compiled for its width's instructions).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod kernels {
    use super::width::{Group, Pair, Width};
    use super::*;
    use crate::q8_x8::prefetch_ahead as prefetch;

    /// For a vector of `[row][2]` i16 pairs: the first of each pair in both lanes
    /// (`EVEN`), or the second (`ODD`).
    const EVEN: [i8; 32] = [
        0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12,
        13, 12, 13,
    ];
    const ODD: [i8; 32] = [
        2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10,
        11, 14, 15, 14, 15,
    ];

    /// Four activation codes (or two i16 sums), broadcast to every row's four bytes.
    #[inline(always)]
    unsafe fn splat<W: Width, T>(p: *const T) -> W::I {
        W::splat4(p as *const u8)
    }

    /// The prefetches of one superblock of the group(s).
    #[inline(always)]
    unsafe fn fetch<W: Width>(blk: *const u8, stride: usize, bytes: usize) {
        prefetch(blk, bytes);
        if std::mem::size_of::<W::I>() == 64 {
            prefetch(blk.add(stride), bytes);
        }
    }

    #[inline(always)]
    unsafe fn q4<W: Width, const MR: usize>(
        a: &Acts,
        i0: usize,
        group: *const u8,
        stride: usize,
        kb: usize,
        out: *mut f32,
        n: usize,
    ) {
        let k = a.k;
        let mask = W::bytes(0x0F);
        let (even, odd) = (W::pattern(&EVEN), W::pattern(&ODD));
        let mut accf = [W::zero_f(); MR];
        let mut accm = [W::zero_f(); MR];
        for b in 0..kb {
            let blk = group.add(b * Q4X8_BYTES);
            fetch::<W>(blk, stride, Q4X8_BYTES);
            let mut acc = [W::zero(); MR];
            for p in 0..4 {
                let pairs = W::u8_i16(blk.add(Q4_SCALES + 16 * p), stride);
                let s_lo = W::shuffle(pairs, even);
                let s_hi = W::shuffle(pairs, odd);
                let mut sum_lo = [W::zero(); MR];
                let mut sum_hi = [W::zero(); MR];
                for v in 0..8 {
                    let w = W::load(blk.add(Q4_QS + 256 * p + 32 * v), stride);
                    let lo = W::and(w, mask);
                    let hi = W::and(W::srli16_4(w), mask);
                    for r in 0..MR {
                        let aq = a.q.as_ptr().add((i0 + r) * k + b * QK + 64 * p + 4 * v);
                        // At most 8 · 2 · 15 · 127 = 30480: exact in i16.
                        sum_lo[r] = W::add16(sum_lo[r], W::maddubs(lo, splat::<W, _>(aq)));
                        sum_hi[r] = W::add16(sum_hi[r], W::maddubs(hi, splat::<W, _>(aq.add(32))));
                    }
                }
                for r in 0..MR {
                    acc[r] = W::add32(acc[r], W::madd(sum_lo[r], s_lo));
                    acc[r] = W::add32(acc[r], W::madd(sum_hi[r], s_hi));
                }
            }
            let d = W::f16_f32(blk, stride);
            let dmin = W::f16_f32(blk.add(16), stride);
            let mut mins = [W::zero(); 4];
            for p in 0..4 {
                mins[p] = W::u8_i16(blk.add(Q4_MINS + 16 * p), stride);
            }
            for r in 0..MR {
                let at = (i0 + r) * kb + b;
                let da = W::splat_f(*a.d.get_unchecked(at));
                accf[r] = W::fmadd(W::to_f(acc[r]), W::mul(d, da), accf[r]);
                let s32 = a.sums32.as_ptr().add(at * 8);
                let mut m = W::madd(mins[0], splat::<W, _>(s32));
                for p in 1..4 {
                    m = W::add32(m, W::madd(mins[p], splat::<W, _>(s32.add(2 * p))));
                }
                accm[r] = W::fmadd(W::to_f(m), W::mul(dmin, da), accm[r]);
            }
        }
        for r in 0..MR {
            W::store(out.add(r * n), W::sub_f(accf[r], accm[r]));
        }
    }

    #[inline(always)]
    unsafe fn q6<W: Width, const MR: usize>(
        a: &Acts,
        i0: usize,
        group: *const u8,
        stride: usize,
        kb: usize,
        out: *mut f32,
        n: usize,
    ) {
        let k = a.k;
        let m4 = W::bytes(0x0F);
        let m2 = W::bytes(0x30);
        let (even, odd) = (W::pattern(&EVEN), W::pattern(&ODD));
        // Run `run`'s two scales per row, as `[row][2]` i16 pairs.
        let run_scales =
            |blk: *const u8, run: usize| W::i8_i16(blk.add(Q6_SCALES + 16 * run), stride);
        let mut accf = [W::zero_f(); MR];
        for b in 0..kb {
            let blk = group.add(b * Q6X8_BYTES);
            fetch::<W>(blk, stride, Q6X8_BYTES);
            // The codes are stored + 32: start from −32 · Σ scale · (sum of 16 codes).
            let mut acc = [W::zero(); MR];
            for run in 0..8 {
                let pairs = run_scales(blk, run);
                for r in 0..MR {
                    let s16 = a.sums16.as_ptr().add(((i0 + r) * kb + b) * 16 + 2 * run);
                    acc[r] = W::add32(acc[r], W::madd(pairs, splat::<W, _>(s16)));
                }
            }
            for r in 0..MR {
                acc[r] = W::neg_times32(acc[r]);
            }
            for p in 0..4 {
                // Runs 2p (low nibbles) and 2p + 1 (high), their high bits at pairs u, u + 1.
                let u = 2 * (p % 2);
                let (first, second) = (run_scales(blk, 2 * p), run_scales(blk, 2 * p + 1));
                let scales = [
                    W::shuffle(first, even),
                    W::shuffle(first, odd),
                    W::shuffle(second, even),
                    W::shuffle(second, odd),
                ];
                for half in 0..2 {
                    let mut sum_lo = [W::zero(); MR];
                    let mut sum_hi = [W::zero(); MR];
                    for step in 0..4 {
                        let v = 4 * half + step;
                        let w = W::load(blk.add(Q6_QL + 256 * p + 32 * v), stride);
                        let h = W::load(blk.add(Q6_QH + 256 * (p / 2) + 32 * v), stride);
                        let (h_lo, h_hi) = if u == 0 {
                            (W::slli16_4(h), W::slli16_2(h))
                        } else {
                            (h, W::srli16_2(h))
                        };
                        let lo = W::or(W::and(w, m4), W::and(h_lo, m2));
                        let hi = W::or(W::and(W::srli16_4(w), m4), W::and(h_hi, m2));
                        for r in 0..MR {
                            let aq = a.q.as_ptr().add((i0 + r) * k + b * QK + 64 * p + 4 * v);
                            sum_lo[r] = W::add16(sum_lo[r], W::maddubs(lo, splat::<W, _>(aq)));
                            sum_hi[r] =
                                W::add16(sum_hi[r], W::maddubs(hi, splat::<W, _>(aq.add(32))));
                        }
                        // Two steps at most 2 · 2 · 63 · 127 = 32004: then weigh them.
                        if step % 2 == 1 {
                            for r in 0..MR {
                                acc[r] = W::add32(acc[r], W::madd(sum_lo[r], scales[half]));
                                acc[r] = W::add32(acc[r], W::madd(sum_hi[r], scales[2 + half]));
                                sum_lo[r] = W::zero();
                                sum_hi[r] = W::zero();
                            }
                        }
                    }
                }
            }
            let d = W::f16_f32(blk, stride);
            for r in 0..MR {
                let da = W::splat_f(*a.d.get_unchecked((i0 + r) * kb + b));
                accf[r] = W::fmadd(W::to_f(acc[r]), W::mul(d, da), accf[r]);
            }
        }
        for r in 0..MR {
            W::store(out.add(r * n), accf[r]);
        }
    }

    macro_rules! entry {
        ($name:ident, $body:ident, $width:ty, $mr:expr, $features:literal) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(
                a: &Acts,
                i0: usize,
                group: *const u8,
                stride: usize,
                kb: usize,
                out: *mut f32,
                n: usize,
            ) {
                $body::<$width, $mr>(a, i0, group, stride, kb, out, n)
            }
        };
    }

    entry!(q4_1, q4, Group, 1, "avx2,fma,f16c");
    entry!(q4_2, q4, Group, 2, "avx2,fma,f16c");
    entry!(q4_3, q4, Group, 3, "avx2,fma,f16c");
    entry!(q6_1, q6, Group, 1, "avx2,fma,f16c");
    entry!(q6_2, q6, Group, 2, "avx2,fma,f16c");
    entry!(q6_3, q6, Group, 3, "avx2,fma,f16c");
    entry!(
        pair_q4_1,
        q4,
        Pair,
        1,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
    );
    entry!(
        pair_q4_2,
        q4,
        Pair,
        2,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
    );
    entry!(
        pair_q4_3,
        q4,
        Pair,
        3,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
    );
    entry!(
        pair_q6_1,
        q6,
        Pair,
        1,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
    );
    entry!(
        pair_q6_2,
        q6,
        Pair,
        2,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
    );
    entry!(
        pair_q6_3,
        q6,
        Pair,
        3,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c"
    );
}
