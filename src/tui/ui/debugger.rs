//! The Debugger tab: a timeline scrubber over the steps (errors, divergences and irreversible
//! calls marked), the step list, and the selected event (pretty or raw JSON, rehearsal
//! branches, or the token view with per-token log-probabilities); or the step-aligned diff of
//! two sessions. Only the rows on screen are formatted, so a 10,000-event session draws as fast
//! as a short one.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Gauge, Paragraph, Wrap};

use super::block;
use crate::session::EventBody;
use crate::tui::app::App;
use crate::tui::debugger::{DebuggerTab, summary};
use crate::tui::diff::Row;
use crate::tui::highlight::json_lines;

/// The debugger's areas.
pub struct DebugLayout {
    pub scrubber: Rect,
    pub timeline: Rect,
    pub detail: Rect,
}

pub fn layout(body: Rect) -> DebugLayout {
    let [head, scrubber, main] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(1),
        Constraint::Min(3),
    ])
    .areas(body);
    let _ = head;
    let [timeline, detail] =
        Layout::horizontal([Constraint::Percentage(45), Constraint::Percentage(55)]).areas(main);
    DebugLayout {
        scrubber,
        timeline,
        detail,
    }
}

/// First visible step of the timeline (`rows` visible), keeping the cursor in view.
pub fn timeline_offset(d: &DebuggerTab, rows: u16) -> usize {
    let rows = usize::from(rows).max(1);
    let n = d.primary.as_ref().map_or(0, |p| p.main.len());
    d.cursor
        .saturating_sub(rows / 2)
        .min(n.saturating_sub(rows))
}

pub fn draw(app: &App, f: &mut Frame, body: Rect) {
    let t = app.theme();
    let d = &app.debugger;
    if let Some((path, done, total)) = &d.loading {
        let ratio = if *total > 0 {
            (*done as f64 / *total as f64).clamp(0.0, 1.0)
        } else {
            0.0
        };
        let r = super::centered(body, body.width.saturating_sub(8), 3);
        f.render_widget(
            Gauge::default()
                .block(block(
                    t,
                    &format!("Loading {} (ctrl-c cancels)", path.display()),
                    true,
                ))
                .gauge_style(t.fg(t.c.accent))
                .ratio(ratio)
                .label(format!(
                    "{:.1} / {:.1} MB",
                    *done as f64 / 1e6,
                    *total as f64 / 1e6
                )),
            r,
        );
        return;
    }
    let Some(p) = &d.primary else {
        f.render_widget(
            Paragraph::new(vec![
                Line::styled("No session open.", t.fg(t.c.fg)),
                Line::styled(
                    "Open one from the Sessions tab (2, then enter), or start envace with --session FILE.",
                    t.muted(),
                ),
            ])
            .block(block(t, "Debugger", true)),
            body,
        );
        return;
    };
    if d.diff {
        return draw_diff(app, f, body);
    }
    let l = layout(body);
    let h = &p.session.header;
    let fork = h
        .forked_from
        .as_ref()
        .map(|o| {
            format!(
                " · forked from {} at {}{}",
                o.session,
                o.event_id,
                if o.edited { " (edited)" } else { "" }
            )
        })
        .unwrap_or_default();
    f.render_widget(
        Paragraph::new(Line::from(vec![
            Span::styled(format!(" {}", p.file_name()), t.title()),
            Span::styled(
                format!(
                    " · {} · {} · {} · step {}/{}{}",
                    h.environment,
                    h.task_id.as_deref().unwrap_or("no task"),
                    h.mode,
                    d.cursor + 1,
                    p.main.len(),
                    fork
                ),
                t.muted(),
            ),
        ])),
        Rect { height: 1, ..body },
    );
    draw_scrubber(app, f, l.scrubber);

    // Timeline.
    let rows = l.timeline.height.saturating_sub(2);
    let offset = timeline_offset(d, rows);
    let mut lines = Vec::new();
    for i in offset..(offset + usize::from(rows)).min(p.main.len()) {
        let e = &p.session.events[p.main[i]];
        let m = p.marks[i];
        let glyph = if m.error {
            Span::styled("✗", t.fg(t.c.error))
        } else if m.irreversible {
            Span::styled("⚠", t.fg(t.c.irreversible))
        } else if m.divergence {
            Span::styled("≠", t.fg(t.c.divergence))
        } else {
            Span::raw(" ")
        };
        let base = if i == d.cursor {
            t.selected()
        } else {
            Style::default()
        };
        let kind_style = match &e.event {
            EventBody::Simulated { .. } => t.fg(t.c.simulated),
            EventBody::Real { .. } => t.fg(t.c.real),
            EventBody::ActorParsed { .. } => t.fg(t.c.tool_call),
            EventBody::RehearsalStart { .. } => t.fg(t.c.accent),
            _ => t.fg(t.c.fg),
        };
        lines.push(
            Line::from(vec![
                Span::styled(format!("{:>5} ", e.seq), t.muted()),
                glyph,
                Span::raw(" "),
                Span::styled(summary(e), kind_style),
            ])
            .style(base),
        );
    }
    f.render_widget(
        Paragraph::new(lines).block(block(t, "Steps (main line)", true)),
        l.timeline,
    );
    draw_detail(app, f, l.detail);
}

