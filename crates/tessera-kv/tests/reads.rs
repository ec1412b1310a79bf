//! Layer-cache reads against an independent reference: every position kept in a plain
//! list, attention computed in f64 loops with the mask written out from its definition
//! (causal, left padding, sliding window). Covers chunked appends, decode steps, rings that
//! wrap, GQA, left-padded rows and trim, for every codec: the values a read attends are
//! modelled per position from the codec's definition (inputs rounded to bf16 or f16; affine
//! and turbo positions quantized and dequantized one at a time, after the bf16-first
//! transition), never taken from the read itself. Every read is checked at every level of
//! [`Isa::supported`].

use candle_core::{Device, Tensor};
use proptest::prelude::*;
use tessera_kv::planes::{AffinePlanes, Planes, TurboPlanes};
use tessera_kv::{
    AttentionCache, Codec, Isa, KvCache, KvError, KvScheme, LayerSpec, PlainDType, Retention,
    TurboPrep,
};

struct Reference {
    keys: Vec<Vec<Vec<Vec<f32>>>>, // [row][head][pos][d]
    values: Vec<Vec<Vec<Vec<f32>>>>,
}

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

/// Attention of the queries `queries` (indices into the chunk) of `q` `(b, qh, n, d)` over
/// every position of `r`, in f64, with the mask from its definition: query position
/// `qp = start + i` of row `row` sees key position `k` iff `k ≤ qp` (causal), `k ≥ pads[row]`
/// (left padding) and `qp − k < window` (sliding window). Padding queries (`qp < pads[row]`)
/// are left 0: their output is unspecified.
#[allow(clippy::too_many_arguments)]
fn reference_attend_at(
    r: &Reference,
    q: &[f32],
    (b, qh, n, d): (usize, usize, usize, usize),
    kvh: usize,
    start: usize,
    pads: &[usize],
    window: Option<usize>,
    scale: f32,
    queries: &[usize],
) -> Vec<f32> {
    let g = qh / kvh;
    let mut out = vec![0f32; b * qh * n * d];
    for row in 0..b {
        for h in 0..qh {
            let keys = &r.keys[row][h / g];
            let values = &r.values[row][h / g];
            for &i in queries {
                let qp = start + i;
                let visible: Vec<usize> = (0..=qp)
                    .filter(|&k| k >= pads[row] && window.is_none_or(|w| qp - k < w))
                    .collect();
                if qp < pads[row] {
                    continue; // padding query: output unspecified
                }
                let qv = &q[((row * qh + h) * n + i) * d..][..d];
                let scores: Vec<f64> = visible
                    .iter()
                    .map(|&k| {
                        keys[k]
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
                    let v: f64 = visible
                        .iter()
                        .zip(&exps)
                        .map(|(&k, e)| e / z * values[k][dd] as f64)
                        .sum();
                    out[((row * qh + h) * n + i) * d + dd] = v as f32;
                }
            }
        }
    }
    out
}

/// One read scenario: a single layer of `codec`, appended `chunks` (1: a decode step through
/// `append_decode`; more: a chunk through `append_window`), every read checked against
/// [`reference_attend_at`] at every instruction level this CPU runs.
#[derive(Debug, Clone)]
struct Case {
    codec: Codec,
    kvh: usize,
    /// Query heads per KV head.
    gqa: usize,
    d: usize,
    window: Option<usize>,
    pads: Vec<usize>,
    /// The scheme's `quantized_kv_start`.
    start: usize,
    chunks: Vec<usize>,
    seed: u64,
}

/// What a read returns for each stored position, from each codec's own definition: plain
/// dtypes round the input; a quantized codec holds bf16 until the append that converts it
/// (that append is read in bf16 too) and afterwards returns each position quantized and
/// dequantized on its own (`as_stored`), turbo keys with the preparation and affine keys
/// with the means fitted once per row, at conversion, on the bf16 keys that row held then
/// at its live (non-padding) positions.
struct StoredModel {
    codec: Codec,
    quantized: bool,
    /// Turbo: one 1-row planes per row, holding that row's fitted key preparation.
    turbo: Vec<TurboPlanes>,
    /// Affine: one 1-row planes per row, holding that row's fitted key means.
    affine: Vec<AffinePlanes>,
}

fn rounded(x: &Tensor, dtype: PlainDType) -> Vec<f32> {
    let x: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
    match dtype {
        PlainDType::F32 => x,
        PlainDType::Bf16 => x
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect(),
        PlainDType::F16 => x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect(),
    }
}

impl StoredModel {
    /// `x` `(rows, kv_heads, n, dim)` as a read returns it now, row-major.
    fn stored(&self, x: &Tensor, keys: bool) -> Vec<f32> {
        let flat = |t: Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
        match (self.codec, self.quantized) {
            (Codec::Plain(dtype), _) => rounded(x, dtype),
            (_, false) => rounded(x, PlainDType::Bf16),
            (codec, true) => {
                // Each row through its own fitted planes.
                let row = |r: usize| x.narrow(0, r, 1).unwrap();
                let rows: Vec<Tensor> = match codec {
                    Codec::Affine { .. } => (self.affine.iter().enumerate())
                        .map(|(r, p)| p.as_stored(0, &row(r), keys).unwrap())
                        .collect(),
                    _ => (self.turbo.iter().enumerate())
                        .map(|(r, p)| p.as_stored(0, &row(r), keys).unwrap())
                        .collect(),
                };
                assert_eq!(rows.len(), x.dims()[0], "one fitted row per row");
                flat(Tensor::cat(&rows, 0).unwrap())
            }
        }
    }
}

/// The positions a row's turbo key preparation is fitted on at conversion: every live
/// (non-padding) position among `held` (the positions the layer holds, in slot order), in
/// temporal order — however a wrapped ring has placed them.
fn fitted_positions(held: &[usize], pad: usize) -> Vec<usize> {
    let mut live: Vec<usize> = held.iter().copied().filter(|&p| p >= pad).collect();
    live.sort_unstable();
    live
}

/// Positions `positions` of `raw` (`[row][head][pos]`) as a `(rows, heads, len, dim)` tensor.
fn gather(raw: &[Vec<Vec<Vec<f32>>>], positions: &[usize]) -> Tensor {
    let (b, h, d) = (raw.len(), raw[0].len(), raw[0][0][0].len());
    let mut data = Vec::with_capacity(b * h * positions.len() * d);
    for row in raw {
        for head in row {
            for &p in positions {
                data.extend_from_slice(&head[p]);
            }
        }
    }
    Tensor::from_vec(data, (b, h, positions.len(), d), &Device::Cpu).unwrap()
}

/// Writes `flat` `(rows, heads, len, dim)` back to positions `positions` of `r`.
fn scatter(r: &mut [Vec<Vec<Vec<f32>>>], positions: &[usize], flat: &[f32]) {
    let d = r[0][0][0].len();
    let mut chunks = flat.chunks_exact(d);
    for row in r.iter_mut() {
        for head in row.iter_mut() {
            for &p in positions {
                head[p] = chunks.next().unwrap().to_vec();
            }
        }
    }
}

/// The queries of a chunk the reference computes: every one of a short chunk; of a long one
/// the first and last 8, each row's first real query and its neighbours, the queries around
/// the window's length, and 8 more at random (the reference is O(queries · keys) in f64).
fn checked_queries(
    n: usize,
    start: usize,
    pads: &[usize],
    window: Option<usize>,
    seed: &mut u64,
) -> Vec<usize> {
    if n <= 32 {
        return (0..n).collect();
    }
    let mut qs = std::collections::BTreeSet::new();
    qs.extend((0..8).chain(n - 8..n));
    for &p in pads {
        for i in [p, p + 1].into_iter().filter_map(|p| p.checked_sub(start)) {
            qs.insert(i.min(n - 1));
        }
    }
    if let Some(w) = window {
        qs.extend((w.saturating_sub(1)..w + 2).filter(|&i| i < n));
    }
    for _ in 0..8 {
        qs.insert(((lcg(seed) + 1.0) / 2.0 * n as f32) as usize % n);
    }
    qs.into_iter().collect()
}

fn check_reads(case: &Case) {
    let Case {
        codec,
        kvh,
        gqa,
        d,
        window,
        ref pads,
        start: quantized_kv_start,
        ref chunks,
        seed,
    } = *case;
    let b = pads.len();
    let qh = kvh * gqa;
    let spec = LayerSpec {
        kv_heads: kvh,
        head_dim: d,
        value_dim: d,
        retention: window.map_or(Retention::Full, |size| Retention::Window { size }),
    };
    let mut scheme = KvScheme::uniform(codec);
    scheme.quantized_kv_start = quantized_kv_start;
    let levels = Isa::supported();
    let mut caches: Vec<KvCache> = levels
        .iter()
        .map(|&isa| {
            KvCache::new(&[spec], &scheme, pads.clone())
                .unwrap()
                .with_isa(isa)
        })
        .collect();
    for (cache, &isa) in caches.iter().zip(&levels) {
        assert_eq!(cache.layers()[0].isa(), isa);
    }
    let empty = || vec![vec![Vec::new(); kvh]; b];
    let (mut raw_k, mut raw_v) = (empty(), empty());
    let mut reference = Reference {
        keys: empty(),
        values: empty(),
    };
    let mut model = StoredModel {
        codec,
        quantized: false,
        turbo: Vec::new(),
        affine: Vec::new(),
    };
    let mut seed = seed;
    let scale = 1.0 / (d as f32).sqrt();
    let mut end = 0;
    for (step, &n) in chunks.iter().enumerate() {
        let (k, kd) = random((b, kvh, n, d), &mut seed);
        let (v, vd) = random((b, kvh, n, d), &mut seed);
        let (q, qd) = random((b, qh, n, d), &mut seed);
        let (sk, sv) = (model.stored(&k, true), model.stored(&v, false));
        for row in 0..b {
            for h in 0..kvh {
                for i in 0..n {
                    let at = ((row * kvh + h) * n + i) * d;
                    raw_k[row][h].push(kd[at..at + d].to_vec());
                    raw_v[row][h].push(vd[at..at + d].to_vec());
                    reference.keys[row][h].push(sk[at..at + d].to_vec());
                    reference.values[row][h].push(sv[at..at + d].to_vec());
                }
            }
        }
        let queries = checked_queries(n, end, pads, window, &mut seed);
        let want = reference_attend_at(
            &reference,
            &qd,
            (b, qh, n, d),
            kvh,
            end,
            pads,
            window,
            scale,
            &queries,
        );
        for (cache, isa) in caches.iter_mut().zip(&levels) {
            let layer = cache.layer_mut(0);
            let read = if n == 1 {
                layer.append_decode(&k, &v).unwrap()
            } else {
                layer.append_window(&k, &v).unwrap()
            };
            assert_eq!(read.isa(), *isa, "the read runs at the cache's level");
            let got: Vec<f32> = read
                .attend(&q, scale)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            for (row, &pad) in pads.iter().enumerate() {
                for h in 0..qh {
                    for &i in queries.iter().filter(|&&i| end + i >= pad) {
                        let at = ((row * qh + h) * n + i) * d;
                        for dd in 0..d {
                            let (g, w) = (got[at + dd], want[at + dd]);
                            assert!(
                                (g - w).abs() <= TOLERANCE * (1.0 + w.abs()),
                                "{isa}, append {step} ({n} at {end}), row {row} head {h} \
                                 query {i} dim {dd}: {g} vs {w}\n{case:?}"
                            );
                        }
                    }
                }
            }
        }
        end += n;
        if codec.is_quantized() && !model.quantized && end >= quantized_kv_start {
            // The converting append: the layer now holds (slot order) the bf16 positions its
            // ring or list kept, quantized; a turbo layer fits its key preparation on them.
            let held: Vec<usize> = match window {
                Some(size) if end > size => {
                    let mut slots = vec![0; size];
                    (end - size..end).for_each(|p| slots[p % size] = p);
                    slots
                }
                _ => (0..end).collect(),
            };
            // Each row's own preparation, fitted on its live positions only.
            let fitted = |planes: &mut dyn Planes, row: usize, prep: TurboPrep| {
                let live = fitted_positions(&held, pads[row]);
                let bf16 = Tensor::from_vec(
                    rounded(&gather(&raw_k[row..row + 1], &live), PlainDType::Bf16),
                    (1, kvh, live.len(), d),
                    &Device::Cpu,
                )
                .unwrap();
                planes
                    .fit_key_prep(&bf16, std::slice::from_ref(&(0..live.len())), prep, None)
                    .unwrap();
            };
            match codec {
                Codec::Turbo { kbits, vbits, prep } => {
                    model.turbo = (0..b)
                        .map(|row| {
                            let mut planes = TurboPlanes::new(kbits, vbits, 1, kvh, d, d);
                            fitted(&mut planes, row, prep);
                            planes
                        })
                        .collect();
                }
                Codec::Affine { bits, group } => {
                    model.affine = (0..b)
                        .map(|row| {
                            let mut planes = AffinePlanes::new(bits, group as usize, 1, kvh, d, d);
                            fitted(&mut planes, row, TurboPrep::ALL);
                            planes
                        })
                        .collect();
                }
                Codec::Plain(_) => {}
            }
            model.quantized = true;
            let (sk, sv) = (
                model.stored(&gather(&raw_k, &held), true),
                model.stored(&gather(&raw_v, &held), false),
            );
            scatter(&mut reference.keys, &held, &sk);
            scatter(&mut reference.values, &held, &sv);
        }
        for cache in &caches {
            assert_eq!(cache.end(), end);
            assert_eq!(
                cache.layers()[0].awaiting_conversion(),
                codec.is_quantized() && !model.quantized,
                "append {step}: the layer converts when the model does"
            );
        }
    }
}

/// Largest accepted `|fused − reference| / (1 + |reference|)`: f32 arithmetic (and the
/// fused reads' exp, within 1e-6) against f64 on the same stored values. The largest seen
/// over 300 random cases at every level was 2.9e-7; one key masked wrongly, or one stored
/// code off, moves an output by ~1e-4 or more.
const TOLERANCE: f32 = 1e-5;

#[allow(clippy::too_many_arguments)]
fn run_case(
    kvh: usize,
    group: usize,
    d: usize,
    window: Option<usize>,
    pads: Vec<usize>,
    chunks: &[usize],
    seed: u64,
) {
    check_reads(&Case {
        codec: Codec::Plain(PlainDType::F32),
        kvh,
        gqa: group,
        d,
        window,
        pads,
        start: 0,
        chunks: chunks.to_vec(),
        seed,
    });
}

#[test]
fn full_layer_chunked_then_decode() {
    run_case(2, 2, 64, None, vec![0], &[7, 300, 1, 1, 1], 1);
}

#[test]
fn window_ring_wraps_in_chunks_and_decode() {
    run_case(1, 4, 32, Some(16), vec![0], &[5, 20, 1, 1, 9, 1, 40, 1], 2);
}

#[test]
fn long_chunks_in_query_blocks_with_window_and_padding() {
    run_case(1, 2, 32, Some(100), vec![0, 7], &[150, 1, 300, 1], 4);
    run_case(2, 2, 16, None, vec![3, 0], &[129, 257, 1], 5);
}

#[test]
fn left_padded_rows_with_window() {
    run_case(1, 2, 16, Some(8), vec![0, 3, 6], &[7, 1, 1, 12, 1], 3);
}

/// Appends `n` fresh positions to layer `layer` of `cache` and checks the read against
/// [`reference_attend_at`] over `reference` (bf16 storage, one row, one KV head, two query
/// heads, head_dim 8), which takes the new positions too.
fn append_checked(
    cache: &mut KvCache,
    layer: usize,
    reference: &mut Reference,
    window: Option<usize>,
    n: usize,
    seed: &mut u64,
) {
    let d = 8;
    let (k, _) = random((1, 1, n, d), seed);
    let (v, _) = random((1, 1, n, d), seed);
    let (q, qd) = random((1, 2, n, d), seed);
    let start = reference.keys[0][0].len();
    assert_eq!(cache.layers()[layer].rows().end_of(0), start);
    let (sk, sv) = (rounded(&k, PlainDType::Bf16), rounded(&v, PlainDType::Bf16));
    for i in 0..n {
        reference.keys[0][0].push(sk[i * d..][..d].to_vec());
        reference.values[0][0].push(sv[i * d..][..d].to_vec());
    }
    let scale = 0.35;
    let queries: Vec<usize> = (0..n).collect();
    let want = reference_attend_at(
        reference,
        &qd,
        (1, 2, n, d),
        1,
        start,
        &[0],
        window,
        scale,
        &queries,
    );
    let isa = cache.layers()[layer].isa();
    let l = cache.layer_mut(layer);
    let read = if n == 1 {
        l.append_decode(&k, &v).unwrap()
    } else {
        l.append_window(&k, &v).unwrap()
    };
    let got: Vec<f32> = read
        .attend(&q, scale)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= TOLERANCE * (1.0 + w.abs()),
            "{isa}, layer {layer}, {n} at {start}, output {i}: {g} vs {w}"
        );
    }
}

