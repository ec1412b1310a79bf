//! The step-level engine: a [`Batch`] of requests decoded together, which requests join and
//! leave between steps (continuous batching).
//!
//! `add` queues a validated [`GenerationRequest`]; each `step` decodes one token for every
//! running row, and then reads one bounded chunk of the oldest admitted request's prompt
//! into a cache of its own (so running streams keep flowing while a long prompt is read);
//! several whole short prompts waiting together are read in one forward instead, left-padded
//! to the widest (at most one chunk of tokens in all), so a burst of arrivals costs one
//! forward rather than one each. A request whose prompt is read samples its first token,
//! and its cache is merged into the running batch, which it decodes with from the next step (codes copied as stored, for every KV codec); a request that
//! finishes, or is cancelled, is filtered out at the step that ends it. Rows keep their own
//! ends, so nothing is recomputed when rows come and go. Admission control: at
//! most `max_batch` running rows, the KV bytes every admitted request may grow to within
//! `kv_budget` (from the caches' own accounting, so a 4-bit scheme admits more rows), and at
//! most `max_queue` waiting requests.

use crate::ahead::Ahead;
use crate::generate::StopReason;
use crate::prefix::PrefixCache;
use crate::sampler::{Dist, Sampler, SamplerConfig};
use crate::speculative::{verify_token, DraftLength, NgramDrafter, SpecStats};
use crate::stop::{Released, StopText};
use crate::EngineError;
use candle_core::Tensor;
use std::collections::VecDeque;
use std::path::Path;
use std::time::{Duration, Instant};
use tessera_kv::{AttentionCache, KvCache, KvScheme, Retention};
use tessera_models::{LogitsMode, Model, Tokenizer};

/// One generation, validated by [`Batch::add`].
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Tokens that end the generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// Texts that end the generation where they appear (not part of the output; needs a
    /// batch with a tokenizer, [`Batch::with_tokenizer`]).
    pub stop_strings: Vec<String>,
    /// `Some(n)`: every token's event carries its log-probability under the model and the
    /// `n` (at most [`MAX_TOP_LOGPROBS`]) most likely tokens at that step.
    pub logprobs: Option<usize>,
}

/// The most alternatives a token's [`TokenLogprobs`] lists (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A sampled token's log-probability under the model (before sampling filters and
/// penalties) and the most likely tokens at its step, best first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// `token`'s log-probability under `logits` and the `top` most likely ids, as every
    /// generating path reports them.
    pub fn new(logits: &[f32], token: u32, top: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // The sampler's vectorized e^(l − max) (a libm exp per id was ~1.5 ms a row at
        // Gemma's 262k), summed in f64.
        let log_total = max
            + crate::sampler::weights_of(logits, 1.0)
                .iter()
                .map(|&w| w as f64)
                .sum::<f64>()
                .ln() as f32;
        let logprob = |id: u32| {
            logits
                .get(id as usize)
                .map_or(f32::NEG_INFINITY, |l| l - log_total)
        };
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let top = top.min(ids.len());
        if top > 0 && top < ids.len() {
            ids.select_nth_unstable_by(top - 1, |&a, &b| {
                logits[b as usize].total_cmp(&logits[a as usize])
            });
        }
        ids.truncate(top);
        ids.sort_unstable_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        TokenLogprobs {
            logprob: logprob(token),
            top: ids.into_iter().map(|id| (id, logprob(id))).collect(),
        }
    }
}

pub type RequestId = u64;

/// What a step produced for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token {
        id: RequestId,
        token: u32,
        /// Where the request asked for them.
        logprobs: Option<TokenLogprobs>,
        /// The text this token makes printable, stop strings held back (a batch with a
        /// tokenizer; empty otherwise).
        text: String,
    },
    Finished {
        id: RequestId,
        reason: StopReason,
        /// The stop token that ended the request, when [`StopReason::EndToken`] did.
        stop_token: Option<u32>,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens a stored prefix gave (not read again).
        cached_tokens: usize,
        /// The text still held back at the end (an incomplete character, a partial stop
        /// string that did not complete), released.
        text: String,
    },
    /// The request could not go on (its tokens could not be detokenized); its row has left
    /// the batch.
    Failed { id: RequestId, message: String },
}

/// Admission limits of a [`Batch`].
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    /// Most rows decoded together.
    pub max_batch: usize,
    /// Most KV bytes the admitted requests may grow to (prompt + `max_tokens` each, sliding
    /// layers capped at their window); `None`: no budget.
    pub kv_budget: Option<usize>,
    /// Most requests waiting for admission; `add` refuses past it.
    pub max_queue: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            max_batch: 16,
            kv_budget: None,
            max_queue: 256,
        }
    }
}

/// Speculation inside a batch: every running row drafts by prompt lookup (the continuation
/// of the latest earlier occurrence of its last `ngram` tokens, at most `max_draft`), and one
/// forward verifies every row's draft as one chunk per row inside a speculative round;
/// each row keeps what its own sampler accepts (the rejection rule of
/// [`crate::speculative`]) and the round rolls every row back to its own count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSpec {
    pub ngram: usize,
    pub max_draft: usize,
}

/// The most tokens a round may draft.
pub const MAX_DRAFT: usize = 64;

