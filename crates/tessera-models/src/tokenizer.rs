//! A `tokenizers` BPE built from a GGUF vocabulary, of either kind llama.cpp writes:
//!
//! - SentencePiece (`tokenizer.ggml.model = "llama"`: Gemma, Llama 2): tokens, scores,
//!   token types, byte fallback, no merges (below).
//! - Byte-level BPE (`"gpt2"`: Llama 3, Qwen 2/3, SmolLM, DeepSeek, …): tokens and ranked
//!   merges over the GPT-2 byte alphabet, the text first split by the regexes of the
//!   pre-tokenizer the vocabulary names in `tokenizer.ggml.pre` (`PRE_TOKENIZERS`: every
//!   byte-level one llama.cpp knows).
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
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, Tokenizer as HfTokenizer,
};

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
    /// The file's Jinja chat template (`tokenizer.chat_template`), if it has one.
    chat_template: Option<String>,
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
        // Byte-level vocabularies: how the text is split first (llama.cpp reads a vocabulary
        // without `tokenizer.ggml.pre` as `default`).
        let pre = match (model.as_str(), gguf.get("tokenizer.ggml.pre")) {
            ("gpt2", None) => Some(pre_tokenizer("default")?),
            ("gpt2", Some(_)) => Some(pre_tokenizer(&gguf.string("tokenizer.ggml.pre")?)?),
            _ => None,
        };
        let special = SpecialTokens {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?.ok_or_else(|| ModelError::MissingMetadata {
                key: "tokenizer.ggml.eos_token_id".into(),
            })?,
            end_of_turn,
            start_of_turn: find("<start_of_turn>"),
            // llama.cpp's defaults: SentencePiece vocabularies add BOS, byte-level ones as
            // their pre-tokenizer says (Llama 3, Tekken, Chameleon).
            add_bos: gguf.bool_or(
                "tokenizer.ggml.add_bos_token",
                pre.map_or(model == "llama", |p| p.add_bos),
            ),
        };
        let inner = if let Some(pre) = pre {
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
            build_byte_level(&tokens, &merges, &types, pre)?
        } else {
            // llama.cpp's default: SentencePiece text starts with a space (`▁`) unless the
            // vocabulary says not (Gemma's do; Llama 2's and Phi-3's have no such key).
            // Decoding keeps that space: the first piece's text, as llama.cpp's
            // `token_to_piece` gives it.
            let add_space_prefix = gguf.bool_or("tokenizer.ggml.add_space_prefix", true);
            build(&tokens, &scores, &types, add_space_prefix)?
        };
        let chat_template = match gguf.get("tokenizer.chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        };
        Ok(Tokenizer {
            inner,
            special,
            vocab_size: tokens.len(),
            chat_template,
        })
    }

    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The file's Jinja chat template (`tokenizer.chat_template`), if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
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

// Pattern fragments several pre-tokenizers share (macros, so that `concat!` can join them).

/// English contractions, any case (`'s`, `'T`, `'Re`, …).
macro_rules! contractions {
    () => {
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    };
}

/// GPT-2's pattern: lowercase contractions; runs of letters, of digits, of other
/// non-space characters, each with at most one leading space; whitespace runs (a run before
/// a word leaves its last space to the word).
macro_rules! gpt2 {
    () => {
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    };
}

