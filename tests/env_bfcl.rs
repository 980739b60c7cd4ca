//! The BFCL-v4 single-turn loader and AST checker on small fixtures written in BFCL's format,
//! through the library and through `envace eval bfcl`.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

use envace::env::bfcl::{CheckMode, evaluate_files, load_category, load_responses, standardize};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/bfcl")
}

fn report(category: &str, responses: &str) -> envace::env::bfcl::BfclReport {
    evaluate_files(&dir(), category, &dir().join(responses)).unwrap()
}

fn error_of(r: &envace::env::bfcl::BfclReport, id: &str) -> String {
    r.results
        .iter()
        .find(|x| x.id == id)
        .and_then(|x| x.error.clone())
        .unwrap_or_default()
}

#[test]
fn simple_accepts_omitted_optionals_int_for_float_and_normalised_strings() {
    let r = report("simple_python", "responses_simple.jsonl");
    assert_eq!((r.correct, r.total), (2, 3), "{:?}", r.results);
    assert!(r.results[0].correct && r.results[1].correct);
    assert!(
        error_of(&r, "simple_python_2").contains("wrong type"),
        "{:?}",
        r.results
    );
}

#[test]
fn multiple_rejects_unknown_parameters() {
    let r = report("multiple", "responses_multiple.jsonl");
    assert_eq!((r.correct, r.total), (1, 2));
    assert!(error_of(&r, "multiple_1").contains("unexpected parameter `color`"));
}

#[test]
fn parallel_matches_order_free_and_counts_calls() {
    let r = report("parallel", "responses_parallel.jsonl");
    assert_eq!((r.correct, r.total), (1, 2));
    assert!(error_of(&r, "parallel_1").contains("expected 2 calls"));
}

#[test]
fn irrelevance_passes_only_without_calls() {
    let r = report("irrelevance", "responses_irrelevance.jsonl");
    assert_eq!((r.correct, r.total), (1, 2));
    assert!((r.accuracy() - 0.5).abs() < 1e-9);
}

#[test]
fn missing_response_counts_as_wrong() {
    let entries = load_category(&dir(), "simple_python").unwrap();
    let r = envace::env::bfcl::evaluate(&entries, "simple_python", &Default::default());
    assert_eq!((r.correct, r.total), (0, 3));
    assert_eq!(error_of(&r, "simple_python_0"), "no response");
}

#[test]
fn loader_exposes_tools_and_user_messages() {
    let entries = load_category(&dir(), "multiple").unwrap();
    let tools = entries[0].tools();
    assert_eq!(tools.len(), 2);
    assert_eq!(tools[0].input_schema["type"], "object");
    assert_eq!(
        entries[0].user_messages(),
        vec!["Weather in New York?".to_string()]
    );
    assert_eq!(
        CheckMode::for_category("live_parallel_multiple"),
        CheckMode::Parallel
    );
    assert_eq!(
        CheckMode::for_category("live_irrelevance"),
        CheckMode::Irrelevance
    );
    assert_eq!(
        CheckMode::for_category("live_relevance"),
        CheckMode::Relevance
    );
    assert_eq!(
        CheckMode::for_category("live_multiple"),
        CheckMode::Multiple
    );
    assert_eq!(CheckMode::for_category("simple_java"), CheckMode::Simple);
    assert_eq!(standardize("New York, N.Y."), "newyorkny");
}

#[test]
fn malformed_files_are_errors_with_path_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("r.jsonl");
    std::fs::write(&p, "{\"id\": \"a\", \"calls\": []}\nnot json\n").unwrap();
    let e = load_responses(&p).unwrap_err().to_string();
    assert!(e.contains("r.jsonl:2"), "{e}");
    let e = load_category(tmp.path(), "simple_python")
        .unwrap_err()
        .to_string();
    assert!(e.contains("BFCL_v4_simple_python.json"), "{e}");
}

#[test]
fn cli_eval_bfcl_prints_accuracy_correct_total() {
    let out = Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(["eval", "bfcl", "--data"])
        .arg(dir())
        .args(["--category", "simple_python", "--responses"])
        .arg(dir().join("responses_simple.jsonl"))
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["correct"], 2);
    assert_eq!(v["total"], 3);
    assert!((v["accuracy"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-9);
    let out = Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(["eval", "bfcl", "--data"])
        .arg(dir())
        .args(["--category", "parallel", "--responses"])
        .arg(dir().join("responses_parallel.jsonl"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("accuracy: 0.5000")
            && text.contains("correct: 1")
            && text.contains("total: 2"),
        "{text}"
    );
}
