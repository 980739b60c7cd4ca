//! The AVX-512BW kernels: a 512-bit register holds 4 weights of each of a tile's 16 rows.

use super::{
    ActRows, DmScales, Nibbles, PREFETCH_BLOCKS, Q6Block, Q6Scales, Q8Block, Simd, TILE, Tiles,
    fifth, prefetch,
};

impl Tiles {
    #[inline(always)]
    pub(super) fn q8<const R: usize>(
        &self,
        blocks: &[Q8Block],
        d: &[[u16; TILE]],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        use std::arch::x86_64::{__m256i, __m512, __m512i};
        let Simd::Avx512 { f, bw, sse } = self.simd else {
            return;
        };
        let ones = f._mm512_set1_epi16(1);
        let zero = f._mm512_setzero_si512();
        let mut facc: [__m512; R] = [f._mm512_setzero_ps(); R];
        for (b, blk) in blocks.iter().enumerate() {
            prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            let mut acc: [__m512i; R] = [zero; R];
            for g in 0..8 {
                let w: __m512i = bytemuck::cast(blk.qs[g]);
                let mag = bw._mm512_abs_epi8(w);
                let neg = bw._mm512_movepi8_mask(w);
                for r in 0..R {
                    let a = f._mm512_set1_epi32(acts.q(r, b)[g]);
                    let a = bw._mm512_mask_sub_epi8(a, neg, zero, a);
                    let p = bw._mm512_madd_epi16(bw._mm512_maddubs_epi16(mag, a), ones);
                    acc[r] = f._mm512_add_epi32(acc[r], p);
                }
            }
            let wd = f._mm512_cvtph_ps(bytemuck::cast::<[u16; TILE], __m256i>(d[b]));
            for r in 0..R {
                let scale = f._mm512_mul_ps(wd, f._mm512_set1_ps(acts.d(r, b)));
                facc[r] = f._mm512_fmadd_ps(f._mm512_cvtepi32_ps(acc[r]), scale, facc[r]);
            }
        }
        for r in 0..R {
            out[r] = bytemuck::cast(facc[r]);
        }
    }

    /// Nibble weights `d · q + m`: 4-bit (Q4_1 with f16 scales, Q4_K with f32) or 5-bit
    /// (Q5_0, Q5_1 with f16 scales, Q5_K with f32), the 5th bits merged into each nibble
    /// register with a shift and a ternary-logic OR.
    #[inline(always)]
    pub(super) fn nibbles<const R: usize>(
        &self,
        blocks: &[impl Nibbles],
        dm: &[impl DmScales],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        use std::arch::x86_64::{__m512, __m512i};
        let Simd::Avx512 { f, bw, sse } = self.simd else {
            return;
        };
        let five = fifth(blocks);
        let ones = f._mm512_set1_epi16(1);
        let low = f._mm512_set1_epi8(0x0F);
        let bit4 = f._mm512_set1_epi8(0x10);
        let zero = f._mm512_setzero_si512();
        let mut facc: [__m512; R] = [f._mm512_setzero_ps(); R];
        for (b, blk) in blocks.iter().enumerate() {
            prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            // i16 lanes: 4-bit, all 16 products of at most 15 · 127 in one sum; 5-bit, 8
            // products of at most 31 · 127 per pair of nibble registers.
            let mut acc: [[__m512i; R]; 2] = [[zero; R]; 2];
            let qh: __m512i = if five {
                bytemuck::cast(*blk.qh())
            } else {
                zero
            };
            for n in 0..4 {
                let w: __m512i = bytemuck::cast(blk.qs()[n]);
                let mut lo = f._mm512_and_si512(w, low);
                let mut hi = f._mm512_and_si512(bw._mm512_srli_epi16::<4>(w), low);
                if five {
                    // Bits 2n and 2n + 1 of each `qh` byte to bit 4 (a 16-bit shift of at most
                    // 4 keeps bit 4 of each byte within the byte); a | (b & c) is table 0xF8.
                    let (hlo, hhi) = match n {
                        0 => (bw._mm512_slli_epi16::<4>(qh), bw._mm512_slli_epi16::<3>(qh)),
                        1 => (bw._mm512_slli_epi16::<2>(qh), bw._mm512_slli_epi16::<1>(qh)),
                        2 => (qh, bw._mm512_srli_epi16::<1>(qh)),
                        _ => (bw._mm512_srli_epi16::<2>(qh), bw._mm512_srli_epi16::<3>(qh)),
                    };
                    lo = f._mm512_ternarylogic_epi32::<0xF8>(lo, hlo, bit4);
                    hi = f._mm512_ternarylogic_epi32::<0xF8>(hi, hhi, bit4);
                }
                let a = if five { n / 2 } else { 0 };
                for r in 0..R {
                    let q = acts.q(r, b);
                    let plo = bw._mm512_maddubs_epi16(lo, f._mm512_set1_epi32(q[n]));
                    let phi = bw._mm512_maddubs_epi16(hi, f._mm512_set1_epi32(q[n + 4]));
                    acc[a][r] = bw._mm512_add_epi16(acc[a][r], bw._mm512_add_epi16(plo, phi));
                }
            }
            let [wd, wm] = dm[b].load(f);
            for r in 0..R {
                let mut sum = bw._mm512_madd_epi16(acc[0][r], ones);
                if five {
                    sum = f._mm512_add_epi32(sum, bw._mm512_madd_epi16(acc[1][r], ones));
                }
                let scale = f._mm512_mul_ps(wd, f._mm512_set1_ps(acts.d(r, b)));
                facc[r] = f._mm512_fmadd_ps(f._mm512_cvtepi32_ps(sum), scale, facc[r]);
                facc[r] = f._mm512_fmadd_ps(wm, f._mm512_set1_ps(acts.s(r, b)), facc[r]);
            }
        }
        for r in 0..R {
            out[r] = bytemuck::cast(facc[r]);
        }
    }

