use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("the prompt has {prompt} tokens but the model's context is {context}")]
    PromptTooLong { prompt: usize, context: usize },

    #[error("the prompt is empty")]
    EmptyPrompt,

    #[error("the text has {have} tokens; this evaluation needs at least {need}")]
    TextTooShort { have: usize, need: usize },

    #[error("the queue is full ({limit} requests waiting); try again later")]
    QueueFull { limit: usize },

    #[error("invalid setting: {0}")]
    Invalid(String),

    /// A request field that failed validation: the field as the APIs name it (`temperature`,
    /// `top_logprobs`, `prompt`, …) and why, so a server names it without reading the text.
    #[error("invalid setting: {message}")]
    Field {
        field: &'static str,
        message: String,
    },

    #[error("{0}")]
    Fetch(String),

    /// A chat template that does not parse, fails to render, or calls
    /// `raise_exception(msg)` (then the text is exactly `msg`).
    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// A prompt cache file that cannot be written, read or used: the text names the file
    /// and the field.
    #[error("prompt cache: {0}")]
    PromptCache(String),

    #[error(transparent)]
    Model(#[from] tessera_models::ModelError),

    #[error(transparent)]
    Kv(#[from] tessera_kv::KvError),

    #[error("tensor operation failed: {0}")]
    Tensor(#[from] candle_core::Error),
}

impl EngineError {
    /// A [`EngineError::Field`] error.
    pub fn field(field: &'static str, message: impl Into<String>) -> Self {
        EngineError::Field {
            field,
            message: message.into(),
        }
    }

    /// The request field the error is about, where validation named one.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            EngineError::Field { field, .. } => Some(field),
            _ => None,
        }
    }
}

/// The one vocabulary check of a prompt's ids: every id below `vocab`.
pub fn check_vocabulary(ids: &[u32], vocab: usize) -> Result<(), EngineError> {
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => Err(EngineError::field(
            "prompt",
            format!("token id {id} is outside the model's vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}
