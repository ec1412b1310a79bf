//! The step-level engine: a [`Batch`] of requests decoded together, which requests join and
//! leave between steps (continuous batching).
//!
//! `add` queues a validated [`GenerationRequest`]; each `step` decodes one token for every
//! running row (with speculation, each row's draft verified in one round), and then reads
//! one bounded chunk of the oldest admitted request's prompt into a cache of its own (so
//! running streams keep flowing while a long prompt is read); several whole short prompts
//! waiting together are read in one forward instead, left-padded to the widest (at most one
//! chunk of tokens in all), so a burst of arrivals costs one forward rather than one each.
//! A request whose prompt is read samples its first token, and its cache is merged into the
//! running batch (codes copied as stored, for every KV codec), which it decodes with from
//! the next step; a request that finishes, or is cancelled, is filtered out at the step
//! that ends it. Rows keep their own ends, so nothing is recomputed when rows come and go.
//! Admission control: at most `max_batch` running rows, the KV bytes every admitted request
//! may grow to within `kv_budget` (from the caches' own accounting, so a 4-bit scheme admits
//! more rows), and at most `max_queue` waiting requests.
//!
//! The parts: `admission.rs` (what `add` refuses, the queue, which prompts are read next
//! and the rows they become), `forwards.rs` (the forwards a step runs), `output.rs` (a
//! row's output stage: sampling, the one draft verification, stops, log-probabilities,
//! events), `ahead.rs` (greedy steps run one ahead of their tokens), `request.rs` (what
//! goes in and comes out).

mod admission;
mod ahead;
mod forwards;
mod output;
mod request;

pub use admission::PREFIX_CHECKPOINT;
pub use request::{
    BatchLimits, BatchSpec, BatchTimes, DraftSource, Event, GenerationRequest, Refused, RequestId,
    TokenLogprobs, MAX_DRAFT, MAX_TOP_LOGPROBS,
};

use crate::prefix::PrefixCache;
use crate::sequence::Sequence;
use crate::speculative::{ModelDrafter, SpecStats};
use crate::EngineError;
use admission::{Prefill, Waiting};
use ahead::Ahead;
use output::Row;
use std::collections::VecDeque;
use std::path::Path;
use std::time::Instant;
use tessera_kv::{AttentionCache, KvCache, KvScheme, Retention};
use tessera_models::{Model, Tokenizer};

/// Requests decoded together; see the module docs.
pub struct Batch<'m> {
    model: &'m Model,
    /// Detokenizes every row's output (stop strings, [`Event::Token`]'s text).
    tokenizer: Option<&'m Tokenizer>,
    scheme: KvScheme,
    prefill_chunk: usize,
    limits: BatchLimits,
    /// KV bytes one row costs per position, per layer, and the layers' windows.
    layer_costs: Vec<(usize, Option<usize>)>,
    running: Option<KvCache>,
    rows: Vec<Row<'m>>,
    prefill: Option<Prefill>,
    waiting: VecDeque<Waiting>,
    /// Running rows cancelled since the last step.
    cancelled: Vec<RequestId>,
    next_id: RequestId,
    prefixes: Option<PrefixCache<'m>>,
    spec: Option<BatchSpec<'m>>,
    spec_stats: SpecStats,
    /// Rows of finished or cancelled requests kept for [`Batch::take_row`]
    /// ([`Batch::keeping_rows`]), with the tokens each holds.
    kept: Option<Vec<(RequestId, Sequence)>>,
    times: BatchTimes,
    /// Run greedy decode steps one ahead of their tokens ([`Batch::with_steps_ahead`]).
    steps_ahead: bool,
    /// The step run ahead whose tokens the rows have not taken yet.
    ahead: Option<Ahead>,
}

