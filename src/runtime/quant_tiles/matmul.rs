//! The tiles' matrix products: the driver around the kernels of [`super::avx512`] and
//! [`super::avx2`]. A decode step (at most [`MAX_ROWS`] rows) splits the tiles over the thread
//! pool, each tile computing every row, so each weight byte is read once per step. A prefill
//! (more rows) splits the rows into blocks instead, each block running every tile in passes of
//! 4 or 8 rows ([`pass_rows`]): a tile's weights stay in L1 across the block's passes, and each block writes its own
//! rows of the result, so nothing is transposed or copied afterwards.

use std::sync::Mutex;

use candle_core::Tensor;

use super::{Acts, BLOCK, Kind, MAX_ROWS, Simd, TILE, Tiles};

type Result<T> = candle_core::Result<T>;

/// Input rows per prefill block, at most (a block's quantized activations, 64 rows of 576
/// values, stay in L2 while it runs every tile).
const ROW_BLOCK: usize = 64;

impl Tiles {
    /// `x · Wᵀ` for `x` (rows, in) f32 on the CPU: (rows, out).
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = self.matmul_parts(x, &[(0, self.out)])?;
        y.pop()
            .ok_or_else(|| candle_core::Error::Msg("tiled matmul: no result".into()))
    }

    /// `x · Wᵀ` for output rows `start..start + len` of each part, each part its own (rows,
    /// len) tensor: the projections of a stack, computed in one call without a stacked result
    /// to narrow and copy. Each part starts at a tile (a multiple of 16), as the parts of a
    /// [`Tiles::stack`] do.
    pub fn matmul_parts(&self, x: &Tensor, parts: &[(usize, usize)]) -> Result<Vec<Tensor>> {
        let (rows, inp) = x.dims2()?;
        if inp != self.inp || rows == 0 {
            candle_core::bail!(
                "tiled quantized matmul: input {:?} against a ({}, {}) weight",
                x.dims(),
                self.out,
                self.inp
            );
        }
        if let Some(p) = parts
            .iter()
            .find(|&&(s, l)| s % TILE != 0 || l == 0 || s + l > self.out)
        {
            candle_core::bail!(
                "tiled quantized matmul: part {p:?} of a ({}, {}) weight: not a nonempty run of \
                 rows from a tile",
                self.out,
                self.inp
            );
        }
        let x = x.contiguous()?;
        let acts = {
            let (storage, layout) = x.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                candle_core::bail!("tiled quantized matmul: input not on the CPU");
            };
            let all = cpu.as_slice::<f32>()?;
            let Some((a, b)) = layout.contiguous_offsets() else {
                candle_core::bail!("tiled quantized matmul: input not contiguous");
            };
            Acts::quantize(&all[a..b])
        };
        let job = Product {
            acts: &acts,
            rows,
            kb: inp / BLOCK,
            parts,
        };
        let mut outs: Vec<Vec<f32>> = parts.iter().map(|&(_, l)| vec![0f32; rows * l]).collect();
        if rows <= MAX_ROWS {
            self.by_tiles(&job, &mut outs);
        } else {
            self.by_rows(&job, &mut outs);
        }
        outs.into_iter()
            .zip(parts)
            .map(|(y, &(_, l))| Tensor::from_vec(y, (rows, l), x.device()))
            .collect()
    }

    /// The run holding tile `t` and the tile's place in it.
    fn locate(&self, mut t: usize, kb: usize) -> (&Kind, usize) {
        let mut kind = &self.runs[0];
        for run in &self.runs {
            kind = run;
            if t < run.tiles(kb) {
                break;
            }
            t -= run.tiles(kb);
        }
        (kind, t)
    }

    /// A few rows: the parts' tiles split over the pool, each computing every row.
    fn by_tiles(&self, job: &Product<'_>, outs: &mut [Vec<f32>]) {
        let (rows, kb) = (job.rows, job.kb);
        // (part, tile) for every tile of every part.
        let items: Vec<(usize, usize)> = (0..job.parts.len())
            .flat_map(|p| job.tiles(p).map(move |t| (p, t)))
            .collect();
        // Each item's rows of its tile, item-major.
        let mut flat = vec![0f32; items.len() * rows * TILE];
        {
            let slots: Vec<Mutex<&mut [f32]>> =
                flat.chunks_mut(rows * TILE).map(Mutex::new).collect();
            let item = |i: usize| {
                let mut acc = [[0f32; TILE]; MAX_ROWS];
                self.tile(items[i].1, job, 0, &mut acc[..rows]);
                if let Ok(mut slot) = slots[i].lock() {
                    slot.copy_from_slice(acc[..rows].as_flattened());
                }
            };
            crate::runtime::par::for_each_index(items.len(), items.len() * kb < 64, item);
        }
        for (&(p, t), res) in items.iter().zip(flat.chunks_exact(rows * TILE)) {
            let (s, l) = job.parts[p];
            let (acc, _) = res.as_chunks::<TILE>();
            scatter(acc, t * TILE - s, l, &mut outs[p]);
        }
    }

    /// Many rows (prefill): blocks of rows split over the pool, each running every tile of
    /// every part in passes of 4 or 8 rows and writing its own rows of each part.
    fn by_rows(&self, job: &Product<'_>, outs: &mut [Vec<f32>]) {
        let rows = job.rows;
        let threads = rayon::current_num_threads().max(1);
        let block = rows
            .div_ceil(4 * threads)
            .next_multiple_of(4)
            .clamp(4, ROW_BLOCK);
        let blocks = rows.div_ceil(block);
        // Per block, its rows of every part.
        let mut dst: Vec<Vec<&mut [f32]>> = (0..blocks).map(|_| Vec::new()).collect();
        for (y, &(_, l)) in outs.iter_mut().zip(job.parts) {
            for (b, chunk) in y.chunks_mut(block * l).enumerate() {
                dst[b].push(chunk);
            }
        }
        let dst: Vec<Mutex<Vec<&mut [f32]>>> = dst.into_iter().map(Mutex::new).collect();
        let item = |b: usize| {
            let Ok(mut mine) = dst[b].lock() else {
                return;
            };
            let first = b * block;
            let n = block.min(rows - first);
            let mut acc = [[0f32; TILE]; ROW_BLOCK];
            for (p, &(s, l)) in job.parts.iter().enumerate() {
                for t in job.tiles(p) {
                    self.tile(t, job, first, &mut acc[..n]);
                    scatter(&acc[..n], t * TILE - s, l, mine[p]);
                }
            }
        };
        crate::runtime::par::for_each_index(blocks, false, item);
    }

    /// Tile `t` against input rows `first..first + out.len()`; rows in passes of at most
    /// [`pass_rows`] (register pressure), each row by the same arithmetic as alone.
    fn tile(&self, t: usize, job: &Product<'_>, first: usize, out: &mut [[f32; TILE]]) {
        let (kb, acts) = (job.kb, job.acts);
        let (kind, j) = self.locate(t, kb);
        let range = j * kb..(j + 1) * kb;
        let most = pass_rows(self.simd, kind);
        let mut row0 = 0;
        while row0 < out.len() {
            let n = (out.len() - row0).min(most);
            let o = &mut out[row0..row0 + n];
            let a = acts.rows(first + row0, kb);
            // The kernel for `n` rows, its const row count spelled out.
            macro_rules! by_rows {
                ($kernel:ident, $w:expr, $s:expr) => {{
                    let (w, s) = (&$w[range.clone()], &$s[range.clone()]);
                    match n {
                        1 => self.$kernel::<1>(w, s, a, o),
                        2 => self.$kernel::<2>(w, s, a, o),
                        3 => self.$kernel::<3>(w, s, a, o),
                        4 => self.$kernel::<4>(w, s, a, o),
                        5 => self.$kernel::<5>(w, s, a, o),
                        6 => self.$kernel::<6>(w, s, a, o),
                        7 => self.$kernel::<7>(w, s, a, o),
                        _ => self.$kernel::<8>(w, s, a, o),
                    }
                }};
            }
            match (self.simd, kind) {
                (Simd::Avx512 { .. }, Kind::Q8 { blocks, d }) => by_rows!(q8, blocks, d),
                (Simd::Avx512 { .. }, Kind::Q4 { blocks, dm }) => by_rows!(nibbles, blocks, dm),
                (Simd::Avx512 { .. }, Kind::Q4K { blocks, dm }) => by_rows!(nibbles, blocks, dm),
                (Simd::Avx512 { .. }, Kind::Q5 { blocks, dm }) => by_rows!(nibbles, blocks, dm),
                (Simd::Avx512 { .. }, Kind::Q5K { blocks, dm }) => by_rows!(nibbles, blocks, dm),
                (Simd::Avx512 { .. }, Kind::Q6K { blocks, d }) => by_rows!(q6k, blocks, d),
                (Simd::Avx2 { .. }, Kind::Q8 { blocks, d }) => by_rows!(q8_avx2, blocks, d),
                (Simd::Avx2 { .. }, Kind::Q4 { blocks, dm }) => by_rows!(nibbles_avx2, blocks, dm),
                (Simd::Avx2 { .. }, Kind::Q4K { blocks, dm }) => by_rows!(nibbles_avx2, blocks, dm),
                (Simd::Avx2 { .. }, Kind::Q5 { blocks, dm }) => by_rows!(nibbles_avx2, blocks, dm),
                (Simd::Avx2 { .. }, Kind::Q5K { blocks, dm }) => by_rows!(nibbles_avx2, blocks, dm),
                (Simd::Avx2 { .. }, Kind::Q6K { blocks, d }) => by_rows!(q6k_avx2, blocks, d),
            }
            row0 += n;
        }
    }
}

