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

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use serde_json::{Value, json};
use sha2::Digest;

use super::backend::{
    CancelToken, ChatPrompt, FinishReason, Generation, LanguageModel, ModelInfo, RuntimeError,
    SamplingParams, StreamSink,
};
use super::model::TextSide;
use super::tool_format::{self, ToolRendering};
use crate::message::{Message, Role};

/// The prefix of a remote model spec.
pub const SCHEME: &str = "openai:";

/// True when `spec` names a remote model rather than a local path.
pub fn is_remote(spec: &str) -> bool {
    spec.starts_with(SCHEME)
}

/// Which endpoint generations go through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`: the server renders the chat.
    Chat,
    /// `/v1/completions` with token ids rendered and encoded here.
    Completions,
}

/// A parsed `openai:` model spec.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteSpec {
    /// The API root, e.g. `http://127.0.0.1:8080/v1` (no trailing slash).
    pub base_url: String,
    /// The served model's name; `None` takes the first one `/v1/models` lists.
    pub model_name: Option<String>,
    /// A local `.gguf`, HF or adapter directory whose tokenizer and chat template render prompts.
    pub tokenizer: Option<PathBuf>,
    pub api: Api,
    /// The environment variable holding the API key.
    pub key_env: String,
    /// Whether `key_env` was named explicitly (then it must be set).
    pub key_required: bool,
    /// Longest wait for the response headers, or between two streamed chunks.
    pub timeout: Duration,
    /// Retries of a request that failed before it streamed anything.
    pub retries: u32,
    /// Chat API only: render the tools into the system message in this format instead of
    /// passing `tools` (for servers whose template drops them, e.g. SmolLM2's).
    pub tool_rendering: Option<ToolRendering>,
    /// llama.cpp's `cache_prompt` (`None`: the server's default, on). Off, every prompt is
    /// processed whole, so greedy results do not depend on what the slot held before (with the
    /// cache, llama.cpp's server can answer the same prompt differently on a second request).
    pub cache_prompt: Option<bool>,
}

