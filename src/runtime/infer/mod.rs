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
//!
//! Prefill (several new positions per row) keeps candle's matmuls for `q·kᵀ` and `·V`, and
//! [`softmax_prefill`] does the scale, mask and softmax between them in one pass in place:
//! the tensor path allocated a scores-sized tensor for each (at 512 tokens, 9.4 MB per layer
//! each, with their page faults) and was ~30% of a prefill's time.

// The kernels index several arrays by the same counters on purpose (register blocks).
#![allow(clippy::needless_range_loop)]

use std::sync::Mutex;
use std::sync::atomic::{AtomicU8, Ordering};

use candle_core::{DType, Layout, Storage, Tensor};
use wide::f32x8;

type Result<T> = candle_core::Result<T>;

/// Key-padding score, the same value as the decoder's mask.
const PAD_SCORE: f32 = -1e9;

/// The f32 data and (batch, head, position) strides plus offset of a cache view whose
/// positions are laid out one after the other (a (row, head)'s keys are one run of memory).
fn view_f32<'a>(storage: &'a Storage, layout: &Layout) -> Result<(&'a [f32], [usize; 3], usize)> {
    let data = match storage {
        Storage::Cpu(s) => s.as_slice::<f32>()?,
        _ => candle_core::bail!("decode attention runs on the CPU only"),
    };
    let st = layout.stride();
    let dims = layout.dims();
    // A position's values must follow the previous one's ([`View::run`]); one position (a
    // one-token prompt's keys, a view of the projection) has no previous one.
    if st.len() != 4 || dims.len() != 4 || st[3] != 1 || (dims[2] > 1 && st[2] != dims[3]) {
        candle_core::bail!(
            "decode attention needs a (b, h, s, d) view whose positions are contiguous, got \
             strides {st:?} for {dims:?}"
        );
    }
    Ok((data, [st[0], st[1], st[2]], layout.start_offset()))
}

/// `a·b + c`, one rounding where the CPU has FMA (the build targets the host CPU), two where
/// it does not. Every kernel here accumulates through this, so results do not depend on how
/// many rows or heads a call carries.
#[inline(always)]
fn fmadd(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_feature = "fma")]
    {
        a.mul_add(b, c)
    }
    #[cfg(not(target_feature = "fma"))]
    {
        a * b + c
    }
}

