//! Session loading benchmark (`cargo bench --bench read_session`): a ~100 MB synthetic session
//! (the shadow-mode sample repeated, `session::synth`), read whole ([`read_session`]), read
//! progressively with progress reports ([`read_session_with_progress`]), and summarised for the
//! sessions browser ([`summarize`]). Prints MB/s per reader, median of 3 runs after one warm-up
//! read (the file is in the page cache: this measures parsing, not the disk).
//! `ENVACE_BENCH_MB` changes the size.

use std::path::Path;
use std::time::Instant;

use envace::runtime::CancelToken;
use envace::session::synth::synthesize;
use envace::session::{read_session, read_session_with_progress, summarize};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn measure(name: &str, bytes: u64, mut f: impl FnMut()) {
    f();
    let runs: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            f();
            bytes as f64 / 1e6 / t.elapsed().as_secs_f64()
        })
        .collect();
    println!(
        "{{\"reader\":\"{name}\",\"mb\":{:.1},\"mb_per_s\":{:.1},\"runs\":{runs:.1?}}}",
        bytes as f64 / 1e6,
        median(runs.clone())
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mb: u64 = std::env::var("ENVACE_BENCH_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let sample = Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions/bank-shadow-rehearsal.jsonl");
    let template = read_session(&sample)?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("big.jsonl");
    let t = Instant::now();
    let bytes = synthesize(&template, mb * 1_000_000, &path)?;
    eprintln!(
        "synthesized {:.1} MB in {:.1}s",
        bytes as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    measure("read_session", bytes, || {
        let s = read_session(&path).expect("read");
        assert!(!s.events.is_empty());
    });
    measure("read_session_with_progress", bytes, || {
        let mut reports = 0u64;
        let s = read_session_with_progress(&path, &mut |_, _| reports += 1, &CancelToken::new())
            .expect("read");
        assert!(!s.events.is_empty() && reports > 0);
    });
    measure("summarize", bytes, || {
        let s = summarize(&path).expect("summarize");
        assert!(s.events > 0);
    });
    Ok(())
}
