//! Rehearse mode: every call simulated, never executed.

use super::*;

#[test]
fn rehearse_mode_simulates_each_call_and_scores_with_the_verifier() {
    let t = call_text("transfer", json!({"amount": 5}));
    let r = run(
        spec(&["pay"]),
        cfg(Mode::Rehearse),
        Script {
            reward: 1.0,
            ..Script::default()
        }
        .actor(&[&t, "Paid."])
        .sim(vec![result_text(json!({"status": "done"}))]),
    );
    assert!(r.real_calls().is_empty());
    assert!(r.approvals().is_empty(), "nothing real to approve");
    let sims = r.generates(GenRole::Simulator);
    assert_eq!(sims.len(), 1);
    assert_eq!(sims[0].call_id.as_deref(), Some("call_0"));
    assert!(sims[0].tools.is_empty());
    assert!(!sims[0].enable_thinking);
    let o = r.outcome();
    assert_eq!(o.scored_by, Some(ScoredBy::Verifier));
    assert_eq!(o.reward(), 1.0);
    assert_eq!(o.trace.actions.len(), 1);
    let prompt = &r.generates(GenRole::Actor)[1].messages;
    assert_eq!(
        prompt.last().map(|m| m.content.as_str()),
        Some("{\"status\":\"done\"}")
    );
}

#[test]
fn rejected_simulation_ends_episode_with_zero_reward() {
    let t = call_text("transfer", json!({"amount": -1}));
    let r = run(
        spec(&["pay"]),
        cfg(Mode::Rehearse),
        Script {
            reward: 1.0,
            ..Script::default()
        }
        .actor(&[&t])
        .sim(vec![result_text(
            json!({"error_tool_call": {"code": "schema", "message": "amount < 0"}}),
        )]),
    );
    let o = r.outcome();
    assert_eq!(
        o.end,
        EndReason::SimulatorRejected {
            code: "schema".into(),
            message: "amount < 0".into()
        }
    );
    assert_eq!(o.scored_by, Some(ScoredBy::ForcedZero));
    assert_eq!(o.reward(), 0.0);
    assert!(!r.effects.iter().any(|e| matches!(e, Effect::Score { .. })));
    assert_eq!(o.stats.simulator_rejections, 1);
}

#[test]
fn unparseable_simulation_ends_episode_with_zero_reward() {
    let t = call_text("transfer", json!({}));
    let r = run(
        spec(&["pay"]),
        cfg(Mode::Rehearse),
        Script {
            reward: 1.0,
            ..Script::default()
        }
        .actor(&[&t])
        .sim(vec!["sure, done".into()]),
    );
    assert!(matches!(
        r.outcome().end,
        EndReason::SimulatorFormatError { .. }
    ));
    assert_eq!(r.outcome().reward(), 0.0);
    assert_eq!(r.count("format"), 1);
    assert_eq!(r.outcome().stats.simulator_format_failures, 1);
}

#[test]
fn show_error_policy_lets_the_actor_continue_after_a_rejection() {
    let t = call_text("transfer", json!({}));
    let mut c = cfg(Mode::Rehearse);
    c.sim_failure = SimFailurePolicy::ShowErrorToActor;
    let r = run(
        spec(&["pay"]),
        c,
        Script::default().actor(&[&t, &t, "gave up"]).sim(vec![
            result_text(json!({"error_tool_call": {"code": "c", "message": "m"}})),
            "garbage".into(),
        ]),
    );
    assert_eq!(r.outcome().end, EndReason::Answered);
    assert_eq!(r.outcome().scored_by, Some(ScoredBy::Verifier));
    let prompt = &r.generates(GenRole::Actor)[2].messages;
    let tools: Vec<&str> = prompt
        .iter()
        .filter(|m| m.role == crate::message::Role::Tool)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(tools[0], "{\"error\":{\"code\":\"c\",\"message\":\"m\"}}");
    assert!(tools[1].contains("simulator_format_error"));
}

#[test]
fn real_call_permit_refuses_rehearse_mode() {
    assert!(RealCallPermit::for_mode(&Mode::Rehearse).is_none());
    assert!(RealCallPermit::for_mode(&real()).is_some());
    assert!(RealCallPermit::for_mode(&shadow()).is_some());
}

/// Random actor/simulator outputs, random approvals: rehearse mode never asks for a real call.
#[test]
fn rehearse_mode_never_emits_execute_real() {
    let mut rng = StdRng::seed_from_u64(7);
    let names = ["get_balance", "transfer", "unknown"];
    for _ in 0..300 {
        let mut script = Script::default();
        for _ in 0..rng.random_range(1..8) {
            let t = match rng.random_range(0..4) {
                0 => "answer".to_string(),
                1 => "<tool_call>broken".to_string(),
                _ => {
                    let k = rng.random_range(1..3);
                    (0..k)
                        .map(|_| call_text(names[rng.random_range(0..3)], json!({"x": 1})))
                        .collect()
                }
            };
            script.actor.push_back(t);
            script.sim.push_back(match rng.random_range(0..4) {
                0 => "nonsense".into(),
                1 => result_text(json!({"error_tool_call": {"code": "c", "message": "m"}})),
                _ => result_text(json!({"ok": true})),
            });
        }
        let mut c = cfg(Mode::Rehearse);
        if rng.random_bool(0.5) {
            c.sim_failure = SimFailurePolicy::ShowErrorToActor;
        }
        let r = run(spec(&["a", "b"]), c, script);
        assert!(r.real_calls().is_empty());
        assert!(r.approvals().is_empty());
        assert!(
            !r.effects
                .iter()
                .any(|e| matches!(e, Effect::ExecuteReal { .. }))
        );
        r.as_session();
    }
}
