//! Task environments behind one interface: the built-in domains, any MCP server, BFCL tasks.
//! The engine talks only to [`Environment`]; it never knows which kind answers. Tool errors
//! that an agent can read and recover from are data ([`ToolResponse::Error`]); failures of the
//! environment itself (a crashed server, a timeout) are [`EnvError`].

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::message::ToolCall;

pub use crate::session::format::{ChecklistItem, ToolAnnotations, ToolResponse, ToolSpec};

pub mod bfcl;
pub mod bfcl_multi;
pub mod cli;
pub mod domain_env;
pub mod domains;
pub mod mcp_client;
pub mod mcp_server;
pub mod mcp_tasks;
pub mod reward;
pub mod tasks;

pub use domain_env::DomainEnv;
pub use domains::Domain;
pub use tasks::{GoldTurnTrace, Split, Task};

impl ToolSpec {
    /// Irreversible = destructive and not read-only: these pass the approval gate and trigger
    /// Private Rehearsal.
    pub fn is_irreversible(&self) -> bool {
        self.annotations.destructive && !self.annotations.read_only
    }

    /// The OpenAI / HF `tools` entry: `{"type":"function","function":{name,description,parameters}}`.
    pub fn to_openai_json(&self) -> Value {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.input_schema,
            }
        })
    }
}

impl ToolResponse {
    /// The JSON the agent sees in its `tool` message: the value, or `{"error":{code,message}}`.
    pub fn to_json(&self) -> Value {
        match self {
            Self::Success { value } => value.clone(),
            Self::Error { code, message } => {
                serde_json::json!({"error": {"code": code, "message": message}})
            }
        }
    }
    pub fn is_error(&self) -> bool {
        matches!(self, Self::Error { .. })
    }
}

/// What an agent did in an episode, as a scorer needs it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeTrace {
    /// Tool calls the actor committed (in order), whether or not they succeeded.
    pub actions: Vec<ToolCall>,
    /// The agent's plain-text messages to the user (final answers), in order.
    pub agent_messages: Vec<String>,
    /// False when the episode ended abnormally (turn limit, parse failure, simulator rejection).
    pub finished_normally: bool,
    /// How many of `actions` had been committed when each final answer was given (one entry
    /// per answered user turn): a multi-turn task is scored turn by turn, so an action the user
    /// only asks for in a later turn does not count as right when taken early.
    #[serde(default)]
    pub turn_ends: Vec<usize>,
}

/// A finished episode's score: `reward` in [0,1] is task success (τ²-style, all-or-nothing);
/// `partial` is the weighted checklist fraction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Score {
    pub reward: f64,
    pub partial: f64,
    pub checklist: Vec<ChecklistItem>,
}

/// Failures of the environment itself (not of the agent's call).
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("unknown domain `{0}` (known: {1})")]
    UnknownDomain(String, String),
    #[error("unknown task `{0}`")]
    UnknownTask(String),
    #[error("mcp server `{server}`: {message}")]
    Mcp { server: String, message: String },
    #[error("mcp server `{server}`: tool call `{tool}` timed out after {seconds:.1}s")]
    Timeout {
        server: String,
        tool: String,
        seconds: f64,
    },
    #[error("{path}: task {task}: field `{field}`: {message}")]
    BadTask {
        path: String,
        task: String,
        field: String,
        message: String,
    },
    #[error("{0}")]
    Other(String),
}

/// A world the agent acts in. Implemented by the built-in domains and by MCP servers.
#[async_trait]
pub trait Environment: Send {
    /// A short name for sessions and the UI (`bank`, `mcp:server-filesystem`).
    fn name(&self) -> String;
    /// The tools on offer, with annotations.
    async fn tools(&mut self) -> Result<Vec<ToolSpec>, EnvError>;
    /// Reset to the initial state of a task (by id; environments without tasks ignore it).
    async fn reset(&mut self, task_id: Option<&str>) -> Result<(), EnvError>;
    /// Execute one tool call for real.
    async fn call(&mut self, call: &ToolCall) -> Result<ToolResponse, EnvError>;
    /// A JSON snapshot of the current state (for sessions and the UI).
    async fn snapshot(&mut self) -> Result<Value, EnvError>;
    /// A stable hash of the current state.
    async fn state_hash(&mut self) -> Result<String, EnvError>;
    /// Score a finished episode of the current task. Must not change the live state observed by
    /// the episode (scoring replays on fresh copies).
    async fn score(&mut self, trace: &EpisodeTrace) -> Result<Score, EnvError>;

    /// The current task's user messages, in order (a scripted follow-up turn is sent after the
    /// agent answered the previous one). Empty when the environment has no task.
    fn user_turns(&self) -> Vec<String> {
        Vec::new()
    }

    /// The current task's gold trajectory replayed on a fresh copy of its initial state: per
    /// turn, each (call, response) and the expert's reply. `None` without a gold solution.
    /// The simulator role uses these as recorded few-shot examples during training.
    fn gold_trajectory(&self) -> Result<Option<Vec<GoldTurnTrace>>, EnvError> {
        Ok(None)
    }
}
