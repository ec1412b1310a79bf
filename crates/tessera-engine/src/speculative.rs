//! Speculative decoding: a drafter proposes the next few tokens, the target reads the last
//! decided token and the draft as one chunk inside a speculative round of its cache, keeps
//! the drafts its own sampling rule accepts plus one token of its own, and rolls its cache
//! (and the drafter's) back to what it kept. The rounds run inside a [`crate::Batch`]
//! ([`crate::BatchSpec`]): every row has its own drafter, one forward verifies every row's
//! draft, and the row's output stage holds the one verification loop.
//!
//! Two drafters share one trait ([`Drafter`]): prompt lookup ([`NgramDrafter`]: the
//! continuation of the latest earlier occurrence of the last few tokens, no second model;
//! on an editing task most of the output copies the prompt) and a small model of the same
//! vocabulary ([`ModelDrafter`], its own session and cache, rolled back per round).
//!
//! Verification is the standard rule (Leviathan et al. 2023, Chen et al. 2023): a draft
//! token `x` drawn from the drafter's distribution `q` is accepted with probability
//! `min(1, p(x) / q(x))`, where `p` is the distribution the target's sampler would draw
//! from at that position (penalties, temperature and filters applied); the first rejected
//! position takes a token from the residual `max(p − q, 0)`, normalized; a round that
//! accepts every draft adds a token drawn from `p` after the last. Each output token is
//! then distributed exactly as the target's sampler would have it. Under greedy sampling
//! `p` puts all its mass on the argmax, so the rule keeps the drafts that equal the
//! target's argmax and then takes the argmax: plain greedy decode, bit for bit (the
//! kernels are batch-invariant: a position's logits do not depend on the chunk it is read
//! in). The draft length adapts ([`DraftLength`]): halved after
//! a round that accepts nothing, doubled after one that accepts everything, and drafting
//! pauses for a while after single drafts keep failing.

use crate::sampler::{Dist, Sampler, SamplerConfig};
use crate::{EngineError, Session, DEFAULT_PREFILL_CHUNK};
use tessera_kv::KvScheme;
use tessera_models::{LogitsMode, Model};

/// A proposal: the drafted tokens and the distribution each was drawn from (a point mass
/// where the drafter chose deterministically).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub q: Vec<Dist>,
}

/// Proposes tokens for the target to verify.
pub trait Drafter {
    /// Reads what it needs of `history` before the first round (a draft model's prefill),
    /// so the first round does not pay for it.
    fn prefill(&mut self, _history: &[u32]) -> Result<(), EngineError> {
        Ok(())
    }

    /// Up to `k` tokens continuing `history` (the prompt and every token decided so far);
    /// fewer, or none, where it has no proposal.
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Draft, EngineError>;

    /// The target kept the first `accepted` tokens of the last draft.
    fn accepted(&mut self, _accepted: usize) -> Result<(), EngineError> {
        Ok(())
    }
}

/// Prompt-lookup drafting: match the last `n` tokens (then `n - 1`, … down to 1) against
/// the history, propose what followed their latest earlier occurrence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramDrafter {
    /// The longest suffix matched.
    pub n: usize,
}

impl NgramDrafter {
    /// Up to `k` tokens that followed the latest earlier occurrence of `history`'s longest
    /// matching suffix (of at most `n` tokens); empty when nothing matches.
    pub fn lookup(&self, history: &[u32], k: usize) -> Vec<u32> {
        let len = history.len();
        for n in (1..=self.n.min(len.saturating_sub(1))).rev() {
            let pattern = &history[len - n..];
            // Latest first; the occurrence must be followed by at least one token.
            for start in (0..len - n).rev() {
                if &history[start..start + n] == pattern {
                    let from = start + n;
                    return history[from..(from + k).min(len)].to_vec();
                }
            }
        }
        Vec::new()
    }
}

impl Drafter for NgramDrafter {
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Draft, EngineError> {
        let tokens = self.lookup(history, k);
        let q = tokens.iter().map(|&t| Dist::point(t)).collect();
        Ok(Draft { tokens, q })
    }
}

/// Drafting with a smaller model of the same vocabulary: its own session (round slack for
/// the drafts), fed the history it has not seen, then `k` tokens one at a time inside a
/// round that [`Drafter::accepted`] rolls back to what the target kept. Under greedy
/// sampling it drafts its argmax; otherwise it draws from its own logits under the target's
/// temperature and filters (no penalties: any `q` is exact, this one is close to `p`).
pub struct ModelDrafter<'m> {
    session: Session<'m>,
    model: &'m Model,
    scheme: KvScheme,
    max_draft: usize,
    sampler: Sampler,
    /// Drafts fed inside the open round (the last draft is never fed).
    open: usize,
    round_open: bool,
}

