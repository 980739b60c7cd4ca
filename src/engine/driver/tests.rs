//! Driver plumbing tests. The model is a scripted test double (it replays outputs; it stands
//! for the model, not for the thing under test) and the environment a tiny in-test counter
//! world. End-to-end runs with a real model live elsewhere.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use serde_json::{Value, json};

use super::*;
use crate::engine::fsm::RehearsalVerdict;
use crate::engine::prompts::SIMULATOR_INSTRUCTION;
use crate::engine::types::{
    ApprovalGate, EndReason, EngineConfig, EpisodeSpec, LiveOptions, PrivateRehearsal,
    RehearsalDepth, RehearsalStrategy,
};
use crate::env::{EnvError, ToolAnnotations, ToolResponse, ToolSpec};
use crate::message::{Message, ToolCall};
use crate::runtime::{FinishReason, ModelInfo, RuntimeError, SamplingParams, StreamSink};
use crate::session::{
    MemorySink, ModelRef, SessionHeader, SessionTree, SessionWriter, read_session, strip_timestamps,
};

type Log = Arc<Mutex<Vec<String>>>;

fn log(l: &Log, s: impl Into<String>) {
    if let Ok(mut v) = l.lock() {
        v.push(s.into());
    }
}

fn entries(l: &Log) -> Vec<String> {
    l.lock().map(|v| v.clone()).unwrap_or_default()
}

/// Replays scripted outputs: actor prompts and simulator prompts have separate queues (told
/// apart by the simulator instruction, marked in the first prompt id).
struct ScriptedModel {
    actor: VecDeque<String>,
    sim: VecDeque<String>,
    log: Log,
}

impl LanguageModel for ScriptedModel {
    fn info(&self) -> ModelInfo {
        ModelInfo {
            path: "scripted".into(),
            hash: "0000".into(),
            architecture: "test".into(),
            device: "cpu".into(),
            dtype: "f32".into(),
            parameters: 0,
            tool_rendering: crate::runtime::tool_format::ToolRendering::Template,
        }
    }
    fn render_chat(
        &self,
        messages: &[Message],
        tools: &[Value],
        _add_generation_prompt: bool,
        _thinking: bool,
    ) -> Result<String, RuntimeError> {
        Ok(format!("{}|{}", json!(messages), tools.len()))
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>, RuntimeError> {
        let role = u32::from(text.contains(&SIMULATOR_INSTRUCTION[..27]));
        Ok(std::iter::once(role)
            .chain(text.bytes().take(5).map(u32::from))
            .collect())
    }
    fn decode(&self, ids: &[u32]) -> Result<String, RuntimeError> {
        Ok(ids.iter().filter_map(|&i| char::from_u32(i)).collect())
    }
    fn generate(
        &mut self,
        prompt_ids: &[u32],
        n: usize,
        _params: &SamplingParams,
        mut stream: Option<StreamSink<'_>>,
        _cancel: &CancelToken,
    ) -> Result<Vec<Generation>, RuntimeError> {
        let sim = prompt_ids.first() == Some(&1);
        log(&self.log, if sim { "gen:sim" } else { "gen:actor" });
        let mut out = Vec::new();
        for i in 0..n {
            let q = if sim { &mut self.sim } else { &mut self.actor };
            let text = q
                .pop_front()
                .ok_or_else(|| RuntimeError::Generation("script exhausted".into()))?;
            if let Some(s) = stream.as_mut() {
                let mid = text
                    .char_indices()
                    .nth(text.chars().count() / 2)
                    .map_or(0, |c| c.0);
                s(i, &text[..mid]);
                s(i, &text[mid..]);
            }
            out.push(Generation {
                prompt_ids: prompt_ids.to_vec(),
                response_ids: text.bytes().map(u32::from).collect(),
                logprobs: vec![-0.5; text.len()],
                text,
                finish: FinishReason::Eos,
            });
        }
        Ok(out)
    }
}

/// A bank with one balance. `transfer` is destructive.
struct Bank {
    name: &'static str,
    balance: i64,
    log: Log,
}

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_balance".into(),
            description: "balance".into(),
            input_schema: json!({"type": "object"}),
            annotations: ToolAnnotations {
                read_only: true,
                ..Default::default()
            },
        },
        ToolSpec {
            name: "transfer".into(),
            description: "send money".into(),
            input_schema: json!({"type": "object", "properties": {"amount": {"type": "integer"}}}),
            annotations: ToolAnnotations {
                destructive: true,
                ..Default::default()
            },
        },
    ]
}

