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
//!
//! The engine is one type spread over files by concept: this file holds the public data, the
//! state ([`Engine`], its phases), `handle` and the plumbing every part uses; `history` the
//! played history a fork starts from; `calls` the main line (actor turns and the call
//! pipeline: simulate, gate, execute); `rehearsal` Private Rehearsal's imagined branches.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::fidelity::FidelityTable;
use super::parse::ActorTurn;
use super::prompts::tools_json;
use super::types::{
    Decision, EndReason, EngineConfig, EpisodeSpec, GenRole, MemoryPlacement, Mode,
    PrivateRehearsal, RecordedExample, RehearsalDepth, ScoredBy, SimulatedOutcome,
};
use crate::env::{EpisodeTrace, Score, ToolResponse};
use crate::message::{Message, ToolCall};
use crate::runtime::{Generation, SamplingParams};
use crate::session::schema::{EventBody, GenerationRecord, NewEvent};

mod calls;
mod history;
mod rehearsal;

use calls::{CallStep, CallsState, QueuedCall};
pub use history::{PlayedCall, check_history, played_calls};
use rehearsal::{Rehearsal, RehearsalWait, rehearsal_pending};

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

#[derive(Debug, Clone)]
struct Pending {
    id: RequestId,
    prompt: Vec<Message>,
    branch: Option<usize>,
    call_id: Option<String>,
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
        if role == GenRole::Actor && self.cfg.constrain_tool_names {
            sampling.tool_names = crate::runtime::tool_format::tool_names(&tools);
        }
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

#[cfg(test)]
mod tests;
