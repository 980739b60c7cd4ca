//! Token log-probabilities (log_softmax + gather) and the entropy, straight from the logits in
//! one pass: the vocabulary-wide softmax is never materialised as a tensor.

use super::*;

/// Per row of logits (N, V) and a target id: (N, 3) = [log p(target), logsumexp, entropy].
struct TokenLogprobOp;

impl CustomOp2 for TokenLogprobOp {
    fn name(&self) -> &'static str {
        "envace-token-logprob"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (x, t) = (f32s(s1, l1, name)?, u32s(s2, l2, name)?);
        let out = token_stats(x, last_dim(l1, name)?, t, name)?;
        let n = out.len() / 3;
        Ok((CpuStorage::F32(out), Shape::from((n, 3))))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let op = TokenLogprobBwd {
            stats: res.flatten_all()?.to_vec1::<f32>()?,
            grads: g.flatten_all()?.to_vec1::<f32>()?,
        };
        Ok((
            tracked(logits, logits.apply_op2_no_bwd(targets, &op)?),
            None,
        ))
    }
}

/// d/dx of g_lp · log p(t) + g_H · H: g_lp (δ_jt − p_j) − g_H p_j (log p_j + H).
struct TokenLogprobBwd {
    stats: Vec<f32>,
    grads: Vec<f32>,
}

impl CustomOp2 for TokenLogprobBwd {
    fn name(&self) -> &'static str {
        "envace-token-logprob-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (x, t) = (f32s(s1, l1, name)?, u32s(s2, l2, name)?);
        let v = last_dim(l1, name)?;
        let n = x.len() / v;
        if t.len() != n || self.stats.len() != n * 3 || self.grads.len() != n * 3 {
            bail!("{name}: shapes do not line up");
        }
        let mut out = x.to_vec();
        logprob_grads_in_place(&mut out, v, t, &self.stats, &self.grads);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// (Σ e, Σ e·(x − m)) with e = exp(x − m), eight lanes at a time through `wide`'s vector `exp`
/// (finite logits ≤ m: its argument is ≤ 0, where it matches `f32::exp` to a few ulp).
fn exp_sums(x: &[f32], m: f32) -> (f32, f32) {
    use wide::f32x8;
    let (xv, tail) = x.as_chunks::<8>();
    let mv = f32x8::splat(m);
    let (mut s8, mut sx8) = (f32x8::ZERO, f32x8::ZERO);
    for x8 in xv {
        let d = f32x8::from(*x8) - mv;
        let e = d.exp();
        s8 += e;
        sx8 = e.mul_add(d, sx8);
    }
    let (mut s, mut sx) = (s8.reduce_add(), sx8.reduce_add());
    for &x in tail {
        let e = (x - m).exp();
        s += e;
        sx += e * (x - m);
    }
    (s, sx)
}

/// One row's target, stats and output gradients in [`logprob_grads_in_place`].
type GradRowArgs<'a> = (&'a u32, (&'a [f32], &'a [f32]));

/// Rows of logits `x` (`v` wide) and one target per row: (rows × 3) = `[log p(target),
/// logsumexp, entropy]` per row, rows in parallel when there are enough. Errors (prefixed with
/// `what`) when the targets do not match the rows or one is outside the vocabulary.
pub(crate) fn token_stats(x: &[f32], v: usize, targets: &[u32], what: &str) -> Result<Vec<f32>> {
    let n = x.len() / v.max(1);
    if targets.len() != n || n * v != x.len() {
        bail!(
            "{what}: {} targets for {n} rows of {v} logits",
            targets.len()
        );
    }
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= v) {
        bail!("{what}: target {bad} out of range for vocabulary {v}");
    }
    let mut out = vec![0f32; n * 3];
    let row = |(o, (x, &t)): (&mut [f32], (&[f32], &u32))| {
        o.copy_from_slice(&token_stats_row(x, t as usize));
    };
    if x.len() < PAR_MIN_ELEMS {
        out.chunks_mut(3)
            .zip(x.chunks(v).zip(targets.iter()))
            .for_each(row);
    } else {
        out.par_chunks_mut(3)
            .zip(x.par_chunks(v).zip(targets.par_iter()))
            .with_min_len(min_rows(v))
            .for_each(row);
    }
    Ok(out)
}

/// `[log p(t), logsumexp, entropy]` of one row of logits `x` and its target `t < x.len()`.
fn token_stats_row(x: &[f32], t: usize) -> [f32; 3] {
    let m = max_of(x);
    let (s, sx) = exp_sums(x, m);
    let lse = m + s.ln();
    // H = −Σ p (x − lse) = lse − m − Σ e (x − m) / Σ e
    [x[t] - lse, lse, lse - m - sx / s]
}

