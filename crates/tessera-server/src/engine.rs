//! The engine thread: the only thread that touches the model, the tokenizer and the
//! [`Batch`]. Handlers send it a [`Submit`] (one or more prompts, `n` choices each); it
//! tokenizes, validates and queues every choice (all or none), then loops — take new
//! submissions (blocking only when there is nothing to step), cancel requests whose client
//! has gone, `step()`, and forward each choice's text (and logprobs, where asked) to its
//! reply channel as the batch releases it (the batch detokenizes, and holds text back until
//! it cannot become one of the request's stop strings).
//! It publishes what it observed to [`Metrics`] once per loop.

use crate::metrics::{Gauges, Metrics, Outcome, Tally};
use crate::openai::{ApiError, Finish, TokenLogprob, TopLogprob};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tessera_engine::chat::{ChatTemplate, Message};
use tessera_engine::speculative::SpecStats;
use tessera_engine::{
    Batch, BatchLimits, BatchSpec, BatchTimes, EngineError, Event, GenerationRequest, Prompt,
    PromptInput, RequestId, SamplerConfig, StopReason, TokenLogprobs,
};
use tessera_kv::KvScheme;
use tessera_models::{Model, Tokenizer};
use tokio::sync::mpsc::{self, error::TryRecvError, UnboundedSender};

/// What a request asks for, before tokenization.
#[derive(Debug, Clone)]
pub enum Input {
    /// A completion prompt (encoded with the vocabulary's BOS).
    Text(String),
    /// A completion prompt given as token ids (used as they are).
    Tokens(Vec<u32>),
    /// A conversation, rendered through the chat template.
    Chat(Vec<Message>),
}

/// One prompt and the `n` choices to generate for it.
#[derive(Debug)]
pub struct Job {
    pub input: Input,
    /// Choices for this prompt; choice `k` samples with `sampler.seed + k`.
    pub n: usize,
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    pub stops: Vec<String>,
    /// `Some(k)`: every token's logprob and the `k` most likely tokens at its step.
    pub logprobs: Option<usize>,
    /// The model's end-of-sequence tokens do not end a choice (`ignore_eos`).
    pub ignore_eos: bool,
}

/// A request: its prompts (choices are numbered prompt by prompt, `n` each, as OpenAI
/// orders them) and where the engine answers.
pub struct Submit {
    pub jobs: Vec<Job>,
    pub reply: UnboundedSender<Reply>,
    /// When the request arrived (time to first token counts from here).
    pub received: Instant,
}

/// An item for choice `choice` of a request.
#[derive(Debug)]
pub struct Reply {
    pub choice: usize,
    pub item: StreamItem,
}

/// What the engine tells a request's handler, in this order: `Accepted` (every choice
/// queued) or `Error`; then, per choice, `Text` pieces and `Done` (or `Error` if the engine
/// failed mid-way).
#[derive(Debug)]
pub enum StreamItem {
    Accepted,
    Text {
        text: String,
        /// The tokens this text completes (where logprobs were asked for).
        logprobs: Vec<TokenLogprob>,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens a stored prefix gave (`prompt_tokens_details.cached_tokens`).
        cached_tokens: usize,
        /// Tokens whose logprobs no `Text` carried (their text was held back to the end).
        logprobs: Vec<TokenLogprob>,
    },
    Error(ApiError),
}

/// What the engine thread owns.
pub struct EngineParts {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub scheme: KvScheme,
    pub prefill_chunk: usize,
    pub limits: BatchLimits,
    /// KV bytes of finished requests' rows kept for prefix reuse (0: none).
    pub prefix_cache: usize,
    /// Where the prefix store mirrors its rows (`--prompt-cache-dir`), so they outlive the
    /// process; `None`: in memory only.
    pub prompt_cache_dir: Option<PathBuf>,
    /// `None`: the chat endpoint answers 400.
    pub chat_template: Option<ChatTemplate>,
    /// Speculation inside the batch (`--spec ngram` or `--draft-model`); `None`: plain
    /// decode steps.
    pub spec: Option<ServeSpec>,
    /// false: no greedy decode step runs ahead of its tokens (`Batch::with_steps_ahead`,
    /// which the batch does by default on a GPU).
    pub steps_ahead: bool,
}

