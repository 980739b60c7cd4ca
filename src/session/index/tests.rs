//! Session index: summaries of the sample sessions agree with a full read and the branch tree,
//! stay right on truncated files and other key orders, and a directory scan reports bad files;
//! sorting and filtering for the browser's list.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::*;
use crate::session::{EventBody, SessionTree, read_session};

fn sample(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("sessions")
        .join(name)
}

const SAMPLES: [&str; 3] = [
    "bank-success.jsonl",
    "bank-failure.jsonl",
    "bank-shadow-rehearsal.jsonl",
];

/// What the summary must say, computed from a full, validated read.
fn expected(path: &Path) -> (usize, usize, Option<f64>, Option<String>) {
    let s = read_session(path).expect("read");
    let tree = SessionTree::build(&s.events);
    let main = tree.main_line();
    let steps = main
        .iter()
        .filter(|&&i| matches!(s.events[i].event, EventBody::ActorParsed { .. }))
        .count();
    let reward = main.iter().rev().find_map(|&i| match &s.events[i].event {
        EventBody::Reward { reward, .. } => Some(*reward),
        _ => None,
    });
    let end = main.iter().rev().find_map(|&i| match &s.events[i].event {
        EventBody::EpisodeEnd { reason, .. } => serde_json::to_value(reason)
            .ok()
            .and_then(|v| v["reason"].as_str().map(String::from)),
        _ => None,
    });
    (s.events.len(), steps, reward, end)
}

#[test]
fn summaries_of_the_samples_agree_with_a_full_read() {
    for name in SAMPLES {
        let p = sample(name);
        let s = summarize(&p).expect("summarize");
        let (events, steps, reward, end) = expected(&p);
        assert_eq!(
            (s.events, s.steps, s.reward, s.end.clone()),
            (events, steps, reward, end),
            "{name}"
        );
        assert_eq!(s.environment, "bank");
        assert_eq!(s.model, "models/envace-tiny");
        assert!(s.created.is_some() && s.date().is_some());
        assert!(!s.truncated && s.forked_from.is_none());
        assert_eq!(s.bytes, std::fs::metadata(&p).expect("meta").len());
    }
    let s = summarize(&sample("bank-success.jsonl")).expect("summarize");
    assert_eq!(s.task_id.as_deref(), Some("bank-test-0018"));
    assert_eq!(s.mode, "real");
    assert_eq!(
        (s.steps, s.reward, s.end.as_deref()),
        (2, Some(1.0), Some("answered"))
    );
    // The rehearsal sample has branches with actor turns of their own: they are not steps.
    let p = sample("bank-shadow-rehearsal.jsonl");
    let all = read_session(&p)
        .expect("read")
        .events
        .iter()
        .filter(|e| matches!(e.event, EventBody::ActorParsed { .. }))
        .count();
    assert!(summarize(&p).expect("summarize").steps < all);
}

#[test]
fn a_truncated_last_line_is_tolerated_and_flagged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bytes = std::fs::read(sample("bank-success.jsonl")).expect("read");
    let p = dir.path().join("cut.jsonl");
    // Cut inside the reward line: the end is known, the reward is not.
    std::fs::write(&p, &bytes[..bytes.len() - 40]).expect("write");
    let s = summarize(&p).expect("summarize");
    assert!(s.truncated);
    assert_eq!(s.events, 14);
    assert_eq!((s.reward, s.end.as_deref()), (None, Some("answered")));
    // Only the header, cut.
    std::fs::write(&p, &bytes[..100]).expect("write");
    assert!(matches!(
        summarize(&p),
        Err(SessionError::TruncatedHeader { .. })
    ));
    std::fs::write(&p, b"").expect("write");
    assert!(matches!(summarize(&p), Err(SessionError::Empty { .. })));
    // A corrupt line in the middle is an error naming it.
    let text = String::from_utf8(bytes).expect("utf8");
    let mut lines: Vec<&str> = text.lines().collect();
    lines[3] = "{\"oops\": ";
    std::fs::write(&p, lines.join("\n") + "\n").expect("write");
    assert!(matches!(
        summarize(&p),
        Err(SessionError::Corrupt { line: 4, .. })
    ));
}

#[test]
fn lines_in_another_key_order_summarize_the_same() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = std::fs::read_to_string(sample("bank-shadow-rehearsal.jsonl")).expect("read");
    let mut out = String::new();
    for (i, line) in text.lines().enumerate() {
        if i == 0 {
            out.push_str(line);
        } else {
            // `event` first, then the rest: the fast path does not apply.
            let v: serde_json::Value = serde_json::from_str(line).expect("json");
            let mut o = serde_json::Map::new();
            o.insert("event".into(), v["event"].clone());
            for (k, x) in v.as_object().expect("object") {
                if k != "event" {
                    o.insert(k.clone(), x.clone());
                }
            }
            out.push_str(&serde_json::Value::Object(o).to_string());
        }
        out.push('\n');
    }
    let p = dir.path().join("reordered.jsonl");
    std::fs::write(&p, out).expect("write");
    let a = summarize(&sample("bank-shadow-rehearsal.jsonl")).expect("a");
    let b = summarize(&p).expect("b");
    assert_eq!(
        (a.events, a.steps, a.reward, a.end),
        (b.events, b.steps, b.reward, b.end)
    );
}