impl<'m> Batch<'m> {
    pub fn new(
        model: &'m Model,
        scheme: &KvScheme,
        prefill_chunk: usize,
        limits: BatchLimits,
    ) -> Result<Self, EngineError> {
        if prefill_chunk == 0 {
            return Err(EngineError::Invalid(
                "--prefill-chunk must be at least 1".into(),
            ));
        }
        if limits.max_batch == 0 {
            return Err(EngineError::Invalid(
                "--max-batch must be at least 1".into(),
            ));
        }
        let probe = KvCache::new(&model.layer_specs(), scheme, vec![0])?;
        let layer_costs = probe
            .layers()
            .iter()
            .map(|l| {
                let window = match l.spec().retention {
                    Retention::Full => None,
                    Retention::Window { size } => Some(size),
                };
                (l.bytes_per_token(), window)
            })
            .collect();
        Ok(Batch {
            model,
            tokenizer: None,
            scheme: scheme.clone(),
            prefill_chunk,
            limits,
            layer_costs,
            running: None,
            rows: Vec::new(),
            prefill: None,
            waiting: VecDeque::new(),
            cancelled: Vec::new(),
            next_id: 0,
            prefixes: None,
            spec: None,
            spec_stats: SpecStats::default(),
            kept: None,
            times: BatchTimes::default(),
            steps_ahead: model.device().is_cuda(),
            ahead: None,
        })
    }

    /// Whether greedy decode steps run one ahead of their tokens (by default on a GPU, where
    /// they took 0.1–0.2 ms off a batch-1 step of an 8B, BENCHMARKS.md; off on the CPU, where
    /// a forward runs as it is called and nothing would overlap). Run ahead, a step queues
    /// its forward on the ids the previous step chose (on the device, where it picks
    /// them), then takes the previous step's tokens while the forward runs:
    /// the device does not idle while the host reads tokens, emits them and prepares the
    /// next step. Each token is emitted one step later, and a row that ends on a token has
    /// had one step more computed for it, which leaves with it: a kept row
    /// ([`Batch::keeping_rows`]) that ended on a stop token holds that token fed, and says
    /// so in the tokens [`Batch::take_row`] hands back. It applies while every running row
    /// is greedy without penalties or log-probabilities, no row is about to reach its
    /// `max_tokens` or the context, nothing waits to be read, and the batch has no
    /// speculation or prefix store; other steps take any tokens still ahead first and run
    /// as before.
    pub fn with_steps_ahead(mut self, on: bool) -> Self {
        self.set_steps_ahead(on);
        self
    }

    /// [`Batch::with_steps_ahead`] where `allowed`, else off: a caller's switch that leaves
    /// the default (by device) in place unless it turns steps ahead off.
    pub fn allowing_steps_ahead(mut self, allowed: bool) -> Self {
        self.allow_steps_ahead(allowed);
        self
    }

    /// [`Batch::allowing_steps_ahead`] on a batch already made.
    pub fn allow_steps_ahead(&mut self, allowed: bool) {
        self.steps_ahead &= allowed;
    }

    /// [`Batch::with_steps_ahead`] on a batch already running: a step still ahead keeps
    /// its tokens for the next step to take.
    pub fn set_steps_ahead(&mut self, on: bool) {
        self.steps_ahead = on;
    }

    /// Takes the tokens of a step run ahead, if any (their events), so that every token
    /// decoded so far is emitted: for a caller that stops stepping before the batch is
    /// idle.
    pub fn settle(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = Vec::new();
        self.settle_ahead(&mut events)?;
        Ok(events)
    }

    /// Keeps the row of every request that leaves (finished, failed or cancelled) with
    /// the tokens its cache holds, until [`Batch::take_row`] hands it over: a caller that
    /// continues the sequence (a chat's next turn, a prompt cache to save) resumes from it.
    pub fn keeping_rows(mut self) -> Self {
        self.kept = Some(Vec::new());
        self
    }

