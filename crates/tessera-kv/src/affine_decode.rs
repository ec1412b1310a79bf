//! The fused decode read of affine storage: one query position per row, attended straight
//! from the packed codes. Each stored position is unpacked once into a head_dim-sized
//! buffer of raw codes and used by every query head of its KV head (GQA folded); scales
//! and biases are applied per group, never per element:
//!
//! - score: `q · (s·c + β) = s · (q · c) + β · Σq`, with `Σq` per group computed once;
//! - value: `Σ p (s·c + β) = Σ (p·s) c + (Σ p·β)`, the bias term summed per group and added
//!   once at the end.
//!
//! Pieces of positions run across the CPU pool and merge like the plain fused read.

use crate::affine_planes::{AffinePlanes, PlaneView};
use crate::decode::{self, dot, DecodeShape, Partial, RowSlots};
use candle_core::Tensor;
use std::ops::Range;

/// Unpacks `out.len()` codes of `BITS` bits (layout in [`crate::affine`]) as f32 values.
#[inline(always)]
pub(crate) fn unpack<const BITS: usize>(words: &[u32], out: &mut [f32]) {
    let mask = (1u32 << BITS) - 1;
    if 32 % BITS == 0 {
        // Codes never straddle words: a fixed number per word, which vectorizes.
        let per = 32 / BITS;
        for (w, o) in words.iter().zip(out.chunks_exact_mut(per)) {
            for (j, o) in o.iter_mut().enumerate() {
                *o = ((w >> (BITS * j)) & mask) as f32;
            }
        }
    } else {
        for (i, o) in out.iter_mut().enumerate() {
            let bit = i * BITS;
            let (w, shift) = (bit / 32, bit % 32);
            let mut v = (words[w] as u64) >> shift;
            if shift + BITS > 32 {
                v |= (words[w + 1] as u64) << (32 - shift);
            }
            *o = (v as u32 & mask) as f32;
        }
    }
}

/// Group parameters of one position as f32 `(scale, bias)` pairs.
#[inline(always)]
fn params(view: &PlaneView, slot: usize, out: &mut [f32]) {
    for (o, p) in out.iter_mut().zip(view.params(slot)) {
        *o = p.to_f32();
    }
}

/// What one piece of one (row, KV head) needs.
struct Piece<'a> {
    /// `group` query heads, `head_dim` each.
    q: &'a [f32],
    /// Σq per (query head, key group).
    qsum: &'a [f32],
    keys: PlaneView<'a>,
    values: PlaneView<'a>,
    group_size: usize,
    scale: f32,
}

#[inline(always)]
fn span<const BITS: usize>(p: &Piece, slots: Range<usize>, s: &DecodeShape) -> Partial {
    let (g, d, dv, gs) = (s.group, s.head_dim, s.value_dim, p.group_size);
    let (kg, vg) = (d / gs, dv / gs);
    let n = slots.len();
    let mut buf = vec![0f32; d.max(dv)];
    let mut sb = vec![0f32; 2 * kg.max(vg)];
    let mut scores = vec![0f32; g * n];
    for (i, slot) in slots.clone().enumerate() {
        unpack::<BITS>(p.keys.codes(slot), &mut buf[..d]);
        params(&p.keys, slot, &mut sb[..2 * kg]);
        for h in 0..g {
            let qh = &p.q[h * d..(h + 1) * d];
            let mut total = 0f32;
            for j in 0..kg {
                let raw = dot(&qh[j * gs..(j + 1) * gs], &buf[j * gs..(j + 1) * gs]);
                total += sb[2 * j] * raw + sb[2 * j + 1] * p.qsum[h * kg + j];
            }
            scores[h * n + i] = total * p.scale;
        }
    }
    let (max, sum) = decode::exponentiate(&mut scores, g, n);
    let mut acc = vec![0f32; g * dv];
    let mut bias = vec![0f32; g * vg];
    for (i, slot) in slots.enumerate() {
        unpack::<BITS>(p.values.codes(slot), &mut buf[..dv]);
        params(&p.values, slot, &mut sb[..2 * vg]);
        for h in 0..g {
            let w = scores[h * n + i];
            for j in 0..vg {
                let c = w * sb[2 * j];
                let out = &mut acc[h * dv + j * gs..][..gs];
                for (o, x) in out.iter_mut().zip(&buf[j * gs..(j + 1) * gs]) {
                    *o += c * x;
                }
                bias[h * vg + j] += w * sb[2 * j + 1];
            }
        }
    }
    for h in 0..g {
        for j in 0..vg {
            let b = bias[h * vg + j];
            acc[h * dv + j * gs..][..gs]
                .iter_mut()
                .for_each(|o| *o += b);
        }
    }
    Partial { max, sum, acc }
}

/// `span` compiled for AVX2 + FMA, where the CPU has them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn span_avx2<const BITS: usize>(p: &Piece, slots: Range<usize>, s: &DecodeShape) -> Partial {
    span::<BITS>(p, slots, s)
}

fn span_best<const BITS: usize>(p: &Piece, slots: Range<usize>, s: &DecodeShape) -> Partial {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { span_avx2::<BITS>(p, slots, s) };
    }
    span::<BITS>(p, slots, s)
}

fn span_bits(bits: u8, p: &Piece, slots: Range<usize>, s: &DecodeShape) -> Partial {
    match bits {
        2 => span_best::<2>(p, slots, s),
        3 => span_best::<3>(p, slots, s),
        4 => span_best::<4>(p, slots, s),
        5 => span_best::<5>(p, slots, s),
        6 => span_best::<6>(p, slots, s),
        8 => span_best::<8>(p, slots, s),
        _ => unreachable!("affine bits are validated when the scheme is parsed"),
    }
}

/// Attends `q` `(rows, kv_heads * group, 1, head_dim)` over affine `planes`, each row over
/// its visible slots.
pub(crate) fn attend(
    q: &Tensor,
    planes: &AffinePlanes,
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let (g, d, gs) = (s.group, s.head_dim, planes.group());
    let kg = d / gs;
    // Σq per (row, query head, key group), shared by every position.
    let qsum: Vec<f32> = qv.chunks_exact(gs).map(|c| c.iter().sum()).collect();
    let out = decode::run_pieces(rows, s, |r, h, slots| {
        let head = r * s.kv_heads + h;
        let (keys, values) = planes.views(head);
        let piece = Piece {
            q: &qv[head * g * d..][..g * d],
            qsum: &qsum[head * g * kg..][..g * kg],
            keys,
            values,
            group_size: gs,
            scale,
        };
        span_bits(planes.bits(), &piece, slots, s)
    });
    Tensor::from_vec(
        out,
        (s.rows, s.kv_heads * s.group, 1, s.value_dim),
        q.device(),
    )
}
