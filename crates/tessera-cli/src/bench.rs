//! `tessera bench`: prefill and decode throughput, peak RSS and KV bytes.

use crate::commands::{load, scheme_of};
use crate::{KvArgs, ModelArgs};
use anyhow::{bail, Result};
use std::path::Path;
use std::time::Instant;
use tessera_engine::{
    prompt_cache, Batch, BatchLimits, BatchTimes, Event, GenerationRequest, SamplerConfig,
    Sequence, Session, DEFAULT_PREFILL_CHUNK,
};
use tessera_kv::KvScheme;
use tessera_models::Model;

/// Deterministic token ids in the ordinary-text range of the vocabulary: past the first
/// 1000 ids (where real vocabularies keep special and byte tokens), or in the upper three
/// quarters of a vocabulary too small for that (a test model's).
pub(crate) fn synthetic_tokens(n: usize, vocab: usize, bos: u32) -> Vec<u32> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let hi = vocab.min(200_000) as u64;
    let lo = 1000.min(hi / 4);
    let span = (hi - lo).max(1);
    std::iter::once(bos)
        .chain((1..n).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (lo + state % span) as u32
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

/// What `tessera bench` measures.
pub struct Shape {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub depth: usize,
    pub repeat: usize,
    pub batch: usize,
    /// Decode steps run ahead of their tokens where the engine does so
    /// (`Batch::with_steps_ahead`; false turns it off).
    pub steps_ahead: bool,
}

/// A [`Batch`] (the step engine `serve` runs) for `rows` greedy requests, with no budget.
fn engine<'m>(model: &'m Model, scheme: &KvScheme, rows: usize) -> Result<Batch<'m>> {
    let limits = BatchLimits {
        max_batch: rows,
        kv_budget: None,
        max_queue: rows,
    };
    Ok(Batch::new(model, scheme, DEFAULT_PREFILL_CHUNK, limits)?)
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig::default(),
        stop_tokens: Vec::new(),
        stop_strings: Vec::new(),
        logprobs: None,
    }
}

/// Reads `prompt` as `rows` requests that each stop at their first token: the prompts are
/// read one after another, as the server reads them. Returns prompt tokens per second, and
/// the batch's times (its prompt chunks' forwards, and how long the host took to submit them).
fn prefill_rate(
    model: &Model,
    scheme: &KvScheme,
    rows: usize,
    prompt: &[u32],
) -> Result<(f64, BatchTimes)> {
    let mut batch = engine(model, scheme, rows)?;
    for _ in 0..rows {
        batch.add(greedy(prompt.to_vec(), 1))?;
    }
    let t = Instant::now();
    while !batch.is_idle() {
        batch.step()?;
    }
    let rate = (rows * prompt.len()) as f64 / t.elapsed().as_secs_f64();
    Ok((rate, *batch.times()))
}

/// Tokens each decode row may produce: rows join one step apart and decode from then on,
/// through the warm-up step and the `steps` timed, with room to spare.
fn decode_tokens(rows: usize, steps: usize) -> usize {
    rows + steps + 4
}

