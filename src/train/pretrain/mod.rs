//! `envace pretrain`: builds the bundled model from scratch on the built-in domains. The corpus
//! is the train split's gold runs, as the engine will show them: actor conversations (trained on
//! the assistant turns: tool calls, including ones that fail, and replies) and one simulator
//! prompt per call (trained on the real response, errors included), then a byte-level BPE
//! tokenizer (digits split, entity names kept out of the merges so held-out names tokenise like
//! training ones), then SFT. Writes an HF checkpoint directory plus `envace.json` (the prompt
//! profile the engine must use with it).

use std::path::Path;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::TrainError;
use super::metrics::MetricsSink;
use super::model::{Example, TrainableModel};
use super::sft::{SftConfig, SftReport, run_sft};
use crate::engine::parse::SimOutput;
use crate::engine::profile::PromptProfile;
use crate::engine::prompts::actor::tools_json;
use crate::engine::prompts::actor::{MEMORY_HEADING, actor_prompt, tool_message};
use crate::engine::prompts::memory::render_memory;
use crate::engine::prompts::simulator::{SimulatorPromptInput, simulator_prompt};
use crate::engine::spec::{GoldCall, gold_conversation};
use crate::engine::types::{
    BranchEnd, BranchStep, BranchSummary, MemoryConfig, MemoryPlacement, Prediction,
    RecordedExample, SimulatedOutcome,
};
use crate::env::ToolSpec;
use crate::env::domains::{Domain, sample_entities};
use crate::env::tasks::{Split, Task, generate_tasks, list_tasks};
use crate::message::{Message, Role, ToolCall};
use crate::runtime::CancelToken;
use crate::runtime::chat_template::{
    COMPACT_TOOLS_TEMPLATE, COMPACT_TOOLS_TEMPLATE_V2, ChatTemplate,
};
use crate::runtime::config::{DecoderConfig, Family};
use crate::runtime::fixture::tokenizer_config_with;
use crate::runtime::loader::is_gguf;
use crate::runtime::model::gguf_tokenizer;
use crate::runtime::tokenizer::Tokenizer;
use crate::train::lora::LoraConfig;

/// Pretraining settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PretrainConfig {
    pub seed: u64,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub intermediate_size: usize,
    pub max_len: usize,
    #[serde(default)]
    pub corpus: CorpusConfig,
    pub sft: SftConfig,
    /// Train a LoRA adapter on the `--init` model instead of every weight.
    #[serde(default)]
    pub lora: Option<LoraConfig>,
}

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
    /// Tool drills per task (see [`super::tool_drill`]; a fraction is a probability): episodes
    /// with made-up tools, so that the model learns to read a tool list, not only the built-in
    /// domains' tools. Half of them also give a simulator example.
    #[serde(default)]
    pub tool_drills_per_task: f64,
    /// How the drills name their tools.
    #[serde(default)]
    pub tool_drill_style: super::tool_drill::DrillStyle,
    /// The chat template the corpus is rendered with (and the model ships with).
    #[serde(default)]
    pub template: CorpusTemplate,
    pub seed: u64,
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
            copy_per_task: 0.0,
            recorded_fraction: 0.0,
            random_copy_fraction: 0.0,
            random_entity_fraction: 0.0,
            tool_drills_per_task: 0.0,
            tool_drill_style: Default::default(),
            template: CorpusTemplate::Compact,
            seed: 0,
        }
    }
}

impl Default for PretrainConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            vocab_size: 768,
            hidden_size: 256,
            layers: 6,
            heads: 8,
            kv_heads: 4,
            intermediate_size: 704,
            max_len: 512,
            corpus: CorpusConfig {
                tasks_per_domain: 4000,
                sim_per_task: 1,
                memory_fraction: 0.4,
                slip_fraction: 0.3,
                copy_per_task: 1.0,
                recorded_fraction: 0.0,
                random_copy_fraction: 0.0,
                random_entity_fraction: 0.0,
                tool_drills_per_task: 0.0,
                tool_drill_style: Default::default(),
                template: CorpusTemplate::Compact,
                seed: 0,
            },
            sft: SftConfig {
                steps: 3000,
                batch_size: 16,
                lr: 2e-3,
                warmup: 100,
                min_lr_ratio: 0.05,
                weight_decay: 0.01,
                grad_clip: 1.0,
                seed: 0,
                max_len: 512,
                checkpoint_every: 0,
                time_budget_s: Some(900.0),
                stop_at: None,
            },
            lora: None,
        }
    }
}

/// A rendered training text split into (text, trained) segments.
#[derive(Debug, Clone, PartialEq)]
pub struct Segmented {
    pub role: Role,
    pub segments: Vec<(String, bool)>,
}

impl Segmented {
    pub fn text(&self) -> String {
        self.segments.iter().map(|(s, _)| s.as_str()).collect()
    }

    /// Tokenise segment by segment so that the mask lines up with token boundaries.
    pub fn to_example(&self, tok: &Tokenizer) -> Result<Example, TrainError> {
        let mut ids = Vec::new();
        let mut mask = Vec::new();
        for (s, trained) in &self.segments {
            let t = tok.encode(s)?;
            mask.extend(std::iter::repeat_n(
                if *trained { 1.0 } else { 0.0 },
                t.len(),
            ));
            ids.extend(t);
        }
        Ok(Example { ids, mask })
    }
}

/// Split `full` into untrained / trained parts at the given (start, end) byte ranges.
fn segment(full: &str, trained: &[(usize, usize)]) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut pos = 0;
    for &(a, b) in trained {
        if a > pos {
            out.push((full[pos..a].to_string(), false));
        }
        out.push((full[a..b].to_string(), true));
        pos = b;
    }
    if pos < full.len() {
        out.push((full[pos..].to_string(), false));
    }
    out
}

const END: &str = "<|im_end|>";

