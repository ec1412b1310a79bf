//! A Q8_0 weight matmul for x86-64 CPUs from AVX2 up (AVX-512 VNNI and AMX where the CPU
//! has them), used for every Q8_0 matrix (and every Q5_0 matrix after its lossless
//! re-encoding to Q8_0).
//!
//! Why our own: candle 0.11 multiplies Q8_0 matrices whose width is not a multiple of 256
//! (all of Gemma 3 270M's: k = 640) with one scalar-scheduled AVX2 dot product per
//! (row, column) pair, converting the f16 block scale on every block. Here the weights are
//! repacked once at load into int8 codes plus f32 block scales, activations are quantized to
//! Q8_0 as llama.cpp does (per 32-element block, scale = max|x| / 127, round half away from
//! zero), and a 4 × 4 register tile of (activation row, weight row) pairs shares every load.
//! `vpdpbusd` (at AVX2: `maddubs` then `madd`) multiplies unsigned by signed bytes, so each
//! product a·w is formed as |w| · (a with w's sign), the same trick as ggml's AVX2 path.
//! At AVX-512 VNNI, several rows run two blocks at a time in 512-bit registers. At [`Isa::Amx`], 16 or
//! more activation rows go to AMX int8 tiles instead ([`crate::q8_amx`]).

use crate::decoder::{Residual, RmsNorm};
use crate::device_weights::{rms_norm, PairRope};
use crate::kquant::KMatrix;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Result, Tensor};
use tessera_kv::Isa;

#[cfg(target_arch = "x86_64")]
use crate::q8_amx::TileActs;

const BLOCK: usize = 32;
const Q8_0_BYTES: usize = 34;

/// A Q8_0 matrix `(n, k)` repacked for [`Q8Matrix::matmul`]. One exists only where the
/// CPU runs the kernels ([`Q8Matrix::from_qtensor`] returns `None` below [`Isa::Avx2`]),
/// so its matmul needs no check of its own.
pub struct Q8Matrix {
    n: usize,
    k: usize,
    /// Codes, row-major `(n, k)`.
    qs: Codes,
    /// Block scales `(n, k / 32)`, kept as f16 bits as stored (half the bytes of f32 on
    /// the memory-bound decode path).
    d: Vec<u16>,
    /// Created at [`Isa::Amx`] (capped): [`Q8Matrix::uses_amx`].
    amx: bool,
    /// Created at [`Isa::Avx512Vnni`] or above (capped): the VNNI and 512-bit kernels;
    /// the AVX2 ones otherwise.
    vnni: bool,
    /// At [`Isa::Amx`], the scales of the whole 16-row tiles again in the order the AMX
    /// kernel reads them (see [`crate::q8_amx::tile_scales`]; 6% more bytes than the
    /// codes alone); empty otherwise.
    tile_d: Vec<u16>,
    /// How the whole groups of rows sit in `qs` and `d` (the rest row-major).
    layout: Layout,
}

/// How a [`Q8Matrix`] keeps its whole groups of rows ([`crate::q8_x8`] says where each
/// code sits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// Row-major throughout: at [`Isa::Amx`] (whose tiles read rows) and off x86-64.
    Rows,
    /// Groups of eight, for the AVX2 kernels ([`crate::q8_x8`]).
    X8,
    /// Groups of sixteen with offset codes, for the AVX-512 VNNI kernels
    /// ([`crate::q8_x16`]).
    X16,
}

impl Layout {
    /// Rows in a group (1 for row-major: every row its own).
    fn group(self) -> usize {
        match self {
            Layout::Rows => 1,
            Layout::X8 => crate::q8_x8::GROUP,
            Layout::X16 => crate::q8_x16::GROUP,
        }
    }
}

/// Int8 codes in 64-byte aligned storage: a 32-byte block of a row (k a multiple of 32)
/// then never straddles two cache lines, which makes an AMX tile load several times slower.
pub(crate) struct Codes {
    lines: Vec<Line>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([i8; 64]);

impl Codes {
    pub(crate) fn zeroed(len: usize) -> Self {
        Codes {
            lines: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }
}

impl std::ops::Deref for Codes {
    type Target = [i8];
    fn deref(&self) -> &[i8] {
        // SAFETY: the lines are contiguous initialized bytes (arrays, no padding), at least
        // `len` of them.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const i8, self.len) }
    }
}

impl std::ops::DerefMut for Codes {
    fn deref_mut(&mut self) -> &mut [i8] {
        // SAFETY: as in `deref`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut i8, self.len) }
    }
}

/// Activation rows from which the AMX tiles take over: one full B tile.
const AMX_MIN_ROWS: usize = 16;

impl Q8Matrix {
    /// Repacks a 2-D Q8_0 tensor; `None` for any other type, and at any level below
    /// [`Isa::Avx2`] (`isa` capped to what this CPU runs).
    pub fn from_qtensor(t: &QTensor, isa: Isa) -> Result<Option<Self>> {
        if t.dtype() != GgmlDType::Q8_0 || !isa.capped().avx2() || !t.device().is_cpu() {
            return Ok(None);
        }
        let (n, k) = t.shape().dims2()?;
        if k == 0 || k % BLOCK != 0 {
            return Ok(None);
        }
        let kb = k / BLOCK;
        let data = t.data()?;
        let mut qs = Codes::zeroed(n * k);
        let mut d = vec![0u16; n * kb];
        for (b, block) in data.chunks_exact(Q8_0_BYTES).enumerate() {
            let scale = u16::from_le_bytes([block[0], block[1]]);
            for (dst, &src) in qs[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(&block[2..]) {
                *dst = src as i8;
            }
            d[b] = scale;
        }
        Ok(Some(Q8Matrix::new(n, k, qs, d, isa.capped())))
    }

    /// Over row-major codes and scales.
    fn new(n: usize, k: usize, mut qs: Codes, mut d: Vec<u16>, isa: Isa) -> Self {
        let (amx, vnni) = (isa.amx(), isa.vnni());
        let layout = match (cfg!(target_arch = "x86_64"), amx, vnni) {
            (false, _, _) | (true, true, _) => Layout::Rows,
            (true, false, true) => Layout::X16,
            (true, false, false) => Layout::X8,
        };
        if layout != Layout::Rows {
            crate::q8_x8::interleave(&mut qs, &mut d, n, k, layout.group(), true);
        }
        if layout == Layout::X16 {
            crate::q8_x16::flip_grouped(&mut qs, n, k);
        }
        #[cfg(target_arch = "x86_64")]
        let tile_d = if amx {
            crate::q8_amx::tile_scales(&d, n, k / BLOCK)
        } else {
            Vec::new()
        };
        #[cfg(not(target_arch = "x86_64"))]
        let tile_d = Vec::new();
        Q8Matrix {
            n,
            k,
            qs,
            d,
            amx,
            vnni,
            tile_d,
            layout,
        }
    }

    /// The rows that sit in whole groups (the rest are row-major): none where the matrix
    /// is row-major throughout.
    fn grouped_rows(&self) -> usize {
        match self.layout {
            Layout::Rows => 0,
            l => self.n / l.group() * l.group(),
        }
    }

    /// The codes and scales row-major.
    fn row_major(&self) -> (Codes, Vec<u16>) {
        let mut qs = Codes::zeroed(self.qs.len());
        qs.copy_from_slice(&self.qs);
        let mut d = self.d.clone();
        if self.layout == Layout::X16 {
            crate::q8_x16::flip_grouped(&mut qs, self.n, self.k);
        }
        if self.layout != Layout::Rows {
            crate::q8_x8::interleave(&mut qs, &mut d, self.n, self.k, self.layout.group(), false);
        }
        (qs, d)
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    /// Whether [`Q8Matrix::matmul`] of `m` activation rows runs on AMX tiles: at
    /// [`Isa::Amx`], from 16 rows (one full tile), for a matrix of 16 rows or more. Fewer
    /// rows, the weight rows past the last multiple of 16, and lower levels run the VNNI
    /// kernels.
    pub fn uses_amx(&self, m: usize) -> bool {
        cfg!(target_arch = "x86_64") && self.amx && m >= AMX_MIN_ROWS && self.n >= 16
    }

    /// `x` `(..., k)` f32 times this matrix transposed: `(..., n)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let Some(&k) = dims.last() else {
            candle_core::bail!("Q8Matrix: a scalar input has no width");
        };
        if k != self.k {
            candle_core::bail!("Q8Matrix: input width {k}, matrix width {}", self.k);
        }
        let m = x.elem_count() / k;
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        // Not zeroed first: the kernels write every one of the m × n outputs (the tests
        // check that on NaN-filled buffers), and zeroing a batch's logits buffer (64 rows ×
        // 262k columns is 67 MB) costs a memset per step.
        let mut out: Vec<f32> = Vec::with_capacity(m * self.n);
        // SAFETY: the spare capacity holds m × n floats; `matmul_into` writes each of them
        // (and reads none) before `set_len` exposes them.
        unsafe {
            self.matmul_into(&xs, m, out.as_mut_ptr());
            out.set_len(m * self.n);
        }
        let mut out_dims = dims;
        out_dims.pop();
        out_dims.push(self.n);
        Tensor::from_vec(out, out_dims, x.device())
    }

