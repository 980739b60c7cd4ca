//! Tasks of the built-in domains: the JSON format (see docs/TASKS.md), the seeded generator with
//! its fixed `train`/`test` splits, loading and validating user task files, and the gold
//! trajectory (each gold call with the response it gets on a fresh copy of the initial state).
//!
//! A task file that does not validate is rejected with the file, the task id and the field; a
//! built-in task is validated the same way by the tests, so the generator cannot drift.
//!
//! `randomize`: random-entity copies of a task or a conversation (GRPO, pretraining corpus).

use std::path::Path;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::env::domains::Domain;
use crate::env::{EnvError, ToolResponse};
use crate::message::ToolCall;

pub(crate) mod randomize;

/// Number of built-in tasks per domain in each split.
pub const TRAIN_TASKS: usize = 500;
pub const TEST_TASKS: usize = 100;

/// A fixed data split. Train and test tasks use disjoint names, ids and amounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Test,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Test => "test",
        }
    }
}

impl std::str::FromStr for Split {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "train" => Ok(Split::Train),
            "test" => Ok(Split::Test),
            _ => Err(format!("unknown split `{s}` (train, test)")),
        }
    }
}

/// One gold call. `error` names the error code the call is expected to get (a task whose right
/// behaviour is to try, see the refusal and tell the user); absent when it should succeed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GoldAction {
    pub name: String,
    pub arguments: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl GoldAction {
    pub fn to_call(&self) -> ToolCall {
        ToolCall {
            name: self.name.clone(),
            arguments: self.arguments.clone(),
        }
    }
}

/// One user turn: what the user says, the expert's calls, and the expert's reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turn {
    pub user: String,
    #[serde(default)]
    pub actions: Vec<GoldAction>,
    #[serde(default)]
    pub reply: String,
}

/// What a checklist item checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Check {
    /// The agent made this call (same name, same arguments), whatever it returned.
    Call { name: String, arguments: Value },
    /// The text appears (case-insensitively) in some agent message.
    Fact { text: String },
    /// The final state equals the gold final state.
    State,
    /// The episode ended normally.
    Finished,
}

/// A weighted checklist item (partial credit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChecklistSpec {
    pub name: String,
    pub weight: f64,
    pub check: Check,
}

/// A task of a built-in domain. See docs/TASKS.md for the format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub id: String,
    pub domain: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<Split>,
    /// The task type (`balance`, `pay_if_enough`, ...): for reports, not for scoring.
    #[serde(default)]
    pub kind: String,
    pub turns: Vec<Turn>,
    pub initial_state: Value,
    #[serde(default)]
    pub required_facts: Vec<String>,
    /// Partial credit; derived from the gold actions and facts when empty.
    #[serde(default)]
    pub checklist: Vec<ChecklistSpec>,
}

impl Task {
    pub fn domain(&self) -> Result<Domain, EnvError> {
        Domain::from_name(&self.domain)
    }

    /// The user's messages, in order (turn 2 is sent after the agent answered turn 1).
    pub fn user_turns(&self) -> Vec<String> {
        self.turns.iter().map(|t| t.user.clone()).collect()
    }

    /// All gold calls, in order.
    pub fn gold_actions(&self) -> Vec<ToolCall> {
        self.turns
            .iter()
            .flat_map(|t| t.actions.iter().map(GoldAction::to_call))
            .collect()
    }

    /// The expert's replies, one per turn.
    pub fn gold_replies(&self) -> Vec<String> {
        self.turns.iter().map(|t| t.reply.clone()).collect()
    }

    /// The checklist to score with: the task's own, or one derived from gold and facts.
    pub fn effective_checklist(&self) -> Vec<ChecklistSpec> {
        if self.checklist.is_empty() {
            derive_checklist(self)
        } else {
            self.checklist.clone()
        }
    }

    /// Replay the gold calls on a fresh copy of the initial state: each call with its response,
    /// turn by turn. This is what the simulator role is shown as recorded examples.
    pub fn gold_trajectory(&self) -> Result<Vec<GoldTurnTrace>, EnvError> {
        let domain = self.domain()?;
        let mut state = self.initial_state.clone();
        let mut out = Vec::new();
        for turn in &self.turns {
            let mut steps = Vec::new();
            for a in &turn.actions {
                let call = a.to_call();
                let resp = domain.apply(&mut state, &call)?;
                steps.push((call, resp));
            }
            out.push(GoldTurnTrace {
                user: turn.user.clone(),
                steps,
                reply: turn.reply.clone(),
            });
        }
        Ok(out)
    }

    /// The gold trajectory flattened to (call, response) pairs.
    pub fn gold_steps(&self) -> Result<Vec<(ToolCall, ToolResponse)>, EnvError> {
        Ok(self
            .gold_trajectory()?
            .into_iter()
            .flat_map(|t| t.steps)
            .collect())
    }
}

/// One turn of a replayed gold episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GoldTurnTrace {
    pub user: String,
    pub steps: Vec<(ToolCall, ToolResponse)>,
    pub reply: String,
}

