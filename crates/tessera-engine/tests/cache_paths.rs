//! Acceptance (c) and (d): the cached paths against independent references on the real
//! model. (c) chunked prefill + decode through the KV cache gives the logits of one full
//! pass with an explicit causal/sliding mask and no cache; (d) a left-padded batch of four
//! prompts gives the same greedy tokens as each prompt alone. Weights are dequantized to f32
//! so that both sides compute in f32 throughout (candle's quantized matmuls re-quantize
//! activations to int8, which turns 1e-7 differences in summation order into percent-level
//! logit noise).

mod common;

use tessera_engine::{generate_batch_greedy, SamplerConfig, Session};
use tessera_kv::KvScheme;
use tessera_models::{LogitsMode, Model};

#[test]
fn chunked_prefill_and_decode_equal_one_uncached_pass() {
    let (model, tok) = common::load_f32_weights();
    let Model::Decoder(gemma) = &model;
    let ids: Vec<u32> = tok.encode(&common::corpus(), true).unwrap()[..1500].to_vec();
    let reference = gemma.forward_uncached(&ids).unwrap(); // (1, 1500, vocab)
    let vocab = model.vocab_size();

    let mut session = Session::new(&model, &KvScheme::parse("f32").unwrap(), 512).unwrap();
    // Uneven chunks cross the 512-token window and wrap every sliding ring; then decode.
    let mut got: Vec<(usize, Vec<f32>)> = Vec::new();
    let mut pos = 0;
    for n in [300, 512, 437, 200] {
        let logits = session
            .forward(&ids[pos..pos + n], LogitsMode::All)
            .unwrap();
        for i in (0..n).step_by(97) {
            got.push((pos + i, logits[i * vocab..(i + 1) * vocab].to_vec()));
        }
        pos += n;
    }
    while pos < ids.len() {
        let logits = session
            .forward(&ids[pos..pos + 1], LogitsMode::Last)
            .unwrap();
        got.push((pos, logits));
        pos += 1;
    }
    let mut worst = 0f32;
    for (p, logits) in &got {
        let want: Vec<f32> = reference
            .get(0)
            .unwrap()
            .get(*p)
            .unwrap()
            .to_vec1()
            .unwrap();
        let scale = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let err = logits
            .iter()
            .zip(&want)
            .fold(0f32, |a, (g, w)| a.max((g - w).abs()));
        worst = worst.max(err / scale);
        assert_eq!(
            tessera_engine::argmax(logits),
            tessera_engine::argmax(&want),
            "top-1 differs at position {p}"
        );
    }
    assert!(
        worst < 1e-3,
        "largest logit difference {worst} of the largest logit"
    );
}

#[test]
fn left_padded_batch_equals_one_at_a_time() {
    let (model, tok) = common::load_f32_weights();
    let corpus = common::corpus();
    let chars: Vec<char> = corpus.chars().collect();
    let prompts: Vec<Vec<u32>> = [(100, 20), (3000, 150), (9000, 600), (20000, 2600)]
        .iter()
        .map(|&(at, len)| {
            tok.encode(&chars[at..at + len].iter().collect::<String>(), true)
                .unwrap()
        })
        .collect();
    assert!(
        prompts[3].len() > 512,
        "the longest prompt wraps the sliding rings"
    );
    let scheme = KvScheme::parse("bf16").unwrap();
    let steps = 12;
    let batched = generate_batch_greedy(&model, &prompts, steps, &scheme, 256, &[]).unwrap();
    for (prompt, got) in prompts.iter().zip(&batched) {
        let mut session = Session::new(&model, &scheme, 256).unwrap();
        let alone = common::decode_alone(&mut session, prompt, SamplerConfig::default(), steps);
        assert_eq!(got, &alone, "prompt of {} tokens", prompt.len());
    }
}
