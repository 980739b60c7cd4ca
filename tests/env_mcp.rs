//! The rmcp client against real MCP servers (installed by scripts/fetch-fixtures) over stdio
//! and streamable HTTP, against our own `envace env serve`, and against misbehaving servers (a
//! script on stdio, a hand-written HTTP server): clear errors within the timeout, never a panic
//! or a hang. A missing fixture fails the test and says how to fetch it.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use envace::env::mcp_client::{McpEnv, McpServerConfig, McpTransport, load_mcp_task_file};
use envace::env::tasks::{Split, list_tasks};
use envace::env::{Domain, DomainEnv, EnvError, Environment, EpisodeTrace, ToolResponse};
use envace::message::ToolCall;
use serde_json::{Value, json};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(rel: &str) -> String {
    let p = root().join(rel);
    assert!(
        p.exists(),
        "missing fixture {}: run scripts/fetch-fixtures",
        p.display()
    );
    p.to_string_lossy().into_owned()
}

fn npm_server(name: &str) -> String {
    fixture(&format!(
        ".cache/mcp/node_modules/@modelcontextprotocol/server-{name}/dist/index.js"
    ))
}

fn call(name: &str, arguments: Value) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments,
    }
}

fn ok(r: ToolResponse) -> Value {
    match r {
        ToolResponse::Success { value } => value,
        other => panic!("expected success, got {other:?}"),
    }
}

async fn connect(cfg: McpServerConfig) -> McpEnv {
    McpEnv::connect(cfg.with_timeout(Duration::from_secs(20)))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"))
}

#[tokio::test]
async fn memory_server_stores_entities_and_scores_an_mcp_task() {
    let dir = tempfile::tempdir().unwrap();
    let mem = dir.path().join("memory.json");
    let cfg = McpServerConfig::stdio("node", vec![npm_server("memory")])
        .with_env("MEMORY_FILE_PATH", mem.to_string_lossy());
    let file = load_mcp_task_file(&root().join("tests/fixtures/mcp_tasks/memory.json")).unwrap();
    let mut env = connect(cfg).await.with_tasks(file.tasks);
    assert_eq!(env.name(), "mcp:server-memory");
    let tools = env.tools().await.unwrap();
    let find = |n: &str| tools.iter().find(|t| t.name == n).unwrap().clone();
    assert!(find("read_graph").annotations.read_only);
    assert!(find("delete_entities").is_irreversible());
    assert!(!find("create_entities").is_irreversible());

    env.reset(Some("mem-remember-ann")).await.unwrap();
    assert_eq!(
        env.user_turns(),
        vec!["Remember that Ann likes tea.".to_string()]
    );
    let empty = EpisodeTrace {
        finished_normally: true,
        agent_messages: vec!["Noted, Ann.".into()],
        ..Default::default()
    };
    let before = env.score(&empty).await.unwrap();
    assert_eq!(before.reward, 0.0);

    let action = call(
        "create_entities",
        json!({"entities": [{"name": "Ann", "entityType": "person", "observations": ["likes tea"]}]}),
    );
    ok(env.call(&action).await.unwrap());
    let graph = ok(env.call(&call("read_graph", json!({}))).await.unwrap());
    assert_eq!(graph["entities"][0]["name"], "Ann");
    assert!(mem.exists(), "state went to MEMORY_FILE_PATH");

    let trace = EpisodeTrace {
        actions: vec![action],
        agent_messages: vec!["Noted: Ann likes tea.".into()],
        finished_normally: true,
        turn_ends: vec![1],
    };
    let s = env.score(&trace).await.unwrap();
    assert_eq!(s.reward, 1.0, "{:?}", s.checklist);
    assert_eq!(s.checklist.len(), 3);
    let h1 = env.state_hash().await.unwrap();
    assert_eq!(env.state_hash().await.unwrap(), h1);
    env.close().await.unwrap();
}

