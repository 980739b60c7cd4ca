//! Loading checkpoints into the [`Decoder`]: HF directories (single or sharded safetensors,
//! any float dtype converted explicitly) and GGUF files (quantized, with Q4_1/Q5_x weights
//! requantized to Q8_0, whose CPU kernels are SIMD, and an f32 copy for prefill when it fits).
//! Every failure names the file and the tensor or field. PEFT LoRA adapter directories
//! (`adapter_config.json` + `adapter_model.safetensors`) are read here too and attached to (or
//! folded into) a loaded decoder.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor, gguf_file};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::backend::RuntimeError;
use super::config::{DecoderConfig, Family, token_ids};
use super::decoder::{
    Attention, Decoder, Embedding, Layer, Linear, LoraWeights, Mlp, RmsNorm, Rope, Weight,
};

/// Budget for f32 prefill copies of quantized weights.
const DENSE_PREFILL_BUDGET_BYTES: usize = 2 << 30;

/// Where a checkpoint's files are.
#[derive(Debug, Clone)]
pub struct CheckpointFiles {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub weights: Vec<PathBuf>,
    pub tokenizer: PathBuf,
    pub tokenizer_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

fn file_err(path: &Path, message: impl Into<String>) -> RuntimeError {
    RuntimeError::File {
        path: path.display().to_string(),
        message: message.into(),
    }
}

impl CheckpointFiles {
    /// Locate the files of an HF checkpoint directory.
    pub fn locate(dir: &Path) -> Result<Self, RuntimeError> {
        if !dir.is_dir() {
            return Err(file_err(
                dir,
                "not a directory (expected an HF checkpoint directory or a .gguf file)",
            ));
        }
        let need = |name: &str| {
            let p = dir.join(name);
            if p.is_file() {
                Ok(p)
            } else {
                Err(file_err(&p, "missing"))
            }
        };
        let config = need("config.json")?;
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let weights = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            let text =
                std::fs::read_to_string(&index).map_err(|e| file_err(&index, e.to_string()))?;
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| file_err(&index, format!("invalid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| RuntimeError::Field {
                    path: index.display().to_string(),
                    field: "weight_map".into(),
                    message: "missing or not an object".into(),
                })?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect();
            files.sort();
            files.dedup();
            let mut out = Vec::new();
            for f in files {
                let p = dir.join(&f);
                if !p.is_file() {
                    return Err(file_err(
                        &p,
                        format!("missing (listed in {})", index.display()),
                    ));
                }
                out.push(p);
            }
            out
        } else {
            return Err(file_err(
                &single,
                "missing (and no model.safetensors.index.json for a sharded checkpoint)",
            ));
        };
        let opt = |name: &str| {
            let p = dir.join(name);
            p.is_file().then_some(p)
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
            tokenizer: need("tokenizer.json")?,
            tokenizer_config: opt("tokenizer_config.json"),
            generation_config: opt("generation_config.json"),
        })
    }
}

/// sha256 of a set of files, hex.
pub fn hash_files(paths: &[PathBuf]) -> Result<String, RuntimeError> {
    let mut h = Sha256::new();
    for p in paths {
        let mut f = std::fs::File::open(p).map_err(|e| file_err(p, e.to_string()))?;
        std::io::copy(&mut f, &mut h).map_err(|e| file_err(p, e.to_string()))?;
    }
    Ok(hex::encode(h.finalize()))
}

/// Where tensors come from while building the decoder.
struct TensorSource<'a> {
    tensors: HashMap<String, (Tensor, PathBuf)>,
    dtype: DType,
    device: &'a Device,
    trainable: Option<&'a VarMap>,
}

