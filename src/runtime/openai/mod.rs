//! An OpenAI-compatible server (vLLM, SGLang, llama.cpp's `llama-server`, or any other that
//! speaks `/v1/completions` and `/v1/chat/completions`) as a [`LanguageModel`], so the engine,
//! the evals and the TUI run a policy served elsewhere exactly as they run a local one.
//!
//! A model spec names it: `openai:http://HOST:PORT/v1#MODEL_NAME` plus `&key=value` options
//! (see [`RemoteSpec::parse`]). Two ways to talk to it:
//! - **completions** (`&tokenizer=PATH`, the default when a tokenizer is given): the chat
//!   template is rendered and tokenized locally, by the same code as the in-process model, and
//!   the *token ids* go to `/v1/completions`, so the server sees byte-identical prompts;
//! - **chat**: the messages and tools go to `/v1/chat/completions` and the server's template
//!   renders them; tool calls it returns as structured `tool_calls` become `<tool_call>` text for
//!   the actor parser.
//!
//! Every request streams (server-sent events): text reaches the UI as it comes, stop strings are
//! applied here with the local model's rule (stop once the text ends with one, kept in the
//! text), and a cancel drops the connection. Branches are parallel requests seeded `seed + i`.
//! Failures before the first streamed byte (refused connection, 429, 5xx, timeout) are retried
//! with exponential backoff; every error names the URL. The API key comes from an environment
//! variable (`OPENAI_API_KEY` unless `&key_env=` names another) and is never logged or recorded.
//!
//! HTTP runs on one background thread with its own tokio runtime: `LanguageModel` is blocking and
//! may be called (and dropped) from async contexts, where a nested runtime would panic.

mod http;
mod spec;
mod stream;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use serde_json::{Value, json};
use sha2::Digest;

use self::http::{Http, Job, Reply, short};
pub use self::spec::{Api, RemoteSpec};
use self::stream::Branch;
use super::backend::{
    CancelToken, ChatPrompt, FinishReason, Generation, LanguageModel, ModelInfo, RuntimeError,
    SamplingParams, StreamSink, generate_rendered,
};
use super::model::TextSide;
use super::tool_format::{self, ToolRendering};
use crate::message::Message;
use crate::session::export::openai_message;

/// The prefix of a remote model spec.
pub const SCHEME: &str = "openai:";

/// True when `spec` names a remote model rather than a local path.
pub fn is_remote(spec: &str) -> bool {
    spec.starts_with(SCHEME)
}

/// Refuses `--constrain-tools` for a served model when the command starts, before a session is
/// written: the constraint is enforced token by token in the local decoder, and a server is sent
/// no such thing ([`RemoteModel`] refuses it again at each generation, for callers that set it
/// later, as the TUI's Run form).
pub fn refuse_remote_constraint(spec: &str, constrain: bool) -> Result<(), RuntimeError> {
    if !constrain || !is_remote(spec) {
        return Ok(());
    }
    let url = RemoteSpec::parse(spec)?.base_url;
    Err(RuntimeError::Generation(format!(
        "{url}: constrained tool names (--constrain-tools) need a local model; a served model cannot enforce them"
    )))
}

pub struct RemoteModel {
    spec: RemoteSpec,
    model_name: String,
    text: Option<TextSide>,
    http: Http,
}

impl std::fmt::Debug for RemoteModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteModel")
            .field("url", &self.spec.base_url)
            .field("model", &self.model_name)
            .finish()
    }
}

impl RemoteModel {
    /// Parse the spec, read the local tokenizer if one is named, and ask the server which models
    /// it serves (`GET /v1/models`): a server that is down, refuses, or does not serve the named
    /// model is an error here, not at the first generation.
    pub fn open(spec: &str) -> Result<Self, RuntimeError> {
        let spec = RemoteSpec::parse(spec)?;
        let text = spec.tokenizer.as_deref().map(TextSide::load).transpose()?;
        let key = match std::env::var(&spec.key_env) {
            Ok(k) if !k.is_empty() => Some(k),
            _ if spec.key_required => {
                return Err(RuntimeError::Field {
                    path: spec.display(spec.model_name.as_deref().unwrap_or("")),
                    field: "key_env".into(),
                    message: format!("environment variable {} is not set", spec.key_env),
                });
            }
            _ => None,
        };
        let http = Http::start(key, spec.timeout, spec.retries).map_err(|message| {
            RuntimeError::Remote {
                url: spec.base_url.clone(),
                message,
            }
        })?;
        let served = list_models(&http, &spec)?;
        let model_name = match &spec.model_name {
            Some(name) if served.iter().any(|s| s == name) || served.is_empty() => name.clone(),
            Some(name) => {
                return Err(RuntimeError::Remote {
                    url: spec.endpoint("models"),
                    message: format!("does not serve `{name}` (it serves: {})", served.join(", ")),
                });
            }
            None => served
                .first()
                .cloned()
                .ok_or_else(|| RuntimeError::Remote {
                    url: spec.endpoint("models"),
                    message: "lists no model; name one with #MODEL_NAME".into(),
                })?,
        };
        Ok(Self {
            spec,
            model_name,
            text,
            http,
        })
    }