/// Ask for the cache lines of `xs` (keys or values a loop reads next: a decode step's keys and
/// values come from memory, and short runs of them do not wake the hardware prefetcher).
#[inline(always)]
fn prefetch(xs: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(sse) = pulp::core_arch::x86::Sse::try_new() {
        for c in xs.chunks(16) {
            sse._mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(c.as_ptr().cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = xs;
}

/// `$body` with `$w` bound to the head width `$hd`, a compile-time constant for the common
/// widths (64, 128, 32) so that a loop over a run of keys addresses them as one base plus
/// constant offsets (with a run-time width, address arithmetic took as many instructions as
/// the FMAs); other widths run the same body with the run-time value. For `#[inline(always)]`
/// bodies: the constant only helps where it reaches the loop.
macro_rules! with_head_width {
    ($hd:expr, $w:ident => $body:expr) => {
        match $hd {
            64 => {
                let $w: usize = 64;
                $body
            }
            128 => {
                let $w: usize = 128;
                $body
            }
            32 => {
                let $w: usize = 32;
                $body
            }
            $w => $body,
        }
    };
}

/// Lane width of the accumulators (one AVX register of f32).
const LANES: usize = 8;

/// The fixed summation order of every dot product here: `LANES` running sums over chunks,
/// folded pairwise, plus the tail summed in order.
#[inline(always)]
fn fold(acc: &[f32; LANES], tail: f32) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `O` weight rows against `R` input rows: `out[o][r] = w[o]·x[r]`, each exactly as a lone
/// dot product in [`fold`]'s order, with `O·R` independent accumulators so that the FMA
/// chains overlap (one dot alone waits on its own latency) and each loaded chunk is reused.
#[inline(always)]
fn dot_block<const O: usize, const R: usize>(w: &[f32], x: &[f32], inp: usize) -> [[f32; R]; O] {
    let n = inp / LANES;
    let wc: [&[[f32; LANES]]; O] = std::array::from_fn(|o| {
        let (c, _) = w[o * inp..(o + 1) * inp].as_chunks::<LANES>();
        &c[..n]
    });
    let xc: [&[[f32; LANES]]; R] = std::array::from_fn(|r| {
        let (c, _) = x[r * inp..(r + 1) * inp].as_chunks::<LANES>();
        &c[..n]
    });
    let mut acc = [[f32x8::ZERO; R]; O];
    for c in 0..n {
        let xs: [f32x8; R] = std::array::from_fn(|r| f32x8::from(xc[r][c]));
        for o in 0..O {
            let wv = f32x8::from(wc[o][c]);
            for r in 0..R {
                acc[o][r] = wv.mul_add(xs[r], acc[o][r]);
            }
        }
    }
    let mut out = [[0f32; R]; O];
    for o in 0..O {
        for r in 0..R {
            let mut tail = 0f32;
            for i in n * LANES..inp {
                tail = fmadd(w[o * inp + i], x[r * inp + i], tail);
            }
            out[o][r] = fold(&acc[o][r].to_array(), tail);
        }
    }
    out
}

/// Output features `o0..o1` of `x · wᵀ` for `R` input rows into `dst` ((o1 − o0) × R, feature
/// major), `O` features at a time.
#[inline(always)]
fn dots_into<const O: usize, const R: usize>(
    wd: &[f32],
    xv: &[f32],
    inp: usize,
    o0: usize,
    o1: usize,
    dst: &mut [f32],
) {
    let mut o = o0;
    while o + O <= o1 {
        let blk = dot_block::<O, R>(&wd[o * inp..(o + O) * inp], xv, inp);
        for (k, row) in blk.iter().enumerate() {
            dst[(o - o0 + k) * R..(o - o0 + k + 1) * R].copy_from_slice(row);
        }
        o += O;
    }
    while o < o1 {
        let blk = dot_block::<1, R>(&wd[o * inp..(o + 1) * inp], xv, inp);
        dst[(o - o0) * R..(o - o0 + 1) * R].copy_from_slice(&blk[0]);
        o += 1;
    }
}

/// [`dots_into`] for a run-time row count (1..=[`FEW_ROWS`]); the block shapes keep 8–16
/// accumulators live.
fn dots_rows(
    wd: &[f32],
    xv: &[f32],
    rows: usize,
    inp: usize,
    o0: usize,
    o1: usize,
    dst: &mut [f32],
) {
    match rows {
        1 => dots_into::<8, 1>(wd, xv, inp, o0, o1, dst),
        2 => dots_into::<4, 2>(wd, xv, inp, o0, o1, dst),
        3 => dots_into::<4, 3>(wd, xv, inp, o0, o1, dst),
        4 => dots_into::<4, 4>(wd, xv, inp, o0, o1, dst),
        5 => dots_into::<2, 5>(wd, xv, inp, o0, o1, dst),
        6 => dots_into::<2, 6>(wd, xv, inp, o0, o1, dst),
        7 => dots_into::<2, 7>(wd, xv, inp, o0, o1, dst),
        _ => dots_into::<2, 8>(wd, xv, inp, o0, o1, dst),
    }
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

/// A cache view's data with its (batch, head, position) strides and offset.
struct View<'a> {
    data: &'a [f32],
    st: [usize; 3],
    off: usize,
}

impl View<'_> {
    /// Positions `0..n` of (row, kv head), `n · hd` values in a row ([`view_f32`] checked that
    /// a position's values follow the previous one's).
    fn run(&self, r: usize, h: usize, n: usize, hd: usize) -> &[f32] {
        let a = self.off + r * self.st[0] + h * self.st[1];
        &self.data[a..a + n * hd]
    }

    /// Key or value vector of (row, kv head, position).
    #[inline(always)]
    fn at(&self, r: usize, h: usize, j: usize, hd: usize) -> &[f32] {
        let a = self.off + r * self.st[0] + h * self.st[1] + j * self.st[2];
        &self.data[a..a + hd]
    }
}

/// Rows that share one pass over a shared prefix's keys (their query heads become the lanes).
const PREFIX_LANES: usize = 16;

/// Scores of `G` consecutive lane groups `lg..lg + G` (`LANES` query heads each, transposed in
/// `qt`: `qt[d·hp + lane]`) against `n` keys: `out[j·hp + lane] = (q·k_j) · scale`, each an FMA
/// chain over `d` in order (so a lane's score does not depend on which other heads share its
/// group, nor on `G`). Eight keys at a time keep eight chains per group in flight; two groups
/// at once broadcast each key value once for 16 lanes.
///
/// `keys`: `n` keys of `hd` values each, one after the other (a cache view's positions of one
/// row and KV head), the width a constant where it can be ([`with_head_width`]).
fn score_lanes<const G: usize>(
    qt: &[f32],
    hp: usize,
    lg: usize,
    hd: usize,
    keys: &[f32],
    scale: f32,
    out: &mut [f32],
) {
    let n = keys.len() / hd.max(1);
    with_head_width!(hd, w => {
        score_lanes_hd::<G>(qt, hp, lg, w, n, |j| &keys[j * w..][..w], scale, out)
    })
}

/// [`score_lanes`] for keys given one at a time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_lanes_hd<'k, const G: usize>(
    qt: &[f32],
    hp: usize,
    lg: usize,
    hd: usize,
    n: usize,
    key: impl Fn(usize) -> &'k [f32],
    scale: f32,
    out: &mut [f32],
) {
    const KB: usize = 8;
    let (qc, _) = qt.as_chunks::<LANES>();
    let groups = hp / LANES;
    let ql = |d: usize, g: usize| f32x8::from(qc[d * groups + lg + g]);
    let mut j = 0;
    while j + KB <= n {
        if j + 3 * KB <= n {
            for u in 0..KB {
                prefetch(&key(j + 2 * KB + u)[..hd]);
            }
        }
        let ks: [&[f32]; KB] = std::array::from_fn(|u| &key(j + u)[..hd]);
        let mut acc = [[f32x8::ZERO; G]; KB];
        for d in 0..hd {
            let q: [f32x8; G] = std::array::from_fn(|g| ql(d, g));
            for u in 0..KB {
                let k = f32x8::splat(ks[u][d]);
                for g in 0..G {
                    acc[u][g] = q[g].mul_add(k, acc[u][g]);
                }
            }
        }
        for (u, a) in acc.iter().enumerate() {
            for (g, a) in a.iter().enumerate() {
                let o = (j + u) * hp + (lg + g) * LANES;
                out[o..o + LANES].copy_from_slice(&(*a * f32x8::splat(scale)).to_array());
            }
        }
        j += KB;
    }
    // The last keys one at a time.
    for g in 0..G {
        for j in j..n {
            let k = &key(j)[..hd];
            let mut acc = f32x8::ZERO;
            for (d, &kd) in k.iter().enumerate() {
                acc = ql(d, g).mul_add(f32x8::splat(kd), acc);
            }
            let o = j * hp + (lg + g) * LANES;
            out[o..o + LANES].copy_from_slice(&(acc * f32x8::splat(scale)).to_array());
        }
    }
}

/// Softmax per lane over the keys of `sc` (`sc[j·ng·LANES + lg·LANES + lane]`, `ng` lane
/// groups): each lane group's running max, sum and scale stay in registers (through memory
/// they were a store-to-load chain per key). The max is exact in any order (four partial
/// maxima); each lane's sum runs in key order, as before.
fn softmax_lanes(sc: &mut [f32], ng: usize) {
    let (chunks, _) = sc.as_chunks_mut::<LANES>();
    let total = chunks.len() / ng.max(1);
    for lg in 0..ng {
        let at = |j: usize| j * ng + lg;
        let mut m4 = [f32x8::splat(f32::NEG_INFINITY); 4];
        let mut j = 0;
        while j + 4 <= total {
            for (u, m) in m4.iter_mut().enumerate() {
                *m = m.max(f32x8::from(chunks[at(j + u)]));
            }
            j += 4;
        }
        while j < total {
            m4[0] = m4[0].max(f32x8::from(chunks[at(j)]));
            j += 1;
        }
        let m = m4[0].max(m4[1]).max(m4[2].max(m4[3]));
        let mut t = f32x8::ZERO;
        for j in 0..total {
            let e = (f32x8::from(chunks[at(j)]) - m).exp();
            t += e;
            chunks[at(j)] = e.to_array();
        }
        let inv = f32x8::ONE / t;
        for j in 0..total {
            chunks[at(j)] = (f32x8::from(chunks[at(j)]) * inv).to_array();
        }
    }
}

/// For `U` heads at once (`acc`: U × C·LANES): `acc[u] += Σ_j p(j, u) · v_j` over `n` values
/// of width `C·LANES`, in order of `j` (each lane an FMA chain over the keys; `U·C` chains in
/// flight).
#[inline(always)]
fn weigh_values_c<'v, const C: usize, const U: usize>(
    acc: &mut [f32],
    n: usize,
    p: impl Fn(usize, usize) -> f32,
    val: impl Fn(usize) -> &'v [f32],
) {
    let (ac, _) = acc.as_chunks::<LANES>();
    let mut a: [[f32x8; C]; U] =
        std::array::from_fn(|u| std::array::from_fn(|c| f32x8::from(ac[u * C + c])));
    for j in 0..n {
        if j + 8 < n {
            prefetch(val(j + 8));
        }
        let (vc, _) = val(j).as_chunks::<LANES>();
        let vs: [f32x8; C] = std::array::from_fn(|c| f32x8::from(vc[c]));
        for u in 0..U {
            let w = f32x8::splat(p(j, u));
            for c in 0..C {
                a[u][c] = w.mul_add(vs[c], a[u][c]);
            }
        }
    }
    let (ac, _) = acc.as_chunks_mut::<LANES>();
    for u in 0..U {
        for c in 0..C {
            ac[u * C + c] = a[u][c].to_array();
        }
    }
}

