//! The sessions browser's index: one [`SessionSummary`] per file, built by streaming the file
//! line by line ([`summarize`]), a directory scan that reports bad files instead of stopping
//! ([`scan_dir`]), and sorting and filtering for the list view.
//!
//! A summary is cheap by design: it never holds the whole file, and parses only the header and,
//! of each event line, the `id`, `parent` and `type` prefix the writer puts first (falling back
//! to a light JSON parse for lines written in another key order). Only `reward` and
//! `episode_end` lines on the main line are parsed further. It does not validate the session:
//! that is [`read_session`](super::read_session)'s job when the file is opened.

use std::cmp::Ordering;
use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::Deserialize;

use super::SessionError;
use super::reader::check_header;
use super::schema::{ForkOrigin, SessionHeader};

/// One session file, as the browser lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionSummary {
    pub path: PathBuf,
    /// File modification time, where the file system has one.
    pub modified: Option<SystemTime>,
    /// File size.
    pub bytes: u64,
    /// The header's creation time (RFC 3339), absent in sessions written without timestamps.
    pub created: Option<String>,
    pub environment: String,
    pub task_id: Option<String>,
    /// `real`, `rehearse` or `shadow`.
    pub mode: String,
    /// The model's path as recorded in the header.
    pub model: String,
    /// Main-line actor turns: `actor_parsed` events outside every rehearsal branch (an event is
    /// in a branch when a `branch_start` is among its ancestors, exactly as
    /// [`SessionTree`](super::SessionTree) decides). A Private Rehearsal's proposal and its commit
    /// count as two.
    pub steps: usize,
    /// Event lines (the header and a truncated last line excluded).
    pub events: usize,
    /// The last main-line reward; `None` for unscored (aborted, unfinished) episodes.
    pub reward: Option<f64>,
    /// The main-line end reason's name (`answered`, `turn_limit`, …); `None` while unfinished.
    pub end: Option<String>,
    pub forked_from: Option<ForkOrigin>,
    /// The last line was cut short (the writer was killed mid-line).
    pub truncated: bool,
}

impl SessionSummary {
    /// The file name, for display and filtering.
    pub fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// When the session was recorded: the header's time, else the file's modification time.
    pub fn date(&self) -> Option<SystemTime> {
        self.created
            .as_deref()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(SystemTime::from)
            .or(self.modified)
    }
}

/// Summarise one session file without loading it.
pub fn summarize(path: &Path) -> Result<SessionSummary, SessionError> {
    let origin = path.display().to_string();
    let io = |source| SessionError::Io {
        path: origin.clone(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    let mut reader = BufReader::with_capacity(256 * 1024, file);
    let corrupt = |line: usize, message: String| SessionError::Corrupt {
        path: origin.clone(),
        line,
        message,
    };

    let mut buf = Vec::new();
    if reader.read_until(b'\n', &mut buf).map_err(io)? == 0 {
        return Err(SessionError::Empty {
            path: origin.clone(),
        });
    }
    let terminated = buf.last() == Some(&b'\n');
    let header: SessionHeader = match std::str::from_utf8(trim_newline(&buf))
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(t).map_err(|e| e.to_string()))
    {
        Ok(h) => h,
        Err(_) if !terminated => {
            return Err(SessionError::TruncatedHeader {
                path: origin.clone(),
            });
        }
        Err(m) => return Err(corrupt(1, m)),
    };
    check_header(&header).map_err(|m| corrupt(1, m))?;

    let mut s = SessionSummary {
        path: path.to_path_buf(),
        modified: meta.modified().ok(),
        bytes: meta.len(),
        created: header.ts.clone(),
        environment: header.environment.clone(),
        task_id: header.task_id.clone(),
        mode: header.mode.clone(),
        model: header.model.path.clone(),
        steps: 0,
        events: 0,
        reward: None,
        end: None,
        forked_from: header.forked_from.clone(),
        truncated: false,
    };
    // Ids of events inside rehearsal branches (the main line is the default, so only these
    // need remembering).
    let mut in_branch: HashSet<String> = HashSet::new();
    let mut line = 1;
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf).map_err(io)? == 0 {
            break;
        }
        line += 1;
        let terminated = buf.last() == Some(&b'\n');
        let raw = trim_newline(&buf);
        // A last line without a newline may be cut anywhere: only a full parse vouches for it.
        let head = if terminated { fast_head(raw) } else { None };
        let head = match head {
            Some(h) => h,
            None => match light_head(raw) {
                Ok(h) => h,
                Err(_) if !terminated => {
                    s.truncated = true;
                    break;
                }
                Err(m) => return Err(corrupt(line, m)),
            },
        };
        s.events += 1;
        let branch = head
            .parent
            .as_deref()
            .is_some_and(|p| in_branch.contains(p))
            || (head.kind == "branch_start" && head.parent.is_some());
        if branch {
            in_branch.insert(head.id.into_owned());
            continue;
        }
        match head.kind.as_ref() {
            "actor_parsed" => s.steps += 1,
            "reward" => {
                let r: RewardLine = parse_line(raw).map_err(|m| corrupt(line, m))?;
                s.reward = Some(r.event.reward);
            }
            "episode_end" => {
                let e: EndLine = parse_line(raw).map_err(|m| corrupt(line, m))?;
                s.end = Some(e.event.reason.reason);
            }
            _ => {}
        }
    }
    Ok(s)
}

