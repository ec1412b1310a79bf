//! The fused decode read of TurboQuant storage, on the shared decode kernel
//! ([`crate::read::decode`]). Keys and values are decoded in the rotated space (norm × codebook
//! level per coordinate, no inverse transform per position): the query is rotated once per
//! read so that `(R q) · (R k) = q · k`, and the softmax-weighted values are accumulated in
//! the rotated space and inverse-rotated once per output head (the deferred-V read).

use crate::planes::turbo::{TurboPlane, TurboPlanes};
use crate::planes::Planes;
use crate::read::decode::{self, DecodeShape, RowSlots, TileSource};
use crate::{Isa, KvError};
use candle_core::Tensor;
use std::ops::Range;

pub(crate) struct TurboSource<'a> {
    planes: &'a TurboPlanes,
    /// Per plane (keys, values): how the 512-bit path decodes it, if it does.
    #[cfg(target_arch = "x86_64")]
    wide: [Option<x86::Wide>; 2],
    /// Per plane: the element (rotated coordinate) each tile column holds, where the
    /// decoding permutes them.
    order: [Option<Vec<usize>>; 2],
}

impl TurboSource<'_> {
    fn fill(&self, which: usize, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let (keys, values) = self.planes.planes();
        let plane = [keys, values][which];
        let at = block * self.planes.capacity();
        // SAFETY (both): `wide` is set only at a level capped to the CPU's that has AVX-512,
        // and only for the geometries each kernel takes.
        #[cfg(target_arch = "x86_64")]
        match self.wide[which] {
            Some(x86::Wide::LaneMajor) => {
                return unsafe { x86::decode_rows(plane, at, slots, out) }
            }
            Some(x86::Wide::ByteWindow) => {
                return unsafe { x86::decode_rows_any(plane, at, slots, out) }
            }
            None => {}
        }
        for (slot, row) in slots.zip(out.chunks_exact_mut(plane.dim())) {
            plane.rotated(at + slot, row);
        }
    }
}

impl TileSource for TurboSource<'_> {
    fn keys(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        self.fill(0, block, slots, out)
    }

    fn values(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        self.fill(1, block, slots, out)
    }

    fn prepare_query(&self, block: usize, q: &mut [f32]) {
        self.planes.key_prep().rescale(block, q);
        self.planes.planes().0.rotation().forward(q);
        if let Some(order) = &self.order[0] {
            let rotated = q.to_vec();
            for (x, &e) in q.iter_mut().zip(order) {
                *x = rotated[e];
            }
        }
    }

    fn finish_output(&self, _block: usize, out: &mut [f32]) {
        if let Some(order) = &self.order[1] {
            let tile_order = out.to_vec();
            for (&x, &e) in tile_order.iter().zip(order) {
                out[e] = x;
            }
        }
        self.planes.planes().1.rotation().inverse(out);
    }
}

