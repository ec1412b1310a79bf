//! A session: one model, one KV cache, and the tokens fed so far. Prefill goes in chunks
//! (each chunk one `append_window` per layer); decode feeds one token at a time.

use crate::error::check_vocabulary;
use crate::sequence::Sequence;
use crate::EngineError;
use candle_core::Tensor;
use std::time::{Duration, Instant};
use tessera_kv::{Codec, KvCache, KvScheme, PlainDType};
use tessera_models::{LogitsMode, Model};

pub const DEFAULT_PREFILL_CHUNK: usize = 512;

pub struct Session<'m> {
    model: &'m Model,
    /// The scheme the cache was made with (new caches of a [`crate::Generation`]'s batch).
    scheme: KvScheme,
    cache: KvCache,
    tokens: Vec<u32>,
    prefill_chunk: usize,
    /// Time spent in prefill and in decode forwards, and how many tokens each covered.
    pub prefill_time: Duration,
    pub prefill_tokens: usize,
    pub decode_time: Duration,
    pub decode_tokens: usize,
}

impl<'m> Session<'m> {
    pub fn new(
        model: &'m Model,
        scheme: &KvScheme,
        prefill_chunk: usize,
    ) -> Result<Self, EngineError> {
        if prefill_chunk == 0 {
            return Err(EngineError::Invalid(
                "--prefill-chunk must be at least 1".into(),
            ));
        }
        Ok(Session {
            model,
            scheme: scheme.clone(),
            cache: KvCache::new(&model.layer_specs(), scheme, vec![0])?.with_isa(model.isa()),
            tokens: Vec::new(),
            prefill_chunk,
            prefill_time: Duration::ZERO,
            prefill_tokens: 0,
            decode_time: Duration::ZERO,
            decode_tokens: 0,
        })
    }

    /// How many leading tokens of `prompt` this session's cache can give
    /// ([`crate::sequence::reuse_of`]: short of the last token, never below the reuse
    /// floor nor past what a ring holds); cut back with [`Session::truncate`].
    pub fn reuse_for(&self, prompt: &[u32]) -> crate::Reuse {
        crate::sequence::reuse_of(&self.tokens, &self.cache, prompt)
    }

    /// A session continuing from `cache` (one row, made with `scheme`), which holds exactly
    /// `tokens` (a prompt cache read from disk).
    pub fn with_cache(
        model: &'m Model,
        scheme: &KvScheme,
        cache: KvCache,
        tokens: Vec<u32>,
        prefill_chunk: usize,
    ) -> Result<Self, EngineError> {
        if prefill_chunk == 0 {
            return Err(EngineError::Invalid(
                "--prefill-chunk must be at least 1".into(),
            ));
        }
        if cache.offsets() != [tokens.len()] {
            return Err(EngineError::Invalid(format!(
                "a session's cache must be one row holding its {} tokens, not rows of {:?}",
                tokens.len(),
                cache.offsets()
            )));
        }
        Ok(Session {
            model,
            scheme: scheme.clone(),
            cache,
            tokens,
            prefill_chunk,
            prefill_time: Duration::ZERO,
            prefill_tokens: 0,
            decode_time: Duration::ZERO,
            decode_tokens: 0,
        })
    }

    /// Gives the cache's sliding-window rings `slack` spare slots, so speculative rounds of
    /// up to `slack + 1` positions roll back after a ring has wrapped. Only before the
    /// first feed (a cache that holds positions keeps its slack).
    pub fn with_round_slack(mut self, slack: usize) -> Self {
        if self.tokens.is_empty() {
            self.cache = self.cache.with_round_slack(slack);
        }
        self
    }

    pub fn round_slack(&self) -> usize {
        self.cache.round_slack()
    }

