//! End to end on the bundled model (`models/envace-tiny`, committed): a run in each mode,
//! Private Rehearsal with N=4 parallel and sequential, sessions that read back and whose branch
//! tree rebuilds; deterministic sessions; `eval` killed with SIGKILL at random moments loses at
//! most the event being written.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use envace::session::{SessionTree, read_session, strip_timestamps};
use rand::{Rng, SeedableRng};
use serde_json::Value;

fn model() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/envace-tiny");
    assert!(
        p.join("model.safetensors").is_file(),
        "the bundled model {} is missing",
        p.display()
    );
    p
}

fn envace(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(args)
        .output()
        .unwrap();
    // 0: success; 1: `run` played the episode and it did not succeed (README, "Exit codes").
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "envace {args:?}: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

fn run(task: &str, extra: &[&str], out: &Path) -> Value {
    let m = model();
    let mut args = vec![
        "run",
        "--model",
        m.to_str().unwrap(),
        "--env",
        "bank",
        "--task",
        task,
        "--out",
        out.to_str().unwrap(),
        "--json",
    ];
    args.extend_from_slice(extra);
    envace(&args)
}

#[test]
fn every_mode_produces_a_valid_session() {
    let dir = tempfile::tempdir().unwrap();
    for mode in ["real", "rehearse", "shadow"] {
        let p = dir.path().join(format!("{mode}.jsonl"));
        let v = run("bank-test-0001", &["--mode", mode], &p);
        let s = read_session(&p).unwrap();
        assert!(s.warnings.is_empty(), "{mode}: {:?}", s.warnings);
        assert_eq!(s.header.mode, mode);
        let kinds: Vec<&str> = s.events.iter().map(|e| e.event.kind()).collect();
        assert!(
            kinds.contains(&"generation") && kinds.contains(&"episode_end"),
            "{mode}: {kinds:?}"
        );
        if mode == "rehearse" {
            assert!(
                !kinds.contains(&"real"),
                "rehearse mode recorded a real call"
            );
        }
        if mode == "shadow" && kinds.contains(&"real") {
            assert!(
                kinds.contains(&"simulated") && kinds.contains(&"fidelity"),
                "{kinds:?}"
            );
        }
        assert!(v["reward"].is_number());
    }
}

#[test]
fn private_rehearsal_parallel_and_sequential_build_a_branch_tree() {
    let dir = tempfile::tempdir().unwrap();
    // A transfer task: its write is irreversible, so rehearsal triggers before it.
    for strategy in ["parallel", "sequential"] {
        let p = dir.path().join(format!("{strategy}.jsonl"));
        run(
            "bank-test-0001",
            &[
                "--mode",
                "real",
                "--rehearsals",
                "4",
                "--rehearsal-mode",
                strategy,
                "--rehearse-on",
                "every",
            ],
            &p,
        );
        let s = read_session(&p).unwrap();
        let tree = SessionTree::build(&s.events);
        let branches = tree.branches();
        assert!(
            branches.len() >= 4,
            "{strategy}: {} branches",
            branches.len()
        );
        let kinds: Vec<&str> = s.events.iter().map(|e| e.event.kind()).collect();
        assert!(
            kinds.contains(&"rehearsal_start") && kinds.contains(&"rehearsal_memory"),
            "{strategy}: {kinds:?}"
        );
        assert!(!tree.main_line().is_empty());
    }
}

#[test]
fn same_seed_same_session() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.jsonl");
    let b = dir.path().join("b.jsonl");
    run(
        "bank-test-0003",
        &["--mode", "shadow", "--seed", "7", "--temperature", "0.8"],
        &a,
    );
    run(
        "bank-test-0003",
        &["--mode", "shadow", "--seed", "7", "--temperature", "0.8"],
        &b,
    );
    let ta = strip_timestamps(&std::fs::read_to_string(&a).unwrap());
    let tb = strip_timestamps(&std::fs::read_to_string(&b).unwrap());
    assert_eq!(ta, tb);
}

