//! Role-wise GRPO (EnvACE "World Rehearsal"): G episodes per task from the engine — in
//! `rehearse` mode by default, where the simulator role answers every call and a verifier scores
//! the committed actions afterwards — every generation a row, one baseline per role (the mean
//! reward of that role's rows in the group), no std scaling, token-mean clipped surrogate over
//! generated tokens only, optional KL to the starting policy and entropy bonus. `--mode real` is
//! the actor-only baseline against the real environment.
//!
//! The pieces live by concept: `rollout.rs` (the tasks a step plays, the rollout sink),
//! `batch.rs` (advantages, row weights, micro-batches), `step.rs` (the loss, grounding rows,
//! checkpoints, the collapse stop). This file holds the settings and the run.

mod batch;
mod rollout;
mod step;

use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::TrainError;
use super::checkpoint::Loaded;
use super::metrics::{MetricsSink, StepMetrics};
use super::model::{Example, TrainableModel};
use super::optim::{AdamW, AdamWConfig};
use crate::engine::driver::{ApprovalPolicy, PolicyApprover, share_model};
use crate::engine::profile::PromptProfile;
use crate::engine::runner::{
    Episode, EpisodeConfig, EpisodeEnv, EpisodeIo, ModeChoice, Policy, launch,
};
use crate::engine::spec::task_spec;
use crate::engine::types::GenRole;
use crate::env::domain_env::DomainEnv;
use crate::runtime::chat_template::ChatTemplate;
use crate::runtime::{CancelToken, LocalModel};
use crate::session::{TrainingRow, training_rows};

pub use batch::{ScoredRow, loss_advantage, role_advantages, row_weight};
pub use rollout::{randomized_task, step_tasks, training_tasks};
pub use step::collapsed;

