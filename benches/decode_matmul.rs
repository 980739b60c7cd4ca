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
//!
//! The steps run on a pool worker (`caller: "pool"`), as `Decoder::forward` runs a decode step.
//! The tiles use this CPU's best instruction set; `DECODE_MATMUL_ISA=avx2` runs the AVX2 kernels
//! on an AVX-512 CPU (each line names its `isa`).
//!
//! The `stream` lines give this machine's memory roof in the same run: buffers of the Q8_0
//! step's bytes (the same 120 products of the same sizes), only summed as 64-bit words, split
//! over the pool as the one-row tiles are (one parallel call per product, items of one tile's
//! bytes), and the same bytes in one parallel call per step. The first is what the one-row
//! kernels could reach if their arithmetic were free; the gap between the two is the cost of
//! the 120 calls. Each is also timed from the bench's main thread, outside the pool
//! (`caller: "outside"`), as this bench called every kernel before 2026-12-07: each call then
//! injects its work into the pool and the main thread sleeps until it is done.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use envace::runtime::quant_tiles::{Isa, Tiles, isas};

const LAYERS: usize = 30;
/// (out, in) of a layer's four products.
const SHAPES: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];

/// The kernels' instruction set: `DECODE_MATMUL_ISA` (`avx2` or `avx512`), else the CPU's best.
fn isa() -> candle_core::Result<Isa> {
    let err = |m: String| candle_core::Error::Msg(m);
    let asked = std::env::var("DECODE_MATMUL_ISA").ok();
    let isa = match asked.as_deref() {
        None => isas().first().copied(),
        Some("avx2") => Some(Isa::Avx2),
        Some("avx512") => Some(Isa::Avx512),
        Some(other) => {
            return Err(err(format!(
                "DECODE_MATMUL_ISA={other:?}: expected avx2 or avx512"
            )));
        }
    };
    match isa {
        Some(i) if isas().contains(&i) => Ok(i),
        _ if asked.is_some() => Err(err(format!(
            "DECODE_MATMUL_ISA={:?}: this CPU (or build) has no tile kernels for it",
            asked.unwrap_or_default()
        ))),
        _ => Err(err("no tile kernels on this CPU (or build)".into())),
    }
}