    /// `out (m, n) = x (m, k) · Wᵀ`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        // The tiles write through raw pointers: the lengths are what keeps them in bounds.
        assert!(
            out.len() == m * self.n,
            "Q8Matrix::matmul: out of {} for ({m}, {}) · ({}, {})ᵀ",
            out.len(),
            self.k,
            self.n,
            self.k
        );
        // SAFETY: `out` holds the m × n floats checked above.
        unsafe { self.matmul_into(x, m, out.as_mut_ptr()) }
    }

    /// [`Q8Matrix::matmul`] into `out`, which must have room for m × n floats; writes every
    /// one of them.
    ///
    /// # Safety
    /// `out` must be valid for writes of `m * n` floats.
    unsafe fn matmul_into(&self, x: &[f32], m: usize, out: *mut f32) {
        assert!(
            x.len() == m * self.k,
            "Q8Matrix::matmul: x of {} for ({m}, {}) · ({}, {})ᵀ",
            x.len(),
            self.k,
            self.n,
            self.k
        );
        let acts = QuantizedActs::new(
            x,
            m,
            self.k,
            self.uses_amx(m),
            // The 512-bit tile's scales (row-major VNNI matrices: the AMX level).
            self.vnni && self.layout == Layout::Rows,
            self.layout == Layout::X16,
        );
        #[cfg(target_arch = "x86_64")]
        if let Some(tiles) = &acts.tiles {
            self.matmul_amx(&acts, tiles, out);
            return;
        }
        let out_ptr = out as usize;
        #[cfg(target_arch = "x86_64")]
        if self.layout != Layout::Rows {
            // Whole groups of rows, then tiles of four over the rows past them.
            let group = self.layout.group();
            let groups = self.n / group;
            let first = groups * group;
            let items = groups + (self.n - first).div_ceil(4);
            let run = |item: usize| {
                let out = out_ptr as *mut f32;
                // SAFETY: `X8` is set only where this CPU runs AVX2 (a Q8Matrix exists from
                // that level) and `X16` only where it runs AVX-512 VNNI, whose offsets
                // `acts` then holds; each item writes only its own output columns.
                unsafe {
                    if item >= groups && self.layout == Layout::X16 {
                        self.tail_columns(&acts, first + 4 * (item - groups), out)
                    } else if item >= groups {
                        self.tile_columns(&acts, first + 4 * (item - groups), out)
                    } else if self.layout == Layout::X8 {
                        crate::q8_x8::run(
                            &self.qs,
                            &self.d,
                            self.k,
                            item,
                            &acts.q,
                            &acts.d,
                            0..m,
                            out.add(group * item),
                            self.n,
                        )
                    } else {
                        crate::q8_x16::run(
                            &self.qs,
                            &self.d,
                            self.k,
                            item,
                            &acts.q,
                            &acts.d,
                            &acts.offsets,
                            0..m,
                            out.add(group * item),
                            self.n,
                        )
                    }
                }
            };
            if m == 1 {
                // A group streams group / 4 times a tile's bytes.
                let bytes = |item: usize| if item < groups { group / 4 } else { 1 };
                crate::shares::stream(items, bytes, run);
            } else {
                candle_core::utils::barrier_pool()
                    .execute_chunked(items, |range| range.for_each(run));
            }
            return;
        }
        let tiles = self.n.div_ceil(4);
        let run = |tile: usize| {
            // SAFETY: each weight-row tile writes only its own output columns.
            unsafe { self.tile_columns(&acts, tile * 4, out_ptr as *mut f32) };
        };
        if m == 1 {
            // A decode step: a contiguous run of rows per thread (equal tiles: equal bytes).
            crate::shares::stream(tiles, |_| 1, run);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(tiles, |range| range.for_each(run));
        }
    }

    /// [`Q8Matrix::matmul`] on AMX tiles ([`Q8Matrix::uses_amx`]): whole 16-row weight
    /// tiles there, the rows past them (fewer than 16) with the VNNI kernels, as one more
    /// work item.
    #[cfg(target_arch = "x86_64")]
    /// `out` must be valid for writes of m × n floats.
    fn matmul_amx(&self, acts: &QuantizedActs, tile_acts: &TileActs, out: *mut f32) {
        use crate::q8_amx::{weight_tiles, TILE};
        let full = self.n / TILE;
        let items = full + usize::from(!self.n.is_multiple_of(TILE));
        let out_ptr = out as usize;
        candle_core::utils::barrier_pool().execute_chunked(items, |range| {
            let out = out_ptr as *mut f32;
            let tiles = range.start..range.end.min(full);
            if !tiles.is_empty() {
                // SAFETY: `uses_amx` held, so this matrix was made at Isa::Amx (capped:
                // detected here, with the tile permission granted); `acts` has m rows of
                // width k and `out` m × n floats; each range of weight tiles writes only
                // its own columns.
                unsafe {
                    weight_tiles(
                        &self.qs,
                        &self.tile_d,
                        self.n,
                        self.k,
                        tile_acts,
                        acts.m,
                        tiles,
                        out,
                    )
                };
            }
            if range.end > full {
                for j0 in (full * TILE..self.n).step_by(4) {
                    // SAFETY: as in `matmul`: columns past the AMX tiles, this item's.
                    unsafe { self.tile_columns(acts, j0, out) };
                }
            }
        });
    }

    /// All activation rows against weight rows `j0 .. j0 + 4` (fewer at the end) of a
    /// [`Layout::X16`] matrix's row-major rest, with the groups' arithmetic ([`exact_dot`]):
    /// a row's output then does not depend on whether a stack put it in a group.
    ///
    /// # Safety
    /// The matrix is [`Layout::X16`] (made where this CPU runs AVX-512 VNNI); `out` is
    /// valid for writes of m × n floats.
    #[cfg(target_arch = "x86_64")]
    unsafe fn tail_columns(&self, acts: &QuantizedActs, j0: usize, out: *mut f32) {
        for j in j0..(j0 + 4).min(self.n) {
            for i in 0..acts.m {
                *out.add(i * self.n + j) = exact_dot(self, acts, i, j);
            }
        }
    }

