//! Sessions: nothing lost. An append-only JSONL record of one episode (see [`schema`] for the
//! format), written one flushed line per event ([`SessionWriter`]), read back tolerantly
//! ([`read_session`]: a truncated last line is a warning), rebuilt into the episode tree with its
//! rehearsal branches ([`SessionTree`]), replayed as text and exported to OpenAI chat JSONL.
//! For a sessions browser: one-line summaries streamed from large files ([`index`]) and
//! progressive loading with progress and cancellation ([`read_session_with_progress`]).
//!
//! This module does no scoring and runs no model. It is the leaf of the dependency graph: it
//! owns the file format, including every plain data type a line holds ([`format`]), and
//! depends on nothing in the crate but `message` (and the runtime's cancel token for
//! progressive reading). The engine, the environments and the trainer depend on it, never the
//! other way round.

pub mod export;
pub mod format;
pub mod index;
pub mod reader;
pub mod rows;
pub mod schema;
pub mod synth;
pub mod tree;
pub mod writer;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use export::{
    ExportOptions, export_openai, openai_message, openai_records, render_replay, replay_text,
};
pub use index::{SessionSummary, SortKey, filter, scan_dir, sort, summarize};
pub use reader::{
    PROGRESS_STEP, ReadWarning, Session, parse_session, read_session, read_session_with_progress,
    strip_timestamps,
};
pub use rows::{TrainingRow, training_rows};
pub use schema::{
    EventBody, EventRecord, FORMAT_VERSION, ForkOrigin, GenerationRecord, ModelRef, NewEvent,
    SESSION_FORMAT, SessionHeader,
};
pub use tree::{BranchRef, BranchTracker, BranchView, SessionTree};
pub use writer::{EventSink, MemorySink, SessionWriter};

/// Errors reading or writing sessions; each names the file and, where it applies, the line.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: empty session file")]
    Empty { path: String },
    #[error("{path}: the header line is truncated (the writer stopped before finishing it)")]
    TruncatedHeader { path: String },
    #[error("{path}: line {line}: corrupt: {message}")]
    Corrupt {
        path: String,
        line: usize,
        message: String,
    },
    #[error("{path}: line {line}: invalid: {message}")]
    Invalid {
        path: String,
        line: usize,
        message: String,
    },
    #[error("serialising an event: {0}")]
    Json(#[from] serde_json::Error),
    #[error("no data directory for sessions on this system; pass an explicit path")]
    NoDataDir,
    #[error("{path}: reading cancelled")]
    Cancelled { path: String },
}

/// The default sessions directory: `<data dir>/sessions` of `ProjectDirs("dev","envace","envace")`.
pub fn default_sessions_dir() -> Option<PathBuf> {
    directories::ProjectDirs::from("dev", "envace", "envace").map(|d| d.data_dir().join("sessions"))
}

/// A file name for a new session: `<env>-<task>-s<seed>-<UTC time>.jsonl` (unsafe characters
/// replaced by `_`).
pub fn session_file_name(environment: &str, task_id: Option<&str>, seed: u64) -> String {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    };
    let stamp = chrono::Utc::now().format("%Y%m%d-%H%M%S%.3f");
    format!(
        "{}-{}-s{seed}-{stamp}.jsonl",
        clean(environment),
        clean(task_id.unwrap_or("none"))
    )
}

/// `explicit` if given, else a fresh file under [`default_sessions_dir`].
pub fn resolve_session_path(
    explicit: Option<PathBuf>,
    environment: &str,
    task_id: Option<&str>,
    seed: u64,
) -> Result<PathBuf, SessionError> {
    match explicit {
        Some(p) => Ok(p),
        None => default_sessions_dir()
            .map(|d| d.join(session_file_name(environment, task_id, seed)))
            .ok_or(SessionError::NoDataDir),
    }
}
