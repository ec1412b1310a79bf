//! The fused chunk read of quantized storage (affine here; turbo through its tile source): a
//! causal window of queries (prefill, or a speculative window) attended straight from the
//! packed codes, flash-attention style.
//!
//! Each work item is one (row, KV head, block of queries) with the query heads of that KV
//! head folded in. It walks the visible key slots in tiles: a tile is dequantized into a
//! small buffer (never the whole cache), scored with one matrix product, masked, folded into
//! a running softmax, and its values accumulated with a second product. Items run across the
//! CPU pool; the products are single-threaded inside an item.

use crate::planes::affine::{AffinePlanes, PlaneView};
use crate::planes::ChunkGeometry;
use crate::read::affine_tiles::unpack;
use crate::read::decode::TileSource;
use candle_core::Tensor;
use std::ops::Range;

/// Queries per work item, and key slots per tile. Sized so an item's buffers stay in L2.
const QUERY_BLOCK: usize = 32;
const KEY_TILE: usize = 128;

/// Dequantizes `slots` of one plane block into rows of `dim` f32 values.
fn dequantize_tile(
    view: &PlaneView,
    bits: u8,
    group: usize,
    dim: usize,
    slots: Range<usize>,
    out: &mut [f32],
) {
    for (slot, row) in slots.zip(out.chunks_exact_mut(dim)) {
        match bits {
            2 => unpack::<2>(view.codes(slot), row),
            3 => unpack::<3>(view.codes(slot), row),
            4 => unpack::<4>(view.codes(slot), row),
            5 => unpack::<5>(view.codes(slot), row),
            6 => unpack::<6>(view.codes(slot), row),
            8 => unpack::<8>(view.codes(slot), row),
            _ => unreachable!("affine bits are validated when the scheme is parsed"),
        }
        for (values, p) in row
            .chunks_exact_mut(group)
            .zip(view.params(slot).chunks_exact(2))
        {
            let (s, b) = (p[0].to_f32(), p[1].to_f32());
            values.iter_mut().for_each(|v| *v = s * *v + b);
        }
    }
}

/// `dst (m × n) = [dst +] lhs (m × k) · rhs`, all row-major; `rhs_t` says `rhs` is stored
/// transposed (`n × k`).
#[allow(clippy::too_many_arguments)]
fn matmul(
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    rhs: &[f32],
    rhs_t: bool,
    m: usize,
    n: usize,
    k: usize,
) {
    assert!(dst.len() >= m * n && lhs.len() >= m * k && rhs.len() >= k * n);
    let (rhs_cs, rhs_rs) = if rhs_t { (k, 1) } else { (1, n) };
    // SAFETY: the slices hold every element the strides reach (asserted above).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// One work item: rows `r` of the output for KV head `h`, queries `i0 .. i0 + len`.
#[allow(clippy::too_many_arguments)]
fn attend_block<S: TileSource>(
    q: &[f32],
    source: &S,
    geo: &ChunkGeometry,
    r: usize,
    h: usize,
    i0: usize,
    len: usize,
    scale: f32,
) -> Vec<f32> {
    let (g, d, dv, n) = (geo.group, geo.head_dim, geo.value_dim, geo.queries);
    let m = g * len; // query rows: head-major, then query
    let mut qb = vec![0f32; m * d];
    for hh in 0..g {
        let src = &q[(((r * geo.kv_heads + h) * g + hh) * n + i0) * d..][..len * d];
        for (dst, s) in qb[hh * len * d..][..len * d].iter_mut().zip(src) {
            *dst = s * scale;
        }
    }
    qb.chunks_exact_mut(d)
        .for_each(|row| source.prepare_query(r * geo.kv_heads + h, row));
    let visible: Vec<Range<usize>> = (i0..i0 + len)
        .map(|i| match geo.is_padding(r, i) {
            true => 0..0,
            false => geo.visible(r, i),
        })
        .collect();
    // Tiles start at the first slot a real query sees; a padding query (which sees only its
    // own slot, and whose output is never used) is read after them. Tiles that began at
    // its slot would put the row's masked padding into every real query's products, and
    // the sums' order over slots (so their last bits, on some CPUs' matmul) would depend
    // on how the row was padded rather than on its prompt.
    let lo = visible
        .iter()
        .filter(|v| !v.is_empty())
        .map(|v| v.start)
        .min()
        .unwrap_or(0);
    let hi = visible.iter().map(|v| v.end).max().unwrap_or(0);
    let block = r * geo.kv_heads + h;
    let mut kt = vec![0f32; KEY_TILE * d];
    let mut vt = vec![0f32; KEY_TILE * dv];
    let mut scores = vec![0f32; m * KEY_TILE];
    let mut max = vec![f32::NEG_INFINITY; m];
    let mut sum = vec![0f32; m];
    let mut acc = vec![0f32; m * dv];
    let mut t0 = lo;
    while t0 < hi {
        let t = KEY_TILE.min(hi - t0);
        source.keys(block, t0..t0 + t, &mut kt[..t * d]);
        source.values(block, t0..t0 + t, &mut vt[..t * dv]);
        matmul(&mut scores, false, &qb, &kt, true, m, t, d);
        for row in 0..m {
            let vis = &visible[row % len];
            let line = &mut scores[row * t..(row + 1) * t];
            // Slots of this tile the query sees: [a, b) in tile coordinates.
            let a = vis.start.clamp(t0, t0 + t) - t0;
            let b = vis.end.clamp(t0, t0 + t) - t0;
            line[..a].iter_mut().for_each(|s| *s = 0.0);
            line[b..].iter_mut().for_each(|s| *s = 0.0);
            if a >= b {
                continue;
            }
            let tile_max = line[a..b].iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let new_max = max[row].max(tile_max);
            let rescale = (max[row] - new_max).exp();
            if rescale != 1.0 {
                sum[row] *= rescale;
                acc[row * dv..(row + 1) * dv]
                    .iter_mut()
                    .for_each(|o| *o *= rescale);
            }
            max[row] = new_max;
            for s in &mut line[a..b] {
                *s = (*s - new_max).exp();
                sum[row] += *s;
            }
        }
        matmul(&mut acc, true, &scores, &vt, false, m, dv, t);
        t0 += t;
    }
    // A padding query's softmax over its one slot is 1: its output is that slot's value.
    for qi in (0..len).filter(|&qi| geo.is_padding(r, i0 + qi)) {
        let slot = geo.visible(r, i0 + qi).start;
        source.values(block, slot..slot + 1, &mut vt[..dv]);
        for hh in 0..g {
            let row = hh * len + qi;
            acc[row * dv..(row + 1) * dv].copy_from_slice(&vt[..dv]);
            sum[row] = 1.0;
        }
    }
    for row in 0..m {
        let inv = 1.0 / sum[row];
        acc[row * dv..(row + 1) * dv]
            .iter_mut()
            .for_each(|o| *o *= inv);
    }
    acc.chunks_exact_mut(dv)
        .for_each(|row| source.finish_output(r * geo.kv_heads + h, row));
    acc
}

/// Affine planes as a tile source for chunks: rows dequantized in element order.
struct AffineTiles<'a> {
    planes: &'a AffinePlanes,
}

