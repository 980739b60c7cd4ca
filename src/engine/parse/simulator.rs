//! Simulator output parser, strict by design (the paper's semantics): optional
//! `<think>…</think>`, then exactly one `<execution_result>{JSON}</execution_result>` holding a
//! non-empty JSON object or array, and nothing else but whitespace. The object
//! `{"error_tool_call": {"code", "message"}}` means the simulator rejects the call. Anything
//! else is a [`SimFormatError`]; no repair is attempted, because a simulator that cannot keep
//! the format must lose reward rather than be papered over.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::split_think;

pub use crate::session::format::{SimFormatError, SimOutput};

const OPEN: &str = "<execution_result>";
const CLOSE: &str = "</execution_result>";
/// Key of a rejection object.
pub const REJECTION_KEY: &str = "error_tool_call";

/// The simulator's answer format, written: `<execution_result>{result}</execution_result>`. The
/// one writer of the format this module parses (few-shot examples, training targets).
pub fn execution_result(result: &impl std::fmt::Display) -> String {
    format!("{OPEN}{result}{CLOSE}")
}

impl SimOutput {
    /// The JSON as the simulator wrote it (a rejection as `{"error_tool_call": {…}}`).
    pub fn to_json(&self) -> Value {
        match self {
            Self::Result { value } => value.clone(),
            Self::Rejected { code, message } => {
                serde_json::json!({REJECTION_KEY: {"code": code, "message": message}})
            }
        }
    }
}

/// A parsed simulator generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimTurn {
    pub think: Option<String>,
    pub output: SimOutput,
}

/// Parse one simulator generation strictly.
pub fn parse_simulator(text: &str) -> Result<SimTurn, SimFormatError> {
    let split = split_think(text, OPEN);
    if split.unclosed {
        return Err(SimFormatError::UnclosedThink);
    }
    if !split.prefix.trim().is_empty() {
        return Err(SimFormatError::TextOutsideResult {
            text: split.prefix.trim().to_string(),
        });
    }
    let rest = split.rest.trim();
    let Some(body) = rest.strip_prefix(OPEN) else {
        return Err(match rest.find(OPEN) {
            Some(i) => SimFormatError::TextOutsideResult {
                text: rest[..i].trim().to_string(),
            },
            None => SimFormatError::MissingResult,
        });
    };
    let Some(close) = body.find(CLOSE) else {
        return Err(SimFormatError::UnclosedResult);
    };
    let inner = body[..close].trim();
    let after = body[close + CLOSE.len()..].trim();
    if !after.is_empty() {
        return Err(if after.contains(OPEN) {
            SimFormatError::MultipleResults
        } else {
            SimFormatError::TextOutsideResult {
                text: after.to_string(),
            }
        });
    }
    if inner.contains(OPEN) {
        return Err(SimFormatError::MultipleResults);
    }
    let value: Value = serde_json::from_str(inner).map_err(|e| SimFormatError::InvalidJson {
        reason: e.to_string(),
    })?;
    let output = match &value {
        Value::Object(o) if o.is_empty() => return Err(SimFormatError::EmptyResult),
        Value::Array(a) if a.is_empty() => return Err(SimFormatError::EmptyResult),
        Value::Object(o) if o.contains_key(REJECTION_KEY) => rejection(o)?,
        Value::Object(_) | Value::Array(_) => SimOutput::Result { value },
        _ => return Err(SimFormatError::NotObjectOrArray),
    };
    Ok(SimTurn {
        think: split.think,
        output,
    })
}

