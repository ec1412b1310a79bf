//! gelu with the tanh approximation (Gemma's `gelu_pytorch_tanh`), computed in place over
//! both cores. candle's `gelu` calls libm `tanhf` per element on one thread, which cost
//! about a tenth of prefill; here `tanh` comes from a vectorizable `exp` (Cephes-style
//! range reduction and a degree-6 polynomial, relative error ≈ 2e-7).

use candle_core::{Result, Tensor};

#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    let x = x.clamp(-87.0, 87.0);
    let n = (x * std::f32::consts::LOG2_E).round();
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

#[inline(always)]
fn gelu_one(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // sqrt(2 / pi)
    let a = K * (x + 0.044_715 * x * x * x);
    // 0.5 · (1 + tanh(a)) = 1 / (1 + exp(-2a)); written with e = exp(-2|a|) ≤ 1 so that
    // neither sign cancels.
    let e = exp_approx(-2.0 * a.abs());
    let s = if a < 0.0 {
        e / (1.0 + e)
    } else {
        1.0 / (1.0 + e)
    };
    x * s
}

#[inline(always)]
fn gelu_slice(xs: &mut [f32]) {
    for x in xs {
        *x = gelu_one(*x);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_slice_avx2(xs: &mut [f32]) {
    gelu_slice(xs)
}

fn gelu_best(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { gelu_slice_avx2(xs) };
    }
    gelu_slice(xs)
}

/// gelu-tanh of an f32 tensor (candle's kernel off the CPU).
pub fn gelu_tanh(x: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return x.gelu();
    }
    let mut v: Vec<f32> = x.flatten_all()?.to_vec1()?;
    const CHUNK: usize = 8192;
    let ptr = v.as_mut_ptr() as usize;
    let len = v.len();
    candle_core::utils::barrier_pool().execute_chunked(len.div_ceil(CHUNK), |range| {
        for c in range {
            let start = c * CHUNK;
            let end = (start + CHUNK).min(len);
            // SAFETY: chunks are disjoint.
            let slice = unsafe {
                std::slice::from_raw_parts_mut((ptr as *mut f32).add(start), end - start)
            };
            gelu_best(slice);
        }
    });
    Tensor::from_vec(v, x.dims(), x.device())
}

#[cfg(test)]
mod tests {
    #[test]
    fn matches_the_libm_formula() {
        let mut worst = 0f32;
        for i in -20000..20000 {
            let x = i as f32 / 1000.0;
            let want = 0.5
                * x as f64
                * (1.0
                    + ((2.0 / std::f64::consts::PI).sqrt()
                        * (x as f64 + 0.044715 * (x as f64).powi(3)))
                    .tanh());
            let got = super::gelu_one(x) as f64;
            worst = worst.max(((got - want).abs() / (1e-6 + want.abs())) as f32);
        }
        assert!(worst < 1e-5, "relative error {worst}");
    }
}
