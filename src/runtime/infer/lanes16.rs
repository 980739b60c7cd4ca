//! Dispatch to the 16-lane loops over a shared prefix ([`super::avx512`]) where this CPU has
//! them; each function returns `false` (and leaves its output alone) where it does not, for
//! [`super`]'s 8-lane loops to run.

#[cfg(target_arch = "x86_64")]
use super::avx512;

/// [`super::score_lanes`] for every lane group (`hp` lanes).
#[cfg(target_arch = "x86_64")]
pub(super) fn score_lanes(
    qt: &[f32],
    hp: usize,
    hd: usize,
    keys: &[f32],
    scale: f32,
    out: &mut [f32],
) -> bool {
    let Some(f) = avx512::token().filter(|_| hp.is_multiple_of(avx512::W)) else {
        return false;
    };
    for lg in 0..hp / avx512::W {
        avx512::score_lanes(f, qt, hp, lg, hd, keys, scale, out);
    }
    true
}

/// [`super::weigh_values`].
#[cfg(target_arch = "x86_64")]
pub(super) fn weigh_values(
    acc: &mut [f32],
    hd: usize,
    vals: &[f32],
    sc: &[f32],
    hp: usize,
) -> bool {
    avx512::token().is_some_and(|f| avx512::weigh_values(f, acc, hd, vals, sc, hp))
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn score_lanes(_: &[f32], _: usize, _: usize, _: &[f32], _: f32, _: &mut [f32]) -> bool {
    false
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn weigh_values(_: &mut [f32], _: usize, _: &[f32], _: &[f32], _: usize) -> bool {
    false
}
