//! FSM transition tests, without IO. A small scripted "world" answers the engine's effects
//! (actor texts, simulator texts, real responses, approval decisions, a score) so each test
//! states a behaviour and checks the effects and persisted events.

use std::collections::VecDeque;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use super::*;
use crate::engine::types::{
    ApprovalGate, BranchEnd, CommitRule, LiveOptions, MemoryConfig, Prediction, RehearsalStrategy,
    RehearsalTrigger, SimFailurePolicy,
};
use crate::env::{ToolAnnotations, ToolSpec};
use crate::runtime::FinishReason;
use crate::session::{EventBody, SessionTree, parse_session};

// ---- harness ------------------------------------------------------------------------------

fn tool(name: &str, destructive: bool) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        description: format!("{name} tool"),
        input_schema: json!({"type": "object"}),
        annotations: ToolAnnotations {
            destructive,
            ..Default::default()
        },
    }
}

fn spec(turns: &[&str]) -> EpisodeSpec {
    EpisodeSpec {
        task_id: Some("t1".into()),
        system: "Policy: be careful.".into(),
        user_turns: turns.iter().map(|s| s.to_string()).collect(),
        tools: vec![tool("get_balance", false), tool("transfer", true)],
        examples: vec![],
    }
}

fn cfg(mode: Mode) -> EngineConfig {
    EngineConfig {
        mode,
        ..EngineConfig::default()
    }
}

fn real() -> Mode {
    Mode::Real(LiveOptions::default())
}

fn shadow() -> Mode {
    Mode::Shadow(LiveOptions::default())
}

fn with_rehearsal(mode_live: fn(LiveOptions) -> Mode, pr: PrivateRehearsal) -> Mode {
    mode_live(LiveOptions {
        approval: ApprovalGate::Off,
        private_rehearsal: Some(pr),
    })
}

fn call_text(name: &str, args: Value) -> String {
    format!(
        "<tool_call>{}</tool_call>",
        json!({"name": name, "arguments": args})
    )
}

fn result_text(v: Value) -> String {
    format!("<execution_result>{v}</execution_result>")
}

fn gen_of(text: &str) -> Generation {
    let n = text.len().min(7);
    Generation {
        prompt_ids: vec![1, 2, 3],
        response_ids: (0..n as u32).collect(),
        logprobs: vec![-0.1; n],
        text: text.to_string(),
        finish: FinishReason::Eos,
    }
}

#[derive(Default)]
struct Script {
    actor: VecDeque<String>,
    sim: VecDeque<String>,
    real: VecDeque<ToolResponse>,
    decisions: VecDeque<Decision>,
    reward: f64,
}

impl Script {
    fn actor(mut self, texts: &[&str]) -> Self {
        self.actor.extend(texts.iter().map(|s| s.to_string()));
        self
    }
    fn actor_owned(mut self, texts: Vec<String>) -> Self {
        self.actor.extend(texts);
        self
    }
    fn sim(mut self, texts: Vec<String>) -> Self {
        self.sim.extend(texts);
        self
    }
    fn real(mut self, r: Vec<ToolResponse>) -> Self {
        self.real.extend(r);
        self
    }
    fn decide(mut self, d: Vec<Decision>) -> Self {
        self.decisions.extend(d);
        self
    }
}

#[derive(Default)]
struct Run {
    effects: Vec<Effect>,
    events: Vec<NewEvent>,
    outcome: Option<EpisodeOutcome>,
}

impl Run {
    fn generates(&self, role: GenRole) -> Vec<&GenerateRequest> {
        self.effects
            .iter()
            .filter_map(|e| match e {
                Effect::Generate(g) if g.role == role => Some(g),
                _ => None,
            })
            .collect()
    }
    fn real_calls(&self) -> Vec<&ToolCall> {
        self.effects
            .iter()
            .filter_map(|e| match e {
                Effect::ExecuteReal { call, .. } => Some(call),
                _ => None,
            })
            .collect()
    }
    fn approvals(&self) -> Vec<&ApprovalRequest> {
        self.effects
            .iter()
            .filter_map(|e| match e {
                Effect::AskApproval(a) => Some(a),
                _ => None,
            })
            .collect()
    }
    fn kinds(&self) -> Vec<&'static str> {
        self.events.iter().map(|e| e.event.kind()).collect()
    }
    fn outcome(&self) -> &EpisodeOutcome {
        self.outcome.as_ref().expect("episode finished")
    }
    fn count(&self, kind: &str) -> usize {
        self.kinds().iter().filter(|k| **k == kind).count()
    }
    /// The events as a session file, read back through the validating reader.
    fn as_session(&self) -> crate::session::Session {
        let header = crate::session::SessionHeader::new(
            crate::session::ModelRef {
                path: "m".into(),
                hash: "h".into(),
                tool_rendering: None,
            },
            None,
            "test",
            None,
            0,
            "real",
            serde_json::to_value(EngineConfig::default()).expect("config"),
        );
        let mut text = serde_json::to_string(&header).expect("header");
        text.push('\n');
        for (i, e) in self.events.iter().enumerate() {
            let rec = crate::session::EventRecord {
                seq: i as u64 + 1,
                id: e.id.clone(),
                parent: e.parent.clone(),
                ts: None,
                event: e.event.clone(),
            };
            text.push_str(&serde_json::to_string(&rec).expect("event"));
            text.push('\n');
        }
        parse_session(text.as_bytes(), "fsm").expect("valid session")
    }
}

