//! The debugger's state: a loaded session stepped through like a program. Steps are the
//! main-line events (rehearsal branches hang off their `rehearsal_start` step); each step is
//! marked once at load (error, divergence, irreversible call) so jumps and the timeline
//! scrubber cost nothing per frame. A second session (a fork, or one marked in the Sessions
//! tab) can be loaded beside it for a step-aligned diff.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use ratatui::layout::Rect;

use super::app::{EditTarget, Effect, Level, Slot};
use super::command::{TabCommand, TabContext};
use super::keymap::Action;
use crate::engine::types::{EndReason, SimulatedOutcome};
use crate::message::Role;
use crate::session::{EventBody, EventRecord, Session, SessionTree};

/// What is notable about a step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mark {
    pub error: bool,
    pub divergence: bool,
    pub irreversible: bool,
}

/// A loaded session.
#[derive(Debug, Clone)]
pub struct DebugSession {
    pub path: PathBuf,
    pub session: Session,
    pub tree: SessionTree,
    /// Main-line event indices, in order: the steps.
    pub main: Vec<usize>,
    pub marks: Vec<Mark>,
}

impl DebugSession {
    pub fn new(path: PathBuf, session: Session) -> Self {
        let tree = SessionTree::build(&session.events);
        let main = tree.main_line();
        let irreversible: HashSet<String> = session
            .events
            .iter()
            .find_map(|e| match &e.event {
                EventBody::EpisodeStart { tools, .. } => Some(
                    tools
                        .iter()
                        .filter(|t| t.is_irreversible())
                        .map(|t| t.name.clone())
                        .collect(),
                ),
                _ => None,
            })
            .unwrap_or_default();
        let marks = main
            .iter()
            .map(|&i| mark(&session.events[i], &irreversible))
            .collect();
        Self {
            path,
            session,
            tree,
            main,
            marks,
        }
    }

    pub fn step(&self, i: usize) -> Option<&EventRecord> {
        self.main.get(i).map(|&e| &self.session.events[e])
    }

    /// Rehearsal branches hanging off the event at index `event`.
    pub fn branches_at(&self, event: usize) -> Vec<crate::session::BranchView> {
        self.tree
            .branches()
            .into_iter()
            .filter(|b| b.rehearsal == event)
            .collect()
    }

