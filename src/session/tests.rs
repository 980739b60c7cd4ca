//! Session format tests: round trip, kill-at-any-byte tolerance, validation errors with line
//! numbers, tree rebuild, export and replay.

use serde_json::json;

use super::*;
use crate::engine::parse::{SimOutput, parse_actor};
use crate::engine::types::{
    BranchEnd, BranchStep, BranchSummary, EndReason, EngineConfig, GenRole, Prediction,
    RehearsalDepth, RehearsalStrategy, RehearsalTrigger, ScoredBy, SimulatedOutcome,
};
use crate::env::{ToolAnnotations, ToolResponse, ToolSpec};
use crate::message::{Message, MessageToolCall, ToolCall};
use crate::runtime::FinishReason;

fn header() -> SessionHeader {
    SessionHeader::new(
        ModelRef {
            path: "models/tiny".into(),
            hash: "abc123".into(),
            tool_rendering: None,
        },
        None,
        "bank",
        Some("t1".into()),
        7,
        "real",
        serde_json::to_value(EngineConfig::default()).expect("config"),
    )
}

fn call() -> ToolCall {
    ToolCall {
        name: "transfer".into(),
        arguments: json!({"amount": 5}),
    }
}

fn ev(id: &str, parent: Option<&str>, event: EventBody) -> NewEvent {
    NewEvent {
        id: id.into(),
        parent: parent.map(String::from),
        event,
    }
}

/// A small episode: start, user, actor generation, rehearsal with one branch, real call, end.
fn sample_events() -> Vec<NewEvent> {
    let tool = ToolSpec {
        name: "transfer".into(),
        description: "move money".into(),
        input_schema: json!({"type": "object"}),
        annotations: ToolAnnotations {
            destructive: true,
            ..Default::default()
        },
    };
    let text = "<tool_call>{\"name\":\"transfer\",\"arguments\":{\"amount\":5}}</tool_call>";
    let assistant = Message {
        tool_calls: vec![MessageToolCall {
            id: "call_0".into(),
            kind: "function".into(),
            function: call(),
        }],
        ..Message::assistant("")
    };
    vec![
        ev(
            "e0",
            None,
            EventBody::EpisodeStart {
                task_id: Some("t1".into()),
                mode: "real".into(),
                tools: vec![tool],
                user_turns: vec!["pay 5".into()],
            },
        ),
        ev(
            "e1",
            Some("e0"),
            EventBody::Message {
                message: Message::system("be careful"),
            },
        ),
        ev(
            "e2",
            Some("e1"),
            EventBody::Message {
                message: Message::user("pay 5"),
            },
        ),
        ev(
            "e3",
            Some("e2"),
            EventBody::Generation(GenerationRecord {
                role: GenRole::Actor,
                request: 0,
                index: 0,
                branch: None,
                call_id: None,
                prompt: vec![Message::user("pay 5")],
                prompt_ids: vec![1, 2, 3],
                response_ids: vec![4, 5],
                logprobs: vec![-0.5, -0.25],
                loss_mask: vec![1, 1],
                text: text.into(),
                finish: FinishReason::Eos,
            }),
        ),
        ev(
            "e4",
            Some("e3"),
            EventBody::ActorParsed {
                turn: parse_actor(text),
                call_ids: vec!["call_0".into()],
            },
        ),
        ev(
            "e5",
            Some("e4"),
            EventBody::RehearsalStart {
                branches: 1,
                strategy: RehearsalStrategy::Parallel,
                trigger: RehearsalTrigger::Irreversible,
                depth: RehearsalDepth::Turns(1),
                proposed: vec![call()],
            },
        ),
        ev("e6", Some("e5"), EventBody::BranchStart { index: 0 }),
        ev(
            "e7",
            Some("e6"),
            EventBody::Simulated {
                call_id: "call_b0".into(),
                call: call(),
                outcome: SimulatedOutcome::Parsed {
                    output: SimOutput::Result {
                        value: json!({"ok": true}),
                    },
                },
                think: None,
                recalled: false,
            },
        ),
        ev(
            "e8",
            Some("e7"),
            EventBody::BranchEnd {
                summary: BranchSummary {
                    index: 0,
                    steps: vec![BranchStep {
                        call: call(),
                        outcome: SimulatedOutcome::Parsed {
                            output: SimOutput::Result {
                                value: json!({"ok": true}),
                            },
                        },
                    }],
                    end: BranchEnd::DepthReached,
                    prediction: Prediction::Unknown,
                },
            },
        ),
        ev(
            "e9",
            Some("e5"),
            EventBody::RehearsalMemory {
                text: "1. transfer → ok".into(),
                branches: vec![0],
            },
        ),
        ev("e10", Some("e9"), EventBody::Message { message: assistant }),
        ev(
            "e11",
            Some("e10"),
            EventBody::Real {
                call_id: "call_0".into(),
                call: call(),
                response: ToolResponse::Success {
                    value: json!({"ok": true}),
                },
            },
        ),
        ev(
            "e12",
            Some("e11"),
            EventBody::Message {
                message: Message::tool("call_0", "transfer", "{\"ok\":true}"),
            },
        ),
        ev(
            "e13",
            Some("e12"),
            EventBody::EpisodeEnd {
                reason: EndReason::Answered,
                finished_normally: true,
            },
        ),
        ev(
            "e14",
            Some("e13"),
            EventBody::Reward {
                reward: 1.0,
                partial: 1.0,
                checklist: vec![],
                scored_by: ScoredBy::Environment,
            },
        ),
    ]
}

