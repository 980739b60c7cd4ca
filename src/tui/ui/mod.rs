//! Drawing. Views only read the [`App`]; one file per tab or dialog. The frame is a tab bar,
//! the active tab's body, and a status bar; overlays (help, palette, approval, confirmations,
//! the text editor) draw on top. Below the minimum size only a notice is drawn.

pub mod debugger;
pub mod models;
pub mod run;
pub mod sessions;
pub mod train;

use ratatui::Frame;
use ratatui::layout::{Alignment, Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span, Text};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Wrap};

use super::app::{App, EditTarget, Level, ModelState, Overlay, Tab, palette_matches};
use super::keymap::Scope;
use super::theme::Theme;
use crate::runtime::tool_format::ToolRendering;

/// The body area for a terminal of this size (between tab bar and status bar).
pub fn body_area(area: Rect) -> Rect {
    Rect {
        x: area.x,
        y: area.y + 1,
        width: area.width,
        height: area.height.saturating_sub(3),
    }
}

/// Draw the whole app.
pub fn draw(app: &App, f: &mut Frame) {
    let area = f.area();
    let t = app.theme();
    f.render_widget(Block::default().style(t.base()), area);
    if area.width < super::app::MIN_WIDTH || area.height < super::app::MIN_HEIGHT {
        let msg = Text::from(vec![
            Line::styled(
                "terminal too small",
                t.fg(t.c.warning).add_modifier(Modifier::BOLD),
            ),
            Line::raw(format!(
                "{}×{} — envace needs at least {}×{}",
                area.width,
                area.height,
                super::app::MIN_WIDTH,
                super::app::MIN_HEIGHT
            )),
            Line::styled("enlarge the window, or press q to quit", t.muted()),
        ]);
        let y = area.height / 2;
        let r = Rect::new(
            area.x,
            area.y + y.saturating_sub(1),
            area.width,
            3.min(area.height),
        );
        f.render_widget(Paragraph::new(msg).alignment(Alignment::Center), r);
        return;
    }
    let [tabs, body, notice, status] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(1),
        Constraint::Length(1),
        Constraint::Length(1),
    ])
    .areas(area);
    draw_tabs(app, f, tabs);
    match app.tab {
        Tab::Run => run::draw(app, f, body),
        Tab::Sessions => sessions::draw(app, f, body),
        Tab::Debugger => debugger::draw(app, f, body),
        Tab::Train => train::draw(app, f, body),
        Tab::Models => models::draw(app, f, body),
    }
    draw_notice(app, f, notice);
    draw_status(app, f, status);
    match &app.overlay {
        Some(Overlay::Help { scroll }) => draw_help(app, f, area, *scroll),
        Some(Overlay::Palette { query, selected }) => draw_palette(app, f, area, query, *selected),
        Some(Overlay::Approval(d)) => run::draw_approval(app, f, area, d),
        Some(Overlay::ConfirmDelete(p)) => {
            let r = centered(area, 60, 5);
            f.render_widget(Clear, r);
            f.render_widget(
                Paragraph::new(vec![
                    Line::raw(format!("Delete {}?", p.display())),
                    Line::styled("enter/a: delete · any other key: keep", t.muted()),
                ])
                .wrap(Wrap { trim: true })
                .block(block(t, "Delete session", true)),
                r,
            );
        }
        None => {}
    }
    if let Some(ed) = &app.editor {
        let multi = !matches!(
            ed.target,
            EditTarget::Instruction
                | EditTarget::RejectReason
                | EditTarget::SessionFilter
                | EditTarget::TrainField(_)
        );
        let h = if multi { area.height * 2 / 3 } else { 5 };
        let r = centered(area, area.width.saturating_sub(10).min(100), h);
        f.render_widget(Clear, r);
        let [edit, err] = Layout::vertical([Constraint::Min(1), Constraint::Length(1)]).areas(r);
        let mut ta = ed.area.clone();
        ta.set_block(block(t, ed.target.title(), true));
        ta.set_cursor_line_style(Style::default());
        f.render_widget(&ta, edit);
        if let Some(e) = &ed.error {
            f.render_widget(
                Paragraph::new(Line::styled(format!(" ✗ {e}"), t.fg(t.c.error))),
                err,
            );
        }
    }
}

/// A bordered block with a title; focus changes the border colour.
pub fn block<'a>(t: &Theme, title: &'a str, focused: bool) -> Block<'a> {
    Block::default()
        .borders(Borders::ALL)
        .border_style(t.border(focused))
        .title(Span::styled(format!(" {title} "), t.title()))
}

/// A rectangle of at most `w`×`h` centred in `area`.
pub fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let w = w.min(area.width);
    let h = h.min(area.height);
    Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    )
}

