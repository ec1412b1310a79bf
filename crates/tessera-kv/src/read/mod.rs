//! The attention read a layer cache returns from an append: the keys and values of every
//! position the new queries may see, and which they see.
//!
//! Three sources, whatever the codec: dense (gathered f32 keys and values plus a mask), a
//! fused decode over planes (each row its own slots), and a fused chunk over planes (each row
//! placed by a [`ChunkGeometry`]). A fused source is attended by its planes' own kernel
//! ([`Planes::decode`] / [`Planes::chunk`]); planes without one are read densely, with the
//! mask written from the same visibility.

pub(crate) mod affine_tiles;
pub(crate) mod chunk;
pub(crate) mod decode;
mod dense;
pub(crate) mod piece;
pub(crate) mod turbo_tiles;

use crate::planes::{ChunkGeometry, Planes, PlanesRef, RowSlots};
use crate::{Isa, KvError};
use candle_core::Tensor;
pub use decode::exp_nonpositive;
pub(crate) use dense::{attend_dense, chunk_mask, mask_of, slots_mask};

/// Where a read's keys and values come from.
#[derive(Debug)]
enum Source<'a> {
    /// Gathered f32 keys `(rows, kv_heads, keys, head_dim)` and values, plus an additive mask
    /// `(rows, 1, queries, keys)` when some query may not see some key. `ends[i]`, where
    /// given, bounds the keys any row's query `i` sees (so blocks of a causal chunk skip the
    /// masked upper triangle).
    Dense {
        keys: Tensor,
        values: Tensor,
        mask: Option<Tensor>,
        ends: Option<Vec<usize>>,
    },
    /// One query position per row, row `r` over the slots `rows[r]` of the planes.
    Decode {
        planes: PlanesRef<'a>,
        rows: Vec<RowSlots>,
    },
    /// A chunk of queries per row over the planes, as `geometry` places them.
    Chunk {
        planes: PlanesRef<'a>,
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
        AttentionRead::of(Source::Dense {
            keys,
            values,
            mask,
            ends: None,
        })
    }

    /// A one-position read of each row's `rows[r]` slots.
    pub(crate) fn decode(planes: PlanesRef<'a>, rows: Vec<RowSlots>) -> Self {
        AttentionRead::of(Source::Decode { planes, rows })
    }

    /// A chunk read placed by `geometry`.
    pub(crate) fn chunk(planes: PlanesRef<'a>, geometry: ChunkGeometry) -> Self {
        AttentionRead::of(Source::Chunk { planes, geometry })
    }

    /// Materializes a fused read as a dense one over decoded f32 keys and values, masked by
    /// the same visibility.
    pub fn to_dense(&self) -> Result<AttentionRead<'a>, KvError> {
        match &self.source {
            Source::Dense {
                keys,
                values,
                mask,
                ends,
            } => Ok(AttentionRead::of(Source::Dense {
                keys: keys.clone(),
                values: values.clone(),
                mask: mask.clone(),
                ends: ends.clone(),
            })),
            Source::Decode { planes, rows } => {
                let p = planes.get();
                let (keys, values) = p.read(0..rows.len(), 0, p.capacity())?;
                let mask = slots_mask(rows, p.capacity(), keys.device())?;
                Ok(AttentionRead::dense(keys, values, Some(mask)))
            }
            Source::Chunk { planes, geometry } => {
                let p = planes.get();
                let (keys, values) = p.read(0..geometry.rows.len(), 0, geometry.slots)?;
                let mask = chunk_mask(geometry, keys.device())?;
                let ends = (0..geometry.queries)
                    .map(|i| {
                        (0..geometry.rows.len())
                            .map(|r| geometry.visible(r, i).end)
                            .max()
                            .unwrap_or(0)
                    })
                    .collect();
                Ok(AttentionRead::of(Source::Dense {
                    keys,
                    values,
                    mask,
                    ends: Some(ends),
                }))
            }
        }
    }

    /// Scaled dot-product attention of `q` `(rows, q_heads, queries, head_dim)` over this
    /// read, query heads grouped onto KV heads (GQA). Returns `(rows, q_heads, queries, value_dim)`.
    pub fn attend(&self, q: &Tensor, scale: f32) -> Result<Tensor, KvError> {
        let fused = match &self.source {
            Source::Dense {
                keys,
                values,
                mask,
                ends,
            } => return attend_dense(q, keys, values, mask.as_ref(), ends.as_deref(), scale),
            Source::Decode { planes, rows } => planes.get().decode(q, rows, scale, self.isa)?,
            Source::Chunk { planes, geometry } => {
                check_chunk_query(q, geometry)?;
                planes.get().chunk(q, geometry, scale, self.isa)?
            }
        };
        match fused {
            Some(out) => Ok(out),
            None => self.to_dense()?.attend(q, scale),
        }
    }

    /// Plain attention, one query head at a time with an explicit softmax: the reference the
    /// tests hold [`AttentionRead::attend`] to.
    pub fn attend_reference(&self, q: &Tensor, scale: f32) -> Result<Tensor, KvError> {
        let Source::Dense {
            keys, values, mask, ..
        } = &self.source
        else {
            return self.to_dense()?.attend_reference(q, scale);
        };
        dense::attend_reference(q, keys, values, mask.as_ref(), scale)
    }

    /// The planes a fused read is over (tests look at their codec).
    pub fn planes(&self) -> Option<&dyn Planes> {
        match &self.source {
            Source::Dense { .. } => None,
            Source::Decode { planes, .. } | Source::Chunk { planes, .. } => Some(planes.get()),
        }
    }
}

fn check_chunk_query(q: &Tensor, g: &ChunkGeometry) -> Result<(), KvError> {
    let (b, qh, n, d) = q.dims4()?;
    if b != g.rows.len() || d != g.head_dim || n != g.queries || qh % g.kv_heads != 0 {
        return Err(KvError::QueryShape {
            got: q.dims().to_vec(),
            detail: format!(
                "a chunk read of {} queries over {} rows of {} KV heads, head_dim {}",
                g.queries,
                g.rows.len(),
                g.kv_heads,
                g.head_dim
            ),
        });
    }
    Ok(())
}