    /// Q6_K in the 6-bit layout (`u = q + 32`, a scale per 16 values): the top bits merged
    /// into each nibble register (shift, ternary-logic OR), `Σ u · a` per half block in i16
    /// lanes of two nibble registers each, less the half's `32 · Σ a`: the integer `Σ q · a`,
    /// times `d · sc`.
    #[inline(always)]
    pub(super) fn q6k<const R: usize>(
        &self,
        blocks: &[Q6Block],
        d: &[Q6Scales],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        use std::arch::x86_64::{__m128i, __m256i, __m512, __m512i};
        let Simd::Avx512 { f, bw, sse } = self.simd else {
            return;
        };
        let ones = f._mm512_set1_epi16(1);
        let low = f._mm512_set1_epi8(0x0F);
        let top = f._mm512_set1_epi8(0x30);
        let zero = f._mm512_setzero_si512();
        let mut facc: [__m512; R] = [f._mm512_setzero_ps(); R];
        for (b, blk) in blocks.iter().enumerate() {
            prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            // acc[half][n / 2]: 4 products of at most 63 · 127 per i16 lane, no saturation.
            let mut acc: [[[__m512i; R]; 2]; 2] = [[[zero; R]; 2]; 2];
            for n in 0..4 {
                let w: __m512i = bytemuck::cast(blk.qs[n]);
                let qh: __m512i = bytemuck::cast(blk.qh[n / 2]);
                // The low nibble's top bits at bit 4 · (n % 2), the high one's 2 above, to
                // bits 4 and 5 (16-bit shifts; what crosses a byte is masked off); a | (b & c)
                // is table 0xF8.
                let (tlo, thi) = if n % 2 == 0 {
                    (bw._mm512_slli_epi16::<4>(qh), bw._mm512_slli_epi16::<2>(qh))
                } else {
                    (qh, bw._mm512_srli_epi16::<2>(qh))
                };
                let lo = f._mm512_and_si512(w, low);
                let hi = f._mm512_and_si512(bw._mm512_srli_epi16::<4>(w), low);
                let lo = f._mm512_ternarylogic_epi32::<0xF8>(lo, tlo, top);
                let hi = f._mm512_ternarylogic_epi32::<0xF8>(hi, thi, top);
                for r in 0..R {
                    let q = acts.q(r, b);
                    let plo = bw._mm512_maddubs_epi16(lo, f._mm512_set1_epi32(q[n]));
                    let phi = bw._mm512_maddubs_epi16(hi, f._mm512_set1_epi32(q[n + 4]));
                    acc[0][n / 2][r] = bw._mm512_add_epi16(acc[0][n / 2][r], plo);
                    acc[1][n / 2][r] = bw._mm512_add_epi16(acc[1][n / 2][r], phi);
                }
            }
            let s = &d[b];
            let wd = f._mm512_cvtph_ps(bytemuck::cast::<[u16; TILE], __m256i>(s.d));
            let [slo, shi]: [[i8; TILE]; 2] = bytemuck::cast(s.sc);
            let sc = |v: [i8; TILE]| {
                let v = f._mm512_cvtepi8_epi32(bytemuck::cast::<[i8; TILE], __m128i>(v));
                f._mm512_mul_ps(wd, f._mm512_cvtepi32_ps(v))
            };
            let (dlo, dhi) = (sc(slo), sc(shi));
            for r in 0..R {
                let da = f._mm512_set1_ps(acts.d(r, b));
                let [hlo, hhi] = acts.h(r, b);
                let half = |a: [__m512i; 2], off: i32| {
                    let sum = f._mm512_add_epi32(
                        bw._mm512_madd_epi16(a[0], ones),
                        bw._mm512_madd_epi16(a[1], ones),
                    );
                    f._mm512_cvtepi32_ps(f._mm512_sub_epi32(sum, f._mm512_set1_epi32(off)))
                };
                let lo = half([acc[0][0][r], acc[0][1][r]], hlo);
                let hi = half([acc[1][0][r], acc[1][1][r]], hhi);
                facc[r] = f._mm512_fmadd_ps(lo, f._mm512_mul_ps(dlo, da), facc[r]);
                facc[r] = f._mm512_fmadd_ps(hi, f._mm512_mul_ps(dhi, da), facc[r]);
            }
        }
        for r in 0..R {
            out[r] = bytemuck::cast(facc[r]);
        }
    }
}
