//! verl / EnvACE training rows (`envace export --format verl`): the parquet file verl's
//! `RLHFDataset` and the EnvACE reference's `ChecklistDataset` read, and the JSON copy of the same
//! rows its tool simulator loads (`env.checklist.dataset_path`).
//!
//! The format is theirs, so this module follows their code, not ours:
//! - the reference's data preparation (CM2's `pipeline/5_rl_training/convert_checklist_for_verl.py`
//!   then `convert_checklist_to_parquet.py`, whose files EnvACE's `run_checklist_*.sh` train on):
//!   `messages` (the prompt: system + first user turn; `data.prompt_key=messages`), `uuid`,
//!   `checklists`, `data_source`, and `extra_info` with `messages` (the whole reference
//!   conversation: later user turns and recorded tool responses come from it), `tools` (OpenAI
//!   tool schemas as a JSON *string*), `interaction_kwargs {name: "checklist", checklist_list}`,
//!   `need_tools_kwargs`, `original_index` (EnvACE `agent_system/dataset/checklist_dataset.py`
//!   reads `extra_info.{index, original_index, tools, interaction_kwargs, messages}`);
//! - verl's documented RL dataset columns, added beside them: `prompt` (verl's default prompt
//!   key; the same messages), `ability`, `reward_model {style, ground_truth}`,
//!   `extra_info.{index, split}`.
//!
//! envace's own additions live in `extra_info`: `role` (actor | simulator), `task_id`,
//! `reward`, and for session rows the generation itself (`session`, `seq`, `call_id`,
//! `response`, `prompt_ids`, `response_ids`, `loss_mask`, `logprobs`: null where a session has
//! no token ids). Tool-call arguments are JSON strings, as in the OpenAI API and the reference.
//!
//! A task's checklist is turned into the reference's judge checklist (one checklist, a list of
//! standards per user turn, weights summing to 1 per turn); what a judge cannot observe (the
//! final state) stays in `reward_model.ground_truth`, the task itself as envace's task JSON.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::ExportError;
use crate::engine::prompts::{initial_conversation, tools_json};
use crate::engine::spec::{gold_conversation, task_spec};
use crate::env::domains::Domain;
use crate::env::tasks::{Check, Split, Task, find_builtin, list_tasks};
use crate::message::{Message, Role};
use crate::session::export::{ExportOptions, openai_records};
use crate::session::format::GenRole;
use crate::session::{EventBody, Session, read_session};

/// `ability` of every row (the EnvACE repository's `examples/data_preprocess/prepare.py`).
pub const ABILITY: &str = "agent";
/// `reward_model.style`: envace scores by rules (gold replay and checklist), not a model.
pub const REWARD_STYLE: &str = "rule";
/// `extra_info.interaction_kwargs.name`, as the reference writes it.
pub const INTERACTION_NAME: &str = "checklist";

/// A tool call inside a message, OpenAI-shaped (`arguments` a JSON string).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerlToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: VerlFunction,
}

fn function_kind() -> String {
    "function".to_string()
}

/// The called function: its name and its arguments as a JSON string.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerlFunction {
    pub name: String,
    pub arguments: String,
}

/// One chat message as the rows hold it (what `session::openai_message` writes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerlMessage {
    pub role: String,
    #[serde(default)]
    pub content: String,
    #[serde(default)]
    pub tool_calls: Vec<VerlToolCall>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

impl VerlMessage {
    /// From a message in the OpenAI API shape (as `session::openai_message` writes it).
    pub fn from_openai(v: &Value) -> Result<Self, String> {
        Self::deserialize(v).map_err(|e| e.to_string())
    }
}

impl From<&Message> for VerlMessage {
    /// The shape `session::openai_message` writes (a test pins the two together).
    fn from(m: &Message) -> Self {
        let role = match m.role {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        };
        Self {
            role: role.to_string(),
            content: m.content.clone(),
            tool_calls: m
                .tool_calls
                .iter()
                .map(|c| VerlToolCall {
                    id: c.id.clone(),
                    kind: function_kind(),
                    function: VerlFunction {
                        name: c.function.name.clone(),
                        arguments: c.function.arguments.to_string(),
                    },
                })
                .collect(),
            tool_call_id: m.tool_call_id.clone(),
        }
    }
}

