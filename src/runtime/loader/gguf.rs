//! GGUF files: metadata → DecoderConfig, the quantized inference load (stacked q/k/v and
//! gate/up, tile repacking, an f32 prefill copy when it fits) and the dequantized training load
//! under HF tensor names (llama q/k rows un-permuted).

use super::*;

/// GGUF metadata lookups that name the file and key on failure.
struct Meta<'a> {
    ct: &'a gguf_file::Content,
    path: &'a Path,
    arch: String,
}

impl Meta<'_> {
    fn get(&self, key: &str) -> Result<&gguf_file::Value, RuntimeError> {
        let full = format!("{}.{key}", self.arch);
        self.ct
            .metadata
            .get(&full)
            .ok_or_else(|| RuntimeError::Field {
                path: self.path.display().to_string(),
                field: full.clone(),
                message: "missing GGUF metadata".into(),
            })
    }
    fn u32(&self, key: &str) -> Result<usize, RuntimeError> {
        self.get(key)?
            .to_u32()
            .map(|x| x as usize)
            .map_err(|e| RuntimeError::Field {
                path: self.path.display().to_string(),
                field: format!("{}.{key}", self.arch),
                message: e.to_string(),
            })
    }
    fn f32_or(&self, key: &str, default: f64) -> f64 {
        self.get(key)
            .ok()
            .and_then(|v| v.to_f32().ok())
            .map(f64::from)
            .unwrap_or(default)
    }
}

/// How to hold GGUF weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgufOptions {
    /// Requantize types without SIMD CPU kernels (Q4_1, Q5_x, Q8_1) to Q8_0.
    pub requantize: bool,
    /// What multiplies a prefill's rows.
    pub prefill: PrefillOn,
    /// Repack Q4_1, Q8_0 and k-quant (Q4_K, Q5_K, Q6_K) projections for the tiled AVX-512
    /// decode kernels ([`crate::runtime::quant_tiles`]), where the CPU has them. Off when
    /// `ENVACE_NO_TILES` is set (A/B runs against candle's kernels, like `ENVACE_SLOW_OPS`).
    pub tiles: bool,
}

/// What multiplies a prefill's rows by a quantized projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillOn {
    /// The tiles where they beat an f32 copy here ([`Tiles::prefill_beats_gemm`]), else the
    /// f32 copy within the memory budget.
    ///
    /// [`Tiles::prefill_beats_gemm`]: crate::runtime::quant_tiles::Tiles::prefill_beats_gemm
    Auto,
    /// An f32 copy of each projection through candle's gemm, within the memory budget (4 bytes
    /// per weight).
    Gemm,
    /// The decode tiles (or candle's quantized kernels where there are none): no copy.
    Tiles,
}

/// Environment switch for [`PrefillOn`]: `gemm`, `tiles` or `auto` (A/B runs; `tiles` also
/// for machines short of memory).
pub const PREFILL_ENV: &str = "ENVACE_PREFILL";

/// Environment switch that turns the tiled decode kernels off.
pub const NO_TILES_ENV: &str = "ENVACE_NO_TILES";

impl PrefillOn {
    /// [`PREFILL_ENV`]'s choice (`Auto` when unset; an unknown value is named in a warning).
    pub fn from_env() -> Self {
        let value = std::env::var(PREFILL_ENV).ok();
        Self::parse(value.as_deref()).unwrap_or_else(|e| {
            tracing::warn!("{e}; using auto");
            PrefillOn::Auto
        })
    }

    /// A value of [`PREFILL_ENV`] (`None`: unset, `Auto`); an unknown one is an error naming
    /// the variable, the value and the choices.
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        match value {
            None | Some("auto") => Ok(PrefillOn::Auto),
            Some("gemm") => Ok(PrefillOn::Gemm),
            Some("tiles") => Ok(PrefillOn::Tiles),
            Some(other) => Err(format!(
                "{PREFILL_ENV}={other:?}: expected gemm, tiles or auto"
            )),
        }
    }
}

impl Default for GgufOptions {
    fn default() -> Self {
        Self {
            requantize: true,
            prefill: PrefillOn::from_env(),
            tiles: std::env::var_os(NO_TILES_ENV).is_none(),
        }
    }
}

