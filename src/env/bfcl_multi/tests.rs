//! Unit tests of the multi-turn turn loop, held-out functions and responses files, with a
//! scripted responder and an echoing executor in place of a model and the bridge.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::env::bfcl::{BfclEntry, BfclResponse};
use crate::message::Role;

/// Answers each step from a script of (calls, text) and keeps the conversations it saw.
struct Script {
    steps: Vec<Vec<ToolCall>>,
    seen: Vec<Vec<Message>>,
}

impl BfclResponder for Script {
    fn respond(&mut self, _entry: &BfclEntry) -> Result<BfclResponse, BoxError> {
        Err("multi-turn only".into())
    }
    fn chat(
        &mut self,
        messages: &[Message],
        _tools: &[ToolSpec],
    ) -> Result<(Vec<ToolCall>, String), BoxError> {
        self.seen.push(messages.to_vec());
        let calls = if self.steps.is_empty() {
            vec![]
        } else {
            self.steps.remove(0)
        };
        Ok((calls, format!("step {}", self.seen.len())))
    }
}

/// Answers each call with `<name>:<n>`.
struct Echo(usize);

impl StepExecutor for Echo {
    fn execute(&mut self, calls: &[ToolCall]) -> Result<Vec<String>, BfclMultiError> {
        Ok(calls
            .iter()
            .map(|c| {
                self.0 += 1;
                format!("{}:{}", c.name, self.0)
            })
            .collect())
    }
}

fn call(name: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: json!({}),
    }
}

fn entry(turns: usize) -> MultiEntry {
    MultiEntry {
        id: "multi_turn_base_9".into(),
        question: (0..turns)
            .map(|t| vec![json!({"role": "user", "content": format!("do {t}")})])
            .collect(),
        initial_config: json!({}),
        involved_classes: vec!["MathAPI".into()],
        functions: vec![json!({"name": "ls", "description": "list",
            "parameters": {"type": "dict", "properties": {}}})],
        held_out: vec![],
        ground_truth: vec![vec![]; turns],
    }
}

#[test]
fn each_turn_runs_until_a_step_without_calls_and_results_are_fed_back() {
    let mut r = Script {
        steps: vec![vec![call("ls"), call("pwd")], vec![], vec![call("cd")]],
        seen: vec![],
    };
    let got = run_entry(&entry(2), &mut r, &mut Echo(0), 20).unwrap();
    assert_eq!(
        got.turns,
        vec![
            vec![vec![call("ls"), call("pwd")], vec![]],
            vec![vec![call("cd")], vec![]],
        ]
    );
    assert_eq!(got.raw.as_ref().unwrap()[0], ["step 1", "step 2"]);
    // The second step saw: user, assistant with two calls, two tool results.
    let second = &r.seen[1];
    let roles: Vec<Role> = second.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [Role::User, Role::Assistant, Role::Tool, Role::Tool],
        "{second:?}"
    );
    assert_eq!(second[1].tool_calls.len(), 2);
    assert_eq!(second[2].content, "ls:1");
    assert_eq!(second[3].tool_call_id.as_deref(), Some("call_1"));
    // The second turn starts after the first answer, with its own user message.
    let third = &r.seen[2];
    assert_eq!(third[4].content, "step 2");
    assert_eq!(third[5].content, "do 1");
}

#[test]
fn a_turn_past_the_step_limit_force_quits_the_entry() {
    let mut r = Script {
        steps: vec![vec![call("ls")]; 10],
        seen: vec![],
    };
    let got = run_entry(&entry(3), &mut r, &mut Echo(0), 2).unwrap();
    // Steps 1, 2, 3 made calls; the third exceeded the limit of 2: no later turn ran.
    assert_eq!(got.turns.len(), 1, "{got:?}");
    assert_eq!(got.turns[0].len(), 3);
}

#[test]
fn a_single_turn_responder_is_refused_naming_the_entry() {
    struct Single;
    impl BfclResponder for Single {
        fn respond(&mut self, _entry: &BfclEntry) -> Result<BfclResponse, BoxError> {
            Err("unused".into())
        }
    }
    let e = run_entry(&entry(1), &mut Single, &mut Echo(0), 20).unwrap_err();
    assert!(e.to_string().contains("multi_turn_base_9"), "{e}");
    assert!(e.to_string().contains("single-turn"), "{e}");
}

