//! Compiles the CUDA sources as the engine compiles them at run time (NVRTC, sm_90), with no
//! device: every KV codec the CUDA cache stores (bf16; affine 4 and 8 bits in groups of 32,
//! 64 and 128; turbo keys and values of 2 to 8 bits) at head dims 64, 128 and 256 with 1 to
//! 8 query heads per KV head where a model has them, planes.cu, and weights.cu with the
//! model's build choices. The kernels are compiled only on the device otherwise, so a
//! source that does not compile would first show there; CI runs this where the CUDA
//! toolkit is installed.
//!
//! Usage: `kernels-compile [--quick] [--times]`; `--quick` compiles one head geometry per
//! codec. Prints one line per failure and a count; exits 1 on any failure. `--times`
//! compiles one source at a time and prints each one's NVRTC time and output sizes.

use anyhow::Context;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tessera_kernels::compile::compile;
use tessera_kernels::cuda::{decode_source, GpuCodec};
use tessera_kernels::{GREEDY_CU, PLANES_CU, WEIGHTS_CU};

fn codecs() -> Vec<GpuCodec> {
    let mut all = vec![GpuCodec::Bf16];
    for bits in [4, 8] {
        for group in [32, 64, 128] {
            all.push(GpuCodec::Affine { bits, group });
        }
    }
    for kbits in 2..=8 {
        for vbits in 2..=8 {
            all.push(GpuCodec::Turbo { kbits, vbits });
        }
    }
    all
}

fn main() {
    let (mut quick, mut times) = (false, false);
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--quick" => quick = true,
            "--times" => times = true,
            _ => {
                eprintln!(
                    "kernels-compile: unknown argument {arg:?} (usage: kernels-compile [--quick] [--times])"
                );
                std::process::exit(2);
            }
        }
    }
    let mut sources: Vec<(String, String)> = vec![
        ("planes.cu".into(), PLANES_CU.into()),
        ("weights.cu".into(), WEIGHTS_CU.into()),
        ("greedy.cu".into(), GREEDY_CU.into()),
    ];
    // Head geometries of the models we run (d, query heads per KV head): Gemma 3 270M (256, 4),
    // Llama 3 8B (128, 4), Qwen 2.5 0.5B (64, 7), Qwen 2.5 1.5B (128, 6), Qwen 3 0.6B
    // (128, 2), and both ends of the range.
    let shapes: &[(usize, usize)] = if quick {
        &[(128, 4)]
    } else {
        &[
            (256, 4),
            (128, 4),
            (64, 7),
            (128, 6),
            (128, 2),
            (64, 1),
            (256, 8),
        ]
    };
    for codec in codecs() {
        // Turbo codes other than equal widths compile the same paths at one geometry.
        let mixed_turbo = matches!(codec, GpuCodec::Turbo { kbits, vbits } if kbits != vbits);
        for &(d, g) in shapes {
            if mixed_turbo && (d, g) != shapes[0] {
                continue;
            }
            sources.push((
                format!("decode.cu {} d {d} g {g}", codec.name()),
                decode_source(codec, d, g, ""),
            ));
        }
    }
    if times {
        std::process::exit(time_each(&sources));
    }
    let start = Instant::now();
    // Independent programs: one NVRTC compile per core at a time.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = AtomicUsize::new(0);
    let failures: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut failures = Vec::new();
                    while let Some((name, src)) = sources.get(next.fetch_add(1, Ordering::Relaxed))
                    {
                        if let Err(e) = compile(src).with_context(|| name.clone()) {
                            failures.push(format!("{e:#}"));
                        }
                    }
                    failures
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| {
                w.join()
                    .unwrap_or_else(|_| vec!["a compile thread panicked".into()])
            })
            .collect()
    });
    for f in &failures {
        println!("FAIL {f}");
    }
    let (failed, passed) = (failures.len(), sources.len().saturating_sub(failures.len()));
    println!(
        "kernels-compile: {passed} compiled, {failed} failed ({:.1} s)",
        start.elapsed().as_secs_f64()
    );
    if failed > 0 || passed == 0 {
        std::process::exit(1);
    }
}

/// One source at a time: NVRTC's time and its output's sizes. Returns the exit status.
fn time_each(sources: &[(String, String)]) -> i32 {
    let (mut total, mut failed) = (0.0, 0);
    for (name, src) in sources {
        let start = Instant::now();
        match compile(src) {
            Ok(out) => {
                let seconds = start.elapsed().as_secs_f64();
                total += seconds;
                let (ptx, cubin) = (out.ptx.len() / 1024, out.cubin.len() / 1024);
                println!(
                    "{name}: nvrtc {:.0} ms, ptx {ptx} KiB, cubin {cubin} KiB",
                    seconds * 1e3
                );
            }
            Err(e) => {
                println!("FAIL {name}: {e:#}");
                failed += 1;
            }
        }
    }
    println!(
        "kernels-compile: {} sources, {failed} failed, nvrtc {total:.2} s one at a time",
        sources.len()
    );
    i32::from(failed > 0)
}
