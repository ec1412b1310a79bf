// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

//! Shared by the model tests: where the default model and the shared corpus live.

use candle_core::Device;
use std::path::PathBuf;
use tessera_models::{LoadOptions, Model, Tokenizer};

/// `$TESSERA_MODEL`, or the default model's store path (`.ci/run` fetches it first).
pub fn model_path() -> PathBuf {
    let path = std::env::var_os("TESSERA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(tessera_engine::store::default_model_path);
    assert!(
        path.exists(),
        "model {} is missing: run `tessera model fetch` (or set TESSERA_MODEL)",
        path.display()
    );
    path
}

pub fn load(reencode_q5_0: bool) -> (Model, Tokenizer) {
    load_with(LoadOptions {
        reencode_q5_0,
        ..Default::default()
    })
}

/// Weights dequantized to f32: numerics without candle's activation re-quantization.
pub fn load_f32_weights() -> (Model, Tokenizer) {
    load_with(LoadOptions {
        dequantize: true,
        ..Default::default()
    })
}

pub fn load_with(options: LoadOptions) -> (Model, Tokenizer) {
    Model::load(&model_path(), &options, &Device::Cpu).expect("default model loads")
}

/// Qwen 2.5 Coder 0.5B Instruct in the store (`.ci/run` fetches it with `tessera model
/// fetch qwen2.5-coder-0.5b-instruct`).
pub fn qwen_path() -> PathBuf {
    let path = tessera_engine::store::tessera_home()
        .join("models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    assert!(
        path.exists(),
        "model {} is missing: run `tessera model fetch qwen2.5-coder-0.5b-instruct`",
        path.display()
    );
    path
}

pub fn load_path(path: &std::path::Path) -> (Model, Tokenizer) {
    Model::load(path, &LoadOptions::default(), &Device::Cpu).expect("model loads")
}

/// The repository's sibling `shared/` folder.
pub fn shared(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(rel)
}

pub fn corpus() -> String {
    std::fs::read_to_string(shared("corpus/pride-and-prejudice.txt"))
        .expect("../shared/corpus is readable")
}

/// A file removed when dropped, also when the test fails.
pub struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A temporary GGUF path unique to this process and `tag` (tests run in parallel).
pub fn temp_gguf(tag: &str) -> TempFile {
    TempFile(std::env::temp_dir().join(format!("tessera-test-{}-{tag}.gguf", std::process::id())))
}

/// Largest logit difference as a fraction of the reference's largest logit.
pub fn relative_gap(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0f32, |a, b| a.max(b.abs()));
    let diff = ours
        .iter()
        .zip(reference)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    diff / scale
}

/// A copy of the GGUF at `src` with every tensor dequantized and stored as F32, for
/// candle-transformers' quantized models: their QMatMul runs F32 tensors as plain f32
/// matmuls, so a reference on f32 weights needs no `CANDLE_DEQUANTIZE_ALL` environment
/// variable. The copy is removed when the returned file drops.
pub fn f32_gguf_copy(src: &std::path::Path, tag: &str) -> TempFile {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    use std::io::Write;
    let tmp = temp_gguf(tag);
    let mut file = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(&str, QTensor)> = names
        .into_iter()
        .map(|name| {
            let q = content.tensor(&mut file, name, &Device::Cpu).unwrap();
            let t = q.dequantize(&Device::Cpu).unwrap();
            (
                name.as_str(),
                QTensor::quantize(&t, GgmlDType::F32).unwrap(),
            )
        })
        .collect();
    let md: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (*k, t)).collect();
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp.0).unwrap());
    gguf_file::write(&mut w, &md, &ts).unwrap();
    w.flush().unwrap();
    drop(w);
    let mut file = std::fs::File::open(&tmp.0).unwrap();
    let copy = gguf_file::Content::read(&mut file).unwrap();
    assert!(copy
        .tensor_infos
        .values()
        .all(|t| t.ggml_dtype == GgmlDType::F32));
    tmp
}

/// `prompt` read into `session` and `max_tokens` sampled one token per forward with
/// [`tessera_engine::Session::feed`] and the sampler alone: the reference the step engine's
/// outputs ([`tessera_engine::Batch`], [`tessera_engine::Generation`]) are held to.
pub fn decode_alone(
    session: &mut tessera_engine::Session,
    prompt: &[u32],
    sampler: tessera_engine::SamplerConfig,
    max_tokens: usize,
) -> Vec<u32> {
    let mut sampler = tessera_engine::Sampler::new(sampler);
    let mut logits = session.feed(prompt).unwrap();
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let token = sampler.sample(&logits, session.tokens());
        out.push(token);
        if out.len() < max_tokens {
            logits = session.feed(&[token]).unwrap();
        }
    }
    out
}

/// Runs `requests` through `batch`, each added at the step of its index in `join_at` (and
/// `cancel`'s request cancelled at its step); returns each request's tokens and finish
/// event, and the most rows ever running. The batch (its times) stays with the caller.
pub fn run_batch(
    batch: &mut tessera_engine::Batch,
    requests: &[tessera_engine::GenerationRequest],
    join_at: &[usize],
    cancel: Option<(usize, usize)>,
) -> (Vec<Vec<u32>>, Vec<Option<tessera_engine::Event>>, usize) {
    let mut ids: Vec<Option<tessera_engine::RequestId>> = vec![None; requests.len()];
    let mut tokens: std::collections::HashMap<tessera_engine::RequestId, Vec<u32>> =
        std::collections::HashMap::new();
    let mut finished: std::collections::HashMap<tessera_engine::RequestId, tessera_engine::Event> =
        std::collections::HashMap::new();
    let mut most = 0;
    let mut step = 0;
    loop {
        for (i, r) in requests.iter().enumerate() {
            if join_at[i] == step {
                ids[i] = Some(batch.add(r.clone()).unwrap());
            }
        }
        if let Some((which, at)) = cancel {
            if at == step {
                assert!(batch.cancel(ids[which].unwrap()), "the request was live");
            }
        }
        if batch.is_idle() && join_at.iter().all(|&j| j < step) {
            break;
        }
        for event in batch.step().unwrap() {
            match event {
                tessera_engine::Event::Token { id, token, .. } => {
                    tokens.entry(id).or_default().push(token)
                }
                tessera_engine::Event::Finished { id, .. } => {
                    assert!(finished.insert(id, event).is_none(), "finished twice");
                }
                tessera_engine::Event::Failed { message, .. } => {
                    panic!("a request failed: {message}")
                }
            }
        }
        most = most.max(batch.running());
        step += 1;
        assert!(step < 2000, "the batch does not finish");
    }
    let out = ids
        .iter()
        .map(|id| tokens.remove(&id.unwrap()).unwrap_or_default())
        .collect();
    let events = ids.iter().map(|id| finished.remove(&id.unwrap())).collect();
    (out, events, most)
}