    /// Hands over request `id`'s row: the tokens its cache holds and the cache (one row).
    /// A request still decoding leaves the batch now (as if cancelled); one still waiting
    /// gives back the sequence it was queued with ([`Batch::add_resumed`]). `None`, with
    /// nothing changed, in a batch that does not keep rows ([`Batch::keeping_rows`]), and
    /// when the request holds no cache.
    pub fn take_row(&mut self, id: RequestId) -> Result<Option<Sequence>, EngineError> {
        if self.kept.is_none() {
            return Ok(None);
        }
        if let Some(i) = self.rows.iter().position(|r| r.id == id) {
            self.remove_rows(&[i])?;
        }
        if self.prefill.as_ref().is_some_and(|p| p.id == id) {
            if let Some(p) = self.prefill.take() {
                let mut tokens = p.request.prompt;
                tokens.truncate(p.fed);
                return Ok(Some(Sequence::new(tokens, p.cache)?));
            }
        }
        if let Some(at) = self.waiting.iter().position(|w| w.id == id) {
            return Ok(self.waiting.remove(at).and_then(|w| w.resumed));
        }
        let kept = self.kept.as_mut();
        Ok(kept.and_then(|k| {
            let at = k.iter().position(|(r, _)| *r == id)?;
            Some(k.swap_remove(at).1)
        }))
    }

    /// Where the batch's time went so far.
    pub fn times(&self) -> &BatchTimes {
        &self.times
    }

    /// Detokenizes each row's output as it is generated: [`Event::Token`] and
    /// [`Event::Finished`] carry the text, and requests may have stop strings.
    pub fn with_tokenizer(mut self, tokenizer: &'m Tokenizer) -> Self {
        self.tokenizer = Some(tokenizer);
        self
    }

    /// Decodes with speculation ([`BatchSpec`]). Only before the first request: every
    /// row's cache is made with round slack for the drafts. A draft model must share the
    /// target's vocabulary and take the batch's KV scheme (one drafter is made here to
    /// check).
    pub fn with_speculation(mut self, spec: BatchSpec<'m>) -> Result<Self, EngineError> {
        if !(1..=MAX_DRAFT).contains(&spec.max_draft) {
            return Err(EngineError::Invalid(format!(
                "speculation drafts 1 to {MAX_DRAFT} tokens a round, not {}",
                spec.max_draft
            )));
        }
        match spec.source {
            DraftSource::Ngram { n: 0 } => {
                return Err(EngineError::Invalid(
                    "prompt-lookup drafting needs an n-gram of at least 1 token".into(),
                ))
            }
            DraftSource::Ngram { .. } => {}
            DraftSource::Model(draft) => {
                let config = crate::SamplerConfig::default();
                ModelDrafter::new(draft, self.model, &self.scheme, spec.max_draft, &config)?;
            }
        }
        if !self.is_idle() || self.next_id > 0 {
            return Err(EngineError::Invalid(
                "speculation is set before the first request".into(),
            ));
        }
        self.spec = Some(spec);
        Ok(self)
    }

    /// What the speculative rounds did so far (all zero without speculation).
    pub fn spec_stats(&self) -> &SpecStats {
        &self.spec_stats
    }

    /// Round slack every row's cache has (the longest draft).
    fn round_slack(&self) -> usize {
        self.spec.map_or(0, |s| s.max_draft)
    }

    /// Keeps finished requests' rows (up to `budget` bytes of KV) so later requests sharing
    /// a prefix with one read only their new suffix ([`PrefixCache`]).
    pub fn with_prefix_cache(mut self, budget: usize) -> Self {
        self.prefixes = (budget > 0).then(|| PrefixCache::new(budget));
        self
    }

    /// [`Batch::with_prefix_cache`], the store mirrored to the folder `dir` (which must
    /// exist): rows kept are saved there, and the fitting files already there are indexed
    /// and read when a request first reuses them ([`PrefixCache::with_dir`]). Errs only
    /// when the folder cannot be listed.
    pub fn with_prefix_cache_dir(mut self, budget: usize, dir: &Path) -> Result<Self, EngineError> {
        self.prefixes = if budget > 0 {
            Some(PrefixCache::with_dir(
                budget,
                dir,
                self.model,
                &self.scheme,
            )?)
        } else {
            None
        };
        Ok(self)
    }

    /// The prefix store's notes since the last call (files skipped, dropped or not saved),
    /// for the caller to log.
    pub fn take_notes(&mut self) -> Vec<String> {
        self.prefixes
            .as_mut()
            .map_or_else(Vec::new, PrefixCache::take_notes)
    }

