//! Batch generation: several prompts of different lengths in one batch, left padded so
//! their last prompt tokens line up, decoded together.

use crate::sampler::argmax;
use crate::EngineError;
use candle_core::Tensor;
use tessera_kv::{KvCache, KvScheme};
use tessera_models::{LogitsMode, Model};

/// Greedy continuations of every prompt, `max_tokens` each (a row stops early at one of
/// `stop_tokens`). Equal to running each prompt alone.
pub fn generate_batch_greedy(
    model: &Model,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    scheme: &KvScheme,
    prefill_chunk: usize,
    stop_tokens: &[u32],
    pad_token: u32,
) -> Result<Vec<Vec<u32>>, EngineError> {
    if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
        return Err(EngineError::EmptyPrompt);
    }
    if prefill_chunk == 0 {
        return Err(EngineError::Invalid(
            "--prefill-chunk must be at least 1".into(),
        ));
    }
    let longest = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    // Saturating: a huge `max_tokens` must not wrap around past the check.
    if longest.saturating_add(max_tokens) > model.context_length() {
        return Err(EngineError::PromptTooLong {
            prompt: longest.saturating_add(max_tokens),
            context: model.context_length(),
        });
    }
    let pads: Vec<usize> = prompts.iter().map(|p| longest - p.len()).collect();
    let rows: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&pads)
        .map(|(p, &pad)| {
            std::iter::repeat(pad_token)
                .take(pad)
                .chain(p.iter().copied())
                .collect()
        })
        .collect();
    let mut cache = KvCache::new(&model.layer_specs(), scheme, pads)?.with_isa(model.isa());
    let device = model.device();
    let b = prompts.len();
    let mut logits = None;
    let mut start = 0;
    while start < longest {
        let n = prefill_chunk.min(longest - start);
        let chunk: Vec<u32> = rows
            .iter()
            .flat_map(|r| r[start..start + n].iter().copied())
            .collect();
        let ids = Tensor::from_vec(chunk, (b, n), device)?;
        logits = Some(model.forward(&ids, &mut cache, LogitsMode::Last)?);
        start += n;
    }
    let mut out = vec![Vec::new(); b];
    let mut done = vec![false; b];
    let mut logits = logits.ok_or(EngineError::EmptyPrompt)?;
    for step in 0..max_tokens {
        let rows_logits: Vec<Vec<f32>> = logits.squeeze(1)?.to_vec2()?;
        let next: Vec<u32> = rows_logits.iter().map(|l| argmax(l)).collect();
        for (row, &t) in next.iter().enumerate() {
            if done[row] {
                continue;
            }
            if stop_tokens.contains(&t) {
                done[row] = true;
            } else {
                out[row].push(t);
            }
        }
        if done.iter().all(|&d| d) || step + 1 == max_tokens {
            break;
        }
        let ids = Tensor::from_vec(next, (b, 1), device)?;
        logits = model.forward(&ids, &mut cache, LogitsMode::Last)?;
    }
    Ok(out)
}
