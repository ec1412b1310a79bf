//! Steps run ahead on ids chosen where the logits lie (`Model::choose_greedy` →
//! `ChosenIds`, `Model::forward_chosen`, the path a GPU takes), on the CPU through a
//! stand-in graph backend: its `greedy_ids` picks each row's token by the engine's argmax
//! and hands over the ids as a tensor and a host copy, and it refuses every capture, so the
//! steps themselves stay eager. Requests that join at different steps, end on `max_tokens`
//! and on a stop token (so the chosen ids are filtered as rows leave) decode what each
//! decodes alone. The CUDA kernel itself is checked on the device (`tessera bench`'s tokens
//! digest with and without `--no-steps-ahead`).

mod common;

use candle_core::{Device, Result, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use tessera_engine::{
    Batch, BatchLimits, Event, Generation, GenerationRequest, SamplerConfig, Session, StopReason,
};
use tessera_kv::KvScheme;
use tessera_models::step_graph::{install, DeviceGraph, GraphBackend, HostIds};
use tessera_models::Tokenizer;

struct StandIn {
    picks: Arc<AtomicUsize>,
}

struct Ready(Vec<u32>);

impl HostIds for Ready {
    fn wait(self: Box<Self>) -> Result<Vec<u32>> {
        Ok(self.0)
    }
}

impl GraphBackend for StandIn {
    fn serves(&self, device: &Device) -> bool {
        device.is_cpu()
    }
    fn begin(&self, _: &Device) -> Result<()> {
        candle_core::bail!("no captures in the stand-in")
    }
    fn end(&self, _: &Device) -> Result<Box<dyn DeviceGraph>> {
        candle_core::bail!("no captures in the stand-in")
    }
    fn greedy_ids(&self, logits: &Tensor) -> Result<Option<(Tensor, Box<dyn HostIds>)>> {
        let rows: Vec<Vec<f32>> = logits.to_vec2()?;
        let ids: Vec<u32> = rows.iter().map(|r| tessera_engine::argmax(r)).collect();
        self.picks.fetch_add(1, Ordering::SeqCst);
        let tensor = Tensor::from_vec(ids.clone(), (ids.len(), 1), logits.device())?;
        Ok(Some((tensor, Box::new(Ready(ids)))))
    }
}

fn request(prompt: Vec<u32>, max_tokens: usize, stop_tokens: Vec<u32>) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig::default(),
        stop_tokens,
        logprobs: None,
        stop_strings: Vec::new(),
    }
}

/// The stand-in, installed once for the process (the tests share it), and its count of
/// steps whose ids it chose.
fn stand_in() -> Arc<AtomicUsize> {
    static PICKS: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    PICKS
        .get_or_init(|| {
            let picks = Arc::new(AtomicUsize::new(0));
            install(Box::new(StandIn {
                picks: picks.clone(),
            }));
            picks
        })
        .clone()
}

/// `len` characters of the corpus from character `at`, encoded.
fn corpus_tokens(tok: &Tokenizer, at: usize, len: usize, bos: bool) -> Vec<u32> {
    let text: String = common::corpus().chars().skip(at).take(len).collect();
    tok.encode(&text, bos).unwrap()
}

/// Where `tokens` first holds a token it had not made before, from its seventh on: a stop
/// token that ends a request after several steps ran ahead.
fn first_made_late(tokens: &[u32]) -> usize {
    (6..tokens.len())
        .find(|&k| !tokens[..k].contains(&tokens[k]))
        .unwrap_or_else(|| panic!("no token first made late in {tokens:?}"))
}

