//! Row operations against one decode step, on one full-attention layer stored as affine:4
//! (group 64, `quantized_kv_start` 0): 16 one-row caches of DEPTH positions each (appended in
//! chunks of 512), merged into one 16-row cache, then `merge`, `filter`, `extract`, `align`,
//! a round begin + rollback and `state()` timed against one decode step of the 16 rows
//! (one position appended per row, then attended) at the detected ISA.
//!
//! `cargo bench -p tessera-kv --bench rows [-- DEPTH ...]` (default 4096 and 1024) prints,
//! per operation, the median milliseconds of `ROWS_RUNS` runs (default 21, at least 10)
//! after one warm-up round, the operations taking turns; its ratio to the decode step; and
//! the minor page faults it took. Two layer geometries: Gemma 3 270M's (1 KV head, 4 query
//! heads, head_dim 256) and Qwen 2.5 0.5B's (2 KV heads, 14 query heads, head_dim 64).
//! Inputs a consuming or mutating operation needs are rebuilt outside the timed region.

use candle_core::{Device, Tensor};
use std::time::Instant;
use tessera_kv::{AttentionCache, Isa, KvCache, KvScheme, LayerSpec, Retention};

const ROWS: usize = 16;
const CHUNK: usize = 512;

struct Geometry {
    name: &'static str,
    kv_heads: usize,
    q_heads: usize,
    head_dim: usize,
}

const GEOMETRIES: [Geometry; 2] = [
    Geometry {
        name: "Gemma 3 270M (1 KV head × 256, 4 q heads)",
        kv_heads: 1,
        q_heads: 4,
        head_dim: 256,
    },
    Geometry {
        name: "Qwen 2.5 0.5B (2 KV heads × 64, 14 q heads)",
        kv_heads: 2,
        q_heads: 14,
        head_dim: 64,
    },
];

fn random(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// The process's minor page faults so far (field 10 of /proc/self/stat): a fresh
/// allocation's pages each fault once, on first touch.
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    // Fields after the name start at field 3 (state); minflt is field 10.
    after_name
        .split_whitespace()
        .nth(7)
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}

/// The time of one operation and the page faults it took.
#[derive(Clone, Copy, Default)]
struct Sample {
    ms: f64,
    faults: f64,
}

impl std::ops::Add for Sample {
    type Output = Sample;
    fn add(self, o: Sample) -> Sample {
        Sample {
            ms: self.ms + o.ms,
            faults: self.faults + o.faults,
        }
    }
}

