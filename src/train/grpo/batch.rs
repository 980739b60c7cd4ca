//! From a step's episodes to what the loss trains on: one advantage per row (its reward minus
//! the mean reward of its role's rows in the group, no std scaling), the weight a row carries
//! into the policy term (negative advantages scaled, the self-imitation bonus), and
//! micro-batches sized by padded tokens. Pure bookkeeping: no forward pass and no random draw
//! here, so every rule is tested on hand-built rows.

use super::GrpoConfig;
use crate::engine::types::GenRole;
use crate::session::TrainingRow;

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

/// Token counts a step's losses are divided by: the policy term by the tokens of the rows with
/// signal (as without a KL term), the KL and entropy terms by the tokens of every trained row.
#[derive(Debug, Clone, Copy)]
pub(super) struct Norms {
    pub(super) policy: f64,
    pub(super) all: f64,
}

/// End (exclusive) of the micro-batch that starts at `start` in length-sorted `rows`: as many
/// rows as fit `budget` tokens *padded* to the longest of them (at least one). Counting unpadded
/// tokens let 27 short rows share a batch with a 600-token one: 16k padded positions and 10 GB
/// of attention activations.
pub(super) fn micro_batch_end(rows: &[&ScoredRow], start: usize, budget: usize) -> usize {
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
