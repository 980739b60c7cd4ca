//! BFCL-v4 multi-turn categories (`multi_turn_base`, `multi_turn_miss_func`,
//! `multi_turn_miss_param`, `multi_turn_long_context`), run against the official executable
//! environments. BFCL scores a multi-turn answer by executing it — GorillaFileSystem, MathAPI,
//! TwitterAPI, … are Python classes whose state and call results the official checker compares
//! with the ground truth's — so this module does not re-implement them: it drives
//! `scripts/bfcl-multi-env.py` (embedded in the binary, run with the venv's Python that
//! `scripts/fetch-bfcl` builds), which resets, executes and scores with gorilla's own code.
//!
//! Here: the entry loader (questions, initial configs, the classes' function docs from
//! `multi_turn_func_doc/`, the ground truth), the bridge client ([`Bridge`], one process per
//! evaluation), the turn loop BFCL's inference runs ([`run_entry`]: per user turn, the model acts
//! until it answers without a call, each step's calls executed on the bridge and fed back; more
//! than `max_steps` steps in a turn force-quits the entry), the responses file (per turn, per
//! step, the calls), scoring through the official checker, ground-truth-derived answers, and
//! [`BfclMultiEnv`], the bridge behind the crate's [`Environment`] trait. Like `env::bfcl`, it
//! knows no model: a [`BfclResponder`] answers each step.
//!
//! The categories differ only in their data, except `miss_func`: its entries hold functions
//! back (`missed_function`: turn → names). As BFCL's `populate_test_cases_with_predefined_functions`
//! does, those are taken out of the offered list; at their turn (whose question is empty) they
//! join it and the user message is BFCL's [`ADDITIONAL_FUNCTIONS_PROMPT`]. `long_context` loads
//! the classes with their long-context data, which the bridge decides from the entry id, as the
//! official executor does.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::env::bfcl::{
    BfclError, BfclReport, BfclResponder, BfclResult, BoxError, dict_to_object, field, read_jsonl,
};
use crate::env::reward::state_hash;
use crate::env::{
    ChecklistItem, EnvError, Environment, EpisodeTrace, Score, ToolAnnotations, ToolResponse,
    ToolSpec,
};
use crate::message::{Message, MessageToolCall, ToolCall};

/// The bridge's source, shown in errors; the text itself is embedded so the binary runs from
/// any directory.
pub const BRIDGE_SCRIPT: &str = "scripts/bfcl-multi-env.py";
const BRIDGE_SOURCE: &str = include_str!("../../scripts/bfcl-multi-env.py");

/// BFCL's own step limit per turn (`MAXIMUM_STEP_LIMIT` in bfcl_eval/constants): a turn with
/// more steps than this force-quits the entry.
pub const DEFAULT_MAX_STEPS: usize = 20;

/// The user message of a turn whose held-out functions become available (bfcl_eval's
/// `DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC`).
pub const ADDITIONAL_FUNCTIONS_PROMPT: &str =
    "I have updated some more functions you can choose from. What about now?";

/// The function-doc file of each class (bfcl_eval's `MULTI_TURN_FUNC_DOC_FILE_MAPPING`).
const FUNC_DOCS: [(&str, &str); 12] = [
    ("GorillaFileSystem", "gorilla_file_system.json"),
    ("MathAPI", "math_api.json"),
    ("MessageAPI", "message_api.json"),
    ("TwitterAPI", "posting_api.json"),
    ("TicketAPI", "ticket_api.json"),
    ("TradingBot", "trading_bot.json"),
    ("TravelAPI", "travel_booking.json"),
    ("VehicleControlAPI", "vehicle_control.json"),
    ("WebSearchAPI", "web_search.json"),
    ("MemoryAPI_kv", "memory_kv.json"),
    ("MemoryAPI_vector", "memory_vector.json"),
    ("MemoryAPI_rec_sum", "memory_rec_sum.json"),
];