/// The actor text of a conversation: every assistant message (content, calls, `<|im_end|>`)
/// is trained.
pub fn actor_text(
    t: &ChatTemplate,
    msgs: &[Message],
    tools: &[Value],
) -> Result<Segmented, TrainError> {
    let full = t.render(msgs, tools, false, false)?;
    let mut ranges = Vec::new();
    for (i, m) in msgs.iter().enumerate() {
        if m.role != Role::Assistant {
            continue;
        }
        let start = t.render(&msgs[..i], tools, true, false)?.len();
        let end = t.render(&msgs[..=i], tools, false, false)?.len();
        let body = &full[start..end];
        let cut = body
            .rfind(END)
            .map(|p| start + p + END.len())
            .unwrap_or(end);
        ranges.push((start, cut));
    }
    Ok(Segmented {
        role: Role::Assistant,
        segments: segment(&full, &ranges),
    })
}

/// The simulator text for one call: its prompt, then the trained result.
pub fn simulator_text(
    t: &ChatTemplate,
    prompt: &[Message],
    result: &Value,
) -> Result<Segmented, TrainError> {
    let p = t.render(prompt, &[], true, false)?;
    let target = format!("<execution_result>{result}</execution_result>{END}");
    Ok(Segmented {
        role: Role::Tool,
        segments: vec![(p, false), (target, true)],
    })
}

/// The actor text of a conversation whose last message (an assistant turn) is the only one
/// trained.
pub fn actor_text_last(
    t: &ChatTemplate,
    msgs: &[Message],
    tools: &[Value],
) -> Result<Segmented, TrainError> {
    let full = t.render(msgs, tools, false, false)?;
    let start = t.render(&msgs[..msgs.len() - 1], tools, true, false)?.len();
    let cut = full[start..]
        .rfind(END)
        .map(|p| start + p + END.len())
        .unwrap_or(full.len());
    Ok(Segmented {
        role: Role::Assistant,
        segments: segment(&full, &[(start, cut)]),
    })
}

/// The tasks a corpus is built from.
fn corpus_tasks(d: Domain, split: Split, cfg: &CorpusConfig) -> Vec<Task> {
    if cfg.tasks_per_domain == 0 {
        return list_tasks(d, Some(split)).into_iter().cloned().collect();
    }
    match split {
        Split::Train => generate_tasks(d, cfg.tasks_per_domain, 0),
        Split::Test => generate_tasks(d, 0, cfg.tasks_per_domain),
    }
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
            out.push(actor_text(&t, &msgs, &tj)?);
            if cfg.random_entity_fraction > 0.0 && rng.random::<f64>() < cfg.random_entity_fraction
            {
                let seed = rng.random::<u64>();
                out.push(actor_text(&t, &with_random_entities(&msgs, seed)?, &tj)?);
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
                && let Some(m) = memory_example(&t, &tj, &task, &msgs, &calls, &mut rng)?
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
                };
                out.extend(slip_examples(&slip, &mut rng)?);
            }
            // Whole drills, then one more with the fractional part's probability.
            let whole = cfg.copy_per_task.max(0.0).floor();
            // One draw whenever drills are on, as before whole drills existed, so that a corpus
            // of `--copy-per-task` ≤ 1 is the one the model card's commands produced.
            let frac = cfg.copy_per_task - whole;
            let extra = usize::from(cfg.copy_per_task > 0.0 && rng.random::<f64>() < frac);
            for _ in 0..whole as usize + extra {
                let seed = rng.random::<u64>();
                out.push(copy_drill(&t, split, seed, cfg.random_copy_fraction)?);
            }
            if cfg.tool_drills_per_task > 0.0 {
                let whole = cfg.tool_drills_per_task.floor();
                let frac = cfg.tool_drills_per_task - whole;
                let extra = usize::from(rng.random::<f64>() < frac);
                for _ in 0..whole as usize + extra {
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
            }
        }
    }
    Ok(out)
}

/// The actor text of tool drill `seed` and, with `with_sim`, the simulator text of its first
/// call (the response it got).
fn tool_drill_texts(
    t: &ChatTemplate,
    profile: &PromptProfile,
    seed: u64,
    with_sim: bool,
    style: super::tool_drill::DrillStyle,
) -> Result<Vec<Segmented>, TrainError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let server = format!("mcp:{}", random_word_styled(&mut rng, false));
    let d = super::tool_drill::tool_drill_styled(
        seed,
        &crate::engine::spec::mcp_system(&server),
        style,
    );
    let mut out = vec![actor_text(t, &d.messages, &tools_json(&d.tools))?];
    if let (true, Some((call, response))) = (with_sim, d.calls.first()) {
        let at = d
            .messages
            .iter()
            .position(|m| !m.tool_calls.is_empty())
            .unwrap_or(d.messages.len() - 1);
        let prompt = simulator_prompt(
            &SimulatorPromptInput {
                tools: &d.tools,
                examples: &[],
                conversation: &d.messages[..=at],
                call,
            },
            &profile.sim_prompt,
        );
        out.push(simulator_text(t, &prompt, response)?);
    }
    Ok(out)
}

/// Whether this simulator example sees the whole recorded run (one draw, only when the fraction
/// is on, so that corpora without it are the ones earlier commands produced).
fn recorded(cfg: &CorpusConfig, rng: &mut StdRng) -> bool {
    cfg.recorded_fraction > 0.0 && rng.random::<f64>() < cfg.recorded_fraction
}

/// The simulator's few-shot pool for gold call `k`: the other gold steps, or every gold step
/// (`k` included) when `whole_run`.
fn recorded_pool(calls: &[GoldCall], k: usize, whole_run: bool) -> Vec<RecordedExample> {
    calls
        .iter()
        .enumerate()
        .filter(|(j, _)| whole_run || *j != k)
        .map(|(_, o)| RecordedExample {
            name: o.call.name.clone(),
            arguments: o.call.arguments.clone(),
            response: o.response.clone(),
        })
        .collect()
}

