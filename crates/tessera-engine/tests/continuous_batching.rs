//! Continuous batching on the real model: requests of different prompt lengths join a
//! running batch at different steps (prompts read in bounded chunks between decode steps),
//! leave it when they finish or are cancelled, and each one's tokens equal the same request
//! run alone through a `Session` — for bf16, affine:4 and turbo:4 caches. Weights are
//! dequantized to f32 (as in cache_paths.rs) so that batch shapes cannot change a sum.

mod common;

use std::collections::HashMap;
use tessera_engine::{
    Batch, BatchLimits, EngineError, Event, GenerationRequest, RequestId, SamplerConfig, Session,
    StopReason, PREFIX_CHECKPOINT,
};
use tessera_kv::KvScheme;
use tessera_models::Model;

const CHUNK: usize = 64;

fn prompts(tok: &tessera_models::Tokenizer) -> Vec<Vec<u32>> {
    let corpus = common::corpus();
    let chars: Vec<char> = corpus.chars().collect();
    // Lengths from a handful of tokens to past the 512-position sliding window.
    [
        (500, 30),
        (4000, 400),
        (9000, 12),
        (20000, 2700),
        (31000, 220),
        (45000, 90),
    ]
    .iter()
    .map(|&(at, len)| {
        tok.encode(&chars[at..at + len].iter().collect::<String>(), true)
            .unwrap()
    })
    .collect()
}

fn alone(
    model: &Model,
    scheme: &KvScheme,
    prompt: &[u32],
    max_tokens: usize,
    sampler: SamplerConfig,
) -> Vec<u32> {
    let mut session = Session::new(model, scheme, CHUNK).unwrap();
    common::decode_alone(&mut session, prompt, sampler, max_tokens)
}

/// Runs `requests` (added at the step of their index in `join_at`) through one batch;
/// returns each request's tokens and finish event, and the most rows ever running.
fn batched(
    model: &Model,
    scheme: &KvScheme,
    requests: &[GenerationRequest],
    join_at: &[usize],
    limits: BatchLimits,
    cancel: Option<(usize, usize)>,
) -> (Vec<Vec<u32>>, Vec<Option<Event>>, usize) {
    let mut batch = Batch::new(model, scheme, CHUNK, limits).unwrap();
    common::run_batch(&mut batch, requests, join_at, cancel)
}

/// Greedy requests for `prompts`, but the third samples (seeded with `seed`).
fn requests_sampling_third(
    prompts: &[Vec<u32>],
    max_tokens: &[usize],
    seed: u64,
) -> Vec<GenerationRequest> {
    prompts
        .iter()
        .zip(max_tokens)
        .enumerate()
        .map(|(i, (p, &m))| GenerationRequest {
            prompt: p.clone(),
            max_tokens: m,
            sampler: if i == 2 {
                SamplerConfig {
                    temperature: 0.9,
                    top_k: Some(40),
                    seed,
                    ..SamplerConfig::default()
                }
            } else {
                SamplerConfig::default()
            },
            stop_tokens: vec![],
            logprobs: None,
            stop_strings: Vec::new(),
        })
        .collect()
}

#[test]
fn requests_joining_and_leaving_equal_each_run_alone() {
    let (model, tok) = common::load_f32_weights();
    let prompts = prompts(&tok);
    assert!(prompts[3].len() > 512, "one prompt wraps the sliding rings");
    let max_tokens = [9, 4, 12, 6, 1, 8];
    let join_at = [0, 0, 2, 3, 9, 14];
    for kv in ["bf16", "affine:4", "turbo:4"] {
        let scheme = KvScheme::parse(kv).unwrap();
        // One request samples (seeded): its draws must not depend on its neighbours.
        let requests = requests_sampling_third(&prompts, &max_tokens, 7);
        let limits = BatchLimits {
            max_batch: 3,
            kv_budget: None,
            max_queue: 8,
        };
        let (out, events, most) = batched(&model, &scheme, &requests, &join_at, limits, None);
        assert!(most <= 3, "{kv}: {most} rows ran at once, the limit is 3");
        assert!(most >= 2, "{kv}: rows never ran together");
        for (i, r) in requests.iter().enumerate() {
            let want = alone(&model, &scheme, &r.prompt, r.max_tokens, r.sampler.clone());
            assert_eq!(
                out[i],
                want,
                "{kv}: request {i} ({} prompt tokens)",
                r.prompt.len()
            );
            assert_eq!(
                events[i],
                Some(Event::Finished {
                    id: match events[i] {
                        Some(Event::Finished { id, .. }) => id,
                        _ => unreachable!("checked by the equality"),
                    },
                    reason: StopReason::MaxTokens,
                    stop_token: None,
                    prompt_tokens: r.prompt.len(),
                    completion_tokens: r.max_tokens,
                    cached_tokens: 0,
                    text: String::new(),
                }),
                "{kv}: request {i}"
            );
        }
    }
}

