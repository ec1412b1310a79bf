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
