//! The Q8_0 matmul on Intel AMX int8 tiles, for 16 or more activation rows
//! ([`crate::q8::Q8Matrix`] dispatches here at [`tessera_kv::Isa::Amx`]).
//!
//! Q8_0 scales change every 32 elements, so each tile product covers one block: `tdpbssd`
//! (signed × signed bytes, no sign trick) of a 16 × 32-byte A tile and an 8 × 64-byte B
//! tile gives a 16 × 16 int32 tile, which AVX-512 converts and accumulates in f32 with the
//! two block scales. The product is computed transposed, weights as A (16 weight rows
//! loaded straight from the row-major codes with stride k, no repacking) and activations
//! as B, repacked once per matmul into the 4-byte interleave B needs; the (weight row,
//! activation row) accumulator is transposed in registers at the end.
//!
//! Tiles: tmm0..tmm3 the int32 results, tmm4 / tmm5 the weights, tmm6 / tmm7 the
//! activations. Tile products run a group of four steps ahead of the scaling, so that the
//! AMX unit and the vector units overlap. Measured on Sapphire Rapids class cores, a step
//! (one 16 × 16 × 32 product and its scaling) takes ~30 ns with its operands in L1, the
//! products alone half of that, so per int8 multiply-add this is ~5 times the VNNI kernel;
//! with weights from memory, tileloadd's strided misses (which do not overlap) make it
//! less, hence the prefetches.
#![cfg(target_arch = "x86_64")]

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;

use crate::q8::Codes;

const BLOCK: usize = 32;
/// Weight rows per A tile and activation rows per B tile.
pub(crate) const TILE: usize = 16;
/// Bytes of one B tile: 8 rows of 16 activation rows × 4 bytes.
pub(crate) const B_BYTES: usize = 8 * 64;

/// Quantized activations as B tiles: for activation tile `t` (rows 16t..16t+16, rows past
/// m zero) and block `b`, 8 rows of 64 bytes with `B[r][4i + u] = x[16t + i][32b + 4r + u]`,
/// and the 16 rows' block scales.
pub(crate) struct TileActs {
    tiles: usize,
    kb: usize,
    /// `(tiles, kb, 8, 64)` codes (each B tile 8 whole cache lines).
    q: Codes,
    /// `(tiles, kb, 16)` scales.
    d: Vec<f32>,
}

impl TileActs {
    /// Room for `m` rows of width `k`, all zero (so the rows past m of the last tile are).
    pub(crate) fn zeroed(m: usize, k: usize) -> Self {
        let kb = k / BLOCK;
        let tiles = m.div_ceil(TILE);
        TileActs {
            tiles,
            kb,
            q: Codes::zeroed(tiles * kb * B_BYTES),
            d: vec![0f32; tiles * kb * TILE],
        }
    }

    /// The codes and scales as raw parts, for the quantization to fill the tiles in
    /// parallel ([`fill_tile`]): tile t's codes start at `t · kb · B_BYTES`, its scales at
    /// `t · kb · 16`.
    pub(crate) fn parts(&mut self) -> (*mut i8, *mut f32) {
        (self.q.as_mut_ptr(), self.d.as_mut_ptr())
    }
}

/// Writes one activation tile (`tq`: `(kb, 8, 64)` codes, `td`: `(kb, 16)` scales) from its
/// rows' Q8_0 codes `q` `(rows, k)` and scales `d` `(rows, k / 32)`, rows ≤ 16.
pub(crate) fn fill_tile(tq: &mut [i8], td: &mut [f32], q: &[i8], d: &[f32], k: usize) {
    let kb = k / BLOCK;
    for (i, (src, scales)) in q.chunks_exact(k).zip(d.chunks_exact(kb)).enumerate() {
        for (b, (dst, block)) in tq
            .chunks_exact_mut(B_BYTES)
            .zip(src.chunks_exact(BLOCK))
            .enumerate()
        {
            for (r, four) in block.chunks_exact(4).enumerate() {
                dst[r * 64 + 4 * i..r * 64 + 4 * i + 4].copy_from_slice(four);
            }
            td[b * TILE + i] = scales[b];
        }
    }
}

