//! Supervised training on masked sequences (actor turns and simulator turns of gold
//! trajectories): token-mean NLL, AdamW, clipping, warmup + cosine, a deterministic data order
//! derived from (seed, step) so that `--resume` continues bit-for-bit, atomic checkpoints.

use std::path::Path;
use std::time::Instant;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use super::TrainError;
use super::checkpoint::{self, Loaded, TrainerState};
use super::metrics::{MetricsSink, StepMetrics};
use super::model::{Example, TrainableModel, masked_nll};
use super::optim::{AdamW, AdamWConfig, schedule};
use crate::runtime::CancelToken;
use crate::runtime::par::with_spinning_helpers;

/// SFT settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SftConfig {
    pub steps: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub warmup: usize,
    pub min_lr_ratio: f64,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub seed: u64,
    pub max_len: usize,
    /// Write a checkpoint every N steps (0 = only at the end).
    pub checkpoint_every: usize,
    /// Stop early (with a final checkpoint) after this many seconds.
    pub time_budget_s: Option<f64>,
    /// Stop early (with a final checkpoint) before this step, the schedule still spanning
    /// `steps`: reproduces exactly a run that its time budget ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_at: Option<usize>,
}

impl Default for SftConfig {
    fn default() -> Self {
        Self {
            steps: 1000,
            batch_size: 16,
            lr: 2e-3,
            warmup: 50,
            min_lr_ratio: 0.1,
            weight_decay: 0.01,
            grad_clip: 1.0,
            seed: 0,
            max_len: 512,
            checkpoint_every: 0,
            time_budget_s: None,
            stop_at: None,
        }
    }
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct SftReport {
    pub steps: usize,
    pub first_loss: f64,
    pub last_loss: f64,
    pub tokens: f64,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

/// Example indices of `step`'s batch. Each epoch is a seeded permutation, cut into windows of
/// 32 batches whose examples are sorted by length (little padding), with the batch order
/// shuffled again; the whole order is a function of (seed, step), so a resumed run sees exactly
/// the batches it would have seen.
pub fn batch_indices(lengths: &[usize], batch: usize, seed: u64, step: usize) -> Vec<usize> {
    let n = lengths.len();
    if n == 0 || batch == 0 {
        return Vec::new();
    }
    let per_epoch = n.div_ceil(batch);
    let epoch = step / per_epoch;
    let batches = epoch_batches(lengths, batch, seed, epoch);
    batches.get(step % per_epoch).cloned().unwrap_or_default()
}

fn epoch_batches(lengths: &[usize], batch: usize, seed: u64, epoch: usize) -> Vec<Vec<usize>> {
    let n = lengths.len();
    let mut p: Vec<usize> = (0..n).collect();
    let mut rng = StdRng::seed_from_u64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    p.shuffle(&mut rng);
    let mut batches = Vec::with_capacity(n.div_ceil(batch));
    for window in p.chunks(batch * 32) {
        let mut w = window.to_vec();
        w.sort_by_key(|&i| (lengths[i], i));
        batches.extend(w.chunks(batch).map(<[usize]>::to_vec));
    }
    batches.shuffle(&mut rng);
    batches
}

/// Train. With `out`, checkpoints go to `out/checkpoint-STEP` and `out/final`; with `resume`,
/// weights must already be loaded from the checkpoint and its optimizer state is restored.
#[allow(clippy::too_many_arguments)]
pub fn run_sft(
    model: &TrainableModel,
    examples: &[Example],
    cfg: &SftConfig,
    tokenizer_json: &Path,
    out: Option<&Path>,
    resume: Option<&Loaded>,
    sink: &mut dyn MetricsSink,
    cancel: &CancelToken,
) -> Result<SftReport, TrainError> {
    if examples.is_empty() {
        return Err(TrainError::Data("no training examples".into()));
    }
    let examples: Vec<Example> = examples
        .iter()
        .map(|e| {
            let mut e = e.clone();
            e.truncate(cfg.max_len);
            e
        })
        .filter(|e| e.trained_tokens() > 0)
        .collect();
    let lengths: Vec<usize> = examples.iter().map(|e| e.ids.len()).collect();
    let mut opt = AdamW::new(
        model.named_vars(),
        AdamWConfig {
            lr: cfg.lr,
            weight_decay: cfg.weight_decay,
            ..Default::default()
        },
    )?;
    let mut start = 0;
    if let Some(l) = resume {
        opt.load_state(&l.optimizer, l.state.step)
            .map_err(|m| TrainError::Checkpoint(format!("{}: {m}", l.dir.display())))?;
        start = l.state.step;
    }
    let t0 = Instant::now();
    let (mut first, mut last, mut tokens) = (f64::NAN, f64::NAN, 0f64);
    let mut step = start;
    while step < cfg.steps {
        if cancel.is_cancelled() {
            break;
        }
        if cfg.stop_at.is_some_and(|s| step >= s) {
            sink.log(&format!("stopped at step {step} (--stop-at)"));
            break;
        }
        if let Some(b) = cfg.time_budget_s
            && t0.elapsed().as_secs_f64() > b
        {
            sink.log(&format!("time budget of {b:.0}s reached at step {step}"));
            break;
        }
        let idx = batch_indices(&lengths, cfg.batch_size, cfg.seed, step);
        let batch: Vec<&Example> = idx.iter().map(|&i| &examples[i]).collect();
        let lr = schedule(cfg.lr, step, cfg.warmup, cfg.steps, cfg.min_lr_ratio);
        // The whole step with the pool's helpers spinning between kernels.
        let (loss, n, gn) = with_spinning_helpers(|| -> Result<_, TrainError> {
            let (loss, n) = masked_nll(&model.decoder, &batch)?;
            let grads = crate::runtime::train_pass::backward(&loss)?;
            let gn = opt.grad_norm(&grads)?;
            let scale = if cfg.grad_clip > 0.0 && gn > cfg.grad_clip {
                cfg.grad_clip / gn
            } else {
                1.0
            };
            opt.step(&grads, lr, scale)?;
            Ok((loss, n, gn))
        })?;
        let l = loss.to_scalar::<f32>()? as f64;
        if first.is_nan() {
            first = l;
        }
        last = l;
        tokens += batch.iter().map(|e| e.ids.len() as f64).sum::<f64>();
        step += 1;
        let secs = t0.elapsed().as_secs_f64();
        sink.record(
            &StepMetrics::new("sft", step)
                .with("loss", l)
                .with("lr", lr)
                .with("grad_norm", gn)
                .with("trained_tokens", n)
                .with("tokens_per_s", tokens / secs.max(1e-9)),
        );
        if let Some(dir) = out
            && cfg.checkpoint_every > 0
            && step % cfg.checkpoint_every == 0
        {
            save(
                model,
                &opt,
                cfg,
                tokenizer_json,
                &dir.join(format!("checkpoint-{step}")),
                step,
            )?;
        }
    }
    if let Some(dir) = out {
        save(model, &opt, cfg, tokenizer_json, &dir.join("final"), step)?;
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(SftReport {
        steps: step,
        first_loss: first,
        last_loss: last,
        tokens,
        seconds,
        tokens_per_s: tokens / seconds.max(1e-9),
    })
}

fn save(
    model: &TrainableModel,
    opt: &AdamW,
    cfg: &SftConfig,
    tokenizer_json: &Path,
    dir: &Path,
    step: usize,
) -> Result<(), TrainError> {
    let state = TrainerState {
        kind: "sft".into(),
        step,
        total_steps: cfg.steps,
        seed: cfg.seed,
        rng: serde_json::json!({"data_order": "seeded epoch permutations; position = step * batch"}),
        config: serde_json::to_value(cfg).unwrap_or_default(),
        metrics: serde_json::Value::Null,
    };
    checkpoint::save_trainer(dir, model, opt, tokenizer_json, None, &state)?;
    Ok(())
}
