//! The fused training kernels (`runtime::fused`) against candle's slow differentiable ops: every
//! op's forward and gradients on random inputs (RMSNorm, SwiGLU gate, both RoPE layouts, softmax
//! with and without a causal mask, token log-probs and entropy), GQA decoders of each family end
//! to end (loss and every weight's gradient; Llama and Qwen2 go through the hand-written training
//! pass, `runtime::train_pass`), and AdamW steps. `with_kernels` switches per call,
//! so one process compares both paths.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use envace::runtime::config::Family;
use envace::runtime::fixture::tiny_config;
use envace::runtime::fused::{self, Kernels, with_kernels};
use envace::runtime::train_pass;
use envace::train::model::{
    Example, TrainableModel, batch_tensors, masked_nll, masked_token_terms,
};
use envace::train::optim::{AdamW, AdamWConfig};

const KERNELS: [Kernels; 2] = [Kernels::Fused, Kernels::Slow];

fn rand(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
    let data: Vec<f32> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// max |a − b| / max(1, max |b|).
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
    let d = d.max(0).unwrap().to_scalar::<f32>().unwrap();
    let m = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    d / m.to_scalar::<f32>().unwrap().max(1.0)
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f32) {
    let d = rel_diff(a, b);
    assert!(
        d < tol,
        "{what}: fused vs slow differ by {d} (tolerance {tol})"
    );
}

/// `f` on fresh vars of `inputs` under both kernels; a random cotangent makes the loss
/// Σ f(..)·c. Returns (output, gradient of each input) for fused and slow.
fn both(inputs: &[Tensor], f: impl Fn(&[Tensor]) -> Tensor) -> Vec<(Tensor, Vec<Option<Tensor>>)> {
    KERNELS
        .iter()
        .map(|&k| {
            with_kernels(k, || {
                let vars: Vec<Var> = inputs
                    .iter()
                    .map(|t| Var::from_tensor(t).unwrap())
                    .collect();
                let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                let y = f(&ts);
                let c = rand(y.dims(), 99);
                let g: GradStore = (&y * &c).unwrap().sum_all().unwrap().backward().unwrap();
                let grads = ts.iter().map(|t| g.get(t).cloned()).collect();
                (y, grads)
            })
        })
        .collect()
}

fn compare(what: &str, r: &[(Tensor, Vec<Option<Tensor>>)], tol: f32) {
    let (fused, slow) = (&r[0], &r[1]);
    assert_close(&format!("{what} forward"), &fused.0, &slow.0, tol);
    for (i, (a, b)) in fused.1.iter().zip(&slow.1).enumerate() {
        match (a, b) {
            (Some(a), Some(b)) => assert_close(&format!("{what} grad {i}"), a, b, tol),
            (None, None) => {}
            _ => panic!("{what} grad {i}: one path has a gradient, the other not"),
        }
    }
}

#[test]
fn rms_norm_forward_and_grads_match_slow() {
    for (rows, d, seed) in [(3, 7, 1), (2 * 63, 256, 2), (8 * 64, 256, 3)] {
        let x = rand(&[rows, d], seed);
        let w = rand(&[d], seed + 10);
        let r = both(&[x, w], |t| fused::rms_norm(&t[0], &t[1], 1e-6).unwrap());
        compare(&format!("rms_norm {rows}x{d}"), &r, 1e-4);
        assert!(r[0].1.iter().all(Option::is_some));
    }
}

#[test]
fn frozen_inputs_receive_no_gradient() {
    // A LoRA base: the norm weight is a plain tensor, only x is trained.
    let x = Var::from_tensor(&rand(&[4, 8], 20)).unwrap();
    let w = rand(&[8], 21);
    let u = rand(&[4, 8], 22);
    for k in KERNELS {
        with_kernels(k, || {
            let y = fused::rms_norm(x.as_tensor(), &w, 1e-6).unwrap();
            let y = fused::silu_mul(&y, &u).unwrap();
            let g = y.sum_all().unwrap().backward().unwrap();
            assert!(g.get(x.as_tensor()).is_some(), "{k:?}");
            assert!(g.get(&w).is_none(), "{k:?}: frozen weight got a gradient");
            // candle's own `mul` backward does give the constant one; ours does not.
            if k == Kernels::Fused {
                assert!(g.get(&u).is_none(), "fused: constant got a gradient");
            }
        });
    }
}