/// Llama 3's pattern with its number rule `$digits`: contractions; a letter run with at
/// most one leading non-letter, non-digit, non-newline; numbers; symbol runs with their
/// trailing newlines; newline runs with the whitespace before them; other whitespace as GPT-2.
macro_rules! llama3 {
    ($digits:literal) => {
        concat!(
            contractions!(),
            r"|[^\r\n\p{L}\p{N}]?\p{L}+|",
            $digits,
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
    };
}

/// GPT-4o's (o200k) pattern, with contraction suffix `$suffix` and number rule `$digits`:
/// a word is an optional leading symbol, then capitals/marks followed by lowercase, or
/// capitals then lowercase ("CamelCase" splits into "Camel", "Case").
macro_rules! o200k {
    ($suffix:literal, $digits:literal) => {
        concat!(
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
            $suffix,
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
            $suffix,
            "|",
            $digits,
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
    };
}

/// DeepSeek V3's word pattern (`$symbols`: how a symbol run ends): one ASCII punctuation
/// character glued to the ASCII word after it; letter/mark runs with at most one leading
/// character that is no letter, punctuation, symbol or newline; punctuation/symbol runs.
macro_rules! deepseek3 {
    ($symbols:literal) => {
        concat!(
            r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+"##,
            $symbols,
            r"|\s+(?!\S)|\s+"
        )
    };
}

/// CJK ideographs and kana, runs of each.
const CJK_KANA: &str = "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+";
/// DeepSeek's CJK (and Samaritan…Hangul) runs.
const CJK_DEEPSEEK: &str = "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+";
/// Words up to a space or one of these punctuation marks (BLOOM, Poro, Viking).
const BLOOM: &str = " ?[^(\\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+";

/// How one family of vocabularies (the `tokenizer.ggml.pre` names llama.cpp gives it) is
/// split before the byte-level BPE runs: each regex splits every piece the previous ones
/// left, matches and the text between them alike becoming pieces (llama.cpp's
/// `unicode_regex_split`; a `tokenizers` `Split` with `Isolated` behaviour). The patterns
/// are those of the models' published tokenizer configurations, where llama.cpp quotes them
/// (fancy-regex runs them as they are; llama.cpp rewrites some for `std::regex`).
struct PreTokenizer {
    names: &'static [&'static str],
    splits: &'static [&'static str],
    /// A pre-token that is itself a vocabulary entry becomes that token, whatever the merges
    /// would make of it (llama.cpp's `ignore_merges`, from the models' configurations).
    ignore_merges: bool,
    /// Whether prompts start with BOS when `tokenizer.ggml.add_bos_token` is absent.
    add_bos: bool,
}

const fn pre(
    names: &'static [&'static str],
    splits: &'static [&'static str],
    ignore_merges: bool,
    add_bos: bool,
) -> PreTokenizer {
    PreTokenizer {
        names,
        splits,
        ignore_merges,
        add_bos,
    }
}

