//! The kernels' input side: activation rows quantized to Q8_0 per 32-value block, exactly as
//! candle's `BlockQ8_0::from_float` does, with the per-block sums the offset terms need.

use half::f16;
use wide::{CmpGe, CmpLe, f32x8, i32x8};

use super::BLOCK;

/// Input rows quantized to Q8_0 as the kernels read them, per (row, block) in row-major order.
pub(super) struct Acts {
    /// The block's 32 quantized values as 8 little-endian groups of 4 bytes.
    pub(super) q: Vec<[i32; 8]>,
    /// The block scale (rounded through f16, as candle stores it).
    pub(super) d: Vec<f32>,
    /// `d · Σ q` over the block (the Q4_1 offset term's factor).
    pub(super) s: Vec<f32>,
    /// `32 · Σ q` over values 0..16 and 16..32 of the block (the Q6_K offset terms: its
    /// weights are stored as `q + 32`).
    pub(super) h: Vec<[i32; 2]>,
}

impl Acts {
    /// Candle's `BlockQ8_0::from_float`: `d = amax / 127`, `q = round(x / d)`.
    pub(super) fn quantize(x: &[f32]) -> Self {
        let n = x.len() / BLOCK;
        let mut q = Vec::with_capacity(n);
        let mut d = Vec::with_capacity(n);
        let mut s = Vec::with_capacity(n);
        let mut h = Vec::with_capacity(n);
        for chunk in x.chunks_exact(BLOCK) {
            // Eight lanes at a time; `round` (half away from zero) as truncation plus one step
            // away where the exact remainder is at least a half: the same integers.
            let (c, _) = chunk.as_chunks::<8>();
            let v: [f32x8; BLOCK / 8] = std::array::from_fn(|i| f32x8::from(c[i]));
            let amax = v.iter().fold(f32x8::ZERO, |a, x| a.max(x.abs()));
            let amax = amax.to_array().into_iter().fold(0f32, f32::max);
            let scale = amax / 127.0;
            let id = f32x8::splat(if scale != 0.0 { 1.0 / scale } else { 0.0 });
            let mut qi = [0i32; BLOCK];
            for (i, x) in v.iter().enumerate() {
                let y = *x * id;
                let t = y.trunc_int();
                let frac = y - t.round_float();
                let up: i32x8 = bytemuck::cast(frac.cmp_ge(f32x8::splat(0.5)));
                let down: i32x8 = bytemuck::cast(frac.cmp_le(f32x8::splat(-0.5)));
                // Masks are −1 where set.
                qi[8 * i..8 * i + 8].copy_from_slice(&(t - up + down).to_array());
            }
            let sum: i32 = qi.iter().sum();
            let lo: i32 = 32 * qi[..BLOCK / 2].iter().sum::<i32>();
            let hi = 32 * sum - lo;
            h.push([lo, hi]);
            let mut groups = [0i32; 8];
            for (g, four) in qi.chunks_exact(4).enumerate() {
                groups[g] = i32::from_le_bytes(std::array::from_fn(|j| four[j] as i8 as u8));
            }
            let scale = f16::from_f32(scale).to_f32();
            q.push(groups);
            d.push(scale);
            s.push(scale * sum as f32);
        }
        Self { q, d, s, h }
    }

    /// The rows from `row0` on, `kb` blocks each.
    pub(super) fn rows(&self, row0: usize, kb: usize) -> ActRows<'_> {
        ActRows {
            acts: self,
            start: row0 * kb,
            kb,
        }
    }
}

/// A view of [`Acts`] from one row on.
#[derive(Clone, Copy)]
pub(super) struct ActRows<'a> {
    acts: &'a Acts,
    start: usize,
    kb: usize,
}

impl ActRows<'_> {
    #[inline(always)]
    pub(super) fn q(&self, r: usize, b: usize) -> &[i32; 8] {
        &self.acts.q[self.start + r * self.kb + b]
    }
    #[inline(always)]
    pub(super) fn d(&self, r: usize, b: usize) -> f32 {
        self.acts.d[self.start + r * self.kb + b]
    }
    #[inline(always)]
    pub(super) fn s(&self, r: usize, b: usize) -> f32 {
        self.acts.s[self.start + r * self.kb + b]
    }
    #[inline(always)]
    pub(super) fn h(&self, r: usize, b: usize) -> [i32; 2] {
        self.acts.h[self.start + r * self.kb + b]
    }
}
