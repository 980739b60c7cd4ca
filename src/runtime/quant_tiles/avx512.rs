//! The AVX-512BW kernels: a 512-bit register holds 4 weights of each of a tile's 16 rows.

use super::{
    ActRows, DmScales, Nibbles, PREFETCH_BLOCKS, Q8Block, Scales32, Simd, TILE, Tiles, fifth,
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