fn rejection(o: &serde_json::Map<String, Value>) -> Result<SimOutput, SimFormatError> {
    let bad = |reason: &str| SimFormatError::MalformedRejection {
        reason: reason.to_string(),
    };
    if o.len() != 1 {
        return Err(bad("`error_tool_call` must be the only key"));
    }
    let Some(Value::Object(inner)) = o.get(REJECTION_KEY) else {
        return Err(bad("`error_tool_call` is not an object"));
    };
    let code = match inner.get("code") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        _ => return Err(bad("`code` must be a non-empty string or an integer")),
    };
    let message = match inner.get("message") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(bad("`message` must be a string")),
    };
    Ok(SimOutput::Rejected { code, message })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ok(text: &str) -> SimTurn {
        parse_simulator(text).expect("should parse")
    }
    fn err(text: &str) -> SimFormatError {
        parse_simulator(text).expect_err("should fail")
    }

    #[test]
    fn plain_result_object_parses() {
        let t = ok("<execution_result>{\"balance\": 12.5}</execution_result>");
        assert_eq!(
            t.output,
            SimOutput::Result {
                value: json!({"balance": 12.5})
            }
        );
        assert_eq!(t.think, None);
    }

    #[test]
    fn think_then_result_parses() {
        let t = ok(
            "<think>the account exists</think>\n<execution_result>\n[1, 2]\n</execution_result>\n",
        );
        assert_eq!(t.think.as_deref(), Some("the account exists"));
        assert_eq!(
            t.output,
            SimOutput::Result {
                value: json!([1, 2])
            }
        );
    }

    #[test]
    fn lone_closing_think_is_accepted() {
        let t = ok("checking\n</think><execution_result>{\"a\":1}</execution_result>");
        assert_eq!(t.think.as_deref(), Some("checking"));
    }

    #[test]
    fn rejection_is_recognised() {
        let t = ok(
            r#"<execution_result>{"error_tool_call": {"code": "unknown_tool", "message": "no such tool"}}</execution_result>"#,
        );
        assert_eq!(
            t.output,
            SimOutput::Rejected {
                code: "unknown_tool".into(),
                message: "no such tool".into()
            }
        );
        assert_eq!(
            t.output.to_json(),
            json!({"error_tool_call": {"code": "unknown_tool", "message": "no such tool"}})
        );
    }

    #[test]
    fn integer_rejection_code_is_accepted() {
        let t = ok(
            r#"<execution_result>{"error_tool_call": {"code": 400, "message": "bad"}}</execution_result>"#,
        );
        assert!(matches!(t.output, SimOutput::Rejected { ref code, .. } if code == "400"));
    }

    #[test]
    fn rejection_without_message_is_malformed() {
        assert!(matches!(
            err(r#"<execution_result>{"error_tool_call": {"code": "x"}}</execution_result>"#),
            SimFormatError::MalformedRejection { .. }
        ));
    }

    #[test]
    fn rejection_with_extra_keys_is_malformed() {
        assert!(matches!(
            err(
                r#"<execution_result>{"error_tool_call": {"code": "x", "message": "m"}, "ok": 1}</execution_result>"#
            ),
            SimFormatError::MalformedRejection { .. }
        ));
    }

    #[test]
    fn rejection_that_is_a_string_is_malformed() {
        assert!(matches!(
            err(r#"<execution_result>{"error_tool_call": "nope"}</execution_result>"#),
            SimFormatError::MalformedRejection { .. }
        ));
    }

    #[test]
    fn tool_level_error_object_is_a_normal_result() {
        let t = ok(
            r#"<execution_result>{"error": {"code": "insufficient_funds", "message": "m"}}</execution_result>"#,
        );
        assert!(matches!(t.output, SimOutput::Result { .. }));
    }

    #[test]
    fn missing_block_fails() {
        assert_eq!(err("{\"a\": 1}"), SimFormatError::MissingResult);
        assert_eq!(err(""), SimFormatError::MissingResult);
    }

    #[test]
    fn unclosed_block_fails() {
        assert_eq!(
            err("<execution_result>{\"a\": 1}"),
            SimFormatError::UnclosedResult
        );
    }

    #[test]
    fn unclosed_think_fails() {
        assert_eq!(
            err("<think>hm <execution_result>{\"a\":1}</execution_result>"),
            SimFormatError::UnclosedThink
        );
    }

    #[test]
    fn text_before_block_fails() {
        assert!(matches!(
            err("Sure! <execution_result>{\"a\":1}</execution_result>"),
            SimFormatError::TextOutsideResult { .. }
        ));
        assert!(matches!(
            err("hi <think>x</think><execution_result>{\"a\":1}</execution_result>"),
            SimFormatError::TextOutsideResult { .. }
        ));
    }

    #[test]
    fn text_after_block_fails() {
        assert_eq!(
            err("<execution_result>{\"a\":1}</execution_result> done"),
            SimFormatError::TextOutsideResult {
                text: "done".into()
            }
        );
    }

    #[test]
    fn two_blocks_fail() {
        assert_eq!(
            err(
                "<execution_result>{\"a\":1}</execution_result><execution_result>{\"b\":1}</execution_result>"
            ),
            SimFormatError::MultipleResults
        );
    }

    #[test]
    fn single_quotes_are_not_repaired() {
        assert!(matches!(
            err("<execution_result>{'a': 1}</execution_result>"),
            SimFormatError::InvalidJson { .. }
        ));
    }

    #[test]
    fn scalars_and_empties_fail() {
        assert_eq!(
            err("<execution_result>42</execution_result>"),
            SimFormatError::NotObjectOrArray
        );
        assert_eq!(
            err("<execution_result>\"ok\"</execution_result>"),
            SimFormatError::NotObjectOrArray
        );
        assert_eq!(
            err("<execution_result>{}</execution_result>"),
            SimFormatError::EmptyResult
        );
        assert_eq!(
            err("<execution_result>[]</execution_result>"),
            SimFormatError::EmptyResult
        );
    }

    #[test]
    fn truncated_json_fails() {
        assert!(matches!(
            err("<execution_result>{\"a\": [1, 2</execution_result>"),
            SimFormatError::InvalidJson { .. }
        ));
    }
}
