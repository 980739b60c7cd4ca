//! The episode as the Run tab shows it, built incrementally from persisted session events
//! (exactly what the driver streams, and exactly what a session file holds): main-line actor
//! turns with their proposed calls, each call's simulated and real response and fidelity, the
//! rehearsal branches with their imagined steps and predicted outcome, and the live text of the
//! generation in progress.

use std::collections::HashMap;

use crate::engine::fidelity::Fidelity;
use crate::engine::types::{
    BranchSummary, Decision, EndReason, GenRole, Prediction, RehearsalStrategy, SimulatedOutcome,
};
use crate::env::ToolResponse;
use crate::message::ToolCall;
use crate::session::{BranchTracker, EventBody, EventRecord};

/// One main-line actor turn.
#[derive(Debug, Clone, PartialEq)]
pub struct ActorEntry {
    /// The answer, or the prose before the calls.
    pub content: String,
    /// The raw generation.
    pub raw: String,
    /// (call id, call, irreversible)
    pub calls: Vec<(String, ToolCall, bool)>,
    pub format_problems: Vec<String>,
}

/// Everything known about one main-line call.
#[derive(Debug, Clone, PartialEq)]
pub struct CallEntry {
    pub id: String,
    pub call: ToolCall,
    pub irreversible: bool,
    pub simulated: Option<SimulatedOutcome>,
    pub real: Option<ToolResponse>,
    pub fidelity: Option<Fidelity>,
    pub approval: Option<Decision>,
}

/// One imagined call of a branch.
#[derive(Debug, Clone, PartialEq)]
pub struct ImaginedStep {
    pub call: ToolCall,
    /// The simulated outcome once known.
    pub outcome: Option<SimulatedOutcome>,
    /// The outcome is the real error already observed for this call, not a simulation.
    pub recalled: bool,
}

impl ImaginedStep {
    fn proposed(call: &ToolCall) -> Self {
        Self {
            call: call.clone(),
            outcome: None,
            recalled: false,
        }
    }
}

/// One imagined branch.
#[derive(Debug, Clone, PartialEq)]
pub struct BranchEntry {
    pub index: usize,
    pub steps: Vec<ImaginedStep>,
    pub summary: Option<BranchSummary>,
}

/// One Private Rehearsal.
#[derive(Debug, Clone, PartialEq)]
pub struct RehearsalEntry {
    pub event_id: String,
    pub strategy: RehearsalStrategy,
    pub planned: usize,
    pub proposed: Vec<ToolCall>,
    pub branches: Vec<BranchEntry>,
    pub memory: Option<String>,
}

impl RehearsalEntry {
    /// (predicted success, predicted failure) over finished branches.
    pub fn verdict(&self) -> (usize, usize) {
        let mut s = (0, 0);
        for b in self.branches.iter().filter_map(|b| b.summary.as_ref()) {
            match b.prediction {
                Prediction::Success => s.0 += 1,
                Prediction::Failure { .. } => s.1 += 1,
                Prediction::Unknown => {}
            }
        }
        s
    }
}

/// Text being generated right now.
#[derive(Debug, Clone, PartialEq)]
pub struct Streaming {
    pub role: GenRole,
    /// The request's branch; sample `i` of a batched request (Private Rehearsal's parallel
    /// siblings) is branch `branch + i`.
    pub branch: Option<usize>,
    /// One text per sample of the request.
    pub texts: Vec<String>,
}

impl Streaming {
    /// `(label, text)` per sample: "actor ▍", "actor (branch 2) ▍", …
    pub fn lines(&self) -> Vec<(String, &str)> {
        let who = match self.role {
            GenRole::Actor => "actor",
            GenRole::Simulator => "simulator",
        };
        self.texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let label = match self.branch {
                    Some(b) => format!("{who} (branch {}) ▍", b + i),
                    None if self.texts.len() > 1 => format!("{who} (sample {i}) ▍"),
                    None => format!("{who} ▍"),
                };
                (label, t.as_str())
            })
            .collect()
    }
}