fn draw_scrubber(app: &App, f: &mut Frame, area: Rect) {
    let t = app.theme();
    let d = &app.debugger;
    let Some(p) = &d.primary else { return };
    let w = usize::from(area.width.saturating_sub(2)).max(1);
    let n = p.main.len().max(1);
    // Each column covers a range of steps; show the most important mark in it.
    let mut cols: Vec<(char, Style)> = vec![('─', t.muted()); w];
    for (i, m) in p.marks.iter().enumerate() {
        let c = i * w / n;
        let (ch, st, rank) = if m.error {
            ('✗', t.fg(t.c.error), 3)
        } else if m.irreversible {
            ('⚠', t.fg(t.c.irreversible), 2)
        } else if m.divergence {
            ('≠', t.fg(t.c.divergence), 1)
        } else {
            continue;
        };
        let cur_rank = match cols[c].0 {
            '✗' => 3,
            '⚠' => 2,
            '≠' => 1,
            _ => 0,
        };
        if rank > cur_rank {
            cols[c] = (ch, st);
        }
    }
    let cur = (d.cursor * w / n).min(w - 1);
    cols[cur] = ('▲', t.fg(t.c.accent).add_modifier(Modifier::BOLD));
    let mut spans = vec![Span::styled("[", t.muted())];
    spans.extend(
        cols.into_iter()
            .map(|(c, s)| Span::styled(c.to_string(), s)),
    );
    spans.push(Span::styled("]", t.muted()));
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

fn draw_detail(app: &App, f: &mut Frame, area: Rect) {
    let t = app.theme();
    let d = &app.debugger;
    let (Some(p), Some(idx)) = (&d.primary, d.current_event()) else {
        return;
    };
    let e = &p.session.events[idx];
    let mut lines = vec![Line::from(vec![
        Span::styled(format!("#{} {} ", e.seq, e.event.kind()), t.title()),
        Span::styled(
            format!(
                "id {} · parent {} · {}",
                e.id,
                e.parent.as_deref().unwrap_or("–"),
                e.ts.as_deref().unwrap_or("")
            ),
            t.muted(),
        ),
    ])];
    let height = usize::from(area.height.saturating_sub(2)) + usize::from(d.detail_scroll);
    let mut title = if d.raw {
        "Event · raw JSON (J: pretty)"
    } else {
        "Event · pretty (J: raw)"
    };
    if d.tokens
        && let EventBody::Generation(g) = &e.event
    {
        title = "Event · tokens shaded by log-probability (t: JSON)";
        match d.decoded.get(&idx) {
            Some(tokens) => {
                lines.push(Line::from(vec![
                    Span::styled("p ≥ 0.9 ", t.fg(t.c.fg)),
                    Span::styled("p ≥ 0.5 ", t.fg(t.c.ok)),
                    Span::styled("p ≥ 0.1 ", t.fg(t.c.warning)),
                    Span::styled("p < 0.1", t.fg(t.c.error).add_modifier(Modifier::BOLD)),
                ]));
                let mut spans = Vec::new();
                for (k, tok) in tokens.iter().enumerate() {
                    let lp = g.logprobs.get(k).copied().unwrap_or(0.0);
                    let prob = f64::from(lp).exp();
                    let st = if prob >= 0.9 {
                        t.fg(t.c.fg)
                    } else if prob >= 0.5 {
                        t.fg(t.c.ok)
                    } else if prob >= 0.1 {
                        t.fg(t.c.warning)
                    } else {
                        t.fg(t.c.error).add_modifier(Modifier::BOLD)
                    };
                    let shown = tok.replace('\n', "⏎");
                    let st = if k % 2 == 1 {
                        st.add_modifier(Modifier::UNDERLINED)
                    } else {
                        st
                    };
                    spans.push(Span::styled(shown, st));
                    if tok.contains('\n') {
                        lines.push(Line::from(std::mem::take(&mut spans)));
                    }
                }
                lines.push(Line::from(spans));
                let mean = if g.logprobs.is_empty() {
                    0.0
                } else {
                    g.logprobs.iter().map(|x| f64::from(*x)).sum::<f64>() / g.logprobs.len() as f64
                };
                lines.push(Line::styled(
                    format!(
                        "{} tokens · mean log-prob {mean:.3} · finish {:?}",
                        tokens.len(),
                        g.finish
                    ),
                    t.muted(),
                ));
            }
            None => lines.push(Line::styled("decoding tokens…", t.muted())),
        }
    } else if d.raw {
        let raw = serde_json::to_string(e).unwrap_or_default();
        lines.push(Line::raw(raw));
    } else {
        let pretty = serde_json::to_string_pretty(&e.event).unwrap_or_default();
        lines.extend(json_lines(&pretty, &t.syntax, height));
        if let EventBody::RehearsalStart { .. } = &e.event {
            for b in p.branches_at(idx) {
                lines.push(Line::styled(
                    format!("branch {}:", b.index),
                    t.fg(t.c.accent),
                ));
                for &bi in &b.events {
                    lines.push(Line::styled(
                        format!("   {}", summary(&p.session.events[bi])),
                        t.fg(t.c.simulated),
                    ));
                }
            }
        }
    }
    f.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .scroll((d.detail_scroll, 0))
            .block(block(t, title, false)),
        area,
    );
}