    /// The model names a server lists (the TUI's health check).
    pub fn served_models(spec: &str) -> Result<Vec<String>, RuntimeError> {
        let spec = RemoteSpec::parse(spec)?;
        let key = std::env::var(&spec.key_env).ok().filter(|k| !k.is_empty());
        let http = Http::start(key, spec.timeout, 0).map_err(|message| RuntimeError::Remote {
            url: spec.base_url.clone(),
            message,
        })?;
        list_models(&http, &spec)
    }

    pub fn spec(&self) -> &RemoteSpec {
        &self.spec
    }

    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    fn no_tokenizer(&self) -> RuntimeError {
        RuntimeError::Remote {
            url: self.spec.base_url.clone(),
            message: "this backend has no local tokenizer (add &tokenizer=PATH to the model spec)"
                .into(),
        }
    }

    /// Constrained tool names are enforced token by token in the local decoder; a server is
    /// sent no such constraint, so the request is refused rather than run unconstrained.
    fn refuse_constraint(&self, params: &SamplingParams) -> Result<(), RuntimeError> {
        if params.tool_names.is_empty() {
            return Ok(());
        }
        Err(RuntimeError::Generation(format!(
            "{}: constrained tool names (--constrain-tools) need a local model; a served model cannot enforce them",
            self.spec.base_url
        )))
    }

    fn common_body(
        &self,
        params: &SamplingParams,
        branch: usize,
    ) -> serde_json::Map<String, Value> {
        let mut body = serde_json::Map::new();
        body.insert("model".into(), json!(self.model_name));
        body.insert("max_tokens".into(), json!(params.max_tokens));
        body.insert("temperature".into(), json!(params.temperature.max(0.0)));
        body.insert(
            "seed".into(),
            json!(params.seed.wrapping_add(branch as u64)),
        );
        body.insert("stream".into(), json!(true));
        if let Some(p) = params.top_p {
            body.insert("top_p".into(), json!(p));
        }
        if let Some(k) = params.top_k {
            body.insert("top_k".into(), json!(k));
        }
        if let Some(c) = self.spec.cache_prompt {
            body.insert("cache_prompt".into(), json!(c));
        }
        body
    }