    /// All activation rows against weight rows `j0 .. j0 + 4` (fewer at the end).
    unsafe fn tile_columns(&self, acts: &QuantizedActs, j0: usize, out: *mut f32) {
        let nr = (self.n - j0).min(4);
        #[cfg(target_arch = "x86_64")]
        if self.amx {
            // The AMX tiles' arithmetic ([`exact_dot`]) for every row the tiles do not take
            // (fewer than 16 activation rows, weight rows past the last whole tile), so a
            // row's output does not depend on its batch at this level either.
            for j in j0..j0 + nr {
                for i in 0..acts.m {
                    *out.add(i * self.n + j) = exact_dot(self, acts, i, j);
                }
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if acts.m == 1 {
            // One activation row: weight rows one after another, a single stream per thread.
            for j in j0..j0 + nr {
                *out.add(j) = if self.vnni {
                    row_dot(self, acts, j)
                } else {
                    row_dot_avx2(self, acts, j)
                };
            }
            return;
        }
        let mut i = 0;
        while i < acts.m {
            let mr = (acts.m - i).min(4);
            let mut result = [[0f32; 4]; 4];
            #[cfg(target_arch = "x86_64")]
            if !self.vnni {
                match mr {
                    4 => kernel_avx2::<4>(self, acts, i, j0, nr, &mut result),
                    3 => kernel_avx2::<3>(self, acts, i, j0, nr, &mut result),
                    2 => kernel_avx2::<2>(self, acts, i, j0, nr, &mut result),
                    _ => kernel_avx2::<1>(self, acts, i, j0, nr, &mut result),
                }
            } else if acts.d2.is_empty() {
                match mr {
                    4 => kernel::<4>(self, acts, i, j0, nr, &mut result),
                    3 => kernel::<3>(self, acts, i, j0, nr, &mut result),
                    2 => kernel::<2>(self, acts, i, j0, nr, &mut result),
                    _ => kernel::<1>(self, acts, i, j0, nr, &mut result),
                }
            } else {
                match mr {
                    4 => kernel512::<4>(self, acts, i, j0, nr, &mut result),
                    3 => kernel512::<3>(self, acts, i, j0, nr, &mut result),
                    2 => kernel512::<2>(self, acts, i, j0, nr, &mut result),
                    _ => kernel512::<1>(self, acts, i, j0, nr, &mut result),
                }
            }
            for (r, row) in result.iter().enumerate().take(mr) {
                for (c, v) in row.iter().enumerate().take(nr) {
                    *out.add((i + r) * self.n + j0 + c) = *v;
                }
            }
            i += mr;
        }
    }
}

/// Q8_0 blocks of `x` as llama.cpp forms them ([`crate::activation::quantize_block`]).
fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    for ((src, dst), scale_out) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
    {
        let scale = crate::activation::quantize_block(src, dst);
        *scale_out = scale;
    }
}

/// Activations quantized to Q8_0 blocks.
struct QuantizedActs {
    m: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    /// Per pair of blocks, the two scales each repeated 8 times: the 16 lanes of one
    /// 512-bit step of the multi-row kernel.
    d2: Vec<f32>,
    /// Per block, −128 · its codes' sum: what the offset codes of [`Layout::X16`] add
    /// ([`crate::q8_x16::block_offsets`]); empty for other layouts.
    offsets: Vec<i32>,
    /// The rows as AMX B tiles, where the matmul runs on AMX.
    #[cfg(target_arch = "x86_64")]
    tiles: Option<TileActs>,
}

impl QuantizedActs {
    /// `amx`: also repack the rows as AMX B tiles ([`Q8Matrix::uses_amx`]), in the same
    /// parallel pass (one 16-row chunk is one tile).
    /// `wide`: also the scales in the order of the 512-bit kernel (AVX-512 VNNI).
    /// `offsets`: also the blocks' offsets for [`Layout::X16`].
    fn new(x: &[f32], m: usize, k: usize, amx: bool, wide: bool, offsets: bool) -> Self {
        let kb = k / BLOCK;
        let mut q = vec![0i8; m * k];
        let mut d = vec![0f32; m * kb];
        // Rows in parallel for prefill-sized inputs.
        const ROWS: usize = 16;
        #[cfg(target_arch = "x86_64")]
        let mut tiles = amx.then(|| TileActs::zeroed(m, k));
        #[cfg(target_arch = "x86_64")]
        let tile_parts = tiles.as_mut().map(|t| {
            let (q, d) = t.parts();
            (q as usize, d as usize)
        });
        #[cfg(not(target_arch = "x86_64"))]
        let _ = amx;
        let (qp, dp) = (q.as_mut_ptr() as usize, d.as_mut_ptr() as usize);
        candle_core::utils::barrier_pool().execute_chunked(m.div_ceil(ROWS), |range| {
            for chunk in range {
                let rows = chunk * ROWS..((chunk + 1) * ROWS).min(m);
                // SAFETY: row chunks are disjoint.
                let (q, d) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(
                            (qp as *mut i8).add(rows.start * k),
                            rows.len() * k,
                        ),
                        std::slice::from_raw_parts_mut(
                            (dp as *mut f32).add(rows.start * kb),
                            rows.len() * kb,
                        ),
                    )
                };
                quantize_blocks(&x[rows.start * k..rows.end * k], q, d);
                #[cfg(target_arch = "x86_64")]
                if let Some((tq, td)) = tile_parts {
                    use crate::q8_amx::{B_BYTES, TILE};
                    debug_assert_eq!(ROWS, TILE);
                    // SAFETY: tile `chunk`'s parts of the TileActs (kb B tiles, kb × 16
                    // scales; the TileActs holds m.div_ceil(16) tiles), written by this
                    // chunk alone.
                    let (tq, td) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(
                                (tq as *mut i8).add(chunk * kb * B_BYTES),
                                kb * B_BYTES,
                            ),
                            std::slice::from_raw_parts_mut(
                                (td as *mut f32).add(chunk * kb * TILE),
                                kb * TILE,
                            ),
                        )
                    };
                    crate::q8_amx::fill_tile(tq, td, q, d, k);
                }
            }
        });
        let d2 = if wide && m > 1 && kb.is_multiple_of(2) {
            d.chunks_exact(2)
                .flat_map(|p| [p[0]; 8].into_iter().chain([p[1]; 8]))
                .collect()
        } else {
            Vec::new()
        };
        let offsets = match offsets {
            true => crate::q8_x16::block_offsets(&q),
            false => Vec::new(),
        };
        QuantizedActs {
            m,
            q,
            d,
            d2,
            offsets,
            #[cfg(target_arch = "x86_64")]
            tiles,
        }
    }
}

/// The byte dot products of one 32-byte block, 4 to an i32 lane: `vpdpbusd` at AVX-512 VNNI,
/// `maddubs` (|w| · ±a, at most 127 · 127 · 2: no saturation) then `madd` by ones at AVX2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_dot<const VNNI: bool>(
    wabs: std::arch::x86_64::__m256i,
    signed: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, signed)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, signed), _mm256_set1_epi16(1))
    }
}

/// [`kernel_body`] at AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn kernel<const MR: usize>(
    w: &Q8Matrix,
    a: &QuantizedActs,
    i0: usize,
    j0: usize,
    nr: usize,
    result: &mut [[f32; 4]; 4],
) {
    kernel_body::<true, MR>(w, a, i0, j0, nr, result)
}

/// [`kernel_body`] at AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kernel_avx2<const MR: usize>(
    w: &Q8Matrix,
    a: &QuantizedActs,
    i0: usize,
    j0: usize,
    nr: usize,
    result: &mut [[f32; 4]; 4],
) {
    kernel_body::<false, MR>(w, a, i0, j0, nr, result)
}

/// MR activation rows against 4 weight rows, one 32-byte block at a time.
// (Indexes acc[r] and the operands of row r alike: clearer as ranges.)
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn kernel_body<const VNNI: bool, const MR: usize>(
    w: &Q8Matrix,
    a: &QuantizedActs,
    i0: usize,
    j0: usize,
    nr: usize,
    result: &mut [[f32; 4]; 4],
) {
    use std::arch::x86_64::*;
    let k = w.k;
    let kb = k / BLOCK;
    // Rows past the matrix's end repeat its last row; their results are dropped.
    let rows: [usize; 4] = std::array::from_fn(|c| j0 + c.min(nr - 1));
    let mut acc = [[_mm256_setzero_ps(); 4]; MR];
    for b in 0..kb {
        let mut wv = [_mm256_setzero_si256(); 4];
        let mut wabs = [_mm256_setzero_si256(); 4];
        let mut dw = [_mm256_setzero_ps(); 4];
        for c in 0..4 {
            wv[c] =
                _mm256_loadu_si256(w.qs.as_ptr().add(rows[c] * k + b * BLOCK) as *const __m256i);
            wabs[c] = _mm256_sign_epi8(wv[c], wv[c]);
            dw[c] = _mm256_set1_ps(f16_bits_to_f32(*w.d.get_unchecked(rows[c] * kb + b)));
        }
        for r in 0..MR {
            let av =
                _mm256_loadu_si256(a.q.as_ptr().add((i0 + r) * k + b * BLOCK) as *const __m256i);
            let da = _mm256_set1_ps(*a.d.get_unchecked((i0 + r) * kb + b));
            for c in 0..4 {
                let signed = _mm256_sign_epi8(av, wv[c]);
                let dot = block_dot::<VNNI>(wabs[c], signed);
                acc[r][c] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(da, dw[c]), acc[r][c]);
            }
        }
    }
    for r in 0..MR {
        for c in 0..4 {
            // Horizontal sum of the 8 lanes.
            let v = acc[r][c];
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
            result[r][c] = _mm_cvtss_f32(s);
        }
    }
}

