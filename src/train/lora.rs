//! LoRA: low-rank adapters on the decoder's projections, trained while the base stays frozen.
//!
//! A projection `W` (out × in) gains A (r × in, Kaiming-uniform as PEFT initialises it, seeded)
//! and B (out × r, zeros): `y = x Wᵀ + (alpha/r) · x Aᵀ Bᵀ`, so training starts from the base
//! model exactly. The adapters are the trainer's only `Var`s (see `TrainableModel::load_lora`);
//! rollouts run the same adapted decoder. Adapters are saved as PEFT writes them
//! (`adapter_model.safetensors` with `base_model.model.…lora_A.weight` names and
//! `adapter_config.json`), and [`merge_adapter`] folds one into its base as a plain HF
//! checkpoint (`W' = W + (alpha/r) · B A`). Reference: Hu et al. 2021; HF PEFT `tuners/lora`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, gguf_file};
use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::TrainError;
use super::checkpoint::{self, write_atomically};
use crate::runtime::RuntimeError;
use crate::runtime::decoder::Decoder;
use crate::runtime::loader::{
    ADAPTER_WEIGHTS, AdapterConfig, CheckpointFiles, LORA_MODULES, base_hash, gguf_hf_tensors,
    is_gguf, peft_names, read_adapter, read_safetensors, write_gguf_with,
};

/// The modules adapted when none are named: the attention projections.
pub const DEFAULT_TARGETS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];

/// How to adapt a model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    pub r: usize,
    pub alpha: f64,
    /// Short module names (`q_proj`, …, `down_proj`).
    pub targets: Vec<String>,
    /// Seed of A's initialisation.
    pub seed: u64,
}

impl LoraConfig {
    /// From command-line values: rank, optional alpha (default `2·r`), comma-separated targets
    /// (empty = [`DEFAULT_TARGETS`]).
    pub fn new(r: usize, alpha: Option<f64>, targets: &str, seed: u64) -> Result<Self, TrainError> {
        if r == 0 {
            return Err(TrainError::Data(
                "--lora: the rank must be at least 1".into(),
            ));
        }
        let mut t: Vec<String> = targets
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        if t.is_empty() {
            t = DEFAULT_TARGETS.iter().map(|s| s.to_string()).collect();
        }
        if let Some(bad) = t.iter().find(|m| !LORA_MODULES.contains(&m.as_str())) {
            return Err(TrainError::Data(format!(
                "--lora-targets: `{bad}` is not one of {}",
                LORA_MODULES.join(", ")
            )));
        }
        t.dedup();
        let alpha = alpha.unwrap_or(2.0 * r as f64);
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(TrainError::Data(format!(
                "--lora-alpha: {alpha} is not a positive number"
            )));
        }
        Ok(Self {
            r,
            alpha,
            targets: t,
            seed,
        })
    }
}

/// Fresh adapter tensors (CPU, f32, PEFT names) for the targeted projections of `decoder`:
/// A ~ U(±1/√in) (PEFT's `kaiming_uniform_(a=√5)`), B = 0. Seeded; the order is the decoder's.
pub fn init_adapter(
    decoder: &Decoder,
    cfg: &LoraConfig,
) -> Result<HashMap<String, Tensor>, RuntimeError> {
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut out = HashMap::new();
    for (name, lin) in decoder.named_linears() {
        let module = name.rsplit('.').next().unwrap_or(&name);
        if !cfg.targets.iter().any(|t| t == module) {
            continue;
        }
        let (o, i) = lin.dims()?;
        let bound = 1.0 / (i as f32).sqrt();
        let a: Vec<f32> = (0..cfg.r * i)
            .map(|_| rng.random_range(-bound..bound))
            .collect();
        let (an, bn) = peft_names(&name);
        out.insert(an, Tensor::from_vec(a, (cfg.r, i), &Device::Cpu)?);
        out.insert(bn, Tensor::zeros((o, cfg.r), DType::F32, &Device::Cpu)?);
    }
    if out.is_empty() {
        return Err(RuntimeError::Generation(format!(
            "LoRA targets {:?} match no projection of the model",
            cfg.targets
        )));
    }
    Ok(out)
}