/// 512-bit decoding of turbo rows. 2- and 4-bit rows: codes unpacked lane-major as in
/// [`crate::read::affine_tiles`] (16 words per load, no permutes). Other widths (3, 5–8 bits):
/// 16 codes at a time in element order, from the `2·bits`-byte window that holds them: the
/// window broadcast to all four 128-bit lanes, each code's two bytes shuffled into its own
/// 32-bit lane, shifted and masked. Then the codebook lookup in registers (up to 64
/// levels; a gather from the table beyond), scaled by the norm.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::planes::turbo::TurboPlane;
    use crate::Isa;
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// How a plane's rows are decoded by 512-bit code.
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub enum Wide {
        /// 2 and 4 bits: lane-major, element order permuted.
        LaneMajor,
        /// Any width: element order kept.
        ByteWindow,
    }

    /// The 512-bit decoding of `plane` at `isa` (capped to the CPU's by the caller), if its
    /// geometry has one.
    pub fn available(plane: &TurboPlane, isa: Isa) -> Option<Wide> {
        if !isa.avx512() {
            return None;
        }
        let (dim, bits) = (plane.dim(), plane.bits() as usize);
        if matches!(bits, 2 | 4) && (dim * bits) % 512 == 0 {
            return Some(Wide::LaneMajor);
        }
        (dim % 16 == 0).then_some(Wide::ByteWindow)
    }

    /// # Safety
    /// The CPU must have AVX-512 F and [`available`] must give `LaneMajor` for `plane`.
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

    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL and [`available`] must give `ByteWindow` for
    /// `plane`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub unsafe fn decode_rows_any(
        plane: &TurboPlane,
        at: usize,
        slots: Range<usize>,
        out: &mut [f32],
    ) {
        let (dim, bits) = (plane.dim(), plane.bits() as usize);
        let levels = plane.levels();
        let mut table = [0f32; 256];
        table[..levels.len()].copy_from_slice(levels);
        let t: [__m512; 4] = std::array::from_fn(|i| _mm512_loadu_ps(table.as_ptr().add(16 * i)));
        // Code j of a window starts at bit j·bits, in byte j·bits/8: that byte and the
        // next go to the low half of 32-bit lane j (128-bit lane j/4 of the shuffle, which
        // indexes within its own copy of the window).
        let mut lane_shuffle = [-1i8; 64];
        let mut shifts = [0i32; 16];
        for (j, shift) in shifts.iter_mut().enumerate() {
            let byte = (j * bits) / 8;
            lane_shuffle[4 * j] = byte as i8;
            lane_shuffle[4 * j + 1] = (byte + 1).min(15) as i8;
            *shift = ((j * bits) % 8) as i32;
        }
        let shuffle = _mm512_loadu_si512(lane_shuffle.as_ptr().cast());
        let shifts = _mm512_loadu_si512(shifts.as_ptr().cast());
        let mask = _mm512_set1_epi32((1 << bits) - 1);
        let window: __mmask16 = ((1u32 << (2 * bits)) - 1) as __mmask16;
        for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
            let (codes, norm) = plane.slot(at + slot);
            assert!(codes.len() * 32 >= dim * bits);
            let bytes = codes.as_ptr().cast::<i8>();
            let norm = _mm512_set1_ps(norm);
            for (w, cols) in row.chunks_exact_mut(16).enumerate() {
                // The window holds 2·bits ≤ 16 bytes; the masked load reads no further.
                let x = _mm_maskz_loadu_epi8(window, bytes.add(w * 2 * bits));
                let x = _mm512_broadcast_i32x4(x);
                let c = _mm512_and_si512(
                    _mm512_srlv_epi32(_mm512_shuffle_epi8(x, shuffle), shifts),
                    mask,
                );
                let v = match levels.len() {
                    0..=16 => _mm512_permutexvar_ps(c, t[0]),
                    17..=32 => _mm512_permutex2var_ps(t[0], c, t[1]),
                    33..=64 => {
                        let lo = _mm512_permutex2var_ps(t[0], c, t[1]);
                        let hi = _mm512_permutex2var_ps(t[2], c, t[3]);
                        let upper = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
                        _mm512_mask_blend_ps(upper, lo, hi)
                    }
                    _ => _mm512_i32gather_ps::<4>(c, table.as_ptr()),
                };
                _mm512_storeu_ps(cols.as_mut_ptr(), _mm512_mul_ps(v, norm));
            }
        }
    }
}

