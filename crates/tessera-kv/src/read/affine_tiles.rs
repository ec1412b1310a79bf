//! The fused decode read of affine storage: the shared decode kernel ([`crate::read::decode`])
//! with a tile source that dequantizes positions from the packed codes as it fills a
//! sub-tile: nothing larger than 32 positions is ever dequantized.
//!
//! (Applying scale and bias per group on the fly — `s·(q·c) + β·Σq` — measured slower: it
//! needs a horizontal sum per group and head.)

use crate::planes::affine::{AffinePlanes, PlaneView};
use crate::read::decode::{self, DecodeShape, RowSlots, TileSource};
use crate::{Isa, KvError};
use candle_core::Tensor;
use std::ops::Range;

/// Unpacks `out.len()` codes of `BITS` bits (layout in [`crate::codec::affine`]) as f32 values.
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
        values.iter_mut().for_each(|v| *v = *v * s + b);
    }
}

/// Affine planes as a tile source: each position is dequantized on its way into the tile.
pub(crate) struct AffineSource<'a> {
    planes: &'a AffinePlanes,
    /// The words per block of the vector unpacker the read's level and the planes'
    /// geometry allow (16 at AVX-512, 8 at AVX2), which writes rows lane-major: `orders`
    /// are then the element at each tile column, keys and values.
    #[cfg(target_arch = "x86_64")]
    lanes: Option<usize>,
    orders: Option<(Vec<usize>, Vec<usize>)>,
}

