//! The decoder's configuration, read from an HF `config.json` (Llama, Qwen2, Qwen3) or from GGUF
//! metadata. One struct with variant flags (`qkv_bias`, `qk_norm`, `rope_interleaved`) instead of
//! three model copies; errors name the file and the field.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::backend::RuntimeError;

/// The architecture families the decoder implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
}

impl Family {
    /// HF `architectures` values accepted for each family.
    pub const SUPPORTED: &'static [(&'static str, Family)] = &[
        ("LlamaForCausalLM", Family::Llama),
        ("Qwen2ForCausalLM", Family::Qwen2),
        ("Qwen3ForCausalLM", Family::Qwen3),
    ];

    pub fn hf_architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
        }
    }
}

/// Llama-3 style RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// Everything the decoder needs to know about a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecoderConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2 always; others when `attention_bias`).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// RoPE pairs (2i, 2i+1) instead of (i, i+d/2): llama-family GGUF files store q/k permuted.
    pub rope_interleaved: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn field_err(path: &Path, field: &str, message: impl Into<String>) -> RuntimeError {
    RuntimeError::Field {
        path: path.display().to_string(),
        field: field.to_string(),
        message: message.into(),
    }
}

fn req_usize(v: &Value, path: &Path, field: &str) -> Result<usize, RuntimeError> {
    match v.get(field) {
        None | Some(Value::Null) => Err(field_err(path, field, "missing")),
        Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
            field_err(
                path,
                field,
                format!("expected a non-negative integer, got {x}"),
            )
        }),
    }
}

fn opt_usize(v: &Value, path: &Path, field: &str) -> Result<Option<usize>, RuntimeError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => req_usize(v, path, field).map(Some),
    }
}

fn opt_f64(v: &Value, path: &Path, field: &str) -> Result<Option<f64>, RuntimeError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| field_err(path, field, format!("expected a number, got {x}"))),
    }
}

fn opt_bool(v: &Value, path: &Path, field: &str) -> Result<Option<bool>, RuntimeError> {
    match v.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| field_err(path, field, format!("expected true or false, got {x}"))),
    }
}

/// Token ids given as a number or a list of numbers (`eos_token_id`).
pub fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

