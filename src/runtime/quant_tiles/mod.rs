//! Quantized projections for decode steps (a few rows), from weight tiles with AVX-512BW or
//! AVX2 kernels: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants (Q4_K, Q5_K, Q6_K), all with
//! the file's weights exactly (no requantization).
//!
//! Why it exists: a decode step reads every weight once, so its speed is the bytes it reads
//! and the instructions per weight. Candle has no SIMD kernel for Q4_1 (scalar fallback, so the
//! loader requantized Q4_1 files to Q8_0: twice the bytes), and its Q8_0 kernel has a fast
//! AVX-512 VNNI path only when the input width is a multiple of 256 (SmolLM2's hidden size is
//! 576): everything else took its AVX2 `vec_dot_4`, half of a decode step in the profile. The
//! k-quants are what GGUF downloads mostly are (Q4_K_M mixes Q4_K and Q6_K per tensor); with
//! candle's kernels a Qwen2.5-0.5B Q4_K_M decoded at ~0.95× llama.cpp's speed.
//!
//! Layout: the weights are repacked once at load into tiles of 16 output rows × one 32-wide
//! block, so that one 512-bit register holds 4 consecutive weights of each of the 16 rows
//! (bytes: 8 registers per block; nibbles: 4, each holding two groups of 4 as low and high
//! nibbles). A step broadcasts 4 activation bytes and multiplies-and-sums pairs (`maddubs`,
//! `madd`) against the register, accumulating 16 rows' partial dot products in one register;
//! every weight byte is read once per step whatever the number of input rows (≤ 8).
//! - Q8_0 weights are signed and `maddubs` wants one unsigned side: the kernel multiplies the
//!   weights' magnitudes by activations whose sign is flipped where the weight is negative
//!   (2 · 127 · 127 < 2¹⁵, so the i16 pair sums never saturate).
//! - Q4_1 weights are `d · q + m` with q in 0..15: `maddubs(q, a)` cannot saturate and the
//!   block's 8 products per i16 lane are summed in i16 (8 · 15 · 127 < 2¹⁵) before one `madd`;
//!   the `m` term is `m · d_a · Σ a`, with the activation block sums computed once per step.
//! - K-quants come in 256-value superblocks whose f16 `d` (and `dmin`) scale 6- or 8-bit
//!   sub-block scales; at load every 32-block gets its products `d · sc` (and `−dmin · min`) in
//!   f32, as candle's dequantization computes them (not representable in f16), so the tiles hold
//!   exactly the weights candle dequantizes. Q4_K (`D · q + M`, q in 0..15) is the Q4_1 nibble
//!   layout and kernel with f32 scales. Q5_K (q in 0..31) is the 5-bit layout: the Q4_1
//!   nibbles plus a register of 5th bits per block, merged into each nibble register with a
//!   shift and a ternary-logic OR (AVX2: and, or); `D`, `M` as Q4_1's; i16 lanes hold the
//!   products of two nibble registers (4 · 2 · 31 · 127 < 2¹⁵), so a block has two sums.
//!   Q6_K has a scale per 16 values and q in −32..31, stored as `u = q + 32` in 0..63: the
//!   6-bit layout, the Q4_1 nibbles plus a plane of top-2-bit pairs (merged like Q5's 5th
//!   bits), with the file's i8 scales and f16 `d` (0.875 bytes per weight; as signed bytes
//!   with f32 scale products it took 1.25). The kernel sums `u · a` per 16-value half (i16
//!   lanes hold two nibble registers' products, 4 · 63 · 127 < 2¹⁵) and subtracts
//!   `32 · Σ a` of the half (precomputed with the activations): the integer `Σ q · a`,
//!   then `d · sc` in f32 as candle's dequantization computes it.
//! - The other legacy types go into the kind that holds them exactly: Q4_0 (`d · (q − 8)`) as
//!   Q4_1 with `m = −8d`; Q5_1 (`d · q + m`, q in 0..31) in the 5-bit layout with its f16
//!   scales, and Q5_0 (`d · (q − 16)`) as Q5_1 with `m = −16d`. (SmolLM2's hidden size, 576, is
//!   not a multiple of 256, so `llama-quantize` stores most of a Q4_K_M / Q5_K_M file's
//!   projections as Q5_0 / Q5_1: as bytes they read 8.5 / 10 bits per weight, in 5 bits 6.)
//!
//! Numerics: activations are quantized per 32 values to i8 with an f16 scale, exactly as
//! candle's `BlockQ8_0::from_float` does; integer sums per block, scaled in f32. For Q8_0 the
//! result is candle's Q8_0 × Q8_0 dot product up to the order of the f32 block sums; for Q4_1
//! and the k-quants it is the file's weights (no requantization) against Q8_0 activations
//! (candle's k-quant kernels quantize activations per 256 values instead, Q8_K: coarser). Each input row is
//! computed by the same loop whatever the batch, so a batched row equals the same row alone
//! bit for bit.
//!
//! Instruction sets ([`Isa`]): with AVX-512BW a register holds 4 weights of the tile's 16 rows;
//! with AVX2 + FMA (CPUs without AVX-512: AMD before Zen 4, most Intel client chips) a 256-bit
//! register holds them for 8 rows, and each tile is computed as two halves of 8 rows from the
//! same repacked blocks (the sign trick by `sign_epi8` instead of a masked negation; f16 scales
//! widened in scalar code, which has no `cvtph` wrapper here). Same integer sums, same order.
//!
//! The intrinsics come through `pulp`'s safe feature-token wrappers (this crate forbids
//! `unsafe`); the tokens are checked at run time. The kernels inline into plain code only when
//! their features are enabled at compile time (`.cargo/config.toml` builds for the host CPU),
//! so without them — at compile time or on the CPU — [`Tiles::new`] returns `None` and
//! candle's kernels serve.

