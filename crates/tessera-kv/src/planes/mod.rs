//! Storage planes: one codec's keys and values of one layer, `[row, kv_head, slot, field]`.
//!
//! Every storage — plain, affine and TurboQuant on the host, and any codec on a device
//! through the installed backend ([`device`]) — implements the one [`Planes`] trait, so each
//! cache operation (appends, reads, the row operations, state) is written once, against the
//! trait, and a new storage is one `impl`. Planes know slots, never positions: which slot
//! holds which position is the retention policy's ([`crate::retention`]), which positions a
//! row may see is the rows' ([`crate::rows`]).

pub mod affine;
pub mod device;
pub mod plain;
pub mod turbo;

pub use affine::AffinePlanes;
pub use device::{host_planes, install, planes_for, DeviceBackend};
pub use plain::PlainPlanes;
pub use turbo::{TurboPlanes, TurboTables};

use crate::{Codec, Isa, KvError, TurboPrep};
use candle_core::Tensor;
use std::any::Any;
use std::ops::Range;

/// `(rows, heads, head_dim, value_dim)` of a layer's planes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaneGeometry {
    pub rows: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub value_dim: usize,
}

/// The slots one row of a decode read attends: up to two ranges (a ring that wrapped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowSlots {
    pub ranges: Vec<Range<usize>>,
    /// The row's own position (padding not counted) of the first slot of `ranges`: where
    /// the read's pieces fall ([`crate::read::piece`]).
    pub first_position: usize,
}

impl RowSlots {
    /// The row's slots as one span, when they are one: a ring that has wrapped holds its
    /// whole window in two ranges covering every slot, and attention does not depend on the
    /// order of its positions. `None` for two separate runs (a padded row in a wrapped ring).
    pub fn single_span(&self) -> Option<Range<usize>> {
        match self.ranges.as_slice() {
            [a] => Some(a.clone()),
            [a, b] if b.start == 0 && b.end == a.start => Some(0..a.end),
            _ => None,
        }
    }

    /// The row's slots as one run in position order over planes of `capacity` slots: a
    /// wrapped ring's `[a, capacity)` then `[0, e)` is `a .. capacity + e`, slot `p -
    /// capacity` past the end. A read that walks it sums the row's positions from its
    /// first whatever slot the ring put that in (a device's deterministic mode). `None`
    /// where the ranges are not one run.
    pub fn position_run(&self, capacity: usize) -> Option<Range<usize>> {
        match self.ranges.as_slice() {
            [a] => Some(a.clone()),
            [a, e] if a.end == capacity && e.start == 0 && e.end <= a.start => {
                Some(a.start..capacity + e.end)
            }
            _ => None,
        }
    }
}

/// Where one row of a chunk read sits in time: its queries are physical positions
/// `start ..`, slot `j` of the read's planes holds its position `first + j`, and its first
/// `pad` positions are padding no real query sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowSpan {
    pub pad: usize,
    pub start: usize,
    pub first: usize,
}

/// A causal chunk read: `queries` positions per row over slots `0 .. slots` of planes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkGeometry {
    pub rows: Vec<RowSpan>,
    pub kv_heads: usize,
    /// Query heads per KV head (set from the queries when the read is attended).
    pub group: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub queries: usize,
    /// Slots the read spans (every row's visible slots lie below).
    pub slots: usize,
    /// A sliding window: a query sees only keys less than `window` positions back.
    pub window: Option<usize>,
}

impl ChunkGeometry {
    /// The slots query `i` of row `row` sees: causal, no padding, inside the window. A
    /// padding query sees only itself, so its discarded output stays finite.
    pub fn visible(&self, row: usize, i: usize) -> Range<usize> {
        let RowSpan { pad, start, first } = self.rows[row];
        let q = start + i;
        let lo = if q < pad {
            q
        } else {
            let w = self.window.map_or(0, |w| (q + 1).saturating_sub(w));
            pad.max(w).max(first)
        };
        lo - first..q + 1 - first
    }

    /// Whether query `i` of row `row` is padding (a left-padded row's position below its
    /// prompt).
    pub fn is_padding(&self, row: usize, i: usize) -> bool {
        let RowSpan { pad, start, .. } = self.rows[row];
        start + i < pad
    }

