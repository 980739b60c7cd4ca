//! The AVX2 + FMA kernels, for CPUs without AVX-512: a 256-bit register holds 4 weights of 8
//! rows, so each tile is computed as two halves of 8 rows from the same repacked blocks.

use std::arch::x86_64::__m256;

use super::{
    ActRows, DmScales, Nibbles, PREFETCH_BLOCKS, Q6Block, Q6Scales, Q8Block, Simd, TILE, Tiles,
    f16x8, fifth, prefetch,
};

/// Half `h` (rows 8h..8h+8) of a 16-row register's 64 bytes, as an AVX2 register.
#[inline(always)]
fn half_reg(bytes: &[u8; 64], h: usize) -> std::arch::x86_64::__m256i {
    // By reference: a by-value cast of all 64 bytes went through a stack copy (measured: the
    // reload waited on the store in the profile).
    let halves: &[[u8; 32]; 2] = bytemuck::cast_ref(bytes);
    bytemuck::cast(halves[h])
}

/// Rows 8h..8h+8 of each of `R` output rows.
#[inline(always)]
fn store_half<const R: usize>(out: &mut [[f32; TILE]], h: usize, facc: &[__m256; R]) {
    for (o, f) in out.iter_mut().zip(facc) {
        o[8 * h..8 * h + 8].copy_from_slice(&bytemuck::cast::<__m256, [f32; 8]>(*f));
    }
}

/// A kernel's rows over both 8-row halves of the tile: one pass of `$pass` taking both halves
/// when `$both` (few rows: each block read once, each activation broadcast once), else one
/// pass per half (more rows' accumulators for both halves would not fit the 16 registers).
macro_rules! by_halves {
    ($self:ident . $pass:ident :: <$r:ident>, $both:expr, ($($arg:expr),*)) => {
        if $both {
            $self.$pass::<$r, 2>($($arg,)* 0);
        } else {
            for h in 0..2 {
                $self.$pass::<$r, 1>($($arg,)* h);
            }
        }
    };
}

