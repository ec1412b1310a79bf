//! Moving rows between caches: one relayout builds a layer from rows of others, their stored
//! codes copied run by run through the retention's slot arithmetic (merge, extend, filter,
//! extract, align and finalize_prefill are each one call of it), and the donor rows a
//! drafter reads.

use crate::layer::{AttentionCache, DonorRows, LayerCache};
use crate::planes::Planes;
use crate::retention::Slots;
use crate::rows::Rows;
use crate::QueryMoments;
use crate::{KvError, Retention};
use candle_core::Tensor;

impl LayerCache {
    /// Whether `other` stores positions as this layer does (same spec, transition and slack,
    /// and the same codec stage — or, with `stages_may_differ`, one still in the bf16 stage of
    /// the other's codec, which a merge converts first), so rows can move between them.
    pub(crate) fn check_compatible(
        &self,
        other: &LayerCache,
        stages_may_differ: bool,
    ) -> Result<(), KvError> {
        let stage = self.planes.codec() == other.planes.codec()
            || (stages_may_differ
                && self.target.is_some()
                && (self.awaiting_conversion() || other.awaiting_conversion()));
        let same = self.spec == other.spec
            && stage
            && self.target == other.target
            && self.start == other.start
            && self.slack == other.slack;
        if !same {
            return Err(KvError::Rows(format!(
                "layer {}: rows of {} stored as {} (slack {}) cannot join rows of {} stored as {} (slack {})",
                self.layer,
                other.signature(),
                other.planes.codec(),
                other.slack,
                self.signature(),
                self.planes.codec(),
                self.slack
            )));
        }
        if self.rows.round().is_some() || other.rows.round().is_some() {
            return Err(KvError::Rows(format!(
                "layer {}: rows cannot move during a speculative round",
                self.layer
            )));
        }
        Ok(())
    }

    /// A layer whose row `i` is row `sources[i].1` of `sources[i].0` with left padding
    /// `sources[i].2`: the row's held positions copied as stored (packed codes, never
    /// requantized), each moved by the change of its padding. What merge, filter, extract
    /// and align are made of.
    pub(crate) fn relayout(sources: &[(&LayerCache, usize, usize)]) -> Result<LayerCache, KvError> {
        let Some(&(model, _, _)) = sources.first() else {
            return Err(KvError::Rows("a cache needs at least one row".into()));
        };
        for (src, row, _) in sources {
            model.check_compatible(src, false)?;
            if *row >= src.rows.batch() {
                return Err(KvError::Rows(format!(
                    "row {row} of a cache of {} rows",
                    src.rows.batch()
                )));
            }
        }
        let rows = sources.len();
        let pads: Vec<usize> = sources.iter().map(|s| s.2).collect();
        let (ends, held): (Vec<usize>, Vec<usize>) =
            sources.iter().map(|&(c, r, pad)| c.placed(r, pad)).unzip();
        let width = ends.iter().max().copied().unwrap_or(0);
        let mut planes = model.planes.empty(rows)?;
        // Room for the next append too: a width on a growth step would otherwise regrow (and
        // copy) the whole layer at the first decode after a merge.
        planes.reserve(model.slots.capacity(width + 1), model.slots.ring)?;
        for (i, &(src, r, pad)) in sources.iter().enumerate() {
            src.copy_row(r, pad, planes.as_mut(), model.slots, i)?;
        }
        Ok(LayerCache {
            layer: model.layer,
            spec: model.spec,
            slots: model.slots,
            slack: model.slack,
            planes,
            rows: Rows::from_parts(
                pads,
                ends,
                held,
                sources
                    .iter()
                    .map(|&(src, r, _)| src.rows.reuse_floor()[r])
                    .collect(),
            ),
            target: model.target,
            start: model.start,
            bound: sources.iter().any(|s| s.0.bound),
            isa: model.isa,
            queries: QueryMoments::gather(sources.iter().map(|(src, r, _)| (&src.queries, *r))),
        })
    }

    /// Where row `r` lands with padding `pad`: its end and its oldest held position.
    fn placed(&self, r: usize, pad: usize) -> (usize, usize) {
        let own = self.rows.left_pad()[r];
        let held = self.rows.held_from()[r].max(own) - own + pad;
        (pad + self.rows.end_of(r).saturating_sub(own), held)
    }

