//! Fork: a counterfactual re-run of a saved session. A debugger user picks a main-line event,
//! optionally edits a tool result or an actor message at or before it, and re-runs from there
//! with the current model; the new branch is a new session file (by default [`fork_path`],
//! beside the original) whose header's `forked_from` names where it came from.
//!
//! [`fork_spec`] is pure: it turns a session and a [`ForkRequest`] into the episode spec and the
//! played *history* (the main-line messages after the initial conversation, up to the fork
//! point, edit applied). [`run_fork`](super::runner::run_fork) runs it on a built-in domain, with
//! the original's configuration ([`recorded_config`](super::runner::recorded_config)): the engine starts from the
//! history ([`Engine::with_history`](super::Engine::with_history)) and the live environment is
//! brought to the history's state by replaying its played calls
//! ([`replay_history`](super::runner::replay_history)); the conversation keeps its own, possibly
//! edited, tool messages. That difference is the counterfactual.
//!
//! Which messages the history holds: those with an event index at or before the fork point. The
//! fork point is the chosen event itself, except for events that produced a message, which map to
//! that message so that forking "at" them keeps what they produced: `actor_parsed` → the
//! assistant message that recorded the turn (when the turn was recorded as one; a proposal that
//! triggered Private Rehearsal was not), `real` / `simulated` / `fidelity` → the tool message
//! answering their call. So forking at an actor `generation` re-generates that turn, at
//! `approval_requested` re-asks for approval, at a `real` event keeps its result, at the first
//! user message (or anything before it) re-runs the whole episode. Events inside rehearsal
//! branches are refused. Calls approved with edited arguments appear in the history with the
//! arguments that ran.
//!
//! MCP sessions cannot be forked: replaying their calls would run them again on a real server.

use std::path::{Path, PathBuf};

use super::fsm::{EngineError, check_history};
use super::parse::{ActorAction, parse_actor};
use super::prompts::assistant_message;
use super::types::EpisodeSpec;
use crate::message::{Message, Role};
use crate::session::{EventBody, ForkOrigin, Session, SessionTree};

/// "Fork from here".
#[derive(Debug, Clone, PartialEq)]
pub struct ForkRequest {
    /// The original session file.
    pub session: PathBuf,
    /// A main-line event id of that session: the fork point (see the module docs).
    pub at_event: String,
    pub edit: Option<ForkEdit>,
}

/// One edit of the history before re-running. The target is a `message` event id at or before
/// the fork point, after the initial conversation.
#[derive(Debug, Clone, PartialEq)]
pub enum ForkEdit {
    /// Replace the content of a `tool` message.
    ToolResult { event_id: String, content: String },
    /// Replace an `assistant` message by actor output text, as the model would write it (tool
    /// calls as `<tool_call>{…}</tool_call>`), read by the actor parser. An edit may change the
    /// message's calls only when the message is the fork point itself (the new calls then run
    /// first); earlier in the history its calls must stay as they were.
    ActorMessage { event_id: String, content: String },
}

impl ForkEdit {
    pub fn event_id(&self) -> &str {
        match self {
            Self::ToolResult { event_id, .. } | Self::ActorMessage { event_id, .. } => event_id,
        }
    }
}

/// What [`fork_spec`] derives from a session.
#[derive(Debug, Clone, PartialEq)]
pub struct ForkSpec {
    /// The original episode: its system prompt, scripted user turns and tools.
    pub spec: EpisodeSpec,
    /// Main-line messages after the initial conversation, up to the fork point, edited.
    pub history: Vec<Message>,
    pub task_id: Option<String>,
    pub environment: String,
    /// For the new session's header (`session` is the request's path as given).
    pub origin: ForkOrigin,
}

