//! Runs whole episodes for the CLI, the TUI and evaluation: builds the engine configuration from
//! user options and the model's prompt profile, picks the environment access the mode allows
//! (a live environment, or a verifier used only after a rehearsed episode), writes the session.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::driver::{
    ApprovalHook, ApprovalPolicy, Driver, DriverError, DriverEvent, EnvAccess, SharedModel,
};
use crate::engine::eval::EvalSummary;
use crate::engine::fsm::{Engine, EngineError, EpisodeOutcome, played_calls};
use crate::engine::profile::PromptProfile;
use crate::engine::spec::task_spec;
use crate::engine::types::{
    EngineConfig, EpisodeSpec, LiveOptions, MemoryConfig, Mode, PrivateRehearsal, RehearsalDepth,
    RehearsalStrategy, RehearsalTrigger,
};
use crate::env::domain_env::DomainEnv;
use crate::env::domains::Domain;
use crate::env::tasks::{Split, Task, list_tasks};
use crate::env::{EnvError, Environment};
use crate::message::Message;
use crate::runtime::CancelToken;
use crate::session::schema::{ModelRef, SessionHeader};
use crate::session::{EventSink, SessionError, SessionWriter};

/// How the world answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ModeChoice {
    Real,
    Rehearse,
    Shadow,
}

/// Options shared by `envace run`, `envace eval`, the TUI's Run tab and rollouts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunOptions {
    pub mode: ModeChoice,
    /// Private Rehearsal branches (0 = off). Needs a real environment (real or shadow mode).
    pub rehearsals: usize,
    pub rehearsal_mode: RehearsalStrategy,
    pub rehearse_on: RehearsalTrigger,
    pub approve: ApprovalPolicy,
    pub seed: u64,
    pub max_turns: u32,
    /// Actor sampling temperature (0 = greedy).
    pub temperature: f64,
    /// How Private Rehearsal imagines and what its memory looks like.
    #[serde(default)]
    pub rehearsal: RehearsalTuning,
}

/// Private Rehearsal knobs beyond N, strategy and trigger (defaults: `PrivateRehearsal`'s).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RehearsalTuning {
    pub depth: RehearsalDepth,
    pub memory: MemoryConfig,
    /// Sampling temperature of the imagined turns and simulations.
    pub temperature: f64,
    /// See [`PrivateRehearsal::recall_errors`].
    #[serde(default = "crate::engine::types::default_recall_errors")]
    pub recall_errors: bool,
    /// See [`PrivateRehearsal::explore_temperature`].
    #[serde(default)]
    pub explore_temperature: Option<f64>,
}

impl Default for RehearsalTuning {
    fn default() -> Self {
        let d = PrivateRehearsal::default();
        Self {
            depth: d.depth,
            memory: d.memory,
            temperature: d.sampling.temperature,
            recall_errors: d.recall_errors,
            explore_temperature: d.explore_temperature,
        }
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            mode: ModeChoice::Real,
            rehearsals: 0,
            rehearsal_mode: RehearsalStrategy::Parallel,
            rehearse_on: RehearsalTrigger::Irreversible,
            approve: ApprovalPolicy::Always,
            seed: 0,
            max_turns: 8,
            temperature: 0.0,
            rehearsal: RehearsalTuning::default(),
        }
    }
}

/// Failures of a run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("private rehearsal needs a real environment: use --mode real or --mode shadow")]
    RehearsalWithoutEnvironment,
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Fork(#[from] crate::engine::fork::ForkError),
    #[error(
        "a played history cannot be replayed on an external environment (its calls would run \
         again for real); start from a built-in domain"
    )]
    HistoryOnExternal,
}

/// The engine configuration for `opts` and a model's profile.
pub fn engine_config(
    opts: &RunOptions,
    profile: Option<&PromptProfile>,
) -> Result<EngineConfig, RunError> {
    let live = || LiveOptions {
        private_rehearsal: (opts.rehearsals > 0).then(|| {
            let d = PrivateRehearsal::default();
            PrivateRehearsal {
                branches: opts.rehearsals,
                strategy: opts.rehearsal_mode,
                trigger: opts.rehearse_on,
                depth: opts.rehearsal.depth,
                memory: opts.rehearsal.memory.clone(),
                sampling: crate::runtime::SamplingParams {
                    temperature: opts.rehearsal.temperature,
                    ..d.sampling
                },
                recall_errors: opts.rehearsal.recall_errors,
                explore_temperature: opts.rehearsal.explore_temperature,
            }
        }),
        ..LiveOptions::default()
    };
    let mode = match opts.mode {
        ModeChoice::Real => Mode::Real(live()),
        ModeChoice::Shadow => Mode::Shadow(live()),
        ModeChoice::Rehearse => {
            if opts.rehearsals > 0 {
                return Err(RunError::RehearsalWithoutEnvironment);
            }
            Mode::Rehearse
        }
    };
    let mut cfg = EngineConfig {
        mode,
        max_turns: opts.max_turns,
        ..EngineConfig::default()
    };
    cfg.actor_sampling.temperature = opts.temperature;
    if let Some(p) = profile {
        cfg.sim_prompt = p.sim_prompt.clone();
        cfg.actor_thinking = p.actor_thinking;
    }
    Ok(cfg.with_seed(opts.seed))
}

