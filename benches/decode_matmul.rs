//! Decode projection benchmark (`cargo bench --bench decode_matmul`): the tile kernels alone on
//! the projections of a decode step, SmolLM2-135M's 30 layers (q/k/v stacked 576 → 960, o
//! 576 → 576, gate/up stacked 576 → 3,072, down 1,536 → 576), each layer its own weights, so
//! that a step streams them from memory as a decode does (attention, norms, the head and the
//! sampler apart). One row (a decode step) and eight (eight rehearsal branches), per weight
//! types: `q8_0` (a Q8_0 file), `q5_0+q6_k` (Q5_0 with a Q6_K down, most layers of SmolLM2's
//! Q4_K_M file), `q8_0+q6_k` (Q8_0 with a Q6_K down, SmolLM2's Q6_K file) and `q4_1`.
//! Prints one JSON object per (types, rows): milliseconds per 30-layer step (median and min of
//! 9 rounds of 10 steps after a warm-up), the weights' bytes in the file's format per step and
//! the multiply-adds' rate. `RAYON_NUM_THREADS=1` measures one core. Envace's whole decode is
//! `envace bench generate`; this isolates the kernels, which that run's noise hides.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use envace::runtime::quant_tiles::Tiles;

const LAYERS: usize = 30;
/// (out, in) of a layer's four products.
const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];

fn layers(types: [GgmlDType; 4]) -> candle_core::Result<(Vec<Tiles>, usize)> {
    let dev = Device::Cpu;
    let mut tiles = Vec::new();
    let mut bytes = 0;
    for _ in 0..LAYERS {
        for (&(out, inp), dtype) in SHAPES.iter().zip(types) {
            let w = Tensor::randn(0f32, 0.05, (out, inp), &dev)?;
            let qt = QTensor::quantize(&w, dtype)?;
            bytes += qt.storage_size_in_bytes();
            let none = || candle_core::Error::Msg("no tile kernels on this CPU".into());
            tiles.push(Tiles::new(&qt)?.ok_or_else(none)?);
        }
    }
    Ok((tiles, bytes))
}

fn step(tiles: &[Tiles], xs: &[Tensor]) -> candle_core::Result<()> {
    for (i, t) in tiles.iter().enumerate() {
        std::hint::black_box(t.matmul(&xs[i % SHAPES.len()])?);
    }
    Ok(())
}

fn main() -> candle_core::Result<()> {
    use GgmlDType::*;
    let sets = [
        ("q8_0", [Q8_0, Q8_0, Q8_0, Q8_0]),
        ("q5_0+q6_k", [Q5_0, Q5_0, Q5_0, Q6K]),
        ("q8_0+q6_k", [Q8_0, Q8_0, Q8_0, Q6K]),
        ("q4_1", [Q4_1, Q4_1, Q4_1, Q4_1]),
    ];
    for (name, types) in sets {
        let (tiles, bytes) = layers(types)?;
        for rows in [1, 8] {
            let xs: Vec<Tensor> = SHAPES
                .iter()
                .map(|&(_, inp)| Tensor::randn(0f32, 1.0, (rows, inp), &Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            step(&tiles, &xs)?;
            let mut t = Vec::new();
            for _ in 0..9 {
                let start = Instant::now();
                for _ in 0..10 {
                    step(&tiles, &xs)?;
                }
                t.push(start.elapsed().as_secs_f64() * 1e3 / 10.0);
            }
            t.sort_by(f64::total_cmp);
            let median = t[t.len() / 2];
            let macs: usize = SHAPES.iter().map(|(o, i)| o * i * rows * LAYERS).sum();
            println!(
                "{{\"types\":\"{name}\",\"rows\":{rows},\"ms_per_step_median\":{median:.3},\"ms_per_step_min\":{:.3},\"file_mb\":{:.1},\"gmac_s\":{:.1}}}",
                t[0],
                bytes as f64 / 1e6,
                macs as f64 / median / 1e6
            );
        }
    }
    Ok(())
}