    pub fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

fn mark(e: &EventRecord, irreversible: &HashSet<String>) -> Mark {
    let mut m = Mark::default();
    match &e.event {
        EventBody::Format { format } => m.error = format.is_failure(),
        EventBody::Real { call, response, .. } => {
            m.error = response.is_error();
            m.irreversible = irreversible.contains(&call.name);
        }
        EventBody::Simulated { outcome, .. } => {
            m.error = matches!(outcome, SimulatedOutcome::Unparseable { .. })
        }
        EventBody::Fidelity { fidelity, .. } => m.divergence = !fidelity.exact,
        EventBody::ApprovalRequested {
            irreversible: i, ..
        } => m.irreversible = *i,
        EventBody::EpisodeEnd { reason, .. } => m.error = !matches!(reason, EndReason::Answered),
        EventBody::Reward { reward, .. } => m.error = *reward < 1.0,
        EventBody::ScoringFailed { .. } => m.error = true,
        _ => {}
    }
    m
}

/// One line summarising an event (timeline rows, diff alignment).
pub fn summary(e: &EventRecord) -> String {
    fn clip(s: &str, n: usize) -> String {
        let one: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
        if one.chars().count() > n {
            format!("{}…", one.chars().take(n).collect::<String>())
        } else {
            one
        }
    }
    match &e.event {
        EventBody::EpisodeStart { task_id, mode, .. } => format!(
            "episode start: {} ({mode})",
            task_id.as_deref().unwrap_or("no task")
        ),
        EventBody::Message { message } => {
            let role = match message.role {
                Role::System => "system",
                Role::User => "user",
                Role::Assistant => "assistant",
                Role::Tool => "tool",
            };
            let calls: Vec<String> = message
                .tool_calls
                .iter()
                .map(|c| super::episode::call_line(&c.function))
                .collect();
            if calls.is_empty() {
                format!("{role}: {}", clip(&message.content, 100))
            } else {
                format!(
                    "{role}: {} {}",
                    clip(&message.content, 40),
                    calls.join("; ")
                )
            }
        }
        EventBody::Generation(g) => {
            format!("{:?} generation: {} tokens", g.role, g.response_ids.len()).to_lowercase()
        }
        EventBody::ActorParsed { turn, .. } => {
            let calls: Vec<String> = turn.calls().iter().map(super::episode::call_line).collect();
            if calls.is_empty() {
                format!("actor answers: {}", clip(&turn.content, 80))
            } else {
                format!("actor calls {}", calls.join("; "))
            }
        }
        EventBody::Format { format } => format!("format: {}", clip(&format!("{format:?}"), 90)),
        EventBody::Simulated {
            call,
            outcome,
            recalled,
            ..
        } => format!(
            // A recalled branch call was answered from the real error already observed, not
            // by the simulator.
            "{} {} → {}",
            if *recalled { "recalled" } else { "simulated" },
            call.name,
            clip(&super::episode::outcome_line(outcome), 80)
        ),
        EventBody::Real { call, response, .. } => format!(
            "real {} → {}",
            call.name,
            clip(&response.to_json().to_string(), 80)
        ),
        EventBody::Fidelity { tool, fidelity, .. } => format!(
            "fidelity {tool}: exact={} key_f1={:.2} values={:.2}",
            fidelity.exact, fidelity.key_f1, fidelity.value_agreement
        ),
        EventBody::ApprovalRequested {
            call, irreversible, ..
        } => format!(
            "approval asked: {}{}",
            super::episode::call_line(call),
            if *irreversible { " [irreversible]" } else { "" }
        ),
        EventBody::Approval { decision, .. } => {
            format!("approval: {}", clip(&format!("{decision:?}"), 80))
        }
        EventBody::RehearsalStart {
            branches, strategy, ..
        } => format!("private rehearsal: {branches} branches ({strategy:?})").to_lowercase(),
        EventBody::BranchStart { index } => format!("branch {index} starts"),
        EventBody::BranchEnd { summary } => {
            format!("branch {} ends: {:?}", summary.index, summary.prediction)
        }
        EventBody::RehearsalMemory { text, .. } => format!("rehearsal memory: {}", clip(text, 80)),
        EventBody::EpisodeEnd { reason, .. } => format!("episode end: {reason:?}"),
        EventBody::Reward {
            reward, partial, ..
        } => {
            format!("reward {reward:.2} (partial {partial:.2})")
        }
        EventBody::ScoringFailed { message } => format!("scoring failed: {}", clip(message, 80)),
    }
}

/// A fork the user asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct ForkSpec {
    pub session: PathBuf,
    /// The main-line event the new run continues after (see `engine::fork` for how events map
    /// to the history).
    pub at_event: String,
    /// (event id, is a tool result, new content)
    pub edit: Option<(String, bool, String)>,
}

