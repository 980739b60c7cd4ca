//! Handlers of the episode commands (`run`, `eval`, `export`): argument plumbing only; the work
//! is in `envace::engine::runner` and `envace::session`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::cli::{
    DiffArgs, EvalArgs, ExportArgs, ForkArgs, LoraArgs, MergeArgs, ModeArgs, RunArgs, SessionsArgs,
    SftArgs, TrainArgs,
};
use envace::engine::EpisodeOutcome;
use envace::engine::driver::{PolicyApprover, SharedModel, share_model};
use envace::engine::profile::PromptProfile;
use envace::engine::runner::{
    ConfigError, Episode, EpisodeConfig, EpisodeEnv, EpisodeIo, EvalSet, ModeChoice, Policy,
    eval_domain, header, launch, run_domain_task,
};
use envace::engine::types::EpisodeSpec;
use envace::env::Environment;
use envace::env::domains::Domain;
use envace::env::mcp_client::{McpEnv, load_mcp_task_file};
use envace::env::tasks::{Split, find_builtin};
use envace::runtime::{CancelToken, DeviceChoice};
use envace::session::{SessionWriter, default_sessions_dir, replay_text, resolve_session_path};

/// How the binary's exit status reports an episode command (README, "Exit codes"): returned as
/// an error so that `main` exits with `code` after printing `message` (when not empty).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct Exit {
    pub code: u8,
    pub message: String,
}

/// The episode ran and did not succeed (reward below 1, or it ended on the agent).
pub const EXIT_EPISODE_FAILED: u8 = 1;
/// Bad input or set-up: a flag, file, task or model that cannot be used (clap's usage errors
/// exit 2 as well). Every error that is not classified otherwise.
pub const EXIT_BAD_INPUT: u8 = 2;
/// The environment or the model failed (an MCP server that dies, times out or cannot be
/// reached; an episode that could not be scored).
pub const EXIT_ENVIRONMENT: u8 = 3;
/// Interrupted (Ctrl-C / SIGINT): the session ends as cancelled.
pub const EXIT_CANCELLED: u8 = 130;

/// The exit status of an error that reached `main`.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    if let Some(x) = e.downcast_ref::<Exit>() {
        return x.code;
    }
    let env_failure = |err: &envace::env::EnvError| {
        !matches!(
            err,
            envace::env::EnvError::BadTask { .. }
                | envace::env::EnvError::UnknownDomain(..)
                | envace::env::EnvError::UnknownTask(_)
        )
    };
    for cause in e.chain() {
        if let Some(err) = cause.downcast_ref::<envace::env::EnvError>() {
            return if env_failure(err) {
                EXIT_ENVIRONMENT
            } else {
                EXIT_BAD_INPUT
            };
        }
        if let Some(envace::engine::runner::RunError::Env(err)) =
            cause.downcast_ref::<envace::engine::runner::RunError>()
        {
            return if env_failure(err) {
                EXIT_ENVIRONMENT
            } else {
                EXIT_BAD_INPUT
            };
        }
    }
    EXIT_BAD_INPUT
}

/// Success, or the [`Exit`] that says how one episode went wrong.
fn episode_status(o: &EpisodeOutcome) -> Result<()> {
    use envace::engine::types::EndReason;
    match &o.end {
        EndReason::Cancelled => Err(Exit {
            code: EXIT_CANCELLED,
            message: "cancelled: the session ends as cancelled".into(),
        }
        .into()),
        EndReason::Failed { message } => Err(Exit {
            code: EXIT_ENVIRONMENT,
            message: format!("the episode failed: {message}"),
        }
        .into()),
        _ if o.reward() >= 1.0 => Ok(()),
        end => Err(Exit {
            code: EXIT_EPISODE_FAILED,
            message: format!(
                "the episode did not succeed: reward {:.2} ({end:?})",
                o.reward()
            ),
        }
        .into()),
    }
}

/// A cancel token that Ctrl-C (SIGINT) sets, so that a headless episode ends its session as
/// cancelled instead of leaving it unfinished; a second Ctrl-C exits at once.
fn cancel_on_ctrl_c() -> CancelToken {
    let cancel = CancelToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("interrupted: ending the episode as cancelled (Ctrl-C again to quit now)");
            c.cancel();
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(i32::from(EXIT_CANCELLED));
            }
        }
    });
    cancel
}

