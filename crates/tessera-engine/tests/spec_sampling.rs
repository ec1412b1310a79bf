//! Speculative sampling keeps the target's distribution: thousands of seeded runs of a
//! small synthetic Gemma 3 (16-position sliding windows, f32 weights), with a second
//! synthetic model as drafter and with prompt lookup, and the first three tokens' joint
//! and marginal frequencies tested by chi-square against the exact distribution, computed
//! from the definition (plain forwards along every branch, top-k softmax in f64, OpenAI's
//! presence penalty) rather than by the sampler under test.

mod common;

use std::collections::HashMap;
use tessera_engine::{
    Batch, BatchLimits, BatchSpec, Event, Generation, GenerationRequest, SamplerConfig, Session,
};
use tessera_kv::KvScheme;
use tessera_models::{synth, Model};

const RUNS: usize = 1500;
const TOP_K: usize = 6;
const DRAFT: usize = 3;

fn synthetic(seed: u64, tag: &str) -> (Model, common::TempFile) {
    let file = common::temp_gguf(tag);
    let shape = synth::preset("gemma3", "tiny").unwrap();
    synth::write_model(&shape, synth::parse_dtype("f32").unwrap(), seed, &file.0).unwrap();
    let (model, _) = Model::load(&file.0, &Default::default(), &candle_core::Device::Cpu).unwrap();
    (model, file)
}

