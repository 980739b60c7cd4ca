//! The Run tab: settings strip; actor, simulator and rehearsal-branch panes side by side; the
//! real response diffed against the simulated one; and the approval dialog.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Clear, Paragraph, Wrap};

use super::{block, centered};
use crate::engine::types::{Decision, Prediction};
use crate::tui::app::{App, ApprovalDialog};
use crate::tui::diff::{Row, align};
use crate::tui::episode::{call_line, outcome_line};
use crate::tui::highlight::json_lines;
use crate::tui::run_tab::{Pane, RunPhase};

/// Items (turns, calls) drawn per pane; older ones are in the session and the Debugger.
pub const PANE_ITEMS: usize = 200;

/// The Run tab's panes.
pub struct RunLayout {
    pub settings: Rect,
    pub actor: Rect,
    pub simulated: Rect,
    pub branches: Rect,
    pub diff: Rect,
}

pub fn layout(body: Rect) -> RunLayout {
    let [settings, panes, diff] = Layout::vertical([
        Constraint::Length(6),
        Constraint::Percentage(55),
        Constraint::Min(6),
    ])
    .areas(body);
    let [actor, simulated, branches] = Layout::horizontal([
        Constraint::Ratio(1, 3),
        Constraint::Ratio(1, 3),
        Constraint::Ratio(1, 3),
    ])
    .areas(panes);
    RunLayout {
        settings,
        actor,
        simulated,
        branches,
        diff,
    }
}

