//! BFCL-v4 single-turn tasks: the loader for `BFCL_v4_<category>.json` (JSON Lines) with its
//! `possible_answer/BFCL_v4_<category>.json`, the responses file (`{"id", "calls", "raw"?}` per
//! line: written by the live evaluation, read by `envace eval bfcl --responses`), and an AST
//! checker that gives the official verdict of gorilla's `ast_checker.py` (PyPI `bfcl-eval`
//! 2026.3.23) on every entry, including its less obvious rules: Python's types (`5.0` is not an
//! integer; an int is accepted for a float, but not inside a list of floats), Python's `==`
//! (`True == 1`), strings standardised only at the top of a value or of a list, a value of the
//! ground truth's type accepted as a "variable" and compared as it is, `""` meaning "may be
//! omitted", simple categories checked against the first function, parallel calls matched
//! greedily in order, irrelevance passed by making no call.
//!
//! `scripts/bfcl-conformance` scores the same answers with the official checker and with this
//! one and lists every disagreement; docs/BFCL.md records the result. Change a rule here only
//! with that script run. Ground truths that contradict their own schema are data defects: they
//! are listed there, never special-cased here.
//!
//! This module knows no model: `envace eval bfcl --model` generates in the engine
//! (`engine::bfcl_eval`) and hands the responses back to be written and scored here.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::env::{ToolAnnotations, ToolSpec};
use crate::message::{Message, ToolCall};

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
    #[error("answering `{id}`: {source}")]
    Respond { id: String, source: BoxError },
}

/// The error a [`BfclResponder`] reports (it lives in a layer this module does not know).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

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

    /// The messages of the first turn (single-turn categories have one), roles kept: some live
    /// entries open with a system message. An unknown role is read as the user's.
    pub fn messages(&self) -> Vec<Message> {
        self.question
            .first()
            .map(|turn| turn_messages(turn))
            .unwrap_or_default()
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

pub(crate) fn dict_to_object(v: Value) -> Value {
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

pub(crate) fn read_jsonl(path: &Path) -> Result<Vec<Value>, BfclError> {
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

pub(crate) fn field<T: serde::de::DeserializeOwned>(
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

/// BFCL's string normalisation (`standardize_string`): `,./-_*^` and spaces removed, lower-cased
/// (with Python's final-sigma rule, which `str::to_lowercase` shares), `'` turned into `"`.
pub fn standardize(s: &str) -> String {
    let kept: String = s
        .chars()
        .filter(|c| !matches!(c, ' ' | ',' | '.' | '/' | '-' | '_' | '*' | '^'))
        .collect();
    kept.to_lowercase().replace('\'', "\"")
}

/// The Python type of a JSON value as `json.loads` makes it: what the official checker's
/// `type(value) == …` tests see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PyType {
    None,
    Bool,
    Int,
    Float,
    Str,
    List,
    Dict,
}

impl PyType {
    fn of(v: &Value) -> PyType {
        match v {
            Value::Null => PyType::None,
            Value::Bool(_) => PyType::Bool,
            Value::Number(n) if n.is_f64() => PyType::Float,
            Value::Number(_) => PyType::Int,
            Value::String(_) => PyType::Str,
            Value::Array(_) => PyType::List,
            Value::Object(_) => PyType::Dict,
        }
    }

    /// `PYTHON_TYPE_MAPPING`: the schema types BFCL's Python categories use (`any` is a string).
    fn of_schema(ty: &str) -> Option<PyType> {
        Some(match ty {
            "string" | "any" => PyType::Str,
            "integer" => PyType::Int,
            "float" => PyType::Float,
            "boolean" => PyType::Bool,
            "array" | "tuple" => PyType::List,
            "dict" => PyType::Dict,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            PyType::None => "null",
            PyType::Bool => "boolean",
            PyType::Int => "integer",
            PyType::Float => "float",
            PyType::Str => "string",
            PyType::List => "array",
            PyType::Dict => "dict",
        }
    }
}

/// A number as Python compares it: booleans are 0 and 1; integers stay exact.
enum PyNum {
    Int(i128),
    Float(f64),
}

fn py_num(v: &Value) -> Option<PyNum> {
    match v {
        Value::Bool(b) => Some(PyNum::Int(i128::from(*b))),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Some(PyNum::Int(i128::from(i)))
            } else if let Some(u) = n.as_u64() {
                Some(PyNum::Int(i128::from(u)))
            } else {
                n.as_f64().map(PyNum::Float)
            }
        }
        _ => None,
    }
}

/// Python's `==` on JSON values, which the official checker's `in` tests use: `True == 1 == 1.0`,
/// lists and dicts compare element-wise, nothing is normalised.
fn py_eq(a: &Value, b: &Value) -> bool {
    if let (Some(x), Some(y)) = (py_num(a), py_num(b)) {
        return match (x, y) {
            (PyNum::Int(x), PyNum::Int(y)) => x == y,
            (PyNum::Int(x), PyNum::Float(y)) | (PyNum::Float(y), PyNum::Int(x)) => x as f64 == y,
            (PyNum::Float(x), PyNum::Float(y)) => x == y,
        };
    }
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| py_eq(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, p)| y.get(k).is_some_and(|q| py_eq(p, q)))
        }
        _ => false,
    }
}

