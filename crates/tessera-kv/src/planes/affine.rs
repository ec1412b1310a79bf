//! Affine-quantized storage planes: per position and head, `bits`-bit codes packed in u32
//! words (layout in [`crate::codec::affine`]) plus an f16 scale and bias per group of `group`
//! elements. Positions are quantized once, when written, and never requantized.
//!
//! Inputs are rounded to bf16 before quantizing, so a position quantized on append and one
//! converted later from bf16 storage hold the same codes bit for bit (given its row's key
//! means).
//!
//! Keys are stored centred: each (row, KV head) has a per-channel mean, fitted at the
//! bf16-first conversion on the keys that row holds then ([`Planes::fit_key_prep`]; zero
//! until fitted), subtracted before quantizing and added back by [`Planes::read`]. The
//! fused reads score the centred keys as they are: a query's scores all move by the same
//! `q · mean`, which softmax ignores. Why: a model whose keys carry a large per-channel
//! offset (Qwen 2.5's key bias, rotated slowly by RoPE's low frequencies) spends each
//! group's range on it, and 4-bit codes then lose the rest of the key (measured: KL 6.6
//! against bf16 on Qwen2.5-Coder-1.5B uncentred, 0.026 centred; BENCHMARKS.md).
//!
//! State buffers: `[key codes (u32), key params (f16 scale, bias per group), value codes,
//! value params, key means (f32, (rows, heads, head_dim))]`, each `(rows, heads, capacity,
//! …)`; a state of four buffers (written before keys were centred) restores with zero
//! means.

use super::{
    bf16_values, check_span, check_state, copy_slots, from_bytes, same_kind, to_bytes,
    ChunkGeometry, PlaneGeometry, Planes, PlanesState, RowSlots,
};
use crate::codec::affine::{dequantize_group, quantize_group, GroupParams};
use crate::codec::prep::ChannelPrep;
use crate::read::affine_tiles;
use crate::read::chunk;
use crate::read::decode::DecodeShape;
use crate::{Codec, Isa, KvError, TurboPrep, MAX_CAPACITY};
use candle_core::{Device, Tensor};
use half::f16;
use std::any::Any;
use std::ops::Range;

/// One plane (keys or values) of `rows × heads × capacity` positions of `dim` elements.
#[derive(Debug, Clone)]
struct Plane {
    dim: usize,
    words: usize,  // u32 words per position
    groups: usize, // groups per position
    codes: Vec<u32>,
    params: Vec<f16>, // (scale, bias) per group
}

impl Plane {
    fn new(dim: usize, bits: u8, group: usize) -> Self {
        Plane {
            dim,
            words: dim * bits as usize / 32,
            groups: dim / group,
            codes: Vec::new(),
            params: Vec::new(),
        }
    }

    /// Re-lays the plane out for `capacity` slots per (row, head), keeping contents.
    fn grow(&mut self, blocks: usize, old_cap: usize, capacity: usize) {
        let mut codes = vec![0u32; blocks * capacity * self.words];
        let mut params = vec![f16::ZERO; blocks * capacity * self.groups * 2];
        for b in 0..blocks {
            let (cw, pw) = (old_cap * self.words, old_cap * self.groups * 2);
            codes[b * capacity * self.words..][..cw].copy_from_slice(&self.codes[b * cw..][..cw]);
            params[b * capacity * self.groups * 2..][..pw]
                .copy_from_slice(&self.params[b * pw..][..pw]);
        }
        self.codes = codes;
        self.params = params;
    }

    fn write(
        &mut self,
        block: usize,
        capacity: usize,
        slot: usize,
        x: &[f32],
        bits: u8,
        group: usize,
    ) {
        let at = block * capacity + slot;
        let words = &mut self.codes[at * self.words..(at + 1) * self.words];
        let params = &mut self.params[at * self.groups * 2..(at + 1) * self.groups * 2];
        let wpg = group * bits as usize / 32;
        for g in 0..self.groups {
            let p = quantize_group(
                &x[g * group..(g + 1) * group],
                bits,
                &mut words[g * wpg..(g + 1) * wpg],
            );
            params[2 * g] = f16::from_f32(p.scale);
            params[2 * g + 1] = f16::from_f32(p.bias);
        }
    }

