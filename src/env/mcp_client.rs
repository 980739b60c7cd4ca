//! Any MCP server as an [`Environment`], through the rmcp client, over either transport: a child
//! process on stdio, or a streamable-HTTP endpoint (a URL, with optional headers such as
//! `Authorization`). Tools and annotations from `tools/list`, calls through `tools/call`
//! (structured content preferred, text content parsed as JSON when it is JSON), a per-call
//! timeout, and MCP task files whose success checks are read-only calls made after the episode.
//!
//! A server that crashes, hangs, exits early, refuses the connection, answers HTTP errors or
//! talks garbage becomes an [`EnvError`] naming the server (its URL for HTTP), with the tail of
//! its stderr for a process; it never panics or blocks the caller past the timeout. Errors the
//! server reports for a call (`isError`, a JSON-RPC error) are the agent's to read: they become
//! [`ToolResponse::Error`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock};
use rmcp::service::{ClientInitializeError, RoleClient, RunningService};
use rmcp::transport::streamable_http_client::{
    StreamableHttpClientTransportConfig, StreamableHttpError,
};
use rmcp::transport::{DynamicTransportError, IntoTransport, StreamableHttpClientTransport};
use rmcp::{ServiceError, ServiceExt};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::env::reward::state_hash;
use crate::env::{
    ChecklistItem, EnvError, Environment, EpisodeTrace, Score, ToolAnnotations, ToolResponse,
    ToolSpec,
};
use crate::message::ToolCall;

pub use super::mcp_tasks::{
    McpCheck, McpTask, McpTaskFile, load_mcp_task_file, verify_check_tools,
};

/// How to reach a server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum McpTransport {
    /// A child process speaking MCP on stdin/stdout.
    Stdio {
        command: String,
        #[serde(default)]
        args: Vec<String>,
        #[serde(default)]
        env: BTreeMap<String, String>,
        #[serde(default)]
        cwd: Option<PathBuf>,
    },
    /// A streamable-HTTP endpoint, e.g. `http://127.0.0.1:3001/mcp`.
    Http {
        url: String,
        /// Sent with every request (`Authorization: Bearer …`, API keys).
        #[serde(default, skip_serializing_if = "HttpHeaders::is_empty")]
        headers: HttpHeaders,
    },
}

/// HTTP headers for a streamable-HTTP server. Debug output shows the names only: values are
/// often credentials.
#[derive(Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct HttpHeaders(pub BTreeMap<String, String>);

impl HttpHeaders {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for HttpHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.keys().map(|k| (k, "<redacted>")))
            .finish()
    }
}

/// A server to connect to.
#[derive(Debug, Clone, PartialEq)]
pub struct McpServerConfig {
    /// Shown in errors and as the environment name (`mcp:NAME`).
    pub name: String,
    pub transport: McpTransport,
    /// Limit for each `tools/call` and `tools/list`.
    pub call_timeout: Duration,
    /// Limit for start-up and the initialize handshake.
    pub connect_timeout: Duration,
}

impl McpServerConfig {
    pub fn stdio(command: impl Into<String>, args: Vec<String>) -> Self {
        let command = command.into();
        let name = server_name(&command, &args);
        Self {
            name,
            transport: McpTransport::Stdio {
                command,
                args,
                env: BTreeMap::new(),
                cwd: None,
            },
            call_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(30),
        }
    }

    pub fn http(url: impl Into<String>) -> Self {
        let url = url.into();
        Self {
            name: url.clone(),
            transport: McpTransport::Http {
                url,
                headers: HttpHeaders::default(),
            },
            call_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(30),
        }
    }

    /// A config for a transport as written in a task file's `server` section (default timeouts;
    /// named like [`Self::stdio`] and [`Self::http`]).
    pub fn from_transport(transport: McpTransport) -> Self {
        let name = match &transport {
            McpTransport::Stdio { command, args, .. } => server_name(command, args),
            McpTransport::Http { url, .. } => url.clone(),
        };
        Self {
            name,
            transport,
            call_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(30),
        }
    }

    /// Adds a header to every request (HTTP only; ignored for stdio).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        if let McpTransport::Http { headers, .. } = &mut self.transport {
            headers.0.insert(name.into(), value.into());
        }
        self
    }

    pub fn with_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        if let McpTransport::Stdio { env, .. } = &mut self.transport {
            env.insert(key.into(), value.into());
        }
        self
    }

    pub fn with_cwd(mut self, dir: impl Into<PathBuf>) -> Self {
        if let McpTransport::Stdio { cwd, .. } = &mut self.transport {
            *cwd = Some(dir.into());
        }
        self
    }

    /// Sets both the call and the connect timeout.
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.call_timeout = t;
        self.connect_timeout = t;
        self
    }

    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

