//! Real mode: calls run in order, the approval gate and its decisions.

use super::*;

#[test]
fn real_mode_executes_calls_in_order_and_feeds_results_back() {
    let two = format!(
        "{}{}",
        call_text("get_balance", json!({"id": "a"})),
        call_text("get_balance", json!({"id": "b"}))
    );
    let r = run(
        spec(&["hi"]),
        cfg(real()),
        Script::default()
            .actor(&[&two, "Balances shown."])
            .real(vec![
                ToolResponse::Success {
                    value: json!({"balance": 1}),
                },
                ToolResponse::Error {
                    code: "not_found".into(),
                    message: "no b".into(),
                },
            ]),
    );
    let calls = r.real_calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].arguments, json!({"id": "a"}));
    assert_eq!(calls[1].arguments, json!({"id": "b"}));
    assert!(r.generates(GenRole::Simulator).is_empty());
    let last_prompt = &r.generates(GenRole::Actor)[1].messages;
    let tools: Vec<&str> = last_prompt
        .iter()
        .filter(|m| m.role == crate::message::Role::Tool)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(
        tools,
        [
            "{\"balance\":1}",
            "{\"error\":{\"code\":\"not_found\",\"message\":\"no b\"}}"
        ]
    );
    assert_eq!(r.outcome().trace.actions.len(), 2);
    assert_eq!(r.outcome().stats.real_calls, 2);
}

#[test]
fn irreversible_call_asks_approval_and_reversible_call_does_not() {
    let t = format!(
        "{}{}",
        call_text("get_balance", json!({})),
        call_text("transfer", json!({"amount": 5}))
    );
    let r = run(
        spec(&["pay"]),
        cfg(real()),
        Script::default().actor(&[&t, "done"]),
    );
    let asks = r.approvals();
    assert_eq!(asks.len(), 1);
    assert_eq!(asks[0].call.name, "transfer");
    assert!(asks[0].irreversible);
    assert_eq!(asks[0].rehearsal, None);
    assert_eq!(r.real_calls().len(), 2);
    assert_eq!(r.count("approval_requested"), 1);
    assert_eq!(r.count("approval"), 1);
}

#[test]
fn every_call_gate_asks_for_all_calls_and_off_gate_for_none() {
    let t = format!(
        "{}{}",
        call_text("get_balance", json!({})),
        call_text("transfer", json!({}))
    );
    let every = Mode::Real(LiveOptions {
        approval: ApprovalGate::EveryCall,
        private_rehearsal: None,
    });
    let r = run(
        spec(&["x"]),
        cfg(every),
        Script::default().actor(&[&t, "ok"]),
    );
    assert_eq!(r.approvals().len(), 2);
    let off = Mode::Real(LiveOptions {
        approval: ApprovalGate::Off,
        private_rehearsal: None,
    });
    let r = run(spec(&["x"]), cfg(off), Script::default().actor(&[&t, "ok"]));
    assert!(r.approvals().is_empty());
    assert_eq!(r.real_calls().len(), 2);
}

#[test]
fn rejected_approval_skips_the_call_and_tells_the_actor_why() {
    let t = call_text("transfer", json!({"amount": 5}));
    let r = run(
        spec(&["pay"]),
        cfg(real()),
        Script::default()
            .actor(&[&t, "Okay, not paying."])
            .decide(vec![Decision::Reject {
                reason: "too much".into(),
            }]),
    );
    assert!(r.real_calls().is_empty());
    let prompt = &r.generates(GenRole::Actor)[1].messages;
    let last = prompt.last().expect("tool message");
    assert_eq!(
        last.content,
        "{\"error\":{\"code\":\"rejected_by_user\",\"message\":\"too much\"}}"
    );
    assert!(r.outcome().trace.actions.is_empty());
    assert_eq!(r.outcome().end, EndReason::Answered);
}

#[test]
fn edited_approval_runs_the_edited_arguments_and_updates_the_conversation() {
    let t = call_text("transfer", json!({"amount": 500}));
    let r = run(
        spec(&["pay"]),
        cfg(real()),
        Script::default()
            .actor(&[&t, "paid"])
            .decide(vec![Decision::ApproveEdited {
                arguments: json!({"amount": 5}),
            }]),
    );
    assert_eq!(r.real_calls()[0].arguments, json!({"amount": 5}));
    assert_eq!(r.outcome().trace.actions[0].arguments, json!({"amount": 5}));
    let prompt = &r.generates(GenRole::Actor)[1].messages;
    let asst = prompt
        .iter()
        .find(|m| !m.tool_calls.is_empty())
        .expect("assistant with calls");
    assert_eq!(asst.tool_calls[0].function.arguments, json!({"amount": 5}));
}

#[test]
fn terminate_decision_ends_the_episode_without_running_the_call() {
    let t = call_text("transfer", json!({}));
    let r = run(
        spec(&["pay"]),
        cfg(real()),
        Script::default()
            .actor(&[&t])
            .decide(vec![Decision::Terminate]),
    );
    assert!(r.real_calls().is_empty());
    assert_eq!(r.outcome().end, EndReason::Terminated);
    assert!(!r.outcome().trace.finished_normally);
    assert_eq!(r.outcome().scored_by, Some(ScoredBy::Environment));
}