/// The target's next-token distribution after `context`, from its definition: the logits
/// of a plain forward, the presence penalty for every distinct token generated so far
/// (`generated`), the top `TOP_K` kept, softmax at `temperature` in f64.
fn exact_next(
    model: &Model,
    context: &[u32],
    generated: &[u32],
    config: &SamplerConfig,
) -> Vec<(u32, f64)> {
    let scheme = KvScheme::parse("f32").unwrap();
    let mut s = Session::new(model, &scheme, 64).unwrap();
    let mut logits: Vec<f64> = s.feed(context).unwrap().iter().map(|&l| l as f64).collect();
    let mut seen = generated.to_vec();
    seen.sort_unstable();
    seen.dedup();
    for t in seen {
        logits[t as usize] -= config.presence_penalty as f64;
    }
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    ids.truncate(TOP_K);
    let max = logits[ids[0] as usize];
    let w: Vec<f64> = ids
        .iter()
        .map(|&i| ((logits[i as usize] - max) / config.temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    ids.into_iter()
        .zip(w.into_iter().map(|x| x / total))
        .collect()
}

/// The exact probability of every (t1, t2, t3) the target can produce after `prompt`.
fn exact_triples(model: &Model, prompt: &[u32], config: &SamplerConfig) -> HashMap<[u32; 3], f64> {
    let mut out = HashMap::new();
    for (t1, p1) in exact_next(model, prompt, &[], config) {
        let c1 = [prompt, &[t1]].concat();
        for (t2, p2) in exact_next(model, &c1, &[t1], config) {
            let c2 = [&c1[..], &[t2]].concat();
            for (t3, p3) in exact_next(model, &c2, &[t1, t2], config) {
                out.insert([t1, t2, t3], p1 * p2 * p3);
            }
        }
    }
    out
}

/// Pearson's chi-square of observed against expected counts keyed alike, bins expected
/// below 5 pooled into one; returns the statistic and the critical value at a significance
/// of 1e-4 (Wilson–Hilferty), and panics on an outcome of probability 0.
fn chi_square<K: std::hash::Hash + Eq + std::fmt::Debug>(
    observed: &HashMap<K, usize>,
    expected: &HashMap<K, f64>,
    n: usize,
) -> (f64, f64) {
    for k in observed.keys() {
        assert!(
            expected.contains_key(k),
            "{k:?} was drawn but has probability 0"
        );
    }
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pooled_o, mut pooled_e) = (0.0, 0.0);
    for (k, &p) in expected {
        let e = p * n as f64;
        let o = *observed.get(k).unwrap_or(&0) as f64;
        if e < 5.0 {
            pooled_o += o;
            pooled_e += e;
        } else {
            stat += (o - e).powi(2) / e;
            bins += 1;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_o - pooled_e).powi(2) / pooled_e;
        bins += 1;
    }
    let df = (bins - 1) as f64;
    let z = 3.719;
    let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (stat, crit)
}

/// Checks `RUNS` seeded speculative runs against the exact distribution: the joint of the
/// first two tokens and the marginal of the third.
fn check(target: &Model, prompt: &[u32], config: &SamplerConfig, spec: BatchSpec, label: &str) {
    let scheme = KvScheme::parse("bf16").unwrap();
    let mut outputs = Vec::new();
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..RUNS as u64 {
        let config = SamplerConfig {
            seed,
            ..config.clone()
        };
        let mut s = Session::new(target, &scheme, 64)
            .unwrap()
            .with_round_slack(DRAFT);
        // Five tokens: the first round after the first token drafts three. Each run's
        // drafter is made with its sampler (a draft model draws under the run's seed).
        let mut gen = Generation::with_spec(&mut s, prompt, config, 5, vec![], Some(spec)).unwrap();
        let got: Vec<u32> = gen.by_ref().collect::<Result<_, _>>().unwrap();
        assert_eq!(got.len(), 5, "{label}");
        drafted += gen.spec_stats().drafted;
        accepted += gen.spec_stats().accepted;
        outputs.push(got);
    }
    compare(target, prompt, config, &outputs, drafted, accepted, label);
}

/// Tests the first three tokens of `outputs` against the exact distribution (the joint of
/// the first two, the marginal of the third); both verification outcomes must have occurred.
fn compare(
    target: &Model,
    prompt: &[u32],
    config: &SamplerConfig,
    outputs: &[Vec<u32>],
    drafted: usize,
    accepted: usize,
    label: &str,
) {
    let exact = exact_triples(target, prompt, config);
    let mut pairs: HashMap<[u32; 2], f64> = HashMap::new();
    let mut thirds: HashMap<u32, f64> = HashMap::new();
    for (k, &p) in &exact {
        *pairs.entry([k[0], k[1]]).or_default() += p;
        *thirds.entry(k[2]).or_default() += p;
    }
    let mut seen_pairs: HashMap<[u32; 2], usize> = HashMap::new();
    let mut seen_thirds: HashMap<u32, usize> = HashMap::new();
    for got in outputs {
        *seen_pairs.entry([got[0], got[1]]).or_default() += 1;
        *seen_thirds.entry(got[2]).or_default() += 1;
    }
    println!("{label}: {accepted} of {drafted} drafts accepted");
    assert!(
        drafted * 4 > RUNS,
        "{label}: the drafter must propose tokens"
    );
    assert!(
        accepted > 0 && accepted < drafted,
        "{label}: both outcomes must occur"
    );
    let (stat, crit) = chi_square(&seen_pairs, &pairs, outputs.len());
    println!("{label}: (t1, t2) chi-square {stat:.1}, critical {crit:.1}");
    assert!(
        stat < crit,
        "{label}: (t1, t2) chi-square {stat:.1} ≥ {crit:.1}"
    );
    let (stat, crit) = chi_square(&seen_thirds, &thirds, outputs.len());
    println!("{label}: t3 chi-square {stat:.1}, critical {crit:.1}");
    assert!(stat < crit, "{label}: t3 chi-square {stat:.1} ≥ {crit:.1}");
}

/// A temperature at which the top `TOP_K` tokens after `prompt` are neither one certain
/// token nor uniform (the synthetic models' logit scale is arbitrary).
fn spread_temperature(model: &Model, prompt: &[u32]) -> f32 {
    let scheme = KvScheme::parse("f32").unwrap();
    let mut s = Session::new(model, &scheme, 64).unwrap();
    let mut l = s.feed(prompt).unwrap();
    l.sort_by(|a, b| b.total_cmp(a));
    ((l[0] - l[TOP_K - 1]) / 2.0).max(1e-3)
}

/// The prompt (20 tokens, a motif repeated, which prompt lookup finds; past the
/// 16-position window) and the sampler every run uses on `target`.
fn prompt_and_config(target: &Model) -> (Vec<u32>, SamplerConfig) {
    let prompt: Vec<u32> = (0..20).map(|i| 300 + (i % 5) * 7).collect();
    let config = SamplerConfig {
        temperature: spread_temperature(target, &prompt),
        top_k: Some(TOP_K),
        ..Default::default()
    };
    (prompt, config)
}

#[test]
fn speculative_sampling_draws_from_the_target_distribution() {
    let (target, _t) = synthetic(3, "spec-target");
    let (small, _d) = synthetic(4, "spec-drafter");
    let (prompt, config) = prompt_and_config(&target);
    check(
        &target,
        &prompt,
        &config,
        BatchSpec::model(&small, DRAFT),
        "draft model",
    );
    // The target drafting for itself accepts nearly everything; the presence penalty
    // makes each position's distribution depend on the drafts before it.
    let penalized = SamplerConfig {
        presence_penalty: 1.0,
        ..config.clone()
    };
    check(
        &target,
        &prompt,
        &penalized,
        BatchSpec::model(&target, DRAFT),
        "self-draft, presence penalty",
    );
    check(
        &target,
        &prompt,
        &config,
        BatchSpec::ngram(3, DRAFT),
        "prompt lookup",
    );
}

#[test]
fn speculative_sampling_in_a_batch_draws_from_the_target_distribution() {
    // Sixteen rows at a time, each its own seed, each accepting its own count per round.
    // (A draft model's rows take the same rounds: `check` above runs through a one-row
    // batch, and serve_spec.rs runs a draft model over many rows.)
    let (target, _t) = synthetic(3, "spec-batch-target");
    let (prompt, config) = prompt_and_config(&target);
    let spec = BatchSpec::ngram(3, DRAFT);
    batch_check(&target, &prompt, &config, spec, "batch, prompt lookup");
}

fn batch_check(
    target: &Model,
    prompt: &[u32],
    config: &SamplerConfig,
    spec: BatchSpec,
    label: &str,
) {
    let scheme = KvScheme::parse("bf16").unwrap();
    let limits = BatchLimits {
        max_batch: 16,
        max_queue: RUNS,
        ..Default::default()
    };
    let mut batch = Batch::new(target, &scheme, 64, limits)
        .unwrap()
        .with_speculation(spec)
        .unwrap();
    let mut outputs: HashMap<u64, Vec<u32>> = HashMap::new();
    for seed in 0..RUNS as u64 {
        let id = batch
            .add(GenerationRequest {
                prompt: prompt.to_vec(),
                max_tokens: 5,
                sampler: SamplerConfig {
                    seed,
                    ..config.clone()
                },
                stop_tokens: vec![],
                logprobs: None,
                stop_strings: Vec::new(),
            })
            .unwrap();
        outputs.insert(id, Vec::new());
    }
    while !batch.is_idle() {
        for event in batch.step().unwrap() {
            if let Event::Token { id, token, .. } = event {
                outputs.get_mut(&id).unwrap().push(token);
            }
        }
    }
    let outputs: Vec<Vec<u32>> = outputs.into_values().collect();
    assert!(outputs.iter().all(|o| o.len() == 5));
    let st = batch.spec_stats();
    compare(
        target,
        prompt,
        config,
        &outputs,
        st.drafted,
        st.accepted,
        label,
    );
}
