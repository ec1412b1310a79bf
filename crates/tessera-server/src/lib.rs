//! tessera-server: an OpenAI-compatible HTTP server (axum + tokio) in front of one
//! [`tessera_engine::Batch`].
//!
//! The engine runs on its own thread ([`engine::run`]) and is the only thread that touches
//! the model, tokenizer and caches; HTTP handlers parse and validate a request, send it to
//! the engine over a channel, and turn what comes back into a JSON response or an SSE
//! stream. A request that fails is answered with an OpenAI-shaped error and never takes
//! another request, or the process, with it.
//!
//! Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions`.

pub mod engine;
pub mod openai;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine::{EngineParts, Input, Job, StreamItem, Submit};
use openai::{ApiError, ChatRequest, CompletionRequest, Endpoint, Envelope, Sampling};
use serde::de::DeserializeOwned;
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tessera_engine::SamplerConfig;
use tokio::sync::mpsc;

/// Everything `tessera serve` decided: where to listen, who may call, and the engine.
pub struct ServerConfig {
    pub host: String,
    /// 0: any free port (the "listening on" line says which).
    pub port: u16,
    /// The name `/v1/models` lists and responses carry.
    pub model_name: String,
    /// When set, `/v1/*` needs `Authorization: Bearer <api_key>`.
    pub api_key: Option<String>,
    pub engine: EngineParts,
}

#[derive(Debug)]
pub struct ServerError(pub String);

impl std::fmt::Display for ServerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ServerError {}

struct AppState {
    submit: mpsc::Sender<Submit>,
    model_name: String,
    api_key: Option<String>,
    started: u64,
    next_id: AtomicU64,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Serves until the process ends. Prints `listening on http://HOST:PORT` on stderr once the
/// socket is bound.
pub fn serve(config: ServerConfig) -> Result<(), ServerError> {
    let ServerConfig {
        host,
        port,
        model_name,
        api_key,
        engine,
    } = config;
    let queue = engine.limits.max_queue.max(1);
    let (tx, rx) = mpsc::channel::<Submit>(queue);
    let engine_thread = std::thread::Builder::new()
        .name("tessera-engine".into())
        .spawn(move || engine::run(engine, rx))
        .map_err(|e| ServerError(format!("cannot start the engine thread: {e}")))?;
    let state = Arc::new(AppState {
        submit: tx,
        model_name,
        api_key,
        started: unix_now(),
        next_id: AtomicU64::new(0),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| ServerError(format!("cannot start the async runtime: {e}")))?;
    let result = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind((host.as_str(), port))
            .await
            .map_err(|e| ServerError(format!("cannot listen on {host}:{port}: {e}")))?;
        let bound = listener
            .local_addr()
            .map_err(|e| ServerError(format!("cannot read the bound address: {e}")))?;
        eprintln!("listening on http://{host}:{}", bound.port());
        axum::serve(listener, router(state))
            .await
            .map_err(|e| ServerError(format!("server failed: {e}")))
    });
    drop(engine_thread);
    result
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|| async { ApiError::not_found("no such route") })
        .with_state(state)
}

async fn health() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

fn check_key(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(g) if g == key => Ok(()),
        _ => Err(ApiError::unauthorized()),
    }
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = check_key(&state, &headers) {
        return e.into_response();
    }
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.started,
            "owned_by": "tessera",
        }],
    }))
    .into_response()
}

/// The body as `T`: malformed JSON and wrong types are a 400 in OpenAI's shape.
fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "We could not parse the JSON body of your request"
        } else {
            "Invalid request body"
        };
        ApiError::invalid(format!("{what}: {e}"))
    })
}