#[test]
fn a_cancelled_request_leaves_and_the_others_go_on() {
    let (model, tok) = common::load_f32_weights();
    let prompts = prompts(&tok);
    let scheme = KvScheme::parse("affine:4").unwrap();
    let requests: Vec<GenerationRequest> = [0usize, 2, 5]
        .iter()
        .map(|&i| GenerationRequest {
            prompt: prompts[i].clone(),
            max_tokens: 10,
            sampler: SamplerConfig::default(),
            stop_tokens: vec![],
            logprobs: None,
            stop_strings: Vec::new(),
        })
        .collect();
    // Request 1 is cancelled once all three decode together.
    let (out, events, _) = batched(
        &model,
        &scheme,
        &requests,
        &[0, 0, 0],
        BatchLimits::default(),
        Some((1, 5)),
    );
    assert!(
        events[1].is_none(),
        "a cancelled request has no finish event"
    );
    assert!(
        out[1].len() < 10,
        "it stopped early ({} tokens)",
        out[1].len()
    );
    for i in [0, 2] {
        let want = alone(
            &model,
            &scheme,
            &requests[i].prompt,
            10,
            SamplerConfig::default(),
        );
        assert_eq!(out[i], want, "request {i} after its neighbour left");
    }
    // The cancelled one's tokens so far are the start of its own run.
    let want = alone(
        &model,
        &scheme,
        &requests[1].prompt,
        10,
        SamplerConfig::default(),
    );
    assert_eq!(out[1][..], want[..out[1].len()]);
}

/// Steps run ahead of their tokens (`Batch::with_steps_ahead`, on by default on a GPU; here
/// forced on the CPU, where the host picks the tokens): requests that join at different
/// steps (so steps run ahead stop and start again), end on `max_tokens`, on a stop token
/// and by cancellation, each decode what it decodes alone, and finish as it does.
#[test]
fn steps_run_ahead_decode_what_each_request_decodes_alone() {
    let (model, tok) = common::load_f32_weights();
    let prompts = prompts(&tok);
    let scheme = KvScheme::parse("affine:4").unwrap();
    let picked = [0usize, 2, 4, 5];
    let max_tokens = [9usize, 12, 7, 10];
    let alone_runs: Vec<Vec<u32>> = picked
        .iter()
        .zip(&max_tokens)
        .map(|(&p, &m)| alone(&model, &scheme, &prompts[p], m, SamplerConfig::default()))
        .collect();
    // Request 1 stops on its fifth token (its first occurrence ends it).
    let stop = alone_runs[1][4];
    let stop_at = alone_runs[1].iter().position(|&t| t == stop).unwrap();
    let requests: Vec<GenerationRequest> = picked
        .iter()
        .zip(&max_tokens)
        .enumerate()
        .map(|(i, (&p, &m))| GenerationRequest {
            prompt: prompts[p].clone(),
            max_tokens: m,
            sampler: SamplerConfig::default(),
            stop_tokens: if i == 1 { vec![stop] } else { vec![] },
            logprobs: None,
            stop_strings: Vec::new(),
        })
        .collect();
    let mut batch = Batch::new(&model, &scheme, CHUNK, BatchLimits::default())
        .unwrap()
        .with_steps_ahead(true);
    // Request 3 joins late and is cancelled some steps after.
    let join_at = [0, 0, 3, 8];
    let (out, events, most) = common::run_batch(&mut batch, &requests, &join_at, Some((3, 8 + 5)));
    let ran_ahead = batch.times().steps_ahead;
    assert!(most >= 3, "rows ran together ({most})");
    assert!(ran_ahead > 5, "steps ran ahead ({ran_ahead})");
    for i in [0, 2] {
        assert_eq!(out[i], alone_runs[i], "request {i}");
        assert!(
            matches!(events[i], Some(Event::Finished { reason: StopReason::MaxTokens, completion_tokens, .. }) if completion_tokens == max_tokens[i]),
            "request {i}: {:?}",
            events[i]
        );
    }
    assert_eq!(
        out[1],
        alone_runs[1][..stop_at],
        "request 1 up to its stop token"
    );
    assert!(
        matches!(events[1], Some(Event::Finished { reason: StopReason::EndToken, stop_token: Some(t), completion_tokens, .. }) if t == stop && completion_tokens == stop_at),
        "request 1: {:?}",
        events[1]
    );
    assert!(
        events[3].is_none(),
        "a cancelled request has no finish event"
    );
    assert!(
        !out[3].is_empty() && out[3].len() < max_tokens[3],
        "{:?}",
        out[3]
    );
    assert_eq!(
        out[3][..],
        alone_runs[3][..out[3].len()],
        "request 3 until cancelled"
    );
}

