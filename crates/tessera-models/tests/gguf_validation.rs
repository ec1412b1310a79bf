//! A GGUF with a bad value fails to load with an error that names the key (or tensor)
//! and the value, never a panic: each case rewrites a synthesized tiny model's metadata
//! (its tensors copied as they are) and loads the result.

use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use std::path::Path;
use tessera_kv::{KvCache, KvScheme};
use tessera_models::{LoadOptions, LogitsMode, Model};

mod common;
use common::{tiny, Dir};

type Metadata = Vec<(String, Value)>;
type Tensors = Vec<(String, QTensor)>;

/// The metadata and tensors of `src`.
fn read(src: &Path) -> (Metadata, Tensors) {
    let mut file = std::fs::File::open(src).unwrap();
    let content = Content::read(&mut file).unwrap();
    let mut md: Vec<(String, Value)> = content.metadata.clone().into_iter().collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let ts = names
        .into_iter()
        .map(|n| {
            (
                n.clone(),
                content.tensor(&mut file, n, &Device::Cpu).unwrap(),
            )
        })
        .collect();
    (md, ts)
}

/// `src` rewritten to `dst` with `edit` applied to its metadata.
fn rewrite(src: &Path, dst: &Path, edit: impl FnOnce(&mut Vec<(String, Value)>)) {
    let (mut md, ts) = read(src);
    edit(&mut md);
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut w = std::io::BufWriter::new(std::fs::File::create(dst).unwrap());
    gguf_file::write(&mut w, &md, &ts).unwrap();
}

/// Sets (or adds) `key`.
fn set(md: &mut Vec<(String, Value)>, key: &str, value: Value) {
    md.retain(|(k, _)| k != key);
    md.push((key.to_string(), value));
}

fn remove(md: &mut Vec<(String, Value)>, key: &str) {
    let before = md.len();
    md.retain(|(k, _)| k != key);
    assert_eq!(md.len() + 1, before, "{key} was there");
}

/// Loads `path`; a panic fails the test with `what`.
fn load(path: &Path, what: &str) -> Result<Model, String> {
    std::panic::catch_unwind(|| {
        Model::load(path, &LoadOptions::default(), &Device::Cpu)
            .map(|(m, _)| m)
            .map_err(|e| e.to_string())
    })
    .unwrap_or_else(|_| panic!("{what}: loading panicked"))
}

fn load_error(path: &Path, what: &str) -> String {
    match load(path, what) {
        Ok(_) => panic!("{what}: loaded"),
        Err(e) => e,
    }
}