fn write_sample(dir: &std::path::Path, timestamps: bool) -> std::path::PathBuf {
    let path = dir.join("nested/s.jsonl");
    let mut w = SessionWriter::create_with(&path, &header(), timestamps).expect("create");
    for e in sample_events() {
        w.append(e).expect("append");
    }
    path
}

#[test]
fn written_session_reads_back_identically() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = write_sample(dir.path(), true);
    let s = read_session(&path).expect("read");
    assert!(s.warnings.is_empty());
    assert_eq!(s.header.environment, "bank");
    assert_eq!(s.header.mode, "real");
    assert!(s.header.ts.is_some());
    let originals = sample_events();
    assert_eq!(s.events.len(), originals.len());
    for (i, (r, o)) in s.events.iter().zip(&originals).enumerate() {
        assert_eq!(r.seq, i as u64 + 1);
        assert_eq!(r.id, o.id);
        assert_eq!(r.parent, o.parent);
        assert_eq!(r.event, o.event);
        assert!(r.ts.is_some());
    }
}

#[test]
fn the_header_records_the_tool_rendering_and_older_headers_still_read() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("s.jsonl");
    let mut h = header();
    h.model.tool_rendering = Some("system-smollm2".into());
    let mut w = SessionWriter::create_with(&path, &h, false).expect("create");
    for e in sample_events() {
        w.append(e).expect("append");
    }
    let s = read_session(&path).expect("read");
    assert_eq!(
        s.header.model.tool_rendering.as_deref(),
        Some("system-smollm2")
    );
    assert!(
        render_replay(&s).contains("tools: rendered into the system message (system-smollm2)"),
        "{}",
        render_replay(&s)
    );
    // A header written before the field existed has none, and says nothing about it.
    let plain = write_sample(dir.path(), false);
    let text = std::fs::read_to_string(&plain).expect("read");
    assert!(
        !text
            .lines()
            .next()
            .expect("header")
            .contains("tool_rendering")
    );
    let s = read_session(&plain).expect("read");
    assert_eq!(s.header.model.tool_rendering, None);
    assert!(!render_replay(&s).contains("rendered into the system message"));
}

#[test]
fn killing_the_writer_at_any_byte_loses_at_most_the_last_event() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = write_sample(dir.path(), false);
    let bytes = std::fs::read(&path).expect("read");
    let header_len = bytes.iter().position(|&b| b == b'\n').expect("newline") + 1;
    let full = read_session(&path).expect("full").events;
    for cut in 0..=bytes.len() {
        let r = parse_session(&bytes[..cut], "cut");
        if cut == 0 {
            assert!(matches!(r, Err(SessionError::Empty { .. })));
            continue;
        }
        if cut < header_len - 1 {
            assert!(
                matches!(r, Err(SessionError::TruncatedHeader { .. })),
                "cut {cut}: {r:?}"
            );
            continue;
        }
        let s = r.unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        let complete_lines = bytes[..cut].iter().filter(|&&b| b == b'\n').count();
        let complete_events = complete_lines.saturating_sub(1);
        assert!(s.events.len() >= complete_events, "cut {cut}");
        assert!(s.events.len() <= complete_events + 1, "cut {cut}");
        assert_eq!(s.events[..], full[..s.events.len()], "cut {cut}");
        if cut == bytes.len() {
            assert!(s.warnings.is_empty());
        }
    }
}

#[test]
fn truncated_last_line_is_a_warning_not_an_error() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = write_sample(dir.path(), false);
    let mut bytes = std::fs::read(&path).expect("read");
    let n = bytes.len();
    bytes.truncate(n - 10);
    let s = parse_session(&bytes, "t").expect("tolerated");
    assert_eq!(s.events.len(), sample_events().len() - 1);
    assert!(matches!(
        s.warnings.as_slice(),
        [ReadWarning::TruncatedLastLine { line: 16, .. }]
    ));
}