// The kernels index several arrays by the same counters on purpose (register blocks).
#![allow(clippy::needless_range_loop)]

use candle_core::Device;
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

type Result<T> = candle_core::Result<T>;

/// Output rows per tile: one 512-bit register of i32 or f32.
const TILE: usize = 16;
/// Values per block (Q8_0 and Q4_1; k-quants are tiled per 32 values of their superblocks).
const BLOCK: usize = 32;
/// Input rows the kernels take at once (decode batches, rehearsal branches).
pub const MAX_ROWS: usize = 8;

/// One 32-wide Q8_0 block of 16 output rows: `qs[g]` holds weights 4g..4g+4 of each row
/// (row-major, 4 bytes per row), as i8 bytes.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Q8Block {
    qs: [[u8; 64]; 8],
}

/// One 32-wide Q4_1 block of 16 output rows: `qs[h]` holds, per row, weights 4h..4h+4 in the
/// low nibbles and 4(h+4)..4(h+4)+4 in the high nibbles.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Q4Block {
    qs: [[u8; 64]; 4],
}

/// One 32-wide 5-bit block of 16 output rows (Q5_0, Q5_1, Q5_K): the low 4 bits of each
/// value in the [`Q4Block`] nibble layout (`qs`), the 5th bits beside them in `qh`: byte `4r + k`
/// holds row `r`'s 5th bits of the values in byte `4r + k` of `qs[n]`, the low nibble's at bit
/// `2n` and the high nibble's at bit `2n + 1`. 320 bytes for 512 weights, where the same values
/// as bytes took 512.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Q5Block {
    qs: [[u8; 64]; 4],
    qh: [u8; 64],
}

/// One 32-wide 6-bit block of 16 output rows (Q6_K, as `q + 32` in 0..63): the low 4 bits of
/// each value in the [`Q4Block`] nibble layout (`qs`), the top 2 bits in `qh[n / 2]` beside
/// them: byte `4r + k` holds row `r`'s top bits of the values in byte `4r + k` of `qs[n]`, the
/// low nibble's at bit `4 · (n % 2)` and the high nibble's at bit `4 · (n % 2) + 2`. 384 bytes
/// for 512 weights, where the same values as signed bytes took 512.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Q6Block {
    qs: [[u8; 64]; 4],
    qh: [[u8; 64]; 2],
}

/// One 32-wide Q6_K block's scales for the 16 rows of a tile, as the file has them: the i8
/// sub-block scales of values 0..16 (`sc[..16]`) and 16..32 (`sc[16..]`) and each row's f16
/// superblock `d`. The kernels multiply them in f32 (`d · sc`) as candle's dequantization does,
/// so one cache line per block serves where the products took two.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Q6Scales {
    sc: [i8; 2 * TILE],
    d: [u16; TILE],
}

/// One 32-wide block's f32 scales for the 16 rows of a tile, as Q4_K and Q5_K blocks have them
/// after their per-superblock `d` and `dmin` multiply the 6-bit sub-block scales: `[D; M]`
/// (the weight is `D · q + M`).
type Scales32 = [f32; 2 * TILE];

/// Values per k-quant superblock.
const QK_K: usize = 256;

/// The repacked weight data, tile-major (tile t, block b at `t · blocks_per_row + b`), with the
/// rows' scales per block beside it (Q8_0: f16 `d`; Q4_1: f16 `d` then `m`; k-quants: f32).
enum Kind {
    Q8 {
        blocks: Vec<Q8Block>,
        d: Vec<[u16; TILE]>,
    },
    Q4 {
        blocks: Vec<Q4Block>,
        dm: Vec<[u16; 2 * TILE]>,
    },
    /// Q4_K: q in 0..15 in the Q4_1 nibble layout, `D · q + M` per 32-block.
    Q4K {
        blocks: Vec<Q4Block>,
        dm: Vec<Scales32>,
    },
    /// Q5_0 and Q5_1: q in 0..31 in the 5-bit layout, f16 `d · q + m` (Q5_0: `m = −16d`).
    Q5 {
        blocks: Vec<Q5Block>,
        dm: Vec<[u16; 2 * TILE]>,
    },
    /// Q5_K: q in 0..31 in the 5-bit layout, `D · q + M` per 32-block.
    Q5K {
        blocks: Vec<Q5Block>,
        dm: Vec<Scales32>,
    },
    /// Q6_K: `q + 32` in 0..63 in the 6-bit layout, a scale per 16 values.
    Q6K {
        blocks: Vec<Q6Block>,
        d: Vec<Q6Scales>,
    },
}

