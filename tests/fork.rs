//! Forks on the bundled model (`models/envace-tiny`), against the real bank domain: a fork at
//! the start reproduces the original event for event; an edited actor message runs its new call;
//! a later fork replays the history's calls on the live environment before its own calls run
//! (a balance read after a replayed transfer sees the transfer); an edited tool result is what
//! the new session's history shows while the environment and the score follow what really ran;
//! forks are refused, naming the event, for unknown events, rehearsal-branch events, wrong edit
//! targets, and MCP sessions.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::{Path, PathBuf};

use envace::engine::EpisodeOutcome;
use envace::engine::driver::{ApprovalPolicy, PolicyApprover, SharedModel, share_model};
use envace::engine::fork::{ForkEdit, ForkError, ForkRequest, fork_path, fork_spec};
use envace::engine::profile::PromptProfile;
use envace::engine::runner::{
    EpisodeConfig, ModeChoice, Policy, RunError, recorded_config, replay_history, run_domain_task,
    run_fork,
};
use envace::engine::spec::gold_conversation;
use envace::env::tasks::find_builtin;
use envace::env::{DomainEnv, Environment, ToolResponse};
use envace::message::{Message, Role};
use envace::runtime::{CancelToken, LocalModel};
use envace::session::{
    EventBody, EventRecord, Session, SessionTree, read_session, strip_timestamps,
};
use serde_json::{Value, json};

const TASK: &str = "bank-test-0001"; // "Move 669 from acc_965 to acc_519." (succeeds)
const TRANSFER: &str = r#"<tool_call>{"name":"transfer","arguments":{"src":"acc_965","dst":"acc_519","amount":669}}</tool_call>"#;
const BALANCE: &str =
    r#"<tool_call>{"name":"get_balance","arguments":{"acc":"acc_965"}}</tool_call>"#;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/envace-tiny")
}

fn model() -> (SharedModel, Option<PromptProfile>) {
    let dir = model_dir();
    let m = LocalModel::load_on(&dir, &candle_core::Device::Cpu, None).unwrap();
    (share_model(Box::new(m)), PromptProfile::read(&dir).unwrap())
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn record(m: &SharedModel, profile: Option<&PromptProfile>, opts: &EpisodeConfig, out: &Path) {
    let task = find_builtin(TASK).unwrap();
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    rt().block_on(run_domain_task(
        Policy { model: m, profile },
        task,
        opts,
        out,
        &mut approver,
        None,
        CancelToken::new(),
    ))
    .unwrap();
}

fn fork(
    m: &SharedModel,
    profile: Option<&PromptProfile>,
    req: &ForkRequest,
    opts: &EpisodeConfig,
) -> (PathBuf, Result<EpisodeOutcome, RunError>) {
    let out = fork_path(&req.session);
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    let r = rt().block_on(run_fork(
        Policy { model: m, profile },
        req,
        opts,
        &out,
        &mut approver,
        None,
        CancelToken::new(),
    ));
    (out, r)
}

fn request(session: &Path, at: &str, edit: Option<ForkEdit>) -> ForkRequest {
    ForkRequest {
        session: session.to_path_buf(),
        at_event: at.into(),
        edit,
    }
}

/// Main-line message events, in order.
fn main_messages(s: &Session) -> Vec<(&EventRecord, &Message)> {
    let tree = SessionTree::build(&s.events);
    tree.main_line()
        .into_iter()
        .filter_map(|i| match &s.events[i].event {
            EventBody::Message { message } => Some((&s.events[i], message)),
            _ => None,
        })
        .collect()
}

/// The event lines without timestamps, and their log-probs apart: the model reuses its cached
/// prompt prefix across runs, which moves log-probs in the 6th digit (tokens are unchanged).
fn body_lines(path: &Path) -> (Vec<Value>, Vec<f64>) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut logprobs = Vec::new();
    let lines = strip_timestamps(&text)
        .lines()
        .skip(1)
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            if let Some(Value::Array(lp)) = v["event"].as_object_mut().unwrap().remove("logprobs") {
                logprobs.extend(lp.iter().map(|x| x.as_f64().unwrap()));
            }
            v
        })
        .collect();
    (lines, logprobs)
}

