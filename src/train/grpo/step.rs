//! One optimisation step and what surrounds it: the optimizer over the trainable parameters
//! (frozen patterns, restored on resume), the token-mean clipped surrogate with the optional KL
//! to a frozen copy of the starting policy (k3) and entropy bonus, the optional grounding NLL
//! on shadow-session real responses, gradient accumulation over micro-batches with clipping,
//! the step's metrics, checkpoints, and the collapse stop. The loss sees only the batch
//! ([`super::batch`]); it never plays an episode.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Tensor;
use candle_core::backprop::GradStore;

use super::GrpoConfig;
use super::batch::{MicroBatch, Norms, Scored, ScoredRow, Trained};
use super::config_changes;
use super::rollout::RolloutStats;
use crate::engine::types::GenRole;
use crate::runtime::LocalModel;
use crate::runtime::decoder::Decoder;
use crate::runtime::train_pass::backward;
use crate::train::TrainError;
use crate::train::checkpoint::{self, Loaded, TrainerState};
use crate::train::metrics::{MetricsSink, StepMetrics};
use crate::train::model::{Example, TrainableModel};
use crate::train::optim::{AdamW, AdamWConfig};

/// The optimizer over the model's trainable parameters less the frozen ones, restored from
/// `resume` when given (whose configuration must match), and the step the run starts at.
pub(super) fn optimizer(
    cfg: &GrpoConfig,
    model: &TrainableModel,
    resume: Option<&Loaded>,
    sink: &mut dyn MetricsSink,
) -> Result<(AdamW, usize), TrainError> {
    let all = model.named_vars();
    // A pattern that matches nothing is a typo, not a request to train everything.
    if let Some(f) = cfg
        .frozen
        .iter()
        .find(|f| !all.iter().any(|(name, _)| name.contains(f.as_str())))
    {
        return Err(TrainError::Data(format!(
            "frozen `{f}`: no trainable parameter name contains it (names look like `{}`)",
            all.first().map_or("", |(n, _)| n.as_str())
        )));
    }
    let trainable: Vec<(String, candle_core::Var)> = all
        .into_iter()
        .filter(|(name, _)| !cfg.frozen.iter().any(|f| name.contains(f.as_str())))
        .collect();
    if trainable.is_empty() {
        return Err(TrainError::Data(format!(
            "frozen `{}`: every parameter is frozen, nothing left to train",
            cfg.frozen.join(",")
        )));
    }
    if !cfg.frozen.is_empty() {
        let n: usize = trainable.iter().map(|(_, v)| v.elem_count()).sum();
        sink.log(&format!(
            "frozen: parameters matching {}; {n} left to train",
            cfg.frozen.join(",")
        ));
    }
    let mut opt = AdamW::new(
        trainable,
        AdamWConfig {
            lr: cfg.lr,
            weight_decay: 0.0,
            ..Default::default()
        },
    )?;
    let mut step = 0;
    if let Some(l) = resume {
        let changed = config_changes(&l.state.config, cfg);
        if !changed.is_empty() {
            return Err(TrainError::Checkpoint(format!(
                "{}: resuming with a different configuration ({}) would not continue the run \
                 it saved; pass the flags it started with (`config` in its trainer_state.json) \
                 or start a new run",
                l.dir.display(),
                changed.join(", ")
            )));
        }
        // Steps without reward signal make no optimizer update (and epochs > 1 make several):
        // AdamW's bias correction needs its own count, not the trainer's step.
        let opt_steps = l
            .state
            .rng
            .get("optimizer_steps")
            .and_then(serde_json::Value::as_u64)
            .map_or(l.state.step, |n| n as usize);
        opt.load_state(&l.optimizer, opt_steps)
            .map_err(|m| TrainError::Checkpoint(format!("{}: {m}", l.dir.display())))?;
        step = l.state.step;
    }
    sink.log(&match &model.lora {
        Some(a) => format!(
            "LoRA r={} alpha={} on {}: {} trainable parameters (base frozen)",
            a.r,
            a.lora_alpha,
            a.target_modules.join(","),
            model.trainable_parameters()
        ),
        None => format!(
            "full fine-tuning: {} trainable parameters",
            model.trainable_parameters()
        ),
    });
    Ok((opt, step))
}

