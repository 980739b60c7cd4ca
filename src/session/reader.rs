//! Tolerant session reader. A truncated last line (the writer was killed mid-line) is a
//! warning, not a failure; a corrupt line anywhere else is an error naming its line number.
//! Validation: a known header, strictly increasing `seq`, unique `id`s, and every `parent`
//! naming an earlier event.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::SessionError;
use super::schema::{EventRecord, FORMAT_VERSION, SESSION_FORMAT, SessionHeader};

/// Something odd but recoverable found while reading.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "warning", rename_all = "snake_case")]
pub enum ReadWarning {
    /// The last line is incomplete (the writer stopped mid-line); it was dropped.
    TruncatedLastLine { line: usize, bytes: usize },
    /// The last line parsed but has no final newline.
    MissingFinalNewline { line: usize },
}

impl std::fmt::Display for ReadWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TruncatedLastLine { line, bytes } => {
                write!(
                    f,
                    "line {line}: truncated last line ({bytes} bytes) dropped"
                )
            }
            Self::MissingFinalNewline { line } => write!(f, "line {line}: no final newline"),
        }
    }
}

/// A session read back from disk.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    pub header: SessionHeader,
    pub events: Vec<EventRecord>,
    pub warnings: Vec<ReadWarning>,
}

impl Session {
    /// The event with this id.
    pub fn event(&self, id: &str) -> Option<&EventRecord> {
        self.events.iter().find(|e| e.id == id)
    }
}

/// Read and validate a session file.
pub fn read_session(path: impl AsRef<Path>) -> Result<Session, SessionError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| SessionError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse_session(&bytes, &path.display().to_string())
}

/// Parse session bytes (`origin` names the source in errors). Total: never panics.
pub fn parse_session(bytes: &[u8], origin: &str) -> Result<Session, SessionError> {
    let mut warnings = Vec::new();
    let ends_with_newline = bytes.last() == Some(&b'\n');
    let mut lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    if ends_with_newline {
        lines.pop();
    }
    let count = lines.len();
    if count == 0 || bytes.is_empty() {
        return Err(SessionError::Empty {
            path: origin.to_string(),
        });
    }
    let corrupt = |line: usize, message: String| SessionError::Corrupt {
        path: origin.to_string(),
        line,
        message,
    };

    // Header.
    let header_text = std::str::from_utf8(lines[0]).map_err(|e| corrupt(1, e.to_string()));
    let header: SessionHeader = match header_text
        .and_then(|t| serde_json::from_str(t).map_err(|e| corrupt(1, e.to_string())))
    {
        Ok(h) => h,
        Err(e) => {
            if count == 1 && !ends_with_newline {
                return Err(SessionError::TruncatedHeader {
                    path: origin.to_string(),
                });
            }
            return Err(e);
        }
    };
    if header.format != SESSION_FORMAT {
        return Err(corrupt(
            1,
            format!("format is `{}`, expected `{SESSION_FORMAT}`", header.format),
        ));
    }
    if header.format_version > FORMAT_VERSION {
        return Err(corrupt(
            1,
            format!(
                "format version {} is newer than this envace reads ({FORMAT_VERSION})",
                header.format_version
            ),
        ));
    }

    let mut events: Vec<EventRecord> = Vec::with_capacity(count.saturating_sub(1));
    let mut ids: HashSet<String> = HashSet::new();
    let mut last_seq: Option<u64> = None;
    for (i, raw) in lines.iter().enumerate().skip(1) {
        let line_no = i + 1;
        let is_last = i + 1 == count;
        let parsed = std::str::from_utf8(raw)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<EventRecord>(t).map_err(|e| e.to_string()));
        let record = match parsed {
            Ok(r) => r,
            Err(message) => {
                if is_last && !ends_with_newline {
                    warnings.push(ReadWarning::TruncatedLastLine {
                        line: line_no,
                        bytes: raw.len(),
                    });
                    break;
                }
                return Err(corrupt(line_no, message));
            }
        };
        if is_last && !ends_with_newline {
            warnings.push(ReadWarning::MissingFinalNewline { line: line_no });
        }
        let invalid = |message: String| SessionError::Invalid {
            path: origin.to_string(),
            line: line_no,
            message,
        };
        if let Some(prev) = last_seq
            && record.seq <= prev
        {
            return Err(invalid(format!(
                "seq {} does not increase (previous {prev})",
                record.seq
            )));
        }
        if let Some(p) = &record.parent
            && !ids.contains(p)
        {
            return Err(invalid(format!("parent `{p}` is not an earlier event")));
        }
        if !ids.insert(record.id.clone()) {
            return Err(invalid(format!("duplicate id `{}`", record.id)));
        }
        last_seq = Some(record.seq);
        events.push(record);
    }
    Ok(Session {
        header,
        events,
        warnings,
    })
}

/// Remove the volatile `ts` field from every line of a session file's text, so two recordings
/// of the same seed, model and task compare equal.
pub fn strip_timestamps(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(serde_json::Value::Object(mut o)) => {
                o.shift_remove("ts");
                out.push_str(&serde_json::Value::Object(o).to_string());
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}