/// Decode of `rows` requests at `depth` tokens of context: the context is read once (not
/// timed) and every request resumes from a copy of it; once all rows run, one untimed
/// step, then `steps` timed. Returns the batch's times over the timed steps, the running
/// rows' KV bytes, the bytes one position costs and a digest of every token decoded.
fn decode_times(
    model: &Model,
    scheme: &KvScheme,
    rows: usize,
    context: &[u32],
    steps: usize,
    steps_ahead: bool,
) -> Result<(BatchTimes, usize, usize, u64)> {
    let mut session = Session::new(model, scheme, DEFAULT_PREFILL_CHUNK)?;
    let held = context.len() - 1;
    if held > 0 {
        session.feed(&context[..held])?;
    }
    let mut batch = engine(model, scheme, rows)?.allowing_steps_ahead(steps_ahead);
    let max_tokens = decode_tokens(rows, steps);
    for _ in 0..rows {
        let held = Sequence::new(context[..held].to_vec(), session.cache().extract(0)?)?;
        batch
            .add_resumed(greedy(context.to_vec(), max_tokens), held)
            .map_err(|refused| refused.error)?;
    }
    let mut digest = TokenDigest::default();
    while batch.running() < rows {
        digest.add(&batch.step()?);
    }
    digest.add(&batch.step()?);
    let before = *batch.times();
    for _ in 0..steps {
        digest.add(&batch.step()?);
    }
    let after = *batch.times();
    if batch.running() < rows {
        bail!("a row left the batch during the timed steps");
    }
    // The tokens of a step run ahead, still on their way: the digest covers every step.
    digest.add(&batch.settle()?);
    let times = BatchTimes {
        decode: after.decode - before.decode,
        decode_steps: after.decode_steps - before.decode_steps,
        decode_rows: after.decode_rows - before.decode_rows,
        decode_submit: after.decode_submit - before.decode_submit,
        steps_ahead: after.steps_ahead - before.steps_ahead,
        ..BatchTimes::default()
    };
    Ok((
        times,
        batch.kv_bytes_allocated(),
        session.cache().bytes_per_token(),
        digest.0,
    ))
}

/// FNV-1a over the decoded tokens in event order (request, token): the same schedule decoded
/// by two paths (eager steps against graphs, one build against another) must print the same.
struct TokenDigest(u64);

impl Default for TokenDigest {
    fn default() -> Self {
        TokenDigest(0xcbf2_9ce4_8422_2325)
    }
}

