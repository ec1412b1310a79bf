//! Row operations and speculative rounds against an independent model of the batch.
//!
//! The model keeps, per row, the input vectors of its surviving real positions, its left
//! padding, the oldest position its sliding-window ring still holds (from the definition:
//! a ring of `window + slack` slots holds the latest `window + slack` positions written, a
//! rewind does not bring evicted ones back) and the row's history of appends and rewinds.
//! A random sequence of appends, merges, extends, filters, extracts, aligns, trims and
//! speculative rounds (random per-row keeps) runs on a two-layer cache (a sliding window
//! whose ring wraps, and a full layer); refusals are predicted from the definitions and a
//! refused operation must leave the cache's state as it was. Afterwards, for every row:
//!
//! - its stored positions (read back as a drafter reads them) are the model's, bit for bit
//!   (plain: the input rounded to the dtype), and those of a fresh one-row cache fed only
//!   that row's history;
//! - the reads of a decode step and of a chunk equal an f64 attention over the modelled
//!   stored values, masked from the definition (causal, window), at every
//!   [`Isa::supported`] level, and equal the fresh one-row cache's reads.
//!
//! TurboQuant and affine storage are compared with the fresh one-row cache only (and, bit
//! for bit, in stored values): their key preparation (affine: the key means) is fitted per
//! row, at conversion, on the keys the row held then, so a model would have to
//! re-implement the fit; the fresh cache replays the row's own appends (the same chunks,
//! so it converts on the same keys) and rewinds. reads.rs checks both codecs' reads against
//! an f64 reference over modelled stored values.
//!
//! `state()` → `from_state` → `state()` is checked bit for bit, and the restored cache's
//! next reads equal the original's exactly.

use candle_core::{Device, Tensor};
use half::{bf16, f16};
use proptest::prelude::*;
use proptest::test_runner::Config;
use tessera_kv::{
    AttentionCache, Codec, Isa, KvCache, KvError, KvScheme, LayerSpec, PlainDType, Retention,
    TurboPrep,
};

const D: usize = 64;
const SCALE: f32 = 0.125; // 1 / sqrt(D)
/// Largest accepted `|got − want| / (1 + |want|)` (f32 kernels against f64 on the same
/// stored values; a key masked wrongly or a code off moves an output by ~1e-3).
const TOLERANCE: f32 = 1e-5;
/// Rows a batch grows to at most.
const MAX_ROWS: usize = 5;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

#[derive(Debug, Clone, Copy)]
struct Cfg {
    codec: Codec,
    kvh: usize,
    gqa: usize,
    window: usize,
    slack: usize,
    /// The scheme's `quantized_kv_start`.
    start: usize,
}

impl Cfg {
    fn ring(&self) -> usize {
        self.window + self.slack
    }

    fn qh(&self) -> usize {
        self.kvh * self.gqa
    }

    /// Layer 0 a sliding window (its refusals come before layer 1 changes), layer 1 full.
    fn specs(&self) -> [LayerSpec; 2] {
        let spec = |retention| LayerSpec {
            kv_heads: self.kvh,
            head_dim: D,
            value_dim: D,
            retention,
        };
        [
            spec(Retention::Window { size: self.window }),
            spec(Retention::Full),
        ]
    }

    fn new_cache(&self, pads: Vec<usize>) -> KvCache {
        let mut scheme = KvScheme::uniform(self.codec);
        scheme.quantized_kv_start = self.start;
        KvCache::new(&self.specs(), &scheme, pads)
            .unwrap()
            .with_round_slack(self.slack)
    }

    fn layer_window(&self, layer: usize) -> Option<usize> {
        (layer == 0).then_some(self.window)
    }
}

/// One position's keys and values, `kv_heads × D` each.
#[derive(Debug, Clone)]
struct Tok {
    k: Vec<f32>,
    v: Vec<f32>,
}

fn tok(cfg: &Cfg, seed: &mut u64) -> Tok {
    let n = cfg.kvh * D;
    Tok {
        k: (0..n).map(|_| lcg(seed)).collect(),
        v: (0..n).map(|_| lcg(seed)).collect(),
    }
}

#[derive(Debug, Clone)]
enum Event {
    Append(Vec<Tok>),
    Truncate(usize),
}

#[derive(Debug, Clone)]
struct RowModel {
    pad: usize,
    /// The surviving real positions.
    toks: Vec<Tok>,
    /// The oldest real position the window layer's ring still holds.
    held: usize,
    history: Vec<Event>,
}

impl RowModel {
    fn len(&self) -> usize {
        self.toks.len()
    }

    fn end(&self) -> usize {
        self.pad + self.len()
    }

    fn append(&mut self, toks: &[Tok], ring: usize) {
        self.toks.extend_from_slice(toks);
        self.held = self.held.max(self.len().saturating_sub(ring));
        self.history.push(Event::Append(toks.to_vec()));
    }

    /// A rewind to `len` real positions. A ring that held nothing below `held` still holds
    /// nothing below `len` after a rewind below `held` (only a rewind to no positions at all
    /// gets there), and holds each position appended from then on.
    fn truncate(&mut self, len: usize) {
        if len < self.len() {
            self.toks.truncate(len);
            self.history.push(Event::Truncate(len));
        }
        self.held = self.held.min(len);
    }

