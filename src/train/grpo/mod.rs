//! Role-wise GRPO (EnvACE "World Rehearsal"): G episodes per task from the engine — in
//! `rehearse` mode by default, where the simulator role answers every call and a verifier scores
//! the committed actions afterwards — every generation a row, one baseline per role (the mean
//! reward of that role's rows in the group), no std scaling, token-mean clipped surrogate over
//! generated tokens only, optional KL to the starting policy and entropy bonus. `--mode real` is
//! the actor-only baseline against the real environment.

use std::path::Path;
use std::time::Instant;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::TrainError;
use super::checkpoint::{self, Loaded, TrainerState};
use super::metrics::{MetricsSink, StepMetrics};
use super::model::{Example, TrainableModel, batch_tensors};
use super::optim::{AdamW, AdamWConfig};
use crate::engine::driver::{ApprovalPolicy, PolicyApprover, share_model};
use crate::engine::profile::PromptProfile;
use crate::engine::runner::{
    Episode, EpisodeConfig, EpisodeEnv, EpisodeIo, ModeChoice, Policy, header, launch,
};
use crate::engine::spec::task_spec;
use crate::engine::types::GenRole;
use crate::env::domain_env::DomainEnv;
use crate::env::domains::Domain;
use crate::env::tasks::{Split, Task, list_tasks};
use crate::runtime::chat_template::ChatTemplate;
use crate::runtime::decoder::Decoder;
use crate::runtime::{CancelToken, LocalModel};
use crate::session::schema::{EventRecord, NewEvent};
use crate::session::{
    EventSink, MemorySink, SessionError, SessionWriter, TrainingRow, training_rows,
};

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

/// A row with its advantage.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredRow {
    pub row: TrainingRow,
    pub advantage: f64,
    /// The policy term's token mask when it differs from the row's loss mask
    /// ([`GrpoConfig::mask_copies`]: copied values left out); the KL and entropy terms keep
    /// the loss mask.
    pub policy_mask: Option<Vec<u8>>,
}

impl ScoredRow {
    /// The mask the policy term trains on.
    pub fn policy_mask(&self) -> &[u8] {
        self.policy_mask.as_deref().unwrap_or(&self.row.loss_mask)
    }
}

/// Role-wise advantages for one group (the G episodes of one task): each row's reward minus
/// the mean reward of the rows of the same role in the group. Rehearsal-branch rows (test-time
/// only) are not trained. Unscored episodes count as reward 0.
pub fn role_advantages(group: &[Vec<TrainingRow>]) -> Vec<ScoredRow> {
    let rows: Vec<&TrainingRow> = group
        .iter()
        .flatten()
        .filter(|r| r.branch.is_none())
        .collect();
    let baseline = |role: GenRole| {
        let rs: Vec<f64> = rows
            .iter()
            .filter(|r| r.role == role)
            .map(|r| r.reward.unwrap_or(0.0))
            .collect();
        if rs.is_empty() {
            0.0
        } else {
            rs.iter().sum::<f64>() / rs.len() as f64
        }
    };
    let (ba, bs) = (baseline(GenRole::Actor), baseline(GenRole::Simulator));
    rows.into_iter()
        .map(|r| {
            let b = if r.role == GenRole::Actor { ba } else { bs };
            ScoredRow {
                advantage: r.reward.unwrap_or(0.0) - b,
                row: r.clone(),
                policy_mask: None,
            }
        })
        .collect()
}

/// Keeps a rollout's events in memory and, when asked, also appends them to a session file.
struct RolloutSink {
    mem: MemorySink,
    file: Option<SessionWriter>,
}

impl RolloutSink {
    fn new(
        dir: Option<&Path>,
        (step, g): (usize, usize),
        task: &Task,
        policy: Policy<'_>,
        config: &EpisodeConfig,
    ) -> Result<Self, TrainError> {
        let file = match dir {
            None => None,
            Some(dir) => {
                let path = dir
                    .join(format!("step-{step:04}"))
                    .join(format!("{}-g{g}.jsonl", task.id));
                let domain = task.domain().map_err(|e| TrainError::Data(e.to_string()))?;
                let head = header(policy, domain.name(), Some(task.id.clone()), config)
                    .map_err(|e| TrainError::Data(e.to_string()))?;
                Some(
                    SessionWriter::create(&path, &head)
                        .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?,
                )
            }
        };
        Ok(Self {
            mem: MemorySink::default(),
            file,
        })
    }
}