#[tokio::test]
async fn filesystem_server_write_file_is_destructive_and_refusals_are_tool_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().canonicalize().unwrap();
    let cfg = McpServerConfig::stdio(
        "node",
        vec![npm_server("filesystem"), d.to_string_lossy().into()],
    );
    let mut env = connect(cfg).await;
    let tools = env.tools().await.unwrap();
    let write = tools.iter().find(|t| t.name == "write_file").unwrap();
    assert!(write.annotations.destructive && !write.annotations.read_only);
    assert!(write.is_irreversible());
    assert!(
        tools
            .iter()
            .find(|t| t.name == "read_text_file")
            .unwrap()
            .annotations
            .read_only
    );

    let p = d.join("note.txt");
    ok(env
        .call(&call(
            "write_file",
            json!({"path": p, "content": "hello envace"}),
        ))
        .await
        .unwrap());
    assert_eq!(std::fs::read_to_string(&p).unwrap(), "hello envace");
    let r = ok(env
        .call(&call("read_text_file", json!({"path": p})))
        .await
        .unwrap());
    assert!(r.to_string().contains("hello envace"), "{r}");
    // A refusal by the server is the agent's to read, not an environment failure.
    let r = env
        .call(&call("read_text_file", json!({"path": "/etc/hostname"})))
        .await
        .unwrap();
    assert!(r.is_error(), "{r:?}");
    let r = env.call(&call("no_such_tool", json!({}))).await.unwrap();
    assert!(r.is_error(), "{r:?}");
}

#[tokio::test]
async fn everything_server_text_and_structured_content() {
    let cfg = McpServerConfig::stdio("node", vec![npm_server("everything"), "stdio".into()]);
    let mut env = connect(cfg).await;
    let tools = env.tools().await.unwrap();
    assert!(tools.len() >= 5);
    let echo = ok(env
        .call(&call("echo", json!({"message": "hi there"})))
        .await
        .unwrap());
    assert!(
        echo["text"].as_str().unwrap().contains("hi there"),
        "{echo}"
    );
    let sum = ok(env
        .call(&call("get-sum", json!({"a": 2, "b": 3})))
        .await
        .unwrap());
    assert!(sum["text"].as_str().unwrap().contains('5'), "{sum}");
    let st = ok(env
        .call(&call(
            "get-structured-content",
            json!({"location": "Chicago"}),
        ))
        .await
        .unwrap());
    assert!(
        st.is_object() && st.get("text").is_none(),
        "structured content preferred: {st}"
    );
    assert!(st.get("temperature").is_some(), "{st}");
}

#[tokio::test]
async fn git_server_over_a_temp_repo() {
    let exe = fixture(".cache/mcp/venv/bin/mcp-server-git");
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    std::fs::create_dir(&repo).unwrap();
    let st = std::process::Command::new("git")
        .args(["init", "-q", "-b", "main"])
        .current_dir(&repo)
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::write(repo.join("a.txt"), "one\n").unwrap();
    let mut cfg = McpServerConfig::stdio(
        exe,
        vec!["--repository".into(), repo.to_string_lossy().into()],
    );
    for (k, v) in [
        ("GIT_AUTHOR_NAME", "T"),
        ("GIT_AUTHOR_EMAIL", "t@example.com"),
        ("GIT_COMMITTER_NAME", "T"),
        ("GIT_COMMITTER_EMAIL", "t@example.com"),
    ] {
        cfg = cfg.with_env(k, v);
    }
    let mut env = connect(cfg).await;
    let tools = env.tools().await.unwrap();
    assert!(
        tools
            .iter()
            .find(|t| t.name == "git_reset")
            .unwrap()
            .is_irreversible()
    );
    assert!(
        tools
            .iter()
            .find(|t| t.name == "git_status")
            .unwrap()
            .annotations
            .read_only
    );
    let r = ok(env
        .call(&call("git_status", json!({"repo_path": repo})))
        .await
        .unwrap());
    assert!(r.to_string().contains("a.txt"), "{r}");
    ok(env
        .call(&call(
            "git_add",
            json!({"repo_path": repo, "files": ["a.txt"]}),
        ))
        .await
        .unwrap());
    ok(env
        .call(&call(
            "git_commit",
            json!({"repo_path": repo, "message": "first envace commit"}),
        ))
        .await
        .unwrap());
    let log = ok(env
        .call(&call("git_log", json!({"repo_path": repo})))
        .await
        .unwrap());
    assert!(log.to_string().contains("first envace commit"), "{log}");
}