/// What drafts for every row of the server's batches.
pub enum Drafting {
    /// Prompt lookup over the last `n` tokens.
    Ngram(usize),
    /// A smaller model of the same vocabulary (on the target's device), one cache a row.
    Model(Box<Model>),
}

/// Speculation in the server: the drafter and the most tokens a round drafts.
pub struct ServeSpec {
    pub drafting: Drafting,
    pub max_draft: usize,
}

impl ServeSpec {
    pub fn batch_spec(&self) -> BatchSpec<'_> {
        match &self.drafting {
            Drafting::Ngram(n) => BatchSpec::ngram(*n, self.max_draft),
            Drafting::Model(m) => BatchSpec::model(m, self.max_draft),
        }
    }
}

/// A reply held back until the step's metrics are published, so that a client that has
/// its answer sees it counted in `/metrics`.
type Outgoing = (UnboundedSender<Reply>, Reply);

/// A choice the engine is generating for.
struct Live {
    reply: UnboundedSender<Reply>,
    choice: usize,
    prompt_tokens: usize,
    tokens: usize,
    /// Logprobs of tokens whose text has not been sent yet.
    pending: Vec<TokenLogprob>,
    received: Instant,
    last_token: Option<Instant>,
}

impl Live {
    fn new(reply: UnboundedSender<Reply>, choice: usize) -> Live {
        Live {
            reply,
            choice,
            prompt_tokens: 0,
            tokens: 0,
            pending: Vec::new(),
            received: Instant::now(),
            last_token: None,
        }
    }

    fn send(&self, item: StreamItem) {
        let _ = self.reply.send(Reply {
            choice: self.choice,
            item,
        });
    }

    /// Sends text the batch released, with the logprobs of the tokens it completes.
    fn forward(&mut self, text: String) {
        if !text.is_empty() {
            let logprobs = std::mem::take(&mut self.pending);
            self.send(StreamItem::Text { text, logprobs });
        }
    }

    /// The choice's end: the batch's last text, then its `Done` (for the caller to send once
    /// the metrics count it). A stop string's tokens are cut with it, their logprobs too.
    fn finish(
        &mut self,
        reason: StopReason,
        text: String,
        cached_tokens: usize,
    ) -> (Outgoing, Finish) {
        self.forward(text);
        let finish = match reason {
            StopReason::StopString => {
                self.pending.clear();
                Finish::Stop
            }
            StopReason::EndToken => Finish::Stop,
            StopReason::MaxTokens | StopReason::ContextLimit => Finish::Length,
        };
        (self.done(finish, cached_tokens), finish)
    }

    /// The choice's `Done`, for the caller to send once the metrics count it.
    fn done(&mut self, finish: Finish, cached_tokens: usize) -> Outgoing {
        let logprobs = std::mem::take(&mut self.pending);
        let reply = Reply {
            choice: self.choice,
            item: StreamItem::Done {
                finish,
                prompt_tokens: self.prompt_tokens,
                completion_tokens: self.tokens,
                cached_tokens,
                logprobs,
            },
        };
        (self.reply.clone(), reply)
    }
}

/// An engine error as the API reports it: a validation error names its field as `param`.
pub fn engine_error(e: &EngineError) -> ApiError {
    match e {
        EngineError::QueueFull { .. } => ApiError::busy(e.to_string()),
        // Validation names the field it failed on; the server passes it on as `param`.
        EngineError::Field { field, message } => {
            ApiError::invalid(message.clone()).with_param(field)
        }
        EngineError::Invalid(m) => ApiError::invalid(m.clone()),
        EngineError::PromptTooLong { .. }
        | EngineError::EmptyPrompt
        | EngineError::ChatTemplate(_) => ApiError::invalid(e.to_string()),
        _ => ApiError::internal(e.to_string()),
    }
}

/// Each token's own text and bytes, decoded once.
#[derive(Default)]
struct TokenTexts(HashMap<u32, (String, Vec<u8>)>);

impl TokenTexts {
    fn get(&mut self, tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
        if self.0.len() > 1 << 16 {
            self.0.clear();
        }
        self.0
            .entry(id)
            .or_insert_with(|| token_text(tokenizer, id))
            .clone()
    }