#[test]
fn steps_run_ahead_on_chosen_ids_decode_what_each_request_decodes_alone() {
    let picks = stand_in();
    let (model, tok) = common::load_f32_weights();
    let scheme = KvScheme::parse("affine:4").unwrap();
    let prompts: Vec<Vec<u32>> = [(9000, 40), (500, 30), (31000, 220)]
        .iter()
        .map(|&(at, len)| corpus_tokens(&tok, at, len, true))
        .collect();
    let max_tokens = [30usize, 24, 20];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&max_tokens)
        .map(|(p, &m)| {
            let mut session = Session::new(&model, &scheme, 64).unwrap();
            common::decode_alone(&mut session, p, SamplerConfig::default(), m)
        })
        .collect();
    // Request 0, the first row, stops on a token it first makes at its seventh or later,
    // while all three run ahead: the last row then takes its place, and the chosen ids
    // must follow.
    let stop_at = first_made_late(&alone[0]);
    let stop = alone[0][stop_at];
    let requests = [
        request(prompts[0].clone(), max_tokens[0], vec![stop]),
        request(prompts[1].clone(), max_tokens[1], vec![]),
        request(prompts[2].clone(), max_tokens[2], vec![]),
    ];
    let join_at = [0, 0, 2];
    let mut batch = Batch::new(&model, &scheme, 64, BatchLimits::default())
        .unwrap()
        .with_steps_ahead(true);
    let (out, mut events, _) = common::run_batch(&mut batch, &requests, &join_at, None);
    assert!(batch.times().steps_ahead > 5, "{:?}", batch.times());
    assert!(
        picks.load(Ordering::SeqCst) > 5,
        "the stand-in chose the ids"
    );
    assert_eq!(
        out[0],
        alone[0][..stop_at],
        "request 0 up to its stop token"
    );
    assert_eq!(out[1], alone[1], "request 1");
    assert_eq!(out[2], alone[2], "request 2");
    for (i, want) in [
        (0, StopReason::EndToken),
        (1, StopReason::MaxTokens),
        (2, StopReason::MaxTokens),
    ] {
        match events[i].take() {
            Some(Event::Finished {
                reason,
                completion_tokens,
                ..
            }) => {
                assert_eq!(reason, want, "request {i}");
                assert_eq!(completion_tokens, out[i].len(), "request {i}");
            }
            other => panic!("request {i} ended with {other:?}"),
        }
    }
}

/// A generation (a one-row batch keeping its row, as `generate` and `chat` run) whose steps
/// run ahead: the same tokens as one that waits for them, ending on a stop token. The
/// session then holds that token fed (the step run ahead fed it) where the other holds the
/// sequence without it, so a session that waited is fed it too; from there a second turn
/// decodes the same tokens in both, as chat's next turn does.
#[test]
fn a_generation_keeping_its_row_runs_ahead_and_its_session_holds_what_it_fed() {
    let picks = stand_in();
    let (model, tok) = common::load_f32_weights();
    let scheme = KvScheme::parse("affine:4").unwrap();
    let first = corpus_tokens(&tok, 12000, 60, true);
    let second = corpus_tokens(&tok, 20000, 40, false);
    let alone = {
        let mut session = Session::new(&model, &scheme, 64).unwrap();
        common::decode_alone(&mut session, &first, SamplerConfig::default(), 30)
    };
    let stop_at = first_made_late(&alone);
    let stop = alone[stop_at];

    let mut turns: Vec<(Vec<u32>, Vec<u32>, Vec<u32>)> = Vec::new();
    for ahead in [false, true] {
        let before = picks.load(Ordering::SeqCst);
        let mut session = Session::new(&model, &scheme, 64).unwrap();
        let mut gen = Generation::new(
            &mut session,
            &first,
            SamplerConfig::default(),
            30,
            vec![stop],
        )
        .unwrap();
        gen.set_steps_ahead(ahead);
        let out: Vec<u32> = gen.by_ref().map(|t| t.unwrap()).collect();
        assert_eq!(
            gen.stop_reason(),
            Some(StopReason::EndToken),
            "ahead {ahead}"
        );
        assert_eq!(gen.stop_token(), Some(stop), "ahead {ahead}");
        let ran_ahead = gen.steps_ahead();
        drop(gen);
        if ahead {
            assert!(ran_ahead > 3, "{ran_ahead} steps ran ahead");
            assert!(
                picks.load(Ordering::SeqCst) > before,
                "the stand-in chose the ids"
            );
        } else {
            assert_eq!(ran_ahead, 0);
            // The stop token, fed as the step run ahead fed it.
            session.feed(&[stop]).unwrap();
        }
        let held = session.tokens().to_vec();
        assert_eq!(
            session.cache().offsets(),
            vec![held.len()],
            "ahead {ahead}: the cache holds the session's tokens"
        );
        let mut gen =
            Generation::new(&mut session, &second, SamplerConfig::default(), 12, vec![]).unwrap();
        gen.set_steps_ahead(ahead);
        let next: Vec<u32> = gen.by_ref().map(|t| t.unwrap()).collect();
        assert_eq!(
            gen.stop_reason(),
            Some(StopReason::MaxTokens),
            "ahead {ahead}"
        );
        drop(gen);
        assert_eq!(session.tokens().len(), held.len() + second.len() + 11);
        turns.push((out, held, next));
    }
    assert_eq!(
        turns[0].0,
        alone[..stop_at],
        "waiting: the first turn up to its stop"
    );
    assert_eq!(turns[1].0, turns[0].0, "the first turn's tokens");
    assert_eq!(turns[1].1, turns[0].1, "the sessions after the first turn");
    assert_eq!(
        turns[1].1.last(),
        Some(&stop),
        "the session holds the stop token"
    );
    assert_eq!(turns[1].2, turns[0].2, "the second turn's tokens");
}
