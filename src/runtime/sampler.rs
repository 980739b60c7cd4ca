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
        // Candidates in order of probability, ties by index, so that the result is
        // deterministic; only as far as the walk below needs (sorting a 50k vocabulary every
        // step was a tenth of a real model's decode time).
        let mut sorted = sort_head(&mut cand, 0, SORTED_HEAD);
        if let Some(k) = self.top_k
            && k > 0
            && k < cand.len()
        {
            sorted = sort_head(&mut cand, sorted, k);
            cand.truncate(k);
        }
        if let Some(p) = self.top_p
            && p > 0.0
            && p < 1.0
        {
            let total: f64 = cand.iter().map(|c| c.1).sum();
            let mut acc = 0.0;
            let mut keep = cand.len();
            let mut i = 0;
            while i < cand.len() {
                if i == sorted {
                    sorted = sort_head(&mut cand, sorted, sorted * 4);
                }
                acc += cand[i].1 / total;
                if acc >= p {
                    keep = i + 1;
                    break;
                }
                i += 1;
            }
            cand.truncate(keep);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.random::<f64>() * total;
        let mut i = 0;
        while i < cand.len() {
            if i == sorted {
                sorted = sort_head(&mut cand, sorted, usize::MAX);
            }
            r -= cand[i].1;
            if r <= 0.0 {
                return cand[i].0;
            }
            i += 1;
        }
        sort_head(&mut cand, sorted, usize::MAX);
        cand[cand.len() - 1].0
    }
}

/// Candidates sorted up front; the rest only if the walk gets that far.
const SORTED_HEAD: usize = 64;

/// Descending probability, ties by lower index: a total order, so a partially sorted head is
/// exactly the full sort's head.
fn by_prob(a: &(usize, f64), b: &(usize, f64)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Given `cand[..done]` already sorted and no smaller than the rest, extend the sorted head
/// to `upto` entries; returns the new sorted length.
fn sort_head(cand: &mut [(usize, f64)], done: usize, upto: usize) -> usize {
    let upto = upto.max(done).min(cand.len());
    if upto > done {
        let rest = &mut cand[done..];
        let m = upto - done;
        if m < rest.len() {
            rest.select_nth_unstable_by(m, by_prob);
        }
        rest[..m].sort_by(by_prob);
    }
    upto
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

    /// The partial sort draws exactly what a full sort of the vocabulary would.
    #[test]
    fn partial_sort_draws_like_a_full_sort() {
        fn full(params: &SamplingParams, logits: &[f32], rng: &mut StdRng) -> usize {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut cand: Vec<(usize, f64)> = logits
                .iter()
                .enumerate()
                .map(|(i, &x)| (i, (((x - max) as f64) / params.temperature).exp()))
                .collect();
            cand.sort_by(by_prob);
            if let Some(k) = params.top_k {
                cand.truncate(k);
            }
            let total: f64 = cand.iter().map(|c| c.1).sum();
            if let Some(p) = params.top_p {
                let mut acc = 0.0;
                let keep = cand
                    .iter()
                    .position(|c| {
                        acc += c.1 / total;
                        acc >= p
                    })
                    .map_or(cand.len(), |i| i + 1);
                cand.truncate(keep);
            }
            let total: f64 = cand.iter().map(|c| c.1).sum();
            let mut r = rng.random::<f64>() * total;
            for c in &cand {
                r -= c.1;
                if r <= 0.0 {
                    return c.0;
                }
            }
            cand[cand.len() - 1].0
        }
        // A flat-ish 5,000-token vocabulary with ties, so that walks run past the sorted head.
        let logits: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 613) as f32 * 0.004 - (i % 3) as f32)
            .collect();
        for params in [
            SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
            SamplingParams {
                temperature: 0.7,
                top_k: Some(300),
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.3,
                top_p: Some(0.95),
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(&params, 11);
            let mut rng = StdRng::seed_from_u64(11);
            for _ in 0..200 {
                let got = s.sample_index(&logits);
                let want = full(&params, &logits, &mut rng);
                assert_eq!(got, want, "{params:?}");
            }
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
