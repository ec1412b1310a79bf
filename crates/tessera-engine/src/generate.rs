//! The generate iterator over a [`Session`]: the prompt read and tokens sampled by a
//! one-row [`Batch`] (the step engine the server runs), resumed from the session's cache,
//! which the session gets back, holding the whole sequence, when generation ends.

use crate::batch::{Batch, BatchLimits, BatchTimes, Event, GenerationRequest, RequestId};
use crate::sampler::SamplerConfig;
use crate::session::Session;
use crate::EngineError;
use std::collections::VecDeque;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-sequence or end-of-turn token.
    EndToken,
    /// The text reached one of the request's stop strings (a [`crate::Batch`] with a
    /// tokenizer).
    StopString,
    MaxTokens,
    /// The model's context is full.
    ContextLimit,
}

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
        let model = session.model();
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() > session.context_left() {
            return Err(EngineError::PromptTooLong {
                prompt: session.tokens().len() + prompt.len(),
                context: model.context_length(),
            });
        }
        let held = session.tokens().len();
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
        let (cache, tokens) = session.lend()?;
        let id = match batch.add_resumed(request, cache, held) {
            Ok(id) => id,
            Err(refused) => {
                session.give_back(refused.cache, tokens);
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
            Ok(Some((tokens, cache))) => self.session.give_back(cache, tokens),
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

/// Incremental detokenizer: turns generated ids into text as it becomes printable.
///
/// Each push re-decodes a window of the latest tokens and returns what the new text adds
/// to the window's text already returned. The window starts [`TextStream::CONTEXT`] tokens
/// back from where it last moved, so whatever a decoder makes of a sequence's start (a
/// leading space it strips, a character split over tokens) is the same in both decodes a
/// piece is cut from, and it moves once it holds [`TextStream::WINDOW`] tokens: a push costs
/// a bounded decode, not one of the whole sequence (which made a 4096-token stream cost
/// ~0.6–1.2 ms a token). A trailing U+FFFD is held back for up to [`TextStream::MAX_HELD`]
/// tokens: it is usually the start of a character split over byte-fallback tokens, which
/// the next ones complete. Text already returned cannot be taken back: when re-decoding
/// changes it (a held character forced out and then completed, a decoder that normalizes
/// across tokens within the window), the stream resumes at the first character that
/// changed, so the change shows rather than being lost, and it never cuts inside a
/// character. [`TextStream::finish`] returns whatever is still held at the end of
/// generation.
#[derive(Debug)]
pub struct TextStream {
    ids: Vec<u32>,
    /// Where decoding starts: the tokens before it are settled.
    start: usize,
    /// The decode of `ids[start..]` that everything returned so far was cut from.
    shown: String,
    /// The latest decode, while its ending is held back.
    held: Option<String>,
    /// Tokens pushed since text was last returned.
    held_tokens: usize,
}

impl TextStream {
    /// A UTF-8 character is at most 4 bytes, one byte-fallback token each: after 3 more
    /// tokens a trailing U+FFFD will not complete any more.
    pub const MAX_HELD: usize = 3;
    /// Tokens before the newest that a moved window keeps as the decoder's left context.
    pub const CONTEXT: usize = 6;
    /// Tokens a window holds before it moves.
    pub const WINDOW: usize = 32;

    pub fn new() -> Self {
        TextStream {
            ids: Vec::new(),
            start: 0,
            shown: String::new(),
            held: None,
            held_tokens: 0,
        }
    }

    /// Adds `id` and returns the text it makes printable (possibly none).
    pub fn push(
        &mut self,
        tokenizer: &tessera_models::Tokenizer,
        id: u32,
    ) -> Result<String, EngineError> {
        self.push_with(id, |ids| tokenizer.decode(ids))
    }

    /// [`TextStream::push`] with any decoder of an id sequence.
    pub fn push_with<E>(
        &mut self,
        id: u32,
        decode: impl Fn(&[u32]) -> Result<String, E>,
    ) -> Result<String, EngineError>
    where
        EngineError: From<E>,
    {
        self.ids.push(id);
        let text = decode(&self.ids[self.start..])?;
        if text.ends_with('\u{FFFD}') && self.held_tokens < Self::MAX_HELD {
            self.held_tokens += 1;
            self.held = Some(text);
            return Ok(String::new());
        }
        let new = self.advance(text);
        // Nothing is held here: the window moves past settled text only.
        if self.ids.len() - self.start >= Self::WINDOW {
            let start = self.ids.len() - Self::CONTEXT;
            self.shown = decode(&self.ids[start..])?;
            self.start = start;
        }
        Ok(new)
    }

    /// The text still held back (an incomplete character at the end of generation), as the
    /// decoder renders it; empty when nothing is held.
    pub fn finish(&mut self) -> String {
        match self.held.take() {
            Some(text) => self.advance(text),
            None => String::new(),
        }
    }

    fn advance(&mut self, text: String) -> String {
        self.held = None;
        self.held_tokens = 0;
        let start = common_prefix(&self.shown, &text);
        let new = text[start..].to_string();
        self.shown = text;
        new
    }
}

/// Length in bytes of the longest common prefix of `a` and `b` that ends on a character
/// boundary of both.
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-level decoder: each id is one byte, invalid UTF-8 rendered as U+FFFD.
    fn bytes(ids: &[u32]) -> Result<String, EngineError> {
        let b: Vec<u8> = ids.iter().map(|&i| i as u8).collect();
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    fn stream(ids: &[u32], decode: fn(&[u32]) -> Result<String, EngineError>) -> Vec<String> {
        let mut s = TextStream::new();
        let mut pieces: Vec<String> = ids
            .iter()
            .map(|&i| s.push_with(i, decode).unwrap())
            .collect();
        pieces.push(s.finish());
        pieces
    }

    fn ids_of(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    #[test]
    fn a_character_split_over_tokens_comes_out_whole() {
        // '€' is E2 82 AC: nothing shows until its last byte arrives.
        assert_eq!(stream(&ids_of("a€b"), bytes), ["a", "", "", "€", "b", ""]);
        let text = "aé€😀漢 z";
        let pieces = stream(&ids_of(text), bytes);
        assert_eq!(pieces.concat(), text);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    }

    #[test]
    fn a_trailing_partial_character_is_flushed_at_the_end() {
        // Generation stops after the first two bytes of '€'.
        let pieces = stream(&[b'a' as u32, 0xE2, 0x82], bytes);
        assert_eq!(pieces, ["a", "", "", "\u{FFFD}"]);
    }

    #[test]
    fn bytes_that_never_complete_are_not_held_forever() {
        // A stray continuation byte, then plain text: shown after MAX_HELD tokens at most.
        let pieces = stream(&[0x82, 0x82, 0x82, 0x82, b'x' as u32], bytes);
        assert_eq!(pieces.concat(), "\u{FFFD}".repeat(4) + "x");
        assert_eq!(pieces[TextStream::MAX_HELD], "\u{FFFD}".repeat(4));
        // Forced out as U+FFFD, then completed by a later byte: the completed character
        // shows, and the stream never cuts inside it.
        let pieces = stream(&[0xFF, 0xF0, 0x9F, 0x98, 0x80], bytes);
        assert_eq!(pieces, ["", "", "", "\u{FFFD}\u{FFFD}", "😀", ""]);
    }

    /// A decoder that normalizes across tokens (NFC composition of `e` + U+0301): the text
    /// it re-decodes changes bytes already returned.
    fn composing(ids: &[u32]) -> Result<String, EngineError> {
        let pieces = ["e", "\u{301}", "x", "ü"];
        let text: String = ids.iter().map(|&i| pieces[i as usize]).collect();
        Ok(text.replace("e\u{301}", "é"))
    }

    /// A decoder that treats its first piece differently (as SentencePiece decoders strip
    /// the leading space of a sequence): ids are words, each rendered as " word".
    fn spaced(ids: &[u32]) -> Result<String, EngineError> {
        let text: String = ids.iter().map(|&i| format!(" w{i}")).collect();
        Ok(text.strip_prefix(' ').unwrap_or(&text).to_string())
    }

    #[test]
    fn a_long_stream_decodes_windows_yet_equals_the_whole_decode() {
        // Byte tokens with multi-byte characters straddling every window position, and a
        // decoder that strips the start of each window it sees.
        let text = "ab€c😀漢字 é ".repeat(40);
        let ids = ids_of(&text);
        assert!(ids.len() > 10 * TextStream::WINDOW);
        let pieces = stream(&ids, bytes);
        assert_eq!(pieces.concat(), text);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        let ids: Vec<u32> = (0..500).collect();
        assert_eq!(stream(&ids, spaced).concat(), spaced(&ids).unwrap());
        // Every decode is of a bounded window, never of the whole sequence.
        let longest = std::cell::Cell::new(0);
        let mut s = TextStream::new();
        for &i in &ids {
            s.push_with(i, |w: &[u32]| {
                longest.set(longest.get().max(w.len()));
                spaced(w)
            })
            .unwrap();
        }
        assert_eq!(longest.get(), TextStream::WINDOW);
    }

    #[test]
    fn re_decoding_that_changes_earlier_text_never_cuts_a_character() {
        // "e" is returned, then re-decoding turns it into the two-byte "é": the old offset
        // (1) falls inside it. The stream resumes at the changed character.
        let pieces = stream(&[3, 0, 1, 2], composing);
        assert_eq!(pieces, ["ü", "e", "é", "x", ""]);
    }
}