/// What the episode may touch besides the model.
pub enum EpisodeEnv<'a> {
    /// Real/shadow: live; rehearse: used only as the post-episode verifier (a fresh copy).
    Domain(&'a mut dyn Environment),
    /// A server with real side effects: live in real/shadow mode; never touched in rehearse
    /// mode (the episode is then unscored).
    External(&'a mut dyn Environment),
}

/// Run one episode of `spec`.
#[allow(clippy::too_many_arguments)]
pub async fn run_episode(
    model: &SharedModel,
    spec: EpisodeSpec,
    cfg: EngineConfig,
    env: EpisodeEnv<'_>,
    task_id: Option<String>,
    approver: &mut dyn ApprovalHook,
    sink: &mut dyn EventSink,
    ui: Option<UnboundedSender<DriverEvent>>,
    cancel: CancelToken,
) -> Result<EpisodeOutcome, RunError> {
    run_episode_from(
        model,
        spec,
        Vec::new(),
        cfg,
        env,
        task_id,
        approver,
        sink,
        ui,
        cancel,
    )
    .await
}

/// Run one episode of `spec` starting after a played `history` (a fork; see
/// [`Engine::with_history`]). In real and shadow mode the live environment is reset and then
/// brought to the state after the history by replaying its played calls
/// ([`replay_history`]); rehearse mode needs nothing (the verifier replays the whole trace,
/// history included). An external environment with a history is refused in live modes: its
/// calls would run again for real.
#[allow(clippy::too_many_arguments)]
pub async fn run_episode_from(
    model: &SharedModel,
    spec: EpisodeSpec,
    history: Vec<Message>,
    cfg: EngineConfig,
    env: EpisodeEnv<'_>,
    task_id: Option<String>,
    approver: &mut dyn ApprovalHook,
    sink: &mut dyn EventSink,
    ui: Option<UnboundedSender<DriverEvent>>,
    cancel: CancelToken,
) -> Result<EpisodeOutcome, RunError> {
    let rehearse = matches!(cfg.mode, Mode::Rehearse);
    let played = !played_calls(&history).is_empty();
    let mut engine = Engine::new(spec, cfg)?.with_history(history.clone())?;
    let access = match (rehearse, env) {
        (true, EpisodeEnv::Domain(env)) => EnvAccess::VerifyAfter {
            verifier: env,
            task_id,
        },
        (true, EpisodeEnv::External(_)) => EnvAccess::Unscored,
        (false, EpisodeEnv::External(_)) if played => return Err(RunError::HistoryOnExternal),
        (false, EpisodeEnv::Domain(env) | EpisodeEnv::External(env)) => {
            env.reset(task_id.as_deref()).await?;
            replay_history(env, &history).await?;
            EnvAccess::Live(env)
        }
    };
    let mut driver = Driver {
        model: model.clone(),
        env: access,
        approver,
        sink,
        ui,
        cancel,
    };
    Ok(driver.run(&mut engine).await?)
}

/// Run a history's played calls ([`played_calls`]) on `env`, in order, discarding their
/// responses: the environment reaches the state the history left it in, while the conversation
/// keeps its own (possibly edited) tool messages. Returns the number of calls replayed.
pub async fn replay_history(
    env: &mut dyn Environment,
    history: &[Message],
) -> Result<usize, EnvError> {
    let calls = played_calls(history);
    for p in &calls {
        env.call(&p.call).await?;
    }
    Ok(calls.len())
}

/// The session header of a run.
pub fn header(
    model: &SharedModel,
    env: &str,
    task_id: Option<String>,
    cfg: &EngineConfig,
    seed: u64,
) -> SessionHeader {
    let info = match model.lock() {
        Ok(m) => Some(m.info()),
        Err(_) => None,
    };
    let mref = info
        .as_ref()
        .map(ModelRef::from)
        .unwrap_or_else(|| ModelRef {
            path: String::new(),
            hash: String::new(),
            tool_rendering: None,
        });
    // A LoRA adapter directory (loaded as base + adapter) is named in the header's `adapter`.
    let adapter = info
        .as_ref()
        .map(|i| std::path::Path::new(&i.path))
        .filter(|p| p.join("adapter_config.json").is_file())
        .map(|p| p.display().to_string());
    SessionHeader::new(mref, adapter, env, task_id, seed, cfg)
}

/// Run a built-in domain task, writing its session to `out`.
#[allow(clippy::too_many_arguments)] // the driver's inputs, passed through as they are
pub async fn run_domain_task(
    model: &SharedModel,
    task: &Task,
    opts: &RunOptions,
    profile: Option<&PromptProfile>,
    out: &Path,
    approver: &mut dyn ApprovalHook,
    ui: Option<UnboundedSender<DriverEvent>>,
    cancel: CancelToken,
) -> Result<EpisodeOutcome, RunError> {
    let domain = task.domain()?;
    let cfg = engine_config(opts, profile)?;
    let spec = task_spec(task, false)?;
    let mut env = DomainEnv::with_tasks(domain, vec![task.clone()]);
    let mut writer = SessionWriter::create(
        out,
        &header(model, domain.name(), Some(task.id.clone()), &cfg, opts.seed),
    )?;
    run_episode(
        model,
        spec,
        cfg,
        EpisodeEnv::Domain(&mut env),
        Some(task.id.clone()),
        approver,
        &mut writer,
        ui,
        cancel,
    )
    .await
}

/// Evaluate a model on a domain split; one session per task under `sessions_dir`.
#[allow(clippy::too_many_arguments)]
pub async fn eval_domain(
    model: &SharedModel,
    domain: Domain,
    split: Split,
    limit: Option<usize>,
    opts: &RunOptions,
    profile: Option<&PromptProfile>,
    sessions_dir: &Path,
    mut progress: impl FnMut(usize, usize, &EpisodeOutcome),
    cancel: CancelToken,
) -> Result<(EvalSummary, Vec<(String, EpisodeOutcome)>), RunError> {
    let tasks = list_tasks(domain, Some(split));
    let n = limit.unwrap_or(tasks.len()).min(tasks.len());
    let t0 = Instant::now();
    let mut outcomes = Vec::with_capacity(n);
    std::fs::create_dir_all(sessions_dir).map_err(|e| SessionError::Io {
        path: sessions_dir.display().to_string(),
        source: e,
    })?;
    for (i, task) in tasks.iter().take(n).enumerate() {
        if cancel.is_cancelled() {
            break;
        }
        let path: PathBuf = sessions_dir.join(format!("{}.jsonl", task.id));
        let mut approver = crate::engine::driver::PolicyApprover(opts.approve);
        let o = run_domain_task(
            model,
            task,
            opts,
            profile,
            &path,
            &mut approver,
            None,
            cancel.clone(),
        )
        .await?;
        progress(i + 1, n, &o);
        outcomes.push((task.id.clone(), o));
    }
    let only: Vec<EpisodeOutcome> = outcomes.iter().map(|(_, o)| o.clone()).collect();
    Ok((
        EvalSummary::from_outcomes(&only, t0.elapsed().as_secs_f64()),
        outcomes,
    ))
}

/// Score a live model on a BFCL-v4 single-turn category with the same AST checker as
/// `envace eval bfcl`: one actor turn per entry (the entry's functions as tools), calls parsed by
/// the actor parser. Returns the report and the calls made (id → calls).
pub fn eval_bfcl_live(
    model: &SharedModel,
    entries: &[crate::env::bfcl::BfclEntry],
    category: &str,
    opts: &RunOptions,
    profile: Option<&PromptProfile>,
    mut progress: impl FnMut(usize, usize),
    cancel: &CancelToken,
) -> Result<crate::env::bfcl::BfclReport, crate::runtime::RuntimeError> {
    use crate::engine::parse::parse_actor;
    use crate::engine::prompts::actor::tools_json;
    use crate::message::Message;
    let mut responses = std::collections::HashMap::new();
    let thinking = profile.is_some_and(|p| p.actor_thinking);
    let params = crate::runtime::SamplingParams {
        temperature: opts.temperature,
        seed: opts.seed,
        max_tokens: 384,
        ..Default::default()
    };
    let mut guard = model
        .lock()
        .map_err(|_| crate::runtime::RuntimeError::Generation("model lock poisoned".into()))?;
    for (i, e) in entries.iter().enumerate() {
        if cancel.is_cancelled() {
            break;
        }
        let msgs: Vec<Message> = e.user_messages().into_iter().map(Message::user).collect();
        let prompt = guard.render_chat(&msgs, &tools_json(&e.tools()), true, thinking)?;
        let ids = guard.encode(&prompt)?;
        let generated = guard.generate(&ids, 1, &params, None, cancel)?;
        let calls = generated
            .first()
            .map(|g| parse_actor(&g.text).calls().to_vec())
            .unwrap_or_default();
        responses.insert(e.id.clone(), calls);
        progress(i + 1, entries.len());
    }
    Ok(crate::env::bfcl::evaluate(entries, category, &responses))
}
