//! Batch-invariant reads: a position's attention output has the same bits whether it is read
//! alone (one decode step at a time), inside a chunk of any length, or in a left-padded
//! batch with other rows, for every codec, full and ring layers (before and after the ring
//! wraps, with and without round slack), GQA groups with and without a kernel instance of
//! their own, at every level this CPU runs. The one-position run is the reference; nothing
//! here is compared with a tolerance.
//!
//! Every run makes the same first append (the row's first `FIRST` positions, in one chunk),
//! so the bf16-first transition fits each row's codec on the same keys and queries.

use candle_core::{Device, Tensor};
use tessera_kv::{AttentionCache, Isa, KvCache, KvScheme, LayerSpec, Retention};

/// Positions of the first append in every run.
const FIRST: usize = 20;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// `(rows, heads, n, d)` of pseudo-random values.
fn random(shape: (usize, usize, usize, usize), seed: &mut u64) -> Tensor {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let data: Vec<f32> = (0..n).map(|_| lcg(seed)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// One row's keys, values and queries over its whole sequence.
struct Sequence {
    k: Tensor,
    v: Tensor,
    q: Tensor,
}

impl Sequence {
    fn new(spec: &LayerSpec, q_heads: usize, len: usize, seed: u64) -> Self {
        let mut seed = seed;
        Sequence {
            k: random((1, spec.kv_heads, len, spec.head_dim), &mut seed),
            v: random((1, spec.kv_heads, len, spec.value_dim), &mut seed),
            q: random((1, q_heads, len, spec.head_dim), &mut seed),
        }
    }

    fn len(&self) -> usize {
        self.k.dim(2).unwrap()
    }
}

/// Positions `at` of `t` `(rows, heads, n, d)`.
fn span(t: &Tensor, at: std::ops::Range<usize>) -> Tensor {
    t.narrow(2, at.start, at.len()).unwrap()
}

/// `rows` left-padded by `pads` (each row's sequence as long as the widest row's padding
/// plus the first row's sequence, less its own padding, so every row ends at one physical
/// width) appended together in chunks of `chunk`, the first append holding the first row's
/// first `FIRST` real positions: each row's output bits per real position.
fn run(
    spec: LayerSpec,
    scheme: &KvScheme,
    isa: Isa,
    slack: usize,
    rows: &[&Sequence],
    pads: &[usize],
    chunk: usize,
) -> Vec<Vec<Vec<u32>>> {
    let widest = pads.iter().max().copied().unwrap_or(0);
    let total = pads[0] + rows[0].len();
    let cat = |f: &dyn Fn(&Sequence) -> &Tensor| {
        let parts: Vec<Tensor> = rows
            .iter()
            .zip(pads)
            .map(|(s, &p)| {
                let t = f(s).pad_with_zeros(2, p, 0).unwrap();
                assert_eq!(t.dim(2).unwrap(), total, "rows end at one physical width");
                t
            })
            .collect();
        Tensor::cat(&parts, 0).unwrap()
    };
    let (k, v, q) = (cat(&|s| &s.k), cat(&|s| &s.v), cat(&|s| &s.q));
    let mut cache = KvCache::new(&[spec], scheme, pads.to_vec())
        .unwrap()
        .with_isa(isa)
        .with_round_slack(slack);
    let mut outs = vec![Vec::new(); rows.len()];
    let mut at = 0;
    while at < total {
        let n = if at == 0 {
            widest + FIRST
        } else {
            chunk.min(total - at)
        };
        let layer = cache.layer_mut(0);
        let qc = span(&q, at..at + n);
        layer.observe_queries(&qc).unwrap();
        let (kc, vc) = (span(&k, at..at + n), span(&v, at..at + n));
        let read = if n == 1 {
            layer.append_decode(&kc, &vc).unwrap()
        } else {
            layer.append_window(&kc, &vc).unwrap()
        };
        let out = read.attend(&qc, 0.125).unwrap(); // (rows, q_heads, n, dv)
        for (r, (o, &pad)) in outs.iter_mut().zip(pads).enumerate() {
            for i in (0..n).filter(|i| at + i >= pad) {
                let bits = out
                    .narrow(0, r, 1)
                    .unwrap()
                    .narrow(2, i, 1)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                o.push(bits.into_iter().map(f32::to_bits).collect());
            }
        }
        at += n;
    }
    outs
}

/// The first real position of `got` that differs from `want`, and how many elements of
/// it differ.
fn first_difference(got: &[Vec<u32>], want: &[Vec<u32>]) -> Option<(usize, usize)> {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).enumerate().find_map(|(p, (g, w))| {
        let n = g.iter().zip(w).filter(|(a, b)| a != b).count();
        (n > 0).then_some((p, n))
    })
}

fn check(scheme_name: &str, retention: Retention, slack: usize, group: usize, d: usize) {
    let mut scheme = KvScheme::parse(scheme_name).unwrap();
    scheme.quantized_kv_start = 0;
    let spec = LayerSpec {
        kv_heads: 2,
        head_dim: d,
        value_dim: d,
        retention,
    };
    // Three pieces of a full layer, and a 300-position window that wraps its ring.
    let len = 600;
    let seq = Sequence::new(&spec, 2 * group, len, 7);
    let other = Sequence::new(&spec, 2 * group, len + 13, 8);
    for isa in Isa::supported() {
        let what =
            format!("{scheme_name}, {retention:?}, slack {slack}, group {group}, d {d}, {isa}");
        let alone = run(spec, &scheme, isa, slack, &[&seq], &[0], 1);
        // (Chunks of 64: in the batch below.)
        for chunk in [7, 300] {
            let got = run(spec, &scheme, isa, slack, &[&seq], &[0], chunk);
            if let Some((p, n)) = first_difference(&got[0], &alone[0]) {
                panic!("{what}: chunks of {chunk}: position {p} differs from the one-position run in {n} elements");
            }
        }
        // Beside another row, padded by 13 (this row) and 0: chunks, then decode steps.
        for chunk in [1, 64] {
            let got = run(spec, &scheme, isa, slack, &[&seq, &other], &[13, 0], chunk);
            if let Some((p, n)) = first_difference(&got[0], &alone[0]) {
                panic!("{what}: padded batch, chunks of {chunk}: position {p} differs from the one-position run in {n} elements");
            }
        }
    }
}

#[test]
fn plain_reads_are_batch_invariant() {
    for scheme in ["bf16", "f16", "f32"] {
        check(scheme, Retention::Full, 0, 4, 64);
        check(scheme, Retention::Window { size: 300 }, 0, 4, 64);
    }
    // A group without its own kernel instance, and a width the 512-bit kernels skip.
    check("bf16", Retention::Window { size: 300 }, 3, 3, 48);
}

#[test]
fn affine_reads_are_batch_invariant() {
    for scheme in ["affine:4", "affine:3", "affine:8"] {
        check(scheme, Retention::Full, 0, 4, 64);
        check(scheme, Retention::Window { size: 300 }, 2, 4, 64);
    }
    check("affine:4:32", Retention::Full, 0, 3, 96);
}

#[test]
fn turbo_reads_are_batch_invariant() {
    for scheme in ["turbo:4", "turbo:3:2", "turbo:4:pairs"] {
        check(scheme, Retention::Full, 0, 4, 64);
        check(scheme, Retention::Window { size: 300 }, 2, 4, 64);
    }
}