impl RemoteSpec {
    /// Parse `openai:URL[#MODEL_NAME][&key=value…]`. Options: `tokenizer=PATH`,
    /// `api=completions|chat`, `key_env=VAR`, `timeout=SECONDS`, `retries=N`,
    /// `tools=hermes|smollm2|server` (chat API), `cache_prompt=true|false` (llama.cpp). Errors
    /// name the option.
    pub fn parse(spec: &str) -> Result<Self, RuntimeError> {
        let err = |field: &str, message: String| RuntimeError::Field {
            path: spec.to_string(),
            field: field.to_string(),
            message,
        };
        let rest = spec.strip_prefix(SCHEME).ok_or_else(|| {
            err(
                "scheme",
                format!("a remote model spec starts with `{SCHEME}`"),
            )
        })?;
        let (url, fragment) = match rest.split_once('#') {
            Some((u, f)) => (u, Some(f)),
            None => (rest, None),
        };
        let base_url = url.trim_end_matches('/').to_string();
        let parsed = reqwest::Url::parse(&base_url)
            .map_err(|e| err("url", format!("`{base_url}` is not a URL: {e}")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(err(
                "url",
                format!("`{base_url}`: expected http:// or https://"),
            ));
        }
        let mut out = Self {
            base_url,
            model_name: None,
            tokenizer: None,
            api: Api::Chat,
            key_env: "OPENAI_API_KEY".into(),
            key_required: false,
            timeout: Duration::from_secs(120),
            retries: 3,
            tool_rendering: None,
            cache_prompt: None,
        };
        let mut api = None;
        if let Some(fragment) = fragment {
            let mut parts = fragment.split('&');
            let name = parts.next().unwrap_or_default();
            if !name.is_empty() {
                out.model_name = Some(name.to_string());
            }
            for part in parts.filter(|p| !p.is_empty()) {
                let (k, v) = part
                    .split_once('=')
                    .ok_or_else(|| err(part, "expected key=value".into()))?;
                match k {
                    "tokenizer" => out.tokenizer = Some(PathBuf::from(v)),
                    "api" => {
                        api = Some(match v {
                            "chat" => Api::Chat,
                            "completions" => Api::Completions,
                            _ => {
                                return Err(err(
                                    k,
                                    format!("`{v}` (expected chat or completions)"),
                                ));
                            }
                        })
                    }
                    "key_env" => {
                        out.key_env = v.to_string();
                        out.key_required = true;
                    }
                    "timeout" => {
                        let s: f64 = v
                            .parse()
                            .ok()
                            .filter(|s: &f64| *s > 0.0 && s.is_finite())
                            .ok_or_else(|| err(k, format!("`{v}` (expected seconds > 0)")))?;
                        out.timeout = Duration::from_secs_f64(s);
                    }
                    "retries" => {
                        out.retries = v
                            .parse()
                            .map_err(|_| err(k, format!("`{v}` (expected a count)")))?
                    }
                    "tools" => {
                        out.tool_rendering = match v {
                            "hermes" | "system-hermes" => Some(ToolRendering::SystemHermes),
                            "smollm2" | "system-smollm2" => Some(ToolRendering::SystemSmolLM2),
                            "server" | "template" => None,
                            _ => {
                                return Err(err(
                                    k,
                                    format!("`{v}` (expected hermes, smollm2 or server)"),
                                ));
                            }
                        }
                    }
                    "cache_prompt" => {
                        out.cache_prompt = Some(match v {
                            "true" => true,
                            "false" => false,
                            _ => return Err(err(k, format!("`{v}` (expected true or false)"))),
                        })
                    }
                    _ => {
                        return Err(err(
                            k,
                            "unknown option (known: tokenizer, api, key_env, timeout, retries, tools, cache_prompt)"
                                .into(),
                        ));
                    }
                }
            }
        }
        out.api = match (api, &out.tokenizer) {
            (Some(Api::Completions), None) => {
                return Err(err(
                    "api",
                    "completions renders prompts locally: add &tokenizer=PATH (a .gguf, HF or adapter directory)".into(),
                ));
            }
            (Some(a), _) => a,
            (None, Some(_)) => Api::Completions,
            (None, None) => Api::Chat,
        };
        if out.api == Api::Completions && out.tool_rendering.is_some() {
            return Err(err(
                "tools",
                "only for api=chat (with a tokenizer, the local template decides)".into(),
            ));
        }
        Ok(out)
    }

    /// The spec as recorded in sessions: URL and model name, no options that hold paths or keys.
    pub fn display(&self, model_name: &str) -> String {
        format!("{SCHEME}{}#{model_name}", self.base_url)
    }

    fn endpoint(&self, path: &str) -> String {
        format!("{}/{path}", self.base_url)
    }
}

/// A served model.
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
#[derive(Debug, Default)]
struct Branch {
    text: String,
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    /// Structured tool calls (chat API): (name, arguments text), by index.
    calls: Vec<(String, String)>,
    reasoning_open: bool,
    finish: Option<FinishReason>,
    done: bool,
}

impl Branch {
    /// Take one streamed (or whole) response object; returns the new text.
    fn absorb(&mut self, v: &Value) -> Result<String, String> {
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
            // Usage-only chunks carry no choice.
            if v.get("usage").is_some() || v.get("choices").is_some() {
                return Ok(String::new());
            }
            return Err(format!(
                "malformed response (no `choices`): {}",
                short(&v.to_string())
            ));
        };
        let mut piece = String::new();
        if let Some(t) = choice.get("text").and_then(Value::as_str) {
            piece.push_str(t);
        }
        for key in ["delta", "message"] {
            let Some(m) = choice.get(key) else { continue };
            let reasoning = m
                .get("reasoning_content")
                .or_else(|| m.get("reasoning"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !reasoning.is_empty() {
                if !self.reasoning_open {
                    piece.push_str("<think>");
                    self.reasoning_open = true;
                }
                piece.push_str(reasoning);
            }
            if let Some(c) = m.get("content").and_then(Value::as_str)
                && !c.is_empty()
            {
                if self.reasoning_open {
                    piece.push_str("</think>\n");
                    self.reasoning_open = false;
                }
                piece.push_str(c);
            }
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
                for (k, call) in calls.iter().enumerate() {
                    let index = call
                        .get("index")
                        .and_then(Value::as_u64)
                        .map_or(k, |i| i as usize);
                    if self.calls.len() <= index {
                        self.calls.resize(index + 1, Default::default());
                    }
                    let f = call.get("function").unwrap_or(&Value::Null);
                    if let Some(slot) = self.calls.get_mut(index) {
                        if let Some(n) = f.get("name").and_then(Value::as_str) {
                            slot.0.push_str(n);
                        }
                        match f.get("arguments") {
                            Some(Value::String(a)) => slot.1.push_str(a),
                            Some(Value::Object(_)) => {
                                slot.1.push_str(&f["arguments"].to_string());
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        if let Some(entries) = choice
            .get("logprobs")
            .and_then(|l| l.get("content"))
            .and_then(Value::as_array)
        {
            for e in entries {
                if let Some(lp) = e.get("logprob").and_then(Value::as_f64) {
                    self.logprobs.push(lp as f32);
                }
                if let Some(id) = e.get("id").and_then(Value::as_u64) {
                    self.ids.push(id as u32);
                }
            }
        } else if let Some(lps) = choice
            .get("logprobs")
            .and_then(|l| l.get("token_logprobs"))
            .and_then(Value::as_array)
        {
            self.logprobs
                .extend(lps.iter().filter_map(Value::as_f64).map(|x| x as f32));
        }
        match choice.get("finish_reason").and_then(Value::as_str) {
            Some("length") => self.finish = Some(FinishReason::Length),
            Some(_) => self.finish = Some(FinishReason::Eos),
            None => {}
        }
        self.text.push_str(&piece);
        Ok(piece)
    }

    /// The end of the stream: close an open reasoning block and write structured tool calls as
    /// `<tool_call>` blocks (the format the actor parser reads). Returns the text added.
    fn close(&mut self) -> String {
        let mut tail = String::new();
        if self.reasoning_open {
            tail.push_str("</think>\n");
            self.reasoning_open = false;
        }
        for (name, args) in std::mem::take(&mut self.calls) {
            if name.is_empty() {
                continue;
            }
            let arguments = serde_json::from_str::<Value>(&args).unwrap_or(Value::String(args));
            if !self.text.is_empty() || !tail.is_empty() {
                tail.push('\n');
            }
            tail.push_str(&format!(
                "<tool_call>\n{}\n</tool_call>",
                json!({"name": name, "arguments": arguments})
            ));
        }
        self.text.push_str(&tail);
        tail
    }
}

/// The chat messages in the OpenAI wire shape (tool-call arguments as JSON strings).
fn wire_messages(messages: &[Message]) -> Vec<Value> {
    messages
        .iter()
        .map(|m| {
            let role = match m.role {
                Role::System => "system",
                Role::User => "user",
                Role::Assistant => "assistant",
                Role::Tool => "tool",
            };
            let mut o = serde_json::Map::new();
            o.insert("role".into(), json!(role));
            o.insert("content".into(), json!(m.content));
            if !m.tool_calls.is_empty() {
                let calls: Vec<Value> = m
                    .tool_calls
                    .iter()
                    .map(|c| {
                        json!({
                            "id": c.id,
                            "type": c.kind,
                            "function": {
                                "name": c.function.name,
                                "arguments": c.function.arguments.to_string(),
                            }
                        })
                    })
                    .collect();
                o.insert("tool_calls".into(), Value::Array(calls));
            }
            if let Some(id) = &m.tool_call_id {
                o.insert("tool_call_id".into(), json!(id));
            }
            if let (Role::Tool, Some(name)) = (m.role, &m.name) {
                o.insert("name".into(), json!(name));
            }
            Value::Object(o)
        })
        .collect()
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
            let prompt = self.render_chat(chat.messages, chat.tools, true, chat.enable_thinking)?;
            let ids = self.encode(&prompt)?;
            return self.generate(&ids, n, params, stream, cancel);
        }
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

// ---- HTTP on a background thread.

/// A message from a request's task.
#[derive(Debug)]
enum Reply {
    /// One server-sent event's JSON (or the whole JSON body of a non-streamed answer).
    Data(Value),
    /// `[DONE]` (or the end of a non-streamed body).
    End,
    Failed(String),
}

struct Job {
    url: String,
    /// `None`: GET.
    body: Option<Vec<u8>>,
    tag: usize,
    out: mpsc::Sender<(usize, Reply)>,
    /// Set by the caller when it wants no more (stop string, cancel, another branch failed).
    stop: Arc<AtomicBool>,
}

struct Http {
    jobs: tokio::sync::mpsc::UnboundedSender<Job>,
}

#[derive(Debug, Clone, Copy)]
struct Limits {
    timeout: Duration,
    retries: u32,
}

impl Http {
    fn start(key: Option<String>, timeout: Duration, retries: u32) -> Result<Self, String> {
        let (jobs, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let limits = Limits { timeout, retries };
        std::thread::Builder::new()
            .name("envace-openai".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("cannot start the HTTP runtime: {e}")));
                        return;
                    }
                };
                // reqwest is built without a bundled crypto provider (see Cargo.toml).
                let _ = rustls::crypto::ring::default_provider().install_default();
                let client = match reqwest::Client::builder()
                    .connect_timeout(timeout.min(Duration::from_secs(30)))
                    .build()
                {
                    Ok(c) => c,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("cannot build the HTTP client: {e}")));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                rt.block_on(async move {
                    while let Some(job) = rx.recv().await {
                        tokio::spawn(run_job(client.clone(), key.clone(), limits, job));
                    }
                });
            })
            .map_err(|e| format!("cannot start the HTTP thread: {e}"))?;
        ready_rx
            .recv()
            .map_err(|_| "the HTTP thread stopped at start".to_string())??;
        Ok(Self { jobs })
    }

    fn submit(&self, job: Job) -> Result<(), String> {
        self.jobs
            .send(job)
            .map_err(|_| "the HTTP worker stopped".to_string())
    }
}

enum Attempt {
    /// Worth another try (nothing was streamed yet).
    Retry(String),
    Fatal(String),
}

async fn run_job(client: reqwest::Client, key: Option<String>, limits: Limits, job: Job) {
    let mut attempt = 0;
    loop {
        let message = match attempt_once(&client, key.as_deref(), limits, &job).await {
            Ok(()) => return,
            Err(Attempt::Retry(m)) if attempt < limits.retries => {
                attempt += 1;
                // 0.5 s, 1 s, 2 s, … capped at 8 s.
                let wait = Duration::from_millis(500 << (attempt - 1).min(4));
                tracing::warn!(url = %job.url, attempt, "retrying after: {m}");
                tokio::time::sleep(wait).await;
                if job.stop.load(Ordering::Relaxed) {
                    return;
                }
                continue;
            }
            Err(Attempt::Retry(m)) if limits.retries > 0 => {
                format!("{m} (after {} retries)", limits.retries)
            }
            Err(Attempt::Retry(m)) | Err(Attempt::Fatal(m)) => m,
        };
        let _ = job.out.send((job.tag, Reply::Failed(message)));
        return;
    }
}

async fn attempt_once(
    client: &reqwest::Client,
    key: Option<&str>,
    limits: Limits,
    job: &Job,
) -> Result<(), Attempt> {
    let secs = limits.timeout.as_secs_f64();
    let mut req = match &job.body {
        Some(body) => client
            .post(&job.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(
                reqwest::header::ACCEPT,
                "text/event-stream, application/json",
            )
            .body(body.clone()),
        None => client.get(&job.url),
    };
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let mut resp = match tokio::time::timeout(limits.timeout, req.send()).await {
        Err(_) => return Err(Attempt::Retry(format!("no response within {secs} s"))),
        Ok(Err(e)) => return Err(Attempt::Retry(format!("cannot connect: {}", chain(&e)))),
        Ok(Ok(r)) => r,
    };
    let status = resp.status();
    if !status.is_success() {
        let body = tokio::time::timeout(limits.timeout, resp.text())
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let message = format!("HTTP {status}: {}", short(body.trim()));
        return Err(
            if status.as_u16() == 429 || status.as_u16() == 408 || status.is_server_error() {
                Attempt::Retry(message)
            } else {
                Attempt::Fatal(message)
            },
        );
    }
    let sse = resp
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let send = |reply: Reply| job.out.send((job.tag, reply)).is_ok();
    if !sse {
        let body = match tokio::time::timeout(limits.timeout, resp.bytes()).await {
            Err(_) => return Err(Attempt::Retry(format!("no body within {secs} s"))),
            Ok(Err(e)) => return Err(Attempt::Retry(format!("body: {}", chain(&e)))),
            Ok(Ok(b)) => b,
        };
        let v: Value = serde_json::from_slice(&body).map_err(|e| {
            Attempt::Fatal(format!(
                "malformed JSON: {e}: {}",
                short(&String::from_utf8_lossy(&body))
            ))
        })?;
        if let Some(err) = v.get("error") {
            return Err(Attempt::Fatal(format!(
                "server error: {}",
                short(&err.to_string())
            )));
        }
        if send(Reply::Data(v)) {
            send(Reply::End);
        }
        return Ok(());
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut streamed = false;
    let after = |streamed: bool, m: String| {
        if streamed {
            Attempt::Fatal(m)
        } else {
            Attempt::Retry(m)
        }
    };
    loop {
        if job.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let chunk = match tokio::time::timeout(limits.timeout, resp.chunk()).await {
            Err(_) => {
                return Err(after(
                    streamed,
                    format!("the stream stalled: nothing for {secs} s"),
                ));
            }
            Ok(Err(e)) => {
                return Err(after(streamed, format!("the stream broke: {}", chain(&e))));
            }
            Ok(Ok(None)) => {
                return Err(after(
                    streamed,
                    "the server closed the stream before [DONE]".into(),
                ));
            }
            Ok(Ok(Some(c))) => c,
        };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
            let raw: Vec<u8> = buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&raw);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue; // blank separators, comments, `event:` / `id:` fields
            };
            let data = data.trim();
            if data == "[DONE]" {
                send(Reply::End);
                return Ok(());
            }
            let v: Value = serde_json::from_str(data).map_err(|e| {
                Attempt::Fatal(format!(
                    "malformed JSON in the stream: {e}: {}",
                    short(data)
                ))
            })?;
            if let Some(err) = v.get("error") {
                return Err(Attempt::Fatal(format!(
                    "server error: {}",
                    short(&err.to_string())
                )));
            }
            if job.stop.load(Ordering::Relaxed) || !send(Reply::Data(v)) {
                return Ok(()); // the caller wants no more: dropping the response closes it
            }
            streamed = true;
        }
    }
}

/// An error with its causes (reqwest's top-level message alone says little).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// At most 300 characters of a server's text, for error messages.
fn short(s: &str) -> String {
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    // Tests may unwrap: a panic is the failure report.
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn spec_parses_url_name_and_options() {
        let s = RemoteSpec::parse("openai:http://127.0.0.1:8080/v1/#smollm2&retries=1&timeout=2.5")
            .unwrap();
        assert_eq!(s.base_url, "http://127.0.0.1:8080/v1");
        assert_eq!(s.model_name.as_deref(), Some("smollm2"));
        assert_eq!(s.api, Api::Chat);
        assert_eq!(s.retries, 1);
        assert_eq!(s.timeout, Duration::from_millis(2500));
        assert_eq!(
            s.display("smollm2"),
            "openai:http://127.0.0.1:8080/v1#smollm2"
        );
        let s = RemoteSpec::parse("openai:https://h/v1#m&tokenizer=models/x.gguf").unwrap();
        assert_eq!(s.api, Api::Completions);
        assert_eq!(s.tokenizer.as_deref(), Some(Path::new("models/x.gguf")));
        let s = RemoteSpec::parse("openai:http://h:1/v1").unwrap();
        assert_eq!(s.model_name, None);
    }

    #[test]
    fn spec_errors_name_the_option() {
        for (spec, field) in [
            ("openai:ftp://h/v1#m", "url"),
            ("openai:not a url#m", "url"),
            ("openai:http://h/v1#m&api=completions", "api"),
            ("openai:http://h/v1#m&api=rest", "api"),
            ("openai:http://h/v1#m&timeout=0", "timeout"),
            ("openai:http://h/v1#m&retries=x", "retries"),
            ("openai:http://h/v1#m&colour=red", "colour"),
            ("openai:http://h/v1#m&tools=xml", "tools"),
            ("openai:http://h/v1#m&cache_prompt=no", "cache_prompt"),
            (
                "openai:http://h/v1#m&tokenizer=t.gguf&tools=hermes",
                "tools",
            ),
        ] {
            match RemoteSpec::parse(spec) {
                Err(RuntimeError::Field { field: f, .. }) => assert_eq!(f, field, "{spec}"),
                other => panic!("{spec}: {other:?}"),
            }
        }
    }

    #[test]
    fn streamed_chat_tool_calls_become_tool_call_blocks() {
        let mut b = Branch::default();
        let chunks = [
            json!({"choices": [{"delta": {"reasoning_content": "need "}}]}),
            json!({"choices": [{"delta": {"reasoning_content": "balance"}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_balance", "arguments": "{\"acc"}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "ount\": \"chk\"}"}}]}}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
        ];
        for c in &chunks {
            b.absorb(c).unwrap();
        }
        let tail = b.close();
        assert!(tail.starts_with("</think>\n"), "{tail}");
        assert_eq!(
            b.text,
            "<think>need balance</think>\n\n<tool_call>\n{\"name\":\"get_balance\",\"arguments\":{\"account\":\"chk\"}}\n</tool_call>"
        );
        assert_eq!(b.finish, Some(FinishReason::Eos));
    }

    #[test]
    fn completion_chunks_carry_ids_and_logprobs() {
        let mut b = Branch::default();
        b.absorb(&json!({"choices": [{"text": "Hel", "logprobs": {"content": [{"id": 7, "token": "Hel", "logprob": -0.5}]}}]}))
            .unwrap();
        b.absorb(&json!({"choices": [{"text": "lo", "logprobs": {"content": [{"id": 9, "token": "lo", "logprob": -0.25}]}, "finish_reason": "length"}]}))
            .unwrap();
        assert_eq!(b.text, "Hello");
        assert_eq!(b.ids, vec![7, 9]);
        assert_eq!(b.logprobs, vec![-0.5, -0.25]);
        assert_eq!(b.finish, Some(FinishReason::Length));
        assert!(b.absorb(&json!({"object": "x"})).is_err());
        assert_eq!(b.absorb(&json!({"choices": [], "usage": {}})).unwrap(), "");
    }

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
