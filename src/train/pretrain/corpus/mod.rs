//! The pretraining corpus: every training text `envace pretrain` builds from the built-in
//! domains' train split, rendered as the engine will show it (see [`CorpusConfig`] for what
//! goes in). This module draws the tasks and decides, seeded, which texts each task yields;
//! the texts come from its children: `text` (rendering with trained segments), `episodes` (a
//! task's gold run: simulator pools, slipped calls, rehearsal-memory examples), `drills` (copy
//! drills, tool drills, calculation drills), [`tool_drill`] (made-up tools) and [`calc_drill`]
//! (calculator functions, some requests fitting none); random-entity copies come from
//! `env::tasks::randomize`, which GRPO's randomized tasks share.
//!
//! Corpora are reproducible: the same configuration gives the same texts, and a kind of text
//! that is off must not change the random draws of the others (earlier corpora stay the ones
//! their commands produced).

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::engine::profile::PromptProfile;
use crate::engine::prompts::actor::tools_json;
use crate::engine::prompts::simulator::{SimulatorPromptInput, simulator_prompt};
use crate::engine::spec::gold_conversation;
use crate::env::domains::Domain;
pub use crate::env::tasks::randomize::EntityStyle;
use crate::env::tasks::randomize::with_random_entities;
use crate::env::tasks::{Split, Task, generate_tasks, list_tasks};
use crate::runtime::chat_template::{
    COMPACT_TOOLS_TEMPLATE, COMPACT_TOOLS_TEMPLATE_V2, ChatTemplate,
};
use crate::train::TrainError;

pub mod calc_drill;
mod drills;
mod episodes;
mod steps;
pub(super) mod text;
pub mod tool_drill;

pub use drills::COPY_SYSTEM;
use drills::{calc_drill_texts, copy_drill, tool_drill_texts};
use episodes::{SlipInput, memory_example, recorded_pool, slip_examples};
pub use steps::PriceStepStyle;
use text::END;
pub use text::{Segmented, actor_text, actor_text_last, simulator_text};

