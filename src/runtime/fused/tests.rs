//! Every fused op against candle's differentiable ops (values and gradients), the kernel
//! override, and the optimizer against its tensor formula.

use super::*;
use crate::runtime::test_util::max_abs_diff;
use candle_core::{Device, Var};

fn randn(shape: &[usize], seed: u64) -> Tensor {
    // A small LCG: deterministic without a device RNG.
    let n: usize = shape.iter().product();
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let data: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

#[test]
fn override_is_scoped_and_restored() {
    let outer = Kernels::current();
    with_kernels(Kernels::Slow, || {
        assert_eq!(Kernels::current(), Kernels::Slow);
        with_kernels(Kernels::Fused, || {
            assert_eq!(Kernels::current(), Kernels::Fused)
        });
        assert_eq!(Kernels::current(), Kernels::Slow);
    });
    assert_eq!(Kernels::current(), outer);
}

#[test]
fn dot_matches_a_plain_sum_for_odd_lengths() {
    let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f32> = (0..37).map(|i| 1.0 - i as f32 * 0.1).collect();
    let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
    assert!((dot(&a, &b) - want).abs() < 1e-3);
}

#[test]
fn softmax_rows_sum_to_one_and_masked_entries_are_zero() {
    let x = randn(&[3, 5], 1);
    let mask = Tensor::new(&[[0f32, f32::NEG_INFINITY, 0.0, 0.0, 0.0]; 3], &Device::Cpu).unwrap();
    let y = with_kernels(Kernels::Fused, || {
        softmax_last_dim(&x.broadcast_add(&mask).unwrap()).unwrap()
    });
    let rows = y.to_vec2::<f32>().unwrap();
    for r in rows {
        assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(r[1], 0.0);
    }
}

#[test]
fn rms_norm_backward_matches_slow_on_a_large_parallel_batch() {
    // Large enough to take the rayon path (and several dw blocks).
    let x = Var::from_tensor(&randn(&[96, 300], 2)).unwrap();
    let w = Var::from_tensor(&randn(&[300], 3)).unwrap();
    let c = randn(&[96, 300], 4);
    let run = |k| {
        with_kernels(k, || {
            let y = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
            let g = (y * &c).unwrap().sum_all().unwrap().backward().unwrap();
            (
                g.get(x.as_tensor()).unwrap().clone(),
                g.get(w.as_tensor()).unwrap().clone(),
            )
        })
    };
    let (fx, fw) = run(Kernels::Fused);
    let (sx, sw) = run(Kernels::Slow);
    assert!(
        max_abs_diff(&fx, &sx) < 1e-4,
        "dx {}",
        max_abs_diff(&fx, &sx)
    );
    assert!(
        max_abs_diff(&fw, &sw) < 1e-3,
        "dw {}",
        max_abs_diff(&fw, &sw)
    );
}

#[test]
fn adamw_matches_the_tensor_formula() {
    let p0 = randn(&[40_000], 5);
    let g = randn(&[40_000], 6);
    let p = Var::from_tensor(&p0).unwrap();
    let mut m = vec![0.1f32; 40_000];
    let mut v = vec![0.2f32; 40_000];
    let h = AdamWStep {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
        bc1: 0.1,
        bc2: 0.05,
        grad_scale: 0.5,
    };
    with_kernels(Kernels::Fused, || {
        assert!(fused_adamw_for(p.as_tensor(), &g));
        adamw_update(p.as_tensor(), &g, &mut m, &mut v, h).unwrap();
    });
    let gs = (&g * 0.5).unwrap();
    let m_ref = ((gs.clone() * 0.1).unwrap() + 0.1 * 0.9).unwrap();
    let v_ref = ((gs.sqr().unwrap() * 0.05).unwrap() + 0.2 * 0.95).unwrap();
    let u = ((&m_ref / 0.1).unwrap() / ((&v_ref / 0.05).unwrap().sqrt().unwrap() + 1e-8).unwrap())
        .unwrap();
    let p_ref = ((&p0 * (1.0 - 1e-2 * 0.01)).unwrap() - (u * 1e-2).unwrap()).unwrap();
    assert!(max_abs_diff(p.as_tensor(), &p_ref) < 1e-5);
    let m_t = Tensor::from_vec(m, 40_000, &Device::Cpu).unwrap();
    assert!(max_abs_diff(&m_t, &m_ref) < 1e-6);
}

#[test]
fn sum_squares_matches_the_tensor_reduction() {
    let t = randn(&[70_001], 7);
    let want = t
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64;
    let got = with_kernels(Kernels::Fused, || sum_squares(&t).unwrap());
    assert!((got - want).abs() / want < 1e-5, "{got} vs {want}");
}

#[test]
fn out_of_range_targets_are_an_error() {
    let x = randn(&[2, 4], 8);
    let t = Tensor::new(&[1u32, 4], &Device::Cpu).unwrap();
    let r = with_kernels(Kernels::Fused, || token_logprobs(&x, &t));
    assert!(r.is_err());
}