/// A copy of `call` with one id argument (`prefix_N`) renumbered, or, without ids, one integer
/// argument changed: the kind of slip a rehearsal branch makes.
fn corrupt_call(call: &ToolCall, rng: &mut StdRng) -> Option<ToolCall> {
    let args = call.arguments.as_object()?;
    let keys: Vec<&String> = args.keys().collect();
    let ids: Vec<&String> = keys
        .iter()
        .copied()
        .filter(|k| {
            args[k.as_str()]
                .as_str()
                .and_then(|v| v.rsplit_once('_'))
                .is_some_and(|(_, n)| n.parse::<i64>().is_ok())
        })
        .collect();
    let ints: Vec<&String> = keys
        .iter()
        .copied()
        .filter(|k| args[k.as_str()].is_i64())
        .collect();
    let mut new = args.clone();
    if let Some(k) = ids.choose(rng) {
        let v = args[k.as_str()].as_str()?;
        let (prefix, n) = v.rsplit_once('_')?;
        let n: i64 = n.parse().ok()?;
        let m = loop {
            let m = rng.random_range(100..=999);
            if m != n {
                break m;
            }
        };
        new.insert((*k).clone(), Value::String(format!("{prefix}_{m}")));
    } else if let Some(k) = ints.choose(rng) {
        let n = args[k.as_str()].as_i64()?;
        let delta = rng.random_range(1..=200);
        new.insert(
            (*k).clone(),
            json!(if rng.random::<bool>() {
                n + delta
            } else {
                (n - delta).max(1)
            }),
        );
    } else {
        return None;
    }
    Some(ToolCall {
        name: call.name.clone(),
        arguments: Value::Object(new),
    })
}

/// System prompt of the copy drills.
pub const COPY_SYSTEM: &str = "Repeat the items exactly.";

/// A copy drill: 4-10 entities of the split, echoed in order (see
/// [`CorpusConfig::copy_per_task`]); each is replaced by a random letter string with
/// probability `random_fraction` ([`CorpusConfig::random_copy_fraction`]).
fn copy_drill(
    t: &ChatTemplate,
    split: Split,
    seed: u64,
    random_fraction: f64,
) -> Result<Segmented, TrainError> {
    let n = 4 + (seed % 7) as usize;
    let mut entities = sample_entities(split, seed, n);
    if random_fraction > 0.0 {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x7261_6e64);
        for e in &mut entities {
            if rng.random::<f64>() < random_fraction {
                *e = random_word(&mut rng);
            }
        }
    }
    let items = entities.join(", ");
    let msgs = vec![
        Message::system(COPY_SYSTEM),
        Message::user(items.clone()),
        Message::assistant(items),
    ];
    actor_text_last(t, &msgs, &[])
}

/// A random letter string of 3-8 letters, capitalised half the time, never a test-pool value.
fn random_word(rng: &mut StdRng) -> String {
    let capital = rng.random::<bool>();
    random_word_styled(rng, capital)
}

/// A random letter string of 3-8 letters (first letter upper case if `capital`), never a
/// test-pool value.
pub(crate) fn random_word_styled(rng: &mut StdRng, capital: bool) -> String {
    const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
    loop {
        let len = rng.random_range(3..=8);
        let mut w: String = (0..len)
            .map(|_| char::from(LETTERS[rng.random_range(0..LETTERS.len())]))
            .collect();
        if capital {
            w = w[..1].to_uppercase() + &w[1..];
        }
        if !crate::env::domains::in_test_pools(&w) {
            return w;
        }
    }
}

/// `msgs` with every train-split pool value that occurs as a whole word replaced by a random
/// string (the same one at every occurrence, capitalised like the original; see
/// [`CorpusConfig::random_entity_fraction`]).
fn with_random_entities(msgs: &[Message], seed: u64) -> Result<Vec<Message>, TrainError> {
    let text =
        serde_json::to_string(msgs).map_err(|e| TrainError::Data(format!("messages: {e}")))?;
    serde_json::from_str(&randomize_pool_words(&text, seed))
        .map_err(|e| TrainError::Data(format!("messages: {e}")))
}

/// `text` with every train-split pool value that occurs as a whole word replaced by a random
/// letter string (the same one at every occurrence, capitalised like the original, never a
/// test- or train-pool value nor a word already in the text), seeded. Shared by the pretraining corpus and GRPO's randomized tasks.
pub(crate) fn randomize_pool_words(text: &str, seed: u64) -> String {
    let mut text = text.to_string();
    let mut rng = StdRng::seed_from_u64(seed);
    // Longest first, so that `Anna` is replaced before a shorter value could match inside it.
    let pool = crate::env::domains::train_pool_values();
    let mut values = pool.clone();
    values.sort_by_key(|v| std::cmp::Reverse(v.len()));
    for v in values {
        if find_word(&text, v).is_none() {
            continue;
        }
        let capital = v.chars().next().is_some_and(char::is_uppercase);
        // A replacement that is already a word of the text (another entity's replacement, a
        // JSON key, a pool value still to come) would merge two things into one.
        let new = loop {
            let w = random_word_styled(&mut rng, capital);
            if find_word(&text, &w).is_none() && !pool.contains(&w.as_str()) {
                break w;
            }
        };
        text = replace_words(&text, v, &new);
    }
    text
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Byte offset of the first whole-word occurrence of `word` in `text`.
fn find_word(text: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = text[from..].find(word) {
        let start = from + i;
        let end = start + word.len();
        let before = text[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !is_word_char(c));
        let after = text[end..].chars().next().is_none_or(|c| !is_word_char(c));
        if before && after {
            return Some(start);
        }
        from = start + word.len().max(1);
    }
    None
}

/// `text` with every whole-word occurrence of `word` replaced by `new`.
fn replace_words(text: &str, word: &str, new: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = find_word(rest, word) {
        out.push_str(&rest[..i]);
        out.push_str(new);
        rest = &rest[i + word.len()..];
    }
    out.push_str(rest);
    out
}

/// What [`slip_examples`] needs from the task being rendered.
struct SlipInput<'a> {
    template: &'a ChatTemplate,
    tools: &'a [ToolSpec],
    tools_json: &'a [Value],
    profile: &'a PromptProfile,
    task: &'a Task,
    msgs: &'a [Message],
    calls: &'a [GoldCall],
    /// The simulator example's pool is the whole recorded run (see [`CorpusConfig`]).
    recorded: bool,
}