#[test]
fn rms_norm_on_a_transposed_view_matches_slow() {
    // The decoder's q/k norms get (b, h, l, d) views of (b, l, h, d) data.
    let x = rand(&[2, 5, 3, 16], 4).transpose(1, 2).unwrap();
    let w = rand(&[16], 5);
    let r = both(&[x, w], |t| {
        fused::rms_norm(&t[0].transpose(1, 2).unwrap(), &t[1], 1e-6).unwrap()
    });
    compare("rms_norm transposed", &r, 1e-4);
}

#[test]
fn rope_both_layouts_match_slow() {
    let (l, d) = (12, 16);
    let pos = Tensor::arange(0u32, l as u32, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .reshape((l, 1))
        .unwrap();
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / d as f32))
        .collect();
    let inv = Tensor::from_vec(inv, (1, d / 2), &Device::Cpu).unwrap();
    let freqs = pos.matmul(&inv).unwrap();
    let (cos, sin) = (freqs.cos().unwrap(), freqs.sin().unwrap());
    for interleaved in [false, true] {
        for (b, h, seed) in [(1, 1, 6), (3, 4, 7), (8, 8, 8)] {
            let x = rand(&[b, h, l, d], seed);
            let r = both(&[x], |t| {
                fused::rope(&t[0], &cos, &sin, interleaved).unwrap()
            });
            compare(
                &format!("rope interleaved={interleaved} b{b} h{h}"),
                &r,
                1e-5,
            );
        }
    }
}

#[test]
fn softmax_with_and_without_causal_mask_matches_slow() {
    let (rows, l) = (24, 20);
    let mut mask = vec![0f32; rows * l];
    for i in 0..rows {
        for j in 0..l {
            if j > i % l {
                mask[i * l + j] = f32::NEG_INFINITY;
            }
        }
    }
    let mask = Tensor::from_vec(mask, (rows, l), &Device::Cpu).unwrap();
    for (masked, shape) in [
        (false, [2, 3, rows, l]),
        (true, [2, 3, rows, l]),
        (true, [40, 4, rows, l]),
    ] {
        let x = rand(&shape, 9);
        let r = both(&[x], |t| {
            let a = if masked {
                t[0].broadcast_add(&mask).unwrap()
            } else {
                t[0].clone()
            };
            fused::softmax_last_dim(&a).unwrap()
        });
        compare(&format!("softmax masked={masked} {shape:?}"), &r, 1e-5);
    }
}

#[test]
fn silu_mul_forward_and_grads_match_silu_times_up() {
    for (shape, seed) in [([3, 5, 7], 12), ([8, 64, 768], 13)] {
        let g = rand(&shape, seed);
        let u = rand(&shape, seed + 1);
        let r = both(&[g, u], |t| fused::silu_mul(&t[0], &t[1]).unwrap());
        compare(&format!("silu_mul {shape:?}"), &r, 1e-5);
    }
}

/// The vector path's `exp` gives 0 where the true value overflows: the gate must still be
/// silu's value there (≈ 0 for large negative inputs, the input for large positive ones).
#[test]
fn silu_mul_holds_at_extreme_gates() {
    let g: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) * 7.5).collect();
    let gt = Tensor::from_vec(g.clone(), (2, 32), &Device::Cpu).unwrap();
    let ut = Tensor::ones((2, 32), DType::F32, &Device::Cpu).unwrap();
    let got = fused::silu_mul(&gt, &ut)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (x, y) in g.iter().zip(&got) {
        let want = x / (1.0 + (-x).exp());
        assert!(
            (want - y).abs() <= 1e-5 * (1.0 + want.abs()),
            "silu({x}) = {y}, want {want}"
        );
    }
}

