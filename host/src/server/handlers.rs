//! The routes: parse and validate a request, queue it on the engine, relay
//! its events as one JSON body or as SSE `data:` chunks ending `data: [DONE]`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{ApiError, ChatRequest, Common, CompletionRequest, Prompt};
use super::scheduler::{Cmd, Event, Finish, Job};
use super::{AppState, BODY_LIMIT};
use crate::chat::Message;

const UI: &str = include_str!("ui.html");

pub fn router(st: Arc<AppState>) -> Router {
    Router::new()
        .route("/", get(ui))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/props", get(props))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .fallback(|| async { ApiError::not_found("no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", Some("method_not_allowed"), "method not allowed on this route")
        })
        .layer(axum::middleware::from_fn_with_state(st.clone(), super::guard::guard))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(st)
}

async fn ui() -> impl IntoResponse {
    ([(header::CACHE_CONTROL, "no-store")], Html(UI))
}

/// 200 while the engine thread runs; 503 once it has stopped (shutdown, or a bug).
async fn health(State(st): State<Arc<AppState>>) -> Response {
    let broken = st.metrics.broken.lock().map(|b| b.clone()).unwrap_or(None);
    if let Some(why) = broken {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unavailable", "reason": why}))).into_response();
    }
    if st.engine_alive.load(Relaxed) {
        Json(json!({"status": "ok"})).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unavailable", "reason": "the engine has stopped"}))).into_response()
    }
}

/// Tokenize off the async workers (a prompt can be megabytes).
async fn encode(st: &Arc<AppState>, text: String, bos: bool) -> Result<Vec<u32>, ApiError> {
    let s = st.clone();
    blocking(st, move || {
        let st = s;
        let mut ids = Vec::new();
        if bos && st.tok.add_bos() {
            ids.extend(st.tok.bos());
        }
        ids.extend(st.tok.encode(&text, false, true));
        ids
    })
    .await
}

#[derive(serde::Deserialize)]
struct MetricsQuery {
    format: Option<String>,
}

async fn metrics(State(st): State<Arc<AppState>>, Query(q): Query<MetricsQuery>, headers: HeaderMap) -> Response {
    let snap = st.metrics.snapshot();
    let wants_json =
        q.format.as_deref() == Some("json") || headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|a| a.contains("application/json"));
    if wants_json {
        Json(snap).into_response()
    } else {
        ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], snap.prometheus()).into_response()
    }
}

fn model_object(st: &AppState) -> Value {
    json!({
        "id": st.opts.model_id,
        "object": "model",
        "created": st.created,
        "owned_by": "pulsar",
        "meta": {"n_ctx": st.opts.n_ctx, "parallel": st.opts.parallel},
    })
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&st)]}))
}

async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    if id != st.opts.model_id {
        return Err(ApiError::not_found(format!("model `{id}` is not served here (this server serves `{}`)", st.opts.model_id)));
    }
    Ok(Json(model_object(&st)))
}

/// llama-server's `/props`: the defaults a request gets, the context, the template.
async fn props(State(st): State<Arc<AppState>>) -> Json<Value> {
    let d = &st.opts.sampling;
    // 0.95, not f32's 0.949999988079071.
    let f = |x: f32| x.to_string().parse::<f64>().unwrap_or(x as f64);
    Json(json!({
        "default_generation_settings": {
            "n_ctx": st.opts.n_ctx,
            "params": {
                "temperature": f(d.temperature),
                "top_k": d.top_k,
                "top_p": f(d.top_p),
                "min_p": f(d.min_p),
                "repeat_penalty": f(d.repeat_penalty),
                "repeat_last_n": d.repeat_last_n,
                "presence_penalty": f(d.presence_penalty),
                "frequency_penalty": f(d.frequency_penalty),
            },
        },
        "total_slots": st.opts.parallel,
        "model_alias": st.opts.model_id,
        "chat_template": st.template.as_ref().map(|t| t.text()).ok(),
    }))
}

#[derive(serde::Deserialize)]
struct TokenizeRequest {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

/// llama-server's `/tokenize`: `{"tokens": [ids]}`, or `[{id, piece}]` with `with_pieces`.
async fn tokenize(State(st): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    let req: TokenizeRequest = parse(&st, body).await?;
    let ids = encode(&st, req.content, req.add_special).await?;
    if !req.with_pieces {
        return Ok(Json(json!({ "tokens": ids })));
    }
    let tokens: Vec<Value> = ids.iter().map(|&id| json!({"id": id, "piece": st.tok.decode(&[id])})).collect();
    Ok(Json(json!({ "tokens": tokens })))
}

#[derive(serde::Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<i64>,
}

async fn detokenize(State(st): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    let req: DetokenizeRequest = parse(&st, body).await?;
    let n = st.tok.vocab_size() as i64;
    let mut ids = Vec::with_capacity(req.tokens.len());
    for t in req.tokens {
        if !(0..n).contains(&t) {
            return Err(ApiError::invalid_param("tokens", format!("token id {t} is outside the vocabulary (0 to {})", n - 1)));
        }
        ids.push(t as u32);
    }
    Ok(Json(json!({ "content": st.tok.decode(&ids) })))
}

