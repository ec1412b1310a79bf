//! The one reduction order of every CPU attention read, so that a query's output has the
//! same bits whether it is read alone (a decode step), beside other rows of a batch, or
//! inside a chunk of any length (a prefill chunk, a speculative window).
//!
//! A query's visible positions are cut into pieces at multiples of [`PIECE`] of its row's
//! own positions (padding not counted), so a position falls in the same piece for every
//! query of the row that sees it, however the query was batched or chunked. Inside a piece
//! each score is one dot product in the tile kernels' fixed lane order (a key's score does
//! not depend on the keys beside it); then the piece's maximum, `exp(score − max)` and the
//! weights' sum in position order, and the values accumulated in position order, one fused
//! multiply-add per position and output element. The pieces' states are folded in position
//! order ([`Softmax::fold`]) and the output is the folded sum over the folded weight.
//! Nothing depends on how many queries, rows or heads share a call, nor on how a piece's
//! positions are split into sub-tiles or slot ranges (a ring's wrap).

use crate::read::decode::{accumulate, exp_nonpositive, score, TileSource, Tiles};
use crate::Isa;
use std::ops::Range;

/// Positions per piece: small enough to spread a decode of moderate depth over both cores,
/// large enough that folding the pieces stays negligible.
pub(crate) const PIECE: usize = 256;

/// Positions decoded into f32 at a time inside a piece: a tile of 32 rows of 256 stays in L1.
const SUB_TILE: usize = 32;

/// The pieces of one query's visible slots `ranges` (in position order; two where a ring
/// wrapped), the first of which holds the row's position `first_position`: each piece the
/// slot ranges it spans (two where it crosses the wrap), in position order.
pub(crate) fn pieces(ranges: &[Range<usize>], first_position: usize) -> Vec<Vec<Range<usize>>> {
    let mut out: Vec<Vec<Range<usize>>> = Vec::new();
    let mut position = first_position;
    let mut room = 0; // positions the current piece still takes
    for range in ranges {
        let mut slot = range.start;
        while slot < range.end {
            if room == 0 {
                out.push(Vec::new());
                room = PIECE - position % PIECE;
            }
            let len = room.min(range.end - slot);
            if let Some(piece) = out.last_mut() {
                piece.push(slot..slot + len);
            }
            slot += len;
            position += len;
            room -= len;
        }
    }
    out
}

/// The sizes a piece is attended with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    /// Query heads per KV head.
    pub group: usize,
    pub head_dim: usize,
    pub value_dim: usize,
}

/// The softmax state of `group` query heads over some positions: the running maximum, the
/// weights' sum and the weighted values `(group, value_dim)` (both relative to the maximum).
#[derive(Clone, Debug)]
pub(crate) struct Softmax {
    pub max: Vec<f32>,
    pub sum: Vec<f32>,
    pub acc: Vec<f32>,
}

impl Softmax {
    /// The state over no positions.
    pub fn empty(dims: Dims) -> Self {
        Softmax {
            max: vec![f32::NEG_INFINITY; dims.group],
            sum: vec![0.0; dims.group],
            acc: vec![0.0; dims.group * dims.value_dim],
        }
    }

    /// Folds in the state of the next piece (positions after all folded so far). From the
    /// empty state the piece's own numbers come out exactly (`0 · 0 + x · 1`).
    pub fn fold(&mut self, piece: &Softmax) {
        let dv = self.acc.len() / self.max.len().max(1);
        for h in 0..self.max.len() {
            let max = self.max[h].max(piece.max[h]);
            let (old, new) = ((self.max[h] - max).exp(), (piece.max[h] - max).exp());
            self.max[h] = max;
            self.sum[h] = self.sum[h] * old + piece.sum[h] * new;
            for (a, p) in self.acc[h * dv..(h + 1) * dv]
                .iter_mut()
                .zip(&piece.acc[h * dv..(h + 1) * dv])
            {
                *a = *a * old + *p * new;
            }
        }
    }

    /// The attention output `(group, value_dim)`: the weighted values over the weights' sum.
    pub fn output(&self, out: &mut [f32]) {
        let dv = self.acc.len() / self.max.len().max(1);
        for h in 0..self.max.len() {
            for (o, a) in out[h * dv..(h + 1) * dv]
                .iter_mut()
                .zip(&self.acc[h * dv..(h + 1) * dv])
            {
                *o = *a / self.sum[h];
            }
        }
    }
}