/// Why a fork cannot be made; each names the event or session at fault.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("no event `{event_id}` in the session")]
    UnknownEvent { event_id: String },
    #[error("event `{event_id}` is inside a rehearsal branch; fork from a main-line event")]
    InBranch { event_id: String },
    #[error("the session has no episode_start event on its main line")]
    NoEpisodeStart,
    #[error("edit target `{event_id}` is a `{kind}` event, not a message")]
    EditNotAMessage { event_id: String, kind: String },
    #[error("edit target `{event_id}` is a {found} message; this edit needs a {expected} message")]
    EditWrongRole {
        event_id: String,
        expected: &'static str,
        found: String,
    },
    #[error(
        "edit target `{event_id}` is not in the history of a fork at `{at}` (it is after the fork \
         point, or part of the initial conversation)"
    )]
    EditOutsideHistory { event_id: String, at: String },
    #[error("edited actor message `{event_id}` does not parse: {message}")]
    BadActorEdit { event_id: String, message: String },
    #[error(
        "edited actor message `{event_id}` changes its tool calls; that is only possible when \
         forking at `{event_id}` itself"
    )]
    EditChangesCalls { event_id: String },
    #[error("the history up to `{at}` cannot be continued: {source}")]
    History {
        at: String,
        #[source]
        source: EngineError,
    },
    #[error(
        "forking MCP sessions is not supported: environment `{environment}` is not a built-in \
         domain (replaying its calls would run them again on the server)"
    )]
    NotADomain { environment: String },
    #[error("the session has no task id; a domain fork needs one to rebuild the task")]
    NoTask,
    #[error("task `{task_id}` is not a built-in task of this envace")]
    UnknownTask { task_id: String },
    #[error(
        "built-in task `{task_id}` no longer matches the session (its {what} changed); the fork \
         would be scored against a different task"
    )]
    TaskChanged { task_id: String, what: &'static str },
    #[error(transparent)]
    Env(#[from] crate::env::EnvError),
}

/// The spec and history of a fork of `session` (pure; reads nothing).
pub fn fork_spec(session: &Session, req: &ForkRequest) -> Result<ForkSpec, ForkError> {
    let events = &session.events;
    let tree = SessionTree::build(events);
    let at = main_line_index(session, &tree, &req.at_event)?;
    let main = tree.main_line();

    let (task_id, tools, user_turns) = main
        .iter()
        .find_map(|&i| match &events[i].event {
            EventBody::EpisodeStart {
                task_id,
                tools,
                user_turns,
                ..
            } => Some((task_id.clone(), tools.clone(), user_turns.clone())),
            _ => None,
        })
        .ok_or(ForkError::NoEpisodeStart)?;

    // Main-line messages, with their event index.
    let messages: Vec<(usize, &Message)> = main
        .iter()
        .filter_map(|&i| match &events[i].event {
            EventBody::Message { message } => Some((i, message)),
            _ => None,
        })
        .collect();
    // The initial conversation: up to and including the first user message.
    let first_user = messages
        .iter()
        .position(|(_, m)| m.role == Role::User)
        .unwrap_or(messages.len());
    let system = messages[..first_user]
        .iter()
        .find(|(_, m)| m.role == Role::System)
        .map(|(_, m)| m.content.clone())
        .unwrap_or_default();
    let spec = EpisodeSpec {
        task_id: task_id.clone().or_else(|| session.header.task_id.clone()),
        system,
        user_turns,
        tools,
        examples: Vec::new(),
    };

    let point = fork_point(session, &tree, at);
    let played: Vec<(usize, &Message)> = messages
        .iter()
        .skip(first_user + 1)
        .filter(|(i, _)| *i <= point)
        .copied()
        .collect();
    let mut history: Vec<Message> = played.iter().map(|(_, m)| (*m).clone()).collect();

    // Calls run with edited arguments: the conversation the actor saw had them.
    let upto: Vec<usize> = main.iter().copied().filter(|&i| i <= point).collect();
    crate::session::tree::apply_approval_edits(events, &upto, &mut history);

    let mut edited_event = None;
    if let Some(edit) = &req.edit {
        let target = edit.event_id();
        let ti = main_line_index(session, &tree, target)?;
        let EventBody::Message { message } = &events[ti].event else {
            return Err(ForkError::EditNotAMessage {
                event_id: target.to_string(),
                kind: events[ti].event.kind().to_string(),
            });
        };
        let expected = match edit {
            ForkEdit::ToolResult { .. } => Role::Tool,
            ForkEdit::ActorMessage { .. } => Role::Assistant,
        };
        if message.role != expected {
            return Err(ForkError::EditWrongRole {
                event_id: target.to_string(),
                expected: role_name(expected),
                found: role_name(message.role).to_string(),
            });
        }
        let Some(h) = played.iter().position(|(i, _)| *i == ti) else {
            return Err(ForkError::EditOutsideHistory {
                event_id: target.to_string(),
                at: req.at_event.clone(),
            });
        };
        match edit {
            ForkEdit::ToolResult { content, .. } => history[h].content = content.clone(),
            ForkEdit::ActorMessage { content, .. } => {
                let next_id = next_call_id(&history);
                let last = h + 1 == played.len();
                history[h] = edited_actor_message(&history[h], content, target, last, next_id)?;
            }
        }
        edited_event = Some(target.to_string());
    }

    check_history(&spec, &history).map_err(|source| ForkError::History {
        at: req.at_event.clone(),
        source,
    })?;
    let origin = ForkOrigin {
        session: req.session.display().to_string(),
        event_id: req.at_event.clone(),
        seq: events[at].seq,
        edited: edited_event.is_some(),
        edited_event,
    };
    Ok(ForkSpec {
        spec,
        history,
        task_id: task_id.or_else(|| session.header.task_id.clone()),
        environment: session.header.environment.clone(),
        origin,
    })
}

/// A free file name for a fork of `original`, beside it: `<stem>.fork-<n>.jsonl` with the
/// smallest `n ≥ 1` not taken. A fork of a fork (`x.fork-1.jsonl`) is named from the first
/// stem (`x.fork-2.jsonl`); its header records the lineage. (Not reserved: two forks started at
/// the same moment may pick the same name.)
pub fn fork_path(original: &Path) -> PathBuf {
    let dir = original.parent().unwrap_or(Path::new(""));
    let mut stem = original.file_stem().map_or_else(
        || "session".to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    if let Some((base, n)) = stem.rsplit_once(".fork-")
        && !base.is_empty()
        && !n.is_empty()
        && n.bytes().all(|b| b.is_ascii_digit())
    {
        stem = base.to_string();
    }
    let mut n = 1u64;
    loop {
        let p = dir.join(format!("{stem}.fork-{n}.jsonl"));
        if !p.exists() {
            return p;
        }
        n += 1;
    }
}

// ---- helpers ------------------------------------------------------------------------------

/// The index of a main-line event, or why not.
fn main_line_index(session: &Session, tree: &SessionTree, id: &str) -> Result<usize, ForkError> {
    let i = session
        .events
        .iter()
        .position(|e| e.id == id)
        .ok_or_else(|| ForkError::UnknownEvent {
            event_id: id.to_string(),
        })?;
    if tree.branch_of.get(i).copied().flatten().is_some() {
        return Err(ForkError::InBranch {
            event_id: id.to_string(),
        });
    }
    Ok(i)
}

/// The fork point of the main-line event at `at`: itself, or the message it produced.
fn fork_point(session: &Session, tree: &SessionTree, at: usize) -> usize {
    let events = &session.events;
    let later_messages = move || {
        tree.main_line()
            .into_iter()
            .filter(move |&i| i > at)
            .filter_map(move |i| match &events[i].event {
                EventBody::Message { message } => Some((i, message)),
                _ => None,
            })
    };
    let produced = match &events[at].event {
        EventBody::ActorParsed { call_ids, .. } => later_messages()
            .next()
            .filter(|(_, m)| {
                m.role == Role::Assistant
                    && m.tool_calls.iter().map(|tc| &tc.id).eq(call_ids.iter())
            })
            .map(|(i, _)| i),
        EventBody::Real { call_id, .. }
        | EventBody::Simulated { call_id, .. }
        | EventBody::Fidelity { call_id, .. } => later_messages()
            .find(|(_, m)| m.role == Role::Tool && m.tool_call_id.as_ref() == Some(call_id))
            .map(|(i, _)| i),
        _ => None,
    };
    produced.unwrap_or(at)
}

/// The assistant message `original` rewritten from actor output `text`.
fn edited_actor_message(
    original: &Message,
    text: &str,
    event_id: &str,
    is_fork_point: bool,
    next_id: u64,
) -> Result<Message, ForkError> {
    let turn = parse_actor(text);
    if turn.action == ActorAction::Malformed {
        return Err(ForkError::BadActorEdit {
            event_id: event_id.to_string(),
            message: "no final answer and no tool call could be read".into(),
        });
    }
    let old: Vec<_> = original.tool_calls.iter().map(|tc| &tc.function).collect();
    let same_calls = turn.calls().iter().eq(old.iter().copied());
    if !same_calls && !is_fork_point {
        return Err(ForkError::EditChangesCalls {
            event_id: event_id.to_string(),
        });
    }
    // Keep the original call ids where there are calls to keep; new calls get fresh ids.
    let ids: Vec<String> = (0..turn.calls().len())
        .map(|k| match original.tool_calls.get(k) {
            Some(tc) => tc.id.clone(),
            None => format!("call_{}", next_id + k as u64),
        })
        .collect();
    Ok(assistant_message(&turn, &ids))
}

/// The first `call_N` number after every call id in `history`.
fn next_call_id(history: &[Message]) -> u64 {
    history
        .iter()
        .flat_map(|m| m.tool_calls.iter())
        .filter_map(|tc| tc.id.strip_prefix("call_")?.parse::<u64>().ok())
        .max()
        .map_or(0, |n| n + 1)
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    }
}
