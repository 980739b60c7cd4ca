//! The plain data a session file records, defined here so that the file format has one owner.
//!
//! Every type that appears inside a session line lives in this module (or in
//! [`crate::message`], the OpenAI-shaped messages every layer shares). The engine, the
//! environments and the runtime build and use these values (re-exported at their old paths:
//! `engine::types::EndReason`, `env::ToolSpec`, `runtime::FinishReason`, ...) and keep their
//! behaviour in their own `impl` blocks; but a change to a field here is a change to the file
//! format, made in this module, pinned by the golden file test (`tests/session_format.rs`)
//! and answered by [`FORMAT_VERSION`](super::schema::FORMAT_VERSION). This module depends on
//! nothing in the crate but `message`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::message::ToolCall;

// ---- Tools, their responses and the scoring checklist (the environments build these).

/// MCP-style behaviour hints of a tool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolAnnotations {
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub destructive: bool,
    #[serde(default)]
    pub idempotent: bool,
    #[serde(default)]
    pub open_world: bool,
}

/// A tool as the agent sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments object.
    pub input_schema: Value,
    #[serde(default)]
    pub annotations: ToolAnnotations,
}

/// What a tool call returned, as the agent will read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ToolResponse {
    Success {
        value: Value,
    },
    /// A structured error the agent can read (unknown id, bad argument, policy refusal...).
    Error {
        code: String,
        message: String,
    },
}

/// One checklist item of a score.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChecklistItem {
    pub name: String,
    pub weight: f64,
    pub passed: bool,
    pub reason: String,
}

// ---- Why a generation ended (the runtime reports it).

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", content = "detail", rename_all = "snake_case")]
pub enum FinishReason {
    Eos,
    Stop(String),
    Length,
    Cancelled,
}

// ---- What the engine reports: roles, approvals, episode ends, branch summaries.

/// Which role a generation plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GenRole {
    Actor,
    Simulator,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum RehearsalStrategy {
    /// Independent branches (first steps sampled as one batch).
    Parallel,
    /// Each branch sees the memory of the earlier ones.
    Sequential,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum RehearsalTrigger {
    /// Before turns that contain an irreversible call.
    Irreversible,
    /// Before every turn with calls.
    #[value(name = "every", alias = "every-call")]
    EveryCall,
}

/// How far a branch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "turns", rename_all = "snake_case")]
pub enum RehearsalDepth {
    /// At most this many imagined actor turns (≥ 1).
    Turns(u32),
    /// Until the imagined episode ends (bounded by the turn limit).
    ToEnd,
}

/// A human (or policy) answer to an approval request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    Approve,
    /// Run the call with these arguments instead.
    ApproveEdited {
        arguments: Value,
    },
    /// Do not run it; the actor is told why and continues.
    Reject {
        reason: String,
    },
    /// Stop the episode.
    Terminate,
}

/// Why an episode ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum EndReason {
    /// The actor gave its final answer to the last user turn.
    Answered,
    TurnLimit,
    /// The actor tried to call tools but no call could be parsed.
    ActorFormatError,
    SimulatorFormatError {
        error: SimFormatError,
    },
    SimulatorRejected {
        code: String,
        message: String,
    },
    /// The approval hook asked to stop.
    Terminated,
    Cancelled,
    /// The model or the environment failed (not the agent's fault).
    Failed {
        message: String,
    },
}

/// Who produced the reward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoredBy {
    /// The live environment (real and shadow modes).
    Environment,
    /// A fresh verifier copy that replayed the committed actions (rehearse mode).
    Verifier,
    /// Forced to zero by the simulator-failure policy, without scoring.
    ForcedZero,
}

/// What a rehearsal branch predicts about the real outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "prediction", rename_all = "snake_case")]
pub enum Prediction {
    Success,
    Failure { reason: String },
    Unknown,
}

/// One imagined call and its simulated outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchStep {
    pub call: ToolCall,
    pub outcome: SimulatedOutcome,
}

/// A simulator answer or why there was none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum SimulatedOutcome {
    Parsed { output: SimOutput },
    Unparseable { error: SimFormatError },
}

/// How an imagined branch ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "end", rename_all = "snake_case")]
pub enum BranchEnd {
    Answered { text: String },
    DepthReached,
    TurnLimit,
    Rejected { code: String, message: String },
    SimulatorFormatError,
    ActorFormatError,
}