/// What goes into the pretraining corpus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CorpusConfig {
    /// Train-split tasks generated per domain (0 = the 500 built-in ones). Every generated task
    /// has fresh names, ids and amounts, so the model must copy them from the request.
    pub tasks_per_domain: usize,
    /// Simulator examples per task (one per gold call, sampled; 0 = every call).
    pub sim_per_task: usize,
    /// Fraction of the tasks with an irreversible gold call that also yield an actor example
    /// whose prompt carries a Private Rehearsal memory (imagined branches, some with wrong ids
    /// and their real errors) before that call, so that rehearsal helps instead of derailing.
    pub memory_fraction: f64,
    /// Fraction of tasks that add a slipped call (one id or amount changed, as a model gets it
    /// wrong): a simulator example answering it with the domain's real response (usually an
    /// error such as `not_found`, so the simulator learns that calls can fail) and, when that
    /// response is an error, an actor example recovering with the gold call.
    #[serde(default)]
    pub slip_fraction: f64,
    /// Where a slip's new id or amount comes from: the corpus split's own values, or the whole
    /// range. A config recorded before this field existed was built with the whole range.
    #[serde(default = "SlipValues::legacy")]
    pub slip_values: SlipValues,
    /// Copy drills per task (a fraction is a probability; 2.5 = two, and a third half the
    /// time): short conversations whose reply repeats a list of train-split
    /// entities (ids, names, amounts, places) exactly. Dense practice of the one skill the
    /// tasks hinge on — carrying a value from the request into a call — which a small model
    /// otherwise learns slowly from the sparse copies inside full episodes.
    #[serde(default)]
    pub copy_per_task: f64,
    /// Fraction of simulator examples (gold calls and slips) whose few-shot pool is the task's
    /// whole recorded gold run, the call being simulated included: the context the simulator
    /// has in rehearse-mode training. It learns to answer a call that matches a recorded one
    /// with the recorded response, and a slipped call with the real error even though the
    /// gold call sits in the pool. Otherwise the pool is the other gold steps only.
    #[serde(default)]
    pub recorded_fraction: f64,
    /// Fraction of the items in copy drills that are random letter strings (`Qevorl`, `tusk`)
    /// instead of train-split entities. The train split's places, payees and items are short
    /// fixed lists a model memorises as units, so copying them teaches recall, not copying;
    /// the test split's held-out ones then come out wrong (`Kyvi` for `Kyiv`). Random strings
    /// can only be copied.
    #[serde(default)]
    pub random_copy_fraction: f64,
    /// Fraction of tasks that add a second actor conversation in which every train-split name,
    /// place, payee and item is replaced by a random letter string wherever it occurs (request,
    /// calls, responses, answer): the copying the test split demands, in the sentences it
    /// happens in, on values no model can have memorised.
    #[serde(default)]
    pub random_entity_fraction: f64,
    /// What the random entities look like: letter strings, or (lower-case values) real nouns.
    #[serde(default, skip_serializing_if = "is_default")]
    pub random_entity_style: EntityStyle,
    /// Tool drills per task (see [`tool_drill`]; a fraction is a probability): episodes
    /// with made-up tools, so that the model learns to read a tool list, not only the built-in
    /// domains' tools. Half of them also give a simulator example.
    #[serde(default)]
    pub tool_drills_per_task: f64,
    /// How the drills name their tools.
    #[serde(default)]
    pub tool_drill_style: tool_drill::DrillStyle,
    /// Calculation drills per task (see [`calc_drill`]; a fraction is a probability):
    /// calculator-style functions, one or two calls, or (15%) a request no listed function
    /// fits, which the reply declines without a call; half of the drills with one function
    /// called also give their declining twin (the same request, that function unlisted).
    /// Actor texts only.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub calc_drills_per_task: f64,
    /// Spelling drills per task (see [`drills::spell_drill`]; a fraction is a probability):
    /// 3-8 real words of the request copied into the JSON strings of as many calls.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub spell_drills_per_task: f64,
    /// Write price comparisons (see [`steps`]) in this style at the start of every actor turn
    /// that follows a list of flights (`fl_375 357 or fl_817 122: fl_817.`), then the call or
    /// answer. Recorded as `true` (pairs) or `"prices"`, left out when off.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "steps::recorded"
    )]
    pub price_steps: Option<PriceStepStyle>,
    /// The chat template the corpus is rendered with (and the model ships with).
    #[serde(default)]
    pub template: CorpusTemplate,
    /// More tasks of some kinds (`pay_if_enough` → 3.0: three times as many train-split tasks
    /// of that kind, the extra ones fresh instances from the next (W_max − 1)× as many tasks of
    /// the sequence, at most one short of the count where the kinds' cycle rounds down; every
    /// one with all its texts). Kinds a model keeps failing get the practice; no task is
    /// repeated.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kind_weights: BTreeMap<String, f64>,
    pub seed: u64,
}

/// Probability that a calculation drill also gives its declining twin.
const CALC_TWINS: f64 = 0.5;

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

fn is_default<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

/// Where a slipped call's new id or amount is drawn from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SlipValues {
    /// The corpus split's part of the range: a train-split corpus never mentions a test-split
    /// id or amount, not even as the `not_found` of a slip.
    #[default]
    Split,
    /// The whole range, a quarter of it the test split's: how every corpus was built before
    /// this option (the bundled models included), kept so that their commands reproduce.
    Any,
}

impl SlipValues {
    fn legacy() -> Self {
        Self::Any
    }

    /// The split a slip's values must belong to, if any.
    fn within(self, split: Split) -> Option<Split> {
        match self {
            Self::Split => Some(split),
            Self::Any => None,
        }
    }
}

/// Which compact template a model trained here speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum CorpusTemplate {
    /// [`COMPACT_TOOLS_TEMPLATE`]: tools as `name(params)` (the bundled model's).
    #[default]
    Compact,
    /// [`COMPACT_TOOLS_TEMPLATE_V2`]: optional parameters marked `name(req,opt?)`.
    CompactV2,
}

impl CorpusTemplate {
    pub fn source(self) -> &'static str {
        match self {
            Self::Compact => COMPACT_TOOLS_TEMPLATE,
            Self::CompactV2 => COMPACT_TOOLS_TEMPLATE_V2,
        }
    }
}

