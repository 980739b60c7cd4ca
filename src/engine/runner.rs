//! The one launcher: [`launch`] runs an episode for the CLI, the TUI, GRPO rollouts and forks
//! from an [`Episode`] (spec, optional played history, task id), an [`EpisodeConfig`] and its
//! [`EpisodeIo`] (environment, session sink, approval hook, UI stream, cancel token). It picks
//! the environment access the mode allows (a live environment, or a verifier used only after a
//! rehearsed episode) and brings a live environment to a played history's state. Built on it:
//! a built-in task written to a session file, a fork of a saved session, a split evaluation.

use std::path::{Path, PathBuf};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

pub use crate::engine::episode::{ConfigError, EpisodeConfig, ModeChoice};

use crate::engine::driver::{
    ApprovalHook, Driver, DriverError, DriverEvent, EnvAccess, PolicyApprover, SharedModel,
};
use crate::engine::eval::EvalSummary;
use crate::engine::fork::{ForkError, ForkRequest, fork_spec};
use crate::engine::fsm::{Engine, EngineError, EpisodeOutcome, played_calls};
use crate::engine::profile::PromptProfile;
use crate::engine::spec::task_spec;
use crate::engine::types::{EngineConfig, EpisodeSpec, Mode};
use crate::env::domain_env::DomainEnv;
use crate::env::domains::Domain;
use crate::env::tasks::{Split, Task, find_builtin, list_tasks};
use crate::env::{EnvError, Environment};
use crate::message::Message;
use crate::runtime::CancelToken;
use crate::session::schema::{ModelRef, SessionHeader};
use crate::session::{EventSink, SessionError, SessionWriter, read_session};

/// Failures of a run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Driver(#[from] DriverError),
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Fork(#[from] ForkError),
    #[error(
        "a played history cannot be replayed on an external environment (its calls would run \
         again for real); start from a built-in domain"
    )]
    HistoryOnExternal,
}

/// What the episode may touch besides the model.
pub enum EpisodeEnv<'a> {
    /// Real/shadow: live; rehearse: used only as the post-episode verifier (a fresh copy).
    Domain(&'a mut dyn Environment),
    /// A server with real side effects: live in real/shadow mode; never touched in rehearse
    /// mode (the episode is then unscored).
    External(&'a mut dyn Environment),
}

/// The model that plays both roles and how to prompt it (its `envace.json` profile).
#[derive(Clone, Copy)]
pub struct Policy<'a> {
    pub model: &'a SharedModel,
    pub profile: Option<&'a PromptProfile>,
}

/// What to play.
#[derive(Debug, Clone)]
pub struct Episode {
    pub spec: EpisodeSpec,
    /// Main-line messages already played (a fork; see [`Engine::with_history`]); empty for a
    /// fresh episode.
    pub history: Vec<Message>,
    /// The task the environment resets to (and scores against).
    pub task_id: Option<String>,
}

impl Episode {
    pub fn new(spec: EpisodeSpec, task_id: Option<String>) -> Self {
        Self {
            spec,
            history: Vec::new(),
            task_id,
        }
    }
}

/// Everything an episode talks to besides the model.
pub struct EpisodeIo<'a> {
    pub env: EpisodeEnv<'a>,
    pub sink: &'a mut dyn EventSink,
    pub approver: &'a mut dyn ApprovalHook,
    /// Driver events for a UI, streamed as they happen.
    pub ui: Option<UnboundedSender<DriverEvent>>,
    pub cancel: CancelToken,
}