impl Tiles {
    /// AVX2 Q8_0, by the halves of the tile (see [`super::Isa`]); the weights' signs go onto the
    /// activations with `sign` (AVX-512: a masked negation), the rest as [`Self::q8`]. One or
    /// two rows (decode) take both halves in one pass over the blocks (each block read once,
    /// each activation broadcast for both); more rows take one pass per half (their
    /// accumulators for both halves would not fit the 16 registers). Each lane's sums run in
    /// the same order either way, so a row gives the same bits batched or alone.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn q8_avx2<const R: usize>(
        &self,
        blocks: &[Q8Block],
        d: &[[u16; TILE]],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        by_halves!(self.q8_avx2_pass::<R>, R <= 2, (blocks, d, acts, out));
    }

    /// One pass of [`Self::q8_avx2`] over the blocks: halves `h0..h0 + H` of the tile.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn q8_avx2_pass<const R: usize, const H: usize>(
        &self,
        blocks: &[Q8Block],
        d: &[[u16; TILE]],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
        h0: usize,
    ) {
        use std::arch::x86_64::__m256i;
        let Simd::Avx2 { x, x2, fma, sse } = self.simd else {
            return;
        };
        let ones = x._mm256_set1_epi16(1);
        let mut facc: [[__m256; R]; H] = [[x._mm256_setzero_ps(); R]; H];
        for (b, blk) in blocks.iter().enumerate() {
            if h0 == 0 {
                prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            }
            let mut acc: [[__m256i; R]; H] = [[x._mm256_setzero_si256(); R]; H];
            for g in 0..8 {
                let mut w = [x._mm256_setzero_si256(); H];
                let mut mag = [x._mm256_setzero_si256(); H];
                for k in 0..H {
                    w[k] = half_reg(&blk.qs[g], h0 + k);
                    mag[k] = x2._mm256_abs_epi8(w[k]);
                }
                for r in 0..R {
                    let a = x._mm256_set1_epi32(acts.q(r, b)[g]);
                    for k in 0..H {
                        let s = x2._mm256_sign_epi8(a, w[k]);
                        let p = x2._mm256_madd_epi16(x2._mm256_maddubs_epi16(mag[k], s), ones);
                        acc[k][r] = x2._mm256_add_epi32(acc[k][r], p);
                    }
                }
            }
            for k in 0..H {
                let h = h0 + k;
                let wd: __m256 = bytemuck::cast(f16x8(&d[b][8 * h..8 * h + 8]));
                for r in 0..R {
                    let scale = x._mm256_mul_ps(wd, x._mm256_set1_ps(acts.d(r, b)));
                    facc[k][r] =
                        fma._mm256_fmadd_ps(x._mm256_cvtepi32_ps(acc[k][r]), scale, facc[k][r]);
                }
            }
        }
        for (k, f) in facc.iter().enumerate() {
            store_half(out, h0 + k, f);
        }
    }

    /// AVX2 nibble weights `d · q + m`, 4- or 5-bit (see [`Self::nibbles`]), by the halves of
    /// the tile, the 5th bits merged with and/or; one pass for both halves or one per half, as
    /// [`Self::q8_avx2`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn nibbles_avx2<const R: usize>(
        &self,
        blocks: &[impl Nibbles],
        dm: &[impl DmScales],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        by_halves!(self.nibbles_avx2_pass::<R>, R <= 2, (blocks, dm, acts, out));
    }

    /// One pass of [`Self::nibbles_avx2`] over the blocks: halves `h0..h0 + H` of the tile.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn nibbles_avx2_pass<const R: usize, const H: usize>(
        &self,
        blocks: &[impl Nibbles],
        dm: &[impl DmScales],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
        h0: usize,
    ) {
        use std::arch::x86_64::__m256i;
        let Simd::Avx2 { x, x2, fma, sse } = self.simd else {
            return;
        };
        let five = fifth(blocks);
        let ones = x._mm256_set1_epi16(1);
        let low = x._mm256_set1_epi8(0x0F);
        let bit4 = x._mm256_set1_epi8(0x10);
        let zero = x._mm256_setzero_si256();
        let mut facc: [[__m256; R]; H] = [[x._mm256_setzero_ps(); R]; H];
        for (b, blk) in blocks.iter().enumerate() {
            if h0 == 0 {
                prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            }
            // i16 lanes as in the AVX-512 kernel: acc[half][5-bit pair][row].
            let mut acc: [[[__m256i; R]; 2]; H] = [[[zero; R]; 2]; H];
            let qh: [__m256i; H] = std::array::from_fn(|k| {
                if five {
                    half_reg(blk.qh(), h0 + k)
                } else {
                    zero
                }
            });
            for n in 0..4 {
                let a = if five { n / 2 } else { 0 };
                let mut lo = [zero; H];
                let mut hi = [zero; H];
                for k in 0..H {
                    let w = half_reg(&blk.qs()[n], h0 + k);
                    lo[k] = x2._mm256_and_si256(w, low);
                    hi[k] = x2._mm256_and_si256(x2._mm256_srli_epi16::<4>(w), low);
                    if five {
                        let q = qh[k];
                        let (hlo, hhi) = match n {
                            0 => (x2._mm256_slli_epi16::<4>(q), x2._mm256_slli_epi16::<3>(q)),
                            1 => (x2._mm256_slli_epi16::<2>(q), x2._mm256_slli_epi16::<1>(q)),
                            2 => (q, x2._mm256_srli_epi16::<1>(q)),
                            _ => (x2._mm256_srli_epi16::<2>(q), x2._mm256_srli_epi16::<3>(q)),
                        };
                        lo[k] = x2._mm256_or_si256(lo[k], x2._mm256_and_si256(hlo, bit4));
                        hi[k] = x2._mm256_or_si256(hi[k], x2._mm256_and_si256(hhi, bit4));
                    }
                }
                for r in 0..R {
                    let q = acts.q(r, b);
                    let (alo, ahi) = (x._mm256_set1_epi32(q[n]), x._mm256_set1_epi32(q[n + 4]));
                    for k in 0..H {
                        let plo = x2._mm256_maddubs_epi16(lo[k], alo);
                        let phi = x2._mm256_maddubs_epi16(hi[k], ahi);
                        acc[k][a][r] =
                            x2._mm256_add_epi16(acc[k][a][r], x2._mm256_add_epi16(plo, phi));
                    }
                }
            }
            for k in 0..H {
                let [wd, wm]: [__m256; 2] = bytemuck::cast(dm[b].half8(h0 + k));
                for r in 0..R {
                    let mut sum = x2._mm256_madd_epi16(acc[k][0][r], ones);
                    if five {
                        sum = x2._mm256_add_epi32(sum, x2._mm256_madd_epi16(acc[k][1][r], ones));
                    }
                    let scale = x._mm256_mul_ps(wd, x._mm256_set1_ps(acts.d(r, b)));
                    let f = fma._mm256_fmadd_ps(x._mm256_cvtepi32_ps(sum), scale, facc[k][r]);
                    facc[k][r] = fma._mm256_fmadd_ps(wm, x._mm256_set1_ps(acts.s(r, b)), f);
                }
            }
        }
        for (k, f) in facc.iter().enumerate() {
            store_half(out, h0 + k, f);
        }
    }

    /// AVX2 Q6_K in the 6-bit layout (see [`Self::q6k`]), by the halves of the tile; the top
    /// bits merged with and/or. One row (decode) takes both halves in one pass over the blocks,
    /// as [`Self::q8_avx2`]; more rows take one pass per half (a half's accumulators are four
    /// registers per row here, lows and highs apart, so two halves of two rows would fill all
    /// sixteen). Each lane's sums run in the same order either way.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) fn q6k_avx2<const R: usize>(
        &self,
        blocks: &[Q6Block],
        d: &[Q6Scales],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        by_halves!(self.q6k_avx2_pass::<R>, R == 1, (blocks, d, acts, out));
    }

    /// One pass of [`Self::q6k_avx2`] over the blocks: halves `h0..h0 + H` of the tile.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn q6k_avx2_pass<const R: usize, const H: usize>(
        &self,
        blocks: &[Q6Block],
        d: &[Q6Scales],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
        h0: usize,
    ) {
        use std::arch::x86_64::{__m128i, __m256i};
        let Simd::Avx2 { x, x2, fma, sse } = self.simd else {
            return;
        };
        let ones = x._mm256_set1_epi16(1);
        let low = x._mm256_set1_epi8(0x0F);
        let top = x._mm256_set1_epi8(0x30);
        let zero = x._mm256_setzero_si256();
        let mut facc: [[__m256; R]; H] = [[x._mm256_setzero_ps(); R]; H];
        for (b, blk) in blocks.iter().enumerate() {
            if h0 == 0 {
                prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            }
            // i16 lanes as in the AVX-512 kernel: acc[half][low/high nibble][n / 2][row].
            let mut acc: [[[[__m256i; R]; 2]; 2]; H] = [[[[zero; R]; 2]; 2]; H];
            for n in 0..4 {
                let mut lo = [zero; H];
                let mut hi = [zero; H];
                for k in 0..H {
                    let w = half_reg(&blk.qs[n], h0 + k);
                    let qh = half_reg(&blk.qh[n / 2], h0 + k);
                    let (tlo, thi) = if n % 2 == 0 {
                        (x2._mm256_slli_epi16::<4>(qh), x2._mm256_slli_epi16::<2>(qh))
                    } else {
                        (qh, x2._mm256_srli_epi16::<2>(qh))
                    };
                    lo[k] = x2._mm256_or_si256(
                        x2._mm256_and_si256(w, low),
                        x2._mm256_and_si256(tlo, top),
                    );
                    hi[k] = x2._mm256_or_si256(
                        x2._mm256_and_si256(x2._mm256_srli_epi16::<4>(w), low),
                        x2._mm256_and_si256(thi, top),
                    );
                }
                for r in 0..R {
                    let q = acts.q(r, b);
                    let (alo, ahi) = (x._mm256_set1_epi32(q[n]), x._mm256_set1_epi32(q[n + 4]));
                    for k in 0..H {
                        let plo = x2._mm256_maddubs_epi16(lo[k], alo);
                        let phi = x2._mm256_maddubs_epi16(hi[k], ahi);
                        acc[k][0][n / 2][r] = x2._mm256_add_epi16(acc[k][0][n / 2][r], plo);
                        acc[k][1][n / 2][r] = x2._mm256_add_epi16(acc[k][1][n / 2][r], phi);
                    }
                }
            }
            let s = &d[b];
            for k in 0..H {
                let h = h0 + k;
                let wd: __m256 = bytemuck::cast(f16x8(&s.d[8 * h..8 * h + 8]));
                let sc = |at: usize| {
                    let mut v = [0i8; TILE];
                    v[..8].copy_from_slice(&s.sc[at..at + 8]);
                    let v = x2._mm256_cvtepi8_epi32(bytemuck::cast::<[i8; TILE], __m128i>(v));
                    x._mm256_mul_ps(wd, x._mm256_cvtepi32_ps(v))
                };
                let (dlo, dhi) = (sc(8 * h), sc(TILE + 8 * h));
                for r in 0..R {
                    let da = x._mm256_set1_ps(acts.d(r, b));
                    let [hlo, hhi] = acts.h(r, b);
                    let half = |a: [__m256i; 2], off: i32| {
                        let sum = x2._mm256_add_epi32(
                            x2._mm256_madd_epi16(a[0], ones),
                            x2._mm256_madd_epi16(a[1], ones),
                        );
                        x._mm256_cvtepi32_ps(x2._mm256_sub_epi32(sum, x._mm256_set1_epi32(off)))
                    };
                    let lo = half([acc[k][0][0][r], acc[k][0][1][r]], hlo);
                    let hi = half([acc[k][1][0][r], acc[k][1][1][r]], hhi);
                    facc[k][r] = fma._mm256_fmadd_ps(lo, x._mm256_mul_ps(dlo, da), facc[k][r]);
                    facc[k][r] = fma._mm256_fmadd_ps(hi, x._mm256_mul_ps(dhi, da), facc[k][r]);
                }
            }
        }
        for (k, f) in facc.iter().enumerate() {
            store_half(out, h0 + k, f);
        }
    }

    // Off x86_64 `Tiles::new` returns `None`, so these are never called.
}
