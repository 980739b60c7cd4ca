//! The EnvACE engine: one model in two roles. The actor emits tool calls; the simulator writes
//! the tool's response; Private Rehearsal runs imagined branches before irreversible real calls.
//!
//! - [`fsm`]: THE episode engine, a pure state machine (`Engine::handle(Event) -> Vec<Effect>`)
//!   shared by the CLI, the TUI and the RL rollout collector. No IO.
//! - [`driver`]: the tokio driver that runs the effects against a `LanguageModel`, an
//!   `Environment`, an approval hook and an event sink.
//! - [`parse`]: actor (tolerant) and simulator (strict) output parsers.
//! - [`prompts`]: actor prompt, per-call simulator prompt, rehearsal memory.
//! - [`eval`]: the `envace eval` summary over episode outcomes.
//! - [`fidelity`]: simulated-vs-real response metrics (shadow mode).
//! - [`fork`]: counterfactual re-runs: continue a saved session from one of its main-line
//!   events, optionally after editing a tool result or an actor message.
//! - [`types`]: episode spec, configuration, and the data the engine reports.
//!
//! Data flows one way: runtime ← engine → env; engine → session.

pub mod bfcl_eval;
pub mod driver;
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
pub use eval::EvalSummary;
pub use fork::{ForkEdit, ForkError, ForkRequest, ForkSpec, fork_path, fork_spec, run_fork};
pub use fsm::{
    ApprovalRequest, Effect, Engine, EngineError, EpisodeOutcome, EpisodeStats, Event,
    GenerateRequest, PlayedCall, REJECTED_BY_USER, RealCallPermit, RehearsalVerdict, RequestId,
    check_history, played_calls,
};
pub use types::{
    ApprovalGate, BranchEnd, BranchStep, BranchSummary, Decision, EndReason, EngineConfig,
    EpisodeSpec, GenRole, LiveOptions, MemoryConfig, MemoryFormat, MemoryPlacement,
    MemorySelection, Mode, Prediction, PrivateRehearsal, RecordedExample, RehearsalDepth,
    RehearsalStrategy, RehearsalTrigger, ScoredBy, SimFailurePolicy, SimPromptConfig,
    SimulatedOutcome,
};
