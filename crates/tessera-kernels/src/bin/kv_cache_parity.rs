//! Parity of the CUDA KV backend against the CPU cache, run on the device:
//! `kv-cache-parity [--plant-failure]`. Every comparison counts: the last line is
//! "kv-cache-parity: N passed, M failed", and the exit status is 1 on any failure (a part
//! that stops with an error counts as one failed check and the others still run).
//! `--plant-failure` perturbs one GPU output (the first cache read's) before it is
//! compared, to show that a miss is reported and fails the run.
//! - encode: random rows written into the device planes (encode kernel) and into
//!   tessera-kv's CPU `AffinePlanes`, read back (decode kernel / CPU read): equal bit for
//!   bit, for affine 4 and 8 bits with groups 32, 64 and 128; the same for TurboQuant rows
//!   (its key preparation fitted on the same keys) against `TurboPlanes`, widths 2..8.
//! - cache: the same appends into a `KvCache` on the CPU and one on the GPU, for bf16,
//!   affine:4 and affine:8 with conversion at 0 and mid-way: full and sliding-window layers,
//!   head dims 128 and 256, 2 rows one of them left-padded; prefill chunks, decode steps (the
//!   fused decode kernel), a ring that wraps, a second chunk after conversion. Every read's
//!   output is compared with the CPU read's (which the CPU tests hold to an f32 reference):
//!   ‖gpu − cpu‖ / ‖cpu‖ under 1e-4 for bf16 (q and p enter the tensor cores as two bf16
//!   parts) and turbo rows read on CUDA cores (f32, the same stored codes), 2e-3 for affine
//!   and 4-bit turbo rows (f16 tensor-core operands).

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use tessera_kv::affine_planes::AffinePlanes;
use tessera_kv::device::{DeviceBackend, DevicePlanes, PlaneGeometry};
use tessera_kv::turbo_planes::TurboPlanes;
use tessera_kv::{
    AttentionCache, Codec, KvCache, KvScheme, LayerSpec, PlainDType, Retention, TurboPrep,
};

/// Every comparison's outcome.
#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
    /// `--plant-failure`: perturb the next compared cache read (then cleared).
    plant: bool,
}

impl Tally {
    fn record(&mut self, ok: bool) {
        if ok {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
    }
}

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

fn encode_parity(gpu: &Device, tally: &mut Tally) -> Result<()> {
    let backend = tessera_kernels::backend::CudaBackend::new();
    for (bits, group) in [(4u8, 32u16), (4, 64), (4, 128), (8, 64), (8, 128)] {
        for d in [128usize, 256] {
            let (b, h, n) = (2, 3, 37);
            let geo = PlaneGeometry {
                rows: b,
                heads: h,
                head_dim: d,
                value_dim: d,
            };
            let codec = Codec::Affine { bits, group };
            let k = random(&[b, h, n, d], 11 + d as u64, &Device::Cpu)?;
            let v = random(&[b, h, n, d], 12 + bits as u64, &Device::Cpu)?;
            let mut cpu = AffinePlanes::new(bits, group as usize, b, h, d, d);
            cpu.reserve(n + 5, usize::MAX);
            cpu.write(5, &k, &v)?;
            let (ck, cv) = cpu.read(5, n)?;
            let mut dev = backend.planes(codec, geo, gpu)?.expect("cuda planes");
            let (gk, gv) = write_twice(dev.as_mut(), &k, &v, gpu)?;
            let stored = dev.as_stored(&k.to_device(gpu)?, true)?;
            let ok = same_bits(&ck, &gk)?
                && same_bits(&cv, &gv)?
                && same_bits(&cpu.as_stored(&k)?, &stored)?;
            println!(
                "encode affine:{bits}:{group} d={d}: {}",
                if ok { "bit-identical" } else { "MISMATCH" }
            );
            tally.record(ok);
        }
    }
    Ok(())
}

fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    let a: Vec<f32> = a.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
    let b: Vec<f32> = b.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
    Ok(a.len() == b.len() && a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()))
}

/// Two writes into device planes across a capacity growth (the copy kernel must keep the
/// first), then the slots read back.
fn write_twice(
    dev: &mut dyn DevicePlanes,
    k: &Tensor,
    v: &Tensor,
    gpu: &Device,
) -> Result<(Tensor, Tensor)> {
    let n = k.dims()[2];
    dev.reserve(5 + 20, usize::MAX)?;
    dev.write(
        5,
        &k.narrow(2, 0, 20)?.to_device(gpu)?,
        &v.narrow(2, 0, 20)?.to_device(gpu)?,
    )?;
    dev.reserve(5 + n + 300, usize::MAX)?;
    dev.write(
        25,
        &k.narrow(2, 20, n - 20)?.to_device(gpu)?,
        &v.narrow(2, 20, n - 20)?.to_device(gpu)?,
    )?;
    Ok(dev.read(5, n)?)
}