impl TensorSource<'_> {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, RuntimeError> {
        let (t, path) = self.tensors.get(name).ok_or_else(|| {
            let mut near: Vec<&String> = self
                .tensors
                .keys()
                .filter(|k| k.ends_with(name.rsplit('.').next().unwrap_or(name)))
                .take(3)
                .collect();
            near.sort();
            RuntimeError::Tensor {
                path: "checkpoint".into(),
                name: name.into(),
                message: format!("missing from the weight files (similar names: {near:?})"),
            }
        })?;
        if t.dims() != shape {
            return Err(RuntimeError::Tensor {
                path: path.display().to_string(),
                name: name.into(),
                message: format!("shape mismatch: expected {shape:?}, got {:?}", t.dims()),
            });
        }
        let t = t.to_dtype(self.dtype)?.to_device(self.device)?;
        match self.trainable {
            None => Ok(t),
            Some(vm) => {
                let var = Var::from_tensor(&t)?;
                let out = var.as_tensor().clone();
                vm.data()
                    .lock()
                    .map_err(|_| RuntimeError::Generation("var map lock poisoned".into()))?
                    .insert(name.to_string(), var);
                Ok(out)
            }
        }
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// Load the dense tensors of a checkpoint's weight files.
pub fn read_safetensors(
    paths: &[PathBuf],
) -> Result<HashMap<String, (Tensor, PathBuf)>, RuntimeError> {
    let mut out = HashMap::new();
    for p in paths {
        let bytes = std::fs::read(p).map_err(|e| file_err(p, format!("cannot read: {e}")))?;
        let map = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
            .map_err(|e| file_err(p, format!("truncated or corrupt safetensors: {e}")))?;
        for (k, v) in map {
            out.insert(k, (v, p.clone()));
        }
    }
    Ok(out)
}

/// Build a dense decoder from named tensors. With `trainable`, every weight becomes a `Var`
/// registered under its HF name.
pub fn build_dense(
    cfg: &DecoderConfig,
    tensors: HashMap<String, (Tensor, PathBuf)>,
    dtype: DType,
    device: &Device,
    trainable: Option<&VarMap>,
) -> Result<Decoder, RuntimeError> {
    let src = TensorSource {
        tensors,
        dtype,
        device,
        trainable,
    };
    let h = cfg.hidden_size;
    let (nh, nkv, hd, im) = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    );
    let lin = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear, RuntimeError> {
        let w = src.get(&format!("{name}.weight"), &[out, inp])?;
        let b = if bias {
            Some(src.get(&format!("{name}.bias"), &[out])?)
        } else {
            None
        };
        Ok(Linear::dense(w, b))
    };
    let norm = |name: &str, n: usize| -> Result<RmsNorm, RuntimeError> {
        Ok(RmsNorm {
            weight: src.get(&format!("{name}.weight"), &[n])?,
            eps: cfg.rms_norm_eps,
        })
    };
    let embed = src.get("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        layers.push(Layer {
            input_layernorm: norm(&format!("{p}.input_layernorm"), h)?,
            post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm"), h)?,
            self_attn: Attention {
                q_proj: lin(&format!("{p}.self_attn.q_proj"), nh * hd, h, cfg.qkv_bias)?,
                k_proj: lin(&format!("{p}.self_attn.k_proj"), nkv * hd, h, cfg.qkv_bias)?,
                v_proj: lin(&format!("{p}.self_attn.v_proj"), nkv * hd, h, cfg.qkv_bias)?,
                o_proj: lin(&format!("{p}.self_attn.o_proj"), h, nh * hd, false)?,
                q_norm: if cfg.qk_norm {
                    Some(norm(&format!("{p}.self_attn.q_norm"), hd)?)
                } else {
                    None
                },
                k_norm: if cfg.qk_norm {
                    Some(norm(&format!("{p}.self_attn.k_norm"), hd)?)
                } else {
                    None
                },
            },
            mlp: Mlp {
                gate_proj: lin(&format!("{p}.mlp.gate_proj"), im, h, false)?,
                up_proj: lin(&format!("{p}.mlp.up_proj"), im, h, false)?,
                down_proj: lin(&format!("{p}.mlp.down_proj"), h, im, false)?,
            },
        });
    }
    let lm_head = if cfg.tie_word_embeddings || !src.has("lm_head.weight") {
        if !cfg.tie_word_embeddings {
            return Err(RuntimeError::Tensor {
                path: "checkpoint".into(),
                name: "lm_head.weight".into(),
                message: "missing and tie_word_embeddings is false".into(),
            });
        }
        Linear::dense(embed.clone(), None)
    } else {
        lin("lm_head", cfg.vocab_size, h, false)?
    };
    Ok(Decoder {
        cfg: cfg.clone(),
        embed: Embedding { weight: embed },
        layers,
        norm: norm("model.norm", h)?,
        lm_head,
        rope: Rope::new(cfg, dtype, device)?,
        device: device.clone(),
        dtype,
    })
}

