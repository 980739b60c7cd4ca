//! The decode-step fast path of [`Pass::Infer`](super::decoder::Pass::Infer): attention of one
//! new query position per row over the KV cache, in one pass over plain slices.
//!
//! Why it exists: with one query row the tensor version (q·Kᵀ matmul per head, scale, mask,
//! softmax, ·V matmul, reshapes) costs a dozen small candle ops per layer, and the cache's
//! narrowed (strided) K/V views get copied to contiguous buffers on every step. Profiling
//! showed decode time growing with context length far beyond the arithmetic. Here each
//! (row, head) reads its keys and values straight from the cache storage, computes
//! max → exp → sum → weighted sum of values, and writes its output: no tensor temporaries.
//!
//! What it must never do: change results. Scores are `q·k · scale` plus −1e9 on left padding,
//! exactly the mask [`build_mask`](super::decoder) adds, and every row is computed by the same
//! loop whatever the batch, so a batched row equals the same row decoded alone bit for bit.
//! Only inference uses it (no autograd through it).

use std::sync::atomic::{AtomicU8, Ordering};

use candle_core::{DType, Layout, Storage, Tensor};

type Result<T> = candle_core::Result<T>;

/// Key-padding score, the same value as the decoder's mask.
const PAD_SCORE: f32 = -1e9;

/// The f32 data and (batch, head, position) strides plus offset of a cache view whose last
/// dimension is contiguous.
fn view_f32<'a>(storage: &'a Storage, layout: &Layout) -> Result<(&'a [f32], [usize; 3], usize)> {
    let data = match storage {
        Storage::Cpu(s) => s.as_slice::<f32>()?,
        _ => candle_core::bail!("decode attention runs on the CPU only"),
    };
    let st = layout.stride();
    if st.len() != 4 || st[3] != 1 {
        candle_core::bail!("decode attention needs a (b, h, s, d) view with contiguous rows");
    }
    Ok((data, [st[0], st[1], st[2]], layout.start_offset()))
}

/// Dot product with eight independent accumulators (vectorises; fixed summation order).
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Set (to anything) to turn the fast path off: A/B benchmarks and parity checks against the
/// tensor path in the same build.
pub const DISABLE_ENV: &str = "ENVACE_NO_FAST_DECODE";

static ENABLED: AtomicU8 = AtomicU8::new(UNSET);
const UNSET: u8 = 2;

/// Whether the fast path is enabled: on unless [`DISABLE_ENV`] is set or [`set_enabled`] said
/// otherwise.
pub fn is_enabled() -> bool {
    match ENABLED.load(Ordering::Relaxed) {
        UNSET => {
            let on = std::env::var_os(DISABLE_ENV).is_none();
            ENABLED.store(u8::from(on), Ordering::Relaxed);
            on
        }
        v => v == 1,
    }
}

/// Turn the fast path on or off for the whole process (parity tests, A/B runs).
pub fn set_enabled(on: bool) {
    ENABLED.store(u8::from(on), Ordering::Relaxed);
}

/// Whether [`attend_one`] can serve this step: one query position, f32 on the CPU.
pub(crate) fn supports(q: &Tensor) -> bool {
    is_enabled() && q.device().is_cpu() && q.dtype() == DType::F32 && q.dim(2).is_ok_and(|l| l == 1)
}