/// A piece of the reference conversation a standard was written from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// User turn (0-based).
    pub turn: i64,
    /// Message index inside the turn (the user message is step 0).
    pub step: i64,
    /// `assistant.tool_calls` or `assistant.content.user_visible_reply`.
    pub from: String,
    pub snippet: String,
}

/// One judge-checked standard of a turn (the reference's checklist item).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChecklistStandard {
    /// `C0`, `C1`, … within its turn.
    pub id: String,
    pub evidence: Vec<Evidence>,
    pub focus_on: String,
    pub question: String,
    pub pass_condition: String,
    pub failure_examples: Vec<String>,
    /// Whether failing it ends the episode after this turn.
    pub required_for_next_turn: bool,
    pub dependence: Vec<String>,
    /// Weight in its turn; a turn's weights sum to 1.
    pub weight: f64,
}

/// `extra_info.interaction_kwargs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InteractionKwargs {
    pub name: String,
    /// Checklists × user turns × standards (envace writes one checklist).
    pub checklist_list: Vec<Vec<Vec<ChecklistStandard>>>,
}

/// `reward_model`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardModel {
    pub style: String,
    /// The task as envace's task JSON (docs/TASKS.md): gold turns, facts, checklist, initial
    /// state. `None` for a session whose task is not a built-in one.
    pub ground_truth: Option<String>,
}

/// A generation's exact tokens (no re-tokenisation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenIds {
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    /// Over `response_ids`.
    pub loss_mask: Vec<u8>,
    /// Over `response_ids`; empty when not recorded.
    pub logprobs: Vec<f32>,
}

/// The recorded generation a session row is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationInfo {
    /// The session file's name.
    pub session: String,
    /// The generation event's `seq`.
    pub seq: u64,
    /// For simulator rows: the call simulated.
    pub call_id: Option<String>,
    /// The generated text.
    pub response: String,
    /// `None` when the session holds no token ids (e.g. a remote model).
    pub tokens: Option<TokenIds>,
}

/// `extra_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExtraInfo {
    pub index: i64,
    /// `train` or `test`; `None` when unknown (a session of a non-built-in task).
    pub split: Option<String>,
    /// The row's id (also the `uuid` column): the task id, or `<session file>#<seq>`.
    pub original_index: String,
    pub role: GenRole,
    pub need_tools_kwargs: bool,
    /// The tools passed to the chat template with the prompt (none for simulator prompts);
    /// written as a JSON string.
    pub tools: Vec<Value>,
    /// The whole conversation: the gold one for tasks, the episode's main line for sessions.
    pub messages: Vec<VerlMessage>,
    pub interaction_kwargs: InteractionKwargs,
    pub task_id: Option<String>,
    /// The episode's reward (sessions); `None` for tasks and unscored episodes.
    pub reward: Option<f64>,
    pub generation: Option<GenerationInfo>,
}

/// One training row. The file's columns: `data_source`, `prompt`, `ability`, `reward_model`,
/// `extra_info`, and as the reference also has them `uuid` (= `extra_info.original_index`),
/// `messages` (= `prompt`) and `checklists` (= `extra_info.interaction_kwargs.checklist_list`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerlRow {
    /// `envace_<environment>` (`envace_bank`, …).
    pub data_source: String,
    /// The messages rendered for the generation: system + first user turn for a task.
    pub prompt: Vec<VerlMessage>,
    pub ability: String,
    pub reward_model: RewardModel,
    pub extra_info: ExtraInfo,
}

// ---- Rows from the built-in tasks.

/// The rows of a built-in domain's split (the first `limit` tasks), indexed from 0.
pub fn rows_from_tasks(
    domain: Domain,
    split: Split,
    limit: Option<usize>,
) -> Result<Vec<VerlRow>, ExportError> {
    let tasks = list_tasks(domain, Some(split));
    let n = limit.map_or(tasks.len(), |l| l.min(tasks.len()));
    tasks[..n]
        .iter()
        .enumerate()
        .map(|(i, t)| row_from_task(t, i))
        .collect()
}