/// A readable name: the package directory for `node …/server-x/dist/index.js`, else the
/// executable's file name.
fn server_name(command: &str, args: &[String]) -> String {
    let script = args
        .iter()
        .find(|a| a.ends_with(".js") || a.ends_with(".py"));
    if let Some(s) = script {
        let p = Path::new(s);
        if let Some(pkg) = p
            .ancestors()
            .find(|a| {
                a.parent()
                    .and_then(|x| x.file_name())
                    .is_some_and(|n| n == "@modelcontextprotocol" || n == "node_modules")
            })
            .and_then(|a| a.file_name())
        {
            return pkg.to_string_lossy().into_owned();
        }
        return p
            .file_name()
            .map_or_else(|| s.clone(), |f| f.to_string_lossy().into_owned());
    }
    Path::new(command)
        .file_name()
        .map_or_else(|| command.to_string(), |f| f.to_string_lossy().into_owned())
}

/// The last few KiB a server wrote to stderr, and the first stdout line that was not JSON
/// (for error messages).
#[derive(Debug, Clone, Default)]
struct StderrTail(Arc<Mutex<String>>, Arc<Mutex<Option<String>>>);

impl StderrTail {
    fn note_garbage(&self, line: &str) {
        if let Ok(mut g) = self.1.lock()
            && g.is_none()
        {
            let short: String = line.chars().take(120).collect();
            *g = Some(format!("{short:?}"));
        }
    }
    fn garbage(&self) -> Option<String> {
        self.1.lock().ok().and_then(|g| g.clone())
    }
    const KEEP: usize = 2048;
    fn push(&self, s: &str) {
        if let Ok(mut t) = self.0.lock() {
            t.push_str(s);
            if t.len() > Self::KEEP {
                let mut cut = t.len() - Self::KEEP;
                while !t.is_char_boundary(cut) {
                    cut += 1;
                }
                t.drain(..cut);
            }
        }
    }
    fn get(&self) -> String {
        self.0
            .lock()
            .map(|t| t.trim().to_string())
            .unwrap_or_default()
    }
}

fn spawn_stderr_reader(mut se: tokio::process::ChildStderr, tail: StderrTail) {
    tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        while let Ok(n) = se.read(&mut buf).await {
            if n == 0 {
                break;
            }
            tail.push(&String::from_utf8_lossy(&buf[..n]));
        }
    });
}

/// Forward the server's stdout line by line, noting (and dropping) lines that are not JSON, so
/// that a garbage-talking server is named as such instead of surfacing as a bare timeout.
fn spawn_stdout_vetter(
    stdout: tokio::process::ChildStdout,
    tail: StderrTail,
) -> tokio::io::ReadHalf<tokio::io::DuplexStream> {
    let (ours, mut theirs) = tokio::io::duplex(1 << 20);
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if line.trim().is_empty() {
                continue;
            }
            if serde_json::from_str::<Value>(&line).is_err() {
                tail.note_garbage(&line);
                continue;
            }
            if theirs.write_all(line.as_bytes()).await.is_err()
                || theirs.write_all(b"\n").await.is_err()
            {
                break;
            }
        }
        // Dropping `theirs` closes the client's side: the service sees the server gone.
    });
    tokio::io::split(ours).0
}

/// A connected MCP server.
pub struct McpEnv {
    config: McpServerConfig,
    client: RunningService<RoleClient, ()>,
    /// The server process (stdio); killed when the environment is dropped.
    process: Option<tokio::process::Child>,
    stderr: StderrTail,
    tools: Option<Vec<ToolSpec>>,
    tasks: Vec<McpTask>,
    task: Option<McpTask>,
}