/// Trims on a full layer and a sliding-window ring (window 4, `slack` extra slots), checked
/// against the reference. A full layer trims anything it holds. A ring of `4 + slack` slots
/// that has wrapped holds positions `end − 4 − slack .. end`; after a trim of `t` the next
/// query, at `end − t`, needs positions from `end − t − 3`, so the ring trims up to
/// `slack + 1` positions and refuses one more with `RingOverwritten` (changing nothing on
/// any layer). After an allowed trim the reads still match the reference.
#[test]
fn trim_full_then_continue_and_wrapped_ring_trims_what_it_still_holds() {
    let spec = |retention| LayerSpec {
        kv_heads: 1,
        head_dim: 8,
        value_dim: 8,
        retention,
    };
    let window = 4;
    let windows = [None, Some(window)];
    let scheme = KvScheme::uniform(Codec::Plain(PlainDType::Bf16));
    for isa in Isa::supported() {
        for slack in [0usize, 2] {
            let ring = window + slack;
            let mut cache = KvCache::new(
                &[
                    spec(Retention::Full),
                    spec(Retention::Window { size: window }),
                ],
                &scheme,
                vec![0],
            )
            .unwrap()
            .with_isa(isa)
            .with_round_slack(slack);
            assert_eq!(cache.layers()[1].round_slack(), slack);
            let mut refs: Vec<Reference> = (0..2)
                .map(|_| Reference {
                    keys: vec![vec![Vec::new()]],
                    values: vec![vec![Vec::new()]],
                })
                .collect();
            let mut seed = 9 + slack as u64;
            let mut append = |cache: &mut KvCache, refs: &mut [Reference], n: usize| {
                for (layer, r) in refs.iter_mut().enumerate() {
                    append_checked(cache, layer, r, windows[layer], n, &mut seed);
                }
            };
            let trim_refs = |refs: &mut [Reference], end: usize| {
                for r in refs.iter_mut() {
                    r.keys[0][0].truncate(end);
                    r.values[0][0].truncate(end);
                }
            };
            // A ring that has not wrapped trims like a full layer.
            append(&mut cache, &mut refs, 3);
            cache.trim(2).unwrap();
            assert_eq!(cache.end(), 1);
            trim_refs(&mut refs, 1);
            append(&mut cache, &mut refs, 6);
            append(&mut cache, &mut refs, 1);
            append(&mut cache, &mut refs, 1);
            append(&mut cache, &mut refs, 1);
            for round in 0..2 {
                let end = cache.end();
                assert!(end > ring, "the ring has wrapped");
                assert_eq!(cache.layers()[1].rows().held_from(), &[end - ring]);
                // One past the boundary: the next query would need a position the ring
                // overwrote.
                let err = cache.trim(slack + 2).unwrap_err();
                match err {
                    KvError::RingOverwritten {
                        layer,
                        row,
                        wanted,
                        window: w,
                        slots,
                        needed,
                        held,
                    } => {
                        assert_eq!((layer, row, w, slots), (1, 0, window, ring), "{err}");
                        assert_eq!(wanted, end - slack - 2, "{err}");
                        assert_eq!(needed, end - slack - 2 + 1 - window, "{err}");
                        assert_eq!(held, end - ring, "{err}");
                        assert_eq!(needed + 1, held, "exactly one position short: {err}");
                    }
                    other => panic!("slack {slack} round {round}: {other}"),
                }
                assert_eq!(cache.end(), end, "a refused trim changes nothing");
                assert_eq!(cache.layers()[0].rows().ends(), vec![end]);
                let err = cache.trim(end + 1).unwrap_err();
                assert!(
                    matches!(err, KvError::TrimTooFar { requested, held, .. } if requested == end + 1 && held == end),
                    "{err}"
                );
                assert_eq!(cache.end(), end);
                // At the boundary: every position the next query needs is still held.
                cache.trim(slack + 1).unwrap();
                assert_eq!(cache.end(), end - slack - 1);
                trim_refs(&mut refs, end - slack - 1);
                append(&mut cache, &mut refs, 1);
                append(&mut cache, &mut refs, 3);
                append(&mut cache, &mut refs, 1);
            }
            assert_eq!(cache.bytes_per_token(), 2 * (8 + 8) * 2);
            assert_eq!(
                cache.signatures(),
                vec![
                    "kv:plain:bf16".to_string(),
                    "kv:window4:plain:bf16".to_string()
                ]
            );
        }
    }
}

