//! `envace export --format verl`: built-in tasks and real session fixtures written as parquet,
//! read back with the `parquet` crate's row reader (values checked, and equal to the JSON copy),
//! then with pyarrow, pandas and HF datasets through scripts/check-verl-parquet (its venv,
//! .cache/verl-venv, is built by `scripts/check-verl-parquet --setup`; a missing venv fails the
//! test, naming that command).

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;

use envace::engine::prompts::tools_json;
use envace::engine::spec::domain_system;
use envace::env::domains::Domain;
use envace::env::tasks::{Split, Task, list_tasks};
use envace::export::{
    ExportError, VerlRow, reference_checklist, rows_from_sessions, rows_from_tasks, write_json,
    write_parquet,
};
use envace::session::format::GenRole;
use envace::session::{EventBody, read_session};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;
use serde_json::{Value, json};

const COLUMNS: [&str; 8] = [
    "data_source",
    "prompt",
    "ability",
    "reward_model",
    "extra_info",
    "uuid",
    "messages",
    "checklists",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn real_session() -> PathBuf {
    root().join("tests/fixtures/sessions/v1-bank-test-0004-shadow-pr2.jsonl")
}

fn field_json(f: &Field) -> Value {
    match f {
        Field::Null => Value::Null,
        Field::Bool(b) => json!(b),
        Field::Long(x) => json!(x),
        Field::Double(x) => json!(x),
        Field::Float(x) => json!(x),
        Field::Str(s) => json!(s),
        Field::ListInternal(l) => Value::Array(l.elements().iter().map(field_json).collect()),
        Field::Group(r) => Value::Object(
            r.get_column_iter()
                .map(|(k, v)| (k.clone(), field_json(v)))
                .collect(),
        ),
        other => panic!("unexpected parquet field {other:?}"),
    }
}

/// The file's rows through the parquet crate's row API, each as a JSON object, and the column
/// names.
fn read_parquet(path: &Path) -> (Vec<String>, Vec<Value>) {
    let r = SerializedFileReader::new(File::open(path).unwrap()).unwrap();
    let names = r
        .metadata()
        .file_metadata()
        .schema()
        .get_fields()
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    let rows = r
        .get_row_iter(None)
        .unwrap()
        .map(|row| field_json(&Field::Group(row.unwrap())))
        .collect();
    (names, rows)
}

fn read_json(path: &Path) -> Vec<Value> {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn task_rows_read_back_with_the_actor_prompt_tools_and_checklist() {
    let rows = rows_from_tasks(Domain::Bank, Split::Train, Some(5)).unwrap();
    assert_eq!(rows.len(), 5);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bank-train.parquet");
    write_parquet(&rows, &path).unwrap();
    let (names, back) = read_parquet(&path);
    assert_eq!(names, COLUMNS);
    assert_eq!(back.len(), 5);
    let tasks: Vec<&Task> = list_tasks(Domain::Bank, Some(Split::Train));
    let tools = Value::Array(tools_json(&Domain::Bank.tools()));
    for (i, (r, task)) in back.iter().zip(&tasks).enumerate() {
        assert_eq!(r["data_source"], "envace_bank");
        assert_eq!(r["ability"], "agent");
        assert_eq!(r["uuid"], task.id.as_str());
        // The prompt the engine gives the actor: the domain's system prompt, the first user turn.
        assert_eq!(
            r["prompt"],
            json!([
                {"role": "system", "content": domain_system(Domain::Bank), "tool_calls": [], "tool_call_id": null},
                {"role": "user", "content": task.turns[0].user, "tool_calls": [], "tool_call_id": null},
            ])
        );
        assert_eq!(r["messages"], r["prompt"]);
        let x = &r["extra_info"];
        assert_eq!(x["index"], i);
        assert_eq!(x["split"], "train");
        assert_eq!(x["original_index"], task.id.as_str());
        assert_eq!(x["role"], "actor");
        assert_eq!(x["need_tools_kwargs"], true);
        assert_eq!(x["task_id"], task.id.as_str());
        assert_eq!(x["reward"], Value::Null);
        assert_eq!(x["prompt_ids"], Value::Null);
        // Tools as a JSON string (as the reference stores them).
        let t: Value = serde_json::from_str(x["tools"].as_str().unwrap()).unwrap();
        assert_eq!(t, tools);
        // The gold conversation: every user turn, every gold call with arguments as a string.
        let users: Vec<&str> = x["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "user")
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        assert_eq!(users, task.user_turns());
        let calls: Vec<(String, Value)> = x["messages"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|m| m["tool_calls"].as_array().unwrap().clone())
            .map(|c| {
                (
                    c["function"]["name"].as_str().unwrap().to_string(),
                    serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap(),
                )
            })
            .collect();
        let gold: Vec<(String, Value)> = task
            .gold_actions()
            .into_iter()
            .map(|c| (c.name, c.arguments))
            .collect();
        assert_eq!(calls, gold);
        // The judge checklist, twice (the reference's top-level copy and interaction_kwargs).
        let ik = &x["interaction_kwargs"];
        assert_eq!(ik["name"], "checklist");
        assert_eq!(
            ik["checklist_list"],
            serde_json::to_value(vec![reference_checklist(task)]).unwrap()
        );
        assert_eq!(r["checklists"], ik["checklist_list"]);
        // Ground truth: the task itself.
        assert_eq!(r["reward_model"]["style"], "rule");
        let gt: Task =
            serde_json::from_str(r["reward_model"]["ground_truth"].as_str().unwrap()).unwrap();
        assert_eq!(&gt, *task);
    }
}

#[test]
fn parquet_and_json_copies_hold_the_same_rows() {
    let mut rows = rows_from_tasks(Domain::Travel, Split::Test, Some(3)).unwrap();
    rows.extend(rows_from_sessions(&[real_session()], true).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let pq = dir.path().join("rows.parquet");
    let js = dir.path().join("rows.json");
    write_parquet(&rows, &pq).unwrap();
    write_json(&rows, &js).unwrap();
    let (_, back) = read_parquet(&pq);
    let json = read_json(&js);
    assert_eq!(back.len(), json.len());
    for (i, (a, b)) in back.iter().zip(&json).enumerate() {
        if let Some(path) = first_difference(a, b, String::new()) {
            panic!("row {i}: parquet and JSON differ at {path}");
        }
    }
}

/// The path of the first place where two JSON values differ. Floats may differ in the last bit:
/// serde_json parses them fast, not exactly (no `float_roundtrip`); Python's json.load, which
/// the reference reads the file with, is exact, and scripts/check-verl-parquet compares exactly.
fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            if x.keys().ne(y.keys()) {
                return Some(format!("{at}: keys {:?} vs {:?}", x.keys(), y.keys()));
            }
            x.iter()
                .find_map(|(k, v)| first_difference(v, &y[k], format!("{at}.{k}")))
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(v, w, format!("{at}[{i}]"))),
        (Value::Number(x), Value::Number(y)) if x.is_f64() || y.is_f64() => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            ((x - y).abs() > 1e-15 * x.abs().max(1.0)).then(|| format!("{at}: {x} vs {y}"))
        }
        _ => (a != b).then(|| format!("{at}: {a} vs {b}")),
    }
}

