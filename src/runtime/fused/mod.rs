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

mod adamw;
mod logprob;
mod norm;
mod rope;
mod softmax;
mod swiglu;
#[cfg(test)]
mod tests;

pub use adamw::{AdamWStep, adamw_update, fused_adamw_for, grad_norm, sum_squares};
pub(crate) use logprob::{logprob_grads_in_place, token_stats};
pub use logprob::{token_logprobs, token_logprobs_entropy};
pub use norm::rms_norm;
pub use rope::rope;
pub(crate) use rope::rotate_row;
pub use softmax::softmax_last_dim;
pub(crate) use swiglu::sigmoid8;
pub use swiglu::silu_mul;

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
