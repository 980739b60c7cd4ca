//! The parts of `envace bench generate` that need the engine or a second process: the
//! Private Rehearsal timing and the competing process of `--contend`.

use std::path::Path;

use anyhow::{Context, Result, bail};

use envace::engine::driver::share_model;
use envace::engine::profile::PromptProfile;
use envace::engine::runner::Policy;
use envace::env::tasks::find_builtin;

/// The `--rehearsal-task` of `envace bench generate` (checked before the benchmark runs):
/// `None` for `none`.
pub fn bench_rehearsal_task(task: &str) -> Result<Option<&'static envace::env::tasks::Task>> {
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
pub fn bench_rehearsal(
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
pub fn bench_contended(
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
pub struct Competitor {
    child: std::process::Child,
}

impl Competitor {
    pub fn spawn(threads: usize) -> Result<Self> {
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