#[derive(Debug, thiserror::Error)]
pub enum BfclMultiError {
    #[error(transparent)]
    Data(#[from] BfclError),
    #[error("{path}:{line}: entry `{id}`: unknown class `{class}` in `involved_classes`")]
    UnknownClass {
        path: PathBuf,
        line: usize,
        id: String,
        class: String,
    },
    #[error("{path}: {message}")]
    FuncDoc { path: PathBuf, message: String },
    #[error("{path}:{line}: entry `{id}`: `missed_function`: {message}")]
    MissedFunction {
        path: PathBuf,
        line: usize,
        id: String,
        message: String,
    },
    #[error("category `{category}`: {message}")]
    Unsupported { category: String, message: String },
    #[error("{python}: not found (run scripts/fetch-bfcl)")]
    NoPython { python: PathBuf },
    #[error("{script}: entry `{id}`: {message}")]
    Bridge {
        script: &'static str,
        id: String,
        message: String,
    },
    #[error("answering `{id}`: {source}")]
    Respond { id: String, source: BoxError },
}

/// One multi-turn entry with what is needed to run and score it.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiEntry {
    pub id: String,
    /// `question[turn][message]`: `{role, content}` objects.
    pub question: Vec<Vec<Value>>,
    pub initial_config: Value,
    pub involved_classes: Vec<String>,
    /// The function docs offered from the first turn: those of the involved classes, in their
    /// order, less the held-out ones (BFCL's `populate_test_cases_with_predefined_functions`;
    /// `excluded_function` is not applied there either).
    pub functions: Vec<Value>,
    /// `miss_func`: per turn (ascending), the function docs held out until that turn, in the
    /// order the entry names them. Empty in the other categories.
    pub held_out: Vec<(usize, Vec<Value>)>,
    /// Per turn, the ground truth's call strings (`cd(folder='document')`).
    pub ground_truth: Vec<Vec<String>>,
}

impl MultiEntry {
    /// The functions offered at turn `t`, as tool specs (BFCL's `"type": "dict"` becomes
    /// `"object"`): the first turn's, then each held-out group appended at its turn.
    pub fn tools_at(&self, t: usize) -> Vec<ToolSpec> {
        let held = self
            .held_out
            .iter()
            .filter(|(turn, _)| *turn <= t)
            .flat_map(|(_, docs)| docs);
        self.functions
            .iter()
            .chain(held)
            .map(|f| ToolSpec {
                name: f["name"].as_str().unwrap_or_default().to_string(),
                description: f["description"].as_str().unwrap_or_default().to_string(),
                input_schema: dict_to_object(f.get("parameters").cloned().unwrap_or(json!({}))),
                annotations: ToolAnnotations::default(),
            })
            .collect()
    }

    /// Whether turn `t` is one where held-out functions join the list.
    pub fn adds_functions_at(&self, t: usize) -> bool {
        self.held_out.iter().any(|(turn, _)| *turn == t)
    }

    /// The messages of turn `t`, roles kept (an unknown role is read as the user's); at a turn
    /// where held-out functions join, BFCL's [`ADDITIONAL_FUNCTIONS_PROMPT`].
    pub fn turn_messages(&self, t: usize) -> Vec<Message> {
        if self.adds_functions_at(t) {
            return vec![Message::user(ADDITIONAL_FUNCTIONS_PROMPT)];
        }
        self.question
            .get(t)
            .map(|turn| crate::env::bfcl::turn_messages(turn))
            .unwrap_or_default()
    }

    /// What the bridge needs of the entry.
    fn bridge_json(&self) -> Value {
        json!({
            "id": self.id,
            "initial_config": self.initial_config,
            "involved_classes": self.involved_classes,
        })
    }
}

/// Categories this module scores (the others are single-turn, `env::bfcl`).
pub fn is_multi_turn(category: &str) -> bool {
    category.starts_with("multi_turn")
}

fn func_docs(dir: &Path, class: &str) -> Option<Result<Vec<Value>, BfclMultiError>> {
    let file = FUNC_DOCS.iter().find(|(c, _)| *c == class)?.1;
    let path = dir.join("multi_turn_func_doc").join(file);
    Some(read_jsonl(&path).map_err(|e| match e {
        BfclError::Io { path, source } => BfclMultiError::FuncDoc {
            path,
            message: format!("{source} (run scripts/fetch-bfcl)"),
        },
        other => other.into(),
    }))
}

