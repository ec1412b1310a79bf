//! TurboQuant storage planes: per position and head, the f16 norm of the vector and the
//! `bits`-bit Lloyd–Max codes of its normalized, rotated coordinates (codes packed in u32
//! words with the affine layout: element i at bit i·bits). Keys and values have their own
//! bit widths, rotations (fixed seeds) and codebooks. Inputs are rounded to bf16 first, so
//! quantizing on append and converting bf16 storage later store the same codes.

use super::{
    bf16_values, check_span, check_state, copy_slots, from_bytes, same_kind, to_bytes,
    ChunkGeometry, PlaneGeometry, Planes, PlanesState, RowSlots,
};
use crate::codec::affine::put_code;
use crate::codec::pairs::{PairBook, PAIR_BITS};
use crate::codec::prep::ChannelPrep;
use crate::codec::turbo::{Codebook, Rotation};
use crate::read::decode::DecodeShape;
use crate::read::{chunk, turbo_tiles};
use crate::{Codec, Isa, KvError, TurboPrep, MAX_CAPACITY};
use candle_core::{Device, Tensor};
use half::f16;
use std::any::Any;
use std::ops::Range;

/// Rotation seeds: fixed, so a saved cache decodes anywhere.
const KEY_SEED: u64 = 0x7e55_e7a0_0000_0001;
const VALUE_SEED: u64 = 0x7e55_e7a0_0000_0002;

/// One plane (keys or values) of `rows × heads × capacity` vectors of `dim` elements.
#[derive(Debug, Clone)]
pub(crate) struct TurboPlane {
    dim: usize,
    bits: u8,
    words: usize,
    codes: Vec<u32>,
    norms: Vec<f16>,
    rotation: Rotation,
    book: Codebook,
    /// The pair codebook the coordinates are coded with instead of `book`, two at a time,
    /// where asked for and the width has one ([`PAIR_BITS`]).
    pairs: Option<PairBook>,
    /// What a code decodes to, padded to 256 entries so that a code masked to 8 bits indexes
    /// it without a bounds check: the levels, or the pair points' first coordinates, and
    /// (pairs only) their second coordinates.
    table: [[f32; 256]; 2],
}

/// `values` padded with zeros to 256 entries.
fn padded(values: &[f32]) -> [f32; 256] {
    let mut t = [0f32; 256];
    t[..values.len().min(256)].copy_from_slice(&values[..values.len().min(256)]);
    t
}

/// The codes of a plane row in storage order: a little-endian bit stream over its words
/// (code i at bit i·width, as `put_code` writes them), read without per-code address
/// arithmetic.
struct CodeStream<'a> {
    words: std::slice::Iter<'a, u32>,
    held: u64,
    count: u32,
}

impl<'a> CodeStream<'a> {
    fn new(words: &'a [u32]) -> Self {
        CodeStream {
            words: words.iter(),
            held: 0,
            count: 0,
        }
    }

    /// The next `width`-bit code (`width` ≤ 8).
    #[inline(always)]
    fn next(&mut self, width: u32) -> usize {
        if self.count < width {
            self.held |= (self.words.next().copied().unwrap_or(0) as u64) << self.count;
            self.count += 32;
        }
        let code = (self.held & ((1u64 << width) - 1)) as usize;
        self.held >>= width;
        self.count -= width;
        code & 0xff
    }
}

impl TurboPlane {
    fn new(dim: usize, bits: u8, seed: u64, pairs: bool) -> Self {
        let book = Codebook::shared(dim, bits);
        let pairs = (pairs && PAIR_BITS.contains(&bits)).then(|| PairBook::shared(dim, bits));
        let table = match &pairs {
            Some(p) => [padded(p.xs()), padded(p.ys())],
            None => [padded(&book.levels), [0.0; 256]],
        };
        TurboPlane {
            dim,
            bits,
            words: (dim * bits as usize).div_ceil(32),
            codes: Vec::new(),
            norms: Vec::new(),
            rotation: Rotation::new(dim, seed),
            book,
            pairs,
            table,
        }
    }

    fn grow(&mut self, blocks: usize, old_cap: usize, capacity: usize) {
        let mut codes = vec![0u32; blocks * capacity * self.words];
        let mut norms = vec![f16::ZERO; blocks * capacity];
        for b in 0..blocks {
            let w = old_cap * self.words;
            codes[b * capacity * self.words..][..w].copy_from_slice(&self.codes[b * w..][..w]);
            norms[b * capacity..][..old_cap].copy_from_slice(&self.norms[b * old_cap..][..old_cap]);
        }
        self.codes = codes;
        self.norms = norms;
    }

