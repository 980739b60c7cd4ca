//! τ²-style rewards for the built-in domains: a state hash over canonical JSON, and the score of
//! a finished episode. Scoring replays calls on fresh copies of the task's initial state and never
//! touches a live environment, so it can run at any time and any number of times.
//!
//! reward = 1 only when the episode finished normally, the state reached by the agent's calls
//! equals the state reached by the gold calls (after every answered turn of a multi-turn task,
//! not only at the end), and every required fact appears (case-insensitive) in some agent
//! message. `partial` is the weighted checklist fraction.

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::env::tasks::{Check, Task};
use crate::env::{ChecklistItem, EnvError, EpisodeTrace, Score};
use crate::message::ToolCall;

/// JSON with object keys sorted at every level and no whitespace.
pub fn canonical_json(v: &Value) -> String {
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Object(m) => {
                let mut keys: Vec<&String> = m.keys().collect();
                keys.sort();
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String((*k).clone()).to_string());
                    out.push(':');
                    if let Some(x) = m.get(*k) {
                        write(x, out);
                    }
                }
                out.push('}');
            }
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(x, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(v, &mut out);
    out
}

/// sha256 (hex) of the canonical JSON of a state.
pub fn state_hash(v: &Value) -> String {
    hex::encode(Sha256::digest(canonical_json(v).as_bytes()))
}

/// Replay calls on a fresh copy of the task's initial state; returns the final state.
pub fn replay(task: &Task, calls: &[ToolCall]) -> Result<Value, EnvError> {
    let domain = task.domain()?;
    let mut state = task.initial_state.clone();
    for c in calls {
        domain.apply(&mut state, c)?;
    }
    Ok(state)
}

/// The hash of the state the gold calls reach.
pub fn gold_hash(task: &Task) -> Result<String, EnvError> {
    Ok(state_hash(&replay(task, &task.gold_actions())?))
}

fn mentions(messages: &[String], fact: &str) -> bool {
    let f = fact.to_lowercase();
    messages.iter().any(|m| m.to_lowercase().contains(&f))
}

/// Score a finished episode of `task`.
pub fn score_task(task: &Task, trace: &EpisodeTrace) -> Result<Score, EnvError> {
    let gold = gold_hash(task)?;
    let reached = state_hash(&replay(task, &trace.actions)?);
    let state_ok = gold == reached;
    let missing: Vec<&String> = task
        .required_facts
        .iter()
        .filter(|f| !mentions(&trace.agent_messages, f))
        .collect();
    let mut checklist = Vec::new();
    for spec in task.effective_checklist() {
        let (passed, reason) = match &spec.check {
            Check::Call { name, arguments } => {
                let hit = trace
                    .actions
                    .iter()
                    .any(|a| &a.name == name && &a.arguments == arguments);
                (
                    hit,
                    if hit {
                        "the call was made".to_string()
                    } else {
                        "no such call".to_string()
                    },
                )
            }
            Check::Fact { text } => {
                let hit = mentions(&trace.agent_messages, text);
                (
                    hit,
                    if hit {
                        "mentioned".to_string()
                    } else {
                        format!("no agent message mentions `{text}`")
                    },
                )
            }
            Check::State => (
                state_ok,
                if state_ok {
                    "state hash matches".to_string()
                } else {
                    format!("state hash {} != gold {}", &reached[..12], &gold[..12])
                },
            ),
            Check::Finished => (
                trace.finished_normally,
                if trace.finished_normally {
                    "finished normally".to_string()
                } else {
                    "ended abnormally".to_string()
                },
            ),
        };
        checklist.push(ChecklistItem {
            name: spec.name,
            weight: spec.weight,
            passed,
            reason,
        });
    }
    let turns_ok = turn_states(task, trace, &mut checklist)?;
    let partial = weighted_partial(&checklist);
    let success = trace.finished_normally && state_ok && turns_ok && missing.is_empty();
    Ok(Score {
        reward: if success { 1.0 } else { 0.0 },
        partial,
        checklist,
    })
}

/// A multi-turn task is scored turn by turn: for every turn but the last that the agent
/// answered, the state its calls had reached by that answer must equal the state the gold
/// calls reach by the end of that turn (one checklist item each). Without it, an irreversible
/// action the user only asks for later (return the item while answering what it cost) scores
/// as right whenever the final state comes out the same. A trace without turn ends (recorded
/// elsewhere) is scored on its final state only.
fn turn_states(
    task: &Task,
    trace: &EpisodeTrace,
    checklist: &mut Vec<ChecklistItem>,
) -> Result<bool, EnvError> {
    if task.turns.len() < 2 || trace.turn_ends.is_empty() {
        return Ok(true);
    }
    let domain = task.domain()?;
    let mut gold = task.initial_state.clone();
    let mut all = true;
    for (k, turn) in task.turns[..task.turns.len() - 1].iter().enumerate() {
        for a in &turn.actions {
            domain.apply(&mut gold, &a.to_call())?;
        }
        let Some(&end) = trace.turn_ends.get(k) else {
            break;
        };
        let reached = state_hash(&replay(
            task,
            &trace.actions[..end.min(trace.actions.len())],
        )?);
        let want = state_hash(&gold);
        let passed = reached == want;
        all &= passed;
        checklist.push(ChecklistItem {
            name: format!("state after turn {} matches gold", k + 1),
            weight: 1.0,
            passed,
            reason: if passed {
                "state hash matches".to_string()
            } else {
                format!("state hash {} != gold {}", &reached[..12], &want[..12])
            },
        });
    }
    Ok(all)
}

/// The trace an expert produces: gold calls, gold replies, finished normally.
pub fn gold_trace(task: &Task) -> EpisodeTrace {
    EpisodeTrace {
        actions: task.gold_actions(),
        agent_messages: task.gold_replies(),
        finished_normally: true,
        turn_ends: task
            .turns
            .iter()
            .scan(0, |n, t| {
                *n += t.actions.len();
                Some(*n)
            })
            .collect(),
    }
}

/// The weighted fraction of passed checklist items, in [0, 1]; a plain 0 (not -0: a float `sum`
/// of nothing is -0.0, which printed as `partial -0.000`) when none passed or the list is empty.
pub fn weighted_partial(checklist: &[ChecklistItem]) -> f64 {
    let total: f64 = checklist.iter().map(|c| c.weight).sum();
    let got: f64 = checklist
        .iter()
        .filter(|c| c.passed)
        .map(|c| c.weight)
        .sum();
    if total > 0.0 && got > 0.0 {
        got / total
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(weight: f64, passed: bool) -> ChecklistItem {
        ChecklistItem {
            name: "c".into(),
            weight,
            passed,
            reason: String::new(),
        }
    }

    #[test]
    fn partial_is_a_plain_zero_when_nothing_passed() {
        for list in [vec![], vec![item(1.0, false), item(2.0, false)]] {
            let p = weighted_partial(&list);
            assert!(p == 0.0 && p.is_sign_positive(), "{p}");
            assert_eq!(format!("{p:.3}"), "0.000");
        }
        assert!((weighted_partial(&[item(1.0, true), item(3.0, false)]) - 0.25).abs() < 1e-12);
    }
}
