//! Softmax over the last dimension (masked entries stay zero) with its one-pass backward.

use super::*;

struct SoftmaxOp;

impl CustomOp1 for SoftmaxOp {
    fn name(&self) -> &'static str {
        "envace-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let x = f32s(s, l, name)?;
        let d = last_dim(l, name)?;
        let mut out = vec![0f32; x.len()];
        rows1(&mut out, x, d, |o, x| {
            let m = max_of(x);
            let mut sum = 0f32;
            for (o, &x) in o.iter_mut().zip(x) {
                *o = (x - m).exp();
                sum += *o;
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|o| *o *= inv);
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, y: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        Ok(tracked(
            x,
            y.apply_op2_no_bwd(&g.contiguous()?, &SoftmaxBwd)?,
        ))
    }
}

/// dx = y ⊙ (g − Σ g⊙y), per row.
struct SoftmaxBwd;

impl CustomOp2 for SoftmaxBwd {
    fn name(&self) -> &'static str {
        "envace-softmax-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (y, g) = (f32s(s1, l1, name)?, f32s(s2, l2, name)?);
        let d = last_dim(l1, name)?;
        if y.len() != g.len() {
            bail!("{name}: gradient shape does not match");
        }
        let mut out = vec![0f32; y.len()];
        rows2(&mut out, y, g, d, |o, y, g| {
            let s = dot(y, g);
            for ((o, &y), &g) in o.iter_mut().zip(y).zip(g) {
                *o = y * (g - s);
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Softmax over the last dimension, differentiable. −inf entries (a causal mask) get 0.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if !fused_for(&[x]) {
        return candle_nn::ops::softmax(x, D::Minus1);
    }
    x.contiguous()?.apply_op1(SoftmaxOp)
}
