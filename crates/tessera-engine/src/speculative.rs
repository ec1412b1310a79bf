//! Speculative decoding with prompt lookup (n-gram drafting): each round proposes the
//! continuation of the latest earlier occurrence of the last few tokens (in the prompt or
//! the output so far), the target reads the last sampled token and the draft as one chunk
//! inside a speculative round of its cache, accepts the longest prefix of the draft its own
//! greedy choice agrees with plus its own next token, and rolls the cache back to what it
//! accepted. No second model: on an editing task (rewrite a file with a small change) most
//! of the output is a copy of the prompt, so most drafts are accepted. The draft length
//! adapts: halved after a round that accepts nothing, doubled after one that accepts all.
//!
//! Greedy only for now: the accepted tokens are the target's own argmax at every position,
//! so the output is the plain greedy output up to the numerics of reading several positions
//! as one chunk instead of one at a time (a quantized matmul's sums depend on its row count,
//! which can flip a near tie).

use crate::generate::StopReason;
use crate::sampler::argmax;
use crate::{EngineError, Session};
use std::collections::VecDeque;
use tessera_models::LogitsMode;

/// Prompt-lookup drafting: match the last `n` tokens (then `n - 1`, … down to 1) against
/// the history, propose what followed their latest earlier occurrence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramDrafter {
    /// The longest suffix matched.
    pub n: usize,
    /// Most tokens drafted per round.
    pub max_draft: usize,
}

