//! A decoder whose weights are `Var`s in a `VarMap` (HF names), ready for the optimizer, plus
//! the masked token log-probabilities both SFT and GRPO are built on. In LoRA mode the base
//! weights are plain tensors (frozen: not in the optimizer, no gradients) and the `VarMap` holds
//! only the adapters' A and B matrices, by PEFT name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

use crate::runtime::RuntimeError;
use crate::runtime::config::DecoderConfig;
use crate::runtime::decoder::Decoder;
use crate::runtime::fixture::random_weights;
use crate::runtime::fused;
use crate::runtime::loader::{
    ADAPTER_WEIGHTS, AdapterConfig, CheckpointFiles, attach_adapter, base_hash, build_dense,
    gguf_hf_tensors, hf_tensors, is_adapter_dir, is_gguf, load_gguf_dense, load_hf, read_adapter,
};
use crate::runtime::train_pass;
use crate::train::lora::{LoraConfig, adapter_on_checked_base, fold_adapter, init_adapter};

/// A trainable decoder.
pub struct TrainableModel {
    pub decoder: Decoder,
    pub varmap: VarMap,
    /// The checkpoint directory it came from (tokenizer files are copied from there).
    pub source: Option<PathBuf>,
    /// `Some` in LoRA mode: the adapter being trained (its base is frozen).
    pub lora: Option<AdapterConfig>,
}

impl std::fmt::Debug for TrainableModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainableModel")
            .field("source", &self.source)
            .field("lora", &self.lora)
            .finish()
    }
}

impl TrainableModel {
    /// Load an HF checkpoint directory, or a GGUF file (dequantized, see
    /// [`load_gguf_dense`]), with every weight trainable (f32). A LoRA adapter directory (a LoRA
    /// run's checkpoint) loads in LoRA mode: its base frozen, its adapter trainable.
    pub fn load(dir: &Path, device: &Device) -> Result<Self, RuntimeError> {
        if is_adapter_dir(dir) {
            return Self::load_adapter(dir, device);
        }
        let varmap = VarMap::new();
        let decoder = load_base(dir, device, Some(&varmap))?;
        Ok(Self {
            decoder,
            varmap,
            source: Some(dir.to_path_buf()),
            lora: None,
        })
    }

    /// Full fine-tuning from a LoRA adapter directory: its base with the adapter folded into
    /// the weights (as `envace merge` does), every weight trainable (f32). The model then trains
    /// and saves as a plain checkpoint; the adapter's tokenizer and template stay the caller's.
    pub fn load_folded(dir: &Path, device: &Device) -> Result<Self, RuntimeError> {
        let (acfg, lora, base) = adapter_on_checked_base(dir, None)?;
        let (cfg, mut named) = if is_gguf(&base) {
            let (cfg, tensors, _) = gguf_hf_tensors(&base, device)?;
            let named = tensors
                .into_iter()
                .map(|(k, t)| (k, (t, base.clone())))
                .collect::<HashMap<_, _>>();
            (cfg, named)
        } else {
            hf_tensors(&CheckpointFiles::locate(&base)?)?
        };
        // Fold on the tensors alone (cheap handles), then put the adapted ones back beside
        // their files.
        let mut tensors: HashMap<String, Tensor> = named
            .iter()
            .map(|(k, (t, _))| (k.clone(), t.clone()))
            .collect();
        fold_adapter(&mut tensors, &acfg, &lora, dir, &base)?;
        for (k, t) in tensors {
            if let Some(entry) = named.get_mut(&k) {
                entry.0 = t;
            }
        }
        let varmap = VarMap::new();
        let decoder = build_dense(&cfg, named, DType::F32, device, Some(&varmap))?;
        Ok(Self {
            decoder,
            varmap,
            source: Some(dir.to_path_buf()),
            lora: None,
        })
    }

    /// LoRA mode on a base HF checkpoint: fresh adapters (A seeded Kaiming-uniform, B zero, so
    /// the model starts exactly as the base) on `cfg.targets`; the base weights are frozen.
    pub fn load_lora(base: &Path, cfg: &LoraConfig, device: &Device) -> Result<Self, RuntimeError> {
        let decoder = load_base(base, device, None)?;
        let tensors = init_adapter(&decoder, cfg)?;
        let acfg = AdapterConfig {
            r: cfg.r,
            lora_alpha: cfg.alpha,
            target_modules: cfg.targets.clone(),
            // Absolute, so that the adapter finds its base from any working directory.
            base_model_name_or_path: Some(
                std::fs::canonicalize(base)
                    .unwrap_or_else(|_| base.to_path_buf())
                    .display()
                    .to_string(),
            ),
            base_sha256: Some(base_hash(base)?),
        };
        Self::with_adapter(decoder, acfg, tensors, base, device)
    }

