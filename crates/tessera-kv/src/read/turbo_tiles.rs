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
        // SAFETY (all): `wide` is set only at a level capped to the CPU's that has AVX-512
        // (AVX2 for the `…8` kernels), and only for the geometries each kernel takes.
        #[cfg(target_arch = "x86_64")]
        match self.wide[which] {
            Some(x86::Wide::LaneMajor) => {
                return unsafe { x86::decode_rows(plane, at, slots, out) }
            }
            Some(x86::Wide::ByteWindow) => {
                return unsafe { x86::decode_rows_any(plane, at, slots, out) }
            }
            Some(x86::Wide::Pairs) => {
                if let Some(book) = plane.pairs() {
                    return unsafe { x86::decode_pairs(plane, book, at, slots, out) };
                }
            }
            Some(x86::Wide::LaneMajor8) => {
                return unsafe { x86::decode_rows8(plane, at, slots, out) }
            }
            Some(x86::Wide::ByteWindow8) => {
                return unsafe { x86::decode_rows_any8(plane, at, slots, out) }
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
///
/// At AVX2 the same two schemes run 8 lanes wide (`…8`) for codebooks of up to 16 levels
/// (2 to 4 bits): 8 words per load, or 8 codes from a `bits`-byte window, looked up by two
/// in-register permutes and a blend. Wider codebooks and pair codebooks keep the scalar
/// decoding there.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use crate::codec::pairs::PairBook;
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
        /// Pair codebooks: the byte window's extraction of `2·bits`-bit pair codes, both
        /// coordinates looked up and interleaved back into element order.
        Pairs,
        /// `LaneMajor` at AVX2: blocks of 8 words.
        LaneMajor8,
        /// `ByteWindow` at AVX2: 8 codes a step.
        ByteWindow8,
    }

    impl Wide {
        /// Words per lane-major block, where the decoding permutes the elements.
        pub fn lanes(self) -> Option<usize> {
            match self {
                Wide::LaneMajor => Some(16),
                Wide::LaneMajor8 => Some(8),
                _ => None,
            }
        }
    }

    /// The vector decoding of `plane` at `isa` (capped to the CPU's by the caller), if its
    /// geometry has one.
    pub fn available(plane: &TurboPlane, isa: Isa) -> Option<Wide> {
        if !isa.avx512() {
            if !isa.avx2() || plane.pairs().is_some() {
                return None;
            }
            let (dim, bits) = (plane.dim(), plane.bits() as usize);
            if matches!(bits, 2 | 4) && (dim * bits) % 256 == 0 {
                return Some(Wide::LaneMajor8);
            }
            // Past 16 levels the lookup is a gather, slower than the scalar decoding on
            // AMD's Zen 1 (turbo:8 at depth 16384: 10.8 ms a read against 7.1).
            return (dim % 8 == 0 && bits <= 4).then_some(Wide::ByteWindow8);
        }
        if plane.pairs().is_some() {
            return (plane.dim() % 32 == 0).then_some(Wide::Pairs);
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

    /// Entries `c` (8 lanes) of a codebook of `levels` ≤ 16 values held in `t`: one
    /// permute, or two and a blend on bit 3.
    ///
    /// # Safety
    /// The CPU must have AVX2; every `c` is below `levels`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn lookup8(levels: usize, c: __m256i, t: &[__m256; 2]) -> __m256 {
        let lo = _mm256_permutevar8x32_ps(t[0], c);
        if levels <= 8 {
            return lo;
        }
        let hi = _mm256_permutevar8x32_ps(t[1], c);
        // Bit 3 of each code to its lane's sign bit picks the upper half.
        _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)))
    }

    /// The codebook of `plane` (at most 16 levels: [`available`]) in two registers.
    ///
    /// # Safety
    /// The CPU must have AVX.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn table8(plane: &TurboPlane) -> [__m256; 2] {
        let levels = plane.levels();
        assert!(levels.len() <= 16, "a {}-level codebook", levels.len());
        let mut table = [0f32; 16];
        table[..levels.len()].copy_from_slice(levels);
        [
            _mm256_loadu_ps(table.as_ptr()),
            _mm256_loadu_ps(table.as_ptr().add(8)),
        ]
    }

    /// # Safety
    /// The CPU must have AVX2 and [`available`] must give `LaneMajor8` for `plane`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn decode_rows8(
        plane: &TurboPlane,
        at: usize,
        slots: Range<usize>,
        out: &mut [f32],
    ) {
        let (dim, bits) = (plane.dim(), plane.bits() as usize);
        let per = 32 / bits;
        let levels = plane.levels().len();
        let t = table8(plane);
        let mask = _mm256_set1_epi32((1 << bits) - 1);
        for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
            let (codes, norm) = plane.slot(at + slot);
            assert!(codes.len() * 32 == dim * bits);
            let norm = _mm256_set1_ps(norm);
            for (b, cols) in row.chunks_exact_mut(8 * per).enumerate() {
                let words = _mm256_loadu_si256(codes.as_ptr().add(b * 8).cast());
                for j in 0..per {
                    let c = _mm256_and_si256(
                        _mm256_srlv_epi32(words, _mm256_set1_epi32((j * bits) as i32)),
                        mask,
                    );
                    let v = _mm256_mul_ps(lookup8(levels, c, &t), norm);
                    _mm256_storeu_ps(cols.as_mut_ptr().add(j * 8), v);
                }
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and [`available`] must give `ByteWindow8` for `plane`.
    #[target_feature(enable = "avx2")]
    pub unsafe fn decode_rows_any8(
        plane: &TurboPlane,
        at: usize,
        slots: Range<usize>,
        out: &mut [f32],
    ) {
        let (dim, bits) = (plane.dim(), plane.bits() as usize);
        let levels = plane.levels().len();
        let t = table8(plane);
        // Code j of a window starts at bit j·bits, in byte j·bits/8: that byte and the
        // next go to the low half of 32-bit lane j (both 128-bit lanes hold the window).
        let mut lane_shuffle = [-1i8; 32];
        let mut shifts = [0i32; 8];
        for (j, shift) in shifts.iter_mut().enumerate() {
            let byte = (j * bits) / 8;
            let lane = 16 * (j / 4) + 4 * (j % 4);
            lane_shuffle[lane] = byte as i8;
            lane_shuffle[lane + 1] = (byte + 1) as i8;
            *shift = ((j * bits) % 8) as i32;
        }
        let shuffle = _mm256_loadu_si256(lane_shuffle.as_ptr().cast());
        let shifts = _mm256_loadu_si256(shifts.as_ptr().cast());
        let mask = _mm256_set1_epi32((1 << bits) - 1);
        for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
            let (codes, norm) = plane.slot(at + slot);
            let len = codes.len() * 4;
            assert!(len * 8 >= dim * bits);
            let bytes = codes.as_ptr().cast::<u8>();
            let norm = _mm256_set1_ps(norm);
            for (w, cols) in row.chunks_exact_mut(8).enumerate() {
                // The window is `bits` ≤ 8 bytes; an 8-byte load where the row has them,
                // a copy at its end.
                let start = w * bits;
                let x = if start + 8 <= len {
                    _mm_loadl_epi64(bytes.add(start).cast())
                } else {
                    let mut tail = [0u8; 8];
                    tail[..len - start].copy_from_slice(&std::slice::from_raw_parts(
                        bytes.add(start),
                        len - start,
                    ));
                    _mm_loadl_epi64(tail.as_ptr().cast())
                };
                let x = _mm256_broadcastsi128_si256(x);
                let c = _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_shuffle_epi8(x, shuffle), shifts),
                    mask,
                );
                let v = _mm256_mul_ps(lookup8(levels, c, &t), norm);
                _mm256_storeu_ps(cols.as_mut_ptr(), v);
            }
        }
    }

    /// Entries `c` of a table of `points` (16, 64 or 256) values, held in `t` up to 64.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn lookup(points: usize, c: __m512i, t: &[__m512; 4], table: &[f32; 256]) -> __m512 {
        match points {
            0..=16 => _mm512_permutexvar_ps(c, t[0]),
            17..=64 => {
                let lo = _mm512_permutex2var_ps(t[0], c, t[1]);
                let hi = _mm512_permutex2var_ps(t[2], c, t[3]);
                let upper = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
                _mm512_mask_blend_ps(upper, lo, hi)
            }
            _ => _mm512_i32gather_ps::<4>(c, table.as_ptr()),
        }
    }

    /// # Safety
    /// The CPU must have AVX-512 F/BW/VL, [`available`] must give `Pairs` for `plane`, and
    /// `book` must be its pair codebook.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub unsafe fn decode_pairs(
        plane: &TurboPlane,
        book: &PairBook,
        at: usize,
        slots: Range<usize>,
        out: &mut [f32],
    ) {
        // 16 pair codes of `width` (4, 6 or 8) bits per step: 2·width ≤ 16 bytes.
        let (dim, width) = (plane.dim(), 2 * plane.bits() as usize);
        let points = book.xs().len();
        let (mut xs, mut ys) = ([0f32; 256], [0f32; 256]);
        xs[..points].copy_from_slice(book.xs());
        ys[..points].copy_from_slice(book.ys());
        let tx: [__m512; 4] = std::array::from_fn(|i| _mm512_loadu_ps(xs.as_ptr().add(16 * i)));
        let ty: [__m512; 4] = std::array::from_fn(|i| _mm512_loadu_ps(ys.as_ptr().add(16 * i)));
        let mut lane_shuffle = [-1i8; 64];
        let mut shifts = [0i32; 16];
        for (j, shift) in shifts.iter_mut().enumerate() {
            let byte = (j * width) / 8;
            lane_shuffle[4 * j] = byte as i8;
            lane_shuffle[4 * j + 1] = (byte + 1).min(15) as i8;
            *shift = ((j * width) % 8) as i32;
        }
        let shuffle = _mm512_loadu_si512(lane_shuffle.as_ptr().cast());
        let shifts = _mm512_loadu_si512(shifts.as_ptr().cast());
        let mask = _mm512_set1_epi32((1 << width) - 1);
        let window: __mmask16 = ((1u32 << (2 * width)) - 1) as __mmask16;
        // Interleaving: element 2i is pair i's x (lanes 0–15 of the first operand), 2i + 1
        // its y (16–31: the second operand's).
        let (mut low, mut high) = ([0i32; 16], [0i32; 16]);
        for i in 0..16 {
            let (pair, y) = (i as i32 / 2, 16 * (i as i32 % 2));
            (low[i], high[i]) = (pair + y, 8 + pair + y);
        }
        let low = _mm512_loadu_si512(low.as_ptr().cast());
        let high = _mm512_loadu_si512(high.as_ptr().cast());
        for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
            let (codes, norm) = plane.slot(at + slot);
            assert!(codes.len() * 32 >= dim * width / 2);
            let bytes = codes.as_ptr().cast::<i8>();
            let norm = _mm512_set1_ps(norm);
            for (g, cols) in row.chunks_exact_mut(32).enumerate() {
                let x = _mm_maskz_loadu_epi8(window, bytes.add(g * 2 * width));
                let x = _mm512_broadcast_i32x4(x);
                let c = _mm512_and_si512(
                    _mm512_srlv_epi32(_mm512_shuffle_epi8(x, shuffle), shifts),
                    mask,
                );
                let (px, py) = (lookup(points, c, &tx, &xs), lookup(points, c, &ty, &ys));
                let first = _mm512_mul_ps(_mm512_permutex2var_ps(px, low, py), norm);
                let second = _mm512_mul_ps(_mm512_permutex2var_ps(px, high, py), norm);
                _mm512_storeu_ps(cols.as_mut_ptr(), first);
                _mm512_storeu_ps(cols.as_mut_ptr().add(16), second);
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
        let order = |plane: &TurboPlane, wide: Option<x86::Wide>| {
            wide.and_then(x86::Wide::lanes).map(|lanes| {
                crate::read::affine_tiles::x86::lane_major_order(plane.dim(), plane.bits(), lanes)
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
    use crate::TurboPrep;
    use candle_core::Device;

    /// The rows a tile source fills (portable `rotated`, 512- or 256-bit lane-major or
    /// byte-window, as the level and the geometry choose), held to `norm · levels[code]` (or the pair
    /// point's coordinate) with the codes read bit by bit from the stored words.
    #[test]
    fn decoded_rows_match_norm_times_level_at_every_level() {
        let (heads, slots, read) = (2, 6, 1..5);
        #[cfg(target_arch = "x86_64")]
        let mut kinds = std::collections::HashSet::new();
        for isa in Isa::supported() {
            for (bits, pairs) in (2..=8u8)
                .map(|b| (b, false))
                .chain((2..=4).map(|b| (b, true)))
            {
                // 256 at 2 and 4 bits and 128 at 4 bits are lane-major (128 at 2 bits too at
                // AVX2); 8 is portable at AVX-512 and a byte window shorter than a load at AVX2.
                for (d, dv) in [(256, 128), (64, 8)] {
                    let prep = TurboPrep {
                        pairs,
                        ..TurboPrep::ALL
                    };
                    let mut planes = TurboPlanes::new(bits, bits, 1, heads, d, dv).with_prep(prep);
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
                            assert_eq!(plane.pairs().is_some(), pairs);
                            let what = format!(
                                "{isa}, {bits} bits, pairs {pairs}, dim {dim}, block {block}"
                            );
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
                                    let level = match plane.pairs() {
                                        Some(book) => {
                                            let code =
                                                code_bit_by_bit(words, e / 2, 2 * bits as usize);
                                            let (x, y) = book.decode(code as u16);
                                            [x, y][e % 2]
                                        }
                                        None => {
                                            plane.levels()[code_bit_by_bit(words, e, bits as usize)]
                                        }
                                    };
                                    let want = norm as f64 * level as f64;
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
        // The three 512-bit decodings and the two AVX2 ones ran wherever this CPU has them.
        #[cfg(target_arch = "x86_64")]
        {
            let top = Isa::detected();
            let want = if top.avx512() {
                5
            } else if top.avx2() {
                2
            } else {
                0
            };
            assert_eq!(kinds.len(), want);
        }
    }
}
