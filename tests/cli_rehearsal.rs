//! The Private Rehearsal knobs of the CLI (`--memory-format`, `--memory-select`,
//! `--memory-placement`, `--rehearsal-depth`, `--rehearsal-temperature`, `--rehearsal-explore`,
//! `--rehearsal-recall`) reach the engine, and bad
//! values are refused with a message naming the flag.
#![allow(clippy::unwrap_used)]

use assert_cmd::Command;

fn envace() -> Command {
    let mut c = Command::cargo_bin("envace").unwrap();
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

#[test]
fn bad_rehearsal_flags_name_the_flag() {
    for (flag, value, needle) in [
        ("--memory-select", "bogus", "for '--memory-select"),
        ("--memory-select", "success-first:0", "not a count"),
        ("--rehearsal-depth", "0", "for '--rehearsal-depth"),
        ("--rehearse-on", "sometimes", "for '--rehearse-on"),
        ("--temperature", "-0.5", "--temperature:"),
        ("--rehearsal-temperature", "-1", "--rehearsal-temperature"),
        ("--rehearsal-explore", "-0.5", "--rehearsal-explore"),
        ("--rehearsal-explore", "NaN", "--rehearsal-explore"),
        ("--rehearsal-recall", "maybe", "--rehearsal-recall"),
    ] {
        let out = envace()
            .args(["run", "--env", "bank", "--task", "bank-test-0001"])
            .arg(format!("{flag}={value}"))
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{flag} {value}: {err}");
    }
}

#[test]
fn memory_format_and_depth_reach_the_session() {
    let dir = tempfile::tempdir().unwrap();
    let run = |fmt: &str, name: &str| {
        let out = dir.path().join(name);
        envace()
            .args([
                "run",
                "--env",
                "retail",
                "--task",
                "retail-test-0001",
                "--mode",
                "shadow",
                "--rehearsals",
                "2",
                "--rehearse-on",
                "every",
                "--memory-format",
                fmt,
                "--rehearsal-depth",
                "1",
                "--rehearsal-temperature",
                "0.5",
                "--rehearsal-explore",
                "0.9",
                "--rehearsal-recall",
                "false",
                "--out",
            ])
            .arg(&out)
            .args(["--json"])
            .assert()
            // 0 or 1: the episode was played (1: it did not succeed).
            .code(&[0, 1][..]);
        std::fs::read_to_string(out).unwrap()
    };
    let full = run("full", "full.jsonl");
    let header: serde_json::Value = serde_json::from_str(full.lines().next().unwrap()).unwrap();
    let pr = &header["config"]["mode"]["private_rehearsal"];
    assert_eq!(pr["memory"]["format"], "full", "{pr}");
    assert_eq!(pr["depth"]["turns"], 1, "{pr}");
    assert_eq!(pr["sampling"]["temperature"], 0.5, "{pr}");
    assert_eq!(pr["explore_temperature"], 0.9, "{pr}");
    assert_eq!(pr["recall_errors"], false, "{pr}");
    assert!(
        full.contains("\"type\":\"rehearsal_memory\",\"text\":\"Attempt 1"),
        "full memory format"
    );
    let json = run("json", "json.jsonl");
    assert!(
        json.contains("\"type\":\"rehearsal_memory\",\"text\":\"["),
        "json memory format"
    );
}

#[test]
fn pretrain_fractions_out_of_range_name_the_flag() {
    for flag in [
        "--memory-fraction",
        "--slip-fraction",
        "--recorded-fraction",
    ] {
        let out = envace()
            .args([
                "pretrain",
                "--out",
                "/nonexistent/never-written",
                "--dry-run",
                flag,
                "1.5",
            ])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(flag) && err.contains("between 0 and 1"),
            "{err}"
        );
    }
}
