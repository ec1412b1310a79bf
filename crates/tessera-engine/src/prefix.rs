//! Prefix reuse: finished requests' rows kept by the tokens they hold, least recently used
//! first out within a byte budget, so a request sharing a prefix with one of them (a system
//! prompt, a conversation's history) reads only its new suffix.
//!
//! A stored row is reused up to the longest common prefix with the new prompt, short of the
//! prompt's last token (whose logits the request needs), and only where the cache can give
//! that prefix back exactly: never below a layer's reuse floor (`minimum_reusable_offset`:
//! positions a nonzero `quantized_kv_start` stored quantized, which a fresh prefill would
//! hold in bf16), and never past what a sliding-window ring still holds (trimming a wrapped
//! ring back further than its round slack + 1 is refused — on Gemma 3, whose sliding
//! layers keep 512 positions, a stored row longer than 512 is reused only at its own length
//! or one short of it).
//!
//! With a folder ([`PrefixCache::with_dir`], the server's `--prompt-cache-dir`) the store
//! mirrors itself on disk: every row kept is also saved as a prompt cache file
//! (`<first 16 hex digits of the sha256 of its tokens>.tpc`, [`file_name`]), and a row
//! evicted or made redundant has its file deleted. A new store on the folder indexes the
//! files that fit its model and scheme from their headers alone (newest first, within the
//! budget) and reads one only when a lookup picks it; a file that fails to read then is
//! dropped from the index and the lookup goes on with the other rows. Files that do not
//! fit are skipped, never deleted (they may be another model's).

use crate::sequence::{reuse_of, Sequence};
use crate::{prompt_cache, EngineError};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::time::SystemTime;
use tessera_kv::{KvCache, KvScheme};
use tessera_models::Model;

struct Entry {
    tokens: Vec<u32>,
    /// `None`: indexed from its file, read at the first lookup that picks it.
    cache: Option<KvCache>,
    /// The reuse floor (a lazy entry's from its file's header).
    floor: Option<usize>,
    /// Counted against the budget (a lazy entry's from its file's buffer sizes).
    bytes: usize,
    used: u64,
    /// Its file in the store's folder; `None` without a folder or where saving failed.
    file: Option<PathBuf>,
}

/// The folder a store mirrors itself to, and what its files must fit.
struct Disk<'m> {
    dir: PathBuf,
    model: &'m Model,
    scheme: KvScheme,
}

/// Finished rows by their tokens; see the module docs.
pub struct PrefixCache<'m> {
    budget: usize,
    entries: Vec<Entry>,
    clock: u64,
    hits: u64,
    reused_tokens: u64,
    disk: Option<Disk<'m>>,
    /// What the folder mirror has to say (files skipped, dropped, not saved), for the
    /// caller to log: library code prints nothing.
    notes: Vec<String>,
}

/// The store's file name for a row holding `tokens`: the first 16 hex digits of the
/// sha256 of the tokens as little-endian u32s, then `.tpc`.
pub fn file_name(tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let hex: String = h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{hex}.{}", prompt_cache::EXTENSION)
}

/// `e`'s text without the `prompt cache: ` and `path: ` the callers' lines already say.
fn reason(e: &EngineError, path: &Path) -> String {
    match e {
        EngineError::PromptCache(m) => {
            let at = format!("{}: ", path.display());
            m.strip_prefix(&at).unwrap_or(m).to_string()
        }
        e => e.to_string(),
    }
}

impl<'m> PrefixCache<'m> {
    /// A store of at most `budget` bytes of KV planes, in memory only.
    pub fn new(budget: usize) -> Self {
        PrefixCache {
            budget,
            entries: Vec::new(),
            clock: 0,
            hits: 0,
            reused_tokens: 0,
            disk: None,
            notes: Vec::new(),
        }
    }

    /// The notes gathered since the last call (see the `notes` field), oldest first.
    pub fn take_notes(&mut self) -> Vec<String> {
        std::mem::take(&mut self.notes)
    }

