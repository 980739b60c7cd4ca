//! The AVX-512 forms of decode attention's two loops over a shared prefix (scores against its
//! keys, weighted sum of its values): 16 lanes per FMA where [`super`]'s loops use 8. On a CPU
//! with two 512-bit FMA units that halves the instructions of the part of a decode step that
//! grows with the number of rehearsal branches.
//!
//! What it must never do: change a bit. Every lane runs the arithmetic of the 8-lane loops (the
//! same FMA chain over the same operands in the same order, then the same multiply), so a lane
//! gives the same result whichever loop computes it; only how many lanes share an instruction
//! changes. `tests/infer.rs` compares forked branches with the row decoded alone bit for bit.

// The kernels index several arrays by the same counters on purpose (register blocks).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::__m512;

use pulp::core_arch::x86::Avx512f;

use super::prefetch;

/// Lanes per register.
pub(super) const W: usize = 16;

/// This CPU's AVX-512F token, when the build enabled AVX-512F at compile time (without that each
/// intrinsic would be a function call, slower than the 8-lane loops).
pub(super) fn token() -> Option<Avx512f> {
    if cfg!(target_feature = "avx512f") {
        Avx512f::try_new()
    } else {
        None
    }
}

/// [`super::score_lanes`] for the 16-lane group `lg` (`qt[d·hp + lane]`, `hp` a multiple of
/// 16): `out[j·hp + lane] = (q·k_j) · scale`, each an FMA chain over `d` in order. Eight keys at
/// a time keep eight chains in flight; each key value is broadcast once for 16 lanes.
#[allow(clippy::too_many_arguments)]
pub(super) fn score_lanes(
    f: Avx512f,
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
        score_lanes_hd(f, qt, hp, lg, w, n, |j| &keys[j * w..][..w], scale, out)
    })
}

/// [`score_lanes`] for keys given one at a time.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn score_lanes_hd<'k>(
    f: Avx512f,
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
    let (qc, _) = qt.as_chunks::<W>();
    let groups = hp / W;
    let ql = |d: usize| -> __m512 { bytemuck::cast(qc[d * groups + lg]) };
    let scale = f._mm512_set1_ps(scale);
    let mut store = |j: usize, acc: __m512| {
        let o = j * hp + lg * W;
        let v: [f32; W] = bytemuck::cast(f._mm512_mul_ps(acc, scale));
        out[o..o + W].copy_from_slice(&v);
    };
    let mut j = 0;
    while j + KB <= n {
        if j + 3 * KB <= n {
            for u in 0..KB {
                prefetch(&key(j + 2 * KB + u)[..hd]);
            }
        }
        let ks: [&[f32]; KB] = std::array::from_fn(|u| &key(j + u)[..hd]);
        let mut acc = [f._mm512_setzero_ps(); KB];
        for d in 0..hd {
            let q = ql(d);
            for u in 0..KB {
                acc[u] = f._mm512_fmadd_ps(q, f._mm512_set1_ps(ks[u][d]), acc[u]);
            }
        }
        for (u, &a) in acc.iter().enumerate() {
            store(j + u, a);
        }
        j += KB;
    }
    // The last keys one at a time.
    for j in j..n {
        let k = &key(j)[..hd];
        let mut acc = f._mm512_setzero_ps();
        for (d, &kd) in k.iter().enumerate() {
            acc = f._mm512_fmadd_ps(ql(d), f._mm512_set1_ps(kd), acc);
        }
        store(j, acc);
    }
}

/// For `U` heads at once (`acc`: U × C·16, the outputs of score lanes `h..h + U`):
/// `acc[u] += Σ_j sc[j·hp + h + u] · v_j` over the values `vals` (C·16 each, one after the
/// other), in order of `j` (each lane an FMA chain over the keys; `U·C` chains in flight).
#[inline(always)]
fn weigh_values_c<const C: usize, const U: usize>(
    f: Avx512f,
    acc: &mut [f32],
    vals: &[f32],
    sc: &[f32],
    hp: usize,
    h: usize,
) {
    let (ac, _) = acc.as_chunks_mut::<W>();
    let mut a: [[__m512; C]; U] =
        std::array::from_fn(|u| std::array::from_fn(|c| bytemuck::cast(ac[u * C + c])));
    let (vc, _) = vals.as_chunks::<W>();
    for (j, (v, s)) in vc.chunks_exact(C).zip(sc.chunks_exact(hp)).enumerate() {
        if let Some(ahead) = vc.get((j + 8) * C..(j + 9) * C) {
            prefetch(ahead.as_flattened());
        }
        let s = &s[h..h + U];
        let vs: [__m512; C] = std::array::from_fn(|c| bytemuck::cast(v[c]));
        for u in 0..U {
            let w = f._mm512_set1_ps(s[u]);
            for c in 0..C {
                a[u][c] = f._mm512_fmadd_ps(w, vs[c], a[u][c]);
            }
        }
    }
    for u in 0..U {
        for c in 0..C {
            ac[u * C + c] = bytemuck::cast(a[u][c]);
        }
    }
}

/// [`super::weigh_values`] over a run of values (`n` of `hd` each, one after the other) with
/// the weights of score lanes `0..acc.len() / hd` (`sc[j·hp + lane]`), for head widths of 32,
/// 64 or 128 (`false`, untouched, for others), up to four heads at a time (the same per-lane
/// order whatever the grouping).
pub(super) fn weigh_values(
    f: Avx512f,
    acc: &mut [f32],
    hd: usize,
    vals: &[f32],
    sc: &[f32],
    hp: usize,
) -> bool {
    if !matches!(hd, 32 | 64 | 128) {
        return false;
    }
    let n = vals.len() / hd;
    let sc = &sc[..n * hp];
    let heads = acc.len() / hd;
    let mut h = 0;
    while h < heads {
        let u = match heads - h {
            1 => 1,
            2 | 3 => 2,
            _ => 4,
        };
        let u = if hd == 128 { u.min(2) } else { u };
        let a = &mut acc[h * hd..(h + u) * hd];
        match (hd, u) {
            (32, 4) => weigh_values_c::<2, 4>(f, a, vals, sc, hp, h),
            (32, 2) => weigh_values_c::<2, 2>(f, a, vals, sc, hp, h),
            (32, _) => weigh_values_c::<2, 1>(f, a, vals, sc, hp, h),
            (64, 4) => weigh_values_c::<4, 4>(f, a, vals, sc, hp, h),
            (64, 2) => weigh_values_c::<4, 2>(f, a, vals, sc, hp, h),
            (64, _) => weigh_values_c::<4, 1>(f, a, vals, sc, hp, h),
            (_, 2) => weigh_values_c::<8, 2>(f, a, vals, sc, hp, h),
            _ => weigh_values_c::<8, 1>(f, a, vals, sc, hp, h),
        }
        h += u;
    }
    true
}