#[async_trait]
impl Environment for Bank {
    fn name(&self) -> String {
        self.name.into()
    }
    async fn tools(&mut self) -> Result<Vec<ToolSpec>, EnvError> {
        Ok(tools())
    }
    async fn reset(&mut self, _task: Option<&str>) -> Result<(), EnvError> {
        log(&self.log, format!("{}:reset", self.name));
        self.balance = 10;
        Ok(())
    }
    async fn call(&mut self, call: &ToolCall) -> Result<ToolResponse, EnvError> {
        log(&self.log, format!("{}:call:{}", self.name, call.name));
        match call.name.as_str() {
            "get_balance" => Ok(ToolResponse::Success {
                value: json!({"balance": self.balance}),
            }),
            "transfer" => {
                let amount = call.arguments["amount"].as_i64().unwrap_or(0);
                if amount > self.balance {
                    return Ok(ToolResponse::Error {
                        code: "insufficient_funds".into(),
                        message: "not enough money".into(),
                    });
                }
                self.balance -= amount;
                Ok(ToolResponse::Success {
                    value: json!({"balance": self.balance}),
                })
            }
            "crash" => Err(EnvError::Other("server died".into())),
            _ => Ok(ToolResponse::Error {
                code: "unknown_tool".into(),
                message: call.name.clone(),
            }),
        }
    }
    async fn snapshot(&mut self) -> Result<Value, EnvError> {
        Ok(json!({"balance": self.balance}))
    }
    async fn state_hash(&mut self) -> Result<String, EnvError> {
        Ok(self.balance.to_string())
    }
    async fn score(&mut self, trace: &EpisodeTrace) -> Result<Score, EnvError> {
        log(&self.log, format!("{}:score", self.name));
        let ok = self.balance == 5 && trace.finished_normally;
        Ok(Score {
            reward: if ok { 1.0 } else { 0.0 },
            partial: if ok { 1.0 } else { 0.0 },
            checklist: vec![],
        })
    }
}

fn bank(name: &'static str, l: &Log) -> Bank {
    Bank {
        name,
        balance: 10,
        log: l.clone(),
    }
}

fn model(actor: &[&str], sim: &[String], l: &Log) -> SharedModel {
    share_model(Box::new(ScriptedModel {
        actor: actor.iter().map(|s| s.to_string()).collect(),
        sim: sim.iter().cloned().collect(),
        log: l.clone(),
    }))
}

fn spec() -> EpisodeSpec {
    EpisodeSpec {
        task_id: Some("pay5".into()),
        system: "Bank policy.".into(),
        user_turns: vec!["Send 5.".into()],
        tools: tools(),
        examples: vec![],
    }
}

const TRANSFER: &str =
    "<tool_call>{\"name\":\"transfer\",\"arguments\":{\"amount\":5}}</tool_call>";

fn sim_ok() -> String {
    "<execution_result>{\"balance\": 5}</execution_result>".into()
}

fn header(cfg: &EngineConfig) -> SessionHeader {
    SessionHeader::new(
        ModelRef {
            path: "scripted".into(),
            hash: "0000".into(),
            tool_rendering: None,
        },
        None,
        "bank",
        Some("pay5".into()),
        1,
        cfg.mode.name(),
        serde_json::to_value(cfg).expect("config"),
    )
}

