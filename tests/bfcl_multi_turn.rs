//! BFCL-v4 `multi_turn_base` through the official environments and checker
//! (scripts/bfcl-multi-env.py, run with the venv scripts/fetch-bfcl builds): the ground truth
//! replays as correct, a wrong call sequence fails naming its turn, recorded answers score the
//! same when read back, and a live run of the bundled tiny model writes a well-formed responses
//! file. The other multi-turn categories (miss_func, miss_param, long_context): the ground truth
//! replays as correct, the functions offered per turn are the official inference's, and
//! long-context entries load the classes' long-context data. A missing fixture fails the test,
//! naming scripts/fetch-bfcl.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use clap::Parser;
use envace::env::bfcl_multi::{Bridge, load_multi_category, load_multi_responses};
use envace::env::cli::{BfclEvalArgs, BfclModelLoader, eval_bfcl};
use serde_json::{Value, json};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn fixture(rel: &str) -> PathBuf {
    let p = root().join(rel);
    assert!(
        p.exists(),
        "missing fixture {}: run scripts/fetch-bfcl",
        p.display()
    );
    p
}

fn data() -> PathBuf {
    fixture(".cache/bfcl/venv/bin/python");
    fixture(".cache/bfcl/data/multi_turn_func_doc/gorilla_file_system.json");
    fixture(".cache/bfcl/data/BFCL_v4_multi_turn_base.json");
    fixture(".cache/bfcl/data")
}

/// `envace eval bfcl`'s flags, parsed as the binary parses them.
#[derive(Parser)]
struct EvalBfcl {
    #[command(flatten)]
    args: BfclEvalArgs,
}

const OTHER_CATEGORIES: [&str; 3] = [
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
];

fn eval(extra: &[&Path]) -> Value {
    eval_category("multi_turn_base", extra)
}

fn eval_category(category: &str, extra: &[&Path]) -> Value {
    let data = data();
    for c in OTHER_CATEGORIES {
        fixture(&format!(".cache/bfcl/data/BFCL_v4_{c}.json"));
    }
    let mut argv: Vec<&Path> = vec![
        Path::new("eval-bfcl"),
        Path::new("--data"),
        &data,
        Path::new("--category"),
        Path::new(category),
        Path::new("--json"),
    ];
    argv.extend_from_slice(extra);
    let cli = EvalBfcl::try_parse_from(argv).unwrap();
    eval_bfcl(&cli.args, &envace::engine::bfcl_eval::load_responder).unwrap()
}

#[test]
fn ground_truth_of_the_first_20_entries_scores_correct_and_reads_back_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("gt.jsonl");
    let v = eval(&[
        Path::new("--ground-truth"),
        Path::new("--limit"),
        Path::new("20"),
        Path::new("--out"),
        &out,
    ]);
    assert_eq!(
        (&v["correct"], &v["total"]),
        (&json!(20), &json!(20)),
        "{v}"
    );
    assert_eq!(v["accuracy"], 1.0);
    assert_eq!(v["results"].as_array().unwrap().len(), 20);

    // The file is the --responses format: scored again, the same verdicts.
    assert_eq!(load_multi_responses(&out).unwrap().len(), 20);
    let again = eval(&[
        Path::new("--limit"),
        Path::new("20"),
        Path::new("--responses"),
        &out,
    ]);
    assert_eq!(again["results"], v["results"]);
}

#[test]
fn a_wrong_call_sequence_scores_incorrect_naming_the_turn() {
    let data = data();
    let entries = load_multi_category(&data, "multi_turn_base").unwrap();
    let mut bridge = Bridge::spawn(&Bridge::default_python(&data)).unwrap();
    let mut turns: Vec<Vec<Vec<envace::message::ToolCall>>> = bridge
        .ground_truth_calls(&entries[0])
        .unwrap()
        .into_iter()
        .map(|calls| vec![calls])
        .collect();
    assert!(bridge.score(&entries[0], &turns).unwrap().valid);

    // Turn 2 of multi_turn_base_0 sorts final_report.pdf; listing the directory instead leaves
    // the state alone but misses the sorted content.
    turns[2] = vec![vec![envace::message::ToolCall {
        name: "ls".into(),
        arguments: json!({}),
    }]];
    let verdict = bridge.score(&entries[0], &turns).unwrap();
    assert!(!verdict.valid);
    assert_eq!(verdict.turn, Some(2), "{verdict:?}");
    let error = verdict.error().unwrap();
    assert!(error.starts_with("turn 2: multi_turn:"), "{error}");

    // Through the CLI: a responses file with that answer, and an entry with no answer.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("wrong.jsonl");
    std::fs::write(
        &path,
        format!("{}\n", json!({"id": "multi_turn_base_0", "turns": turns})),
    )
    .unwrap();
    let cli = EvalBfcl::try_parse_from([
        Path::new("eval-bfcl"),
        Path::new("--data"),
        &data,
        Path::new("--category"),
        Path::new("multi_turn_base"),
        Path::new("--limit"),
        Path::new("2"),
        Path::new("--responses"),
        &path,
    ])
    .unwrap();
    let no_model: BfclModelLoader<'_, anyhow::Error> = &|_, _, _| anyhow::bail!("no model needed");
    let v = eval_bfcl(&cli.args, no_model).unwrap();
    assert_eq!(v["correct"], 0, "{v}");
    let r = &v["results"];
    assert!(
        r[0]["error"].as_str().unwrap().starts_with("turn 2: "),
        "{r}"
    );
    assert_eq!(r[1]["error"], "no response");
}