impl NgramDrafter {
    /// Up to `k` tokens that followed the latest earlier occurrence of `history`'s longest
    /// matching suffix (of at most `n` tokens); empty when nothing matches.
    pub fn draft(&self, history: &[u32], k: usize) -> Vec<u32> {
        let len = history.len();
        for n in (1..=self.n.min(len.saturating_sub(1))).rev() {
            let pattern = &history[len - n..];
            // Latest first; the occurrence must be followed by at least one token.
            for start in (0..len - n).rev() {
                if &history[start..start + n] == pattern {
                    let from = start + n;
                    return history[from..(from + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }
}

/// What the rounds did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Verification rounds (forwards with a draft) and plain decode steps (no draft).
    pub rounds: usize,
    pub plain_steps: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// `accepted_at[i]`: rounds whose draft position `i` was accepted.
    pub accepted_at: Vec<usize>,
}

/// Greedy generation with n-gram speculation over a [`Session`]: an iterator of tokens, as
/// [`crate::Generation`] is. The session's cache must have round slack of at least the
/// drafter's `max_draft` ([`Session::with_round_slack`]) so that rounds roll back after a
/// sliding-window ring has wrapped.
pub struct Speculative<'a, 'm> {
    session: &'a mut Session<'m>,
    drafter: NgramDrafter,
    stop_tokens: Vec<u32>,
    max_tokens: usize,
    produced: usize,
    /// Tokens decided and not yet emitted.
    ready: VecDeque<u32>,
    /// The prompt and every token decided so far (drafts are looked up here).
    history: Vec<u32>,
    stop: Option<StopReason>,
    stop_token: Option<u32>,
    failed: bool,
    stats: SpecStats,
    /// Tokens the next round drafts at most: halved after a round that accepts nothing,
    /// doubled (up to the drafter's `max_draft`) after one that accepts everything, so a
    /// stretch of output that copies nothing costs short verifications.
    k: usize,
}

impl<'a, 'm> Speculative<'a, 'm> {
    /// Feeds `prompt` and decides the first token.
    pub fn new(
        session: &'a mut Session<'m>,
        prompt: &[u32],
        drafter: NgramDrafter,
        max_tokens: usize,
        stop_tokens: Vec<u32>,
    ) -> Result<Self, EngineError> {
        if drafter.n == 0 || drafter.max_draft == 0 {
            return Err(EngineError::Invalid(
                "speculation needs an n-gram of at least 1 token and at least 1 draft token".into(),
            ));
        }
        if session.round_slack() < drafter.max_draft {
            return Err(EngineError::Invalid(format!(
                "a session with round slack {} cannot roll back drafts of {} tokens",
                session.round_slack(),
                drafter.max_draft
            )));
        }
        let mut history = session.tokens().to_vec();
        history.extend_from_slice(prompt);
        let mut ready = VecDeque::new();
        if max_tokens > 0 {
            let logits = session.feed(prompt)?;
            let first = argmax(&logits);
            ready.push_back(first);
            history.push(first);
        }
        Ok(Speculative {
            session,
            drafter,
            stop_tokens,
            max_tokens,
            produced: 0,
            ready,
            history,
            stop: (max_tokens == 0).then_some(StopReason::MaxTokens),
            stop_token: None,
            failed: false,
            stats: SpecStats::default(),
            k: drafter.max_draft,
        })
    }

    pub fn stats(&self) -> &SpecStats {
        &self.stats
    }

    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    pub fn stop_token(&self) -> Option<u32> {
        self.stop_token
    }

    pub fn session(&self) -> &Session<'m> {
        self.session
    }

    /// One round: the last decided token (not fed yet) and a draft read as one chunk, the
    /// agreeing prefix and the target's next token decided.
    fn round(&mut self) -> Result<(), EngineError> {
        let last = *self.history.last().ok_or(EngineError::EmptyPrompt)?;
        let left = self.session.context_left();
        if left == 0 {
            self.stop = Some(StopReason::ContextLimit);
            return Ok(());
        }
        // Never decide more than max_tokens, never read past the context.
        let k = self
            .k
            .min(self.max_tokens - self.produced - 1)
            .min(left - 1);
        let draft = if k > 0 {
            self.drafter.draft(&self.history, k)
        } else {
            Vec::new()
        };
        if draft.is_empty() {
            let logits = self.session.feed(&[last])?;
            let next = argmax(&logits);
            self.ready.push_back(next);
            self.history.push(next);
            self.stats.plain_steps += 1;
            return Ok(());
        }
        let mut chunk = Vec::with_capacity(draft.len() + 1);
        chunk.push(last);
        chunk.extend_from_slice(&draft);
        let logits = self.session.speculate(&chunk)?;
        let vocab = logits.len() / chunk.len();
        let mut accepted = 0;
        while accepted < draft.len()
            && argmax(&logits[accepted * vocab..(accepted + 1) * vocab]) == draft[accepted]
        {
            accepted += 1;
        }
        let next = argmax(&logits[accepted * vocab..(accepted + 1) * vocab]);
        // Kept: the last token and the accepted drafts; the target's next token is fed in
        // the next round.
        self.session.end_speculation(chunk.len(), 1 + accepted)?;
        for &t in draft[..accepted].iter().chain([&next]) {
            self.ready.push_back(t);
            self.history.push(t);
        }
        self.k = if accepted == draft.len() {
            (2 * self.k).min(self.drafter.max_draft)
        } else if accepted == 0 {
            (self.k / 2).max(1)
        } else {
            self.k
        };
        self.stats.rounds += 1;
        self.stats.drafted += draft.len();
        self.stats.accepted += accepted;
        if self.stats.accepted_at.len() < draft.len() {
            self.stats.accepted_at.resize(draft.len(), 0);
        }
        for slot in &mut self.stats.accepted_at[..accepted] {
            *slot += 1;
        }
        Ok(())
    }
}

impl Iterator for Speculative<'_, '_> {
    type Item = Result<u32, EngineError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        loop {
            if let Some(t) = self.ready.pop_front() {
                if self.stop.is_some() {
                    return None;
                }
                self.produced += 1;
                if self.stop_tokens.contains(&t) {
                    self.stop = Some(StopReason::EndToken);
                    self.stop_token = Some(t);
                } else if self.produced >= self.max_tokens {
                    self.stop = Some(StopReason::MaxTokens);
                }
                return Some(Ok(t));
            }
            if self.stop.is_some() {
                return None;
            }
            if let Err(e) = self.round() {
                self.failed = true;
                return Some(Err(e));
            }
        }
    }
}

impl Session<'_> {
    /// Reads `chunk` (the last decided token, then a draft) inside a speculative round
    /// and returns the logits of every position `(chunk.len(), vocab)`, flattened.
    fn speculate(&mut self, chunk: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.cache_mut().check_append(chunk.len())?;
        self.cache_mut().round_begin()?;
        match self.forward(chunk, LogitsMode::All) {
            Ok(logits) => Ok(logits),
            Err(e) => {
                // Nothing was appended by a refused forward; close the round as it was.
                let _ = self.cache_mut().round_rollback(&[0]);
                Err(e)
            }
        }
    }

    /// Closes the round [`Session::speculate`] opened, keeping `keep` of the `fed`
    /// positions it read.
    fn end_speculation(&mut self, fed: usize, keep: usize) -> Result<(), EngineError> {
        self.cache_mut().round_rollback(&[keep])?;
        self.drop_last_tokens(fed - keep);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::NgramDrafter;

    #[test]
    fn drafts_continue_the_latest_earlier_occurrence_of_the_longest_suffix() {
        let d = NgramDrafter { n: 3, max_draft: 4 };
        // "1 2 3" occurred at 0 (followed by 4 5) and at 5 (followed by 9): latest wins.
        let h = [1, 2, 3, 4, 5, 1, 2, 3, 9, 7, 1, 2, 3];
        assert_eq!(d.draft(&h, 4), vec![9, 7, 1, 2]);
        // Capped at k, and at the history's end.
        assert_eq!(d.draft(&h, 2), vec![9, 7]);
        // No 3-gram or 2-gram match: the last token alone.
        let h = [5, 6, 7, 8, 6, 9, 7];
        assert_eq!(d.draft(&h, 3), vec![8, 6, 9]);
        // Nothing matches.
        assert!(d.draft(&[1, 2, 3], 3).is_empty());
        assert!(d.draft(&[], 3).is_empty());
        assert!(d.draft(&[4], 3).is_empty());
    }
}