#[tokio::test]
async fn our_own_server_serves_every_domain_faithfully() {
    for d in Domain::ALL {
        let task = list_tasks(d, Some(Split::Test))
            .into_iter()
            .find(|t| {
                t.turns
                    .iter()
                    .flat_map(|x| &x.actions)
                    .any(|a| a.error.is_some())
            })
            .unwrap()
            .clone();
        let cfg = McpServerConfig::stdio(
            env!("CARGO_BIN_EXE_envace"),
            vec![
                "env".into(),
                "serve".into(),
                d.name().into(),
                "--task".into(),
                task.id.clone(),
            ],
        );
        let mut remote = connect(cfg).await;
        let mut local = DomainEnv::new(d);
        local.reset(Some(&task.id)).await.unwrap();
        let theirs = remote.tools().await.unwrap();
        let ours = local.tools().await.unwrap();
        assert_eq!(theirs.len(), ours.len());
        for (a, b) in theirs.iter().zip(&ours) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.input_schema, b.input_schema, "{}", a.name);
            assert_eq!(
                a.annotations.read_only, b.annotations.read_only,
                "{}",
                a.name
            );
            assert_eq!(
                a.annotations.destructive, b.annotations.destructive,
                "{}",
                a.name
            );
            assert_eq!(
                a.annotations.idempotent, b.annotations.idempotent,
                "{}",
                a.name
            );
            assert_eq!(a.is_irreversible(), b.is_irreversible());
        }
        let mut calls = task.gold_actions();
        calls.push(call("nope", json!({})));
        calls.push(call(&ours[0].name, json!({"bogus": 1})));
        for c in calls {
            let r = remote.call(&c).await.unwrap();
            let l = local.call(&c).await.unwrap();
            assert_eq!(r, l, "{d} {c:?}");
        }
        remote.close().await.unwrap();
    }
}

fn bad_server(mode: &str) -> McpServerConfig {
    McpServerConfig::stdio(
        "python3",
        vec![fixture("tests/fixtures/mcp/bad_server.py"), mode.into()],
    )
    .with_timeout(Duration::from_secs(2))
}

/// Connect and call `echo`; the whole thing must end (with an error) well within the limits.
async fn fault(mode: &str) -> EnvError {
    let t0 = Instant::now();
    let out = async {
        let mut env = McpEnv::connect(bad_server(mode)).await?;
        env.tools().await?;
        env.call(&call("echo", json!({"text": "hi"}))).await
    };
    let r = tokio::time::timeout(Duration::from_secs(15), out)
        .await
        .unwrap_or_else(|_| panic!("{mode}: hung"));
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "{mode}: took {:?}",
        t0.elapsed()
    );
    match r {
        Ok(v) => panic!("{mode}: succeeded with {v:?}"),
        Err(e) => e,
    }
}

#[tokio::test]
async fn fault_server_exits_at_start() {
    let e = fault("exit_at_start").await.to_string();
    assert!(
        e.contains("bad_server.py") && e.contains("exiting at start on purpose"),
        "{e}"
    );
}

#[tokio::test]
async fn fault_server_never_answers() {
    let e = fault("silent").await.to_string();
    assert!(
        e.contains("no valid answer to initialize within 2.0s"),
        "{e}"
    );
}

#[tokio::test]
async fn fault_server_answers_invalid_json() {
    let e = fault("garbage_init").await.to_string();
    assert!(
        e.contains("non-JSON-RPC output") && e.contains("this is not json"),
        "{e}"
    );
    let e = fault("garbage_on_call").await.to_string();
    assert!(
        e.contains("non-JSON-RPC output") && e.contains("oops"),
        "{e}"
    );
}

#[tokio::test]
async fn fault_server_crashes_mid_call_and_later_calls_fail_fast() {
    let mut env = McpEnv::connect(bad_server("crash_on_call")).await.unwrap();
    assert_eq!(env.tools().await.unwrap()[0].name, "echo");
    let t0 = Instant::now();
    let e = env
        .call(&call("echo", json!({"text": "x"})))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("gone") && e.contains("crashing mid-call"), "{e}");
    let e2 = env
        .call(&call("echo", json!({"text": "x"})))
        .await
        .unwrap_err();
    assert!(matches!(e2, EnvError::Mcp { .. }), "{e2}");
    assert!(t0.elapsed() < Duration::from_secs(4));
}

#[tokio::test]
async fn fault_server_hangs_on_call_times_out() {
    let e = fault("hang_on_call").await;
    assert!(
        matches!(e, EnvError::Timeout { ref tool, .. } if tool == "echo"),
        "{e}"
    );
}