/// Summarise every `*.jsonl` file directly in `dir` (not recursive), in file-name order. Files
/// that cannot be summarised are returned with their error; a scan never stops early.
pub fn scan_dir(dir: &Path) -> (Vec<SessionSummary>, Vec<(PathBuf, SessionError)>) {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(source) => {
            let err = SessionError::Io {
                path: dir.display().to_string(),
                source,
            };
            return (Vec::new(), vec![(dir.to_path_buf(), err)]);
        }
    };
    let mut bad = Vec::new();
    let mut paths = Vec::new();
    for entry in entries {
        match entry {
            Ok(e) => {
                let p = e.path();
                // `is_file` follows symlinks.
                if p.extension().is_some_and(|x| x == "jsonl") && p.is_file() {
                    paths.push(p);
                }
            }
            Err(source) => bad.push((
                dir.to_path_buf(),
                SessionError::Io {
                    path: dir.display().to_string(),
                    source,
                },
            )),
        }
    }
    paths.sort();
    let mut good = Vec::with_capacity(paths.len());
    for p in paths {
        match summarize(&p) {
            Ok(s) => good.push(s),
            Err(e) => bad.push((p, e)),
        }
    }
    (good, bad)
}

/// What the list can be sorted by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    /// [`SessionSummary::date`].
    Date,
    Environment,
    Task,
    Mode,
    Steps,
    Reward,
}

/// Sort in place. Missing values (no date, no task, unscored) always come last, in either
/// direction; ties keep file-name order.
pub fn sort(v: &mut [SessionSummary], key: SortKey, descending: bool) {
    v.sort_by(|a, b| {
        let primary = match key {
            SortKey::Date => cmp_missing_last(a.date(), b.date(), descending),
            SortKey::Environment => directed(
                a.environment
                    .to_lowercase()
                    .cmp(&b.environment.to_lowercase()),
                descending,
            ),
            SortKey::Task => cmp_missing_last(
                a.task_id.as_deref().map(str::to_lowercase),
                b.task_id.as_deref().map(str::to_lowercase),
                descending,
            ),
            SortKey::Mode => directed(a.mode.cmp(&b.mode), descending),
            SortKey::Steps => directed(a.steps.cmp(&b.steps), descending),
            SortKey::Reward => cmp_missing_last(a.reward, b.reward, descending),
        };
        primary.then_with(|| a.path.cmp(&b.path))
    });
}

/// The summaries matching `query`: every whitespace-separated term must occur
/// (case-insensitively) in the environment, task id, mode, model or file name. An empty query
/// matches everything.
pub fn filter<'a>(v: &'a [SessionSummary], query: &str) -> Vec<&'a SessionSummary> {
    let terms: Vec<String> = query.split_whitespace().map(str::to_lowercase).collect();
    v.iter()
        .filter(|s| {
            let fields = [
                s.environment.to_lowercase(),
                s.task_id.as_deref().unwrap_or_default().to_lowercase(),
                s.mode.to_lowercase(),
                s.model.to_lowercase(),
                s.file_name().to_lowercase(),
            ];
            terms
                .iter()
                .all(|t| fields.iter().any(|f| f.contains(t.as_str())))
        })
        .collect()
}