    /// Whether every row's queries start at one position and slot = position (full
    /// retention with aligned rows): what a device's fused chunk kernel takes.
    pub fn aligned(&self) -> Option<usize> {
        let start = self.rows.first()?.start;
        self.rows
            .iter()
            .all(|r| r.start == start && r.first == 0)
            .then_some(start)
    }
}

/// One storage's planes as plain data: the codec, geometry and capacity, and the stored
/// buffers exactly as the host layout holds them (little-endian), in an order each codec
/// documents on its type. A device's planes give the same buffers as the host planes would.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanesState {
    pub codec: Codec,
    pub geometry: PlaneGeometry,
    pub capacity: usize,
    pub buffers: Vec<Vec<u8>>,
}

/// Keys and values of one layer in one codec. Rows are addressed by index, slots by the
/// retention policy; inputs and outputs are `(rows, heads, n, dim)` tensors.
pub trait Planes: std::fmt::Debug + Send + Sync + Any {
    /// The codec the planes hold (with its preparation, for turbo).
    fn codec(&self) -> Codec;
    fn geometry(&self) -> PlaneGeometry;
    fn capacity(&self) -> usize;
    /// Empty planes of the same codec on the same device, for `rows` rows (per-row codec
    /// state, such as a turbo key preparation, is taken over with [`Planes::adopt_row`]).
    fn empty(&self, rows: usize) -> Result<Box<dyn Planes>, KvError>;
    /// Makes room for `slots` slots (growing in [`crate::GROWTH_STEP`] steps, never past
    /// `limit`), keeping the contents.
    fn reserve(&mut self, slots: usize, limit: usize) -> Result<(), KvError>;
    /// Encodes `k`, `v` `(rows.len(), heads, n, dim)` into rows `rows`, slots `slot .. slot + n`.
    fn write(
        &mut self,
        rows: Range<usize>,
        slot: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(), KvError>;
    /// Slots `slot .. slot + len` of rows `rows`, decoded to f32 `(rows.len(), heads, len, dim)`.
    fn read(
        &self,
        rows: Range<usize>,
        slot: usize,
        len: usize,
    ) -> Result<(Tensor, Tensor), KvError>;
    /// Takes over row `src_row`'s per-row codec state (a turbo key preparation) from `src`
    /// (same codec) into row `dst_row`. Codecs without one have nothing to do.
    fn adopt_row(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        dst_row: usize,
    ) -> Result<(), KvError> {
        let _ = (src, src_row, dst_row);
        Ok(())
    }
    /// Whether [`Planes::resize_rows`] moves rows where they lie (the host's planes); where
    /// not, row operations build new planes.
    fn resizes_rows_in_place(&self) -> bool {
        false
    }
    /// Keeps rows `keep` ([`keeps_in_place`]), each moved to its index in `keep` with every
    /// slot as stored, then adds `added` empty rows after them, in place: rows that stay at
    /// their index are not touched. Only where [`Planes::resizes_rows_in_place`].
    fn resize_rows(&mut self, keep: &[usize], added: usize) -> Result<(), KvError> {
        let _ = (keep, added);
        Err(KvError::Rows(format!(
            "{} planes here do not move rows in place",
            self.codec()
        )))
    }
    /// Copies `len` stored slots of row `src_row` of `src` (same codec, same device) from
    /// `src_slot` into row `dst_row` from `dst_slot`: the stored codes as they are, never
    /// requantized.
    fn copy_from(
        &mut self,
        src: &dyn Planes,
        src_row: usize,
        src_slot: usize,
        dst_row: usize,
        dst_slot: usize,
        len: usize,
    ) -> Result<(), KvError>;
    /// Fits each row's key preparation on `k` `(rows, heads, n, head_dim)` (what the bf16
    /// stage holds at conversion), over the slots `live[row]` of each row, before anything
    /// is written: turbo planes their `prep`, the scales weighted by the queries' mean
    /// squares `queries` (`heads × head_dim`) where the layer has seen any; affine planes
    /// their key means alone. Plain planes ignore it.
    fn fit_key_prep(
        &mut self,
        k: &Tensor,
        live: &[Range<usize>],
        prep: TurboPrep,
        queries: Option<&[f32]>,
    ) -> Result<(), KvError> {
        let _ = (k, live, prep, queries);
        Ok(())
    }
    /// The fused decode read: `q` `(rows, q_heads, 1, head_dim)`, row `r` over the slots
    /// `rows[r]`. `Ok(None)` where these planes have none (the caller reads densely).
    fn decode(
        &self,
        q: &Tensor,
        rows: &[RowSlots],
        scale: f32,
        isa: Isa,
    ) -> Result<Option<Tensor>, KvError>;
    /// The fused chunk read: `q` `(rows, q_heads, n, head_dim)` as `geometry` places it.
    /// `Ok(None)` where these planes have none (the caller reads densely).
    fn chunk(
        &self,
        q: &Tensor,
        geometry: &ChunkGeometry,
        scale: f32,
        isa: Isa,
    ) -> Result<Option<Tensor>, KvError>;
    /// Whether these planes take live decode steps ([`Planes::live_spans`]): device planes
    /// whose kernels read a step's positions from device memory.
    fn serves_live(&self) -> bool {
        false
    }
    /// What [`Planes::live_spans`] would return for these spans, changing nothing; `None`
    /// where these planes cannot take them.
    fn live_identity(&self, spans: &[(usize, usize)], query_heads: usize) -> Option<u64> {
        let _ = (spans, query_heads);
        None
    }
    /// Sets the positions the next [`Planes::live_step`] runs at, `spans[r] = (start,
    /// slot)`: row `r` writes at `slot` and reads slots `start ..= slot`. They are kept in
    /// device memory, and uploaded only where they differ from what the previous live step
    /// left there (each advances every slot by one). `query_heads` sizes the read. Returns
    /// the identity of every buffer a live step touches: a live step captured in a device
    /// graph replays correctly while it stays the same.
    fn live_spans(&mut self, spans: &[(usize, usize)], query_heads: usize) -> Result<u64, KvError> {
        let _ = (spans, query_heads);
        Err(KvError::Device(format!(
            "live decode steps on {} planes",
            self.codec()
        )))
    }
    /// Sets the device's positions back to what the last [`Planes::live_spans`] set (a
    /// step run again: its writes land where they did, its reads read the same).
    fn live_rewind(&mut self) -> Result<(), KvError> {
        Err(KvError::Device(format!(
            "live decode steps on {} planes",
            self.codec()
        )))
    }
    /// One decode step at the positions [`Planes::live_spans`] set: `k`, `v` `(rows, heads,
    /// 1, dim)` stored at each row's slot, `q` `(rows, q_heads, 1, head_dim)` read over
    /// `start ..= slot`, then every slot advanced by one, on the device. Queues device work
    /// only (nothing uploaded or read back), so a device graph can capture it.
    fn live_step(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
    ) -> Result<Tensor, KvError> {
        let _ = (q, k, v, scale);
        Err(KvError::Device(format!(
            "live decode steps on {} planes",
            self.codec()
        )))
    }
    fn allocated_bytes(&self) -> usize;
    /// Encoded bytes of one position of one row, keys and values.
    fn bytes_per_position(&self) -> usize;
    /// The stored planes as host data ([`PlanesState`]).
    fn state(&self) -> Result<PlanesState, KvError>;
    /// Replaces the contents with `state` (same codec and geometry; what [`Planes::state`]
    /// gave).
    fn restore(&mut self, state: &PlanesState) -> Result<(), KvError>;
    fn as_any(&self) -> &dyn Any;
}

/// Planes a read uses: the cache's own, or planes the same append retired (the bf16 stage a
/// converting append is read from) or built for itself (a ring's span).
#[derive(Debug)]
pub(crate) enum PlanesRef<'a> {
    Borrowed(&'a dyn Planes),
    Owned(Box<dyn Planes>),
}

impl PlanesRef<'_> {
    pub fn get(&self) -> &dyn Planes {
        match self {
            PlanesRef::Borrowed(p) => *p,
            PlanesRef::Owned(p) => p.as_ref(),
        }
    }
}