/// The episode view.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EpisodeView {
    pub events: usize,
    pub task_id: Option<String>,
    pub mode: String,
    pub actor: Vec<ActorEntry>,
    pub calls: Vec<CallEntry>,
    pub rehearsals: Vec<RehearsalEntry>,
    pub streaming: Option<Streaming>,
    pub generated_tokens: usize,
    pub reward: Option<f64>,
    pub end: Option<EndReason>,
    irreversible_tools: Vec<String>,
    last_actor_raw: Option<String>,
    /// Which rehearsal branch each event belongs to (the session tree's rule).
    branches: BranchTracker,
    /// event position → rehearsal index, for `rehearsal_start` events.
    rehearsal_at: HashMap<usize, usize>,
}

impl EpisodeView {
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a EventRecord>) -> Self {
        let mut v = Self::default();
        for e in events {
            v.apply(e);
        }
        v
    }

    /// Main-line actor turns taken.
    pub fn turns(&self) -> usize {
        self.actor.len()
    }

    pub fn call(&self, id: &str) -> Option<&CallEntry> {
        self.calls.iter().find(|c| c.id == id)
    }

    fn call_mut(&mut self, id: &str) -> Option<&mut CallEntry> {
        self.calls.iter_mut().find(|c| c.id == id)
    }

    /// Streamed text of a running generation.
    /// Live text of sample `index` of the generation running for `role` / `branch`.
    pub fn stream(&mut self, role: GenRole, branch: Option<usize>, index: usize, text: &str) {
        let s = match &mut self.streaming {
            Some(s) if s.role == role && s.branch == branch => s,
            _ => self.streaming.insert(Streaming {
                role,
                branch,
                texts: Vec::new(),
            }),
        };
        if s.texts.len() <= index {
            s.texts.resize(index + 1, String::new());
        }
        s.texts[index].push_str(text);
    }

    /// Apply one persisted event.
    pub fn apply(&mut self, e: &EventRecord) {
        let position = self.events;
        self.events += 1;
        let branch = self
            .branches
            .push(e)
            .1
            .and_then(|b| Some((*self.rehearsal_at.get(&b.rehearsal)?, b.index)));
        match &e.event {
            EventBody::EpisodeStart {
                task_id,
                mode,
                tools,
                ..
            } => {
                self.task_id = task_id.clone();
                self.mode = mode.clone();
                self.irreversible_tools = tools
                    .iter()
                    .filter(|t| t.is_irreversible())
                    .map(|t| t.name.clone())
                    .collect();
            }
            EventBody::Generation(g) => {
                self.generated_tokens += g.response_ids.len();
                if g.role == GenRole::Actor && branch.is_none() {
                    self.last_actor_raw = Some(g.text.clone());
                }
                self.streaming = None;
            }
            EventBody::ActorParsed { turn, call_ids } if branch.is_none() => {
                let calls: Vec<(String, ToolCall, bool)> = turn
                    .calls()
                    .iter()
                    .zip(call_ids)
                    .map(|(c, id)| {
                        let irr = self.irreversible_tools.contains(&c.name);
                        (id.clone(), c.clone(), irr)
                    })
                    .collect();
                for (id, call, irr) in &calls {
                    self.calls.push(CallEntry {
                        id: id.clone(),
                        call: call.clone(),
                        irreversible: *irr,
                        simulated: None,
                        real: None,
                        fidelity: None,
                        approval: None,
                    });
                }
                self.actor.push(ActorEntry {
                    content: turn.content.clone(),
                    raw: self.last_actor_raw.take().unwrap_or_default(),
                    calls,
                    format_problems: Vec::new(),
                });
            }
            EventBody::Format { format } if branch.is_none() => {
                if let Some(a) = self.actor.last_mut() {
                    a.format_problems.push(format!("{format:?}"));
                }
            }
            EventBody::Simulated {
                call_id,
                call,
                outcome,
                recalled,
                ..
            } => match branch {
                None => {
                    if let Some(c) = self.call_mut(call_id) {
                        c.simulated = Some(outcome.clone());
                    }
                }
                Some((r, b)) => {
                    if let Some(br) = self.branch_mut(r, b) {
                        match br
                            .steps
                            .iter_mut()
                            .find(|st| st.outcome.is_none() && st.call.name == call.name)
                        {
                            Some(step) => {
                                step.outcome = Some(outcome.clone());
                                step.recalled = *recalled;
                            }
                            None => br.steps.push(ImaginedStep {
                                call: call.clone(),
                                outcome: Some(outcome.clone()),
                                recalled: *recalled,
                            }),
                        }
                    }
                }
            },
            EventBody::Real {
                call_id, response, ..
            } => {
                if let Some(c) = self.call_mut(call_id) {
                    c.real = Some(response.clone());
                }
            }
            EventBody::Fidelity {
                call_id, fidelity, ..
            } => {
                if let Some(c) = self.call_mut(call_id) {
                    c.fidelity = Some(*fidelity);
                }
            }
            EventBody::Approval { call_id, decision } => {
                if let Some(c) = self.call_mut(call_id) {
                    c.approval = Some(decision.clone());
                }
            }
            EventBody::RehearsalStart {
                branches,
                strategy,
                proposed,
                ..
            } => {
                self.rehearsal_at.insert(position, self.rehearsals.len());
                self.rehearsals.push(RehearsalEntry {
                    event_id: e.id.clone(),
                    strategy: *strategy,
                    planned: *branches,
                    proposed: proposed.clone(),
                    branches: Vec::new(),
                    memory: None,
                });
            }
            EventBody::BranchStart { index } => {
                if let Some((r, _)) = branch
                    && let Some(reh) = self.rehearsals.get_mut(r)
                {
                    let steps = if *index == 0 {
                        reh.proposed.iter().map(ImaginedStep::proposed).collect()
                    } else {
                        Vec::new()
                    };
                    reh.branches.push(BranchEntry {
                        index: *index,
                        steps,
                        summary: None,
                    });
                }
            }
            EventBody::ActorParsed { turn, .. } => {
                if let Some((r, b)) = branch
                    && let Some(br) = self.branch_mut(r, b)
                {
                    br.steps
                        .extend(turn.calls().iter().map(ImaginedStep::proposed));
                }
            }
            EventBody::BranchEnd { summary } => {
                if let Some((r, b)) = branch
                    && let Some(br) = self.branch_mut(r, b)
                {
                    br.summary = Some(summary.clone());
                }
            }
            EventBody::RehearsalMemory { text, .. } => {
                if let Some(r) = self.rehearsals.last_mut() {
                    r.memory = Some(text.clone());
                }
            }
            EventBody::EpisodeEnd { reason, .. } => {
                self.end = Some(reason.clone());
                self.streaming = None;
            }
            EventBody::Reward { reward, .. } => self.reward = Some(*reward),
            EventBody::ScoringFailed { message } => {
                self.end = Some(EndReason::Failed {
                    message: format!("scoring failed: {message}"),
                });
            }
            EventBody::Format { .. }
            | EventBody::Message { .. }
            | EventBody::ApprovalRequested { .. } => {}
        }
    }

    fn branch_mut(&mut self, r: usize, b: usize) -> Option<&mut BranchEntry> {
        self.rehearsals
            .get_mut(r)?
            .branches
            .iter_mut()
            .find(|x| x.index == b)
    }

    /// Whether `event_id` lies inside a rehearsal branch.
    pub fn in_branch(&self, event_id: &str) -> bool {
        self.branches.branch(event_id).is_some()
    }
}

