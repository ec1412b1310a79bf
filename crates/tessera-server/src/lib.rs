//! tessera-server: an OpenAI-compatible HTTP server (axum + tokio) in front of one
//! [`tessera_engine::Batch`].
//!
//! The engine runs on its own thread ([`engine::run`]) and is the only thread that touches
//! the model, tokenizer and caches; HTTP handlers parse and validate a request, send it to
//! the engine over a channel, and turn what comes back into a JSON response or an SSE
//! stream. A request that fails is answered with an OpenAI-shaped error and never takes
//! another request, or the process, with it.
//!
//! Routes: `GET /health`, `GET /metrics` (Prometheus text; no API key, like vLLM's and
//! llama-server's), `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`.
//! SIGINT or SIGTERM stops accepting connections and lets requests in flight finish (up to
//! [`SHUTDOWN_GRACE`]); a second signal exits at once.

pub mod engine;
pub mod metrics;
pub mod openai;

use axum::body::{Body as HttpBody, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine::{EngineParts, Input, Job, Reply, StreamItem, Submit};
use metrics::Metrics;
use openai::{ApiError, Body, ChatMessage, ChoiceOut, Endpoint, Envelope, Prompt, Sampling};
use serde_json::{json, Value};
use std::future::IntoFuture;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tessera_engine::{SamplerConfig, MAX_TOP_LOGPROBS};
use tokio::sync::mpsc;

/// How long a shutdown waits for requests in flight.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// The most choices (prompts × `n`) one request may ask for.
pub const MAX_CHOICES: usize = 64;

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
    metrics: Arc<Metrics>,
    /// `--max-queue`: every choice of a request waits in the queue at first.
    max_queue: usize,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM; never where neither can be listened for.
async fn shutdown_signal() {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {}
        _ = terminate => {}
    }
}

/// Serves until SIGINT or SIGTERM, then stops accepting connections, lets requests in
/// flight finish (at most [`SHUTDOWN_GRACE`]) and returns `Ok`. Prints
/// `listening on http://HOST:PORT` on stderr once the socket is bound.
pub fn serve(config: ServerConfig) -> Result<(), ServerError> {
    let ServerConfig {
        host,
        port,
        model_name,
        api_key,
        engine,
    } = config;
    let queue = engine.limits.max_queue.max(1);
    let metrics = Arc::new(Metrics::new(engine.limits.kv_budget));
    let (tx, rx) = mpsc::channel::<Submit>(queue);
    let engine_metrics = metrics.clone();
    let engine_thread = std::thread::Builder::new()
        .name("tessera-engine".into())
        .spawn(move || engine::run(engine, rx, engine_metrics))
        .map_err(|e| ServerError(format!("cannot start the engine thread: {e}")))?;
    let state = Arc::new(AppState {
        submit: tx,
        model_name,
        api_key,
        started: unix_now(),
        next_id: AtomicU64::new(0),
        metrics,
        max_queue: queue,
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
        let signalled = Arc::new(tokio::sync::Notify::new());
        let notify = signalled.clone();
        let server = axum::serve(listener, router(state))
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                eprintln!(
                    "shutting down: no new connections; requests in flight may take up to {}s",
                    SHUTDOWN_GRACE.as_secs()
                );
                notify.notify_one();
            })
            .into_future();
        // After the signal: the grace period, or a second signal, ends the wait.
        let deadline = async {
            signalled.notified().await;
            tokio::select! {
                _ = tokio::time::sleep(SHUTDOWN_GRACE) => {
                    eprintln!("shutdown: requests still running after the grace period; exiting");
                }
                _ = shutdown_signal() => eprintln!("shutdown: second signal; exiting"),
            }
        };
        tokio::select! {
            r = server => r.map_err(|e| ServerError(format!("server failed: {e}"))),
            _ = deadline => Ok(()),
        }
    });
    // Requests still running (past the grace period) are abandoned with the runtime; the
    // engine thread ends once its submission channel closes, or with the process.
    runtime.shutdown_background();
    drop(engine_thread);
    if result.is_ok() {
        eprintln!("stopped");
    }
    result
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|| async { ApiError::not_found("no such route") })
        .with_state(state)
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
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

