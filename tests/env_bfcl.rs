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

/// One simple entry with one function whose parameters are `props`, and its ground truth.
fn entry(props: Value, truth: Value) -> envace::env::bfcl::BfclEntry {
    serde_json::from_value(serde_json::json!({
        "id": "simple_python_9",
        "question": [[{"role": "user", "content": "?"}]],
        "function": [{"name": "f", "description": "", "parameters":
            {"type": "dict", "properties": props, "required": []}}],
        "ground_truth": [{"f": truth}],
    }))
    .unwrap()
}

/// The official verdict rules, one call each (`ast_checker.py`, bfcl-eval 2026.3.23).
fn verdict(props: Value, truth: Value, args: Value) -> Result<(), String> {
    let e = entry(props, truth);
    let call = envace::message::ToolCall {
        name: "f".into(),
        arguments: args,
    };
    envace::env::bfcl::check_entry(&e, CheckMode::Simple, &[call])
}

#[test]
fn ints_inside_a_float_list_are_rejected_though_a_bare_int_is_a_float() {
    use serde_json::json;
    let props =
        json!({"xs": {"type": "array", "items": {"type": "float"}}, "y": {"type": "float"}});
    let truth = json!({"xs": [[1.0, 2.0]], "y": [3.0]});
    assert!(
        verdict(
            props.clone(),
            truth.clone(),
            json!({"xs": [1.0, 2.0], "y": 3})
        )
        .is_ok()
    );
    let e = verdict(props, truth, json!({"xs": [1, 2], "y": 3.0})).unwrap_err();
    assert!(e.contains("wrong type"), "{e}");
}

#[test]
fn types_are_checked_one_level_deep_and_values_compare_as_python_does() {
    use serde_json::json;
    let props =
        json!({"t": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}});
    // 10.0 == 10 in Python, and the inner lists' items are not type-checked.
    let ok = verdict(
        props,
        json!({"t": [[[10, 20]]]}),
        json!({"t": [[10.0, 20.0]]}),
    );
    assert!(ok.is_ok(), "{ok:?}");
    let props = json!({"d": {"type": "dict", "properties": {}}});
    // True == 1 in Python, inside an allowed dict too.
    let ok = verdict(
        props,
        json!({"d": [{"on": [true]}]}),
        json!({"d": {"on": 1}}),
    );
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn strings_are_normalised_at_the_top_only_and_quotes_count_as_equal() {
    use serde_json::json;
    let props = json!({"s": {"type": "string"}, "l": {"type": "array", "items": {"type": "array", "items": {"type": "string"}}}});
    let truth = json!({"s": ["del 'a.txt'"], "l": ["", [["A b"]]]});
    assert!(verdict(props.clone(), truth.clone(), json!({"s": "DEL \"A.TXT\""})).is_ok());
    let e = verdict(props, truth, json!({"s": "del 'a.txt'", "l": [["a b"]]})).unwrap_err();
    assert!(e.contains("not an allowed value"), "{e}");
}

#[test]
fn a_value_of_the_ground_truths_type_is_a_variable_compared_as_it_is() {
    use serde_json::json;
    let props =
        json!({"when": {"type": "string"}, "xs": {"type": "array", "items": {"type": "integer"}}});
    // BFCL allows null for an optional string whose default is null.
    let truth = json!({"when": ["", null], "xs": ["data['x']"]});
    assert!(
        verdict(
            props.clone(),
            truth.clone(),
            json!({"when": null, "xs": "data['x']"})
        )
        .is_ok()
    );
    // A variable is not normalised.
    let e = verdict(props, truth, json!({"xs": "DATA['x']"})).unwrap_err();
    assert!(e.contains("not an allowed value"), "{e}");
}

#[test]
fn an_empty_list_matches_an_optional_lists_omit_marker() {
    use serde_json::json;
    let props = json!({"xs": {"type": "array", "items": {"type": "string"}}});
    assert!(verdict(props, json!({"xs": [["a"], ""]}), json!({"xs": []})).is_ok());
}

#[test]
fn simple_entries_are_checked_against_the_first_function() {
    use serde_json::json;
    let mut e = entry(json!({}), json!({}));
    e.function.insert(
        0,
        json!({"name": "g", "parameters": {"type": "dict", "properties": {}, "required": []}}),
    );
    let call = envace::message::ToolCall {
        name: "f".into(),
        arguments: json!({}),
    };
    let err = envace::env::bfcl::check_entry(&e, CheckMode::Simple, &[call]).unwrap_err();
    assert!(err.contains("want g"), "{err}");
}

#[test]
fn responses_round_trip_through_the_one_writer_and_reader() {
    use envace::env::bfcl::{BfclResponse, write_response};
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("r.jsonl");
    let rs = vec![
        BfclResponse {
            id: "a".into(),
            calls: vec![envace::message::ToolCall {
                name: "f".into(),
                arguments: serde_json::json!({"x": [1, "y"]}),
            }],
            raw: Some("<tool_call>…</tool_call>".into()),
        },
        BfclResponse {
            id: "b".into(),
            calls: vec![],
            raw: None,
        },
    ];
    let mut f = std::fs::File::create(&p).unwrap();
    for r in &rs {
        write_response(&mut f, &p, r).unwrap();
    }
    let back = load_responses(&p).unwrap();
    assert_eq!(back["a"], rs[0].calls);
    assert!(back["b"].is_empty());
    let text = std::fs::read_to_string(&p).unwrap();
    assert!(text.lines().next().unwrap().contains("\"raw\""));
    assert!(!text.lines().nth(1).unwrap().contains("raw"));
}
