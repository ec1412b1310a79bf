//! tessera-models' weight backend on CUDA: Q4_0 matrices rearranged into a code plane and
//! a scale plane (weights.cu), multiplied on the tensor cores below [`GEMM_FROM`] input rows
//! (f16 mma over the exact codes; up to [`SPLIT_UP_TO`] rows, a decode step, each input row
//! split into an f16 high part and residual so the product keeps ~22 bits of x) and
//! dequantized to bf16 for cuBLAS from [`GEMM_FROM`] rows (prefill chunks: the inputs made
//! bf16 in one launch with the norm or activation before them, f32 out of the GEMM itself).
//! Everything runs on candle's stream for the device. Other weight types, and Q4_0 matrices
//! whose shape the layout does not take, stay with candle's quantized matmuls.

use crate::dependent::DependentLaunch;
use crate::{q4_0_planes, Q4_0_OCTET, Q4_0_ROWS, WEIGHTS_CU};
use anyhow::{anyhow, bail, Context};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::cublas::{result as cublas, sys as cublas_sys};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Storage, Tensor};
use std::any::Any;
use std::sync::{Arc, Mutex};
use tessera_models::device_weights::{residual_sum, DeviceMatrix, PairRope, WeightBackend};

/// Most input rows whose launches split each row into an f16 high part and residual (f32-like
/// products, 1–2e-7); more rows enter as f16 (≤ 2e-4), 32 a launch. At 9–16 rows the split
/// cost 1.7× the time of f16 inputs (twice the n8 tiles) on the H200 (weights-bench variants).
pub const SPLIT_UP_TO: usize = 8;
/// Input rows from which the matrix is dequantized to bf16 for a GEMM (prefill chunks).
pub const GEMM_FROM: usize = 256;
/// Threads of a GEMM input launch (weights.cu's GEMM_INPUT_THREADS): one block a row.
const GEMM_INPUT_THREADS: u32 = 256;
/// The widest row a normed input launch takes: 1024 threads of NORM_ITEMS (weights.cu) word
/// sets of 8 columns.
const NORMED_MAX_K: usize = 1024 * 4 * 8;

/// Input rows a launch takes: 4 n8 tiles of split (two-column) or plain rows.
fn rows_per_launch(split: bool) -> usize {
    if split {
        16
    } else {
        32
    }
}

/// The launch shapes the model takes, by the matrix's rows and the launch's n8 tiles
/// ([`MmaShapes::MODEL`]; weights-bench's variants try others).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaShapes {
    /// Matrices of ≤ 4096 rows (an 8B's o and down, 256 tiles) at one n8 tile.
    pub small: MmaShape,
    /// The same at 2 or 4 n8 tiles (5+ input rows).
    pub small_wide: MmaShape,
    /// Larger matrices (q|k|v, gate|up, the output).
    pub large: MmaShape,
}

impl MmaShapes {
    /// At one n8 tile 2 tiles × 8 warps ran fastest for the small matrices, 1 × 4 elsewhere
    /// (weights-bench on the H200, 1–16 input rows). At 2+ n8 tiles 1 × 8 at two blocks an SM
    /// (weights.cu's WIDE_8_BLOCKS) beat it by 1.1–2.4 µs a launch (H100, 8–32 rows). Two
    /// tiles a warp for the large ones lost at every row count, 1 to 32 (H100). NOTES.md.
    pub const MODEL: MmaShapes = MmaShapes {
        small: MmaShape { tiles: 2, warps: 8 },
        small_wide: MmaShape { tiles: 1, warps: 8 },
        large: MmaShape { tiles: 1, warps: 4 },
    };

    /// The shape of a launch of `nt` n8 tiles over an `n`-row matrix.
    pub fn for_launch(&self, n: usize, nt: usize) -> MmaShape {
        match (n <= 4096, nt > 1) {
            (true, false) => self.small,
            (true, true) => self.small_wide,
            (false, _) => self.large,
        }
    }
}

/// n8 tiles for `rows` input rows: the kernels exist for 1, 2 and 4.
fn n_tiles(rows: usize, split: bool) -> usize {
    let columns = if split { 2 * rows } else { rows };
    columns.div_ceil(8).next_power_of_two()
}

/// How a tensor-core launch is shaped: 16-row tiles a block (1 or 2) and warps a block (4 or
/// 8, splitting the rows' octets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MmaShape {
    pub tiles: usize,
    pub warps: usize,
}

impl MmaShape {
    /// Every shape the kernels exist for.
    pub fn all() -> Vec<MmaShape> {
        [1, 2]
            .into_iter()
            .flat_map(|tiles| [4, 8].map(|warps| MmaShape { tiles, warps }))
            .collect()
    }

    fn kernel_name(&self, nt: usize) -> String {
        format!("q4_0_mma_{nt}_{}_{}", self.tiles, self.warps)
    }

