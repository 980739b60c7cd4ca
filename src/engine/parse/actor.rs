//! Actor output parser (Hermes/Qwen style): optional `<think>…</think>`, then either one or more
//! `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks or a plain final answer.
//!
//! Tolerant of what small local models write — a missing closing tag, JSON leaked into plain
//! text without tags, prose after the call, code fences, single quotes, Python literals,
//! trailing commas, `arguments` given as a JSON string or under `parameters` — but every repair
//! and every failure is returned as an [`ActorFormatEvent`]. It never panics and never guesses
//! silently.

use serde_json::{Map, Value};

use super::json::{self, Repair};
use super::split_think;
use crate::message::ToolCall;

pub use crate::session::format::{ActorAction, ActorFormatEvent, ActorTurn};

use crate::runtime::tool_guard::{CLOSE, OPEN};
/// Leaked-JSON scanning stops after this many candidate objects (keeps adversarial inputs linear
/// enough for fuzzing).
const MAX_LEAK_CANDIDATES: usize = 64;

impl ActorFormatEvent {
    /// Failures lose content; everything else is a repair that kept it.
    pub fn is_failure(&self) -> bool {
        matches!(
            self,
            Self::UnparseableToolCall { .. } | Self::EmptyOutput | Self::UnclosedThink
        )
    }
}

impl ActorTurn {
    pub fn calls(&self) -> &[ToolCall] {
        match &self.action {
            ActorAction::Calls { calls } => calls,
            _ => &[],
        }
    }
}

/// Parse one actor generation. Total: every input gives a turn.
pub fn parse_actor(text: &str) -> ActorTurn {
    let mut events = Vec::new();
    let split = split_think(text, OPEN);
    if split.unclosed {
        events.push(ActorFormatEvent::UnclosedThink);
    }
    let think = split.think;
    let rest = split.rest;

    let mut calls = Vec::new();
    let mut content;
    let tagged = rest.contains(OPEN);
    if tagged {
        let first = rest.find(OPEN).unwrap_or(0);
        content = strip_stray_close(&rest[..first], &mut events);
        let mut pos = first;
        let mut block = 0;
        let mut trailing = String::new();
        while let Some(rel) = rest[pos..].find(OPEN) {
            let between = &rest[pos..pos + rel];
            if block > 0 && !between.trim().is_empty() {
                trailing.push_str(between.trim());
                trailing.push('\n');
            }
            let inner_start = pos + rel + OPEN.len();
            let close = rest[inner_start..].find(CLOSE).map(|i| inner_start + i);
            let next = rest[inner_start..].find(OPEN).map(|i| inner_start + i);
            let (inner_end, after) = match (close, next) {
                (Some(c), Some(n)) if c < n => (c, c + CLOSE.len()),
                (Some(c), None) => (c, c + CLOSE.len()),
                (_, Some(n)) => {
                    events.push(ActorFormatEvent::MissingClosingTag { block });
                    (n, n)
                }
                (None, None) => {
                    events.push(ActorFormatEvent::MissingClosingTag { block });
                    (rest.len(), rest.len())
                }
            };
            parse_block(
                &rest[inner_start..inner_end],
                block,
                &mut calls,
                &mut events,
            );
            block += 1;
            pos = after;
        }
        let tail = strip_stray_close(&rest[pos..], &mut events);
        trailing.push_str(tail.trim());
        let trailing = trailing.trim();
        if !trailing.is_empty() {
            events.push(ActorFormatEvent::TrailingProse {
                text: trailing.to_string(),
            });
        }
    } else {
        content = strip_stray_close(rest, &mut events);
        let (leaked, outside) = find_leaked_calls(&content, &mut events);
        if !leaked.is_empty() {
            calls = leaked;
            content = outside;
        }
    }
    let content = content.trim().to_string();

    let action = if !calls.is_empty() {
        ActorAction::Calls { calls }
    } else if tagged {
        ActorAction::Malformed
    } else {
        if content.is_empty() && !split.unclosed {
            events.push(ActorFormatEvent::EmptyOutput);
        }
        ActorAction::Answer
    };
    ActorTurn {
        think,
        content,
        action,
        events,
    }
}

fn strip_stray_close(text: &str, events: &mut Vec<ActorFormatEvent>) -> String {
    if text.contains(CLOSE) {
        events.push(ActorFormatEvent::StrayClosingTag);
        text.replace(CLOSE, "")
    } else {
        text.to_string()
    }
}