pub fn draw(app: &App, f: &mut Frame, body: Rect) {
    let t = app.theme();
    let r = &app.run;
    let l = layout(body);

    // Settings strip.
    let mut spans = Vec::new();
    for (i, field) in r.form.fields.iter().enumerate() {
        let sel = r.focus == Pane::Settings && i == r.form.cursor;
        let vs = if sel {
            t.selected().fg(t.c.accent)
        } else {
            t.fg(t.c.fg)
        };
        spans.push(Span::styled(format!("{}: ", field.label), t.muted()));
        spans.push(Span::styled(field.display(), vs));
        spans.push(Span::raw("  "));
    }
    let instr = if r.instruction.is_empty() {
        let task = crate::env::tasks::find_builtin(&r.form.choice("task"));
        match task {
            Some(task) => Line::from(vec![
                Span::styled("task: ", t.muted()),
                Span::raw(task.user_turns().first().cloned().unwrap_or_default()),
                Span::styled("   (i: type your own instruction)", t.muted()),
            ]),
            None => Line::styled("i: type an instruction", t.muted()),
        }
    } else {
        Line::from(vec![
            Span::styled("instruction: ", t.fg(t.c.accent)),
            Span::raw(r.instruction.clone()),
            Span::styled("   (c: clear, unscored run)", t.muted()),
        ])
    };
    let state = match &r.phase {
        RunPhase::Idle => Line::styled("r: run the episode", t.muted()),
        RunPhase::Running { label } => Line::styled(
            format!(
                "running {label}{}",
                if r.awaiting_approval {
                    " — waiting for your approval"
                } else {
                    ""
                }
            ),
            t.fg(t.c.accent),
        ),
        RunPhase::Done { session, result } => match result {
            Ok(reward) => Line::from(vec![
                Span::styled(format!("done, reward {reward:.2}"), t.reward(*reward)),
                Span::styled(format!("  session {}", session.display()), t.muted()),
            ]),
            Err(e) => Line::styled(format!("failed: {e}"), t.fg(t.c.error)),
        },
    };
    f.render_widget(
        Paragraph::new(vec![Line::from(spans), instr, state])
            .wrap(Wrap { trim: true })
            .block(block(t, "Episode", r.focus == Pane::Settings)),
        l.settings,
    );

    // Actor pane (the most recent PANE_ITEMS turns: a frame stays cheap in long episodes).
    let mut lines: Vec<Line> = Vec::new();
    let skip = r.view.actor.len().saturating_sub(PANE_ITEMS);
    if skip > 0 {
        lines.push(Line::styled(
            format!("… {skip} earlier turns (see the Debugger)"),
            t.muted(),
        ));
    }
    for (i, a) in r.view.actor.iter().enumerate().skip(skip) {
        lines.push(Line::styled(format!("turn {}", i + 1), t.muted()));
        if !a.content.trim().is_empty() {
            lines.push(Line::raw(a.content.trim().to_string()));
        }
        for (_, call, irr) in &a.calls {
            let mut s = vec![Span::styled(
                format!("→ {}", call_line(call)),
                t.fg(t.c.tool_call),
            )];
            if *irr {
                s.push(Span::styled(" ⚠ irreversible", t.fg(t.c.irreversible)));
            }
            lines.push(Line::from(s));
        }
        for p in &a.format_problems {
            lines.push(Line::styled(format!("format: {p}"), t.fg(t.c.warning)));
        }
    }
    if let Some(s) = &r.view.streaming
        && s.role == crate::engine::types::GenRole::Actor
    {
        for (who, text) in s.lines() {
            lines.push(Line::styled(who, t.fg(t.c.accent)));
            lines.push(Line::raw(text.to_string()));
        }
    }
    pane(
        app,
        f,
        l.actor,
        "Actor · proposed calls",
        lines,
        PaneScroll {
            scroll: r.scroll[0],
            focused: r.focus == Pane::Actor,
            anchor: None,
        },
    );

    // Simulated pane.
    let mut lines: Vec<Line> = Vec::new();
    let skip = r.view.calls.len().saturating_sub(PANE_ITEMS);
    for c in r.view.calls.iter().skip(skip) {
        if let Some(o) = &c.simulated {
            lines.push(Line::styled(call_line(&c.call), t.fg(t.c.tool_call)));
            lines.push(Line::styled(
                format!("  ⇒ {}", outcome_line(o)),
                t.fg(t.c.simulated),
            ));
        }
    }
    if let Some(s) = &r.view.streaming
        && s.role == crate::engine::types::GenRole::Simulator
    {
        for (who, text) in s.lines() {
            lines.push(Line::styled(who, t.fg(t.c.accent)));
            lines.push(Line::styled(text.to_string(), t.fg(t.c.simulated)));
        }
    }
    if lines.is_empty() && r.view.mode == "real" {
        lines.push(Line::styled("real mode: nothing is simulated", t.muted()));
    }
    pane(
        app,
        f,
        l.simulated,
        "Simulator · predicted responses",
        lines,
        PaneScroll {
            scroll: r.scroll[1],
            focused: r.focus == Pane::Simulated,
            anchor: None,
        },
    );

    // Branches pane.
    let mut lines: Vec<Line> = Vec::new();
    let skip = r.view.rehearsals.len().saturating_sub(PANE_ITEMS / 10);
    let mut last_header = None;
    for (k, reh) in r.view.rehearsals.iter().enumerate().skip(skip) {
        let (ok, bad) = reh.verdict();
        last_header = Some(lines.len());
        lines.push(Line::from(vec![
            Span::styled(
                format!(
                    "rehearsal {} · {:?} · N={}",
                    k + 1,
                    reh.strategy,
                    reh.planned
                )
                .to_lowercase(),
                t.title(),
            ),
            Span::styled(format!("  ✓{ok} ✗{bad}"), t.muted()),
        ]));
        let nb = reh.branches.len();
        for (j, b) in reh.branches.iter().enumerate() {
            let (branch_glyph, stem) = if j + 1 == nb {
                ("└", " ")
            } else {
                ("├", "│")
            };
            let (verdict, style) = match b.summary.as_ref().map(|s| &s.prediction) {
                Some(Prediction::Success) => {
                    ("predicted success".to_string(), t.fg(t.c.reward_good))
                }
                Some(Prediction::Failure { reason }) => {
                    (format!("predicted failure: {reason}"), t.fg(t.c.reward_bad))
                }
                Some(Prediction::Unknown) => ("prediction unknown".to_string(), t.muted()),
                None => ("…".to_string(), t.fg(t.c.accent)),
            };
            lines.push(Line::from(vec![
                Span::styled(format!("{branch_glyph} branch {} ", b.index), t.fg(t.c.fg)),
                Span::styled(verdict, style),
            ]));
            for st in &b.steps {
                lines.push(Line::styled(
                    format!("{stem}  → {}", call_line(&st.call)),
                    t.fg(t.c.tool_call),
                ));
                if let Some(o) = &st.outcome {
                    // A recalled outcome is the real error this call already got: real colour.
                    let (tag, colour) = if st.recalled {
                        ("recalled ", t.c.real)
                    } else {
                        ("", t.c.simulated)
                    };
                    lines.push(Line::styled(
                        format!("{stem}    ⇒ {tag}{}", outcome_line(o)),
                        t.fg(colour),
                    ));
                }
            }
        }
        if let Some(m) = &reh.memory {
            lines.push(Line::styled("memory:", t.muted()));
            for ml in m.lines() {
                lines.push(Line::styled(format!("  {ml}"), t.muted()));
            }
        }
    }
    if lines.is_empty() {
        lines.push(Line::styled(
            "Private Rehearsal branches appear here (N > 0, before irreversible calls)",
            t.muted(),
        ));
    }
    pane(
        app,
        f,
        l.branches,
        "Rehearsal branches",
        lines,
        PaneScroll {
            scroll: r.scroll[2],
            focused: r.focus == Pane::Branches,
            anchor: last_header,
        },
    );

    draw_diff(app, f, l.diff);
}

