//! OpenAI's wire shapes: the request bodies we read (unknown fields ignored), the response
//! and chunk bodies we write, and the error body `{"error": {message, type, param, code}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

/// An error as OpenAI reports it, with its HTTP status.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key: send `Authorization: Bearer KEY`.".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn busy(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded"),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// A message's `content`: a string, a list of parts (the text parts are joined), or null.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
}

impl ChatMessage {
    pub fn text(self) -> Result<tessera_engine::chat::Message, ApiError> {
        let content = match self.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => out.push_str(&t),
                        (kind, _) => {
                            return Err(ApiError::invalid(format!(
                                "message content parts of type {kind:?} are not supported; \
                                 only \"text\""
                            ))
                            .with_param("messages"))
                        }
                    }
                }
                out
            }
        };
        // OpenAI's name for system instructions to newer models; chat templates know
        // `system` only (Qwen 2.5's drops any role it does not know, silently).
        let role = if self.role == "developer" {
            "system".to_string()
        } else {
            self.role
        };
        Ok(tessera_engine::chat::Message::new(role, content))
    }
}

/// A request body: a JSON object whose fields are read one by one, so that a wrong type is
/// a 400 naming the field (`param`). Unknown fields are ignored; `null` reads as absent.
pub struct Body(serde_json::Map<String, Value>);

impl Body {
    pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        let v: Value = serde_json::from_slice(bytes).map_err(|e| {
            ApiError::invalid(format!(
                "We could not parse the JSON body of your request: {e}"
            ))
        })?;
        match v {
            Value::Object(map) => Ok(Body(map)),
            _ => Err(ApiError::invalid("The request body must be a JSON object")),
        }
    }

    /// The raw value of `name`, `None` when absent or null.
    pub fn value(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    /// Field `name` as `T`; a value that is not a `T` is a 400 with `param: name`.
    pub fn get<T: DeserializeOwned>(&self, name: &'static str) -> Result<Option<T>, ApiError> {
        match self.value(name) {
            None => Ok(None),
            Some(v) => T::deserialize(v).map(Some).map_err(|e| {
                ApiError::invalid(format!("Invalid type for '{name}': {e}")).with_param(name)
            }),
        }
    }

    /// A required field.
    pub fn require<T: DeserializeOwned>(&self, name: &'static str) -> Result<T, ApiError> {
        self.get(name)?.ok_or_else(|| {
            ApiError::invalid(format!("Missing required parameter: '{name}'.")).with_param(name)
        })
    }
}

/// The most choices one request may ask for (`n`).
pub const MAX_N: usize = 8;

/// The sampling, stopping and streaming fields both endpoints share, type-checked.
#[derive(Debug, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub stop: Vec<String>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's and llama-server's extension, which load generators send: the model's
    /// end-of-sequence tokens do not end the choice, `max_tokens` does.
    pub ignore_eos: bool,
}

impl Sampling {
    pub fn from_body(body: &Body) -> Result<Sampling, ApiError> {
        let stop = match body.value("stop") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| i.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    ApiError::invalid(
                        "Invalid type for 'stop': expected a string or a list of strings",
                    )
                    .with_param("stop")
                })?,
            Some(_) => {
                return Err(ApiError::invalid(
                    "Invalid type for 'stop': expected a string or a list of strings",
                )
                .with_param("stop"))
            }
        };
        // OpenAI's seeds are signed integers; any 64-bit integer is taken.
        let seed = match body.value("seed") {
            None => None,
            Some(v) => Some(v.as_u64().or(v.as_i64().map(|s| s as u64)).ok_or_else(|| {
                ApiError::invalid("Invalid type for 'seed': expected an integer").with_param("seed")
            })?),
        };
        let n = body.get::<u64>("n")?.unwrap_or(1);
        if !(1..=MAX_N as u64).contains(&n) {
            return Err(
                ApiError::invalid(format!("n must be between 1 and {MAX_N}, not {n}"))
                    .with_param("n"),
            );
        }
        #[derive(Deserialize)]
        struct StreamOptions {
            #[serde(default)]
            include_usage: bool,
        }
        let stream = body.get::<bool>("stream")?.unwrap_or(false);
        let include_usage = body
            .get::<StreamOptions>("stream_options")?
            .is_some_and(|o| o.include_usage);
        Ok(Sampling {
            temperature: body.get("temperature")?,
            top_p: body.get("top_p")?,
            top_k: body.get("top_k")?,
            min_p: body.get("min_p")?,
            seed,
            presence_penalty: body.get("presence_penalty")?,
            frequency_penalty: body.get("frequency_penalty")?,
            repetition_penalty: body.get("repetition_penalty")?,
            stop,
            n: n as usize,
            stream,
            include_usage,
            ignore_eos: body.get::<bool>("ignore_eos")?.unwrap_or(false),
        })
    }
}

