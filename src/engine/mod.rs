//! The EnvACE engine: one model in two roles. The actor emits tool calls; the simulator writes
//! the tool's response; Private Rehearsal runs imagined branches before irreversible real calls.
//!
//! - [`parse`]: actor (tolerant) and simulator (strict) output parsers.
//! - [`fidelity`]: simulated-vs-real response metrics (shadow mode).
//! - [`types`]: episode spec, configuration, and the data the engine reports.
pub mod fidelity;
pub mod parse;
pub mod types;
