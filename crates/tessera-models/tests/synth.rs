//! A synthesized model goes through the whole loader and tokenizer and runs: the file is a
//! real GGUF of the preset's shapes, not a stub.

use candle_core::{Device, Tensor};
use tessera_kv::{KvCache, KvScheme};
use tessera_models::synth::{parse_dtype, preset, write_model};
use tessera_models::{LoadOptions, LogitsMode, Model};

/// Logits `(n, vocab)` as rows.
fn rows(t: &Tensor, vocab: usize) -> Vec<Vec<f32>> {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v.chunks(vocab).map(|r| r.to_vec()).collect()
}

fn argmax(r: &[f32]) -> usize {
    (0..r.len()).max_by(|&a, &b| r[a].total_cmp(&r[b])).unwrap()
}

/// `ids` through the model's uncached reference forward and through the cached forward
/// (a prefill of all but the last 12 tokens, then 12 decode steps): every position's
/// logits agree within `tol` times the largest logit magnitude, and so does the top token
/// wherever the reference's top two are further apart than twice that.
fn compare_cached_with_uncached(model: &Model, ids: &[u32], tol: f32) {
    let Model::Decoder(g) = model;
    let vocab = model.vocab_size();
    let n = ids.len();
    let reference = g.forward_uncached(ids).unwrap();
    assert_eq!(reference.dims(), &[1, n, vocab]);
    let want = rows(&reference, vocab);
    let dev = Device::Cpu;
    let scheme = KvScheme::parse("f32").unwrap();
    let mut cache = KvCache::new(&model.layer_specs(), &scheme, vec![0]).unwrap();
    let p = n - 12;
    let prefill = model
        .forward(
            &Tensor::from_slice(&ids[..p], (1, p), &dev).unwrap(),
            &mut cache,
            LogitsMode::All,
        )
        .unwrap();
    assert_eq!(prefill.dims(), &[1, p, vocab]);
    let mut got = rows(&prefill, vocab);
    for &id in &ids[p..] {
        let step = model
            .forward(
                &Tensor::new(&[[id]], &dev).unwrap(),
                &mut cache,
                LogitsMode::Last,
            )
            .unwrap();
        assert_eq!(step.dims(), &[1, 1, vocab]);
        got.extend(rows(&step, vocab));
    }
    assert_eq!(cache.end(), n);
    let scale = want.iter().flatten().fold(0f32, |a, v| a.max(v.abs()));
    assert!(scale.is_finite() && scale > 1e-3, "logit scale {scale}");
    let mut checked_top = 0;
    for (pos, (w, g)) in want.iter().zip(&got).enumerate() {
        let diff = w.iter().zip(g).fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(
            diff <= tol * scale,
            "position {pos}: cached and uncached logits differ by {diff} (scale {scale})"
        );
        let top = argmax(w);
        let second = (0..vocab)
            .filter(|&i| i != top)
            .map(|i| w[i])
            .fold(f32::MIN, f32::max);
        if w[top] - second > 2.0 * tol * scale {
            assert_eq!(argmax(g), top, "position {pos}: top token");
            checked_top += 1;
        }
    }
    // Most positions have a clear top token: the check above is not vacuous.
    assert!(
        checked_top * 2 >= n,
        "{checked_top} of {n} positions had a clear top token"
    );
}