/// [`weigh_values_c`] for heads `h0..h1` (`acc`: their outputs, hd each) of any head width,
/// two heads at a time (the same per-lane order whatever the pairing).
fn weigh_values<'v>(
    acc: &mut [f32],
    hd: usize,
    n: usize,
    p: impl Fn(usize, usize) -> f32 + Copy,
    val: impl Fn(usize) -> &'v [f32] + Copy,
) {
    let heads = acc.len() / hd;
    let mut h = 0;
    while h < heads {
        let u = if h + 2 <= heads { 2 } else { 1 };
        let a = &mut acc[h * hd..(h + u) * hd];
        let pp = move |j: usize, k: usize| p(j, h + k);
        match (hd, u) {
            (32, 2) => weigh_values_c::<4, 2>(a, n, pp, val),
            (32, _) => weigh_values_c::<4, 1>(a, n, pp, val),
            (64, 2) => weigh_values_c::<8, 2>(a, n, pp, val),
            (64, _) => weigh_values_c::<8, 1>(a, n, pp, val),
            (128, _) => {
                for k in 0..u {
                    let pk = move |j: usize, _: usize| p(j, h + k);
                    weigh_values_c::<16, 1>(&mut a[k * hd..(k + 1) * hd], n, pk, val);
                }
            }
            _ => {
                for j in 0..n {
                    let v = val(j);
                    for (k, ak) in a.chunks_exact_mut(hd).enumerate() {
                        let w = p(j, h + k);
                        for (x, &y) in ak.iter_mut().zip(v) {
                            *x = fmadd(w, y, *x);
                        }
                    }
                }
            }
        }
        h += u;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;
mod lanes16;

/// Attention for one query position per row.
///
/// `q`: (b, nh, 1, hd) after RoPE; `prefix`: optional keys/values (1, nkv, P, hd) of positions
/// `0..P` that every row shares (rehearsal branches forked from one prompt); `k`, `v`: each
/// row's own positions after that, (b, nkv, s, hd), up to and including the new one (so no
/// causal mask is needed); `pad[r]`: left padding of row r (empty = none). Returns
/// (b, 1, nh·hd), heads in order, as the tensor path's `transpose(1, 2).reshape(..)` lays them
/// out.
///
/// Work items are (kv head, block of rows): the query heads of a GQA group, and with a shared
/// prefix those of several rows, are the lanes of one pass over each key, so a shared prefix
/// is read once per block instead of once per row. Every lane's arithmetic is the same
/// whatever shares its pass, so a row gives the same bits batched, forked or alone.
pub fn attend_one(
    q: &Tensor,
    prefix: Option<(&Tensor, &Tensor)>,
    k: &Tensor,
    v: &Tensor,
    pad: &[usize],
    scale: f32,
) -> Result<Tensor> {
    let (b, nh, l, hd) = q.dims4()?;
    let (kb, nkv, s, khd) = k.dims4()?;
    let np = match prefix {
        Some((pk, pv)) => {
            let (pb, pnkv, np, phd) = pk.dims4()?;
            if pb != 1 || pnkv != nkv || phd != hd || pv.dims4()? != (1, nkv, np, hd) {
                candle_core::bail!(
                    "decode attention prefix shapes: k {:?}, v {:?}",
                    pk.dims(),
                    pv.dims()
                );
            }
            np
        }
        None => 0,
    };
    if l != 1 || kb != b || khd != hd || v.dims4()? != (b, nkv, s, hd) || nh % nkv != 0 {
        candle_core::bail!(
            "decode attention shapes: q {:?}, k {:?}, v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let groups = nh / nkv;
    let total = np + s;
    // Rows per item: several share the prefix pass; without one each row is its own item.
    let rpi = if np > 0 {
        (PREFIX_LANES / groups).max(1)
    } else {
        1
    };
    let blocks = b.div_ceil(rpi);
    let qv = q.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; b * nh * hd];
    {
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let kview = view_f32(&ks, kl)?;
        let vview = view_f32(&vs, vl)?;
        let own_k = View {
            data: kview.0,
            st: kview.1,
            off: kview.2,
        };
        let own_v = View {
            data: vview.0,
            st: vview.1,
            off: vview.2,
        };
        let pstor = prefix.map(|(pk, pv)| (pk.storage_and_layout(), pv.storage_and_layout()));
        let pviews = match &pstor {
            Some(((pks, pkl), (pvs, pvl))) => {
                let a = view_f32(pks, pkl)?;
                let c = view_f32(pvs, pvl)?;
                Some((
                    View {
                        data: a.0,
                        st: a.1,
                        off: a.2,
                    },
                    View {
                        data: c.0,
                        st: c.1,
                        off: c.2,
                    },
                ))
            }
            None => None,
        };
        let results: Vec<Mutex<Vec<f32>>> =
            (0..nkv * blocks).map(|_| Mutex::new(Vec::new())).collect();
        let item = |i: usize| {
            let (blk, kh) = (i % blocks, i / blocks);
            let r0 = blk * rpi;
            let r1 = (r0 + rpi).min(b);
            let heads = (r1 - r0) * groups;
            let hp = heads.div_ceil(LANES) * LANES;
            // Lane h = (row r0 + h / groups, query head kh·groups + h % groups).
            let mut qt = vec![0f32; hd * hp];
            for h in 0..heads {
                let (r, g) = (r0 + h / groups, h % groups);
                let qh = &qv[(r * nh + kh * groups + g) * hd..][..hd];
                for (d, &x) in qh.iter().enumerate() {
                    qt[d * hp + h] = x;
                }
            }
            let mut sc = vec![0f32; total * hp];
            if let Some((pk, _)) = &pviews {
                let keys = pk.run(0, kh, np, hd);
                let mut lg = 0;
                if lanes16::score_lanes(&qt, hp, hd, keys, scale, &mut sc) {
                    lg = hp / LANES;
                }
                while lg < hp / LANES {
                    if lg + 2 <= hp / LANES {
                        score_lanes::<2>(&qt, hp, lg, hd, keys, scale, &mut sc);
                        lg += 2;
                    } else {
                        score_lanes::<1>(&qt, hp, lg, hd, keys, scale, &mut sc);
                        lg += 1;
                    }
                }
            }
            // Each row's own keys: the lane groups holding its heads, kept for its lanes only
            // (an item of one row owns every lane: straight into the scores).
            if r1 - r0 == 1 {
                let own = &mut sc[np * hp..];
                for lg in 0..hp / LANES {
                    score_lanes::<1>(&qt, hp, lg, hd, own_k.run(r0, kh, s, hd), scale, own);
                }
            } else {
                let mut tmp = vec![0f32; s * hp];
                for r in r0..r1 {
                    let (h0, h1) = ((r - r0) * groups, (r - r0 + 1) * groups);
                    for lg in h0 / LANES..h1.div_ceil(LANES) {
                        let keys = own_k.run(r, kh, s, hd);
                        score_lanes::<1>(&qt, hp, lg, hd, keys, scale, &mut tmp);
                    }
                    for j in 0..s {
                        sc[(np + j) * hp + h0..(np + j) * hp + h1]
                            .copy_from_slice(&tmp[j * hp + h0..j * hp + h1]);
                    }
                }
            }
            // Left padding, then softmax per lane over every key.
            for h in 0..heads {
                let p = pad.get(r0 + h / groups).copied().unwrap_or(0);
                for j in 0..p.min(total) {
                    sc[j * hp + h] += PAD_SCORE;
                }
            }
            // Lanes past `heads` hold zeros and are never read.
            softmax_lanes(&mut sc, hp / LANES);
            // Weighted values: the prefix's, then the row's own, in key order.
            let mut acc = vec![0f32; heads * hd];
            if let Some((_, pv)) = &pviews {
                let sc = &sc;
                let p = |j: usize, h: usize| sc[j * hp + h];
                let val = |j| pv.at(0, kh, j, hd);
                if !lanes16::weigh_values(&mut acc, hd, pv.run(0, kh, np, hd), sc, hp) {
                    weigh_values(&mut acc, hd, np, p, val);
                }
            }
            for (rr, a) in acc.chunks_exact_mut(groups * hd).enumerate() {
                let (r, h0, sc) = (r0 + rr, rr * groups, &sc);
                weigh_values(
                    a,
                    hd,
                    s,
                    |j, h| sc[(np + j) * hp + h0 + h],
                    |j| own_v.at(r, kh, j, hd),
                );
            }
            if let Ok(mut dst) = results[i].lock() {
                *dst = acc;
            }
        };
        let n_items = nkv * blocks;
        crate::runtime::par::for_each_index(n_items, b * nh * total * hd < PARALLEL_MIN_WORK, item);
        for (i, res) in results.into_iter().enumerate() {
            let (blk, kh) = (i % blocks, i / blocks);
            let r0 = blk * rpi;
            let acc = res.into_inner().map_err(|_| {
                candle_core::Error::Msg("decode attention: a worker panicked".into())
            })?;
            for (h, a) in acc.chunks_exact(hd).enumerate() {
                let (r, g) = (r0 + h / groups, h % groups);
                out[(r * nh + kh * groups + g) * hd..][..hd].copy_from_slice(a);
            }
        }
    }
    Tensor::from_vec(out, (b, 1, nh * hd), q.device())
}

/// Whether [`softmax_prefill`] can serve these attention scores: the fast path on, f32 on the
/// CPU, outside autograd.
pub(crate) fn prefill_supports(att: &Tensor) -> bool {
    is_enabled() && !att.track_op() && att.device().is_cpu() && att.dtype() == DType::F32
}

/// Score rows per work item of [`softmax_prefill`].
const SOFTMAX_ROWS: usize = 16;

/// The in-place op of [`softmax_prefill`].
struct PrefillSoftmax<'a> {
    scale: f32,
    /// New positions per row (the query rows of one head are `l` consecutive score rows).
    l: usize,
    /// Cached positions before them.
    offset: usize,
    /// Left padding per batch row (empty: none).
    pad: &'a [usize],
}

impl candle_core::InplaceOp1 for PrefillSoftmax<'_> {
    fn name(&self) -> &'static str {
        "envace-prefill-softmax"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &Layout) -> Result<()> {
        let candle_core::CpuStorage::F32(data) = storage else {
            candle_core::bail!("prefill softmax: f32 scores only");
        };
        let (Some((start, end)), &[_, h, rows, s]) = (layout.contiguous_offsets(), layout.dims())
        else {
            candle_core::bail!("prefill softmax: contiguous (b, heads, rows, s) scores only");
        };
        if s == 0 || rows % self.l != 0 || self.offset + self.l != s {
            candle_core::bail!(
                "prefill softmax: scores {:?} for {} new positions after {}",
                layout.dims(),
                self.l,
                self.offset
            );
        }
        let x = &mut data[start..end];
        let serial = x.len() < PARALLEL_MIN_WORK;
        let per_batch_row = h * rows;
        let chunks: Vec<Mutex<&mut [f32]>> =
            x.chunks_mut(SOFTMAX_ROWS * s).map(Mutex::new).collect();
        let item = |c: usize| {
            let Ok(mut block) = chunks[c].lock() else {
                return;
            };
            for (k, row) in block.chunks_exact_mut(s).enumerate() {
                let at = c * SOFTMAX_ROWS + k;
                let (b, i) = (at / per_batch_row, at % per_batch_row % self.l);
                let pad = self.pad.get(b).copied().unwrap_or(0);
                softmax_causal_row(row, self.offset + i + 1, pad, self.scale);
            }
        };
        let n_items = chunks.len();
        crate::runtime::par::for_each_index(n_items, serial, item);
        Ok(())
    }
}