/// Load a multi-turn category from a BFCL data directory (`BFCL_v4_<category>.json`,
/// `possible_answer/`, `multi_turn_func_doc/`).
pub fn load_multi_category(dir: &Path, category: &str) -> Result<Vec<MultiEntry>, BfclMultiError> {
    let qpath = dir.join(format!("BFCL_v4_{category}.json"));
    let apath = dir
        .join("possible_answer")
        .join(format!("BFCL_v4_{category}.json"));
    let mut answers: HashMap<String, Vec<Vec<String>>> = HashMap::new();
    for (i, a) in read_jsonl(&apath)?.iter().enumerate() {
        let id: String = field(a, "id", &apath, i + 1)?;
        answers.insert(id, field(a, "ground_truth", &apath, i + 1)?);
    }
    let mut docs: HashMap<String, Vec<Value>> = HashMap::new();
    let mut out = Vec::new();
    for (i, q) in read_jsonl(&qpath)?.iter().enumerate() {
        let line = i + 1;
        let id: String = field(q, "id", &qpath, line)?;
        let involved_classes: Vec<String> = field(q, "involved_classes", &qpath, line)?;
        let mut functions = Vec::new();
        for class in &involved_classes {
            if !docs.contains_key(class) {
                let loaded =
                    func_docs(dir, class).ok_or_else(|| BfclMultiError::UnknownClass {
                        path: qpath.clone(),
                        line,
                        id: id.clone(),
                        class: class.clone(),
                    })??;
                docs.insert(class.clone(), loaded);
            }
            functions.extend(docs[class].iter().cloned());
        }
        let question: Vec<Vec<Value>> = field(q, "question", &qpath, line)?;
        let held_out = match q.get("missed_function") {
            None => Vec::new(),
            Some(m) => hold_out(m, &mut functions, question.len()).map_err(|message| {
                BfclMultiError::MissedFunction {
                    path: qpath.clone(),
                    line,
                    id: id.clone(),
                    message,
                }
            })?,
        };
        for (t, _) in &held_out {
            if !question[*t].is_empty() {
                return Err(BfclMultiError::MissedFunction {
                    path: qpath.clone(),
                    line,
                    id,
                    message: format!("turn {t} adds functions but has a question"),
                });
            }
        }
        let ground_truth = answers
            .remove(&id)
            .ok_or_else(|| BfclError::MissingAnswer {
                path: apath.clone(),
                id: id.clone(),
            })?;
        out.push(MultiEntry {
            question,
            initial_config: q.get("initial_config").cloned().unwrap_or(json!({})),
            involved_classes,
            functions,
            held_out,
            ground_truth,
            id,
        });
    }
    Ok(out)
}

/// Take an entry's `missed_function` (`{"3": ["sort"]}`) out of `functions`: per name, its
/// first doc moves to the turn's group (BFCL's `populate_test_cases_with_predefined_functions`,
/// which skips a name it cannot find; here that is an error, as is a turn past the entry's).
fn hold_out(
    missed: &Value,
    functions: &mut Vec<Value>,
    turns: usize,
) -> Result<Vec<(usize, Vec<Value>)>, String> {
    let map = missed
        .as_object()
        .ok_or("expected an object of turn → function names")?;
    let mut out = Vec::new();
    for (key, names) in map {
        let turn: usize = key
            .parse()
            .map_err(|_| format!("`{key}` is not a turn index"))?;
        if turn >= turns {
            return Err(format!("turn {turn}, but the entry has {turns} turns"));
        }
        let names = names
            .as_array()
            .ok_or_else(|| format!("turn {turn}: expected a list of function names"))?;
        let mut docs = Vec::new();
        for name in names {
            let name = name
                .as_str()
                .ok_or_else(|| format!("turn {turn}: {name} is not a function name"))?;
            let i = functions
                .iter()
                .position(|f| f["name"] == name)
                .ok_or_else(|| format!("turn {turn}: `{name}` is no function of the entry"))?;
            docs.push(functions.remove(i));
        }
        out.push((turn, docs));
    }
    out.sort_by_key(|(turn, _)| *turn);
    Ok(out)
}

/// One entry's answer: per turn, per step, the calls made.
pub type Turns = Vec<Vec<Vec<ToolCall>>>;

/// The official checker's verdict on one entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MultiVerdict {
    pub valid: bool,
    #[serde(default)]
    pub error_type: String,
    #[serde(default)]
    pub error_message: String,
    /// The turn that failed (0-based).
    #[serde(default)]
    pub turn: Option<usize>,
    /// The checker's differences (state) or missing results (responses).
    #[serde(default)]
    pub details: Option<Value>,
}