    /// A store of at most `budget` bytes mirrored to the folder `dir` (which must exist),
    /// for `model` under `scheme`, with the folder's fitting files indexed as lazy entries:
    /// newest (by modification time) first, until the next would pass the budget (that
    /// one and older are left on disk, unindexed). A file whose header does not read or
    /// does not fit this model and scheme is skipped with one stderr line; none is
    /// deleted here. Errs only when the folder cannot be listed.
    pub fn with_dir(
        budget: usize,
        dir: &Path,
        model: &'m Model,
        scheme: &KvScheme,
    ) -> Result<Self, EngineError> {
        let list = std::fs::read_dir(dir)
            .map_err(|e| EngineError::PromptCache(format!("cannot list {}: {e}", dir.display())))?;
        let mut files: Vec<(SystemTime, PathBuf)> = list
            .filter_map(|entry| {
                let entry = entry.ok()?;
                let path = entry.path();
                let tpc = path
                    .extension()
                    .is_some_and(|x| x == prompt_cache::EXTENSION);
                let meta = entry.metadata().ok().filter(|m| m.is_file() && tpc)?;
                Some((meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), path))
            })
            .collect();
        // Newest first; equal times by name, so the order does not depend on the listing.
        files.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        let mut store = PrefixCache::new(budget);
        let mut beyond = 0;
        for (_, path) in files {
            let header = prompt_cache::read_header(&path)
                .and_then(|(h, _)| prompt_cache::check_header(&h, model, scheme).map(|()| h));
            let header = match header {
                Ok(h) => h,
                Err(e) => {
                    store.notes.push(format!(
                        "prompt cache: skipping {}: {}",
                        path.display(),
                        reason(&e, &path)
                    ));
                    continue;
                }
            };
            let [tokens] = header.tokens.as_slice() else {
                store.notes.push(format!(
                    "prompt cache: skipping {}: a cache of {} rows (the prefix store keeps \
                     one-row caches)",
                    path.display(),
                    header.tokens.len()
                ));
                continue;
            };
            // A newer file holding the same tokens covers this one. One that extends them
            // may not (a wrapped ring cannot be cut back, which its header alone does not
            // tell), so both are indexed, as `insert` would have kept both.
            if tokens.is_empty() || store.entries.iter().any(|e| e.tokens == *tokens) {
                continue;
            }
            // Saturating: the sizes are the file's word until it is read.
            let bytes = header
                .layers
                .iter()
                .flat_map(|l| &l.buffers)
                .fold(0usize, |sum, b| sum.saturating_add(b.bytes));
            if beyond > 0 || store.bytes().saturating_add(bytes) > budget {
                beyond += 1;
                continue;
            }
            store.entries.push(Entry {
                tokens: tokens.clone(),
                cache: None,
                floor: header.minimum_reusable_offset,
                bytes,
                used: 0,
                file: Some(path),
            });
        }
        // The newest file is the most recently used.
        let n = store.entries.len() as u64;
        for (i, e) in store.entries.iter_mut().enumerate() {
            e.used = n - i as u64;
        }
        store.clock = n;
        store.notes.push(format!(
            "prompt cache: {}: {n} cached prefixes indexed ({:.1} MiB of {:.1}){}",
            dir.display(),
            store.bytes() as f64 / (1 << 20) as f64,
            budget as f64 / (1 << 20) as f64,
            if beyond > 0 {
                format!(", {beyond} older files past the budget left unindexed")
            } else {
                String::new()
            }
        ));
        store.disk = Some(Disk {
            dir: dir.to_path_buf(),
            model,
            scheme: scheme.clone(),
        });
        Ok(store)
    }

    /// KV bytes held, counting indexed files not read yet at their size on disk.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Rows held, in memory or indexed on disk.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Rows indexed from the folder and not read yet.
    pub fn lazy(&self) -> usize {
        self.entries.iter().filter(|e| e.cache.is_none()).count()
    }

    /// Lookups that reused a prefix, and the prompt tokens they did not have to read.
    pub fn hits(&self) -> (u64, u64) {
        (self.hits, self.reused_tokens)
    }

    /// Keeps `row`, evicting the least recently used
    /// rows past the budget. A row larger than the whole budget, or one whose tokens another
    /// row already holds (or extends and can be cut back to), is not kept. With a folder the
    /// row is saved there too (a failure is a note; the row is then kept in memory only),
    /// and the files of rows it replaces or evicts are deleted.
    pub fn insert(&mut self, row: Sequence) {
        let (tokens, cache) = row.into_parts();
        let bytes = cache.allocated_bytes();
        if tokens.is_empty() || bytes > self.budget {
            return;
        }
        if self
            .entries
            .iter()
            .any(|e| covers(&e.tokens, e.cache.as_ref(), &tokens))
        {
            return;
        }
        // A stored row this one covers is now redundant. Its file goes before the new one
        // is written, so a (vanishingly unlikely) name collision keeps the new file.
        let (redundant, kept): (Vec<Entry>, Vec<Entry>) = std::mem::take(&mut self.entries)
            .into_iter()
            .partition(|e| covers(&tokens, Some(&cache), &e.tokens));
        self.entries = kept;
        for e in redundant {
            self.notes.extend(remove_file(e.file.as_deref()));
        }
        let file = self.save(&tokens, &cache);
        self.clock += 1;
        self.entries.push(Entry {
            floor: cache.minimum_reusable_offset(),
            tokens,
            cache: Some(cache),
            bytes,
            used: self.clock,
            file,
        });
        self.evict();
    }

    /// `cache` saved to the folder under its tokens' name, where there is a folder.
    fn save(&mut self, tokens: &[u32], cache: &KvCache) -> Option<PathBuf> {
        let disk = self.disk.as_ref()?;
        let path = disk.dir.join(file_name(tokens));
        match prompt_cache::save(&path, disk.model, &[tokens.to_vec()], cache) {
            Ok(_) => Some(path),
            Err(e) => {
                self.notes.push(format!(
                    "prompt cache: cannot save {} (the prefix stays in memory only): {}",
                    path.display(),
                    reason(&e, &path)
                ));
                None
            }
        }
    }

    /// Drops the least recently used rows (and their files) while past the budget.
    fn evict(&mut self) {
        while self.bytes() > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            let e = self.entries.remove(oldest);
            self.notes.extend(remove_file(e.file.as_deref()));
        }
    }

    /// Reads lazy entry `i` from its file; on failure says why on stderr and returns
    /// false (the caller drops the entry).
    fn load(&mut self, i: usize) -> bool {
        let (Some(disk), Some(path)) = (self.disk.as_ref(), self.entries[i].file.as_deref()) else {
            return false;
        };
        let why = match prompt_cache::load(path, disk.model, Some(&disk.scheme)) {
            Ok(p) if p.tokens.len() == 1 && p.tokens[0] == self.entries[i].tokens => {
                let e = &mut self.entries[i];
                e.bytes = p.cache.allocated_bytes();
                e.floor = p.cache.minimum_reusable_offset();
                e.cache = Some(p.cache);
                return true;
            }
            Ok(_) => "its tokens changed since the folder was indexed".to_string(),
            Err(e) => reason(&e, path),
        };
        self.notes.push(format!(
            "prompt cache: dropping {} from the index: {why}",
            path.display()
        ));
        false
    }

    /// The longest reusable prefix of `prompt` (by [`crate::sequence::reuse_of`]), or
    /// `None`. The stored row stays (a copy is handed out). A lazy row that the longest
    /// match picks is read from its file first; one that fails to read is dropped from
    /// the index and the next longest match is tried. Only rows of `round_slack` count (a
    /// row joins a batch of its own slack only; files saved by a server without
    /// speculation have none).
    pub fn lookup(&mut self, prompt: &[u32], round_slack: usize) -> Option<Sequence> {
        let limit = prompt.len().saturating_sub(1);
        // Longest first; equal lengths in store order (the first stored wins).
        let mut candidates: Vec<(usize, usize)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                let common = e
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                let len = common.min(limit);
                let floored = e.floor.is_some_and(|floor| len < floor);
                (len > 0 && !floored).then_some((len, i))
            })
            .collect();
        candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut failed = Vec::new();
        let mut best = None;
        for (_, i) in candidates {
            if self.entries[i].cache.is_none() && !self.load(i) {
                failed.push(i);
                continue;
            }
            let e = &self.entries[i];
            let Some(cache) = e.cache.as_ref() else {
                continue;
            };
            if cache.round_slack() != round_slack {
                continue;
            }
            let reuse = reuse_of(&e.tokens, cache, prompt);
            if reuse.tokens == 0 {
                continue;
            }
            let Ok(mut copy) = cache.extract(0) else {
                continue;
            };
            if copy.trim(e.tokens.len() - reuse.tokens).is_err() {
                continue;
            }
            best = Some((i, copy, reuse.tokens));
            break;
        }
        if let Some((i, _, len)) = &best {
            self.clock += 1;
            self.entries[*i].used = self.clock;
            self.hits += 1;
            self.reused_tokens += *len as u64;
            touch(self.entries[*i].file.as_deref());
        }
        // Unreadable files leave the index (their files stay: nothing here wrote them).
        let mut i = 0;
        self.entries.retain(|_| {
            i += 1;
            !failed.contains(&(i - 1))
        });
        // A row read from disk may hold more than its file's buffers said.
        self.evict();
        best.and_then(|(_, cache, len)| Sequence::new(prompt[..len].to_vec(), cache).ok())
    }
}