impl std::fmt::Debug for McpEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpEnv")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl McpEnv {
    /// Start (stdio) or reach (HTTP) the server and complete the MCP handshake.
    pub async fn connect(config: McpServerConfig) -> Result<Self, EnvError> {
        let stderr = StderrTail::default();
        let err = |message: String| EnvError::Mcp {
            server: config.name.clone(),
            message,
        };
        let (client, process) = match &config.transport {
            McpTransport::Http { url, headers } => {
                let transport =
                    http_transport(url, headers, config.connect_timeout).map_err(err)?;
                (handshake(&config, transport, &stderr).await?, None)
            }
            McpTransport::Stdio {
                command,
                args,
                env,
                cwd,
            } => {
                let mut cmd = tokio::process::Command::new(command);
                cmd.args(args)
                    .envs(env)
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .kill_on_drop(true);
                if let Some(d) = cwd {
                    cmd.current_dir(d);
                }
                let mut child = cmd
                    .spawn()
                    .map_err(|e| err(format!("cannot start `{command}`: {e}")))?;
                let (Some(stdin), Some(stdout), Some(child_stderr)) =
                    (child.stdin.take(), child.stdout.take(), child.stderr.take())
                else {
                    return Err(err("cannot capture the server's stdio".into()));
                };
                spawn_stderr_reader(child_stderr, stderr.clone());
                let reader = spawn_stdout_vetter(stdout, stderr.clone());
                // On a failed handshake `child` is dropped here and killed (kill_on_drop).
                let client = handshake(&config, (reader, stdin), &stderr).await?;
                (client, Some(child))
            }
        };
        Ok(Self {
            config,
            client,
            process,
            stderr,
            tools: None,
            tasks: Vec::new(),
            task: None,
        })
    }

    /// Attach MCP tasks (see [`load_mcp_task_file`]) that `reset` can select.
    pub fn with_tasks(mut self, tasks: Vec<McpTask>) -> Self {
        self.tasks = tasks;
        self
    }

    pub fn config(&self) -> &McpServerConfig {
        &self.config
    }

    /// What the server reported about itself in the handshake.
    pub fn server_info(&self) -> Option<Value> {
        self.client
            .peer_info()
            .and_then(|i| serde_json::to_value(&*i).ok())
    }

    /// Shut the server down (stdio: close its stdin, then terminate it).
    pub async fn close(mut self) -> Result<(), EnvError> {
        let _ = tokio::time::timeout(Duration::from_secs(5), self.client.close()).await;
        Ok(())
    }

    fn error(&mut self, message: String) -> EnvError {
        let status = match self.process.as_mut().map(tokio::process::Child::try_wait) {
            Some(Ok(Some(st))) => format!(" (server exited: {st})"),
            _ => String::new(),
        };
        EnvError::Mcp {
            server: self.config.name.clone(),
            message: with_tail(format!("{message}{status}"), &self.stderr),
        }
    }

    fn gone(&mut self, e: &ServiceError) -> EnvError {
        let message = match &self.config.transport {
            McpTransport::Stdio { .. } => {
                format!("the server is gone (crashed, exited or sent garbage): {e}")
            }
            McpTransport::Http { url, .. } => format!(
                "request failed{} (server down, unreachable, HTTP error or garbage): {}",
                url_unless_named(url, &self.config),
                error_chain(e)
            ),
        };
        self.error(message)
    }

    fn closed(&mut self) -> EnvError {
        let message = match &self.config.transport {
            McpTransport::Stdio { .. } => "the server is no longer running".to_string(),
            McpTransport::Http { url, .. } => format!(
                "the connection is closed{}",
                url_unless_named(url, &self.config)
            ),
        };
        self.error(message)
    }

    fn timeout(&self, what: &str) -> EnvError {
        EnvError::Timeout {
            server: self.config.name.clone(),
            tool: what.to_string(),
            seconds: self.config.call_timeout.as_secs_f64(),
        }
    }

    async fn raw_call(&mut self, call: &ToolCall) -> Result<ToolResponse, EnvError> {
        if self.client.is_closed() {
            return Err(self.closed());
        }
        let args = match &call.arguments {
            Value::Object(m) => Some(m.clone()),
            Value::Null => None,
            _ => {
                return Ok(ToolResponse::Error {
                    code: "invalid_arguments".into(),
                    message: "arguments must be a JSON object".into(),
                });
            }
        };
        let mut params = CallToolRequestParams::new(call.name.clone());
        if let Some(a) = args {
            params = params.with_arguments(a);
        }
        let t = self.config.call_timeout;
        match tokio::time::timeout(t, self.client.peer().call_tool(params)).await {
            Err(_) => match self.stderr.garbage() {
                // The transport drops lines it cannot decode: say so rather than just "timeout".
                Some(line) => Err(self.error(format!(
                    "no valid answer to `{}` within {:.1}s; the server wrote non-JSON-RPC output: {line}",
                    call.name,
                    t.as_secs_f64()
                ))),
                None => Err(self.timeout(&call.name)),
            },
            Ok(Ok(result)) => Ok(to_response(result)),
            Ok(Err(ServiceError::McpError(e))) => Ok(ToolResponse::Error {
                code: format!("mcp_{}", e.code.0),
                message: e.message.to_string(),
            }),
            Ok(Err(e)) => Err(self.gone(&e)),
        }
    }
}

