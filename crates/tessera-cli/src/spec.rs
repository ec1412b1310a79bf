//! Speculative decoding options (`--spec ngram[:N]`, `--draft-model P|NAME`,
//! `--draft-tokens K`) shared by generate, chat, bench and serve, and the one generation
//! loop generate and chat run, plain or speculative.

use crate::commands::{load, model_path};
use crate::ModelArgs;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::path::PathBuf;
use tessera_engine::speculative::{NgramDrafter, SpecStats};
use tessera_engine::{BatchSpec, Generation, SamplerConfig, Session, StopReason};
use tessera_models::{Model, Tokenizer};

/// Speculative decoding.
#[derive(Args, Clone, Default)]
pub struct SpecArgs {
    /// Speculative decoding by prompt lookup: `ngram[:N]` drafts the continuation of the
    /// latest earlier occurrence of the last N tokens (default 3) of the prompt and output,
    /// which the model verifies in one chunk. Greedy output stays the model's greedy output;
    /// sampled output keeps the model's distribution (the standard rejection rule).
    #[arg(long, value_name = "ngram[:N]")]
    pub spec: Option<String>,
    /// Speculative decoding with a draft model: a smaller GGUF (or a built-in model's name)
    /// of the same vocabulary drafts tokens one by one, the model verifies them in one chunk
    /// (e.g. `qwen2.5-coder-0.5b-instruct` for `qwen2.5-coder-1.5b-instruct`).
    #[arg(long, value_name = "P|NAME")]
    pub draft_model: Option<PathBuf>,
    /// With --spec or --draft-model: most tokens drafted per round (the draft length halves
    /// after a round that accepts none and doubles back after one that accepts all; drafting
    /// pauses a few steps when single drafts keep failing).
    #[arg(long, default_value_t = 8)]
    pub draft_tokens: usize,
}

/// What drafts, once the flags are checked.
#[derive(Clone)]
pub enum SpecChoice {
    Ngram(NgramDrafter),
    Model(PathBuf),
}

impl SpecArgs {
    /// The drafter the flags ask for, checked before any model loads; `None` without
    /// speculation.
    pub fn choice(&self) -> Result<Option<SpecChoice>> {
        if self.spec.is_none() && self.draft_model.is_none() {
            return Ok(None);
        }
        if self.spec.is_some() && self.draft_model.is_some() {
            bail!("--spec and --draft-model: give one drafter, not both");
        }
        if self.draft_tokens == 0 || self.draft_tokens > 64 {
            bail!("--draft-tokens {}: must be from 1 to 64", self.draft_tokens);
        }
        if let Some(path) = &self.draft_model {
            return Ok(Some(SpecChoice::Model(path.clone())));
        }
        let spec = self.spec.as_deref().unwrap_or_default().trim();
        let n = match spec.split_once(':') {
            None if spec == "ngram" => 3,
            Some(("ngram", n)) => n
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .with_context(|| format!("--spec {spec}: N must be a whole number from 1"))?,
            _ => bail!(
                "--spec {spec}: expected ngram or ngram:N (prompt lookup; a draft model is \
                 --draft-model)"
            ),
        };
        Ok(Some(SpecChoice::Ngram(NgramDrafter { n })))
    }

    /// Whether a drafter is asked for (the flags are checked by [`SpecArgs::choice`]).
    pub fn is_set(&self) -> bool {
        self.spec.is_some() || self.draft_model.is_some()
    }

    /// Round slack the target's cache needs (0 without speculation).
    pub fn slack(&self) -> usize {
        if self.is_set() {
            self.draft_tokens
        } else {
            0
        }
    }
}

/// A loaded draft model (on the target's device, with its load options).
pub struct DraftModel {
    pub model: Model,
    pub name: String,
}