/// The multi-row tile two blocks (64 bytes) at a time in 512-bit registers: half the
/// instructions of [`kernel`]. AVX-512 has no byte `sign`, so a·w is formed as
/// |w| · (a negated where w < 0) with a mask.
// (Indexes acc[r] and the operands of row r alike: clearer as ranges.)
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn kernel512<const MR: usize>(
    w: &Q8Matrix,
    a: &QuantizedActs,
    i0: usize,
    j0: usize,
    nr: usize,
    result: &mut [[f32; 4]; 4],
) {
    use std::arch::x86_64::*;
    let k = w.k;
    let kb = k / BLOCK;
    let pairs = kb / 2;
    let rows: [usize; 4] = std::array::from_fn(|c| j0 + c.min(nr - 1));
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); 4]; MR];
    for p in 0..pairs {
        let mut wabs = [zero; 4];
        let mut neg = [0u64; 4];
        let mut dw = [_mm512_setzero_ps(); 4];
        for c in 0..4 {
            let wv = _mm512_loadu_si512(w.qs.as_ptr().add(rows[c] * k + p * 2 * BLOCK) as *const _);
            wabs[c] = _mm512_abs_epi8(wv);
            neg[c] = _mm512_movepi8_mask(wv);
            let lo = _mm512_set1_ps(f16_bits_to_f32(*w.d.get_unchecked(rows[c] * kb + 2 * p)));
            let hi = _mm256_set1_ps(f16_bits_to_f32(
                *w.d.get_unchecked(rows[c] * kb + 2 * p + 1),
            ));
            dw[c] = _mm512_insertf32x8(lo, hi, 1);
        }
        for r in 0..MR {
            let av = _mm512_loadu_si512(a.q.as_ptr().add((i0 + r) * k + p * 2 * BLOCK) as *const _);
            let da = _mm512_loadu_ps(a.d2.as_ptr().add(((i0 + r) * pairs + p) * 16));
            for c in 0..4 {
                let signed = _mm512_mask_sub_epi8(av, neg[c], zero, av);
                let dot = _mm512_dpbusd_epi32(zero, wabs[c], signed);
                acc[r][c] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(da, dw[c]), acc[r][c]);
            }
        }
    }
    for r in 0..MR {
        for c in 0..4 {
            result[r][c] = _mm512_reduce_add_ps(acc[r][c]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn f16_bits_to_f32(bits: u16) -> f32 {
    use std::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Activation row `i` against row-major weight row `j` as [`crate::q8_x16`]'s groups form
/// it: per block the exact integer sum, then in block order `acc += f32(sum) · (d_w · d_a)`
/// with one rounding (a fused multiply-add), so the result equals a group lane's bit for bit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn exact_dot(w: &Q8Matrix, a: &QuantizedActs, i: usize, j: usize) -> f32 {
    use std::arch::x86_64::*;
    let (k, kb) = (w.k, w.k / BLOCK);
    let (wq, wd) = (w.qs.as_ptr().add(j * k), w.d.as_ptr().add(j * kb));
    let (aq, ad) = (a.q.as_ptr().add(i * k), a.d.as_ptr().add(i * kb));
    let mut acc = 0f32;
    for b in 0..kb {
        let wv = _mm256_loadu_si256(wq.add(b * BLOCK) as *const __m256i);
        let av = _mm256_loadu_si256(aq.add(b * BLOCK) as *const __m256i);
        let dot = block_dot::<true>(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(dot),
            _mm256_extracti128_si256(dot, 1),
        );
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        let sum = _mm_cvtsi128_si32(s) as f32;
        acc = sum.mul_add(f16_bits_to_f32(*wd.add(b)) * *ad.add(b), acc);
    }
    acc
}

/// [`row_dot_body`] at AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn row_dot(w: &Q8Matrix, a: &QuantizedActs, j: usize) -> f32 {
    row_dot_body::<true>(w, a, j)
}

/// [`row_dot_body`] at AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_dot_avx2(w: &Q8Matrix, a: &QuantizedActs, j: usize) -> f32 {
    row_dot_body::<false>(w, a, j)
}

/// How far ahead of its reads the row kernel prefetches the codes into L2.
#[cfg(target_arch = "x86_64")]
const AHEAD: usize = 4096;

/// One weight row against the single activation row (decode).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_dot_body<const VNNI: bool>(w: &Q8Matrix, a: &QuantizedActs, j: usize) -> f32 {
    use std::arch::x86_64::*;
    let k = w.k;
    let kb = k / BLOCK;
    let wq = w.qs.as_ptr().add(j * k);
    let wd = w.d.as_ptr().add(j * kb);
    // Rows are contiguous: ask for the codes (and now and then the scales) of the rows
    // ahead, so memory's latency overlaps this row's arithmetic.
    _mm_prefetch::<_MM_HINT_T1>((wd as *const i8).wrapping_add(AHEAD / 16));
    let mut acc = [_mm256_setzero_ps(); 2];
    for b in 0..kb {
        if b % 2 == 0 {
            _mm_prefetch::<_MM_HINT_T1>(wq.wrapping_add(b * BLOCK + AHEAD));
        }
        let wv = _mm256_loadu_si256(wq.add(b * BLOCK) as *const __m256i);
        let av = _mm256_loadu_si256(a.q.as_ptr().add(b * BLOCK) as *const __m256i);
        let dot = block_dot::<VNNI>(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
        let scale = _mm256_set1_ps(f16_bits_to_f32(*wd.add(b)) * *a.d.get_unchecked(b));
        // The multi-row kernels' order, so a row's output does not depend on the batch it
        // is in: VNNI's pair blocks in two halves (even and odd blocks apart), AVX2's tile
        // one accumulator.
        let lane = if VNNI { b & 1 } else { 0 };
        acc[lane] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[lane]);
    }
    let v = _mm256_add_ps(acc[0], acc[1]);
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

impl Q8Matrix {
    /// The rows of `parts` stacked into one matrix (all of one width), so projections that
    /// read the same input run as one matmul: one activation quantization, one dispatch.
    pub fn stack(parts: Vec<Q8Matrix>) -> Result<Q8Matrix> {
        let Some(k) = parts.first().map(|p| p.k) else {
            candle_core::bail!("Q8Matrix::stack: no matrices");
        };
        if let Some(p) = parts.iter().find(|p| p.k != k) {
            candle_core::bail!("Q8Matrix::stack: widths {k} and {} differ", p.k);
        }
        let n = parts.iter().map(|p| p.n).sum();
        let parts_amx = parts.iter().all(|p| p.amx);
        let parts_vnni = parts.iter().all(|p| p.vnni);
        let mut qs = Codes::zeroed(n * k);
        let mut d = Vec::with_capacity(n * k / BLOCK);
        let mut at = 0;
        for p in parts {
            let (pq, pd) = p.row_major();
            qs[at..at + pq.len()].copy_from_slice(&pq);
            at += pq.len();
            d.extend_from_slice(&pd);
        }
        let isa = match (parts_amx, parts_vnni) {
            (true, _) => Isa::Amx,
            (false, true) => Isa::Avx512Vnni,
            _ => Isa::Avx2,
        };
        Ok(Q8Matrix::new(n, k, qs, d, isa))
    }

    /// Row `j` dequantized: an embedding lookup on a tied matrix.
    pub fn row(&self, j: usize) -> Vec<f32> {
        let kb = self.k / BLOCK;
        let group = self.layout.group();
        // Offset codes are flipped back.
        let flip = match self.layout == Layout::X16 && j < self.grouped_rows() {
            true => i8::MIN,
            false => 0,
        };
        (0..self.k)
            .map(|e| {
                let at = crate::q8_x8::code_at(j, e, self.n, self.k, group);
                let scale = crate::q8_x8::scale_at(j, e / BLOCK, self.n, kb, group);
                (self.qs[at] ^ flip) as f32 * half::f16::from_bits(self.d[scale]).to_f32()
            })
            .collect()
    }
}

/// A weight matrix: repacked Q8_0 ([`Q8Matrix`]) and Q4_K / Q6_K read in place
/// ([`KMatrix`]) from [`Isa::Avx2`] (where this CPU runs them), candle's matmul otherwise.
pub enum Linear {
    Q8(Q8Matrix),
    /// Q4_K / Q6_K at [`Isa::Avx2`] and above ([`KMatrix`]).
    K(KMatrix),
    /// On a GPU, in the installed weight backend's layout ([`crate::device_weights`]).
    Device(Box<dyn crate::device_weights::DeviceMatrix>),
    Candle(candle_core::quantized::QMatMul),
}

impl Linear {
    /// `dequantize` forces f32 weights (reference tests); `isa` (capped to what this CPU
    /// runs) picks our kernels from [`Isa::Avx2`], candle's matmul below it.
    pub fn new(t: QTensor, dequantize: bool, isa: Isa) -> Result<Self> {
        if dequantize {
            return Ok(Linear::Candle(candle_core::quantized::QMatMul::Tensor(
                t.dequantize(&t.device())?,
            )));
        }
        // Q8_0 at most at AVX-512 VNNI: the AMX tiles take only batches of 16 rows or more,
        // and the kernels of fewer rows cannot give their bits at VNNI speed (the groups of
        // sixteen can, but the tiles read rows), so a row's output would depend on its
        // batch; the tiles' arithmetic everywhere halved decode at one row (Gemma 3 270M,
        // 74 → 36 tok/s), while prefill at VNNI was as fast (BENCHMARKS.md).
        let q8_level = match isa.capped() {
            Isa::Amx => Isa::Avx512Vnni,
            level => level,
        };
        if let Some(m) = Q8Matrix::from_qtensor(&t, q8_level)? {
            return Ok(Linear::Q8(m));
        }
        if KMatrix::takes(&t, isa) {
            return KMatrix::new(t, isa).map(Linear::K);
        }
        candle_core::quantized::QMatMul::from_qtensor(t).map(Linear::Candle)
    }

    /// Whether [`Linear::row`] serves rows: the matrix is in one of our layouts.
    pub fn has_rows(&self) -> bool {
        matches!(self, Linear::Q8(_) | Linear::K(_))
    }

    /// Row `j` of the weights dequantized (an embedding lookup on a tied matrix), where
    /// this matrix keeps its rows in our own layout.
    pub fn row(&self, j: usize) -> Option<Vec<f32>> {
        match self {
            Linear::Q8(m) => Some(m.row(j)),
            Linear::K(m) => Some(m.row(j)),
            Linear::Device(_) | Linear::Candle(_) => None,
        }
    }

    /// `norm(s) · Wᵀ` of the residual stream `s` ([`Residual::sum`]), returned with `s`: on a
    /// device backend, the pending add and the norm are folded into the matmul's input
    /// preparation ([`crate::device_weights::DeviceMatrix::forward_normed`]).
    pub(crate) fn forward_normed(&self, s: &Residual, norm: &RmsNorm) -> Result<(Tensor, Tensor)> {
        match self {
            Linear::Device(m) => m.forward_normed(&s.x, s.pending.as_ref(), &norm.weight, norm.eps),
            _ => {
                let sum = s.sum()?;
                let y = self.forward(&rms_norm(&sum, &norm.weight, norm.eps)?)?;
                Ok((sum, y))
            }
        }
    }

    /// `(silu(gate) · up) · Wᵀ`: on a device backend, the activation and product are folded
    /// into the matmul's input preparation.
    pub(crate) fn forward_silu_gated(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Device(m) => m.forward_silu_gated(gate, up),
            _ => self.forward(&(candle_nn::ops::silu(gate)? * up)?),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Q8(m) => m.forward(x),
            Linear::K(m) => m.forward(x),
            Linear::Device(m) => m.forward(x),
            Linear::Candle(candle_core::quantized::QMatMul::Tensor(_))
                if x.device().is_cpu() && x.rank() == 3 && x.dim(0)? > 1 && x.dim(1)? == 1 =>
            {
                // f32 weights are the reference: a decode step of several rows multiplies
                // each row on its own, so a row's logits do not depend on its neighbours
                // (the f32 matmul sums in a different order for one row than for several,
                // and a last-bit change can flip a quantized cache's code).
                let rows = (0..x.dim(0)?)
                    .map(|r| self.forward(&x.narrow(0, r, 1)?))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&rows, 0)
            }
            Linear::Candle(candle_core::quantized::QMatMul::QTensor(w)) if x.device().is_cpu() => {
                match crate::row_matmul::forward(w, x)? {
                    Some(y) => Ok(y),
                    // Another type: candle's matmul a row at a time, so that a row's output
                    // does not depend on the rows beside it (see `row_matmul`).
                    None => per_row(&candle_core::quantized::QMatMul::QTensor(w.clone()), x),
                }
            }
            // Deterministic mode on a device: candle's kernels pick their launch shape (and
            // so each output's sum order) by the row count, so each row gets a launch alone.
            Linear::Candle(m)
                if crate::device_weights::deterministic()
                    && !x.device().is_cpu()
                    && x.elem_count() > 0 =>
            {
                per_row(m, x)
            }
            Linear::Candle(m) => candle_core::Module::forward(m, x),
        }
    }
}

