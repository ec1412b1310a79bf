//! A sequence: a row's tokens and the one-row cache that holds them. A session's state, a
//! batch row handed back ([`crate::Batch::take_row`]) or resumed
//! ([`crate::Batch::add_resumed`]), a prefix-store entry and a prompt-cache file are each
//! one; [`Sequence::reuse_for`] is the one rule for how much of a new prompt a held
//! sequence can give.

use crate::EngineError;
use tessera_kv::KvCache;

/// Tokens and the one-row cache holding exactly them.
#[derive(Debug)]
pub struct Sequence {
    tokens: Vec<u32>,
    cache: KvCache,
}

/// How much of a prompt a held sequence gives ([`Sequence::reuse_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reuse {
    /// Leading prompt tokens taken from the cache (not prefilled again).
    pub tokens: usize,
    /// Why less of the cache than the prompt shares was reused, if so.
    pub limited_by: Option<ReuseLimit>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReuseLimit {
    /// The shared prefix is shorter than the cache's reuse floor.
    Floor(usize),
    /// A sliding-window ring no longer holds what cutting the cache back needs.
    Ring,
}

impl Sequence {
    /// `cache` must be one row holding exactly `tokens`.
    pub fn new(tokens: Vec<u32>, cache: KvCache) -> Result<Self, EngineError> {
        if cache.offsets() != [tokens.len()] {
            return Err(EngineError::Invalid(format!(
                "a sequence's cache must be one row holding its {} tokens, not rows of {:?}",
                tokens.len(),
                cache.offsets()
            )));
        }
        Ok(Sequence { tokens, cache })
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    pub fn into_parts(self) -> (Vec<u32>, KvCache) {
        (self.tokens, self.cache)
    }

    /// How many leading tokens of `prompt` this sequence can give ([`reuse_of`]).
    pub fn reuse_for(&self, prompt: &[u32]) -> Reuse {
        reuse_of(&self.tokens, &self.cache, prompt)
    }

    /// Cuts the sequence back to its first `keep` tokens (on every layer or none).
    pub fn cut_to(&mut self, keep: usize) -> Result<(), EngineError> {
        let drop = self.tokens.len().saturating_sub(keep);
        self.cache.trim(drop)?;
        self.tokens.truncate(keep);
        Ok(())
    }
}

/// The reuse rule, written once: the longest prefix `held` shares with `prompt`, short of
/// `prompt`'s last token (whose logits the caller needs), and nothing where that is below
/// `cache`'s reuse floor (its codec was fitted on more positions than a fresh cache's
/// would be) or where cutting back needs positions a sliding-window ring no longer holds.
/// `cache` holds `held` (one row).
pub fn reuse_of(held: &[u32], cache: &KvCache, prompt: &[u32]) -> Reuse {
    let common = held.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    let keep = common.min(prompt.len().saturating_sub(1));
    let none = |limited_by| Reuse {
        tokens: 0,
        limited_by,
    };
    if keep == 0 {
        return none(None);
    }
    if let Some(floor) = cache.minimum_reusable_offset().filter(|&f| keep < f) {
        return none(Some(ReuseLimit::Floor(floor)));
    }
    if !cache.can_trim(held.len() - keep) {
        return none(Some(ReuseLimit::Ring));
    }
    Reuse {
        tokens: keep,
        limited_by: None,
    }
}

#[cfg(test)]
mod tests {
    use super::{reuse_of, Reuse, ReuseLimit, Sequence};
    use candle_core::{DType, Device, Tensor};
    use tessera_kv::{AttentionCache, KvCache, KvScheme, LayerSpec, Retention};

    /// A one-layer, one-row cache of `scheme` fed `chunks` positions in turn.
    fn cache_fed(chunks: &[usize], retention: Retention, scheme: &str) -> KvCache {
        let spec = LayerSpec {
            kv_heads: 1,
            head_dim: 128,
            value_dim: 128,
            retention,
        };
        let scheme = KvScheme::parse(scheme).unwrap();
        let mut cache = KvCache::new(&[spec], &scheme, vec![0]).unwrap();
        for (c, &n) in chunks.iter().enumerate() {
            let k = Tensor::ones((1, 1, n, 128), DType::F32, &Device::Cpu).unwrap();
            let k = (k * (c as f64 + 1.0)).unwrap();
            cache.layer_mut(0).append_window(&k, &k).unwrap();
        }
        cache
    }

    fn reuse(tokens: usize, limited_by: Option<ReuseLimit>) -> Reuse {
        Reuse { tokens, limited_by }
    }

    #[test]
    fn the_shared_prefix_short_of_the_last_token_is_reused() {
        let held = [1, 2, 3, 4];
        let cache = cache_fed(&[4], Retention::Full, "bf16");
        // The previous prompt and reply, then a new turn.
        assert_eq!(reuse_of(&held, &cache, &[1, 2, 3, 4, 5, 6]), reuse(4, None));
        // The reply re-tokenized differently: back to where they part.
        assert_eq!(reuse_of(&held, &cache, &[1, 2, 3, 9, 5]), reuse(3, None));
        // Always one token left to feed, even when the prompt is all held.
        assert_eq!(reuse_of(&held, &cache, &[1, 2, 3]), reuse(2, None));
        assert_eq!(reuse_of(&held, &cache, &[7, 2]), reuse(0, None));
        assert_eq!(reuse_of(&held, &cache, &[]), reuse(0, None));
        let empty = cache_fed(&[], Retention::Full, "bf16");
        assert_eq!(reuse_of(&[], &empty, &[1, 2]), reuse(0, None));
        // The sequence cut to what it gives holds exactly that prefix.
        let mut s = Sequence::new(held.to_vec(), cache).unwrap();
        let r = s.reuse_for(&[1, 2, 3, 9, 5]);
        s.cut_to(r.tokens).unwrap();
        assert_eq!(s.tokens(), &[1, 2, 3]);
        assert_eq!(s.cache().offsets(), vec![3]);
        assert!(Sequence::new(vec![1, 2], cache_fed(&[3], Retention::Full, "bf16")).is_err());
    }

    #[test]
    fn never_below_the_reuse_floor_nor_past_what_a_ring_holds() {
        // A quantized cache whose codec was fitted on its first 512 positions: a prefix
        // shorter than that would be read with another fit than a fresh cache's.
        let held: Vec<u32> = (0..600).collect();
        let cache = cache_fed(&[512, 88], Retention::Full, "affine:4");
        let floor = cache.minimum_reusable_offset().unwrap();
        assert_eq!(floor, 512);
        assert_eq!(
            reuse_of(&held, &cache, &held[..300]),
            reuse(0, Some(ReuseLimit::Floor(512)))
        );
        let mut longer = held[..550].to_vec();
        longer.push(9999);
        assert_eq!(reuse_of(&held, &cache, &longer), reuse(550, None));
        // A ring of 16 that has wrapped cannot be cut back: the window of the position it
        // would end at reaches what was overwritten.
        let held: Vec<u32> = (0..40).collect();
        let ring = cache_fed(&[40], Retention::Window { size: 16 }, "bf16");
        assert_eq!(
            reuse_of(&held, &ring, &held[..11]),
            reuse(0, Some(ReuseLimit::Ring))
        );
        let mut more = held.clone();
        more.push(40);
        assert_eq!(reuse_of(&held, &ring, &more), reuse(40, None));
    }
}
