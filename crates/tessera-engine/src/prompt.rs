//! What a generation reads, tokenized one way for every front end (the CLI's `generate` and
//! `chat`, the server's completions and chat completions): a completion prompt — text
//! encoded with the vocabulary's BOS, or token ids as given — or a conversation rendered
//! with the model's chat template, and the tokens that end a generation of each kind.

use crate::chat::{ChatTemplate, Message};
use crate::EngineError;
use tessera_models::Tokenizer;

/// A prompt before tokenization.
#[derive(Debug, Clone, Copy)]
pub enum PromptInput<'a> {
    /// A completion prompt, encoded with the vocabulary's BOS.
    Text(&'a str),
    /// A completion prompt given as token ids, used as they are.
    Tokens(&'a [u32]),
    /// A conversation, rendered through the chat template with the assistant's turn opened.
    Chat(&'a [Message]),
}

/// A tokenized prompt and the tokens that end its generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    /// EOS and EOT; for a conversation also the template's end-of-turn token.
    pub stop_tokens: Vec<u32>,
}

impl Prompt {
    /// Tokenizes `input`; a conversation needs `template`.
    pub fn new(
        tokenizer: &Tokenizer,
        template: Option<&ChatTemplate>,
        input: PromptInput,
    ) -> Result<Prompt, EngineError> {
        Ok(match input {
            PromptInput::Text(text) => Prompt {
                ids: tokenizer.encode(text, true)?,
                stop_tokens: stop_tokens(tokenizer),
            },
            PromptInput::Tokens(ids) => Prompt {
                ids: ids.to_vec(),
                stop_tokens: stop_tokens(tokenizer),
            },
            PromptInput::Chat(messages) => {
                let template = template.ok_or_else(|| {
                    EngineError::ChatTemplate("this model has no usable chat template".into())
                })?;
                let text = template.render(messages, true)?;
                Prompt {
                    // The rendered text carries its own BOS where the template wants one.
                    ids: tokenizer.encode(&text, false)?,
                    stop_tokens: chat_stop_tokens(tokenizer, template),
                }
            }
        })
    }
}

/// The vocabulary's end-of-sequence and end-of-turn ids: what ends a completion.
pub fn stop_tokens(tokenizer: &Tokenizer) -> Vec<u32> {
    let s = tokenizer.special();
    std::iter::once(s.eos).chain(s.end_of_turn).collect()
}

/// What ends a chat reply: [`stop_tokens`] and the token of the template's end-of-turn text,
/// where the vocabulary has one.
pub fn chat_stop_tokens(tokenizer: &Tokenizer, template: &ChatTemplate) -> Vec<u32> {
    let mut ids = stop_tokens(tokenizer);
    if let Some(id) = template
        .end_of_turn()
        .and_then(|t| tokenizer.token_id(t.trim()))
    {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// The model file's chat template (`tokenizer.chat_template`), else the built-in format its
/// vocabulary fits ([`ChatTemplate::origin`] says which).
pub fn model_chat_template(tokenizer: &Tokenizer) -> Result<ChatTemplate, EngineError> {
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default();
    let s = tokenizer.special();
    ChatTemplate::from_gguf_or_builtin(
        tokenizer.chat_template(),
        &text(s.bos),
        &text(Some(s.eos)),
        |t| tokenizer.token_id(t).is_some(),
    )
}
