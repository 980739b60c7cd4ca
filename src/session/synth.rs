//! Synthetic large sessions, for the loader benchmark and the progressive-loading tests: a real
//! session's events repeated, renumbered (`seq`, ids) and re-chained (each copy's root hangs off
//! the previous copy's last event), until the file reaches a target size. The result is a valid
//! session with the event mix of the template (generations, with their token ids and
//! log-probs, dominate the bytes, as in real sessions).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use super::SessionError;
use super::reader::Session;
use super::schema::EventRecord;

/// Write `template` repeated to `out` until it holds at least `target_bytes` (at least one copy).
/// Returns the file's size.
pub fn synthesize(template: &Session, target_bytes: u64, out: &Path) -> Result<u64, SessionError> {
    let io = |source| SessionError::Io {
        path: out.display().to_string(),
        source,
    };
    let mut w = BufWriter::with_capacity(1 << 20, File::create(out).map_err(io)?);
    let mut written = 0u64;
    let mut line = serde_json::to_string(&template.header)?;
    line.push('\n');
    w.write_all(line.as_bytes()).map_err(io)?;
    written += line.len() as u64;
    let mut seq = 0u64;
    let mut last: Option<String> = None;
    loop {
        let mut ids: HashMap<&str, String> = HashMap::new();
        for e in &template.events {
            seq += 1;
            let id = format!("e{}", seq - 1);
            let parent = match &e.parent {
                Some(p) => ids.get(p.as_str()).cloned(),
                None => last.clone(),
            };
            ids.insert(e.id.as_str(), id.clone());
            let record = EventRecord {
                seq,
                id: id.clone(),
                parent,
                ts: e.ts.clone(),
                event: e.event.clone(),
            };
            let mut line = serde_json::to_string(&record)?;
            line.push('\n');
            w.write_all(line.as_bytes()).map_err(io)?;
            written += line.len() as u64;
            last = Some(id);
        }
        if written >= target_bytes || template.events.is_empty() {
            break;
        }
    }
    w.flush().map_err(io)?;
    Ok(written)
}
