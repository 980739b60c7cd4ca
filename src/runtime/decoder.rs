//! The project's own llama-family decoder (Llama, Qwen2, Qwen3 from one implementation).
//!
//! Why it exists: candle-transformers' stock models cannot train (their fused ops have no
//! backward) and hide their KV cache. This decoder
//! - runs candle's fused ops (`rms_norm`, `rope`, `softmax_last_dim`) in [`Pass::Infer`] and
//!   differentiable ones in [`Pass::Train`]: the fused custom ops with their own backward in
//!   [`super::fused`] (f32 on CPU), else candle's `rms_norm_slow`, `rope_slow`, `softmax`;
//! - takes an explicit, batched, forkable [`KvCache`] (rehearsal branches share a prefill);
//! - returns logits for every position when asked (the trainer needs them);
//! - holds each projection either dense (safetensors, trainable, optionally LoRA-wrapped) or
//!   quantized (GGUF via candle's `QMatMul` and the tiles of [`super::quant_tiles`]), with an
//!   f32 copy for prefill where it fits and the tiles do not prefill faster.
//!
//! Reference: HF `modeling_llama.py` / `modeling_qwen2.py` / `modeling_qwen3.py`.

use std::sync::Arc;

use candle_core::quantized::QMatMul;
use candle_core::{DType, Device, Module, Tensor};

use super::config::DecoderConfig;
use super::kv_cache::KvCache;

type Result<T> = candle_core::Result<T>;

/// Which candle ops to use: fused (fast, no backward) or differentiable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    Infer,
    Train,
}

/// Which positions to return logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsAt {
    Last,
    All,
}

/// A low-rank adapter on a projection: y += (alpha/r) · (x Aᵀ) Bᵀ, with A (r × in) and
/// B (out × r). Plain matmuls, so the same hook serves [`Pass::Infer`] and [`Pass::Train`]; when
/// A and B are `Var`s they are the only tensors of the projection that receive gradients.
#[derive(Debug, Clone)]
pub struct LoraWeights {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
}

impl LoraWeights {
    /// The dense update `scale · B A` (out × in), in f32.
    pub fn delta(&self) -> Result<Tensor> {
        let a = self.a.to_dtype(DType::F32)?;
        let b = self.b.to_dtype(DType::F32)?;
        b.matmul(&a)? * self.scale
    }
}

/// A projection's weight, dense or quantized.
#[derive(Debug, Clone)]
pub enum Weight {
    Dense(Tensor),
    Quant {
        q: Arc<QMatMul>,
        /// f32 copy used when many rows are multiplied at once (prefill), where candle's gemm
        /// beats the quantized kernels. Absent when it would not fit the memory budget, and
        /// where the tiles prefill faster (see [`crate::runtime::loader::PrefillOn`]).
        dense: Option<Tensor>,
        /// `Some((start, len))` when `q` holds several projections stacked (q/k/v, gate/up:
        /// one input quantization and one kernel call per step instead of two or three) and
        /// this one is output features `start..start + len` of it.
        part: Option<(usize, usize)>,
        /// The same weight repacked for the tiled AVX-512 / AVX2 decode kernels
        /// ([`super::quant_tiles`]: the legacy types and the k-quants); absent on other CPUs and
        /// types. Stacked like `q`, and also where `q` could not be (projections of different
        /// types): then this one is rows `tile_rows` of it.
        tiles: Option<Arc<super::quant_tiles::Tiles>>,
        /// `Some((start, len))` when `tiles` holds several projections stacked.
        tile_rows: Option<(usize, usize)>,
    },
}

/// The stacked matrix several [`Linear`]s are parts of, if they are exactly that (in order, no
/// gaps; adapters and biases are added per part afterwards): `rows` names each part's rows in
/// it, `matrix` the shared value (compared by address).
fn shared<'a, T>(
    parts: &[&'a Linear],
    rows: impl Fn(&'a Weight) -> Option<((usize, usize), &'a Arc<T>)>,
) -> Option<&'a Arc<T>> {
    let mut fused: Option<&'a Arc<T>> = None;
    let mut next = 0;
    for l in parts {
        let ((start, len), m) = rows(&l.weight)?;
        if start != next || fused.is_some_and(|f| !Arc::ptr_eq(f, m)) {
            return None;
        }
        fused = Some(m);
        next = start + len;
    }
    fused
}

