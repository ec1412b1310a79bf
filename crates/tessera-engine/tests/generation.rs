//! `Generation` runs on the step engine: a one-row `Batch` resumed from the session's cache.
//! Held to a plain loop of `Session::feed` and the sampler (`common::decode_alone`) on the
//! real model: sampled turns of a conversation continue the session, the session gets its
//! cache back holding every token fed (also when the iterator is dropped early), an end
//! token stops it and is named, and refused input leaves the session as it was.

mod common;

use tessera_engine::{EngineError, Generation, SamplerConfig, Session, StopReason};
use tessera_kv::KvScheme;
use tessera_models::{Model, Tokenizer};

const CHUNK: usize = 64;

fn text_tokens(tok: &Tokenizer, at: usize, chars: usize, bos: bool) -> Vec<u32> {
    let text: String = common::corpus().chars().skip(at).take(chars).collect();
    tok.encode(&text, bos).unwrap()
}

fn sampled(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.9,
        top_k: Some(40),
        top_p: Some(0.95),
        repetition_penalty: 1.1,
        seed,
        ..Default::default()
    }
}

fn generate(session: &mut Session, prompt: &[u32], sampler: SamplerConfig, n: usize) -> Vec<u32> {
    Generation::new(session, prompt, sampler, n, vec![])
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// The session holds `tokens`, in its token list and its cache.
fn holds(session: &Session, tokens: &[u32], what: &str) {
    assert_eq!(session.tokens(), tokens, "{what}: tokens");
    assert_eq!(session.cache().offsets(), [tokens.len()], "{what}: cache");
}

fn conversation(model: &Model, tok: &Tokenizer, kv: &str) {
    let scheme = KvScheme::parse(kv).unwrap();
    // The first turn is longer than a prefill chunk, so it is read in several.
    let first = text_tokens(tok, 0, 600, true);
    let second = text_tokens(tok, 2000, 120, false);
    assert!(first.len() > CHUNK, "{} tokens", first.len());
    let mut ours = Session::new(model, &scheme, CHUNK).unwrap();
    let mut reference = Session::new(model, &scheme, CHUNK).unwrap();
    let out = generate(&mut ours, &first, sampled(3), 12);
    let want = common::decode_alone(&mut reference, &first, sampled(3), 12);
    assert_eq!(out, want, "{kv}: first turn");
    // Every token fed: the prompt and each sampled token but the last.
    let fed: Vec<u32> = first.iter().chain(&out[..11]).copied().collect();
    holds(&ours, &fed, kv);
    let out = generate(&mut ours, &second, sampled(4), 8);
    let want = common::decode_alone(&mut reference, &second, sampled(4), 8);
    assert_eq!(out, want, "{kv}: second turn");
    let fed: Vec<u32> = fed
        .iter()
        .chain(&second)
        .chain(&out[..7])
        .copied()
        .collect();
    holds(&ours, &fed, kv);
}

#[test]
fn turns_of_a_conversation_continue_the_session() {
    let (model, tok) = common::load(true);
    for kv in ["bf16", "affine:4", "turbo:4"] {
        conversation(&model, &tok, kv);
    }
}

#[test]
fn a_generation_dropped_early_gives_the_cache_back() {
    let (model, tok) = common::load(true);
    let scheme = KvScheme::parse("affine:4").unwrap();
    let prompt = text_tokens(&tok, 500, 300, true);
    let mut session = Session::new(&model, &scheme, CHUNK).unwrap();
    let mut generation =
        Generation::new(&mut session, &prompt, SamplerConfig::default(), 20, vec![]).unwrap();
    let taken: Vec<u32> = generation.by_ref().take(3).map(Result::unwrap).collect();
    drop(generation);
    // The prompt and at least the tokens taken but the last, at most every token taken.
    let held = session.tokens().to_vec();
    assert_eq!(held[..prompt.len()], prompt[..]);
    let extra = &held[prompt.len()..];
    assert!(
        (2..=3).contains(&extra.len()) && taken.starts_with(extra),
        "held {extra:?} after taking {taken:?}"
    );
    holds(&session, &held, "dropped");
    // The session goes on from there as a session fed the same tokens the same way does:
    // the prompt, then each generated token alone (a token's keys and values depend on
    // whether it was read alone or inside a chunk, in the last bits, and a 4-bit cache
    // can round such a difference to another code).
    let more = text_tokens(&tok, 3000, 60, false);
    let out = generate(&mut session, &more, SamplerConfig::default(), 6);
    let mut reference = Session::new(&model, &scheme, CHUNK).unwrap();
    reference.feed(&prompt).unwrap();
    for t in extra {
        reference.feed(&[*t]).unwrap();
    }
    let want = common::decode_alone(&mut reference, &more, SamplerConfig::default(), 6);
    assert_eq!(out, want);
}

#[test]
fn an_end_token_stops_it_and_is_named() {
    let (model, tok) = common::load(true);
    let scheme = KvScheme::parse("bf16").unwrap();
    let prompt = text_tokens(&tok, 1000, 200, true);
    let greedy = SamplerConfig::default();
    let mut reference = Session::new(&model, &scheme, CHUNK).unwrap();
    let free = common::decode_alone(&mut reference, &prompt, greedy.clone(), 8);
    let stop = free[4];
    let cut = free.iter().position(|&t| t == stop).unwrap();
    let mut session = Session::new(&model, &scheme, CHUNK).unwrap();
    let mut generation = Generation::new(&mut session, &prompt, greedy, 8, vec![stop]).unwrap();
    let out: Vec<u32> = generation.by_ref().map(Result::unwrap).collect();
    assert_eq!(out, free[..cut]);
    assert_eq!(generation.stop_reason(), Some(StopReason::EndToken));
    assert_eq!(generation.stop_token(), Some(stop));
    drop(generation);
    let mut generation = Generation::new(
        &mut session,
        &[free[cut]],
        SamplerConfig::default(),
        2,
        vec![],
    )
    .unwrap();
    assert_eq!(generation.by_ref().count(), 2);
    assert_eq!(generation.stop_reason(), Some(StopReason::MaxTokens));
    assert_eq!(generation.stop_token(), None);
}

#[test]
fn refused_input_leaves_the_session_as_it_was() {
    let (model, tok) = common::load(true);
    let scheme = KvScheme::parse("turbo:4").unwrap();
    let prompt = text_tokens(&tok, 100, 200, true);
    let mut session = Session::new(&model, &scheme, CHUNK).unwrap();
    session.feed(&prompt).unwrap();
    let greedy = SamplerConfig::default;
    let empty = Generation::new(&mut session, &[], greedy(), 4, vec![]).err();
    assert!(matches!(empty, Some(EngineError::EmptyPrompt)), "{empty:?}");
    holds(&session, &prompt, "after an empty prompt");
    let vocab = model.vocab_size() as u32;
    let outside = Generation::new(&mut session, &[5, vocab], greedy(), 4, vec![]).err();
    let message = outside.map(|e| e.to_string()).unwrap_or_default();
    assert!(message.contains(&vocab.to_string()), "{message}");
    holds(&session, &prompt, "after an id outside the vocabulary");
    let bad = SamplerConfig {
        top_p: Some(1.5),
        ..greedy()
    };
    let refused = Generation::new(&mut session, &[5], bad, 4, vec![]).err();
    assert!(refused.is_some());
    holds(&session, &prompt, "after a bad sampler");
    // And it still generates as a session that never saw the refusals.
    let out = generate(&mut session, &[5, 6], greedy(), 4);
    let mut reference = Session::new(&model, &scheme, CHUNK).unwrap();
    reference.feed(&prompt).unwrap();
    assert_eq!(
        out,
        common::decode_alone(&mut reference, &[5, 6], greedy(), 4)
    );
}
