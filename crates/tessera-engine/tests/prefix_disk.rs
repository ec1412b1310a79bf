//! The prefix store mirrored to a folder (the server's `--prompt-cache-dir`), with the real
//! model: a row kept by one batch is reused by the next batch on the folder (read lazily,
//! when a request first picks it) with the tokens of a cold run; rows replaced or evicted
//! lose their files; files that are corrupt, truncated, for another scheme or not prompt
//! caches at all are skipped at index time or dropped at first use, never deleted, and
//! the request is served either way. Weights are dequantized to f32 (as in
//! continuous_batching.rs) and shared prefixes end on chunk boundaries, so a reused prefix
//! and a cold prefill run the same sums.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};
use tessera_engine::prefix::{file_name, PrefixCache};
use tessera_engine::prompt_cache;
use tessera_engine::{
    Batch, BatchLimits, Event, GenerationRequest, SamplerConfig, Sequence, Session,
};
use tessera_kv::{KvCache, KvScheme};
use tessera_models::{Model, Tokenizer};

const CHUNK: usize = 64;

/// A folder removed when dropped, also when the test fails.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir(tag: &str) -> TempDir {
    let dir =
        std::env::temp_dir().join(format!("tessera-prefix-disk-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}

/// `n` tokens of the corpus from character `at` (BOS first when `bos`).
fn corpus_tokens(tok: &Tokenizer, at: usize, n: usize, bos: bool) -> Vec<u32> {
    let chars: Vec<char> = common::corpus().chars().collect();
    let text: String = chars[at..at + 8 * n].iter().collect();
    let mut ids = tok.encode(&text, bos).unwrap();
    assert!(ids.len() >= n, "{} tokens of text", ids.len());
    ids.truncate(n);
    ids
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().chain(b).copied().collect()
}

fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_tokens,
        sampler: SamplerConfig::default(),
        stop_tokens: vec![],
        logprobs: None,
        stop_strings: Vec::new(),
    }
}

fn alone(model: &Model, scheme: &KvScheme, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut session = Session::new(model, scheme, CHUNK).unwrap();
    common::decode_alone(&mut session, prompt, SamplerConfig::default(), max_tokens)
}

/// Runs `request` alone through `batch`: its tokens and its `cached_tokens`.
fn serve_one(batch: &mut Batch, request: GenerationRequest) -> (Vec<u32>, usize) {
    let id = batch.add(request).unwrap();
    let mut tokens = Vec::new();
    let mut cached = None;
    let mut steps = 0;
    while !batch.is_idle() {
        for event in batch.step().unwrap() {
            match event {
                Event::Token { id: i, token, .. } if i == id => tokens.push(token),
                Event::Finished {
                    id: i,
                    cached_tokens,
                    ..
                } if i == id => cached = Some(cached_tokens),
                _ => {}
            }
        }
        steps += 1;
        assert!(steps < 500, "the batch does not finish");
    }
    (tokens, cached.expect("a finish event"))
}

/// The `.tpc` files in `dir`, sorted.
fn tpc_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "tpc"))
        .collect();
    files.sort();
    files
}

/// A one-row cache holding `tokens`, prefilled in CHUNK-token chunks.
fn row(model: &Model, scheme: &KvScheme, tokens: &[u32]) -> KvCache {
    let mut session = Session::new(model, scheme, CHUNK).unwrap();
    session.feed(tokens).unwrap();
    session.cache().extract(0).unwrap()
}

fn save_row(dir: &Path, model: &Model, scheme: &KvScheme, tokens: &[u32]) -> PathBuf {
    let path = dir.join(file_name(tokens));
    prompt_cache::save(
        &path,
        model,
        &[tokens.to_vec()],
        &row(model, scheme, tokens),
    )
    .unwrap();
    path
}

fn set_mtime(path: &Path, secs_ago: u64) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(secs_ago))
        .unwrap();
}

