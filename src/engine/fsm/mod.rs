//! THE episode engine, as a pure state machine: `handle(&mut self, Event) -> Vec<Effect>`. It
//! never does IO. A driver (the tokio one in `driver.rs`, the TUI, the RL rollout collector)
//! runs the effects — generate for a role, execute a call on the real environment, ask for
//! approval, persist an event, score — and feeds the results back as events.
//!
//! Flow: actor turn → for each proposed call: (Private Rehearsal first, when triggered) →
//! simulate (rehearse, shadow) → approval gate (real, shadow) → real execution (real, shadow) →
//! tool message → next actor turn … → final answer (→ next scripted user turn) → score → finish.
//!
//! Guarantees by construction:
//! - In `rehearse` mode no [`Effect::ExecuteReal`] can be produced: that effect carries a
//!   [`RealCallPermit`] whose only constructor refuses the rehearse mode, and the rehearse mode
//!   has no `LiveOptions` (hence no rehearsal or approval settings) to begin with.
//! - Every state waits for exactly one request id; events for other ids are ignored.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::fidelity::{FidelityTable, fidelity};
use super::parse::{ActorAction, ActorTurn, FormatEvent, SimOutput, parse_actor, parse_simulator};
use super::prompts::simulator::{SimulatorPromptInput, example_from_real};
use super::prompts::{
    actor_prompt, assistant_message, initial_conversation, render_memory, simulator_prompt,
    tool_message, tools_json,
};
use super::types::{
    ApprovalGate, BranchEnd, BranchStep, BranchSummary, CommitRule, Decision, EndReason,
    EngineConfig, EpisodeSpec, GenRole, MemoryPlacement, Mode, Prediction, PrivateRehearsal,
    RecordedExample, RehearsalDepth, RehearsalStrategy, RehearsalTrigger, ScoredBy,
    SimFailurePolicy, SimulatedOutcome,
};
use crate::env::{EpisodeTrace, Score, ToolResponse};
use crate::message::{Message, Role, ToolCall};
use crate::runtime::{Generation, SamplingParams};
use crate::session::schema::{EventBody, GenerationRecord, NewEvent};

/// Identifies one outstanding request (generation, real call, approval, scoring).
pub type RequestId = u64;

/// Proof that the episode's mode has a real environment. Only [`RealCallPermit::for_mode`]
/// makes one, and it refuses `Mode::Rehearse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RealCallPermit(());

impl RealCallPermit {
    pub fn for_mode(mode: &Mode) -> Option<Self> {
        match mode {
            Mode::Real(_) | Mode::Shadow(_) => Some(Self(())),
            Mode::Rehearse => None,
        }
    }
}

/// A generation to run: render `messages` (with `tools` for the actor), then `n` continuations.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub id: RequestId,
    pub role: GenRole,
    /// Rehearsal branch this generation belongs to (`None` on the main line; for the batched
    /// first steps of parallel rehearsal, the first branch number it serves).
    pub branch: Option<usize>,
    /// For simulator requests: the call being simulated.
    pub call_id: Option<String>,
    pub messages: Vec<Message>,
    pub tools: Vec<Value>,
    pub enable_thinking: bool,
    pub sampling: SamplingParams,
    pub n: usize,
}

/// What the rehearsal before a call predicted (for the approval hook).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RehearsalVerdict {
    pub branches: usize,
    pub predicted_success: usize,
    pub predicted_failure: usize,
}

/// A real call waiting for approval.
#[derive(Debug, Clone, PartialEq)]
pub struct ApprovalRequest {
    pub id: RequestId,
    pub call_id: String,
    pub call: ToolCall,
    pub irreversible: bool,
    /// Set when the call was committed after Private Rehearsal.
    pub rehearsal: Option<RehearsalVerdict>,
    /// Shadow mode: what the simulator predicted this call will return.
    pub predicted: Option<SimulatedOutcome>,
}

/// What the engine asks its driver to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    Generate(GenerateRequest),
    /// Run `call` on the real environment; answer with [`Event::RealResult`].
    ExecuteReal {
        id: RequestId,
        call_id: String,
        call: ToolCall,
        permit: RealCallPermit,
    },
    /// Answer with [`Event::ApprovalDecision`].
    AskApproval(ApprovalRequest),
    Persist(NewEvent),
    /// Score the episode (`Environment` = the live environment; `Verifier` = a fresh copy that
    /// replays `trace.actions` first); answer with [`Event::Scored`].
    Score {
        id: RequestId,
        trace: EpisodeTrace,
        by: ScoredBy,
    },
    /// The episode is over; no further effects follow.
    Finish(EpisodeOutcome),
}

/// What the driver reports back.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Start,
    GenerationDone {
        id: RequestId,
        generations: Vec<Generation>,
    },
    RealResult {
        id: RequestId,
        response: ToolResponse,
    },
    ApprovalDecision {
        id: RequestId,
        decision: Decision,
    },
    Scored {
        id: RequestId,
        score: Score,
    },
    /// The model or environment failed while serving a request (`None`: not tied to one).
    Error {
        id: Option<RequestId>,
        message: String,
    },
    Cancel,
}

/// Counters over one episode (main line unless said otherwise).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeStats {
    /// All actor generations, branches included.
    pub actor_generations: usize,
    /// All simulator generations, branches included.
    pub simulator_generations: usize,
    /// Main-line actor turns whose output needed a repair.
    pub actor_turns_repaired: usize,
    /// Main-line actor turns with a format failure.
    pub actor_turns_failed: usize,
    /// Main-line actor turns parsed.
    pub actor_turns: usize,
    pub simulator_format_failures: usize,
    pub simulator_rejections: usize,
    pub real_calls: usize,
    /// Calls answered by the simulator on the main line (rehearse mode).
    pub simulated_calls: usize,
    pub rehearsals: usize,
    pub rehearsal_branches: usize,
    /// Branch calls answered from an observed real error instead of the simulator.
    #[serde(default)]
    pub rehearsal_recalls: usize,
    /// Rehearse mode: main-line calls answered from a recorded example (`recall_recorded`).
    #[serde(default)]
    pub recalled_calls: usize,
    /// Generated tokens, all roles and branches.
    pub generated_tokens: usize,
    /// Shadow-mode fidelity per tool.
    pub fidelity: FidelityTable,
}

impl EpisodeStats {
    /// Share of main-line actor turns with a format failure.
    pub fn format_error_rate(&self) -> f64 {
        if self.actor_turns == 0 {
            0.0
        } else {
            self.actor_turns_failed as f64 / self.actor_turns as f64
        }
    }
}

/// How an episode ended, with its score (absent for aborted episodes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeOutcome {
    pub end: EndReason,
    pub score: Option<Score>,
    pub scored_by: Option<ScoredBy>,
    pub trace: EpisodeTrace,
    pub stats: EpisodeStats,
}

impl EpisodeOutcome {
    pub fn reward(&self) -> f64 {
        self.score.as_ref().map_or(0.0, |s| s.reward)
    }
}

