//! Q4_K and Q6_K weight matmuls (decode, batches, prefill) for x86-64 CPUs from AVX2 up:
//! most of a Q4_K_M file (all of Qwen 2.5's matrices, Gemma 3's attn_output and ffn_down).
//!
//! Why our own: a decode step streams every weight once, so it runs at the speed memory
//! delivers the bytes, if the arithmetic keeps up. candle 0.11 repacks Q4_K for its
//! AVX-512 tiles with every 32-element scale and minimum widened to f32 (6 bits a weight
//! where the file has 4.5: a third more bytes per step), and runs Q6_K decode one
//! scalar-scheduled dot product per row. Here the activations are quantized once per matmul
//! to int8 per 256-element block, as llama.cpp's Q8_K (scale max|x| / 127, round half away
//! from zero), with the sums of every 16 and 32 codes kept for the minima and offsets. A
//! block's integer dot is exact in i32: `maddubs` multiplies the unsigned weight codes by
//! the signed activation codes into i16 pairs (at most 63 · 128 · 2, no saturation), then
//! `madd` (AVX-512 VNNI: `vpdpwssd`) weighs the pairs by their sub-block's scale into i32
//! lanes; one f32 multiply-add per block applies the block and activation scales.
//!
//! The whole groups of eight rows are held again interleaved (`kquant/x8.rs`, a second copy
//! of the weights beside the file's bytes that candle's matmul reads): one i32 lane per
//! weight row, so the per-row work (scales, minima, the final sum) is one vector op for
//! eight rows. Those kernels take every input, decode and prefill, so a row's output never
//! depends on how many rows share its matmul. At AVX-512 VNNI two neighbouring groups run
//! side by side in 512-bit registers (each op once for sixteen rows) where there are several
//! activation rows, with the same arithmetic per row; on a Zen 5 (`kquant_matmul_speed`)
//! they run Q4_K at 1.2–1.8× candle's repacked AVX-512 tiles from 16 to 512 rows and Q6_K
//! at 0.85–1.4×, and a decode at 1.3× the file-layout 512-bit kernels (Qwen 2.5 1.5B: 37 →
//! 49 tok/s). The rows past the last whole group read the file's blocks in place: at VNNI
//! one or two activation rows in 512-bit registers against two weight rows, each weight
//! block unpacked once (two blocks' 6-bit scales at a time, by byte shuffles); at AVX2
//! 256-bit tiles of the same arithmetic. Each weight row stream is prefetched into L2 ahead
//! of use (the hardware prefetcher alone left the arithmetic and the wait for memory
//! serialized: half the bandwidth).
//!
//! Several matrices that read the same input (q/k/v of mixed types) stack into one
//! [`KMatrix`]: one activation quantization, one dispatch.

mod x8;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Result, Tensor};
use tessera_kv::Isa;

/// Elements per superblock.
const QK: usize = 256;
const Q4K_BYTES: usize = 144;
const Q6K_BYTES: usize = 210;
/// Weight rows per work item handed to a thread: one group of eight at AVX2, two at VNNI
/// (`kquant/x8.rs`).
const ROWS_PER_ITEM: usize = 8;
/// Activation rows per work item of a multi-row matmul (their codes stay in L2 while the
/// item's weight rows are read).
const ACT_ROWS_PER_ITEM: usize = 64;

/// A Q4_K superblock as the file stores it.
#[repr(C)]
#[derive(Clone, Copy)]
struct Q4Block {
    /// f16 bits: the superblock's scale of scales and scale of minima.
    d: u16,
    dmin: u16,
    /// Eight 6-bit scales and minima, one pair per 32-element sub-block ([`q4k_scale_min`]).
    packed: [u8; 12],
    /// Element 64j + l is the low nibble of `qs[32j + l]`, element 64j + 32 + l its high
    /// nibble.
    qs: [u8; 128],
}

/// A Q6_K superblock as the file stores it.
#[repr(C)]
#[derive(Clone, Copy)]
struct Q6Block {
    /// Low 4 bits: element 128h + l is `ql[64h + l] & 15`, 128h + 32 + l is
    /// `ql[64h + 32 + l] & 15`, 128h + 64 + l and 128h + 96 + l the high nibbles of the same.
    ql: [u8; 128],
    /// High 2 bits of the same four elements: bit pairs 0, 2, 4, 6 of `qh[32h + l]`.
    qh: [u8; 64],
    /// Per 16-element sub-block.
    scales: [i8; 16],
    d: u16,
}

const _: () =
    assert!(std::mem::size_of::<Q4Block>() == 144 && std::mem::size_of::<Q6Block>() == 210);

/// Rows of one type: the tensor's own bytes, read in place (no second copy), and
/// candle's matmul for inputs of many rows.
struct Part {
    rows: usize,
    q4: bool,
    /// Where the tensor's blocks start: CPU storage, owned by `matmul`'s tensor, which
    /// never moves or changes.
    blocks: usize,
    matmul: QMatMul,
    /// The whole groups of eight rows again, interleaved for the group kernels (on
    /// x86-64).
    x8: Option<x8::Interleaved>,
}

impl Part {
    fn q4_blocks(&self, kb: usize) -> &[Q4Block] {
        // SAFETY: a Q4_K tensor's CPU storage is rows · kb blocks of exactly this layout
        // (alignment 2, as candle's block type), alive as long as `self.matmul`.
        unsafe { std::slice::from_raw_parts(self.blocks as *const Q4Block, self.rows * kb) }
    }

    fn q6_blocks(&self, kb: usize) -> &[Q6Block] {
        // SAFETY: as in `q4_blocks`, for Q6_K.
        unsafe { std::slice::from_raw_parts(self.blocks as *const Q6Block, self.rows * kb) }
    }
}

/// A stack of Q4_K and Q6_K matrices of one width `k` (a multiple of 256), `n` rows in all.
pub struct KMatrix {
    n: usize,
    k: usize,
    parts: Vec<Part>,
    /// The 512-bit kernels (AVX-512 BW and VNNI: this CPU runs them); the AVX2 ones
    /// otherwise.
    vnni: bool,
}

/// The 6-bit scale and minimum of sub-block `j` from a Q4_K block's 12 packed bytes (the
/// format's definition: the first four sub-blocks in the low 6 bits of bytes 0–3 and 4–7,
/// the last four split between bytes 8–11 and the top 2 bits of bytes 0–7).
fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

impl KMatrix {
    /// Whether [`KMatrix::new`] takes `t`: a 2-D Q4_K or Q6_K tensor on the CPU, of a
    /// width that is a multiple of 256, at [`Isa::Avx2`] or above (`isa` capped to what
    /// this CPU runs), on x86-64.
    pub fn takes(t: &QTensor, isa: Isa) -> bool {
        cfg!(target_arch = "x86_64")
            && isa.capped().avx2()
            && t.device().is_cpu()
            && matches!(t.dtype(), GgmlDType::Q4K | GgmlDType::Q6K)
            && t.shape().dims2().is_ok_and(|(_, k)| k > 0 && k % QK == 0)
    }

