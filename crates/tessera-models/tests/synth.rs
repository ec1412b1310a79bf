//! A synthesized model goes through the whole loader and tokenizer and runs: the file is a
//! real GGUF of the preset's shapes, not a stub.

use candle_core::Device;
use tessera_models::synth::{parse_dtype, preset, write_model};
use tessera_models::{LoadOptions, Model};

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
    // Byte fallback tokenizes any text; the model gives finite logits over the vocabulary.
    let ids = tokenizer
        .encode("Synthetic weights, real shapes: é", true)
        .unwrap();
    assert!(ids.len() > 5, "{ids:?}");
    let logits = g.forward_uncached(&ids).unwrap();
    let v: Vec<f32> = logits.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(v.len() % 512, 0);
    assert!(v.iter().all(|x| x.is_finite()));
    assert!(v.iter().any(|x| *x != v[0]), "logits vary");
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
    let e = parse_dtype("q3_k").unwrap_err().to_string();
    assert!(e.contains("q3_k"), "{e}");
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
