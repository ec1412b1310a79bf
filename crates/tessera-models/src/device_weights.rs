//! Device weights: the hook through which a GPU backend keeps quantized weight matrices in
//! its own layout and runs their matmuls (a matmul near the memory floor for decode steps, a
//! dequantize-and-GEMM for prefill chunks). tessera-models defines the interface and stays
//! CPU-only; tessera-kernels (feature `cuda`) implements it and is installed once per process
//! with [`install`]. A matrix the backend does not take stays with candle's quantized matmul.

use candle_core::quantized::QTensor;
use candle_core::{Result, Tensor};
use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// One weight matrix (`out_features × in_features`) in a backend's layout, on its device.
pub trait DeviceMatrix: Send + Sync {
    fn out_features(&self) -> usize;
    fn in_features(&self) -> usize;
    /// `x · Wᵀ` for f32 `x` of shape `(…, in_features)`: f32 `(…, out_features)`.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
    /// `rms_norm(s, weight, eps) · Wᵀ` ([`rms_norm`]) of the residual stream `s = x + add`
    /// (`x` where nothing is added), returned with `s`. A backend that prepares its inputs
    /// in a launch of its own folds the add and the norm into it, writing `s` as it reads
    /// it: one launch fewer per normed matmul and one per residual add, four a decode layer.
    fn forward_normed(
        &self,
        x: &Tensor,
        add: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        let s = residual_sum(x, add)?;
        let y = self.forward(&rms_norm(&s, weight, eps)?)?;
        Ok((s, y))
    }
    /// [`DeviceMatrix::forward_normed`] with the output's leading `rope.columns` columns
    /// RoPE'd over adjacent pairs ([`PairRope`]): a backend whose matmul writes its outputs
    /// from an epilogue rotates them there, a decoder's q|k then needs no launch of its own.
    fn forward_normed_roped(
        &self,
        x: &Tensor,
        add: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
        rope: &PairRope<'_>,
    ) -> Result<(Tensor, Tensor)> {
        let (s, y) = self.forward_normed(x, add, weight, eps)?;
        Ok((s, rope.apply(&y)?))
    }
    /// `(silu(gate) · up) · Wᵀ`, a gated MLP's down projection; as with the norm, a backend
    /// folds the activation and product into its input preparation.
    fn forward_silu_gated(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        self.forward(&(candle_nn::ops::silu(gate)? * up)?)
    }
    /// The concrete matrix, for [`WeightBackend::stack`].
    fn as_any(&self) -> &dyn Any;
}

/// RoPE over adjacent pairs (2i, 2i + 1) of a matmul's leading output columns, llama.cpp's
/// "normal" RoPE (candle's `rope_i`): columns `2i, 2i + 1` of output row r become
/// `(e·c − o·s, e·s + o·c)` at `c, s` = entry `i % half` of the tables' row r. The columns
/// are whole heads of `2·half`.
pub struct PairRope<'a> {
    /// `(rows, half)` f32, one row per input row of the matmul.
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub columns: usize,
}

impl PairRope<'_> {
    /// Pairs in a row of the tables.
    pub fn half(&self) -> Result<usize> {
        self.cos.dim(1)
    }

    /// Checks the tables against a matmul of `rows` input rows and `n` output columns.
    pub fn check(&self, rows: usize, n: usize) -> Result<()> {
        let half = self.half()?;
        if self.cos.dims() != [rows, half]
            || self.sin.dims() != [rows, half]
            || half == 0
            || self.columns > n
            || !self.columns.is_multiple_of(2 * half)
        {
            candle_core::bail!(
                "RoPE tables {:?} / {:?} over {} of {n} columns for {rows} rows",
                self.cos.dims(),
                self.sin.dims(),
                self.columns
            );
        }
        Ok(())
    }

    /// `y` (`(…, n)`, f32) with its leading columns rotated, by tensor ops: the definition,
    /// for backends that do not fold it.
    pub fn apply(&self, y: &Tensor) -> Result<Tensor> {
        let n = y.dim(candle_core::D::Minus1)?;
        let rows = y.elem_count() / n.max(1);
        self.check(rows, n)?;
        let half = self.half()?;
        let heads = self.columns / (2 * half);
        let y2 = y.reshape((rows, n))?;
        let pairs = y2
            .narrow(1, 0, self.columns)?
            .reshape((rows, heads, half, 2))?;
        let (e, o) = (pairs.narrow(3, 0, 1)?, pairs.narrow(3, 1, 1)?);
        let c = self.cos.reshape((rows, 1, half, 1))?;
        let s = self.sin.reshape((rows, 1, half, 1))?;
        let re = (e.broadcast_mul(&c)? - o.broadcast_mul(&s)?)?;
        let ro = (e.broadcast_mul(&s)? + o.broadcast_mul(&c)?)?;
        let roped = Tensor::cat(&[re, ro], 3)?.reshape((rows, self.columns))?;
        let out = if self.columns < n {
            Tensor::cat(&[roped, y2.narrow(1, self.columns, n - self.columns)?], 1)?
        } else {
            roped
        };
        out.reshape(y.dims())
    }
}