/// Invalid engine inputs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("the episode has no user turn")]
    NoUserTurn,
    #[error("max_turns must be at least 1")]
    NoTurns,
    #[error("private rehearsal needs at least 1 branch")]
    NoBranches,
    #[error("rehearsal depth must be at least 1 turn")]
    ZeroDepth,
    #[error("rehearsal explore_temperature {0}: a finite temperature ≥ 0")]
    BadExploreTemperature(f64),
    /// A played history (see [`Engine::with_history`]) that the engine could not have produced.
    #[error("history message {index}: {message}")]
    BadHistory { index: usize, message: String },
}

/// The error code of the tool message that tells the actor a call was rejected at the approval
/// gate: that call never ran.
pub const REJECTED_BY_USER: &str = "rejected_by_user";

/// A call a played history already made.
#[derive(Debug, Clone, PartialEq)]
pub struct PlayedCall {
    pub call_id: String,
    pub call: ToolCall,
    /// The response the conversation shows for it (the tool message, as JSON when it parses).
    pub shown: Value,
}

/// The calls a history already made, in order: every call of an assistant message that a later
/// tool message answers, except calls rejected at the approval gate (their tool message carries
/// the [`REJECTED_BY_USER`] error: they never ran). Calls without an answer yet are pending, not
/// played. These are what scoring counts as actions and what a fork replays on a live
/// environment.
pub fn played_calls(history: &[Message]) -> Vec<PlayedCall> {
    let mut out = Vec::new();
    for (i, m) in history.iter().enumerate() {
        if m.role != Role::Tool {
            continue;
        }
        let Some(id) = m.tool_call_id.as_deref() else {
            continue;
        };
        let call = history[..i]
            .iter()
            .rev()
            .flat_map(|a| a.tool_calls.iter())
            .find(|tc| tc.id == id);
        let Some(tc) = call else { continue };
        let shown = serde_json::from_str::<Value>(&m.content)
            .unwrap_or_else(|_| Value::String(m.content.clone()));
        let rejected = shown
            .pointer("/error/code")
            .and_then(Value::as_str)
            .is_some_and(|c| c == REJECTED_BY_USER);
        if !rejected {
            out.push(PlayedCall {
                call_id: id.to_string(),
                call: tc.function.clone(),
                shown,
            });
        }
    }
    out
}

/// The calls of the history's last assistant message that no tool message answers yet: the
/// engine runs them first when it starts from this history.
fn pending_calls(history: &[Message]) -> Vec<(String, ToolCall)> {
    let Some(pos) = history.iter().rposition(|m| m.role == Role::Assistant) else {
        return Vec::new();
    };
    let answered: Vec<&str> = history[pos + 1..]
        .iter()
        .filter_map(|m| m.tool_call_id.as_deref())
        .collect();
    history[pos]
        .tool_calls
        .iter()
        .filter(|tc| !answered.contains(&tc.id.as_str()))
        .map(|tc| (tc.id.clone(), tc.function.clone()))
        .collect()
}

