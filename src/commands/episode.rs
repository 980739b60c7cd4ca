//! `envace run` and `envace eval`: one episode (a built-in task or a task of an MCP server's
//! task file) and a domain's split, through `envace::engine::runner`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use super::{
    EXIT_CANCELLED, EXIT_ENVIRONMENT, Exit, cancel_on_ctrl_c, episode_setup, episode_status,
    outcome_json,
};
use crate::cli::{EvalArgs, RunArgs};
use envace::engine::driver::PolicyApprover;
use envace::engine::runner::{
    Episode, EpisodeEnv, EpisodeIo, EvalSet, Policy, eval_domain, header, launch, run_domain_task,
};
use envace::engine::types::EpisodeSpec;
use envace::env::Environment;
use envace::env::domains::Domain;
use envace::env::mcp_client::{McpEnv, load_mcp_task_file};
use envace::env::tasks::{Split, find_builtin};
use envace::session::{SessionWriter, default_sessions_dir, replay_text, resolve_session_path};

/// The MCP server and task file of `envace run`: --mcp/--mcp-url, else the task file's
/// `server` section.
fn mcp_run_config(
    a: &RunArgs,
) -> Result<
    Option<(
        envace::env::mcp_client::McpServerConfig,
        PathBuf,
        envace::env::mcp_client::McpTaskFile,
    )>,
> {
    let explicit = a.mcp.config_with_headers(&a.headers)?;
    let Some(file) = a.task_file.clone() else {
        if explicit.is_some() {
            bail!("--mcp/--mcp-url need --task-file FILE");
        }
        return Ok(None);
    };
    let tf = load_mcp_task_file(&file)?;
    let cfg = match explicit.or_else(|| tf.server_config()) {
        Some(c) => c,
        None => bail!(
            "{}: no server: pass --mcp 'CMD' or --mcp-url URL, or add a `server` section",
            file.display()
        ),
    };
    Ok(Some((cfg, file, tf)))
}

pub async fn run(a: RunArgs) -> Result<()> {
    let (config, model, profile) = episode_setup(&a.mode, &a.model)?;
    let policy = Policy {
        model: &model,
        profile: profile.as_ref(),
    };
    let cancel = cancel_on_ctrl_c();
    let mut approver = PolicyApprover(config.approve);
    let (outcome, path) = if let Some(env) = &a.env {
        let id = a
            .task
            .as_deref()
            .context("--env needs --task ID (see `envace tasks DOMAIN`)")?;
        let task = find_builtin(id)
            .with_context(|| format!("unknown task `{id}` (see `envace tasks {env}`)"))?;
        if task.domain != *env {
            bail!(
                "task `{id}` belongs to domain `{}`, not `{env}`",
                task.domain
            );
        }
        let path = resolve_session_path(a.out.clone(), env, Some(id), config.seed)?;
        let o = run_domain_task(policy, task, &config, &path, &mut approver, None, cancel).await?;
        (o, path)
    } else if let Some((cfg, file, tf)) = mcp_run_config(&a)? {
        let file = &file;
        let task = match &a.task {
            Some(id) => tf
                .tasks
                .iter()
                .find(|t| t.id == *id)
                .with_context(|| format!("{}: no task `{id}`", file.display()))?,
            None => tf
                .tasks
                .first()
                .with_context(|| format!("{}: no tasks", file.display()))?,
        }
        .clone();
        let mut env = McpEnv::connect(cfg).await?.with_tasks(tf.tasks.clone());
        let tools = env.tools().await?;
        if let Err(e) = envace::env::mcp_client::verify_check_tools(file, &tf, &tools) {
            let _ = env.close().await;
            return Err(e.into());
        }
        let spec = EpisodeSpec {
            task_id: Some(task.id.clone()),
            system: envace::engine::spec::mcp_system(&env.name()),
            user_turns: task.turns.clone(),
            tools,
            examples: Vec::new(),
        };
        let name = env.name();
        let path = resolve_session_path(a.out.clone(), &name, Some(&task.id), config.seed)?;
        let mut writer = SessionWriter::create(
            &path,
            &header(policy, &name, Some(task.id.clone()), &config)?,
        )?;
        // Rehearse mode never touches the server: the episode is unscored.
        let io = EpisodeIo {
            env: EpisodeEnv::External(&mut env),
            sink: &mut writer,
            approver: &mut approver,
            ui: None,
            cancel,
        };
        let o = launch(
            policy,
            Episode::new(spec, Some(task.id.clone())),
            &config,
            io,
        )
        .await;
        let o = match o {
            Ok(o) => o,
            Err(e) => {
                let _ = env.close().await;
                return Err(e.into());
            }
        };
        let _ = env.close().await;
        (o, path)
    } else {
        bail!("choose an environment: --env DOMAIN --task ID, or --mcp 'CMD' --task-file FILE");
    };
    if a.json {
        println!("{}", outcome_json(&outcome, &path));
    } else {
        print!("{}", replay_text(&path)?);
        println!("session: {}", path.display());
    }
    episode_status(&outcome)
}

pub async fn eval(a: EvalArgs) -> Result<()> {
    let env = a
        .env
        .as_deref()
        .context("--env DOMAIN is required (BFCL: `envace eval bfcl`)")?;
    let domain = Domain::from_name(env)?;
    let split = match a.split.as_str() {
        "train" => Split::Train,
        "test" => Split::Test,
        other => bail!("--split: `{other}` (train or test)"),
    };
    let (config, model, profile) = episode_setup(&a.mode, &a.model)?;
    let dir: PathBuf = match &a.sessions {
        Some(d) => d.clone(),
        None => default_sessions_dir()
            .context("no user data directory; pass --sessions DIR")?
            .join(format!(
                "eval-{env}-{}-s{}-{}",
                a.split,
                config.seed,
                chrono::Utc::now().format("%Y%m%dT%H%M%S")
            )),
    };
    let quiet = a.json;
    let cancel = cancel_on_ctrl_c();
    let policy = Policy {
        model: &model,
        profile: profile.as_ref(),
    };
    let set = EvalSet {
        domain,
        split,
        limit: a.limit,
    };
    let (summary, outcomes) = eval_domain(
        policy,
        set,
        &config,
        &dir,
        |i, n, o| {
            if !quiet {
                eprintln!("[{i}/{n}] reward {:.2} ({:?})", o.reward(), o.end);
            }
        },
        cancel.clone(),
    )
    .await?;
    let mut v = serde_json::to_value(&summary)?;
    v["sessions"] = dir.display().to_string().into();
    if a.json {
        println!("{v}");
    } else {
        println!("{}", serde_json::to_string_pretty(&v)?);
    }
    // An evaluation succeeds when every episode got its verdict; agent failures are its data.
    use envace::engine::types::EndReason;
    let failed: Vec<(&str, &str)> = outcomes
        .iter()
        .filter_map(|(id, o)| match &o.end {
            EndReason::Failed { message } => Some((id.as_str(), message.as_str())),
            _ => None,
        })
        .collect();
    if cancel.is_cancelled() {
        return Err(Exit {
            code: EXIT_CANCELLED,
            message: format!("cancelled after {} episodes", outcomes.len()),
        }
        .into());
    }
    if !failed.is_empty() {
        return Err(Exit {
            code: EXIT_ENVIRONMENT,
            message: format!(
                "{} episodes failed on environment or model errors: {} (first: {}: {})",
                failed.len(),
                failed.iter().map(|f| f.0).collect::<Vec<_>>().join(", "),
                failed[0].0,
                failed[0].1
            ),
        }
        .into());
    }
    Ok(())
}
