//! tessera-engine: drives models and caches.
//!
//! A [`Session`] owns one KV cache and feeds tokens through a model (prefill in chunks,
//! decode one token at a time); [`Generation`] samples from it with a [`Sampler`] until a
//! stop; [`generate_batch_greedy`] runs several prompts as one left-padded batch;
//! [`eval`] measures perplexity and KL divergence per KV scheme; [`store`] fetches and
//! verifies the default model.
//! [`chat`] renders a model's Jinja chat template (or a built-in one) into a prompt.

mod batch;
pub mod chat;
mod error;
pub mod eval;
mod generate;
mod sampler;
mod session;
pub mod store;

pub use batch::generate_batch_greedy;
pub use error::EngineError;
pub use generate::{Generation, StopReason, TextStream};
pub use sampler::{argmax, Sampler, SamplerConfig};
pub use session::{log_softmax, Session, DEFAULT_PREFILL_CHUNK};