/// Python's `value in options`.
fn py_in(value: &Value, options: &[Value]) -> bool {
    options.iter().any(|o| py_eq(value, o))
}

fn is_omit_marker(v: &Value) -> bool {
    v.as_str() == Some("")
}

/// A string standardised, anything else as it is (the official checker's list and dict rules).
fn standardize_value(v: &Value) -> Value {
    match v {
        Value::String(s) => Value::String(standardize(s)),
        other => other.clone(),
    }
}

/// The elements Python sees when it iterates an allowed value with `range(len(x))` and `x[j]`:
/// a list's items, or a string's characters (`""` is the empty list). `None` where Python would
/// raise: the official checker has no verdict there, so the candidate never matches.
fn py_items(v: &Value) -> Option<Vec<Value>> {
    match v {
        Value::Array(a) => Some(a.clone()),
        Value::String(s) => Some(s.chars().map(|c| Value::String(c.to_string())).collect()),
        _ => None,
    }
}

/// `type_checker`: Ok(is_variable) when `value` has the schema's type, or the type of the first
/// allowed value (then BFCL calls it a "variable": it is compared as it is, not normalised).
/// Arrays have their items checked one level deep, with no int-to-float conversion.
fn type_check(
    value: &Value,
    allowed: &[Value],
    expected: PyType,
    nested: Option<PyType>,
) -> Result<bool, String> {
    let answer_type = allowed.iter().find(|a| !is_omit_marker(a)).map(PyType::of);
    let is_variable = answer_type.is_some_and(|t| t != expected);
    let got = PyType::of(value);
    if got == expected {
        let (Some(nested), Some(items)) = (nested, value.as_array()) else {
            return Ok(is_variable);
        };
        let fits = |option: &Value| match option {
            Value::Array(option) => items
                .iter()
                .all(|x| type_check(x, option, nested, None).is_ok()),
            _ => true,
        };
        if allowed.iter().any(fits) {
            return Ok(is_variable);
        }
        return Err(format!(
            "wrong type: expected {} of {}, got {value}",
            expected.name(),
            nested.name()
        ));
    }
    if answer_type == Some(got) {
        return Ok(true);
    }
    Err(format!(
        "wrong type: expected {}, got {value}",
        expected.name()
    ))
}

/// `string_checker`: standardised value among the standardised allowed strings.
fn string_check(value: &str, allowed: &[Value]) -> bool {
    let v = standardize(value);
    allowed
        .iter()
        .filter_map(Value::as_str)
        .any(|a| standardize(a) == v)
}

/// `list_checker`: the list, its top-level strings standardised, equal to an allowed list
/// standardised the same way.
fn list_check(value: &[Value], allowed: &[Value]) -> bool {
    let v = Value::Array(value.iter().map(standardize_value).collect());
    allowed.iter().filter_map(py_items).any(|option| {
        let o = Value::Array(option.iter().map(standardize_value).collect());
        py_eq(&v, &o)
    })
}

/// `dict_checker` against one allowed dict `{key: [allowed values]}`: every key given is allowed
/// and its (standardised) value among the key's (standardised) values; every key not given may
/// be omitted (`""`). Values inside are neither type-checked nor normalised below the top.
fn dict_option_check(value: &Map<String, Value>, option: &Value) -> bool {
    let Some(option) = option.as_object() else {
        return false;
    };
    for (k, v) in value {
        let Some(choices) = option.get(k).and_then(py_items) else {
            return false;
        };
        let choices: Vec<Value> = choices.iter().map(standardize_value).collect();
        if !py_in(&standardize_value(v), &choices) {
            return false;
        }
    }
    option
        .iter()
        .filter(|(k, _)| !value.contains_key(*k))
        .all(|(_, choices)| match choices {
            Value::Array(c) => c.iter().any(is_omit_marker),
            // Python's `"" in "text"` is true.
            Value::String(_) => true,
            _ => false,
        })
}