/// A condensed rehearsal branch, as the memory and the session show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchSummary {
    pub index: usize,
    pub steps: Vec<BranchStep>,
    pub end: BranchEnd,
    pub prediction: Prediction,
}

// ---- A parsed actor turn, with every repair or failure found in it.

/// What the actor decided this turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ActorAction {
    /// One or more calls (never empty: the parser only builds this with at least one call).
    Calls { calls: Vec<ToolCall> },
    /// A plain answer that ends the turn; the text is [`ActorTurn::content`].
    Answer,
    /// The output tried to call tools but no call could be recovered.
    Malformed,
}

/// A repair or failure found while parsing actor output. `block` is the 0-based index of the
/// `<tool_call>` block (or leaked JSON object) concerned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ActorFormatEvent {
    /// `<think>` never closed; thinking was ended at the first `<tool_call>` or at the end.
    UnclosedThink,
    /// A `<tool_call>` block without `</tool_call>`; it was ended at the next block or the end.
    MissingClosingTag {
        block: usize,
    },
    /// `</tool_call>` without a matching opening tag (removed).
    StrayClosingTag,
    /// The JSON inside a block was wrapped in a Markdown code fence.
    CodeFence {
        block: usize,
    },
    /// Text inside a block around the JSON object (ignored).
    TextInBlock {
        block: usize,
        text: String,
    },
    /// Prose after the last tool call (ignored: not part of the assistant message).
    TrailingProse {
        text: String,
    },
    SingleQuotes {
        block: usize,
    },
    PythonLiterals {
        block: usize,
    },
    TrailingComma {
        block: usize,
    },
    /// `arguments` was a string holding JSON; it was decoded.
    ArgumentsAsString {
        block: usize,
    },
    /// Arguments were found under another key (`parameters`), or nested OpenAI style.
    ArgumentsKeyAlias {
        block: usize,
        key: String,
    },
    /// No `arguments` at all: `{}` was used.
    MissingArguments {
        block: usize,
    },
    /// A block held a JSON array of calls.
    CallArray {
        block: usize,
    },
    /// A call found as bare JSON in plain text, without `<tool_call>` tags.
    UntaggedToolCall {
        block: usize,
    },
    /// A block from which no call could be recovered.
    UnparseableToolCall {
        block: usize,
        reason: String,
        raw: String,
    },
    /// Nothing but whitespace (or only thinking) was produced.
    EmptyOutput,
}

/// A parsed actor generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActorTurn {
    pub think: Option<String>,
    /// Text of the assistant message: the answer, or the prose before the calls.
    pub content: String,
    pub action: ActorAction,
    pub events: Vec<ActorFormatEvent>,
}

// ---- A parsed simulator answer, or why it was not accepted.

/// What the simulator answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SimOutput {
    /// The simulated tool response (a non-empty object or array).
    Result { value: Value },
    /// The simulator refused the call (bad format, unknown tool, schema violation).
    Rejected { code: String, message: String },
}

/// Why a simulator output was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum SimFormatError {
    #[error("`<think>` is never closed")]
    UnclosedThink,
    #[error("no `<execution_result>` block")]
    MissingResult,
    #[error("`<execution_result>` is never closed")]
    UnclosedResult,
    #[error("more than one `<execution_result>` block")]
    MultipleResults,
    #[error("text outside the result block: {text:?}")]
    TextOutsideResult { text: String },
    #[error("result is not valid JSON: {reason}")]
    InvalidJson { reason: String },
    #[error("result is not a JSON object or array")]
    NotObjectOrArray,
    #[error("result is an empty object or array")]
    EmptyResult,
    #[error("malformed `error_tool_call`: {reason}")]
    MalformedRejection { reason: String },
}

// ---- A format event of either role.

/// A format event of either role, as sessions record it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum FormatEvent {
    Actor(ActorFormatEvent),
    Simulator(SimFormatError),
}

// ---- Simulated-vs-real fidelity of one call (shadow mode).

/// Fidelity of one prediction against the real response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fidelity {
    /// Identical JSON (numbers compared by value: `1` equals `1.0`).
    pub exact: bool,
    /// F1 between the sets of leaf paths (`a.b`, `items.0.id`).
    pub key_f1: f64,
    /// Fraction of the real response's leaf paths whose predicted value is equal.
    pub value_agreement: f64,
}
