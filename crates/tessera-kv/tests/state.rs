//! Cache state: `state()` → `KvCache::from_state` → `state()` is the identity, bit for bit,
//! for every codec, retention and row layout after appends, a merge, a filter and a round
//! rolled back; the restored cache then reads exactly as the original (same output bits).
//! Bad states are typed errors naming the problem, never panics.

use candle_core::{Device, Tensor};
use tessera_kv::{
    AttentionCache, CacheState, Codec, KvCache, KvError, KvScheme, LayerSpec, PlainDType,
    Retention, TurboPrep, STATE_VERSION,
};

const D: usize = 128;
const KVH: usize = 2;
const QH: usize = 4;
const WINDOW: usize = 8;
const SLACK: usize = 3;

/// A named edit of a state.
type Edit = (&'static str, Box<dyn Fn(&mut CacheState)>);

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn random(shape: (usize, usize, usize, usize), seed: &mut u64) -> Tensor {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let data: Vec<f32> = (0..n).map(|_| lcg(seed)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn codecs() -> Vec<Codec> {
    vec![
        Codec::Plain(PlainDType::Bf16),
        Codec::Plain(PlainDType::F16),
        Codec::Plain(PlainDType::F32),
        Codec::Affine { bits: 2, group: 32 },
        Codec::Affine { bits: 4, group: 64 },
        Codec::Affine {
            bits: 8,
            group: 128,
        },
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
        Codec::Turbo {
            kbits: 3,
            vbits: 2,
            prep: TurboPrep {
                pairs: true,
                ..TurboPrep::ALL
            },
        },
    ]
}

fn spec(window: Option<usize>) -> LayerSpec {
    LayerSpec {
        kv_heads: KVH,
        head_dim: D,
        value_dim: D,
        retention: window.map_or(Retention::Full, |size| Retention::Window { size }),
    }
}

fn new_cache(codec: Codec, window: Option<usize>, start: usize, pads: Vec<usize>) -> KvCache {
    let mut scheme = KvScheme::uniform(codec);
    scheme.quantized_kv_start = start;
    KvCache::new(&[spec(window)], &scheme, pads)
        .unwrap()
        .with_round_slack(SLACK)
}

fn append(cache: &mut KvCache, n: usize, seed: &mut u64) {
    let b = cache.batch();
    let (k, v) = (random((b, KVH, n, D), seed), random((b, KVH, n, D), seed));
    cache.layer_mut(0).append_window(&k, &v).unwrap();
}

/// A decode step and then a chunk of 4 on `cache`, returning both reads' output bits.
fn reads(cache: &mut KvCache, seed: u64) -> Vec<Vec<u32>> {
    let mut seed = seed;
    let b = cache.batch();
    let mut out = Vec::new();
    for n in [1, 4] {
        let (k, v) = (
            random((b, KVH, n, D), &mut seed),
            random((b, KVH, n, D), &mut seed),
        );
        let q = random((b, QH, n, D), &mut seed);
        let layer = cache.layer_mut(0);
        layer.observe_queries(&q).unwrap();
        let read = if n == 1 {
            layer.append_decode(&k, &v).unwrap()
        } else {
            layer.append_window(&k, &v).unwrap()
        };
        out.push(bits(&read.attend(&q, 0.125).unwrap()));
    }
    out
}

fn restore(state: &CacheState) -> KvCache {
    KvCache::from_state(state, &Device::Cpu).unwrap()
}

/// Round-trips `cache` through its state and checks both go on reading the same bits.
fn check_round_trip(mut cache: KvCache, ctx: &str) {
    let state = cache.state().unwrap();
    let mut restored = restore(&state);
    let again = restored.state().unwrap();
    assert!(again == state, "{ctx}: state → from_state → state differs");
    assert_eq!(restored.ends(), cache.ends(), "{ctx}");
    assert_eq!(restored.offsets(), cache.offsets(), "{ctx}");
    assert_eq!(restored.left_pad(), cache.left_pad(), "{ctx}");
    assert_eq!(restored.signatures(), cache.signatures(), "{ctx}");
    assert_eq!(restored.bytes_per_token(), cache.bytes_per_token(), "{ctx}");
    let (a, b) = (reads(&mut cache, 99), reads(&mut restored, 99));
    assert!(a == b, "{ctx}: the restored cache reads other bits");
    assert!(
        cache.state().unwrap() == restored.state().unwrap(),
        "{ctx}: the caches diverge after the same appends"
    );
}

/// Appends (a left-padded prefill, decodes), a merge with a second cache, a filter, a
/// ring past its wrap, a round rolled back to different ends per row.
fn scenario(codec: Codec, window: Option<usize>, pads: &[usize], start: usize) -> KvCache {
    let mut seed = 17 + pads.len() as u64;
    let mut a = new_cache(codec, window, start, pads.to_vec());
    append(&mut a, 6, &mut seed);
    append(&mut a, 1, &mut seed);
    append(&mut a, 1, &mut seed);
    let mut b = new_cache(codec, window, start, vec![1]);
    append(&mut b, 5, &mut seed);
    let mut cache = KvCache::merge(vec![a, b]).unwrap();
    assert_eq!(cache.batch(), pads.len() + 1);
    let keep: Vec<usize> = if pads.len() == 1 {
        vec![1]
    } else {
        vec![3, 0, 2]
    };
    cache.filter(&keep).unwrap();
    append(&mut cache, 9, &mut seed);
    cache.round_begin().unwrap();
    append(&mut cache, 3, &mut seed);
    let keep = [1, 0, 2];
    cache.round_rollback(&keep[..cache.batch()]).unwrap();
    cache
}

#[test]
fn every_codec_round_trips_bit_for_bit() {
    for codec in codecs() {
        for window in [None, Some(WINDOW)] {
            for pads in [vec![0], vec![0, 2, 4]] {
                let ctx = format!("{codec} {window:?} pads {pads:?}");
                let cache = scenario(codec, window, &pads, 0);
                assert_eq!(cache.layers()[0].planes().codec(), codec, "{ctx}");
                if window.is_some() {
                    let held = cache.layers()[0].rows().held_from().to_vec();
                    let pads = cache.left_pad().to_vec();
                    assert!(
                        held.iter().zip(&pads).all(|(h, p)| h > p),
                        "{ctx}: ring wrapped"
                    );
                }
                if pads.len() > 1 {
                    let ends = cache.ends();
                    assert!(
                        ends.iter().any(|&e| e != ends[0]),
                        "{ctx}: ends differ per row"
                    );
                }
                check_round_trip(cache, &ctx);
            }
        }
    }
}

/// A state taken inside an open round carries the round: the restored cache rolls back as
/// the original does.
#[test]
fn an_open_round_round_trips() {
    for codec in [
        Codec::Plain(PlainDType::Bf16),
        Codec::Affine { bits: 4, group: 64 },
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
    ] {
        for window in [None, Some(WINDOW)] {
            let ctx = format!("{codec} {window:?}");
            let mut cache = scenario(codec, window, &[0, 2, 4], 0);
            cache.round_begin().unwrap();
            let mut seed = 5;
            append(&mut cache, 4, &mut seed);
            let state = cache.state().unwrap();
            assert!(state.layers[0].round.is_some(), "{ctx}");
            let mut restored = restore(&state);
            cache.round_rollback(&[2, 4, 0]).unwrap();
            restored.round_rollback(&[2, 4, 0]).unwrap();
            assert_eq!(restored.ends(), cache.ends(), "{ctx}");
            check_round_trip(cache, &ctx);
            check_round_trip(restored, &ctx);
        }
    }
}

/// A state of a still-bf16 quantized cache round-trips, and the restored cache converts
/// at the same append, to the same codes (and turbo key preparations), as the original.
#[test]
fn a_bf16_stage_state_converts_as_the_original() {
    for codec in codecs().into_iter().filter(|c| c.is_quantized()) {
        for window in [None, Some(WINDOW)] {
            let ctx = format!("{codec} {window:?}");
            let mut cache = new_cache(codec, window, 12, vec![0, 3]);
            let mut seed = 3;
            let q = random((2, QH, 7, D), &mut seed);
            cache.layer_mut(0).observe_queries(&q).unwrap();
            append(&mut cache, 7, &mut seed);
            assert!(cache.layers()[0].awaiting_conversion(), "{ctx}");
            // A turbo layer keeps the queries it saw for its conversion; the state holds them.
            let weighs = matches!(codec, Codec::Turbo { prep, .. } if prep.key_scale);
            assert_eq!(
                cache.state().unwrap().layers[0].queries.is_empty(),
                !weighs,
                "{ctx}"
            );
            assert_eq!(cache.max_append_tokens(), Some(5), "{ctx}");
            let state = cache.state().unwrap();
            assert_eq!(
                state.layers[0].planes.codec,
                Codec::Plain(PlainDType::Bf16),
                "{ctx}"
            );
            let mut restored = restore(&state);
            assert!(restored.state().unwrap() == state, "{ctx}");
            assert!(restored.layers()[0].awaiting_conversion(), "{ctx}");
            assert_eq!(restored.max_append_tokens(), Some(5), "{ctx}");
            // The chunk of 4 converts both (7 + 1 + 4 = 12).
            let (a, b) = (reads(&mut cache, 8), reads(&mut restored, 8));
            assert!(a == b, "{ctx}: the converting reads differ");
            for c in [&cache, &restored] {
                assert!(!c.layers()[0].awaiting_conversion(), "{ctx}");
                assert_eq!(c.layers()[0].planes().codec(), codec, "{ctx}");
                assert_eq!(c.minimum_reusable_offset(), Some(12), "{ctx}");
            }
            assert!(cache.state().unwrap() == restored.state().unwrap(), "{ctx}");
            check_round_trip(restored, &ctx);
        }
    }
}

/// A valid state to break: 3 rows, after the scenario.
fn valid(codec: Codec, window: Option<usize>) -> CacheState {
    scenario(codec, window, &[0, 2, 4], 0).state().unwrap()
}

/// `from_state` must refuse `state` with a [`KvError::BadState`] whose message contains
/// every one of `needles`.
fn refused(state: &CacheState, needles: &[&str], ctx: &str) {
    match KvCache::from_state(state, &Device::Cpu) {
        Ok(_) => panic!("{ctx}: a bad state was accepted"),
        Err(KvError::BadState(message)) => {
            for needle in needles {
                assert!(
                    message.contains(needle),
                    "{ctx}: `{message}` does not name `{needle}`"
                );
            }
        }
        Err(other) => panic!("{ctx}: {other:?} is not BadState"),
    }
}

#[test]
fn wrong_version_is_refused() {
    let mut state = valid(Codec::Plain(PlainDType::Bf16), None);
    for version in [0, STATE_VERSION + 1, u32::MAX] {
        state.version = version;
        refused(&state, &["version", &version.to_string()], "version");
    }
}

/// Version 1 differs from version 2 only in the turbo codebooks: its other states are read,
/// turbo ones (planes or conversion target) are refused by name.
#[test]
fn version_1_is_read_unless_it_holds_turbo_codes() {
    let turbo = |kbits, vbits| Codec::Turbo {
        kbits,
        vbits,
        prep: TurboPrep::ALL,
    };
    for codec in [
        Codec::Plain(PlainDType::Bf16),
        Codec::Affine { bits: 4, group: 64 },
    ] {
        let mut state = valid(codec, None);
        state.version = 1;
        assert!(KvCache::from_state(&state, &Device::Cpu).is_ok(), "{codec}");
    }
    for codec in [turbo(4, 3), turbo(8, 8)] {
        let mut state = valid(codec, None);
        state.version = 1;
        refused(&state, &["version 1", "turbo"], &codec.to_string());
    }
}

#[test]
fn truncated_and_wrongly_sized_buffers_are_refused() {
    for codec in codecs() {
        for window in [None, Some(WINDOW)] {
            let good = valid(codec, window);
            let buffers = good.layers[0].planes.buffers.len();
            let mut tried = 0;
            for i in 0..buffers {
                let ctx = format!("{codec} {window:?} buffer {i}");
                if good.layers[0].planes.buffers[i].is_empty() {
                    // An empty table (turbo without mean or scales): one element too many.
                    let mut state = good.clone();
                    state.layers[0].planes.buffers[i] = vec![0; 4];
                    refused(&state, &[], &ctx);
                    continue;
                }
                tried += 1;
                // Truncated by one byte.
                let mut state = good.clone();
                state.layers[0].planes.buffers[i].pop();
                refused(&state, &[], &format!("{ctx} truncated"));
                // Whole elements too few and too many.
                let mut state = good.clone();
                let len = state.layers[0].planes.buffers[i].len();
                state.layers[0].planes.buffers[i].truncate(len - 8);
                refused(&state, &[], &format!("{ctx} 8 bytes short"));
                let mut state = good.clone();
                state.layers[0].planes.buffers[i].extend([0; 8]);
                refused(&state, &[], &format!("{ctx} 8 bytes long"));
                let mut state = good.clone();
                state.layers[0].planes.buffers[i].clear();
                refused(&state, &[], &format!("{ctx} empty"));
            }
            assert!(tried >= 2, "{codec}: keys and values at least");
            // A buffer missing, or one too many.
            let mut state = good.clone();
            state.layers[0].planes.buffers.pop();
            if matches!(codec, Codec::Affine { .. }) {
                // Without its last buffer, the key means, an affine state is one written
                // before keys were centred: it restores with zero means.
                let restored = KvCache::from_state(&state, &Device::Cpu).unwrap();
                let again = restored.state().unwrap();
                let means = &again.layers[0].planes.buffers[4];
                assert!(
                    !means.is_empty() && means.iter().all(|&b| b == 0),
                    "{codec}: a four-buffer state restores zero means"
                );
                state.layers[0].planes.buffers.pop();
            }
            refused(&state, &["buffers"], &format!("{codec} a buffer short"));
            let mut state = good.clone();
            state.layers[0].planes.buffers.push(Vec::new());
            refused(&state, &["buffers"], &format!("{codec} a buffer extra"));
        }
    }
}

#[test]
fn geometry_mismatches_are_refused() {
    for codec in [
        Codec::Plain(PlainDType::F32),
        Codec::Affine { bits: 4, group: 64 },
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
    ] {
        let good = valid(codec, None);
        let ctx = |what: &str| format!("{codec}: {what}");
        let mut s = good.clone();
        s.layers[0].spec.kv_heads = KVH + 1;
        refused(&s, &["layer 0", "disagree"], &ctx("spec kv_heads"));
        let mut s = good.clone();
        s.layers[0].spec.head_dim = D / 2;
        refused(&s, &["layer 0"], &ctx("spec head_dim"));
        let mut s = good.clone();
        s.layers[0].planes.geometry.value_dim = D / 2;
        refused(&s, &["layer 0"], &ctx("planes value_dim"));
        let mut s = good.clone();
        s.layers[0].planes.geometry.rows = 2;
        refused(&s, &["layer 0", "rows"], &ctx("planes rows"));
        // Planes of another codec than the buffers were written in.
        let other = match codec {
            Codec::Plain(_) => Codec::Affine { bits: 4, group: 64 },
            Codec::Affine { .. } => Codec::Affine { bits: 8, group: 64 },
            Codec::Turbo { .. } => Codec::Turbo {
                kbits: 2,
                vbits: 2,
                prep: TurboPrep::ALL,
            },
        };
        let mut s = good.clone();
        s.layers[0].planes.codec = other;
        refused(&s, &[], &ctx("planes codec"));
        // Ends longer than the rows, and held_from / round of the wrong length.
        let mut s = good.clone();
        s.layers[0].ends.push(3);
        refused(&s, &["layer 0", "rows"], &ctx("ends longer than rows"));
        let mut s = good.clone();
        s.layers[0].ends.pop();
        refused(&s, &["layer 0"], &ctx("ends shorter than rows"));
        let mut s = good.clone();
        s.layers[0].held_from.push(0);
        refused(&s, &["layer 0"], &ctx("held_from longer than rows"));
        let mut s = good.clone();
        s.layers[0].round = Some(vec![1]);
        refused(&s, &["layer 0"], &ctx("round of one row"));
        // Capacity too small for the ends.
        let mut s = good.clone();
        let capacity = s.layers[0].planes.capacity;
        s.layers[0].ends[1] = capacity + 1;
        refused(
            &s,
            &["layer 0", &capacity.to_string()],
            &ctx("ends past capacity"),
        );
    }
}

/// A state whose layer says it is a plain layer (no target) or converts to one codec, while
/// its planes hold another quantized codec, describes no cache this crate builds.
#[test]
fn target_and_planes_codec_mismatch_is_refused() {
    let affine = Codec::Affine { bits: 4, group: 64 };
    let turbo = Codec::Turbo {
        kbits: 4,
        vbits: 4,
        prep: TurboPrep::ALL,
    };
    // Turbo planes in a layer whose target is affine.
    let mut s = valid(turbo, None);
    assert_eq!(s.layers[0].target, Some(turbo));
    s.layers[0].target = Some(affine);
    refused(&s, &["layer 0"], "turbo planes, affine target");
    // Quantized planes in a layer with no target (a plain layer).
    let mut s = valid(affine, None);
    s.layers[0].target = None;
    refused(&s, &["layer 0"], "affine planes, no target");
    // A quantized target whose planes are f32 (the bf16 stage is always bf16).
    let mut s = valid(Codec::Plain(PlainDType::F32), None);
    s.layers[0].target = Some(affine);
    refused(&s, &["layer 0"], "f32 planes, affine target");
}

/// Planes whose capacity times rows and heads overflows must not pass the length checks
/// (the lengths wrap to 0 in release, and the next append writes out of bounds).
#[test]
fn overflowing_capacity_is_refused() {
    for codec in [
        Codec::Plain(PlainDType::Bf16),
        Codec::Affine { bits: 4, group: 64 },
    ] {
        let mut s = new_cache(codec, None, 0, vec![0]).state().unwrap();
        // rows 1 × heads 2 × 2^63 wraps to 0 elements: the empty buffers "fit".
        s.layers[0].planes.capacity = 1 << 63;
        let result = std::panic::catch_unwind(|| {
            let mut cache = KvCache::from_state(&s, &Device::Cpu)?;
            let mut seed = 1;
            let (k, v) = (
                random((1, KVH, 2, D), &mut seed),
                random((1, KVH, 2, D), &mut seed),
            );
            cache.layer_mut(0).append_window(&k, &v).map(|_| ())
        });
        match result {
            Ok(Err(KvError::BadState(_))) => {}
            Ok(other) => panic!("{codec}: {other:?}"),
            Err(_) => panic!("{codec}: a bad state panicked"),
        }
    }
}

/// Hostile row bookkeeping (ends before the padding, held_from past the ends, a round past
/// the ends): restoring and using the cache gives typed errors or works, never panics.
#[test]
fn hostile_row_fields_never_panic() {
    for codec in [
        Codec::Plain(PlainDType::Bf16),
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
    ] {
        for window in [None, Some(WINDOW)] {
            let good = valid(codec, window);
            let edits: Vec<Edit> = vec![
                ("ends before pad", Box::new(|s| s.layers[0].ends[2] = 1)),
                (
                    "held past ends",
                    Box::new(|s| s.layers[0].held_from[0] = 500),
                ),
                ("pad past ends", Box::new(|s| s.layers[0].left_pad[1] = 400)),
                (
                    "round past ends",
                    Box::new(|s| s.layers[0].round = Some(vec![300, 0, 0])),
                ),
                ("cache pad rows", Box::new(|s| s.left_pad = vec![0])),
                ("prefill rows", Box::new(|s| s.prefill = Some(vec![1]))),
            ];
            for (what, edit) in edits {
                let mut s = good.clone();
                edit(&mut s);
                let ctx = format!("{codec} {window:?} {what}");
                let outcome = std::panic::catch_unwind(|| {
                    let Ok(mut cache) = KvCache::from_state(&s, &Device::Cpu) else {
                        return;
                    };
                    let _ = cache.capture_donor_rows();
                    let _ = cache.round_rollback(&[0, 0, 0]);
                    let _ = cache.trim(1);
                    let mut seed = 2;
                    let (k, v) = (
                        random((3, KVH, 1, D), &mut seed),
                        random((3, KVH, 1, D), &mut seed),
                    );
                    if let Ok(read) = cache.layer_mut(0).append_decode(&k, &v) {
                        let q = random((3, QH, 1, D), &mut seed);
                        let _ = read.attend(&q, 0.125);
                    }
                    let _ = cache.finalize_prefill();
                    let _ = cache.extract(0);
                });
                assert!(outcome.is_ok(), "{ctx}: a bad state panicked");
            }
        }
    }
}

/// Codecs the planes do not implement, and layer shapes no cache has, are typed errors when
/// a state names them (a scheme's parser would have refused them; a file may not have come
/// from one).
#[test]
fn unsupported_codecs_and_shapes_in_a_state_are_refused() {
    let affine = Codec::Affine { bits: 4, group: 32 };
    let good = valid(affine, Some(WINDOW));
    for (bits, group) in [(7, 32), (4, 48), (1, 64)] {
        let mut state = good.clone();
        let bad = Codec::Affine { bits, group };
        state.layers[0].planes.codec = bad;
        state.layers[0].target = Some(bad);
        match KvCache::from_state(&state, &Device::Cpu) {
            Err(KvError::UnsupportedAffine { .. }) => {}
            other => panic!("affine {bits}:{group} in a state: {other:?}"),
        }
    }
    let turbo = valid(
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
        None,
    );
    let mut state = turbo.clone();
    let bad = Codec::Turbo {
        kbits: 9,
        vbits: 4,
        prep: TurboPrep::ALL,
    };
    state.layers[0].planes.codec = bad;
    state.layers[0].target = Some(bad);
    assert!(matches!(
        KvCache::from_state(&state, &Device::Cpu),
        Err(KvError::UnsupportedTurbo { .. })
    ));
    let mut state = good.clone();
    state.layers[0].spec.retention = Retention::Window { size: 0 };
    refused(&state, &["layer 0"], "a window of 0");
    let mut state = good;
    state.layers[0].spec.kv_heads = 0;
    refused(&state, &["layer 0"], "no KV heads");
}

#[test]
fn bad_query_moments_are_refused() {
    let codec = Codec::Turbo {
        kbits: 4,
        vbits: 4,
        prep: TurboPrep::ALL,
    };
    let mut cache = new_cache(codec, None, 12, vec![0]);
    let mut seed = 9;
    let q = random((1, QH, 3, D), &mut seed);
    cache.layer_mut(0).observe_queries(&q).unwrap();
    append(&mut cache, 3, &mut seed);
    let state = cache.state().unwrap();
    let good = serde_json::to_value(&state.layers[0].queries).unwrap();
    let sums = good["sums"].as_array().unwrap().len();
    assert_eq!(sums, KVH * D);
    let edits: [(&str, serde_json::Value); 3] = [
        (
            "negative",
            serde_json::json!({"sums": vec![-1.0; sums], "counts": [3], "kv_heads": KVH, "q_heads": QH}),
        ),
        (
            "sums",
            serde_json::json!({"sums": vec![1.0; sums - 1], "counts": [3], "kv_heads": KVH, "q_heads": QH}),
        ),
        (
            "query",
            serde_json::json!({"sums": vec![1.0; sums], "counts": [3], "kv_heads": KVH, "q_heads": QH + 1}),
        ),
    ];
    for (name, edit) in edits {
        let mut bad = state.clone();
        bad.layers[0].queries = serde_json::from_value(edit).unwrap();
        refused(&bad, &["layer 0", "query moments"], name);
    }
}
