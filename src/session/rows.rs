//! Training rows from recorded events: each generation (one actor turn or one simulated tool
//! response) is one row carrying its exact token ids, logprobs and loss mask, with the episode's
//! reward (role-wise GRPO gives both roles' rows the same score). Works on a session file's
//! events or on a rollout's in-memory records alike.

use serde::{Deserialize, Serialize};

use super::format::GenRole;
use super::schema::{EventBody, EventRecord};

/// One generation as a training row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingRow {
    pub role: GenRole,
    /// `Some` for generations inside a Private Rehearsal branch (imagined, test-time only).
    pub branch: Option<usize>,
    pub prompt_ids: Vec<u32>,
    pub response_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub loss_mask: Vec<u8>,
    /// The episode's reward (`None` if the episode was not scored).
    pub reward: Option<f64>,
}

/// Every generation of an episode as a row, with the episode's reward.
pub fn training_rows(events: &[EventRecord]) -> Vec<TrainingRow> {
    let reward = events.iter().rev().find_map(|e| match &e.event {
        EventBody::Reward { reward, .. } => Some(*reward),
        _ => None,
    });
    events
        .iter()
        .filter_map(|e| match &e.event {
            EventBody::Generation(g) => Some(TrainingRow {
                role: g.role,
                branch: g.branch,
                prompt_ids: g.prompt_ids.clone(),
                response_ids: g.response_ids.clone(),
                logprobs: g.logprobs.clone(),
                loss_mask: g.loss_mask.clone(),
                reward,
            }),
            _ => None,
        })
        .collect()
}