#[test]
fn admission_limits_queue_context_and_kv_budget() {
    let (model, tok) = common::load(false);
    let prompts = prompts(&tok);
    let scheme = KvScheme::parse("bf16").unwrap();
    let request = |p: &Vec<u32>, max_tokens| GenerationRequest {
        prompt: p.clone(),
        max_tokens,
        sampler: SamplerConfig::default(),
        stop_tokens: vec![],
        logprobs: None,
        stop_strings: Vec::new(),
    };
    // The queue: the third waiting request is refused, nothing else changes.
    let limits = BatchLimits {
        max_batch: 1,
        kv_budget: None,
        max_queue: 2,
    };
    let mut batch = Batch::new(&model, &scheme, CHUNK, limits).unwrap();
    batch.add(request(&prompts[0], 2)).unwrap();
    batch.add(request(&prompts[2], 2)).unwrap();
    match batch.add(request(&prompts[1], 2)) {
        Err(EngineError::QueueFull { limit: 2 }) => {}
        other => panic!("a full queue: {other:?}"),
    }
    assert_eq!(batch.waiting(), 2);
    // Past the context: both counts named.
    let context = model.context_length();
    match batch.add(request(&prompts[0], context)) {
        Err(EngineError::PromptTooLong { prompt, context: c }) => {
            assert_eq!((prompt, c), (prompts[0].len() + context, context))
        }
        other => panic!("past the context: {other:?}"),
    }
    assert!(matches!(
        batch.add(request(&vec![], 2)),
        Err(EngineError::EmptyPrompt)
    ));
    assert!(matches!(
        batch.add(request(&vec![u32::MAX], 2)),
        Err(EngineError::Field {
            field: "prompt",
            ..
        })
    ));
    // The KV budget: room for the two shorter requests' whole growth, not for a third.
    let need = |p: &Vec<u32>, m: usize| batch.kv_bytes_for(p.len() + m);
    let budget = need(&prompts[0], 4) + need(&prompts[2], 4) + need(&prompts[5], 4) / 2;
    let limits = BatchLimits {
        max_batch: 8,
        kv_budget: Some(budget),
        max_queue: 8,
    };
    let mut batch = Batch::new(&model, &scheme, CHUNK, limits).unwrap();
    for i in [0, 2, 5] {
        batch.add(request(&prompts[i], 4)).unwrap();
    }
    let too_big = GenerationRequest {
        max_tokens: context - prompts[0].len(),
        ..request(&prompts[0], 0)
    };
    if batch.kv_bytes_for(context) > budget {
        assert!(matches!(batch.add(too_big), Err(EngineError::Invalid(_))));
    }
    let mut finished = 0;
    let mut steps = 0;
    while !batch.is_idle() {
        assert!(batch.kv_bytes_reserved() <= budget, "over the budget");
        assert!(
            batch.running() <= 2,
            "a third row was admitted past the budget"
        );
        for event in batch.step().unwrap() {
            finished += matches!(event, Event::Finished { .. }) as usize;
        }
        steps += 1;
        assert!(steps < 500);
    }
    assert_eq!(finished, 3, "the third request ran once a row left");
}

/// Runs `request` alone through `batch` to its end: its tokens and finish event.
fn serve_one(batch: &mut Batch, request: GenerationRequest) -> (Vec<u32>, Event) {
    let id = batch.add(request).unwrap();
    let mut tokens = Vec::new();
    let mut finished = None;
    while !batch.is_idle() {
        for event in batch.step().unwrap() {
            match event {
                Event::Token { id: i, token, .. } if i == id => tokens.push(token),
                Event::Finished { id: i, .. } if i == id => finished = Some(event),
                _ => {}
            }
        }
    }
    (tokens, finished.expect("a finish event"))
}

