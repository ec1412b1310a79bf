//! Admission: what `add` refuses, the queue, which waiting prompts are read next (alone, in
//! chunks, or several in one forward) and the rows they become.

use super::output::Row;
use super::request::{DraftSource, GenerationRequest, Refused, RequestId, MAX_TOP_LOGPROBS};
use super::Batch;
use crate::error::check_vocabulary;
use crate::sampler::{Sampler, SamplerConfig};
use crate::sequence::Sequence;
use crate::speculative::{DraftLength, Drafter, ModelDrafter, NgramDrafter};
use crate::stop::StopText;
use crate::EngineError;
use tessera_kv::KvCache;

/// A queued request, with the cache of its prompt's first tokens when the caller gave one
/// ([`Batch::add_resumed`]).
pub(super) struct Waiting {
    pub(super) id: RequestId,
    pub(super) request: GenerationRequest,
    pub(super) resumed: Option<Sequence>,
}

/// A request whose prompt is being read into a cache of its own.
pub(super) struct Prefill {
    pub(super) id: RequestId,
    pub(super) request: GenerationRequest,
    pub(super) cache: KvCache,
    pub(super) fed: usize,
    pub(super) cached: usize,
    pub(super) kv_bytes: usize,
    /// Where a chunk ends and the row is kept in the prefix store too (see
    /// [`PREFIX_CHECKPOINT`]).
    pub(super) checkpoint: Option<usize>,
}

/// With a prefix store, on a model with sliding-window layers, a prompt is also kept as it
/// stood this many tokens before its end. A wrapped ring cannot be cut back, so the
/// finished row (prompt and reply) gives back only itself; the checkpoint serves the next
/// prompt that shares all but the last few dozen tokens (the same document or system
/// prompt with another question, a regenerated last turn).
pub const PREFIX_CHECKPOINT: usize = 64;

impl<'m> Batch<'m> {
    /// Queues `request`. Refused, with nothing queued, when its prompt is empty, when
    /// prompt + `max_tokens` exceed the model's context or could never fit the KV budget,
    /// and when the queue is full.
    pub fn add(&mut self, request: GenerationRequest) -> Result<RequestId, EngineError> {
        self.check(&request)?;
        Ok(self.enqueue(request, None))
    }

    /// [`Batch::add`] for a request whose prompt begins with what `held` holds, e.g. the
    /// previous turn of a conversation or a prompt cache: only the rest of the prompt is
    /// read. Refused as `add` refuses, and when `held`'s tokens are not a prefix of the
    /// prompt that leaves at least one token to read; the sequence comes back with the
    /// error.
    pub fn add_resumed(
        &mut self,
        request: GenerationRequest,
        held: Sequence,
    ) -> Result<RequestId, Box<Refused>> {
        if let Err(error) = self.check(&request) {
            return Err(Box::new(Refused { error, held }));
        }
        let n = held.tokens().len();
        if n >= request.prompt.len() || !request.prompt.starts_with(held.tokens()) {
            let error = EngineError::Invalid(format!(
                "a resumed request's {} held tokens must be a prefix of its {} prompt tokens \
                 that leaves at least one to read",
                n,
                request.prompt.len(),
            ));
            return Err(Box::new(Refused { error, held }));
        }
        Ok(self.enqueue(request, Some(held)))
    }

    pub(super) fn enqueue(
        &mut self,
        request: GenerationRequest,
        resumed: Option<Sequence>,
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
    pub(super) fn check(&self, request: &GenerationRequest) -> Result<(), EngineError> {
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
            return Err(EngineError::field(
                "top_logprobs",
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, not {n}"),
            ));
        }
        let total = request.prompt.len().saturating_add(request.max_tokens);
        if total > self.model.context_length() {
            return Err(EngineError::PromptTooLong {
                prompt: total,
                context: self.model.context_length(),
            });
        }
        check_vocabulary(&request.prompt, self.model.vocab_size())?;
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

    /// How many waiting prompts, from the front of the queue, can be read together in one
    /// forward, and the widest of them: each a whole prompt within one chunk, with no
    /// reusable prefix and no checkpoint to keep, admitted by the row and KV limits, the
    /// group padded to its widest prompt no more than one chunk of tokens. At least two,
    /// else `None`: one prompt is read as before.
    pub(super) fn group_size(&mut self) -> Option<(usize, usize)> {
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

    /// A request's row once its prompt is read (`cached` of its tokens reused).
    pub(super) fn new_row(
        &self,
        id: RequestId,
        request: GenerationRequest,
        cached: usize,
        kv_bytes: usize,
    ) -> Row<'m> {
        let GenerationRequest {
            prompt,
            max_tokens,
            sampler,
            stop_tokens,
            stop_strings,
            logprobs,
        } = request;
        // A drafter that cannot be made (checked by `with_speculation`, so not expected)
        // fails its request at its first token.
        let (drafter, failure) = match self.drafter_for(&sampler) {
            Ok(d) => (d, None),
            Err(e) => (None, Some(format!("the drafter could not be made: {e}"))),
        };
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
            failure,
            stop_token: None,
            logprobs,
            next: 0,
            kv_bytes,
            draft_len: DraftLength::new(self.round_slack()),
            drafter,
        }
    }

    /// A row's drafter, where the batch speculates.
    pub(super) fn drafter_for(
        &self,
        sampler: &SamplerConfig,
    ) -> Result<Option<Box<dyn Drafter + 'm>>, EngineError> {
        let Some(spec) = self.spec else {
            return Ok(None);
        };
        Ok(Some(match spec.source {
            DraftSource::Ngram { n } => Box::new(NgramDrafter { n }),
            DraftSource::Model(draft) => Box::new(ModelDrafter::new(
                draft,
                self.model,
                &self.scheme,
                spec.max_draft,
                sampler,
            )?),
        }))
    }

    /// Starts reading the next waiting prompt when a row and the budget allow.
    pub(super) fn admit(&mut self) -> Result<(), EngineError> {
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
        let (cache, fed) = match reused.map(Sequence::into_parts) {
            Some((tokens, cache)) => (cache, tokens.len()),
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
}