#[tokio::test]
async fn well_behaved_script_server_works() {
    let mut env = McpEnv::connect(bad_server("ok")).await.unwrap();
    let v = ok(env
        .call(&call("echo", json!({"text": "{\"a\":1}"})))
        .await
        .unwrap());
    assert_eq!(v, json!({"a": 1}), "JSON text content is parsed");
    let v = ok(env
        .call(&call("echo", json!({"text": "plain"})))
        .await
        .unwrap());
    assert_eq!(v, json!({"text": "plain"}));
}

#[tokio::test]
async fn missing_server_binary_is_a_clear_error() {
    let e = McpEnv::connect(McpServerConfig::stdio("/nonexistent/mcp-server", vec![]))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot start") && e.contains("/nonexistent/mcp-server"),
        "{e}"
    );
}

fn bad_mcp_file(name: &str) -> String {
    let p = root().join("tests/fixtures/tasks_invalid").join(name);
    let e = load_mcp_task_file(Path::new(&p)).unwrap_err();
    assert!(matches!(e, EnvError::BadTask { .. }));
    let m = e.to_string();
    assert!(m.contains(name), "{m}");
    m
}

#[test]
fn bad_mcp_task_file_names_the_check() {
    let m = bad_mcp_file("mcp_bad_check.json");
    assert!(
        m.contains("task mem-bad") && m.contains("`checks[0]`") && m.contains("equal"),
        "{m}"
    );
}

#[test]
fn bad_mcp_task_file_names_the_turns() {
    let m = bad_mcp_file("mcp_turns_not_strings.json");
    assert!(m.contains("task mem-turns") && m.contains("`turns`"), "{m}");
}

// ---------------------------------------------------------------------------------------------
// Streamable HTTP: the real `server-everything` in its `streamableHttp` mode, a refused
// connection, and a tiny hand-written HTTP server that misbehaves in chosen ways.