/// The row of one task: the prompt the engine gives the actor at the start of its episode
/// (`engine::prompts::initial_conversation` of `engine::spec::task_spec`), its tools, the gold
/// conversation and the judge checklist.
pub fn row_from_task(task: &Task, index: usize) -> Result<VerlRow, ExportError> {
    let task_err = |source| ExportError::Task {
        task: task.id.clone(),
        source,
    };
    let domain = task.domain().map_err(task_err)?;
    let spec = task_spec(task, false).map_err(task_err)?;
    let (gold, _) = gold_conversation(task).map_err(task_err)?;
    let ground_truth = serde_json::to_string(task).map_err(|e| {
        task_err(crate::env::EnvError::Other(format!(
            "serialising the task: {e}"
        )))
    })?;
    Ok(VerlRow {
        data_source: data_source(domain.name()),
        prompt: initial_conversation(&spec)
            .iter()
            .map(VerlMessage::from)
            .collect(),
        ability: ABILITY.to_string(),
        reward_model: RewardModel {
            style: REWARD_STYLE.to_string(),
            ground_truth: Some(ground_truth),
        },
        extra_info: ExtraInfo {
            index: index as i64,
            split: task.split.map(|s| s.name().to_string()),
            original_index: task.id.clone(),
            role: GenRole::Actor,
            need_tools_kwargs: true,
            tools: tools_json(&spec.tools),
            messages: gold.iter().map(VerlMessage::from).collect(),
            interaction_kwargs: InteractionKwargs {
                name: INTERACTION_NAME.to_string(),
                checklist_list: vec![reference_checklist(task)],
            },
            task_id: Some(task.id.clone()),
            reward: None,
            generation: None,
        },
    })
}

fn data_source(environment: &str) -> String {
    format!("envace_{environment}")
}

/// A standard before its id and normalised weight.
struct Draft {
    standard: ChecklistStandard,
    raw_weight: f64,
}

