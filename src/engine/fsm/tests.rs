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

// ---- real mode ----------------------------------------------------------------------------

#[test]
fn real_mode_executes_calls_in_order_and_feeds_results_back() {
    let two = format!(
        "{}{}",
        call_text("get_balance", json!({"id": "a"})),
        call_text("get_balance", json!({"id": "b"}))
    );
    let r = run(
        spec(&["hi"]),
        cfg(real()),
        Script::default()
            .actor(&[&two, "Balances shown."])
            .real(vec![
                ToolResponse::Success {
                    value: json!({"balance": 1}),
                },
                ToolResponse::Error {
                    code: "not_found".into(),
                    message: "no b".into(),
                },
            ]),
    );
    let calls = r.real_calls();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].arguments, json!({"id": "a"}));
    assert_eq!(calls[1].arguments, json!({"id": "b"}));
    assert!(r.generates(GenRole::Simulator).is_empty());
    let last_prompt = &r.generates(GenRole::Actor)[1].messages;
    let tools: Vec<&str> = last_prompt
        .iter()
        .filter(|m| m.role == crate::message::Role::Tool)
        .map(|m| m.content.as_str())
        .collect();
    assert_eq!(
        tools,
        [
            "{\"balance\":1}",
            "{\"error\":{\"code\":\"not_found\",\"message\":\"no b\"}}"
        ]
    );
    assert_eq!(r.outcome().trace.actions.len(), 2);
    assert_eq!(r.outcome().stats.real_calls, 2);
}

#[test]
fn irreversible_call_asks_approval_and_reversible_call_does_not() {
    let t = format!(
        "{}{}",
        call_text("get_balance", json!({})),
        call_text("transfer", json!({"amount": 5}))
    );
    let r = run(
        spec(&["pay"]),
        cfg(real()),
        Script::default().actor(&[&t, "done"]),
    );
    let asks = r.approvals();
    assert_eq!(asks.len(), 1);
    assert_eq!(asks[0].call.name, "transfer");
    assert!(asks[0].irreversible);
    assert_eq!(asks[0].rehearsal, None);
    assert_eq!(r.real_calls().len(), 2);
    assert_eq!(r.count("approval_requested"), 1);
    assert_eq!(r.count("approval"), 1);
}

#[test]
fn every_call_gate_asks_for_all_calls_and_off_gate_for_none() {
    let t = format!(
        "{}{}",
        call_text("get_balance", json!({})),
        call_text("transfer", json!({}))
    );
    let every = Mode::Real(LiveOptions {
        approval: ApprovalGate::EveryCall,
        private_rehearsal: None,
    });
    let r = run(
        spec(&["x"]),
        cfg(every),
        Script::default().actor(&[&t, "ok"]),
    );
    assert_eq!(r.approvals().len(), 2);
    let off = Mode::Real(LiveOptions {
        approval: ApprovalGate::Off,
        private_rehearsal: None,
    });
    let r = run(spec(&["x"]), cfg(off), Script::default().actor(&[&t, "ok"]));
    assert!(r.approvals().is_empty());
    assert_eq!(r.real_calls().len(), 2);
}

#[test]
fn rejected_approval_skips_the_call_and_tells_the_actor_why() {
    let t = call_text("transfer", json!({"amount": 5}));
    let r = run(
        spec(&["pay"]),
        cfg(real()),
        Script::default()
            .actor(&[&t, "Okay, not paying."])
            .decide(vec![Decision::Reject {
                reason: "too much".into(),
            }]),
    );
    assert!(r.real_calls().is_empty());
    let prompt = &r.generates(GenRole::Actor)[1].messages;
    let last = prompt.last().expect("tool message");
    assert_eq!(
        last.content,
        "{\"error\":{\"code\":\"rejected_by_user\",\"message\":\"too much\"}}"
    );
    assert!(r.outcome().trace.actions.is_empty());
    assert_eq!(r.outcome().end, EndReason::Answered);
}

#[test]
fn edited_approval_runs_the_edited_arguments_and_updates_the_conversation() {
    let t = call_text("transfer", json!({"amount": 500}));
    let r = run(
        spec(&["pay"]),
        cfg(real()),
        Script::default()
            .actor(&[&t, "paid"])
            .decide(vec![Decision::ApproveEdited {
                arguments: json!({"amount": 5}),
            }]),
    );
    assert_eq!(r.real_calls()[0].arguments, json!({"amount": 5}));
    assert_eq!(r.outcome().trace.actions[0].arguments, json!({"amount": 5}));
    let prompt = &r.generates(GenRole::Actor)[1].messages;
    let asst = prompt
        .iter()
        .find(|m| !m.tool_calls.is_empty())
        .expect("assistant with calls");
    assert_eq!(asst.tool_calls[0].function.arguments, json!({"amount": 5}));
}

#[test]
fn terminate_decision_ends_the_episode_without_running_the_call() {
    let t = call_text("transfer", json!({}));
    let r = run(
        spec(&["pay"]),
        cfg(real()),
        Script::default()
            .actor(&[&t])
            .decide(vec![Decision::Terminate]),
    );
    assert!(r.real_calls().is_empty());
    assert_eq!(r.outcome().end, EndReason::Terminated);
    assert!(!r.outcome().trace.finished_normally);
    assert_eq!(r.outcome().scored_by, Some(ScoredBy::Environment));
}

// ---- rehearse mode ------------------------------------------------------------------------

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

// ---- shadow mode --------------------------------------------------------------------------

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

// ---- Private Rehearsal --------------------------------------------------------------------

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

// ---- robustness ---------------------------------------------------------------------------

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

// ---- starting from a played history (forks) ----------------------------------------------

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