/// `x · Wᵀ` by candle's matmul one row of `x` at a time (each row's sums in the order a
/// one-row launch has, whatever the rows beside it).
fn per_row(m: &candle_core::quantized::QMatMul, x: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let k = *dims.last().unwrap_or(&0);
    let flat = x.reshape(((), k))?;
    let rows = (0..flat.dim(0)?)
        .map(|r| candle_core::Module::forward(m, &flat.narrow(0, r, 1)?))
        .collect::<Result<Vec<_>>>()?;
    let y = Tensor::cat(&rows, 0)?;
    let mut out = dims;
    out.pop();
    out.push(y.dim(1)?);
    y.reshape(out)
}

/// Several projections of the same input: one stacked matmul where the parts allow it (all
/// [`Q8Matrix`], or all candle-quantized in one type and width), separate matmuls
/// otherwise. `forward` returns the parts in order. Stacking saves a matmul launch (and, on
/// a GPU, an activation quantization) per extra part: on a launch-bound GPU decode step,
/// that is time.
pub enum Projections {
    Stacked { matrix: Linear, widths: Vec<usize> },
    Separate(Vec<Linear>),
}

/// Refuses a grouping of `parts` projections that does not cover them, or has an empty group.
fn check_joined(parts: usize, joined: &[usize]) -> Result<()> {
    if joined.iter().sum::<usize>() != parts || joined.contains(&0) {
        candle_core::bail!("{parts} projections joined as {joined:?}");
    }
    Ok(())
}

/// The stacked output's column widths of each group of `joined` consecutive parts.
fn joined_widths(widths: &[usize], joined: &[usize]) -> Vec<usize> {
    let mut parts = widths.iter();
    joined
        .iter()
        .map(|&j| parts.by_ref().take(j).sum())
        .collect()
}

/// The quantized tensors behind `parts`, where every part is one (and there is one).
fn quantized(parts: &[Linear]) -> Option<Vec<&QTensor>> {
    if parts.is_empty() {
        return None;
    }
    parts
        .iter()
        .map(|p| match p {
            Linear::Candle(candle_core::quantized::QMatMul::QTensor(t)) => Some(t.as_ref()),
            _ => None,
        })
        .collect()
}

/// `parts`' rows as one quantized matrix on their device, where they share a type, a
/// width and a device. GGUF rows are whole blocks, so stacking concatenates bytes.
fn stack_quantized(parts: &[&QTensor]) -> Result<Option<QTensor>> {
    let (dtype, device) = (parts[0].dtype(), parts[0].device());
    let width = parts[0].shape().dims2()?.1;
    let alike = |t: &&QTensor| {
        t.dtype() == dtype
            && t.device().same_device(&device)
            && t.shape().dims2().is_ok_and(|(_, k)| k == width)
    };
    if !parts.iter().all(alike) || width % dtype.block_size() != 0 {
        return Ok(None);
    }
    let row_bytes = width / dtype.block_size() * dtype.type_size();
    let mut bytes = Vec::new();
    let mut rows = 0;
    for t in parts {
        let n = t.shape().dims2()?.0;
        // (A device copy may carry padding past its last row.)
        bytes.extend_from_slice(&t.data()?[..n * row_bytes]);
        rows += n;
    }
    let storage = QStorage::from_data(std::borrow::Cow::Owned(bytes), &device, dtype)?;
    Ok(Some(QTensor::new(storage, (rows, width))?))
}

