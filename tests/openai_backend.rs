//! The OpenAI-compatible backend against a real server: llama.cpp's own `llama-server` (built
//! from PyPI's llama-cpp-python sdist by scripts/fetch-llama-cpp, as scripts/test does) serving
//! the SmolLM2 GGUF on 127.0.0.1. Through the release binary:
//! - the completions path (`&tokenizer=` the same GGUF: prompts rendered and tokenized here)
//!   plays the first turn of the same test tasks as the in-process model, and their greedy
//!   actions agree on a stated share (two different Q4_1 kernels: llama.cpp's and ours);
//! - the chat path (`/v1/chat/completions`, tools rendered into the system message) plays an
//!   episode and records the backend in the session header;
//! - killing the server mid-evaluation ends the command with an error naming the URL (after
//!   its retries), not a hang or a panic.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn gguf() -> PathBuf {
    let p = root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "missing fixture {}: run scripts/fetch-fixtures",
        p.display()
    );
    p
}

/// One server at a time: three servers with two threads each on a two-core machine would make
/// each test wait on the others.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A running llama-server, killed on drop (before the lock it holds is released).
struct Server {
    child: Child,
    port: u16,
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start() -> Self {
        let turn = ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let bin = root().join(".cache/llama.cpp/bin/llama-server");
        assert!(
            bin.is_file(),
            "missing fixture {}: run scripts/fetch-fixtures (it builds llama.cpp's server)",
            bin.display()
        );
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log =
            std::fs::File::create(std::env::temp_dir().join(format!("llama-server-{port}.log")))
                .unwrap();
        let child = Command::new(bin)
            .args(["-m"])
            .arg(gguf())
            .args([
                "--alias",
                "smollm2",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "-c",
                "16384",
                "-np",
                "4",
                "-t",
                "2",
                "--no-webui",
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let server = Self {
            child,
            port,
            _turn: turn,
        };
        let t = Instant::now();
        while health(port) != Some(200) {
            assert!(
                t.elapsed() < Duration::from_secs(120),
                "llama-server on port {port} not healthy after 120 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }
}

/// The status of `GET /health` (None while nothing listens).
fn health(port: u16) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split_whitespace().nth(1)?.parse().ok()
}

fn envace(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_envace"))
        .current_dir(root())
        .args(args)
        .output()
        .unwrap()
}

/// Every session file in `dir`, by task id: (header, the first main-line actor generation's
/// text, the first parsed actor action).
fn first_turns(dir: &Path) -> Vec<(String, Value, String, Value)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().and_then(|e| e.to_str()) != Some("jsonl") {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let mut lines = text.lines();
        let header: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
        let events: Vec<Value> = lines
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["event"].clone())
            .collect();
        let generated = events
            .iter()
            .find(|e| e["type"] == "generation" && e["role"] == "actor" && e["branch"].is_null())
            .map(|e| e["text"].as_str().unwrap().to_string())
            .unwrap_or_default();
        let action = events
            .iter()
            .find(|e| e["type"] == "actor_parsed")
            .map(|e| e["turn"]["action"].clone())
            .unwrap_or(Value::Null);
        let task = header["task_id"].as_str().unwrap().to_string();
        out.push((task, header, generated, action));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn completions_backend_agrees_with_the_in_process_model_on_the_same_gguf() {
    let server = Server::start();
    let gguf = gguf();
    // Without llama.cpp's prompt cache: with it, the server can answer the same prompt
    // differently on a second request (measured), which would make this comparison a lottery.
    let spec = format!(
        "openai:{}#smollm2&tokenizer={}&cache_prompt=false",
        server.url(),
        gguf.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let (mut same_action, mut same_text, mut compared) = (0, 0, 0);
    for domain in ["bank", "retail"] {
        let mut runs = Vec::new();
        for (name, model) in [
            ("local", gguf.display().to_string()),
            ("remote", spec.clone()),
        ] {
            let sessions = dir.path().join(format!("{name}-{domain}"));
            // One actor turn per task: both sides answer the same prompt.
            let o = envace(&[
                "eval",
                "--model",
                &model,
                "--env",
                domain,
                "--split",
                "test",
                "--limit",
                "3",
                "--seed",
                "0",
                "--mode",
                "real",
                "--max-turns",
                "1",
                "--json",
                "--sessions",
                sessions.to_str().unwrap(),
            ]);
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(0), "{model}: {stderr}");
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(v["tasks"], 3, "{v}");
            runs.push(first_turns(&sessions));
        }
        let (local, remote) = (&runs[0], &runs[1]);
        assert_eq!(local.len(), 3);
        assert_eq!(remote.len(), 3);
        for ((task, _, lt, la), (task_r, header, rt, ra)) in local.iter().zip(remote) {
            assert_eq!(task, task_r);
            // The remote sessions record the backend and the served model's name.
            assert_eq!(
                header["model"]["path"],
                format!("openai:{}#smollm2", server.url()),
                "{header}"
            );
            assert!(
                !rt.is_empty(),
                "{task}: the remote episode generated nothing"
            );
            assert!(!ra.is_null(), "{task}: no parsed actor turn");
            compared += 1;
            same_action += usize::from(la == ra);
            same_text += usize::from(lt == rt);
            let prefix = lt
                .chars()
                .zip(rt.chars())
                .take_while(|(a, b)| a == b)
                .count();
            eprintln!(
                "{task}: same action {}, same text {}, identical prefix {prefix} of {} chars",
                la == ra,
                lt == rt,
                lt.chars().count().max(rt.chars().count())
            );
        }
    }
    eprintln!("same greedy action: {same_action} of {compared}; same text: {same_text}");
    // Stated share (docs/SCALE.md): the same calls/answer on at least a third of the first
    // turns. Measured 3 of 6, text identical on 1 of 6: the base model is unsure from its second
    // token on, and llama.cpp's and envace's Q4_1 kernels break such near-ties differently.
    assert!(
        3 * same_action >= compared,
        "only {same_action} of {compared} greedy first turns take the same action"
    );
}

#[test]
fn chat_backend_plays_an_episode_and_records_the_backend() {
    let server = Server::start();
    let spec = format!("openai:{}#smollm2&tools=smollm2", server.url());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("s.jsonl");
    let o = envace(&[
        "run",
        "--model",
        &spec,
        "--env",
        "bank",
        "--task",
        "bank-test-0007",
        "--mode",
        "shadow",
        "--max-turns",
        "2",
        "--seed",
        "0",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    // The episode runs to its end (solved or not: the base model is not tuned on bank tasks).
    assert!(matches!(o.status.code(), Some(0 | 1)), "{stderr}");
    let text = std::fs::read_to_string(&out).unwrap();
    let header: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(
        header["model"]["path"],
        format!("openai:{}#smollm2", server.url())
    );
    assert_eq!(header["model"]["tool_rendering"], "system-smollm2");
    let generations: Vec<Value> = text
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["event"]["type"] == "generation")
        .collect();
    assert!(!generations.is_empty(), "no generation recorded");
    // The chat API keeps the messages (rendered by the server), not token ids.
    let g = &generations[0]["event"];
    assert!(g["prompt"].as_array().is_some_and(|m| !m.is_empty()), "{g}");
    assert!(!g["text"].as_str().unwrap().is_empty(), "{g}");
    // A served model cannot enforce constrained tool names: refused when the command starts,
    // naming the server, rather than run unconstrained; no session or answer file is begun.
    let session = dir.path().join("c.jsonl");
    let sessions = dir.path().join("eval-sessions");
    let answers = dir.path().join("bfcl.jsonl");
    let data = root().join(".cache/bfcl/data");
    assert!(
        data.is_dir(),
        "missing fixture {}: run scripts/fetch-bfcl",
        data.display()
    );
    let runs: [(Vec<&str>, &Path); 3] = [
        (
            vec![
                "run",
                "--env",
                "bank",
                "--task",
                "bank-test-0007",
                "--mode",
                "shadow",
                "--out",
                session.to_str().unwrap(),
            ],
            &session,
        ),
        (
            vec![
                "eval",
                "--env",
                "bank",
                "--split",
                "test",
                "--limit",
                "1",
                "--sessions",
                sessions.to_str().unwrap(),
            ],
            &sessions,
        ),
        (
            vec![
                "eval",
                "bfcl",
                "--data",
                data.to_str().unwrap(),
                "--category",
                "simple_python",
                "--limit",
                "1",
                "--out",
                answers.to_str().unwrap(),
            ],
            &answers,
        ),
    ];
    for (args, written) in runs {
        let mut args = args;
        args.extend(["--model", spec.as_str(), "--constrain-tools"]);
        let o = envace(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            !matches!(o.status.code(), Some(0 | 1)),
            "{args:?}: {stderr}"
        );
        assert!(
            stderr.contains("--constrain-tools") && stderr.contains(&server.url()),
            "{args:?}: {stderr}"
        );
        assert!(!written.exists(), "{args:?}: {stderr}");
    }
}

#[test]
fn a_server_killed_mid_evaluation_is_an_error_naming_the_url() {
    let mut server = Server::start();
    let url = server.url();
    let spec = format!(
        "openai:{url}#smollm2&tokenizer={}&retries=2&timeout=10",
        gguf().display()
    );
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_envace"))
        .current_dir(root())
        .args([
            "eval",
            "--model",
            &spec,
            "--env",
            "bank",
            "--split",
            "test",
            "--limit",
            "10",
            "--seed",
            "0",
            "--mode",
            "shadow",
            "--json",
            "--sessions",
        ])
        .arg(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Kill the server once the first session has an actor generation in it.
    let t = Instant::now();
    loop {
        let started = std::fs::read_dir(dir.path())
            .map(|d| {
                d.flatten().any(|e| {
                    std::fs::read_to_string(e.path())
                        .is_ok_and(|s| s.contains("\"type\":\"generation\""))
                })
            })
            .unwrap_or(false);
        if started {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no generation after 120 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let t = Instant::now();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_ne!(o.status.code(), Some(0), "{stderr}");
    assert!(o.status.code().is_some(), "killed by a signal: {stderr}");
    assert!(stderr.contains(&format!("{url}/completions")), "{stderr}");
    // Two retries with backoff (0.5 s, 1 s), then the error: seconds, not a hang.
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
}
