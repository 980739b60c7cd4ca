//! The SwiGLU gate, silu(g) · u, in one pass forward and backward.

use super::*;

struct SiluMulOp;

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// σ(x) for eight values through `wide`'s vector `exp` (which gives 0 instead of ∞ above 87.3:
/// its input is capped at 80, where σ is below 2e-35 either way).
#[inline]
pub(crate) fn sigmoid8(x: wide::f32x8) -> wide::f32x8 {
    let one = wide::f32x8::ONE;
    one / (one + (-x).fast_min(wide::f32x8::splat(80.0)).exp())
}

impl CustomOp2 for SiluMulOp {
    fn name(&self) -> &'static str {
        "envace-silu-mul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (g, u) = (f32s(s1, l1, name)?, f32s(s2, l2, name)?);
        if g.len() != u.len() || l1.dims() != l2.dims() {
            bail!("{name}: gate and up differ in shape");
        }
        let d = last_dim(l1, name)?;
        let mut out = vec![0f32; g.len()];
        rows2(&mut out, g, u, d, |o, g, u| {
            let (oc, ot) = o.as_chunks_mut::<8>();
            let (gc, gt) = g.as_chunks::<8>();
            let (uc, ut) = u.as_chunks::<8>();
            for ((o, g), u) in oc.iter_mut().zip(gc).zip(uc) {
                let g = wide::f32x8::from(*g);
                *o = (g * sigmoid8(g) * wide::f32x8::from(*u)).to_array();
            }
            for ((o, &g), &u) in ot.iter_mut().zip(gt).zip(ut) {
                *o = g * sigmoid(g) * u;
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let packed = g.apply_op3_no_bwd(u, &grad.contiguous()?, &SiluMulBwd)?;
        let dg = packed.narrow(0, 0, 1)?.reshape(g.shape())?;
        let du = packed.narrow(0, 1, 1)?.reshape(u.shape())?;
        Ok((tracked(g, dg), tracked(u, du)))
    }
}

/// One chunk of (dg, du), (g, u), grad in [`SiluMulBwd`].
type SiluBwdChunk<'a> = (
    ((&'a mut [f32], &'a mut [f32]), (&'a [f32], &'a [f32])),
    &'a [f32],
);

/// (2, n): d/dg = grad · u · σ(g)(1 + g(1 − σ(g))), d/du = grad · silu(g).
struct SiluMulBwd;

impl CustomOp3 for SiluMulBwd {
    fn name(&self) -> &'static str {
        "envace-silu-mul-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (g, u, gr) = (
            f32s(s1, l1, name)?,
            f32s(s2, l2, name)?,
            f32s(s3, l3, name)?,
        );
        let n = g.len();
        if u.len() != n || gr.len() != n {
            bail!("{name}: shapes do not line up");
        }
        let mut out = vec![0f32; 2 * n];
        let (dg, du) = out.split_at_mut(n);
        let chunk = TASK_ELEMS;
        let work = |(((dg, du), (g, u)), gr): SiluBwdChunk| {
            for ((((dg, du), &g), &u), &gr) in
                dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u).zip(gr)
            {
                let s = sigmoid(g);
                *du = gr * g * s;
                *dg = gr * u * s * (1.0 + g * (1.0 - s));
            }
        };
        if n < PAR_MIN_ELEMS {
            work((((dg, du), (g, u)), gr));
        } else {
            dg.par_chunks_mut(chunk)
                .zip(du.par_chunks_mut(chunk))
                .zip(g.par_chunks(chunk).zip(u.par_chunks(chunk)))
                .zip(gr.par_chunks(chunk))
                .for_each(work);
        }
        Ok((CpuStorage::F32(out), Shape::from((2, n))))
    }
}

/// `silu(gate) · up` (the SwiGLU MLP's gate), differentiable in both.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if !fused_for(&[gate, up]) || gate.dims() != up.dims() {
        return candle_nn::ops::silu(gate)? * up;
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMulOp)
}