/// Fold the adapter `lora` (read from `adapter` with `cfg`) into the named base `tensors`
/// (HF names; `base` names their file in errors): each adapted weight becomes `W + (alpha/r)·B A`,
/// computed in f32 and stored in W's dtype. Returns the names of the weights it changed.
pub fn fold_adapter(
    tensors: &mut HashMap<String, Tensor>,
    cfg: &AdapterConfig,
    lora: &HashMap<String, Tensor>,
    adapter: &Path,
    base: &Path,
) -> Result<Vec<String>, RuntimeError> {
    let adapter_file = adapter.join(ADAPTER_WEIGHTS);
    let tensor_err = |name: &str, message: String| RuntimeError::Tensor {
        path: adapter_file.display().to_string(),
        name: name.to_string(),
        message,
    };
    let mut modules: Vec<String> = Vec::new();
    for k in lora.keys() {
        let module = k
            .strip_prefix("base_model.model.")
            .and_then(|m| {
                m.strip_suffix(".lora_A.weight")
                    .or_else(|| m.strip_suffix(".lora_B.weight"))
            })
            .ok_or_else(|| tensor_err(k, "not a PEFT LoRA tensor name".into()))?;
        modules.push(module.to_string());
    }
    modules.sort();
    modules.dedup();
    let scale = cfg.scale();
    let mut changed = Vec::with_capacity(modules.len());
    for m in &modules {
        let (an, bn) = peft_names(m);
        let a = lora
            .get(&an)
            .ok_or_else(|| tensor_err(&an, "missing from the adapter".into()))?;
        let b = lora
            .get(&bn)
            .ok_or_else(|| tensor_err(&bn, "missing from the adapter".into()))?;
        let wn = format!("{m}.weight");
        let w = tensors.get(&wn).ok_or_else(|| {
            tensor_err(
                &an,
                format!("the base {} has no tensor `{wn}`", base.display()),
            )
        })?;
        let (o, i) = w.dims2()?;
        if a.dims() != [cfg.r, i] || b.dims() != [o, cfg.r] {
            return Err(tensor_err(
                &an,
                format!(
                    "shapes A {:?} / B {:?} do not fit `{wn}` {:?} at r = {}",
                    a.dims(),
                    b.dims(),
                    w.dims(),
                    cfg.r
                ),
            ));
        }
        let delta = (b.to_dtype(DType::F32)?.matmul(&a.to_dtype(DType::F32)?)? * scale)?;
        let merged = (w.to_dtype(DType::F32)? + delta)?.to_dtype(w.dtype())?;
        tensors.insert(wn.clone(), merged);
        changed.push(wn);
    }
    Ok(changed)
}

/// An adapter read with its base resolved (`base` when given, else the one its config names) and
/// checked against the base hash the adapter recorded: what every fold of it starts from.
pub fn adapter_on_checked_base(
    adapter: &Path,
    base: Option<&Path>,
) -> Result<(AdapterConfig, HashMap<String, Tensor>, PathBuf), RuntimeError> {
    let (cfg, lora) = read_adapter(adapter)?;
    let base = match base {
        Some(b) => b.to_path_buf(),
        None => cfg.resolve_base(adapter)?,
    };
    cfg.check_base(adapter, &base, &base_hash(&base)?)?;
    Ok((cfg, lora, base))
}

/// What a merge did.
#[derive(Debug, Clone, Serialize)]
pub struct MergeReport {
    pub out: PathBuf,
    /// The base the adapter was folded into (given, or the one its config names).
    pub base: PathBuf,
    pub merged_projections: usize,
    pub r: usize,
    pub lora_alpha: f64,
    pub target_modules: Vec<String>,
    /// The stored weights' dtype (`float32`, `bfloat16`, `float16`, or `as base`).
    pub dtype: String,
}

/// Fold the adapter in `adapter` into its base and write the result to `out` atomically, as a
/// plain HF checkpoint any engine loads (transformers, vLLM, verl, llama.cpp's converter).
///
/// The base is `base` when given, else the one the adapter's config names; the adapter's
/// recorded base hash is checked either way. An HF base keeps its `config.json` and
/// `generation_config.json`, its tokenizer files and every tensor it has (adapted weights
/// `W + (alpha/r)·B A` computed in f32 and stored in W's dtype). A GGUF base (as
/// `models/smollm2-envace`'s) is dequantized to f32 with llama q/k rows put back in HF order,
/// and the checkpoint gets a `config.json` describing those tensors and the adapter's own
/// tokenizer files (the GGUF's tokenizer and chat template as the adapter was trained with).
/// The prompt profile (`envace.json`) is the adapter's if it has one, else the base's. With
/// `dtype`, every floating tensor is stored in it (`config.json`'s `torch_dtype` says so).
pub fn merge_adapter(
    base: Option<&Path>,
    adapter: &Path,
    out: &Path,
    dtype: Option<DType>,
) -> Result<MergeReport, TrainError> {
    let (cfg, lora, base) = adapter_on_checked_base(adapter, base)?;
    // (tensors, config.json, generation_config.json, tokenizer.json whose siblings travel)
    let gguf = is_gguf(&base);
    // A GGUF base is dequantized to f32: that is its dtype unless another is asked for.
    let dtype = dtype.or(gguf.then_some(DType::F32));
    let (mut tensors, mut config, generation, tokenizer) = if gguf {
        let (dcfg, tensors, _) = gguf_hf_tensors(&base, &Device::Cpu)?;
        let tokenizer = adapter.join("tokenizer.json");
        if !tokenizer.is_file() {
            return Err(TrainError::Data(format!(
                "{}: missing; an adapter on a GGUF base carries the tokenizer it was trained with",
                tokenizer.display()
            )));
        }
        let generation = checkpoint::generation_config_json(&dcfg);
        (tensors, dcfg.to_hf_json(), Some(generation), tokenizer)
    } else {
        let files = CheckpointFiles::locate(&base)?;
        let tensors: HashMap<String, Tensor> = read_safetensors(&files.weights)?
            .into_iter()
            .map(|(k, (t, _))| (k, t))
            .collect();
        let config = read_json(&files.config)?;
        let generation = files
            .generation_config
            .as_deref()
            .map(read_json)
            .transpose()?;
        (tensors, config, generation, files.tokenizer.clone())
    };
    let modules = fold_adapter(&mut tensors, &cfg, &lora, adapter, &base)?;
    let dtype_name = match dtype {
        None => "as base".to_string(),
        Some(d) => {
            for t in tensors.values_mut() {
                if t.dtype().is_float() {
                    *t = t.to_dtype(d)?;
                }
            }
            let name = torch_dtype(d);
            if let Some(obj) = config.as_object_mut() {
                obj.insert("torch_dtype".into(), name.into());
            }
            name.to_string()
        }
    };
    let profile = [adapter.join("envace.json"), base.join("envace.json")]
        .into_iter()
        .find(|p| p.is_file());
    write_atomically(out, |tmp| {
        checkpoint::write_json(tmp, "config.json", &config)?;
        if let Some(g) = &generation {
            checkpoint::write_json(tmp, "generation_config.json", g)?;
        }
        checkpoint::copy_tokenizer_files(tmp, &tokenizer)?;
        if let Some(p) = &profile {
            std::fs::copy(p, tmp.join("envace.json")).map_err(|e| {
                checkpoint::CheckpointError::Io {
                    path: p.display().to_string(),
                    message: e.to_string(),
                }
            })?;
        }
        checkpoint::save_tensors(tmp, "model.safetensors", &tensors)
    })?;
    Ok(MergeReport {
        out: out.to_path_buf(),
        base,
        merged_projections: modules.len(),
        r: cfg.r,
        lora_alpha: cfg.lora_alpha,
        target_modules: cfg.target_modules,
        dtype: dtype_name,
    })
}