    /// Encodes `x` into slot `at` (absolute: block · capacity + slot).
    fn write(&mut self, at: usize, x: &[f32]) {
        let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
        let mut u: Vec<f32> = if norm > 0.0 {
            x.iter().map(|v| v / norm).collect()
        } else {
            vec![0.0; x.len()]
        };
        self.rotation.forward(&mut u);
        let words = &mut self.codes[at * self.words..(at + 1) * self.words];
        words.iter_mut().for_each(|w| *w = 0);
        match &self.pairs {
            // Pair p's code sits where coordinates 2p and 2p + 1 would have theirs.
            Some(book) => {
                for (p, xy) in u.chunks_exact(2).enumerate() {
                    put_code(words, p, 2 * self.bits, book.encode(xy[0], xy[1]) as u32);
                }
            }
            None => {
                for (i, &c) in u.iter().enumerate() {
                    put_code(words, i, self.bits, self.book.encode(c) as u32);
                }
            }
        }
        self.norms[at] = f16::from_f32(norm);
    }

    /// The stored vector of slot `at` in the rotated space: norm × codebook levels (or pair
    /// points).
    #[inline]
    pub fn rotated(&self, at: usize, out: &mut [f32]) {
        let mut codes = CodeStream::new(&self.codes[at * self.words..(at + 1) * self.words]);
        let norm = self.norms[at].to_f32();
        let [first, second] = &self.table;
        let width = self.bits as u32;
        if self.pairs.is_some() {
            for xy in out.chunks_exact_mut(2) {
                let c = codes.next(2 * width);
                xy[0] = norm * first[c];
                xy[1] = norm * second[c];
            }
        } else {
            for o in out.iter_mut() {
                *o = norm * first[codes.next(width)];
            }
        }
    }

    /// The stored vector of slot `at` in the original space.
    fn read(&self, at: usize, out: &mut [f32]) {
        self.rotated(at, out);
        self.rotation.inverse(out);
    }

    pub fn rotation(&self) -> &Rotation {
        &self.rotation
    }

    pub fn bits(&self) -> u8 {
        self.bits
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The scalar codebook's levels (unused where the plane codes pairs).
    pub fn levels(&self) -> &[f32] {
        &self.book.levels
    }

    /// The pair codebook, where the plane codes pairs.
    pub fn pairs(&self) -> Option<&PairBook> {
        self.pairs.as_ref()
    }

    /// Packed codes and norm of slot `at`.
    #[inline(always)]
    pub fn slot(&self, at: usize) -> (&[u32], f32) {
        (
            &self.codes[at * self.words..(at + 1) * self.words],
            self.norms[at].to_f32(),
        )
    }
}

/// What a device backend needs to encode and read turbo planes as these do: per plane the
/// rotation's signs and the codebook, and the keys' fitted preparation.
#[derive(Debug, Clone)]
pub struct TurboTables {
    /// Keys', then values': signs (`dim`), levels and thresholds (ascending).
    pub signs: [Vec<f32>; 2],
    pub levels: [Vec<f32>; 2],
    pub thresholds: [Vec<f32>; 2],
    /// The keys' mean and scales per (row, KV head) block (`rows × heads × head_dim`,
    /// block = row · heads + head), where fitted.
    pub key_mean: Option<Vec<f32>>,
    pub key_scale: Option<Vec<f32>>,
}

/// TurboQuant keys and values of one layer.
///
/// State buffers: `[key codes (u32), key norms (f16), value codes, value norms, key mean
/// (f32, empty if none), key scales (f32, empty if none)]`.
#[derive(Debug, Clone)]
pub struct TurboPlanes {
    rows: usize,
    heads: usize,
    capacity: usize,
    /// What keys are centred on and scaled by before encoding, per row (see
    /// [`ChannelPrep`]). Fused reads skip the mean: `q · m` is the same for every position
    /// of a row's head, and softmax ignores a constant added to all of a query's scores.
    /// (Values are encoded as they come: the same preparation did not pay for them; see
    /// BENCHMARKS.md.)
    key_prep: ChannelPrep,
    keys: TurboPlane,
    values: TurboPlane,
    /// Whether the scheme asked for pair codebooks (`:pairs`; only widths in [`PAIR_BITS`]
    /// have them, so a plane of another width codes scalars all the same).
    pairs: bool,
}

impl TurboPlanes {
    pub fn new(
        kbits: u8,
        vbits: u8,
        rows: usize,
        heads: usize,
        head_dim: usize,
        value_dim: usize,
    ) -> Self {
        TurboPlanes {
            rows,
            heads,
            capacity: 0,
            key_prep: ChannelPrep::default(),
            keys: TurboPlane::new(head_dim, kbits, KEY_SEED, false),
            values: TurboPlane::new(value_dim, vbits, VALUE_SEED, false),
            pairs: false,
        }
    }