impl Kind {
    fn name(&self) -> &'static str {
        match self {
            Kind::Q8 { .. } => "Q8_0",
            Kind::Q4 { .. } => "Q4_1",
            Kind::Q4K { .. } => "Q4_K",
            Kind::Q5 { .. } => "Q5_1",
            Kind::Q5K { .. } => "Q5_K",
            Kind::Q6K { .. } => "Q6_K",
        }
    }

    /// The same kind with no tiles.
    fn empty(&self) -> Kind {
        match self {
            Kind::Q8 { .. } => Kind::Q8 {
                blocks: Vec::new(),
                d: Vec::new(),
            },
            Kind::Q4 { .. } => Kind::Q4 {
                blocks: Vec::new(),
                dm: Vec::new(),
            },
            Kind::Q4K { .. } => Kind::Q4K {
                blocks: Vec::new(),
                dm: Vec::new(),
            },
            Kind::Q5 { .. } => Kind::Q5 {
                blocks: Vec::new(),
                dm: Vec::new(),
            },
            Kind::Q5K { .. } => Kind::Q5K {
                blocks: Vec::new(),
                dm: Vec::new(),
            },
            Kind::Q6K { .. } => Kind::Q6K {
                blocks: Vec::new(),
                d: Vec::new(),
            },
        }
    }

    /// Whole tiles held, for `kb` blocks per row.
    fn tiles(&self, kb: usize) -> usize {
        let blocks = match self {
            Kind::Q8 { blocks, .. } => blocks.len(),
            Kind::Q4 { blocks, .. } | Kind::Q4K { blocks, .. } => blocks.len(),
            Kind::Q5 { blocks, .. } | Kind::Q5K { blocks, .. } => blocks.len(),
            Kind::Q6K { blocks, .. } => blocks.len(),
        };
        blocks / kb.max(1)
    }

    /// Append `other`'s tiles; `false` (nothing appended) when the kinds differ.
    fn extend(&mut self, other: &Kind) -> bool {
        match (self, other) {
            (Kind::Q8 { blocks, d }, Kind::Q8 { blocks: b, d: s }) => {
                blocks.extend_from_slice(b);
                d.extend_from_slice(s);
            }
            (Kind::Q4 { blocks, dm }, Kind::Q4 { blocks: b, dm: s }) => {
                blocks.extend_from_slice(b);
                dm.extend_from_slice(s);
            }
            (Kind::Q4K { blocks, dm }, Kind::Q4K { blocks: b, dm: s }) => {
                blocks.extend_from_slice(b);
                dm.extend_from_slice(s);
            }
            (Kind::Q5 { blocks, dm }, Kind::Q5 { blocks: b, dm: s }) => {
                blocks.extend_from_slice(b);
                dm.extend_from_slice(s);
            }
            (Kind::Q5K { blocks, dm }, Kind::Q5K { blocks: b, dm: s }) => {
                blocks.extend_from_slice(b);
                dm.extend_from_slice(s);
            }
            (Kind::Q6K { blocks, d }, Kind::Q6K { blocks: b, d: s }) => {
                blocks.extend_from_slice(b);
                d.extend_from_slice(s);
            }
            _ => return false,
        }
        true
    }
}

/// A Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or k-quant weight (out, in) repacked for the tiled kernels
/// (the legacy types into the layout of the kind that holds them exactly; see [`Tiles::new`]).
pub struct Tiles {
    out: usize,
    inp: usize,
    /// The tiles in row order, as runs of one kind each: one run, or several when projections
    /// of different types are stacked (a K_M file's Q5_0 q/k beside its Q8_0 v).
    runs: Vec<Kind>,
    simd: Simd,
}

impl Q5Block {
    const ZERO: Self = Q5Block {
        qs: [[0; 64]; 4],
        qh: [0; 64],
    };
}

impl Q6Block {
    const ZERO: Self = Q6Block {
        qs: [[0; 64]; 4],
        qh: [[0; 64]; 2],
    };
}

impl Q6Scales {
    const ZERO: Self = Q6Scales {
        sc: [0; 2 * TILE],
        d: [0; TILE],
    };
}

