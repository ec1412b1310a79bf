//! Stop strings: a generation's text as it becomes printable, held back wherever it may
//! still turn into a stop string, and cut where one appears (the stop string itself is not
//! part of the output, as OpenAI's `stop` defines it).

use crate::text_stream::TextStream;
use crate::EngineError;
use tessera_models::Tokenizer;

/// Why a generation ended.
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

/// Text a token (or the end of generation) releases.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Released {
    /// Text that can no longer become part of a stop string.
    pub text: String,
    /// A stop string appeared: `text` ends where it began, and nothing follows.
    pub stopped: bool,
}

/// One generation's detokenized output with its stop strings.
#[derive(Debug)]
pub struct StopText {
    stream: TextStream,
    stops: Vec<String>,
    /// All text decoded so far; `text[..sent]` has been released.
    text: String,
    sent: usize,
    /// The longest stop string, in bytes.
    longest: usize,
}

impl StopText {
    /// Empty stop strings are ignored (they would end every generation at once).
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        StopText {
            stream: TextStream::new(),
            longest: stops.iter().map(String::len).max().unwrap_or(0),
            stops,
            text: String::new(),
            sent: 0,
        }
    }

    /// Adds generated token `id`.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<Released, EngineError> {
        let piece = self.stream.push(tokenizer, id)?;
        Ok(self.push_text(&piece, false))
    }

    /// The end of generation: whatever the detokenizer and the stop strings still held.
    pub fn finish(&mut self) -> Released {
        let rest = self.stream.finish();
        self.push_text(&rest, true)
    }

    /// Adds decoded text; `at_end`: nothing follows, so nothing is held back.
    pub fn push_text(&mut self, piece: &str, at_end: bool) -> Released {
        self.text.push_str(piece);
        // A stop string that ends in the new text began at most `longest` bytes before it.
        let from = self.sent.saturating_sub(self.longest);
        let from = (0..=from)
            .rev()
            .find(|&i| self.text.is_char_boundary(i))
            .unwrap_or(0);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()))
            .min()
            .map(|at| from + at);
        let (end, stopped) = match hit {
            Some(at) => (at.max(self.sent), true),
            None if at_end => (self.text.len(), false),
            None => (self.text.len() - self.held_back(), false),
        };
        let text = self.text[self.sent..end.max(self.sent)].to_string();
        self.sent = end.max(self.sent);
        Released { text, stopped }
    }

    /// Bytes at the end of the text that begin some stop string (so may still become one).
    fn held_back(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|s| {
                (1..s.len())
                    .rev()
                    .find(|&k| s.is_char_boundary(k) && self.text.ends_with(&s[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> StopText {
        StopText::new(s.iter().map(|s| s.to_string()).collect())
    }

    fn released(text: &str, stopped: bool) -> Released {
        Released {
            text: text.into(),
            stopped,
        }
    }

    #[test]
    fn a_stop_string_split_over_pieces_is_held_back_then_cut() {
        let mut t = stops(&["END"]);
        assert_eq!(t.push_text("hello E", false), released("hello ", false));
        assert_eq!(t.push_text("N", false), released("", false));
        assert_eq!(t.push_text("D more", false), released("", true));
    }

    #[test]
    fn a_held_prefix_that_does_not_complete_is_released() {
        let mut t = stops(&["END"]);
        assert_eq!(t.push_text("a E", false), released("a ", false));
        assert_eq!(t.push_text("x", false), released("Ex", false));
        // At the end nothing is held back.
        assert_eq!(t.push_text("E", true), released("E", false));
    }

    #[test]
    fn the_earliest_stop_wins_and_multibyte_text_is_safe() {
        let mut t = stops(&["é!", "b"]);
        assert_eq!(t.push_text("ééaé!b", false), released("ééa", true));
        // Held back across a multi-byte prefix of a stop string.
        let mut t = stops(&["éx"]);
        assert_eq!(t.push_text("aé", false), released("a", false));
        assert_eq!(t.push_text("é", false), released("é", false));
    }

    #[test]
    fn without_stop_strings_text_passes_through_and_empty_ones_are_ignored() {
        let mut t = stops(&[""]);
        assert_eq!(t.push_text("abc", false), released("abc", false));
        assert_eq!(t.finish(), released("", false));
    }
}
