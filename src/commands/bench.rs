//! `envace bench train`, `envace bench generate` (with the Private Rehearsal timing and the
//! competing process of `--contend`, which need the engine or a second process) and the
//! competing process itself, `envace bench spin`.

use std::path::Path;

use anyhow::{Context, Result, bail};

use envace::engine::driver::share_model;
use envace::engine::profile::PromptProfile;
use envace::engine::runner::Policy;
use envace::env::tasks::find_builtin;

/// The `--rehearsal-task` of `envace bench generate` (checked before the benchmark runs):
/// `None` for `none`.
fn bench_rehearsal_task(task: &str) -> Result<Option<&'static envace::env::tasks::Task>> {
    if task == "none" {
        return Ok(None);
    }
    find_builtin(task)
        .map(Some)
        .with_context(|| format!("--rehearsal-task: unknown task `{task}` (or `none`)"))
}

/// `rehearsal_ms` of `envace bench generate`: the first Private Rehearsal of `task` played by
/// `model` in real mode. `None` when the episode never rehearsed (the model proposed no
/// irreversible call).
fn bench_rehearsal(
    model: envace::runtime::LocalModel,
    path: &Path,
    task: &envace::env::tasks::Task,
) -> Result<Option<f64>> {
    let profile = PromptProfile::for_model(path)?;
    let model = share_model(Box::new(model));
    let policy = Policy {
        model: &model,
        profile: profile.as_ref(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(envace::engine::bench::rehearsal_ms(policy, task, 0))?)
}

/// `bench generate --contend N`: `decode_tok_s` measured again beside a [`Competitor`] of `N`
/// busy threads, and its ratio to the quiet figure already in `r`.
fn bench_contended(
    model: &envace::runtime::LocalModel,
    a: &crate::cli::BenchGenerateArgs,
    r: &mut envace::runtime::bench::GenerateBench,
) -> Result<()> {
    let competitor = Competitor::spawn(usize::from(a.contend))?;
    let rate = envace::runtime::bench::decode_rate(model, a.prompt_tokens, a.new_tokens, a.runs);
    drop(competitor);
    let rate = rate?;
    r.contend_threads = usize::from(a.contend);
    r.decode_tok_s_contended = Some(rate);
    r.contended_ratio = Some(rate / r.decode_tok_s);
    Ok(())
}

/// A competing process for `bench generate --contend`: a child `envace bench spin` that keeps
/// its threads busy until dropped (its standard input closes with the pipe, so it also ends if
/// this process dies first).
struct Competitor {
    child: std::process::Child,
}

impl Competitor {
    fn spawn(threads: usize) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the envace binary")?;
        let child = std::process::Command::new(&exe)
            .args(["bench", "spin", "--threads", &threads.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("starting the competing process {}", exe.display()))?;
        // Let its threads get going before anything is timed.
        std::thread::sleep(std::time::Duration::from_millis(300));
        Ok(Self { child })
    }
}

impl Drop for Competitor {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        if let Err(err) = self.child.kill() {
            tracing::debug!("competing process already gone: {err}");
        }
        if let Err(err) = self.child.wait() {
            tracing::debug!("waiting for the competing process: {err}");
        }
    }
}

/// `envace bench spin`: `threads` busy threads until standard input reaches its end.
pub fn spin(threads: usize) -> Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..threads.max(1))
        .map(|_| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            })
        })
        .collect();
    std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink())
        .context("reading standard input")?;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        if w.join().is_err() {
            bail!("a spinning thread panicked");
        }
    }
    Ok(())
}

/// `envace bench train`: training throughput of a model or a named shape.
pub fn bench_train(a: crate::cli::BenchTrainArgs) -> Result<()> {
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

/// `envace bench generate`: prefill / decode throughput and branch cost, then the contended
/// decode and the Private Rehearsal timing when asked for.
pub fn bench_generate(a: crate::cli::BenchGenerateArgs) -> Result<()> {
    let task = bench_rehearsal_task(&a.rehearsal_task)?;
    let model = envace::runtime::LocalModel::load(&a.model, a.device)
        .with_context(|| format!("loading {}", a.model.display()))?;
    let mut r =
        envace::runtime::bench::run(&model, a.prompt_tokens, a.new_tokens, a.runs, &a.depths)?;
    if a.contend > 0 {
        bench_contended(&model, &a, &mut r)?;
    }
    if let Some(task) = task {
        r.rehearsal_ms = bench_rehearsal(model, &a.model, task)?;
    }
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!("{}", serde_json::to_string_pretty(&r)?);
    }
    Ok(())
}