/// The blocks of the one nibble kernel per instruction set: 4-bit ([`Q4Block`]) or 5-bit
/// ([`Q5Block`]: the same nibbles plus 5th bits, merged in when `FIFTH`, a compile-time
/// constant, so the 4-bit kernel carries none of it).
trait Nibbles: Copy {
    const FIFTH: bool;
    fn qs(&self) -> &[[u8; 64]; 4];
    /// The 5th bits (4-bit blocks: none, never read).
    fn qh(&self) -> &[u8; 64];
}

/// `B::FIFTH` of a slice of blocks (kernels take them as `impl Nibbles`).
#[inline(always)]
fn fifth<B: Nibbles>(_: &[B]) -> bool {
    B::FIFTH
}

impl Nibbles for Q4Block {
    const FIFTH: bool = false;
    #[inline(always)]
    fn qs(&self) -> &[[u8; 64]; 4] {
        &self.qs
    }
    #[inline(always)]
    fn qh(&self) -> &[u8; 64] {
        &[0; 64]
    }
}

impl Nibbles for Q5Block {
    const FIFTH: bool = true;
    #[inline(always)]
    fn qs(&self) -> &[[u8; 64]; 4] {
        &self.qs
    }
    #[inline(always)]
    fn qh(&self) -> &[u8; 64] {
        &self.qh
    }
}

impl std::fmt::Debug for Tiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tiles({}, {} × {})",
            self.runs
                .iter()
                .map(Kind::name)
                .collect::<Vec<_>>()
                .join("+"),
            self.out,
            self.inp
        )
    }
}

/// A block's `[d; m]` per row as the nibble kernel reads them: f16 (Q4_1) or f32 (Q4_K).
trait DmScales: Copy {
    #[cfg(target_arch = "x86_64")]
    fn load(self, f: pulp::core_arch::x86::Avx512f) -> [std::arch::x86_64::__m512; 2];
    /// `[d; m]` of rows 8h..8h+8 in f32 (the AVX2 kernels' halves).
    fn half8(self, h: usize) -> [[f32; 8]; 2];
}

impl DmScales for [u16; 2 * TILE] {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn load(self, f: pulp::core_arch::x86::Avx512f) -> [std::arch::x86_64::__m512; 2] {
        let [d, m]: [[u16; TILE]; 2] = bytemuck::cast(self);
        [
            f._mm512_cvtph_ps(bytemuck::cast(d)),
            f._mm512_cvtph_ps(bytemuck::cast(m)),
        ]
    }
    #[inline(always)]
    fn half8(self, h: usize) -> [[f32; 8]; 2] {
        [
            f16x8(&self[8 * h..8 * h + 8]),
            f16x8(&self[TILE + 8 * h..TILE + 8 * h + 8]),
        ]
    }
}

impl DmScales for Scales32 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn load(self, _: pulp::core_arch::x86::Avx512f) -> [std::arch::x86_64::__m512; 2] {
        bytemuck::cast(self)
    }
    #[inline(always)]
    fn half8(self, h: usize) -> [[f32; 8]; 2] {
        let [d, m]: [[[f32; 8]; 2]; 2] = bytemuck::cast(self);
        [d[h], m[h]]
    }
}

/// One k-quant superblock decoded as candle's `to_float` reads it: 256 quants (Q6_K: `q + 32`,
/// unsigned as the file stores it) and the scales: Q4_K, Q5_K the f32 products `d · sc` and
/// `m = −dmin · min`, 8 each per 32 values; Q6_K its 16 i8 scales (one per 16 values) in `sc`
/// and its f16 `d` (bits) in `d6`.
struct KBlock {
    q: [u8; QK_K],
    d: [f32; 8],
    m: [f32; 8],
    sc: [i8; 16],
    d6: u16,
}

/// ggml's 6-bit scale and min of sub-block `j` (candle's `get_scale_min_k4`).
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

impl KBlock {
    /// Decode one block's bytes (candle's `BlockQ4K`, `BlockQ5K`, `BlockQ6K`, `repr(C)`).
    fn decode(dtype: GgmlDType, s: &[u8]) -> Self {
        let h = |i: usize| f16::from_le_bytes([s[i], s[i + 1]]).to_f32();
        let mut k = KBlock {
            q: [0; QK_K],
            d: [0.0; 8],
            m: [0.0; 8],
            sc: [0; 16],
            d6: 0,
        };
        if dtype == GgmlDType::Q6K {
            // ql [128], qh [64], scales [i8; 16], d: value v's low 4 bits are a nibble of
            // ql[64·(v/128) + v%32 (+32 in quarters 1, 3)] (low in quarters 0, 1), its high 2
            // bits are bits 2·quarter of qh[32·(v/128) + v%32]; its scale is scales[v/16].
            let (ql, qh, sc) = (&s[..128], &s[128..192], &s[192..208]);
            for v in 0..QK_K {
                let (half, quarter, l) = (v / 128, v % 128 / 32, v % 32);
                let byte = ql[64 * half + 32 * (quarter % 2) + l];
                let lo = if quarter < 2 { byte & 0x0F } else { byte >> 4 };
                let hi = (qh[32 * half + l] >> (2 * quarter)) & 3;
                k.q[v] = lo | (hi << 4);
            }
            k.sc = std::array::from_fn(|j| sc[j] as i8);
            k.d6 = u16::from_le_bytes([s[208], s[209]]);
        } else {
            // d, dmin, scales [12], (Q5_K: qh [32],) qs [128]: sub-block j's value l is a nibble
            // of qs[32·(j/2) + l] (low for even j), plus 16 where bit j of qh[l] is set.
            let (d, dmin, scales) = (h(0), h(2), &s[4..16]);
            let (qh, qs) = if dtype == GgmlDType::Q5K {
                (Some(&s[16..48]), &s[48..176])
            } else {
                (None, &s[16..144])
            };
            for j in 0..QK_K / BLOCK {
                let (sc, m) = scale_min_k4(j, scales);
                k.d[j] = d * sc as f32;
                k.m[j] = -(dmin * m as f32);
                for l in 0..BLOCK {
                    let byte = qs[32 * (j / 2) + l];
                    let mut q = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    if qh.is_some_and(|qh| (qh[l] >> j) & 1 == 1) {
                        q += 16;
                    }
                    k.q[BLOCK * j + l] = q;
                }
            }
        }
        k
    }
}

