//! `tessera bench`: prefill and decode throughput, peak RSS and KV bytes.

use crate::commands::{load, scheme_of};
use crate::{KvArgs, ModelArgs};
use anyhow::{bail, Result};
use std::time::Instant;
use tessera_engine::{argmax, Session};
use tessera_models::LogitsMode;

/// Deterministic token ids in the ordinary-text range of the vocabulary.
fn synthetic_tokens(n: usize, vocab: usize, bos: u32) -> Vec<u32> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let hi = vocab.min(200_000) as u64;
    std::iter::once(bos)
        .chain((1..n).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (1000 + state % (hi - 1000)) as u32
        }))
        .collect()
}

/// Peak resident set size of this process, from /proc (Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub fn bench(
    margs: &ModelArgs,
    prompt_tokens: usize,
    gen_tokens: usize,
    depth: usize,
    repeat: usize,
    kv: &KvArgs,
    json: bool,
) -> Result<()> {
    let scheme = scheme_of(kv)?;
    let label = kv
        .kv_config
        .as_ref()
        .map_or(kv.kv.clone(), |p| p.display().to_string());
    if prompt_tokens == 0 || gen_tokens == 0 || repeat == 0 {
        bail!("--prompt-tokens, --gen-tokens and --repeat must be at least 1");
    }
    let (model, tok) = load(margs)?;
    if depth + gen_tokens > model.context_length() || prompt_tokens > model.context_length() {
        bail!(
            "--depth + --gen-tokens and --prompt-tokens must fit the model's context of {}",
            model.context_length()
        );
    }
    let bos = tok.special().bos.unwrap_or(2);
    // Prefill: a fresh cache per run, the whole prompt in default-size chunks; one untimed
    // warm-up run first, then the mean of `repeat` runs (llama-bench's method).
    let prompt = synthetic_tokens(prompt_tokens, model.vocab_size(), bos);
    let mut rates = Vec::with_capacity(repeat);
    for run in 0..=repeat {
        let mut session = Session::new(&model, &scheme, tessera_engine::DEFAULT_PREFILL_CHUNK)?;
        let t = Instant::now();
        session.feed(&prompt)?;
        if run > 0 {
            rates.push(prompt_tokens as f64 / t.elapsed().as_secs_f64());
        }
    }
    let prefill_tps = rates.iter().sum::<f64>() / rates.len() as f64;
    let prefill_sd =
        (rates.iter().map(|r| (r - prefill_tps).powi(2)).sum::<f64>() / rates.len() as f64).sqrt();
    // Decode: `depth` tokens of context first (not timed), then greedy steps.
    let mut session = Session::new(&model, &scheme, tessera_engine::DEFAULT_PREFILL_CHUNK)?;
    let context = synthetic_tokens(depth.max(1), model.vocab_size(), bos);
    let mut logits = session.feed(&context)?;
    // One untimed step warms the decode path.
    logits = session.forward(&[argmax(&logits)], LogitsMode::Last)?;
    let t = Instant::now();
    for _ in 0..gen_tokens {
        let next = argmax(&logits);
        logits = session.forward(&[next], LogitsMode::Last)?;
    }
    let decode_tps = gen_tokens as f64 / t.elapsed().as_secs_f64();
    let cache = session.cache();
    let rss = peak_rss_bytes().unwrap_or(0);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "model": model.architecture(), "kv": label, "prompt_tokens": prompt_tokens, "prefill_tok_s": prefill_tps, "prefill_tok_s_sd": prefill_sd, "repeat": repeat,
                "depth": depth, "gen_tokens": gen_tokens, "decode_tok_s": decode_tps,
                "peak_rss_bytes": rss, "kv_bytes_per_token": cache.bytes_per_token(), "kv_allocated_bytes": cache.allocated_bytes(),
            })
        );
    } else {
        println!(
            "model {} | kv {} | threads {}",
            model.architecture(),
            label,
            candle_core::utils::get_num_threads()
        );
        println!("prefill  {prompt_tokens:>6} tokens  {prefill_tps:>8.1} ± {prefill_sd:.1} tok/s  (mean of {repeat} runs after a warm-up)");
        println!("decode   {gen_tokens:>6} tokens  {decode_tps:>8.1} tok/s  (depth {depth})");
        println!(
            "peak RSS {:.1} MiB | KV {} bytes/token, {:.1} MiB allocated",
            rss as f64 / 1048576.0,
            cache.bytes_per_token(),
            cache.allocated_bytes() as f64 / 1048576.0
        );
    }
    Ok(())
}
