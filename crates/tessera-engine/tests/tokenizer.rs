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
