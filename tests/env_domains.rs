//! The built-in domains, their tasks and their scoring, end to end (no mocks): every gold
//! solution scores 1.0, wrong and empty episodes score below 1, bad calls are JSON errors,
//! splits are disjoint, bad task files name file, task and field, and the CLI agrees.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use envace::env::reward::{gold_trace, replay, score_task, state_hash};
use envace::env::tasks::{Split, Task, builtin_tasks, list_tasks, load_task_file, validate_task};
use envace::env::{Domain, DomainEnv, EnvError, Environment, EpisodeTrace, ToolResponse};
use envace::message::ToolCall;
use serde_json::{Value, json};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn call(name: &str, arguments: Value) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments,
    }
}

#[test]
fn every_gold_solution_scores_one_in_every_domain() {
    for d in Domain::ALL {
        let tasks = builtin_tasks(d);
        assert!(tasks.len() >= 500, "{d}: only {} tasks", tasks.len());
        for t in tasks {
            let s = score_task(t, &gold_trace(t)).unwrap();
            assert_eq!(s.reward, 1.0, "{}: {:?}", t.id, s.checklist);
            assert_eq!(s.partial, 1.0, "{}: {:?}", t.id, s.checklist);
            // The JSON round trip validates like a user file would.
            let v = serde_json::to_value(t).unwrap();
            let back = validate_task(&v, 0).unwrap_or_else(|e| panic!("{}: {e:?}", t.id));
            assert_eq!(&back, t);
        }
    }
}

#[test]
fn generator_is_deterministic() {
    for d in Domain::ALL {
        let again = envace::env::tasks::generate_tasks(d, 500, 100);
        assert_eq!(again.as_slice(), builtin_tasks(d));
    }
}

#[test]
fn task_mix_has_multi_step_multi_turn_state_dependent_and_failing_calls() {
    for d in Domain::ALL {
        let tasks = builtin_tasks(d);
        let kinds: BTreeSet<&str> = tasks.iter().map(|t| t.kind.as_str()).collect();
        assert!(kinds.len() >= 8, "{d}: kinds {kinds:?}");
        let single = tasks.iter().filter(|t| t.gold_actions().len() == 1).count();
        let multi = tasks.iter().filter(|t| t.gold_actions().len() >= 2).count();
        let turns = tasks.iter().filter(|t| t.turns.len() >= 2).count();
        let failing = tasks
            .iter()
            .filter(|t| {
                t.turns
                    .iter()
                    .flat_map(|x| &x.actions)
                    .any(|a| a.error.is_some())
            })
            .count();
        for (what, n) in [
            ("single", single),
            ("multi", multi),
            ("multi-turn", turns),
            ("failing", failing),
        ] {
            assert!(n >= 30, "{d}: only {n} {what}-step tasks");
        }
        let gold_errors = tasks
            .iter()
            .flat_map(|t| t.gold_steps().unwrap())
            .filter(|(_, r)| r.is_error())
            .count();
        assert!(
            gold_errors >= 30,
            "{d}: {gold_errors} error responses in gold data"
        );
    }
}

#[test]
fn each_domain_has_six_tools_and_two_irreversible() {
    for d in Domain::ALL {
        let tools = d.tools();
        assert!(tools.len() >= 6, "{d}");
        let irr = tools.iter().filter(|t| t.is_irreversible()).count();
        assert!(irr >= 2, "{d}: {irr} irreversible");
        for t in &tools {
            assert_eq!(t.input_schema["type"], "object");
            assert!(t.input_schema["properties"].is_object());
            assert!(
                !(t.annotations.read_only && t.annotations.destructive),
                "{}",
                t.name
            );
        }
    }
}

#[test]
fn episodes_are_short() {
    // Roughly 4 characters a token: the whole gold episode (user, calls, responses, replies).
    for d in Domain::ALL {
        let mut chars = Vec::new();
        for t in builtin_tasks(d) {
            let mut n = 0;
            for turn in t.gold_trajectory().unwrap() {
                n += turn.user.len() + turn.reply.len();
                for (c, r) in &turn.steps {
                    n += c.name.len()
                        + c.arguments.to_string().len()
                        + r.to_json().to_string().len();
                }
            }
            chars.push(n);
        }
        let mean = chars.iter().sum::<usize>() as f64 / chars.len() as f64 / 4.0;
        let max = *chars.iter().max().unwrap() as f64 / 4.0;
        eprintln!("{d}: mean ~{mean:.0} tokens, max ~{max:.0}");
        assert!(mean < 200.0 && max < 400.0, "{d}: mean {mean} max {max}");
    }
}

