//! The `Plain` codec: keys and values stored unquantized in bf16, f16 or f32, in planes
//! `(rows, kv_heads, slots, dim)`, as mlx-lm's `KVCache` stores them.
//!
//! State buffers: `[keys, values]`, each the raw elements `(rows, heads, capacity, dim)`.

use super::{
    check_span, check_state, from_bytes, same_kind, to_bytes, ChunkGeometry, PlaneGeometry, Planes,
    PlanesState, RowSlots,
};
use crate::read::decode::{self, DecodeShape, Element};
use crate::{Codec, Isa, KvError, PlainDType, MAX_CAPACITY};
use candle_core::{DType, Device, Tensor};
use half::{bf16, f16};
use std::any::Any;
use std::ops::Range;

/// The stored elements of one plane, in the storage dtype.
#[derive(Debug, Clone)]
enum Data {
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl Data {
    fn new(dtype: PlainDType) -> Self {
        match dtype {
            PlainDType::Bf16 => Data::Bf16(Vec::new()),
            PlainDType::F16 => Data::F16(Vec::new()),
            PlainDType::F32 => Data::F32(Vec::new()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Data::Bf16(x) => x.len(),
            Data::F16(x) => x.len(),
            Data::F32(x) => x.len(),
        }
    }

    /// Re-lays `blocks` blocks of `old` slots out as `new` slots of `dim` each.
    fn grow(&mut self, blocks: usize, dim: usize, old: usize, new: usize) {
        fn grow<E: Copy + Default>(
            x: &mut Vec<E>,
            blocks: usize,
            dim: usize,
            old: usize,
            new: usize,
        ) {
            let mut out = vec![E::default(); blocks * new * dim];
            for b in 0..blocks {
                out[b * new * dim..][..old * dim].copy_from_slice(&x[b * old * dim..][..old * dim]);
            }
            *x = out;
        }
        match self {
            Data::Bf16(x) => grow(x, blocks, dim, old, new),
            Data::F16(x) => grow(x, blocks, dim, old, new),
            Data::F32(x) => grow(x, blocks, dim, old, new),
        }
    }

    /// [`super::resize_rows`] of rows of `per_row` elements.
    fn resize_rows(&mut self, per_row: usize, keep: &[usize], added: usize) {
        match self {
            Data::Bf16(x) => super::resize_rows(x, per_row, keep, added, bf16::ZERO),
            Data::F16(x) => super::resize_rows(x, per_row, keep, added, f16::ZERO),
            Data::F32(x) => super::resize_rows(x, per_row, keep, added, 0.0),
        }
    }

    /// Copies `len` elements from `src` at `from` into `self` at `to`.
    fn copy(&mut self, src: &Data, from: usize, to: usize, len: usize) {
        match (self, src) {
            (Data::Bf16(d), Data::Bf16(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
            (Data::F16(d), Data::F16(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
            (Data::F32(d), Data::F32(s)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
            _ => unreachable!("copies are between planes of one dtype (checked by same_kind)"),
        }
    }

    /// Stores `x` rounded to the storage dtype: its `i`-th run of `chunk` elements at `at(i)`.
    fn store(
        &mut self,
        x: &Tensor,
        chunk: usize,
        at: impl Fn(usize) -> usize,
    ) -> Result<(), KvError> {
        fn put<E: Copy>(d: &mut [E], v: &[E], chunk: usize, at: impl Fn(usize) -> usize) {
            for (i, run) in v.chunks_exact(chunk).enumerate() {
                d[at(i)..at(i) + chunk].copy_from_slice(run);
            }
        }
        let x = x.flatten_all()?;
        match self {
            Data::Bf16(d) => put(d, &x.to_dtype(DType::BF16)?.to_vec1::<bf16>()?, chunk, at),
            Data::F16(d) => put(d, &x.to_dtype(DType::F16)?.to_vec1::<f16>()?, chunk, at),
            Data::F32(d) => put(d, &x.to_dtype(DType::F32)?.to_vec1::<f32>()?, chunk, at),
        }
        Ok(())
    }

    fn widen(&self, at: usize, len: usize, out: &mut Vec<f32>) {
        fn w<E: Element>(x: &[E], out: &mut Vec<f32>) {
            out.extend(x.iter().map(|e| e.f32()));
        }
        match self {
            Data::Bf16(x) => w(&x[at..at + len], out),
            Data::F16(x) => w(&x[at..at + len], out),
            Data::F32(x) => w(&x[at..at + len], out),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self {
            Data::Bf16(x) => to_bytes(x),
            Data::F16(x) => to_bytes(x),
            Data::F32(x) => to_bytes(x),
        }
    }

    fn load(&mut self, b: &[u8]) -> Result<(), KvError> {
        match self {
            Data::Bf16(x) => *x = from_bytes(b, "plain bf16 plane")?,
            Data::F16(x) => *x = from_bytes(b, "plain f16 plane")?,
            Data::F32(x) => *x = from_bytes(b, "plain f32 plane")?,
        }
        Ok(())
    }
}

/// Plain storage planes of one layer.
#[derive(Debug, Clone)]
pub struct PlainPlanes {
    dtype: PlainDType,
    geometry: PlaneGeometry,
    capacity: usize,
    keys: Data,
    values: Data,
}

impl PlainPlanes {
    pub fn new(dtype: PlainDType, geometry: PlaneGeometry) -> Self {
        PlainPlanes {
            dtype,
            geometry,
            capacity: 0,
            keys: Data::new(dtype),
            values: Data::new(dtype),
        }
    }

    pub fn dtype(&self) -> PlainDType {
        self.dtype
    }

    /// Rounds `input` to the storage dtype and back to f32: exactly what a later read of
    /// the stored position returns.
    pub fn as_stored(&self, input: &Tensor) -> Result<Tensor, KvError> {
        Ok(input.to_dtype(self.dtype.dtype())?.to_dtype(DType::F32)?)
    }

    fn blocks(&self) -> usize {
        self.geometry.rows * self.geometry.heads
    }
}

impl Planes for PlainPlanes {
    fn codec(&self) -> Codec {
        Codec::Plain(self.dtype)
    }

    fn geometry(&self) -> PlaneGeometry {
        self.geometry
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn empty(&self, rows: usize) -> Result<Box<dyn Planes>, KvError> {
        Ok(Box::new(PlainPlanes::new(
            self.dtype,
            PlaneGeometry {
                rows,
                ..self.geometry
            },
        )))
    }

    fn resizes_rows_in_place(&self) -> bool {
        true
    }

    fn resize_rows(&mut self, keep: &[usize], added: usize) -> Result<(), KvError> {
        let g = self.geometry;
        super::check_keep(keep, g.rows)?;
        let per_row = g.heads * self.capacity;
        self.keys.resize_rows(per_row * g.head_dim, keep, added);
        self.values.resize_rows(per_row * g.value_dim, keep, added);
        self.geometry.rows = keep.len() + added;
        Ok(())
    }

    fn reserve(&mut self, slots: usize, limit: usize) -> Result<(), KvError> {
        if slots <= self.capacity {
            return Ok(());
        }
        let capacity = crate::grown_capacity(slots, limit);
        let (blocks, g) = (self.blocks(), self.geometry);
        self.keys.grow(blocks, g.head_dim, self.capacity, capacity);
        self.values
            .grow(blocks, g.value_dim, self.capacity, capacity);
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
        let (h, cap) = (self.geometry.heads, self.capacity);
        for (plane, x, dim) in [
            (&mut self.keys, k, self.geometry.head_dim),
            (&mut self.values, v, self.geometry.value_dim),
        ] {
            // Run i of x is (row rows.start + i / h, head i % h): n slots of dim.
            let row0 = rows.start;
            plane.store(x, n * dim, |i| {
                (((row0 + i / h) * h + i % h) * cap + slot) * dim
            })?;
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
        let (h, cap) = (self.geometry.heads, self.capacity);
        let mut out = Vec::with_capacity(2);
        for (plane, dim) in [
            (&self.keys, self.geometry.head_dim),
            (&self.values, self.geometry.value_dim),
        ] {
            let mut x = Vec::with_capacity(rows.len() * h * len * dim);
            for row in rows.clone() {
                for head in 0..h {
                    plane.widen(((row * h + head) * cap + slot) * dim, len * dim, &mut x);
                }
            }
            out.push(Tensor::from_vec(
                x,
                (rows.len(), h, len, dim),
                &Device::Cpu,
            )?);
        }
        let v = out.pop().expect("two planes");
        Ok((out.pop().expect("two planes"), v))
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
        let src = same_kind::<PlainPlanes>(src, self)?;
        check_span(src, &(src_row..src_row + 1), src_slot, len)?;
        check_span(self, &(dst_row..dst_row + 1), dst_slot, len)?;
        let h = self.geometry.heads;
        for (dst, from, dim) in [
            (&mut self.keys, &src.keys, self.geometry.head_dim),
            (&mut self.values, &src.values, self.geometry.value_dim),
        ] {
            for head in 0..h {
                dst.copy(
                    from,
                    ((src_row * h + head) * src.capacity + src_slot) * dim,
                    ((dst_row * h + head) * self.capacity + dst_slot) * dim,
                    len * dim,
                );
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
        let g = self.geometry;
        let shape = DecodeShape::of(q, g, self.capacity)?;
        let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
        let out = match (&self.keys, &self.values) {
            (Data::Bf16(k), Data::Bf16(v)) => {
                decode::attend_plain(&qv, k, v, rows, &shape, scale, isa)
            }
            (Data::F16(k), Data::F16(v)) => {
                decode::attend_plain(&qv, k, v, rows, &shape, scale, isa)
            }
            (Data::F32(k), Data::F32(v)) => {
                decode::attend_plain(&qv, k, v, rows, &shape, scale, isa)
            }
            _ => unreachable!("both planes have the storage dtype"),
        };
        Ok(Some(shape.output(out, q.device())?))
    }

    fn chunk(
        &self,
        q: &Tensor,
        g: &ChunkGeometry,
        scale: f32,
        isa: Isa,
    ) -> Result<Option<Tensor>, KvError> {
        let q = q.contiguous()?;
        let (c, d, dv) = (
            self.capacity,
            self.geometry.head_dim,
            self.geometry.value_dim,
        );
        let out = match (&self.keys, &self.values) {
            (Data::Bf16(k), Data::Bf16(v)) => {
                decode::chunk_plain(&q, k, v, c, d, dv, g, scale, isa)?
            }
            (Data::F16(k), Data::F16(v)) => decode::chunk_plain(&q, k, v, c, d, dv, g, scale, isa)?,
            (Data::F32(k), Data::F32(v)) => decode::chunk_plain(&q, k, v, c, d, dv, g, scale, isa)?,
            _ => unreachable!("both planes have the storage dtype"),
        };
        Ok(Some(out))
    }

    fn allocated_bytes(&self) -> usize {
        (self.keys.len() + self.values.len()) * self.dtype.size_in_bytes()
    }

    fn bytes_per_position(&self) -> usize {
        let g = self.geometry;
        g.heads * (g.head_dim + g.value_dim) * self.dtype.size_in_bytes()
    }

    fn state(&self) -> Result<PlanesState, KvError> {
        Ok(PlanesState {
            codec: self.codec(),
            geometry: self.geometry,
            capacity: self.capacity,
            buffers: vec![self.keys.bytes(), self.values.bytes()],
        })
    }

    fn restore(&mut self, state: &PlanesState) -> Result<(), KvError> {
        check_state(self, state, 2)?;
        let g = self.geometry;
        let (mut keys, mut values) = (Data::new(self.dtype), Data::new(self.dtype));
        keys.load(&state.buffers[0])?;
        values.load(&state.buffers[1])?;
        let blocks = (self.blocks())
            .checked_mul(state.capacity)
            .filter(|_| state.capacity <= MAX_CAPACITY)
            .ok_or_else(|| KvError::BadState(format!("a capacity of {} slots", state.capacity)))?;
        if keys.len() != blocks * g.head_dim || values.len() != blocks * g.value_dim {
            return Err(KvError::BadState(format!(
                "plain planes of capacity {}: buffers of {} and {} elements",
                state.capacity,
                keys.len(),
                values.len()
            )));
        }
        (self.keys, self.values, self.capacity) = (keys, values, state.capacity);
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
