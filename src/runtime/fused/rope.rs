//! Rotary position embedding as one op: rotates pairs of each head's row by position angles
//! (half-split or interleaved pairs); its backward is the opposite rotation.

use super::*;

/// Rotate one head row `x` (d values) of a position with that position's `c`/`s` (d/2 each)
/// into `o`: pairs (2i, 2i+1) when `interleaved`, else (i, i + d/2); `sign` −1 rotates back (the
/// backward of a rotation is its transpose).
#[inline]
pub(crate) fn rotate_row(
    o: &mut [f32],
    x: &[f32],
    c: &[f32],
    s: &[f32],
    interleaved: bool,
    sign: f32,
) {
    let h = x.len() / 2;
    if interleaved {
        for (((o, x), &c), &s) in o.chunks_exact_mut(2).zip(x.chunks_exact(2)).zip(c).zip(s) {
            let s = s * sign;
            o[0] = x[0] * c - x[1] * s;
            o[1] = x[0] * s + x[1] * c;
        }
    } else {
        let (o0, o1) = o.split_at_mut(h);
        let (x0, x1) = x.split_at(h);
        for i in 0..h {
            let s = s[i] * sign;
            o0[i] = x0[i] * c[i] - x1[i] * s;
            o1[i] = x1[i] * c[i] + x0[i] * s;
        }
    }
}

struct RopeOp {
    interleaved: bool,
    /// Rotate by −θ: the backward of a rotation is its transpose.
    inverse: bool,
}

impl CustomOp3 for RopeOp {
    fn name(&self) -> &'static str {
        "envace-rope"
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
        let (x, cos, sin) = (
            f32s(s1, l1, name)?,
            f32s(s2, l2, name)?,
            f32s(s3, l3, name)?,
        );
        let (_, _, l, d) = l1.shape().dims4()?;
        let h = d / 2;
        if d % 2 != 0 || cos.len() != l * h || sin.len() != l * h {
            bail!(
                "{name}: x {:?} does not match cos/sin ({l}, {h})",
                l1.dims()
            );
        }
        let sign = if self.inverse { -1f32 } else { 1f32 };
        let interleaved = self.interleaved;
        let mut out = vec![0f32; x.len()];
        let rotate = |o: &mut [f32], x: &[f32]| {
            // One (batch, head) block: l rows of d.
            for (t, (o, x)) in o.chunks_mut(d).zip(x.chunks(d)).enumerate() {
                let c = &cos[t * h..(t + 1) * h];
                let s = &sin[t * h..(t + 1) * h];
                rotate_row(o, x, c, s, interleaved, sign);
            }
        };
        rows1(&mut out, x, l * d, rotate);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let gx = g.contiguous()?.apply_op3_no_bwd(
            cos,
            sin,
            &RopeOp {
                interleaved: self.interleaved,
                inverse: !self.inverse,
            },
        )?;
        Ok((tracked(x, gx), None, None))
    }
}

/// RoPE on `x` (b, h, l, d) with `cos`/`sin` (l, d/2) (constants: no gradient), differentiable
/// in `x`. `interleaved` rotates pairs (2i, 2i+1) (`rope_i`), else (i, i+d/2) (`rope`).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Tensor> {
    if !fused_for(&[x, cos, sin]) {
        return if interleaved {
            candle_nn::rotary_emb::rope_i_slow(x, cos, sin)
        } else {
            candle_nn::rotary_emb::rope_slow(x, cos, sin)
        };
    }
    x.contiguous()?.apply_op3(
        &cos.contiguous()?,
        &sin.contiguous()?,
        RopeOp {
            interleaved,
            inverse: false,
        },
    )
}
