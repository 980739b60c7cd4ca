//! Starting from a played history (the debugger's forks).

use super::*;

fn calls_msg(calls: &[(&str, &str, Value)]) -> Message {
    Message {
        tool_calls: calls
            .iter()
            .map(|(id, name, args)| crate::message::MessageToolCall {
                id: id.to_string(),
                kind: "function".into(),
                function: ToolCall {
                    name: name.to_string(),
                    arguments: args.clone(),
                },
            })
            .collect(),
        ..Message::assistant("")
    }
}

fn tool_msg(id: &str, name: &str, v: Value) -> Message {
    Message::tool(id, name, v.to_string())
}

fn run_from(
    spec: EpisodeSpec,
    cfg: EngineConfig,
    history: Vec<Message>,
    mut script: Script,
) -> Run {
    let mut e = Engine::new(spec, cfg)
        .expect("engine")
        .with_history(history)
        .expect("history");
    let r = drive(&mut e, &mut script);
    assert!(e.is_done(), "engine should be done, is {}", e.state_name());
    r
}

fn persisted_messages(r: &Run) -> Vec<Message> {
    r.events
        .iter()
        .filter_map(|e| match &e.event {
            EventBody::Message { message } => Some(message.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn empty_history_starts_like_an_ordinary_episode() {
    let script =
        || Script::default().actor(&[&call_text("get_balance", json!({"id": "a"})), "Done."]);
    let a = run(spec(&["hi"]), cfg(real()), script());
    let b = run_from(spec(&["hi"]), cfg(real()), vec![], script());
    assert_eq!(a.events, b.events);
    assert_eq!(a.effects, b.effects);
}

#[test]
fn history_is_persisted_after_the_initial_conversation_and_its_calls_enter_the_trace() {
    let history = vec![
        calls_msg(&[("call_0", "get_balance", json!({"id": "a"}))]),
        tool_msg("call_0", "get_balance", json!({"balance": 7})),
        calls_msg(&[("call_3", "transfer", json!({"amount": 5}))]),
        tool_msg(
            "call_3",
            "transfer",
            json!({"error": {"code": REJECTED_BY_USER, "message": "no"}}),
        ),
    ];
    let r = run_from(
        spec(&["hi"]),
        cfg(real()),
        history.clone(),
        Script::default().actor(&[&call_text("get_balance", json!({"id": "b"})), "Done."]),
    );
    assert_eq!(
        &r.kinds()[..7],
        [
            "episode_start",
            "message",
            "message",
            "message",
            "message",
            "message",
            "message"
        ]
    );
    let msgs = persisted_messages(&r);
    assert_eq!(&msgs[2..6], &history[..]);
    // The actor's first prompt is the whole history.
    assert_eq!(r.generates(GenRole::Actor)[0].messages[2..], history[..]);
    // Played calls (not the rejected one) and the new call, in order.
    let actions: Vec<&Value> = r
        .outcome()
        .trace
        .actions
        .iter()
        .map(|c| &c.arguments)
        .collect();
    assert_eq!(actions, [&json!({"id": "a"}), &json!({"id": "b"})]);
    assert_eq!(r.outcome().trace.agent_messages, ["Done."]);
    // New call ids continue after the history's.
    let new_call = msgs
        .iter()
        .rev()
        .find(|m| !m.tool_calls.is_empty())
        .expect("call");
    assert_eq!(new_call.tool_calls[0].id, "call_4");
    // Only what this engine generated is counted.
    assert_eq!(r.outcome().stats.actor_turns, 2);
    assert_eq!(r.outcome().stats.real_calls, 1);
    assert_eq!(played_calls(&history).len(), 1);
}

#[test]
fn history_turns_count_toward_the_turn_limit() {
    let history = vec![
        calls_msg(&[("call_0", "get_balance", json!({"id": "a"}))]),
        tool_msg("call_0", "get_balance", json!({"balance": 7})),
        calls_msg(&[("call_1", "get_balance", json!({"id": "b"}))]),
        tool_msg("call_1", "get_balance", json!({"balance": 8})),
    ];
    let mut c = cfg(real());
    c.max_turns = 3;
    let r = run_from(
        spec(&["hi"]),
        c.clone(),
        history.clone(),
        Script::default().actor(&[&call_text("get_balance", json!({"id": "c"}))]),
    );
    assert_eq!(r.generates(GenRole::Actor).len(), 1);
    assert_eq!(r.outcome().end, EndReason::TurnLimit);
    assert_eq!(r.outcome().trace.actions.len(), 3);
    // With the limit already reached, the actor is not asked at all.
    c.max_turns = 2;
    let r = run_from(spec(&["hi"]), c, history, Script::default());
    assert!(r.generates(GenRole::Actor).is_empty());
    assert_eq!(r.outcome().end, EndReason::TurnLimit);
}

#[test]
fn history_consumes_user_turns_and_the_next_scripted_turn_follows() {
    let history = vec![Message::assistant("A1"), Message::user("two")];
    let r = run_from(
        spec(&["one", "two", "three"]),
        cfg(real()),
        history,
        Script::default().actor(&["A2", "A3"]),
    );
    let texts: Vec<String> = persisted_messages(&r)
        .into_iter()
        .map(|m| m.content)
        .collect();
    assert_eq!(
        texts,
        [
            "Policy: be careful.",
            "one",
            "A1",
            "two",
            "A2",
            "three",
            "A3"
        ]
    );
    assert_eq!(r.outcome().end, EndReason::Answered);
    assert_eq!(r.outcome().trace.agent_messages, ["A1", "A2", "A3"]);
}

#[test]
fn each_answer_records_how_many_calls_were_committed_by_then() {
    // Live: one call in turn 1, two in turn 2.
    let t = call_text("get_balance", json!({"id": "a"}));
    let r = run(
        spec(&["first", "second"]),
        cfg(real()),
        Script::default().actor(&[&t, "A1", &t, &t, "A2"]),
    );
    assert_eq!(r.outcome().trace.agent_messages, ["A1", "A2"]);
    assert_eq!(r.outcome().trace.turn_ends, [1, 3]);
    // From a history: its played calls count (a rejected one does not), then the live turn's.
    let history = vec![
        calls_msg(&[
            ("call_0", "get_balance", json!({"id": "a"})),
            ("call_1", "get_balance", json!({"id": "b"})),
        ]),
        tool_msg("call_0", "get_balance", json!({"balance": 5})),
        tool_msg(
            "call_1",
            "get_balance",
            json!({"error": {"code": REJECTED_BY_USER, "message": "no"}}),
        ),
        Message::assistant("A1"),
        Message::user("second"),
    ];
    let r = run_from(
        spec(&["first", "second"]),
        cfg(real()),
        history,
        Script::default().actor(&[&t, "A2"]),
    );
    assert_eq!(r.outcome().trace.agent_messages, ["A1", "A2"]);
    assert_eq!(r.outcome().trace.turn_ends, [1, 2]);
}

#[test]
fn history_ending_in_a_final_answer_sends_the_next_user_turn_or_ends() {
    let r = run_from(
        spec(&["one"]),
        cfg(real()),
        vec![Message::assistant("All done.")],
        Script {
            reward: 1.0,
            ..Script::default()
        },
    );
    assert!(r.generates(GenRole::Actor).is_empty());
    assert_eq!(r.outcome().end, EndReason::Answered);
    assert_eq!(r.outcome().reward(), 1.0);
    assert_eq!(r.outcome().trace.agent_messages, ["All done."]);

    let r = run_from(
        spec(&["one", "two"]),
        cfg(real()),
        vec![Message::assistant("A1")],
        Script::default().actor(&["A2"]),
    );
    let first = &r.generates(GenRole::Actor)[0].messages;
    assert_eq!(first.last(), Some(&Message::user("two")));
    assert_eq!(r.outcome().end, EndReason::Answered);
}

#[test]
fn pending_calls_of_the_history_run_before_the_actor_is_asked() {
    let history = vec![
        calls_msg(&[
            ("call_0", "get_balance", json!({"id": "a"})),
            ("call_1", "transfer", json!({"amount": 5})),
        ]),
        tool_msg("call_0", "get_balance", json!({"balance": 7})),
    ];
    let r = run_from(
        spec(&["hi"]),
        cfg(real()),
        history,
        Script::default().actor(&["Sent."]),
    );
    // The unanswered transfer passes the approval gate and runs, then the actor answers.
    let first_acts: Vec<&str> = r
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Generate(_) => Some("generate"),
            Effect::AskApproval(_) => Some("approval"),
            Effect::ExecuteReal { .. } => Some("real"),
            _ => None,
        })
        .collect();
    assert_eq!(first_acts, ["approval", "real", "generate"]);
    assert_eq!(r.real_calls()[0].name, "transfer");
    assert_eq!(r.outcome().trace.actions.len(), 2);
    assert_eq!(r.outcome().end, EndReason::Answered);
}

#[test]
fn rehearse_mode_scores_the_history_calls_with_the_verifier() {
    let history = vec![
        calls_msg(&[("call_0", "transfer", json!({"amount": 5}))]),
        tool_msg("call_0", "transfer", json!({"ok": true})),
    ];
    let r = run_from(
        spec(&["hi"]),
        cfg(Mode::Rehearse),
        history,
        Script::default().actor(&["Sent."]),
    );
    let trace = r
        .effects
        .iter()
        .find_map(|e| match e {
            Effect::Score { trace, by, .. } => Some((trace.clone(), *by)),
            _ => None,
        })
        .expect("scored");
    assert_eq!(trace.1, ScoredBy::Verifier);
    assert_eq!(trace.0.actions.len(), 1);
    assert!(r.generates(GenRole::Simulator).is_empty());
}

#[test]
fn live_modes_learn_simulator_examples_from_the_history() {
    let history = vec![
        calls_msg(&[("call_0", "get_balance", json!({"id": "a"}))]),
        tool_msg("call_0", "get_balance", json!({"balance": 7})),
    ];
    for (mode, learned) in [(shadow(), 1), (Mode::Rehearse, 0)] {
        let mut e = Engine::new(spec(&["hi"]), cfg(mode))
            .expect("engine")
            .with_history(history.clone())
            .expect("history");
        e.handle(Event::Start);
        assert_eq!(e.examples.len(), learned);
    }
}

#[test]
fn histories_the_engine_could_not_have_played_are_refused() {
    let bad = |h: Vec<Message>, turns: &[&str]| {
        Engine::new(spec(turns), cfg(real()))
            .expect("engine")
            .with_history(h)
            .err()
    };
    let index_of = |e: Option<EngineError>| match e {
        Some(EngineError::BadHistory { index, .. }) => Some(index),
        _ => None,
    };
    assert_eq!(index_of(bad(vec![Message::system("x")], &["hi"])), Some(0));
    // A tool message for a call nobody made.
    assert_eq!(
        index_of(bad(
            vec![tool_msg("call_9", "get_balance", json!({}))],
            &["hi"]
        )),
        Some(0)
    );
    // A user message that does not follow a final answer.
    assert_eq!(
        index_of(bad(vec![Message::user("again")], &["hi", "again"])),
        Some(0)
    );
    // More user messages than scripted turns.
    assert_eq!(
        index_of(bad(
            vec![Message::assistant("a"), Message::user("b")],
            &["hi"]
        )),
        Some(1)
    );
    // An assistant message while a call has no result.
    assert_eq!(
        index_of(bad(
            vec![
                calls_msg(&[("call_0", "get_balance", json!({}))]),
                Message::assistant("x")
            ],
            &["hi"]
        )),
        Some(1)
    );
    // Pending calls at the very end are fine.
    assert!(
        bad(
            vec![calls_msg(&[("call_0", "get_balance", json!({}))])],
            &["hi"]
        )
        .is_none()
    );
}

#[test]
fn best_branch_commits_a_siblings_different_call_when_the_draft_failed() {
    let mut p = pr(2, RehearsalStrategy::Parallel, RehearsalDepth::Turns(2));
    p.memory.commit = CommitRule::BestBranch;
    let r = run(
        spec(&["pay"]),
        cfg(with_rehearsal(Mode::Real, p)),
        Script::default()
            // proposal, branch 1's first step (batched), each branch's imagined answer, then
            // the real answer: the actor is never asked again with the memory.
            .actor_owned(vec![
                call_text("transfer", json!({"amount": 50})),
                call_text("transfer", json!({"amount": 5})),
                "imagined: refused".into(),
                "imagined: paid".into(),
                "Paid.".into(),
            ])
            .sim(vec![
                result_text(json!({"error": "insufficient funds"})),
                result_text(json!({"ok": true})),
            ]),
    );
    let actor = r.generates(GenRole::Actor);
    assert_eq!(actor.len(), 5);
    assert!(
        !actor
            .iter()
            .flat_map(|g| &g.messages)
            .any(|m| m.content.contains("Private rehearsal")),
        "no memory prompt"
    );
    let calls = r.real_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        calls[0].arguments,
        json!({"amount": 5}),
        "the call whose rehearsal succeeded"
    );
    assert_eq!(r.outcome().end, EndReason::Answered);
}

#[test]
fn best_branch_still_tries_the_draft_when_no_other_call_succeeded() {
    let transfer = call_text("transfer", json!({"amount": 50}));
    let mut p = pr(2, RehearsalStrategy::Parallel, RehearsalDepth::Turns(2));
    p.memory.commit = CommitRule::BestBranch;
    let r = run(
        spec(&["pay"]),
        cfg(with_rehearsal(Mode::Real, p)),
        Script::default()
            // Both branches make the same call and imagine it refused: the task may well want
            // the attempt (then a reply to the user), so the draft is tried, not dropped.
            .actor_owned(vec![
                transfer.clone(),
                transfer,
                "imagined: refused".into(),
                "imagined: refused".into(),
                "Sorry, it was refused.".into(),
            ])
            .sim(vec![
                result_text(json!({"error": "insufficient funds"})),
                result_text(json!({"error": "insufficient funds"})),
            ]),
    );
    assert_eq!(r.generates(GenRole::Actor).len(), 5);
    let calls = r.real_calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].arguments, json!({"amount": 50}), "the draft");
    assert_eq!(r.outcome().end, EndReason::Answered);
}

