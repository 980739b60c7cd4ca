//! Shadow mode: the prediction first, then the real call, with fidelity.

use super::*;

#[test]
fn shadow_mode_predicts_then_executes_and_the_actor_sees_the_real_answer() {
    let t = call_text("get_balance", json!({"id": "a"}));
    let r = run(
        spec(&["bal?"]),
        cfg(shadow()),
        Script::default()
            .actor(&[&t, "5"])
            .sim(vec![result_text(json!({"balance": 7}))])
            .real(vec![ToolResponse::Success {
                value: json!({"balance": 5}),
            }]),
    );
    assert_eq!(r.generates(GenRole::Simulator).len(), 1);
    assert_eq!(r.real_calls().len(), 1);
    // The simulation comes before the real call.
    let sim_at = r
        .effects
        .iter()
        .position(|e| matches!(e, Effect::Generate(g) if g.role == GenRole::Simulator));
    let real_at = r
        .effects
        .iter()
        .position(|e| matches!(e, Effect::ExecuteReal { .. }));
    assert!(sim_at < real_at);
    let prompt = &r.generates(GenRole::Actor)[1].messages;
    assert_eq!(
        prompt.last().map(|m| m.content.as_str()),
        Some("{\"balance\":5}")
    );
    let kinds = r.kinds();
    let s = kinds
        .iter()
        .position(|k| *k == "simulated")
        .expect("simulated");
    let re = kinds.iter().position(|k| *k == "real").expect("real");
    let f = kinds
        .iter()
        .position(|k| *k == "fidelity")
        .expect("fidelity");
    assert!(s < re && re < f);
    assert_eq!(r.outcome().scored_by, Some(ScoredBy::Environment));
}

#[test]
fn shadow_mode_shows_the_prediction_to_the_approval_hook() {
    let t = call_text("transfer", json!({"amount": 1}));
    let r = run(
        spec(&["x"]),
        cfg(shadow()),
        Script::default()
            .actor(&[&t, "ok"])
            .sim(vec![result_text(json!({"ok": true}))]),
    );
    let asks = r.approvals();
    assert_eq!(asks.len(), 1);
    assert_eq!(
        asks[0].predicted.as_ref().and_then(SimulatedOutcome::value),
        Some(json!({"ok": true}))
    );
}

#[test]
fn shadow_mode_records_fidelity_per_tool() {
    let t = format!(
        "{}{}",
        call_text("get_balance", json!({"id": "a"})),
        call_text("transfer", json!({"amount": 1}))
    );
    let r = run(
        spec(&["x"]),
        cfg(Mode::Shadow(LiveOptions {
            approval: ApprovalGate::Off,
            private_rehearsal: None,
        })),
        Script::default()
            .actor(&[&t, "ok"])
            .sim(vec![
                result_text(json!({"balance": 7})),
                result_text(json!({"ok": true})),
            ])
            .real(vec![
                ToolResponse::Success {
                    value: json!({"balance": 5}),
                },
                ToolResponse::Success {
                    value: json!({"ok": true}),
                },
            ]),
    );
    let f = &r.outcome().stats.fidelity;
    assert_eq!(f.per_tool["get_balance"].exact, 0);
    assert_eq!(f.per_tool["get_balance"].mean_key_f1(), 1.0);
    assert_eq!(f.per_tool["transfer"].exact, 1);
    assert_eq!(f.total().calls, 2);
}

#[test]
fn shadow_mode_unparseable_prediction_still_runs_the_real_call() {
    let t = call_text("get_balance", json!({}));
    let r = run(
        spec(&["x"]),
        cfg(shadow()),
        Script::default()
            .actor(&[&t, "ok"])
            .sim(vec!["oops".into()]),
    );
    assert_eq!(r.real_calls().len(), 1);
    assert_eq!(r.outcome().end, EndReason::Answered);
    assert_eq!(r.outcome().stats.fidelity.total().exact, 0);
    assert_eq!(r.outcome().stats.simulator_format_failures, 1);
}
