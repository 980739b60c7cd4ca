//! The engine's vocabulary: episode inputs ([`EpisodeSpec`]), configuration ([`EngineConfig`],
//! whose [`Mode`] nests the options that only make sense with a real environment), and the
//! plain data the FSM reports (end reasons, approval decisions, rehearsal branch summaries),
//! which sessions record: those are defined in `session::format` (the file format's owner) and
//! re-exported here, with their small helpers. Pure data: no behaviour beyond small helpers.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::env::ToolSpec;
use crate::runtime::SamplingParams;

pub use crate::session::format::{
    BranchEnd, BranchStep, BranchSummary, Decision, EndReason, GenRole, Prediction, RehearsalDepth,
    RehearsalStrategy, RehearsalTrigger, ScoredBy, SimulatedOutcome,
};

/// A recorded `(name, arguments, response)` example shown to the simulator (few-shot).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedExample {
    pub name: String,
    pub arguments: Value,
    pub response: Value,
}

/// Everything the engine needs to know about one episode's task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeSpec {
    pub task_id: Option<String>,
    /// System prompt: the environment's policy and the task's instructions.
    pub system: String,
    /// User turns: the first opens the episode; each later one is sent after the actor's
    /// final answer to the previous one (scripted multi-turn tasks).
    pub user_turns: Vec<String>,
    pub tools: Vec<ToolSpec>,
    /// Few-shot examples for the simulator (e.g. the task's gold run during training).
    #[serde(default)]
    pub examples: Vec<RecordedExample>,
}

/// How the world answers tool calls. The options that need a real environment (Private
/// Rehearsal, the approval gate) exist only inside the modes that have one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Mode {
    /// The environment answers every call.
    Real(LiveOptions),
    /// The simulator predicts, then the environment answers; the actor sees the real answer.
    Shadow(LiveOptions),
    /// The simulator answers every call; the real environment is never called.
    Rehearse,
}

impl Mode {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Real(_) => "real",
            Self::Shadow(_) => "shadow",
            Self::Rehearse => "rehearse",
        }
    }
    pub fn live(&self) -> Option<&LiveOptions> {
        match self {
            Self::Real(l) | Self::Shadow(l) => Some(l),
            Self::Rehearse => None,
        }
    }
}

/// Options of the modes with a real environment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveOptions {
    pub approval: ApprovalGate,
    /// Private Rehearsal before real calls; `None` = off.
    pub private_rehearsal: Option<PrivateRehearsal>,
}

/// Which real calls must be approved before they run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalGate {
    /// Only irreversible calls (destructive, not read-only): the default.
    #[default]
    Irreversible,
    /// Every real call.
    EveryCall,
    /// No call is gated.
    Off,
}

/// Private Rehearsal settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrivateRehearsal {
    /// Number of imagined branches N (≥ 1).
    pub branches: usize,
    pub strategy: RehearsalStrategy,
    pub trigger: RehearsalTrigger,
    pub depth: RehearsalDepth,
    pub memory: MemoryConfig,
    /// Sampling for the imagined actor turns and simulations (low temperature recommended).
    pub sampling: SamplingParams,
    /// Answer an imagined call with the real error this episode already observed for the
    /// identical call (same name and arguments), as long as no irreversible call has succeeded
    /// since, instead of asking the simulator: imagination must not contradict what the
    /// environment just said (the bundled simulator predicted a booking for the very call the
    /// real environment had refused a turn earlier, so the draft was retried in a loop).
    #[serde(default = "default_recall_errors")]
    pub recall_errors: bool,
    /// Sampling temperature of the first imagined step of branches 1…N−1 (None: `sampling`'s).
    /// At a low temperature the siblings almost always propose the draft again, which leaves
    /// [`CommitRule::BestBranch`] no alternative to switch to.
    #[serde(default)]
    pub explore_temperature: Option<f64>,
}

pub(crate) fn default_recall_errors() -> bool {
    true
}

impl Default for PrivateRehearsal {
    fn default() -> Self {
        Self {
            branches: 4,
            strategy: RehearsalStrategy::Parallel,
            trigger: RehearsalTrigger::Irreversible,
            depth: RehearsalDepth::Turns(2),
            memory: MemoryConfig::default(),
            sampling: SamplingParams {
                temperature: 0.3,
                top_p: Some(0.95),
                max_tokens: 512,
                ..SamplingParams::default()
            },
            recall_errors: default_recall_errors(),
            explore_temperature: None,
        }
    }
}

/// How a rehearsal memory is written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MemoryConfig {
    pub format: MemoryFormat,
    /// Merge branches with the same actions and outcomes.
    pub dedupe: bool,
    pub selection: MemorySelection,
    /// Simulated results longer than this are cut (characters).
    pub max_result_chars: usize,
    pub placement: MemoryPlacement,
    /// What the actor commits after the rehearsal (sessions written before this setting
    /// existed re-prompted, and read back that way).
    #[serde(default = "CommitRule::legacy")]
    pub commit: CommitRule,
}

/// What the actor commits after a Private Rehearsal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum CommitRule {
    /// Always ask the actor again, with the memory in its prompt.
    Reprompt,
    /// Keep the drafted call (branch 0's first step) unless its own rehearsal predicted a
    /// failure; only then ask again with the memory. A simulator that is right about failures
    /// but unsure about hidden state then changes the course only where it saw trouble. On the
    /// bundled model it loses 12 points to no rehearsal where re-prompting loses 23
    /// (docs/REHEARSAL.md): the re-prompted actor drops calls the task wants tried.
    DraftUnlessFailure,
    /// Never ask again and never drop the call: keep the draft unless its own rehearsal
    /// predicted a failure and another branch that made a different first call predicted
    /// success; then commit that branch's first turn. A call every branch expects to fail is
    /// still tried (tasks often want the attempt, then a reply to the user); a draft whose
    /// rehearsal failed where a sibling's alternative succeeded (a mistyped id) is replaced.
    /// The default: on the bundled model rehearsal no longer costs success (68.3% with and
    /// without it on 100 test tasks per domain; on the previous one 55.7% with and without,
    /// where draft-unless-failure scored 46.0%).
    #[default]
    BestBranch,
}