/// Every byte-level BPE pre-tokenizer llama.cpp knows (src/llama-vocab.cpp), one entry per
/// `LLAMA_VOCAB_PRE_TYPE_*` (those sharing a regex list share an entry unless their options
/// differ). Not here: `gemma4`, `granite-embed-multi-311m`, `sarvam-moe` and `whitespace`,
/// whose BPE runs on raw UTF-8 (no byte alphabet; see `NOT_BYTE_LEVEL`).
const PRE_TOKENIZERS: &[PreTokenizer] = &[
    // DEFAULT: a vocabulary without `tokenizer.ggml.pre` (llama.cpp warns that quality
    // suffers). Punctuation runs first, then GPT-2's words, digit runs, digit triples.
    pre(
        &["default"],
        &[r"[\p{P}\$\+<=>\^~\|]+", gpt2!(), r"\p{N}+", "[0-9][0-9][0-9]"],
        false,
        false,
    ),
    // LLAMA3 (Llama 3, Falcon 3, Pixtral, LFM2, …): numbers in groups of up to three.
    pre(
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        &[llama3!(r"\p{N}{1,3}")],
        true,
        true,
    ),
    // DBRX, SMAUG, CHATGLM4 (chatglm-bpe): Llama 3's pattern, merges as usual.
    pre(
        &["dbrx", "smaug-bpe", "chatglm-bpe"],
        &[llama3!(r"\p{N}{1,3}")],
        false,
        false,
    ),
    // CHATGLM4 (GLM 4/5): the same, whole-token pre-tokens kept.
    pre(&["glm4", "glm5"], &[llama3!(r"\p{N}{1,3}")], true, false),
    // JAIS2: Llama 3's, whitespace cut into runs of 512, 256, …, 4, 1-2, 1 characters.
    pre(
        &["jais-2"],
        &[concat!(
            contractions!(),
            r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+",
            r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)",
            r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
        )],
        false,
        false,
    ),
    // QWEN2 (Qwen 2/3, DeepSeek-R1 distills, Megrez), STABLELM2, HUNYUAN, SOLAR_OPEN,
    // GROK_2: every digit alone.
    pre(
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        &[llama3!(r"\p{N}")],
        false,
        false,
    ),
    // QWEN35: Qwen 2's with combining marks kept in words.
    pre(
        &["qwen35"],
        &[concat!(
            contractions!(),
            r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )],
        false,
        false,
    ),
    // UFAKZEKA: Qwen 2's without the contractions (Turkish suffixes after an apostrophe
    // stay with their word).
    pre(
        &["ufakzeka"],
        &[r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
        false,
        false,
    ),
    // LAGUNA: lines and newline runs first, then Qwen 2's.
    pre(&["laguna"], &[r"[^\n]+|[\n]+", llama3!(r"\p{N}")], false, false),
    // MINICPM5: numbers in groups of up to three, then Llama 3's shape with digit runs.
    pre(&["minicpm5"], &[r"\p{N}{1,3}", llama3!(r"\p{N}+")], true, false),
    // SEED_CODER: single digits, symbol runs without newlines.
    pre(
        &["seed-coder"],
        &[concat!(
            contractions!(),
            r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
        )],
        false,
        false,
    ),
    // BAILINGMOE (Ling, LLaDA-MoE). The published pattern's possessive `?+` and `++` match
    // what the greedy forms match here (what follows them cannot start inside them).
    pre(
        &["bailingmoe", "bailingmoe2", "llada-moe"],
        &[r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"],
        false,
        false,
    ),
    // EXAONE_MOE: a word may hold single spaces between letters.
    pre(
        &["exaone-moe"],
        &[concat!(
            contractions!(),
            r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
        )],
        false,
        false,
    ),
    // DEEPSEEK_LLM: newlines alone, cased-letter words, ASCII/full-width punctuation runs,
    // trailing whitespace, CJK runs, digit runs.
    pre(
        &["deepseek-llm"],
        &[
            r"[\r\n]",
            concat!(
                "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}",
                "\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}",
                "\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}",
                "\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}",
                "\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}",
                "\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}",
                "\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}",
                "\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}",
                "\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}",
                "\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}",
                "\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}",
                "\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}",
                "\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}",
                "\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}",
                "\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}",
                "\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+"
            ),
            "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
            r"\s+$",
            CJK_DEEPSEEK,
            r"\p{N}+",
        ],
        false,
        false,
    ),
    // DEEPSEEK_CODER: newlines alone, letter runs, punctuation runs, CJK runs, digits alone.
    pre(
        &["deepseek-coder"],
        &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_DEEPSEEK, r"\p{N}"],
        false,
        false,
    ),
    // DEEPSEEK3_LLM, HUNYUAN_DENSE, JOYAI_LLM, HY_V4: numbers in groups of up to three, CJK
    // and kana runs, then DeepSeek V3's words.
    pre(
        &["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"],
        &[r"\p{N}{1,3}", CJK_KANA, deepseek3!(r"[\r\n]*|\s*[\r\n]+")],
        false,
        false,
    ),
    // SPARK2_5: the same with newlines alone, then every digit alone.
    pre(
        &["spark2_5"],
        &[r"\p{N}{1,3}", CJK_KANA, deepseek3!(r"|[\r\n]"), r"\p{N}"],
        false,
        false,
    ),
    // AFMOE: digit runs cut into threes from the right (1234567 → 1 234 567; llama.cpp
    // does this in code), CJK and other Asian scripts, then DeepSeek V3's words.
    pre(
        &["afmoe"],
        &[
            r"\p{N}{1,3}(?=(?:\p{N}{3})*(?:\P{N}|$))",
            concat!(
                "[\u{4E00}-\u{9FFF}\u{3400}-\u{4DBF}\u{8C48}-\u{FAFF}\u{3040}-\u{309F}",
                "\u{30A0}-\u{30FF}\u{FF65}-\u{FF9F}\u{2F00}-\u{2FDF}\u{E40}-\u{E7F}\u{E80}-\u{EFF}",
                "\u{1780}-\u{17FF}\u{1000}-\u{109F}\u{AA60}-\u{AA7F}\u{A9E0}-\u{A9FF}",
                "\u{AC00}-\u{D7AF}\u{1100}-\u{11FF}]+"
            ),
            deepseek3!(r"[\r\n]*|\s*[\r\n]+"),
        ],
        false,
        false,
    ),
    // YOUTU: Hangul, CJK punctuation, Bopomofo, CJK/kana runs, then GPT-4o's words with
    // single digits.
    pre(
        &["youtu"],
        &[
            concat!(
                "[\u{AC00}-\u{D7A3}\u{3131}-\u{318E}]+",
                "|[\u{FF01}\u{2026}\u{201C}\u{201D}\u{2018}\u{2019}\u{2014}\u{FF1A}\u{FF1B}\u{FF0C}",
                "\u{3001}-\u{303F}\u{FE30}-\u{FE4F}]+|[\u{3105}-\u{312F}]+",
                "|[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+"
            ),
            o200k!("(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"\p{N}"),
        ],
        true,
        false,
    ),
    // FALCON: punctuation runs, GPT-2's words, digit triples.
    pre(
        &["falcon"],
        &[r"[\p{P}\$\+<=>\^~\|`]+", gpt2!(), "[0-9][0-9][0-9]"],
        false,
        false,
    ),
    // STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2: every
    // digit alone, then GPT-2's words.
    pre(
        &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        &[r"\p{N}", gpt2!()],
        false,
        false,
    ),
    // GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING (and what llama.cpp maps to GPT2:
    // Phi-2, Jina, GigaChat, A.X, Mellum, ModernBERT, RoBERTa, EXAONE 4).
    pre(
        &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
        ],
        &[gpt2!()],
        false,
        false,
    ),
    // PORO, BLOOM, GPT3_FINNISH: words up to a space or punctuation mark.
    pre(&["poro-chat", "bloom", "gpt3-finnish"], &[BLOOM], false, false),
    // VIKING: the same, then every digit alone.
    pre(&["viking"], &[BLOOM, r"\p{N}"], false, false),
    // TEKKEN (Mistral NeMo and later): GPT-4o's shape, no contractions, single digits.
    pre(&["tekken"], &[o200k!("", r"\p{N}")], true, true),
    // CHAMELEON: sentinel and image tokens, tab/newline/space runs, digits, punctuation
    // alone, then GPT-2's words.
    pre(
        &["chameleon"],
        &[
            "<sentinel:[0-9]+>",
            "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            gpt2!(),
        ],
        false,
        true,
    ),
    // GPT4O (GPT-4o, Llama 4, Kanana 2, MiniMax M2, …).
    pre(
        &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        &[o200k!("(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"\p{N}{1,3}")],
        false,
        false,
    ),
    // GRANITE_EMB_MULTI: GPT-4o's pattern (marks already belong to words), whole-token
    // pre-tokens kept.
    pre(
        &["granite-embed-multi-97m"],
        &[o200k!("(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"\p{N}{1,3}")],
        true,
        false,
    ),
    // TINY_AYA (Aya, Cohere 2 MoE): digit runs cut into threes from the right where a word
    // boundary follows, then GPT-4o's.
    pre(
        &["tiny_aya", "cohere2moe"],
        &[
            r"\d{1,3}(?=(?:\d{3})*\b)",
            o200k!("(?i:'s|'t|'re|'ve|'m|'ll|'d)?", r"\p{N}{1,3}"),
        ],
        false,
        false,
    ),
    // KIMI_K2: Han runs, then GPT-4o's words without Han characters (llama.cpp does this in
    // code; Rust regex classes intersect with `&&`).
    pre(
        &["kimi-k2"],
        &[concat!(
            r"\p{Han}+",
            r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+",
            contractions!(),
            r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*",
            contractions!(),
            r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        )],
        false,
        false,
    ),
    // SUPERBPE: digit runs, each cut into threes from the right (an empty match before
    // every group of three); no word splitting at all (tokens span spaces).
    pre(
        &["superbpe"],
        &[r"\p{N}+", r"(?=(\d{3})+(?!\d))"],
        false,
        false,
    ),
];

/// `tokenizer.ggml.pre` names llama.cpp runs as BPE over raw UTF-8 rather than the byte
/// alphabet (SentencePiece-style `▁` spaces, `<0xNN>` byte tokens): not supported here.
const NOT_BYTE_LEVEL: &[&str] = &[
    "gemma4",
    "granite-embed-multi-311m",
    "sarvam-moe",
    "whitespace",
];

/// The pre-tokenizer of `tokenizer.ggml.pre` = `name`.
fn pre_tokenizer(name: &str) -> Result<&'static PreTokenizer, ModelError> {
    if let Some(p) = PRE_TOKENIZERS.iter().find(|p| p.names.contains(&name)) {
        return Ok(p);
    }
    Err(ModelError::UnknownPreTokenizer {
        pre: name.to_string(),
        reason: if NOT_BYTE_LEVEL.contains(&name) {
            "its BPE runs on raw UTF-8, not the byte alphabet; this build reads byte-level ones"
        } else {
            "llama.cpp's list of byte-level BPE pre-tokenizers does not name it"
        },
    })
}

/// A byte-level BPE (GPT-2's byte alphabet) from GGUF tokens and `"left right"` merges.
fn build_byte_level(
    tokens: &[String],
    merges: &[String],
    types: &[i32],
    pre: &PreTokenizer,
) -> Result<HfTokenizer, ModelError> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
    use tokenizers::SplitDelimiterBehavior;
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            // llama.cpp splits at the first space after the first byte.
            m.bytes()
                .skip(1)
                .position(|b| b == b' ')
                .map(|i| (m[..=i].to_string(), m[i + 2..].to_string()))
                .ok_or_else(|| ModelError::Tokenizer(format!("merge `{m}` is not `left right`")))
        })
        .collect::<Result<_, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre.ignore_merges)
        .build()
        .map_err(tokenizer_error)?;
    let mut tok = HfTokenizer::new(bpe);
    let mut steps: Vec<PreTokenizerWrapper> = pre
        .splits
        .iter()
        .map(|pattern| {
            split_regex(pattern, SplitDelimiterBehavior::Isolated).map(PreTokenizerWrapper::from)
        })
        .collect::<Result<_, _>>()?;
    // Then each piece to the byte alphabet (the splitting is done: no GPT-2 regex here).
    steps.push(ByteLevel::new(false, true, false).into());
    tok.with_pre_tokenizer(Some(PreSequence::new(steps)));
    tok.with_decoder(Some(ByteLevel::default()));
    add_declared_tokens(&mut tok, tokens, types)?;
    Ok(tok)
}

