//! The sampler against distributions written from the definitions.

use super::*;

#[test]
fn greedy_picks_argmax_and_penalty_changes_it() {
    let logits = [0.1, 2.0, 1.9, -1.0];
    assert_eq!(
        Sampler::new(SamplerConfig::default()).sample(&logits, &[]),
        1
    );
    let cfg = SamplerConfig {
        repetition_penalty: 1.5,
        ..Default::default()
    };
    assert_eq!(Sampler::new(cfg).sample(&logits, &[1]), 2);
}

#[test]
fn top_k_one_is_greedy_and_seeds_reproduce() {
    let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 17) as f32 * 0.3).collect();
    let cfg = SamplerConfig {
        temperature: 1.0,
        top_k: Some(1),
        ..Default::default()
    };
    assert_eq!(Sampler::new(cfg).sample(&logits, &[]), argmax(&logits));
    let cfg = SamplerConfig {
        temperature: 1.0,
        seed: 7,
        ..Default::default()
    };
    let a: Vec<u32> = {
        let mut s = Sampler::new(cfg.clone());
        (0..20).map(|_| s.sample(&logits, &[])).collect()
    };
    let b: Vec<u32> = {
        let mut s = Sampler::new(cfg);
        (0..20).map(|_| s.sample(&logits, &[])).collect()
    };
    assert_eq!(a, b);
    assert!(
        a.iter().any(|&t| t != a[0]),
        "temperature 1 should not always pick one token"
    );
}

#[test]
fn presence_and_frequency_penalties_count_earlier_picks() {
    // Greedy over fixed logits: without penalties token 0 forever; a frequency penalty
    // of 0.6 against a lead of 1.0 makes the sampler alternate once token 0 was picked
    // twice (2 × 0.6 > 1.0), a presence penalty of 1.5 after one pick.
    let logits = [3.0, 2.0, -1.0];
    let run = |cfg: SamplerConfig| {
        let mut s = Sampler::new(cfg);
        (0..6).map(|_| s.sample(&logits, &[])).collect::<Vec<u32>>()
    };
    assert_eq!(run(SamplerConfig::default()), vec![0; 6]);
    let freq = SamplerConfig {
        frequency_penalty: 0.6,
        ..Default::default()
    };
    assert_eq!(run(freq), vec![0, 0, 1, 0, 1, 0]);
    let presence = SamplerConfig {
        presence_penalty: 1.5,
        ..Default::default()
    };
    assert_eq!(run(presence), vec![0, 1, 0, 0, 0, 0]);
}

#[test]
fn validation_names_the_setting() {
    let ok = SamplerConfig::default();
    assert!(ok.validate().is_ok());
    let cases = [
        (
            SamplerConfig {
                temperature: -1.0,
                ..ok.clone()
            },
            "temperature",
        ),
        (
            SamplerConfig {
                temperature: f32::NAN,
                ..ok.clone()
            },
            "temperature",
        ),
        (
            SamplerConfig {
                top_p: Some(0.0),
                ..ok.clone()
            },
            "top_p",
        ),
        (
            SamplerConfig {
                min_p: Some(1.5),
                ..ok.clone()
            },
            "min_p",
        ),
        (
            SamplerConfig {
                top_k: Some(0),
                ..ok.clone()
            },
            "top_k",
        ),
        (
            SamplerConfig {
                repetition_penalty: 0.0,
                ..ok.clone()
            },
            "repetition_penalty",
        ),
        (
            SamplerConfig {
                presence_penalty: 2.5,
                ..ok.clone()
            },
            "presence_penalty",
        ),
        (
            SamplerConfig {
                frequency_penalty: -3.0,
                ..ok.clone()
            },
            "frequency_penalty",
        ),
    ];
    for (cfg, name) in cases {
        let err = cfg.validate().expect_err(name).to_string();
        assert!(err.contains(name), "{err}");
    }
}

#[test]
fn min_p_and_top_p_cut_the_tail() {
    let logits = [10.0, 9.9, 0.0, -5.0];
    let cfg = SamplerConfig {
        temperature: 1.0,
        min_p: Some(0.5),
        seed: 3,
        ..Default::default()
    };
    let mut s = Sampler::new(cfg);
    for _ in 0..50 {
        assert!(s.sample(&logits, &[]) < 2);
    }
    let cfg = SamplerConfig {
        temperature: 1.0,
        top_p: Some(0.4),
        seed: 3,
        ..Default::default()
    };
    let mut s = Sampler::new(cfg);
    for _ in 0..50 {
        assert_eq!(s.sample(&logits, &[]), 0);
    }
}
/// The filters from their definitions, in f64 over every id sorted best first (ties by
/// id): top_k's best, then softmax at the temperature, then min_p against the best's
/// probability, then top_p's shortest prefix reaching it; renormalized.
fn reference(logits: &[f32], c: &SamplerConfig) -> Vec<(u32, f64)> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    ids.truncate(c.top_k.unwrap_or(ids.len()));
    let max = logits[ids[0] as usize] as f64;
    let w: Vec<f64> = ids
        .iter()
        .map(|&i| ((logits[i as usize] as f64 - max) / c.temperature as f64).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let p: Vec<f64> = w.iter().map(|w| w / total).collect();
    let mut keep = p
        .iter()
        .take_while(|&&q| q >= p[0] * c.min_p.unwrap_or(0.0) as f64)
        .count();
    if let Some(top_p) = c.top_p {
        let mut acc = 0.0;
        if let Some(end) = p[..keep].iter().position(|q| {
            acc += q;
            acc >= top_p as f64
        }) {
            keep = end + 1;
        }
    }
    let kept: f64 = p[..keep].iter().sum();
    ids[..keep]
        .iter()
        .zip(&p)
        .map(|(&i, q)| (i, q / kept))
        .collect()
}

