//! The caches of every layer of one model, for one batch of rows, and the row operations
//! on all of them at once: each is checked on every layer before any layer changes.

use crate::layer::{AttentionCache, DonorRows, LayerCache};
use crate::{Isa, KvError, KvScheme, LayerSpec, Retention};

/// The caches of every layer of one model, for one batch of rows.
#[derive(Debug, Default)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    /// The rows' padding where there are no layers to hold it.
    pads: Vec<usize>,
    /// The right padding of a prepared prefill ([`KvCache::prepare_prefill`]).
    prefill: Option<Vec<usize>>,
}

/// The notice (as the seeds give for TurboQuant) that a scheme leaves the sliding-window
/// layers in another codec than the rest, for the caller to show; `None` when it does not.
pub fn sliding_notice(specs: &[LayerSpec], scheme: &KvScheme) -> Option<String> {
    let sliding = scheme.sliding.filter(|c| *c != scheme.default)?;
    let windows: Vec<usize> = specs
        .iter()
        .filter_map(|s| match s.retention {
            Retention::Window { size } => Some(size),
            Retention::Full => None,
        })
        .collect();
    let size = windows.iter().max()?;
    Some(format!(
        "KV scheme {scheme}: the {} sliding-window layers (of {}) stay {sliding}; they hold at \
         most {size} positions each",
        windows.len(),
        specs.len()
    ))
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
        Ok(KvCache::of_layers(layers, left_pad))
    }

    pub(crate) fn of_layers(layers: Vec<LayerCache>, pads: Vec<usize>) -> Self {
        KvCache {
            layers,
            pads,
            prefill: None,
        }
    }

    /// Runs every layer's fused reads at `isa` (capped to what the CPU runs; the default is
    /// [`Isa::detected`]).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.layers.iter_mut().for_each(|l| l.set_isa(isa));
        self
    }

    /// Gives every sliding-window ring `slack` slots beyond its window, so speculative
    /// rounds of up to `slack + 1` positions roll back after the ring has wrapped. A builder:
    /// on a cache that has already appended, the slack stays what it was.
    pub fn with_round_slack(mut self, slack: usize) -> Self {
        if self.end() == 0 {
            for layer in &mut self.layers {
                // Refused only once something is stored, which end() == 0 rules out.
                let _ = layer.set_round_slack(slack);
            }
        }
        self
    }

    /// The round slack of the sliding-window rings (the least of any layer; 0 without
    /// layers).
    pub fn round_slack(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.round_slack())
            .min()
            .unwrap_or(0)
    }

    pub fn layer_mut(&mut self, layer: usize) -> &mut LayerCache {
        &mut self.layers[layer]
    }

    pub fn layers(&self) -> &[LayerCache] {
        &self.layers
    }

    pub fn batch(&self) -> usize {
        self.left_pad().len()
    }

    pub fn left_pad(&self) -> &[usize] {
        self.layers
            .first()
            .map_or(&self.pads, |l| l.rows().left_pad())
    }

    /// Physical positions the rows span (the largest row end, padding included).
    pub fn end(&self) -> usize {
        self.layers.first().map_or(0, |l| l.offset())
    }

    /// Each row's physical end: where its next position is written.
    pub fn ends(&self) -> Vec<usize> {
        self.layers
            .first()
            .map_or_else(|| self.pads.clone(), |l| l.rows().ends())
    }

    /// Real positions per row: the RoPE position of each row's next token.
    pub fn offsets(&self) -> Vec<usize> {
        self.layers
            .first()
            .map_or_else(|| vec![0; self.pads.len()], |l| l.rows().offsets())
    }

    /// Rewinds every layer's rows to end at `ends`, or none: a refusal by any layer leaves
    /// the cache unchanged.
    fn rewind_all(&mut self, ends: &[usize]) -> Result<(), KvError> {
        for layer in &self.layers {
            layer.check_rewind(ends)?;
        }
        for layer in &mut self.layers {
            layer.rewind(ends)?;
        }
        Ok(())
    }

    /// Whether [`KvCache::trim`]`(n)` would succeed: every row holds `n` positions and
    /// every ring still holds what its window needs at the shorter end. Changes nothing.
    pub fn can_trim(&self, n: usize) -> bool {
        let Some(first) = self.layers.first() else {
            return true;
        };
        first
            .trimmed(&vec![n; self.batch()])
            .is_ok_and(|ends| self.layers.iter().all(|l| l.check_rewind(&ends).is_ok()))
    }

    /// Drops the last `n` positions of every row, on every layer or none.
    pub fn trim(&mut self, n: usize) -> Result<(), KvError> {
        self.trim_rows(&vec![n; self.batch()])
    }

    /// Drops the last `counts[row]` positions of each row, on every layer or none.
    pub fn trim_rows(&mut self, counts: &[usize]) -> Result<(), KvError> {
        let Some(first) = self.layers.first() else {
            return Ok(());
        };
        let ends = first.trimmed(counts)?;
        self.rewind_all(&ends)
    }

    /// Opens a speculative round on every layer.
    pub fn round_begin(&mut self) -> Result<(), KvError> {
        if self.layers.iter().any(|l| l.rows().round().is_some()) {
            return Err(KvError::Rows("a speculative round is already open".into()));
        }
        for layer in &mut self.layers {
            layer.round_begin()?;
        }
        Ok(())
    }

    /// Keeps everything the open round appended.
    pub fn round_commit(&mut self) -> Result<(), KvError> {
        for layer in &self.layers {
            layer.rollback_offsets(&vec![0; self.batch()])?;
        }
        for layer in &mut self.layers {
            layer.round_commit()?;
        }
        Ok(())
    }

    /// Closes the open round keeping `keep[row]` of the positions it appended to each row
    /// (the accepted drafts, plus whatever the verifier appended after them).
    pub fn round_rollback(&mut self, keep: &[usize]) -> Result<(), KvError> {
        for layer in &self.layers {
            layer.check_rewind(&layer.rollback_offsets(keep)?)?;
        }
        for layer in &mut self.layers {
            layer.round_rollback(keep)?;
        }
        Ok(())
    }

    /// Checks, before a forward touches any layer, that every layer takes an append of `n`
    /// positions per row (inside a round, none may overwrite ring slots a rollback needs),
    /// so a refused step leaves every layer as it was.
    pub fn check_append(&self, n: usize) -> Result<(), KvError> {
        self.layers.iter().try_for_each(|l| l.guard_round(n))
    }

    /// Positions an append may add before some layer's bf16-first transition (exactly
    /// there a prefill chunk should end); `None` where no transition lies ahead.
    pub fn max_append_tokens(&self) -> Option<usize> {
        self.layers
            .iter()
            .filter_map(|l| l.max_append_tokens())
            .min()
    }

    /// The length the next append should have for the bf16-first transition to fit each
    /// row's codec on the same positions however a prompt is chunked (at most: all of a
    /// shorter prompt); `None`: any ([`LayerCache::first_append`]).
    pub fn first_append(&self) -> Option<usize> {
        self.layers.iter().filter_map(|l| l.first_append()).min()
    }

    /// The earliest prefix a saved copy may be reused from, over every layer and row
    /// (where the bf16-first transition fitted their codecs; [`crate::NEVER_REUSED`]: none).
    pub fn minimum_reusable_offset(&self) -> Option<usize> {
        self.layers
            .iter()
            .filter_map(|l| l.minimum_reusable_offset())
            .max()
    }

    /// Builds a cache from rows of others: layer `l`'s row `i` is row `sources[i].1` of
    /// `caches[sources[i].0]`'s layer `l`, with left padding `sources[i].2`.
    fn relayout(
        caches: &[&KvCache],
        sources: &[(usize, usize, usize)],
    ) -> Result<KvCache, KvError> {
        let layers = caches.first().map_or(0, |c| c.layers.len());
        if let Some(c) = caches.iter().find(|c| c.layers.len() != layers) {
            return Err(KvError::Rows(format!(
                "caches of {layers} and {} layers cannot share rows",
                c.layers.len()
            )));
        }
        if caches.iter().any(|c| c.prefill.is_some()) {
            return Err(KvError::Rows(
                "rows cannot move while a prefill is prepared (finalize it first)".into(),
            ));
        }
        let built = (0..layers)
            .map(|l| {
                let rows: Vec<(&LayerCache, usize, usize)> = sources
                    .iter()
                    .map(|&(c, r, pad)| (&caches[c].layers[l], r, pad))
                    .collect();
                LayerCache::relayout(&rows)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(KvCache::of_layers(
            built,
            sources.iter().map(|s| s.2).collect(),
        ))
    }

    /// One batch of the rows of `caches`, in order, left padded to the widest (each cache
    /// keeps its rows' alignment): codes copied as stored, for every codec. A cache still in
    /// the bf16 stage of a layer whose other caches have converted is converted first (the
    /// quantized stage wins; its rows keep their own turbo fits).
    pub fn merge(mut caches: Vec<KvCache>) -> Result<KvCache, KvError> {
        Self::check_mergeable(&caches.iter().collect::<Vec<_>>())?;
        Self::convert_stages(&mut caches.iter_mut().collect::<Vec<_>>())?;
        Self::merged(&caches.iter().collect::<Vec<_>>())
    }

    /// Appends the rows of `other` after this cache's. Refused (this cache unchanged) where
    /// [`KvCache::merge`] would be.
    ///
    /// Where `other`'s rows end no later than these and every layer's planes move rows in
    /// place (the host's), this cache's rows stay where they are and only `other`'s are
    /// copied: a request joining a running batch costs its own row, not the batch's.
    pub fn extend(&mut self, mut other: KvCache) -> Result<(), KvError> {
        Self::check_mergeable(&[&*self, &other])?;
        Self::convert_stages(&mut [&mut *self, &mut other])?;
        let in_place = self.layers.iter().all(LayerCache::moves_rows_in_place);
        if !in_place || self.end() < other.end() {
            *self = Self::merged(&[&*self, &other])?;
            return Ok(());
        }
        let shift = self.end() - other.end();
        for (mine, theirs) in self.layers.iter_mut().zip(&other.layers) {
            mine.append_rows(theirs, shift)?;
        }
        self.pads.extend(other.left_pad().iter().map(|p| p + shift));
        Ok(())
    }

    /// Keeps rows `keep`, in that order, as [`KvCache::filter`] does, but where the rows can
    /// stay where they lie it leaves them there: when no kept row moves to a higher index
    /// ([`crate::planes::keeps_in_place`]: an increasing `keep`, or one whose gaps are filled
    /// from the end), every layer's planes move rows in place (the host's), and the padding
    /// the kept rows share is less than half the batch's width, only the rows whose index
    /// changes are copied and every row's padding stays as it is. Otherwise it is
    /// [`KvCache::filter`], which slices the shared padding off. A request leaving a running
    /// batch then costs one row (its gap filled by the last), not the batch; the shared
    /// padding (memory for positions no row holds) is sliced once it reaches half the width.
    pub fn retain(&mut self, keep: &[usize]) -> Result<(), KvError> {
        let pads = self.left_pad().to_vec();
        let shared = keep.iter().filter_map(|r| pads.get(*r)).min().copied();
        let in_place = crate::planes::keeps_in_place(keep, pads.len())
            && self.prefill.is_none()
            && self.layers.iter().all(LayerCache::moves_rows_in_place)
            && self.layers.iter().all(|l| l.rows().round().is_none())
            && shared.is_some_and(|s| 2 * s < self.end().max(1));
        if !in_place {
            return self.filter(keep);
        }
        for layer in &mut self.layers {
            layer.retain_rows(keep)?;
        }
        self.pads = keep.iter().map(|&r| pads[r]).collect();
        Ok(())
    }

    /// Everything a merge checks before it changes anything.
    fn check_mergeable(caches: &[&KvCache]) -> Result<(), KvError> {
        let Some(first) = caches.first() else {
            return Err(KvError::Rows("a merge needs at least one cache".into()));
        };
        for c in caches {
            if c.layers.len() != first.layers.len() {
                return Err(KvError::Rows(format!(
                    "caches of {} and {} layers cannot share rows",
                    first.layers.len(),
                    c.layers.len()
                )));
            }
            if c.prefill.is_some() {
                return Err(KvError::Rows(
                    "rows cannot move while a prefill is prepared (finalize it first)".into(),
                ));
            }
            for (a, b) in first.layers.iter().zip(&c.layers) {
                a.check_compatible(b, true)?;
            }
        }
        Ok(())
    }

    /// Converts every layer still in its bf16 stage where another cache's same layer has
    /// converted.
    fn convert_stages(caches: &mut [&mut KvCache]) -> Result<(), KvError> {
        let layers = caches.first().map_or(0, |c| c.layers.len());
        for l in 0..layers {
            if caches.iter().any(|c| !c.layers[l].awaiting_conversion()) {
                for c in caches.iter_mut() {
                    c.layers[l].convert()?;
                }
            }
        }
        Ok(())
    }

    fn merged(caches: &[&KvCache]) -> Result<KvCache, KvError> {
        let width = caches.iter().map(|c| c.end()).max().unwrap_or(0);
        let mut sources = Vec::new();
        for (i, c) in caches.iter().enumerate() {
            let shift = width - c.end();
            for (r, pad) in c.left_pad().iter().enumerate() {
                sources.push((i, r, pad + shift));
            }
        }
        Self::relayout(caches, &sources)
    }

    /// Keeps rows `keep`, in that order, and slices off the left padding they all share.
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), KvError> {
        let pads = self.left_pad().to_vec();
        if let Some(&r) = keep.iter().find(|&&r| r >= pads.len()) {
            return Err(KvError::Rows(format!(
                "row {r} of a cache of {} rows",
                pads.len()
            )));
        }
        let shared = keep.iter().map(|&r| pads[r]).min().unwrap_or(0);
        let sources: Vec<_> = keep.iter().map(|&r| (0, r, pads[r] - shared)).collect();
        *self = Self::relayout(&[self], &sources)?;
        Ok(())
    }

    /// Row `row` as a one-row cache of the same codecs, its live span only.
    pub fn extract(&self, row: usize) -> Result<KvCache, KvError> {
        if row >= self.batch() {
            return Err(KvError::Rows(format!(
                "row {row} of a cache of {} rows",
                self.batch()
            )));
        }
        Self::relayout(&[self], &[(0, row, 0)])
    }

    /// Moves each row so its padding is `left_pad[row]` (its positions and codes as they are).
    pub fn align(&mut self, left_pad: &[usize]) -> Result<(), KvError> {
        if left_pad.len() != self.batch() {
            return Err(KvError::RowCount {
                given: left_pad.len(),
                rows: self.batch(),
            });
        }
        if left_pad == self.left_pad() {
            return Ok(());
        }
        let sources: Vec<_> = left_pad
            .iter()
            .enumerate()
            .map(|(r, &p)| (0, r, p))
            .collect();
        *self = Self::relayout(&[self], &sources)?;
        Ok(())
    }

    /// Starts a right-padded prefill (the seeds' `FullPrefillPadding`): the next append
    /// holds row `r`'s real tokens followed by `right_pad[r]` padding tokens, so unequal
    /// prompts prefill as one batch with no per-row chunking. [`KvCache::finalize_prefill`]
    /// then drops the padding and rolls the rows to left padding.
    pub fn prepare_prefill(&mut self, right_pad: &[usize]) -> Result<(), KvError> {
        if right_pad.len() != self.batch() {
            return Err(KvError::RowCount {
                given: right_pad.len(),
                rows: self.batch(),
            });
        }
        if self.layers.iter().any(|l| l.rows().round().is_some()) {
            return Err(KvError::Rows(
                "a prefill cannot start inside a speculative round".into(),
            ));
        }
        self.prefill = Some(right_pad.to_vec());
        Ok(())
    }

    /// Ends a prepared prefill: each row drops its right padding, then the rows are moved so
    /// they all end together (left padding). A sliding-window ring whose padding evicted
    /// positions its row still sees refuses (nothing changes; give it round slack of the
    /// longest padding, or prefill those rows apart).
    pub fn finalize_prefill(&mut self) -> Result<(), KvError> {
        let Some(right_pad) = self.prefill.take() else {
            return Ok(());
        };
        let result = self.trim_rows(&right_pad);
        if let Err(e) = result {
            self.prefill = Some(right_pad);
            return Err(e);
        }
        let ends = self.ends();
        let width = ends.iter().max().copied().unwrap_or(0);
        let pads: Vec<usize> = self
            .left_pad()
            .iter()
            .zip(&ends)
            .map(|(p, e)| p + width - e)
            .collect();
        self.align(&pads)
    }

    /// Every layer's rows as a drafter reads them ([`LayerCache::capture_donor_rows`]).
    pub fn capture_donor_rows(&self) -> Result<Vec<DonorRows>, KvError> {
        self.layers.iter().map(|l| l.capture_donor_rows()).collect()
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

    pub(crate) fn prefill(&self) -> Option<&[usize]> {
        self.prefill.as_deref()
    }

    pub(crate) fn set_prefill(&mut self, prefill: Option<Vec<usize>>) {
        self.prefill = prefill;
    }
}
