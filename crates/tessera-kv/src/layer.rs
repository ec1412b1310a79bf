//! Layer caches: one storage's planes, one retention and the rows, composed. Every append
//! goes through [`LayerCache::append`]; every row operation through [`LayerCache::relayout`].

use crate::codec::prep::QueryMoments;
use crate::planes::device::{host_planes, planes_on};
use crate::planes::{ChunkGeometry, PlaneGeometry, Planes, PlanesRef, RowSpan};
use crate::read::mask_of;
use crate::retention::Slots;
use crate::rows::Rows;
use crate::{AttentionRead, Codec, Isa, KvError, LayerSpec, PlainDType, Retention};
use candle_core::{Device, Tensor};
use std::ops::Range;

/// What a model's attention layer sees: append new keys and values, get back a read.
/// `k`, `v` are `(rows, kv_heads, n, dim)`; each row's positions are written at its own end.
pub trait AttentionCache {
    /// Appends one decode step (one query position per row) and returns its read.
    fn append_decode(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError>;
    /// Appends a causal chunk of positions (prefill, or a speculative window).
    fn append_window(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError>;
    /// Appends the drafted positions of a speculative round: a causal window read, the same
    /// numbers as [`AttentionCache::append_window`].
    fn append_committed(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError> {
        self.append_window(k, v)
    }
    /// Appends a chunk read causally, OR'd with full attention inside each marked block
    /// (`blocks[row]`: ranges of the chunk's own positions, e.g. an image's tokens).
    fn append_bidirectional(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        blocks: &[Vec<Range<usize>>],
    ) -> Result<AttentionRead<'_>, KvError>;
    /// A vision encoder's windowed read: each position of the chunk sees exactly the
    /// positions of its own block (both directions), nothing stored before; a position in no
    /// block sees itself.
    fn append_encoder_window(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        blocks: &[Vec<Range<usize>>],
    ) -> Result<AttentionRead<'_>, KvError>;
    /// A diffusion canvas read: every stored position of each row plus the block's own keys
    /// and values, unmasked; appends nothing.
    fn read_block(&self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError>;
    /// The queries the next append's read will attend with, `(rows, q_heads, n, head_dim)`,
    /// shown before the append: a layer still to convert to TurboQuant weighs its key scales
    /// by what queries look at (see [`crate::codec::prep`]). Others ignore it.
    fn observe_queries(&mut self, q: &Tensor) -> Result<(), KvError> {
        let _ = q;
        Ok(())
    }
    /// Physical positions the rows span (the largest row end, padding included).
    fn offset(&self) -> usize;
    /// Drops the last `n` positions of every row.
    fn trim(&mut self, n: usize) -> Result<(), KvError>;
    /// Encoded bytes one position costs, over all rows, keys and values.
    fn bytes_per_token(&self) -> usize;
    /// Names the storage, e.g. `kv:plain:bf16` or `kv:window512:plain:bf16`.
    fn signature(&self) -> String;
}

/// A ring chunk's own planes, each row's first position in them, and the slots they span.
type RingSpan = (Box<dyn Planes>, Vec<usize>, usize);

/// How the queries of an append see keys.
#[derive(Clone, Copy)]
enum Visibility<'b> {
    Causal,
    Bidirectional(&'b [Vec<Range<usize>>]),
    EncoderWindow(&'b [Vec<Range<usize>>]),
}

impl Visibility<'_> {
    fn name(&self) -> &'static str {
        match self {
            Visibility::Causal => "causal",
            Visibility::Bidirectional(_) => "bidirectional",
            Visibility::EncoderWindow(_) => "encoder-window",
        }
    }
}

/// Checks that `codec` is one the planes implement and fits `spec`'s head dimensions (a
/// scheme's parser checks the first; a restored state is checked here).
pub(crate) fn check_codec(layer: usize, spec: &LayerSpec, codec: Codec) -> Result<(), KvError> {
    match codec {
        Codec::Plain(_) => {}
        Codec::Affine { bits, group } => {
            if !crate::codec::affine::AFFINE_BITS.contains(&bits)
                || !crate::codec::affine::AFFINE_GROUPS.contains(&group)
            {
                return Err(KvError::UnsupportedAffine {
                    bits: bits as u32,
                    group: group as u32,
                });
            }
            for dim in [spec.head_dim, spec.value_dim] {
                if dim % group as usize != 0 {
                    return Err(KvError::GroupDoesNotDivide {
                        layer,
                        dim,
                        group: group as usize,
                    });
                }
            }
        }
        Codec::Turbo { kbits, vbits, .. } => {
            if !(2..=8).contains(&kbits) || !(2..=8).contains(&vbits) {
                return Err(KvError::UnsupportedTurbo {
                    kbits: kbits as u32,
                    vbits: vbits as u32,
                });
            }
            for dim in [spec.head_dim, spec.value_dim] {
                if !dim.is_power_of_two() {
                    return Err(KvError::TurboDim { layer, dim });
                }
            }
        }
    }
    Ok(())
}

/// The cache of one attention layer.
#[derive(Debug)]
pub struct LayerCache {
    pub(crate) layer: usize,
    pub(crate) spec: LayerSpec,
    pub(crate) slots: Slots,
    pub(crate) slack: usize,
    pub(crate) planes: Box<dyn Planes>,
    pub(crate) rows: Rows,
    /// The quantized codec this layer converts to (the seeds' bf16-first lego), and the
    /// number of positions it holds in bf16 first.
    pub(crate) target: Option<Codec>,
    pub(crate) start: usize,
    /// Whether the first append has placed the storage (on a device, or the host).
    pub(crate) bound: bool,
    /// The vector instruction level the fused reads run at.
    pub(crate) isa: Isa,
    /// The queries read with before the conversion, which a TurboQuant target weighs its
    /// key scales by ([`QueryMoments`]).
    pub(crate) queries: QueryMoments,
}

impl LayerCache {
    /// A layer cache for `codec`. A quantized codec starts as bf16 storage and converts
    /// inside the first append that leaves it holding at least `quantized_kv_start`
    /// positions (the first append when that is 0).
    pub fn new(
        layer: usize,
        spec: LayerSpec,
        codec: Codec,
        quantized_kv_start: usize,
        left_pad: Vec<usize>,
    ) -> Result<Self, KvError> {
        check_codec(layer, &spec, codec)?;
        let geometry = PlaneGeometry {
            rows: left_pad.len(),
            heads: spec.kv_heads,
            head_dim: spec.head_dim,
            value_dim: spec.value_dim,
        };
        let (stage, target) = match codec {
            Codec::Plain(_) => (codec, None),
            quantized => (Codec::Plain(PlainDType::Bf16), Some(quantized)),
        };
        Ok(LayerCache {
            layer,
            spec,
            slots: Slots::of(spec.retention, 0),
            slack: 0,
            planes: host_planes(stage, geometry),
            rows: Rows::new(left_pad),
            target,
            start: quantized_kv_start,
            bound: false,
            isa: Isa::detected(),
            queries: QueryMoments::default(),
        })
    }

    /// Gives a sliding-window ring `slack` slots beyond its window, so a speculative round of
    /// up to `slack + 1` positions can be rolled back after the ring has wrapped. Set before
    /// the first append.
    pub fn set_round_slack(&mut self, slack: usize) -> Result<(), KvError> {
        if self.rows.width() > 0 || self.planes.capacity() > 0 {
            return Err(KvError::Rows(format!(
                "layer {}: round slack is set before the first append",
                self.layer
            )));
        }
        self.slack = slack;
        self.slots = Slots::of(self.spec.retention, slack);
        Ok(())
    }

    pub fn round_slack(&self) -> usize {
        self.slack
    }

    /// The earliest prefix a saved copy of this cache may be reused from, over every row
    /// (each row's is in [`Rows::reuse_floor`]): where the bf16-first transition fitted its
    /// codec ([`crate::transition`]).
    pub fn minimum_reusable_offset(&self) -> Option<usize> {
        self.rows.reuse_floor().iter().flatten().max().copied()
    }

    /// Runs this layer's fused reads at `isa` (capped to what the CPU runs).
    pub fn set_isa(&mut self, isa: Isa) {
        self.isa = isa.capped();
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn spec(&self) -> &LayerSpec {
        &self.spec
    }

    pub fn rows(&self) -> &Rows {
        &self.rows
    }

    /// The storage, for inspection.
    pub fn planes(&self) -> &dyn Planes {
        self.planes.as_ref()
    }

    pub fn allocated_bytes(&self) -> usize {
        self.planes.allocated_bytes()
    }

    pub(crate) fn geometry(&self) -> PlaneGeometry {
        PlaneGeometry {
            rows: self.rows.batch(),
            heads: self.spec.kv_heads,
            head_dim: self.spec.head_dim,
            value_dim: self.spec.value_dim,
        }
    }

    /// On the first append, moves the (still empty) storage into the installed device
    /// backend's planes when it serves the appends' device (never the CPU in the engine),
    /// after checking it also serves the target codec, so an unsupported one fails here
    /// rather than at conversion.
    fn bind_device(&mut self, device: &Device) -> Result<(), KvError> {
        if self.bound {
            return Ok(());
        }
        if let Some(target) = self.target {
            planes_on(target, self.geometry(), device)?;
        }
        if let Some(planes) = planes_on(self.planes.codec(), self.geometry(), device)? {
            self.planes = planes;
        }
        self.bound = true;
        Ok(())
    }

    fn check(&self, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
        let bad = || KvError::ShapeMismatch {
            layer: self.layer,
            got: k.dims().to_vec(),
            rows: self.rows.batch(),
            kv_heads: self.spec.kv_heads,
            head_dim: self.spec.head_dim,
        };
        let (b, h, n, d) = k.dims4().map_err(|_| bad())?;
        let (vb, vh, vn, vd) = v.dims4().map_err(|_| bad())?;
        if b != self.rows.batch() || h != self.spec.kv_heads || d != self.spec.head_dim || n == 0 {
            return Err(bad());
        }
        if (vb, vh, vn, vd) != (b, h, n, self.spec.value_dim) {
            return Err(bad());
        }
        Ok(())
    }

    /// Rows `a .. b` of `x`, positions `from .. from + len`.
    fn part(x: &Tensor, rows: Range<usize>, from: usize, len: usize) -> Result<Tensor, KvError> {
        Ok(x.narrow(0, rows.start, rows.len())?.narrow(2, from, len)?)
    }

    /// Stores the `n` positions of `k`, `v` at each row's end, rows of one end together.
    fn store(&mut self, k: &Tensor, v: &Tensor, ends: &[usize]) -> Result<(), KvError> {
        let n = k.dims()[2];
        let mut a = 0;
        while a < ends.len() {
            let b = a + ends[a..].iter().take_while(|&&e| e == ends[a]).count();
            let e = ends[a];
            for run in self.slots.runs(e..e + n) {
                let (kp, vp) = (
                    Self::part(k, a..b, run.pos - e, run.len)?,
                    Self::part(v, a..b, run.pos - e, run.len)?,
                );
                self.planes.write(a..b, run.slot, &kp, &vp)?;
            }
            a = b;
        }
        Ok(())
    }

    /// A ring's read of a chunk: its own planes holding, per row, the positions the chunk's
    /// first query still sees (`firsts[r] ..` the row's end, copied as stored) and then the
    /// chunk's own positions — built before the chunk's writes overwrite ring slots.
    fn ring_span(&self, k: &Tensor, v: &Tensor, ends: &[usize]) -> Result<RingSpan, KvError> {
        let n = k.dims()[2];
        let rows = self.rows.batch();
        let pads = self.rows.left_pad();
        let firsts: Vec<usize> = (0..rows)
            .map(|r| self.slots.first_visible(ends[r], pads[r]))
            .collect();
        let kept: Vec<usize> = (0..rows).map(|r| ends[r] - firsts[r]).collect();
        let width = kept.iter().max().copied().unwrap_or(0) + n;
        let mut span = self.planes.empty(rows)?;
        span.reserve(width, width)?;
        let linear = Slots::of(Retention::Full, 0);
        for r in 0..rows {
            span.adopt_row(self.planes.as_ref(), r, r)?;
            let shift = -(firsts[r] as isize);
            for run in self.slots.runs_between(firsts[r]..ends[r], linear, shift) {
                span.copy_from(self.planes.as_ref(), r, run.slot, r, run.dst, run.len)?;
            }
        }
        let mut a = 0;
        while a < rows {
            let b = a + kept[a..].iter().take_while(|&&c| c == kept[a]).count();
            span.write(
                a..b,
                kept[a],
                &Self::part(k, a..b, 0, n)?,
                &Self::part(v, a..b, 0, n)?,
            )?;
            a = b;
        }
        Ok((span, firsts, width))
    }

    /// Refuses an append inside a round that would overwrite ring slots a rollback to the
    /// round's start still needs.
    pub(crate) fn guard_round(&self, n: usize) -> Result<(), KvError> {
        let (Some(before), Some(window)) = (self.rows.round(), self.slots.window) else {
            return Ok(());
        };
        for (r, &back_to) in before.iter().enumerate() {
            let pad = self.rows.left_pad()[r];
            let needed = self.slots.first_visible(back_to, pad);
            let held = self.rows.held_from()[r]
                .max((self.rows.end_of(r) + n).saturating_sub(self.slots.ring));
            if needed < back_to && held > needed {
                return Err(KvError::RingOverwritten {
                    layer: self.layer,
                    row: r,
                    wanted: before[r].saturating_sub(pad),
                    window,
                    slots: self.slots.ring,
                    needed,
                    held,
                });
            }
        }
        Ok(())
    }

    /// The one append every named read goes through: store the new positions at each row's
    /// end, and read what each new query may see.
    fn append(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        visibility: Visibility,
    ) -> Result<AttentionRead<'_>, KvError> {
        self.check(k, v)?;
        if !matches!(visibility, Visibility::Causal) && self.planes.codec().is_quantized() {
            return Err(KvError::ReadNotServed {
                layer: self.layer,
                read: visibility.name(),
                codec: self.planes.codec().to_string(),
            });
        }
        if let Visibility::Bidirectional(b) | Visibility::EncoderWindow(b) = visibility {
            if b.len() != self.rows.batch() {
                return Err(KvError::Rows(format!(
                    "{} lists of blocks given for {} rows",
                    b.len(),
                    self.rows.batch()
                )));
            }
        }
        self.bind_device(k.device())?;
        self.guard_round(k.dims()[2])?;
        let n = k.dims()[2];
        let ends = self.rows.ends();
        let pads = self.rows.left_pad().to_vec();
        let width = ends.iter().max().copied().unwrap_or(0) + n;
        self.planes
            .reserve(self.slots.capacity(width), self.slots.ring)?;
        if n == 1 && matches!(visibility, Visibility::Causal) {
            self.store(k, v, &ends)?;
            let rows = (0..ends.len())
                .map(|r| self.slots.visible(ends[r], pads[r]))
                .collect();
            self.rows.advance(1, self.slots.ring);
            let retired = self.convert_if_due()?;
            return Ok(AttentionRead::decode(self.planes_ref(retired), rows));
        }
        let (span, firsts, slots) = match self.slots.window {
            None => (None, vec![0; ends.len()], width),
            Some(_) => {
                let (span, firsts, slots) = self.ring_span(k, v, &ends)?;
                (Some(span), firsts, slots)
            }
        };
        self.store(k, v, &ends)?;
        self.rows.advance(n, self.slots.ring);
        let geometry = ChunkGeometry {
            rows: (0..ends.len())
                .map(|r| RowSpan {
                    pad: pads[r],
                    start: ends[r],
                    first: firsts[r],
                })
                .collect(),
            kv_heads: self.spec.kv_heads,
            group: 0,
            head_dim: self.spec.head_dim,
            value_dim: self.spec.value_dim,
            queries: n,
            slots,
            window: self.slots.window,
        };
        let retired = self.convert_if_due()?;
        let planes = match span {
            Some(span) => PlanesRef::Owned(span),
            None => self.planes_ref(retired),
        };
        let blocks = match visibility {
            Visibility::Causal => return Ok(AttentionRead::chunk(planes, geometry)),
            Visibility::Bidirectional(b) | Visibility::EncoderWindow(b) => b,
        };
        let block_of = |r: usize, i: usize| blocks[r].iter().position(|b| b.contains(&i));
        let encoder = matches!(visibility, Visibility::EncoderWindow(_));
        let p = planes.get();
        let (keys, values) = p.read(0..ends.len(), 0, slots)?;
        let mask = mask_of(
            ends.len(),
            n,
            slots,
            |r, i, j| {
                let RowSpan { start, first, .. } = geometry.rows[r];
                // Key slot j holds position first + j: chunk index first + j - start.
                let own = (first + j).checked_sub(start).filter(|&c| c < n);
                let same_block =
                    own.is_some_and(|c| block_of(r, i).is_some_and(|b| block_of(r, c) == Some(b)));
                if encoder {
                    same_block || (block_of(r, i).is_none() && own == Some(i))
                } else {
                    same_block || geometry.visible(r, i).contains(&j)
                }
            },
            keys.device(),
        )?;
        Ok(AttentionRead::dense(keys, values, Some(mask)))
    }

    fn planes_ref(&self, retired: Option<Box<dyn Planes>>) -> PlanesRef<'_> {
        match retired {
            Some(planes) => PlanesRef::Owned(planes),
            None => PlanesRef::Borrowed(self.planes.as_ref()),
        }
    }
}

/// Each row's live keys and values in temporal order (a drafter reads these), with the
/// row's offset (real positions), the physical position of its first held key, and its end.
#[derive(Debug, Default)]
pub struct DonorRows {
    pub keys: Vec<Tensor>,
    pub values: Vec<Tensor>,
    pub offsets: Vec<usize>,
    pub starts: Vec<usize>,
    pub ends: Vec<usize>,
}

impl AttentionCache for LayerCache {
    fn observe_queries(&mut self, q: &Tensor) -> Result<(), KvError> {
        let weighs = matches!(self.target, Some(Codec::Turbo { prep, .. }) if prep.key_scale);
        if !(weighs && self.awaiting_conversion()) {
            return Ok(());
        }
        let (_, q_heads, n, dim) = q.dims4()?;
        if dim != self.spec.head_dim || q_heads % self.spec.kv_heads.max(1) != 0 {
            return Err(KvError::QueryShape {
                got: q.dims().to_vec(),
                detail: format!(
                    "layer {}: {} KV heads of {} channels",
                    self.layer, self.spec.kv_heads, self.spec.head_dim
                ),
            });
        }
        // Row r's append starts at its end; positions before its left padding are no query.
        let live: Vec<Range<usize>> = self
            .rows
            .ends()
            .iter()
            .zip(self.rows.left_pad())
            .map(|(end, pad)| pad.saturating_sub(*end).min(n)..n)
            .collect();
        if q.dims()[0] != live.len() {
            return Err(KvError::RowCount {
                given: q.dims()[0],
                rows: live.len(),
            });
        }
        let x: Vec<f32> = q
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        self.queries
            .observe(&x, (q_heads, n, dim), self.spec.kv_heads, &live);
        Ok(())
    }

    fn append_decode(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError> {
        let isa = self.isa;
        Ok(self.append(k, v, Visibility::Causal)?.at(isa))
    }

    fn append_window(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError> {
        let isa = self.isa;
        Ok(self.append(k, v, Visibility::Causal)?.at(isa))
    }

    fn append_bidirectional(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        blocks: &[Vec<Range<usize>>],
    ) -> Result<AttentionRead<'_>, KvError> {
        self.append(k, v, Visibility::Bidirectional(blocks))
    }

    fn append_encoder_window(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        blocks: &[Vec<Range<usize>>],
    ) -> Result<AttentionRead<'_>, KvError> {
        self.append(k, v, Visibility::EncoderWindow(blocks))
    }

    fn read_block(&self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError> {
        self.check(k, v)?;
        if self.planes.codec().is_quantized() {
            return Err(KvError::ReadNotServed {
                layer: self.layer,
                read: "block",
                codec: self.planes.codec().to_string(),
            });
        }
        let n = k.dims()[2];
        let donor = self.capture_donor_rows()?;
        let longest = donor.keys.iter().map(|k| k.dims()[2]).max().unwrap_or(0);
        let Codec::Plain(dtype) = self.planes.codec() else {
            unreachable!("quantized storage was refused above")
        };
        let dtype = dtype.dtype();
        let as_stored = |x: &Tensor| -> Result<Tensor, KvError> {
            Ok(x.to_dtype(dtype)?.to_dtype(candle_core::DType::F32)?)
        };
        // Row r's stored keys right-aligned before the block's (padding in front masked).
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for (r, (sk, sv)) in donor.keys.iter().zip(&donor.values).enumerate() {
            let missing = longest - sk.dims()[2];
            let pad =
                |x: &Tensor| -> Result<Tensor, KvError> { Ok(x.pad_with_zeros(2, missing, 0)?) };
            keys.push(Tensor::cat(
                &[
                    &pad(&sk.to_device(k.device())?)?,
                    &as_stored(&k.narrow(0, r, 1)?)?,
                ],
                2,
            )?);
            values.push(Tensor::cat(
                &[
                    &pad(&sv.to_device(k.device())?)?,
                    &as_stored(&v.narrow(0, r, 1)?)?,
                ],
                2,
            )?);
        }
        let lens: Vec<usize> = donor.keys.iter().map(|k| k.dims()[2]).collect();
        let mask = mask_of(
            lens.len(),
            n,
            longest + n,
            |r, _, j| j >= longest - lens[r],
            k.device(),
        )?;
        Ok(AttentionRead::dense(
            Tensor::cat(&keys, 0)?,
            Tensor::cat(&values, 0)?,
            Some(mask),
        ))
    }

    fn offset(&self) -> usize {
        self.rows.width()
    }

    fn trim(&mut self, n: usize) -> Result<(), KvError> {
        let offsets = self.trimmed(&vec![n; self.rows.batch()])?;
        self.rewind(&offsets)
    }

    fn bytes_per_token(&self) -> usize {
        // Before conversion, what the target codec will cost.
        let one = PlaneGeometry {
            rows: 1,
            ..self.geometry()
        };
        let per_row = match (self.target, self.awaiting_conversion()) {
            (Some(target), true) => host_planes(target, one).bytes_per_position(),
            _ => self.planes.bytes_per_position(),
        };
        per_row * self.rows.batch()
    }

    fn signature(&self) -> String {
        let codec = match self.target {
            Some(Codec::Affine { bits, group }) => format!("bf16-first:affine:{bits}:{group}"),
            Some(turbo @ Codec::Turbo { .. }) => format!("bf16-first:{turbo}"),
            _ => match self.planes.codec() {
                Codec::Plain(dtype) => format!("plain:{}", dtype.name()),
                codec => codec.to_string(),
            },
        };
        match self.spec.retention {
            Retention::Full => format!("kv:{codec}"),
            Retention::Window { size } => format!("kv:window{size}:{codec}"),
        }
    }
}
