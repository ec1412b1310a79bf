//! A `tokenizers` BPE built from a GGUF vocabulary, of either kind llama.cpp writes:
//!
//! - SentencePiece (`tokenizer.ggml.model = "llama"`: Gemma, Llama 2): tokens, scores,
//!   token types, byte fallback, no merges (below).
//! - Byte-level BPE (`"gpt2"`: Llama 3, Qwen 2/3): tokens and ranked merges over the
//!   GPT-2 byte alphabet, the text first split by the pre-tokenizer regex the vocabulary
//!   names in `tokenizer.ggml.pre` (the patterns are those of the models' published
//!   tokenizer configurations).
//!
//! SentencePiece BPE repeatedly merges the adjacent pair whose concatenation is the vocabulary
//! piece with the highest score. A Hugging Face BPE does the same with merge ranks, so the
//! merges are derived here: every split of every normal piece into two pieces that are both
//! in the vocabulary, ranked by the merged piece's score. Control tokens (`<bos>`,
//! `<start_of_turn>`, …) and user-defined tokens (runs of newlines, spaces and tabs, HTML
//! tags) are matched on the raw text before the model runs, as llama.cpp's SPM tokenizer does.
//! Spaces become `▁`; unknown characters fall back to `<0xNN>` byte tokens.

use crate::gguf::GgufFile;
use crate::ModelError;
use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, Tokenizer as HfTokenizer};

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// Token ids a generation loop needs to know.
#[derive(Debug, Clone)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: u32,
    /// Gemma's `<end_of_turn>`, which ends a chat reply.
    pub end_of_turn: Option<u32>,
    pub start_of_turn: Option<u32>,
    pub add_bos: bool,
}

pub struct Tokenizer {
    inner: HfTokenizer,
    special: SpecialTokens,
    vocab_size: usize,
}

fn tokenizer_error(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl Tokenizer {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, ModelError> {
        let model = gguf.string("tokenizer.ggml.model")?;
        if model != "llama" && model != "gpt2" {
            return Err(ModelError::Tokenizer(format!(
                "tokenizer model `{model}` is not supported (this build reads SentencePiece `llama` and byte-level BPE `gpt2` vocabularies)"
            )));
        }
        const TOKENS: &str = "tokenizer.ggml.tokens";
        const SCORES: &str = "tokenizer.ggml.scores";
        const TYPES: &str = "tokenizer.ggml.token_type";
        let entry = |key: &str, i: usize, v: &Value, what: &str| {
            ModelError::Tokenizer(format!(
                "`{key}` entry {i} is {}, expected {what}",
                crate::gguf::describe(v)
            ))
        };
        let tokens: Vec<String> = gguf
            .array(TOKENS)?
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(s) => Ok(s.clone()),
                _ => Err(entry(TOKENS, i, v, "a string")),
            })
            .collect::<Result<_, _>>()?;
        if tokens.is_empty() || tokens.len() > u32::MAX as usize {
            return Err(ModelError::Tokenizer(format!(
                "`{TOKENS}` holds {} tokens: a vocabulary needs 1 to 2^32 - 1",
                tokens.len()
            )));
        }
        // Byte-level vocabularies rank merges instead of scoring pieces.
        let scores: Vec<f32> = match (model.as_str(), gguf.get(SCORES)) {
            (_, Some(_)) => gguf
                .array(SCORES)?
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::F32(x) => Ok(*x),
                    Value::F64(x) => Ok(*x as f32),
                    _ => Err(entry(SCORES, i, v, "a float")),
                })
                .collect::<Result<_, _>>()?,
            ("gpt2", None) => vec![0.0; tokens.len()],
            (_, None) => return Err(ModelError::MissingMetadata { key: SCORES.into() }),
        };
        let types: Vec<i32> = gguf
            .array(TYPES)?
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::I32(x) => Ok(*x),
                Value::U32(x) => i32::try_from(*x).map_err(|_| entry(TYPES, i, v, "a token type")),
                _ => Err(entry(TYPES, i, v, "an integer")),
            })
            .collect::<Result<_, _>>()?;
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "`{TOKENS}` holds {} tokens but `{SCORES}` {} and `{TYPES}` {} entries",
                tokens.len(),
                scores.len(),
                types.len()
            )));
        }
        // Special token ids must name tokens of the vocabulary.
        let id = |key: &str| -> Result<Option<u32>, ModelError> {
            match gguf.opt_u32(key)? {
                Some(id) if id as usize >= tokens.len() => Err(ModelError::BadMetadata {
                    key: key.to_string(),
                    value: id.to_string(),
                    reason: format!("outside the vocabulary of {} tokens", tokens.len()),
                }),
                other => Ok(other),
            }
        };
        let find = |text: &str| tokens.iter().position(|t| t == text).map(|i| i as u32);
        let end_of_turn = match id("tokenizer.ggml.eot_token_id")? {
            Some(id) => Some(id),
            // The token that ends a chat turn: Gemma's, Llama 3's, Qwen's (ChatML).
            None => ["<end_of_turn>", "<|eot_id|>", "<|im_end|>"]
                .iter()
                .find_map(|t| find(t)),
        };
        let special = SpecialTokens {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?.ok_or_else(|| ModelError::MissingMetadata {
                key: "tokenizer.ggml.eos_token_id".into(),
            })?,
            end_of_turn,
            start_of_turn: find("<start_of_turn>"),
            // llama.cpp's defaults: SentencePiece vocabularies add BOS, byte-level ones not.
            add_bos: gguf.bool_or("tokenizer.ggml.add_bos_token", model == "llama"),
        };
        let inner = if model == "gpt2" {
            const MERGES: &str = "tokenizer.ggml.merges";
            let merges: Vec<String> = gguf
                .array(MERGES)?
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(entry(MERGES, i, v, "a string")),
                })
                .collect::<Result<_, _>>()?;
            let pre = gguf
                .string("tokenizer.ggml.pre")
                .unwrap_or_else(|_| "default".into());
            build_byte_level(&tokens, &merges, &types, &pre)?
        } else {
            let add_space_prefix = gguf.bool_or("tokenizer.ggml.add_space_prefix", false);
            build(&tokens, &scores, &types, add_space_prefix)?
        };
        Ok(Tokenizer {
            inner,
            special,
            vocab_size: tokens.len(),
        })
    }

    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Token ids of `text`, with BOS first when `with_bos` and the vocabulary asks for it.
    /// Control-token text such as `<start_of_turn>` becomes that control token.
    pub fn encode(&self, text: &str, with_bos: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self.inner.encode(text, false).map_err(tokenizer_error)?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if with_bos && self.special.add_bos {
            if let Some(bos) = self.special.bos {
                ids.push(bos);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The text of `ids`; control tokens are dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner.decode(ids, true).map_err(tokenizer_error)
    }

    /// The id of the token whose text is `text`, if the vocabulary has one.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text)
    }

    /// The text of one token as the vocabulary stores it (for debugging and tests).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

/// Pre-tokenizer patterns by `tokenizer.ggml.pre`: how the text is split before the byte
/// BPE runs (Llama 3 groups up to three digits, Qwen 2 splits every digit).
fn pre_tokenizer_pattern(pre: &str) -> Option<&'static str> {
    match pre {
        "llama-bpe" | "llama3" | "llama-v3" | "smaug-bpe" => Some(concat!(
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)",
            r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )),
        "qwen2" => Some(concat!(
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)",
            r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )),
        "default" | "gpt-2" | "gpt2" => {
            Some(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
        }
        _ => None,
    }
}

