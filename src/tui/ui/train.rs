//! The Train tab: the GRPO configuration form, checkpoints, live charts of the trainer's
//! metrics (reward per role, loss, simulator quality, tokens/s) and the log tail.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::Color;
use ratatui::symbols;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Chart, Dataset, GraphType, Paragraph, Wrap};

use super::block;
use crate::tui::app::App;
use crate::tui::train_tab::{TrainFocus, TrainPhase};

pub fn draw(app: &App, f: &mut Frame, body: Rect) {
    let t = app.theme();
    let tr = &app.train;
    let [left, right] =
        Layout::horizontal([Constraint::Length(42), Constraint::Min(30)]).areas(body);
    let [form_a, ckpt_a] = Layout::vertical([
        Constraint::Length(tr.form.fields.len() as u16 + 3),
        Constraint::Min(3),
    ])
    .areas(left);

    let mut lines: Vec<Line> = tr
        .form
        .fields
        .iter()
        .enumerate()
        .map(|(i, fld)| {
            let sel = tr.focus == TrainFocus::Form && i == tr.form.cursor;
            let vs = if sel {
                t.selected().fg(t.c.accent)
            } else {
                t.fg(t.c.fg)
            };
            Line::from(vec![
                Span::styled(format!("{:<17}", fld.label), t.muted()),
                Span::styled(fld.display(), vs),
            ])
        })
        .collect();
    let state = match &tr.phase {
        TrainPhase::Idle => Line::styled("s: start · R: resume from checkpoint", t.muted()),
        TrainPhase::Running => Line::styled(
            format!("running · step {}", tr.last.as_ref().map_or(0, |m| m.step)),
            t.fg(t.c.accent),
        ),
        TrainPhase::Done(Ok(s)) => Line::styled(format!("done: {s}"), t.fg(t.c.ok)),
        TrainPhase::Done(Err(e)) => Line::styled(format!("failed: {e}"), t.fg(t.c.error)),
    };
    lines.push(state);
    f.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: true }).block(block(
            t,
            "GRPO configuration",
            tr.focus == TrainFocus::Form,
        )),
        form_a,
    );

    let ck: Vec<Line> = if tr.checkpoints.is_empty() {
        vec![Line::styled("no checkpoints yet", t.muted())]
    } else {
        tr.checkpoints
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let name = super::short_path(&p.display().to_string());
                if i == tr.selected_checkpoint && tr.focus == TrainFocus::Checkpoints {
                    Line::styled(name, t.selected())
                } else {
                    Line::raw(name)
                }
            })
            .collect()
    };
    f.render_widget(
        Paragraph::new(ck).block(block(
            t,
            "Checkpoints (L: load into Run)",
            tr.focus == TrainFocus::Checkpoints,
        )),
        ckpt_a,
    );

    let [charts, log] = Layout::vertical([Constraint::Min(8), Constraint::Length(7)]).areas(right);
    let [top, bottom] =
        Layout::vertical([Constraint::Ratio(1, 2), Constraint::Ratio(1, 2)]).areas(charts);
    let [c1, c2] =
        Layout::horizontal([Constraint::Ratio(1, 2), Constraint::Ratio(1, 2)]).areas(top);
    let [c3, c4] =
        Layout::horizontal([Constraint::Ratio(1, 2), Constraint::Ratio(1, 2)]).areas(bottom);
    chart(
        app,
        f,
        c1,
        "Reward per role",
        &[
            ("reward_actor", "actor", t.c.tool_call),
            ("reward_simulator", "simulator", t.c.simulated),
        ],
    );
    chart(
        app,
        f,
        c2,
        "Loss",
        &[("loss", "loss", t.c.accent), ("kl", "KL", t.c.muted)],
    );
    chart(
        app,
        f,
        c3,
        "Simulator",
        &[
            ("sim_fidelity", "fidelity", t.c.real),
            ("sim_failure_rate", "format failures", t.c.error),
        ],
    );
    chart(
        app,
        f,
        c4,
        "Tokens / s",
        &[("tokens_per_s", "tok/s", t.c.ok)],
    );

    let h = usize::from(log.height.saturating_sub(2));
    let lines: Vec<Line> = tr
        .logs
        .iter()
        .skip(tr.logs.len().saturating_sub(h))
        .map(|l| Line::raw(l.clone()))
        .collect();
    f.render_widget(Paragraph::new(lines).block(block(t, "Log", false)), log);
}

fn chart(app: &App, f: &mut Frame, area: Rect, title: &str, series: &[(&str, &str, Color)]) {
    let t = app.theme();
    let tr = &app.train;
    type Series<'a> = (&'a str, &'a [(f64, f64)], Color);
    let present: Vec<Series> = series
        .iter()
        .filter_map(|(k, name, c)| tr.series.get(*k).map(|v| (*name, v.as_slice(), *c)))
        .filter(|(_, v, _)| !v.is_empty())
        .collect();
    if present.is_empty() {
        f.render_widget(
            Paragraph::new(Line::styled("no data yet", t.muted())).block(block(t, title, false)),
            area,
        );
        return;
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (_, v, _) in &present {
        for (x, y) in v.iter() {
            x0 = x0.min(*x);
            x1 = x1.max(*x);
            y0 = y0.min(*y);
            y1 = y1.max(*y);
        }
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
        y0 -= 1.0;
    }
    let last: Vec<String> = present
        .iter()
        .map(|(n, v, _)| format!("{n} {:.3}", v.last().map_or(0.0, |p| p.1)))
        .collect();
    let datasets = present
        .iter()
        .map(|(name, v, c)| {
            Dataset::default()
                .name(name.to_string())
                .marker(symbols::Marker::Braille)
                .graph_type(GraphType::Line)
                .style(t.fg(*c))
                .data(v)
        })
        .collect();
    let title = format!("{title} · {}", last.join(" · "));
    let ch = Chart::new(datasets)
        .block(block(t, &title, false))
        .x_axis(
            Axis::default()
                .bounds([x0, x1])
                .labels(vec![
                    Span::raw(format!("{x0:.0}")),
                    Span::raw(format!("{x1:.0}")),
                ])
                .style(t.muted()),
        )
        .y_axis(
            Axis::default()
                .bounds([y0, y1])
                .labels(vec![
                    Span::raw(format!("{y0:.2}")),
                    Span::raw(format!("{y1:.2}")),
                ])
                .style(t.muted()),
        );
    f.render_widget(ch, area);
}
