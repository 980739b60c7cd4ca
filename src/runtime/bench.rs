//! `envace bench generate`: prefill and decode throughput, decode at fixed context depths,
//! batched decode, the cost of K rehearsal branches relative to one (the prompt is prefilled
//! once and shared), and decode beside a competing process. Medians of repeated runs; run on an
//! otherwise quiet machine (the contended decode brings its own competitor).
//!
//! Counting, so that the numbers compare with llama.cpp's `llama-bench`: a decode rate is
//! forward passes per second. The first new token is sampled from the prefill's logits (no
//! forward of its own), so N new tokens cost N − 1 forwards and count as N − 1; `tg128` in
//! llama-bench runs 128 one-token forwards. Decode "at depth D" is the decode after a D-token
//! prefill (depth 0: a one-token prompt), as `llama-bench -d D`.

use std::collections::BTreeMap;

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
    /// One row, after the `prompt_tokens` prefill (forwards per second).
    pub decode_tok_s: f64,
    /// One row at each context depth (`--depths`, default 0, 128 and 512), by depth.
    pub decode_tok_s_at: BTreeMap<String, f64>,
    /// Eight prompts of different lengths (left-padded), the longest `prompt_tokens`: row-forwards
    /// per second of the decode after the batch's prefill (the prefill is not timed).
    pub decode_tok_s_b8: f64,
    /// Decode time of 8 branches / decode time of 1, each after one shared prefill (prefill
    /// not timed).
    pub branch_ratio_k8: f64,
    /// Wall time of one Private Rehearsal (N=4 parallel branches, depth 2) in a real episode,
    /// from its start to its rehearsal memory (filled by the caller, which owns the engine;
    /// `None` when not measured or when the episode never reached an irreversible call).
    pub rehearsal_ms: Option<f64>,
    /// Busy threads of the competing process behind `decode_tok_s_contended` (0: not measured).
    pub contend_threads: usize,
    /// `decode_tok_s`, measured the same way while another process keeps `contend_threads`
    /// threads busy (filled by the caller, which owns the competitor).
    pub decode_tok_s_contended: Option<f64>,
    /// `decode_tok_s_contended / decode_tok_s`.
    pub contended_ratio: Option<f64>,
    pub runs: usize,
    /// Peak resident memory of this process (MiB, Linux) when the timings above are done: the
    /// model as loaded (an f32 prefill copy included) and the largest caches and activations.
    pub peak_rss_mb: Option<f64>,
}

/// Peak resident memory of this process (MiB) on Linux: `VmHWM` of `/proc/self/status`.
pub fn peak_rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// `decode_tok_s` alone: `runs` times a `prompt_tokens` prefill (not timed), then `new_tokens`
/// greedy tokens; the median in forwards per second.
pub fn decode_rate(
    model: &LocalModel,
    prompt_tokens: usize,
    new_tokens: usize,
    runs: usize,
) -> Result<f64, RuntimeError> {
    let cancel = CancelToken::new();
    let ctx = GenContext {
        eos: &[],
        ..model.context()
    };
    let prompt = bench_prompt(model, prompt_tokens.max(1))?;
    let greedy = SamplingParams {
        max_tokens: new_tokens.max(2),
        ..Default::default()
    };
    let mut rates = Vec::new();
    for _ in 0..runs.max(1) {
        let mut prefix = Prefix::new(&model.decoder, &prompt)?;
        rates.push(decode_one(&mut prefix, ctx, &greedy, &cancel)?);
    }
    Ok(median(rates))
}

/// One row decoded from `prefix` (already prefilled), in forwards per second.
fn decode_one(
    prefix: &mut Prefix,
    ctx: GenContext<'_>,
    params: &SamplingParams,
    cancel: &CancelToken,
) -> Result<f64, RuntimeError> {
    let t = Instant::now();
    let out = prefix.generate(ctx, 1, params, None, cancel)?;
    let n: usize = out.iter().map(|(g, _)| g.response_ids.len()).sum();
    Ok(forwards_per_s(n, t.elapsed().as_secs_f64()))
}