fn cached(event: &Event) -> usize {
    match event {
        Event::Finished { cached_tokens, .. } => *cached_tokens,
        Event::Token { .. } | Event::Failed { .. } => unreachable!("a finish event"),
    }
}

/// A finished request's row is kept and a later request sharing its prefix reads only the
/// rest: `cached_tokens` says how much, and the greedy tokens equal the request run alone
/// with the same prefill chunks (chunk boundaries change f32 sums in the last bits, which can
/// flip a greedy near-tie, so each reference replays the chunks the batch ran). On Gemma 3 a
/// row whose sliding rings have wrapped is reused only whole (a conversation continuing),
/// never cut back to a shorter shared prefix; the checkpoint a long prompt leaves
/// PREFIX_CHECKPOINT tokens before its end serves a prompt parting from it after that.
#[test]
fn prefix_reuse_reads_only_the_new_suffix() {
    let (model, tok) = common::load_f32_weights();
    let prompts = prompts(&tok);
    let scheme = KvScheme::parse("bf16").unwrap();
    let request = |prompt: Vec<u32>, max_tokens| GenerationRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig::default(),
        stop_tokens: vec![],
        logprobs: None,
        stop_strings: Vec::new(),
    };
    let store = || {
        Batch::new(&model, &scheme, CHUNK, BatchLimits::default())
            .unwrap()
            .with_prefix_cache(256 << 20)
    };
    // A shared "system prompt" of four whole chunks, two different questions.
    let mut batch = store();
    let system = prompts[3][..4 * CHUNK].to_vec();
    let first: Vec<u32> = system.iter().chain(&prompts[2][1..]).copied().collect();
    let second: Vec<u32> = system.iter().chain(&prompts[0][1..]).copied().collect();
    assert_ne!(
        first[4 * CHUNK],
        second[4 * CHUNK],
        "the questions differ at once"
    );
    let (_, done) = serve_one(&mut batch, request(first.clone(), 6));
    assert_eq!(cached(&done), 0, "nothing stored yet");
    let (got, done) = serve_one(&mut batch, request(second.clone(), 6));
    assert_eq!(cached(&done), 4 * CHUNK, "the shared prefix is reused");
    assert_eq!(
        got,
        alone(&model, &scheme, &second, 6, SamplerConfig::default())
    );
    assert_eq!(batch.prefix_cache().unwrap().hits(), (1, 4 * CHUNK as u64));
    // A conversation past the 512-position window: the whole previous exchange is reused.
    let mut batch = store();
    let long = prompts[3].clone();
    let (answer, _) = serve_one(&mut batch, request(long.clone(), 5));
    let follow_up: Vec<u32> = long
        .iter()
        .chain(&answer)
        .chain(&prompts[2][1..])
        .copied()
        .collect();
    let (got, done) = serve_one(&mut batch, request(follow_up.clone(), 5));
    let fed = long.len() + answer.len() - 1;
    assert_eq!(cached(&done), fed, "the exchange's fed tokens");
    let mut session = Session::new(&model, &scheme, CHUNK).unwrap();
    session.feed(&long).unwrap();
    for &t in &answer[..answer.len() - 1] {
        session.feed(&[t]).unwrap();
    }
    let want = common::decode_alone(&mut session, &follow_up[fed..], SamplerConfig::default(), 5);
    assert_eq!(got, want, "the follow-up");
    // Sharing only the long prompt's first half: its wrapped rings cannot be cut back there.
    let half: Vec<u32> = long[..long.len() / 2]
        .iter()
        .chain(&prompts[0][1..])
        .copied()
        .collect();
    let (got, done) = serve_one(&mut batch, request(half.clone(), 5));
    assert_eq!(
        cached(&done),
        0,
        "a wrapped ring gives no shorter prefix back"
    );
    assert_eq!(
        got,
        alone(&model, &scheme, &half, 5, SamplerConfig::default())
    );
    assert_eq!(batch.prefix_cache().unwrap().hits(), (1, fed as u64));
    // Another ending within the last PREFIX_CHECKPOINT tokens (the same document, another
    // question): the checkpoint the long prompt left gives all but those tokens back.
    let keep = long.len() - PREFIX_CHECKPOINT;
    let other: Vec<u32> = long[..long.len() - 20]
        .iter()
        .chain(&prompts[0][1..])
        .copied()
        .collect();
    let (got, done) = serve_one(&mut batch, request(other.clone(), 5));
    assert_eq!(cached(&done), keep, "the checkpoint's tokens");
    let mut session = Session::new(&model, &scheme, CHUNK).unwrap();
    session.feed(&long[..keep]).unwrap();
    let want = common::decode_alone(&mut session, &other[keep..], SamplerConfig::default(), 5);
    assert_eq!(got, want, "another question after the same document");
}

