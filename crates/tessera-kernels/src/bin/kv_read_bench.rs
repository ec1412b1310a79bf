//! Parity and speed of the GPU decode read, in one device run:
//! `kv-read-bench [parity] [copy] [time] [chunk] [+FILTER ...] [--plant-failure]` (all parts
//! by default; only reads whose label contains every FILTER, e.g. `+affine:4:64
//! "+(32,8,128) b16"`, are timed). Every parity comparison counts: the last line is
//! "kv-read-bench: N passed, M failed" and the exit status is 1 on any failure (a part that
//! stops with an error counts as one failed check; the other parts still run).
//! `--plant-failure` perturbs the first compared output, to show a miss fails the run;
//! `--defines=TEXT` adds `#define` lines to every kernel configuration (the variants);
//! `--split-factor=F` times reads with F times the planned splits (a wave of blocks F times
//! over), to see what the one-wave plan costs.
//! - parity: random keys/values stored by the CPU cache's own codecs (bf16 rounding,
//!   tessera-kv's affine quantizer), uploaded as stored, read on the GPU with left padding
//!   and ragged lengths, compared with attention in f64 on the host over the same stored
//!   values: ‖gpu − ref‖ / ‖ref‖ must stay under 1e-3 (CUDA cores) or 1e-2 (tensor cores,
//!   f16/bf16 operands); the output is poisoned (NaN) first.
//! - copy: device-to-device copy bandwidth (bytes read + written), the ceiling we report
//!   against.
//! - time: median µs per read (both launches) of every kernel variant a codec has, alone
//!   and 10 back to back (the GPU's rate, the host's launch latency hidden), for
//!   (q heads, kv heads, dim) = (4,1,256), (32,8,128), (64,8,128), batch 1 and 16,
//!   4k/32k/128k positions, bf16, affine 4/64, 8/64 and 4/128; GB/s over the bytes of the
//!   stored keys and values.
//!   `bench/sdpa_decode.py` times torch's SDPA on the same shapes in the same call.
//! - chunk: the fused chunk (prefill) read against the same f64 reference, query by query
//!   (causal, a padded row), then its µs for 512 queries at the end of 32k / 128k positions.

use anyhow::{bail, Result};
use candle_core::cuda_backend::cudarc::driver::{sys::CUevent_flags, CudaSlice};
use candle_core::{Device, Tensor};
use half::bf16;
use tessera_kernels::cuda::{DecodeRead, GpuCodec, GpuPlanes, Plan, Variant};
use tessera_kernels::tally::Tally;
use tessera_kernels::BLOCK_STEP;
use tessera_kv::planes::{AffinePlanes, Planes};

/// Records `rel <= bound` (false for NaN), printing a miss.
fn check(tally: &mut Tally, name: &str, rel: f64, bound: f64) {
    if !tally.within(rel, bound) {
        println!("{name}: relative error {rel:.3e} over {bound:e}: FAIL");
    }
}

/// `--plant-failure`: one element of `out` off by 1 (outputs are averages of values in
/// [-6, 6]), once.
fn maybe_plant(tally: &mut Tally, out: &mut [f32], name: &str) {
    if tally.take_plant() {
        out[0] += 1.0;
        println!("planted failure: first output of {name} off by 1");
    }
}

