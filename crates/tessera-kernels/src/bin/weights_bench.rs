//! Parity and speed of tessera's Q4_0 weight kernels against candle's quantized matmul, in
//! one device run: `weights-bench [parity] [time] [variants] [profile]
//! [--variant=NAME=V,…] [--plant-failure]` (parity and time by default).
//! - parity: random Q4_0 matrices (codes uniform, scales in [1e-3, 1e-2]) and random inputs;
//!   our output, and candle's for information, against a host reference in f64 computed
//!   from the file's block definition (x = d · (q − 8)). Both paths at every row count:
//!   tensor-core launches (every block shape) must stay under 1e-6 relative up to
//!   `SPLIT_UP_TO` rows (inputs split into f16 high parts and residuals) and 1e-3 above (f16
//!   inputs), the bf16 GEMM under 1e-2;
//!   stacking; shapes the layout does not take are refused.
//!   The last line is "weights-bench: N passed, M failed"; the exit status is 1 on a miss.
//!   `--plant-failure` perturbs the first output compared, to show a miss fails the run.
//! - time: every matmul of one Llama-3-8B forward (32 layers of q|k|v 6144×4096, o
//!   4096×4096, gate|up 28672×4096, down 4096×14336, and the 128256×4096 output), 4.2 GB
//!   of Q4_0, for m = 1..512 input rows: median ms of a whole pass by our tensor-core
//!   launches (every block shape, and the model's choice), by our bf16 GEMM, and by candle,
//!   and the GB/s the weights stream at; for 1, 8 and 16 rows, each kind of matrix alone.
//! - variants: weights.cu's build choices (B_AHEAD, MIN_WARPS, any `#define`) and the host's
//!   SPLIT_UP_TO and the launch shapes of small and large matrices (SMALL=1x4, SMALL_WIDE=2x8
//!   at 5+ rows, LARGE=2x4),
//!   each `--variant=NAME=V,NAME=V`
//!   (the flags replace the default list):
//!   parity against the f64 reference on two shapes through the model's entry point (a miss
//!   fails the run), then its launches timed per kind of matrix and for the whole forward at
//!   1, 4, 8, 16 and 32 rows.
//! - profile: one model's-path matmul of the output and a down matrix at 1 and 8 rows, for
//!   a profiler (device-run.sh `wprofile`).

use anyhow::{anyhow, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use std::borrow::Cow;
use std::time::Instant;
use tessera_kernels::tally::Tally;
use tessera_kernels::weights::CudaWeights;
use tessera_kernels::weights::{MmaShape, MmaShapes, Q4Matrix, SPLIT_UP_TO};
use tessera_models::device_weights::{DeviceMatrix, PairRope, WeightBackend};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `n × k` Q4_0 blocks: random codes, scales in [1e-3, 1e-2].
fn q4_0_bytes(n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let blocks = n * k / 32;
    let mut out = vec![0u8; blocks * 18];
    for b in out.chunks_exact_mut(18) {
        let d = half::f16::from_f64(1e-3 + 9e-3 * rng.unit());
        b[..2].copy_from_slice(&d.to_bits().to_le_bytes());
        for c in b[2..].chunks_mut(8) {
            let r = rng.next().to_le_bytes();
            c.copy_from_slice(&r[..c.len()]);
        }
    }
    out
}

/// Row `j` of the matrix, from the block definition.
fn reference_row(bytes: &[u8], k: usize, j: usize) -> Vec<f64> {
    let kb = k / 32;
    let mut row = vec![0.0; k];
    for b in 0..kb {
        let blk = &bytes[(j * kb + b) * 18..(j * kb + b + 1) * 18];
        let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64();
        for i in 0..16 {
            row[b * 32 + i] = d * ((blk[2 + i] & 15) as f64 - 8.0);
            row[b * 32 + 16 + i] = d * ((blk[2 + i] >> 4) as f64 - 8.0);
        }
    }
    row
}

/// `len` inputs uniform in [-1, 1).
fn inputs(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len).map(|_| (rng.unit() * 2.0 - 1.0) as f32).collect()
}

