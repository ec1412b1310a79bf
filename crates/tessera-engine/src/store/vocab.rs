//! llama.cpp's tokenizer test vocabularies, fetched from the llama-cpp-python sdist.

use super::{fetch_error, sha256_file, tessera_home, FetchEvent};
use crate::EngineError;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

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
