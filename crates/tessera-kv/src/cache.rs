//! Layer caches: one codec's planes, one retention policy and the rows, composed.

use crate::affine_chunk::ChunkGeometry;
use crate::affine_planes::AffinePlanes;
use crate::decode::RowSlots;
use crate::device::{planes_on, DevicePlanes, PlaneGeometry};
use crate::plain::PlainPlanes;
use crate::read::DeviceRef;
use crate::rows::Rows;
use crate::turbo_planes::TurboPlanes;
use crate::{AttentionRead, Codec, Isa, KvError, KvScheme, LayerSpec, PlainDType, Retention};
use candle_core::{Device, Tensor};
use std::borrow::Cow;

/// What a model's attention layer sees: append new keys and values, get back a read.
pub trait AttentionCache {
    /// Appends one decode step (one query position per row) and returns its read.
    fn append_decode(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError>;
    /// Appends a causal chunk of positions (prefill, or a speculative window).
    fn append_window(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError>;
    /// Physical positions appended so far (padding included).
    fn offset(&self) -> usize;
    /// Drops the last `n` positions (speculative rollback).
    fn trim(&mut self, n: usize) -> Result<(), KvError>;
    /// Encoded bytes one position costs, over all rows, keys and values.
    fn bytes_per_token(&self) -> usize;
    /// Names the storage, e.g. `kv:plain:bf16` or `kv:window512:plain:bf16`.
    fn signature(&self) -> String;
}

/// Storage planes of one codec. Both kinds write and read contiguous slot ranges; the
/// retention policy decides the slots.
#[derive(Debug)]
enum Planes {
    Plain(PlainPlanes),
    Affine(AffinePlanes),
    Turbo(TurboPlanes),
    /// Any codec, on a device, through the installed backend (see [`crate::device`]).
    Device(Box<dyn DevicePlanes>),
}

impl Planes {
    fn reserve(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        slots: usize,
        limit: usize,
    ) -> Result<(), KvError> {
        match self {
            Planes::Plain(p) => p.reserve(k, v, slots, limit),
            Planes::Affine(p) => {
                p.reserve(slots, limit);
                Ok(())
            }
            Planes::Turbo(p) => {
                p.reserve(slots, limit);
                Ok(())
            }
            Planes::Device(p) => p.reserve(slots, limit),
        }
    }

    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
        match self {
            Planes::Plain(p) => p.write(slot, k, v),
            Planes::Affine(p) => p.write(slot, k, v),
            Planes::Turbo(p) => p.write(slot, k, v),
            Planes::Device(p) => p.write(slot, k, v),
        }
    }

    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor), KvError> {
        match self {
            Planes::Plain(p) => p.read(slot, len),
            Planes::Affine(p) => p.read(slot, len),
            Planes::Turbo(p) => p.read(slot, len),
            Planes::Device(p) => p.read(slot, len),
        }
    }

    fn as_stored(&self, x: &Tensor, keys: bool) -> Result<Tensor, KvError> {
        match self {
            Planes::Plain(p) => p.as_stored(x),
            Planes::Affine(p) => p.as_stored(x),
            Planes::Turbo(p) => p.as_stored(x, keys),
            Planes::Device(p) => p.as_stored(x, keys),
        }
    }

    fn allocated_bytes(&self) -> usize {
        match self {
            Planes::Plain(p) => p.allocated_bytes(),
            Planes::Affine(p) => p.allocated_bytes(),
            Planes::Turbo(p) => p.allocated_bytes(),
            Planes::Device(p) => p.allocated_bytes(),
        }
    }

    fn capacity(&self) -> usize {
        match self {
            Planes::Plain(p) => p.capacity(),
            Planes::Affine(p) => p.capacity(),
            Planes::Turbo(p) => p.capacity(),
            Planes::Device(p) => p.capacity(),
        }
    }