    /// The matrix over `t`'s own bytes; an error unless [`KMatrix::takes`] it.
    pub fn new(t: QTensor, isa: Isa) -> Result<Self> {
        if !KMatrix::takes(&t, isa) {
            candle_core::bail!("KMatrix: a {:?} tensor {:?} at {isa}", t.dtype(), t.shape());
        }
        let (n, k) = t.shape().dims2()?;
        let q4 = t.dtype() == GgmlDType::Q4K;
        let bytes = n * k / QK * if q4 { Q4K_BYTES } else { Q6K_BYTES };
        let blocks = match t.data()? {
            std::borrow::Cow::Borrowed(data) if data.len() >= bytes => data.as_ptr() as usize,
            _ => candle_core::bail!("KMatrix: a ({n}, {k}) tensor with too few bytes"),
        };
        let matmul = QMatMul::from_qtensor(t)?;
        let vnni = isa.capped().vnni();
        let mut part = Part {
            rows: n,
            q4,
            blocks,
            matmul,
            x8: None,
        };
        #[cfg(target_arch = "x86_64")]
        {
            let kb = k / QK;
            part.x8 = Some(match q4 {
                true => x8::Interleaved::q4(part.q4_blocks(kb), kb),
                false => x8::Interleaved::q6(part.q6_blocks(kb), kb),
            });
        }
        Ok(KMatrix {
            n,
            k,
            parts: vec![part],
            vnni,
        })
    }

    /// The rows of `parts` stacked into one matrix (all of one width); neighbouring parts
    /// of one type become one tensor (one candle matmul for many rows).
    pub fn stack(parts: Vec<KMatrix>) -> Result<KMatrix> {
        let Some(first) = parts.first() else {
            candle_core::bail!("KMatrix::stack: no matrices");
        };
        let (k, vnni) = (first.k, first.vnni);
        if let Some(p) = parts.iter().find(|p| p.k != k) {
            candle_core::bail!("KMatrix::stack: widths {k} and {} differ", p.k);
        }
        let n = parts.iter().map(|p| p.n).sum();
        let vnni = vnni && parts.iter().all(|p| p.vnni);
        let isa = if vnni { Isa::Avx512Vnni } else { Isa::Avx2 };
        let mut merged: Vec<Part> = Vec::new();
        for part in parts.into_iter().flat_map(|p| p.parts) {
            match merged.last_mut() {
                Some(last) if last.q4 == part.q4 => {
                    let (a, b) = (qtensor(&last.matmul)?, qtensor(&part.matmul)?);
                    let dtype = a.dtype();
                    let row_bytes = k / QK * if last.q4 { Q4K_BYTES } else { Q6K_BYTES };
                    let mut bytes = a.data()?[..last.rows * row_bytes].to_vec();
                    bytes.extend_from_slice(&b.data()?[..part.rows * row_bytes]);
                    let storage = candle_core::quantized::QStorage::from_data(
                        std::borrow::Cow::Owned(bytes),
                        &candle_core::Device::Cpu,
                        dtype,
                    )?;
                    let t = QTensor::new(storage, (last.rows + part.rows, k))?;
                    match KMatrix::new(t, isa)?.parts.pop() {
                        Some(one) => *last = one,
                        None => candle_core::bail!("KMatrix::stack: a merged part vanished"),
                    }
                }
                _ => merged.push(part),
            }
        }
        Ok(KMatrix {
            n,
            k,
            parts: merged,
            vnni,
        })
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    pub fn in_features(&self) -> usize {
        self.k
    }

    /// `x` `(..., k)` f32 times this matrix transposed: `(..., n)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let Some(&k) = dims.last() else {
            candle_core::bail!("KMatrix: a scalar input has no width");
        };
        if k != self.k {
            candle_core::bail!("KMatrix: input width {k}, matrix width {}", self.k);
        }
        let m = x.elem_count() / k;
        let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
        let mut out = vec![0f32; m * self.n];
        self.matmul(&xs, m, &mut out);
        let mut out_dims = dims;
        out_dims.pop();
        out_dims.push(self.n);
        Tensor::from_vec(out, out_dims, x.device())
    }

    /// `out (m, n) = x (m, k) · Wᵀ`.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        // The kernels write through raw pointers: these lengths keep them in bounds.
        assert!(
            x.len() == m * self.k && out.len() == m * self.n,
            "KMatrix::matmul: x of {}, out of {} for ({m}, {}) · ({}, {})ᵀ",
            x.len(),
            out.len(),
            self.k,
            self.n,
            self.k
        );
        if m == 0 || self.n == 0 {
            return;
        }
        let acts = Acts::new(x, m, self.k);
        let per_item = ROWS_PER_ITEM * if self.vnni { 2 } else { 1 };
        // Work items: groups of weight rows (never straddling two parts) × chunks of
        // activation rows.
        let groups: Vec<(usize, usize, usize)> = {
            let mut v = Vec::new();
            let mut row0 = 0;
            for (p, part) in self.parts.iter().enumerate() {
                for g in (0..part.rows).step_by(per_item) {
                    v.push((p, g, row0 + g));
                }
                row0 += part.rows;
            }
            v
        };
        let chunks = m.div_ceil(ACT_ROWS_PER_ITEM);
        let out_ptr = out.as_mut_ptr() as usize;
        let n = self.n;
        let run = |item: usize| {
            let (p, local, global) = groups[item / chunks];
            let c = item % chunks;
            let part = &self.parts[p];
            let rows = local..(local + per_item).min(part.rows);
            let acts_rows = c * ACT_ROWS_PER_ITEM..((c + 1) * ACT_ROWS_PER_ITEM).min(m);
            // SAFETY: this CPU runs AVX2 (and VNNI where `vnni`: `new` checked the
            // capped level); each item writes only out[i][global + rows] for its own
            // activation rows i, disjoint from every other item's.
            unsafe {
                part.run(
                    &acts,
                    self.k / QK,
                    rows,
                    acts_rows,
                    (out_ptr as *mut f32).add(global),
                    n,
                    self.vnni,
                )
            };
        };
        let items = groups.len() * chunks;
        if m == 1 {
            // A decode step: a contiguous run of rows per thread, cut at equal bytes.
            let kb = self.k / QK;
            let bytes = |item: usize| {
                let part = &self.parts[groups[item].0];
                let rows = (part.rows - groups[item].1).min(per_item);
                rows * kb * if part.q4 { Q4K_BYTES } else { Q6K_BYTES }
            };
            crate::shares::stream(items, bytes, run);
        } else {
            candle_core::utils::barrier_pool().execute_chunked(items, |range| range.for_each(run));
        }
    }

    /// Row `j` dequantized, by the format's definition: an embedding lookup.
    pub fn row(&self, mut j: usize) -> Vec<f32> {
        let kb = self.k / QK;
        for part in &self.parts {
            if j >= part.rows {
                j -= part.rows;
                continue;
            }
            let mut out = Vec::with_capacity(self.k);
            match part.q4 {
                true => part.q4_blocks(kb)[j * kb..(j + 1) * kb]
                    .iter()
                    .for_each(|b| {
                        let (d, dmin) = (f16(b.d), f16(b.dmin));
                        for e in 0..QK {
                            let (s, l) = (e / 32, e % 32);
                            let (scale, min) = q4k_scale_min(s, &b.packed);
                            let byte = b.qs[(s / 2) * 32 + l];
                            let q = if s % 2 == 0 { byte & 15 } else { byte >> 4 };
                            out.push(d * scale as f32 * q as f32 - dmin * min as f32);
                        }
                    }),
                false => part.q6_blocks(kb)[j * kb..(j + 1) * kb]
                    .iter()
                    .for_each(|b| {
                        let d = f16(b.d);
                        for e in 0..QK {
                            let (h, quarter, l) = (e / 128, (e % 128) / 32, e % 32);
                            let low = b.ql[64 * h + 32 * (quarter % 2) + l];
                            let low = if quarter < 2 { low & 15 } else { low >> 4 };
                            let high = (b.qh[32 * h + l] >> (2 * quarter)) & 3;
                            let q = (low | (high << 4)) as i32 - 32;
                            out.push(d * b.scales[e / 16] as f32 * q as f32);
                        }
                    }),
            }
            return out;
        }
        Vec::new()
    }
}

