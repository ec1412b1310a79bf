//! Parity of the CUDA KV backend against the CPU cache, run on the device:
//! `kv-cache-parity [--plant-failure]`. Every comparison counts: the last line is
//! "kv-cache-parity: N passed, M failed", and the exit status is 1 on any failure (a part
//! that stops with an error counts as one failed check and the others still run).
//! `--plant-failure` perturbs one GPU output (the first cache read's) before it is
//! compared, to show that a miss is reported and fails the run.
//! - planes: the device planes (the CUDA backend) against tessera-kv's host planes of the
//!   same codec, through the same `Planes` calls: bf16, affine 4 and 8 bits with groups
//!   32, 64 and 128 (head dims 128 and 256), TurboQuant of widths 2..8 with and without the
//!   key preparation (fitted per row on each row's live slots). Writes across a capacity
//!   growth, a write into one row, reads of a row range, `state` bytes, `empty` +
//!   `adopt_row` + `copy_from`, `restore` of the host's state: equal bit for bit.
//! - cache: the same appends into a `KvCache` on the CPU and one on the GPU, for bf16,
//!   affine:4 and affine:8 with conversion at 0 and mid-way, and turbo: full and
//!   sliding-window layers, head dims 128 and 256, 2 rows one of them left-padded; prefill
//!   chunks, decode steps (the fused decode kernel), a ring that wraps, a second chunk after
//!   conversion. Every read's output is compared with the CPU read's (which the CPU tests
//!   hold to an f32 reference): ‖gpu − cpu‖ / ‖cpu‖ under 1e-4 for bf16 (q and p enter the
//!   tensor cores as two bf16 parts) and turbo rows read on CUDA cores (f32, the same stored
//!   codes), 2e-3 for affine and 4-bit turbo rows (f16 tensor-core operands).
//! - row ops: the cache's row operations (merge, extend, filter, retain, extract, align, speculative
//!   rounds rolled back per row and committed, state → from_state) in one sequence on both
//!   caches (see `row_ops_parity`): reads within the same tolerances, `state` bit for bit.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::ops::Range;
use tessera_kernels::tally::Tally;
use tessera_kv::planes::device::host_planes;
use tessera_kv::planes::{DeviceBackend, PlaneGeometry, Planes, PlanesState};
use tessera_kv::{
    AttentionCache, CacheState, Codec, KvCache, KvError, KvScheme, LayerSpec, PlainDType,
    Retention, TurboPrep,
};

fn random(shape: &[usize], seed: u64, device: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<f32> = (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            // A few outlier channels, as real keys have.
            if i % 61 == 0 {
                u * 8.0
            } else {
                u
            }
        })
        .collect();
    Ok(Tensor::from_vec(v, shape, device)?)
}

fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a: Vec<f32> = a.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
    let b: Vec<f32> = b.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
    if a.len() != b.len() {
        bail!("lengths differ: {} vs {}", a.len(), b.len());
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(&b) {
        if !x.is_finite() {
            return Ok(f64::INFINITY);
        }
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    Ok((num / den.max(1e-30)).sqrt())
}

fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    let f = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()?)
    };
    let (a, b) = (f(a)?, f(b)?);
    Ok(a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()))
}

/// Where two planes states differ, or `None` when they are equal bit for bit.
fn state_diff(cpu: &PlanesState, gpu: &PlanesState) -> Option<String> {
    if cpu.codec != gpu.codec || cpu.geometry != gpu.geometry || cpu.capacity != gpu.capacity {
        return Some(format!(
            "cpu {} {:?} capacity {} vs gpu {} {:?} capacity {}",
            cpu.codec, cpu.geometry, cpu.capacity, gpu.codec, gpu.geometry, gpu.capacity
        ));
    }
    if cpu.buffers.len() != gpu.buffers.len() {
        return Some(format!(
            "{} buffers on the cpu, {} on the gpu",
            cpu.buffers.len(),
            gpu.buffers.len()
        ));
    }
    for (i, (c, g)) in cpu.buffers.iter().zip(&gpu.buffers).enumerate() {
        if c.len() != g.len() {
            return Some(format!(
                "buffer {i}: {} bytes on the cpu, {} on the gpu",
                c.len(),
                g.len()
            ));
        }
        if let Some(at) = c.iter().zip(g).position(|(x, y)| x != y) {
            let differ = c.iter().zip(g).filter(|(x, y)| x != y).count();
            return Some(format!(
                "buffer {i} ({} bytes): {differ} bytes differ, the first at byte {at} (cpu {:#04x}, gpu {:#04x})",
                c.len(),
                c[at],
                g[at]
            ));
        }
    }
    None
}