/// A request decoding in the running batch: row `i` of the running cache.
struct Row {
    id: RequestId,
    sampler: Sampler,
    /// Prompt and generated tokens (the sampler's history).
    history: Vec<u32>,
    prompt_tokens: usize,
    cached_tokens: usize,
    produced: usize,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    /// The detokenized output and its stop strings, where the batch has a tokenizer.
    text: Option<StopText>,
    /// Why the request cannot go on (reported by [`Row::finished`]).
    failure: Option<String>,
    /// The stop token that ended the request.
    stop_token: Option<u32>,
    logprobs: Option<usize>,
    /// The token fed at the next step.
    next: u32,
    kv_bytes: usize,
    /// With speculation: tokens the next round drafts at most.
    draft_len: DraftLength,
}

/// A request [`Batch::add_resumed`] refused, and the cache it was given back.
#[derive(Debug)]
pub struct Refused {
    pub error: EngineError,
    pub cache: KvCache,
}

/// A queued request, with the cache of its prompt's first tokens when the caller gave one
/// ([`Batch::add_resumed`]).
struct Waiting {
    id: RequestId,
    request: GenerationRequest,
    resumed: Option<(KvCache, usize)>,
}

/// Where a [`Batch`]'s time went: its forward passes as the host saw them (each including
/// the wait for its logits or tokens, and sampling).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchTimes {
    /// Prompt chunks read, the prompt tokens they held, and the forwards that read them
    /// (several short prompts may share one).
    pub prefill: Duration,
    pub prefill_tokens: usize,
    pub prefill_forwards: usize,
    /// Of `prefill`: the host's time until each chunk's forward pass returned (as
    /// `decode_submit` is for steps). A chunk's submit time close to its whole time says
    /// the host bounds prefill, a synchronization inside the forward among the causes.
    pub prefill_submit: Duration,
    /// Decode steps (plain or speculative), and the row-steps they covered.
    pub decode: Duration,
    pub decode_steps: usize,
    pub decode_rows: usize,
    /// Of `decode`: the host's time until the forward pass returned, before waiting for
    /// its results. On a GPU, a step whose submit time is close to its whole time is bound
    /// by the host.
    pub decode_submit: Duration,
    /// Of `decode_steps`: steps run ahead of their tokens ([`Batch::with_steps_ahead`]).
    pub steps_ahead: usize,
    /// Rows moved: the merges of prompts' rows into the running batch and the filters of
    /// finished rows out of it (with the extracts a prefix store keeps), and how many.
    pub rows: Duration,
    pub row_moves: usize,
}

impl BatchTimes {
    /// Adds `other`'s times and counts (a replaced batch's, kept by a server).
    pub fn add(&mut self, other: &BatchTimes) {
        self.prefill += other.prefill;
        self.prefill_tokens += other.prefill_tokens;
        self.prefill_forwards += other.prefill_forwards;
        self.prefill_submit += other.prefill_submit;
        self.decode += other.decode;
        self.decode_steps += other.decode_steps;
        self.decode_rows += other.decode_rows;
        self.decode_submit += other.decode_submit;
        self.steps_ahead += other.steps_ahead;
        self.rows += other.rows;
        self.row_moves += other.row_moves;
    }
}

/// A request whose prompt is being read into a cache of its own.
struct Prefill {
    id: RequestId,
    request: GenerationRequest,
    cache: KvCache,
    fed: usize,
    cached: usize,
    kv_bytes: usize,
    /// Where a chunk ends and the row is kept in the prefix store too (see
    /// [`PREFIX_CHECKPOINT`]).
    checkpoint: Option<usize>,
}