impl TokenDigest {
    fn add(&mut self, events: &[Event]) {
        for e in events {
            if let Event::Token { id, token, .. } = e {
                for b in id.to_le_bytes().into_iter().chain(token.to_le_bytes()) {
                    self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
    }
}

pub fn bench(margs: &ModelArgs, shape: Shape, kv: &KvArgs, json: bool) -> Result<()> {
    let Shape {
        prompt_tokens,
        gen_tokens,
        depth,
        repeat,
        batch,
        steps_ahead,
    } = shape;
    let scheme = scheme_of(kv)?;
    let label = crate::commands::scheme_label(kv);
    if prompt_tokens == 0 || gen_tokens == 0 || repeat == 0 || batch == 0 {
        bail!("--prompt-tokens, --gen-tokens, --repeat and --batch must be at least 1");
    }
    let (model, tok) = load(margs)?;
    crate::commands::notice_scheme(&model, &scheme);
    // Decode rows join one step apart and take a warm-up step: `decode_tokens` more each.
    let decoded = decode_tokens(batch, gen_tokens);
    if depth.max(1) + decoded > model.context_length() || prompt_tokens > model.context_length() {
        bail!(
            "--depth + --gen-tokens (+ --batch + 4 joining and warm-up steps) and --prompt-tokens \
             must fit the model's context of {}",
            model.context_length()
        );
    }
    let bos = tok.special().bos.unwrap_or(2);
    // Prefill: a fresh cache per run, the whole prompt in default-size chunks; one untimed
    // warm-up run first, then the mean of `repeat` runs (llama-bench's method).
    let prompt = synthetic_tokens(prompt_tokens, model.vocab_size(), bos);
    let mut rates = Vec::with_capacity(repeat);
    let mut prefill_times = BatchTimes::default();
    for run in 0..=repeat {
        let (rate, times) = prefill_rate(&model, &scheme, batch, &prompt)?;
        if run > 0 {
            rates.push(rate);
            prefill_times.add(&times);
        }
    }
    let chunks = prefill_times.prefill_forwards.max(1) as f64;
    let (chunk_ms, chunk_submit_ms) = (
        1e3 * prefill_times.prefill.as_secs_f64() / chunks,
        1e3 * prefill_times.prefill_submit.as_secs_f64() / chunks,
    );
    let prefill_tps = rates.iter().sum::<f64>() / rates.len() as f64;
    let prefill_sd =
        (rates.iter().map(|r| (r - prefill_tps).powi(2)).sum::<f64>() / rates.len() as f64).sqrt();
    // Decode: `depth` tokens of context first (not timed), then greedy steps.
    let context = synthetic_tokens(depth.max(1), model.vocab_size(), bos);
    let (times, kv_allocated, kv_per_token, digest) =
        decode_times(&model, &scheme, batch, &context, gen_tokens, steps_ahead)?;
    let elapsed = times.decode.as_secs_f64();
    let decode_tps = times.decode_rows as f64 / elapsed;
    let (step_ms, submit_ms) = (
        1e3 * elapsed / times.decode_steps as f64,
        1e3 * times.decode_submit.as_secs_f64() / times.decode_steps as f64,
    );
    let rss = peak_rss_bytes().unwrap_or(0);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "model": model.architecture(), "device": margs.device, "isa": model.isa().to_string(), "batch": batch, "kv": label, "prompt_tokens": prompt_tokens, "prefill_tok_s": prefill_tps, "prefill_tok_s_sd": prefill_sd, "repeat": repeat, "prefill_chunk_ms": chunk_ms, "prefill_chunk_submit_ms": chunk_submit_ms,
                "depth": depth, "gen_tokens": gen_tokens, "decode_tok_s": decode_tps, "decode_step_ms": step_ms, "decode_submit_ms": submit_ms, "decode_steps_ahead": times.steps_ahead,
                "peak_rss_bytes": rss, "tokens_digest": format!("{digest:016x}"), "kv_bytes_per_token": kv_per_token, "kv_allocated_bytes": kv_allocated,
            })
        );
    } else {
        println!(
            "model {} | device {} | batch {batch} | kv {} | threads {} | isa {}",
            model.architecture(),
            margs.device,
            label,
            candle_core::utils::get_num_threads(),
            model.isa()
        );
        println!(
            "prefill  {prompt_tokens:>6} tokens  {prefill_tps:>8.1} ± {prefill_sd:.1} tok/s  (mean of \
             {repeat} runs after a warm-up; all rows' prompts, read one after another; a chunk \
             {chunk_ms:.2} ms, {chunk_submit_ms:.2} of them submitting)"
        );
        let ahead = if times.steps_ahead > 0 {
            format!("; {} of the steps run ahead", times.steps_ahead)
        } else {
            String::new()
        };
        println!(
            "decode   {gen_tokens:>6} tokens  {decode_tps:>8.1} tok/s  (depth {depth}; all rows; a \
             step {step_ms:.2} ms, {submit_ms:.2} of them submitting; tokens digest \
             {digest:016x}{ahead})"
        );
        println!(
            "peak RSS {:.1} MiB | KV {} bytes/token, {:.1} MiB allocated",
            rss as f64 / 1048576.0,
            kv_per_token,
            kv_allocated as f64 / 1048576.0
        );
    }
    if let Some(line) = crate::commands::step_graph_report(&model, margs) {
        // JSON output keeps stdout to the one object.
        if json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    }
    Ok(())
}

