//! The session file format (JSONL, version [`FORMAT_VERSION`]).
//!
//! Line 1 is a [`SessionHeader`]. Every later line is one [`EventRecord`]:
//! `{"seq": n, "id": "e7", "parent": "e6", "ts": "…", "event": {"type": "…", …}}`.
//! `seq` increases strictly; `id` is unique; `parent` names an earlier event (the one this
//! event follows causally; rehearsal branches hang off their `rehearsal_start`, so the branch
//! tree rebuilds from parents alone). `ts` is the only volatile field: with it stripped, the same
//! seed, model and task give the same file.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::format::{
    ActorTurn, BranchSummary, ChecklistItem, Decision, EndReason, Fidelity, FinishReason,
    FormatEvent, GenRole, RehearsalDepth, RehearsalStrategy, RehearsalTrigger, ScoredBy,
    SimulatedOutcome, ToolResponse, ToolSpec,
};
use crate::message::{Message, ToolCall};

/// Value of the header's `format` field.
pub const SESSION_FORMAT: &str = "envace-session";
/// Current format version; readers accept this and older.
///
/// History: **2** (2026-12-04): the header's `episode` (the episode configuration as chosen)
/// and the `scoring_failed` event. **1**: the first format. Version-1 files read unchanged
/// (the additions are optional); the golden file `tests/fixtures/sessions/format-v2.jsonl`
/// pins this version, and a real version-1 file is read beside it (`tests/session_format.rs`).
pub const FORMAT_VERSION: u32 = 2;

/// The model a session was recorded with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelRef {
    pub path: String,
    pub hash: String,
    /// How the tools were shown to the model (`template`, `system-hermes`, `system-smollm2`);
    /// absent in sessions written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_rendering: Option<String>,
}

/// Where a forked session came from: the original session and the main-line event the fork
/// continues after.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkOrigin {
    /// The original session: its file name when the fork lies beside it, else its path.
    pub session: String,
    /// The event the fork point was chosen at, and its `seq`, in the original session.
    pub event_id: String,
    pub seq: u64,
    /// Whether a message of the history was edited before re-running.
    pub edited: bool,
    /// The edited message's event id in the original session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edited_event: Option<String>,
}

/// The first line of a session file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionHeader {
    pub format: String,
    pub format_version: u32,
    pub envace_version: String,
    pub model: ModelRef,
    #[serde(default)]
    pub adapter: Option<String>,
    pub seed: u64,
    pub environment: String,
    #[serde(default)]
    pub task_id: Option<String>,
    pub mode: String,
    /// The episode configuration as chosen (the engine's `EpisodeConfig`, as JSON; opaque to
    /// this module): what fork and replay re-run. Absent in version-1 files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode: Option<Value>,
    /// The engine configuration it resolved to (with the model's prompt profile), as JSON.
    pub config: Value,
    /// Set when this session was forked from another one (a counterfactual re-run); absent in
    /// ordinary sessions and in files written before forks existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forked_from: Option<ForkOrigin>,
    /// Creation time (volatile; stripped for comparisons).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ts: Option<String>,
}

impl SessionHeader {
    /// A header without an episode configuration (see [`Self::with_episode`]).
    pub fn new(
        model: ModelRef,
        adapter: Option<String>,
        environment: impl Into<String>,
        task_id: Option<String>,
        seed: u64,
        mode: &str,
        config: Value,
    ) -> Self {
        Self {
            format: SESSION_FORMAT.to_string(),
            format_version: FORMAT_VERSION,
            envace_version: env!("CARGO_PKG_VERSION").to_string(),
            model,
            adapter,
            seed,
            environment: environment.into(),
            task_id,
            mode: mode.to_string(),
            episode: None,
            config,
            forked_from: None,
            ts: None,
        }
    }
}

impl SessionHeader {
    /// Record the episode configuration as chosen (what fork and replay re-run).
    pub fn with_episode(mut self, episode: Value) -> Self {
        self.episode = Some(episode);
        self
    }
}

