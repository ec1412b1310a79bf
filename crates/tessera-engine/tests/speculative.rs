//! Prompt-lookup speculation on the real model: every speculative token is plain greedy
//! decode's choice along the same output (or a near tie, shown), for bf16, affine:4,
//! turbo:4 and `:global` caches, with Gemma 3's 512-position rings past their wrap (rounds
//! roll back through the ring slack), and most drafts are accepted on a prompt whose
//! continuation is a copy. Weights are dequantized to f32 (as in continuous_batching.rs):
//! a round reads several positions as one chunk, and int8 activation rounding would turn
//! the chunk's different sums into flips.

mod common;

use tessera_engine::speculative::{Drafter, ModelDrafter, SpecStats};
use tessera_engine::{
    argmax, Batch, BatchLimits, BatchSpec, Generation, SamplerConfig, Session, StopReason,
};
use tessera_kv::KvScheme;
use tessera_models::Model;

const DRAFT: usize = 6;

/// A passage twice, then its first part a third time: the continuation copies it, so
/// drafts hit; over 600 tokens, past Gemma 3's 512-position window.
fn copy_prompt(tok: &tessera_models::Tokenizer) -> Vec<u32> {
    let corpus = common::corpus();
    let passage: String = corpus.chars().skip(30_000).take(1400).collect();
    let again: String = passage.chars().take(300).collect();
    let prompt = tok
        .encode(&format!("{passage}\n\n{passage}\n\n{again}"), true)
        .unwrap();
    assert!(
        prompt.len() > 600,
        "{} tokens: past the window",
        prompt.len()
    );
    prompt
}

/// Runs 40 speculative greedy tokens with `drafter` and checks them against plain decode,
/// one token at a time along the same output: at every position the speculative token is
/// plain greedy's choice, or close to it. A chunk's sums differ from a step's in the last
/// bits: with bf16 storage that only decides a near tie (0.1 on logits around 20, 0.5%); a
/// 4-bit code can flip on it, which moves a logit by up to about 1 (rare: at most 3 of 40
/// tokens). Each such position is shown. Returns the rounds' counters.
fn check_greedy_equals_plain(
    model: &Model,
    prompt: &[u32],
    kv: &str,
    spec: BatchSpec,
) -> SpecStats {
    let scheme = scheme(kv);
    let session = || {
        Session::new(model, &scheme, 256)
            .unwrap()
            .with_round_slack(DRAFT)
    };
    let mut s = session();
    let greedy = SamplerConfig::default();
    let mut spec = Generation::with_spec(&mut s, prompt, greedy, 40, vec![], Some(spec)).unwrap();
    let got: Vec<u32> = spec.by_ref().collect::<Result<_, _>>().unwrap();
    assert_eq!(got.len(), 40, "{kv}");
    let near_tie = if kv == "bf16" { 0.1 } else { 1.0 };
    let mut plain = session();
    let mut logits = plain.feed(prompt).unwrap();
    let mut ties = 0;
    for (i, &t) in got.iter().enumerate() {
        let best = argmax(&logits);
        if best != t {
            let gap = logits[best as usize] - logits[t as usize];
            println!(
                "{kv}: token {i}: plain greedy {best}, speculative {t}, {gap} apart (top logit {})",
                logits[best as usize]
            );
            assert!(gap < near_tie, "{kv}: token {i} is {gap} below greedy's");
            ties += 1;
        }
        logits = plain.feed(&[t]).unwrap();
    }
    assert!(ties <= 3, "{kv}: {ties} near ties");
    assert_eq!(spec.stop_reason(), Some(StopReason::MaxTokens));
    let st = spec.spec_stats().clone();
    drop(spec);
    println!("{kv}: {}", st.summary());
    // Every decided token was fed except the last: the cache holds prompt + 39.
    assert_eq!(s.tokens().len(), prompt.len() + 39, "{kv}");
    assert_eq!(s.cache().offsets(), vec![prompt.len() + 39], "{kv}");
    st
}

/// A scheme by name, or `mix`: a kv-config of three codecs (affine:4 by default, the
/// sliding-window layers turbo:3, layer 5 bf16).
fn scheme(kv: &str) -> KvScheme {
    if kv == "mix" {
        let config = r#"{"default": "affine:4", "sliding": "turbo:3",
                         "layers": [{"layer": 5, "scheme": "bf16"}]}"#;
        return KvScheme::from_config_json(config).unwrap();
    }
    KvScheme::parse(kv).unwrap()
}

