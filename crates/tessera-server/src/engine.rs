//! The engine thread: the only thread that touches the model, the tokenizer and the
//! [`Batch`]. Handlers send it a [`Submit`]; it tokenizes, validates and queues the request,
//! then loops — take new submissions (blocking only when there is nothing to step), cancel
//! requests whose client has gone, `step()`, and forward each request's text to its reply
//! channel as it becomes printable (stop strings held back until they cannot match).

use crate::openai::{ApiError, Finish};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use tessera_engine::chat::{ChatTemplate, Message};
use tessera_engine::{
    Batch, BatchLimits, EngineError, Event, GenerationRequest, RequestId, SamplerConfig,
    StopReason, TextStream,
};
use tessera_kv::KvScheme;
use tessera_models::{Model, Tokenizer};
use tokio::sync::mpsc::{self, error::TryRecvError, UnboundedSender};

/// What a request asks for, before tokenization.
#[derive(Debug)]
pub enum Input {
    /// A completion prompt (encoded with the vocabulary's BOS).
    Text(String),
    /// A conversation, rendered through the chat template.
    Chat(Vec<Message>),
}

#[derive(Debug)]
pub struct Job {
    pub input: Input,
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    pub stops: Vec<String>,
}

pub struct Submit {
    pub job: Job,
    pub reply: UnboundedSender<StreamItem>,
}

/// What the engine tells a request's handler, in this order: `Accepted` or `Error`; then
/// `Text` pieces; then `Done` (or `Error` if the engine failed mid-way).
#[derive(Debug)]
pub enum StreamItem {
    Accepted {
        prompt_tokens: usize,
    },
    Text(String),
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt tokens a stored prefix gave (`prompt_tokens_details.cached_tokens`).
        cached_tokens: usize,
    },
    Error(ApiError),
}

/// What the engine thread owns.
pub struct EngineParts {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub scheme: KvScheme,
    pub prefill_chunk: usize,
    pub limits: BatchLimits,
    /// KV bytes of finished requests' rows kept for prefix reuse (0: none).
    pub prefix_cache: usize,
    /// `None`: the chat endpoint answers 400.
    pub chat_template: Option<ChatTemplate>,
    /// End of a completion: EOS (and EOT).
    pub stop_tokens: Vec<u32>,
    /// End of a chat reply: EOS, EOT and the template's end-of-turn token.
    pub chat_stop_tokens: Vec<u32>,
}

/// A request the engine is generating for.
struct Live {
    reply: UnboundedSender<StreamItem>,
    stream: TextStream,
    /// All text decoded so far; `text[..sent]` went to the client.
    text: String,
    sent: usize,
    stops: Vec<String>,
    prompt_tokens: usize,
    tokens: usize,
}

impl Live {
    /// Sends what can no longer turn into a stop string; on a stop string, sends the text
    /// before it and returns true.
    fn forward(&mut self, piece: &str, at_end: bool) -> bool {
        self.text.push_str(piece);
        let search_from = self
            .sent
            .saturating_sub(self.stops.iter().map(|s| s.len()).max().unwrap_or(0));
        let search_from = (0..=search_from)
            .rev()
            .find(|&i| self.text.is_char_boundary(i))
            .unwrap_or(0);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.text[search_from..].find(s.as_str()))
            .min()
            .map(|at| search_from + at);
        let (end, stopped) = match hit {
            Some(at) => (at.max(self.sent), true),
            None if at_end => (self.text.len(), false),
            None => (self.text.len() - held_back(&self.text, &self.stops), false),
        };
        if end > self.sent {
            let _ = self
                .reply
                .send(StreamItem::Text(self.text[self.sent..end].to_string()));
            self.sent = end;
        }
        stopped
    }

    fn done(&self, finish: Finish, cached_tokens: usize) {
        let _ = self.reply.send(StreamItem::Done {
            finish,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.tokens,
            cached_tokens,
        });
    }
}

/// Bytes at the end of `text` that begin some stop string (so may still become one).
fn held_back(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .filter_map(|s| {
            (1..s.len())
                .rev()
                .find(|&k| s.is_char_boundary(k) && text.ends_with(&s[..k]))
        })
        .max()
        .unwrap_or(0)
}

