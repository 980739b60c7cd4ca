//! The Models tab: models on disk, the loaded model, device and memory.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;

use super::block;
use crate::runtime::tool_format::ToolRendering;
use crate::tui::app::{App, ModelState};

pub fn draw(app: &App, f: &mut Frame, body: Rect) {
    let t = app.theme();
    let m = &app.models;
    let [list, info] = Layout::vertical([Constraint::Min(5), Constraint::Length(9)]).areas(body);
    let mut lines = Vec::new();
    if m.entries.is_empty() {
        lines.push(Line::styled(
            "no models found under models/ or the data directory",
            t.muted(),
        ));
    }
    for (i, e) in m.entries.iter().enumerate() {
        let loaded = matches!(&app.model, ModelState::Ready(info) if crate::tui::models_tab::is_loaded(e, &info.path));
        // Both 19 columns wide.
        let size = if e.format == "remote" {
            format!("{:<6}{:>8}     ", e.format, "–")
        } else {
            format!("{:<5} {:>8.1} MB  ", e.format, e.bytes as f64 / 1e6)
        };
        let row = Line::from(vec![
            Span::styled(if loaded { "● " } else { "  " }, t.fg(t.c.ok)),
            Span::styled(format!("{:<44}", list_name(e)), t.fg(t.c.fg)),
            Span::styled(size, t.muted()),
            Span::styled(e.detail.clone(), t.muted()),
        ]);
        lines.push(if i == m.selected {
            row.style(t.selected())
        } else {
            row
        });
    }
    f.render_widget(
        Paragraph::new(lines).block(block(t, "Models (enter: load)", true)),
        list,
    );
    let mut lines = Vec::new();
    match &app.model {
        ModelState::Loading(p) => lines.push(Line::styled(
            format!("loading {}…", p.display()),
            t.fg(t.c.accent),
        )),
        ModelState::Failed { path, error } => lines.push(Line::styled(
            format!("{}: {error}", path.display()),
            t.fg(t.c.error),
        )),
        ModelState::Ready(i) => {
            lines.push(Line::from(vec![
                Span::styled("path          ", t.muted()),
                Span::raw(i.path.clone()),
            ]));
            lines.push(Line::from(vec![
                Span::styled("architecture  ", t.muted()),
                Span::raw(i.architecture.clone()),
            ]));
            lines.push(Line::from(vec![
                Span::styled("tool format   ", t.muted()),
                Span::raw(match i.tool_rendering {
                    ToolRendering::Template => "the model's chat template".to_string(),
                    r => format!("{r} (tools in the system message)"),
                }),
            ]));
            lines.push(Line::from(vec![
                Span::styled("parameters    ", t.muted()),
                Span::raw(format!("{:.2} M", i.parameters as f64 / 1e6)),
            ]));
            lines.push(Line::from(vec![
                Span::styled("device        ", t.muted()),
                Span::raw(format!("{} · {}", i.device, i.dtype)),
            ]));
            lines.push(Line::from(vec![
                Span::styled("weights hash  ", t.muted()),
                Span::raw(i.hash.chars().take(16).collect::<String>()),
            ]));
        }
    }
    lines.push(Line::from(vec![
        Span::styled("memory (RSS)  ", t.muted()),
        Span::raw(
            m.rss_mb
                .map(|r| format!("{r:.0} MiB"))
                .unwrap_or_else(|| "–".into()),
        ),
    ]));
    lines.push(Line::from(vec![
        Span::styled("compiled for  ", t.muted()),
        Span::raw(format!(
            "cpu{}{}",
            if cfg!(feature = "cuda") {
                " + cuda"
            } else {
                ""
            },
            if cfg!(feature = "metal") {
                " + metal"
            } else {
                ""
            }
        )),
    ]));
    f.render_widget(
        Paragraph::new(lines).block(block(t, "Loaded model", false)),
        info,
    );
}

/// The list's name for an entry: a path, or a remote backend's URL and model name without its
/// options (the tokenizer path would fill the row); a longer one is cut to 43 characters.
fn list_name(e: &crate::tui::models_tab::ModelEntry) -> String {
    let s = e.path.display().to_string();
    let s = if e.format == "remote" {
        s.split('&').next().unwrap_or_default().to_string()
    } else {
        s
    };
    if s.chars().count() > 44 {
        let tail: String = s.chars().skip(s.chars().count() - 42).collect();
        format!("…{tail}")
    } else {
        s
    }
}
