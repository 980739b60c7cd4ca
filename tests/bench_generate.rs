//! `envace bench generate` at short prompts (it used to index past a prompt shorter than 72
//! tokens), its decode-at-depth, rehearsal and contended-decode keys (with the competing
//! process it starts and stops), and its batch of prompts of different lengths.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

use envace::runtime::bench::batch_prompts;

/// Run the built `envace` from the repository root.
fn envace(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_envace"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn bench_generate_runs_at_short_prompts() {
    for prompt in ["1", "5", "40"] {
        let o = envace(&[
            "bench",
            "generate",
            "--model",
            "models/envace-tiny",
            "--prompt-tokens",
            prompt,
            "--new-tokens",
            "4",
            "--runs",
            "1",
            "--depths",
            "0,7",
            "--rehearsal-task",
            "none",
            "--contend",
            "0",
            "--json",
        ]);
        assert!(
            o.status.success(),
            "{prompt}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for k in [
            "prefill_tok_s",
            "decode_tok_s",
            "decode_tok_s_b8",
            "branch_ratio_k8",
        ] {
            assert!(v[k].as_f64().unwrap() > 0.0, "{prompt}: {k} in {v}");
        }
        // The process's peak memory: at least the bundled model's 18 MB of f32 weights.
        if cfg!(target_os = "linux") {
            assert!(v["peak_rss_mb"].as_f64().unwrap() > 18.0, "{prompt}: {v}");
        }
        let at = v["decode_tok_s_at"].as_object().unwrap();
        assert_eq!(at.keys().collect::<Vec<_>>(), ["0", "7"], "{v}");
        assert!(at.values().all(|x| x.as_f64().unwrap() > 0.0), "{v}");
        assert!(v["rehearsal_ms"].is_null(), "skipped: {v}");
        assert!(v["decode_tok_s_contended"].is_null(), "skipped: {v}");
        assert_eq!(v["contend_threads"], 0, "{v}");
    }
    // One new token needs no forward pass: nothing to time.
    let o = envace(&[
        "bench",
        "generate",
        "--model",
        "models/envace-tiny",
        "--new-tokens",
        "1",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--new-tokens"));
    let o = envace(&[
        "bench",
        "generate",
        "--model",
        "models/envace-tiny",
        "--prompt-tokens",
        "0",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--prompt-tokens"));
}

/// `rehearsal_ms` times a real Private Rehearsal: the bundled model's bank-test-0007 reaches
/// its irreversible `transfer` and rehearses it.
#[test]
fn bench_generate_times_one_private_rehearsal() {
    let o = envace(&[
        "bench",
        "generate",
        "--model",
        "models/envace-tiny",
        "--prompt-tokens",
        "16",
        "--new-tokens",
        "4",
        "--runs",
        "1",
        "--depths",
        "0",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ms = v["rehearsal_ms"].as_f64().unwrap_or_else(|| panic!("{v}"));
    assert!(ms > 0.0 && ms < 600_000.0, "{v}");
    let o = envace(&[
        "bench",
        "generate",
        "--model",
        "models/envace-tiny",
        "--rehearsal-task",
        "bank-nope",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--rehearsal-task"));
}

#[test]
fn the_batch_rows_differ_in_length_and_the_longest_is_the_whole_prompt() {
    let prompt: Vec<u32> = (0..512).collect();
    let rows = batch_prompts(&prompt);
    assert_eq!(rows.len(), 8);
    assert_eq!(rows[0], prompt);
    let lens: Vec<usize> = rows.iter().map(Vec::len).collect();
    assert!(lens.windows(2).all(|w| w[0] > w[1]), "{lens:?}");
    assert!(rows.iter().all(|r| prompt.starts_with(r)));
    assert!(batch_prompts(&[7]).iter().all(|r| r == &[7]));
}

/// Command lines of running `envace bench spin --threads <threads>` processes.
fn spinners(threads: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args
            .windows(3)
            .any(|w| w[0] == "spin" && w[1] == "--threads" && w[2] == threads)
        {
            found.push(args.join(" "));
        }
    }
    found
}

#[test]
fn contended_decode_runs_beside_a_competing_process_and_stops_it() {
    let o = envace(&[
        "bench",
        "generate",
        "--model",
        "models/envace-tiny",
        "--prompt-tokens",
        "16",
        "--new-tokens",
        "8",
        "--runs",
        "1",
        "--depths",
        "0",
        "--rehearsal-task",
        "none",
        "--contend",
        "3",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["contend_threads"], 3, "{v}");
    let quiet = v["decode_tok_s"].as_f64().unwrap();
    let busy = v["decode_tok_s_contended"].as_f64().unwrap();
    let ratio = v["contended_ratio"].as_f64().unwrap();
    assert!(busy > 0.0, "{v}");
    assert!((ratio - busy / quiet).abs() < 1e-9, "{v}");
    // The competitor is gone with the bench.
    assert!(
        spinners("3").is_empty(),
        "left running: {:?}",
        spinners("3")
    );
}

#[test]
fn spin_ends_when_its_input_closes() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(["bench", "spin", "--threads", "1"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"anything").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(
        child.try_wait().unwrap().is_none(),
        "ended while its input was open"
    );
    drop(stdin);
    let t = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "{status}");
            break;
        }
        assert!(
            t.elapsed().as_secs() < 10,
            "still spinning 10 s after its input closed"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn a_competing_process_of_more_than_256_threads_is_refused() {
    let o = envace(&[
        "bench",
        "generate",
        "--model",
        "models/envace-tiny",
        "--contend",
        "100000",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--contend") && err.contains("256"), "{err}");
}