    /// Where the kernel for this shape and `nt` n8 tiles sits in [`Kernels::mma`]
    /// (shapes in [`MmaShape::all`]'s order, then n8 tiles 1, 2, 4); `None` where no kernel
    /// exists.
    fn kernel_index(&self, nt: usize) -> Option<usize> {
        let shape = match (self.tiles, self.warps) {
            (1, 4) => 0,
            (1, 8) => 1,
            (2, 4) => 2,
            (2, 8) => 3,
            _ => return None,
        };
        let tiles = match nt {
            1 => 0,
            2 => 1,
            4 => 2,
            _ => return None,
        };
        Some(shape * N_TILES.len() + tiles)
    }
}

/// The n8 tile counts the kernels exist for.
const N_TILES: [usize; 3] = [1, 2, 4];

impl std::fmt::Display for MmaShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} tile(s) × {} warps", self.tiles, self.warps)
    }
}

const Q4_0_BLOCK: usize = 32;

fn candle_error(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

struct Kernels {
    device: CudaDevice,
    /// The tensor-core kernels (weights.cu's `q4_0_mma_{NT}_{tiles}_{warps}`), at
    /// [`MmaShape::kernel_index`].
    mma: Vec<CudaFunction>,
    inputs: CudaFunction,
    /// `inputs` of RMS-normalized rows.
    normed_inputs: CudaFunction,
    /// `inputs` of RMS-normalized sums of two rows (a residual add, then the norm).
    add_normed_inputs: CudaFunction,
    /// `inputs` of silu(gate) · up.
    gated_inputs: CudaFunction,
    to_bf16: CudaFunction,
    /// RoPE over adjacent pairs of a GEMM's output (the mma launches fold it).
    rope_pairs: CudaFunction,
    /// A GEMM's bf16 input rows from each [`Source`]: plain, normed, add-normed, gated.
    gemm_inputs: [CudaFunction; 4],
    /// [`CudaWeights`]'s `split_up_to`.
    split_up_to: usize,
    /// [`CudaWeights`]'s `shapes`.
    shapes: MmaShapes,
    /// The B fragments' scratch, shared by every matrix: launches on one stream run in
    /// order, so a matmul's fragments are read before the next one writes them.
    fragments: Mutex<Option<CudaSlice<u32>>>,
}

impl Kernels {
    /// Fragment words a matmul of `k` inputs writes at most (a full launch of rows).
    fn fragment_words(k: usize) -> usize {
        [true, false]
            .map(|split| n_tiles(rows_per_launch(split), split))
            .into_iter()
            .max()
            .unwrap_or(1)
            * k
            * 4
    }

    /// Grows the fragment scratch, as a matrix of `k` inputs is made, to what any of its
    /// matmuls needs: a matmul then never allocates, inside a captured step graph least of
    /// all.
    fn reserve_fragments(&self, k: usize) -> anyhow::Result<()> {
        let words = Self::fragment_words(k);
        let mut scratch = self.fragments.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|f| f.len() < words) {
            // SAFETY: the input launches write every fragment word a matmul reads.
            *scratch = Some(unsafe { self.device.cuda_stream().alloc::<u32>(words)? });
        }
        Ok(())
    }
}

/// Installs the CUDA weight backend into tessera-models (once per process).
pub fn install() {
    tessera_models::device_weights::install(Box::new(CudaWeights::default()));
}

pub struct CudaWeights {
    /// Built on first use, for the first CUDA device seen.
    kernels: Mutex<Option<Arc<Kernels>>>,
    /// Lines compiled ahead of weights.cu (`#define` of its build choices); empty for the
    /// model's kernels.
    defines: String,
    /// Most input rows split into high parts and residuals ([`SPLIT_UP_TO`] for the model).
    split_up_to: usize,
    /// The launch shapes ([`MmaShapes::MODEL`] for the model).
    shapes: MmaShapes,
}

impl Default for CudaWeights {
    fn default() -> Self {
        CudaWeights::with_choices("", SPLIT_UP_TO)
    }
}

impl CudaWeights {
    /// A backend whose kernels are compiled with `defines` (lines such as
    /// `#define MIN_WARPS 0`) ahead of weights.cu, splitting inputs up to `split_up_to`
    /// rows: weights-bench times the build choices weights.cu lists this way.
    pub fn with_choices(defines: &str, split_up_to: usize) -> Self {
        CudaWeights {
            kernels: Mutex::new(None),
            defines: defines.to_string(),
            split_up_to,
            shapes: MmaShapes::MODEL,
        }
    }

    /// The same backend launching as `shapes` says (weights-bench's variants).
    pub fn with_shapes(mut self, shapes: MmaShapes) -> Self {
        self.shapes = shapes;
        self
    }

    /// `m` for this backend's kernels, sharing its planes on the device.
    pub fn rebind(&self, device: &CudaDevice, m: &Q4Matrix) -> anyhow::Result<Q4Matrix> {
        Ok(Q4Matrix {
            codes: m.codes.clone(),
            scales: m.scales.clone(),
            n: m.n,
            k: m.k,
            kernels: self.kernels(device)?,
        })
    }

