//! The fused chunk read of any host storage: a causal window of queries (prefill, or a
//! speculative window) attended straight from the stored planes, through the tile source
//! the decode read uses and in the decode read's reduction order
//! ([`crate::read::piece`]), so a query inside a chunk gets the bits it would get alone.
//!
//! Each work item is one (row, KV head, block of queries) with the query heads of that KV
//! head folded in. It walks the pieces its queries see: a piece's keys and values are
//! decoded once for the whole block (sub-tile by sub-tile, never the whole cache), each
//! query scores and accumulates the part of the piece it sees, and folds the piece into its
//! own running state. Items run across the CPU pool.

use crate::planes::{ChunkGeometry, RowSpan};
use crate::read::decode::TileSource;
use crate::read::piece::{Dims, PieceReader, Softmax, PIECE};
use crate::Isa;
use candle_core::Tensor;
use std::ops::Range;

/// Queries per work item: a block's decoded piece serves all of them.
const QUERY_BLOCK: usize = 32;

/// Real queries `i0 .. i0 + len` of row `r`, KV head `h`: their outputs, query-major
/// `(len, group, value_dim)`.
#[allow(clippy::too_many_arguments)]
fn attend_block<S: TileSource>(
    q: &[f32],
    source: &S,
    reader: &PieceReader,
    geo: &ChunkGeometry,
    r: usize,
    h: usize,
    i0: usize,
    len: usize,
    scale: f32,
) -> Vec<f32> {
    let Dims {
        group: g,
        head_dim: d,
        value_dim: dv,
    } = reader.dims;
    let (n, block) = (geo.queries, r * geo.kv_heads + h);
    // Query-major: each query's heads side by side, as the decode read holds one query.
    let mut qb = vec![0f32; len * g * d];
    for qi in 0..len {
        for hh in 0..g {
            let src = &q[((block * g + hh) * n + i0 + qi) * d..][..d];
            let dst = &mut qb[(qi * g + hh) * d..][..d];
            for (o, x) in dst.iter_mut().zip(src) {
                *o = x * scale;
            }
            source.prepare_query(block, dst);
        }
    }
    let visible: Vec<Range<usize>> = (i0..i0 + len).map(|i| geo.visible(r, i)).collect();
    let lo = visible.iter().map(|v| v.start).min().unwrap_or(0);
    let hi = visible.iter().map(|v| v.end).max().unwrap_or(0);
    // Slot j of the read holds the row's own position first + j − pad.
    let RowSpan { pad, first, .. } = geo.rows[r];
    let mut states: Vec<Softmax> = (0..len).map(|_| Softmax::empty(reader.dims)).collect();
    let mut p0 = lo;
    while p0 < hi {
        let position = (first + p0).saturating_sub(pad);
        let p1 = (p0 + PIECE - position % PIECE).min(hi);
        let spans: Vec<Range<usize>> = visible
            .iter()
            .map(|v| {
                let (a, b) = (v.start.max(p0), v.end.min(p1));
                if a < b {
                    a - p0..b - p0
                } else {
                    0..0
                }
            })
            .collect();
        let pieces = reader.attend(source, block, &[p0..p1], &qb, &spans);
        for (state, piece) in states.iter_mut().zip(pieces) {
            if let Some(piece) = piece {
                state.fold(&piece);
            }
        }
        p0 = p1;
    }
    let mut out = vec![0f32; len * g * dv];
    for (state, o) in states.iter().zip(out.chunks_exact_mut(g * dv)) {
        state.output(o);
    }
    out.chunks_exact_mut(dv)
        .for_each(|row| source.finish_output(block, row));
    out
}

/// A left-padded row's padding queries `0 .. len`: each sees only its own slot, so its
/// (discarded, finite) output is that slot's value. Query-major `(len, group, value_dim)`.
fn attend_padding<S: TileSource>(
    source: &S,
    geo: &ChunkGeometry,
    dims: Dims,
    r: usize,
    h: usize,
    len: usize,
) -> Vec<f32> {
    let (g, dv) = (dims.group, dims.value_dim);
    let block = r * geo.kv_heads + h;
    let mut out = vec![0f32; len * g * dv];
    let mut value = vec![0f32; dv];
    for qi in 0..len {
        let slot = geo.visible(r, qi).start;
        source.values(block, slot..slot + 1, &mut value);
        source.finish_output(block, &mut value);
        for hh in 0..g {
            out[(qi * g + hh) * dv..][..dv].copy_from_slice(&value);
        }
    }
    out
}

/// Attends `q` `(rows, kv_heads * group, queries, head_dim)` over slots `0 .. geo.slots` of
/// `source`'s planes with the kernels of `isa` (the level `source` was made for). Returns
/// `(rows, kv_heads * group, queries, value_dim)`.
pub(crate) fn attend_source<S: TileSource>(
    q: &Tensor,
    source: &S,
    geo: &ChunkGeometry,
    scale: f32,
    isa: Isa,
) -> candle_core::Result<Tensor> {
    let (b, qh, n, d) = q.dims4()?;
    if b != geo.rows.len() || d != geo.head_dim || n != geo.queries || qh % geo.kv_heads != 0 {
        candle_core::bail!(
            "a chunk read of {} queries over {} rows of {} KV heads, head_dim {}, given queries {:?}",
            geo.queries,
            geo.rows.len(),
            geo.kv_heads,
            geo.head_dim,
            q.dims()
        );
    }
    let dims = Dims {
        group: qh / geo.kv_heads,
        head_dim: d,
        value_dim: geo.value_dim,
    };
    let reader = PieceReader::new(isa, dims);
    let rows = geo.rows.len();
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let (g, dv) = (dims.group, dims.value_dim);
    // (row, KV head, first query, queries, padding)
    let mut items = Vec::new();
    for r in 0..rows {
        let padding = (0..n).take_while(|&i| geo.is_padding(r, i)).count();
        for h in 0..geo.kv_heads {
            if padding > 0 {
                items.push((r, h, 0, padding, true));
            }
            for i0 in (padding..n).step_by(QUERY_BLOCK) {
                items.push((r, h, i0, QUERY_BLOCK.min(n - i0), false));
            }
        }
    }
    // The blocks seeing the most keys first, so the pool's last items are short ones.
    items.sort_by_key(|&(_, _, i0, len, _)| std::cmp::Reverse(i0 + len));
    let outs: Vec<std::sync::Mutex<Vec<f32>>> = items
        .iter()
        .map(|_| std::sync::Mutex::new(Vec::new()))
        .collect();
    candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
        for i in range {
            let (r, h, i0, len, padding) = items[i];
            let out = match padding {
                true => attend_padding(source, geo, dims, r, h, len),
                false => attend_block(&qv, source, &reader, geo, r, h, i0, len, scale),
            };
            *outs[i].lock().unwrap_or_else(|e| e.into_inner()) = out;
        }
    });
    let mut out = vec![0f32; rows * geo.kv_heads * g * n * dv];
    for ((r, h, i0, len, _), block) in items.into_iter().zip(outs) {
        let block = block.into_inner().unwrap_or_else(|e| e.into_inner());
        for qi in 0..len {
            for hh in 0..g {
                let dst = (((r * geo.kv_heads + h) * g + hh) * n + i0 + qi) * dv;
                out[dst..dst + dv].copy_from_slice(&block[(qi * g + hh) * dv..][..dv]);
            }
        }
    }
    Tensor::from_vec(out, (rows, geo.kv_heads * g, n, dv), q.device())
}