/// The 64-byte operand of `ldtilecfg` / `sttilecfg` (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of tmm0..tmm7 (then 8 reserved).
    colsb: [u16; 16],
    /// Rows of tmm0..tmm7 (then 8 reserved).
    rows: [u8; 16],
}

impl TileConfig {
    fn ours() -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        // tmm0..tmm3: 16 × 16 int32 results; tmm4, tmm5: 16 weight rows × 32 codes;
        // tmm6, tmm7: 8 rows × (16 activation rows × 4 codes).
        for t in 0..8 {
            (c.rows[t], c.colsb[t]) = match t {
                0..=3 => (16, 64),
                4 | 5 => (16, 32),
                _ => (8, 64),
            };
        }
        c
    }
}

/// The block scales of the whole 16-row tiles of an `(n, kb)` scale matrix, in the order
/// the tiles read them: `(n / 16, kb, 16)`, the 16 rows' scales of a block together.
pub(crate) fn tile_scales(d: &[u16], n: usize, kb: usize) -> Vec<u16> {
    let mut out = vec![0u16; n / TILE * TILE * kb];
    for (tile, dst) in out.chunks_exact_mut(TILE * kb).enumerate() {
        for b in 0..kb {
            for r in 0..TILE {
                dst[b * TILE + r] = d[(tile * TILE + r) * kb + b];
            }
        }
    }
    out
}

/// Tile products issued together: one per result tile. A product's int32 tile is stored
/// to memory and read back by vector loads; the products of group g + 1 are issued before
/// the scaling of group g, so that the AMX unit and the vector units overlap.
const GROUP: usize = 4;
/// Result buffers: two groups.
const RING: usize = 2 * GROUP;
/// Weight tiles between the one multiplied and the one prefetched.
const PREFETCH: usize = 2;
/// Steps between a B tile multiplied and the one prefetched.
const PREFETCH_B: usize = 8;

/// Blocks of one k chunk where there are several activation tiles: the weight tile's part
/// (16 KiB) stays in L1 while the activation tiles' parts stream past it. A whole weight
/// row of k = 2048 (32 KiB a tile) would not, and tileloadd's strided reloads from L2 are
/// slow.
const K_CHUNK: usize = 32;

/// Where the stream of (weight tile, k chunk, activation tile, block) steps is.
#[derive(Clone, Copy)]
struct Cursor {
    tile: usize,
    chunk: usize,
    t: usize,
    b: usize,
}

impl Cursor {
    /// `kc`: blocks per k chunk (the last one may be shorter).
    fn advance(&mut self, kb: usize, kc: usize, act_tiles: usize) {
        self.b += 1;
        if self.b == kb.min((self.chunk + 1) * kc) {
            self.t += 1;
            if self.t == act_tiles {
                self.t = 0;
                self.chunk += 1;
                if self.chunk * kc >= kb {
                    self.chunk = 0;
                    self.tile += 1;
                }
            }
            self.b = self.chunk * kc;
        }
    }
}

