//! Episode specs for built-in domain tasks and their gold conversations, built in one place so
//! that the CLI, the TUI, the RL collector and the pretrainer all show the model the same text.

use crate::engine::prompts::actor::tool_message;
use crate::engine::types::{EpisodeSpec, RecordedExample};
use crate::env::EnvError;
use crate::env::domains::Domain;
use crate::env::tasks::Task;
use crate::message::{Message, MessageToolCall, ToolCall};

/// The system prompt of a built-in domain.
pub fn domain_system(domain: Domain) -> String {
    format!(
        "You are the {} desk ({}). Use the tools, then answer the user.",
        domain.name(),
        domain.description()
    )
}

/// The system prompt of an episode on an MCP server's tools (`server` names it, e.g.
/// `mcp:server-filesystem`); also the one tool drills are trained with.
pub fn mcp_system(server: &str) -> String {
    format!("You are an assistant with the tools of `{server}`. Use them, then answer the user.")
}

/// The spec of a built-in task. With `gold_examples`, the simulator's few-shot pool is the
/// task's recorded gold run (what EnvACE gives the simulator during training).
pub fn task_spec(task: &Task, gold_examples: bool) -> Result<EpisodeSpec, EnvError> {
    let domain = task.domain()?;
    let examples = if gold_examples {
        gold_examples_of(task)?
    } else {
        Vec::new()
    };
    Ok(EpisodeSpec {
        task_id: Some(task.id.clone()),
        system: domain_system(domain),
        user_turns: task.user_turns(),
        tools: domain.tools(),
        examples,
    })
}

/// The gold run as recorded (name, arguments, response) examples.
pub fn gold_examples_of(task: &Task) -> Result<Vec<RecordedExample>, EnvError> {
    Ok(task
        .gold_steps()?
        .into_iter()
        .map(|(c, r)| RecordedExample {
            name: c.name,
            arguments: c.arguments,
            response: r.to_json(),
        })
        .collect())
}

/// Call ids as the engine numbers them.
pub fn call_id(n: usize) -> String {
    format!("call_{n}")
}

/// One gold call inside the gold conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct GoldCall {
    /// Index of the assistant message that made the call.
    pub message: usize,
    pub call: ToolCall,
    pub response: serde_json::Value,
}

/// The gold conversation (system, user, assistant calls, tool results, replies, follow-up user
/// turns) and the calls made in it.
pub fn gold_conversation(task: &Task) -> Result<(Vec<Message>, Vec<GoldCall>), EnvError> {
    let domain = task.domain()?;
    let mut msgs = vec![Message::system(domain_system(domain))];
    let mut calls = Vec::new();
    let mut n = 0;
    for turn in task.gold_trajectory()? {
        msgs.push(Message::user(turn.user.clone()));
        for (call, resp) in &turn.steps {
            let id = call_id(n);
            n += 1;
            let mut m = Message::assistant("");
            m.tool_calls.push(MessageToolCall {
                id: id.clone(),
                kind: "function".into(),
                function: call.clone(),
            });
            calls.push(GoldCall {
                message: msgs.len(),
                call: call.clone(),
                response: resp.to_json(),
            });
            msgs.push(m);
            msgs.push(tool_message(&id, &call.name, &resp.to_json()));
        }
        msgs.push(Message::assistant(turn.reply.clone()));
    }
    Ok((msgs, calls))
}