/// A child process killed (and reaped) when the test ends, passing or failing.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port nothing listens on right now (the OS picks it; tests run in parallel).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `server-everything streamableHttp` on a free port; returns the guard and the endpoint URL
/// once the server says it listens. Waiting for its own "listening" line, not just for the port
/// to accept, makes sure the port is ours: tests pick ports in parallel, and a server that lost
/// a race for one exits with "already in use" (then we try another).
fn everything_http() -> (KillOnDrop, String) {
    let script = npm_server("everything");
    for _attempt in 0..3 {
        let port = free_port();
        let log = tempfile::NamedTempFile::new().unwrap();
        let child = std::process::Command::new("node")
            .args([script.as_str(), "streamableHttp"])
            .env("PORT", port.to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log.reopen().unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start node for server-everything: {e}"));
        let mut guard = KillOnDrop(child);
        let t0 = Instant::now();
        loop {
            let text = std::fs::read_to_string(log.path()).unwrap_or_default();
            if text.contains(&format!("listening on port {port}")) {
                return (guard, format!("http://127.0.0.1:{port}/mcp"));
            }
            if let Ok(Some(st)) = guard.0.try_wait() {
                assert!(
                    text.contains("already in use"),
                    "server-everything streamableHttp exited ({st}) before listening on {port}: {text}"
                );
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "server-everything did not listen on {port} within 20 s: {text}"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }
    panic!("server-everything: three ports in a row were taken");
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

async fn echo_latency(env: &mut McpEnv, n: usize) -> Duration {
    let mut times = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        let r = ok(env
            .call(&call("echo", json!({"message": format!("ping {i}")})))
            .await
            .unwrap());
        times.push(t.elapsed());
        assert!(r["text"].as_str().unwrap().contains(&format!("ping {i}")));
    }
    median(times)
}

#[tokio::test]
async fn everything_server_over_streamable_http_lists_and_calls_tools() {
    let (_server, url) = everything_http();
    let mut env = connect(McpServerConfig::http(&url)).await;
    assert_eq!(env.name(), format!("mcp:{url}"));
    assert!(env.server_info().is_some());
    let tools = env.tools().await.unwrap();
    assert!(tools.len() >= 5, "{tools:?}");
    let echo_tool = tools.iter().find(|t| t.name == "echo").unwrap();
    assert!(
        echo_tool.input_schema["properties"]
            .get("message")
            .is_some()
    );
    let echo = ok(env
        .call(&call("echo", json!({"message": "hi over http"})))
        .await
        .unwrap());
    assert!(
        echo["text"].as_str().unwrap().contains("hi over http"),
        "{echo}"
    );
    let sum = ok(env
        .call(&call("get-sum", json!({"a": 2, "b": 3})))
        .await
        .unwrap());
    assert!(sum["text"].as_str().unwrap().contains('5'), "{sum}");
    let st = ok(env
        .call(&call(
            "get-structured-content",
            json!({"location": "Chicago"}),
        ))
        .await
        .unwrap());
    assert!(st.get("temperature").is_some(), "{st}");
    // The server's refusals stay the agent's to read, as over stdio.
    let r = env.call(&call("no_such_tool", json!({}))).await.unwrap();
    assert!(r.is_error(), "{r:?}");
    // reset selects a task only: the session (and the server) carry on.
    env.reset(None).await.unwrap();
    ok(env
        .call(&call("echo", json!({"message": "after reset"})))
        .await
        .unwrap());

    // The same tools as over stdio; and the call latency of each (printed for the record).
    let mut stdio = connect(McpServerConfig::stdio(
        "node",
        vec![npm_server("everything"), "stdio".into()],
    ))
    .await;
    let names =
        |ts: &[envace::env::ToolSpec]| ts.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&stdio.tools().await.unwrap()), names(&tools));
    let http_ms = echo_latency(&mut env, 30).await;
    let stdio_ms = echo_latency(&mut stdio, 30).await;
    eprintln!("echo median latency: streamable HTTP {http_ms:?}, stdio {stdio_ms:?}");
    assert!(http_ms < Duration::from_secs(1), "{http_ms:?}");
    env.close().await.unwrap();
    stdio.close().await.unwrap();
}

#[tokio::test]
async fn http_server_going_down_mid_session_is_a_clear_error_naming_the_url() {
    let (server, url) = everything_http();
    let mut env = connect(McpServerConfig::http(&url).with_timeout(Duration::from_secs(5))).await;
    env.tools().await.unwrap();
    drop(server);
    let t0 = Instant::now();
    let e = env
        .call(&call("echo", json!({"message": "anyone?"})))
        .await
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let m = e.to_string();
    assert!(matches!(e, EnvError::Mcp { .. }), "{m}");
    assert!(
        m.contains(&url) && m.to_lowercase().contains("refused"),
        "{m}"
    );
}

#[tokio::test]
async fn http_connection_refused_is_a_clear_error_within_a_second() {
    let url = format!("http://127.0.0.1:{}/mcp", free_port());
    let t0 = Instant::now();
    let e = McpEnv::connect(McpServerConfig::http(&url).with_timeout(Duration::from_secs(10)))
        .await
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    let m = e.to_string();
    assert!(
        m.contains(&url) && m.to_lowercase().contains("refused"),
        "{m}"
    );
    // A server with its own name is named, and its URL still given.
    let e = McpEnv::connect(McpServerConfig::http(&url).with_name("tools-api"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("`tools-api`") && e.contains(&url), "{e}");
}

#[tokio::test]
async fn http_bad_urls_and_headers_are_clear_errors() {
    let e = McpEnv::connect(McpServerConfig::http("localhost:3001/mcp"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("localhost:3001/mcp") && e.contains("http://"),
        "{e}"
    );
    let e = McpEnv::connect(McpServerConfig::http("not a url"))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a URL"), "{e}");
    let e = McpEnv::connect(
        McpServerConfig::http("http://127.0.0.1:9/mcp").with_header("Bad Name", "x"),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("header name `Bad Name`"), "{e}");
}

/// How the hand-written server answers.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Tiny {
    /// Reads the request, never answers.
    HangOnInit,
    /// `HTTP 500` with a text body.
    Status500OnInit,
    /// `200 application/json` whose body is not JSON.
    GarbageJsonOnInit,
    /// Bytes that are not HTTP at all, then closes.
    NotHttp,
    /// A proper MCP handshake and tools/list (one tool, `echo`); then tools/call…
    CallHangs,
    CallStatus500,
    CallGarbage,
    CallEchoes,
}

struct TinyServer {
    url: String,
    /// Each request's head (request line and headers), lower-cased.
    requests: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

fn read_request(s: &mut std::net::TcpStream) -> Option<(String, Value)> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_lowercase();
    let len = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse::<usize>().unwrap_or(0));
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).ok()?;
    Some((head, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

fn respond(s: &mut std::net::TcpStream, status: &str, content_type: &str, body: &str) {
    use std::io::Write;
    let _ = write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn result(id: &Value, result: Value) -> String {
    json!({"jsonrpc": "2.0", "id": id, "result": result}).to_string()
}

/// A one-request-per-connection HTTP server in a thread; it lives until the test process ends.
fn tiny_server(mode: Tiny) -> TinyServer {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let seen = seen.clone();
            std::thread::spawn(move || {
                let Some((head, body)) = read_request(&mut s) else {
                    return;
                };
                seen.lock().unwrap().push(head.clone());
                let method = body["method"].as_str().unwrap_or_default().to_string();
                let id = body["id"].clone();
                let hang = || std::thread::sleep(Duration::from_secs(60));
                match mode {
                    Tiny::HangOnInit => hang(),
                    Tiny::Status500OnInit => respond(
                        &mut s,
                        "500 Internal Server Error",
                        "text/plain",
                        "boom: database on fire",
                    ),
                    Tiny::GarbageJsonOnInit => {
                        respond(&mut s, "200 OK", "application/json", "this is not json")
                    }
                    Tiny::NotHttp => {
                        use std::io::Write;
                        let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\nwhat is this\r\n");
                    }
                    _ if head.starts_with("get ") || head.starts_with("delete ") => {
                        respond(&mut s, "405 Method Not Allowed", "text/plain", "")
                    }
                    _ if method == "initialize" => {
                        let version = body["params"]["protocolVersion"].clone();
                        let r = result(
                            &id,
                            json!({"protocolVersion": version, "capabilities": {"tools": {}},
                                   "serverInfo": {"name": "tiny", "version": "0"}}),
                        );
                        respond(&mut s, "200 OK", "application/json", &r);
                    }
                    _ if id.is_null() => respond(&mut s, "202 Accepted", "text/plain", ""),
                    _ if method == "tools/list" => {
                        let r = result(
                            &id,
                            json!({"tools": [{"name": "echo", "inputSchema": {"type": "object"},
                                   "annotations": {"readOnlyHint": true}}]}),
                        );
                        respond(&mut s, "200 OK", "application/json", &r);
                    }
                    Tiny::CallHangs => hang(),
                    Tiny::CallStatus500 => respond(
                        &mut s,
                        "500 Internal Server Error",
                        "text/plain",
                        "boom: tool backend on fire",
                    ),
                    Tiny::CallGarbage => {
                        respond(&mut s, "200 OK", "application/json", "{{{ not json")
                    }
                    Tiny::CallEchoes => {
                        let text = body["params"]["arguments"]["text"].clone();
                        let r = result(&id, json!({"content": [{"type": "text", "text": text}]}));
                        respond(&mut s, "200 OK", "application/json", &r);
                    }
                }
            });
        }
    });
    TinyServer { url, requests }
}

/// Connect to a tiny server and call `echo`: it must fail, clearly and fast.
async fn http_fault(mode: Tiny) -> (EnvError, String) {
    let server = tiny_server(mode);
    let cfg = McpServerConfig::http(&server.url).with_timeout(Duration::from_secs(1));
    let t0 = Instant::now();
    let out = async {
        let mut env = McpEnv::connect(cfg).await?;
        env.tools().await?;
        env.call(&call("echo", json!({"text": "hi"}))).await
    };
    let r = tokio::time::timeout(Duration::from_secs(10), out)
        .await
        .unwrap_or_else(|_| panic!("{mode:?}: hung"));
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "{mode:?}: took {:?}",
        t0.elapsed()
    );
    match r {
        Ok(v) => panic!("{mode:?}: succeeded with {v:?}"),
        Err(e) => {
            let m = e.to_string();
            eprintln!("{mode:?}: {m}");
            assert!(
                m.contains(&server.url),
                "{mode:?}: does not name the URL: {m}"
            );
            (e, m)
        }
    }
}

