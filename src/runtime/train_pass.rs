//! The decoder's training pass with a hand-written backward: forward from token ids to logits,
//! keeping what the backward needs (a tape), then every parameter's gradient from the logits'
//! gradient — no autograd graph for the decoder itself.
//!
//! Why it exists: with candle's autograd even fused per-op kernels left most of a training step
//! to graph bookkeeping (each node's gradient starts as a zeroed buffer plus an add, every
//! elementwise op over 64k elements wakes candle's spinning thread pool, every fresh buffer is
//! page-faulted in), so a step of the 5M-parameter benchmark model ran at ~0.55× PyTorch on the
//! same cores. Here the step is the matmuls (candle's CPU gemm, called on its storages), the
//! attention kernels of [`super::train_attention`], and one rayon pass per norm, gate and residual,
//! forward and back.
//!
//! How it plugs into candle: [`forward`] returns the logits as the output of one custom op
//! ([`TapeOp`]) on a fresh one-element `Var`; the op owns the tape, so the tape lives exactly as
//! long as the logits' graph (a forward that is only looked at frees its activations with its
//! loss). The loss is built on the logits with ordinary candle ops; during candle's backward the
//! op receives the logits' gradient, runs the tape's backward and leaves the parameters'
//! gradients in a per-thread collector frame, which [`backward`] (pushed before, popped after
//! `loss.backward()`) inserts into the same `GradStore`, summed where a tensor is used twice (tied
//! embeddings). Losses on next-token log-probs (SFT, GRPO) take [`token_terms_at`] instead: the
//! same op outputs each position's `[log p, logsumexp, entropy]` and keeps the logits to itself,
//! turning them into their gradient in place, so no vocabulary-wide tensor enters the graph.
//! A trainer must therefore call [`backward`] instead of `Tensor::backward` — the decoder's
//! parameters get no gradient otherwise (tests compare every parameter's gradient with the
//! autograd path).
//!
//! What it covers: dense f32 weights on the CPU (Llama and Qwen2 layouts, biases, GQA, both RoPE
//! layouts, tied embeddings, LoRA adapters), rows right-padded from position 0. Anything else
//! (Qwen3's q/k norms, quantized or other-dtype weights, `ENVACE_SLOW_OPS`) is not taken here:
//! [`applies`] says so and the decoder runs the autograd path.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Storage, Tensor, TensorId, Var, bail};
use rayon::prelude::*;
use wide::f32x8;

use super::decoder::{Decoder, Linear, RmsNorm, Weight};
use super::fused::{Kernels, dot, sigmoid8};
use super::train_attention::{AttnOp, AttnShape};

type Result<T> = candle_core::Result<T>;

thread_local! {
    /// Parameter gradients the tapes produced, one frame per [`backward`] running on this
    /// thread. A stack, not one collector: a thread that waits inside a parallel call of one
    /// backward (a rayon worker stepping on behalf of a trainer) may run another trainer's whole
    /// step meanwhile, and that step's gradients must not mix with these.
    static COLLECTED: RefCell<Vec<Grads>> = const { RefCell::new(Vec::new()) };
}

/// Whether [`forward`] can run `decoder`: the fused kernels selected, dense contiguous f32 CPU
/// weights everywhere, and no per-head q/k norm.
pub fn applies(decoder: &Decoder) -> bool {
    let f32_cpu = |t: &Tensor| {
        t.dtype() == candle_core::DType::F32 && t.device().is_cpu() && t.is_contiguous()
    };
    let lin = |l: &Linear| {
        matches!(&l.weight, Weight::Dense(w) if f32_cpu(w))
            && l.bias.as_ref().is_none_or(f32_cpu)
            && l.lora
                .as_ref()
                .is_none_or(|a| f32_cpu(&a.a) && f32_cpu(&a.b))
    };
    Kernels::current() == Kernels::Fused
        && f32_cpu(&decoder.embed.weight)
        && f32_cpu(&decoder.norm.weight)
        && lin(&decoder.lm_head)
        && decoder.cfg.head_dim.is_multiple_of(2)
        && decoder.cfg.num_key_value_heads > 0
        && decoder
            .cfg
            .num_attention_heads
            .is_multiple_of(decoder.cfg.num_key_value_heads)
        && decoder.layers.iter().all(|l| {
            let a = &l.self_attn;
            a.q_norm.is_none()
                && a.k_norm.is_none()
                && f32_cpu(&l.input_layernorm.weight)
                && f32_cpu(&l.post_attention_layernorm.weight)
                && [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]
                    .into_iter()
                    .chain([&l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj])
                    .all(lin)
        })
}

