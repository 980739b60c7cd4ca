//! Seeded token sampling: greedy, temperature, top-k, top-p. Returns the chosen token and its
//! log-probability under the model's untempered distribution (what RL's ratio needs). Same seed
//! and logits ⇒ same tokens on every run.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wide::f32x8;

use super::backend::SamplingParams;

/// One sampler per sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
    rng: StdRng,
    /// Per-token weights and their chunk sums, reused from draw to draw.
    weights: Vec<f32>,
    sums: Vec<f64>,
}

/// Entries per partial sum of [`exp_weights`] (the draw walks these sums first).
const CHUNK: usize = 64;

/// The largest entry (−∞ for none).
fn max_of(xs: &[f32]) -> f32 {
    let (c, tail) = xs.as_chunks::<8>();
    let m = c.iter().fold(f32x8::splat(f32::NEG_INFINITY), |m, x| {
        m.max(f32x8::from(*x))
    });
    let m = m.to_array().into_iter().fold(f32::NEG_INFINITY, f32::max);
    tail.iter().copied().fold(m, f32::max)
}

/// `w[i] = exp((x[i] − max) · inv_t)` in f32 (vector `exp`, as the attention softmax; a
/// non-finite logit gets weight 0), and the sums of every [`CHUNK`] weights in f64, each in
/// index order. Returns the total.
fn exp_weights(x: &[f32], max: f32, inv_t: f32, w: &mut Vec<f32>, sums: &mut Vec<f64>) -> f64 {
    w.clear();
    w.resize(x.len(), 0.0);
    sums.clear();
    let (m, it) = (f32x8::splat(max), f32x8::splat(inv_t));
    for (xc, wc) in x.chunks(CHUNK).zip(w.chunks_mut(CHUNK)) {
        let (xv, xt) = xc.as_chunks::<8>();
        let (wv, wt) = wc.as_chunks_mut::<8>();
        for (x8, w8) in xv.iter().zip(wv.iter_mut()) {
            let v = f32x8::from(*x8);
            let e = ((v - m) * it).exp();
            // wide's exp is 0 for non-finite input; the mask only documents it.
            *w8 = v.is_finite().blend(e, f32x8::ZERO).to_array();
        }
        for (x1, w1) in xt.iter().zip(wt.iter_mut()) {
            *w1 = exp1(*x1, max, inv_t);
        }
        sums.push(wc.iter().map(|&v| f64::from(v)).sum());
    }
    sums.iter().sum()
}

/// log-softmax of one entry: [`exp_weights`]' total at temperature 1 without storing the
/// weights (the same per-chunk sums, so the same value as a draw's normaliser).
fn logprob_of(logits: &[f32], idx: usize) -> f32 {
    let max = max_of(logits);
    let m = f32x8::splat(max);
    let mut total = 0f64;
    let mut buf = [0f32; CHUNK];
    for xc in logits.chunks(CHUNK) {
        let w = &mut buf[..xc.len()];
        let (xv, xt) = xc.as_chunks::<8>();
        let (wv, wt) = w.as_chunks_mut::<8>();
        for (x8, w8) in xv.iter().zip(wv.iter_mut()) {
            let v = f32x8::from(*x8);
            *w8 = v.is_finite().blend((v - m).exp(), f32x8::ZERO).to_array();
        }
        for (x1, w1) in xt.iter().zip(wt.iter_mut()) {
            *w1 = exp1(*x1, max, 1.0);
        }
        total += w.iter().map(|&v| f64::from(v)).sum::<f64>();
    }
    logits[idx] - (total.ln() as f32 + max)
}

/// One weight of [`exp_weights`]' tail, by the same vector `exp`.
fn exp1(x: f32, max: f32, inv_t: f32) -> f32 {
    if !x.is_finite() {
        return 0.0;
    }
    let mut lane = [f32::NEG_INFINITY; 8];
    lane[0] = (x - max) * inv_t;
    f32x8::from(lane).exp().to_array()[0]
}