/// Check that `history` could follow `spec`'s initial conversation on an engine's main line:
/// no system message; a tool message answers a call of the latest assistant message; no
/// assistant or user message while a call is unanswered (except at the very end, where the calls
/// are pending); a user message follows a final answer, and there are no more of them than
/// scripted user turns after the first.
pub fn check_history(spec: &EpisodeSpec, history: &[Message]) -> Result<(), EngineError> {
    let bad = |index: usize, message: String| EngineError::BadHistory { index, message };
    let mut pending: Vec<&str> = Vec::new();
    let mut users = 0;
    let mut after_answer = false;
    for (i, m) in history.iter().enumerate() {
        match m.role {
            Role::System => {
                return Err(bad(
                    i,
                    "a system message (the initial conversation comes from the spec)".into(),
                ));
            }
            Role::User | Role::Assistant if !pending.is_empty() => {
                return Err(bad(
                    i,
                    format!("call `{}` has no tool message before it", pending[0]),
                ));
            }
            Role::User => {
                if !after_answer {
                    return Err(bad(
                        i,
                        "a user message that does not follow a final answer".into(),
                    ));
                }
                users += 1;
                if users >= spec.user_turns.len() {
                    return Err(bad(
                        i,
                        format!(
                            "more user messages than the {} scripted turn(s) after the first",
                            spec.user_turns.len().saturating_sub(1)
                        ),
                    ));
                }
                after_answer = false;
            }
            Role::Assistant => {
                pending = m.tool_calls.iter().map(|tc| tc.id.as_str()).collect();
                after_answer = m.tool_calls.is_empty();
            }
            Role::Tool => {
                let id = m.tool_call_id.as_deref().unwrap_or_default();
                let Some(at) = pending.iter().position(|p| *p == id) else {
                    return Err(bad(
                        i,
                        format!("a tool message for `{id}`, which is not an unanswered call"),
                    ));
                };
                pending.remove(at);
                after_answer = false;
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone)]
struct Pending {
    id: RequestId,
    prompt: Vec<Message>,
    branch: Option<usize>,
    call_id: Option<String>,
}

#[derive(Debug, Clone)]
struct QueuedCall {
    id: String,
    call: ToolCall,
    irreversible: bool,
}

#[derive(Debug, Clone)]
struct CallsState {
    calls: Vec<QueuedCall>,
    next: usize,
    verdict: Option<RehearsalVerdict>,
}

#[derive(Debug, Clone)]
enum CallStep {
    /// Waiting for the simulator (rehearse: the answer; shadow: the prediction).
    Simulating { req: Pending },
    AwaitingApproval {
        id: RequestId,
        prediction: Option<SimulatedOutcome>,
    },
    Executing {
        id: RequestId,
        prediction: Option<SimulatedOutcome>,
    },
}

/// A rehearsal in progress (the data that stays fixed while branches run).
#[derive(Debug, Clone)]
struct Rehearsal {
    cfg: PrivateRehearsal,
    start_id: String,
    /// The actor's proposed turn: the first step of branch 0.
    proposal: Option<(ActorTurn, Vec<String>)>,
    /// The same proposal, kept for [`CommitRule::DraftUnlessFailure`].
    draft: (ActorTurn, Vec<String>),
    /// Parallel mode: pre-generated first steps of branches 1…N-1.
    first_steps: VecDeque<(Pending, usize, Generation)>,
    /// Each branch's first actor turn, by branch index (for [`CommitRule::BestBranch`]).
    first_turns: Vec<(usize, ActorTurn, Vec<String>)>,
    done: Vec<BranchSummary>,
}

#[derive(Debug, Clone)]
struct Branch {
    index: usize,
    tip: String,
    conv: Vec<Message>,
    next_user: usize,
    depth: u32,
    steps: Vec<BranchStep>,
    calls: Vec<QueuedCall>,
    next_call: usize,
    tool_errors: usize,
}

#[derive(Debug, Clone)]
enum BranchWait {
    Actor { req: Pending },
    Simulator { req: Pending },
}

#[derive(Debug, Clone)]
enum RehearsalWait {
    FirstSteps { req: Pending },
    Branch(Box<Branch>, BranchWait),
}

/// The engine's state: what it is waiting for.
#[derive(Debug, Clone)]
enum Phase {
    NotStarted,
    Actor {
        req: Pending,
        commit: Option<RehearsalVerdict>,
    },
    Calls(CallsState, CallStep),
    Rehearsing(Box<Rehearsal>, RehearsalWait),
    Scoring {
        id: RequestId,
        end: EndReason,
        by: ScoredBy,
    },
    Done,
}

/// One episode.
#[derive(Debug, Clone)]
pub struct Engine {
    cfg: EngineConfig,
    spec: EpisodeSpec,
    /// Main-line messages already played (a fork's history), replayed at start.
    history: Vec<Message>,
    tools: Vec<Value>,
    next_request: u64,
    next_event: u64,
    next_call: u64,
    conv: Vec<Message>,
    next_user: usize,
    turns: u32,
    tip: Option<String>,
    examples: Vec<RecordedExample>,
    /// Real errors observed in this episode since the last irreversible call that succeeded
    /// (the state they were observed in): what Private Rehearsal recalls instead of imagining.
    observed_errors: Vec<(ToolCall, Value)>,
    trace: EpisodeTrace,
    stats: EpisodeStats,
    phase: Phase,
    out: Vec<Effect>,
}

impl Engine {
    pub fn new(spec: EpisodeSpec, cfg: EngineConfig) -> Result<Self, EngineError> {
        if spec.user_turns.is_empty() {
            return Err(EngineError::NoUserTurn);
        }
        if cfg.max_turns == 0 {
            return Err(EngineError::NoTurns);
        }
        if let Some(pr) = cfg.mode.live().and_then(|l| l.private_rehearsal.as_ref()) {
            if pr.branches == 0 {
                return Err(EngineError::NoBranches);
            }
            if pr.depth == RehearsalDepth::Turns(0) {
                return Err(EngineError::ZeroDepth);
            }
            if let Some(t) = pr.explore_temperature
                && !(t.is_finite() && t >= 0.0)
            {
                return Err(EngineError::BadExploreTemperature(t));
            }
        }
        Ok(Self {
            tools: tools_json(&spec.tools),
            examples: spec.examples.clone(),
            observed_errors: Vec::new(),
            cfg,
            spec,
            history: Vec::new(),
            next_request: 0,
            next_event: 0,
            next_call: 0,
            conv: Vec::new(),
            next_user: 0,
            turns: 0,
            tip: None,
            trace: EpisodeTrace::default(),
            stats: EpisodeStats::default(),
            phase: Phase::NotStarted,
            out: Vec::new(),
        })
    }

    /// Start from a played history instead of the initial conversation alone (a fork): the
    /// main-line messages that followed the system prompt and first user turn, possibly edited.
    /// At start the engine persists them after the initial conversation, counts the actor turns
    /// (assistant messages) and user turns they used, puts their played calls
    /// ([`played_calls`]) and final answers into the trace (and, in live modes with
    /// `learn_examples_from_real`, the calls' responses into the simulator's examples), then
    /// continues where the history stops: pending calls of its last assistant message run
    /// first; after a final answer comes the next user turn or the end of the episode;
    /// otherwise the actor is asked. [`EpisodeStats`] count only what this engine generates.
    pub fn with_history(mut self, history: Vec<Message>) -> Result<Self, EngineError> {
        check_history(&self.spec, &history)?;
        self.history = history;
        Ok(self)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }
    pub fn spec(&self) -> &EpisodeSpec {
        &self.spec
    }
    /// The main-line conversation so far.
    pub fn conversation(&self) -> &[Message] {
        &self.conv
    }
    pub fn trace(&self) -> &EpisodeTrace {
        &self.trace
    }
    pub fn stats(&self) -> &EpisodeStats {
        &self.stats
    }
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }
    /// A short name of the current state (for status lines).
    pub fn state_name(&self) -> &'static str {
        match &self.phase {
            Phase::NotStarted => "not started",
            Phase::Actor { commit: None, .. } => "actor",
            Phase::Actor {
                commit: Some(_), ..
            } => "actor (commit)",
            Phase::Calls(_, CallStep::Simulating { .. }) => "simulating",
            Phase::Calls(_, CallStep::AwaitingApproval { .. }) => "awaiting approval",
            Phase::Calls(_, CallStep::Executing { .. }) => "executing",
            Phase::Rehearsing(..) => "rehearsing",
            Phase::Scoring { .. } => "scoring",
            Phase::Done => "done",
        }
    }

    /// Apply one event; return the effects to run, in order.
    pub fn handle(&mut self, event: Event) -> Vec<Effect> {
        let phase = std::mem::replace(&mut self.phase, Phase::Done);
        match (phase, event) {
            (Phase::Done, _) => {}
            (Phase::NotStarted, Event::Start) => self.start(),
            (Phase::NotStarted, Event::Cancel) => {
                self.finish(EndReason::Cancelled, None, None);
            }
            (p @ Phase::NotStarted, _) => self.phase = p,
            (Phase::Scoring { end, .. }, Event::Cancel) => self.finish(end, None, None),
            (Phase::Scoring { id, .. }, Event::Error { id: eid, message })
                if eid.is_none_or(|e| e == id) =>
            {
                // Recorded, and the outcome says why there is no score: an environment that
                // fails while checking the episode is an environment error, not a silent null.
                self.persist(EventBody::ScoringFailed {
                    message: message.clone(),
                });
                self.finish(
                    EndReason::Failed {
                        message: format!("scoring failed: {message}"),
                    },
                    None,
                    None,
                )
            }
            (_, Event::Cancel) => self.end(EndReason::Cancelled),
            (p, Event::Error { id, message }) => {
                if id.is_none_or(|i| Some(i) == pending_id(&p)) {
                    self.end(EndReason::Failed { message });
                } else {
                    self.phase = p;
                }
            }
            (Phase::Actor { req, commit }, Event::GenerationDone { id, generations })
                if id == req.id =>
            {
                self.on_actor(req, commit, generations)
            }
            (
                Phase::Calls(st, CallStep::Simulating { req }),
                Event::GenerationDone { id, generations },
            ) if id == req.id => self.on_main_simulation(st, req, generations),
            (
                Phase::Calls(st, CallStep::AwaitingApproval { id, prediction }),
                Event::ApprovalDecision { id: did, decision },
            ) if id == did => self.on_decision(st, prediction, decision),
            (
                Phase::Calls(st, CallStep::Executing { id, prediction }),
                Event::RealResult { id: rid, response },
            ) if id == rid => self.on_real(st, prediction, response),
            (Phase::Rehearsing(r, wait), Event::GenerationDone { id, generations })
                if Some(id) == rehearsal_pending(&wait) =>
            {
                self.on_rehearsal_generation(r, wait, generations)
            }
            (Phase::Scoring { id, end, by }, Event::Scored { id: sid, score }) if id == sid => {
                self.on_scored(end, by, score)
            }
            // Stale or unexpected: ignored, state unchanged.
            (p, _) => self.phase = p,
        }
        std::mem::take(&mut self.out)
    }

    // ---- plumbing -------------------------------------------------------------------------

    fn new_request(&mut self) -> RequestId {
        let id = self.next_request;
        self.next_request += 1;
        id
    }

    fn new_call_ids(&mut self, n: usize) -> Vec<String> {
        (0..n)
            .map(|_| {
                let id = format!("call_{}", self.next_call);
                self.next_call += 1;
                id
            })
            .collect()
    }

    /// Persist under `parent`; returns the new event's id.
    fn emit(&mut self, parent: Option<String>, event: EventBody) -> String {
        let id = format!("e{}", self.next_event);
        self.next_event += 1;
        self.out.push(Effect::Persist(NewEvent {
            id: id.clone(),
            parent,
            event,
        }));
        id
    }

    /// Persist on the main line.
    fn persist(&mut self, event: EventBody) {
        let id = self.emit(self.tip.clone(), event);
        self.tip = Some(id);
    }

    fn placement(&self) -> MemoryPlacement {
        self.rehearsal_cfg()
            .map_or(MemoryPlacement::UserMessage, |p| p.memory.placement)
    }

    fn rehearsal_cfg(&self) -> Option<&PrivateRehearsal> {
        self.cfg
            .mode
            .live()
            .and_then(|l| l.private_rehearsal.as_ref())
    }

    fn generate(
        &mut self,
        role: GenRole,
        branch: Option<usize>,
        call_id: Option<String>,
        prompt: Vec<Message>,
        mut sampling: SamplingParams,
        n: usize,
    ) -> Pending {
        let id = self.new_request();
        // Distinct, reproducible seeds per request.
        sampling.seed = sampling.seed.wrapping_add(id.wrapping_mul(1_000_003));
        let (tools, enable_thinking) = match role {
            GenRole::Actor => (self.tools.clone(), self.cfg.actor_thinking),
            GenRole::Simulator => (Vec::new(), self.cfg.simulator_thinking),
        };
        self.out.push(Effect::Generate(GenerateRequest {
            id,
            role,
            branch,
            call_id: call_id.clone(),
            messages: prompt.clone(),
            tools,
            enable_thinking,
            sampling,
            n,
        }));
        Pending {
            id,
            prompt,
            branch,
            call_id,
        }
    }

    fn generation_body(role: GenRole, req: &Pending, index: usize, g: &Generation) -> EventBody {
        EventBody::Generation(GenerationRecord {
            role,
            request: req.id,
            index,
            branch: req.branch,
            call_id: req.call_id.clone(),
            prompt: req.prompt.clone(),
            prompt_ids: g.prompt_ids.clone(),
            response_ids: g.response_ids.clone(),
            logprobs: g.logprobs.clone(),
            loss_mask: vec![1; g.response_ids.len()],
            text: g.text.clone(),
            finish: g.finish.clone(),
        })
    }

    fn count_generation(&mut self, role: GenRole, g: &Generation) {
        match role {
            GenRole::Actor => self.stats.actor_generations += 1,
            GenRole::Simulator => self.stats.simulator_generations += 1,
        }
        self.stats.generated_tokens += g.response_ids.len();
    }

    /// Keep a real error for recall; an irreversible call that succeeded may have changed the
    /// state every earlier error was observed in, so it clears them.
    fn observe_real(&mut self, call: &ToolCall, irreversible: bool, shown: &Value) {
        if shown.get("error").is_some() {
            self.observed_errors.push((call.clone(), shown.clone()));
        } else if irreversible {
            self.observed_errors.clear();
        }
    }

    /// The real error last observed for exactly this call in the current state, if any.
    fn recalled_error(&self, call: &ToolCall) -> Option<Value> {
        self.observed_errors
            .iter()
            .rev()
            .find(|(c, _)| c.name == call.name && c.arguments == call.arguments)
            .map(|(_, v)| v.clone())
    }

    fn is_irreversible(&self, name: &str) -> bool {
        self.spec
            .tools
            .iter()
            .any(|t| t.name == name && t.is_irreversible())
    }

    fn queue(&self, turn: &ActorTurn, ids: &[String]) -> Vec<QueuedCall> {
        turn.calls()
            .iter()
            .zip(ids)
            .map(|(c, id)| QueuedCall {
                id: id.clone(),
                call: c.clone(),
                irreversible: self.is_irreversible(&c.name),
            })
            .collect()
    }

    // ---- main line ------------------------------------------------------------------------

    fn start(&mut self) {
        self.persist(EventBody::EpisodeStart {
            task_id: self.spec.task_id.clone(),
            mode: self.cfg.mode.name().to_string(),
            tools: self.spec.tools.clone(),
            user_turns: self.spec.user_turns.clone(),
        });
        self.conv = initial_conversation(&self.spec);
        for m in self.conv.clone() {
            self.persist(EventBody::Message { message: m });
        }
        self.next_user = 1;
        let history = std::mem::take(&mut self.history);
        self.absorb_history(&history);
        match history.last() {
            Some(last) if last.role == Role::Assistant && last.tool_calls.is_empty() => {
                self.after_answer()
            }
            _ => {
                let calls: Vec<QueuedCall> = pending_calls(&history)
                    .into_iter()
                    .map(|(id, call)| QueuedCall {
                        irreversible: self.is_irreversible(&call.name),
                        id,
                        call,
                    })
                    .collect();
                if calls.is_empty() {
                    self.actor_turn(None)
                } else {
                    self.next_call(CallsState {
                        calls,
                        next: 0,
                        verdict: None,
                    })
                }
            }
        }
    }

    /// Persist a played history on the main line and account for it (see [`Self::with_history`]).
    fn absorb_history(&mut self, history: &[Message]) {
        // The history's calls join the trace after this loop: an answer's turn end counts the
        // calls played before it.
        for (i, m) in history.iter().enumerate() {
            self.persist(EventBody::Message { message: m.clone() });
            self.conv.push(m.clone());
            match m.role {
                Role::Assistant => {
                    self.turns += 1;
                    if m.tool_calls.is_empty() {
                        self.trace.agent_messages.push(m.content.clone());
                        self.trace
                            .turn_ends
                            .push(self.trace.actions.len() + played_calls(&history[..i]).len());
                    }
                    // New call ids continue after the history's.
                    for tc in &m.tool_calls {
                        if let Some(n) = tc
                            .id
                            .strip_prefix("call_")
                            .and_then(|n| n.parse::<u64>().ok())
                        {
                            self.next_call = self.next_call.max(n + 1);
                        }
                    }
                }
                Role::User => self.next_user += 1,
                Role::System | Role::Tool => {}
            }
        }
        let learn = self.cfg.learn_examples_from_real && self.cfg.mode.live().is_some();
        for p in played_calls(history) {
            if learn {
                self.examples.push(example_from_real(&p.call, &p.shown));
                let irreversible = self.is_irreversible(&p.call.name);
                self.observe_real(&p.call, irreversible, &p.shown);
            }
            self.trace.actions.push(p.call);
        }
    }

    /// After a final answer: the next scripted user turn, or the end of the episode.
    fn after_answer(&mut self) {
        if let Some(next) = self.spec.user_turns.get(self.next_user).cloned() {
            self.next_user += 1;
            let msg = Message::user(next);
            self.persist(EventBody::Message {
                message: msg.clone(),
            });
            self.conv.push(msg);
            self.actor_turn(None);
        } else {
            self.end(EndReason::Answered);
        }
    }

    /// Ask the actor for its next turn; `commit` carries a rehearsal memory and verdict.
    fn actor_turn(&mut self, commit: Option<(String, RehearsalVerdict)>) {
        if commit.is_none() {
            if self.turns >= self.cfg.max_turns {
                return self.end(EndReason::TurnLimit);
            }
            self.turns += 1;
        }
        let prompt = actor_prompt(
            &self.conv,
            commit.as_ref().map(|c| c.0.as_str()),
            self.placement(),
        );
        let sampling = self.cfg.actor_sampling.clone();
        let req = self.generate(GenRole::Actor, None, None, prompt, sampling, 1);
        self.phase = Phase::Actor {
            req,
            commit: commit.map(|c| c.1),
        };
    }

    /// Record a parsed actor turn (generation, parse, format events) on the main line.
    fn record_actor(&mut self, req: &Pending, g: &Generation) -> (ActorTurn, Vec<String>) {
        self.count_generation(GenRole::Actor, g);
        self.persist(Self::generation_body(GenRole::Actor, req, 0, g));
        let turn = parse_actor(&g.text);
        let ids = self.new_call_ids(turn.calls().len());
        self.persist(EventBody::ActorParsed {
            turn: turn.clone(),
            call_ids: ids.clone(),
        });
        self.stats.actor_turns += 1;
        let failed =
            turn.events.iter().any(|e| e.is_failure()) || turn.action == ActorAction::Malformed;
        if failed {
            self.stats.actor_turns_failed += 1;
        } else if !turn.events.is_empty() {
            self.stats.actor_turns_repaired += 1;
        }
        for e in &turn.events {
            self.persist(EventBody::Format {
                format: FormatEvent::Actor(e.clone()),
            });
        }
        (turn, ids)
    }

    fn on_actor(
        &mut self,
        req: Pending,
        commit: Option<RehearsalVerdict>,
        generations: Vec<Generation>,
    ) {
        let Some(g) = generations.into_iter().next() else {
            return self.end(EndReason::Failed {
                message: "the model returned no generation".into(),
            });
        };
        let (turn, ids) = self.record_actor(&req, &g);
        match &turn.action {
            ActorAction::Answer => {
                let msg = assistant_message(&turn, &[]);
                self.persist(EventBody::Message {
                    message: msg.clone(),
                });
                self.conv.push(msg);
                self.trace.agent_messages.push(turn.content.clone());
                self.trace.turn_ends.push(self.trace.actions.len());
                self.after_answer();
            }
            ActorAction::Malformed => self.end(EndReason::ActorFormatError),
            ActorAction::Calls { .. } => {
                let calls = self.queue(&turn, &ids);
                if commit.is_none() && self.should_rehearse(&calls) {
                    return self.start_rehearsal(turn, ids);
                }
                let msg = assistant_message(&turn, &ids);
                self.persist(EventBody::Message {
                    message: msg.clone(),
                });
                self.conv.push(msg);
                self.next_call(CallsState {
                    calls,
                    next: 0,
                    verdict: commit,
                });
            }
        }
    }

    fn should_rehearse(&self, calls: &[QueuedCall]) -> bool {
        match self.rehearsal_cfg() {
            None => false,
            Some(pr) => match pr.trigger {
                RehearsalTrigger::EveryCall => true,
                RehearsalTrigger::Irreversible => calls.iter().any(|c| c.irreversible),
            },
        }
    }

    fn next_call(&mut self, st: CallsState) {
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        if matches!(self.cfg.mode, Mode::Rehearse)
            && self.cfg.recall_recorded
            && let Some(value) = self.recorded_response(&q.call)
        {
            self.stats.recalled_calls += 1;
            let outcome = SimulatedOutcome::Parsed {
                output: SimOutput::Result { value },
            };
            self.persist(EventBody::Simulated {
                call_id: q.id.clone(),
                call: q.call.clone(),
                outcome: outcome.clone(),
                think: None,
                recalled: true,
            });
            return self.after_main_simulation(st, q, outcome);
        }
        match self.cfg.mode {
            Mode::Rehearse | Mode::Shadow(_) => {
                let prompt = simulator_prompt(
                    &SimulatorPromptInput {
                        tools: &self.spec.tools,
                        examples: &self.examples,
                        conversation: &self.conv,
                        call: &q.call,
                    },
                    &self.cfg.sim_prompt,
                );
                let sampling = self.cfg.simulator_sampling.clone();
                let req = self.generate(
                    GenRole::Simulator,
                    None,
                    Some(q.id.clone()),
                    prompt,
                    sampling,
                    1,
                );
                self.phase = Phase::Calls(st, CallStep::Simulating { req });
            }
            Mode::Real(_) => self.gate(st, None),
        }
    }

    /// Parse a simulator generation into an outcome, recording format failures.
    fn simulated_outcome(
        &mut self,
        g: &Generation,
        parent: Option<String>,
    ) -> (SimulatedOutcome, Option<String>, Option<String>) {
        let mut tip = parent;
        match parse_simulator(&g.text) {
            Ok(t) => {
                if matches!(t.output, SimOutput::Rejected { .. }) {
                    self.stats.simulator_rejections += 1;
                }
                (SimulatedOutcome::Parsed { output: t.output }, t.think, tip)
            }
            Err(error) => {
                self.stats.simulator_format_failures += 1;
                tip = Some(self.emit(
                    tip,
                    EventBody::Format {
                        format: FormatEvent::Simulator(error.clone()),
                    },
                ));
                (SimulatedOutcome::Unparseable { error }, None, tip)
            }
        }
    }

    fn on_main_simulation(&mut self, st: CallsState, req: Pending, generations: Vec<Generation>) {
        let Some(g) = generations.into_iter().next() else {
            return self.end(EndReason::Failed {
                message: "the model returned no generation".into(),
            });
        };
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        self.count_generation(GenRole::Simulator, &g);
        self.persist(Self::generation_body(GenRole::Simulator, &req, 0, &g));
        let (outcome, think, tip) = self.simulated_outcome(&g, self.tip.clone());
        self.tip = tip;
        self.persist(EventBody::Simulated {
            call_id: q.id.clone(),
            call: q.call.clone(),
            outcome: outcome.clone(),
            think,
            recalled: false,
        });
        self.after_main_simulation(st, q, outcome);
    }

    /// The response of the recorded example whose call is exactly `call` (rehearse mode's
    /// `recall_recorded`).
    fn recorded_response(&self, call: &ToolCall) -> Option<Value> {
        self.examples
            .iter()
            .find(|e| e.name == call.name && e.arguments == call.arguments)
            .map(|e| e.response.clone())
    }

    /// Go on from a main-line simulated outcome: the gate (shadow mode) or the actor sees it.
    fn after_main_simulation(
        &mut self,
        mut st: CallsState,
        q: QueuedCall,
        outcome: SimulatedOutcome,
    ) {
        match self.cfg.mode {
            Mode::Shadow(_) => self.gate(st, Some(outcome)),
            Mode::Real(_) => self.end(EndReason::Failed {
                message: "internal: simulation in real mode".into(),
            }),
            Mode::Rehearse => {
                self.stats.simulated_calls += 1;
                self.trace.actions.push(q.call.clone());
                let policy = self.cfg.sim_failure;
                let shown = match outcome {
                    SimulatedOutcome::Parsed {
                        output: SimOutput::Result { value },
                    } => value,
                    SimulatedOutcome::Parsed {
                        output: SimOutput::Rejected { code, message },
                    } => match policy {
                        SimFailurePolicy::EndWithZeroReward => {
                            return self.end(EndReason::SimulatorRejected { code, message });
                        }
                        SimFailurePolicy::ShowErrorToActor => {
                            json!({"error": {"code": code, "message": message}})
                        }
                    },
                    SimulatedOutcome::Unparseable { error } => match policy {
                        SimFailurePolicy::EndWithZeroReward => {
                            return self.end(EndReason::SimulatorFormatError { error });
                        }
                        SimFailurePolicy::ShowErrorToActor => {
                            json!({"error": {"code": "simulator_format_error", "message": error.to_string()}})
                        }
                    },
                };
                self.tool_result(&q, &shown);
                st.next += 1;
                self.next_call(st);
            }
        }
    }

    fn tool_result(&mut self, q: &QueuedCall, value: &Value) {
        let msg = tool_message(&q.id, &q.call.name, value);
        self.persist(EventBody::Message {
            message: msg.clone(),
        });
        self.conv.push(msg);
    }

    /// The approval gate before a real call.
    fn gate(&mut self, st: CallsState, prediction: Option<SimulatedOutcome>) {
        let Some(live) = self.cfg.mode.live() else {
            return self.end(EndReason::Failed {
                message: "internal: approval gate in rehearse mode".into(),
            });
        };
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        let needs = match live.approval {
            ApprovalGate::Irreversible => q.irreversible,
            ApprovalGate::EveryCall => true,
            ApprovalGate::Off => false,
        };
        if !needs {
            return self.execute(st, prediction);
        }
        let id = self.new_request();
        self.persist(EventBody::ApprovalRequested {
            call_id: q.id.clone(),
            call: q.call.clone(),
            irreversible: q.irreversible,
        });
        self.out.push(Effect::AskApproval(ApprovalRequest {
            id,
            call_id: q.id.clone(),
            call: q.call.clone(),
            irreversible: q.irreversible,
            rehearsal: st.verdict,
            predicted: prediction.clone(),
        }));
        self.phase = Phase::Calls(st, CallStep::AwaitingApproval { id, prediction });
    }

    fn execute(&mut self, st: CallsState, prediction: Option<SimulatedOutcome>) {
        let Some(permit) = RealCallPermit::for_mode(&self.cfg.mode) else {
            return self.end(EndReason::Failed {
                message: "internal: real call in rehearse mode".into(),
            });
        };
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        let id = self.new_request();
        self.out.push(Effect::ExecuteReal {
            id,
            call_id: q.id,
            call: q.call,
            permit,
        });
        self.phase = Phase::Calls(st, CallStep::Executing { id, prediction });
    }

    fn on_decision(
        &mut self,
        mut st: CallsState,
        prediction: Option<SimulatedOutcome>,
        decision: Decision,
    ) {
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        self.persist(EventBody::Approval {
            call_id: q.id.clone(),
            decision: decision.clone(),
        });
        match decision {
            Decision::Approve => self.execute(st, prediction),
            Decision::ApproveEdited { arguments } => {
                if let Some(c) = st.calls.get_mut(st.next) {
                    c.call.arguments = arguments.clone();
                }
                // Keep the conversation consistent with what actually ran.
                for m in self.conv.iter_mut().rev() {
                    if let Some(tc) = m.tool_calls.iter_mut().find(|tc| tc.id == q.id) {
                        tc.function.arguments = arguments;
                        break;
                    }
                }
                self.execute(st, prediction)
            }
            Decision::Reject { reason } => {
                self.tool_result(
                    &q,
                    &json!({"error": {"code": REJECTED_BY_USER, "message": reason}}),
                );
                st.next += 1;
                self.next_call(st);
            }
            Decision::Terminate => self.end(EndReason::Terminated),
        }
    }

    fn on_real(
        &mut self,
        mut st: CallsState,
        prediction: Option<SimulatedOutcome>,
        response: ToolResponse,
    ) {
        let Some(q) = st.calls.get(st.next).cloned() else {
            return self.actor_turn(None);
        };
        self.stats.real_calls += 1;
        self.persist(EventBody::Real {
            call_id: q.id.clone(),
            call: q.call.clone(),
            response: response.clone(),
        });
        let real = response.to_json();
        if let Some(pred) = prediction {
            let f = fidelity(pred.value().as_ref(), &real);
            self.stats.fidelity.add(&q.call.name, &f);
            self.persist(EventBody::Fidelity {
                call_id: q.id.clone(),
                tool: q.call.name.clone(),
                fidelity: f,
            });
        }
        self.trace.actions.push(q.call.clone());
        if self.cfg.learn_examples_from_real {
            self.examples.push(example_from_real(&q.call, &real));
        }
        self.observe_real(&q.call, q.irreversible, &real);
        self.tool_result(&q, &real);
        st.next += 1;
        self.next_call(st);
    }

    fn end(&mut self, reason: EndReason) {
        self.trace.finished_normally = reason.is_normal();
        self.persist(EventBody::EpisodeEnd {
            reason: reason.clone(),
            finished_normally: reason.is_normal(),
        });
        if reason.is_aborted() {
            return self.finish(reason, None, None);
        }
        let forced = matches!(
            reason,
            EndReason::SimulatorRejected { .. } | EndReason::SimulatorFormatError { .. }
        );
        if forced {
            let score = Score {
                reward: 0.0,
                partial: 0.0,
                checklist: Vec::new(),
            };
            return self.on_scored(reason, ScoredBy::ForcedZero, score);
        }
        let by = match self.cfg.mode {
            Mode::Rehearse => ScoredBy::Verifier,
            Mode::Real(_) | Mode::Shadow(_) => ScoredBy::Environment,
        };
        let id = self.new_request();
        self.out.push(Effect::Score {
            id,
            trace: self.trace.clone(),
            by,
        });
        self.phase = Phase::Scoring {
            id,
            end: reason,
            by,
        };
    }

    fn on_scored(&mut self, end: EndReason, by: ScoredBy, score: Score) {
        self.persist(EventBody::Reward {
            reward: score.reward,
            partial: score.partial,
            checklist: score.checklist.clone(),
            scored_by: by,
        });
        self.finish(end, Some(score), Some(by));
    }

    fn finish(&mut self, end: EndReason, score: Option<Score>, by: Option<ScoredBy>) {
        self.out.push(Effect::Finish(EpisodeOutcome {
            end,
            score,
            scored_by: by,
            trace: self.trace.clone(),
            stats: self.stats.clone(),
        }));
        self.phase = Phase::Done;
    }

    // ---- Private Rehearsal ----------------------------------------------------------------

    fn start_rehearsal(&mut self, proposal: ActorTurn, ids: Vec<String>) {
        let Some(cfg) = self.rehearsal_cfg().cloned() else {
            return self.end(EndReason::Failed {
                message: "internal: rehearsal without configuration".into(),
            });
        };
        self.stats.rehearsals += 1;
        let n = cfg.branches.max(1);
        self.persist(EventBody::RehearsalStart {
            branches: n,
            strategy: cfg.strategy,
            trigger: cfg.trigger,
            depth: cfg.depth,
            proposed: proposal.calls().to_vec(),
        });
        let start_id = self.tip.clone().unwrap_or_default();
        let parallel_batch = cfg.strategy == RehearsalStrategy::Parallel && n > 1;
        let r = Box::new(Rehearsal {
            cfg,
            start_id,
            draft: (proposal.clone(), ids.clone()),
            proposal: Some((proposal, ids)),
            first_steps: VecDeque::new(),
            first_turns: Vec::new(),
            done: Vec::new(),
        });
        if parallel_batch {
            let prompt = actor_prompt(&self.conv, None, self.placement());
            let sampling = first_step_sampling(&r.cfg);
            let req = self.generate(GenRole::Actor, Some(1), None, prompt, sampling, n - 1);
            self.phase = Phase::Rehearsing(r, RehearsalWait::FirstSteps { req });
        } else {
            self.begin_branch(r, 0);
        }
    }

    fn memory_for(&self, r: &Rehearsal) -> Option<String> {
        (r.cfg.strategy == RehearsalStrategy::Sequential && !r.done.is_empty())
            .then(|| render_memory(&r.done, &r.cfg.memory))
    }

    fn begin_branch(&mut self, mut r: Box<Rehearsal>, index: usize) {
        let tip = self.emit(Some(r.start_id.clone()), EventBody::BranchStart { index });
        let mut b = Box::new(Branch {
            index,
            tip,
            conv: self.conv.clone(),
            next_user: self.next_user,
            depth: 0,
            steps: Vec::new(),
            calls: Vec::new(),
            next_call: 0,
            tool_errors: 0,
        });
        if index == 0
            && let Some((turn, ids)) = r.proposal.take()
        {
            return self.branch_step(r, b, turn, ids);
        }
        if r.cfg.strategy == RehearsalStrategy::Parallel {
            if let Some((req, i, g)) = r.first_steps.pop_front() {
                let (turn, ids) = self.record_branch_actor(&mut b, &req, i, &g);
                return self.branch_step(r, b, turn, ids);
            }
            // Fewer first steps came back than asked for: stop here.
            return self.finish_rehearsal(r);
        }
        self.branch_actor(r, b);
    }

    /// Ask for the branch's next actor turn.
    fn branch_actor(&mut self, r: Box<Rehearsal>, b: Box<Branch>) {
        let memory = self.memory_for(&r);
        let prompt = actor_prompt(&b.conv, memory.as_deref(), self.placement());
        let sampling = if b.depth == 0 {
            first_step_sampling(&r.cfg)
        } else {
            r.cfg.sampling.clone()
        };
        let req = self.generate(GenRole::Actor, Some(b.index), None, prompt, sampling, 1);
        self.phase = Phase::Rehearsing(r, RehearsalWait::Branch(b, BranchWait::Actor { req }));
    }

    fn record_branch_actor(
        &mut self,
        b: &mut Branch,
        req: &Pending,
        index: usize,
        g: &Generation,
    ) -> (ActorTurn, Vec<String>) {
        self.count_generation(GenRole::Actor, g);
        let mut body = Self::generation_body(GenRole::Actor, req, index, g);
        if let EventBody::Generation(rec) = &mut body {
            rec.branch = Some(b.index);
        }
        b.tip = self.emit(Some(b.tip.clone()), body);
        let turn = parse_actor(&g.text);
        let ids = self.new_call_ids(turn.calls().len());
        b.tip = self.emit(
            Some(b.tip.clone()),
            EventBody::ActorParsed {
                turn: turn.clone(),
                call_ids: ids.clone(),
            },
        );
        for e in &turn.events {
            b.tip = self.emit(
                Some(b.tip.clone()),
                EventBody::Format {
                    format: FormatEvent::Actor(e.clone()),
                },
            );
        }
        (turn, ids)
    }

    fn branch_message(&mut self, b: &mut Branch, message: Message) {
        b.tip = self.emit(
            Some(b.tip.clone()),
            EventBody::Message {
                message: message.clone(),
            },
        );
        b.conv.push(message);
    }

    /// May the branch take another actor turn?
    fn branch_may_continue(&self, r: &Rehearsal, b: &Branch) -> Option<BranchEnd> {
        if let RehearsalDepth::Turns(d) = r.cfg.depth
            && b.depth >= d
        {
            return Some(BranchEnd::DepthReached);
        }
        // The proposal already counted as a main-line turn.
        let used = self.turns.saturating_sub(1) + b.depth;
        (used >= self.cfg.max_turns).then_some(BranchEnd::TurnLimit)
    }

    fn branch_step(
        &mut self,
        mut r: Box<Rehearsal>,
        mut b: Box<Branch>,
        turn: ActorTurn,
        ids: Vec<String>,
    ) {
        if b.depth == 0 && r.cfg.memory.commit == CommitRule::BestBranch {
            r.first_turns.push((b.index, turn.clone(), ids.clone()));
        }
        b.depth += 1;
        match &turn.action {
            ActorAction::Malformed => self.end_branch(r, &b, BranchEnd::ActorFormatError),
            ActorAction::Answer => {
                self.branch_message(&mut b, assistant_message(&turn, &[]));
                match self.spec.user_turns.get(b.next_user).cloned() {
                    None => self.end_branch(
                        r,
                        &b,
                        BranchEnd::Answered {
                            text: turn.content.clone(),
                        },
                    ),
                    Some(next) => {
                        if let Some(end) = self.branch_may_continue(&r, &b) {
                            return self.end_branch(r, &b, end);
                        }
                        b.next_user += 1;
                        self.branch_message(&mut b, Message::user(next));
                        self.branch_actor(r, b);
                    }
                }
            }
            ActorAction::Calls { .. } => {
                let calls = self.queue(&turn, &ids);
                self.branch_message(&mut b, assistant_message(&turn, &ids));
                b.calls = calls;
                b.next_call = 0;
                self.branch_next_call(r, b);
            }
        }
    }

    fn branch_next_call(&mut self, r: Box<Rehearsal>, b: Box<Branch>) {
        let Some(q) = b.calls.get(b.next_call).cloned() else {
            if let Some(end) = self.branch_may_continue(&r, &b) {
                return self.end_branch(r, &b, end);
            }
            return self.branch_actor(r, b);
        };
        if r.cfg.recall_errors
            && let Some(value) = self.recalled_error(&q.call)
        {
            self.stats.rehearsal_recalls += 1;
            let outcome = SimulatedOutcome::Parsed {
                output: SimOutput::Result { value },
            };
            return self.branch_outcome(r, b, q, outcome, None, true);
        }
        let prompt = simulator_prompt(
            &SimulatorPromptInput {
                tools: &self.spec.tools,
                examples: &self.examples,
                conversation: &b.conv,
                call: &q.call,
            },
            &self.cfg.sim_prompt,
        );
        let sampling = r.cfg.sampling.clone();
        let req = self.generate(
            GenRole::Simulator,
            Some(b.index),
            Some(q.id.clone()),
            prompt,
            sampling,
            1,
        );
        self.phase = Phase::Rehearsing(r, RehearsalWait::Branch(b, BranchWait::Simulator { req }));
    }

    fn on_rehearsal_generation(
        &mut self,
        mut r: Box<Rehearsal>,
        wait: RehearsalWait,
        generations: Vec<Generation>,
    ) {
        match wait {
            RehearsalWait::FirstSteps { req } => {
                for (i, g) in generations.into_iter().enumerate() {
                    r.first_steps.push_back((req.clone(), i, g));
                }
                self.begin_branch(r, 0);
            }
            RehearsalWait::Branch(mut b, BranchWait::Actor { req }) => {
                let Some(g) = generations.into_iter().next() else {
                    return self.end(EndReason::Failed {
                        message: "the model returned no generation".into(),
                    });
                };
                let (turn, ids) = self.record_branch_actor(&mut b, &req, 0, &g);
                self.branch_step(r, b, turn, ids);
            }
            RehearsalWait::Branch(mut b, BranchWait::Simulator { req }) => {
                let Some(g) = generations.into_iter().next() else {
                    return self.end(EndReason::Failed {
                        message: "the model returned no generation".into(),
                    });
                };
                let Some(q) = b.calls.get(b.next_call).cloned() else {
                    return self.branch_actor(r, b);
                };
                self.count_generation(GenRole::Simulator, &g);
                b.tip = self.emit(
                    Some(b.tip.clone()),
                    Self::generation_body(GenRole::Simulator, &req, 0, &g),
                );
                let (outcome, think, tip) = self.simulated_outcome(&g, Some(b.tip.clone()));
                b.tip = tip.unwrap_or_default();
                self.branch_outcome(r, b, q, outcome, think, false);
            }
        }
    }

    /// Record a branch call's simulated (or recalled) outcome and go on.
    fn branch_outcome(
        &mut self,
        r: Box<Rehearsal>,
        mut b: Box<Branch>,
        q: QueuedCall,
        outcome: SimulatedOutcome,
        think: Option<String>,
        recalled: bool,
    ) {
        b.tip = self.emit(
            Some(b.tip.clone()),
            EventBody::Simulated {
                call_id: q.id.clone(),
                call: q.call.clone(),
                outcome: outcome.clone(),
                think,
                recalled,
            },
        );
        b.steps.push(BranchStep {
            call: q.call.clone(),
            outcome: outcome.clone(),
        });
        match outcome {
            SimulatedOutcome::Parsed {
                output: SimOutput::Result { value },
            } => {
                if value.get("error").is_some() {
                    b.tool_errors += 1;
                }
                self.branch_message(&mut b, tool_message(&q.id, &q.call.name, &value));
                b.next_call += 1;
                self.branch_next_call(r, b);
            }
            SimulatedOutcome::Parsed {
                output: SimOutput::Rejected { code, message },
            } => self.end_branch(r, &b, BranchEnd::Rejected { code, message }),
            SimulatedOutcome::Unparseable { .. } => {
                self.end_branch(r, &b, BranchEnd::SimulatorFormatError)
            }
        }
    }

    fn end_branch(&mut self, mut r: Box<Rehearsal>, b: &Branch, end: BranchEnd) {
        let errors = b.tool_errors > 0;
        let prediction = match &end {
            BranchEnd::Answered { .. } if !errors => Prediction::Success,
            BranchEnd::DepthReached | BranchEnd::TurnLimit if !errors => Prediction::Unknown,
            BranchEnd::Answered { .. } | BranchEnd::DepthReached | BranchEnd::TurnLimit => {
                Prediction::Failure {
                    reason: "a tool returned an error".into(),
                }
            }
            BranchEnd::Rejected { code, .. } => Prediction::Failure {
                reason: format!("call rejected: {code}"),
            },
            BranchEnd::SimulatorFormatError => Prediction::Unknown,
            BranchEnd::ActorFormatError => Prediction::Failure {
                reason: "unparseable call".into(),
            },
        };
        let summary = BranchSummary {
            index: b.index,
            steps: b.steps.clone(),
            end,
            prediction,
        };
        self.emit(
            Some(b.tip.clone()),
            EventBody::BranchEnd {
                summary: summary.clone(),
            },
        );
        self.stats.rehearsal_branches += 1;
        r.done.push(summary);
        let next = b.index + 1;
        if next < r.cfg.branches {
            self.begin_branch(r, next)
        } else {
            self.finish_rehearsal(r)
        }
    }

    fn finish_rehearsal(&mut self, r: Box<Rehearsal>) {
        let text = render_memory(&r.done, &r.cfg.memory);
        let verdict = RehearsalVerdict {
            branches: r.done.len(),
            predicted_success: r
                .done
                .iter()
                .filter(|b| b.prediction == Prediction::Success)
                .count(),
            predicted_failure: r
                .done
                .iter()
                .filter(|b| matches!(b.prediction, Prediction::Failure { .. }))
                .count(),
        };
        let id = self.emit(
            Some(r.start_id.clone()),
            EventBody::RehearsalMemory {
                text: text.clone(),
                branches: r.done.iter().map(|b| b.index).collect(),
            },
        );
        self.tip = Some(id);
        let draft_failed = r
            .done
            .iter()
            .find(|b| b.index == 0)
            .is_none_or(|b| matches!(b.prediction, Prediction::Failure { .. }));
        let commit = match r.cfg.memory.commit {
            CommitRule::Reprompt => None,
            CommitRule::DraftUnlessFailure => (!draft_failed).then_some(r.draft),
            CommitRule::BestBranch if !draft_failed => Some(r.draft),
            CommitRule::BestBranch => {
                let draft_calls = r.draft.0.calls().to_vec();
                let succeeded = |i: usize| {
                    r.done
                        .iter()
                        .any(|b| b.index == i && b.prediction == Prediction::Success)
                };
                let alternative = r.first_turns.iter().find(|(i, turn, _)| {
                    *i != 0
                        && succeeded(*i)
                        && matches!(turn.action, ActorAction::Calls { .. })
                        && turn.calls() != draft_calls.as_slice()
                });
                Some(match alternative {
                    Some((_, turn, ids)) => (turn.clone(), ids.clone()),
                    None => r.draft,
                })
            }
        };
        if let Some((turn, ids)) = commit {
            // Commit without asking the actor again: the memory is on record.
            let calls = self.queue(&turn, &ids);
            let msg = assistant_message(&turn, &ids);
            self.persist(EventBody::Message {
                message: msg.clone(),
            });
            self.conv.push(msg);
            return self.next_call(CallsState {
                calls,
                next: 0,
                verdict: Some(verdict),
            });
        }
        self.actor_turn(Some((text, verdict)));
    }
}