/// The served model as OpenAI lists it.
fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "tessera",
    })
}

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = check_key(&state, &headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [model_object(&state)]})).into_response()
}

/// `GET /v1/models/{id}` (the openai client's `models.retrieve`): the served model, or 404.
async fn model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = check_key(&state, &headers) {
        return e.into_response();
    }
    if id != state.model_name {
        return ApiError::not_found(format!(
            "The model '{id}' does not exist; this server serves '{}'",
            state.model_name
        ))
        .with_code("model_not_found")
        .into_response();
    }
    Json(model_object(&state)).into_response()
}

/// The sampler the request's fields ask for, validated by the engine's own rules (its
/// messages name the setting, which becomes `param`); OpenAI's temperature range [0, 2]
/// is checked here.
fn sampler(s: &Sampling) -> Result<SamplerConfig, ApiError> {
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(
            ApiError::invalid(format!("temperature must be in [0, 2], not {temperature}"))
                .with_param("temperature"),
        );
    }
    // -1 and 0 both mean "off" (vLLM and llama.cpp conventions).
    let top_k = match s.top_k {
        None | Some(-1) | Some(0) => None,
        Some(k) if k > 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(_) => {
            return Err(ApiError::invalid("top_k must be -1, 0 or positive").with_param("top_k"))
        }
    };
    let seed = s.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let config = SamplerConfig {
        temperature,
        top_k,
        // 1 and 0 are "off"; anything else goes to `validate`, which refuses what is out of
        // range.
        top_p: s.top_p.filter(|&p| p != 1.0),
        min_p: s.min_p.filter(|&p| p != 0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        seed,
        ..Default::default()
    };
    config.validate().map_err(|e| engine::engine_error(&e))?;
    Ok(config)
}

/// What shapes the answer (beyond the choices' contents).
struct Answer {
    endpoint: Endpoint,
    /// Choices per prompt.
    n: usize,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    received: Instant,
}

fn refuse_if(cond: bool, param: &'static str, message: &str) -> Result<(), ApiError> {
    match cond {
        true => Err(ApiError::invalid(message).with_param(param)),
        false => Ok(()),
    }
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received = Instant::now();
    let run = async {
        check_key(&state, &headers)?;
        let body = Body::parse(&body)?;
        let prompts = openai::prompts(&body)?;
        let sampling = Sampling::from_body(&body)?;
        let sampler = sampler(&sampling)?;
        // OpenAI's default for completions.
        let max_tokens = body.get::<usize>("max_tokens")?.unwrap_or(16);
        let logprobs = body.get::<usize>("logprobs")?;
        if let Some(k) = logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return Err(ApiError::invalid(format!(
                "logprobs must be at most {MAX_TOP_LOGPROBS}, not {k}"
            ))
            .with_param("logprobs"));
        }
        refuse_if(
            body.get::<bool>("echo")?.unwrap_or(false),
            "echo",
            "echo is not supported",
        )?;
        refuse_if(
            body.get::<u64>("best_of")?.is_some_and(|b| b > 1),
            "best_of",
            "best_of is not supported; use n",
        )?;
        refuse_if(
            prompts.len() * sampling.n > MAX_CHOICES,
            "prompt",
            &format!("at most {MAX_CHOICES} choices (prompts × n) per request"),
        )?;
        let jobs = prompts
            .into_iter()
            .map(|p| Job {
                input: match p {
                    Prompt::Text(t) => Input::Text(t),
                    Prompt::Tokens(ids) => Input::Tokens(ids),
                },
                n: sampling.n,
                max_tokens: Some(max_tokens),
                sampler: sampler.clone(),
                stops: sampling.stop.clone(),
                logprobs,
                ignore_eos: sampling.ignore_eos,
            })
            .collect();
        let answer = Answer {
            endpoint: Endpoint::Completions,
            n: sampling.n,
            stream: sampling.stream,
            include_usage: sampling.include_usage,
            logprobs: logprobs.is_some(),
            received,
        };
        respond(&state, jobs, answer).await
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let received = Instant::now();
    let run = async {
        check_key(&state, &headers)?;
        let body = Body::parse(&body)?;
        let messages: Vec<ChatMessage> = body.require("messages")?;
        refuse_if(
            messages.is_empty(),
            "messages",
            "messages must not be empty",
        )?;
        let sampling = Sampling::from_body(&body)?;
        let sampler = sampler(&sampling)?;
        let max_tokens = match body.get::<usize>("max_completion_tokens")? {
            Some(m) => Some(m),
            None => body.get::<usize>("max_tokens")?,
        };
        let want = body.get::<bool>("logprobs")?.unwrap_or(false);
        let top = body.get::<usize>("top_logprobs")?;
        refuse_if(
            !want && top.is_some_and(|t| t > 0),
            "top_logprobs",
            "top_logprobs needs logprobs to be true",
        )?;
        if let Some(t) = top.filter(|&t| t > MAX_TOP_LOGPROBS) {
            return Err(ApiError::invalid(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, not {t}"
            ))
            .with_param("top_logprobs"));
        }
        let messages = messages
            .into_iter()
            .map(ChatMessage::text)
            .collect::<Result<Vec<_>, _>>()?;
        let job = Job {
            input: Input::Chat(messages),
            n: sampling.n,
            max_tokens,
            sampler,
            stops: sampling.stop.clone(),
            logprobs: want.then(|| top.unwrap_or(0)),
            ignore_eos: sampling.ignore_eos,
        };
        let answer = Answer {
            endpoint: Endpoint::Chat,
            n: sampling.n,
            stream: sampling.stream,
            include_usage: sampling.include_usage,
            logprobs: want,
            received,
        };
        respond(&state, vec![job], answer).await
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

/// A finished choice's counts.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    prompt: usize,
    completion: usize,
    cached: usize,
}

