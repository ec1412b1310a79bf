//! `tessera bench --verify-rounds K,K,...`: the cost of one speculative verification round
//! of K drafted tokens against a plain one-token decode step, on a cache already `--depth`
//! tokens deep. `(K+1) * step / round` is the most speculation can gain there: the speedup
//! if every draft is accepted and drafting is free.
//!
//! A round is what `Session::speculate` + `end_speculation` do: open a round on the cache,
//! one forward of K+1 tokens (the last decided token, then K drafts) with every position's
//! logits, those logits copied to the host (which waits for the device), then a rollback
//! keeping the first position, as a round that accepts no draft does; so the cache grows
//! by one per round, like a step. A step is one token with the last position's logits,
//! copied to the host the same way. Each K: one untimed round and step, then `repeat` of
//! each, alternating; the medians are reported.

use crate::bench::synthetic_tokens;
use crate::commands::{load, scheme_of};
use crate::{KvArgs, ModelArgs};
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use std::time::Instant;
use tessera_kv::KvCache;
use tessera_models::{LogitsMode, Model};

/// The largest K `--verify-rounds` takes.
pub const MAX_K: usize = 64;

/// Parses `--verify-rounds`: comma-separated draft lengths, each 1..=MAX_K.
pub fn parse_ks(list: &str) -> Result<Vec<usize>> {
    let ks = list
        .split(',')
        .map(|s| {
            let s = s.trim();
            let k: usize = s.parse().with_context(|| {
                format!("--verify-rounds: {s:?} is not a draft length (a whole number 1..={MAX_K})")
            })?;
            if k == 0 || k > MAX_K {
                bail!("--verify-rounds: K = {k} is outside 1..={MAX_K}");
            }
            Ok(k)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ks)
}

/// Seconds for `f`, which must end by reading from the device (a host copy waits for it).
fn timed(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// Feeds `tokens` (the same on every row) as one append; returns the logits `mode` asks
/// for, copied to the host.
fn forward(
    model: &Model,
    cache: &mut KvCache,
    tokens: &[u32],
    mode: LogitsMode,
) -> Result<Vec<f32>> {
    let batch = cache.batch();
    let ids: Vec<u32> = (0..batch).flat_map(|_| tokens.iter().copied()).collect();
    let ids = Tensor::from_vec(ids, (batch, tokens.len()), model.device())?;
    let logits = model.forward(&ids, cache, mode)?;
    Ok(logits.flatten_all()?.to_vec1()?)
}

/// One verification round of `chunk` (K+1 tokens), keeping the first position per row.
fn round(model: &Model, cache: &mut KvCache, chunk: &[u32]) -> Result<()> {
    cache.check_append(chunk.len())?;
    cache.round_begin()?;
    match forward(model, cache, chunk, LogitsMode::All) {
        Ok(_) => Ok(cache.round_rollback(&vec![1; cache.batch()])?),
        Err(e) => {
            let _ = cache.round_rollback(&vec![0; cache.batch()]);
            Err(e)
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `tessera bench --verify-rounds LIST`: prefill `depth` tokens (untimed), then per K the
/// median of `repeat` rounds and `repeat` steps (after one of each untimed).
pub fn bench_verify_rounds(
    margs: &ModelArgs,
    kv: &KvArgs,
    list: &str,
    depth: usize,
    batch: usize,
    repeat: usize,
    json: bool,
) -> Result<()> {
    let ks = parse_ks(list)?;
    if repeat == 0 || batch == 0 {
        bail!("--repeat and --batch must be at least 1");
    }
    let scheme = scheme_of(kv)?;
    let label = crate::commands::scheme_label(kv);
    let (model, tok) = load(margs)?;
    crate::commands::notice_scheme(&model, &scheme);
    let max_k = ks.iter().copied().max().unwrap_or(1);
    // Each K appends (1 + repeat) rounds and steps of one position each; the widest round
    // briefly holds max_k + 1 more.
    let grows = 2 * (repeat + 1) * ks.len();
    if depth.max(1) + grows + max_k + 1 > model.context_length() {
        bail!(
            "--depth {depth} plus {grows} positions of rounds and steps (and a round of {}) \
             must fit the model's context of {}",
            max_k + 1,
            model.context_length()
        );
    }
    let bos = tok.special().bos.unwrap_or(2);
    let vocab = model.vocab_size();
    let mut cache = KvCache::new(&model.layer_specs(), &scheme, vec![0; batch])?
        .with_isa(model.isa())
        .with_round_slack(max_k + 1);
    let context = synthetic_tokens(depth.max(1), vocab, bos);
    for chunk in context.chunks(tessera_engine::DEFAULT_PREFILL_CHUNK) {
        forward(&model, &mut cache, chunk, LogitsMode::Last)?;
    }
    // Arbitrary in-vocabulary ids for the decided token and the drafts.
    let drafts = synthetic_tokens(max_k + 2, vocab, bos);
    let last = drafts[1];
    let mut rows = Vec::with_capacity(ks.len());
    for &k in &ks {
        let chunk = &drafts[1..k + 2];
        let (mut rounds, mut steps) = (Vec::new(), Vec::new());
        for run in 0..=repeat {
            let r = timed(|| round(&model, &mut cache, chunk))?;
            let s = timed(|| forward(&model, &mut cache, &[last], LogitsMode::Last).map(drop))?;
            if run > 0 {
                rounds.push(r * 1e3);
                steps.push(s * 1e3);
            }
        }
        let (round_ms, step_ms) = (median(rounds), median(steps));
        rows.push((k, round_ms, step_ms));
    }
    let ceiling = |k: usize, round_ms: f64, step_ms: f64| (k + 1) as f64 * step_ms / round_ms;
    if json {
        let verify: Vec<_> = rows
            .iter()
            .map(|&(k, r, s)| {
                serde_json::json!({
                    "k": k, "round_ms": r, "step_ms": s, "round_over_step": r / s,
                    "ceiling": ceiling(k, r, s),
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "model": model.architecture(), "device": margs.device, "isa": model.isa().to_string(),
                "batch": batch, "kv": label, "depth": depth, "repeat": repeat, "round_keep": 1,
                "verify": verify,
            })
        );
    } else {
        println!(
            "model {} | device {} | batch {batch} | kv {label} | depth {depth} | medians of {repeat} \
             after a warm-up; a round keeps 1 position",
            model.architecture(),
            margs.device,
        );
        for (k, r, s) in rows {
            println!(
                "verify K={k:<2}  round {r:>8.3} ms  step {s:>7.3} ms  round/step {:>6.2}  \
                 ceiling (K+1)*step/round = {:>5.2} x",
                r / s,
                ceiling(k, r, s)
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_ks;

    #[test]
    fn verify_rounds_list_is_validated() {
        assert_eq!(parse_ks("1,2, 4,16").unwrap(), vec![1, 2, 4, 16]);
        assert_eq!(parse_ks("64").unwrap(), vec![64]);
        for bad in ["0", "65", "1,x", "", "1,,2", "-1", "2.5"] {
            assert!(parse_ks(bad).is_err(), "{bad:?} was taken");
        }
    }
}