/// Most rows one pass of a kernel takes over a tile. The AVX-512 Q8_0 and 4-bit kernels take 8
/// (their accumulators fit the 32 registers): a tile's blocks are then read and unpacked once
/// for a decode step's eight branches, not twice, and a prefill block's passes halve. Measured
/// on an Intel Xeon (docs/PERFORMANCE.md, `decode_matmul`): Q8_0's 8-row step and prefill ~15%
/// faster. The Q6_K kernel (four accumulators per row) and the 5-bit ones (two) were slower at
/// 8 rows; the AVX2 kernels have 16 registers: 4 rows.
fn pass_rows(simd: Simd, kind: &Kind) -> usize {
    match (simd, kind) {
        (Simd::Avx512 { .. }, Kind::Q8 { .. } | Kind::Q4 { .. } | Kind::Q4K { .. }) => 8,
        _ => 4,
    }
}

/// One product's input and outputs: the quantized rows, `kb` blocks each, and the output rows
/// `(start, len)` of each part.
struct Product<'a> {
    acts: &'a Acts,
    rows: usize,
    kb: usize,
    parts: &'a [(usize, usize)],
}

impl Product<'_> {
    /// The tiles part `p` spans.
    fn tiles(&self, p: usize) -> std::ops::Range<usize> {
        let (s, l) = self.parts[p];
        s / TILE..(s + l).div_ceil(TILE)
    }
}

/// Rows of one tile's results into columns `col..` (at most 16, within `width`) of a
/// row-major output `width` wide.
fn scatter(acc: &[[f32; TILE]], col: usize, width: usize, out: &mut [f32]) {
    let n = TILE.min(width - col);
    for (r, a) in acc.iter().enumerate() {
        out[r * width + col..r * width + col + n].copy_from_slice(&a[..n]);
    }
}
