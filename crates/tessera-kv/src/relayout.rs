//! Moving rows between caches: one relayout builds a layer from rows of others, their stored
//! codes copied run by run through the retention's slot arithmetic (merge, extend, filter,
//! extract, align and finalize_prefill are each one call of it), and the donor rows a
//! drafter reads.

use crate::layer::{AttentionCache, DonorRows, LayerCache};
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
        let ends: Vec<usize> = sources
            .iter()
            .map(|(c, r, pad)| pad + c.rows.offsets()[*r])
            .collect();
        let held: Vec<usize> = sources
            .iter()
            .map(|(c, r, pad)| {
                c.rows.held_from()[*r].max(c.rows.left_pad()[*r]) - c.rows.left_pad()[*r] + pad
            })
            .collect();
        let width = ends.iter().max().copied().unwrap_or(0);
        let mut planes = model.planes.empty(rows)?;
        // Room for the next append too: a width on a growth step would otherwise regrow (and
        // copy) the whole layer at the first decode after a merge.
        planes.reserve(model.slots.capacity(width + 1), model.slots.ring)?;
        for (i, (src, r, pad)) in sources.iter().enumerate() {
            planes.adopt_row(src.planes.as_ref(), *r, i)?;
            let src_pad = src.rows.left_pad()[*r];
            let lo = src.rows.held_from()[*r].max(src_pad);
            let end = src.rows.end_of(*r).max(lo);
            let shift = *pad as isize - src_pad as isize;
            for run in src.slots.runs_between(lo..end, model.slots, shift) {
                planes.copy_from(src.planes.as_ref(), *r, run.slot, i, run.dst, run.len)?;
            }
        }
        Ok(LayerCache {
            layer: model.layer,
            spec: model.spec,
            slots: model.slots,
            slack: model.slack,
            planes,
            rows: Rows::from_parts(pads, ends, held),
            target: model.target,
            start: model.start,
            minimum_reusable_offset: sources
                .iter()
                .filter_map(|s| s.0.minimum_reusable_offset)
                .max(),
            bound: sources.iter().any(|s| s.0.bound),
            isa: model.isa,
            queries: QueryMoments::gather(sources.iter().map(|(src, r, _)| (&src.queries, *r))),
        })
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
