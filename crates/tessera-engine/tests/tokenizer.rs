//! The GGUF SentencePiece tokenizer: known ids, exact round trips, control tokens.

mod common;

#[test]
fn tokenizer_matches_known_ids_and_round_trips() {
    let (_, tok) = common::load(true);
    // Agreed by two independent builders (../shared/reference/gemma3-270m.md).
    assert_eq!(
        tok.encode("The capital of France is", true).unwrap(),
        vec![2, 818, 5279, 529, 7001, 563]
    );
    let texts = [
        "Hello, world!",
        "  two leading spaces and a trailing one ",
        "line one\nline two\n\n\nafter three newlines\ttab\t\ttabs",
        "digits 0123456789 and 3.14159, 1,000,000",
        "emoji 🦀🚀 and accents: café, naïve, Ærø; CJK 漢字かな; Cyrillic Привет",
        "rare bytes \u{1} \u{7f} \u{10FFFF} ꙮ",
        "<b>html</b> tags and </not_a_tag>",
        "",
    ];
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(
            tok.decode(&ids).unwrap(),
            text,
            "round trip of {text:?} via {ids:?}"
        );
    }
    let corpus = common::corpus();
    let slice: String = corpus.chars().take(20_000).collect();
    let ids = tok.encode(&slice, false).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), slice);
    assert!(
        ids.len() > 3000 && ids.len() < 7000,
        "{} tokens for 20k chars of English",
        ids.len()
    );
}

#[test]
fn chat_markers_are_single_control_tokens() {
    let (_, tok) = common::load(true);
    let special = tok.special();
    let (start, end) = (special.start_of_turn.unwrap(), special.end_of_turn.unwrap());
    let ids = tok
        .encode("<start_of_turn>user\nHi<end_of_turn>\n", false)
        .unwrap();
    assert_eq!(ids.first(), Some(&start));
    assert!(ids.contains(&end));
    // Decoding drops control tokens and keeps the text between them.
    assert_eq!(tok.decode(&ids).unwrap(), "user\nHi\n");
    assert_eq!(special.bos, Some(2));
    assert_eq!(special.eos, 1);
}

#[test]
fn streamed_text_holds_a_character_split_over_byte_tokens() {
    use tessera_engine::TextStream;
    let (_, tok) = common::load(true);
    // U+10FFFF is in no vocabulary: it falls back to its four UTF-8 bytes.
    let text = "Ab \u{10FFFF} cd";
    let ids = tok.encode(text, false).unwrap();
    let bytes = ["<0xF4>", "<0x8F>", "<0xBF>", "<0xBF>"].map(|t| tok.token_id(t).unwrap());
    let at = ids
        .windows(4)
        .position(|w| w == bytes)
        .unwrap_or_else(|| panic!("no byte-fallback tokens in {ids:?}"));
    let mut stream = TextStream::new();
    let pieces: Vec<String> = ids
        .iter()
        .map(|&id| stream.push(&tok, id).unwrap())
        .collect();
    assert_eq!(pieces.concat() + &stream.finish(), text);
    // Nothing shows until the character's last byte, then all of it.
    assert_eq!(pieces[at..at + 3], ["", "", ""], "{pieces:?}");
    assert!(pieces[at + 3].starts_with('\u{10FFFF}'), "{pieces:?}");
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    // Generation stopping inside the character: what is held comes out at the end.
    let mut stream = TextStream::new();
    let shown: String = ids[..at + 2]
        .iter()
        .map(|&id| stream.push(&tok, id).unwrap())
        .collect();
    let rest = stream.finish();
    assert!(rest.contains('\u{FFFD}'), "{rest:?}");
    assert_eq!(shown + &rest, tok.decode(&ids[..at + 2]).unwrap());
}

#[test]
fn a_long_stream_of_real_text_equals_its_whole_decode() {
    use tessera_engine::TextStream;
    use tessera_models::{GgufFile, Tokenizer};
    // Gemma's SentencePiece vocabulary and Qwen's byte-level BPE: thousands of tokens of
    // real text streamed through the windowed detokenizer give the text of one decode
    // (a window start inside a word, a space or a multi-byte character included: the
    // corpus's quotes and dashes are several bytes).
    let text = common::corpus();
    let text = &text[..text
        .char_indices()
        .nth(12_000)
        .map_or(text.len(), |(i, _)| i)];
    for path in [common::model_path(), common::qwen_path()] {
        let gguf = GgufFile::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&gguf).unwrap();
        let ids = tok.encode(text, false).unwrap();
        assert!(ids.len() > 50 * TextStream::WINDOW, "{}", ids.len());
        let mut stream = TextStream::new();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&stream.push(&tok, id).unwrap());
        }
        streamed.push_str(&stream.finish());
        assert_eq!(streamed, tok.decode(&ids).unwrap(), "{}", path.display());
    }
}
