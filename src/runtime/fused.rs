//! Fused CPU kernels for the training pass, each a candle custom op with its own backward.
//!
//! Why it exists: candle's differentiable "slow" ops (`rms_norm_slow`, `rope_slow`,
//! `softmax`, `log_softmax` + `gather`) build every normalisation, rotation and softmax out of
//! five to fifteen small tensor ops, each allocating its output and recording its own backward;
//! on the small models this project trains that overhead, not the matmuls, dominated a training
//! step. Here each of those is one pass over contiguous f32 rows forward and one pass backward
//! (rows in parallel on rayon), plus a one-pass AdamW update and gradient norm.
//!
//! What it must never do: change results beyond float rounding (tests compare every op and a
//! whole decoder's gradients against the slow path), or run on anything but contiguous f32 CPU
//! tensors — other dtypes and devices take the slow ops. [`Kernels::Slow`] (or
//! `ENVACE_SLOW_OPS=1`) selects the slow ops everywhere, for A/B runs and parity tests.

use std::cell::{Cell, RefCell};
use std::sync::OnceLock;

use candle_core::backprop::GradStore;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, D, DType, InplaceOp2, Layout, Shape, Storage,
    Tensor, bail,
};
use rayon::prelude::*;

type Result<T> = candle_core::Result<T>;

/// Which implementation the training-pass ops use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernels {
    /// This module's fused custom ops (f32 on CPU; anything else falls back to `Slow`).
    Fused,
    /// candle's differentiable composite ops.
    Slow,
}

thread_local! {
    static OVERRIDE: Cell<Option<Kernels>> = const { Cell::new(None) };
}

impl Kernels {
    /// `ENVACE_SLOW_OPS=1` (any value but empty or `0`) selects [`Kernels::Slow`]; read once.
    pub fn from_env() -> Self {
        static ENV: OnceLock<Kernels> = OnceLock::new();
        *ENV.get_or_init(|| match std::env::var("ENVACE_SLOW_OPS") {
            Ok(v) if !v.is_empty() && v != "0" => Kernels::Slow,
            _ => Kernels::Fused,
        })
    }

    /// The kernels in effect on this thread: a [`with_kernels`] override, else the environment.
    pub fn current() -> Self {
        OVERRIDE.with(Cell::get).unwrap_or_else(Self::from_env)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kernels::Fused => "fused",
            Kernels::Slow => "slow",
        }
    }
}

/// Run `f` with `k` as this thread's kernels (restored afterwards, also on panic). Ops record
/// their backward when built, so a loss built inside `f` keeps its kernels for `backward()`.
pub fn with_kernels<R>(k: Kernels, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Kernels>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(k))));
    f()
}

/// Whether the fused kernels apply to these tensors: selected, f32, on the CPU.
fn fused_for(ts: &[&Tensor]) -> bool {
    Kernels::current() == Kernels::Fused
        && ts
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.device().is_cpu())
}

// ---------------------------------------------------------------------------------------------
// Slice helpers

/// Below this many elements a kernel stays on the calling thread (rayon's hand-off costs more).
const PAR_MIN_ELEMS: usize = 1 << 14;
/// Rows handed to one rayon task at least (roughly this many elements per task).
const TASK_ELEMS: usize = 1 << 12;

fn min_rows(d: usize) -> usize {
    (TASK_ELEMS / d.max(1)).max(1)
}

/// The contiguous f32 data behind a custom op's input.
pub(crate) fn f32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!("{op}: input is not contiguous"),
    }
}

fn u32s<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [u32]> {
    let data = s.as_slice::<u32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => bail!("{op}: input is not contiguous"),
    }
}

fn last_dim(l: &Layout, op: &str) -> Result<usize> {
    match l.dims().last() {
        Some(&d) if d > 0 => Ok(d),
        _ => bail!("{op}: needs a non-empty last dimension"),
    }
}

/// Apply `f(out_row, in_row)` to every row of width `d`, in parallel when it pays.
fn rows1<F>(out: &mut [f32], a: &[f32], d: usize, f: F)
where
    F: Fn(&mut [f32], &[f32]) + Sync + Send,
{
    if out.len() < PAR_MIN_ELEMS {
        out.chunks_mut(d)
            .zip(a.chunks(d))
            .for_each(|(o, a)| f(o, a));
    } else {
        out.par_chunks_mut(d)
            .zip(a.par_chunks(d))
            .with_min_len(min_rows(d))
            .for_each(|(o, a)| f(o, a));
    }
}