/// `src` as the concrete planes type `T`, or the error naming both codecs.
pub(crate) fn same_kind<'a, T: Planes>(
    src: &'a dyn Planes,
    dst: &dyn Planes,
) -> Result<&'a T, KvError> {
    src.as_any()
        .downcast_ref::<T>()
        .filter(|s| s.codec() == dst.codec())
        .ok_or_else(|| KvError::CodecMismatch {
            expected: dst.codec().to_string(),
            got: src.codec().to_string(),
        })
}

/// Checks that rows `rows`, slots `slot .. slot + n` lie inside `planes`.
pub(crate) fn check_span(
    planes: &dyn Planes,
    rows: &Range<usize>,
    slot: usize,
    n: usize,
) -> Result<(), KvError> {
    let (have, capacity) = (planes.geometry().rows, planes.capacity());
    if rows.end > have || slot + n > capacity {
        return Err(KvError::Rows(format!(
            "{} planes of {have} rows × {capacity} slots addressed at rows {rows:?}, slots {slot}..{}",
            planes.codec(),
            slot + n
        )));
    }
    Ok(())
}

/// Whether `keep` can be moved in place: distinct rows of `rows`, none placed above where
/// it lies (`keep[i] >= i`), so that moving them in index order reads every row before
/// anything overwrites it. A strictly increasing `keep` is such, and so is one whose gaps
/// are filled from the end.
pub fn keeps_in_place(keep: &[usize], rows: usize) -> bool {
    let mut seen = vec![false; rows];
    keep.iter().enumerate().all(|(i, &r)| {
        let fresh = r < rows && r >= i && !seen[r];
        if fresh {
            seen[r] = true;
        }
        fresh
    })
}