fn engine_error(e: &EngineError) -> ApiError {
    match e {
        EngineError::QueueFull { .. } => ApiError::busy(e.to_string()),
        EngineError::PromptTooLong { .. }
        | EngineError::EmptyPrompt
        | EngineError::Invalid(_)
        | EngineError::ChatTemplate(_) => ApiError::invalid(e.to_string()),
        _ => ApiError::internal(e.to_string()),
    }
}

/// Runs the engine until every submission sender is gone.
pub fn run(parts: EngineParts, mut rx: mpsc::Receiver<Submit>) {
    let EngineParts {
        model,
        tokenizer,
        scheme,
        prefill_chunk,
        limits,
        prefix_cache,
        chat_template,
        stop_tokens,
        chat_stop_tokens,
    } = parts;
    let mut batch = match Batch::new(&model, &scheme, prefill_chunk, limits) {
        Ok(b) => b.with_prefix_cache(prefix_cache),
        Err(e) => {
            // Validated before the server starts; answer every request with the reason.
            while let Some(s) = rx.blocking_recv() {
                let _ = s.reply.send(StreamItem::Error(engine_error(&e)));
            }
            return;
        }
    };
    let mut live: HashMap<RequestId, Live> = HashMap::new();
    let context = model.context_length();
    loop {
        // New submissions: wait for one only when there is nothing to step.
        loop {
            let submit = if batch.is_idle() && live.is_empty() {
                match rx.blocking_recv() {
                    Some(s) => s,
                    None => return,
                }
            } else {
                match rx.try_recv() {
                    Ok(s) => s,
                    Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => break,
                }
            };
            let Submit { job, reply } = submit;
            let accepted = (|| -> Result<(Vec<u32>, usize, Vec<u32>), ApiError> {
                let (prompt, stops) = match &job.input {
                    Input::Text(t) => (
                        tokenizer
                            .encode(t, true)
                            .map_err(|e| ApiError::invalid(e.to_string()))?,
                        stop_tokens.clone(),
                    ),
                    Input::Chat(messages) => {
                        let Some(template) = &chat_template else {
                            return Err(ApiError::invalid(
                                "this model has no usable chat template; use /v1/completions",
                            ));
                        };
                        let text = template
                            .render(messages, true)
                            .map_err(|e| engine_error(&e).with_param("messages"))?;
                        // The rendered text carries its own BOS where the template wants one.
                        let ids = tokenizer
                            .encode(&text, false)
                            .map_err(|e| ApiError::invalid(e.to_string()))?;
                        (ids, chat_stop_tokens.clone())
                    }
                };
                if prompt.is_empty() {
                    return Err(ApiError::invalid("the prompt is empty").with_param("prompt"));
                }
                let max_tokens = job
                    .max_tokens
                    .unwrap_or_else(|| context.saturating_sub(prompt.len()));
                if prompt.len() >= context || prompt.len().saturating_add(max_tokens) > context {
                    return Err(ApiError::invalid(format!(
                        "This model's maximum context length is {context} tokens. However, you \
                         requested {} tokens ({} in the messages/prompt, {max_tokens} for the \
                         completion). Please reduce the prompt or max_tokens.",
                        prompt.len().saturating_add(max_tokens),
                        prompt.len(),
                    ))
                    .with_param("max_tokens")
                    .with_code("context_length_exceeded"));
                }
                Ok((prompt, max_tokens, stops))
            })();
            let (prompt, max_tokens, stops) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    let _ = reply.send(StreamItem::Error(e));
                    continue;
                }
            };
            let prompt_tokens = prompt.len();
            let request = GenerationRequest {
                prompt,
                max_tokens,
                sampler: job.sampler,
                stop_tokens: stops,
                logprobs: None,
            };
            match batch.add(request) {
                Ok(id) => {
                    let _ = reply.send(StreamItem::Accepted { prompt_tokens });
                    live.insert(
                        id,
                        Live {
                            reply,
                            stream: TextStream::new(),
                            text: String::new(),
                            sent: 0,
                            stops: job.stops.into_iter().filter(|s| !s.is_empty()).collect(),
                            prompt_tokens,
                            tokens: 0,
                        },
                    );
                }
                Err(e) => {
                    let _ = reply.send(StreamItem::Error(engine_error(&e)));
                }
            }
        }

        // Clients that went away.
        let gone: Vec<RequestId> = live
            .iter()
            .filter(|(_, l)| l.reply.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            batch.cancel(id);
            live.remove(&id);
        }

        if batch.is_idle() {
            continue;
        }
        let events = match catch_unwind(AssertUnwindSafe(|| batch.step())) {
            Ok(Ok(events)) => events,
            failed => {
                // The step failed for the whole batch: fail its requests, start over empty.
                let message = match failed {
                    Ok(Err(e)) => format!("the engine failed: {e}"),
                    _ => "the engine failed (panic in a step)".to_string(),
                };
                for (_, l) in live.drain() {
                    let _ = l
                        .reply
                        .send(StreamItem::Error(ApiError::internal(message.clone())));
                }
                match Batch::new(&model, &scheme, prefill_chunk, limits) {
                    Ok(b) => batch = b.with_prefix_cache(prefix_cache),
                    Err(_) => return,
                }
                continue;
            }
        };
        for event in events {
            match event {
                Event::Token { id, token, .. } => {
                    let Some(l) = live.get_mut(&id) else { continue };
                    l.tokens += 1;
                    let piece = match l.stream.push(&tokenizer, token) {
                        Ok(p) => p,
                        Err(e) => {
                            let _ = l.reply.send(StreamItem::Error(ApiError::internal(format!(
                                "detokenizing failed: {e}"
                            ))));
                            batch.cancel(id);
                            live.remove(&id);
                            continue;
                        }
                    };
                    if l.forward(&piece, false) {
                        // Cut by a stop string: the engine's finish event never comes.
                        l.done(Finish::Stop, 0);
                        batch.cancel(id);
                        live.remove(&id);
                    }
                }
                Event::Finished {
                    id,
                    reason,
                    cached_tokens,
                    ..
                } => {
                    let Some(mut l) = live.remove(&id) else {
                        continue;
                    };
                    let rest = l.stream.finish();
                    let finish = if l.forward(&rest, true) {
                        Finish::Stop
                    } else {
                        match reason {
                            StopReason::EndToken => Finish::Stop,
                            StopReason::MaxTokens | StopReason::ContextLimit => Finish::Length,
                        }
                    };
                    l.done(finish, cached_tokens);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(stops: &[&str]) -> (Live, mpsc::UnboundedReceiver<StreamItem>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let l = Live {
            reply: tx,
            stream: TextStream::new(),
            text: String::new(),
            sent: 0,
            stops: stops.iter().map(|s| s.to_string()).collect(),
            prompt_tokens: 0,
            tokens: 0,
        };
        (l, rx)
    }

    fn sent(rx: &mut mpsc::UnboundedReceiver<StreamItem>) -> String {
        let mut out = String::new();
        while let Ok(item) = rx.try_recv() {
            if let StreamItem::Text(t) = item {
                out.push_str(&t);
            }
        }
        out
    }

    #[test]
    fn a_stop_string_split_over_pieces_is_held_back_then_cut() {
        let (mut l, mut rx) = live(&["END"]);
        assert!(!l.forward("hello E", false));
        assert_eq!(sent(&mut rx), "hello ");
        assert!(!l.forward("N", false));
        assert_eq!(sent(&mut rx), "");
        assert!(l.forward("D more", false));
        assert_eq!(sent(&mut rx), "");
        assert_eq!(&l.text[..l.sent], "hello ");
    }

    #[test]
    fn a_held_prefix_that_does_not_complete_is_released() {
        let (mut l, mut rx) = live(&["END"]);
        assert!(!l.forward("a E", false));
        assert!(!l.forward("x", false));
        assert_eq!(sent(&mut rx), "a Ex");
        assert!(!l.forward("E", true));
        assert_eq!(sent(&mut rx), "E");
    }

    #[test]
    fn the_earliest_stop_wins_and_multibyte_text_is_safe() {
        let (mut l, mut rx) = live(&["é!", "b"]);
        assert!(l.forward("ééaé!b", false));
        assert_eq!(sent(&mut rx), "ééa");
    }
}
