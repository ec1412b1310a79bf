//! tessera's affine codec against golden vectors made by mlx itself: `mx.quantize` of mlx's
//! Linux CPU wheel (`tests/data/make_mlx_affine.py` writes `tests/data/mlx_affine.json`;
//! it records the mlx version). Codes, scales and biases are compared bit for bit, through
//! both [`tessera_kv::codec::affine::quantize_group`] and the stored [`AffinePlanes`].
//!
//! Inputs are f32 values bf16 represents exactly (the planes round to bf16 before
//! quantizing, so this is what they quantize). mlx was given f32, so its scales and biases
//! are f32, computed exactly as ours before storage: we compare our f32 [`GroupParams`] with
//! them bit for bit, and our stored f16 with `f16::from_f32` of mlx's value (mlx stores
//! scales and biases in the input dtype, bf16 for bf16 inputs; tessera stores f16).
//!
//! Where they differ, mlx's CPU kernel (`mlx/backend/cpu/quantized.cpp`) is not what
//! `src/codec/affine.rs` follows, which is mlx's Metal kernel (`affine_quantize` in
//! `backend/metal/kernels/quantized.h`, the one mlx-lm runs on Apple GPUs). Two differences,
//! each checked here to be the whole of the discrepancy:
//!
//! 1. **Running maximum.** Metal (and tessera) start `w_max` at 0, the CPU kernel at −∞. They
//!    differ exactly on groups whose maximum is negative. For those the generator also
//!    quantized the group with its largest element replaced by 0, which gives the CPU
//!    kernel Metal's `(w_min, w_max)`: our parameters must equal that run's bit for bit, and
//!    our codes its codes at every other element.
//! 2. **Ties.** Metal (and tessera) round half away from zero (`round`), the CPU kernel half
//!    to even (`std::rint`). For the codes: where the quotient `(w − β) / s` is exactly
//!    `k + ½` with `k` even, our code is mlx's plus one; everywhere else they agree. For the
//!    first code `q0 = round(edge / s)`: where `edge / s` is exactly a half-integer, mlx's
//!    scale is `edge / rint(q0)` and ours `edge / round(q0)`; the bias (`edge`) agrees, and
//!    mlx's codes are reproduced by our [`affine::code`] on mlx's parameters (ties aside).
//!
//! Dequantization (`s · q + β` in f32, element `i` at bit `i · bits` of the group's words) is
//! compared with `mx.dequantize` bit for bit.

use half::f16;
use serde_json::Value;
use std::collections::BTreeMap;
use tessera_kv::codec::affine::{self, GroupParams};
use tessera_kv::planes::{AffinePlanes, Planes};

const GOLDEN: &str = include_str!("data/mlx_affine.json");

/// 32-bit values from 8 hex digits each, little-endian byte order.
fn words(hex: &str) -> Vec<u32> {
    assert_eq!(hex.len() % 8, 0);
    (0..hex.len() / 8)
        .map(|i| {
            let mut b = [0u8; 4];
            for (j, byte) in b.iter_mut().enumerate() {
                let at = i * 8 + j * 2;
                *byte = u8::from_str_radix(&hex[at..at + 2], 16).unwrap();
            }
            u32::from_le_bytes(b)
        })
        .collect()
}

fn floats(hex: &str) -> Vec<f32> {
    words(hex).into_iter().map(f32::from_bits).collect()
}

fn hex_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("golden file: no {key}"))
}

/// Whether `x` is exactly halfway between two integers.
fn is_tie(x: f32) -> bool {
    (x - x.trunc()).abs() == 0.5
}

#[derive(Default, Debug)]
struct Tally {
    groups: usize,
    /// Parameters and every code bit for bit.
    exact: usize,
    /// Groups with a negative maximum (difference 1).
    zero_max: usize,
    /// Of those, groups where mlx's CPU parameters on the group itself differ from ours.
    zero_max_differs: usize,
    /// Groups whose `q0` is a tie (difference 2).
    q0_ties: usize,
    /// Codes that differ by a tie (difference 2), and the groups holding them.
    code_ties: usize,
    code_tie_groups: usize,
}

