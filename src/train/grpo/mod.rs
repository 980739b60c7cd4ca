//! Role-wise GRPO (EnvACE "World Rehearsal"): G episodes per task from the engine — in
//! `rehearse` mode by default, where the simulator role answers every call and a verifier scores
//! the committed actions afterwards — every generation a row, one baseline per role (the mean
//! reward of that role's rows in the group), no std scaling, token-mean clipped surrogate over
//! generated tokens only, optional KL to the starting policy and entropy bonus. `--mode real` is
//! the actor-only baseline against the real environment.
//!
//! One run repeats four steps ([`run_grpo`]): collect a group of episodes per task
//! (`rollout.rs`), score their rows into a batch (`batch.rs`), optimise on it, then record,
//! checkpoint and check for collapse (`step.rs`). This file holds the settings, their checks
//! and the driver that reads as that outline.

mod batch;
mod rollout;
mod step;

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::TrainError;
use super::checkpoint::Loaded;
use super::metrics::MetricsSink;
use super::model::TrainableModel;
use crate::engine::profile::PromptProfile;
use crate::engine::runner::ModeChoice;
use crate::engine::types::GenRole;
use crate::runtime::{CancelToken, LocalModel};

pub use batch::{ScoredRow, loss_advantage, role_advantages, row_weight};
pub use rollout::{randomized_task, step_tasks, training_tasks};
pub use step::collapsed;

use batch::{Scored, Trained};
use rollout::Rollouts;
use step::{Grounding, Learner, collapse_stop, optimizer, step_metrics};

