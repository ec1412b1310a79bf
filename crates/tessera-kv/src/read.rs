//! The attention read a layer cache returns from an append: keys and values of every
//! position the new queries may see, with the mask that says which.

use crate::decode::{self, DecodeShape, RowSlots};
use crate::KvError;
use candle_core::{DType, Tensor, D};
use std::marker::PhantomData;

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

/// Keys `(rows, kv_heads, keys, head_dim)` and values `(rows, kv_heads, keys, value_dim)` in
/// f32, plus an additive mask `(rows, 1, queries, keys)` when some query may not see some key.
/// Borrowing the cache keeps it from changing while the read is alive.
#[derive(Debug)]
pub struct AttentionRead<'a> {
    keys: Tensor,
    values: Tensor,
    mask: Option<Tensor>,
    /// Set for a fused decode read: `keys`/`values` are then the whole stored planes and
    /// each row attends its listed slots.
    decode: Option<Vec<RowSlots>>,
    _cache: PhantomData<&'a ()>,
}

impl<'a> AttentionRead<'a> {
    /// A read over gathered keys and values `(rows, kv_heads, keys, dim)` with a mask.
    pub(crate) fn dense(keys: Tensor, values: Tensor, mask: Option<Tensor>) -> Self {
        AttentionRead {
            keys,
            values,
            mask,
            decode: None,
            _cache: PhantomData,
        }
    }

    /// A one-position read straight from stored planes `(rows, kv_heads, capacity, dim)`.
    pub(crate) fn decode(planes_k: Tensor, planes_v: Tensor, rows: Vec<RowSlots>) -> Self {
        AttentionRead {
            keys: planes_k,
            values: planes_v,
            mask: None,
            decode: Some(rows),
            _cache: PhantomData,
        }
    }

    /// Materializes a fused decode read as a dense one (the reference the fused read is
    /// tested against).
    pub fn to_dense(&self) -> Result<AttentionRead<'a>, KvError> {
        let Some(rows) = &self.decode else {
            return Ok(AttentionRead::dense(
                self.keys.clone(),
                self.values.clone(),
                self.mask.clone(),
            ));
        };
        let (b, _, cap, _) = self.keys.dims4()?;
        // Keys in slot order plus a mask that hides every slot a row does not list.
        let keys = self.keys.to_dtype(DType::F32)?;
        let values = self.values.to_dtype(DType::F32)?;
        let mut mask = vec![f32::NEG_INFINITY; b * cap];
        for (r, slots) in rows.iter().enumerate() {
            for range in &slots.ranges {
                for slot in range.clone() {
                    mask[r * cap + slot] = 0.0;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (b, 1, 1, cap), self.keys.device())?;
        Ok(AttentionRead::dense(keys, values, Some(mask)))
    }

    /// Scaled dot-product attention of `q` `(rows, q_heads, queries, head_dim)` over this
    /// read, query heads grouped onto KV heads (GQA). Returns `(rows, q_heads, queries, value_dim)`.
    pub fn attend(&self, q: &Tensor, scale: f32) -> Result<Tensor, KvError> {
        if let Some(rows) = &self.decode {
            return self.attend_decode(q, rows, scale);
        }
        let (b, qh, n, d) = q.dims4()?;
        let (kb, kvh, s, kd) = self.keys.dims4()?;
        if kb != b || kd != d || qh % kvh != 0 {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("keys are {:?}", self.keys.dims()),
            });
        }
        // Causal chunks in blocks of queries, each against the keys up to its last position
        // only: the masked upper triangle is never multiplied. A dense read's keys end with
        // the chunk's own positions, so block [i0, i0 + len) sees the first s - n + i0 + len.
        if let (Some(mask), true) = (&self.mask, n > QUERY_BLOCK) {
            let mut outs = Vec::with_capacity(n.div_ceil(QUERY_BLOCK));
            for i0 in (0..n).step_by(QUERY_BLOCK) {
                let len = QUERY_BLOCK.min(n - i0);
                let limit = s - (n - (i0 + len));
                outs.push(attend_dense(
                    &q.narrow(2, i0, len)?,
                    &self.keys.narrow(2, 0, limit)?,
                    &self.values.narrow(2, 0, limit)?,
                    Some(&mask.narrow(2, i0, len)?.narrow(3, 0, limit)?),
                    scale,
                )?);
            }
            return Ok(Tensor::cat(&outs, 2)?);
        }
        attend_dense(q, &self.keys, &self.values, self.mask.as_ref(), scale)
    }

    fn attend_decode(&self, q: &Tensor, rows: &[RowSlots], scale: f32) -> Result<Tensor, KvError> {
        let (b, qh, n, d) = q.dims4()?;
        let (kb, kvh, capacity, kd) = self.keys.dims4()?;
        if kb != b || kd != d || n != 1 || qh % kvh != 0 {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("a decode read over planes {:?}", self.keys.dims()),
            });
        }
        let shape = DecodeShape {
            rows: b,
            kv_heads: kvh,
            group: qh / kvh,
            head_dim: d,
            value_dim: self.values.dims()[3],
            capacity,
        };
        Ok(decode::attend(
            &q.contiguous()?,
            &self.keys,
            &self.values,
            rows,
            &shape,
            scale,
        )?)
    }

    /// Plain attention, one query head at a time with an explicit softmax: the reference the
    /// tests hold [`AttentionRead::attend`] to.
    pub fn attend_reference(&self, q: &Tensor, scale: f32) -> Result<Tensor, KvError> {
        let qh = q.dims4()?.1;
        let kvh = self.keys.dims()[1];
        let g = qh / kvh;
        let mut heads = Vec::with_capacity(qh);
        for h in 0..qh {
            let qh_t = q.narrow(1, h, 1)?; // (b, 1, n, d)
            let k = self.keys.narrow(1, h / g, 1)?;
            let v = self.values.narrow(1, h / g, 1)?;
            let mut s = (qh_t.matmul(&k.t()?)? * scale as f64)?;
            if let Some(mask) = &self.mask {
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
