//! A `tokenizers` BPE built from a GGUF SentencePiece vocabulary
//! (`tokenizer.ggml.model = "llama"`: tokens, scores, token types, byte fallback, no merges).
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
        if model != "llama" {
            return Err(ModelError::Tokenizer(format!(
                "tokenizer model `{model}` is not supported (this build reads SentencePiece `llama` vocabularies)"
            )));
        }
        let tokens: Vec<String> = gguf
            .array("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.to_string().cloned().map_err(tokenizer_error))
            .collect::<Result<_, _>>()?;
        let scores: Vec<f32> = gguf
            .array("tokenizer.ggml.scores")?
            .iter()
            .map(|v| v.to_f32().map_err(tokenizer_error))
            .collect::<Result<_, _>>()?;
        let types: Vec<i32> = gguf
            .array("tokenizer.ggml.token_type")?
            .iter()
            .map(|v| match v {
                Value::I32(x) => Ok(*x),
                Value::U32(x) => Ok(*x as i32),
                _ => Err(tokenizer_error("token_type entries must be integers")),
            })
            .collect::<Result<_, _>>()?;
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(ModelError::Tokenizer(format!(
                "{} tokens but {} scores and {} token types",
                tokens.len(),
                scores.len(),
                types.len()
            )));
        }
        let id = |key: &str| gguf.u32(key).ok();
        let find = |text: &str| tokens.iter().position(|t| t == text).map(|i| i as u32);
        let special = SpecialTokens {
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id").ok_or_else(|| ModelError::MissingMetadata {
                key: "tokenizer.ggml.eos_token_id".into(),
            })?,
            end_of_turn: find("<end_of_turn>"),
            start_of_turn: find("<start_of_turn>"),
            add_bos: gguf.bool_or("tokenizer.ggml.add_bos_token", true),
        };
        let add_space_prefix = gguf.bool_or("tokenizer.ggml.add_space_prefix", false);
        let inner = build(&tokens, &scores, &types, add_space_prefix)?;
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

    /// The text of one token as the vocabulary stores it (for debugging and tests).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
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
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, &t)| t == CONTROL || t == USER_DEFINED)
        .map(|(text, &t)| AddedToken::from(text.clone(), t == CONTROL).normalized(false))
        .collect();
    tok.add_special_tokens(added.iter().filter(|a| a.special).cloned())
        .map_err(tokenizer_error)?;
    tok.add_tokens(added.iter().filter(|a| !a.special).cloned())
        .map_err(tokenizer_error)?;
    Ok(tok)
}