/// GRPO settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GrpoConfig {
    pub domains: Vec<String>,
    pub mode: ModeChoice,
    pub steps: usize,
    /// Tasks per step.
    pub batch: usize,
    /// Episodes per task.
    pub group: usize,
    pub lr: f64,
    /// The actor's sampling temperature in rollouts.
    pub temperature: f64,
    /// The simulator's sampling temperature in rollouts. Lower than the actor's by default: a
    /// small model sampling long JSON at 1.0 breaks the format in a large share of its
    /// responses, and every broken response ends its episode with reward 0 (measured on the
    /// bundled model: half of the rehearse-mode episodes at 1.0). Test-time rehearsal samples
    /// the simulator at 0.3 as well.
    #[serde(default = "default_sim_temperature")]
    pub sim_temperature: f64,
    pub max_turns: u32,
    /// PPO-style ratio clipping ε (the ratio is against the rollout's logprobs).
    pub clip_eps: f64,
    /// Optimisation passes over each step's rows.
    pub epochs: usize,
    /// KL penalty to the starting policy (0 = off; k3 estimator), on every generated row: rows
    /// without advantage (groups that all succeeded or all failed) are trained on it too.
    pub kl_coef: f64,
    pub entropy_coef: f64,
    pub grad_clip: f64,
    /// Padded tokens per forward/backward micro-batch (gradient accumulation; the step's loss
    /// and gradient do not depend on it). `None`: from the model's size
    /// ([`micro_batch_tokens_for`]).
    #[serde(default)]
    pub micro_batch_tokens: Option<usize>,
    pub seed: u64,
    pub checkpoint_every: usize,
    pub time_budget_s: Option<f64>,
    /// Stop when the mean reward of the last `collapse_patience` steps falls below this fraction
    /// of the mean of the first `collapse_patience` steps (a window, not one step: at low
    /// success one group more or less swings a single step's reward to 0), or the actor's
    /// format-error rate exceeds 0.5.
    pub collapse_fraction: f64,
    pub collapse_patience: usize,
    /// Grounding loss (our extension, off at 0): each step also minimises this weight times the
    /// simulator's NLL of real responses recorded in shadow-mode sessions
    /// ([`GrpoConfig::grounding_sessions`]), so the world model learns what the environment
    /// really answers, not only what led to reward.
    #[serde(default)]
    pub grounding_coef: f64,
    /// Session files (a file, a directory or a glob) whose shadow-mode simulator rows, relabelled
    /// with the real response, feed the grounding loss.
    #[serde(default)]
    pub grounding_sessions: Option<String>,
    /// Grounding rows per step.
    #[serde(default = "default_grounding_batch")]
    pub grounding_batch: usize,
    /// Write every rollout episode as a session file under this directory
    /// (`step-NNNN/<task>-g<G>.jsonl`), to inspect what the policy did and what the simulator
    /// answered (the TUI's Sessions tab and `envace sessions` read them).
    #[serde(default)]
    pub rollouts_dir: Option<std::path::PathBuf>,
    /// Parameters left out of the optimizer in full fine-tuning: a parameter is frozen when its
    /// name contains one of these strings (e.g. `embed_tokens` keeps the tied embedding — the
    /// input side of every copied name — fixed while the layers learn).
    #[serde(default)]
    pub frozen: Vec<String>,
    /// Fraction of a step's tasks played with random entities (0 = off): the group plays a
    /// copy of the train task in which every train-split name, place, payee and item is
    /// replaced by a random letter string, everywhere (request, state, gold calls, checklist),
    /// so the reward depends on copying values the model cannot have memorised, as the test
    /// split's held-out values require. The verifier scores the copy like any task.
    #[serde(default)]
    pub random_entities: f64,
    /// What the random entities look like (`--entity-style`): letter strings, or payees and
    /// items as real nouns.
    #[serde(default, skip_serializing_if = "is_letters")]
    pub entity_style: crate::env::tasks::randomize::EntityStyle,
    /// Train on the first N train tasks of each domain only (None = all of them).
    #[serde(default)]
    pub task_limit: Option<usize>,
    /// Train on these train-split tasks only (ids; empty = all). A test-split id is refused:
    /// the test split is what the README table scores.
    #[serde(default)]
    pub task_ids: Vec<String>,
    /// Scale of negative advantages in the policy loss (1 = GRPO as specified; 0 = learn from
    /// the better-than-baseline rows only). An ablation: at 0 the damage to tasks outside the
    /// training set is the same as at 1 (docs/TRAINING.md, session 15).
    #[serde(default = "default_negative_weight")]
    pub negative_weight: f64,
    /// Self-imitation weight (0 = off): every row of a successful episode also carries this
    /// much positive advantage, so the tasks a group solves every time (zero GRPO advantage)
    /// are still reinforced while other groups' updates move the shared weights under them.
    #[serde(default)]
    pub imitation: f64,
    /// Rehearse-mode rollouts answer a call that exactly matches one of the task's recorded
    /// gold calls with the recorded response (`EngineConfig::recall_recorded`); the simulator
    /// is trained on the calls the record does not cover. Off by default.
    #[serde(default)]
    pub sim_recall: bool,
    /// The roles whose rows the loss trains (default both; `[Actor]` keeps the simulator role
    /// as it is while it still answers the rollouts' calls — an ablation of joint training).
    #[serde(default = "default_roles")]
    pub roles: Vec<GenRole>,
    /// Leave the tokens of values copied from the conversation out of the policy term
    /// ([`super::copymask`]): RL trains the decisions, not which value came back. Off by
    /// default.
    #[serde(default)]
    pub mask_copies: bool,
}

fn is_letters(s: &crate::env::tasks::randomize::EntityStyle) -> bool {
    *s == crate::env::tasks::randomize::EntityStyle::Letters
}

fn default_roles() -> Vec<GenRole> {
    vec![GenRole::Actor, GenRole::Simulator]
}

fn default_negative_weight() -> f64 {
    1.0
}

fn default_grounding_batch() -> usize {
    8
}

fn default_sim_temperature() -> f64 {
    0.3
}

