//! Unit tests of the model store.

use super::*;

/// A fresh empty folder under the system's temporary folder, removed when dropped.
struct TempDir(PathBuf);
impl TempDir {
    fn new(tag: &str) -> Self {
        let seq = ASSEMBLY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d =
            std::env::temp_dir().join(format!("tessera-store-{tag}-{}-{seq}", std::process::id()));
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
    let e = resolve_model(
        Some(Path::new("/nonexistent/x.gguf")),
        "--model",
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("--model /nonexistent/x.gguf: file not found") && e.contains("known model name"),
        "{e}"
    );
    assert!(e.contains("gemma-3-270m"), "{e}");
}

#[test]
fn an_existing_path_wins() {
    let d = TempDir::new("path");
    let p = d.0.join("gemma-3-270m");
    fs::write(&p, b"x").unwrap();
    assert_eq!(resolve_model(Some(&p), "--model", &mut |_| {}).unwrap(), p);
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
