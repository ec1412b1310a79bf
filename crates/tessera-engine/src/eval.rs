//! Quality of KV schemes: perplexity, and against the bf16 cache on the same positions, mean
//! KL divergence of the next-token distribution and top-1 agreement.
//!
//! Two regimes. [`EvalMode::Chunks`] reproduces llama.cpp's `llama-perplexity`:
//! non-overlapping chunks of `ctx` tokens, BOS first, the second half of each chunk scored.
//! Each chunk is fed as two appends (the unscored first half, then the scored second half as
//! one window), so a quantized cache reads quantized keys for the scored tokens as llama.cpp's
//! does. [`EvalMode::Decode`] prefills `prefill` tokens and then decodes the next `tokens`
//! one at a time, scoring each: the regime users run. Schemes run in lockstep so the bf16
//! reference distributions never need to be stored.

use crate::error::check_vocabulary;
use crate::session::{log_softmax, Session, DEFAULT_PREFILL_CHUNK};
use crate::EngineError;
use tessera_kv::KvScheme;
use tessera_models::{LogitsMode, Model};

#[derive(Debug, Clone, Copy)]
pub enum EvalMode {
    Chunks { ctx: usize, chunks: Option<usize> },
    Decode { prefill: usize, tokens: usize },
}

#[derive(Debug, Clone)]
pub struct SchemeResult {
    /// The scheme string exactly as given.
    pub kv: String,
    pub ppl: f64,
    pub kl_vs_bf16: Option<f64>,
    pub top1_agree: Option<f64>,
    pub kv_bytes_per_token: f64,
    /// Bits per stored K or V element, scales and offsets included (bf16 16, affine:4 4.5).
    pub bits_per_element: f64,
    pub tokens_scored: usize,
}

#[derive(Default, Clone)]
struct Tally {
    nll: f64,
    kl: f64,
    agree: usize,
    count: usize,
}

impl Tally {
    /// Scores one position: `logits` of this scheme, `reference` log-probabilities of bf16.
    fn add(&mut self, logits: &[f32], reference: &[f64], target: u32) {
        let lp = log_softmax(logits);
        self.nll -= lp[target as usize];
        self.kl += reference
            .iter()
            .zip(&lp)
            .map(|(&r, &s)| if r > -700.0 { r.exp() * (r - s) } else { 0.0 })
            .sum::<f64>();
        if argmax64(&lp) == argmax64(reference) {
            self.agree += 1;
        }
        self.count += 1;
    }
}

