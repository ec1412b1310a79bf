//! The bf16-first transition (the seeds' lego): a layer with a quantized codec stores bf16
//! until an append leaves it holding `quantized_kv_start` positions, reads that append in
//! bf16, then converts every stored slot and drops the bf16 planes.

use crate::layer::LayerCache;
use crate::planes::{planes_for, Planes};
use crate::{Codec, KvError};
use std::ops::Range;

impl LayerCache {
    /// Whether the storage is still the bf16 stage of a quantized codec.
    pub fn awaiting_conversion(&self) -> bool {
        self.target.is_some() && !self.planes.codec().is_quantized()
    }

    /// Positions an append may add before the bf16-first transition converts this layer
    /// (the seeds' `maxAppendTokens`): an append of exactly that many converts at
    /// `quantized_kv_start`. `None` where no transition lies ahead.
    pub fn max_append_tokens(&self) -> Option<usize> {
        let width = self.rows.width();
        (self.awaiting_conversion() && self.start > width).then(|| self.start - width)
    }

    /// The bf16-first transition: once an append leaves this layer holding at least
    /// `quantized_kv_start` positions, encode every stored slot into the target codec's
    /// planes and drop the bf16 planes. Irreversible; the slots (and so a ring's write
    /// index) carry over unchanged. Returns the retired bf16 planes (the append that
    /// converts is read from them).
    pub(crate) fn convert_if_due(&mut self) -> Result<Option<Box<dyn Planes>>, KvError> {
        let width = self.rows.width();
        let Some(target) = self.target else {
            return Ok(None);
        };
        if !self.awaiting_conversion() || width < self.start || width == 0 {
            return Ok(None);
        }
        let used = self.slots.capacity(width);
        let rows = self.rows.batch();
        let (k, v) = self.planes.read(0..rows, 0, used)?;
        let mut converted = planes_for(target, self.geometry(), k.device())?;
        if let Codec::Turbo { prep, .. } = target {
            let live: Vec<Range<usize>> = (0..rows).map(|r| self.live_slots(r)).collect();
            converted.fit_key_prep(&k, &live, prep)?;
        }
        let capacity = self.planes.capacity().min(self.slots.ring).max(used);
        converted.reserve(capacity, self.slots.ring)?;
        converted.write(0..rows, 0, &k, &v)?;
        let retired = std::mem::replace(&mut self.planes, converted);
        if self.start > 0 {
            self.minimum_reusable_offset = Some(width);
        }
        Ok(Some(retired))
    }

    /// The slots holding row `row`'s live positions, as one range (a wrapped ring whose
    /// live positions do not cover it: the longer of its two runs — what a key preparation
    /// is fitted on).
    pub(crate) fn live_slots(&self, row: usize) -> Range<usize> {
        let lo = self.rows.held_from()[row].max(self.rows.left_pad()[row]);
        let end = self.rows.end_of(row);
        if end <= lo {
            return 0..0;
        }
        if end - lo >= self.slots.ring {
            return 0..self.slots.ring;
        }
        let (a, b) = (self.slots.slot(lo), self.slots.slot(end - 1) + 1);
        if a < b {
            a..b
        } else if self.slots.ring - a >= b {
            a..self.slots.ring
        } else {
            0..b
        }
    }

}