impl SpecChoice {
    /// Loads the draft model, if this choice has one, and checks that it shares the
    /// target's vocabulary token for token.
    pub fn load(&self, target: &ModelArgs, target_tok: &Tokenizer) -> Result<Option<DraftModel>> {
        let SpecChoice::Model(path) = self else {
            return Ok(None);
        };
        let args = ModelArgs {
            model: Some(path.clone()),
            ..target.clone()
        };
        let file = model_path(&args)?;
        let (model, tok) =
            load(&args).with_context(|| format!("loading the draft model {}", path.display()))?;
        same_vocabulary(&tok, target_tok)
            .with_context(|| format!("--draft-model {}", path.display()))?;
        let name = file.file_stem().map_or_else(
            || path.display().to_string(),
            |s| s.to_string_lossy().into_owned(),
        );
        Ok(Some(DraftModel { model, name }))
    }

    /// Its summary name: `ngram:N` or `draft NAME`.
    pub fn label(&self, draft: Option<&DraftModel>) -> String {
        match (self, draft) {
            (SpecChoice::Ngram(d), _) => format!("ngram:{}", d.n),
            (SpecChoice::Model(_), Some(m)) => format!("draft {}", m.name),
            (SpecChoice::Model(p), None) => format!("draft {}", p.display()),
        }
    }

    /// The speculation of a generation or a batch, drafting up to `max_draft` a round.
    pub fn batch_spec<'m>(
        &self,
        draft: Option<&'m DraftModel>,
        max_draft: usize,
    ) -> Result<BatchSpec<'m>> {
        Ok(match (self, draft) {
            (SpecChoice::Ngram(d), _) => BatchSpec::ngram(d.n, max_draft),
            (SpecChoice::Model(_), Some(m)) => BatchSpec::model(&m.model, max_draft),
            (SpecChoice::Model(p), None) => bail!("the draft model {} is not loaded", p.display()),
        })
    }
}

/// The vocabularies must agree token for token: a drafted id has to mean the same text.
fn same_vocabulary(draft: &Tokenizer, target: &Tokenizer) -> Result<()> {
    if draft.vocab_size() != target.vocab_size() {
        bail!(
            "the draft model's vocabulary has {} tokens, the model's {}: a drafter must share \
             the model's vocabulary",
            draft.vocab_size(),
            target.vocab_size()
        );
    }
    if let Some(id) =
        (0..target.vocab_size() as u32).find(|&id| draft.token_text(id) != target.token_text(id))
    {
        bail!(
            "the vocabularies differ at token {id} ({:?} in the draft model, {:?} in the model): \
             a drafter must share the model's vocabulary",
            draft.token_text(id).unwrap_or_default(),
            target.token_text(id).unwrap_or_default()
        );
    }
    Ok(())
}

/// How a generation ended, and what its rounds did where it speculated.
pub struct Outcome {
    pub reason: Option<StopReason>,
    pub stop_token: Option<u32>,
    pub spec: Option<SpecStats>,
    /// Decode steps queued before their previous step's tokens were taken.
    pub steps_ahead: usize,
}

/// Feeds `prompt` into `session` and generates up to `max_tokens`, plainly or with `spec`;
/// each token goes to `emit`. `steps_ahead` false: a plain generation waits for each step's
/// tokens before queueing the next (it otherwise runs ahead where its device allows:
/// `Batch::with_steps_ahead`).
#[allow(clippy::too_many_arguments)]
pub fn run<'m>(
    session: &mut Session<'m>,
    prompt: &[u32],
    sampler: SamplerConfig,
    max_tokens: usize,
    stops: Vec<u32>,
    spec: Option<BatchSpec<'m>>,
    steps_ahead: bool,
    mut emit: impl FnMut(u32) -> Result<()>,
) -> Result<Outcome> {
    let mut gen = Generation::with_spec(session, prompt, sampler, max_tokens, stops, spec)?;
    gen.allow_steps_ahead(steps_ahead);
    for t in gen.by_ref() {
        emit(t?)?;
    }
    Ok(Outcome {
        reason: gen.stop_reason(),
        stop_token: gen.stop_token(),
        spec: spec.map(|_| gen.spec_stats().clone()),
        steps_ahead: gen.steps_ahead(),
    })
}