    /// LoRA mode from an adapter directory (resuming a LoRA run): the base named in its
    /// `adapter_config.json`, frozen, and its adapter, trainable.
    pub fn load_adapter(dir: &Path, device: &Device) -> Result<Self, RuntimeError> {
        let (mut acfg, tensors) = read_adapter(dir)?;
        let base = acfg.resolve_base(dir)?;
        let hash = base_hash(&base)?;
        acfg.check_base(dir, &base, &hash)?;
        acfg.base_sha256 = Some(hash);
        let decoder = load_base(&base, device, None)?;
        // A base named relative to `dir` would not resolve from the directories this adapter
        // is saved into next (checkpoints, a continued run's output): save it resolved.
        acfg.base_model_name_or_path = Some(
            std::fs::canonicalize(&base)
                .unwrap_or_else(|_| base.clone())
                .display()
                .to_string(),
        );
        Self::with_adapter(decoder, acfg, tensors, dir, device)
    }

    fn with_adapter(
        mut decoder: Decoder,
        acfg: AdapterConfig,
        tensors: HashMap<String, Tensor>,
        source: &Path,
        device: &Device,
    ) -> Result<Self, RuntimeError> {
        let varmap = VarMap::new();
        let mut live = HashMap::new();
        {
            let mut data = varmap
                .data()
                .lock()
                .map_err(|_| RuntimeError::Generation("var map lock poisoned".into()))?;
            for (name, t) in tensors {
                let var = Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(device)?)?;
                live.insert(name.clone(), var.as_tensor().clone());
                data.insert(name, var);
            }
        }
        attach_adapter(
            &mut decoder,
            &acfg,
            &live,
            &source.join(ADAPTER_WEIGHTS),
            false,
        )?;
        Ok(Self {
            decoder,
            varmap,
            source: Some(source.to_path_buf()),
            lora: Some(acfg),
        })
    }

    /// Number of trainable parameters (every weight, or the adapters in LoRA mode).
    pub fn trainable_parameters(&self) -> usize {
        self.named_vars()
            .iter()
            .map(|(_, v)| v.as_tensor().elem_count())
            .sum()
    }

    /// A freshly initialised model (seeded).
    pub fn init(cfg: &DecoderConfig, seed: u64, device: &Device) -> Result<Self, RuntimeError> {
        let w = random_weights(cfg, seed, 0.02)?;
        let tensors = w
            .into_iter()
            .map(|(k, v)| (k, (v, PathBuf::from("init"))))
            .collect();
        let varmap = VarMap::new();
        let decoder = build_dense(cfg, tensors, DType::F32, device, Some(&varmap))?;
        Ok(Self {
            decoder,
            varmap,
            source: None,
            lora: None,
        })
    }

    /// Named trainable variables.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        match self.varmap.data().lock() {
            Ok(m) => m.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Current weights by HF name (the adapter tensors by PEFT name in LoRA mode).
    pub fn weights(&self) -> HashMap<String, Tensor> {
        self.named_vars()
            .into_iter()
            .map(|(k, v)| (k, v.as_tensor().clone()))
            .collect()
    }
}

/// A base checkpoint (HF directory or GGUF file) as a dense f32 decoder; its weights become
/// `Var`s in `varmap` when given (full fine-tuning), else they stay frozen tensors.
fn load_base(
    path: &Path,
    device: &Device,
    varmap: Option<&VarMap>,
) -> Result<Decoder, RuntimeError> {
    if is_gguf(path) {
        return Ok(load_gguf_dense(path, DType::F32, device, varmap)?.0);
    }
    let files = CheckpointFiles::locate(path)?;
    load_hf(&files, DType::F32, device, varmap)
}

/// One training sequence: `mask[i]` weights the prediction of `ids[i]` from `ids[..i]`
/// (0 on prompt, tool and user tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub ids: Vec<u32>,
    pub mask: Vec<f32>,
}

impl Example {
    pub fn trained_tokens(&self) -> usize {
        self.mask.iter().filter(|&&m| m > 0.0).count()
    }