fn draw_diff(app: &App, f: &mut Frame, body: Rect) {
    let t = app.theme();
    let d = &app.debugger;
    let (Some(a), other) = (&d.primary, &d.other) else {
        return;
    };
    let Some(b) = other else {
        f.render_widget(
            Paragraph::new(Line::styled("loading the other session…", t.muted()))
                .block(block(t, "Diff", true)),
            body,
        );
        return;
    };
    let rows = d.diff_rows();
    let same = rows.iter().filter(|r| matches!(r, Row::Same(..))).count();
    let title = format!(
        "Step-aligned diff · {} ↔ {} · {} of {} steps equal · reward {} ↔ {} (D: back)",
        a.file_name(),
        b.file_name(),
        same,
        rows.len(),
        reward_of(a),
        reward_of(b)
    );
    let outer = block(t, &title, true);
    let inner = outer.inner(body);
    f.render_widget(outer, body);
    let [left, right] =
        Layout::horizontal([Constraint::Ratio(1, 2), Constraint::Ratio(1, 2)]).areas(inner);
    let h = usize::from(inner.height);
    // Keep the row holding the cursor's step in view.
    let cur_row = rows
        .iter()
        .position(
            |r| matches!(r, Row::Same(x, _) | Row::Changed(x, _) | Row::Left(x) if *x == d.cursor),
        )
        .unwrap_or(0);
    let start = cur_row
        .saturating_sub(h / 2)
        .min(rows.len().saturating_sub(h));
    let div = Style::default()
        .fg(t.c.divergence)
        .add_modifier(Modifier::BOLD);
    let (mut ls, mut rs) = (Vec::new(), Vec::new());
    let line =
        |s: &crate::tui::debugger::DebugSession, i: usize| summary(&s.session.events[s.main[i]]);
    for (k, row) in rows.iter().enumerate().skip(start).take(h) {
        let sel = if k == cur_row {
            t.selected()
        } else {
            Style::default()
        };
        let (l, r) = match *row {
            Row::Same(x, y) => (
                Line::styled(format!("  {}", line(a, x)), t.muted()),
                Line::styled(format!("  {}", line(b, y)), t.muted()),
            ),
            Row::Changed(x, y) => (
                Line::styled(format!("≠ {}", line(a, x)), div),
                Line::styled(format!("≠ {}", line(b, y)), div),
            ),
            Row::Left(x) => (
                Line::styled(format!("− {}", line(a, x)), div),
                Line::raw(""),
            ),
            Row::Right(y) => (
                Line::raw(""),
                Line::styled(format!("+ {}", line(b, y)), div),
            ),
        };
        ls.push(l.patch_style(sel));
        rs.push(r.patch_style(sel));
    }
    f.render_widget(Paragraph::new(ls), left);
    f.render_widget(Paragraph::new(rs), right);
}

fn reward_of(s: &crate::tui::debugger::DebugSession) -> String {
    s.session
        .events
        .iter()
        .rev()
        .find_map(|e| match &e.event {
            EventBody::Reward { reward, .. } => Some(format!("{reward:.2}")),
            _ => None,
        })
        .unwrap_or_else(|| "–".into())
}