/// [`rows1`] with two inputs of the same width.
fn rows2<F>(out: &mut [f32], a: &[f32], b: &[f32], d: usize, f: F)
where
    F: Fn(&mut [f32], &[f32], &[f32]) + Sync + Send,
{
    if out.len() < PAR_MIN_ELEMS {
        out.chunks_mut(d)
            .zip(a.chunks(d))
            .zip(b.chunks(d))
            .for_each(|((o, a), b)| f(o, a, b));
    } else {
        out.par_chunks_mut(d)
            .zip(a.par_chunks(d))
            .zip(b.par_chunks(d))
            .with_min_len(min_rows(d))
            .for_each(|((o, a), b)| f(o, a, b));
    }
}

/// Σ aᵢbᵢ with eight independent accumulators (so that it vectorises).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// A gradient for `arg` only if it takes part in autograd: candle stores whatever a custom
/// op's backward returns, and a frozen tensor (a LoRA base weight) must receive none.
fn tracked(arg: &Tensor, grad: Tensor) -> Option<Tensor> {
    arg.track_op().then_some(grad)
}

#[inline]
fn max_of(a: &[f32]) -> f32 {
    a.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: y = x / sqrt(mean(x²) + eps) · w

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

// ---------------------------------------------------------------------------------------------
// RoPE: rotate pairs (i, i + d/2) (`interleaved: false`) or (2i, 2i + 1) by position angles.

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

// ---------------------------------------------------------------------------------------------
// Softmax over the last dimension

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

// ---------------------------------------------------------------------------------------------
// SwiGLU gate: silu(g) · u

struct SiluMulOp;

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
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
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
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

// ---------------------------------------------------------------------------------------------
// Token log-probabilities (log_softmax + gather) and entropy in one pass

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
        let v = last_dim(l1, name)?;
        let n = x.len() / v;
        if t.len() != n {
            bail!("{name}: {} targets for {n} rows", t.len());
        }
        if let Some(&bad) = t.iter().find(|&&t| t as usize >= v) {
            bail!("{name}: target {bad} out of range for vocabulary {v}");
        }
        let mut out = vec![0f32; n * 3];
        let row = |(o, (x, &t)): (&mut [f32], (&[f32], &u32))| {
            let m = max_of(x);
            let (mut s, mut sx) = (0f32, 0f32);
            for &x in x {
                let e = (x - m).exp();
                s += e;
                sx += e * (x - m);
            }
            let lse = m + s.ln();
            o[0] = x[t as usize] - lse;
            o[1] = lse;
            // H = −Σ p (x − lse) = lse − m − Σ e (x − m) / Σ e
            o[2] = lse - m - sx / s;
        };
        if x.len() < PAR_MIN_ELEMS {
            out.chunks_mut(3)
                .zip(x.chunks(v).zip(t.iter()))
                .for_each(row);
        } else {
            out.par_chunks_mut(3)
                .zip(x.par_chunks(v).zip(t.par_iter()))
                .with_min_len(min_rows(v))
                .for_each(row);
        }
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

/// One row's inputs in [`TokenLogprobBwd`]: (logits, target), (stats, output grads).
type LogprobBwdRow<'a> = ((&'a [f32], &'a u32), (&'a [f32], &'a [f32]));

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
        let mut out = vec![0f32; x.len()];
        let row = |(o, ((x, &t), (st, gr))): (&mut [f32], LogprobBwdRow)| {
            let (lse, ent) = (st[1], st[2]);
            let (g_lp, g_ent) = (gr[0], gr[2]);
            if g_ent == 0.0 {
                for (o, &x) in o.iter_mut().zip(x) {
                    *o = -g_lp * (x - lse).exp();
                }
            } else {
                for (o, &x) in o.iter_mut().zip(x) {
                    let lp = x - lse;
                    let p = lp.exp();
                    *o = -g_lp * p - g_ent * p * (lp + ent);
                }
            }
            if let Some(o) = o.get_mut(t as usize) {
                *o += g_lp;
            }
        };
        let (stats, grads) = (&self.stats, &self.grads);
        if x.len() < PAR_MIN_ELEMS {
            out.chunks_mut(v)
                .zip(
                    x.chunks(v)
                        .zip(t.iter())
                        .zip(stats.chunks(3).zip(grads.chunks(3))),
                )
                .for_each(row);
        } else {
            out.par_chunks_mut(v)
                .zip(
                    x.par_chunks(v)
                        .zip(t.par_iter())
                        .zip(stats.par_chunks(3).zip(grads.par_chunks(3))),
                )
                .with_min_len(min_rows(v))
                .for_each(row);
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
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

// ---------------------------------------------------------------------------------------------
// Optimizer: one-pass AdamW and gradient norm

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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        // A small LCG: deterministic without a device RNG.
        let n: usize = shape.iter().product();
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let data: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn override_is_scoped_and_restored() {
        let outer = Kernels::current();
        with_kernels(Kernels::Slow, || {
            assert_eq!(Kernels::current(), Kernels::Slow);
            with_kernels(Kernels::Fused, || {
                assert_eq!(Kernels::current(), Kernels::Fused)
            });
            assert_eq!(Kernels::current(), Kernels::Slow);
        });
        assert_eq!(Kernels::current(), outer);
    }

    #[test]
    fn dot_matches_a_plain_sum_for_odd_lengths() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        let b: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.1).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((dot(&a, &b) - want).abs() < 1e-3);
    }

    #[test]
    fn softmax_rows_sum_to_one_and_masked_entries_are_zero() {
        let x = randn(&[3, 5], 1);
        let mask =
            Tensor::new(&[[0f32, f32::NEG_INFINITY, 0.0, 0.0, 0.0]; 3], &Device::Cpu).unwrap();
        let y = with_kernels(Kernels::Fused, || {
            softmax_last_dim(&x.broadcast_add(&mask).unwrap()).unwrap()
        });
        let rows = y.to_vec2::<f32>().unwrap();
        for r in rows {
            assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
            assert_eq!(r[1], 0.0);
        }
    }

    #[test]
    fn rms_norm_backward_matches_slow_on_a_large_parallel_batch() {
        // Large enough to take the rayon path (and several dw blocks).
        let x = Var::from_tensor(&randn(&[96, 300], 2)).unwrap();
        let w = Var::from_tensor(&randn(&[300], 3)).unwrap();
        let c = randn(&[96, 300], 4);
        let run = |k| {
            with_kernels(k, || {
                let y = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
                let g = (y * &c).unwrap().sum_all().unwrap().backward().unwrap();
                (
                    g.get(x.as_tensor()).unwrap().clone(),
                    g.get(w.as_tensor()).unwrap().clone(),
                )
            })
        };
        let (fx, fw) = run(Kernels::Fused);
        let (sx, sw) = run(Kernels::Slow);
        assert!(max_diff(&fx, &sx) < 1e-4, "dx {}", max_diff(&fx, &sx));
        assert!(max_diff(&fw, &sw) < 1e-3, "dw {}", max_diff(&fw, &sw));
    }

    #[test]
    fn adamw_matches_the_tensor_formula() {
        let p0 = randn(&[40_000], 5);
        let g = randn(&[40_000], 6);
        let p = Var::from_tensor(&p0).unwrap();
        let mut m = vec![0.1f32; 40_000];
        let mut v = vec![0.2f32; 40_000];
        let h = AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            bc1: 0.1,
            bc2: 0.05,
            grad_scale: 0.5,
        };
        with_kernels(Kernels::Fused, || {
            assert!(fused_adamw_for(p.as_tensor(), &g));
            adamw_update(p.as_tensor(), &g, &mut m, &mut v, h).unwrap();
        });
        let gs = (&g * 0.5).unwrap();
        let m_ref = ((gs.clone() * 0.1).unwrap() + 0.1 * 0.9).unwrap();
        let v_ref = ((gs.sqr().unwrap() * 0.05).unwrap() + 0.2 * 0.95).unwrap();
        let u = ((&m_ref / 0.1).unwrap()
            / ((&v_ref / 0.05).unwrap().sqrt().unwrap() + 1e-8).unwrap())
        .unwrap();
        let p_ref = ((&p0 * (1.0 - 1e-2 * 0.01)).unwrap() - (u * 1e-2).unwrap()).unwrap();
        assert!(max_diff(p.as_tensor(), &p_ref) < 1e-5);
        let m_t = Tensor::from_vec(m, 40_000, &Device::Cpu).unwrap();
        assert!(max_diff(&m_t, &m_ref) < 1e-6);
    }

    #[test]
    fn sum_squares_matches_the_tensor_reduction() {
        let t = randn(&[70_001], 7);
        let want = t
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let got = with_kernels(Kernels::Fused, || sum_squares(&t).unwrap());
        assert!((got - want).abs() / want < 1e-5, "{got} vs {want}");
    }

    #[test]
    fn out_of_range_targets_are_an_error() {
        let x = randn(&[2, 4], 8);
        let t = Tensor::new(&[1u32, 4], &Device::Cpu).unwrap();
        let r = with_kernels(Kernels::Fused, || token_logprobs(&x, &t));
        assert!(r.is_err());
    }
}