#[test]
fn speculative_greedy_equals_plain_greedy_on_every_scheme() {
    let (model, tok) = common::load_f32_weights();
    let prompt = copy_prompt(&tok);
    for kv in ["bf16", "affine:4", "turbo:4", "turbo:4:global", "mix"] {
        let st = check_greedy_equals_plain(&model, &prompt, kv, BatchSpec::ngram(3, DRAFT));
        // The bf16 model copies the passage, so most drafts hold; how well the model copies
        // over a 4-bit cache is that cache's quality (printed above).
        assert!(st.rounds > 0 && st.accepted > 0, "{kv}: {st:?}");
        if kv == "bf16" {
            assert!(st.accepted * 2 > st.drafted, "{kv}: {st:?}");
        }
    }
}

#[test]
fn draft_model_greedy_equals_plain_greedy_and_rolls_back_with_the_target() {
    // The target reads f32 weights; the drafter is the same model with its shipped
    // quantized weights, its own cache in the same scheme (rings past their wrap, rolled
    // back every round through their slack).
    let (model, tok) = common::load_f32_weights();
    let (draft_model, _) = common::load(true);
    let prompt = copy_prompt(&tok);
    for kv in ["bf16", "affine:4", "turbo:4"] {
        let scheme = KvScheme::parse(kv).unwrap();
        let greedy = SamplerConfig::default();
        let st =
            check_greedy_equals_plain(&model, &prompt, kv, BatchSpec::model(&draft_model, DRAFT));
        assert!(
            st.rounds > 0 && st.accepted * 2 > st.drafted,
            "{kv}: {st:?}"
        );
        // A drafter's rounds: drafts fed inside a round, rolled back to what the target
        // kept; its cache holds exactly the tokens it was fed, a prefix of the history.
        let mut drafter = ModelDrafter::new(&draft_model, &model, &scheme, DRAFT, &greedy).unwrap();
        let mut history = prompt.clone();
        for keep in [0, 2, DRAFT - 1] {
            let draft = drafter.draft(&history, DRAFT).unwrap();
            assert_eq!(draft.tokens.len(), DRAFT, "{kv}");
            drafter.accepted(keep).unwrap();
            history.extend_from_slice(&draft.tokens[..keep]);
            history.push(1000 + keep as u32);
            let held = drafter.session().tokens();
            assert_eq!(
                drafter.session().cache().offsets(),
                vec![held.len()],
                "{kv}"
            );
            assert_eq!(&held[..], &history[..held.len()], "{kv}");
            // Everything but the target's own token, which the next round feeds.
            assert_eq!(held.len(), history.len() - 1, "{kv}");
        }
    }
}

#[test]
fn a_draft_model_of_another_vocabulary_is_refused() {
    let (model, _) = common::load(true);
    let (other, _) = common::load_path(&common::qwen_path());
    let scheme = KvScheme::parse("bf16").unwrap();
    let err = ModelDrafter::new(&other, &model, &scheme, DRAFT, &SamplerConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("vocabulary") && err.contains("151936") && err.contains("262144"),
        "{err}"
    );
    // The same refusal where a server takes its drafter: the batch's speculation.
    let err = Batch::new(&model, &scheme, 64, BatchLimits::default())
        .unwrap()
        .with_speculation(BatchSpec::model(&other, DRAFT))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("vocabulary"), "{err}");
}

#[test]
fn a_stop_token_inside_an_accepted_draft_ends_the_output_there() {
    let (model, tok) = common::load(true);
    let line = "one two three four five six seven eight nine ten. ";
    let prompt = tok.encode(&line.repeat(6), true).unwrap();
    let scheme = KvScheme::parse("bf16").unwrap();
    let drafter = Some(BatchSpec::ngram(2, DRAFT));
    let greedy = SamplerConfig::default;
    // First without a stop: the output, which copies the line.
    let mut s = Session::new(&model, &scheme, 512)
        .unwrap()
        .with_round_slack(DRAFT);
    let free: Vec<u32> = Generation::with_spec(&mut s, &prompt, greedy(), 24, vec![], drafter)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    // Then with the sixth token of that output as a stop token.
    let stop = free[5];
    let first = free.iter().position(|&t| t == stop).unwrap();
    let mut s = Session::new(&model, &scheme, 512)
        .unwrap()
        .with_round_slack(DRAFT);
    let mut spec =
        Generation::with_spec(&mut s, &prompt, greedy(), 24, vec![stop], drafter).unwrap();
    let got: Vec<u32> = spec.by_ref().collect::<Result<_, _>>().unwrap();
    // The stop token is not emitted (as with plain generation).
    assert_eq!(got, free[..first].to_vec());
    assert_eq!(spec.stop_reason(), Some(StopReason::EndToken));
    assert_eq!(spec.stop_token(), Some(stop));
    // A session without round slack for the drafts is refused up front.
    let mut bare = Session::new(&model, &scheme, 512).unwrap();
    let err = Generation::with_spec(&mut bare, &prompt, greedy(), 8, vec![], drafter)
        .err()
        .unwrap();
    assert!(err.to_string().contains("round slack"), "{err}");
}