/// Sampling of a branch's first imagined step (branches 1…N−1; branch 0 starts from the draft).
fn first_step_sampling(cfg: &PrivateRehearsal) -> SamplingParams {
    match cfg.explore_temperature {
        Some(temperature) => SamplingParams {
            temperature,
            ..cfg.sampling.clone()
        },
        None => cfg.sampling.clone(),
    }
}

fn pending_id(p: &Phase) -> Option<RequestId> {
    match p {
        Phase::Actor { req, .. } => Some(req.id),
        Phase::Calls(_, CallStep::Simulating { req }) => Some(req.id),
        Phase::Calls(_, CallStep::AwaitingApproval { id, .. })
        | Phase::Calls(_, CallStep::Executing { id, .. }) => Some(*id),
        Phase::Rehearsing(_, w) => rehearsal_pending(w),
        Phase::Scoring { id, .. } => Some(*id),
        Phase::NotStarted | Phase::Done => None,
    }
}

fn rehearsal_pending(w: &RehearsalWait) -> Option<RequestId> {
    match w {
        RehearsalWait::FirstSteps { req } => Some(req.id),
        RehearsalWait::Branch(_, BranchWait::Actor { req })
        | RehearsalWait::Branch(_, BranchWait::Simulator { req }) => Some(req.id),
    }
}

#[cfg(test)]
mod tests;