/// Makes device matrices.
pub trait WeightBackend: Send + Sync {
    /// `t` (on a device) in this backend's layout; `Ok(None)` where the backend does not
    /// serve `t`'s device or type, which then stays with candle's matmul.
    fn matrix(&self, t: &QTensor) -> Result<Option<Box<dyn DeviceMatrix>>>;
    /// `parts` as one matrix, their rows stacked in order (one launch for several
    /// projections of the same input); `Ok(None)` where they cannot be stacked.
    fn stack(&self, parts: &[&dyn DeviceMatrix]) -> Result<Option<Box<dyn DeviceMatrix>>>;
}

/// RMSNorm over the last dimension, `x / sqrt(mean(x²) + eps) · weight` (candle's op).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps)
}

/// `x + add`, or `x` where nothing is added.
pub fn residual_sum(x: &Tensor, add: Option<&Tensor>) -> Result<Tensor> {
    match add {
        Some(h) => x + h,
        None => Ok(x.clone()),
    }
}

static BACKEND: OnceLock<Box<dyn WeightBackend>> = OnceLock::new();

static DETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// Batch-invariant numerics on the device (`--deterministic`): every matmul gives a row the
/// bits it gets alone (candle's quantized matmuls one row a launch, the weight backend one
/// launch shape and input precision whatever the row count), and the KV backend reads each
/// query with one kernel and fixed splits anchored at its first position. The CPU paths are
/// batch-invariant always; this switch costs GPU speed, so it is a mode.
pub fn set_deterministic(on: bool) {
    DETERMINISTIC.store(on, Ordering::Relaxed);
}

/// Whether [`set_deterministic`] turned the mode on.
pub fn deterministic() -> bool {
    DETERMINISTIC.load(Ordering::Relaxed)
}

/// Installs the process's weight backend; a second call keeps the first.
pub fn install(backend: Box<dyn WeightBackend>) {
    let _ = BACKEND.set(backend);
}

/// `t` as a device matrix of the installed backend, where one is installed and takes it.
pub(crate) fn matrix(t: &QTensor) -> Result<Option<Box<dyn DeviceMatrix>>> {
    match BACKEND.get() {
        Some(backend) if !t.device().is_cpu() => backend.matrix(t),
        _ => Ok(None),
    }
}

