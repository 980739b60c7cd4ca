//! envace: train and inspect tool-using LLM agents the EnvACE way (actor + simulator roles with
//! shared weights, world rehearsal, Private Rehearsal). See docs/ARCHITECTURE.md for the map.

pub mod cancel;
pub mod engine;
pub mod env;
pub mod export;
pub mod message;
pub mod runtime;
pub mod session;
pub mod train;
pub mod tui;
