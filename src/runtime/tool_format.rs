//! How tools reach a model whose own chat template has no tools section. Such a template (SmolLM2's
//! ChatML one, for instance) silently drops `tools`, drops assistant `tool_calls` and prints `tool`
//! messages as a role the model never saw, so the model would never learn a tool exists. Here the
//! conversation is rewritten into plain system / user / assistant text in a tool-use format the
//! model was tuned on, and then rendered through the model's own template with no `tools`:
//!
//! - [`ToolRendering::SystemHermes`]: Qwen2.5/Hermes instructions appended to the system message,
//!   calls as `<tool_call>` JSON objects in the assistant content, consecutive tool results merged
//!   into one user turn of `<tool_response>` blocks — exactly what the Qwen2.5 template (and our
//!   built-in [`CHATML_TOOLS_TEMPLATE`](super::chat_template::CHATML_TOOLS_TEMPLATE)) prints.
//! - [`ToolRendering::SystemSmolLM2`]: SmolLM2's function-calling prompt (the one its tool-use
//!   tuning used, as Ollama's smollm2 template shows it), tools as one JSON list of function
//!   objects (the OpenAI `{"type": "function", "function": …}` wrapper is unwrapped, as in its
//!   tuning data), calls as one `<tool_call>[…]</tool_call>` JSON list, each tool result as a user
//!   turn of one `<tool_response>` block.
//!
//! Both outputs are read back by `engine::parse::parse_actor` (objects or lists inside
//! `<tool_call>`). The rewrite must never reorder or drop a turn, and must only append to what an
//! earlier, shorter conversation rendered: the engine's prompt cache and the trainers' loss masks
//! rely on a conversation's rendering being a prefix of its continuation's.

use std::borrow::Cow;
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::chat_template::python_json;
use crate::message::{Message, MessageToolCall, Role};

/// How a conversation's tools, calls and tool results are shown to a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ToolRendering {
    /// The model's own template takes `tools` and prints calls and results itself.
    #[serde(rename = "template")]
    Template,
    /// Qwen2.5/Hermes tool instructions in the system message (template without tools section).
    #[serde(rename = "system-hermes")]
    SystemHermes,
    /// SmolLM2's own function-calling prompt (template without tools section).
    #[serde(rename = "system-smollm2")]
    SystemSmolLM2,
}

impl ToolRendering {
    /// Every rendering, for tests and option lists.
    pub const ALL: [Self; 3] = [Self::Template, Self::SystemHermes, Self::SystemSmolLM2];

    /// The name used in configuration files and sessions.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Template => "template",
            Self::SystemHermes => "system-hermes",
            Self::SystemSmolLM2 => "system-smollm2",
        }
    }
}

impl fmt::Display for ToolRendering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// CHATML_TOOLS_TEMPLATE's (and Qwen2.5's) text before the tool list.
const HERMES_TOOLS_HEAD: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>";
/// CHATML_TOOLS_TEMPLATE's (and Qwen2.5's) text after the tool list.
const HERMES_TOOLS_TAIL: &str = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/// SmolLM2's function-calling system prompt, before the tool list.
const SMOLLM2_TOOLS_HEAD: &str = "You are an expert in composing functions. You are given a question and a set of possible functions.\nBased on the question, you will need to make one or more function/tool calls to achieve the purpose.\nIf none of the functions can be used, point it out and refuse to answer.\nIf the given question lacks the parameters required by the function, also point it out.\nYou have access to the following tools:\n<tools>";
/// SmolLM2's function-calling system prompt, after the tool list.
const SMOLLM2_TOOLS_TAIL: &str = "</tools>\nThe output MUST strictly adhere to the following format, and NO other text MUST be included.\nThe example format is as follows. Please make sure the parameter type is correct. If no function call is needed, please make the tool calls an empty list '[]'.\n<tool_call>[\n{\"name\": \"func_name1\", \"arguments\": {\"argument1\": \"value1\", \"argument2\": \"value2\"}},\n(more tool calls as required)\n]</tool_call>";

/// The system-prompt block that lists `tools` (`None` for [`ToolRendering::Template`] or when
/// there are no tools).
pub fn tools_block(rendering: ToolRendering, tools: &[Value]) -> Option<String> {
    if tools.is_empty() {
        return None;
    }
    match rendering {
        ToolRendering::Template => None,
        ToolRendering::SystemHermes => {
            let mut s = HERMES_TOOLS_HEAD.to_string();
            for t in tools {
                s.push('\n');
                s.push_str(&python_json(t));
            }
            s.push_str(HERMES_TOOLS_TAIL);
            Some(s)
        }
        ToolRendering::SystemSmolLM2 => {
            let functions: Vec<Value> = tools.iter().map(unwrap_function).cloned().collect();
            Some(format!(
                "{SMOLLM2_TOOLS_HEAD}{}{SMOLLM2_TOOLS_TAIL}",
                python_json(&Value::Array(functions))
            ))
        }
    }
}

