//! The command line: clap types only. Each subcommand is a thin call into the library
//! (`envace::env::cli` for the environment commands).

use clap::{Parser, Subcommand};
use envace::env::cli::{BfclEvalArgs, EnvCommand, TasksArgs};

#[derive(Debug, Parser)]
#[command(
    name = "envace",
    version,
    about = "Train and inspect tool-using LLM agents the EnvACE way"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
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