/// A projection's rows in its stacked tiles, and the tiles.
fn tile_part(w: &Weight) -> Option<((usize, usize), &Arc<super::quant_tiles::Tiles>)> {
    match w {
        Weight::Quant {
            tiles: Some(t),
            tile_rows: Some(r),
            ..
        } => Some((*r, t)),
        _ => None,
    }
}

/// A projection's rows in its stacked quantized matrix, and the matrix.
fn q_part(w: &Weight) -> Option<((usize, usize), &Arc<QMatMul>)> {
    match w {
        Weight::Quant {
            q, part: Some(r), ..
        } => Some((*r, q)),
        _ => None,
    }
}

/// Whether the tiled kernels take a product with `x2` (rows, in): f32 inference input on the
/// CPU. Callers ask only where no dense copy serves the rows (decode steps; prefill of a model
/// loaded without f32 copies), so many rows here are a prefill: one pass per tile over them,
/// where candle's quantized kernels read every weight again for each row.
fn tiles_take(x2: &Tensor) -> Result<bool> {
    Ok(super::infer::is_enabled()
        && !x2.track_op()
        && x2.device().is_cpu()
        && x2.dtype() == DType::F32
        && x2.dim(0)? > 0)
}

/// Rows above which a quantized projection uses its dense copy: candle's quantized matmul
/// re-reads the weights for every row, gemm reads them once.
const PREFILL_DENSE_ROWS: usize = super::infer::FEW_ROWS;

/// `y = x Wᵀ + b` (+ LoRA).
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Tensor>,
    pub lora: Option<LoraWeights>,
}

impl Linear {
    pub fn dense(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight: Weight::Dense(weight),
            bias,
            lora: None,
        }
    }

    /// `(out_features, in_features)`.
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.weight {
            Weight::Dense(w) => w.dims2(),
            Weight::Quant {
                part: Some((_, len)),
                q,
                ..
            } => {
                let (_, inp) = match q.as_ref() {
                    QMatMul::QTensor(t) => t.shape().dims2()?,
                    QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.dims2()?,
                };
                Ok((*len, inp))
            }
            Weight::Quant { q, .. } => match q.as_ref() {
                QMatMul::QTensor(t) => t.shape().dims2(),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.dims2(),
            },
        }
    }

    /// Fold the adapter into a dense weight (`W + scale · B A`, computed in f32) and drop it.
    /// Quantized projections keep their adapter attached (there is no dense weight to fold into).
    pub fn merge_lora(&mut self) -> Result<()> {
        let (Weight::Dense(w), Some(l)) = (&self.weight, &self.lora) else {
            return Ok(());
        };
        let merged = (w.to_dtype(DType::F32)? + l.delta()?)?.to_dtype(w.dtype())?;
        self.weight = Weight::Dense(merged);
        self.lora = None;
        Ok(())
    }

    /// Bias and adapter on a base product `y` of `x2` (rows, in).
    fn extras(&self, mut y: Tensor, x2: &Tensor) -> Result<Tensor> {
        if let Some(b) = &self.bias {
            y = y.broadcast_add(b)?;
        }
        if let Some(l) = &self.lora {
            // Decode steps: the few-row kernel (candle's matmul costs more per call than these
            // rank-r products do, and a LoRA model makes two per projection per step).
            let delta = if super::infer::few_rows_applies(x2, &l.a) && l.b.is_contiguous() {
                let h = super::infer::few_rows_matmul(x2, &l.a)?;
                super::infer::few_rows_matmul(&h, &l.b)?
            } else {
                x2.matmul(&l.a.t()?)?.matmul(&l.b.t()?)?
            };
            y = (y + (delta * l.scale)?)?;
        }
        Ok(y)
    }

    /// Several projections of the same input. Stacked quantized parts (see
    /// [`Weight::Quant`]'s `part`) take one kernel call for all of them when the quantized
    /// kernel is what would run anyway (a few rows, or no dense copy); otherwise each runs
    /// alone.
    pub fn forward_many(parts: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>> {
        let dims = x.dims().to_vec();
        let last = dims.len() - 1;
        let rows: usize = dims[..last].iter().product();
        let quant_runs = parts.iter().all(|l| match &l.weight {
            Weight::Quant { dense, .. } => dense.is_none() || rows <= PREFILL_DENSE_ROWS,
            Weight::Dense(_) => false,
        });
        if !quant_runs {
            return parts.iter().map(|l| l.forward(x)).collect();
        }
        let x2 = x.reshape((rows, dims[last]))?;
        // One call for all parts: their shared tiles (whatever their types; each part its own
        // result), else their shared quantized matrix (narrowed per part).
        let ys: Vec<Tensor> = match shared(parts, tile_part) {
            Some(t) if tiles_take(&x2)? => {
                let rows: Option<Vec<(usize, usize)>> = parts
                    .iter()
                    .map(|l| tile_part(&l.weight).map(|(r, _)| r))
                    .collect();
                let Some(rows) = rows else {
                    candle_core::bail!("stacked projection without its part");
                };
                t.matmul_parts(&x2, &rows)?
            }
            _ => match shared(parts, q_part) {
                Some(q) => {
                    let y = q.forward(&x2)?;
                    parts
                        .iter()
                        .map(|l| match q_part(&l.weight) {
                            Some(((start, len), _)) => y.narrow(1, start, len),
                            None => candle_core::bail!("stacked projection without its part"),
                        })
                        .collect::<Result<_>>()?
                }
                None => return parts.iter().map(|l| l.forward(x)).collect(),
            },
        };
        parts
            .iter()
            .zip(ys)
            .map(|(l, y)| {
                let len = y.dim(1)?;
                let yi = l.extras(y, &x2)?;
                let mut out_dims = dims.clone();
                out_dims[last] = len;
                yi.reshape(out_dims)
            })
            .collect()
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let last = dims.len() - 1;
        let rows: usize = dims[..last].iter().product();
        let x2 = x.reshape((rows, dims[last]))?;
        let y = match &self.weight {
            // Decode steps (one position per row, a few rows) and the last position's logits
            // (b, hidden) in inference: each weight row read once (see `infer`), and a row's
            // result is the same whatever the batch (gemm's kernels differ with the row count).
            // Prefill keeps gemm, so that a short prompt gives the same logits in a model with
            // and without (zero) adapters.
            Weight::Dense(w)
                if (dims.len() == 2 || dims.len() == 3 && dims[1] == 1)
                    && super::infer::few_rows_applies(&x2, w) =>
            {
                super::infer::few_rows_matmul(&x2, w)?
            }
            Weight::Dense(w) => x2.matmul(&w.t()?)?,
            Weight::Quant {
                q,
                dense,
                part,
                tiles,
                tile_rows,
            } => match (dense, tiles) {
                (Some(w), _) if rows > PREFILL_DENSE_ROWS => x2.matmul(&w.t()?)?,
                (_, Some(t)) if tiles_take(&x2)? => match tile_rows {
                    Some(part) => t.matmul_parts(&x2, &[*part])?.pop().ok_or_else(|| {
                        candle_core::Error::Msg("tiled matmul: no result for the part".into())
                    })?,
                    None => t.matmul(&x2)?,
                },
                _ => {
                    let y = q.forward(&x2)?;
                    match part {
                        Some((start, len)) => y.narrow(1, *start, *len)?,
                        None => y,
                    }
                }
            },
        };
        let y = self.extras(y, &x2)?;
        let mut out_dims = dims;
        out_dims[last] = y.dim(1)?;
        y.reshape(out_dims)
    }
}