#[tokio::test]
async fn http_server_that_never_answers_initialize_times_out() {
    let (_, m) = http_fault(Tiny::HangOnInit).await;
    assert!(m.contains("no answer to initialize within 1.0s"), "{m}");
}

#[tokio::test]
async fn http_500_on_initialize_is_a_clear_error() {
    let (_, m) = http_fault(Tiny::Status500OnInit).await;
    assert!(m.contains("handshake failed") && m.contains("500"), "{m}");
}

#[tokio::test]
async fn http_garbage_on_initialize_is_a_clear_error() {
    let (_, m) = http_fault(Tiny::GarbageJsonOnInit).await;
    assert!(m.contains("handshake failed"), "{m}");
    let (_, m) = http_fault(Tiny::NotHttp).await;
    assert!(m.contains("handshake failed"), "{m}");
}

#[tokio::test]
async fn http_call_that_hangs_times_out_naming_the_server() {
    let (e, m) = http_fault(Tiny::CallHangs).await;
    assert!(
        matches!(e, EnvError::Timeout { ref tool, .. } if tool == "echo"),
        "{m}"
    );
}

#[tokio::test]
async fn http_500_on_a_call_is_a_clear_error() {
    let (e, m) = http_fault(Tiny::CallStatus500).await;
    assert!(
        matches!(e, EnvError::Mcp { .. }) && m.contains("500"),
        "{m}"
    );
}