fn layers(types: [GgmlDType; 4], isa: Isa) -> candle_core::Result<(Vec<Tiles>, usize)> {
    let dev = Device::Cpu;
    let mut tiles = Vec::new();
    let mut bytes = 0;
    for _ in 0..LAYERS {
        for (&(out, inp), dtype) in SHAPES.iter().zip(types) {
            let w = Tensor::randn(0f32, 0.05, (out, inp), &dev)?;
            let qt = QTensor::quantize(&w, dtype)?;
            bytes += qt.storage_size_in_bytes();
            let none = || candle_core::Error::Msg("no tile kernels on this CPU".into());
            tiles.push(Tiles::with_isa(&qt, isa)?.ok_or_else(none)?);
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

/// The `stream` baseline: `words[p]` holds product `p`'s bytes as 64-bit words, `items[p]` its
/// tiles; each item sums its own words.
struct Stream {
    words: Vec<Vec<u64>>,
    items: Vec<usize>,
}

impl Stream {
    fn q8_0_step() -> Self {
        let (mut words, mut items) = (Vec::new(), Vec::new());
        for _ in 0..LAYERS {
            for &(out, inp) in &SHAPES {
                // Q8_0: 34 bytes per 32 weights.
                let n = (out * inp / 32 * 34).div_ceil(8);
                words.push((0..n as u64).collect());
                items.push(out / 16);
            }
        }
        Self { words, items }
    }

    fn bytes(&self) -> usize {
        self.words.iter().map(|w| w.len() * 8).sum()
    }

    /// One parallel call per product, as the tiles' one-row step makes.
    fn per_product(&self) {
        for (w, &n) in self.words.iter().zip(&self.items) {
            let per = w.len().div_ceil(n);
            envace::runtime::par::for_each_index(n, false, |i| {
                let part = &w[(i * per).min(w.len())..((i + 1) * per).min(w.len())];
                std::hint::black_box(part.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
            });
        }
    }

    /// Every product's items in one parallel call.
    fn one_call(&self) {
        let at: Vec<(usize, usize)> = self
            .items
            .iter()
            .enumerate()
            .flat_map(|(p, &n)| (0..n).map(move |i| (p, i)))
            .collect();
        envace::runtime::par::for_each_index(at.len(), false, |k| {
            let (p, i) = at[k];
            let w = &self.words[p];
            let per = w.len().div_ceil(self.items[p]);
            let part = &w[(i * per).min(w.len())..((i + 1) * per).min(w.len())];
            std::hint::black_box(part.iter().fold(0u64, |a, &x| a.wrapping_add(x)));
        });
    }
}

/// Where a step's parallel calls come from: the bench's main thread, outside rayon's pool (each
/// call then injects its work into the pool and sleeps until it is done: how these benches
/// called the kernels before 2026-12-07), or a pool worker ([`envace::runtime::par::on_pool`]),
/// as `Decoder::forward` runs a decode step.
#[derive(Clone, Copy)]
enum Caller {
    Outside,
    Pool,
}

impl Caller {
    fn name(self) -> &'static str {
        match self {
            Caller::Outside => "outside",
            Caller::Pool => "pool",
        }
    }
}

/// Median and min of 9 rounds of 10 calls of `f` (after one), in milliseconds per call, the
/// calls made from `caller`.
fn time(
    caller: Caller,
    mut f: impl FnMut() -> candle_core::Result<()> + Send,
) -> candle_core::Result<(f64, f64)> {
    let mut rounds = move || {
        f()?;
        let mut t = Vec::new();
        for _ in 0..9 {
            let start = Instant::now();
            for _ in 0..10 {
                f()?;
            }
            t.push(start.elapsed().as_secs_f64() * 1e3 / 10.0);
        }
        t.sort_by(f64::total_cmp);
        Ok((t[t.len() / 2], t[0]))
    };
    match caller {
        Caller::Outside => rounds(),
        Caller::Pool => envace::runtime::par::on_pool(rounds),
    }
}

fn main() -> candle_core::Result<()> {
    use GgmlDType::*;
    let isa = isa()?;
    let stream = Stream::q8_0_step();
    let mb = stream.bytes() as f64 / 1e6;
    for (name, how) in [("stream_per_product", true), ("stream_one_call", false)] {
        for caller in [Caller::Outside, Caller::Pool] {
            let (median, min) = time(caller, || {
                if how {
                    stream.per_product();
                } else {
                    stream.one_call();
                }
                Ok(())
            })?;
            println!(
                "{{\"types\":\"{name}\",\"caller\":\"{}\",\"rows\":1,\"ms_per_step_median\":{median:.3},\"ms_per_step_min\":{min:.3},\"file_mb\":{mb:.1},\"gb_s\":{:.1}}}",
                caller.name(),
                mb / median
            );
        }
    }
    drop(stream);
    let sets = [
        ("q8_0", [Q8_0, Q8_0, Q8_0, Q8_0]),
        ("q5_0+q6_k", [Q5_0, Q5_0, Q5_0, Q6K]),
        ("q8_0+q6_k", [Q8_0, Q8_0, Q8_0, Q6K]),
        ("q4_1", [Q4_1, Q4_1, Q4_1, Q4_1]),
    ];
    for (name, types) in sets {
        let (tiles, bytes) = layers(types, isa)?;
        for rows in [1, 8] {
            let xs: Vec<Tensor> = SHAPES
                .iter()
                .map(|&(_, inp)| Tensor::randn(0f32, 1.0, (rows, inp), &Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            {
                let caller = Caller::Pool;
                let (median, min) = time(caller, || step(&tiles, &xs))?;
                let macs: usize = SHAPES.iter().map(|(o, i)| o * i * rows * LAYERS).sum();
                println!(
                    "{{\"types\":\"{name}\",\"isa\":\"{isa:?}\",\"caller\":\"{}\",\"rows\":{rows},\"ms_per_step_median\":{median:.3},\"ms_per_step_min\":{min:.3},\"file_mb\":{:.1},\"gb_s\":{:.1},\"gmac_s\":{:.1}}}",
                    caller.name(),
                    bytes as f64 / 1e6,
                    bytes as f64 / 1e6 / median,
                    macs as f64 / median / 1e6
                );
            }
        }
    }
    Ok(())
}
