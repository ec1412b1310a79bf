//! Deterministic mode on a GPU (`--deterministic`): tessera-engine's determinism check
//! (`checks/determinism.rs`: every chunking, a batch of 15 neighbours, n-gram and draft-model
//! speculation, a warm prompt cache, a prefix-store hit, steps ahead on and off) gives the
//! plain one-row run's logits bit for bit on the CUDA backends. Synthetic models in real
//! shapes, since nothing is downloaded on the device: Gemma 3 270M in Q8_0 (candle's
//! quantized matmuls, sliding-window rings that wrap, head dim 256), Qwen 2 in Q4_0
//! (tessera's tensor-core matmuls) and Llama in Q4_K. Needs a GPU: run it there with
//! `cargo test --release --features cuda -p tessera-kernels --test determinism_cuda --
//! --ignored` (bench/determinism-cuda.sh).
#![cfg(feature = "cuda")]

#[path = "../../tessera-engine/tests/checks/determinism.rs"]
mod check;

use candle_core::Device;
use check::{check_model, only, schemes, Runs};
use tessera_models::{synth, LoadOptions, Model};

/// A random-weight model of `preset`'s shapes in `dtype`, written to a temporary file and
/// loaded on GPU 0.
fn synthetic(arch: &str, preset: &str, dtype: &str) -> Model {
    let path = std::env::temp_dir().join(format!(
        "tessera-determinism-{}-{arch}-{preset}-{dtype}.gguf",
        std::process::id()
    ));
    let shape = synth::preset(arch, preset).unwrap();
    synth::write_model(&shape, synth::parse_dtype(dtype).unwrap(), 7, &path).unwrap();
    let device = Device::new_cuda(0).unwrap();
    let (model, _) = Model::load(&path, &LoadOptions::default(), &device).unwrap();
    let _ = std::fs::remove_file(&path);
    model
}

/// The prompt (560 tokens) and the neighbours' pool: phrases of 12 tokens drawn from 64,
/// so that n-gram drafts find matches; ids from 300 up, clear of the control and byte
/// tokens of the synthetic vocabulary.
fn tokens(vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u64| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) % n
    };
    let span = (vocab - 300) as u64;
    let phrases: Vec<Vec<u32>> = (0..64)
        .map(|_| (0..12).map(|_| 300 + next(span) as u32).collect())
        .collect();
    let mut pool = Vec::new();
    while pool.len() < 21_000 {
        pool.extend_from_slice(&phrases[next(64) as usize]);
    }
    (pool[4000..4560].to_vec(), pool)
}

#[test]
#[ignore = "needs a GPU"]
fn deterministic_mode_gives_the_one_row_logits_on_cuda() {
    tessera_kernels::backend::install();
    tessera_kernels::weights::install();
    tessera_kernels::graphs::install();
    // The check can fail: with the mode off, the default kernels (matmul and attention
    // launches shaped by their row counts) change a chunked or batched position's logits.
    tessera_models::device_weights::set_deterministic(false);
    {
        let model = synthetic("gemma3", "gemma3-270m", "q8_0");
        let (prompt, pool) = tokens(model.vocab_size());
        let run = std::panic::AssertUnwindSafe(|| {
            check_model(
                &model,
                "mode off",
                &prompt,
                &pool,
                &only("bf16"),
                Runs::Kernels,
            )
        });
        assert!(
            std::panic::catch_unwind(run).is_err(),
            "the default kernels gave the one-row bits too: the check shows nothing"
        );
    }
    tessera_models::device_weights::set_deterministic(true);
    let cases: [(&str, &str, &str, Vec<(&str, tessera_kv::KvScheme)>, Runs); 3] = [
        ("gemma3", "gemma3-270m", "q8_0", schemes(), Runs::All),
        ("qwen2", "tiny-256", "q4_0", only("mix"), Runs::All),
        ("llama", "tiny-256", "q4_k", only("mix"), Runs::Kernels),
    ];
    // Every case and scheme checked, each on its own, so that one run names every miss.
    let mut missed = Vec::new();
    for (arch, preset, dtype, schemes, runs) in cases {
        let model = synthetic(arch, preset, dtype);
        let (prompt, pool) = tokens(model.vocab_size());
        for scheme in schemes {
            let name = format!("{arch} {preset} {dtype} {} on CUDA", scheme.0);
            let t = std::time::Instant::now();
            let run = std::panic::AssertUnwindSafe(|| {
                check_model(&model, &name, &prompt, &pool, &[scheme.clone()], runs)
            });
            let held = std::panic::catch_unwind(run).is_ok();
            eprintln!(
                "{name}: {}, {:.1} s",
                if held { "bit-identical" } else { "DIFFERS" },
                t.elapsed().as_secs_f64()
            );
            if !held {
                missed.push(name);
            }
        }
    }
    assert!(missed.is_empty(), "deterministic mode missed: {missed:?}");
}
