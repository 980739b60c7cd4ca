//! The command line: clap types only; each command is a thin call into the library.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use envace::env::cli::{BfclEvalArgs, EnvCommand, TasksArgs};
use envace::runtime::DeviceChoice;

#[derive(Debug, Parser)]
#[command(
    name = "envace",
    version,
    about = "Train and inspect tool-using LLM agents the EnvACE way"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text with a local model (HF checkpoint directory or .gguf file).
    Generate(GenerateArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Headless demo of the bundled model (what `cargo run --release` shows until the TUI lands).
    Demo(DemoArgs),
    /// Train the bundled model from scratch on the built-in domains (tokenizer + SFT).
    Pretrain(PretrainArgs),
    /// Task environments: built-in domains and MCP servers.
    Env {
        #[command(subcommand)]
        command: EnvCommand,
    },
    /// List the tasks of a built-in domain.
    Tasks(TasksArgs),
    /// Evaluate.
    Eval {
        #[command(subcommand)]
        command: EvalCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum EvalCommand {
    /// Score recorded calls on a BFCL-v4 single-turn category.
    Bfcl(BfclEvalArgs),
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub prompt: String,
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    #[arg(long)]
    pub top_p: Option<f64>,
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Number of branches sampled from the one prefilled prompt.
    #[arg(long, default_value_t = 1)]
    pub branches: usize,
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Render the prompt raw instead of through the chat template.
    #[arg(long)]
    pub raw: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Prefill / decode throughput and branch cost.
    Generate(BenchGenerateArgs),
}

#[derive(Debug, Args)]
pub struct BenchGenerateArgs {
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct PretrainArgs {
    /// Output model directory.
    #[arg(long, default_value = "models/envace-tiny")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Maximum optimizer steps.
    #[arg(long, default_value_t = 3000)]
    pub steps: usize,
    /// Wall-clock budget in minutes (training stops early, keeping what it learned).
    #[arg(long, default_value_t = 15.0)]
    pub minutes: f64,
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    #[arg(long, default_value_t = 2e-3)]
    pub lr: f64,
    #[arg(long, default_value_t = 768)]
    pub vocab: usize,
    #[arg(long, default_value_t = 256)]
    pub hidden: usize,
    #[arg(long, default_value_t = 6)]
    pub layers: usize,
    /// Metrics JSONL (one object per step).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Print corpus statistics and samples, train nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[arg(long)]
    pub json: bool,
}