fn lcg(s: &mut u64) -> f32 {
    *s = s
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// Stores `k`, `v` (batch, kv_heads, cap, d) with `codec` as the CPU cache would; returns
/// the planes' words and the values a read of them returns.
#[allow(clippy::type_complexity)]
fn store(
    codec: GpuCodec,
    k: &[f32],
    v: &[f32],
    shape: (usize, usize, usize, usize),
) -> Result<([Vec<u32>; 4], usize, Vec<f32>, Vec<f32>)> {
    let (b, h, n, d) = shape;
    match codec {
        GpuCodec::Bf16 => {
            let pack = |x: &[f32]| -> Vec<u32> {
                x.chunks_exact(2)
                    .map(|p| {
                        bf16::from_f32(p[0]).to_bits() as u32
                            | (bf16::from_f32(p[1]).to_bits() as u32) << 16
                    })
                    .collect()
            };
            let round =
                |x: &[f32]| -> Vec<f32> { x.iter().map(|&a| bf16::from_f32(a).to_f32()).collect() };
            Ok(([pack(k), pack(v), vec![], vec![]], n, round(k), round(v)))
        }
        GpuCodec::Turbo { .. } => {
            bail!("kv-read-bench has no turbo planes (kv-cache-parity checks them)")
        }
        GpuCodec::Affine { bits, group } => {
            let mut planes = AffinePlanes::new(bits, group, b, h, d, d);
            Planes::reserve(&mut planes, n, n)?;
            let kt = Tensor::from_vec(k.to_vec(), shape, &Device::Cpu)?;
            let vt = Tensor::from_vec(v.to_vec(), shape, &Device::Cpu)?;
            Planes::write(&mut planes, 0..b, 0, &kt, &vt)?;
            let (kd, vd) = Planes::read(&planes, 0..b, 0, n)?;
            // The state's buffers: key codes, key (scale, bias) f16 pairs, value codes,
            // value pairs; a pair's two f16 are the little-endian halves of one device word.
            let state = Planes::state(&planes)?;
            let cap = state.capacity;
            let words = |x: &[u8]| -> Vec<u32> {
                x.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect()
            };
            let [kc, kp, vc, vp] = [0, 1, 2, 3].map(|i| words(&state.buffers[i]));
            Ok((
                [kc, vc, kp, vp],
                cap,
                kd.flatten_all()?.to_vec1()?,
                vd.flatten_all()?.to_vec1()?,
            ))
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    (b, kvh, n, d): (usize, usize, usize, usize),
    g: usize,
    starts: &[i32],
    ends: &[i32],
) -> Vec<f64> {
    let mut out = vec![0f64; b * kvh * g * d];
    for row in 0..b {
        for hq in 0..kvh * g {
            let h = hq / g;
            let qv = &q[(row * kvh * g + hq) * d..][..d];
            let at = |p: usize| ((row * kvh + h) * n + p) * d;
            let positions = starts[row] as usize..ends[row] as usize;
            let scores: Vec<f64> = positions
                .clone()
                .map(|p| (0..d).map(|i| qv[i] as f64 * k[at(p) + i] as f64).sum())
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            let o = &mut out[(row * kvh * g + hq) * d..][..d];
            for (p, wp) in positions.zip(&w) {
                for i in 0..d {
                    o[i] += wp / sum * v[at(p) + i] as f64;
                }
            }
        }
    }
    out
}

/// ‖got − want‖ / ‖want‖, after checking every output was written and is finite
/// (infinite if not).
fn rel_err(got: &[f32], want: &[f64], name: &str) -> Result<f64> {
    if got.len() != want.len() {
        bail!("{name}: {} outputs, expected {}", got.len(), want.len());
    }
    if got.iter().any(|x| !x.is_finite()) {
        println!("{name}: unwritten or non-finite output");
        return Ok(f64::INFINITY);
    }
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - b).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    Ok((num / den).sqrt())
}

/// The affine codecs the parity runs cover: the folded kernel's lane layouts (two groups a
/// row of 128 at 4 and 8 bits, one group a row, four).
const AFFINE_CODECS: [GpuCodec; 4] = [
    GpuCodec::Affine { bits: 4, group: 64 },
    GpuCodec::Affine { bits: 8, group: 64 },
    GpuCodec::Affine {
        bits: 4,
        group: 128,
    },
    GpuCodec::Affine { bits: 8, group: 32 },
];

fn parity(gpu: &DecodeRead, tally: &mut Tally) -> Result<()> {
    let mut seed = 0x1234_5678u64;
    let mut worst = 0f64;
    for codec in std::iter::once(GpuCodec::Bf16).chain(AFFINE_CODECS) {
        // (q heads, KV heads, dim, rows): 300 rows take two launches of spans.
        for (qh, kvh, d, rows) in [
            (4, 1, 256, 3),
            (32, 8, 128, 3),
            (8, 8, 64, 3),
            (64, 8, 128, 3),
            (2, 1, 128, 3),
            (2, 1, 128, 300),
        ] {
            if let GpuCodec::Affine { group, .. } = codec {
                if group > d {
                    continue;
                }
            }
            let g = qh / kvh;
            let b = rows;
            let n = if rows > 3 {
                400
            } else {
                2100 + (seed as usize % 900)
            };
            let shape = (b, kvh, n, d);
            // Keys and values with a few large channels, as real keys have.
            let k: Vec<f32> = (0..b * kvh * n * d)
                .map(|i| lcg(&mut seed) * if i % d < 4 { 6.0 } else { 1.0 })
                .collect();
            let v: Vec<f32> = (0..b * kvh * n * d).map(|_| lcg(&mut seed)).collect();
            let q: Vec<f32> = (0..b * qh * d).map(|_| lcg(&mut seed) * 0.2).collect();
            // Left padding, a short row, a row of one position (in turn).
            let starts: Vec<i32> = (0..b).map(|r| [0, 37, n as i32 - 1][r % 3]).collect();
            let ends: Vec<i32> = (0..b)
                .map(|r| [n as i32, n as i32 - 290, n as i32][r % 3])
                .collect();
            let ([kw, vw, kp, vp], cap, kr, vr) = store(codec, &k, &v, shape)?;
            // The reference reads the stored values, laid out with the planes' capacity.
            let (kr, vr) = (regrid(&kr, shape, cap), regrid(&vr, shape, cap));
            let planes = gpu.upload(codec, (b, kvh, cap, d), &kw, &vw, &kp, &vp)?;
            let want = reference(&q, &kr, &vr, (b, kvh, cap, d), g, &starts, &ends);
            let s = &gpu.stream;
            // The device gets 8q and a scale of 1/8: the scale must reach the scores.
            let qd = s.clone_htod(&q.iter().map(|x| x * 8.0).collect::<Vec<_>>())?;
            let spans: Vec<(usize, usize)> = starts
                .iter()
                .zip(&ends)
                .map(|(&a, &e)| (a as usize, e as usize))
                .collect();
            for variant in Variant::ALL {
                if !gpu.has(codec, d, g, variant)? {
                    continue;
                }
                let mut out: CudaSlice<f32> = s.clone_htod(&vec![f32::NAN; b * qh * d])?;
                let plan = gpu.plan(Some(variant), &planes, g, n)?;
                let mut scratch = gpu.scratch(&plan, &planes, g)?;
                let qv = qd.as_view();
                gpu.decode(
                    &plan,
                    &planes,
                    g,
                    &qv,
                    0.125,
                    &spans,
                    None,
                    &mut scratch,
                    &mut out,
                )?;
                let name = format!("{} {variant:?} ({qh},{kvh},{d})", codec.name());
                let mut got = s.clone_dtoh(&out)?;
                maybe_plant(tally, &mut got, &name);
                let rel = rel_err(&got, &want, &name)?;
                // f32 arithmetic lands far under 1e-3; bf16 operands (the tensor cores take
                // q and the softmax weights in bf16, as SDPA does) between 1e-3 and 1e-2.
                let bound = if variant == Variant::Simt { 1e-3 } else { 1e-2 };
                worst = worst.max(rel);
                println!(
                    "parity {name} b{b} n{n} splits {}: rel err {rel:.2e}",
                    plan.splits
                );
                check(tally, &name, rel, bound);
                // The same read from positions in device memory (the chunk, then (start,
                // slot = end − 1) per row): the same bits, and every slot advanced by one.
                let eager = got;
                let live_plan = plan;
                let mut live_scratch = gpu.scratch(&live_plan, &planes, g)?;
                let desc: Vec<i32> = std::iter::once(plan.chunk as i32)
                    .chain(starts.iter().zip(&ends).flat_map(|(&a, &e)| [a, e - 1]))
                    .collect();
                let mut live = s.clone_htod(&desc)?;
                let mut out = s.clone_htod(&vec![f32::NAN; b * qh * d])?;
                gpu.decode(
                    &live_plan,
                    &planes,
                    g,
                    &qv,
                    0.125,
                    &[],
                    Some(&mut live),
                    &mut live_scratch,
                    &mut out,
                )?;
                let live_name = format!("{name} live");
                let mut got = s.clone_dtoh(&out)?;
                maybe_plant(tally, &mut got, &live_name);
                let rel = rel_err(&got, &want, &live_name)?;
                worst = worst.max(rel);
                let advanced: Vec<i32> = std::iter::once(plan.chunk as i32)
                    .chain(starts.iter().zip(&ends).flat_map(|(&a, &e)| [a, e]))
                    .collect();
                let moved = s.clone_dtoh(&live)? == advanced;
                let same = got
                    .iter()
                    .zip(&eager)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                println!(
                    "parity {live_name} b{b} n{n} splits {}: rel err {rel:.2e}, slots advanced: \
                     {moved}, the ordinary read's bits: {same}",
                    live_plan.splits
                );
                let ok = moved && same;
                check(
                    tally,
                    &live_name,
                    if ok { rel } else { f64::INFINITY },
                    bound,
                );
            }
        }
    }
    println!("parity: done, worst relative error {worst:.2e}");
    Ok(())
}

/// The chunk (prefill) read against the same f64 reference, query by query: query i of row
/// r (position start + i) sees slots pads[r] ..= start + i, or only itself while it is
/// padding. Few queries over a long span take several splits (partials and the merge),
/// many take one (the block writes the output).
fn chunk_parity(gpu: &DecodeRead, tally: &mut Tally) -> Result<()> {
    let mut seed = 0x9876_5432u64;
    let mut worst = 0f64;
    for codec in std::iter::once(GpuCodec::Bf16).chain(AFFINE_CODECS) {
        // bf16: q and p enter the tensor cores as two bf16 parts each (≈ 16 bits); affine:
        // f16 operands (11 bits).
        let bound = if codec == GpuCodec::Bf16 { 1e-4 } else { 1e-2 };
        // (12,4,128): 3 query heads per KV head, so 2 queries fill 6 of 8 columns.
        for (qh, kvh, d) in [(32, 8, 128), (8, 8, 64), (2, 1, 128), (12, 4, 128)] {
            let g = qh / kvh;
            if !gpu.has_chunk(codec, d, g)? {
                continue;
            }
            for (start, n) in [(1500usize, 5usize), (300, 203)] {
                let (b, total) = (2, start + n);
                // Row 1's first two queries are padding.
                let pads = [0usize, start + 2];
                let shape = (b, kvh, total, d);
                let k: Vec<f32> = (0..b * kvh * total * d)
                    .map(|i| lcg(&mut seed) * if i % d < 4 { 6.0 } else { 1.0 })
                    .collect();
                let v: Vec<f32> = (0..b * kvh * total * d).map(|_| lcg(&mut seed)).collect();
                let q: Vec<f32> = (0..b * qh * n * d).map(|_| lcg(&mut seed) * 0.2).collect();
                let ([kw, vw, kp, vp], cap, kr, vr) = store(codec, &k, &v, shape)?;
                let (kr, vr) = (regrid(&kr, shape, cap), regrid(&vr, shape, cap));
                let planes = gpu.upload(codec, (b, kvh, cap, d), &kw, &vw, &kp, &vp)?;
                let mut want = vec![0f64; b * qh * n * d];
                for i in 0..n {
                    let pos = start + i;
                    let qi: Vec<f32> = (0..b * qh)
                        .flat_map(|rh| q[(rh * n + i) * d..][..d].to_vec())
                        .collect();
                    let starts: Vec<i32> = pads
                        .iter()
                        .map(|&p| if pos < p { pos } else { p } as i32)
                        .collect();
                    let ends = vec![pos as i32 + 1; b];
                    let one = reference(&qi, &kr, &vr, (b, kvh, cap, d), g, &starts, &ends);
                    for rh in 0..b * qh {
                        want[(rh * n + i) * d..][..d].copy_from_slice(&one[rh * d..][..d]);
                    }
                }
                let s = &gpu.stream;
                let qd = s.clone_htod(&q.iter().map(|x| x * 8.0).collect::<Vec<_>>())?;
                let pd = s.clone_htod(&pads.iter().map(|&p| p as i32).collect::<Vec<_>>())?;
                let mut out: CudaSlice<f32> = s.clone_htod(&vec![f32::NAN; b * qh * n * d])?;
                let qv = qd.as_view();
                gpu.chunk(&planes, g, &qv, 0.125, &pd, start, n, 0, &mut out)?;
                let name = format!(
                    "chunk {} ({qh},{kvh},{d}) start {start} n {n}",
                    codec.name()
                );
                let mut got = s.clone_dtoh(&out)?;
                maybe_plant(tally, &mut got, &name);
                let rel = rel_err(&got, &want, &name)?;
                worst = worst.max(rel);
                println!("parity {name}: rel err {rel:.2e}");
                check(tally, &name, rel, bound);
            }
        }
    }
    println!("chunk parity: done, worst relative error {worst:.2e}");
    Ok(())
}

/// µs per chunk read of `n` queries at the end of `depth` positions (random planes).
fn time_chunks(gpu: &DecodeRead) -> Result<()> {
    println!(
        "{:<14} {:>12} {:>5} {:>7} {:>7} {:>10}",
        "codec", "shape", "batch", "depth", "queries", "µs"
    );
    let (qh, kvh, d) = (32usize, 8usize, 128usize);
    for codec in [GpuCodec::Bf16, GpuCodec::Affine { bits: 4, group: 64 }] {
        for (b, depth, n) in [
            (1usize, 32768usize, 512usize),
            (16, 32768, 512),
            (1, 131072, 512),
        ] {
            let g = qh / kvh;
            let planes = gpu.random_planes(codec, b, kvh, depth, d, 23)?;
            let s = &gpu.stream;
            let mut seed = 7u64;
            let q: Vec<f32> = (0..b * qh * n * d).map(|_| lcg(&mut seed) * 0.1).collect();
            let qd = s.clone_htod(&q)?;
            let pd = s.clone_htod(&vec![0i32; b])?;
            let mut out = s.alloc_zeros::<f32>(b * qh * n * d)?;
            let qv = qd.as_view();
            let us = timed(gpu, 10, || {
                gpu.chunk(&planes, g, &qv, 1.0, &pd, depth - n, n, 0, &mut out)
            })?;
            println!(
                "{:<14} {:>12} {:>5} {:>7} {:>7} {:>10.1}",
                codec.name(),
                format!("({qh},{kvh},{d})"),
                b,
                depth,
                n,
                us
            );
        }
    }
    Ok(())
}

/// (b, h, n, d) values into (b, h, cap, d) slots (zeros beyond n).
fn regrid(x: &[f32], (b, h, n, d): (usize, usize, usize, usize), cap: usize) -> Vec<f32> {
    if x.len() == b * h * cap * d {
        return x.to_vec();
    }
    let mut out = vec![0f32; b * h * cap * d];
    for blk in 0..b * h {
        out[blk * cap * d..][..n * d].copy_from_slice(&x[blk * n * d..][..n * d]);
    }
    out
}

fn timed<F: FnMut() -> Result<()>>(gpu: &DecodeRead, reps: usize, mut f: F) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let a = gpu.stream.record_event(flags)?;
        f()?;
        let b = gpu.stream.record_event(flags)?;
        times.push(a.elapsed_ms(&b)? as f64 * 1000.0);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[reps / 2])
}

