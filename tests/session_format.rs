//! The session file format is pinned. `tests/fixtures/sessions/format-v2.jsonl` holds a header
//! and one line of every event type (and of the nested variants a line can hold), written from
//! the Rust values below: every line must serialise exactly so and parse back to the same value.
//! A change to any type of `session::format` / `session::schema` fails here; then bump
//! `FORMAT_VERSION`, keep a reader for the older version, and regenerate the file with
//! `UPDATE_GOLDEN=1 cargo test --test session_format`. Version-1 files (no `episode` in the
//! header, no `scoring_failed` events) still read: a real one recorded by the last version-1
//! build is committed beside it.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::{Path, PathBuf};

use envace::engine::runner::{EpisodeConfig, ModeChoice, recorded_config};
use envace::engine::types::{PrivateRehearsal, RehearsalStrategy};
use envace::message::{Message, ToolCall};
use envace::session::format::*;
use envace::session::{
    EventBody, EventRecord, FORMAT_VERSION, ForkOrigin, GenerationRecord, ModelRef, SessionHeader,
    read_session, render_replay,
};
use serde_json::json;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sessions")
        .join(name)
}

/// Every event type's `type` tag. A new `EventBody` variant makes this match non-exhaustive:
/// add it to `events()` and regenerate the golden file.
fn kind_of(e: &EventBody) -> &'static str {
    match e {
        EventBody::EpisodeStart { .. } => "episode_start",
        EventBody::Message { .. } => "message",
        EventBody::Generation(_) => "generation",
        EventBody::ActorParsed { .. } => "actor_parsed",
        EventBody::Format { .. } => "format",
        EventBody::Simulated { .. } => "simulated",
        EventBody::Real { .. } => "real",
        EventBody::Fidelity { .. } => "fidelity",
        EventBody::ApprovalRequested { .. } => "approval_requested",
        EventBody::Approval { .. } => "approval",
        EventBody::RehearsalStart { .. } => "rehearsal_start",
        EventBody::BranchStart { .. } => "branch_start",
        EventBody::BranchEnd { .. } => "branch_end",
        EventBody::RehearsalMemory { .. } => "rehearsal_memory",
        EventBody::EpisodeEnd { .. } => "episode_end",
        EventBody::Reward { .. } => "reward",
        EventBody::ScoringFailed { .. } => "scoring_failed",
    }
}

const ALL_KINDS: [&str; 17] = [
    "episode_start",
    "message",
    "generation",
    "actor_parsed",
    "format",
    "simulated",
    "real",
    "fidelity",
    "approval_requested",
    "approval",
    "rehearsal_start",
    "branch_start",
    "branch_end",
    "rehearsal_memory",
    "episode_end",
    "reward",
    "scoring_failed",
];

fn header() -> SessionHeader {
    let config = EpisodeConfig {
        seed: 5,
        ..EpisodeConfig::new(ModeChoice::Shadow)
    }
    .with_rehearsal(Some(PrivateRehearsal {
        branches: 2,
        ..PrivateRehearsal::default()
    }))
    .unwrap();
    let mut h = SessionHeader::new(
        ModelRef {
            path: "models/envace-tiny".into(),
            hash: "abc".into(),
            tool_rendering: Some("template".into()),
        },
        Some("models/adapter".into()),
        "bank",
        Some("bank-test-0001".into()),
        5,
        "shadow",
        serde_json::to_value(config.engine_config(None).unwrap()).unwrap(),
    )
    .with_episode(serde_json::to_value(&config).unwrap());
    h.forked_from = Some(ForkOrigin {
        session: "orig.jsonl".into(),
        event_id: "e3".into(),
        seq: 3,
        edited: true,
        edited_event: Some("e2".into()),
    });
    h
}

fn call() -> ToolCall {
    ToolCall {
        name: "transfer".into(),
        arguments: json!({"src": "acc_1", "dst": "acc_2", "amount": 5}),
    }
}