/// The grounding rows ([`GrpoConfig::grounding_coef`]) and their lengths, which order their
/// seeded batches.
pub(super) struct Grounding {
    examples: Vec<Example>,
    lengths: Vec<usize>,
}

impl Grounding {
    /// The grounding rows of the configured sessions, reported to `sink` when there are any.
    pub fn load(
        cfg: &GrpoConfig,
        base: &LocalModel,
        sink: &mut dyn MetricsSink,
    ) -> Result<Self, TrainError> {
        let examples = grounding_examples(cfg, base)?;
        if !examples.is_empty() {
            sink.log(&format!(
                "grounding: {} shadow-mode simulator rows (real responses), weight {}",
                examples.len(),
                cfg.grounding_coef
            ));
        }
        let lengths = examples.iter().map(|e| e.ids.len()).collect();
        Ok(Self { examples, lengths })
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// Step `step`'s grounding batch (seeded by step) and the policy's NLL of it: the loss and
    /// the tokens it covers.
    fn nll(
        &self,
        decoder: &Decoder,
        cfg: &GrpoConfig,
        step: usize,
    ) -> candle_core::Result<(Tensor, f64)> {
        let idx = crate::train::sft::batch_indices(
            &self.lengths,
            cfg.grounding_batch.max(1),
            cfg.seed ^ 0x6772_6f75,
            step,
        );
        let batch: Vec<&Example> = idx.iter().map(|&i| &self.examples[i]).collect();
        crate::train::model::masked_nll(decoder, &batch)
    }
}

/// The grounding rows: shadow-mode simulator generations of the configured sessions, relabelled
/// with the real response (see `train::data`). Empty when grounding is off; an error when it is
/// on and the sessions hold no such row.
fn grounding_examples(cfg: &GrpoConfig, base: &LocalModel) -> Result<Vec<Example>, TrainError> {
    if cfg.grounding_coef <= 0.0 {
        return Ok(Vec::new());
    }
    let Some(pattern) = &cfg.grounding_sessions else {
        return Err(TrainError::Data(
            "grounding loss: no sessions given (--grounding-sessions)".into(),
        ));
    };
    let files = crate::train::data::expand_glob(pattern)?;
    let opts = crate::train::data::SessionDataOptions {
        roles: vec![GenRole::Simulator],
        // Only relabelled rows (whose target is the real response) pass.
        min_reward: f64::INFINITY,
    };
    let data = crate::train::data::session_examples(&files, &opts, &base.tokenizer)?;
    if data.examples.is_empty() {
        return Err(TrainError::Data(format!(
            "grounding loss: {pattern} holds no shadow-mode simulator row (record sessions with `--mode shadow`)"
        )));
    }
    Ok(data.examples)
}

/// The KL term's reference: a frozen copy of the policy as the run started.
pub(super) struct Reference {
    pub decoder: Decoder,
    /// The trainable tensors it was copied from, by the policy's names: saved with every
    /// checkpoint ([`checkpoint::REFERENCE_WEIGHTS`]) and put back on resume, so that a resumed
    /// run is held to the same reference as the run it continues (not to the checkpoint's
    /// weights).
    pub weights: HashMap<String, Tensor>,
}

/// The reference for a KL term (`None` without one): the policy as it is now for a new run;
/// for a resumed run, the policy with the checkpoint's saved reference tensors in place of its
/// trainable ones. A checkpoint written before references were saved holds none: the
/// reference is then the checkpoint's weights, and the run says so.
pub(super) fn reference(
    cfg: &GrpoConfig,
    model: &TrainableModel,
    resume: Option<&Loaded>,
    sink: &mut dyn MetricsSink,
) -> Result<Option<Reference>, TrainError> {
    if cfg.kl_coef <= 0.0 {
        return Ok(None);
    }
    let saved = match resume {
        Some(l) => match &l.reference {
            Some(r) => Some((l, r)),
            None => {
                sink.log(&format!(
                    "{}: no {} (written before KL references were saved): the KL term's \
                     reference is this checkpoint's weights, not the run's starting point",
                    l.dir.display(),
                    checkpoint::REFERENCE_WEIGHTS
                ));
                None
            }
        },
        None => None,
    };
    let Some((loaded, saved)) = saved else {
        let weights = model
            .named_vars()
            .into_iter()
            .map(|(k, v)| Ok((k, v.as_tensor().copy()?)))
            .collect::<candle_core::Result<_>>()?;
        return Ok(Some(Reference {
            decoder: deep_copy(&model.decoder)?,
            weights,
        }));
    };
    // Check every tensor first (so that a bad file leaves the policy as it was), then copy
    // the decoder with the saved tensors in the trainable parameters' place and put the
    // checkpoint's values back.
    let corrupt = |message: String| checkpoint::CheckpointError::Corrupt {
        path: loaded
            .dir
            .join(checkpoint::REFERENCE_WEIGHTS)
            .display()
            .to_string(),
        message,
    };
    let vars = model.named_vars();
    let mut swap = Vec::with_capacity(vars.len());
    for (name, var) in &vars {
        let t = saved
            .get(name)
            .ok_or_else(|| corrupt(format!("no tensor `{name}`")))?;
        if t.dims() != var.dims() {
            return Err(corrupt(format!(
                "`{name}` has shape {:?}, the policy's is {:?}",
                t.dims(),
                var.dims()
            ))
            .into());
        }
        swap.push(t.to_device(var.device())?.to_dtype(var.dtype())?);
    }
    let mut now = Vec::with_capacity(vars.len());
    for ((_, var), t) in vars.iter().zip(&swap) {
        now.push(var.as_tensor().copy()?);
        var.set(t)?;
    }
    let decoder = deep_copy(&model.decoder);
    for ((_, var), t) in vars.iter().zip(&now) {
        var.set(t)?;
    }
    Ok(Some(Reference {
        decoder: decoder?,
        weights: saved.clone(),
    }))
}

/// A copy of the starting policy for the KL term.
pub(super) fn deep_copy(d: &Decoder) -> Result<Decoder, TrainError> {
    // Round-trip the weights so that the reference shares no storage with the policy.
    let mut copy = d.clone();
    let cp = |t: &Tensor| -> candle_core::Result<Tensor> { t.copy().map(|t| t.detach()) };
    copy.embed.weight = cp(&d.embed.weight)?;
    copy.norm.weight = cp(&d.norm.weight)?;
    let fix = |l: &mut crate::runtime::decoder::Linear| -> candle_core::Result<()> {
        if let crate::runtime::decoder::Weight::Dense(w) = &l.weight {
            l.weight = crate::runtime::decoder::Weight::Dense(cp(w)?);
        }
        if let Some(b) = &l.bias {
            l.bias = Some(cp(b)?);
        }
        // LoRA: the adapters are the policy's Vars; the reference keeps their starting values.
        if let Some(lora) = l.lora.as_mut() {
            lora.a = cp(&lora.a)?;
            lora.b = cp(&lora.b)?;
        }
        Ok(())
    };
    for l in copy.layers.iter_mut() {
        fix(&mut l.self_attn.q_proj)?;
        fix(&mut l.self_attn.k_proj)?;
        fix(&mut l.self_attn.v_proj)?;
        fix(&mut l.self_attn.o_proj)?;
        fix(&mut l.mlp.gate_proj)?;
        fix(&mut l.mlp.up_proj)?;
        fix(&mut l.mlp.down_proj)?;
        l.input_layernorm.weight = cp(&l.input_layernorm.weight)?;
        l.post_attention_layernorm.weight = cp(&l.post_attention_layernorm.weight)?;
        if let Some(n) = l.self_attn.q_norm.as_mut() {
            n.weight = cp(&n.weight)?;
        }
        if let Some(n) = l.self_attn.k_norm.as_mut() {
            n.weight = cp(&n.weight)?;
        }
    }
    fix(&mut copy.lm_head)?;
    Ok(copy)
}

/// Per-token log-probs (B, T-1) and entropies (B, T-1) under `decoder` in training mode, at
/// the generated positions (`mask`; zero elsewhere).
fn policy_terms(
    decoder: &Decoder,
    ids: &Tensor,
    mask: &Tensor,
    entropy: bool,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    crate::train::model::masked_token_terms(decoder, ids, mask, entropy)
}

/// The loss pieces of one micro-batch, already divided by their [`Norms`].
struct MicroLoss {
    loss: Tensor,
    kl: f64,
    entropy: f64,
    /// Sum over masked tokens of |ratio − 1| (ratio = π/π_rollout), and of tokens clipped.
    ratio_gap: f64,
    clipped: f64,
}

fn micro_loss(
    policy: &Decoder,
    reference: Option<&Decoder>,
    rows: &[&ScoredRow],
    cfg: &GrpoConfig,
    norms: Norms,
) -> candle_core::Result<MicroLoss> {
    let MicroBatch {
        ids,
        mask,
        policy_mask,
        adv,
        old,
    } = MicroBatch::new(rows, cfg, &policy.device)?;
    let (lp, ent) = policy_terms(policy, &ids, &mask, cfg.entropy_coef > 0.0)?;
    let ratio = (&lp - &old)?.exp()?;
    let gap = (ratio.detach() - 1.0)?.abs()?;
    let ratio_gap = (&gap * &mask)?.sum_all()?.to_scalar::<f32>()? as f64;
    let clipped_n = (gap.gt(cfg.clip_eps)?.to_dtype(mask.dtype())? * &mask)?
        .sum_all()?
        .to_scalar::<f32>()? as f64;
    let clipped = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)?;
    let surrogate = (&ratio * &adv)?.minimum(&(clipped * &adv)?)?;
    let mut loss = ((surrogate * &policy_mask)?.sum_all()?.neg()? / norms.policy.max(1.0))?;
    let mut kl_v = 0.0;
    if let Some(reference) = reference
        && cfg.kl_coef > 0.0
    {
        let (ref_lp, _) = policy_terms(reference, &ids, &mask, false)?;
        let d = (ref_lp.detach() - &lp)?;
        let k3 = ((d.exp()? - &d)? - 1.0)?;
        let kl = ((k3 * &mask)?.sum_all()? / norms.all)?;
        kl_v = kl.to_scalar::<f32>()? as f64;
        loss = (loss + (kl * cfg.kl_coef)?)?;
    }
    let mut ent_v = 0.0;
    if let Some(e) = ent {
        let e = ((e * &mask)?.sum_all()? / norms.all)?;
        ent_v = e.to_scalar::<f32>()? as f64;
        loss = (loss - (e * cfg.entropy_coef)?)?;
    }
    Ok(MicroLoss {
        loss,
        kl: kl_v,
        entropy: ent_v,
        ratio_gap,
        clipped: clipped_n,
    })
}