#[test]
fn tiny_gemma3_loads_tokenizes_and_runs() {
    let dir = std::env::temp_dir().join(format!("tessera-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    let shape = preset("gemma3", "tiny").unwrap();
    write_model(&shape, parse_dtype("q8_0").unwrap(), 7, &path).unwrap();
    assert!(!path.with_extension("gguf.partial").exists());
    let (model, tokenizer) = Model::load(&path, &LoadOptions::default(), &Device::Cpu).unwrap();
    let Model::Decoder(g) = &model;
    let c = g.config();
    assert_eq!(
        (c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.ffn),
        (64, 6, 2, 1, 32, 128)
    );
    assert_eq!(model.vocab_size(), 512);
    // Six layers with the sliding pattern of six: one global layer, five windows of 16.
    let windows = model
        .layer_specs()
        .iter()
        .filter(|s| s.retention != tessera_kv::Retention::Full)
        .count();
    assert_eq!(windows, 5);
    // Byte fallback tokenizes any text: the vocabulary's pieces (`▁w0`, …) match no word
    // here, so after BOS (id 2) comes one token per byte of the text with spaces as `▁`,
    // byte b being `<0xBB>` at id 6 + b.
    let text = "Synthetic weights, real shapes: é, past a window of 16.";
    let ids = tokenizer.encode(text, true).unwrap();
    let bytes = text.replace(' ', "\u{2581}").into_bytes();
    let want: Vec<u32> = std::iter::once(2)
        .chain(bytes.iter().map(|&b| 6 + b as u32))
        .collect();
    assert_eq!(ids, want);
    // The cached forward (a prefill chunk longer than the window, then decode steps) gives
    // the uncached reference's logits; both with f32 weights and the f32 cache, the two
    // differ only in the order of float operations in attention (measured: 6e-7 of the
    // logit scale; the bound leaves 30 times that).
    let dequantized = LoadOptions {
        dequantize: true,
        ..Default::default()
    };
    let (f32_model, _) = Model::load(&path, &dequantized, &Device::Cpu).unwrap();
    compare_cached_with_uncached(&f32_model, &ids, 2e-5);
    // The quantized model too: there the two paths' activations may also round to
    // neighbouring int8 codes in the quantized matmuls (the decode steps' one-row kernel and
    // the whole-sequence reference's multi-row kernel sum in different orders; at the AMX
    // level the two are different instructions altogether), each such step moving an
    // output by max|x| / 127 times one weight, and attention carries it on. Measured: 2e-7
    // of the logit scale with no step taken (VNNI), 6.3e-3 after one flip at position 67
    // (AMX); a cache that reads a wrong position moves the logits by O(1).
    compare_cached_with_uncached(&model, &ids, 1.5e-2);
    // The same seed writes the same file; another seed does not.
    let again = dir.join("again.gguf");
    write_model(&shape, parse_dtype("q8_0").unwrap(), 7, &again).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(&again).unwrap()
    );
    write_model(&shape, parse_dtype("q8_0").unwrap(), 8, &again).unwrap();
    assert_ne!(
        std::fs::read(&path).unwrap(),
        std::fs::read(&again).unwrap()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_synth_requests_name_the_problem() {
    let e = preset("mistral", "tiny").unwrap_err().to_string();
    assert!(e.contains("mistral") && e.contains("qwen3"), "{e}");
    let e = preset("llama", "gemma3-12b").unwrap_err().to_string();
    assert!(e.contains("llama3-8b"), "{e}");
    let e = preset("gemma3", "gemma3-9b").unwrap_err().to_string();
    assert!(e.contains("gemma3-9b") && e.contains("gemma3-12b"), "{e}");
    let e = parse_dtype("iq2_xxs").unwrap_err().to_string();
    assert!(e.contains("iq2_xxs") && e.contains("q6_k"), "{e}");
    // 12B really is twelve billion parameters (embeddings included).
    let p = preset("gemma3", "gemma3-12b").unwrap().parameters();
    assert!((11_000_000_000..13_500_000_000).contains(&p), "{p}");
    // Llama 3 8B with a tied output layer: 8.03 B less its 0.53 B output matrix.
    let p = preset("llama", "llama3-8b").unwrap().parameters();
    assert!((7_400_000_000..7_600_000_000).contains(&p), "{p}");
}

#[test]
fn tiny_llama_and_qwen3_load_with_every_layer_global() {
    let dir = std::env::temp_dir().join(format!("tessera-synth-lq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for arch in ["llama", "qwen3"] {
        let path = dir.join(format!("{arch}.gguf"));
        let shape = preset(arch, "tiny").unwrap();
        write_model(&shape, parse_dtype("q8_0").unwrap(), 1, &path).unwrap();
        let (model, _) = Model::load(&path, &LoadOptions::default(), &Device::Cpu).unwrap();
        assert_eq!(model.architecture(), arch);
        let specs = model.layer_specs();
        assert_eq!(specs.len(), 4);
        assert!(specs
            .iter()
            .all(|s| s.retention == tessera_kv::Retention::Full && s.kv_heads == 2));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
