//! The generate iterator: prefill the prompt, then sample one token per step until a stop.

use crate::sampler::{Sampler, SamplerConfig};
use crate::session::Session;
use crate::EngineError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-sequence or end-of-turn token.
    EndToken,
    MaxTokens,
    /// The model's context is full.
    ContextLimit,
}

/// Yields generated token ids; stop tokens are not yielded. After the iterator ends,
/// [`Generation::stop_reason`] says why.
pub struct Generation<'s, 'm> {
    session: &'s mut Session<'m>,
    sampler: Sampler,
    stop_tokens: Vec<u32>,
    max_tokens: usize,
    produced: usize,
    logits: Option<Vec<f32>>,
    pending: Option<u32>,
    stop: Option<StopReason>,
}

impl<'s, 'm> Generation<'s, 'm> {
    /// Feeds `prompt` into `session` (on top of whatever it holds) and prepares to sample.
    pub fn new(
        session: &'s mut Session<'m>,
        prompt: &[u32],
        sampler: SamplerConfig,
        max_tokens: usize,
        stop_tokens: Vec<u32>,
    ) -> Result<Self, EngineError> {
        let logits = session.feed(prompt)?;
        Ok(Generation {
            session,
            sampler: Sampler::new(sampler),
            stop_tokens,
            max_tokens,
            produced: 0,
            logits: Some(logits),
            pending: None,
            stop: None,
        })
    }

    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    pub fn session(&self) -> &Session<'m> {
        self.session
    }

    fn step(&mut self) -> Result<Option<u32>, EngineError> {
        if self.stop.is_some() {
            return Ok(None);
        }
        if self.produced >= self.max_tokens {
            self.stop = Some(StopReason::MaxTokens);
            return Ok(None);
        }
        // The previous token is fed lazily, so no forward runs after the last one.
        if let Some(token) = self.pending.take() {
            if self.session.context_left() == 0 {
                self.stop = Some(StopReason::ContextLimit);
                return Ok(None);
            }
            self.logits = Some(self.session.feed(&[token])?);
        }
        let logits = self.logits.take().expect("logits after feed");
        let token = self.sampler.sample(&logits, self.session.tokens());
        if self.stop_tokens.contains(&token) {
            self.stop = Some(StopReason::EndToken);
            return Ok(None);
        }
        self.produced += 1;
        self.pending = Some(token);
        Ok(Some(token))
    }
}

impl Iterator for Generation<'_, '_> {
    type Item = Result<u32, EngineError>;

    fn next(&mut self) -> Option<Self::Item> {
        match self.step() {
            Ok(Some(t)) => Some(Ok(t)),
            Ok(None) => None,
            Err(e) => {
                self.stop = Some(StopReason::MaxTokens);
                Some(Err(e))
            }
        }
    }
}

/// Incremental detokenizer: returns only text that is complete (no half UTF-8 sequence
/// pending from byte-fallback tokens).
pub struct TextStream {
    ids: Vec<u32>,
    printed: usize,
}

impl TextStream {
    pub fn new() -> Self {
        TextStream {
            ids: Vec::new(),
            printed: 0,
        }
    }

    pub fn push(
        &mut self,
        tokenizer: &tessera_models::Tokenizer,
        id: u32,
    ) -> Result<String, EngineError> {
        self.ids.push(id);
        let text = tokenizer.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') || text.len() < self.printed {
            return Ok(String::new());
        }
        let new = text[self.printed..].to_string();
        self.printed = text.len();
        Ok(new)
    }
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}