/// Load a GGUF file (llama, qwen2, qwen3 architectures) with the fast defaults.
pub fn load_gguf(
    path: &Path,
    device: &Device,
) -> Result<(Decoder, gguf_file::Content), RuntimeError> {
    load_gguf_with(path, device, GgufOptions::default())
}

/// llama.cpp's tensor names → HF names, for the parts of a layer.
const GGUF_LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
];

/// The HF name of a GGUF tensor (`None` for tensors the decoder does not use).
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    let hf = GGUF_LAYER_NAMES
        .iter()
        .find(|(g, _)| *g == part)
        .map(|(_, h)| *h)?;
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// llama.cpp stores the q and k projections of llama models with each head's rows permuted
/// for its interleaved RoPE: HF row `(h, j, i)` (half `j`, pair `i`) is GGUF row `(h, i, j)`.
/// `to_hf` undoes that permutation; otherwise it applies it (HF → GGUF), e.g. to an adapter's
/// B matrix before it is attached to a GGUF base.
pub fn permute_rope_rows(t: &Tensor, heads: usize, to_hf: bool) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    let cols: usize = dims.iter().skip(1).product();
    if heads == 0 || rows % (2 * heads) != 0 {
        return Err(candle_core::Error::Msg(format!(
            "cannot permute {rows} rows into {heads} heads of RoPE pairs"
        )));
    }
    let half = rows / heads / 2;
    let split = if to_hf {
        (heads, half, 2, cols)
    } else {
        (heads, 2, half, cols)
    };
    t.reshape(split)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims.as_slice())
}

/// Every tensor of a GGUF file dequantized (f32) under its HF name, with llama q/k rows back in
/// HF order: the dense, trainable form of a quantized checkpoint. The returned config describes
/// those tensors (HF RoPE layout; tied embeddings when the file has no `output.weight`).
pub fn gguf_hf_tensors(
    path: &Path,
    device: &Device,
) -> Result<(DecoderConfig, HashMap<String, Tensor>, gguf_file::Content), RuntimeError> {
    let (mut f, ct, mut cfg) = read_gguf_header(path)?;
    let permuted = cfg.rope_interleaved && cfg.family == Family::Llama;
    let mut out = HashMap::new();
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let Some(hf) = gguf_to_hf_name(name) else {
            continue;
        };
        let terr = |message: String| RuntimeError::Tensor {
            path: path.display().to_string(),
            name: name.clone(),
            message,
        };
        let q = ct
            .tensor(&mut f, name, device)
            .map_err(|e| terr(e.to_string()))?;
        let mut t = q
            .dequantize(device)
            .map_err(|e| terr(format!("cannot dequantize: {e}")))?;
        if permuted && hf.ends_with("q_proj.weight") {
            t = permute_rope_rows(&t, cfg.num_attention_heads, true)
                .map_err(|e| terr(e.to_string()))?;
        } else if permuted && hf.ends_with("k_proj.weight") {
            t = permute_rope_rows(&t, cfg.num_key_value_heads, true)
                .map_err(|e| terr(e.to_string()))?;
        }
        out.insert(hf, t);
    }
    cfg.rope_interleaved = false;
    cfg.tie_word_embeddings = !out.contains_key("lm_head.weight");
    Ok((cfg, out, ct))
}

/// A GGUF file as a dense decoder in `dtype` (trainable with `trainable`): see
/// [`gguf_hf_tensors`].
pub fn load_gguf_dense(
    path: &Path,
    dtype: DType,
    device: &Device,
    trainable: Option<&VarMap>,
) -> Result<(Decoder, gguf_file::Content), RuntimeError> {
    let (cfg, tensors, ct) = gguf_hf_tensors(path, device)?;
    let tensors = tensors
        .into_iter()
        .map(|(k, v)| (k, (v, path.to_path_buf())))
        .collect();
    let decoder = build_dense(&cfg, tensors, dtype, device, trainable)?;
    Ok((decoder, ct))
}

