//! What reaches the user when an episode command goes wrong: exit statuses (0 success, 1 the
//! episode did not succeed, 2 bad input, 3 environment or model failure, 130 interrupted), a
//! server that dies before scoring, task-file checks that name a tool the server lacks (found
//! before the episode), a failed check that shows what it found, and Ctrl-C ending the session
//! as cancelled. Driven through the release binary and the misbehaving MCP server script.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use envace::env::mcp_client::{McpEnv, McpServerConfig, load_mcp_task_file};
use envace::env::{Environment, EpisodeTrace};
use envace::session::{EventBody, read_session};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn envace(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_envace"))
        .current_dir(root())
        .args(args)
        .output()
        .unwrap()
}

fn bad_server(mode: &str) -> String {
    format!(
        "python3 {} {mode}",
        root().join("tests/fixtures/mcp/bad_server.py").display()
    )
}

/// A task file for the bad server's one tool, `echo`, with one check calling `check_tool`.
fn task_file(dir: &Path, check_tool: &str) -> PathBuf {
    let p = dir.join("tasks.json");
    std::fs::write(
        &p,
        serde_json::json!({"tasks": [{
            "id": "echo-hello",
            "turns": ["Echo the word hello."],
            "checks": [{"name": "echo works", "call": {"name": check_tool,
                "arguments": {"text": "hello"}}, "path": "/text", "contains": "bye"}]
        }]})
        .to_string(),
    )
    .unwrap();
    p
}

fn code(o: &Output) -> Option<i32> {
    o.status.code()
}

