//! Incremental detokenization: generated ids to text as it becomes printable.

use crate::EngineError;

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