    fn logprobs(&mut self, tokenizer: &Tokenizer, id: u32, lp: &TokenLogprobs) -> TokenLogprob {
        let (token, bytes) = self.get(tokenizer, id);
        TokenLogprob {
            token,
            bytes,
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(id, logprob)| {
                    let (token, bytes) = self.get(tokenizer, id);
                    TopLogprob {
                        token,
                        bytes,
                        logprob,
                    }
                })
                .collect(),
        }
    }
}

/// A token's text as decoding it alone gives (control tokens: their name), and its bytes:
/// a token that is part of a character (a byte-fallback `<0xE2>`, or a byte-level piece)
/// decodes to U+FFFD alone, so its bytes come from the vocabulary's text of it.
fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let text = tokenizer.decode(&[id]).unwrap_or_default();
    let raw = tokenizer.token_text(id);
    if text.is_empty() {
        if let Some(raw) = raw {
            let bytes = raw.as_bytes().to_vec();
            return (raw, bytes);
        }
    }
    if text.contains('\u{FFFD}') {
        if let Some(bytes) = raw
            .as_deref()
            .and_then(|r| byte_fallback(r).or_else(|| byte_level(r)))
        {
            return (text, bytes);
        }
    }
    let bytes = text.as_bytes().to_vec();
    (text, bytes)
}

/// `<0xHH>`: SentencePiece's byte-fallback token for byte HH.
fn byte_fallback(raw: &str) -> Option<Vec<u8>> {
    let hex = raw.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2)
        .then(|| u8::from_str_radix(hex, 16).ok())
        .flatten()
        .map(|b| vec![b])
}

/// The bytes of a GPT-2 byte-level token (each byte shown as one printable character).
fn byte_level(raw: &str) -> Option<Vec<u8>> {
    let direct = |b: u32| matches!(b, 33..=126 | 161..=172 | 174..=255);
    raw.chars()
        .map(|c| {
            let c = c as u32;
            if c < 256 && direct(c) {
                Some(c as u8)
            } else if (256..256 + 68).contains(&c) {
                (0u32..256)
                    .filter(|&b| !direct(b))
                    .nth((c - 256) as usize)
                    .map(|b| b as u8)
            } else {
                None
            }
        })
        .collect()
}

/// Counts of batches a failure replaced, added to the live batch's so counters never fall.
#[derive(Default)]
struct Base {
    prefix: (u64, u64),
    spec: SpecStats,
    times: BatchTimes,
}

impl Base {
    /// Keeps `batch`'s counts before it is replaced.
    fn absorb(&mut self, batch: &Batch) {
        if let Some(p) = batch.prefix_cache() {
            let (hits, tokens) = p.hits();
            self.prefix = (self.prefix.0 + hits, self.prefix.1 + tokens);
        }
        self.spec.add(batch.spec_stats());
        self.times.add(batch.times());
    }
}

fn publish(metrics: &Metrics, batch: &Batch, tally: &mut Tally, base: &Base) {
    let prefixes = batch.prefix_cache();
    let (hits, tokens) = prefixes.map_or((0, 0), |p| p.hits());
    metrics.publish(
        tally,
        Gauges {
            running: batch.running(),
            waiting: batch.waiting(),
            kv_bytes_allocated: batch.kv_bytes_allocated(),
            kv_bytes_reserved: batch.kv_bytes_reserved(),
            prefix_cache_bytes: prefixes.map_or(0, |p| p.bytes()),
            prefix_cache_hits: base.prefix.0 + hits,
            prefix_cache_tokens: base.prefix.1 + tokens,
            spec: {
                let mut spec = base.spec.clone();
                spec.add(batch.spec_stats());
                spec
            },
            times: {
                let mut times = base.times;
                times.add(batch.times());
                times
            },
        },
    );
}

