//! The environment subcommands (`envace env …`, `envace tasks`, `envace eval bfcl`): clap types
//! and their handlers. Thin on purpose: each handler parses, calls the library, prints. anyhow
//! lives here (the top), never below.

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::env::bfcl::{
    BfclReport, BfclResponder, collect_responses, evaluate, load_category, load_responses,
    responses_by_id,
};
use crate::env::bfcl_multi::{
    Bridge, collect_multi_responses, evaluate_multi, ground_truth_responses, is_multi_turn,
    load_multi_category, load_multi_responses, multi_responses_by_id,
};
use crate::env::domains::Domain;
use crate::env::mcp_client::{McpEnv, McpServerConfig};
use crate::env::reward::{gold_trace, score_task};
use crate::env::tasks::{Split, Task, builtin_tasks, list_tasks, load_task_file};
use crate::env::{DomainEnv, Environment, ToolResponse, ToolSpec};
use crate::message::ToolCall;

/// `envace env …`
#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// List the built-in domains.
    List {
        #[arg(long)]
        json: bool,
    },
    /// List the tools of a domain or of an MCP server, with their annotations.
    Tools {
        /// A built-in domain (bank, retail, travel).
        domain: Option<String>,
        #[command(flatten)]
        mcp: McpArgs,
        #[command(flatten)]
        headers: McpHeaderArgs,
        #[arg(long)]
        json: bool,
    },
    /// Call one tool: `envace env call DOMAIN TOOL 'JSON'`, `envace env call --mcp CMD TOOL 'JSON'`
    /// or `envace env call --mcp-url URL TOOL 'JSON'`.
    Call {
        /// [DOMAIN] TOOL [JSON]
        #[arg(required = true, num_args = 1..=3)]
        target: Vec<String>,
        #[command(flatten)]
        mcp: McpArgs,
        #[command(flatten)]
        headers: McpHeaderArgs,
        /// Reset the domain to this task's initial state first.
        #[arg(long)]
        task: Option<String>,
    },
    /// Replay every task's gold solution and check that it scores 1.0.
    CheckGold {
        domain: String,
        /// A task file to check instead of the built-in tasks.
        #[arg(long)]
        tasks: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Serve a built-in domain as an MCP server over stdio.
    Serve {
        domain: String,
        /// Start from this task's initial state (default: the demo state).
        #[arg(long)]
        task: Option<String>,
    },
}

/// How to reach an MCP server.
#[derive(Debug, Clone, Args)]
pub struct McpArgs {
    /// An MCP server command line, e.g. 'node server.js stdio' (split on whitespace).
    #[arg(long)]
    pub mcp: Option<String>,
    /// A streamable-HTTP MCP endpoint URL, e.g. http://127.0.0.1:3001/mcp.
    #[arg(long, conflicts_with = "mcp")]
    pub mcp_url: Option<String>,
    /// Extra environment for the server: KEY=VALUE (repeatable).
    #[arg(long = "mcp-env")]
    pub mcp_env: Vec<String>,
    /// Working directory of the server.
    #[arg(long)]
    pub mcp_cwd: Option<PathBuf>,
    /// Per-call timeout in seconds.
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
}

/// Headers for `--mcp-url` (`envace env tools|call`). Kept out of [`McpArgs`], which other
/// commands build as a struct literal.
#[derive(Debug, Clone, Default, Args)]
pub struct McpHeaderArgs {
    /// A header for every request to --mcp-url: 'NAME: VALUE', e.g.
    /// 'Authorization: Bearer TOKEN' (repeatable).
    #[arg(long = "mcp-header", requires = "mcp_url")]
    pub mcp_header: Vec<String>,
}

impl McpArgs {
    pub fn config(&self) -> Result<Option<McpServerConfig>> {
        self.config_with_headers(&McpHeaderArgs::default())
    }

