//! From a step's episodes to what the loss trains on: one advantage per row (its reward minus
//! the mean reward of its role's rows in the group, no std scaling), the weight a row carries
//! into the policy term (negative advantages scaled, the self-imitation bonus), the optional
//! copy mask, the rows that carry signal, micro-batches sized by padded tokens, and a
//! micro-batch laid out as tensors. Pure bookkeeping: no forward pass and no random draw here,
//! so every rule is tested on hand-built rows.

use candle_core::{Device, Tensor};

use super::GrpoConfig;
use crate::engine::types::GenRole;
use crate::runtime::tokenizer::Tokenizer;
use crate::session::TrainingRow;
use crate::train::copymask;
use crate::train::model::{Example, batch_tensors};

/// A row with its advantage.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredRow {
    pub row: TrainingRow,
    pub advantage: f64,
    /// The policy term's token mask when it differs from the row's loss mask
    /// ([`GrpoConfig::mask_copies`]: copied values left out); the KL and entropy terms keep
    /// the loss mask.
    pub policy_mask: Option<Vec<u8>>,
}

impl ScoredRow {
    /// The mask the policy term trains on.
    pub fn policy_mask(&self) -> &[u8] {
        self.policy_mask.as_deref().unwrap_or(&self.row.loss_mask)
    }
}

/// Role-wise advantages for one group (the G episodes of one task): each row's reward minus
/// the mean reward of the rows of the same role in the group. Rehearsal-branch rows (test-time
/// only) are not trained. Unscored episodes count as reward 0.
pub fn role_advantages(group: &[Vec<TrainingRow>]) -> Vec<ScoredRow> {
    let rows: Vec<&TrainingRow> = group
        .iter()
        .flatten()
        .filter(|r| r.branch.is_none())
        .collect();
    let baseline = |role: GenRole| {
        let rs: Vec<f64> = rows
            .iter()
            .filter(|r| r.role == role)
            .map(|r| r.reward.unwrap_or(0.0))
            .collect();
        if rs.is_empty() {
            0.0
        } else {
            rs.iter().sum::<f64>() / rs.len() as f64
        }
    };
    let (ba, bs) = (baseline(GenRole::Actor), baseline(GenRole::Simulator));
    rows.into_iter()
        .map(|r| {
            let b = if r.role == GenRole::Actor { ba } else { bs };
            ScoredRow {
                advantage: r.reward.unwrap_or(0.0) - b,
                row: r.clone(),
                policy_mask: None,
            }
        })
        .collect()
}

/// The advantage a row's tokens carry into the policy loss: negative advantages scaled by
/// [`GrpoConfig::negative_weight`].
pub fn loss_advantage(advantage: f64, negative_weight: f64) -> f64 {
    if advantage < 0.0 {
        advantage * negative_weight
    } else {
        advantage
    }
}

/// The weight a row's tokens carry into the policy loss: its [`loss_advantage`] plus, for rows
/// of successful episodes, the self-imitation bonus [`GrpoConfig::imitation`] × reward.
pub fn row_weight(r: &ScoredRow, cfg: &GrpoConfig) -> f64 {
    loss_advantage(r.advantage, cfg.negative_weight) + cfg.imitation * r.row.reward.unwrap_or(0.0)
}

/// How much of the generated text the copy mask left out of the policy term.
#[derive(Debug, Clone, Copy)]
pub(super) struct CopyMasked {
    /// Fraction of generated tokens left out.
    pub fraction: f64,
    /// Rows whose text did not map onto their tokens (multi-byte characters split across
    /// tokens); they train unmasked.
    pub unmapped_rows: usize,
}

/// A step's rows, scored.
pub(super) struct Scored {
    pub rows: Vec<ScoredRow>,
    /// Set when [`GrpoConfig::mask_copies`] is on.
    pub copy_masked: Option<CopyMasked>,
}

impl Scored {
    /// The rows of every group with their [`role_advantages`], and with their copy masks when
    /// [`GrpoConfig::mask_copies`] is on.
    pub fn new(
        cfg: &GrpoConfig,
        groups: &[Vec<Vec<TrainingRow>>],
        tokenizer: &Tokenizer,
        end_of_turn: Option<u32>,
    ) -> Self {
        let mut rows: Vec<ScoredRow> = groups.iter().flat_map(|g| role_advantages(g)).collect();
        // Fraction of generated tokens the copy mask leaves out of the policy term.
        let mut copy_masked: Option<CopyMasked> = None;
        if cfg.mask_copies {
            // `unmapped`: rows whose text did not map onto their tokens (multi-byte characters
            // split across tokens); they train unmasked, and the metric says how many.
            let (mut kept, mut total, mut unmapped) = (0usize, 0usize, 0usize);
            for r in &mut rows {
                r.policy_mask = copymask::copy_mask(
                    tokenizer,
                    end_of_turn,
                    &r.row.prompt_ids,
                    &r.row.response_ids,
                )
                .map(|m| m.iter().zip(&r.row.loss_mask).map(|(a, b)| a & b).collect());
                unmapped += usize::from(r.policy_mask.is_none());
                total += r.row.loss_mask.iter().filter(|&&m| m == 1).count();
                kept += r.policy_mask().iter().filter(|&&m| m == 1).count();
            }
            copy_masked = Some(CopyMasked {
                fraction: 1.0 - kept as f64 / total.max(1) as f64,
                unmapped_rows: unmapped,
            });
        }
        Self { rows, copy_masked }
    }