#[test]
fn too_few_turns_is_a_forced_termination_and_a_bad_call_is_an_error_result() {
    let data = data();
    let entries = load_multi_category(&data, "multi_turn_base").unwrap();
    let mut bridge = Bridge::spawn(&Bridge::default_python(&data)).unwrap();
    let verdict = bridge.score(&entries[0], &[vec![]]).unwrap();
    assert_eq!(verdict.error_type, "multi_turn:force_terminated");

    // Calls outside the entry's classes are never evaluated: a builtin answers as an unknown
    // name does, a name that is no identifier is a failed call; the calls around them run.
    use envace::env::bfcl_multi::StepExecutor;
    bridge.reset(&entries[0]).unwrap();
    let results = bridge
        .execute(&[
            envace::message::ToolCall {
                name: "cd".into(),
                arguments: json!({"folder": "document"}),
            },
            envace::message::ToolCall {
                name: "open".into(),
                arguments: json!({"file": "x", "mode": "w"}),
            },
            envace::message::ToolCall {
                name: "ls, cd".into(),
                arguments: json!({}),
            },
            envace::message::ToolCall {
                name: "ls".into(),
                arguments: json!({}),
            },
        ])
        .unwrap();
    assert_eq!(
        results,
        [
            r#"{"current_working_directory": "document"}"#,
            "Error during execution: name 'open' is not defined",
            "Error during execution: `ls, cd`: function and argument names must be identifiers",
            r#"{"current_directory_content": ["final_report.pdf", "previous_report.pdf"]}"#,
        ]
    );
}

#[test]
fn tiny_model_runs_two_entries_and_writes_a_well_formed_responses_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny.jsonl");
    let model = root().join("models/envace-tiny");
    let v = eval(&[
        Path::new("--model"),
        &model,
        Path::new("--device"),
        Path::new("cpu"),
        Path::new("--limit"),
        Path::new("2"),
        Path::new("--max-steps"),
        Path::new("2"),
        Path::new("--max-tokens"),
        Path::new("48"),
        Path::new("--out"),
        &out,
    ]);
    assert_eq!(v["total"], 2, "{v}");
    let accuracy = v["accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&accuracy), "{v}");
    assert!(
        v["seconds"].as_f64().is_some() && v["model"].is_string(),
        "{v}"
    );

    let text = std::fs::read_to_string(&out).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<&str> = lines.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["multi_turn_base_0", "multi_turn_base_1"]);
    for l in &lines {
        let turns = l["turns"].as_array().unwrap();
        let raw = l["raw"].as_array().unwrap();
        assert!(!turns.is_empty() && turns.len() == raw.len(), "{l}");
        for (steps, texts) in turns.iter().zip(raw) {
            let steps = steps.as_array().unwrap();
            assert_eq!(steps.len(), texts.as_array().unwrap().len(), "{l}");
            assert!(!steps.is_empty() && steps.len() <= 3, "{l}");
        }
    }
    // Read back, the file scores the same.
    let again = eval(&[
        Path::new("--limit"),
        Path::new("2"),
        Path::new("--responses"),
        &out,
    ]);
    assert_eq!(again["results"], v["results"]);
}