    /// These (empty) planes with the key preparation `prep` asks for, as the identity until
    /// a row's is fitted or adopted.
    pub fn with_prep(mut self, prep: TurboPrep) -> Self {
        self.key_prep = ChannelPrep::identity(
            self.rows * self.heads,
            self.keys.dim,
            prep.key_mean,
            prep.key_scale,
        );
        if prep.pairs != self.pairs {
            let (k, v) = (&self.keys, &self.values);
            self.keys = TurboPlane::new(k.dim, k.bits, KEY_SEED, prep.pairs);
            self.values = TurboPlane::new(v.dim, v.bits, VALUE_SEED, prep.pairs);
            self.pairs = prep.pairs;
        }
        self
    }

    pub fn bits(&self) -> (u8, u8) {
        (self.keys.bits, self.values.bits)
    }

    pub(crate) fn key_prep(&self) -> &ChannelPrep {
        &self.key_prep
    }

    /// The preparation these planes were fitted with.
    pub fn prep(&self) -> TurboPrep {
        TurboPrep {
            key_mean: self.key_prep.centered(),
            key_scale: self.key_prep.scaled(),
            pairs: self.pairs,
        }
    }

    /// The rotations, codebooks and key preparation, for a device backend.
    pub fn tables(&self) -> TurboTables {
        let (mean, scale) = self.key_prep.tables();
        let (k, v) = (&self.keys, &self.values);
        TurboTables {
            signs: [k.rotation.signs().to_vec(), v.rotation.signs().to_vec()],
            levels: [k.book.levels.clone(), v.book.levels.clone()],
            thresholds: [k.book.thresholds.clone(), v.book.thresholds.clone()],
            key_mean: mean.map(<[f32]>::to_vec),
            key_scale: scale.map(<[f32]>::to_vec),
        }
    }

    /// `(heads, head_dim, value_dim)`.
    pub fn geometry3(&self) -> (usize, usize, usize) {
        (self.heads, self.keys.dim, self.values.dim)
    }

    pub(crate) fn planes(&self) -> (&TurboPlane, &TurboPlane) {
        (&self.keys, &self.values)
    }

    /// What a later read of `x` `(1, heads, n, dim)` returns once stored in row `row`:
    /// encoded and decoded with that row's preparation.
    pub fn as_stored(&self, row: usize, x: &Tensor, keys: bool) -> Result<Tensor, KvError> {
        let identity = ChannelPrep::default();
        let (src, prep) = if keys {
            (&self.keys, &self.key_prep)
        } else {
            (&self.values, &identity)
        };
        let mut plane = TurboPlane {
            codes: vec![0; src.words],
            norms: vec![f16::ZERO],
            ..src.clone()
        };
        super::as_stored_by(x, row, self.heads, prep, |prepared, out| {
            plane.write(0, prepared);
            plane.read(0, out);
        })
    }

    /// The key preparation tables an adoption writes into: sized for every row.
    fn prep_tables(&mut self, prep: TurboPrep) {
        if self.key_prep == ChannelPrep::default() {
            self.key_prep = ChannelPrep::identity(
                self.rows * self.heads,
                self.keys.dim,
                prep.key_mean,
                prep.key_scale,
            );
        }
    }
}

impl Planes for TurboPlanes {
    fn codec(&self) -> Codec {
        Codec::Turbo {
            kbits: self.keys.bits,
            vbits: self.values.bits,
            prep: self.prep(),
        }
    }

