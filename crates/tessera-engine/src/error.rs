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