#[test]
fn affine_quantization_matches_mlx_bit_for_bit_or_by_the_named_differences() {
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    let (rows, dim) = (
        golden["rows"].as_u64().unwrap() as usize,
        golden["dim"].as_u64().unwrap() as usize,
    );
    let cases = golden["cases"].as_array().unwrap();
    assert_eq!(
        cases.len(),
        affine::AFFINE_BITS.len() * affine::AFFINE_GROUPS.len(),
        "every accepted (bits, group)"
    );
    let mut tallies: BTreeMap<u8, Tally> = BTreeMap::new();
    for case in cases {
        let bits = case["bits"].as_u64().unwrap() as u8;
        let group = case["group"].as_u64().unwrap() as usize;
        let n_bins = ((1u32 << bits) - 1) as f32;
        let w = floats(golden["inputs"][bits.to_string()].as_str().unwrap());
        assert_eq!(w.len(), rows * dim);
        for x in &w {
            assert_eq!(x.to_bits() & 0xffff, 0, "inputs are bf16 values");
        }
        let (mq, ms, mb, mdeq) = (
            words(hex_of(case, "codes")),
            floats(hex_of(case, "scales")),
            floats(hex_of(case, "biases")),
            floats(hex_of(case, "dequantized")),
        );
        let (wpr, wpg, groups) = (
            dim * bits as usize / 32,
            group * bits as usize / 32,
            dim / group,
        );
        assert_eq!(
            (mq.len(), ms.len(), mb.len()),
            (rows * wpr, rows * groups, rows * groups)
        );
        let zero_max: BTreeMap<(usize, usize), &Value> = case["zero_max"]
            .as_array()
            .unwrap()
            .iter()
            .map(|z| {
                let at = |k: &str| z[k].as_u64().unwrap() as usize;
                ((at("row"), at("group")), z)
            })
            .collect();

        // The stored planes: the rows as positions of one (row, head) block.
        let mut planes = AffinePlanes::new(bits, group, 1, 1, dim, dim);
        planes.reserve(rows, usize::MAX).unwrap();
        let t =
            candle_core::Tensor::from_vec(w.clone(), (1, 1, rows, dim), &candle_core::Device::Cpu)
                .unwrap();
        planes.write(0..1, 0, &t, &t).unwrap();
        let [(stored_codes, stored_params), _] = planes.raw();

        let tally = tallies.entry(bits).or_default();
        for r in 0..rows {
            for g in 0..groups {
                tally.groups += 1;
                let at = format!("bits {bits} group {group} row {r} group {g}");
                let x = &w[r * dim + g * group..][..group];
                // Ours, through the codec function and through the planes.
                let mut ours = vec![0u32; wpg];
                let p = affine::quantize_group(x, bits, &mut ours);
                assert_eq!(
                    &stored_codes[r * wpr + g * wpg..][..wpg],
                    ours.as_slice(),
                    "{at}: planes store the codec's codes"
                );
                let stored = &stored_params[(r * groups + g) * 2..][..2];
                assert_eq!(
                    (stored[0].to_bits(), stored[1].to_bits()),
                    (
                        f16::from_f32(p.scale).to_bits(),
                        f16::from_f32(p.bias).to_bits()
                    ),
                    "{at}: planes store f16 of the codec's parameters"
                );

                // mlx's, on this group or (difference 1) on it with its maximum set to 0.
                let (theirs, scale, bias, skip) = match zero_max.get(&(r, g)) {
                    Some(z) => {
                        assert!(
                            x.iter().all(|v| *v < 0.0),
                            "{at}: zero_max only for max < 0"
                        );
                        tally.zero_max += 1;
                        let e = z["element"].as_u64().unwrap() as usize;
                        let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        assert_eq!(x[e], max, "{at}: the replaced element is the maximum");
                        // The CPU kernel's own maximum (negative) changes its parameters
                        // unless both ranges happen to snap to the same grid.
                        tally.zero_max_differs +=
                            ((ms[r * groups + g].to_bits(), mb[r * groups + g].to_bits())
                                != (p.scale.to_bits(), p.bias.to_bits()))
                                as usize;
                        (
                            words(hex_of(z, "codes")),
                            floats(hex_of(z, "scale"))[0],
                            floats(hex_of(z, "bias"))[0],
                            Some(e),
                        )
                    }
                    None => {
                        let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        assert!(max >= 0.0, "{at}: the generator missed a negative maximum");
                        (
                            mq[r * wpr + g * wpg..][..wpg].to_vec(),
                            ms[r * groups + g],
                            mb[r * groups + g],
                            None,
                        )
                    }
                };
                let mlx = GroupParams { scale, bias };
                let exact_params =
                    (p.scale.to_bits(), p.bias.to_bits()) == (scale.to_bits(), bias.to_bits());
                // The codes ours must equal (ties aside): our own, or (q0 tie) our code
                // function on mlx's grid.
                let compared: Vec<u32> = if exact_params {
                    assert_eq!(
                        (stored[0].to_bits(), stored[1].to_bits()),
                        (
                            f16::from_f32(scale).to_bits(),
                            f16::from_f32(bias).to_bits()
                        ),
                        "{at}: stored f16 = f16 of mlx's f32"
                    );
                    (0..group)
                        .map(|i| affine::get_code(&ours, i, bits))
                        .collect()
                } else {
                    // Difference 2 on q0, from its definition (Metal's w_max starts at 0).
                    let w_min = x.iter().cloned().fold(f32::MAX, f32::min);
                    let w_max = x.iter().cloned().fold(0f32, f32::max);
                    let side = w_min.abs() > w_max.abs();
                    let s0 = ((w_max - w_min) / n_bins).max(1e-7);
                    let s0 = if side { s0 } else { -s0 };
                    let edge = if side { w_min } else { w_max };
                    let q0 = edge / s0;
                    assert!(
                        is_tie(q0),
                        "{at}: parameters differ without a q0 tie: ours {p:?}, mlx {mlx:?}"
                    );
                    assert_eq!(
                        scale.to_bits(),
                        (edge / q0.round_ties_even()).to_bits(),
                        "{at}"
                    );
                    assert_eq!(p.scale.to_bits(), (edge / q0.round()).to_bits(), "{at}");
                    assert_eq!(
                        (p.bias.to_bits(), bias.to_bits()),
                        (edge.to_bits(), edge.to_bits())
                    );
                    tally.q0_ties += 1;
                    x.iter().map(|&v| affine::code(v, mlx, bits)).collect()
                };
                let grid = if exact_params { p } else { mlx };
                let mut ties = 0;
                for (i, (&c, &v)) in compared.iter().zip(x).enumerate() {
                    if Some(i) == skip {
                        continue; // mlx quantized 0 there, we the element itself
                    }
                    let m = affine::get_code(&theirs, i, bits);
                    if c != m {
                        let q = (v - grid.bias) / grid.scale;
                        assert!(
                            is_tie(q) && (q.trunc() as u32).is_multiple_of(2) && c == m + 1,
                            "{at} element {i} ({v}): code {c} vs mlx {m}, quotient {q}"
                        );
                        ties += 1;
                    }
                }
                tally.code_ties += ties;
                tally.code_tie_groups += (ties > 0) as usize;
                if exact_params && ties == 0 && skip.is_none() {
                    tally.exact += 1;
                }

                // Dequantization of mlx's own codes and parameters.
                let mut y = vec![0f32; group];
                let their_params = GroupParams {
                    scale: ms[r * groups + g],
                    bias: mb[r * groups + g],
                };
                affine::dequantize_group(
                    &mq[r * wpr + g * wpg..][..wpg],
                    their_params,
                    bits,
                    &mut y,
                );
                for (i, (a, b)) in y
                    .iter()
                    .zip(&mdeq[r * dim + g * group..][..group])
                    .enumerate()
                {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{at} element {i}: dequantized {a} vs mlx {b}"
                    );
                }
            }
        }
    }
    for (bits, t) in &tallies {
        eprintln!("{bits} bits: {t:?}");
        // The data exercises each difference, and most groups are exact.
        assert!(
            t.zero_max_differs > 0 && t.code_ties > 0,
            "{bits} bits: {t:?}"
        );
        assert!(bits == &8 || t.q0_ties > 0, "{bits} bits: {t:?}");
        assert!(t.exact * 2 >= t.groups, "{bits} bits: {t:?}");
    }
}