#[derive(serde::Deserialize)]
struct TemplateRequest {
    messages: Vec<super::api::ChatMessage>,
}

/// llama-server's `/apply-template`: the prompt a chat request would run, not run.
async fn apply_template(State(st): State<Arc<AppState>>, body: Body) -> Result<Json<Value>, ApiError> {
    let req: TemplateRequest = parse(&st, body).await?;
    let messages = messages_of(&st, &req.messages)?;
    Ok(Json(json!({ "prompt": render(&st, messages).await? })))
}

/// A JSON body: 408 past the body deadline, 413 past the size limit, 400
/// for anything that does not parse. The bytes arrive on the async worker;
/// parsing them (megabytes, maybe) runs on a blocking thread so that
/// `/health` and the other connections never wait behind it.
async fn parse<T: DeserializeOwned + Send + 'static>(st: &AppState, body: Body) -> Result<T, ApiError> {
    let limit = st.opts.body_timeout;
    let bytes = match tokio::time::timeout(limit, axum::body::to_bytes(body, BODY_LIMIT)).await {
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                Some("request_timeout"),
                format!("the request body did not arrive within {} s", limit.as_secs_f64()),
            ));
        }
        Ok(Err(e)) if is_over_limit(&e) => {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                Some("request_too_large"),
                format!("the request body is over the {} MiB limit", BODY_LIMIT >> 20),
            ));
        }
        Ok(Err(e)) => return Err(ApiError::invalid(format!("cannot read the request body: {e}"))),
        Ok(Ok(b)) => b,
    };
    if bytes.is_empty() {
        return Err(ApiError::invalid("the request body is empty: send a JSON object"));
    }
    blocking(st, move || {
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", Some("invalid_json"), format!("invalid request body: {e}")))
    })
    .await?
}

fn is_over_limit(e: &axum::Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cur {
        if c.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = c.source();
    }
    false
}

/// Run `f` on tokio's blocking pool (CPU work a request brings: parsing,
/// template rendering, tokenizing), at most one job a core at a time: more
/// would only add memory and steal the CPU the async workers need.
async fn blocking<T: Send + 'static>(st: &AppState, f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    let _turn = st.cpu_work.acquire().await.map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("a request worker failed: {e}")))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

/// A request's messages in the template's terms, checked.
fn messages_of(st: &AppState, msgs: &[super::api::ChatMessage]) -> Result<Vec<Message>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::invalid_param("messages", "`messages` is empty"));
    }
    if let Err(e) = &st.template {
        return Err(ApiError::invalid(format!("this model has no chat template ({e}): use /v1/completions")));
    }
    let mut messages = Vec::with_capacity(msgs.len());
    for m in msgs {
        if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(ApiError::invalid_param("messages", format!("unknown role `{}`", m.role)));
        }
        let role = if m.role == "developer" { "system".to_string() } else { m.role.clone() };
        messages.push(Message { role, content: m.text()? });
    }
    Ok(messages)
}

/// Render the chat template off the async workers (bounded by its fuel).
async fn render(st: &Arc<AppState>, messages: Vec<Message>) -> Result<String, ApiError> {
    let s = st.clone();
    blocking(st, move || {
        let tpl = s.template.as_ref().map_err(|e| ApiError::invalid(e.clone()))?;
        tpl.render(&messages, true).map_err(|e| ApiError::invalid_param("messages", format!("{e:#}")))
    })
    .await?
}

/// `model` names the served model or nothing (OpenAI answers another name with a 404).
fn check_model(st: &AppState, common: &Common) -> Result<(), ApiError> {
    match common.model.as_deref().filter(|m| !m.is_empty()) {
        Some(m) if m != st.opts.model_id => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            format!("the model `{m}` does not exist here: this server serves `{}`", st.opts.model_id),
        )
        .with_param("model")),
        _ => Ok(()),
    }
}

async fn chat(State(st): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(&st, body).await?;
    check_model(&st, &req.common)?;
    req.common.check_supported()?;
    let messages = messages_of(&st, &req.messages)?;
    // The template adds BOS itself when the family wants one.
    let text = render(&st, messages).await?;
    let ids = encode(&st, text, false).await?;
    generate(st, ids, req.common, Kind::Chat).await
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(&st, body).await?;
    check_model(&st, &req.common)?;
    req.common.check_supported()?;
    let text = match req.prompt {
        Prompt::One(s) => s,
        Prompt::Many(mut v) if v.len() == 1 => v.remove(0),
        Prompt::Many(v) => return Err(ApiError::invalid_param("prompt", format!("only one prompt per request is supported, got {}", v.len()))),
    };
    let ids = encode(&st, text, true).await?;
    generate(st, ids, req.common, Kind::Completion).await
}