    /// Copies row `r` into row `dst` of `planes` (laid out by `slots`) with padding `pad`:
    /// its codec state and its held positions as stored, each moved by the change of its
    /// padding.
    fn copy_row(
        &self,
        r: usize,
        pad: usize,
        planes: &mut dyn Planes,
        slots: Slots,
        dst: usize,
    ) -> Result<(), KvError> {
        planes.adopt_row(self.planes.as_ref(), r, dst)?;
        let own = self.rows.left_pad()[r];
        let lo = self.rows.held_from()[r].max(own);
        let end = self.rows.end_of(r).max(lo);
        let shift = pad as isize - own as isize;
        for run in self.slots.runs_between(lo..end, slots, shift) {
            planes.copy_from(self.planes.as_ref(), r, run.slot, dst, run.dst, run.len)?;
        }
        Ok(())
    }

    /// Whether this layer's planes add and remove rows where they lie
    /// ([`Planes::resizes_rows_in_place`]).
    pub(crate) fn moves_rows_in_place(&self) -> bool {
        self.planes.resizes_rows_in_place()
    }

    /// Appends the rows of `other` after this layer's, their padding grown by `shift`, in
    /// place: this layer's rows stay as they are (the caller checked that the layers are
    /// compatible and in one codec stage, that `other`'s rows, so padded, end no later than
    /// these, and that the planes move rows in place).
    pub(crate) fn append_rows(&mut self, other: &LayerCache, shift: usize) -> Result<(), KvError> {
        let (first, added) = (self.rows.batch(), other.rows.batch());
        let kept: Vec<usize> = (0..first).collect();
        self.planes.resize_rows(&kept, added)?;
        let width = self.rows.width().max(other.rows.width() + shift);
        self.planes
            .reserve(self.slots.capacity(width + 1), self.slots.ring)?;
        for r in 0..added {
            let pad = other.rows.left_pad()[r] + shift;
            other.copy_row(r, pad, self.planes.as_mut(), self.slots, first + r)?;
            let (end, held) = other.placed(r, pad);
            self.rows.push(pad, end, held, other.rows.reuse_floor()[r]);
        }
        self.queries = QueryMoments::gather(
            (0..first)
                .map(|r| (&self.queries, r))
                .chain((0..added).map(|r| (&other.queries, r))),
        );
        self.bound |= other.bound;
        Ok(())
    }

    /// Keeps rows `keep` ([`crate::planes::keeps_in_place`]) in place, their padding as it
    /// is: only rows whose index changes are copied.
    pub(crate) fn retain_rows(&mut self, keep: &[usize]) -> Result<(), KvError> {
        if self.rows.round().is_some() {
            return Err(KvError::Rows(format!(
                "layer {}: rows cannot move during a speculative round",
                self.layer
            )));
        }
        self.planes.resize_rows(keep, 0)?;
        self.rows.retain(keep);
        self.queries = QueryMoments::gather(keep.iter().map(|&r| (&self.queries, r)));
        Ok(())
    }

    /// Each row's live keys and values in temporal order, `(1, kv_heads, len, dim)` f32 —
    /// a drafter's read of this (target) cache.
    pub fn capture_donor_rows(&self) -> Result<DonorRows, KvError> {
        let linear = Slots::of(Retention::Full, 0);
        let mut donor = DonorRows::default();
        for r in 0..self.rows.batch() {
            let pad = self.rows.left_pad()[r];
            let lo = self.rows.held_from()[r].max(pad);
            let end = self.rows.end_of(r);
            let (mut ks, mut vs) = (Vec::new(), Vec::new());
            for run in self.slots.runs_between(lo..end, linear, 0) {
                let (k, v) = self.planes.read(r..r + 1, run.slot, run.len)?;
                ks.push(k);
                vs.push(v);
            }
            let (k, v) = if ks.is_empty() {
                let (k, v) = self.planes.read(r..r + 1, 0, 0)?;
                (k, v)
            } else {
                (Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?)
            };
            donor.keys.push(k);
            donor.values.push(v);
            donor.offsets.push(self.rows.offsets()[r]);
            donor.starts.push(lo);
            donor.ends.push(end);
        }
        Ok(donor)
    }
}
