//! The determinism check both test binaries run: tessera-engine's on the CPU (real models,
//! every ISA level) and tessera-kernels' on a GPU in deterministic mode (synthetic models).
//! A greedy generation gives the logits of the plain one-row run, bit for bit, however its
//! prompt is chunked (1, 7, 64, 512), beside 15 random neighbours of a continuous batch
//! (some sampling, some left-padded in a group read), with n-gram speculation, with a draft
//! model, from a warm prompt cache, from a prefix-store hit, and with steps ahead on and
//! off. Session runs compare every logit; batch runs compare each token's log-probability
//! and its 20 most likely alternatives (functions of every logit, through the softmax's
//! normalizer) with those of the session's logits.
//!
//! The prompt should be longer than the bf16-first transition's first append
//! ([`tessera_kv::FIRST_APPEND`]), so the chunk sizes differ after it.

use tessera_engine::prompt_cache::PromptCache;
use tessera_engine::{
    Batch, BatchLimits, BatchSpec, Event, Generation, GenerationRequest, SamplerConfig, Session,
    TokenLogprobs,
};
use tessera_kv::KvScheme;
use tessera_models::Model;

/// Generated tokens compared per run.
pub const GENERATE: usize = 8;

pub fn schemes() -> Vec<(&'static str, KvScheme)> {
    let mix = r#"{"default": "turbo:4", "sliding": "affine:4",
                  "layers": [{"layer": 0, "scheme": "bf16"}, {"layer": 3, "scheme": "affine:8"}]}"#;
    vec![
        ("bf16", KvScheme::parse("bf16").unwrap()),
        ("affine:4", KvScheme::parse("affine:4").unwrap()),
        ("turbo:4", KvScheme::parse("turbo:4").unwrap()),
        ("mix", KvScheme::from_config_json(mix).unwrap()),
    ]
}

pub fn greedy() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.0,
        ..Default::default()
    }
}

/// Greedy decoding in a session of `chunk`: the tokens and every generated position's
/// logits as bits (the prompt's last position first).
pub fn session_run(session: &mut Session, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<u32>>) {
    let bits = |l: &[f32]| l.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut logits = session.feed(prompt).unwrap();
    let (mut tokens, mut all) = (Vec::new(), vec![bits(&logits)]);
    while tokens.len() < GENERATE {
        let t = tessera_engine::argmax(&logits);
        tokens.push(t);
        if tokens.len() < GENERATE {
            logits = session.feed(&[t]).unwrap();
            all.push(bits(&logits));
        }
    }
    (tokens, all)
}

pub fn bit_equal(a: &[(u32, f32)], b: &[(u32, f32)]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.0 == y.0 && x.1.to_bits() == y.1.to_bits())
}

pub fn first_difference(got: &[Vec<u32>], want: &[Vec<u32>]) -> Option<usize> {
    got.iter().zip(want).position(|(g, w)| g != w)
}

pub fn request(prompt: Vec<u32>, sampler: SamplerConfig, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_tokens,
        sampler,
        stop_tokens: Vec::new(),
        stop_strings: Vec::new(),
        logprobs: Some(20),
    }
}

/// Runs `requests` (added at their steps) to the end; the first request's tokens and
/// log-probabilities, and its finish event.
pub fn batch_run(
    batch: &mut Batch,
    requests: &[(GenerationRequest, usize)],
) -> (Vec<u32>, Vec<TokenLogprobs>, Event) {
    let mut ids = vec![None; requests.len()];
    let (mut tokens, mut logprobs, mut finished) = (Vec::new(), Vec::new(), None);
    let mut step = 0;
    loop {
        for (i, (r, at)) in requests.iter().enumerate() {
            if *at == step {
                ids[i] = Some(batch.add(r.clone()).unwrap());
            }
        }
        if batch.is_idle() && requests.iter().all(|(_, at)| *at < step) {
            break;
        }
        for event in batch.step().unwrap() {
            match &event {
                Event::Token {
                    id,
                    token,
                    logprobs: l,
                    ..
                } if Some(*id) == ids[0] => {
                    tokens.push(*token);
                    logprobs.extend(l.clone());
                }
                Event::Finished { id, .. } if Some(*id) == ids[0] => finished = Some(event),
                Event::Failed { message, .. } => panic!("a request failed: {message}"),
                _ => {}
            }
        }
        step += 1;
        assert!(step < 3000, "the batch does not finish");
    }
    (tokens, logprobs, finished.unwrap())
}