fn draw_tabs(app: &App, f: &mut Frame, area: Rect) {
    let t = app.theme();
    let mut spans = vec![Span::raw(" ")];
    for (i, tab) in Tab::ALL.iter().enumerate() {
        let style = if *tab == app.tab {
            t.fg(t.c.tab_active)
                .add_modifier(Modifier::BOLD | Modifier::REVERSED)
        } else {
            t.muted()
        };
        spans.push(Span::styled(format!(" {} {} ", i + 1, tab.title()), style));
        spans.push(Span::styled("│", t.muted()));
    }
    let help = app
        .keymap
        .key_for(Scope::Global, super::keymap::Action::Help);
    spans.push(Span::styled(
        format!("  {help} help · ctrl-p commands"),
        t.muted(),
    ));
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

fn draw_notice(app: &App, f: &mut Frame, area: Rect) {
    let t = app.theme();
    let line = match &app.notice {
        Some((level, text)) => {
            let c = match level {
                Level::Info => t.c.ok,
                Level::Warn => t.c.warning,
                Level::Error => t.c.error,
            };
            Line::styled(format!(" {text}"), t.fg(c))
        }
        None => Line::styled(format!(" {}", hint(app)), t.muted()),
    };
    f.render_widget(Paragraph::new(line), area);
}

/// The key hint for the current tab.
fn hint(app: &App) -> &'static str {
    match app.tab {
        Tab::Run => "←/→ field · ↑/↓ value · i instruction · r run · w focus pane · ctrl-c cancel",
        Tab::Sessions => "enter open · / filter · s sort · S reverse · m mark for diff · d delete",
        Tab::Debugger => {
            "n/p step · e error · v divergence · x irreversible · J raw · t tokens · f fork · E edit+fork · D diff"
        }
        Tab::Train => {
            "↑/↓ field · ←/→ value · s start · x stop · R resume · w checkpoints · L load"
        }
        Tab::Models => "↑/↓ select · enter load",
    }
}

fn draw_status(app: &App, f: &mut Frame, area: Rect) {
    let t = app.theme();
    let style = Style::default().fg(t.c.status_fg).bg(t.c.status_bg);
    let model = match &app.model {
        ModelState::Loading(p) => format!("loading {}…", short_path(&p.display().to_string())),
        // Tools rendered into the system message is worth a glance: the model's own template
        // would have dropped them.
        ModelState::Ready(i) if i.tool_rendering != ToolRendering::Template => format!(
            "{} · {} · tools: {} · {}",
            short_path(&i.path),
            i.architecture,
            i.tool_rendering,
            i.device
        ),
        ModelState::Ready(i) => format!(
            "{} · {} · {}",
            short_path(&i.path),
            i.architecture,
            i.device
        ),
        ModelState::Failed { path, .. } => {
            format!("{}: failed", short_path(&path.display().to_string()))
        }
    };
    let r = &app.run;
    let mode = r.form.choice("mode");
    let running = match &r.phase {
        super::run_tab::RunPhase::Running { .. } => {
            const SPIN: [&str; 4] = ["⠋", "⠙", "⠸", "⠴"];
            format!("{} running", SPIN[(app.ticks % 4) as usize])
        }
        super::run_tab::RunPhase::Done { .. } => "done".into(),
        super::run_tab::RunPhase::Idle => "idle".into(),
    };
    let reward = r
        .view
        .reward
        .map(|x| format!("{x:.2}"))
        .unwrap_or_else(|| "–".into());
    let train = if app.train.is_running() {
        format!(
            " · training step {}",
            app.train.last.as_ref().map_or(0, |m| m.step)
        )
    } else {
        String::new()
    };
    let text = format!(
        " {model} │ mode {mode} │ {running} │ step {} │ {:.1} tok/s │ reward {reward}{train} │ theme {}",
        r.view.turns(),
        r.tokens_per_s,
        t.name
    );
    f.render_widget(Paragraph::new(Line::styled(text, style)).style(style), area);
}

/// The last two components of a path.
pub fn short_path(p: &str) -> String {
    let parts: Vec<&str> = p.trim_end_matches('/').rsplit('/').take(2).collect();
    parts.into_iter().rev().collect::<Vec<_>>().join("/")
}

fn draw_help(app: &App, f: &mut Frame, area: Rect, scroll: u16) {
    let t = app.theme();
    let r = centered(area, 90, area.height.saturating_sub(4));
    f.render_widget(Clear, r);
    let mut lines = Vec::new();
    for (scope, rows) in app.keymap.help() {
        if rows.is_empty() {
            continue;
        }
        lines.push(Line::styled(
            scope.name().to_string(),
            t.fg(t.c.accent).add_modifier(Modifier::BOLD),
        ));
        for (keys, help) in rows {
            lines.push(Line::from(vec![
                Span::styled(format!("  {keys:<22}"), t.fg(t.c.tool_call)),
                Span::raw(help),
            ]));
        }
    }
    f.render_widget(
        Paragraph::new(lines).scroll((scroll, 0)).block(block(
            t,
            "Keys (from the keymap; ? or esc closes)",
            true,
        )),
        r,
    );
}

fn draw_palette(app: &App, f: &mut Frame, area: Rect, query: &str, selected: usize) {
    let t = app.theme();
    let r = centered(area, 70, 16);
    f.render_widget(Clear, r);
    let matches = palette_matches(query);
    let sel = selected.min(matches.len().saturating_sub(1));
    let mut lines = vec![Line::from(vec![
        Span::styled("> ", t.fg(t.c.accent)),
        Span::raw(query.to_string()),
        Span::styled("▏", t.fg(t.c.accent)),
    ])];
    let visible = usize::from(r.height.saturating_sub(3));
    let start = sel.saturating_sub(visible.saturating_sub(1));
    for (i, a) in matches.iter().enumerate().skip(start).take(visible) {
        let style = if i == sel {
            t.selected()
        } else {
            Style::default()
        };
        lines.push(Line::from(vec![
            Span::styled(format!("{:<20}", a.name()), style.fg(t.c.tool_call)),
            Span::styled(a.help(), style),
        ]));
    }
    f.render_widget(
        Paragraph::new(lines).block(block(t, "Command palette", true)),
        r,
    );
}
