//! tessera-models' weight backend on CUDA: Q4_0 matrices rearranged into a code plane and
//! a scale plane (weights.cu), multiplied by our matvec for one input row (a batch-1
//! decode step: f32 activations, no activation quantization, 1e-7 from an f64 reference
//! where candle's int8 path is 5e-3 away) and dequantized to bf16 for cuBLAS from
//! [`GEMM_FROM`] rows (prefill chunks, on the tensor cores). Between the two, candle's
//! kernels on its own copy of the matrix were faster, so that copy stays too: the weights
//! take twice their file's size on the device until our kernels cover those rows (NOTES.md).
//! Everything runs on candle's stream for the device. Other weight types stay with candle's
//! quantized matmuls.

use crate::cuda::compile_source;
use crate::{q4_0_planes, Q4_0_TILE, WEIGHTS_CU};
use anyhow::{anyhow, Context};
use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Storage, Tensor};
use std::any::Any;
use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use tessera_models::device_weights::{DeviceMatrix, WeightBackend};

/// Most input rows one matvec launch takes (weights.cu instantiates 1..=8).
pub const MATVEC_ROWS: usize = 8;
/// Input rows our matvec serves in the model; from 2 rows candle's int8 kernels (dp4a on
/// its own copy of the matrix) were faster on the H200 (weights-bench, NOTES.md).
pub const MATVEC_UP_TO: usize = 1;
/// Input rows from which the matrix is dequantized to bf16 for a GEMM (prefill chunks);
/// below, candle's kernels won (weights-bench: 64 rows 14.1 ms against 9.0, 512 rows 26.5
/// against 41.8 for one 8B forward).
pub const GEMM_FROM: usize = 256;
/// Warps per matvec block, and output rows per block for `m` inputs (weights.cu's `WARPS`
/// and `ROWS_PER_BLOCK`).
const WARPS: usize = 4;
fn rows_per_block(m: usize) -> usize {
    if m <= 2 {
        4
    } else {
        2
    }
}

const Q4_0_BLOCK: usize = 32;

fn candle_error(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

struct Kernels {
    device: CudaDevice,
    /// `matvec[m - 1]` takes `m` input rows.
    matvec: Vec<CudaFunction>,
    to_bf16: CudaFunction,
}

/// Installs the CUDA weight backend into tessera-models (once per process).
pub fn install() {
    tessera_models::device_weights::install(Box::new(CudaWeights::default()));
}

#[derive(Default)]
pub struct CudaWeights {
    /// Built on first use, for the first CUDA device seen.
    kernels: Mutex<Option<Arc<Kernels>>>,
}

impl CudaWeights {
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
        let module =
            compile_source(device.cuda_stream().context(), WEIGHTS_CU).context("weights.cu")?;
        let matvec = (1..=MATVEC_ROWS)
            .map(|m| module.load_function(&format!("q4_0_matvec_{m}")))
            .collect::<Result<Vec<_>, _>>()?;
        let k = Arc::new(Kernels {
            device: device.clone(),
            matvec,
            to_bf16: module.load_function("q4_0_to_bf16")?,
        });
        *slot = Some(k.clone());
        Ok(k)
    }

    /// A Q4_0 matrix of `n × k` from the file's blocks, in our planes on the device;
    /// `candle` serves the row counts between [`MATVEC_UP_TO`] and [`GEMM_FROM`] (without
    /// it, matvec launches do).
    pub fn q4_0(
        &self,
        device: &CudaDevice,
        blocks: &[u8],
        n: usize,
        k: usize,
        candle: Option<QMatMul>,
    ) -> anyhow::Result<Q4Matrix> {
        let (codes, scales) = q4_0_planes(blocks, n, k)?;
        let kernels = self.kernels(device)?;
        let stream = device.cuda_stream();
        Ok(Q4Matrix {
            codes: stream.clone_htod(&codes)?,
            scales: stream.clone_htod(&scales)?,
            n,
            k,
            kernels,
            candle,
        })
    }
}

impl WeightBackend for CudaWeights {
    fn matrix(&self, t: &QTensor) -> candle_core::Result<Option<Box<dyn DeviceMatrix>>> {
        let Device::Cuda(device) = t.device() else {
            return Ok(None);
        };
        let (n, k) = t.shape().dims2()?;
        if t.dtype() != GgmlDType::Q4_0 || k % Q4_0_TILE != 0 {
            return Ok(None);
        }
        let blocks = t.data()?;
        // candle's copy, for the rows its kernels serve (the caller drops `t`).
        let exact = blocks.get(..n * k / Q4_0_BLOCK * 18).ok_or_else(|| {
            candle_core::Error::Msg(format!("Q4_0 matrix {n}×{k}: {} bytes", blocks.len()))
        })?;
        let storage = QStorage::from_data(Cow::Borrowed(exact), &t.device(), GgmlDType::Q4_0)?;
        let candle = QMatMul::from_qtensor(QTensor::new(storage, (n, k))?)?;
        let m = self
            .q4_0(&device, exact, n, k, Some(candle))
            .map_err(candle_error)?;
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
            stream.memcpy_dtod(&m.codes, &mut c).map_err(candle_error)?;
            let mut s = scales.slice_mut(row * row_scales..(row + m.n) * row_scales);
            stream
                .memcpy_dtod(&m.scales, &mut s)
                .map_err(candle_error)?;
            row += m.n;
        }
        Ok(Some(Box::new(Q4Matrix {
            codes,
            scales,
            n,
            k: first.k,
            kernels: first.kernels.clone(),
            candle: stack_candle(&q4)?,
        })))
    }
}

