//! Dense attention over gathered f32 keys and values, and the masks that say which keys each
//! query sees, written from the same visibility the fused reads use.

use crate::planes::{ChunkGeometry, RowSlots};
use crate::KvError;
use candle_core::{Device, Tensor, D};

/// Queries per block of a chunked (causal) dense read.
const QUERY_BLOCK: usize = 128;

/// Scaled dot-product attention of `q` `(b, q_heads, n, d)` over `keys`/`values`
/// `(b, kv_heads, s, dim)` with an optional additive mask `(b, 1, n, s)`. With `ends`, query
/// `i` of every row sees no key at or past `ends[i]`: causal chunks are attended in blocks of
/// queries, each against the keys up to its last query's bound only.
pub(crate) fn attend_dense(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: Option<&Tensor>,
    ends: Option<&[usize]>,
    scale: f32,
) -> Result<Tensor, KvError> {
    let (b, qh, n, d) = q.dims4()?;
    let (kb, kvh, s, kd) = keys.dims4()?;
    if kb != b || kd != d || qh % kvh != 0 {
        return Err(KvError::QueryShape {
            got: q.dims().to_vec(),
            detail: format!("keys are {:?}", keys.dims()),
        });
    }
    if let (Some(mask), Some(ends), true) = (mask, ends, n > QUERY_BLOCK) {
        let mut outs = Vec::with_capacity(n.div_ceil(QUERY_BLOCK));
        for i0 in (0..n).step_by(QUERY_BLOCK) {
            let len = QUERY_BLOCK.min(n - i0);
            let limit = ends[i0 + len - 1].clamp(1, s);
            outs.push(attend_block(
                &q.narrow(2, i0, len)?,
                &keys.narrow(2, 0, limit)?,
                &values.narrow(2, 0, limit)?,
                Some(&mask.narrow(2, i0, len)?.narrow(3, 0, limit)?),
                scale,
            )?);
        }
        return Ok(Tensor::cat(&outs, 2)?);
    }
    attend_block(q, keys, values, mask, scale)
}

fn attend_block(
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

/// Plain attention, one query head at a time with an explicit softmax.
pub(crate) fn attend_reference(
    q: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: Option<&Tensor>,
    scale: f32,
) -> Result<Tensor, KvError> {
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

/// The additive mask `(rows, 1, queries, keys)` in which query `i` of row `r` sees key `j`
/// exactly where `visible(r, i, j)`.
pub(crate) fn mask_of(
    rows: usize,
    queries: usize,
    keys: usize,
    visible: impl Fn(usize, usize, usize) -> bool,
    device: &Device,
) -> Result<Tensor, KvError> {
    let mut data = vec![f32::NEG_INFINITY; rows * queries * keys];
    for r in 0..rows {
        for i in 0..queries {
            let line = &mut data[(r * queries + i) * keys..][..keys];
            for (j, m) in line.iter_mut().enumerate() {
                if visible(r, i, j) {
                    *m = 0.0;
                }
            }
        }
    }
    Ok(Tensor::from_vec(data, (rows, 1, queries, keys), device)?)
}

/// The mask of a chunk read over slots `0 .. geometry.slots`, or `None` when every query sees
/// every slot.
pub(crate) fn chunk_mask(g: &ChunkGeometry, device: &Device) -> Result<Option<Tensor>, KvError> {
    let all = (0..g.rows.len()).all(|r| (0..g.queries).all(|i| g.visible(r, i) == (0..g.slots)));
    if all {
        return Ok(None);
    }
    let spans: Vec<Vec<std::ops::Range<usize>>> = (0..g.rows.len())
        .map(|r| (0..g.queries).map(|i| g.visible(r, i)).collect())
        .collect();
    Ok(Some(mask_of(
        g.rows.len(),
        g.queries,
        g.slots,
        |r, i, j| spans[r][i].contains(&j),
        device,
    )?))
}

/// The mask of a decode read over slots `0 .. capacity`: each row sees its listed slots.
pub(crate) fn slots_mask(
    rows: &[RowSlots],
    capacity: usize,
    device: &Device,
) -> Result<Tensor, KvError> {
    mask_of(
        rows.len(),
        1,
        capacity,
        |r, _, j| rows[r].ranges.iter().any(|range| range.contains(&j)),
        device,
    )
}