    fn signature(&self) -> String {
        match self {
            Planes::Plain(p) => format!("plain:{}", p.dtype().name()),
            Planes::Affine(p) => format!("affine:{}:{}", p.bits(), p.group()),
            Planes::Turbo(p) => Codec::Turbo {
                kbits: p.bits().0,
                vbits: p.bits().1,
                prep: p.prep(),
            }
            .to_string(),
            Planes::Device(p) => match p.codec() {
                Codec::Plain(dtype) => format!("plain:{}", dtype.name()),
                codec => codec.to_string(),
            },
        }
    }

    /// The codec the planes hold now.
    fn codec(&self) -> Codec {
        match self {
            Planes::Plain(p) => Codec::Plain(p.dtype()),
            Planes::Affine(p) => Codec::Affine {
                bits: p.bits(),
                group: p.group() as u16,
            },
            Planes::Turbo(p) => Codec::Turbo {
                kbits: p.bits().0,
                vbits: p.bits().1,
                prep: p.prep(),
            },
            Planes::Device(p) => p.codec(),
        }
    }
}

/// The cache of one attention layer.
#[derive(Debug)]
pub struct LayerCache {
    layer: usize,
    spec: LayerSpec,
    planes: Planes,
    rows: Rows,
    /// The quantized codec this layer converts to (the seeds' bf16-first lego), and the
    /// number of positions it holds in bf16 first.
    target: Option<Codec>,
    start: usize,
    minimum_reusable_offset: Option<usize>,
    /// The vector instruction level the fused reads run at.
    isa: Isa,
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
        if let Codec::Turbo { .. } = codec {
            for dim in [spec.head_dim, spec.value_dim] {
                if !dim.is_power_of_two() {
                    return Err(KvError::TurboDim { layer, dim });
                }
            }
        }
        if let Codec::Affine { group, .. } = codec {
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
        let (planes, target) = match codec {
            Codec::Plain(dtype) => (Planes::Plain(PlainPlanes::new(dtype)), None),
            quantized => (
                Planes::Plain(PlainPlanes::new(PlainDType::Bf16)),
                Some(quantized),
            ),
        };
        Ok(LayerCache {
            layer,
            spec,
            planes,
            rows: Rows::new(left_pad),
            target,
            start: quantized_kv_start,
            minimum_reusable_offset: None,
            isa: Isa::detected(),
        })
    }

    /// The earliest prefix a saved copy of this cache may be reused from: the offset at
    /// which a nonzero `quantized_kv_start` converted it.
    pub fn minimum_reusable_offset(&self) -> Option<usize> {
        self.minimum_reusable_offset
    }

