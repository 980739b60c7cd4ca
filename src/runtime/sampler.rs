//! Seeded token sampling: greedy, temperature, top-k, top-p. Returns the chosen token and its
//! log-probability under the model's untempered distribution (what RL's ratio needs). Same seed
//! and logits ⇒ same tokens on every run.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::backend::SamplingParams;

/// One sampler per sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
    rng: StdRng,
}

/// log-softmax of one entry.
fn logprob_of(logits: &[f32], idx: usize) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits
        .iter()
        .map(|&x| ((x - max) as f64).exp())
        .sum::<f64>()
        .ln() as f32
        + max;
    logits[idx] - lse
}

impl Sampler {
    pub fn new(params: &SamplingParams, seed: u64) -> Self {
        Self {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            rng: StdRng::seed_from_u64(seed),
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Pick a token; returns (token, logprob).
    pub fn sample(&mut self, logits: &[f32]) -> (u32, f32) {
        if logits.is_empty() {
            return (0, 0.0);
        }
        let idx = if self.is_greedy() {
            argmax(logits)
        } else {
            self.sample_index(logits)
        };
        (idx as u32, logprob_of(logits, idx))
    }

    fn sample_index(&mut self, logits: &[f32]) -> usize {
        let t = self.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut cand: Vec<(usize, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, &x)| (i, (((x - max) as f64) / t).exp()))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        // Sort by probability, ties by index, so that the result is deterministic.
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(k) = self.top_k
            && k > 0
            && k < cand.len()
        {
            cand.truncate(k);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        if let Some(p) = self.top_p
            && p > 0.0
            && p < 1.0
        {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / total;
                if acc >= p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.random::<f64>() * total;
        for c in &cand {
            r -= c.1;
            if r <= 0.0 {
                return c.0;
            }
        }
        cand[cand.len() - 1].0
    }
}

/// Index of the first maximum.
pub fn argmax(xs: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_max_and_reports_logprob() {
        let p = SamplingParams::default();
        let mut s = Sampler::new(&p, 0);
        let (t, lp) = s.sample(&[0.0, 2.0, 2.0, -1.0]);
        assert_eq!(t, 1);
        let z: f32 = [0.0f32, 2.0, 2.0, -1.0].iter().map(|x| x.exp()).sum();
        assert!((lp - (2.0f32.exp() / z).ln()).abs() < 1e-5);
    }

    #[test]
    fn same_seed_same_tokens() {
        let p = SamplingParams {
            temperature: 1.0,
            top_p: Some(0.9),
            top_k: Some(5),
            ..Default::default()
        };
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(&p, seed);
            (0..40).map(|_| s.sample(&logits).0).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let p = SamplingParams {
            temperature: 1.5,
            top_k: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(&p, 3);
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.1, 0.5, 0.3]).0, 1);
        }
    }

    #[test]
    fn top_p_excludes_tail() {
        let p = SamplingParams {
            temperature: 1.0,
            top_p: Some(0.5),
            ..Default::default()
        };
        let mut s = Sampler::new(&p, 1);
        for _ in 0..50 {
            // token 0 has ~88% of the mass: top-p 0.5 keeps only it.
            assert_eq!(s.sample(&[4.0, 2.0, 0.0]).0, 0);
        }
    }
}