/// A slip of one gold call, answered by the domain's real response: a simulator example for
/// it, and (when the response is an error) an actor example whose prompt shows the slip and
/// its error and whose target is the gold call.
fn slip_examples(x: &SlipInput<'_>, rng: &mut StdRng) -> Result<Vec<Segmented>, TrainError> {
    if x.calls.is_empty() {
        return Ok(Vec::new());
    }
    let k = rng.random_range(0..x.calls.len());
    let gc = &x.calls[k];
    let Some(bad) = corrupt_call(&gc.call, rng) else {
        return Ok(Vec::new());
    };
    let d = x
        .task
        .domain()
        .map_err(|e| TrainError::Data(e.to_string()))?;
    let mut state = x.task.initial_state.clone();
    for c in &x.calls[..k] {
        d.apply(&mut state, &c.call)
            .map_err(|e| TrainError::Data(e.to_string()))?;
    }
    let response = d
        .apply(&mut state, &bad)
        .map_err(|e| TrainError::Data(e.to_string()))?
        .to_json();
    // The conversation as it would look with the slip in place of the gold call.
    let gold_msg = &x.msgs[gc.message];
    let mut slipped = gold_msg.clone();
    let id = match slipped.tool_calls.first_mut() {
        Some(tc) => {
            tc.function = bad.clone();
            tc.id.clone()
        }
        None => return Ok(Vec::new()),
    };
    let mut conv = x.msgs[..gc.message].to_vec();
    conv.push(slipped);
    let examples = recorded_pool(x.calls, k, x.recorded);
    let prompt = simulator_prompt(
        &SimulatorPromptInput {
            tools: x.tools,
            examples: &examples,
            conversation: &conv,
            call: &bad,
        },
        &x.profile.sim_prompt,
    );
    let mut out = vec![simulator_text(x.template, &prompt, &response)?];
    if response.get("error").is_some() {
        conv.push(tool_message(&id, &bad.name, &response));
        conv.push(gold_msg.clone());
        out.push(actor_text_last(x.template, &conv, x.tools_json)?);
    }
    Ok(out)
}

/// An actor example whose prompt carries a rehearsal memory of four imagined branches before
/// the task's first irreversible gold call: some branches make that call (and see its real
/// response), others a slip of it (and see the real response to the slip, usually an error).
/// The target is the gold call, so the model learns to use the memory without trusting it
/// blindly. The memory is rendered exactly as the engine renders it (default settings).
fn memory_example(
    t: &ChatTemplate,
    tools: &[Value],
    task: &Task,
    msgs: &[Message],
    calls: &[GoldCall],
    rng: &mut StdRng,
) -> Result<Option<Segmented>, TrainError> {
    let d = task.domain().map_err(|e| TrainError::Data(e.to_string()))?;
    let specs = d.tools();
    let irreversible = |name: &str| specs.iter().any(|s| s.name == name && s.is_irreversible());
    let Some(k) = calls.iter().position(|c| irreversible(&c.call.name)) else {
        return Ok(None);
    };
    let gc = &calls[k];
    // The state just before the call: the earlier gold calls replayed on the initial state.
    let mut state = task.initial_state.clone();
    for c in &calls[..k] {
        d.apply(&mut state, &c.call)
            .map_err(|e| TrainError::Data(e.to_string()))?;
    }
    // The reply the gold run gives right after the call, if the call ends its turn.
    let reply = msgs
        .get(gc.message + 2)
        .filter(|m| m.role == Role::Assistant && m.tool_calls.is_empty())
        .map(|m| m.content.clone());
    let branch = |index: usize, call: &ToolCall, value: Value, reply: Option<String>| {
        let error = value.get("error").is_some();
        let end = match (&reply, error) {
            (Some(text), false) => BranchEnd::Answered { text: text.clone() },
            _ => BranchEnd::DepthReached,
        };
        let prediction = match (&end, error) {
            (_, true) => Prediction::Failure {
                reason: "a tool returned an error".into(),
            },
            (BranchEnd::Answered { .. }, false) => Prediction::Success,
            _ => Prediction::Unknown,
        };
        BranchSummary {
            index,
            steps: vec![BranchStep {
                call: call.clone(),
                outcome: SimulatedOutcome::Parsed {
                    output: SimOutput::Result { value },
                },
            }],
            end,
            prediction,
        }
    };
    // How many of the four branches slip: none (30%), some (50%), all (20%).
    let u: f64 = rng.random();
    let wrong = if u < 0.3 {
        0
    } else if u < 0.8 {
        rng.random_range(1..=3)
    } else {
        4
    };
    let mut branches = Vec::new();
    for i in 0..4 {
        if i < wrong {
            let Some(bad) = corrupt_call(&gc.call, rng) else {
                return Ok(None);
            };
            let resp = d
                .apply(&mut state.clone(), &bad)
                .map_err(|e| TrainError::Data(e.to_string()))?;
            branches.push(branch(i, &bad, resp.to_json(), None));
        } else {
            branches.push(branch(i, &gc.call, gc.response.clone(), reply.clone()));
        }
    }
    branches.shuffle(rng);
    for (i, b) in branches.iter_mut().enumerate() {
        b.index = i;
    }
    let memory = render_memory(&branches, &MemoryConfig::default());
    let mut prompt = actor_prompt(
        &msgs[..gc.message],
        Some(&memory),
        MemoryPlacement::UserMessage,
    );
    prompt.push(msgs[gc.message].clone());
    Ok(Some(actor_text_last(t, &prompt, tools)?))
}