/// Write a copy of the GGUF file `base` to `out` (atomically: a temporary file beside it, then
/// a rename) in which the tensors named in `replaced` (HF names, dense tensors in HF layout, as
/// [`gguf_hf_tensors`] gives them) are quantized to `dtype`, llama q/k rows put back in the
/// file's RoPE order; every other tensor is copied as stored (no requantization), in the file's
/// order. `set` adds or replaces metadata entries (the chat template of a fine-tuned model).
/// Written as GGUF v2 with 32-byte alignment, which llama.cpp and candle read.
pub fn write_gguf_with(
    base: &Path,
    replaced: &HashMap<String, Tensor>,
    dtype: GgmlDType,
    set: Vec<(String, gguf_file::Value)>,
    out: &Path,
) -> Result<(), RuntimeError> {
    let (mut f, ct, cfg) = read_gguf_header(base)?;
    let permuted = cfg.rope_interleaved && cfg.family == Family::Llama;
    let mut infos: Vec<(&String, &gguf_file::TensorInfo)> = ct.tensor_infos.iter().collect();
    infos.sort_by_key(|(_, i)| i.offset);
    let mut tensors: Vec<(String, QTensor)> = Vec::with_capacity(infos.len());
    let mut used = 0;
    for (name, _) in infos {
        let hf = gguf_to_hf_name(name);
        let q = match hf.as_ref().and_then(|h| replaced.get(h)) {
            Some(t) => {
                used += 1;
                let terr = |message: String| RuntimeError::Tensor {
                    path: out.display().to_string(),
                    name: name.clone(),
                    message,
                };
                let t = t.to_dtype(DType::F32)?;
                let t = if permuted && name.ends_with("attn_q.weight") {
                    permute_rope_rows(&t, cfg.num_attention_heads, false)?
                } else if permuted && name.ends_with("attn_k.weight") {
                    permute_rope_rows(&t, cfg.num_key_value_heads, false)?
                } else {
                    t
                };
                let cols = t.dims().last().copied().unwrap_or(0);
                if !cols.is_multiple_of(dtype.block_size()) {
                    return Err(terr(format!(
                        "rows of {cols} values do not split into {dtype:?} blocks of {}: pick a type with smaller blocks (q8_0, q4_1, f16)",
                        dtype.block_size()
                    )));
                }
                QTensor::quantize(&t, dtype).map_err(|e| terr(format!("cannot quantize: {e}")))?
            }
            None => ct
                .tensor(&mut f, name, &Device::Cpu)
                .map_err(|e| file_err(base, format!("tensor {name}: {e}")))?,
        };
        tensors.push((name.clone(), q));
    }
    if used != replaced.len() {
        let missing: Vec<&String> = replaced
            .keys()
            .filter(|h| {
                !ct.tensor_infos
                    .keys()
                    .any(|n| gguf_to_hf_name(n).as_ref() == Some(*h))
            })
            .collect();
        return Err(file_err(base, format!("has no tensor for {missing:?}")));
    }
    let mut metadata: Vec<(String, gguf_file::Value)> = ct
        .metadata
        .into_iter()
        // The writer aligns to 32 bytes whatever the source said.
        .filter(|(k, _)| k != "general.alignment" && !set.iter().any(|(s, _)| s == k))
        .collect();
    metadata.extend(set);
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    let tmp = out.with_extension("gguf.tmp");
    let write = || -> Result<(), RuntimeError> {
        let mut w = std::io::BufWriter::new(
            std::fs::File::create(&tmp).map_err(|e| file_err(&tmp, e.to_string()))?,
        );
        let meta: Vec<(&str, &gguf_file::Value)> =
            metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut w, &meta, &ts).map_err(|e| file_err(&tmp, e.to_string()))?;
        std::io::Write::flush(&mut w).map_err(|e| file_err(&tmp, e.to_string()))?;
        w.get_ref()
            .sync_all()
            .map_err(|e| file_err(&tmp, e.to_string()))?;
        std::fs::rename(&tmp, out).map_err(|e| file_err(out, e.to_string()))
    };
    write().inspect_err(|_| {
        std::fs::remove_file(&tmp).ok();
    })
}

