//! Session export and text replay. `export_openai` writes OpenAI chat JSONL (one line per
//! conversation: `{"messages": [...], "tools": [...]}`, tool-call arguments as JSON strings as
//! the OpenAI API has them); `render_replay` prints a session step by step, branches indented,
//! the way the TUI debugger shows it.

use std::fmt::Write as _;
use std::io::Write;
use std::path::Path;

use serde_json::{Value, json};

use super::SessionError;
use super::format::{ActorAction, GenRole};
use super::reader::{Session, read_session};
use super::schema::{EventBody, GenerationRecord};
use super::tree::SessionTree;
use crate::message::{Message, Role};

/// What `export_openai` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions {
    /// Also write one record per simulator generation (its prompt + its answer).
    pub include_simulator: bool,
    /// Add a `metadata` object (task, mode, reward, model hash) to each record.
    pub include_metadata: bool,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            include_simulator: false,
            include_metadata: true,
        }
    }
}

/// A message in the OpenAI API shape.
pub fn openai_message(m: &Message) -> Value {
    let role = match m.role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let mut o = serde_json::Map::new();
    o.insert("role".into(), json!(role));
    o.insert("content".into(), json!(m.content));
    if !m.tool_calls.is_empty() {
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.arguments.to_string(),
                    }
                })
            })
            .collect();
        o.insert("tool_calls".into(), Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        o.insert("tool_call_id".into(), json!(id));
    }
    Value::Object(o)
}

/// The export records of one session.
pub fn openai_records(session: &Session, opts: &ExportOptions) -> Vec<Value> {
    let tree = SessionTree::build(&session.events);
    let mut tools = Vec::new();
    let mut messages = Vec::new();
    let mut reward = Value::Null;
    let mut end = Value::Null;
    let main = tree.main_line();
    for &i in &main {
        match &session.events[i].event {
            EventBody::EpisodeStart { tools: t, .. } => {
                tools = t.iter().map(|t| t.to_openai_json()).collect();
            }
            EventBody::Message { message } => messages.push(message.clone()),
            EventBody::Reward { reward: r, .. } => reward = json!(r),
            EventBody::EpisodeEnd { reason, .. } => {
                end = serde_json::to_value(reason).unwrap_or(Value::Null)
            }
            _ => {}
        }
    }
    // The conversation as it ran: calls approved with edited arguments carry the edit.
    super::tree::apply_approval_edits(&session.events, &main, &mut messages);
    let messages: Vec<Value> = messages.iter().map(openai_message).collect();
    let metadata = |role: &str| {
        json!({
            "role": role,
            "task_id": session.header.task_id,
            "environment": session.header.environment,
            "mode": session.header.mode,
            "seed": session.header.seed,
            "model_hash": session.header.model.hash,
            "reward": reward,
            "end": end,
        })
    };
    let mut out = Vec::new();
    let mut actor = json!({"messages": messages, "tools": tools});
    if opts.include_metadata {
        actor["metadata"] = metadata("actor");
    }
    out.push(actor);
    if opts.include_simulator {
        for e in &session.events {
            if let EventBody::Generation(g) = &e.event
                && g.role == GenRole::Simulator
            {
                let mut msgs: Vec<Value> = g.prompt.iter().map(openai_message).collect();
                msgs.push(json!({"role": "assistant", "content": g.text}));
                let mut rec = json!({"messages": msgs});
                if opts.include_metadata {
                    rec["metadata"] = metadata("simulator");
                }
                out.push(rec);
            }
        }
    }
    out
}

/// Export a session file as OpenAI chat JSONL to `out`; returns the number of lines written.
pub fn export_openai(
    path: impl AsRef<Path>,
    out: &mut dyn Write,
    opts: &ExportOptions,
) -> Result<usize, SessionError> {
    let session = read_session(path.as_ref())?;
    let records = openai_records(&session, opts);
    let io = |source| SessionError::Io {
        path: "<export output>".into(),
        source,
    };
    for r in &records {
        writeln!(out, "{r}").map_err(io)?;
    }
    out.flush().map_err(io)?;
    Ok(records.len())
}

/// Read a session file and render it as text.
pub fn replay_text(path: impl AsRef<Path>) -> Result<String, SessionError> {
    Ok(render_replay(&read_session(path)?))
}

fn cut(s: &str, max: usize) -> String {
    let s = s.trim();
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max).collect();
        t.push('…');
        t
    }
}

/// Render a session step by step. Rehearsal branches are indented under their rehearsal.
pub fn render_replay(session: &Session) -> String {
    let tree = SessionTree::build(&session.events);
    let h = &session.header;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "session: env {} task {} mode {} seed {} model {} ({})",
        h.environment,
        h.task_id.as_deref().unwrap_or("-"),
        h.mode,
        h.seed,
        h.model.path,
        cut(&h.model.hash, 16)
    );
    if let Some(r) = h
        .model
        .tool_rendering
        .as_deref()
        .filter(|r| *r != "template")
    {
        let _ = writeln!(out, "tools: rendered into the system message ({r})");
    }
    for w in &session.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    for (i, e) in session.events.iter().enumerate() {
        let indent = match tree.branch_of[i] {
            Some(b) => format!("    [branch {}] ", b.index),
            None => String::new(),
        };
        let line = describe(&e.event);
        if line.is_empty() {
            continue;
        }
        for (k, l) in line.lines().enumerate() {
            if k == 0 {
                let _ = writeln!(out, "{indent}#{:<4} {l}", e.seq);
            } else {
                let _ = writeln!(out, "{indent}      {l}");
            }
        }
    }
    out
}