/// The names of OpenAI-style tool entries (`{"type": "function", "function": {"name": …}}` or a
/// bare `{"name": …}`), in order; entries without a name are skipped.
pub fn tool_names(tools: &[Value]) -> Vec<String> {
    tools
        .iter()
        .filter_map(|t| unwrap_function(t).get("name").and_then(Value::as_str))
        .map(str::to_string)
        .collect()
}

/// `{"type": "function", "function": f}` → `f`; anything else unchanged.
fn unwrap_function(tool: &Value) -> &Value {
    match tool.get("function") {
        Some(f) if f.is_object() => f,
        _ => tool,
    }
}

/// One call as `{"name": …, "arguments": …}`, printed as the Qwen templates print it (arguments
/// given as a JSON string are inserted as they are).
fn call_json(call: &MessageToolCall) -> String {
    let args = match &call.function.arguments {
        Value::String(s) => s.clone(),
        other => python_json(other),
    };
    format!(
        "{{\"name\": {}, \"arguments\": {args}}}",
        python_json(&Value::String(call.function.name.clone()))
    )
}

/// An assistant message's text with its calls written in, as the model would emit it.
pub fn assistant_text(
    rendering: ToolRendering,
    content: &str,
    calls: &[MessageToolCall],
) -> String {
    let mut s = content.to_string();
    if calls.is_empty() {
        return s;
    }
    match rendering {
        ToolRendering::Template | ToolRendering::SystemHermes => {
            for (i, c) in calls.iter().enumerate() {
                if i > 0 || !content.is_empty() {
                    s.push('\n');
                }
                s.push_str("<tool_call>\n");
                s.push_str(&call_json(c));
                s.push_str("\n</tool_call>");
            }
        }
        ToolRendering::SystemSmolLM2 => {
            if !content.is_empty() {
                s.push('\n');
            }
            let items: Vec<String> = calls.iter().map(call_json).collect();
            s.push_str("<tool_call>[\n");
            s.push_str(&items.join(",\n"));
            s.push_str("\n]</tool_call>");
        }
    }
    s
}

