//! BFCL-v4 single-turn tasks: the loader for `BFCL_v4_<category>.json` (JSON Lines) with its
//! `possible_answer/BFCL_v4_<category>.json`, and an AST checker that follows BFCL's rules
//! (gorilla `berkeley-function-call-leaderboard`, `ast_checker.py`): same function name; every
//! required parameter present; no unknown parameter; types checked (an int is accepted for a
//! float); strings normalised (lower-case, spaces and `,./-_*^` removed) and matched against the
//! allowed list, where `""` means the parameter may be omitted; lists and dicts element-wise;
//! parallel calls matched order-free; irrelevance passes when no call is made.
//!
//! Used by `envace eval bfcl` on pre-recorded calls, and by the engine on a live model.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::env::{ToolAnnotations, ToolSpec};
use crate::message::ToolCall;

#[derive(Debug, thiserror::Error)]
pub enum BfclError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Parse {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: no possible answer for `{id}`")]
    MissingAnswer { path: PathBuf, id: String },
}

/// How a category is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckMode {
    /// Exactly one call, to the one function given.
    Simple,
    /// Exactly one call, to the right one of several functions.
    Multiple,
    /// Several calls, matched order-free.
    Parallel,
    /// Passes when no call is made.
    Irrelevance,
    /// Passes when some call is made.
    Relevance,
}

impl CheckMode {
    pub fn for_category(category: &str) -> CheckMode {
        let c = category.strip_prefix("live_").unwrap_or(category);
        if c.starts_with("irrelevance") {
            CheckMode::Irrelevance
        } else if c.starts_with("relevance") {
            CheckMode::Relevance
        } else if c.starts_with("parallel") {
            CheckMode::Parallel
        } else if c.starts_with("multiple") {
            CheckMode::Multiple
        } else {
            CheckMode::Simple
        }
    }
}

/// One BFCL entry: the question, the functions on offer, the allowed answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BfclEntry {
    pub id: String,
    /// `question[turn][message]`: `{role, content}` objects.
    pub question: Vec<Vec<Value>>,
    pub function: Vec<Value>,
    /// `[{func_name: {param: [allowed values]}}]`; empty for (ir)relevance categories.
    #[serde(default)]
    pub ground_truth: Vec<Value>,
}

impl BfclEntry {
    /// The functions as tool specs (BFCL's `"type": "dict"` becomes `"object"`).
    pub fn tools(&self) -> Vec<ToolSpec> {
        self.function
            .iter()
            .map(|f| ToolSpec {
                name: f["name"].as_str().unwrap_or_default().to_string(),
                description: f["description"].as_str().unwrap_or_default().to_string(),
                input_schema: dict_to_object(f.get("parameters").cloned().unwrap_or(json!({}))),
                annotations: ToolAnnotations::default(),
            })
            .collect()
    }