#[test]
fn bad_metadata_values_are_errors_naming_key_and_value() {
    let dir = Dir::new("bad");
    let gemma = tiny(&dir.0, "gemma3");
    let llama = tiny(&dir.0, "llama");
    let u = Value::U32;
    // (source, edit, what the message must contain)
    type Edit = Box<dyn FnOnce(&mut Vec<(String, Value)>)>;
    let setting = |key: &'static str, v: Value| -> Edit { Box::new(move |md| set(md, key, v)) };
    let cases: Vec<(&Path, Edit, Vec<&str>)> = vec![
        (
            &gemma,
            setting("gemma3.attention.head_count", u(0)),
            vec!["`gemma3.attention.head_count` = 0", "positive"],
        ),
        (
            &gemma,
            setting("gemma3.attention.head_count_kv", u(0)),
            vec!["`gemma3.attention.head_count_kv` = 0"],
        ),
        // Tiny Gemma has 2 query heads: 3 KV heads do not divide them.
        (
            &gemma,
            setting("gemma3.attention.head_count_kv", u(3)),
            vec![
                "`gemma3.attention.head_count_kv` = 3",
                "gemma3.attention.head_count = 2",
            ],
        ),
        (
            &gemma,
            setting("gemma3.attention.sliding_window", u(0)),
            vec!["`gemma3.attention.sliding_window` = 0"],
        ),
        (
            &gemma,
            setting("gemma3.embedding_length", u(0)),
            vec!["`gemma3.embedding_length` = 0"],
        ),
        (
            &gemma,
            setting("gemma3.block_count", u(0)),
            vec!["`gemma3.block_count` = 0"],
        ),
        (
            &gemma,
            setting("gemma3.block_count", u(u32::MAX)),
            vec!["`gemma3.block_count` = 4294967295", "65536"],
        ),
        (
            &gemma,
            setting("gemma3.context_length", u(0)),
            vec!["`gemma3.context_length` = 0"],
        ),
        (
            &gemma,
            setting("gemma3.feed_forward_length", u(0)),
            vec!["`gemma3.feed_forward_length` = 0"],
        ),
        (
            &gemma,
            setting("gemma3.attention.value_length", u(0)),
            vec!["`gemma3.attention.value_length` = 0"],
        ),
        // Odd head size (the file's RoPE dimension count set to match): RoPE needs pairs.
        (
            &gemma,
            Box::new(move |md| {
                set(md, "gemma3.attention.key_length", u(31));
                set(md, "gemma3.rope.dimension_count", u(31));
            }),
            vec!["`gemma3.attention.key_length` = 31", "even"],
        ),
        (
            &gemma,
            setting("gemma3.rope.dimension_count", u(31)),
            vec!["`gemma3.rope.dimension_count` = 31", "32"],
        ),
        (
            &gemma,
            setting(
                "gemma3.attention.layer_norm_rms_epsilon",
                Value::F32(f32::NAN),
            ),
            vec!["`gemma3.attention.layer_norm_rms_epsilon` = NaN"],
        ),
        (
            &gemma,
            setting("gemma3.attention.layer_norm_rms_epsilon", Value::F32(-1.0)),
            vec!["`gemma3.attention.layer_norm_rms_epsilon` = -1"],
        ),
        (
            &gemma,
            setting("gemma3.rope.freq_base", Value::F32(0.0)),
            vec!["`gemma3.rope.freq_base` = 0"],
        ),
        (
            &gemma,
            setting("gemma3.rope.freq_base", Value::String("big".into())),
            vec!["`gemma3.rope.freq_base` = \"big\"", "float"],
        ),
        (
            &gemma,
            setting("gemma3.attention.head_count", Value::I32(-4)),
            vec!["`gemma3.attention.head_count` = I32(-4)"],
        ),
        (
            &gemma,
            setting("gemma3.attention.head_count", Value::U64(1 << 40)),
            vec!["`gemma3.attention.head_count` = U64(1099511627776)"],
        ),
        (
            &gemma,
            setting(
                "gemma3.attention.head_count_kv",
                Value::String("one".into()),
            ),
            vec!["`gemma3.attention.head_count_kv` = \"one\""],
        ),
        (
            &gemma,
            Box::new(|md| remove(md, "gemma3.attention.head_count")),
            vec!["`gemma3.attention.head_count` is missing"],
        ),
        // Llama with no key length: the head size is embedding / heads, so they must divide.
        (
            &llama,
            Box::new(move |md| {
                remove(md, "llama.attention.key_length");
                set(md, "llama.attention.head_count", u(3));
            }),
            vec![
                "`llama.embedding_length` = 64",
                "llama.attention.head_count = 3",
            ],
        ),
        // A value that passes validation but disagrees with the tensors: the tensor is named.
        (
            &gemma,
            setting("gemma3.feed_forward_length", u(256)),
            vec!["`blk.0.ffn_gate.weight`", "[128, 64]", "[256, 64]"],
        ),
        // The vocabulary.
        (
            &gemma,
            setting("tokenizer.ggml.tokens", Value::Array(Vec::new())),
            vec!["tokenizer.ggml.tokens", "0 values"],
        ),
        (
            &gemma,
            setting(
                "tokenizer.ggml.tokens",
                Value::Array((0..512).map(Value::U32).collect()),
            ),
            vec!["`tokenizer.ggml.tokens` entry 0 is U32(0)", "string"],
        ),
        (
            &gemma,
            setting(
                "tokenizer.ggml.scores",
                Value::Array(vec![Value::F32(0.0); 100]),
            ),
            vec!["512 tokens", "`tokenizer.ggml.scores` 100"],
        ),
        (
            &gemma,
            setting(
                "tokenizer.ggml.token_type",
                Value::Array(vec![Value::String("x".into()); 512]),
            ),
            vec!["`tokenizer.ggml.token_type` entry 0 is \"x\""],
        ),
        (
            &gemma,
            Box::new(|md| remove(md, "tokenizer.ggml.scores")),
            vec!["`tokenizer.ggml.scores` is missing"],
        ),
        (
            &gemma,
            setting("tokenizer.ggml.eos_token_id", u(512)),
            vec!["`tokenizer.ggml.eos_token_id` = 512", "512 tokens"],
        ),
        (
            &gemma,
            setting("tokenizer.ggml.bos_token_id", u(100_000)),
            vec!["`tokenizer.ggml.bos_token_id` = 100000"],
        ),
        (
            &gemma,
            setting("tokenizer.ggml.eot_token_id", Value::I32(-1)),
            vec!["`tokenizer.ggml.eot_token_id` = I32(-1)"],
        ),
        (
            &gemma,
            Box::new(|md| remove(md, "tokenizer.ggml.eos_token_id")),
            vec!["`tokenizer.ggml.eos_token_id` is missing"],
        ),
        // Byte-level BPE vocabularies.
        (
            &gemma,
            setting("tokenizer.ggml.model", Value::String("gpt2".into())),
            vec!["`tokenizer.ggml.merges` is missing"],
        ),
        (
            &gemma,
            Box::new(move |md| {
                set(md, "tokenizer.ggml.model", Value::String("gpt2".into()));
                set(
                    md,
                    "tokenizer.ggml.merges",
                    Value::Array(vec![Value::String("abc".into())]),
                );
            }),
            vec!["merge `abc` is not `left right`"],
        ),
        (
            &gemma,
            Box::new(move |md| {
                set(md, "tokenizer.ggml.model", Value::String("gpt2".into()));
                set(
                    md,
                    "tokenizer.ggml.merges",
                    Value::Array(vec![Value::U32(1)]),
                );
            }),
            vec!["`tokenizer.ggml.merges` entry 0 is U32(1)"],
        ),
        (
            &gemma,
            Box::new(move |md| {
                set(md, "tokenizer.ggml.model", Value::String("gpt2".into()));
                set(md, "tokenizer.ggml.merges", Value::Array(Vec::new()));
                set(
                    md,
                    "tokenizer.ggml.pre",
                    Value::String("no-such-pre".into()),
                );
            }),
            vec!["pre-tokenizer `no-such-pre`"],
        ),
        (
            &gemma,
            setting("tokenizer.ggml.model", Value::String("rwkv".into())),
            vec!["tokenizer model `rwkv`"],
        ),
        // candle's reader divides by the alignment.
        (
            &gemma,
            setting("general.alignment", u(0)),
            vec!["general.alignment = 0"],
        ),
    ];
    for (i, (src, edit, want)) in cases.into_iter().enumerate() {
        let dst = dir.0.join(format!("case{i}.gguf"));
        rewrite(src, &dst, edit);
        let e = load_error(&dst, &format!("case {i} ({want:?})"));
        for w in &want {
            assert!(e.contains(w), "case {i}: `{e}` does not contain `{w}`");
        }
    }
}

