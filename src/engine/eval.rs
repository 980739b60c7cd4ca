//! Aggregate episode outcomes into the summary `envace eval` prints: success rate, mean reward,
//! format error rate, simulator fidelity (when a real environment answered), tokens, time, and
//! for built-in domains the successes per task kind (which decisions a policy gets wrong).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::fidelity::FidelityTable;
use super::fsm::EpisodeOutcome;

/// One evaluation run's summary (serialises to the CLI's JSON object).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalSummary {
    pub tasks: usize,
    /// Share of episodes with reward ≥ 1 (τ²-style all-or-nothing success).
    pub success_rate: f64,
    pub mean_reward: f64,
    /// Share of main-line actor turns with a format failure, over all episodes.
    pub format_error_rate: f64,
    /// Shadow-mode exact-match rate of simulated vs real responses (`None` without any).
    pub sim_exact_match: Option<f64>,
    pub sim_key_f1: Option<f64>,
    /// Episodes that ended without a score (cancelled, model or environment failure).
    pub aborted: usize,
    pub tokens: usize,
    pub seconds: f64,
    pub fidelity: FidelityTable,
    /// Per task kind (`pay_if_enough`, `cheapest`, ...; built-in domains), episodes and
    /// successes: empty where the tasks have no kind.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kinds: BTreeMap<String, KindCount>,
}

/// Episodes of one task kind, and how many succeeded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindCount {
    pub tasks: usize,
    pub successes: usize,
}

impl EvalSummary {
    pub fn from_outcomes(outcomes: &[EpisodeOutcome], seconds: f64) -> Self {
        let n = outcomes.len();
        let ratio = |x: f64, d: usize| if d == 0 { 0.0 } else { x / d as f64 };
        let successes = outcomes.iter().filter(|o| o.reward() >= 1.0).count();
        let reward: f64 = outcomes.iter().map(EpisodeOutcome::reward).sum();
        let turns: usize = outcomes.iter().map(|o| o.stats.actor_turns).sum();
        let failed: usize = outcomes.iter().map(|o| o.stats.actor_turns_failed).sum();
        let mut fidelity = FidelityTable::default();
        for o in outcomes {
            fidelity.merge(&o.stats.fidelity);
        }
        let total = fidelity.total();
        let any = total.calls > 0;
        Self {
            tasks: n,
            success_rate: ratio(successes as f64, n),
            mean_reward: ratio(reward, n),
            format_error_rate: ratio(failed as f64, turns),
            sim_exact_match: any.then(|| total.exact_rate()),
            sim_key_f1: any.then(|| total.mean_key_f1()),
            aborted: outcomes.iter().filter(|o| o.score.is_none()).count(),
            tokens: outcomes.iter().map(|o| o.stats.generated_tokens).sum(),
            seconds,
            fidelity,
            kinds: BTreeMap::new(),
        }
    }

    /// The same summary with successes counted per task kind, from (kind, outcome) pairs: the
    /// episodes of [`Self::from_outcomes`] with their tasks' kinds (an empty kind is not counted).
    pub fn with_kinds<'a>(
        mut self,
        episodes: impl IntoIterator<Item = (&'a str, &'a EpisodeOutcome)>,
    ) -> Self {
        for (kind, o) in episodes {
            if kind.is_empty() {
                continue;
            }
            let c = self.kinds.entry(kind.to_string()).or_default();
            c.tasks += 1;
            c.successes += usize::from(o.reward() >= 1.0);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::fidelity::fidelity;
    use crate::engine::fsm::EpisodeStats;
    use crate::engine::types::{EndReason, ScoredBy};
    use crate::env::{EpisodeTrace, Score};
    use serde_json::json;

    fn outcome(reward: Option<f64>, turns: usize, failed: usize, tokens: usize) -> EpisodeOutcome {
        EpisodeOutcome {
            end: EndReason::Answered,
            score: reward.map(|r| Score {
                reward: r,
                partial: r,
                checklist: vec![],
            }),
            scored_by: reward.map(|_| ScoredBy::Environment),
            trace: EpisodeTrace::default(),
            stats: EpisodeStats {
                actor_turns: turns,
                actor_turns_failed: failed,
                generated_tokens: tokens,
                ..EpisodeStats::default()
            },
        }
    }

    #[test]
    fn summary_averages_over_episodes() {
        let mut a = outcome(Some(1.0), 3, 1, 10);
        a.stats
            .fidelity
            .add("get", &fidelity(Some(&json!({"a": 1})), &json!({"a": 1})));
        let s = EvalSummary::from_outcomes(
            &[a, outcome(Some(0.0), 1, 0, 5), outcome(None, 0, 0, 1)],
            2.0,
        );
        assert_eq!(s.tasks, 3);
        assert!((s.success_rate - 1.0 / 3.0).abs() < 1e-12);
        assert!((s.mean_reward - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(s.format_error_rate, 0.25);
        assert_eq!(s.sim_exact_match, Some(1.0));
        assert_eq!(s.aborted, 1);
        assert_eq!(s.tokens, 16);
    }

    #[test]
    fn successes_are_counted_per_task_kind() {
        let outcomes = [
            outcome(Some(1.0), 1, 0, 1),
            outcome(Some(0.5), 1, 0, 1),
            outcome(Some(1.0), 1, 0, 1),
            outcome(None, 0, 0, 1),
            outcome(Some(1.0), 1, 0, 1),
        ];
        let kinds = ["cheapest", "cheapest", "balance", "balance", ""];
        let s = EvalSummary::from_outcomes(&outcomes, 1.0)
            .with_kinds(kinds.into_iter().zip(outcomes.iter()));
        let count = |tasks, successes| KindCount { tasks, successes };
        assert_eq!(
            s.kinds.len(),
            2,
            "an empty kind is not counted: {:?}",
            s.kinds
        );
        assert_eq!(s.kinds["cheapest"], count(2, 1));
        assert_eq!(s.kinds["balance"], count(2, 1));
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["kinds"]["cheapest"], json!({"tasks": 2, "successes": 1}));
        // Without kinds the key is left out, and an old summary without it still reads.
        let plain = serde_json::to_value(EvalSummary::from_outcomes(&outcomes, 1.0)).unwrap();
        assert!(plain.get("kinds").is_none());
        let back: EvalSummary = serde_json::from_value(plain).unwrap();
        assert!(back.kinds.is_empty());
    }

    #[test]
    fn summary_without_real_answers_has_no_fidelity() {
        let s = EvalSummary::from_outcomes(&[outcome(Some(1.0), 1, 0, 1)], 0.1);
        assert_eq!(s.sim_exact_match, None);
        assert_eq!(s.sim_key_f1, None);
        let empty = EvalSummary::from_outcomes(&[], 0.0);
        assert_eq!(empty.success_rate, 0.0);
    }
}