impl MultiVerdict {
    /// `turn N: <error_type>: <message>`, or `None` when valid.
    pub fn error(&self) -> Option<String> {
        if self.valid {
            return None;
        }
        let turn = self.turn.map(|t| format!("turn {t}: ")).unwrap_or_default();
        Some(format!("{turn}{}: {}", self.error_type, self.error_message))
    }
}

/// Executes one step's calls and returns their result strings (the bridge; a fake in tests).
pub trait StepExecutor {
    fn execute(&mut self, calls: &[ToolCall]) -> Result<Vec<String>, BfclMultiError>;
}

/// The bridge process: `python -c <scripts/bfcl-multi-env.py>`, JSON Lines both ways.
pub struct Bridge {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    /// The entry of the last reset (errors name it).
    entry: String,
}

impl Bridge {
    /// The interpreter `scripts/fetch-bfcl` builds, next to a data directory
    /// (`.cache/bfcl/data` → `.cache/bfcl/venv/bin/python`).
    pub fn default_python(data: &Path) -> PathBuf {
        data.parent()
            .unwrap_or(Path::new("."))
            .join("venv")
            .join("bin")
            .join("python")
    }

    pub fn spawn(python: &Path) -> Result<Self, BfclMultiError> {
        if !python.exists() {
            return Err(BfclMultiError::NoPython {
                python: python.to_path_buf(),
            });
        }
        let err = |message: String| BfclMultiError::Bridge {
            script: BRIDGE_SCRIPT,
            id: "-".into(),
            message,
        };
        let mut child = Command::new(python)
            .arg("-c")
            .arg(BRIDGE_SOURCE)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| err(format!("starting {}: {e}", python.display())))?;
        let stdin = child.stdin.take();
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| err("no stdout pipe".into()))?;
        Ok(Self {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            entry: "-".into(),
        })
    }

    fn error(&self, message: impl Into<String>) -> BfclMultiError {
        BfclMultiError::Bridge {
            script: BRIDGE_SCRIPT,
            id: self.entry.clone(),
            message: message.into(),
        }
    }

    /// One request, one reply; `{"ok": false}` becomes an error naming the entry.
    fn request(&mut self, req: &Value) -> Result<Value, BfclMultiError> {
        let line = format!("{req}\n");
        let sent = match self.stdin.as_mut() {
            Some(stdin) => stdin
                .write_all(line.as_bytes())
                .and_then(|()| stdin.flush()),
            None => Err(std::io::Error::other("stdin closed")),
        };
        if let Err(e) = sent {
            let status = self.child.try_wait().ok().flatten();
            return Err(self.error(format!("writing a request: {e} (exit status {status:?})")));
        }
        let mut reply = String::new();
        let n = self
            .stdout
            .read_line(&mut reply)
            .map_err(|e| self.error(format!("reading a reply: {e}")))?;
        if n == 0 {
            let status = self.child.try_wait().ok().flatten();
            return Err(self.error(format!("the bridge exited (status {status:?})")));
        }
        let v: Value = serde_json::from_str(&reply)
            .map_err(|e| self.error(format!("reply is not JSON ({e}): {}", reply.trim())))?;
        if v["ok"] != json!(true) {
            return Err(self.error(v["error"].as_str().unwrap_or("failed").to_string()));
        }
        Ok(v)
    }

    /// Fresh instances of the entry's classes, loaded with its initial config.
    pub fn reset(&mut self, entry: &MultiEntry) -> Result<(), BfclMultiError> {
        self.entry = entry.id.clone();
        self.request(&json!({"op": "reset", "entry": entry.bridge_json()}))
            .map(|_| ())
    }

    /// The public attributes of the live instances, per class.
    pub fn state(&mut self) -> Result<Value, BfclMultiError> {
        Ok(self.request(&json!({"op": "state"}))?["state"].take())
    }

    /// Score per-turn, per-step calls with the official checker.
    pub fn score(
        &mut self,
        entry: &MultiEntry,
        turns: &[Vec<Vec<ToolCall>>],
    ) -> Result<MultiVerdict, BfclMultiError> {
        let saved = std::mem::replace(&mut self.entry, entry.id.clone());
        let reply = self.request(&json!({
            "op": "score",
            "entry": entry.bridge_json(),
            "turns": turns,
            "ground_truth": entry.ground_truth,
        }));
        let verdict = reply.and_then(|v| {
            serde_json::from_value(v).map_err(|e| self.error(format!("verdict: {e}")))
        });
        self.entry = saved;
        verdict
    }

    /// What the official inference offers the model for a raw entry of a category file
    /// (`{"function": [doc], "missed_function": {turn: [doc]}, "additional_functions_prompt"}`):
    /// bfcl_eval's own `populate_test_cases_with_predefined_functions`, for conformance checks
    /// of [`load_multi_category`].
    pub fn official_functions(&mut self, raw_entry: &Value) -> Result<Value, BfclMultiError> {
        let id = raw_entry["id"].as_str().unwrap_or("-").to_string();
        let saved = std::mem::replace(&mut self.entry, id);
        let reply = self.request(&json!({"op": "functions", "entry": raw_entry}));
        self.entry = saved;
        reply
    }

    /// The ground truth as named-argument calls, one list per turn.
    pub fn ground_truth_calls(
        &mut self,
        entry: &MultiEntry,
    ) -> Result<Vec<Vec<ToolCall>>, BfclMultiError> {
        let saved = std::mem::replace(&mut self.entry, entry.id.clone());
        let reply = self.request(&json!({
            "op": "ground_truth_calls",
            "entry": entry.bridge_json(),
            "ground_truth": entry.ground_truth,
        }));
        let turns = reply.and_then(|mut v| {
            serde_json::from_value(v["turns"].take())
                .map_err(|e| self.error(format!("ground truth calls: {e}")))
        });
        self.entry = saved;
        turns
    }
}