#[tokio::test]
async fn real_mode_runs_calls_on_the_environment_and_writes_a_readable_session() {
    let l: Log = Log::default();
    let cfg = EngineConfig::default().with_seed(1);
    let mut env = bank("live", &l);
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("s.jsonl");
    let mut writer = SessionWriter::create(&path, &header(&cfg)).expect("writer");
    let mut engine = Engine::new(spec(), cfg).expect("engine");
    let outcome = Driver {
        model: model(&[TRANSFER, "Sent."], &[], &l),
        env: EnvAccess::Live(&mut env),
        approver: &mut approver,
        sink: &mut writer,
        ui: None,
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await
    .expect("run");
    assert_eq!(outcome.end, EndReason::Answered);
    assert_eq!(outcome.reward(), 1.0);
    assert_eq!(env.balance, 5);
    assert_eq!(
        entries(&l),
        ["gen:actor", "live:call:transfer", "gen:actor", "live:score"]
    );
    let s = read_session(&path).expect("session");
    assert!(s.warnings.is_empty());
    assert_eq!(s.header.mode, "real");
    let kinds: Vec<&str> = s.events.iter().map(|e| e.event.kind()).collect();
    assert!(kinds.contains(&"approval") && kinds.contains(&"real") && kinds.ends_with(&["reward"]));
    // Generations carry token ids, logprobs and a loss mask over the response.
    let g = s
        .events
        .iter()
        .find_map(|e| match &e.event {
            crate::session::EventBody::Generation(g) => Some(g.clone()),
            _ => None,
        })
        .expect("generation");
    assert_eq!(g.response_ids.len(), TRANSFER.len());
    assert_eq!(g.loss_mask, vec![1; TRANSFER.len()]);
    assert_eq!(g.logprobs.len(), TRANSFER.len());
}

#[tokio::test]
async fn rehearse_mode_never_touches_the_live_environment_and_scores_with_a_verifier() {
    let l: Log = Log::default();
    let cfg = EngineConfig {
        mode: Mode::Rehearse,
        ..EngineConfig::default()
    };
    let live = bank("live", &l);
    let mut verifier = bank("verifier", &l);
    let mut approver = PolicyApprover(ApprovalPolicy::Never);
    let mut sink = MemorySink::default();
    let mut engine = Engine::new(spec(), cfg).expect("engine");
    let outcome = Driver {
        model: model(&[TRANSFER, "Sent."], &[sim_ok()], &l),
        env: EnvAccess::VerifyAfter {
            verifier: &mut verifier,
            task_id: Some("pay5".into()),
        },
        approver: &mut approver,
        sink: &mut sink,
        ui: None,
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await
    .expect("run");
    assert_eq!(live.balance, 10, "the live environment is untouched");
    assert_eq!(outcome.scored_by, Some(ScoredBy::Verifier));
    assert_eq!(outcome.reward(), 1.0, "the verifier replayed the transfer");
    // The verifier is used only after every generation, and only to replay and score.
    assert_eq!(
        entries(&l),
        [
            "gen:actor",
            "gen:sim",
            "gen:actor",
            "verifier:reset",
            "verifier:call:transfer",
            "verifier:score"
        ]
    );
    assert!(!entries(&l).iter().any(|e| e.starts_with("live:")));
}

#[tokio::test]
async fn mode_and_environment_access_must_agree() {
    let l: Log = Log::default();
    let mut env = bank("live", &l);
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    let mut sink = MemorySink::default();
    let mut engine = Engine::new(
        spec(),
        EngineConfig {
            mode: Mode::Rehearse,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let r = Driver {
        model: model(&[], &[], &l),
        env: EnvAccess::Live(&mut env),
        approver: &mut approver,
        sink: &mut sink,
        ui: None,
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await;
    assert!(matches!(r, Err(DriverError::ModeMismatch { .. })));
    assert!(entries(&l).is_empty(), "nothing ran");

    let mut engine = Engine::new(spec(), EngineConfig::default()).expect("engine");
    let r = Driver {
        model: model(&[], &[], &l),
        env: EnvAccess::VerifyAfter {
            verifier: &mut env,
            task_id: None,
        },
        approver: &mut approver,
        sink: &mut sink,
        ui: None,
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await;
    assert!(matches!(r, Err(DriverError::ModeMismatch { .. })));
}

#[tokio::test]
async fn never_policy_keeps_irreversible_calls_from_running() {
    let l: Log = Log::default();
    let mut env = bank("live", &l);
    let mut approver = PolicyApprover(ApprovalPolicy::Never);
    let mut sink = MemorySink::default();
    let mut engine = Engine::new(spec(), EngineConfig::default()).expect("engine");
    let outcome = Driver {
        model: model(&[TRANSFER, "I could not send it."], &[], &l),
        env: EnvAccess::Live(&mut env),
        approver: &mut approver,
        sink: &mut sink,
        ui: None,
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await
    .expect("run");
    assert_eq!(env.balance, 10);
    assert_eq!(outcome.reward(), 0.0);
    assert!(!entries(&l).iter().any(|e| e == "live:call:transfer"));
}

#[test]
fn auto_policy_follows_the_rehearsal_verdict_for_irreversible_calls() {
    let req = |irreversible, rehearsal| ApprovalRequest {
        id: 0,
        call_id: "c".into(),
        call: ToolCall {
            name: "transfer".into(),
            arguments: json!({}),
        },
        irreversible,
        rehearsal,
        predicted: None,
    };
    let auto = PolicyApprover(ApprovalPolicy::Auto);
    let v = |s, f| {
        Some(RehearsalVerdict {
            branches: s + f,
            predicted_success: s,
            predicted_failure: f,
        })
    };
    assert_eq!(auto.decision(&req(false, None)), Decision::Approve);
    assert_eq!(auto.decision(&req(true, v(3, 1))), Decision::Approve);
    assert!(matches!(
        auto.decision(&req(true, v(1, 1))),
        Decision::Reject { .. }
    ));
    assert!(matches!(
        auto.decision(&req(true, None)),
        Decision::Reject { .. }
    ));
    assert_eq!(
        PolicyApprover(ApprovalPolicy::Always).decision(&req(true, None)),
        Decision::Approve
    );
}

#[tokio::test]
async fn streamed_text_and_persisted_events_reach_the_ui_channel() {
    let l: Log = Log::default();
    let mut env = bank("live", &l);
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    let mut sink = MemorySink::default();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut engine = Engine::new(spec(), EngineConfig::default()).expect("engine");
    Driver {
        model: model(&["Hello there."], &[], &l),
        env: EnvAccess::Live(&mut env),
        approver: &mut approver,
        sink: &mut sink,
        ui: Some(tx),
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await
    .expect("run");
    let mut text = String::new();
    let mut persisted = 0;
    let mut finished = false;
    while let Ok(ev) = rx.try_recv() {
        match ev {
            DriverEvent::Text { text: t, role, .. } => {
                assert_eq!(role, GenRole::Actor);
                text.push_str(&t);
            }
            DriverEvent::Persisted(_) => persisted += 1,
            DriverEvent::Finished(_) => finished = true,
            DriverEvent::AwaitingApproval(_) => {}
        }
    }
    assert_eq!(text, "Hello there.");
    assert_eq!(persisted, sink.records.len());
    assert!(finished);
}

#[tokio::test]
async fn cancelling_ends_the_episode_as_cancelled_without_generating() {
    let l: Log = Log::default();
    let mut env = bank("live", &l);
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    let mut sink = MemorySink::default();
    let cancel = CancelToken::new();
    cancel.cancel();
    let mut engine = Engine::new(spec(), EngineConfig::default()).expect("engine");
    let outcome = Driver {
        model: model(&["never used"], &[], &l),
        env: EnvAccess::Live(&mut env),
        approver: &mut approver,
        sink: &mut sink,
        ui: None,
        cancel,
    }
    .run(&mut engine)
    .await
    .expect("run");
    assert_eq!(outcome.end, EndReason::Cancelled);
    assert!(outcome.score.is_none());
    assert!(entries(&l).is_empty());
    assert_eq!(
        sink.records.last().map(|r| r.event.kind()),
        Some("episode_end")
    );
}

#[tokio::test]
async fn model_and_environment_failures_end_the_episode_as_failed() {
    let l: Log = Log::default();
    let mut env = bank("live", &l);
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    let mut sink = MemorySink::default();
    let mut engine = Engine::new(spec(), EngineConfig::default()).expect("engine");
    let outcome = Driver {
        model: model(&[], &[], &l),
        env: EnvAccess::Live(&mut env),
        approver: &mut approver,
        sink: &mut sink,
        ui: None,
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await
    .expect("run");
    assert!(
        matches!(&outcome.end, EndReason::Failed { message } if message.contains("script exhausted"))
    );

    let crash = "<tool_call>{\"name\":\"crash\",\"arguments\":{}}</tool_call>";
    let mut engine = Engine::new(spec(), EngineConfig::default()).expect("engine");
    let outcome = Driver {
        model: model(&[crash], &[], &l),
        env: EnvAccess::Live(&mut env),
        approver: &mut approver,
        sink: &mut sink,
        ui: None,
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await
    .expect("run");
    assert!(
        matches!(&outcome.end, EndReason::Failed { message } if message.contains("server died"))
    );
}

async fn rehearsed_session(
    dir: &std::path::Path,
    strategy: RehearsalStrategy,
) -> std::path::PathBuf {
    let l: Log = Log::default();
    let cfg = EngineConfig {
        mode: Mode::Real(LiveOptions {
            approval: ApprovalGate::Irreversible,
            private_rehearsal: Some(PrivateRehearsal {
                branches: 2,
                strategy,
                depth: RehearsalDepth::Turns(1),
                // The script answers the re-prompt (proposal, branch, commit, answer).
                memory: crate::engine::types::MemoryConfig {
                    commit: crate::engine::types::CommitRule::Reprompt,
                    ..Default::default()
                },
                ..PrivateRehearsal::default()
            }),
        }),
        ..EngineConfig::default()
    }
    .with_seed(3);
    let mut env = bank("live", &l);
    let mut approver = PolicyApprover(ApprovalPolicy::Always);
    let path = dir.join(format!("{strategy:?}.jsonl"));
    let mut writer = SessionWriter::create(&path, &header(&cfg)).expect("writer");
    let mut engine = Engine::new(spec(), cfg).expect("engine");
    let outcome = Driver {
        model: model(
            &[TRANSFER, TRANSFER, TRANSFER, "Sent."],
            &[sim_ok(), sim_ok()],
            &l,
        ),
        env: EnvAccess::Live(&mut env),
        approver: &mut approver,
        sink: &mut writer,
        ui: None,
        cancel: CancelToken::new(),
    }
    .run(&mut engine)
    .await
    .expect("run");
    assert_eq!(outcome.stats.rehearsal_branches, 2);
    assert_eq!(env.balance, 5, "exactly one real transfer");
    path
}

#[tokio::test]
async fn private_rehearsal_sessions_rebuild_their_branch_tree() {
    let dir = tempfile::tempdir().expect("tmp");
    for strategy in [RehearsalStrategy::Parallel, RehearsalStrategy::Sequential] {
        let path = rehearsed_session(dir.path(), strategy).await;
        let s = read_session(&path).expect("session");
        let tree = SessionTree::build(&s.events);
        assert_eq!(tree.branches().len(), 2, "{strategy:?}");
        let text = crate::session::replay_text(&path).expect("replay");
        assert!(text.contains("[branch 1]"), "{text}");
        assert!(text.contains("rehearsal memory:"), "{text}");
    }
}

#[tokio::test]
async fn same_seed_model_and_task_give_the_same_session_except_timestamps() {
    let d1 = tempfile::tempdir().expect("tmp");
    let d2 = tempfile::tempdir().expect("tmp");
    let a = rehearsed_session(d1.path(), RehearsalStrategy::Parallel).await;
    let b = rehearsed_session(d2.path(), RehearsalStrategy::Parallel).await;
    let a = std::fs::read_to_string(a).expect("a");
    let b = std::fs::read_to_string(b).expect("b");
    assert_eq!(strip_timestamps(&a), strip_timestamps(&b));
}