/// What a domain generator produces; [`build_task`] adds the id and the checklist.
#[derive(Debug, Clone)]
pub(crate) struct TaskDraft {
    pub kind: &'static str,
    pub turns: Vec<Turn>,
    pub initial_state: Value,
    pub facts: Vec<String>,
}

/// A gold turn from the generators: (user, [(call, expected error code)], reply).
pub(crate) fn turn(user: String, actions: Vec<(ToolCall, Option<&str>)>, reply: String) -> Turn {
    Turn {
        user,
        actions: actions
            .into_iter()
            .map(|(c, e)| GoldAction {
                name: c.name,
                arguments: c.arguments,
                error: e.map(str::to_string),
            })
            .collect(),
        reply,
    }
}

fn build_task(domain: Domain, split: Split, index: usize, draft: TaskDraft) -> Task {
    let mut task = Task {
        id: format!("{}-{}-{index:04}", domain.name(), split.name()),
        domain: domain.name().to_string(),
        split: Some(split),
        kind: draft.kind.to_string(),
        turns: draft.turns,
        initial_state: draft.initial_state,
        required_facts: draft.facts,
        checklist: Vec::new(),
    };
    task.checklist = derive_checklist(&task);
    task
}

/// The default checklist: every gold call (writes weigh 1, reads 0.5), every required fact
/// (1 each), the final state (2).
pub fn derive_checklist(task: &Task) -> Vec<ChecklistSpec> {
    let read_only: Vec<String> = task
        .domain()
        .map(|d| {
            d.tools()
                .into_iter()
                .filter(|t| t.annotations.read_only)
                .map(|t| t.name)
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::new();
    for a in task.turns.iter().flat_map(|t| &t.actions) {
        let weight = if read_only.contains(&a.name) {
            0.5
        } else {
            1.0
        };
        out.push(ChecklistSpec {
            name: format!("calls {} {}", a.name, a.arguments),
            weight,
            check: Check::Call {
                name: a.name.clone(),
                arguments: a.arguments.clone(),
            },
        });
    }
    for f in &task.required_facts {
        out.push(ChecklistSpec {
            name: format!("tells the user `{f}`"),
            weight: 1.0,
            check: Check::Fact { text: f.clone() },
        });
    }
    out.push(ChecklistSpec {
        name: "final state matches gold".to_string(),
        weight: 2.0,
        check: Check::State,
    });
    out
}

/// The built-in tasks of a domain (train then test), generated once per process.
pub fn builtin_tasks(domain: Domain) -> &'static [Task] {
    static CACHE: [OnceLock<Vec<Task>>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = match domain {
        Domain::Bank => &CACHE[0],
        Domain::Retail => &CACHE[1],
        Domain::Travel => &CACHE[2],
    };
    slot.get_or_init(|| generate_tasks(domain, TRAIN_TASKS, TEST_TASKS))
}

/// Generate `n_train` + `n_test` tasks of a domain (deterministic).
pub fn generate_tasks(domain: Domain, n_train: usize, n_test: usize) -> Vec<Task> {
    let mut out = Vec::with_capacity(n_train + n_test);
    for (split, n) in [(Split::Train, n_train), (Split::Test, n_test)] {
        for i in 0..n {
            out.push(build_task(domain, split, i, domain.generate(split, i)));
        }
    }
    out
}

/// The built-in tasks of a domain, optionally of one split.
pub fn list_tasks(domain: Domain, split: Option<Split>) -> Vec<&'static Task> {
    builtin_tasks(domain)
        .iter()
        .filter(|t| split.is_none() || t.split == split)
        .collect()
}

/// Find a built-in task by id (any domain).
pub fn find_builtin(task_id: &str) -> Option<&'static Task> {
    Domain::ALL
        .into_iter()
        .flat_map(builtin_tasks)
        .find(|t| t.id == task_id)
}

/// Read a task file as JSON (built-in format or MCP task file); errors name the file.
pub(crate) fn read_json_file(path: &Path) -> Result<Value, EnvError> {
    let bad = |message: String| EnvError::BadTask {
        path: path.display().to_string(),
        task: "-".into(),
        field: "-".into(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))
}

/// Load and validate a task file: a JSON array of tasks, or `{"tasks": [...]}`.
pub fn load_task_file(path: &Path) -> Result<Vec<Task>, EnvError> {
    let shown = path.display().to_string();
    let bad = |task: &str, field: &str, message: String| EnvError::BadTask {
        path: shown.clone(),
        task: task.to_string(),
        field: field.to_string(),
        message,
    };
    let root = read_json_file(path)?;
    let items = match &root {
        Value::Array(a) => a.clone(),
        Value::Object(o) => match o.get("tasks") {
            Some(Value::Array(a)) => a.clone(),
            _ => return Err(bad("-", "tasks", "expected an array of tasks".into())),
        },
        _ => {
            return Err(bad(
                "-",
                "-",
                "expected a JSON array of tasks or {\"tasks\": [...]}".into(),
            ));
        }
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let task = validate_task(item, i).map_err(|(task, field, msg)| bad(&task, &field, msg))?;
        if out.iter().any(|t: &Task| t.id == task.id) {
            return Err(bad(&task.id, "id", "duplicate task id".into()));
        }
        out.push(task);
    }
    Ok(out)
}