/// Load an HF checkpoint directory.
pub fn load_hf(
    files: &CheckpointFiles,
    dtype: DType,
    device: &Device,
    trainable: Option<&VarMap>,
) -> Result<Decoder, RuntimeError> {
    let mut cfg = DecoderConfig::from_hf_file(&files.config)?;
    if let Some(gc) = &files.generation_config
        && let Ok(text) = std::fs::read_to_string(gc)
        && let Ok(v) = serde_json::from_str::<Value>(&text)
    {
        for id in token_ids(v.get("eos_token_id")) {
            if !cfg.eos_token_ids.contains(&id) {
                cfg.eos_token_ids.push(id);
            }
        }
    }
    let tensors = read_safetensors(&files.weights)?;
    build_dense(&cfg, tensors, dtype, device, trainable)
}

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
    /// Keep an f32 copy of each projection for prefill (when it fits the budget).
    pub dense_prefill: bool,
    /// Repack Q4_1/Q8_0 projections for the tiled AVX-512 decode kernels
    /// ([`super::quant_tiles`]), where the CPU has them.
    pub tiles: bool,
}

impl Default for GgufOptions {
    fn default() -> Self {
        Self {
            requantize: true,
            dense_prefill: true,
            tiles: true,
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

/// Whether a model path is a GGUF file.
pub fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().and_then(|e| e.to_str()) == Some("gguf")
}

/// Stack quantized projections of the same input (q/k/v, gate/up) into one quantized matrix,
/// each keeping its rows as a part (see [`Weight::Quant`]): a decode step then quantizes the
/// input once and makes one kernel call instead of two or three. The separate matrices are
/// dropped (the f32 prefill copies stay per projection). Left as they are when the types or
/// input widths differ (k-quant files mix types), or a projection is not a quantized tensor.
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
        if t.dtype() != dtype || i != inp {
            return Ok(parts);
        }
        rows.push(o);
    }
    let mut data = Vec::new();
    for t in &tensors {
        data.extend_from_slice(&t.data()?);
    }
    let total: usize = rows.iter().sum();
    let storage =
        candle_core::quantized::QStorage::from_data(std::borrow::Cow::Owned(data), device, dtype)?;
    let fused = Arc::new(QMatMul::from_qtensor(QTensor::new(storage, (total, inp))?)?);
    let part_tiles: Option<Vec<&super::quant_tiles::Tiles>> = parts
        .iter()
        .map(|l| match &l.weight {
            Weight::Quant { tiles, .. } => tiles.as_deref(),
            Weight::Dense(_) => None,
        })
        .collect();
    let tiles = part_tiles
        .and_then(|t| super::quant_tiles::Tiles::stack(&t))
        .map(Arc::new);
    let mut start = 0;
    Ok(parts.map(|l| {
        let len = rows.remove(0);
        let dense = match l.weight {
            Weight::Quant { dense, .. } => dense,
            Weight::Dense(_) => None,
        };
        let out = Linear {
            weight: Weight::Quant {
                q: fused.clone(),
                dense,
                part: Some((start, len)),
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
    let dense_bytes = cfg.parameter_count() * 4;
    let keep_dense =
        opts.dense_prefill && device.is_cpu() && dense_bytes <= DENSE_PREFILL_BUDGET_BYTES;
    let quant_linear = |t: QTensor| -> Result<Linear, RuntimeError> {
        let dense = if keep_dense {
            Some(t.dequantize(device)?)
        } else {
            None
        };
        // The tiled decode kernels take Q4_1 and Q8_0 as they are in the file.
        let mut tiles = if opts.tiles {
            super::quant_tiles::Tiles::new(&t)?
        } else {
            None
        };
        // Types whose CPU vec_dot is the scalar fallback are requantized to Q8_0 (for prefill
        // without a dense copy, and for the tiles when the file's type has none).
        let t = match t.dtype() {
            GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 | GgmlDType::Q8_1
                if opts.requantize && device.is_cpu() =>
            {
                let d = match &dense {
                    Some(d) => d.clone(),
                    None => t.dequantize(device)?,
                };
                QTensor::quantize(&d, GgmlDType::Q8_0)?
            }
            _ => t,
        };
        if tiles.is_none() && opts.tiles {
            tiles = super::quant_tiles::Tiles::new(&t)?;
        }
        Ok(Linear {
            weight: Weight::Quant {
                q: Arc::new(QMatMul::from_qtensor(t)?),
                dense,
                part: None,
                tiles: tiles.map(Arc::new),
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

/// A PEFT adapter's configuration file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// A PEFT adapter's weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The prefix PEFT gives every tensor of a causal LM's adapter.
const PEFT_PREFIX: &str = "base_model.model.";

/// The projections a LoRA adapter may target, by their HF module names.
pub const LORA_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The PEFT names of the A and B tensors of the projection `linear` (an HF module path such as
/// `model.layers.0.self_attn.q_proj`).
pub fn peft_names(linear: &str) -> (String, String) {
    (
        format!("{PEFT_PREFIX}{linear}.lora_A.weight"),
        format!("{PEFT_PREFIX}{linear}.lora_B.weight"),
    )
}

/// Whether `dir` holds a PEFT adapter rather than a full model.
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.is_dir() && dir.join(ADAPTER_CONFIG).is_file() && !dir.join("config.json").is_file()
}

/// The fields of `adapter_config.json` envace reads and writes (PEFT `LoraConfig`, LoRA only).
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterConfig {
    pub r: usize,
    pub lora_alpha: f64,
    /// Short module names (`q_proj`, …).
    pub target_modules: Vec<String>,
    /// The base model (a directory path for envace's own adapters).
    pub base_model_name_or_path: Option<String>,
}

impl AdapterConfig {
    /// `alpha / r`.
    pub fn scale(&self) -> f64 {
        self.lora_alpha / self.r.max(1) as f64
    }

    /// The PEFT JSON (keys as PEFT writes them; no bias, no dropout, causal LM).
    pub fn to_peft_json(&self) -> Value {
        let alpha = if self.lora_alpha.fract() == 0.0 && self.lora_alpha.abs() < 1e15 {
            serde_json::json!(self.lora_alpha as i64)
        } else {
            serde_json::json!(self.lora_alpha)
        };
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.r,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "target_modules": self.target_modules,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "modules_to_save": null,
            "use_rslora": false,
            "use_dora": false,
        })
    }

    /// Read and check `DIR/adapter_config.json`.
    pub fn read(dir: &Path) -> Result<Self, RuntimeError> {
        let path = dir.join(ADAPTER_CONFIG);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| file_err(&path, format!("cannot read: {e}")))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| file_err(&path, format!("invalid JSON: {e}")))?;
        let field = |f: &str, m: String| RuntimeError::Field {
            path: path.display().to_string(),
            field: f.into(),
            message: m,
        };
        match v.get("peft_type").and_then(Value::as_str) {
            Some("LORA") => {}
            other => {
                return Err(field(
                    "peft_type",
                    format!("{other:?}: only LORA adapters are supported"),
                ));
            }
        }
        let r = v
            .get("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| field("r", "missing or not a positive integer".into()))?
            as usize;
        let lora_alpha = v
            .get("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or_else(|| field("lora_alpha", "missing or not a number".into()))?;
        for flag in ["use_dora", "use_rslora", "fan_in_fan_out"] {
            if v.get(flag).and_then(Value::as_bool) == Some(true) {
                return Err(field(flag, "true is not supported".into()));
            }
        }
        if let Some(b) = v.get("bias").and_then(Value::as_str)
            && b != "none"
        {
            return Err(field("bias", format!("`{b}`: only \"none\" is supported")));
        }
        let target_modules: Vec<String> = match v.get("target_modules") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| field("target_modules", "not a list of strings".into()))
                })
                .collect::<Result<_, _>>()?,
            _ => {
                return Err(field(
                    "target_modules",
                    "missing or not a list (regex targets are not supported)".into(),
                ));
            }
        };
        if let Some(t) = target_modules
            .iter()
            .find(|t| !LORA_MODULES.contains(&t.as_str()))
        {
            return Err(field(
                "target_modules",
                format!("`{t}` is not one of {}", LORA_MODULES.join(", ")),
            ));
        }
        Ok(Self {
            r,
            lora_alpha,
            target_modules,
            base_model_name_or_path: v
                .get("base_model_name_or_path")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    /// The base model directory: `base_model_name_or_path` as written (absolute, or relative
    /// to the working directory), else relative to the adapter directory.
    pub fn resolve_base(&self, adapter_dir: &Path) -> Result<PathBuf, RuntimeError> {
        let path = adapter_dir.join(ADAPTER_CONFIG);
        let Some(b) = &self.base_model_name_or_path else {
            return Err(RuntimeError::Field {
                path: path.display().to_string(),
                field: "base_model_name_or_path".into(),
                message: "missing: name the base model (or merge with `envace merge --model BASE`)"
                    .into(),
            });
        };
        let p = PathBuf::from(b);
        if p.exists() {
            return Ok(p);
        }
        let beside = adapter_dir.join(&p);
        if beside.exists() {
            return Ok(beside);
        }
        Err(RuntimeError::Field {
            path: path.display().to_string(),
            field: "base_model_name_or_path".into(),
            message: format!("`{b}` is not a local model directory or file"),
        })
    }
}

/// Read an adapter directory: its config and its tensors by PEFT name (on the CPU, as stored).
pub fn read_adapter(dir: &Path) -> Result<(AdapterConfig, HashMap<String, Tensor>), RuntimeError> {
    let cfg = AdapterConfig::read(dir)?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let bytes = std::fs::read(&path).map_err(|e| file_err(&path, format!("cannot read: {e}")))?;
    let tensors = candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
        .map_err(|e| file_err(&path, format!("truncated or corrupt safetensors: {e}")))?;
    Ok((cfg, tensors))
}

/// Attach adapter tensors (PEFT names, already on the decoder's device and dtype) to the
/// decoder's projections; with `merge`, fold them into the dense weights instead. Every targeted
/// projection must have both tensors with the right shapes, and every tensor must be used.
/// Returns the number of adapted projections.
pub fn attach_adapter(
    decoder: &mut Decoder,
    cfg: &AdapterConfig,
    tensors: &HashMap<String, Tensor>,
    source: &Path,
    merge: bool,
) -> Result<usize, RuntimeError> {
    let scale = cfg.scale();
    let tensor_err = |name: &str, message: String| RuntimeError::Tensor {
        path: source.display().to_string(),
        name: name.to_string(),
        message,
    };
    let mut used = 0usize;
    let mut adapted = 0usize;
    let permuted = decoder.cfg.rope_interleaved && decoder.cfg.family == Family::Llama;
    let heads = (
        decoder.cfg.num_attention_heads,
        decoder.cfg.num_key_value_heads,
    );
    for (name, lin) in decoder.named_linears_mut() {
        let module = name.rsplit('.').next().unwrap_or(&name);
        let (an, bn) = peft_names(&name);
        let (a, b) = match (tensors.get(&an), tensors.get(&bn)) {
            (Some(a), Some(b)) => (a, b),
            (None, None) if !cfg.target_modules.iter().any(|t| t == module) => continue,
            (None, _) => return Err(tensor_err(&an, "missing from the adapter".into())),
            (_, None) => return Err(tensor_err(&bn, "missing from the adapter".into())),
        };
        let (out, inp) = lin.dims()?;
        if a.dims() != [cfg.r, inp] {
            return Err(tensor_err(
                &an,
                format!(
                    "shape mismatch: expected [{}, {inp}], got {:?}",
                    cfg.r,
                    a.dims()
                ),
            ));
        }
        if b.dims() != [out, cfg.r] {
            return Err(tensor_err(
                &bn,
                format!(
                    "shape mismatch: expected [{out}, {}], got {:?}",
                    cfg.r,
                    b.dims()
                ),
            ));
        }
        // Adapters are stored in HF row order; a llama GGUF base keeps q/k rows permuted.
        let b = match module {
            "q_proj" if permuted => permute_rope_rows(b, heads.0, false)?,
            "k_proj" if permuted => permute_rope_rows(b, heads.1, false)?,
            _ => b.clone(),
        };
        lin.lora = Some(LoraWeights {
            a: a.clone(),
            b,
            scale,
        });
        if merge {
            lin.merge_lora()?;
        }
        used += 2;
        adapted += 1;
    }
    if used != tensors.len() {
        let mut unknown: Vec<&String> = tensors
            .keys()
            .filter(|k| {
                !decoder.named_linears().iter().any(|(n, _)| {
                    let (a, b) = peft_names(n);
                    **k == a || **k == b
                })
            })
            .collect();
        unknown.sort();
        let first = unknown.first().map(|s| s.as_str()).unwrap_or("?");
        return Err(tensor_err(
            first,
            format!(
                "does not match any projection of the base model ({} unmatched tensors)",
                unknown.len()
            ),
        ));
    }
    Ok(adapted)
}