/// The episode configuration the flags describe, validated (errors name the flag's field).
pub fn episode_config(m: &ModeArgs) -> Result<EpisodeConfig> {
    use envace::engine::types::{MemoryConfig, PrivateRehearsal};
    let d = PrivateRehearsal::default();
    let pr = PrivateRehearsal {
        branches: m.rehearsals.max(1),
        strategy: m.rehearsal_mode,
        trigger: m.rehearse_on,
        depth: m.rehearsal_depth,
        memory: MemoryConfig {
            format: m.memory_format,
            selection: m.memory_select,
            placement: m.memory_placement,
            commit: m.rehearsal_commit,
            ..MemoryConfig::default()
        },
        sampling: envace::runtime::SamplingParams {
            temperature: m.rehearsal_temperature,
            ..d.sampling
        },
        recall_errors: m.rehearsal_recall,
        explore_temperature: m.rehearsal_explore,
    };
    // The errors name the flag. The rehearsal flags are checked even with --rehearsals 0: a
    // bad value should not pass silently because it happens to be unused.
    let flag = |e: ConfigError| -> anyhow::Error {
        match e {
            ConfigError::Invalid { field, problem } => {
                let flag = match field {
                    "max_turns" => "--max-turns",
                    "actor_temperature" => "--temperature",
                    "rehearsal.branches" => "--rehearsals",
                    "rehearsal.depth" => "--rehearsal-depth",
                    "rehearsal.temperature" => "--rehearsal-temperature",
                    "rehearsal.explore_temperature" => "--rehearsal-explore",
                    "rehearsal.memory.selection" => "--memory-select",
                    other => other,
                };
                anyhow::anyhow!("{flag}: {problem}")
            }
            other => other.into(),
        }
    };
    EpisodeConfig::new(ModeChoice::Shadow)
        .with_rehearsal(Some(pr.clone()))
        .and_then(|c| c.validate())
        .map_err(flag)?;
    let rehearsal = (m.rehearsals > 0).then_some(pr);
    let config = EpisodeConfig {
        approve: m.approve,
        seed: m.seed,
        max_turns: m.max_turns,
        actor_temperature: m.temperature,
        constrain_tool_names: m.constrain_tools,
        ..EpisodeConfig::new(m.mode)
    }
    .with_rehearsal(rehearsal)?;
    config.validate().map_err(flag)?;
    Ok(config)
}

/// Load a model and its prompt profile.
pub fn load_model(
    path: &Path,
    device: DeviceChoice,
) -> Result<(SharedModel, Option<PromptProfile>)> {
    let model = envace::runtime::openai::open_model(path, device)
        .with_context(|| format!("loading model {}", path.display()))?;
    let profile = PromptProfile::for_model(path)?;
    Ok((share_model(model), profile))
}

/// Training needs the weights here: a served model is not trainable.
fn require_local(path: &Path) -> Result<()> {
    if envace::runtime::openai::is_remote(&path.to_string_lossy()) {
        bail!(
            "{}: a remote (openai:) model is not trainable here; train a local copy, or export sessions with `envace export --format verl` and train on a GPU node (docs/SCALE.md)",
            path.display()
        );
    }
    Ok(())
}

fn outcome_json(o: &EpisodeOutcome, session: &Path) -> serde_json::Value {
    serde_json::json!({
        "session": session.display().to_string(),
        "reward": o.reward(),
        "end": o.end,
        "score": o.score,
        "stats": o.stats,
    })
}

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
    let config = episode_config(&a.mode)?;
    envace::runtime::openai::refuse_remote_constraint(
        &a.model.to_string_lossy(),
        a.mode.constrain_tools,
    )?;
    let (model, profile) = load_model(&a.model, a.mode.device)?;
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
    let config = episode_config(&a.mode)?;
    envace::runtime::openai::refuse_remote_constraint(
        &a.model.to_string_lossy(),
        a.mode.constrain_tools,
    )?;
    let (model, profile) = load_model(&a.model, a.mode.device)?;
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

pub fn export(a: ExportArgs) -> Result<()> {
    match a.format.as_str() {
        "openai" => export_openai(a),
        "verl" => export_verl(a),
        other => bail!("--format `{other}`: `openai` or `verl`"),
    }
}