/// Every integer key of the architecture and tokenizer set to each of a few edge values:
/// the load either fails with an error or gives a model that runs a prefill and a decode
/// step; nothing panics.
#[test]
fn no_integer_edge_value_panics() {
    let dir = Dir::new("sweep");
    for arch in ["gemma3", "llama"] {
        let src = tiny(&dir.0, arch);
        let (md, _) = read(&src);
        let keys: Vec<String> = md
            .iter()
            .filter(|(_, v)| matches!(v, Value::U32(_)))
            .map(|(k, _)| k.clone())
            .collect();
        assert!(keys.len() >= 11, "{keys:?}");
        for key in &keys {
            for value in [0, 1, 2, 3, 7, 1 << 20, u32::MAX] {
                let dst = dir.0.join("sweep.gguf");
                rewrite(&src, &dst, |md| set(md, key, Value::U32(value)));
                let what = format!("{arch}: {key} = {value}");
                let Ok(model) = load(&dst, &what) else {
                    continue;
                };
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut cache = KvCache::new(
                        &model.layer_specs(),
                        &KvScheme::parse("f32").unwrap(),
                        vec![0],
                    )
                    .map_err(|e| e.to_string())?;
                    let dev = Device::Cpu;
                    let prefill = Tensor::new(&[[2u32, 300, 301, 302]], &dev).unwrap();
                    model
                        .forward(&prefill, &mut cache, LogitsMode::Last)
                        .map_err(|e| e.to_string())?;
                    let step = Tensor::new(&[[303u32]], &dev).unwrap();
                    model
                        .forward(&step, &mut cache, LogitsMode::Last)
                        .map_err(|e| e.to_string())
                }));
                assert!(run.is_ok(), "{what}: the forward panicked");
            }
        }
    }
}

