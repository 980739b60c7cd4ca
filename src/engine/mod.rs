//! The EnvACE engine: one model in two roles. The actor emits tool calls; the simulator writes
//! the tool's response; Private Rehearsal runs imagined branches before irreversible real calls.
//!
//! - [`fsm`]: THE episode engine, a pure state machine (`Engine::handle(Event) -> Vec<Effect>`)
//!   shared by the CLI, the TUI and the RL rollout collector. No IO.
//! - [`driver`]: the tokio driver that runs the effects against a `LanguageModel`, an
//!   `Environment`, an approval hook and an event sink.
//! - [`parse`]: actor (tolerant) and simulator (strict) output parsers.
//! - [`prompts`]: actor prompt, per-call simulator prompt, rehearsal memory.
//! - [`episode`]: THE episode configuration (what clap, the TUI form and GRPO build; stored
//!   whole in session headers) and its single translation into the engine's configuration.
//! - [`runner`]: THE launcher ([`launch`]) and what is built on it (a task to a session file,
//!   a fork, a split evaluation).
//! - [`eval`]: the `envace eval` summary over episode outcomes.
//! - [`bench`]: the wall time of one Private Rehearsal, for `envace bench generate`.
//! - [`fidelity`]: simulated-vs-real response metrics (shadow mode).
//! - [`fork`]: counterfactual re-runs: continue a saved session from one of its main-line
//!   events, optionally after editing a tool result or an actor message.
//! - [`types`]: episode spec, configuration, and the data the engine reports.
//!
//! Data flows one way: runtime ← engine → env; engine → session.

pub mod bench;
pub mod bfcl_eval;
pub mod driver;
pub mod episode;
pub mod eval;
pub mod fidelity;
pub mod fork;
pub mod fsm;
pub mod parse;
pub mod profile;
pub mod prompts;
pub mod runner;
pub mod spec;
pub mod types;

pub use driver::{
    ApprovalHook, ApprovalPolicy, Driver, DriverError, DriverEvent, EnvAccess, PolicyApprover,
    SharedModel, share_model,
};
pub use episode::{ConfigError, EpisodeConfig, ModeChoice};
pub use eval::{EvalSummary, KindCount};
pub use fork::{ForkEdit, ForkError, ForkRequest, ForkSpec, fork_path, fork_spec};
pub use fsm::{
    ApprovalRequest, Effect, Engine, EngineError, EpisodeOutcome, EpisodeStats, Event,
    GenerateRequest, PlayedCall, REJECTED_BY_USER, RealCallPermit, RehearsalVerdict, RequestId,
    check_history, played_calls,
};
pub use runner::{Episode, EpisodeEnv, EpisodeIo, Policy, launch, recorded_config, run_fork};
pub use types::{
    ApprovalGate, BranchEnd, BranchStep, BranchSummary, Decision, EndReason, EngineConfig,
    EpisodeSpec, GenRole, LiveOptions, MemoryConfig, MemoryFormat, MemoryPlacement,
    MemorySelection, Mode, Prediction, PrivateRehearsal, RecordedExample, RehearsalDepth,
    RehearsalStrategy, RehearsalTrigger, ScoredBy, SimFailurePolicy, SimPromptConfig,
    SimulatedOutcome,
};