/// Whether a model path is a GGUF file.
pub fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().and_then(|e| e.to_str()) == Some("gguf")
}

/// Stack quantized projections of the same input (q/k/v, gate/up) into one quantized matrix,
/// each keeping its rows as a part (see [`Weight::Quant`]): a decode step then quantizes the
/// input once and makes one kernel call instead of two or three. The separate matrices are
/// dropped (the f32 prefill copies stay per projection). When the types differ (k-quant files
/// mix them: Q5_0 q/k beside a Q8_0 v) only the tiles are stacked, each projection keeping its
/// own matrix for the other paths. Left as they are when the input widths differ or a
/// projection is not a quantized tensor.
fn stack_quantized<const N: usize>(
    parts: [Linear; N],
    device: &Device,
) -> Result<[Linear; N], RuntimeError> {
    let mut tensors = Vec::with_capacity(N);
    for l in &parts {
        match &l.weight {
            Weight::Quant { q, part: None, .. } => match q.as_ref() {
                QMatMul::QTensor(t) => tensors.push(t.clone()),
                _ => return Ok(parts),
            },
            _ => return Ok(parts),
        }
    }
    let dtype = tensors[0].dtype();
    let inp = tensors[0].shape().dims2()?.1;
    let mut rows = Vec::with_capacity(N);
    for t in &tensors {
        let (o, i) = t.shape().dims2()?;
        if i != inp {
            return Ok(parts);
        }
        rows.push(o);
    }
    let part_tiles: Option<Vec<&crate::runtime::quant_tiles::Tiles>> = parts
        .iter()
        .map(|l| match &l.weight {
            Weight::Quant { tiles, .. } => tiles.as_deref(),
            Weight::Dense(_) => None,
        })
        .collect();
    let tiles = part_tiles
        .and_then(|t| crate::runtime::quant_tiles::Tiles::stack(&t))
        .map(Arc::new);
    let same_type = tensors.iter().all(|t| t.dtype() == dtype);
    if !same_type && tiles.is_none() {
        return Ok(parts);
    }
    let fused = if same_type {
        let mut data = Vec::new();
        for t in &tensors {
            data.extend_from_slice(&t.data()?);
        }
        let total: usize = rows.iter().sum();
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Owned(data),
            device,
            dtype,
        )?;
        Some(Arc::new(QMatMul::from_qtensor(QTensor::new(
            storage,
            (total, inp),
        )?)?))
    } else {
        None
    };
    let mut start = 0;
    Ok(parts.map(|l| {
        let len = rows.remove(0);
        let Weight::Quant { q, dense, .. } = l.weight else {
            return l;
        };
        let (q, part) = match &fused {
            Some(f) => (f.clone(), Some((start, len))),
            None => (q, None),
        };
        let out = Linear {
            weight: Weight::Quant {
                q,
                dense,
                part,
                tile_rows: tiles.as_ref().map(|_| (start, len)),
                tiles: tiles.clone(),
            },
            ..l
        };
        start += len;
        out
    }))
}