impl TileSource for AffineTiles<'_> {
    fn keys(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let (keys, _) = self.planes.views(block);
        let (_, d, _) = self.planes.geometry3();
        dequantize_tile(
            &keys,
            self.planes.bits(),
            self.planes.group(),
            d,
            slots,
            out,
        );
    }

    fn values(&self, block: usize, slots: Range<usize>, out: &mut [f32]) {
        let (_, values) = self.planes.views(block);
        let (_, _, dv) = self.planes.geometry3();
        dequantize_tile(
            &values,
            self.planes.bits(),
            self.planes.group(),
            dv,
            slots,
            out,
        );
    }
}

/// Attends `q` `(rows, kv_heads * group, queries, head_dim)` over slots `0 .. geo.slots` of
/// affine `planes`. Returns `(rows, kv_heads * group, queries, value_dim)`.
pub(crate) fn attend(
    q: &Tensor,
    planes: &AffinePlanes,
    geo: &ChunkGeometry,
    scale: f32,
) -> candle_core::Result<Tensor> {
    attend_source(q, &AffineTiles { planes }, geo, scale)
}

/// The chunk read over any tile source (affine, turbo).
pub(crate) fn attend_source<S: TileSource>(
    q: &Tensor,
    source: &S,
    geo: &ChunkGeometry,
    scale: f32,
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
    let geo = &ChunkGeometry {
        group: qh / geo.kv_heads,
        ..geo.clone()
    };
    let rows = geo.rows.len();
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let (g, dv) = (geo.group, geo.value_dim);
    let mut items = Vec::new();
    for r in 0..rows {
        // A left-padded row's padding queries are one item, and its real queries are
        // blocked from the first of them, as the same prompt read unpadded would be: a
        // real query's products then have the same shapes (and bits) either way.
        let padding = (0..n).take_while(|&i| geo.is_padding(r, i)).count();
        for h in 0..geo.kv_heads {
            if padding > 0 {
                items.push((r, h, 0, padding));
            }
            for i0 in (padding..n).step_by(QUERY_BLOCK) {
                items.push((r, h, i0, QUERY_BLOCK.min(n - i0)));
            }
        }
    }
    let outs: Vec<std::sync::Mutex<Vec<f32>>> = items
        .iter()
        .map(|_| std::sync::Mutex::new(Vec::new()))
        .collect();
    candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
        for i in range {
            let (r, h, i0, len) = items[i];
            *outs[i].lock().unwrap_or_else(|e| e.into_inner()) =
                attend_block(&qv, source, geo, r, h, i0, len, scale);
        }
    });
    let mut out = vec![0f32; rows * geo.kv_heads * g * n * dv];
    for ((r, h, i0, len), block) in items.into_iter().zip(outs) {
        let block = block.into_inner().unwrap();
        for hh in 0..g {
            let dst = (((r * geo.kv_heads + h) * g + hh) * n + i0) * dv;
            out[dst..dst + len * dv].copy_from_slice(&block[hh * len * dv..][..len * dv]);
        }
    }
    Tensor::from_vec(out, (rows, geo.kv_heads * g, n, dv), q.device())
}