/// `tessera bench --spec …|--draft-model … --prompt-file F`: greedy decode of `gen_tokens`
/// after the prompt, plain and speculative, `repeat` timed runs of each after one untimed
/// warm-up; the decode rate is the tokens after the first over the time since it was out
/// (as generate's), so neither prefill counts.
pub fn bench(
    margs: &ModelArgs,
    kv: &crate::KvArgs,
    spec: &SpecArgs,
    prompt_file: Option<&std::path::Path>,
    gen_tokens: usize,
    repeat: usize,
    json: bool,
) -> Result<()> {
    let Some(choice) = spec.choice()? else {
        bail!("give --spec or --draft-model");
    };
    let Some(file) = prompt_file else {
        bail!("speculative bench needs --prompt-file (drafts are judged on real text)");
    };
    if gen_tokens < 2 || repeat == 0 {
        bail!("--gen-tokens must be at least 2 and --repeat at least 1");
    }
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read prompt file {}", file.display()))?;
    let scheme = crate::commands::scheme_of(kv)?;
    let (model, tok) = load(margs)?;
    let draft = choice.load(margs, &tok)?;
    let prompt = tok.encode(&text, true)?;
    let greedy = SamplerConfig::default();
    let max_draft = spec.draft_tokens;
    let mut plain_rates = Vec::new();
    let mut spec_rates = Vec::new();
    let mut stats = SpecStats::default();
    let mut same = true;
    for round in 0..=repeat {
        let timed = |spec: Option<BatchSpec>| -> Result<(f64, Vec<u32>, Option<SpecStats>)> {
            let mut session = Session::new(&model, &scheme, tessera_engine::DEFAULT_PREFILL_CHUNK)?
                .with_round_slack(max_draft);
            let mut out = Vec::new();
            let mut first = None;
            let outcome = run(
                &mut session,
                &prompt,
                greedy.clone(),
                gen_tokens,
                Vec::new(),
                spec,
                !margs.no_steps_ahead,
                |t| {
                    out.push(t);
                    first.get_or_insert_with(std::time::Instant::now);
                    Ok(())
                },
            )?;
            let rate = first.map_or(0.0, |t| {
                (out.len().max(1) - 1) as f64 / t.elapsed().as_secs_f64().max(1e-9)
            });
            Ok((rate, out, outcome.spec))
        };
        let (plain_rate, plain_out, _) = timed(None)?;
        let (spec_rate, spec_out, st) = timed(Some(choice.batch_spec(draft.as_ref(), max_draft)?))?;
        same &= plain_out == spec_out;
        if round > 0 {
            plain_rates.push(plain_rate);
            spec_rates.push(spec_rate);
            stats = st.unwrap_or_default();
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (plain, fast) = (mean(&plain_rates), mean(&spec_rates));
    let label = choice.label(draft.as_ref());
    if json {
        println!(
            "{}",
            serde_json::json!({
                "model": model.architecture(), "device": margs.device, "kv": scheme.to_string(),
                "spec": label, "draft_tokens": spec.draft_tokens, "prompt_tokens": prompt.len(),
                "gen_tokens": gen_tokens, "repeat": repeat, "plain_tok_s": plain, "spec_tok_s": fast,
                "speedup": fast / plain, "rounds": stats.rounds, "plain_steps": stats.plain_steps,
                "drafted": stats.drafted, "accepted": stats.accepted,
                "tokens_per_forward": stats.tokens_per_forward(),
                "drafted_at": stats.drafted_at, "accepted_at": stats.accepted_at,
                "same_output": same,
            })
        );
    } else {
        println!(
            "model {} | device {} | kv {scheme} | spec {label}, up to {} drafted | prompt {} tokens",
            model.architecture(),
            margs.device,
            spec.draft_tokens,
            prompt.len()
        );
        println!(
            "decode {gen_tokens} tokens: plain {plain:.1} tok/s | speculative {fast:.1} tok/s | {:.2}x (mean of {repeat} runs after a warm-up) | same output: {same}",
            fast / plain
        );
        println!("speculative rounds (last run): {}", stats.summary());
    }
    Ok(())
}