/// Row `r` of a nibble tile block from the block's 32 quants (each < 16).
fn put_q4(blk: &mut Q4Block, r: usize, q: impl Fn(usize) -> u8) {
    for h in 0..4 {
        for j in 0..4 {
            blk.qs[h][4 * r + j] = q(4 * h + j) | (q(4 * (h + 4) + j) << 4);
        }
    }
}

/// Row `r` of a 5-bit tile block from the block's 32 quants (each < 32).
fn put_q5(blk: &mut Q5Block, r: usize, q: impl Fn(usize) -> u8) {
    for n in 0..4 {
        for k in 0..4 {
            let (lo, hi) = (q(4 * n + k), q(4 * (n + 4) + k));
            blk.qs[n][4 * r + k] = (lo & 0x0F) | ((hi & 0x0F) << 4);
            blk.qh[4 * r + k] |= ((lo >> 4) << (2 * n)) | ((hi >> 4) << (2 * n + 1));
        }
    }
}

/// Row `r` of a 6-bit tile block from the block's 32 quants (each < 64).
fn put_q6(blk: &mut Q6Block, r: usize, q: impl Fn(usize) -> u8) {
    for n in 0..4 {
        for k in 0..4 {
            let (lo, hi) = (q(4 * n + k), q(4 * (n + 4) + k));
            let at = 4 * (n % 2);
            blk.qs[n][4 * r + k] = (lo & 0x0F) | ((hi & 0x0F) << 4);
            blk.qh[n / 2][4 * r + k] |= ((lo >> 4) << at) | ((hi >> 4) << (at + 2));
        }
    }
}

/// Row `r` of a byte tile block from the block's 32 quant bytes.
fn put_q8(blk: &mut Q8Block, r: usize, q: &[u8]) {
    for (i, &byte) in q.iter().enumerate() {
        blk.qs[i / 4][4 * r + i % 4] = byte;
    }
}

/// The instruction sets the kernels come in, best first: AVX-512BW (a 512-bit register holds
/// 4 weights of a tile's 16 rows) and AVX2 + FMA (a 256-bit register holds 4 weights of 8 rows:
/// the tile's two halves are computed one after the other from the same repacked blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Simd {
    Avx512 {
        f: pulp::core_arch::x86::Avx512f,
        bw: pulp::core_arch::x86::Avx512bw,
        sse: pulp::core_arch::x86::Sse,
    },
    Avx2 {
        x: pulp::core_arch::x86::Avx,
        x2: pulp::core_arch::x86::Avx2,
        fma: pulp::core_arch::x86::Fma,
        sse: pulp::core_arch::x86::Sse,
    },
}

#[cfg(not(target_arch = "x86_64"))]
#[derive(Clone, Copy)]
enum Simd {
    Avx512,
    Avx2,
}

impl Isa {
    /// Whether tiles with these kernels prefill faster than an f32 copy of the weights through
    /// candle's gemm, on this CPU: the AVX-512 kernels, whose `maddubs` does 64 multiply-adds
    /// per instruction. On AMD Zen 4, which issues a 512-bit FMA as two 256-bit halves, gemm's
    /// f32 rate is half an Intel core's and the tiles win clearly; on an Intel Xeon with AVX-512
    /// they won end to end too (`envace bench generate`, 9 of 9 alternated pairs), and they need
    /// no f32 copy. The AVX2 kernels measured level with gemm (AMD Zen 3), so AVX2 CPUs keep
    /// the copy. `cargo bench --bench prefill_matmul` measures both on one layer;
    /// docs/PERFORMANCE.md has the figures.
    pub fn prefill_beats_gemm(self) -> bool {
        self == Isa::Avx512
    }
}