fn turbo_encode_parity(gpu: &Device, tally: &mut Tally) -> Result<()> {
    let backend = tessera_kernels::backend::CudaBackend::new();
    let none = TurboPrep {
        key_mean: false,
        key_scale: false,
    };
    for (kbits, vbits, d, prep) in [
        (4u8, 4u8, 128usize, TurboPrep::ALL),
        (3, 5, 128, TurboPrep::ALL),
        (2, 8, 256, TurboPrep::ALL),
        (7, 6, 64, none),
        (4, 2, 256, none),
    ] {
        let (b, h, n) = (2, 3, 37);
        let geo = PlaneGeometry {
            rows: b,
            heads: h,
            head_dim: d,
            value_dim: d,
        };
        let codec = Codec::Turbo { kbits, vbits, prep };
        let k = random(&[b, h, n, d], 21 + d as u64, &Device::Cpu)?;
        let v = random(&[b, h, n, d], 22 + kbits as u64, &Device::Cpu)?;
        let mut cpu = TurboPlanes::new(kbits, vbits, b, h, d, d);
        cpu.fit_key_prep(&k, prep)?;
        cpu.reserve(n + 5, usize::MAX);
        cpu.write(5, &k, &v)?;
        let (ck, cv) = cpu.read(5, n)?;
        let mut dev = backend.planes(codec, geo, gpu)?.expect("cuda planes");
        dev.fit_key_prep(&k.to_device(gpu)?, prep)?;
        let (gk, gv) = write_twice(dev.as_mut(), &k, &v, gpu)?;
        let stored_k = dev.as_stored(&k.to_device(gpu)?, true)?;
        let stored_v = dev.as_stored(&v.to_device(gpu)?, false)?;
        let ok = same_bits(&ck, &gk)?
            && same_bits(&cv, &gv)?
            && same_bits(&cpu.as_stored(&k, true)?, &stored_k)?
            && same_bits(&cpu.as_stored(&v, false)?, &stored_v)?;
        println!(
            "encode {codec} d={d}: {}",
            if ok {
                "bit-identical".to_string()
            } else {
                format!(
                    "MISMATCH (keys rel err {:.2e}, values {:.2e})",
                    rel_err(&gk.to_device(&Device::Cpu)?, &ck)?,
                    rel_err(&gv.to_device(&Device::Cpu)?, &cv)?
                )
            }
        );
        tally.record(ok);
    }
    Ok(())
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
                    if std::mem::take(&mut tally.plant) {
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
            let sig = dev.layers()[0].signature();
            // bf16 reads split q and p into two bf16 parts (≈16 bits); affine reads feed
            // the tensor cores f16 (11 bits).
            let tolerance = match codec {
                Codec::Plain(_) if start == 0 => 1e-4,
                // 4-bit turbo rows go through the tensor cores in f16 (other widths:
                // f32 on CUDA cores, ≈ 1e-6).
                Codec::Turbo {
                    kbits: 4, vbits: 4, ..
                } => 2e-3,
                Codec::Turbo { .. } => 1e-4,
                _ => 2e-3,
            };
            let ok = worst.iter().all(|&e| e < tolerance);
            println!(
                "cache {codec} start {start} ({sig}): worst rel err decode {:.2e}, chunk {:.2e}: {}",
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

fn main() {
    let mut tally = Tally::default();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--plant-failure" => tally.plant = true,
            _ => {
                eprintln!("kv-cache-parity: unknown argument {arg:?} (usage: kv-cache-parity [--plant-failure])");
                std::process::exit(2);
            }
        }
    }
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
        ("encode", encode_parity),
        ("turbo encode", turbo_encode_parity),
        ("cache", cache_parity),
    ];
    for (name, part) in parts {
        // A part that stops on an error is one failed check; the other parts still run.
        if let Err(e) = part(&gpu, &mut tally) {
            println!("{name} parity stopped with an error: {e:#}: FAIL");
            tally.record(false);
        }
    }
    if tally.plant {
        println!("--plant-failure: no cache read was compared to perturb: FAIL");
        tally.record(false);
    }
    println!(
        "kv-cache-parity: {} passed, {} failed",
        tally.passed, tally.failed
    );
    if tally.failed > 0 || tally.passed == 0 {
        std::process::exit(1);
    }
}