impl<'m> ModelDrafter<'m> {
    /// A drafter over `model` for drafts of up to `max_draft` tokens, its cache in
    /// `scheme`. `sampler` is the target's: its temperature and filters shape the drafts.
    /// Refused when the drafter's vocabulary is not the target's.
    pub fn new(
        model: &'m Model,
        target: &Model,
        scheme: &KvScheme,
        max_draft: usize,
        sampler: &SamplerConfig,
    ) -> Result<Self, EngineError> {
        if model.vocab_size() != target.vocab_size() {
            return Err(EngineError::Invalid(format!(
                "the draft model's vocabulary has {} tokens, the target's {}: a drafter must \
                 share the target's vocabulary",
                model.vocab_size(),
                target.vocab_size()
            )));
        }
        let config = SamplerConfig {
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: sampler.seed ^ 0xD1B5_4A32_D192_ED03,
            ..sampler.clone()
        };
        Ok(ModelDrafter {
            session: Self::fresh(model, scheme, max_draft)?,
            model,
            scheme: scheme.clone(),
            max_draft,
            sampler: Sampler::new(config),
            open: 0,
            round_open: false,
        })
    }

    fn fresh(
        model: &'m Model,
        scheme: &KvScheme,
        max_draft: usize,
    ) -> Result<Session<'m>, EngineError> {
        Ok(Session::new(model, scheme, DEFAULT_PREFILL_CHUNK)?.with_round_slack(max_draft))
    }

    pub fn session(&self) -> &Session<'m> {
        &self.session
    }

    /// Cuts the session back to the longest prefix it shares with `history` (short of all
    /// of it: the last token is fed for logits); a fresh cache where a ring cannot be cut.
    fn sync(&mut self, history: &[u32]) -> Result<(), EngineError> {
        let held = self.session.tokens();
        let common = held
            .iter()
            .zip(history)
            .take_while(|(a, b)| a == b)
            .count()
            .min(history.len().saturating_sub(1));
        if common < held.len() && self.session.truncate(common).is_err() {
            self.session = Self::fresh(self.model, &self.scheme, self.max_draft)?;
        }
        Ok(())
    }
}

impl ModelDrafter<'_> {
    /// `k` tokens, the first drawn from `logits`, each fed for the next but the last.
    fn draft_in_round(&mut self, mut logits: Vec<f32>, k: usize) -> Result<Draft, EngineError> {
        let mut draft = Draft::default();
        for i in 0..k {
            let q = self.sampler.distribution(&logits, &[], &[]);
            let t = self.sampler.draw(&q);
            draft.tokens.push(t);
            draft.q.push(q);
            if i + 1 < k {
                logits = self.session.forward(&[t], LogitsMode::Last)?;
                self.open += 1;
            }
        }
        Ok(draft)
    }
}

impl Drafter for ModelDrafter<'_> {
    fn prefill(&mut self, history: &[u32]) -> Result<(), EngineError> {
        self.sync(history)?;
        let fed = self.session.tokens().len();
        // All but the last token: the first draft feeds it and drafts from its logits.
        if fed + 1 < history.len() {
            self.session.feed(&history[fed..history.len() - 1])?;
        }
        Ok(())
    }

    fn draft(&mut self, history: &[u32], k: usize) -> Result<Draft, EngineError> {
        if history.is_empty() {
            return Ok(Draft::default());
        }
        self.sync(history)?;
        // Never past the drafter's own context: the new history and k - 1 fed drafts.
        let fed = self.session.tokens().len();
        let k = k.min((self.session.context_left() + 1).saturating_sub(history.len() - fed));
        if k == 0 {
            return Ok(Draft::default());
        }
        let logits = self.session.feed(&history[fed..])?;
        self.session.round_open()?;
        self.round_open = true;
        let drafted = self.draft_in_round(logits, k);
        if drafted.is_err() {
            // Closes the round as it was.
            let _ = self.accepted(0);
        }
        drafted
    }

    fn accepted(&mut self, accepted: usize) -> Result<(), EngineError> {
        if !self.round_open {
            return Ok(());
        }
        let keep = accepted.min(self.open);
        let fed = std::mem::take(&mut self.open);
        self.round_open = false;
        self.session.round_close(fed, keep)
    }
}