impl CommitRule {
    /// The behaviour of sessions recorded before the rule was configurable.
    pub fn legacy() -> Self {
        Self::Reprompt
    }
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            format: MemoryFormat::Compact,
            dedupe: true,
            selection: MemorySelection::All,
            max_result_chars: 200,
            placement: MemoryPlacement::UserMessage,
            commit: CommitRule::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum MemoryFormat {
    /// One line per branch: actions → outcomes → prediction.
    Compact,
    /// Every step with its full simulated result.
    Full,
    /// The branch summaries as JSON.
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "k", rename_all = "snake_case")]
pub enum MemorySelection {
    All,
    /// Branches predicted to succeed first, then the others, at most `k`.
    SuccessFirst(usize),
    /// Only branches predicted to fail (what to avoid), at most `k`.
    FailuresOnly(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum MemoryPlacement {
    /// A user-role note appended after the conversation (works with every chat template).
    #[value(name = "user")]
    UserMessage,
    /// Appended to the system prompt.
    #[value(name = "system")]
    SystemSuffix,
}

/// What happens when the simulator's output does not parse or it rejects the call (in the
/// modes where the simulator answers; in shadow mode the real answer is used anyway).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimFailurePolicy {
    /// The paper's semantics: the episode ends with reward 0.
    #[default]
    EndWithZeroReward,
    /// The actor receives an error tool message and continues.
    ShowErrorToActor,
}

/// Simulator prompt settings (see `prompts::simulator`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimPromptConfig {
    /// Keep only the last this many conversation messages (0 = all).
    pub max_history_messages: usize,
    /// Cut each message or result to this many characters.
    pub max_message_chars: usize,
    /// Few-shot examples to show (same tool first).
    pub max_examples: usize,
    /// Include the system prompt (policy) in the simulator's context.
    pub include_policy: bool,
    /// Compact form for small models: a one-line instruction and tools as `name(params)`
    /// instead of full JSON schemas. A model's `envace.json` says which form it was trained on.
    #[serde(default)]
    pub compact: bool,
}

impl Default for SimPromptConfig {
    fn default() -> Self {
        Self {
            max_history_messages: 12,
            max_message_chars: 600,
            max_examples: 4,
            include_policy: false,
            compact: false,
        }
    }
}

/// Engine configuration for one episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    pub mode: Mode,
    /// Maximum actor turns on the main line (a rehearsal commit does not count again).
    pub max_turns: u32,
    pub sim_failure: SimFailurePolicy,
    pub actor_sampling: SamplingParams,
    pub simulator_sampling: SamplingParams,
    pub actor_thinking: bool,
    pub simulator_thinking: bool,
    pub sim_prompt: SimPromptConfig,
    /// Add real responses seen in this episode to the simulator's few-shot pool.
    pub learn_examples_from_real: bool,
    /// Rehearse mode: a call that exactly matches a recorded example (same name and arguments)
    /// gets the recorded response instead of a simulation; the simulator answers only the
    /// calls the record does not cover. Off by default (the paper's simulator answers every
    /// call); measured in docs/TRAINING.md: the bundled simulator rewrites even an exactly
    /// matching recorded response (a booking's `active` became `cancelled`), and GRPO then
    /// rewards the actor for answers that ignore what the tool said.
    #[serde(default)]
    pub recall_recorded: bool,
    /// Actor generations (main line and rehearsal branches) may only name listed tools in a
    /// call (`SamplingParams::tool_names`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub constrain_tool_names: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Real(LiveOptions::default()),
            max_turns: 12,
            sim_failure: SimFailurePolicy::default(),
            actor_sampling: SamplingParams {
                max_tokens: 512,
                ..SamplingParams::default()
            },
            simulator_sampling: SamplingParams {
                max_tokens: 384,
                ..SamplingParams::default()
            },
            actor_thinking: true,
            simulator_thinking: false,
            sim_prompt: SimPromptConfig::default(),
            learn_examples_from_real: true,
            recall_recorded: false,
            constrain_tool_names: false,
        }
    }
}

impl EngineConfig {
    /// Set the base seed of every sampler (actor, simulator, rehearsal); each request then
    /// derives its own seed from it, so one episode seed reproduces the whole episode.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.actor_sampling.seed = seed;
        self.simulator_sampling.seed = seed;
        if let Mode::Real(l) | Mode::Shadow(l) = &mut self.mode
            && let Some(pr) = &mut l.private_rehearsal
        {
            pr.sampling.seed = seed;
        }
        self
    }
}

impl EndReason {
    pub fn is_normal(&self) -> bool {
        matches!(self, Self::Answered)
    }
    /// Aborted episodes are not scored (they say nothing about the agent).
    pub fn is_aborted(&self) -> bool {
        matches!(self, Self::Cancelled | Self::Failed { .. })
    }
}

impl SimulatedOutcome {
    /// The parsed JSON (a rejection in its `error_tool_call` form), if any.
    pub fn value(&self) -> Option<Value> {
        match self {
            Self::Parsed { output } => Some(output.to_json()),
            Self::Unparseable { .. } => None,
        }
    }
}
