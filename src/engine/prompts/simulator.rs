//! The simulator's prompt: a separate, compact prompt per pending call (our own wording; a tiny
//! model is trained on it). A system message with the instruction (check the call's format,
//! that the tool is allowed, the arguments against the schema; then answer in
//! `<execution_result>`), and one user message with: the allowed tools and schemas, few-shot
//! recorded examples (same tool first), the conversation so far, the actor's latest message,
//! results already given for it, and the current call.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::engine::parse::execution_result;
use crate::engine::types::{RecordedExample, SimPromptConfig};
use crate::env::ToolSpec;
use crate::message::{Message, Role, ToolCall};

/// The simulator's system instruction.
pub const SIMULATOR_INSTRUCTION: &str = "You simulate tool execution. For the call: \
1) check it is well formed; 2) check the tool is in the allowed list; 3) check the arguments \
against its JSON schema; 4) write the result the real tool would return, consistent with the \
examples and the conversation. Answer only <execution_result>JSON</execution_result>, the JSON \
a non-empty object or array. If a check fails, answer <execution_result>{\"error_tool_call\": \
{\"code\": \"...\", \"message\": \"...\"}}</execution_result>.";

/// The compact instruction (see `SimPromptConfig::compact`).
pub const SIMULATOR_INSTRUCTION_COMPACT: &str =
    "Simulate the tool call. Answer <execution_result>JSON</execution_result>.";

/// `name(param,param)` for the compact tool list.
pub fn compact_signature(t: &ToolSpec) -> String {
    let params: Vec<&str> = t
        .input_schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|o| o.keys().map(String::as_str).collect())
        .unwrap_or_default();
    format!("{}({})", t.name, params.join(","))
}

/// What the simulator prompt is built from.
#[derive(Debug, Clone, Copy)]
pub struct SimulatorPromptInput<'a> {
    pub tools: &'a [ToolSpec],
    pub examples: &'a [RecordedExample],
    /// The conversation so far, including the actor's latest message and any tool results
    /// already given for it (the system message is skipped unless `include_policy`).
    pub conversation: &'a [Message],
    pub call: &'a ToolCall,
}

/// `{"name": …, "arguments": …}` as compact JSON.
pub fn format_call(call: &ToolCall) -> String {
    json!({"name": call.name, "arguments": call.arguments}).to_string()
}

fn cut(s: &str, max: usize) -> String {
    if max == 0 || s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max).collect();
        t.push('…');
        t
    }
}

fn line(m: &Message, max: usize) -> String {
    match m.role {
        Role::System => format!("[system] {}", cut(&m.content, max)),
        Role::User => format!("[user] {}", cut(&m.content, max)),
        Role::Assistant => {
            let mut s = format!("[assistant] {}", cut(m.content.trim(), max));
            for c in &m.tool_calls {
                let _ = write!(s, "\n[call] {}", cut(&format_call(&c.function), max));
            }
            s
        }
        Role::Tool => format!(
            "[result {}] {}",
            m.name.as_deref().unwrap_or("?"),
            cut(&m.content, max)
        ),
    }
}

/// Pick at most `max` examples, those of the same tool first (most recent first within each
/// group), skipping exact duplicates.
fn select_examples<'a>(
    examples: &'a [RecordedExample],
    tool: &str,
    max: usize,
) -> Vec<&'a RecordedExample> {
    let mut picked: Vec<&RecordedExample> = Vec::new();
    let same = examples.iter().rev().filter(|e| e.name == tool);
    let other = examples.iter().rev().filter(|e| e.name != tool);
    for e in same.chain(other) {
        if picked.len() >= max {
            break;
        }
        if !picked.contains(&e) {
            picked.push(e);
        }
    }
    picked
}