/// Load a GGUF file with explicit options.
/// Open a GGUF file and read its metadata into a [`DecoderConfig`] (llama, qwen2, qwen3).
fn read_gguf_header(
    path: &Path,
) -> Result<(std::fs::File, gguf_file::Content, DecoderConfig), RuntimeError> {
    let mut f =
        std::fs::File::open(path).map_err(|e| file_err(path, format!("cannot open: {e}")))?;
    let ct = gguf_file::Content::read(&mut f)
        .map_err(|e| file_err(path, format!("not a valid GGUF file: {e}")))?;
    let arch = ct
        .metadata
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .ok_or_else(|| RuntimeError::Field {
            path: path.display().to_string(),
            field: "general.architecture".into(),
            message: "missing".into(),
        })?;
    let family = match arch.as_str() {
        "llama" => Family::Llama,
        "qwen2" => Family::Qwen2,
        "qwen3" => Family::Qwen3,
        other => {
            return Err(RuntimeError::UnsupportedArchitecture {
                path: path.display().to_string(),
                got: other.to_string(),
                supported: "llama, qwen2, qwen3 (GGUF general.architecture)".into(),
            });
        }
    };
    let meta = Meta {
        ct: &ct,
        path,
        arch: arch.clone(),
    };
    let hidden = meta.u32("embedding_length")?;
    let nh = meta.u32("attention.head_count")?;
    let nkv = meta.u32("attention.head_count_kv")?;
    let head_dim = meta
        .u32("attention.key_length")
        .unwrap_or(hidden / nh.max(1));
    let layers_n = meta.u32("block_count")?;
    let ctx = meta.u32("context_length").unwrap_or(4096);
    let embed = ct
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| RuntimeError::Tensor {
            path: path.display().to_string(),
            name: "token_embd.weight".into(),
            message: "missing".into(),
        })?;
    // candle reverses GGUF's innermost-first dims: [vocab, hidden].
    let dims = embed.shape.dims();
    let (vocab, emb_dim) = match dims {
        [v, h] => (*v, *h),
        _ => (0, 0),
    };
    if emb_dim != hidden {
        return Err(RuntimeError::Tensor {
            path: path.display().to_string(),
            name: "token_embd.weight".into(),
            message: format!("shape mismatch: expected [{vocab}, {hidden}], got {dims:?}"),
        });
    }
    let cfg = DecoderConfig {
        family,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: meta.u32("feed_forward_length")?,
        num_hidden_layers: layers_n,
        num_attention_heads: nh,
        num_key_value_heads: nkv,
        head_dim,
        rms_norm_eps: meta.f32_or("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta: meta.f32_or("rope.freq_base", 10_000.0),
        rope_scaling: None,
        max_position_embeddings: ctx.min(32_768),
        // A GGUF without `output.weight` ties the head to the embedding (SmolLM2).
        tie_word_embeddings: !ct.tensor_infos.contains_key("output.weight"),
        qkv_bias: family == Family::Qwen2,
        qk_norm: family == Family::Qwen3,
        rope_interleaved: family == Family::Llama,
        bos_token_id: ct
            .metadata
            .get("tokenizer.ggml.bos_token_id")
            .and_then(|v| v.to_u32().ok()),
        eos_token_ids: ct
            .metadata
            .get("tokenizer.ggml.eos_token_id")
            .and_then(|v| v.to_u32().ok())
            .into_iter()
            .collect(),
    };
    Ok((f, ct, cfg))
}