/// `grads` added into `acc`, parameter by parameter.
fn accumulate(
    mut acc: GradStore,
    grads: &GradStore,
    opt: &AdamW,
) -> candle_core::Result<GradStore> {
    for (_, v) in opt.params() {
        if let Some(g) = grads.get(v.as_tensor()) {
            let sum = match acc.get(v.as_tensor()) {
                Some(prev) => (prev + g)?,
                None => g.clone(),
            };
            acc.insert(v.as_tensor(), sum);
        }
    }
    Ok(acc)
}

/// What one step's optimisation measured, summed over its micro-batches and epochs.
#[derive(Debug, Clone, Default)]
pub(super) struct PassStats {
    loss: f64,
    kl: f64,
    entropy: f64,
    /// The gradient norm before clipping, of the last update (0 without one).
    grad_norm: f64,
    /// First-epoch ratio diagnostics: on-policy rows should start at ratio 1.
    ratio_gap: f64,
    clipped: f64,
    trained_tokens: usize,
    grounding_nll: Option<f64>,
}

/// The model being trained and everything its updates need.
pub(super) struct Learner<'a> {
    pub cfg: &'a GrpoConfig,
    pub model: &'a TrainableModel,
    /// A frozen copy of the starting policy for the KL term (`kl_coef > 0`).
    pub reference: Option<Reference>,
    pub grounding: Grounding,
    pub opt: AdamW,
}