/// One planes check: `ok`, or the reason printed, counted either way.
fn check(tally: &mut Tally, what: &str, diff: Option<String>) {
    match &diff {
        None => println!("{what}: ok"),
        Some(why) => println!("{what}: MISMATCH: {why}"),
    }
    tally.record(diff.is_none());
}

/// Both reads equal bit for bit, as a `check` diff.
fn read_diff(cpu: (Tensor, Tensor), gpu: (Tensor, Tensor)) -> Result<Option<String>> {
    if same_bits(&cpu.0, &gpu.0)? && same_bits(&cpu.1, &gpu.1)? {
        return Ok(None);
    }
    let k = rel_err(
        &gpu.0.to_device(&Device::Cpu)?,
        &cpu.0.to_dtype(DType::F32)?,
    );
    let v = rel_err(
        &gpu.1.to_device(&Device::Cpu)?,
        &cpu.1.to_dtype(DType::F32)?,
    );
    Ok(Some(format!(
        "reads differ (keys rel err {:.2e}, values {:.2e})",
        k.unwrap_or(f64::NAN),
        v.unwrap_or(f64::NAN)
    )))
}

/// The planes of one codec on the host (tessera-kv's own) and on the device (the CUDA
/// backend), driven through the same `Planes` calls.
struct PlanesPair {
    cpu: Box<dyn Planes>,
    gpu: Box<dyn Planes>,
}

impl PlanesPair {
    fn write(
        &mut self,
        rows: Range<usize>,
        slot: usize,
        k: &Tensor,
        v: &Tensor,
        dev: &Device,
    ) -> Result<()> {
        self.cpu.write(rows.clone(), slot, k, v)?;
        self.gpu
            .write(rows, slot, &k.to_device(dev)?, &v.to_device(dev)?)?;
        Ok(())
    }

    fn reserve(&mut self, slots: usize) -> Result<()> {
        self.cpu.reserve(slots, usize::MAX)?;
        self.gpu.reserve(slots, usize::MAX)?;
        Ok(())
    }

    fn read_diff(&self, rows: Range<usize>, slot: usize, len: usize) -> Result<Option<String>> {
        read_diff(
            self.cpu.read(rows.clone(), slot, len)?,
            self.gpu.read(rows, slot, len)?,
        )
    }

    fn state_diff(&self) -> Result<Option<String>> {
        Ok(state_diff(&self.cpu.state()?, &self.gpu.state()?))
    }
}