/// Leviathan et al.'s rule at one draft position: `Ok(())` keeps `token` (drawn from `q`),
/// `Err(t)` replaces it with `t` drawn from the residual `max(p − q, 0)`. No randomness is
/// spent where `p(token) ≥ q(token)` (always accepted) or `p(token) = 0` (never), nor on a
/// residual of one candidate, so greedy verification is deterministic.
pub fn verify_token(p: &Dist, q: &Dist, token: u32, sampler: &mut Sampler) -> Result<(), u32> {
    let (pt, qt) = (p.prob(token), q.prob(token));
    if pt >= qt || (pt > 0.0 && sampler.uniform() * qt < pt) {
        return Ok(());
    }
    // q by id, so the residual is one pass (a draft model's q may hold the whole vocabulary).
    let mut q_by_id = vec![0f32; q.ids.iter().max().map_or(0, |&m| m as usize + 1)];
    for (&id, &qq) in q.ids.iter().zip(&q.probs) {
        q_by_id[id as usize] = qq;
    }
    let residual: Vec<f32> = p
        .ids
        .iter()
        .zip(&p.probs)
        .map(|(&id, &pp)| (pp - q_by_id.get(id as usize).copied().unwrap_or(0.0)).max(0.0))
        .collect();
    let total: f32 = residual.iter().sum();
    if total <= 0.0 {
        // p ≤ q everywhere but token was rejected: only rounding gets here; p itself.
        return Err(sampler.draw(p));
    }
    let residual = Dist {
        ids: p.ids.clone(),
        probs: residual.into_iter().map(|r| r / total).collect(),
    };
    Err(sampler.draw(&residual))
}

/// How many tokens the next round drafts: halved after a round that keeps none of its
/// drafts, doubled (up to the most) after one that keeps all. A round of one draft that
/// keeps nothing also starts a back-off: the next 1, then 2, 4, … up to 16 steps decode
/// plainly, until a round keeps a draft again. On output the drafter cannot predict, a
/// failed round costs more than a step (a chunk of two positions), so drafting pauses there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftLength {
    max: usize,
    k: usize,
    backoff: usize,
    wait: usize,
}

impl DraftLength {
    /// The longest back-off, in plain steps.
    pub const MAX_BACKOFF: usize = 16;

    pub fn new(max: usize) -> Self {
        DraftLength {
            max,
            k: max,
            backoff: 0,
            wait: 0,
        }
    }

    /// The most tokens this round may draft; 0 while backing off (a plain step). Called
    /// once per step.
    pub fn next(&mut self) -> usize {
        if self.wait > 0 {
            self.wait -= 1;
            0
        } else {
            self.k
        }
    }

    /// After a round that drafted `drafted` tokens and kept `accepted`.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        if accepted == 0 {
            if self.k == 1 {
                self.backoff = (2 * self.backoff).clamp(1, Self::MAX_BACKOFF);
                self.wait = self.backoff;
            }
            self.k = (self.k / 2).max(1);
        } else {
            self.backoff = 0;
            if accepted == drafted {
                self.k = (2 * self.k).min(self.max);
            }
        }
    }
}

/// What the rounds did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Verification rounds (forwards with a draft) and plain decode steps (no draft).
    pub rounds: usize,
    pub plain_steps: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// `accepted_at[i]`: rounds whose draft position `i` was accepted.
    pub accepted_at: Vec<usize>,
    /// `drafted_at[i]`: rounds that drafted a token at position `i`.
    pub drafted_at: Vec<usize>,
}

impl SpecStats {
    /// Counts one round that drafted `drafted` tokens and kept `accepted`.
    pub fn count_round(&mut self, drafted: usize, accepted: usize) {
        self.rounds += 1;
        self.drafted += drafted;
        self.accepted += accepted;
        if self.drafted_at.len() < drafted {
            self.drafted_at.resize(drafted, 0);
            self.accepted_at.resize(drafted, 0);
        }
        self.drafted_at[..drafted].iter_mut().for_each(|n| *n += 1);
        self.accepted_at[..accepted]
            .iter_mut()
            .for_each(|n| *n += 1);
    }

