//! The `envace` binary: parse the command line and hand over to the library.

mod cli;

use clap::Parser;

use cli::{Cli, Command, EvalCommand};
use envace::env::cli as env_cli;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Env { command } => env_cli::run_env(command).await,
        Command::Tasks(args) => env_cli::run_tasks(args),
        Command::Eval {
            command: EvalCommand::Bfcl(args),
        } => env_cli::run_eval_bfcl(args),
    }
}