/// `usage` over every choice: each prompt counted once (its `n` choices share it), the
/// completions summed.
fn total_usage(counts: &[Counts], n: usize) -> Value {
    let (mut prompt, mut completion, mut cached) = (0, 0, 0);
    for group in counts.chunks(n.max(1)) {
        let p = group.first().map_or(0, |c| c.prompt);
        prompt += p;
        cached += group.iter().map(|c| c.cached).max().unwrap_or(0).min(p);
        completion += group.iter().map(|c| c.completion).sum::<usize>();
    }
    openai::usage(prompt, completion, cached)
}

/// Submits the request's jobs and answers with the whole response, or an SSE stream when
/// asked.
async fn respond(state: &AppState, jobs: Vec<Job>, answer: Answer) -> Result<Response, ApiError> {
    let choices: usize = jobs.iter().map(|j| j.n).sum();
    if choices > state.max_queue {
        // It could never be queued whole: not a "try again later".
        return Err(ApiError::invalid(format!(
            "this request asks for {choices} choices (prompts × n); the server queues at \
             most {} (--max-queue)",
            state.max_queue
        ))
        .with_param("n"));
    }
    let (reply, mut rx) = mpsc::unbounded_channel();
    state
        .submit
        .try_send(Submit {
            jobs,
            reply,
            received: answer.received,
        })
        .map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                ApiError::busy("the server's queue is full; try again later")
            }
            mpsc::error::TrySendError::Closed(_) => ApiError::internal("the engine has stopped"),
        })?;
    match rx.recv().await.map(|r| r.item) {
        Some(StreamItem::Accepted) => {}
        Some(StreamItem::Error(e)) => return Err(e),
        _ => return Err(ApiError::internal("the engine has stopped")),
    }
    let prefix = match answer.endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let serial = state.next_id.fetch_add(1, Ordering::Relaxed);
    let envelope = Envelope {
        endpoint: answer.endpoint,
        id: format!("{prefix}-{:x}{serial:06x}", state.started),
        created: unix_now(),
        model: state.model_name.clone(),
        logprobs: answer.logprobs,
    };
    if answer.stream {
        return Ok(sse(envelope, rx, choices, answer.n, answer.include_usage));
    }
    let mut out = vec![ChoiceOut::default(); choices];
    let mut counts = vec![Counts::default(); choices];
    let mut left = choices;
    while left > 0 {
        let Some(Reply { choice, item }) = rx.recv().await else {
            return Err(ApiError::internal("the engine has stopped"));
        };
        let (Some(c), Some(count)) = (out.get_mut(choice), counts.get_mut(choice)) else {
            continue;
        };
        match item {
            StreamItem::Text { text, logprobs } => {
                c.text.push_str(&text);
                c.logprobs.extend(logprobs);
            }
            StreamItem::Done {
                finish,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                logprobs,
            } => {
                if c.finish.is_none() {
                    left -= 1;
                }
                c.finish = Some(finish);
                c.logprobs.extend(logprobs);
                *count = Counts {
                    prompt: prompt_tokens,
                    completion: completion_tokens,
                    cached: cached_tokens,
                };
            }
            StreamItem::Error(e) => return Err(e),
            StreamItem::Accepted => {}
        }
    }
    Ok(Json(envelope.response(&out, total_usage(&counts, answer.n))).into_response())
}

