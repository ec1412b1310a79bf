//! Acceptance (b): `eval --ctx 512 --chunks 12` on Pride and Prejudice reproduces
//! llama.cpp's f16-cache perplexity (22.5205, ../shared/reference/llama.cpp.md) within 2%.

mod common;

use tessera_engine::eval::{evaluate, EvalMode};
use tessera_kv::KvScheme;

const LLAMA_CPP_F16_PPL: f64 = 22.5205;

#[test]
fn perplexity_matches_llama_cpp_within_two_percent() {
    let (model, tok) = common::load(true);
    let ids = tok.encode(&common::corpus(), true).unwrap();
    let ids = &ids[..512 * 12 + 1];
    let schemes = vec![
        ("bf16".to_string(), KvScheme::parse("bf16").unwrap()),
        ("f32".to_string(), KvScheme::parse("f32").unwrap()),
    ];
    let results = evaluate(
        &model,
        ids,
        &schemes,
        EvalMode::Chunks {
            ctx: 512,
            chunks: Some(12),
        },
        2,
    )
    .unwrap();
    let bf16 = &results[0];
    assert_eq!(bf16.tokens_scored, 12 * 255);
    let ratio = bf16.ppl / LLAMA_CPP_F16_PPL;
    assert!(
        (ratio - 1.0).abs() < 0.02,
        "ppl {} vs llama.cpp {LLAMA_CPP_F16_PPL}",
        bf16.ppl
    );
    assert!(bf16.kl_vs_bf16.is_none());
    let f32 = &results[1];
    assert!(
        f32.kl_vs_bf16.unwrap() < 0.01,
        "f32 vs bf16 cache KL {}",
        f32.kl_vs_bf16.unwrap()
    );
    assert_eq!(f32.kv_bytes_per_token, 2.0 * bf16.kv_bytes_per_token);
}