fn events() -> Vec<EventBody> {
    let tool = ToolSpec {
        name: "transfer".into(),
        description: "Move money.".into(),
        input_schema: json!({"type": "object", "properties": {"amount": {"type": "number"}}}),
        annotations: ToolAnnotations {
            read_only: false,
            destructive: true,
            ..ToolAnnotations::default()
        },
    };
    let all_actor_events = vec![
        ActorFormatEvent::UnclosedThink,
        ActorFormatEvent::MissingClosingTag { block: 0 },
        ActorFormatEvent::StrayClosingTag,
        ActorFormatEvent::CodeFence { block: 0 },
        ActorFormatEvent::TextInBlock {
            block: 0,
            text: "x".into(),
        },
        ActorFormatEvent::TrailingProse { text: "ok".into() },
        ActorFormatEvent::SingleQuotes { block: 1 },
        ActorFormatEvent::PythonLiterals { block: 1 },
        ActorFormatEvent::TrailingComma { block: 1 },
        ActorFormatEvent::ArgumentsAsString { block: 1 },
        ActorFormatEvent::ArgumentsKeyAlias {
            block: 1,
            key: "parameters".into(),
        },
        ActorFormatEvent::MissingArguments { block: 2 },
        ActorFormatEvent::CallArray { block: 2 },
        ActorFormatEvent::UntaggedToolCall { block: 2 },
        ActorFormatEvent::UnparseableToolCall {
            block: 3,
            reason: "eof".into(),
            raw: "{".into(),
        },
        ActorFormatEvent::EmptyOutput,
    ];
    let sim_errors = vec![
        SimFormatError::UnclosedThink,
        SimFormatError::MissingResult,
        SimFormatError::UnclosedResult,
        SimFormatError::MultipleResults,
        SimFormatError::TextOutsideResult { text: "t".into() },
        SimFormatError::InvalidJson { reason: "r".into() },
        SimFormatError::NotObjectOrArray,
        SimFormatError::EmptyResult,
        SimFormatError::MalformedRejection { reason: "r".into() },
    ];
    let parsed = SimulatedOutcome::Parsed {
        output: SimOutput::Result {
            value: json!({"ok": true}),
        },
    };
    let mut out = vec![
        EventBody::EpisodeStart {
            task_id: Some("bank-test-0001".into()),
            mode: "shadow".into(),
            tools: vec![tool],
            user_turns: vec!["Move 5.".into(), "Thanks.".into()],
        },
        EventBody::Message {
            message: Message::user("Move 5."),
        },
        EventBody::Generation(GenerationRecord {
            role: GenRole::Actor,
            request: 1,
            index: 0,
            branch: Some(1),
            call_id: None,
            prompt: vec![Message::system("s"), Message::user("u")],
            prompt_ids: vec![1, 2, 3],
            response_ids: vec![4, 5],
            logprobs: vec![-0.5, -0.25],
            loss_mask: vec![1, 1],
            text: "<tool_call>{}</tool_call>".into(),
            finish: FinishReason::Stop("</tool_call>".into()),
        }),
        EventBody::ActorParsed {
            turn: ActorTurn {
                think: Some("plan".into()),
                content: String::new(),
                action: ActorAction::Calls {
                    calls: vec![call()],
                },
                events: all_actor_events.clone(),
            },
            call_ids: vec!["c1".into()],
        },
        EventBody::Simulated {
            call_id: "c1".into(),
            call: call(),
            outcome: parsed.clone(),
            think: None,
            recalled: true,
        },
        EventBody::Real {
            call_id: "c1".into(),
            call: call(),
            response: ToolResponse::Error {
                code: "insufficient_funds".into(),
                message: "no".into(),
            },
        },
        EventBody::Fidelity {
            call_id: "c1".into(),
            tool: "transfer".into(),
            fidelity: Fidelity {
                exact: false,
                key_f1: 0.5,
                value_agreement: 0.25,
            },
        },
        EventBody::ApprovalRequested {
            call_id: "c1".into(),
            call: call(),
            irreversible: true,
        },
        EventBody::RehearsalStart {
            branches: 2,
            strategy: RehearsalStrategy::Parallel,
            trigger: RehearsalTrigger::EveryCall,
            depth: RehearsalDepth::Turns(2),
            proposed: vec![call()],
        },
        EventBody::BranchStart { index: 0 },
        EventBody::RehearsalMemory {
            text: "branch 0: transfer → ok → success".into(),
            branches: vec![0, 1],
        },
        EventBody::Reward {
            reward: 1.0,
            partial: 0.5,
            checklist: vec![ChecklistItem {
                name: "transfer".into(),
                weight: 1.0,
                passed: true,
                reason: "done".into(),
            }],
            scored_by: ScoredBy::Verifier,
        },
        EventBody::ScoringFailed {
            message: "server died".into(),
        },
    ];
    for e in all_actor_events {
        out.push(EventBody::Format {
            format: FormatEvent::Actor(e),
        });
    }
    for e in sim_errors.iter().cloned() {
        out.push(EventBody::Format {
            format: FormatEvent::Simulator(e.clone()),
        });
        out.push(EventBody::Simulated {
            call_id: "c2".into(),
            call: call(),
            outcome: SimulatedOutcome::Unparseable { error: e },
            think: Some("t".into()),
            recalled: false,
        });
    }
    for decision in [
        Decision::Approve,
        Decision::ApproveEdited {
            arguments: json!({"amount": 4}),
        },
        Decision::Reject {
            reason: "no".into(),
        },
        Decision::Terminate,
    ] {
        out.push(EventBody::Approval {
            call_id: "c1".into(),
            decision,
        });
    }
    for (i, (end, prediction)) in [
        (
            BranchEnd::Answered {
                text: "done".into(),
            },
            Prediction::Success,
        ),
        (
            BranchEnd::DepthReached,
            Prediction::Failure {
                reason: "err".into(),
            },
        ),
        (BranchEnd::TurnLimit, Prediction::Unknown),
        (
            BranchEnd::Rejected {
                code: "c".into(),
                message: "m".into(),
            },
            Prediction::Unknown,
        ),
        (BranchEnd::SimulatorFormatError, Prediction::Unknown),
        (BranchEnd::ActorFormatError, Prediction::Unknown),
    ]
    .into_iter()
    .enumerate()
    {
        out.push(EventBody::BranchEnd {
            summary: BranchSummary {
                index: i,
                steps: vec![BranchStep {
                    call: call(),
                    outcome: SimulatedOutcome::Parsed {
                        output: SimOutput::Rejected {
                            code: "c".into(),
                            message: "m".into(),
                        },
                    },
                }],
                end,
                prediction,
            },
        });
    }
    for reason in [
        EndReason::Answered,
        EndReason::TurnLimit,
        EndReason::ActorFormatError,
        EndReason::SimulatorFormatError {
            error: SimFormatError::EmptyResult,
        },
        EndReason::SimulatorRejected {
            code: "c".into(),
            message: "m".into(),
        },
        EndReason::Terminated,
        EndReason::Cancelled,
        EndReason::Failed {
            message: "model".into(),
        },
    ] {
        out.push(EventBody::EpisodeEnd {
            finished_normally: reason == EndReason::Answered,
            reason,
        });
    }
    for finish in [
        FinishReason::Eos,
        FinishReason::Length,
        FinishReason::Cancelled,
    ] {
        out.push(EventBody::Generation(GenerationRecord {
            role: GenRole::Simulator,
            request: 2,
            index: 1,
            branch: None,
            call_id: Some("c1".into()),
            prompt: vec![Message::user("u")],
            prompt_ids: vec![1],
            response_ids: vec![2],
            logprobs: vec![-1.0],
            loss_mask: vec![1],
            text: "<execution_result>{}</execution_result>".into(),
            finish,
        }));
    }
    out.push(EventBody::Real {
        call_id: "c3".into(),
        call: call(),
        response: ToolResponse::Success {
            value: json!({"balance": 5}),
        },
    });
    out.push(EventBody::ActorParsed {
        turn: ActorTurn {
            think: None,
            content: "Done.".into(),
            action: ActorAction::Answer,
            events: Vec::new(),
        },
        call_ids: Vec::new(),
    });
    out.push(EventBody::ActorParsed {
        turn: ActorTurn {
            think: None,
            content: String::new(),
            action: ActorAction::Malformed,
            events: Vec::new(),
        },
        call_ids: Vec::new(),
    });
    out.push(EventBody::RehearsalStart {
        branches: 1,
        strategy: RehearsalStrategy::Sequential,
        trigger: RehearsalTrigger::Irreversible,
        depth: RehearsalDepth::ToEnd,
        proposed: Vec::new(),
    });
    out
}