impl EventSink for RolloutSink {
    fn persist(&mut self, event: NewEvent) -> Result<EventRecord, SessionError> {
        if let Some(f) = &mut self.file {
            f.append(event.clone())?;
        }
        self.mem.persist(event)
    }
}

/// Per-token log-probs (B, T-1) and entropies (B, T-1) under `decoder` in training mode, at
/// the generated positions (`mask`; zero elsewhere).
fn policy_terms(
    decoder: &Decoder,
    ids: &Tensor,
    mask: &Tensor,
    entropy: bool,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    super::model::masked_token_terms(decoder, ids, mask, entropy)
}

/// The loss pieces of one micro-batch, already divided by their [`Norms`].
struct MicroLoss {
    loss: Tensor,
    kl: f64,
    entropy: f64,
    /// Sum over masked tokens of |ratio − 1| (ratio = π/π_rollout), and of tokens clipped.
    ratio_gap: f64,
    clipped: f64,
}

/// The advantage a row's tokens carry into the policy loss: negative advantages scaled by
/// [`GrpoConfig::negative_weight`].
pub fn loss_advantage(advantage: f64, negative_weight: f64) -> f64 {
    if advantage < 0.0 {
        advantage * negative_weight
    } else {
        advantage
    }
}

/// The weight a row's tokens carry into the policy loss: its [`loss_advantage`] plus, for rows
/// of successful episodes, the self-imitation bonus [`GrpoConfig::imitation`] × reward.
pub fn row_weight(r: &ScoredRow, cfg: &GrpoConfig) -> f64 {
    loss_advantage(r.advantage, cfg.negative_weight) + cfg.imitation * r.row.reward.unwrap_or(0.0)
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

/// Token counts a step's losses are divided by: the policy term by the tokens of the rows with
/// signal (as without a KL term), the KL and entropy terms by the tokens of every trained row.
#[derive(Debug, Clone, Copy)]
struct Norms {
    policy: f64,
    all: f64,
}

fn micro_loss(
    policy: &Decoder,
    reference: Option<&Decoder>,
    rows: &[&ScoredRow],
    cfg: &GrpoConfig,
    norms: Norms,
) -> candle_core::Result<MicroLoss> {
    let dev = &policy.device;
    // Ids and a token mask laid out for the batch: the row's loss mask (KL, entropy, ratio
    // diagnostics) or its policy mask (the policy term; differs with `mask_copies`).
    let layout = |mask_of: fn(&ScoredRow) -> &[u8]| {
        let examples: Vec<Example> = rows
            .iter()
            .map(|r| {
                let mut ids = r.row.prompt_ids.clone();
                ids.extend_from_slice(&r.row.response_ids);
                let mut mask = vec![0.0; r.row.prompt_ids.len()];
                mask.extend(mask_of(r).iter().map(|&m| f32::from(m)));
                Example { ids, mask }
            })
            .collect();
        let refs: Vec<&Example> = examples.iter().collect();
        batch_tensors(&refs, dev)
    };
    let (ids, mask) = layout(|r| &r.row.loss_mask)?;
    let policy_mask = if rows.iter().any(|r| r.policy_mask.is_some()) {
        layout(ScoredRow::policy_mask)?.1
    } else {
        mask.clone()
    };
    let (b, t1) = mask.dims2()?;
    // Advantages and rollout logprobs laid out like the mask.
    let mut adv = vec![0f32; b * t1];
    let mut old = vec![0f32; b * t1];
    for (i, r) in rows.iter().enumerate() {
        let p = r.row.prompt_ids.len();
        let weighted = row_weight(r, cfg) as f32;
        for (k, lp) in r.row.logprobs.iter().enumerate() {
            let pos = p + k; // predicting ids[pos] from position pos-1
            if pos >= 1 && pos - 1 < t1 {
                adv[i * t1 + pos - 1] = weighted;
                old[i * t1 + pos - 1] = *lp;
            }
        }
    }
    let adv = Tensor::from_vec(adv, (b, t1), dev)?;
    let old = Tensor::from_vec(old, (b, t1), dev)?;
    let (lp, ent) = policy_terms(policy, &ids, &mask, cfg.entropy_coef > 0.0)?;
    let ratio = (&lp - &old)?.exp()?;
    let gap = (ratio.detach() - 1.0)?.abs()?;
    let ratio_gap = (&gap * &mask)?.sum_all()?.to_scalar::<f32>()? as f64;
    let clipped_n = (gap.gt(cfg.clip_eps)?.to_dtype(mask.dtype())? * &mask)?
        .sum_all()?
        .to_scalar::<f32>()? as f64;
    let clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)?;
    let surrogate = (&ratio * &adv)?.minimum(&(clipped * &adv)?)?;
    let mut loss = ((surrogate * &policy_mask)?.sum_all()?.neg()? / norms.policy.max(1.0))?;
    let mut kl_v = 0.0;
    if let Some(reference) = reference
        && cfg.kl_coef > 0.0
    {
        let (ref_lp, _) = policy_terms(reference, &ids, &mask, false)?;
        let d = (ref_lp.detach() - &lp)?;
        let k3 = ((d.exp()? - &d)? - 1.0)?;
        let kl = ((k3 * &mask)?.sum_all()? / norms.all)?;
        kl_v = kl.to_scalar::<f32>()? as f64;
        loss = (loss + (kl * cfg.kl_coef)?)?;
    }
    let mut ent_v = 0.0;
    if let Some(e) = ent {
        let e = ((e * &mask)?.sum_all()? / norms.all)?;
        ent_v = e.to_scalar::<f32>()? as f64;
        loss = (loss - (e * cfg.entropy_coef)?)?;
    }
    Ok(MicroLoss {
        loss,
        kl: kl_v,
        entropy: ent_v,
        ratio_gap,
        clipped: clipped_n,
    })
}