/// Turns rows `h * stride + span` (`g` of them) into `exp(score − row max)` in place; returns
/// each row's max and sum.
#[inline(always)]
fn exponentiate(
    scores: &mut [f32],
    g: usize,
    stride: usize,
    span: Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let mut max = vec![f32::NEG_INFINITY; g];
    let mut sum = vec![0f32; g];
    for h in 0..g {
        let row = &mut scores[h * stride + span.start..h * stride + span.end];
        max[h] = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        for v in row.iter_mut() {
            *v = exp_nonpositive(*v - max[h]);
        }
        sum[h] = row.iter().sum();
    }
    (max, sum)
}

/// The sub-tiles of a piece's `parts`: `(piece offset, slots)` of at most [`SUB_TILE`].
fn sub_tiles(parts: &[Range<usize>]) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
    parts
        .iter()
        .scan(0, |offset, part| {
            let at = *offset;
            *offset += part.len();
            Some((at, part.clone()))
        })
        .flat_map(|(at, part)| {
            (part.start..part.end)
                .step_by(SUB_TILE)
                .map(move |s| (at + s - part.start, s..(s + SUB_TILE).min(part.end)))
        })
}

/// One piece of KV head `block`'s slots (`parts`, in position order) attended by several
/// queries: `q` holds each query's `group` heads (`head_dim` each, scaled and prepared),
/// `spans[i]` the offsets within the piece query `i` sees (empty: none). Returns each
/// query's state over its span (`None` for an empty span).
#[inline(always)]
fn attend_piece<S: TileSource, const G: usize>(
    source: &S,
    block: usize,
    parts: &[Range<usize>],
    q: &[f32],
    spans: &[Range<usize>],
    dims: Dims,
    tiles: Tiles,
) -> Vec<Option<Softmax>> {
    let Dims {
        group: g,
        head_dim: d,
        value_dim: dv,
    } = dims;
    let n: usize = parts.iter().map(|p| p.len()).sum();
    let mut tile = vec![0f32; SUB_TILE * d.max(dv)];
    let mut scores = vec![0f32; spans.len() * g * n];
    // A group size without its own kernel instance runs one head at a time.
    let (heads, per_call) = if G == g { (1, G) } else { (g, 1) };
    let overlap = |span: &Range<usize>, at: usize, m: usize| {
        let (a, b) = (span.start.max(at), span.end.min(at + m));
        (a < b).then_some(a..b)
    };
    for (at, slots) in sub_tiles(parts) {
        let m = slots.len();
        if !spans.iter().any(|s| overlap(s, at, m).is_some()) {
            continue;
        }
        source.keys(block, slots, &mut tile[..m * d]);
        for (i, span) in spans.iter().enumerate() {
            let Some(seen) = overlap(span, at, m) else {
                continue;
            };
            let keys = &tile[(seen.start - at) * d..];
            for h in 0..heads {
                let qh = &q[(i * g + h) * d..];
                let out = &mut scores[(i * g + h) * n + seen.start..];
                match per_call {
                    1 => score::<1>(tiles, qh, keys, seen.len(), d, out, n),
                    _ => score::<G>(tiles, qh, keys, seen.len(), d, out, n),
                }
            }
        }
    }
    // A loop, not a closure: a closure does not inherit the caller's target features, and
    // the exponential's fused multiply-adds became a libm call each (7% of a prefill).
    let mut states: Vec<Option<Softmax>> = Vec::with_capacity(spans.len());
    for (i, span) in spans.iter().enumerate() {
        states.push(if span.is_empty() {
            None
        } else {
            let (max, sum) = exponentiate(&mut scores[i * g * n..], g, n, span.clone());
            Some(Softmax {
                max,
                sum,
                acc: vec![0f32; g * dv],
            })
        });
    }
    for (at, slots) in sub_tiles(parts) {
        let m = slots.len();
        if !spans.iter().any(|s| overlap(s, at, m).is_some()) {
            continue;
        }
        source.values(block, slots, &mut tile[..m * dv]);
        for (i, span) in spans.iter().enumerate() {
            let (Some(seen), Some(state)) = (overlap(span, at, m), states[i].as_mut()) else {
                continue;
            };
            let values = &tile[(seen.start - at) * dv..];
            for h in 0..heads {
                let w = &scores[(i * g + h) * n + seen.start..];
                let out = &mut state.acc[h * dv..];
                match per_call {
                    1 => accumulate::<1>(tiles, w, n, values, seen.len(), dv, out),
                    _ => accumulate::<G>(tiles, w, n, values, seen.len(), dv, out),
                }
            }
        }
    }
    states
}

