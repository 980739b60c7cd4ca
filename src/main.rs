//! The `envace` binary: parses the command line and calls into the library.

mod cli;
mod commands;

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;

use cli::{BenchCommand, Cli, Command, EvalArgs, EvalCommand, GenerateArgs};
use envace::env::cli as env_cli;
use envace::message::Message;
use envace::runtime::{CancelToken, LocalModel, SamplingParams};

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
        None => tui(cli::TuiArgs::default()),
        Some(Command::Tui(a)) => tui(a),
        Some(Command::Demo(a)) => demo(a.model),
        Some(Command::Generate(a)) => generate(a),
        Some(Command::Pretrain(a)) => pretrain(a),
        Some(Command::Train(cli::TrainArgs {
            command: Some(cli::TrainCommand::Sft(a)),
            ..
        })) => commands::train_sft(*a),
        Some(Command::Train(a)) => commands::train(a),
        Some(Command::Merge(a)) => commands::merge(a),
        Some(Command::Env { command }) => tokio_runtime()?.block_on(env_cli::run_env(command)),
        Some(Command::Tasks(args)) => env_cli::run_tasks(args),
        Some(Command::Eval(EvalArgs {
            command: Some(EvalCommand::Bfcl(args)),
            ..
        })) => env_cli::run_eval_bfcl_with(args, &envace::engine::bfcl_eval::load_responder),
        Some(Command::Eval(a)) => tokio_runtime()?.block_on(commands::eval(a)),
        Some(Command::Run(a)) => tokio_runtime()?.block_on(commands::run(a)),
        Some(Command::Replay { file }) => {
            print!("{}", envace::session::replay_text(&file)?);
            Ok(())
        }
        Some(Command::Export(a)) => commands::export(a),
        Some(Command::Sessions(a)) => commands::sessions(a),
        Some(Command::Fork(a)) => tokio_runtime()?.block_on(commands::fork(a)),
        Some(Command::Diff(a)) => commands::diff(a),
        Some(Command::Bench(BenchCommand::Train(a))) => {
            use envace::train::bench;
            let model = match (&a.model, &a.shape) {
                (None, None) => Some(std::path::PathBuf::from("models/envace-tiny")),
                (m, _) => m.clone(),
            };
            let (m, label, total) = bench::load(
                model.as_deref(),
                a.shape.as_deref(),
                a.lora,
                0,
                &candle_core::Device::Cpu,
            )?;
            let cfg = bench::TrainBenchConfig {
                batch: a.batch,
                seq: a.seq,
                steps: a.steps.max(1),
                seed: 0,
            };
            let r = bench::run(&m, &label, total, a.lora, &cfg)?;
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("{}", serde_json::to_string_pretty(&r)?);
            }
            Ok(())
        }
        Some(Command::Bench(BenchCommand::Spin { threads })) => {
            commands::spin(usize::from(threads))
        }
        Some(Command::Bench(BenchCommand::Generate(a))) => {
            let task = commands::bench_rehearsal_task(&a.rehearsal_task)?;
            let model = LocalModel::load(&a.model, a.device)
                .with_context(|| format!("loading {}", a.model.display()))?;
            let mut r = envace::runtime::bench::run(
                &model,
                a.prompt_tokens,
                a.new_tokens,
                a.runs,
                &a.depths,
            )?;
            if a.contend > 0 {
                commands::bench_contended(&model, &a, &mut r)?;
            }
            if let Some(task) = task {
                r.rehearsal_ms = commands::bench_rehearsal(model, &a.model, task)?;
            }
            if a.json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("{}", serde_json::to_string_pretty(&r)?);
            }
            Ok(())
        }
    }
}

fn tui(a: cli::TuiArgs) -> Result<()> {
    use std::io::IsTerminal;
    anyhow::ensure!(
        std::io::stdout().is_terminal(),
        "the TUI needs a terminal; for scripts use the headless commands (`envace --help`)"
    );
    anyhow::ensure!(
        a.model.exists(),
        "model {} not found (run from the repository root, or pass --model)",
        a.model.display()
    );
    let opts = envace::tui::TuiOptions {
        mcp: a.mcp.config_with_headers(&a.headers)?,
        model: a.model,
        env: a.env,
        session: a.session,
        sessions_dir: a.sessions_dir,
        theme: a.theme,
        device: a.device,
    };
    envace::tui::run(opts)?;
    Ok(())
}