impl ForkSpec {
    pub fn file_name(&self) -> String {
        self.session
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// The debugger tab.
#[derive(Debug, Clone, Default)]
pub struct DebuggerTab {
    pub primary: Option<DebugSession>,
    pub other: Option<DebugSession>,
    /// Index into `primary.main`.
    pub cursor: usize,
    pub raw: bool,
    pub tokens: bool,
    pub diff: bool,
    pub detail_scroll: u16,
    /// (path, bytes done, total) while a file loads.
    pub loading: Option<(PathBuf, u64, u64)>,
    /// Decoded tokens per event index (for the token view).
    pub decoded: HashMap<usize, Vec<String>>,
    requested: HashSet<usize>,
    /// Step-aligned rows of primary vs other, computed once when both are loaded.
    diff_rows: Vec<super::diff::Row>,
}

impl DebuggerTab {
    pub fn progress(&mut self, path: PathBuf, done: u64, total: u64) {
        self.loading = Some((path, done, total));
    }

    pub fn load_failed(&mut self) {
        self.loading = None;
    }

    pub fn loaded(&mut self, path: PathBuf, slot: Slot, session: Session) {
        self.loading = None;
        let s = DebugSession::new(path, session);
        match slot {
            Slot::Primary => {
                self.primary = Some(s);
                self.cursor = 0;
                self.detail_scroll = 0;
                self.decoded.clear();
                self.requested.clear();
                if !self.diff {
                    self.other = None;
                }
            }
            Slot::Other => self.other = Some(s),
        }
        self.diff_rows = match (&self.primary, &self.other) {
            (Some(a), Some(b)) => {
                let sa: Vec<String> = a
                    .main
                    .iter()
                    .map(|&i| summary(&a.session.events[i]))
                    .collect();
                let sb: Vec<String> = b
                    .main
                    .iter()
                    .map(|&i| summary(&b.session.events[i]))
                    .collect();
                super::diff::align(&sa, &sb)
            }
            _ => Vec::new(),
        };
    }

    fn steps(&self) -> usize {
        self.primary.as_ref().map_or(0, |p| p.main.len())
    }

    /// The event index under the cursor.
    pub fn current_event(&self) -> Option<usize> {
        self.primary.as_ref()?.main.get(self.cursor).copied()
    }

    fn jump(&mut self, pred: impl Fn(&Mark) -> bool) -> bool {
        let Some(p) = &self.primary else {
            return false;
        };
        let n = p.marks.len();
        for k in 1..=n {
            let i = (self.cursor + k) % n;
            if pred(&p.marks[i]) {
                self.cursor = i;
                self.detail_scroll = 0;
                return true;
            }
        }
        false
    }

    /// Handle an action while this tab is in front.
    pub fn handle(&mut self, a: Action, ctx: &TabContext) -> Vec<TabCommand> {
        match a {
            Action::Fork => self.fork(None, ctx),
            Action::EditFork => match self.editable_at_cursor() {
                Some((event_id, tool, text)) => vec![TabCommand::Edit {
                    target: EditTarget::ForkContent { event_id, tool },
                    text,
                }],
                None => vec![TabCommand::notify(
                    Level::Warn,
                    "select a tool result or an actor message on the main line to edit",
                )],
            },
            Action::ToggleDiff => self.toggle_diff(),
            _ => {
                self.action(a);
                match self.wants_tokens() {
                    Some((event, ids)) => {
                        vec![TabCommand::Effect(Effect::DecodeTokens { event, ids })]
                    }
                    None => Vec::new(),
                }
            }
        }
    }

    /// Fork at the cursor (with an optional edit, from the fork editor), when nothing runs and
    /// a model is ready; the Run tab supplies the options and watches it.
    pub fn fork(&self, edit: Option<(String, bool, String)>, ctx: &TabContext) -> Vec<TabCommand> {
        if ctx.run_busy {
            return vec![TabCommand::notify(
                Level::Warn,
                "an episode is already running",
            )];
        }
        if !ctx.model_ready {
            return vec![TabCommand::notify(
                Level::Warn,
                "the model is not loaded yet",
            )];
        }
        match self.fork_request(edit) {
            Ok(spec) => vec![TabCommand::Fork(spec)],
            Err(e) => vec![TabCommand::Notify(Level::Warn, e)],
        }
    }

    /// Show or hide the diff; with nothing beside the session yet, load the session it was
    /// forked from.
    fn toggle_diff(&mut self) -> Vec<TabCommand> {
        if self.other.is_some() {
            self.diff = !self.diff;
            return Vec::new();
        }
        match self.origin_path() {
            Some(path) => {
                self.diff = true;
                vec![TabCommand::Effect(Effect::LoadSession {
                    path,
                    slot: Slot::Other,
                })]
            }
            None => vec![TabCommand::notify(
                Level::Info,
                "nothing to diff with: mark two sessions with m in the Sessions tab, or open a fork",
            )],
        }
    }

    /// Navigation and view toggles (the keys that stay inside this tab).
    pub fn action(&mut self, a: Action) {
        let n = self.steps();
        let before = self.cursor;
        match a {
            Action::NextStep | Action::Down => {
                self.cursor = (self.cursor + 1).min(n.saturating_sub(1))
            }
            Action::PrevStep | Action::Up => self.cursor = self.cursor.saturating_sub(1),
            Action::PageDown => self.cursor = (self.cursor + 20).min(n.saturating_sub(1)),
            Action::PageUp => self.cursor = self.cursor.saturating_sub(20),
            Action::Top => self.cursor = 0,
            Action::Bottom => self.cursor = n.saturating_sub(1),
            Action::NextError => {
                self.jump(|m| m.error);
            }
            Action::NextDivergence => {
                self.jump(|m| m.divergence);
            }
            Action::NextIrreversible => {
                self.jump(|m| m.irreversible);
            }
            Action::ToggleRaw => self.raw = !self.raw,
            Action::ToggleTokens => self.tokens = !self.tokens,
            Action::Right => self.detail_scroll = self.detail_scroll.saturating_add(5),
            Action::Left => self.detail_scroll = self.detail_scroll.saturating_sub(5),
            _ => {}
        }
        if self.cursor != before {
            self.detail_scroll = 0;
        }
    }

    /// The generation whose tokens the token view needs decoded (asked once per event).
    pub fn wants_tokens(&mut self) -> Option<(usize, Vec<u32>)> {
        if !self.tokens {
            return None;
        }
        let idx = self.current_event()?;
        if self.decoded.contains_key(&idx) || self.requested.contains(&idx) {
            return None;
        }
        let p = self.primary.as_ref()?;
        match &p.session.events[idx].event {
            EventBody::Generation(g) => {
                self.requested.insert(idx);
                Some((idx, g.response_ids.clone()))
            }
            _ => None,
        }
    }

    /// A fork at the cursor, with an optional edit (event id, tool?, content).
    pub fn fork_request(&self, edit: Option<(String, bool, String)>) -> Result<ForkSpec, String> {
        let p = self
            .primary
            .as_ref()
            .ok_or("open a session first (Sessions tab, Enter)")?;
        let at = p.step(self.cursor).ok_or("no step selected")?;
        Ok(ForkSpec {
            session: p.path.clone(),
            at_event: at.id.clone(),
            edit,
        })
    }

    /// The tool result or actor message under the cursor: (event id, is tool, content).
    pub fn editable_at_cursor(&self) -> Option<(String, bool, String)> {
        let p = self.primary.as_ref()?;
        let e = p.step(self.cursor)?;
        match &e.event {
            EventBody::Message { message } if message.role == Role::Tool => Some((
                e.id.clone(),
                true,
                super::highlight::pretty(&message.content),
            )),
            EventBody::Message { message } if message.role == Role::Assistant => {
                Some((e.id.clone(), false, message.content.clone()))
            }
            _ => None,
        }
    }

    /// The session this one was forked from, if it lies beside it.
    pub fn origin_path(&self) -> Option<PathBuf> {
        let p = self.primary.as_ref()?;
        let origin = p.session.header.forked_from.as_ref()?;
        let candidate = PathBuf::from(&origin.session);
        if candidate.is_absolute() {
            return Some(candidate);
        }
        Some(p.path.parent()?.join(candidate))
    }

    /// Step-aligned rows for the diff view (left step, right step), aligned on summaries.
    pub fn diff_rows(&self) -> &[super::diff::Row] {
        &self.diff_rows
    }

    /// Click on the timeline selects that step.
    pub fn click(&mut self, body: Rect, x: u16, y: u16) {
        let l = super::ui::debugger::layout(body);
        let t = l.timeline;
        if x >= t.x && x < t.x + t.width && y > t.y && y + 1 < t.y + t.height {
            let offset = super::ui::debugger::timeline_offset(self, t.height.saturating_sub(2));
            let i = offset + usize::from(y - t.y - 1);
            if i < self.steps() {
                self.cursor = i;
                self.detail_scroll = 0;
            }
        }
        let s = l.scrubber;
        if y == s.y && x >= s.x && x < s.x + s.width && self.steps() > 0 && s.width > 0 {
            let frac = f64::from(x - s.x) / f64::from(s.width.max(1));
            self.cursor = ((frac * self.steps() as f64) as usize).min(self.steps() - 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DebuggerTab {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("sessions/bank-shadow-rehearsal.jsonl");
        let s = crate::session::read_session(&path).unwrap();
        let mut d = DebuggerTab::default();
        d.loaded(path, Slot::Primary, s);
        d
    }

    #[test]
    fn jumps_find_marked_steps_and_wrap() {
        let mut d = sample();
        let p = d.primary.as_ref().unwrap();
        assert!(p.marks.iter().any(|m| m.irreversible));
        d.action(Action::NextIrreversible);
        assert!(d.primary.as_ref().unwrap().marks[d.cursor].irreversible);
        let first = d.cursor;
        d.action(Action::Bottom);
        d.action(Action::NextIrreversible);
        assert_eq!(d.cursor, first, "jumps wrap around");
    }

    #[test]
    fn fork_point_is_the_step_under_the_cursor() {
        let mut d = sample();
        d.action(Action::Bottom);
        let f = d.fork_request(None).unwrap();
        let p = d.primary.as_ref().unwrap();
        assert_eq!(f.at_event, p.step(d.cursor).unwrap().id);
        assert!(DebuggerTab::default().fork_request(None).is_err());
    }

    #[test]
    fn recalled_branch_calls_are_not_labelled_simulated() {
        let rec = |recalled: bool| -> EventRecord {
            serde_json::from_value(serde_json::json!({
                "seq": 7, "id": "e7",
                "event": {
                    "type": "simulated", "call_id": "b0_call_1", "recalled": recalled,
                    "call": {"name": "book", "arguments": {"flight": "fl_1"}},
                    "outcome": {"status": "parsed", "output": {"kind": "result", "value": {"error": "no_seats"}}}
                }
            }))
            .unwrap()
        };
        assert!(
            summary(&rec(true)).starts_with("recalled book → "),
            "{}",
            summary(&rec(true))
        );
        assert!(summary(&rec(false)).starts_with("simulated book → "));
    }

    #[test]
    fn fork_waits_for_a_running_episode_then_a_loaded_model() {
        let mut d = sample();
        let warned = |cmds: Vec<TabCommand>, what: &str| match cmds.as_slice() {
            [TabCommand::Notify(Level::Warn, m)] => m.contains(what),
            _ => false,
        };
        let busy = TabContext {
            run_busy: true,
            model_ready: false,
            ..TabContext::ready()
        };
        assert!(warned(d.handle(Action::Fork, &busy), "already running"));
        let loading = TabContext {
            model_ready: false,
            ..TabContext::ready()
        };
        assert!(warned(d.handle(Action::Fork, &loading), "not loaded"));
        let spec = d.fork_request(None).unwrap();
        assert_eq!(
            d.handle(Action::Fork, &TabContext::ready()),
            vec![TabCommand::Fork(spec)]
        );
    }

    #[test]
    fn toggle_diff_needs_a_second_session_then_flips_the_view() {
        let ctx = TabContext::ready();
        let mut d = sample();
        assert!(matches!(
            d.handle(Action::ToggleDiff, &ctx).as_slice(),
            [TabCommand::Notify(Level::Info, _)]
        ));
        assert!(!d.diff);
        let p = d.primary.clone().unwrap();
        d.loaded(p.path.clone(), Slot::Other, p.session);
        assert!(d.handle(Action::ToggleDiff, &ctx).is_empty());
        assert!(d.diff);
        assert!(d.handle(Action::ToggleDiff, &ctx).is_empty());
        assert!(!d.diff);
    }

    #[test]
    fn diff_of_a_session_with_itself_is_identical() {
        let mut d = sample();
        let p = d.primary.clone().unwrap();
        d.loaded(p.path.clone(), Slot::Other, p.session);
        assert!(super::super::diff::identical(d.diff_rows()));
    }
}