/// `name(arg=value, …)` on one line.
pub fn call_line(c: &ToolCall) -> String {
    let args = match c.arguments.as_object() {
        Some(o) => o
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", "),
        None => c.arguments.to_string(),
    };
    format!("{}({args})", c.name)
}

/// A simulated outcome on one line.
pub fn outcome_line(o: &SimulatedOutcome) -> String {
    match o {
        SimulatedOutcome::Parsed { .. } => o
            .value()
            .map(|v| v.to_string())
            .unwrap_or_else(|| "?".into()),
        SimulatedOutcome::Unparseable { error } => format!("unparseable: {error:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_shadow_session_builds_calls_branches_and_reward() {
        let s = crate::session::read_session(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("sessions/bank-shadow-rehearsal.jsonl"),
        )
        .unwrap();
        let v = EpisodeView::from_events(&s.events);
        assert_eq!(v.mode, "shadow");
        assert!(!v.actor.is_empty());
        assert!(
            v.calls
                .iter()
                .any(|c| c.simulated.is_some() && c.real.is_some())
        );
        assert!(!v.rehearsals.is_empty());
        let r = &v.rehearsals[0];
        assert_eq!(r.branches.len(), r.planned);
        assert!(r.branches.iter().all(|b| b.summary.is_some()));
        assert!(r.memory.is_some());
        assert!(v.reward.is_some() && v.end.is_some());
        assert!(v.generated_tokens > 0);
    }

    #[test]
    fn parallel_siblings_stream_side_by_side_not_interleaved() {
        let mut v = EpisodeView::default();
        // One batched request for branches 1..=3: tokens arrive interleaved by sample.
        for piece in ["<tool", "_call", ">"] {
            for i in 0..3 {
                v.stream(GenRole::Actor, Some(1), i, piece);
            }
        }
        let s = v.streaming.as_ref().unwrap();
        let lines = s.lines();
        assert_eq!(lines.len(), 3);
        for (i, (label, text)) in lines.iter().enumerate() {
            assert_eq!(label, &format!("actor (branch {}) ▍", i + 1));
            assert_eq!(*text, "<tool_call>");
        }
        // A new request (the main line) replaces it.
        v.stream(GenRole::Actor, None, 0, "Done");
        let lines = v.streaming.as_ref().unwrap().lines();
        assert_eq!(lines, vec![("actor ▍".to_string(), "Done")]);
    }

    #[test]
    fn a_recalled_branch_call_is_marked_on_its_step() {
        let ev = |seq: u64, parent: Option<&str>, event: serde_json::Value| -> EventRecord {
            serde_json::from_value(serde_json::json!({
                "seq": seq, "id": format!("e{seq}"), "parent": parent, "event": event
            }))
            .unwrap()
        };
        let call = serde_json::json!({"name": "book", "arguments": {"flight": "fl_408"}});
        let error = serde_json::json!({"status": "parsed", "output": {"kind": "result",
            "value": {"error": {"code": "not_found", "message": "flight fl_408 not found"}}}});
        let mut events = vec![ev(
            1,
            None,
            serde_json::json!({"type": "rehearsal_start", "branches": 2,
            "strategy": "parallel", "trigger": "irreversible",
            "depth": {"kind": "turns", "turns": 2}, "proposed": [call]}),
        )];
        // Branch b: its start under the rehearsal, then its one call, recalled in branch 0.
        for b in 0..2u64 {
            let start = format!("e{}", 2 + 2 * b);
            events.push(ev(
                2 + 2 * b,
                Some("e1"),
                serde_json::json!({"type": "branch_start", "index": b}),
            ));
            events.push(ev(
                3 + 2 * b,
                Some(&start),
                serde_json::json!({"type": "simulated", "call_id": format!("b{b}_call_0"),
                "call": call, "outcome": error, "recalled": b == 0}),
            ));
        }
        let v = EpisodeView::from_events(&events);
        let b = &v.rehearsals[0].branches;
        assert_eq!(b.len(), 2);
        // Branch 0's proposed call got the recalled real error; branch 1's was simulated.
        assert_eq!(b[0].steps.len(), 1);
        assert!(b[0].steps[0].recalled && b[0].steps[0].outcome.is_some());
        assert_eq!(b[1].steps.len(), 1);
        assert!(!b[1].steps[0].recalled && b[1].steps[0].outcome.is_some());
    }
}
