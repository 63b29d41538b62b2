//! The OpenAI wire format: request bodies, responses, stream chunks and the
//! error object. Unknown request fields are ignored (clients send many).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::sample::SamplerConfig;

/// An error as OpenAI returns it: `{"error": {"message", "type", "code", "param"}}`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, code: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, code, param: None }
    }
    /// 400: the request is wrong.
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", None, message)
    }
    pub fn invalid_param(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::invalid(message).with_param(param)
    }
    pub fn with_param(self, param: &'static str) -> ApiError {
        ApiError { param: Some(param), ..self }
    }
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "authentication_error", Some("invalid_api_key"), message)
    }
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "permission_error", Some("forbidden"), message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", Some("not_found"), message)
    }
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("unavailable"), message)
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", Some("internal_error"), message)
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Message content: a string, or an array of parts of which only text is supported.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

impl ChatMessage {
    pub fn text(&self) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(s)) => Ok(s.clone()),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (k, _) => return Err(ApiError::invalid_param("messages", format!("content parts of type `{k}` are not supported (text only)"))),
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What both endpoints share: sampling and limits.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// llama.cpp's server names.
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    /// llama-server's: keep generating past end-of-turn tokens (benchmarks;
    /// stop strings and `max_tokens` still end the generation).
    #[serde(default)]
    pub ignore_eos: bool,
    // Fields this server does not implement yet: refused when they ask for
    // something (see `check_supported`), never silently ignored.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub response_format: Option<Value>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub logit_bias: Option<Value>,
    pub echo: Option<Value>,
    pub best_of: Option<Value>,
    pub suffix: Option<Value>,
    pub modalities: Option<Value>,
    pub audio: Option<Value>,
    pub prediction: Option<Value>,
}

/// Whether an unsupported field's value asks for something (absent, null,
/// false, 0, "", [] and {} do not).
fn asks(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64() != Some(0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: Common,
}

/// `prompt`: a string, or an array holding exactly one string.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
}

/// Most stop strings a request may give.
pub const MAX_STOPS: usize = 16;