fn pretrain(a: cli::PretrainArgs) -> Result<()> {
    use envace::train::metrics::{JsonlSink, MetricsSink, NullSink};
    use envace::train::pretrain::{PretrainConfig, run_pretrain};
    let mut cfg = PretrainConfig {
        seed: a.seed,
        vocab_size: a.vocab,
        hidden_size: a.hidden,
        layers: a.layers,
        ..Default::default()
    };
    cfg.intermediate_size = a.hidden * 11 / 4;
    cfg.sft.steps = a.steps;
    cfg.sft.batch_size = a.batch;
    cfg.sft.lr = a.lr;
    cfg.sft.time_budget_s = Some(a.minutes * 60.0);
    cfg.sft.stop_at = a.stop_at;
    cfg.sft.checkpoint_every = a.checkpoint_every;
    cfg.sft.warmup = a.warmup;
    cfg.corpus.tasks_per_domain = a.tasks_per_domain;
    cfg.corpus.sim_per_task = a.sim_per_task;
    cfg.corpus.memory_fraction = a.memory_fraction;
    cfg.corpus.slip_fraction = a.slip_fraction;
    cfg.corpus.slip_values = a.slip_values;
    cfg.corpus.copy_per_task = a.copy_per_task;
    cfg.corpus.recorded_fraction = a.recorded_fraction;
    cfg.corpus.random_copy_fraction = a.random_copy;
    cfg.corpus.random_entity_fraction = a.random_entities;
    cfg.corpus.random_entity_style = a.entity_style;
    cfg.corpus.tool_drills_per_task = a.tool_drills;
    cfg.corpus.tool_drill_style = a.tool_drill_style;
    cfg.corpus.calc_drills_per_task = a.calc_drills;
    cfg.corpus.spell_drills_per_task = a.spell_drills;
    cfg.corpus.price_steps = a.price_steps;
    cfg.corpus.template = a.template;
    cfg.corpus.kind_weights = a.kind_weights.iter().cloned().collect();
    let unknown =
        envace::train::pretrain::unknown_kinds(&envace::env::domains::Domain::ALL, &cfg.corpus);
    if !unknown.is_empty() {
        anyhow::bail!(
            "--kind-weight: no train-split task of the corpus has kind {} (the kinds are the second column of `envace tasks DOMAIN --split train`)",
            unknown.join(", ")
        );
    }
    for (flag, v) in [
        ("--random-entities", a.random_entities),
        ("--random-copy", a.random_copy),
        ("--memory-fraction", a.memory_fraction),
        ("--slip-fraction", a.slip_fraction),
        ("--recorded-fraction", a.recorded_fraction),
    ] {
        if !(0.0..=1.0).contains(&v) {
            anyhow::bail!("{flag} {v}: a fraction between 0 and 1");
        }
    }
    if a.entity_style != envace::train::pretrain::EntityStyle::Letters && a.random_entities == 0.0 {
        anyhow::bail!("--entity-style shapes the copies of --random-entities F, which is 0");
    }
    cfg.corpus.seed = a.seed;
    if let Some(r) = a.lora.lora {
        cfg.lora = Some(envace::train::lora::LoraConfig::new(
            r,
            a.lora.lora_alpha,
            &a.lora.lora_targets,
            a.seed,
        )?);
    }
    if a.dry_run {
        let stats = envace::train::pretrain::dry_run(&cfg)?;
        println!("{}", serde_json::to_string_pretty(&stats)?);
        return Ok(());
    }
    let mut sink: Box<dyn MetricsSink> = match &a.metrics {
        Some(p) => Box::new(JsonlSink::create(p, a.json)?),
        None => Box::new(NullSink),
    };
    let report = run_pretrain(
        &cfg,
        a.init.as_deref(),
        &a.out,
        sink.as_mut(),
        &CancelToken::new(),
    )?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

fn tokio_runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn generate(a: GenerateArgs) -> Result<()> {
    let mut model = envace::runtime::openai::open_model(&a.model, a.device)
        .with_context(|| format!("loading {}", a.model.display()))?;
    let mut msgs = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(Message::system(s.clone()));
    }
    msgs.push(Message::user(a.prompt.clone()));
    let chat = envace::runtime::ChatPrompt {
        messages: &msgs,
        tools: &[],
        enable_thinking: false,
    };
    // --raw: the prompt text as it is (a local model or a completions backend encodes it).
    let raw_ids = if a.raw {
        Some(model.encode(&a.prompt)?)
    } else {
        None
    };
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed: a.seed,
        max_tokens: a.max_tokens,
        stop: a.stop.clone(),
        tool_names: Vec::new(),
    };
    let cancel = CancelToken::new();
    let t = Instant::now();
    let mut out = std::io::stdout();
    let mut sink = |_: usize, s: &str| {
        let _ = out.write_all(s.as_bytes());
        let _ = out.flush();
    };
    let streamed = !(a.json || a.branches > 1);
    let stream: Option<envace::runtime::StreamSink<'_>> =
        if streamed { Some(&mut sink) } else { None };
    let gens = match &raw_ids {
        Some(ids) => model.generate(ids, a.branches, &params, stream, &cancel)?,
        None => model.generate_chat(&chat, a.branches, &params, stream, &cancel)?,
    };
    if streamed {
        println!();
    }
    let secs = t.elapsed().as_secs_f64();
    let tokens: usize = gens.iter().map(|g| g.response_ids.len()).sum();
    if a.json {
        let mut obj = serde_json::json!({
            "prompt_tokens": gens.first().map_or(0, |g| g.prompt_ids.len()),
            "tokens": tokens,
            "tokens_per_s": tokens as f64 / secs.max(1e-9),
            "seconds": secs,
        });
        if a.branches > 1 {
            obj["branches"] = gens
                .iter()
                .map(|g| serde_json::json!({"text": g.text, "tokens": g.response_ids, "logprobs": g.logprobs, "finish": g.finish}))
                .collect();
        } else if let Some(g) = gens.first() {
            obj["text"] = g.text.clone().into();
            obj["response_ids"] = serde_json::json!(g.response_ids);
            obj["logprobs"] = serde_json::json!(g.logprobs);
            obj["finish"] = serde_json::json!(g.finish);
        }
        println!("{obj}");
    } else if a.branches > 1 {
        for (i, g) in gens.iter().enumerate() {
            println!(
                "--- branch {i} ({} tokens) ---\n{}",
                g.response_ids.len(),
                g.text
            );
        }
    }
    Ok(())
}

