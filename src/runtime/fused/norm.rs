//! RMSNorm, y = x / sqrt(mean(x²) + eps) · w: one pass forward, one pass backward (the
//! gradients of x and of the weight).

use super::*;

struct RmsNormOp {
    eps: f32,
}

#[inline]
fn rstd(x: &[f32], eps: f32) -> f32 {
    1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt()
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "envace-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (x, w) = (f32s(s1, l1, name)?, f32s(s2, l2, name)?);
        let d = last_dim(l1, name)?;
        if w.len() != d {
            bail!("{name}: weight has {} elements, rows have {d}", w.len());
        }
        let eps = self.eps;
        let mut out = vec![0f32; x.len()];
        rows1(&mut out, x, d, |o, x| {
            let r = rstd(x, eps);
            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                *o = x * r * w;
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = w.dim(0)?;
        let rows = x.elem_count() / d;
        let packed = x.apply_op3_no_bwd(w, &g.contiguous()?, &RmsNormBwd { eps: self.eps })?;
        let gx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let gw = packed.narrow(0, rows, 1)?.reshape(d)?;
        Ok((tracked(x, gx), tracked(w, gw)))
    }
}

/// Gradients of [`RmsNormOp`] in one pass: rows of dx, then one row of dw (rows + 1, d).
struct RmsNormBwd {
    eps: f32,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "envace-rms-norm-bwd"
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
        let (x, w, g) = (
            f32s(s1, l1, name)?,
            f32s(s2, l2, name)?,
            f32s(s3, l3, name)?,
        );
        let d = w.len();
        if d == 0 || x.len() % d != 0 || g.len() != x.len() {
            bail!("{name}: shapes do not line up");
        }
        let rows = x.len() / d;
        let eps = self.eps;
        let mut out = Vec::with_capacity((rows + 1) * d);
        out.resize(rows * d, 0f32);
        // dx_j = r·(g_j w_j − x̂_j · mean_k(g_k w_k x̂_k)), x̂ = x·r; dw_j = Σ_rows g_j x̂_j.
        // Blocks of rows in parallel, each with its own partial dw, summed in block order (so
        // the result does not depend on the thread count or scheduling).
        let block = min_rows(d) * d;
        let per_block = |(dx, (x, g)): (&mut [f32], (&[f32], &[f32]))| {
            let mut dw = vec![0f32; d];
            let mut gw = vec![0f32; d];
            for ((dx, x), g) in dx.chunks_mut(d).zip(x.chunks(d)).zip(g.chunks(d)) {
                let r = rstd(x, eps);
                for ((gw, &g), &w) in gw.iter_mut().zip(g).zip(w) {
                    *gw = g * w;
                }
                let c = dot(&gw, x) * r / d as f32;
                for (((dx, &gw), &x), (dw, &g)) in dx
                    .iter_mut()
                    .zip(gw.iter())
                    .zip(x)
                    .zip(dw.iter_mut().zip(g))
                {
                    let xh = x * r;
                    *dx = r * (gw - xh * c);
                    *dw += g * xh;
                }
            }
            dw
        };
        let partials: Vec<Vec<f32>> = if x.len() < PAR_MIN_ELEMS {
            out.chunks_mut(block)
                .zip(x.chunks(block).zip(g.chunks(block)))
                .map(per_block)
                .collect()
        } else {
            out.par_chunks_mut(block)
                .zip(x.par_chunks(block).zip(g.par_chunks(block)))
                .map(per_block)
                .collect()
        };
        let mut dw = vec![0f32; d];
        for p in &partials {
            for (a, b) in dw.iter_mut().zip(p) {
                *a += b;
            }
        }
        out.extend_from_slice(&dw);
        Ok((CpuStorage::F32(out), Shape::from((rows + 1, d))))
    }
}

/// RMSNorm over the last dimension with a learned scale, differentiable in `x` and `weight`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    if !fused_for(&[x, weight]) {
        return candle_nn::ops::rms_norm_slow(x, weight, eps);
    }
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNormOp { eps })
}
