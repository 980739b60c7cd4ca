//! Small, dependency-free JSON helpers for the tolerant actor parser: find a balanced JSON value
//! inside surrounding text, and repair the Python-flavoured JSON that small models write
//! (single quotes, `True`/`False`/`None`, trailing commas). Every repair is reported back so the
//! caller can record it; nothing here is silent. The strict simulator parser does not use the
//! repairs, only plain `serde_json`.

use serde_json::Value;

/// A repair applied by [`repair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    SingleQuotes,
    PythonLiterals,
    TrailingComma,
}

/// Byte range `[start, end)` of the first balanced `{…}` or `[…]` starting at or after `from`,
/// skipping over string literals (double- or single-quoted). `None` when no opening bracket
/// exists or it never closes.
pub fn balanced_span(text: &str, from: usize, open: u8) -> Option<(usize, usize)> {
    let bytes = text.as_bytes();
    let start = from + bytes.get(from..)?.iter().position(|&b| b == open)?;
    balanced_end(bytes, start).map(|end| (start, end))
}

/// End (exclusive) of the balanced value that starts with the bracket at `start`.
pub fn balanced_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut stack: Vec<u8> = Vec::new();
    let mut i = start;
    let mut quote: Option<u8> = None;
    while i < bytes.len() {
        let b = bytes[i];
        if let Some(q) = quote {
            if b == b'\\' {
                i += 2;
                continue;
            }
            if b == q {
                quote = None;
            }
        } else {
            match b {
                b'"' | b'\'' => quote = Some(b),
                b'{' => stack.push(b'}'),
                b'[' => stack.push(b']'),
                b'}' | b']' => {
                    if stack.pop() != Some(b) {
                        return None;
                    }
                    if stack.is_empty() {
                        return Some(i + 1);
                    }
                }
                _ => {}
            }
        }
        i += 1;
    }
    None
}

/// Rewrite Python-ish JSON into JSON: single-quoted strings become double-quoted, bare
/// `True`/`False`/`None` become `true`/`false`/`null`, and commas before `}`/`]` are dropped.
/// Returns the rewritten text and the repairs that actually changed something.
pub fn repair(text: &str) -> (String, Vec<Repair>) {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut repairs = Vec::new();
    let note = |r: Repair, repairs: &mut Vec<Repair>| {
        if !repairs.contains(&r) {
            repairs.push(r);
        }
    };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' => {
                // Copy a double-quoted string verbatim.
                out.push(c);
                i += 1;
                while i < chars.len() {
                    let d = chars[i];
                    out.push(d);
                    i += 1;
                    if d == '\\' {
                        if let Some(&e) = chars.get(i) {
                            out.push(e);
                            i += 1;
                        }
                    } else if d == '"' {
                        break;
                    }
                }
            }
            '\'' => {
                note(Repair::SingleQuotes, &mut repairs);
                out.push('"');
                i += 1;
                while i < chars.len() {
                    let d = chars[i];
                    i += 1;
                    match d {
                        '\\' => match chars.get(i) {
                            Some('\'') => {
                                out.push('\'');
                                i += 1;
                            }
                            Some(&e) => {
                                out.push('\\');
                                out.push(e);
                                i += 1;
                            }
                            None => out.push_str("\\\\"),
                        },
                        '"' => out.push_str("\\\""),
                        '\'' => break,
                        _ => out.push(d),
                    }
                }
                out.push('"');
            }
            ',' => {
                let mut j = i + 1;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                if matches!(chars.get(j), Some('}') | Some(']')) {
                    note(Repair::TrailingComma, &mut repairs);
                } else {
                    out.push(c);
                }
                i += 1;
            }
            c if c.is_ascii_alphabetic() => {
                let mut j = i;
                while j < chars.len() && (chars[j].is_ascii_alphanumeric() || chars[j] == '_') {
                    j += 1;
                }
                let word: String = chars[i..j].iter().collect();
                match word.as_str() {
                    "True" => {
                        note(Repair::PythonLiterals, &mut repairs);
                        out.push_str("true");
                    }
                    "False" => {
                        note(Repair::PythonLiterals, &mut repairs);
                        out.push_str("false");
                    }
                    "None" => {
                        note(Repair::PythonLiterals, &mut repairs);
                        out.push_str("null");
                    }
                    _ => out.push_str(&word),
                }
                i = j;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    (out, repairs)
}