#[test]
fn wrong_shapes_are_typed_errors() {
    let spec = LayerSpec {
        kv_heads: 2,
        head_dim: 8,
        value_dim: 8,
        retention: Retention::Full,
    };
    let mut cache = KvCache::new(
        &[spec],
        &KvScheme::uniform(Codec::Plain(PlainDType::F32)),
        vec![0],
    )
    .unwrap();
    let mut seed = 1;
    let (k, _) = random((1, 1, 3, 8), &mut seed);
    let err = cache
        .layer_mut(0)
        .append_window(&k, &k)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer 0") && err.contains("kv_heads 2"),
        "{err}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn reads_match_reference(
        kvh in 1usize..3,
        group in prop::sample::select(vec![1usize, 2, 4]),
        d in prop::sample::select(vec![16usize, 64]),
        window in prop::option::of(4usize..40),
        pads in prop::collection::vec(0usize..5, 1..3),
        chunks in prop::collection::vec(prop_oneof![Just(1usize), 2usize..50], 1..6),
        seed in any::<u64>(),
    ) {
        let longest_pad = *pads.iter().max().unwrap();
        let mut chunks = chunks;
        chunks[0] = chunks[0].max(longest_pad + 1);
        run_case(kvh, group, d, window, pads, &chunks, seed);
    }
}