/// 15 neighbours: random prompts (3 to 60 tokens, some short enough to be read together,
/// left-padded) and lengths, greedy or sampled, joining at random steps.
pub fn neighbours(ids: &[u32], seed: u64) -> Vec<(GenerationRequest, usize)> {
    assert!(ids.len() > 20_080, "a pool of {} tokens", ids.len());
    let mut state = seed;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    (0..15)
        .map(|i| {
            let len = 3 + next(58) as usize;
            let from = 1 + next(20_000) as usize;
            let sampler = if i % 3 == 0 {
                SamplerConfig {
                    temperature: 0.9,
                    top_p: Some(0.95),
                    seed: next(1000),
                    ..Default::default()
                }
            } else {
                greedy()
            };
            let r = request(
                ids[from..from + len].to_vec(),
                sampler,
                1 + next(20) as usize,
            );
            (r, next(6) as usize)
        })
        .collect()
}

/// Which runs a check makes.
#[derive(Clone, Copy, PartialEq)]
pub enum Runs {
    /// Every run.
    All,
    /// The kernels' runs: the chunkings, alone in a batch and beside 15 neighbours (what
    /// another level's arithmetic can change; the other paths re-read the same kernels).
    Kernels,
}

pub fn check_model(
    model: &Model,
    name: &str,
    prompt: &[u32],
    pool: &[u32],
    schemes: &[(&str, KvScheme)],
    runs: Runs,
) {
    let prompt = prompt.to_vec();
    let limits = BatchLimits {
        max_batch: 16,
        ..Default::default()
    };
    for (kv, scheme) in schemes {
        let what = |run: &str| format!("{name}, {kv}: {run}");
        let mut plain = Session::new(model, &scheme, 512).unwrap();
        let (tokens, logits) = session_run(&mut plain, &prompt);
        for chunk in [1, 7, 64] {
            let mut s = Session::new(model, &scheme, chunk).unwrap();
            let (t, l) = session_run(&mut s, &prompt);
            if let Some(p) = first_difference(&l, &logits) {
                panic!(
                    "{}: generated position {p}'s logits differ",
                    what(&format!("prefill chunks of {chunk}"))
                );
            }
            assert_eq!(t, tokens);
        }
        if runs == Runs::All {
            // A warm prompt cache of the prompt's first 540 tokens.
            let mut warm = Session::new(model, &scheme, 512).unwrap();
            warm.feed(&prompt[..540]).unwrap();
            let cached = PromptCache {
                scheme: scheme.clone(),
                tokens: vec![warm.tokens().to_vec()],
                cache: warm.cache().extract(0).unwrap(),
            };
            let (mut resumed, reuse) = cached.resume(model, &scheme, &prompt, 512).unwrap();
            assert_eq!(reuse.tokens, 540, "{}", what("the prompt cache is reused"));
            let rest = &prompt[reuse.tokens..];
            let (t, l) = session_run(&mut resumed, rest);
            if let Some(p) = first_difference(&l, &logits) {
                panic!(
                    "{}: generated position {p}'s logits differ",
                    what("warm prompt cache")
                );
            }
            assert_eq!(t, tokens);

            // Speculation over a session: n-gram drafts and a draft model (the model itself).
            let mut s = Session::new(model, &scheme, 512)
                .unwrap()
                .with_round_slack(4);
            let ngram = Some(BatchSpec::ngram(3, 4));
            let spec =
                Generation::with_spec(&mut s, &prompt, greedy(), GENERATE, vec![], ngram).unwrap();
            let t: Vec<u32> = spec.map(|t| t.unwrap()).collect();
            assert_eq!(t, tokens, "{}", what("n-gram speculation"));
            {
                let mut s = Session::new(model, &scheme, 512)
                    .unwrap()
                    .with_round_slack(4);
                let drafter = Some(BatchSpec::model(model, 4));
                let spec =
                    Generation::with_spec(&mut s, &prompt, greedy(), GENERATE, vec![], drafter)
                        .unwrap();
                let t: Vec<u32> = spec.map(|t| t.unwrap()).collect();
                assert_eq!(t, tokens, "{}", what("a draft model"));
            }
        }

        // The request alone in a batch: the session's tokens, and the log-probabilities every
        // other batch run is held to.
        let ours = request(prompt.clone(), greedy(), GENERATE);
        let mut batch = Batch::new(model, &scheme, 512, limits).unwrap();
        let (t, alone, _) = batch_run(&mut batch, &[(ours.clone(), 0)]);
        assert_eq!(t, tokens, "{}", what("alone in a batch"));
        // ... whose log-probabilities are those of the session's logits.
        for (p, (got, want)) in alone.iter().zip(&logits).enumerate() {
            let want: Vec<f32> = want.iter().map(|&b| f32::from_bits(b)).collect();
            let want = TokenLogprobs::new(&want, tokens[p], 20);
            assert!(
                got.logprob.to_bits() == want.logprob.to_bits() && bit_equal(&got.top, &want.top),
                "{}: generated position {p}'s log-probabilities differ from the session's",
                what("alone in a batch")
            );
        }
        let same = |got: &[TokenLogprobs], run: &str| {
            if let Some(p) = got.iter().zip(&alone).position(|(g, w)| {
                g.logprob.to_bits() != w.logprob.to_bits() || !bit_equal(&g.top, &w.top)
            }) {
                panic!(
                    "{}: generated position {p}'s log-probabilities differ",
                    what(run)
                );
            }
            assert_eq!(got.len(), alone.len(), "{}", what(run));
        };
        // Beside 15 random neighbours, with small prefill chunks.
        let mut crowd = vec![(ours.clone(), 2)];
        crowd.extend(neighbours(pool, 17));
        let mut batch = Batch::new(model, &scheme, 64, limits).unwrap();
        let (_, got, _) = batch_run(&mut batch, &crowd);
        same(&got, "beside 15 neighbours");
        if runs == Runs::Kernels {
            continue;
        }
        // Steps ahead (they run only while no row asks for log-probabilities: greedy rows,
        // tokens compared).
        let quiet: Vec<(GenerationRequest, usize)> = crowd
            .iter()
            .map(|(r, at)| {
                let mut r = r.clone();
                r.logprobs = None;
                r.sampler = greedy();
                (r, *at)
            })
            .collect();
        for ahead in [false, true] {
            let mut batch = Batch::new(model, &scheme, 64, limits)
                .unwrap()
                .with_steps_ahead(ahead);
            let (t, _, _) = batch_run(&mut batch, &quiet);
            assert_eq!(
                t,
                tokens,
                "{}",
                what(&format!("steps ahead {ahead}, beside 15 neighbours"))
            );
            if ahead {
                assert!(batch.times().steps_ahead > 0, "{}", what("steps ran ahead"));
            }
        }
        // Speculation inside the batch.
        let mut batch = Batch::new(model, &scheme, 512, limits)
            .unwrap()
            .with_speculation(BatchSpec::ngram(3, 4))
            .unwrap();
        let (_, got, _) = batch_run(&mut batch, &crowd);
        same(&got, "n-gram speculation beside 15 neighbours");
        // A prefix-store hit: a first request shares the prompt's first 550 tokens (on
        // Gemma 3, whose wrapped rings cannot be cut back, its checkpoint 64 tokens before
        // its end is what is reused).
        let mut batch = Batch::new(model, &scheme, 512, limits)
            .unwrap()
            .with_prefix_cache(1 << 30);
        let mut other = prompt[..550].to_vec();
        other.extend_from_slice(&prompt[10..70]);
        batch_run(&mut batch, &[(request(other, greedy(), 2), 0)]);
        let (_, got, finished) = batch_run(&mut batch, &[(ours.clone(), 0)]);
        let Event::Finished { cached_tokens, .. } = finished else {
            unreachable!()
        };
        assert!(
            (tessera_kv::FIRST_APPEND..=550).contains(&cached_tokens),
            "{}: {cached_tokens} tokens",
            what("the stored prefix is reused")
        );
        same(&got, "a prefix-store hit");
    }
}

/// One scheme by name.
pub fn only(name: &str) -> Vec<(&'static str, KvScheme)> {
    schemes()
        .into_iter()
        .filter(|(kv, _)| *kv == name)
        .collect()
}
