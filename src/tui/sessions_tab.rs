//! The Sessions tab's state: the sessions directory as summaries (from
//! `session::index`), sorted and filtered, with a selection and a session marked for diff.
//! Opening or comparing sessions happens in the debugger; this tab only asks for it.

use std::path::PathBuf;

use super::app::{EditTarget, Effect, Level, Overlay, Slot};
use super::command::{TabCommand, TabContext};
use super::keymap::Action;
use crate::session::index::{SessionSummary, SortKey, filter, sort};

/// Sort columns in cycling order.
pub const SORT_KEYS: [SortKey; 6] = [
    SortKey::Date,
    SortKey::Environment,
    SortKey::Task,
    SortKey::Mode,
    SortKey::Steps,
    SortKey::Reward,
];

/// The Sessions tab.
#[derive(Debug, Clone)]
pub struct SessionsTab {
    pub all: Vec<SessionSummary>,
    pub filter: String,
    pub sort: usize,
    pub descending: bool,
    pub selected: usize,
    pub marked: Option<PathBuf>,
    pub scanned: bool,
}

impl Default for SessionsTab {
    fn default() -> Self {
        Self {
            all: Vec::new(),
            filter: String::new(),
            sort: 0,
            descending: true,
            selected: 0,
            marked: None,
            scanned: false,
        }
    }
}

impl SessionsTab {
    pub fn set(&mut self, mut v: Vec<SessionSummary>) {
        let keep = self.selected_path();
        sort(&mut v, SORT_KEYS[self.sort], self.descending);
        self.all = v;
        self.scanned = true;
        if let Some(k) = keep
            && let Some(i) = self.visible().iter().position(|s| s.path == k)
        {
            self.selected = i;
        }
        self.clamp();
    }

    /// Rows after filtering, in display order.
    pub fn visible(&self) -> Vec<&SessionSummary> {
        filter(&self.all, &self.filter)
    }

    pub fn clamp(&mut self) {
        let n = self.visible().len();
        self.selected = self.selected.min(n.saturating_sub(1));
    }

    pub fn selected_path(&self) -> Option<PathBuf> {
        self.visible().get(self.selected).map(|s| s.path.clone())
    }

    pub fn sort_key(&self) -> SortKey {
        SORT_KEYS[self.sort]
    }

    pub fn nav(&mut self, a: Action) {
        let n = self.visible().len();
        match a {
            Action::Down => self.selected = (self.selected + 1).min(n.saturating_sub(1)),
            Action::Up => self.selected = self.selected.saturating_sub(1),
            Action::PageDown => self.selected = (self.selected + 10).min(n.saturating_sub(1)),
            Action::PageUp => self.selected = self.selected.saturating_sub(10),
            Action::Top => self.selected = 0,
            Action::Bottom => self.selected = n.saturating_sub(1),
            Action::SortNext => {
                self.sort = (self.sort + 1) % SORT_KEYS.len();
                self.resort();
            }
            Action::SortReverse => {
                self.descending = !self.descending;
                self.resort();
            }
            _ => {}
        }
    }

    /// Handle an action while this tab is in front.
    pub fn handle(&mut self, a: Action, _ctx: &TabContext) -> Vec<TabCommand> {
        match a {
            Action::Confirm => match self.selected_path() {
                // Opening one session leaves any diff.
                Some(path) => vec![
                    TabCommand::SetDiff(false),
                    TabCommand::Effect(Effect::LoadSession {
                        path,
                        slot: Slot::Primary,
                    }),
                ],
                None => Vec::new(),
            },
            Action::Delete => match self.selected_path() {
                Some(p) => vec![TabCommand::Overlay(Overlay::ConfirmDelete(p))],
                None => Vec::new(),
            },
            Action::Filter => vec![TabCommand::Edit {
                target: EditTarget::SessionFilter,
                text: self.filter.clone(),
            }],
            Action::Refresh => vec![TabCommand::Effect(Effect::ScanSessions)],
            Action::MarkDiff => self.mark_diff(),
            _ => {
                self.nav(a);
                Vec::new()
            }
        }
    }

    /// The first press marks the selected session; a press on another one compares the two.
    fn mark_diff(&mut self) -> Vec<TabCommand> {
        let Some(p) = self.selected_path() else {
            return Vec::new();
        };
        match self.marked.take() {
            Some(m) if m != p => vec![
                TabCommand::SetDiff(true),
                TabCommand::Effect(Effect::LoadSession {
                    path: m,
                    slot: Slot::Primary,
                }),
                TabCommand::Effect(Effect::LoadSession {
                    path: p,
                    slot: Slot::Other,
                }),
            ],
            Some(_) => Vec::new(),
            None => {
                self.marked = Some(p);
                vec![TabCommand::notify(
                    Level::Info,
                    "marked for diff: press m on another session to compare",
                )]
            }
        }
    }

    /// The filter as typed so far (the editor updates it on every key).
    pub fn set_filter(&mut self, text: String) {
        self.filter = text;
        self.clamp();
    }

    fn resort(&mut self) {
        let v = std::mem::take(&mut self.all);
        self.set(v);
    }

    /// Select the row under a click (the table starts two rows below the body's top).
    pub fn click(&mut self, body: ratatui::layout::Rect, y: u16) {
        let first = body.y + 2;
        if y >= first {
            let offset = super::ui::sessions::scroll_offset(self, body);
            let i = offset + usize::from(y - first);
            if i < self.visible().len() {
                self.selected = i;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::index::summarize;

    fn tab() -> SessionsTab {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("sessions");
        let mut t = SessionsTab::default();
        t.set(
            ["bank-success.jsonl", "bank-failure.jsonl"]
                .iter()
                .map(|n| summarize(&dir.join(n)).unwrap())
                .collect(),
        );
        t
    }

    #[test]
    fn opening_a_session_leaves_diff_mode_before_loading_it() {
        let mut t = tab();
        let path = t.selected_path().unwrap();
        assert_eq!(
            t.handle(Action::Confirm, &TabContext::ready()),
            vec![
                TabCommand::SetDiff(false),
                TabCommand::Effect(Effect::LoadSession {
                    path,
                    slot: Slot::Primary
                }),
            ]
        );
    }

    #[test]
    fn marking_a_second_session_asks_for_diff_mode_then_loads_both() {
        let ctx = TabContext::ready();
        let mut t = tab();
        let first = t.selected_path().unwrap();
        assert!(matches!(
            t.handle(Action::MarkDiff, &ctx).as_slice(),
            [TabCommand::Notify(Level::Info, _)]
        ));
        assert_eq!(t.marked.as_ref(), Some(&first));
        t.handle(Action::Down, &ctx);
        let second = t.selected_path().unwrap();
        assert_ne!(first, second);
        assert_eq!(
            t.handle(Action::MarkDiff, &ctx),
            vec![
                TabCommand::SetDiff(true),
                TabCommand::Effect(Effect::LoadSession {
                    path: first,
                    slot: Slot::Primary
                }),
                TabCommand::Effect(Effect::LoadSession {
                    path: second,
                    slot: Slot::Other
                }),
            ]
        );
        assert!(t.marked.is_none());
    }
}