fn leaves(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::String(s) => {
            out.insert(s.clone());
        }
        Value::Array(a) => a.iter().for_each(|x| leaves(x, out)),
        Value::Object(m) => {
            for (k, x) in m {
                if k.contains('_') && k.chars().any(|c| c.is_ascii_digit()) {
                    out.insert(k.clone());
                }
                leaves(x, out);
            }
        }
        _ => {}
    }
}

fn words(t: &Task) -> BTreeSet<String> {
    t.user_turns()
        .join(" ")
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn train_and_test_share_no_names_ids_or_numbers() {
    let enums: BTreeSet<&str> = [
        "checking",
        "savings",
        "pending",
        "shipped",
        "delivered",
        "cancelled",
        "basic",
        "flex",
        "active",
    ]
    .into();
    for d in Domain::ALL {
        let mut strings: HashMap<Split, BTreeSet<String>> = HashMap::new();
        let mut numbers: HashMap<Split, BTreeSet<String>> = HashMap::new();
        for split in [Split::Train, Split::Test] {
            let tasks = list_tasks(d, Some(split));
            assert_eq!(tasks.len(), if split == Split::Train { 500 } else { 100 });
            let s = strings.entry(split).or_default();
            let n = numbers.entry(split).or_default();
            for t in tasks {
                leaves(&t.initial_state, s);
                for w in words(t) {
                    if w.chars().all(|c| c.is_ascii_digit()) {
                        n.insert(w);
                    } else if w.contains('_') {
                        s.insert(w);
                    }
                }
            }
        }
        let shared: Vec<&String> = strings[&Split::Train]
            .intersection(&strings[&Split::Test])
            .filter(|s| !enums.contains(s.as_str()))
            .collect();
        assert!(shared.is_empty(), "{d}: train and test share {shared:?}");
        let shared: Vec<&String> = numbers[&Split::Train]
            .intersection(&numbers[&Split::Test])
            .collect();
        assert!(
            shared.is_empty(),
            "{d}: train and test instructions share numbers {shared:?}"
        );
    }
}

#[test]
fn empty_episode_scores_below_one_for_every_task() {
    for d in Domain::ALL {
        for t in builtin_tasks(d) {
            let s = score_task(
                t,
                &EpisodeTrace {
                    finished_normally: true,
                    ..Default::default()
                },
            )
            .unwrap();
            assert_eq!(s.reward, 0.0, "{}", t.id);
            assert!(s.partial < 1.0, "{}", t.id);
        }
    }
}

#[test]
fn an_action_taken_a_turn_early_fails_a_multi_turn_task() {
    let mut checked = 0;
    for d in Domain::ALL {
        for t in builtin_tasks(d) {
            if t.turns.len() < 2 {
                continue;
            }
            let gold = gold_trace(t);
            assert_eq!(gold.turn_ends.len(), t.turns.len(), "{}", t.id);
            let s = score_task(t, &gold).unwrap();
            assert_eq!(s.reward, 1.0, "{}", t.id);
            assert!(
                s.checklist
                    .iter()
                    .any(|c| c.name == "state after turn 1 matches gold" && c.passed),
                "{}",
                t.id
            );
            // Every call made before the first answer: the same calls, messages and final
            // state, only the order against the user's turns differs.
            let early = EpisodeTrace {
                turn_ends: vec![gold.actions.len(); gold.turn_ends.len()],
                ..gold.clone()
            };
            let first = replay(t, &gold.actions[..gold.turn_ends[0]]).unwrap();
            let last = replay(t, &gold.actions).unwrap();
            let s = score_task(t, &early).unwrap();
            if state_hash(&first) == state_hash(&last) {
                // The later turns change nothing (a question, or calls that fail): no harm.
                assert_eq!(s.reward, 1.0, "{}", t.id);
                continue;
            }
            assert_eq!(s.reward, 0.0, "{}", t.id);
            assert!(
                s.checklist
                    .iter()
                    .any(|c| c.name == "state after turn 1 matches gold" && !c.passed),
                "{}",
                t.id
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 20,
        "only {checked} multi-turn tasks change state after turn 1"
    );
}

#[test]
fn abnormal_end_scores_zero_even_with_gold_actions() {
    let t = &builtin_tasks(Domain::Bank)[1];
    let mut trace = gold_trace(t);
    trace.finished_normally = false;
    assert_eq!(score_task(t, &trace).unwrap().reward, 0.0);
}

#[test]
fn wrong_actions_score_below_one() {
    for d in Domain::ALL {
        let mut checked = 0;
        for t in builtin_tasks(d) {
            // Perturb the last write: change one integer or string argument.
            let mut trace = gold_trace(t);
            let tools = d.tools();
            let Some(a) = trace.actions.iter_mut().rev().find(|a| {
                tools
                    .iter()
                    .any(|s| s.name == a.name && !s.annotations.read_only)
            }) else {
                continue;
            };
            let mut changed = false;
            if let Some(obj) = a.arguments.as_object_mut() {
                for (_, v) in obj.iter_mut() {
                    if let Some(n) = v.as_i64() {
                        *v = json!(n + 1);
                        changed = true;
                        break;
                    }
                }
                if !changed {
                    for (_, v) in obj.iter_mut() {
                        if let Some(s) = v.as_str() {
                            *v = json!(format!("{s}9"));
                            changed = true;
                            break;
                        }
                    }
                }
            }
            assert!(changed);
            let s = score_task(t, &trace).unwrap();
            let gold_failed = t
                .turns
                .iter()
                .flat_map(|x| &x.actions)
                .filter(|x| {
                    tools
                        .iter()
                        .any(|s| s.name == x.name && !s.annotations.read_only)
                })
                .all(|x| x.error.is_some());
            if !gold_failed {
                assert_eq!(s.reward, 0.0, "{} with {:?}", t.id, trace.actions);
            }
            assert!(s.partial < 1.0, "{}", t.id);
            checked += 1;
        }
        assert!(checked > 300, "{d}: {checked}");
    }
}

#[test]
fn missing_fact_fails_even_when_state_matches() {
    let t = list_tasks(Domain::Bank, Some(Split::Test))
        .into_iter()
        .find(|t| t.kind == "insufficient_funds")
        .unwrap();
    let mut trace = gold_trace(t);
    trace.agent_messages = vec!["Done.".into()];
    let s = score_task(t, &trace).unwrap();
    assert_eq!(s.reward, 0.0);
    assert!(s.partial > 0.0 && s.partial < 1.0);
    trace.agent_messages = vec!["INSUFFICIENT FUNDS, sorry".into()];
    assert_eq!(score_task(t, &trace).unwrap().reward, 1.0);
}

#[test]
fn state_dependent_task_rewards_only_the_right_branch() {
    let t = builtin_tasks(Domain::Bank)
        .iter()
        .find(|t| t.kind == "pay_if_enough" && t.required_facts == ["savings"])
        .unwrap();
    let mut trace = gold_trace(t);
    // Paying from checking instead (the branch the balance rules out) fails.
    let last = trace.actions.last_mut().unwrap();
    let chk = t.gold_actions()[1].arguments["acc"].clone();
    last.arguments["src"] = chk;
    assert_eq!(score_task(t, &trace).unwrap().reward, 0.0);
}

#[tokio::test]
async fn bad_calls_are_json_errors_and_leave_state_alone() {
    let mut env = DomainEnv::new(Domain::Bank);
    let task = list_tasks(Domain::Bank, Some(Split::Train))[1].clone();
    env.reset(Some(&task.id)).await.unwrap();
    let before = env.state_hash().await.unwrap();
    let acc = task.gold_actions()[0].arguments["src"]
        .as_str()
        .unwrap()
        .to_string();
    let cases = [
        (call("teleport", json!({})), "unknown_tool"),
        (call("get_balance", json!({})), "invalid_arguments"),
        (call("get_balance", json!({"acc": 5})), "invalid_arguments"),
        (call("get_balance", json!("acc_1")), "invalid_arguments"),
        (
            call("get_balance", json!({"acc": acc, "x": 1})),
            "invalid_arguments",
        ),
        (call("get_balance", json!({"acc": "acc_0"})), "not_found"),
        (
            call("transfer", json!({"src": acc, "dst": "acc_0", "amount": 5})),
            "not_found",
        ),
        (
            call("transfer", json!({"src": acc, "dst": acc, "amount": 5})),
            "invalid_arguments",
        ),
        (
            call(
                "transfer",
                json!({"src": acc, "dst": "acc_0", "amount": -5}),
            ),
            "invalid_amount",
        ),
        (
            call(
                "transfer",
                json!({"src": acc, "dst": "acc_0", "amount": "5"}),
            ),
            "invalid_arguments",
        ),
        (
            call(
                "transfer",
                json!({"src": acc, "dst": "acc_0", "amount": 5.5}),
            ),
            "invalid_arguments",
        ),
        (
            call("set_limit", json!({"acc": acc, "limit": 99999})),
            "invalid_amount",
        ),
        (
            call(
                "card_pay",
                json!({"card": "card_0", "payee": "x", "amount": 1}),
            ),
            "not_found",
        ),
    ];
    for (c, code) in cases {
        match env.call(&c).await.unwrap() {
            ToolResponse::Error { code: got, message } => {
                assert_eq!(got, code, "{c:?}: {message}");
                assert!(!message.is_empty());
            }
            other => panic!("{c:?} succeeded: {other:?}"),
        }
    }
    assert_eq!(env.state_hash().await.unwrap(), before);
    for d in [Domain::Retail, Domain::Travel] {
        let mut env = DomainEnv::new(d);
        for t in d.tools() {
            for args in [
                json!({}),
                json!(null),
                json!({"zzz": 1}),
                json!({"order": 1, "bk": 2, "flight": [], "name": {}}),
            ] {
                let r = env.call(&call(&t.name, args.clone())).await.unwrap();
                assert!(r.is_error(), "{d} {} {args}: {r:?}", t.name);
            }
        }
    }
}

#[tokio::test]
async fn policy_violations_come_back_as_errors() {
    // Each built-in failing gold call is a real policy error in a live environment.
    let mut seen = BTreeSet::new();
    for d in Domain::ALL {
        let mut env = DomainEnv::new(d);
        for t in builtin_tasks(d) {
            env.reset(Some(&t.id)).await.unwrap();
            for a in t.turns.iter().flat_map(|x| &x.actions) {
                let r = env.call(&a.to_call()).await.unwrap();
                if let Some(code) = &a.error {
                    assert_eq!(r, env.call(&a.to_call()).await.unwrap());
                    match r {
                        ToolResponse::Error { code: got, .. } => assert_eq!(&got, code),
                        other => panic!("{}: {other:?}", t.id),
                    }
                    seen.insert(code.clone());
                }
            }
        }
    }
    for code in [
        "insufficient_funds",
        "limit_exceeded",
        "card_frozen",
        "bad_status",
        "out_of_stock",
        "sold_out",
        "fare_rules",
    ] {
        assert!(seen.contains(code), "no task exercises {code}");
    }
}

#[tokio::test]
async fn domain_env_follows_the_environment_contract() {
    for d in Domain::ALL {
        let t = list_tasks(d, Some(Split::Test))[2].clone();
        let mut env = DomainEnv::new(d);
        assert_eq!(env.name(), d.name());
        assert!(matches!(
            env.score(&EpisodeTrace::default()).await,
            Err(EnvError::Other(_))
        ));
        assert!(matches!(
            env.reset(Some("nope")).await,
            Err(EnvError::UnknownTask(_))
        ));
        env.reset(Some(&t.id)).await.unwrap();
        assert_eq!(env.user_turns(), t.user_turns());
        assert_eq!(env.snapshot().await.unwrap(), t.initial_state);
        assert_eq!(
            env.state_hash().await.unwrap(),
            state_hash(&t.initial_state)
        );
        let gold = env.gold_trajectory().unwrap().unwrap();
        assert_eq!(gold.len(), t.turns.len());
        for turn in &gold {
            for (c, r) in &turn.steps {
                assert_eq!(&env.call(c).await.unwrap(), r);
            }
        }
        let live = env.state_hash().await.unwrap();
        let s = env.score(&gold_trace(&t)).await.unwrap();
        assert_eq!(s.reward, 1.0);
        // Scoring replays on fresh copies: the live state is untouched.
        assert_eq!(env.state_hash().await.unwrap(), live);
        env.reset(Some(&t.id)).await.unwrap();
        assert_eq!(env.snapshot().await.unwrap(), t.initial_state);
    }
}

#[test]
fn user_task_file_loads_and_scores() {
    let tasks = load_task_file(&fixtures().join("tasks/bank_custom.json")).unwrap();
    assert_eq!(tasks.len(), 2);
    for t in &tasks {
        assert_eq!(
            score_task(t, &gold_trace(t)).unwrap().reward,
            1.0,
            "{}",
            t.id
        );
    }
    assert_eq!(tasks[1].checklist.len(), 3);
    let s = score_task(
        &tasks[1],
        &EpisodeTrace {
            finished_normally: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(s.reward, 0.0);
    assert_eq!(s.partial, 0.5);
}

fn invalid(name: &str) -> String {
    let path = fixtures()
        .join("tasks_invalid")
        .join(format!("{name}.json"));
    match load_task_file(&path) {
        Ok(_) => panic!("{name} loaded"),
        Err(e) => {
            assert!(matches!(e, EnvError::BadTask { .. }));
            let msg = e.to_string();
            assert!(msg.contains(&format!("{name}.json")), "{msg}");
            msg
        }
    }
}

#[test]
fn bad_task_file_missing_field_names_file_task_and_field() {
    let m = invalid("missing_field");
    assert!(
        m.contains("task missing-state") && m.contains("`initial_state`"),
        "{m}"
    );
}

#[test]
fn bad_task_file_unknown_tool_names_the_action() {
    let m = invalid("unknown_tool");
    assert!(
        m.contains("task bad-tool") && m.contains("`turns[0].actions[0].name`"),
        "{m}"
    );
    assert!(m.contains("teleport"), "{m}");
}

#[test]
fn bad_task_file_wrong_type_of_turns() {
    let m = invalid("wrong_type_turns");
    assert!(
        m.contains("task turns-string") && m.contains("`turns`"),
        "{m}"
    );
}

#[test]
fn bad_task_file_wrong_type_in_state() {
    let m = invalid("wrong_type_state");
    assert!(
        m.contains("task balance-string") && m.contains("`initial_state`"),
        "{m}"
    );
}

#[test]
fn bad_task_file_gold_call_that_fails_unexpectedly() {
    let m = invalid("gold_mismatch");
    assert!(
        m.contains("task gold-fails") && m.contains("`turns[0].actions[0]`"),
        "{m}"
    );
    assert!(m.contains("limit_exceeded"), "{m}");
}

#[test]
fn bad_task_file_unknown_domain() {
    let m = invalid("unknown_domain");
    assert!(
        m.contains("task no-such-domain") && m.contains("`domain`") && m.contains("casino"),
        "{m}"
    );
}

#[test]
fn bad_task_file_missing_id() {
    let m = invalid("missing_id");
    assert!(m.contains("task #0") && m.contains("`id`"), "{m}");
}

#[test]
fn bad_task_file_wrong_type_of_facts() {
    let m = invalid("wrong_type_facts");
    assert!(
        m.contains("task facts-number") && m.contains("`required_facts`"),
        "{m}"
    );
}

fn envace(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn cli_check_gold_reports_all_tasks_at_one() {
    for d in Domain::ALL {
        let out = envace(&["env", "check-gold", d.name(), "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["tasks"], 600);
        assert_eq!(v["passed"], 600);
        assert_eq!(v["mean_reward"], 1.0);
    }
}

#[test]
fn cli_tasks_json_round_trips_through_the_task_loader() {
    let out = envace(&["tasks", "travel", "--split", "test", "--json"]);
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("travel_test.json");
    std::fs::write(&p, &out.stdout).unwrap();
    let loaded = load_task_file(&p).unwrap();
    let want: Vec<Task> = list_tasks(Domain::Travel, Some(Split::Test))
        .into_iter()
        .cloned()
        .collect();
    assert_eq!(loaded, want);
    let out = envace(&[
        "env",
        "check-gold",
        "travel",
        "--tasks",
        p.to_str().unwrap(),
    ]);
    assert!(out.status.success());
}

#[test]
fn cli_reports_bad_task_file_on_stderr() {
    let p = fixtures().join("tasks_invalid/unknown_tool.json");
    let out = envace(&["tasks", "bank", "--file", p.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown_tool.json")
            && err.contains("bad-tool")
            && err.contains("turns[0].actions[0].name"),
        "{err}"
    );
}

#[test]
fn cli_list_tools_and_call() {
    let out = envace(&["env", "list", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 3);
    let out = envace(&["env", "tools", "bank", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        v.as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == "transfer" && t["annotations"]["destructive"] == true)
    );
    let t = &list_tasks(Domain::Bank, Some(Split::Train))[0];
    let acc = t.gold_actions()[0].arguments["acc"]
        .as_str()
        .unwrap()
        .to_string();
    let out = envace(&[
        "env",
        "call",
        "bank",
        "--task",
        &t.id,
        "get_balance",
        &format!("{{\"acc\":\"{acc}\"}}"),
    ]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["acc"], acc.as_str());
    let out = envace(&["env", "call", "bank", "get_balance", "{\"acc\":\"acc_0\"}"]);
    assert_eq!(out.status.code(), Some(2));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["code"], "not_found");
}
