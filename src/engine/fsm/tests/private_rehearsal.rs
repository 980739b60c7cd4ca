//! Private Rehearsal: branches before irreversible calls, their memory and commit rules.

use super::*;

#[test]
fn private_rehearsal_runs_only_before_irreversible_calls() {
    let mode = with_rehearsal(
        Mode::Real,
        pr(2, RehearsalStrategy::Sequential, RehearsalDepth::Turns(1)),
    );
    let r = run(
        spec(&["bal"]),
        cfg(mode),
        Script::default().actor(&[&call_text("get_balance", json!({})), "5"]),
    );
    assert_eq!(r.count("rehearsal_start"), 0);
    assert!(r.generates(GenRole::Simulator).is_empty());
    assert_eq!(r.real_calls().len(), 1);
}

#[test]
fn every_call_trigger_rehearses_reversible_calls_too() {
    let mut p = pr(1, RehearsalStrategy::Sequential, RehearsalDepth::Turns(1));
    p.trigger = RehearsalTrigger::EveryCall;
    let get = call_text("get_balance", json!({}));
    let r = run(
        spec(&["bal"]),
        cfg(with_rehearsal(Mode::Real, p)),
        Script::default()
            .actor(&[&get, &get, "5"])
            .sim(vec![result_text(json!({"balance": 5}))]),
    );
    assert_eq!(r.count("rehearsal_start"), 1);
    assert_eq!(r.real_calls().len(), 1);
}

#[test]
fn parallel_rehearsal_batches_first_steps_and_runs_n_branches_before_one_real_call() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mode = with_rehearsal(
        Mode::Real,
        pr(3, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1)),
    );
    let r = run(
        spec(&["pay 5"]),
        cfg(mode),
        Script::default()
            // proposal, 2 batched first steps, commit, final answer
            .actor_owned(vec![
                transfer.clone(),
                transfer.clone(),
                call_text("transfer", json!({"amount": 50})),
                transfer.clone(),
                "Paid.".into(),
            ])
            .sim(vec![
                result_text(json!({"ok": true})),
                result_text(json!({"ok": true})),
                result_text(json!({"error_tool_call": {"code": "limit", "message": "too much"}})),
            ]),
    );
    let actor = r.generates(GenRole::Actor);
    assert_eq!(
        actor[1].n, 2,
        "first steps of branches 1 and 2 in one batch"
    );
    assert_eq!(actor[1].branch, Some(1));
    assert_eq!(r.generates(GenRole::Simulator).len(), 3);
    assert!(
        r.generates(GenRole::Simulator)
            .iter()
            .all(|g| g.branch.is_some())
    );
    assert_eq!(
        r.real_calls().len(),
        1,
        "only the committed call runs for real"
    );
    assert_eq!(r.count("branch_start"), 3);
    assert_eq!(r.count("branch_end"), 3);
    assert_eq!(r.count("rehearsal_memory"), 1);
    let o = r.outcome();
    assert_eq!(o.stats.rehearsals, 1);
    assert_eq!(o.stats.rehearsal_branches, 3);
    assert_eq!(o.trace.actions.len(), 1);
    // Commit prompt holds the memory; the proposal never entered the conversation.
    let commit = &actor[2].messages;
    let note = &commit.last().expect("memory").content;
    assert!(note.contains("Private rehearsal"), "{note}");
    assert!(
        note.contains("(×2)"),
        "dedupe merges the two identical branches: {note}"
    );
    assert!(note.contains("call rejected: limit"), "{note}");
    assert!(!commit.iter().any(|m| !m.tool_calls.is_empty()));
    // Branch prompts never include the memory (parallel = independent).
    assert!(
        !actor[1]
            .messages
            .iter()
            .any(|m| m.content.contains("Private rehearsal"))
    );
}