impl<'a> AffineSource<'a> {
    /// The tile source of `planes` at `isa` (capped to the CPU's). The unpacker and the
    /// orders `prepare_query` and `finish_output` apply are chosen together, here, so they
    /// always agree.
    fn new(planes: &'a AffinePlanes, isa: Isa) -> Self {
        let (_, d, dv) = planes.geometry3();
        #[cfg(target_arch = "x86_64")]
        {
            let (bits, isa) = (planes.bits(), isa.capped());
            let lanes = if isa.avx512() {
                x86::available(bits, [d, dv]).then_some(16)
            } else if isa.avx2() {
                x86::available8(bits, [d, dv]).then_some(8)
            } else {
                None
            };
            let orders = lanes.map(|lanes| {
                (
                    x86::lane_major_order(d, bits, lanes),
                    x86::lane_major_order(dv, bits, lanes),
                )
            });
            AffineSource {
                planes,
                lanes,
                orders,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (d, dv, isa);
            AffineSource {
                planes,
                orders: None,
            }
        }
    }

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
        // SAFETY: `lanes` is set only at a level capped to the CPU's that has AVX-512 (16)
        // or AVX2 (8), and only for geometries that unpacker takes.
        #[cfg(target_arch = "x86_64")]
        match self.lanes {
            Some(16) => {
                unsafe { x86::dequantize_rows(view, self.planes.bits(), group, slots, out) };
                return;
            }
            Some(_) => {
                unsafe { x86::dequantize_rows8(view, self.planes.bits(), group, slots, out) };
                return;
            }
            None => {}
        }
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

/// 512-bit dequantization of 2-, 4- and 8-bit rows in lane-major order: a block of 16 u32
/// words (`16 · per` codes, `per = 32 / bits`) is loaded once; shifting all 16 words by
/// `j · bits` yields code `j` of every word, stored as tile columns `j · 16 .. j · 16 + 16`.
/// Column `block · 16 · per + j · 16 + w` thus holds element `block · 16 · per + w · per + j`
/// ([`lane_major_order`]); no permute, and each block's scales and biases are one vector.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use crate::planes::affine::PlaneView;
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Whether rows of `bits` bits and these dimensions have the 512-bit unpacker (the
    /// caller checks the level).
    pub fn available(bits: u8, dims: [usize; 2]) -> bool {
        matches!(bits, 2 | 4 | 8) && dims.iter().all(|d| d * bits as usize % 512 == 0)
    }

    /// Whether rows of `bits` bits and these dimensions have the 256-bit unpacker (the
    /// caller checks the level).
    pub fn available8(bits: u8, dims: [usize; 2]) -> bool {
        matches!(bits, 2 | 4 | 8) && dims.iter().all(|d| d * bits as usize % 256 == 0)
    }

    /// [`dequantize_rows`] 8 lanes wide: blocks of 8 words.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `bits` must be 2, 4 or 8 and `dim · bits` a
    /// multiple of 256.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequantize_rows8(
        view: &PlaneView,
        bits: u8,
        group: usize,
        slots: Range<usize>,
        out: &mut [f32],
    ) {
        let dim = out.len() / slots.len();
        let per = 32 / bits as usize;
        let block = 8 * per;
        assert!(dim % block == 0 && group >= per && group % per == 0);
        let mask = _mm256_set1_epi32((1 << bits) - 1);
        let scale_at = param_index::<8>(dim, per, group);
        let one_group = group % block == 0;
        let (mut scales, mut biases) = ([0f32; 8], [0f32; 8]);
        let mut wide = Vec::new();
        for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
            let codes = view.codes(slot);
            let params = view.params(slot);
            assert!(codes.len() * 32 == dim * bits as usize && params.len() * group == 2 * dim);
            wide.resize(params.len(), 0f32);
            widen_params(params, &mut wide);
            for (b, cols) in row.chunks_exact_mut(block).enumerate() {
                let at = &scale_at[b];
                let (s, bias) = if one_group {
                    // The whole block lies in one group.
                    let at0 = at[0] as usize;
                    (_mm256_set1_ps(wide[at0]), _mm256_set1_ps(wide[at0 + 1]))
                } else {
                    for w in 0..8 {
                        scales[w] = wide[at[w] as usize];
                        biases[w] = wide[at[w] as usize + 1];
                    }
                    (
                        _mm256_loadu_ps(scales.as_ptr()),
                        _mm256_loadu_ps(biases.as_ptr()),
                    )
                };
                let words = _mm256_loadu_si256(codes.as_ptr().add(b * 8).cast());
                for j in 0..per {
                    let v = _mm256_and_si256(
                        _mm256_srlv_epi32(words, _mm256_set1_epi32((j * bits as usize) as i32)),
                        mask,
                    );
                    let f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, bias);
                    _mm256_storeu_ps(cols.as_mut_ptr().add(j * 8), f);
                }
            }
        }
    }

    /// Lane w of block b (blocks of `L` words, `per` codes each) takes the parameters of
    /// group (b·block + w·per) / group: their indices in a row's (scale, bias) list,
    /// computed once per call.
    fn param_index<const L: usize>(dim: usize, per: usize, group: usize) -> Vec<[i32; L]> {
        let block = L * per;
        (0..dim / block)
            .map(|b| std::array::from_fn(|w| (2 * ((b * block + w * per) / group)) as i32))
            .collect()
    }

    /// A row's f16 (scale, bias) pairs as f32, 8 at a time (`to_f32` per value pays a
    /// dispatch); `wide` is as long as `params`.
    ///
    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn widen_params(params: &[half::f16], wide: &mut [f32]) {
        let n = params.len();
        for (dst, src) in wide.chunks_exact_mut(8).zip(params.chunks_exact(8)) {
            let h = _mm_loadu_si128(src.as_ptr().cast());
            _mm256_storeu_ps(dst.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
        for i in n / 8 * 8..n {
            wide[i] = params[i].to_f32();
        }
    }

    /// The element each tile column holds (see the module above) for blocks of `lanes`
    /// words (16 for the 512-bit unpacker, 8 for the 256-bit one).
    pub fn lane_major_order(dim: usize, bits: u8, lanes: usize) -> Vec<usize> {
        let per = 32 / bits as usize;
        (0..dim)
            .map(|p| {
                let (block, r) = (p / (lanes * per), p % (lanes * per));
                let (j, w) = (r / lanes, r % lanes);
                block * lanes * per + w * per + j
            })
            .collect()
    }

    /// # Safety
    /// The CPU must have AVX-512 F and BW; `bits` must be 2, 4 or 8 and `dim · bits` a
    /// multiple of 512.
    #[target_feature(enable = "avx512f,avx512bw,avx2,f16c")]
    pub unsafe fn dequantize_rows(
        view: &PlaneView,
        bits: u8,
        group: usize,
        slots: Range<usize>,
        out: &mut [f32],
    ) {
        let dim = out.len() / slots.len();
        let per = 32 / bits as usize;
        let block = 16 * per;
        assert!(dim % block == 0 && group >= per && group % per == 0);
        let mask = _mm512_set1_epi32((1 << bits) - 1);
        let scale_at = param_index::<16>(dim, per, group);
        let (mut scales, mut biases) = ([0f32; 16], [0f32; 16]);
        for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
            let codes = view.codes(slot);
            let params = view.params(slot);
            assert!(codes.len() * 32 == dim * bits as usize && params.len() * group == 2 * dim);
            let mut wide = [0f32; 64];
            let n = params.len();
            assert!(n <= 64, "at most 32 groups per row");
            widen_params(params, &mut wide[..n]);
            let first16 = _mm512_loadu_ps(wide.as_ptr());
            for (b, cols) in row.chunks_exact_mut(block).enumerate() {
                let at = &scale_at[b];
                let (s, bias) = if n <= 16 {
                    // Every parameter sits in one register: two in-register permutes.
                    let idx = _mm512_loadu_si512(at.as_ptr().cast());
                    let idx1 = _mm512_add_epi32(idx, _mm512_set1_epi32(1));
                    (
                        _mm512_permutexvar_ps(idx, first16),
                        _mm512_permutexvar_ps(idx1, first16),
                    )
                } else {
                    for w in 0..16 {
                        scales[w] = wide[at[w] as usize];
                        biases[w] = wide[at[w] as usize + 1];
                    }
                    (
                        _mm512_loadu_ps(scales.as_ptr()),
                        _mm512_loadu_ps(biases.as_ptr()),
                    )
                };
                let words = _mm512_loadu_si512(codes.as_ptr().add(b * 16).cast());
                for j in 0..per {
                    let v = _mm512_and_si512(
                        _mm512_srlv_epi32(words, _mm512_set1_epi32((j * bits as usize) as i32)),
                        mask,
                    );
                    let f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, bias);
                    _mm512_storeu_ps(cols.as_mut_ptr().add(j * 16), f);
                }
            }
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

    fn prepare_query(&self, _block: usize, q: &mut [f32]) {
        if let Some((key_order, _)) = &self.orders {
            let element_order = q.to_vec();
            for (x, &e) in q.iter_mut().zip(key_order) {
                *x = element_order[e];
            }
        }
    }

    fn finish_output(&self, _block: usize, out: &mut [f32]) {
        if let Some((_, value_order)) = &self.orders {
            let tile_order = out.to_vec();
            for (&x, &e) in tile_order.iter().zip(value_order) {
                out[e] = x;
            }
        }
    }
}

/// Attends `q` `(rows, kv_heads * group, 1, head_dim)` over `planes`, each row over its
/// visible slots.
/// The tile source of `planes` at `isa`, for the decode and chunk reads alike.
pub(crate) fn source(planes: &AffinePlanes, isa: Isa) -> AffineSource<'_> {
    AffineSource::new(planes, isa)
}