    fn geometry(&self) -> PlaneGeometry {
        PlaneGeometry {
            rows: self.rows,
            heads: self.heads,
            head_dim: self.keys.dim,
            value_dim: self.values.dim,
        }
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn empty(&self, rows: usize) -> Result<Box<dyn Planes>, KvError> {
        let empty = |p: &TurboPlane| TurboPlane {
            codes: Vec::new(),
            norms: Vec::new(),
            ..p.clone()
        };
        let prep = self.prep();
        Ok(Box::new(TurboPlanes {
            rows,
            heads: self.heads,
            capacity: 0,
            key_prep: ChannelPrep::identity(
                rows * self.heads,
                self.keys.dim,
                prep.key_mean,
                prep.key_scale,
            ),
            keys: empty(&self.keys),
            values: empty(&self.values),
            pairs: self.pairs,
        }))
    }

    fn resizes_rows_in_place(&self) -> bool {
        true
    }

    fn resize_rows(&mut self, keep: &[usize], added: usize) -> Result<(), KvError> {
        super::check_keep(keep, self.rows)?;
        let per_row = self.heads * self.capacity;
        for p in [&mut self.keys, &mut self.values] {
            super::resize_rows(&mut p.codes, per_row * p.words, keep, added, 0);
            super::resize_rows(&mut p.norms, per_row, keep, added, f16::ZERO);
        }
        self.key_prep.resize_rows(self.heads, keep, added);
        self.rows = keep.len() + added;
        Ok(())
    }

    fn reserve(&mut self, slots: usize, limit: usize) -> Result<(), KvError> {
        if slots <= self.capacity {
            return Ok(());
        }
        let capacity = crate::grown_capacity(slots, limit);
        let blocks = self.rows * self.heads;
        self.keys.grow(blocks, self.capacity, capacity);
        self.values.grow(blocks, self.capacity, capacity);
        self.capacity = capacity;
        Ok(())
    }

    fn write(
        &mut self,
        rows: Range<usize>,
        slot: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), KvError> {
        let n = k.dims4()?.2;
        check_span(self, &rows, slot, n)?;
        let (kx, vx) = (bf16_values(k)?, bf16_values(v)?);
        let (dk, dv) = (self.keys.dim, self.values.dim);
        let mut pk = vec![0f32; dk];
        let first = rows.start * self.heads;
        for local in 0..rows.len() * self.heads {
            let block = first + local;
            for i in 0..n {
                let (at, src) = (block * self.capacity + slot + i, local * n + i);
                self.key_prep.encode(block, &kx[src * dk..][..dk], &mut pk);
                self.keys.write(at, &pk);
                self.values.write(at, &vx[src * dv..][..dv]);
            }
        }
        Ok(())
    }

    fn read(
        &self,
        rows: Range<usize>,
        slot: usize,
        len: usize,
    ) -> Result<(Tensor, Tensor), KvError> {
        check_span(self, &rows, slot, len)?;
        let first = rows.start * self.heads;
        let blocks = rows.len() * self.heads;
        let plane = |p: &TurboPlane, prep: Option<&ChannelPrep>| -> Result<Tensor, KvError> {
            let mut out = vec![0f32; blocks * len * p.dim];
            for local in 0..blocks {
                let block = first + local;
                for i in 0..len {
                    let at = local * len + i;
                    let row = &mut out[at * p.dim..(at + 1) * p.dim];
                    p.read(block * self.capacity + slot + i, row);
                    if let Some(prep) = prep {
                        prep.decode(block, row);
                    }
                }
            }
            Ok(Tensor::from_vec(
                out,
                (rows.len(), self.heads, len, p.dim),
                &Device::Cpu,
            )?)
        };
        Ok((
            plane(&self.keys, Some(&self.key_prep))?,
            plane(&self.values, None)?,
        ))
    }

    fn adopt_row(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        dst_row: usize,
    ) -> Result<(), KvError> {
        let src = same_kind::<TurboPlanes>(src, self)?;
        super::check_adopt(src_row, src.rows, dst_row, self.rows)?;
        self.prep_tables(src.prep());
        self.key_prep
            .adopt(&src.key_prep, src_row, dst_row, self.heads);
        Ok(())
    }

    fn copy_from(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        src_slot: usize,
        dst_row: usize,
        dst_slot: usize,
        len: usize,
    ) -> Result<(), KvError> {
        let src = same_kind::<TurboPlanes>(src, self)?;
        check_span(src, &(src_row..src_row + 1), src_slot, len)?;
        check_span(self, &(dst_row..dst_row + 1), dst_slot, len)?;
        for (dst, from) in [(&mut self.keys, &src.keys), (&mut self.values, &src.values)] {
            let w = dst.words;
            for head in 0..self.heads {
                let d0 = (dst_row * self.heads + head) * self.capacity + dst_slot;
                let s0 = (src_row * self.heads + head) * src.capacity + src_slot;
                copy_slots(&mut dst.codes, &from.codes, w, s0, d0, len);
                copy_slots(&mut dst.norms, &from.norms, 1, s0, d0, len);
            }
        }
        Ok(())
    }

    fn fit_key_prep(
        &mut self,
        k: &Tensor,
        live: &[Range<usize>],
        prep: TurboPrep,
        queries: Option<&[f32]>,
    ) -> Result<(), KvError> {
        let n = k.dims4()?.2;
        let x = bf16_values(k)?;
        self.key_prep = ChannelPrep::fit(
            &x,
            self.heads,
            n,
            self.keys.dim,
            live,
            prep.key_mean,
            prep.key_scale,
            queries.filter(|q| q.len() == live.len() * self.heads * self.keys.dim),
        );
        Ok(())
    }

    fn decode(
        &self,
        q: &Tensor,
        rows: &[RowSlots],
        scale: f32,
        isa: Isa,
    ) -> Result<Option<Tensor>, KvError> {
        let shape = DecodeShape::of(q, self.geometry(), self.capacity)?;
        Ok(Some(turbo_tiles::attend(
            &q.contiguous()?,
            self,
            rows,
            &shape,
            scale,
            isa,
        )?))
    }

    fn chunk(
        &self,
        q: &Tensor,
        geometry: &ChunkGeometry,
        scale: f32,
        isa: Isa,
    ) -> Result<Option<Tensor>, KvError> {
        Ok(Some(chunk::attend_source(
            &q.contiguous()?,
            &turbo_tiles::source(self, isa),
            geometry,
            scale,
            isa,
        )?))
    }

    fn allocated_bytes(&self) -> usize {
        (self.keys.codes.len() + self.values.codes.len()) * 4
            + (self.keys.norms.len() + self.values.norms.len()) * 2
            + self.key_prep.bytes()
    }

    /// Codes plus an f16 norm per vector.
    fn bytes_per_position(&self) -> usize {
        self.heads * ((self.keys.words + self.values.words) * 4 + 2 * 2)
    }

    fn state(&self) -> Result<PlanesState, KvError> {
        let (mean, scale) = self.key_prep.tables();
        Ok(PlanesState {
            codec: self.codec(),
            geometry: self.geometry(),
            capacity: self.capacity,
            buffers: vec![
                to_bytes(&self.keys.codes),
                to_bytes(&self.keys.norms),
                to_bytes(&self.values.codes),
                to_bytes(&self.values.norms),
                mean.map_or(Vec::new(), to_bytes),
                scale.map_or(Vec::new(), to_bytes),
            ],
        })
    }

    fn restore(&mut self, state: &PlanesState) -> Result<(), KvError> {
        check_state(self, state, 6)?;
        let blocks = (self.rows * self.heads)
            .checked_mul(state.capacity)
            .filter(|_| state.capacity <= MAX_CAPACITY)
            .ok_or_else(|| KvError::BadState(format!("a capacity of {} slots", state.capacity)))?;
        let mut planes = [self.keys.clone(), self.values.clone()];
        for (i, p) in planes.iter_mut().enumerate() {
            p.codes = from_bytes(&state.buffers[2 * i], "turbo codes")?;
            p.norms = from_bytes(&state.buffers[2 * i + 1], "turbo norms")?;
            if p.codes.len() != blocks * p.words || p.norms.len() != blocks {
                return Err(KvError::BadState(format!(
                    "turbo planes of capacity {}: {} code words and {} norms",
                    state.capacity,
                    p.codes.len(),
                    p.norms.len()
                )));
            }
        }
        let prep = self.prep();
        let mut key_prep = ChannelPrep::identity(
            self.rows * self.heads,
            self.keys.dim,
            prep.key_mean,
            prep.key_scale,
        );
        key_prep
            .load(
                from_bytes(&state.buffers[4], "turbo key mean")?,
                from_bytes(&state.buffers[5], "turbo key scales")?,
            )
            .map_err(KvError::BadState)?;
        let [keys, values] = planes;
        (self.keys, self.values, self.capacity, self.key_prep) =
            (keys, values, state.capacity, key_prep);
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