/// Output columns of the weight tiles `tiles` (16 rows each) of `out (m, n) = x · Wᵀ`, for
/// the weight codes `qs` `(n, k)` and their scales in tile order `dt` ([`tile_scales`]).
///
/// All (weight tile, k chunk, activation tile, block) steps of the range run as one
/// stream, so the tile products stay a [`GROUP`] ahead across pair and tile boundaries too.
///
/// # Safety
/// The CPU runs AMX-INT8 and AVX-512 and this process holds the tile data permission
/// ([`tessera_kv::Isa::Amx`] detected); `acts` holds `m` rows of width `k`; `out` points at
/// `m × n` floats of which only columns of `tiles` are written, by this call alone.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn weight_tiles(
    qs: &[i8],
    dt: &[u16],
    n: usize,
    k: usize,
    acts: &TileActs,
    m: usize,
    tiles: Range<usize>,
    out: *mut f32,
) {
    #[repr(C, align(64))]
    struct Results([[i32; TILE * TILE]; RING]);
    let kb = k / BLOCK;
    assert!(
        tiles.end * TILE <= n
            && qs.len() == n * k
            && dt.len() == n / TILE * TILE * kb
            && acts.kb == kb
            && acts.tiles == m.div_ceil(TILE)
    );
    let steps = tiles.len() * acts.tiles * kb;
    if steps == 0 {
        return;
    }
    // Another kernel on this thread (candle's AMX Q4_K matmul) may hold a configuration of
    // its own: keep it, run on ours, put it back.
    let mut saved = TileConfig::ours();
    let ours = TileConfig::ours();
    // SAFETY: both operands are 64 writable / readable bytes; AMX runs here (the caller's
    // contract).
    unsafe {
        asm!("sttilecfg [{}]", in(reg) &mut saved, options(nostack));
        asm!("ldtilecfg [{}]", in(reg) &ours, options(nostack));
    }
    let mut ring = Results([[0; TILE * TILE]; RING]);
    let ring_ptr = ring.0.as_mut_ptr() as *mut i32;
    // The current weight tile's scales as f32, `(kb, 16)`.
    let mut scales = vec![0f32; kb * TILE];
    // One activation tile reads each weight once: no chunks.
    let kc = if acts.tiles == 1 { kb } else { K_CHUNK.min(kb) };
    let start = Cursor {
        tile: tiles.start,
        chunk: 0,
        t: 0,
        b: 0,
    };
    let mut ahead = start;
    // SAFETY (every `group`): tileloadd reads 16 rows of 32 bytes at stride k from block b
    // of weight tile `tile` (rows tile·16 .. +16 ≤ n), and the 512 bytes of B tile (t, b);
    // both in bounds (tile < tiles.end, t < acts.tiles, b < kb, checked above). tilestored
    // writes 1 KiB into each of the group's result buffers. The configuration is ours
    // (loaded above). (A macro, not a closure: a call would spill the 16 accumulators.)
    macro_rules! group {
        ($g:expr) => {{
            let g: usize = $g;
            let count = (steps - g * GROUP).min(GROUP);
            let mut w = [qs.as_ptr(); GROUP];
            let mut x = [acts.q.as_ptr(); GROUP];
            for i in 0..count {
                unsafe {
                    w[i] = qs.as_ptr().add(ahead.tile * TILE * k + ahead.b * BLOCK);
                    x[i] = acts.q.as_ptr().add((ahead.t * kb + ahead.b) * B_BYTES);
                }
                // The next B tiles of this stream (contiguous until the next weight
                // tile), from L2 for prefill-sized inputs.
                let xnext = x[i].wrapping_add(PREFETCH_B * B_BYTES);
                for line in 0..B_BYTES / 64 {
                    _mm_prefetch::<_MM_HINT_T0>(xnext.wrapping_add(line * 64));
                }
                if ahead.t == 0 {
                    // The weights stream from memory once (decode batches): fetch the
                    // tile PREFETCH tiles ahead, a block's share (512 bytes) per step.
                    // (Prefetches do not fault; past the end they are wasted.)
                    let next = qs
                        .as_ptr()
                        .wrapping_add((ahead.tile + PREFETCH) * TILE * k + ahead.b * B_BYTES);
                    for line in 0..B_BYTES / 64 {
                        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(line * 64));
                    }
                }
                ahead.advance(kb, kc, acts.tiles);
            }
            let c = unsafe { ring_ptr.add(g % 2 * GROUP * TILE * TILE) };
            unsafe { group_products(count, &w, &x, k, c) };
        }};
    }
    // The stream prefetches PREFETCH weight tiles ahead; the first ones of this range
    // here, all their lines at once (tileloadd's own misses do not overlap).
    for tile in tiles.start..(tiles.start + PREFETCH).min(tiles.end) {
        let base = qs[tile * TILE * k..(tile + 1) * TILE * k].as_ptr();
        for line in 0..TILE * k / 64 {
            // SAFETY: within the tile's bytes (16k, a multiple of 64).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(line * 64)) };
        }
    }
    group!(0);
    let mut step = 0;
    for tile in tiles {
        let src = &dt[tile * TILE * kb..(tile + 1) * TILE * kb];
        for (dst, src) in scales.chunks_exact_mut(TILE).zip(src.chunks_exact(TILE)) {
            // SAFETY: 16 u16 read, 16 f32 written, both in bounds (chunks of 16).
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr() as *const __m256i);
                _mm512_storeu_ps(dst.as_mut_ptr(), _mm512_cvtph_ps(h));
            }
        }
        for chunk in 0..kb.div_ceil(kc) {
            for t in 0..acts.tiles {
                let mut acc = [_mm512_setzero_ps(); TILE];
                for b in chunk * kc..kb.min((chunk + 1) * kc) {
                    if step % GROUP == 0 && step + GROUP < steps {
                        group!(step / GROUP + 1);
                    }
                    // SAFETY: the result buffer of this step (written by its product, whose
                    // store precedes these loads), the 16 weight scales of block b and the 16
                    // activation scales of (t, b): all in bounds.
                    unsafe {
                        let c = ring_ptr.add(step % RING * TILE * TILE);
                        let dw = scales.as_ptr().add(b * TILE);
                        let da = _mm512_loadu_ps(acts.d.as_ptr().add((t * kb + b) * TILE));
                        for (j, a) in acc.iter_mut().enumerate() {
                            let v =
                                _mm512_cvtepi32_ps(_mm512_load_si512(c.add(j * TILE) as *const _));
                            let s = _mm512_mul_ps(da, _mm512_set1_ps(*dw.add(j)));
                            *a = _mm512_fmadd_ps(v, s, *a);
                        }
                    }
                    step += 1;
                }
                // acc[j][i] (weight row j, activation row i) to output rows i.
                transpose16(&mut acc);
                let rows = TILE.min(m - t * TILE);
                for (i, v) in acc.iter().enumerate().take(rows) {
                    // SAFETY: row 16t + i < m, columns tile·16 .. +16 ≤ n: in `out`, and
                    // this call's (the caller's contract).
                    unsafe {
                        let o = out.add((t * TILE + i) * n + tile * TILE);
                        let sum = if chunk == 0 {
                            *v
                        } else {
                            _mm512_add_ps(_mm512_loadu_ps(o), *v)
                        };
                        _mm512_storeu_ps(o, sum);
                    }
                }
            }
        }
    }
    // SAFETY: as above; a saved configuration in the init state (palette 0, nothing was
    // configured) is restored by releasing the tiles.
    unsafe {
        if saved.palette == 0 {
            asm!("tilerelease", options(nostack, nomem));
        } else {
            asm!("ldtilecfg [{}]", in(reg) &saved, options(nostack));
        }
    }
}