/// One call of `op` on `input` (built by the caller, untimed); what `op` returns is dropped
/// outside the timed region (its page faults are counted outside it too).
fn time_ms<S, R>(input: S, op: impl FnOnce(S) -> R) -> Sample {
    let faults = minor_faults();
    let t = Instant::now();
    let out = op(input);
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let faults = (minor_faults() - faults) as f64;
    drop(std::hint::black_box(out));
    Sample { ms, faults }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One timed operation: each call sets up its own inputs untimed and returns the sample of
/// the operation alone.
type Op<'a> = (&'static str, Box<dyn FnMut() -> Sample + 'a>);

/// Runs every operation once per round, in turn (so a machine's load drifting over the run
/// weighs on all of them alike), one warm-up round then `runs` timed; medians per operation.
fn interleaved(ops: &mut [Op<'_>], runs: usize) -> Vec<Sample> {
    let mut times = vec![Vec::with_capacity(runs); ops.len()];
    for round in 0..=runs {
        for (i, (_, op)) in ops.iter_mut().enumerate() {
            let sample = op();
            if round > 0 {
                times[i].push(sample);
            }
        }
    }
    times
        .into_iter()
        .map(|t| Sample {
            ms: median(t.iter().map(|s| s.ms).collect()),
            faults: median(t.iter().map(|s| s.faults).collect()),
        })
        .collect()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn one_row_cache(spec: LayerSpec, scheme: &KvScheme, depth: usize, seed: u64) -> KvCache {
    let mut cache = KvCache::new(&[spec], scheme, vec![0]).unwrap();
    let layer = cache.layer_mut(0);
    for (i, start) in (0..depth).step_by(CHUNK).enumerate() {
        let n = CHUNK.min(depth - start);
        let s = seed * 1000 + 2 * i as u64;
        let k = random((1, spec.kv_heads, n, spec.head_dim), s);
        let v = random((1, spec.kv_heads, n, spec.value_dim), s + 1);
        layer.append_window(&k, &v).unwrap();
    }
    cache
}

fn extracts(cache: &KvCache) -> Vec<KvCache> {
    (0..cache.batch())
        .map(|r| cache.extract(r).unwrap())
        .collect()
}

fn bench(g: &Geometry, depth: usize, runs: usize) {
    let spec = LayerSpec {
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        value_dim: g.head_dim,
        retention: Retention::Full,
    };
    let scheme = KvScheme::parse("affine:4:64").unwrap();
    assert_eq!(scheme.quantized_kv_start, 0);
    let singles: Vec<KvCache> = (0..ROWS)
        .map(|r| one_row_cache(spec, &scheme, depth, r as u64))
        .collect();
    assert!(singles.iter().all(|c| !c.layers()[0].awaiting_conversion()));
    let merged = KvCache::merge(singles).unwrap();
    assert_eq!((merged.batch(), merged.end()), (ROWS, depth));
    let state = merged.state().unwrap();
    let rebuild = || KvCache::from_state(&state, &Device::Cpu).unwrap();

    // One decode step: a position appended to every row and attended, then trimmed off so
    // every run reads the same depth. The warm-up step also grows the planes past `depth`
    // (a merged cache holds exactly its width), which the timed steps then reuse.
    let mut decoding = rebuild();
    let (k1, v1) = (
        random((ROWS, g.kv_heads, 1, g.head_dim), 77),
        random((ROWS, g.kv_heads, 1, g.head_dim), 78),
    );
    let q = random((ROWS, g.q_heads, 1, g.head_dim), 79);
    let scale = 1.0 / (g.head_dim as f32).sqrt();
    let isa = decoding.layers()[0].isa();
    let keep15: Vec<usize> = (0..ROWS).filter(|&r| r != 5).collect();
    let keep8: Vec<usize> = (0..ROWS).step_by(2).collect();
    // Row 5 leaves a running batch: the last row takes its place (as the server's does).
    let gap_filled: Vec<usize> = (0..ROWS - 1)
        .map(|r| if r == 5 { ROWS - 1 } else { r })
        .collect();
    let after_a_leave = || {
        let mut c = rebuild();
        c.retain(&gap_filled).unwrap();
        (c, merged.extract(5).unwrap())
    };
    let pads: Vec<usize> = (0..ROWS).collect();
    // A round of 4 drafted positions per row (appended untimed), rolled back keeping 1.
    let drafts = (
        random((ROWS, g.kv_heads, 4, g.head_dim), 80),
        random((ROWS, g.kv_heads, 4, g.head_dim), 81),
    );
    let mut round_cache = rebuild();
    let mut ops: Vec<Op<'_>> = vec![
        (
            "decode step (append_decode + attend)",
            Box::new(|| {
                time_ms(&mut decoding, |c| {
                    let layer = c.layer_mut(0);
                    let out = layer
                        .append_decode(&k1, &v1)
                        .unwrap()
                        .attend(&q, scale)
                        .unwrap();
                    layer.trim(1).unwrap();
                    out
                })
            }),
        ),
        (
            "first decode step after a merge (planes grow)",
            Box::new(|| {
                time_ms(rebuild(), |mut c| {
                    let out = c
                        .layer_mut(0)
                        .append_decode(&k1, &v1)
                        .unwrap()
                        .attend(&q, scale)
                        .unwrap();
                    (c, out)
                })
            }),
        ),
        (
            "merge of 16 one-row caches",
            Box::new(|| time_ms(extracts(&merged), |caches| KvCache::merge(caches).unwrap())),
        ),
        (
            "filter keeping 15 of 16",
            Box::new(|| {
                time_ms(rebuild(), |mut c| {
                    c.filter(&keep15).unwrap();
                    c
                })
            }),
        ),
        (
            "filter keeping 8 of 16",
            Box::new(|| {
                time_ms(rebuild(), |mut c| {
                    c.filter(&keep8).unwrap();
                    c
                })
            }),
        ),
        (
            "retain 15 of 16 in place (the last row fills the gap)",
            Box::new(|| {
                time_ms(rebuild(), |mut c| {
                    c.retain(&gap_filled).unwrap();
                    c
                })
            }),
        ),
        (
            "extend of those 15 rows by one in place",
            Box::new(|| {
                time_ms(after_a_leave(), |(mut c, one)| {
                    c.extend(one).unwrap();
                    c
                })
            }),
        ),
        (
            "extract of one row",
            Box::new(|| time_ms(&merged, |c| c.extract(7).unwrap())),
        ),
        (
            "align (row r padded by r)",
            Box::new(|| {
                time_ms(rebuild(), |mut c| {
                    c.align(&pads).unwrap();
                    c
                })
            }),
        ),
        (
            "round_begin + round_rollback (4 drafts, keep 1)",
            Box::new(|| {
                let begin = time_ms(&mut round_cache, |c| c.round_begin().unwrap());
                drop(
                    round_cache
                        .layer_mut(0)
                        .append_window(&drafts.0, &drafts.1)
                        .unwrap(),
                );
                let rollback = time_ms(&mut round_cache, |c| c.round_rollback(&[1; ROWS]).unwrap());
                round_cache.trim(1).unwrap();
                assert_eq!(round_cache.end(), depth);
                begin + rollback
            }),
        ),
        (
            "state()",
            Box::new(|| time_ms(&merged, |c| c.state().unwrap())),
        ),
    ];
    let load_before = loadavg();
    let times = interleaved(&mut ops, runs);
    let names: Vec<&str> = ops.iter().map(|o| o.0).collect();
    drop(ops);
    let decode = times[0].ms;

    let mib = merged.allocated_bytes() as f64 / (1 << 20) as f64;
    println!();
    println!(
        "{}, {ROWS} rows × {depth} positions, affine:4:64 ({mib:.1} MiB stored), isa {isa}, \
         median of {runs} interleaved runs",
        g.name
    );
    println!("load average before / after: {load_before} / {}", loadavg());
    println!("| operation | ms | ratio to decode step | page faults |");
    println!("|---|---|---|---|");
    for (name, t) in names.iter().zip(&times) {
        println!(
            "| {name} | {:.4} | {:.3} | {:.0} |",
            t.ms,
            t.ms / decode,
            t.faults
        );
    }
    profile(merged.allocated_bytes(), runs, decode);
}

/// What moving this many bytes costs in the memory system alone: the copy into memory
/// already touched, and one page fault (pages of an allocation above glibc's largest mmap
/// threshold, 32 MiB, so each run maps fresh pages), to set against the faults counted above.
fn profile(bytes: usize, runs: usize, decode: f64) {
    let words = bytes / 4;
    let src: Vec<u32> = (0..words as u32).collect();
    let mut warm = vec![1u32; words];
    const FRESH: usize = 64 << 20;
    let mut ops: Vec<Op<'_>> = vec![
        (
            "copy",
            Box::new(|| time_ms(&mut warm, |w| w.copy_from_slice(std::hint::black_box(&src)))),
        ),
        (
            "faults",
            Box::new(|| {
                time_ms((), |()| {
                    let mut fresh = vec![0u8; FRESH];
                    for page in fresh.iter_mut().step_by(4096) {
                        *page = 1;
                    }
                    std::hint::black_box(fresh)
                })
            }),
        ),
    ];
    let t = interleaved(&mut ops, runs);
    println!(
        "| (memory alone: copy of {:.1} MiB into touched memory) | {:.4} | {:.3} | {:.0} |",
        bytes as f64 / (1 << 20) as f64,
        t[0].ms,
        t[0].ms / decode,
        t[0].faults
    );
    println!(
        "| (memory alone: one page fault, of {:.0} touching 64 MiB) | {:.4} | {:.5} | 1 |",
        t[1].faults,
        t[1].ms / t[1].faults.max(1.0),
        t[1].ms / t[1].faults.max(1.0) / decode
    );
}

fn main() {
    // What the tessera binaries do at start (see `keep_freed_memory`); `ROWS_MALLOC=default`
    // measures glibc's defaults instead.
    if std::env::var("ROWS_MALLOC").as_deref() != Ok("default") {
        println!("keep_freed_memory: {}", tessera_kv::keep_freed_memory());
    }
    let mut depths: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    if depths.is_empty() {
        depths = vec![4096, 1024];
    }
    let runs: usize = std::env::var("ROWS_RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(21)
        .max(10);
    println!("detected isa: {}", Isa::detected());
    for depth in depths {
        for g in &GEOMETRIES {
            bench(g, depth, runs);
        }
    }
}
