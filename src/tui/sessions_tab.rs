//! The Sessions tab's state: the sessions directory as summaries (from
//! `session::index`), sorted and filtered, with a selection and a session marked for diff.

use std::path::PathBuf;

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