    fn kernels(&self, device: &CudaDevice) -> anyhow::Result<Arc<Kernels>> {
        let mut slot = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = slot.as_ref() {
            if k.device.same_device(device) {
                return Ok(k.clone());
            }
            return Err(anyhow!(
                "the CUDA weight backend serves one device per process"
            ));
        }
        let source = format!("{}\n{WEIGHTS_CU}", self.defines);
        let module =
            crate::compile::load(device.cuda_stream().context(), &source).context("weights.cu")?;
        let mma = MmaShape::all()
            .iter()
            .flat_map(|shape| N_TILES.map(|nt| shape.kernel_name(nt)))
            .map(|name| Ok(module.load_function(&name)?))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let k = Arc::new(Kernels {
            device: device.clone(),
            mma,
            inputs: module.load_function("q4_0_inputs")?,
            normed_inputs: module.load_function("q4_0_normed_inputs")?,
            add_normed_inputs: module.load_function("q4_0_add_normed_inputs")?,
            gated_inputs: module.load_function("q4_0_silu_gated_inputs")?,
            to_bf16: module.load_function("q4_0_to_bf16")?,
            rope_pairs: module.load_function("rope_pairs")?,
            gemm_inputs: [
                module.load_function("gemm_inputs_plain")?,
                module.load_function("gemm_inputs_normed")?,
                module.load_function("gemm_inputs_add_normed")?,
                module.load_function("gemm_inputs_silu_gated")?,
            ],
            split_up_to: self.split_up_to,
            shapes: self.shapes,
            fragments: Mutex::new(None),
        });
        *slot = Some(k.clone());
        Ok(k)
    }

    /// A Q4_0 matrix of `n × k` from the file's blocks, in our planes on the device.
    pub fn q4_0(
        &self,
        device: &CudaDevice,
        blocks: &[u8],
        n: usize,
        k: usize,
    ) -> anyhow::Result<Q4Matrix> {
        let (codes, scales) = q4_0_planes(blocks, n, k)?;
        let kernels = self.kernels(device)?;
        kernels.reserve_fragments(k)?;
        let stream = device.cuda_stream();
        Ok(Q4Matrix {
            codes: Arc::new(stream.clone_htod(&codes)?),
            scales: Arc::new(stream.clone_htod(&scales)?),
            n,
            k,
            kernels,
        })
    }
}

impl WeightBackend for CudaWeights {
    fn matrix(&self, t: &QTensor) -> candle_core::Result<Option<Box<dyn DeviceMatrix>>> {
        let Device::Cuda(device) = t.device() else {
            return Ok(None);
        };
        let (n, k) = t.shape().dims2()?;
        if t.dtype() != GgmlDType::Q4_0
            || !k.is_multiple_of(Q4_0_OCTET)
            || !n.is_multiple_of(Q4_0_ROWS)
        {
            return Ok(None);
        }
        let blocks = t.data()?;
        let exact = blocks.get(..n * k / Q4_0_BLOCK * 18).ok_or_else(|| {
            candle_core::Error::Msg(format!("Q4_0 matrix {n}×{k}: {} bytes", blocks.len()))
        })?;
        let m = self.q4_0(&device, exact, n, k).map_err(candle_error)?;
        Ok(Some(Box::new(m)))
    }

    fn stack(
        &self,
        parts: &[&dyn DeviceMatrix],
    ) -> candle_core::Result<Option<Box<dyn DeviceMatrix>>> {
        let Some(q4) = parts
            .iter()
            .map(|p| p.as_any().downcast_ref::<Q4Matrix>())
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        let first = q4[0];
        if q4.iter().any(|m| m.k != first.k) {
            return Ok(None);
        }
        let stream = first.kernels.device.cuda_stream();
        let n: usize = q4.iter().map(|m| m.n).sum();
        let (row_codes, row_scales) = (first.k / 2, first.k / Q4_0_BLOCK);
        let mut codes = stream
            .alloc_zeros::<u8>(n * row_codes)
            .map_err(candle_error)?;
        let mut scales = stream
            .alloc_zeros::<u16>(n * row_scales)
            .map_err(candle_error)?;
        let mut row = 0;
        for m in &q4 {
            let mut c = codes.slice_mut(row * row_codes..(row + m.n) * row_codes);
            stream
                .memcpy_dtod(m.codes.as_ref(), &mut c)
                .map_err(candle_error)?;
            let mut s = scales.slice_mut(row * row_scales..(row + m.n) * row_scales);
            stream
                .memcpy_dtod(m.scales.as_ref(), &mut s)
                .map_err(candle_error)?;
            row += m.n;
        }
        Ok(Some(Box::new(Q4Matrix {
            codes: Arc::new(codes),
            scales: Arc::new(scales),
            n,
            k: first.k,
            kernels: first.kernels.clone(),
        })))
    }
}