    /// Runs this layer's fused reads at `isa` (capped to what the CPU runs).
    pub fn set_isa(&mut self, isa: Isa) {
        self.isa = isa.capped();
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Whether the storage is still the bf16 stage of a quantized codec.
    pub fn awaiting_conversion(&self) -> bool {
        self.target.is_some() && matches!(self.planes.codec(), Codec::Plain(_))
    }

    fn geometry(&self) -> PlaneGeometry {
        PlaneGeometry {
            rows: self.rows.batch(),
            heads: self.spec.kv_heads,
            head_dim: self.spec.head_dim,
            value_dim: self.spec.value_dim,
        }
    }

    /// On the first append, moves the (still empty) storage into the installed device
    /// backend's planes when it serves the appends' device (never the CPU in the engine):
    /// planes for the current stage, after checking it also serves the target codec, so an
    /// unsupported one fails here rather than at conversion.
    fn bind_device(&mut self, device: &Device) -> Result<(), KvError> {
        if !matches!(&self.planes, Planes::Plain(p) if p.capacity() == 0) {
            return Ok(());
        }
        if let Some(target) = self.target {
            planes_on(target, self.geometry(), device)?;
        }
        if let Some(planes) = planes_on(self.planes.codec(), self.geometry(), device)? {
            self.planes = Planes::Device(planes);
        }
        Ok(())
    }

    /// Whether `n` positions can be dropped: not from a ring that has wrapped (the evicted
    /// positions are gone), and not more than are held.
    fn check_trim(&self, n: usize) -> Result<(), KvError> {
        let held = self.rows.end();
        if let Retention::Window { size } = self.spec.retention {
            if held > size && n > 0 {
                return Err(KvError::TrimWrappedRing {
                    layer: self.layer,
                    requested: n,
                    window: size,
                    held,
                });
            }
        }
        if n > held {
            return Err(KvError::TrimTooFar {
                layer: self.layer,
                requested: n,
                held,
            });
        }
        Ok(())
    }

    /// The bf16-first transition: once an append leaves the bf16 stage holding at least
    /// `start` positions (and never while empty), quantize every stored slot into the target
    /// codec's planes and drop the bf16 planes. Irreversible; the slots (and so a ring's write
    /// index) carry over unchanged. Returns the retired bf16 planes (a read may still
    /// need them).
    fn convert_if_due(&mut self) -> Result<Option<Planes>, KvError> {
        let end = self.rows.end();
        let Some(target) = self.target else {
            return Ok(None);
        };
        if !self.awaiting_conversion() || end < self.start || end == 0 {
            return Ok(None);
        }
        let used = match self.spec.retention {
            Retention::Full => end,
            Retention::Window { size } => end.min(size),
        };
        let limit = match self.spec.retention {
            Retention::Full => usize::MAX,
            Retention::Window { size } => size,
        };
        let slots = used.max(self.planes.capacity().min(limit));
        let (k, v) = self.planes.read(0, used)?;
        let (rows, heads) = (self.rows.batch(), self.spec.kv_heads);
        let (d, dv) = (self.spec.head_dim, self.spec.value_dim);
        let on_device = match &self.planes {
            Planes::Device(_) => planes_on(target, self.geometry(), k.device())?,
            _ => None,
        };
        let mut converted = match target {
            _ if on_device.is_some() => {
                let mut planes = on_device.expect("checked");
                if let Codec::Turbo { prep, .. } = target {
                    planes.fit_key_prep(&k, prep)?;
                }
                Planes::Device(planes)
            }
            Codec::Affine { bits, group } => {
                Planes::Affine(AffinePlanes::new(bits, group as usize, rows, heads, d, dv))
            }
            Codec::Turbo { kbits, vbits, prep } => {
                let mut planes = TurboPlanes::new(kbits, vbits, rows, heads, d, dv);
                planes.fit_key_prep(&k, prep)?;
                Planes::Turbo(planes)
            }
            Codec::Plain(_) => return Ok(None),
        };
        converted.reserve(&k, &v, slots, limit)?;
        converted.write(0, &k, &v)?;
        let retired = std::mem::replace(&mut self.planes, converted);
        if self.start > 0 {
            self.minimum_reusable_offset = Some(end);
        }
        Ok(Some(retired))
    }

    pub fn spec(&self) -> &LayerSpec {
        &self.spec
    }

    pub fn rows(&self) -> &Rows {
        &self.rows
    }

    pub fn allocated_bytes(&self) -> usize {
        self.planes.allocated_bytes()
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

    /// The one append every named read goes through: store the new positions, gather every
    /// position the new queries may see in temporal order, and mask the rest.
    fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError> {
        self.check(k, v)?;
        self.bind_device(k.device())?;
        let n = k.dims()[2];
        let start = self.rows.end();
        if n == 1 {
            return self.append_one(k, v);
        }
        if matches!(self.planes, Planes::Affine(_) | Planes::Turbo(_)) {
            return self.append_quantized_chunk(k, v);
        }
        if let (Planes::Device(_), Retention::Full) = (&self.planes, self.spec.retention) {
            return self.append_device_chunk(k, v);
        }
        let device = k.device().clone();
        let (keys, values, positions, window) = match self.spec.retention {
            Retention::Full => {
                self.planes.reserve(k, v, start + n, usize::MAX)?;
                self.planes.write(start, k, v)?;
                let (keys, values) = self.planes.read(0, start + n)?;
                (keys, values, (0..start + n).collect::<Vec<_>>(), None)
            }
            Retention::Window { size } => {
                // The first new query needs the previous size-1 positions; read them before
                // the new positions overwrite their slots.
                let kept = start.min(size - 1);
                let (old_k, old_v) = self.read_ring(start - kept, kept, size)?;
                let new_k = self.planes.as_stored(k, true)?;
                let new_v = self.planes.as_stored(v, false)?;
                let (keys, values) = match (old_k, old_v) {
                    (Some(ok), Some(ov)) => (
                        Tensor::cat(&[&ok, &new_k], 2)?,
                        Tensor::cat(&[&ov, &new_v], 2)?,
                    ),
                    _ => (new_k, new_v),
                };
                self.write_ring(start, k, v, size)?;
                (
                    keys,
                    values,
                    (start - kept..start + n).collect(),
                    Some(size),
                )
            }
        };
        let mask = self.rows.mask(n, &positions, window, &device)?;
        self.rows.advance(n);
        // The read above holds its own copies, so this append is read as stored before it;
        // conversion happens inside the append, before it returns (and the bf16 source is
        // freed here, before any other layer converts).
        self.convert_if_due()?;
        Ok(AttentionRead::dense(keys, values, mask))
    }

    /// A causal chunk on device planes with full retention: stored, then read by the
    /// backend's fused chunk read (densely where it has none). As on the CPU, an append
    /// that converts the layer is read from the bf16 planes it retires.
    fn append_device_chunk(
        &mut self,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<AttentionRead<'_>, KvError> {
        let (n, start) = (k.dims()[2], self.rows.end());
        self.planes.reserve(k, v, start + n, usize::MAX)?;
        self.planes.write(start, k, v)?;
        let pads = self.rows.left_pad().to_vec();
        self.rows.advance(n);
        if let Some(Planes::Device(retired)) = self.convert_if_due()? {
            return Ok(AttentionRead::device_chunk(
                DeviceRef::Owned(retired),
                pads,
                start,
                n,
            ));
        }
        let Planes::Device(planes) = &self.planes else {
            unreachable!("checked by the caller")
        };
        Ok(AttentionRead::device_chunk(
            DeviceRef::Borrowed(planes.as_ref()),
            pads,
            start,
            n,
        ))
    }

    /// A causal chunk on quantized (affine or turbo) storage, read from the packed codes
    /// (fused chunk read).
    fn append_quantized_chunk(
        &mut self,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<AttentionRead<'_>, KvError> {
        let n = k.dims()[2];
        let start = self.rows.end();
        let geometry = |first: usize, slots: usize, window: Option<usize>| ChunkGeometry {
            rows: self.rows.batch(),
            kv_heads: self.spec.kv_heads,
            group: 0, // the queries' head count sets it
            head_dim: self.spec.head_dim,
            value_dim: self.spec.value_dim,
            queries: n,
            start,
            first,
            slots,
            window,
        };
        let pads = self.rows.left_pad().to_vec();
        match self.spec.retention {
            Retention::Full => {
                let geo = geometry(0, start + n, None);
                self.planes.reserve(k, v, start + n, usize::MAX)?;
                self.planes.write(start, k, v)?;
                self.rows.advance(n);
                Ok(match &self.planes {
                    Planes::Affine(p) => AttentionRead::affine_chunk(Cow::Borrowed(p), pads, geo),
                    Planes::Turbo(p) => AttentionRead::turbo_chunk(Cow::Borrowed(p), pads, geo),
                    Planes::Plain(_) | Planes::Device(_) => {
                        unreachable!("called for host quantized planes")
                    }
                })
            }
            Retention::Window { size } => {
                // The new positions overwrite ring slots the first queries still need: the
                // read gets its own packed copy of the previous size-1 positions plus the
                // new ones, in temporal order.
                let kept = start.min(size - 1);
                let geo = geometry(start - kept, kept + n, Some(size));
                let first = (start - kept) % size;
                let head = kept.min(size - first);
                let read = match &self.planes {
                    Planes::Affine(ring) => {
                        let mut span = ring.empty_like();
                        span.reserve(kept + n, kept + n);
                        span.copy_slots(ring, first, 0, head);
                        span.copy_slots(ring, 0, head, kept - head);
                        span.write(kept, k, v)?;
                        Planes::Affine(span)
                    }
                    Planes::Turbo(ring) => {
                        let mut span = ring.empty_like();
                        span.reserve(kept + n, kept + n);
                        span.copy_slots(ring, first, 0, head);
                        span.copy_slots(ring, 0, head, kept - head);
                        span.write(kept, k, v)?;
                        Planes::Turbo(span)
                    }
                    Planes::Plain(_) | Planes::Device(_) => {
                        unreachable!("called for host quantized planes")
                    }
                };
                self.write_ring(start, k, v, size)?;
                self.rows.advance(n);
                Ok(match read {
                    Planes::Affine(span) => {
                        AttentionRead::affine_chunk(Cow::Owned(span), pads, geo)
                    }
                    Planes::Turbo(span) => AttentionRead::turbo_chunk(Cow::Owned(span), pads, geo),
                    Planes::Plain(_) | Planes::Device(_) => unreachable!(),
                })
            }
        }
    }

    /// One position per row: store it, then read straight from the planes (fused decode,
    /// plain or packed affine).
    fn append_one(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError> {
        let pos = self.rows.end();
        let (first, slot_of, size) = match self.spec.retention {
            Retention::Full => {
                self.planes.reserve(k, v, pos + 1, usize::MAX)?;
                (0, pos, usize::MAX)
            }
            Retention::Window { size } => {
                self.planes.reserve(k, v, (pos + 1).min(size), size)?;
                (pos + 1 - size.min(pos + 1), pos % size, size)
            }
        };
        self.planes.write(slot_of, k, v)?;
        let rows = self
            .rows
            .left_pad()
            .iter()
            .map(|&pad| {
                // Visible positions: first ..= pos, none before the row's padding; a padding
                // query sees only itself.
                let lo = first.max(pad).min(pos);
                let (a, b) = (lo % size, pos % size);
                let ranges = if size == usize::MAX || a <= b {
                    vec![a..b + 1]
                } else {
                    vec![a..size, 0..b + 1]
                };
                RowSlots { ranges }
            })
            .collect();
        self.rows.advance(1);
        // (Matched twice: returning a borrow from one arm of a match that falls through to a
        // mutable use is refused by today's borrow checker.)
        if matches!(self.planes, Planes::Affine(_)) {
            let Planes::Affine(affine) = &self.planes else {
                unreachable!()
            };
            return Ok(AttentionRead::affine_decode(affine, rows));
        }
        if matches!(self.planes, Planes::Turbo(_)) {
            let Planes::Turbo(turbo) = &self.planes else {
                unreachable!()
            };
            return Ok(AttentionRead::turbo_decode(turbo, rows));
        }
        if matches!(self.planes, Planes::Device(_)) {
            // As on the CPU, the step that converts reads the bf16 planes it retires.
            if let Some(Planes::Device(retired)) = self.convert_if_due()? {
                return Ok(AttentionRead::device_decode(
                    DeviceRef::Owned(retired),
                    rows,
                ));
            }
            let Planes::Device(planes) = &self.planes else {
                unreachable!()
            };
            return Ok(AttentionRead::device_decode(
                DeviceRef::Borrowed(planes.as_ref()),
                rows,
            ));
        }
        let Planes::Plain(plain) = &self.planes else {
            unreachable!()
        };
        let (keys, values) = plain.planes();
        let (keys, values) = (keys.clone(), values.clone());
        // The read keeps the bf16 planes alive; converting drops only the cache's handle.
        self.convert_if_due()?;
        Ok(AttentionRead::decode(keys, values, rows))
    }

    /// Positions `first .. first + len` of a ring of `size` slots, in temporal order.
    fn read_ring(
        &self,
        first: usize,
        len: usize,
        size: usize,
    ) -> Result<(Option<Tensor>, Option<Tensor>), KvError> {
        if len == 0 {
            return Ok((None, None));
        }
        let slot = first % size;
        let head = len.min(size - slot);
        let (k1, v1) = self.planes.read(slot, head)?;
        if head == len {
            return Ok((Some(k1), Some(v1)));
        }
        let (k2, v2) = self.planes.read(0, len - head)?;
        Ok((
            Some(Tensor::cat(&[&k1, &k2], 2)?),
            Some(Tensor::cat(&[&v1, &v2], 2)?),
        ))
    }

    /// Stores positions `first ..` of `k`, `v` in a ring of `size` slots; only the last
    /// `size` of them survive.
    fn write_ring(
        &mut self,
        first: usize,
        k: &Tensor,
        v: &Tensor,
        size: usize,
    ) -> Result<(), KvError> {
        let n = k.dims()[2];
        let skip = n.saturating_sub(size);
        let (k, v) = (k.narrow(2, skip, n - skip)?, v.narrow(2, skip, n - skip)?);
        let (first, n) = (first + skip, n - skip);
        self.planes.reserve(&k, &v, (first + n).min(size), size)?;
        let slot = first % size;
        let head = n.min(size - slot);
        self.planes
            .write(slot, &k.narrow(2, 0, head)?, &v.narrow(2, 0, head)?)?;
        if head < n {
            self.planes.write(
                0,
                &k.narrow(2, head, n - head)?,
                &v.narrow(2, head, n - head)?,
            )?;
        }
        Ok(())
    }
}

impl AttentionCache for LayerCache {
    fn append_decode(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError> {
        let isa = self.isa;
        Ok(self.append(k, v)?.at(isa))
    }

    fn append_window(&mut self, k: &Tensor, v: &Tensor) -> Result<AttentionRead<'_>, KvError> {
        let isa = self.isa;
        Ok(self.append(k, v)?.at(isa))
    }

    fn offset(&self) -> usize {
        self.rows.end()
    }

    fn trim(&mut self, n: usize) -> Result<(), KvError> {
        self.check_trim(n)?;
        self.rows.retreat(n);
        Ok(())
    }

    fn bytes_per_token(&self) -> usize {
        // Before conversion, what the target codec will cost.
        let planes = match (&self.planes, self.awaiting_conversion()) {
            (Planes::Device(_), true) => &Planes::Plain(PlainPlanes::new(PlainDType::Bf16)),
            (planes, _) => planes,
        };
        let per_row = match (planes, self.target) {
            (Planes::Device(p), _) => p.bytes_per_position(),
            (Planes::Affine(p), _) => p.bytes_per_position(),
            (Planes::Plain(_), Some(Codec::Affine { bits, group })) => AffinePlanes::new(
                bits,
                group as usize,
                1,
                self.spec.kv_heads,
                self.spec.head_dim,
                self.spec.value_dim,
            )
            .bytes_per_position(),
            (Planes::Turbo(p), _) => p.bytes_per_position(),
            (Planes::Plain(_), Some(Codec::Turbo { kbits, vbits, .. })) => TurboPlanes::new(
                kbits,
                vbits,
                1,
                self.spec.kv_heads,
                self.spec.head_dim,
                self.spec.value_dim,
            )
            .bytes_per_position(),
            (Planes::Plain(p), _) => {
                self.spec.kv_heads
                    * (self.spec.head_dim + self.spec.value_dim)
                    * p.dtype().size_in_bytes()
            }
        };
        per_row * self.rows.batch()
    }

    fn signature(&self) -> String {
        let codec = match self.target {
            Some(Codec::Affine { bits, group }) => format!("bf16-first:affine:{bits}:{group}"),
            Some(turbo @ Codec::Turbo { .. }) => format!("bf16-first:{turbo}"),
            _ => self.planes.signature(),
        };
        match self.spec.retention {
            Retention::Full => format!("kv:{codec}"),
            Retention::Window { size } => format!("kv:window{size}:{codec}"),
        }
    }
}

/// The caches of every layer of one model, for one batch of rows.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    left_pad: Vec<usize>,
}

/// Says once per process (as the seeds do for TurboQuant) when a scheme leaves the
/// sliding-window layers in another codec than the rest.
fn notice_sliding_kept(specs: &[LayerSpec], scheme: &KvScheme) {
    static SAID: std::sync::Once = std::sync::Once::new();
    let Some(sliding) = scheme.sliding.filter(|c| *c != scheme.default) else {
        return;
    };
    let windows: Vec<usize> = specs
        .iter()
        .filter_map(|s| match s.retention {
            Retention::Window { size } => Some(size),
            Retention::Full => None,
        })
        .collect();
    if let Some(size) = windows.iter().max() {
        SAID.call_once(|| {
            eprintln!(
                "note: KV scheme {scheme}: the {} sliding-window layers (of {}) stay {sliding}; \
                 they hold at most {size} positions each",
                windows.len(),
                specs.len()
            )
        });
    }
}

impl KvCache {
    /// Builds one layer cache per spec; `left_pad[row]` is the padding before row `row`'s
    /// first real token (all zeros for a single sequence).
    pub fn new(
        specs: &[LayerSpec],
        scheme: &KvScheme,
        left_pad: Vec<usize>,
    ) -> Result<Self, KvError> {
        if let Some(&(layer, _)) = scheme.per_layer.iter().find(|(l, _)| *l >= specs.len()) {
            return Err(KvError::UnknownLayer {
                layer,
                layers: specs.len(),
            });
        }
        notice_sliding_kept(specs, scheme);
        let layers = specs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                LayerCache::new(
                    i,
                    *spec,
                    scheme.codec_for(i, spec),
                    scheme.quantized_kv_start,
                    left_pad.clone(),
                )
            })
            .collect::<Result<_, _>>()?;
        Ok(KvCache { layers, left_pad })
    }

