//! The fused decode read of affine storage: the shared decode kernel ([`crate::decode`])
//! with a tile source that dequantizes each piece's positions from the packed codes as it
//! fills the piece's tile. Nothing larger than one piece (256 positions) is ever
//! dequantized.
//!
//! (Applying scale and bias per group on the fly — `s·(q·c) + β·Σq` — measured slower: it
//! needs a horizontal sum per group and head.)

use crate::affine_planes::{AffinePlanes, PlaneView};
use crate::decode::{self, DecodeShape, RowSlots, TileSource};
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

/// Unpacks one stored position and applies its groups' scale and bias: `dim` f32 values.
#[inline(always)]
fn dequantize_row<const BITS: usize>(view: &PlaneView, slot: usize, group: usize, out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    unpack::<BITS>(view.codes(slot), out);
    // The row's (scale, bias) pairs converted in one call: per-value conversions would each
    // pay half's feature dispatch.
    let params = view.params(slot);
    let mut wide = [0f32; 32];
    let mut heap = Vec::new();
    let wide: &mut [f32] = if params.len() <= wide.len() {
        &mut wide[..params.len()]
    } else {
        heap.resize(params.len(), 0f32);
        &mut heap
    };
    params.convert_to_f32_slice(wide);
    for (values, p) in out.chunks_exact_mut(group).zip(wide.chunks_exact(2)) {
        let (s, b) = (p[0], p[1]);
        values.iter_mut().for_each(|v| *v = v.mul_add(s, b));
    }
}

/// Affine planes as a tile source: each position is dequantized on its way into the tile.
struct AffineSource<'a> {
    planes: &'a AffinePlanes,
}

impl AffineSource<'_> {
    #[inline(always)]
    fn rows<const BITS: usize>(
        view: &PlaneView,
        group: usize,
        slots: Range<usize>,
        out: &mut [f32],
    ) {
        let dim = out.len() / slots.len();
        for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
            dequantize_row::<BITS>(view, slot, group, row);
        }
    }

    #[inline(always)]
    fn fill(&self, view: &PlaneView, slots: Range<usize>, out: &mut [f32]) {
        let group = self.planes.group();
        match self.planes.bits() {
            2 => Self::rows::<2>(view, group, slots, out),
            3 => Self::rows::<3>(view, group, slots, out),
            4 => Self::rows::<4>(view, group, slots, out),
            5 => Self::rows::<5>(view, group, slots, out),
            6 => Self::rows::<6>(view, group, slots, out),
            8 => Self::rows::<8>(view, group, slots, out),
            _ => unreachable!("affine bits are validated when the scheme is parsed"),
        }
    }
}

impl TileSource for AffineSource<'_> {
    #[inline(always)]
    fn keys(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        self.fill(&self.planes.views(block).0, slots, out)
    }

    #[inline(always)]
    fn values(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        self.fill(&self.planes.views(block).1, slots, out)
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
    let out = decode::attend_source(&qv, &AffineSource { planes }, rows, s, scale);
    Tensor::from_vec(
        out,
        (s.rows, s.kv_heads * s.group, 1, s.value_dim),
        q.device(),
    )
}
