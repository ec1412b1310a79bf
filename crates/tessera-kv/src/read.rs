//! The attention read a layer cache returns from an append: keys and values of every
//! position the new queries may see, with the mask that says which.

use crate::affine_chunk::{self, ChunkGeometry};
use crate::affine_decode;
use crate::affine_planes::AffinePlanes;
use crate::decode::{self, DecodeShape, RowSlots};
use crate::device::DevicePlanes;
use crate::rows::Rows;
use crate::turbo_decode;
use crate::turbo_planes::TurboPlanes;
use crate::{Isa, KvError};
use candle_core::{DType, Tensor, D};
use std::borrow::Cow;

/// Queries per block of a chunked (causal) dense read.
const QUERY_BLOCK: usize = 128;

/// Scaled dot-product attention of `q` `(b, q_heads, n, d)` over `keys`/`values`
/// `(b, kv_heads, s, dim)` with an optional additive mask `(b, 1, n, s)`.
fn attend_dense(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: Option<&Tensor>,
    scale: f32,
) -> Result<Tensor, KvError> {
    let (b, qh, n, d) = q.dims4()?;
    let (_, kvh, s, _) = keys.dims4()?;
    let dv = values.dims()[3];
    let g = qh / kvh;
    // Query heads h = kv * g + i share KV head kv: fold them into the query axis so each
    // KV head's keys are multiplied once for its whole group.
    let q = q.contiguous()?.reshape((b, kvh, g * n, d))?;
    let scores = (q.matmul(&keys.t()?)? * scale as f64)?; // (b, kvh, g*n, s)
    let scores = match mask {
        Some(mask) => scores
            .reshape((b, kvh, g, n, s))?
            .broadcast_add(&mask.unsqueeze(1)?)?
            .reshape((b, kvh, g * n, s))?,
        None => scores,
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    let out = probs.matmul(values)?; // (b, kvh, g*n, dv)
    Ok(out.reshape((b, qh, n, dv))?)
}

/// Device planes a read uses: the cache's own, or bf16 planes the same append retired
/// when it converted the layer.
#[derive(Debug)]
pub(crate) enum DeviceRef<'a> {
    Borrowed(&'a dyn DevicePlanes),
    Owned(Box<dyn DevicePlanes>),
}

impl DeviceRef<'_> {
    fn get(&self) -> &dyn DevicePlanes {
        match self {
            DeviceRef::Borrowed(p) => *p,
            DeviceRef::Owned(p) => p.as_ref(),
        }
    }
}

/// Each row's visible slots as one span, when they are one: a ring that has wrapped holds
/// its whole window in two ranges that together cover every slot, and attention does not
/// depend on the order of its positions. `None` when some row's slots are not contiguous
/// (a padded row in a wrapped ring).
fn single_spans(rows: &[RowSlots]) -> Option<Vec<(usize, usize)>> {
    rows.iter()
        .map(|r| match r.ranges.as_slice() {
            [a] => Some((a.start, a.end)),
            [a, b] if b.start == 0 && b.end == a.start => Some((0, a.end)),
            _ => None,
        })
        .collect()
}

/// Where a read's keys and values come from. (One lives per layer per step, so the size of
/// the largest variant does not matter.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Source<'a> {
    /// Gathered f32 keys `(rows, kv_heads, keys, head_dim)` and values, plus an additive mask
    /// `(rows, 1, queries, keys)` when some query may not see some key.
    Dense {
        keys: Tensor,
        values: Tensor,
        mask: Option<Tensor>,
    },
    /// One query position per row, straight from plain planes `(rows, kv_heads, capacity,
    /// dim)`; each row attends its listed slots.
    PlainDecode {
        keys: Tensor,
        values: Tensor,
        rows: Vec<RowSlots>,
    },
    /// One query position per row, straight from the packed codes of affine planes.
    AffineDecode {
        planes: &'a AffinePlanes,
        rows: Vec<RowSlots>,
    },
    /// One query position per row, straight from TurboQuant codes.
    TurboDecode {
        planes: &'a TurboPlanes,
        rows: Vec<RowSlots>,
    },
    /// One query position per row, on a device, through its backend's fused read.
    DeviceDecode {
        planes: DeviceRef<'a>,
        rows: Vec<RowSlots>,
    },
    /// A causal chunk of `queries` positions from `start` on a device (full retention:
    /// slot = position), through the backend's fused chunk read where it has one.
    DeviceChunk {
        planes: DeviceRef<'a>,
        pads: Vec<usize>,
        start: usize,
        queries: usize,
    },
    /// A causal chunk of queries over TurboQuant slots (the cache's planes or a span copy).
    TurboChunk {
        planes: Cow<'a, TurboPlanes>,
        pads: Vec<usize>,
        geometry: ChunkGeometry,
    },
    /// A causal chunk of queries over packed affine slots: the cache's own planes, or (for a
    /// ring whose old slots the chunk overwrites) a packed copy of the span it needs.
    AffineChunk {
        planes: Cow<'a, AffinePlanes>,
        pads: Vec<usize>,
        geometry: ChunkGeometry,
    },
}

