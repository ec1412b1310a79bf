//! The output stage of a row: sampling, the one verification of a draft, stop tokens and
//! stop text, log-probabilities and the events a step reports.

use super::request::{Event, RequestId, TokenLogprobs};
use crate::sampler::Sampler;
use crate::speculative::{verify_token, Draft, DraftLength, Drafter};
use crate::stop::{Released, StopReason, StopText};
use tessera_models::Tokenizer;

/// A request decoding in the running batch: row `i` of the running cache.
pub(super) struct Row<'m> {
    pub(super) id: RequestId,
    pub(super) sampler: Sampler,
    /// Prompt and generated tokens (the sampler's history).
    pub(super) history: Vec<u32>,
    pub(super) prompt_tokens: usize,
    pub(super) cached_tokens: usize,
    pub(super) produced: usize,
    pub(super) max_tokens: usize,
    pub(super) stop_tokens: Vec<u32>,
    /// The detokenized output and its stop strings, where the batch has a tokenizer.
    pub(super) text: Option<StopText>,
    /// Why the request cannot go on (reported by [`Row::finished`]).
    pub(super) failure: Option<String>,
    /// The stop token that ended the request.
    pub(super) stop_token: Option<u32>,
    pub(super) logprobs: Option<usize>,
    /// The token fed at the next step.
    pub(super) next: u32,
    pub(super) kv_bytes: usize,
    /// With speculation: tokens the next round drafts at most, and what drafts them.
    pub(super) draft_len: DraftLength,
    pub(super) drafter: Option<Box<dyn Drafter + 'm>>,
}

impl<'m> Row<'m> {
    /// Greedy with nothing to penalize and no log-probabilities: the token is the logits'
    /// argmax, which the device can pick.
    pub(super) fn plain_greedy(&self) -> bool {
        let c = self.sampler.config();
        c.temperature <= 0.0
            && c.repetition_penalty == 1.0
            && c.presence_penalty == 0.0
            && c.frequency_penalty == 0.0
            && self.logprobs.is_none()
    }

    /// [`Row::take`] for a token already chosen (by [`Row::plain_greedy`]'s argmax).
    pub(super) fn take_chosen(
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
    pub(super) fn take(
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
    pub(super) fn emit(
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
    /// (the one verification loop: [`crate::speculative`] states the rule). Neither emitted
    /// nor recorded here.
    pub(super) fn verify(&mut self, draft: &Draft, at: &[&[f32]]) -> Vec<u32> {
        let base = self.history.len();
        let mut next = None;
        for (j, (&t, q)) in draft.tokens.iter().zip(&draft.q).enumerate() {
            let p = self
                .sampler
                .distribution(at[j], &self.history, &draft.tokens[..j]);
            match verify_token(&p, q, t, &mut self.sampler) {
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
                .distribution(at[accepted], &self.history, &draft.tokens);
            self.sampler.draw(&p)
        });
        let mut decided: Vec<u32> = self.history.drain(base..).collect();
        decided.push(next);
        decided
    }

    /// The request's last event: its text still held back released (where that completes a
    /// stop string, the reason becomes [`StopReason::StopString`]), or its failure.
    pub(super) fn finished(&mut self, reason: StopReason) -> Event {
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