/// Build the simulator prompt for one pending call.
pub fn simulator_prompt(input: &SimulatorPromptInput<'_>, cfg: &SimPromptConfig) -> Vec<Message> {
    let max = cfg.max_message_chars;
    let mut u = String::new();

    u.push_str("# Allowed tools\n");
    if cfg.compact {
        let sigs: Vec<String> = input.tools.iter().map(compact_signature).collect();
        let _ = writeln!(u, "{}", sigs.join(" "));
    } else {
        for t in input.tools {
            let _ = writeln!(
                u,
                "{}",
                json!({"name": t.name, "description": t.description, "parameters": t.input_schema})
            );
        }
    }

    let examples = select_examples(input.examples, &input.call.name, cfg.max_examples);
    if !examples.is_empty() {
        u.push_str("\n# Examples\n");
        for e in examples {
            let call = ToolCall {
                name: e.name.clone(),
                arguments: e.arguments.clone(),
            };
            let _ = writeln!(
                u,
                "call: {}\n{}",
                cut(&format_call(&call), max),
                execution_result(&cut(&e.response.to_string(), max))
            );
        }
    }

    // Split the conversation at the actor's latest message with calls.
    let conv = input.conversation;
    let latest = conv
        .iter()
        .rposition(|m| m.role == Role::Assistant && !m.tool_calls.is_empty());
    let (history, latest_msg, after) = match latest {
        Some(i) => (&conv[..i], Some(&conv[i]), &conv[i + 1..]),
        None => (conv, None, &conv[conv.len()..]),
    };
    let history: Vec<&Message> = history
        .iter()
        .filter(|m| cfg.include_policy || m.role != Role::System)
        .collect();
    let skip = if cfg.max_history_messages > 0 {
        history.len().saturating_sub(cfg.max_history_messages)
    } else {
        0
    };
    if !history.is_empty() {
        u.push_str("\n# Conversation\n");
        if skip > 0 {
            let _ = writeln!(u, "({skip} earlier messages omitted)");
        }
        for m in &history[skip..] {
            let _ = writeln!(u, "{}", line(m, max));
        }
    }
    // In compact form the latest message is left out when it says nothing beyond this call.
    let redundant = |m: &Message| {
        cfg.compact
            && m.content.trim().is_empty()
            && m.tool_calls.len() == 1
            && m.tool_calls[0].function == *input.call
    };
    if let Some(m) = latest_msg.filter(|m| !redundant(m)) {
        let _ = writeln!(u, "\n# Latest assistant message\n{}", line(m, max));
    }
    if !after.is_empty() {
        u.push_str("\n# Results already returned for it\n");
        for m in after {
            let _ = writeln!(u, "{}", line(m, max));
        }
    }
    let _ = write!(u, "\n# Call to simulate\n{}", format_call(input.call));

    let instruction = if cfg.compact {
        SIMULATOR_INSTRUCTION_COMPACT
    } else {
        SIMULATOR_INSTRUCTION
    };
    vec![Message::system(instruction), Message::user(u)]
}