/// A call refused for real, proposed again: rehearsal recalls the refusal for branch 0 instead
/// of asking the simulator (which, on the bundled model, imagined it succeeding), so best-branch
/// commits the sibling's different call.
fn recall_script() -> Script {
    let fifty = call_text("transfer", json!({"amount": 50}));
    Script::default()
        .actor_owned(vec![
            // Rehearsal 1: draft and sibling both transfer 50, both imagined fine.
            fifty.clone(),
            fifty.clone(),
            "imagined: paid".into(),
            "imagined: paid".into(),
            // The real transfer is refused; the actor proposes it again. Rehearsal 2: the
            // sibling tries 5.
            fifty,
            call_text("transfer", json!({"amount": 5})),
            "imagined: refused".into(),
            "imagined: paid".into(),
            "Paid 5.".into(),
        ])
        .sim(vec![
            result_text(json!({"ok": true})),
            result_text(json!({"ok": true})),
            // Without recall, branch 0 of rehearsal 2 reads this one.
            result_text(json!({"ok": true})),
            result_text(json!({"ok": true})),
        ])
        .real(vec![
            ToolResponse::Error {
                code: "insufficient_funds".into(),
                message: "balance 20".into(),
            },
            ToolResponse::Success {
                value: json!({"ok": true}),
            },
        ])
}