    /// [`Self::config`], with headers for an HTTP server.
    pub fn config_with_headers(&self, headers: &McpHeaderArgs) -> Result<Option<McpServerConfig>> {
        // Checked here, not with clap's `requires`: clap waives a requirement that conflicts
        // with a present argument, and `--mcp` conflicts with `--mcp-url`.
        if self.mcp.is_none() && (!self.mcp_env.is_empty() || self.mcp_cwd.is_some()) {
            bail!("--mcp-env and --mcp-cwd apply to a server process (--mcp), not to --mcp-url");
        }
        let timeout = Duration::from_secs_f64(self.timeout.max(0.001));
        if let Some(url) = &self.mcp_url {
            let mut cfg = McpServerConfig::http(url).with_timeout(timeout);
            for h in &headers.mcp_header {
                let (k, v) = h
                    .split_once(':')
                    .with_context(|| format!("--mcp-header `{h}`: expected 'NAME: VALUE'"))?;
                cfg = cfg.with_header(k.trim(), v.trim());
            }
            return Ok(Some(cfg));
        }
        let Some(line) = &self.mcp else {
            return Ok(None);
        };
        let mut parts = line.split_whitespace().map(str::to_string);
        let command = parts.next().context("--mcp needs a command")?;
        let mut cfg = McpServerConfig::stdio(command, parts.collect()).with_timeout(timeout);
        for kv in &self.mcp_env {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--mcp-env `{kv}`: expected KEY=VALUE"))?;
            cfg = cfg.with_env(k, v);
        }
        if let Some(cwd) = &self.mcp_cwd {
            cfg = cfg.with_cwd(cwd.clone());
        }
        Ok(Some(cfg))
    }
}

/// `envace tasks DOMAIN [--split train|test] [--json]`
#[derive(Debug, Args)]
pub struct TasksArgs {
    pub domain: String,
    #[arg(long)]
    pub split: Option<Split>,
    /// Read tasks from this file instead of the built-in set.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Print the tasks in the task-file JSON format (see docs/TASKS.md).
    #[arg(long)]
    pub json: bool,
}

/// `envace eval bfcl --data DIR --category NAME (--responses FILE | --model PATH) [--limit N]
/// [--out FILE] [--json]`
#[derive(Debug, Args)]
#[command(group(
    clap::ArgGroup::new("answers")
        .required(true)
        .args(["responses", "model", "ground_truth"])
))]
pub struct BfclEvalArgs {
    /// Directory holding BFCL_v4_<category>.json and possible_answer/.
    #[arg(long)]
    pub data: PathBuf,
    #[arg(long)]
    pub category: String,
    /// Score recorded calls: JSON Lines of {"id", "calls": [{"name", "arguments"}]}.
    #[arg(long)]
    pub responses: Option<PathBuf>,
    /// Score a live model instead (checkpoint directory or .gguf file): greedy, one turn per
    /// entry, the entry's functions as tools through the model's chat template.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Score only the first N entries of the category.
    #[arg(long)]
    pub limit: Option<usize>,
    /// With --model: write the responses here (the --responses format, plus the model's `raw`
    /// text), one flushed line per entry.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// With --model: most tokens generated per entry (generation also stops at EOS).
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// With --model: auto, cpu, cuda or metal.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// With --model: a call's name can only be one of the entry's functions (constrained
    /// decoding, local models).
    #[arg(long)]
    pub constrain_tools: bool,
    /// Print one JSON object, with a verdict per entry (`results`).
    #[arg(long)]
    pub json: bool,
    /// Multi-turn categories: answer with the ground truth (each turn's calls, arguments named),
    /// the conformance check of the bridge and the official checker; --out writes the answers.
    #[arg(long)]
    pub ground_truth: bool,
    /// Multi-turn categories with --model: most steps with calls in one turn; one more
    /// force-quits the entry (BFCL's MAXIMUM_STEP_LIMIT is 20).
    #[arg(long, default_value_t = crate::env::bfcl_multi::DEFAULT_MAX_STEPS)]
    pub max_steps: usize,
    /// Multi-turn categories: the Python that runs the official environments (default: the
    /// venv scripts/fetch-bfcl builds next to --data, `<data>/../venv/bin/python`).
    #[arg(long)]
    pub python: Option<PathBuf>,
}

