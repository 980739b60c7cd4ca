//! Loading checkpoints into the [`Decoder`]: HF directories (single or sharded safetensors,
//! any float dtype converted explicitly) and GGUF files (quantized, with Q4_1/Q5_x weights
//! requantized to Q8_0, whose CPU kernels are SIMD, and an f32 copy for prefill when it fits
//! and the tiles do not prefill faster).
//! Every failure names the file and the tensor or field. PEFT LoRA adapter directories
//! (`adapter_config.json` + `adapter_model.safetensors`) are read here too and attached to (or
//! folded into) a loaded decoder. This file: HF checkpoint directories; `gguf.rs`: GGUF files
//! (quantized inference load, dequantized training load, name mapping); `adapter.rs`: PEFT
//! adapters.

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

mod adapter;
mod gguf;

pub use adapter::*;
pub use gguf::*;

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

    /// The files a checkpoint's hash covers: its weights and `config.json`.
    pub fn hashed(&self) -> Vec<PathBuf> {
        let mut v = self.weights.clone();
        v.push(self.config.clone());
        v
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
    let (cfg, tensors) = hf_tensors(files)?;
    build_dense(&cfg, tensors, dtype, device, trainable)
}

/// An HF checkpoint directory's configuration (its generation config's end tokens added) and
/// named tensors, as [`build_dense`] takes them.
#[allow(clippy::type_complexity)]
pub fn hf_tensors(
    files: &CheckpointFiles,
) -> Result<(DecoderConfig, HashMap<String, (Tensor, PathBuf)>), RuntimeError> {
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
    Ok((cfg, read_safetensors(&files.weights)?))
}