    fn read(
        &self,
        block: usize,
        capacity: usize,
        slot: usize,
        out: &mut [f32],
        bits: u8,
        group: usize,
    ) {
        let at = block * capacity + slot;
        let words = &self.codes[at * self.words..(at + 1) * self.words];
        let params = &self.params[at * self.groups * 2..(at + 1) * self.groups * 2];
        let wpg = group * bits as usize / 32;
        for g in 0..self.groups {
            let p = GroupParams {
                scale: params[2 * g].to_f32(),
                bias: params[2 * g + 1].to_f32(),
            };
            dequantize_group(
                &words[g * wpg..(g + 1) * wpg],
                p,
                bits,
                &mut out[g * group..(g + 1) * group],
            );
        }
    }
}

/// One (row, head) block of a plane, as the fused reads see it.
#[derive(Clone, Copy)]
pub(crate) struct PlaneView<'a> {
    codes: &'a [u32],
    params: &'a [f16],
    words: usize,
    groups: usize,
}

impl<'a> PlaneView<'a> {
    /// The packed codes of `slot`.
    #[inline(always)]
    pub fn codes(&self, slot: usize) -> &'a [u32] {
        &self.codes[slot * self.words..(slot + 1) * self.words]
    }

    /// `(scale, bias)` of each group of `slot`, interleaved.
    #[inline(always)]
    pub fn params(&self, slot: usize) -> &'a [f16] {
        &self.params[slot * self.groups * 2..(slot + 1) * self.groups * 2]
    }
}

impl Plane {
    fn view(&self, block: usize, capacity: usize) -> PlaneView<'_> {
        PlaneView {
            codes: &self.codes[block * capacity * self.words..(block + 1) * capacity * self.words],
            params: &self.params
                [block * capacity * self.groups * 2..(block + 1) * capacity * self.groups * 2],
            words: self.words,
            groups: self.groups,
        }
    }
}

/// Affine keys and values of one layer.
#[derive(Debug, Clone)]
pub struct AffinePlanes {
    bits: u8,
    group: usize,
    rows: usize,
    heads: usize,
    capacity: usize,
    keys: Plane,
    values: Plane,
    /// Per (row, KV head) key means (see the module's doc).
    key_prep: ChannelPrep,
}

impl AffinePlanes {
    pub fn new(
        bits: u8,
        group: usize,
        rows: usize,
        heads: usize,
        head_dim: usize,
        value_dim: usize,
    ) -> Self {
        AffinePlanes {
            bits,
            group,
            rows,
            heads,
            capacity: 0,
            keys: Plane::new(head_dim, bits, group),
            values: Plane::new(value_dim, bits, group),
            key_prep: ChannelPrep::identity(rows * heads, head_dim, true, false),
        }
    }

    /// The stored arrays of (keys, values): codes `(rows, heads, capacity, words)` and
    /// `(scale, bias)` per group `(rows, heads, capacity, groups, 2)` — what a GPU copy of
    /// the planes uploads as is.
    pub fn raw(&self) -> [(&[u32], &[f16]); 2] {
        [
            (&self.keys.codes, &self.keys.params),
            (&self.values.codes, &self.values.params),
        ]
    }

    pub fn bits(&self) -> u8 {
        self.bits
    }

    pub fn group(&self) -> usize {
        self.group
    }

    /// `(heads, head_dim, value_dim)`.
    pub fn geometry3(&self) -> (usize, usize, usize) {
        (self.heads, self.keys.dim, self.values.dim)
    }