#[test]
fn sequential_rehearsal_shows_earlier_branches_to_later_ones() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mode = with_rehearsal(
        Mode::Real,
        pr(2, RehearsalStrategy::Sequential, RehearsalDepth::Turns(1)),
    );
    let r = run(
        spec(&["pay"]),
        cfg(mode),
        Script::default()
            .actor_owned(vec![
                transfer.clone(),
                transfer.clone(),
                transfer.clone(),
                "ok".into(),
            ])
            .sim(vec![
                result_text(json!({"ok": 1})),
                result_text(json!({"ok": 2})),
            ]),
    );
    let actor = r.generates(GenRole::Actor);
    // proposal, branch 1 (n=1, sees branch 0), commit, answer
    assert_eq!(actor.len(), 4);
    assert_eq!(actor[1].n, 1);
    assert_eq!(actor[1].branch, Some(1));
    let note = &actor[1].messages.last().expect("memory").content;
    assert!(
        note.contains("{\"ok\":1}") && !note.contains("{\"ok\":2}"),
        "{note}"
    );
    let commit_note = &actor[2].messages.last().expect("memory").content;
    assert!(commit_note.contains("{\"ok\":1}") && commit_note.contains("{\"ok\":2}"));
}

#[test]
fn commit_turn_is_not_rehearsed_again() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mode = with_rehearsal(
        Mode::Real,
        pr(1, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1)),
    );
    let r = run(
        spec(&["pay"]),
        cfg(mode),
        Script::default()
            .actor_owned(vec![transfer.clone(), transfer.clone(), "done".into()])
            .sim(vec![result_text(json!({"ok": true}))]),
    );
    assert_eq!(r.count("rehearsal_start"), 1);
    assert_eq!(r.real_calls().len(), 1);
    assert_eq!(r.outcome().end, EndReason::Answered);
}

#[test]
fn draft_unless_failure_commits_the_draft_when_its_branch_did_not_fail() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mut p = pr(2, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1));
    p.memory.commit = CommitRule::DraftUnlessFailure;
    let r = run(
        spec(&["pay"]),
        cfg(with_rehearsal(Mode::Real, p)),
        Script::default()
            // proposal, branch 1's first step (a slip), then straight to the answer: the actor
            // is not asked again before the real call.
            .actor_owned(vec![
                transfer.clone(),
                call_text("transfer", json!({"amount": 50})),
                "Paid.".into(),
            ])
            .sim(vec![
                result_text(json!({"ok": true})),
                result_text(json!({"error_tool_call": {"code": "limit", "message": "too much"}})),
            ]),
    );
    let actor = r.generates(GenRole::Actor);
    assert_eq!(
        actor.len(),
        3,
        "proposal, one batched branch step, final answer"
    );
    assert!(
        !actor[2]
            .messages
            .iter()
            .any(|m| m.content.contains("Private rehearsal")),
        "no memory prompt: the draft was committed"
    );
    assert_eq!(
        r.count("rehearsal_memory"),
        1,
        "the memory is still on record"
    );
    let calls = r.real_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].arguments, json!({"amount": 5}), "the drafted call");
    assert_eq!(r.outcome().end, EndReason::Answered);
}

#[test]
fn draft_unless_failure_asks_again_when_the_drafts_branch_failed() {
    let transfer = call_text("transfer", json!({"amount": 50}));
    let mut p = pr(1, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1));
    p.memory.commit = CommitRule::DraftUnlessFailure;
    let r = run(
        spec(&["pay"]),
        cfg(with_rehearsal(Mode::Real, p)),
        Script::default()
            .actor_owned(vec![
                transfer,
                call_text("transfer", json!({"amount": 5})),
                "Paid.".into(),
            ])
            .sim(vec![result_text(
                json!({"error_tool_call": {"code": "limit", "message": "too much"}}),
            )]),
    );
    let actor = r.generates(GenRole::Actor);
    assert_eq!(actor.len(), 3, "proposal, commit with the memory, answer");
    let note = &actor[1].messages.last().expect("memory").content;
    assert!(note.contains("call rejected: limit"), "{note}");
    assert_eq!(r.real_calls()[0].arguments, json!({"amount": 5}));
}