/// A row kept by one batch outlives it: a new batch on the folder indexes it (lazily),
/// reads it when a request sharing its first 256 tokens arrives, reports those tokens as
/// cached, and generates what a cold run does. Then corrupt, truncated, foreign-scheme and
/// junk files: the index skips what its headers refuse, a request whose best match fails
/// to read falls back to the next match, and no file is deleted.
#[test]
fn a_row_outlives_its_batch_and_bad_files_are_skipped() {
    let (model, tok) = common::load_f32_weights();
    let scheme = KvScheme::parse("bf16").unwrap();
    let budget = 256 << 20;
    let dir = tempdir("outlives");
    let a = corpus_tokens(&tok, 4000, 300, true);
    let b = cat(&a[..4 * CHUNK], &corpus_tokens(&tok, 9000, 40, false));
    assert_ne!(a[4 * CHUNK], b[4 * CHUNK], "B leaves A at token 256");
    let want_b = alone(&model, &scheme, &b, 6);

    let mut first = Batch::new(&model, &scheme, CHUNK, BatchLimits::default())
        .unwrap()
        .with_prefix_cache_dir(budget, &dir.0)
        .unwrap();
    let (_, cached) = serve_one(&mut first, greedy(a.clone(), 6));
    assert_eq!(cached, 0, "an empty folder");
    let files = tpc_files(&dir.0);
    assert_eq!(files.len(), 1, "A's row is saved: {files:?}");
    let (header, _) = prompt_cache::read_header(&files[0]).unwrap();
    // The row holds the tokens it was fed: the prompt and all but the last generated.
    assert_eq!(header.tokens.len(), 1);
    assert_eq!(header.tokens[0].len(), a.len() + 5);
    assert!(header.tokens[0].starts_with(&a));
    assert_eq!(
        files[0].file_name().unwrap().to_str().unwrap(),
        file_name(&header.tokens[0])
    );
    drop(first);

    let mut second = Batch::new(&model, &scheme, CHUNK, BatchLimits::default())
        .unwrap()
        .with_prefix_cache_dir(budget, &dir.0)
        .unwrap();
    let store = second.prefix_cache().unwrap();
    assert_eq!((store.len(), store.lazy()), (1, 1), "indexed, not read");
    assert!(store.bytes() > 0, "a lazy row counts against the budget");
    let (got, cached) = serve_one(&mut second, greedy(b.clone(), 6));
    assert_eq!(cached, 4 * CHUNK, "B reuses A's first 256 tokens");
    assert_eq!(got, want_b, "B's tokens equal a cold run");
    let store = second.prefix_cache().unwrap();
    assert_eq!(store.hits(), (1, 4 * CHUNK as u64));
    assert_eq!((store.len(), store.lazy()), (2, 0), "A read, B kept");
    assert_eq!(tpc_files(&dir.0).len(), 2);
    drop(second);

    // A folder of bad files, and one good row sharing B's first 128 tokens.
    let bad = tempdir("bad");
    let corrupt = save_row(&bad.0, &model, &scheme, &a);
    let mut bytes = std::fs::read(&corrupt).unwrap();
    let mid = bytes.len() / 2;
    for byte in &mut bytes[mid..mid + 16] {
        *byte ^= 0x5a;
    }
    std::fs::write(&corrupt, &bytes).unwrap();
    let truncate = |path: &Path| {
        let len = std::fs::metadata(path).unwrap().len();
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(len * 3 / 4)
            .unwrap();
    };
    // Cut before the index is built (its header's lengths give it away), and after.
    let cut_early = save_row(
        &bad.0,
        &model,
        &scheme,
        &cat(&a[..160], &corpus_tokens(&tok, 12000, 20, false)),
    );
    truncate(&cut_early);
    let cut_late = save_row(
        &bad.0,
        &model,
        &scheme,
        &cat(&a[..3 * CHUNK], &corpus_tokens(&tok, 20000, 20, false)),
    );
    let good_tokens = cat(&a[..2 * CHUNK], &corpus_tokens(&tok, 31000, 20, false));
    save_row(&bad.0, &model, &scheme, &good_tokens);
    let affine = KvScheme::parse("affine:4").unwrap();
    let foreign = bad.0.join("foreign.tpc");
    let foreign_tokens = cat(&a[..3 * CHUNK + 10], &[7, 8, 9]);
    prompt_cache::save(
        &foreign,
        &model,
        std::slice::from_ref(&foreign_tokens),
        &row(&model, &affine, &foreign_tokens),
    )
    .unwrap();
    let junk = bad.0.join("junk.tpc");
    std::fs::write(&junk, b"not a prompt cache at all").unwrap();
    let before = tpc_files(&bad.0);
    assert_eq!(before.len(), 6);

    let mut third = Batch::new(&model, &scheme, CHUNK, BatchLimits::default())
        .unwrap()
        .with_prefix_cache_dir(budget, &bad.0)
        .unwrap();
    let store = third.prefix_cache().unwrap();
    assert_eq!(
        (store.len(), store.lazy()),
        (3, 3),
        "the corrupt, the late-cut and the good rows are indexed; the early-cut, affine:4 \
         and junk files not"
    );
    // Each skipped file is named in a note for the server's log, with its reason.
    let notes = third.take_notes().join("\n");
    for (f, why) in [
        (&cut_early, "truncated"),
        (&foreign, "signature"),
        (&junk, "not a valid safetensors file"),
    ] {
        let line = notes
            .lines()
            .find(|l| l.contains(&*f.display().to_string()))
            .unwrap_or_else(|| panic!("no note names {}: {notes}", f.display()));
        assert!(line.contains("skipping") && line.contains(why), "{line}");
    }
    assert!(notes.contains("3 cached prefixes indexed"), "{notes}");
    truncate(&cut_late);
    let (got, cached) = serve_one(&mut third, greedy(b.clone(), 6));
    let notes = third.take_notes().join("\n");
    for f in [&corrupt, &cut_late] {
        assert!(
            notes.contains(&format!("dropping {} from the index", f.display())),
            "{notes}"
        );
    }
    assert_eq!(
        cached,
        2 * CHUNK,
        "the corrupt (256) and cut (192) matches fail to read; the good one gives 128"
    );
    assert_eq!(got, want_b, "B's tokens equal a cold run");
    let store = third.prefix_cache().unwrap();
    assert_eq!(
        (store.len(), store.lazy()),
        (2, 0),
        "the unreadable rows left the index; the good one and B's are held"
    );
    drop(third);
    for f in &before {
        assert!(f.exists(), "{} was not deleted", f.display());
    }

    // Only unreadable files: the request is served cold.
    let only_bad = tempdir("only-bad");
    for f in [&corrupt, &cut_early, &cut_late] {
        std::fs::copy(f, only_bad.0.join(f.file_name().unwrap())).unwrap();
    }
    let mut fourth = Batch::new(&model, &scheme, CHUNK, BatchLimits::default())
        .unwrap()
        .with_prefix_cache_dir(budget, &only_bad.0)
        .unwrap();
    assert_eq!(fourth.prefix_cache().unwrap().lazy(), 1, "the corrupt one");
    let (got, cached) = serve_one(&mut fourth, greedy(b.clone(), 6));
    assert_eq!(cached, 0, "the only match fails to read: a cold prefill");
    assert_eq!(got, want_b);
    let store = fourth.prefix_cache().unwrap();
    assert_eq!((store.len(), store.lazy()), (1, 0), "B's row alone");
}