/// Parse the inside of one `<tool_call>` block into zero or more calls.
fn parse_block(
    inner: &str,
    block: usize,
    calls: &mut Vec<ToolCall>,
    events: &mut Vec<ActorFormatEvent>,
) {
    let (inner, fenced) = json::strip_code_fence(inner);
    if fenced {
        events.push(ActorFormatEvent::CodeFence { block });
    }
    let unparseable = |reason: String| ActorFormatEvent::UnparseableToolCall {
        block,
        reason,
        raw: inner.to_string(),
    };
    let start = inner.find(['{', '[']);
    let Some(start) = start else {
        events.push(unparseable("no JSON object in block".into()));
        return;
    };
    let Some(end) = json::balanced_end(inner.as_bytes(), start) else {
        events.push(unparseable("unbalanced brackets".into()));
        return;
    };
    let around = format!("{} {}", inner[..start].trim(), inner[end..].trim());
    let around = around.trim();
    if !around.is_empty() {
        events.push(ActorFormatEvent::TextInBlock {
            block,
            text: around.to_string(),
        });
    }
    let value = match json::parse_lenient(&inner[start..end]) {
        Ok((v, repairs)) => {
            record_repairs(&repairs, block, events);
            v
        }
        Err(e) => {
            events.push(unparseable(e));
            return;
        }
    };
    match value {
        Value::Object(obj) => match object_to_call(obj, block, events) {
            Ok(c) => calls.push(c),
            Err(reason) => events.push(unparseable(reason)),
        },
        Value::Array(items) if !items.is_empty() => {
            events.push(ActorFormatEvent::CallArray { block });
            for item in items {
                match item {
                    Value::Object(obj) => match object_to_call(obj, block, events) {
                        Ok(c) => calls.push(c),
                        Err(reason) => events.push(unparseable(reason)),
                    },
                    _ => events.push(unparseable("array item is not an object".into())),
                }
            }
        }
        _ => events.push(unparseable("not a JSON object".into())),
    }
}

fn record_repairs(repairs: &[Repair], block: usize, events: &mut Vec<ActorFormatEvent>) {
    for r in repairs {
        events.push(match r {
            Repair::SingleQuotes => ActorFormatEvent::SingleQuotes { block },
            Repair::PythonLiterals => ActorFormatEvent::PythonLiterals { block },
            Repair::TrailingComma => ActorFormatEvent::TrailingComma { block },
        });
    }
}

/// `{"name", "arguments"}` (or the OpenAI nesting `{"function": {…}}`) into a call.
fn object_to_call(
    mut obj: Map<String, Value>,
    block: usize,
    events: &mut Vec<ActorFormatEvent>,
) -> Result<ToolCall, String> {
    if !obj.contains_key("name")
        && let Some(Value::Object(inner)) = obj.get("function")
    {
        events.push(ActorFormatEvent::ArgumentsKeyAlias {
            block,
            key: "function".into(),
        });
        obj = inner.clone();
    }
    let name = match obj.get("name") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        Some(_) => return Err("`name` is not a non-empty string".into()),
        None => return Err("no `name`".into()),
    };
    let (key, raw) = if let Some(v) = obj.get("arguments") {
        ("arguments", v.clone())
    } else if let Some(v) = obj.get("parameters") {
        events.push(ActorFormatEvent::ArgumentsKeyAlias {
            block,
            key: "parameters".into(),
        });
        ("parameters", v.clone())
    } else {
        events.push(ActorFormatEvent::MissingArguments { block });
        return Ok(ToolCall {
            name,
            arguments: Value::Object(Map::new()),
        });
    };
    let arguments = match raw {
        Value::Object(_) => raw,
        Value::Null => {
            events.push(ActorFormatEvent::MissingArguments { block });
            Value::Object(Map::new())
        }
        Value::String(s) => {
            let trimmed = s.trim();
            if trimmed.is_empty() {
                events.push(ActorFormatEvent::MissingArguments { block });
                Value::Object(Map::new())
            } else {
                match json::parse_lenient(trimmed) {
                    Ok((v @ Value::Object(_), repairs)) => {
                        events.push(ActorFormatEvent::ArgumentsAsString { block });
                        record_repairs(&repairs, block, events);
                        v
                    }
                    _ => return Err(format!("`{key}` is a string that is not a JSON object")),
                }
            }
        }
        _ => return Err(format!("`{key}` is not an object")),
    };
    Ok(ToolCall { name, arguments })
}

