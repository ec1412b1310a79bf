//! What goes into a [`crate::Batch`] and what comes out of it.

use crate::sampler::SamplerConfig;
use crate::sequence::Sequence;
use crate::stop::StopReason;
use crate::EngineError;
use std::time::Duration;
use tessera_models::Model;

/// One generation, validated by [`crate::Batch::add`].
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Tokens that end the generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// Texts that end the generation where they appear (not part of the output; needs a
    /// batch with a tokenizer, [`crate::Batch::with_tokenizer`]).
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

/// Admission limits of a [`crate::Batch`].
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

/// Speculation inside a batch: every running row has its own drafter (from `source`), which
/// proposes at most `max_draft` tokens a round, and one forward verifies every row's draft
/// as one chunk per row inside a speculative round; each row keeps what its own sampler
/// accepts (the rejection rule of [`crate::speculative`]) and the round rolls every row
/// back to its own count.
#[derive(Clone, Copy)]
pub struct BatchSpec<'m> {
    pub source: DraftSource<'m>,
    pub max_draft: usize,
}

/// What drafts for a row.
#[derive(Clone, Copy)]
pub enum DraftSource<'m> {
    /// Prompt lookup: the continuation of the latest earlier occurrence of the row's last
    /// `n` tokens ([`crate::speculative::NgramDrafter`]).
    Ngram { n: usize },
    /// A smaller model of the target's vocabulary, one cache per row
    /// ([`crate::speculative::ModelDrafter`], in the batch's KV scheme).
    Model(&'m Model),
}

impl<'m> BatchSpec<'m> {
    /// Prompt lookup over the last `n` tokens, at most `max_draft` drafted a round.
    pub fn ngram(n: usize, max_draft: usize) -> Self {
        BatchSpec {
            source: DraftSource::Ngram { n },
            max_draft,
        }
    }

    /// A draft model, at most `max_draft` drafted a round.
    pub fn model(model: &'m Model, max_draft: usize) -> Self {
        BatchSpec {
            source: DraftSource::Model(model),
            max_draft,
        }
    }
}

/// The most tokens a round may draft.
pub const MAX_DRAFT: usize = 64;

/// A request [`crate::Batch::add_resumed`] refused, and the sequence it was given back.
#[derive(Debug)]
pub struct Refused {
    pub error: EngineError,
    pub held: Sequence,
}

/// Where a [`crate::Batch`]'s time went: its forward passes as the host saw them (each including
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
    /// Of `decode_steps`: steps run ahead of their tokens ([`crate::Batch::with_steps_ahead`]).
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