/// The store's files follow its rows: a row a longer one extends loses its file, a row
/// evicted past the budget loses its file, the index takes the newest files that fit the
/// budget (leaving older ones on disk), and a row whose save fails is kept in memory.
#[test]
fn files_follow_the_rows_and_the_budget() {
    let (model, tok) = common::load_f32_weights();
    let scheme = KvScheme::parse("bf16").unwrap();
    let dir = tempdir("follow");
    // No BOS: unrelated rows share no first token.
    let r1 = corpus_tokens(&tok, 500, 24, false);
    let r1_longer = cat(&r1, &corpus_tokens(&tok, 600, 4, false));
    let r2 = corpus_tokens(&tok, 9000, 24, false);
    let r3 = corpus_tokens(&tok, 20000, 24, false);
    assert!(r1[0] != r2[0] && r1[0] != r3[0] && r2[0] != r3[0]);
    let rows: Vec<KvCache> = [&r1, &r1_longer, &r2]
        .iter()
        .map(|t| row(&model, &scheme, t))
        .collect();
    let sizes: Vec<usize> = rows.iter().map(KvCache::allocated_bytes).collect();
    // Room for one row and a half: a second row evicts the first.
    let budget = sizes.iter().max().unwrap() * 3 / 2;
    assert!(sizes[1] + sizes[2] > budget, "{sizes:?}");
    let mut store = PrefixCache::with_dir(budget, &dir.0, &model, &scheme).unwrap();
    let mut rows = rows.into_iter();
    store.insert(Sequence::new(r1.clone(), rows.next().unwrap()).unwrap());
    assert!(dir.0.join(file_name(&r1)).exists());
    store.insert(Sequence::new(r1_longer.clone(), rows.next().unwrap()).unwrap());
    assert!(!dir.0.join(file_name(&r1)).exists(), "redundant: deleted");
    assert!(dir.0.join(file_name(&r1_longer)).exists());
    assert_eq!(store.len(), 1);
    store.insert(Sequence::new(r2.clone(), rows.next().unwrap()).unwrap());
    assert_eq!(store.len(), 1, "the budget holds one row");
    assert!(
        !dir.0.join(file_name(&r1_longer)).exists(),
        "evicted: deleted"
    );
    assert_eq!(tpc_files(&dir.0), vec![dir.0.join(file_name(&r2))]);
    drop(store);

    // Three files of one size, a budget for two: the two newest are indexed.
    let r2_file = dir.0.join(file_name(&r2));
    let r1_file = save_row(&dir.0, &model, &scheme, &r1);
    let r3_file = save_row(&dir.0, &model, &scheme, &r3);
    set_mtime(&r1_file, 300);
    set_mtime(&r2_file, 200);
    set_mtime(&r3_file, 100);
    let sizes: Vec<usize> = [&r1_file, &r2_file, &r3_file]
        .iter()
        .map(|f| {
            let (h, _) = prompt_cache::read_header(f).unwrap();
            h.layers
                .iter()
                .flat_map(|l| &l.buffers)
                .map(|b| b.bytes)
                .sum()
        })
        .collect();
    let two = sizes[1] + sizes[2];
    assert!(two + sizes[0] > two * 5 / 4, "{sizes:?}");
    let mut store = PrefixCache::with_dir(two * 5 / 4, &dir.0, &model, &scheme).unwrap();
    assert_eq!((store.len(), store.lazy()), (2, 2));
    let extend = |r: &[u32]| cat(r, &[r[5], r[6]]);
    assert!(
        store.lookup(&extend(&r1), 0).is_none(),
        "the oldest file is not indexed"
    );
    assert!(r1_file.exists(), "and stays on disk");
    let hit = store
        .lookup(&extend(&r3), 0)
        .expect("the newest file is read");
    assert_eq!(
        (hit.tokens(), hit.cache().offsets()),
        (&r3[..], vec![r3.len()])
    );
    assert_eq!(store.lazy(), 1);
    drop(store);

    // The folder gone: saving fails (one stderr line), the row is kept in memory.
    let gone = tempdir("gone");
    let mut store = PrefixCache::with_dir(budget, &gone.0, &model, &scheme).unwrap();
    std::fs::remove_dir_all(&gone.0).unwrap();
    store.insert(Sequence::new(r1.clone(), row(&model, &scheme, &r1)).unwrap());
    assert_eq!(store.len(), 1);
    let hit = store
        .lookup(&extend(&r1), 0)
        .expect("the row is held in memory");
    assert_eq!(hit.tokens(), &r1[..]);
    assert!(PrefixCache::with_dir(budget, &gone.0, &model, &scheme).is_err());
}
