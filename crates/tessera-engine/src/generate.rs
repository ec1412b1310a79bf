//! The generate iterator over a [`Session`]: the prompt read and tokens sampled by a
//! one-row [`Batch`] (the step engine the server runs), resumed from the session's cache,
//! which the session gets back, holding the whole sequence, when generation ends; plain or
//! speculative ([`BatchSpec`]), as the batch decodes.

use crate::sampler::SamplerConfig;
use crate::session::Session;
use crate::speculative::SpecStats;
use crate::step::{Batch, BatchLimits, BatchSpec, BatchTimes, Event, GenerationRequest, RequestId};
use crate::stop::StopReason;
use crate::EngineError;
use std::collections::VecDeque;
use tessera_kv::KvScheme;
use tessera_models::Model;

/// Yields generated token ids; stop tokens are not yielded. After the iterator ends,
/// [`Generation::stop_reason`] says why. While it lives the session's cache is in its
/// batch; the session has it back (holding the prompt and every token fed) when generation
/// ends or the iterator is dropped.
pub struct Generation<'s, 'm> {
    session: &'s mut Session<'m>,
    batch: Batch<'m>,
    id: RequestId,
    /// Tokens a step sampled and the iterator has not yielded yet.
    ready: VecDeque<u32>,
    /// Fewer tokens than asked fit the model's context: reaching them is the context's limit.
    capped: bool,
    stop: Option<StopReason>,
    stop_token: Option<u32>,
    /// An error ended generation.
    failed: bool,
    /// The batch's times already credited to the session.
    credited: BatchTimes,
    /// The session cache's round slack, for a cache made anew.
    round_slack: usize,
}

impl<'s, 'm> Generation<'s, 'm> {
    /// Reads `prompt` into `session` (on top of whatever it holds) and prepares to sample.
    /// Refuses an empty prompt, one that overflows the model's context and ids outside its
    /// vocabulary, the session unchanged.
    pub fn new(
        session: &'s mut Session<'m>,
        prompt: &[u32],
        sampler: SamplerConfig,
        max_tokens: usize,
        stop_tokens: Vec<u32>,
    ) -> Result<Self, EngineError> {
        Self::with_spec(session, prompt, sampler, max_tokens, stop_tokens, None)
    }

    /// [`Generation::new`], speculative where `spec` is given: the session's cache needs
    /// round slack for its drafts ([`Session::with_round_slack`]), so rounds roll back
    /// after a sliding-window ring has wrapped. Greedy output is the plain greedy output;
    /// sampled output keeps the model's distribution.
    pub fn with_spec(
        session: &'s mut Session<'m>,
        prompt: &[u32],
        sampler: SamplerConfig,
        max_tokens: usize,
        stop_tokens: Vec<u32>,
        spec: Option<BatchSpec<'m>>,
    ) -> Result<Self, EngineError> {
        let model = session.model();
        if let Some(spec) = spec.filter(|s| session.round_slack() < s.max_draft) {
            return Err(EngineError::Invalid(format!(
                "a session with round slack {} cannot roll back drafts of {} tokens",
                session.round_slack(),
                spec.max_draft
            )));
        }
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() > session.context_left() {
            return Err(EngineError::PromptTooLong {
                prompt: session.tokens().len() + prompt.len(),
                context: model.context_length(),
            });
        }
        let round_slack = session.round_slack();
        let whole: Vec<u32> = session.tokens().iter().chain(prompt).copied().collect();
        let room = model.context_length() - whole.len();
        let request = GenerationRequest {
            prompt: whole,
            max_tokens: max_tokens.min(room),
            sampler,
            stop_tokens,
            stop_strings: Vec::new(),
            logprobs: None,
        };
        let limits = BatchLimits {
            max_batch: 1,
            kv_budget: None,
            max_queue: 1,
        };
        let mut batch =
            Batch::new(model, session.scheme(), session.prefill_chunk(), limits)?.keeping_rows();
        if let Some(spec) = spec {
            batch = batch.with_speculation(spec)?;
        }
        let id = match batch.add_resumed(request, session.lend()?) {
            Ok(id) => id,
            Err(refused) => {
                session.give_back(refused.held);
                return Err(refused.error);
            }
        };
        let mut generation = Generation {
            session,
            batch,
            id,
            ready: VecDeque::new(),
            capped: room < max_tokens,
            stop: None,
            stop_token: None,
            failed: false,
            credited: BatchTimes::default(),
            round_slack,
        };
        // The prompt is read here, as a session's feed reads it: its errors come from `new`.
        while generation.batch.waiting() > 0 && generation.stop.is_none() {
            generation.advance()?;
        }
        Ok(generation)
    }

    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    /// The stop token that ended generation, when [`StopReason::EndToken`] did. Where
    /// decode steps ran ahead of their tokens ([`Generation::set_steps_ahead`]), the
    /// session's cache holds it fed; else it does not.
    pub fn stop_token(&self) -> Option<u32> {
        self.stop_token
    }