#[test]
fn scanning_a_directory_reports_bad_files_and_skips_the_rest() {
    let dir = tempfile::tempdir().expect("tempdir");
    for name in SAMPLES {
        std::fs::copy(sample(name), dir.path().join(name)).expect("copy");
    }
    std::fs::write(dir.path().join("garbage.jsonl"), "not a session\n").expect("write");
    std::fs::write(dir.path().join("empty.jsonl"), "").expect("write");
    std::fs::write(dir.path().join("notes.txt"), "ignored").expect("write");
    std::fs::create_dir(dir.path().join("sub.jsonl")).expect("dir");
    let (good, bad) = scan_dir(dir.path());
    let names: Vec<String> = good.iter().map(SessionSummary::file_name).collect();
    assert_eq!(
        names,
        [
            "bank-failure.jsonl",
            "bank-shadow-rehearsal.jsonl",
            "bank-success.jsonl"
        ]
    );
    let bad_names: Vec<String> = bad
        .iter()
        .map(|(p, _)| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    assert_eq!(bad_names, ["empty.jsonl", "garbage.jsonl"]);
    let (good, bad) = scan_dir(&dir.path().join("missing"));
    assert!(good.is_empty() && bad.len() == 1);
}

fn summary(
    name: &str,
    env: &str,
    task: Option<&str>,
    steps: usize,
    reward: Option<f64>,
) -> SessionSummary {
    SessionSummary {
        path: PathBuf::from(name),
        modified: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(steps as u64 * 100)),
        bytes: 0,
        created: None,
        environment: env.into(),
        task_id: task.map(String::from),
        mode: if steps.is_multiple_of(2) {
            "real".into()
        } else {
            "shadow".into()
        },
        model: "models/envace-tiny".into(),
        steps,
        events: 0,
        reward,
        end: None,
        forked_from: None,
        truncated: false,
    }
}

fn names(v: &[SessionSummary]) -> Vec<&str> {
    v.iter().map(|s| s.path.to_str().expect("utf8")).collect()
}

#[test]
fn sorting_puts_missing_values_last_in_both_directions() {
    let mut v = vec![
        summary("a.jsonl", "bank", Some("t2"), 3, Some(0.0)),
        summary("b.jsonl", "retail", None, 1, None),
        summary("c.jsonl", "Travel", Some("t1"), 2, Some(1.0)),
    ];
    sort(&mut v, SortKey::Reward, true);
    assert_eq!(names(&v), ["c.jsonl", "a.jsonl", "b.jsonl"]);
    sort(&mut v, SortKey::Reward, false);
    assert_eq!(names(&v), ["a.jsonl", "c.jsonl", "b.jsonl"]);
    sort(&mut v, SortKey::Task, false);
    assert_eq!(names(&v), ["c.jsonl", "a.jsonl", "b.jsonl"]);
    sort(&mut v, SortKey::Steps, true);
    assert_eq!(names(&v), ["a.jsonl", "c.jsonl", "b.jsonl"]);
    sort(&mut v, SortKey::Date, false);
    assert_eq!(names(&v), ["b.jsonl", "c.jsonl", "a.jsonl"]);
    sort(&mut v, SortKey::Environment, true);
    assert_eq!(names(&v), ["c.jsonl", "b.jsonl", "a.jsonl"]);
    sort(&mut v, SortKey::Mode, false);
    assert_eq!(names(&v), ["c.jsonl", "a.jsonl", "b.jsonl"]);
    // The header's time wins over the file's.
    v[0].created = Some("2030-01-01T00:00:00.000Z".into());
    let first = v[0].path.clone();
    sort(&mut v, SortKey::Date, true);
    assert_eq!(v[0].path, first);
}

#[test]
fn filtering_matches_every_term_case_insensitively() {
    let v = vec![
        summary("bank-x.jsonl", "bank", Some("bank-test-0001"), 2, None),
        summary("r.jsonl", "retail", Some("retail-train-0003"), 1, None),
    ];
    let hits = |q: &str| -> Vec<&str> {
        filter(&v, q)
            .into_iter()
            .map(|s| s.path.to_str().expect("utf8"))
            .collect()
    };
    assert_eq!(hits(""), ["bank-x.jsonl", "r.jsonl"]);
    assert_eq!(hits("BANK"), ["bank-x.jsonl"]);
    assert_eq!(hits("retail shadow"), ["r.jsonl"]);
    assert_eq!(hits("retail real"), Vec::<&str>::new());
    assert_eq!(hits("TEST-0001"), ["bank-x.jsonl"]);
    assert_eq!(hits("envace-tiny"), ["bank-x.jsonl", "r.jsonl"]);
    assert_eq!(hits("x.jsonl"), ["bank-x.jsonl"]);
}

#[test]
fn a_large_session_is_summarized_by_streaming() {
    let dir = tempfile::tempdir().expect("tempdir");
    let template = read_session(sample("bank-shadow-rehearsal.jsonl")).expect("template");
    let p = dir.path().join("big.jsonl");
    crate::session::synth::synthesize(&template, 20 << 20, &p).expect("synth");
    let t = std::time::Instant::now();
    let s = summarize(&p).expect("summarize");
    let took = t.elapsed();
    let (events, steps, reward, end) = expected(&p);
    assert_eq!(
        (s.events, s.steps, s.reward, s.end),
        (events, steps, reward, end)
    );
    // Generous: a 20 MB file in well under the time a full read takes on a slow machine.
    assert!(took < Duration::from_secs(5), "{took:?}");
}
