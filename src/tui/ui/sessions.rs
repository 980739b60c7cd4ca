//! The Sessions tab: the sessions directory as a sortable, filterable table.

use ratatui::Frame;
use ratatui::layout::{Constraint, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Cell, Paragraph, Row, Table};

use super::block;
use crate::session::index::SortKey;
use crate::tui::app::App;
use crate::tui::sessions_tab::SessionsTab;

/// First visible row, keeping the selection on screen.
pub fn scroll_offset(s: &SessionsTab, body: Rect) -> usize {
    let visible = usize::from(body.height.saturating_sub(3)).max(1);
    s.selected.saturating_sub(visible - 1)
}

fn date(s: &crate::session::index::SessionSummary) -> String {
    match s.date() {
        Some(t) => chrono::DateTime::<chrono::Utc>::from(t)
            .format("%Y-%m-%d %H:%M")
            .to_string(),
        None => "–".into(),
    }
}

pub fn draw(app: &App, f: &mut Frame, body: Rect) {
    let t = app.theme();
    let s = &app.sessions;
    let rows_all = s.visible();
    let title = format!(
        "Sessions in {} · {} of {} · sort {:?} {}{}",
        app.sessions_dir.display(),
        rows_all.len(),
        s.all.len(),
        s.sort_key(),
        if s.descending { "↓" } else { "↑" },
        if s.filter.is_empty() {
            String::new()
        } else {
            format!(" · filter “{}”", s.filter)
        }
    );
    if rows_all.is_empty() {
        let msg = if !s.scanned {
            "scanning…".to_string()
        } else if s.all.is_empty() {
            "no sessions yet: run an episode in the Run tab (r), or `envace run`".to_string()
        } else {
            "no session matches the filter (esc in / clears it)".to_string()
        };
        f.render_widget(
            Paragraph::new(Line::styled(msg, t.muted())).block(block(t, &title, true)),
            body,
        );
        return;
    }
    let offset = scroll_offset(s, body);
    let visible = usize::from(body.height.saturating_sub(3)).max(1);
    let head = |k: SortKey, name: &'static str| {
        if s.sort_key() == k {
            Cell::from(Span::styled(
                format!("{name}{}", if s.descending { "↓" } else { "↑" }),
                t.fg(t.c.accent),
            ))
        } else {
            Cell::from(Span::styled(name, t.title()))
        }
    };
    let header = Row::new(vec![
        Cell::from(""),
        head(SortKey::Date, "date"),
        head(SortKey::Environment, "env"),
        head(SortKey::Task, "task"),
        head(SortKey::Mode, "mode"),
        head(SortKey::Steps, "steps"),
        head(SortKey::Reward, "reward"),
        Cell::from(Span::styled("end", t.title())),
        Cell::from(Span::styled("file", t.title())),
    ]);
    let rows = rows_all
        .iter()
        .enumerate()
        .skip(offset)
        .take(visible)
        .map(|(i, x)| {
            let marked = s.marked.as_ref() == Some(&x.path);
            let reward = match x.reward {
                Some(r) => Cell::from(Span::styled(format!("{r:.2}"), t.reward(r))),
                None => Cell::from(Span::styled("–", t.muted())),
            };
            let fork = if x.forked_from.is_some() { "⑂ " } else { "" };
            let row = Row::new(vec![
                Cell::from(if marked { "◆" } else { " " }),
                Cell::from(date(x)),
                Cell::from(x.environment.clone()),
                Cell::from(format!(
                    "{fork}{}",
                    x.task_id.clone().unwrap_or_else(|| "–".into())
                )),
                Cell::from(x.mode.clone()),
                Cell::from(x.steps.to_string()),
                reward,
                Cell::from(x.end.clone().unwrap_or_else(|| "unfinished".into())),
                Cell::from(Span::styled(x.file_name(), t.muted())),
            ]);
            if i == s.selected {
                row.style(t.selected())
            } else {
                row
            }
        });
    let table = Table::new(
        rows,
        [
            Constraint::Length(1),
            Constraint::Length(16),
            Constraint::Length(7),
            Constraint::Length(18),
            Constraint::Length(8),
            Constraint::Length(5),
            Constraint::Length(6),
            Constraint::Length(12),
            Constraint::Min(10),
        ],
    )
    .header(header)
    .block(block(t, &title, true));
    f.render_widget(table, body);
}