/// The tensor behind a quantized [`QMatMul`].
fn qtensor(m: &QMatMul) -> Result<&QTensor> {
    match m {
        QMatMul::QTensor(t) => Ok(t),
        _ => candle_core::bail!("KMatrix: a part without its quantized tensor"),
    }
}

fn f16(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

impl Part {
    /// Weight rows `rows` of this part against activation rows `acts_rows`, into
    /// `out[i * n + (r - rows.start)]` for i in `acts_rows`, r in `rows`.
    ///
    /// # Safety
    /// The CPU runs AVX2 (and AVX-512 VNNI where `vnni`); `out` is valid for those writes.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        acts: &Acts,
        kb: usize,
        rows: std::ops::Range<usize>,
        acts_rows: std::ops::Range<usize>,
        out: *mut f32,
        n: usize,
        vnni: bool,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            let (mut rows, mut out) = (rows, out);
            if let Some(x8) = &self.x8 {
                // Whole groups first: at VNNI two at a time in 512-bit registers, but for a
                // single activation row (decode), where two streams at once read slower.
                let wide = vnni && acts_rows.len() > 1;
                while rows.start % x8::GROUP == 0 {
                    let g = rows.start / x8::GROUP;
                    let whole = x8.groups().saturating_sub(g).min(rows.len() / x8::GROUP);
                    let take = match (whole, wide) {
                        (0, _) => break,
                        (1, _) | (_, false) => {
                            x8.run(acts, g, acts_rows.clone(), out, n);
                            1
                        }
                        _ => {
                            x8.run_pair(acts, g, acts_rows.clone(), out, n);
                            2
                        }
                    };
                    rows.start += take * x8::GROUP;
                    out = out.add(take * x8::GROUP);
                }
                if rows.is_empty() {
                    return;
                }
            }
            let tile = Tile {
                acts,
                kb,
                out,
                n,
                row0: rows.start,
            };
            match (self.q4, vnni) {
                (true, true) => tile.each(
                    self.q4_blocks(kb),
                    rows,
                    acts_rows,
                    x86::q4_512_2,
                    x86::q4_512_1,
                ),
                (true, false) => tile.each(
                    self.q4_blocks(kb),
                    rows,
                    acts_rows,
                    x86::q4_avx2,
                    x86::q4_avx2_1,
                ),
                (false, true) => tile.each(
                    self.q6_blocks(kb),
                    rows,
                    acts_rows,
                    x86::q6_512_2,
                    x86::q6_512_1,
                ),
                (false, false) => tile.each(
                    self.q6_blocks(kb),
                    rows,
                    acts_rows,
                    x86::q6_avx2,
                    x86::q6_avx2_1,
                ),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (acts, kb, rows, acts_rows, out, n, vnni);
    }
}

/// Activation rows quantized per 256-element block.
struct Acts {
    k: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    /// Sums of every 16 codes (Q6_K's sub-blocks), then of every 32 (Q4_K's).
    sums16: Vec<i16>,
    sums32: Vec<i16>,
    /// The codes again in the order of a Q4_K block's nibbles read 64 bytes at a time
    /// (the 512-bit kernel): per 128 elements, the 32-element runs 0, 2, 1, 3.
    q4: Vec<i8>,
}

impl Acts {
    fn new(x: &[f32], m: usize, k: usize) -> Self {
        let kb = k / QK;
        let mut acts = Acts {
            k,
            q: vec![0; m * k],
            d: vec![0.0; m * kb],
            sums16: vec![0; m * kb * 16],
            sums32: vec![0; m * kb * 8],
            q4: vec![0; m * k],
        };
        let blocks = m * kb;
        // Blocks in parallel for prefill-sized inputs.
        const PER_ITEM: usize = 64;
        let ptrs = (
            acts.q.as_mut_ptr() as usize,
            acts.d.as_mut_ptr() as usize,
            acts.sums16.as_mut_ptr() as usize,
            acts.sums32.as_mut_ptr() as usize,
            acts.q4.as_mut_ptr() as usize,
        );
        let body = |range: std::ops::Range<usize>| {
            // SAFETY: the block ranges of the items are disjoint, within m · kb blocks.
            let (q, d, s16, s32, q4) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        (ptrs.0 as *mut i8).add(range.start * QK),
                        range.len() * QK,
                    ),
                    std::slice::from_raw_parts_mut(
                        (ptrs.1 as *mut f32).add(range.start),
                        range.len(),
                    ),
                    std::slice::from_raw_parts_mut(
                        (ptrs.2 as *mut i16).add(range.start * 16),
                        range.len() * 16,
                    ),
                    std::slice::from_raw_parts_mut(
                        (ptrs.3 as *mut i16).add(range.start * 8),
                        range.len() * 8,
                    ),
                    std::slice::from_raw_parts_mut(
                        (ptrs.4 as *mut i8).add(range.start * QK),
                        range.len() * QK,
                    ),
                )
            };
            let src = &x[range.start * QK..range.end * QK];
            for (b, block) in src.chunks_exact(QK).enumerate() {
                let codes = &mut q[b * QK..(b + 1) * QK];
                let scale = crate::activation::quantize_block(block, codes);
                d[b] = scale;
                for (g, sum) in s16[b * 16..(b + 1) * 16].iter_mut().enumerate() {
                    *sum = codes[g * 16..(g + 1) * 16].iter().map(|&c| c as i16).sum();
                }
                for g in 0..8 {
                    s32[b * 8 + g] = s16[b * 16 + 2 * g] + s16[b * 16 + 2 * g + 1];
                }
                for (slot, run) in [0, 2, 1, 3, 4, 6, 5, 7].into_iter().enumerate() {
                    q4[b * QK + 32 * slot..b * QK + 32 * (slot + 1)]
                        .copy_from_slice(&codes[32 * run..32 * (run + 1)]);
                }
            }
        };
        if blocks <= PER_ITEM {
            body(0..blocks);
        } else {
            candle_core::utils::barrier_pool()
                .execute_chunked(blocks.div_ceil(PER_ITEM), |items| {
                    body(items.start * PER_ITEM..(items.end * PER_ITEM).min(blocks))
                });
        }
        acts
    }
}