impl Default for GrpoConfig {
    fn default() -> Self {
        Self {
            domains: vec!["bank".into()],
            mode: ModeChoice::Rehearse,
            steps: 20,
            batch: 4,
            group: 4,
            // Measured on the bundled model (docs/TRAINING.md): 1e-4 lost 15 points of test
            // success in 400 episodes, 2e-5 stays within a task or two of the start.
            lr: 2e-5,
            temperature: 1.0,
            sim_temperature: default_sim_temperature(),
            max_turns: 6,
            clip_eps: 0.2,
            epochs: 1,
            kl_coef: 0.0,
            entropy_coef: 0.0,
            grad_clip: 1.0,
            micro_batch_tokens: None,
            seed: 0,
            checkpoint_every: 0,
            time_budget_s: None,
            collapse_fraction: 0.25,
            // Four tasks a step make one step's reward mostly a matter of which tasks were
            // drawn: five-step windows stopped healthy runs (0.36 → 0.08 by the draw alone).
            collapse_patience: 10,
            grounding_coef: 0.0,
            grounding_sessions: None,
            grounding_batch: default_grounding_batch(),
            rollouts_dir: None,
            frozen: Vec::new(),
            random_entities: 0.0,
            entity_style: Default::default(),
            task_limit: None,
            task_ids: Vec::new(),
            negative_weight: default_negative_weight(),
            imitation: 0.0,
            sim_recall: false,
            roles: default_roles(),
            mask_copies: false,
        }
    }
}

/// Settings a resumed run may change: how long it runs, how often it checkpoints, where its
/// rollouts go. Everything else must match the checkpoint's, or the run would not be the one
/// it saved (a silently different learning rate or mode is a different experiment).
/// (The micro-batch size changes memory and speed, not the step.)
const RESUMABLE_CHANGES: &[&str] = &[
    "steps",
    "time_budget_s",
    "checkpoint_every",
    "rollouts_dir",
    "micro_batch_tokens",
];

/// Activation memory one training micro-batch is sized for by default.
const MICRO_BATCH_BYTES: usize = 3 << 30;

/// The default micro-batch of a model: the most padded tokens, a power of two from 256 to 4096,
/// whose f32 activations stay within ~3 GB. Per token each layer keeps about eight hidden-sized
/// and three MLP-sized vectors for the backward (half again with their gradients), and the
/// logits three vocabulary-sized ones. The bundled model gets 4096; SmolLM2-135M 1024 (measured
/// on one LoRA GRPO step, group 8: 4.7 GB peak against 10.9 GB at 4096, the same loss and
/// gradient norm, 1.3× the tokens/s); a 1.7B Qwen3 256.
pub fn micro_batch_tokens_for(cfg: &crate::runtime::config::DecoderConfig) -> usize {
    let per_layer = 8 * cfg.hidden_size + 3 * cfg.intermediate_size;
    let floats = cfg.num_hidden_layers * per_layer * 3 / 2 + 3 * cfg.vocab_size;
    let fit = (MICRO_BATCH_BYTES / (4 * floats.max(1))).min(4096);
    let mut n = 256;
    while n * 2 <= fit {
        n *= 2;
    }
    n
}

/// The settings of `now` that differ from a checkpoint's stored configuration, as
/// `name: saved → now` (empty when they agree). A stored configuration from an older version is
/// read with today's defaults for the fields it lacks.
pub fn config_changes(stored: &serde_json::Value, now: &GrpoConfig) -> Vec<String> {
    let saved = match serde_json::from_value::<GrpoConfig>(stored.clone()) {
        Ok(c) => serde_json::to_value(c).unwrap_or_default(),
        Err(e) => return vec![format!("the stored configuration is not GRPO's ({e})")],
    };
    let now = serde_json::to_value(now).unwrap_or_default();
    let (Some(saved), Some(now)) = (saved.as_object(), now.as_object()) else {
        return Vec::new();
    };
    now.iter()
        .filter(|(k, v)| !RESUMABLE_CHANGES.contains(&k.as_str()) && saved.get(*k) != Some(v))
        .map(|(k, v)| {
            let was = saved.get(k).map_or("–".to_string(), ToString::to_string);
            format!("{k}: {was} → {v}")
        })
        .collect()
}