/// RMSNorm with a learned scale.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn forward(&self, x: &Tensor, pass: Pass) -> Result<Tensor> {
        match pass {
            Pass::Infer => {
                candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight, self.eps as f32)
            }
            Pass::Train => super::fused::rms_norm(x, &self.weight, self.eps as f32),
        }
    }
}

/// Precomputed RoPE tables.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    interleaved: bool,
}

impl Rope {
    /// The (cos, sin) tables, (max positions, head_dim / 2) each.
    pub fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    /// Whether pairs (2i, 2i+1) rotate together (else (i, i + d/2)).
    pub fn is_interleaved(&self) -> bool {
        self.interleaved
    }

    pub fn new(cfg: &DecoderConfig, dtype: DType, device: &Device) -> Result<Self> {
        let inv = cfg.rope_inv_freq();
        let n = inv.len();
        let inv = Tensor::from_vec(inv, (1, n), device)?;
        let max = cfg.max_position_embeddings;
        let t = Tensor::arange(0u32, max as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max, 1))?;
        let freqs = t.matmul(&inv)?;
        Ok(Self {
            cos: freqs.cos()?.to_dtype(dtype)?,
            sin: freqs.sin()?.to_dtype(dtype)?,
            interleaved: cfg.rope_interleaved,
        })
    }

    /// `x`: (b, h, l, d), positions `offset..offset+l`.
    fn apply(&self, x: &Tensor, offset: usize, pass: Pass) -> Result<Tensor> {
        let (_, _, l, _) = x.dims4()?;
        let max = self.cos.dim(0)?;
        if offset + l > max {
            candle_core::bail!(
                "sequence of {} tokens exceeds max_position_embeddings {max}",
                offset + l
            );
        }
        let cos = self.cos.narrow(0, offset, l)?;
        let sin = self.sin.narrow(0, offset, l)?;
        let x = x.contiguous()?;
        match (pass, self.interleaved) {
            (Pass::Infer, false) => candle_nn::rotary_emb::rope(&x, &cos, &sin),
            (Pass::Infer, true) => candle_nn::rotary_emb::rope_i(&x, &cos, &sin),
            (Pass::Train, interleaved) => super::fused::rope(&x, &cos, &sin, interleaved),
        }
    }
}

