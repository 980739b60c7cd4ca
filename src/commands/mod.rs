//! Handlers of the subcommands: argument plumbing only, the work is in the library
//! (`envace::engine::runner`, `envace::train`, `envace::session`, `envace::export`). This
//! module holds what they share: the exit statuses, the episode configuration the flags
//! describe, and model loading; one file per group of commands beside it.

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::cli::ModeArgs;
use envace::engine::EpisodeOutcome;
use envace::engine::driver::{SharedModel, share_model};
use envace::engine::profile::PromptProfile;
use envace::engine::runner::{ConfigError, EpisodeConfig, ModeChoice};
use envace::runtime::{CancelToken, DeviceChoice};

mod app;
mod bench;
mod episode;
mod export;
mod sessions;
mod train;

pub use app::{demo, generate, tui};
pub use bench::{bench_generate, bench_train, spin};
pub use episode::{eval, run};
pub use export::export;
pub use sessions::{diff, fork, sessions};
pub use train::{merge, pretrain, train, train_sft};

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
pub(crate) fn episode_status(o: &EpisodeOutcome) -> Result<()> {
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
pub(crate) fn cancel_on_ctrl_c() -> CancelToken {
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

/// What `run` and `eval` start from: the flags' episode configuration, then the model, with
/// `--constrain-tools` refused for a served model before anything loads.
pub(crate) fn episode_setup(
    mode: &ModeArgs,
    model: &Path,
) -> Result<(EpisodeConfig, SharedModel, Option<PromptProfile>)> {
    let config = episode_config(mode)?;
    envace::runtime::openai::refuse_remote_constraint(
        &model.to_string_lossy(),
        mode.constrain_tools,
    )?;
    let (model, profile) = load_model(model, mode.device)?;
    Ok((config, model, profile))
}

/// Training needs the weights here: a served model is not trainable.
pub(crate) fn require_local(path: &Path) -> Result<()> {
    if envace::runtime::openai::is_remote(&path.to_string_lossy()) {
        bail!(
            "{}: a remote (openai:) model is not trainable here; train a local copy, or export sessions with `envace export --format verl` and train on a GPU node (docs/SCALE.md)",
            path.display()
        );
    }
    Ok(())
}

pub(crate) fn outcome_json(o: &EpisodeOutcome, session: &Path) -> serde_json::Value {
    serde_json::json!({
        "session": session.display().to_string(),
        "reward": o.reward(),
        "end": o.end,
        "score": o.score,
        "stats": o.stats,
    })
}

/// The async runtime of the commands that talk to environments or servers.
pub fn tokio_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}