/// The rmcp transport for a streamable-HTTP URL, on our own reqwest client: its build can fail
/// (no system CA certificates for `https`), and rmcp's own default client would panic then.
fn http_transport(
    url: &str,
    headers: &HttpHeaders,
    connect_timeout: Duration,
) -> Result<StreamableHttpClientTransport<reqwest::Client>, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("`{url}` is not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "`{url}`: a streamable-HTTP endpoint needs an http:// or https:// URL"
        ));
    }
    let mut custom = HashMap::new();
    for (k, v) in &headers.0 {
        let name = http::HeaderName::from_bytes(k.trim().as_bytes())
            .map_err(|e| format!("header name `{k}`: {e}"))?;
        let mut value =
            http::HeaderValue::from_str(v.trim()).map_err(|e| format!("header `{k}`: {e}"))?;
        value.set_sensitive(true);
        custom.insert(name, value);
    }
    // reqwest is built without a bundled crypto provider (see Cargo.toml): install ring unless
    // something else already installed one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut builder = reqwest::Client::builder()
        // As rmcp's default client: no idle pooling (avoids ~40 ms delayed-ACK stalls), and only
        // same-origin 307/308 redirects (FastMCP answers `/mcp` with a 307 to `/mcp/`).
        .pool_max_idle_per_host(0)
        .connect_timeout(connect_timeout)
        .redirect(reqwest::redirect::Policy::custom(|attempt| {
            let same_origin = attempt
                .previous()
                .first()
                .is_some_and(|first| first.origin() == attempt.url().origin());
            let keeps_method = matches!(attempt.status().as_u16(), 307 | 308);
            if same_origin && keeps_method && attempt.previous().len() < 10 {
                attempt.follow()
            } else {
                attempt.stop()
            }
        }));
    if parsed.scheme() == "http" {
        // Plain HTTP needs no trust store; don't fail where the system has no CA certificates.
        builder = builder.tls_certs_only(std::iter::empty::<reqwest::Certificate>());
    }
    let client = builder
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {}", error_chain(&e)))?;
    let config = StreamableHttpClientTransportConfig::with_uri(url).custom_headers(custom);
    Ok(StreamableHttpClientTransport::with_client(client, config))
}

/// The MCP `initialize` exchange, bounded by the connect timeout.
async fn handshake<T, E, A>(
    config: &McpServerConfig,
    transport: T,
    stderr: &StderrTail,
) -> Result<RunningService<RoleClient, ()>, EnvError>
where
    T: IntoTransport<RoleClient, E, A>,
    E: std::error::Error + Send + Sync + 'static,
{
    let err = |message: String| EnvError::Mcp {
        server: config.name.clone(),
        message,
    };
    let at = match &config.transport {
        McpTransport::Http { url, .. } => url_unless_named(url, config),
        McpTransport::Stdio { .. } => String::new(),
    };
    let limit = config.connect_timeout.as_secs_f64();
    match tokio::time::timeout(config.connect_timeout, ().serve(transport)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => match &config.transport {
            McpTransport::Stdio { .. } => {
                // Give the stderr reader a moment to collect the reason.
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err(err(with_tail(
                    format!("handshake failed (server exited or answered garbage): {e}"),
                    stderr,
                )))
            }
            McpTransport::Http { .. } => Err(err(format!(
                "handshake failed{at} (server down, unreachable, HTTP error or not an MCP \
                 endpoint): {}",
                error_chain(&e)
            ))),
        },
        Err(_) => match &config.transport {
            McpTransport::Stdio { .. } => {
                let garbage = stderr
                    .garbage()
                    .map(|l| format!(" (it wrote non-JSON-RPC output: {l})"))
                    .unwrap_or_default();
                Err(err(with_tail(
                    format!("no valid answer to initialize within {limit:.1}s{garbage}"),
                    stderr,
                )))
            }
            McpTransport::Http { .. } => Err(err(format!(
                "no answer to initialize within {limit:.1}s{at} (the server accepted the \
                 connection but did not reply)"
            ))),
        },
    }
}