/// One `/v1/completions` prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `prompt`: a string, a list of strings, a list of token ids or a list of lists of ids.
pub fn prompts(body: &Body) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid(
            "Invalid type for 'prompt': expected a string, a list of strings, a list of token \
             ids or a list of lists of token ids",
        )
        .with_param("prompt")
    };
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|i| i.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect()
    };
    match body.value("prompt") {
        None => {
            Err(ApiError::invalid("Missing required parameter: 'prompt'.").with_param("prompt"))
        }
        Some(Value::String(s)) => Ok(vec![Prompt::Text(s.clone())]),
        Some(Value::Array(items)) if items.is_empty() => {
            Err(ApiError::invalid("prompt must not be an empty list").with_param("prompt"))
        }
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) => items
                .iter()
                .map(|i| i.as_str().map(|s| Prompt::Text(s.to_string())))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(bad),
            Value::Number(_) => Ok(vec![Prompt::Tokens(ids(items).ok_or_else(bad)?)]),
            Value::Array(_) => items
                .iter()
                .map(|i| i.as_array().and_then(|a| ids(a)).map(Prompt::Tokens))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(bad),
            _ => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

/// Why a choice ended, in OpenAI's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// One alternative at a token's step.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

/// A generated token with its log-probability and the most likely tokens at its step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<TopLogprob>,
}

/// JSON has no -inf: OpenAI writes -9999.0 for a token the model rules out.
fn lp(v: f32) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        json!(-9999.0)
    }
}

/// Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}`.
pub fn chat_logprobs(tokens: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let top: Vec<Value> = t
                .top
                .iter()
                .map(|a| json!({"token": a.token, "logprob": lp(a.logprob), "bytes": a.bytes}))
                .collect();
            json!({"token": t.token, "logprob": lp(t.logprob), "bytes": t.bytes,
                   "top_logprobs": top})
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// Completions' `logprobs`: `{tokens, token_logprobs, top_logprobs, text_offset}`, offsets
/// (in characters) counted from `offset`, which is advanced past these tokens.
pub fn completion_logprobs(tokens: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut text_offset = Vec::with_capacity(tokens.len());
    for t in tokens {
        text_offset.push(*offset);
        *offset += t.token.chars().count();
    }
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut m = serde_json::Map::new();
            for a in &t.top {
                m.entry(a.token.clone()).or_insert_with(|| lp(a.logprob));
            }
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| lp(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

pub fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// Which endpoint a response belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// One finished choice of a whole (non-streamed) response.
#[derive(Debug, Clone, Default)]
pub struct ChoiceOut {
    pub text: String,
    pub finish: Option<Finish>,
    pub logprobs: Vec<TokenLogprob>,
}

/// What identifies one response: every chunk of a stream repeats it.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// Whether the request asked for logprobs (else `logprobs` is null).
    pub logprobs: bool,
}

impl Envelope {
    fn with(&self, object: &str, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn logprobs_value(&self, tokens: &[TokenLogprob], offset: &mut usize) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Chat => chat_logprobs(tokens),
            Endpoint::Completions => completion_logprobs(tokens, offset),
        }
    }

    /// The whole (non-streamed) response.
    pub fn response(&self, choices: &[ChoiceOut], usage: Value) -> Value {
        let finish = |c: &ChoiceOut| c.finish.map(Finish::as_str);
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let logprobs = self.logprobs_value(&c.logprobs, &mut 0);
                match self.endpoint {
                    Endpoint::Completions => json!({"index": index, "text": c.text,
                        "logprobs": logprobs, "finish_reason": finish(c)}),
                    Endpoint::Chat => json!({"index": index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs, "finish_reason": finish(c)}),
                }
            })
            .collect();
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion",
        };
        let mut v = self.with(object, Value::Array(choices));
        v["usage"] = usage;
        v
    }

    fn chunk_object(&self) -> &'static str {
        match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        }
    }

    /// A stream chunk for choice `index`: `text` (for chat, `delta`'s content; `role` on
    /// the first chunk), the logprobs of the tokens it carries (`offset`: the choice's
    /// text offset so far, for completions) and the finish reason on the last. With
    /// `include_usage`, `usage` is null until the usage chunk.
    #[allow(clippy::too_many_arguments)]
    pub fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        first: bool,
        finish: Option<Finish>,
        logprobs: &[TokenLogprob],
        offset: &mut usize,
        include_usage: bool,
    ) -> Value {
        let finish = finish.map(Finish::as_str);
        let logprobs = if logprobs.is_empty() {
            Value::Null
        } else {
            self.logprobs_value(logprobs, offset)
        };
        let choice = match self.endpoint {
            Endpoint::Completions => json!({"index": index, "text": text.unwrap_or(""),
                                            "logprobs": logprobs, "finish_reason": finish}),
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": index, "delta": delta, "logprobs": logprobs,
                       "finish_reason": finish})
            }
        };
        let mut v = self.with(self.chunk_object(), json!([choice]));
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The last chunk before `[DONE]` when `stream_options.include_usage` is set.
    pub fn usage_chunk(&self, usage: Value) -> Value {
        let mut v = self.with(self.chunk_object(), json!([]));
        v["usage"] = usage;
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(s: &str) -> Body {
        Body::parse(s.as_bytes()).unwrap()
    }

    #[test]
    fn a_developer_message_is_a_system_one_and_text_parts_join() {
        let m: Vec<ChatMessage> = serde_json::from_str(
            r#"[{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}]"#,
        )
        .unwrap();
        let m: Vec<_> = m.into_iter().map(|m| m.text().unwrap()).collect();
        let pairs: Vec<(&str, &str)> = m
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [("system", "Be brief."), ("user", "ab"), ("assistant", "")]
        );
    }

    #[test]
    fn every_prompt_form_parses_and_wrong_ones_name_the_param() {
        let p = |s| prompts(&body(s));
        assert_eq!(
            p(r#"{"prompt": "a"}"#).unwrap(),
            vec![Prompt::Text("a".into())]
        );
        assert_eq!(
            p(r#"{"prompt": ["a", "b"]}"#).unwrap(),
            vec![Prompt::Text("a".into()), Prompt::Text("b".into())]
        );
        assert_eq!(
            p(r#"{"prompt": [1, 2]}"#).unwrap(),
            vec![Prompt::Tokens(vec![1, 2])]
        );
        assert_eq!(
            p(r#"{"prompt": [[1], [2, 3]]}"#).unwrap(),
            vec![Prompt::Tokens(vec![1]), Prompt::Tokens(vec![2, 3])]
        );
        for bad in [
            r#"{"prompt": 5}"#,
            r#"{"prompt": ["a", 1]}"#,
            r#"{"prompt": [1, -2]}"#,
            r#"{"prompt": [[1], "a"]}"#,
            r#"{"prompt": []}"#,
            r#"{"prompt": {}}"#,
            r#"{}"#,
        ] {
            let e = p(bad).unwrap_err();
            assert_eq!(e.param, Some("prompt"), "{bad}");
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn wrong_types_name_the_field() {
        for (s, param) in [
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"n": 1.5}"#, "n"),
            (r#"{"stop": [1]}"#, "stop"),
            (r#"{"seed": "x"}"#, "seed"),
            (r#"{"stream": 1}"#, "stream"),
            (r#"{"stream_options": 5}"#, "stream_options"),
            (r#"{"presence_penalty": "a"}"#, "presence_penalty"),
        ] {
            let e = Sampling::from_body(&body(s)).unwrap_err();
            assert_eq!(e.param, Some(param), "{s}: {}", e.message);
        }
        let s = Sampling::from_body(&body(
            r#"{"seed": -1, "stop": "x", "n": 3, "temperature": null, "unknown": 1,
                "stream_options": {"include_usage": true}}"#,
        ))
        .unwrap();
        assert_eq!(s.seed, Some(u64::MAX));
        assert_eq!(s.stop, vec!["x".to_string()]);
        assert_eq!((s.n, s.temperature, s.include_usage), (3, None, true));
        assert!(Body::parse(b"[]").is_err());
        assert!(Body::parse(b"{").is_err());
    }

    #[test]
    fn logprobs_shapes() {
        let t = TokenLogprob {
            token: " Paris".into(),
            bytes: b" Paris".to_vec(),
            logprob: -0.5,
            top: vec![
                TopLogprob {
                    token: " Paris".into(),
                    bytes: b" Paris".to_vec(),
                    logprob: -0.5,
                },
                TopLogprob {
                    token: " a".into(),
                    bytes: b" a".to_vec(),
                    logprob: f32::NEG_INFINITY,
                },
            ],
        };
        let v = chat_logprobs(std::slice::from_ref(&t));
        assert_eq!(v["content"][0]["token"], " Paris");
        assert_eq!(v["content"][0]["top_logprobs"][1]["logprob"], -9999.0);
        assert_eq!(v["content"][0]["bytes"][0], 32);
        let mut offset = 3;
        let v = completion_logprobs(&[t.clone(), t], &mut offset);
        assert_eq!(v["text_offset"], json!([3, 9]));
        assert_eq!(offset, 15);
        assert_eq!(v["top_logprobs"][0][" Paris"], -0.5);
        assert_eq!(v["token_logprobs"], json!([-0.5, -0.5]));
    }
}