impl Sampler {
    pub fn new(params: &SamplingParams, seed: u64) -> Self {
        Self {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            rng: StdRng::seed_from_u64(seed),
            weights: Vec::new(),
            sums: Vec::new(),
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
        if self.is_greedy() {
            let idx = argmax(logits);
            return (idx as u32, logprob_of(logits, idx));
        }
        if self.top_k.is_none() && self.top_p.is_none() {
            return self.sample_plain(logits);
        }
        let idx = self.sample_index(logits);
        (idx as u32, logprob_of(logits, idx))
    }

    /// Temperature alone (rehearsal branches, RL rollouts): one pass of weights, then the draw
    /// walks the chunk sums and one chunk in index order (a fixed order: same seed, same
    /// token). At temperature 1 the weights' total is also the log-probability's normaliser.
    fn sample_plain(&mut self, logits: &[f32]) -> (u32, f32) {
        let max = max_of(logits);
        let inv_t = (1.0 / self.temperature) as f32;
        let total = exp_weights(logits, max, inv_t, &mut self.weights, &mut self.sums);
        if !(total > 0.0 && total.is_finite()) {
            let idx = argmax(logits);
            return (idx as u32, logprob_of(logits, idx));
        }
        let mut r = self.rng.random::<f64>() * total;
        let mut idx = None;
        'walk: for (c, &sum) in self.sums.iter().enumerate() {
            if r > sum {
                r -= sum;
                continue;
            }
            for (i, &w) in self.weights[c * CHUNK..].iter().take(CHUNK).enumerate() {
                r -= f64::from(w);
                if w > 0.0 {
                    idx = Some(c * CHUNK + i);
                    if r <= 0.0 {
                        break 'walk;
                    }
                }
            }
        }
        // Rounding can leave a sliver of `r`: the last token with weight then.
        let idx = idx
            .or_else(|| self.weights.iter().rposition(|&w| w > 0.0))
            .unwrap_or_else(|| argmax(logits));
        let lp = if inv_t == 1.0 {
            logits[idx] - (total.ln() as f32 + max)
        } else {
            logprob_of(logits, idx)
        };
        (idx as u32, lp)
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

    /// Temperature alone: draws in index order over one pass of f32 weights. Their frequencies
    /// follow softmax(x / t), masked (−∞) tokens never come, the reported log-probability is
    /// the untempered log-softmax (f64 reference), and chunk boundaries and the tail of a
    /// vocabulary that is no multiple of 8 change nothing.
    #[test]
    fn plain_temperature_draws_follow_the_softmax() {
        let n = 3_001;
        let mut logits: Vec<f32> = (0..n).map(|i| -8.0 + (i % 17) as f32 * 0.01).collect();
        for (k, i) in [5usize, 63, 64, 1_000, 2_999, 3_000]
            .into_iter()
            .enumerate()
        {
            logits[i] = 2.0 + k as f32 * 0.3;
        }
        for i in (100..n).step_by(7) {
            logits[i] = f32::NEG_INFINITY;
        }
        let t = 0.7;
        let p = SamplingParams {
            temperature: t,
            ..Default::default()
        };
        let want = |l: &[f32], i: usize, t: f64| -> f64 {
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = l.iter().map(|&x| ((f64::from(x - max)) / t).exp()).sum();
            ((f64::from(l[i] - max)) / t).exp() / z
        };
        let mut s = Sampler::new(&p, 5);
        let draws = 20_000;
        let mut count = vec![0usize; n];
        for _ in 0..draws {
            let (i, lp) = s.sample(&logits);
            let i = i as usize;
            count[i] += 1;
            assert!(logits[i].is_finite(), "drew masked token {i}");
            assert!((f64::from(lp) - want(&logits, i, 1.0).ln()).abs() < 1e-5);
        }
        for i in [5usize, 63, 64, 1_000, 2_999, 3_000] {
            let p = want(&logits, i, t);
            let sd = (p * (1.0 - p) / draws as f64).sqrt();
            let f = count[i] as f64 / draws as f64;
            assert!(
                (f - p).abs() < 5.0 * sd + 1e-4,
                "token {i}: {f} drawn vs p {p}"
            );
        }
        // At temperature 1 the normaliser comes from the draw's own weights.
        let mut s = Sampler::new(
            &SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
            9,
        );
        for _ in 0..200 {
            let (i, lp) = s.sample(&logits);
            let w = want(&logits, i as usize, 1.0).ln();
            assert!((f64::from(lp) - w).abs() < 1e-5, "{lp} vs {w}");
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