pub(crate) fn attend(
    q: &Tensor,
    planes: &AffinePlanes,
    rows: &[RowSlots],
    s: &DecodeShape,
    scale: f32,
    isa: Isa,
) -> Result<Tensor, KvError> {
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let source = AffineSource::new(planes, isa);
    s.output(
        decode::attend_source(&qv, &source, rows, s, scale, isa),
        q.device(),
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::planes::Planes;
    use crate::read::decode::tests::{random_words, values};
    use candle_core::Device;

    /// Code `i` of a little-endian stream of `bits`-bit codes in u32 words (the layout of
    /// [`crate::codec::affine`]), read one bit at a time.
    pub(crate) fn code_bit_by_bit(words: &[u32], i: usize, bits: usize) -> usize {
        (0..bits)
            .map(|b| {
                let at = i * bits + b;
                (((words[at / 32] >> (at % 32)) & 1) as usize) << b
            })
            .sum()
    }

    /// Asserts `order` (the element each tile column holds) is a permutation of `0..dim`.
    pub(crate) fn assert_permutation(order: &[usize], dim: usize) {
        let mut seen = vec![false; dim];
        order.iter().for_each(|&e| seen[e] = true);
        assert!(
            order.len() == dim && seen.iter().all(|s| *s),
            "not a permutation"
        );
    }

    /// `unpack` has no per-level variant (it is inlined into each level's compiled decode);
    /// [`dequantized_tiles_match_scale_code_bias_at_every_level`] runs it at every level.
    #[test]
    fn unpack_matches_a_bit_by_bit_reader() {
        fn check<const BITS: usize>() {
            for dim in [32, 64, 256] {
                let words = random_words(BITS as u64, dim * BITS / 32);
                let mut out = vec![f32::NAN; dim];
                unpack::<BITS>(&words, &mut out);
                for (i, &got) in out.iter().enumerate() {
                    let want = code_bit_by_bit(&words, i, BITS) as f32;
                    assert_eq!(got, want, "{BITS} bits, dim {dim}, code {i}");
                }
            }
        }
        check::<2>();
        check::<3>();
        check::<4>();
        check::<5>();
        check::<6>();
        check::<8>();
    }

    /// The rows a tile source fills (512- or 256-bit lane-major or portable, as the level and
    /// the geometry choose), held to `scale · code + bias` from the stored codes and parameters.
    #[test]
    fn dequantized_tiles_match_scale_code_bias_at_every_level() {
        let (heads, slots, read) = (2, 6, 1..5);
        let mut wide_runs = 0;
        for isa in Isa::supported() {
            for bits in crate::codec::affine::AFFINE_BITS {
                for group in [32, 64, 128] {
                    // Wide enough for the 512-bit unpacker at 2, 4 and 8 bits, with one to 16
                    // groups per row (both ways of gathering the parameters).
                    for (d, dv) in [(128, 512), (256, 64), (64, 256)] {
                        if d % group != 0 || dv % group != 0 {
                            continue;
                        }
                        let mut planes = AffinePlanes::new(bits, group, 1, heads, d, dv);
                        planes.reserve(slots, usize::MAX).unwrap();
                        let tensor = |seed, dim| {
                            let x = values(seed, heads * slots * dim);
                            Tensor::from_vec(x, (1, heads, slots, dim), &Device::Cpu).unwrap()
                        };
                        planes
                            .write(0..1, 0, &tensor(10, d), &tensor(11, dv))
                            .unwrap();
                        let source = AffineSource::new(&planes, isa);
                        // Orders come with a vector unpacker, and only with it.
                        let orders = source.orders.as_ref();
                        wide_runs += orders.is_some() as usize;
                        let [(key_codes, key_params), (value_codes, value_params)] = planes.raw();
                        let planes_of = [
                            (d, key_codes, key_params, orders.map(|o| &o.0)),
                            (dv, value_codes, value_params, orders.map(|o| &o.1)),
                        ];
                        for block in 0..heads {
                            for (which, (dim, codes, params, order)) in planes_of.iter().enumerate()
                            {
                                let (dim, bits) = (*dim, bits as usize);
                                let what = format!(
                                    "{isa}, {bits} bits, group {group}, dims {d}/{dv}, \
                                     plane {which}, block {block}"
                                );
                                if let Some(order) = order {
                                    assert_permutation(order, dim);
                                }
                                let mut tile = vec![f32::NAN; read.len() * dim];
                                match which {
                                    0 => source.keys(block, read.clone(), &mut tile),
                                    _ => source.values(block, read.clone(), &mut tile),
                                }
                                for (t, slot) in read.clone().enumerate() {
                                    let at = block * planes.capacity() + slot;
                                    let words = &codes[at * dim * bits / 32..][..dim * bits / 32];
                                    let params = &params[at * 2 * dim / group..][..2 * dim / group];
                                    for c in 0..dim {
                                        let e = order.map_or(c, |o| o[c]);
                                        // Element e is code e % group of its group's stream.
                                        let g = e / group;
                                        let stream = &words[g * group * bits / 32..];
                                        let code = code_bit_by_bit(stream, e % group, bits) as f64;
                                        let (s, b) =
                                            (params[2 * g].to_f64(), params[2 * g + 1].to_f64());
                                        let want = s * code + b;
                                        let got = tile[t * dim + c] as f64;
                                        assert!(
                                            (got - want).abs() <= 1e-6 * (s * code).abs() + 1e-6,
                                            "{what}, slot {slot}, column {c}: {got} vs {want}"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        // A vector unpacker (512-bit, or 256-bit at AVX2) ran wherever this CPU has one.
        assert_eq!(wide_runs > 0, Isa::detected().avx2());
    }
}
