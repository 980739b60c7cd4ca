//! One optimisation step's pieces: the token-mean clipped surrogate with the optional KL to a
//! frozen copy of the starting policy (k3) and entropy bonus, the grounding rows for the
//! optional NLL on shadow-session real responses, checkpoints, and the collapse stop. The loss
//! sees only the batch; it never plays an episode.

use std::path::Path;

use candle_core::Tensor;

use super::GrpoConfig;
use super::batch::{Norms, ScoredRow, row_weight};
use crate::engine::types::GenRole;
use crate::runtime::LocalModel;
use crate::runtime::decoder::Decoder;
use crate::train::TrainError;
use crate::train::checkpoint::{self, TrainerState};
use crate::train::model::{Example, TrainableModel, batch_tensors};
use crate::train::optim::AdamW;

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
pub(super) struct MicroLoss {
    pub(super) loss: Tensor,
    pub(super) kl: f64,
    pub(super) entropy: f64,
    /// Sum over masked tokens of |ratio − 1| (ratio = π/π_rollout), and of tokens clipped.
    pub(super) ratio_gap: f64,
    pub(super) clipped: f64,
}

pub(super) fn micro_loss(
    policy: &Decoder,
    reference: Option<&Decoder>,
    rows: &[&ScoredRow],
    cfg: &GrpoConfig,
    norms: Norms,
) -> candle_core::Result<MicroLoss> {
    let dev = &policy.device;
    // Ids and a token mask laid out for the batch: the row's loss mask (KL, entropy, ratio
    // diagnostics) or its policy mask (the policy term; differs with `mask_copies`).
    let layout = |mask_of: fn(&ScoredRow) -> &[u8]| {
        let examples: Vec<Example> = rows
            .iter()
            .map(|r| {
                let mut ids = r.row.prompt_ids.clone();
                ids.extend_from_slice(&r.row.response_ids);
                let mut mask = vec![0.0; r.row.prompt_ids.len()];
                mask.extend(mask_of(r).iter().map(|&m| f32::from(m)));
                Example { ids, mask }
            })
            .collect();
        let refs: Vec<&Example> = examples.iter().collect();
        batch_tensors(&refs, dev)
    };
    let (ids, mask) = layout(|r| &r.row.loss_mask)?;
    let policy_mask = if rows.iter().any(|r| r.policy_mask.is_some()) {
        layout(ScoredRow::policy_mask)?.1
    } else {
        mask.clone()
    };
    let (b, t1) = mask.dims2()?;
    // Advantages and rollout logprobs laid out like the mask.
    let mut adv = vec![0f32; b * t1];
    let mut old = vec![0f32; b * t1];
    for (i, r) in rows.iter().enumerate() {
        let p = r.row.prompt_ids.len();
        let weighted = row_weight(r, cfg) as f32;
        for (k, lp) in r.row.logprobs.iter().enumerate() {
            let pos = p + k; // predicting ids[pos] from position pos-1
            if pos >= 1 && pos - 1 < t1 {
                adv[i * t1 + pos - 1] = weighted;
                old[i * t1 + pos - 1] = *lp;
            }
        }
    }
    let adv = Tensor::from_vec(adv, (b, t1), dev)?;
    let old = Tensor::from_vec(old, (b, t1), dev)?;
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

/// The grounding rows: shadow-mode simulator generations of the configured sessions, relabelled
/// with the real response (see `train::data`). Empty when grounding is off; an error when it is
/// on and the sessions hold no such row.
pub(super) fn grounding_examples(
    cfg: &GrpoConfig,
    base: &LocalModel,
) -> Result<Vec<Example>, TrainError> {
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

pub(super) fn save(
    model: &TrainableModel,
    opt: &AdamW,
    cfg: &GrpoConfig,
    tokenizer_json: &Path,
    dir: &Path,
    step: usize,
) -> Result<(), TrainError> {
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
    checkpoint::save_trainer(dir, model, opt, tokenizer_json, &state)?;
    Ok(())
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
