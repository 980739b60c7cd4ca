//! A step's rollouts: which train tasks the step plays (a seeded permutation per epoch,
//! optionally a random-entity copy of each), G episodes per task through the engine's one
//! launcher with the current weights — every call approved, a seed per (step, task, group
//! member) — and each episode's session turned into training rows. Episodes are kept in memory
//! and optionally written as session files. Every draw here is a function of the seed and the
//! step, so a resumed run plays the same tasks with the same seeds; this module must not draw
//! from any other source.

use std::path::Path;

use super::GrpoConfig;
use crate::engine::driver::{ApprovalPolicy, PolicyApprover, SharedModel, share_model};
use crate::engine::fsm::EpisodeOutcome;
use crate::engine::profile::PromptProfile;
use crate::engine::runner::{
    Episode, EpisodeConfig, EpisodeEnv, EpisodeIo, ModeChoice, Policy, header, launch,
};
use crate::engine::spec::task_spec;
use crate::env::domain_env::DomainEnv;
use crate::env::domains::Domain;
use crate::env::tasks::randomize::EntityStyle;
use crate::env::tasks::{Split, Task, list_tasks};
use crate::runtime::chat_template::ChatTemplate;
use crate::runtime::{CancelToken, LocalModel};
use crate::session::schema::{EventRecord, NewEvent};
use crate::session::{
    EventSink, MemorySink, SessionError, SessionWriter, TrainingRow, training_rows,
};
use crate::train::TrainError;
use crate::train::model::TrainableModel;

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

/// Episodes played by steps `0..step` (counted from 0): [`step_tasks`] of each, `group` apiece.
/// A resumed run counts the steps before its checkpoint this way: they are a function of the
/// configuration, so nothing needs recording.
pub fn episodes_before(tasks: &[&'static Task], cfg: &GrpoConfig, step: usize) -> usize {
    (0..step)
        .map(|s| step_tasks(tasks, cfg.batch, cfg.seed, s).len() * cfg.group)
        .sum()
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
    randomized_task_styled(task, seed, EntityStyle::Letters)
}

/// [`randomized_task`] with payees and items as real nouns or letter strings (`style`).
pub fn randomized_task_styled(
    task: &Task,
    seed: u64,
    style: EntityStyle,
) -> Result<Task, TrainError> {
    crate::env::tasks::randomize::randomized_task(task, seed, style)
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
        randomized_task_styled(task, rng.random::<u64>(), cfg.entity_style)
    } else {
        Ok(task.clone())
    }
}

/// The rollout's episode: the trainer's mode, turn limit and temperatures, every call approved,
/// a seed per (step, task, group member).
fn episode_config(cfg: &GrpoConfig, step: usize, ti: usize, g: usize) -> EpisodeConfig {
    EpisodeConfig {
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
    }
}

/// Counts over a step's episodes, for its metrics and the collapse stop.
#[derive(Debug, Clone, Default)]
pub(super) struct RolloutStats {
    pub episodes: usize,
    reward_sum: f64,
    actor_turns_failed: usize,
    actor_turns: usize,
    simulator_failures: usize,
    simulator_generations: usize,
    fidelity_sum: f64,
    fidelity_n: usize,
}

impl RolloutStats {
    /// Count one episode: its outcome and its session's events.
    fn add(&mut self, outcome: &EpisodeOutcome, records: &[EventRecord]) {
        self.reward_sum += outcome.reward();
        self.episodes += 1;
        self.actor_turns_failed += outcome.stats.actor_turns_failed;
        self.actor_turns += outcome.stats.actor_turns;
        self.simulator_failures +=
            outcome.stats.simulator_format_failures + outcome.stats.simulator_rejections;
        self.simulator_generations += outcome.stats.simulator_generations;
        // Shadow-mode rollouts compare each prediction with the real response.
        for r in records {
            if let crate::session::EventBody::Fidelity { fidelity, .. } = &r.event {
                self.fidelity_sum += fidelity.value_agreement;
                self.fidelity_n += 1;
            }
        }
    }

    /// The mean episode reward (unscored episodes count 0).
    pub fn mean_reward(&self) -> f64 {
        self.reward_sum / self.episodes.max(1) as f64
    }

    /// The share of the actor's turns that failed to parse.
    pub fn actor_format_error_rate(&self) -> f64 {
        self.actor_turns_failed as f64 / self.actor_turns.max(1) as f64
    }

    /// The share of the simulator's generations that broke the format or were rejected.
    pub fn sim_failure_rate(&self) -> f64 {
        self.simulator_failures as f64 / self.simulator_generations.max(1) as f64
    }

    /// The simulator's mean value agreement with the real response: shadow/real only.
    pub fn sim_fidelity(&self) -> Option<f64> {
        (self.fidelity_n > 0).then(|| self.fidelity_sum / self.fidelity_n as f64)
    }
}