/// `x · Wᵀ` in f64 for the rows of `x` (each `k` long) against reference rows `w`.
fn reference_out(w: &[Vec<f64>], x: &[f32], k: usize) -> Vec<f64> {
    x.chunks_exact(k)
        .flat_map(|xr| {
            w.iter()
                .map(|row| row.iter().zip(xr).map(|(a, b)| a * *b as f64).sum::<f64>())
                .collect::<Vec<_>>()
        })
        .collect()
}

fn cuda(device: &Device) -> Result<&candle_core::CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d),
        _ => Err(anyhow!("not a CUDA device")),
    }
}

fn qtensor(bytes: &[u8], n: usize, k: usize, device: &Device) -> Result<QTensor> {
    let storage = QStorage::from_data(Cow::Borrowed(bytes), device, GgmlDType::Q4_0)?;
    Ok(QTensor::new(storage, (n, k))?)
}

/// Ours and candle's outputs against the f64 reference `want`: ours within `tol` passes.
fn check(
    tally: &mut Tally,
    label: &str,
    mut got: Vec<f32>,
    want: &[f64],
    candle: &[f32],
    tol: f64,
) {
    if tally.take_plant() {
        got[0] += 1.0;
    }
    let rel = |v: &[f32]| {
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (a, b) in v.iter().zip(want) {
            let a = *a as f64;
            num += if a.is_nan() {
                f64::INFINITY
            } else {
                (a - b) * (a - b)
            };
            den += b * b;
        }
        (num / den).sqrt()
    };
    let (ours, theirs) = (rel(&got), rel(candle));
    let ok = ours < tol && got.len() == want.len();
    println!(
        "{} {label}: ours {ours:.2e} (tolerance {tol:.0e}), candle {theirs:.2e}",
        if ok { "PASS" } else { "FAIL" }
    );
    tally.record(ok);
}

