//! Retention: which slot holds which physical position — the slot arithmetic, written once.
//!
//! Full retention stores position `p` in slot `p`. A sliding window of `size` positions is
//! a ring of `size + slack` slots storing `p` in slot `p mod (size + slack)`: queries see at
//! most `size` positions back, and the `slack` extra slots keep the positions a speculative
//! round of up to `slack + 1` positions overwrites, so rolling it back finds them still there.

use crate::planes::RowSlots;
use crate::Retention;
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slots {
    /// The window queries see, if any.
    pub window: Option<usize>,
    /// Slots a row has: `usize::MAX` for full retention.
    pub ring: usize,
}

/// A run of positions stored in consecutive slots: `len` positions from `pos`, in slots
/// `slot ..` (and, when moved, in slots `dst ..` of the destination).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub pos: usize,
    pub slot: usize,
    pub dst: usize,
    pub len: usize,
}

impl Slots {
    pub fn of(retention: Retention, slack: usize) -> Self {
        match retention {
            Retention::Full => Slots {
                window: None,
                ring: usize::MAX,
            },
            Retention::Window { size } => Slots {
                window: Some(size),
                ring: size + slack,
            },
        }
    }

    pub fn slot(&self, pos: usize) -> usize {
        if self.ring == usize::MAX {
            pos
        } else {
            pos % self.ring
        }
    }

    /// Capacity the planes need once every row's positions below `width` are stored.
    pub fn capacity(&self, width: usize) -> usize {
        width.min(self.ring)
    }

    /// The runs storing positions `positions`; positions a later one of them evicts (more
    /// than `ring` of them) are left out.
    pub fn runs(&self, positions: Range<usize>) -> Vec<Run> {
        let start = positions.start.max(positions.end.saturating_sub(self.ring));
        self.runs_between(start..positions.end, *self, 0)
    }

    /// The runs moving positions `positions` of these slots to positions `+ shift` of `to`:
    /// each run consecutive in both.
    pub fn runs_between(&self, positions: Range<usize>, to: Slots, shift: isize) -> Vec<Run> {
        let mut runs = Vec::new();
        let mut pos = positions.start;
        while pos < positions.end {
            let slot = self.slot(pos);
            let dst = to.slot((pos as isize + shift) as usize);
            let len = (positions.end - pos)
                .min(self.ring - slot)
                .min(to.ring - dst);
            runs.push(Run {
                pos,
                slot,
                dst,
                len,
            });
            pos += len;
        }
        runs
    }

    /// The oldest position the next query of a row ending at `end` (padded by `pad`) sees.
    pub fn first_visible(&self, end: usize, pad: usize) -> usize {
        let back = self.window.map_or(0, |w| (end + 1).saturating_sub(w));
        pad.max(back).min(end)
    }

    /// The slots the query at position `pos` of a row padded by `pad` sees, as at most two
    /// ranges, with the row's own position of the first; a padding query sees only itself.
    pub fn visible(&self, pos: usize, pad: usize) -> RowSlots {
        let lo = if pos < pad {
            pos
        } else {
            self.first_visible(pos, pad)
        };
        RowSlots {
            ranges: self.visible_slots(pos, pad),
            first_position: lo.saturating_sub(pad),
        }
    }

    /// The slots the query at position `pos` of a row padded by `pad` sees, as at most two
    /// ranges; a padding query sees only itself.
    pub fn visible_slots(&self, pos: usize, pad: usize) -> Vec<Range<usize>> {
        let lo = if pos < pad {
            pos
        } else {
            self.first_visible(pos, pad)
        };
        let (a, b) = (self.slot(lo), self.slot(pos));
        if a <= b {
            std::iter::once(a..b + 1).collect()
        } else {
            vec![a..self.ring, 0..b + 1]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_runs_split_at_the_wrap_and_drop_evicted() {
        let s = Slots::of(Retention::Window { size: 6 }, 2); // 8 slots
        assert_eq!(
            s.runs(5..12),
            vec![
                Run {
                    pos: 5,
                    slot: 5,
                    dst: 5,
                    len: 3
                },
                Run {
                    pos: 8,
                    slot: 0,
                    dst: 0,
                    len: 4
                }
            ]
        );
        // Twenty positions into eight slots: only the last eight are stored.
        assert_eq!(
            s.runs(0..20),
            vec![
                Run {
                    pos: 12,
                    slot: 4,
                    dst: 4,
                    len: 4
                },
                Run {
                    pos: 16,
                    slot: 0,
                    dst: 0,
                    len: 4
                }
            ]
        );
        assert_eq!(s.first_visible(10, 0), 5);
        assert_eq!(s.visible_slots(9, 0), vec![4..8, 0..2]);
        assert_eq!(s.visible_slots(1, 3), vec![1..2]);
    }

    #[test]
    fn full_retention_is_identity() {
        let s = Slots::of(Retention::Full, 0);
        assert_eq!(
            s.runs(3..9),
            vec![Run {
                pos: 3,
                slot: 3,
                dst: 3,
                len: 6
            }]
        );
        // Moved two positions later in a ring of 8: split where the destination wraps.
        let ring = Slots::of(Retention::Window { size: 8 }, 0);
        assert_eq!(
            s.runs_between(3..9, ring, 2),
            vec![
                Run {
                    pos: 3,
                    slot: 3,
                    dst: 5,
                    len: 3
                },
                Run {
                    pos: 6,
                    slot: 6,
                    dst: 0,
                    len: 3
                }
            ]
        );
        assert_eq!(s.visible_slots(9, 2), vec![2..10]);
    }
}
