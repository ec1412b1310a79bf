//! Deterministic inference on real quantized models (the default Gemma 3 270M and Qwen 2.5
//! Coder 0.5B) on the CPU: the runs of `checks/determinism.rs` (every chunking, a batch of
//! neighbours, speculation, prompt cache, prefix store, steps ahead) give the plain one-row
//! run's logits bit for bit.
//!
//! The test CI runs covers every run on Gemma for every KV scheme (bf16, affine:4, turbo:4,
//! a per-layer mix) at the CPU's own level, every run on Qwen with the mix (its layers hold
//! bf16, affine and turbo codes), and at every lower level the kernels' runs (the chunkings
//! and the batch) on Gemma with the mix. The whole matrix (every scheme, model and level)
//! is the ignored test (`cargo test --release -p tessera-engine --test determinism --
//! --ignored`), too long for CI's budget. tessera-kernels' `determinism_cuda` runs the same
//! check on a GPU.

#[path = "checks/determinism.rs"]
mod check;
mod common;

use check::{check_model, only, schemes, Runs};
use tessera_kv::Isa;
use tessera_models::{LoadOptions, Model, Tokenizer};

/// The corpus's tokens: the prompt (a stretch with repeats, for n-gram drafts, longer than
/// the bf16-first transition's first append) and the neighbours' pool.
fn corpus_tokens(tok: &Tokenizer) -> (Vec<u32>, Vec<u32>) {
    let ids = tok.encode(&common::corpus(), true).unwrap();
    let mut prompt = vec![ids[0]];
    prompt.extend_from_slice(&ids[4000..4000 + 559]);
    (prompt, ids)
}

fn check(
    model: &Model,
    tok: &Tokenizer,
    name: &str,
    schemes: &[(&str, tessera_kv::KvScheme)],
    runs: Runs,
) {
    let (prompt, pool) = corpus_tokens(tok);
    check_model(model, name, &prompt, &pool, schemes, runs);
}

/// Gemma at every level below the CPU's own.
fn lower_levels(schemes: &[(&str, tessera_kv::KvScheme)], runs: Runs) {
    for isa in Isa::supported()
        .into_iter()
        .filter(|&l| l != Isa::detected())
    {
        let (model, tok) = common::load_with(LoadOptions {
            isa,
            ..Default::default()
        });
        assert_eq!(model.isa(), isa);
        let name = format!("gemma-3-270m at {isa:?}");
        check(&model, &tok, &name, schemes, runs);
    }
}

/// One test for both models and every level, so that their runs do not share the two cores
/// (the kernels' pool spins while another test's runs; in parallel a pair took twice as
/// long).
#[test]
fn generations_are_bit_identical_however_run() {
    let (model, tok) = common::load(true);
    check(&model, &tok, "gemma-3-270m", &schemes(), Runs::All);
    drop(model);
    let (model, tok) = common::load_path(&common::qwen_path());
    check(&model, &tok, "qwen2.5-coder-0.5b", &only("mix"), Runs::All);
    drop(model);
    lower_levels(&only("mix"), Runs::Kernels);
}

/// The whole matrix: every scheme on Qwen, and every run of every scheme at every lower
/// level (Gemma at the CPU's own level is the test above).
#[test]
#[ignore = "long: the whole matrix, beyond CI's budget"]
fn the_whole_matrix() {
    let (model, tok) = common::load_path(&common::qwen_path());
    check(&model, &tok, "qwen2.5-coder-0.5b", &schemes(), Runs::All);
    drop(model);
    lower_levels(&schemes(), Runs::All);
}