#[test]
fn a_successful_and_a_failed_episode_exit_0_and_1_bad_input_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    // The bundled model solves bank-test-0000 and fails bank-test-0007 (README table).
    let out = dir.path().join("ok.jsonl");
    let ok = envace(&[
        "run",
        "--env",
        "bank",
        "--task",
        "bank-test-0000",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        code(&ok),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let out = dir.path().join("fail.jsonl");
    let fail = envace(&[
        "run",
        "--env",
        "bank",
        "--task",
        "bank-test-0007",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(
        code(&fail),
        Some(1),
        "{}",
        String::from_utf8_lossy(&fail.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&fail.stdout).unwrap();
    assert_eq!(v["reward"], 0.0, "the outcome is still printed: {v}");
    assert!(String::from_utf8_lossy(&fail.stderr).contains("did not succeed"));
    let bad = envace(&["run", "--env", "bank", "--task", "bank-test-9999"]);
    assert_eq!(code(&bad), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("bank-test-9999"));
}

#[test]
fn a_server_that_dies_during_the_episode_exits_3_with_the_reason_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = task_file(dir.path(), "echo");
    let out = dir.path().join("s.jsonl");
    let o = envace(&[
        "run",
        "--mcp",
        &bad_server("crash_on_call"),
        "--task-file",
        tasks.to_str().unwrap(),
        "--mode",
        "real",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(code(&o), Some(3), "{stderr}");
    assert!(stderr.contains("the episode failed"), "{stderr}");
    // Whether the model's own call or the scoring call met the crash, the session says so.
    let s = read_session(&out).unwrap();
    let said = s.events.iter().any(|e| match &e.event {
        EventBody::ScoringFailed { message } => message.contains("bad_server"),
        EventBody::EpisodeEnd { reason, .. } => format!("{reason:?}").contains("Failed"),
        _ => false,
    });
    assert!(said, "{}", envace::session::replay_text(&out).unwrap());
    assert!(
        envace::session::replay_text(&out)
            .unwrap()
            .contains("failed"),
    );
}

#[test]
fn a_check_naming_a_tool_the_server_lacks_is_refused_before_the_episode() {
    let dir = tempfile::tempdir().unwrap();
    let tasks = task_file(dir.path(), "read_everything");
    let out = dir.path().join("s.jsonl");
    let t0 = Instant::now();
    let o = envace(&[
        "run",
        "--mcp",
        &bad_server("ok"),
        "--task-file",
        tasks.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(code(&o), Some(2), "{stderr}");
    assert!(
        stderr.contains("echo-hello")
            && stderr.contains("checks[0].call.name")
            && stderr.contains("read_everything")
            && stderr.contains("echo"),
        "{stderr}"
    );
    assert!(!out.exists(), "no episode ran");
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[tokio::test]
async fn a_failed_check_names_the_value_it_found() {
    let dir = tempfile::tempdir().unwrap();
    let file = load_mcp_task_file(&task_file(dir.path(), "echo")).unwrap();
    let cfg = McpServerConfig::stdio(
        "python3",
        vec![
            root()
                .join("tests/fixtures/mcp/bad_server.py")
                .to_string_lossy()
                .into_owned(),
            "ok".into(),
        ],
    );
    let mut env = McpEnv::connect(cfg).await.unwrap().with_tasks(file.tasks);
    env.reset(Some("echo-hello")).await.unwrap();
    let trace = EpisodeTrace {
        finished_normally: true,
        ..Default::default()
    };
    let score = env.score(&trace).await.unwrap();
    let item = &score.checklist[0];
    assert!(!item.passed);
    assert!(
        item.reason.contains("does not contain `bye`") && item.reason.contains("found \"hello\""),
        "{}",
        item.reason
    );
    env.close().await.unwrap();
}

#[test]
fn ctrl_c_ends_an_evaluation_as_cancelled_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let sessions = dir.path().join("eval");
    let child = Command::new(env!("CARGO_BIN_EXE_envace"))
        .current_dir(root())
        .args([
            "eval",
            "--env",
            "bank",
            "--limit",
            "50",
            "--mode",
            "shadow",
            "--sessions",
        ])
        .arg(&sessions)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until an episode is under way (its session exists), then interrupt.
    let t0 = Instant::now();
    while std::fs::read_dir(&sessions).map_or(0, |d| d.count()) < 2 {
        assert!(t0.elapsed() < Duration::from_secs(60), "no episode started");
        std::thread::sleep(Duration::from_millis(50));
    }
    let st = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let out = child.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every session is complete; the interrupted one ends as cancelled.
    let mut cancelled = 0;
    let mut n = 0;
    for e in std::fs::read_dir(&sessions).unwrap() {
        let s = read_session(e.unwrap().path()).unwrap();
        n += 1;
        let end = s.events.iter().find_map(|e| match &e.event {
            EventBody::EpisodeEnd { reason, .. } => Some(format!("{reason:?}")),
            _ => None,
        });
        let end = end.expect("every session has its end");
        cancelled += usize::from(end.contains("Cancelled"));
    }
    assert!(n < 50, "the evaluation stopped early ({n} sessions)");
    assert_eq!(cancelled, 1, "the interrupted episode ends as cancelled");
}

#[test]
fn a_negative_or_non_finite_drill_rate_is_refused_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    for (flag, value) in [
        ("--calc-drills", "-1"),
        ("--tool-drills", "NaN"),
        ("--copy-per-task", "inf"),
    ] {
        let arg = format!("{flag}={value}");
        let o = envace(&["pretrain", "--out", out.to_str().unwrap(), &arg]);
        assert_eq!(code(&o), Some(2), "{arg}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(flag) && err.contains("≥ 0"), "{arg}: {err}");
        assert!(!out.exists(), "{arg}: nothing written");
    }
}

#[test]
fn an_entity_style_without_random_entities_is_refused_naming_both_flags() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m");
    let pretrain = envace(&[
        "pretrain",
        "--out",
        out.to_str().unwrap(),
        "--entity-style",
        "words",
    ]);
    let train = envace(&[
        "train",
        "--model",
        "models/envace-tiny",
        "--env",
        "bank",
        "--steps",
        "1",
        "--out",
        out.to_str().unwrap(),
        "--entity-style",
        "words",
    ]);
    for o in [pretrain, train] {
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(code(&o), Some(2), "{err}");
        assert!(
            err.contains("--entity-style") && err.contains("--random-entities"),
            "{err}"
        );
        assert!(!out.exists(), "nothing written: {err}");
    }
}
