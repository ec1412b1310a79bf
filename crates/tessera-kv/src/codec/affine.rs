//! The affine codec's arithmetic (mlx's `quantize` / `dequantize`, written from its
//! definition): each group of `group` consecutive elements along head_dim stores a scale `s`,
//! a bias `β` and one `bits`-bit code `q` per element, reconstructed as `s · q + β`.
//!
//! Rounding follows mlx rather than plain min/max: the group's larger-magnitude edge and zero
//! are made exactly representable. With `n = 2^bits − 1`, `w_max` taken over the group and
//! 0 (mlx starts its running maximum at 0), `s = max((w_max − w_min) / n, 1e-7)`, negated when
//! the maximum is the larger-magnitude edge; `q0 = round(edge / s)`; unless `q0` is 0 the scale
//! snaps to `edge / q0` and the bias is the edge itself. Codes are `round((w − β) / s)`
//! clamped to `0 ..= n`, rounding half away from zero.
//!
//! Layout (mlx's): element `i` of a group sits at bit offset `i · bits` of the group's
//! little-endian stream of u32 words; a group of `g` elements fills exactly `g · bits / 32`
//! words, so codes of 3, 5 and 6 bits may straddle two words.
//!
//! Which mlx: this is the arithmetic of mlx's Metal kernel (what mlx-lm runs on Apple GPUs).
//! mlx's CPU backend (0.32) differs in two places, both checked against mlx's own codes in
//! `tests/mlx_affine.rs`: it starts the running maximum at −∞ (so a group whose elements are
//! all negative gets another scale) and rounds with `rint` (ties to even, for codes and
//! `q0`). Everything else — layout, snapping, eps, clamping, dequantization — is bit-exact.
//!
//! This module is the codec's arithmetic only; the layer cache that stores affine planes
//! builds on it.

/// Bit widths and group sizes the affine codec accepts.
pub const AFFINE_BITS: [u8; 6] = [2, 3, 4, 5, 6, 8];
pub const AFFINE_GROUPS: [u16; 3] = [32, 64, 128];

/// One group's quantization parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupParams {
    pub scale: f32,
    pub bias: f32,
}

/// Round half away from zero (Metal's and C's `round`).
#[inline]
fn round_away(x: f32) -> f32 {
    x.round()
}

/// mlx's scale and bias for one group.
pub fn group_params(group: &[f32], bits: u8) -> GroupParams {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let w_min = group.iter().fold(f32::MAX, |a, &v| a.min(v));
    let w_max = group.iter().fold(0f32, |a, &v| a.max(v));
    let mut scale = ((w_max - w_min) / n_bins).max(1e-7);
    let side = w_min.abs() > w_max.abs();
    if !side {
        scale = -scale;
    }
    let edge = if side { w_min } else { w_max };
    let q0 = round_away(edge / scale);
    if q0 == 0.0 {
        GroupParams { scale, bias: 0.0 }
    } else {
        GroupParams {
            scale: edge / q0,
            bias: edge,
        }
    }
}

/// The code of `w` under `p`.
#[inline]
pub fn code(w: f32, p: GroupParams, bits: u8) -> u32 {
    let n_bins = ((1u32 << bits) - 1) as f32;
    round_away((w - p.bias) / p.scale).clamp(0.0, n_bins) as u32
}

/// Quantizes one group into `words` (`group.len() · bits / 32` of them) and returns its
/// parameters.
pub fn quantize_group(group: &[f32], bits: u8, words: &mut [u32]) -> GroupParams {
    let p = group_params(group, bits);
    words.iter_mut().for_each(|w| *w = 0);
    for (i, &w) in group.iter().enumerate() {
        put_code(words, i, bits, code(w, p, bits));
    }
    p
}

/// Writes code `i` of a group's word stream.
#[inline]
pub fn put_code(words: &mut [u32], i: usize, bits: u8, value: u32) {
    let bit = i * bits as usize;
    let (word, shift) = (bit / 32, bit % 32);
    words[word] |= value << shift;
    if shift + bits as usize > 32 {
        words[word + 1] |= value >> (32 - shift);
    }
}

/// Reads code `i` of a group's word stream.
#[inline]
pub fn get_code(words: &[u32], i: usize, bits: u8) -> u32 {
    let bit = i * bits as usize;
    let (word, shift) = (bit / 32, bit % 32);
    let mut v = (words[word] as u64) >> shift;
    if shift + bits as usize > 32 {
        v |= (words[word + 1] as u64) << (32 - shift);
    }
    (v as u32) & ((1u32 << bits) - 1)
}

/// Reconstructs one group.
pub fn dequantize_group(words: &[u32], p: GroupParams, bits: u8, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = p.scale * get_code(words, i, bits) as f32 + p.bias;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.45) * 3.0
            })
            .collect()
    }

    #[test]
    fn codes_sit_at_bit_offset_i_times_bits() {
        for bits in AFFINE_BITS {
            for group in AFFINE_GROUPS {
                let g = group as usize;
                let mut words = vec![0u32; g * bits as usize / 32];
                let codes: Vec<u32> = (0..g).map(|i| (i as u32 * 7 + 3) % (1 << bits)).collect();
                for (i, &c) in codes.iter().enumerate() {
                    put_code(&mut words, i, bits, c);
                }
                // The same stream as one little-endian bit string.
                let bitstring: Vec<bool> = words
                    .iter()
                    .flat_map(|w| (0..32).map(move |b| (w >> b) & 1 == 1))
                    .collect();
                for (i, &c) in codes.iter().enumerate() {
                    let v = (0..bits as usize).fold(0u32, |acc, b| {
                        acc | ((bitstring[i * bits as usize + b] as u32) << b)
                    });
                    assert_eq!(v, c, "bits {bits} group {group} element {i}");
                    assert_eq!(get_code(&words, i, bits), c);
                }
            }
        }
    }

    #[test]
    fn edge_and_zero_are_exact_and_error_is_bounded() {
        for bits in AFFINE_BITS {
            for group in AFFINE_GROUPS {
                let g = group as usize;
                let mut x = sample(g, bits as u64 * 1000 + group as u64);
                x[3] = 0.0;
                let mut words = vec![0u32; g * bits as usize / 32];
                let p = quantize_group(&x, bits, &mut words);
                let mut y = vec![0f32; g];
                dequantize_group(&words, p, bits, &mut y);
                let (min, max) = (
                    x.iter().cloned().fold(f32::MAX, f32::min),
                    x.iter().cloned().fold(0f32, f32::max),
                );
                let edge = if min.abs() > max.abs() { min } else { max };
                let at = x.iter().position(|&v| v == edge).unwrap();
                assert!(
                    (y[at] - edge).abs() <= 1e-6 * edge.abs(),
                    "edge {edge} → {}",
                    y[at]
                );
                assert!(y[3].abs() <= 1e-6, "zero → {}", y[3]);
                // Every element within half a step, except values past the far edge that the
                // snapped grid cannot reach (at most one more step).
                for (a, b) in x.iter().zip(&y) {
                    assert!(
                        (a - b).abs() <= 1.5 * p.scale.abs() + 1e-6,
                        "bits {bits}: {a} → {b} (scale {})",
                        p.scale
                    );
                }
            }
        }
    }

    #[test]
    fn all_negative_group_keeps_zero_in_range() {
        let x: Vec<f32> = (0..32).map(|i| -1.0 - i as f32 * 0.1).collect();
        let p = group_params(&x, 4);
        // mlx starts the running maximum at 0, so the grid spans [min, 0].
        assert!(p.bias < 0.0 && p.scale > 0.0);
        assert_eq!(code(0.0, p, 4), 15);
    }
}
