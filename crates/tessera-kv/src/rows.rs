//! Rows: the codec-agnostic batch bookkeeping of the reference design's `KvTensorRows`.
//!
//! Row `r` of a batch starts with `left_pad[r]` padding positions that no query may attend
//! (a left-padded prompt's first append writes them), then its real positions, up to its
//! physical end `ends[r]`, where its next append is written. It holds `ends[r] − left_pad[r]`
//! real positions: its next token's RoPE position. Rows have their own ends (a speculative
//! rollback keeps a different count per row); the width of the batch is the largest end. `held_from[r]` is the oldest position row `r`
//! still stores (a ring evicts; a rollback does not bring evicted positions back).
//! `reuse_floor[r]` is the fewest real positions row `r` may be cut back to and still be
//! continued with the numbers a fresh row would get (the bf16-first transition fitted its
//! codec on them; `None`: any). Rows never encode or decode keys and values.

use crate::KvError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rows {
    left_pad: Vec<usize>,
    ends: Vec<usize>,
    held_from: Vec<usize>,
    reuse_floor: Vec<Option<usize>>,
    /// Each row's end when the open speculative round began.
    round: Option<Vec<usize>>,
}

impl Rows {
    pub fn new(left_pad: Vec<usize>) -> Self {
        let rows = left_pad.len();
        Rows {
            held_from: left_pad.clone(),
            left_pad,
            ends: vec![0; rows],
            reuse_floor: vec![None; rows],
            round: None,
        }
    }

    /// Rows with the given padding, ends, oldest held positions and reuse floors.
    pub(crate) fn from_parts(
        left_pad: Vec<usize>,
        ends: Vec<usize>,
        held_from: Vec<usize>,
        reuse_floor: Vec<Option<usize>>,
    ) -> Self {
        Rows {
            left_pad,
            ends,
            held_from,
            reuse_floor,
            round: None,
        }
    }

    /// Each row's reuse floor (see the module's documentation).
    pub fn reuse_floor(&self) -> &[Option<usize>] {
        &self.reuse_floor
    }

    pub(crate) fn set_reuse_floor(&mut self, floors: Vec<Option<usize>>) {
        self.reuse_floor = floors;
    }

    pub fn batch(&self) -> usize {
        self.left_pad.len()
    }

    pub fn left_pad(&self) -> &[usize] {
        &self.left_pad
    }

    /// Real positions each row holds: the RoPE position of its next token.
    pub fn offsets(&self) -> Vec<usize> {
        self.ends
            .iter()
            .zip(&self.left_pad)
            .map(|(e, p)| e.saturating_sub(*p))
            .collect()
    }

    pub fn held_from(&self) -> &[usize] {
        &self.held_from
    }

    /// Row `row`'s physical end: where its next position is written.
    pub fn end_of(&self, row: usize) -> usize {
        self.ends[row]
    }

    pub fn ends(&self) -> Vec<usize> {
        self.ends.clone()
    }

    /// Physical positions the batch spans: the largest row end.
    pub fn width(&self) -> usize {
        self.ends.iter().max().copied().unwrap_or(0)
    }

    /// The ends when the open round began, if one is open.
    pub fn round(&self) -> Option<&[usize]> {
        self.round.as_deref()
    }

    /// Every row advanced by `n` positions; `ring` slots hold a row's latest positions.
    pub(crate) fn advance(&mut self, n: usize, ring: usize) {
        for r in 0..self.batch() {
            self.ends[r] += n;
            self.held_from[r] = self.held_from[r].max(self.ends[r].saturating_sub(ring));
        }
    }

    /// Sets each row's end (a trim or rollback; checked by the caller).
    pub(crate) fn set_ends(&mut self, ends: Vec<usize>) {
        // A row rewound below everything it still holds holds nothing: what it appends next
        // is stored from its new end on.
        for (held, end) in self.held_from.iter_mut().zip(&ends) {
            *held = (*held).min(*end);
        }
        self.ends = ends;
    }

    /// Keeps rows `keep`, in that order (checked by the caller), as they are.
    pub(crate) fn retain(&mut self, keep: &[usize]) {
        let pick = |v: &[usize]| keep.iter().map(|&r| v[r]).collect::<Vec<_>>();
        self.left_pad = pick(&self.left_pad);
        self.ends = pick(&self.ends);
        self.held_from = pick(&self.held_from);
        self.reuse_floor = keep.iter().map(|&r| self.reuse_floor[r]).collect();
    }

    /// Adds a row after the others: its padding, end, oldest held position and reuse floor.
    pub(crate) fn push(
        &mut self,
        pad: usize,
        end: usize,
        held_from: usize,
        reuse_floor: Option<usize>,
    ) {
        self.left_pad.push(pad);
        self.ends.push(end);
        self.held_from.push(held_from);
        self.reuse_floor.push(reuse_floor);
    }

    pub(crate) fn begin_round(&mut self) -> Result<(), KvError> {
        if self.round.is_some() {
            return Err(KvError::Rows("a speculative round is already open".into()));
        }
        self.round = Some(self.ends.clone());
        Ok(())
    }

    pub(crate) fn end_round(&mut self) {
        self.round = None;
    }

    pub(crate) fn restore_round(&mut self, round: Option<Vec<usize>>) {
        self.round = round;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ends_width_and_eviction() {
        let mut rows = Rows::new(vec![0, 2]);
        rows.advance(5, usize::MAX);
        assert_eq!(rows.ends(), vec![5, 5]);
        assert_eq!(rows.width(), 5);
        assert_eq!(rows.offsets(), vec![5, 3]);
        assert_eq!(rows.held_from(), &[0, 2]);
        // A ring of 4 slots: both rows (end 7) have evicted positions before 3.
        rows.advance(2, 4);
        assert_eq!(rows.held_from(), &[3, 3]);
    }
}
