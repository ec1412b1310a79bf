//! What the model tests share: a temporary folder removed on drop, and tiny synthesized
//! models written into it.

use std::path::{Path, PathBuf};
use tessera_models::synth::{parse_dtype, preset, write_model};

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
