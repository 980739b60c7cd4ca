//! Causal self-attention for the training pass ([`super::train_pass`]): forward and backward
//! over whole (batch row, kv head) blocks, RoPE and GQA included.
//!
//! Why it exists: the autograd path spends some twenty graph nodes on attention (reshapes,
//! transposes, copies, a scaled score matmul, the mask add, the softmax, a second matmul), each
//! with its own buffers. Here one pass reads q, k and v as they come out of their projections
//! (B, T, heads·d), rotates them, computes the causal softmax and the weighted sum, and writes
//! the output in the layout the output projection reads; the backward recomputes the
//! probabilities (per block of 64 query rows, so its scratch stays small at any length) instead
//! of storing them. Work is split over (batch row, kv head) blocks, so a block owns its k/v
//! gradients and needs no locks.
//!
//! The arithmetic is two register-blocked kernels over head rows padded to a multiple of 8:
//! scores of one query against all its keys, eight keys per register from a transposed key
//! block (no horizontal sums), and weighted sums of rows with the output row held in registers.
//! They replaced per-pair dot products and `axpy`s that loaded and stored the output row for
//! every key: attention fell from 5.0% to 2.9% of a SmolLM2-135M LoRA step and from 8.7% to
//! ~5.5% of a tiny-256x6 step (docs/PERFORMANCE.md has the profile command). The softmax is the
//! inference path's `infer::softmax_causal_row`.
//!
//! What it must never do: differ from the autograd path beyond float rounding — `tests/fused.rs`
//! compares whole decoders' gradients with candle's own ops. Right padding only: a causal row
//! never sees later positions, so no pad mask is needed.

use rayon::prelude::*;
use wide::f32x8;

use super::fused::rotate_row as rotate;
use super::infer::softmax_causal_row;

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

/// Query rows whose probabilities the backward holds at once (bounds its scratch to
/// `2 · QBLOCK · T` floats per task, whatever the sequence length).
const QBLOCK: usize = 64;

/// `s[j] = a · bt[.., j]` for j in 0..n, with `bt` a (dp, stride) row-major transpose of the
/// keys (or values): eight keys per register, four registers per pass over `a`, so no
/// horizontal sums. `stride` is a multiple of 8 and `s` holds at least `n` rounded up to 8.
fn row_scores(a: &[f32], bt: &[f32], stride: usize, n: usize, s: &mut [f32]) {
    let chunks = n.div_ceil(8);
    let (out, _) = s.as_chunks_mut::<8>();
    let mut c0 = 0;
    while c0 + 4 <= chunks {
        let mut acc = [f32x8::ZERO; 4];
        for (c, &ac) in a.iter().enumerate() {
            let (row, _) = bt[c * stride + c0 * 8..c * stride + c0 * 8 + 32].as_chunks::<8>();
            let av = f32x8::splat(ac);
            for u in 0..4 {
                acc[u] = f32x8::from(row[u]).mul_add(av, acc[u]);
            }
        }
        for u in 0..4 {
            out[c0 + u] = acc[u].to_array();
        }
        c0 += 4;
    }
    while c0 < chunks {
        let mut acc = f32x8::ZERO;
        for (c, &ac) in a.iter().enumerate() {
            let (row, _) = bt[c * stride + c0 * 8..c * stride + c0 * 8 + 8].as_chunks::<8>();
            acc = f32x8::from(row[0]).mul_add(f32x8::splat(ac), acc);
        }
        out[c0] = acc.to_array();
        c0 += 1;
    }
}

/// `out += Σₛ w[s] · rows[s]`, rows (w.len(), dp) row-major with dp a multiple of 8: the output
/// row stays in registers while the rows stream past (no load and store of it per row), in
/// blocks of 8, 4, 2 or 1 registers so that every block's loop has a fixed width.
fn weighted_rows_add(w: &[f32], rows: &[f32], dp: usize, out: &mut [f32]) {
    let (ov, _) = out[..dp].as_chunks_mut::<8>();
    let mut c = 0;
    while c < ov.len() {
        c += match ov.len() - c {
            8.. => weighted_block::<8>(w, rows, dp, c, ov),
            4..=7 => weighted_block::<4>(w, rows, dp, c, ov),
            2 | 3 => weighted_block::<2>(w, rows, dp, c, ov),
            _ => weighted_block::<1>(w, rows, dp, c, ov),
        };
    }
}

