//! A played history: the main-line messages a fork starts from. Checks that the engine could
//! have produced it, lists the calls it already made (what scoring counts and a fork replays)
//! and the calls still pending, and absorbs it into a fresh engine's trace and counters.

use serde_json::Value;

use super::{Engine, EngineError, REJECTED_BY_USER};
use crate::engine::prompts::simulator::example_from_real;
use crate::engine::types::EpisodeSpec;
use crate::message::{Message, Role, ToolCall};
use crate::session::schema::EventBody;

/// A call a played history already made.
#[derive(Debug, Clone, PartialEq)]
pub struct PlayedCall {
    pub call_id: String,
    pub call: ToolCall,
    /// The response the conversation shows for it (the tool message, as JSON when it parses).
    pub shown: Value,
}

/// The calls a history already made, in order: every call of an assistant message that a later
/// tool message answers, except calls rejected at the approval gate (their tool message carries
/// the [`REJECTED_BY_USER`] error: they never ran). Calls without an answer yet are pending, not
/// played. These are what scoring counts as actions and what a fork replays on a live
/// environment.
pub fn played_calls(history: &[Message]) -> Vec<PlayedCall> {
    let mut out = Vec::new();
    for (i, m) in history.iter().enumerate() {
        if m.role != Role::Tool {
            continue;
        }
        let Some(id) = m.tool_call_id.as_deref() else {
            continue;
        };
        let call = history[..i]
            .iter()
            .rev()
            .flat_map(|a| a.tool_calls.iter())
            .find(|tc| tc.id == id);
        let Some(tc) = call else { continue };
        let shown = serde_json::from_str::<Value>(&m.content)
            .unwrap_or_else(|_| Value::String(m.content.clone()));
        let rejected = shown
            .pointer("/error/code")
            .and_then(Value::as_str)
            .is_some_and(|c| c == REJECTED_BY_USER);
        if !rejected {
            out.push(PlayedCall {
                call_id: id.to_string(),
                call: tc.function.clone(),
                shown,
            });
        }
    }
    out
}

/// The calls of the history's last assistant message that no tool message answers yet: the
/// engine runs them first when it starts from this history.
pub(super) fn pending_calls(history: &[Message]) -> Vec<(String, ToolCall)> {
    let Some(pos) = history.iter().rposition(|m| m.role == Role::Assistant) else {
        return Vec::new();
    };
    let answered: Vec<&str> = history[pos + 1..]
        .iter()
        .filter_map(|m| m.tool_call_id.as_deref())
        .collect();
    history[pos]
        .tool_calls
        .iter()
        .filter(|tc| !answered.contains(&tc.id.as_str()))
        .map(|tc| (tc.id.clone(), tc.function.clone()))
        .collect()
}

/// Check that `history` could follow `spec`'s initial conversation on an engine's main line:
/// no system message; a tool message answers a call of the latest assistant message; no
/// assistant or user message while a call is unanswered (except at the very end, where the calls
/// are pending); a user message follows a final answer, and there are no more of them than
/// scripted user turns after the first.
pub fn check_history(spec: &EpisodeSpec, history: &[Message]) -> Result<(), EngineError> {
    let bad = |index: usize, message: String| EngineError::BadHistory { index, message };
    let mut pending: Vec<&str> = Vec::new();
    let mut users = 0;
    let mut after_answer = false;
    for (i, m) in history.iter().enumerate() {
        match m.role {
            Role::System => {
                return Err(bad(
                    i,
                    "a system message (the initial conversation comes from the spec)".into(),
                ));
            }
            Role::User | Role::Assistant if !pending.is_empty() => {
                return Err(bad(
                    i,
                    format!("call `{}` has no tool message before it", pending[0]),
                ));
            }
            Role::User => {
                if !after_answer {
                    return Err(bad(
                        i,
                        "a user message that does not follow a final answer".into(),
                    ));
                }
                users += 1;
                if users >= spec.user_turns.len() {
                    return Err(bad(
                        i,
                        format!(
                            "more user messages than the {} scripted turn(s) after the first",
                            spec.user_turns.len().saturating_sub(1)
                        ),
                    ));
                }
                after_answer = false;
            }
            Role::Assistant => {
                pending = m.tool_calls.iter().map(|tc| tc.id.as_str()).collect();
                after_answer = m.tool_calls.is_empty();
            }
            Role::Tool => {
                let id = m.tool_call_id.as_deref().unwrap_or_default();
                let Some(at) = pending.iter().position(|p| *p == id) else {
                    return Err(bad(
                        i,
                        format!("a tool message for `{id}`, which is not an unanswered call"),
                    ));
                };
                pending.remove(at);
                after_answer = false;
            }
        }
    }
    Ok(())
}

impl Engine {
    /// Start from a played history instead of the initial conversation alone (a fork): the
    /// main-line messages that followed the system prompt and first user turn, possibly edited.
    /// At start the engine persists them after the initial conversation, counts the actor turns
    /// (assistant messages) and user turns they used, puts their played calls
    /// ([`played_calls`]) and final answers into the trace (and, in live modes with
    /// `learn_examples_from_real`, the calls' responses into the simulator's examples), then
    /// continues where the history stops: pending calls of its last assistant message run
    /// first; after a final answer comes the next user turn or the end of the episode;
    /// otherwise the actor is asked. [`EpisodeStats`](super::EpisodeStats) count only what this
    /// engine generates.
    pub fn with_history(mut self, history: Vec<Message>) -> Result<Self, EngineError> {
        check_history(&self.spec, &history)?;
        self.history = history;
        Ok(self)
    }

    /// Persist a played history on the main line and account for it (see [`Self::with_history`]).
    pub(super) fn absorb_history(&mut self, history: &[Message]) {
        // The history's calls join the trace after this loop: an answer's turn end counts the
        // calls played before it.
        for (i, m) in history.iter().enumerate() {
            self.persist(EventBody::Message { message: m.clone() });
            self.conv.push(m.clone());
            match m.role {
                Role::Assistant => {
                    self.turns += 1;
                    if m.tool_calls.is_empty() {
                        self.trace.agent_messages.push(m.content.clone());
                        self.trace
                            .turn_ends
                            .push(self.trace.actions.len() + played_calls(&history[..i]).len());
                    }
                    // New call ids continue after the history's.
                    for tc in &m.tool_calls {
                        if let Some(n) = tc
                            .id
                            .strip_prefix("call_")
                            .and_then(|n| n.parse::<u64>().ok())
                        {
                            self.next_call = self.next_call.max(n + 1);
                        }
                    }
                }
                Role::User => self.next_user += 1,
                Role::System | Role::Tool => {}
            }
        }
        let learn = self.cfg.learn_examples_from_real && self.cfg.mode.live().is_some();
        for p in played_calls(history) {
            if learn {
                self.examples.push(example_from_real(&p.call, &p.shown));
                let irreversible = self.is_irreversible(&p.call.name);
                self.observe_real(&p.call, irreversible, &p.shown);
            }
            self.trace.actions.push(p.call);
        }
    }
}
