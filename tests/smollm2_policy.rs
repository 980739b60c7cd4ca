//! The shipped SmolLM2 policy (models/smollm2-envace: a LoRA adapter naming its base GGUF
//! relative to itself) loads from a fresh clone once scripts/fetch-fixtures has run, and plays a
//! test task it solves in the README's table (bank-test-0000) through the release binary in
//! shadow mode, recording its tool rendering in the session header.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_shipped_smollm2_adapter_solves_a_test_task_in_shadow_mode() {
    let gguf = root().join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.is_file(),
        "missing fixture {}: run scripts/fetch-fixtures",
        gguf.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("s.jsonl");
    let o = Command::new(env!("CARGO_BIN_EXE_envace"))
        .current_dir(root())
        .args([
            "run",
            "--model",
            "models/smollm2-envace",
            "--env",
            "bank",
            "--task",
            "bank-test-0000",
            "--mode",
            "shadow",
            "--seed",
            "0",
            "--json",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["reward"], 1.0, "{v}");
    let s = envace::session::read_session(&out).unwrap();
    assert!(
        s.header
            .adapter
            .as_deref()
            .is_some_and(|a| a.ends_with("smollm2-envace"))
    );
    assert_eq!(s.header.model.tool_rendering.as_deref(), Some("template"));
}
