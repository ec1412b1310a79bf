//! Prompt caches on disk with the real model: a saved and loaded cache continues with the
//! same logits bit for bit as the cache that was saved (bf16, affine:4, turbo:4, `:global`,
//! a per-layer mix, a nonzero `quantized_kv_start`; Gemma 3's 512-position rings past
//! their wrap), and a prompt extending the cached one gives the cold run's greedy tokens.

mod common;

use tessera_engine::prompt_cache::{self, ReuseLimit};
use tessera_engine::{argmax, EngineError, Generation, SamplerConfig, Session};
use tessera_kv::{KvCache, KvScheme};
use tessera_models::{LogitsMode, Model};

const CHUNK: usize = 128;

fn corpus_tokens(tok: &tessera_models::Tokenizer, at: usize, n: usize) -> Vec<u32> {
    let chars: Vec<char> = common::corpus().chars().collect();
    let text: String = chars[at..at + 8 * n].iter().collect();
    let mut ids = tok.encode(&text, true).unwrap();
    assert!(ids.len() >= n, "{} tokens of text", ids.len());
    ids.truncate(n);
    ids
}

fn schemes() -> Vec<(&'static str, KvScheme)> {
    let mix = r#"{"default": "affine:4", "sliding": "turbo:3",
                  "layers": [{"layer": 5, "scheme": "bf16"}, {"layer": 0, "scheme": "affine:8:32"}]}"#;
    let mut late = KvScheme::parse("affine:4").unwrap();
    late.quantized_kv_start = 200;
    vec![
        ("bf16", KvScheme::parse("bf16").unwrap()),
        ("affine:4", KvScheme::parse("affine:4").unwrap()),
        ("turbo:4", KvScheme::parse("turbo:4").unwrap()),
        ("turbo:4:global", KvScheme::parse("turbo:4:global").unwrap()),
        ("mix", KvScheme::from_config_json(mix).unwrap()),
        ("affine:4 from 200", late),
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn a_saved_cache_continues_with_the_same_logits_bit_for_bit() {
    let (model, tok) = common::load(true);
    let dir = tempdir();
    // 600 tokens: every sliding layer's 512-slot ring has wrapped.
    let prompt = corpus_tokens(&tok, 1000, 600);
    for (name, scheme) in schemes() {
        let mut saved = Session::new(&model, &scheme, CHUNK).unwrap();
        let mut next = argmax(&saved.feed(&prompt).unwrap());
        let path = dir.join(format!("{}.tpc", name.replace([':', ' '], "_")));
        let bytes = prompt_cache::save(&path, &model, std::slice::from_ref(&prompt), saved.cache())
            .unwrap();
        assert_eq!(bytes, std::fs::metadata(&path).unwrap().len(), "{name}");
        let loaded = prompt_cache::load(&path, &model, Some(&scheme)).unwrap();
        assert_eq!(loaded.tokens, vec![prompt.clone()], "{name}");
        assert_eq!(
            loaded.cache.state().unwrap(),
            saved.cache().state().unwrap(),
            "{name}: the loaded state"
        );
        let mut resumed = loaded.into_session(&model, CHUNK).unwrap();
        // Decode steps, then a chunk of several tokens: every logit the same bits.
        for step in 0..4 {
            let a = saved.forward(&[next], LogitsMode::Last).unwrap();
            let b = resumed.forward(&[next], LogitsMode::Last).unwrap();
            assert!(bits(&a) == bits(&b), "{name}: step {step} logits differ");
            next = argmax(&a);
        }
        let chunk = &prompt[..9];
        let a = saved.forward(chunk, LogitsMode::All).unwrap();
        let b = resumed.forward(chunk, LogitsMode::All).unwrap();
        assert!(bits(&a) == bits(&b), "{name}: chunk logits differ");
        // Without --kv the file's own scheme is taken, and it builds the same layers.
        let own = prompt_cache::load(&path, &model, None).unwrap();
        assert_eq!(
            own.cache.signatures(),
            saved.cache().signatures(),
            "{name}: the file's scheme"
        );
    }
}

#[test]
fn a_cache_of_several_rows_round_trips_and_a_mismatch_is_named() {
    let (model, tok) = common::load(true);
    let dir = tempdir();
    let scheme = KvScheme::parse("turbo:4").unwrap();
    let rows = [corpus_tokens(&tok, 3000, 40), corpus_tokens(&tok, 6000, 90)];
    let caches: Vec<KvCache> = rows
        .iter()
        .map(|p| {
            let mut s = Session::new(&model, &scheme, CHUNK).unwrap();
            s.feed(p).unwrap();
            s.cache().extract(0).unwrap()
        })
        .collect();
    let merged = KvCache::merge(caches).unwrap();
    let path = dir.join("rows.tpc");
    prompt_cache::save(&path, &model, &rows, &merged).unwrap();
    let loaded = prompt_cache::load(&path, &model, None).unwrap();
    assert_eq!(loaded.tokens, rows.to_vec());
    assert_eq!(loaded.cache.state().unwrap(), merged.state().unwrap());
    // The wrong token counts are refused at save time.
    let err = prompt_cache::save(&path, &model, &[rows[1].clone(), rows[0].clone()], &merged);
    assert!(matches!(err, Err(EngineError::PromptCache(_))));
    // Another scheme than the file's: the layer and both signatures are named.
    let err = prompt_cache::load(&path, &model, Some(&KvScheme::parse("affine:4").unwrap()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("layer 0 signature")
            && err.contains("turbo:4:4")
            && err.contains("affine:4:64"),
        "{err}"
    );
    let err = prompt_cache::load(&path, &model, None)
        .unwrap()
        .into_session(&model, CHUNK)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("2 rows"), "{err}");
}

#[test]
fn a_prompt_extending_the_cache_gives_the_cold_greedy_tokens() {
    // Quantized weights as shipped: the cached prompt ends where a chunk of the cold run
    // ends, so both read the same chunks and every matmul has the same shapes (a quantized
    // matmul's sums depend on its row count, so other chunks could flip a near tie).
    let (model, tok) = common::load(true);
    let dir = tempdir();
    let extra = corpus_tokens(&tok, 20000, 30);
    let greedy = SamplerConfig::default();
    for (name, scheme) in schemes()
        .into_iter()
        .filter(|(n, _)| ["bf16", "affine:4", "turbo:4", "affine:4 from 200"].contains(n))
    {
        // Prefill chunks also end at quantized_kv_start (where the cache converts).
        let cached = corpus_tokens(&tok, 9000, scheme.quantized_kv_start + 5 * CHUNK);
        let prompt: Vec<u32> = cached.iter().chain(&extra[1..]).copied().collect();
        let mut cold = Session::new(&model, &scheme, CHUNK).unwrap();
        let want: Vec<u32> = Generation::new(&mut cold, &prompt, greedy.clone(), 24, vec![])
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let path = dir.join(format!("x-{}.tpc", name.replace([':', ' '], "_")));
        let mut s = Session::new(&model, &scheme, CHUNK).unwrap();
        s.feed(&cached).unwrap();
        prompt_cache::save(&path, &model, std::slice::from_ref(&cached), s.cache()).unwrap();
        let loaded = prompt_cache::load(&path, &model, Some(&scheme)).unwrap();
        let (mut warm, reuse) = loaded.resume(&model, &scheme, &prompt, CHUNK).unwrap();
        assert_eq!(reuse.tokens, cached.len(), "{name}");
        assert_eq!(warm.tokens(), &cached[..], "{name}");
        let got: Vec<u32> = Generation::new(
            &mut warm,
            &prompt[reuse.tokens..],
            greedy.clone(),
            24,
            vec![],
        )
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
        assert_eq!(got, want, "{name}");
        assert_eq!(warm.prefill_tokens, prompt.len() - cached.len(), "{name}");
    }
}

#[test]
fn reuse_stops_at_the_floor_and_at_what_a_ring_still_holds() {
    let (model, tok) = common::load(true);
    let dir = tempdir();
    let cached = corpus_tokens(&tok, 12000, 700);
    let mut late = KvScheme::parse("affine:4").unwrap();
    late.quantized_kv_start = 200;
    let cases: [(&str, KvScheme, usize, Option<ReuseLimit>); 4] = [
        // The prompt parts from the cache at 100, below the floor of 200: nothing reused.
        ("floor", late.clone(), 100, Some(ReuseLimit::Floor(200))),
        // At 300 it is above the floor; but the rings (512 of 700) cannot go back to 300.
        ("ring", late, 300, Some(ReuseLimit::Ring)),
        // The same prompt again: all but its last token (whose logits are needed).
        ("same", KvScheme::parse("bf16").unwrap(), 700, None),
        // Parting one short of the end is a trim the rings allow.
        ("one short", KvScheme::parse("turbo:4").unwrap(), 699, None),
    ];
    for (name, scheme, common_len, limit) in cases {
        let mut s = Session::new(&model, &scheme, CHUNK).unwrap();
        s.feed(&cached).unwrap();
        let path = dir.join(format!("r-{}.tpc", name.replace(' ', "_")));
        prompt_cache::save(&path, &model, std::slice::from_ref(&cached), s.cache()).unwrap();
        let mut prompt = cached[..common_len].to_vec();
        if common_len < cached.len() {
            // A different token where they part, then a few more.
            prompt.push((cached[common_len] + 1) % model.vocab_size() as u32);
            prompt.extend_from_slice(&cached[..5]);
        }
        let loaded = prompt_cache::load(&path, &model, Some(&scheme)).unwrap();
        let (warm, reuse) = loaded.resume(&model, &scheme, &prompt, CHUNK).unwrap();
        assert_eq!(reuse.limited_by, limit, "{name}");
        let want = match limit {
            Some(_) => 0,
            None => common_len.min(prompt.len() - 1),
        };
        assert_eq!(reuse.tokens, want, "{name}");
        assert_eq!(warm.tokens(), &prompt[..want], "{name}");
        assert_eq!(warm.cache().offsets(), vec![want], "{name}");
    }
}

#[test]
fn another_model_is_refused_by_its_fingerprint() {
    let (model, tok) = common::load(true);
    let dir = tempdir();
    let scheme = KvScheme::parse("bf16").unwrap();
    let mut s = Session::new(&model, &scheme, CHUNK).unwrap();
    s.feed(&corpus_tokens(&tok, 100, 20)).unwrap();
    let path = dir.join("fp.tpc");
    prompt_cache::save(&path, &model, &[s.tokens().to_vec()], s.cache()).unwrap();
    // The same architecture and shapes from another GGUF: a synthetic Gemma 3 270M.
    let other = dir.join("other.gguf");
    let shape = tessera_models::synth::preset("gemma3", "gemma3-270m").unwrap();
    tessera_models::synth::write_model(
        &shape,
        tessera_models::synth::parse_dtype("q8_0").unwrap(),
        7,
        &other,
    )
    .unwrap();
    let (other, _) = Model::load(&other, &Default::default(), &candle_core::Device::Cpu).unwrap();
    assert_eq!(other.layer_specs(), model.layer_specs());
    let err = prompt_cache::load(&path, &other, None)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("model fingerprint"), "{err}");
    assert!(err.contains("fp.tpc"), "{err}");
}

/// A fresh folder under the system's temp dir, removed when dropped.
struct TempDir(std::path::PathBuf);

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempdir() -> TempDir {
    let dir = std::env::temp_dir().join(format!(
        "tessera-prompt-cache-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    TempDir(dir)
}