/// A Q4_0 matrix in our planes (weights.cu's layout).
pub struct Q4Matrix {
    /// Shared with the same matrix bound to other kernels ([`CudaWeights::rebind`]).
    codes: Arc<CudaSlice<u8>>,
    scales: Arc<CudaSlice<u16>>,
    n: usize,
    k: usize,
    kernels: Arc<Kernels>,
}

/// Rows of f32 in a device buffer: `m` rows of the matrix's width, `ld` floats apart, from
/// `offset`.
struct Rows<'a> {
    data: &'a CudaSlice<f32>,
    offset: usize,
    ld: usize,
}

impl Rows<'_> {
    /// Rows `first..first + rows` of width `k`.
    fn view(&self, first: usize, rows: usize, k: usize) -> CudaView<'_, f32> {
        let at = self.offset + first * self.ld;
        self.data.slice(at..at + (rows - 1) * self.ld + k)
    }
}

/// A [`PairRope`]'s tables on the device: `half` floats a row, one row an input row.
struct RopeRows<'a> {
    cos: Rows<'a>,
    sin: Rows<'a>,
    columns: usize,
    half: usize,
}

/// What a matmul's input launch makes its fragments of (weights.cu's `SOURCE`s).
enum Source<'a> {
    /// The rows as they are.
    Plain,
    /// The rows RMS-normalized by these weights (k of them) and epsilon; with `add`, the
    /// rows plus these (contiguous, as the rows are), their sum written to the buffer.
    Normed {
        weight: CudaView<'a, f32>,
        eps: f32,
        add: Option<(Rows<'a>, &'a mut CudaSlice<f32>)>,
    },
    /// silu(rows) · these rows (the up half of a gated MLP).
    SiluGated(Rows<'a>),
}

/// How a matmul runs: tensor-core launches from the codes, each shaped as the backend's
/// [`MmaShapes`] say for its n8 tiles or all as one given shape; or one bf16 GEMM over the
/// dequantized matrix.
#[derive(Clone, Copy, Debug)]
enum Path {
    Mma(Option<MmaShape>),
    Gemm,
}

/// `f` of `t`'s rows, `ld` floats apart: `t` must hold f32 on a CUDA device.
fn with_rows<R>(
    t: &Tensor,
    ld: usize,
    f: impl FnOnce(Rows<'_>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        candle_core::bail!("a CUDA matrix given a {:?} input", t.device().location());
    };
    f(Rows {
        data: s.as_cuda_slice::<f32>()?,
        offset: layout.start_offset(),
        ld,
    })
}