/// The tile source of `planes` at `isa` (capped to the CPU's): 512-bit decoding where the
/// level and the geometry allow. The decoding and the orders `prepare_query` and
/// `finish_output` apply are chosen together, here, so they always agree.
pub(crate) fn source(planes: &TurboPlanes, isa: Isa) -> TurboSource<'_> {
    let (keys, values) = planes.planes();
    #[cfg(target_arch = "x86_64")]
    {
        let isa = isa.capped();
        let wide = [x86::available(keys, isa), x86::available(values, isa)];
        let order = |plane: &TurboPlane, wide| {
            (wide == Some(x86::Wide::LaneMajor)).then(|| {
                crate::read::affine_tiles::x86::lane_major_order(plane.dim(), plane.bits())
            })
        };
        TurboSource {
            planes,
            wide,
            order: [order(keys, wide[0]), order(values, wide[1])],
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (keys, values, isa);
        TurboSource {
            planes,
            order: [None, None],
        }
    }
}

/// Attends `q` `(rows, kv_heads * group, 1, head_dim)` over `planes`, each row over its
/// visible slots.
pub(crate) fn attend(
    q: &Tensor,
    planes: &TurboPlanes,
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
    isa: Isa,
) -> Result<Tensor, KvError> {
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let source = source(planes, isa);
    s.output(
        decode::attend_source(&qv, &source, rows, s, scale, isa),
        q.device(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planes::Planes;
    use crate::read::affine_tiles::tests::{assert_permutation, code_bit_by_bit};
    use crate::read::decode::tests::values;
    use candle_core::Device;

    /// The rows a tile source fills (portable `rotated`, 512-bit lane-major or byte-window,
    /// as the level and the geometry choose), held to `norm · levels[code]` with the codes
    /// read bit by bit from the stored words.
    #[test]
    fn decoded_rows_match_norm_times_level_at_every_level() {
        let (heads, slots, read) = (2, 6, 1..5);
        #[cfg(target_arch = "x86_64")]
        let mut kinds = std::collections::HashSet::new();
        for isa in Isa::supported() {
            for bits in 2..=8u8 {
                // 256 at 2 and 4 bits and 128 at 4 bits are lane-major; 8 is portable.
                for (d, dv) in [(256, 128), (64, 8)] {
                    let mut planes = TurboPlanes::new(bits, bits, 1, heads, d, dv);
                    planes.reserve(slots, usize::MAX).unwrap();
                    let tensor = |seed, dim| {
                        let x = values(seed, heads * slots * dim);
                        Tensor::from_vec(x, (1, heads, slots, dim), &Device::Cpu).unwrap()
                    };
                    planes
                        .write(0..1, 0, &tensor(12, d), &tensor(13, dv))
                        .unwrap();
                    let tiles = source(&planes, isa);
                    #[cfg(target_arch = "x86_64")]
                    kinds.extend(tiles.wide.into_iter().flatten().map(|w| w as u8));
                    let (key_plane, value_plane) = planes.planes();
                    for block in 0..heads {
                        for (which, plane) in [key_plane, value_plane].into_iter().enumerate() {
                            let dim = plane.dim();
                            let what = format!("{isa}, {bits} bits, dim {dim}, block {block}");
                            let order = tiles.order[which].as_deref();
                            if let Some(order) = order {
                                assert_permutation(order, dim);
                            }
                            let mut tile = vec![f32::NAN; read.len() * dim];
                            match which {
                                0 => tiles.keys(block, read.clone(), &mut tile),
                                _ => tiles.values(block, read.clone(), &mut tile),
                            }
                            for (t, slot) in read.clone().enumerate() {
                                let (words, norm) = plane.slot(block * planes.capacity() + slot);
                                for c in 0..dim {
                                    let e = order.map_or(c, |o| o[c]);
                                    let code = code_bit_by_bit(words, e, bits as usize);
                                    let want = norm as f64 * plane.levels()[code] as f64;
                                    let got = tile[t * dim + c] as f64;
                                    assert!(
                                        (got - want).abs() <= 1e-6 * want.abs() + 1e-9,
                                        "{what}, slot {slot}, column {c}: {got} vs {want}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
        // Both 512-bit decodings ran wherever this CPU has them.
        #[cfg(target_arch = "x86_64")]
        assert_eq!(kinds.len(), if Isa::detected().avx512() { 2 } else { 0 });
    }
}
