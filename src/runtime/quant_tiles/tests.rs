//! Exactness tests of the tiled kernels: every kind, with every instruction set this CPU has,
//! against the file's dequantized weights (f64 reference per block) for 1-8 rows and ragged
//! tiles, stacking, and refusals.

use super::*;
use candle_core::quantized::{QMatMul, QStorage};
use candle_core::{Module, Tensor};

/// The weight's own dot product in f64: its stored blocks (scales through f16) against the
/// activations quantized as the kernels do, integer sums per block.
fn reference(qt: &QTensor, x: &[f32]) -> Vec<f64> {
    let (out, inp) = qt.shape().dims2().unwrap();
    let data = qt.data().unwrap();
    let kb = inp / BLOCK;
    let acts = Acts::quantize(x);
    let bb = data.len() / (out * kb);
    let h = |s: &[u8], i: usize| f16::from_le_bytes([s[i], s[i + 1]]).to_f32() as f64;
    (0..out)
        .map(|o| {
            (0..kb)
                .map(|b| {
                    let s = &data[(o * kb + b) * bb..(o * kb + b + 1) * bb];
                    let qa: Vec<i64> = acts.q[b]
                        .iter()
                        .flat_map(|g| g.to_le_bytes().map(|v| v as i8 as i64))
                        .collect();
                    let da = acts.d[b] as f64;
                    match qt.dtype() {
                        GgmlDType::Q8_0 => {
                            let isum: i64 = s[2..]
                                .iter()
                                .zip(&qa)
                                .map(|(&w, a)| w as i8 as i64 * a)
                                .sum();
                            h(s, 0) * da * isum as f64
                        }
                        _ => (0..BLOCK)
                            .map(|i| {
                                let byte = s[4 + i % 16];
                                let q = if i < 16 { byte & 15 } else { byte >> 4 } as f64;
                                (h(s, 0) * q + h(s, 2)) * da * qa[i] as f64
                            })
                            .sum(),
                    }
                })
                .sum()
        })
        .collect()
}

/// Every instruction set this CPU runs the kernels with, paired with every type.
fn each_isa<const N: usize>(dtypes: [GgmlDType; N]) -> Vec<(Isa, GgmlDType)> {
    isas()
        .into_iter()
        .flat_map(|isa| dtypes.map(|d| (isa, d)))
        .collect()
}

fn quantized(out: usize, inp: usize, dtype: GgmlDType) -> QTensor {
    let w = Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu).unwrap();
    QTensor::quantize(&w, dtype).unwrap()
}