    /// Runs every layer's fused reads at `isa` (capped to what the CPU runs; the default is
    /// [`Isa::detected`]).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.layers.iter_mut().for_each(|l| l.set_isa(isa));
        self
    }

    pub fn layer_mut(&mut self, layer: usize) -> &mut LayerCache {
        &mut self.layers[layer]
    }

    pub fn layers(&self) -> &[LayerCache] {
        &self.layers
    }

    pub fn batch(&self) -> usize {
        self.left_pad.len()
    }

    pub fn left_pad(&self) -> &[usize] {
        &self.left_pad
    }

    /// Physical positions appended (padding included).
    pub fn end(&self) -> usize {
        self.layers.first().map_or(0, |l| l.offset())
    }

    /// Real positions per row: the RoPE position of each row's next token.
    pub fn offsets(&self) -> Vec<usize> {
        self.left_pad
            .iter()
            .map(|&p| self.end().saturating_sub(p))
            .collect()
    }

    /// Trims every layer, or none: a refusal by any layer leaves the cache unchanged.
    pub fn trim(&mut self, n: usize) -> Result<(), KvError> {
        for layer in &self.layers {
            layer.check_trim(n)?;
        }
        for layer in &mut self.layers {
            layer.trim(n)?;
        }
        Ok(())
    }

    /// Encoded bytes per position over all layers and rows.
    pub fn bytes_per_token(&self) -> usize {
        self.layers.iter().map(|l| l.bytes_per_token()).sum()
    }

    pub fn allocated_bytes(&self) -> usize {
        self.layers.iter().map(|l| l.allocated_bytes()).sum()
    }

    pub fn signatures(&self) -> Vec<String> {
        self.layers.iter().map(|l| l.signature()).collect()
    }
}
