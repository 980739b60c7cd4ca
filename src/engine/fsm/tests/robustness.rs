//! Robustness: stale events, cancellation, model errors.

use super::*;

#[test]
fn stale_and_unexpected_events_are_ignored() {
    let mut e = Engine::new(spec(&["hi"]), cfg(real())).expect("engine");
    let _ = e.handle(Event::Start);
    assert!(
        e.handle(Event::GenerationDone {
            id: 99,
            generations: vec![gen_of("x")]
        })
        .is_empty()
    );
    assert!(
        e.handle(Event::RealResult {
            id: 0,
            response: ToolResponse::Success { value: json!(1) }
        })
        .is_empty()
    );
    assert!(
        e.handle(Event::ApprovalDecision {
            id: 0,
            decision: Decision::Approve
        })
        .is_empty()
    );
    assert!(
        e.handle(Event::Error {
            id: Some(42),
            message: "other".into()
        })
        .is_empty()
    );
    assert_eq!(e.state_name(), "actor");
    assert!(e.handle(Event::Start).is_empty());
}

#[test]
fn cancel_ends_the_episode_without_a_score() {
    let mut e = Engine::new(spec(&["hi"]), cfg(real())).expect("engine");
    let _ = e.handle(Event::Start);
    let effects = e.handle(Event::Cancel);
    let Some(Effect::Finish(o)) = effects.last() else {
        panic!("no finish: {effects:?}")
    };
    assert_eq!(o.end, EndReason::Cancelled);
    assert_eq!(o.score, None);
    assert!(!effects.iter().any(|f| matches!(f, Effect::Score { .. })));
    assert!(e.is_done());
    assert!(e.handle(Event::Cancel).is_empty());
}

#[test]
fn model_error_fails_the_episode_without_a_score() {
    let mut e = Engine::new(spec(&["hi"]), cfg(real())).expect("engine");
    let _ = e.handle(Event::Start);
    let effects = e.handle(Event::Error {
        id: Some(0),
        message: "oom".into(),
    });
    let Some(Effect::Finish(o)) = effects.last() else {
        panic!("no finish")
    };
    assert_eq!(
        o.end,
        EndReason::Failed {
            message: "oom".into()
        }
    );
    assert_eq!(o.score, None);
}

#[test]
fn empty_generation_list_fails_the_episode() {
    let mut e = Engine::new(spec(&["hi"]), cfg(real())).expect("engine");
    let _ = e.handle(Event::Start);
    let effects = e.handle(Event::GenerationDone {
        id: 0,
        generations: vec![],
    });
    assert!(
        matches!(effects.last(), Some(Effect::Finish(o)) if matches!(o.end, EndReason::Failed { .. }))
    );
}

#[test]
fn scoring_error_finishes_failed_without_a_score_and_is_recorded() {
    let mut e = Engine::new(spec(&["hi"]), cfg(real())).expect("engine");
    let _ = e.handle(Event::Start);
    let effects = e.handle(Event::GenerationDone {
        id: 0,
        generations: vec![gen_of("hi")],
    });
    let Some(Effect::Score { id, .. }) = effects.last() else {
        panic!("no score")
    };
    let effects = e.handle(Event::Error {
        id: Some(*id),
        message: "scorer crashed".into(),
    });
    // The outcome says why there is no score (an environment failure, exit 3 in the CLI), and
    // the session records it.
    assert!(
        matches!(effects.last(), Some(Effect::Finish(o)) if o.score.is_none()
            && o.end == EndReason::Failed { message: "scoring failed: scorer crashed".into() }),
        "{effects:?}"
    );
    assert!(effects.iter().any(|f| matches!(f, Effect::Persist(n)
        if matches!(&n.event, EventBody::ScoringFailed { message } if message == "scorer crashed"))));
}

#[test]
fn same_script_gives_identical_events() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let script = || {
        Script::default()
            .actor_owned(vec![
                transfer.clone(),
                transfer.clone(),
                transfer.clone(),
                "ok".into(),
            ])
            .sim(vec![
                result_text(json!({"a": 1})),
                result_text(json!({"b": 2})),
            ])
    };
    let mode = with_rehearsal(
        Mode::Shadow,
        pr(2, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1)),
    );
    let a = run(spec(&["x"]), cfg(mode.clone()), script());
    let b = run(spec(&["x"]), cfg(mode), script());
    assert_eq!(a.events, b.events);
    assert_eq!(a.effects, b.effects);
}

#[test]
fn request_seeds_are_distinct_and_reproducible() {
    let t = call_text("get_balance", json!({}));
    let r = run(
        spec(&["x"]),
        cfg(shadow()),
        Script::default().actor(&[&t, "ok"]),
    );
    let seeds: Vec<u64> = r
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Generate(g) => Some(g.sampling.seed),
            _ => None,
        })
        .collect();
    let mut unique = seeds.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), seeds.len());
}
