//! The fused decode read of TurboQuant storage, on the shared decode kernel
//! ([`crate::decode`]). Keys and values are decoded in the rotated space (norm × codebook
//! level per coordinate, no inverse transform per position): the query is rotated once per
//! read so that `(R q) · (R k) = q · k`, and the softmax-weighted values are accumulated in
//! the rotated space and inverse-rotated once per output head (the deferred-V read).

use crate::decode::{self, DecodeShape, RowSlots, TileSource};
use crate::turbo_planes::TurboPlanes;
use candle_core::Tensor;
use std::ops::Range;

struct TurboSource<'a> {
    planes: &'a TurboPlanes,
}

impl TileSource for TurboSource<'_> {
    fn keys(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let (keys, _) = self.planes.planes();
        let (d, cap) = (self.planes.geometry().1, self.planes.capacity());
        for (slot, row) in slots.zip(out.chunks_exact_mut(d)) {
            keys.rotated(block * cap + slot, row);
        }
    }

    fn values(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let (_, values) = self.planes.planes();
        let (dv, cap) = (self.planes.geometry().2, self.planes.capacity());
        for (slot, row) in slots.zip(out.chunks_exact_mut(dv)) {
            values.rotated(block * cap + slot, row);
        }
    }

    fn prepare_query(&self, q: &mut [f32]) {
        self.planes.planes().0.rotation().forward(q);
    }

    fn finish_output(&self, out: &mut [f32]) {
        self.planes.planes().1.rotation().inverse(out);
    }
}

/// Attends `q` `(rows, kv_heads * group, 1, head_dim)` over turbo `planes`, each row over
/// its visible slots.
pub(crate) fn attend(
    q: &Tensor,
    planes: &TurboPlanes,
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
) -> candle_core::Result<Tensor> {
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let out = decode::attend_source(&qv, &TurboSource { planes }, rows, s, scale);
    Tensor::from_vec(
        out,
        (s.rows, s.kv_heads * s.group, 1, s.value_dim),
        q.device(),
    )
}
