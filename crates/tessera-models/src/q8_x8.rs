//! Q8_0 rows interleaved in groups, for the AVX2 kernels here (groups of eight; the Q8 side
//! of `kquant/x8.rs`, which says why) and the AVX-512 VNNI ones in `q8_x16.rs` (groups of
//! sixteen).
//!
//! A [`crate::q8::Q8Matrix`] keeps its whole groups of G rows this way, in the same places
//! as the row-major matrix (group g's codes are bytes `G·g·k ..` of the codes, its scales
//! entries `G·g·kb ..` of the scales), so the rows past the last whole group stay row-major
//! where the row kernels read them:
//! - codes: for block b, vector v (4 elements of all G rows), bytes `[row r][t]` = element
//!   `32b + 4v + t` of row `G·g + r` (at `G·g·k + 32G·b + 4G·v + 4r + t`);
//! - scales: block b's G rows side by side (at `G·g·kb + G·b + r`).

pub(crate) const GROUP: usize = 8;
const BLOCK: usize = 32;

/// Where element `e` of row `j` sits in a matrix of `n` rows and width `k`, interleaved in
/// groups of `group`.
pub(crate) fn code_at(j: usize, e: usize, n: usize, k: usize, group: usize) -> usize {
    let g = j / group;
    if g >= n / group {
        return j * k + e;
    }
    let (r, b, v, t) = (j % group, e / BLOCK, (e % BLOCK) / 4, e % 4);
    group * g * k + BLOCK * group * b + 4 * group * v + 4 * r + t
}

/// Where block `b`'s scale of row `j` sits.
pub(crate) fn scale_at(j: usize, b: usize, n: usize, kb: usize, group: usize) -> usize {
    let g = j / group;
    if g >= n / group {
        return j * kb + b;
    }
    group * g * kb + group * b + j % group
}

/// Row-major codes and scales interleaved in groups of `group` (or back, `forward` false),
/// in place.
pub(crate) fn interleave(
    qs: &mut [i8],
    d: &mut [u16],
    n: usize,
    k: usize,
    group: usize,
    forward: bool,
) {
    let kb = k / BLOCK;
    let mut codes = vec![0i8; group * k];
    let mut scales = vec![0u16; group * kb];
    for g in 0..n / group {
        let (q, s) = (
            &mut qs[group * g * k..group * (g + 1) * k],
            &mut d[group * g * kb..group * (g + 1) * kb],
        );
        codes.copy_from_slice(q);
        scales.copy_from_slice(s);
        for r in 0..group {
            for e in 0..k {
                let at = code_at(r, e, group, k, group);
                match forward {
                    true => q[at] = codes[r * k + e],
                    false => q[r * k + e] = codes[at],
                }
            }
            for b in 0..kb {
                let at = scale_at(r, b, group, kb, group);
                match forward {
                    true => s[at] = scales[r * kb + b],
                    false => s[r * kb + b] = scales[at],
                }
            }
        }
    }
}

/// Activation rows `rows` in tiles of at most `widest`, the widths of the groups' kernels
/// (three here and in `kquant/x8.rs`): `tile(first row, rows in the tile)`.
pub(crate) fn row_tiles(
    rows: std::ops::Range<usize>,
    widest: usize,
    mut tile: impl FnMut(usize, usize),
) {
    let mut i = rows.start;
    while i < rows.end {
        let mr = (rows.end - i).min(widest);
        tile(i, mr);
        i += mr;
    }
}

/// How far ahead of the block in use a group's stream is prefetched into L2 (here and in
/// `kquant/x8.rs`; without it Q6_K groups read at 7–8 GB/s instead of 11–13 on an EPYC).
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 4096;

/// Prefetches the `size` bytes [`AHEAD`] of `block` into L2, a cache line at a time.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead(block: *const u8, size: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let p = block.wrapping_add(AHEAD);
    let mut line = 0;
    while line < size {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(line) as *const i8) };
        line += 64;
    }
}

/// Group `g` against activation rows `rows` (codes `aq`, row-major `(m, k)`; scales `ad`,
/// `(m, kb)`), into `out[i * n + c]` for c in 0..8.
///
/// # Safety
/// The CPU runs AVX2, FMA and F16C; `g` is a whole group of the interleaved `qs` / `d`;
/// `out` is valid for those writes.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run(
    qs: &[i8],
    d: &[u16],
    k: usize,
    g: usize,
    aq: &[i8],
    ad: &[f32],
    rows: std::ops::Range<usize>,
    out: *mut f32,
    n: usize,
) {
    let kb = k / BLOCK;
    let (codes, scales) = (
        qs.as_ptr().add(GROUP * g * k),
        d.as_ptr().add(GROUP * g * kb),
    );
    row_tiles(rows, 3, |i, mr| {
        let (a, o) = (aq.as_ptr().add(i * k), out.add(i * n));
        let ad = ad.as_ptr().add(i * kb);
        match mr {
            3 => kernels::q8_3(codes, scales, kb, a, ad, o, n),
            2 => kernels::q8_2(codes, scales, kb, a, ad, o, n),
            _ => kernels::q8_1(codes, scales, kb, a, ad, o, n),
        }
    });
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod kernels {
    use super::{prefetch_ahead, BLOCK};
    use std::arch::x86_64::*;

    /// MR activation rows (`a`, `ad` at the first; rows `k = 32 · kb` apart) against one
    /// group: per 32-byte vector, `maddubs` of |w| and the row's four codes broadcast with
    /// w's signs, then `madd` by ones: one i32 lane per weight row.
    #[inline(always)]
    unsafe fn q8<const MR: usize>(
        codes: *const i8,
        scales: *const u16,
        kb: usize,
        a: *const i8,
        ad: *const f32,
        out: *mut f32,
        n: usize,
    ) {
        let k = kb * BLOCK;
        let ones = _mm256_set1_epi16(1);
        let mut accf = [_mm256_setzero_ps(); MR];
        for b in 0..kb {
            let blk = codes.add(256 * b);
            prefetch_ahead(blk as *const u8, 256);
            let mut acc = [_mm256_setzero_si256(); MR];
            for v in 0..8 {
                let w = _mm256_loadu_si256(blk.add(32 * v) as *const __m256i);
                let wabs = _mm256_sign_epi8(w, w);
                for r in 0..MR {
                    let four = (a.add(r * k + BLOCK * b + 4 * v) as *const i32).read_unaligned();
                    let signed = _mm256_sign_epi8(_mm256_set1_epi32(four), w);
                    // At most 127 · 127 · 2 per i16 lane: no saturation.
                    let pairs = _mm256_maddubs_epi16(wabs, signed);
                    acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(scales.add(8 * b) as *const __m128i));
            for r in 0..MR {
                let da = _mm256_set1_ps(*ad.add(r * kb + b));
                accf[r] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(dw, da), accf[r]);
            }
        }
        for r in 0..MR {
            _mm256_storeu_ps(out.add(r * n), accf[r]);
        }
    }

    macro_rules! entry {
        ($name:ident, $mr:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name(
                codes: *const i8,
                scales: *const u16,
                kb: usize,
                a: *const i8,
                ad: *const f32,
                out: *mut f32,
                n: usize,
            ) {
                q8::<$mr>(codes, scales, kb, a, ad, out, n)
            }
        };
    }

    entry!(q8_1, 1);
    entry!(q8_2, 2);
    entry!(q8_3, 3);
}
