//! Parsers for model output, one file per format (the mistral.rs habit): [`actor`] reads the
//! tool-caller's Hermes/Qwen-style output tolerantly, [`simulator`] reads the tool simulator's
//! `<execution_result>` strictly. Both are total functions over arbitrary text (fuzzed), and
//! both report every repair or failure as a structured event, never silently.

pub mod actor;
pub mod json;
pub mod simulator;

#[cfg(test)]
pub(crate) mod randomized;

pub use actor::{ActorAction, ActorFormatEvent, ActorTurn, parse_actor};
pub use simulator::{SimFormatError, SimOutput, SimTurn, execution_result, parse_simulator};

pub use crate::session::format::FormatEvent;

impl FormatEvent {
    pub fn is_failure(&self) -> bool {
        match self {
            Self::Actor(e) => e.is_failure(),
            Self::Simulator(_) => true,
        }
    }
}

/// Result of separating `<think>…</think>` from the rest of an output.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ThinkSplit<'a> {
    /// Text before `<think>` (normally empty).
    pub prefix: &'a str,
    pub think: Option<String>,
    pub rest: &'a str,
    /// `<think>` was never closed.
    pub unclosed: bool,
}

/// Split off thinking. A lone `</think>` (templates that open the think block in the prompt)
/// ends thinking without an opening tag. An unclosed `<think>` ends at `stop_at` if present,
/// else at the end of the text.
pub(crate) fn split_think<'a>(text: &'a str, stop_at: &str) -> ThinkSplit<'a> {
    const OPEN: &str = "<think>";
    const CLOSE: &str = "</think>";
    if let Some(o) = text.find(OPEN) {
        let after = o + OPEN.len();
        let prefix = &text[..o];
        if let Some(c) = text[after..].find(CLOSE) {
            return ThinkSplit {
                prefix,
                think: Some(text[after..after + c].trim().to_string()),
                rest: &text[after + c + CLOSE.len()..],
                unclosed: false,
            };
        }
        let end = text[after..]
            .find(stop_at)
            .map(|s| after + s)
            .unwrap_or(text.len());
        return ThinkSplit {
            prefix,
            think: Some(text[after..end].trim().to_string()),
            rest: &text[end..],
            unclosed: true,
        };
    }
    if let Some(c) = text.find(CLOSE) {
        return ThinkSplit {
            prefix: "",
            think: Some(text[..c].trim().to_string()),
            rest: &text[c + CLOSE.len()..],
            unclosed: false,
        };
    }
    ThinkSplit {
        prefix: "",
        think: None,
        rest: text,
        unclosed: false,
    }
}