/// The keys and values the new queries of one append may see. Borrowing the cache keeps it
/// from changing while the read is alive.
#[derive(Debug)]
pub struct AttentionRead<'a> {
    source: Source<'a>,
    /// The vector instruction level the CPU kernels of a fused read run at.
    isa: Isa,
}

impl<'a> AttentionRead<'a> {
    /// A read of `source` at the CPU's own level, until the cache sets its layer's ([`Self::at`]).
    fn of(source: Source<'a>) -> Self {
        AttentionRead {
            source,
            isa: Isa::detected(),
        }
    }

    /// This read with its CPU kernels run at `isa` (capped to what the CPU runs).
    pub(crate) fn at(mut self, isa: Isa) -> Self {
        self.isa = isa.capped();
        self
    }

    /// The vector instruction level the CPU kernels of this read run at.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// A read over gathered keys and values `(rows, kv_heads, keys, dim)` with a mask.
    pub(crate) fn dense(keys: Tensor, values: Tensor, mask: Option<Tensor>) -> Self {
        AttentionRead::of(Source::Dense { keys, values, mask })
    }

    /// A one-position read straight from plain planes `(rows, kv_heads, capacity, dim)`.
    pub(crate) fn decode(planes_k: Tensor, planes_v: Tensor, rows: Vec<RowSlots>) -> Self {
        AttentionRead::of(Source::PlainDecode {
            keys: planes_k,
            values: planes_v,
            rows,
        })
    }

    /// A one-position read straight from affine planes.
    pub(crate) fn affine_decode(planes: &'a AffinePlanes, rows: Vec<RowSlots>) -> Self {
        AttentionRead::of(Source::AffineDecode { planes, rows })
    }

    /// A one-position read straight from TurboQuant planes.
    pub(crate) fn turbo_decode(planes: &'a TurboPlanes, rows: Vec<RowSlots>) -> Self {
        AttentionRead::of(Source::TurboDecode { planes, rows })
    }

    /// A one-position read by the device planes' own kernel.
    pub(crate) fn device_decode(planes: DeviceRef<'a>, rows: Vec<RowSlots>) -> Self {
        AttentionRead::of(Source::DeviceDecode { planes, rows })
    }

    /// A causal chunk read by the device planes' own kernel (or densely, where the backend
    /// has none).
    pub(crate) fn device_chunk(
        planes: DeviceRef<'a>,
        pads: Vec<usize>,
        start: usize,
        queries: usize,
    ) -> Self {
        AttentionRead::of(Source::DeviceChunk {
            planes,
            pads,
            start,
            queries,
        })
    }

    /// A causal chunk read straight from TurboQuant slots.
    pub(crate) fn turbo_chunk(
        planes: Cow<'a, TurboPlanes>,
        pads: Vec<usize>,
        geometry: ChunkGeometry,
    ) -> Self {
        AttentionRead::of(Source::TurboChunk {
            planes,
            pads,
            geometry,
        })
    }

    /// A causal chunk read straight from packed affine slots.
    pub(crate) fn affine_chunk(
        planes: Cow<'a, AffinePlanes>,
        pads: Vec<usize>,
        geometry: ChunkGeometry,
    ) -> Self {
        AttentionRead::of(Source::AffineChunk {
            planes,
            pads,
            geometry,
        })
    }

