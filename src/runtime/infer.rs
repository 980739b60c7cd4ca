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

use std::sync::Mutex;
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
/// `transpose(1, 2).reshape(..)` lays them out. Work items are (row, kv head) pairs, split over
/// candle's thread pool; the query heads of one GQA group share each key/value read.
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
        // Item (r, kh) owns the output of query heads kh·groups .. (kh+1)·groups of row r: one
        // contiguous chunk, in item order.
        let chunks: Vec<Mutex<&mut [f32]>> = out.chunks_mut(groups * hd).map(Mutex::new).collect();
        let item = |i: usize| {
            let (r, kh) = (i / nkv, i % nkv);
            let p = pad.get(r).copied().unwrap_or(0);
            let kbase = koff + r * kst[0] + kh * kst[1];
            let vbase = voff + r * vst[0] + kh * vst[1];
            let qg = &qv[(r * nh + kh * groups) * hd..(r * nh + (kh + 1) * groups) * hd];
            // scores[g * s + j]
            let mut scores = vec![0f32; groups * s];
            for j in 0..s {
                let at = kbase + j * kst[2];
                let kr = &kd[at..at + hd];
                for (g, qh) in qg.chunks_exact(hd).enumerate() {
                    let mut x = dot(qh, kr) * scale;
                    if j < p {
                        x += PAD_SCORE;
                    }
                    scores[g * s + j] = x;
                }
            }
            for sg in scores.chunks_exact_mut(s) {
                let max = sg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for sc in sg.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let inv = 1.0 / sum;
                for sc in sg.iter_mut() {
                    *sc *= inv;
                }
            }
            let mut acc = vec![0f32; groups * hd];
            for j in 0..s {
                let at = vbase + j * vst[2];
                let vr = &vd[at..at + hd];
                for (g, o) in acc.chunks_exact_mut(hd).enumerate() {
                    let w = scores[g * s + j];
                    for (oi, &vi) in o.iter_mut().zip(vr) {
                        *oi += w * vi;
                    }
                }
            }
            if let Ok(mut dst) = chunks[i].lock() {
                dst.copy_from_slice(&acc);
            }
        };
        let n_items = b * nkv;
        if n_items * s * hd * groups < PARALLEL_MIN_WORK {
            (0..n_items).for_each(item);
        } else {
            candle_core::utils::barrier_pool()
                .execute_chunked(n_items, |range| range.for_each(item));
        }
    }
    Tensor::from_vec(out, (b, 1, nh * hd), q.device())
}

/// Multiply-adds below which a step runs on the calling thread (the pool's wake-up and barrier
/// cost more than they save).
const PARALLEL_MIN_WORK: usize = 1 << 15;

/// Rows up to which [`few_rows_matmul`] serves a dense projection.
pub const FEW_ROWS: usize = 8;

/// Whether `x · wᵀ` can take [`few_rows_matmul`]: inference (neither side tracked by autograd),
/// f32 on the CPU, at most [`FEW_ROWS`] rows, `w` contiguous.
pub(crate) fn few_rows_applies(x2: &Tensor, w: &Tensor) -> bool {
    is_enabled()
        && !x2.track_op()
        && !w.track_op()
        && x2.device().is_cpu()
        && x2.dtype() == DType::F32
        && w.dtype() == DType::F32
        && w.is_contiguous()
        && x2.dim(0).is_ok_and(|r| r <= FEW_ROWS)
}

/// `x · wᵀ` for a few rows of `x` (rows, in) against a dense `w` (out, in): each weight row is
/// read once and dotted with every input row (gemm packs the whole weight on every call, which
/// dominates at decode sizes). Output features are split over candle's pool in blocks. Each
/// output element is one [`dot`], whatever the number of rows: batched rows equal single rows.
pub(crate) fn few_rows_matmul(x2: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (rows, inp) = x2.dims2()?;
    let (outf, win) = w.dims2()?;
    if inp != win || rows > FEW_ROWS {
        candle_core::bail!("few-rows matmul: x {:?} vs w {:?}", x2.dims(), w.dims());
    }
    let xv = x2.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    // Transposed result (out, rows): each block of output features is one contiguous chunk.
    let mut yt = vec![0f32; outf * rows];
    {
        let (ws, wl) = w.storage_and_layout();
        let wd = match &*ws {
            Storage::Cpu(s) => s.as_slice::<f32>()?,
            _ => candle_core::bail!("few-rows matmul runs on the CPU only"),
        };
        let wd = &wd[wl.start_offset()..wl.start_offset() + outf * inp];
        const BLOCK: usize = 16;
        let chunks: Vec<Mutex<&mut [f32]>> = yt.chunks_mut(BLOCK * rows).map(Mutex::new).collect();
        let item = |i: usize| {
            let o0 = i * BLOCK;
            let o1 = (o0 + BLOCK).min(outf);
            let mut acc = [0f32; BLOCK * FEW_ROWS];
            for o in o0..o1 {
                let wr = &wd[o * inp..(o + 1) * inp];
                for (r, xr) in xv.chunks_exact(inp).enumerate() {
                    acc[(o - o0) * rows + r] = dot(wr, xr);
                }
            }
            if let Ok(mut dst) = chunks[i].lock() {
                let n = dst.len();
                dst.copy_from_slice(&acc[..n]);
            }
        };
        let n_items = outf.div_ceil(BLOCK);
        if outf * inp * rows < PARALLEL_MIN_WORK {
            (0..n_items).for_each(item);
        } else {
            candle_core::utils::barrier_pool()
                .execute_chunked(n_items, |range| range.for_each(item));
        }
    }
    let mut y = vec![0f32; rows * outf];
    for (o, col) in yt.chunks_exact(rows).enumerate() {
        for (r, &val) in col.iter().enumerate() {
            y[r * outf + o] = val;
        }
    }
    Tensor::from_vec(y, (rows, outf), x2.device())
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
    fn few_rows_matmul_matches_gemm_and_rows_are_independent() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (300, 96), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (8, 96), &dev).unwrap();
        let fast = few_rows_matmul(&x, &w).unwrap();
        let gemm = x.matmul(&w.t().unwrap()).unwrap();
        let diff = (&fast - gemm)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(diff < 1e-4, "max abs diff {diff}");
        let one = few_rows_matmul(&x.narrow(0, 3, 1).unwrap(), &w).unwrap();
        assert_eq!(
            fast.narrow(0, 3, 1).unwrap().to_vec2::<f32>().unwrap(),
            one.to_vec2::<f32>().unwrap()
        );
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
