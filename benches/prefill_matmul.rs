//! Prefill projection benchmark (`cargo bench --bench prefill_matmul`): one SmolLM2-135M layer's
//! projections (q/k/v stacked 576 → 960, o 576 → 576, gate/up stacked 576 → 3,072, down
//! 1,536 → 576) on 512 rows, two ways, interleaved round by round:
//! - `f32_gemm`: candle's gemm against an f32 copy of the weights (prefill on AVX2 CPUs, and
//!   wherever `ENVACE_PREFILL=gemm`);
//! - `tiles`: the decode kernels' tiles ([`Tiles::matmul`]: blocks of rows, each running every
//!   tile in passes of 4 or 8 rows; prefill on CPUs with AVX-512).
//!
//! Weight types: `q8_0` (every projection Q8_0, as in a Q8_0 file), `q5_0+q6_k` (Q5_0 with a
//! Q6_K down projection, as most layers of SmolLM2's Q4_K_M file hold them) and `q4_1`.
//! Prints one JSON object per (types, way): milliseconds per layer (median and min of 7 rounds
//! of 3 calls after a warm-up) and the multiply-adds' rate in GMAC/s. `RAYON_NUM_THREADS=1`
//! measures one core.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use envace::runtime::quant_tiles::Tiles;

const ROWS: usize = 512;
/// (out, in) of the layer's four products.
const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];

struct Proj {
    dense: Tensor,
    tiles: Tiles,
    x: Tensor,
}

fn layer(types: [GgmlDType; 4]) -> candle_core::Result<Vec<Proj>> {
    let dev = Device::Cpu;
    SHAPES
        .iter()
        .zip(types)
        .map(|(&(out, inp), dtype)| {
            let w = Tensor::randn(0f32, 0.05, (out, inp), &dev)?;
            let qt = QTensor::quantize(&w, dtype)?;
            let dense = qt.dequantize(&dev)?;
            let none = || candle_core::Error::Msg("no tile kernels on this CPU".into());
            let tiles = Tiles::new(&qt)?.ok_or_else(none)?;
            let x = Tensor::randn(0f32, 1.0, (ROWS, inp), &dev)?;
            Ok(Proj { dense, tiles, x })
        })
        .collect()
}

fn run(layer: &[Proj], way: usize) -> candle_core::Result<()> {
    for p in layer {
        let y = match way {
            0 => p.x.matmul(&p.dense.t()?)?,
            _ => p.tiles.matmul(&p.x)?,
        };
        std::hint::black_box(y);
    }
    Ok(())
}

fn main() -> candle_core::Result<()> {
    // On a pool worker, as `Decoder::forward` runs (called from outside the pool, every
    // parallel call would inject its work and put this thread to sleep until it is done).
    envace::runtime::par::on_pool(run_all)
}

fn run_all() -> candle_core::Result<()> {
    use GgmlDType::*;
    let sets = [
        ("q8_0", [Q8_0, Q8_0, Q8_0, Q8_0]),
        ("q5_0+q6_k", [Q5_0, Q5_0, Q5_0, Q6K]),
        ("q4_1", [Q4_1, Q4_1, Q4_1, Q4_1]),
    ];
    let ways = ["f32_gemm", "tiles"];
    let macs: usize = SHAPES.iter().map(|(o, i)| o * i * ROWS).sum();
    for (name, types) in sets {
        let l = layer(types)?;
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); ways.len()];
        for w in 0..ways.len() {
            run(&l, w)?;
        }
        for _ in 0..7 {
            for (w, t) in times.iter_mut().enumerate() {
                let start = Instant::now();
                for _ in 0..3 {
                    run(&l, w)?;
                }
                t.push(start.elapsed().as_secs_f64() * 1e3 / 3.0);
            }
        }
        for (w, mut t) in times.into_iter().enumerate() {
            t.sort_by(f64::total_cmp);
            let median = t[t.len() / 2];
            println!(
                "{{\"types\":\"{name}\",\"way\":\"{}\",\"rows\":{ROWS},\"ms_per_layer_median\":{median:.3},\"ms_per_layer_min\":{:.3},\"gmac_s\":{:.1}}}",
                ways[w],
                t[0],
                macs as f64 / median / 1e6
            );
        }
    }
    Ok(())
}