/// One work item's view: where its results go.
#[cfg(target_arch = "x86_64")]
struct Tile<'a> {
    acts: &'a Acts,
    kb: usize,
    out: *mut f32,
    n: usize,
    row0: usize,
}

/// A kernel: MR activation rows from `i0` against NR weight rows (their blocks), sums into
/// `result[r][c]`.
#[cfg(target_arch = "x86_64")]
type Kernel<B, const MR: usize, const NR: usize> =
    unsafe fn(&Acts, usize, [&[B]; NR], &mut [[f32; NR]; MR]);

#[cfg(target_arch = "x86_64")]
impl Tile<'_> {
    /// Runs `full` over `rows` × `acts_rows` in MR × NR tiles, and `single` over the
    /// activation rows past the last whole tile (the last weight tile narrower by repeating
    /// a row whose results are dropped).
    unsafe fn each<B, const MR: usize, const NR: usize>(
        &self,
        blocks: &[B],
        rows: std::ops::Range<usize>,
        acts_rows: std::ops::Range<usize>,
        full: Kernel<B, MR, NR>,
        single: Kernel<B, 1, NR>,
    ) {
        let kb = self.kb;
        let mut j = rows.start;
        while j < rows.end {
            let nr = (rows.end - j).min(NR);
            let w: [&[B]; NR] = std::array::from_fn(|c| {
                let row = j + c.min(nr - 1);
                &blocks[row * kb..(row + 1) * kb]
            });
            let mut i = acts_rows.start;
            while i < acts_rows.end {
                let mr = if acts_rows.end - i >= MR { MR } else { 1 };
                let mut result = [[0f32; NR]; MR];
                if mr == MR {
                    full(self.acts, i, w, &mut result);
                } else {
                    let mut one = [[0f32; NR]; 1];
                    single(self.acts, i, w, &mut one);
                    result[0] = one[0];
                }
                for (r, row) in result.iter().enumerate().take(mr) {
                    for (c, v) in row.iter().enumerate().take(nr) {
                        *self.out.add((i + r) * self.n + (j - self.row0) + c) = *v;
                    }
                }
                i += mr;
            }
            j += nr;
        }
    }
}