/// Calls written as bare JSON in plain text. Returns the calls and the text outside them.
fn find_leaked_calls(text: &str, events: &mut Vec<ActorFormatEvent>) -> (Vec<ToolCall>, String) {
    let mut calls = Vec::new();
    let mut outside = String::new();
    let mut kept_from = 0;
    let mut pos = 0;
    let mut tried = 0;
    let bytes = text.as_bytes();
    while tried < MAX_LEAK_CANDIDATES {
        let Some(rel) = bytes
            .get(pos..)
            .and_then(|b| b.iter().position(|&c| c == b'{' || c == b'['))
        else {
            break;
        };
        let start = pos + rel;
        tried += 1;
        let Some(end) = json::balanced_end(bytes, start) else {
            pos = start + 1;
            continue;
        };
        let mut local = Vec::new();
        let mut local_events = Vec::new();
        let block = calls.len();
        if let Ok((value, repairs)) = json::parse_lenient(&text[start..end]) {
            let objs: Vec<Map<String, Value>> = match value {
                Value::Object(o) => vec![o],
                Value::Array(items) => items
                    .into_iter()
                    .filter_map(|v| match v {
                        Value::Object(o) => Some(o),
                        _ => None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            let all_calls = !objs.is_empty() && objs.iter().all(looks_like_call);
            if all_calls {
                record_repairs(&repairs, block, &mut local_events);
                for o in objs {
                    match object_to_call(o, block, &mut local_events) {
                        Ok(c) => local.push(c),
                        Err(_) => {
                            local.clear();
                            break;
                        }
                    }
                }
            }
        }
        if local.is_empty() {
            pos = start + 1;
            continue;
        }
        events.push(ActorFormatEvent::UntaggedToolCall { block });
        events.extend(local_events);
        calls.extend(local);
        outside.push_str(&text[kept_from..start]);
        kept_from = end;
        pos = end;
    }
    if calls.is_empty() {
        return (calls, text.to_string());
    }
    outside.push_str(&text[kept_from..]);
    let outside = outside.replace("```json", "").replace("```", "");
    (calls, outside.trim().to_string())
}

fn looks_like_call(o: &Map<String, Value>) -> bool {
    matches!(o.get("name"), Some(Value::String(_)))
        && (o.contains_key("arguments") || o.contains_key("parameters"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, args: Value) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: args,
        }
    }

    #[test]
    fn well_formed_single_call_has_no_events() {
        let t = parse_actor(
            "<think>need balance</think>\n<tool_call>\n{\"name\": \"get_balance\", \"arguments\": {\"account\": \"chk\"}}\n</tool_call>",
        );
        assert_eq!(t.think.as_deref(), Some("need balance"));
        assert_eq!(t.calls(), &[call("get_balance", json!({"account": "chk"}))]);
        assert!(t.events.is_empty(), "{:?}", t.events);
        assert_eq!(t.content, "");
    }

    #[test]
    fn parallel_calls_are_kept_in_order() {
        let t = parse_actor(
            "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n<tool_call>{\"name\":\"b\",\"arguments\":{\"x\":1}}</tool_call>",
        );
        assert_eq!(
            t.calls(),
            &[call("a", json!({})), call("b", json!({"x": 1}))]
        );
        assert!(t.events.is_empty());
    }

    #[test]
    fn prose_before_calls_becomes_content_without_event() {
        let t =
            parse_actor("Let me check.\n<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>");
        assert_eq!(t.content, "Let me check.");
        assert!(t.events.is_empty());
    }

    #[test]
    fn plain_text_is_an_answer() {
        let t = parse_actor("<think>done</think>\n\nYour balance is 5.");
        assert_eq!(t.action, ActorAction::Answer);
        assert_eq!(t.content, "Your balance is 5.");
        assert!(t.events.is_empty());
    }

    #[test]
    fn lone_closing_think_splits_thinking_from_answer() {
        let t = parse_actor("thinking here\n</think>\nHello");
        assert_eq!(t.think.as_deref(), Some("thinking here"));
        assert_eq!(t.content, "Hello");
        assert!(t.events.is_empty());
    }

    #[test]
    fn missing_closing_tag_is_repaired_and_reported() {
        let t = parse_actor("<tool_call>{\"name\":\"a\",\"arguments\":{\"k\":1}}");
        assert_eq!(t.calls(), &[call("a", json!({"k": 1}))]);
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::MissingClosingTag { block: 0 }]
        );
    }

    #[test]
    fn missing_closing_tag_between_two_blocks_is_repaired() {
        let t = parse_actor(
            "<tool_call>{\"name\":\"a\",\"arguments\":{}}\n<tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>",
        );
        assert_eq!(t.calls().len(), 2);
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::MissingClosingTag { block: 0 }]
        );
    }

    #[test]
    fn trailing_prose_is_reported() {
        let t = parse_actor(
            "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call> and then I will wait",
        );
        assert_eq!(t.calls().len(), 1);
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::TrailingProse {
                text: "and then I will wait".into()
            }]
        );
    }

    #[test]
    fn single_quotes_and_python_literals_are_repaired() {
        let t = parse_actor(
            "<tool_call>{'name': 'freeze', 'arguments': {'card': 'x1', 'now': True}}</tool_call>",
        );
        assert_eq!(
            t.calls(),
            &[call("freeze", json!({"card": "x1", "now": true}))]
        );
        assert_eq!(
            t.events,
            vec![
                ActorFormatEvent::SingleQuotes { block: 0 },
                ActorFormatEvent::PythonLiterals { block: 0 }
            ]
        );
    }

    #[test]
    fn arguments_as_json_string_are_decoded() {
        let t = parse_actor(
            r#"<tool_call>{"name": "pay", "arguments": "{\"amount\": 5}"}</tool_call>"#,
        );
        assert_eq!(t.calls(), &[call("pay", json!({"amount": 5}))]);
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::ArgumentsAsString { block: 0 }]
        );
    }

    #[test]
    fn arguments_string_that_is_not_json_fails_the_block() {
        let t = parse_actor(r#"<tool_call>{"name": "pay", "arguments": "five"}</tool_call>"#);
        assert_eq!(t.action, ActorAction::Malformed);
        assert!(matches!(
            t.events.as_slice(),
            [ActorFormatEvent::UnparseableToolCall { block: 0, .. }]
        ));
    }

    #[test]
    fn parameters_key_is_accepted_as_alias() {
        let t = parse_actor(r#"<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>"#);
        assert_eq!(t.calls(), &[call("a", json!({"x": 1}))]);
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::ArgumentsKeyAlias {
                block: 0,
                key: "parameters".into()
            }]
        );
    }

    #[test]
    fn openai_nested_function_is_accepted() {
        let t = parse_actor(
            r#"<tool_call>{"type":"function","function":{"name":"a","arguments":"{}"}}</tool_call>"#,
        );
        assert_eq!(t.calls(), &[call("a", json!({}))]);
        assert_eq!(t.events.len(), 2);
    }

    #[test]
    fn missing_arguments_default_to_empty_object() {
        let t = parse_actor(r#"<tool_call>{"name": "list"}</tool_call>"#);
        assert_eq!(t.calls(), &[call("list", json!({}))]);
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::MissingArguments { block: 0 }]
        );
    }

    #[test]
    fn code_fence_inside_block_is_stripped() {
        let t = parse_actor(
            "<tool_call>\n```json\n{\"name\":\"a\",\"arguments\":{}}\n```\n</tool_call>",
        );
        assert_eq!(t.calls().len(), 1);
        assert_eq!(t.events, vec![ActorFormatEvent::CodeFence { block: 0 }]);
    }

    #[test]
    fn text_inside_block_is_reported() {
        let t = parse_actor("<tool_call>call: {\"name\":\"a\",\"arguments\":{}} ok</tool_call>");
        assert_eq!(t.calls().len(), 1);
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::TextInBlock {
                block: 0,
                text: "call: ok".into()
            }]
        );
    }

    #[test]
    fn array_of_calls_in_one_block() {
        let t = parse_actor(
            r#"<tool_call>[{"name":"a","arguments":{}},{"name":"b","arguments":{}}]</tool_call>"#,
        );
        assert_eq!(t.calls().len(), 2);
        assert_eq!(t.events, vec![ActorFormatEvent::CallArray { block: 0 }]);
    }

    #[test]
    fn leaked_json_without_tags_is_recovered() {
        let t = parse_actor(
            "I will transfer now. {\"name\": \"transfer\", \"arguments\": {\"amount\": 3}}",
        );
        assert_eq!(t.calls(), &[call("transfer", json!({"amount": 3}))]);
        assert_eq!(t.content, "I will transfer now.");
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::UntaggedToolCall { block: 0 }]
        );
    }

    #[test]
    fn leaked_json_in_code_fence_is_recovered() {
        let t = parse_actor("```json\n{\"name\": \"a\", \"arguments\": {}}\n```");
        assert_eq!(t.calls(), &[call("a", json!({}))]);
        assert_eq!(t.content, "");
    }

    #[test]
    fn json_in_answer_without_call_shape_stays_an_answer() {
        let t = parse_actor("The result is {\"balance\": 5, \"name\": \"chk\"}.");
        assert_eq!(t.action, ActorAction::Answer);
        assert!(t.events.is_empty());
    }

    #[test]
    fn garbage_block_is_malformed_with_reason() {
        let t = parse_actor("<tool_call>not json at all</tool_call>");
        assert_eq!(t.action, ActorAction::Malformed);
        assert!(matches!(
            &t.events[..],
            [ActorFormatEvent::UnparseableToolCall { reason, .. }] if reason.contains("no JSON")
        ));
    }

    #[test]
    fn unbalanced_block_is_malformed() {
        let t = parse_actor("<tool_call>{\"name\": \"a\", \"arguments\": {</tool_call>");
        assert_eq!(t.action, ActorAction::Malformed);
    }

    #[test]
    fn one_good_and_one_bad_block_keeps_the_good_call() {
        let t = parse_actor(
            "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><tool_call>{\"arguments\":{}}</tool_call>",
        );
        assert_eq!(t.calls().len(), 1);
        assert!(matches!(
            &t.events[..],
            [ActorFormatEvent::UnparseableToolCall { block: 1, .. }]
        ));
    }

    #[test]
    fn empty_name_is_rejected() {
        let t = parse_actor(r#"<tool_call>{"name":" ","arguments":{}}</tool_call>"#);
        assert_eq!(t.action, ActorAction::Malformed);
    }

    #[test]
    fn non_object_arguments_are_rejected() {
        let t = parse_actor(r#"<tool_call>{"name":"a","arguments":[1,2]}</tool_call>"#);
        assert_eq!(t.action, ActorAction::Malformed);
    }

    #[test]
    fn unclosed_think_ends_at_first_tool_call() {
        let t = parse_actor("<think>hmm\n<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>");
        assert_eq!(t.think.as_deref(), Some("hmm"));
        assert_eq!(t.calls().len(), 1);
        assert_eq!(t.events, vec![ActorFormatEvent::UnclosedThink]);
    }

    #[test]
    fn unclosed_think_without_call_is_a_failure() {
        let t = parse_actor("<think>I keep thinking");
        assert_eq!(t.action, ActorAction::Answer);
        assert_eq!(t.content, "");
        assert_eq!(t.events, vec![ActorFormatEvent::UnclosedThink]);
        assert!(t.events[0].is_failure());
    }

    #[test]
    fn empty_output_is_reported() {
        let t = parse_actor("  \n ");
        assert_eq!(t.events, vec![ActorFormatEvent::EmptyOutput]);
    }

    #[test]
    fn stray_closing_tag_is_removed_and_reported() {
        let t = parse_actor("Done.</tool_call>");
        assert_eq!(t.content, "Done.");
        assert_eq!(t.events, vec![ActorFormatEvent::StrayClosingTag]);
    }

    #[test]
    fn trailing_comma_is_repaired() {
        let t = parse_actor(r#"<tool_call>{"name":"a","arguments":{"x":1,},}</tool_call>"#);
        assert_eq!(t.calls(), &[call("a", json!({"x": 1}))]);
        assert_eq!(t.events, vec![ActorFormatEvent::TrailingComma { block: 0 }]);
    }

    #[test]
    fn unicode_content_does_not_panic() {
        let t =
            parse_actor("<tool_call>{\"name\":\"é\",\"arguments\":{\"v\":\"ß→✓\"}}</tool_call>ü");
        assert_eq!(t.calls().len(), 1);
        let _ = parse_actor("<tool_call>é{");
        let _ = parse_actor("{é[ü'ß");
    }

    #[test]
    fn prose_between_calls_counts_as_trailing_prose() {
        let t = parse_actor(
            "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call> then <tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>",
        );
        assert_eq!(t.calls().len(), 2);
        assert_eq!(
            t.events,
            vec![ActorFormatEvent::TrailingProse {
                text: "then".into()
            }]
        );
    }
}