/// One attention block's weights.
#[derive(Debug, Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
}

/// The SwiGLU MLP.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

impl Mlp {
    /// The gate as one fused pass (inference and the autograd training pass alike; candle's
    /// `silu` then `*` allocated and filled two gate-sized tensors).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gu = Linear::forward_many(&[&self.gate_proj, &self.up_proj], x)?;
        self.down_proj
            .forward(&super::fused::silu_mul(&gu[0], &gu[1])?)
    }
}

/// One transformer block.
#[derive(Debug, Clone)]
pub struct Layer {
    pub input_layernorm: RmsNorm,
    pub self_attn: Attention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: Mlp,
}

/// Token embeddings: a dense table.
#[derive(Debug, Clone)]
pub struct Embedding {
    pub weight: Tensor,
}

/// The decoder.
#[derive(Debug, Clone)]
pub struct Decoder {
    pub cfg: DecoderConfig,
    pub embed: Embedding,
    pub layers: Vec<Layer>,
    pub norm: RmsNorm,
    pub lm_head: Linear,
    pub rope: Rope,
    pub device: Device,
    pub dtype: DType,
}

/// Additive attention mask (b, 1, l, s): causal −inf plus a finite large negative on left
/// padding (a fully padded query row then stays finite instead of becoming NaN).
fn build_mask(
    b: usize,
    l: usize,
    offset: usize,
    pad: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Option<Tensor>> {
    let s = offset + l;
    let any_pad = pad.iter().any(|&p| p > 0);
    if l == 1 && !any_pad {
        return Ok(None);
    }
    let mut data = vec![0f32; b * l * s];
    for r in 0..b {
        let p = pad.get(r).copied().unwrap_or(0);
        for i in 0..l {
            for j in 0..s {
                let v = if j > offset + i {
                    f32::NEG_INFINITY
                } else if j < p {
                    -1e9
                } else {
                    0.0
                };
                data[(r * l + i) * s + j] = v;
            }
        }
    }
    Ok(Some(
        Tensor::from_vec(data, (b, 1, l, s), device)?.to_dtype(dtype)?,
    ))
}

impl Attention {
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        cfg: &DecoderConfig,
        rope: &Rope,
        mask: Option<&Tensor>,
        cache: &mut KvCache,
        layer: usize,
        pass: Pass,
    ) -> Result<Tensor> {
        let (b, l, _) = x.dims3()?;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let offset = cache.seq_len();
        let qkv = Linear::forward_many(&[&self.q_proj, &self.k_proj, &self.v_proj], x)?;
        let q = qkv[0].reshape((b, l, nh, hd))?.transpose(1, 2)?;
        let k = qkv[1].reshape((b, l, nkv, hd))?.transpose(1, 2)?;
        let v = qkv[2].reshape((b, l, nkv, hd))?.transpose(1, 2)?;
        let q = match &self.q_norm {
            Some(n) => n.forward(&q.contiguous()?, pass)?,
            None => q,
        };
        let k = match &self.k_norm {
            Some(n) => n.forward(&k.contiguous()?, pass)?,
            None => k,
        };
        let q = rope.apply(&q, offset, pass)?;
        let k = rope.apply(&k, offset, pass)?;
        if pass == Pass::Infer && super::infer::supports(&q) {
            // Decode step: one-pass attention over the cache (same scores, mask and result),
            // reading a shared prefix once for all rows.
            let kv = cache.append_decode(layer, &k, &v.contiguous()?)?;
            let scale = (1.0 / (hd as f64).sqrt()) as f32;
            let prefix = kv.prefix.as_ref().map(|(k, v)| (k, v));
            let out = super::infer::attend_one(&q, prefix, &kv.k, &kv.v, cache.pad(b), scale)?;
            return self.o_proj.forward(&out);
        }
        let (k, v) = cache.append(layer, &k, &v.contiguous()?, pass == Pass::Infer)?;
        let s = k.dim(2)?;
        let groups = nh / nkv;
        // GQA without copying k/v: fold the query groups into the row dimension.
        let q = q.reshape((b, nkv, groups * l, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let att = q.matmul(&k.t()?)?;
        if pass == Pass::Infer && super::infer::prefill_supports(&att) {
            // Prefill: scale, mask and softmax in one pass over the fresh scores, in place.
            super::infer::softmax_prefill(&att, scale as f32, l, offset, cache.pad(b))?;
            return self.attend_values(&att, &v, b, l);
        }
        let att = (att * scale)?;
        let att = match mask {
            Some(m) => {
                let att = att.reshape((b, nkv, groups, l, s))?;
                let m = m.reshape((b, 1, 1, l, s))?;
                att.broadcast_add(&m)?.reshape((b, nkv, groups * l, s))?
            }
            None => att,
        };
        let att = match pass {
            Pass::Infer => candle_nn::ops::softmax_last_dim(&att.contiguous()?)?,
            Pass::Train => super::fused::softmax_last_dim(&att)?,
        };
        self.attend_values(&att, &v, b, l)
    }

    /// The probabilities `att` (b, nkv, groups·l, s) times the values, heads back in order,
    /// through the output projection.
    fn attend_values(&self, att: &Tensor, v: &Tensor, b: usize, l: usize) -> Result<Tensor> {
        let (_, nkv, _, hd) = v.dims4()?;
        let nh = att.dim(2)? / l * nkv;
        let out = att.matmul(v)?; // (b, nkv, groups*l, hd)
        let out = out
            .reshape((b, nh, l, hd))?
            .transpose(1, 2)?
            .reshape((b, l, nh * hd))?;
        self.o_proj.forward(&out)
    }
}

impl Decoder {
    /// Forward `ids` (b, l) after the cached positions. Appends to `cache`. Returns logits
    /// (b, vocab) for [`LogitsAt::Last`] or (b, l, vocab) for [`LogitsAt::All`], in f32.
    pub fn forward(
        &self,
        ids: &Tensor,
        cache: &mut KvCache,
        pass: Pass,
        at: LogitsAt,
    ) -> Result<Tensor> {
        if pass == Pass::Infer && self.device.is_cpu() {
            return super::par::on_pool(|| self.forward_here(ids, cache, pass, at));
        }
        self.forward_here(ids, cache, pass, at)
    }

    /// [`Decoder::forward`] on the calling thread.
    fn forward_here(
        &self,
        ids: &Tensor,
        cache: &mut KvCache,
        pass: Pass,
        at: LogitsAt,
    ) -> Result<Tensor> {
        let h = self.hidden(ids, cache, pass)?;
        let (_, l, _) = h.dims3()?;
        let h = match at {
            LogitsAt::Last => h.narrow(1, l - 1, 1)?.squeeze(1)?,
            LogitsAt::All => h,
        };
        self.lm_head.forward(&h)?.to_dtype(DType::F32)
    }

    /// Training forward of `ids` (b, l) from position 0 without a cache: logits (b, l, vocab)
    /// at every position, differentiable. Rows are right-padded (causal attention needs no pad
    /// mask then). Dense f32 CPU models run [`super::train_pass`] (a hand-written backward:
    /// differentiate the loss with [`super::train_pass::backward`]); anything it does not cover
    /// runs [`Decoder::forward`] with [`Pass::Train`] through candle's autograd, which computes
    /// the same values.
    pub fn forward_train(&self, ids: &Tensor) -> Result<Tensor> {
        if super::train_pass::applies(self) {
            return super::train_pass::forward(self, ids);
        }
        let mut cache = self.new_cache();
        self.forward(ids, &mut cache, Pass::Train, LogitsAt::All)
    }

    /// [`Decoder::forward_train`] with logits only at the flat positions `rows` (indices into
    /// the `b · l` positions, row-major): (rows.len(), vocab). The hand-written training pass
    /// skips the vocabulary projection elsewhere; the autograd path selects from all logits.
    pub fn forward_train_at(&self, ids: &Tensor, rows: &[usize]) -> Result<Tensor> {
        if super::train_pass::applies(self) {
            return super::train_pass::forward_at(self, ids, Some(rows));
        }
        let all = self.forward_train(ids)?;
        let (b, l, v) = all.dims3()?;
        let idx = Tensor::from_vec(
            rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            rows.len(),
            &self.device,
        )?;
        all.reshape((b * l, v))?.index_select(&idx, 0)
    }

    /// Final hidden states (b, l, hidden) after the last norm.
    pub fn hidden(&self, ids: &Tensor, cache: &mut KvCache, pass: Pass) -> Result<Tensor> {
        let (b, l) = ids.dims2()?;
        if cache.num_layers() != self.layers.len() {
            candle_core::bail!(
                "kv cache has {} layers, model has {}",
                cache.num_layers(),
                self.layers.len()
            );
        }
        if cache.seq_len() > 0 && cache.batch_size() != b {
            candle_core::bail!(
                "kv cache batch {} does not match input batch {b}",
                cache.batch_size()
            );
        }
        let offset = cache.seq_len();
        let mask = build_mask(b, l, offset, cache.pad(b), self.dtype, &self.device)?;
        let flat = ids.flatten_all()?;
        let mut x =
            self.embed
                .weight
                .index_select(&flat, 0)?
                .reshape((b, l, self.cfg.hidden_size))?;
        for (i, layer) in self.layers.iter().enumerate() {
            let r = x.clone();
            let y = layer.input_layernorm.forward(&x, pass)?;
            let y = layer.self_attn.forward(
                &y,
                &self.cfg,
                &self.rope,
                mask.as_ref(),
                cache,
                i,
                pass,
            )?;
            x = (r + y)?;
            let r = x.clone();
            let y = layer.post_attention_layernorm.forward(&x, pass)?;
            let y = layer.mlp.forward(&y)?;
            x = (r + y)?;
        }
        cache.advance(l);
        self.norm.forward(&x, pass)
    }

    /// Every dense weight tensor with its HF name (for saving, grads, LoRA targets).
    pub fn named_linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.self_attn.q_proj"), &l.self_attn.q_proj));
            out.push((format!("{p}.self_attn.k_proj"), &l.self_attn.k_proj));
            out.push((format!("{p}.self_attn.v_proj"), &l.self_attn.v_proj));
            out.push((format!("{p}.self_attn.o_proj"), &l.self_attn.o_proj));
            out.push((format!("{p}.mlp.gate_proj"), &l.mlp.gate_proj));
            out.push((format!("{p}.mlp.up_proj"), &l.mlp.up_proj));
            out.push((format!("{p}.mlp.down_proj"), &l.mlp.down_proj));
        }
        out
    }

    /// [`Decoder::named_linears`], mutable (attaching or merging adapters).
    pub fn named_linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter_mut().enumerate() {
            let p = format!("model.layers.{i}");
            let Layer { self_attn, mlp, .. } = l;
            out.push((format!("{p}.self_attn.q_proj"), &mut self_attn.q_proj));
            out.push((format!("{p}.self_attn.k_proj"), &mut self_attn.k_proj));
            out.push((format!("{p}.self_attn.v_proj"), &mut self_attn.v_proj));
            out.push((format!("{p}.self_attn.o_proj"), &mut self_attn.o_proj));
            out.push((format!("{p}.mlp.gate_proj"), &mut mlp.gate_proj));
            out.push((format!("{p}.mlp.up_proj"), &mut mlp.up_proj));
            out.push((format!("{p}.mlp.down_proj"), &mut mlp.down_proj));
        }
        out
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A LoRA projection's decode step (the few-row kernel) equals the plain matmul formula.
    #[test]
    fn lora_decode_step_equals_the_matmul_formula() -> Result<()> {
        let dev = Device::Cpu;
        let (inp, out, r) = (96, 40, 8);
        let w = Tensor::randn(0f32, 1.0, (out, inp), &dev)?;
        let a = Tensor::randn(0f32, 0.1, (r, inp), &dev)?;
        let b = Tensor::randn(0f32, 0.1, (out, r), &dev)?;
        let lin = Linear {
            weight: Weight::Dense(w.clone()),
            bias: None,
            lora: Some(LoraWeights {
                a: a.clone(),
                b: b.clone(),
                scale: 2.0,
            }),
        };
        for rows in [1, 3, 8] {
            let x = Tensor::randn(0f32, 1.0, (rows, 1, inp), &dev)?;
            let got = lin.forward(&x)?.reshape((rows, out))?;
            let x2 = x.reshape((rows, inp))?;
            let want = (x2.matmul(&w.t()?)? + (x2.matmul(&a.t()?)?.matmul(&b.t()?)? * 2.0)?)?;
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-4, "{rows} rows: {diff}");
        }
        Ok(())
    }
}