#[test]
fn branch_runs_to_the_end_when_depth_is_unbounded() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mode = with_rehearsal(
        Mode::Real,
        pr(1, RehearsalStrategy::Parallel, RehearsalDepth::ToEnd),
    );
    let r = run(
        spec(&["pay"]),
        cfg(mode),
        Script::default()
            .actor_owned(vec![
                transfer.clone(),
                call_text("get_balance", json!({})),
                "imagined done".into(),
                transfer.clone(),
                "done".into(),
            ])
            .sim(vec![
                result_text(json!({"ok": true})),
                result_text(json!({"balance": 0})),
            ]),
    );
    let end = r
        .events
        .iter()
        .find_map(|e| match &e.event {
            EventBody::BranchEnd { summary } => Some(summary.clone()),
            _ => None,
        })
        .expect("branch end");
    assert_eq!(end.steps.len(), 2);
    assert_eq!(
        end.end,
        BranchEnd::Answered {
            text: "imagined done".into()
        }
    );
    assert_eq!(end.prediction, Prediction::Success);
    assert_eq!(r.real_calls().len(), 1);
}

#[test]
fn approval_request_after_rehearsal_carries_the_verdict() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mode = Mode::Real(LiveOptions {
        approval: ApprovalGate::Irreversible,
        private_rehearsal: Some(pr(2, RehearsalStrategy::Parallel, RehearsalDepth::ToEnd)),
    });
    let r = run(
        spec(&["pay"]),
        cfg(mode),
        Script::default()
            .actor_owned(vec![
                transfer.clone(),
                transfer.clone(),
                "paid".into(),
                transfer.clone(),
                "paid".into(),
            ])
            .sim(vec![
                result_text(json!({"error_tool_call": {"code": "x", "message": "y"}})),
                result_text(json!({"ok": true})),
            ]),
    );
    let asks = r.approvals();
    assert_eq!(asks.len(), 1);
    assert_eq!(
        asks[0].rehearsal,
        Some(RehearsalVerdict {
            branches: 2,
            predicted_success: 1,
            predicted_failure: 1
        })
    );
}

#[test]
fn shadow_mode_with_rehearsal_records_branches_and_fidelity() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mode = with_rehearsal(
        Mode::Shadow,
        pr(1, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1)),
    );
    let r = run(
        spec(&["pay"]),
        cfg(mode),
        Script::default()
            .actor_owned(vec![transfer.clone(), transfer.clone(), "done".into()])
            .sim(vec![
                result_text(json!({"ok": true})),
                result_text(json!({"ok": false})),
            ]),
    );
    assert_eq!(r.real_calls().len(), 1);
    assert_eq!(r.count("fidelity"), 1);
    assert_eq!(r.outcome().stats.fidelity.total().exact, 0);
}

#[test]
fn session_from_a_rehearsed_episode_validates_and_rebuilds_its_branch_tree() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mode = with_rehearsal(
        Mode::Real,
        pr(3, RehearsalStrategy::Parallel, RehearsalDepth::Turns(2)),
    );
    let r = run(
        spec(&["pay"]),
        cfg(mode),
        Script::default()
            .actor_owned(vec![
                transfer.clone(),
                transfer.clone(),
                "<tool_call>bad</tool_call>".into(),
                "imagined answer".into(),
                "imagined answer 2".into(),
                transfer.clone(),
                "done".into(),
            ])
            .sim(vec![
                result_text(json!({"ok": true})),
                result_text(json!({"ok": true})),
            ]),
    );
    let s = r.as_session();
    let tree = SessionTree::build(&s.events);
    let branches = tree.branches();
    assert_eq!(branches.len(), 3);
    let idx: Vec<usize> = branches.iter().map(|b| b.index).collect();
    assert_eq!(idx, [0, 1, 2]);
    for b in &branches {
        assert!(matches!(
            s.events[b.rehearsal].event,
            EventBody::RehearsalStart { .. }
        ));
        assert!(matches!(
            s.events[*b.events.last().expect("events")].event,
            EventBody::BranchEnd { .. }
        ));
    }
    // The main line holds no branch event and ends with the reward.
    let main = tree.main_line();
    assert!(main.iter().all(|&i| !matches!(
        s.events[i].event,
        EventBody::BranchStart { .. } | EventBody::BranchEnd { .. }
    )));
    assert!(matches!(
        s.events[*main.last().expect("main")].event,
        EventBody::Reward { .. }
    ));
    let ends: Vec<BranchEnd> = s
        .events
        .iter()
        .filter_map(|e| match &e.event {
            EventBody::BranchEnd { summary } => Some(summary.end.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(ends[2], BranchEnd::ActorFormatError);
}