/// Without AVX-512BW or AVX2 the loader keeps candle's quantized matmul (`Tiles::new` gives
/// `None`): that fallback must compute the same block dot products the tiles would.
fn check_fallback(dtype: GgmlDType, out: usize, inp: usize) {
    let w = Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu).unwrap();
    let qt = QTensor::quantize(&w, dtype).unwrap();
    let requant = matches!(dtype, GgmlDType::Q4_1);
    let qm = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap()).unwrap();
    for rows in [1, 3, MAX_ROWS] {
        let x = Tensor::randn(0f32, 1.0, (rows, inp), &Device::Cpu).unwrap();
        let got = qm.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        for (r, xr) in x.to_vec2::<f32>().unwrap().iter().enumerate() {
            let want = reference(&qt, xr);
            for (a, b) in got[r].iter().zip(&want) {
                // For Q8_0 weights candle quantizes activations to Q8_0 as the tiles do (only
                // summation order differs); for Q4_1 to Q8_1, whose block sums are stored as
                // f16.
                // Terms are ~N(0, 1), so a row's sum is of order sqrt(inp); a wrong
                // kernel or layout is off by that much.
                let tol = if requant {
                    5e-3 * (inp as f64).sqrt()
                } else {
                    1e-4 * (1.0 + b.abs())
                };
                assert!(
                    (*a as f64 - b).abs() <= tol,
                    "{dtype:?} fallback {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn candles_quantized_matmul_fallback_matches_the_block_reference() {
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1] {
        check_fallback(dtype, 40, 576);
        check_fallback(dtype, 16, 32);
    }
}

#[test]
fn tiles_equal_the_blocks_dot_product_for_every_row_count_and_a_ragged_tile() {
    if !available() {
        // What runs instead on this CPU.
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_1] {
            assert!(Tiles::new(&quantized(40, 576, dtype)).unwrap().is_none());
            check_fallback(dtype, 40, 576);
        }
        return;
    }
    // 40 rows leave a partial last tile.
    for (isa, dtype) in each_isa([GgmlDType::Q8_0, GgmlDType::Q4_1]) {
        for (out, inp) in [(40, 576), (64, 1536), (16, 32)] {
            let qt = quantized(out, inp, dtype);
            let tiles = Tiles::with_isa(&qt, isa).unwrap().unwrap();
            assert_eq!(tiles.isa(), isa);
            // Decode batches, and prefills of many rows (passes of a few per tile).
            for rows in (1..=MAX_ROWS).chain([MAX_ROWS + 5, 37]) {
                let x = Tensor::randn(0f32, 1.0, (rows, inp), &Device::Cpu).unwrap();
                let ours = tiles.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
                let xs = x.to_vec2::<f32>().unwrap();
                for r in 0..rows {
                    let want = reference(&qt, &xs[r]);
                    for (a, b) in ours[r].iter().zip(&want) {
                        // Only the f32 rounding and order of the block sums differ.
                        let tol = 1e-5 * (1.0 + b.abs()) + 1e-4;
                        assert!((*a as f64 - b).abs() <= tol, "{isa:?} {dtype:?} {a} vs {b}");
                    }
                    // Each row equals the same row alone, bit for bit.
                    let alone = tiles.matmul(&x.narrow(0, r, 1).unwrap()).unwrap();
                    assert_eq!(alone.to_vec2::<f32>().unwrap()[0], ours[r]);
                }
            }
        }
    }
}

#[test]
fn q8_tiles_match_candles_q8_kernel() {
    // candle's kernel is what runs without the tiles: it must match the block reference.
    check_fallback(GgmlDType::Q8_0, 48, 576);
    if !available() {
        return;
    }
    // 576 is not a multiple of 256: candle runs its Q8_0 × Q8_0 vec_dot (its VNNI path for
    // multiples of 256 quantizes activations per 256 values instead).
    let w = Tensor::randn(0f32, 1.0, (48, 576), &Device::Cpu).unwrap();
    let qm = QMatMul::from_qtensor(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()).unwrap();
    for isa in isas() {
        let tiles = Tiles::with_isa(&QTensor::quantize(&w, GgmlDType::Q8_0).unwrap(), isa)
            .unwrap()
            .unwrap();
        for rows in [1, 3, 8] {
            let x = Tensor::randn(0f32, 1.0, (rows, 576), &Device::Cpu).unwrap();
            let ours = tiles.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
            let theirs = qm.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            for (a, b) in ours.iter().flatten().zip(theirs.iter().flatten()) {
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                    "{isa:?}: {a} vs candle {b}"
                );
            }
        }
    }
}