/// Runs `request` alone through `batch` to its end: its tokens, the text its events carried
/// (each token's, then the finish event's) and its finish event.
fn serve_text(batch: &mut Batch, request: GenerationRequest) -> (Vec<u32>, String, Event) {
    let id = batch.add(request).unwrap();
    let (mut tokens, mut text, mut finished) = (Vec::new(), String::new(), None);
    while !batch.is_idle() {
        for event in batch.step().unwrap() {
            match &event {
                Event::Token {
                    id: i,
                    token,
                    text: t,
                    ..
                } if *i == id => {
                    tokens.push(*token);
                    text.push_str(t);
                }
                Event::Finished { id: i, text: t, .. } if *i == id => {
                    text.push_str(t);
                    finished = Some(event.clone());
                }
                Event::Failed { message, .. } => panic!("a request failed: {message}"),
                _ => {}
            }
        }
    }
    (tokens, text, finished.expect("a finish event"))
}

/// Stop strings live in the batch: the text it releases is the tokenizer's decoding of the
/// tokens, cut where the first stop string begins; the request ends at the token that
/// completes it (`StopReason::StopString`), leaves the batch like any finished row, and
/// still reports the prefix it reused. The reference is the tokenizer's own decode of the
/// tokens and `str::find`, not the batch's incremental text.
#[test]
fn stop_strings_end_a_request_which_reports_its_reused_prefix() {
    let (model, tok) = common::load(false);
    let scheme = KvScheme::parse("bf16").unwrap();
    let prompt = prompts(&tok)[1].clone();
    let request = |stop_strings: Vec<String>| GenerationRequest {
        prompt: prompt.clone(),
        max_tokens: 40,
        sampler: SamplerConfig::default(),
        stop_tokens: vec![],
        logprobs: None,
        stop_strings,
    };
    // Without a tokenizer a batch cannot match text: refused, not ignored.
    let mut plain = Batch::new(&model, &scheme, CHUNK, BatchLimits::default()).unwrap();
    assert!(matches!(
        plain.add(request(vec!["e".into()])),
        Err(EngineError::Invalid(_))
    ));
    let mut batch = Batch::new(&model, &scheme, CHUNK, BatchLimits::default())
        .unwrap()
        .with_tokenizer(&tok)
        .with_prefix_cache(64 << 20);
    // No stop strings: the released text is the whole decoding.
    let (tokens, text, end) = serve_text(&mut batch, request(vec![]));
    assert_eq!(text, tok.decode(&tokens).unwrap());
    assert!(matches!(
        end,
        Event::Finished {
            reason: StopReason::MaxTokens,
            ..
        }
    ));
    // Stop strings common enough in 40 tokens of English to be met; the earliest wins.
    let stops = vec!["the".to_string(), "e".to_string(), "\n\n".to_string()];
    let (tokens, text, end) = serve_text(&mut batch, request(stops.clone()));
    let decoded = tok.decode(&tokens).unwrap();
    let at = stops
        .iter()
        .filter_map(|s| decoded.find(s.as_str()))
        .min()
        .expect("a stop string in the output");
    assert_eq!(text, decoded[..at], "the text before the stop string");
    let before = tok.decode(&tokens[..tokens.len() - 1]).unwrap();
    assert!(
        stops.iter().all(|s| !before.contains(s.as_str())),
        "the request ended at the token that completed the stop string"
    );
    match end {
        Event::Finished {
            reason,
            completion_tokens,
            cached_tokens,
            ..
        } => {
            assert_eq!(reason, StopReason::StopString);
            assert_eq!(completion_tokens, tokens.len());
            assert!(cached_tokens > 0, "the first request's row was reused");
        }
        other => panic!("a finish event: {other:?}"),
    }
    assert_eq!(batch.running(), 0, "the row left the batch");
}

