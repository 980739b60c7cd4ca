//! The MCP task file format (docs/TASKS.md): tasks with user turns, required facts and success
//! checks (a read-only call after the episode, a JSON pointer into its result, a condition);
//! loading with errors that name the file, task and field; checking a file's check calls
//! against the tools a server lists. The client that plays and scores them is `mcp_client`.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::mcp_client::{McpServerConfig, McpTransport};
use super::tasks::read_json_file;
use super::{EnvError, ToolResponse, ToolSpec};
use crate::message::ToolCall;

/// A success check of an MCP task: a call made after the episode, then a JSON pointer into its
/// result and a condition on what it points at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpCheck {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default = "one")]
    pub weight: f64,
    /// Should be a read-only tool.
    pub call: ToolCall,
    /// RFC 6901 pointer into the result JSON (`""`: the whole result).
    #[serde(default)]
    pub path: String,
    /// The pointed value must equal this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub equals: Option<Value>,
    /// The pointed value's text (a string as is, else its JSON) must contain this,
    /// case-insensitively.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contains: Option<String>,
    /// The call must fail (true) or succeed (false, the default).
    #[serde(default)]
    pub expect_error: bool,
}

fn one() -> f64 {
    1.0
}

impl McpCheck {
    pub(crate) fn evaluate(&self, resp: &ToolResponse) -> (bool, String) {
        if resp.is_error() != self.expect_error {
            return (false, format!("call returned {}", resp.to_json()));
        }
        let root = resp.to_json();
        let Some(v) = root.pointer(&self.path) else {
            return (false, format!("no value at `{}` in {root}", self.path));
        };
        if let Some(want) = &self.equals
            && v != want
        {
            return (false, format!("`{}` is {v}, want {want}", self.path));
        }
        if let Some(sub) = &self.contains {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            if !text.to_lowercase().contains(&sub.to_lowercase()) {
                return (
                    false,
                    format!(
                        "`{}` does not contain `{sub}`: found {}",
                        self.path,
                        shorten(&Value::String(text).to_string(), 200)
                    ),
                );
            }
        }
        (true, "ok".into())
    }
}

/// `s` cut to at most `max` characters, marked with `…` when cut.
fn shorten(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Check calls of a task file that name a tool the server does not list: found before any
/// episode runs, not after the first one. The error names the file, task and check.
pub fn verify_check_tools(
    path: &Path,
    file: &McpTaskFile,
    tools: &[ToolSpec],
) -> Result<(), EnvError> {
    for t in &file.tasks {
        for (i, c) in t.checks.iter().enumerate() {
            if !tools.iter().any(|s| s.name == c.call.name) {
                let mut names: Vec<&str> = tools.iter().map(|s| s.name.as_str()).collect();
                names.sort_unstable();
                return Err(EnvError::BadTask {
                    path: path.display().to_string(),
                    task: t.id.clone(),
                    field: format!("checks[{i}].call.name"),
                    message: format!(
                        "the server has no tool `{}` (it lists: {})",
                        c.call.name,
                        names.join(", ")
                    ),
                });
            }
        }
    }
    Ok(())
}

/// A task for an MCP environment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpTask {
    pub id: String,
    /// The user's messages, in order.
    pub turns: Vec<String>,
    #[serde(default)]
    pub required_facts: Vec<String>,
    #[serde(default)]
    pub checks: Vec<McpCheck>,
}

/// An MCP task file: the server to start or reach (optional) and the tasks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpTaskFile {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<McpTransport>,
    pub tasks: Vec<McpTask>,
}

impl McpTaskFile {
    /// The `server` section as a config to connect with (default timeouts), if there is one.
    pub fn server_config(&self) -> Option<McpServerConfig> {
        self.server.clone().map(McpServerConfig::from_transport)
    }
}

/// Load an MCP task file; errors name the file, the task and the field.
pub fn load_mcp_task_file(path: &Path) -> Result<McpTaskFile, EnvError> {
    let shown = path.display().to_string();
    let bad = |task: &str, field: &str, message: String| EnvError::BadTask {
        path: shown.clone(),
        task: task.to_string(),
        field: field.to_string(),
        message,
    };
    let root = read_json_file(path)?;
    let server = match root.get("server") {
        None => None,
        Some(s) => Some(
            serde_json::from_value::<McpTransport>(s.clone())
                .map_err(|e| bad("-", "server", e.to_string()))?,
        ),
    };
    let items = root
        .get("tasks")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("-", "tasks", "expected an array of tasks".into()))?;
    let mut tasks = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let id = item
            .get("id")
            .and_then(Value::as_str)
            .map_or_else(|| format!("#{i}"), str::to_string);
        let obj = item
            .as_object()
            .ok_or_else(|| bad(&id, "-", "a task must be an object".into()))?;
        for k in obj.keys() {
            if !["id", "turns", "required_facts", "checks"].contains(&k.as_str()) {
                return Err(bad(&id, k, "unknown field".into()));
            }
        }
        for (field, required) in [("id", true), ("turns", true)] {
            if required && !obj.contains_key(field) {
                return Err(bad(&id, field, "missing field".into()));
            }
        }
        if let Some(checks) = obj.get("checks").and_then(Value::as_array) {
            for (ci, c) in checks.iter().enumerate() {
                if let Err(e) = serde_json::from_value::<McpCheck>(c.clone()) {
                    return Err(bad(&id, &format!("checks[{ci}]"), e.to_string()));
                }
            }
        }
        fn field<T: serde::de::DeserializeOwned + Default>(
            obj: &serde_json::Map<String, Value>,
            key: &str,
        ) -> Result<T, String> {
            obj.get(key).map_or(Ok(T::default()), |v| {
                serde_json::from_value(v.clone()).map_err(|e| e.to_string())
            })
        }
        let task = McpTask {
            id: field::<String>(obj, "id").map_err(|m| bad(&id, "id", m))?,
            turns: field(obj, "turns").map_err(|m| bad(&id, "turns", m))?,
            required_facts: field(obj, "required_facts")
                .map_err(|m| bad(&id, "required_facts", m))?,
            checks: field(obj, "checks").map_err(|m| bad(&id, "checks", m))?,
        };
        if task.turns.is_empty() {
            return Err(bad(&id, "turns", "needs at least one turn".into()));
        }
        tasks.push(task);
    }
    Ok(McpTaskFile { server, tasks })
}
