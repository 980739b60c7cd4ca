//! Texts from a task's gold run beyond its plain actor and simulator texts: the simulator's
//! few-shot pool, slipped calls answered with the domain's real response (and the actor's
//! recovery), and actor examples whose prompt carries a Private Rehearsal memory. A slip's
//! response is always the domain's own, replayed on the task's state, never imagined.

use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use serde_json::{Value, json};

use crate::engine::parse::SimOutput;
use crate::engine::profile::PromptProfile;
use crate::engine::prompts::actor::{actor_prompt, tool_message};
use crate::engine::prompts::memory::render_memory;
use crate::engine::prompts::simulator::{SimulatorPromptInput, simulator_prompt};
use crate::engine::spec::GoldCall;
use crate::engine::types::{
    BranchEnd, BranchStep, BranchSummary, MemoryConfig, MemoryPlacement, Prediction,
    RecordedExample, SimulatedOutcome,
};
use crate::env::ToolSpec;
use crate::env::domains::held_out;
use crate::env::tasks::Split;
use crate::env::tasks::Task;
use crate::message::{Message, Role, ToolCall};
use crate::runtime::chat_template::ChatTemplate;
use crate::train::TrainError;

use super::text::{Segmented, actor_text_last, simulator_text};

/// The simulator's few-shot pool for gold call `k`: the other gold steps, or every gold step
/// (`k` included) when `whole_run`.
pub(super) fn recorded_pool(calls: &[GoldCall], k: usize, whole_run: bool) -> Vec<RecordedExample> {
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
/// argument changed: the kind of slip a rehearsal branch makes. With `within: Some(split)` the
/// new number belongs to that split's part of the range (ids and amounts are split by
/// [`held_out`]), so a train-split corpus never shows a test-split id or amount, not even as a
/// slip's `not_found`; `None` draws from the whole range (how corpora were built before
/// `--slip-values`, kept so that their commands reproduce).
pub(super) fn corrupt_call(
    call: &ToolCall,
    rng: &mut StdRng,
    within: Option<Split>,
) -> Option<ToolCall> {
    let fits = |v: i64| within.is_none_or(|split| held_out(v) == (split == Split::Test));
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
            if m != n && fits(m) {
                break m;
            }
        };
        new.insert((*k).clone(), Value::String(format!("{prefix}_{m}")));
    } else if let Some(k) = ints.choose(rng) {
        let n = args[k.as_str()].as_i64()?;
        // At most 1000 draws: the range always holds values of both splits, but a tiny `n`
        // clamped at 1 may not; then the slip is skipped.
        let m = (0..1000).find_map(|_| {
            let delta = rng.random_range(1..=200);
            let m = if rng.random::<bool>() {
                n + delta
            } else {
                (n - delta).max(1)
            };
            (m != n && fits(m) || within.is_none()).then_some(m)
        })?;
        new.insert((*k).clone(), json!(m));
    } else {
        return None;
    }
    Some(ToolCall {
        name: call.name.clone(),
        arguments: Value::Object(new),
    })
}

/// What [`slip_examples`] needs from the task being rendered.
pub(super) struct SlipInput<'a> {
    pub(super) template: &'a ChatTemplate,
    pub(super) tools: &'a [ToolSpec],
    pub(super) tools_json: &'a [Value],
    pub(super) profile: &'a PromptProfile,
    pub(super) task: &'a Task,
    pub(super) msgs: &'a [Message],
    pub(super) calls: &'a [GoldCall],
    /// The simulator example's pool is the whole recorded run (see
    /// [`CorpusConfig`](super::CorpusConfig)).
    pub(super) recorded: bool,
    /// The split whose values a slip draws (see [`corrupt_call`]).
    pub(super) within: Option<Split>,
}

/// A slip of one gold call, answered by the domain's real response: a simulator example for
/// it, and (when the response is an error) an actor example whose prompt shows the slip and
/// its error and whose target is the gold call.
pub(super) fn slip_examples(
    x: &SlipInput<'_>,
    rng: &mut StdRng,
) -> Result<Vec<Segmented>, TrainError> {
    if x.calls.is_empty() {
        return Ok(Vec::new());
    }
    let k = rng.random_range(0..x.calls.len());
    let gc = &x.calls[k];
    let Some(bad) = corrupt_call(&gc.call, rng, x.within) else {
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
pub(super) fn memory_example(
    t: &ChatTemplate,
    tools: &[Value],
    task: &Task,
    msgs: &[Message],
    calls: &[GoldCall],
    within: Option<Split>,
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
            let Some(bad) = corrupt_call(&gc.call, rng, within) else {
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