#[inline(always)]
fn attend_piece_any<S: TileSource>(
    source: &S,
    block: usize,
    parts: &[Range<usize>],
    q: &[f32],
    spans: &[Range<usize>],
    dims: Dims,
    tiles: Tiles,
) -> Vec<Option<Softmax>> {
    match dims.group {
        2 => attend_piece::<S, 2>(source, block, parts, q, spans, dims, tiles),
        4 => attend_piece::<S, 4>(source, block, parts, q, spans, dims, tiles),
        8 => attend_piece::<S, 8>(source, block, parts, q, spans, dims, tiles),
        _ => attend_piece::<S, 1>(source, block, parts, q, spans, dims, tiles),
    }
}

/// [`attend_piece_any`] compiled for AVX2, so the source's decoding and the softmax inlined
/// into it use the wider vectors too.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_piece_avx2<S: TileSource>(
    source: &S,
    block: usize,
    parts: &[Range<usize>],
    q: &[f32],
    spans: &[Range<usize>],
    dims: Dims,
    tiles: Tiles,
) -> Vec<Option<Softmax>> {
    attend_piece_any(source, block, parts, q, spans, dims, tiles)
}

/// [`attend_piece_any`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn attend_piece_avx512<S: TileSource>(
    source: &S,
    block: usize,
    parts: &[Range<usize>],
    q: &[f32],
    spans: &[Range<usize>],
    dims: Dims,
    tiles: Tiles,
) -> Vec<Option<Softmax>> {
    attend_piece_any(source, block, parts, q, spans, dims, tiles)
}

/// How pieces are attended at one level: the tile kernels and the compiled wrapper.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PieceReader {
    isa: Isa,
    tiles: Tiles,
    pub dims: Dims,
}

impl PieceReader {
    /// The reader at `isa` (capped to the CPU's) for `dims`.
    pub fn new(isa: Isa, dims: Dims) -> Self {
        let isa = isa.capped();
        PieceReader {
            isa,
            tiles: Tiles::new(isa, dims.head_dim, dims.value_dim),
            dims,
        }
    }

    /// See [`attend_piece`].
    pub fn attend<S: TileSource>(
        &self,
        source: &S,
        block: usize,
        parts: &[Range<usize>],
        q: &[f32],
        spans: &[Range<usize>],
    ) -> Vec<Option<Softmax>> {
        let (dims, tiles) = (self.dims, self.tiles);
        // SAFETY (both): `isa` was capped to the CPU's level in `new`, so the CPU has every
        // feature the wrapper is compiled for.
        #[cfg(target_arch = "x86_64")]
        if self.isa.avx512() {
            return unsafe { attend_piece_avx512(source, block, parts, q, spans, dims, tiles) };
        } else if self.isa.avx2() {
            return unsafe { attend_piece_avx2(source, block, parts, q, spans, dims, tiles) };
        }
        attend_piece_any(source, block, parts, q, spans, dims, tiles)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cut_at_the_rows_positions_across_a_wrap() {
        // A full row from position 0: pieces of PIECE slots.
        assert_eq!(
            pieces(&[0..600], 0),
            vec![vec![0..256], vec![256..512], vec![512..600]]
        );
        // Padded by 7: the same positions, so the same cuts, 7 slots later.
        assert_eq!(
            pieces(&[7..607], 0),
            vec![vec![7..263], vec![263..519], vec![519..607]]
        );
        // A ring's window from position 300, wrapped at slot 520: the piece of positions
        // 512..768 spans the wrap.
        assert_eq!(
            pieces(&[300..520, 0..100], 300),
            vec![vec![300..512], vec![512..520, 0..100]]
        );
        assert!(pieces(&[], 5).is_empty());
    }
}