/// ` (URL)` when the server goes by another name (errors always name the server), else nothing.
fn url_unless_named(url: &str, config: &McpServerConfig) -> String {
    if url == config.name {
        String::new()
    } else {
        format!(" ({url})")
    }
}

type DynError = dyn std::error::Error + 'static;

/// The next error down: `source()`, or the cause rmcp keeps in a field not marked as a source.
fn cause(e: &DynError) -> Option<&DynError> {
    if let Some(ClientInitializeError::TransportError { error, .. }) =
        e.downcast_ref::<ClientInitializeError>()
    {
        return Some(error);
    }
    if let Some(StreamableHttpError::Client(inner)) =
        e.downcast_ref::<StreamableHttpError<reqwest::Error>>()
    {
        return Some(inner);
    }
    e.source()
}

/// What went wrong on the wire, `a: b: c`: the transport's own error and its causes, each once.
/// The useful part (`Connection refused`, `HTTP 500`) sits several levels down, under rmcp
/// wrappers (`Send message error Transport [WorkerTransport<…>] error: …`) that say nothing a
/// user can act on.
fn error_chain(e: &DynError) -> String {
    let mut start = e;
    let mut next = Some(e);
    while let Some(c) = next {
        if let Some(d) = c.downcast_ref::<DynamicTransportError>() {
            start = d.error.as_ref();
        }
        next = cause(c);
    }
    let mut out = String::new();
    let mut next = Some(start);
    while let Some(c) = next {
        let m = c.to_string();
        if !m.is_empty() && !out.contains(&m) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&m);
        }
        next = cause(c);
    }
    out
}

fn with_tail(message: String, tail: &StderrTail) -> String {
    let t = tail.get();
    if t.is_empty() {
        message
    } else {
        format!("{message}; server stderr: {t}")
    }
}

/// A `tools/call` result as the agent reads it: `structuredContent` when present; otherwise the
/// text content (parsed as JSON when it is a JSON object or array, else `{"text": …}`).
pub fn to_response(r: CallToolResult) -> ToolResponse {
    let texts: Vec<String> = r
        .content
        .iter()
        .filter_map(ContentBlock::as_text)
        .map(|t| t.text.clone())
        .collect();
    let joined = texts.join("\n");
    if r.is_error == Some(true) {
        // Our own servers send {"error": {code, message}}: keep the code.
        if let Some(e) = r.structured_content.as_ref().and_then(|v| v.get("error"))
            && let (Some(code), Some(message)) = (
                e.get("code").and_then(Value::as_str),
                e.get("message").and_then(Value::as_str),
            )
        {
            return ToolResponse::Error {
                code: code.to_string(),
                message: message.to_string(),
            };
        }
        return ToolResponse::Error {
            code: "tool_error".into(),
            message: if joined.is_empty() {
                r.structured_content
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| "the tool reported an error".into())
            } else {
                joined
            },
        };
    }
    if let Some(v) = r.structured_content {
        return ToolResponse::Success { value: v };
    }
    let others = r.content.len() - texts.len();
    let value = match serde_json::from_str::<Value>(joined.trim()) {
        Ok(v @ (Value::Object(_) | Value::Array(_))) if others == 0 => v,
        _ => {
            let mut o = json!({ "text": joined });
            if others > 0 {
                let kinds: Vec<&str> = r
                    .content
                    .iter()
                    .filter_map(|c| match c {
                        ContentBlock::Text(_) => None,
                        ContentBlock::Image(_) => Some("image"),
                        ContentBlock::Audio(_) => Some("audio"),
                        ContentBlock::Resource(_) => Some("resource"),
                        ContentBlock::ResourceLink(_) => Some("resource_link"),
                        _ => Some("other"),
                    })
                    .collect();
                o["other_content"] = json!(kinds);
            }
            o
        }
    };
    ToolResponse::Success { value }
}