/// The parts' candle matrices as one, their rows stacked (GGUF rows are whole blocks, so
/// stacking concatenates bytes), where every part has one.
fn stack_candle(parts: &[&Q4Matrix]) -> candle_core::Result<Option<QMatMul>> {
    let mut bytes = Vec::new();
    let mut rows = 0;
    for p in parts {
        let Some(QMatMul::QTensor(t)) = &p.candle else {
            return Ok(None);
        };
        // (A device copy carries padding past its last row.)
        let row_bytes = p.k / Q4_0_BLOCK * 18;
        bytes.extend_from_slice(&t.data()?[..p.n * row_bytes]);
        rows += p.n;
    }
    let device = Device::Cuda(parts[0].kernels.device.clone());
    let storage = QStorage::from_data(Cow::Owned(bytes), &device, GgmlDType::Q4_0)?;
    QMatMul::from_qtensor(QTensor::new(storage, (rows, parts[0].k))?).map(Some)
}

/// A Q4_0 matrix in our planes (weights.cu's layout), with candle's copy for the row
/// counts its kernels serve faster.
pub struct Q4Matrix {
    codes: CudaSlice<u8>,
    scales: CudaSlice<u16>,
    n: usize,
    k: usize,
    kernels: Arc<Kernels>,
    candle: Option<QMatMul>,
}

impl Q4Matrix {
    /// `y = x · Wᵀ` for `m` rows of f32 `x` (starting at `offset`), by matvec launches of at
    /// most [`MATVEC_ROWS`] rows each.
    fn matvec(
        &self,
        x: &CudaSlice<f32>,
        offset: usize,
        m: usize,
    ) -> anyhow::Result<CudaSlice<f32>> {
        let stream = self.kernels.device.cuda_stream();
        // SAFETY: the launches below write every element before anything reads it.
        let mut y = unsafe { stream.alloc::<f32>(m * self.n)? };
        let (n, k) = (self.n as i32, self.k as i32);
        for first in (0..m).step_by(MATVEC_ROWS) {
            let rows = (m - first).min(MATVEC_ROWS);
            let cfg = LaunchConfig {
                grid_dim: (self.n.div_ceil(rows_per_block(rows)) as u32, 1, 1),
                block_dim: ((32 * WARPS) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let at = offset + first * self.k;
            let xs = x.slice(at..at + rows * self.k);
            let mut ys = y.slice_mut(first * self.n..(first + rows) * self.n);
            let mut l = stream.launch_builder(&self.kernels.matvec[rows - 1]);
            l.arg(&self.codes)
                .arg(&self.scales)
                .arg(&xs)
                .arg(&mut ys)
                .arg(&n)
                .arg(&k);
            // SAFETY: the planes hold n rows of k/2 code bytes and k/32 scales, xs `rows`
            // rows of k floats, ys `rows` rows of n; the kernel reads and writes no more.
            unsafe { l.launch(cfg)? };
        }
        Ok(y)
    }

    /// `x · Wᵀ` by matvec launches, whatever the row count.
    pub fn forward_matvec(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (m, out_dims) = self.shapes(x)?;
        if m == 0 {
            return Tensor::zeros(out_dims, DType::F32, x.device());
        }
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            candle_core::bail!("a CUDA matrix given a {:?} input", x.device().location());
        };
        let y = self
            .matvec(s.as_cuda_slice::<f32>()?, layout.start_offset(), m)
            .map_err(candle_error)?;
        Ok(wrap(&self.kernels.device, y, &out_dims))
    }

    /// `x · Wᵀ` by a bf16 GEMM over the dequantized matrix, whatever the row count.
    pub fn forward_gemm(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (m, out_dims) = self.shapes(x)?;
        let w = self.to_bf16().map_err(candle_error)?;
        let y = x
            .reshape((m, self.k))?
            .to_dtype(DType::BF16)?
            .matmul(&w.t()?)?
            .to_dtype(DType::F32)?;
        y.reshape(out_dims)
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

    /// The matrix as bf16 `(n, k)`, for a GEMM.
    pub fn to_bf16(&self) -> anyhow::Result<Tensor> {
        let stream = self.kernels.device.cuda_stream();
        let lanes = self.n * self.k / Q4_0_BLOCK;
        // SAFETY: the kernel writes every element before anything reads it.
        let mut w = unsafe { stream.alloc::<half::bf16>(self.n * self.k)? };
        let cfg = LaunchConfig::for_num_elems(lanes.min(1 << 22) as u32);
        let count = lanes as i64;
        let mut l = stream.launch_builder(&self.kernels.to_bf16);
        l.arg(&self.codes).arg(&self.scales).arg(&mut w).arg(&count);
        // SAFETY: `lanes` lanes of 16 code bytes (and their tiles' scales) in, 32 bf16 each out.
        unsafe { l.launch(cfg)? };
        Ok(wrap(&self.kernels.device, w, &[self.n, self.k]))
    }
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
        let m = x.elem_count() / self.k.max(1);
        match &self.candle {
            _ if m >= GEMM_FROM => self.forward_gemm(x),
            Some(candle) if m > MATVEC_UP_TO => candle_core::Module::forward(candle, x),
            _ => self.forward_matvec(x),
        }
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