impl GrpoConfig {
    /// The checks on the settings alone (the frozen patterns are checked against the model's
    /// parameter names when the optimizer is built). [`run_grpo`] runs them; a caller that
    /// writes files first runs them before, so that bad settings leave nothing behind.
    pub fn validate(&self) -> Result<(), TrainError> {
        if !(self.negative_weight >= 0.0 && self.negative_weight.is_finite()) {
            return Err(TrainError::Data(format!(
                "negative_weight {}: a finite weight ≥ 0 (`--negative-weight`)",
                self.negative_weight
            )));
        }
        if !(self.imitation >= 0.0 && self.imitation.is_finite()) {
            return Err(TrainError::Data(format!(
                "imitation {}: a finite weight ≥ 0 (`--imitation`)",
                self.imitation
            )));
        }
        if self.roles.is_empty() {
            return Err(TrainError::Data(
                "roles: no role to train (`--roles actor,simulator`)".into(),
            ));
        }
        if self.sim_recall && self.mode != ModeChoice::Rehearse {
            return Err(TrainError::Data(format!(
                "sim_recall answers simulated calls from the record; mode {:?} simulates none \
                 (`--sim-recall` needs `--mode rehearse`)",
                self.mode
            )));
        }
        if self.entity_style != crate::env::tasks::randomize::EntityStyle::Letters
            && self.random_entities == 0.0
        {
            return Err(TrainError::Data(
                "entity_style shapes the randomized tasks of random_entities, which is 0 \
                 (`--entity-style` needs `--random-entities F`)"
                    .into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.random_entities) {
            return Err(TrainError::Data(format!(
                "random_entities {}: a fraction between 0 and 1 (`--random-entities`)",
                self.random_entities
            )));
        }
        Ok(())
    }
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct GrpoReport {
    pub steps: usize,
    /// Over the whole run, a resumed run's steps before its checkpoint included.
    pub episodes: usize,
    pub first_reward: f64,
    pub last_reward: f64,
    pub stopped: String,
    pub seconds: f64,
}

/// Everything a GRPO run needs besides its config.
pub struct GrpoRun<'a> {
    pub model: &'a TrainableModel,
    /// The model directory (tokenizer, template, prompt profile).
    pub model_dir: &'a Path,
    pub out: Option<&'a Path>,
    pub resume: Option<&'a Loaded>,
    pub sink: &'a mut dyn MetricsSink,
    pub cancel: &'a CancelToken,
}

/// Train.
pub fn run_grpo(cfg: &GrpoConfig, run: GrpoRun<'_>) -> Result<GrpoReport, TrainError> {
    let GrpoRun {
        model,
        model_dir,
        out,
        resume,
        sink,
        cancel,
    } = run;
    // Set up in this order: a bad run reports the first problem met, as it always has.
    let base = LocalModel::load_on(model_dir, &model.decoder.device, None)?;
    let profile = PromptProfile::read(model_dir).map_err(|e| TrainError::Data(e.to_string()))?;
    let tasks = training_tasks(cfg)?;
    let reference = step::reference(cfg, model, resume, sink)?;
    let grounding = Grounding::load(cfg, &base, sink)?;
    cfg.validate()?;
    let (opt, mut step) = optimizer(cfg, model, resume, sink)?;
    let mut learner = Learner {
        cfg,
        model,
        reference,
        grounding,
        opt,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| TrainError::Data(format!("tokio: {e}")))?;
    let t0 = Instant::now();
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    // A resumed run counts the episodes of the steps before its checkpoint too.
    let mut episodes = rollout::episodes_before(&tasks, cfg, step);
    let mut stopped = "steps".to_string();
    let mut history: Vec<f64> = Vec::new();
    let tok_json = model_dir.join("tokenizer.json");
    let end_of_turn = base.tokenizer.token_to_id(&base.template.eos_token);
    let rollouts = Rollouts {
        cfg,
        model,
        model_dir,
        base: &base,
        profile: profile.as_ref(),
        tasks: &tasks,
        rt: &rt,
        cancel,
    };
    while step < cfg.steps {
        if let Some(reason) = interrupted(cfg, cancel, t0) {
            stopped = reason;
            break;
        }
        let ts = Instant::now();
        // 1. Rollouts with the current weights: a group of episodes per task.
        let played = rollouts.collect(step)?;
        episodes += played.stats.episodes;
        let mean_reward = played.stats.mean_reward();
        // 2. The batch: role-wise advantages, copy masks, the rows that carry signal.
        let scored = Scored::new(cfg, &played.groups, &base.tokenizer, end_of_turn);
        let trained = Trained::select(&scored.rows, cfg);
        // 3. Optimise.
        let pass = learner.optimise(&trained, step)?;
        step += 1;
        if first.is_nan() {
            first = mean_reward;
        }
        last = mean_reward;
        // 4. Record the step, checkpoint, stop on collapse.
        let secs = ts.elapsed().as_secs_f64();
        sink.record(&step_metrics(
            step,
            &played.stats,
            &scored,
            &trained,
            &pass,
            secs,
        ));
        learner.checkpoint(out, &tok_json, step)?;
        history.push(mean_reward);
        let format_errors = played.stats.actor_format_error_rate();
        if let Some(reason) = collapse_stop(cfg, &history, format_errors, step) {
            stopped = reason;
            sink.log(&stopped);
            break;
        }
    }
    if let Some(dir) = out {
        learner.save(&tok_json, &dir.join("final"), step)?;
    }
    Ok(GrpoReport {
        steps: step,
        episodes,
        first_reward: first,
        last_reward: last,
        stopped,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Why the run stops before its next step, if it does: cancelled, or out of its time budget.
fn interrupted(cfg: &GrpoConfig, cancel: &CancelToken, t0: Instant) -> Option<String> {
    if cancel.is_cancelled() {
        return Some("cancelled".into());
    }
    if let Some(b) = cfg.time_budget_s
        && t0.elapsed().as_secs_f64() > b
    {
        return Some("time budget".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default micro-batch from the model's shape: the bundled model's, SmolLM2-135M's
    /// (where 1024 was measured against 4096) and a 1.7B Qwen3's.
    #[test]
    fn micro_batches_are_sized_from_the_model() {
        use crate::runtime::config::Family;
        use crate::runtime::fixture::tiny_config;
        let shape = |vocab, hidden, inter, layers| crate::runtime::config::DecoderConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            ..tiny_config(Family::Llama)
        };
        assert_eq!(micro_batch_tokens_for(&shape(768, 256, 704, 6)), 4096);
        assert_eq!(micro_batch_tokens_for(&shape(49_152, 576, 1_536, 30)), 1024);
        assert_eq!(
            micro_batch_tokens_for(&shape(151_936, 2_048, 6_144, 28)),
            256
        );
    }

    #[test]
    fn resuming_refuses_changed_settings_but_not_longer_runs() {
        let saved = GrpoConfig::default();
        let stored = serde_json::to_value(&saved).unwrap();
        assert!(config_changes(&stored, &saved).is_empty());
        let longer = GrpoConfig {
            steps: saved.steps * 2,
            checkpoint_every: 7,
            micro_batch_tokens: Some(512),
            ..saved.clone()
        };
        assert!(config_changes(&stored, &longer).is_empty());
        let other = GrpoConfig {
            lr: 5e-5,
            mode: ModeChoice::Real,
            ..saved.clone()
        };
        let c = config_changes(&stored, &other);
        assert_eq!(c.len(), 2, "{c:?}");
        assert!(
            c.iter().any(|l| l.starts_with("lr: 0.00002 → 0.00005")),
            "{c:?}"
        );
        assert!(c.iter().any(|l| l.starts_with("mode: ")), "{c:?}");
        // An older checkpoint without a newer field reads it at its default: no change.
        let mut old = stored.clone();
        old.as_object_mut().unwrap().remove("mask_copies");
        assert!(config_changes(&old, &saved).is_empty());
        assert_eq!(config_changes(&serde_json::json!([1]), &saved).len(), 1);
    }
}