/// `x` `(rows, heads, n, dim)` as f32 values rounded to bf16, row-major.
pub(crate) fn bf16_values(x: &Tensor) -> Result<Vec<f32>, KvError> {
    Ok(x.to_dtype(candle_core::DType::BF16)?
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

/// What reads return once `x` `(b, heads, n, dim)` is stored from row `row` on: each head
/// vector prepared with its (row, head)'s block of `prep`, coded and decoded by `code`
/// (prepared vector in, decoded vector out), the preparation then undone.
pub(crate) fn as_stored_by(
    x: &Tensor,
    row: usize,
    heads: usize,
    prep: &crate::codec::prep::ChannelPrep,
    mut code: impl FnMut(&[f32], &mut [f32]),
) -> Result<Tensor, KvError> {
    let (b, h, n, d) = x.dims4()?;
    let values = bf16_values(x)?;
    let mut out = vec![0f32; values.len()];
    let mut prepared = vec![0f32; d];
    for (i, (src, dst)) in values
        .chunks_exact(d)
        .zip(out.chunks_exact_mut(d))
        .enumerate()
    {
        let block = (row + i / (n * h)) * heads + (i / n) % h;
        prep.encode(block, src, &mut prepared);
        code(&prepared, dst);
        prep.decode(block, dst);
    }
    Ok(Tensor::from_vec(out, (b, h, n, d), x.device())?)
}

/// Refuses an [`Planes::adopt_row`] of a row either side does not hold.
pub(crate) fn check_adopt(
    src_row: usize,
    src_rows: usize,
    dst_row: usize,
    dst_rows: usize,
) -> Result<(), KvError> {
    if src_row >= src_rows || dst_row >= dst_rows {
        return Err(KvError::Rows(format!(
            "adopt row {src_row} of {src_rows} into row {dst_row} of {dst_rows}"
        )));
    }
    Ok(())
}

/// Refuses a `keep` that [`keeps_in_place`] does not take.
pub(crate) fn check_keep(keep: &[usize], rows: usize) -> Result<(), KvError> {
    if !keeps_in_place(keep, rows) {
        return Err(KvError::Rows(format!(
            "rows {keep:?} of {rows} kept in place (distinct, each at or after its place)"
        )));
    }
    Ok(())
}

/// [`Planes::resize_rows`] on one buffer of `per_row` elements a row: kept rows moved
/// (`keep` checked by [`check_keep`]), then `added` rows of `fill`. Growing takes the
/// vector's amortized reallocation, so a row joining a batch copies the others only when
/// the buffer runs out of room.
pub(crate) fn resize_rows<T: Copy>(
    buf: &mut Vec<T>,
    per_row: usize,
    keep: &[usize],
    added: usize,
    fill: T,
) {
    for (to, &from) in keep.iter().enumerate() {
        if from != to {
            // from > to: the destination ends where the source starts at the latest, and
            // row `to` is read by no later move (it is kept, if at all, at its own place).
            buf.copy_within(from * per_row..(from + 1) * per_row, to * per_row);
        }
    }
    buf.truncate(keep.len() * per_row);
    buf.resize((keep.len() + added) * per_row, fill);
}

/// Copies `len` slots of `per_slot` elements from slot `from` of `src` to slot `to` of `dst`.
pub(crate) fn copy_slots<T: Copy>(
    dst: &mut [T],
    src: &[T],
    per_slot: usize,
    from: usize,
    to: usize,
    len: usize,
) {
    dst[to * per_slot..(to + len) * per_slot]
        .copy_from_slice(&src[from * per_slot..(from + len) * per_slot]);
}

/// Checks a state against the planes it is restored into.
pub(crate) fn check_state(
    planes: &dyn Planes,
    state: &PlanesState,
    buffers: usize,
) -> Result<(), KvError> {
    if state.codec != planes.codec()
        || state.geometry != planes.geometry()
        || state.buffers.len() != buffers
    {
        return Err(KvError::BadState(format!(
            "planes of {} {:?} given a state of {} {:?} with {} buffers",
            planes.codec(),
            planes.geometry(),
            state.codec,
            state.geometry,
            state.buffers.len()
        )));
    }
    Ok(())
}

/// Little-endian bytes of a slice of plain values, and back.
pub(crate) fn to_bytes<T: bytemuck::Pod>(x: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(x).to_vec()
}

pub(crate) fn from_bytes<T: bytemuck::Pod>(b: &[u8], what: &str) -> Result<Vec<T>, KvError> {
    if !b.len().is_multiple_of(std::mem::size_of::<T>()) {
        return Err(KvError::BadState(format!("{what}: {} bytes", b.len())));
    }
    Ok(bytemuck::pod_collect_to_vec(b))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_wrapped_ring_is_one_run_in_position_order() {
        let row = |ranges: Vec<std::ops::Range<usize>>| super::RowSlots {
            ranges,
            first_position: 0,
        };
        assert_eq!(row(vec![3..9]).position_run(16), Some(3..9));
        // Oldest positions in slots 10..16, the newest in 0..4: one run 10..20.
        assert_eq!(row(vec![10..16, 0..4]).position_run(16), Some(10..20));
        // The whole ring, wrapped at slot 5.
        assert_eq!(row(vec![5..16, 0..5]).position_run(16), Some(5..21));
        // Not one run: a gap before the end, or ranges that overlap.
        assert_eq!(row(vec![10..15, 0..4]).position_run(16), None);
        assert_eq!(row(vec![10..16, 0..12]).position_run(16), None);
        assert_eq!(row(vec![10..16, 2..4]).position_run(16), None);
    }

    use super::{keeps_in_place, resize_rows};

    #[test]
    fn rows_kept_in_place_move_down_only_and_read_before_written() {
        assert!(keeps_in_place(&[0, 1, 2], 3));
        assert!(keeps_in_place(&[0, 2], 3));
        assert!(keeps_in_place(&[0, 4, 2, 3], 5));
        assert!(keeps_in_place(&[], 3));
        assert!(!keeps_in_place(&[1, 0], 2), "row 0 placed above itself");
        assert!(!keeps_in_place(&[2, 2], 3), "a row twice");
        assert!(!keeps_in_place(&[0, 3], 3), "a row out of range");
        // Rows of three elements, row r holding 10r, 10r+1, 10r+2.
        let rows = |r: &[usize]| -> Vec<u32> {
            r.iter()
                .flat_map(|&r| (0..3).map(move |i| 10 * r as u32 + i))
                .collect()
        };
        for (keep, added) in [(vec![0, 4, 2, 3], 2), (vec![1, 3], 0), (vec![], 1)] {
            let mut buf = rows(&[0, 1, 2, 3, 4]);
            resize_rows(&mut buf, 3, &keep, added, 99);
            let mut want = rows(&keep);
            want.extend(std::iter::repeat_n(99, 3 * added));
            assert_eq!(buf, want, "keep {keep:?}, added {added}");
        }
    }
}