/// The fused bf16 decode read over full and wrapped-ring layers with left-padded rows, 40
/// decode steps past a chunk.
#[test]
fn fused_bf16_decode_matches_reference_past_the_wrap() {
    for window in [None, Some(24)] {
        check_reads(&Case {
            codec: Codec::Plain(PlainDType::Bf16),
            kvh: 2,
            gqa: 4,
            d: 64,
            window,
            pads: vec![0, 5, 2],
            start: 0,
            chunks: [vec![30], vec![1; 40]].concat(),
            seed: 42,
        });
    }
}

#[test]
fn affine_reads_match_reference_through_the_transition() {
    for codec in [
        Codec::Affine { bits: 4, group: 32 },
        Codec::Affine { bits: 3, group: 64 },
        Codec::Affine { bits: 8, group: 64 },
    ] {
        let case = |gqa, window, pads: Vec<usize>, chunks: &[usize], seed| Case {
            codec,
            kvh: 1,
            gqa,
            d: 64,
            window,
            pads,
            start: 0,
            chunks: chunks.to_vec(),
            seed,
        };
        check_reads(&case(4, None, vec![0], &[9, 1, 40, 1, 1], 11));
        check_reads(&case(2, Some(16), vec![0, 3], &[5, 30, 1, 1, 20, 1], 12));
    }
}

/// Every quantized codec converting at a decode step and inside a chunk (a nonzero
/// `quantized_kv_start`), on full layers and on rings that wrapped before and after
/// converting: the converting append reads bf16, every later one the quantized values.
#[test]
fn quantized_reads_match_reference_when_converting_late() {
    let codecs = [
        Codec::Affine { bits: 2, group: 32 },
        Codec::Affine {
            bits: 5,
            group: 128,
        },
        Codec::Affine { bits: 6, group: 64 },
        Codec::Turbo {
            kbits: 4,
            vbits: 3,
            prep: TurboPrep::ALL,
        },
        Codec::Turbo {
            kbits: 8,
            vbits: 2,
            prep: TurboPrep {
                key_mean: false,
                key_scale: true,
                pairs: false,
            },
        },
        Codec::Turbo {
            kbits: 3,
            vbits: 6,
            prep: TurboPrep {
                key_mean: true,
                key_scale: false,
                pairs: false,
            },
        },
    ];
    for (c, codec) in codecs.into_iter().enumerate() {
        for (window, start) in [(None, 21), (None, 30), (Some(12), 21), (Some(12), 45)] {
            check_reads(&Case {
                codec,
                kvh: 2,
                gqa: 2,
                d: 128,
                window,
                pads: vec![2, 0],
                start,
                // 21: a decode step converts; 30 and 45: a chunk does.
                chunks: vec![20, 1, 1, 7, 17, 1, 3, 1],
                seed: 70 + c as u64,
            });
        }
    }
}

