//! Q8_0 rows interleaved in groups of sixteen with offset codes, for the AVX-512 VNNI
//! kernels (below [`crate::q8::Q8Matrix`]'s AMX level).
//!
//! Why: the 4 × 4 row-major tile forms each product as |w| · (a negated where w < 0) and
//! converts and scales every (activation row, weight row) pair's block sum apart: five
//! vector ops per 64 products. Here one 64-byte load holds four codes of each of sixteen
//! weight rows (the layout of `q8_x8.rs` with G = 16), one `vpdpbusd` against the activation
//! row's four codes broadcast gives one i32 lane per weight row, and a block's sums are
//! converted and scaled once for all sixteen: eight `vpdpbusd` and three float ops per
//! 512 products.
//!
//! `vpdpbusd` multiplies unsigned by signed bytes, so the grouped codes are stored as
//! w + 128 (w XOR 0x80, exact for every i8), and a block's sum Σ (w + 128) · a is corrected
//! by −128 · Σ a, a number per activation row and block ([`block_offsets`]) that every
//! weight row shares: it starts the block's accumulator.

pub(crate) const GROUP: usize = 16;
const BLOCK: usize = 32;

/// The grouped codes of a matrix of `n` rows and width `k`, offset by 128 (XOR 0x80: its own
/// inverse), in place.
pub(crate) fn flip_grouped(qs: &mut [i8], n: usize, k: usize) {
    for q in &mut qs[..n / GROUP * GROUP * k] {
        *q ^= i8::MIN;
    }
}

/// −128 · Σ a over each 32-code block of activation codes `q`: what `vpdpbusd` over
/// offset weights adds to each block's sum.
pub(crate) fn block_offsets(q: &[i8]) -> Vec<i32> {
    q.chunks_exact(BLOCK)
        .map(|b| -128 * b.iter().map(|&c| c as i32).sum::<i32>())
        .collect()
}

/// Group `g` against activation rows `rows` (codes `aq`, row-major `(m, k)`; scales `ad`
/// and block offsets `ao`, `(m, kb)`), into `out[i * n + c]` for c in 0..16.
///
/// # Safety
/// The CPU runs AVX-512 F, BW and VNNI, FMA and F16C; `g` is a whole group of the
/// interleaved, offset `qs` / `d`; `out` is valid for those writes.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run(
    qs: &[i8],
    d: &[u16],
    k: usize,
    g: usize,
    aq: &[i8],
    ad: &[f32],
    ao: &[i32],
    rows: std::ops::Range<usize>,
    out: *mut f32,
    n: usize,
) {
    let kb = k / BLOCK;
    let (codes, scales) = (
        qs.as_ptr().add(GROUP * g * k),
        d.as_ptr().add(GROUP * g * kb),
    );
    crate::q8_x8::row_tiles(rows, kernels::WIDEST, |i, mr| {
        let a = kernels::Acts {
            q: aq.as_ptr().add(i * k),
            d: ad.as_ptr().add(i * kb),
            offsets: ao.as_ptr().add(i * kb),
        };
        let o = out.add(i * n);
        match mr {
            8 => kernels::q8_8(codes, scales, kb, &a, o, n),
            7 => kernels::q8_7(codes, scales, kb, &a, o, n),
            6 => kernels::q8_6(codes, scales, kb, &a, o, n),
            5 => kernels::q8_5(codes, scales, kb, &a, o, n),
            4 => kernels::q8_4(codes, scales, kb, &a, o, n),
            3 => kernels::q8_3(codes, scales, kb, &a, o, n),
            2 => kernels::q8_2(codes, scales, kb, &a, o, n),
            _ => kernels::q8_1(codes, scales, kb, &a, o, n),
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod kernels {
    use super::{BLOCK, GROUP};
    use crate::q8_x8::prefetch_ahead;
    use std::arch::x86_64::*;

    /// The most activation rows one pass over a group's codes serves.
    pub(super) const WIDEST: usize = 8;

    /// The first activation row of a tile: codes, scales and block offsets (rows `k` codes
    /// and `kb` scales and offsets apart).
    pub(super) struct Acts {
        pub q: *const i8,
        pub d: *const f32,
        pub offsets: *const i32,
    }

    /// MR activation rows against one group: per 64-byte vector, `vpdpbusd` of the offset
    /// codes and the row's four codes broadcast, one i32 lane per weight row. A row's
    /// arithmetic is the same whatever MR, so its output does not depend on its batch.
    #[inline(always)]
    unsafe fn q8<const MR: usize>(
        codes: *const i8,
        scales: *const u16,
        kb: usize,
        a: &Acts,
        out: *mut f32,
        n: usize,
    ) {
        let k = kb * BLOCK;
        let mut accf = [_mm512_setzero_ps(); MR];
        for b in 0..kb {
            let blk = codes.add(BLOCK * GROUP * b);
            prefetch_ahead(blk as *const u8, BLOCK * GROUP);
            let mut acc: [__m512i; MR] =
                std::array::from_fn(|r| _mm512_set1_epi32(*a.offsets.add(r * kb + b)));
            for v in 0..BLOCK / 4 {
                let w = _mm512_loadu_si512(blk.add(4 * GROUP * v) as *const __m512i);
                for r in 0..MR {
                    let four = (a.q.add(r * k + BLOCK * b + 4 * v) as *const i32).read_unaligned();
                    acc[r] = _mm512_dpbusd_epi32(acc[r], w, _mm512_set1_epi32(four));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(GROUP * b) as *const __m256i));
            for r in 0..MR {
                let da = _mm512_set1_ps(*a.d.add(r * kb + b));
                accf[r] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(dw, da), accf[r]);
            }
        }
        for r in 0..MR {
            _mm512_storeu_ps(out.add(r * n), accf[r]);
        }
    }

    macro_rules! entry {
        ($name:ident, $mr:expr) => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
            pub(super) unsafe fn $name(
                codes: *const i8,
                scales: *const u16,
                kb: usize,
                a: &Acts,
                out: *mut f32,
                n: usize,
            ) {
                q8::<$mr>(codes, scales, kb, a, out, n)
            }
        };
    }

    entry!(q8_1, 1);
    entry!(q8_2, 2);
    entry!(q8_3, 3);
    entry!(q8_4, 4);
    entry!(q8_5, 5);
    entry!(q8_6, 6);
    entry!(q8_7, 7);
    entry!(q8_8, 8);
}
