//! The optimizer's hot loop: one-pass AdamW on each parameter in place, and the global
//! gradient norm (sum of squares) for clipping.

use super::*;

/// One AdamW step's constants (bias corrections already raised to the step).
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1 − β₁ᵗ and 1 − β₂ᵗ.
    pub bc1: f32,
    pub bc2: f32,
    /// Multiplies the gradient first (clipping, accumulation).
    pub grad_scale: f32,
}

/// One chunk of (param, grad), m, v in [`AdamWOp`].
type AdamWChunk<'a> = (((&'a mut [f32], &'a [f32]), &'a mut [f32]), &'a mut [f32]);

struct AdamWOp<'a> {
    m: RefCell<&'a mut [f32]>,
    v: RefCell<&'a mut [f32]>,
    h: AdamWStep,
}

impl InplaceOp2 for AdamWOp<'_> {
    fn name(&self) -> &'static str {
        "envace-adamw"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let name = self.name();
        let g = f32s(s2, l2, name)?;
        let Some((a, b)) = l1.contiguous_offsets() else {
            bail!("{name}: parameter is not contiguous");
        };
        let p = match s1 {
            CpuStorage::F32(p) => &mut p[a..b],
            _ => bail!("{name}: parameter is not f32"),
        };
        let mut m = self
            .m
            .try_borrow_mut()
            .map_err(|_| candle_core::Error::Msg(format!("{name}: moments in use")))?;
        let mut v = self
            .v
            .try_borrow_mut()
            .map_err(|_| candle_core::Error::Msg(format!("{name}: moments in use")))?;
        if g.len() != p.len() || m.len() != p.len() || v.len() != p.len() {
            bail!("{name}: parameter, gradient and moments differ in size");
        }
        let h = self.h;
        let decay = 1.0 - h.lr * h.weight_decay;
        let (ib1, ib2) = (1.0 / h.bc1, 1.0 / h.bc2);
        let update = |(((p, g), m), v): AdamWChunk| {
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                let g = g * h.grad_scale;
                *m = h.beta1 * *m + (1.0 - h.beta1) * g;
                *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
                let u = (*m * ib1) / ((*v * ib2).sqrt() + h.eps);
                *p = *p * decay - h.lr * u;
            }
        };
        const CHUNK: usize = 1 << 14;
        if p.len() < PAR_MIN_ELEMS {
            update((((p, g), &mut m[..]), &mut v[..]));
        } else {
            p.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .zip(m.par_chunks_mut(CHUNK))
                .zip(v.par_chunks_mut(CHUNK))
                .for_each(update);
        }
        Ok(())
    }
}

/// Whether [`adamw_update`] applies to this parameter and gradient.
pub fn fused_adamw_for(param: &Tensor, grad: &Tensor) -> bool {
    fused_for(&[param, grad]) && param.is_contiguous() && param.dims() == grad.dims()
}

/// AdamW on `param` in place, with its moments `m`, `v` (flat, row-major) updated in the same
/// pass. Only for tensors where [`fused_adamw_for`] holds.
pub fn adamw_update(
    param: &Tensor,
    grad: &Tensor,
    m: &mut [f32],
    v: &mut [f32],
    h: AdamWStep,
) -> Result<()> {
    let op = AdamWOp {
        m: RefCell::new(m),
        v: RefCell::new(v),
        h,
    };
    param.inplace_op2(&grad.contiguous()?, &op)
}

/// Σ x² over a tensor, accumulated in f64 per block (block order fixed: deterministic).
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    if !fused_for(&[t]) {
        let s = t
            .sqr()?
            .sum_all()?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
        return Ok(s as f64);
    }
    let t = t.contiguous()?;
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*s else {
        bail!("sum_squares: not a CPU tensor");
    };
    let x = f32s(cpu, l, "sum_squares")?;
    const CHUNK: usize = 1 << 14;
    let part = |c: &[f32]| dot(c, c) as f64;
    let parts: Vec<f64> = if x.len() < PAR_MIN_ELEMS {
        x.chunks(CHUNK).map(part).collect()
    } else {
        x.par_chunks(CHUNK).map(part).collect()
    };
    Ok(parts.iter().sum())
}

/// Global L2 norm of the gradients of `params` (those without a gradient count as zero).
pub fn grad_norm<'a>(
    grads: &GradStore,
    params: impl IntoIterator<Item = &'a Tensor>,
) -> Result<f64> {
    let mut sq = 0f64;
    for p in params {
        if let Some(g) = grads.get(p) {
            sq += sum_squares(g)?;
        }
    }
    Ok(sq.sqrt())
}