impl Learner<'_> {
    /// Optimise on `trained` (and the grounding batch of step `step`) for `epochs` passes, one
    /// optimizer update per pass with the micro-batches' gradients accumulated.
    /// All of it runs with the pool's helpers spinning between kernels
    /// ([`crate::runtime::par::with_spinning_helpers`]).
    pub fn optimise(
        &mut self,
        trained: &Trained<'_>,
        step: usize,
    ) -> Result<PassStats, TrainError> {
        crate::runtime::par::with_spinning_helpers(|| self.optimise_here(trained, step))
    }

    fn optimise_here(
        &mut self,
        trained: &Trained<'_>,
        step: usize,
    ) -> Result<PassStats, TrainError> {
        let cfg = self.cfg;
        let mut pass = PassStats::default();
        // Something to learn from: trained rows with tokens, or a grounding batch.
        let has_work = trained.norms.all > 0.0 || !self.grounding.is_empty();
        if !has_work {
            return Ok(pass);
        }
        for epoch in 0..cfg.epochs.max(1) {
            let mut acc: Option<GradStore> = None;
            if epoch == 0 && !self.grounding.is_empty() {
                let (nll, n) = self.grounding.nll(&self.model.decoder, cfg, step)?;
                pass.grounding_nll = Some(nll.to_scalar::<f32>()? as f64);
                pass.trained_tokens += n as usize;
                acc = Some(backward(&(nll * cfg.grounding_coef)?)?);
            }
            let micro = cfg
                .micro_batch_tokens
                .unwrap_or_else(|| super::micro_batch_tokens_for(&self.model.decoder.cfg));
            for rows in trained.micro_batches(micro) {
                let toks: usize = rows
                    .iter()
                    .map(|r| r.row.prompt_ids.len() + r.row.response_ids.len())
                    .sum();
                let ml = micro_loss(
                    &self.model.decoder,
                    self.reference.as_ref().map(|r| &r.decoder),
                    rows,
                    cfg,
                    trained.norms,
                )?;
                pass.loss += ml.loss.to_scalar::<f32>()? as f64;
                pass.kl += ml.kl;
                pass.entropy += ml.entropy;
                if epoch == 0 {
                    pass.ratio_gap += ml.ratio_gap;
                    pass.clipped += ml.clipped;
                }
                pass.trained_tokens += toks;
                let grads = backward(&ml.loss)?;
                acc = Some(match acc {
                    None => grads,
                    Some(a) => accumulate(a, &grads, &self.opt)?,
                });
            }
            if let Some(grads) = acc {
                let gn = self.opt.grad_norm(&grads)?;
                pass.grad_norm = gn;
                let scale = if cfg.grad_clip > 0.0 && gn > cfg.grad_clip {
                    cfg.grad_clip / gn
                } else {
                    1.0
                };
                self.opt.step(&grads, cfg.lr, scale)?;
            }
        }
        Ok(pass)
    }

    /// Save `checkpoint-{step}` under `out` when [`GrpoConfig::checkpoint_every`] says so.
    pub fn checkpoint(
        &self,
        out: Option<&Path>,
        tokenizer_json: &Path,
        step: usize,
    ) -> Result<(), TrainError> {
        if let Some(dir) = out
            && self.cfg.checkpoint_every > 0
            && step.is_multiple_of(self.cfg.checkpoint_every)
        {
            self.save(
                tokenizer_json,
                &dir.join(format!("checkpoint-{step}")),
                step,
            )?;
        }
        Ok(())
    }

    /// Save the model, the optimizer and the trainer state (step `step`) to `dir`.
    pub fn save(&self, tokenizer_json: &Path, dir: &Path, step: usize) -> Result<(), TrainError> {
        let (cfg, opt) = (self.cfg, &self.opt);
        let state = TrainerState {
            kind: "grpo".into(),
            step,
            total_steps: cfg.steps,
            seed: cfg.seed,
            rng: serde_json::json!({
                "rollout_seeds": "f(seed, step, task index, group index)",
                "task_order": "seeded epoch permutations",
                "optimizer_steps": opt.step,
            }),
            config: serde_json::to_value(cfg).unwrap_or_default(),
            metrics: serde_json::Value::Null,
        };
        let reference = self.reference.as_ref().map(|r| &r.weights);
        checkpoint::save_trainer(dir, self.model, opt, tokenizer_json, reference, &state)?;
        Ok(())
    }
}