/// [`merge_adapter`] into a GGUF file instead of an HF directory, for llama.cpp and the engines
/// that read GGUF: the adapter's base must be a GGUF file (given, or the one the adapter names;
/// its recorded hash is checked). Every adapted projection is folded in f32 and quantized to
/// `dtype`; every other tensor (embeddings, norms, the head) is copied as the base stores it.
/// The file's chat template becomes the adapter's (from its `tokenizer_config.json`), so a
/// server that renders chats (llama-server's `/v1/chat/completions`) uses the format the model
/// was fine-tuned in; tokenizer and hyperparameters stay the base's.
pub fn merge_adapter_gguf(
    base: Option<&Path>,
    adapter: &Path,
    out: &Path,
    dtype: GgmlDType,
) -> Result<MergeReport, TrainError> {
    let (cfg, lora, base) = adapter_on_checked_base(adapter, base)?;
    if !is_gguf(&base) {
        return Err(TrainError::Data(format!(
            "{}: a GGUF output needs a GGUF base; merge into an HF directory (an --out without .gguf) and convert it with llama.cpp's convert_hf_to_gguf.py",
            base.display()
        )));
    }
    let (_, mut tensors, _) = gguf_hf_tensors(&base, &Device::Cpu)?;
    let changed = fold_adapter(&mut tensors, &cfg, &lora, adapter, &base)?;
    let replaced: HashMap<String, Tensor> = changed
        .iter()
        .filter_map(|n| tensors.remove(n).map(|t| (n.clone(), t)))
        .collect();
    let mut set = Vec::new();
    let tc = adapter.join("tokenizer_config.json");
    if tc.is_file() {
        let v = read_json(&tc)?;
        if let Some(t) = v.get("chat_template").and_then(|t| t.as_str()) {
            set.push((
                "tokenizer.chat_template".to_string(),
                gguf_file::Value::String(t.to_string()),
            ));
        }
    }
    write_gguf_with(&base, &replaced, dtype, set, out)?;
    Ok(MergeReport {
        out: out.to_path_buf(),
        base,
        merged_projections: changed.len(),
        r: cfg.r,
        lora_alpha: cfg.lora_alpha,
        target_modules: cfg.target_modules,
        dtype: format!("{dtype:?}").to_lowercase(),
    })
}

/// A JSON file, parsed (errors name the file).
fn read_json(path: &Path) -> Result<serde_json::Value, TrainError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))
}

/// HF's name of a dtype, as `config.json`'s `torch_dtype` writes it.
pub fn torch_dtype(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        _ => "float32",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_rejects_unknown_targets() {
        let c = LoraConfig::new(8, None, "", 0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.alpha, 16.0);
        assert_eq!(c.targets, DEFAULT_TARGETS.to_vec());
        let e = LoraConfig::new(4, Some(8.0), "q_proj,lm_head", 0)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("lm_head") && e.contains("gate_proj"), "{e}");
        assert!(LoraConfig::new(0, None, "", 0).is_err());
    }
}