/// A tensor whose dimensions multiply past `usize`: the open fails naming it (a hand-made
/// GGUF v3 header, since no writer makes one).
#[test]
fn overflowing_tensor_shape_is_an_error() {
    let dir = Dir::new("shape");
    let path = dir.0.join("huge.gguf");
    let mut b: Vec<u8> = Vec::new();
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    b.extend(0x4655_4747u32.to_le_bytes()); // "GGUF"
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata entries
    string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes()); // string
    string(&mut b, "gemma3");
    string(&mut b, "token_embd.weight");
    b.extend(2u32.to_le_bytes());
    b.extend((1u64 << 33).to_le_bytes());
    b.extend((1u64 << 33).to_le_bytes());
    b.extend(0u32.to_le_bytes()); // F32
    b.extend(0u64.to_le_bytes()); // offset
    b.resize(b.len().div_ceil(32) * 32 + 64, 0);
    std::fs::write(&path, &b).unwrap();
    let e = load_error(&path, "huge tensor");
    assert!(
        e.contains("token_embd.weight") && e.contains("8589934592") && e.contains("overflows"),
        "{e}"
    );
}

/// Odd but loadable vocabularies (a duplicated piece, an empty control token, a merge of
/// pieces whose join is not in the vocabulary) load, and encode and decode without a panic.
#[test]
fn odd_vocabularies_load_and_tokenize() {
    let dir = Dir::new("vocab");
    let gemma = tiny(&dir.0, "gemma3");
    let (md, _) = read(&gemma);
    let mut tokens = match &md
        .iter()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .unwrap()
        .1
    {
        Value::Array(a) => a.clone(),
        _ => unreachable!(),
    };
    tokens[300] = Value::String(String::new());
    tokens[301] = tokens[262].clone();
    let mut types = vec![Value::I32(1); 512];
    types[300] = Value::I32(3);
    let edits: Vec<Box<dyn Fn(&mut Metadata)>> = vec![
        Box::new(|md| {
            set(md, "tokenizer.ggml.tokens", Value::Array(tokens.clone()));
            set(md, "tokenizer.ggml.token_type", Value::Array(types.clone()));
        }),
        Box::new(|md| {
            set(md, "tokenizer.ggml.model", Value::String("gpt2".into()));
            let merge = "\u{2581}w0 \u{2581}w1".to_string();
            set(
                md,
                "tokenizer.ggml.merges",
                Value::Array(vec![Value::String(merge)]),
            );
        }),
    ];
    for (i, edit) in edits.iter().enumerate() {
        let dst = dir.0.join(format!("vocab{i}.gguf"));
        rewrite(&gemma, &dst, edit);
        let loaded = std::panic::catch_unwind(|| {
            Model::load(&dst, &LoadOptions::default(), &Device::Cpu).map(|(_, t)| {
                let ids = t.encode("x \u{2581}w0 é", true)?;
                let all: Vec<u32> = (0..512).collect();
                t.decode(&all)?;
                Ok::<_, tessera_models::ModelError>(ids)
            })
        });
        let ids = loaded
            .unwrap_or_else(|_| panic!("vocabulary {i}: panicked"))
            .map_err(|e| e.to_string());
        // Loading may refuse a vocabulary (with an error); when it loads, it tokenizes.
        if let Ok(ids) = ids {
            let ids = ids.unwrap_or_else(|e| panic!("vocabulary {i}: {e}"));
            assert!(
                !ids.is_empty() && ids.iter().all(|&id| id < 512),
                "{i}: {ids:?}"
            );
        }
    }
}
