//! Progressive loading: the streaming reader gives exactly what the whole-buffer reader of
//! format version 1 gave (kept here verbatim as the oracle), on the sample sessions cut and
//! corrupted at many points and on a ~20 MB synthetic session; progress is monotonic and ends
//! at the total; cancellation stops the read.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use super::*;
use crate::session::synth::synthesize;

fn samples() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("sessions/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    v.sort();
    assert!(v.len() >= 3, "sample sessions missing: {v:?}");
    v
}

/// Results compare by their debug text (errors hold io::Error, which has no `PartialEq`).
fn shown(r: &Result<Session, SessionError>) -> String {
    format!("{r:?}")
}

/// The reader as it was before progressive loading (whole buffer, split on newlines).
fn reference_parse(bytes: &[u8], origin: &str) -> Result<Session, SessionError> {
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

#[test]
fn streaming_reader_matches_the_whole_buffer_reader_on_every_cut_of_the_samples() {
    for path in samples() {
        let bytes = std::fs::read(&path).expect("read");
        let n = bytes.len();
        // Every byte near the ends and around each line break, every 61st elsewhere.
        let mut cuts: Vec<usize> = (0..n.min(300)).chain(n.saturating_sub(300)..=n).collect();
        cuts.extend((0..n).step_by(61));
        for (i, b) in bytes.iter().enumerate() {
            if *b == b'\n' {
                cuts.extend(i.saturating_sub(1)..=(i + 2).min(n));
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        for k in cuts {
            let cut = &bytes[..k];
            assert_eq!(
                shown(&parse_session(cut, "s")),
                shown(&reference_parse(cut, "s")),
                "{} cut at {k}",
                path.display()
            );
        }
    }
}

#[test]
fn streaming_reader_matches_the_whole_buffer_reader_on_corrupted_samples() {
    let mut rng_state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        rng_state
    };
    for path in samples() {
        let bytes = std::fs::read(&path).expect("read");
        for _ in 0..300 {
            let mut b = bytes.clone();
            let at = (next() % b.len() as u64) as usize;
            // A garbage byte, a lost newline, or a duplicated line.
            match next() % 3 {
                0 => b[at] = b"x}\"\n\xff,1"[(next() % 7) as usize],
                1 => {
                    if let Some(nl) = b[at..].iter().position(|&c| c == b'\n') {
                        b.remove(at + nl);
                    }
                }
                _ => {
                    let start = b[..at]
                        .iter()
                        .rposition(|&c| c == b'\n')
                        .map_or(0, |p| p + 1);
                    let end = b[at..]
                        .iter()
                        .position(|&c| c == b'\n')
                        .map_or(b.len(), |p| at + p + 1);
                    let line = b[start..end].to_vec();
                    b.splice(end..end, line);
                }
            }
            assert_eq!(
                shown(&parse_session(&b, "s")),
                shown(&reference_parse(&b, "s")),
                "{} corrupted at {at}",
                path.display()
            );
        }
    }
}

#[test]
fn file_reads_equal_slice_parses_and_report_progress_to_the_end() {
    for path in samples() {
        let bytes = std::fs::read(&path).expect("read");
        let mut calls = Vec::new();
        let s =
            read_session_with_progress(&path, &mut |d, t| calls.push((d, t)), &CancelToken::new())
                .expect("read");
        let origin = path.display().to_string();
        assert_eq!(s, reference_parse(&bytes, &origin).expect("reference"));
        assert_eq!(s, read_session(&path).expect("read_session"));
        let total = bytes.len() as u64;
        assert_eq!(calls.last(), Some(&(total, total)), "{calls:?}");
    }
}

fn synthetic(dir: &Path, mb: u64) -> PathBuf {
    let template = read_session(&samples()[1]).expect("template");
    let p = dir.join("big.jsonl");
    let written = synthesize(&template, mb << 20, &p).expect("synthesize");
    assert!(written >= mb << 20);
    p
}

#[test]
fn a_large_session_loads_progressively_with_monotonic_progress() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = synthetic(dir.path(), 20);
    let bytes = std::fs::read(&p).expect("read");
    let total = bytes.len() as u64;
    let mut calls: Vec<(u64, u64)> = Vec::new();
    let s = read_session_with_progress(&p, &mut |d, t| calls.push((d, t)), &CancelToken::new())
        .expect("read");
    let reference = reference_parse(&bytes, &p.display().to_string()).expect("reference");
    assert_eq!(s.events.len(), reference.events.len());
    assert!(s == reference, "streaming and whole-buffer reads differ");
    let ids: HashSet<&str> = s.events.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids.len(), s.events.len());

    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0), "not monotonic");
    assert!(calls.iter().all(|&(d, t)| t == total && d <= total));
    assert_eq!(calls.last(), Some(&(total, total)));
    // About one report per MiB: never two within a MiB, never a gap of much more than one.
    let max_line = bytes
        .split(|&b| b == b'\n')
        .map(<[u8]>::len)
        .max()
        .unwrap_or(0) as u64;
    let steps = calls.len() as u64;
    assert!(
        steps >= total / (PROGRESS_STEP + max_line + 1) && steps <= total / PROGRESS_STEP + 1,
        "{steps} reports"
    );
    for w in calls.windows(2).take(calls.len().saturating_sub(2)) {
        let gap = w[1].0 - w[0].0;
        assert!(
            gap >= PROGRESS_STEP && gap <= PROGRESS_STEP + max_line + 1,
            "gap {gap}"
        );
    }
}

#[test]
fn cancelling_stops_a_read_with_cancelled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = synthetic(dir.path(), 4);
    let cancel = CancelToken::new();
    cancel.cancel();
    let e = read_session_with_progress(&p, &mut |_, _| {}, &cancel).expect_err("cancelled");
    assert!(matches!(e, SessionError::Cancelled { .. }), "{e}");

    // Cancelled from the progress callback (as a UI would, between two reports).
    let cancel = CancelToken::new();
    let mut reports = 0;
    let c = cancel.clone();
    let e = read_session_with_progress(
        &p,
        &mut |_, _| {
            reports += 1;
            c.cancel();
        },
        &cancel,
    )
    .expect_err("cancelled");
    assert!(matches!(e, SessionError::Cancelled { .. }), "{e}");
    assert_eq!(reports, 1);
    assert!(e.to_string().contains("cancelled"));
}

#[test]
fn errors_name_the_line_when_read_from_a_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = std::fs::read_to_string(&samples()[1]).expect("read");
    let mut lines: Vec<&str> = src.lines().collect();
    lines[4] = "{not json";
    let p = dir.path().join("bad.jsonl");
    std::fs::write(&p, lines.join("\n") + "\n").expect("write");
    let e = read_session_with_progress(&p, &mut |_, _| {}, &CancelToken::new()).expect_err("bad");
    assert!(matches!(e, SessionError::Corrupt { line: 5, .. }), "{e}");
    let missing = dir.path().join("missing.jsonl");
    let e = read_session(&missing).expect_err("missing");
    assert!(matches!(e, SessionError::Io { .. }), "{e}");
}