#[tokio::test]
async fn http_garbage_answer_to_a_call_is_a_clear_error() {
    let (e, m) = http_fault(Tiny::CallGarbage).await;
    assert!(matches!(e, EnvError::Mcp { .. }), "{m}");
}

#[tokio::test]
async fn http_headers_are_sent_with_every_request() {
    let server = tiny_server(Tiny::CallEchoes);
    let cfg = McpServerConfig::http(&server.url)
        .with_header("Authorization", "Bearer s3cret")
        .with_header("X-Api-Key", "k1")
        .with_timeout(Duration::from_secs(5));
    assert!(
        !format!("{cfg:?}").contains("s3cret"),
        "header values are redacted in Debug"
    );
    let mut env = McpEnv::connect(cfg).await.unwrap();
    let tools = env.tools().await.unwrap();
    assert!(tools[0].annotations.read_only);
    let v = ok(env
        .call(&call("echo", json!({"text": "{\"a\":1}"})))
        .await
        .unwrap());
    assert_eq!(v, json!({"a": 1}));
    let requests = server.requests.lock().unwrap().clone();
    let posts: Vec<&String> = requests.iter().filter(|r| r.starts_with("post ")).collect();
    assert!(posts.len() >= 4, "{requests:?}");
    for r in posts {
        assert!(
            r.contains("authorization: bearer s3cret") && r.contains("x-api-key: k1"),
            "{r}"
        );
    }
}

#[test]
fn cli_lists_and_calls_tools_of_an_http_server() {
    let (_server, url) = everything_http();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(["env", "tools", "--mcp-url", &url, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tools: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        tools
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "echo"),
        "{tools}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envace"))
        .args([
            "env",
            "call",
            "--mcp-url",
            &url,
            "--mcp-header",
            "Authorization: Bearer t0ken",
            "echo",
            r#"{"message": "from the cli"}"#,
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("from the cli"),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Process-only flags do not apply to a URL.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(["env", "tools", "--mcp-url", &url, "--mcp-env", "A=b"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("--mcp-env and --mcp-cwd apply to"),
        "{stderr}"
    );
    // Refused: a clear message on stderr, a failing exit, no panic.
    let dead = format!("http://127.0.0.1:{}/mcp", free_port());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(["env", "tools", "--mcp-url", &dead])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&dead) && !stderr.contains("panicked"),
        "{stderr}"
    );
}

#[test]
fn mcp_task_file_server_section_may_name_a_url_with_headers() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("http_tasks.json");
    std::fs::write(
        &p,
        r#"{"server": {"url": "http://127.0.0.1:3001/mcp", "headers": {"Authorization": "Bearer x"}},
            "tasks": [{"id": "t1", "turns": ["Say hi."]}]}"#,
    )
    .unwrap();
    let file = load_mcp_task_file(&p).unwrap();
    let cfg = file.server_config().unwrap();
    assert_eq!(cfg.name, "http://127.0.0.1:3001/mcp");
    assert_eq!(
        cfg,
        McpServerConfig::http("http://127.0.0.1:3001/mcp").with_header("Authorization", "Bearer x")
    );
    std::fs::write(
        &p,
        r#"{"server": {"command": "node", "args": ["node_modules/@modelcontextprotocol/server-memory/dist/index.js"]},
            "tasks": [{"id": "t1", "turns": ["Say hi."]}]}"#,
    )
    .unwrap();
    let cfg = load_mcp_task_file(&p).unwrap().server_config().unwrap();
    assert!(matches!(cfg.transport, McpTransport::Stdio { .. }));
    assert_eq!(cfg.name, "server-memory");
}