/// [`recall_script`] in the real environment with two best-branch branches of depth 2.
fn run_recall_script(recall_errors: bool) -> Run {
    let mut p = pr(2, RehearsalStrategy::Parallel, RehearsalDepth::Turns(2));
    p.memory.commit = CommitRule::BestBranch;
    p.recall_errors = recall_errors;
    run(
        spec(&["pay"]),
        cfg(with_rehearsal(Mode::Real, p)),
        recall_script(),
    )
}

#[test]
fn rehearsal_recalls_the_real_error_of_an_identical_call_instead_of_imagining_it() {
    let r = run_recall_script(true);
    let amounts: Vec<&Value> = r.real_calls().iter().map(|c| &c.arguments).collect();
    assert_eq!(
        amounts,
        [&json!({"amount": 50}), &json!({"amount": 5})],
        "the refused call is not committed again"
    );
    assert_eq!(
        r.generates(GenRole::Simulator).len(),
        3,
        "one call recalled"
    );
    assert_eq!(r.outcome().stats.rehearsal_recalls, 1);
    let recalled: Vec<&EventBody> = r
        .events
        .iter()
        .map(|e| &e.event)
        .filter(|e| matches!(e, EventBody::Simulated { recalled: true, .. }))
        .collect();
    assert_eq!(recalled.len(), 1);
    let EventBody::Simulated { outcome, .. } = recalled[0] else {
        unreachable!()
    };
    assert_eq!(
        outcome.value(),
        Some(json!({"error": {"code": "insufficient_funds", "message": "balance 20"}}))
    );
    assert_eq!(r.outcome().end, EndReason::Answered);
    // The recalled flag survives the session round trip, and the replay says so.
    let s = r.as_session();
    let text = crate::session::render_replay(&s);
    assert!(text.contains("recalled transfer[call_"), "{text}");
    assert_eq!(
        s.events
            .iter()
            .filter(|e| matches!(e.event, EventBody::Simulated { recalled: true, .. }))
            .count(),
        1
    );
}