impl DecoderConfig {
    /// Read and validate an HF `config.json`.
    pub fn from_hf_file(path: &Path) -> Result<Self, RuntimeError> {
        let text = std::fs::read_to_string(path).map_err(|e| RuntimeError::File {
            path: path.display().to_string(),
            message: format!("cannot read: {e}"),
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| RuntimeError::File {
            path: path.display().to_string(),
            message: format!("invalid JSON: {e}"),
        })?;
        Self::from_hf_json(&v, path)
    }

    /// Validate an HF config value (`path` is used in error messages only).
    pub fn from_hf_json(v: &Value, path: &Path) -> Result<Self, RuntimeError> {
        let supported = Family::SUPPORTED
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ");
        let arch = match v.get("architectures") {
            Some(Value::Array(a)) if !a.is_empty() => a[0].as_str().unwrap_or("").to_string(),
            Some(other) => {
                return Err(field_err(
                    path,
                    "architectures",
                    format!("expected a non-empty list, got {other}"),
                ));
            }
            None => match v.get("model_type").and_then(Value::as_str) {
                Some("llama") => "LlamaForCausalLM".into(),
                Some("qwen2") => "Qwen2ForCausalLM".into(),
                Some("qwen3") => "Qwen3ForCausalLM".into(),
                Some(other) => other.to_string(),
                None => {
                    return Err(field_err(
                        path,
                        "architectures",
                        "missing (and no `model_type`)",
                    ));
                }
            },
        };
        let family = Family::SUPPORTED
            .iter()
            .find(|(n, _)| *n == arch)
            .map(|(_, f)| *f)
            .ok_or_else(|| RuntimeError::UnsupportedArchitecture {
                path: path.display().to_string(),
                got: arch.clone(),
                supported: supported.clone(),
            })?;
        let hidden_size = req_usize(v, path, "hidden_size")?;
        let num_attention_heads = req_usize(v, path, "num_attention_heads")?;
        if num_attention_heads == 0 {
            return Err(field_err(path, "num_attention_heads", "must be > 0"));
        }
        let num_key_value_heads =
            opt_usize(v, path, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(field_err(
                path,
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"
                ),
            ));
        }
        let head_dim = opt_usize(v, path, "head_dim")?.unwrap_or(hidden_size / num_attention_heads);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(field_err(
                path,
                "head_dim",
                format!("must be even and > 0, got {head_dim}"),
            ));
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str)
            && act != "silu"
        {
            return Err(field_err(
                path,
                "hidden_act",
                format!("only `silu` is supported, got `{act}`"),
            ));
        }
        if opt_bool(v, path, "use_sliding_window")?.unwrap_or(false) {
            return Err(field_err(
                path,
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        if opt_bool(v, path, "mlp_bias")?.unwrap_or(false) {
            return Err(field_err(path, "mlp_bias", "MLP biases are not supported"));
        }
        let rope_scaling = match v.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(rs) => {
                let kind = rs
                    .get("rope_type")
                    .or_else(|| rs.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                match kind {
                    "default" => None,
                    "llama3" => {
                        let p = Path::new(path);
                        let sub = |f: &str| {
                            rs.get(f).and_then(Value::as_f64).ok_or_else(|| {
                                field_err(
                                    p,
                                    &format!("rope_scaling.{f}"),
                                    "missing or not a number",
                                )
                            })
                        };
                        Some(RopeScaling {
                            factor: sub("factor")?,
                            low_freq_factor: sub("low_freq_factor")?,
                            high_freq_factor: sub("high_freq_factor")?,
                            original_max_position_embeddings: sub(
                                "original_max_position_embeddings",
                            )?
                                as usize,
                        })
                    }
                    other => {
                        return Err(field_err(
                            path,
                            "rope_scaling.rope_type",
                            format!("`{other}` is not supported (supported: default, llama3)"),
                        ));
                    }
                }
            }
        };
        let attention_bias = opt_bool(v, path, "attention_bias")?.unwrap_or(false);
        Ok(Self {
            family,
            vocab_size: req_usize(v, path, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(v, path, "intermediate_size")?,
            num_hidden_layers: req_usize(v, path, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: opt_f64(v, path, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: opt_f64(v, path, "rope_theta")?.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings: opt_usize(v, path, "max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: opt_bool(v, path, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias: family == Family::Qwen2 || attention_bias,
            qk_norm: family == Family::Qwen3,
            rope_interleaved: false,
            bos_token_id: v
                .get("bos_token_id")
                .and_then(Value::as_u64)
                .map(|x| x as u32),
            eos_token_ids: token_ids(v.get("eos_token_id")),
        })
    }

    /// The HF `config.json` for this configuration (what the fixture generator and the trainer
    /// write next to the weights).
    pub fn to_hf_json(&self) -> Value {
        let mut v = json!({
            "architectures": [self.family.hf_architecture()],
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias && self.family != Family::Qwen2,
            "torch_dtype": "float32",
        });
        if let Some(obj) = v.as_object_mut() {
            if self.family != Family::Llama {
                obj.insert("use_sliding_window".into(), json!(false));
                obj.insert("sliding_window".into(), Value::Null);
                obj.insert("max_window_layers".into(), json!(self.num_hidden_layers));
            }
            if let Some(b) = self.bos_token_id {
                obj.insert("bos_token_id".into(), json!(b));
            }
            match self.eos_token_ids.as_slice() {
                [] => {}
                [one] => {
                    obj.insert("eos_token_id".into(), json!(one));
                }
                many => {
                    obj.insert("eos_token_id".into(), json!(many));
                }
            }
            if let Some(rs) = &self.rope_scaling {
                obj.insert(
                    "rope_scaling".into(),
                    json!({
                        "rope_type": "llama3",
                        "factor": rs.factor,
                        "low_freq_factor": rs.low_freq_factor,
                        "high_freq_factor": rs.high_freq_factor,
                        "original_max_position_embeddings": rs.original_max_position_embeddings,
                    }),
                );
            }
        }
        v
    }

    /// Inverse RoPE frequencies (with Llama-3 scaling when configured).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f64> = (0..d)
            .step_by(2)
            .map(|i| 1.0 / self.rope_theta.powf(i as f64 / d as f64))
            .collect();
        let out: Vec<f64> = match &self.rope_scaling {
            None => base,
            Some(rs) => {
                let low_wl = rs.original_max_position_embeddings as f64 / rs.low_freq_factor;
                let high_wl = rs.original_max_position_embeddings as f64 / rs.high_freq_factor;
                base.into_iter()
                    .map(|f| {
                        let wl = 2.0 * std::f64::consts::PI / f;
                        if wl < high_wl {
                            f
                        } else if wl > low_wl {
                            f / rs.factor
                        } else {
                            let smooth = (rs.original_max_position_embeddings as f64 / wl
                                - rs.low_freq_factor)
                                / (rs.high_freq_factor - rs.low_freq_factor);
                            (1.0 - smooth) * f / rs.factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        out.into_iter().map(|x| x as f32).collect()
    }

    /// Number of parameters (dense count).
    pub fn parameter_count(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let mut layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim;
        }
        let emb = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { emb };
        emb + head + h + self.num_hidden_layers * layer
    }
}