fn golden_text() -> String {
    let mut lines = vec![serde_json::to_string(&header()).unwrap()];
    for (i, event) in events().into_iter().enumerate() {
        let rec = EventRecord {
            seq: i as u64 + 1,
            id: format!("e{}", i + 1),
            parent: (i > 0).then(|| format!("e{i}")),
            ts: None,
            event,
        };
        lines.push(serde_json::to_string(&rec).unwrap());
    }
    lines.join("\n") + "\n"
}

#[test]
fn the_format_is_pinned_by_the_golden_file() {
    let path = fixture("format-v2.jsonl");
    let text = golden_text();
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let golden = std::fs::read_to_string(&path).unwrap();
    for (n, (want, got)) in golden.lines().zip(text.lines()).enumerate() {
        assert_eq!(
            got,
            want,
            "line {} of {}: the session format changed: bump FORMAT_VERSION, keep a reader for \
             the old version, then regenerate with UPDATE_GOLDEN=1",
            n + 1,
            path.display()
        );
    }
    assert_eq!(golden.lines().count(), text.lines().count());
    // Every line parses back to the value that wrote it, and every event type is there.
    let s = read_session(&path).unwrap();
    assert_eq!(s.header, header());
    assert_eq!(s.header.format_version, FORMAT_VERSION);
    assert_eq!(FORMAT_VERSION, 2);
    let bodies: Vec<EventBody> = s.events.iter().map(|e| e.event.clone()).collect();
    assert_eq!(bodies, events());
    for kind in ALL_KINDS {
        assert!(
            bodies
                .iter()
                .any(|b| kind_of(b) == kind && b.kind() == kind),
            "{kind} missing"
        );
    }
}