#[test]
fn without_recall_the_simulator_imagines_the_refused_call_and_it_is_retried() {
    let r = run_recall_script(false);
    assert_eq!(r.generates(GenRole::Simulator).len(), 4);
    assert_eq!(r.outcome().stats.rehearsal_recalls, 0);
    assert_eq!(r.real_calls()[1].arguments, json!({"amount": 50}));
}

#[test]
fn an_irreversible_call_that_succeeds_clears_the_recalled_errors() {
    let fifty = call_text("transfer", json!({"amount": 50}));
    let ten = call_text("transfer", json!({"amount": 10}));
    let mut p = pr(1, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1));
    p.memory.commit = CommitRule::BestBranch;
    p.recall_errors = true;
    let r = run(
        spec(&["pay"]),
        cfg(with_rehearsal(Mode::Real, p)),
        Script::default()
            // One branch of depth 1 per rehearsal: each irreversible proposal costs one
            // simulation unless it is recalled.
            .actor_owned(vec![fifty.clone(), ten, fifty, "Done.".into()])
            .real(vec![
                ToolResponse::Error {
                    code: "insufficient_funds".into(),
                    message: "balance 20".into(),
                },
                ToolResponse::Success {
                    value: json!({"ok": true}),
                },
                ToolResponse::Success {
                    value: json!({"ok": true}),
                },
            ]),
    );
    // The second transfer 50 comes after a successful transfer: the state the refusal was
    // observed in is gone, so the simulator is asked again.
    assert_eq!(r.generates(GenRole::Simulator).len(), 3);
    assert_eq!(r.outcome().stats.rehearsal_recalls, 0);
    assert_eq!(r.real_calls().len(), 3);
}