pub fn load_gguf_with(
    path: &Path,
    device: &Device,
    opts: GgufOptions,
) -> Result<(Decoder, gguf_file::Content), RuntimeError> {
    let (mut f, ct, cfg) = read_gguf_header(path)?;
    let mut read = |name: &str| -> Result<QTensor, RuntimeError> {
        ct.tensor(&mut f, name, device)
            .map_err(|e| RuntimeError::Tensor {
                path: path.display().to_string(),
                name: name.into(),
                message: format!("{e}"),
            })
    };
    let embed_q = read("token_embd.weight")?;
    let dense_fits = device.is_cpu() && cfg.parameter_count() * 4 <= DENSE_PREFILL_BUDGET_BYTES;
    let quant_linear = |t: QTensor| -> Result<Linear, RuntimeError> {
        // The tiled decode kernels take Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants as they
        // are in the file (k-quants are never requantized: candle's kernels for them are SIMD).
        let mut tiles = if opts.tiles {
            crate::runtime::quant_tiles::Tiles::new(&t)?
        } else {
            None
        };
        // Types whose CPU vec_dot is the scalar fallback are requantized to Q8_0 (for prefill
        // without a dense copy, and for the tiles when the file's type has none).
        let mut dequantized = None;
        let t = match t.dtype() {
            GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 | GgmlDType::Q8_1
                if opts.requantize && device.is_cpu() =>
            {
                let d = t.dequantize(device)?;
                let q = QTensor::quantize(&d, GgmlDType::Q8_0)?;
                dequantized = Some(d);
                q
            }
            _ => t,
        };
        if tiles.is_none() && opts.tiles {
            tiles = crate::runtime::quant_tiles::Tiles::new(&t)?;
        }
        let keep_dense = dense_fits
            && match opts.prefill {
                PrefillOn::Gemm => true,
                PrefillOn::Tiles => false,
                PrefillOn::Auto => !tiles.as_ref().is_some_and(|t| t.prefill_beats_gemm()),
            };
        // The file's weights (not the requantized ones) in f32.
        let dense = match (keep_dense, dequantized) {
            (false, _) => None,
            (true, Some(d)) => Some(d),
            (true, None) => Some(t.dequantize(device)?),
        };
        Ok(Linear {
            weight: Weight::Quant {
                q: Arc::new(QMatMul::from_qtensor(t)?),
                dense,
                part: None,
                tiles: tiles.map(Arc::new),
                tile_rows: None,
            },
            bias: None,
            lora: None,
        })
    };
    // A quantized linear layer; a tensor the kernels refuse (size or type) is named with the file.
    let quant = |name: &str, t: QTensor| -> Result<Linear, RuntimeError> {
        quant_linear(t).map_err(|e| file_err(path, format!("tensor `{name}`: {e}")))
    };
    let dq = |t: &QTensor| -> Result<Tensor, RuntimeError> { Ok(t.dequantize(device)?) };
    let embed = dq(&embed_q)?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("blk.{i}");
        let mut lin = |n: &str, bias: bool| -> Result<Linear, RuntimeError> {
            let name = format!("{p}.{n}.weight");
            let mut l = quant(&name, read(&name)?)?;
            if bias {
                l.bias = Some(dq(&read(&format!("{p}.{n}.bias"))?)?);
            }
            Ok(l)
        };
        let [q_proj, k_proj, v_proj] = stack_quantized(
            [
                lin("attn_q", cfg.qkv_bias)?,
                lin("attn_k", cfg.qkv_bias)?,
                lin("attn_v", cfg.qkv_bias)?,
            ],
            device,
        )?;
        let o_proj = lin("attn_output", false)?;
        let [gate_proj, up_proj] =
            stack_quantized([lin("ffn_gate", false)?, lin("ffn_up", false)?], device)?;
        let down_proj = lin("ffn_down", false)?;
        let mut norm = |n: &str| -> Result<RmsNorm, RuntimeError> {
            Ok(RmsNorm {
                weight: dq(&read(&format!("{p}.{n}.weight"))?)?,
                eps: cfg.rms_norm_eps,
            })
        };
        let (q_norm, k_norm) = if cfg.qk_norm {
            (Some(norm("attn_q_norm")?), Some(norm("attn_k_norm")?))
        } else {
            (None, None)
        };
        layers.push(Layer {
            input_layernorm: norm("attn_norm")?,
            post_attention_layernorm: norm("ffn_norm")?,
            self_attn: Attention {
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_norm,
                k_norm,
            },
            mlp: Mlp {
                gate_proj,
                up_proj,
                down_proj,
            },
        });
    }
    let norm = RmsNorm {
        weight: dq(&read("output_norm.weight")?)?,
        eps: cfg.rms_norm_eps,
    };
    let lm_head = if ct.tensor_infos.contains_key("output.weight") {
        quant("output.weight", read("output.weight")?)?
    } else {
        quant("token_embd.weight", embed_q)?
    };
    let decoder = Decoder {
        rope: Rope::new(&cfg, DType::F32, device)?,
        cfg,
        embed: Embedding { weight: embed },
        layers,
        norm,
        lm_head,
        device: device.clone(),
        dtype: DType::F32,
    };
    Ok((decoder, ct))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_choice_parses_its_three_values_and_names_a_bad_one() {
        assert_eq!(PrefillOn::parse(None), Ok(PrefillOn::Auto));
        assert_eq!(PrefillOn::parse(Some("auto")), Ok(PrefillOn::Auto));
        assert_eq!(PrefillOn::parse(Some("gemm")), Ok(PrefillOn::Gemm));
        assert_eq!(PrefillOn::parse(Some("tiles")), Ok(PrefillOn::Tiles));
        let e = PrefillOn::parse(Some("dense")).unwrap_err();
        assert!(
            e.contains("ENVACE_PREFILL=\"dense\"") && e.contains("gemm, tiles or auto"),
            "{e}"
        );
    }
}