impl StepExecutor for Bridge {
    /// Execute one step's calls on the instances of the last reset; the result strings are
    /// the official executor's.
    fn execute(&mut self, calls: &[ToolCall]) -> Result<Vec<String>, BfclMultiError> {
        let mut v = self.request(&json!({"op": "execute", "calls": calls}))?;
        serde_json::from_value(v["results"].take()).map_err(|e| self.error(format!("results: {e}")))
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        // Closing stdin ends the bridge's read loop; kill in case it is stuck in a call.
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One line of a multi-turn responses file: per turn, per step, the calls made (a step without
/// calls is the model's answer to the user), and, from a live model, each step's text.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MultiResponse {
    pub id: String,
    pub turns: Turns,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<Vec<Vec<String>>>,
}

/// Run one entry as BFCL's inference does: for each turn, its messages are appended and the
/// model steps until it makes no call; each step's calls are executed and their results fed
/// back as tool messages. A turn with more than `max_steps` steps with calls force-quits the
/// entry: the remaining turns are not run (the checker then fails it as force-terminated).
/// The caller resets the executor to the entry first.
pub fn run_entry(
    entry: &MultiEntry,
    responder: &mut dyn BfclResponder,
    executor: &mut dyn StepExecutor,
    max_steps: usize,
) -> Result<MultiResponse, BfclMultiError> {
    let mut messages: Vec<Message> = Vec::new();
    let mut turns = Vec::new();
    let mut raw = Vec::new();
    let mut n_calls = 0usize;
    for t in 0..entry.question.len() {
        let tools = entry.tools_at(t);
        messages.extend(entry.turn_messages(t));
        let mut steps = Vec::new();
        let mut texts = Vec::new();
        let mut force_quit = false;
        loop {
            let (calls, text) =
                responder
                    .chat(&messages, &tools)
                    .map_err(|source| BfclMultiError::Respond {
                        id: entry.id.clone(),
                        source,
                    })?;
            steps.push(calls.clone());
            texts.push(text.clone());
            if calls.is_empty() {
                messages.push(Message::assistant(text));
                break;
            }
            let results = executor.execute(&calls)?;
            let mut m = Message::assistant("");
            let ids: Vec<String> = (0..calls.len())
                .map(|i| format!("call_{}", n_calls + i))
                .collect();
            n_calls += calls.len();
            for (id, call) in ids.iter().zip(&calls) {
                m.tool_calls.push(MessageToolCall {
                    id: id.clone(),
                    kind: "function".into(),
                    function: call.clone(),
                });
            }
            messages.push(m);
            for ((id, call), result) in ids.iter().zip(&calls).zip(results) {
                messages.push(Message::tool(id.clone(), call.name.clone(), result));
            }
            if steps.len() > max_steps {
                force_quit = true;
                break;
            }
        }
        turns.push(steps);
        raw.push(texts);
        if force_quit {
            break;
        }
    }
    Ok(MultiResponse {
        id: entry.id.clone(),
        turns,
        raw: Some(raw),
    })
}

fn create(path: &Path) -> Result<std::fs::File, BfclError> {
    std::fs::File::create(path).map_err(|source| BfclError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn write_line(
    out: &mut impl Write,
    path: &Path,
    response: &MultiResponse,
) -> Result<(), BfclError> {
    let io = |source| BfclError::Io {
        path: path.to_path_buf(),
        source,
    };
    let line = serde_json::to_string(response).map_err(|e| io(e.into()))?;
    writeln!(out, "{line}").map_err(io)?;
    out.flush().map_err(io)
}

/// Run every entry with `responder` on the bridge, appending each response to `out` (when
/// given) as it comes; `progress(done, total, response)` after each.
pub fn collect_multi_responses(
    entries: &[MultiEntry],
    responder: &mut dyn BfclResponder,
    bridge: &mut Bridge,
    max_steps: usize,
    out: Option<&Path>,
    mut progress: impl FnMut(usize, usize, &MultiResponse),
) -> Result<Vec<MultiResponse>, BfclMultiError> {
    let mut file = match out {
        Some(path) => Some((create(path)?, path)),
        None => None,
    };
    let mut responses = Vec::with_capacity(entries.len());
    for (i, entry) in entries.iter().enumerate() {
        bridge.reset(entry)?;
        let response = run_entry(entry, responder, bridge, max_steps)?;
        if let Some((f, path)) = file.as_mut() {
            write_line(f, path, &response)?;
        }
        progress(i + 1, entries.len(), &response);
        responses.push(response);
    }
    Ok(responses)
}

/// Answers derived from the ground truth: each turn's calls as one step, named arguments.
/// Written to `out` when given, in the responses format.
pub fn ground_truth_responses(
    entries: &[MultiEntry],
    bridge: &mut Bridge,
    out: Option<&Path>,
) -> Result<Vec<MultiResponse>, BfclMultiError> {
    let mut file = match out {
        Some(path) => Some((create(path)?, path)),
        None => None,
    };
    let mut responses = Vec::with_capacity(entries.len());
    for entry in entries {
        let turns = bridge
            .ground_truth_calls(entry)?
            .into_iter()
            .map(|calls| vec![calls])
            .collect();
        let response = MultiResponse {
            id: entry.id.clone(),
            turns,
            raw: None,
        };
        if let Some((f, path)) = file.as_mut() {
            write_line(f, path, &response)?;
        }
        responses.push(response);
    }
    Ok(responses)
}

/// Read a multi-turn responses file (JSON Lines of [`MultiResponse`]); `id` → turns.
pub fn load_multi_responses(path: &Path) -> Result<HashMap<String, Turns>, BfclError> {
    let mut out = HashMap::new();
    for (i, v) in read_jsonl(path)?.iter().enumerate() {
        let id: String = field(v, "id", path, i + 1)?;
        let turns: Turns = field(v, "turns", path, i + 1)?;
        out.insert(id, turns);
    }
    Ok(out)
}

/// Score recorded turns (`id` → turns) with the official checker; a missing id is wrong.
pub fn evaluate_multi(
    entries: &[MultiEntry],
    responses: &HashMap<String, Turns>,
    bridge: &mut Bridge,
) -> Result<BfclReport, BfclMultiError> {
    let mut report = BfclReport::default();
    for e in entries {
        let error = match responses.get(&e.id) {
            None => Some("no response".to_string()),
            Some(turns) => bridge.score(e, turns)?.error(),
        };
        report.total += 1;
        if error.is_none() {
            report.correct += 1;
        }
        report.results.push(BfclResult {
            id: e.id.clone(),
            correct: error.is_none(),
            error,
        });
    }
    Ok(report)
}

/// Responses as [`evaluate_multi`] takes them.
pub fn multi_responses_by_id(responses: &[MultiResponse]) -> HashMap<String, Turns> {
    responses
        .iter()
        .map(|r| (r.id.clone(), r.turns.clone()))
        .collect()
}

/// A trace's actions split into per-turn steps (one call per step) at its `turn_ends`; calls
/// after the last answered turn belong to an unanswered turn.
pub fn trace_turns(trace: &EpisodeTrace) -> Turns {
    let mut turns = Vec::new();
    let mut start = 0;
    for &end in &trace.turn_ends {
        let end = end.min(trace.actions.len()).max(start);
        turns.push(
            trace.actions[start..end]
                .iter()
                .map(|c| vec![c.clone()])
                .collect(),
        );
        start = end;
    }
    if start < trace.actions.len() {
        turns.push(
            trace.actions[start..]
                .iter()
                .map(|c| vec![c.clone()])
                .collect(),
        );
    }
    turns
}

/// A multi-turn category behind [`Environment`]: `reset(Some(id))` picks an entry, calls run on
/// the official instances, `score` asks the official checker. Tool results are the official
/// executor's strings (its errors too, as BFCL feeds them back). The bridge is a pipe to a
/// local process: its calls block the async task briefly, as a domain's in-process calls do.
pub struct BfclMultiEnv {
    category: String,
    entries: Vec<MultiEntry>,
    current: Option<usize>,
    bridge: Bridge,
}

impl BfclMultiEnv {
    /// Refuses entries that hold functions back (`multi_turn_miss_func`): the trait offers one
    /// tool list per episode, and offering them all from the first turn would change the task;
    /// `envace eval bfcl` ([`run_entry`]) runs those.
    pub fn new(
        category: &str,
        entries: Vec<MultiEntry>,
        bridge: Bridge,
    ) -> Result<Self, BfclMultiError> {
        if let Some(e) = entries.iter().find(|e| !e.held_out.is_empty()) {
            return Err(BfclMultiError::Unsupported {
                category: category.to_string(),
                message: format!(
                    "entry `{}` adds functions in a later turn, which one episode's tool list \
                     cannot express; run it with `envace eval bfcl`",
                    e.id
                ),
            });
        }
        Ok(Self {
            category: category.to_string(),
            entries,
            current: None,
            bridge,
        })
    }

    fn entry(&self) -> Result<&MultiEntry, EnvError> {
        self.current
            .and_then(|i| self.entries.get(i))
            .ok_or_else(|| EnvError::Other(format!("bfcl:{}: no entry reset", self.category)))
    }
}

fn env_error(e: BfclMultiError) -> EnvError {
    EnvError::Other(e.to_string())
}

#[async_trait]
impl Environment for BfclMultiEnv {
    fn name(&self) -> String {
        format!("bfcl:{}", self.category)
    }

    async fn tools(&mut self) -> Result<Vec<ToolSpec>, EnvError> {
        Ok(self.entry().map(|e| e.tools_at(0)).unwrap_or_default())
    }

    async fn reset(&mut self, task_id: Option<&str>) -> Result<(), EnvError> {
        let i = match task_id {
            None if !self.entries.is_empty() => 0,
            None => return Err(EnvError::UnknownTask("(none)".into())),
            Some(id) => self
                .entries
                .iter()
                .position(|e| e.id == id)
                .ok_or_else(|| EnvError::UnknownTask(id.to_string()))?,
        };
        self.current = Some(i);
        let entry = self.entries[i].clone();
        self.bridge.reset(&entry).map_err(env_error)
    }

    async fn call(&mut self, call: &ToolCall) -> Result<ToolResponse, EnvError> {
        self.entry()?;
        let result = self
            .bridge
            .execute(std::slice::from_ref(call))
            .map_err(env_error)?;
        Ok(ToolResponse::Success {
            value: Value::String(result.into_iter().next().unwrap_or_default()),
        })
    }

    async fn snapshot(&mut self) -> Result<Value, EnvError> {
        self.entry()?;
        self.bridge.state().map_err(env_error)
    }

    async fn state_hash(&mut self) -> Result<String, EnvError> {
        Ok(state_hash(&self.snapshot().await?))
    }

    async fn score(&mut self, trace: &EpisodeTrace) -> Result<Score, EnvError> {
        let entry = self.entry()?.clone();
        let verdict = self
            .bridge
            .score(&entry, &trace_turns(trace))
            .map_err(env_error)?;
        let reward = if verdict.valid { 1.0 } else { 0.0 };
        Ok(Score {
            reward,
            partial: reward,
            checklist: vec![ChecklistItem {
                name: "official multi-turn checker".into(),
                weight: 1.0,
                passed: verdict.valid,
                reason: verdict.error().unwrap_or_else(|| "valid".into()),
            }],
        })
    }

    fn user_turns(&self) -> Vec<String> {
        let Ok(entry) = self.entry() else {
            return Vec::new();
        };
        (0..entry.question.len())
            .map(|t| {
                entry
                    .turn_messages(t)
                    .iter()
                    .map(|m| m.content.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
