//! Prompt builders, pure functions from engine state to chat messages (rendered later by
//! `LanguageModel::render_chat`). Wording is data-like and kept compact: a tiny model is trained
//! on it. [`actor`]: the tool caller's conversation; [`simulator`]: one separate prompt per
//! pending call; [`memory`]: the Private Rehearsal memory placed in the actor's context.

pub mod actor;
pub mod memory;
pub mod simulator;

pub use actor::{actor_prompt, assistant_message, initial_conversation, tool_message, tools_json};
pub use memory::render_memory;
pub use simulator::{SIMULATOR_INSTRUCTION, SimulatorPromptInput, format_call, simulator_prompt};