/// The metrics of step `step` (counted from 1), which took `secs` seconds.
pub(super) fn step_metrics(
    step: usize,
    played: &RolloutStats,
    scored: &Scored,
    trained: &Trained<'_>,
    pass: &PassStats,
    secs: f64,
) -> StepMetrics {
    let norm = trained.norms.all;
    let mut metrics = StepMetrics::new("grpo", step)
        .with("reward", played.mean_reward())
        .with("reward_actor", scored.role_mean(GenRole::Actor))
        .with("reward_simulator", scored.role_mean(GenRole::Simulator))
        .with("adv_abs_mean", scored.adv_abs_mean())
        .with("rows", scored.rows.len())
        .with("rows_with_signal", trained.with_signal)
        .with("rows_trained", trained.rows.len())
        .with("loss", pass.loss)
        .with("kl", pass.kl)
        .with("entropy", pass.entropy)
        .with("grad_norm", pass.grad_norm)
        .with("ratio_gap", pass.ratio_gap / norm.max(1.0))
        .with("clip_frac", pass.clipped / norm.max(1.0))
        .with("actor_format_error_rate", played.actor_format_error_rate())
        .with("sim_failure_rate", played.sim_failure_rate())
        .with("tokens_per_s", pass.trained_tokens as f64 / secs.max(1e-9))
        .with("seconds", secs);
    if let Some(g) = pass.grounding_nll {
        metrics = metrics.with("grounding_nll", g);
    }
    if let Some(c) = scored.copy_masked {
        metrics = metrics
            .with("copy_masked_frac", c.fraction)
            .with("copy_mask_unmapped_rows", c.unmapped_rows);
    }
    // Simulator fidelity (mean value agreement with the real response): shadow/real only.
    if let Some(f) = played.sim_fidelity() {
        metrics = metrics.with("sim_fidelity", f);
    }
    metrics
}