/// End (exclusive) of the micro-batch that starts at `start` in length-sorted `rows`: as many
/// rows as fit `budget` tokens *padded* to the longest of them (at least one). Counting unpadded
/// tokens let 27 short rows share a batch with a 600-token one: 16k padded positions and 10 GB
/// of attention activations.
fn micro_batch_end(rows: &[&ScoredRow], start: usize, budget: usize) -> usize {
    let len = |r: &ScoredRow| r.row.prompt_ids.len() + r.row.response_ids.len();
    let mut end = start + 1;
    let mut longest = rows.get(start).map_or(0, |r| len(r));
    while end < rows.len() {
        let l = longest.max(len(rows[end]));
        if (end + 1 - start) * l > budget {
            break;
        }
        longest = l;
        end += 1;
    }
    end.min(rows.len())
}

/// The tasks of step `step`: each epoch over the train split is a seeded permutation cut into
/// batches, so a batch mixes domains and tasks (the SFT sampler's length-sorted windows would
/// put consecutive tasks of one domain together), and a resumed run sees the same tasks.
pub fn step_tasks(
    tasks: &[&'static Task],
    batch: usize,
    seed: u64,
    step: usize,
) -> Vec<&'static Task> {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let n = tasks.len();
    if n == 0 || batch == 0 {
        return Vec::new();
    }
    let per_epoch = n.div_ceil(batch);
    let epoch = (step / per_epoch) as u64;
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng =
        rand::rngs::StdRng::seed_from_u64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    order.shuffle(&mut rng);
    let start = (step % per_epoch) * batch;
    order[start..(start + batch).min(n)]
        .iter()
        .map(|&i| tasks[i])
        .collect()
}

/// The train-split tasks a run plays: every domain's, cut to `task_limit` per domain, or the
/// named `task_ids` (each must be a train-split task of one of the run's domains).
pub fn training_tasks(cfg: &GrpoConfig) -> Result<Vec<&'static Task>, TrainError> {
    let mut tasks: Vec<&'static Task> = Vec::new();
    for d in &cfg.domains {
        let domain = Domain::from_name(d).map_err(|e| TrainError::Data(e.to_string()))?;
        let train = list_tasks(domain, Some(Split::Train));
        let n = cfg.task_limit.unwrap_or(train.len()).min(train.len());
        tasks.extend(train.into_iter().take(n));
    }
    if !cfg.task_ids.is_empty() {
        let mut chosen = Vec::with_capacity(cfg.task_ids.len());
        for id in &cfg.task_ids {
            match tasks.iter().find(|t| &t.id == id) {
                Some(t) => chosen.push(*t),
                None => {
                    return Err(TrainError::Data(format!(
                        "task `{id}`: not a train-split task of {} (test tasks are never trained on)",
                        cfg.domains.join(",")
                    )));
                }
            }
        }
        tasks = chosen;
    }
    if tasks.is_empty() {
        return Err(TrainError::Data("no training tasks".into()));
    }
    Ok(tasks)
}

