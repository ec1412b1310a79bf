//! tessera-engine: drives models and caches.
//!
//! A [`Batch`] is the step-level engine every generation runs on — requests added,
//! prefilled in bounded chunks between decode steps, merged into the running batch and
//! filtered out when they finish (continuous batching, with admission limits), each row
//! with its own drafter where the batch speculates ([`BatchSpec`]);
//! [`generate_batch_greedy`] runs several prompts through one. A [`Sequence`] is a row's
//! tokens and the cache holding them, and [`Sequence::reuse_for`] the one rule for how much
//! of a new prompt it gives. A [`Session`] owns one KV cache and the tokens it holds
//! (feeding tokens itself where every position's logits are wanted: evaluation, a draft
//! model's drafts); [`Generation`] samples from a session through a one-row batch resumed
//! from its cache, plain or speculative, which the session gets back when it ends;
//! [`eval`] measures perplexity and KL divergence per KV scheme, [`kv_auto`] chooses
//! per-layer key and value widths from measured sensitivity; [`store`] fetches and
//! verifies the default model.
//! [`chat`] renders a model's Jinja chat template (or a built-in one) into a prompt;
//! [`prompt`] tokenizes a completion prompt or a conversation the one way every front end
//! uses, with the tokens that end its generation.

pub mod chat;
mod error;
pub mod eval;
mod generate;
pub mod kv_auto;
pub mod prefix;
pub mod prompt;
pub mod prompt_cache;
mod sampler;
pub mod sequence;
mod session;
pub mod speculative;
mod step;
pub mod stop;
pub mod store;
mod text_stream;

pub use error::{check_vocabulary, EngineError};
pub use generate::{generate_batch_greedy, Generation};
pub use prefix::PrefixCache;
pub use prompt::{Prompt, PromptInput};
pub use sampler::{argmax, Dist, Sampler, SamplerConfig};
pub use sequence::{Reuse, ReuseLimit, Sequence};
pub use session::{log_softmax, Session, DEFAULT_PREFILL_CHUNK};
pub use step::{
    Batch, BatchLimits, BatchSpec, BatchTimes, DraftSource, Event, GenerationRequest, Refused,
    RequestId, TokenLogprobs, MAX_DRAFT, MAX_TOP_LOGPROBS, PREFIX_CHECKPOINT,
};
pub use stop::{Released, StopReason, StopText};
pub use text_stream::TextStream;