#[test]
fn the_siblings_first_steps_sample_at_the_explore_temperature() {
    let mut p = pr(3, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1));
    p.sampling.temperature = 0.3;
    p.explore_temperature = Some(1.0);
    let r = run(
        spec(&["pay"]),
        cfg(with_rehearsal(Mode::Real, p.clone())),
        Script::default().actor_owned(vec![
            call_text("transfer", json!({"amount": 5})),
            call_text("transfer", json!({"amount": 5})),
            call_text("transfer", json!({"amount": 5})),
        ]),
    );
    let branch_actor: Vec<f64> = r
        .generates(GenRole::Actor)
        .iter()
        .filter(|g| g.branch.is_some())
        .map(|g| g.sampling.temperature)
        .collect();
    assert_eq!(
        branch_actor,
        [1.0],
        "one batched request for branches 1 and 2"
    );
    assert!(
        r.generates(GenRole::Simulator)
            .iter()
            .all(|g| g.sampling.temperature == 0.3)
    );
    // Sequential branches ask one by one; the first step of each sibling explores, later
    // imagined turns do not.
    p.strategy = RehearsalStrategy::Sequential;
    p.depth = RehearsalDepth::Turns(2);
    let r = run(
        spec(&["pay"]),
        cfg(with_rehearsal(Mode::Real, p)),
        Script::default()
            .actor_owned(vec![
                call_text("transfer", json!({"amount": 5})),
                "imagined".into(),
                call_text("transfer", json!({"amount": 5})),
                "imagined".into(),
                call_text("transfer", json!({"amount": 5})),
                "imagined".into(),
            ])
            .sim(vec![result_text(json!({"ok": true})); 3]),
    );
    let temps: Vec<f64> = r
        .generates(GenRole::Actor)
        .iter()
        .filter(|g| g.branch.is_some())
        .map(|g| g.sampling.temperature)
        .collect();
    // Branch 0: its second turn (0.3). Branches 1 and 2: first step (1.0), second turn (0.3).
    assert_eq!(temps, [0.3, 1.0, 0.3, 1.0, 0.3]);
}