fn print_json(v: &Value) -> Result<()> {
    let mut out = std::io::stdout().lock();
    serde_json::to_writer_pretty(&mut out, v)?;
    writeln!(out)?;
    Ok(())
}

fn annotations_text(t: &ToolSpec) -> String {
    let a = &t.annotations;
    let mut tags = Vec::new();
    if a.read_only {
        tags.push("read-only");
    }
    if a.destructive {
        tags.push("destructive");
    }
    if a.idempotent {
        tags.push("idempotent");
    }
    if a.open_world {
        tags.push("open-world");
    }
    if t.is_irreversible() {
        tags.push("IRREVERSIBLE");
    }
    tags.join(", ")
}

/// Run `envace env …`.
pub async fn run_env(cmd: EnvCommand) -> Result<()> {
    match cmd {
        EnvCommand::List { json } => run_list(json),
        EnvCommand::Tools {
            domain,
            mcp,
            headers,
            json,
        } => run_tools(domain, &mcp, &headers, json).await,
        EnvCommand::Call {
            target,
            mcp,
            headers,
            task,
        } => run_call(target, &mcp, &headers, task).await,
        EnvCommand::CheckGold {
            domain,
            tasks,
            json,
        } => run_check_gold(&domain, tasks, json),
        EnvCommand::Serve { domain, task } => {
            let domain = Domain::from_name(&domain)?;
            let mut env = DomainEnv::new(domain);
            if let Some(id) = task {
                env.reset(Some(&id)).await?;
            }
            crate::env::mcp_server::serve_stdio(env).await?;
            Ok(())
        }
    }
}

fn run_list(json: bool) -> Result<()> {
    let rows: Vec<Value> = Domain::ALL
        .into_iter()
        .map(|d| {
            let tools = d.tools();
            let irr: Vec<&str> = tools
                .iter()
                .filter(|t| t.is_irreversible())
                .map(|t| t.name.as_str())
                .collect();
            json!({
                "name": d.name(),
                "description": d.description(),
                "tools": tools.len(),
                "irreversible": irr,
                "tasks": {
                    "train": list_tasks(d, Some(Split::Train)).len(),
                    "test": list_tasks(d, Some(Split::Test)).len(),
                },
            })
        })
        .collect();
    if json {
        return print_json(&Value::Array(rows));
    }
    for r in rows {
        println!(
            "{:<8} {} tools, {} train / {} test tasks: {}",
            r["name"].as_str().unwrap_or_default(),
            r["tools"],
            r["tasks"]["train"],
            r["tasks"]["test"],
            r["description"].as_str().unwrap_or_default()
        );
    }
    Ok(())
}

async fn open_env(
    domain: Option<&str>,
    mcp: &McpArgs,
    headers: &McpHeaderArgs,
) -> Result<Box<dyn Environment>> {
    match (domain, mcp.config_with_headers(headers)?) {
        (Some(_), Some(_)) => bail!("give either a DOMAIN or --mcp/--mcp-url, not both"),
        (None, None) => bail!(
            "give a DOMAIN ({}), --mcp 'CMD ARGS' or --mcp-url URL",
            Domain::known_names()
        ),
        (Some(d), None) => Ok(Box::new(DomainEnv::new(Domain::from_name(d)?))),
        (None, Some(cfg)) => Ok(Box::new(McpEnv::connect(cfg).await?)),
    }
}

async fn run_tools(
    domain: Option<String>,
    mcp: &McpArgs,
    headers: &McpHeaderArgs,
    json: bool,
) -> Result<()> {
    let mut env = open_env(domain.as_deref(), mcp, headers).await?;
    let tools = env.tools().await?;
    if json {
        return print_json(&serde_json::to_value(&tools)?);
    }
    let mut out = std::io::stdout().lock();
    for t in &tools {
        let mut text = format!("{}  [{}]\n", t.name, annotations_text(t));
        if !t.description.is_empty() {
            let first = t.description.lines().next().unwrap_or_default();
            text.push_str(&format!("    {first}\n"));
        }
        text.push_str(&format!("    {}\n", t.input_schema));
        // `envace env tools … | head` closes the pipe early: that is not an error.
        match out.write_all(text.as_bytes()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            other => other?,
        }
    }
    Ok(())
}