#[test]
fn sigkill_during_eval_loses_at_most_the_event_being_written() {
    let m = model();
    let dir = tempfile::tempdir().unwrap();
    let eval = |sessions: &Path| {
        Command::new(env!("CARGO_BIN_EXE_envace"))
            .args([
                "eval",
                "--model",
                m.to_str().unwrap(),
                "--env",
                "bank",
                "--limit",
                "4",
                "--mode",
                "shadow",
                "--json",
                "--sessions",
            ])
            .arg(sessions)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    // The reference: the same evaluation, uninterrupted.
    let full = dir.path().join("full");
    assert!(eval(&full).wait().unwrap().success());
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xE7AC);
    let mut checked_lines = 0;
    for k in 0..20 {
        let d = dir.path().join(format!("kill{k}"));
        let mut child = eval(&d);
        std::thread::sleep(Duration::from_millis(rng.random_range(100..2500)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries {
            let p = e.unwrap().path();
            let text = std::fs::read_to_string(&p).unwrap();
            if text.is_empty() {
                continue; // killed between creating the file and writing its header
            }
            let reference = strip_timestamps(
                &std::fs::read_to_string(full.join(p.file_name().unwrap())).unwrap(),
            );
            let reference: Vec<&str> = reference.lines().collect();
            let complete = text.ends_with('\n');
            let lines: Vec<&str> = text.lines().collect();
            let whole = if complete {
                lines.len()
            } else {
                lines.len() - 1
            };
            let stripped = strip_timestamps(&lines[..whole].join("\n"));
            for (i, line) in stripped.lines().enumerate() {
                assert_eq!(
                    line,
                    reference[i],
                    "{}: line {} differs from the uninterrupted run",
                    p.display(),
                    i + 1
                );
                checked_lines += 1;
            }
            if whole >= 1 {
                // It reads back (a torn last line is a warning, not an error).
                let s = read_session(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                assert_eq!(s.events.len(), whole - 1);
            }
        }
    }
    assert!(checked_lines > 0);
}

#[test]
fn live_bfcl_scoring_runs_the_model_through_the_ast_checker() {
    let gguf =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.is_file(),
        "fixture {} is missing: run scripts/fetch-fixtures",
        gguf.display()
    );
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bfcl");
    for (cat, n) in [("simple_python", 3.0), ("irrelevance", 2.0)] {
        let v = envace(&[
            "eval",
            "bfcl",
            "--model",
            gguf.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--category",
            cat,
            "--json",
        ]);
        assert_eq!(v["total"].as_f64(), Some(n), "{v}");
        let acc = v["accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc));
        assert_eq!(v["correct"].as_f64().unwrap(), (acc * n).round());
    }
}

/// `envace eval` on a built-in domain counts episodes and successes per task kind, and the
/// counts add up to the run's tasks and success rate.
#[test]
fn eval_reports_successes_per_task_kind() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let sessions = dir.path().join("s");
    let v = envace(&[
        "eval",
        "--model",
        m.to_str().unwrap(),
        "--env",
        "bank",
        "--limit",
        "6",
        "--mode",
        "real",
        "--json",
        "--sessions",
        sessions.to_str().unwrap(),
    ]);
    let kinds = v["kinds"]
        .as_object()
        .unwrap_or_else(|| panic!("no kinds: {v}"));
    // Bank tasks cycle through 12 kinds: the first six are six kinds.
    assert_eq!(kinds.len(), 6, "{v}");
    assert!(kinds.contains_key("balance"), "{v}");
    let (mut tasks, mut successes) = (0, 0);
    for c in kinds.values() {
        tasks += c["tasks"].as_u64().unwrap();
        successes += c["successes"].as_u64().unwrap();
    }
    assert_eq!(tasks, 6);
    let rate = v["success_rate"].as_f64().unwrap();
    assert_eq!(successes as f64, (rate * 6.0).round(), "{v}");
}
