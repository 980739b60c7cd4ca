//! `envace sessions`, `envace fork` and `envace diff`: listing saved sessions, re-running one
//! from a step (with an edit), and comparing two.

use std::path::Path;

use anyhow::{Context, Result, bail};

use super::{cancel_on_ctrl_c, episode_status, load_model, outcome_json};
use crate::cli::{DiffArgs, ForkArgs, SessionsArgs};
use envace::engine::driver::PolicyApprover;
use envace::engine::runner::{EpisodeConfig, Policy};
use envace::session::{default_sessions_dir, replay_text};

pub fn sessions(a: SessionsArgs) -> Result<()> {
    use envace::session::index::{SortKey, filter, scan_dir, sort};
    let dir = match a.dir {
        Some(d) => d,
        None => default_sessions_dir().context("no data directory; pass --dir")?,
    };
    let key = match a.sort.as_str() {
        "date" => SortKey::Date,
        "env" | "environment" => SortKey::Environment,
        "task" => SortKey::Task,
        "mode" => SortKey::Mode,
        "steps" => SortKey::Steps,
        "reward" => SortKey::Reward,
        other => bail!("--sort `{other}`: expected date, env, task, mode, steps or reward"),
    };
    let (mut all, errors) = scan_dir(&dir);
    for (p, e) in &errors {
        eprintln!("skipped {}: {e}", p.display());
    }
    sort(&mut all, key, !a.asc);
    let rows = filter(&all, &a.filter);
    if a.json {
        for s in rows {
            println!(
                "{}",
                serde_json::json!({
                    "path": s.path.display().to_string(), "environment": s.environment,
                    "task_id": s.task_id, "mode": s.mode, "model": s.model, "steps": s.steps,
                    "events": s.events, "reward": s.reward, "end": s.end,
                    "created": s.created, "forked_from": s.forked_from, "truncated": s.truncated,
                })
            );
        }
        return Ok(());
    }
    println!(
        "{:<8} {:<20} {:<9} {:>5} {:>6}  {:<12} file",
        "env", "task", "mode", "steps", "reward", "end"
    );
    for s in rows {
        println!(
            "{:<8} {:<20} {:<9} {:>5} {:>6}  {:<12} {}",
            s.environment,
            s.task_id.as_deref().unwrap_or("-"),
            s.mode,
            s.steps,
            s.reward
                .map(|r| format!("{r:.2}"))
                .unwrap_or_else(|| "-".into()),
            s.end.as_deref().unwrap_or("unfinished"),
            s.file_name()
        );
    }
    Ok(())
}

fn parse_edit(spec: &str, flag: &str) -> Result<(String, String)> {
    let (id, content) = spec
        .split_once('=')
        .with_context(|| format!("{flag} `{spec}`: expected EVENT_ID=CONTENT"))?;
    let content = match content.strip_prefix('@') {
        Some(file) => {
            std::fs::read_to_string(file).with_context(|| format!("{flag}: reading {file}"))?
        }
        None => content.to_string(),
    };
    Ok((id.to_string(), content))
}

pub async fn fork(a: ForkArgs) -> Result<()> {
    use envace::engine::fork::{ForkEdit, ForkRequest, fork_path};
    use envace::engine::runner::{recorded_config, run_fork};
    let edit = match (&a.edit_tool, &a.edit_actor) {
        (Some(e), _) => {
            let (event_id, content) = parse_edit(e, "--edit-tool")?;
            Some(ForkEdit::ToolResult { event_id, content })
        }
        (None, Some(e)) => {
            let (event_id, content) = parse_edit(e, "--edit-actor")?;
            Some(ForkEdit::ActorMessage { event_id, content })
        }
        (None, None) => None,
    };
    let req = ForkRequest {
        session: a.session.clone(),
        at_event: a.at.clone(),
        edit,
    };
    // The fork re-runs what the original ran: its recorded episode configuration.
    let original = envace::session::read_session(&a.session)?;
    let mut config = recorded_config(
        &original.header,
        &EpisodeConfig {
            approve: a.approve,
            ..EpisodeConfig::default()
        },
    )
    .with_context(|| format!("{}: line 1", a.session.display()))?;
    config.approve = a.approve;
    if let Some(seed) = a.seed {
        config.seed = seed;
    }
    let (model, profile) = load_model(&a.model, a.device)?;
    let policy = Policy {
        model: &model,
        profile: profile.as_ref(),
    };
    let out = a.out.clone().unwrap_or_else(|| fork_path(&a.session));
    let mut approver = PolicyApprover(config.approve);
    let o = run_fork(
        policy,
        &req,
        &config,
        &out,
        &mut approver,
        None,
        cancel_on_ctrl_c(),
    )
    .await?;
    if a.json {
        println!("{}", outcome_json(&o, &out));
    } else {
        print!("{}", replay_text(&out)?);
        println!("session: {}", out.display());
    }
    episode_status(&o)
}

pub fn diff(a: DiffArgs) -> Result<()> {
    use envace::session::{SessionTree, read_session};
    use envace::tui::debugger::summary;
    use envace::tui::diff::{Row, align};
    let load = |p: &Path| -> Result<Vec<String>> {
        let s = read_session(p)?;
        let main = SessionTree::build(&s.events).main_line();
        Ok(main.iter().map(|&i| summary(&s.events[i])).collect())
    };
    let (sa, sb) = (load(&a.a)?, load(&a.b)?);
    let rows = align(&sa, &sb);
    let same = rows.iter().filter(|r| matches!(r, Row::Same(..))).count();
    if a.json {
        for r in &rows {
            let (kind, l, rr) = match *r {
                Row::Same(x, y) => ("same", Some(&sa[x]), Some(&sb[y])),
                Row::Changed(x, y) => ("changed", Some(&sa[x]), Some(&sb[y])),
                Row::Left(x) => ("only_a", Some(&sa[x]), None),
                Row::Right(y) => ("only_b", None, Some(&sb[y])),
            };
            println!("{}", serde_json::json!({"row": kind, "a": l, "b": rr}));
        }
        return Ok(());
    }
    println!(
        "{} ↔ {}: {same} of {} steps equal",
        a.a.display(),
        a.b.display(),
        rows.len()
    );
    for r in &rows {
        match *r {
            Row::Same(x, _) => println!("  {}", sa[x]),
            Row::Changed(x, y) => println!("- {}\n+ {}", sa[x], sb[y]),
            Row::Left(x) => println!("- {}", sa[x]),
            Row::Right(y) => println!("+ {}", sb[y]),
        }
    }
    Ok(())
}