#[test]
fn a_version_1_session_still_reads_and_gives_its_configuration() {
    let s = read_session(fixture("v1-bank-test-0004-shadow-pr2.jsonl")).unwrap();
    assert_eq!(s.header.format_version, 1);
    assert!(s.header.episode.is_none());
    assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    let replay = render_replay(&s);
    assert!(replay.contains("bank-test-0004"), "{replay}");
    // The configuration is recovered from the version-1 engine configuration.
    let c = recorded_config(&s.header, &EpisodeConfig::default()).unwrap();
    assert_eq!(c.mode_choice(), ModeChoice::Shadow);
    let pr = c.rehearsal().unwrap();
    assert_eq!(pr.branches, 2);
    assert_eq!(c.max_turns, 8);
}

/// Sessions are the leaf of the dependency graph (docs/ARCHITECTURE.md): outside its tests,
/// `src/session/` names nothing of the crate but `message` and `cancel`, so that a reader of
/// session files needs no engine, environment or runtime.
#[test]
fn the_session_module_depends_on_nothing_but_message_and_cancel() {
    fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                rust_files(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src/session"),
        &mut files,
    );
    assert!(files.len() >= 5, "{files:?}");
    let mut offending = Vec::new();
    for f in files.iter().filter(|f| !f.ends_with("tests.rs")) {
        let text = std::fs::read_to_string(f).unwrap();
        // Test modules inside a file may use the engine to build their inputs.
        let code = text.split("#[cfg(test)]").next().unwrap();
        for (i, line) in code.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("crate::") {
                let after = &rest[at + "crate::".len()..];
                let module: String = after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !["message", "cancel", "session"].contains(&module.as_str()) {
                    offending.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
                }
                rest = after;
            }
        }
    }
    assert!(offending.is_empty(), "{offending:#?}");
}