#[test]
fn trace_actions_split_into_turns_at_the_answers() {
    let trace = EpisodeTrace {
        actions: vec![call("a"), call("b"), call("c")],
        agent_messages: vec!["x".into(), "y".into()],
        finished_normally: true,
        turn_ends: vec![2, 2],
    };
    assert_eq!(
        trace_turns(&trace),
        vec![
            vec![vec![call("a")], vec![call("b")]],
            vec![],
            vec![vec![call("c")]]
        ]
    );
}

#[test]
fn responses_file_errors_name_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r.jsonl");
    std::fs::write(&p, "{\"id\": \"a\", \"turns\": []}\n{\"id\": \"b\"}\n").unwrap();
    let e = load_multi_responses(&p).unwrap_err().to_string();
    assert!(e.contains("r.jsonl:2") && e.contains("turns"), "{e}");
}

#[test]
fn a_missing_interpreter_names_fetch_bfcl() {
    let e = Bridge::spawn(Path::new("/nowhere/venv/bin/python"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("scripts/fetch-bfcl"), "{e}");
}

fn doc(name: &str) -> Value {
    json!({"name": name, "description": name, "parameters": {"type": "dict", "properties": {}}})
}

#[test]
fn held_out_functions_leave_the_list_and_join_it_at_their_turn_with_bfcls_prompt() {
    let mut functions = vec![doc("ls"), doc("sort"), doc("cd"), doc("wc")];
    let held = hold_out(&json!({"2": ["wc", "sort"]}), &mut functions, 4).unwrap();
    assert_eq!(functions, vec![doc("ls"), doc("cd")]);
    assert_eq!(held, vec![(2, vec![doc("wc"), doc("sort")])]);

    let mut e = entry(4);
    e.functions = functions;
    e.held_out = held;
    e.question[2].clear();
    let names = |t| -> Vec<String> { e.tools_at(t).into_iter().map(|s| s.name).collect() };
    assert_eq!(names(1), ["ls", "cd"]);
    assert_eq!(names(2), ["ls", "cd", "wc", "sort"]);
    assert_eq!(names(3), names(2));
    assert_eq!(e.turn_messages(2)[0].content, ADDITIONAL_FUNCTIONS_PROMPT);
    assert_eq!(e.turn_messages(1)[0].content, "do 1");

    // The turn loop offers each turn its own list.
    struct Tools(Vec<Vec<String>>);
    impl BfclResponder for Tools {
        fn respond(&mut self, _entry: &BfclEntry) -> Result<BfclResponse, BoxError> {
            Err("multi-turn only".into())
        }
        fn chat(
            &mut self,
            _messages: &[Message],
            tools: &[ToolSpec],
        ) -> Result<(Vec<ToolCall>, String), BoxError> {
            self.0.push(tools.iter().map(|t| t.name.clone()).collect());
            Ok((vec![], "ok".into()))
        }
    }
    let mut r = Tools(vec![]);
    run_entry(&e, &mut r, &mut Echo(0), 20).unwrap();
    assert_eq!(r.0.len(), 4);
    assert_eq!(r.0[1], names(1));
    assert_eq!(r.0[2], names(2));
}

#[test]
fn a_bad_missed_function_is_refused_naming_the_turn_or_the_name() {
    let mut functions = vec![doc("ls")];
    let e = hold_out(&json!({"1": ["sort"]}), &mut functions, 3).unwrap_err();
    assert!(e.contains("turn 1") && e.contains("`sort`"), "{e}");
    let e = hold_out(&json!({"5": ["ls"]}), &mut functions, 3).unwrap_err();
    assert!(e.contains("turn 5") && e.contains("3 turns"), "{e}");
    let e = hold_out(&json!({"x": ["ls"]}), &mut functions, 3).unwrap_err();
    assert!(e.contains("`x`"), "{e}");
    assert_eq!(
        functions,
        vec![doc("ls")],
        "nothing taken on errors before the name"
    );
}

#[test]
fn tools_offer_the_class_functions_as_objects() {
    let tools = entry(1).tools_at(0);
    assert_eq!(tools[0].name, "ls");
    assert_eq!(tools[0].input_schema["type"], "object");
}