/// Turn rows of logits (`v` wide) into their gradients, in place: row i's logits become
/// d/dx of `g_lp · log p(t) + g_H · H` for its `stats[3i..]` (from [`token_stats_row`]) and
/// output gradients `grads[3i..]` (entries 0 and 2 are read), i.e.
/// `g_lp (δ_jt − p_j) − g_H p_j (log p_j + H)`. Rows run in parallel when there are enough.
pub(crate) fn logprob_grads_in_place(
    x: &mut [f32],
    v: usize,
    targets: &[u32],
    stats: &[f32],
    grads: &[f32],
) {
    let row = |(x, (&t, (st, gr))): (&mut [f32], GradRowArgs)| {
        let (lse, ent) = (st[1], st[2]);
        let (g_lp, g_ent) = (gr[0], gr[2]);
        softmax_grad_row_in_place(x, lse, ent, g_lp, g_ent);
        if let Some(o) = x.get_mut(t as usize) {
            *o += g_lp;
        }
    };
    let per_row = targets.iter().zip(stats.chunks(3).zip(grads.chunks(3)));
    if x.len() < PAR_MIN_ELEMS {
        x.chunks_mut(v).zip(per_row).for_each(row);
    } else {
        x.par_chunks_mut(v)
            .zip(
                targets
                    .par_iter()
                    .zip(stats.par_chunks(3).zip(grads.par_chunks(3))),
            )
            .with_min_len(min_rows(v))
            .for_each(row);
    }
}

/// One row of [`logprob_grads_in_place`] before the target's `+ g_lp`: each logit x becomes
/// `−g_lp·p − g_H·p·(log p + H)` with p = exp(x − lse), eight lanes at a time.
fn softmax_grad_row_in_place(x: &mut [f32], lse: f32, ent: f32, g_lp: f32, g_ent: f32) {
    use wide::f32x8;
    let (xv, xt) = x.as_chunks_mut::<8>();
    let (l, h) = (f32x8::splat(lse), f32x8::splat(ent));
    let (a, b) = (f32x8::splat(-g_lp), f32x8::splat(-g_ent));
    if g_ent == 0.0 {
        for x8 in xv {
            *x8 = (a * (f32x8::from(*x8) - l).exp()).to_array();
        }
    } else {
        for x8 in xv {
            let lp = f32x8::from(*x8) - l;
            let p = lp.exp();
            *x8 = (a * p + b * p * (lp + h)).to_array();
        }
    }
    for x in xt {
        let lp = *x - lse;
        let p = lp.exp();
        *x = -g_lp * p - g_ent * p * (lp + ent);
    }
}

/// Whether the fused token-logprob op applies (f32 logits, u32 targets, CPU).
fn fused_logprob_for(logits: &Tensor, targets: &Tensor) -> bool {
    fused_for(&[logits]) && targets.dtype() == DType::U32 && targets.device().is_cpu()
}

/// The slow path: `log_softmax` then `gather` (and the entropy from the full log-softmax).
fn token_logprobs_slow(
    logits: &Tensor,
    targets: &Tensor,
    entropy: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let lsm = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let lp = lsm
        .gather(&targets.contiguous()?.unsqueeze(D::Minus1)?, D::Minus1)?
        .squeeze(D::Minus1)?;
    let ent = if entropy {
        Some((lsm.exp()? * &lsm)?.sum(D::Minus1)?.neg()?)
    } else {
        None
    };
    Ok((lp, ent))
}

/// `log softmax(logits)[target]` per position: logits (…, V), targets (…) → (…), differentiable
/// in the logits.
pub fn token_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    Ok(token_logprobs_entropy(logits, targets, false)?.0)
}

/// [`token_logprobs`] and, when `entropy`, the entropy of each position's distribution, both
/// from one pass over the logits (and one backward pass).
pub fn token_logprobs_entropy(
    logits: &Tensor,
    targets: &Tensor,
    entropy: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    if !fused_logprob_for(logits, targets) {
        return token_logprobs_slow(logits, targets, entropy);
    }
    let dims = logits.dims();
    let v = logits.dim(D::Minus1)?;
    let lead = dims[..dims.len() - 1].to_vec();
    let n: usize = lead.iter().product();
    if targets.dims() != lead.as_slice() {
        bail!(
            "token_logprobs: targets {:?} do not match logits {:?}",
            targets.dims(),
            dims
        );
    }
    let packed = logits
        .contiguous()?
        .reshape((n, v))?
        .apply_op2(&targets.contiguous()?.reshape(n)?, TokenLogprobOp)?;
    let lp = packed.narrow(1, 0, 1)?.reshape(lead.as_slice())?;
    let ent = if entropy {
        Some(packed.narrow(1, 2, 1)?.reshape(lead.as_slice())?)
    } else {
        None
    };
    Ok((lp, ent))
}
