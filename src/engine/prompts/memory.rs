//! Rehearsal memory: condense imagined branches (per branch: the actions, the simulated
//! outcomes, the predicted success) into text for the actor's context. Format, de-duplication
//! and selection are configurable ([`MemoryConfig`]) because which works best is an open,
//! measurable question; the quick prototype found long, repetitive notes harmful, hence compact
//! and de-duplicated by default.

use std::fmt::Write as _;

use crate::engine::types::{
    BranchEnd, BranchSummary, MemoryConfig, MemoryFormat, MemorySelection, Prediction,
    SimulatedOutcome,
};

use super::simulator::format_call;

fn cut(s: &str, max: usize) -> String {
    if max == 0 || s.chars().count() <= max {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max).collect();
        t.push('…');
        t
    }
}

fn prediction_text(p: &Prediction) -> String {
    match p {
        Prediction::Success => "success".into(),
        Prediction::Failure { reason } => format!("failure ({reason})"),
        Prediction::Unknown => "unknown".into(),
    }
}

fn end_text(e: &BranchEnd, max: usize) -> String {
    match e {
        BranchEnd::Answered { text } => format!("answered \"{}\"", cut(text, max)),
        BranchEnd::DepthReached => "stopped (depth)".into(),
        BranchEnd::TurnLimit => "stopped (turn limit)".into(),
        BranchEnd::Rejected { code, message } => {
            format!("call rejected: {code}: {}", cut(message, max))
        }
        BranchEnd::SimulatorFormatError => "simulation failed".into(),
        BranchEnd::ActorFormatError => "unparseable call".into(),
    }
}

fn outcome_text(o: &SimulatedOutcome, max: usize) -> String {
    match o.value() {
        Some(v) => cut(&v.to_string(), max),
        None => "(no valid simulation)".into(),
    }
}

/// Rank for `SuccessFirst`: success, unknown, failure.
fn rank(p: &Prediction) -> u8 {
    match p {
        Prediction::Success => 0,
        Prediction::Unknown => 1,
        Prediction::Failure { .. } => 2,
    }
}

/// Select (and order) the branches to show.
fn select(branches: &[BranchSummary], sel: MemorySelection) -> Vec<&BranchSummary> {
    match sel {
        MemorySelection::All => branches.iter().collect(),
        MemorySelection::SuccessFirst(k) => {
            let mut v: Vec<&BranchSummary> = branches.iter().collect();
            v.sort_by_key(|b| (rank(&b.prediction), b.index));
            v.truncate(k);
            v
        }
        MemorySelection::FailuresOnly(k) => branches
            .iter()
            .filter(|b| matches!(b.prediction, Prediction::Failure { .. }))
            .take(k)
            .collect(),
    }
}

/// Group identical branches (same steps, end and prediction), keeping first-seen order.
fn group(branches: Vec<&BranchSummary>, dedupe: bool) -> Vec<(&BranchSummary, usize)> {
    let mut out: Vec<(&BranchSummary, usize)> = Vec::new();
    for b in branches {
        let same = |o: &&BranchSummary| {
            o.steps == b.steps && o.end == b.end && o.prediction == b.prediction
        };
        match out.iter_mut().find(|(o, _)| dedupe && same(o)) {
            Some((_, n)) => *n += 1,
            None => out.push((b, 1)),
        }
    }
    out
}

