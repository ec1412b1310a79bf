//! Rows: the codec-agnostic batch bookkeeping of the reference design's `KvTensorRows`.
//!
//! Rows of a batch share one physical token axis. A row whose prompt is shorter than the
//! longest is left padded: its first `left_pad[row]` physical positions hold padding that no
//! query may attend. Row `r` therefore holds `end - left_pad[r]` real positions, and its next
//! token has RoPE position `end - left_pad[r]`. Rows never encode or decode keys and values.

use crate::KvError;
use candle_core::{Device, Tensor};

#[derive(Debug, Clone)]
pub struct Rows {
    left_pad: Vec<usize>,
    end: usize,
}

impl Rows {
    pub fn new(left_pad: Vec<usize>) -> Self {
        Rows { left_pad, end: 0 }
    }

    pub fn batch(&self) -> usize {
        self.left_pad.len()
    }

    /// Physical positions appended so far (padding included), shared by every row.
    pub fn end(&self) -> usize {
        self.end
    }

    pub fn left_pad(&self) -> &[usize] {
        &self.left_pad
    }

    /// Real positions each row holds: the RoPE position of its next token.
    pub fn offsets(&self) -> Vec<usize> {
        self.left_pad
            .iter()
            .map(|&p| self.end.saturating_sub(p))
            .collect()
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.end += n;
    }

    pub(crate) fn retreat(&mut self, n: usize) {
        self.end -= n;
    }

    /// Additive attention mask `(rows, 1, n, keys)` for `n` queries at physical positions
    /// `self.end() ..`, against keys at physical positions `key_positions`: causal, padding
    /// excluded, and (for sliding layers) only keys less than `window` positions back.
    /// `None` when every query may see every key. A query on a padding position would see
    /// no key at all; it is let see itself so its (discarded) output stays finite.
    pub fn mask(
        &self,
        n: usize,
        key_positions: &[usize],
        window: Option<usize>,
        device: &Device,
    ) -> Result<Option<Tensor>, KvError> {
        let s = key_positions.len();
        let b = self.batch();
        let mut data = vec![0f32; b * n * s];
        let mut any_masked = false;
        for (row, &pad) in self.left_pad.iter().enumerate() {
            for i in 0..n {
                let q = self.end + i;
                let line = &mut data[(row * n + i) * s..(row * n + i + 1) * s];
                let mut any_visible = false;
                for (j, &k) in key_positions.iter().enumerate() {
                    let visible = k <= q && k >= pad && window.map_or(true, |w| q - k < w);
                    if visible {
                        any_visible = true;
                    } else {
                        line[j] = f32::NEG_INFINITY;
                        any_masked = true;
                    }
                }
                if !any_visible {
                    if let Some(j) = key_positions.iter().position(|&k| k == q) {
                        line[j] = 0.0;
                    }
                }
            }
        }
        if !any_masked {
            return Ok(None);
        }
        Ok(Some(Tensor::from_vec(data, (b, 1, n, s), device)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_excludes_padding_future_and_out_of_window() {
        let mut rows = Rows::new(vec![0, 2]);
        rows.advance(3); // physical positions 0,1,2 held; row 1's first two are padding
        let keys: Vec<usize> = (0..5).collect();
        let m = rows.mask(2, &keys, Some(3), &Device::Cpu).unwrap().unwrap();
        let m: Vec<f32> = m.flatten_all().unwrap().to_vec1().unwrap();
        let vis = |row: usize, i: usize, j: usize| m[(row * 2 + i) * 5 + j] == 0.0;
        // Row 0, query at position 3, window 3: sees 1,2,3.
        assert_eq!(
            (0..5).map(|j| vis(0, 0, j)).collect::<Vec<_>>(),
            [false, true, true, true, false]
        );
        // Row 1, query at position 4: sees 2,3,4 (0 and 1 are padding anyway).
        assert_eq!(
            (0..5).map(|j| vis(1, 1, j)).collect::<Vec<_>>(),
            [false, false, true, true, true]
        );
        assert_eq!(rows.offsets(), vec![3, 1]);
    }

    #[test]
    fn unmasked_decode_needs_no_mask() {
        let mut rows = Rows::new(vec![0]);
        rows.advance(4);
        let keys: Vec<usize> = (0..5).collect();
        assert!(rows.mask(1, &keys, None, &Device::Cpu).unwrap().is_none());
    }
}
