//! Decode-step attention benchmark (`cargo bench --bench decode_attention`): the fast path
//! (`runtime::infer::attend_one`) on SmolLM2-135M's attention shape (30 layers, 9 query heads,
//! 3 KV heads, head width 64), alone of the rest of a decode step, whose tile kernels and
//! thread-pool waits make `envace bench generate` too noisy on a shared VM to show a change of
//! a few percent in attention. Each step reads 30 layers of distinct keys and values, as a
//! decode does (so the cache misses count), for these shapes:
//! - one row at depth 128, 256, 384 and 576, with no shared prefix (`rows 1, prefix 0`);
//! - one row forked from a 512-token prompt, 64 of its own positions (`Prefix::generate`'s
//!   layout for a single continuation);
//! - eight rehearsal branches forked from a 512-token prompt, 64 own positions each (the
//!   `branch_ratio_k8` shape);
//! - eight rows of 576 own positions each (a `decode_tok_s_b8`-like batch, no prefix).
//!
//! Prints one JSON object per shape: milliseconds per 30-layer step, median and min of 7 rounds
//! of 20 steps after one warm-up round. `RAYON_NUM_THREADS=1` measures one core;
//! `DECODE_ATTENTION_SHAPE=rows,prefix,own` runs that one shape (any sizes) instead.

use std::time::Instant;

use candle_core::{Device, Tensor};
use envace::runtime::infer::attend_one;

const LAYERS: usize = 30;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;

struct Layer {
    prefix: Option<(Tensor, Tensor)>,
    k: Tensor,
    v: Tensor,
}

/// One layer's cache as decode sees it: the rows' own positions narrowed out of a larger
/// capacity (a strided view, as `KvCache` hands them over), and the shared prefix if any.
fn layer(rows: usize, prefix: usize, own: usize) -> candle_core::Result<Layer> {
    let dev = Device::Cpu;
    let cap = own.next_power_of_two().max(64);
    let k = Tensor::randn(0f32, 1.0, (rows, KV_HEADS, cap, HEAD_DIM), &dev)?.narrow(2, 0, own)?;
    let v = Tensor::randn(0f32, 1.0, (rows, KV_HEADS, cap, HEAD_DIM), &dev)?.narrow(2, 0, own)?;
    let prefix = if prefix > 0 {
        Some((
            Tensor::randn(0f32, 1.0, (1, KV_HEADS, prefix, HEAD_DIM), &dev)?,
            Tensor::randn(0f32, 1.0, (1, KV_HEADS, prefix, HEAD_DIM), &dev)?,
        ))
    } else {
        None
    };
    Ok(Layer { prefix, k, v })
}

fn step(q: &Tensor, layers: &[Layer], scale: f32) -> candle_core::Result<()> {
    for l in layers {
        let prefix = l.prefix.as_ref().map(|(k, v)| (k, v));
        std::hint::black_box(attend_one(q, prefix, &l.k, &l.v, &[], scale)?);
    }
    Ok(())
}

fn main() -> candle_core::Result<()> {
    // On a pool worker, as `Decoder::forward` runs (called from outside the pool, every
    // parallel call would inject its work and put this thread to sleep until it is done).
    envace::runtime::par::on_pool(run_all)
}

fn run_all() -> candle_core::Result<()> {
    let shapes = [
        (1, 0, 128),
        (1, 0, 256),
        (1, 0, 384),
        (1, 0, 576),
        (1, 512, 64),
        (8, 512, 64),
        (8, 0, 576),
    ];
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let threads = candle_core::utils::get_num_threads();
    // `DECODE_ATTENTION_SHAPE=rows,prefix,own` runs that shape alone.
    let only: Option<Vec<usize>> = std::env::var("DECODE_ATTENTION_SHAPE")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect());
    let shapes: Vec<(usize, usize, usize)> = match only.as_deref() {
        Some(&[rows, prefix, own]) => vec![(rows, prefix, own)],
        Some(_) => {
            return Err(candle_core::Error::Msg(
                "DECODE_ATTENTION_SHAPE: expected rows,prefix,own".into(),
            ));
        }
        None => shapes.to_vec(),
    };
    for (rows, prefix, own) in shapes {
        let layers = (0..LAYERS)
            .map(|_| layer(rows, prefix, own))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let q = Tensor::randn(0f32, 1.0, (rows, HEADS, 1, HEAD_DIM), &Device::Cpu)?;
        let steps = 20;
        let mut rounds = Vec::new();
        for round in 0..8 {
            let t = Instant::now();
            for _ in 0..steps {
                step(&q, &layers, scale)?;
            }
            if round > 0 {
                rounds.push(t.elapsed().as_secs_f64() * 1e3 / steps as f64);
            }
        }
        rounds.sort_by(f64::total_cmp);
        println!(
            "{{\"rows\":{rows},\"prefix\":{prefix},\"own\":{own},\"threads\":{threads},\
             \"ms_per_step_median\":{:.3},\"ms_per_step_min\":{:.3}}}",
            rounds[rounds.len() / 2],
            rounds[0]
        );
    }
    Ok(())
}
