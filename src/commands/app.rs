//! The interactive entry points: `envace tui`, the headless `envace demo`, and `envace
//! generate` (one prompt through a model, streamed).

use std::io::Write;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::cli::{self, GenerateArgs};
use envace::message::Message;
use envace::runtime::{CancelToken, SamplingParams};

/// `envace tui` (and `envace` alone): the workbench on a terminal.
pub fn tui(a: cli::TuiArgs) -> Result<()> {
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

/// `envace generate`: one prompt through a local or served model, streamed or as JSON (with
/// `--branches N`, N samples forked from one prefill).
pub fn generate(a: GenerateArgs) -> Result<()> {
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
            "prompt_ids": gens.first().map(|g| g.prompt_ids.clone()).unwrap_or_default(),
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
pub fn demo(model: Option<std::path::PathBuf>) -> Result<()> {
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
    super::tokio_runtime()?.block_on(super::run(args))
}
