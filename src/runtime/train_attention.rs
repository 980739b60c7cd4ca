//! Causal self-attention for the training pass ([`super::train_pass`]): forward and backward
//! over whole (batch row, kv head) blocks, RoPE and GQA included.
//!
//! Why it exists: the autograd path spends some twenty graph nodes on attention (reshapes,
//! transposes, copies, a scaled score matmul, the mask add, the softmax, a second matmul), each
//! with its own buffers. Here one pass reads q, k and v as they come out of their projections
//! (B, T, heads·d), rotates them, computes the causal softmax and the weighted sum, and writes
//! the output in the layout the output projection reads; the backward recomputes each row's
//! probabilities (T×T per head, cheap next to the projections) instead of storing them. Work is
//! split over (batch row, kv head) blocks, so a block owns its k/v gradients and needs no locks.
//!
//! What it must never do: differ from the autograd path beyond float rounding — `tests/fused.rs`
//! compares whole decoders' gradients with candle's own ops. Right padding only: a causal row
//! never sees later positions, so no pad mask is needed.

use rayon::prelude::*;

use super::fused::{dot, rotate_row as rotate};

// ---------------------------------------------------------------------------------------------
// Causal attention with RoPE and GQA

/// The head layout of [`AttnOp`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// RoPE rotates pairs (2i, 2i+1) instead of (i, i + d/2).
    pub interleaved: bool,
}

/// Causal attention over positions 0..T: q (B, T, heads·d), k and v (B, T, kv_heads·d).
pub(crate) struct AttnOp {
    pub(crate) shape: AttnShape,
    /// cos/sin of positions 0..T, (T, d/2) each, row-major.
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
}

#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Per (batch row, kv head): the rotated k and v of its T positions, and the geometry.
struct Geometry<'a> {
    op: &'a AttnOp,
    t: usize,
    scale: f32,
}

impl Geometry<'_> {
    fn d(&self) -> usize {
        self.op.shape.head_dim
    }

    /// Head `head`'s rows (T, d) of `src` (B, T, width) for batch row `b`, rotated to their
    /// positions when `rope`.
    fn gather(&self, src: &[f32], width: usize, b: usize, head: usize, rope: bool) -> Vec<f32> {
        let (t, d) = (self.t, self.d());
        let half = d / 2;
        let mut out = vec![0f32; t * d];
        for (i, o) in out.chunks_mut(d).enumerate() {
            let at = (b * t + i) * width + head * d;
            let x = &src[at..at + d];
            if rope {
                let c = &self.op.cos[i * half..(i + 1) * half];
                let s = &self.op.sin[i * half..(i + 1) * half];
                rotate(o, x, c, s, self.op.shape.interleaved, 1.0);
            } else {
                o.copy_from_slice(x);
            }
        }
        out
    }

    /// Rotate every row of `x` (T, d) back (the transpose of RoPE).
    fn unrotate(&self, x: &[f32]) -> Vec<f32> {
        let d = self.d();
        let half = d / 2;
        let mut out = vec![0f32; x.len()];
        for (i, (o, x)) in out.chunks_mut(d).zip(x.chunks(d)).enumerate() {
            let c = &self.op.cos[i * half..(i + 1) * half];
            let s = &self.op.sin[i * half..(i + 1) * half];
            rotate(o, x, c, s, self.op.shape.interleaved, -1.0);
        }
        out
    }

    /// Softmax of query row `i` against keys 0..=i into `p[..=i]`.
    fn probs(&self, q: &[f32], kr: &[f32], i: usize, p: &mut [f32]) {
        let d = self.d();
        let mut m = f32::NEG_INFINITY;
        for (j, pj) in p[..=i].iter_mut().enumerate() {
            *pj = dot(q, &kr[j * d..(j + 1) * d]) * self.scale;
            m = m.max(*pj);
        }
        let mut sum = 0f32;
        for pj in p[..=i].iter_mut() {
            *pj = (*pj - m).exp();
            sum += *pj;
        }
        let inv = 1.0 / sum;
        p[..=i].iter_mut().for_each(|pj| *pj *= inv);
    }
}

/// Write `rows` (T, d) of head `head` into `dst` (B, T, width) for batch row `b`.
fn scatter(dst: &mut [f32], width: usize, t: usize, d: usize, b: usize, head: usize, rows: &[f32]) {
    for (i, r) in rows.chunks(d).enumerate() {
        let at = (b * t + i) * width + head * d;
        dst[at..at + d].copy_from_slice(r);
    }
}

impl AttnOp {
    /// (shape, head_dim, query heads per kv head, q row width, k/v row width).
    fn widths(&self) -> (AttnShape, usize, usize, usize, usize) {
        let s = self.shape;
        let d = s.head_dim;
        (s, d, s.heads / s.kv_heads, s.heads * d, s.kv_heads * d)
    }

