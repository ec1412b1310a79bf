//! 10,000 mutated and truncated prompt cache files, read into a small synthetic Gemma 3
//! (six layers, 16-position sliding windows): bit flips anywhere and in the header, cut
//! points, a rewritten header length, and numbers in the header replaced by huge,
//! zero, negative or neighbouring values (with the length prefix kept consistent, so the
//! mutation reaches our own checks). Every outcome must be a `PromptCache` error of one
//! line, or the original cache exactly (a mutation that changes nothing it holds: zeroed
//! bytes that were zero, whitespace in the JSON), which then runs a forward step; nothing
//! may panic, and the process's peak memory may not grow past a bound.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::Instant;
use tessera_engine::prompt_cache::{self, PromptCache};
use tessera_engine::{EngineError, Session};
use tessera_kv::{KvCache, KvScheme};
use tessera_models::{synth, LogitsMode, Model};

const CASES: usize = 10_000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

fn header_len(bytes: &[u8]) -> usize {
    u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

/// Replaces one number of the header text and rewrites the length prefix to match.
fn mutate_number(bytes: &[u8], rng: &mut Rng) -> Vec<u8> {
    let n = header_len(bytes);
    let text = &bytes[8..8 + n];
    let runs: Vec<(usize, usize)> = {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < text.len() {
            if text[i].is_ascii_digit() {
                let s = i;
                while i < text.len() && text[i].is_ascii_digit() {
                    i += 1;
                }
                runs.push((s, i));
            } else {
                i += 1;
            }
        }
        runs
    };
    let (s, e) = runs[rng.below(runs.len())];
    let old: u128 = std::str::from_utf8(&text[s..e])
        .unwrap()
        .parse()
        .unwrap_or(0);
    let new = match rng.below(8) {
        0 => "0".to_string(),
        1 => "1".to_string(),
        2 => "4294967296".to_string(),
        3 => "18446744073709551615".to_string(),
        4 => "99999999999999999999999".to_string(),
        5 => "-1".to_string(),
        6 => (old + 1).to_string(),
        _ => old.saturating_sub(1).to_string(),
    };
    let mut header = text[..s].to_vec();
    header.extend_from_slice(new.as_bytes());
    header.extend_from_slice(&text[e..]);
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

fn mutate(bytes: &[u8], rng: &mut Rng) -> (&'static str, Vec<u8>) {
    let mut b = bytes.to_vec();
    let n = header_len(bytes);
    match rng.below(6) {
        0 => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            ("bit flips", b)
        }
        1 => {
            for _ in 0..1 + rng.below(3) {
                let i = 8 + rng.below(n);
                b[i] ^= 1 << rng.below(8);
            }
            ("header bit flips", b)
        }
        2 => {
            b.truncate(rng.below(bytes.len()));
            ("truncated", b)
        }
        3 => {
            let len = match rng.below(3) {
                0 => rng.next(),
                1 => u64::MAX - rng.below(16) as u64,
                _ => (n as u64)
                    .wrapping_add(rng.below(64) as u64)
                    .wrapping_sub(32),
            };
            b[..8].copy_from_slice(&len.to_le_bytes());
            ("header length", b)
        }
        4 => ("header number", mutate_number(bytes, rng)),
        _ => {
            // A run of bytes zeroed or overwritten with noise.
            let at = rng.below(b.len());
            let len = (1 + rng.below(64)).min(b.len() - at);
            let noise = rng.below(2) == 0;
            for x in &mut b[at..at + len] {
                *x = if noise { rng.next() as u8 } else { 0 };
            }
            ("overwritten run", b)
        }
    }
}

/// A loaded cache must run: one forward step of one token per row.
fn run_one_step(model: &Model, loaded: PromptCache) {
    let mut cache: KvCache = loaded.cache;
    let rows = cache.batch();
    let ids = candle_core::Tensor::from_vec(vec![1u32; rows], (rows, 1), model.device()).unwrap();
    let _ = model.forward(&ids, &mut cache, LogitsMode::Last);
}

#[test]
fn mutated_and_truncated_files_give_clean_errors() {
    let dir = std::env::temp_dir().join(format!("tessera-pc-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gguf = dir.join("tiny.gguf");
    let shape = synth::preset("gemma3", "tiny").unwrap();
    synth::write_model(&shape, synth::parse_dtype("q8_0").unwrap(), 3, &gguf).unwrap();
    let (model, _) = Model::load(&gguf, &Default::default(), &candle_core::Device::Cpu).unwrap();
    // Originals: rings past their wrap in three codecs, and a bf16-first layer that has
    // not converted yet.
    let mut late = KvScheme::parse("affine:4:32").unwrap();
    late.quantized_kv_start = 64;
    let prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 37) % 500).collect();
    let originals: Vec<Vec<u8>> = [
        KvScheme::parse("bf16").unwrap(),
        KvScheme::parse("affine:4:32").unwrap(),
        KvScheme::parse("turbo:3").unwrap(),
        late,
    ]
    .iter()
    .enumerate()
    .map(|(i, scheme)| {
        let mut s = Session::new(&model, scheme, 16).unwrap();
        s.feed(&prompt).unwrap();
        let path: PathBuf = dir.join(format!("orig-{i}.tpc"));
        prompt_cache::save(&path, &model, std::slice::from_ref(&prompt), s.cache()).unwrap();
        std::fs::read(&path).unwrap()
    })
    .collect();
    // What each original holds: a mutated file that loads must hold exactly that (a
    // mutation the format cannot see changes nothing, e.g. zeroed bytes that were zero).
    let held: Vec<(Vec<Vec<u32>>, tessera_kv::CacheState)> = originals
        .iter()
        .map(|b| {
            let c = prompt_cache::decode(b, &model, None).unwrap();
            (c.tokens, c.cache.state().unwrap())
        })
        .collect();

    let rss_before = peak_rss();
    let started = Instant::now();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut ok, mut refused) = (0, 0);
    let mut kinds: std::collections::BTreeMap<&str, (usize, usize)> = Default::default();
    for case in 0..CASES {
        let original = &originals[case % originals.len()];
        let (kind, bytes) = mutate(original, &mut rng);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            match prompt_cache::decode(&bytes, &model, None) {
                Ok(loaded) => {
                    let (tokens, state) = &held[case % originals.len()];
                    assert!(
                        loaded.tokens == *tokens && loaded.cache.state().unwrap() == *state,
                        "case {case} ({kind}) loaded another cache than the original"
                    );
                    run_one_step(&model, loaded);
                    Ok(())
                }
                Err(e) => Err(e),
            }
        }));
        let entry = kinds.entry(kind).or_default();
        match outcome {
            Err(_) => panic!("case {case} ({kind}) panicked"),
            Ok(Ok(())) => {
                ok += 1;
                entry.0 += 1;
            }
            Ok(Err(e)) => {
                let text = e.to_string();
                assert!(
                    matches!(e, EngineError::PromptCache(_)) && !text.contains('\n'),
                    "case {case} ({kind}): {text:?}"
                );
                refused += 1;
                entry.1 += 1;
            }
        }
        // Some of them through the file path too: the header reader and the loader.
        if case % 100 == 0 {
            let path = dir.join("mutated.tpc");
            std::fs::write(&path, &bytes).unwrap();
            let header = catch_unwind(|| prompt_cache::read_header(&path).map(|_| ()));
            assert!(header.is_ok(), "case {case} ({kind}): read_header panicked");
            let loaded = catch_unwind(AssertUnwindSafe(|| {
                prompt_cache::load(&path, &model, None).map(|_| ())
            }));
            assert!(loaded.is_ok(), "case {case} ({kind}): load panicked");
        }
    }
    let elapsed = started.elapsed();
    let grew = peak_rss().saturating_sub(rss_before);
    eprintln!(
        "{CASES} mutated files in {:.1} s: {refused} refused, {ok} loaded and ran; peak RSS grew {} KiB; by kind (loaded, refused): {kinds:?}",
        elapsed.as_secs_f64(),
        grew / 1024
    );
    assert_eq!(ok + refused, CASES);
    // Every kind was exercised, and most mutations are caught.
    assert_eq!(kinds.len(), 6, "{kinds:?}");
    assert!(refused > CASES * 9 / 10, "{refused} of {CASES} refused");
    // The originals are a few hundred KiB: no mutation may make the loader allocate what
    // the file cannot back.
    assert!(grew < 256 << 20, "peak RSS grew {grew} bytes");
    let _ = std::fs::remove_dir_all(&dir);
}