    /// Run one request per branch and collect the streamed generations.
    fn run(
        &self,
        endpoint: &str,
        bodies: Vec<Value>,
        prompt_ids: &[u32],
        params: &SamplingParams,
        mut stream: Option<StreamSink<'_>>,
        cancel: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError> {
        let url = self.spec.endpoint(endpoint);
        let remote = |message: String| RuntimeError::Remote {
            url: url.clone(),
            message,
        };
        let (tx, rx) = mpsc::channel();
        let mut stops = Vec::new();
        for (i, body) in bodies.iter().enumerate() {
            let stop = Arc::new(AtomicBool::new(false));
            let body = serde_json::to_vec(body).map_err(|e| remote(e.to_string()))?;
            self.http
                .submit(Job {
                    url: url.clone(),
                    body: Some(body),
                    tag: i,
                    out: tx.clone(),
                    stop: stop.clone(),
                })
                .map_err(remote)?;
            stops.push(stop);
        }
        drop(tx);
        let stop_all = |stops: &[Arc<AtomicBool>]| {
            for s in stops {
                s.store(true, Ordering::Relaxed);
            }
        };
        let mut branches: Vec<Branch> = (0..bodies.len()).map(|_| Branch::default()).collect();
        let mut open = branches.len();
        while open > 0 {
            if cancel.is_cancelled() {
                stop_all(&stops);
                for b in branches.iter_mut().filter(|b| b.finish.is_none()) {
                    b.finish = Some(FinishReason::Cancelled);
                }
                break;
            }
            let (i, reply) = match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => r,
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(remote("the HTTP worker stopped".into()));
                }
            };
            let Some(b) = branches.get_mut(i) else {
                continue;
            };
            if b.done {
                continue;
            }
            match reply {
                Reply::Data(v) => {
                    let piece = b.absorb(&v).map_err(remote)?;
                    if !piece.is_empty()
                        && let Some(s) = stream.as_mut()
                    {
                        s(i, &piece);
                    }
                    if let Some(stop) = params.stop.iter().find(|s| b.text.ends_with(s.as_str())) {
                        b.finish = Some(FinishReason::Stop(stop.clone()));
                        b.done = true;
                        open -= 1;
                        if let Some(s) = stops.get(i) {
                            s.store(true, Ordering::Relaxed);
                        }
                    }
                }
                Reply::End => {
                    let tail = b.close();
                    if !tail.is_empty()
                        && let Some(s) = stream.as_mut()
                    {
                        s(i, &tail);
                    }
                    if b.finish.is_none() {
                        stop_all(&stops);
                        return Err(remote("the stream ended without a finish reason".into()));
                    }
                    b.done = true;
                    open -= 1;
                }
                Reply::Failed(message) => {
                    stop_all(&stops);
                    return Err(remote(message));
                }
            }
        }
        branches
            .into_iter()
            .map(|b| {
                let text = b.text;
                let (response_ids, logprobs) =
                    if !b.ids.is_empty() && b.ids.len() == b.logprobs.len() {
                        (b.ids, b.logprobs)
                    } else {
                        match &self.text {
                            Some(t) => (t.tokenizer.encode(&text)?, Vec::new()),
                            None => (Vec::new(), Vec::new()),
                        }
                    };
                Ok(Generation {
                    prompt_ids: prompt_ids.to_vec(),
                    response_ids,
                    logprobs,
                    text,
                    finish: b.finish.unwrap_or(FinishReason::Eos),
                })
            })
            .collect()
    }
}

/// What one branch has streamed so far.
/// The chat messages in the OpenAI wire shape (tool-call arguments as JSON strings): the
/// session export's writer.
fn wire_messages(messages: &[Message]) -> Vec<Value> {
    messages.iter().map(openai_message).collect()
}

fn list_models(http: &Http, spec: &RemoteSpec) -> Result<Vec<String>, RuntimeError> {
    let url = spec.endpoint("models");
    let remote = |message: String| RuntimeError::Remote {
        url: url.clone(),
        message,
    };
    let (tx, rx) = mpsc::channel();
    http.submit(Job {
        url: url.clone(),
        body: None,
        tag: 0,
        out: tx,
        stop: Arc::new(AtomicBool::new(false)),
    })
    .map_err(remote)?;
    let wait = spec.timeout * (spec.retries + 1) + Duration::from_secs(30);
    let mut listing = None;
    loop {
        match rx.recv_timeout(wait) {
            Ok((_, Reply::Data(v))) => listing = Some(v),
            Ok((_, Reply::End)) => break,
            Ok((_, Reply::Failed(m))) => return Err(remote(m)),
            Err(_) => return Err(remote("no answer".into())),
        }
    }
    let v = listing.ok_or_else(|| remote("empty answer".into()))?;
    let data = v.get("data").and_then(Value::as_array).ok_or_else(|| {
        remote(format!(
            "malformed model list (no `data` array): {}",
            short(&v.to_string())
        ))
    })?;
    Ok(data
        .iter()
        .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string))
        .collect())
}

impl LanguageModel for RemoteModel {
    fn info(&self) -> ModelInfo {
        let hash_input = format!(
            "{}#{}+{}",
            self.spec.base_url,
            self.model_name,
            self.text.as_ref().map_or("", |t| t.hash.as_str())
        );
        ModelInfo {
            path: self.spec.display(&self.model_name),
            hash: hex::encode(sha2::Sha256::digest(hash_input.as_bytes())),
            architecture: match self.spec.api {
                Api::Chat => "openai-compatible (chat)".into(),
                Api::Completions => "openai-compatible (completions)".into(),
            },
            device: "remote".into(),
            dtype: "remote".into(),
            parameters: 0,
            tool_rendering: match (&self.text, self.spec.tool_rendering) {
                (Some(t), _) => t.template.tool_rendering,
                (None, Some(r)) => r,
                (None, None) => ToolRendering::Template,
            },
        }
    }