/// Every row operation of the planes on the device against tessera-kv's host planes of the
/// same codec: encode (two writes across a capacity growth, then a write into one row
/// only), read back, `state` bytes, `empty` + `copy_from` + `adopt_row` into another row,
/// `restore` of the host's state into device planes. Reads and states must be equal bit for
/// bit (the kernels use the CPU's arithmetic, step for step).
fn planes_parity(gpu: &Device, tally: &mut Tally) -> Result<()> {
    let backend = tessera_kernels::backend::CudaBackend::new();
    let none = TurboPrep {
        key_mean: false,
        key_scale: false,
        pairs: false,
    };
    let scale_only = TurboPrep {
        key_mean: false,
        key_scale: true,
        pairs: false,
    };
    let mut cases: Vec<(Codec, usize)> = vec![(Codec::Plain(PlainDType::Bf16), 128)];
    for (bits, group) in [(4u8, 32u16), (4, 64), (4, 128), (8, 32), (8, 64), (8, 128)] {
        for d in [128usize, 256] {
            cases.push((Codec::Affine { bits, group }, d));
        }
    }
    for (kbits, vbits, d, prep) in [
        (4u8, 4u8, 128usize, TurboPrep::ALL),
        (4, 4, 128, none),
        (3, 5, 128, TurboPrep::ALL),
        (2, 8, 256, scale_only),
        (7, 6, 64, none),
        (4, 2, 256, TurboPrep::ALL),
    ] {
        cases.push((Codec::Turbo { kbits, vbits, prep }, d));
    }
    for (case, (codec, d)) in cases.into_iter().enumerate() {
        let name = format!("planes {codec} d={d}");
        if let Err(e) = planes_case(&backend, gpu, tally, codec, d, case as u64, &name) {
            tally.stopped(&name, format!("{e:#}"));
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn planes_case(
    backend: &tessera_kernels::backend::CudaBackend,
    gpu: &Device,
    tally: &mut Tally,
    codec: Codec,
    d: usize,
    case: u64,
    name: &str,
) -> Result<()> {
    let (b, h, n) = (3, 2, 37);
    let geo = PlaneGeometry {
        rows: b,
        heads: h,
        head_dim: d,
        value_dim: d,
    };
    let seed = 100 * case;
    let k = random(&[b, h, n, d], seed + 1, &Device::Cpu)?;
    let v = random(&[b, h, n, d], seed + 2, &Device::Cpu)?;
    let mut p = PlanesPair {
        cpu: host_planes(codec, geo),
        gpu: backend
            .planes(codec, geo, gpu)?
            .ok_or_else(|| anyhow!("the CUDA backend does not serve {codec}"))?,
    };
    if let Codec::Turbo { prep, .. } = codec {
        // Each row fitted on its own live slots: row 1 as if left-padded by 4.
        let live = [0..n, 4..n, 0..n - 5];
        p.cpu.fit_key_prep(&k, &live, prep, None)?;
        p.gpu.fit_key_prep(&k.to_device(gpu)?, &live, prep, None)?;
    }
    // Two writes across a capacity growth (the copy kernel keeps the first).
    p.reserve(5 + 20)?;
    p.write(0..b, 5, &k.narrow(2, 0, 20)?, &v.narrow(2, 0, 20)?, gpu)?;
    p.reserve(5 + n + 300)?;
    p.write(
        0..b,
        25,
        &k.narrow(2, 20, n - 20)?,
        &v.narrow(2, 20, n - 20)?,
        gpu,
    )?;
    check(
        tally,
        &format!("{name}: encode, read back"),
        p.read_diff(0..b, 5, n)?,
    );
    // One row only, then a read of rows 1..3.
    let k1 = random(&[1, h, 9, d], seed + 3, &Device::Cpu)?;
    let v1 = random(&[1, h, 9, d], seed + 4, &Device::Cpu)?;
    p.write(1..2, 50, &k1, &v1, gpu)?;
    check(
        tally,
        &format!("{name}: write row 1, read rows 1..3"),
        p.read_diff(1..3, 45, 20)?,
    );
    check(tally, &format!("{name}: state bytes"), p.state_diff()?);
    // Empty planes of 2 rows: row 1 of the source copied into row 0 at another slot, with
    // its key preparation adopted (turbo).
    let mut e = PlanesPair {
        cpu: p.cpu.empty(2)?,
        gpu: p.gpu.empty(2)?,
    };
    e.reserve(64)?;
    e.cpu.adopt_row(p.cpu.as_ref(), 1, 0)?;
    e.gpu.adopt_row(p.gpu.as_ref(), 1, 0)?;
    e.cpu.copy_from(p.cpu.as_ref(), 1, 5, 0, 3, n)?;
    e.gpu.copy_from(p.gpu.as_ref(), 1, 5, 0, 3, n)?;
    // And a write into row 1 of the copy (its own, unfitted preparation).
    e.write(1..2, 0, &k1, &v1, gpu)?;
    check(
        tally,
        &format!("{name}: empty + adopt_row + copy_from"),
        e.read_diff(0..2, 0, 40)?,
    );
    check(
        tally,
        &format!("{name}: empty + copy_from state bytes"),
        e.state_diff()?,
    );
    // Row 0 written after the adoption: encoded with the adopted preparation.
    e.write(0..1, 45, &k1, &v1, gpu)?;
    check(
        tally,
        &format!("{name}: write after adopt_row"),
        e.read_diff(0..1, 45, 9)?,
    );
    // A copy from other-type planes is refused.
    let refused = p.gpu.copy_from(p.cpu.as_ref(), 0, 0, 0, 0, 1).is_err();
    check(
        tally,
        &format!("{name}: copy_from host planes refused"),
        (!refused).then(|| "accepted".to_string()),
    );
    // The host's state restored into fresh device planes: the same state and reads.
    let state = p.cpu.state()?;
    let mut r = backend.planes(codec, geo, gpu)?.expect("served above");
    r.restore(&state)?;
    check(
        tally,
        &format!("{name}: restore host state"),
        state_diff(&state, &r.state()?),
    );
    check(
        tally,
        &format!("{name}: read after restore"),
        read_diff(p.cpu.read(0..b, 0, n + 20)?, r.read(0..b, 0, n + 20)?)?,
    );
    Ok(())
}

/// The read tolerance of a codec: ‖gpu − cpu‖ / ‖cpu‖. bf16 reads split q and p into two
/// bf16 parts (≈16 bits); affine reads and 4-bit turbo reads feed the tensor cores f16 (11
/// bits); other turbo widths read on CUDA cores in f32 (≈ 1e-6).
fn tolerance(codec: Codec) -> f64 {
    match codec {
        Codec::Plain(_) => 1e-4,
        Codec::Turbo {
            kbits: 4, vbits: 4, ..
        } => 2e-3,
        Codec::Turbo { .. } => 1e-4,
        _ => 2e-3,
    }
}

fn cache_parity(gpu: &Device, tally: &mut Tally) -> Result<()> {
    let specs = [
        LayerSpec {
            kv_heads: 2,
            head_dim: 128,
            value_dim: 128,
            retention: Retention::Full,
        },
        LayerSpec {
            kv_heads: 2,
            head_dim: 128,
            value_dim: 128,
            retention: Retention::Window { size: 64 },
        },
        LayerSpec {
            kv_heads: 1,
            head_dim: 256,
            value_dim: 256,
            retention: Retention::Full,
        },
        LayerSpec {
            kv_heads: 1,
            head_dim: 256,
            value_dim: 256,
            retention: Retention::Window { size: 64 },
        },
    ];
    let groups = [4usize, 2, 4, 4]; // query heads per KV head
                                    // (appended positions, 1 = a decode step), in order.
    let steps: Vec<usize> = [vec![50], vec![1; 30], vec![20], vec![1; 40]].concat();
    for codec in [
        Codec::Plain(PlainDType::Bf16),
        Codec::Affine { bits: 4, group: 64 },
        Codec::Affine { bits: 8, group: 64 },
        Codec::Affine { bits: 4, group: 32 },
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
        Codec::Turbo {
            kbits: 3,
            vbits: 6,
            prep: TurboPrep {
                key_mean: false,
                key_scale: true,
                pairs: false,
            },
        },
    ] {
        for start in [0usize, 60] {
            if start > 0 && matches!(codec, Codec::Plain(_)) {
                continue;
            }
            let scheme = KvScheme {
                quantized_kv_start: start,
                ..KvScheme::uniform(codec)
            };
            let pads = vec![0, 7];
            let mut cpu = KvCache::new(&specs, &scheme, pads.clone())?;
            let mut dev = KvCache::new(&specs, &scheme, pads)?;
            let mut worst = [0f64; 2]; // decode, chunk
            let mut seed = 1000;
            for &n in &steps {
                for (l, spec) in specs.iter().enumerate() {
                    seed += 1;
                    let (h, d) = (spec.kv_heads, spec.head_dim);
                    let k = random(&[2, h, n, d], seed, &Device::Cpu)?;
                    let v = random(&[2, h, n, d], seed + 7, &Device::Cpu)?;
                    let q = random(&[2, h * groups[l], n, d], seed + 13, &Device::Cpu)?;
                    let scale = 1.0 / (d as f32).sqrt();
                    let want = cpu.layer_mut(l).append_window(&k, &v)?.attend(&q, scale)?;
                    let read = dev
                        .layer_mut(l)
                        .append_window(&k.to_device(gpu)?, &v.to_device(gpu)?)?;
                    let mut got = read.attend(&q.to_device(gpu)?, scale)?;
                    if tally.take_plant() {
                        // One element off by 1 (the outputs are averages of values in
                        // [-8, 8]): every tolerance here must catch it.
                        let mut v: Vec<f32> = got
                            .to_dtype(DType::F32)?
                            .to_device(&Device::Cpu)?
                            .flatten_all()?
                            .to_vec1()?;
                        v[0] += 1.0;
                        println!("planted failure: first output of cache {codec} start {start} layer {l} off by 1");
                        got = Tensor::from_vec(v, got.dims(), gpu)?.to_dtype(got.dtype())?;
                    }
                    let err = rel_err(&got.to_device(&Device::Cpu)?, &want)?;
                    let w = &mut worst[usize::from(n > 1)];
                    *w = w.max(err);
                }
            }
            let tolerance = tolerance(codec);
            let ok = worst.iter().all(|&e| e < tolerance);
            println!(
                "cache {codec} start {start}: worst rel err decode {:.2e}, chunk {:.2e} (tolerance {tolerance:.0e}): {}",
                worst[0],
                worst[1],
                if ok { "ok" } else { "FAIL" }
            );
            tally.record(ok);
            // The device keeps a turbo row's f16 norm in a 32-bit word: 2 bytes more per
            // stored vector (keys and values, 2 rows).
            let padding: usize = match codec {
                Codec::Turbo { .. } => specs.iter().map(|s| 2 * 2 * 2 * s.kv_heads).sum(),
                _ => 0,
            };
            let same_size = cpu.bytes_per_token() + padding == dev.bytes_per_token();
            if !same_size {
                println!(
                    "cache {codec} start {start}: bytes/token differ: cpu {} gpu {}: FAIL",
                    cpu.bytes_per_token(),
                    dev.bytes_per_token()
                );
            }
            tally.record(same_size);
        }
    }
    // An unsupported codec is refused on first use with its name.
    let scheme = KvScheme::parse("affine:2")?;
    let mut dev = KvCache::new(&specs[..1], &scheme, vec![0])?;
    let k = random(&[1, 2, 3, 128], 1, gpu)?;
    match dev.layer_mut(0).append_window(&k, &k) {
        Err(e) => {
            println!("affine:2 on cuda refused: {e}");
            tally.record(true);
        }
        Ok(_) => {
            println!("affine:2 on cuda was accepted: FAIL");
            tally.record(false);
        }
    }
    Ok(())
}

/// The same cache on the CPU (tessera-kv's host planes) and on the GPU (the CUDA backend),
/// driven through the same calls.
struct CachePair {
    cpu: KvCache,
    gpu: KvCache,
}

/// What a row-operations run compares: the worst read error of each kind, and the checks.
struct RowRun<'a> {
    dev: &'a Device,
    specs: &'a [LayerSpec],
    groups: &'a [usize],
    seed: u64,
    /// Worst rel err of decode reads (one position) and chunk reads.
    worst: [f64; 2],
    /// Reads compared.
    reads: usize,
    /// The codec's read tolerance (reads over it are printed as they happen).
    tol: f64,
    /// (what, why) of each state comparison that differed, and how many were compared.
    state_misses: Vec<String>,
    states: usize,
}

impl CachePair {
    fn new(specs: &[LayerSpec], scheme: &KvScheme, pads: Vec<usize>) -> Result<Self> {
        Ok(CachePair {
            cpu: KvCache::new(specs, scheme, pads.clone())?.with_round_slack(8),
            gpu: KvCache::new(specs, scheme, pads)?.with_round_slack(8),
        })
    }

    /// `f` on both caches (an error names the side).
    fn both(&mut self, what: &str, f: impl Fn(&mut KvCache) -> Result<(), KvError>) -> Result<()> {
        f(&mut self.cpu).with_context(|| format!("{what} on the CPU cache"))?;
        f(&mut self.gpu).with_context(|| format!("{what} on the GPU cache"))?;
        if self.cpu.offsets() != self.gpu.offsets() || self.cpu.left_pad() != self.gpu.left_pad() {
            bail!(
                "after {what}: rows differ: cpu offsets {:?} pads {:?}, gpu offsets {:?} pads {:?}",
                self.cpu.offsets(),
                self.cpu.left_pad(),
                self.gpu.offsets(),
                self.gpu.left_pad()
            );
        }
        Ok(())
    }

    fn merge(parts: Vec<CachePair>) -> Result<Self> {
        let (cpu, gpu): (Vec<_>, Vec<_>) = parts.into_iter().map(|p| (p.cpu, p.gpu)).unzip();
        Ok(CachePair {
            cpu: KvCache::merge(cpu).context("merge on the CPU")?,
            gpu: KvCache::merge(gpu).context("merge on the GPU")?,
        })
    }

    fn extend(&mut self, other: CachePair) -> Result<()> {
        self.cpu.extend(other.cpu).context("extend on the CPU")?;
        self.gpu.extend(other.gpu).context("extend on the GPU")?;
        Ok(())
    }

    fn extract(&self, row: usize) -> Result<Self> {
        Ok(CachePair {
            cpu: self.cpu.extract(row).context("extract on the CPU")?,
            gpu: self.gpu.extract(row).context("extract on the GPU")?,
        })
    }

    fn rows(&self) -> usize {
        self.cpu.left_pad().len()
    }
}

impl RowRun<'_> {
    /// Appends `n` positions to every row of every layer of both caches (`n == 1`: a decode
    /// step) and compares the reads.
    fn append(
        &mut self,
        pair: &mut CachePair,
        n: usize,
        tally: &mut Tally,
        what: &str,
    ) -> Result<()> {
        let b = pair.rows();
        for (l, spec) in self.specs.iter().enumerate() {
            self.seed += 1;
            let (h, d, seed) = (spec.kv_heads, spec.head_dim, self.seed * 31);
            let k = random(&[b, h, n, d], seed, &Device::Cpu)?;
            let v = random(&[b, h, n, d], seed + 7, &Device::Cpu)?;
            let q = random(&[b, h * self.groups[l], n, d], seed + 13, &Device::Cpu)?;
            let scale = 1.0 / (d as f32).sqrt();
            let (kg, vg, qg) = (
                k.to_device(self.dev)?,
                v.to_device(self.dev)?,
                q.to_device(self.dev)?,
            );
            let (want, mut got) = if n == 1 {
                (
                    pair.cpu
                        .layer_mut(l)
                        .append_decode(&k, &v)?
                        .attend(&q, scale)?,
                    pair.gpu
                        .layer_mut(l)
                        .append_decode(&kg, &vg)?
                        .attend(&qg, scale)?,
                )
            } else {
                (
                    pair.cpu
                        .layer_mut(l)
                        .append_window(&k, &v)?
                        .attend(&q, scale)?,
                    pair.gpu
                        .layer_mut(l)
                        .append_window(&kg, &vg)?
                        .attend(&qg, scale)?,
                )
            };
            if tally.take_plant() {
                got = planted(&got, &format!("row ops {what} layer {l}"))?;
            }
            let err = rel_err(&got.to_device(&Device::Cpu)?, &want)
                .with_context(|| format!("{what}: layer {l} read shapes"))?;
            if err.is_nan() || err >= self.tol {
                println!(
                    "  {what}: layer {l} ({n} positions): rel err {err:.2e} over {:.0e}",
                    self.tol
                );
            }
            let w = &mut self.worst[usize::from(n > 1)];
            *w = if err.is_nan() {
                f64::INFINITY
            } else {
                w.max(err)
            };
            self.reads += 1;
        }
        Ok(())
    }

    fn decode_steps(
        &mut self,
        pair: &mut CachePair,
        steps: usize,
        tally: &mut Tally,
        what: &str,
    ) -> Result<()> {
        for _ in 0..steps {
            self.append(pair, 1, tally, what)?;
        }
        Ok(())
    }

    /// Compares every layer's planes state of the two caches bit for bit.
    fn states(&mut self, pair: &CachePair, what: &str) -> Result<(CacheState, CacheState)> {
        let cpu = pair.cpu.state().context("state of the CPU cache")?;
        let gpu = pair.gpu.state().context("state of the GPU cache")?;
        self.compare_states(&cpu, &gpu, what);
        Ok((cpu, gpu))
    }

    fn compare_states(&mut self, cpu: &CacheState, gpu: &CacheState, what: &str) {
        self.states += 1;
        if cpu.layers.len() != gpu.layers.len() {
            self.state_misses.push(format!(
                "{what}: {} layers vs {}",
                cpu.layers.len(),
                gpu.layers.len()
            ));
            return;
        }
        for (l, (c, g)) in cpu.layers.iter().zip(&gpu.layers).enumerate() {
            if let Some(why) = state_diff(&c.planes, &g.planes) {
                self.state_misses.push(format!("{what}: layer {l}: {why}"));
            }
        }
    }
}

/// `got` with its first element off by 1 (the outputs are averages of values in [-8, 8]:
/// every tolerance here must catch it).
fn planted(got: &Tensor, what: &str) -> Result<Tensor> {
    let mut v: Vec<f32> = got
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1()?;
    v[0] += 1.0;
    println!("planted failure: first output of {what} off by 1");
    Ok(Tensor::from_vec(v, got.dims(), got.device())?.to_dtype(got.dtype())?)
}

/// The cache's row operations on the GPU against the CPU: the same sequence on both —
/// prefill chunks and decode steps on 3 left-padded rows, `merge` with a 1-row cache,
/// `extend` with a 2-row one, `filter`, `retain` and `extend` in place (rows left and
/// joining where they lie, growing past the planes' room), `extract`, `align`, a speculative round rolled
/// back to a different length per row and one committed, with the sliding-window layer's
/// ring wrapped well past its size, then `state` → `from_state` (each side its own, and the
/// CPU's state restored on the GPU) — for bf16, affine 4:64 and 8:32, and turbo 4/4 with
/// and without the key preparation, conversion after 24 positions. Every read is compared
/// within the codec's tolerance, and every `state` bit for bit.
fn row_ops_parity(gpu: &Device, tally: &mut Tally) -> Result<()> {
    let specs = [
        LayerSpec {
            kv_heads: 2,
            head_dim: 128,
            value_dim: 128,
            retention: Retention::Full,
        },
        LayerSpec {
            kv_heads: 2,
            head_dim: 128,
            value_dim: 128,
            retention: Retention::Window { size: 48 },
        },
    ];
    let groups = [2usize, 4];
    let none = TurboPrep {
        key_mean: false,
        key_scale: false,
        pairs: false,
    };
    for codec in [
        Codec::Plain(PlainDType::Bf16),
        Codec::Affine { bits: 4, group: 64 },
        Codec::Affine { bits: 8, group: 32 },
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: TurboPrep::ALL,
        },
        Codec::Turbo {
            kbits: 4,
            vbits: 4,
            prep: none,
        },
    ] {
        let scheme = KvScheme {
            quantized_kv_start: if matches!(codec, Codec::Plain(_)) {
                0
            } else {
                24
            },
            ..KvScheme::uniform(codec)
        };
        let mut run = RowRun {
            dev: gpu,
            specs: &specs,
            groups: &groups,
            seed: 5000,
            worst: [0.0; 2],
            reads: 0,
            tol: tolerance(codec),
            state_misses: Vec::new(),
            states: 0,
        };
        let name = format!("row ops {codec}");
        let mut step = String::new();
        let outcome = row_ops_sequence(&mut run, &specs, &scheme, tally, &mut step);
        let tol = tolerance(codec);
        let reads_ok = run.worst.iter().all(|&e| e < tol);
        println!(
            "{name}: {} reads, worst rel err decode {:.2e}, chunk {:.2e} (tolerance {tol:.0e}): {}",
            run.reads,
            run.worst[0],
            run.worst[1],
            if reads_ok { "ok" } else { "FAIL" }
        );
        tally.record(reads_ok && run.reads > 0);
        for miss in &run.state_misses {
            println!("{name}: state MISMATCH at {miss}");
        }
        println!(
            "{name}: {} state comparisons, {} differ: {}",
            run.states,
            run.state_misses.len(),
            if run.state_misses.is_empty() {
                "ok"
            } else {
                "FAIL"
            }
        );
        tally.record(run.state_misses.is_empty() && run.states > 0);
        if let Err(e) = outcome {
            println!("{name}: stopped at step \"{step}\" with an error: {e:#}: FAIL");
            tally.record(false);
        }
    }
    Ok(())
}