/// Whether a row holding `longer` (in `cache`; `None`: not read yet, taken to) gives back
/// `shorter`: it extends it and can be cut back to it (a wrapped ring cannot give back
/// more than its slack).
fn covers(longer: &[u32], cache: Option<&KvCache>, shorter: &[u32]) -> bool {
    longer.starts_with(shorter) && cache.is_none_or(|c| c.can_trim(longer.len() - shorter.len()))
}

/// Deletes a dropped row's file, where it has one; the note when that fails.
fn remove_file(path: Option<&Path>) -> Option<String> {
    let path = path?;
    match std::fs::remove_file(path) {
        Ok(()) => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => Some(format!(
            "prompt cache: cannot delete {}: {e}",
            path.display()
        )),
    }
}

/// Marks a reused row's file as just used, so the next index orders it newest.
fn touch(path: Option<&Path>) {
    if let Some(path) = path {
        if let Ok(f) = std::fs::File::options().write(true).open(path) {
            let _ = f.set_modified(SystemTime::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::file_name;
    use sha2::{Digest, Sha256};

    #[test]
    fn file_names_hash_the_little_endian_tokens() {
        let bytes: Vec<u8> = [1u32, 258].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(bytes, [1, 0, 0, 0, 2, 1, 0, 0]);
        let hex: String = Sha256::digest(&bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(file_name(&[1, 258]), format!("{}.tpc", &hex[..16]));
        assert_ne!(file_name(&[1, 258]), file_name(&[258, 1]));
    }
}