/// Parse strictly, else after [`repair`]. Returns the value and the repairs used (empty when the
/// text was valid JSON already), or serde's message for the repaired text.
pub fn parse_lenient(text: &str) -> Result<(Value, Vec<Repair>), String> {
    match serde_json::from_str::<Value>(text) {
        Ok(v) => Ok((v, Vec::new())),
        Err(strict_err) => {
            let (fixed, repairs) = repair(text);
            if repairs.is_empty() {
                return Err(strict_err.to_string());
            }
            serde_json::from_str::<Value>(&fixed)
                .map(|v| (v, repairs))
                .map_err(|e| e.to_string())
        }
    }
}

/// Remove a surrounding Markdown code fence (```json … ```), if any. Returns the inner text and
/// whether a fence was removed.
pub fn strip_code_fence(text: &str) -> (&str, bool) {
    let t = text.trim();
    if let Some(rest) = t.strip_prefix("```") {
        let rest = rest.trim_start_matches(|c: char| c.is_ascii_alphanumeric());
        let inner = rest.strip_suffix("```").unwrap_or(rest);
        return (inner.trim(), true);
    }
    (t, false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn balanced_span_skips_brackets_inside_strings() {
        let t = r#"x {"a": "}{", "b": [1, {"c": 2}]} tail"#;
        let (s, e) = balanced_span(t, 0, b'{').expect("span");
        assert_eq!(&t[s..e], r#"{"a": "}{", "b": [1, {"c": 2}]}"#);
    }

    #[test]
    fn balanced_span_is_none_for_unclosed_object() {
        assert_eq!(balanced_span(r#"{"a": {"b": 1}"#, 0, b'{'), None);
    }

    #[test]
    fn repair_converts_python_dict() {
        let (v, r) = parse_lenient("{'a': True, 'b': None, 'c': [1, 2,], 'd': \"it's\"}")
            .expect("repairable");
        assert_eq!(v, json!({"a": true, "b": null, "c": [1, 2], "d": "it's"}));
        assert_eq!(
            r,
            vec![
                Repair::SingleQuotes,
                Repair::PythonLiterals,
                Repair::TrailingComma
            ]
        );
    }

    #[test]
    fn repair_keeps_words_inside_strings() {
        let (v, r) =
            parse_lenient(r#"{'msg': 'True story, None left', 'q': "a\"b"}"#).expect("repairable");
        assert_eq!(v, json!({"msg": "True story, None left", "q": "a\"b"}));
        assert_eq!(r, vec![Repair::SingleQuotes]);
    }

    #[test]
    fn repair_escapes_double_quotes_inside_single_quoted_strings() {
        let (v, _) = parse_lenient(r#"{'say': 'he said "hi"', 'x': 'don\'t'}"#).expect("ok");
        assert_eq!(v, json!({"say": "he said \"hi\"", "x": "don't"}));
    }

    #[test]
    fn valid_json_reports_no_repair() {
        let (_, r) = parse_lenient(r#"{"a": 1}"#).expect("valid");
        assert!(r.is_empty());
    }

    #[test]
    fn unrepairable_text_is_an_error() {
        assert!(parse_lenient("{a: 1").is_err());
    }

    #[test]
    fn code_fence_is_stripped() {
        assert_eq!(
            strip_code_fence("```json\n{\"a\":1}\n```"),
            ("{\"a\":1}", true)
        );
        assert_eq!(strip_code_fence(" {} "), ("{}", false));
    }
}
