//! The named reads (`append_bidirectional`, `append_encoder_window`, `read_block`), donor
//! rows and the bf16-first chunk bound (`max_append_tokens`) against an independent model:
//! every row's positions kept in plain per-position lists (rounded to the storage dtype, or
//! quantized per position from the codec's definition), each read's attention computed in
//! f64 loops with the mask written out from the read's definition.

use candle_core::{Device, Tensor};
use std::ops::Range;
use tessera_kv::planes::{AffinePlanes, Planes};
use tessera_kv::{
    AttentionCache, Codec, KvCache, KvError, KvScheme, LayerSpec, PlainDType, Retention, TurboPrep,
};

/// Largest accepted `|read − reference| / (1 + |reference|)`: f32 arithmetic against f64 on
/// the same stored values. One key masked wrongly moves an output by far more.
const TOLERANCE: f32 = 1e-5;
const SLACK: usize = 3;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn random(shape: (usize, usize, usize, usize), seed: &mut u64) -> (Tensor, Vec<f32>) {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let data: Vec<f32> = (0..n).map(|_| lcg(seed)).collect();
    (
        Tensor::from_vec(data.clone(), shape, &Device::Cpu).unwrap(),
        data,
    )
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn rounded(x: &[f32], dtype: PlainDType) -> Vec<f32> {
    match dtype {
        PlainDType::F32 => x.to_vec(),
        PlainDType::Bf16 => x
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect(),
        PlainDType::F16 => x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect(),
    }
}

/// How the model stores a position: rounded to a plain dtype, or affine-quantized on its own.
#[derive(Clone, Copy, Debug)]
enum Store {
    Round(PlainDType),
    Affine { bits: u8, group: usize },
}

fn stored(x: &Tensor, how: Store) -> Vec<f32> {
    match how {
        Store::Round(dtype) => rounded(&flat(x), dtype),
        Store::Affine { bits, group } => {
            let d = x.dims()[3];
            flat(
                &AffinePlanes::new(bits, group, 1, 1, d, d)
                    .as_stored(0, x, false)
                    .unwrap(),
            )
        }
    }
}

/// The model of one layer: per row and KV head, each physical position's stored key and
/// value (padding positions included, never visible), the rows' ends and oldest held
/// positions, written from the documented semantics.
#[derive(Clone)]
struct Model {
    kvh: usize,
    d: usize,
    keys: Vec<Vec<Vec<Vec<f32>>>>, // [row][head][pos][d]
    values: Vec<Vec<Vec<Vec<f32>>>>,
    pads: Vec<usize>,
    ends: Vec<usize>,
    held: Vec<usize>,
    /// Slots a row has (`window + slack`), `None` for full retention.
    ring: Option<usize>,
    window: Option<usize>,
}

impl Model {
    fn new(kvh: usize, d: usize, pads: &[usize], window: Option<usize>) -> Self {
        let b = pads.len();
        let empty = || vec![vec![Vec::new(); kvh]; b];
        Model {
            kvh,
            d,
            keys: empty(),
            values: empty(),
            pads: pads.to_vec(),
            ends: vec![0; b],
            held: pads.to_vec(),
            ring: window.map(|w| w + SLACK),
            window,
        }
    }

    /// Appends `n` positions per row at each row's end (`st`: keys and values as stored).
    fn append(&mut self, n: usize, st: (&[f32], &[f32])) {
        let (kvh, d) = (self.kvh, self.d);
        for r in 0..self.pads.len() {
            let e = self.ends[r];
            for h in 0..kvh {
                self.keys[r][h].truncate(e);
                self.values[r][h].truncate(e);
                for i in 0..n {
                    let at = ((r * kvh + h) * n + i) * d;
                    self.keys[r][h].push(st.0[at..at + d].to_vec());
                    self.values[r][h].push(st.1[at..at + d].to_vec());
                }
            }
            self.ends[r] = e + n;
            if let Some(ring) = self.ring {
                self.held[r] = self.held[r].max(self.ends[r].saturating_sub(ring));
            }
        }
    }

    /// The live positions of row `r`: its oldest held real position up to its end.
    fn live(&self, r: usize) -> Range<usize> {
        self.held[r].max(self.pads[r])..self.ends[r]
    }

    /// Whether causal query position `qp` of row `r` sees key position `p`.
    fn causal(&self, r: usize, qp: usize, p: usize) -> bool {
        p <= qp && p >= self.pads[r] && self.window.is_none_or(|w| qp - p < w)
    }
}

/// f64 attention of `q` `(b, qh, n, d)`: query `i` of row `r` over the positions `p` of
/// `keys[r][kv head]` with `visible(r, i, p)`. Queries with no visible key are left NaN.
fn reference(
    q: &[f32],
    (b, qh, n, d): (usize, usize, usize, usize),
    keys: &[Vec<Vec<Vec<f32>>>],
    values: &[Vec<Vec<Vec<f32>>>],
    visible: impl Fn(usize, usize, usize) -> bool,
    scale: f32,
) -> Vec<f32> {
    let kvh = keys[0].len();
    let g = qh / kvh;
    let mut out = vec![f32::NAN; b * qh * n * d];
    for r in 0..b {
        for h in 0..qh {
            let (ks, vs) = (&keys[r][h / g], &values[r][h / g]);
            for i in 0..n {
                let seen: Vec<usize> = (0..ks.len()).filter(|&p| visible(r, i, p)).collect();
                if seen.is_empty() {
                    continue;
                }
                let qv = &q[((r * qh + h) * n + i) * d..][..d];
                let scores: Vec<f64> = seen
                    .iter()
                    .map(|&p| {
                        ks[p]
                            .iter()
                            .zip(qv)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = exps.iter().sum();
                for dd in 0..d {
                    let v: f64 = seen
                        .iter()
                        .zip(&exps)
                        .map(|(&p, e)| e / z * vs[p][dd] as f64)
                        .sum();
                    out[((r * qh + h) * n + i) * d + dd] = v as f32;
                }
            }
        }
    }
    out
}

/// Largest `|got − want| / (1 + |want|)` over the queries `check(row, i)` selects.
fn max_error(
    got: &[f32],
    want: &[f32],
    (b, qh, n, d): (usize, usize, usize, usize),
    check: impl Fn(usize, usize) -> bool,
) -> f32 {
    let mut worst = 0f32;
    for r in 0..b {
        for h in 0..qh {
            for i in (0..n).filter(|&i| check(r, i)) {
                for dd in 0..d {
                    let at = ((r * qh + h) * n + i) * d + dd;
                    let (g, w) = (got[at], want[at]);
                    assert!(
                        w.is_finite(),
                        "row {r} query {i}: the reference sees no key"
                    );
                    worst = worst.max((g - w).abs() / (1.0 + w.abs()));
                }
            }
        }
    }
    worst
}

fn block_of(blocks: &[Range<usize>], i: usize) -> Option<usize> {
    blocks.iter().position(|b| b.contains(&i))
}

/// One step of a scenario.
#[derive(Debug, Clone)]
enum Step {
    /// A causal chunk (`append_window`), or a decode step for 1.
    Causal(usize),
    /// A round of a causal chunk of `n`, rolled back keeping `keep[row]`.
    Round(usize, Vec<usize>),
    Bidirectional(usize, Vec<Vec<Range<usize>>>),
    Encoder(usize, Vec<Vec<Range<usize>>>),
    Block(usize),
}

struct Scenario {
    codec: Codec,
    /// The stage the model stores positions in (bf16 for a quantized codec's bf16 stage).
    store: PlainDType,
    quantized_kv_start: usize,
    kvh: usize,
    gqa: usize,
    d: usize,
    window: Option<usize>,
    pads: Vec<usize>,
    seed: u64,
}

impl Scenario {
    fn spec(&self) -> LayerSpec {
        LayerSpec {
            kv_heads: self.kvh,
            head_dim: self.d,
            value_dim: self.d,
            retention: self
                .window
                .map_or(Retention::Full, |size| Retention::Window { size }),
        }
    }

    fn cache(&self) -> KvCache {
        let mut scheme = KvScheme::uniform(self.codec);
        scheme.quantized_kv_start = self.quantized_kv_start;
        KvCache::new(&[self.spec()], &scheme, self.pads.clone())
            .unwrap()
            .with_round_slack(SLACK)
    }

    /// Runs `steps` on a fresh cache and the model, checking every read.
    fn run(&self, steps: &[Step]) -> (KvCache, Model) {
        let mut cache = self.cache();
        let mut model = Model::new(self.kvh, self.d, &self.pads, self.window);
        let mut seed = self.seed;
        for (at, step) in steps.iter().enumerate() {
            self.step(&mut cache, &mut model, step, &mut seed, at);
        }
        (cache, model)
    }

    fn step(&self, cache: &mut KvCache, model: &mut Model, step: &Step, seed: &mut u64, at: usize) {
        let (b, kvh, d) = (self.pads.len(), self.kvh, self.d);
        let qh = kvh * self.gqa;
        let scale = 1.0 / (d as f32).sqrt();
        let how = Store::Round(self.store);
        let ctx = format!(
            "step {at} {step:?} of {:?} {:?} pads {:?}",
            self.codec, self.window, self.pads
        );
        let n = match step {
            Step::Causal(n)
            | Step::Round(n, _)
            | Step::Bidirectional(n, _)
            | Step::Encoder(n, _)
            | Step::Block(n) => *n,
        };
        let shape = (b, qh, n, d);
        let (k, _) = random((b, kvh, n, d), seed);
        let (v, _) = random((b, kvh, n, d), seed);
        let (q, qd) = random((b, qh, n, d), seed);
        let (sk, sv) = (stored(&k, how), stored(&v, how));
        let starts = model.ends.clone();
        let pads = self.pads.clone();
        let real = |r: usize, i: usize| starts[r] + i >= pads[r];
        if let Step::Round(..) = step {
            cache.round_begin().unwrap();
        }
        match step {
            Step::Causal(_) | Step::Round(..) => {
                model.append(n, (&sk, &sv));
                let want = reference(
                    &qd,
                    shape,
                    &model.keys,
                    &model.values,
                    |r, i, p| model.causal(r, starts[r] + i, p),
                    scale,
                );
                let layer = cache.layer_mut(0);
                let read = if n == 1 {
                    layer.append_decode(&k, &v).unwrap()
                } else {
                    layer.append_window(&k, &v).unwrap()
                };
                let got = flat(&read.attend(&q, scale).unwrap());
                let err = max_error(&got, &want, shape, real);
                assert!(err <= TOLERANCE, "{ctx}: causal read off by {err}");
            }
            Step::Bidirectional(_, blocks) => {
                model.append(n, (&sk, &sv));
                // From the definition: causal, OR both in one block of the row's chunk.
                let visible = |r: usize, i: usize, p: usize| {
                    let causal = model.causal(r, starts[r] + i, p);
                    let block = p >= starts[r]
                        && block_of(&blocks[r], i)
                            .is_some_and(|bi| block_of(&blocks[r], p - starts[r]) == Some(bi));
                    causal || block
                };
                let want = reference(&qd, shape, &model.keys, &model.values, visible, scale);
                let read = cache
                    .layer_mut(0)
                    .append_bidirectional(&k, &v, blocks)
                    .unwrap();
                let got = flat(&read.attend(&q, scale).unwrap());
                let err = max_error(&got, &want, shape, real);
                assert!(err <= TOLERANCE, "{ctx}: bidirectional read off by {err}");
                // The blocks matter: the plain causal reference is far from this read
                // wherever a block has two positions.
                if blocks.iter().any(|bs| bs.iter().any(|r| r.len() > 1)) {
                    let causal = reference(
                        &qd,
                        shape,
                        &model.keys,
                        &model.values,
                        |r, i, p| model.causal(r, starts[r] + i, p),
                        scale,
                    );
                    assert!(
                        max_error(&got, &causal, shape, real) > 1e-3,
                        "{ctx}: blocks ignored"
                    );
                }
            }
            Step::Encoder(_, blocks) => {
                model.append(n, (&sk, &sv));
                let visible = |r: usize, i: usize, p: usize| {
                    let Some(c) = p.checked_sub(starts[r]) else {
                        return false;
                    };
                    match block_of(&blocks[r], i) {
                        Some(bi) => block_of(&blocks[r], c) == Some(bi),
                        None => c == i,
                    }
                };
                let want = reference(&qd, shape, &model.keys, &model.values, visible, scale);
                let read = cache
                    .layer_mut(0)
                    .append_encoder_window(&k, &v, blocks)
                    .unwrap();
                let got = flat(&read.attend(&q, scale).unwrap());
                let err = max_error(&got, &want, shape, |_, _| true);
                assert!(err <= TOLERANCE, "{ctx}: encoder-window read off by {err}");
            }
            Step::Block(_) => {
                // The model with the block appended virtually: live positions plus the
                // block, every query seeing all of them.
                let mut virt = model.clone();
                virt.append(n, (&sk, &sv));
                let live: Vec<Range<usize>> = (0..b).map(|r| model.live(r)).collect();
                let visible =
                    |r: usize, _i: usize, p: usize| live[r].contains(&p) || p >= starts[r];
                let want = reference(&qd, shape, &virt.keys, &virt.values, visible, scale);
                let (offset, ends) = (cache.layers()[0].offset(), cache.ends());
                let got = {
                    let read = cache.layers()[0].read_block(&k, &v).unwrap();
                    flat(&read.attend(&q, scale).unwrap())
                };
                let err = max_error(&got, &want, shape, |_, _| true);
                assert!(err <= TOLERANCE, "{ctx}: block read off by {err}");
                assert_eq!(
                    cache.layers()[0].offset(),
                    offset,
                    "{ctx}: a block read appends nothing"
                );
                assert_eq!(cache.ends(), ends, "{ctx}: a block read appends nothing");
                assert_eq!(cache.layers()[0].rows().ends(), ends, "{ctx}");
            }
        }
        if let Step::Round(_, keep) = step {
            let keep: Vec<usize> = keep[..b].to_vec();
            cache.round_rollback(&keep).unwrap();
            model.ends = starts.iter().zip(&keep).map(|(s, k)| s + k).collect();
        }
        assert_eq!(cache.ends(), model.ends, "{ctx}: ends");
        assert_eq!(
            cache.layers()[0].rows().held_from(),
            model.held.as_slice(),
            "{ctx}: held_from"
        );
    }
}

fn blocks(rows: usize, all: Vec<Vec<Range<usize>>>) -> Vec<Vec<Range<usize>>> {
    all.into_iter().take(rows).collect()
}

/// The scenario of every named read: a left-padded prefill, a decode, a round rolled back to
/// different ends per row, then bidirectional chunks (one block longer than the window),
/// an encoder-window chunk and block reads, each followed by a causal decode.
fn named_steps(rows: usize) -> Vec<Step> {
    use Step::*;
    vec![
        Causal(7),
        Causal(1),
        Round(4, vec![1, 3, 0]),
        Bidirectional(6, blocks(rows, vec![vec![0..3, 4..6], vec![1..5], vec![]])),
        Causal(1),
        Bidirectional(
            12,
            blocks(
                rows,
                vec![vec![0..12], vec![2..3, 5..11], vec![0..1, 6..12]],
            ),
        ),
        Causal(1),
        Encoder(5, blocks(rows, vec![vec![0..2, 2..5], vec![1..4], vec![]])),
        Causal(1),
        Block(4),
        Causal(1),
        Round(3, vec![0, 2, 1]),
        Block(3),
        Causal(2),
        Causal(1),
    ]
}

fn plain_scenarios() -> Vec<Scenario> {
    let mut out = Vec::new();
    let mut seed = 100;
    for dtype in [PlainDType::Bf16, PlainDType::F32] {
        for window in [None, Some(8)] {
            for pads in [vec![0], vec![0, 2, 5]] {
                seed += 1;
                out.push(Scenario {
                    codec: Codec::Plain(dtype),
                    store: dtype,
                    quantized_kv_start: 0,
                    kvh: 2,
                    gqa: 2,
                    d: 16,
                    window,
                    pads,
                    seed,
                });
            }
        }
    }
    out
}

#[test]
fn named_reads_on_plain_storage_match_reference() {
    for s in plain_scenarios() {
        s.run(&named_steps(s.pads.len()));
    }
}

/// An encoder-window chunk as the first append of a fresh cache (a vision encoder's use):
/// each position sees only its block; positions in no block only themselves.
#[test]
fn encoder_window_on_a_fresh_cache() {
    for window in [None, Some(8)] {
        for pads in [vec![0], vec![0, 0]] {
            let s = Scenario {
                codec: Codec::Plain(PlainDType::F32),
                store: PlainDType::F32,
                quantized_kv_start: 0,
                kvh: 1,
                gqa: 2,
                d: 16,
                window,
                pads: pads.clone(),
                seed: 7,
            };
            let all = vec![vec![0..4, 4..13], vec![2..3, 3..12]];
            s.run(&[Step::Encoder(14, blocks(pads.len(), all)), Step::Causal(1)]);
        }
    }
}

/// During the bf16 stage of a quantized codec the named reads are served, in bf16; an
/// encoder chunk that makes the layer hold `quantized_kv_start` positions is read in bf16
/// and converts it, after which every named read is refused.
#[test]
fn named_reads_served_during_the_bf16_stage() {
    let codecs = [
        Codec::Affine { bits: 4, group: 32 },
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
    ];
    for codec in codecs {
        for window in [None, Some(8)] {
            let s = Scenario {
                codec,
                store: PlainDType::Bf16,
                quantized_kv_start: 1000,
                kvh: 1,
                gqa: 2,
                d: 32,
                window,
                pads: vec![0, 2, 5],
                seed: 31,
            };
            let (cache, _) = s.run(&named_steps(3));
            assert!(
                cache.layers()[0].awaiting_conversion(),
                "{codec:?}: still bf16"
            );

            // Converting inside a bidirectional chunk: start 20, the chunk 16..22.
            let s = Scenario {
                quantized_kv_start: 20,
                ..s
            };
            let steps = [
                Step::Causal(16),
                Step::Bidirectional(6, vec![vec![0..6], vec![1..4], vec![]]),
            ];
            let (mut cache, _) = s.run(&steps);
            let layer = cache.layer_mut(0);
            assert!(
                !layer.awaiting_conversion(),
                "{codec:?}: converted at 22 ≥ 20"
            );
            assert_eq!(layer.minimum_reusable_offset(), Some(22));
            let mut seed = 3;
            let (k, _) = random((3, 1, 2, 32), &mut seed);
            let err = layer
                .append_bidirectional(&k, &k, &[std::iter::once(0..2).collect(), vec![], vec![]])
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    KvError::ReadNotServed {
                        read: "bidirectional",
                        ..
                    }
                ),
                "{err}"
            );
        }
    }
}

/// On affine and turbo storage after conversion every named read is a typed refusal that
/// leaves the cache exactly as it was.
#[test]
fn named_reads_refused_on_quantized_storage_change_nothing() {
    let codecs = [
        Codec::Affine { bits: 4, group: 32 },
        Codec::Affine { bits: 8, group: 32 },
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
        Codec::Turbo {
            kbits: 2,
            vbits: 3,
            prep: TurboPrep {
                key_mean: false,
                key_scale: false,
                pairs: false,
            },
        },
    ];
    for codec in codecs {
        for window in [None, Some(8)] {
            let s = Scenario {
                codec,
                store: PlainDType::Bf16,
                quantized_kv_start: 0,
                kvh: 1,
                gqa: 2,
                d: 32,
                window,
                pads: vec![0, 2],
                seed: 5,
            };
            let mut cache = s.cache();
            let mut seed = 9;
            let (k, _) = random((2, 1, 12, 32), &mut seed);
            cache.layer_mut(0).append_window(&k, &k).unwrap();
            assert!(!cache.layers()[0].awaiting_conversion());
            let before = cache.state().unwrap();
            let (k, _) = random((2, 1, 4, 32), &mut seed);
            let blocks = vec![vec![0..4], vec![1..3]];
            let name = codec.to_string();
            let check = |err: KvError, read: &str| match &err {
                KvError::ReadNotServed {
                    layer: 0,
                    read: r,
                    codec: c,
                } if *r == read && *c == name => {
                    assert!(err.to_string().contains(read), "{err}");
                }
                other => panic!("{name}: the {read} read gave {other:?}"),
            };
            check(
                cache
                    .layer_mut(0)
                    .append_bidirectional(&k, &k, &blocks)
                    .unwrap_err(),
                "bidirectional",
            );
            assert!(
                cache.state().unwrap() == before,
                "{name}: a refused read changes nothing"
            );
            check(
                cache
                    .layer_mut(0)
                    .append_encoder_window(&k, &k, &blocks)
                    .unwrap_err(),
                "encoder-window",
            );
            assert!(
                cache.state().unwrap() == before,
                "{name}: a refused read changes nothing"
            );
            check(cache.layers()[0].read_block(&k, &k).unwrap_err(), "block");
            assert!(
                cache.state().unwrap() == before,
                "{name}: a refused read changes nothing"
            );
            // The cache goes on as before: a causal append still works.
            cache.layer_mut(0).append_window(&k, &k).unwrap();
            assert_eq!(cache.end(), 16);
        }
    }
}

/// A bidirectional append given the wrong number of block lists is refused, leaving the
/// cache as it was.
#[test]
fn bidirectional_with_wrong_block_rows_changes_nothing() {
    let s = &plain_scenarios()[1]; // bf16, full, 3 rows
    let mut cache = s.cache();
    let mut seed = 4;
    let (k, _) = random((3, 2, 8, 16), &mut seed);
    cache.layer_mut(0).append_window(&k, &k).unwrap();
    let before = cache.state().unwrap();
    let (k, _) = random((3, 2, 3, 16), &mut seed);
    let err = cache
        .layer_mut(0)
        .append_bidirectional(&k, &k, &[std::iter::once(0..3).collect()])
        .unwrap_err();
    assert!(matches!(err, KvError::Rows(_)), "{err:?}");
    assert!(err.to_string().contains("blocks"), "{err}");
    assert!(
        cache.state().unwrap() == before,
        "a refused append changes nothing"
    );
}

/// Donor rows of full and wrapped-window layers with left padding, after rollbacks: each
/// row's keys and values exactly its live positions in temporal order, as stored.
#[test]
fn donor_rows_are_the_live_positions_in_order() {
    use Step::*;
    for dtype in [PlainDType::Bf16, PlainDType::F16, PlainDType::F32] {
        for window in [None, Some(8)] {
            let s = Scenario {
                codec: Codec::Plain(dtype),
                store: dtype,
                quantized_kv_start: 0,
                kvh: 2,
                gqa: 1,
                d: 8,
                window,
                pads: vec![0, 2, 5],
                seed: 77,
            };
            let mut cache = s.cache();
            let mut model = Model::new(s.kvh, s.d, &s.pads, window);
            let mut seed = s.seed;
            let steps = [
                Causal(7),
                Causal(1),
                Round(4, vec![1, 3, 0]),
                Causal(9),
                Round(3, vec![2, 0, 1]),
                Causal(1),
                Round(4, vec![0, 4, 2]),
            ];
            for (at, step) in steps.iter().enumerate() {
                s.step(&mut cache, &mut model, step, &mut seed, at);
                let donor = cache.layers()[0].capture_donor_rows().unwrap();
                assert_eq!(cache.capture_donor_rows().unwrap()[0].ends, donor.ends);
                for r in 0..3 {
                    let live = model.live(r);
                    let ctx = format!("{dtype:?} {window:?} step {at} row {r} live {live:?}");
                    assert_eq!(donor.offsets[r], model.ends[r] - model.pads[r], "{ctx}");
                    assert_eq!(donor.starts[r], live.start, "{ctx}");
                    assert_eq!(donor.ends[r], model.ends[r], "{ctx}");
                    for (t, list) in [
                        (&donor.keys[r], &model.keys[r]),
                        (&donor.values[r], &model.values[r]),
                    ] {
                        assert_eq!(t.dims(), &[1, s.kvh, live.len(), s.d], "{ctx}");
                        let want: Vec<f32> = (0..s.kvh)
                            .flat_map(|h| live.clone().flat_map(move |p| list[h][p].clone()))
                            .collect();
                        let got = flat(t);
                        assert!(
                            got.iter()
                                .zip(&want)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{ctx}: donor rows differ from the stored positions"
                        );
                    }
                }
                if window.is_some() && at == 3 {
                    assert!(
                        model.held.iter().zip(&model.pads).any(|(h, p)| h > p),
                        "the ring wrapped"
                    );
                }
            }
        }
    }
}

/// An engine-style prefill that chunks at `min(chunk, max_append_tokens)` converts exactly
/// at `quantized_kv_start`: the chunk ending there is read in bf16, the next quantized.
#[test]
fn max_append_tokens_converts_exactly_at_start() {
    const S: usize = 20;
    let codecs = [
        Codec::Affine { bits: 4, group: 32 },
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
    ];
    for codec in codecs {
        let pads = vec![0, 3];
        let s = Scenario {
            codec,
            store: PlainDType::Bf16,
            quantized_kv_start: S,
            kvh: 1,
            gqa: 2,
            d: 32,
            window: None,
            pads: pads.clone(),
            seed: 55,
        };
        let (b, d, qh) = (2, 32, 2);
        let scale = 1.0 / (d as f32).sqrt();
        let mut cache = s.cache();
        let mut bf16 = Model::new(1, d, &pads, None);
        let mut quant = Model::new(1, d, &pads, None);
        let affine = match codec {
            Codec::Affine { bits, group } => Some(Store::Affine {
                bits,
                group: group as usize,
            }),
            _ => None,
        };
        let mut seed = 1;
        let (mut remaining, chunk) = (30, 8);
        let mut chunks = Vec::new();
        // Affine: the keys and values appended so far, until the layer converts; then the
        // planes holding the key means fitted on each row's live keys held then.
        let mut raw: Vec<(Tensor, Tensor)> = Vec::new();
        let mut fitted: Option<AffinePlanes> = None;
        while remaining > 0 {
            let end = cache.end();
            let bound = cache.max_append_tokens();
            assert_eq!(bound, (end < S).then(|| S - end), "{codec:?} at {end}");
            let n = chunk.min(remaining).min(bound.unwrap_or(usize::MAX));
            chunks.push(n);
            let (k, _) = random((b, 1, n, d), &mut seed);
            let (v, _) = random((b, 1, n, d), &mut seed);
            let (q, qd) = random((b, qh, n, d), &mut seed);
            let round = Store::Round(PlainDType::Bf16);
            bf16.append(n, (&stored(&k, round), &stored(&v, round)));
            if let Some(Store::Affine { bits, group }) = affine {
                let held = |p: &AffinePlanes, k: &Tensor, v: &Tensor| {
                    let st = |x: &Tensor, keys| flat(&p.as_stored(0, x, keys).unwrap());
                    (st(k, true), st(v, false))
                };
                match &fitted {
                    Some(p) => {
                        let (sk, sv) = held(p, &k, &v);
                        quant.append(n, (&sk, &sv));
                    }
                    None => {
                        raw.push((k.clone(), v.clone()));
                        if end + n >= S {
                            // The conversion: means from each row's live keys (after its
                            // padding), then every held position stored with them.
                            let cat = |i: usize| {
                                let parts: Vec<&Tensor> = raw
                                    .iter()
                                    .map(|c| if i == 0 { &c.0 } else { &c.1 })
                                    .collect();
                                Tensor::cat(&parts, 2).unwrap()
                            };
                            let (ka, va) = (cat(0), cat(1));
                            let live: Vec<Range<usize>> =
                                pads.iter().map(|&p| p..end + n).collect();
                            let mut p = AffinePlanes::new(bits, group, b, 1, d, d);
                            p.fit_key_prep(&ka, &live, TurboPrep::ALL, None).unwrap();
                            let (sk, sv) = held(&p, &ka, &va);
                            quant = Model::new(1, d, &pads, None);
                            quant.append(end + n, (&sk, &sv));
                            fitted = Some(p);
                        }
                    }
                }
            }
            let starts = vec![end; b];
            let causal = |m: &Model| {
                reference(
                    &qd,
                    (b, qh, n, d),
                    &m.keys,
                    &m.values,
                    |r, i, p| m.causal(r, starts[r] + i, p),
                    scale,
                )
            };
            let got = flat(
                &cache
                    .layer_mut(0)
                    .append_window(&k, &v)
                    .unwrap()
                    .attend(&q, scale)
                    .unwrap(),
            );
            let real = |r: usize, i: usize| end + i >= pads[r];
            let bf16_err = max_error(&got, &causal(&bf16), (b, qh, n, d), real);
            let converted = end + n > S;
            if !converted {
                assert!(
                    bf16_err <= TOLERANCE,
                    "{codec:?} chunk {end}+{n}: bf16 read off by {bf16_err}"
                );
            } else {
                assert!(
                    bf16_err > 1e-3,
                    "{codec:?} chunk {end}+{n}: read bf16 after converting"
                );
                if affine.is_some() {
                    let err = max_error(&got, &causal(&quant), (b, qh, n, d), real);
                    assert!(
                        err <= TOLERANCE,
                        "{codec:?} chunk {end}+{n}: quantized read off by {err}"
                    );
                }
            }
            if end + n == S && affine.is_some() {
                let err = max_error(&got, &causal(&quant), (b, qh, n, d), real);
                assert!(
                    err > 1e-3,
                    "{codec:?}: the converting chunk was read quantized"
                );
            }
            let layer = &cache.layers()[0];
            assert_eq!(
                layer.awaiting_conversion(),
                end + n < S,
                "{codec:?} at {}",
                end + n
            );
            assert_eq!(cache.minimum_reusable_offset(), (end + n >= S).then_some(S));
            remaining -= n;
        }
        assert_eq!(
            chunks,
            vec![8, 8, 4, 8, 2],
            "{codec:?}: chunks end at S = {S}"
        );
        assert_eq!(cache.max_append_tokens(), None);
    }
    // Plain codecs have no bound; quantized ones converting at the first append bound only
    // that append (to FIRST_APPEND, so a row's codec is fitted on the same positions however
    // its prompt is chunked), and a row whose first append was shorter is never reused.
    for (codec, start) in [
        (Codec::Plain(PlainDType::Bf16), 20),
        (Codec::Plain(PlainDType::F32), 0),
        (Codec::Affine { bits: 4, group: 32 }, 0),
    ] {
        let quantized = !matches!(codec, Codec::Plain(_));
        let s = Scenario {
            codec,
            store: PlainDType::Bf16,
            quantized_kv_start: start,
            kvh: 1,
            gqa: 1,
            d: 32,
            window: None,
            pads: vec![0],
            seed: 1,
        };
        let mut cache = s.cache();
        let bound = cache.max_append_tokens();
        let first = quantized.then_some(tessera_kv::FIRST_APPEND);
        assert_eq!(bound, first, "{codec:?} start {start}");
        let mut seed = 2;
        let (k, _) = random((1, 1, 5, 32), &mut seed);
        cache.layer_mut(0).append_window(&k, &k).unwrap();
        assert_eq!(cache.max_append_tokens(), None, "{codec:?} start {start}");
        assert_eq!(
            cache.minimum_reusable_offset(),
            quantized.then_some(tessera_kv::NEVER_REUSED),
            "{codec:?} start {start}"
        );
    }
}