/// `parts` stacked by the installed backend, where it can.
pub(crate) fn stack(parts: &[&dyn DeviceMatrix]) -> Result<Option<Box<dyn DeviceMatrix>>> {
    match BACKEND.get() {
        Some(backend) if !parts.is_empty() => backend.stack(parts),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8::{Linear, Projections};
    use candle_core::{Device, Tensor};

    /// A stand-in backend on the CPU: f32 matrices, stacked by concatenating rows.
    struct Dense(Tensor);
    impl DeviceMatrix for Dense {
        fn out_features(&self) -> usize {
            self.0.dim(0).unwrap_or(0)
        }
        fn in_features(&self) -> usize {
            self.0.dim(1).unwrap_or(0)
        }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            x.broadcast_matmul(&self.0.t()?)
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }
    struct Stacker;
    impl WeightBackend for Stacker {
        fn matrix(&self, _: &QTensor) -> Result<Option<Box<dyn DeviceMatrix>>> {
            Ok(None)
        }
        fn stack(&self, parts: &[&dyn DeviceMatrix]) -> Result<Option<Box<dyn DeviceMatrix>>> {
            let dense: Option<Vec<Tensor>> = parts
                .iter()
                .map(|p| p.as_any().downcast_ref::<Dense>().map(|d| d.0.clone()))
                .collect();
            match dense {
                Some(d) => Ok(Some(Box::new(Dense(Tensor::cat(&d, 0)?)))),
                None => Ok(None),
            }
        }
    }

    /// The fold's definition against candle's `rope_i` on the heads it rotates (an
    /// independent implementation), the columns past them untouched, bad tables refused.
    #[test]
    fn pair_rope_is_candles_rope_i_on_the_leading_heads() {
        let dev = Device::Cpu;
        let (rows, heads, half, rest) = (3usize, 4usize, 8usize, 16usize);
        let columns = heads * 2 * half;
        let y = Tensor::randn(0f32, 1.0, (rows, 1, columns + rest), &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (rows, half), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (rows, half), &dev).unwrap();
        let rope = PairRope {
            cos: &cos,
            sin: &sin,
            columns,
        };
        let got = rope.apply(&y).unwrap();
        assert_eq!(got.dims(), y.dims());
        let heads_major = |t: &Tensor| {
            t.narrow(2, 0, columns)
                .and_then(|t| t.reshape((rows, 1, heads, 2 * half)))
                .and_then(|t| t.transpose(1, 2))
                .and_then(|t| t.contiguous())
                .unwrap()
        };
        let want = candle_nn::rotary_emb::rope_i(
            &heads_major(&y),
            &cos.reshape((rows, 1, half)).unwrap(),
            &sin.reshape((rows, 1, half)).unwrap(),
        )
        .unwrap();
        let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
        let (g, w) = (flat(&heads_major(&got)), flat(&want));
        let worst = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-5,
            "rotated columns differ from rope_i by {worst}"
        );
        assert_eq!(
            flat(&got.narrow(2, columns, rest).unwrap()),
            flat(&y.narrow(2, columns, rest).unwrap()),
            "columns past the heads changed"
        );
        let short = PairRope {
            cos: &cos,
            sin: &sin,
            columns: columns + 2,
        };
        assert!(short.apply(&y).is_err(), "a partial head was accepted");
    }

    #[test]
    fn device_projections_stack_through_the_backend_and_split_back() {
        install(Box::new(Stacker));
        let dev = Device::Cpu;
        let parts: Vec<Tensor> = [5usize, 3, 3]
            .iter()
            .enumerate()
            .map(|(i, &n)| Tensor::randn(0f32, 1.0, (n, 8), &dev).map(|t| (t + i as f64).unwrap()))
            .collect::<Result<_>>()
            .unwrap();
        let linears = parts
            .iter()
            .map(|w| Linear::Device(Box::new(Dense(w.clone()))))
            .collect();
        let proj = Projections::new(linears).unwrap();
        let Projections::Stacked { widths, .. } = &proj else {
            panic!("device parts were not stacked");
        };
        assert_eq!(widths, &[5, 3, 3]);
        let x = Tensor::randn(0f32, 1.0, (2, 1, 8), &dev).unwrap();
        let outs = proj.forward(&x).unwrap();
        for (w, y) in parts.iter().zip(&outs) {
            // f64 reference of each part on its own.
            let w64: Vec<Vec<f64>> = w
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .to_vec2()
                .unwrap();
            let x64: Vec<f64> = x
                .flatten_all()
                .unwrap()
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            let got: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(got.len(), 2 * w64.len());
            for r in 0..2 {
                for (j, row) in w64.iter().enumerate() {
                    let want: f64 = row
                        .iter()
                        .zip(&x64[r * 8..r * 8 + 8])
                        .map(|(a, b)| a * b)
                        .sum();
                    let g = got[r * w64.len() + j] as f64;
                    assert!(
                        (g - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "row {r} out {j}: {g} vs {want}"
                    );
                }
            }
        }
    }
}