    /// Keys and values of block `row * heads + head`.
    pub(crate) fn views(&self, block: usize) -> (PlaneView<'_>, PlaneView<'_>) {
        (
            self.keys.view(block, self.capacity),
            self.values.view(block, self.capacity),
        )
    }

    /// What a later read of `x` `(b, heads, n, dim)` returns once stored in rows `row ..
    /// row + b`: quantized and dequantized, keys (`keys`) with those rows' means.
    pub fn as_stored(&self, row: usize, x: &Tensor, keys: bool) -> Result<Tensor, KvError> {
        let identity = ChannelPrep::default();
        let prep = if keys { &self.key_prep } else { &identity };
        let mut plane = Plane::new(x.dims4()?.3, self.bits, self.group);
        plane.codes = vec![0; plane.words];
        plane.params = vec![f16::ZERO; plane.groups * 2];
        super::as_stored_by(x, row, self.heads, prep, |prepared, out| {
            plane.codes.iter_mut().for_each(|w| *w = 0);
            plane.write(0, 1, 0, prepared, self.bits, self.group);
            plane.read(0, 1, 0, out, self.bits, self.group);
        })
    }

    /// The key means, `(rows, heads, head_dim)` row-major.
    pub fn key_means(&self) -> &[f32] {
        self.key_prep.tables().0.unwrap_or(&[])
    }
}