/// A `Split` on `pattern`; a pattern fancy-regex cannot compile is a tokenizer error naming it.
fn split_regex(
    pattern: &str,
    behavior: tokenizers::SplitDelimiterBehavior,
) -> Result<tokenizers::pre_tokenizers::split::Split, ModelError> {
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    Split::new(SplitPattern::Regex(pattern.into()), behavior, false)
        .map_err(|e| ModelError::Tokenizer(format!("pre-tokenizer regex `{pattern}`: {e}")))
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _};

    /// The pieces `pre` splits `text` into (before the byte alphabet).
    fn pieces(pre: &str, text: &str) -> Vec<String> {
        let p = pre_tokenizer(pre).unwrap();
        let mut s = PreTokenizedString::from(text);
        for pattern in p.splits {
            split_regex(pattern, tokenizers::SplitDelimiterBehavior::Isolated)
                .unwrap()
                .pre_tokenize(&mut s)
                .unwrap();
        }
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_string())
            .collect()
    }

    #[test]
    fn every_pre_tokenizer_compiles_and_keeps_all_the_text() {
        let text = "Hello, y'all! I'VE 12345678 x3.14 CamelCase \u{2581}naïve café 漢字かな한국어 \
                    Привет мир\t\ttabs\n\n  \r\n trailing   <sentinel:7> IMGIMGABZ 🦙 ٣٤٥ ۔،";
        let mut names = std::collections::HashSet::new();
        for p in PRE_TOKENIZERS {
            for name in p.names {
                assert!(names.insert(*name), "`{name}` is listed twice");
                assert!(!NOT_BYTE_LEVEL.contains(name), "`{name}`");
            }
            let got = pieces(p.names[0], text);
            assert_eq!(got.concat(), text, "{}", p.names[0]);
            assert!(got.iter().all(|g| !g.is_empty()), "{}: {got:?}", p.names[0]);
        }
        // llama.cpp (as vendored by llama-cpp-python 0.3.36) knows 91 names, 4 of them not
        // byte-level.
        assert_eq!(names.len() + NOT_BYTE_LEVEL.len(), 91);
    }

    #[test]
    fn pre_tokenizers_split_as_their_models_do() {
        let cases: &[(&str, &str, &[&str])] = &[
            ("llama-bpe", "12345 it's", &["123", "45", " it", "'s"]),
            ("qwen2", "123 ab", &["1", "2", "3", " ab"]),
            ("smollm", "abc 123", &["abc", " ", "1", "2", "3"]),
            ("gpt-2", "Hello  world", &["Hello", " ", " world"]),
            ("superbpe", "a 1234567 b", &["a ", "1", "234", "567", " b"]),
            ("afmoe", "1234567 89", &["1", "234", "567", " ", "89"]),
            ("tiny_aya", "1234567 89", &["1", "234", "567", " ", "89"]),
            ("kimi-k2", "漢字abc", &["漢字", "abc"]),
            ("tekken", "CamelCase", &["Camel", "Case"]),
            ("gpt-4o", "CamelCase's", &["Camel", "Case's"]),
            ("deepseek-v3", "a1234", &["a", "123", "4"]),
            ("bloom", "Hei, maailma!", &["Hei", ",", " maailma", "!"]),
        ];
        for (pre, text, want) in cases {
            assert_eq!(pieces(pre, text), *want, "{pre} on {text:?}");
        }
    }

    #[test]
    fn unknown_pre_tokenizers_are_named() {
        for (name, reason) in [("no-such-pre", "does not name"), ("gemma4", "raw UTF-8")] {
            let e = pre_tokenizer(name).err().unwrap();
            assert!(
                matches!(&e, ModelError::UnknownPreTokenizer { pre, .. } if pre == name),
                "{e}"
            );
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("pre-tokenizer `{name}`")) && msg.contains(reason),
                "{msg}"
            );
            assert!(!msg.contains('\n'), "{msg}");
        }
    }
}