fn event(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The SSE stream: for chat, a role chunk per choice first; then one `data: {json}\n\n`
/// event per piece of text of any choice (with its `index`), each choice's finishing chunk,
/// the usage chunk when asked once all are done, then `data: [DONE]\n\n`.
fn sse(
    envelope: Envelope,
    rx: mpsc::UnboundedReceiver<Reply>,
    choices: usize,
    n: usize,
    include_usage: bool,
) -> Response {
    struct St {
        rx: mpsc::UnboundedReceiver<Reply>,
        envelope: Envelope,
        started: bool,
        done: bool,
        include_usage: bool,
        n: usize,
        finished: Vec<Option<Counts>>,
        /// Per choice: characters so far (completions' `text_offset`).
        offsets: Vec<usize>,
    }
    let st = St {
        rx,
        envelope,
        started: false,
        done: false,
        include_usage,
        n,
        finished: vec![None; choices],
        offsets: vec![0; choices],
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let mut out = String::new();
        if !st.started {
            st.started = true;
            if st.envelope.endpoint == Endpoint::Chat {
                // The role comes first, in a chunk of its own per choice (as OpenAI sends).
                for index in 0..st.finished.len() {
                    out.push_str(&event(&st.envelope.chunk(
                        index,
                        Some(""),
                        true,
                        None,
                        &[],
                        &mut 0,
                        st.include_usage,
                    )));
                }
                return Some((Ok::<_, std::convert::Infallible>(Bytes::from(out)), st));
            }
        }
        let fail = |out: &mut String, e: ApiError| {
            out.push_str(&event(&e.body()));
            out.push_str("data: [DONE]\n\n");
        };
        loop {
            let Some(Reply { choice, item }) = st.rx.recv().await else {
                fail(&mut out, ApiError::internal("the engine has stopped"));
                st.done = true;
                break;
            };
            let Some(offset) = st.offsets.get_mut(choice) else {
                continue;
            };
            match item {
                StreamItem::Text { text, logprobs } => {
                    if text.is_empty() && logprobs.is_empty() {
                        continue;
                    }
                    out.push_str(&event(&st.envelope.chunk(
                        choice,
                        Some(&text),
                        false,
                        None,
                        &logprobs,
                        offset,
                        st.include_usage,
                    )));
                }
                StreamItem::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    logprobs,
                } => {
                    let text = match st.envelope.endpoint {
                        Endpoint::Completions => Some(""),
                        Endpoint::Chat => None,
                    };
                    out.push_str(&event(&st.envelope.chunk(
                        choice,
                        text,
                        false,
                        Some(finish),
                        &logprobs,
                        offset,
                        st.include_usage,
                    )));
                    if let Some(f) = st.finished.get_mut(choice) {
                        *f = Some(Counts {
                            prompt: prompt_tokens,
                            completion: completion_tokens,
                            cached: cached_tokens,
                        });
                    }
                    if st.finished.iter().all(Option::is_some) {
                        if st.include_usage {
                            let counts: Vec<Counts> =
                                st.finished.iter().map(|c| c.unwrap_or_default()).collect();
                            out.push_str(&event(
                                &st.envelope.usage_chunk(total_usage(&counts, st.n)),
                            ));
                        }
                        out.push_str("data: [DONE]\n\n");
                        st.done = true;
                    }
                }
                StreamItem::Error(e) => {
                    fail(&mut out, e);
                    st.done = true;
                }
                StreamItem::Accepted => continue,
            }
            break;
        }
        Some((Ok(Bytes::from(out)), st))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(HttpBody::from_stream(stream))
        .unwrap_or_else(|_| ApiError::internal("cannot build the stream").into_response())
}