/// One query's scores in place: `x · scale` with −1e9 added on the `pad` left-padding keys,
/// softmax over the first `valid` keys (the causal window), zeros after them (where the tensor
/// path's −inf mask gives exactly 0). Exponentials by `wide`'s `exp`, as [`attend_one`]'s.
/// Also the training pass's causal softmax (`train_attention`, no padding there).
pub(crate) fn softmax_causal_row(x: &mut [f32], valid: usize, pad: usize, scale: f32) {
    let valid = valid.min(x.len());
    let (head, rest) = x.split_at_mut(valid);
    rest.fill(0.0);
    for (j, v) in head.iter_mut().enumerate() {
        *v = *v * scale + if j < pad { PAD_SCORE } else { 0.0 };
    }
    let max = head.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let m = f32x8::splat(max);
    let mut sum = f32x8::ZERO;
    let (chunks, tail) = head.as_chunks_mut::<LANES>();
    for c in chunks.iter_mut() {
        let e = (f32x8::from(*c) - m).exp();
        sum += e;
        *c = e.to_array();
    }
    // The tail through the same vector exp (padded lanes are dropped).
    let mut last = [f32::NEG_INFINITY; LANES];
    last[..tail.len()].copy_from_slice(tail);
    let e = (f32x8::from(last) - m).exp().to_array();
    let n = tail.len();
    tail.copy_from_slice(&e[..n]);
    let total = sum.to_array().iter().sum::<f32>() + e[..n].iter().sum::<f32>();
    let inv = 1.0 / total;
    for v in head.iter_mut() {
        *v *= inv;
    }
}