/// `envace export --format verl`: built-in tasks (`--tasks`) or sessions, as parquet rows.
fn export_verl(a: ExportArgs) -> Result<()> {
    use envace::export::verl;
    let out = a
        .out
        .as_deref()
        .context("--format verl writes a parquet file: --out FILE.parquet")?;
    let rows = if a.tasks.is_empty() {
        if a.files.is_empty() {
            bail!("--format verl: give session files or directories, or --tasks DOMAINS");
        }
        let mut paths = Vec::new();
        for f in &a.files {
            if f.is_dir() {
                let mut v: Vec<PathBuf> = std::fs::read_dir(f)
                    .with_context(|| format!("reading {}", f.display()))?
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
                    .collect();
                v.sort();
                paths.extend(v);
            } else {
                paths.push(f.clone());
            }
        }
        verl::rows_from_sessions(&paths, a.include_simulator)?
    } else {
        if !a.files.is_empty() {
            bail!("--tasks exports built-in tasks: give no session files with it");
        }
        let splits: &[Split] = match a.split.as_str() {
            "train" => &[Split::Train],
            "test" => &[Split::Test],
            "all" => &[Split::Train, Split::Test],
            other => bail!("--split: `{other}` (train, test or all)"),
        };
        let mut rows = Vec::new();
        for d in &a.tasks {
            let domain = Domain::from_name(d).with_context(|| format!("--tasks: `{d}`"))?;
            for &split in splits {
                rows.extend(verl::rows_from_tasks(domain, split, a.limit)?);
            }
        }
        // One index across domains and splits (the task id stays in `original_index`).
        for (i, r) in rows.iter_mut().enumerate() {
            r.extra_info.index = i as i64;
        }
        rows
    };
    verl::write_parquet(&rows, out)?;
    if let Some(j) = &a.json {
        verl::write_json(&rows, j)?;
    }
    eprintln!("{} rows → {}", rows.len(), out.display());
    Ok(())
}

fn export_openai(a: ExportArgs) -> Result<()> {
    let [file] = a.files.as_slice() else {
        bail!(
            "--format openai exports one session file (got {})",
            a.files.len()
        );
    };
    let opts = envace::session::export::ExportOptions {
        include_simulator: a.include_simulator,
        ..Default::default()
    };
    let n = match &a.out {
        Some(p) => {
            let mut f =
                std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?;
            envace::session::export_openai(file, &mut f, &opts)?
        }
        None => envace::session::export_openai(file, &mut std::io::stdout(), &opts)?,
    };
    eprintln!("{n} records");
    Ok(())
}

/// The model to train: a checkpoint to resume (full or LoRA), else `model` fully trainable or
/// with fresh LoRA adapters.
fn trainable_model(
    model: &Path,
    lora: &LoraArgs,
    seed: u64,
    resume: Option<&Path>,
    device: &candle_core::Device,
) -> Result<(
    envace::train::model::TrainableModel,
    Option<envace::train::checkpoint::Loaded>,
    PathBuf,
)> {
    use envace::train::lora::LoraConfig;
    use envace::train::model::TrainableModel;
    require_local(model)?;
    Ok(match resume {
        Some(path) => {
            // A run directory resumes from its latest complete checkpoint.
            let dir = &envace::train::checkpoint::resolve_checkpoint(path)?;
            let loaded = envace::train::checkpoint::load_for_resume(dir, device)?;
            let m = TrainableModel::load(dir, device)
                .with_context(|| format!("loading checkpoint {}", dir.display()))?;
            if lora.lora.is_some() && m.lora.is_none() {
                bail!(
                    "--lora with --resume: {} is a full fine-tuning checkpoint",
                    dir.display()
                );
            }
            (m, Some(loaded), dir.to_path_buf())
        }
        None => {
            let m = match lora.lora {
                Some(r) => TrainableModel::load_lora(
                    model,
                    &LoraConfig::new(r, lora.lora_alpha, &lora.lora_targets, seed)?,
                    device,
                ),
                None => TrainableModel::load(model, device),
            }
            .with_context(|| format!("loading model {}", model.display()))?;
            (m, None, model.to_path_buf())
        }
    })
}