/// Median µs per call of `f` over `reps` samples of `burst` calls queued back to back.
fn timed_burst<F: FnMut() -> Result<()>>(
    gpu: &DecodeRead,
    reps: usize,
    burst: usize,
    mut f: F,
) -> Result<f64> {
    timed(gpu, reps, || {
        for _ in 0..burst {
            f()?;
        }
        Ok(())
    })
    .map(|us| us / burst as f64)
}

fn copy_bandwidth(gpu: &DecodeRead) -> Result<f64> {
    let n = 1usize << 29; // 2 GiB of u32
    let src = gpu.stream.alloc_zeros::<u32>(n)?;
    let mut dst = gpu.stream.alloc_zeros::<u32>(n)?;
    let us = timed(gpu, 10, || Ok(gpu.stream.memcpy_dtod(&src, &mut dst)?))?;
    let gbs = (2 * 4 * n) as f64 / us / 1e3;
    println!("copy: {us:.0} µs for 2 × 2 GiB → {gbs:.0} GB/s (read + write)");
    Ok(gbs)
}

/// `filters`: every one must occur in a read's label ("affine:4:64 Folded (32,8,128) b16
/// n32768") for it to be timed.
fn time_reads(gpu: &DecodeRead, copy: f64, filters: &[String], split_factor: f64) -> Result<()> {
    println!(
        "{:<14} {:<10} {:>12} {:>5} {:>7} {:>10} {:>8} {:>7} {:>9} {:>7} {:>6}",
        "codec",
        "kernel",
        "shape",
        "batch",
        "tokens",
        "µs",
        "GB/s",
        "%copy",
        "µs b2b",
        "%copy",
        "splits"
    );
    for codec in [
        GpuCodec::Bf16,
        GpuCodec::Affine { bits: 4, group: 64 },
        GpuCodec::Affine { bits: 8, group: 64 },
        GpuCodec::Affine {
            bits: 4,
            group: 128,
        },
        GpuCodec::Turbo { kbits: 4, vbits: 4 },
        GpuCodec::Turbo { kbits: 3, vbits: 3 },
    ] {
        for (qh, kvh, d) in [(4usize, 1usize, 256usize), (32, 8, 128), (64, 8, 128)] {
            for b in [1usize, 16] {
                for n in [4096usize, 32768, 131072] {
                    let g = qh / kvh;
                    let mut chosen = vec![];
                    for variant in Variant::ALL {
                        let label =
                            format!("{} {variant:?} ({qh},{kvh},{d}) b{b} n{n}", codec.name());
                        if gpu.has(codec, d, g, variant)?
                            && filters.iter().all(|f| label.contains(f.as_str()))
                        {
                            chosen.push(variant);
                        }
                    }
                    if chosen.is_empty() {
                        continue;
                    }
                    let one = GpuPlanes::bytes_for(codec, b, kvh, n, d);
                    // Rotate over copies while one fits in the 50 MB L2 several times over.
                    let copies = (256_000_000 / one).clamp(1, 8);
                    let planes: Vec<GpuPlanes> = (0..copies)
                        .map(|c| gpu.random_planes(codec, b, kvh, n, d, 17 + c as u32))
                        .collect::<Result<_>>()?;
                    let s = &gpu.stream;
                    let mut seed = 5u64;
                    let q: Vec<f32> = (0..b * qh * d).map(|_| lcg(&mut seed) * 0.1).collect();
                    let qd = s.clone_htod(&q)?;
                    let (qv, spans) = (qd.as_view(), vec![(0, n); b]);
                    let mut out = s.alloc_zeros::<f32>(b * qh * d)?;
                    for variant in chosen {
                        let plan = scaled_splits(
                            gpu.plan(Some(variant), &planes[0], g, n)?,
                            n,
                            split_factor,
                        );
                        let mut scratch = gpu.scratch(&plan, &planes[0], g)?;
                        let mut i = 0;
                        let mut read = || {
                            i += 1;
                            let p = &planes[i % copies];
                            gpu.decode(&plan, p, g, &qv, 1.0, &spans, None, &mut scratch, &mut out)
                        };
                        let us = timed(gpu, 30, &mut read)?;
                        let burst = timed_burst(gpu, 10, 10, &mut read)?;
                        let gbs = one as f64 / us / 1e3;
                        let burst_gbs = one as f64 / burst / 1e3;
                        println!(
                            "{:<14} {:<10} {:>12} {:>5} {:>7} {:>10.1} {:>8.0} {:>6.0}% {:>9.1} {:>6.0}% {:>6}",
                            codec.name(),
                            format!("{variant:?}"),
                            format!("({qh},{kvh},{d})"),
                            b,
                            n,
                            us,
                            gbs,
                            100.0 * gbs / copy,
                            burst,
                            100.0 * burst_gbs / copy,
                            plan.splits
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// `plan` with `factor` times its splits over `n` positions (chunks stay whole block steps).
fn scaled_splits(plan: Plan, n: usize, factor: f64) -> Plan {
    if factor == 1.0 {
        return plan;
    }
    let want = ((plan.splits as f64 * factor).round() as usize).max(1);
    let chunk = n.div_ceil(want).div_ceil(BLOCK_STEP).max(1) * BLOCK_STEP;
    Plan {
        splits: n.div_ceil(chunk),
        chunk,
        ..plan
    }
}

fn main() {
    // Words name the parts to run; `+TEXT` arguments filter the timed reads by label.
    let mut plant = false;
    let mut defines = String::new();
    let mut split_factor = 1.0f64;
    let all: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| {
            if let Some(d) = a.strip_prefix("--defines=") {
                defines.push_str(d);
                defines.push('\n');
                return false;
            }
            if let Some(f) = a.strip_prefix("--split-factor=") {
                match f.parse::<f64>() {
                    Ok(f) if f > 0.0 => split_factor = f,
                    _ => {
                        eprintln!(
                            "kv-read-bench: --split-factor wants a positive number, not {f:?}"
                        );
                        std::process::exit(2);
                    }
                }
                return false;
            }
            let this = a == "--plant-failure";
            plant |= this;
            !this
        })
        .collect();
    let mut tally = Tally::new(plant);
    let (filters, args): (Vec<String>, Vec<String>) =
        all.into_iter().partition(|a| a.starts_with('+'));
    let filters: Vec<String> = filters.iter().map(|f| f[1..].to_string()).collect();
    const PARTS: [&str; 4] = ["parity", "copy", "time", "chunk"];
    if let Some(bad) = args.iter().find(|a| !PARTS.contains(&a.as_str())) {
        eprintln!(
            "kv-read-bench: unknown part {bad:?} (parts: {}; +FILTER; --plant-failure; --defines=TEXT)",
            PARTS.join(", ")
        );
        std::process::exit(2);
    }
    let want = |w: &str| args.is_empty() || args.iter().any(|a| a == w);
    let checks = want("parity") || want("chunk");
    // Timing alone has no checks: it passes unless a part stopped.
    let summary = |tally: &mut Tally| {
        let passed = if checks {
            tally.finish("kv-read-bench")
        } else {
            tally.failed == 0
        };
        if !passed {
            std::process::exit(1);
        }
    };
    let gpu = match DecodeRead::new(0) {
        Ok(g) => g.with_defines(defines),
        Err(e) => {
            eprintln!("kv-read-bench: no CUDA device: {e:#}");
            tally.record(false);
            summary(&mut tally);
            unreachable!();
        }
    };
    // A part that stops on an error is one failed check; the other parts still run.
    let part = |name: &str, r: Result<()>, tally: &mut Tally| {
        if let Err(e) = r {
            tally.stopped(name, format!("{e:#}"));
        }
    };
    if want("parity") {
        let r = parity(&gpu, &mut tally);
        part("parity", r, &mut tally);
    }
    if want("copy") || want("time") {
        match copy_bandwidth(&gpu) {
            Ok(copy) if want("time") => {
                let r = time_reads(&gpu, copy, &filters, split_factor);
                part("time", r, &mut tally);
            }
            Ok(_) => {}
            Err(e) => part("copy", Err(e), &mut tally),
        }
    }
    if want("chunk") {
        let r = chunk_parity(&gpu, &mut tally);
        part("chunk parity", r, &mut tally);
        let r = time_chunks(&gpu);
        part("chunk timing", r, &mut tally);
    }
    summary(&mut tally);
}