    /// The prefix store, where there is one.
    pub fn prefix_cache(&self) -> Option<&PrefixCache<'m>> {
        self.prefixes.as_ref()
    }

    /// KV bytes one row holding `positions` positions costs.
    pub fn kv_bytes_for(&self, positions: usize) -> usize {
        self.layer_costs
            .iter()
            .map(|&(bytes, window)| bytes * window.map_or(positions, |w| positions.min(w)))
            .sum()
    }

    /// KV bytes the admitted requests may grow to.
    pub fn kv_bytes_reserved(&self) -> usize {
        self.rows.iter().map(|r| r.kv_bytes).sum::<usize>()
            + self.prefill.as_ref().map_or(0, |p| p.kv_bytes)
    }

    /// KV bytes the caches hold now.
    pub fn kv_bytes_allocated(&self) -> usize {
        self.running.as_ref().map_or(0, |c| c.allocated_bytes())
            + self
                .prefill
                .as_ref()
                .map_or(0, |p| p.cache.allocated_bytes())
    }

    /// Requests decoding now.
    pub fn running(&self) -> usize {
        self.rows.len()
    }

    /// Requests queued or having their prompt read.
    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.prefill.is_some() as usize
    }

    pub fn is_idle(&self) -> bool {
        self.rows.is_empty() && self.prefill.is_none() && self.waiting.is_empty()
    }
    /// One step: one token for every running row, then a chunk of the oldest admitted
    /// prompt (rows that finished make room for it). A request whose prompt is read samples
    /// its first token and decodes from the next step on, one token a step.
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let mut events = Vec::new();
        if !self.keeps_ahead() {
            self.settle_ahead(&mut events)?;
        }
        self.drop_cancelled()?;
        self.decode(&mut events)?;
        if !self.prefill_group(&mut events)? {
            self.admit()?;
            self.prefill_chunk(&mut events)?;
        }
        Ok(events)
    }
    fn drop_cancelled(&mut self) -> Result<(), EngineError> {
        if self.cancelled.is_empty() {
            return Ok(());
        }
        let cancelled = std::mem::take(&mut self.cancelled);
        let gone: Vec<usize> = (0..self.rows.len())
            .filter(|&i| cancelled.contains(&self.rows[i].id))
            .collect();
        self.remove_rows(&gone)
    }

    /// Filters rows `gone` out of the running batch.
    fn remove_rows(&mut self, gone: &[usize]) -> Result<(), EngineError> {
        if gone.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let keep = gaps_filled_from_the_end(self.rows.len(), gone);
        if self.prefixes.is_some() || self.kept.is_some() {
            let offsets = self
                .running
                .as_ref()
                .map_or_else(Vec::new, KvCache::offsets);
            for &i in gone {
                // A leaving row holds the tokens it was fed: its history up to its offset,
                // and the stop token it ended on where a step run ahead fed it.
                let row = &self.rows[i];
                let offset = offsets.get(i).copied().unwrap_or(0);
                let fed = offset.min(row.history.len());
                let mut tokens = row.history[..fed].to_vec();
                if let Some(stop) = row.stop_token.filter(|_| offset == fed + 1) {
                    tokens.push(stop);
                }
                // The last row leaving takes the cache itself rather than a copy.
                let cache = match self.running.take() {
                    Some(c) if keep.is_empty() && gone.len() == 1 => c,
                    Some(c) => {
                        let row = c.extract(i);
                        self.running = Some(c);
                        row?
                    }
                    None => continue,
                };
                self.leave(self.rows[i].id, tokens, cache)?;
            }
        }
        match self.ahead.as_mut() {
            Some(_) if keep.is_empty() => self.ahead = None,
            Some(ahead) => ahead.retain(&keep)?,
            None => {}
        }
        if keep.is_empty() {
            self.running = None;
        } else if let Some(cache) = self.running.as_mut() {
            // In place where the rows can stay (the host's planes): a leaving row's place
            // is taken by the last row, the only one copied.
            cache.retain(&keep)?;
        }
        self.times.rows += started.elapsed();
        self.times.row_moves += 1;
        let mut rows: Vec<Option<Row<'m>>> = std::mem::take(&mut self.rows)
            .into_iter()
            .map(Some)
            .collect();
        self.rows = keep.iter().filter_map(|&r| rows[r].take()).collect();
        Ok(())
    }
}