/// `dict_checker`: the dict matches one allowed dict (`""` options skipped).
fn dict_check(value: &Map<String, Value>, allowed: &[Value]) -> bool {
    allowed
        .iter()
        .filter(|a| !is_omit_marker(a))
        .any(|a| dict_option_check(value, a))
}

/// `list_dict_checker`: same length as an allowed list, and each dict matches the allowed dict
/// at its position.
fn list_dict_check(value: &[Value], allowed: &[Value]) -> bool {
    allowed.iter().any(|option| {
        let options = match option {
            Value::Array(a) => a.as_slice(),
            Value::String(s) if s.is_empty() => &[],
            _ => return false,
        };
        options.len() == value.len()
            && value
                .iter()
                .zip(options)
                .all(|(v, o)| v.as_object().is_some_and(|v| dict_option_check(v, o)))
    })
}

/// Check one parameter value (`simple_function_checker`'s loop body).
fn check_param(value: &Value, schema: &Value, allowed: &[Value]) -> Result<(), String> {
    let ty = schema.get("type").and_then(Value::as_str).unwrap_or("");
    let expected =
        PyType::of_schema(ty).ok_or_else(|| format!("unsupported schema type `{ty}`"))?;
    let nested = if expected == PyType::List {
        let item = schema
            .pointer("/items/type")
            .and_then(Value::as_str)
            .unwrap_or("");
        Some(PyType::of_schema(item).ok_or_else(|| format!("unsupported item type `{item}`"))?)
    } else {
        None
    };
    // Python converts an int to a float where a float is expected (not a bool, not in a list).
    let value = match value {
        Value::Number(n) if ty == "float" && !n.is_f64() => {
            n.as_f64().map(Value::from).unwrap_or_else(|| value.clone())
        }
        other => other.clone(),
    };
    let is_variable = type_check(&value, allowed, expected, nested)?;
    let ok = match (&value, is_variable) {
        (Value::Object(m), false) => dict_check(m, allowed),
        (Value::Array(a), false) if nested == Some(PyType::Dict) => list_dict_check(a, allowed),
        (Value::String(s), false) => string_check(s, allowed),
        (Value::Array(a), false) => list_check(a, allowed),
        _ => py_in(&value, allowed),
    };
    if ok {
        Ok(())
    } else {
        Err(format!("{value} is not an allowed value"))
    }
}

/// Check one call against one function description and one ground-truth entry
/// (`simple_function_checker`). The function's own name is the one the call must use.
pub fn check_call(call: &ToolCall, function: &Value, truth: &Value) -> Result<(), String> {
    let params = truth
        .as_object()
        .and_then(|o| o.values().next())
        .and_then(Value::as_object)
        .ok_or("malformed ground truth")?;
    let name = function["name"].as_str().unwrap_or_default();
    if call.name != name {
        return Err(format!("wrong function: {} (want {name})", call.name));
    }
    let args = call
        .arguments
        .as_object()
        .ok_or_else(|| "arguments are not an object".to_string())?;
    let props = function
        .pointer("/parameters/properties")
        .and_then(Value::as_object);
    let required = function
        .pointer("/parameters/required")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    if let Some(r) = required
        .iter()
        .filter_map(Value::as_str)
        .find(|r| !args.contains_key(*r))
    {
        return Err(format!("missing required parameter `{r}`"));
    }
    for (k, v) in args {
        let (Some(schema), Some(allowed)) = (props.and_then(|p| p.get(k)), params.get(k)) else {
            return Err(format!("unexpected parameter `{k}`"));
        };
        let allowed = allowed.as_array().map(Vec::as_slice).unwrap_or_default();
        check_param(v, schema, allowed).map_err(|e| format!("`{k}`: {e}"))?;
    }
    for (k, allowed) in params {
        let optional = allowed
            .as_array()
            .is_some_and(|a| a.iter().any(is_omit_marker));
        if !args.contains_key(k) && !optional {
            return Err(format!("missing parameter `{k}`"));
        }
    }
    Ok(())
}

/// `find_description`: the function a ground-truth call names.
fn function_named<'a>(entry: &'a BfclEntry, truth: &Value) -> Result<&'a Value, String> {
    let name = truth
        .as_object()
        .and_then(|o| o.keys().next())
        .ok_or("malformed ground truth")?;
    entry
        .function
        .iter()
        .find(|f| f["name"] == *name.as_str())
        .ok_or_else(|| format!("ground truth names `{name}`, which is not a given function"))
}