/// A fresh batch and its prefix store, which indexes `dir` where there is one (a folder
/// that cannot be listed leaves the store in memory, with one stderr line).
#[allow(clippy::too_many_arguments)]
fn new_batch<'m>(
    model: &'m Model,
    tokenizer: &'m Tokenizer,
    scheme: &KvScheme,
    prefill_chunk: usize,
    limits: BatchLimits,
    prefix_cache: usize,
    dir: Option<&Path>,
    spec: Option<BatchSpec<'m>>,
    steps_ahead: bool,
) -> Result<Batch<'m>, EngineError> {
    let fresh = || -> Result<Batch<'m>, EngineError> {
        let batch = Batch::new(model, scheme, prefill_chunk, limits)?
            .with_tokenizer(tokenizer)
            .allowing_steps_ahead(steps_ahead);
        match spec {
            Some(spec) => batch.with_speculation(spec),
            None => Ok(batch),
        }
    };
    let batch = fresh()?;
    let Some(dir) = dir else {
        return Ok(batch.with_prefix_cache(prefix_cache));
    };
    match batch.with_prefix_cache_dir(prefix_cache, dir) {
        Ok(b) => Ok(b),
        Err(e) => {
            eprintln!("{e}; the prefix cache is kept in memory only");
            Ok(fresh()?.with_prefix_cache(prefix_cache))
        }
    }
}

/// The prefix store's notes (prompt cache files skipped, dropped or not saved) on stderr.
fn log_notes(batch: &mut Batch) {
    for note in batch.take_notes() {
        eprintln!("{note}");
    }
}