    /// The mean reward of `role`'s rows (0 without any).
    pub fn role_mean(&self, role: GenRole) -> f64 {
        let v: Vec<f64> = self
            .rows
            .iter()
            .filter(|r| r.row.role == role)
            .map(|r| r.row.reward.unwrap_or(0.0))
            .collect();
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    }

    /// The mean absolute advantage of the rows.
    pub fn adv_abs_mean(&self) -> f64 {
        let adv: Vec<f64> = self.rows.iter().map(|r| r.advantage).collect();
        adv.iter().map(|a| a.abs()).sum::<f64>() / adv.len().max(1) as f64
    }
}

/// Token counts a step's losses are divided by: the policy term by the tokens of the rows with
/// signal (as without a KL term), the KL and entropy terms by the tokens of every trained row.
#[derive(Debug, Clone, Copy)]
pub(super) struct Norms {
    pub policy: f64,
    pub all: f64,
}

/// The rows a step optimises on, sorted by length, and the token counts its losses are divided
/// by.
pub(super) struct Trained<'a> {
    pub rows: Vec<&'a ScoredRow>,
    pub norms: Norms,
    /// How many of `rows` carry a non-zero [`row_weight`].
    pub with_signal: usize,
}

impl<'a> Trained<'a> {
    /// The rows that carry signal — and, with a KL term, every row: a group whose episodes all
    /// succeeded has no advantage, and only the KL term holds what it does in place while the
    /// other groups' updates move the shared weights. Rows of a role not trained
    /// ([`GrpoConfig::roles`]) and empty responses are left out.
    pub fn select(rows: &'a [ScoredRow], cfg: &GrpoConfig) -> Self {
        let signal = |r: &ScoredRow| row_weight(r, cfg) != 0.0;
        let mut active: Vec<&ScoredRow> = rows
            .iter()
            .filter(|r| {
                (cfg.kl_coef > 0.0 || signal(r))
                    && !r.row.response_ids.is_empty()
                    && cfg.roles.contains(&r.row.role)
            })
            .collect();
        // Similar lengths together: a micro-batch is padded to its longest row.
        active.sort_by_key(|r| r.row.prompt_ids.len() + r.row.response_ids.len());
        let tokens = |r: &&ScoredRow| r.row.loss_mask.iter().map(|&m| f64::from(m)).sum::<f64>();
        let policy_tokens =
            |r: &&ScoredRow| r.policy_mask().iter().map(|&m| f64::from(m)).sum::<f64>();
        let norms = Norms {
            policy: active.iter().filter(|r| signal(r)).map(policy_tokens).sum(),
            all: active.iter().map(tokens).sum(),
        };
        let with_signal = active.iter().filter(|r| signal(r)).count();
        Self {
            rows: active,
            norms,
            with_signal,
        }
    }