async fn run_call(
    target: Vec<String>,
    mcp: &McpArgs,
    headers: &McpHeaderArgs,
    task: Option<String>,
) -> Result<()> {
    let is_mcp = mcp.mcp.is_some() || mcp.mcp_url.is_some();
    let (domain, tool, args) = match (is_mcp, target.as_slice()) {
        (true, [t]) => (None, t.clone(), "{}".to_string()),
        (true, [t, a]) => (None, t.clone(), a.clone()),
        (false, [d, t]) => (Some(d.clone()), t.clone(), "{}".to_string()),
        (false, [d, t, a]) => (Some(d.clone()), t.clone(), a.clone()),
        _ => bail!(
            "usage: envace env call DOMAIN TOOL 'JSON' | envace env call --mcp CMD TOOL 'JSON' | \
             envace env call --mcp-url URL TOOL 'JSON'"
        ),
    };
    let arguments: Value =
        serde_json::from_str(&args).with_context(|| format!("arguments are not JSON: {args}"))?;
    let mut env = open_env(domain.as_deref(), mcp, headers).await?;
    if task.is_some() {
        env.reset(task.as_deref()).await?;
    }
    let resp = env
        .call(&ToolCall {
            name: tool,
            arguments,
        })
        .await?;
    println!("{}", serde_json::to_string(&resp.to_json())?);
    if let ToolResponse::Error { .. } = resp {
        std::process::exit(2);
    }
    Ok(())
}

/// The outcome of checking one task's gold solution.
fn check_one(task: &Task) -> Result<(), String> {
    // Live replay through the environment: declared errors must be the ones returned.
    let domain = task.domain().map_err(|e| e.to_string())?;
    let mut env = DomainEnv::new(domain);
    env.reset_to(task.clone()).map_err(|e| e.to_string())?;
    for (ti, turn) in task.turns.iter().enumerate() {
        for (ai, a) in turn.actions.iter().enumerate() {
            let resp = env.call_sync(&a.to_call()).map_err(|e| e.to_string())?;
            let got = match &resp {
                ToolResponse::Error { code, .. } => Some(code.as_str()),
                ToolResponse::Success { .. } => None,
            };
            if got != a.error.as_deref() {
                return Err(format!(
                    "turns[{ti}].actions[{ai}] {}: got {}",
                    a.name,
                    resp.to_json()
                ));
            }
        }
    }
    let score = score_task(task, &gold_trace(task)).map_err(|e| e.to_string())?;
    if score.reward < 1.0 || score.partial < 1.0 {
        let failed: Vec<String> = score
            .checklist
            .iter()
            .filter(|c| !c.passed)
            .map(|c| format!("{}: {}", c.name, c.reason))
            .collect();
        return Err(format!(
            "reward {} partial {:.3}: {}",
            score.reward,
            score.partial,
            failed.join("; ")
        ));
    }
    Ok(())
}

fn run_check_gold(domain: &str, file: Option<PathBuf>, json: bool) -> Result<()> {
    let domain = Domain::from_name(domain)?;
    let tasks: Vec<Task> = match file {
        Some(p) => load_task_file(&p)?
            .into_iter()
            .filter(|t| t.domain == domain.name())
            .collect(),
        None => builtin_tasks(domain).to_vec(),
    };
    let mut failures = Vec::new();
    for t in &tasks {
        if let Err(e) = check_one(t) {
            failures.push((t.id.clone(), e));
        }
    }
    let passed = tasks.len() - failures.len();
    let mean_reward = if tasks.is_empty() {
        0.0
    } else {
        passed as f64 / tasks.len() as f64
    };
    if json {
        print_json(&json!({
            "domain": domain.name(),
            "tasks": tasks.len(),
            "passed": passed,
            "mean_reward": mean_reward,
            "failures": failures.iter().map(|(id, e)| json!({"id": id, "error": e})).collect::<Vec<_>>(),
        }))?;
    } else {
        for (id, e) in &failures {
            println!("FAIL {id}: {e}");
        }
        println!(
            "{}: {passed}/{} gold solutions score 1.0 (mean reward {mean_reward:.3})",
            domain.name(),
            tasks.len()
        );
    }
    if !failures.is_empty() {
        bail!("{} gold solutions did not score 1.0", failures.len());
    }
    Ok(())
}