#[test]
fn token_logprobs_and_entropy_match_log_softmax_and_gather() {
    for (b, t, v, seed) in [(2, 5, 11, 10), (8, 63, 512, 11)] {
        let logits = (rand(&[b, t, v], seed) * 3.0).unwrap();
        let tg: Vec<u32> = (0..b * t).map(|i| ((i * 7919) % v) as u32).collect();
        let tg = Tensor::from_vec(tg, (b, t), &Device::Cpu).unwrap();
        let r = both(std::slice::from_ref(&logits), |x| {
            fused::token_logprobs(&x[0], &tg).unwrap()
        });
        compare(&format!("token_logprobs {b}x{t}x{v}"), &r, 1e-5);
        // Log-probs and entropy together, each weighted by its own cotangent.
        let r = both(&[logits], |x| {
            let (lp, ent) = fused::token_logprobs_entropy(&x[0], &tg, true).unwrap();
            Tensor::stack(&[lp, ent.unwrap()], 0).unwrap()
        });
        compare(&format!("token_logprobs+entropy {b}x{t}x{v}"), &r, 1e-5);
    }
}

fn batch(vocab: u32) -> Vec<Example> {
    (0..4u32)
        .map(|k| {
            let n = 17 + k as usize * 3; // ragged: right padding, masked
            let ids: Vec<u32> = (0..n as u32).map(|i| (i * 31 + k * 17) % vocab).collect();
            let mask = (0..n).map(|i| if i % 3 == 0 { 0.0 } else { 1.0 }).collect();
            Example { ids, mask }
        })
        .collect()
}

/// Loss and every weight's gradient of a GQA decoder, fused vs slow.
fn decoder_grads_match(family: Family, interleaved: bool, tied: bool) {
    let mut cfg = tiny_config(family);
    cfg.rope_interleaved = interleaved;
    cfg.tie_word_embeddings = tied;
    assert!(cfg.num_attention_heads > cfg.num_key_value_heads, "GQA");
    let model = TrainableModel::init(&cfg, 5, &Device::Cpu).unwrap();
    // Without q/k norms the fused side is the hand-written training pass (`train_pass`); with
    // them, candle's autograd over the fused ops.
    assert_eq!(
        with_kernels(Kernels::Fused, || train_pass::applies(&model.decoder)),
        !cfg.qk_norm
    );
    let ex = batch(cfg.vocab_size as u32);
    let refs: Vec<&Example> = ex.iter().collect();
    let run = |k| {
        with_kernels(k, || {
            let (loss, _) = masked_nll(&model.decoder, &refs).unwrap();
            let g = train_pass::backward(&loss).unwrap();
            (loss.to_scalar::<f32>().unwrap(), g)
        })
    };
    let (lf, gf) = run(Kernels::Fused);
    let (ls, gs) = run(Kernels::Slow);
    assert!(
        (lf - ls).abs() < 1e-5 * ls.abs().max(1.0),
        "loss {lf} vs {ls}"
    );
    assert_same_grads(&format!("{family:?}"), &model, &gf, &gs);
}

/// Every weight of `model` has a nonzero gradient in `fused`, equal to `slow`'s within 1e-4.
fn assert_same_grads(what: &str, model: &TrainableModel, fused: &GradStore, slow: &GradStore) {
    let vars = model.named_vars();
    assert!(!vars.is_empty());
    for (name, v) in vars {
        let a = fused
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("fused: no grad for {name}"));
        let b = slow
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("slow: no grad for {name}"));
        let nz = a
            .abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(nz > 0.0, "{what} {name}: zero gradient");
        assert_close(&format!("{what} {name}"), a, b, 1e-4);
    }
}