impl Simd {
    fn isa(self) -> Isa {
        match self {
            Simd::Avx512 { .. } => Isa::Avx512,
            Simd::Avx2 { .. } => Isa::Avx2,
        }
    }
}

/// The kernels of `isa`, when this CPU has it and the build enabled it at compile time:
/// without that (a portable build) every intrinsic would be a function call, and candle's
/// runtime-dispatched kernels are faster.
#[cfg(target_arch = "x86_64")]
fn simd_for(isa: Isa) -> Option<Simd> {
    use pulp::core_arch::x86 as x;
    match isa {
        Isa::Avx512 => {
            if !cfg!(all(target_feature = "avx512f", target_feature = "avx512bw")) {
                return None;
            }
            Some(Simd::Avx512 {
                f: x::Avx512f::try_new()?,
                bw: x::Avx512bw::try_new()?,
                sse: x::Sse::try_new()?,
            })
        }
        Isa::Avx2 => {
            if !cfg!(all(target_feature = "avx2", target_feature = "fma")) {
                return None;
            }
            Some(Simd::Avx2 {
                x: x::Avx::try_new()?,
                x2: x::Avx2::try_new()?,
                fma: x::Fma::try_new()?,
                sse: x::Sse::try_new()?,
            })
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn simd_for(_: Isa) -> Option<Simd> {
    None
}

/// The instruction sets this CPU and build run the kernels with, best first.
pub fn isas() -> Vec<Isa> {
    [Isa::Avx512, Isa::Avx2]
        .into_iter()
        .filter(|&i| simd_for(i).is_some())
        .collect()
}

fn simd() -> Option<Simd> {
    isas().first().copied().and_then(simd_for)
}

/// Whether this CPU runs the tiled kernels.
pub fn available() -> bool {
    simd().is_some()
}

/// Whether the tiles of this CPU's best instruction set prefill faster than an f32 copy
/// ([`Tiles::prefill_beats_gemm`] of tiles made by [`Tiles::new`]).
pub fn prefill_beats_gemm_here() -> bool {
    isas().first().is_some_and(|isa| isa.prefill_beats_gemm())
}

/// Blocks ahead of the one being computed whose cache lines the kernels request (measured on
/// the AVX2 kernels: 4 ahead +7-10% decode, 8 no better).
#[cfg(target_arch = "x86_64")]
const PREFETCH_BLOCKS: usize = 4;

/// Ask for the cache lines of `blocks[i]` (past the end: of whatever follows, which is
/// harmless: a prefetch never faults and reads nothing).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch<T>(sse: pulp::core_arch::x86::Sse, blocks: &[T], i: usize) {
    let p = blocks.as_ptr().wrapping_add(i) as *const i8;
    for line in 0..std::mem::size_of::<T>() / 64 {
        sse._mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.wrapping_add(64 * line));
    }
}

/// Eight f16 scales as f32 (rows 8h..8h+8 of a tile).
#[inline(always)]
fn f16x8(bits: &[u16]) -> [f32; 8] {
    let mut o = [0f32; 8];
    for (o, &b) in o.iter_mut().zip(bits) {
        *o = f16::from_bits(b).to_f32();
    }
    o
}

impl Tiles {
    /// Repack a CPU Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K tensor (out, in) for the
    /// best instruction set here. `None` for other types, for an input width that is not a whole number of the
    /// type's blocks, or when the CPU has neither AVX-512BW nor AVX2. Rows past `out` in the
    /// last tile are zero.
    pub fn new(t: &QTensor) -> Result<Option<Self>> {
        match isas().first() {
            Some(&isa) => Self::with_isa(t, isa),
            None => Ok(None),
        }
    }

    /// [`Tiles::new`] for the kernels of `isa` (`None` also when this CPU lacks it).
    pub fn with_isa(t: &QTensor, isa: Isa) -> Result<Option<Self>> {
        let Some(simd) = simd_for(isa) else {
            return Ok(None);
        };
        if !matches!(t.device(), Device::Cpu) {
            return Ok(None);
        }
        let (out, inp) = t.shape().dims2()?;
        let dtype = t.dtype();
        if !matches!(
            dtype,
            GgmlDType::Q8_0
                | GgmlDType::Q4_0
                | GgmlDType::Q4_1
                | GgmlDType::Q5_0
                | GgmlDType::Q5_1
                | GgmlDType::Q4K
                | GgmlDType::Q5K
                | GgmlDType::Q6K
        ) {
            return Ok(None);
        }
        // Values and bytes per block of the file's type (k-quants: 256-value superblocks).
        let (vals, block_bytes) = (dtype.block_size(), dtype.type_size());
        if inp % vals != 0 {
            return Ok(None);
        }
        let nb = inp / vals;
        let kb = inp / BLOCK;
        let tiles = out.div_ceil(TILE);
        let data = t.data()?;
        if data.len() != out * nb * block_bytes {
            candle_core::bail!(
                "{dtype:?} tensor ({out}, {inp}) holds {} bytes, expected {}",
                data.len(),
                out * nb * block_bytes
            );
        }
        let src = |row: usize, b: usize| {
            &data[(row * nb + b) * block_bytes..(row * nb + b + 1) * block_bytes]
        };
        let kind = match dtype {
            GgmlDType::Q8_0 => {
                let mut blocks = vec![Q8Block { qs: [[0; 64]; 8] }; tiles * kb];
                let mut d = vec![[0u16; TILE]; tiles * kb];
                for row in 0..out {
                    let (ti, r) = (row / TILE, row % TILE);
                    for b in 0..kb {
                        let s = src(row, b);
                        d[ti * kb + b][r] = u16::from_le_bytes([s[0], s[1]]);
                        put_q8(&mut blocks[ti * kb + b], r, &s[2..]);
                    }
                }
                Kind::Q8 { blocks, d }
            }
            GgmlDType::Q4_0 => {
                // `d · (q − 8)`: the nibble layout with `m = −8d` (exact in f16 unless it
                // overflows, which only a corrupt file's scale can).
                let mut blocks = vec![Q4Block { qs: [[0; 64]; 4] }; tiles * kb];
                let mut dm = vec![[0u16; 2 * TILE]; tiles * kb];
                for row in 0..out {
                    let (ti, r) = (row / TILE, row % TILE);
                    for b in 0..kb {
                        let s = src(row, b);
                        let d = f16::from_le_bytes([s[0], s[1]]);
                        let m = f16::from_f32(-8.0 * d.to_f32());
                        if !m.is_finite() {
                            return Ok(None);
                        }
                        dm[ti * kb + b][r] = d.to_bits();
                        dm[ti * kb + b][TILE + r] = m.to_bits();
                        put_q4(&mut blocks[ti * kb + b], r, |i| {
                            let byte = s[2 + i % 16];
                            if i < 16 { byte & 0x0F } else { byte >> 4 }
                        });
                    }
                }
                Kind::Q4 { blocks, dm }
            }
            GgmlDType::Q5_0 | GgmlDType::Q5_1 => {
                // GGUF Q5_0: d, qh (u32), qs[16]; Q5_1: d, m, qh, qs. Value j's low 4 bits are
                // a nibble of qs[j % 16] (low for j < 16), its 5th bit is bit j of qh. Both go
                // into the 5-bit layout as `d · q + m` with f16 scales: Q5_0 (`d · (q − 16)`)
                // with `m = −16d`, exact in f16 unless it overflows (only a corrupt scale can).
                let q5_0 = dtype == GgmlDType::Q5_0;
                let mut blocks = vec![Q5Block::ZERO; tiles * kb];
                let mut dm = vec![[0u16; 2 * TILE]; tiles * kb];
                for row in 0..out {
                    let (ti, r) = (row / TILE, row % TILE);
                    for b in 0..kb {
                        let s = src(row, b);
                        let i = ti * kb + b;
                        let d = f16::from_le_bytes([s[0], s[1]]);
                        let (m, at) = if q5_0 {
                            (f16::from_f32(-16.0 * d.to_f32()), 2)
                        } else {
                            (f16::from_le_bytes([s[2], s[3]]), 4)
                        };
                        if !m.is_finite() {
                            return Ok(None);
                        }
                        dm[i][r] = d.to_bits();
                        dm[i][TILE + r] = m.to_bits();
                        let qh = u32::from_le_bytes([s[at], s[at + 1], s[at + 2], s[at + 3]]);
                        let qs = &s[at + 4..at + 20];
                        put_q5(&mut blocks[i], r, |j| {
                            let nib = if j < 16 {
                                qs[j] & 0x0F
                            } else {
                                qs[j - 16] >> 4
                            };
                            nib | ((((qh >> j) & 1) as u8) << 4)
                        });
                    }
                }
                Kind::Q5 { blocks, dm }
            }
            GgmlDType::Q4_1 => {
                let mut blocks = vec![Q4Block { qs: [[0; 64]; 4] }; tiles * kb];
                let mut dm = vec![[0u16; 2 * TILE]; tiles * kb];
                for row in 0..out {
                    let (ti, r) = (row / TILE, row % TILE);
                    for b in 0..kb {
                        let s = src(row, b);
                        dm[ti * kb + b][r] = u16::from_le_bytes([s[0], s[1]]);
                        dm[ti * kb + b][TILE + r] = u16::from_le_bytes([s[2], s[3]]);
                        // GGUF Q4_1: value j (< 16) is the low nibble of byte j, value j + 16 the
                        // high nibble.
                        put_q4(&mut blocks[ti * kb + b], r, |i| {
                            let byte = s[4 + i % 16];
                            if i < 16 { byte & 0x0F } else { byte >> 4 }
                        });
                    }
                }
                Kind::Q4 { blocks, dm }
            }
            _ => {
                let n = |on: bool| if on { tiles * kb } else { 0 };
                let mut q4 = vec![Q4Block { qs: [[0; 64]; 4] }; n(dtype == GgmlDType::Q4K)];
                let mut q5 = vec![Q5Block::ZERO; n(dtype == GgmlDType::Q5K)];
                let q6k = dtype == GgmlDType::Q6K;
                let mut q6 = vec![Q6Block::ZERO; n(q6k)];
                let mut s6 = vec![Q6Scales::ZERO; n(q6k)];
                let mut sc = vec![[0f32; 2 * TILE]; n(!q6k)];
                for row in 0..out {
                    let (ti, r) = (row / TILE, row % TILE);
                    for sb in 0..nb {
                        let k = KBlock::decode(dtype, src(row, sb));
                        for j in 0..QK_K / BLOCK {
                            let i = ti * kb + sb * (QK_K / BLOCK) + j;
                            let q = &k.q[BLOCK * j..BLOCK * (j + 1)];
                            if q6k {
                                s6[i].sc[r] = k.sc[2 * j];
                                s6[i].sc[TILE + r] = k.sc[2 * j + 1];
                                s6[i].d[r] = k.d6;
                            } else {
                                sc[i][r] = k.d[j];
                                sc[i][TILE + r] = k.m[j];
                            }
                            match dtype {
                                GgmlDType::Q4K => put_q4(&mut q4[i], r, |v| q[v]),
                                GgmlDType::Q5K => put_q5(&mut q5[i], r, |v| q[v]),
                                _ => put_q6(&mut q6[i], r, |v| q[v]),
                            }
                        }
                    }
                }
                match dtype {
                    GgmlDType::Q4K => Kind::Q4K { blocks: q4, dm: sc },
                    GgmlDType::Q5K => Kind::Q5K { blocks: q5, dm: sc },
                    _ => Kind::Q6K { blocks: q6, d: s6 },
                }
            }
        };
        Ok(Some(Self {
            out,
            inp,
            runs: vec![kind],
            simd,
        }))
    }

    /// Several projections of the same input stacked as one (their rows in order), when each
    /// but the last fills whole tiles and all have the same width and instruction set; else
    /// `None`. Parts of one kind share a run; a part of another kind starts a new one, so one
    /// call computes them all whatever their types.
    pub fn stack(parts: &[&Tiles]) -> Option<Self> {
        let first = parts.first()?;
        let inp = first.inp;
        let mut out = 0;
        let mut runs: Vec<Kind> = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            if p.inp != inp || p.isa() != first.isa() || (i + 1 < parts.len() && p.out % TILE != 0)
            {
                return None;
            }
            for kind in &p.runs {
                if !runs.last_mut().is_some_and(|last| last.extend(kind)) {
                    let mut run = kind.empty();
                    run.extend(kind);
                    runs.push(run);
                }
            }
            out += p.out;
        }
        Some(Self {
            out,
            inp,
            runs,
            simd: first.simd,
        })
    }

    /// `(out, in)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.out, self.inp)
    }

    /// The instruction set these tiles' kernels use.
    pub fn isa(&self) -> Isa {
        self.simd.isa()
    }

    /// Whether a prefill's rows run faster on these tiles than on an f32 copy of the weights
    /// ([`Isa::prefill_beats_gemm`] of their instruction set).
    pub fn prefill_beats_gemm(&self) -> bool {
        self.isa().prefill_beats_gemm()
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn q8<const R: usize, W, S>(&self, _: &[W], _: &[S], _: ActRows<'_>, _: &mut [[f32; TILE]]) {}
    #[cfg(not(target_arch = "x86_64"))]
    fn nibbles<const R: usize, W, S>(
        &self,
        _: &[W],
        _: &[S],
        _: ActRows<'_>,
        _: &mut [[f32; TILE]],
    ) {
    }
    #[cfg(not(target_arch = "x86_64"))]
    fn q6k<const R: usize, W, S>(&self, _: &[W], _: &[S], _: ActRows<'_>, _: &mut [[f32; TILE]]) {}
    #[cfg(not(target_arch = "x86_64"))]
    fn q8_avx2<const R: usize, W, S>(
        &self,
        _: &[W],
        _: &[S],
        _: ActRows<'_>,
        _: &mut [[f32; TILE]],
    ) {
    }
    #[cfg(not(target_arch = "x86_64"))]
    fn nibbles_avx2<const R: usize, W, S>(
        &self,
        _: &[W],
        _: &[S],
        _: ActRows<'_>,
        _: &mut [[f32; TILE]],
    ) {
    }
    #[cfg(not(target_arch = "x86_64"))]
    fn q6k_avx2<const R: usize, W, S>(
        &self,
        _: &[W],
        _: &[S],
        _: ActRows<'_>,
        _: &mut [[f32; TILE]],
    ) {
    }
}

mod acts;
use acts::{ActRows, Acts};
mod matmul;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;
