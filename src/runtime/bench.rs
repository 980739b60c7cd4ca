//! `envace bench generate`: prefill and decode throughput, batched decode, and the cost of K
//! rehearsal branches relative to one (the prompt is prefilled once and shared). Medians of
//! repeated runs; run on a quiet machine (candle's thread pool degrades when cores are shared).

use std::time::Instant;

use serde::Serialize;

use super::backend::{CancelToken, RuntimeError, SamplingParams};
use super::generate::{GenContext, Prefix, generate_batch};
use super::model::LocalModel;

/// The report (`--json` prints it as one object).
#[derive(Debug, Clone, Serialize)]
pub struct GenerateBench {
    pub model: String,
    pub parameters: usize,
    pub device: String,
    pub threads: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    pub decode_tok_s_b8: f64,
    pub branch_ratio_k8: f64,
    pub runs: usize,
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    if xs.is_empty() { 0.0 } else { xs[xs.len() / 2] }
}

/// A deterministic prompt of exactly `n` tokens.
pub fn bench_prompt(model: &LocalModel, n: usize) -> Result<Vec<u32>, RuntimeError> {
    let text = "The bank transfers money between checking and savings accounts; the shop \
                handles returns, exchanges and refunds; the travel desk books, changes and \
                cancels flights and hotels. Every tool answers in JSON. ";
    let mut ids = Vec::new();
    while ids.len() < n {
        ids.extend(model.tokenizer.encode(text)?);
    }
    ids.truncate(n);
    Ok(ids)
}

/// Run the generation benchmark.
pub fn run(
    model: &LocalModel,
    prompt_tokens: usize,
    new_tokens: usize,
    runs: usize,
) -> Result<GenerateBench, RuntimeError> {
    let cancel = CancelToken::new();
    // EOS disabled so that every run decodes exactly `new_tokens`.
    let ctx = GenContext {
        eos: &[],
        ..model.context()
    };
    let prompt = bench_prompt(model, prompt_tokens)?;
    let greedy = SamplingParams {
        max_tokens: new_tokens,
        ..Default::default()
    };
    let sampled = SamplingParams {
        temperature: 1.0,
        max_tokens: new_tokens,
        ..Default::default()
    };
    let (mut prefill, mut decode, mut b8, mut ratio) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    // Warm-up (allocations, thread pool).
    let mut p = Prefix::new(&model.decoder, &prompt[..prompt.len().min(32)])?;
    p.generate(
        ctx,
        1,
        &SamplingParams {
            max_tokens: 4,
            ..Default::default()
        },
        None,
        &cancel,
    )?;
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let mut prefix = Prefix::new(&model.decoder, &prompt)?;
        let t_prefill = t.elapsed().as_secs_f64();
        prefill.push(prompt.len() as f64 / t_prefill);

        let t = Instant::now();
        let out = prefix.generate(ctx, 1, &greedy, None, &cancel)?;
        let n: usize = out.iter().map(|(g, _)| g.response_ids.len()).sum();
        decode.push(n as f64 / t.elapsed().as_secs_f64());

        let short: Vec<Vec<u32>> = (0..8).map(|i| prompt[i * 8..i * 8 + 16].to_vec()).collect();
        let t = Instant::now();
        let out = generate_batch(ctx, &short, &greedy, None, &cancel)?;
        let n: usize = out.iter().map(|(g, _)| g.response_ids.len()).sum();
        b8.push(n as f64 / t.elapsed().as_secs_f64());

        let t = Instant::now();
        let mut p1 = Prefix::new(&model.decoder, &prompt)?;
        p1.generate(ctx, 1, &sampled, None, &cancel)?;
        let one = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut p8 = Prefix::new(&model.decoder, &prompt)?;
        p8.generate(ctx, 8, &sampled, None, &cancel)?;
        let eight = t.elapsed().as_secs_f64();
        ratio.push(eight / one);
    }
    Ok(GenerateBench {
        model: model.path.display().to_string(),
        parameters: model.decoder.cfg.parameter_count(),
        device: super::device::describe(&model.decoder.device),
        threads: candle_core::utils::get_num_threads(),
        prompt_tokens,
        new_tokens,
        prefill_tok_s: median(prefill),
        decode_tok_s: median(decode),
        decode_tok_s_b8: median(b8),
        branch_ratio_k8: median(ratio),
        runs: runs.max(1),
    })
}