/// The task's checklist as the reference's judge checklist: one list of standards per user
/// turn. Each gold call of the task's checklist is a standard on the turn that makes it (its
/// weight as the task gives it), each required fact one on the turn whose gold reply states it
/// (else the last), and every turn gets a reply standard (weight 0.5) against its gold reply.
/// What no judge can observe (final state, normal end) is left out. Weights are normalised to
/// sum to 1 per turn, as the reference's labelling prompt asks.
pub fn reference_checklist(task: &Task) -> Vec<Vec<ChecklistStandard>> {
    let turns = &task.turns;
    let mut drafts: Vec<Vec<Draft>> = turns.iter().map(|_| Vec::new()).collect();
    let mut used: Vec<Vec<bool>> = turns.iter().map(|t| vec![false; t.actions.len()]).collect();
    let last = turns.len().saturating_sub(1);
    let reply_step = |t: usize| 2 * turns[t].actions.len() as i64 + 1;
    for item in task.effective_checklist() {
        match &item.check {
            Check::Call { name, arguments } => {
                let found = turns.iter().enumerate().find_map(|(t, turn)| {
                    turn.actions.iter().enumerate().find_map(|(k, a)| {
                        (!used[t][k] && a.name == *name && a.arguments == *arguments)
                            .then_some((t, k))
                    })
                });
                if let Some((t, k)) = found {
                    used[t][k] = true;
                }
                let error = found.and_then(|(t, k)| turns[t].actions[k].error.clone());
                let Some(slot) = drafts.get_mut(found.map_or(last, |(t, _)| t)) else {
                    continue;
                };
                slot.push(Draft {
                    standard: call_standard(name, arguments, error.as_deref(), found),
                    raw_weight: item.weight,
                });
            }
            Check::Fact { text } => {
                let lower = text.to_lowercase();
                let t = turns
                    .iter()
                    .position(|turn| turn.reply.to_lowercase().contains(&lower))
                    .unwrap_or(last);
                let Some(slot) = drafts.get_mut(t) else {
                    continue;
                };
                slot.push(Draft {
                    standard: ChecklistStandard {
                        id: String::new(),
                        evidence: vec![Evidence {
                            turn: t as i64,
                            step: reply_step(t),
                            from: "assistant.content.user_visible_reply".into(),
                            snippet: turns[t].reply.clone(),
                        }],
                        focus_on: "assistant.content.user_visible_reply".into(),
                        question: format!("Does the assistant tell the user `{text}`?"),
                        pass_condition: format!(
                            "A user-visible reply of the assistant contains `{text}` \
                             (case-insensitive)."
                        ),
                        failure_examples: vec![
                            format!("The reply omits `{text}`"),
                            "The reply states a different value".into(),
                        ],
                        required_for_next_turn: false,
                        dependence: Vec::new(),
                        weight: 0.0,
                    },
                    raw_weight: item.weight,
                });
            }
            Check::State | Check::Finished => {}
        }
    }
    for (t, slot) in drafts.iter_mut().enumerate() {
        slot.push(Draft {
            standard: ChecklistStandard {
                id: String::new(),
                evidence: vec![Evidence {
                    turn: t as i64,
                    step: reply_step(t),
                    from: "assistant.content.user_visible_reply".into(),
                    snippet: turns[t].reply.clone(),
                }],
                focus_on: "assistant.content.user_visible_reply".into(),
                question: "Does the assistant's reply report the outcome of this turn the way \
                           the reference reply does?"
                    .into(),
                pass_condition: "The final user-visible reply of the turn conveys the same \
                                 outcome as the reference snippet (same accounts, amounts, ids \
                                 and status); wording may differ."
                    .into(),
                failure_examples: vec![
                    "No reply to the user".into(),
                    "The reply claims an outcome the tool responses do not support".into(),
                    "The reply contradicts the reference snippet".into(),
                ],
                required_for_next_turn: false,
                dependence: Vec::new(),
                weight: 0.0,
            },
            raw_weight: 0.5,
        });
    }
    drafts
        .into_iter()
        .map(|slot| {
            let total: f64 = slot.iter().map(|d| d.raw_weight).sum();
            let n = slot.len() as f64;
            slot.into_iter()
                .enumerate()
                .map(|(i, d)| ChecklistStandard {
                    id: format!("C{i}"),
                    weight: if total > 0.0 {
                        d.raw_weight / total
                    } else {
                        1.0 / n
                    },
                    ..d.standard
                })
                .collect()
        })
        .collect()
}

/// The standard of one gold call; `at` is its (turn, index in the turn) when found.
fn call_standard(
    name: &str,
    arguments: &Value,
    error: Option<&str>,
    at: Option<(usize, usize)>,
) -> ChecklistStandard {
    let args = arguments.to_string();
    let snippet = format!(
        "\"name\": {}, \"arguments\": {}",
        Value::from(name),
        Value::from(args.as_str())
    );
    let mut pass_condition = format!(
        "There exists an assistant tool call with name={name} and arguments equal to {args} \
         (the same keys and values)."
    );
    if let Some(code) = error {
        pass_condition.push_str(&format!(
            " The environment is expected to refuse it with error `{code}`; making the call is \
             what counts."
        ));
    }
    ChecklistStandard {
        id: String::new(),
        evidence: at
            .map(|(t, k)| Evidence {
                turn: t as i64,
                step: 2 * k as i64 + 1,
                from: "assistant.tool_calls".into(),
                snippet,
            })
            .into_iter()
            .collect(),
        focus_on: "assistant.tool_calls".into(),
        question: format!("Did the assistant call {name} with arguments {args}?"),
        pass_condition,
        failure_examples: vec![
            "No tool call observed".into(),
            "Wrong tool name".into(),
            "Missing, extra or different argument values".into(),
        ],
        required_for_next_turn: true,
        dependence: Vec::new(),
        weight: 0.0,
    }
}

// ---- Rows from collected sessions.

/// One row per main-line generation of each session: actor turns, and with `include_simulator`
/// the simulator's generations. Private Rehearsal branch generations are left out (imagined,
/// never executed; `train sft` skips them too). Each row keeps its role, the episode's reward and
/// the generation's token ids, loss mask and logprobs where the session has them. Rows are
/// indexed from 0 across all files.
pub fn rows_from_sessions(
    paths: &[PathBuf],
    include_simulator: bool,
) -> Result<Vec<VerlRow>, ExportError> {
    let mut rows = Vec::new();
    for path in paths {
        let session = read_session(path).map_err(|source| ExportError::Session {
            path: path.display().to_string(),
            source,
        })?;
        session_rows(path, &session, include_simulator, &mut rows)?;
    }
    for (i, r) in rows.iter_mut().enumerate() {
        r.extra_info.index = i as i64;
    }
    Ok(rows)
}