/// Render the memory text for the actor (the heading is added by `actor_prompt`).
pub fn render_memory(branches: &[BranchSummary], cfg: &MemoryConfig) -> String {
    let max = cfg.max_result_chars;
    let chosen = select(branches, cfg.selection);
    if cfg.format == MemoryFormat::Json {
        let items: Vec<&BranchSummary> = chosen;
        return serde_json::to_string(&items).unwrap_or_default();
    }
    let grouped = group(chosen, cfg.dedupe);
    let mut s = String::new();
    if grouped.is_empty() {
        s.push_str("No imagined attempt to report.");
        return s;
    }
    for (k, (b, n)) in grouped.iter().enumerate() {
        let times = if *n > 1 {
            format!(" (×{n})")
        } else {
            String::new()
        };
        match cfg.format {
            MemoryFormat::Compact => {
                let steps: Vec<String> = b
                    .steps
                    .iter()
                    .map(|st| {
                        format!(
                            "{} → {}",
                            cut(&format_call(&st.call), max),
                            outcome_text(&st.outcome, max)
                        )
                    })
                    .collect();
                let steps = if steps.is_empty() {
                    "no call".to_string()
                } else {
                    steps.join("; ")
                };
                let _ = writeln!(
                    s,
                    "{}. {steps}; {}; predicted {}{times}",
                    k + 1,
                    end_text(&b.end, max),
                    prediction_text(&b.prediction)
                );
            }
            MemoryFormat::Full | MemoryFormat::Json => {
                let _ = writeln!(
                    s,
                    "Attempt {}{times}: predicted {}",
                    k + 1,
                    prediction_text(&b.prediction)
                );
                for st in &b.steps {
                    let _ = writeln!(s, "  call {}", cut(&format_call(&st.call), max));
                    let _ = writeln!(s, "  result {}", outcome_text(&st.outcome, max));
                }
                let _ = writeln!(s, "  ended: {}", end_text(&b.end, max));
            }
        }
    }
    s.trim_end().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::parse::SimOutput;
    use crate::engine::types::BranchStep;
    use crate::message::ToolCall;
    use serde_json::json;

    fn branch(index: usize, amount: i64, pred: Prediction) -> BranchSummary {
        BranchSummary {
            index,
            steps: vec![BranchStep {
                call: ToolCall {
                    name: "pay".into(),
                    arguments: json!({"amount": amount}),
                },
                outcome: SimulatedOutcome::Parsed {
                    output: SimOutput::Result {
                        value: json!({"ok": true}),
                    },
                },
            }],
            end: BranchEnd::Answered {
                text: "paid".into(),
            },
            prediction: pred,
        }
    }

    #[test]
    fn compact_memory_is_one_line_per_branch() {
        let b = [
            branch(0, 5, Prediction::Success),
            branch(1, 7, Prediction::Unknown),
        ];
        let m = render_memory(&b, &MemoryConfig::default());
        assert_eq!(
            m,
            "1. {\"name\":\"pay\",\"arguments\":{\"amount\":5}} → {\"ok\":true}; answered \"paid\"; predicted success\n\
             2. {\"name\":\"pay\",\"arguments\":{\"amount\":7}} → {\"ok\":true}; answered \"paid\"; predicted unknown"
        );
    }

    #[test]
    fn dedupe_merges_identical_branches_with_a_count() {
        let b = [
            branch(0, 5, Prediction::Success),
            branch(1, 5, Prediction::Success),
            branch(2, 5, Prediction::Success),
        ];
        let m = render_memory(&b, &MemoryConfig::default());
        assert_eq!(m.lines().count(), 1);
        assert!(m.ends_with("(×3)"));
        let no = MemoryConfig {
            dedupe: false,
            ..Default::default()
        };
        assert_eq!(render_memory(&b, &no).lines().count(), 3);
    }

    #[test]
    fn success_first_selection_orders_and_caps() {
        let b = [
            branch(0, 1, Prediction::Failure { reason: "x".into() }),
            branch(1, 2, Prediction::Unknown),
            branch(2, 3, Prediction::Success),
        ];
        let cfg = MemoryConfig {
            selection: MemorySelection::SuccessFirst(2),
            ..Default::default()
        };
        let m = render_memory(&b, &cfg);
        let lines: Vec<&str> = m.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].contains("\"amount\":3") && lines[0].ends_with("success"));
        assert!(lines[1].contains("\"amount\":2"));
    }

    #[test]
    fn failures_only_selection_keeps_failures() {
        let b = [
            branch(
                0,
                1,
                Prediction::Failure {
                    reason: "rejected".into(),
                },
            ),
            branch(1, 2, Prediction::Success),
        ];
        let cfg = MemoryConfig {
            selection: MemorySelection::FailuresOnly(5),
            ..Default::default()
        };
        let m = render_memory(&b, &cfg);
        assert_eq!(m.lines().count(), 1);
        assert!(m.contains("failure (rejected)"));
    }

    #[test]
    fn full_format_lists_every_step() {
        let b = [branch(0, 5, Prediction::Success)];
        let cfg = MemoryConfig {
            format: MemoryFormat::Full,
            ..Default::default()
        };
        let m = render_memory(&b, &cfg);
        assert!(m.starts_with("Attempt 1: predicted success\n  call {"));
        assert!(m.contains("\n  result {\"ok\":true}\n  ended: answered \"paid\""));
    }

    #[test]
    fn json_format_round_trips() {
        let b = [branch(0, 5, Prediction::Success)];
        let cfg = MemoryConfig {
            format: MemoryFormat::Json,
            ..Default::default()
        };
        let back: Vec<BranchSummary> =
            serde_json::from_str(&render_memory(&b, &cfg)).expect("json");
        assert_eq!(back, b.to_vec());
    }

    #[test]
    fn long_results_are_cut() {
        let mut b = branch(0, 5, Prediction::Success);
        b.steps[0].outcome = SimulatedOutcome::Parsed {
            output: SimOutput::Result {
                value: json!({"text": "x".repeat(500)}),
            },
        };
        let cfg = MemoryConfig {
            max_result_chars: 20,
            ..Default::default()
        };
        let m = render_memory(&[b], &cfg);
        assert!(m.contains("…") && m.len() < 200, "{m}");
    }
}
