//! Tolerant session reader. A truncated last line (the writer was killed mid-line) is a
//! warning, not a failure; a corrupt line anywhere else is an error naming its line number.
//! Validation: a known header, strictly increasing `seq`, unique `id`s, and every `parent`
//! naming an earlier event. One streaming implementation serves whole files, byte slices and
//! progressive loading with progress reports and cancellation (large sessions behind a UI).

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::SessionError;
use super::schema::{EventRecord, FORMAT_VERSION, SESSION_FORMAT, SessionHeader};
use crate::cancel::CancelToken;

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

/// How often (in bytes read) [`read_session_with_progress`] reports progress.
pub const PROGRESS_STEP: u64 = 1 << 20;

/// Read and validate a session file.
pub fn read_session(path: impl AsRef<Path>) -> Result<Session, SessionError> {
    read_session_with_progress(path, &mut |_, _| {}, &CancelToken::new())
}

/// [`read_session`] for large files behind a UI: the same validation, warnings and errors, read
/// incrementally; `progress(bytes_done, bytes_total)` is called about every [`PROGRESS_STEP`]
/// bytes and once at the end (with `bytes_done == bytes_total` for a file that did not change
/// while being read); `cancel` is checked before every line and stops the read with
/// [`SessionError::Cancelled`].
pub fn read_session_with_progress(
    path: impl AsRef<Path>,
    progress: &mut dyn FnMut(u64, u64),
    cancel: &CancelToken,
) -> Result<Session, SessionError> {
    let path = path.as_ref();
    let origin = path.display().to_string();
    let io = |source| SessionError::Io {
        path: origin.clone(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let total = file.metadata().map_err(io)?.len();
    let reader = BufReader::with_capacity(256 * 1024, file);
    read_lines(reader, &origin, total, progress, Some(cancel))
}

/// Parse session bytes (`origin` names the source in errors). Total: never panics.
pub fn parse_session(bytes: &[u8], origin: &str) -> Result<Session, SessionError> {
    read_lines(bytes, origin, bytes.len() as u64, &mut |_, _| {}, None)
}

/// The one reading loop behind [`read_session`], [`read_session_with_progress`] and
/// [`parse_session`]: splits on `\n` (a line without one can only be the last) and feeds
/// each line to the [`Validator`].
fn read_lines(
    mut reader: impl BufRead,
    origin: &str,
    total: u64,
    progress: &mut dyn FnMut(u64, u64),
    cancel: Option<&CancelToken>,
) -> Result<Session, SessionError> {
    let mut v = Validator::new(origin);
    let mut buf: Vec<u8> = Vec::new();
    let (mut done, mut reported) = (0u64, 0u64);
    loop {
        if cancel.is_some_and(CancelToken::is_cancelled) {
            return Err(SessionError::Cancelled {
                path: origin.to_string(),
            });
        }
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|source| SessionError::Io {
                path: origin.to_string(),
                source,
            })?;
        if n == 0 {
            break;
        }
        done += n as u64;
        let terminated = buf.last() == Some(&b'\n');
        let raw = if terminated {
            &buf[..buf.len() - 1]
        } else {
            &buf[..]
        };
        if !v.push(raw, terminated)? {
            break;
        }
        if done - reported >= PROGRESS_STEP {
            progress(done, total.max(done));
            reported = done;
        }
    }
    let session = v.finish()?;
    progress(done, total.max(done));
    Ok(session)
}

/// Line-by-line validation: a known header, strictly increasing `seq`, unique `id`s, parents
/// that name earlier events; a bad line is an error naming its number, except an unparseable
/// last line without a final newline (a truncated write), which is a warning.
struct Validator<'o> {
    origin: &'o str,
    line: usize,
    header: Option<SessionHeader>,
    events: Vec<EventRecord>,
    ids: HashSet<String>,
    last_seq: Option<u64>,
    warnings: Vec<ReadWarning>,
}

impl<'o> Validator<'o> {
    fn new(origin: &'o str) -> Self {
        Self {
            origin,
            line: 0,
            header: None,
            events: Vec::new(),
            ids: HashSet::new(),
            last_seq: None,
            warnings: Vec::new(),
        }
    }

    fn corrupt(&self, message: String) -> SessionError {
        SessionError::Corrupt {
            path: self.origin.to_string(),
            line: self.line,
            message,
        }
    }

    fn invalid(&self, message: String) -> SessionError {
        SessionError::Invalid {
            path: self.origin.to_string(),
            line: self.line,
            message,
        }
    }

    /// Take one line (without its `\n`; `terminated` = it had one). `Ok(false)`: stop reading
    /// (a truncated last line was dropped).
    fn push(&mut self, raw: &[u8], terminated: bool) -> Result<bool, SessionError> {
        self.line += 1;
        if self.header.is_none() {
            self.push_header(raw, terminated)?;
            return Ok(true);
        }
        let parsed = std::str::from_utf8(raw)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<EventRecord>(t).map_err(|e| e.to_string()));
        let record = match parsed {
            Ok(r) => r,
            Err(message) => {
                if !terminated {
                    self.warnings.push(ReadWarning::TruncatedLastLine {
                        line: self.line,
                        bytes: raw.len(),
                    });
                    return Ok(false);
                }
                return Err(self.corrupt(message));
            }
        };
        if !terminated {
            self.warnings
                .push(ReadWarning::MissingFinalNewline { line: self.line });
        }
        if let Some(prev) = self.last_seq
            && record.seq <= prev
        {
            return Err(self.invalid(format!(
                "seq {} does not increase (previous {prev})",
                record.seq
            )));
        }
        if let Some(p) = &record.parent
            && !self.ids.contains(p)
        {
            return Err(self.invalid(format!("parent `{p}` is not an earlier event")));
        }
        if !self.ids.insert(record.id.clone()) {
            return Err(self.invalid(format!("duplicate id `{}`", record.id)));
        }
        self.last_seq = Some(record.seq);
        self.events.push(record);
        Ok(true)
    }

    fn push_header(&mut self, raw: &[u8], terminated: bool) -> Result<(), SessionError> {
        let parsed = std::str::from_utf8(raw)
            .map_err(|e| self.corrupt(e.to_string()))
            .and_then(|t| serde_json::from_str(t).map_err(|e| self.corrupt(e.to_string())));
        let header: SessionHeader = match parsed {
            Ok(h) => h,
            // Without a newline the header is the only line: the writer stopped mid-header.
            Err(_) if !terminated => {
                return Err(SessionError::TruncatedHeader {
                    path: self.origin.to_string(),
                });
            }
            Err(e) => return Err(e),
        };
        check_header(&header).map_err(|m| self.corrupt(m))?;
        self.header = Some(header);
        Ok(())
    }

    fn finish(self) -> Result<Session, SessionError> {
        match self.header {
            None => Err(SessionError::Empty {
                path: self.origin.to_string(),
            }),
            Some(header) => Ok(Session {
                header,
                events: self.events,
                warnings: self.warnings,
            }),
        }
    }
}

/// A header this envace can read: the right format, a version not newer than ours.
pub(crate) fn check_header(header: &SessionHeader) -> Result<(), String> {
    if header.format != SESSION_FORMAT {
        return Err(format!(
            "format is `{}`, expected `{SESSION_FORMAT}`",
            header.format
        ));
    }
    if header.format_version > FORMAT_VERSION {
        return Err(format!(
            "format version {} is newer than this envace reads ({FORMAT_VERSION})",
            header.format_version
        ));
    }
    Ok(())
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

#[cfg(test)]
mod tests;