/// A GRPO-shaped loss (per-position weights on the log-probs, plus an entropy bonus) through
/// `masked_token_terms`: the token terms and every weight's gradient, fused vs slow. On Llama
/// the fused side is the training pass's in-graph token terms (`train_pass::token_terms_at`);
/// on Qwen3 (q/k norms) it is the logits through the fused token-logprob op.
fn token_terms_grads_match(family: Family) {
    let cfg = tiny_config(family);
    let model = TrainableModel::init(&cfg, 7, &Device::Cpu).unwrap();
    assert_eq!(
        with_kernels(Kernels::Fused, || train_pass::applies(&model.decoder)),
        !cfg.qk_norm
    );
    let ex = batch(cfg.vocab_size as u32);
    let refs: Vec<&Example> = ex.iter().collect();
    let (ids, mask) = batch_tensors(&refs, &Device::Cpu).unwrap();
    let weights = (rand(mask.dims(), 3) * &mask).unwrap();
    let run = |k| {
        with_kernels(k, || {
            let (lp, ent) = masked_token_terms(&model.decoder, &ids, &mask, true).unwrap();
            let ent = ent.unwrap();
            let loss = ((&lp * &weights).unwrap().sum_all().unwrap().neg().unwrap()
                - (&ent * &mask)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .affine(0.05, 0.0)
                    .unwrap())
            .unwrap();
            let g = train_pass::backward(&loss).unwrap();
            (lp, ent, g)
        })
    };
    let (lpf, entf, gf) = run(Kernels::Fused);
    let (lps, ents, gs) = run(Kernels::Slow);
    assert_close(&format!("{family:?} log-probs"), &lpf, &lps, 1e-5);
    assert_close(&format!("{family:?} entropy"), &entf, &ents, 1e-5);
    // Unmasked positions stay exactly zero.
    let off: f32 = ((&lpf.abs().unwrap() + &entf.abs().unwrap()).unwrap()
        * mask.affine(-1.0, 1.0).unwrap())
    .unwrap()
    .sum_all()
    .unwrap()
    .to_scalar()
    .unwrap();
    assert_eq!(off, 0.0, "terms outside the mask");
    assert_same_grads(&format!("{family:?} token terms"), &model, &gf, &gs);
}

#[test]
fn llama_token_terms_and_entropy_gradients_fused_equal_slow() {
    token_terms_grads_match(Family::Llama);
}

#[test]
fn qwen3_token_terms_and_entropy_gradients_fused_equal_slow() {
    token_terms_grads_match(Family::Qwen3);
}

/// The hand-written training pass gives the same bits on 1, 2 and 3 threads, run after run:
/// no reduction's order depends on how the scheduler splits the work (the RMSNorm weight
/// gradient summed per fixed block of rows, not a rayon fold), so a seeded GRPO or SFT run
/// reproduces.
#[test]
fn training_pass_gradients_are_the_same_bits_on_any_number_of_threads() {
    let cfg = tiny_config(Family::Llama);
    let model = TrainableModel::init(&cfg, 9, &Device::Cpu).unwrap();
    // Enough rows for several blocks of the norm-weight sum.
    let ex: Vec<Example> = (0..12u32)
        .map(|k| {
            let n = 90 + k as usize;
            let ids = (0..n as u32)
                .map(|i| (i * 37 + k * 11) % cfg.vocab_size as u32)
                .collect();
            Example {
                ids,
                mask: vec![1.0; n],
            }
        })
        .collect();
    let refs: Vec<&Example> = ex.iter().collect();
    let grads = |threads: usize| -> Vec<(String, Vec<u32>)> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            with_kernels(Kernels::Fused, || {
                assert!(train_pass::applies(&model.decoder));
                let (loss, _) = masked_nll(&model.decoder, &refs).unwrap();
                let g = train_pass::backward(&loss).unwrap();
                model
                    .named_vars()
                    .into_iter()
                    .map(|(name, v)| {
                        let t = g.get(v.as_tensor()).unwrap();
                        let bits = t
                            .flatten_all()
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap()
                            .into_iter()
                            .map(f32::to_bits)
                            .collect();
                        (name, bits)
                    })
                    .collect()
            })
        })
    };
    let one = grads(1);
    assert!(
        one.iter().any(|(n, _)| n.contains("norm")),
        "norm weights train"
    );
    for threads in [2, 3, 2] {
        for ((name, a), (_, b)) in one.iter().zip(&grads(threads)) {
            assert!(a == b, "{name}: other bits on {threads} threads");
        }
    }
}