async fn generate(st: Arc<AppState>, prompt: Vec<u32>, common: Common, kind: Kind) -> Result<Response, ApiError> {
    let rejected = |e: ApiError| {
        st.metrics.requests_rejected.fetch_add(1, Relaxed);
        e
    };
    common.check_n().map_err(rejected)?;
    let seed = st.seeds.fetch_add(0x9e37_79b9_7f4a_7c15, Relaxed);
    let sampling = common.sampling(&st.opts.sampling, seed).map_err(rejected)?;
    let stops = common.stops().map_err(rejected)?;
    let n_ctx = st.opts.n_ctx;
    if prompt.is_empty() {
        return Err(rejected(ApiError::invalid_param("prompt", "the prompt is empty")));
    }
    if prompt.len() >= n_ctx {
        return Err(rejected(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("context_length_exceeded"),
            format!("the prompt is {} tokens; the context holds {n_ctx} (raise --ctx)", prompt.len()),
        )));
    }
    // max_tokens is clamped to what fits the context.
    let room = n_ctx - prompt.len();
    let max_tokens = common.max_tokens().map_err(rejected)?.map_or(room, |m| m.min(room));
    // Check and take a queue place in one step, so concurrent requests
    // cannot all pass the check and overfill the queue.
    let max_queue = st.opts.max_queue as u64;
    if st.metrics.queue_depth.fetch_update(Relaxed, Relaxed, |d| (d < max_queue).then_some(d + 1)).is_err() {
        return Err(rejected(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("queue_full"), "too many requests are waiting: retry later")));
    }
    let (tx, rx) = unbounded_channel();
    let n_prompt = prompt.len();
    let job = Job { prompt, sampling, max_tokens, stops, ignore_eos: common.ignore_eos, events: tx, enqueued: Instant::now() };
    if st.engine.send(Cmd::Submit(job)).is_err() {
        st.metrics.queue_depth.fetch_sub(1, Relaxed);
        return Err(rejected(ApiError::unavailable("the server is shutting down")));
    }
    st.metrics.requests_total.fetch_add(1, Relaxed);
    let n = st.ids.fetch_add(1, Relaxed);
    let meta = Meta {
        id: format!("{}-{n:08x}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
        created: super::api::now_secs(),
        model: st.opts.model_id.clone(),
        kind,
        include_usage: common.include_usage(),
    };
    tracing::debug!("{}: {n_prompt} prompt tokens, max_tokens {max_tokens}, stream {}", meta.id, common.stream);
    if common.stream {
        Ok(stream(meta, rx).into_response())
    } else {
        whole(meta, rx).await
    }
}

/// What every response and chunk repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    include_usage: bool,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({"id": self.id, "object": self.object(chunk), "created": self.created, "model": self.model, "system_fingerprint": "pulsar", "choices": choices})
    }

    /// A stream chunk carrying `text` (and, at the end, the finish reason).
    fn chunk(&self, text: Option<&str>, role: bool, finish: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Completion => json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}),
        };
        self.envelope(true, json!([choice]))
    }
}

async fn whole(meta: Meta, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let fin: Finish = loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done(f)) => break f,
            Some(Event::Error(e)) => return Err(e),
            None => return Err(ApiError::internal("the engine stopped before the generation finished")),
        }
    };
    let choice = match meta.kind {
        Kind::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": fin.reason}),
        Kind::Completion => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": fin.reason}),
    };
    let mut body = meta.envelope(false, json!([choice]));
    body["usage"] = json!(fin.usage);
    body["timings"] = json!(fin.timings);
    Ok(Json(body).into_response())
}

struct StreamState {
    meta: Meta,
    rx: UnboundedReceiver<Event>,
    out: VecDeque<String>,
    started: bool,
    ended: bool,
}

fn stream(meta: Meta, rx: UnboundedReceiver<Event>) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let state = StreamState { meta, rx, out: VecDeque::new(), started: false, ended: false };
    let s = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(data) = s.out.pop_front() {
                return Some((Ok(SseEvent::default().data(data)), s));
            }
            if s.ended {
                return None;
            }
            if !s.started && s.meta.kind == Kind::Chat {
                s.started = true;
                s.out.push_back(s.meta.chunk(Some(""), true, None).to_string());
                continue;
            }
            s.started = true;
            match s.rx.recv().await {
                Some(Event::Text(t)) => s.out.push_back(s.meta.chunk(Some(&t), false, None).to_string()),
                Some(Event::Done(f)) => {
                    let mut last = match s.meta.kind {
                        Kind::Chat => s.meta.chunk(None, false, Some(f.reason)),
                        Kind::Completion => s.meta.chunk(Some(""), false, Some(f.reason)),
                    };
                    last["timings"] = json!(f.timings);
                    s.out.push_back(last.to_string());
                    if s.meta.include_usage {
                        let mut u = s.meta.envelope(true, json!([]));
                        u["usage"] = json!(f.usage);
                        s.out.push_back(u.to_string());
                    }
                    s.out.push_back("[DONE]".into());
                    s.ended = true;
                }
                Some(Event::Error(e)) => {
                    s.out.push_back(e.body().to_string());
                    s.out.push_back("[DONE]".into());
                    s.ended = true;
                }
                None => {
                    s.out.push_back(ApiError::internal("the engine stopped before the generation finished").body().to_string());
                    s.out.push_back("[DONE]".into());
                    s.ended = true;
                }
            }
        }
    });
    Sse::new(s).keep_alive(KeepAlive::default())
}