fn tool_response(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// The conversation a template without tools section renders: tools in the system message,
/// calls in the assistant content, tool results as user turns. Borrowed unchanged for
/// [`ToolRendering::Template`], and when there are no tools, no calls and no tool messages.
pub fn rewrite_messages<'a>(
    rendering: ToolRendering,
    messages: &'a [Message],
    tools: &[Value],
) -> Cow<'a, [Message]> {
    let has_tool_turns = messages
        .iter()
        .any(|m| m.role == Role::Tool || !m.tool_calls.is_empty());
    if rendering == ToolRendering::Template || (tools.is_empty() && !has_tool_turns) {
        return Cow::Borrowed(messages);
    }
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    if let Some(block) = tools_block(rendering, tools) {
        match messages.split_first() {
            Some((first, tail)) if first.role == Role::System => {
                let mut sys = first.clone();
                sys.content = match rendering {
                    // As CHATML_TOOLS_TEMPLATE: the system text and a blank line, always.
                    ToolRendering::SystemHermes => format!("{}\n\n{block}", first.content),
                    _ if first.content.trim().is_empty() => block,
                    _ => format!("{}\n\n{block}", first.content),
                };
                out.push(sys);
                rest = tail;
            }
            _ => out.push(Message::system(block)),
        }
    }
    let mut previous_was_tool = false;
    for m in rest {
        match m.role {
            Role::Tool => {
                let block = tool_response(&m.content);
                match out.last_mut() {
                    Some(last) if previous_was_tool && rendering == ToolRendering::SystemHermes => {
                        last.content.push('\n');
                        last.content.push_str(&block);
                    }
                    _ => out.push(Message::user(block)),
                }
                previous_was_tool = true;
                continue;
            }
            Role::Assistant if !m.tool_calls.is_empty() => {
                let mut a =
                    Message::assistant(assistant_text(rendering, &m.content, &m.tool_calls));
                a.name = m.name.clone();
                out.push(a);
            }
            _ => out.push(m.clone()),
        }
        previous_was_tool = false;
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::parse::parse_actor;
    use crate::message::ToolCall;
    use serde_json::json;

    fn call(id: &str, name: &str, arguments: Value) -> MessageToolCall {
        MessageToolCall {
            id: id.into(),
            kind: "function".into(),
            function: ToolCall {
                name: name.into(),
                arguments,
            },
        }
    }

    fn two_calls() -> Vec<MessageToolCall> {
        vec![
            call(
                "c1",
                "get_weather",
                json!({"city": "Zürich", "unit": "celsius"}),
            ),
            call(
                "c2",
                "list_files",
                json!({"path": "/tmp", "limit": 3, "deep": false}),
            ),
        ]
    }

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "description": "Weather <now>", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
        ]
    }

    #[test]
    fn names_round_trip_through_serde_and_display() {
        for r in ToolRendering::ALL {
            let s = serde_json::to_string(&r).unwrap();
            assert_eq!(s, format!("\"{}\"", r.as_str()));
            assert_eq!(r.to_string(), r.as_str());
            assert_eq!(serde_json::from_str::<ToolRendering>(&s).unwrap(), r);
        }
        assert_eq!(ToolRendering::SystemSmolLM2.as_str(), "system-smollm2");
    }

    #[test]
    fn hermes_calls_parse_back_into_the_same_calls() {
        let calls = two_calls();
        for content in ["", "Let me check."] {
            let text = assistant_text(ToolRendering::SystemHermes, content, &calls);
            let turn = parse_actor(&text);
            let want: Vec<ToolCall> = calls.iter().map(|c| c.function.clone()).collect();
            assert_eq!(turn.calls(), want.as_slice(), "{text}");
            assert_eq!(turn.content, content);
            assert!(turn.events.is_empty(), "{:?}", turn.events);
        }
    }

    #[test]
    fn smollm2_calls_are_one_list_and_parse_back_after_thinking() {
        let calls = two_calls();
        let text = assistant_text(ToolRendering::SystemSmolLM2, "", &calls);
        assert_eq!(text.matches("<tool_call>").count(), 1);
        assert!(text.starts_with("<tool_call>[\n{\"name\": \"get_weather\""));
        assert!(text.ends_with("}\n]</tool_call>"));
        let turn = parse_actor(&format!("<think>\nweather first\n</think>\n\n{text}"));
        let want: Vec<ToolCall> = calls.iter().map(|c| c.function.clone()).collect();
        assert_eq!(turn.calls(), want.as_slice());
        assert_eq!(turn.think.as_deref(), Some("weather first"));
    }

    #[test]
    fn arguments_given_as_a_json_string_are_inserted_verbatim() {
        let c = call("c1", "f", Value::String("{\"a\": 1}".into()));
        let text = assistant_text(ToolRendering::SystemHermes, "", &[c]);
        assert_eq!(
            text,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>"
        );
    }

    #[test]
    fn hermes_merges_consecutive_tool_results_into_one_user_turn() {
        let mut a = Message::assistant("");
        a.tool_calls = two_calls();
        let msgs = vec![
            Message::user("q"),
            a,
            Message::tool("c1", "get_weather", "sunny"),
            Message::tool("c2", "list_files", "[]"),
            Message::assistant("done"),
        ];
        let out = rewrite_messages(ToolRendering::SystemHermes, &msgs, &tools());
        let roles: Vec<Role> = out.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                Role::System,
                Role::User,
                Role::Assistant,
                Role::User,
                Role::Assistant
            ]
        );
        assert_eq!(
            out[3].content,
            "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n[]\n</tool_response>"
        );
        assert!(
            out.iter()
                .all(|m| m.tool_calls.is_empty() && m.tool_call_id.is_none())
        );
        let smol = rewrite_messages(ToolRendering::SystemSmolLM2, &msgs, &tools());
        assert_eq!(smol.len(), 6, "one user turn per tool result");
    }

    #[test]
    fn smollm2_puts_the_task_system_text_first_and_unwraps_functions() {
        let msgs = vec![Message::system("Be brief."), Message::user("q")];
        let out = rewrite_messages(ToolRendering::SystemSmolLM2, &msgs, &tools());
        let sys = &out[0].content;
        assert!(sys.starts_with("Be brief.\n\nYou are an expert in composing functions."));
        assert!(
            sys.contains("<tools>[{\"name\": \"get_weather\", \"description\": \"Weather <now>\"")
        );
        assert!(sys.ends_with("(more tool calls as required)\n]</tool_call>"));
        let only_user = [Message::user("q")];
        let empty = rewrite_messages(ToolRendering::SystemSmolLM2, &only_user, &tools());
        assert!(empty[0].content.starts_with("You are an expert"));
        assert_eq!(empty[1].content, "q");
    }

    #[test]
    fn plain_conversations_are_borrowed_unchanged() {
        let msgs = vec![Message::system("s"), Message::user("q")];
        for r in ToolRendering::ALL {
            assert!(matches!(rewrite_messages(r, &msgs, &[]), Cow::Borrowed(_)));
        }
        assert!(matches!(
            rewrite_messages(ToolRendering::Template, &msgs, &tools()),
            Cow::Borrowed(_)
        ));
    }
}