/// Registers `c..c + N` of [`weighted_rows_add`]; returns N.
#[inline(always)]
fn weighted_block<const N: usize>(
    w: &[f32],
    rows: &[f32],
    dp: usize,
    c: usize,
    ov: &mut [[f32; 8]],
) -> usize {
    let mut acc = [f32x8::ZERO; N];
    for (a, o) in acc.iter_mut().zip(&ov[c..c + N]) {
        *a = f32x8::from(*o);
    }
    for (&ws, row) in w.iter().zip(rows.chunks_exact(dp)) {
        let (rv, _) = row[c * 8..c * 8 + N * 8].as_chunks::<8>();
        let wv = f32x8::splat(ws);
        for u in 0..N {
            acc[u] = f32x8::from(rv[u]).mul_add(wv, acc[u]);
        }
    }
    for (o, a) in ov[c..c + N].iter_mut().zip(acc) {
        *o = a.to_array();
    }
    N
}

/// Per (batch row, kv head): the geometry, and the rows of one head gathered into (T, dp)
/// blocks, dp = d rounded up to 8 with zero columns (exact: they add nothing to any product).
struct Geometry<'a> {
    op: &'a AttnOp,
    t: usize,
    /// T rounded up to 8: the row stride of transposed blocks and score rows.
    tp: usize,
    dp: usize,
    scale: f32,
}

impl Geometry<'_> {
    fn d(&self) -> usize {
        self.op.shape.head_dim
    }

    /// Head `head`'s rows (T, dp) of `src` (B, T, width) for batch row `b`, rotated to their
    /// positions when `rope`.
    fn gather(&self, src: &[f32], width: usize, b: usize, head: usize, rope: bool) -> Vec<f32> {
        let (t, d, dp) = (self.t, self.d(), self.dp);
        let half = d / 2;
        let mut out = vec![0f32; t * dp];
        for (i, o) in out.chunks_mut(dp).enumerate() {
            let at = (b * t + i) * width + head * d;
            let x = &src[at..at + d];
            if rope {
                let c = &self.op.cos[i * half..(i + 1) * half];
                let s = &self.op.sin[i * half..(i + 1) * half];
                rotate(&mut o[..d], x, c, s, self.op.shape.interleaved, 1.0);
            } else {
                o[..d].copy_from_slice(x);
            }
        }
        out
    }

    /// (dp, tp) transpose of a (T, dp) block, zero past T.
    fn transpose(&self, x: &[f32]) -> Vec<f32> {
        let (tp, dp) = (self.tp, self.dp);
        let mut out = vec![0f32; dp * tp];
        for (i, row) in x.chunks_exact(dp).enumerate() {
            for (c, &v) in row.iter().enumerate() {
                out[c * tp + i] = v;
            }
        }
        out
    }

    /// Rotate every row of `x` (T, dp) back (the transpose of RoPE) into (T, d).
    fn unrotate(&self, x: &[f32]) -> Vec<f32> {
        let (d, dp) = (self.d(), self.dp);
        let half = d / 2;
        let mut out = vec![0f32; self.t * d];
        for (i, (o, x)) in out.chunks_mut(d).zip(x.chunks(dp)).enumerate() {
            let c = &self.op.cos[i * half..(i + 1) * half];
            let s = &self.op.sin[i * half..(i + 1) * half];
            rotate(o, &x[..d], c, s, self.op.shape.interleaved, -1.0);
        }
        out
    }

    /// (T, dp) back to (T, d) (the same buffer when no padding was added).
    fn unpad(&self, x: Vec<f32>) -> Vec<f32> {
        let (d, dp) = (self.d(), self.dp);
        if d == dp {
            return x;
        }
        x.chunks(dp).flat_map(|r| r[..d].iter().copied()).collect()
    }

    /// Softmax of query row `i` against keys 0..=i (`krt` transposed) into `p[..=i]`.
    fn probs(&self, q: &[f32], krt: &[f32], i: usize, p: &mut [f32]) {
        row_scores(q, krt, self.tp, i + 1, p);
        softmax_causal_row(&mut p[..=i], i + 1, 0, self.scale);
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
            tp: t.div_ceil(8) * 8,
            dp: self.shape.head_dim.div_ceil(8) * 8,
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
        let (_, _, groups, qw, kw) = self.widths();
        let g = self.geometry(t);
        let dp = g.dp;
        let krt = g.transpose(&g.gather(k, kw, b, kvh, true));
        let vt = g.gather(v, kw, b, kvh, false);
        let mut out = Vec::with_capacity(groups * t * g.d());
        let mut oh = vec![0f32; t * dp];
        let mut p = vec![0f32; g.tp];
        for gi in 0..groups {
            let qr = g.gather(q, qw, b, kvh * groups + gi, true);
            oh.fill(0.0);
            for (i, o) in oh.chunks_mut(dp).enumerate() {
                g.probs(&qr[i * dp..(i + 1) * dp], &krt, i, &mut p);
                weighted_rows_add(&p[..=i], &vt[..(i + 1) * dp], dp, o);
            }
            out.extend(oh.chunks(dp).flat_map(|r| &r[..g.d()]));
        }
        out
    }

    /// Backward for one (batch row, kv head): (dq (groups, T, d), dk (T, d), dv (T, d)), with
    /// respect to the unrotated projections. Per block of query rows: the probabilities and
    /// score gradients of the block (recomputed, not stored by the forward), dq row by row, then
    /// dk and dv key by key from the block's columns.
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
        let (_, _, groups, qw, kw) = self.widths();
        let g = self.geometry(t);
        let (dp, tp) = (g.dp, g.tp);
        let kr = g.gather(k, kw, b, kvh, true);
        let krt = g.transpose(&kr);
        let vtt = g.transpose(&g.gather(v, kw, b, kvh, false));
        let mut dkr = vec![0f32; t * dp];
        let mut dv = vec![0f32; t * dp];
        let mut dq = Vec::with_capacity(groups * t * g.d());
        // Rows of the block: probabilities and score gradients, tp wide.
        let mut pb = vec![0f32; QBLOCK * tp];
        let mut dsb = vec![0f32; QBLOCK * tp];
        let mut col = vec![0f32; QBLOCK];
        let mut dpi = vec![0f32; tp];
        for gi in 0..groups {
            let h = kvh * groups + gi;
            let qr = g.gather(q, qw, b, h, true);
            let go = g.gather(gr, qw, b, h, false);
            let mut dqr = vec![0f32; t * dp];
            for i0 in (0..t).step_by(QBLOCK) {
                let i1 = (i0 + QBLOCK).min(t);
                for i in i0..i1 {
                    let (qi, goi) = (&qr[i * dp..(i + 1) * dp], &go[i * dp..(i + 1) * dp]);
                    let p = &mut pb[(i - i0) * tp..(i - i0 + 1) * tp];
                    g.probs(qi, &krt, i, p);
                    row_scores(goi, &vtt, tp, i + 1, &mut dpi);
                    let sum: f32 = p[..=i].iter().zip(&dpi).map(|(p, d)| p * d).sum();
                    let ds = &mut dsb[(i - i0) * tp..(i - i0 + 1) * tp];
                    for ((ds, &p), &d) in ds[..=i].iter_mut().zip(&p[..=i]).zip(&dpi) {
                        *ds = p * (d - sum) * g.scale;
                    }
                    weighted_rows_add(&ds[..=i], &kr[..(i + 1) * dp], dp, &mut dqr[i * dp..]);
                }
                // Key j takes the block's rows i ≥ j.
                for j in 0..i1 {
                    let from = j.max(i0);
                    let n = i1 - from;
                    let rows = from * dp..i1 * dp;
                    for (c, r) in col[..n].iter_mut().zip(from - i0..) {
                        *c = dsb[r * tp + j];
                    }
                    weighted_rows_add(&col[..n], &qr[rows.clone()], dp, &mut dkr[j * dp..]);
                    for (c, r) in col[..n].iter_mut().zip(from - i0..) {
                        *c = pb[r * tp + j];
                    }
                    weighted_rows_add(&col[..n], &go[rows], dp, &mut dv[j * dp..]);
                }
            }
            dq.extend_from_slice(&g.unrotate(&dqr));
        }
        (dq, g.unrotate(&dkr), g.unpad(dv))
    }
}