/// A byte-level BPE (GPT-2's byte alphabet) from GGUF tokens and `"left right"` merges.
fn build_byte_level(
    tokens: &[String],
    merges: &[String],
    types: &[i32],
    pre: &str,
) -> Result<HfTokenizer, ModelError> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::SplitDelimiterBehavior;
    let pattern = pre_tokenizer_pattern(pre).ok_or_else(|| {
        ModelError::Tokenizer(format!(
            "byte-level pre-tokenizer `{pre}` is not supported (this build knows llama-bpe, qwen2 and gpt-2)"
        ))
    })?;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(l, r)| (l.to_string(), r.to_string()))
                .ok_or_else(|| ModelError::Tokenizer(format!("merge `{m}` is not `left right`")))
        })
        .collect::<Result<_, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        // Llama 3's configuration takes a pre-token found whole in the vocabulary as is.
        .ignore_merges(pre != "qwen2")
        .build()
        .map_err(tokenizer_error)?;
    let mut tok = HfTokenizer::new(bpe);
    let split = Split::new(
        SplitPattern::Regex(pattern.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tokenizer_error)?;
    tok.with_pre_tokenizer(Some(PreSequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ])));
    tok.with_decoder(Some(ByteLevel::default()));
    add_declared_tokens(&mut tok, tokens, types)?;
    Ok(tok)
}

/// Control tokens (special: dropped when decoding) and user-defined ones, matched whole on
/// the raw text before the model runs.
fn add_declared_tokens(
    tok: &mut HfTokenizer,
    tokens: &[String],
    types: &[i32],
) -> Result<(), ModelError> {
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        // (An empty text would match everywhere: such a token is never matched whole.)
        .filter(|(text, &t)| (t == CONTROL || t == USER_DEFINED) && !text.is_empty())
        .map(|(text, &t)| AddedToken::from(text.clone(), t == CONTROL).normalized(false))
        .collect();
    tok.add_special_tokens(added.iter().filter(|a| a.special).cloned())
        .map_err(tokenizer_error)?;
    tok.add_tokens(added.iter().filter(|a| !a.special).cloned())
        .map_err(tokenizer_error)?;
    Ok(())
}

fn build(
    tokens: &[String],
    scores: &[f32],
    types: &[i32],
    add_space_prefix: bool,
) -> Result<HfTokenizer, ModelError> {
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let index = |s: &str| {
        vocab
            .get(s)
            .copied()
            .filter(|&i| types[i as usize] == NORMAL)
    };
    // (score of the merged piece, left id, right id): higher score merges first.
    let mut merges: Vec<(f32, u32, u32)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types[id] != NORMAL || piece.chars().nth(1).is_none() {
            continue;
        }
        for (split, _) in piece.char_indices().skip(1) {
            if let (Some(l), Some(r)) = (index(&piece[..split]), index(&piece[split..])) {
                merges.push((scores[id], l, r));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|(_, l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone()))
        .collect();
    let unk = tokens
        .iter()
        .position(|t| t == "<unk>")
        .map(|i| tokens[i].clone());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(tokenizer_error)?;
    let mut tok = HfTokenizer::new(bpe);
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_space_prefix {
        normalizers.push(tokenizers::normalizers::prepend::Prepend::new("▁".into()).into());
    }
    normalizers.push(Replace::new(" ", "▁").map_err(tokenizer_error)?.into());
    tok.with_normalizer(Some(tokenizers::normalizers::Sequence::new(normalizers)))
        .map_err(tokenizer_error)?;
    let decoders: Vec<DecoderWrapper> = vec![
        tokenizers::decoders::DecoderWrapper::Replace(
            tokenizers::normalizers::replace::Replace::new("▁", " ").map_err(tokenizer_error)?,
        ),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    tok.with_decoder(Some(DecoderSequence::new(decoders)));
    add_declared_tokens(&mut tok, tokens, types)?;
    Ok(tok)
}