impl Default for CorpusConfig {
    fn default() -> Self {
        Self {
            tasks_per_domain: 0,
            sim_per_task: 0,
            memory_fraction: 0.0,
            slip_fraction: 0.0,
            slip_values: SlipValues::Split,
            copy_per_task: 0.0,
            recorded_fraction: 0.0,
            random_copy_fraction: 0.0,
            random_entity_fraction: 0.0,
            random_entity_style: EntityStyle::Letters,
            tool_drills_per_task: 0.0,
            tool_drill_style: Default::default(),
            calc_drills_per_task: 0.0,
            spell_drills_per_task: 0.0,
            price_steps: None,
            template: CorpusTemplate::Compact,
            kind_weights: BTreeMap::new(),
            seed: 0,
        }
    }
}

/// The split's own tasks: the first `tasks_per_domain` generated ones (0: the built-in set,
/// which is the same sequence's first 500 train and 100 test tasks).
fn base_tasks(d: Domain, split: Split, cfg: &CorpusConfig) -> Vec<Task> {
    match (cfg.tasks_per_domain, split) {
        (0, _) => list_tasks(d, Some(split)).into_iter().cloned().collect(),
        (n, Split::Train) => generate_tasks(d, n, 0),
        (n, Split::Test) => generate_tasks(d, 0, n),
    }
}

/// The tasks a corpus is built from: [`base_tasks`], then (train split, `kind_weights`) fresh
/// ones of the weighted kinds from further along the same sequence.
fn corpus_tasks(d: Domain, split: Split, cfg: &CorpusConfig) -> Vec<Task> {
    let mut tasks = base_tasks(d, split, cfg);
    if split != Split::Train || cfg.kind_weights.is_empty() {
        return tasks;
    }
    let n = tasks.len();
    let mut left: BTreeMap<&str, usize> = cfg
        .kind_weights
        .iter()
        .filter_map(|(kind, w)| {
            let have = tasks.iter().filter(|t| &t.kind == kind).count();
            let want = (have as f64 * (w - 1.0).max(0.0)).round() as usize;
            (want > 0).then_some((kind.as_str(), want))
        })
        .collect();
    if left.is_empty() {
        return tasks;
    }
    // Fresh tasks come from the next (W_max − 1)·n of the sequence, in order. Kinds cycle, so
    // the window holds about (W − 1)× each kind's count; where rounding leaves it one short, the
    // window is what the corpus gets (widening it would change corpora already trained on).
    let most = cfg.kind_weights.values().fold(1.0f64, |a, &w| a.max(w));
    let further = generate_tasks(d, (n as f64 * most).ceil() as usize, 0);
    for t in further.into_iter().skip(n) {
        if let Some(k) = left.get_mut(t.kind.as_str())
            && *k > 0
        {
            *k -= 1;
            tasks.push(t);
        }
    }
    tasks
}

/// Every `kind_weights` key that none of the domains' train tasks in the corpus has (a typo, or
/// a kind of a domain not trained on, would otherwise weigh nothing, silently).
pub fn unknown_kinds(domains: &[Domain], cfg: &CorpusConfig) -> Vec<String> {
    let known: std::collections::BTreeSet<String> = domains
        .iter()
        .flat_map(|&d| base_tasks(d, Split::Train, cfg))
        .map(|t| t.kind)
        .collect();
    cfg.kind_weights
        .keys()
        .filter(|k| !known.contains(*k))
        .cloned()
        .collect()
}