    fn render_chat(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
        enable_thinking: bool,
    ) -> Result<String, RuntimeError> {
        match &self.text {
            Some(t) => t
                .template
                .render(messages, tools, add_generation_prompt, enable_thinking),
            // What the chat API is sent, for display.
            None => serde_json::to_string_pretty(&json!({
                "messages": wire_messages(messages),
                "tools": tools,
            }))
            .map_err(|e| RuntimeError::Generation(e.to_string())),
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        match &self.text {
            Some(t) => t.tokenizer.encode(text),
            None => Err(self.no_tokenizer()),
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        match &self.text {
            Some(t) => t.tokenizer.decode(ids),
            None => Err(self.no_tokenizer()),
        }
    }

    /// `/v1/completions` with the token ids as the prompt.
    fn generate(
        &mut self,
        prompt_ids: &[u32],
        n: usize,
        params: &SamplingParams,
        stream: Option<StreamSink<'_>>,
        cancel: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError> {
        self.refuse_constraint(params)?;
        let bodies = (0..n.max(1))
            .map(|i| {
                let mut b = self.common_body(params, i);
                b.insert("prompt".into(), json!(prompt_ids));
                // Standard OpenAI field, and llama.cpp's own name for it.
                b.insert("logprobs".into(), json!(1));
                b.insert("n_probs".into(), json!(1));
                Value::Object(b)
            })
            .collect();
        self.run("completions", bodies, prompt_ids, params, stream, cancel)
    }

    fn generate_chat(
        &mut self,
        chat: &ChatPrompt<'_>,
        n: usize,
        params: &SamplingParams,
        stream: Option<StreamSink<'_>>,
        cancel: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError> {
        if self.spec.api == Api::Completions {
            return generate_rendered(self, chat, n, params, stream, cancel);
        }
        self.refuse_constraint(params)?;
        let (messages, tools) = match self.spec.tool_rendering {
            Some(r) => (
                tool_format::rewrite_messages(r, chat.messages, chat.tools).into_owned(),
                Vec::new(),
            ),
            _ => (chat.messages.to_vec(), chat.tools.to_vec()),
        };
        let wire = wire_messages(&messages);
        let bodies = (0..n.max(1))
            .map(|i| {
                let mut b = self.common_body(params, i);
                b.insert("messages".into(), json!(wire));
                if tools.is_empty() {
                    // llama.cpp refuses logprobs with tools while streaming.
                    b.insert("logprobs".into(), json!(true));
                } else {
                    b.insert("tools".into(), json!(tools));
                }
                b.insert(
                    "chat_template_kwargs".into(),
                    json!({"enable_thinking": chat.enable_thinking}),
                );
                Value::Object(b)
            })
            .collect();
        self.run("chat/completions", bodies, &[], params, stream, cancel)
    }
}

/// Open a model spec: `openai:…` (a served model) or a local path (checkpoint, GGUF, adapter).
pub fn open_model(
    spec: &Path,
    device: super::DeviceChoice,
) -> Result<Box<dyn LanguageModel>, RuntimeError> {
    let s = spec.to_string_lossy();
    if is_remote(&s) {
        Ok(Box::new(RemoteModel::open(&s)?))
    } else {
        Ok(Box::new(super::LocalModel::load(spec, device)?))
    }
}

#[cfg(test)]
mod tests {
    // Tests may unwrap: a panic is the failure report.
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn wire_messages_send_arguments_as_strings() {
        let mut a = Message::assistant("");
        a.tool_calls.push(crate::message::MessageToolCall {
            id: "call_0".into(),
            kind: "function".into(),
            function: crate::message::ToolCall {
                name: "f".into(),
                arguments: json!({"x": 1}),
            },
        });
        let w = wire_messages(&[a, Message::tool("call_0", "f", "{\"ok\": true}")]);
        assert_eq!(
            w[0]["tool_calls"][0]["function"]["arguments"],
            json!("{\"x\":1}")
        );
        assert_eq!(w[1]["role"], "tool");
        assert_eq!(w[1]["tool_call_id"], "call_0");
    }

    #[test]
    fn a_refused_connection_is_an_error_naming_the_url() {
        // Port 9 (discard) on loopback: nothing listens in the test environment.
        let e =
            RemoteModel::open("openai:http://127.0.0.1:9/v1#m&retries=1&timeout=2").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.starts_with("http://127.0.0.1:9/v1/models: cannot connect"),
            "{msg}"
        );
        assert!(msg.contains("after 1 retries"), "{msg}");
    }
}