    /// Adds `other`'s counts, position by position.
    pub fn add(&mut self, other: &SpecStats) {
        let sum = |x: &mut Vec<usize>, y: &[usize]| {
            if x.len() < y.len() {
                x.resize(y.len(), 0);
            }
            x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        };
        self.rounds += other.rounds;
        self.plain_steps += other.plain_steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        sum(&mut self.drafted_at, &other.drafted_at);
        sum(&mut self.accepted_at, &other.accepted_at);
    }

    /// Tokens decided per target forward.
    pub fn tokens_per_forward(&self) -> f64 {
        let forwards = self.rounds + self.plain_steps;
        (self.accepted + forwards) as f64 / forwards.max(1) as f64
    }

    /// One line for a summary: rounds, drafted, accepted (share), tokens per forward, and
    /// the acceptance rate at each draft position.
    pub fn summary(&self) -> String {
        let by_position: Vec<String> = self
            .accepted_at
            .iter()
            .zip(&self.drafted_at)
            .map(|(&a, &d)| format!("{:.0}", 100.0 * a as f64 / d.max(1) as f64))
            .collect();
        format!(
            "{} rounds, {} drafted, {} accepted ({:.0}%), {:.2} tokens per forward, accepted by position % [{}]",
            self.rounds,
            self.drafted,
            self.accepted,
            100.0 * self.accepted as f64 / self.drafted.max(1) as f64,
            self.tokens_per_forward(),
            by_position.join(" ")
        )
    }
}

