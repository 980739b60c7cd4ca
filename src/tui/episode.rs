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
use crate::session::{EventBody, EventRecord};

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

/// One imagined branch.
#[derive(Debug, Clone, PartialEq)]
pub struct BranchEntry {
    pub index: usize,
    /// (call, simulated outcome once known)
    pub steps: Vec<(ToolCall, Option<SimulatedOutcome>)>,
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
    pub branch: Option<usize>,
    pub text: String,
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
    /// event id → (rehearsal index, branch index) for events inside a rehearsal branch.
    branch_of: HashMap<String, (usize, usize)>,
    /// event id → rehearsal index, for `rehearsal_start` events.
    rehearsal_of: HashMap<String, usize>,
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
    pub fn stream(&mut self, role: GenRole, branch: Option<usize>, text: &str) {
        match &mut self.streaming {
            Some(s) if s.role == role && s.branch == branch => s.text.push_str(text),
            _ => {
                self.streaming = Some(Streaming {
                    role,
                    branch,
                    text: text.to_string(),
                })
            }
        }
    }

    /// Apply one persisted event.
    pub fn apply(&mut self, e: &EventRecord) {
        self.events += 1;
        let parent_branch = e
            .parent
            .as_deref()
            .and_then(|p| self.branch_of.get(p).copied());
        let branch = match (&e.event, e.parent.as_deref()) {
            (EventBody::BranchStart { index }, Some(p)) => {
                self.rehearsal_of.get(p).map(|r| (*r, *index))
            }
            _ => parent_branch,
        };
        if let Some(b) = branch {
            self.branch_of.insert(e.id.clone(), b);
        }
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
                            .find(|(c, o)| o.is_none() && c.name == call.name)
                        {
                            Some(step) => step.1 = Some(outcome.clone()),
                            None => br.steps.push((call.clone(), Some(outcome.clone()))),
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
                self.rehearsal_of
                    .insert(e.id.clone(), self.rehearsals.len());
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
                        reh.proposed.iter().map(|c| (c.clone(), None)).collect()
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
                        .extend(turn.calls().iter().map(|c| (c.clone(), None)));
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
        self.branch_of.contains_key(event_id)
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
}
