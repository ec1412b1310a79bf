//! Rewinds: trims and speculative rounds. A row may return to an earlier end exactly when its
//! window's positions are still stored; a round remembers each row's end when it began and
//! its rollback keeps a count of positions per row.

use crate::layer::LayerCache;
use crate::KvError;

impl LayerCache {
    /// Checks that every row may be rewound to end at `ends` (no later than it ends now; a
    /// window's positions still held).
    pub(crate) fn check_rewind(&self, ends: &[usize]) -> Result<(), KvError> {
        if ends.len() != self.rows.batch() {
            return Err(KvError::RowCount {
                given: ends.len(),
                rows: self.rows.batch(),
            });
        }
        for (r, &end) in ends.iter().enumerate() {
            let held = self.rows.end_of(r);
            if end > held {
                return Err(KvError::Rows(format!(
                    "layer {}: row {r} cannot return to end {end}: it ends at {held}",
                    self.layer
                )));
            }
            let (Some(window), pad) = (self.slots.window, self.rows.left_pad()[r]) else {
                continue;
            };
            let needed = self.slots.first_visible(end, pad);
            let oldest = self.rows.held_from()[r];
            if needed < end && needed < oldest {
                return Err(KvError::RingOverwritten {
                    layer: self.layer,
                    row: r,
                    wanted: end.saturating_sub(pad),
                    window,
                    slots: self.slots.ring,
                    needed,
                    held: oldest,
                });
            }
        }
        Ok(())
    }

    /// Rewinds every row to end at `ends` (checked: [`Self::check_rewind`]). Stored slots
    /// past a row's new end are overwritten by its next appends; quantized storage stays
    /// quantized.
    pub fn rewind(&mut self, ends: &[usize]) -> Result<(), KvError> {
        self.check_rewind(ends)?;
        self.rows.set_ends(ends.to_vec());
        Ok(())
    }

    /// Each row's end less `counts[row]`.
    pub(crate) fn trimmed(&self, counts: &[usize]) -> Result<Vec<usize>, KvError> {
        if counts.len() != self.rows.batch() {
            return Err(KvError::RowCount {
                given: counts.len(),
                rows: self.rows.batch(),
            });
        }
        self.rows
            .ends()
            .iter()
            .zip(counts)
            .map(|(&o, &n)| {
                o.checked_sub(n).ok_or(KvError::TrimTooFar {
                    layer: self.layer,
                    requested: n,
                    held: o,
                })
            })
            .collect()
    }

    /// Opens a speculative round: a later [`Self::round_rollback`] returns each row to
    /// its offset now plus the positions it keeps.
    pub fn round_begin(&mut self) -> Result<(), KvError> {
        self.rows.begin_round()
    }

    /// Keeps everything the round appended.
    pub fn round_commit(&mut self) -> Result<(), KvError> {
        self.round_offsets()?;
        self.rows.end_round();
        Ok(())
    }

    /// The ends a rollback keeping `keep[row]` drafted positions per row returns to.
    pub(crate) fn rollback_offsets(&self, keep: &[usize]) -> Result<Vec<usize>, KvError> {
        let before = self.round_offsets()?;
        if keep.len() != before.len() {
            return Err(KvError::RowCount {
                given: keep.len(),
                rows: before.len(),
            });
        }
        Ok(before.iter().zip(keep).map(|(b, k)| b + k).collect())
    }

    /// Closes the round keeping `keep[row]` of the positions it appended to each row.
    pub fn round_rollback(&mut self, keep: &[usize]) -> Result<(), KvError> {
        let ends = self.rollback_offsets(keep)?;
        self.check_rewind(&ends)?;
        self.rows.set_ends(ends);
        self.rows.end_round();
        Ok(())
    }

    fn round_offsets(&self) -> Result<&[usize], KvError> {
        self.rows
            .round()
            .ok_or_else(|| KvError::Rows("no speculative round is open".into()))
    }
}