impl Session<'_> {
    /// Opens a speculative round on the cache: what follows can be rolled back.
    pub(crate) fn round_open(&mut self) -> Result<(), EngineError> {
        self.cache_mut().round_begin()?;
        Ok(())
    }

    /// Closes the open round keeping `keep` of the `fed` positions read inside it.
    pub(crate) fn round_close(&mut self, fed: usize, keep: usize) -> Result<(), EngineError> {
        self.cache_mut().round_rollback(&[keep])?;
        self.drop_last_tokens(fed - keep);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{verify_token, NgramDrafter};
    use crate::sampler::{Dist, Sampler, SamplerConfig};

    /// Pearson's statistic of `counts` against probabilities `p`, and the critical value at
    /// a significance of 1e-4 (Wilson–Hilferty's approximation of the chi-square quantile).
    fn chi_square(counts: &[usize], p: &[f64]) -> (f64, f64) {
        let n: usize = counts.iter().sum();
        let mut stat = 0.0;
        let mut df = 0usize;
        for (&c, &pi) in counts.iter().zip(p) {
            let e = pi * n as f64;
            if e > 0.0 {
                stat += (c as f64 - e).powi(2) / e;
                df += 1;
            } else {
                assert_eq!(c, 0, "a token of probability 0 was drawn");
            }
        }
        let df = (df - 1) as f64;
        let z = 3.719;
        let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
        (stat, crit)
    }

    fn dist(probs: &[f64]) -> Dist {
        let total: f64 = probs.iter().sum();
        let (ids, probs) = probs
            .iter()
            .enumerate()
            .filter(|(_, &p)| p > 0.0)
            .map(|(i, &p)| (i as u32, (p / total) as f32))
            .unzip();
        Dist { ids, probs }
    }

    /// Draft from `q`, verify against `p`, many times: the output follows `p`.
    fn speculative_counts(p: &[f64], q: &[f64], trials: usize, seed: u64) -> Vec<usize> {
        let (pd, qd) = (dist(p), dist(q));
        let config = SamplerConfig {
            temperature: 1.0,
            seed,
            ..Default::default()
        };
        let mut drafter = Sampler::new(SamplerConfig {
            seed: seed + 1,
            ..config.clone()
        });
        let mut target = Sampler::new(config);
        let mut counts = vec![0; p.len()];
        for _ in 0..trials {
            let x = drafter.draw(&qd);
            let out = match verify_token(&pd, &qd, x, &mut target) {
                Ok(()) => x,
                Err(r) => r,
            };
            counts[out as usize] += 1;
        }
        counts
    }

    #[test]
    fn the_rejection_rule_gives_the_target_distribution() {
        let total = |v: &[f64]| -> Vec<f64> {
            let t: f64 = v.iter().sum();
            v.iter().map(|x| x / t).collect()
        };
        let p = total(&[0.30, 0.05, 0.25, 0.0, 0.15, 0.25]);
        // A drafter close to p, one far from it, one whose support misses p's and adds
        // a token p never draws, and a deterministic one (prompt lookup).
        let qs: [&[f64]; 4] = [
            &[0.25, 0.10, 0.25, 0.0, 0.20, 0.20],
            &[0.02, 0.60, 0.02, 0.0, 0.30, 0.06],
            &[0.40, 0.0, 0.0, 0.30, 0.30, 0.0],
            &[0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        ];
        for (i, q) in qs.iter().enumerate() {
            let counts = speculative_counts(&p, q, 100_000, 11 + i as u64);
            let (stat, crit) = chi_square(&counts, &p);
            assert!(
                stat < crit,
                "q {i}: chi-square {stat:.1} ≥ {crit:.1}, counts {counts:?}"
            );
            // The test can fail: keeping every draft gives q, not p.
            let (stat_q, _) = chi_square_against_drafts(q, &p, 100_000);
            assert!(
                stat_q > crit,
                "q {i}: accepting every draft should be told apart"
            );
        }
    }

    /// The statistic of a sampler that keeps every draft (its output is `q`) against `p`.
    fn chi_square_against_drafts(q: &[f64], p: &[f64], trials: usize) -> (f64, f64) {
        let qd = dist(q);
        let mut s = Sampler::new(SamplerConfig {
            temperature: 1.0,
            seed: 5,
            ..Default::default()
        });
        let mut counts = vec![0; p.len()];
        for _ in 0..trials {
            counts[s.draw(&qd) as usize] += 1;
        }
        // Tokens p never draws count as a certain failure.
        if counts.iter().zip(p).any(|(&c, &pi)| c > 0 && pi == 0.0) {
            return (f64::INFINITY, 0.0);
        }
        chi_square(&counts, p)
    }

    #[test]
    fn the_draft_length_adapts_and_backs_off() {
        let mut len = super::DraftLength::new(8);
        assert_eq!(len.next(), 8);
        len.update(8, 3);
        assert_eq!(len.next(), 8, "a partial round keeps the length");
        for want in [4, 2, 1] {
            len.update(8, 0);
            assert_eq!(len.next(), want);
        }
        // Single drafts failing: 1, 2, 4 … 16 plain steps between them.
        let mut waits = Vec::new();
        for _ in 0..6 {
            len.update(1, 0);
            let mut wait = 0;
            while len.next() == 0 {
                wait += 1;
            }
            waits.push(wait);
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 16]);
        // A kept draft ends the back-off; a fully kept one doubles the length.
        len.update(1, 1);
        assert_eq!(len.next(), 2);
        len.update(2, 0);
        assert_eq!(len.next(), 1, "halved, no back-off yet");
        len.update(1, 0);
        assert_eq!(len.next(), 0, "the back-off starts over at one step");
        assert_eq!(len.next(), 1);
    }

    #[test]
    fn greedy_verification_keeps_the_argmax_and_spends_no_randomness() {
        let p = Dist::point(4);
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(verify_token(&p, &Dist::point(4), 4, &mut s), Ok(()));
        assert_eq!(verify_token(&p, &Dist::point(2), 2, &mut s), Err(4));
        let q = dist(&[0.5, 0.0, 0.25, 0.0, 0.25]);
        assert_eq!(verify_token(&p, &q, 0, &mut s), Err(4));
        assert_eq!(verify_token(&p, &q, 4, &mut s), Ok(()));
        // The state is untouched: the next draw equals a fresh sampler's.
        let mut fresh = Sampler::new(SamplerConfig::default());
        assert_eq!(s.uniform(), fresh.uniform());
    }

    #[test]
    fn drafts_continue_the_latest_earlier_occurrence_of_the_longest_suffix() {
        let d = NgramDrafter { n: 3 };
        // "1 2 3" occurred at 0 (followed by 4 5) and at 5 (followed by 9): latest wins.
        let h = [1, 2, 3, 4, 5, 1, 2, 3, 9, 7, 1, 2, 3];
        assert_eq!(d.lookup(&h, 4), vec![9, 7, 1, 2]);
        // Capped at k, and at the history's end.
        assert_eq!(d.lookup(&h, 2), vec![9, 7]);
        // No 3-gram or 2-gram match: the last token alone.
        let h = [5, 6, 7, 8, 6, 9, 7];
        assert_eq!(d.lookup(&h, 3), vec![8, 6, 9]);
        // Nothing matches.
        assert!(d.lookup(&[1, 2, 3], 3).is_empty());
        assert!(d.lookup(&[], 3).is_empty());
        assert!(d.lookup(&[4], 3).is_empty());
    }
}