#[test]
fn environment_trait_runs_calls_on_the_official_instances_and_scores_a_trace() {
    use envace::env::bfcl_multi::BfclMultiEnv;
    use envace::env::{Environment, EpisodeTrace, ToolResponse};

    let data = data();
    let entries = load_multi_category(&data, "multi_turn_base").unwrap();
    let mut bridge = Bridge::spawn(&Bridge::default_python(&data)).unwrap();
    let truth = bridge.ground_truth_calls(&entries[0]).unwrap();
    let mut env = BfclMultiEnv::new("multi_turn_base", entries[..2].to_vec(), bridge).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        assert!(env.reset(Some("multi_turn_base_7")).await.is_err());
        env.reset(Some("multi_turn_base_0")).await.unwrap();
        assert_eq!(env.name(), "bfcl:multi_turn_base");
        assert_eq!(env.user_turns().len(), 4);
        let tools = env.tools().await.unwrap();
        assert!(tools.iter().any(|t| t.name == "mv"), "{tools:?}");
        assert!(tools.iter().any(|t| t.name == "post_tweet"), "{tools:?}");

        let before = env.state_hash().await.unwrap();
        let r = env
            .call(&envace::message::ToolCall {
                name: "mkdir".into(),
                arguments: json!({"dir_name": "x"}),
            })
            .await
            .unwrap();
        assert_eq!(
            r,
            ToolResponse::Success {
                value: json!("None")
            }
        );
        assert_ne!(env.state_hash().await.unwrap(), before);
        let snap = env.snapshot().await.unwrap();
        assert!(snap["GorillaFileSystem"]["root"].is_string(), "{snap}");

        // The ground truth as an episode trace scores 1; without its last turn, 0.
        let mut trace = EpisodeTrace {
            finished_normally: true,
            ..EpisodeTrace::default()
        };
        for calls in &truth {
            trace.actions.extend(calls.iter().cloned());
            trace.turn_ends.push(trace.actions.len());
            trace.agent_messages.push("done".into());
        }
        let score = env.score(&trace).await.unwrap();
        assert_eq!(score.reward, 1.0, "{score:?}");
        // Scoring left the live state alone.
        assert_eq!(env.snapshot().await.unwrap(), snap);
        trace.turn_ends.pop();
        let n = trace.turn_ends.last().copied().unwrap();
        trace.actions.truncate(n);
        let score = env.score(&trace).await.unwrap();
        assert_eq!(score.reward, 0.0);
        assert!(
            score.checklist[0].reason.contains("force_terminated"),
            "{score:?}"
        );
    });
}

#[test]
fn other_categories_ground_truth_of_the_first_20_entries_scores_correct() {
    for c in OTHER_CATEGORIES {
        let v = eval_category(
            c,
            &[
                Path::new("--ground-truth"),
                Path::new("--limit"),
                Path::new("20"),
            ],
        );
        assert_eq!(
            (&v["correct"], &v["total"]),
            (&json!(20), &json!(20)),
            "{c}: {v}"
        );
    }
}

#[test]
fn offered_functions_per_turn_are_the_official_inferences_in_every_category() {
    let data = data();
    let mut bridge = Bridge::spawn(&Bridge::default_python(&data)).unwrap();
    let mut held_out_entries = 0;
    for c in std::iter::once("multi_turn_base").chain(OTHER_CATEGORIES) {
        let path = fixture(&format!(".cache/bfcl/data/BFCL_v4_{c}.json"));
        let raw: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let entries = load_multi_category(&data, c).unwrap();
        assert_eq!(entries.len(), raw.len(), "{c}");
        // Every miss_func entry (the only category that holds functions back), 20 of the others.
        let n = if c == "multi_turn_miss_func" {
            raw.len()
        } else {
            20
        };
        for (e, r) in entries.iter().zip(&raw).take(n) {
            let official = bridge.official_functions(r).unwrap();
            assert_eq!(json!(e.functions), official["function"], "{}", e.id);
            let missed = official["missed_function"].as_object().unwrap();
            assert_eq!(missed.len(), e.held_out.len(), "{}", e.id);
            for (turn, docs) in &e.held_out {
                assert_eq!(
                    &json!(docs),
                    &missed[&turn.to_string()],
                    "{} turn {turn}",
                    e.id
                );
                assert_eq!(
                    e.turn_messages(*turn)[0].content,
                    official["additional_functions_prompt"].as_str().unwrap(),
                    "{}",
                    e.id
                );
                // Before its turn the held-out function is not offered; from it on it is.
                let name = docs[0]["name"].as_str().unwrap();
                let offered = |t: usize| e.tools_at(t).iter().any(|s| s.name == name);
                let before = turn.checked_sub(1).is_none_or(|t| !offered(t));
                assert!(before && offered(*turn), "{} {name}", e.id);
            }
            held_out_entries += usize::from(!e.held_out.is_empty());
        }
    }
    assert_eq!(
        held_out_entries, 200,
        "every miss_func entry holds a function back"
    );

    // The Environment trait offers one tool list per episode: miss_func is refused, by name.
    use envace::env::bfcl_multi::BfclMultiEnv;
    let entries = load_multi_category(&data, "multi_turn_miss_func").unwrap();
    let e = BfclMultiEnv::new("multi_turn_miss_func", entries[..1].to_vec(), bridge)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("multi_turn_miss_func_0") && e.contains("eval bfcl"),
        "{e}"
    );
}

#[test]
fn long_context_entries_load_the_long_context_data() {
    let data = data();
    let entries = load_multi_category(&data, "multi_turn_long_context").unwrap();
    let mut bridge = Bridge::spawn(&Bridge::default_python(&data)).unwrap();
    let long = &entries[1];
    assert_eq!(long.involved_classes, ["GorillaFileSystem"]);
    bridge.reset(long).unwrap();
    let with = bridge.state().unwrap().to_string();
    // The same entry under a base id: the executor decides long context from the category.
    let mut short = long.clone();
    short.id = "multi_turn_base_999".into();
    bridge.reset(&short).unwrap();
    let without = bridge.state().unwrap().to_string();
    assert!(
        with.len() > without.len() + 1000,
        "{} vs {}",
        with.len(),
        without.len()
    );
}