/// A recorded example from a real response (the JSON the actor saw).
pub fn example_from_real(call: &ToolCall, response: &Value) -> RecordedExample {
    RecordedExample {
        name: call.name.clone(),
        arguments: call.arguments.clone(),
        response: response.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::MessageToolCall;

    fn tool(name: &str) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: format!("{name} tool"),
            input_schema: json!({"type": "object", "properties": {"id": {"type": "string"}}}),
            annotations: Default::default(),
        }
    }

    fn call(name: &str, id: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: json!({"id": id}),
        }
    }

    fn conversation() -> Vec<Message> {
        vec![
            Message::system("SECRET POLICY"),
            Message::user("freeze card c1 and check balance"),
            Message {
                tool_calls: vec![
                    MessageToolCall {
                        id: "call_0".into(),
                        kind: "function".into(),
                        function: call("freeze", "c1"),
                    },
                    MessageToolCall {
                        id: "call_1".into(),
                        kind: "function".into(),
                        function: call("balance", "a1"),
                    },
                ],
                ..Message::assistant("Doing both.")
            },
            Message::tool("call_0", "freeze", "{\"frozen\":true}"),
        ]
    }

    fn ex(name: &str, n: i64) -> RecordedExample {
        RecordedExample {
            name: name.into(),
            arguments: json!({"id": n.to_string()}),
            response: json!({"n": n}),
        }
    }

    #[test]
    fn prompt_has_instruction_tools_history_latest_results_and_call() {
        let tools = [tool("freeze"), tool("balance")];
        let conv = conversation();
        let c = call("balance", "a1");
        let p = simulator_prompt(
            &SimulatorPromptInput {
                tools: &tools,
                examples: &[],
                conversation: &conv,
                call: &c,
            },
            &SimPromptConfig::default(),
        );
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].content, SIMULATOR_INSTRUCTION);
        let u = &p[1].content;
        let order = [
            "# Allowed tools",
            "\"name\":\"freeze\"",
            "# Conversation",
            "[user] freeze card",
            "# Latest assistant message",
            "[assistant] Doing both.",
            "[call] {\"name\":\"freeze\"",
            "# Results already returned for it",
            "[result freeze] {\"frozen\":true}",
            "# Call to simulate\n{\"name\":\"balance\",\"arguments\":{\"id\":\"a1\"}}",
        ];
        let mut at = 0;
        for needle in order {
            let i = u[at..]
                .find(needle)
                .unwrap_or_else(|| panic!("missing {needle:?} in\n{u}"));
            at += i;
        }
        assert!(!u.contains("SECRET POLICY"));
        assert!(!u.contains("# Examples"));
    }

    #[test]
    fn policy_is_included_on_request() {
        let conv = conversation();
        let c = call("balance", "a1");
        let cfg = SimPromptConfig {
            include_policy: true,
            ..Default::default()
        };
        let p = simulator_prompt(
            &SimulatorPromptInput {
                tools: &[],
                examples: &[],
                conversation: &conv,
                call: &c,
            },
            &cfg,
        );
        assert!(p[1].content.contains("[system] SECRET POLICY"));
    }

    #[test]
    fn examples_prefer_same_tool_newest_first_and_are_capped() {
        let examples = [
            ex("balance", 1),
            ex("freeze", 2),
            ex("balance", 3),
            ex("balance", 3),
        ];
        let picked = select_examples(&examples, "balance", 3);
        assert_eq!(picked, vec![&examples[2], &examples[0], &examples[1]]);
    }

    #[test]
    fn examples_are_rendered_as_call_and_result() {
        let conv = conversation();
        let c = call("balance", "a1");
        let examples = [ex("balance", 9)];
        let p = simulator_prompt(
            &SimulatorPromptInput {
                tools: &[],
                examples: &examples,
                conversation: &conv,
                call: &c,
            },
            &SimPromptConfig::default(),
        );
        assert!(p[1].content.contains(
            "# Examples\ncall: {\"name\":\"balance\",\"arguments\":{\"id\":\"9\"}}\n<execution_result>{\"n\":9}</execution_result>"
        ));
    }

    #[test]
    fn long_history_is_trimmed_and_counted() {
        let mut conv = vec![Message::system("s")];
        for i in 0..10 {
            conv.push(Message::user(format!("u{i}")));
        }
        let c = call("x", "1");
        let cfg = SimPromptConfig {
            max_history_messages: 3,
            max_message_chars: 5,
            ..Default::default()
        };
        let p = simulator_prompt(
            &SimulatorPromptInput {
                tools: &[],
                examples: &[],
                conversation: &conv,
                call: &c,
            },
            &cfg,
        );
        let u = &p[1].content;
        assert!(u.contains("(7 earlier messages omitted)"));
        assert!(u.contains("[user] u9") && !u.contains("[user] u6"));
    }

    #[test]
    fn prompt_is_a_pure_function() {
        let conv = conversation();
        let c = call("balance", "a1");
        let input = SimulatorPromptInput {
            tools: &[],
            examples: &[],
            conversation: &conv,
            call: &c,
        };
        let cfg = SimPromptConfig::default();
        assert_eq!(
            simulator_prompt(&input, &cfg),
            simulator_prompt(&input, &cfg)
        );
    }
}
