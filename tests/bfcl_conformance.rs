//! envace's BFCL-v4 checker against the official one (PyPI bfcl-eval 2026.3.23, fetched with the
//! data by scripts/fetch-bfcl into .cache/bfcl) through scripts/bfcl-conformance, and the live
//! `eval bfcl --model` path on the SmolLM2 GGUF fixture (scripts/fetch-fixtures). A missing
//! fixture fails the test, naming it.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use envace::env::bfcl::load_responses;
use envace::env::cli::{BfclEvalArgs, eval_bfcl};
use serde_json::Value;

const CATEGORIES: [&str; 6] = [
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "irrelevance",
    "live_simple",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(rel: &str, fetch: &str) -> PathBuf {
    let p = root().join(rel);
    assert!(p.exists(), "missing fixture {}: run {fetch}", p.display());
    p
}

fn bfcl_data() -> PathBuf {
    fixture(".cache/bfcl/data", "scripts/fetch-bfcl")
}

/// Run the conformance script (`--mutations` adds 14 mutated answer sets per category to the
/// ground-truth answers) and return its JSON report and exit status.
fn conformance(extra: &[&str]) -> (Value, i32) {
    let python = fixture(".cache/bfcl/venv/bin/python", "scripts/fetch-bfcl");
    let out = Command::new(python)
        .arg(root().join("scripts/bfcl-conformance"))
        .arg("--data")
        .arg(bfcl_data())
        .args(["--envace", env!("CARGO_BIN_EXE_envace"), "--json"])
        .args(extra)
        .output()
        .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (report, out.status.code().unwrap_or(-1))
}

fn defect_ids(report: &Value) -> HashSet<String> {
    report["data_defects"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn ground_truth_answers_get_the_official_verdict_in_all_six_categories() {
    let (report, status) = conformance(&["--mutations"]);
    let defects = defect_ids(&report);
    let unexplained: Vec<&Value> = report["disagreements"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| !defects.contains(d["id"].as_str().unwrap()))
        .collect();
    assert!(
        unexplained.is_empty(),
        "envace and the official checker disagree: {unexplained:#?}"
    );
    assert_eq!(status, 0);
    for c in CATEGORIES {
        let row = &report["categories"][c];
        let scored = row["ground_truth"]["scored"].as_u64().unwrap();
        assert!(scored >= 200, "{c}: {row}");
        assert!(row["mutations"]["scored"].as_u64().unwrap() > scored, "{c}");
        // Every ground-truth answer passes both checkers, except where the data is defective.
        let passed = row["ground_truth"]["passed"]["envace"].as_u64().unwrap();
        let defective = defects
            .iter()
            .filter(|id| id.starts_with(&format!("{c}_")))
            .count() as u64;
        assert!(passed + defective >= scored, "{c}: {row}");
    }
}

#[test]
fn data_defects_are_the_ones_documented() {
    let (report, _) = conformance(&[]);
    let docs = std::fs::read_to_string(root().join("docs/BFCL.md")).unwrap();
    let mut ids: Vec<String> = defect_ids(&report).into_iter().collect();
    ids.sort();
    for id in &ids {
        assert!(
            docs.contains(id.as_str()),
            "docs/BFCL.md does not list {id}"
        );
    }
    assert_eq!(ids.len(), 13, "{ids:?}");
}

/// `envace eval bfcl`'s flags, parsed as the binary parses them.
#[derive(Parser)]
struct EvalBfcl {
    #[command(flatten)]
    args: BfclEvalArgs,
}

#[test]
fn model_answers_are_written_one_line_per_entry_and_scored() {
    let gguf = fixture(
        ".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "scripts/fetch-fixtures",
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("responses.jsonl");
    let cli = EvalBfcl::try_parse_from([
        Path::new("eval-bfcl"),
        Path::new("--data"),
        &bfcl_data(),
        Path::new("--category"),
        Path::new("simple_python"),
        Path::new("--model"),
        &gguf,
        Path::new("--limit"),
        Path::new("3"),
        Path::new("--device"),
        Path::new("cpu"),
        Path::new("--out"),
        &out,
        Path::new("--json"),
    ])
    .unwrap();
    let v = eval_bfcl(&cli.args, &envace::engine::bfcl_eval::load_responder).unwrap();
    assert_eq!(v["total"], 3, "{v}");
    let accuracy = v["accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&accuracy), "{v}");
    assert_eq!(v["results"].as_array().unwrap().len(), 3);

    let text = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<&str> = lines.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        ["simple_python_0", "simple_python_1", "simple_python_2"]
    );
    for l in &lines {
        assert!(l["calls"].is_array() && l["raw"].is_string(), "{l}");
    }
    // The file is what `--responses` reads, and scores the same.
    assert_eq!(load_responses(&out).unwrap().len(), 3);
    let again = EvalBfcl::try_parse_from([
        Path::new("eval-bfcl"),
        Path::new("--data"),
        &bfcl_data(),
        Path::new("--category"),
        Path::new("simple_python"),
        Path::new("--limit"),
        Path::new("3"),
        Path::new("--responses"),
        &out,
    ])
    .unwrap();
    let no_model: envace::env::cli::BfclModelLoader<'_, anyhow::Error> =
        &|_, _, _| anyhow::bail!("no model needed");
    let w = eval_bfcl(&again.args, no_model).unwrap();
    assert_eq!(
        (&w["correct"], &w["results"]),
        (&v["correct"], &v["results"])
    );
}

#[test]
fn responses_and_model_are_mutually_exclusive_and_one_is_required() {
    let base = ["eval-bfcl", "--data", "d", "--category", "simple_python"];
    assert!(EvalBfcl::try_parse_from(base).is_err());
    let both = [&base[..], &["--responses", "r", "--model", "m"]].concat();
    assert!(EvalBfcl::try_parse_from(both).is_err());
}

#[test]
fn out_without_model_is_refused() {
    let cli = EvalBfcl::try_parse_from([
        "eval-bfcl",
        "--data",
        "d",
        "--category",
        "simple_python",
        "--responses",
        "r",
        "--out",
        "o",
    ])
    .unwrap();
    let no_model: envace::env::cli::BfclModelLoader<'_, anyhow::Error> =
        &|_, _, _| anyhow::bail!("no model needed");
    let e = eval_bfcl(&cli.args, no_model).unwrap_err().to_string();
    assert!(e.contains("--out"), "{e}");
}

#[test]
fn two_answers_for_one_entry_are_refused_naming_both_files() {
    let python = fixture(".cache/bfcl/venv/bin/python", "scripts/fetch-bfcl");
    let tmp = tempfile::tempdir().unwrap();
    let line = r#"{"id":"irrelevance_0","calls":[]}"#;
    let (a, b) = (tmp.path().join("a.jsonl"), tmp.path().join("b.jsonl"));
    std::fs::write(&a, format!("{line}\n")).unwrap();
    std::fs::write(&b, format!("{line}\n")).unwrap();
    let out = Command::new(python)
        .arg(root().join("scripts/bfcl-conformance"))
        .arg("--data")
        .arg(bfcl_data())
        .args([
            "--envace",
            env!("CARGO_BIN_EXE_envace"),
            "--no-ground-truth",
        ])
        .arg("--responses")
        .arg(&a)
        .arg("--responses")
        .arg(&b)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("irrelevance_0") && err.contains("a.jsonl") && err.contains("b.jsonl"),
        "{err}"
    );
}