#[test]
fn stacked_tiles_equal_the_parts_side_by_side() {
    if !available() {
        // Nothing is stacked into tiles here; the loader's stacked QMatMul serves instead
        // (tests/runtime.rs compares the whole GGUF model with candle's quantized llama).
        assert!(Tiles::stack(&[]).is_none());
        check_fallback(GgmlDType::Q8_0, 72, 64);
        return;
    }
    for (isa, dtype) in each_isa([GgmlDType::Q8_0, GgmlDType::Q4_1]) {
        let parts: Vec<Tiles> = [32, 16, 24]
            .iter()
            .map(|&o| {
                Tiles::with_isa(&quantized(o, 64, dtype), isa)
                    .unwrap()
                    .unwrap()
            })
            .collect();
        let stacked = Tiles::stack(&parts.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(stacked.dims(), (72, 64));
        let x = Tensor::randn(0f32, 1.0, (2, 64), &Device::Cpu).unwrap();
        let alone: Vec<Tensor> = parts.iter().map(|p| p.matmul(&x).unwrap()).collect();
        let want = Tensor::cat(&alone, 1).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(stacked.matmul(&x).unwrap().to_vec2::<f32>().unwrap(), want);
        // A part that does not fill its last tile can only come last.
        let ragged = [&parts[2], &parts[0]];
        assert!(Tiles::stack(&ragged).is_none());
    }
}

const K_QUANTS: [GgmlDType; 3] = [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K];

/// The weight as candle dequantizes it (f32) against the activations quantized as
/// the kernels do, per 32-block `d_a · Σ w · q_a`, in f64.
fn reference_dequantized(qt: &QTensor, x: &[f32]) -> Vec<f64> {
    let w = qt
        .dequantize(&Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let acts = Acts::quantize(x);
    w.iter()
        .map(|row| {
            row.chunks_exact(BLOCK)
                .enumerate()
                .map(|(b, wb)| {
                    let qa = acts.q[b].iter().flat_map(|g| g.to_le_bytes());
                    let dot: f64 = wb
                        .iter()
                        .zip(qa)
                        .map(|(&w, a)| w as f64 * a as i8 as f64)
                        .sum();
                    acts.d[b] as f64 * dot
                })
                .sum()
        })
        .collect()
}

#[test]
fn k_quant_tiles_equal_candles_dequantized_weights_for_every_row_count() {
    if !available() {
        for dtype in K_QUANTS {
            assert!(Tiles::new(&quantized(40, 512, dtype)).unwrap().is_none());
        }
        return;
    }
    // 40 and 24 rows leave a partial last tile; widths are whole 256-value superblocks.
    for (isa, dtype) in each_isa(K_QUANTS) {
        for (out, inp) in [(40, 512), (24, 256), (16, 1536)] {
            let qt = quantized(out, inp, dtype);
            let tiles = Tiles::with_isa(&qt, isa).unwrap().unwrap();
            assert_eq!(tiles.dims(), (out, inp));
            // Decode batches, and prefills of many rows (passes of a few per tile).
            for rows in (1..=MAX_ROWS).chain([MAX_ROWS + 5, 37]) {
                let x = Tensor::randn(0f32, 1.0, (rows, inp), &Device::Cpu).unwrap();
                let ours = tiles.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
                let xs = x.to_vec2::<f32>().unwrap();
                for r in 0..rows {
                    let want = reference_dequantized(&qt, &xs[r]);
                    for (a, b) in ours[r].iter().zip(&want) {
                        // Only the f32 rounding and order of the block sums differ (and
                        // candle's rounding of each dequantized weight to f32).
                        let tol = 1e-5 * (1.0 + b.abs()) + 1e-4;
                        assert!((*a as f64 - b).abs() <= tol, "{isa:?} {dtype:?} {a} vs {b}");
                    }
                    let alone = tiles.matmul(&x.narrow(0, r, 1).unwrap()).unwrap();
                    assert_eq!(alone.to_vec2::<f32>().unwrap()[0], ours[r]);
                }
            }
        }
    }
}

#[test]
fn k_quant_tiles_are_as_close_to_the_exact_product_as_candles_kernels() {
    if !available() {
        return;
    }
    // Candle quantizes the activations per 256 values (Q8_K) for k-quant weights, the tiles
    // per 32 (Q8_0): results differ by that rounding (~0.3 on sums of order 20), so both are
    // measured against the dequantized weights times the unquantized input.
    for (isa, dtype) in each_isa(K_QUANTS) {
        let w = Tensor::randn(0f32, 1.0, (48, 512), &Device::Cpu).unwrap();
        let qt = QTensor::quantize(&w, dtype).unwrap();
        let wd = qt
            .dequantize(&Device::Cpu)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let tiles = Tiles::with_isa(&qt, isa).unwrap().unwrap();
        let qm = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap()).unwrap();
        let x = Tensor::randn(0f32, 1.0, (4, 512), &Device::Cpu).unwrap();
        let ours = tiles.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
        let theirs = qm.forward(&x).unwrap().to_vec2::<f32>().unwrap();
        let (mut e_ours, mut e_theirs) = (0f64, 0f64);
        for (r, xr) in x.to_vec2::<f32>().unwrap().iter().enumerate() {
            for (o, wr) in wd.iter().enumerate() {
                let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
                e_ours += (ours[r][o] as f64 - exact).powi(2);
                e_theirs += (theirs[r][o] as f64 - exact).powi(2);
            }
        }
        assert!(
            e_ours <= e_theirs,
            "{isa:?} {dtype:?}: {e_ours} vs candle {e_theirs}"
        );
    }
}

#[test]
fn stacked_tiles_of_any_kinds_equal_the_parts() {
    if !available() {
        return;
    }
    for (isa, dtype) in each_isa(K_QUANTS) {
        let parts: Vec<Tiles> = [32, 16, 24]
            .iter()
            .map(|&o| {
                Tiles::with_isa(&quantized(o, 256, dtype), isa)
                    .unwrap()
                    .unwrap()
            })
            .collect();
        let stacked = Tiles::stack(&parts.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(stacked.dims(), (72, 256));
        let x = Tensor::randn(0f32, 1.0, (3, 256), &Device::Cpu).unwrap();
        let alone: Vec<Tensor> = parts.iter().map(|p| p.matmul(&x).unwrap()).collect();
        let want = Tensor::cat(&alone, 1).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(stacked.matmul(&x).unwrap().to_vec2::<f32>().unwrap(), want);
    }
    // A Q4_K_M file mixes types per tensor (Q5_0 q/k, Q8_0 v): parts of different kinds stack
    // as runs, and one call equals the parts side by side.
    let kinds: Vec<Tiles> = [
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
        GgmlDType::Q8_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_1,
    ]
    .iter()
    .map(|&d| Tiles::new(&quantized(16, 256, d)).unwrap().unwrap())
    .collect();
    let x = Tensor::randn(0f32, 1.0, (2, 256), &Device::Cpu).unwrap();
    for a in &kinds {
        for b in &kinds {
            let stacked = Tiles::stack(&[a, b, a]).unwrap();
            let alone = [a, b, a].map(|p| p.matmul(&x).unwrap());
            let want = Tensor::cat(&alone, 1).unwrap().to_vec2::<f32>().unwrap();
            let got = stacked.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(got, want, "{a:?} with {b:?}");
        }
    }
    // Tiles of one kind for different instruction sets stay apart too.
    let w = quantized(16, 256, GgmlDType::Q8_0);
    let by_isa: Vec<Tiles> = isas()
        .into_iter()
        .map(|isa| Tiles::with_isa(&w, isa).unwrap().unwrap())
        .collect();
    if let [a, b] = &by_isa[..] {
        assert!(Tiles::stack(&[a, b]).is_none());
    }
}

#[test]
fn this_cpus_best_instruction_set_is_used() {
    // With AVX2 (any x86-64 of the last decade) the tiles exist: no CPU with it is left on
    // candle's kernels.
    let isas = isas();
    if let Some(&best) = isas.first() {
        let t = Tiles::new(&quantized(16, 64, GgmlDType::Q8_0))
            .unwrap()
            .unwrap();
        assert_eq!(t.isa(), best);
    }
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    assert!(isas.contains(&Isa::Avx2), "{isas:?}");
}

#[test]
fn legacy_types_tile_exactly_as_candle_dequantizes_them() {
    // Q4_0 goes into the Q4_1 layout, Q5_0 and Q5_1 into the 5-bit one: the file's weights
    // exactly, where the loader's requantization to Q8_0 rounded them again.
    for (isa, dtype) in each_isa([GgmlDType::Q4_0, GgmlDType::Q5_0, GgmlDType::Q5_1]) {
        for (out, inp) in [(40, 576), (16, 32)] {
            let qt = quantized(out, inp, dtype);
            let tiles = Tiles::with_isa(&qt, isa).unwrap().unwrap();
            // 5 bits a weight (plus scales), not a byte.
            let five_bit = matches!(tiles.runs[..], [Kind::Q5 { .. }]);
            assert_eq!(five_bit, dtype != GgmlDType::Q4_0, "{dtype:?} as {tiles:?}");
            for rows in [1, 3, MAX_ROWS] {
                let x = Tensor::randn(0f32, 1.0, (rows, inp), &Device::Cpu).unwrap();
                let ours = tiles.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
                for (r, xr) in x.to_vec2::<f32>().unwrap().iter().enumerate() {
                    let want = reference_dequantized(&qt, xr);
                    for (a, b) in ours[r].iter().zip(&want) {
                        let tol = 1e-5 * (1.0 + b.abs()) + 1e-4;
                        assert!((*a as f64 - b).abs() <= tol, "{isa:?} {dtype:?} {a} vs {b}");
                    }
                }
            }
        }
    }
}

#[test]
fn refuses_other_types_and_wrong_inputs() {
    assert!(
        Tiles::new(&quantized(16, 256, GgmlDType::Q2K))
            .unwrap()
            .is_none()
    );
    if let Some(t) = Tiles::new(&quantized(16, 64, GgmlDType::Q8_0)).unwrap() {
        let x = Tensor::zeros((1, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(t.matmul(&x).is_err());
    }
}

/// The activations' quantization is candle's `BlockQ8_0::from_float` bit for bit (the scales
/// through f16, the values rounded half away from zero): random blocks, and a block whose
/// scale is 1 with values at and beside the halves.
#[test]
fn activations_quantize_like_candles_q8_0() {
    let mut x: Vec<f32> = Tensor::randn(0f32, 3.0, (1, 32 * 40), &Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let halves = [
        127.0,
        -0.5,
        0.5,
        1.5,
        -1.5,
        2.5,
        -2.5,
        126.5,
        -126.5,
        0.49999997,
        -0.49999997,
        0.50000006,
        3.4999998,
        -3.5000002,
        0.0,
        -0.0,
    ];
    let mut crafted: Vec<f32> = halves.iter().chain(halves.iter()).copied().collect();
    crafted[16] = 64.5;
    x.extend(&crafted);
    x.extend([0f32; 32]);
    let t = Tensor::from_vec(x.clone(), (1, x.len()), &Device::Cpu).unwrap();
    let theirs = QTensor::quantize(&t, GgmlDType::Q8_0)
        .unwrap()
        .data()
        .unwrap()
        .to_vec();
    let ours = Acts::quantize(&x);
    for (b, block) in theirs.chunks_exact(34).enumerate() {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        assert_eq!(ours.d[b].to_bits(), d.to_bits(), "block {b} scale");
        let q: Vec<u8> = ours.q[b].iter().flat_map(|g| g.to_le_bytes()).collect();
        assert_eq!(q, &block[2..], "block {b} values");
        let sum: i32 = block[2..].iter().map(|&v| i32::from(v as i8)).sum();
        assert_eq!(ours.s[b], d * sum as f32, "block {b} sum");
    }
}

/// A prefill (more rows than a decode step: row blocks, each running every tile) gives every
/// row the bits of the same row alone (a decode step: tiles split, each running the row), for
/// every type and instruction set, with ragged row blocks and a ragged last tile; the parts of
/// a stack come out as the stacked product's columns; a part not at a tile is refused.
#[test]
fn prefill_rows_equal_each_row_alone_and_parts_equal_the_stack() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (isa, dtype) in each_isa([
        GgmlDType::Q8_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ]) {
        let tiles = Tiles::with_isa(&quantized(40, 256, dtype), isa)
            .unwrap()
            .unwrap();
        for rows in [MAX_ROWS + 1, 67, 130] {
            let x = Tensor::randn(0f32, 1.0, (rows, 256), &Device::Cpu).unwrap();
            let all = tiles.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
            for (r, row) in all.iter().enumerate() {
                let alone = tiles.matmul(&x.narrow(0, r, 1).unwrap()).unwrap();
                let alone = alone.to_vec2::<f32>().unwrap().remove(0);
                assert_eq!(
                    bits(row),
                    bits(&alone),
                    "{isa:?} {dtype:?} {rows} rows, row {r}"
                );
            }
        }
    }
    let parts: Vec<Tiles> = [GgmlDType::Q5_0, GgmlDType::Q6K, GgmlDType::Q8_0]
        .into_iter()
        .map(|d| Tiles::new(&quantized(48, 256, d)).unwrap().unwrap())
        .collect();
    let stack = Tiles::stack(&parts.iter().collect::<Vec<_>>()).unwrap();
    for rows in [3, 70] {
        let x = Tensor::randn(0f32, 1.0, (rows, 256), &Device::Cpu).unwrap();
        let whole = stack.matmul(&x).unwrap();
        let split = stack
            .matmul_parts(&x, &[(0, 48), (48, 48), (96, 40)])
            .unwrap();
        for (y, (s, l)) in split.iter().zip([(0, 48), (48, 48), (96, 40)]) {
            let want = whole.narrow(1, s, l).unwrap().flatten_all().unwrap();
            let got = y.flatten_all().unwrap();
            assert_eq!(y.dims(), [rows, l]);
            assert_eq!(
                bits(&got.to_vec1::<f32>().unwrap()),
                bits(&want.to_vec1::<f32>().unwrap()),
                "{rows} rows, part at {s}"
            );
        }
        assert!(stack.matmul_parts(&x, &[(8, 16)]).is_err());
        assert!(stack.matmul_parts(&x, &[(128, 32)]).is_err());
        assert!(stack.matmul_parts(&x, &[(16, 0)]).is_err());
    }
}

#[test]
fn q6k_tiles_hold_the_extreme_quants_without_overflow() {
    // Every Q6_K quant at 31 (stored 63: the i16 lanes' largest sums, 4 · 63 · 127) or at −32
    // (stored 0), with the largest scales, against activations at ±127: the 6-bit kernel's
    // offset (`32 · Σ a`) and lane sums must give the weights candle dequantizes.
    if !available() {
        return;
    }
    let (out, inp) = (32, 512);
    let mut data = Vec::new();
    for row in 0..out {
        for sb in 0..inp / 256 {
            let bits = if (row + sb) % 3 == 0 { 0x00 } else { 0xFF };
            data.extend(std::iter::repeat_n(bits, 128 + 64)); // ql, qh
            // Each 16-value half its own scale (one sign per row: large terms of opposite
            // signs would cancel to below the f32 sums' rounding).
            let (big, small): (i8, i8) = if row % 2 == 0 {
                (127, 100)
            } else {
                (-128, -100)
            };
            data.extend((0..16).map(|j| if j % 2 == 0 { big as u8 } else { small as u8 }));
            data.extend(half::f16::from_f32(0.25 * (1 + row % 5) as f32).to_le_bytes());
        }
    }
    let storage =
        QStorage::from_data(std::borrow::Cow::Owned(data), &Device::Cpu, GgmlDType::Q6K).unwrap();
    let qt = QTensor::new(storage, (out, inp)).unwrap();
    for isa in isas() {
        let tiles = Tiles::with_isa(&qt, isa).unwrap().unwrap();
        let rows: Vec<Vec<f32>> = vec![
            vec![1.0; inp],
            vec![-1.0; inp],
            (0..inp)
                .map(|i| if i % 16 < 8 { 1.0 } else { -1.0 })
                .collect(),
        ];
        let x = Tensor::new(rows.clone(), &Device::Cpu).unwrap();
        let ours = tiles.matmul(&x).unwrap().to_vec2::<f32>().unwrap();
        for (r, xr) in rows.iter().enumerate() {
            let want = reference_dequantized(&qt, xr);
            for (a, b) in ours[r].iter().zip(&want) {
                let tol = 1e-5 * (1.0 + b.abs()) + 1e-4;
                assert!((*a as f64 - b).abs() <= tol, "{isa:?} row {r}: {a} vs {b}");
            }
        }
    }
}