// ---------------------------------------------------------------------------------------------
// Buffers and matmuls

/// A (rows, cols) f32 matrix, row-major, held as a candle CPU storage so that candle's gemm can
/// read it without a copy.
struct Mat {
    s: CpuStorage,
    rows: usize,
    cols: usize,
}

impl Mat {
    fn new(v: Vec<f32>, rows: usize, cols: usize) -> Self {
        Self {
            s: CpuStorage::F32(v),
            rows,
            cols,
        }
    }

    fn zeros(rows: usize, cols: usize) -> Self {
        Self::new(vec![0f32; rows * cols], rows, cols)
    }

    fn data(&self) -> &[f32] {
        match &self.s {
            CpuStorage::F32(v) => v,
            _ => &[],
        }
    }

    fn data_mut(&mut self) -> &mut [f32] {
        match &mut self.s {
            CpuStorage::F32(v) => v,
            _ => &mut [],
        }
    }

    fn into_vec(self) -> Vec<f32> {
        match self.s {
            CpuStorage::F32(v) => v,
            _ => Vec::new(),
        }
    }

    fn layout(&self) -> Layout {
        Layout::contiguous((self.rows, self.cols))
    }
}

/// Run `f` on a CPU tensor's storage and layout (weights: read in place, no copy).
fn with_storage<R>(t: &Tensor, f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(c) => f(c, l),
        _ => bail!("train pass: CPU tensors only"),
    }
}

/// `x Wᵀ`: x (m, k), W (n, k) → (m, n).
fn x_wt(x: &Mat, w: &Tensor) -> Result<Mat> {
    let (n, k) = w.dims2()?;
    if x.cols != k {
        bail!(
            "train pass: x has {} columns, weight {:?}",
            x.cols,
            w.dims()
        );
    }
    with_storage(w, |ws, wl| {
        let rhs = Layout::contiguous_with_offset((n, k), wl.start_offset()).transpose(0, 1)?;
        let out = x.s.matmul(ws, (1, x.rows, n, k), &x.layout(), &rhs)?;
        Ok(Mat {
            s: out,
            rows: x.rows,
            cols: n,
        })
    })
}

/// `g W`: g (m, n), W (n, k) → (m, k).
fn g_w(g: &Mat, w: &Tensor) -> Result<Mat> {
    let (n, k) = w.dims2()?;
    if g.cols != n {
        bail!(
            "train pass: gradient has {} columns, weight {:?}",
            g.cols,
            w.dims()
        );
    }
    with_storage(w, |ws, wl| {
        let rhs = Layout::contiguous_with_offset((n, k), wl.start_offset());
        let out = g.s.matmul(ws, (1, g.rows, k, n), &g.layout(), &rhs)?;
        Ok(Mat {
            s: out,
            rows: g.rows,
            cols: k,
        })
    })
}

/// `gᵀ x`: g (m, n), x (m, k) → (n, k) (a weight's gradient, in the weight's layout).
fn gt_x(g: &Mat, x: &Mat) -> Result<Mat> {
    if g.rows != x.rows {
        bail!(
            "train pass: {} gradient rows for {} input rows",
            g.rows,
            x.rows
        );
    }
    let lhs = g.layout().transpose(0, 1)?;
    let out =
        g.s.matmul(&x.s, (1, g.cols, x.cols, g.rows), &lhs, &x.layout())?;
    Ok(Mat {
        s: out,
        rows: g.cols,
        cols: x.cols,
    })
}