    /// The rows cut into consecutive micro-batches of at most `budget` padded tokens each
    /// ([`micro_batch_end`]).
    pub fn micro_batches(&self, budget: usize) -> impl Iterator<Item = &[&'a ScoredRow]> + '_ {
        let mut start = 0;
        std::iter::from_fn(move || {
            (start < self.rows.len()).then(|| {
                let end = micro_batch_end(&self.rows, start, budget);
                let batch = &self.rows[start..end];
                start = end;
                batch
            })
        })
    }
}

/// End (exclusive) of the micro-batch that starts at `start` in length-sorted `rows`: as many
/// rows as fit `budget` tokens *padded* to the longest of them (at least one). Counting unpadded
/// tokens let 27 short rows share a batch with a 600-token one: 16k padded positions and 10 GB
/// of attention activations.
fn micro_batch_end(rows: &[&ScoredRow], start: usize, budget: usize) -> usize {
    let len = |r: &ScoredRow| r.row.prompt_ids.len() + r.row.response_ids.len();
    let mut end = start + 1;
    let mut longest = rows.get(start).map_or(0, |r| len(r));
    while end < rows.len() {
        let l = longest.max(len(rows[end]));
        if (end + 1 - start) * l > budget {
            break;
        }
        longest = l;
        end += 1;
    }
    end.min(rows.len())
}

/// One micro-batch as tensors: ids (B, T); the loss mask and the policy mask, the per-token
/// loss weights and the rollout's log-probs, all (B, T-1) and zero outside generated tokens.
pub(super) struct MicroBatch {
    pub ids: Tensor,
    /// The rows' loss masks (KL, entropy, ratio diagnostics).
    pub mask: Tensor,
    /// The rows' policy masks (the policy term; differs with `mask_copies`).
    pub policy_mask: Tensor,
    /// Each row's [`row_weight`] at its generated tokens.
    pub adv: Tensor,
    /// The rollout's log-probs at the generated tokens.
    pub old: Tensor,
}

impl MicroBatch {
    pub fn new(rows: &[&ScoredRow], cfg: &GrpoConfig, dev: &Device) -> candle_core::Result<Self> {
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
        Ok(Self {
            ids,
            mask,
            policy_mask,
            adv,
            old,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micro_batches_count_padded_tokens() {
        let scored = |n: usize| ScoredRow {
            policy_mask: None,
            row: TrainingRow {
                prompt_ids: vec![1; n - 1],
                ..row(GenRole::Actor, 1.0)
            },
            advantage: 1.0,
        };
        let rows: Vec<ScoredRow> = [10, 10, 10, 40, 100].into_iter().map(scored).collect();
        let refs: Vec<&ScoredRow> = rows.iter().collect();
        // 3 × 10 fit 40; a fourth row of 40 would pad all four to 40 (160 > 100).
        assert_eq!(micro_batch_end(&refs, 0, 100), 3);
        assert_eq!(micro_batch_end(&refs, 3, 100), 4);
        // A row longer than the budget still goes, alone.
        assert_eq!(micro_batch_end(&refs, 4, 50), 5);
        assert_eq!(micro_batch_end(&refs, 0, 1000), 5);
    }

    #[test]
    fn negative_advantages_are_scaled_by_the_negative_weight_only() {
        assert_eq!(loss_advantage(0.75, 0.0), 0.75);
        assert_eq!(loss_advantage(-0.25, 1.0), -0.25);
        assert_eq!(loss_advantage(-0.25, 0.5), -0.125);
        assert_eq!(loss_advantage(-0.25, 0.0), 0.0);
        assert_eq!(loss_advantage(0.0, 2.0), 0.0);
    }

    #[test]
    fn self_imitation_adds_to_successful_rows_only_and_reaches_all_success_groups() {
        use GenRole::{Actor as A, Simulator as S};
        let cfg = GrpoConfig {
            imitation: 0.5,
            negative_weight: 0.5,
            ..GrpoConfig::default()
        };
        // A group that solved the task every time: zero GRPO advantage, but each row of it is
        // reinforced by the imitation weight.
        let solved = role_advantages(&[vec![row(A, 1.0), row(S, 1.0)], vec![row(A, 1.0)]]);
        assert!(solved.iter().all(|r| r.advantage == 0.0));
        assert!(solved.iter().all(|r| row_weight(r, &cfg) == 0.5));
        // A mixed group: actor baseline 1/2. The success row gets 1/2 + 1/2, the failure row
        // −1/2 scaled by the negative weight and no bonus.
        let mixed = role_advantages(&[vec![row(A, 1.0)], vec![row(A, 0.0)]]);
        assert_eq!(row_weight(&mixed[0], &cfg), 1.0);
        assert_eq!(row_weight(&mixed[1], &cfg), -0.25);
        // Off by default: the weight is GRPO's.
        let plain = GrpoConfig::default();
        assert!(solved.iter().all(|r| row_weight(r, &plain) == 0.0));
        assert_eq!(row_weight(&mixed[1], &plain), -0.5);
    }

    fn row(role: GenRole, reward: f64) -> TrainingRow {
        TrainingRow {
            role,
            branch: None,
            prompt_ids: vec![1, 2],
            response_ids: vec![3],
            logprobs: vec![-0.5],
            loss_mask: vec![1],
            reward: Some(reward),
        }
    }

    #[test]
    fn advantages_use_one_baseline_per_role_without_std_scaling() {
        use GenRole::{Actor as A, Simulator as S};
        // Episode 1 (reward 1): 2 actor rows, 1 simulator row. Episode 2 (reward 0): 1 actor
        // row, 3 simulator rows. Actor baseline = (1+1+0)/3 = 2/3; simulator = (1+0+0+0)/4 = 1/4.
        let group = vec![
            vec![row(A, 1.0), row(A, 1.0), row(S, 1.0)],
            vec![row(A, 0.0), row(S, 0.0), row(S, 0.0), row(S, 0.0)],
        ];
        let scored = role_advantages(&group);
        let adv: Vec<(GenRole, f64)> = scored.iter().map(|r| (r.row.role, r.advantage)).collect();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(adv[0].1, 1.0 / 3.0) && close(adv[1].1, 1.0 / 3.0));
        assert!(close(adv[2].1, 0.75));
        assert!(close(adv[3].1, -2.0 / 3.0));
        assert!(adv[4..].iter().all(|(r, a)| *r == S && close(*a, -0.25)));
    }

    #[test]
    fn rehearsal_branch_rows_are_not_trained_and_unscored_counts_as_zero() {
        let mut b = row(GenRole::Actor, 1.0);
        b.branch = Some(0);
        let mut u = row(GenRole::Actor, 0.0);
        u.reward = None;
        let scored = role_advantages(&[vec![b, row(GenRole::Actor, 1.0)], vec![u]]);
        assert_eq!(scored.len(), 2);
        assert!((scored[0].advantage - 0.5).abs() < 1e-12);
        assert!((scored[1].advantage + 0.5).abs() < 1e-12);
    }
}