#[test]
fn corrupt_middle_line_is_an_error_naming_its_line() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = write_sample(dir.path(), false);
    let text = std::fs::read_to_string(&path).expect("read");
    let mut lines: Vec<&str> = text.lines().collect();
    lines[4] = "{\"seq\": 4, broken";
    let broken = lines.join("\n") + "\n";
    match parse_session(broken.as_bytes(), "x.jsonl") {
        Err(SessionError::Corrupt { line, path, .. }) => {
            assert_eq!(line, 5);
            assert_eq!(path, "x.jsonl");
        }
        other => panic!("expected corrupt line 5, got {other:?}"),
    }
}

#[test]
fn complete_but_invalid_last_line_is_an_error() {
    let mut text = serde_json::to_string(&header()).expect("json");
    text.push_str("\nnot json\n");
    assert!(matches!(
        parse_session(text.as_bytes(), "x"),
        Err(SessionError::Corrupt { line: 2, .. })
    ));
}

#[test]
fn non_increasing_seq_is_invalid() {
    let mut text = serde_json::to_string(&header()).expect("json");
    for seq in [1, 1] {
        text.push('\n');
        text.push_str(
            &json!({"seq": seq, "id": format!("e{seq}x{}", text.len()), "event": {"type": "branch_start", "index": 0}})
                .to_string(),
        );
    }
    text.push('\n');
    assert!(matches!(
        parse_session(text.as_bytes(), "x"),
        Err(SessionError::Invalid { line: 3, .. })
    ));
}

#[test]
fn duplicate_id_and_unknown_parent_are_invalid() {
    let h = serde_json::to_string(&header()).expect("json");
    let a = json!({"seq": 1, "id": "a", "event": {"type": "branch_start", "index": 0}});
    let dup = json!({"seq": 2, "id": "a", "event": {"type": "branch_start", "index": 1}});
    let orphan =
        json!({"seq": 2, "id": "b", "parent": "zz", "event": {"type": "branch_start", "index": 1}});
    let t1 = format!("{h}\n{a}\n{dup}\n");
    let t2 = format!("{h}\n{a}\n{orphan}\n");
    assert!(
        matches!(parse_session(t1.as_bytes(), "x"), Err(SessionError::Invalid { line: 3, message, .. }) if message.contains("duplicate"))
    );
    assert!(
        matches!(parse_session(t2.as_bytes(), "x"), Err(SessionError::Invalid { line: 3, message, .. }) if message.contains("parent"))
    );
}

#[test]
fn foreign_header_is_rejected() {
    let t = "{\"hello\": 1}\n";
    assert!(matches!(
        parse_session(t.as_bytes(), "x"),
        Err(SessionError::Corrupt { line: 1, .. })
    ));
    let mut h = header();
    h.format = "other".into();
    let t = serde_json::to_string(&h).expect("json") + "\n";
    assert!(matches!(
        parse_session(t.as_bytes(), "x"),
        Err(SessionError::Corrupt { line: 1, .. })
    ));
    let mut h = header();
    h.format_version = FORMAT_VERSION + 1;
    let t = serde_json::to_string(&h).expect("json") + "\n";
    assert!(parse_session(t.as_bytes(), "x").is_err());
}

#[test]
fn tree_rebuilds_main_line_and_branches() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = read_session(write_sample(dir.path(), false)).expect("read");
    let tree = SessionTree::build(&s.events);
    let branches = tree.branches();
    assert_eq!(branches.len(), 1);
    assert_eq!(branches[0].index, 0);
    assert_eq!(s.events[branches[0].rehearsal].id, "e5");
    let ids: Vec<&str> = branches[0]
        .events
        .iter()
        .map(|&i| s.events[i].id.as_str())
        .collect();
    assert_eq!(ids, ["e6", "e7", "e8"]);
    let main: Vec<&str> = tree
        .main_line()
        .iter()
        .map(|&i| s.events[i].id.as_str())
        .collect();
    assert!(main.contains(&"e9") && main.contains(&"e5") && !main.contains(&"e7"));
    assert_eq!(tree.roots, vec![0]);
    assert_eq!(tree.children[5].len(), 2); // branch_start and rehearsal_memory
}

#[test]
fn openai_export_writes_main_line_with_string_arguments() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = write_sample(dir.path(), false);
    let mut out = Vec::new();
    let n = export_openai(&path, &mut out, &ExportOptions::default()).expect("export");
    assert_eq!(n, 1);
    let text = String::from_utf8(out).expect("utf8");
    let rec: serde_json::Value = serde_json::from_str(text.trim()).expect("json line");
    let msgs = rec["messages"].as_array().expect("messages");
    assert_eq!(msgs.len(), 4);
    assert_eq!(msgs[0]["role"], "system");
    assert_eq!(
        msgs[2]["tool_calls"][0]["function"]["arguments"],
        "{\"amount\":5}"
    );
    assert_eq!(msgs[3]["role"], "tool");
    assert_eq!(msgs[3]["tool_call_id"], "call_0");
    assert_eq!(rec["tools"][0]["function"]["name"], "transfer");
    assert_eq!(rec["metadata"]["reward"], 1.0);
}