#[test]
fn qwen2_decoder_gradients_fused_equal_slow() {
    decoder_grads_match(Family::Qwen2, false, false);
}

#[test]
fn llama_decoder_with_interleaved_rope_gradients_fused_equal_slow() {
    decoder_grads_match(Family::Llama, true, false);
}

#[test]
fn qwen3_decoder_with_qk_norm_gradients_fused_equal_slow() {
    decoder_grads_match(Family::Qwen3, false, true);
}

#[test]
fn llama_decoder_with_tied_embeddings_gradients_fused_equal_slow() {
    decoder_grads_match(Family::Llama, false, true);
}

#[test]
fn adamw_steps_fused_equal_slow_and_moments_survive_a_switch() {
    let cfg = tiny_config(Family::Qwen2);
    let ex = batch(cfg.vocab_size as u32);
    let refs: Vec<&Example> = ex.iter().collect();
    // Three steps each; the mixed run switches kernels between steps (moments convert).
    let schedules: [[Kernels; 3]; 3] = [
        [Kernels::Fused; 3],
        [Kernels::Slow; 3],
        [Kernels::Fused, Kernels::Slow, Kernels::Fused],
    ];
    let mut results = Vec::new();
    for sched in schedules {
        let model = TrainableModel::init(&cfg, 9, &Device::Cpu).unwrap();
        let mut opt = with_kernels(sched[0], || {
            AdamW::new(model.named_vars(), AdamWConfig::default()).unwrap()
        });
        let mut norms = Vec::new();
        for k in sched {
            with_kernels(k, || {
                let (loss, _) = masked_nll(&model.decoder, &refs).unwrap();
                let g = train_pass::backward(&loss).unwrap();
                norms.push(opt.grad_norm(&g).unwrap());
                opt.step(&g, 1e-2, 0.5).unwrap();
            });
        }
        results.push((model.weights(), opt.state_tensors(), norms));
    }
    let (wf, sf, nf) = &results[0];
    for (w, s, n) in &results[1..] {
        for (a, b) in nf.iter().zip(n) {
            assert!((a - b).abs() < 1e-4 * b.max(1.0), "grad norm {a} vs {b}");
        }
        for (name, t) in wf {
            assert_close(name, t, &w[name], 1e-4);
        }
        assert_eq!(sf.len(), s.len());
        for (name, t) in sf {
            assert_close(name, t, &s[name], 1e-3);
        }
    }
}

/// The training pass's tapes travel with their logits: a plain `loss.backward()` (which leaves
/// the decoder's gradients with the tape's collector) does not leak into the next
/// `train_pass::backward`, and that one gives exactly a fresh step's gradients.
#[test]
fn a_plain_backward_does_not_leak_into_the_next_training_backward() {
    let cfg = tiny_config(Family::Llama);
    let model = TrainableModel::init(&cfg, 7, &Device::Cpu).unwrap();
    let ex = batch(cfg.vocab_size as u32);
    let refs: Vec<&Example> = ex.iter().collect();
    let step = || {
        let (loss, _) = masked_nll(&model.decoder, &refs).unwrap();
        train_pass::backward(&loss).unwrap()
    };
    let fresh = step();
    let (stray, _) = masked_nll(&model.decoder, &refs).unwrap();
    let plain = stray.backward().unwrap();
    let (name, v) = &model.named_vars()[0];
    assert!(
        plain.get(v.as_tensor()).is_none(),
        "{name}: plain backward reached the decoder"
    );
    // A forward that is never differentiated is simply dropped with its loss.
    drop(masked_nll(&model.decoder, &refs).unwrap());
    let again = step();
    for (name, v) in model.named_vars() {
        let (a, b) = (
            fresh.get(v.as_tensor()).unwrap(),
            again.get(v.as_tensor()).unwrap(),
        );
        assert_close(&format!("{name} after a stray backward"), b, a, 1e-6);
    }
}