#[test]
fn filters_match_their_definition() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32
    };
    for vocab in [50usize, 3001, 40_000] {
        // Logits spread as a model's are: most far below the best few.
        let logits: Vec<f32> = (0..vocab).map(|_| next() * 20.0 - 12.0 * next()).collect();
        for temperature in [0.3f32, 1.0, 1.7] {
            for top_k in [None, Some(1), Some(7), Some(300)] {
                for top_p in [None, Some(0.1f32), Some(0.5), Some(0.9), Some(0.999)] {
                    for min_p in [None, Some(0.01f32), Some(0.2)] {
                        let c = SamplerConfig {
                            temperature,
                            top_k,
                            top_p,
                            min_p,
                            ..Default::default()
                        };
                        let mut got: Vec<(u32, f32)> = {
                            let d = Sampler::new(c.clone()).distribution(&logits, &[], &[]);
                            d.ids.into_iter().zip(d.probs).collect()
                        };
                        got.sort_by_key(|&(i, _)| i);
                        let mut want = reference(&logits, &c);
                        want.sort_by_key(|&(i, _)| i);
                        // top_p's last candidate may differ where f32 and f64 sums
                        // straddle the target; the distributions may not.
                        if top_p.is_none() {
                            let got_ids: Vec<u32> = got.iter().map(|g| g.0).collect();
                            let want_ids: Vec<u32> = want.iter().map(|w| w.0).collect();
                            assert_eq!(got_ids, want_ids, "vocab {vocab}, {c:?}");
                        }
                        let mut tv = 0.0;
                        let (mut g, mut w) = (got.iter().peekable(), want.iter().peekable());
                        loop {
                            match (g.peek(), w.peek()) {
                                (Some(a), Some(b)) if a.0 == b.0 => {
                                    tv += (a.1 as f64 - b.1).abs();
                                    g.next();
                                    w.next();
                                }
                                (Some(a), b) if b.is_none_or(|b| a.0 < b.0) => {
                                    tv += a.1 as f64;
                                    g.next();
                                }
                                (_, Some(b)) => {
                                    tv += b.1;
                                    w.next();
                                }
                                (_, None) => break,
                            }
                        }
                        assert!(
                            tv / 2.0 < 1e-3,
                            "total variation {tv}, vocab {vocab}, {c:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn argmax_rows_matches_the_plain_argmax_with_ties_across_chunks() {
    // Vocabularies with many, few and no divisors up to 256; ties planted inside one
    // chunk and across chunks, and a row whose maximum is its last id.
    for vocab in [1000usize, 1187, 997, 262] {
        let mut rows = Vec::new();
        for r in 0..5 {
            let mut l: Vec<f32> = (0..vocab)
                .map(|i| (((i * 7919 + r * 104729) % 1009) as f32) * 0.01 - 5.0)
                .collect();
            match r {
                1 => {
                    l[vocab / 3] = 50.0;
                    l[vocab / 3 + 1] = 50.0;
                }
                2 => {
                    l[vocab - 2] = 60.0;
                    l[7] = 60.0;
                }
                3 => l[vocab - 1] = 70.0,
                _ => {}
            }
            rows.push(l);
        }
        let flat: Vec<f32> = rows.concat();
        let t = Tensor::from_vec(flat, (5, vocab), &candle_core::Device::Cpu).unwrap();
        let want: Vec<u32> = rows.iter().map(|l| first_greatest(l)).collect();
        assert_eq!(argmax_rows(&t).unwrap(), want, "vocab {vocab}");
        assert_eq!(
            argmax_rows_by_chunks(&t, 5, vocab).unwrap(),
            want,
            "vocab {vocab}, by chunks"
        );
        // A view that is not contiguous takes the chunked path.
        let wide = Tensor::cat(&[&t, &t], 1)
            .unwrap()
            .narrow(1, vocab, vocab)
            .unwrap();
        assert_eq!(argmax_rows(&wide).unwrap(), want, "vocab {vocab}, a view");
    }
}

/// The definition: a scan that moves only to a strictly greater value.
fn first_greatest(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn argmax_is_the_first_strictly_greatest_value() {
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    let cases: Vec<Vec<f32>> = vec![
        vec![],
        vec![nan, 5.0, 7.0],
        vec![1.0, nan, 7.0, nan],
        vec![-0.0, 0.0],
        vec![-1.0, 0.0, -0.0, 0.0],
        vec![f32::NEG_INFINITY; 40],
        vec![-inf, nan, nan, -inf],
        vec![3.0, inf, 2.0, inf],
    ];
    for c in &cases {
        assert_eq!(argmax(c), first_greatest(c), "{c:?}");
    }
    // Lengths around the 16 lanes, the maximum in the lanes, the rest and at ties.
    for len in [1usize, 15, 16, 17, 31, 33, 100, 1003] {
        for at in [0, len / 2, len - 1] {
            let mut v: Vec<f32> = (0..len)
                .map(|i| ((i * 7919) % 101) as f32 * 0.5 - 20.0)
                .collect();
            v[at] = 99.0;
            assert_eq!(argmax(&v), first_greatest(&v), "len {len}, max at {at}");
            v[len - 1] = 99.0;
            v[len / 3] = 99.0;
            assert_eq!(argmax(&v), first_greatest(&v), "len {len}, ties");
        }
    }
}