#[test]
fn openai_export_carries_arguments_edited_at_the_approval_gate() {
    // The user approved call_0 with amount 7 instead of the proposed 5: the call ran with 7
    // and the actor's later turns saw 7, so the exported conversation says 7.
    let mut events = sample_events();
    let at = events
        .iter()
        .position(|e| e.id == "e11")
        .expect("real call");
    events[at].parent = Some("ea".into());
    events.insert(
        at,
        ev(
            "ea",
            Some("e10"),
            EventBody::Approval {
                call_id: "call_0".into(),
                decision: crate::engine::types::Decision::ApproveEdited {
                    arguments: json!({"amount": 7}),
                },
            },
        ),
    );
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("edited.jsonl");
    let mut w = SessionWriter::create_with(&path, &header(), false).expect("create");
    for e in events {
        w.append(e).expect("append");
    }
    let mut out = Vec::new();
    export_openai(&path, &mut out, &ExportOptions::default()).expect("export");
    let rec: serde_json::Value =
        serde_json::from_str(String::from_utf8(out).expect("utf8").trim()).expect("json");
    assert_eq!(
        rec["messages"][2]["tool_calls"][0]["function"]["arguments"],
        "{\"amount\":7}"
    );
}

#[test]
fn replay_text_shows_steps_and_branches() {
    let dir = tempfile::tempdir().expect("tmp");
    let text = replay_text(write_sample(dir.path(), false)).expect("replay");
    assert!(
        text.contains("episode start (real); tools: transfer!"),
        "{text}"
    );
    assert!(text.contains("[branch 0] #7"), "{text}");
    assert!(text.contains("real transfer[call_0]"), "{text}");
    assert!(text.contains("reward 1.000"), "{text}");
}

#[test]
fn stripping_timestamps_makes_recordings_equal() {
    let d1 = tempfile::tempdir().expect("tmp");
    let d2 = tempfile::tempdir().expect("tmp");
    let a = std::fs::read_to_string(write_sample(d1.path(), true)).expect("a");
    std::thread::sleep(std::time::Duration::from_millis(5));
    let b = std::fs::read_to_string(write_sample(d2.path(), true)).expect("b");
    assert_ne!(a, b);
    assert_eq!(strip_timestamps(&a), strip_timestamps(&b));
    let c = std::fs::read_to_string(write_sample(d2.path(), false)).expect("c");
    assert_eq!(strip_timestamps(&a), c);
}

#[test]
fn explicit_path_wins_and_default_name_is_clean() {
    let p = resolve_session_path(Some("x/y.jsonl".into()), "bank", Some("t 1"), 3).expect("p");
    assert_eq!(p, std::path::PathBuf::from("x/y.jsonl"));
    let name = session_file_name("mcp:fs", Some("a/b"), 3);
    assert!(name.starts_with("mcp_fs-a_b-s3-"), "{name}");
    assert!(name.ends_with(".jsonl"));
}

#[test]
fn memory_sink_numbers_events() {
    let mut sink = MemorySink::default();
    for e in sample_events().into_iter().take(3) {
        sink.persist(e).expect("persist");
    }
    let seqs: Vec<u64> = sink.records.iter().map(|r| r.seq).collect();
    assert_eq!(seqs, [1, 2, 3]);
}

#[test]
fn reader_survives_mutated_session_files() {
    use crate::engine::parse::randomized::mutate_bytes;
    use rand::SeedableRng;
    let dir = tempfile::tempdir().expect("tmp");
    let bytes = std::fs::read(write_sample(dir.path(), true)).expect("read");
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let mut ok = 0;
    for _ in 0..3_000 {
        let m = mutate_bytes(&mut rng, &bytes);
        if let Ok(s) = parse_session(&m, "mutated") {
            ok += 1;
            assert!(s.events.windows(2).all(|w| w[0].seq < w[1].seq));
            let tree = SessionTree::build(&s.events);
            assert_eq!(tree.branch_of.len(), s.events.len());
            let _ = render_replay(&s);
            let _ = openai_records(&s, &ExportOptions::default());
        }
    }
    assert!(ok > 0);
}

#[test]
fn training_rows_carry_tokens_and_the_episode_reward() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = read_session(write_sample(dir.path(), false)).expect("read");
    let rows = training_rows(&s.events);
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].role, GenRole::Actor);
    assert_eq!(rows[0].prompt_ids, vec![1, 2, 3]);
    assert_eq!(rows[0].loss_mask, vec![1, 1]);
    assert_eq!(rows[0].reward, Some(1.0));
}