    /// Materializes a fused read as a dense one over dequantized f32 keys and values (the
    /// reference the fused reads are tested against).
    pub fn to_dense(&self) -> Result<AttentionRead<'a>, KvError> {
        let (keys, values, rows) = match &self.source {
            Source::Dense { keys, values, mask } => {
                return Ok(AttentionRead::dense(
                    keys.clone(),
                    values.clone(),
                    mask.clone(),
                ))
            }
            Source::PlainDecode { keys, values, rows } => (
                keys.to_dtype(DType::F32)?,
                values.to_dtype(DType::F32)?,
                rows,
            ),
            Source::AffineDecode { planes, rows } => {
                let (k, v) = planes.read(0, planes.capacity())?;
                (k, v, rows)
            }
            Source::TurboDecode { planes, rows } => {
                let (k, v) = planes.read(0, planes.capacity())?;
                (k, v, rows)
            }
            Source::DeviceDecode { planes, rows } => {
                let (k, v) = planes.get().read(0, planes.get().capacity())?;
                (k, v, rows)
            }
            Source::DeviceChunk {
                planes,
                pads,
                start,
                queries,
            } => {
                let (keys, values) = planes.get().read(0, start + queries)?;
                let mut rows = Rows::new(pads.clone());
                rows.advance(*start);
                let positions: Vec<usize> = (0..start + queries).collect();
                let mask = rows.mask(*queries, &positions, None, keys.device())?;
                return Ok(AttentionRead::dense(keys, values, mask));
            }
            Source::AffineChunk {
                pads,
                geometry: geo,
                ..
            }
            | Source::TurboChunk {
                pads,
                geometry: geo,
                ..
            } => {
                // The mask the dense path builds for the same positions.
                let (keys, values) = match &self.source {
                    Source::AffineChunk { planes, .. } => planes.read(0, geo.slots)?,
                    Source::TurboChunk { planes, .. } => planes.read(0, geo.slots)?,
                    _ => unreachable!(),
                };
                let mut rows = Rows::new(pads.clone());
                rows.advance(geo.start);
                let positions: Vec<usize> = (geo.first..geo.first + geo.slots).collect();
                let mask = rows.mask(geo.queries, &positions, geo.window, keys.device())?;
                return Ok(AttentionRead::dense(keys, values, mask));
            }
        };
        let (b, _, cap, _) = keys.dims4()?;
        // Keys in slot order plus a mask that hides every slot a row does not list.
        let mut mask = vec![f32::NEG_INFINITY; b * cap];
        for (r, slots) in rows.iter().enumerate() {
            for range in &slots.ranges {
                for slot in range.clone() {
                    mask[r * cap + slot] = 0.0;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (b, 1, 1, cap), keys.device())?;
        Ok(AttentionRead::dense(keys, values, Some(mask)))
    }

    /// Scaled dot-product attention of `q` `(rows, q_heads, queries, head_dim)` over this
    /// read, query heads grouped onto KV heads (GQA). Returns `(rows, q_heads, queries, value_dim)`.
    pub fn attend(&self, q: &Tensor, scale: f32) -> Result<Tensor, KvError> {
        let (keys, values, mask) = match &self.source {
            Source::Dense { keys, values, mask } => (keys, values, mask),
            Source::PlainDecode { keys, values, rows } => {
                let shape = decode_shape(q, keys.dims4()?, values.dims()[3])?;
                return Ok(decode::attend(
                    &q.contiguous()?,
                    keys,
                    values,
                    rows,
                    &shape,
                    scale,
                    self.isa,
                )?);
            }
            Source::AffineChunk { pads, geometry, .. }
            | Source::TurboChunk { pads, geometry, .. } => {
                let (b, qh, n, d) = q.dims4()?;
                let g = geometry;
                if b != g.rows || d != g.head_dim || n != g.queries || qh % g.kv_heads != 0 {
                    return Err(KvError::QueryShape {
                        got: q.dims().to_vec(),
                        detail: format!(
                            "a chunk read of {} queries over {} rows of {} KV heads, head_dim {}",
                            g.queries, g.rows, g.kv_heads, g.head_dim
                        ),
                    });
                }
                let geometry = ChunkGeometry {
                    group: qh / g.kv_heads,
                    ..g.clone()
                };
                let q = q.contiguous()?;
                return Ok(match &self.source {
                    Source::AffineChunk { planes, .. } => {
                        affine_chunk::attend(&q, planes, pads, &geometry, scale)?
                    }
                    Source::TurboChunk { planes, .. } => affine_chunk::attend_source(
                        &q,
                        &turbo_decode::source(planes, self.isa),
                        pads,
                        &geometry,
                        scale,
                    )?,
                    _ => unreachable!(),
                });
            }
            Source::DeviceChunk {
                planes,
                pads,
                start,
                queries,
            } => {
                let (b, _, n, _) = q.dims4()?;
                if b != pads.len() || n != *queries {
                    return Err(KvError::QueryShape {
                        got: q.dims().to_vec(),
                        detail: format!(
                            "a chunk read of {queries} queries over {} rows",
                            pads.len()
                        ),
                    });
                }
                return match planes.get().chunk(q, pads, *start, scale)? {
                    Some(out) => Ok(out),
                    None => self.to_dense()?.attend(q, scale),
                };
            }
            Source::DeviceDecode { planes, rows } => {
                return match single_spans(rows) {
                    Some(spans) => planes.get().decode(q, &spans, scale),
                    None => self.to_dense()?.attend(q, scale),
                };
            }
            Source::TurboDecode { planes, rows } => {
                let (kvh, d, dv) = planes.geometry();
                let shape = decode_shape(q, (rows.len(), kvh, planes.capacity(), d), dv)?;
                return Ok(turbo_decode::attend(
                    &q.contiguous()?,
                    planes,
                    rows,
                    &shape,
                    scale,
                    self.isa,
                )?);
            }
            Source::AffineDecode { planes, rows } => {
                let (kvh, d, dv) = planes.geometry();
                let shape = decode_shape(q, (rows.len(), kvh, planes.capacity(), d), dv)?;
                return Ok(affine_decode::attend(
                    &q.contiguous()?,
                    planes,
                    rows,
                    &shape,
                    scale,
                    self.isa,
                )?);
            }
        };
        let (b, qh, n, d) = q.dims4()?;
        let (kb, kvh, s, kd) = keys.dims4()?;
        if kb != b || kd != d || qh % kvh != 0 {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("keys are {:?}", keys.dims()),
            });
        }
        // Causal chunks in blocks of queries, each against the keys up to its last position
        // only: the masked upper triangle is never multiplied. A dense read's keys end with
        // the chunk's own positions, so block [i0, i0 + len) sees the first s - n + i0 + len.
        if let (Some(mask), true) = (mask, n > QUERY_BLOCK) {
            let mut outs = Vec::with_capacity(n.div_ceil(QUERY_BLOCK));
            for i0 in (0..n).step_by(QUERY_BLOCK) {
                let len = QUERY_BLOCK.min(n - i0);
                let limit = s - (n - (i0 + len));
                outs.push(attend_dense(
                    &q.narrow(2, i0, len)?,
                    &keys.narrow(2, 0, limit)?,
                    &values.narrow(2, 0, limit)?,
                    Some(&mask.narrow(2, i0, len)?.narrow(3, 0, limit)?),
                    scale,
                )?);
            }
            return Ok(Tensor::cat(&outs, 2)?);
        }
        attend_dense(q, keys, values, mask.as_ref(), scale)
    }

    /// Plain attention, one query head at a time with an explicit softmax: the reference the
    /// tests hold [`AttentionRead::attend`] to.
    pub fn attend_reference(&self, q: &Tensor, scale: f32) -> Result<Tensor, KvError> {
        let Source::Dense { keys, values, mask } = &self.source else {
            return self.to_dense()?.attend_reference(q, scale);
        };
        let qh = q.dims4()?.1;
        let kvh = keys.dims()[1];
        let g = qh / kvh;
        let mut heads = Vec::with_capacity(qh);
        for h in 0..qh {
            let qh_t = q.narrow(1, h, 1)?; // (b, 1, n, d)
            let k = keys.narrow(1, h / g, 1)?;
            let v = values.narrow(1, h / g, 1)?;
            let mut s = (qh_t.matmul(&k.t()?)? * scale as f64)?;
            if let Some(mask) = mask {
                s = s.broadcast_add(mask)?;
            }
            let max = s.max_keepdim(D::Minus1)?;
            let e = s.broadcast_sub(&max)?.exp()?;
            let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
            heads.push(p.matmul(&v)?);
        }
        Ok(Tensor::cat(&heads, 1)?)
    }
}