fn default_lr(lr: Option<f64>, lora: bool) -> f64 {
    lr.unwrap_or(if lora { 1e-3 } else { 1e-4 })
}

pub fn train(a: TrainArgs) -> Result<()> {
    use envace::train::grpo::{GrpoConfig, GrpoRun, run_grpo};
    use envace::train::metrics::JsonlSink;
    if a.algo != "grpo" {
        bail!("--algo `{}`: only `grpo` is available", a.algo);
    }
    let Some(out) = a.out.clone() else {
        bail!("--out is required");
    };
    if a.epochs == 0 {
        bail!("--epochs 0: at least one optimisation pass per step");
    }
    if a.micro_batch_tokens == Some(0) {
        bail!("--micro-batch-tokens 0: a micro-batch holds at least one row");
    }
    let device = candle_core::Device::Cpu;
    let (model, resume, model_dir) =
        trainable_model(&a.model, &a.lora, a.seed, a.resume.as_deref(), &device)?;
    let cfg = GrpoConfig {
        domains: a.env.split(',').map(str::to_string).collect(),
        mode: a.mode,
        steps: a.steps,
        batch: a.batch,
        group: a.group,
        lr: a.lr.unwrap_or(if model.lora.is_some() {
            1e-3
        } else {
            GrpoConfig::default().lr
        }),
        temperature: a.temperature,
        sim_temperature: a.sim_temperature,
        kl_coef: a.kl,
        entropy_coef: a.entropy,
        seed: a.seed,
        checkpoint_every: a.checkpoint_every,
        time_budget_s: a.minutes.map(|m| m * 60.0),
        grounding_coef: a.grounding,
        grounding_sessions: a.grounding_sessions.clone(),
        rollouts_dir: a.rollouts.clone(),
        collapse_patience: a.collapse_patience,
        epochs: a.epochs,
        frozen: a.freeze.clone(),
        random_entities: a.random_entities,
        entity_style: a.entity_style,
        task_limit: a.limit,
        task_ids: a.tasks.clone(),
        negative_weight: a.negative_weight,
        imitation: a.imitation,
        sim_recall: a.sim_recall,
        roles: envace::train::data::parse_roles(&a.roles)?,
        mask_copies: a.mask_copies,
        micro_batch_tokens: a.micro_batch_tokens,
        ..GrpoConfig::default()
    };
    // Bad settings are refused before the output directory is made.
    cfg.validate()?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut sink = JsonlSink::create(&out.join("metrics.jsonl"), a.json)?;
    let report = run_grpo(
        &cfg,
        GrpoRun {
            model: &model,
            model_dir: &model_dir,
            out: Some(&out),
            resume: resume.as_ref(),
            sink: &mut sink,
            cancel: &CancelToken::new(),
        },
    )?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

/// `envace train sft`: supervised fine-tuning on collected sessions (rows chosen by
/// `envace::train::data`), through the same SFT loop and checkpoints as pretraining.
pub fn train_sft(a: SftArgs) -> Result<()> {
    use envace::train::data::{SessionDataOptions, expand_glob, parse_roles, session_examples};
    use envace::train::metrics::JsonlSink;
    use envace::train::sft::{SftConfig, run_sft};
    let files = expand_glob(&a.sessions)?;
    let device = candle_core::Device::Cpu;
    let (model, resume, model_dir) =
        trainable_model(&a.model, &a.lora, a.seed, a.resume.as_deref(), &device)?;
    let tok_json = model_dir.join("tokenizer.json");
    let tok = envace::runtime::tokenizer::Tokenizer::from_file(&tok_json)?;
    let opts = SessionDataOptions {
        roles: parse_roles(&a.roles)?,
        min_reward: a.min_reward,
    };
    let data = session_examples(&files, &opts, &tok)?;
    if data.examples.is_empty() {
        bail!(
            "--sessions `{}`: no rows pass the filters (--roles {}, --min-reward {}): {}",
            a.sessions,
            a.roles,
            a.min_reward,
            serde_json::to_string(&data.stats)?
        );
    }
    let cfg = SftConfig {
        steps: a.steps,
        batch_size: a.batch,
        lr: default_lr(a.lr, model.lora.is_some()),
        warmup: (a.steps / 10).min(20),
        seed: a.seed,
        // Session prompts are long: never cut the response off.
        max_len: model.decoder.cfg.max_position_embeddings,
        checkpoint_every: a.checkpoint_every,
        ..SftConfig::default()
    };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut sink = JsonlSink::create(&a.out.join("metrics.jsonl"), a.json)?;
    let report = run_sft(
        &model,
        &data.examples,
        &cfg,
        &tok_json,
        Some(&a.out),
        resume.as_ref(),
        &mut sink,
        &CancelToken::new(),
    )?;
    println!(
        "{}",
        serde_json::to_string_pretty(&serde_json::json!({
            "data": data.stats,
            "trainable_parameters": model.trainable_parameters(),
            "lora": model.lora.as_ref().map(|c| c.to_peft_json()),
            "report": report,
            "final": a.out.join("final"),
        }))?
    );
    Ok(())
}

/// `envace merge`.
pub fn merge(a: MergeArgs) -> Result<()> {
    let r = envace::train::lora::merge_adapter(&a.model, &a.adapter, &a.out)?;
    println!("{}", serde_json::to_string_pretty(&r)?);
    Ok(())
}

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

/// The `--rehearsal-task` of `envace bench generate` (checked before the benchmark runs):
/// `None` for `none`.
pub fn bench_rehearsal_task(task: &str) -> Result<Option<&'static envace::env::tasks::Task>> {
    if task == "none" {
        return Ok(None);
    }
    find_builtin(task)
        .map(Some)
        .with_context(|| format!("--rehearsal-task: unknown task `{task}` (or `none`)"))
}