/// The loss on logits computed at the masked positions only (what SFT and GRPO use) equals the
/// loss on all positions' logits, with the same gradient for every weight (tied embeddings: the
/// head's gradient reaches the embedding through the selected rows only).
#[test]
fn logits_at_masked_positions_only_give_the_full_losses_and_gradients() {
    use envace::train::model::{batch_tensors, masked_token_terms, token_logprobs};
    let mut cfg = tiny_config(Family::Llama);
    cfg.tie_word_embeddings = true;
    let model = TrainableModel::init(&cfg, 9, &Device::Cpu).unwrap();
    let ex = batch(cfg.vocab_size as u32);
    let refs: Vec<&Example> = ex.iter().collect();
    with_kernels(Kernels::Fused, || {
        assert!(train_pass::applies(&model.decoder));
        let (ids, mask) = batch_tensors(&refs, &Device::Cpu).unwrap();
        let full = (token_logprobs(&model.decoder, &ids).unwrap() * &mask).unwrap();
        let lf = full.sum_all().unwrap();
        let gf = train_pass::backward(&lf).unwrap();
        let (sel, ent) = masked_token_terms(&model.decoder, &ids, &mask, true).unwrap();
        assert!(ent.is_some());
        assert_close("per-token log-probs", &sel, &full, 1e-5);
        let ls = sel.sum_all().unwrap();
        let gs = train_pass::backward(&ls).unwrap();
        for (name, v) in model.named_vars() {
            let (a, b) = (
                gs.get(v.as_tensor()).unwrap(),
                gf.get(v.as_tensor()).unwrap(),
            );
            assert_close(&name, a, b, 1e-4);
        }
    });
}

/// Training steps of two trainers at once on one pool, each step on a pool worker with the
/// helpers spinning (as SFT and GRPO run them): a worker waiting inside one step's parallel call
/// may run the other trainer's whole step, and each step must still get exactly its own
/// gradients (the same bits as the step run alone; they do not depend on the thread count).
#[test]
fn concurrent_trainers_on_one_pool_each_get_their_own_gradients() {
    use envace::runtime::par::with_spinning_helpers;
    use std::sync::Arc;
    let cfg = tiny_config(Family::Qwen2);
    let models: Vec<Arc<TrainableModel>> = (0..2)
        .map(|s| Arc::new(TrainableModel::init(&cfg, 11 + s, &Device::Cpu).unwrap()))
        .collect();
    let vocab = cfg.vocab_size as u32;
    let want: Vec<_> = models.iter().map(|m| step_grads(m, vocab)).collect();
    let pool = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap(),
    );
    let handles: Vec<_> = (0..2)
        .map(|i| {
            let (pool, m, want) = (pool.clone(), models[i].clone(), want[i].clone());
            std::thread::spawn(move || {
                for _ in 0..60 {
                    let got = pool.install(|| with_spinning_helpers(|| step_grads(&m, vocab)));
                    assert!(
                        got == want,
                        "trainer {i}: gradients differ from its step alone"
                    );
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// Every weight's gradient of one training step of `m` on [`batch`], in `named_vars` order.
fn step_grads(m: &TrainableModel, vocab: u32) -> Vec<Vec<f32>> {
    let ex = batch(vocab);
    let refs: Vec<&Example> = ex.iter().collect();
    let (loss, _) = masked_nll(&m.decoder, &refs).unwrap();
    let g = train_pass::backward(&loss).unwrap();
    m.named_vars()
        .iter()
        .map(|(_, v)| g.get(v.as_tensor()).unwrap().flatten_all().unwrap())
        .map(|t| t.to_vec1::<f32>().unwrap())
        .collect()
}