fn actor_texts(s: &Session) -> Vec<String> {
    s.events
        .iter()
        .filter_map(|e| match &e.event {
            EventBody::Generation(g) => Some(g.text.clone()),
            _ => None,
        })
        .collect()
}

fn reward_event(s: &Session) -> Option<f64> {
    s.events.iter().rev().find_map(|e| match &e.event {
        EventBody::Reward { reward, .. } => Some(*reward),
        _ => None,
    })
}

fn real_responses(s: &Session) -> Vec<(String, ToolResponse)> {
    s.events
        .iter()
        .filter_map(|e| match &e.event {
            EventBody::Real { call, response, .. } => Some((call.name.clone(), response.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_fork_at_the_start_reproduces_the_original() {
    let (m, profile) = model();
    let dir = tempfile::tempdir().unwrap();
    let original = dir.path().join("orig.jsonl");
    record(&m, profile.as_ref(), &EpisodeConfig::default(), &original);
    let o = read_session(&original).unwrap();
    let first_user = main_messages(&o)
        .into_iter()
        .find(|(_, m)| m.role == Role::User)
        .map(|(e, _)| e.id.clone())
        .unwrap();
    let opts = recorded_config(&o.header, &EpisodeConfig::default()).unwrap();
    assert_eq!(opts, EpisodeConfig::default());
    let (out, r) = fork(
        &m,
        profile.as_ref(),
        &request(&original, &first_user, None),
        &opts,
    );
    let outcome = r.unwrap();
    assert_eq!(out, dir.path().join("orig.fork-1.jsonl"));
    let f = read_session(&out).unwrap();
    // Same events, ids and all (timestamps aside, log-probs to 1e-3); only the header says it
    // is a fork.
    let ((fork_lines, fork_lp), (orig_lines, orig_lp)) = (body_lines(&out), body_lines(&original));
    assert_eq!(fork_lines, orig_lines);
    assert_eq!(fork_lp.len(), orig_lp.len());
    assert!(
        fork_lp
            .iter()
            .zip(&orig_lp)
            .all(|(a, b)| (a - b).abs() < 1e-3)
    );
    assert_eq!(actor_texts(&f), actor_texts(&o));
    assert_eq!(reward_event(&f), reward_event(&o));
    assert_eq!(Some(outcome.reward()), reward_event(&o));
    let origin = f.header.forked_from.clone().unwrap();
    assert_eq!(origin.session, "orig.jsonl");
    assert_eq!(origin.event_id, first_user);
    assert!(!origin.edited && origin.edited_event.is_none());
    // The next fork takes the next free name.
    assert_eq!(fork_path(&original), dir.path().join("orig.fork-2.jsonl"));
}

/// Original → fork A (the first actor message edited into the correct transfer, which then
/// runs) → fork B of A (the actor message after the transfer edited into a balance read: the
/// live environment must have replayed the transfer) and fork C of A (the transfer's result
/// edited: the history shows the edit, the environment and the score follow the real transfer).
#[test]
fn forks_with_edits_replay_the_history_on_the_live_environment() {
    let (m, profile) = model();
    let p = profile.as_ref();
    let dir = tempfile::tempdir().unwrap();
    let original = dir.path().join("orig.jsonl");
    let opts = EpisodeConfig::default();
    record(&m, p, &opts, &original);
    let o = read_session(&original).unwrap();
    let first_actor = main_messages(&o)
        .into_iter()
        .find(|(_, m)| m.role == Role::Assistant)
        .map(|(e, _)| e.id.clone())
        .unwrap();

    // Fork A: the first actor message becomes the gold transfer.
    let edit = ForkEdit::ActorMessage {
        event_id: first_actor.clone(),
        content: TRANSFER.into(),
    };
    let (a_path, r) = fork(&m, p, &request(&original, &first_actor, Some(edit)), &opts);
    let a_outcome = r.unwrap();
    let a = read_session(&a_path).unwrap();
    let origin = a.header.forked_from.clone().unwrap();
    assert!(origin.edited);
    assert_eq!(origin.edited_event.as_deref(), Some(first_actor.as_str()));
    let a_msgs = main_messages(&a);
    assert_eq!(a_msgs[2].1.tool_calls[0].function.name, "transfer");
    let reals = real_responses(&a);
    assert_eq!(reals[0].0, "transfer");
    assert!(!reals[0].1.is_error(), "{:?}", reals[0].1);
    assert_eq!(a_outcome.trace.actions[0].name, "transfer");

    // Reference balances, straight from the domain.
    let task = find_builtin(TASK).unwrap();
    let mut env = DomainEnv::with_tasks(task.domain().unwrap(), vec![task.clone()]);
    let balance = |env: &mut DomainEnv| {
        env.call_sync(
            &serde_json::from_value(
                json!({"name": "get_balance", "arguments": {"acc": "acc_965"}}),
            )
            .unwrap(),
        )
        .unwrap()
    };
    rt().block_on(env.reset(Some(TASK))).unwrap();
    let before = balance(&mut env);
    env.call_sync(&a_outcome.trace.actions[0]).unwrap();
    let after = balance(&mut env);
    assert_ne!(before, after);

    // Fork B: after the transfer, the actor's next message becomes a balance read.
    let (tool_idx, _) = a_msgs
        .iter()
        .enumerate()
        .find(|(_, (_, m))| m.role == Role::Tool)
        .unwrap();
    let next_actor = a_msgs[tool_idx + 1..]
        .iter()
        .find(|(_, m)| m.role == Role::Assistant)
        .map(|(e, _)| e.id.clone())
        .expect("the actor spoke after the transfer");
    let edit = ForkEdit::ActorMessage {
        event_id: next_actor.clone(),
        content: BALANCE.into(),
    };
    let (b_path, r) = fork(&m, p, &request(&a_path, &next_actor, Some(edit)), &opts);
    r.unwrap();
    assert_eq!(b_path, dir.path().join("orig.fork-2.jsonl"));
    let b = read_session(&b_path).unwrap();
    assert_eq!(
        b.header.forked_from.as_ref().unwrap().session,
        "orig.fork-1.jsonl"
    );
    let reals = real_responses(&b);
    // Only the balance read ran here (the transfer was replayed, not re-recorded), and it saw
    // the transferred state.
    assert_eq!(reals[0].0, "get_balance");
    assert_eq!(reals[0].1, after);

    // Fork C: the transfer's result is edited into a failure.
    let tool_event = a_msgs[tool_idx].0.id.clone();
    let fake = r#"{"error":{"code":"limit","message":"over the transfer limit"}}"#;
    let edit = ForkEdit::ToolResult {
        event_id: tool_event.clone(),
        content: fake.into(),
    };
    let (c_path, r) = fork(&m, p, &request(&a_path, &tool_event, Some(edit)), &opts);
    let c_outcome = r.unwrap();
    let c = read_session(&c_path).unwrap();
    let c_msgs = main_messages(&c);
    assert_eq!(c_msgs[3].1.role, Role::Tool);
    assert_eq!(c_msgs[3].1.content, fake);
    // The actor was shown the edit.
    let first_gen = c
        .events
        .iter()
        .find_map(|e| match &e.event {
            EventBody::Generation(g) => Some(g.prompt.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(first_gen.last().unwrap().content, fake);
    // The environment and the score follow what ran: the transfer is an action of the trace,
    // and the recorded reward is the domain's score of that trace.
    assert_eq!(c_outcome.trace.actions[0].name, "transfer");
    let mut scorer = DomainEnv::with_tasks(task.domain().unwrap(), vec![task.clone()]);
    rt().block_on(scorer.reset(Some(TASK))).unwrap();
    let score = rt().block_on(scorer.score(&c_outcome.trace)).unwrap();
    assert_eq!(Some(&score), c_outcome.score.as_ref());
    assert_eq!(reward_event(&c), Some(score.reward));
    // Any later real call answered as the domain would after the replayed transfer.
    let mut reference = DomainEnv::with_tasks(task.domain().unwrap(), vec![task.clone()]);
    rt().block_on(reference.reset(Some(TASK))).unwrap();
    for action in &c_outcome.trace.actions[..1] {
        reference.call_sync(action).unwrap();
    }
    for (e, call, response) in c.events.iter().filter_map(|e| match &e.event {
        EventBody::Real { call, response, .. } => Some((e, call, response)),
        _ => None,
    }) {
        assert_eq!(&reference.call_sync(call).unwrap(), response, "{}", e.id);
    }
}

#[test]
fn a_rehearse_mode_fork_is_scored_by_the_verifier_with_the_history() {
    let (m, profile) = model();
    let dir = tempfile::tempdir().unwrap();
    let original = dir.path().join("orig.jsonl");
    record(&m, profile.as_ref(), &EpisodeConfig::default(), &original);
    let o = read_session(&original).unwrap();
    let tool = main_messages(&o)
        .into_iter()
        .find(|(_, m)| m.role == Role::Tool)
        .map(|(e, _)| e.id.clone())
        .unwrap();
    let opts = EpisodeConfig::new(ModeChoice::Rehearse);
    let (out, r) = fork(
        &m,
        profile.as_ref(),
        &request(&original, &tool, None),
        &opts,
    );
    let outcome = r.unwrap();
    let f = read_session(&out).unwrap();
    assert_eq!(f.header.mode, "rehearse");
    assert!(
        real_responses(&f).is_empty(),
        "rehearse mode ran a real call"
    );
    let plan = fork_spec(&o, &request(&original, &tool, None)).unwrap();
    assert_eq!(
        outcome.trace.actions[0],
        plan.history[0].tool_calls[0].function
    );
}

#[test]
fn replaying_a_history_brings_a_domain_to_its_state() {
    let task = find_builtin(TASK).unwrap();
    let (conv, calls) = gold_conversation(task).unwrap();
    assert!(!calls.is_empty());
    // The gold conversation after its system prompt and first user message.
    let history: Vec<Message> = conv[2..].to_vec();
    let mut replayed = DomainEnv::with_tasks(task.domain().unwrap(), vec![task.clone()]);
    let mut direct = replayed.clone();
    let rt = rt();
    rt.block_on(replayed.reset(Some(TASK))).unwrap();
    rt.block_on(direct.reset(Some(TASK))).unwrap();
    let initial = rt.block_on(direct.state_hash()).unwrap();
    let n = rt
        .block_on(replay_history(&mut replayed, &history))
        .unwrap();
    assert_eq!(n, calls.len());
    for c in &calls {
        direct.call_sync(&c.call).unwrap();
    }
    let want = rt.block_on(direct.state_hash()).unwrap();
    assert_eq!(rt.block_on(replayed.state_hash()).unwrap(), want);
    assert_ne!(
        want, initial,
        "the gold run of {TASK} should change the state"
    );
}

#[test]
fn bad_forks_are_refused_naming_the_event() {
    let sample = |n: &str| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("sessions")
            .join(n)
    };
    let ok = sample("bank-success.jsonl");
    let s = read_session(&ok).unwrap();
    let err = |req: ForkRequest| fork_spec(&s, &req).unwrap_err();

    let e = err(request(&ok, "e999", None));
    assert!(matches!(e, ForkError::UnknownEvent { .. }) && e.to_string().contains("e999"));

    // e9 is the tool message, e12 the final answer, e5 the actor's call.
    let wrong_role = ForkEdit::ToolResult {
        event_id: "e5".into(),
        content: "{}".into(),
    };
    let e = err(request(&ok, "e9", Some(wrong_role)));
    assert!(
        matches!(e, ForkError::EditWrongRole { .. }) && e.to_string().contains("e5"),
        "{e}"
    );
    let late = ForkEdit::ToolResult {
        event_id: "e9".into(),
        content: "{}".into(),
    };
    let e = err(request(&ok, "e5", Some(late)));
    assert!(
        matches!(e, ForkError::EditOutsideHistory { .. }) && e.to_string().contains("e9"),
        "{e}"
    );
    let not_message = ForkEdit::ToolResult {
        event_id: "e8".into(),
        content: "{}".into(),
    };
    let e = err(request(&ok, "e12", Some(not_message)));
    assert!(matches!(e, ForkError::EditNotAMessage { .. }), "{e}");
    let changes_calls = ForkEdit::ActorMessage {
        event_id: "e5".into(),
        content: BALANCE.into(),
    };
    let e = err(request(&ok, "e12", Some(changes_calls)));
    assert!(matches!(e, ForkError::EditChangesCalls { .. }), "{e}");

    // Mapping: a `real` event keeps its result, `approval_requested` leaves the call pending.
    let at_real = fork_spec(&s, &request(&ok, "e8", None)).unwrap();
    assert_eq!(at_real.history.last().unwrap().role, Role::Tool);
    let at_gate = fork_spec(&s, &request(&ok, "e6", None)).unwrap();
    assert_eq!(at_gate.history.len(), 1);
    assert_eq!(at_gate.origin.seq, 7);

    // A rehearsal-branch event.
    let shadow = sample("bank-shadow-rehearsal.jsonl");
    let r = read_session(&shadow).unwrap();
    let tree = SessionTree::build(&r.events);
    let in_branch = r.events[tree.branches()[0].events[1]].id.clone();
    let e = fork_spec(&r, &request(&shadow, &in_branch, None)).unwrap_err();
    assert!(
        matches!(e, ForkError::InBranch { .. }) && e.to_string().contains(&in_branch),
        "{e}"
    );

    // An MCP session.
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(&ok).unwrap();
    let (head, rest) = text.split_once('\n').unwrap();
    let mut h: Value = serde_json::from_str(head).unwrap();
    h["environment"] = json!("mcp:server-filesystem");
    let mcp = dir.path().join("mcp.jsonl");
    std::fs::write(&mcp, format!("{h}\n{rest}")).unwrap();
    let (m, profile) = model();
    let (_, r) = fork(
        &m,
        profile.as_ref(),
        &request(&mcp, "e9", None),
        &EpisodeConfig::default(),
    );
    let e = r.unwrap_err();
    assert!(
        e.to_string()
            .contains("forking MCP sessions is not supported"),
        "{e}"
    );
}

/// The header stores the episode configuration whole (every knob, not only mode and seed), and
/// a version-1 header (engine configuration only) gives the same configuration back but for the
/// headless approval policy, which it never recorded.
#[test]
fn the_recorded_configuration_is_the_one_that_ran() {
    use envace::engine::types::{PrivateRehearsal, RehearsalStrategy, SimFailurePolicy};
    let (m, profile) = model();
    let dir = tempfile::tempdir().unwrap();
    let original = dir.path().join("orig.jsonl");
    let config = EpisodeConfig {
        seed: 3,
        max_turns: 6,
        simulator_temperature: 0.2,
        sim_failure: SimFailurePolicy::ShowErrorToActor,
        approve: ApprovalPolicy::Auto,
        ..EpisodeConfig::new(ModeChoice::Shadow)
    }
    .with_rehearsal(Some(PrivateRehearsal {
        branches: 2,
        strategy: RehearsalStrategy::Sequential,
        explore_temperature: Some(0.8),
        ..PrivateRehearsal::default()
    }))
    .unwrap();
    record(&m, profile.as_ref(), &config, &original);
    let o = read_session(&original).unwrap();
    assert_eq!(
        recorded_config(&o.header, &EpisodeConfig::default()).unwrap(),
        config
    );
    let mut v1 = o.header.clone();
    v1.episode = None;
    v1.format_version = 1;
    let back = recorded_config(
        &v1,
        &EpisodeConfig {
            approve: ApprovalPolicy::Auto,
            ..EpisodeConfig::default()
        },
    )
    .unwrap();
    // The engine seeds the rehearsal sampler from the episode seed; the rest is the same.
    let mut expected = config.clone();
    if let envace::engine::types::Mode::Shadow(l) = &mut expected.mode {
        l.private_rehearsal.as_mut().unwrap().sampling.seed = 3;
    }
    assert_eq!(back, expected);
    // A recorded configuration that does not parse or validate is an error naming the field,
    // never a silent fallback to defaults.
    let mut bad = o.header.clone();
    bad.episode.as_mut().unwrap()["max_turns"] = json!("eight");
    let e = recorded_config(&bad, &EpisodeConfig::default()).unwrap_err();
    assert!(e.to_string().starts_with("header.episode:"), "{e}");
    let mut bad = o.header.clone();
    bad.episode.as_mut().unwrap()["max_turns"] = json!(0);
    let e = recorded_config(&bad, &EpisodeConfig::default()).unwrap_err();
    assert!(e.to_string().starts_with("max_turns:"), "{e}");
}