/// Prefill attention probabilities in place: `att` holds the raw scores `q·kᵀ` (b, kv heads,
/// groups · l, s) of `l` new positions per row after `offset` cached ones (row `g·l + i` is
/// query position `offset + i`; s = offset + l). Applies the scale, the decoder's mask (causal,
/// −1e9 on `pad` left padding: [`build_mask`](super::decoder)'s values) and the softmax in one
/// pass over the scores, where the tensor path allocated and filled a scores-sized tensor for
/// each of the three (most of a 512-token prefill's time outside the matmuls, page faults
/// included).
pub(crate) fn softmax_prefill(
    att: &Tensor,
    scale: f32,
    l: usize,
    offset: usize,
    pad: &[usize],
) -> Result<()> {
    att.inplace_op1(&PrefillSoftmax {
        scale,
        l,
        offset,
        pad,
    })
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
            dots_rows(wd, &xv, rows, inp, o0, o1, &mut acc[..(o1 - o0) * rows]);
            if let Ok(mut dst) = chunks[i].lock() {
                let n = dst.len();
                dst.copy_from_slice(&acc[..n]);
            }
        };
        let n_items = outf.div_ceil(BLOCK);
        crate::runtime::par::for_each_index(n_items, outf * inp * rows < PARALLEL_MIN_WORK, item);
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
    use crate::runtime::test_util::max_abs_diff;
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
        let fast = attend_one(&q, None, &k, &v, &pad, scale as f32).unwrap();
        let slow = reference(&q, &k, &v, &pad, scale);
        let diff = max_abs_diff(&fast, &slow);
        assert!(diff < 1e-5, "max abs diff {diff}");
    }

    #[test]
    fn few_rows_matmul_matches_gemm_and_rows_are_independent() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (300, 96), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (8, 96), &dev).unwrap();
        let fast = few_rows_matmul(&x, &w).unwrap();
        let gemm = x.matmul(&w.t().unwrap()).unwrap();
        let diff = max_abs_diff(&fast, &gemm);
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
        let both = attend_one(&q, None, &k, &v, &[], 0.3).unwrap();
        let one = attend_one(
            &q.narrow(0, 1, 1).unwrap(),
            None,
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

    /// The softmax as it was written before `softmax_lanes` (running max and sum per lane in
    /// key order, through a vector): the reference for the same bits.
    fn softmax_sequential(sc: &mut [f32], ng: usize) {
        let mut max = vec![f32x8::splat(f32::NEG_INFINITY); ng];
        for row in sc.as_chunks::<LANES>().0.chunks_exact(ng) {
            for (m, x) in max.iter_mut().zip(row) {
                *m = m.max(f32x8::from(*x));
            }
        }
        let mut sum = vec![f32x8::ZERO; ng];
        for row in sc.as_chunks_mut::<LANES>().0.chunks_exact_mut(ng) {
            for ((x, m), t) in row.iter_mut().zip(&max).zip(sum.iter_mut()) {
                let e = (f32x8::from(*x) - *m).exp();
                *t += e;
                *x = e.to_array();
            }
        }
        let inv: Vec<f32x8> = sum.iter().map(|t| f32x8::ONE / *t).collect();
        for row in sc.as_chunks_mut::<LANES>().0.chunks_exact_mut(ng) {
            for (x, i) in row.iter_mut().zip(&inv) {
                *x = (f32x8::from(*x) * *i).to_array();
            }
        }
    }

    #[test]
    fn lane_softmax_gives_the_sequential_softmax_bit_for_bit() {
        let dev = Device::Cpu;
        for ng in 1..=3 {
            for total in [1, 3, 4, 5, 8, 33, 130] {
                let mut a = Tensor::randn(0f32, 3.0, total * ng * LANES, &dev)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                // Padded keys, as the decoder's mask adds them, and a repeated maximum.
                a[0] += PAD_SCORE;
                if total > 2 {
                    let m = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    a[ng * LANES] = m;
                }
                let mut b = a.clone();
                softmax_lanes(&mut a, ng);
                softmax_sequential(&mut b, ng);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{ng} lane groups, {total} keys");
            }
        }
    }
}