/// With a prefix store, on a model with sliding-window layers, a prompt is also kept as it
/// stood this many tokens before its end. A wrapped ring cannot be cut back, so the
/// finished row (prompt and reply) gives back only itself; the checkpoint serves the next
/// prompt that shares all but the last few dozen tokens (the same document or system
/// prompt with another question, a regenerated last turn).
pub const PREFIX_CHECKPOINT: usize = 64;

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
    rows: Vec<Row>,
    prefill: Option<Prefill>,
    waiting: VecDeque<Waiting>,
    /// Running rows cancelled since the last step.
    cancelled: Vec<RequestId>,
    next_id: RequestId,
    prefixes: Option<PrefixCache<'m>>,
    spec: Option<BatchSpec>,
    spec_stats: SpecStats,
    /// Rows of finished or cancelled requests kept for [`Batch::take_row`]
    /// ([`Batch::keeping_rows`]), with the tokens each holds.
    kept: Option<Vec<(RequestId, Vec<u32>, KvCache)>>,
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
    /// gives back the cache it was queued with ([`Batch::add_resumed`]). `None`, with
    /// nothing changed, in a batch that does not keep rows ([`Batch::keeping_rows`]), and
    /// when the request holds no cache.
    pub fn take_row(&mut self, id: RequestId) -> Result<Option<(Vec<u32>, KvCache)>, EngineError> {
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
                return Ok(Some((tokens, p.cache)));
            }
        }
        if let Some(at) = self.waiting.iter().position(|w| w.id == id) {
            return Ok(self.waiting.remove(at).and_then(|w| {
                let (cache, held) = w.resumed?;
                let mut tokens = w.request.prompt;
                tokens.truncate(held);
                Some((tokens, cache))
            }));
        }
        let kept = self.kept.as_mut();
        Ok(kept.and_then(|k| {
            let at = k.iter().position(|(r, _, _)| *r == id)?;
            let (_, tokens, cache) = k.swap_remove(at);
            Some((tokens, cache))
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
    /// row's cache is made with round slack for the drafts.
    pub fn with_speculation(mut self, spec: BatchSpec) -> Result<Self, EngineError> {
        if spec.ngram == 0 || !(1..=MAX_DRAFT).contains(&spec.max_draft) {
            return Err(EngineError::Invalid(format!(
                "speculation needs an n-gram of at least 1 token and 1 to {MAX_DRAFT} draft \
                 tokens, not {} and {}",
                spec.ngram, spec.max_draft
            )));
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

    /// Queues `request`. Refused, with nothing queued, when its prompt is empty, when
    /// prompt + `max_tokens` exceed the model's context or could never fit the KV budget,
    /// and when the queue is full.
    pub fn add(&mut self, request: GenerationRequest) -> Result<RequestId, EngineError> {
        self.check(&request)?;
        Ok(self.enqueue(request, None))
    }

    /// [`Batch::add`] for a request whose first `held` prompt tokens `cache` (one row)
    /// already holds, e.g. the previous turn of a conversation or a prompt cache: only the
    /// rest of the prompt is read. Refused as `add` refuses, and when the cache does not
    /// hold exactly `held` positions or leaves no prompt token to read; the cache comes back
    /// with the error.
    pub fn add_resumed(
        &mut self,
        request: GenerationRequest,
        cache: KvCache,
        held: usize,
    ) -> Result<RequestId, Box<Refused>> {
        if let Err(error) = self.check(&request) {
            return Err(Box::new(Refused { error, cache }));
        }
        if cache.offsets() != [held] || held >= request.prompt.len() {
            let error = EngineError::Invalid(format!(
                "a resumed request's cache must be one row holding {held} of its {} prompt \
                 tokens (at least one left to read), not rows of {:?}",
                request.prompt.len(),
                cache.offsets()
            ));
            return Err(Box::new(Refused { error, cache }));
        }
        Ok(self.enqueue(request, Some((cache, held))))
    }

    fn enqueue(
        &mut self,
        request: GenerationRequest,
        resumed: Option<(KvCache, usize)>,
    ) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Waiting {
            id,
            request,
            resumed,
        });
        id
    }

    /// What `add` refuses.
    fn check(&self, request: &GenerationRequest) -> Result<(), EngineError> {
        if request.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        request.sampler.validate()?;
        if self.tokenizer.is_none() && request.stop_strings.iter().any(|s| !s.is_empty()) {
            return Err(EngineError::Invalid(
                "stop strings need a batch that detokenizes (Batch::with_tokenizer)".into(),
            ));
        }
        if let Some(n) = request.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(EngineError::Invalid(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, not {n}"
            )));
        }
        let total = request.prompt.len().saturating_add(request.max_tokens);
        if total > self.model.context_length() {
            return Err(EngineError::PromptTooLong {
                prompt: total,
                context: self.model.context_length(),
            });
        }
        let vocab = self.model.vocab_size();
        if let Some(&id) = request.prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::Invalid(format!(
                "token id {id} is outside the model's vocabulary of {vocab}"
            )));
        }
        let bytes = self.kv_bytes_for(total);
        if let Some(budget) = self.limits.kv_budget {
            if bytes > budget {
                return Err(EngineError::Invalid(format!(
                    "a request of {total} positions needs {bytes} KV bytes, more than the whole \
                     budget of {budget}"
                )));
            }
        }
        if self.waiting.len() >= self.limits.max_queue {
            return Err(EngineError::QueueFull {
                limit: self.limits.max_queue,
            });
        }
        Ok(())
    }

    /// Cancels request `id` wherever it is; its row and KV are freed at the next step.
    /// Returns whether the request was still live.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(at) = self.waiting.iter().position(|w| w.id == id) {
            self.waiting.remove(at);
            return true;
        }
        if self.prefill.as_ref().is_some_and(|p| p.id == id) {
            self.prefill = None;
            return true;
        }
        if self.rows.iter().any(|r| r.id == id) && !self.cancelled.contains(&id) {
            self.cancelled.push(id);
            return true;
        }
        false
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

    /// How many waiting prompts, from the front of the queue, can be read together in one
    /// forward, and the widest of them: each a whole prompt within one chunk, with no
    /// reusable prefix and no checkpoint to keep, admitted by the row and KV limits, the
    /// group padded to its widest prompt no more than one chunk of tokens. At least two,
    /// else `None`: one prompt is read as before.
    fn group_size(&mut self) -> Option<(usize, usize)> {
        if self.prefill.is_some() {
            return None;
        }
        let room = self.limits.max_batch.saturating_sub(self.rows.len());
        let rings = self.layer_costs.iter().any(|(_, window)| window.is_some());
        let slack = self.round_slack();
        let reserved = self.kv_bytes_reserved();
        let (mut take, mut width) = (0, 0);
        while let Some(w) = self.waiting.get(take) {
            let len = w.request.prompt.len();
            let wider = width.max(len);
            if take == room
                || w.resumed.is_some()
                || len == 0
                || (take + 1) * wider > self.prefill_chunk
            {
                break;
            }
            if let Some(store) = self.prefixes.as_mut() {
                if rings && len > 2 * PREFIX_CHECKPOINT {
                    break;
                }
                // A stored prefix found is kept with the request (`admit` reads only the
                // rest), so the store counts it once.
                if let Some(hit) = store.lookup(&w.request.prompt, slack) {
                    if let Some(w) = self.waiting.get_mut(take) {
                        w.resumed = Some(hit);
                    }
                    break;
                }
            }
            // Rows hold their padding too: each reserves the group's width.
            let group_bytes: usize = self
                .waiting
                .iter()
                .take(take + 1)
                .map(|w| self.kv_bytes_for(wider + w.request.max_tokens))
                .sum();
            if self
                .limits
                .kv_budget
                .is_some_and(|b| reserved + group_bytes > b)
            {
                break;
            }
            (take, width) = (take + 1, wider);
        }
        (take >= 2).then_some((take, width))
    }

    /// Reads several waiting prompts in one forward (see [`Batch::group_size`]): each row
    /// left-padded to the widest, so every row's last position is its prompt's last token.
    /// Each samples its first token and joins the running batch. Returns whether it read
    /// any; on an error the prompts go back to the front of the queue.
    fn prefill_group(&mut self, events: &mut Vec<Event>) -> Result<bool, EngineError> {
        let Some((take, width)) = self.group_size() else {
            return Ok(false);
        };
        let pads: Vec<usize> = self
            .waiting
            .iter()
            .take(take)
            .map(|w| width - w.request.prompt.len())
            .collect();
        let mut cache = KvCache::new(&self.model.layer_specs(), &self.scheme, pads.clone())?
            .with_isa(self.model.isa())
            .with_round_slack(self.round_slack());
        if cache.max_append_tokens().is_some_and(|m| m < width) {
            // The prompts would cross a bf16-first transition: read one at a time.
            return Ok(false);
        }
        let group: Vec<Waiting> = self.waiting.drain(..take).collect();
        let mut ids = Vec::with_capacity(take * width);
        for (w, &pad) in group.iter().zip(&pads) {
            // Padding: read, masked from every real position, never sampled from.
            ids.extend(std::iter::repeat_n(w.request.prompt[0], pad));
            ids.extend_from_slice(&w.request.prompt);
        }
        let started = Instant::now();
        let logits = Tensor::from_vec(ids, (take, width), self.model.device())
            .map_err(EngineError::from)
            .and_then(|ids| Ok(self.model.forward(&ids, &mut cache, LogitsMode::Last)?))
            .and_then(|l| {
                self.times.prefill_submit += started.elapsed();
                Ok(l.flatten_all()?.to_vec1::<f32>()?)
            });
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                for w in group.into_iter().rev() {
                    self.waiting.push_front(w);
                }
                return Err(e);
            }
        };
        let vocab = logits.len() / take;
        self.times.prefill_tokens += width * take - pads.iter().sum::<usize>();
        self.times.prefill_forwards += 1;
        let mut joining = Vec::new();
        let mut left = Vec::new();
        for (i, w) in group.into_iter().enumerate() {
            let kv_bytes = self.kv_bytes_for(width + w.request.max_tokens);
            let mut row = self.new_row(w.id, w.request, 0, kv_bytes);
            match row.take(&logits[i * vocab..(i + 1) * vocab], self.tokenizer, events) {
                Some(reason) => {
                    events.push(row.finished(reason));
                    left.push((i, row));
                }
                None => joining.push((i, row)),
            }
        }
        for (i, row) in &left {
            let tokens = row.history[..row.prompt_tokens].to_vec();
            self.leave(row.id, tokens, cache.extract(*i)?)?;
        }
        if !joining.is_empty() {
            if !left.is_empty() {
                cache.filter(&joining.iter().map(|(i, _)| *i).collect::<Vec<_>>())?;
            }
            self.times.prefill += started.elapsed();
            self.join(cache)?;
            self.rows.extend(joining.into_iter().map(|(_, row)| row));
            return Ok(true);
        }
        self.times.prefill += started.elapsed();
        Ok(true)
    }

    /// A request's row once its prompt is read (`cached` of its tokens reused).
    fn new_row(
        &self,
        id: RequestId,
        request: GenerationRequest,
        cached: usize,
        kv_bytes: usize,
    ) -> Row {
        let GenerationRequest {
            prompt,
            max_tokens,
            sampler,
            stop_tokens,
            stop_strings,
            logprobs,
        } = request;
        Row {
            id,
            sampler: Sampler::new(sampler),
            prompt_tokens: prompt.len(),
            cached_tokens: cached,
            history: prompt,
            produced: 0,
            max_tokens,
            stop_tokens,
            text: self.tokenizer.map(|_| StopText::new(stop_strings)),
            failure: None,
            stop_token: None,
            logprobs,
            next: 0,
            kv_bytes,
            draft_len: DraftLength::new(self.round_slack()),
        }
    }

    /// Starts reading the next waiting prompt when a row and the budget allow.
    fn admit(&mut self) -> Result<(), EngineError> {
        if self.prefill.is_some() || self.rows.len() >= self.limits.max_batch {
            return Ok(());
        }
        let Some(Waiting { request, .. }) = self.waiting.front() else {
            return Ok(());
        };
        let bytes = self.kv_bytes_for(request.prompt.len() + request.max_tokens);
        if let Some(budget) = self.limits.kv_budget {
            if self.kv_bytes_reserved() + bytes > budget {
                return Ok(());
            }
        }
        let Some(Waiting {
            id,
            request,
            resumed,
        }) = self.waiting.pop_front()
        else {
            return Ok(());
        };
        let slack = self.round_slack();
        let reused = resumed.or_else(|| {
            self.prefixes
                .as_mut()
                .and_then(|store| store.lookup(&request.prompt, slack))
        });
        let (cache, fed) = match reused {
            Some((cache, len)) => (cache, len),
            None => (
                KvCache::new(&self.model.layer_specs(), &self.scheme, vec![0])?
                    .with_isa(self.model.isa())
                    .with_round_slack(slack),
                0,
            ),
        };
        let rings = self.layer_costs.iter().any(|(_, window)| window.is_some());
        let checkpoint = request
            .prompt
            .len()
            .checked_sub(PREFIX_CHECKPOINT)
            .filter(|&c| self.prefixes.is_some() && rings && c > fed.max(PREFIX_CHECKPOINT));
        self.prefill = Some(Prefill {
            id,
            request,
            cache,
            fed,
            cached: fed,
            kv_bytes: bytes,
            checkpoint,
        });
        Ok(())
    }

    /// Reads one chunk of the prompt being prefilled (ending where the KV transition
    /// converts, as a single session's prefill does); when the prompt is read, samples its
    /// first token and moves its row into the running batch.
    fn prefill_chunk(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let Some(p) = self.prefill.as_mut() else {
            return Ok(());
        };
        let rest = p.request.prompt.len() - p.fed;
        let mut len = crate::session::chunk_len(&p.cache, self.prefill_chunk, rest);
        // A checkpoint inside a transition's first append is not made: that row's codec
        // would be fitted on fewer positions than any fresh row's.
        if p.cache.first_append().is_some() && p.checkpoint.is_some_and(|c| c < len) {
            p.checkpoint = None;
        }
        if let Some(c) = p.checkpoint.filter(|&c| p.fed < c) {
            len = len.min(c - p.fed);
        }
        let started = Instant::now();
        let chunk = &p.request.prompt[p.fed..p.fed + len];
        let ids = Tensor::from_slice(chunk, (1, len), self.model.device())?;
        let logits = self.model.forward(&ids, &mut p.cache, LogitsMode::Last)?;
        self.times.prefill_submit += started.elapsed();
        p.fed += len;
        self.times.prefill_tokens += len;
        self.times.prefill_forwards += 1;
        if p.checkpoint == Some(p.fed) {
            if let Some(store) = self.prefixes.as_mut() {
                store.insert(p.request.prompt[..p.fed].to_vec(), p.cache.extract(0)?);
            }
        }
        if p.fed < p.request.prompt.len() {
            // Not waited for: on a GPU the next chunk is submitted while this one runs (the
            // last chunk's read-back waits for all of them).
            self.times.prefill += started.elapsed();
            return Ok(());
        }
        let Some(p) = self.prefill.take() else {
            return Ok(());
        };
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let mut row = self.new_row(p.id, p.request, p.cached, p.kv_bytes);
        let first = row.take(&logits, self.tokenizer, events);
        self.times.prefill += started.elapsed();
        if let Some(reason) = first {
            events.push(row.finished(reason));
            self.leave(row.id, row.history[..row.prompt_tokens].to_vec(), p.cache)?;
            return Ok(());
        }
        self.join(p.cache)?;
        self.rows.push(row);
        Ok(())
    }

    /// Appends `cache`'s rows to the running batch.
    fn join(&mut self, cache: KvCache) -> Result<(), EngineError> {
        let started = Instant::now();
        // A refused join leaves the running rows as they were.
        let joined = match self.running.as_mut() {
            None => {
                self.running = Some(cache);
                Ok(())
            }
            Some(running) => running.extend(cache),
        };
        self.times.rows += started.elapsed();
        self.times.row_moves += 1;
        Ok(joined?)
    }

    /// One token for every running row (with speculation, each row's accepted drafts and
    /// one token more); rows that finish leave the batch.
    fn decode(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let Some(cache) = self.running.as_mut() else {
            return Ok(());
        };
        // A row whose context is full ends before the forward.
        let context = self.model.context_length();
        let offsets = cache.offsets();
        let mut done: Vec<usize> = Vec::new();
        for (i, row) in self.rows.iter_mut().enumerate() {
            if offsets[i] + 1 > context {
                events.push(row.finished(StopReason::ContextLimit));
                done.push(i);
            }
        }
        if done.is_empty() {
            if self.keeps_ahead() {
                self.step_ahead(events, &mut done)?;
                return self.remove_rows(&done);
            }
            let drafts = self.drafts(&offsets);
            if drafts.iter().all(Vec::is_empty) {
                self.step_rows(events, &mut done)?;
            } else {
                self.verify_drafts(&drafts, events, &mut done)?;
            }
        }
        self.remove_rows(&done)
    }

    /// One plain decode step: every row's next token read, one token sampled per row.
    fn step_rows(
        &mut self,
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Result<(), EngineError> {
        let Some(cache) = self.running.as_mut() else {
            return Ok(());
        };
        let started = Instant::now();
        let ids: Vec<u32> = self.rows.iter().map(|r| r.next).collect();
        let ids = Tensor::from_vec(ids, (self.rows.len(), 1), self.model.device())?;
        let logits = self
            .model
            .forward(&ids, cache, LogitsMode::Last)?
            .squeeze(1)?;
        let tokenizer = self.tokenizer;
        if self.rows.iter().all(Row::plain_greedy) {
            // Only the chosen ids come back from the device, not the rows' logits (a
            // megabyte per row at Gemma's vocabulary). Ties go to the lowest id, as the
            // sampler's greedy choice.
            self.times.decode_submit += started.elapsed();
            let tokens = crate::sampler::argmax_rows(&logits)?;
            for (i, (row, &t)) in self.rows.iter_mut().zip(&tokens).enumerate() {
                if let Some(reason) = row.take_chosen(t, tokenizer, events) {
                    events.push(row.finished(reason));
                    done.push(i);
                }
            }
        } else {
            self.times.decode_submit += started.elapsed();
            let logits: Vec<Vec<f32>> = logits.to_vec2()?;
            for (i, (row, l)) in self.rows.iter_mut().zip(&logits).enumerate() {
                if let Some(reason) = row.take(l, tokenizer, events) {
                    events.push(row.finished(reason));
                    done.push(i);
                }
            }
        }
        self.times.decode += started.elapsed();
        self.times.decode_steps += 1;
        self.times.decode_rows += self.rows.len();
        if self.spec.is_some() {
            // Per row, as in a round: a row decoded without a draft.
            self.spec_stats.plain_steps += self.rows.len();
        }
        Ok(())
    }

    /// Whether this step runs ahead of its tokens ([`Batch::with_steps_ahead`]).
    fn keeps_ahead(&self) -> bool {
        let Some(cache) = self.running.as_ref() else {
            return false;
        };
        if !self.steps_ahead
            || self.rows.is_empty()
            || self.spec.is_some()
            || self.prefixes.is_some()
            || !self.cancelled.is_empty()
            || !self.waiting.is_empty()
            || self.prefill.is_some()
        {
            return false;
        }
        // The step decides each row's token after those of the step still ahead: it must
        // be one the row may produce, in its context.
        let pending = usize::from(self.ahead.is_some());
        let context = self.model.context_length();
        self.rows.iter().zip(cache.offsets()).all(|(r, end)| {
            r.plain_greedy() && r.produced + pending < r.max_tokens && end < context
        })
    }

    /// One greedy step run ahead: its forward queued on the previous step's ids (as the
    /// device holds them where it chose them), its own ids chosen, and then the previous
    /// step's tokens taken by the rows.
    fn step_ahead(
        &mut self,
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Result<(), EngineError> {
        let Some(cache) = self.running.as_mut() else {
            return Ok(());
        };
        let started = Instant::now();
        let previous = self.ahead.take();
        let logits = match previous.as_ref().and_then(|a| a.chosen.as_ref()) {
            Some(chosen) => self.model.forward_chosen(chosen, cache, LogitsMode::Last)?,
            None => {
                let ids = match previous.as_ref().and_then(Ahead::here) {
                    Some(ids) => ids,
                    None => self.rows.iter().map(|r| r.next).collect(),
                };
                let ids = Tensor::from_vec(ids, (self.rows.len(), 1), self.model.device())?;
                self.model.forward(&ids, cache, LogitsMode::Last)?
            }
        }
        .squeeze(1)?;
        let rows = self.rows.iter().map(|r| r.id).collect();
        let chosen = self.model.choose_greedy(&logits)?;
        let next = Ahead::new(rows, chosen, || Ok(crate::sampler::argmax_rows(&logits)?))?;
        self.times.decode_submit += started.elapsed();
        if let Some(previous) = previous {
            self.take_ahead(previous, events, done)?;
        }
        self.ahead = Some(next);
        self.times.decode += started.elapsed();
        self.times.decode_steps += 1;
        self.times.steps_ahead += 1;
        self.times.decode_rows += self.rows.len();
        Ok(())
    }

    /// The rows take the tokens of the step run ahead; those that end are put in `done`.
    fn take_ahead(
        &mut self,
        ahead: Ahead,
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Result<(), EngineError> {
        if ahead.rows.len() != self.rows.len()
            || ahead.rows.iter().zip(&self.rows).any(|(&id, r)| id != r.id)
        {
            return Err(EngineError::Invalid(
                "a step run ahead holds other rows than the batch".into(),
            ));
        }
        let tokens = ahead.wait()?;
        let tokenizer = self.tokenizer;
        for (i, (row, &t)) in self.rows.iter_mut().zip(&tokens).enumerate() {
            if let Some(reason) = row.take_chosen(t, tokenizer, events) {
                events.push(row.finished(reason));
                done.push(i);
            }
        }
        Ok(())
    }

    /// Takes the tokens of the step run ahead, if any; rows that end with them leave.
    fn settle_ahead(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let Some(ahead) = self.ahead.take() else {
            return Ok(());
        };
        let started = Instant::now();
        let mut done = Vec::new();
        self.take_ahead(ahead, events, &mut done)?;
        self.times.decode += started.elapsed();
        self.remove_rows(&done)
    }

    /// Each running row's draft (empty without speculation or without a match): never more
    /// tokens than the row may still produce, and every row's chunk inside the context.
    fn drafts(&mut self, offsets: &[usize]) -> Vec<Vec<u32>> {
        let Some(spec) = self.spec else {
            return vec![Vec::new(); self.rows.len()];
        };
        let context = self.model.context_length();
        // The chunk is as wide for every row: it must fit the fullest row's context.
        let room = offsets
            .iter()
            .map(|&o| context.saturating_sub(o + 1))
            .min()
            .unwrap_or(0);
        let drafter = NgramDrafter { n: spec.ngram };
        self.rows
            .iter_mut()
            .map(|row| {
                let k = row
                    .draft_len
                    .next()
                    .min(row.max_tokens.saturating_sub(row.produced + 1))
                    .min(room);
                if k == 0 {
                    Vec::new()
                } else {
                    drafter.lookup(&row.history, k)
                }
            })
            .collect()
    }

    /// One speculative round over the running batch: every row reads its next token and
    /// its draft (padded to the widest draft) as one chunk inside a round; each row keeps
    /// the drafts its sampler accepts and one token more, and the round rolls every row
    /// back to what it kept.
    fn verify_drafts(
        &mut self,
        drafts: &[Vec<u32>],
        events: &mut Vec<Event>,
        done: &mut Vec<usize>,
    ) -> Result<(), EngineError> {
        let Some(cache) = self.running.as_mut() else {
            return Ok(());
        };
        let rows = self.rows.len();
        let width = 1 + drafts.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows * width);
        for (row, draft) in self.rows.iter().zip(drafts) {
            ids.push(row.next);
            ids.extend_from_slice(draft);
            // Padding: read, never kept.
            ids.resize(ids.len() + width - 1 - draft.len(), row.next);
        }
        let started = Instant::now();
        let ids = Tensor::from_vec(ids, (rows, width), self.model.device())?;
        cache.check_append(width)?;
        cache.round_begin()?;
        let logits = match self.model.forward(&ids, cache, LogitsMode::All) {
            Ok(l) => l,
            Err(e) => {
                let _ = cache.round_rollback(&vec![0; rows]);
                return Err(e.into());
            }
        };
        self.times.decode_submit += started.elapsed();
        let logits: Vec<f32> = logits.flatten_all()?.to_vec1()?;
        let vocab = logits.len() / (rows * width);
        let mut keep = vec![1; rows];
        let tokenizer = self.tokenizer;
        for (i, (row, draft)) in self.rows.iter_mut().zip(drafts).enumerate() {
            let at: Vec<&[f32]> = (0..width)
                .map(|j| &logits[(i * width + j) * vocab..(i * width + j + 1) * vocab])
                .collect();
            let decided = row.verify(draft, &at);
            let accepted = decided.len() - 1;
            keep[i] = 1 + accepted;
            if draft.is_empty() {
                self.spec_stats.plain_steps += 1;
            } else {
                self.spec_stats.count_round(draft.len(), accepted);
                row.draft_len.update(draft.len(), accepted);
            }
            for (j, &t) in decided.iter().enumerate() {
                row.sampler.record(t);
                if let Some(reason) = row.emit(t, at[j], tokenizer, events) {
                    events.push(row.finished(reason));
                    done.push(i);
                    // A stop token among the accepted drafts: the row keeps only positions
                    // of tokens it emitted (its cache must hold its history's prefix, which
                    // the prefix store keeps it by).
                    keep[i] = keep[i].min(1 + j);
                    break;
                }
            }
        }
        cache.round_rollback(&keep)?;
        self.times.decode += started.elapsed();
        self.times.decode_steps += 1;
        self.times.decode_rows += rows;
        Ok(())
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
        let mut rows: Vec<Option<Row>> = std::mem::take(&mut self.rows)
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
        match (self.prefixes.as_mut(), self.kept.as_mut()) {
            (Some(store), Some(kept)) => {
                store.insert(tokens.clone(), cache.extract(0)?);
                kept.push((id, tokens, cache));
            }
            (Some(store), None) => store.insert(tokens, cache),
            (None, Some(kept)) => kept.push((id, tokens, cache)),
            (None, None) => {}
        }
        Ok(())
    }
}

impl Row {
    /// Greedy with nothing to penalize and no log-probabilities: the token is the logits'
    /// argmax, which the device can pick.
    fn plain_greedy(&self) -> bool {
        let c = self.sampler.config();
        c.temperature <= 0.0
            && c.repetition_penalty == 1.0
            && c.presence_penalty == 0.0
            && c.frequency_penalty == 0.0
            && self.logprobs.is_none()
    }

    /// [`Row::take`] for a token already chosen (by [`Row::plain_greedy`]'s argmax).
    fn take_chosen(
        &mut self,
        token: u32,
        tokenizer: Option<&Tokenizer>,
        events: &mut Vec<Event>,
    ) -> Option<StopReason> {
        if self.produced >= self.max_tokens {
            return Some(StopReason::MaxTokens);
        }
        self.sampler.record(token);
        self.emit(token, &[], tokenizer, events)
    }

    /// Samples the next token from `logits`: emits it and returns `None`, or returns why
    /// the request ends (a stop token is not emitted).
    fn take(
        &mut self,
        logits: &[f32],
        tokenizer: Option<&Tokenizer>,
        events: &mut Vec<Event>,
    ) -> Option<StopReason> {
        if self.produced >= self.max_tokens {
            return Some(StopReason::MaxTokens);
        }
        let token = self.sampler.sample(logits, &self.history);
        self.emit(token, logits, tokenizer, events)
    }

    /// Emits `token`, decided from `logits`, and returns `None`, or returns why the request
    /// ends (a stop token is not emitted; the token that completes a stop string is, its
    /// text cut where the stop string begins).
    fn emit(
        &mut self,
        token: u32,
        logits: &[f32],
        tokenizer: Option<&Tokenizer>,
        events: &mut Vec<Event>,
    ) -> Option<StopReason> {
        if self.produced >= self.max_tokens {
            return Some(StopReason::MaxTokens);
        }
        if self.stop_tokens.contains(&token) {
            self.stop_token = Some(token);
            return Some(StopReason::EndToken);
        }
        let released = match (self.text.as_mut(), tokenizer) {
            (Some(text), Some(tokenizer)) => match text.push(tokenizer, token) {
                Ok(r) => r,
                Err(e) => {
                    self.failure = Some(format!("detokenizing token {token} failed: {e}"));
                    return Some(StopReason::EndToken);
                }
            },
            _ => Released::default(),
        };
        let logprobs = self
            .logprobs
            .map(|top| TokenLogprobs::new(logits, token, top));
        events.push(Event::Token {
            id: self.id,
            token,
            logprobs,
            text: released.text,
        });
        self.produced += 1;
        self.history.push(token);
        self.next = token;
        if released.stopped {
            return Some(StopReason::StopString);
        }
        (self.produced >= self.max_tokens).then_some(StopReason::MaxTokens)
    }

    /// The tokens a round decides for this row: the accepted prefix of `draft` and one
    /// token more, by the rejection rule over the logits `at(j)` of chunk position `j`
    /// (a prompt-lookup draft is a point mass). Neither emitted nor recorded here.
    fn verify(&mut self, draft: &[u32], at: &[&[f32]]) -> Vec<u32> {
        let base = self.history.len();
        let mut next = None;
        for (j, &t) in draft.iter().enumerate() {
            let p = self.sampler.distribution(at[j], &self.history, &draft[..j]);
            match verify_token(&p, &Dist::point(t), t, &mut self.sampler) {
                Ok(()) => self.history.push(t),
                Err(r) => {
                    next = Some(r);
                    break;
                }
            }
        }
        let accepted = self.history.len() - base;
        let next = next.unwrap_or_else(|| {
            let p = self
                .sampler
                .distribution(at[accepted], &self.history, draft);
            self.sampler.draw(&p)
        });
        let mut decided: Vec<u32> = self.history.drain(base..).collect();
        decided.push(next);
        decided
    }

    /// The request's last event: its text still held back released (where that completes a
    /// stop string, the reason becomes [`StopReason::StopString`]), or its failure.
    fn finished(&mut self, reason: StopReason) -> Event {
        if let Some(message) = self.failure.take() {
            return Event::Failed {
                id: self.id,
                message,
            };
        }
        let (reason, text) = match self.text.as_mut() {
            Some(text) if reason != StopReason::StopString => {
                let rest = text.finish();
                let reason = if rest.stopped {
                    StopReason::StopString
                } else {
                    reason
                };
                (reason, rest.text)
            }
            _ => (reason, String::new()),
        };
        Event::Finished {
            id: self.id,
            reason,
            stop_token: self.stop_token.filter(|_| reason == StopReason::EndToken),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.produced,
            cached_tokens: self.cached_tokens,
            text,
        }
    }
}

/// Greedy continuations of every prompt, `max_tokens` each (a row stops early at one of
/// `stop_tokens`), decoded together in one [`Batch`]. Equal to running each prompt alone.
pub fn generate_batch_greedy(
    model: &Model,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    scheme: &KvScheme,
    prefill_chunk: usize,
    stop_tokens: &[u32],
) -> Result<Vec<Vec<u32>>, EngineError> {
    let limits = BatchLimits {
        max_batch: prompts.len().max(1),
        kv_budget: None,
        max_queue: prompts.len().max(1),
    };
    let mut batch = Batch::new(model, scheme, prefill_chunk, limits)?;
    let ids = prompts
        .iter()
        .map(|p| {
            batch.add(GenerationRequest {
                prompt: p.clone(),
                max_tokens,
                sampler: SamplerConfig::default(),
                stop_tokens: stop_tokens.to_vec(),
                logprobs: None,
                stop_strings: Vec::new(),
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = vec![Vec::new(); prompts.len()];
    while !batch.is_idle() {
        for event in batch.step()? {
            if let Event::Token { id, token, .. } = event {
                if let Some(i) = ids.iter().position(|&r| r == id) {
                    out[i].push(token);
                }
            }
        }
    }
    Ok(out)
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
