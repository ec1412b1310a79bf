//! Affine-quantized storage planes: per position and head, `bits`-bit codes packed in u32
//! words (layout in [`crate::codec::affine`]) plus an f16 scale and bias per group of `group`
//! elements. Positions are quantized once, when written, and never requantized.
//!
//! Inputs are rounded to bf16 before quantizing, so a position quantized on append and one
//! converted later from bf16 storage hold the same codes bit for bit.
//!
//! State buffers: `[key codes (u32), key params (f16 scale, bias per group), value codes,
//! value params]`, each `(rows, heads, capacity, …)`.

use super::{
    check_span, check_state, copy_slots, from_bytes, same_kind, to_bytes, ChunkGeometry,
    PlaneGeometry, Planes, PlanesState, RowSlots,
};
use crate::codec::affine::{dequantize_group, quantize_group, GroupParams};
use crate::read::affine_tiles;
use crate::read::chunk;
use crate::read::decode::DecodeShape;
use crate::{Codec, Isa, KvError, MAX_CAPACITY};
use candle_core::{DType, Device, Tensor};
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
}

/// `x` `(rows, heads, n, dim)` as f32 values rounded to bf16, row-major.
fn bf16_values(x: &Tensor) -> Result<Vec<f32>, KvError> {
    Ok(x.to_dtype(DType::BF16)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1()?)
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

    /// What a later read of `x` returns once stored: quantized and dequantized.
    pub fn as_stored(&self, x: &Tensor) -> Result<Tensor, KvError> {
        let (b, h, n, d) = x.dims4()?;
        let values = bf16_values(x)?;
        let mut plane = Plane::new(d, self.bits, self.group);
        plane.codes = vec![0; plane.words];
        plane.params = vec![f16::ZERO; plane.groups * 2];
        let mut out = vec![0f32; values.len()];
        for (src, dst) in values.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            plane.codes.iter_mut().for_each(|w| *w = 0);
            plane.write(0, 1, 0, src, self.bits, self.group);
            plane.read(0, 1, 0, dst, self.bits, self.group);
        }
        Ok(Tensor::from_vec(out, (b, h, n, d), x.device())?)
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
        for local in 0..rows.len() * self.heads {
            let block = first + local;
            for i in 0..n {
                let at = local * n + i;
                self.keys.write(
                    block,
                    self.capacity,
                    slot + i,
                    &kx[at * dk..(at + 1) * dk],
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
        let plane = |p: &Plane| -> Result<Tensor, KvError> {
            let mut out = vec![0f32; blocks * len * p.dim];
            for local in 0..blocks {
                for i in 0..len {
                    let at = local * len + i;
                    p.read(
                        first + local,
                        self.capacity,
                        slot + i,
                        &mut out[at * p.dim..(at + 1) * p.dim],
                        self.bits,
                        self.group,
                    );
                }
            }
            Ok(Tensor::from_vec(
                out,
                (rows.len(), self.heads, len, p.dim),
                &Device::Cpu,
            )?)
        };
        Ok((plane(&self.keys)?, plane(&self.values)?))
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
        _isa: Isa,
    ) -> Result<Option<Tensor>, KvError> {
        Ok(Some(chunk::attend(
            &q.contiguous()?,
            self,
            geometry,
            scale,
        )?))
    }

    fn allocated_bytes(&self) -> usize {
        (self.keys.codes.len() + self.values.codes.len()) * 4
            + (self.keys.params.len() + self.values.params.len()) * 2
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
            ],
        })
    }

    fn restore(&mut self, state: &PlanesState) -> Result<(), KvError> {
        check_state(self, state, 4)?;
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
        (self.keys, self.values, self.capacity) = (keys, values, state.capacity);
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