/// Answer effects until the episode finishes (or nothing is left to do).
fn drive(engine: &mut Engine, script: &mut Script) -> Run {
    let mut run = Run::default();
    let mut queue: VecDeque<Effect> = engine.handle(Event::Start).into();
    let mut guard = 0;
    while let Some(effect) = queue.pop_front() {
        guard += 1;
        assert!(guard < 10_000, "runaway episode");
        run.effects.push(effect.clone());
        let event = match effect {
            Effect::Generate(g) => {
                let src = match g.role {
                    GenRole::Actor => &mut script.actor,
                    GenRole::Simulator => &mut script.sim,
                };
                let generations = (0..g.n)
                    .map(|_| gen_of(&src.pop_front().unwrap_or_else(|| "Done.".into())))
                    .collect();
                Event::GenerationDone {
                    id: g.id,
                    generations,
                }
            }
            Effect::ExecuteReal { id, .. } => Event::RealResult {
                id,
                response: script.real.pop_front().unwrap_or(ToolResponse::Success {
                    value: json!({"ok": true}),
                }),
            },
            Effect::AskApproval(a) => Event::ApprovalDecision {
                id: a.id,
                decision: script.decisions.pop_front().unwrap_or(Decision::Approve),
            },
            Effect::Persist(e) => {
                run.events.push(e);
                continue;
            }
            Effect::Score { id, .. } => Event::Scored {
                id,
                score: Score {
                    reward: script.reward,
                    partial: script.reward,
                    checklist: vec![],
                },
            },
            Effect::Finish(o) => {
                run.outcome = Some(o);
                continue;
            }
        };
        queue.extend(engine.handle(event));
    }
    run
}

fn run(spec: EpisodeSpec, cfg: EngineConfig, mut script: Script) -> Run {
    let mut e = Engine::new(spec, cfg).expect("engine");
    let r = drive(&mut e, &mut script);
    assert!(e.is_done(), "engine should be done, is {}", e.state_name());
    r
}

fn pr(branches: usize, strategy: RehearsalStrategy, depth: RehearsalDepth) -> PrivateRehearsal {
    PrivateRehearsal {
        branches,
        strategy,
        trigger: RehearsalTrigger::Irreversible,
        depth,
        // These tests follow the re-prompt path; the draft rule has its own tests.
        memory: MemoryConfig {
            commit: CommitRule::Reprompt,
            ..MemoryConfig::default()
        },
        sampling: SamplingParams::default(),
        recall_errors: false,
        explore_temperature: None,
    }
}

// ---- construction -------------------------------------------------------------------------

#[test]
fn engine_rejects_invalid_inputs() {
    assert_eq!(
        Engine::new(spec(&[]), cfg(real())).err(),
        Some(EngineError::NoUserTurn)
    );
    let mut c = cfg(real());
    c.max_turns = 0;
    assert_eq!(
        Engine::new(spec(&["x"]), c).err(),
        Some(EngineError::NoTurns)
    );
    let c = cfg(with_rehearsal(
        Mode::Real,
        pr(0, RehearsalStrategy::Parallel, RehearsalDepth::ToEnd),
    ));
    assert_eq!(
        Engine::new(spec(&["x"]), c).err(),
        Some(EngineError::NoBranches)
    );
    let c = cfg(with_rehearsal(
        Mode::Real,
        pr(2, RehearsalStrategy::Parallel, RehearsalDepth::Turns(0)),
    ));
    assert_eq!(
        Engine::new(spec(&["x"]), c).err(),
        Some(EngineError::ZeroDepth)
    );
    for bad in [-0.5, f64::INFINITY, f64::NAN] {
        let mut p = pr(2, RehearsalStrategy::Parallel, RehearsalDepth::Turns(1));
        p.explore_temperature = Some(bad);
        let err = Engine::new(spec(&["x"]), cfg(with_rehearsal(Mode::Real, p))).err();
        assert!(
            matches!(err, Some(EngineError::BadExploreTemperature(_))),
            "{bad}: {err:?}"
        );
    }
}