    /// Whether the window layer can return this row to `len` real positions: its next query
    /// sees positions `max(0, len + 1 − window) .. len`, all of which the ring must hold.
    fn can_rewind(&self, len: usize, window: usize) -> bool {
        let needed = (len + 1).saturating_sub(window).min(len);
        needed == len || needed >= self.held
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    Ring,
    TooFar,
    Rows,
    RowCount,
}

fn kind(e: &KvError) -> Refusal {
    match e {
        KvError::RingOverwritten { .. } => Refusal::Ring,
        KvError::TrimTooFar { .. } => Refusal::TooFar,
        KvError::Rows(_) => Refusal::Rows,
        KvError::RowCount { .. } => Refusal::RowCount,
        other => panic!("unexpected error {other}"),
    }
}

/// `rows[r]` (`n` positions each) as `(rows, kv_heads, n, D)` keys and values.
fn tensors(cfg: &Cfg, rows: &[Vec<Tok>]) -> (Tensor, Tensor) {
    let n = rows[0].len();
    let build = |pick: fn(&Tok) -> &Vec<f32>| {
        let mut data = Vec::with_capacity(rows.len() * cfg.kvh * n * D);
        for row in rows {
            for h in 0..cfg.kvh {
                for t in row {
                    data.extend_from_slice(&pick(t)[h * D..(h + 1) * D]);
                }
            }
        }
        Tensor::from_vec(data, (rows.len(), cfg.kvh, n, D), &Device::Cpu).unwrap()
    };
    (build(|t| &t.k), build(|t| &t.v))
}

/// Appends to every layer, the window layer first: a refusal (a round's guard) comes from
/// it, before any layer has changed.
fn append_all(cache: &mut KvCache, k: &Tensor, v: &Tensor) -> Result<(), KvError> {
    for l in 0..cache.layers().len() {
        let layer = cache.layer_mut(l);
        if k.dims()[2] == 1 {
            layer.append_decode(k, v)?;
        } else {
            layer.append_window(k, v)?;
        }
    }
    Ok(())
}

/// The model of the cache under test.
struct Batch {
    cfg: Cfg,
    rows: Vec<RowModel>,
    /// Real lengths when the open round began.
    round: Option<Vec<usize>>,
    seed: u64,
}

impl Batch {
    fn end(&self) -> usize {
        self.rows.iter().map(RowModel::end).max().unwrap_or(0)
    }

    /// A new cache of rows padded by `pads`, holding its first chunk of `max(pads) + 1 +
    /// extra` positions (padding first), and its model rows.
    fn new_cache(&mut self, pads: &[usize], extra: usize) -> (KvCache, Vec<RowModel>) {
        let cfg = self.cfg;
        let n = pads.iter().max().unwrap() + 1 + extra;
        let mut cache = cfg.new_cache(pads.to_vec());
        let chunks: Vec<Vec<Tok>> = pads
            .iter()
            .map(|_| (0..n).map(|_| tok(&cfg, &mut self.seed)).collect())
            .collect();
        let (k, v) = tensors(&cfg, &chunks);
        append_all(&mut cache, &k, &v).unwrap();
        let rows = pads
            .iter()
            .zip(&chunks)
            .map(|(&pad, chunk)| {
                let mut row = RowModel {
                    pad,
                    toks: Vec::new(),
                    held: 0,
                    history: Vec::new(),
                };
                row.append(&chunk[pad..], cfg.ring());
                row
            })
            .collect();
        (cache, rows)
    }

    /// Checks what the cache reports about its rows against the model.
    fn check_rows(&self, cache: &KvCache, what: &str) {
        let pads: Vec<usize> = self.rows.iter().map(|r| r.pad).collect();
        let lens: Vec<usize> = self.rows.iter().map(RowModel::len).collect();
        let ends: Vec<usize> = self.rows.iter().map(RowModel::end).collect();
        assert_eq!(cache.left_pad(), pads.as_slice(), "{what}: left padding");
        assert_eq!(cache.offsets(), lens, "{what}: offsets");
        assert_eq!(cache.ends(), ends, "{what}: ends");
        assert_eq!(cache.end(), self.end(), "{what}: end");
        let window_held: Vec<usize> = self.rows.iter().map(|r| r.pad + r.held).collect();
        assert_eq!(
            cache.layers()[0].rows().held_from(),
            window_held.as_slice(),
            "{what}: oldest positions the ring holds"
        );
        assert_eq!(
            cache.layers()[1].rows().held_from(),
            pads.as_slice(),
            "{what}: a full layer holds every position"
        );
        for layer in cache.layers() {
            assert_eq!(
                layer.rows().round().is_some(),
                self.round.is_some(),
                "{what}: round open"
            );
        }
    }

    /// `n` new positions for every row; `refused`: what the round guard should say.
    fn append(&mut self, cache: &mut KvCache, n: usize, what: &str) {
        let cfg = self.cfg;
        let chunks: Vec<Vec<Tok>> = self
            .rows
            .iter()
            .map(|_| (0..n).map(|_| tok(&cfg, &mut self.seed)).collect())
            .collect();
        // Inside a round, an append may not overwrite what a rollback to the round's start
        // needs: positions max(0, b + 1 − window) .. b of a row that began the round at b.
        let refused = self.round.as_ref().is_some_and(|before| {
            self.rows.iter().zip(before).any(|(row, &b)| {
                let needed = (b + 1).saturating_sub(cfg.window).min(b);
                let held = row.held.max((row.len() + n).saturating_sub(cfg.ring()));
                needed < b && held > needed
            })
        });
        let (k, v) = tensors(&cfg, &chunks);
        let before = cache.state().unwrap();
        match append_all(cache, &k, &v) {
            Ok(()) => {
                assert!(!refused, "{what}: append of {n} should be refused");
                for (row, chunk) in self.rows.iter_mut().zip(&chunks) {
                    row.append(chunk, cfg.ring());
                }
            }
            Err(e) => {
                assert!(refused, "{what}: append of {n} refused: {e}");
                assert_eq!(kind(&e), Refusal::Ring, "{what}: {e}");
                assert_eq!(
                    cache.state().unwrap(),
                    before,
                    "{what}: a refusal changes nothing"
                );
            }
        }
    }

