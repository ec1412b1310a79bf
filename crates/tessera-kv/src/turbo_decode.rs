//! The fused decode read of TurboQuant storage, on the shared decode kernel
//! ([`crate::decode`]). Keys and values are decoded in the rotated space (norm × codebook
//! level per coordinate, no inverse transform per position): the query is rotated once per
//! read so that `(R q) · (R k) = q · k`, and the softmax-weighted values are accumulated in
//! the rotated space and inverse-rotated once per output head (the deferred-V read).

use crate::decode::{self, DecodeShape, RowSlots, TileSource};
use crate::turbo_planes::{TurboPlane, TurboPlanes};
use candle_core::Tensor;
use std::ops::Range;

pub(crate) struct TurboSource<'a> {
    planes: &'a TurboPlanes,
    /// Per plane (keys, values): decoded lane-major by the 512-bit path, with the element
    /// (rotated coordinate) each tile column holds.
    wide: [Option<Vec<usize>>; 2],
}

impl TurboSource<'_> {
    fn fill(
        &self,
        plane: &TurboPlane,
        wide: bool,
        block: usize,
        slots: Range<usize>,
        out: &mut [f32],
    ) {
        let at = block * self.planes.capacity();
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: `wide` is set only where the CPU and the plane's geometry allow it.
            unsafe { x86::decode_rows(plane, at, slots, out) };
            return;
        }
        let _ = wide;
        for (slot, row) in slots.zip(out.chunks_exact_mut(plane.dim())) {
            plane.rotated(at + slot, row);
        }
    }
}

impl TileSource for TurboSource<'_> {
    fn keys(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let plane = self.planes.planes().0;
        self.fill(plane, self.wide[0].is_some(), block, slots, out)
    }

    fn values(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let plane = self.planes.planes().1;
        self.fill(plane, self.wide[1].is_some(), block, slots, out)
    }

    fn prepare_query(&self, q: &mut [f32]) {
        self.planes.planes().0.rotation().forward(q);
        if let Some(order) = &self.wide[0] {
            let rotated = q.to_vec();
            for (x, &e) in q.iter_mut().zip(order) {
                *x = rotated[e];
            }
        }
    }

    fn finish_output(&self, out: &mut [f32]) {
        if let Some(order) = &self.wide[1] {
            let tile_order = out.to_vec();
            for (&x, &e) in tile_order.iter().zip(order) {
                out[e] = x;
            }
        }
        self.planes.planes().1.rotation().inverse(out);
    }
}

/// 512-bit decoding of 2- and 4-bit turbo rows: codes unpacked lane-major as in
/// [`crate::affine_decode`] (16 words per load, no permutes), looked up in the codebook
/// with one in-register permute (at most 16 levels), scaled by the norm.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::turbo_planes::TurboPlane;
    use std::arch::x86_64::*;
    use std::ops::Range;

    pub fn available(plane: &TurboPlane) -> bool {
        matches!(plane.bits(), 2 | 4)
            && (plane.dim() * plane.bits() as usize) % 512 == 0
            && std::is_x86_feature_detected!("avx512f")
    }

    /// # Safety
    /// The CPU must have AVX-512 F and [`available`] must hold for `plane`.
    #[target_feature(enable = "avx512f,avx2")]
    pub unsafe fn decode_rows(plane: &TurboPlane, at: usize, slots: Range<usize>, out: &mut [f32]) {
        let (dim, bits) = (plane.dim(), plane.bits() as usize);
        let per = 32 / bits;
        let mut table = [0f32; 16];
        table[..plane.levels().len()].copy_from_slice(plane.levels());
        let levels = _mm512_loadu_ps(table.as_ptr());
        let mask = _mm512_set1_epi32((1 << bits) - 1);
        for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
            let (codes, norm) = plane.slot(at + slot);
            assert!(codes.len() * 32 == dim * bits);
            let norm = _mm512_set1_ps(norm);
            for (b, cols) in row.chunks_exact_mut(16 * per).enumerate() {
                let words = _mm512_loadu_si512(codes.as_ptr().add(b * 16).cast());
                for j in 0..per {
                    let c = _mm512_and_si512(
                        _mm512_srlv_epi32(words, _mm512_set1_epi32((j * bits) as i32)),
                        mask,
                    );
                    let v = _mm512_mul_ps(_mm512_permutexvar_ps(c, levels), norm);
                    _mm512_storeu_ps(cols.as_mut_ptr().add(j * 16), v);
                }
            }
        }
    }
}

/// The tile source of `planes`: 512-bit decoding where the CPU and bit widths allow.
pub(crate) fn source(planes: &TurboPlanes) -> TurboSource<'_> {
    let (keys, values) = planes.planes();
    let wide = |plane: &TurboPlane| -> Option<Vec<usize>> {
        #[cfg(target_arch = "x86_64")]
        if x86::available(plane) {
            return Some(crate::affine_decode::x86::lane_major_order(
                plane.dim(),
                plane.bits(),
            ));
        }
        let _ = plane;
        None
    };
    TurboSource {
        planes,
        wide: [wide(keys), wide(values)],
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
    let source = source(planes);
    let out = decode::attend_source(&qv, &source, rows, s, scale);
    Tensor::from_vec(
        out,
        (s.rows, s.kv_heads * s.group, 1, s.value_dim),
        q.device(),
    )
}