    /// Whether decode steps run one ahead of their tokens ([`Batch::with_steps_ahead`]; by
    /// default where the model runs on a GPU).
    pub fn set_steps_ahead(&mut self, on: bool) {
        self.batch.set_steps_ahead(on);
    }

    /// Steps ahead where `allowed` and the default (by device) has them, else off
    /// ([`Batch::allow_steps_ahead`]): a caller's switch that can only turn them off.
    pub fn allow_steps_ahead(&mut self, allowed: bool) {
        self.batch.allow_steps_ahead(allowed);
    }

    /// What the speculative rounds did so far (all zero without speculation).
    pub fn spec_stats(&self) -> &SpecStats {
        self.batch.spec_stats()
    }

    /// The decode steps that ran ahead of their tokens so far.
    pub fn steps_ahead(&self) -> usize {
        self.batch.times().steps_ahead
    }

    /// The session (its cache is lent to the generation until it ends).
    pub fn session(&self) -> &Session<'m> {
        self.session
    }

    /// One batch step; on an error or the request's end, the session gets its cache back.
    fn advance(&mut self) -> Result<(), EngineError> {
        let events = match self.batch.step() {
            Ok(events) => events,
            Err(e) => {
                self.failed = true;
                self.give_back();
                return Err(e);
            }
        };
        for event in events {
            match event {
                Event::Token { token, .. } => self.ready.push_back(token),
                Event::Finished {
                    reason, stop_token, ..
                } => {
                    self.stop = Some(match reason {
                        StopReason::MaxTokens if self.capped => StopReason::ContextLimit,
                        r => r,
                    });
                    self.stop_token = stop_token;
                }
                Event::Failed { message, .. } => {
                    self.failed = true;
                    self.give_back();
                    return Err(EngineError::Invalid(message));
                }
            }
        }
        self.credit_times();
        if self.stop.is_some() {
            self.give_back();
        }
        Ok(())
    }

    /// Adds the batch's prefill and decode time since the last call to the session's.
    fn credit_times(&mut self) {
        let now = *self.batch.times();
        let s = &mut *self.session;
        s.prefill_time += now.prefill - self.credited.prefill;
        s.prefill_tokens += now.prefill_tokens - self.credited.prefill_tokens;
        s.decode_time += now.decode - self.credited.decode;
        s.decode_tokens += now.decode_rows - self.credited.decode_rows;
        self.credited = now;
    }

    /// Returns the cache to the session, holding every token fed; a cache the batch
    /// cannot hand back (an error inside a step) leaves the session starting over.
    fn give_back(&mut self) {
        match self.batch.take_row(self.id) {
            Ok(Some(held)) => self.session.give_back(held),
            _ => self.session.start_over(self.round_slack),
        }
    }
}

impl Drop for Generation<'_, '_> {
    fn drop(&mut self) {
        if self.stop.is_none() && !self.failed {
            self.give_back();
        }
    }
}

impl Iterator for Generation<'_, '_> {
    type Item = Result<u32, EngineError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(token) = self.ready.pop_front() {
                return Some(Ok(token));
            }
            if self.stop.is_some() || self.failed {
                return None;
            }
            if let Err(e) = self.advance() {
                return Some(Err(e));
            }
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