/// An event as the engine produces it; the writer adds `seq` and `ts`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewEvent {
    pub id: String,
    pub parent: Option<String>,
    pub event: EventBody,
}

/// One event line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    pub seq: u64,
    pub id: String,
    #[serde(default)]
    pub parent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ts: Option<String>,
    pub event: EventBody,
}

/// One model generation with everything training needs (no re-tokenisation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationRecord {
    pub role: GenRole,
    /// The engine's request id; `index` is which of its `n` continuations this is.
    pub request: u64,
    pub index: usize,
    /// Rehearsal branch this generation belongs to, if any.
    #[serde(default)]
    pub branch: Option<usize>,
    /// For simulator generations: the call being simulated.
    #[serde(default)]
    pub call_id: Option<String>,
    /// The messages that were rendered into the prompt.
    pub prompt: Vec<Message>,
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// Loss mask over `response_ids` (prompt tokens are implicitly masked out).
    pub loss_mask: Vec<u8>,
    pub text: String,
    pub finish: FinishReason,
}

/// What happened. Tagged by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventBody {
    EpisodeStart {
        task_id: Option<String>,
        mode: String,
        tools: Vec<ToolSpec>,
        user_turns: Vec<String>,
    },
    /// A message appended to a conversation (main line, or a branch by ancestry).
    Message {
        message: Message,
    },
    Generation(GenerationRecord),
    /// The parse of an actor generation, with the ids given to its calls.
    ActorParsed {
        turn: ActorTurn,
        call_ids: Vec<String>,
    },
    Format {
        format: FormatEvent,
    },
    Simulated {
        call_id: String,
        call: ToolCall,
        outcome: SimulatedOutcome,
        #[serde(default)]
        think: Option<String>,
        /// The outcome is the real response already observed for the identical call, not a
        /// generation (Private Rehearsal's `recall_errors`).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        recalled: bool,
    },
    Real {
        call_id: String,
        call: ToolCall,
        response: ToolResponse,
    },
    Fidelity {
        call_id: String,
        tool: String,
        fidelity: Fidelity,
    },
    ApprovalRequested {
        call_id: String,
        call: ToolCall,
        irreversible: bool,
    },
    Approval {
        call_id: String,
        decision: Decision,
    },
    RehearsalStart {
        branches: usize,
        strategy: RehearsalStrategy,
        trigger: RehearsalTrigger,
        depth: RehearsalDepth,
        /// The calls the actor proposed that triggered the rehearsal (branch 0 starts with them).
        proposed: Vec<ToolCall>,
    },
    BranchStart {
        index: usize,
    },
    BranchEnd {
        summary: BranchSummary,
    },
    RehearsalMemory {
        text: String,
        branches: Vec<usize>,
    },
    EpisodeEnd {
        reason: EndReason,
        finished_normally: bool,
    },
    Reward {
        reward: f64,
        partial: f64,
        checklist: Vec<ChecklistItem>,
        scored_by: ScoredBy,
    },
    /// The episode ended but could not be scored (the environment failed while checking it:
    /// a server that died, a check call that errored at the transport level).
    ScoringFailed {
        message: String,
    },
}

impl EventBody {
    /// The `type` tag, for display.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::EpisodeStart { .. } => "episode_start",
            Self::Message { .. } => "message",
            Self::Generation(_) => "generation",
            Self::ActorParsed { .. } => "actor_parsed",
            Self::Format { .. } => "format",
            Self::Simulated { .. } => "simulated",
            Self::Real { .. } => "real",
            Self::Fidelity { .. } => "fidelity",
            Self::ApprovalRequested { .. } => "approval_requested",
            Self::Approval { .. } => "approval",
            Self::RehearsalStart { .. } => "rehearsal_start",
            Self::BranchStart { .. } => "branch_start",
            Self::BranchEnd { .. } => "branch_end",
            Self::RehearsalMemory { .. } => "rehearsal_memory",
            Self::EpisodeEnd { .. } => "episode_end",
            Self::Reward { .. } => "reward",
            Self::ScoringFailed { .. } => "scoring_failed",
        }
    }
}