/// Forward passes per second of a decode that produced `tokens` new tokens in `seconds`.
fn forwards_per_s(tokens: usize, seconds: f64) -> f64 {
    tokens.saturating_sub(1) as f64 / seconds
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

/// The `decode_tok_s_b8` batch: eight prefixes of `prompt`, from all of it down to about a
/// third (at least one token), so that the rows are left-padded as in a real batch.
pub fn batch_prompts(prompt: &[u32]) -> Vec<Vec<u32>> {
    let n = prompt.len();
    (0..8)
        .map(|i| prompt[..(n - n * i * 3 / 32).max(1).min(n)].to_vec())
        .collect()
}

/// Run the generation benchmark.
pub fn run(
    model: &LocalModel,
    prompt_tokens: usize,
    new_tokens: usize,
    runs: usize,
    depths: &[usize],
) -> Result<GenerateBench, RuntimeError> {
    let cancel = CancelToken::new();
    // EOS disabled so that every run decodes exactly `new_tokens`.
    let ctx = GenContext {
        eos: &[],
        ..model.context()
    };
    if prompt_tokens == 0 || new_tokens < 2 {
        return Err(RuntimeError::Generation(
            "bench generate: --prompt-tokens must be at least 1 and --new-tokens at least 2 \
             (the first new token needs no forward pass)"
                .into(),
        ));
    }
    let prompt = bench_prompt(model, prompt_tokens)?;
    let deep = bench_prompt(model, depths.iter().copied().max().unwrap_or(0).max(1))?;
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
    let mut at: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
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

        decode.push(decode_one(&mut prefix, ctx, &greedy, &cancel)?);

        // Decode at each depth: a `depth`-token prefill (not timed), then the new tokens.
        for &depth in depths {
            let mut p = Prefix::new(&model.decoder, &deep[..depth.max(1)])?;
            at.entry(depth)
                .or_default()
                .push(decode_one(&mut p, ctx, &greedy, &cancel)?);
        }

        // Eight prompts of different lengths (real left padding), the longest at b1's context.
        // The clock starts at the first streamed token: after the batch's prefill and the
        // first tokens (sampled from its logits), so 8 × (N − 1) row-forwards are timed.
        let rows = batch_prompts(&prompt);
        let mut first: Option<Instant> = None;
        let mut sink = |_: usize, _: &str| {
            first.get_or_insert_with(Instant::now);
        };
        let out = generate_batch(ctx, &rows, &greedy, Some(&mut sink), &cancel)?;
        let end = Instant::now();
        let start = first.ok_or_else(|| {
            RuntimeError::Generation("bench generate: the batch streamed no text".into())
        })?;
        let n: usize = out
            .iter()
            .map(|(g, _)| g.response_ids.len().saturating_sub(1))
            .sum();
        b8.push(n as f64 / (end - start).as_secs_f64());

        // Branch cost: decode time of 8 branches over 1, after one shared prefill each (the
        // prefill itself is not timed, so that faster decoding does not move the ratio).
        let mut p1 = Prefix::new(&model.decoder, &prompt)?;
        let t = Instant::now();
        p1.generate(ctx, 1, &sampled, None, &cancel)?;
        let one = t.elapsed().as_secs_f64();
        let mut p8 = Prefix::new(&model.decoder, &prompt)?;
        let t = Instant::now();
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
        decode_tok_s_at: at
            .into_iter()
            .map(|(d, xs)| (d.to_string(), median(xs)))
            .collect(),
        decode_tok_s_b8: median(b8),
        branch_ratio_k8: median(ratio),
        rehearsal_ms: None,
        contend_threads: 0,
        decode_tok_s_contended: None,
        contended_ratio: None,
        runs: runs.max(1),
        peak_rss_mb: peak_rss_mb(),
    })
}