    /// The user's messages of the first turn (single-turn categories have one).
    pub fn user_messages(&self) -> Vec<String> {
        self.question
            .first()
            .map(|turn| {
                turn.iter()
                    .filter(|m| m["role"] == "user")
                    .filter_map(|m| m["content"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}

fn dict_to_object(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.into_iter()
                .map(|(k, x)| {
                    if k == "type" && x == "dict" {
                        (k, json!("object"))
                    } else {
                        (k, dict_to_object(x))
                    }
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(dict_to_object).collect()),
        other => other,
    }
}

fn read_jsonl(path: &Path) -> Result<Vec<Value>, BfclError> {
    let text = std::fs::read_to_string(path).map_err(|source| BfclError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v = serde_json::from_str(line).map_err(|e| BfclError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            message: e.to_string(),
        })?;
        out.push(v);
    }
    Ok(out)
}

fn field<T: serde::de::DeserializeOwned>(
    v: &Value,
    key: &str,
    path: &Path,
    line: usize,
) -> Result<T, BfclError> {
    serde_json::from_value(v.get(key).cloned().unwrap_or(Value::Null)).map_err(|e| {
        BfclError::Parse {
            path: path.to_path_buf(),
            line,
            message: format!("field `{key}`: {e}"),
        }
    })
}

/// Load a category from a BFCL data directory.
pub fn load_category(dir: &Path, category: &str) -> Result<Vec<BfclEntry>, BfclError> {
    let qpath = dir.join(format!("BFCL_v4_{category}.json"));
    let apath = dir
        .join("possible_answer")
        .join(format!("BFCL_v4_{category}.json"));
    let mode = CheckMode::for_category(category);
    let needs_answers = !matches!(mode, CheckMode::Irrelevance | CheckMode::Relevance);
    let mut answers: HashMap<String, Vec<Value>> = HashMap::new();
    if needs_answers {
        for (i, a) in read_jsonl(&apath)?.iter().enumerate() {
            let id: String = field(a, "id", &apath, i + 1)?;
            let gt: Vec<Value> = field(a, "ground_truth", &apath, i + 1)?;
            answers.insert(id, gt);
        }
    }
    let mut out = Vec::new();
    for (i, q) in read_jsonl(&qpath)?.iter().enumerate() {
        let id: String = field(q, "id", &qpath, i + 1)?;
        let question: Vec<Vec<Value>> = field(q, "question", &qpath, i + 1)?;
        let function: Vec<Value> = field(q, "function", &qpath, i + 1)?;
        let ground_truth = if needs_answers {
            answers
                .remove(&id)
                .ok_or_else(|| BfclError::MissingAnswer {
                    path: apath.clone(),
                    id: id.clone(),
                })?
        } else {
            Vec::new()
        };
        out.push(BfclEntry {
            id,
            question,
            function,
            ground_truth,
        });
    }
    Ok(out)
}

/// BFCL's string normalisation.
pub fn standardize(s: &str) -> String {
    s.chars()
        .filter(|c| !matches!(c, ' ' | ',' | '.' | '/' | '-' | '_' | '*' | '^'))
        .flat_map(char::to_lowercase)
        .collect()
}

fn type_ok(value: &Value, schema: &Value) -> Result<(), String> {
    let ty = schema.get("type").and_then(Value::as_str).unwrap_or("any");
    let ok = match ty.to_lowercase().as_str() {
        "integer" | "int" | "long" | "short" | "byte" => value.is_i64() || value.is_u64(),
        "float" | "number" | "double" => value.is_number(),
        "string" | "str" | "char" => value.is_string(),
        "boolean" | "bool" => value.is_boolean(),
        "array" | "tuple" | "list" => match value.as_array() {
            Some(items) => {
                if let Some(item_schema) = schema.get("items") {
                    for x in items {
                        type_ok(x, item_schema)?;
                    }
                }
                true
            }
            None => false,
        },
        "dict" | "object" => value.is_object(),
        _ => true,
    };
    if ok {
        Ok(())
    } else {
        Err(format!("wrong type: expected {ty}, got {value}"))
    }
}

/// Does `value` match one allowed entry?
fn matches(value: &Value, allowed: &Value) -> bool {
    match (value, allowed) {
        (Value::String(a), Value::String(b)) => standardize(a) == standardize(b),
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (Value::Bool(a), Value::Bool(b)) => a == b,
        (Value::Null, Value::Null) => true,
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| matches(x, y))
        }
        (Value::Object(a), Value::Object(b)) => dict_matches(a, b),
        _ => false,
    }
}

/// A dict value against an allowed dict: BFCL writes allowed dicts as `{key: [allowed]}`.
fn dict_matches(a: &Map<String, Value>, b: &Map<String, Value>) -> bool {
    let lists = b.values().all(Value::is_array);
    if !lists {
        return a.len() == b.len()
            && a.iter()
                .all(|(k, v)| b.get(k).is_some_and(|w| matches(v, w)));
    }
    for (k, v) in a {
        let Some(Value::Array(options)) = b.get(k) else {
            return false;
        };
        if !options.iter().any(|o| matches(v, o)) {
            return false;
        }
    }
    b.iter()
        .filter(|(k, _)| !a.contains_key(*k))
        .all(|(_, opts)| opts.as_array().is_some_and(|o| o.iter().any(|x| x == "")))
}

/// Check one call against one function description and one ground-truth entry.
pub fn check_call(call: &ToolCall, function: &Value, truth: &Value) -> Result<(), String> {
    let Some((name, params)) = truth.as_object().and_then(|o| o.iter().next()) else {
        return Err("malformed ground truth".into());
    };
    if &call.name != name {
        return Err(format!("wrong function: {} (want {name})", call.name));
    }
    let args = call
        .arguments
        .as_object()
        .ok_or_else(|| "arguments are not an object".to_string())?;
    let params = params
        .as_object()
        .ok_or_else(|| "malformed ground truth".to_string())?;
    let props = function
        .pointer("/parameters/properties")
        .and_then(Value::as_object);
    let required: Vec<&str> = function
        .pointer("/parameters/required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    for r in &required {
        if !args.contains_key(*r) {
            return Err(format!("missing required parameter `{r}`"));
        }
    }
    for (k, v) in args {
        let schema = props
            .and_then(|p| p.get(k))
            .ok_or_else(|| format!("unexpected parameter `{k}`"))?;
        let allowed = params
            .get(k)
            .and_then(Value::as_array)
            .ok_or_else(|| format!("unexpected parameter `{k}`"))?;
        type_ok(v, schema).map_err(|e| format!("`{k}`: {e}"))?;
        if !allowed.iter().any(|a| matches(v, a)) {
            return Err(format!("`{k}`: {v} is not an allowed value"));
        }
    }
    for (k, allowed) in params {
        if !args.contains_key(k) {
            let optional = allowed
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == ""));
            if !optional {
                return Err(format!("missing parameter `{k}`"));
            }
        }
    }
    Ok(())
}