    pub(crate) fn cache_mut(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    pub fn scheme(&self) -> &KvScheme {
        &self.scheme
    }

    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Lends the cache and the tokens it holds out (to a [`crate::Generation`]'s batch),
    /// leaving an empty cache of no layers until [`Session::give_back`].
    pub(crate) fn lend(&mut self) -> Result<Sequence, EngineError> {
        let none = KvCache::new(
            &[],
            &KvScheme::uniform(Codec::Plain(PlainDType::Bf16)),
            vec![0],
        )?;
        let cache = std::mem::replace(&mut self.cache, none);
        Sequence::new(std::mem::take(&mut self.tokens), cache)
    }

    /// Takes back a lent sequence, now holding more tokens.
    pub(crate) fn give_back(&mut self, held: Sequence) {
        (self.tokens, self.cache) = held.into_parts();
    }

    /// An empty cache of the session's scheme (with round slack `slack`) in place of
    /// whatever it held (a lent cache that could not come back). Keeps the old one when a
    /// new one cannot be made.
    pub(crate) fn start_over(&mut self, slack: usize) {
        if let Ok(cache) = KvCache::new(&self.model.layer_specs(), &self.scheme, vec![0]) {
            self.cache = cache.with_isa(self.model.isa()).with_round_slack(slack);
            self.tokens.clear();
        }
    }

    /// Forgets the last `n` tokens fed (their positions already dropped from the cache).
    pub(crate) fn drop_last_tokens(&mut self, n: usize) {
        let len = self.tokens.len().saturating_sub(n);
        self.tokens.truncate(len);
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Drops every position after the first `len`, so the next feed continues from there
    /// (a chat turn reusing the prefix it shares with the cache). Refused, the session left
    /// unchanged, when the cache cannot drop them: a sliding-window ring that has overwritten
    /// positions its window would need again.
    pub fn truncate(&mut self, len: usize) -> Result<(), EngineError> {
        if len >= self.tokens.len() {
            return Ok(());
        }
        self.cache.trim(self.tokens.len() - len)?;
        self.tokens.truncate(len);
        Ok(())
    }

    pub fn context_left(&self) -> usize {
        self.model
            .context_length()
            .saturating_sub(self.tokens.len())
    }

    /// Feeds `tokens` through the model in prefill chunks and returns the logits of the
    /// last one. Refuses input that would overflow the model's context.
    pub fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if tokens.len() > self.context_left() {
            return Err(EngineError::PromptTooLong {
                prompt: self.tokens.len() + tokens.len(),
                context: self.model.context_length(),
            });
        }
        let start = Instant::now();
        let mut last = Vec::new();
        let mut rest = tokens;
        while !rest.is_empty() {
            let len = chunk_len(&self.cache, self.prefill_chunk, rest.len());
            let (chunk, tail) = rest.split_at(len);
            last = self.forward(chunk, LogitsMode::Last)?;
            rest = tail;
        }
        if tokens.len() > 1 {
            self.prefill_time += start.elapsed();
            self.prefill_tokens += tokens.len();
        } else {
            self.decode_time += start.elapsed();
            self.decode_tokens += 1;
        }
        Ok(last)
    }

    /// Feeds one chunk as one append and returns its logits (last or all positions),
    /// flattened row-major `(positions, vocab)`.
    /// Refuses an empty chunk, one that would overflow the model's context, and ids outside
    /// the model's vocabulary.
    pub fn forward(&mut self, chunk: &[u32], mode: LogitsMode) -> Result<Vec<f32>, EngineError> {
        if chunk.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if chunk.len() > self.context_left() {
            return Err(EngineError::PromptTooLong {
                prompt: self.tokens.len() + chunk.len(),
                context: self.model.context_length(),
            });
        }
        check_vocabulary(chunk, self.model.vocab_size())?;
        let ids = Tensor::from_slice(chunk, (1, chunk.len()), self.model.device())?;
        let logits = self.model.forward(&ids, &mut self.cache, mode)?;
        self.tokens.extend_from_slice(chunk);
        Ok(logits.squeeze(0)?.flatten_all()?.to_vec1()?)
    }
}

/// The next prefill chunk's length, `rest` tokens left to feed into `cache`: a cache's first
/// append under `quantized_kv_start` 0 is the positions the transition fits each row's codec
/// on, whatever the chunk size (so the codes, and every logit after, do not depend on it);
/// other chunks end exactly where a transition converts, so the conversion (and the
/// prefix-reuse floor) falls at `quantized_kv_start`.
pub(crate) fn chunk_len(cache: &KvCache, prefill_chunk: usize, rest: usize) -> usize {
    let len = match cache.first_append() {
        Some(first) => first,
        None => cache
            .max_append_tokens()
            .map_or(prefill_chunk, |m| m.min(prefill_chunk)),
    };
    len.min(rest)
}

/// Log-softmax of one row of logits, in f64 for stable sums.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&l| l as f64 - log_z).collect()
}