/// `rehearsal_ms` of `envace bench generate`: the first Private Rehearsal of `task` played by
/// `model` in real mode. `None` when the episode never rehearsed (the model proposed no
/// irreversible call).
pub fn bench_rehearsal(
    model: envace::runtime::LocalModel,
    path: &Path,
    task: &envace::env::tasks::Task,
) -> Result<Option<f64>> {
    let profile = PromptProfile::for_model(path)?;
    let model = share_model(Box::new(model));
    let policy = Policy {
        model: &model,
        profile: profile.as_ref(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(envace::engine::bench::rehearsal_ms(policy, task, 0))?)
}

/// `bench generate --contend N`: `decode_tok_s` measured again beside a [`Competitor`] of `N`
/// busy threads, and its ratio to the quiet figure already in `r`.
pub fn bench_contended(
    model: &envace::runtime::LocalModel,
    a: &crate::cli::BenchGenerateArgs,
    r: &mut envace::runtime::bench::GenerateBench,
) -> Result<()> {
    let competitor = Competitor::spawn(usize::from(a.contend))?;
    let rate = envace::runtime::bench::decode_rate(model, a.prompt_tokens, a.new_tokens, a.runs);
    drop(competitor);
    let rate = rate?;
    r.contend_threads = usize::from(a.contend);
    r.decode_tok_s_contended = Some(rate);
    r.contended_ratio = Some(rate / r.decode_tok_s);
    Ok(())
}

/// A competing process for `bench generate --contend`: a child `envace bench spin` that keeps
/// its threads busy until dropped (its standard input closes with the pipe, so it also ends if
/// this process dies first).
pub struct Competitor {
    child: std::process::Child,
}

impl Competitor {
    pub fn spawn(threads: usize) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the envace binary")?;
        let child = std::process::Command::new(&exe)
            .args(["bench", "spin", "--threads", &threads.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting the competing process {}", exe.display()))?;
        // Let its threads get going before anything is timed.
        std::thread::sleep(std::time::Duration::from_millis(300));
        Ok(Self { child })
    }
}

impl Drop for Competitor {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        if let Err(err) = self.child.kill() {
            tracing::debug!("competing process already gone: {err}");
        }
        if let Err(err) = self.child.wait() {
            tracing::debug!("waiting for the competing process: {err}");
        }
    }
}

/// `envace bench spin`: `threads` busy threads until standard input reaches its end.
pub fn spin(threads: usize) -> Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            })
        })
        .collect();
    std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink())
        .context("reading standard input")?;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        if w.join().is_err() {
            bail!("a spinning thread panicked");
        }
    }
    Ok(())
}