fn parity(device: &Device, backend: &CudaWeights, tally: &mut Tally) -> Result<()> {
    let mut rng = Rng(7);
    // 1008 rows: an odd number of 16-row tiles (a ragged grid with two a block); 1536
    // columns: six octets over four warps.
    for (n, k) in [
        (1008, 4096),
        (6144, 4096),
        (4096, 14336),
        (96, 1024),
        (256, 1536),
    ] {
        let bytes = q4_0_bytes(n, k, &mut rng);
        let q = qtensor(&bytes, n, k, device)?;
        let ours = backend.q4_0(cuda(device)?, &bytes, n, k)?;
        let candle = QMatMul::from_qtensor(q)?;
        let rows: Vec<Vec<f64>> = (0..n).map(|j| reference_row(&bytes, k, j)).collect();
        for m in [1, 2, 3, 4, 5, 8, 9, 16, 17, 40, 64] {
            // Both paths at every m: tensor-core launches (chunks of 16) and the bf16 GEMM.
            let x = inputs(&mut rng, m * k);
            let want = reference_out(&rows, &x, k);
            let xt = Tensor::from_vec(x, (1, m, k), device)?;
            let theirs = candle.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?;
            // Up to SPLIT_UP_TO rows the inputs enter split (f32-like), above as f16.
            let tol = if m <= SPLIT_UP_TO { 1e-6 } else { 1e-3 };
            for shape in MmaShape::all() {
                let got = ours
                    .forward_mma(&xt, shape)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                check(
                    tally,
                    &format!("{n}×{k} m={m} mma, {shape}"),
                    got,
                    &want,
                    &theirs,
                    tol,
                );
            }
            let gemm = ours.forward_gemm(&xt)?.flatten_all()?.to_vec1::<f32>()?;
            check(
                tally,
                &format!("{n}×{k} m={m} bf16 GEMM"),
                gemm,
                &want,
                &theirs,
                1e-2,
            );
        }
    }
    // The model's entry point picks a path by row count: tensor-core launches, GEMM.
    let (n, k) = (1008, 4096);
    let bytes = q4_0_bytes(n, k, &mut rng);
    let policy = backend
        .matrix(&qtensor(&bytes, n, k, device)?)?
        .ok_or_else(|| anyhow!("the backend refused a Q4_0 matrix"))?;
    let rows: Vec<Vec<f64>> = (0..n).map(|j| reference_row(&bytes, k, j)).collect();
    for (m, tol) in [
        (1, 1e-6),
        (SPLIT_UP_TO, 1e-6),
        (16, 1e-3),
        (100, 1e-3),
        (300, 1e-2),
    ] {
        let x = inputs(&mut rng, m * k);
        let xt = Tensor::from_vec(x.clone(), (m, k), device)?;
        // (label, ours, the f64 reference) for every entry point at these rows.
        let mut checks = vec![("", policy.forward(&xt)?, reference_out(&rows, &x, k))];
        // The norm folded into the input launch: RMSNorm of each row in f64 first; with a
        // residual add folded in too, of x + h summed in f32 (as an add launch would).
        let (weight, eps) = (inputs(&mut rng, k), 1e-6f32);
        let weight: Vec<f32> = weight.iter().map(|w| 1.0 + 0.5 * w).collect();
        let normed = |x: &[f32]| -> Vec<f32> {
            x.chunks(k)
                .flat_map(|row| {
                    let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / k as f64;
                    let inv = 1.0 / (ms + eps as f64).sqrt();
                    row.iter()
                        .zip(&weight)
                        .map(move |(&v, &w)| (v as f64 * inv * w as f64) as f32)
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let wt = Tensor::from_vec(weight.clone(), k, device)?;
        let (sum, got) = policy.forward_normed(&xt, None, &wt, eps)?;
        checks.push((", normed", got, reference_out(&rows, &normed(&x), k)));
        let same_x = sum.flatten_all()?.to_vec1::<f32>()? == x;
        let h = inputs(&mut rng, m * k);
        let ht = Tensor::from_vec(h.clone(), (m, k), device)?;
        let s: Vec<f32> = x.iter().zip(&h).map(|(a, b)| a + b).collect();
        let (sum, got) = policy.forward_normed(&xt, Some(&ht), &wt, eps)?;
        checks.push((", add-normed", got, reference_out(&rows, &normed(&s), k)));
        let same_sum = sum.flatten_all()?.to_vec1::<f32>()? == s;
        // RoPE over adjacent pairs folded into the matmul (the epilogue, or the GEMM path's
        // launch): 7 heads of 128 of the 1008 output columns rotated, in f64 after the
        // reference matmul, at random angles per input row.
        let (half, heads) = (64usize, 7usize);
        let angles: Vec<f64> = (0..m * half).map(|_| rng.unit() * 6.3).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos() as f32).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin() as f32).collect();
        let mut roped = reference_out(&rows, &normed(&s), k);
        for (i, out) in roped.chunks_mut(n).enumerate() {
            for p in 0..heads * half {
                let t = i * half + p % half;
                let (c, sn) = (cos[t] as f64, sin[t] as f64);
                let (e, o) = (out[2 * p], out[2 * p + 1]);
                out[2 * p] = e * c - o * sn;
                out[2 * p + 1] = e * sn + o * c;
            }
        }
        let (cos, sin) = (
            Tensor::from_vec(cos, (m, half), device)?,
            Tensor::from_vec(sin, (m, half), device)?,
        );
        let pairs = PairRope {
            cos: &cos,
            sin: &sin,
            columns: heads * 2 * half,
        };
        let (_, got) = policy.forward_normed_roped(&xt, Some(&ht), &wt, eps, &pairs)?;
        checks.push((", add-normed, roped", got, roped));
        println!(
            "{} model path {n}×{k} m={m}: the stream handed back is x (no add) {same_x}, x + h \
             bit for bit {same_sum}",
            if same_x && same_sum { "PASS" } else { "FAIL" }
        );
        tally.record(same_x && same_sum);
        // silu(gate) · up folded in, gate and up the halves of one (m, 2k) output.
        let both = inputs(&mut rng, m * 2 * k);
        let gated: Vec<f32> = both
            .chunks(2 * k)
            .flat_map(|row| {
                let (g, u) = row.split_at(k);
                g.iter()
                    .zip(u)
                    .map(|(&g, &u)| (g as f64 / (1.0 + (-(g as f64)).exp()) * u as f64) as f32)
                    .collect::<Vec<_>>()
            })
            .collect();
        let both = Tensor::from_vec(both, (m, 2 * k), device)?;
        let (gate, up) = (both.narrow(1, 0, k)?, both.narrow(1, k, k)?);
        checks.push((
            ", silu-gated",
            policy.forward_silu_gated(&gate, &up)?,
            reference_out(&rows, &gated, k),
        ));
        for (what, got, want) in checks {
            let got = got.flatten_all()?.to_vec1::<f32>()?;
            let same = got.clone();
            check(
                tally,
                &format!("model path{what} {n}×{k} m={m}"),
                got,
                &want,
                &same,
                tol,
            );
        }
    }
    // Stacking: three parts as one matrix equal the parts side by side.
    let parts: Vec<(usize, Vec<u8>)> = [48, 32, 16]
        .into_iter()
        .map(|n| (n, q4_0_bytes(n, 1024, &mut rng)))
        .collect();
    let mats = parts
        .iter()
        .map(|(n, b)| {
            backend
                .matrix(&qtensor(b, *n, 1024, device)?)?
                .ok_or_else(|| anyhow!("refused"))
        })
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&dyn DeviceMatrix> = mats.iter().map(|m| m.as_ref()).collect();
    let stacked = backend
        .stack(&refs)?
        .ok_or_else(|| anyhow!("the backend refused to stack Q4_0 matrices"))?;
    let x = inputs(&mut rng, 1024);
    let rows: Vec<Vec<f64>> = parts
        .iter()
        .flat_map(|(n, b)| (0..*n).map(|j| reference_row(b, 1024, j)))
        .collect();
    let want = reference_out(&rows, &x, 1024);
    let xt = Tensor::from_vec(x, (1, 1024), device)?;
    let got = stacked.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?;
    let fake_candle = got.clone();
    check(
        tally,
        "stacked 48+32+16 × 1024",
        got,
        &want,
        &fake_candle,
        1e-6,
    );
    // Shapes the layout does not take stay with candle: rows not a multiple of 16, widths
    // not a multiple of 256 (Gemma 3 270M's 640).
    for (n, k) in [(8, 1536), (16, 640)] {
        let odd = qtensor(&q4_0_bytes(n, k, &mut rng), n, k, device)?;
        let refused = backend.matrix(&odd)?.is_none();
        println!(
            "{} a {n}×{k} Q4_0 matrix left to candle",
            if refused { "PASS" } else { "FAIL" }
        );
        tally.record(refused);
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time(device: &Device, backend: &CudaWeights) -> Result<()> {
    let mut rng = Rng(11);
    let shapes = forward_shapes();
    let mut ours: Vec<Q4Matrix> = Vec::new();
    let mut theirs = Vec::new();
    let mut bytes_total = 0usize;
    for &(n, k) in &shapes {
        let bytes = q4_0_bytes(n, k, &mut rng);
        bytes_total += bytes.len();
        ours.push(backend.q4_0(cuda(device)?, &bytes, n, k)?);
        theirs.push(QMatMul::from_qtensor(qtensor(&bytes, n, k, device)?)?);
    }
    println!(
        "one 8B forward's matmuls: {} matrices, {:.2} GB of Q4_0",
        shapes.len(),
        bytes_total as f64 / 1e9
    );
    let variants = MmaShape::all();
    print!("| rows |");
    for v in &variants {
        print!(" {v} |");
    }
    println!(" model's choice | bf16 GEMM | candle | model's GB/s | candle GB/s |");
    println!("|---|{}---|---|---|---|---|", "---|".repeat(variants.len()));
    for m in [1usize, 2, 4, 8, 16, 32, 64, 512] {
        let xs = [4096usize, 14336]
            .map(|k| Tensor::randn(0f32, 1.0, (1, m, k), device))
            .into_iter()
            .collect::<candle_core::Result<Vec<_>>>()?;
        let input = |k: usize| if k == 4096 { &xs[0] } else { &xs[1] };
        let reps = if m <= 16 { 20 } else { 5 };
        // Median ms of `f` over the matrices `which` selects.
        let pass = |which: &dyn Fn(usize) -> bool,
                    f: &dyn Fn(usize, &Tensor) -> candle_core::Result<Tensor>|
         -> Result<f64> {
            let mut t = Vec::new();
            for rep in 0..reps + 2 {
                device.synchronize()?;
                let start = Instant::now();
                for (i, &(_, k)) in shapes.iter().enumerate() {
                    if which(i) {
                        f(i, input(k))?;
                    }
                }
                device.synchronize()?;
                if rep >= 2 {
                    t.push(start.elapsed().as_secs_f64() * 1e3);
                }
            }
            Ok(median(t))
        };
        let all = |_: usize| true;
        let model = |i: usize, x: &Tensor| ours[i].forward(x);
        print!("| {m} |");
        for v in &variants {
            let ms = if m <= 64 {
                pass(&all, &|i, x| ours[i].forward_mma(x, *v))?
            } else {
                f64::NAN
            };
            print!(" {ms:.3} |");
        }
        let a = pass(&all, &model)?;
        let g = if m >= 8 {
            pass(&all, &|i, x| ours[i].forward_gemm(x))?
        } else {
            f64::NAN
        };
        let b = pass(&all, &|i, x| theirs[i].forward(x))?;
        let gbs = |ms: f64| bytes_total as f64 / ms / 1e6;
        println!(
            " {a:.3} | {g:.3} | {b:.3} | {:.0} | {:.0} |",
            gbs(a),
            gbs(b)
        );
        if [1, 8, 16].contains(&m) {
            // Where the time goes: each kind of matrix alone (32 launches, or the output's 1),
            // by the model's choice, candle, and every shape.
            for (label, shape) in [
                ("q|k|v", (6144, 4096)),
                ("o", (4096, 4096)),
                ("gate|up", (28672, 4096)),
                ("down", (4096, 14336)),
                ("output", (128256, 4096)),
            ] {
                let which = |i: usize| shapes[i] == shape;
                let count = shapes.iter().filter(|s| **s == shape).count();
                let bytes = (count * shape.0 * shape.1 / 32 * 18) as f64;
                let ours_ms = pass(&which, &model)?;
                let theirs_ms = pass(&which, &|i, x| theirs[i].forward(x))?;
                let mut each = String::new();
                for v in &variants {
                    let ms = pass(&which, &|i, x| ours[i].forward_mma(x, *v))?;
                    each += &format!(" {}×{}: {ms:.3};", v.tiles, v.warps);
                }
                println!(
                    "  m={m} {label} {}×{} ×{count}: ours {ours_ms:.3} ms ({:.0} GB/s, {:.1} µs a launch), candle {theirs_ms:.3} ms ({:.0} GB/s); tiles×warps:{each}",
                    shape.0,
                    shape.1,
                    bytes / ours_ms / 1e6,
                    ours_ms * 1e3 / count as f64,
                    bytes / theirs_ms / 1e6
                );
            }
        }
    }
    Ok(())
}

/// The forward's matrices: 32 layers of q|k|v, o, gate|up and down, then the output.
fn forward_shapes() -> Vec<(usize, usize)> {
    (0..32)
        .flat_map(|_| [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
        .chain([(128256, 4096)])
        .collect()
}

/// `NAME=V,NAME=V` as a backend: SPLIT_UP_TO=N the host's split, SMALL=TxW the launch shape
/// of matrices of ≤ 4096 rows at one n8 tile, SMALL_WIDE=TxW at more, LARGE=TxW of larger
/// ones ([`MmaShapes`]), the rest `#define` lines.
fn backend_of(variant: &str) -> Result<(CudaWeights, usize)> {
    let mut defines = String::new();
    let mut split = SPLIT_UP_TO;
    let mut shapes = MmaShapes::MODEL;
    let shape = |name: &str, v: &str| -> Result<MmaShape> {
        let (tiles, warps) = v
            .split_once('x')
            .ok_or_else(|| anyhow!("{name}={v}: want TILESxWARPS"))?;
        Ok(MmaShape {
            tiles: tiles.parse()?,
            warps: warps.parse()?,
        })
    };
    for d in variant.split(',').filter(|d| !d.is_empty()) {
        match d.split_once('=') {
            Some(("SPLIT_UP_TO", v)) => split = v.parse()?,
            Some(("SMALL", v)) => shapes.small = shape("SMALL", v)?,
            Some(("SMALL_WIDE", v)) => shapes.small_wide = shape("SMALL_WIDE", v)?,
            Some(("LARGE", v)) => shapes.large = shape("LARGE", v)?,
            Some((name, v)) => defines += &format!("#define {name} {v}\n"),
            None => return Err(anyhow!("variant {variant:?}: {d:?} is not NAME=VALUE")),
        }
    }
    Ok((
        CudaWeights::with_choices(&defines, split).with_shapes(shapes),
        split,
    ))
}

/// Each build choice of weights.cu in `list`: parity through the model's entry point, then
/// time per kind of matrix (µs a launch) and for the whole forward.
fn variants(device: &Device, list: &[String], tally: &mut Tally) -> Result<()> {
    let dev = cuda(device)?;
    let shapes = forward_shapes();
    let mut rng = Rng(13);
    let base = CudaWeights::default();
    let mut mats = Vec::new();
    for &(n, k) in &shapes {
        mats.push(base.q4_0(dev, &q4_0_bytes(n, k, &mut rng), n, k)?);
    }
    let bytes_total: usize = shapes.iter().map(|(n, k)| n * k / 32 * 18).sum();
    // Parity shapes: a ragged grid of 4096 columns, and 1536 (six octets over four warps).
    let checks: Vec<(usize, usize, Vec<u8>)> = [(1008, 4096), (256, 1536)]
        .into_iter()
        .map(|(n, k)| (n, k, q4_0_bytes(n, k, &mut rng)))
        .collect();
    let reference: Vec<Vec<Vec<f64>>> = checks
        .iter()
        .map(|(n, k, b)| (0..*n).map(|j| reference_row(b, *k, j)).collect())
        .collect();
    let rows_list = [1usize, 4, 8, 16, 32];
    let xs = rows_list
        .iter()
        .map(|&m| {
            Ok([
                Tensor::randn(0f32, 1.0, (1, m, 4096), device)?,
                Tensor::randn(0f32, 1.0, (1, m, 14336), device)?,
            ])
        })
        .collect::<Result<Vec<_>>>()?;
    let kinds = [
        (6144, 4096),
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
        (128256, 4096),
    ];
    println!("| variant | rows | q|k|v µs | o µs | gate|up µs | down µs | output µs | forward ms | GB/s |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for variant in list {
        let name = if variant.is_empty() {
            "(as built)"
        } else {
            variant.as_str()
        };
        let (backend, split) = backend_of(variant)?;
        for ((n, k, bytes), rows) in checks.iter().zip(&reference) {
            let ours = backend.q4_0(dev, bytes, *n, *k)?;
            for m in [1usize, 3, 8, 16, 17, 40] {
                let x = inputs(&mut rng, m * k);
                let want = reference_out(rows, &x, *k);
                let xt = Tensor::from_vec(x, (1, m, *k), device)?;
                let got = ours.forward(&xt)?.flatten_all()?.to_vec1::<f32>()?;
                let tol = if m <= split { 1e-6 } else { 1e-3 };
                let same = got.clone();
                check(
                    tally,
                    &format!("{name} {n}×{k} m={m}"),
                    got,
                    &want,
                    &same,
                    tol,
                );
            }
        }
        let bound = mats
            .iter()
            .map(|m| backend.rebind(dev, m))
            .collect::<Result<Vec<_>>>()?;
        for (x, m) in xs.iter().zip(rows_list) {
            let pass = |which: &dyn Fn(usize) -> bool| -> Result<f64> {
                let mut t = Vec::new();
                for rep in 0..22 {
                    device.synchronize()?;
                    let start = Instant::now();
                    for (i, &(_, k)) in shapes.iter().enumerate() {
                        if which(i) {
                            bound[i].forward(&x[usize::from(k != 4096)])?;
                        }
                    }
                    device.synchronize()?;
                    if rep >= 2 {
                        t.push(start.elapsed().as_secs_f64() * 1e3);
                    }
                }
                Ok(median(t))
            };
            let mut row = format!("| {name} | {m} |");
            for shape in kinds {
                let count = shapes.iter().filter(|s| **s == shape).count();
                let ms = pass(&|i| shapes[i] == shape)?;
                row += &format!(" {:.1} |", ms * 1e3 / count as f64);
            }
            let ms = pass(&|_| true)?;
            println!("{row} {ms:.3} | {:.0} |", bytes_total as f64 / ms / 1e6);
        }
    }
    Ok(())
}

/// For a profiler: the output matrix (128256×4096) and a down matrix (4096×14336), one
/// model's-path matmul each at 1 and 8 rows, nothing else launched on our kernels.
fn profile(device: &Device, backend: &CudaWeights) -> Result<()> {
    let mut rng = Rng(17);
    for (n, k) in [(128256, 4096), (4096, 14336)] {
        let m4 = backend.q4_0(cuda(device)?, &q4_0_bytes(n, k, &mut rng), n, k)?;
        for m in [1usize, 8] {
            let x = Tensor::randn(0f32, 1.0, (1, m, k), device)?;
            m4.forward(&x)?;
            device.synchronize()?;
            println!("profile: {n}×{k} at {m} row(s)");
        }
    }
    Ok(())
}

fn run(args: &[String], tally: &mut Tally) -> Result<()> {
    let parts: Vec<&String> = args.iter().filter(|a| !a.starts_with("--")).collect();
    let want = |w: &str| (parts.is_empty() && w != "variants") || parts.iter().any(|a| *a == w);
    let device = Device::new_cuda(0)?;
    let backend = CudaWeights::default();
    if want("parity") {
        if let Err(e) = parity(&device, &backend, tally) {
            tally.stopped("parity", format!("{e:#}"));
        }
    }
    if want("time") {
        time(&device, &backend)?;
    }
    if want("profile") {
        profile(&device, &backend)?;
    }
    if want("variants") {
        // The build as it is, then each --variant= flag, or by default the choices weights.cu
        // lists.
        let flags: Vec<String> = args
            .iter()
            .filter_map(|a| a.strip_prefix("--variant=").map(String::from))
            .collect();
        let defaults = ["MIN_WARPS=0", "B_AHEAD=0", "SPLIT_UP_TO=16"];
        let mut list = vec![String::new()];
        if flags.is_empty() {
            list.extend(defaults.map(String::from));
        } else {
            list.extend(flags);
        }
        variants(&device, &list, tally)?;
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut tally = Tally::new(args.iter().any(|a| a == "--plant-failure"));
    if let Err(e) = run(&args, &mut tally) {
        tally.stopped("weights-bench", format!("{e:#}"));
    }
    // A timing-only run (`time`) has no checks: it passes unless something stopped.
    let timing_only = !args.iter().any(|a| a == "parity" || a == "variants")
        && args.iter().any(|a| a == "time" || a == "profile");
    let passed = if timing_only {
        tally.failed == 0
    } else {
        tally.finish("weights-bench")
    };
    std::process::exit(i32::from(!passed));
}
