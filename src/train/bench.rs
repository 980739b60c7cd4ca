//! `envace bench train`: training throughput of the trainable decoder — forward + backward +
//! AdamW on a batch of seeded random token sequences, every position trained — and peak memory,
//! for full fine-tuning or LoRA, on a model directory or a named shape (seeded random weights;
//! no download needed). The reported tokens/s counts trained positions (each sequence of `seq`
//! input tokens trains `seq − 1` next-token targets: the work `scripts/bench-pytorch-train`
//! counts, T targets for T inputs plus one); the step
//! is also split into forward, backward and optimizer time, and the kernels in use are named
//! (`ENVACE_SLOW_OPS=1` selects candle's slow differentiable ops, for A/B runs).

use std::path::Path;
use std::time::Instant;

use candle_core::Device;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::TrainError;
use super::lora::LoraConfig;
use super::model::{Example, TrainableModel, masked_nll};
use super::optim::{AdamW, AdamWConfig};
use crate::runtime::bench::peak_rss_mb;
use crate::runtime::config::{DecoderConfig, Family};
use crate::runtime::fused::Kernels;
use crate::runtime::par::with_spinning_helpers;

/// Benchmark settings.
#[derive(Debug, Clone)]
pub struct TrainBenchConfig {
    pub batch: usize,
    pub seq: usize,
    /// Timed steps (after one untimed warm-up step).
    pub steps: usize,
    pub seed: u64,
}

impl Default for TrainBenchConfig {
    fn default() -> Self {
        Self {
            batch: 8,
            seq: 64,
            steps: 5,
            seed: 0,
        }
    }
}

/// What one benchmark run measured.
#[derive(Debug, Clone, Serialize)]
pub struct TrainBenchResult {
    pub model: String,
    pub parameters: usize,
    pub trainable_parameters: usize,
    pub lora_rank: Option<usize>,
    pub batch: usize,
    pub seq: usize,
    pub steps: usize,
    pub step_s_median: f64,
    /// Medians of the step's parts: forward to the loss, `backward()`, optimizer (grad norm +
    /// AdamW). Each is the median over the timed steps, so they need not add up to the step.
    pub fwd_s_median: f64,
    pub bwd_s_median: f64,
    pub opt_s_median: f64,
    /// Trained positions per second: `batch × (seq − 1)` per step.
    pub tokens_per_s: f64,
    /// `fused` (runtime::fused custom ops) or `slow` (`ENVACE_SLOW_OPS=1`: candle's
    /// differentiable composite ops).
    pub kernels: &'static str,
    /// Peak resident memory of the process (Linux `VmHWM`), MiB.
    pub peak_rss_mb: Option<f64>,
}

/// Named shapes: `tiny-256x6` (the PyTorch comparison: Qwen2 layout, hidden 256, 6
/// layers, vocab 512, 4 heads / 2 KV heads, MLP 768 — 4.98M parameters) and `smollm2-135m`
/// (SmolLM2-135M's Llama shape: hidden 576, 30 layers, 9 / 3 heads, MLP 1536, vocab 49,152, tied).
pub fn shape(name: &str) -> Option<DecoderConfig> {
    let base = |family, vocab, hidden, mlp, layers, heads, kv, tie| DecoderConfig {
        family,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: mlp,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv,
        head_dim: hidden / heads,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 2048,
        tie_word_embeddings: tie,
        qkv_bias: family == Family::Qwen2,
        qk_norm: false,
        rope_interleaved: false,
        bos_token_id: None,
        eos_token_ids: vec![0],
    };
    match name {
        "tiny-256x6" => Some(base(Family::Qwen2, 512, 256, 768, 6, 4, 2, false)),
        "smollm2-135m" => Some(base(Family::Llama, 49_152, 576, 1536, 30, 9, 3, true)),
        _ => None,
    }
}