/// Run `envace tasks …`.
pub fn run_tasks(args: TasksArgs) -> Result<()> {
    let domain = Domain::from_name(&args.domain)?;
    let tasks: Vec<Task> = match &args.file {
        Some(p) => load_task_file(p)?,
        None => builtin_tasks(domain).to_vec(),
    };
    let tasks: Vec<Task> = tasks
        .into_iter()
        .filter(|t| t.domain == domain.name())
        .filter(|t| args.split.is_none() || t.split == args.split)
        .collect();
    if args.json {
        return print_json(&serde_json::to_value(&tasks)?);
    }
    let mut out = std::io::stdout().lock();
    for t in &tasks {
        let line = writeln!(
            out,
            "{}  {:<22} {}",
            t.id,
            t.kind,
            t.user_turns().join(" / ")
        );
        match line {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            other => other?,
        }
    }
    Ok(())
}

/// Loads a live model as a [`BfclResponder`] from a path, a token budget and a device name: the
/// engine's `bfcl_eval::load_responder`, handed in by main (this layer knows no model).
pub type BfclModelLoader<'a, E> =
    &'a dyn Fn(&std::path::Path, usize, &str) -> std::result::Result<Box<dyn BfclResponder>, E>;

/// Run `envace eval bfcl …` on recorded calls (`--model` needs [`run_eval_bfcl_with`]).
pub fn run_eval_bfcl(args: BfclEvalArgs) -> Result<()> {
    let no_model: BfclModelLoader<'_, anyhow::Error> =
        &|_, _, _| bail!("this build of envace cannot load a model for `eval bfcl`");
    run_eval_bfcl_with(args, no_model)
}