type Invalid = (String, String, String);

/// Validate one task object, naming the offending field.
pub fn validate_task(item: &Value, index: usize) -> Result<Task, Invalid> {
    let fallback = format!("#{index}");
    let obj = item.as_object().ok_or_else(|| {
        (
            fallback.clone(),
            "-".to_string(),
            "a task must be a JSON object".into(),
        )
    })?;
    let id = match obj.get("id") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(_) => return Err((fallback, "id".into(), "must be a non-empty string".into())),
        None => return Err((fallback, "id".into(), "missing field".into())),
    };
    let err = |field: &str, msg: String| (id.clone(), field.to_string(), msg);
    const FIELDS: [&str; 8] = [
        "id",
        "domain",
        "split",
        "kind",
        "turns",
        "initial_state",
        "required_facts",
        "checklist",
    ];
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(err(k, "unknown field".into()));
    }
    for required in ["domain", "turns", "initial_state"] {
        if !obj.contains_key(required) {
            return Err(err(required, "missing field".into()));
        }
    }
    // Field by field, so that the error names the field.
    fn field<T: serde::de::DeserializeOwned>(
        obj: &serde_json::Map<String, Value>,
        key: &str,
    ) -> Result<Option<T>, String> {
        match obj.get(key) {
            None => Ok(None),
            Some(v) => serde_json::from_value(v.clone())
                .map(Some)
                .map_err(|e| e.to_string()),
        }
    }
    let domain_name: String = field(obj, "domain")
        .map_err(|m| err("domain", m))?
        .unwrap_or_default();
    let domain = Domain::from_name(&domain_name).map_err(|e| err("domain", e.to_string()))?;
    let split: Option<Split> = field(obj, "split").map_err(|m| err("split", m))?;
    let kind: String = field(obj, "kind")
        .map_err(|m| err("kind", m))?
        .unwrap_or_default();
    let turns_v = obj
        .get("turns")
        .and_then(Value::as_array)
        .ok_or_else(|| err("turns", "must be an array of turns".into()))?;
    if turns_v.is_empty() {
        return Err(err("turns", "needs at least one turn".into()));
    }
    let tools = domain.tools();
    let mut turns = Vec::new();
    for (ti, tv) in turns_v.iter().enumerate() {
        let t: Turn = serde_json::from_value(tv.clone()).map_err(|e| {
            // Name the deepest field we can: the action when the action is the problem.
            let path = tv
                .get("actions")
                .and_then(Value::as_array)
                .and_then(|acts| {
                    acts.iter().enumerate().find_map(|(ai, a)| {
                        serde_json::from_value::<GoldAction>(a.clone())
                            .err()
                            .map(|_| format!("turns[{ti}].actions[{ai}]"))
                    })
                })
                .unwrap_or_else(|| format!("turns[{ti}]"));
            err(&path, e.to_string())
        })?;
        for (ai, a) in t.actions.iter().enumerate() {
            if !tools.iter().any(|s| s.name == a.name) {
                return Err(err(
                    &format!("turns[{ti}].actions[{ai}].name"),
                    format!("unknown tool `{}` in domain {domain}", a.name),
                ));
            }
            if !a.arguments.is_object() {
                return Err(err(
                    &format!("turns[{ti}].actions[{ai}].arguments"),
                    "must be a JSON object".into(),
                ));
            }
        }
        turns.push(t);
    }
    let initial_state = obj.get("initial_state").cloned().unwrap_or(Value::Null);
    domain
        .validate_state(&initial_state)
        .map_err(|m| err("initial_state", m))?;
    let required_facts: Vec<String> = field(obj, "required_facts")
        .map_err(|m| err("required_facts", m))?
        .unwrap_or_default();
    let checklist: Vec<ChecklistSpec> = field(obj, "checklist")
        .map_err(|m| err("checklist", m))?
        .unwrap_or_default();
    let task = Task {
        id: id.clone(),
        domain: domain_name,
        split,
        kind,
        turns,
        initial_state,
        required_facts,
        checklist,
    };
    // The gold calls must behave as declared on a fresh copy.
    let traj = task
        .gold_trajectory()
        .map_err(|e| err("initial_state", e.to_string()))?;
    for (ti, t) in traj.iter().enumerate() {
        for (ai, (_, resp)) in t.steps.iter().enumerate() {
            let want = task.turns[ti].actions[ai].error.as_deref();
            let got = match resp {
                ToolResponse::Error { code, .. } => Some(code.as_str()),
                ToolResponse::Success { .. } => None,
            };
            if want != got {
                return Err(err(
                    &format!("turns[{ti}].actions[{ai}]"),
                    format!(
                        "gold call expected {} but got {}",
                        want.map_or("success".to_string(), |c| format!("error `{c}`")),
                        serde_json::to_string(&resp.to_json()).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(task)
}