// ---- helpers ------------------------------------------------------------------------------

fn directed(o: Ordering, descending: bool) -> Ordering {
    if descending { o.reverse() } else { o }
}

fn cmp_missing_last<T: PartialOrd>(a: Option<T>, b: Option<T>, descending: bool) -> Ordering {
    match (a, b) {
        (Some(x), Some(y)) => directed(x.partial_cmp(&y).unwrap_or(Ordering::Equal), descending),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
}

fn trim_newline(buf: &[u8]) -> &[u8] {
    buf.strip_suffix(b"\n").unwrap_or(buf)
}

/// The fields of an event line the index needs.
struct Head<'a> {
    id: std::borrow::Cow<'a, str>,
    parent: Option<std::borrow::Cow<'a, str>>,
    kind: std::borrow::Cow<'a, str>,
}

/// The writer's own layout, `{"seq":N,"id":"…","parent":…,("ts":"…",)"event":{"type":"…"`,
/// read without a JSON parser; `None` for anything else (escapes included).
fn fast_head(line: &[u8]) -> Option<Head<'_>> {
    let mut c = Cursor { s: line, i: 0 };
    c.lit(b"{\"seq\":")?;
    c.digits()?;
    c.lit(b",\"id\":")?;
    let id = c.plain_string()?;
    c.lit(b",\"parent\":")?;
    let parent = if c.lit(b"null").is_some() {
        None
    } else {
        Some(c.plain_string()?)
    };
    if c.lit(b",\"ts\":").is_some() {
        c.plain_string()?;
    }
    c.lit(b",\"event\":{\"type\":")?;
    let kind = c.plain_string()?;
    Some(Head {
        id: id.into(),
        parent: parent.map(Into::into),
        kind: kind.into(),
    })
}

struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn lit(&mut self, l: &[u8]) -> Option<()> {
        let rest = self.s.get(self.i..)?;
        rest.starts_with(l).then(|| self.i += l.len())
    }
    fn digits(&mut self) -> Option<()> {
        let start = self.i;
        while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
        }
        (self.i > start).then_some(())
    }
    /// A JSON string without escapes.
    fn plain_string(&mut self) -> Option<&'a str> {
        self.lit(b"\"")?;
        let rest = self.s.get(self.i..)?;
        let end = rest.iter().position(|&b| b == b'"' || b == b'\\')?;
        if rest[end] != b'"' {
            return None;
        }
        let text = std::str::from_utf8(&rest[..end]).ok()?;
        self.i += end + 1;
        Some(text)
    }
}

#[derive(Deserialize)]
struct LightRecord {
    id: String,
    #[serde(default)]
    parent: Option<String>,
    event: LightEvent,
}

#[derive(Deserialize)]
struct LightEvent {
    #[serde(rename = "type")]
    kind: String,
}

fn light_head(raw: &[u8]) -> Result<Head<'static>, String> {
    let r: LightRecord = parse_line(raw)?;
    Ok(Head {
        id: r.id.into(),
        parent: r.parent.map(Into::into),
        kind: r.event.kind.into(),
    })
}

#[derive(Deserialize)]
struct RewardLine {
    event: RewardBody,
}

#[derive(Deserialize)]
struct RewardBody {
    reward: f64,
}

#[derive(Deserialize)]
struct EndLine {
    event: EndBody,
}

#[derive(Deserialize)]
struct EndBody {
    reason: EndName,
}

#[derive(Deserialize)]
struct EndName {
    reason: String,
}

fn parse_line<T: for<'de> Deserialize<'de>>(raw: &[u8]) -> Result<T, String> {
    let text = std::str::from_utf8(raw).map_err(|e| e.to_string())?;
    serde_json::from_str(text).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests;
