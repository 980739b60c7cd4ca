//! The AVX-512BW kernels: a 512-bit register holds 4 weights of each of a tile's 16 rows.

use super::{
    ActRows, DmScales, PREFETCH_BLOCKS, Q4Block, Q5Block, Q8Block, Scales32, Simd, TILE, Tiles,
    prefetch,
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

    /// Nibble weights `d · q + m` (Q4_1 with f16 scales, Q4_K with f32).
    #[inline(always)]
    pub(super) fn q4<const R: usize>(
        &self,
        blocks: &[Q4Block],
        dm: &[impl DmScales],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        use std::arch::x86_64::{__m512, __m512i};
        let Simd::Avx512 { f, bw, sse } = self.simd else {
            return;
        };
        let ones = f._mm512_set1_epi16(1);
        let low = f._mm512_set1_epi8(0x0F);
        let zero = f._mm512_setzero_si512();
        let mut facc: [__m512; R] = [f._mm512_setzero_ps(); R];
        for (b, blk) in blocks.iter().enumerate() {
            prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            // i16 lanes: at most 8 products of 15 · 127 each, no saturation.
            let mut acc: [__m512i; R] = [zero; R];
            for h in 0..4 {
                let w: __m512i = bytemuck::cast(blk.qs[h]);
                let lo = f._mm512_and_si512(w, low);
                let hi = f._mm512_and_si512(bw._mm512_srli_epi16::<4>(w), low);
                for r in 0..R {
                    let q = acts.q(r, b);
                    let plo = bw._mm512_maddubs_epi16(lo, f._mm512_set1_epi32(q[h]));
                    let phi = bw._mm512_maddubs_epi16(hi, f._mm512_set1_epi32(q[h + 4]));
                    acc[r] = bw._mm512_add_epi16(acc[r], bw._mm512_add_epi16(plo, phi));
                }
            }
            let [wd, wm] = dm[b].load(f);
            for r in 0..R {
                let sum = f._mm512_cvtepi32_ps(bw._mm512_madd_epi16(acc[r], ones));
                let scale = f._mm512_mul_ps(wd, f._mm512_set1_ps(acts.d(r, b)));
                facc[r] = f._mm512_fmadd_ps(sum, scale, facc[r]);
                facc[r] = f._mm512_fmadd_ps(wm, f._mm512_set1_ps(acts.s(r, b)), facc[r]);
            }
        }
        for r in 0..R {
            out[r] = bytemuck::cast(facc[r]);
        }
    }

    /// 5-bit weights `d · q + m` (Q5_0, Q5_1 with f16 scales; Q5_K with f32).
    #[inline(always)]
    pub(super) fn q5<const R: usize>(
        &self,
        blocks: &[Q5Block],
        dm: &[impl DmScales],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        use std::arch::x86_64::{__m512, __m512i};
        let Simd::Avx512 { f, bw, sse } = self.simd else {
            return;
        };
        let ones = f._mm512_set1_epi16(1);
        let low = f._mm512_set1_epi8(0x0F);
        let bit4 = f._mm512_set1_epi8(0x10);
        let zero = f._mm512_setzero_si512();
        let mut facc: [__m512; R] = [f._mm512_setzero_ps(); R];
        for (b, blk) in blocks.iter().enumerate() {
            prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            let qh: __m512i = bytemuck::cast(blk.qh);
            // i16 lanes per pair of nibble registers: 8 products of at most 31 · 127.
            let mut acc: [[__m512i; R]; 2] = [[zero; R]; 2];
            for n in 0..4 {
                let w: __m512i = bytemuck::cast(blk.qs[n]);
                // Bits 2n and 2n + 1 of each `qh` byte to bit 4 (a 16-bit shift of at most 4
                // keeps bit 4 of each byte within the byte).
                let (hlo, hhi) = match n {
                    0 => (bw._mm512_slli_epi16::<4>(qh), bw._mm512_slli_epi16::<3>(qh)),
                    1 => (bw._mm512_slli_epi16::<2>(qh), bw._mm512_slli_epi16::<1>(qh)),
                    2 => (qh, bw._mm512_srli_epi16::<1>(qh)),
                    _ => (bw._mm512_srli_epi16::<2>(qh), bw._mm512_srli_epi16::<3>(qh)),
                };
                // a | (b & c): truth table 0xF8.
                let lo = f._mm512_and_si512(w, low);
                let lo = f._mm512_ternarylogic_epi32::<0xF8>(lo, hlo, bit4);
                let hi = f._mm512_and_si512(bw._mm512_srli_epi16::<4>(w), low);
                let hi = f._mm512_ternarylogic_epi32::<0xF8>(hi, hhi, bit4);
                for r in 0..R {
                    let q = acts.q(r, b);
                    let plo = bw._mm512_maddubs_epi16(lo, f._mm512_set1_epi32(q[n]));
                    let phi = bw._mm512_maddubs_epi16(hi, f._mm512_set1_epi32(q[n + 4]));
                    acc[n / 2][r] =
                        bw._mm512_add_epi16(acc[n / 2][r], bw._mm512_add_epi16(plo, phi));
                }
            }
            let [wd, wm] = dm[b].load(f);
            for r in 0..R {
                let sum = f._mm512_add_epi32(
                    bw._mm512_madd_epi16(acc[0][r], ones),
                    bw._mm512_madd_epi16(acc[1][r], ones),
                );
                let scale = f._mm512_mul_ps(wd, f._mm512_set1_ps(acts.d(r, b)));
                facc[r] = f._mm512_fmadd_ps(f._mm512_cvtepi32_ps(sum), scale, facc[r]);
                facc[r] = f._mm512_fmadd_ps(wm, f._mm512_set1_ps(acts.s(r, b)), facc[r]);
            }
        }
        for r in 0..R {
            out[r] = bytemuck::cast(facc[r]);
        }
    }

    /// Q6_K: signed byte weights (-32..31), one scale per 16 values (half block).
    #[inline(always)]
    pub(super) fn q6k<const R: usize>(
        &self,
        blocks: &[Q8Block],
        d: &[Scales32],
        acts: ActRows<'_>,
        out: &mut [[f32; TILE]],
    ) {
        use std::arch::x86_64::{__m512, __m512i};
        let Simd::Avx512 { f, bw, sse } = self.simd else {
            return;
        };
        let ones = f._mm512_set1_epi16(1);
        let zero = f._mm512_setzero_si512();
        let mut facc: [__m512; R] = [f._mm512_setzero_ps(); R];
        for (b, blk) in blocks.iter().enumerate() {
            prefetch(sse, blocks, b + PREFETCH_BLOCKS);
            // i16 lanes per half block: 8 products of at most 32 · 127, no saturation.
            let mut acc: [[__m512i; R]; 2] = [[zero; R]; 2];
            for g in 0..8 {
                let w: __m512i = bytemuck::cast(blk.qs[g]);
                let mag = bw._mm512_abs_epi8(w);
                let neg = bw._mm512_movepi8_mask(w);
                for r in 0..R {
                    let a = f._mm512_set1_epi32(acts.q(r, b)[g]);
                    let a = bw._mm512_mask_sub_epi8(a, neg, zero, a);
                    let p = bw._mm512_maddubs_epi16(mag, a);
                    acc[g / 4][r] = bw._mm512_add_epi16(acc[g / 4][r], p);
                }
            }
            let [dlo, dhi]: [__m512; 2] = bytemuck::cast(d[b]);
            for r in 0..R {
                let da = f._mm512_set1_ps(acts.d(r, b));
                let lo = f._mm512_cvtepi32_ps(bw._mm512_madd_epi16(acc[0][r], ones));
                let hi = f._mm512_cvtepi32_ps(bw._mm512_madd_epi16(acc[1][r], ones));
                facc[r] = f._mm512_fmadd_ps(lo, f._mm512_mul_ps(dlo, da), facc[r]);
                facc[r] = f._mm512_fmadd_ps(hi, f._mm512_mul_ps(dhi, da), facc[r]);
            }
        }
        for r in 0..R {
            out[r] = bytemuck::cast(facc[r]);
        }
    }
}