/// Runs the engine until every submission sender is gone.
pub fn run(parts: EngineParts, mut rx: mpsc::Receiver<Submit>, metrics: Arc<Metrics>) {
    let EngineParts {
        model,
        tokenizer,
        scheme,
        prefill_chunk,
        limits,
        prefix_cache,
        prompt_cache_dir,
        chat_template,
        spec,
        steps_ahead,
    } = parts;
    let dir = prompt_cache_dir.as_deref();
    // The first batch, and each one after an engine failure (rows kept in memory are gone;
    // those on disk are indexed again).
    let fresh_batch = || {
        new_batch(
            &model,
            &tokenizer,
            &scheme,
            prefill_chunk,
            limits,
            prefix_cache,
            dir,
            spec.as_ref().map(ServeSpec::batch_spec),
            steps_ahead,
        )
    };
    let mut batch = match fresh_batch() {
        Ok(b) => b,
        Err(e) => {
            // Validated before the server starts; answer every request with the reason.
            while let Some(s) = rx.blocking_recv() {
                let _ = s.reply.send(Reply {
                    choice: 0,
                    item: StreamItem::Error(engine_error(&e)),
                });
            }
            return;
        }
    };
    log_notes(&mut batch);
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let mut tally = Tally::default();
    // Prefix-store hits and speculation counts of batches a failure replaced.
    let mut base = Base::default();
    let mut texts = TokenTexts::default();
    let mut outbox: Vec<Outgoing> = Vec::new();
    let context = model.context_length();
    let prepare = |job: &Job| -> Result<(Vec<u32>, usize, Vec<u32>), ApiError> {
        let (input, param) = match &job.input {
            Input::Text(t) => (PromptInput::Text(t), "prompt"),
            Input::Tokens(ids) => (PromptInput::Tokens(ids), "prompt"),
            Input::Chat(messages) => {
                if chat_template.is_none() {
                    return Err(ApiError::invalid(
                        "this model has no usable chat template; use /v1/completions",
                    ));
                }
                (PromptInput::Chat(messages), "messages")
            }
        };
        let Prompt {
            ids: prompt,
            stop_tokens: stops,
        } = Prompt::new(&tokenizer, chat_template.as_ref(), input)
            .map_err(|e| ApiError::invalid(e.to_string()).with_param(param))?;
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt is empty").with_param("prompt"));
        }
        let max_tokens = job
            .max_tokens
            .unwrap_or_else(|| context.saturating_sub(prompt.len()));
        if prompt.len() >= context || prompt.len().saturating_add(max_tokens) > context {
            return Err(ApiError::invalid(format!(
                "This model's maximum context length is {context} tokens. However, you \
                 requested {} tokens ({} in the messages/prompt, {max_tokens} for the \
                 completion). Please reduce the prompt or max_tokens.",
                prompt.len().saturating_add(max_tokens),
                prompt.len(),
            ))
            .with_param("max_tokens")
            .with_code("context_length_exceeded"));
        }
        Ok((prompt, max_tokens, stops))
    };
    loop {
        publish(&metrics, &batch, &mut tally, &base);
        // New submissions: wait for one only when there is nothing to step.
        loop {
            let submit = if batch.is_idle() && live.is_empty() {
                match rx.blocking_recv() {
                    Some(s) => s,
                    None => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(s) => s,
                    Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => break,
                }
            };
            let Submit {
                jobs,
                reply,
                received,
            } = submit;
            let fail = |e: ApiError| {
                let _ = reply.send(Reply {
                    choice: 0,
                    item: StreamItem::Error(e),
                });
            };
            let prepared = match jobs.iter().map(prepare).collect::<Result<Vec<_>, _>>() {
                Ok(p) => p,
                Err(e) => {
                    fail(e);
                    continue;
                }
            };
            // Every choice is queued, or none is.
            let mut added: Vec<(RequestId, Live)> = Vec::new();
            let mut refused = None;
            'jobs: for (job, (prompt, max_tokens, stops)) in jobs.into_iter().zip(prepared) {
                for k in 0..job.n {
                    let mut sampler = job.sampler.clone();
                    sampler.seed = sampler.seed.wrapping_add(k as u64);
                    let prompt_tokens = prompt.len();
                    let request = GenerationRequest {
                        prompt: prompt.clone(),
                        max_tokens,
                        sampler,
                        stop_tokens: if job.ignore_eos {
                            Vec::new()
                        } else {
                            stops.clone()
                        },
                        stop_strings: job.stops.clone(),
                        logprobs: job.logprobs,
                    };
                    match batch.add(request) {
                        Ok(id) => {
                            let mut l = Live::new(reply.clone(), added.len());
                            l.prompt_tokens = prompt_tokens;
                            l.received = received;
                            added.push((id, l));
                        }
                        Err(e) => {
                            refused = Some(engine_error(&e));
                            break 'jobs;
                        }
                    }
                }
            }
            if let Some(e) = refused {
                for (id, _) in &added {
                    batch.cancel(*id);
                }
                fail(e);
                continue;
            }
            let _ = reply.send(Reply {
                choice: 0,
                item: StreamItem::Accepted,
            });
            for (id, l) in added {
                tally.prompt_tokens += l.prompt_tokens as u64;
                live.insert(id, l);
            }
        }

        // Clients that went away.
        let gone: Vec<RequestId> = live
            .iter()
            .filter(|(_, l)| l.reply.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            batch.cancel(id);
            live.remove(&id);
            tally.finish(Outcome::Cancelled, 1);
        }

        if batch.is_idle() {
            continue;
        }
        let events = match catch_unwind(AssertUnwindSafe(|| batch.step())) {
            Ok(Ok(events)) => events,
            failed => {
                // The step failed for the whole batch: fail its requests, start over empty.
                let message = match failed {
                    Ok(Err(e)) => format!("the engine failed: {e}"),
                    _ => "the engine failed (panic in a step)".to_string(),
                };
                for (_, l) in live.drain() {
                    tally.finish(Outcome::Error, 1);
                    outbox.push((
                        l.reply.clone(),
                        Reply {
                            choice: l.choice,
                            item: StreamItem::Error(ApiError::internal(message.clone())),
                        },
                    ));
                }
                base.absorb(&batch);
                // The rows kept in memory are gone; those on disk are indexed again.
                match fresh_batch() {
                    Ok(b) => batch = b,
                    Err(_) => return,
                }
                log_notes(&mut batch);
                publish(&metrics, &batch, &mut tally, &base);
                for (to, reply) in outbox.drain(..) {
                    let _ = to.send(reply);
                }
                continue;
            }
        };
        log_notes(&mut batch);
        let now = Instant::now();
        for event in events {
            match event {
                Event::Token {
                    id,
                    token,
                    logprobs,
                    text,
                } => {
                    tally.generation_tokens += 1;
                    let Some(l) = live.get_mut(&id) else { continue };
                    l.tokens += 1;
                    match l.last_token {
                        None => tally.ttft.observe((now - l.received).as_secs_f64()),
                        Some(t) => tally.itl.observe((now - t).as_secs_f64()),
                    }
                    l.last_token = Some(now);
                    if let Some(lp) = &logprobs {
                        l.pending.push(texts.logprobs(&tokenizer, token, lp));
                    }
                    l.forward(text);
                }
                Event::Finished {
                    id,
                    reason,
                    cached_tokens,
                    text,
                    ..
                } => {
                    let Some(mut l) = live.remove(&id) else {
                        continue;
                    };
                    let (done, finish) = l.finish(reason, text, cached_tokens);
                    outbox.push(done);
                    tally.finish(
                        match finish {
                            Finish::Stop => Outcome::Stop,
                            Finish::Length => Outcome::Length,
                        },
                        1,
                    );
                }
                Event::Failed { id, message } => {
                    let Some(l) = live.remove(&id) else {
                        continue;
                    };
                    let item = StreamItem::Error(ApiError::internal(message));
                    outbox.push((
                        l.reply.clone(),
                        Reply {
                            choice: l.choice,
                            item,
                        },
                    ));
                    tally.finish(Outcome::Error, 1);
                }
            }
        }
        publish(&metrics, &batch, &mut tally, &base);
        for (to, reply) in outbox.drain(..) {
            let _ = to.send(reply);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(token: &str) -> TokenLogprob {
        TokenLogprob {
            token: token.into(),
            bytes: token.as_bytes().to_vec(),
            logprob: -1.0,
            top: Vec::new(),
        }
    }

    /// The batch released "a", then " " (holding back "E" of " E"), then nothing for "ND"
    /// (the stop string "END" completed): each token's logprob travels with the text it
    /// completes, and the stop's tokens are dropped.
    #[test]
    fn logprobs_travel_with_their_text_and_are_cut_with_a_stop_string() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut l = Live::new(tx, 0);
        for (token, text) in [("a", "a"), (" E", " "), ("ND", "")] {
            l.pending.push(lp(token));
            l.forward(text.to_string());
        }
        let ((to, done), finish) = l.finish(StopReason::StopString, String::new(), 3);
        assert!(matches!(finish, Finish::Stop));
        to.send(done).unwrap();
        let mut items = Vec::new();
        while let Ok(r) = rx.try_recv() {
            items.push(r.item);
        }
        assert!(
            matches!(&items[0], StreamItem::Text { text, logprobs } if text == "a" && logprobs == &[lp("a")])
        );
        assert!(
            matches!(&items[1], StreamItem::Text { text, logprobs } if text == " " && logprobs == &[lp(" E")])
        );
        assert!(matches!(
            &items[2],
            StreamItem::Done { logprobs, cached_tokens: 3, .. } if logprobs.is_empty()
        ));
        assert_eq!(items.len(), 3);
    }

    #[test]
    fn token_bytes_of_partial_characters() {
        assert_eq!(byte_fallback("<0xE2>"), Some(vec![0xE2]));
        assert_eq!(byte_fallback("<0xE2"), None);
        // GPT-2's byte-level map: 'Ġ' is the space, 'â' is 0xE2 itself.
        assert_eq!(byte_level("Ġa"), Some(vec![b' ', b'a']));
        assert_eq!(byte_level("â"), Some(vec![0xE2]));
        assert_eq!(byte_level("▁"), None);
    }

    #[test]
    fn invalid_settings_name_their_param() {
        // The field comes from validation itself, not from reading its message.
        let bad_top_p = SamplerConfig {
            top_p: Some(2.0),
            ..Default::default()
        };
        let e = engine_error(&bad_top_p.validate().unwrap_err());
        assert_eq!(
            (e.param, e.message.as_str()),
            (Some("top_p"), "top_p must be in (0, 1]")
        );
        let e = engine_error(&tessera_engine::check_vocabulary(&[3, 9], 5).unwrap_err());
        assert_eq!(e.param, Some("prompt"));
        assert!(e.message.contains("token id 9"), "{}", e.message);
        // A message that merely begins with a field's name names none.
        let e = engine_error(&EngineError::Invalid("top_p of the file".into()));
        assert_eq!(e.param, None);
    }
}