#[test]
fn waiting_short_prompts_are_read_in_one_forward_and_equal_each_run_alone() {
    let (model, tok) = common::load_f32_weights();
    let corpus: Vec<char> = common::corpus().chars().collect();
    let prompts: Vec<Vec<u32>> = [(100, 40), (7000, 25), (12000, 48), (16000, 35), (26000, 50)]
        .iter()
        .map(|&(at, len)| {
            tok.encode(&corpus[at..at + len].iter().collect::<String>(), true)
                .unwrap()
        })
        .collect();
    let widest = prompts[..4].iter().map(Vec::len).max().unwrap();
    assert!(
        4 * widest <= CHUNK,
        "the first four fit one chunk padded ({widest} wide)"
    );
    assert!(
        prompts[..4].iter().any(|p| p.len() != widest),
        "some rows are padded"
    );
    // Request 1 ends at its first token (it leaves from the group); request 2 samples.
    let max_tokens = [7, 1, 9, 5, 6];
    for kv in ["bf16", "affine:4", "turbo:4"] {
        let scheme = KvScheme::parse(kv).unwrap();
        let requests = requests_sampling_third(&prompts, &max_tokens, 11);
        let limits = BatchLimits {
            max_batch: 4,
            kv_budget: None,
            max_queue: 8,
        };
        let mut batch = Batch::new(&model, &scheme, CHUNK, limits).unwrap();
        let ids: Vec<RequestId> = requests
            .iter()
            .map(|r| batch.add(r.clone()).unwrap())
            .collect();
        let mut tokens: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut steps = 0;
        while !batch.is_idle() {
            for event in batch.step().unwrap() {
                match event {
                    Event::Token { id, token, .. } => tokens.entry(id).or_default().push(token),
                    Event::Failed { message, .. } => panic!("{kv}: a request failed: {message}"),
                    Event::Finished { .. } => {}
                }
            }
            if steps == 0 {
                // The first step read the four admitted prompts in one forward; the fifth
                // waits for a row.
                assert_eq!(batch.times().prefill_forwards, 1, "{kv}");
                assert_eq!(batch.running(), 3, "{kv}: request 1 already finished");
                assert_eq!(batch.waiting(), 1, "{kv}");
            }
            steps += 1;
            assert!(steps < 200, "{kv}: the batch does not finish");
        }
        for (i, r) in requests.iter().enumerate() {
            let want = alone(&model, &scheme, &r.prompt, r.max_tokens, r.sampler.clone());
            assert_eq!(tokens[&ids[i]], want, "{kv}: request {i}");
        }
    }
}

/// A short prompt that extends a stored row is read from the stored prefix (not grouped
/// with anything, as nothing else waits) and the store counts the reuse once.
#[test]
fn a_short_prompt_reusing_a_stored_prefix_is_counted_once() {
    let (model, tok) = common::load_f32_weights();
    let prompts = prompts(&tok);
    let scheme = KvScheme::parse("bf16").unwrap();
    let request = |prompt: Vec<u32>| GenerationRequest {
        prompt,
        max_tokens: 3,
        sampler: SamplerConfig::default(),
        stop_tokens: vec![],
        logprobs: None,
        stop_strings: Vec::new(),
    };
    let mut batch = Batch::new(&model, &scheme, CHUNK, BatchLimits::default())
        .unwrap()
        .with_prefix_cache(64 << 20);
    let first = prompts[0].clone();
    let second: Vec<u32> = first.iter().chain(&prompts[2][1..]).copied().collect();
    assert!(second.len() <= CHUNK, "both prompts are short");
    serve_one(&mut batch, request(first.clone()));
    let (got, done) = serve_one(&mut batch, request(second.clone()));
    let reused = cached(&done);
    assert!(
        reused >= first.len() - 1,
        "the first prompt's row is reused ({reused})"
    );
    assert_eq!(batch.prefix_cache().unwrap().hits(), (1, reused as u64));
    // The reference reads the same chunks: the reused prefix, then the rest.
    let mut session = Session::new(&model, &scheme, CHUNK).unwrap();
    session.feed(&second[..reused]).unwrap();
    let want = common::decode_alone(&mut session, &second[reused..], SamplerConfig::default(), 3);
    assert_eq!(got, want);
}