    fn geometry(&self, t: usize) -> Geometry<'_> {
        Geometry {
            op: self,
            t,
            scale: 1.0 / (self.shape.head_dim as f32).sqrt(),
        }
    }

    /// The whole forward: (B, T, heads·d) from q, k, v laid out as the projections write them.
    pub(crate) fn forward_all(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        b: usize,
        t: usize,
    ) -> Vec<f32> {
        let (s, d, groups, qw, _) = self.widths();
        let parts: Vec<Vec<f32>> = (0..b * s.kv_heads)
            .into_par_iter()
            .map(|task| self.forward_task(q, k, v, task / s.kv_heads, task % s.kv_heads, t))
            .collect();
        let mut out = vec![0f32; b * t * qw];
        for (task, part) in parts.iter().enumerate() {
            let (bi, kvh) = (task / s.kv_heads, task % s.kv_heads);
            for (gi, rows) in part.chunks(t * d).enumerate() {
                scatter(&mut out, qw, t, d, bi, kvh * groups + gi, rows);
            }
        }
        out
    }

    /// The whole backward: (dq, dk, dv) for the gradient `gr` of the output.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_all(
        &self,
        qs: &[f32],
        ks: &[f32],
        vs: &[f32],
        gs: &[f32],
        b: usize,
        t: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (s, d, groups, qw, kw) = self.widths();
        let parts: Vec<_> = (0..b * s.kv_heads)
            .into_par_iter()
            .map(|task| self.backward_task(qs, ks, vs, gs, task / s.kv_heads, task % s.kv_heads, t))
            .collect();
        let mut dq = vec![0f32; b * t * qw];
        let mut dk = vec![0f32; b * t * kw];
        let mut dv = vec![0f32; b * t * kw];
        for (task, (pq, pk, pv)) in parts.iter().enumerate() {
            let (bi, kvh) = (task / s.kv_heads, task % s.kv_heads);
            for (gi, rows) in pq.chunks(t * d).enumerate() {
                scatter(&mut dq, qw, t, d, bi, kvh * groups + gi, rows);
            }
            scatter(&mut dk, kw, t, d, bi, kvh, pk);
            scatter(&mut dv, kw, t, d, bi, kvh, pv);
        }
        (dq, dk, dv)
    }

    /// Forward for one (batch row, kv head): the outputs (groups, T, d) of its query heads.
    fn forward_task(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        b: usize,
        kvh: usize,
        t: usize,
    ) -> Vec<f32> {
        let (_, d, groups, qw, kw) = self.widths();
        let g = self.geometry(t);
        let kr = g.gather(k, kw, b, kvh, true);
        let vt = g.gather(v, kw, b, kvh, false);
        let mut out = vec![0f32; groups * t * d];
        let mut p = vec![0f32; t];
        for (gi, oh) in out.chunks_mut(t * d).enumerate() {
            let qr = g.gather(q, qw, b, kvh * groups + gi, true);
            for (i, o) in oh.chunks_mut(d).enumerate() {
                g.probs(&qr[i * d..(i + 1) * d], &kr, i, &mut p);
                for (j, &pj) in p[..=i].iter().enumerate() {
                    axpy(o, pj, &vt[j * d..(j + 1) * d]);
                }
            }
        }
        out
    }

    /// Backward for one (batch row, kv head): (dq (groups, T, d), dk (T, d), dv (T, d)), with
    /// respect to the unrotated projections.
    #[allow(clippy::too_many_arguments)]
    fn backward_task(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        gr: &[f32],
        b: usize,
        kvh: usize,
        t: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (_, d, groups, qw, kw) = self.widths();
        let g = self.geometry(t);
        let kr = g.gather(k, kw, b, kvh, true);
        let vt = g.gather(v, kw, b, kvh, false);
        let mut dkr = vec![0f32; t * d];
        let mut dv = vec![0f32; t * d];
        let mut dq = Vec::with_capacity(groups * t * d);
        let mut p = vec![0f32; t];
        let mut ds = vec![0f32; t];
        for gi in 0..groups {
            let h = kvh * groups + gi;
            let qr = g.gather(q, qw, b, h, true);
            let go = g.gather(gr, qw, b, h, false);
            let mut dqr = vec![0f32; t * d];
            for i in 0..t {
                let qi = &qr[i * d..(i + 1) * d];
                let goi = &go[i * d..(i + 1) * d];
                g.probs(qi, &kr, i, &mut p);
                let mut sum = 0f32;
                for j in 0..=i {
                    let dp = dot(goi, &vt[j * d..(j + 1) * d]);
                    ds[j] = dp;
                    sum += p[j] * dp;
                }
                let dqi = &mut dqr[i * d..(i + 1) * d];
                for j in 0..=i {
                    let dsj = p[j] * (ds[j] - sum) * g.scale;
                    axpy(dqi, dsj, &kr[j * d..(j + 1) * d]);
                    axpy(&mut dkr[j * d..(j + 1) * d], dsj, qi);
                    axpy(&mut dv[j * d..(j + 1) * d], p[j], goi);
                }
            }
            dq.extend_from_slice(&g.unrotate(&dqr));
        }
        (dq, g.unrotate(&dkr), dv)
    }
}