/// Turbo layers converting when a padded row's ring has wrapped but still holds some of its
/// padding: the row's live positions sit in two runs of slots (the upper run longer in the
/// first case, the lower in the second), and its key preparation is fitted on both, in
/// temporal order ([`fitted_positions`]).
#[test]
fn turbo_prep_fitted_per_row_when_padding_splits_a_wrapped_ring() {
    for prep in [
        TurboPrep::ALL,
        TurboPrep {
            key_mean: false,
            key_scale: true,
            pairs: false,
        },
    ] {
        let codec = Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep,
        };
        for (pads, start, chunks) in [
            (vec![6, 0], 14, vec![14, 1, 1, 5, 1]),
            (vec![10, 0], 20, vec![15, 5, 1, 3, 1]),
        ] {
            check_reads(&Case {
                codec,
                kvh: 2,
                gqa: 2,
                d: 64,
                window: Some(12),
                pads,
                start,
                chunks,
                seed: 5,
            });
        }
    }
}

/// Converting from bf16 storage after several appends stores the same codes as converting
/// at once after one append of the same positions (the key means are fitted on what the
/// layer holds at conversion, the same positions either way): the next read is bit for bit
/// the same.
#[test]
fn bf16_first_conversion_equals_quantizing_after_the_fact() {
    for retention in [Retention::Full, Retention::Window { size: 24 }] {
        let spec = LayerSpec {
            kv_heads: 1,
            head_dim: 64,
            value_dim: 64,
            retention,
        };
        let mut seed = 5;
        let chunks: Vec<(Tensor, Tensor)> = [12usize, 20, 9]
            .iter()
            .map(|&n| {
                (
                    random((1, 1, n, 64), &mut seed).0,
                    random((1, 1, n, 64), &mut seed).0,
                )
            })
            .collect();
        let (kd, _) = random((1, 1, 1, 64), &mut seed);
        let (q, _) = random((1, 4, 1, 64), &mut seed);
        let cat = |i: usize| {
            let parts: Vec<&Tensor> = chunks
                .iter()
                .map(|c| if i == 0 { &c.0 } else { &c.1 })
                .collect();
            Tensor::cat(&parts, 2).unwrap()
        };
        let whole = [(cat(0), cat(1))];
        let outputs: Vec<Vec<f32>> = [0usize, 41]
            .iter()
            .map(|&start| {
                let mut scheme = KvScheme::uniform(Codec::Affine { bits: 4, group: 64 });
                scheme.quantized_kv_start = start;
                let mut cache = KvCache::new(&[spec], &scheme, vec![0]).unwrap();
                // At 0 the layer converts at its first append: all 41 positions in one.
                let appends = if start == 0 { &whole[..] } else { &chunks[..] };
                for (k, v) in appends {
                    cache.layer_mut(0).append_window(k, v).unwrap();
                }
                assert!(
                    !cache.layers()[0].awaiting_conversion(),
                    "start {start}: converted by now"
                );
                // At 0 the row's codec was fitted on its 41 positions, fewer than any
                // longer prompt's first append (FIRST_APPEND): never reused.
                assert_eq!(
                    cache.layers()[0].minimum_reusable_offset(),
                    Some(if start > 0 {
                        41
                    } else {
                        tessera_kv::NEVER_REUSED
                    })
                );
                let read = cache.layer_mut(0).append_decode(&kd, &kd).unwrap();
                read.attend(&q, 0.125)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            })
            .collect();
        assert_eq!(outputs[0], outputs[1], "{retention:?}");
    }
}