/// An rmcp tool as a [`ToolSpec`]. MCP defaults apply to absent hints: not read-only,
/// destructive, not idempotent, open-world.
pub fn to_spec(t: &rmcp::model::Tool) -> ToolSpec {
    let a = t.annotations.as_ref();
    let read_only = a.and_then(|a| a.read_only_hint).unwrap_or(false);
    ToolSpec {
        name: t.name.to_string(),
        description: t.description.as_deref().unwrap_or_default().to_string(),
        input_schema: Value::Object((*t.input_schema).clone()),
        annotations: ToolAnnotations {
            read_only,
            destructive: !read_only && a.and_then(|a| a.destructive_hint).unwrap_or(true),
            idempotent: a.and_then(|a| a.idempotent_hint).unwrap_or(false),
            open_world: a.and_then(|a| a.open_world_hint).unwrap_or(true),
        },
    }
}

#[async_trait]
impl Environment for McpEnv {
    fn name(&self) -> String {
        format!("mcp:{}", self.config.name)
    }

    async fn tools(&mut self) -> Result<Vec<ToolSpec>, EnvError> {
        if let Some(t) = &self.tools {
            return Ok(t.clone());
        }
        if self.client.is_closed() {
            return Err(self.closed());
        }
        let t = self.config.call_timeout;
        let tools = match tokio::time::timeout(t, self.client.peer().list_all_tools()).await {
            Err(_) => return Err(self.timeout("tools/list")),
            Ok(Err(ServiceError::McpError(e))) => {
                return Err(self.error(format!("tools/list failed: {}", e.message)));
            }
            Ok(Err(e)) => return Err(self.gone(&e)),
            Ok(Ok(list)) => list.iter().map(to_spec).collect::<Vec<_>>(),
        };
        self.tools = Some(tools.clone());
        Ok(tools)
    }

    /// Selects a task; the server's own state is not reset (MCP has no reset). Over stdio the
    /// process keeps running; over HTTP there is no process of ours to restart: the same
    /// session continues, and whatever the server keeps carries over to the next episode. For a
    /// clean slate, connect anew (a new session) or restart the server out of band.
    async fn reset(&mut self, task_id: Option<&str>) -> Result<(), EnvError> {
        self.task = match task_id {
            None => None,
            Some(id) => Some(
                self.tasks
                    .iter()
                    .find(|t| t.id == id)
                    .cloned()
                    .ok_or_else(|| EnvError::UnknownTask(id.to_string()))?,
            ),
        };
        Ok(())
    }

    async fn call(&mut self, call: &ToolCall) -> Result<ToolResponse, EnvError> {
        self.raw_call(call).await
    }

    /// The results of the current task's check calls (read-only); `{}` without a task.
    async fn snapshot(&mut self) -> Result<Value, EnvError> {
        let Some(task) = self.task.clone() else {
            return Ok(json!({}));
        };
        let mut out = Vec::new();
        for c in &task.checks {
            out.push(self.raw_call(&c.call).await?.to_json());
        }
        Ok(Value::Array(out))
    }

    async fn state_hash(&mut self) -> Result<String, EnvError> {
        let snap = self.snapshot().await?;
        Ok(state_hash(&snap))
    }

    async fn score(&mut self, trace: &EpisodeTrace) -> Result<Score, EnvError> {
        let task = self.task.clone().ok_or_else(|| {
            EnvError::Other("no task: reset to an MCP task before scoring".into())
        })?;
        let mut checklist = Vec::new();
        for (i, c) in task.checks.iter().enumerate() {
            let resp = self.raw_call(&c.call).await?;
            let (passed, reason) = c.evaluate(&resp);
            checklist.push(ChecklistItem {
                name: c
                    .name
                    .clone()
                    .unwrap_or_else(|| format!("check {i}: {}", c.call.name)),
                weight: c.weight,
                passed,
                reason,
            });
        }
        for f in &task.required_facts {
            let lf = f.to_lowercase();
            let hit = trace
                .agent_messages
                .iter()
                .any(|m| m.to_lowercase().contains(&lf));
            checklist.push(ChecklistItem {
                name: format!("tells the user `{f}`"),
                weight: 1.0,
                passed: hit,
                reason: if hit {
                    "mentioned".into()
                } else {
                    "not mentioned".into()
                },
            });
        }
        let all = checklist.iter().all(|c| c.passed);
        Ok(Score {
            reward: if all && trace.finished_normally {
                1.0
            } else {
                0.0
            },
            partial: crate::env::reward::weighted_partial(&checklist),
            checklist,
        })
    }

    fn user_turns(&self) -> Vec<String> {
        self.task
            .as_ref()
            .map(|t| t.turns.clone())
            .unwrap_or_default()
    }
}