use batch::{Norms, micro_batch_end};
use rollout::{RolloutSink, group_task};
use step::{deep_copy, grounding_examples, micro_loss, save};

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
    /// Tokens per forward/backward micro-batch (gradient accumulation).
    pub micro_batch_tokens: usize,
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
            micro_batch_tokens: 4096,
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
const RESUMABLE_CHANGES: &[&str] = &["steps", "time_budget_s", "checkpoint_every", "rollouts_dir"];

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

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct GrpoReport {
    pub steps: usize,
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
    let base = LocalModel::load_on(model_dir, &model.decoder.device, None)?;
    let profile = PromptProfile::read(model_dir).map_err(|e| TrainError::Data(e.to_string()))?;
    let tasks = training_tasks(cfg)?;
    let reference = (cfg.kl_coef > 0.0)
        .then(|| deep_copy(&model.decoder))
        .transpose()?;
    let grounding = grounding_examples(cfg, &base)?;
    if !grounding.is_empty() {
        sink.log(&format!(
            "grounding: {} shadow-mode simulator rows (real responses), weight {}",
            grounding.len(),
            cfg.grounding_coef
        ));
    }
    if !(cfg.negative_weight >= 0.0 && cfg.negative_weight.is_finite()) {
        return Err(TrainError::Data(format!(
            "negative_weight {}: a finite weight ≥ 0 (`--negative-weight`)",
            cfg.negative_weight
        )));
    }
    if !(cfg.imitation >= 0.0 && cfg.imitation.is_finite()) {
        return Err(TrainError::Data(format!(
            "imitation {}: a finite weight ≥ 0 (`--imitation`)",
            cfg.imitation
        )));
    }
    if cfg.roles.is_empty() {
        return Err(TrainError::Data(
            "roles: no role to train (`--roles actor,simulator`)".into(),
        ));
    }
    if cfg.sim_recall && cfg.mode != ModeChoice::Rehearse {
        return Err(TrainError::Data(format!(
            "sim_recall answers simulated calls from the record; mode {:?} simulates none \
             (`--sim-recall` needs `--mode rehearse`)",
            cfg.mode
        )));
    }
    if !(0.0..=1.0).contains(&cfg.random_entities) {
        return Err(TrainError::Data(format!(
            "random_entities {}: a fraction between 0 and 1 (`--random-entities`)",
            cfg.random_entities
        )));
    }
    let grounding_lengths: Vec<usize> = grounding.iter().map(|e| e.ids.len()).collect();
    let all = model.named_vars();
    // A pattern that matches nothing is a typo, not a request to train everything.
    if let Some(f) = cfg
        .frozen
        .iter()
        .find(|f| !all.iter().any(|(name, _)| name.contains(f.as_str())))
    {
        return Err(TrainError::Data(format!(
            "frozen `{f}`: no trainable parameter name contains it (names look like `{}`)",
            all.first().map_or("", |(n, _)| n.as_str())
        )));
    }
    let trainable: Vec<(String, candle_core::Var)> = all
        .into_iter()
        .filter(|(name, _)| !cfg.frozen.iter().any(|f| name.contains(f.as_str())))
        .collect();
    if trainable.is_empty() {
        return Err(TrainError::Data(format!(
            "frozen `{}`: every parameter is frozen, nothing left to train",
            cfg.frozen.join(",")
        )));
    }
    if !cfg.frozen.is_empty() {
        let n: usize = trainable.iter().map(|(_, v)| v.elem_count()).sum();
        sink.log(&format!(
            "frozen: parameters matching {}; {n} left to train",
            cfg.frozen.join(",")
        ));
    }
    let mut opt = AdamW::new(
        trainable,
        AdamWConfig {
            lr: cfg.lr,
            weight_decay: 0.0,
            ..Default::default()
        },
    )?;
    let mut step = 0;
    if let Some(l) = resume {
        let changed = config_changes(&l.state.config, cfg);
        if !changed.is_empty() {
            return Err(TrainError::Checkpoint(format!(
                "{}: resuming with a different configuration ({}) would not continue the run \
                 it saved; pass the flags it started with (`config` in its trainer_state.json) \
                 or start a new run",
                l.dir.display(),
                changed.join(", ")
            )));
        }
        // Steps without reward signal make no optimizer update (and epochs > 1 make several):
        // AdamW's bias correction needs its own count, not the trainer's step.
        let opt_steps = l
            .state
            .rng
            .get("optimizer_steps")
            .and_then(serde_json::Value::as_u64)
            .map_or(l.state.step, |n| n as usize);
        opt.load_state(&l.optimizer, opt_steps)
            .map_err(|m| TrainError::Checkpoint(format!("{}: {m}", l.dir.display())))?;
        step = l.state.step;
    }
    sink.log(&match &model.lora {
        Some(a) => format!(
            "LoRA r={} alpha={} on {}: {} trainable parameters (base frozen)",
            a.r,
            a.lora_alpha,
            a.target_modules.join(","),
            model.trainable_parameters()
        ),
        None => format!(
            "full fine-tuning: {} trainable parameters",
            model.trainable_parameters()
        ),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| TrainError::Data(format!("tokio: {e}")))?;
    let t0 = Instant::now();
    let (mut first, mut last, mut episodes) = (f64::NAN, f64::NAN, 0usize);
    let mut stopped = "steps".to_string();
    let mut history: Vec<f64> = Vec::new();
    let tok_json = model_dir.join("tokenizer.json");
    let end_of_turn = base.tokenizer.token_to_id(&base.template.eos_token);
    while step < cfg.steps {
        if cancel.is_cancelled() {
            stopped = "cancelled".into();
            break;
        }
        if let Some(b) = cfg.time_budget_s
            && t0.elapsed().as_secs_f64() > b
        {
            stopped = "time budget".into();
            break;
        }
        let ts = Instant::now();
        // 1. Rollouts with the current weights.
        let template = ChatTemplate::new(
            &base.template.source,
            &base.template.bos_token,
            &base.template.eos_token,
        )?;
        let view = LocalModel::from_parts(
            model.decoder.clone(),
            base.tokenizer.clone(),
            template,
            base.eos_ids.clone(),
            model_dir,
            format!("grpo-step-{step}"),
        );
        let shared = share_model(Box::new(view));
        let mut groups: Vec<Vec<Vec<TrainingRow>>> = Vec::new();
        let (mut reward_sum, mut n_eps, mut fmt_fail, mut actor_turns, mut sim_fail, mut sim_gens) =
            (0.0, 0usize, 0usize, 0usize, 0usize, 0usize);
        let (mut fid_sum, mut fid_n) = (0.0f64, 0usize);
        for (ti, train_task) in step_tasks(&tasks, cfg.batch, cfg.seed, step)
            .into_iter()
            .enumerate()
        {
            let task = &group_task(cfg, train_task, step, ti)?;
            let mut group = Vec::with_capacity(cfg.group);
            for g in 0..cfg.group {
                // The rollout's episode: the trainer's mode, turn limit and temperatures,
                // every call approved, a seed per (step, task, group member).
                let config = EpisodeConfig {
                    max_turns: cfg.max_turns,
                    actor_temperature: cfg.temperature,
                    simulator_temperature: cfg.sim_temperature,
                    recall_recorded: cfg.sim_recall,
                    approve: ApprovalPolicy::Always,
                    seed: cfg
                        .seed
                        .wrapping_mul(1_000_003)
                        .wrapping_add((step * 10_007 + ti * 101 + g) as u64),
                    ..EpisodeConfig::new(cfg.mode)
                };
                let policy = Policy {
                    model: &shared,
                    profile: profile.as_ref(),
                };
                let domain = task.domain().map_err(|e| TrainError::Data(e.to_string()))?;
                // Rehearse: the simulator sees the task's recorded gold run (as in EnvACE).
                let spec = task_spec(task, cfg.mode == ModeChoice::Rehearse)
                    .map_err(|e| TrainError::Data(e.to_string()))?;
                let mut env = DomainEnv::with_tasks(domain, vec![(*task).clone()]);
                let mut sink_mem = RolloutSink::new(
                    cfg.rollouts_dir.as_deref(),
                    (step, g),
                    task,
                    policy,
                    &config,
                )?;
                let mut approver = PolicyApprover(ApprovalPolicy::Always);
                let io = EpisodeIo {
                    env: EpisodeEnv::Domain(&mut env),
                    sink: &mut sink_mem,
                    approver: &mut approver,
                    ui: None,
                    cancel: cancel.clone(),
                };
                let outcome = rt
                    .block_on(launch(
                        policy,
                        Episode::new(spec, Some(task.id.clone())),
                        &config,
                        io,
                    ))
                    .map_err(|e| TrainError::Data(format!("rollout: {e}")))?;
                reward_sum += outcome.reward();
                n_eps += 1;
                fmt_fail += outcome.stats.actor_turns_failed;
                actor_turns += outcome.stats.actor_turns;
                sim_fail +=
                    outcome.stats.simulator_format_failures + outcome.stats.simulator_rejections;
                sim_gens += outcome.stats.simulator_generations;
                // Shadow-mode rollouts compare each prediction with the real response.
                for r in &sink_mem.mem.records {
                    if let crate::session::EventBody::Fidelity { fidelity, .. } = &r.event {
                        fid_sum += fidelity.value_agreement;
                        fid_n += 1;
                    }
                }
                group.push(training_rows(&sink_mem.mem.records));
            }
            groups.push(group);
        }
        episodes += n_eps;
        let mean_reward = reward_sum / n_eps.max(1) as f64;
        let mut rows: Vec<ScoredRow> = groups.iter().flat_map(|g| role_advantages(g)).collect();
        // Fraction of generated tokens the copy mask leaves out of the policy term.
        let mut copy_masked: Option<(f64, usize)> = None;
        if cfg.mask_copies {
            // `unmapped`: rows whose text did not map onto their tokens (multi-byte characters
            // split across tokens); they train unmasked, and the metric says how many.
            let (mut kept, mut total, mut unmapped) = (0usize, 0usize, 0usize);
            for r in &mut rows {
                r.policy_mask = super::copymask::copy_mask(
                    &base.tokenizer,
                    end_of_turn,
                    &r.row.prompt_ids,
                    &r.row.response_ids,
                )
                .map(|m| m.iter().zip(&r.row.loss_mask).map(|(a, b)| a & b).collect());
                unmapped += usize::from(r.policy_mask.is_none());
                total += r.row.loss_mask.iter().filter(|&&m| m == 1).count();
                kept += r.policy_mask().iter().filter(|&&m| m == 1).count();
            }
            copy_masked = Some((1.0 - kept as f64 / total.max(1) as f64, unmapped));
        }
        let role_mean = |role: GenRole| {
            let v: Vec<f64> = rows
                .iter()
                .filter(|r| r.row.role == role)
                .map(|r| r.row.reward.unwrap_or(0.0))
                .collect();
            if v.is_empty() {
                0.0
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            }
        };
        let adv: Vec<f64> = rows.iter().map(|r| r.advantage).collect();
        let adv_abs = adv.iter().map(|a| a.abs()).sum::<f64>() / adv.len().max(1) as f64;
        // 2. Optimise on rows that carry signal — and, with a KL term, on every row: a group
        // whose episodes all succeeded has no advantage, and only the KL term holds what it
        // does in place while the other groups' updates move the shared weights.
        let signal = |r: &ScoredRow| row_weight(r, cfg) != 0.0;
        let mut active: Vec<&ScoredRow> = rows
            .iter()
            .filter(|r| {
                (cfg.kl_coef > 0.0 || signal(r))
                    && !r.row.response_ids.is_empty()
                    && cfg.roles.contains(&r.row.role)
            })
            .collect();
        // Similar lengths together: a micro-batch is padded to its longest row.
        active.sort_by_key(|r| r.row.prompt_ids.len() + r.row.response_ids.len());
        let tokens = |r: &&ScoredRow| r.row.loss_mask.iter().map(|&m| f64::from(m)).sum::<f64>();
        let policy_tokens =
            |r: &&ScoredRow| r.policy_mask().iter().map(|&m| f64::from(m)).sum::<f64>();
        let norms = Norms {
            policy: active.iter().filter(|r| signal(r)).map(policy_tokens).sum(),
            all: active.iter().map(tokens).sum(),
        };
        let with_signal = active.iter().filter(|r| signal(r)).count();
        let norm = norms.all;
        let (mut loss_v, mut kl_v, mut ent_v, mut gn) = (0.0, 0.0, 0.0, 0.0);
        // First-epoch ratio diagnostics: on-policy rows should start at ratio 1.
        let (mut ratio_gap, mut clipped) = (0.0, 0.0);
        let mut trained_tokens = 0usize;
        let mut grounding_nll: Option<f64> = None;
        if norm > 0.0 || !grounding.is_empty() {
            for epoch in 0..cfg.epochs.max(1) {
                let mut acc: Option<candle_core::backprop::GradStore> = None;
                if epoch == 0 && !grounding.is_empty() {
                    let idx = super::sft::batch_indices(
                        &grounding_lengths,
                        cfg.grounding_batch.max(1),
                        cfg.seed ^ 0x6772_6f75,
                        step,
                    );
                    let batch: Vec<&Example> = idx.iter().map(|&i| &grounding[i]).collect();
                    let (nll, n) = super::model::masked_nll(&model.decoder, &batch)?;
                    grounding_nll = Some(nll.to_scalar::<f32>()? as f64);
                    trained_tokens += n as usize;
                    acc = Some(crate::runtime::train_pass::backward(
                        &(nll * cfg.grounding_coef)?,
                    )?);
                }
                let mut start = 0;
                while start < active.len() {
                    let end = micro_batch_end(&active, start, cfg.micro_batch_tokens);
                    let toks: usize = active[start..end]
                        .iter()
                        .map(|r| r.row.prompt_ids.len() + r.row.response_ids.len())
                        .sum();
                    let ml = micro_loss(
                        &model.decoder,
                        reference.as_ref(),
                        &active[start..end],
                        cfg,
                        norms,
                    )?;
                    loss_v += ml.loss.to_scalar::<f32>()? as f64;
                    kl_v += ml.kl;
                    ent_v += ml.entropy;
                    if epoch == 0 {
                        ratio_gap += ml.ratio_gap;
                        clipped += ml.clipped;
                    }
                    trained_tokens += toks;
                    let grads = crate::runtime::train_pass::backward(&ml.loss)?;
                    acc = Some(match acc {
                        None => grads,
                        Some(mut a) => {
                            for (_, v) in opt.params() {
                                if let Some(g) = grads.get(v.as_tensor()) {
                                    let sum = match a.get(v.as_tensor()) {
                                        Some(prev) => (prev + g)?,
                                        None => g.clone(),
                                    };
                                    a.insert(v.as_tensor(), sum);
                                }
                            }
                            a
                        }
                    });
                    start = end;
                }
                if let Some(grads) = acc {
                    gn = opt.grad_norm(&grads)?;
                    let scale = if cfg.grad_clip > 0.0 && gn > cfg.grad_clip {
                        cfg.grad_clip / gn
                    } else {
                        1.0
                    };
                    opt.step(&grads, cfg.lr, scale)?;
                }
            }
        }
        step += 1;
        if first.is_nan() {
            first = mean_reward;
        }
        last = mean_reward;
        let secs = ts.elapsed().as_secs_f64();
        let fmt_rate = fmt_fail as f64 / actor_turns.max(1) as f64;
        let mut metrics = StepMetrics::new("grpo", step)
            .with("reward", mean_reward)
            .with("reward_actor", role_mean(GenRole::Actor))
            .with("reward_simulator", role_mean(GenRole::Simulator))
            .with("adv_abs_mean", adv_abs)
            .with("rows", rows.len())
            .with("rows_with_signal", with_signal)
            .with("rows_trained", active.len())
            .with("loss", loss_v)
            .with("kl", kl_v)
            .with("entropy", ent_v)
            .with("grad_norm", gn)
            .with("ratio_gap", ratio_gap / norm.max(1.0))
            .with("clip_frac", clipped / norm.max(1.0))
            .with("actor_format_error_rate", fmt_rate)
            .with("sim_failure_rate", sim_fail as f64 / sim_gens.max(1) as f64)
            .with("tokens_per_s", trained_tokens as f64 / secs.max(1e-9))
            .with("seconds", secs);
        if let Some(g) = grounding_nll {
            metrics = metrics.with("grounding_nll", g);
        }
        if let Some((f, unmapped)) = copy_masked {
            metrics = metrics
                .with("copy_masked_frac", f)
                .with("copy_mask_unmapped_rows", unmapped);
        }
        // Simulator fidelity (mean value agreement with the real response): shadow/real only.
        if fid_n > 0 {
            metrics = metrics.with("sim_fidelity", fid_sum / fid_n as f64);
        }
        sink.record(&metrics);
        if let Some(dir) = out
            && cfg.checkpoint_every > 0
            && step % cfg.checkpoint_every == 0
        {
            save(
                model,
                &opt,
                cfg,
                &tok_json,
                &dir.join(format!("checkpoint-{step}")),
                step,
            )?;
        }
        history.push(mean_reward);
        if cfg.collapse_patience > 0
            && let Some(msg) = collapsed(&history, cfg.collapse_patience, cfg.collapse_fraction)
        {
            stopped = msg;
            sink.log(&stopped);
            break;
        }
        if cfg.collapse_patience > 0 && fmt_rate > 0.5 && step > cfg.collapse_patience {
            stopped = format!("collapse: actor format-error rate {fmt_rate:.2}");
            sink.log(&stopped);
            break;
        }
    }
    if let Some(dir) = out {
        save(model, &opt, cfg, &tok_json, &dir.join("final"), step)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resuming_refuses_changed_settings_but_not_longer_runs() {
        let saved = GrpoConfig::default();
        let stored = serde_json::to_value(&saved).unwrap();
        assert!(config_changes(&stored, &saved).is_empty());
        let longer = GrpoConfig {
            steps: saved.steps * 2,
            checkpoint_every: 7,
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
