//! Rehearsal branch step benchmark (`cargo bench --bench branch_step`): the whole decode step
//! of one sampled continuation against K (default 8) forked from the same 512-token prompt, as
//! `envace bench generate`'s `branch_ratio_k8` times them, but alternated (1, K, 1, K, …) from
//! one prefill kept for every round, so that each K step is compared with a 1 step of the same
//! minute. `BRANCH_STEP_MODEL=path.gguf` (required), `BRANCH_STEP_K`, `BRANCH_STEP_ROUNDS`
//! (default 5). Prints one JSON object per round: milliseconds per decode step (63 steps after
//! the first token) of each, and their ratio; then the medians.

use std::path::Path;
use std::time::Instant;

use envace::runtime::backend::{CancelToken, SamplingParams};
use envace::runtime::bench::bench_prompt;
use envace::runtime::generate::{GenContext, Prefix};
use envace::runtime::{DeviceChoice, LocalModel};

const NEW_TOKENS: usize = 64;

fn env_usize(name: &str, default: usize) -> anyhow::Result<usize> {
    match std::env::var(name) {
        Ok(s) => s
            .parse()
            .map_err(|e| anyhow::anyhow!("{name}={s:?}: not a count ({e})")),
        Err(_) => Ok(default),
    }
}

fn main() -> anyhow::Result<()> {
    let path = std::env::var("BRANCH_STEP_MODEL")
        .map_err(|_| anyhow::anyhow!("set BRANCH_STEP_MODEL to a GGUF file"))?;
    let k = env_usize("BRANCH_STEP_K", 8)?.max(1);
    let rounds = env_usize("BRANCH_STEP_ROUNDS", 5)?.max(1);
    let model = LocalModel::load(Path::new(&path), DeviceChoice::Cpu)?;
    let cancel = CancelToken::new();
    // EOS off, so that every branch decodes exactly NEW_TOKENS.
    let ctx = GenContext {
        eos: &[],
        ..model.context()
    };
    let prompt = bench_prompt(&model, 512)?;
    let sampled = SamplingParams {
        temperature: 1.0,
        max_tokens: NEW_TOKENS,
        ..Default::default()
    };
    let base = Prefix::new(&model.decoder, &prompt)?;
    let step_ms = |n: usize| -> anyhow::Result<f64> {
        let mut p = base.clone();
        let t = Instant::now();
        p.generate(ctx, n, &sampled, None, &cancel)?;
        Ok(t.elapsed().as_secs_f64() * 1e3 / (NEW_TOKENS - 1) as f64)
    };
    step_ms(1)?; // warm-up
    let (mut ones, mut ks, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let one = step_ms(1)?;
        let many = step_ms(k)?;
        println!(
            "{{\"round\":{round},\"k\":{k},\"ms_per_step_1\":{one:.2},\"ms_per_step_k\":{many:.2},\"ratio\":{:.3}}}",
            many / one
        );
        ones.push(one);
        ks.push(many);
        ratios.push(many / one);
    }
    let median = |mut xs: Vec<f64>| {
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    };
    println!(
        "{{\"k\":{k},\"ms_per_step_1_median\":{:.2},\"ms_per_step_k_median\":{:.2},\"ratio_median\":{:.3}}}",
        median(ones),
        median(ks),
        median(ratios)
    );
    Ok(())
}