/// Why the run stops after step `step` (counted from 1), if it does: the reward collapsed over
/// `history` ([`collapsed`]), or the actor's format-error rate passed 0.5 once `step` is past
/// the patience. Off when [`GrpoConfig::collapse_patience`] is 0.
pub(super) fn collapse_stop(
    cfg: &GrpoConfig,
    history: &[f64],
    format_error_rate: f64,
    step: usize,
) -> Option<String> {
    if cfg.collapse_patience == 0 {
        return None;
    }
    if let Some(msg) = collapsed(history, cfg.collapse_patience, cfg.collapse_fraction) {
        return Some(msg);
    }
    (format_error_rate > 0.5 && step > cfg.collapse_patience)
        .then(|| format!("collapse: actor format-error rate {format_error_rate:.2}"))
}

/// Whether the reward collapsed: the mean of the last `patience` steps below `fraction` × the
/// mean of the first `patience` steps (checked once both windows are full and distinct).
pub fn collapsed(history: &[f64], patience: usize, fraction: f64) -> Option<String> {
    let p = patience.max(1);
    if history.len() < 2 * p {
        return None;
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let first = mean(&history[..p]);
    let recent = mean(&history[history.len() - p..]);
    (first > 0.0 && recent < fraction * first).then(|| {
        format!(
            "collapse: mean reward of the last {p} steps {recent:.3} < {fraction:.2} × the first {p} steps' {first:.3}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapse_is_judged_on_windows_not_on_one_unlucky_step() {
        // One group's success more or less: a single 0 after a low start is not a collapse.
        let noisy = [0.0625, 0.0, 0.0, 0.0625, 0.0, 0.0];
        assert_eq!(collapsed(&noisy, 5, 0.25), None);
        let steady = [0.06, 0.0, 0.06, 0.0, 0.06, 0.0, 0.06, 0.0, 0.06, 0.0];
        assert_eq!(collapsed(&steady, 5, 0.25), None);
        let falls = [0.5, 0.4, 0.5, 0.45, 0.5, 0.1, 0.0, 0.05, 0.0, 0.0];
        assert!(collapsed(&falls, 5, 0.25).unwrap().starts_with("collapse"));
        assert_eq!(
            collapsed(&falls[..9], 5, 0.25),
            None,
            "windows not full yet"
        );
    }
}