impl Q4Matrix {
    /// `y = x · Wᵀ` for the `m` rows of `x`, made from `source`, by tensor-core launches
    /// (rows split into high parts and residuals up to the backend's `split_up_to` rows).
    fn mma(
        &self,
        x: Rows<'_>,
        m: usize,
        fixed: Option<MmaShape>,
        mut source: Source<'_>,
        rope: Option<&RopeRows<'_>>,
    ) -> anyhow::Result<CudaSlice<f32>> {
        let stream = self.kernels.device.cuda_stream();
        // SAFETY: the launches below write every element before anything reads it.
        let mut y = unsafe { stream.alloc::<f32>(m * self.n)? };
        let (n, k, ld) = (self.n as i32, self.k as i32, x.ld as i32);
        // Deterministic mode: every row split and every launch one shape (the matrix's at
        // two n8 tiles), so a row's sums do not depend on the rows beside it.
        let deterministic = tessera_models::device_weights::deterministic();
        let split = deterministic || m <= self.kernels.split_up_to;
        let per_launch = rows_per_launch(split);
        let words = n_tiles(m.min(per_launch), split) * self.k * 4;
        let mut scratch = self
            .kernels
            .fragments
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if scratch.as_ref().is_none_or(|f| f.len() < words) {
            // SAFETY: the input launches write every fragment word a matmul reads.
            *scratch = Some(unsafe { stream.alloc::<u32>(words)? });
        }
        let frag = scratch
            .as_mut()
            .ok_or_else(|| anyhow!("no fragment scratch"))?;
        let split_i = i32::from(split);
        for first in (0..m).step_by(per_launch) {
            let rows = (m - first).min(per_launch);
            let nt = n_tiles(rows, split);
            let xs = x.view(first, rows, self.k);
            let (rows_i, nt_i) = (rows as i32, nt as i32);
            // NT · k/32 blocks · 32 lanes, in blocks of 1024 threads.
            let inputs_cfg = LaunchConfig::for_num_elems((nt * self.k) as u32);
            // Every launch here is a dependent one (dependent.rs): weights.cu's kernels wait
            // for the launch before them before touching its outputs.
            // SAFETY (all three): xs holds `rows` rows of k floats `ld` apart; frag NT · k/32
            // · 32 uint4 (allocated for the most n8 tiles a launch takes); the kernels touch
            // no more.
            let mut l = DependentLaunch::new(&stream);
            match &mut source {
                Source::Plain => {
                    l.input(&xs).output(&mut *frag).int(rows_i).int(k);
                    l.int(nt_i).int(split_i);
                    unsafe { l.launch(&self.kernels.inputs, inputs_cfg)? };
                }
                Source::Normed { weight, eps, add } => {
                    // Also: `weight` holds k floats (checked by the caller), `add` and `sum`
                    // the rows as `xs` does, contiguous; the kernel's norms hold at most 32
                    // rows (`per_launch`), its blocks at most 32 warps, each thread at most
                    // NORM_ITEMS (4) word sets of a row.
                    if self.k > NORMED_MAX_K {
                        bail!(
                            "a normed input of {} columns (at most {NORMED_MAX_K})",
                            self.k
                        );
                    }
                    let (hs, mut ss);
                    let kernel = match add {
                        Some((h, sum)) => {
                            hs = h.view(first, rows, self.k);
                            ss = sum.slice_mut(first * self.k..(first + rows) * self.k);
                            l.input(&xs).input(&hs).output(&mut ss);
                            &self.kernels.add_normed_inputs
                        }
                        None => {
                            l.input(&xs);
                            &self.kernels.normed_inputs
                        }
                    };
                    l.input(&*weight).output(&mut *frag).int(rows_i).int(k);
                    l.int(nt_i).int(split_i).float(*eps);
                    // One block a fragment column, its threads over the k blocks' 4 lanes.
                    let normed_cfg = LaunchConfig {
                        grid_dim: ((8 * nt) as u32, 1, 1),
                        block_dim: ((self.k / 8).min(1024) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    unsafe { l.launch(kernel, normed_cfg)? };
                }
                Source::SiluGated(up) => {
                    // Also: `up` holds the same rows, as far apart.
                    let us = up.view(first, rows, self.k);
                    l.input(&xs)
                        .input(&us)
                        .output(&mut *frag)
                        .int(rows_i)
                        .int(k);
                    l.int(ld).int(nt_i).int(split_i);
                    unsafe { l.launch(&self.kernels.gated_inputs, inputs_cfg)? };
                }
            }
            let shape = fixed.unwrap_or_else(|| {
                let nt = if deterministic { 2 } else { nt };
                self.kernels.shapes.for_launch(self.n, nt)
            });
            let cfg = LaunchConfig {
                grid_dim: ((self.n / Q4_0_ROWS).div_ceil(shape.tiles) as u32, 1, 1),
                block_dim: ((32 * shape.warps) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let kernel = shape
                .kernel_index(nt)
                .and_then(|i| self.kernels.mma.get(i))
                .ok_or_else(|| anyhow!("no tensor-core kernel {}", shape.kernel_name(nt)))?;
            let mut ys = y.slice_mut(first * self.n..(first + rows) * self.n);
            // The launch's rows of the RoPE tables; without RoPE, no columns (the pointers,
            // the code plane's, are never read).
            let tables = rope.map(|r| {
                (
                    r.cos.view(first, rows, r.half),
                    r.sin.view(first, rows, r.half),
                )
            });
            let (rope_cols, half) = rope.map_or((0, 1), |r| (r.columns as i32, r.half as i32));
            let mut l = DependentLaunch::new(&stream);
            l.input(self.codes.as_ref())
                .input(self.scales.as_ref())
                .input(&*frag);
            l.output(&mut ys).int(rows_i).int(n).int(k).int(split_i);
            match &tables {
                Some((cos, sin)) => l.input(cos).input(sin),
                None => l.input(self.codes.as_ref()).input(self.codes.as_ref()),
            };
            l.int(rope_cols).int(half);
            // SAFETY: the planes hold n/16 tiles of k/2 · 16 code bytes and k/32 · 16 scales,
            // frag the fragments written above, ys `rows` rows of n, the tables `rows` rows of
            // `half` (checked by the caller) where rope_cols > 0; the kernel reads and writes
            // no more.
            unsafe { l.launch(kernel, cfg)? };
        }
        Ok(y)
    }

    /// `y = x · Wᵀ` for the `m` rows of `x`, made from `source`, by one bf16 GEMM (cuBLAS,
    /// f32 accumulation and output): one launch writes the inputs as bf16 rows, one
    /// dequantizes W, then the GEMM.
    fn gemm(
        &self,
        x: Rows<'_>,
        m: usize,
        source: Source<'_>,
        rope: Option<&RopeRows<'_>>,
    ) -> anyhow::Result<CudaSlice<f32>> {
        let stream = self.kernels.device.cuda_stream();
        let (k, ld) = (self.k as i32, x.ld as i32);
        let xs = x.view(0, m, self.k);
        // SAFETY: the input launch writes every element before the GEMM reads it.
        let mut xb = unsafe { stream.alloc::<half::bf16>(m * self.k)? };
        let cfg = LaunchConfig {
            grid_dim: (m as u32, 1, 1),
            block_dim: (GEMM_INPUT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = &self.kernels.gemm_inputs;
        // SAFETY (all four): xs holds m rows of k floats `ld` apart (contiguous for the
        // normed sources), `weight` k floats (checked by the caller), `add` and `sum` m
        // contiguous rows, `up` the rows as `xs` does; xb m · k bf16. No more is touched.
        match source {
            Source::Plain => {
                let mut l = stream.launch_builder(&f[0]);
                l.arg(&xs).arg(&mut xb).arg(&k).arg(&ld);
                unsafe { l.launch(cfg)? };
            }
            Source::Normed {
                weight,
                eps,
                add: None,
            } => {
                let mut l = stream.launch_builder(&f[1]);
                l.arg(&xs).arg(&weight).arg(&mut xb).arg(&k).arg(&eps);
                unsafe { l.launch(cfg)? };
            }
            Source::Normed {
                weight,
                eps,
                add: Some((h, sum)),
            } => {
                let hs = h.view(0, m, self.k);
                let mut l = stream.launch_builder(&f[2]);
                l.arg(&xs).arg(&hs).arg(sum).arg(&weight);
                l.arg(&mut xb).arg(&k).arg(&eps);
                unsafe { l.launch(cfg)? };
            }
            Source::SiluGated(up) => {
                let us = up.view(0, m, self.k);
                let mut l = stream.launch_builder(&f[3]);
                l.arg(&xs).arg(&us).arg(&mut xb).arg(&k).arg(&ld);
                unsafe { l.launch(cfg)? };
            }
        }
        let w = self.bf16_planes()?;
        // SAFETY: the GEMM writes every element.
        let mut y = unsafe { stream.alloc::<f32>(m * self.n)? };
        let (alpha, beta) = (1f32, 0f32);
        let (n, m_i) = (self.n as i32, m as i32);
        {
            let (wp, _w) = w.device_ptr(&stream);
            let (xp, _x) = xb.device_ptr(&stream);
            let (yp, _y) = y.device_ptr_mut(&stream);
            let blas = self.kernels.device.cublas_handle();
            // Column-major, as cuBLAS reads: W (k × n, lda k) transposed times the inputs
            // (k × m) gives Y (n × m, ldc n), which is row-major (m, n).
            // SAFETY: the pointers hold n · k and m · k bf16 and m · n f32, on the stream
            // cuBLAS runs on (candle's handle, bound to it); alpha and beta outlive the call.
            unsafe {
                cublas::gemm_ex(
                    *blas.handle(),
                    cublas_sys::cublasOperation_t::CUBLAS_OP_T,
                    cublas_sys::cublasOperation_t::CUBLAS_OP_N,
                    n,
                    m_i,
                    k,
                    (&alpha) as *const f32 as *const _,
                    wp as *const _,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    k,
                    xp as *const _,
                    cublas_sys::cudaDataType::CUDA_R_16BF,
                    k,
                    (&beta) as *const f32 as *const _,
                    yp as *mut _,
                    cublas_sys::cudaDataType::CUDA_R_32F,
                    n,
                    cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )?;
            }
        }
        if let Some(r) = rope {
            // The mma epilogue's RoPE as a launch of its own, one thread a pair.
            let (cos, sin) = (r.cos.view(0, m, r.half), r.sin.view(0, m, r.half));
            let (cols, half) = (r.columns as i32, r.half as i32);
            let cfg = LaunchConfig::for_num_elems((m * r.columns / 2) as u32);
            let mut l = stream.launch_builder(&self.kernels.rope_pairs);
            l.arg(&mut y).arg(&cos).arg(&sin).arg(&m_i).arg(&n);
            l.arg(&cols).arg(&half);
            // SAFETY: y holds m rows of n ≥ cols floats, the tables m rows of `half` (checked
            // by the caller); one thread a pair of the first cols columns.
            unsafe { l.launch(cfg)? };
        }
        Ok(y)
    }

    /// `y = x · Wᵀ` by `path`.
    fn run(
        &self,
        x: Rows<'_>,
        m: usize,
        path: Path,
        source: Source<'_>,
        rope: Option<&RopeRows<'_>>,
    ) -> anyhow::Result<CudaSlice<f32>> {
        match path {
            Path::Mma(fixed) => self.mma(x, m, fixed, source, rope),
            Path::Gemm => self.gemm(x, m, source, rope),
        }
    }

    /// The path the model takes for `m` input rows.
    fn path(&self, m: usize) -> Path {
        // cuBLAS picks its kernel (and sum order) by the row count: not in deterministic mode.
        if m >= GEMM_FROM && !tessera_models::device_weights::deterministic() {
            Path::Gemm
        } else {
            Path::Mma(None)
        }
    }

    /// The input rows and the output's dims for `x` by `path`.
    fn path_shapes(&self, x: &Tensor, path: Path) -> candle_core::Result<(usize, Vec<usize>)> {
        if let Path::Mma(Some(shape)) = path {
            if shape.kernel_index(1).is_none() {
                candle_core::bail!("no tensor-core kernel is shaped {shape:?}");
            }
        }
        self.shapes(x)
    }

    /// `x · Wᵀ` on the tensor cores, whatever the row count, launched as `shape` says (the
    /// model takes [`MmaShapes::for_launch`]).
    pub fn forward_mma(&self, x: &Tensor, shape: MmaShape) -> candle_core::Result<Tensor> {
        self.forward_by(x, Path::Mma(Some(shape)))
    }

    /// `x · Wᵀ` by a bf16 GEMM over the dequantized matrix, whatever the row count.
    pub fn forward_gemm(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_by(x, Path::Gemm)
    }

    fn forward_by(&self, x: &Tensor, path: Path) -> candle_core::Result<Tensor> {
        let (m, out_dims) = self.path_shapes(x, path)?;
        if m == 0 {
            return Tensor::zeros(out_dims, DType::F32, x.device());
        }
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let y = with_rows(&x, self.k, |rows| {
            self.run(rows, m, path, Source::Plain, None)
                .map_err(candle_error)
        })?;
        Ok(wrap(&self.kernels.device, y, &out_dims))
    }

    /// `rms_norm(s, weight, eps) · Wᵀ` of `s = x + add` (`x` where nothing is added) by the
    /// model's path for its rows, returned with `s`: the add and the norm folded into the
    /// launch that prepares the inputs, which writes `s` as it reads it; with `rope`, the
    /// output's leading columns RoPE'd as they are written.
    fn normed_by(
        &self,
        x: &Tensor,
        add: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
        rope: Option<&PairRope<'_>>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let path = self.path(x.elem_count() / self.k.max(1));
        let (m, out_dims) = self.path_shapes(x, path)?;
        if let Some(r) = rope {
            r.check(m, self.n)?;
        }
        if weight.dims() != [self.k] {
            candle_core::bail!("norm weights {:?} for a width of {}", weight.dims(), self.k);
        }
        if let Some(h) = add.filter(|h| h.dims() != x.dims()) {
            candle_core::bail!("a residual add of {:?} to {:?}", h.dims(), x.dims());
        }
        if m == 0 {
            let y = Tensor::zeros(out_dims, DType::F32, x.device())?;
            return Ok((residual_sum(x, add)?, y));
        }
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let weight = weight.to_dtype(DType::F32)?.contiguous()?;
        // The tables as the launches take them (contiguous f32).
        let tables = rope
            .map(|r| -> candle_core::Result<_> {
                let f = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
                Ok((f(r.cos)?, f(r.sin)?, r.columns, r.half()?))
            })
            .transpose()?;
        let Some(add) = add else {
            let y = self.run_normed(&x, &weight, eps, m, path, None, tables.as_ref())?;
            return Ok((x, wrap(&self.kernels.device, y, &out_dims)));
        };
        let add = add.to_dtype(DType::F32)?.contiguous()?;
        let stream = self.kernels.device.cuda_stream();
        // SAFETY: the input launches write every row of the sum before anything reads it.
        let mut sum = unsafe { stream.alloc::<f32>(m * self.k) }.map_err(candle_error)?;
        let y = with_rows(&add, self.k, |h| {
            self.run_normed(
                &x,
                &weight,
                eps,
                m,
                path,
                Some((h, &mut sum)),
                tables.as_ref(),
            )
        })?;
        let device = &self.kernels.device;
        Ok((wrap(device, sum, x.dims()), wrap(device, y, &out_dims)))
    }

    /// [`Q4Matrix::normed_by`]'s launches, of contiguous f32 `x`, `weight` and RoPE tables
    /// (cos, sin, columns, half).
    #[allow(clippy::too_many_arguments)]
    fn run_normed(
        &self,
        x: &Tensor,
        weight: &Tensor,
        eps: f32,
        m: usize,
        path: Path,
        add: Option<(Rows<'_>, &mut CudaSlice<f32>)>,
        tables: Option<&(Tensor, Tensor, usize, usize)>,
    ) -> candle_core::Result<CudaSlice<f32>> {
        let normed = |rope: Option<&RopeRows<'_>>| {
            with_rows(weight, self.k, |w| {
                with_rows(x, self.k, |rows| {
                    let weight = w.view(0, 1, self.k);
                    self.run(rows, m, path, Source::Normed { weight, eps, add }, rope)
                        .map_err(candle_error)
                })
            })
        };
        match tables {
            None => normed(None),
            Some((cos, sin, columns, half)) => with_rows(cos, *half, |cos| {
                with_rows(sin, *half, |sin| {
                    normed(Some(&RopeRows {
                        cos,
                        sin,
                        columns: *columns,
                        half: *half,
                    }))
                })
            }),
        }
    }

    /// `(silu(gate) · up) · Wᵀ` by `path`, the activation and product folded into the launch
    /// that prepares the inputs. `gate` and `up` may be views into one output (a stacked
    /// gate|up matmul's halves), rows equally apart in both.
    fn silu_gated_by(&self, gate: &Tensor, up: &Tensor, path: Path) -> candle_core::Result<Tensor> {
        let (m, out_dims) = self.path_shapes(gate, path)?;
        if gate.dims() != up.dims() {
            candle_core::bail!("gate {:?} and up {:?} differ", gate.dims(), up.dims());
        }
        if m == 0 {
            return Tensor::zeros(out_dims, DType::F32, gate.device());
        }
        let (gate, up) = (gate.to_dtype(DType::F32)?, up.to_dtype(DType::F32)?);
        let ld = match (
            row_stride(gate.layout(), self.k),
            row_stride(up.layout(), self.k),
        ) {
            (Some(g), Some(u)) if g == u => g,
            // Rows the launch cannot address with one stride: the activation on its own.
            _ => return self.forward_by(&(gate.silu()? * up)?, path),
        };
        let y = with_rows(&up, ld, |up| {
            with_rows(&gate, ld, |rows| {
                self.run(rows, m, path, Source::SiluGated(up), None)
                    .map_err(candle_error)
            })
        })?;
        Ok(wrap(&self.kernels.device, y, &out_dims))
    }

    /// Input rows and the output's dims for `x`.
    fn shapes(&self, x: &Tensor) -> candle_core::Result<(usize, Vec<usize>)> {
        let mut dims = x.dims().to_vec();
        match dims.last_mut() {
            Some(last) if *last == self.k => *last = self.n,
            _ => candle_core::bail!("matmul of {:?} by a {}×{} matrix", x.dims(), self.n, self.k),
        }
        Ok((x.elem_count() / self.k, dims))
    }

    /// The matrix as bf16 `(n, k)`, row-major, for a GEMM.
    fn bf16_planes(&self) -> anyhow::Result<CudaSlice<half::bf16>> {
        let stream = self.kernels.device.cuda_stream();
        // A 16-byte load of the code plane holds 32 weights.
        let loads = self.n * self.k / 32;
        // SAFETY: the kernel writes every element before anything reads it.
        let mut w = unsafe { stream.alloc::<half::bf16>(self.n * self.k)? };
        let cfg = LaunchConfig::for_num_elems(loads.min(1 << 22) as u32);
        let (k, count) = (self.k as i32, loads as i64);
        let mut l = stream.launch_builder(&self.kernels.to_bf16);
        l.arg(self.codes.as_ref())
            .arg(self.scales.as_ref())
            .arg(&mut w)
            .arg(&k)
            .arg(&count);
        // SAFETY: `loads` loads of 16 code bytes (and their scales) in, 32 bf16 each out.
        unsafe { l.launch(cfg)? };
        Ok(w)
    }
}

/// The distance between rows of `layout` when it holds rows of width `k`, each contiguous
/// and all equally apart (a contiguous tensor, or a view of some columns of one).
fn row_stride(layout: &candle_core::Layout, k: usize) -> Option<usize> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let r = dims.len();
    if r == 0 || dims[r - 1] != k || (k > 1 && strides[r - 1] != 1) {
        return None;
    }
    if r == 1 {
        return Some(k);
    }
    let ld = strides[r - 2];
    // Each leading dimension steps over whole runs of the one after it.
    let uniform = (0..r - 2).all(|i| dims[i] == 1 || strides[i] == strides[i + 1] * dims[i + 1]);
    (uniform && ld >= k && ld.is_multiple_of(4) && layout.start_offset().is_multiple_of(4))
        .then_some(ld)
}

fn wrap<T: candle_core::cuda_backend::CudaDType>(
    device: &CudaDevice,
    out: CudaSlice<T>,
    shape: &[usize],
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(out, device.clone());
    Tensor::from_storage(
        Storage::Cuda(storage),
        shape.to_vec(),
        BackpropOp::none(),
        false,
    )
}

impl DeviceMatrix for Q4Matrix {
    fn out_features(&self) -> usize {
        self.n
    }

    fn in_features(&self) -> usize {
        self.k
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_by(x, self.path(x.elem_count() / self.k.max(1)))
    }

    fn forward_silu_gated(&self, gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
        self.silu_gated_by(gate, up, self.path(gate.elem_count() / self.k.max(1)))
    }

    fn forward_normed(
        &self,
        x: &Tensor,
        add: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        self.normed_by(x, add, weight, eps, None)
    }

    fn forward_normed_roped(
        &self,
        x: &Tensor,
        add: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
        rope: &PairRope<'_>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        self.normed_by(x, add, weight, eps, Some(rope))
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