/// The headless demo (`envace demo`): the bundled model plays a
/// held-out bank task in shadow mode (the simulator predicts every call, the real environment
/// answers) with Private Rehearsal before the irreversible call, and the session is replayed.
fn demo(model: Option<std::path::PathBuf>) -> Result<()> {
    let path = model.unwrap_or_else(|| std::path::PathBuf::from("models/envace-tiny"));
    anyhow::ensure!(
        path.join("model.safetensors").is_file(),
        "the bundled model {} is missing (run from the repository root)",
        path.display()
    );
    let out = std::env::temp_dir().join(format!("envace-demo-{}.jsonl", std::process::id()));
    // The same flags a person would type: `envace run … --mode shadow --rehearsals 2`.
    let argv = [
        "envace".to_string(),
        "run".into(),
        "--model".into(),
        path.display().to_string(),
        "--env".into(),
        "bank".into(),
        "--task".into(),
        "bank-test-0004".into(),
        "--mode".into(),
        "shadow".into(),
        "--rehearsals".into(),
        "2".into(),
        "--out".into(),
        out.display().to_string(),
    ];
    let args = match <cli::Cli as clap::Parser>::try_parse_from(argv)?.command {
        Some(cli::Command::Run(a)) => a,
        _ => anyhow::bail!("the demo's command line did not parse as `envace run`"),
    };
    println!(
        "envace demo: the bundled model on a held-out bank task, shadow mode, Private Rehearsal N=2"
    );
    tokio_runtime()?.block_on(commands::run(args))
}