#[test]
fn rehearse_mode_recalls_recorded_responses_for_exactly_matching_calls_when_asked() {
    let recorded = RecordedExample {
        name: "transfer".into(),
        arguments: json!({"amount": 5}),
        response: json!({"tx": "tx_9"}),
    };
    let mut s = spec(&["pay"]);
    s.examples = vec![recorded];
    let script = || {
        Script::default()
            .actor_owned(vec![
                call_text("transfer", json!({"amount": 5})),
                call_text("transfer", json!({"amount": 7})),
                "Paid.".into(),
            ])
            .sim(vec![
                result_text(json!({"tx": "tx_imagined"})),
                result_text(json!({"tx": "tx_other"})),
            ])
    };
    let mut c = cfg(Mode::Rehearse);
    c.recall_recorded = true;
    let r = run(s.clone(), c, script());
    // The recorded call is answered from the record; the other one by the simulator.
    let sims = r.generates(GenRole::Simulator);
    assert_eq!(sims.len(), 1);
    let shown: Vec<(bool, Option<Value>)> = r
        .events
        .iter()
        .filter_map(|e| match &e.event {
            EventBody::Simulated {
                outcome, recalled, ..
            } => Some((*recalled, outcome.value())),
            _ => None,
        })
        .collect();
    assert_eq!(
        shown,
        [
            (true, Some(json!({"tx": "tx_9"}))),
            (false, Some(json!({"tx": "tx_imagined"})))
        ]
    );
    assert_eq!(r.outcome().stats.recalled_calls, 1);
    assert_eq!(r.outcome().stats.simulated_calls, 2);
    assert!(
        r.real_calls().is_empty(),
        "rehearse mode never reaches the environment"
    );
    // Off (the default): the simulator answers both.
    let r = run(s, cfg(Mode::Rehearse), script());
    assert_eq!(r.generates(GenRole::Simulator).len(), 2);
    assert_eq!(r.outcome().stats.recalled_calls, 0);
}

#[test]
fn constrained_tool_names_reach_every_actor_request_and_no_simulator_request() {
    let transfer = call_text("transfer", json!({"amount": 5}));
    let mode = with_rehearsal(
        Mode::Real,
        pr(2, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1)),
    );
    let script = || {
        Script::default()
            .actor_owned(vec![
                transfer.clone(),
                transfer.clone(),
                transfer.clone(),
                "Paid.".into(),
            ])
            .sim(vec![
                result_text(json!({"ok": true})),
                result_text(json!({"ok": true})),
            ])
    };
    let mut c = cfg(mode.clone());
    c.constrain_tool_names = true;
    let r = run(spec(&["pay 5"]), c, script());
    let actor = r.generates(GenRole::Actor);
    assert!(actor.len() >= 3, "proposal, branch step, commit, answer");
    assert!(actor.iter().any(|g| g.branch.is_some()));
    for g in &actor {
        assert_eq!(g.sampling.tool_names, ["get_balance", "transfer"]);
    }
    for g in r.generates(GenRole::Simulator) {
        assert!(g.sampling.tool_names.is_empty());
    }
    let r = run(spec(&["pay 5"]), cfg(mode), script());
    assert!(
        r.generates(GenRole::Actor)
            .iter()
            .all(|g| g.sampling.tool_names.is_empty())
    );
}