fn function_named<'a>(entry: &'a BfclEntry, truth: &Value) -> Option<&'a Value> {
    let name = truth.as_object()?.keys().next()?;
    entry.function.iter().find(|f| f["name"] == *name.as_str())
}

/// Check a model's calls for one entry.
pub fn check_entry(entry: &BfclEntry, mode: CheckMode, calls: &[ToolCall]) -> Result<(), String> {
    match mode {
        CheckMode::Irrelevance => {
            if calls.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{} call(s) made where none was relevant",
                    calls.len()
                ))
            }
        }
        CheckMode::Relevance => {
            if calls.is_empty() {
                Err("no call made".into())
            } else {
                Ok(())
            }
        }
        CheckMode::Simple | CheckMode::Multiple => {
            if calls.len() != 1 || entry.ground_truth.len() != 1 {
                return Err(format!("expected exactly one call, got {}", calls.len()));
            }
            let truth = &entry.ground_truth[0];
            let f = function_named(entry, truth).ok_or("ground truth names no given function")?;
            check_call(&calls[0], f, truth)
        }
        CheckMode::Parallel => {
            if calls.len() != entry.ground_truth.len() {
                return Err(format!(
                    "expected {} calls, got {}",
                    entry.ground_truth.len(),
                    calls.len()
                ));
            }
            let mut used = vec![false; calls.len()];
            for (ti, truth) in entry.ground_truth.iter().enumerate() {
                let f =
                    function_named(entry, truth).ok_or("ground truth names no given function")?;
                let hit = calls
                    .iter()
                    .enumerate()
                    .find(|(ci, c)| !used[*ci] && check_call(c, f, truth).is_ok());
                match hit {
                    Some((ci, _)) => used[ci] = true,
                    None => return Err(format!("no call matches ground truth #{ti}")),
                }
            }
            Ok(())
        }
    }
}

/// Per-entry outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BfclResult {
    pub id: String,
    pub correct: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Accuracy over a category.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BfclReport {
    pub correct: usize,
    pub total: usize,
    pub results: Vec<BfclResult>,
}

impl BfclReport {
    pub fn accuracy(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.correct as f64 / self.total as f64
        }
    }
}

/// Score recorded calls (`id` → calls) on a category's entries; a missing id is wrong.
pub fn evaluate(
    entries: &[BfclEntry],
    category: &str,
    responses: &HashMap<String, Vec<ToolCall>>,
) -> BfclReport {
    let mode = CheckMode::for_category(category);
    let mut report = BfclReport::default();
    for e in entries {
        let outcome = match responses.get(&e.id) {
            None => Err("no response".to_string()),
            Some(calls) => check_entry(e, mode, calls),
        };
        report.total += 1;
        if outcome.is_ok() {
            report.correct += 1;
        }
        report.results.push(BfclResult {
            id: e.id.clone(),
            correct: outcome.is_ok(),
            error: outcome.err(),
        });
    }
    report
}

/// Read a responses file: JSON Lines of `{"id", "calls": [{"name", "arguments"}]}`.
/// `arguments` may also be a JSON string holding the object (OpenAI style).
pub fn load_responses(path: &Path) -> Result<HashMap<String, Vec<ToolCall>>, BfclError> {
    let mut out = HashMap::new();
    for (i, v) in read_jsonl(path)?.iter().enumerate() {
        let id: String = field(v, "id", path, i + 1)?;
        let raw: Vec<Value> = field(v, "calls", path, i + 1)?;
        let mut calls = Vec::new();
        for c in raw {
            let name = c["name"]
                .as_str()
                .ok_or_else(|| BfclError::Parse {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message: "a call needs a string `name`".into(),
                })?
                .to_string();
            let arguments = match c.get("arguments") {
                Some(Value::String(s)) => {
                    serde_json::from_str(s).unwrap_or(Value::String(s.clone()))
                }
                Some(v) => v.clone(),
                None => json!({}),
            };
            calls.push(ToolCall { name, arguments });
        }
        out.insert(id, calls);
    }
    Ok(out)
}

/// Load a category and a responses file and score them.
pub fn evaluate_files(
    dir: &Path,
    category: &str,
    responses: &Path,
) -> Result<BfclReport, BfclError> {
    let entries = load_category(dir, category)?;
    let resp = load_responses(responses)?;
    Ok(evaluate(&entries, category, &resp))
}
