//! Rebuild an episode's tree from `parent` links: the main line, and the rehearsal branches that
//! hang off each `rehearsal_start`. Indices refer to `Session::events`.

use std::collections::HashMap;

use super::schema::{EventBody, EventRecord};

/// Which rehearsal branch an event belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BranchRef {
    /// Index of the `rehearsal_start` event.
    pub rehearsal: usize,
    /// The branch number within that rehearsal.
    pub index: usize,
}

/// One rehearsal branch's events, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchView {
    pub rehearsal: usize,
    pub index: usize,
    pub events: Vec<usize>,
}

/// The event tree of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionTree {
    pub children: Vec<Vec<usize>>,
    pub roots: Vec<usize>,
    pub branch_of: Vec<Option<BranchRef>>,
}

/// The branch rule, in one place: an event belongs to the rehearsal branch its parent belongs
/// to; a `branch_start` opens branch `index` of the event it hangs off (its `rehearsal_start`).
/// Events arrive one at a time in file order ([`SessionTree::build`] over a whole file, the
/// TUI's live episode view as the driver streams them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BranchTracker {
    /// event id → (position in the file, branch).
    seen: HashMap<String, (usize, Option<BranchRef>)>,
    next: usize,
}

impl BranchTracker {
    /// Classify the next event: its parent's position (when the parent is known) and its branch.
    pub fn push(&mut self, e: &EventRecord) -> (Option<usize>, Option<BranchRef>) {
        let parent = e.parent.as_deref().and_then(|p| self.seen.get(p).copied());
        let branch = match (&e.event, parent) {
            (EventBody::BranchStart { index }, Some((p, _))) => Some(BranchRef {
                rehearsal: p,
                index: *index,
            }),
            _ => parent.and_then(|(_, b)| b),
        };
        self.seen.insert(e.id.clone(), (self.next, branch));
        self.next += 1;
        (parent.map(|(p, _)| p), branch)
    }

    /// The branch of an event already pushed.
    pub fn branch(&self, id: &str) -> Option<BranchRef> {
        self.seen.get(id).and_then(|(_, b)| *b)
    }
}

impl SessionTree {
    /// Build from events whose parents precede them (as the reader validates).
    pub fn build(events: &[EventRecord]) -> Self {
        let mut tracker = BranchTracker::default();
        let mut children = vec![Vec::new(); events.len()];
        let mut roots = Vec::new();
        let mut branch_of: Vec<Option<BranchRef>> = Vec::with_capacity(events.len());
        for (i, e) in events.iter().enumerate() {
            let (parent, branch) = tracker.push(e);
            match parent {
                Some(p) => children[p].push(i),
                None => roots.push(i),
            }
            branch_of.push(branch);
        }
        Self {
            children,
            roots,
            branch_of,
        }
    }

    /// Events outside every rehearsal branch, in file order.
    pub fn main_line(&self) -> Vec<usize> {
        (0..self.branch_of.len())
            .filter(|&i| self.branch_of[i].is_none())
            .collect()
    }

    /// All rehearsal branches, in order of first appearance.
    pub fn branches(&self) -> Vec<BranchView> {
        let mut out: Vec<BranchView> = Vec::new();
        for (i, b) in self.branch_of.iter().enumerate() {
            if let Some(b) = b {
                match out
                    .iter_mut()
                    .find(|v| v.rehearsal == b.rehearsal && v.index == b.index)
                {
                    Some(v) => v.events.push(i),
                    None => out.push(BranchView {
                        rehearsal: b.rehearsal,
                        index: b.index,
                        events: vec![i],
                    }),
                }
            }
        }
        out
    }
}

/// Apply the approval gate's edits to `messages`: a call the user approved with edited
/// arguments ran with them, and the conversation the actor saw afterwards carried them (the
/// engine rewrites its conversation; the session's `message` event keeps the proposal, the
/// `approval` event the edit). `indices` are the events to read (a main line, or its prefix).
pub fn apply_approval_edits(
    events: &[EventRecord],
    indices: &[usize],
    messages: &mut [crate::message::Message],
) {
    for &i in indices {
        if let Some(EventBody::Approval {
            call_id,
            decision: super::format::Decision::ApproveEdited { arguments },
        }) = events.get(i).map(|e| &e.event)
        {
            for m in messages.iter_mut() {
                for tc in m.tool_calls.iter_mut().filter(|tc| &tc.id == call_id) {
                    tc.function.arguments = arguments.clone();
                }
            }
        }
    }
}