    pub fn truncate(&mut self, max_len: usize) {
        self.ids.truncate(max_len);
        self.mask.truncate(max_len);
    }
}

/// Right-padded batch: ids (B, T) and the shifted mask (B, T-1).
pub fn batch_tensors(
    examples: &[&Example],
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let t = examples
        .iter()
        .map(|e| e.ids.len())
        .max()
        .unwrap_or(2)
        .max(2);
    let b = examples.len();
    let mut ids = vec![0u32; b * t];
    let mut mask = vec![0f32; b * (t - 1)];
    for (r, e) in examples.iter().enumerate() {
        ids[r * t..r * t + e.ids.len()].copy_from_slice(&e.ids);
        for i in 1..e.ids.len() {
            mask[r * (t - 1) + i - 1] = e.mask.get(i).copied().unwrap_or(0.0);
        }
    }
    Ok((
        Tensor::from_vec(ids, (b, t), device)?,
        Tensor::from_vec(mask, (b, t - 1), device)?,
    ))
}

/// Log-probability of each next token: (B, T-1), differentiable.
pub fn token_logprobs(decoder: &Decoder, ids: &Tensor) -> candle_core::Result<Tensor> {
    let (_, t) = ids.dims2()?;
    let inp = ids.narrow(1, 0, t - 1)?;
    let tgt = ids.narrow(1, 1, t - 1)?.contiguous()?;
    let logits = decoder.forward_train(&inp)?;
    fused::token_logprobs(&logits, &tgt)
}

/// Log-probability (and, with `entropy`, the entropy) of each next token at the positions
/// where `mask` (B, T-1) is non-zero, zero elsewhere: (B, T-1) each, differentiable. Logits are
/// computed at those positions only (see [`Decoder::forward_train_at`]).
pub fn masked_token_terms(
    decoder: &Decoder,
    ids: &Tensor,
    mask: &Tensor,
    entropy: bool,
) -> candle_core::Result<(Tensor, Option<Tensor>)> {
    let (b, t) = ids.dims2()?;
    let inp = ids.narrow(1, 0, t - 1)?;
    let tgt = ids.narrow(1, 1, t - 1)?.contiguous()?;
    let rows: Vec<u32> = mask
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .enumerate()
        .filter(|(_, m)| **m != 0.0)
        .map(|(i, _)| i as u32)
        .collect();
    let n = b * (t - 1);
    if rows.is_empty() {
        let z = Tensor::zeros((b, t - 1), candle_core::DType::F32, &decoder.device)?;
        return Ok((z.clone(), entropy.then_some(z)));
    }
    let positions: Vec<usize> = rows.iter().map(|&r| r as usize).collect();
    let idx = Tensor::from_vec(rows, positions.len(), &decoder.device)?;
    let tgt_sel = tgt.flatten_all()?.index_select(&idx, 0)?;
    let (lp, ent) = if train_pass::applies(decoder) {
        // The hand-written pass hands out the token terms, not the logits (see its docs).
        let targets = tgt_sel.to_vec1::<u32>()?;
        let terms = train_pass::token_terms_at(decoder, &inp, &positions, &targets)?;
        let lp = terms.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?;
        let ent = entropy
            .then(|| terms.narrow(1, 2, 1)?.squeeze(1)?.contiguous())
            .transpose()?;
        (lp, ent)
    } else {
        let logits = decoder.forward_train_at(&inp, &positions)?;
        fused::token_logprobs_entropy(&logits, &tgt_sel, entropy)?
    };
    let spread = |x: Tensor| -> candle_core::Result<Tensor> {
        Tensor::zeros(n, candle_core::DType::F32, &decoder.device)?
            .index_add(&idx, &x, 0)?
            .reshape((b, t - 1))
    };
    Ok((spread(lp)?, ent.map(spread).transpose()?))
}

/// Token-mean negative log-likelihood over the masked tokens, and the number of such tokens.
pub fn masked_nll(decoder: &Decoder, examples: &[&Example]) -> candle_core::Result<(Tensor, f64)> {
    let (ids, mask) = batch_tensors(examples, &decoder.device)?;
    let (lp, _) = masked_token_terms(decoder, &ids, &mask, false)?;
    let n = mask.sum_all()?.to_scalar::<f32>()? as f64;
    let loss = ((lp * &mask)?.sum_all()?.neg()? / n.max(1.0))?;
    Ok((loss, n))
}
