//! Append-only session writer. Each event becomes one line, written with a single `write_all`
//! of the whole line (newline included) and flushed before `append` returns: a process killed
//! at any moment loses at most the line being written, which the reader then reports as a
//! truncated last line. Also [`EventSink`], the seam the driver persists through, with an
//! in-memory implementation for rollouts and tests.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::SessionError;
use super::schema::{EventRecord, NewEvent, SessionHeader};

/// Where persisted events go.
pub trait EventSink: Send {
    /// Store one event; returns the record as stored (with `seq` and `ts`).
    fn persist(&mut self, event: NewEvent) -> Result<EventRecord, SessionError>;
}

/// Keeps events in memory (rollout collection, tests).
#[derive(Debug, Default)]
pub struct MemorySink {
    pub records: Vec<EventRecord>,
}

impl EventSink for MemorySink {
    fn persist(&mut self, event: NewEvent) -> Result<EventRecord, SessionError> {
        let record = EventRecord {
            seq: self.records.len() as u64 + 1,
            id: event.id,
            parent: event.parent,
            ts: None,
            event: event.event,
        };
        self.records.push(record.clone());
        Ok(record)
    }
}

/// Writes a session file.
#[derive(Debug)]
pub struct SessionWriter {
    file: File,
    path: PathBuf,
    next_seq: u64,
    timestamps: bool,
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

impl SessionWriter {
    /// Create (or truncate) `path`, creating parent directories, and write the header line.
    pub fn create(path: impl AsRef<Path>, header: &SessionHeader) -> Result<Self, SessionError> {
        Self::create_with(path, header, true)
    }

    /// Like [`create`](Self::create); `timestamps = false` leaves `ts` out of every line (tests,
    /// byte-for-byte reproducible sessions).
    pub fn create_with(
        path: impl AsRef<Path>,
        header: &SessionHeader,
        timestamps: bool,
    ) -> Result<Self, SessionError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| SessionError::Io {
            path: path.display().to_string(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .map_err(io)?;
        let mut w = Self {
            file,
            path,
            next_seq: 1,
            timestamps,
        };
        let mut header = header.clone();
        header.ts = timestamps.then(now);
        let line = serde_json::to_string(&header)?;
        w.write_line(line)?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one event (stamped with the next `seq` and, if enabled, `ts`).
    pub fn append(&mut self, event: NewEvent) -> Result<EventRecord, SessionError> {
        let record = EventRecord {
            seq: self.next_seq,
            id: event.id,
            parent: event.parent,
            ts: self.timestamps.then(now),
            event: event.event,
        };
        let line = serde_json::to_string(&record)?;
        self.write_line(line)?;
        self.next_seq += 1;
        Ok(record)
    }

    fn write_line(&mut self, mut line: String) -> Result<(), SessionError> {
        line.push('\n');
        let path = &self.path;
        let io = |source| SessionError::Io {
            path: path.display().to_string(),
            source,
        };
        self.file.write_all(line.as_bytes()).map_err(io)?;
        self.file.flush().map_err(io)
    }
}

impl EventSink for SessionWriter {
    fn persist(&mut self, event: NewEvent) -> Result<EventRecord, SessionError> {
        self.append(event)
    }
}