impl Common {
    /// A 400 naming the first field asked for that this server does not implement.
    pub fn check_supported(&self) -> Result<(), ApiError> {
        let is = |v: &Option<Value>, ok: &[Value]| v.as_ref().is_some_and(|x| ok.contains(x));
        let fields: [(&'static str, bool, &str); 14] = [
            ("tools", asks(&self.tools), "tool calls are not implemented"),
            ("tool_choice", asks(&self.tool_choice) && !is(&self.tool_choice, &[json!("none"), json!("auto")]), "tool calls are not implemented"),
            ("functions", asks(&self.functions), "function calls are not implemented"),
            ("function_call", asks(&self.function_call) && !is(&self.function_call, &[json!("none"), json!("auto")]), "function calls are not implemented"),
            ("response_format", asks(&self.response_format) && !is(&self.response_format, &[json!({"type": "text"})]), "only plain text responses are implemented"),
            ("logprobs", asks(&self.logprobs), "log-probabilities are not implemented"),
            ("top_logprobs", asks(&self.top_logprobs), "log-probabilities are not implemented"),
            ("logit_bias", asks(&self.logit_bias), "logit bias is not implemented"),
            ("echo", asks(&self.echo), "echoing the prompt is not implemented"),
            ("best_of", asks(&self.best_of) && !is(&self.best_of, &[json!(1)]), "only one completion per request"),
            ("suffix", asks(&self.suffix), "fill-in-the-middle is not implemented"),
            ("modalities", asks(&self.modalities) && !is(&self.modalities, &[json!(["text"])]), "text only"),
            ("audio", asks(&self.audio), "text only"),
            ("prediction", asks(&self.prediction), "predicted outputs are not implemented"),
        ];
        match fields.iter().find(|f| f.1) {
            Some((name, _, why)) => Err(ApiError::invalid_param(name, format!("`{name}` is not supported by this server ({why})"))),
            None => Ok(()),
        }
    }

    /// Sampling settings, checked: `defaults` (the server's) for each field
    /// the request leaves out, `default_seed` when it gives none.
    pub fn sampling(&self, defaults: &SamplerConfig, default_seed: u64) -> Result<SamplerConfig, ApiError> {
        let top_k = match self.top_k {
            None => defaults.top_k,
            Some(k) if k >= 0 => k as usize,
            // llama.cpp and others use -1 for "off".
            Some(-1) => 0,
            Some(k) => return Err(ApiError::invalid_param("top_k", format!("top_k must be >= 0, got {k}"))),
        };
        let cfg = SamplerConfig {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k,
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            seed: self.seed.map(|s| s as u64).unwrap_or(default_seed),
            repeat_penalty: self.repeat_penalty.unwrap_or(defaults.repeat_penalty),
            repeat_last_n: match self.repeat_last_n {
                None => defaults.repeat_last_n,
                Some(n) if n >= 0 => n as usize,
                Some(n) => return Err(ApiError::invalid_param("repeat_last_n", format!("repeat_last_n must be >= 0, got {n}"))),
            },
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
        };
        if cfg.temperature > 2.0 {
            return Err(ApiError::invalid_param("temperature", format!("temperature must be in [0, 2], got {}", cfg.temperature)));
        }
        cfg.validate().map_err(ApiError::invalid)?;
        Ok(cfg)
    }

    pub fn stops(&self) -> Result<Vec<String>, ApiError> {
        let v = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if v.len() > MAX_STOPS {
            return Err(ApiError::invalid_param("stop", format!("at most {MAX_STOPS} stop strings, got {}", v.len())));
        }
        Ok(v.into_iter().filter(|s| !s.is_empty()).collect())
    }

    /// The requested completion length, if any (`max_completion_tokens` wins).
    pub fn max_tokens(&self) -> Result<Option<usize>, ApiError> {
        match self.max_completion_tokens.or(self.max_tokens) {
            None => Ok(None),
            Some(n) if n >= 1 => Ok(Some(n as usize)),
            Some(n) => Err(ApiError::invalid_param("max_tokens", format!("max_tokens must be >= 1, got {n}"))),
        }
    }

    pub fn check_n(&self) -> Result<(), ApiError> {
        match self.n {
            None | Some(1) => Ok(()),
            Some(n) => Err(ApiError::invalid_param("n", format!("only n = 1 is supported, got {n}"))),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: CachedTokens,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct CachedTokens {
    /// Prompt tokens whose KV was reused from an earlier request.
    pub cached_tokens: usize,
}

/// Server-side timings, added to final responses (not an OpenAI field).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Timings {
    pub queue_ms: f64,
    pub prompt_ms: f64,
    pub predicted_ms: f64,
    pub predicted_per_second: f64,
}

pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_openai_shapes() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"model":"x","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stop":"\n","stream":true,"frequency_penalty":0}"#,
        )
        .unwrap();
        assert_eq!(r.messages[0].text().unwrap(), "hi");
        assert!(r.common.stream);
        assert_eq!(r.common.stops().unwrap(), vec!["\n".to_string()]);
        let r: CompletionRequest = serde_json::from_str(r#"{"prompt":["a"],"max_tokens":0}"#).unwrap();
        assert!(r.common.max_tokens().is_err());
        let img = r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#;
        let r: ChatRequest = serde_json::from_str(img).unwrap();
        assert!(r.messages[0].text().is_err());
        let d = SamplerConfig::llama_server();
        let bad = Common { temperature: Some(-1.0), ..Default::default() };
        assert_eq!(bad.sampling(&d, 1).unwrap_err().status, StatusCode::BAD_REQUEST);
        // Fields left out take the server's defaults.
        let c = Common::default().sampling(&d, 5).unwrap();
        assert_eq!((c.temperature, c.top_k, c.top_p, c.min_p, c.seed), (0.8, 40, 0.95, 0.05, 5));
        // The penalties reach the sampler, and out-of-range ones are refused.
        let r: ChatRequest = serde_json::from_str(r#"{"messages":[],"presence_penalty":0.5,"frequency_penalty":-0.25,"repeat_penalty":1.1,"repeat_last_n":32}"#).unwrap();
        let c = r.common.sampling(&d, 1).unwrap();
        assert_eq!((c.presence_penalty, c.frequency_penalty, c.repeat_penalty, c.repeat_last_n), (0.5, -0.25, 1.1, 32));
        for body in [r#"{"messages":[],"presence_penalty":3}"#, r#"{"messages":[],"repeat_penalty":0}"#, r#"{"messages":[],"repeat_last_n":-2}"#] {
            let r: ChatRequest = serde_json::from_str(body).unwrap();
            assert_eq!(r.common.sampling(&d, 1).unwrap_err().status, StatusCode::BAD_REQUEST, "{body}");
        }
        // Unsupported fields: refused where they ask for something, named.
        for (body, field) in [
            (r#"{"messages":[],"tools":[{"type":"function","function":{"name":"f"}}]}"#, "tools"),
            (r#"{"messages":[],"tool_choice":"required"}"#, "tool_choice"),
            (r#"{"messages":[],"response_format":{"type":"json_object"}}"#, "response_format"),
            (r#"{"messages":[],"logprobs":true}"#, "logprobs"),
            (r#"{"messages":[],"logit_bias":{"50256":-100}}"#, "logit_bias"),
            (r#"{"messages":[],"best_of":3}"#, "best_of"),
        ] {
            let r: ChatRequest = serde_json::from_str(body).unwrap();
            let e = r.common.check_supported().unwrap_err();
            assert!(e.status == StatusCode::BAD_REQUEST && e.param == Some(field) && e.message.contains(field), "{body}: {e:?}");
        }
        for body in [
            r#"{"messages":[],"tools":[],"tool_choice":"auto","logprobs":false,"response_format":{"type":"text"},"best_of":1,"logit_bias":{},"modalities":["text"]}"#,
            r#"{"messages":[],"tools":null,"logprobs":null,"top_logprobs":0}"#,
        ] {
            let r: ChatRequest = serde_json::from_str(body).unwrap();
            assert!(r.common.check_supported().is_ok(), "{body}");
        }
    }
}