/// The tile products of up to [`GROUP`] steps (weights at `w[i]`, row stride k; B tiles
/// at `x[i]`), stored to `c`, 1 KiB each: result tiles tmm0..tmm3, weights and activations
/// alternating between tmm4 / tmm6 and tmm5 / tmm7, so that consecutive products share no
/// tile register.
#[inline(always)]
unsafe fn group_products(
    count: usize,
    w: &[*const i8; GROUP],
    x: &[*const i8; GROUP],
    k: usize,
    c: *mut i32,
) {
    macro_rules! product {
        ($c:literal, $a:literal, $b:literal, $i:expr) => {
            asm!(
                concat!("tilezero ", $c),
                concat!("tileloadd ", $a, ", [{w} + {k} * 1]"),
                concat!("tileloadd ", $b, ", [{x} + {s} * 1]"),
                concat!("tdpbssd ", $c, ", ", $a, ", ", $b),
                concat!("tilestored [{c} + {s} * 1], ", $c),
                w = in(reg) w[$i],
                k = in(reg) k,
                x = in(reg) x[$i],
                c = in(reg) c.add($i * TILE * TILE),
                s = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    // SAFETY: the caller's (see `weight_tiles`).
    unsafe {
        if count == GROUP {
            asm!(
                "tilezero tmm0",
                "tileloadd tmm4, [{w0} + {k} * 1]",
                "tileloadd tmm6, [{x0} + {s} * 1]",
                "tdpbssd tmm0, tmm4, tmm6",
                "tilezero tmm1",
                "tileloadd tmm5, [{w1} + {k} * 1]",
                "tileloadd tmm7, [{x1} + {s} * 1]",
                "tdpbssd tmm1, tmm5, tmm7",
                "tilestored [{c} + {s} * 1], tmm0",
                "tilezero tmm2",
                "tileloadd tmm4, [{w2} + {k} * 1]",
                "tileloadd tmm6, [{x2} + {s} * 1]",
                "tdpbssd tmm2, tmm4, tmm6",
                "tilestored [{c} + {s} * 1 + 1024], tmm1",
                "tilezero tmm3",
                "tileloadd tmm5, [{w3} + {k} * 1]",
                "tileloadd tmm7, [{x3} + {s} * 1]",
                "tdpbssd tmm3, tmm5, tmm7",
                "tilestored [{c} + {s} * 1 + 2048], tmm2",
                "tilestored [{c} + {s} * 1 + 3072], tmm3",
                w0 = in(reg) w[0],
                w1 = in(reg) w[1],
                w2 = in(reg) w[2],
                w3 = in(reg) w[3],
                x0 = in(reg) x[0],
                x1 = in(reg) x[1],
                x2 = in(reg) x[2],
                x3 = in(reg) x[3],
                k = in(reg) k,
                c = in(reg) c,
                s = in(reg) 64usize,
                options(nostack),
            );
            return;
        }
        if count > 0 {
            product!("tmm0", "tmm4", "tmm6", 0);
        }
        if count > 1 {
            product!("tmm1", "tmm5", "tmm7", 1);
        }
        if count > 2 {
            product!("tmm2", "tmm4", "tmm6", 2);
        }
    }
}

/// Transposes 16 rows of 16 floats: at each of the 4 levels, rows r and r + h (r without
/// bit h) swap their off-diagonal h × h blocks, which swaps bit h of the row and column
/// index; after all four, (r, c) holds what (c, r) held.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: &mut [__m512; 16]) {
    swap_blocks::<8>(r);
    swap_blocks::<4>(r);
    swap_blocks::<2>(r);
    swap_blocks::<1>(r);
}

/// One level of [`transpose16`]: the `H × H` block swap of rows r and r + H.
#[inline]
#[target_feature(enable = "avx512f")]
fn swap_blocks<const H: usize>(r: &mut [__m512; 16]) {
    let lo: [i32; 16] = std::array::from_fn(|c| if c & H == 0 { c } else { 16 + c - H } as i32);
    let hi: [i32; 16] = std::array::from_fn(|c| if c & H == 0 { c + H } else { 16 + c } as i32);
    // SAFETY: 16 i32 read from each array.
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_si512(lo.as_ptr() as *const _),
            _mm512_loadu_si512(hi.as_ptr() as *const _),
        )
    };
    for q in 0..8 {
        // The q-th row without bit H.
        let p = (q & !(H - 1)) << 1 | (q & (H - 1));
        let (a, b) = (r[p], r[p + H]);
        r[p] = _mm512_permutex2var_ps(a, lo, b);
        r[p + H] = _mm512_permutex2var_ps(a, hi, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_transposes() {
        if !std::is_x86_feature_detected!("avx512f") {
            // (The AMX path, its only user, needs AVX-512 too.)
            return;
        }
        let m: Vec<f32> = (0..256).map(|v| v as f32).collect();
        let mut rows = [[0f32; 16]; 16];
        // SAFETY: AVX-512 F checked above; 16 floats per row.
        unsafe {
            let mut r: [__m512; 16] =
                std::array::from_fn(|i| _mm512_loadu_ps(m.as_ptr().add(16 * i)));
            transpose16(&mut r);
            for (dst, v) in rows.iter_mut().zip(r) {
                _mm512_storeu_ps(dst.as_mut_ptr(), v);
            }
        }
        for (i, row) in rows.iter().enumerate() {
            for (j, v) in row.iter().enumerate() {
                assert_eq!(*v, (16 * j + i) as f32, "[{i}][{j}]");
            }
        }
    }
}
