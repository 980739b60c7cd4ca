//! The rmcp client against real MCP servers (installed by scripts/fetch-fixtures), against our
//! own `envace env serve`, and against a misbehaving server: clear errors within the timeout,
//! never a panic or a hang. A missing fixture fails the test and says how to fetch it.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use envace::env::mcp_client::{McpEnv, McpServerConfig, load_mcp_task_file};
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
