//! gelu with the tanh approximation (Gemma's `gelu_pytorch_tanh`), computed in place over
//! both cores. candle's `gelu` calls libm `tanhf` per element on one thread, which cost
//! about a tenth of prefill; here `tanh` comes from a vectorizable `exp` (Cephes-style
//! range reduction and a degree-6 polynomial, relative error ≈ 2e-7).

use candle_core::{Result, Tensor};
use tessera_kv::Isa;

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

/// `isa` must be one this CPU runs ([`Isa::capped`]).
fn gelu_at(xs: &mut [f32], isa: Isa) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: the caller capped `isa` to this CPU; AVX2 includes FMA.
        return unsafe { gelu_slice_avx2(xs) };
    }
    let _ = isa;
    gelu_slice(xs)
}

/// gelu-tanh of an f32 tensor at `isa` (capped to what this CPU runs): the portable loop,
/// or the same loop compiled for AVX2 + FMA. candle's kernel off the CPU.
pub fn gelu_tanh(x: &Tensor, isa: Isa) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return x.gelu();
    }
    let isa = isa.capped();
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
            gelu_at(slice, isa);
        }
    });
    Tensor::from_vec(v, x.dims(), x.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// gelu-tanh from its definition, in f64.
    fn reference(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    }

    /// Every level this CPU runs, through the tensor entry point (40 001 values: several
    /// 8192-element chunks and a short last one), against the f64 definition.
    #[test]
    fn every_level_matches_the_f64_definition() {
        let xs: Vec<f32> = (-20000..=20000).map(|i| i as f32 / 1000.0).collect();
        let t = Tensor::from_vec(xs.clone(), xs.len(), &Device::Cpu).unwrap();
        for isa in Isa::supported() {
            let got: Vec<f32> = gelu_tanh(&t, isa).unwrap().to_vec1().unwrap();
            assert_eq!(got.len(), xs.len());
            let mut worst = 0f64;
            for (&x, &g) in xs.iter().zip(&got) {
                let want = reference(x as f64);
                worst = worst.max((g as f64 - want).abs() / (1e-6 + want.abs()));
            }
            assert!(worst < 1e-5, "{isa}: relative error {worst}");
        }
    }
}

/// One block of activations as llama.cpp's Q8_0 / Q8_K form them: scale max|x| / 127,
/// codes rounded half away from zero; returns the scale. The same arithmetic at every
/// level; compiled for AVX2 where the CPU has it, so that the rounding and the maximum
/// vectorize (the baseline x86-64 target calls libm's `truncf` per element, a few percent
/// of a decode step).
pub(crate) fn quantize_block(src: &[f32], dst: &mut [i8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU runs AVX2.
        return unsafe { quantize_block_avx2(src, dst) };
    }
    quantize_block_any(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(src: &[f32], dst: &mut [i8]) -> f32 {
    quantize_block_any(src, dst)
}

#[inline(always)]
fn quantize_block_any(src: &[f32], dst: &mut [i8]) -> f32 {
    // A running maximum per lane (comparisons, not `f32::max`, whose NaN rule keeps it
    // scalar); a NaN input yields codes of 0 either way.
    let mut lanes = [0f32; 8];
    for chunk in src.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(chunk) {
            let a = v.abs();
            *m = if a > *m { a } else { *m };
        }
    }
    let mut amax = 0f32;
    for v in lanes.iter().chain(src.chunks_exact(8).remainder()) {
        let a = v.abs();
        amax = if a > amax { a } else { amax };
    }
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (o, v) in dst.iter_mut().zip(src) {
        let y = v * inv;
        // `as` truncates toward zero (and saturates), which is what `trunc` did.
        *o = (y + 0.5f32.copysign(y)) as i8;
    }
    scale
}

#[cfg(test)]
mod quantize_tests {
    use super::quantize_block;

    /// Against the definition in f64: scale max|x| / 127, round(x / scale) half away from
    /// zero. (The f32 path divides by multiplying with 1 / scale, so a value landing within
    /// an ulp of a half may round the other way: at most one code off there.)
    #[test]
    fn block_codes_follow_the_definition() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for len in [32usize, 256, 37] {
            for spread in [1e-3f32, 1.0, 300.0] {
                let x: Vec<f32> = (0..len)
                    .map(|i| next() * spread * if i % 29 == 0 { 8.0 } else { 1.0 })
                    .collect();
                let mut q = vec![0i8; len];
                let scale = quantize_block(&x, &mut q);
                let amax = x.iter().fold(0f64, |a, v| a.max(v.abs() as f64));
                assert!((scale as f64 - amax / 127.0).abs() <= 1e-6 * amax / 127.0);
                for (v, c) in x.iter().zip(&q) {
                    let want = (*v as f64 / (amax / 127.0)).round();
                    assert!((*c as f64 - want).abs() <= 1.0, "{v}: {c} vs {want}");
                    let exact = *v as f64 / (amax / 127.0);
                    if (exact.abs().fract() - 0.5).abs() > 1e-3 {
                        assert_eq!(*c as f64, want, "{v} of scale {scale}");
                    }
                }
            }
        }
        let mut zeros = [1i8; 32];
        assert_eq!(quantize_block(&[0.0; 32], &mut zeros), 0.0);
        assert_eq!(zeros, [0; 32]);
    }
}
