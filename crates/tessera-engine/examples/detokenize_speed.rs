//! What streaming detokenization costs a token: the first 17,000 characters of the shared
//! corpus encoded by each GGUF's own tokenizer, then pushed through a `TextStream` token by
//! token (as the engine does for every row of every step), timed at 256, 1024 and 4096
//! tokens, and checked against one decode of the same ids; beside it, what a push cost
//! when it re-decoded the whole sequence (the stream before its window).
//!
//! `cargo run --release -p tessera-engine --example detokenize_speed -- MODEL.gguf …`

use std::time::Instant;
use tessera_engine::TextStream;
use tessera_models::{GgufFile, Tokenizer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let corpus = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/corpus/pride-and-prejudice.txt"
    );
    let text = std::fs::read_to_string(corpus)?;
    let text = &text[..text
        .char_indices()
        .nth(17_000)
        .map_or(text.len(), |(i, _)| i)];
    for model in std::env::args().skip(1) {
        let tok = Tokenizer::from_gguf(&GgufFile::open(std::path::Path::new(&model))?)?;
        let all = tok.encode(text, false)?;
        for n in [256usize, 1024, 4096] {
            let ids = &all[..n.min(all.len())];
            let started = Instant::now();
            let mut stream = TextStream::new();
            let mut streamed = String::new();
            for &id in ids {
                streamed.push_str(&stream.push(&tok, id)?);
            }
            streamed.push_str(&stream.finish());
            let per_token = started.elapsed().as_secs_f64() * 1e6 / ids.len() as f64;
            if streamed != tok.decode(ids)? {
                return Err(format!("{model}: the stream differs from one decode").into());
            }
            let started = Instant::now();
            for i in 1..=ids.len() {
                tok.decode(&ids[..i])?;
            }
            let per_whole = started.elapsed().as_secs_f64() * 1e6 / ids.len() as f64;
            println!(
                "{model}: {} tokens streamed, {per_token:.1} µs a token; re-decoding the whole \
                 sequence a push, {per_whole:.1} µs",
                ids.len()
            );
        }
    }
    Ok(())
}
