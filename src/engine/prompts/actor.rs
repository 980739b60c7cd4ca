//! The actor's prompt: the conversation itself (system prompt with the environment's policy and
//! the task's instructions, user turns, assistant messages with `tool_calls`, `tool` messages),
//! with the tools passed to the chat template separately ([`tools_json`]). A rehearsal memory,
//! when present, is added for one generation only and never enters the stored conversation.

use serde_json::Value;

use crate::engine::parse::ActorTurn;
use crate::engine::types::{EpisodeSpec, MemoryPlacement};
use crate::env::ToolSpec;
use crate::message::{Message, MessageToolCall, Role};

/// System prompt used when the task gives none.
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful assistant. Use the tools when they help; answer the user when done.";

/// Heading of a rehearsal memory placed in the actor's context.
pub const MEMORY_HEADING: &str = "[Private rehearsal: imagined with your own simulator; nothing \
was executed. Use it to choose your real action.]";

/// The conversation an episode starts from: the system prompt and the first user turn.
pub fn initial_conversation(spec: &EpisodeSpec) -> Vec<Message> {
    let system = if spec.system.trim().is_empty() {
        DEFAULT_SYSTEM
    } else {
        spec.system.as_str()
    };
    let mut conv = vec![Message::system(system)];
    if let Some(first) = spec.user_turns.first() {
        conv.push(Message::user(first.clone()));
    }
    conv
}

/// The tools section for the chat template.
pub fn tools_json(tools: &[ToolSpec]) -> Vec<Value> {
    tools.iter().map(ToolSpec::to_openai_json).collect()
}

/// The messages to render for the next actor turn.
pub fn actor_prompt(
    conversation: &[Message],
    memory: Option<&str>,
    placement: MemoryPlacement,
) -> Vec<Message> {
    let mut msgs = conversation.to_vec();
    let Some(memory) = memory else {
        return msgs;
    };
    let note = format!("{MEMORY_HEADING}\n{memory}");
    match placement {
        MemoryPlacement::UserMessage => msgs.push(Message::user(note)),
        MemoryPlacement::SystemSuffix => match msgs.first_mut() {
            Some(m) if m.role == Role::System => {
                m.content = format!("{}\n\n{note}", m.content);
            }
            _ => msgs.insert(0, Message::system(note)),
        },
    }
    msgs
}

/// The assistant message for a parsed actor turn (`call_ids` name its calls, in order).
pub fn assistant_message(turn: &ActorTurn, call_ids: &[String]) -> Message {
    let tool_calls = turn
        .calls()
        .iter()
        .zip(call_ids)
        .map(|(c, id)| MessageToolCall {
            id: id.clone(),
            kind: "function".into(),
            function: c.clone(),
        })
        .collect();
    Message {
        tool_calls,
        ..Message::assistant(turn.content.clone())
    }
}

/// The `tool` message carrying a response (compact JSON).
pub fn tool_message(call_id: &str, name: &str, value: &Value) -> Message {
    Message::tool(call_id, name, value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::parse::parse_actor;
    use serde_json::json;

    fn spec(system: &str) -> EpisodeSpec {
        EpisodeSpec {
            task_id: None,
            system: system.into(),
            user_turns: vec!["hi".into(), "more".into()],
            tools: vec![],
            examples: vec![],
        }
    }

    #[test]
    fn conversation_starts_with_policy_and_first_user_turn() {
        let c = initial_conversation(&spec("Policy: never overdraw."));
        assert_eq!(
            c,
            vec![
                Message::system("Policy: never overdraw."),
                Message::user("hi")
            ]
        );
        assert_eq!(initial_conversation(&spec(" "))[0].content, DEFAULT_SYSTEM);
    }

    #[test]
    fn memory_as_user_message_is_appended() {
        let c = initial_conversation(&spec("P"));
        let p = actor_prompt(&c, Some("1. x → ok"), MemoryPlacement::UserMessage);
        assert_eq!(p.len(), 3);
        assert_eq!(p[2].role, Role::User);
        assert!(p[2].content.starts_with(MEMORY_HEADING));
        assert!(p[2].content.ends_with("1. x → ok"));
    }

    #[test]
    fn memory_as_system_suffix_extends_the_system_prompt() {
        let c = initial_conversation(&spec("P"));
        let p = actor_prompt(&c, Some("M"), MemoryPlacement::SystemSuffix);
        assert_eq!(p.len(), 2);
        assert!(p[0].content.starts_with("P\n\n"));
        assert!(p[0].content.ends_with("M"));
    }

    #[test]
    fn no_memory_leaves_conversation_unchanged() {
        let c = initial_conversation(&spec("P"));
        assert_eq!(actor_prompt(&c, None, MemoryPlacement::UserMessage), c);
    }

    #[test]
    fn assistant_message_carries_call_ids() {
        let t = parse_actor("ok <tool_call>{\"name\":\"a\",\"arguments\":{\"x\":1}}</tool_call>");
        let m = assistant_message(&t, &["call_3".into()]);
        assert_eq!(m.content, "ok");
        assert_eq!(m.tool_calls[0].id, "call_3");
        assert_eq!(m.tool_calls[0].function.arguments, json!({"x": 1}));
    }

    #[test]
    fn tool_message_is_compact_json() {
        let m = tool_message("c1", "get", &json!({"a": [1, 2]}));
        assert_eq!(m.content, "{\"a\":[1,2]}");
        assert_eq!(m.tool_call_id.as_deref(), Some("c1"));
    }
}