impl Planes for AffinePlanes {
    fn codec(&self) -> Codec {
        Codec::Affine {
            bits: self.bits,
            group: self.group as u16,
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
        let (heads, dk, dv) = self.geometry3();
        Ok(Box::new(AffinePlanes::new(
            self.bits, self.group, rows, heads, dk, dv,
        )))
    }

    fn adopt_row(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        dst_row: usize,
    ) -> Result<(), KvError> {
        let src = same_kind::<AffinePlanes>(src, self)?;
        super::check_adopt(src_row, src.rows, dst_row, self.rows)?;
        self.key_prep
            .adopt(&src.key_prep, src_row, dst_row, self.heads);
        Ok(())
    }

    fn fit_key_prep(
        &mut self,
        k: &Tensor,
        live: &[Range<usize>],
        _prep: TurboPrep,
        _queries: Option<&[f32]>,
    ) -> Result<(), KvError> {
        let n = k.dims4()?.2;
        if live.len() != self.rows {
            return Err(KvError::RowCount {
                given: live.len(),
                rows: self.rows,
            });
        }
        let x = bf16_values(k)?;
        self.key_prep = ChannelPrep::fit(&x, self.heads, n, self.keys.dim, live, true, false, None);
        Ok(())
    }

    fn resizes_rows_in_place(&self) -> bool {
        true
    }

    fn resize_rows(&mut self, keep: &[usize], added: usize) -> Result<(), KvError> {
        super::check_keep(keep, self.rows)?;
        let per_row = self.heads * self.capacity;
        for p in [&mut self.keys, &mut self.values] {
            let (w, g) = (p.words, p.groups * 2);
            super::resize_rows(&mut p.codes, per_row * w, keep, added, 0);
            super::resize_rows(&mut p.params, per_row * g, keep, added, f16::ZERO);
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
        let first = rows.start * self.heads;
        let mut centred = vec![0f32; dk];
        for local in 0..rows.len() * self.heads {
            let block = first + local;
            for i in 0..n {
                let at = local * n + i;
                self.key_prep
                    .encode(block, &kx[at * dk..(at + 1) * dk], &mut centred);
                self.keys.write(
                    block,
                    self.capacity,
                    slot + i,
                    &centred,
                    self.bits,
                    self.group,
                );
                self.values.write(
                    block,
                    self.capacity,
                    slot + i,
                    &vx[at * dv..(at + 1) * dv],
                    self.bits,
                    self.group,
                );
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
        let identity = ChannelPrep::default();
        let plane = |p: &Plane, prep: &ChannelPrep| -> Result<Tensor, KvError> {
            let mut out = vec![0f32; blocks * len * p.dim];
            for local in 0..blocks {
                for i in 0..len {
                    let at = local * len + i;
                    let row = &mut out[at * p.dim..(at + 1) * p.dim];
                    p.read(
                        first + local,
                        self.capacity,
                        slot + i,
                        row,
                        self.bits,
                        self.group,
                    );
                    prep.decode(first + local, row);
                }
            }
            Ok(Tensor::from_vec(
                out,
                (rows.len(), self.heads, len, p.dim),
                &Device::Cpu,
            )?)
        };
        Ok((
            plane(&self.keys, &self.key_prep)?,
            plane(&self.values, &identity)?,
        ))
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
        let src = same_kind::<AffinePlanes>(src, self)?;
        check_span(src, &(src_row..src_row + 1), src_slot, len)?;
        check_span(self, &(dst_row..dst_row + 1), dst_slot, len)?;
        for (dst, from) in [(&mut self.keys, &src.keys), (&mut self.values, &src.values)] {
            let (w, p) = (dst.words, dst.groups * 2);
            for head in 0..self.heads {
                let d0 = (dst_row * self.heads + head) * self.capacity + dst_slot;
                let s0 = (src_row * self.heads + head) * src.capacity + src_slot;
                copy_slots(&mut dst.codes, &from.codes, w, s0, d0, len);
                copy_slots(&mut dst.params, &from.params, p, s0, d0, len);
            }
        }
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
        Ok(Some(affine_tiles::attend(
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
            &affine_tiles::source(self, isa),
            geometry,
            scale,
            isa,
        )?))
    }

    fn allocated_bytes(&self) -> usize {
        (self.keys.codes.len() + self.values.codes.len()) * 4
            + (self.keys.params.len() + self.values.params.len()) * 2
            + self.key_prep.bytes()
    }

    fn bytes_per_position(&self) -> usize {
        self.heads
            * ((self.keys.words + self.values.words) * 4
                + (self.keys.groups + self.values.groups) * 4)
    }

    fn state(&self) -> Result<PlanesState, KvError> {
        Ok(PlanesState {
            codec: self.codec(),
            geometry: self.geometry(),
            capacity: self.capacity,
            buffers: vec![
                to_bytes(&self.keys.codes),
                to_bytes(&self.keys.params),
                to_bytes(&self.values.codes),
                to_bytes(&self.values.params),
                to_bytes(self.key_means()),
            ],
        })
    }

    fn restore(&mut self, state: &PlanesState) -> Result<(), KvError> {
        // Four buffers: a state written before keys were centred (zero means).
        let count = state.buffers.len().clamp(4, 5);
        check_state(self, state, count)?;
        let mut key_prep =
            ChannelPrep::identity(self.rows * self.heads, self.keys.dim, true, false);
        if let Some(means) = state.buffers.get(4) {
            key_prep
                .load(from_bytes(means, "affine key means")?, Vec::new())
                .map_err(KvError::BadState)?;
        }
        let blocks = (self.rows * self.heads)
            .checked_mul(state.capacity)
            .filter(|_| state.capacity <= MAX_CAPACITY)
            .ok_or_else(|| KvError::BadState(format!("a capacity of {} slots", state.capacity)))?;
        let mut planes = [self.keys.clone(), self.values.clone()];
        for (i, p) in planes.iter_mut().enumerate() {
            p.codes = from_bytes(&state.buffers[2 * i], "affine codes")?;
            p.params = from_bytes(&state.buffers[2 * i + 1], "affine scales and biases")?;
            if p.codes.len() != blocks * p.words || p.params.len() != blocks * p.groups * 2 {
                return Err(KvError::BadState(format!(
                    "affine planes of capacity {}: {} code words and {} parameters",
                    state.capacity,
                    p.codes.len(),
                    p.params.len()
                )));
            }
        }
        let [keys, values] = planes;
        (self.keys, self.values, self.capacity, self.key_prep) =
            (keys, values, state.capacity, key_prep);
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
