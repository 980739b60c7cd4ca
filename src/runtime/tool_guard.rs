//! Tool-name constrained decoding: while the model writes the `"name"` of a tool call, only
//! tokens that keep the name a prefix of a listed tool's name can be drawn. A small model that
//! knows it must call *something* often writes the request's verb (`create_file`,
//! `get_card`) instead of reading the list; a name the environment does not have is a wasted
//! turn at best. The same idea as the guided decoding of vLLM/SGLang (`tool_choice`) and
//! llama.cpp's grammars, for the one field that decides which tool runs.
//!
//! Only the call-level name is guarded: a `<tool_call>` block's top-level object (or an
//! object in a top-level list, SmolLM2's own format), never a `"name"` inside the arguments.
//! Arguments, prose and thinking are left free.

use std::sync::Arc;

/// The tags around a Hermes/Qwen tool call (the actor parser reads the same ones).
pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

/// What the guard needs: the allowed names and each token's text.
#[derive(Debug, Clone)]
pub struct ToolNameGuard {
    /// Each allowed name as it is written inside a JSON string, followed by the closing quote.
    targets: Vec<String>,
    pieces: Arc<Vec<String>>,
}

impl ToolNameGuard {
    /// `names`: the tools the model may call; `pieces[i]`: the text of token `i` on its own
    /// (empty for special tokens, which are never allowed inside a name).
    pub fn new(names: &[String], pieces: Arc<Vec<String>>) -> Self {
        let targets = names
            .iter()
            .map(|n| {
                let quoted = serde_json::to_string(n).unwrap_or_else(|_| format!("\"{n}\""));
                quoted[1..].to_string()
            })
            .collect();
        Self { targets, pieces }
    }

    /// Set every token that cannot continue the name being written to −∞. `text` is the
    /// response so far. Returns whether anything was masked (false outside a name, or when
    /// what was written is no longer a prefix of any listed name: then the model is left free
    /// rather than forced into a name it did not start).
    pub fn mask(&self, text: &str, logits: &mut [f32]) -> bool {
        let Some(typed) = open_name(text) else {
            return false;
        };
        let rests: Vec<&str> = self
            .targets
            .iter()
            .filter_map(|t| t.strip_prefix(typed))
            .collect();
        if rests.is_empty() {
            return false;
        }
        let allowed =
            |p: &str| !p.is_empty() && rests.iter().any(|r| r.starts_with(p) || p.starts_with(r));
        if !self
            .pieces
            .iter()
            .zip(logits.iter())
            .any(|(p, l)| l.is_finite() && allowed(p))
        {
            return false;
        }
        for (p, l) in self.pieces.iter().zip(logits.iter_mut()) {
            if !allowed(p) {
                *l = f32::NEG_INFINITY;
            }
        }
        // Tokens past the piece table (none in practice) cannot be checked: never allowed.
        for l in logits.iter_mut().skip(self.pieces.len()) {
            *l = f32::NEG_INFINITY;
        }
        true
    }
}

