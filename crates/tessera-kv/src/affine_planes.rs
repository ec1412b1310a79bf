//! Affine-quantized storage planes: per position and head, `bits`-bit codes packed in u32
//! words (layout in [`crate::affine`]) plus an f16 scale and bias per group of `group`
//! elements. Positions are quantized once, when written, and never requantized.
//!
//! Inputs are rounded to bf16 before quantizing, so a position quantized on append and one
//! converted later from bf16 storage hold the same codes bit for bit.

use crate::affine::{dequantize_group, quantize_group, GroupParams};
use crate::KvError;
use candle_core::{DType, Device, Tensor};
use half::f16;

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
    device: Device,
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
            device: Device::Cpu,
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

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// `(heads, head_dim, value_dim)`.
    pub fn geometry(&self) -> (usize, usize, usize) {
        (self.heads, self.keys.dim, self.values.dim)
    }

    /// Keys and values of block `row * heads + head`.
    pub(crate) fn views(&self, block: usize) -> (PlaneView<'_>, PlaneView<'_>) {
        (
            self.keys.view(block, self.capacity),
            self.values.view(block, self.capacity),
        )
    }

    /// Encoded bytes of one position of one row: codes plus 16-bit scale and bias per group.
    pub fn bytes_per_position(&self) -> usize {
        self.heads
            * ((self.keys.words + self.values.words) * 4
                + (self.keys.groups + self.values.groups) * 4)
    }

    pub fn allocated_bytes(&self) -> usize {
        (self.keys.codes.len() + self.values.codes.len()) * 4
            + (self.keys.params.len() + self.values.params.len()) * 2
    }

    /// Makes room for `slots` slots, growing in [`crate::GROWTH_STEP`] steps but never past `limit`.
    pub fn reserve(&mut self, slots: usize, limit: usize) {
        if slots <= self.capacity {
            return;
        }
        let capacity = crate::grown_capacity(slots, limit);
        let blocks = self.rows * self.heads;
        self.keys.grow(blocks, self.capacity, capacity);
        self.values.grow(blocks, self.capacity, capacity);
        self.capacity = capacity;
    }

    /// Empty planes of the same codec and geometry.
    pub fn empty_like(&self) -> Self {
        let (heads, dk, dv) = self.geometry();
        AffinePlanes::new(self.bits, self.group, self.rows, heads, dk, dv)
    }

    /// Copies `len` stored slots of `src` (same codec and geometry) from `src_slot` into
    /// `dst_slot ..`, codes and parameters as they are.
    pub fn copy_slots(&mut self, src: &AffinePlanes, src_slot: usize, dst_slot: usize, len: usize) {
        for (dst, from) in [(&mut self.keys, &src.keys), (&mut self.values, &src.values)] {
            let (w, p) = (dst.words, dst.groups * 2);
            for block in 0..self.rows * self.heads {
                let (d0, s0) = (
                    block * self.capacity + dst_slot,
                    block * src.capacity + src_slot,
                );
                dst.codes[d0 * w..(d0 + len) * w]
                    .copy_from_slice(&from.codes[s0 * w..(s0 + len) * w]);
                dst.params[d0 * p..(d0 + len) * p]
                    .copy_from_slice(&from.params[s0 * p..(s0 + len) * p]);
            }
        }
    }

    /// Quantizes `k`, `v` `(rows, heads, n, dim)` into slots `slot .. slot + n`.
    pub fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
        self.device = k.device().clone();
        let n = k.dims()[2];
        let (kx, vx) = (bf16_values(k)?, bf16_values(v)?);
        let (dk, dv) = (self.keys.dim, self.values.dim);
        for block in 0..self.rows * self.heads {
            for i in 0..n {
                let at = block * n + i;
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

    /// Slots `slot .. slot + len` of both planes, dequantized to f32 `(rows, heads, len, dim)`.
    pub fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor), KvError> {
        let plane = |p: &Plane| -> Result<Tensor, KvError> {
            let mut out = vec![0f32; self.rows * self.heads * len * p.dim];
            for block in 0..self.rows * self.heads {
                for i in 0..len {
                    let at = block * len + i;
                    p.read(
                        block,
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
                (self.rows, self.heads, len, p.dim),
                &self.device,
            )?)
        };
        Ok((plane(&self.keys)?, plane(&self.values)?))
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