/// The model to benchmark: a directory (full, or fresh LoRA adapters of rank `lora`) or a named
/// shape with seeded weights (LoRA on a shape goes through a temporary checkpoint).
pub fn load(
    model: Option<&Path>,
    shape_name: Option<&str>,
    lora: Option<usize>,
    seed: u64,
    device: &Device,
) -> Result<(TrainableModel, String, usize), TrainError> {
    let tmp;
    let (dir, label) = match (model, shape_name) {
        (Some(p), _) => (p.to_path_buf(), p.display().to_string()),
        (None, Some(name)) => {
            let cfg = shape(name).ok_or_else(|| {
                TrainError::Data(format!(
                    "unknown shape `{name}` (have: tiny-256x6, smollm2-135m)"
                ))
            })?;
            let m = TrainableModel::init(&cfg, seed, device)?;
            let total = m.trainable_parameters();
            let Some(r) = lora else {
                return Ok((m, name.to_string(), total));
            };
            tmp = tempdir()?;
            let tok = crate::runtime::fixture::byte_level_tokenizer_json(&[]);
            crate::runtime::fixture::write_checkpoint(&tmp, &cfg, &m.weights(), &tok)?;
            let l = TrainableModel::load_lora(&tmp, &LoraConfig::new(r, None, "", seed)?, device)?;
            let _ = std::fs::remove_dir_all(&tmp);
            return Ok((l, name.to_string(), total));
        }
        (None, None) => return Err(TrainError::Data("give --model PATH or --shape NAME".into())),
    };
    let full = TrainableModel::load(&dir, device)?;
    let total = full.trainable_parameters();
    match lora {
        None => Ok((full, label, total)),
        Some(r) => {
            drop(full);
            let m = TrainableModel::load_lora(&dir, &LoraConfig::new(r, None, "", seed)?, device)?;
            Ok((m, label, total))
        }
    }
}

fn tempdir() -> Result<std::path::PathBuf, TrainError> {
    let d = std::env::temp_dir().join(format!("envace-bench-train-{}", std::process::id()));
    std::fs::create_dir_all(&d).map_err(|e| TrainError::Data(format!("{}: {e}", d.display())))?;
    Ok(d)
}

/// Time `cfg.steps` training steps (after one warm-up step).
pub fn run(
    model: &TrainableModel,
    label: &str,
    parameters: usize,
    lora_rank: Option<usize>,
    cfg: &TrainBenchConfig,
) -> Result<TrainBenchResult, TrainError> {
    let vocab = model.decoder.cfg.vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let examples: Vec<Example> = (0..cfg.batch)
        .map(|_| Example {
            ids: (0..cfg.seq).map(|_| rng.random_range(0..vocab)).collect(),
            mask: vec![1.0; cfg.seq],
        })
        .collect();
    let refs: Vec<&Example> = examples.iter().collect();
    let mut opt = AdamW::new(model.named_vars(), AdamWConfig::default())?;
    let (mut times, mut fwd, mut bwd, mut optim) = (vec![], vec![], vec![], vec![]);
    for step in 0..=cfg.steps {
        let t = Instant::now();
        let (t_fwd, t_bwd) = with_spinning_helpers(|| -> Result<_, TrainError> {
            let (loss, _) = masked_nll(&model.decoder, &refs)?;
            let t_fwd = t.elapsed().as_secs_f64();
            let grads = crate::runtime::train_pass::backward(&loss)?;
            let t_bwd = t.elapsed().as_secs_f64();
            // As the trainers do: the gradient norm (clipping, metrics), then the update.
            let _ = opt.grad_norm(&grads)?;
            opt.step(&grads, 1e-4, 1.0)?;
            Ok((t_fwd, t_bwd))
        })?;
        let t_all = t.elapsed().as_secs_f64();
        if step > 0 {
            times.push(t_all);
            fwd.push(t_fwd);
            bwd.push(t_bwd - t_fwd);
            optim.push(t_all - t_bwd);
        }
    }
    let median = median(times);
    Ok(TrainBenchResult {
        model: label.to_string(),
        parameters,
        trainable_parameters: model.trainable_parameters(),
        lora_rank,
        batch: cfg.batch,
        seq: cfg.seq,
        steps: cfg.steps,
        step_s_median: median,
        fwd_s_median: self::median(fwd),
        bwd_s_median: self::median(bwd),
        opt_s_median: self::median(optim),
        tokens_per_s: (cfg.batch * cfg.seq.saturating_sub(1)) as f64 / median,
        kernels: Kernels::current().as_str(),
        peak_rss_mb: peak_rss_mb(),
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_have_the_documented_sizes_and_a_step_runs() {
        let dev = Device::Cpu;
        let (m, _, total) = load(None, Some("tiny-256x6"), None, 0, &dev).unwrap();
        assert!((4_900_000..5_100_000).contains(&total), "{total}");
        let r = run(
            &m,
            "tiny-256x6",
            total,
            None,
            &TrainBenchConfig {
                batch: 2,
                seq: 16,
                steps: 1,
                seed: 0,
            },
        )
        .unwrap();
        assert!(r.tokens_per_s > 0.0 && r.trainable_parameters == total);
        let (l, _, _) = load(None, Some("tiny-256x6"), Some(4), 0, &dev).unwrap();
        assert!(l.trainable_parameters() < total / 20);
        assert!(shape("nope").is_none());
        let smol = shape("smollm2-135m").unwrap();
        assert_eq!(smol.head_dim, 64);
    }
}