/// `a += b`, elementwise, in parallel when large.
fn add_into(a: &mut [f32], b: &[f32]) {
    const CHUNK: usize = 1 << 14;
    a.par_chunks_mut(CHUNK)
        .zip(b.par_chunks(CHUNK))
        .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

fn scale_in_place(a: &mut [f32], s: f32) {
    a.iter_mut().for_each(|a| *a *= s);
}

/// Rows handed to one rayon task at least.
fn min_rows(d: usize) -> usize {
    (4096 / d.max(1)).max(1)
}

// ---------------------------------------------------------------------------------------------
// Parameter gradients

/// Gradients of the parameters that are `Var`s (all of them when fully fine-tuning; the
/// adapters under LoRA), summed per tensor.
#[derive(Default)]
struct Grads {
    by_id: HashMap<TensorId, (Tensor, Vec<f32>)>,
}

impl Grads {
    fn wants(t: &Tensor) -> bool {
        t.is_variable()
    }

    fn add(&mut self, t: &Tensor, g: Vec<f32>) {
        match self.by_id.get_mut(&t.id()) {
            Some((_, acc)) => add_into(acc, &g),
            None => {
                self.by_id.insert(t.id(), (t.clone(), g));
            }
        }
    }

    /// Adds `other`'s gradients to these.
    fn merge(&mut self, other: Grads) {
        for (_, (t, g)) in other.by_id {
            self.add(&t, g);
        }
    }

    fn into_store(self, store: &mut GradStore) -> Result<()> {
        for (_, (t, g)) in self.by_id {
            let g = Tensor::from_vec(g, t.shape(), t.device())?;
            let g = match store.get(&t) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            store.insert(&t, g);
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Projections (with bias and adapter)

/// What a projection's backward needs beyond its input: the adapter's inner activation x Aᵀ.
struct LinSaved {
    lora_h: Option<Mat>,
}

fn linear_fwd(l: &Linear, x: &Mat) -> Result<(Mat, LinSaved)> {
    let Weight::Dense(w) = &l.weight else {
        bail!("train pass: quantized projection");
    };
    let mut y = x_wt(x, w)?;
    if let Some(b) = &l.bias {
        let b = b.to_vec1::<f32>()?;
        let n = y.cols;
        y.data_mut()
            .par_chunks_mut(n)
            .with_min_len(min_rows(n))
            .for_each(|row| row.iter_mut().zip(&b).for_each(|(o, b)| *o += b));
    }
    let lora_h = match &l.lora {
        None => None,
        Some(a) => {
            let h = x_wt(x, &a.a)?;
            let mut d = x_wt(&h, &a.b)?;
            scale_in_place(d.data_mut(), a.scale as f32);
            add_into(y.data_mut(), d.data());
            Some(h)
        }
    };
    Ok((y, LinSaved { lora_h }))
}

/// Gradients of a projection's parameters into `grads`; returns dx when `need_dx`.
fn linear_bwd(
    l: &Linear,
    x: &Mat,
    saved: &LinSaved,
    g: &Mat,
    grads: &mut Grads,
    need_dx: bool,
) -> Result<Option<Mat>> {
    let Weight::Dense(w) = &l.weight else {
        bail!("train pass: quantized projection");
    };
    if Grads::wants(w) {
        grads.add(w, gt_x(g, x)?.into_vec());
    }
    if let Some(b) = &l.bias
        && Grads::wants(b)
    {
        let n = g.cols;
        let mut db = vec![0f32; n];
        for row in g.data().chunks(n) {
            db.iter_mut().zip(row).for_each(|(d, r)| *d += r);
        }
        grads.add(b, db);
    }
    let mut dx = if need_dx { Some(g_w(g, w)?) } else { None };
    if let (Some(a), Some(h)) = (&l.lora, &saved.lora_h) {
        let s = a.scale as f32;
        // y += s · h Bᵀ, h = x Aᵀ
        let mut dh = g_w(g, &a.b)?;
        scale_in_place(dh.data_mut(), s);
        if Grads::wants(&a.b) {
            let mut db = gt_x(g, h)?;
            scale_in_place(db.data_mut(), s);
            grads.add(&a.b, db.into_vec());
        }
        if Grads::wants(&a.a) {
            grads.add(&a.a, gt_x(&dh, x)?.into_vec());
        }
        if let Some(dx) = dx.as_mut() {
            add_into(dx.data_mut(), g_w(&dh, &a.a)?.data());
        }
    }
    Ok(dx)
}

// ---------------------------------------------------------------------------------------------
// RMSNorm and the SwiGLU gate

/// y = x · rstd · w per row; returns (y, rstd per row).
fn rms_fwd(n: &RmsNorm, x: &Mat) -> Result<(Mat, Vec<f32>)> {
    let w = n.weight.to_vec1::<f32>()?;
    let d = x.cols;
    let eps = n.eps as f32;
    let mut y = Mat::zeros(x.rows, d);
    let mut rstd = vec![0f32; x.rows];
    y.data_mut()
        .par_chunks_mut(d)
        .zip(x.data().par_chunks(d))
        .zip(rstd.par_iter_mut())
        .with_min_len(min_rows(d))
        .for_each(|((y, x), r)| {
            *r = 1.0 / (dot(x, x) / d as f32 + eps).sqrt();
            for ((y, &x), &w) in y.iter_mut().zip(x).zip(&w) {
                *y = x * *r * w;
            }
        });
    Ok((y, rstd))
}

/// dx (returned) and dw (into `grads`) of [`rms_fwd`] for the output gradient `dy`.
fn rms_bwd(n: &RmsNorm, x: &Mat, rstd: &[f32], dy: &Mat, grads: &mut Grads) -> Result<Mat> {
    let w = n.weight.to_vec1::<f32>()?;
    let d = x.cols;
    let mut dx = Mat::zeros(x.rows, d);
    dx.data_mut()
        .par_chunks_mut(d)
        .zip(x.data().par_chunks(d))
        .zip(dy.data().par_chunks(d))
        .zip(rstd.par_iter())
        .with_min_len(min_rows(d))
        .for_each(|(((dx, x), dy), &r)| {
            // n = x·r, dn = dy·w, dx = r·(dn − n·mean(dn·n))
            let mut s = 0f32;
            for ((&x, &dy), &w) in x.iter().zip(dy).zip(&w) {
                s += dy * w * x * r;
            }
            let m = s / d as f32;
            for (((dx, &x), &dy), &w) in dx.iter_mut().zip(x).zip(dy).zip(&w) {
                *dx = r * (dy * w - x * r * m);
            }
        });
    if Grads::wants(&n.weight) {
        // dw = Σ_rows dy · x · r: a partial sum per fixed block of rows, added in block order,
        // so that the result is the same bits whatever the threads and their stealing (a
        // rayon fold splits where the scheduler happens to).
        let rows_per_block = min_rows(d).max(16);
        let partials: Vec<Vec<f32>> = x
            .data()
            .par_chunks(d * rows_per_block)
            .zip(dy.data().par_chunks(d * rows_per_block))
            .zip(rstd.par_chunks(rows_per_block))
            .map(|((x, dy), r)| {
                let mut acc = vec![0f32; d];
                for ((x, dy), &r) in x.chunks(d).zip(dy.chunks(d)).zip(r) {
                    for ((a, &x), &dy) in acc.iter_mut().zip(x).zip(dy) {
                        *a += dy * x * r;
                    }
                }
                acc
            })
            .collect();
        let mut dw = vec![0f32; d];
        for p in &partials {
            dw.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
        grads.add(&n.weight, dw);
    }
    Ok(dx)
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu_mul_fwd(g: &Mat, u: &Mat) -> Mat {
    let mut a = Mat::zeros(g.rows, g.cols);
    const CHUNK: usize = 1 << 12;
    a.data_mut()
        .par_chunks_mut(CHUNK)
        .zip(g.data().par_chunks(CHUNK).zip(u.data().par_chunks(CHUNK)))
        .for_each(|(a, (g, u))| {
            // Eight at a time through the vector sigmoid (the tail by the scalar one).
            let (ac, at) = a.as_chunks_mut::<8>();
            let (gc, gt) = g.as_chunks::<8>();
            let (uc, ut) = u.as_chunks::<8>();
            for ((a, g), u) in ac.iter_mut().zip(gc).zip(uc) {
                let g = f32x8::from(*g);
                *a = (g * sigmoid8(g) * f32x8::from(*u)).to_array();
            }
            for ((a, &g), &u) in at.iter_mut().zip(gt).zip(ut) {
                *a = g * sigmoid(g) * u;
            }
        });
    a
}

/// (d gate, d up) of [`silu_mul_fwd`].
fn silu_mul_bwd(g: &Mat, u: &Mat, da: &Mat) -> (Mat, Mat) {
    let mut dg = Mat::zeros(g.rows, g.cols);
    let mut du = Mat::zeros(g.rows, g.cols);
    const CHUNK: usize = 1 << 12;
    dg.data_mut()
        .par_chunks_mut(CHUNK)
        .zip(du.data_mut().par_chunks_mut(CHUNK))
        .zip(g.data().par_chunks(CHUNK).zip(u.data().par_chunks(CHUNK)))
        .zip(da.data().par_chunks(CHUNK))
        .for_each(|(((dg, du), (g, u)), da)| {
            let (dgc, dgt) = dg.as_chunks_mut::<8>();
            let (duc, dut) = du.as_chunks_mut::<8>();
            let (gc, gt) = g.as_chunks::<8>();
            let (uc, ut) = u.as_chunks::<8>();
            let (dac, dat) = da.as_chunks::<8>();
            let one = f32x8::ONE;
            for ((((dg, du), g), u), da) in dgc.iter_mut().zip(duc).zip(gc).zip(uc).zip(dac) {
                let (g, u, da) = (f32x8::from(*g), f32x8::from(*u), f32x8::from(*da));
                let s = sigmoid8(g);
                *du = (da * g * s).to_array();
                *dg = (da * u * s * (one + g * (one - s))).to_array();
            }
            for ((((dg, du), &g), &u), &da) in dgt.iter_mut().zip(dut).zip(gt).zip(ut).zip(dat) {
                let s = sigmoid(g);
                *du = da * g * s;
                *dg = da * u * s * (1.0 + g * (1.0 - s));
            }
        });
    (dg, du)
}

// ---------------------------------------------------------------------------------------------
// The tape

struct LayerTape {
    x_in: Mat,
    rstd1: Vec<f32>,
    xn1: Mat,
    q: Mat,
    k: Mat,
    v: Mat,
    att: Mat,
    x_mid: Mat,
    rstd2: Vec<f32>,
    xn2: Mat,
    gate: Mat,
    up: Mat,
    act: Mat,
    /// q, k, v, o, gate, up, down.
    lin: [LinSaved; 7],
}

/// One forward's saved activations, waiting for its logits' gradient.
struct Tape {
    decoder: Decoder,
    ids: Vec<u32>,
    b: usize,
    t: usize,
    attn: AttnOp,
    layers: Vec<LayerTape>,
    x_out: Mat,
    rstd_f: Vec<f32>,
    xn_f: Mat,
    /// With logits at selected positions only: the head's input rows and their positions.
    head: Option<(Mat, Vec<usize>)>,
    lm: LinSaved,
}

/// Forward `ids` (b, t) from position 0: logits (b, t, vocab). When any parameter is a `Var`,
/// the logits carry the tape for [`backward`]; otherwise they are a plain tensor. Callers check
/// [`applies`] first.
pub fn forward(decoder: &Decoder, ids: &Tensor) -> Result<Tensor> {
    forward_at(decoder, ids, None)
}

/// [`forward`] with the logits computed only at the flat positions `rows` (indices into the
/// `b · t` positions, row-major): (rows.len(), vocab). A loss that reads a few positions (the
/// generated tokens of SFT and GRPO rows) then skips the vocabulary projection, its softmax and
/// its backward everywhere else — with a 49k vocabulary, a fifth of a step's work.
pub fn forward_at(decoder: &Decoder, ids: &Tensor, rows: Option<&[usize]>) -> Result<Tensor> {
    let (b, t) = ids.dims2()?;
    let (data, v, tape) = run_forward(decoder, ids, rows)?;
    let shape = match rows {
        None => Shape::from((b, t, v)),
        Some(r) => Shape::from((r.len(), v)),
    };
    match tape {
        None => Tensor::from_vec(data, shape, &decoder.device),
        Some(tape) => tape_node(decoder, tape, data, v, None, shape),
    }
}

/// Per selected position, `[log p(target), logsumexp, entropy]` of the next-token
/// distribution: (rows.len(), 3), differentiable like [`forward_at`]'s logits. The logits stay
/// inside the graph node: its backward turns them into their own gradient in place, so neither
/// the (rows × vocab) logits' gradient nor candle's zeroed accumulator for it is ever allocated
/// (with SmolLM2's 49k vocabulary, 200 MB per 1k rows each). Same numbers as
/// [`super::fused::token_logprobs_entropy`] on [`forward_at`]'s logits.
pub fn token_terms_at(
    decoder: &Decoder,
    ids: &Tensor,
    rows: &[usize],
    targets: &[u32],
) -> Result<Tensor> {
    let (data, v, tape) = run_forward(decoder, ids, Some(rows))?;
    let stats = super::fused::token_stats(&data, v, targets, "train pass token terms")?;
    let shape = Shape::from((rows.len(), 3));
    match tape {
        None => Tensor::from_vec(stats, shape, &decoder.device),
        Some(tape) => {
            let terms = Terms {
                targets: targets.to_vec(),
                stats: Mutex::new(Some(stats)),
            };
            tape_node(decoder, tape, data, v, Some(terms), shape)
        }
    }
}

/// The graph node [`TapeOp`] on a fresh one-element `Var`: its output is the logits (`terms`
/// `None`) or the token terms, of `shape`.
fn tape_node(
    decoder: &Decoder,
    tape: Tape,
    logits: Vec<f32>,
    vocab: usize,
    terms: Option<Terms>,
    shape: Shape,
) -> Result<Tensor> {
    let anchor = Var::zeros(1, candle_core::DType::F32, &decoder.device)?;
    anchor.as_tensor().apply_op1(TapeOp {
        logits: Mutex::new(Some(logits)),
        shape,
        vocab,
        terms,
        tape: Mutex::new(Some(tape)),
    })
}

/// The forward itself: the logits (row-major, `vocab` wide) at `rows` (all positions when
/// `None`), and the tape when any parameter is a `Var`.
fn run_forward(
    decoder: &Decoder,
    ids: &Tensor,
    rows: Option<&[usize]>,
) -> Result<(Vec<f32>, usize, Option<Tape>)> {
    let (b, t) = ids.dims2()?;
    let cfg = &decoder.cfg;
    let (max, _) = decoder.rope.tables().0.dims2()?;
    if t > max {
        bail!("sequence of {t} tokens exceeds max_position_embeddings {max}");
    }
    let ids_v: Vec<u32> = ids.flatten_all()?.to_vec1::<u32>()?;
    let m = b * t;
    let h = cfg.hidden_size;
    let vocab = decoder.embed.weight.dim(0)?;
    if let Some(&bad) = ids_v.iter().find(|&&i| i as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary ({vocab})");
    }
    // Embedding rows.
    let mut x = Mat::zeros(m, h);
    with_storage(&decoder.embed.weight, |s, l| {
        let e = super::fused::f32s(s, l, "train pass embedding")?;
        for (row, &id) in x.data_mut().chunks_mut(h).zip(&ids_v) {
            let at = id as usize * h;
            row.copy_from_slice(&e[at..at + h]);
        }
        Ok(())
    })?;
    let (cos, sin) = decoder.rope.tables();
    let half = cfg.head_dim / 2;
    let attn = AttnOp {
        shape: AttnShape {
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            interleaved: decoder.rope.is_interleaved(),
        },
        cos: cos.narrow(0, 0, t)?.flatten_all()?.to_vec1::<f32>()?,
        sin: sin.narrow(0, 0, t)?.flatten_all()?.to_vec1::<f32>()?,
    };
    if attn.cos.len() != t * half {
        bail!(
            "train pass: rope tables do not match head_dim {}",
            cfg.head_dim
        );
    }
    let mut layers = Vec::with_capacity(decoder.layers.len());
    for layer in &decoder.layers {
        let a = &layer.self_attn;
        let (xn1, rstd1) = rms_fwd(&layer.input_layernorm, &x)?;
        let (q, sq) = linear_fwd(&a.q_proj, &xn1)?;
        let (k, sk) = linear_fwd(&a.k_proj, &xn1)?;
        let (v, sv) = linear_fwd(&a.v_proj, &xn1)?;
        let att = attn.forward_all(q.data(), k.data(), v.data(), b, t);
        let att = Mat::new(att, m, q.cols);
        let (o, so) = linear_fwd(&a.o_proj, &att)?;
        let mut x_mid = Mat::new(x.data().to_vec(), m, h);
        add_into(x_mid.data_mut(), o.data());
        let mlp = &layer.mlp;
        let (xn2, rstd2) = rms_fwd(&layer.post_attention_layernorm, &x_mid)?;
        let (gate, sg) = linear_fwd(&mlp.gate_proj, &xn2)?;
        let (up, su) = linear_fwd(&mlp.up_proj, &xn2)?;
        let act = silu_mul_fwd(&gate, &up);
        let (down, sd) = linear_fwd(&mlp.down_proj, &act)?;
        let mut x_next = Mat::new(x_mid.data().to_vec(), m, h);
        add_into(x_next.data_mut(), down.data());
        layers.push(LayerTape {
            x_in: x,
            rstd1,
            xn1,
            q,
            k,
            v,
            att,
            x_mid,
            rstd2,
            xn2,
            gate,
            up,
            act,
            lin: [sq, sk, sv, so, sg, su, sd],
        });
        x = x_next;
    }
    let (xn_f, rstd_f) = rms_fwd(&decoder.norm, &x)?;
    let head_in = match rows {
        None => None,
        Some(rows) => {
            if let Some(&bad) = rows.iter().find(|&&r| r >= m) {
                bail!("train pass: position {bad} is outside the {m} positions");
            }
            let mut sel = Mat::zeros(rows.len(), h);
            for (dst, &r) in sel.data_mut().chunks_mut(h).zip(rows) {
                dst.copy_from_slice(&xn_f.data()[r * h..(r + 1) * h]);
            }
            Some(sel)
        }
    };
    let (logits, lm) = linear_fwd(&decoder.lm_head, head_in.as_ref().unwrap_or(&xn_f))?;
    let (v, data) = (logits.cols, logits.into_vec());
    if !any_variable(decoder) {
        return Ok((data, v, None));
    }
    let tape = Tape {
        decoder: decoder.clone(),
        ids: ids_v,
        b,
        t,
        attn,
        layers,
        x_out: x,
        rstd_f,
        xn_f,
        head: head_in.map(|x| (x, rows.map(<[usize]>::to_vec).unwrap_or_default())),
        lm,
    };
    Ok((data, v, Some(tape)))
}

/// The logits, or their token terms, as a graph node that owns its tape: forward hands over
/// what [`forward_at`] or [`token_terms_at`] computed; backward runs the tape with the logits'
/// gradient (see the module header).
struct TapeOp {
    /// The logits: handed over as the output, or (with `terms`) kept for the backward.
    logits: Mutex<Option<Vec<f32>>>,
    shape: Shape,
    vocab: usize,
    terms: Option<Terms>,
    tape: Mutex<Option<Tape>>,
}

/// [`token_terms_at`]'s output: the targets and the (rows, 3) statistics handed over.
struct Terms {
    targets: Vec<u32>,
    stats: Mutex<Option<Vec<f32>>>,
}

impl CustomOp1 for TapeOp {
    fn name(&self) -> &'static str {
        "envace-train-pass"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match &self.terms {
            None => self.logits.lock().ok().and_then(|mut l| l.take()),
            Some(terms) => terms.stats.lock().ok().and_then(|mut s| s.take()),
        };
        match out {
            Some(d) => Ok((CpuStorage::F32(d), self.shape.clone())),
            None => bail!("train pass: the output was already handed over"),
        }
    }

    fn bwd(&self, _anchor: &Tensor, out: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        // Once per tape: a second backward through the same graph has no activations left.
        let tape = self.tape.lock().ok().and_then(|mut t| t.take());
        let Some(tape) = tape else {
            bail!("train pass: this forward was already differentiated (run forward again)");
        };
        let v = self.vocab;
        let dlogits = match &self.terms {
            None => g.flatten_all()?.to_vec1::<f32>()?,
            Some(terms) => {
                let logits = self.logits.lock().ok().and_then(|mut l| l.take());
                let Some(mut logits) = logits else {
                    bail!("train pass: the logits were already differentiated");
                };
                let stats = out.flatten_all()?.to_vec1::<f32>()?;
                let grads = g.flatten_all()?.to_vec1::<f32>()?;
                super::fused::logprob_grads_in_place(
                    &mut logits,
                    v,
                    &terms.targets,
                    &stats,
                    &grads,
                );
                logits
            }
        };
        let rows = dlogits.len() / v.max(1);
        // The running backward's frame, taken out while the tape runs (its parallel calls may
        // run another backward on this thread) and added back after. Outside [`backward`] (a
        // plain `loss.backward()`) there is none, and the gradients are dropped.
        let mut grads = COLLECTED.with(|c| c.borrow_mut().last_mut().map(std::mem::take));
        let mut scratch = Grads::default();
        tape.backward(
            Mat::new(dlogits, rows, v),
            grads.as_mut().unwrap_or(&mut scratch),
        )?;
        if let Some(g) = grads {
            COLLECTED.with(|c| {
                if let Some(top) = c.borrow_mut().last_mut() {
                    top.merge(g);
                }
            });
        }
        Ok(None)
    }
}

fn any_variable(d: &Decoder) -> bool {
    let lin = |l: &Linear| {
        matches!(&l.weight, Weight::Dense(w) if w.is_variable())
            || l.bias.as_ref().is_some_and(Tensor::is_variable)
            || l.lora
                .as_ref()
                .is_some_and(|a| a.a.is_variable() || a.b.is_variable())
    };
    d.embed.weight.is_variable()
        || d.norm.weight.is_variable()
        || lin(&d.lm_head)
        || d.layers.iter().any(|l| {
            let a = &l.self_attn;
            l.input_layernorm.weight.is_variable()
                || l.post_attention_layernorm.weight.is_variable()
                || [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]
                    .into_iter()
                    .chain([&l.mlp.gate_proj, &l.mlp.up_proj, &l.mlp.down_proj])
                    .any(lin)
        })
}

impl Tape {
    /// Every parameter's gradient for the logits' gradient `g`: (b·t, vocab), or (rows, vocab)
    /// when the forward computed logits at selected positions only.
    fn backward(self, g: Mat, grads: &mut Grads) -> Result<()> {
        let d = &self.decoder;
        let (b, t) = (self.b, self.t);
        let m = b * t;
        let h = d.cfg.hidden_size;
        let expected = self.head.as_ref().map_or(m, |(_, rows)| rows.len());
        if g.rows != expected {
            bail!(
                "train pass: logits' gradient has {} rows for {expected} positions",
                g.rows
            );
        }
        let dxn = match &self.head {
            None => linear_bwd(&d.lm_head, &self.xn_f, &self.lm, &g, grads, true)?,
            Some((x_sel, rows)) => {
                // Positions without logits get no gradient from the head.
                linear_bwd(&d.lm_head, x_sel, &self.lm, &g, grads, true)?.map(|dsel| {
                    let mut full = Mat::zeros(m, h);
                    for (src, &r) in dsel.data().chunks(h).zip(rows) {
                        full.data_mut()[r * h..(r + 1) * h].copy_from_slice(src);
                    }
                    full
                })
            }
        };
        let Some(dxn) = dxn else {
            bail!("train pass: no input gradient from the head");
        };
        let mut dx = rms_bwd(&d.norm, &self.x_out, &self.rstd_f, &dxn, grads)?;
        for (layer, lt) in d.layers.iter().zip(&self.layers).rev() {
            let mlp = &layer.mlp;
            let [sq, sk, sv, so, sg, su, sd] = &lt.lin;
            // x_out = x_mid + down(act)
            let Some(dact) = linear_bwd(&mlp.down_proj, &lt.act, sd, &dx, grads, true)? else {
                bail!("train pass: no gradient for the MLP activation");
            };
            let (dg, du) = silu_mul_bwd(&lt.gate, &lt.up, &dact);
            let dxn2 = match (
                linear_bwd(&mlp.gate_proj, &lt.xn2, sg, &dg, grads, true)?,
                linear_bwd(&mlp.up_proj, &lt.xn2, su, &du, grads, true)?,
            ) {
                (Some(mut a), Some(c)) => {
                    add_into(a.data_mut(), c.data());
                    a
                }
                _ => bail!("train pass: no gradient for the MLP input"),
            };
            let dmid = rms_bwd(
                &layer.post_attention_layernorm,
                &lt.x_mid,
                &lt.rstd2,
                &dxn2,
                grads,
            )?;
            add_into(dx.data_mut(), dmid.data());
            // x_mid = x_in + o(att)
            let a = &layer.self_attn;
            let Some(datt) = linear_bwd(&a.o_proj, &lt.att, so, &dx, grads, true)? else {
                bail!("train pass: no gradient for the attention output");
            };
            let (dq, dk, dv) =
                self.attn
                    .backward_all(lt.q.data(), lt.k.data(), lt.v.data(), datt.data(), b, t);
            let (dq, dk, dv) = (
                Mat::new(dq, m, lt.q.cols),
                Mat::new(dk, m, lt.k.cols),
                Mat::new(dv, m, lt.v.cols),
            );
            let mut dxn1 = Mat::zeros(m, h);
            for (l, x_grad, saved) in [
                (&a.q_proj, &dq, sq),
                (&a.k_proj, &dk, sk),
                (&a.v_proj, &dv, sv),
            ] {
                if let Some(part) = linear_bwd(l, &lt.xn1, saved, x_grad, grads, true)? {
                    add_into(dxn1.data_mut(), part.data());
                }
            }
            let din = rms_bwd(&layer.input_layernorm, &lt.x_in, &lt.rstd1, &dxn1, grads)?;
            add_into(dx.data_mut(), din.data());
        }
        if Grads::wants(&d.embed.weight) {
            let mut de = vec![0f32; d.embed.weight.elem_count()];
            for (row, &id) in dx.data().chunks(h).zip(&self.ids) {
                let at = id as usize * h;
                de[at..at + h]
                    .iter_mut()
                    .zip(row)
                    .for_each(|(e, r)| *e += r);
            }
            grads.add(&d.embed.weight, de);
        }
        Ok(())
    }
}

/// `loss.backward()` plus the decoder parameters' gradients of every training forward whose
/// logits the loss depends on (see the module header).
pub fn backward(loss: &Tensor) -> Result<GradStore> {
    COLLECTED.with(|c| c.borrow_mut().push(Grads::default()));
    let store = loss.backward();
    let grads = COLLECTED.with(|c| c.borrow_mut().pop()).unwrap_or_default();
    let mut store = store?;
    grads.into_store(&mut store)?;
    Ok(store)
}