// ---- start and answers --------------------------------------------------------------------

#[test]
fn start_persists_episode_start_and_asks_the_actor_once() {
    let mut e = Engine::new(spec(&["hi"]), cfg(real())).expect("engine");
    let effects = e.handle(Event::Start);
    let kinds: Vec<&str> = effects
        .iter()
        .map(|f| match f {
            Effect::Persist(ev) => ev.event.kind(),
            Effect::Generate(_) => "GENERATE",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["episode_start", "message", "message", "GENERATE"]);
    let Some(Effect::Generate(g)) = effects.last() else {
        panic!("no generate")
    };
    assert_eq!(g.role, GenRole::Actor);
    assert_eq!(g.n, 1);
    assert_eq!(g.tools.len(), 2);
    assert!(g.enable_thinking);
    assert_eq!(
        g.messages,
        vec![Message::system("Policy: be careful."), Message::user("hi")]
    );
    assert_eq!(e.state_name(), "actor");
}

#[test]
fn plain_answer_ends_episode_normally_and_scores_with_the_environment() {
    let r = run(
        spec(&["hi"]),
        cfg(real()),
        Script {
            reward: 1.0,
            ..Script::default()
        }
        .actor(&["Hello!"]),
    );
    let o = r.outcome();
    assert_eq!(o.end, EndReason::Answered);
    assert_eq!(o.scored_by, Some(ScoredBy::Environment));
    assert_eq!(o.reward(), 1.0);
    assert!(o.trace.finished_normally);
    assert_eq!(o.trace.agent_messages, vec!["Hello!".to_string()]);
    let kinds = r.kinds();
    assert_eq!(&kinds[kinds.len() - 2..], ["episode_end", "reward"]);
}

#[test]
fn scripted_user_turns_follow_each_final_answer() {
    let r = run(
        spec(&["first", "second"]),
        cfg(real()),
        Script::default().actor(&["A1", "A2"]),
    );
    assert_eq!(r.outcome().trace.agent_messages, vec!["A1", "A2"]);
    let second = r.generates(GenRole::Actor)[1];
    let users: Vec<&str> = second
        .messages
        .iter()
        .filter(|m| m.role == crate::message::Role::User)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(users, ["first", "second"]);
}

#[test]
fn turn_limit_ends_episode_abnormally() {
    let mut c = cfg(real());
    c.max_turns = 2;
    let t = call_text("get_balance", json!({"id": "a"}));
    let r = run(spec(&["hi"]), c, Script::default().actor(&[&t, &t, &t]));
    assert_eq!(r.outcome().end, EndReason::TurnLimit);
    assert!(!r.outcome().trace.finished_normally);
    assert_eq!(r.generates(GenRole::Actor).len(), 2);
    assert_eq!(r.real_calls().len(), 2);
}

#[test]
fn malformed_actor_output_ends_with_format_error_and_records_why() {
    let r = run(
        spec(&["hi"]),
        cfg(real()),
        Script::default().actor(&["<tool_call>nonsense</tool_call>"]),
    );
    assert_eq!(r.outcome().end, EndReason::ActorFormatError);
    assert_eq!(r.count("format"), 1);
    assert_eq!(r.outcome().stats.actor_turns_failed, 1);
    assert_eq!(r.outcome().stats.format_error_rate(), 1.0);
}

#[test]
fn repaired_actor_output_is_recorded_as_format_event_and_continues() {
    let r = run(
        spec(&["hi"]),
        cfg(real()),
        Script::default().actor(&["<tool_call>{'name': 'get_balance', 'arguments': {}}", "ok"]),
    );
    assert_eq!(r.outcome().end, EndReason::Answered);
    assert_eq!(r.count("format"), 2); // single quotes + missing closing tag
    assert_eq!(r.outcome().stats.actor_turns_repaired, 1);
    assert_eq!(r.real_calls().len(), 1);
}

mod forks;
mod private_rehearsal;
mod real;
mod rehearse;
mod robustness;
mod shadow;
