//! What the model tests share: a temporary folder removed on drop, and tiny synthesized
//! models written into it.

use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};
use tessera_kv::{KvCache, KvScheme};
use tessera_models::synth::{parse_dtype, preset, write_model};
use tessera_models::{LogitsMode, Model};

pub struct Dir(pub PathBuf);

impl Dir {
    pub fn new(tag: &str) -> Dir {
        let dir = std::env::temp_dir().join(format!("tessera-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A synthesized tiny model of `arch` (Q8_0, seed 3).
#[allow(dead_code)] // not every test binary uses it
pub fn tiny(dir: &Path, arch: &str) -> PathBuf {
    synthesized(dir, arch, "tiny")
}

/// The synthesized `preset` of `arch` (Q8_0, seed 3).
#[allow(dead_code)] // not every test binary uses every preset
pub fn synthesized(dir: &Path, arch: &str, preset_name: &str) -> PathBuf {
    let path = dir.join(format!("{arch}-{preset_name}.gguf"));
    write_model(
        &preset(arch, preset_name).unwrap(),
        parse_dtype("q8_0").unwrap(),
        3,
        &path,
    )
    .unwrap();
    path
}

/// `steps` greedy decode steps of `rows` rows (row `r`'s prompt shifted by `r` in the
/// vocabulary) after a prefill, on a fresh cache of `scheme`: each step's logits, all
/// rows', and the cache.
#[allow(dead_code)] // not every test binary decodes
pub fn greedy_steps(
    model: &Model,
    scheme: &str,
    prompt: &[u32],
    steps: usize,
    rows: usize,
) -> (Vec<Vec<f32>>, KvCache) {
    let dev = Device::Cpu;
    let scheme = KvScheme::parse(scheme).unwrap();
    let mut cache = KvCache::new(&model.layer_specs(), &scheme, vec![0; rows]).unwrap();
    let prompts: Vec<u32> = (0..rows as u32)
        .flat_map(|r| prompt.iter().map(move |t| t + r))
        .collect();
    let ids = Tensor::from_slice(&prompts, (rows, prompt.len()), &dev).unwrap();
    model.forward(&ids, &mut cache, LogitsMode::Last).unwrap();
    let mut tokens = vec![7u32; rows];
    let mut out = Vec::new();
    for _ in 0..steps {
        let ids = Tensor::from_slice(&tokens, (rows, 1), &dev).unwrap();
        let logits: Vec<f32> = model
            .forward(&ids, &mut cache, LogitsMode::Last)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let vocab = logits.len() / rows;
        for (r, t) in tokens.iter_mut().enumerate() {
            let row = &logits[r * vocab..(r + 1) * vocab];
            *t = (0..vocab)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap() as u32;
        }
        out.push(logits);
    }
    (out, cache)
}