/// Attention for one query position per row.
///
/// `q`: (b, nh, 1, hd) after RoPE; `k`, `v`: cache views (b, nkv, s, hd) holding every
/// position up to and including the new one (so no causal mask is needed); `pad[r]`: left
/// padding of row r (empty = none). Returns (b, 1, nh·hd), heads in order, as the tensor path's
/// `transpose(1, 2).reshape(..)` lays them out.
pub(crate) fn attend_one(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pad: &[usize],
    scale: f32,
) -> Result<Tensor> {
    let (b, nh, l, hd) = q.dims4()?;
    let (kb, nkv, s, khd) = k.dims4()?;
    if l != 1 || kb != b || khd != hd || v.dims4()? != (b, nkv, s, hd) || nh % nkv != 0 {
        candle_core::bail!(
            "decode attention shapes: q {:?}, k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let groups = nh / nkv;
    let qv = q.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; b * nh * hd];
    {
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (kd, kst, koff) = view_f32(&ks, kl)?;
        let (vd, vst, voff) = view_f32(&vs, vl)?;
        let mut scores = vec![0f32; s];
        for r in 0..b {
            let p = pad.get(r).copied().unwrap_or(0);
            for h in 0..nh {
                let kh = h / groups;
                let qh = &qv[(r * nh + h) * hd..(r * nh + h + 1) * hd];
                let kbase = koff + r * kst[0] + kh * kst[1];
                let vbase = voff + r * vst[0] + kh * vst[1];
                let mut max = f32::NEG_INFINITY;
                for (j, sc) in scores.iter_mut().enumerate() {
                    let at = kbase + j * kst[2];
                    let mut x = dot(qh, &kd[at..at + hd]) * scale;
                    if j < p {
                        x += PAD_SCORE;
                    }
                    *sc = x;
                    max = max.max(x);
                }
                let mut sum = 0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let inv = 1.0 / sum;
                let o = &mut out[(r * nh + h) * hd..(r * nh + h + 1) * hd];
                for (j, &w) in scores.iter().enumerate() {
                    let w = w * inv;
                    let at = vbase + j * vst[2];
                    for (oi, &vi) in o.iter_mut().zip(&vd[at..at + hd]) {
                        *oi += w * vi;
                    }
                }
            }
        }
    }
    Tensor::from_vec(out, (b, 1, nh * hd), q.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{D, Device};

    /// The tensor path of the decoder for one query row, with the same padding mask.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, pad: &[usize], scale: f64) -> Tensor {
        let (b, nh, _, hd) = q.dims4().unwrap();
        let (_, nkv, s, _) = k.dims4().unwrap();
        let g = nh / nkv;
        let q = q.reshape((b, nkv, g, hd)).unwrap();
        let att = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
        let mut m = vec![0f32; b * s];
        for (r, &p) in pad.iter().enumerate() {
            for j in 0..p {
                m[r * s + j] = -1e9;
            }
        }
        let m = Tensor::from_vec(m, (b, 1, 1, s), &Device::Cpu).unwrap();
        let att = att.broadcast_add(&m).unwrap();
        let att = candle_nn::ops::softmax(&att, D::Minus1).unwrap();
        att.matmul(&v.contiguous().unwrap())
            .unwrap()
            .reshape((b, 1, nh * hd))
            .unwrap()
    }

    #[test]
    fn one_pass_attention_matches_tensor_ops_on_a_strided_padded_cache() {
        let dev = Device::Cpu;
        let (b, nh, nkv, hd, cap, s) = (3, 6, 2, 16, 40, 29);
        let q = Tensor::randn(0f32, 1.0, (b, nh, 1, hd), &dev).unwrap();
        // Narrowed views of a larger capacity: strided like the KV cache's.
        let kc = Tensor::randn(0f32, 1.0, (b, nkv, cap, hd), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (b, nkv, cap, hd), &dev).unwrap();
        let k = kc.narrow(2, 0, s).unwrap();
        let v = vc.narrow(2, 0, s).unwrap();
        let pad = [0, 5, 28];
        let scale = 1.0 / (hd as f64).sqrt();
        let fast = attend_one(&q, &k, &v, &pad, scale as f32).unwrap();
        let slow = reference(&q, &k, &v, &pad, scale);
        let diff = (fast - slow)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-5, "max abs diff {diff}");
    }

    #[test]
    fn a_batched_row_equals_the_row_alone() {
        let dev = Device::Cpu;
        let (nh, nkv, hd, s) = (4, 2, 8, 17);
        let q = Tensor::randn(0f32, 1.0, (2, nh, 1, hd), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (2, nkv, s, hd), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (2, nkv, s, hd), &dev).unwrap();
        let both = attend_one(&q, &k, &v, &[], 0.3).unwrap();
        let one = attend_one(
            &q.narrow(0, 1, 1).unwrap(),
            &k.narrow(0, 1, 1).unwrap(),
            &v.narrow(0, 1, 1).unwrap(),
            &[],
            0.3,
        )
        .unwrap();
        assert_eq!(
            both.narrow(0, 1, 1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            one.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
}
