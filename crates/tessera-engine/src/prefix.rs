//! Prefix reuse: finished requests' rows kept by the tokens they hold, least recently used
//! first out within a byte budget, so a request sharing a prefix with one of them (a system
//! prompt, a conversation's history) reads only its new suffix.
//!
//! A stored row is reused up to the longest common prefix with the new prompt, short of the
//! prompt's last token (whose logits the request needs), and only where the cache can give
//! that prefix back exactly: never below a layer's reuse floor (`minimum_reusable_offset`:
//! positions a nonzero `quantized_kv_start` stored quantized, which a fresh prefill would
//! hold in bf16), and never past what a sliding-window ring still holds (trimming a wrapped
//! ring back further than its round slack + 1 is refused — on Gemma 3, whose sliding
//! layers keep 512 positions, a stored row longer than 512 is reused only at its own length
//! or one short of it).

use tessera_kv::KvCache;

struct Entry {
    tokens: Vec<u32>,
    cache: KvCache,
    bytes: usize,
    used: u64,
}

/// Finished rows by their tokens; see the module docs.
pub struct PrefixCache {
    budget: usize,
    entries: Vec<Entry>,
    clock: u64,
    hits: u64,
    reused_tokens: u64,
}

impl PrefixCache {
    /// A store of at most `budget` bytes of KV planes.
    pub fn new(budget: usize) -> Self {
        PrefixCache {
            budget,
            entries: Vec::new(),
            clock: 0,
            hits: 0,
            reused_tokens: 0,
        }
    }

    /// KV bytes held.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Lookups that reused a prefix, and the prompt tokens they did not have to read.
    pub fn hits(&self) -> (u64, u64) {
        (self.hits, self.reused_tokens)
    }

    /// Keeps `cache` (one row holding exactly `tokens`), evicting the least recently used
    /// rows past the budget. A row larger than the whole budget, or one whose tokens another
    /// row already holds (or extends), is not kept.
    pub fn insert(&mut self, tokens: Vec<u32>, cache: KvCache) {
        let bytes = cache.allocated_bytes();
        if tokens.is_empty() || cache.batch() != 1 || bytes > self.budget {
            return;
        }
        if self.entries.iter().any(|e| e.tokens.starts_with(&tokens)) {
            return;
        }
        // A stored row this one extends is now redundant.
        self.entries.retain(|e| !tokens.starts_with(&e.tokens));
        self.clock += 1;
        self.entries.push(Entry {
            tokens,
            cache,
            bytes,
            used: self.clock,
        });
        while self.bytes() > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            self.entries.remove(oldest);
        }
    }

    /// A one-row cache holding the longest reusable prefix of `prompt` and its length, or
    /// `None`. The stored row stays (a copy is handed out).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(KvCache, usize)> {
        let mut best: Option<(usize, KvCache, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let common = e
                .tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count();
            let len = common.min(prompt.len().saturating_sub(1));
            if len == 0 || best.as_ref().is_some_and(|b| b.2 >= len) {
                continue;
            }
            if e.cache
                .minimum_reusable_offset()
                .is_some_and(|floor| len < floor)
            {
                continue;
            }
            let Ok(mut copy) = e.cache.extract(0) else {
                continue;
            };
            if copy.trim(e.tokens.len() - len).is_err() {
                continue;
            }
            best = Some((i, copy, len));
        }
        let (i, cache, len) = best?;
        self.clock += 1;
        self.entries[i].used = self.clock;
        self.hits += 1;
        self.reused_tokens += len as u64;
        Some((cache, len))
    }
}