/// Run `envace eval bfcl …`, loading `--model` with `load`.
pub fn run_eval_bfcl_with<E>(args: BfclEvalArgs, load: BfclModelLoader<'_, E>) -> Result<()>
where
    E: Into<anyhow::Error>,
{
    let v = eval_bfcl(&args, load)?;
    if args.json {
        return print_json(&v);
    }
    println!("category: {}", args.category);
    if let Some(model) = v["model"].as_str() {
        println!("model: {model}");
    }
    println!(
        "accuracy: {:.4}",
        v["accuracy"].as_f64().unwrap_or_default()
    );
    println!("correct: {}", v["correct"]);
    println!("total: {}", v["total"]);
    if let Some(out) = v["responses"].as_str() {
        println!("responses: {out}");
    }
    Ok(())
}

/// Score a category (the first `--limit` entries) on recorded or live responses; the summary
/// `--json` prints: category, accuracy, correct, total, results (and, live: model, seconds,
/// responses).
pub fn eval_bfcl<E>(args: &BfclEvalArgs, load: BfclModelLoader<'_, E>) -> Result<Value>
where
    E: Into<anyhow::Error>,
{
    if is_multi_turn(&args.category) {
        return eval_bfcl_multi(args, load);
    }
    if args.ground_truth {
        bail!(
            "--ground-truth answers multi-turn categories only (single-turn: scripts/bfcl-conformance)"
        );
    }
    // Checked here, not with clap's `requires`: clap waives a requirement that conflicts with a
    // present argument, and --model conflicts with --responses.
    if args.out.is_some() && args.model.is_none() {
        bail!("--out writes the responses of --model; with --responses there is nothing to write");
    }
    let mut entries = load_category(&args.data, &args.category)?;
    entries.truncate(args.limit.unwrap_or(entries.len()));
    let mut v = json!({"category": args.category});
    let responses = match (&args.responses, &args.model) {
        (Some(path), _) => load_responses(path)?,
        (None, Some(model)) => {
            let t0 = Instant::now();
            let mut responder = load_responder(args, model, load)?;
            let quiet = args.json;
            let answered = collect_responses(
                &entries,
                responder.as_mut(),
                args.out.as_deref(),
                |i, n, r| {
                    if !quiet {
                        eprintln!("[{i}/{n}] {}: {} call(s)", r.id, r.calls.len());
                    }
                },
            )?;
            v["model"] = json!(model.display().to_string());
            v["seconds"] = json!(t0.elapsed().as_secs_f64());
            if let Some(out) = &args.out {
                v["responses"] = json!(out.display().to_string());
            }
            responses_by_id(&answered)
        }
        (None, None) => bail!("give --responses FILE or --model PATH"),
    };
    let report = evaluate(&entries, &args.category, &responses);
    fill_report(&mut v, &report)?;
    Ok(v)
}

/// `--model`'s responder for `eval bfcl`, with `--constrain-tools` applied (the binary refuses it
/// for a served model before this runs).
fn load_responder<E>(
    args: &BfclEvalArgs,
    model: &std::path::Path,
    load: BfclModelLoader<'_, E>,
) -> Result<Box<dyn BfclResponder>>
where
    E: Into<anyhow::Error>,
{
    let mut responder = load(model, args.max_tokens, &args.device)
        .map_err(Into::into)
        .with_context(|| format!("loading model {}", model.display()))?;
    responder.constrain_tool_names(args.constrain_tools);
    Ok(responder)
}

fn fill_report(v: &mut Value, report: &BfclReport) -> Result<()> {
    v["accuracy"] = json!(report.accuracy());
    v["correct"] = json!(report.correct);
    v["total"] = json!(report.total);
    v["results"] = serde_json::to_value(&report.results)?;
    Ok(())
}

/// `eval bfcl` on a multi-turn category: the official environments and checker through the
/// bridge (`env::bfcl_multi`); the same summary keys as the single-turn categories.
fn eval_bfcl_multi<E>(args: &BfclEvalArgs, load: BfclModelLoader<'_, E>) -> Result<Value>
where
    E: Into<anyhow::Error>,
{
    if args.out.is_some() && args.model.is_none() && !args.ground_truth {
        bail!(
            "--out writes the responses of --model or --ground-truth; with --responses there is nothing to write"
        );
    }
    let mut entries = load_multi_category(&args.data, &args.category)?;
    entries.truncate(args.limit.unwrap_or(entries.len()));
    let python = args
        .python
        .clone()
        .unwrap_or_else(|| Bridge::default_python(&args.data));
    let mut bridge = Bridge::spawn(&python)?;
    let mut v = json!({"category": args.category});
    let responses = match (&args.responses, &args.model) {
        (Some(path), _) => load_multi_responses(path)?,
        (None, Some(model)) => {
            let t0 = Instant::now();
            let mut responder = load_responder(args, model, load)?;
            let quiet = args.json;
            let answered = collect_multi_responses(
                &entries,
                responder.as_mut(),
                &mut bridge,
                args.max_steps,
                args.out.as_deref(),
                |i, n, r| {
                    if !quiet {
                        let calls: usize = r.turns.iter().flatten().map(Vec::len).sum();
                        eprintln!(
                            "[{i}/{n}] {}: {} turn(s), {calls} call(s)",
                            r.id,
                            r.turns.len()
                        );
                    }
                },
            )?;
            v["model"] = json!(model.display().to_string());
            v["seconds"] = json!(t0.elapsed().as_secs_f64());
            multi_responses_by_id(&answered)
        }
        (None, None) if args.ground_truth => multi_responses_by_id(&ground_truth_responses(
            &entries,
            &mut bridge,
            args.out.as_deref(),
        )?),
        (None, None) => bail!("give --responses FILE, --model PATH or --ground-truth"),
    };
    if let Some(out) = &args.out {
        v["responses"] = json!(out.display().to_string());
    }
    let report = evaluate_multi(&entries, &responses, &mut bridge)?;
    fill_report(&mut v, &report)?;
    Ok(v)
}