fn row_ops_sequence(
    run: &mut RowRun,
    specs: &[LayerSpec],
    scheme: &KvScheme,
    tally: &mut Tally,
    step: &mut String,
) -> Result<()> {
    let mut at = |s: &str| {
        *step = s.to_string();
    };
    at("a: 3 rows padded [0, 6, 3]: prefill 20, 8 decode steps (converts at 24)");
    let mut a = CachePair::new(specs, scheme, vec![0, 6, 3])?;
    run.append(&mut a, 20, tally, "a prefill")?;
    run.decode_steps(&mut a, 8, tally, "a decode")?;
    run.states(&a, "a after decode")?;
    at("b: 1 row: prefill 17, 3 decode steps");
    let mut b = CachePair::new(specs, scheme, vec![0])?;
    run.append(&mut b, 17, tally, "b prefill")?;
    run.decode_steps(&mut b, 3, tally, "b decode")?;
    at("merge [a, b]");
    let mut m = CachePair::merge(vec![a, b])?;
    run.states(&m, "merge")?;
    run.decode_steps(&mut m, 6, tally, "after merge")?;
    at("extend with c: 2 rows padded [2, 0], prefill 9, 2 decode steps");
    let mut c = CachePair::new(specs, scheme, vec![2, 0])?;
    run.append(&mut c, 9, tally, "c prefill")?;
    run.decode_steps(&mut c, 2, tally, "c decode")?;
    m.extend(c)?;
    run.states(&m, "extend")?;
    run.decode_steps(&mut m, 4, tally, "after extend")?;
    run.append(&mut m, 5, tally, "chunk after extend")?;
    at("filter [0, 2, 3, 4]");
    m.both("filter", |x| x.filter(&[0, 2, 3, 4]))?;
    run.states(&m, "filter")?;
    run.decode_steps(&mut m, 3, tally, "after filter")?;
    at("retain [0, 3, 2] (row 1's place given to the last row, in place)");
    m.both("retain", |x| x.retain(&[0, 3, 2]))?;
    run.states(&m, "retain")?;
    run.decode_steps(&mut m, 2, tally, "after retain")?;
    at("extend with d, e, f: 1, 2 and 1 rows, prefill 7 each (rows outgrow the planes' room)");
    for (name, pads) in [("d", vec![1]), ("e", vec![0, 3]), ("f", vec![2])] {
        let mut d = CachePair::new(specs, scheme, pads)?;
        run.append(&mut d, 7, tally, &format!("{name} prefill"))?;
        m.extend(d)?;
        run.states(&m, &format!("extend with {name}"))?;
        run.decode_steps(&mut m, 2, tally, &format!("after extend with {name}"))?;
    }
    at("retain [0, 6, 2, 5, 4] (rows 1 and 3 leave, in place)");
    m.both("retain", |x| x.retain(&[0, 6, 2, 5, 4]))?;
    run.states(&m, "second retain")?;
    run.decode_steps(&mut m, 2, tally, "after second retain")?;
    at("extract row 1");
    let mut x = m.extract(1)?;
    run.states(&x, "extract")?;
    run.decode_steps(&mut x, 3, tally, "extracted row")?;
    at("align (every row to the longest row's end)");
    let (offsets, pads) = (m.cpu.offsets(), m.cpu.left_pad().to_vec());
    let end = offsets
        .iter()
        .zip(&pads)
        .map(|(o, p)| o + p)
        .max()
        .unwrap_or(0);
    let aligned: Vec<usize> = offsets.iter().map(|o| end - o).collect();
    m.both("align", |x| x.align(&aligned))?;
    run.states(&m, "align")?;
    run.append(&mut m, 6, tally, "chunk after align")?;
    at("30 decode steps (the ring of 48 wraps)");
    run.decode_steps(&mut m, 30, tally, "ring past its wrap")?;
    run.states(&m, "ring wrapped")?;
    at("round 1: begin, 4 decode steps, rollback keeping 0, 2, 4, 1, 0 … per row");
    m.both("round_begin", |x| x.round_begin())?;
    run.decode_steps(&mut m, 4, tally, "round 1")?;
    let kept: Vec<usize> = (0..m.rows()).map(|r| [0, 2, 4, 1][r % 4]).collect();
    m.both("round_rollback", |x| x.round_rollback(&kept))?;
    run.states(&m, "rollback")?;
    run.decode_steps(&mut m, 2, tally, "after rollback")?;
    at("round 2: begin, 3 decode steps, commit");
    m.both("round_begin", |x| x.round_begin())?;
    run.decode_steps(&mut m, 3, tally, "round 2")?;
    m.both("round_commit", |x| x.round_commit())?;
    run.decode_steps(&mut m, 2, tally, "after commit")?;
    at("state -> from_state");
    let (cs, gs) = run.states(&m, "before from_state")?;
    let mut r = CachePair {
        cpu: KvCache::from_state(&cs, &Device::Cpu).context("from_state on the CPU")?,
        gpu: KvCache::from_state(&gs, run.dev).context("from_state on the GPU")?,
    };
    run.states(&r, "from_state (each its own)")?;
    let cross = KvCache::from_state(&cs, run.dev).context("the CPU state on the GPU")?;
    let cross = cross
        .state()
        .context("state of the CPU state restored on the GPU")?;
    run.compare_states(&cs, &cross, "CPU state restored on the GPU");
    run.decode_steps(&mut r, 3, tally, "after from_state")?;
    run.append(&mut r, 4, tally, "chunk after from_state")?;
    run.states(&r, "end")?;
    at("done");
    Ok(())
}

fn main() {
    let mut plant = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--plant-failure" => plant = true,
            _ => {
                eprintln!("kv-cache-parity: unknown argument {arg:?} (usage: kv-cache-parity [--plant-failure])");
                std::process::exit(2);
            }
        }
    }
    let mut tally = Tally::new(plant);
    tessera_kernels::backend::install();
    let gpu = match Device::new_cuda(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("kv-cache-parity: no CUDA device: {e}");
            println!("kv-cache-parity: 0 passed, 1 failed");
            std::process::exit(1);
        }
    };
    type Part = fn(&Device, &mut Tally) -> Result<()>;
    let parts: [(&str, Part); 3] = [
        ("planes", planes_parity),
        ("cache", cache_parity),
        ("row ops", row_ops_parity),
    ];
    for (name, part) in parts {
        // A part that stops on an error is one failed check; the other parts still run.
        if let Err(e) = part(&gpu, &mut tally) {
            tally.stopped(&format!("{name} parity"), format!("{e:#}"));
        }
    }
    if !tally.finish("kv-cache-parity") {
        std::process::exit(1);
    }
}