/// The rows of `n` that remain when rows `gone` leave, in the order they then take: each
/// stays at its index, except that a leaving row's index below the remaining count is
/// taken by one of the last rows (the least moved in place; see [`KvCache::retain`]).
fn gaps_filled_from_the_end(n: usize, gone: &[usize]) -> Vec<usize> {
    let kept: Vec<usize> = (0..n).filter(|i| !gone.contains(i)).collect();
    let len = kept.len();
    let mut tail = kept.iter().copied().filter(|&r| r >= len).rev();
    (0..len)
        .filter_map(|i| {
            if gone.contains(&i) {
                tail.next()
            } else {
                Some(i)
            }
        })
        .collect()
}

impl<'m> Batch<'m> {
    /// A leaving request's row (holding `tokens`): into the prefix store, and kept for
    /// [`Batch::take_row`].
    fn leave(
        &mut self,
        id: RequestId,
        tokens: Vec<u32>,
        cache: KvCache,
    ) -> Result<(), EngineError> {
        if self.prefixes.is_none() && self.kept.is_none() {
            return Ok(());
        }
        // A row whose cache does not hold exactly its tokens would be a bug here: it is
        // kept nowhere rather than failing the other rows' step.
        let Ok(row) = Sequence::new(tokens, cache) else {
            debug_assert!(false, "a leaving row's cache does not hold its tokens");
            return Ok(());
        };
        match (self.prefixes.as_mut(), self.kept.as_mut()) {
            (Some(store), Some(kept)) => {
                let copy = Sequence::new(row.tokens().to_vec(), row.cache().extract(0)?)?;
                store.insert(copy);
                kept.push((id, row));
            }
            (Some(store), None) => store.insert(row),
            (None, Some(kept)) => kept.push((id, row)),
            (None, None) => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{gaps_filled_from_the_end, TokenLogprobs};

    #[test]
    fn leaving_rows_gaps_are_filled_from_the_end() {
        for n in 0..7usize {
            // Every subset of n rows leaving.
            for mask in 0..(1u32 << n) {
                let gone: Vec<usize> = (0..n).filter(|&r| mask & (1 << r) != 0).collect();
                let keep = gaps_filled_from_the_end(n, &gone);
                let mut sorted = keep.clone();
                sorted.sort_unstable();
                let kept: Vec<usize> = (0..n).filter(|r| !gone.contains(r)).collect();
                assert_eq!(sorted, kept, "n {n}, gone {gone:?}: {keep:?}");
                for (i, &r) in keep.iter().enumerate() {
                    // A staying row below the count keeps its index; one moved comes from
                    // past the count.
                    assert!(r == i || r >= keep.len(), "n {n}, gone {gone:?}: {keep:?}");
                }
                assert!(tessera_kv::planes::keeps_in_place(&keep, n));
            }
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_top_is_sorted() {
        let logits = [1.0f32, 3.0, -2.0, 2.5, 3.0];
        // From the definition, in f64.
        let total: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let lp = |i: usize| (logits[i] as f64).exp().ln() - total.ln();
        let got = TokenLogprobs::new(&logits, 3, 3);
        assert!((got.logprob as f64 - lp(3)).abs() < 1e-6);
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        // Ties (ids 1 and 4) in either order, then id 3.
        assert!(ids == [1, 4, 3] || ids == [4, 1, 3], "{ids:?}");
        for (id, l) in &got.top {
            assert!((*l as f64 - lp(*id as usize)).abs() < 1e-6);
        }
        let probs: f64 = (0..logits.len()).map(|i| lp(i).exp()).sum();
        assert!((probs - 1.0).abs() < 1e-9);
        assert!(TokenLogprobs::new(&logits, 0, 0).top.is_empty());
        assert_eq!(TokenLogprobs::new(&logits, 0, 99).top.len(), logits.len());
    }
}
