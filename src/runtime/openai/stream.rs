//! One branch's streamed answer: server-sent chunks (completions text, chat deltas with
//! reasoning and incremental tool calls, per-token ids and log-probs, the finish reason) folded
//! into the text the engine's parsers read.

use serde_json::{Value, json};

use super::http::short;
use crate::runtime::backend::FinishReason;

#[derive(Debug, Default)]
pub(super) struct Branch {
    pub(super) text: String,
    pub(super) ids: Vec<u32>,
    pub(super) logprobs: Vec<f32>,
    /// Structured tool calls (chat API): (name, arguments text), by index.
    calls: Vec<(String, String)>,
    reasoning_open: bool,
    pub(super) finish: Option<FinishReason>,
    pub(super) done: bool,
}

impl Branch {
    /// Take one streamed (or whole) response object; returns the new text.
    pub(super) fn absorb(&mut self, v: &Value) -> Result<String, String> {
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
            // Usage-only chunks carry no choice.
            if v.get("usage").is_some() || v.get("choices").is_some() {
                return Ok(String::new());
            }
            return Err(format!(
                "malformed response (no `choices`): {}",
                short(&v.to_string())
            ));
        };
        let mut piece = String::new();
        if let Some(t) = choice.get("text").and_then(Value::as_str) {
            piece.push_str(t);
        }
        for key in ["delta", "message"] {
            let Some(m) = choice.get(key) else { continue };
            let reasoning = m
                .get("reasoning_content")
                .or_else(|| m.get("reasoning"))
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !reasoning.is_empty() {
                if !self.reasoning_open {
                    piece.push_str("<think>");
                    self.reasoning_open = true;
                }
                piece.push_str(reasoning);
            }
            if let Some(c) = m.get("content").and_then(Value::as_str)
                && !c.is_empty()
            {
                if self.reasoning_open {
                    piece.push_str("</think>\n");
                    self.reasoning_open = false;
                }
                piece.push_str(c);
            }
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
                for (k, call) in calls.iter().enumerate() {
                    let index = call
                        .get("index")
                        .and_then(Value::as_u64)
                        .map_or(k, |i| i as usize);
                    if self.calls.len() <= index {
                        self.calls.resize(index + 1, Default::default());
                    }
                    let f = call.get("function").unwrap_or(&Value::Null);
                    if let Some(slot) = self.calls.get_mut(index) {
                        if let Some(n) = f.get("name").and_then(Value::as_str) {
                            slot.0.push_str(n);
                        }
                        match f.get("arguments") {
                            Some(Value::String(a)) => slot.1.push_str(a),
                            Some(Value::Object(_)) => {
                                slot.1.push_str(&f["arguments"].to_string());
                            }
                            _ => {}
                        }
                    }
                }
            }
        }
        if let Some(entries) = choice
            .get("logprobs")
            .and_then(|l| l.get("content"))
            .and_then(Value::as_array)
        {
            for e in entries {
                if let Some(lp) = e.get("logprob").and_then(Value::as_f64) {
                    self.logprobs.push(lp as f32);
                }
                if let Some(id) = e.get("id").and_then(Value::as_u64) {
                    self.ids.push(id as u32);
                }
            }
        } else if let Some(lps) = choice
            .get("logprobs")
            .and_then(|l| l.get("token_logprobs"))
            .and_then(Value::as_array)
        {
            self.logprobs
                .extend(lps.iter().filter_map(Value::as_f64).map(|x| x as f32));
        }
        match choice.get("finish_reason").and_then(Value::as_str) {
            Some("length") => self.finish = Some(FinishReason::Length),
            Some(_) => self.finish = Some(FinishReason::Eos),
            None => {}
        }
        self.text.push_str(&piece);
        Ok(piece)
    }

    /// The end of the stream: close an open reasoning block and write structured tool calls as
    /// `<tool_call>` blocks (the format the actor parser reads). Returns the text added.
    pub(super) fn close(&mut self) -> String {
        let mut tail = String::new();
        if self.reasoning_open {
            tail.push_str("</think>\n");
            self.reasoning_open = false;
        }
        for (name, args) in std::mem::take(&mut self.calls) {
            if name.is_empty() {
                continue;
            }
            let arguments = serde_json::from_str::<Value>(&args).unwrap_or(Value::String(args));
            if !self.text.is_empty() || !tail.is_empty() {
                tail.push('\n');
            }
            tail.push_str(&format!(
                "<tool_call>\n{}\n</tool_call>",
                json!({"name": name, "arguments": arguments})
            ));
        }
        self.text.push_str(&tail);
        tail
    }
}

#[cfg(test)]
mod tests {
    // Tests may unwrap: a panic is the failure report.
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn streamed_chat_tool_calls_become_tool_call_blocks() {
        let mut b = Branch::default();
        let chunks = [
            json!({"choices": [{"delta": {"reasoning_content": "need "}}]}),
            json!({"choices": [{"delta": {"reasoning_content": "balance"}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_balance", "arguments": "{\"acc"}}]}}]}),
            json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "ount\": \"chk\"}"}}]}}]}),
            json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
        ];
        for c in &chunks {
            b.absorb(c).unwrap();
        }
        let tail = b.close();
        assert!(tail.starts_with("</think>\n"), "{tail}");
        assert_eq!(
            b.text,
            "<think>need balance</think>\n\n<tool_call>\n{\"name\":\"get_balance\",\"arguments\":{\"account\":\"chk\"}}\n</tool_call>"
        );
        assert_eq!(b.finish, Some(FinishReason::Eos));
    }

    #[test]
    fn completion_chunks_carry_ids_and_logprobs() {
        let mut b = Branch::default();
        b.absorb(&json!({"choices": [{"text": "Hel", "logprobs": {"content": [{"id": 7, "token": "Hel", "logprob": -0.5}]}}]}))
            .unwrap();
        b.absorb(&json!({"choices": [{"text": "lo", "logprobs": {"content": [{"id": 9, "token": "lo", "logprob": -0.25}]}, "finish_reason": "length"}]}))
            .unwrap();
        assert_eq!(b.text, "Hello");
        assert_eq!(b.ids, vec![7, 9]);
        assert_eq!(b.logprobs, vec![-0.5, -0.25]);
        assert_eq!(b.finish, Some(FinishReason::Length));
        assert!(b.absorb(&json!({"object": "x"})).is_err());
        assert_eq!(b.absorb(&json!({"choices": [], "usage": {}})).unwrap(), "");
    }
}