fn session_rows(
    path: &Path,
    session: &Session,
    include_simulator: bool,
    rows: &mut Vec<VerlRow>,
) -> Result<(), ExportError> {
    let file = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let field = |seq: u64, field: &str, message: String| ExportError::SessionField {
        path: path.display().to_string(),
        seq,
        field: field.to_string(),
        message,
    };
    // The main-line conversation and tools, as the OpenAI export has them (approval edits in).
    let opts = ExportOptions {
        include_simulator: false,
        include_metadata: false,
    };
    let record = openai_records(session, &opts)
        .into_iter()
        .next()
        .unwrap_or(Value::Null);
    let messages = match record["messages"].as_array() {
        Some(ms) => ms
            .iter()
            .map(VerlMessage::from_openai)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| field(0, "messages", e))?,
        None => Vec::new(),
    };
    let tools = record["tools"].as_array().cloned().unwrap_or_default();
    let reward = session.events.iter().rev().find_map(|e| match &e.event {
        EventBody::Reward { reward, .. } => Some(*reward),
        _ => None,
    });
    let header = &session.header;
    let task = header
        .task_id
        .as_deref()
        .and_then(find_builtin)
        .filter(|t| t.domain == header.environment);
    let checklist_list = task.map(reference_checklist).into_iter().collect();
    let ground_truth = task.and_then(|t| serde_json::to_string(t).ok());
    for e in &session.events {
        let EventBody::Generation(g) = &e.event else {
            continue;
        };
        if g.branch.is_some() || (g.role == GenRole::Simulator && !include_simulator) {
            continue;
        }
        if g.loss_mask.len() != g.response_ids.len() {
            return Err(field(
                e.seq,
                "loss_mask",
                format!(
                    "{} entries for {} response ids",
                    g.loss_mask.len(),
                    g.response_ids.len()
                ),
            ));
        }
        if !g.logprobs.is_empty() && g.logprobs.len() != g.response_ids.len() {
            return Err(field(
                e.seq,
                "logprobs",
                format!(
                    "{} entries for {} response ids",
                    g.logprobs.len(),
                    g.response_ids.len()
                ),
            ));
        }
        let tokens = (!g.prompt_ids.is_empty()).then(|| TokenIds {
            prompt_ids: g.prompt_ids.clone(),
            response_ids: g.response_ids.clone(),
            loss_mask: g.loss_mask.clone(),
            logprobs: g.logprobs.clone(),
        });
        rows.push(VerlRow {
            data_source: data_source(&header.environment),
            prompt: g.prompt.iter().map(VerlMessage::from).collect(),
            ability: ABILITY.to_string(),
            reward_model: RewardModel {
                style: REWARD_STYLE.to_string(),
                ground_truth: ground_truth.clone(),
            },
            extra_info: ExtraInfo {
                index: 0,
                split: task.and_then(|t| t.split).map(|s| s.name().to_string()),
                original_index: format!("{file}#{}", e.seq),
                role: g.role,
                need_tools_kwargs: true,
                tools: match g.role {
                    GenRole::Actor => tools.clone(),
                    GenRole::Simulator => Vec::new(),
                },
                messages: messages.clone(),
                interaction_kwargs: InteractionKwargs {
                    name: INTERACTION_NAME.to_string(),
                    checklist_list: Vec::clone(&checklist_list),
                },
                task_id: header.task_id.clone(),
                reward,
                generation: Some(GenerationInfo {
                    session: file.clone(),
                    seq: e.seq,
                    call_id: g.call_id.clone(),
                    response: g.text.clone(),
                    tokens,
                }),
            },
        });
    }
    Ok(())
}

mod parquet;
pub use parquet::{write_json, write_parquet};

#[cfg(test)]
mod tests;