/// What a step's rollouts produced: one group per task, one list of rows per episode.
#[derive(Debug, Default)]
pub(super) struct Played {
    pub groups: Vec<Vec<Vec<TrainingRow>>>,
    pub stats: RolloutStats,
}

/// Everything rollouts need besides the step: the run's settings, the model being trained and
/// what it was loaded with, the tasks, and the runtime the engine runs on.
pub(super) struct Rollouts<'a> {
    pub cfg: &'a GrpoConfig,
    pub model: &'a TrainableModel,
    pub model_dir: &'a Path,
    /// The model as loaded (tokenizer, chat template, end-of-sequence ids).
    pub base: &'a LocalModel,
    pub profile: Option<&'a PromptProfile>,
    pub tasks: &'a [&'static Task],
    pub rt: &'a tokio::runtime::Runtime,
    pub cancel: &'a CancelToken,
}

impl Rollouts<'_> {
    /// Play step `step`'s groups with the current weights.
    pub fn collect(&self, step: usize) -> Result<Played, TrainError> {
        let cfg = self.cfg;
        let shared = self.current_policy(step)?;
        let mut played = Played::default();
        for (ti, train_task) in step_tasks(self.tasks, cfg.batch, cfg.seed, step)
            .into_iter()
            .enumerate()
        {
            let task = &group_task(cfg, train_task, step, ti)?;
            let mut group = Vec::with_capacity(cfg.group);
            for g in 0..cfg.group {
                group.push(self.play(&shared, task, (step, ti, g), &mut played.stats)?);
            }
            played.groups.push(group);
        }
        Ok(played)
    }

    /// The model being trained, as the engine plays it: its current weights with the base's
    /// tokenizer and template.
    fn current_policy(&self, step: usize) -> Result<SharedModel, TrainError> {
        let base = self.base;
        let template = ChatTemplate::new(
            &base.template.source,
            &base.template.bos_token,
            &base.template.eos_token,
        )?;
        let view = LocalModel::from_parts(
            self.model.decoder.clone(),
            base.tokenizer.clone(),
            template,
            base.eos_ids.clone(),
            self.model_dir,
            format!("grpo-step-{step}"),
        );
        Ok(share_model(Box::new(view)))
    }

    /// One episode of `task`, counted into `stats`; its training rows.
    fn play(
        &self,
        shared: &SharedModel,
        task: &Task,
        (step, ti, g): (usize, usize, usize),
        stats: &mut RolloutStats,
    ) -> Result<Vec<TrainingRow>, TrainError> {
        let cfg = self.cfg;
        let config = episode_config(cfg, step, ti, g);
        let policy = Policy {
            model: shared,
            profile: self.profile,
        };
        let domain = task.domain().map_err(|e| TrainError::Data(e.to_string()))?;
        // Rehearse: the simulator sees the task's recorded gold run (as in EnvACE).
        let spec = task_spec(task, cfg.mode == ModeChoice::Rehearse)
            .map_err(|e| TrainError::Data(e.to_string()))?;
        let mut env = DomainEnv::with_tasks(domain, vec![task.clone()]);
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
            cancel: self.cancel.clone(),
        };
        let outcome = self
            .rt
            .block_on(launch(
                policy,
                Episode::new(spec, Some(task.id.clone())),
                &config,
                io,
            ))
            .map_err(|e| TrainError::Data(format!("rollout: {e}")))?;
        stats.add(&outcome, &sink_mem.mem.records);
        Ok(training_rows(&sink_mem.mem.records))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        // Real nouns for payees and items: every card payment still replays, and pays a noun.
        let mut nouns = 0;
        for (i, task) in list_tasks(Domain::Bank, Some(Split::Train))
            .into_iter()
            .enumerate()
        {
            let r = randomized_task_styled(task, i as u64, EntityStyle::Words)
                .expect("word-randomized task validates");
            for a in r.gold_actions() {
                if let Some(p) = a.arguments.get("payee").and_then(|v| v.as_str()) {
                    assert!(
                        crate::env::tasks::randomize::PAYEE_NOUNS.contains(&p),
                        "{}: payee {p}",
                        r.id
                    );
                    assert!(r.turns.iter().any(|t| t.user.contains(&format!("the {p}"))));
                    nouns += 1;
                }
            }
        }
        assert!(nouns >= 20, "{nouns} word payees");
        // Vocabulary words for every value: every bank train task still replays.
        for (i, task) in list_tasks(Domain::Bank, Some(Split::Train))
            .into_iter()
            .enumerate()
        {
            randomized_task_styled(task, i as u64, EntityStyle::Vocab)
                .expect("vocab-randomized task validates");
        }
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
}
