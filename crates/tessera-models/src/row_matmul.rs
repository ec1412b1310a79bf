//! candle's quantized CPU matmul in one reduction order whatever the row count: the block
//! types our kernels do not take (and every type below [`tessera_kv::Isa::Avx2`]).
//!
//! Why not `QMatMul::forward`: candle 0.11 on x86-64 repacks Q4_K, Q6_K and Q8_0 weights into
//! tiles at run time ([`candle_core::quantized::repack`]) and picks between a one-row dot
//! product and the tiles by the row count (Q6_K: one row dotted, several tiled), so a row's
//! output would depend on how many rows share the call (a prompt read in one chunk or in
//! several, a batch's neighbours). [`k_quants::matmul`] quantizes each input row on its own
//! and forms every output from one `vec_dot` of that row with one weight row, whose kernel
//! is chosen by the column alone.

use candle_core::quantized::k_quants::{self, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Result, Tensor};

/// `x (…, k) · Wᵀ` for a quantized `w` (n, k) on the CPU, or `None` where `w` is of a type
/// this does not take (the caller runs candle's matmul a row at a time then).
pub(crate) fn forward(w: &QTensor, x: &Tensor) -> Result<Option<Tensor>> {
    use k_quants::*;
    match w.dtype() {
        GgmlDType::Q4_0 => run::<BlockQ4_0>(w, x),
        GgmlDType::Q4_1 => run::<BlockQ4_1>(w, x),
        GgmlDType::Q5_0 => run::<BlockQ5_0>(w, x),
        GgmlDType::Q5_1 => run::<BlockQ5_1>(w, x),
        GgmlDType::Q8_0 => run::<BlockQ8_0>(w, x),
        GgmlDType::Q2K => run::<BlockQ2K>(w, x),
        GgmlDType::Q3K => run::<BlockQ3K>(w, x),
        GgmlDType::Q4K => run::<BlockQ4K>(w, x),
        GgmlDType::Q5K => run::<BlockQ5K>(w, x),
        GgmlDType::Q6K => run::<BlockQ6K>(w, x),
        _ => Ok(None),
    }
}

fn run<T: GgmlType>(w: &QTensor, x: &Tensor) -> Result<Option<Tensor>> {
    let (n, k) = w.shape().dims2()?;
    let dims = x.dims().to_vec();
    if dims.last() != Some(&k) {
        candle_core::bail!("quantized matmul: input {:?} for a ({n}, {k}) matrix", dims);
    }
    let data = w.data()?;
    let blocks = data.len() / std::mem::size_of::<T>();
    if data.len() % std::mem::size_of::<T>() != 0
        || blocks * T::BLCK_SIZE != n * k
        || data.as_ptr().align_offset(std::mem::align_of::<T>()) != 0
    {
        return Ok(None);
    }
    // SAFETY: the bytes are the matrix's blocks of type `T` (its dtype), aligned and a whole
    // number of them, as checked above; `data` outlives the slice.
    let rhs = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const T, blocks) };
    let lhs: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let m = lhs.len() / k;
    let mut out = vec![0f32; m * n];
    k_quants::matmul((m, k, n), &lhs, rhs, &mut out)?;
    let mut out_dims = dims;
    out_dims.pop();
    out_dims.push(n);
    Ok(Some(
        Tensor::from_vec(out, out_dims, x.device())?.to_dtype(x.dtype())?,
    ))
}