    /// Runs `op` on the cache; `expect` is the model's verdict. On success `apply` updates
    /// the model; on a refusal the cache must be unchanged.
    fn expect(
        &mut self,
        cache: &mut KvCache,
        what: &str,
        expect: Option<Refusal>,
        op: impl FnOnce(&mut KvCache) -> Result<(), KvError>,
        apply: impl FnOnce(&mut Self),
    ) {
        let before = cache.state().unwrap();
        match (op(cache), expect) {
            (Ok(()), None) => apply(self),
            (Ok(()), Some(r)) => panic!("{what}: accepted, the model refuses ({r:?})"),
            (Err(e), None) => panic!("{what}: refused ({e}), the model accepts"),
            (Err(e), Some(r)) => {
                assert_eq!(kind(&e), r, "{what}: {e}");
                assert_eq!(
                    cache.state().unwrap(),
                    before,
                    "{what}: a refusal changes nothing"
                );
            }
        }
        self.check_rows(cache, what);
    }

    /// The verdict on rewinding each row to `lens[r]` real positions.
    fn rewind_verdict(&self, lens: &[usize]) -> Option<Refusal> {
        let ring = self
            .rows
            .iter()
            .zip(lens)
            .any(|(row, &len)| !row.can_rewind(len, self.cfg.window));
        ring.then_some(Refusal::Ring)
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A new cache (`pads`, a first chunk of `max(pads) + 1 + extra`), joined to the batch
    /// by `extend` (0), `merge([new, batch])` (1) or `merge([batch, new])` (2).
    New {
        pads: Vec<usize>,
        extra: usize,
        how: u8,
    },
    Append {
        n: usize,
    },
    /// Keep rows `picks[i] % rows` (7: a row out of range), deduplicated, in that order.
    Filter {
        picks: Vec<usize>,
    },
    /// `retain` of the rows not in `gone` (each `% 8`), in order, or with `fill` each gap
    /// below the kept count taken by one of the last rows (as a server's batch does): in
    /// place (padding as it is) where the rows can stay and the shared padding is under
    /// half the width, otherwise as `filter`.
    Retain {
        gone: Vec<usize>,
        fill: bool,
    },
    /// `extract(row % rows)` (7: out of range), replacing the batch or extended onto it.
    Extract {
        row: usize,
        replace: bool,
    },
    Align {
        pads: Vec<usize>,
        wrong_len: bool,
    },
    /// `round_begin`, the appends, then commit, or a rollback keeping `keeps[r] %
    /// (appended + 2)` (one too many: refused, then retried with keeps clamped). `meddle`
    /// after the first append: 0 filter, 1 extract, 2 align to other pads, 3 a second
    /// round_begin (all refused), 4 a state round trip (the restored cache goes on).
    Round {
        appends: Vec<usize>,
        keeps: Vec<usize>,
        commit: bool,
        meddle: u8,
    },
    /// Per row `counts[r] % (len + 1)` (63: one more than the row's end), or all rows the
    /// first count, bounded by the shortest row.
    Trim {
        counts: Vec<usize>,
        uniform: bool,
    },
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let per_row = |hi| prop::collection::vec(0usize..hi, MAX_ROWS + 1);
    prop_oneof![
        2 => (prop::collection::vec(0usize..4, 1..=3), 0usize..7, 0u8..3)
            .prop_map(|(pads, extra, how)| Op::New { pads, extra, how }),
        3 => (1usize..=7).prop_map(|n| Op::Append { n }),
        1 => prop::collection::vec(0usize..8, 0..4).prop_map(|picks| Op::Filter { picks }),
        2 => (prop::collection::vec(0usize..8, 0..4), any::<bool>())
            .prop_map(|(gone, fill)| Op::Retain { gone, fill }),
        1 => (0usize..8, any::<bool>()).prop_map(|(row, replace)| Op::Extract { row, replace }),
        1 => (per_row(5), prop::bool::weighted(0.15))
            .prop_map(|(pads, wrong_len)| Op::Align { pads, wrong_len }),
        3 => (prop::collection::vec(1usize..=4, 1..=3), per_row(64), any::<bool>(), 0u8..7)
            .prop_map(|(appends, keeps, commit, meddle)| Op::Round { appends, keeps, commit, meddle }),
        2 => (per_row(64), any::<bool>()).prop_map(|(counts, uniform)| Op::Trim { counts, uniform }),
    ]
}

/// Joins caches' rows as `KvCache::merge` does: left padded to the widest end.
fn merged_rows(parts: Vec<(usize, Vec<RowModel>)>) -> Vec<RowModel> {
    let width = parts.iter().map(|(end, _)| *end).max().unwrap();
    parts
        .into_iter()
        .flat_map(|(end, rows)| {
            rows.into_iter().map(move |mut r| {
                r.pad += width - end;
                r
            })
        })
        .collect()
}

fn run_op(batch: &mut Batch, cache: &mut KvCache, op: &Op, step: usize) {
    let what = format!("op {step} {op:?}");
    let rows = batch.rows.len();
    match op {
        Op::New { pads, extra, how } => {
            if rows + pads.len() > MAX_ROWS {
                return;
            }
            let (new, new_rows) = batch.new_cache(pads, *extra);
            let new_end = new_rows.iter().map(RowModel::end).max().unwrap();
            let main = std::mem::take(cache);
            let (main_end, main_rows) = (batch.end(), std::mem::take(&mut batch.rows));
            let (merged, model) = match how {
                0 => {
                    let mut main = main;
                    main.extend(new).unwrap();
                    (
                        main,
                        merged_rows(vec![(main_end, main_rows), (new_end, new_rows)]),
                    )
                }
                1 => (
                    KvCache::merge(vec![new, main]).unwrap(),
                    merged_rows(vec![(new_end, new_rows), (main_end, main_rows)]),
                ),
                _ => (
                    KvCache::merge(vec![main, new]).unwrap(),
                    merged_rows(vec![(main_end, main_rows), (new_end, new_rows)]),
                ),
            };
            *cache = merged;
            batch.rows = model;
            batch.check_rows(cache, &what);
        }
        Op::Append { n } => {
            batch.append(cache, *n, &what);
            batch.check_rows(cache, &what);
        }
        Op::Filter { picks } => {
            let mut keep: Vec<usize> = Vec::new();
            for &p in picks {
                let r = if p == 7 { rows } else { p % rows };
                if !keep.contains(&r) {
                    keep.push(r);
                }
            }
            let verdict = (keep.is_empty() || keep.contains(&rows)).then_some(Refusal::Rows);
            batch.expect(
                cache,
                &what,
                verdict,
                |c| c.filter(&keep),
                |b| {
                    let shared = keep.iter().map(|&r| b.rows[r].pad).min().unwrap();
                    b.rows = keep
                        .iter()
                        .map(|&r| {
                            let mut row = b.rows[r].clone();
                            row.pad -= shared;
                            row
                        })
                        .collect();
                },
            );
        }
        Op::Retain { gone, fill } => {
            let kept: Vec<usize> = (0..rows).filter(|r| !gone.contains(r)).collect();
            let keep: Vec<usize> = if *fill {
                let mut tail = kept.iter().copied().filter(|&r| r >= kept.len());
                (0..kept.len())
                    .map(|i| {
                        if kept.contains(&i) {
                            i
                        } else {
                            tail.next().unwrap()
                        }
                    })
                    .collect()
            } else {
                kept
            };
            let verdict = keep.is_empty().then_some(Refusal::Rows);
            let end = batch.end();
            batch.expect(
                cache,
                &what,
                verdict,
                |c| c.retain(&keep),
                |b| {
                    let shared = keep.iter().map(|&r| b.rows[r].pad).min().unwrap();
                    // Every keep made here has no row placed above its index.
                    let sliced = if 2 * shared < end.max(1) { 0 } else { shared };
                    b.rows = keep
                        .iter()
                        .map(|&r| {
                            let mut row = b.rows[r].clone();
                            row.pad -= sliced;
                            row
                        })
                        .collect();
                },
            );
        }
        Op::Extract { row, replace } => {
            let r = if *row == 7 { rows } else { row % rows };
            if !replace && rows >= MAX_ROWS {
                return;
            }
            let verdict = (r == rows).then_some(Refusal::Rows);
            let replace = *replace;
            batch.expect(
                cache,
                &what,
                verdict,
                |c| {
                    let one = c.extract(r)?;
                    assert_eq!(one.batch(), 1);
                    if replace {
                        *c = one;
                        Ok(())
                    } else {
                        c.extend(one)
                    }
                },
                |b| {
                    let mut one = b.rows[r].clone();
                    one.pad = 0;
                    let one_end = one.end();
                    b.rows = if replace {
                        vec![one]
                    } else {
                        let end = b.end();
                        merged_rows(vec![
                            (end, std::mem::take(&mut b.rows)),
                            (one_end, vec![one]),
                        ])
                    };
                },
            );
        }
        Op::Align { pads, wrong_len } => {
            let pads = pads[..rows + *wrong_len as usize].to_vec();
            let verdict = wrong_len.then_some(Refusal::RowCount);
            batch.expect(
                cache,
                &what,
                verdict,
                |c| c.align(&pads),
                |b| b.rows.iter_mut().zip(&pads).for_each(|(r, &p)| r.pad = p),
            );
        }
        Op::Trim { counts, uniform } => {
            let lens: Vec<usize> = batch.rows.iter().map(RowModel::len).collect();
            let counts: Vec<usize> = if *uniform {
                let shortest = *lens.iter().min().unwrap();
                vec![counts[0] % (shortest + 1); rows]
            } else {
                (0..rows)
                    .map(|r| {
                        if counts[r] == 63 {
                            batch.rows[r].end() + 1
                        } else {
                            counts[r] % (lens[r] + 1)
                        }
                    })
                    .collect()
            };
            let too_far = batch
                .rows
                .iter()
                .zip(&counts)
                .any(|(row, &c)| c > row.end());
            let new_lens: Vec<usize> = lens
                .iter()
                .zip(&counts)
                .map(|(l, c)| l.saturating_sub(*c))
                .collect();
            let verdict = if too_far {
                Some(Refusal::TooFar)
            } else {
                batch.rewind_verdict(&new_lens)
            };
            let uniform = *uniform;
            batch.expect(
                cache,
                &what,
                verdict,
                |c| {
                    if uniform {
                        c.trim(counts[0])
                    } else {
                        c.trim_rows(&counts)
                    }
                },
                |b| {
                    b.rows
                        .iter_mut()
                        .zip(&new_lens)
                        .for_each(|(r, &l)| r.truncate(l))
                },
            );
        }
        Op::Round {
            appends,
            keeps,
            commit,
            meddle,
        } => {
            batch.expect(
                cache,
                &what,
                None,
                |c| c.round_begin(),
                |b| b.round = Some(b.rows.iter().map(RowModel::len).collect()),
            );
            for (i, &n) in appends.iter().enumerate() {
                batch.append(cache, n, &what);
                batch.check_rows(cache, &what);
                if i > 0 {
                    continue;
                }
                let m = format!("{what}: meddling inside the round");
                let all: Vec<usize> = (0..rows).collect();
                let other: Vec<usize> = batch.rows.iter().map(|r| r.pad + 1).collect();
                match meddle {
                    0 => batch.expect(cache, &m, Some(Refusal::Rows), |c| c.filter(&all), |_| {}),
                    1 => batch.expect(
                        cache,
                        &m,
                        Some(Refusal::Rows),
                        |c| c.extract(0).map(|_| ()),
                        |_| {},
                    ),
                    2 => batch.expect(cache, &m, Some(Refusal::Rows), |c| c.align(&other), |_| {}),
                    3 => batch.expect(cache, &m, Some(Refusal::Rows), |c| c.round_begin(), |_| {}),
                    4 => {
                        let state = cache.state().unwrap();
                        let restored = KvCache::from_state(&state, &Device::Cpu).unwrap();
                        assert_eq!(restored.state().unwrap(), state, "{m}: state round trip");
                        *cache = restored;
                        batch.check_rows(cache, &m);
                    }
                    _ => {}
                }
            }
            let before = batch.round.clone().unwrap();
            let appended: Vec<usize> = batch
                .rows
                .iter()
                .zip(&before)
                .map(|(r, b)| r.len() - b)
                .collect();
            if *commit {
                batch.expect(cache, &what, None, |c| c.round_commit(), |b| b.round = None);
                return;
            }
            let keep: Vec<usize> = (0..rows).map(|r| keeps[r] % (appended[r] + 2)).collect();
            let lens: Vec<usize> = before.iter().zip(&keep).map(|(b, k)| b + k).collect();
            let too_many = keep.iter().zip(&appended).any(|(k, a)| k > a);
            if too_many {
                batch.expect(
                    cache,
                    &what,
                    Some(Refusal::Rows),
                    |c| c.round_rollback(&keep),
                    |_| {},
                );
            }
            let keep: Vec<usize> = keep.iter().zip(&appended).map(|(k, a)| *k.min(a)).collect();
            let lens: Vec<usize> = if too_many {
                before.iter().zip(&keep).map(|(b, k)| b + k).collect()
            } else {
                lens
            };
            let verdict = batch.rewind_verdict(&lens);
            batch.expect(
                cache,
                &what,
                verdict,
                |c| c.round_rollback(&keep),
                |b| {
                    b.rows
                        .iter_mut()
                        .zip(&lens)
                        .for_each(|(r, &l)| r.truncate(l));
                    b.round = None;
                },
            );
            if verdict.is_some() {
                // The round stays open: commit it.
                batch.expect(cache, &what, None, |c| c.round_commit(), |b| b.round = None);
            }
        }
    }
}

/// What a read returns for an input vector of `D` elements, from the codec's definition
/// (`None`: affine and turbo, compared with a fresh cache instead).
fn stored(codec: Codec, x: &[f32]) -> Option<Vec<f32>> {
    let to_bf16 = |v: &f32| bf16::from_f32(*v).to_f32();
    Some(match codec {
        Codec::Plain(PlainDType::F32) => x.to_vec(),
        Codec::Plain(PlainDType::Bf16) => x.iter().map(to_bf16).collect(),
        Codec::Plain(PlainDType::F16) => x.iter().map(|v| f16::from_f32(*v).to_f32()).collect(),
        Codec::Affine { .. } | Codec::Turbo { .. } => return None,
    })
}

/// f64 attention of one row's queries `qs` (`q_heads × D` each, at real positions `first
/// ..`) over its stored positions `keys`, `values` (`kv_heads × D` each, real positions `0
/// ..`), query `p` seeing `max(0, p + 1 − window) ..= p`. Returns `(q_heads, queries, D)`.
fn reference(
    cfg: &Cfg,
    keys: &[Vec<f32>],
    values: &[Vec<f32>],
    qs: &[Vec<f32>],
    first: usize,
    window: Option<usize>,
) -> Vec<f32> {
    let (qh, n) = (cfg.qh(), qs.len());
    let mut out = vec![0f32; qh * n * D];
    for h in 0..qh {
        let kv = h / cfg.gqa;
        for (i, q) in qs.iter().enumerate() {
            let p = first + i;
            let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
            let q = &q[h * D..(h + 1) * D];
            let scores: Vec<f64> = (lo..=p)
                .map(|j| {
                    let k = &keys[j][kv * D..(kv + 1) * D];
                    k.iter()
                        .zip(q)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * SCALE as f64
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let z: f64 = exps.iter().sum();
            for d in 0..D {
                let o: f64 = (lo..=p)
                    .zip(&exps)
                    .map(|(j, e)| e / z * values[j][kv * D + d] as f64)
                    .sum();
                out[(h * n + i) * D + d] = o as f32;
            }
        }
    }
    out
}

/// Bit-for-bit equality, naming the first difference.
fn same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} of {}: {} vs {}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= TOLERANCE * (1.0 + w.abs()),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

/// The new positions and queries of the final reads: per row one decode step, then a chunk.
struct Probe {
    dec: Vec<Tok>,
    chunk: Vec<Vec<Tok>>,
    q_dec: Vec<Vec<f32>>,
    q_chunk: Vec<Vec<Vec<f32>>>,
}

fn queries(cfg: &Cfg, rows: &[Vec<Vec<f32>>]) -> Tensor {
    let n = rows[0].len();
    let mut data = Vec::new();
    for row in rows {
        for h in 0..cfg.qh() {
            for q in row {
                data.extend_from_slice(&q[h * D..(h + 1) * D]);
            }
        }
    }
    Tensor::from_vec(data, (rows.len(), cfg.qh(), n, D), &Device::Cpu).unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Per layer, the decode read's and the chunk read's outputs `(rows, q_heads, n, D)` of
/// rows `rows` of the probe.
fn probe_reads(
    cfg: &Cfg,
    cache: &mut KvCache,
    probe: &Probe,
    rows: &[usize],
) -> Vec<[Vec<f32>; 2]> {
    let dec: Vec<Vec<Tok>> = rows.iter().map(|&r| vec![probe.dec[r].clone()]).collect();
    let chunk: Vec<Vec<Tok>> = rows.iter().map(|&r| probe.chunk[r].clone()).collect();
    let q_dec = queries(
        cfg,
        &rows
            .iter()
            .map(|&r| vec![probe.q_dec[r].clone()])
            .collect::<Vec<_>>(),
    );
    let q_chunk = queries(
        cfg,
        &rows
            .iter()
            .map(|&r| probe.q_chunk[r].clone())
            .collect::<Vec<_>>(),
    );
    let (dk, dv) = tensors(cfg, &dec);
    let (ck, cv) = tensors(cfg, &chunk);
    let isa = cache.layers()[0].isa();
    (0..cache.layers().len())
        .map(|l| {
            let layer = cache.layer_mut(l);
            let read = layer.append_decode(&dk, &dv).unwrap();
            assert_eq!(read.isa(), isa);
            let a = flat(&read.attend(&q_dec, SCALE).unwrap());
            let read = layer.append_window(&ck, &cv).unwrap();
            let b = flat(&read.attend(&q_chunk, SCALE).unwrap());
            [a, b]
        })
        .collect()
}

/// A fresh one-row cache fed only `row`'s history (its appends in the chunks it saw, its
/// rewinds as trims). It converts as the batch does: a quantized codec's key preparation
/// depends on when the layer converts (callers keep rows unpadded where the batch converts
/// at a positive `quantized_kv_start`, which a padded row would reach earlier).
fn fresh(cfg: &Cfg, row: &RowModel) -> KvCache {
    let mut cache = cfg.new_cache(vec![0]);
    let mut len = 0;
    for event in &row.history {
        match event {
            Event::Append(toks) => {
                let (k, v) = tensors(cfg, std::slice::from_ref(toks));
                append_all(&mut cache, &k, &v).unwrap();
                len += toks.len();
            }
            Event::Truncate(to) => {
                cache.trim(len - to).unwrap();
                len = *to;
            }
        }
    }
    assert_eq!(
        cache.offsets(),
        vec![row.len()],
        "the fresh cache replays the row"
    );
    cache
}

/// Each layer's stored keys and values of every row, in temporal order, as f32.
fn donors(cache: &KvCache) -> Vec<Vec<(Vec<f32>, Vec<f32>)>> {
    cache
        .capture_donor_rows()
        .unwrap()
        .iter()
        .map(|d| {
            d.keys
                .iter()
                .zip(&d.values)
                .map(|(k, v)| (flat(k), flat(v)))
                .collect()
        })
        .collect()
}

/// `toks` as `(kv_heads, n, D)` row-major, each vector as `codec` stores it.
fn stored_layout(cfg: &Cfg, toks: &[Tok], keys: bool) -> Option<Vec<f32>> {
    let mut out = Vec::new();
    for h in 0..cfg.kvh {
        for t in toks {
            let x = if keys { &t.k } else { &t.v };
            out.extend(stored(cfg.codec, &x[h * D..(h + 1) * D])?);
        }
    }
    Some(out)
}

fn check_final(batch: &mut Batch, mut cache: KvCache) {
    let cfg = batch.cfg;
    let rows = batch.rows.len();
    assert!(batch.round.is_none());
    for layer in cache.layers() {
        assert!(
            !layer.awaiting_conversion(),
            "quantized_kv_start 0: converted at the first append"
        );
    }
    // (2) State round trip, bit for bit.
    let state = cache.state().unwrap();
    let restored = KvCache::from_state(&state, &Device::Cpu).unwrap();
    assert_eq!(restored.state().unwrap(), state, "state round trip");
    // Stored positions: the model's (plain, affine) and the fresh cache's, bit for bit.
    let stored_now = donors(&cache);
    let mut fresh_caches: Vec<KvCache> = batch.rows.iter().map(|r| fresh(&cfg, r)).collect();
    for (r, row) in batch.rows.iter().enumerate() {
        let mine = donors(&fresh_caches[r]);
        for l in 0..2 {
            let lo = if l == 0 { row.held } else { 0 };
            same(
                &stored_now[l][r].0,
                &mine[l][0].0,
                &format!("layer {l} row {r}: keys stored as the fresh cache stores them"),
            );
            same(
                &stored_now[l][r].1,
                &mine[l][0].1,
                &format!("layer {l} row {r}: values stored as the fresh cache stores them"),
            );
            if let (Some(k), Some(v)) = (
                stored_layout(&cfg, &row.toks[lo..], true),
                stored_layout(&cfg, &row.toks[lo..], false),
            ) {
                same(
                    &stored_now[l][r].0,
                    &k,
                    &format!("layer {l} row {r}: stored keys"),
                );
                same(
                    &stored_now[l][r].1,
                    &v,
                    &format!("layer {l} row {r}: stored values"),
                );
            }
        }
    }
    // (1) The next reads.
    let c = 3 + (lcg(&mut batch.seed).abs() * 3.0) as usize % 3;
    let seed = &mut batch.seed;
    let q = |seed: &mut u64| -> Vec<f32> { (0..cfg.qh() * D).map(|_| lcg(seed)).collect() };
    let probe = Probe {
        dec: (0..rows).map(|_| tok(&cfg, seed)).collect(),
        chunk: (0..rows)
            .map(|_| (0..c).map(|_| tok(&cfg, seed)).collect())
            .collect(),
        q_dec: (0..rows).map(|_| q(seed)).collect(),
        q_chunk: (0..rows)
            .map(|_| (0..c).map(|_| q(seed)).collect())
            .collect(),
    };
    let per_row = cfg.qh() * D;
    let want: Vec<Option<Vec<[Vec<f32>; 2]>>> = batch
        .rows
        .iter()
        .enumerate()
        .map(|(r, row)| {
            let all: Vec<Tok> = row
                .toks
                .iter()
                .chain([&probe.dec[r]])
                .chain(&probe.chunk[r])
                .cloned()
                .collect();
            let keys: Vec<Vec<f32>> = all
                .iter()
                .map(|t| {
                    (0..cfg.kvh)
                        .flat_map(|h| {
                            stored(cfg.codec, &t.k[h * D..(h + 1) * D]).unwrap_or_default()
                        })
                        .collect()
                })
                .collect();
            let values: Vec<Vec<f32>> = all
                .iter()
                .map(|t| {
                    (0..cfg.kvh)
                        .flat_map(|h| {
                            stored(cfg.codec, &t.v[h * D..(h + 1) * D]).unwrap_or_default()
                        })
                        .collect()
                })
                .collect();
            stored(cfg.codec, &all[0].k[..D])?;
            let len = row.len();
            Some(
                (0..2)
                    .map(|l| {
                        let w = cfg.layer_window(l);
                        [
                            reference(&cfg, &keys, &values, &[probe.q_dec[r].clone()], len, w),
                            reference(&cfg, &keys, &values, &probe.q_chunk[r], len + 1, w),
                        ]
                    })
                    .collect(),
            )
        })
        .collect();
    let fresh_out: Vec<Vec<[Vec<f32>; 2]>> = fresh_caches
        .iter_mut()
        .enumerate()
        .map(|(r, f)| probe_reads(&cfg, f, &probe, &[r]))
        .collect();
    let all_rows: Vec<usize> = (0..rows).collect();
    let mut at_detected = None;
    for isa in Isa::supported() {
        let mut copy = KvCache::from_state(&state, &Device::Cpu)
            .unwrap()
            .with_isa(isa);
        let got = probe_reads(&cfg, &mut copy, &probe, &all_rows);
        for r in 0..rows {
            for l in 0..2 {
                for (s, n) in [(0, 1), (1, c)] {
                    let mine = &got[l][s][r * per_row * n..(r + 1) * per_row * n];
                    let what = format!("{isa}: layer {l} row {r} {} read", ["decode", "chunk"][s]);
                    close(
                        mine,
                        &fresh_out[r][l][s],
                        &format!("{what} against the fresh one-row cache"),
                    );
                    if let Some(want) = &want[r] {
                        close(
                            mine,
                            &want[l][s],
                            &format!("{what} against the f64 reference"),
                        );
                    }
                }
            }
        }
        if isa == Isa::detected() {
            at_detected = Some(got);
        }
    }
    let original = probe_reads(&cfg, &mut cache, &probe, &all_rows);
    let restored = at_detected.expect("Isa::supported() holds Isa::detected()");
    for l in 0..2 {
        for s in 0..2 {
            same(
                &original[l][s],
                &restored[l][s],
                &format!("layer {l} read {s}: the restored cache reads as the original"),
            );
        }
    }
}

fn run_sequence(cfg: Cfg, first: (Vec<usize>, usize), ops: &[Op], seed: u64) {
    let mut batch = Batch {
        cfg,
        rows: Vec::new(),
        round: None,
        seed,
    };
    let (mut cache, rows) = batch.new_cache(&first.0, first.1);
    batch.rows = rows;
    batch.check_rows(&cache, "first cache");
    for (step, op) in ops.iter().enumerate() {
        run_op(&mut batch, &mut cache, op, step);
    }
    check_final(&mut batch, cache);
}

fn cfg_strategy(codecs: Vec<Codec>) -> impl Strategy<Value = Cfg> {
    (
        prop::sample::select(codecs),
        1usize..=2,
        1usize..=2,
        8usize..=16,
        0usize..=5,
    )
        .prop_map(|(codec, kvh, gqa, window, slack)| Cfg {
            codec,
            kvh,
            gqa,
            window,
            slack,
            start: 0,
        })
}

fn sequence_strategy() -> impl Strategy<Value = ((Vec<usize>, usize), Vec<Op>, u64)> {
    (
        (prop::collection::vec(0usize..4, 1..=3), 0usize..7),
        prop::collection::vec(op_strategy(), 6..=12),
        any::<u64>(),
    )
}

fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

const PLAIN: [Codec; 2] = [
    Codec::Plain(PlainDType::Bf16),
    Codec::Plain(PlainDType::F32),
];
const AFFINE: [Codec; 2] = [
    Codec::Affine { bits: 4, group: 32 },
    Codec::Affine { bits: 8, group: 64 },
];
const TURBO: [Codec; 2] = [
    Codec::Turbo {
        kbits: 4,
        vbits: 4,
        prep: TurboPrep::ALL,
    },
    Codec::Turbo {
        kbits: 3,
        vbits: 4,
        prep: TurboPrep {
            key_mean: false,
            key_scale: false,
            pairs: false,
        },
    },
];

proptest! {
    #![proptest_config(config(CASES))]
    #[test]
    fn plain_row_operations_match_the_model(
        cfg in cfg_strategy(PLAIN.to_vec()),
        (first, ops, seed) in sequence_strategy(),
    ) {
        run_sequence(cfg, first, &ops, seed);
    }

    #[test]
    fn affine_row_operations_match_fresh_caches(
        cfg in cfg_strategy(AFFINE.to_vec()),
        (first, ops, seed) in sequence_strategy(),
    ) {
        run_sequence(cfg, first, &ops, seed);
    }

    #[test]
    fn turbo_row_operations_match_fresh_caches(
        cfg in cfg_strategy(TURBO.to_vec()),
        (first, ops, seed) in sequence_strategy(),
    ) {
        run_sequence(cfg, first, &ops, seed);
    }
}

/// Cases of each codec group's property test (600 each pass in about a minute).
const CASES: u32 = 48;

fn batch_of(cfg: Cfg, pads: &[usize], extra: usize, seed: u64) -> (Batch, KvCache) {
    let mut batch = Batch {
        cfg,
        rows: Vec::new(),
        round: None,
        seed,
    };
    let (cache, rows) = batch.new_cache(pads, extra);
    batch.rows = rows;
    batch.check_rows(&cache, "first cache");
    (batch, cache)
}

/// A positive `quantized_kv_start` reached inside a speculative round (on a ring that has
/// wrapped), then a rollback below the start: the storage stays quantized and the reads
/// are those of the quantized positions that survive.
#[test]
fn conversion_inside_a_round_survives_a_rollback_below_the_start() {
    let codecs = [AFFINE.to_vec(), TURBO.to_vec()].concat();
    for (c, codec) in codecs.into_iter().enumerate() {
        let cfg = Cfg {
            codec,
            kvh: 2,
            gqa: 2,
            window: 8,
            slack: 8,
            start: 20,
        };
        // Both codecs fit each row's key preparation at conversion, on what the batch holds
        // then (its width counts padding): unpadded rows convert at the same append as a
        // fresh one-row cache does.
        let pads = vec![0, 0];
        let extra = 13 - pads.iter().max().unwrap();
        let (mut batch, mut cache) = batch_of(cfg, &pads, extra, 90 + c as u64);
        assert_eq!(cache.end(), 14);
        let awaiting = |cache: &KvCache| {
            cache
                .layers()
                .iter()
                .map(|l| l.awaiting_conversion())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            awaiting(&cache),
            vec![true; 2],
            "{codec}: 14 < 20 positions: bf16"
        );
        assert_eq!(cache.max_append_tokens(), Some(6));
        batch.expect(
            &mut cache,
            "begin",
            None,
            |c| c.round_begin(),
            |b| b.round = Some(b.rows.iter().map(RowModel::len).collect()),
        );
        batch.append(&mut cache, 5, "draft 5");
        assert_eq!(
            awaiting(&cache),
            vec![true; 2],
            "{codec}: 19 < 20 positions: bf16"
        );
        batch.append(&mut cache, 3, "draft 3");
        assert_eq!(
            awaiting(&cache),
            vec![false; 2],
            "{codec}: 22 positions: converted in the round"
        );
        assert_eq!(cache.minimum_reusable_offset(), Some(22));
        let before = batch.round.clone().unwrap();
        let keep = [2, 0];
        let lens: Vec<usize> = before.iter().zip(&keep).map(|(b, k)| b + k).collect();
        assert_eq!(batch.rewind_verdict(&lens), None);
        batch.expect(
            &mut cache,
            "rollback",
            None,
            |c| c.round_rollback(&keep),
            |b| {
                b.rows
                    .iter_mut()
                    .zip(&lens)
                    .for_each(|(r, &l)| r.truncate(l));
                b.round = None;
            },
        );
        assert!(
            cache.end() < cfg.start,
            "{codec}: rolled back below the start"
        );
        assert_eq!(
            awaiting(&cache),
            vec![false; 2],
            "{codec}: conversion is irreversible"
        );
        assert_eq!(cache.max_append_tokens(), None);
        check_final(&mut batch, cache);
    }
}

/// A round's guard measures the positions a rollback to the round's start needs from that
/// start, padding counted once: a padded row of a wrapped ring without slack may draft one
/// position, not two, and then rolls back to the start.
#[test]
fn round_guard_of_a_padded_row() {
    let cfg = Cfg {
        codec: Codec::Plain(PlainDType::F32),
        kvh: 1,
        gqa: 2,
        window: 8,
        slack: 0,
        start: 0,
    };
    // One row padded by 2 holding 10 real positions in a ring of 8: it has wrapped.
    let (mut batch, mut cache) = batch_of(cfg, &[2], 9, 7);
    assert_eq!(cache.offsets(), vec![10]);
    batch.expect(
        &mut cache,
        "begin",
        None,
        |c| c.round_begin(),
        |b| b.round = Some(b.rows.iter().map(RowModel::len).collect()),
    );
    // Two positions would overwrite real position 3, which the query at 10 sees.
    batch.append(&mut cache, 2, "draft 2");
    batch.append(&mut cache, 1, "draft 1");
    batch.expect(
        &mut cache,
        "rollback",
        None,
        |c| c.round_rollback(&[0]),
        |b| {
            b.rows.iter_mut().for_each(|r| r.truncate(10));
            b.round = None;
        },
    );
    check_final(&mut batch, cache);
}

/// A wrapped ring rewound to no positions at all holds, from then on, what it appends: a
/// row operation carries those positions and a drafter reads them.
#[test]
fn ring_rewound_to_nothing_holds_its_next_positions() {
    let cfg = Cfg {
        codec: Codec::Plain(PlainDType::F32),
        kvh: 1,
        gqa: 1,
        window: 8,
        slack: 0,
        start: 0,
    };
    let (mut batch, mut cache) = batch_of(cfg, &[0], 11, 8);
    run_op(
        &mut batch,
        &mut cache,
        &Op::Trim {
            counts: vec![12; 6],
            uniform: false,
        },
        0,
    );
    assert_eq!(cache.offsets(), vec![0]);
    run_op(&mut batch, &mut cache, &Op::Append { n: 3 }, 1);
    run_op(&mut batch, &mut cache, &Op::Filter { picks: vec![0] }, 2);
    check_final(&mut batch, cache);
}

/// A padded row whose first chunk wraps the ring at conversion (9 positions, 2 of them
/// padding, in 8 slots): its turbo key preparation is fitted on its 7 real keys, as a fresh
/// one-row cache fits it.
#[test]
fn turbo_prep_of_a_padded_row_wrapped_at_conversion() {
    let cfg = Cfg {
        codec: TURBO[0],
        kvh: 1,
        gqa: 1,
        window: 8,
        slack: 0,
        start: 0,
    };
    let (mut batch, cache) = batch_of(cfg, &[2], 6, 9);
    check_final(&mut batch, cache);
}

/// `extend` refused (rows cannot move during a round) leaves the cache as it was.
#[test]
fn refused_extend_leaves_the_cache_unchanged() {
    let cfg = Cfg {
        codec: Codec::Plain(PlainDType::Bf16),
        kvh: 1,
        gqa: 1,
        window: 8,
        slack: 2,
        start: 0,
    };
    let (mut batch, mut cache) = batch_of(cfg, &[0, 1], 3, 10);
    let (other, _) = batch.new_cache(&[0], 2);
    batch.expect(
        &mut cache,
        "begin",
        None,
        |c| c.round_begin(),
        |b| b.round = Some(b.rows.iter().map(RowModel::len).collect()),
    );
    batch.expect(
        &mut cache,
        "extend in a round",
        Some(Refusal::Rows),
        |c| c.extend(other),
        |_| {},
    );
    batch.expect(
        &mut cache,
        "commit",
        None,
        |c| c.round_commit(),
        |b| b.round = None,
    );
    check_final(&mut batch, cache);
}