fn sampler(s: &Sampling) -> Result<SamplerConfig, ApiError> {
    let temperature = s.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && temperature >= 0.0) {
        return Err(
            ApiError::invalid("temperature must be a finite number ≥ 0").with_param("temperature")
        );
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid("top_p must be in (0, 1]").with_param("top_p"));
    }
    let min_p = s.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ApiError::invalid("min_p must be in [0, 1]").with_param("min_p"));
    }
    // -1 and 0 both mean "off" (vLLM and llama.cpp conventions).
    let top_k = match s.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(k as usize),
        Some(_) => {
            return Err(ApiError::invalid("top_k must be -1, 0 or positive").with_param("top_k"))
        }
    };
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported").with_param("n"));
    }
    let seed = s.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    Ok(SamplerConfig {
        temperature,
        top_k,
        top_p: (top_p < 1.0).then_some(top_p),
        min_p: (min_p > 0.0).then_some(min_p),
        seed,
        ..Default::default()
    })
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let run = async {
        check_key(&state, &headers)?;
        let mut req: CompletionRequest = parse(&body)?;
        let job = Job {
            input: Input::Text(req.prompt),
            // OpenAI's default for completions.
            max_tokens: Some(req.max_tokens.unwrap_or(16)),
            sampler: sampler(&req.sampling)?,
            stops: req
                .sampling
                .stop
                .take()
                .map(|s| s.into_vec())
                .unwrap_or_default(),
        };
        respond(&state, Endpoint::Completions, job, &req.sampling).await
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let run = async {
        check_key(&state, &headers)?;
        let mut req: ChatRequest = parse(&body)?;
        if req.messages.is_empty() {
            return Err(ApiError::invalid("messages must not be empty").with_param("messages"));
        }
        let sampler = sampler(&req.sampling)?;
        let messages = req
            .messages
            .into_iter()
            .map(|m| m.text())
            .collect::<Result<Vec<_>, _>>()?;
        let job = Job {
            input: Input::Chat(messages),
            max_tokens: req.max_completion_tokens.or(req.max_tokens),
            sampler,
            stops: req
                .sampling
                .stop
                .take()
                .map(|s| s.into_vec())
                .unwrap_or_default(),
        };
        respond(&state, Endpoint::Chat, job, &req.sampling).await
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

/// Submits `job` and answers with the whole response, or an SSE stream when asked.
async fn respond(
    state: &AppState,
    endpoint: Endpoint,
    job: Job,
    sampling: &Sampling,
) -> Result<Response, ApiError> {
    let (reply, mut rx) = mpsc::unbounded_channel();
    state
        .submit
        .try_send(Submit { job, reply })
        .map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                ApiError::busy("the server's queue is full; try again later")
            }
            mpsc::error::TrySendError::Closed(_) => ApiError::internal("the engine has stopped"),
        })?;
    match rx.recv().await {
        Some(StreamItem::Accepted { .. }) => {}
        Some(StreamItem::Error(e)) => return Err(e),
        _ => return Err(ApiError::internal("the engine has stopped")),
    }
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let envelope = Envelope {
        endpoint,
        id: format!("{prefix}-{:x}{n:06x}", state.started),
        created: unix_now(),
        model: state.model_name.clone(),
    };
    if sampling.stream {
        let include_usage = sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        return Ok(sse(envelope, rx, include_usage));
    }
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(StreamItem::Text(t)) => text.push_str(&t),
            Some(StreamItem::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
            }) => {
                let body = envelope.response(
                    &text,
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                );
                return Ok(Json(body).into_response());
            }
            Some(StreamItem::Error(e)) => return Err(e),
            Some(StreamItem::Accepted { .. }) => {}
            None => return Err(ApiError::internal("the engine has stopped")),
        }
    }
}

fn event(v: &serde_json::Value) -> String {
    format!("data: {v}\n\n")
}

/// The SSE stream: one `data: {json}\n\n` event per piece of text, the finishing chunk,
/// the usage chunk when asked, then `data: [DONE]\n\n`.
fn sse(
    envelope: Envelope,
    rx: mpsc::UnboundedReceiver<StreamItem>,
    include_usage: bool,
) -> Response {
    struct St {
        rx: mpsc::UnboundedReceiver<StreamItem>,
        envelope: Envelope,
        first: bool,
        done: bool,
        include_usage: bool,
    }
    let st = St {
        rx,
        envelope,
        first: true,
        done: false,
        include_usage,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out = String::new();
        if st.first && st.envelope.endpoint == Endpoint::Chat {
            // The role comes first, in a chunk of its own (as OpenAI sends it).
            out.push_str(&event(&st.envelope.chunk(
                Some(""),
                true,
                None,
                st.include_usage,
            )));
            st.first = false;
            return Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), st));
        }
        st.first = false;
        loop {
            match st.rx.recv().await {
                Some(StreamItem::Text(t)) if t.is_empty() => continue,
                Some(StreamItem::Text(t)) => {
                    out.push_str(&event(&st.envelope.chunk(
                        Some(&t),
                        false,
                        None,
                        st.include_usage,
                    )));
                }
                Some(StreamItem::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                }) => {
                    let text = match st.envelope.endpoint {
                        Endpoint::Completions => Some(""),
                        Endpoint::Chat => None,
                    };
                    out.push_str(&event(&st.envelope.chunk(
                        text,
                        false,
                        Some(finish),
                        st.include_usage,
                    )));
                    if st.include_usage {
                        out.push_str(&event(&st.envelope.usage_chunk(
                            prompt_tokens,
                            completion_tokens,
                            cached_tokens,
                        )));
                    }
                    out.push_str("data: [DONE]\n\n");
                    st.done = true;
                }
                Some(StreamItem::Error(e)) => {
                    out.push_str(&event(&e.body()));
                    out.push_str("data: [DONE]\n\n");
                    st.done = true;
                }
                Some(StreamItem::Accepted { .. }) => continue,
                None => {
                    let e = ApiError::internal("the engine has stopped");
                    out.push_str(&event(&e.body()));
                    out.push_str("data: [DONE]\n\n");
                    st.done = true;
                }
            }
            return Some((Ok(Bytes::from(out)), st));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| ApiError::internal("cannot build the stream").into_response())
}