/// Check a model's calls for one entry (`ast_checker`, and the relevance runner's rule for
/// (ir)relevance: no call is the same as an empty decoded output).
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
        CheckMode::Simple => {
            // The first function and the first ground truth, whatever their names.
            if calls.len() != 1 {
                return Err(format!("expected exactly one call, got {}", calls.len()));
            }
            let f = entry.function.first().ok_or("no function given")?;
            let truth = entry.ground_truth.first().ok_or("malformed ground truth")?;
            check_call(&calls[0], f, truth)
        }
        CheckMode::Multiple => {
            if calls.len() != entry.ground_truth.len() {
                return Err(format!(
                    "expected exactly {} call(s), got {}",
                    entry.ground_truth.len(),
                    calls.len()
                ));
            }
            let truth = entry.ground_truth.first().ok_or("malformed ground truth")?;
            check_call(&calls[0], function_named(entry, truth)?, truth)
        }
        CheckMode::Parallel => {
            if calls.len() != entry.ground_truth.len() {
                return Err(format!(
                    "expected {} calls, got {}",
                    entry.ground_truth.len(),
                    calls.len()
                ));
            }
            // Greedy, as the official checker: each ground truth takes the first unused call
            // that matches it.
            let mut used = vec![false; calls.len()];
            for (ti, truth) in entry.ground_truth.iter().enumerate() {
                let f = function_named(entry, truth)?;
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

/// One line of a responses file: the calls made for an entry, and the model's text when a live
/// model made them (`envace eval bfcl --model … --out`; ignored when the file is read back).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BfclResponse {
    pub id: String,
    pub calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<String>,
}

/// Append one response to a responses file as a JSON line, flushed: an interrupted run keeps
/// every entry answered so far. The only writer of the format [`load_responses`] reads.
pub fn write_response(
    out: &mut impl std::io::Write,
    path: &Path,
    response: &BfclResponse,
) -> Result<(), BfclError> {
    let io = |source| BfclError::Io {
        path: path.to_path_buf(),
        source,
    };
    let line = serde_json::to_string(response).map_err(|e| io(e.into()))?;
    writeln!(out, "{line}").map_err(io)?;
    out.flush().map_err(io)
}

/// Answers BFCL entries with calls: a live model (the engine's `bfcl_eval::ModelResponder`).
/// The seam lets this layer write and score responses without knowing models.
pub trait BfclResponder {
    fn respond(&mut self, entry: &BfclEntry) -> Result<BfclResponse, BoxError>;

    /// One step of a multi-turn conversation (`env::bfcl_multi`): the conversation so far and
    /// the tools on offer in, the calls parsed from the generation and the generation out.
    fn chat(
        &mut self,
        messages: &[Message],
        tools: &[ToolSpec],
    ) -> Result<(Vec<ToolCall>, String), BoxError> {
        let _ = (messages, tools);
        Err("this responder answers single-turn entries only".into())
    }

    /// Constrain the names of the calls it writes to the entry's functions (constrained
    /// decoding; a responder that cannot, such as recorded answers, ignores it).
    fn constrain_tool_names(&mut self, on: bool) {
        let _ = on;
    }
}

/// Answer every entry with `responder`, appending each response to `out` (when given) as it
/// comes; `progress(done, total, response)` after each.
pub fn collect_responses(
    entries: &[BfclEntry],
    responder: &mut dyn BfclResponder,
    out: Option<&Path>,
    mut progress: impl FnMut(usize, usize, &BfclResponse),
) -> Result<Vec<BfclResponse>, BfclError> {
    let mut file = match out {
        Some(path) => Some((
            std::fs::File::create(path).map_err(|source| BfclError::Io {
                path: path.to_path_buf(),
                source,
            })?,
            path,
        )),
        None => None,
    };
    let mut responses = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        let response = responder
            .respond(entry)
            .map_err(|source| BfclError::Respond {
                id: entry.id.clone(),
                source,
            })?;
        if let Some((f, path)) = file.as_mut() {
            write_response(f, path, &response)?;
        }
        progress(i + 1, entries.len(), &response);
        responses.push(response);
    }
    Ok(responses)
}

/// Responses as [`evaluate`] takes them (`id` → calls).
pub fn responses_by_id(responses: &[BfclResponse]) -> HashMap<String, Vec<ToolCall>> {
    responses
        .iter()
        .map(|r| (r.id.clone(), r.calls.clone()))
        .collect()
}

/// One turn of a BFCL `question` as chat messages, roles kept (an unknown role is read as the
/// user's; an entry without text content is skipped). Single- and multi-turn entries share it.
pub(crate) fn turn_messages(turn: &[Value]) -> Vec<Message> {
    turn.iter()
        .filter_map(|m| {
            let content = m["content"].as_str()?;
            Some(match m["role"].as_str() {
                Some("system") => Message::system(content),
                Some("assistant") => Message::assistant(content),
                _ => Message::user(content),
            })
        })
        .collect()
}