impl Projections {
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let device: Option<Vec<&dyn crate::device_weights::DeviceMatrix>> = parts
            .iter()
            .map(|p| match p {
                Linear::Device(m) => Some(m.as_ref()),
                _ => None,
            })
            .collect();
        if let Some(device) = device {
            if let Some(matrix) = crate::device_weights::stack(&device)? {
                let widths = device.iter().map(|m| m.out_features()).collect();
                return Ok(Projections::Stacked {
                    matrix: Linear::Device(matrix),
                    widths,
                });
            }
        }
        let q8_width = |p: &Linear| match p {
            Linear::Q8(m) => Some(m.k),
            _ => None,
        };
        let k_width = |p: &Linear| match p {
            Linear::K(m) => Some(m.in_features()),
            _ => None,
        };
        let first_k = parts.first().and_then(k_width);
        if first_k.is_some() && parts.iter().all(|p| k_width(p) == first_k) {
            let mut mats = Vec::with_capacity(parts.len());
            for p in parts {
                if let Linear::K(m) = p {
                    mats.push(m);
                }
            }
            let widths = mats.iter().map(|m| m.out_features()).collect();
            return Ok(Projections::Stacked {
                matrix: Linear::K(KMatrix::stack(mats)?),
                widths,
            });
        }
        let first = parts.first().and_then(q8_width);
        if first.is_some() && parts.iter().all(|p| q8_width(p) == first) {
            let mut mats = Vec::with_capacity(parts.len());
            for p in parts {
                if let Linear::Q8(m) = p {
                    mats.push(m);
                }
            }
            let widths = mats.iter().map(|m| m.n).collect();
            return Ok(Projections::Stacked {
                matrix: Linear::Q8(Q8Matrix::stack(mats)?),
                widths,
            });
        }
        if let Some(tensors) = quantized(&parts) {
            let widths = tensors
                .iter()
                .map(|t| t.shape().dims2().map(|d| d.0))
                .collect::<Result<Vec<_>>>()?;
            if let Some(stacked) = stack_quantized(&tensors)? {
                let matrix = candle_core::quantized::QMatMul::from_qtensor(stacked)?;
                return Ok(Projections::Stacked {
                    matrix: Linear::Candle(matrix),
                    widths,
                });
            }
        }
        Ok(Projections::Separate(parts))
    }

    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        self.forward_biased(x, None)
    }

    /// [`Projections::forward_biased`] of `norm(s)` for the residual stream `s`, returned
    /// with `s` ([`Residual::sum`]): a stacked device matrix folds the pending add and the
    /// norm into its input preparation, separate parts share one sum and one norm. Output
    /// `i` joins the next `joined[i]` parts (a stacked matrix's columns as one view, no
    /// copy; separate parts concatenated), so that an op over several of them is one op.
    pub(crate) fn forward_normed(
        &self,
        s: &Residual,
        norm: &RmsNorm,
        bias: Option<&Tensor>,
        joined: &[usize],
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let parts = match self {
            Projections::Stacked { widths, .. } => widths.len(),
            Projections::Separate(parts) => parts.len(),
        };
        check_joined(parts, joined)?;
        match self {
            Projections::Separate(_) => {
                let sum = s.sum()?;
                let normed = rms_norm(&sum, &norm.weight, norm.eps)?;
                let mut outs = self.forward_biased(&normed, bias)?.into_iter();
                let joined = joined
                    .iter()
                    .map(|&j| {
                        let group: Vec<Tensor> = outs.by_ref().take(j).collect();
                        match group.as_slice() {
                            [one] => Ok(one.clone()),
                            _ => Tensor::cat(&group, candle_core::D::Minus1),
                        }
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((sum, joined))
            }
            Projections::Stacked { matrix, widths } => {
                let (sum, all) = matrix.forward_normed(s, norm)?;
                Ok((
                    sum,
                    Self::split_biased(all, &joined_widths(widths, joined), bias)?,
                ))
            }
        }
    }

    /// [`Projections::forward_normed`] (no bias) with the stacked output's leading columns
    /// RoPE'd by the device matrix
    /// ([`crate::device_weights::DeviceMatrix::forward_normed_roped`]), or `None` where
    /// the parts are not one device matrix (the caller then ropes them itself).
    pub(crate) fn forward_normed_roped(
        &self,
        s: &Residual,
        norm: &RmsNorm,
        joined: &[usize],
        rope: &PairRope<'_>,
    ) -> Result<Option<(Tensor, Vec<Tensor>)>> {
        let Projections::Stacked {
            matrix: Linear::Device(m),
            widths,
        } = self
        else {
            return Ok(None);
        };
        check_joined(widths.len(), joined)?;
        let (sum, all) =
            m.forward_normed_roped(&s.x, s.pending.as_ref(), &norm.weight, norm.eps, rope)?;
        let widths = joined_widths(widths, joined);
        Ok(Some((sum, Self::split_biased(all, &widths, None)?)))
    }

    /// [`Projections::forward`] plus `bias`, the parts' biases concatenated (one value per
    /// output row of the stack, in part order): added once to the stacked output before the
    /// split, or split per part for separate matmuls.
    pub fn forward_biased(&self, x: &Tensor, bias: Option<&Tensor>) -> Result<Vec<Tensor>> {
        match self {
            Projections::Separate(parts) => {
                let mut start = 0;
                let outs = parts
                    .iter()
                    .map(|p| {
                        let y = p.forward(x)?;
                        let Some(bias) = bias else {
                            return Ok(y);
                        };
                        let w = y.dim(candle_core::D::Minus1)?;
                        let part = bias.narrow(0, start, w)?;
                        start += w;
                        y.broadcast_add(&part)
                    })
                    .collect::<Result<Vec<_>>>()?;
                if let Some(bias) = bias {
                    if bias.dims() != [start] {
                        candle_core::bail!(
                            "projection bias of shape {:?} for {start} output rows",
                            bias.dims()
                        );
                    }
                }
                Ok(outs)
            }
            Projections::Stacked { matrix, widths } => {
                Self::split_biased(matrix.forward(x)?, widths, bias)
            }
        }
    }

    /// A stacked output plus `bias`, split into its parts of `widths`.
    fn split_biased(all: Tensor, widths: &[usize], bias: Option<&Tensor>) -> Result<Vec<Tensor>> {
        let all = match bias {
            Some(bias) => all.broadcast_add(bias)?,
            None => all,
        };
        let last = all.rank() - 1;
        let mut start = 0;
        widths
            .iter()
            .map(|&w| {
                let part = all.narrow(last, start, w);
                start += w;
                part
            })
            .collect()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::Device;

    /// Values in [-1, 1) from a seeded xorshift stream.
    pub(crate) fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// The Q8_0 weights of `qt` `(n, k)` from its bytes, by the format's definition: per
    /// 32-element block a little-endian f16 scale then 32 int8 codes. Returns the codes
    /// and the scales (as f64).
    fn weight_blocks(qt: &QTensor) -> (Vec<i8>, Vec<f64>) {
        let data = qt.data().unwrap();
        assert_eq!(data.len() % 34, 0);
        let mut codes = Vec::new();
        let mut scales = Vec::new();
        for block in data.chunks_exact(34) {
            scales.push(half::f16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f64());
            codes.extend(block[2..].iter().map(|&b| b as i8));
        }
        (codes, scales)
    }

    /// Q8_0 activation quantization by its definition (llama.cpp's
    /// `quantize_row_q8_0_ref`, in f32 as there): per 32-element block d = max|x| / 127,
    /// codes round(x · (1 / d)) half away from zero (0 where d = 0). `f16_scale`: the
    /// scale kept as f16, as candle's Q8_0 activation blocks store it (the VNNI kernel
    /// keeps it in f32).
    fn activation_blocks(x: &[f32], f16_scale: bool) -> (Vec<i8>, Vec<f64>) {
        let mut codes = Vec::new();
        let mut scales = Vec::new();
        for block in x.chunks_exact(32) {
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
            codes.extend(block.iter().map(|v| (v * inv).round() as i8));
            scales.push(if f16_scale {
                half::f16::from_f32(d).to_f64()
            } else {
                d as f64
            });
        }
        (codes, scales)
    }

    /// Every level this CPU runs dispatches as stated (the Q8_0 kernels from AVX2,
    /// candle's matmul below it) and, at every level, `Linear::forward` on decode rows and
    /// prefill tiles (shapes not multiples of the 4 × 4 tile, nor of the 16-row
    /// quantization chunk; odd block counts take the 256-bit tile, even ones the 512-bit)
    /// matches two independent f64 references built from the format's definition:
    ///
    /// 1. the quantized arithmetic itself, Σ_blocks d_w · d_a · Σ q_w q_a, with the
    ///    activation blocks quantized by definition: within 1e-5 of the sum of the block
    ///    terms' magnitudes (f32 accumulation over at most 20 blocks is ~25 ulps);
    /// 2. the exact product of the dequantized weights (f16 scale × i8 code) with the
    ///    unquantized activations, within the bound that int8 activation rounding gives:
    ///    each activation moves by at most d_a / 2, and an f16 activation scale by a
    ///    further 2^-11 relative, so |err| ≤ Σ |w| · (d_a / 2 · (1 + 2^-11) + 2^-11 |x|)
    ///    (plus the same f32 accumulation slack).
    #[test]
    fn linear_matches_f64_references_at_every_level() {
        let dev = Device::Cpu;
        let shapes = [
            (1, 13, 640), // decode, 20 blocks
            (1, 1, 32),
            (1, 301, 96),  // decode, odd block count
            (5, 64, 64),   // 512-bit tile, one row left over
            (9, 30, 256),  // 512-bit tile, two weight rows left over
            (3, 7, 96),    // 256-bit tile (odd block count)
            (6, 1, 32),    // 256-bit tile, a single weight row
            (19, 45, 640), // prefill: two quantization chunks, three rows left over
            (34, 9, 160),  // 256-bit tile over three quantization chunks
        ];
        let levels = Isa::supported();
        assert_eq!(levels[0], Isa::Portable);
        for &isa in &levels {
            for (si, &(m, n, k)) in shapes.iter().enumerate() {
                let seed = 100 * si as u64;
                let w = Tensor::from_vec(data(n * k, seed + 1), (n, k), &dev).unwrap();
                let qt = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
                let (wq, wd) = weight_blocks(&qt);
                let mut x = data(m * k, seed + 2);
                // A zero block (scale 0) and a block of one large value among small ones.
                x[..32].fill(0.0);
                if k >= 64 {
                    x[32..64].iter_mut().for_each(|v| *v *= 1e-3);
                    x[40] = 30.0;
                }
                let lin = Linear::new(qt, false, isa).unwrap();
                let q8 = isa.avx2();
                assert_eq!(matches!(lin, Linear::Q8(_)), q8, "{isa}: dispatch");
                let xt = Tensor::from_vec(x.clone(), (1, m, k), &dev).unwrap();
                let out = lin.forward(&xt).unwrap();
                assert_eq!(out.dims(), &[1, m, n], "{isa}");
                let got: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
                let (aq, ad) = activation_blocks(&x, !q8);
                let kb = k / 32;
                for i in 0..m {
                    for j in 0..n {
                        let (mut quantized, mut magnitude) = (0f64, 0f64);
                        let (mut exact, mut bound, mut abs) = (0f64, 0f64, 0f64);
                        for b in 0..kb {
                            let (dw, da) = (wd[j * kb + b], ad[i * kb + b]);
                            let xs = &x[i * k + b * 32..i * k + (b + 1) * 32];
                            // The block's activation scale in exact arithmetic.
                            let d_exact =
                                xs.iter().fold(0f64, |a, v| a.max(v.abs() as f64)) / 127.0;
                            let mut dot = 0i64;
                            for (t, &xv) in xs.iter().enumerate() {
                                let (we, xe) = (j * k + b * 32 + t, i * k + b * 32 + t);
                                let (wv, xv) = (wq[we] as f64 * dw, xv as f64);
                                dot += wq[we] as i64 * aq[xe] as i64;
                                exact += wv * xv;
                                abs += (wv * xv).abs();
                                bound += wv.abs()
                                    * (d_exact / 2.0 * (1.0 + 2f64.powi(-11))
                                        + 2f64.powi(-11) * xv.abs());
                            }
                            let term = dw * da * dot as f64;
                            quantized += term;
                            magnitude += term.abs();
                        }
                        let g = got[i * n + j] as f64;
                        assert!(
                            (g - quantized).abs() <= 1e-5 * magnitude + 1e-12,
                            "{isa} (m {m} n {n} k {k}) [{i},{j}]: {g} vs quantized reference {quantized}"
                        );
                        let tol = bound * (1.0 + 1e-4) + 1e-5 * (abs + magnitude) + 1e-12;
                        assert!(
                            (g - exact).abs() <= tol,
                            "{isa} (m {m} n {n} k {k}) [{i},{j}]: {g} vs exact {exact} (bound {tol})"
                        );
                    }
                }
            }
        }
    }

    /// A row's output does not depend on the rows batched with it (a greedy request gives
    /// the same tokens alone and beside others, and a prompt read in one chunk or several):
    /// at every level, each row of a matmul equals that row's matmul alone, bit for bit,
    /// for Q8_0 and the K-quants on our kernels (one row runs other kernels than several at
    /// VNNI; 2–3 rows, groups of eight and sixteen, prefill tiles), and for the types
    /// candle's quantized matmul runs (`row_matmul`: each row quantized and dotted on its
    /// own, never candle's row-count-dependent repacked tiles).
    #[test]
    fn rows_come_out_the_same_alone_and_batched() {
        let dev = Device::Cpu;
        let k = 512;
        let shapes = [2usize, 3, 5, 8, 16, 19, 33, 64];
        // 64 outputs: a width candle's run-time repacking takes (37 it does not).
        for (isa, n) in Isa::supported()
            .into_iter()
            .flat_map(|l| [(l, 37), (l, 64)])
        {
            for (dtype, rows) in [
                (GgmlDType::Q8_0, &shapes[..]),
                (GgmlDType::Q4K, &shapes[..]),
                (GgmlDType::Q6K, &shapes[..]),
                (GgmlDType::Q4_0, &[2, 19][..]),
                (GgmlDType::Q5K, &[2, 19][..]),
                (GgmlDType::Q3K, &[2, 19][..]),
                (GgmlDType::Q2K, &[2, 19][..]),
            ] {
                let w = Tensor::from_vec(data(n * k, 7), (n, k), &dev).unwrap();
                let lin = Linear::new(QTensor::quantize(&w, dtype).unwrap(), false, isa).unwrap();
                for &m in rows {
                    let x = data(m * k, 8);
                    let batched: Vec<f32> = lin
                        .forward(&Tensor::from_vec(x.clone(), (1, m, k), &dev).unwrap())
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    for i in 0..m {
                        let row = Tensor::from_vec(x[i * k..(i + 1) * k].to_vec(), (1, 1, k), &dev)
                            .unwrap();
                        let alone: Vec<f32> = lin
                            .forward(&row)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1()
                            .unwrap();
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&batched[i * n..(i + 1) * n]),
                            bits(&alone),
                            "{isa} {dtype:?}, {n} outputs: row {i} of {m}"
                        );
                    }
                }
            }
        }
    }

    /// Parts of one type and width stack into one matmul whose split output equals the
    /// separate matmuls' bit for bit, at every level (Q8_0 parts: the repacked kernel at
    /// AVX2, candle below); mixed types stay separate; no parts is no stack.
    #[test]
    fn projections_stack_exactly_at_every_level() {
        let dev = Device::Cpu;
        let k = 96;
        let widths = [40, 8, 24];
        let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
        for isa in Isa::supported() {
            let part = |n: usize, seed: u64, dtype: GgmlDType| {
                let w = Tensor::from_vec(data(n * k, seed), (n, k), &dev).unwrap();
                Linear::new(QTensor::quantize(&w, dtype).unwrap(), false, isa).unwrap()
            };
            let make = |dtypes: [GgmlDType; 3]| -> Vec<Linear> {
                (0..3)
                    .map(|i| part(widths[i], 11 + i as u64, dtypes[i]))
                    .collect()
            };
            for m in [1, 5] {
                let x = Tensor::from_vec(data(m * k, 9), (1, m, k), &dev).unwrap();
                for dtype in [GgmlDType::Q4_0, GgmlDType::Q8_0] {
                    let parts = make([dtype; 3]);
                    let separate: Vec<Tensor> =
                        parts.iter().map(|p| p.forward(&x).unwrap()).collect();
                    let stacked = Projections::new(make([dtype; 3])).unwrap();
                    let Projections::Stacked { matrix, .. } = &stacked else {
                        panic!("{isa} {dtype:?}: not stacked");
                    };
                    let q8 = isa.avx2() && dtype == GgmlDType::Q8_0;
                    assert_eq!(matches!(matrix, Linear::Q8(_)), q8, "{isa} {dtype:?}");
                    let outs = stacked.forward(&x).unwrap();
                    assert_eq!(outs.len(), 3);
                    for ((got, want), n) in outs.iter().zip(&separate).zip(widths) {
                        assert_eq!(got.dims(), &[1, m, n]);
                        assert_eq!(flat(got), flat(want), "{isa} {dtype:?} m {m}");
                    }
                    // Biases: added to the stack before the split, or per part, alike.
                    let total: usize = widths.iter().sum();
                    let bias = Tensor::from_vec(data(total, 5), total, &dev).unwrap();
                    let unstacked = Projections::Separate(make([dtype; 3]));
                    let a = stacked.forward_biased(&x, Some(&bias)).unwrap();
                    let b = unstacked.forward_biased(&x, Some(&bias)).unwrap();
                    let mut start = 0;
                    for ((got, other), (want, n)) in
                        a.iter().zip(&b).zip(separate.iter().zip(widths))
                    {
                        let part = bias.narrow(0, start, n).unwrap();
                        start += n;
                        let want = flat(&want.broadcast_add(&part).unwrap());
                        assert_eq!(flat(got), want, "{isa} {dtype:?} m {m} biased");
                        assert_eq!(flat(other), want, "{isa} {dtype:?} m {m} biased, separate");
                    }
                    let short = bias.narrow(0, 0, total - 1).unwrap();
                    assert!(stacked.forward_biased(&x, Some(&short)).is_err());
                    assert!(unstacked.forward_biased(&x, Some(&short)).is_err());
                }
            }
            let mixed = [GgmlDType::Q4_0, GgmlDType::Q8_0, GgmlDType::Q4_0];
            assert!(matches!(
                Projections::new(make(mixed)).unwrap(),
                Projections::Separate(_)
            ));
            assert!(matches!(
                Projections::new(Vec::new()).unwrap(),
                Projections::Separate(p) if p.is_empty()
            ));
        }
    }
    /// A Q8_0 matrix `(n, k)` of random codes (the whole i8 range) and random f16 scales
    /// of both signs, repacked at `isa`.
    fn random_q8(n: usize, k: usize, seed: u64, isa: Isa) -> Option<Q8Matrix> {
        let codes = data(n * k, seed);
        let scales = data(n * k / 32, seed + 1);
        let mut bytes = Vec::with_capacity(n * k / 32 * 34);
        for (block, s) in codes.chunks_exact(32).zip(&scales) {
            bytes.extend(half::f16::from_f32(s * 0.02).to_bits().to_le_bytes());
            bytes.extend(block.iter().map(|v| ((v * 128.0).floor() as i8) as u8));
        }
        let storage = QStorage::from_data(
            std::borrow::Cow::Owned(bytes),
            &Device::Cpu,
            GgmlDType::Q8_0,
        )
        .unwrap();
        let qt = QTensor::new(storage, (n, k)).unwrap();
        Q8Matrix::from_qtensor(&qt, isa).unwrap()
    }

    /// At the detected level, `Q8Matrix::matmul` of 16 or more rows (the AMX tiles where
    /// AMX is detected; n past a multiple of 16, m past a multiple of 16 and k of one block,
    /// of one k chunk and of two, the second short (1312 = 41 blocks), included) matches an
    /// f64 reference from the definition (activations quantized by definition, exact
    /// integer block dots, times both scales) and the VNNI kernel, both within 1e-5 of
    /// Σ |d_w d_a q_w q_a| (the VNNI kernel's partial sums per lane can cancel, so the
    /// block terms' magnitudes alone do not bound it). The AMX path runs exactly where AMX
    /// is detected, and never capped to AVX-512 VNNI; where the CPU has no AVX2 there is no
    /// Q8Matrix to test.
    #[test]
    fn amx_matmul_matches_reference_and_vnni() {
        let top = Isa::detected();
        for (si, &k) in [32, 640, 1312, 2048].iter().enumerate() {
            for (ni, &n) in [16, 40, 640, 2048].iter().enumerate() {
                let seed = 1000 * si as u64 + 100 * ni as u64;
                let Some(w) = random_q8(n, k, seed, top) else {
                    // Only where the CPU has no AVX2, so no Q8Matrix at all.
                    assert!(!top.avx2(), "{top}: no Q8Matrix");
                    continue;
                };
                let vnni = random_q8(n, k, seed, Isa::Avx512Vnni).unwrap();
                let (wq, wd) = w.row_major();
                let kb = k / 32;
                for m in [1, 5, 16, 17, 33, 64, 512] {
                    let amx = top == Isa::Amx && m >= 16;
                    assert_eq!(w.uses_amx(m), amx, "{top} m {m} n {n}");
                    assert!(!vnni.uses_amx(m));
                    let mut x: Vec<f32> = data(m * k, seed + 7 + m as u64)
                        .into_iter()
                        .map(|v| v * 3.0)
                        .collect();
                    x[..32].fill(0.0);
                    let (aq, ad) = activation_blocks(&x, false);
                    // NaN-filled: an output the kernel does not write fails the comparison.
                    let mut got = vec![f32::NAN; m * n];
                    w.matmul(&x, m, &mut got);
                    let mut other = vec![f32::NAN; m * n];
                    vnni.matmul(&x, m, &mut other);
                    for i in 0..m {
                        for j in 0..n {
                            let (mut want, mut magnitude) = (0f64, 0f64);
                            for b in 0..kb {
                                let (wb, ab) = (j * k + b * 32, i * k + b * 32);
                                let (mut dot, mut abs) = (0i64, 0i64);
                                for t in 0..32 {
                                    let p = wq[wb + t] as i64 * aq[ab + t] as i64;
                                    dot += p;
                                    abs += p.abs();
                                }
                                let dw = half::f16::from_bits(wd[j * kb + b]).to_f64();
                                let scale = dw * ad[i * kb + b];
                                want += scale * dot as f64;
                                magnitude += (scale * abs as f64).abs();
                            }
                            let tol = 1e-5 * magnitude + 1e-12;
                            let (g, v) = (got[i * n + j] as f64, other[i * n + j] as f64);
                            assert!(
                                (g - want).abs() <= tol,
                                "{top} (m {m} n {n} k {k}) [{i},{j}]: {g} vs reference {want}"
                            );
                            assert!(
                                (g - v).abs() <= tol,
                                "{top} (m {m} n {n} k {k}) [{i},{j}]: {g} vs VNNI {v}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// GFLOP/s of the Q8_0 kernels at each level this CPU runs from AVX2 (the groups of
    /// eight, of sixteen, the AMX tiles) on Gemma 3 270M's shapes (run with `--ignored
    /// --nocapture`). `warm`: one matrix again and again (in cache if it fits); `cold`:
    /// cycling through copies of 192 MB in all, as a forward pass streams its weights from
    /// memory.
    #[test]
    #[ignore]
    fn q8_matmul_speed() {
        let levels: Vec<Isa> = [Isa::Avx2, Isa::Avx512Vnni, Isa::Amx]
            .into_iter()
            .filter(|l| *l <= Isa::detected())
            .collect();
        for (n, k) in [(262_144, 640), (2048, 640), (640, 2048)] {
            let copies = (192_000_000 / (n * k)).max(1);
            for &level in &levels {
                let ws: Vec<Q8Matrix> = (0..copies)
                    .filter_map(|c| random_q8(n, k, 1 + c as u64, level))
                    .collect();
                for m in [1, 16, 64, 512] {
                    let x = data(m * k, 2);
                    let mut out = vec![0f32; m * n];
                    let reps = (4e10 / (2.0 * (m * n * k) as f64)).clamp(2.0, 400.0) as usize;
                    let mut line =
                        format!("{level:10} {:?} m {m:4} n {n:6} k {k:4}:", ws[0].layout);
                    for (label, count) in [("warm", 1), ("cold", ws.len())] {
                        ws[0].matmul(&x, m, &mut out);
                        let start = std::time::Instant::now();
                        for r in 0..reps {
                            ws[r % count].matmul(&x, m, &mut out);
                        }
                        let s = start.elapsed().as_secs_f64() / reps as f64;
                        let gflops = 2.0 * (m * n * k) as f64 / s / 1e9;
                        line += &format!("  {label} {:8.3} ms {gflops:7.1} GFLOP/s", s * 1e3);
                    }
                    println!("{line}");
                }
            }
        }
    }
}