/// Run one episode. In real and shadow mode the live environment is reset and then brought to
/// the state after the episode's played history by replaying its played calls
/// ([`replay_history`]); rehearse mode needs nothing (the verifier replays the whole trace,
/// history included). An external environment with a history is refused in live modes: its
/// calls would run again for real.
pub async fn launch(
    policy: Policy<'_>,
    episode: Episode,
    config: &EpisodeConfig,
    io: EpisodeIo<'_>,
) -> Result<EpisodeOutcome, RunError> {
    let cfg = config.engine_config(policy.profile)?;
    let rehearse = matches!(cfg.mode, Mode::Rehearse);
    let Episode {
        spec,
        history,
        task_id,
    } = episode;
    let played = !played_calls(&history).is_empty();
    let mut engine = Engine::new(spec, cfg)?.with_history(history.clone())?;
    let access = match (rehearse, io.env) {
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
        model: policy.model.clone(),
        env: access,
        approver: io.approver,
        sink: io.sink,
        ui: io.ui,
        cancel: io.cancel,
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

/// The session header of an episode: the model, the episode configuration whole, and the
/// engine configuration it resolves to with `profile`.
pub fn header(
    policy: Policy<'_>,
    env: &str,
    task_id: Option<String>,
    config: &EpisodeConfig,
) -> Result<SessionHeader, ConfigError> {
    let engine = config.engine_config(policy.profile)?;
    let info = match policy.model.lock() {
        Ok(m) => Some(m.info()),
        Err(_) => None,
    };
    let mref = info
        .as_ref()
        .map(|info| ModelRef {
            path: info.path.clone(),
            hash: info.hash.clone(),
            tool_rendering: Some(info.tool_rendering.as_str().to_string()),
        })
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
    let head = SessionHeader::new(
        mref,
        adapter,
        env,
        task_id,
        config.seed,
        config.mode_choice().name(),
        serde_json::to_value(&engine).unwrap_or(serde_json::Value::Null),
    );
    Ok(match serde_json::to_value(config) {
        Ok(v) => head.with_episode(v),
        Err(_) => head,
    })
}

/// The episode configuration a session was recorded with: its header's `episode` (written
/// since format version 2; one that does not parse or validate is an error naming the field),
/// else recovered from the version-1 engine configuration ([`EpisodeConfig::from_engine`]) with
/// `approve` from `fallback`; else (a version-1 engine configuration this build cannot read)
/// `fallback` with the header's seed and mode.
pub fn recorded_config(
    header: &SessionHeader,
    fallback: &EpisodeConfig,
) -> Result<EpisodeConfig, ConfigError> {
    if let Some(v) = &header.episode {
        let c = serde_json::from_value::<EpisodeConfig>(v.clone()).map_err(|e| {
            ConfigError::Invalid {
                field: "header.episode",
                problem: e.to_string(),
            }
        })?;
        c.validate()?;
        return Ok(c);
    }
    if let Ok(engine) = serde_json::from_value::<EngineConfig>(header.config.clone()) {
        return Ok(EpisodeConfig {
            seed: header.seed,
            ..EpisodeConfig::from_engine(&engine, fallback.approve)
        });
    }
    let mode = match header.mode.as_str() {
        "rehearse" => ModeChoice::Rehearse,
        "shadow" => ModeChoice::Shadow,
        _ => ModeChoice::Real,
    };
    Ok(EpisodeConfig {
        seed: header.seed,
        approve: fallback.approve,
        ..EpisodeConfig::new(mode)
    })
}

/// Run a built-in domain task, writing its session to `out`.
pub async fn run_domain_task(
    policy: Policy<'_>,
    task: &Task,
    config: &EpisodeConfig,
    out: &Path,
    approver: &mut dyn ApprovalHook,
    ui: Option<UnboundedSender<DriverEvent>>,
    cancel: CancelToken,
) -> Result<EpisodeOutcome, RunError> {
    let domain = task.domain()?;
    let spec = task_spec(task, false)?;
    let mut env = DomainEnv::with_tasks(domain, vec![task.clone()]);
    let mut writer = SessionWriter::create(
        out,
        &header(policy, domain.name(), Some(task.id.clone()), config)?,
    )?;
    let io = EpisodeIo {
        env: EpisodeEnv::Domain(&mut env),
        sink: &mut writer,
        approver,
        ui,
        cancel,
    };
    launch(
        policy,
        Episode::new(spec, Some(task.id.clone())),
        config,
        io,
    )
    .await
}

/// Fork a built-in domain session and run it with `model`, writing the new session to `out`
/// (see [`fork_path`](crate::engine::fork::fork_path)). `config` is the run's configuration
/// (the original's: [`recorded_config`]).
pub async fn run_fork(
    policy: Policy<'_>,
    req: &ForkRequest,
    config: &EpisodeConfig,
    out: &Path,
    approver: &mut dyn ApprovalHook,
    ui: Option<UnboundedSender<DriverEvent>>,
    cancel: CancelToken,
) -> Result<EpisodeOutcome, RunError> {
    let session = read_session(&req.session)?;
    let environment = session.header.environment.clone();
    let domain =
        Domain::from_name(&environment).map_err(|_| ForkError::NotADomain { environment })?;
    let plan = fork_spec(&session, req)?;
    let task_id = plan.task_id.clone().ok_or(ForkError::NoTask)?;
    let task = find_builtin(&task_id).ok_or_else(|| ForkError::UnknownTask {
        task_id: task_id.clone(),
    })?;
    let rebuilt = task_spec(task, false)?;
    let changed = if task.domain != domain.name() {
        Some("domain")
    } else if rebuilt.user_turns != plan.spec.user_turns {
        Some("user turns")
    } else if rebuilt.tools != plan.spec.tools {
        Some("tools")
    } else {
        None
    };
    if let Some(what) = changed {
        return Err(ForkError::TaskChanged { task_id, what }.into());
    }

    let mut head = header(policy, domain.name(), Some(task_id.clone()), config)?;
    let mut origin = plan.origin;
    if out.parent() == req.session.parent()
        && let Some(name) = req.session.file_name()
    {
        origin.session = name.to_string_lossy().into_owned();
    }
    head.forked_from = Some(origin);
    let mut env = DomainEnv::with_tasks(domain, vec![task.clone()]);
    let mut writer = SessionWriter::create(out, &head)?;
    let episode = Episode {
        spec: plan.spec,
        history: plan.history,
        task_id: Some(task_id),
    };
    let io = EpisodeIo {
        env: EpisodeEnv::Domain(&mut env),
        sink: &mut writer,
        approver,
        ui,
        cancel,
    };
    launch(policy, episode, config, io).await
}

/// Which tasks an evaluation plays.
#[derive(Debug, Clone, Copy)]
pub struct EvalSet {
    pub domain: Domain,
    pub split: Split,
    /// The first this many tasks of the split (all when `None`).
    pub limit: Option<usize>,
}

/// Evaluate a model on a domain split; one session per task under `sessions_dir`.
pub async fn eval_domain(
    policy: Policy<'_>,
    set: EvalSet,
    config: &EpisodeConfig,
    sessions_dir: &Path,
    mut progress: impl FnMut(usize, usize, &EpisodeOutcome),
    cancel: CancelToken,
) -> Result<(EvalSummary, Vec<(String, EpisodeOutcome)>), RunError> {
    config.validate()?;
    let tasks = list_tasks(set.domain, Some(set.split));
    let n = set.limit.unwrap_or(tasks.len()).min(tasks.len());
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
        let mut approver = PolicyApprover(config.approve);
        let o = run_domain_task(
            policy,
            task,
            config,
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
    // Outcomes are the first tasks in order (a cancelled run stops early).
    let kinds = tasks.iter().map(|t| t.kind.as_str()).zip(only.iter());
    Ok((
        EvalSummary::from_outcomes(&only, t0.elapsed().as_secs_f64()).with_kinds(kinds),
        outcomes,
    ))
}