#[test]
fn affine_accounting_signature_trim_and_bad_group() {
    let spec = LayerSpec {
        kv_heads: 1,
        head_dim: 256,
        value_dim: 256,
        retention: Retention::Full,
    };
    let scheme = KvScheme::parse("affine:4").unwrap();
    let mut cache = KvCache::new(&[spec], &scheme, vec![0]).unwrap();
    let bf16 = KvCache::new(&[spec], &KvScheme::parse("bf16").unwrap(), vec![0]).unwrap();
    // 4 bits + a 16-bit scale and bias per 64 elements: 4.5 bits per element.
    assert_eq!(cache.bytes_per_token() * 8, (256 + 256) * 9 / 2);
    assert!((cache.bytes_per_token() as f64) <= 0.30 * bf16.bytes_per_token() as f64);
    assert_eq!(
        cache.signatures(),
        vec!["kv:bf16-first:affine:4:64".to_string()]
    );
    let mut seed = 3;
    let (k, _) = random((1, 1, 10, 256), &mut seed);
    cache.layer_mut(0).append_window(&k, &k).unwrap();
    assert!(!cache.layers()[0].awaiting_conversion());
    cache.trim(4).unwrap();
    assert_eq!(cache.end(), 6);
    assert!(
        !cache.layers()[0].awaiting_conversion(),
        "trimming never converts back"
    );
    let odd = LayerSpec {
        kv_heads: 1,
        head_dim: 96,
        value_dim: 96,
        retention: Retention::Full,
    };
    let err = KvCache::new(&[spec, odd], &scheme, vec![0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 1") && err.contains("96"), "{err}");
}

fn codec_strategy() -> impl Strategy<Value = Codec> {
    prop_oneof![
        Just(Codec::Plain(PlainDType::Bf16)),
        Just(Codec::Plain(PlainDType::F16)),
        Just(Codec::Plain(PlainDType::F32)),
        (
            prop::sample::select(vec![2u8, 3, 4, 5, 6, 8]),
            prop::sample::select(vec![32u16, 64, 128])
        )
            .prop_map(|(bits, group)| Codec::Affine { bits, group }),
        (2u8..=8, 2u8..=8, any::<(bool, bool)>()).prop_map(|(kbits, vbits, p)| {
            Codec::Turbo {
                kbits,
                vbits,
                prep: TurboPrep {
                    key_mean: p.0,
                    key_scale: p.1,
                    pairs: false,
                },
            }
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(FUSED_CASES))]
    /// Fused reads of every codec (decode steps and chunks, full layers and rings past their
    /// wrap, left padding, GQA, head dims 64–256, conversion at any append) against the f64
    /// reference, at every instruction level.
    #[test]
    fn fused_reads_match_reference(
        codec in codec_strategy(),
        kvh in 1usize..3,
        gqa in prop::sample::select(vec![1usize, 2, 4, 8]),
        d in prop::sample::select(vec![64usize, 128, 256]),
        window in prop::option::of(5usize..300),
        pads in prop::collection::vec(0usize..7, 1..3),
        start in prop_oneof![Just(0usize), 1usize..700],
        prefill in 1usize..500,
        appends in prop::collection::vec(prop_oneof![Just(1usize), 2usize..300], 1..5),
        seed in any::<u64>(),
    ) {
        // A group wider than the head cannot divide it (a typed error tested elsewhere).
        let codec = match codec {
            Codec::Affine { bits, group } if group as usize > d => Codec::Affine { bits, group: d as u16 },
            c => c,
        };
        let chunks = [vec![prefill], appends].concat();
        check_reads(&Case { codec, kvh, gqa, d, window, pads, start, chunks, seed });
    }
}

/// Cases of [`fused_reads_match_reference`] (each at every level of [`Isa::supported`]).
const FUSED_CASES: u32 = 200;

/// The peak-memory bound of the bf16-first transition: layers convert one at a time, each
/// dropping its bf16 planes inside its own append, so between any two layer appends at most
/// the layers not yet reached hold bf16 and no layer holds both encodings. Byte counts come
/// from the storage formulas, not from the cache's own accounting.
#[test]
fn conversion_frees_bf16_layer_by_layer() {
    let (layers, d, start) = (4, 256, 40);
    let spec = LayerSpec {
        kv_heads: 1,
        head_dim: d,
        value_dim: d,
        retention: Retention::Full,
    };
    let mut scheme = KvScheme::parse("affine:4").unwrap();
    scheme.quantized_kv_start = start;
    let mut cache = KvCache::new(&vec![spec; layers], &scheme, vec![0]).unwrap();
    // Capacity grows in steps of 256 slots in both encodings.
    let bf16_layer = 256 * 2 * d * 2;
    // Codes and f16 (scale, bias) pairs per slot, and the row's f32 key means.
    let affine_layer = 256 * 2 * (d * 4 / 8 + d / 64 * 4) + d * 4;
    let mut seed = 9;
    let (k, _) = random((1, 1, 30, d), &mut seed);
    for l in 0..layers {
        cache.layer_mut(l).append_window(&k, &k).unwrap();
    }
    assert_eq!(cache.allocated_bytes(), layers * bf16_layer);
    let (k, _) = random((1, 1, 20, d), &mut seed);
    for l in 0..layers {
        cache.layer_mut(l).append_window(&k, &k).unwrap();
        let converted = l + 1;
        assert_eq!(
            cache.allocated_bytes(),
            converted * affine_layer + (layers - converted) * bf16_layer,
            "after layer {l}'s converting append"
        );
    }
}

#[test]
fn turbo_schemes_parse_account_and_refuse_bad_input() {
    assert_eq!(
        KvScheme::parse("turbo:6:3").unwrap().default,
        Codec::Turbo {
            kbits: 6,
            vbits: 3,
            prep: TurboPrep::ALL
        }
    );
    assert_eq!(
        KvScheme::parse("turbo:4").unwrap().default,
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL
        }
    );
    let parsed = KvScheme::parse("turbo:4:nomean").unwrap().default;
    assert_eq!(
        parsed,
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep {
                key_mean: false,
                key_scale: true,
                pairs: false,
            }
        }
    );
    assert_eq!(parsed.to_string(), "turbo:4:4:nomean");
    assert!(KvScheme::parse("turbo:4:noscale:noscale").is_err());
    let pairs = KvScheme::parse("turbo:3:2:noscale:pairs").unwrap().default;
    assert_eq!(
        pairs,
        Codec::Turbo {
            kbits: 3,
            vbits: 2,
            prep: TurboPrep {
                key_mean: true,
                key_scale: false,
                pairs: true,
            }
        }
    );
    assert_eq!(pairs.to_string(), "turbo:3:2:noscale:pairs");
    assert_eq!(KvScheme::parse(&pairs.to_string()).unwrap().default, pairs);
    assert!(KvScheme::parse("turbo:4:pairs:pairs").is_err());
    assert!(KvScheme::parse("turbo:4:nomeans").is_err());
    let err = KvScheme::parse("turbo:9:4").unwrap_err().to_string();
    assert!(err.contains("9-bit keys"), "{err}");
    assert!(KvScheme::parse("turbo:4:4:4").is_err());
    let spec = LayerSpec {
        kv_heads: 1,
        head_dim: 256,
        value_dim: 256,
        retention: Retention::Full,
    };
    let cache = KvCache::new(&[spec], &KvScheme::parse("turbo:4").unwrap(), vec![0]).unwrap();
    // 4 bits per coordinate plus one f16 norm per 256-element vector: 4.0625 bits.
    assert_eq!(cache.bytes_per_token() * 8, 2 * (256 * 4 + 16));
    assert_eq!(
        cache.signatures(),
        vec!["kv:bf16-first:turbo:4:4".to_string()]
    );
    let odd = LayerSpec {
        head_dim: 96,
        value_dim: 96,
        ..spec
    };
    let err = KvCache::new(&[spec, odd], &KvScheme::parse("turbo:4").unwrap(), vec![0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 1") && err.contains("96"), "{err}");
}

/// Pair codebooks (`:pairs`) store random vectors with less squared error than the scalar
/// codebooks at the same bits: measured through the planes' own write and read, against
/// the exact vectors (k-means on the pair density gains ~8% at 2 bits and ~13% at 3 and 4).
#[test]
fn pair_codebooks_lower_the_stored_error() {
    let (n, d) = (400, 128);
    let mut seed = 23;
    let (_, x) = random((1, 1, n, d), &mut seed);
    let t = Tensor::from_vec(x.clone(), (1, 1, n, d), &Device::Cpu).unwrap();
    for (bits, gain) in [(2u8, 0.05), (3, 0.09), (4, 0.09)] {
        let error = |pairs: bool| -> f64 {
            let prep = TurboPrep {
                pairs,
                ..TurboPrep::ALL
            };
            let planes = TurboPlanes::new(bits, bits, 1, 1, d, d).with_prep(prep);
            let stored: Vec<f32> = planes
                .as_stored(0, &t, false)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            x.iter()
                .zip(&stored)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum()
        };
        let (scalar, pairs) = (error(false), error(true));
        assert!(
            pairs <= (1.0 - gain) * scalar,
            "{bits} bits: pairs {pairs:.4} against scalar {scalar:.4}"
        );
    }
}

/// Per-channel key scales lower the error of scores `q · k` against exact scores when the
/// key channels are uneven (RMS from 0.1 to 10, as after a QK-norm's learned weights), for
/// queries of even channels; and with even channels they change little.
#[test]
fn key_scales_lower_score_error_on_uneven_channels() {
    let (n, d) = (400, 128);
    let mut seed = 11;
    let (raw, _) = random((1, 1, n, d), &mut seed);
    let (_, queries) = random((1, 1, 64, d), &mut seed);
    let score_error = |k: &Tensor, scale: bool| -> f64 {
        let mut planes = TurboPlanes::new(4, 4, 1, 1, d, d);
        let prep = TurboPrep {
            key_mean: true,
            key_scale: scale,
            pairs: false,
        };
        planes
            .fit_key_prep(k, std::slice::from_ref(&(0..n)), prep, None)
            .unwrap();
        let stored: Vec<f32> = planes
            .as_stored(0, k, true)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let exact: Vec<f32> = k.flatten_all().unwrap().to_vec1().unwrap();
        let mut err = 0f64;
        for q in queries.chunks_exact(d) {
            for (a, b) in exact.chunks_exact(d).zip(stored.chunks_exact(d)) {
                let e: f32 = q
                    .iter()
                    .zip(a.iter().zip(b))
                    .map(|(q, (a, b))| q * (a - b))
                    .sum();
                err += (e as f64).powi(2);
            }
        }
        err
    };
    let channel_rms: Vec<f32> = (0..d)
        .map(|c| 10f32.powf(2.0 * (c % 17) as f32 / 16.0 - 1.0))
        .collect();
    let uneven = raw
        .broadcast_mul(&Tensor::new(channel_rms.as_slice(), &Device::Cpu).unwrap())
        .unwrap();
    let (plain, scaled) = (score_error(&uneven, false), score_error(&uneven, true));
    assert!(
        scaled < 0.5 * plain,
        "uneven channels: scaled {scaled} vs plain {plain}"
    );
    let (plain, scaled) = (score_error(&raw, false), score_error(&raw, true));
    assert!(
        scaled < 1.1 * plain,
        "even channels: scaled {scaled} vs plain {plain}"
    );
}

/// Channels the queries weigh heavily (query RMS from 0.1 to 10, as a model's queries are)
/// get finer key codes when the fit knows the queries' mean squares: the error of scores
/// `q · k` against exact scores falls well below the scales fitted on the keys alone, for
/// even and uneven key channels alike.
#[test]
fn query_weights_lower_score_error_on_uneven_queries() {
    let (n, d) = (400, 128);
    let mut seed = 23;
    let (raw, _) = random((1, 1, n, d), &mut seed);
    let (_, even_queries) = random((1, 1, 64, d), &mut seed);
    let query_rms: Vec<f32> = (0..d)
        .map(|c| 10f32.powf(2.0 * ((c * 5) % 19) as f32 / 18.0 - 1.0))
        .collect();
    let queries: Vec<f32> = even_queries
        .chunks_exact(d)
        .flat_map(|q| q.iter().zip(&query_rms).map(|(q, r)| q * r))
        .collect();
    // The queries' own mean squares per channel, from their definition.
    let weights: Vec<f32> = (0..d)
        .map(|c| {
            queries.chunks_exact(d).map(|q| q[c] * q[c]).sum::<f32>() / (queries.len() / d) as f32
        })
        .collect();
    let score_error = |k: &Tensor, weighted: bool| -> f64 {
        let mut planes = TurboPlanes::new(3, 3, 1, 1, d, d);
        let w = weighted.then_some(weights.as_slice());
        planes
            .fit_key_prep(k, std::slice::from_ref(&(0..n)), TurboPrep::ALL, w)
            .unwrap();
        let stored: Vec<f32> = planes
            .as_stored(0, k, true)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let exact: Vec<f32> = k.flatten_all().unwrap().to_vec1().unwrap();
        let mut err = 0f64;
        for q in queries.chunks_exact(d) {
            for (a, b) in exact.chunks_exact(d).zip(stored.chunks_exact(d)) {
                let e: f64 = q
                    .iter()
                    .zip(a.iter().zip(b))
                    .map(|(q, (a, b))| *q as f64 * (*a as f64 - *b as f64))
                    .sum();
                err += e * e;
            }
        }
        err
    };
    let key_rms: Vec<f32> = (0..d)
        .map(|c| 10f32.powf(2.0 * (c % 17) as f32 / 16.0 - 1.0))
        .collect();
    let uneven = raw
        .broadcast_mul(&Tensor::new(key_rms.as_slice(), &Device::Cpu).unwrap())
        .unwrap();
    for (name, k) in [("even keys", &raw), ("uneven keys", &uneven)] {
        let (keys_only, weighted) = (score_error(k, false), score_error(k, true));
        assert!(
            weighted < 0.6 * keys_only,
            "{name}: query-weighted {weighted} vs keys only {keys_only}"
        );
    }
}

/// The layer cache weighs its TurboQuant key scales by the queries shown to it before the
/// converting append: with uneven queries, the read's attention output is nearer the exact
/// attention (f64, from the unquantized keys and values) than the same cache's without
/// them; a plain cache ignores the queries.
#[test]
fn observed_queries_lower_the_read_error() {
    let (n, d, q_heads) = (256, 64, 2);
    let spec = LayerSpec {
        kv_heads: 1,
        head_dim: d,
        value_dim: d,
        retention: Retention::Full,
    };
    let mut seed = 5;
    let (k, kf) = random((1, 1, n, d), &mut seed);
    let (v, vf) = random((1, 1, n, d), &mut seed);
    let (_, qf) = random((1, q_heads, n, d), &mut seed);
    let qf: Vec<f32> = qf
        .chunks_exact(d)
        .flat_map(|q| {
            q.iter()
                .enumerate()
                .map(|(c, x)| x * if c % 8 == 0 { 12.0 } else { 0.3 })
        })
        .collect();
    let q = Tensor::from_vec(qf.clone(), (1, q_heads, n, d), &Device::Cpu).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    // Causal attention in f64 from the definition.
    let mut exact = vec![0f64; q_heads * n * d];
    for h in 0..q_heads {
        for i in 0..n {
            let qi = &qf[(h * n + i) * d..][..d];
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    let kj = &kf[j * d..][..d];
                    qi.iter()
                        .zip(kj)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::MIN, f64::max);
            let w: Vec<f64> = s.iter().map(|s| (s - m).exp()).collect();
            let total: f64 = w.iter().sum();
            for (j, w) in w.iter().enumerate() {
                for c in 0..d {
                    exact[(h * n + i) * d + c] += w / total * vf[j * d + c] as f64;
                }
            }
        }
    }
    // The converting append is read in bf16; the second one reads the quantized keys.
    let half = n / 2;
    let error = |scheme: &str, observe: bool| -> f64 {
        let mut cache = KvCache::new(&[spec], &KvScheme::parse(scheme).unwrap(), vec![0]).unwrap();
        let layer = cache.layer_mut(0);
        let part = |t: &Tensor, lo: usize| t.narrow(2, lo, half).unwrap();
        if observe {
            layer.observe_queries(&part(&q, 0)).unwrap();
        }
        layer.append_window(&part(&k, 0), &part(&v, 0)).unwrap();
        layer.observe_queries(&part(&q, half)).unwrap();
        let out: Vec<f32> = layer
            .append_window(&part(&k, half), &part(&v, half))
            .unwrap()
            .attend(&part(&q, half), scale)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut err = 0f64;
        for h in 0..q_heads {
            for i in 0..half {
                for c in 0..d {
                    let o = out[(h * half + i) * d + c] as f64;
                    err += (o - exact[(h * n + half + i) * d + c]).powi(2);
                }
            }
        }
        err
    };
    let (blind, seen) = (error("turbo:3", false), error("turbo:3", true));
    assert!(seen < 0.8 * blind, "observed {seen} vs blind {blind}");
    assert_eq!(error("bf16", true), error("bf16", false));
    let bad = Tensor::zeros(
        (1, q_heads, 1, d + 1),
        candle_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let err = KvCache::new(&[spec], &KvScheme::parse("turbo:3").unwrap(), vec![0])
        .unwrap()
        .layer_mut(0)
        .observe_queries(&bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("65"), "{err}");
}

/// A row's key scales depend on its own queries only: in a batch of two (the second row
/// left-padded by 3, its padding queries huge), changing the first row's keys and queries
/// leaves every output bit of the second row as it was.
#[test]
fn observed_queries_stay_in_their_row() {
    let (n, d, q_heads, pad) = (64, 64, 2, 3);
    let spec = LayerSpec {
        kv_heads: 1,
        head_dim: d,
        value_dim: d,
        retention: Retention::Full,
    };
    let row_of = |seed: u64, heads: usize, scale: f32| -> Vec<f32> {
        let mut seed = seed;
        let (_, x) = random((1, heads, 2 * n, d), &mut seed);
        x.iter().map(|v| v * scale).collect()
    };
    let second_row = |first: Vec<f32>, second: Vec<f32>, heads: usize| -> Tensor {
        let mut second = second;
        // The second row's padding queries (and keys): large, and never to be counted.
        for h in 0..heads {
            for t in 0..pad {
                second[(h * 2 * n + t) * d..][..d]
                    .iter_mut()
                    .for_each(|x| *x = 50.0);
            }
        }
        let data = [first, second].concat();
        Tensor::from_vec(data, (2, heads, 2 * n, d), &Device::Cpu).unwrap()
    };
    let run = |first_seed: u64| -> Vec<f32> {
        let k = second_row(row_of(first_seed, 1, 1.0), row_of(7, 1, 1.0), 1);
        let v = second_row(row_of(first_seed + 1, 1, 1.0), row_of(8, 1, 1.0), 1);
        let q = second_row(
            row_of(first_seed + 2, q_heads, 3.0),
            row_of(9, q_heads, 3.0),
            q_heads,
        );
        let scheme = KvScheme::parse("turbo:3").unwrap();
        let mut cache = KvCache::new(&[spec], &scheme, vec![0, pad]).unwrap();
        let layer = cache.layer_mut(0);
        let part = |t: &Tensor, lo: usize| t.narrow(2, lo, n).unwrap();
        layer.observe_queries(&part(&q, 0)).unwrap();
        layer.append_window(&part(&k, 0), &part(&v, 0)).unwrap();
        let out = layer
            .append_window(&part(&k, n), &part(&v, n))
            .unwrap()
            .attend(&part(&q, n), 0.125)
            .unwrap();
        out.narrow(0, 1, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (a, b) = (run(100), run(200));
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "the second row's read changed with the first row's queries"
    );
}

/// A left-padded row's real queries read exactly what the same prompt reads unpadded, to the
/// bit, for each codec at every level. Continuous batching reads short prompts padded in one
/// forward and owes each request the tokens it gets alone. The chunk read's tiles used to
/// start at a padding query's own slot, which put the row's masked padding into the real
/// queries' matrix products and grouped them with the padding queries: on an AMD EPYC the
/// f32 matmul then summed in another order, and a greedy token flipped (tessera-engine's
/// continuous_batching tests).
#[test]
fn a_padded_rows_real_queries_read_what_its_prompt_reads_alone() {
    let (kvh, gqa, d, real, scale) = (2, 4, 256, 4, 0.0625);
    let take = |t: &Tensor, row: usize, from: usize| -> Vec<f32> {
        let t = t.narrow(0, row, 1).unwrap();
        let n = t.dim(2).unwrap();
        t.narrow(2, from, n - from)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    for name in ["bf16", "affine:4", "turbo:4"] {
        let mut scheme = KvScheme::parse(name).unwrap();
        scheme.quantized_kv_start = 0;
        let spec = LayerSpec {
            kv_heads: kvh,
            head_dim: d,
            value_dim: d,
            retention: Retention::Full,
        };
        for pad in [7, 17, 40] {
            for &isa in &Isa::supported() {
                let mut seed = 11 + pad as u64;
                let width = pad + real;
                let (k, _) = random((2, kvh, width, d), &mut seed);
                let (v, _) = random((2, kvh, width, d), &mut seed);
                let (q, _) = random((2, kvh * gqa, width, d), &mut seed);
                let mut padded = KvCache::new(&[spec], &scheme, vec![pad, 0])
                    .unwrap()
                    .with_isa(isa);
                let got = padded
                    .layer_mut(0)
                    .append_window(&k, &v)
                    .unwrap()
                    .attend(&q, scale)
                    .unwrap();
                // Row 0's prompt alone: its last `real` positions, unpadded.
                let own = |t: &Tensor| t.narrow(0, 0, 1).unwrap().narrow(2, pad, real).unwrap();
                let mut alone = KvCache::new(&[spec], &scheme, vec![0])
                    .unwrap()
                    .with_isa(isa);
                let want = alone
                    .layer_mut(0)
                    .append_window(&own(&k), &own(&v))
                    .unwrap()
                    .attend(&own(&q), scale)
                    .unwrap();
                let (got, want) = (take(&got, 0, pad), take(&want, 0, 0));
                let differ = got
                    .iter()
                    .zip(&want)
                    .filter(|(g, w)| g.to_bits() != w.to_bits())
                    .count();
                assert_eq!(
                    differ,
                    0,
                    "{name}, {isa}, pad {pad}: {differ} of {} outputs differ from the prompt read alone",
                    want.len()
                );
            }
        }
    }
}