// (The kernels index weight rows, blocks and accumulators alike: clearer as ranges.)
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Acts, Q4Block, Q6Block, QK};
    use std::arch::x86_64::*;

    /// How far ahead each weight row's stream is prefetched into L2. The hardware
    /// prefetcher alone leaves a decode matmul at half this CPU's bandwidth: a block's
    /// arithmetic and its wait for memory do not overlap.
    const AHEAD: usize = 4096;

    /// Asks for the lines `AHEAD` bytes ahead of block `b` (`size` bytes) in one of `nr`
    /// rows read side by side, each `kb` blocks: past the row's end, the same place in the
    /// row `nr` further on, which the next tile reads (rows are contiguous).
    #[inline(always)]
    unsafe fn prefetch(block: *const i8, b: usize, kb: usize, size: usize, nr: usize) {
        let row = kb * size;
        let mut ahead = AHEAD;
        if b * size + ahead >= row {
            ahead += (nr - 1) * row;
        }
        let p = block.wrapping_add(ahead);
        for line in 0..size.div_ceil(64) {
            _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(64 * line));
        }
    }

    /// f16 bits to f32 with F16C.
    #[inline(always)]
    unsafe fn f16(bits: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// acc + Σ pairs p · s (i16 → i32).
    #[inline(always)]
    unsafe fn dot16(acc: __m256i, p: __m256i, s: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(p, s))
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    #[inline(always)]
    unsafe fn hsum128(s: __m128) -> f32 {
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// A shuffle that copies i16 lane `lo` of each 128-bit half to the low half's 8
    /// lanes and lane `hi` to the high half's.
    #[inline(always)]
    unsafe fn pick16(lo: i16, hi: i16) -> __m256i {
        let l = ((2 * lo + 1) << 8) | (2 * lo);
        let h = ((2 * hi + 1) << 8) | (2 * hi);
        _mm256_set_m128i(_mm_set1_epi16(h), _mm_set1_epi16(l))
    }

    #[inline(always)]
    unsafe fn q4<const MR: usize, const NR: usize>(
        a: &Acts,
        i0: usize,
        w: [&[Q4Block]; NR],
        result: &mut [[f32; NR]; MR],
    ) {
        let kb = w[0].len();
        let k = a.k;
        let mask = _mm256_set1_epi8(0x0F);
        let mut picks = [_mm256_setzero_si256(); 8];
        for (s, pick) in picks.iter_mut().enumerate() {
            *pick = pick16(s as i16, s as i16);
        }
        let mut accf = [[_mm256_setzero_ps(); NR]; MR];
        let mut accm = [[_mm_setzero_ps(); NR]; MR];
        for b in 0..kb {
            let mut acc = [[_mm256_setzero_si256(); NR]; MR];
            for c in 0..NR {
                prefetch(&w[c][b] as *const Q4Block as *const i8, b, kb, 148, NR);
            }
            // Scales then minima, a byte each, for every weight row (in pairs). Plain loops:
            // a closure here would be compiled apart, without this function's AVX2.
            let mut unpacked = [_mm_setzero_si128(); NR];
            let mut scales = [_mm256_setzero_si256(); NR];
            for c in (0..NR).step_by(2) {
                let pair = q4k_unpack2(&w[c][b], &w[(c + 1).min(NR - 1)][b]);
                unpacked[c] = _mm256_castsi256_si128(pair);
                if c + 1 < NR {
                    unpacked[c + 1] = _mm256_extracti128_si256::<1>(pair);
                }
            }
            for c in 0..NR {
                let s = _mm_cvtepu8_epi16(unpacked[c]);
                scales[c] = _mm256_set_m128i(s, s);
            }
            for j in 0..4 {
                let mut lo = [_mm256_setzero_si256(); NR];
                let mut hi = [_mm256_setzero_si256(); NR];
                let mut s0 = [_mm256_setzero_si256(); NR];
                let mut s1 = [_mm256_setzero_si256(); NR];
                for c in 0..NR {
                    let q = _mm256_loadu_si256(w[c][b].qs.as_ptr().add(32 * j) as *const __m256i);
                    lo[c] = _mm256_and_si256(q, mask);
                    hi[c] = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                    s0[c] = _mm256_shuffle_epi8(scales[c], picks[2 * j]);
                    s1[c] = _mm256_shuffle_epi8(scales[c], picks[2 * j + 1]);
                }
                for r in 0..MR {
                    let aq = a.q.as_ptr().add((i0 + r) * k + b * QK + 64 * j);
                    let a0 = _mm256_loadu_si256(aq as *const __m256i);
                    let a1 = _mm256_loadu_si256(aq.add(32) as *const __m256i);
                    for c in 0..NR {
                        let p0 = _mm256_maddubs_epi16(lo[c], a0);
                        let p1 = _mm256_maddubs_epi16(hi[c], a1);
                        acc[r][c] = dot16(acc[r][c], p0, s0[c]);
                        acc[r][c] = dot16(acc[r][c], p1, s1[c]);
                    }
                }
            }
            for r in 0..MR {
                let blk = (i0 + r) * kb + b;
                let da = *a.d.get_unchecked(blk);
                let s32 = _mm_loadu_si128(a.sums32.as_ptr().add(blk * 8) as *const __m128i);
                for c in 0..NR {
                    let wb = &w[c][b];
                    accf[r][c] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(acc[r][c]),
                        _mm256_set1_ps(f16(wb.d) * da),
                        accf[r][c],
                    );
                    let mins = _mm_cvtepu8_epi16(_mm_srli_si128::<8>(unpacked[c]));
                    accm[r][c] = _mm_fmadd_ps(
                        _mm_cvtepi32_ps(_mm_madd_epi16(mins, s32)),
                        _mm_set1_ps(f16(wb.dmin) * da),
                        accm[r][c],
                    );
                }
            }
        }
        for r in 0..MR {
            for c in 0..NR {
                result[r][c] = hsum(accf[r][c]) - hsum128(accm[r][c]);
            }
        }
    }

    #[inline(always)]
    unsafe fn q6<const MR: usize, const NR: usize>(
        a: &Acts,
        i0: usize,
        w: [&[Q6Block]; NR],
        result: &mut [[f32; NR]; MR],
    ) {
        let kb = w[0].len();
        let k = a.k;
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x30);
        // Vector v of a 128-element half covers sub-blocks 2v (low 16 elements) and 2v + 1.
        let mut picks = [_mm256_setzero_si256(); 4];
        for (v, pick) in picks.iter_mut().enumerate() {
            *pick = pick16(2 * v as i16, 2 * v as i16 + 1);
        }
        let mut accf = [[_mm256_setzero_ps(); NR]; MR];
        for b in 0..kb {
            let mut acc = [[_mm256_setzero_si256(); NR]; MR];
            for c in 0..NR {
                prefetch(&w[c][b] as *const Q6Block as *const i8, b, kb, 210, NR);
            }
            let mut scales = [_mm256_setzero_si256(); NR];
            for c in 0..NR {
                scales[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(
                    w[c][b].scales.as_ptr() as *const __m128i
                ));
            }
            for h in 0..2 {
                let mut v = [[_mm256_setzero_si256(); 4]; NR];
                let mut s = [[_mm256_setzero_si256(); 4]; NR];
                for c in 0..NR {
                    let wb = &w[c][b];
                    let la = _mm256_loadu_si256(wb.ql.as_ptr().add(64 * h) as *const __m256i);
                    let lb = _mm256_loadu_si256(wb.ql.as_ptr().add(64 * h + 32) as *const __m256i);
                    let qh = _mm256_loadu_si256(wb.qh.as_ptr().add(32 * h) as *const __m256i);
                    v[c][0] = _mm256_or_si256(
                        _mm256_and_si256(la, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2),
                    );
                    v[c][1] = _mm256_or_si256(
                        _mm256_and_si256(lb, m4),
                        _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2),
                    );
                    v[c][2] = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(la, 4), m4),
                        _mm256_and_si256(qh, m2),
                    );
                    v[c][3] = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(lb, 4), m4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                    );
                    // Both 128-bit halves hold this half's 8 scales.
                    let half = if h == 0 {
                        _mm256_permute2x128_si256(scales[c], scales[c], 0x00)
                    } else {
                        _mm256_permute2x128_si256(scales[c], scales[c], 0x11)
                    };
                    for (q, pick) in picks.iter().enumerate() {
                        s[c][q] = _mm256_shuffle_epi8(half, *pick);
                    }
                }
                for r in 0..MR {
                    let aq = a.q.as_ptr().add((i0 + r) * k + b * QK + 128 * h);
                    for q in 0..4 {
                        let av = _mm256_loadu_si256(aq.add(32 * q) as *const __m256i);
                        for c in 0..NR {
                            let p = _mm256_maddubs_epi16(v[c][q], av);
                            acc[r][c] = dot16(acc[r][c], p, s[c][q]);
                        }
                    }
                }
            }
            for r in 0..MR {
                let blk = (i0 + r) * kb + b;
                let da = *a.d.get_unchecked(blk);
                let s16 = _mm256_loadu_si256(a.sums16.as_ptr().add(blk * 16) as *const __m256i);
                for c in 0..NR {
                    // The codes are stored + 32: take 32 · Σ scale · (sum of 16 codes) off.
                    let offset = _mm256_slli_epi32(_mm256_madd_epi16(scales[c], s16), 5);
                    let total = _mm256_sub_epi32(acc[r][c], offset);
                    accf[r][c] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(total),
                        _mm256_set1_ps(f16(w[c][b].d) * da),
                        accf[r][c],
                    );
                }
            }
        }
        for r in 0..MR {
            for c in 0..NR {
                result[r][c] = hsum(accf[r][c]);
            }
        }
    }

    /// Lane indexes for `vpermw`: for each of the 32 i16 lanes of a 512-bit `maddubs`
    /// result, the sub-block whose scale weighs it.
    /// Q4_K, 64 nibble bytes at a time: the low nibbles are sub-blocks (4g, 4g + 2), the
    /// high ones (4g + 1, 4g + 3), 16 lanes each.
    static Q4_SCALE_LANES: [[i16; 32]; 4] = {
        let mut t = [[0i16; 32]; 4];
        let mut v = 0;
        while v < 4 {
            let (g, high) = (v / 2, v % 2);
            let mut l = 0;
            while l < 32 {
                t[v][l] = (4 * g + high + 2 * (l / 16)) as i16;
                l += 1;
            }
            v += 1;
        }
        t
    };
    /// Q6_K, 64 elements at a time (elements 64v ..): sub-blocks of 16, 8 lanes each.
    static Q6_SCALE_LANES: [[i16; 32]; 4] = {
        let mut t = [[0i16; 32]; 4];
        let mut v = 0;
        while v < 4 {
            let mut l = 0;
            while l < 32 {
                t[v][l] = (4 * v + l / 8) as i16;
                l += 1;
            }
            v += 1;
        }
        t
    };
    /// Per-lane shifts that put a Q6_K high-bit pair at bits 4–5: elements 0–31 of a
    /// 64-element run take bits (0, 1) << 4 or (4, 5) >> 0, elements 32–63 bits (2, 3)
    /// << 2 or (6, 7) >> 2.
    static Q6_SHIFT_LEFT: [i16; 32] = halves(4, 2);
    static Q6_SHIFT_RIGHT: [i16; 32] = halves(0, 2);

    /// 16 lanes of `low` then 16 of `high`.
    const fn halves(low: i16, high: i16) -> [i16; 32] {
        let mut t = [low; 32];
        let mut l = 16;
        while l < 32 {
            t[l] = high;
            l += 1;
        }
        t
    }

    /// Where a Q4_K block's 12 packed scale bytes start.
    #[inline(always)]
    unsafe fn packed(blk: &Q4Block) -> *const __m128i {
        (blk as *const Q4Block as *const u8).add(4) as *const __m128i
    }

    /// The same 16 bytes in both 128-bit lanes.
    #[inline(always)]
    unsafe fn lane(t: [i8; 16]) -> __m256i {
        let x = _mm_loadu_si128(t.as_ptr() as *const __m128i);
        _mm256_set_m128i(x, x)
    }

    /// [`super::q4k_scale_min`] for all sub-blocks of two blocks at once, in the two
    /// 128-bit lanes: each lane the block's eight scales then its eight minima, a byte each.
    #[inline(always)]
    unsafe fn q4k_unpack2(a: &Q4Block, b: &Q4Block) -> __m256i {
        // 16 bytes from each: the 12 packed bytes and 4 of the codes after them. (No
        // closures in kernels: one is compiled apart, without the caller's features.)
        let s = _mm256_set_m128i(_mm_loadu_si128(packed(b)), _mm_loadu_si128(packed(a)));
        // Low bits: scales 0–3 are s[0..4] & 63, 4–7 s[8..12] & 15; minima 0–3 s[4..8] & 63,
        // 4–7 s[8..12] >> 4.
        let low = _mm256_shuffle_epi8(
            s,
            lane([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11]),
        );
        let low_mask = lane([63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0]);
        let high_nibble = lane([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15]);
        let low = _mm256_or_si256(
            _mm256_and_si256(low, low_mask),
            _mm256_and_si256(_mm256_srli_epi16::<4>(low), high_nibble),
        );
        // Top bits of scales and minima 4–7: the top 2 bits of s[0..4] and s[4..8], at bits
        // 4–5.
        let top = _mm256_shuffle_epi8(
            s,
            lane([-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7]),
        );
        let top = _mm256_and_si256(_mm256_srli_epi16::<2>(top), _mm256_set1_epi8(0x30));
        _mm256_or_si256(low, top)
    }

    #[inline(always)]
    unsafe fn load512<T>(p: *const T) -> __m512i {
        _mm512_loadu_si512(p as *const _)
    }

    /// MR activation rows against two Q4_K weight rows in 512-bit registers: half the
    /// instructions of [`q4`], for decode steps that must keep up with memory. Each
    /// weight block is unpacked once for all MR rows.
    #[inline(always)]
    unsafe fn q4_512<const MR: usize>(
        a: &Acts,
        i0: usize,
        w: [&[Q4Block]; 2],
        result: &mut [[f32; 2]; MR],
    ) {
        const NR: usize = 2;
        let kb = w[0].len();
        let mask = _mm512_set1_epi8(0x0F);
        let mut lanes = [_mm512_setzero_si512(); 4];
        for (v, lane) in lanes.iter_mut().enumerate() {
            *lane = load512(Q4_SCALE_LANES[v].as_ptr());
        }
        let mut accf = [[_mm512_setzero_ps(); NR]; MR];
        let mut accm = [[_mm_setzero_ps(); NR]; MR];
        for b in 0..kb {
            for c in 0..NR {
                prefetch(&w[c][b] as *const Q4Block as *const i8, b, kb, 144, NR);
            }
            let unpacked = q4k_unpack2(&w[0][b], &w[1][b]);
            for c in 0..NR {
                let wb = &w[c][b];
                let both = if c == 0 {
                    _mm256_castsi256_si128(unpacked)
                } else {
                    _mm256_extracti128_si256::<1>(unpacked)
                };
                let scales = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(both));
                let mins = _mm_cvtepu8_epi16(_mm_srli_si128::<8>(both));
                // Codes (low and high nibbles of each 64 bytes) and their scales' lanes.
                let mut codes = [_mm512_setzero_si512(); 4];
                let mut weights = [_mm512_setzero_si512(); 4];
                for g in 0..2 {
                    let q = load512(wb.qs.as_ptr().add(64 * g));
                    codes[2 * g] = _mm512_and_si512(q, mask);
                    codes[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16::<4>(q), mask);
                    weights[2 * g] = _mm512_permutexvar_epi16(lanes[2 * g], scales);
                    weights[2 * g + 1] = _mm512_permutexvar_epi16(lanes[2 * g + 1], scales);
                }
                let (d, dmin) = (f16(wb.d), f16(wb.dmin));
                for r in 0..MR {
                    let blk = (i0 + r) * kb + b;
                    let aq = a.q4.as_ptr().add(blk * QK);
                    let mut acc = [_mm512_setzero_si512(); 2];
                    for v in 0..4 {
                        let p = _mm512_maddubs_epi16(codes[v], load512(aq.add(64 * v)));
                        acc[v / 2] = _mm512_dpwssd_epi32(acc[v / 2], p, weights[v]);
                    }
                    let da = *a.d.get_unchecked(blk);
                    let sum = _mm512_add_epi32(acc[0], acc[1]);
                    accf[r][c] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(sum),
                        _mm512_set1_ps(d * da),
                        accf[r][c],
                    );
                    let s32 = _mm_loadu_si128(a.sums32.as_ptr().add(blk * 8) as *const __m128i);
                    accm[r][c] = _mm_fmadd_ps(
                        _mm_cvtepi32_ps(_mm_madd_epi16(mins, s32)),
                        _mm_set1_ps(dmin * da),
                        accm[r][c],
                    );
                }
            }
        }
        for r in 0..MR {
            for c in 0..NR {
                result[r][c] = _mm512_reduce_add_ps(accf[r][c]) - hsum128(accm[r][c]);
            }
        }
    }

    /// MR activation rows against two Q6_K weight rows in 512-bit registers.
    #[inline(always)]
    unsafe fn q6_512<const MR: usize>(
        a: &Acts,
        i0: usize,
        w: [&[Q6Block]; 2],
        result: &mut [[f32; 2]; MR],
    ) {
        const NR: usize = 2;
        let kb = w[0].len();
        let m4 = _mm512_set1_epi8(0x0F);
        let m2 = _mm512_set1_epi8(0x30);
        let mut lanes = [_mm512_setzero_si512(); 4];
        for (v, lane) in lanes.iter_mut().enumerate() {
            *lane = load512(Q6_SCALE_LANES[v].as_ptr());
        }
        let (left, right) = (
            load512(Q6_SHIFT_LEFT.as_ptr()),
            load512(Q6_SHIFT_RIGHT.as_ptr()),
        );
        let mut accf = [[_mm512_setzero_ps(); NR]; MR];
        let mut acco = [[_mm256_setzero_ps(); NR]; MR];
        for b in 0..kb {
            for c in 0..NR {
                prefetch(&w[c][b] as *const Q6Block as *const i8, b, kb, 210, NR);
            }
            for c in 0..NR {
                let wb = &w[c][b];
                let sc = _mm_loadu_si128(wb.scales.as_ptr() as *const __m128i);
                let scales256 = _mm256_cvtepi8_epi16(sc);
                let scales = _mm512_zextsi256_si512(scales256);
                // Codes of 64 elements each (+32) and their scales' lanes.
                let mut codes = [_mm512_setzero_si512(); 4];
                let mut weights = [_mm512_setzero_si512(); 4];
                for h in 0..2 {
                    let ql = load512(wb.ql.as_ptr().add(64 * h));
                    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        wb.qh.as_ptr().add(32 * h) as *const __m256i
                    ));
                    codes[2 * h] = _mm512_or_si512(
                        _mm512_and_si512(ql, m4),
                        _mm512_and_si512(_mm512_sllv_epi16(qh, left), m2),
                    );
                    codes[2 * h + 1] = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                        _mm512_and_si512(_mm512_srlv_epi16(qh, right), m2),
                    );
                    weights[2 * h] = _mm512_permutexvar_epi16(lanes[2 * h], scales);
                    weights[2 * h + 1] = _mm512_permutexvar_epi16(lanes[2 * h + 1], scales);
                }
                let d = f16(wb.d);
                for r in 0..MR {
                    let blk = (i0 + r) * kb + b;
                    let aq = a.q.as_ptr().add(blk * QK);
                    let mut acc = [_mm512_setzero_si512(); 2];
                    for v in 0..4 {
                        let p = _mm512_maddubs_epi16(codes[v], load512(aq.add(64 * v)));
                        acc[v / 2] = _mm512_dpwssd_epi32(acc[v / 2], p, weights[v]);
                    }
                    let dd = d * *a.d.get_unchecked(blk);
                    let sum = _mm512_add_epi32(acc[0], acc[1]);
                    accf[r][c] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dd), accf[r][c]);
                    // The codes are stored + 32: 32 · Σ scale · (sum of 16 codes) comes off.
                    let s16 = _mm256_loadu_si256(a.sums16.as_ptr().add(blk * 16) as *const __m256i);
                    let offset = _mm256_madd_epi16(scales256, s16);
                    acco[r][c] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(offset),
                        _mm256_set1_ps(32.0 * dd),
                        acco[r][c],
                    );
                }
            }
        }
        for r in 0..MR {
            for c in 0..NR {
                result[r][c] = _mm512_reduce_add_ps(accf[r][c]) - hsum(acco[r][c]);
            }
        }
    }

    macro_rules! entry512 {
        ($name:ident, $body:ident, $block:ty, $mr:expr) => {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
            pub(super) unsafe fn $name(
                a: &Acts,
                i0: usize,
                w: [&[$block]; 2],
                result: &mut [[f32; 2]; $mr],
            ) {
                $body::<$mr>(a, i0, w, result)
            }
        };
    }

    entry512!(q4_512_1, q4_512, Q4Block, 1);
    entry512!(q4_512_2, q4_512, Q4Block, 2);
    entry512!(q6_512_1, q6_512, Q6Block, 1);
    entry512!(q6_512_2, q6_512, Q6Block, 2);

    macro_rules! entry {
        ($name:ident, $body:ident, $block:ty, $mr:expr) => {
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) unsafe fn $name(
                a: &Acts,
                i0: usize,
                w: [&[$block]; 2],
                result: &mut [[f32; 2]; $mr],
            ) {
                $body::<$mr, 2>(a, i0, w, result)
            }
        };
    }

    entry!(q4_avx2, q4, Q4Block, 2);
    entry!(q4_avx2_1, q4, Q4Block, 1);
    entry!(q6_avx2, q6, Q6Block, 2);
    entry!(q6_avx2_1, q6, Q6Block, 1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// `q8`'s seeded test values in [-1, 1), with every 97th eight times larger (outliers
    /// stretch a block's activation scale, as real activations do).
    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut v = crate::q8::tests::data(n, seed);
        v.iter_mut().step_by(97).for_each(|x| *x *= 8.0);
        v
    }

    fn quantized(n: usize, k: usize, dtype: GgmlDType, seed: u64) -> QTensor {
        let w = Tensor::from_vec(data(n * k, seed), (n, k), &Device::Cpu).unwrap();
        QTensor::quantize(&w, dtype).unwrap()
    }

    /// The activation codes by the Q8_K-like definition the kernels use: per 256 elements
    /// d = max|x| / 127, codes round(x / d) half away from zero (0 where d = 0).
    fn activation_blocks(x: &[f32]) -> (Vec<i8>, Vec<f64>) {
        let mut codes = Vec::new();
        let mut scales = Vec::new();
        for block in x.chunks_exact(QK) {
            let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
            codes.extend(block.iter().map(|v| (v * inv).round() as i8));
            scales.push(d as f64);
        }
        (codes, scales)
    }

    /// At every level from AVX2 this CPU runs, `KMatrix::matmul` of Q4_K, Q6_K and a mixed
    /// stack (shapes not multiples of the tiles or the work items; m past the 4-row tiles
    /// and the 64-row activation chunks) equals an f64 reference from the definitions:
    /// the weights as candle dequantizes them (independent of this file), times the
    /// activation codes × scales, within 1e-5 of the sum of the terms' magnitudes (f32
    /// accumulation over a few dozen blocks). The repacked rows (`row`) equal candle's
    /// dequantization exactly.
    #[test]
    fn matmul_matches_f64_reference_at_every_level() {
        let levels: Vec<Isa> = Isa::supported().into_iter().filter(|l| l.avx2()).collect();
        let k = 512;
        let mats = [
            (vec![(GgmlDType::Q4K, 37)], "q4k"),
            (vec![(GgmlDType::Q6K, 21)], "q6k"),
            (
                vec![
                    (GgmlDType::Q4K, 16),
                    (GgmlDType::Q6K, 9),
                    (GgmlDType::Q4K, 3),
                ],
                "mixed",
            ),
        ];
        for isa in levels {
            for (parts, name) in &mats {
                let tensors: Vec<QTensor> = parts
                    .iter()
                    .enumerate()
                    .map(|(p, &(dt, n))| quantized(n, k, dt, 10 + p as u64))
                    .collect();
                let weights: Vec<f32> = tensors
                    .iter()
                    .flat_map(|t| {
                        t.dequantize(&Device::Cpu)
                            .unwrap()
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                    })
                    .collect();
                let matrix = KMatrix::stack(
                    tensors
                        .into_iter()
                        .map(|t| KMatrix::new(t, isa).unwrap())
                        .collect(),
                )
                .unwrap();
                let n = matrix.out_features();
                for j in 0..n {
                    assert_eq!(matrix.row(j), weights[j * k..(j + 1) * k], "{name} row {j}");
                }
                for m in [1, 2, 3, 4, 5, 9, 70] {
                    let x = data(m * k, 3 + m as u64);
                    let mut got = vec![f32::NAN; m * n];
                    matrix.matmul(&x, m, &mut got);
                    let (codes, scales) = activation_blocks(&x);
                    for i in 0..m {
                        for j in 0..n {
                            let (mut want, mut magnitude) = (0f64, 0f64);
                            for e in 0..k {
                                let term = weights[j * k + e] as f64
                                    * codes[i * k + e] as f64
                                    * scales[(i * k + e) / QK];
                                want += term;
                                magnitude += term.abs();
                            }
                            let g = got[i * n + j] as f64;
                            assert!(
                                (g - want).abs() <= 1e-5 * magnitude + 1e-9,
                                "{isa} {name} m {m} [{i},{j}]: {g} vs reference {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Through `Linear` and `Projections` as the models build them, at every level this CPU
    /// runs: Q4_K and Q6_K dispatch to [`KMatrix`] from AVX2 (candle below); q/k/v-like
    /// parts of mixed types stack into one matrix whose split output equals the separate
    /// matmuls', bit for bit for a decode row (our kernels, one activation quantization
    /// either way) and within 1e-5 for 8 rows (candle's tiles, neighbouring same-type parts
    /// merged into one tensor); rows read back for embedding lookups equal candle's
    /// dequantization.
    #[test]
    fn linear_and_projections_dispatch_and_stack() {
        use crate::q8::{Linear, Projections};
        let k = 512;
        let parts = [
            (GgmlDType::Q4K, 32),
            (GgmlDType::Q4K, 16),
            (GgmlDType::Q6K, 16),
            (GgmlDType::Q4K, 8),
        ];
        let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
        for isa in Isa::supported() {
            let make = || -> Vec<Linear> {
                parts
                    .iter()
                    .enumerate()
                    .map(|(i, &(dt, n))| {
                        Linear::new(quantized(n, k, dt, 40 + i as u64), false, isa).unwrap()
                    })
                    .collect()
            };
            let separate = make();
            for lin in &separate {
                assert_eq!(matches!(lin, Linear::K(_)), isa.avx2(), "{isa}: dispatch");
                assert_eq!(lin.row(3).is_some(), isa.avx2(), "{isa}: rows");
                assert_eq!(lin.has_rows(), isa.avx2(), "{isa}: has rows");
            }
            if isa.avx2() {
                let t = quantized(8, k, GgmlDType::Q6K, 41);
                let want = flat(&t.dequantize(&Device::Cpu).unwrap());
                let lin = Linear::new(t, false, isa).unwrap();
                assert_eq!(lin.row(5).unwrap(), want[5 * k..6 * k], "{isa}: row 5");
            }
            let stacked = Projections::new(make()).unwrap();
            if isa.avx2() {
                let Projections::Stacked {
                    matrix: Linear::K(m),
                    ..
                } = &stacked
                else {
                    panic!("{isa}: K-quant parts not stacked");
                };
                assert_eq!(m.parts.len(), 3, "{isa}: neighbouring Q4_K parts merged");
            }
            for rows in [1, 8] {
                let x = Tensor::from_vec(data(rows * k, 7), (1, rows, k), &Device::Cpu).unwrap();
                let outs = stacked.forward(&x).unwrap();
                assert_eq!(outs.len(), parts.len());
                for ((got, lin), &(_, n)) in outs.iter().zip(&separate).zip(&parts) {
                    assert_eq!(got.dims(), &[1, rows, n]);
                    let want = flat(&lin.forward(&x).unwrap());
                    let got = flat(got);
                    if rows == 1 {
                        assert_eq!(got, want, "{isa}: decode row");
                        continue;
                    }
                    let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() <= 1e-5 * scale, "{isa}: {g} vs {w}");
                    }
                }
            }
        }
    }

    /// Our kernels against candle's matmul on Qwen 2.5 1.5B's and Gemma 3 270M's shapes
    /// (run with `--ignored --nocapture`): GB/s of weights read at m = 1 and 2 (cycling
    /// through copies of ~400 MB, so the weights stream from memory as in a decode step),
    /// GFLOP/s at m = 512 (prefill).
    #[test]
    #[ignore]
    fn kquant_matmul_speed() {
        let top = Isa::detected();
        let shapes = [
            (8960, 1536),
            (1536, 8960),
            (151_936, 1536),
            (640, 1024),
            (640, 2048),
        ];
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
            for (n, k) in shapes {
                let bytes = n * k / QK * if dtype == GgmlDType::Q4K { 144 } else { 210 };
                let copies = (400_000_000 / bytes).max(1);
                let base = quantized(n, k, dtype, 1);
                let ws: Vec<KMatrix> = (0..copies)
                    .map(|_| {
                        let data = std::borrow::Cow::Owned(base.data().unwrap().into_owned());
                        let storage =
                            candle_core::quantized::QStorage::from_data(data, &Device::Cpu, dtype)
                                .unwrap();
                        KMatrix::new(QTensor::new(storage, (n, k)).unwrap(), top).unwrap()
                    })
                    .collect();
                for m in [1, 2, 16, 64, 512] {
                    if m > 2 && n > 20_000 {
                        continue;
                    }
                    let x = data(m * k, 2);
                    let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
                    let mut out = vec![0f32; m * n];
                    let reps = if m < 16 { (3 * copies).max(30) } else { 3 };
                    let time = |f: &mut dyn FnMut(usize)| {
                        (0..copies).for_each(&mut *f);
                        let t = std::time::Instant::now();
                        (0..reps).for_each(|r| f(r % copies));
                        t.elapsed().as_secs_f64() / reps as f64
                    };
                    let ours = time(&mut |c| ws[c].matmul(&x, m, &mut out));
                    let theirs = time(&mut |c| {
                        let _ = candle_core::Module::forward(&ws[c].parts[0].matmul, &xt).unwrap();
                    });
                    let rate = |s: f64| {
                        if m < 16 {
                            format!("{:.1} GB/s", bytes as f64 / s / 1e9)
                        } else {
                            format!("{:.0} GFLOP/s", 2.0 * (m * n * k) as f64 / s / 1e9)
                        }
                    };
                    println!(
                        "{dtype:?} ({n}, {k}) m {m}: ours {:.3} ms {}, candle {:.3} ms {}",
                        ours * 1e3,
                        rate(ours),
                        theirs * 1e3,
                        rate(theirs)
                    );
                }
            }
        }
    }
}
