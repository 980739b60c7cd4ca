//! PEFT LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors`): read,
//! validated against the base, attached to or folded into a loaded decoder.

use super::*;

/// A PEFT adapter's configuration file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// A PEFT adapter's weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// Beside an adapter envace trained: the sha256 of the base it was trained on (PEFT's own
/// `adapter_config.json` refuses keys it does not know, so the record is a file of its own).
pub const ADAPTER_BASE: &str = "envace_base.json";
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
    /// The sha256 of the base the adapter was trained on ([`base_hash`]), kept in
    /// `envace_base.json` beside `adapter_config.json` (PEFT refuses keys it does not know);
    /// `None` for PEFT's adapters and older envace ones, which are not checked.
    pub base_sha256: Option<String>,
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
            base_sha256: read_base_record(dir)?,
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

/// sha256 of a base model's weights, as a loaded model's `hash` has it: a `.gguf` file, or an
/// HF checkpoint directory's weight files and `config.json`.
pub fn base_hash(base: &Path) -> Result<String, RuntimeError> {
    if base.is_file() {
        return hash_files(&[base.to_path_buf()]);
    }
    hash_files(&CheckpointFiles::locate(base)?.hashed())
}

/// The base record (`DIR/envace_base.json`) of an adapter, when it has one: its `sha256`.
fn read_base_record(dir: &Path) -> Result<Option<String>, RuntimeError> {
    let path = dir.join(ADAPTER_BASE);
    if !path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(&path).map_err(|e| file_err(&path, format!("cannot read: {e}")))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| file_err(&path, format!("invalid JSON: {e}")))?;
    match v.get("sha256").and_then(Value::as_str) {
        Some(h) if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) => {
            Ok(Some(h.to_ascii_lowercase()))
        }
        other => Err(RuntimeError::Field {
            path: path.display().to_string(),
            field: "sha256".into(),
            message: format!("{other:?}: expected 64 hex digits"),
        }),
    }
}

impl AdapterConfig {
    /// The base record to write beside the adapter (`envace_base.json`), when its hash is known.
    pub fn base_record(&self) -> Option<Value> {
        let hash = self.base_sha256.as_ref()?;
        Some(serde_json::json!({"base": self.base_model_name_or_path, "sha256": hash}))
    }

    /// Refuse the adapter of `dir` on the base at `base` (`hash`: its [`base_hash`]) when it
    /// recorded another one: its weights are deltas on the weights it was trained with, and on
    /// other ones they give a different model without any error.
    pub fn check_base(&self, dir: &Path, base: &Path, hash: &str) -> Result<(), RuntimeError> {
        match &self.base_sha256 {
            Some(want) if want != hash => Err(RuntimeError::Field {
                path: dir.join(ADAPTER_BASE).display().to_string(),
                field: "sha256".into(),
                message: format!(
                    "the adapter was trained on a base with sha256 {want}, but {} has {hash}: another file at that path (re-quantized, re-downloaded?); point base_model_name_or_path in {ADAPTER_CONFIG} at the base it was trained on",
                    base.display()
                ),
            }),
            _ => Ok(()),
        }
    }
}