/// Text for tokenizer training: capitalised words (entity names) are removed so that names
/// never become merged tokens.
fn tokenizer_corpus(texts: &[Segmented]) -> Vec<String> {
    texts
        .iter()
        .map(|s| {
            s.text()
                .split(' ')
                .filter(|w| !w.chars().next().is_some_and(char::is_uppercase))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

/// Corpus statistics and one sample text per role (`envace pretrain --dry-run`).
pub fn corpus_stats(texts: &[Segmented], tok: Option<&Tokenizer>) -> Value {
    let mut by_role = serde_json::Map::new();
    for role in [Role::Assistant, Role::Tool] {
        let items: Vec<&Segmented> = texts.iter().filter(|t| t.role == role).collect();
        let chars: Vec<usize> = items.iter().map(|t| t.text().len()).collect();
        let tokens: Vec<usize> = match tok {
            Some(tok) => items
                .iter()
                .filter_map(|t| tok.encode(&t.text()).ok().map(|v| v.len()))
                .collect(),
            None => Vec::new(),
        };
        let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len().max(1) as f64;
        let name = if role == Role::Assistant {
            "actor"
        } else {
            "simulator"
        };
        by_role.insert(
            name.into(),
            json!({
                "texts": items.len(),
                "mean_chars": mean(&chars),
                "mean_tokens": mean(&tokens),
                "max_tokens": tokens.iter().max(),
                "sample": items.first().map(|t| t.text()),
            }),
        );
    }
    by_role.insert(
        "memory_sample".into(),
        json!(
            texts
                .iter()
                .map(Segmented::text)
                .find(|t| t.contains(MEMORY_HEADING))
        ),
    );
    Value::Object(by_role)
}

/// The corpus of the bundled model's recipe, tokenised with a freshly trained tokenizer.
pub fn dry_run(cfg: &PretrainConfig) -> Result<Value, TrainError> {
    let texts = corpus(
        &Domain::ALL,
        Split::Train,
        &PromptProfile::compact(),
        &cfg.corpus,
    )?;
    let tok = Tokenizer::from_inner(super::tokenizer::train_bpe(
        &tokenizer_corpus(&texts),
        cfg.vocab_size,
        8,
    )?);
    Ok(corpus_stats(&texts, Some(&tok)))
}

/// What `envace pretrain` reports.
#[derive(Debug, Clone, Serialize)]
pub struct PretrainReport {
    pub out: String,
    pub vocab_size: usize,
    pub parameters: usize,
    pub actor_examples: usize,
    pub simulator_examples: usize,
    pub mean_tokens: f64,
    pub sft: SftReport,
    pub seconds: f64,
}

/// The `pretrain.json` of the model a continuation starts from: `None` when it has none (a
/// checkpoint not made by `envace pretrain`); an unreadable or malformed one is an error that
/// names the file (and the line and column).
fn parent_record(dir: &Path) -> Result<Option<serde_json::Value>, TrainError> {
    if !dir.is_dir() {
        // A model file (GGUF) carries no record.
        return Ok(None);
    }
    let path = dir.join("pretrain.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TrainError::Data(format!("{}: {e}", path.display()))),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))
}

/// Run the whole pipeline into `out` (an HF checkpoint directory). With `init`, training
/// continues from that model (its tokenizer and weights) with a fresh schedule.
pub fn run_pretrain(
    cfg: &PretrainConfig,
    init: Option<&Path>,
    out: &Path,
    sink: &mut dyn MetricsSink,
    cancel: &CancelToken,
) -> Result<PretrainReport, TrainError> {
    let t0 = Instant::now();
    // Read the parent's record before any work: a malformed one is refused now, not after
    // the training it would otherwise be silently dropped from.
    let init_record = init
        .map(|dir| {
            parent_record(dir)
                .map(|parent| json!({ "path": dir.display().to_string(), "pretrain": parent }))
        })
        .transpose()?;
    let profile = PromptProfile::compact();
    let texts = corpus(&Domain::ALL, Split::Train, &profile, &cfg.corpus)?;
    sink.log(&format!("corpus: {} texts", texts.len()));
    let work = out.with_extension("work");
    std::fs::create_dir_all(&work)
        .map_err(|e| TrainError::Data(format!("{}: {e}", work.display())))?;
    let tok_path = work.join("tokenizer.json");
    let hf_tok = match init {
        // A GGUF file: its own tokenizer, as the inference path builds it.
        Some(file) if is_gguf(file) => gguf_tokenizer(file)?.inner().clone(),
        // Continue training an existing model: keep its tokenizer.
        Some(dir) => {
            std::fs::copy(dir.join("tokenizer.json"), &tok_path).map_err(|e| {
                TrainError::Data(format!("{}: {e}", dir.join("tokenizer.json").display()))
            })?;
            tokenizers::Tokenizer::from_file(&tok_path)
                .map_err(|e| TrainError::Data(format!("{}: {e}", tok_path.display())))?
        }
        None => super::tokenizer::train_bpe(&tokenizer_corpus(&texts), cfg.vocab_size, 8)?,
    };
    super::tokenizer::save(&hf_tok, &tok_path)?;
    let tc = tokenizer_config_with(cfg.corpus.template.source());
    std::fs::write(
        work.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tc).unwrap_or_default(),
    )
    .map_err(|e| TrainError::Data(e.to_string()))?;
    let tok = Tokenizer::from_inner(hf_tok);
    let mut examples = Vec::with_capacity(texts.len());
    let (mut actor, mut sim) = (0, 0);
    for t in &texts {
        match t.role {
            Role::Assistant => actor += 1,
            _ => sim += 1,
        }
        examples.push(t.to_example(&tok)?);
    }
    let mean_tokens =
        examples.iter().map(|e| e.ids.len() as f64).sum::<f64>() / examples.len().max(1) as f64;
    sink.log(&format!(
        "tokenizer: {} tokens; {actor} actor + {sim} simulator examples, {mean_tokens:.0} tokens on average",
        tok.vocab_size()
    ));
    let vocab = tok.vocab_size().div_ceil(64) * 64;
    let im_end = tok
        .token_to_id(END)
        .ok_or_else(|| TrainError::Data("tokenizer lacks <|im_end|>".into()))?;
    let dcfg = DecoderConfig {
        family: Family::Llama,
        vocab_size: vocab,
        hidden_size: cfg.hidden_size,
        intermediate_size: cfg.intermediate_size,
        num_hidden_layers: cfg.layers,
        num_attention_heads: cfg.heads,
        num_key_value_heads: cfg.kv_heads,
        head_dim: cfg.hidden_size / cfg.heads,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 2048,
        tie_word_embeddings: true,
        qkv_bias: false,
        qk_norm: false,
        rope_interleaved: false,
        bos_token_id: None,
        eos_token_ids: vec![im_end],
    };
    let device = candle_core::Device::Cpu;
    let model = match (init, &cfg.lora) {
        (Some(dir), Some(lora)) => TrainableModel::load_lora(dir, lora, &device)?,
        (Some(dir), None) => TrainableModel::load(dir, &device)?,
        (None, Some(_)) => {
            return Err(TrainError::Data(
                "--lora needs --init: an adapter trains on an existing model".into(),
            ));
        }
        (None, None) => TrainableModel::init(&dcfg, cfg.seed, &device)?,
    };
    let dcfg = model.decoder.cfg.clone();
    let mut sft = cfg.sft.clone();
    sft.seed = cfg.seed;
    sft.max_len = cfg.max_len;
    let report = run_sft(
        &model,
        &examples,
        &sft,
        &tok_path,
        Some(&work),
        None,
        sink,
        cancel,
    )?;
    // The final checkpoint becomes the model directory; the prompt profile goes beside it.
    let fin = work.join("final");
    let profile_json = serde_json::to_string_pretty(&profile).unwrap_or_default();
    std::fs::write(fin.join("envace.json"), profile_json)
        .map_err(|e| TrainError::Data(e.to_string()))?;
    // The shipped model needs no optimizer state.
    let _ = std::fs::remove_file(fin.join("optimizer.safetensors"));
    // A continuation records what it continued from (and that model's own record, read
    // above), so a shipped model's whole lineage stays in its directory.
    let summary = json!({
        "kind": "pretrain",
        "init": init_record,
        "config": cfg,
        "vocab_size": tok.vocab_size(),
        "parameters": dcfg.parameter_count(),
        "actor_examples": actor,
        "simulator_examples": sim,
        "mean_tokens": mean_tokens,
        "sft": report,
    });
    std::fs::write(
        fin.join("pretrain.json"),
        serde_json::to_string_pretty(&summary).unwrap_or_default(),
    )
    .map_err(|e| TrainError::Data(e.to_string()))?;
    if out.exists() {
        std::fs::remove_dir_all(out)
            .map_err(|e| TrainError::Data(format!("{}: {e}", out.display())))?;
    }
    std::fs::rename(&fin, out).map_err(|e| TrainError::Data(format!("{}: {e}", out.display())))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(PretrainReport {
        out: out.display().to_string(),
        vocab_size: tok.vocab_size(),
        parameters: dcfg.parameter_count(),
        actor_examples: actor,
        simulator_examples: sim,
        mean_tokens,
        sft: report,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(memory_fraction: f64) -> CorpusConfig {
        CorpusConfig {
            tasks_per_domain: 30,
            sim_per_task: 1,
            memory_fraction,
            slip_fraction: 0.0,
            copy_per_task: 0.0,
            recorded_fraction: 0.0,
            random_copy_fraction: 0.0,
            random_entity_fraction: 0.0,
            tool_drills_per_task: 0.0,
            tool_drill_style: Default::default(),
            template: CorpusTemplate::Compact,
            seed: 7,
        }
    }

    /// (prompt, trained result JSON) of every simulator text.
    fn sim_pairs(texts: &[Segmented]) -> Vec<(String, String)> {
        texts
            .iter()
            .filter(|t| t.role == Role::Tool)
            .map(|t| {
                let (p, r) = (&t.segments[0].0, &t.segments[1].0);
                let json = r
                    .trim_start_matches("<execution_result>")
                    .split("</execution_result>")
                    .next()
                    .unwrap_or_default()
                    .to_string();
                (p.clone(), json)
            })
            .collect()
    }

    #[test]
    fn recorded_runs_put_the_simulated_call_and_its_response_in_the_pool() {
        let mut c = cfg(0.0);
        c.sim_per_task = 0;
        let plain = corpus(&Domain::ALL, Split::Train, &PromptProfile::compact(), &c).unwrap();
        c.recorded_fraction = 1.0;
        c.slip_fraction = 1.0;
        let recorded = corpus(&Domain::ALL, Split::Train, &PromptProfile::compact(), &c).unwrap();
        let pairs = sim_pairs(&recorded);
        assert!(pairs.len() > 90, "{} simulator texts", pairs.len());
        // Gold calls: the target is in the prompt (the recorded run holds it).
        let copied = pairs.iter().filter(|(p, r)| p.contains(r.as_str())).count();
        // Slips (one per task here) answer with the real error, which the pool does not hold.
        let errors = pairs
            .iter()
            .filter(|(_, r)| r.contains("\"error\""))
            .count();
        assert!(
            copied + errors >= pairs.len(),
            "{copied} copied, {errors} errors of {}",
            pairs.len()
        );
        assert!(copied * 2 > pairs.len(), "{copied} of {}", pairs.len());
        // Without it, the pool never holds the call being simulated.
        let plain_pairs = sim_pairs(&plain);
        let leaked = plain_pairs
            .iter()
            .filter(|(p, r)| p.contains(r.as_str()))
            .count();
        assert!(
            leaked * 5 < plain_pairs.len(),
            "{leaked} of {}",
            plain_pairs.len()
        );
    }

    #[test]
    fn generated_corpus_has_one_actor_and_one_simulator_text_per_task() {
        let texts = corpus(
            &[Domain::Bank],
            Split::Train,
            &PromptProfile::compact(),
            &cfg(0.0),
        )
        .unwrap();
        let actor = texts.iter().filter(|t| t.role == Role::Assistant).count();
        let sim = texts.iter().filter(|t| t.role == Role::Tool).count();
        assert_eq!((actor, sim), (30, 30));
        assert!(!texts.iter().any(|t| t.text().contains(MEMORY_HEADING)));
    }

    #[test]
    fn memory_examples_train_only_the_gold_call_after_the_memory() {
        let texts = corpus(
            &Domain::ALL,
            Split::Train,
            &PromptProfile::compact(),
            &cfg(1.0),
        )
        .unwrap();
        let memories: Vec<&Segmented> = texts
            .iter()
            .filter(|t| t.text().contains(MEMORY_HEADING))
            .collect();
        assert!(
            memories.len() >= 20,
            "only {} memory examples",
            memories.len()
        );
        let mut slips = 0;
        for m in memories {
            let trained: Vec<&(String, bool)> = m.segments.iter().filter(|s| s.1).collect();
            assert_eq!(trained.len(), 1, "one trained turn");
            let target = &trained[0].0;
            assert!(target.starts_with("<tool_call>"), "{target}");
            assert!(target.ends_with(END));
            // The memory comes before the trained turn, never after it.
            let text = m.text();
            assert!(text.find(MEMORY_HEADING).unwrap() < text.find(target.as_str()).unwrap());
            // Branch lines: the gold call or a slip of it with the slip's real response.
            let note = &text[text.find(MEMORY_HEADING).unwrap()..];
            let call_json = &target["<tool_call>".len()..target.find("</tool_call>").unwrap()];
            let gold: Value = serde_json::from_str(call_json).unwrap();
            let gold_compact = serde_json::to_string(&gold).unwrap();
            for line in note
                .lines()
                .skip(1)
                .take_while(|l| !l.contains("<|im_end|>"))
            {
                if !line.contains(&gold_compact) {
                    slips += 1;
                    assert!(line.contains("predicted"), "{line}");
                }
            }
        }
        assert!(slips > 0, "no branch with a slip");
    }

    #[test]
    fn slips_teach_the_simulator_real_errors_and_the_actor_to_recover() {
        let c = CorpusConfig {
            slip_fraction: 1.0,
            ..cfg(0.0)
        };
        let plain = corpus(
            &Domain::ALL,
            Split::Train,
            &PromptProfile::compact(),
            &cfg(0.0),
        )
        .unwrap();
        let texts = corpus(&Domain::ALL, Split::Train, &PromptProfile::compact(), &c).unwrap();
        let extra = texts.len() - plain.len();
        assert!(extra >= 90, "{extra} slip examples for 90 tasks");
        let target = |t: &Segmented| {
            t.segments
                .iter()
                .filter(|s| s.1)
                .map(|s| s.0.clone())
                .collect::<String>()
        };
        let sim_errors = texts
            .iter()
            .filter(|t| t.role == Role::Tool && target(t).contains("\"not_found\""))
            .count();
        let plain_errors = plain
            .iter()
            .filter(|t| t.role == Role::Tool && target(t).contains("\"not_found\""))
            .count();
        assert!(
            sim_errors >= plain_errors + 30,
            "not_found targets: {plain_errors} -> {sim_errors}"
        );
        // Recovery examples: an error in the prompt, one trained turn, a tool call.
        let recoveries: Vec<&Segmented> = texts
            .iter()
            .filter(|t| {
                t.role == Role::Assistant
                    && t.segments.iter().filter(|s| s.1).count() == 1
                    && !t.text().contains(MEMORY_HEADING)
            })
            .collect();
        assert!(recoveries.len() >= 30, "{} recoveries", recoveries.len());
        for r in recoveries {
            let t = target(r);
            assert!(t.starts_with("<tool_call>"), "{t}");
            let before = &r.text()[..r.text().find(t.as_str()).unwrap()];
            assert!(before.contains("{\"error\""), "no error before the retry");
        }
    }

    #[test]
    fn copy_drills_echo_train_split_entities() {
        let c = CorpusConfig {
            copy_per_task: 1.0,
            ..cfg(0.0)
        };
        let texts = corpus(&[Domain::Bank], Split::Train, &PromptProfile::compact(), &c).unwrap();
        let drills: Vec<&Segmented> = texts
            .iter()
            .filter(|t| t.text().contains(COPY_SYSTEM))
            .collect();
        assert_eq!(drills.len(), 30);
        let c3 = CorpusConfig {
            copy_per_task: 3.0,
            ..c.clone()
        };
        let t3 = corpus(
            &[Domain::Bank],
            Split::Train,
            &PromptProfile::compact(),
            &c3,
        )
        .unwrap();
        let n3 = t3.iter().filter(|t| t.text().contains(COPY_SYSTEM)).count();
        assert_eq!(n3, 90, "three whole drills per task");
        for d in drills {
            let trained: Vec<&(String, bool)> = d.segments.iter().filter(|s| s.1).collect();
            assert_eq!(trained.len(), 1);
            let reply = trained[0].0.trim_end_matches(END);
            let user = d.text();
            let user = user
                .split("<|im_start|>user\n")
                .nth(1)
                .and_then(|u| u.split(END).next())
                .unwrap()
                .to_string();
            assert_eq!(reply, user);
            for item in reply.split(", ") {
                if let Some(n) = item.rsplit('_').next().and_then(|n| n.parse::<i64>().ok()) {
                    assert!(!crate::env::domains::held_out(n), "{item} is a test value");
                }
            }
        }
    }

    #[test]
    fn tool_drills_add_mcp_style_actor_and_simulator_texts_in_the_chosen_template() {
        let plain = corpus(
            &[Domain::Bank],
            Split::Train,
            &PromptProfile::compact(),
            &cfg(0.0),
        )
        .unwrap();
        let c = CorpusConfig {
            tool_drills_per_task: 1.0,
            template: CorpusTemplate::CompactV2,
            ..cfg(0.0)
        };
        let texts = corpus(&[Domain::Bank], Split::Train, &PromptProfile::compact(), &c).unwrap();
        // One actor drill per task (its system prompt names the made-up `mcp:` server), and a
        // simulator text (whose prompt has no system message) for about half of those with a
        // call.
        let drills: Vec<&Segmented> = texts.iter().filter(|t| t.text().contains("mcp:")).collect();
        assert!(drills.iter().all(|t| t.role == Role::Assistant));
        assert_eq!(drills.len(), 30);
        let sims = texts.len() - plain.len() - drills.len();
        assert!((5..=25).contains(&sims), "{sims} simulator drill texts");
        assert_eq!(
            texts.iter().filter(|t| t.role == Role::Tool).count(),
            plain.iter().filter(|t| t.role == Role::Tool).count() + sims
        );
        // The v2 tool list marks optional parameters, and the trained part holds calls.
        assert!(
            drills
                .iter()
                .any(|t| t.text().contains("?)") || t.text().contains("?,"))
        );
        assert!(drills.iter().any(|t| {
            t.segments
                .iter()
                .any(|s| s.1 && s.0.contains("<tool_call>"))
        }));
    }

    #[test]
    fn random_copy_drills_echo_strings_outside_every_pool() {
        let c = CorpusConfig {
            copy_per_task: 1.0,
            random_copy_fraction: 1.0,
            ..cfg(0.0)
        };
        let texts = corpus(&[Domain::Bank], Split::Train, &PromptProfile::compact(), &c).unwrap();
        let mut items = 0;
        for d in texts.iter().filter(|t| t.text().contains(COPY_SYSTEM)) {
            let trained: Vec<&(String, bool)> = d.segments.iter().filter(|s| s.1).collect();
            let reply = trained[0].0.trim_end_matches(END);
            assert!(d.text().contains(&format!("user\n{reply}")), "{}", d.text());
            for item in reply.split(", ") {
                items += 1;
                assert!((3..=8).contains(&item.len()), "{item}");
                assert!(item.chars().all(|ch| ch.is_ascii_alphabetic()), "{item}");
                assert!(!crate::env::domains::in_test_pools(item), "{item}");
            }
        }
        assert!(items >= 30 * 4, "{items} items");
    }

    #[test]
    fn random_entities_replace_every_occurrence_and_keep_the_conversation_consistent() {
        let c = CorpusConfig {
            random_entity_fraction: 1.0,
            ..cfg(0.0)
        };
        let texts = corpus(
            &[Domain::Travel],
            Split::Train,
            &PromptProfile::compact(),
            &c,
        )
        .unwrap();
        let base = corpus(
            &[Domain::Travel],
            Split::Train,
            &PromptProfile::compact(),
            &cfg(0.0),
        )
        .unwrap();
        // One extra actor text per task.
        assert_eq!(texts.len(), base.len() + 30);
        let pools = crate::env::domains::train_pool_values();
        let actor: Vec<String> = texts
            .iter()
            .filter(|t| t.role != Role::Tool)
            .map(Segmented::text)
            .collect();
        let mut changed = 0;
        for pair in actor.chunks(2) {
            let (orig, sub) = (&pair[0], &pair[1]);
            let present: Vec<&&str> = pools
                .iter()
                .filter(|v| find_word(orig, v).is_some() && find_word(sub, v).is_none())
                .collect();
            if !present.is_empty() {
                changed += 1;
            }
            // Ids, amounts and days are untouched.
            for id in orig
                .split(|c: char| !is_word_char(c))
                .filter(|w| w.contains('_'))
            {
                assert!(sub.contains(id), "{id} lost");
            }
        }
        assert!(changed >= 25, "only {changed} of 30 conversations changed");
        assert_eq!(
            replace_words("Ann met Anna; Ann_x, Ann.", "Ann", "Qo"),
            "Qo met Anna; Ann_x, Qo."
        );
    }

    #[test]
    fn a_slip_changes_exactly_one_argument() {
        let mut rng = StdRng::seed_from_u64(1);
        let call = ToolCall {
            name: "transfer".into(),
            arguments: json!({"src": "acc_120", "dst": "acc_450", "amount": 75}),
        };
        for _ in 0..50 {
            let bad = corrupt_call(&call, &mut rng).unwrap();
            let (a, b) = (
                call.arguments.as_object().unwrap(),
                bad.arguments.as_object().unwrap(),
            );
            let changed = a.iter().filter(|(k, v)| b[k.as_str()] != **v).count();
            assert_eq!(changed, 1, "{bad:?}");
            assert_eq!(b["amount"], json!(75), "ids are slipped before amounts");
        }
        let no_args = ToolCall {
            name: "x".into(),
            arguments: json!({"note": "hi"}),
        };
        assert!(corrupt_call(&no_args, &mut rng).is_none());
    }
}
