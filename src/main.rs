//! The `envace` binary: parses the command line and calls into the library.

mod cli;
mod commands;

use anyhow::Result;
use clap::Parser;

use cli::{BenchCommand, Cli, Command, EvalArgs, EvalCommand};
use envace::env::cli as env_cli;

/// Exit statuses: 0 success, 1 the episode did not succeed, 2 bad input or set-up, 3 the
/// environment or model failed, 130 interrupted (`commands::exit_code`; README "Exit codes").
fn main() -> std::process::ExitCode {
    match dispatch(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            match e.downcast_ref::<commands::Exit>() {
                Some(x) if x.message.is_empty() => {}
                Some(x) => eprintln!("{x}"),
                None => eprintln!("Error: {e:?}"),
            }
            std::process::ExitCode::from(commands::exit_code(&e))
        }
    }
}

/// glibc's allocator, for commands that train: keep freed buffers mapped and never trim the
/// heap. Every training step frees and reallocates the same large tensors; by default each
/// one is a fresh mmap whose pages fault in again (measured: most of the CPU in the kernel,
/// docs/PERFORMANCE.md). glibc reads its tunables when the process starts, so the binary
/// starts itself again with `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000` (a user's
/// own `MALLOC_MMAP_MAX_` wins: then nothing happens). The cost: the process keeps its peak
/// memory. Returns only when the new process could not be started (it then runs as it is).
///
/// The restart also fixes `RAYON_NUM_THREADS` (unless set) to the thread count candle would
/// pick: candle 0.11.1 works that count out again on every matmul, reading `/proc/cpuinfo`
/// each time unless the variable is set (measured: a fifth of a LoRA model's decode time).
fn tune_allocator_for_training() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::unix::process::CommandExt;
        if std::env::var_os("MALLOC_MMAP_MAX_").is_some() {
            return;
        }
        let Ok(exe) = std::env::current_exe() else {
            return;
        };
        let mut cmd = std::process::Command::new(exe);
        cmd.args(std::env::args_os().skip(1))
            .env("MALLOC_MMAP_MAX_", "0")
            .env("MALLOC_TRIM_THRESHOLD_", "100000000000");
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env(
                "RAYON_NUM_THREADS",
                candle_core::utils::get_num_threads().to_string(),
            );
        }
        let err = cmd.exec();
        tracing::debug!("could not restart with the training allocator settings: {err}");
    }
}

/// Headless commands log to stderr, filtered by `ENVACE_LOG` (default `warn`; e.g.
/// `ENVACE_LOG=envace=debug`); the TUI logs to a file instead (`tui::driver`).
fn init_stderr_logging() {
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ENVACE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
}

fn dispatch(cli: Cli) -> Result<()> {
    if !matches!(cli.command, None | Some(Command::Tui(_))) {
        init_stderr_logging();
    }
    if matches!(
        cli.command,
        None | Some(Command::Tui(_))
            | Some(Command::Pretrain(_))
            | Some(Command::Train(_))
            | Some(Command::Bench(BenchCommand::Train(_)))
    ) {
        tune_allocator_for_training();
    }
    match cli.command {
        None => commands::tui(cli::TuiArgs::default()),
        Some(Command::Tui(a)) => commands::tui(a),
        Some(Command::Demo(a)) => commands::demo(a.model),
        Some(Command::Generate(a)) => commands::generate(a),
        Some(Command::Pretrain(a)) => commands::pretrain(a),
        Some(Command::Train(cli::TrainArgs {
            command: Some(cli::TrainCommand::Sft(a)),
            ..
        })) => commands::train_sft(*a),
        Some(Command::Train(a)) => commands::train(a),
        Some(Command::Merge(a)) => commands::merge(a),
        Some(Command::Env { command }) => {
            commands::tokio_runtime()?.block_on(env_cli::run_env(command))
        }
        Some(Command::Tasks(args)) => env_cli::run_tasks(args),
        Some(Command::Eval(EvalArgs {
            command: Some(EvalCommand::Bfcl(args)),
            ..
        })) => {
            // Constrained names need a local model: a served one is refused before anything is
            // loaded or written (the env layer knows nothing of model backends).
            if let Some(m) = &args.model {
                envace::runtime::openai::refuse_remote_constraint(
                    &m.to_string_lossy(),
                    args.constrain_tools,
                )?;
            }
            env_cli::run_eval_bfcl_with(args, &envace::engine::bfcl_eval::load_responder)
        }
        Some(Command::Eval(a)) => commands::tokio_runtime()?.block_on(commands::eval(a)),
        Some(Command::Run(a)) => commands::tokio_runtime()?.block_on(commands::run(a)),
        Some(Command::Replay { file }) => {
            print!("{}", envace::session::replay_text(&file)?);
            Ok(())
        }
        Some(Command::Export(a)) => commands::export(a),
        Some(Command::Sessions(a)) => commands::sessions(a),
        Some(Command::Fork(a)) => commands::tokio_runtime()?.block_on(commands::fork(a)),
        Some(Command::Diff(a)) => commands::diff(a),
        Some(Command::Bench(BenchCommand::Train(a))) => commands::bench_train(a),
        Some(Command::Bench(BenchCommand::Spin { threads })) => {
            commands::spin(usize::from(threads))
        }
        Some(Command::Bench(BenchCommand::Generate(a))) => commands::bench_generate(a),
    }
}
