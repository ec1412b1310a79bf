//! The attention read a layer cache returns from an append: keys and values of every
//! position the new queries may see, with the mask that says which.

use crate::KvError;
use candle_core::{Tensor, D};
use std::marker::PhantomData;

/// Keys `(rows, kv_heads, keys, head_dim)` and values `(rows, kv_heads, keys, value_dim)` in
/// f32, plus an additive mask `(rows, 1, queries, keys)` when some query may not see some key.
/// Borrowing the cache keeps it from changing while the read is alive.
#[derive(Debug)]
pub struct AttentionRead<'a> {
    keys: Tensor,
    values: Tensor,
    mask: Option<Tensor>,
    _cache: PhantomData<&'a ()>,
}

impl<'a> AttentionRead<'a> {
    pub(crate) fn new(keys: Tensor, values: Tensor, mask: Option<Tensor>) -> Self {
        AttentionRead { keys, values, mask, _cache: PhantomData }
    }

    pub fn key_count(&self) -> usize {
        self.keys.dims()[2]
    }

    /// Scaled dot-product attention of `q` `(rows, q_heads, queries, head_dim)` over this
    /// read, query heads grouped onto KV heads (GQA). Returns `(rows, q_heads, queries, value_dim)`.
    pub fn attend(&self, q: &Tensor, scale: f32) -> Result<Tensor, KvError> {
        let (b, qh, n, d) = q.dims4()?;
        let (kb, kvh, s, kd) = self.keys.dims4()?;
        let dv = self.values.dims()[3];
        if kb != b || kd != d || qh % kvh != 0 {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!("keys are {:?}", self.keys.dims()),
            });
        }
        let g = qh / kvh;
        // Query heads h = kv * g + i share KV head kv: fold them into the query axis so each
        // KV head's keys are multiplied once for its whole group.
        let q = q.contiguous()?.reshape((b, kvh, g * n, d))?;
        let scores = (q.matmul(&self.keys.t()?)? * scale as f64)?; // (b, kvh, g*n, s)
        let scores = match &self.mask {
            Some(mask) => scores
                .reshape((b, kvh, g, n, s))?
                .broadcast_add(&mask.unsqueeze(1)?)?
                .reshape((b, kvh, g * n, s))?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = probs.matmul(&self.values)?; // (b, kvh, g*n, dv)
        Ok(out.reshape((b, qh, n, dv))?)
    }

    /// Plain attention without the fused softmax, in f64-free f32 steps: the reference the
    /// tests hold [`AttentionRead::attend`] to.
    pub fn attend_reference(&self, q: &Tensor, scale: f32) -> Result<Tensor, KvError> {
        let (b, qh, n, d) = q.dims4()?;
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
        let _ = (b, n, d);
        Ok(Tensor::cat(&heads, 1)?)
    }
}