/// A copy of `task` with every train-split pool value (names, places, payees, items) replaced
/// by a random string wherever it occurs, seeded; validated like a task file, so a copy whose
/// gold run no longer replays is refused rather than played.
pub fn randomized_task(task: &Task, seed: u64) -> Result<Task, TrainError> {
    crate::env::tasks::randomize::randomized_task(task, seed)
        .map_err(|e| TrainError::Data(e.to_string()))
}

/// The task the `ti`-th group of step `step` plays: the train task itself, or with probability
/// [`GrpoConfig::random_entities`] its [`randomized_task`] (deterministic in seed, step and
/// position, so a resumed run plays the same tasks).
fn group_task(cfg: &GrpoConfig, task: &Task, step: usize, ti: usize) -> Result<Task, TrainError> {
    use rand::{Rng, SeedableRng};
    if cfg.random_entities <= 0.0 {
        return Ok(task.clone());
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        cfg.seed ^ 0x5EED_0E17_u64.wrapping_mul((step * 1_009 + ti + 1) as u64),
    );
    if rng.random::<f64>() < cfg.random_entities {
        randomized_task(task, rng.random::<u64>())
    } else {
        Ok(task.clone())
    }
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

/// Whether the reward collapsed: the mean of the last `patience` steps below `fraction` × the
/// mean of the first `patience` steps (checked once both windows are full and distinct).
pub fn collapsed(history: &[f64], patience: usize, fraction: f64) -> Option<String> {
    let p = patience.max(1);
    if history.len() < 2 * p {
        return None;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let first = mean(&history[..p]);
    let recent = mean(&history[history.len() - p..]);
    (first > 0.0 && recent < fraction * first).then(|| {
        format!(
            "collapse: mean reward of the last {p} steps {recent:.3} < {fraction:.2} × the first {p} steps' {first:.3}"
        )
    })
}

/// The grounding rows: shadow-mode simulator generations of the configured sessions, relabelled
/// with the real response (see `train::data`). Empty when grounding is off; an error when it is
/// on and the sessions hold no such row.
fn grounding_examples(cfg: &GrpoConfig, base: &LocalModel) -> Result<Vec<Example>, TrainError> {
    if cfg.grounding_coef <= 0.0 {
        return Ok(Vec::new());
    }
    let Some(pattern) = &cfg.grounding_sessions else {
        return Err(TrainError::Data(
            "grounding loss: no sessions given (--grounding-sessions)".into(),
        ));
    };
    let files = super::data::expand_glob(pattern)?;
    let opts = super::data::SessionDataOptions {
        roles: vec![GenRole::Simulator],
        // Only relabelled rows (whose target is the real response) pass.
        min_reward: f64::INFINITY,
    };
    let data = super::data::session_examples(&files, &opts, &base.tokenizer)?;
    if data.examples.is_empty() {
        return Err(TrainError::Data(format!(
            "grounding loss: {pattern} holds no shadow-mode simulator row (record sessions with `--mode shadow`)"
        )));
    }
    Ok(data.examples)
}

fn deep_copy(d: &Decoder) -> Result<Decoder, TrainError> {
    // Round-trip the weights so that the reference shares no storage with the policy.
    let mut copy = d.clone();
    let cp = |t: &Tensor| -> candle_core::Result<Tensor> { t.copy().map(|t| t.detach()) };
    copy.embed.weight = cp(&d.embed.weight)?;
    copy.norm.weight = cp(&d.norm.weight)?;
    let fix = |l: &mut crate::runtime::decoder::Linear| -> candle_core::Result<()> {
        if let crate::runtime::decoder::Weight::Dense(w) = &l.weight {
            l.weight = crate::runtime::decoder::Weight::Dense(cp(w)?);
        }
        if let Some(b) = &l.bias {
            l.bias = Some(cp(b)?);
        }
        // LoRA: the adapters are the policy's Vars; the reference keeps their starting values.
        if let Some(lora) = l.lora.as_mut() {
            lora.a = cp(&lora.a)?;
            lora.b = cp(&lora.b)?;
        }
        Ok(())
    };
    for l in copy.layers.iter_mut() {
        fix(&mut l.self_attn.q_proj)?;
        fix(&mut l.self_attn.k_proj)?;
        fix(&mut l.self_attn.v_proj)?;
        fix(&mut l.self_attn.o_proj)?;
        fix(&mut l.mlp.gate_proj)?;
        fix(&mut l.mlp.up_proj)?;
        fix(&mut l.mlp.down_proj)?;
        l.input_layernorm.weight = cp(&l.input_layernorm.weight)?;
        l.post_attention_layernorm.weight = cp(&l.post_attention_layernorm.weight)?;
        if let Some(n) = l.self_attn.q_norm.as_mut() {
            n.weight = cp(&n.weight)?;
        }
        if let Some(n) = l.self_attn.k_norm.as_mut() {
            n.weight = cp(&n.weight)?;
        }
    }
    fix(&mut copy.lm_head)?;
    Ok(copy)
}

fn save(
    model: &TrainableModel,
    opt: &AdamW,
    cfg: &GrpoConfig,
    tokenizer_json: &Path,
    dir: &Path,
    step: usize,
) -> Result<(), TrainError> {
    let state = TrainerState {
        kind: "grpo".into(),
        step,
        total_steps: cfg.steps,
        seed: cfg.seed,
        rng: serde_json::json!({
            "rollout_seeds": "f(seed, step, task index, group index)",
            "task_order": "seeded epoch permutations",
            "optimizer_steps": opt.step,
        }),
        config: serde_json::to_value(cfg).unwrap_or_default(),
        metrics: serde_json::Value::Null,
    };
    checkpoint::save_trainer(dir, model, opt, tokenizer_json, &state)?;
    Ok(())
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

    #[test]
    fn micro_batches_count_padded_tokens() {
        let scored = |n: usize| ScoredRow {
            policy_mask: None,
            row: TrainingRow {
                prompt_ids: vec![1; n - 1],
                ..row(GenRole::Actor, 1.0)
            },
            advantage: 1.0,
        };
        let rows: Vec<ScoredRow> = [10, 10, 10, 40, 100].into_iter().map(scored).collect();
        let refs: Vec<&ScoredRow> = rows.iter().collect();
        // 3 × 10 fit 40; a fourth row of 40 would pad all four to 40 (160 > 100).
        assert_eq!(micro_batch_end(&refs, 0, 100), 3);
        assert_eq!(micro_batch_end(&refs, 3, 100), 4);
        // A row longer than the budget still goes, alone.
        assert_eq!(micro_batch_end(&refs, 4, 50), 5);
        assert_eq!(micro_batch_end(&refs, 0, 1000), 5);
    }

    #[test]
    fn randomized_tasks_replay_and_mention_no_train_pool_value() {
        let pool = crate::env::domains::train_pool_values();
        let mut changed = 0;
        let mut total = 0;
        for d in Domain::ALL {
            for (i, task) in list_tasks(d, Some(Split::Train)).into_iter().enumerate() {
                let r = randomized_task(task, i as u64).expect("randomized task validates");
                total += 1;
                assert!(r.id.starts_with(&task.id));
                let differs = r.turns != task.turns || r.initial_state != task.initial_state;
                assert_eq!(r.id != task.id, differs, "{}", r.id);
                assert_eq!(r.gold_actions().len(), task.gold_actions().len());
                // Nowhere: not in the request, the state, the gold calls or the checklist.
                let mut rest = serde_json::to_value(&r).expect("json");
                rest["id"] = serde_json::Value::Null;
                let text = rest.to_string();
                for v in &pool {
                    assert!(!has_whole_word(&text, v), "{}: `{v}` left in {text}", r.id);
                }
                if r.turns != task.turns {
                    changed += 1;
                }
                // Same seed, same copy.
                assert_eq!(randomized_task(task, i as u64).expect("again"), r);
            }
        }
        // About half the tasks name someone, somewhere or something (the rest only ids and
        // amounts, which stay).
        assert!(changed * 2 >= total, "{changed} of {total} changed");
        // The fraction is honoured and deterministic.
        let cfg = GrpoConfig {
            random_entities: 0.5,
            ..GrpoConfig::default()
        };
        let task = list_tasks(Domain::Travel, Some(Split::Train))[0];
        assert!(
            task.turns[0].user.contains(" from "),
            "{}",
            task.turns[0].user
        );
        let picks: Vec<bool> = (0..200)
            .map(|s| group_task(&cfg, task, s, 0).expect("task").id != task.id)
            .collect();
        let n = picks.iter().filter(|&&b| b).count();
        assert!((70..=130).contains(&n), "{n} of 200 randomized at 0.5");
        let again: Vec<bool> = (0..200)
            .map(|s| group_task(&cfg, task, s, 0).expect("task").id != task.id)
            .collect();
        assert_eq!(picks, again);
    }

    #[test]
    fn a_run_can_be_cut_to_named_or_the_first_train_tasks_but_never_test_ones() {
        let cfg = |limit: Option<usize>, ids: &[&str]| GrpoConfig {
            domains: vec!["bank".into(), "travel".into()],
            task_limit: limit,
            task_ids: ids.iter().map(|s| s.to_string()).collect(),
            ..GrpoConfig::default()
        };
        let all = training_tasks(&cfg(None, &[])).expect("all");
        let bank = list_tasks(Domain::Bank, Some(Split::Train)).len();
        let travel = list_tasks(Domain::Travel, Some(Split::Train)).len();
        assert_eq!(all.len(), bank + travel);
        let cut = training_tasks(&cfg(Some(3), &[])).expect("cut");
        let ids: Vec<&str> = cut.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "bank-train-0000",
                "bank-train-0001",
                "bank-train-0002",
                "travel-train-0000",
                "travel-train-0001",
                "travel-train-0002"
            ]
        );
        let named =
            training_tasks(&cfg(None, &["travel-train-0007", "bank-train-0003"])).expect("named");
        let ids: Vec<&str> = named.iter().map(|t| t.id.as_str()).collect();
        assert_eq!(ids, ["travel-train-0007", "bank-train-0003"]);
        for bad in ["bank-test-0003", "retail-train-0001", "bank-train-9999"] {
            let err = training_tasks(&cfg(None, &[bad]))
                .expect_err(bad)
                .to_string();
            assert!(
                err.contains(bad) && err.contains("not a train-split task"),
                "{err}"
            );
        }
        // A limit that excludes a named task: the name is refused, not silently dropped.
        assert!(training_tasks(&cfg(Some(2), &["bank-train-0005"])).is_err());
    }

    #[test]
    fn negative_advantages_are_scaled_by_the_negative_weight_only() {
        assert_eq!(loss_advantage(0.75, 0.0), 0.75);
        assert_eq!(loss_advantage(-0.25, 1.0), -0.25);
        assert_eq!(loss_advantage(-0.25, 0.5), -0.125);
        assert_eq!(loss_advantage(-0.25, 0.0), 0.0);
        assert_eq!(loss_advantage(0.0, 2.0), 0.0);
    }

    #[test]
    fn self_imitation_adds_to_successful_rows_only_and_reaches_all_success_groups() {
        use GenRole::{Actor as A, Simulator as S};
        let cfg = GrpoConfig {
            imitation: 0.5,
            negative_weight: 0.5,
            ..GrpoConfig::default()
        };
        // A group that solved the task every time: zero GRPO advantage, but each row of it is
        // reinforced by the imitation weight.
        let solved = role_advantages(&[vec![row(A, 1.0), row(S, 1.0)], vec![row(A, 1.0)]]);
        assert!(solved.iter().all(|r| r.advantage == 0.0));
        assert!(solved.iter().all(|r| row_weight(r, &cfg) == 0.5));
        // A mixed group: actor baseline 1/2. The success row gets 1/2 + 1/2, the failure row
        // −1/2 scaled by the negative weight and no bonus.
        let mixed = role_advantages(&[vec![row(A, 1.0)], vec![row(A, 0.0)]]);
        assert_eq!(row_weight(&mixed[0], &cfg), 1.0);
        assert_eq!(row_weight(&mixed[1], &cfg), -0.25);
        // Off by default: the weight is GRPO's.
        let plain = GrpoConfig::default();
        assert!(solved.iter().all(|r| row_weight(r, &plain) == 0.0));
        assert_eq!(row_weight(&mixed[1], &plain), -0.5);
    }

    /// Whether `word` occurs in `text` delimited by non-word characters (written apart from
    /// the matcher in env::tasks::randomize, so that a bug there cannot hide here).
    fn has_whole_word(text: &str, word: &str) -> bool {
        text.match_indices(word).any(|(i, _)| {
            let before = text[..i].chars().next_back();
            let after = text[i + word.len()..].chars().next();
            let w = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            !w(before) && !w(after)
        })
    }

    #[test]
    fn an_epoch_of_steps_visits_every_task_once_and_batches_mix_domains() {
        let mut tasks: Vec<&'static Task> = Vec::new();
        for d in ["bank", "retail", "travel"] {
            let domain = Domain::from_name(d).expect("domain");
            tasks.extend(list_tasks(domain, Some(Split::Train)));
        }
        let batch = 4;
        let per_epoch = tasks.len().div_ceil(batch);
        let mut seen = std::collections::HashSet::new();
        let mut mixed = 0;
        for step in 0..per_epoch {
            let b = step_tasks(&tasks, batch, 7, step);
            assert!(!b.is_empty() && b.len() <= batch);
            let domains: std::collections::HashSet<_> =
                b.iter().map(|t| t.id.split('-').next()).collect();
            mixed += usize::from(domains.len() > 1);
            for t in b {
                assert!(seen.insert(t.id.clone()), "{} twice in one epoch", t.id);
            }
        }
        assert_eq!(seen.len(), tasks.len());
        // Three domains of equal size: most 4-task batches hold more than one.
        assert!(
            mixed * 10 > per_epoch * 8,
            "{mixed} of {per_epoch} batches mixed"
        );
        // Same (seed, step), same tasks; the next epoch is another order.
        let ids = |s| {
            step_tasks(&tasks, batch, 7, s)
                .iter()
                .map(|t| t.id.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(3), ids(3));
        assert_ne!(ids(0), ids(per_epoch));
    }

    fn row(role: GenRole, reward: f64) -> TrainingRow {
        TrainingRow {
            role,
            branch: None,
            prompt_ids: vec![1, 2],
            response_ids: vec![3],
            logprobs: vec![-0.5],
            loss_mask: vec![1],
            reward: Some(reward),
        }
    }

    #[test]
    fn collapse_is_judged_on_windows_not_on_one_unlucky_step() {
        // One group's success more or less: a single 0 after a low start is not a collapse.
        let noisy = [0.0625, 0.0, 0.0, 0.0625, 0.0, 0.0];
        assert_eq!(collapsed(&noisy, 5, 0.25), None);
        let steady = [0.06, 0.0, 0.06, 0.0, 0.06, 0.0, 0.06, 0.0, 0.06, 0.0];
        assert_eq!(collapsed(&steady, 5, 0.25), None);
        let falls = [0.5, 0.4, 0.5, 0.45, 0.5, 0.1, 0.0, 0.05, 0.0, 0.0];
        assert!(collapsed(&falls, 5, 0.25).unwrap().starts_with("collapse"));
        assert_eq!(
            collapsed(&falls[..9], 5, 0.25),
            None,
            "windows not full yet"
        );
    }

    #[test]
    fn advantages_use_one_baseline_per_role_without_std_scaling() {
        use GenRole::{Actor as A, Simulator as S};
        // Episode 1 (reward 1): 2 actor rows, 1 simulator row. Episode 2 (reward 0): 1 actor
        // row, 3 simulator rows. Actor baseline = (1+1+0)/3 = 2/3; simulator = (1+0+0+0)/4 = 1/4.
        let group = vec![
            vec![row(A, 1.0), row(A, 1.0), row(S, 1.0)],
            vec![row(A, 0.0), row(S, 0.0), row(S, 0.0), row(S, 0.0)],
        ];
        let scored = role_advantages(&group);
        let adv: Vec<(GenRole, f64)> = scored.iter().map(|r| (r.row.role, r.advantage)).collect();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(adv[0].1, 1.0 / 3.0) && close(adv[1].1, 1.0 / 3.0));
        assert!(close(adv[2].1, 0.75));
        assert!(close(adv[3].1, -2.0 / 3.0));
        assert!(adv[4..].iter().all(|(r, a)| *r == S && close(*a, -0.25)));
    }

    #[test]
    fn rehearsal_branch_rows_are_not_trained_and_unscored_counts_as_zero() {
        let mut b = row(GenRole::Actor, 1.0);
        b.branch = Some(0);
        let mut u = row(GenRole::Actor, 0.0);
        u.reward = None;
        let scored = role_advantages(&[vec![b, row(GenRole::Actor, 1.0)], vec![u]]);
        assert_eq!(scored.len(), 2);
        assert!((scored[0].advantage - 0.5).abs() < 1e-12);
        assert!((scored[1].advantage + 0.5).abs() < 1e-12);
    }
}