fn generation_line(g: &GenerationRecord) -> String {
    let role = match g.role {
        GenRole::Actor => "actor",
        GenRole::Simulator => "simulator",
    };
    format!(
        "{role} generation r{}.{} ({} prompt + {} response tokens)",
        g.request,
        g.index,
        g.prompt_ids.len(),
        g.response_ids.len()
    )
}

fn describe(ev: &EventBody) -> String {
    match ev {
        EventBody::EpisodeStart { mode, tools, .. } => format!(
            "episode start ({mode}); tools: {}",
            tools
                .iter()
                .map(|t| if t.is_irreversible() {
                    format!("{}!", t.name)
                } else {
                    t.name.clone()
                })
                .collect::<Vec<_>>()
                .join(", ")
        ),
        EventBody::Message { message } => match message.role {
            Role::System => format!("system: {}", cut(&message.content, 120)),
            Role::User => format!("user: {}", cut(&message.content, 400)),
            Role::Assistant if message.tool_calls.is_empty() => {
                format!("assistant: {}", cut(&message.content, 400))
            }
            Role::Assistant => {
                let mut s = String::from("assistant calls:");
                if !message.content.trim().is_empty() {
                    s = format!("assistant: {}\n  calls:", cut(&message.content, 200));
                }
                for c in &message.tool_calls {
                    let _ = write!(
                        s,
                        "\n  {} {}({})",
                        c.id,
                        c.function.name,
                        cut(&c.function.arguments.to_string(), 200)
                    );
                }
                s
            }
            Role::Tool => format!(
                "tool {} [{}]: {}",
                message.name.as_deref().unwrap_or("?"),
                message.tool_call_id.as_deref().unwrap_or("?"),
                cut(&message.content, 300)
            ),
        },
        EventBody::Generation(g) => generation_line(g),
        EventBody::ActorParsed { turn, .. } => {
            let mut s = String::from("parsed: ");
            match &turn.action {
                ActorAction::Calls { calls } => {
                    let names: Vec<&str> = calls.iter().map(|c| c.name.as_str()).collect();
                    let _ = write!(s, "{} call(s): {}", calls.len(), names.join(", "));
                }
                ActorAction::Answer => s.push_str("answer"),
                ActorAction::Malformed => s.push_str("MALFORMED"),
            }
            if let Some(t) = &turn.think
                && !t.is_empty()
            {
                let _ = write!(s, "\n  think: {}", cut(t, 200));
            }
            s
        }
        EventBody::Format { format } => format!(
            "format {}: {}",
            if format.is_failure() {
                "FAILURE"
            } else {
                "repair"
            },
            serde_json::to_string(format).unwrap_or_default()
        ),
        EventBody::Simulated {
            call_id,
            call,
            outcome,
            recalled,
            ..
        } => match outcome.value() {
            Some(v) => format!(
                "{} {}[{call_id}] → {}",
                if *recalled { "recalled" } else { "simulated" },
                call.name,
                cut(&v.to_string(), 300)
            ),
            None => format!("simulated {}[{call_id}] → UNPARSEABLE", call.name),
        },
        EventBody::Real {
            call_id,
            call,
            response,
        } => format!(
            "real {}[{call_id}] → {}",
            call.name,
            cut(&response.to_json().to_string(), 300)
        ),
        EventBody::Fidelity { tool, fidelity, .. } => format!(
            "fidelity {tool}: exact {} key-F1 {:.2} values {:.2}{}",
            fidelity.exact,
            fidelity.key_f1,
            fidelity.value_agreement,
            if fidelity.exact {
                ""
            } else {
                "  ← DIVERGENCE"
            }
        ),
        EventBody::ApprovalRequested {
            call, irreversible, ..
        } => format!(
            "approval requested for {}{}",
            call.name,
            if *irreversible { " (irreversible)" } else { "" }
        ),
        EventBody::Approval { decision, .. } => format!(
            "approval: {}",
            serde_json::to_string(decision).unwrap_or_default()
        ),
        EventBody::RehearsalStart {
            branches,
            strategy,
            proposed,
            ..
        } => format!(
            "private rehearsal: {branches} {strategy:?} branch(es) before {}",
            proposed
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        EventBody::BranchStart { index } => format!("branch {index} start"),
        EventBody::BranchEnd { summary } => format!(
            "branch {} end: {:?}; predicted {:?}",
            summary.index, summary.end, summary.prediction
        ),
        EventBody::RehearsalMemory { text, .. } => format!("rehearsal memory:\n{text}"),
        EventBody::EpisodeEnd {
            reason,
            finished_normally,
        } => format!(
            "episode end: {} (normal: {finished_normally})",
            serde_json::to_string(reason).unwrap_or_default()
        ),
        EventBody::ScoringFailed { message } => format!("scoring failed: {message}"),
        EventBody::Reward {
            reward,
            partial,
            checklist,
            scored_by,
        } => {
            let mut s = format!("reward {reward:.3} (partial {partial:.3}, {scored_by:?})");
            for c in checklist {
                let _ = write!(
                    s,
                    "\n  [{}] {} ({}) {}",
                    if c.passed { "x" } else { " " },
                    c.name,
                    c.weight,
                    c.reason
                );
            }
            s
        }
    }
}