/// The geometry of a decode read of `q` `(rows, q_heads, 1, head_dim)` over planes
/// `(rows, kv_heads, capacity, head_dim)`, or the error naming the mismatch.
fn decode_shape(
    q: &Tensor,
    (kb, kvh, capacity, kd): (usize, usize, usize, usize),
    value_dim: usize,
) -> Result<DecodeShape, KvError> {
    let (b, qh, n, d) = q.dims4()?;
    if kb != b || kd != d || n != 1 || qh % kvh != 0 {
        return Err(KvError::QueryShape {
            got: q.dims().to_vec(),
            detail: format!("a decode read over planes {:?}", (kb, kvh, capacity, kd)),
        });
    }
    Ok(DecodeShape {
        rows: b,
        kv_heads: kvh,
        group: qh / kvh,
        head_dim: d,
        value_dim,
        capacity,
    })
}

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one range per row is the common case
mod tests {
    use super::*;

    fn rows(ranges: &[&[std::ops::Range<usize>]]) -> Vec<RowSlots> {
        ranges
            .iter()
            .map(|r| RowSlots { ranges: r.to_vec() })
            .collect()
    }

    #[test]
    fn spans_of_plain_and_wrapped_rows() {
        // A full-attention row and a ring of 8 that has wrapped (slots 5..8 then 0..5: all).
        assert_eq!(
            single_spans(&rows(&[&[0..100], &[5..8, 0..5]])),
            Some(vec![(0, 100), (0, 8)])
        );
        // A padded row in a wrapped ring sees two separate runs of slots: no single span.
        assert_eq!(single_spans(&rows(&[&[0..8], &[6..8, 0..3]])), None);
        // A ring that has not wrapped.
        assert_eq!(single_spans(&rows(&[&[2..7]])), Some(vec![(2, 7)]));
    }
}