fn argmax64(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// Evaluates each `(name, scheme)` on `tokens` (the text's tokens, BOS first when the
/// vocabulary adds one). In [`EvalMode::Chunks`], `bos` replaces each chunk's first token,
/// as llama.cpp does when the vocabulary adds BOS; `None` keeps the text's own tokens.
pub fn evaluate(
    model: &Model,
    tokens: &[u32],
    schemes: &[(String, KvScheme)],
    mode: EvalMode,
    bos: Option<u32>,
) -> Result<Vec<SchemeResult>, EngineError> {
    // Scoring needs a token to condition on and one to predict.
    if tokens.len() < 2 {
        return Err(EngineError::TextTooShort {
            have: tokens.len(),
            need: 2,
        });
    }
    check_vocabulary(tokens, model.vocab_size())?;
    check_vocabulary(bos.as_slice(), model.vocab_size())?;
    let reference = KvScheme::parse("bf16")?;
    // The bf16 reference runs first; schemes equal to it reuse its logits.
    let mut runs: Vec<KvScheme> = vec![reference.clone()];
    let slot: Vec<usize> = schemes
        .iter()
        .map(|(_, s)| {
            if let Some(i) = runs.iter().position(|r| r == s) {
                i
            } else {
                runs.push(s.clone());
                runs.len() - 1
            }
        })
        .collect();
    let mut tallies = vec![Tally::default(); runs.len()];
    let mut bytes = vec![0usize; runs.len()];
    match mode {
        EvalMode::Chunks { ctx, chunks } => {
            if ctx < 4 {
                return Err(EngineError::Invalid("--ctx must be at least 4".into()));
            }
            if ctx > model.context_length() {
                return Err(EngineError::Invalid(format!(
                    "--ctx {ctx} is longer than the model's context of {}",
                    model.context_length()
                )));
            }
            if chunks == Some(0) {
                return Err(EngineError::Invalid("--chunks must be at least 1".into()));
            }
            let available = tokens.len() / ctx;
            let n_chunks = chunks.map_or(available, |c| c.min(available));
            if n_chunks == 0 {
                return Err(EngineError::TextTooShort {
                    have: tokens.len(),
                    need: ctx,
                });
            }
            let half = ctx / 2;
            for c in 0..n_chunks {
                let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
                if let Some(bos) = bos {
                    chunk[0] = bos;
                }
                let mut ref_lp: Vec<Vec<f64>> = Vec::new();
                for (r, scheme) in runs.iter().enumerate() {
                    let mut session = Session::new(model, scheme, ctx)?;
                    session.forward(&chunk[..half], LogitsMode::Last)?;
                    let logits = session.forward(&chunk[half..], LogitsMode::All)?;
                    let vocab = logits.len() / (ctx - half);
                    bytes[r] = session.cache().bytes_per_token();
                    for j in 0..ctx - half - 1 {
                        let row = &logits[j * vocab..(j + 1) * vocab];
                        if r == 0 {
                            ref_lp.push(log_softmax(row));
                        }
                        tallies[r].add(row, &ref_lp[j], chunk[half + j + 1]);
                    }
                }
            }
        }
        EvalMode::Decode {
            prefill,
            tokens: count,
        } => {
            if prefill == 0 || count == 0 {
                return Err(EngineError::Invalid(
                    "--prefill and --tokens must be at least 1".into(),
                ));
            }
            // Saturating: a huge --tokens must not wrap around to a small need.
            let need = prefill.saturating_add(count);
            if tokens.len() < need {
                return Err(EngineError::TextTooShort {
                    have: tokens.len(),
                    need,
                });
            }
            // The last scored token is predicted, not fed.
            if need - 1 > model.context_length() {
                return Err(EngineError::PromptTooLong {
                    prompt: need - 1,
                    context: model.context_length(),
                });
            }
            let mut sessions: Vec<Session> = runs
                .iter()
                .map(|s| Session::new(model, s, DEFAULT_PREFILL_CHUNK))
                .collect::<Result<_, _>>()?;
            let mut logits: Vec<Vec<f32>> = sessions
                .iter_mut()
                .map(|s| s.feed(&tokens[..prefill]))
                .collect::<Result<_, _>>()?;
            for t in 0..count {
                let target = tokens[prefill + t];
                let ref_lp = log_softmax(&logits[0]);
                for r in 0..runs.len() {
                    tallies[r].add(&logits[r], &ref_lp, target);
                }
                if t + 1 < count {
                    for (r, s) in sessions.iter_mut().enumerate() {
                        logits[r] = s.feed(&[target])?;
                    }
                }
            }
            for (r, s) in sessions.iter().enumerate() {
                bytes[r] = s.cache().bytes_per_token();
            }
        }
    }
    // K and V elements one token adds over all layers; the same for every scheme.
    let elements: usize = model
        .layer_specs()
        .iter()
        .map(|s| s.kv_heads * (s.head_dim + s.value_dim))
        .sum();
    Ok(schemes
        .iter()
        .zip(&slot)
        .map(|((name, _), &r)| {
            let t = &tallies[r];
            let n = t.count.max(1) as f64;
            let is_reference = r == 0;
            SchemeResult {
                kv: name.clone(),
                ppl: (t.nll / n).exp(),
                kl_vs_bf16: (!is_reference).then(|| t.kl / n),
                top1_agree: (!is_reference).then(|| t.agree as f64 / n),
                kv_bytes_per_token: bytes[r] as f64,
                bits_per_element: bytes[r] as f64 * 8.0 / elements.max(1) as f64,
                tokens_scored: t.count,
            }
        })
        .collect())
}

/// Perplexity of `targets` decoded one at a time after what `session` holds (the decode
/// regime from a cache that was prefilled elsewhere, e.g. a prompt cache): `logits` are
/// the session's logits for the first target. Returns the perplexity and the count scored.
pub fn decode_perplexity(
    session: &mut Session,
    mut logits: Vec<f32>,
    targets: &[u32],
) -> Result<(f64, usize), EngineError> {
    let mut nll = 0.0;
    for (i, &target) in targets.iter().enumerate() {
        let lp = log_softmax(&logits);
        let Some(&p) = lp.get(target as usize) else {
            return Err(EngineError::Invalid(format!(
                "token id {target} is outside the model's vocabulary of {}",
                lp.len()
            )));
        };
        nll -= p;
        if i + 1 < targets.len() {
            logits = session.feed(&[target])?;
        }
    }
    let n = targets.len().max(1) as f64;
    Ok(((nll / n).exp(), targets.len()))
}