#[cfg(test)]
mod tests {
    //! The blocked kernels against attention written out plainly in f64: sequences longer than
    //! one query block, head sizes that need padding, both RoPE layouts, GQA.
    use super::*;

    fn rand(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn op(shape: AttnShape, t: usize) -> AttnOp {
        let half = shape.head_dim / 2;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for i in 0..t {
            for f in 0..half {
                let a = i as f32 / 10000f32.powf(f as f32 / half as f32);
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        AttnOp { shape, cos, sin }
    }

    /// Row `x` (d) rotated by position `i` (sign −1: back), in f64.
    fn rot(op: &AttnOp, x: &[f64], i: usize, sign: f64) -> Vec<f64> {
        let d = x.len();
        let half = d / 2;
        let mut o = vec![0f64; d];
        for f in 0..half {
            let (c, s) = (
                op.cos[i * half + f] as f64,
                sign * op.sin[i * half + f] as f64,
            );
            let (a, b) = if op.shape.interleaved {
                (2 * f, 2 * f + 1)
            } else {
                (f, f + half)
            };
            o[a] = x[a] * c - x[b] * s;
            o[b] = x[b] * c + x[a] * s;
        }
        o
    }

    type Grads = (Vec<f64>, Vec<f64>, Vec<f64>);

    /// (out, (dq, dk, dv)) in f64, straight from the definitions.
    fn reference(
        op: &AttnOp,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        go: &[f32],
        b: usize,
        t: usize,
    ) -> (Vec<f64>, Grads) {
        let s = op.shape;
        let d = s.head_dim;
        let (qw, kw) = (s.heads * d, s.kv_heads * d);
        let groups = s.heads / s.kv_heads;
        let scale = 1.0 / (d as f64).sqrt();
        let row = |x: &[f32], w: usize, bi: usize, i: usize, h: usize| -> Vec<f64> {
            x[(bi * t + i) * w + h * d..][..d]
                .iter()
                .map(|&v| v as f64)
                .collect()
        };
        let mut out = vec![0f64; b * t * qw];
        let (mut dq, mut dk, mut dv) = (
            vec![0f64; q.len()],
            vec![0f64; k.len()],
            vec![0f64; v.len()],
        );
        for bi in 0..b {
            for h in 0..s.heads {
                let kvh = h / groups;
                let qr: Vec<Vec<f64>> = (0..t)
                    .map(|i| rot(op, &row(q, qw, bi, i, h), i, 1.0))
                    .collect();
                let kr: Vec<Vec<f64>> = (0..t)
                    .map(|i| rot(op, &row(k, kw, bi, i, kvh), i, 1.0))
                    .collect();
                let vv: Vec<Vec<f64>> = (0..t).map(|i| row(v, kw, bi, i, kvh)).collect();
                for i in 0..t {
                    let sc: Vec<f64> = (0..=i)
                        .map(|j| qr[i].iter().zip(&kr[j]).map(|(a, b)| a * b).sum::<f64>() * scale)
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let p: Vec<f64> = e.iter().map(|x| x / z).collect();
                    let goi = row(go, qw, bi, i, h);
                    for c in 0..d {
                        out[(bi * t + i) * qw + h * d + c] = (0..=i).map(|j| p[j] * vv[j][c]).sum();
                    }
                    let dp: Vec<f64> = (0..=i)
                        .map(|j| goi.iter().zip(&vv[j]).map(|(a, b)| a * b).sum())
                        .collect();
                    let sum: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                    let mut dqr = vec![0f64; d];
                    for j in 0..=i {
                        let ds = p[j] * (dp[j] - sum) * scale;
                        let mut dkr = vec![0f64; d];
                        for c in 0..d {
                            dqr[c] += ds * kr[j][c];
                            dkr[c] = ds * qr[i][c];
                            dv[(bi * t + j) * kw + kvh * d + c] += p[j] * goi[c];
                        }
                        for (c, x) in rot(op, &dkr, j, -1.0).into_iter().enumerate() {
                            dk[(bi * t + j) * kw + kvh * d + c] += x;
                        }
                    }
                    for (c, x) in rot(op, &dqr, i, -1.0).into_iter().enumerate() {
                        dq[(bi * t + i) * qw + h * d + c] += x;
                    }
                }
            }
        }
        (out, (dq, dk, dv))
    }

    fn max_rel(a: &[f32], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-12);
        a.iter()
            .zip(b)
            .fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs()))
            / scale
    }

    #[test]
    fn blocked_kernels_match_plain_attention() {
        for (d, t, interleaved) in [
            (12, 150, false),
            (64, 70, true),
            (16, 9, false),
            (8, 64, true),
        ] {
            let shape = AttnShape {
                heads: 4,
                kv_heads: 2,
                head_dim: d,
                interleaved,
            };
            let b = 2;
            let op = op(shape, t);
            let q = rand(b * t * 4 * d, 1);
            let k = rand(b * t * 2 * d, 2);
            let v = rand(b * t * 2 * d, 3);
            let go = rand(b * t * 4 * d, 4);
            let out = op.forward_all(&q, &k, &v, b, t);
            let (dq, dk, dv) = op.backward_all(&q, &k, &v, &go, b, t);
            let (r_out, (r_dq, r_dk, r_dv)) = reference(&op, &q, &k, &v, &go, b, t);
            for (what, x, y) in [
                ("out", &out, &r_out),
                ("dq", &dq, &r_dq),
                ("dk", &dk, &r_dk),
                ("dv", &dv, &r_dv),
            ] {
                let e = max_rel(x, y);
                assert!(
                    e < 1e-5,
                    "d {d} t {t}: {what} differs by {e} (relative to its largest value)"
                );
            }
        }
    }
}