/// Where a pane's content is scrolled: the user's offset (0 = follow), whether it has focus,
/// and an optional line to keep in view while following.
struct PaneScroll {
    scroll: u16,
    focused: bool,
    anchor: Option<usize>,
}

fn pane(
    app: &App,
    f: &mut Frame,
    area: Rect,
    title: &str,
    lines: Vec<Line<'static>>,
    at: PaneScroll,
) {
    let PaneScroll {
        scroll,
        focused,
        anchor,
    } = at;
    let t = app.theme();
    // Follow the tail unless the user scrolled: clamp the scroll to the content. A pane with an
    // anchor line (the latest rehearsal's header) follows the tail only until that line would
    // scroll out, so its verdict stays in view while the approval dialog asks about it.
    let inner_h = area.height.saturating_sub(2);
    let inner_w = area.width.saturating_sub(2).max(1);
    let heights: Vec<u16> = lines
        .iter()
        .map(|l| (l.width() as u16).div_ceil(inner_w).max(1))
        .collect();
    let rows: u16 = heights.iter().fold(0u16, |a, h| a.saturating_add(*h));
    let max = rows.saturating_sub(inner_h);
    let off = if scroll == 0 && !focused {
        let anchor_row = anchor.map_or(max, |a| {
            heights[..a.min(heights.len())]
                .iter()
                .fold(0u16, |acc, h| acc.saturating_add(*h))
        });
        max.min(anchor_row)
    } else {
        scroll.min(max)
    };
    f.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .scroll((off, 0))
            .block(block(t, title, focused)),
        area,
    );
}