/// `tessera bench --prompt-cache FILE`: time to first token for the cached prompt plus
/// `suffix` new tokens, loading the file (from the page cache after the warm-up) against a
/// cold prefill of all the same tokens; the mean of `repeat` runs of each after one
/// untimed warm-up.
pub fn bench_prompt_cache(
    margs: &ModelArgs,
    file: &Path,
    suffix: usize,
    repeat: usize,
    kv: &KvArgs,
    json: bool,
) -> Result<()> {
    if suffix == 0 || repeat == 0 {
        bail!("--suffix-tokens and --repeat must be at least 1");
    }
    let explicit = crate::commands::explicit_scheme(kv)?;
    let (model, tok) = load(margs)?;
    let bytes = std::fs::metadata(file)?.len();
    let first = |ids: &[u32], session: &mut Session| -> Result<u32> {
        let logits = session.feed(ids)?;
        Ok(tessera_engine::argmax(&logits))
    };
    let bos = tok.special().bos.unwrap_or(2);
    let (mut cached_s, mut load_s, mut cold_s) = (Vec::new(), Vec::new(), Vec::new());
    let (mut prompt, mut tokens) = (Vec::new(), (0, 0));
    let mut agree = true;
    let mut label = String::new();
    for run in 0..=repeat {
        let t = Instant::now();
        let cached = prompt_cache::load(file, &model, explicit.as_ref())?;
        let loaded = t.elapsed().as_secs_f64();
        let scheme = cached.scheme.clone();
        if run == 0 {
            let held = cached.tokens.first().cloned().unwrap_or_default();
            let extra = synthetic_tokens(suffix + 1, model.vocab_size(), bos);
            prompt = held.iter().chain(&extra[1..]).copied().collect();
            label = crate::commands::scheme_label(kv);
            if explicit.is_none() {
                label = "the file's".into();
            }
        }
        let (mut session, reuse) =
            cached.resume(&model, &scheme, &prompt, DEFAULT_PREFILL_CHUNK)?;
        let warm = first(&prompt[reuse.tokens..], &mut session)?;
        let cached_time = t.elapsed().as_secs_f64();
        tokens = (prompt.len(), reuse.tokens);
        // Cold: the same tokens prefilled from nothing, split where the warm run's are (the
        // file's prefix, then the suffix), so both read the same chunks and the first tokens
        // agree bit for bit (a different split changes last bits, which can flip a near tie).
        let t = Instant::now();
        let mut session = Session::new(&model, &scheme, DEFAULT_PREFILL_CHUNK)?;
        if reuse.tokens > 0 {
            session.feed(&prompt[..reuse.tokens])?;
        }
        let cold = first(&prompt[reuse.tokens..], &mut session)?;
        let cold_time = t.elapsed().as_secs_f64();
        agree &= warm == cold;
        if run > 0 {
            cached_s.push(cached_time);
            load_s.push(loaded);
            cold_s.push(cold_time);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (cached, loaded, cold) = (mean(&cached_s), mean(&load_s), mean(&cold_s));
    if json {
        println!(
            "{}",
            serde_json::json!({
                "model": model.architecture(), "device": margs.device, "kv": label,
                "file_bytes": bytes, "prompt_tokens": tokens.0, "reused_tokens": tokens.1,
                "ttft_cached_s": cached, "load_s": loaded, "load_gb_s": bytes as f64 / loaded / 1e9,
                "ttft_cold_s": cold, "speedup": cold / cached, "first_token_agrees": agree,
                "repeat": repeat,
            })
        );
    } else {
        println!(
            "prompt cache {} | {:.2} MiB | kv {label} | prompt {} tokens, {} from the cache",
            file.display(),
            bytes as f64 / 1048576.0,
            tokens.0,
            tokens.1
        );
        println!(
            "time to first token: cached {:.1} ms (load {:.1} ms, {:.2} GB/s) | cold {:.1} ms | {:.1}x | first tokens agree: {agree}",
            cached * 1e3,
            loaded * 1e3,
            bytes as f64 / loaded / 1e9,
            cold * 1e3,
            cold / cached
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::synthetic_tokens;

    /// Every id inside the vocabulary, whatever its size (a vocabulary under 1000 ids made
    /// out-of-range ids, and one of exactly 1000 divided by zero), and not all the same.
    #[test]
    fn synthetic_tokens_stay_inside_any_vocabulary() {
        for vocab in [4, 10, 999, 1000, 1001, 4000, 262_144] {
            let ids = synthetic_tokens(300, vocab, 1);
            assert_eq!(ids.len(), 300);
            assert!(
                ids.iter().all(|&id| (id as usize) < vocab),
                "vocabulary {vocab}"
            );
            assert!(
                ids[1..].iter().any(|&id| id != ids[1]),
                "vocabulary {vocab}"
            );
            if vocab > 4000 {
                assert!(ids[1..].iter().all(|&id| id >= 1000), "vocabulary {vocab}");
            }
        }
    }
}
