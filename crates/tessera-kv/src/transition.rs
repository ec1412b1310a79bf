//! The bf16-first transition (the seeds' lego): a layer with a quantized codec stores bf16
//! until an append leaves it holding `quantized_kv_start` positions, reads that append in
//! bf16, then converts every stored slot and drops the bf16 planes.
//!
//! With `quantized_kv_start` 0 the first append converts, whatever it holds, and each row's
//! codec is fitted on the keys (and queries) of that append: so that a row's codes do not
//! depend on how its prompt was chunked, an engine makes that append the first
//! [`FIRST_APPEND`] positions of the prompt (all of a shorter one) whatever its chunk size
//! ([`crate::KvCache::first_append`]). A row converted on exactly [`FIRST_APPEND`] positions
//! may be cut back to no fewer (its reuse floor); one converted on fewer was fitted on its
//! whole first prompt, which no other prompt's fresh row would be, so it is never reused
//! ([`NEVER_REUSED`]).

use crate::layer::LayerCache;
use crate::planes::{planes_for, Planes};
use crate::{Codec, KvError, TurboPrep};
use candle_core::Tensor;
use std::ops::Range;

/// The positions a row's first append holds under `quantized_kv_start` 0 (fewer only for a
/// shorter prompt): the keys its codec is fitted on.
pub const FIRST_APPEND: usize = 512;

/// The reuse floor of a row that no other prompt may reuse (see the module's documentation).
pub const NEVER_REUSED: usize = usize::MAX;

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
        if self.awaiting_conversion() && self.start == 0 && width == 0 {
            return Some(FIRST_APPEND);
        }
        (self.awaiting_conversion() && self.start > width).then(|| self.start - width)
    }

    /// The length the next append should have (at most: less where less is left to feed)
    /// for each row's codec to be fitted on the same positions however the prompt is
    /// chunked: [`FIRST_APPEND`] while a layer converting at `quantized_kv_start` 0 is
    /// empty. `None`: any length.
    pub fn first_append(&self) -> Option<usize> {
        (self.awaiting_conversion() && self.start == 0 && self.rows.width() == 0)
            .then_some(FIRST_APPEND)
    }

    /// The bf16-first transition: once an append leaves this layer holding at least
    /// `quantized_kv_start` positions, encode every stored slot into the target codec's
    /// planes and drop the bf16 planes. Irreversible; the slots (and so a ring's write
    /// index) carry over unchanged. Returns the retired bf16 planes (the append that
    /// converts is read from them).
    pub(crate) fn convert_if_due(&mut self) -> Result<Option<Box<dyn Planes>>, KvError> {
        let width = self.rows.width();
        if width < self.start || width == 0 {
            return Ok(None);
        }
        self.convert()
    }

    /// Converts now, wherever the transition stands (rows joining a batch that has already
    /// converted: the quantized stage wins). A layer with nothing to convert to, or already
    /// converted, is left as it is.
    pub(crate) fn convert(&mut self) -> Result<Option<Box<dyn Planes>>, KvError> {
        let width = self.rows.width();
        let Some(target) = self.target else {
            return Ok(None);
        };
        if !self.awaiting_conversion() {
            return Ok(None);
        }
        let used = self.slots.capacity(width);
        let rows = self.rows.batch();
        let (k, v) = self.planes.read(0..rows, 0, used)?;
        let mut converted = planes_for(target, self.geometry(), k.device())?;
        // Turbo fits its key preparation, affine its key means (it ignores the turbo flags),
        // on the keys each row holds.
        let prep = match target {
            Codec::Turbo { prep, .. } => Some(prep),
            Codec::Affine { .. } => Some(TurboPrep::ALL),
            Codec::Plain(_) => None,
        };
        if let Some(prep) = prep {
            let (keys, live) = self.live_keys()?;
            // Taken: once converted, the layer has no use for them (nor its state).
            let queries = std::mem::take(&mut self.queries).weights();
            converted.fit_key_prep(&keys, &live, prep, queries.as_deref())?;
        }
        let capacity = self.planes.capacity().min(self.slots.ring).max(used);
        converted.reserve(capacity, self.slots.ring)?;
        converted.write(0..rows, 0, &k, &v)?;
        let retired = std::mem::replace(&mut self.planes, converted);
        let floors = match self.start {
            0 => self
                .rows
                .offsets()
                .into_iter()
                .map(|held| {
                    Some(if held == FIRST_APPEND {
                        held
                    } else {
                        NEVER_REUSED
                    })
                })
                .collect(),
            _ => vec![Some(width); rows],
        };
        self.rows.set_reuse_floor(floors);
        Ok(Some(retired))
    }

    /// Each row's live keys in temporal order, `(rows, heads, longest, head_dim)` (shorter
    /// rows zero-filled after their end), and the span each row's live keys fill: what a
    /// row's TurboQuant key preparation is fitted on (every live key, however a ring has
    /// placed them; no padding).
    fn live_keys(&self) -> Result<(Tensor, Vec<Range<usize>>), KvError> {
        let donor = self.capture_donor_rows()?;
        let longest = donor.keys.iter().map(|k| k.dims()[2]).max().unwrap_or(0);
        let live: Vec<Range<usize>> = donor.keys.iter().map(|k| 0..k.dims()[2]).collect();
        let keys = donor
            .keys
            .iter()
            .map(|k| k.pad_with_zeros(2, 0, longest - k.dims()[2]))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((Tensor::cat(&keys, 0)?, live))
    }
}