fn draw_diff(app: &App, f: &mut Frame, area: Rect) {
    let t = app.theme();
    let r = &app.run;
    let focused = r.focus == Pane::Diff;
    let Some(i) = r.diff_call() else {
        f.render_widget(
            Paragraph::new(Line::styled(
                "real responses appear here, diffed against the simulator's prediction (shadow mode)",
                t.muted(),
            ))
            .block(block(t, "Real vs simulated", focused)),
            area,
        );
        return;
    };
    let c = &r.view.calls[i];
    let sim = c
        .simulated
        .as_ref()
        .map(|o| match o.value() {
            Some(v) => serde_json::to_string_pretty(&v).unwrap_or_default(),
            None => outcome_line(o),
        })
        .unwrap_or_else(|| "(not simulated)".into());
    let real = c
        .real
        .as_ref()
        .map(|x| serde_json::to_string_pretty(&x.to_json()).unwrap_or_default())
        .unwrap_or_else(|| match c.approval {
            Some(Decision::Reject { .. } | Decision::Terminate) => "(not run: rejected)".into(),
            _ => "(no real response yet)".into(),
        });
    let fid = c
        .fidelity
        .as_ref()
        .map(|x| {
            format!(
                " · exact {} · key F1 {:.2} · values {:.2}",
                if x.exact { "yes" } else { "no" },
                x.key_f1,
                x.value_agreement
            )
        })
        .unwrap_or_default();
    let appr = match &c.approval {
        Some(Decision::Approve) => " · approved",
        Some(Decision::ApproveEdited { .. }) => " · approved (edited)",
        Some(Decision::Reject { .. }) => " · rejected",
        Some(Decision::Terminate) => " · terminated",
        None => "",
    };
    let title = format!(
        "Real vs simulated · call {}/{} {}{}{}  (w focus, ←/→ call)",
        i + 1,
        r.view.calls.len(),
        c.call.name,
        fid,
        appr
    );
    let inner = block(t, &title, focused).inner(area);
    f.render_widget(block(t, &title, focused), area);
    let [left, right] =
        Layout::horizontal([Constraint::Ratio(1, 2), Constraint::Ratio(1, 2)]).areas(inner);
    let sl: Vec<&str> = sim.lines().collect();
    let rl: Vec<&str> = real.lines().collect();
    let hl_s = json_lines(&sim, &t.syntax, 2000);
    let hl_r = json_lines(&real, &t.syntax, 2000);
    let mut ls: Vec<Line> = vec![Line::styled(
        "simulated",
        t.fg(t.c.simulated).add_modifier(Modifier::UNDERLINED),
    )];
    let mut rs: Vec<Line> = vec![Line::styled(
        "real",
        t.fg(t.c.real).add_modifier(Modifier::UNDERLINED),
    )];
    if c.simulated.is_none() || c.real.is_none() {
        // Nothing to compare yet: show each side as it is.
        ls.extend(if c.simulated.is_some() {
            hl_s
        } else {
            vec![Line::styled(sim.clone(), t.muted())]
        });
        rs.extend(if c.real.is_some() {
            hl_r
        } else {
            vec![Line::styled(real.clone(), t.muted())]
        });
    } else {
        let rows = align(&sl, &rl);
        let div = Style::default()
            .bg(t.c.selection_bg)
            .fg(t.c.divergence)
            .add_modifier(Modifier::BOLD);
        let pick = |hl: &[Line<'static>], raw: &[&str], k: usize| -> Line<'static> {
            hl.get(k)
                .cloned()
                .unwrap_or_else(|| Line::raw(raw.get(k).copied().unwrap_or("").to_string()))
        };
        for row in rows {
            match row {
                Row::Same(a, b) => {
                    ls.push(pick(&hl_s, &sl, a));
                    rs.push(pick(&hl_r, &rl, b));
                }
                Row::Changed(a, b) => {
                    ls.push(Line::styled(format!("{} ≠", sl[a]), div));
                    rs.push(Line::styled(format!("{} ≠", rl[b]), div));
                }
                Row::Left(a) => {
                    ls.push(Line::styled(format!("{} −", sl[a]), div));
                    rs.push(Line::raw(""));
                }
                Row::Right(b) => {
                    ls.push(Line::raw(""));
                    rs.push(Line::styled(format!("{} +", rl[b]), div));
                }
            }
        }
    }
    let scroll = r.scroll[3];
    f.render_widget(Paragraph::new(ls).scroll((scroll, 0)), left);
    f.render_widget(Paragraph::new(rs).scroll((scroll, 0)), right);
}

/// The approval dialog for an irreversible (or gated) real call.
pub fn draw_approval(app: &App, f: &mut Frame, area: Rect, d: &ApprovalDialog) {
    let t = app.theme();
    let r = centered(area, 84, 22);
    f.render_widget(Clear, r);
    let req = &d.request;
    let mut lines = vec![Line::from(vec![
        Span::styled("The actor wants to run ", t.fg(t.c.fg)),
        Span::styled(
            req.call.name.clone(),
            t.fg(t.c.tool_call).add_modifier(Modifier::BOLD),
        ),
        Span::raw(" on the real environment"),
    ])];
    if req.irreversible {
        lines.push(Line::styled(
            "⚠ irreversible: this cannot be undone",
            t.fg(t.c.irreversible).add_modifier(Modifier::BOLD),
        ));
    }
    if let Some(v) = &req.rehearsal {
        let style = if v.predicted_failure * 2 < v.branches {
            t.fg(t.c.reward_good)
        } else {
            t.fg(t.c.reward_bad)
        };
        lines.push(Line::styled(
            format!(
                "Private Rehearsal: {} of {} branches predicted success, {} failure, {} unknown",
                v.predicted_success,
                v.branches,
                v.predicted_failure,
                v.branches
                    .saturating_sub(v.predicted_success + v.predicted_failure)
            ),
            style,
        ));
    }
    if let Some(p) = &req.predicted {
        lines.push(Line::styled(
            format!("simulator predicts: {}", outcome_line(p)),
            t.fg(t.c.simulated),
        ));
    }
    lines.push(Line::styled("arguments:", t.muted()));
    let args = serde_json::to_string_pretty(&req.call.arguments).unwrap_or_default();
    lines.extend(json_lines(&args, &t.syntax, 12));
    if let Some(tool) = &d.tool
        && !tool.description.is_empty()
    {
        lines.push(Line::styled(
            format!("tool: {}", tool.description),
            t.muted(),
        ));
    }
    lines.push(Line::raw(""));
    let k = |a| app.keymap.key_for(crate::tui::keymap::Scope::Approval, a);
    use crate::tui::keymap::Action;
    lines.push(Line::from(vec![
        Span::styled(
            format!("[{}] approve", k(Action::Approve)),
            t.fg(t.c.ok).add_modifier(Modifier::BOLD),
        ),
        Span::raw("   "),
        Span::styled(
            format!("[{}] edit arguments", k(Action::EditCall)),
            t.fg(t.c.accent),
        ),
        Span::raw("   "),
        Span::styled(
            format!("[{}] reject with a reason", k(Action::Reject)),
            t.fg(t.c.warning),
        ),
        Span::raw("   "),
        Span::styled(
            format!("[{}] terminate", k(Action::Terminate)),
            t.fg(t.c.error),
        ),
    ]));
    f.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(block(t, "Approval needed", true)),
        r,
    );
}