/// The part of a call-level `"name"` string written so far, when `text` ends inside one (in an
/// open `<tool_call>` block); `None` anywhere else.
pub fn open_name(text: &str) -> Option<&str> {
    let start = text.rfind(OPEN)? + OPEN.len();
    let block = &text[start..];
    if block.contains(CLOSE) {
        return None;
    }
    // A minimal JSON scanner: container stack, string state, the last key of each object.
    let mut stack: Vec<u8> = Vec::new();
    let mut expect_key = false;
    let mut last_key: Option<(usize, usize)> = None;
    // (start of the string's content, is it a key, is it a call-level name value)
    let mut string: Option<(usize, bool, bool)> = None;
    let mut escaped = false;
    let bytes = block.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if let Some((s, is_key, _)) = string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                if is_key {
                    last_key = Some((s, i));
                }
                string = None;
            }
            continue;
        }
        match b {
            b'{' => {
                stack.push(b'{');
                expect_key = true;
                last_key = None;
            }
            b'[' => {
                stack.push(b'[');
                expect_key = false;
            }
            b'}' | b']' => {
                stack.pop();
                expect_key = false;
            }
            b',' => expect_key = stack.last() == Some(&b'{'),
            b':' => expect_key = false,
            b'"' => {
                let in_object = stack.last() == Some(&b'{');
                let is_key = in_object && expect_key;
                let call_level = matches!(stack.as_slice(), [b'{'] | [b'[', b'{']);
                let is_name = !is_key
                    && in_object
                    && call_level
                    && last_key.is_some_and(|(a, z)| &block[a..z] == "name");
                string = Some((i + 1, is_key, is_name));
            }
            _ => {}
        }
    }
    match string {
        Some((s, false, true)) => Some(&block[s..]),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_call_level_name_being_written() {
        assert_eq!(open_name("<tool_call>\n{\"name\": \"tra"), Some("tra"));
        assert_eq!(open_name("<tool_call>{\"name\":\""), Some(""));
        assert_eq!(
            open_name("<tool_call>[{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b"),
            Some("b")
        );
        // Closed name, arguments, other keys, nested names, closed blocks, prose.
        assert_eq!(open_name("<tool_call>{\"name\": \"transfer\""), None);
        assert_eq!(
            open_name("<tool_call>{\"name\": \"x\", \"arguments\": {\"name\": \"Sv"),
            None
        );
        assert_eq!(
            open_name("<tool_call>{\"name\": \"x\", \"arguments\": {\"to\": \"Sv"),
            None
        );
        assert_eq!(
            open_name("<tool_call>{\"name\": \"x\", \"arguments\": {\"entities\": [{\"name\": \"a"),
            None
        );
        assert_eq!(
            open_name("<tool_call>{\"arguments\": {}, \"name\": \"pa"),
            Some("pa")
        );
        assert_eq!(
            open_name("<tool_call>{\"name\": \"a\"}</tool_call> {\"name\": \"b"),
            None
        );
        assert_eq!(open_name("{\"name\": \"b"), None);
        // An escaped quote does not close the string.
        assert_eq!(open_name("<tool_call>{\"name\": \"a\\\"b"), Some("a\\\"b"));
        // A key that merely contains "name" is not it.
        assert_eq!(open_name("<tool_call>{\"username\": \"bo"), None);
    }

    fn pieces(v: &[&str]) -> Arc<Vec<String>> {
        Arc::new(v.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn masks_tokens_that_leave_every_listed_name() {
        let p = pieces(&[
            "get",
            "_card",
            "_balance",
            "block",
            "\"",
            "\",",
            "get_balance\"",
            "",
            "x",
        ]);
        let g = ToolNameGuard::new(&["get_balance".into(), "block_card".into()], p.clone());
        let allowed = |text: &str| {
            let mut l = vec![0.0f32; p.len()];
            let masked = g.mask(text, &mut l);
            let ok: Vec<&str> = p
                .iter()
                .zip(&l)
                .filter(|(_, l)| l.is_finite())
                .map(|(s, _)| s.as_str())
                .collect();
            (masked, ok)
        };
        assert_eq!(
            allowed("<tool_call>{\"name\": \""),
            (true, vec!["get", "block", "get_balance\""])
        );
        assert_eq!(
            allowed("<tool_call>{\"name\": \"get"),
            (true, vec!["_balance"])
        );
        assert_eq!(
            allowed("<tool_call>{\"name\": \"get_balance"),
            (true, vec!["\"", "\","])
        );
        // Off the list already (a token the table did not predict): left free.
        let (masked, ok) = allowed("<tool_call>{\"name\": \"zzz");
        assert!(!masked);
        assert_eq!(ok.len(), p.len());
        // Outside a name: nothing masked.
        assert!(!allowed("<tool_call>{\"name\": \"get_balance\", \"arguments\": {\"").0);
        assert!(!allowed("I will check.").0);
    }

    #[test]
    fn names_with_json_escapes_are_matched_as_written() {
        let p = pieces(&["a\\\"b\"", "a\"b\""]);
        let g = ToolNameGuard::new(&["a\"b".into()], p);
        let mut l = vec![0.0f32; 2];
        assert!(g.mask("<tool_call>{\"name\": \"", &mut l));
        assert!(l[0].is_finite() && l[1] == f32::NEG_INFINITY);
    }
}