/// Every actor and simulator text of a domain split (see [`CorpusConfig`]).
pub fn corpus(
    domains: &[Domain],
    split: Split,
    profile: &PromptProfile,
    cfg: &CorpusConfig,
) -> Result<Vec<Segmented>, TrainError> {
    let t = ChatTemplate::new(cfg.template.source(), "", END)?;
    let mut out = Vec::new();
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    for &d in domains {
        let tools = d.tools();
        let tj = tools_json(&tools);
        for task in corpus_tasks(d, split, cfg) {
            let (msgs, calls) =
                gold_conversation(&task).map_err(|e| TrainError::Data(e.to_string()))?;
            let msgs = match cfg.price_steps {
                Some(style) => steps::with_price_steps(&msgs, style),
                None => msgs,
            };
            out.push(actor_text(&t, &msgs, &tj)?);
            if cfg.random_entity_fraction > 0.0 && rng.random::<f64>() < cfg.random_entity_fraction
            {
                let seed = rng.random::<u64>();
                let randomized = with_random_entities(&msgs, seed, cfg.random_entity_style)
                    .map_err(|e| TrainError::Data(e.to_string()))?;
                out.push(actor_text(&t, &randomized, &tj)?);
            }
            let mut chosen: Vec<usize> = (0..calls.len()).collect();
            if cfg.sim_per_task > 0 {
                chosen.shuffle(&mut rng);
                chosen.truncate(cfg.sim_per_task);
                chosen.sort_unstable();
            }
            for k in chosen {
                let gc = &calls[k];
                // Few-shot pool: the task's other gold steps, or (rehearse-mode context) the
                // whole recorded run.
                let examples = recorded_pool(&calls, k, recorded(cfg, &mut rng));
                let prompt = simulator_prompt(
                    &SimulatorPromptInput {
                        tools: &tools,
                        examples: &examples,
                        conversation: &msgs[..=gc.message],
                        call: &gc.call,
                    },
                    &profile.sim_prompt,
                );
                out.push(simulator_text(&t, &prompt, &gc.response)?);
            }
            if cfg.memory_fraction > 0.0
                && rng.random::<f64>() < cfg.memory_fraction
                && let Some(m) = memory_example(
                    &t,
                    &tj,
                    &task,
                    &msgs,
                    &calls,
                    cfg.slip_values.within(split),
                    &mut rng,
                )?
            {
                out.push(m);
            }
            if cfg.slip_fraction > 0.0 && rng.random::<f64>() < cfg.slip_fraction {
                let slip = SlipInput {
                    template: &t,
                    tools: &tools,
                    tools_json: &tj,
                    profile,
                    task: &task,
                    msgs: &msgs,
                    calls: &calls,
                    recorded: recorded(cfg, &mut rng),
                    within: cfg.slip_values.within(split),
                };
                out.extend(slip_examples(&slip, &mut rng)?);
            }
            for _ in 0..drill_count(cfg.copy_per_task, &mut rng) {
                let seed = rng.random::<u64>();
                out.push(copy_drill(&t, split, seed, cfg.random_copy_fraction)?);
            }
            for _ in 0..drill_count(cfg.tool_drills_per_task, &mut rng) {
                let seed = rng.random::<u64>();
                let with_sim = rng.random::<bool>();
                out.extend(tool_drill_texts(
                    &t,
                    profile,
                    seed,
                    with_sim,
                    cfg.tool_drill_style,
                )?);
            }
            for _ in 0..drill_count(cfg.calc_drills_per_task, &mut rng) {
                let seed = rng.random::<u64>();
                out.extend(calc_drill_texts(&t, seed, CALC_TWINS)?);
            }
            // Drawn last, so that corpora without them keep their draws.
            for _ in 0..drill_count(cfg.spell_drills_per_task, &mut rng) {
                let seed = rng.random::<u64>();
                out.push(drills::spell_drill(&t, seed)?);
            }
        }
    }
    Ok(out)
}

/// How many drills of a kind one task gets at `per_task` drills per task: the whole part, and
/// one more with the fractional part's probability (2.5 = two, and a third half the time). One
/// draw whenever the kind is on, even at a whole number, and none when it is off: the draws
/// every earlier corpus was built with (the model cards' commands reproduce).
fn drill_count(per_task: f64, rng: &mut StdRng) -> usize {
    if per_task <= 0.0 || !per_task.is_finite() {
        return 0;
    }
    let whole = per_task.floor();
    whole as usize + usize::from(rng.random::<f64>() < per_task - whole)
}

/// Whether this simulator example sees the whole recorded run (one draw, only when the fraction
/// is on, so that corpora without it are the ones earlier commands produced).
fn recorded(cfg: &CorpusConfig, rng: &mut StdRng) -> bool {
    cfg.recorded_fraction > 0.0 && rng.random::<f64>() < cfg.recorded_fraction
}

#[cfg(test)]
mod tests;