#[test]
fn limit_caps_the_rows_and_the_test_split_is_labelled() {
    let rows = rows_from_tasks(Domain::Retail, Split::Test, Some(2)).unwrap();
    assert_eq!(rows.len(), 2);
    assert!(
        rows.iter()
            .all(|r| r.extra_info.split.as_deref() == Some("test"))
    );
    let all = rows_from_tasks(Domain::Retail, Split::Test, None).unwrap();
    assert_eq!(
        all.len(),
        list_tasks(Domain::Retail, Some(Split::Test)).len()
    );
}

/// The main-line generations of the fixture, in order: (seq, role, prompt ids, loss mask).
fn main_line_generations(path: &Path) -> Vec<(u64, GenRole, Vec<u32>, Vec<u8>)> {
    read_session(path)
        .unwrap()
        .events
        .iter()
        .filter_map(|e| match &e.event {
            EventBody::Generation(g) if g.branch.is_none() => {
                Some((e.seq, g.role, g.prompt_ids.clone(), g.loss_mask.clone()))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn session_rows_keep_role_reward_and_token_ids_of_main_line_generations() {
    let path = real_session();
    let actor_only = rows_from_sessions(std::slice::from_ref(&path), false).unwrap();
    let both = rows_from_sessions(std::slice::from_ref(&path), true).unwrap();
    let gens = main_line_generations(&path);
    let actors = gens.iter().filter(|g| g.1 == GenRole::Actor).count();
    assert_eq!(actor_only.len(), actors);
    assert_eq!(both.len(), gens.len());
    assert!(both.iter().any(|r| r.extra_info.role == GenRole::Simulator));

    let dir = tempfile::tempdir().unwrap();
    let pq = dir.path().join("sessions.parquet");
    write_parquet(&both, &pq).unwrap();
    let (_, back) = read_parquet(&pq);
    let file = path.file_name().unwrap().to_str().unwrap();
    for (i, (r, (seq, role, prompt_ids, mask))) in back.iter().zip(&gens).enumerate() {
        let x = &r["extra_info"];
        assert_eq!(x["index"], i);
        assert_eq!(
            x["role"],
            if *role == GenRole::Actor {
                "actor"
            } else {
                "simulator"
            }
        );
        assert_eq!(x["session"], file);
        assert_eq!(x["seq"], *seq);
        assert_eq!(r["uuid"], format!("{file}#{seq}"));
        assert_eq!(x["prompt_ids"], json!(prompt_ids));
        assert_eq!(x["loss_mask"], json!(mask));
        assert_eq!(
            x["response_ids"].as_array().unwrap().len(),
            mask.len(),
            "row {i}"
        );
        // The fixture's episode was scored 0 (the shadow run's real transfer failed once).
        assert_eq!(x["reward"], 0.0);
        assert_eq!(x["task_id"], "bank-test-0004");
        assert_eq!(x["split"], "test");
        assert_eq!(r["data_source"], "envace_bank");
        assert!(r["reward_model"]["ground_truth"].is_string());
        assert_eq!(r["checklists"].as_array().unwrap().len(), 1);
        let tools: Vec<Value> = serde_json::from_str(x["tools"].as_str().unwrap()).unwrap();
        match role {
            // The actor is prompted with the conversation and the tools; the simulator with
            // its own prompt and no tools.
            GenRole::Actor => {
                assert!(!tools.is_empty());
                assert_eq!(r["prompt"][0]["role"], "system");
            }
            GenRole::Simulator => {
                assert!(tools.is_empty());
                assert!(x["call_id"].is_string());
                assert!(
                    x["response"]
                        .as_str()
                        .unwrap()
                        .starts_with("<execution_result>")
                );
            }
        }
    }
    // The whole main-line conversation rides along (the reference's extra_info.messages).
    let convo = back[0]["extra_info"]["messages"].as_array().unwrap();
    assert_eq!(
        convo.last().unwrap()["content"],
        "Done. Sent 291 to the acc_516."
    );
}

#[test]
fn format_v2_fixture_exports_its_main_line_simulator_generations_only() {
    let path = root().join("tests/fixtures/sessions/format-v2.jsonl");
    let rows = rows_from_sessions(std::slice::from_ref(&path), true).unwrap();
    // Its actor generation belongs to rehearsal branch 1: left out.
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.extra_info.role == GenRole::Simulator));
    let dir = tempfile::tempdir().unwrap();
    write_parquet(&rows, &dir.path().join("v2.parquet")).unwrap();
}

#[test]
fn a_loss_mask_shorter_than_the_response_names_the_file_event_and_field() {
    let text = std::fs::read_to_string(real_session()).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let i = lines
        .iter()
        .position(|l| l.contains("\"type\":\"generation\""))
        .unwrap();
    let mut v: Value = serde_json::from_str(&lines[i]).unwrap();
    v["event"]["loss_mask"].as_array_mut().unwrap().pop();
    let seq = v["seq"].as_u64().unwrap();
    lines[i] = v.to_string();
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad-mask.jsonl");
    std::fs::write(&bad, lines.join("\n") + "\n").unwrap();
    let e = rows_from_sessions(&[bad], false).unwrap_err();
    assert!(matches!(e, ExportError::SessionField { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("bad-mask.jsonl"), "{msg}");
    assert!(msg.contains(&format!("event {seq}")), "{msg}");
    assert!(msg.contains("`loss_mask`"), "{msg}");
}

#[test]
fn a_missing_session_file_is_an_error_naming_it() {
    let e = rows_from_sessions(&[PathBuf::from("/nonexistent/s.jsonl")], true).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/s.jsonl"), "{e}");
}

#[test]
fn writing_replaces_the_file_whole_and_leaves_no_temporary() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out/train.parquet");
    let five = rows_from_tasks(Domain::Bank, Split::Train, Some(5)).unwrap();
    write_parquet(&five, &path).unwrap();
    write_parquet(&five[..2], &path).unwrap();
    assert_eq!(read_parquet(&path).1.len(), 2);
    assert!(!dir.path().join("out/train.parquet.tmp").exists());
    // An empty export is a valid file with the schema and no rows.
    let empty: Vec<VerlRow> = Vec::new();
    write_parquet(&empty, &path).unwrap();
    let (names, rows) = read_parquet(&path);
    assert_eq!((names.len(), rows.len()), (COLUMNS.len(), 0));
}

#[test]
fn an_unwritable_path_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, "x").unwrap();
    let path = blocker.join("train.parquet");
    let rows = rows_from_tasks(Domain::Bank, Split::Train, Some(1)).unwrap();
    let e = write_parquet(&rows, &path).unwrap_err();
    assert!(
        e.to_string().contains(&blocker.display().to_string()),
        "{e}"
    );
}

/// pyarrow, pandas and HF datasets read what we wrote: `prompt` a list of dicts with role and
/// content, the reference's columns, every row usable by EnvACE's ChecklistDataset, and the JSON
/// copy equal to the parquet rows.
#[test]
fn python_readers_see_lists_of_dicts_and_the_reference_columns() {
    let script = root().join("scripts/check-verl-parquet");
    let python = root().join(".cache/verl-venv/bin/python");
    assert!(
        python.exists(),
        "missing fixture {}: run scripts/check-verl-parquet --setup",
        python.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let mut all = Vec::new();
    let mut files = Vec::new();
    for (name, rows) in [
        (
            "bank-train.parquet",
            rows_from_tasks(Domain::Bank, Split::Train, Some(20)).unwrap(),
        ),
        (
            "retail-test.parquet",
            rows_from_tasks(Domain::Retail, Split::Test, Some(10)).unwrap(),
        ),
        (
            "travel-test.parquet",
            rows_from_tasks(Domain::Travel, Split::Test, Some(10)).unwrap(),
        ),
        (
            "sessions.parquet",
            rows_from_sessions(&[real_session()], true).unwrap(),
        ),
    ] {
        let p = dir.path().join(name);
        write_parquet(&rows, &p).unwrap();
        files.push(p);
        all.extend(rows);
    }
    let js = dir.path().join("all.json");
    write_json(&all, &js).unwrap();
    let out = Command::new(&python)
        .arg(&script)
        .args(&files)
        .arg("--json")
        .arg(&js)
        .args(["--rows", &all.len().to_string()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}\n{}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("all checks passed"), "{stdout}");
}
