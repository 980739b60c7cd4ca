//! Checkpoints written atomically: everything goes into `NAME.tmp/`, then one rename makes it
//! visible; a previous checkpoint of the same name is swapped out only after the new one is
//! complete. A checkpoint holds an HF model directory (loadable by the runtime) plus, for
//! resuming, `optimizer.safetensors` and `trainer_state.json` (step, RNG state, data order).
//! A LoRA run's checkpoint holds a PEFT adapter (`adapter_config.json`,
//! `adapter_model.safetensors`) in place of the model weights. A GRPO run with a KL term also
//! saves its reference's trainable tensors ([`REFERENCE_WEIGHTS`]), so that a resumed run keeps
//! the reference it started with.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::runtime::config::DecoderConfig;
use crate::runtime::fixture::tokenizer_config_json;
use crate::runtime::loader::{ADAPTER_BASE, ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterConfig};

/// The trainable tensors (PEFT adapter or model weights, by the same names) of the policy a KL
/// term holds the run to: the run's starting point, not the checkpoint's weights.
pub const REFERENCE_WEIGHTS: &str = "reference.safetensors";

/// Checkpoint errors name the directory and file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {message}")]
    Io { path: String, message: String },
    #[error("{path}: incomplete or corrupt checkpoint: {message}")]
    Corrupt { path: String, message: String },
    /// Writing a weights file (the error names it).
    #[error(transparent)]
    Weights(#[from] crate::runtime::RuntimeError),
}

fn io(path: &Path, e: impl std::fmt::Display) -> CheckpointError {
    CheckpointError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// What a trainer needs to continue exactly where it stopped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    pub kind: String,
    pub step: usize,
    pub total_steps: usize,
    pub seed: u64,
    /// Opaque RNG / data-order state of the trainer.
    pub rng: Value,
    pub config: Value,
    pub metrics: Value,
}

/// Build a directory atomically: `fill` writes into `NAME.tmp/`, which then replaces `dir` (a
/// previous `dir` is moved aside first and removed only once the new one is in place).
pub fn write_atomically(
    dir: &Path,
    fill: impl FnOnce(&Path) -> Result<(), CheckpointError>,
) -> Result<(), CheckpointError> {
    let name = dir
        .file_name()
        .ok_or_else(|| io(dir, "checkpoint path has no file name"))?
        .to_string_lossy()
        .to_string();
    let parent = dir.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    let tmp = parent.join(format!("{name}.tmp"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    fill(&tmp)?;
    if dir.exists() {
        let old = parent.join(format!("{name}.old"));
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
        }
        std::fs::rename(dir, &old).map_err(|e| io(dir, e))?;
        std::fs::rename(&tmp, dir).map_err(|e| io(dir, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
    } else {
        std::fs::rename(&tmp, dir).map_err(|e| io(dir, e))?;
    }
    Ok(())
}

/// Write `v` as pretty JSON to `dir/file`.
pub fn write_json(dir: &Path, file: &str, v: &Value) -> Result<(), CheckpointError> {
    let p = dir.join(file);
    let text = serde_json::to_string_pretty(v).map_err(|e| io(&p, e))?;
    std::fs::write(&p, text).map_err(|e| io(&p, e))
}

/// Copy `tokenizer.json`, `tokenizer_config.json` (a default one when absent) and the prompt
/// profile `envace.json` (when present) from beside `tokenizer_json` into `dir`.
pub fn copy_tokenizer_files(dir: &Path, tokenizer_json: &Path) -> Result<(), CheckpointError> {
    let tc_src = tokenizer_json.with_file_name("tokenizer_config.json");
    if tc_src.is_file() {
        std::fs::copy(&tc_src, dir.join("tokenizer_config.json")).map_err(|e| io(&tc_src, e))?;
    } else {
        write_json(dir, "tokenizer_config.json", &tokenizer_config_json())?;
    }
    std::fs::copy(tokenizer_json, dir.join("tokenizer.json")).map_err(|e| io(tokenizer_json, e))?;
    // The prompt profile the model was trained with travels with every checkpoint.
    let profile = tokenizer_json.with_file_name("envace.json");
    if profile.is_file() {
        std::fs::copy(&profile, dir.join("envace.json")).map_err(|e| io(&profile, e))?;
    }
    Ok(())
}

/// Save named tensors (moved to the CPU) as `dir/file`.
pub fn save_tensors(
    dir: &Path,
    file: &str,
    tensors: &HashMap<String, Tensor>,
) -> Result<(), CheckpointError> {
    let cpu: HashMap<String, Tensor> = tensors
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.to_device(&Device::Cpu)?)))
        .collect::<candle_core::Result<_>>()
        .map_err(|e| io(dir, e))?;
    let path = dir.join(file);
    Ok(crate::runtime::fixture::save_safetensors(dir, &path, &cpu)?)
}

/// The `generation_config.json` of a checkpoint envace writes: its end-of-turn tokens, greedy.
pub fn generation_config_json(cfg: &DecoderConfig) -> Value {
    serde_json::json!({"eos_token_id": cfg.eos_token_ids, "do_sample": false})
}

/// Write a checkpoint directory atomically.
pub fn save(
    dir: &Path,
    cfg: &DecoderConfig,
    weights: &HashMap<String, Tensor>,
    tokenizer_json: &Path,
    optimizer: Option<&HashMap<String, Tensor>>,
    reference: Option<&HashMap<String, Tensor>>,
    state: &TrainerState,
) -> Result<(), CheckpointError> {
    write_atomically(dir, |tmp| {
        write_json(tmp, "config.json", &cfg.to_hf_json())?;
        write_json(tmp, "generation_config.json", &generation_config_json(cfg))?;
        copy_tokenizer_files(tmp, tokenizer_json)?;
        save_tensors(tmp, "model.safetensors", weights)?;
        if let Some(opt) = optimizer {
            save_tensors(tmp, "optimizer.safetensors", opt)?;
        }
        if let Some(r) = reference {
            save_tensors(tmp, REFERENCE_WEIGHTS, r)?;
        }
        // trainer_state.json is written last: its presence marks a complete checkpoint.
        write_json(
            tmp,
            "trainer_state.json",
            &serde_json::to_value(state).map_err(|e| io(dir, e))?,
        )
    })
}

/// Write a LoRA checkpoint directory atomically: the adapter as PEFT writes it
/// (`adapter_config.json`, `adapter_model.safetensors`), the tokenizer files and prompt profile
/// (so that the directory loads as a model: base + adapter), the adapter's optimizer state and
/// the trainer state. No `config.json`: the base model is named in `adapter_config.json`, and
/// recorded with its hash in `envace_base.json` when known, which loading checks.
pub fn save_adapter(
    dir: &Path,
    cfg: &AdapterConfig,
    adapter: &HashMap<String, Tensor>,
    tokenizer_json: &Path,
    optimizer: Option<&HashMap<String, Tensor>>,
    reference: Option<&HashMap<String, Tensor>>,
    state: &TrainerState,
) -> Result<(), CheckpointError> {
    write_atomically(dir, |tmp| {
        write_json(tmp, ADAPTER_CONFIG, &cfg.to_peft_json())?;
        if let Some(record) = cfg.base_record() {
            write_json(tmp, ADAPTER_BASE, &record)?;
        }
        copy_tokenizer_files(tmp, tokenizer_json)?;
        save_tensors(tmp, ADAPTER_WEIGHTS, adapter)?;
        if let Some(opt) = optimizer {
            save_tensors(tmp, "optimizer.safetensors", opt)?;
        }
        if let Some(r) = reference {
            save_tensors(tmp, REFERENCE_WEIGHTS, r)?;
        }
        write_json(
            tmp,
            "trainer_state.json",
            &serde_json::to_value(state).map_err(|e| io(dir, e))?,
        )
    })
}

/// Save a trainer's model and optimizer with `state` (what SFT and GRPO both write), and the
/// trainable tensors of a KL term's reference when there is one ([`REFERENCE_WEIGHTS`]).
pub fn save_trainer(
    dir: &Path,
    model: &super::model::TrainableModel,
    opt: &super::optim::AdamW,
    tokenizer_json: &Path,
    reference: Option<&HashMap<String, Tensor>>,
    state: &TrainerState,
) -> Result<(), CheckpointError> {
    match &model.lora {
        Some(cfg) => save_adapter(
            dir,
            cfg,
            &model.weights(),
            tokenizer_json,
            Some(&opt.state_tensors()),
            reference,
            state,
        ),
        None => save(
            dir,
            &model.decoder.cfg,
            &model.weights(),
            tokenizer_json,
            Some(&opt.state_tensors()),
            reference,
            state,
        ),
    }
}

/// A checkpoint read back for resuming.
#[derive(Debug)]
pub struct Loaded {
    pub dir: PathBuf,
    pub state: TrainerState,
    pub optimizer: HashMap<String, Tensor>,
    /// The KL reference's trainable tensors by name ([`REFERENCE_WEIGHTS`]), when the run had
    /// one; `None` also for checkpoints written before they were saved.
    pub reference: Option<HashMap<String, Tensor>>,
}

/// The checkpoint a `--resume` path names: the path itself when it is a checkpoint (it holds
/// `trainer_state.json`), else, for a run directory (what `--out` wrote), its latest complete
/// checkpoint: `final` when the run finished, otherwise the `checkpoint-N` with the largest N.
/// Checkpoints are renamed into place whole, so every such directory is complete.
pub fn resolve_checkpoint(path: &Path) -> Result<std::path::PathBuf, CheckpointError> {
    if path.join("trainer_state.json").is_file() {
        return Ok(path.to_path_buf());
    }
    let missing = |m: String| CheckpointError::Corrupt {
        path: path.display().to_string(),
        message: m,
    };
    if !path.is_dir() {
        return Err(missing("no such checkpoint or run directory".into()));
    }
    let fin = path.join("final");
    if fin.join("trainer_state.json").is_file() {
        return Ok(fin);
    }
    let entries = std::fs::read_dir(path).map_err(|e| io(path, e))?;
    let latest = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let step: usize = name.strip_prefix("checkpoint-")?.parse().ok()?;
            e.path()
                .join("trainer_state.json")
                .is_file()
                .then(|| (step, e.path()))
        })
        .max_by_key(|(step, _)| *step);
    latest.map(|(_, p)| p).ok_or_else(|| {
        missing(
            "trainer_state.json is missing and the directory holds no `final` or \
             `checkpoint-N` checkpoint (was the checkpoint interrupted?)"
                .into(),
        )
    })
}

/// Read and validate a checkpoint for resuming.
pub fn load_for_resume(dir: &Path, device: &Device) -> Result<Loaded, CheckpointError> {
    let corrupt = |m: String| CheckpointError::Corrupt {
        path: dir.display().to_string(),
        message: m,
    };
    let st = dir.join("trainer_state.json");
    if !st.is_file() {
        return Err(corrupt(
            "trainer_state.json is missing (was the checkpoint interrupted?)".into(),
        ));
    }
    let text = std::fs::read_to_string(&st).map_err(|e| io(&st, e))?;
    let state: TrainerState =
        serde_json::from_str(&text).map_err(|e| corrupt(format!("trainer_state.json: {e}")))?;
    // A LoRA checkpoint holds an adapter instead of a model.
    let (files, weights) = if dir.join(ADAPTER_CONFIG).is_file() {
        (
            [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "tokenizer.json"],
            ADAPTER_WEIGHTS,
        )
    } else {
        (
            ["config.json", "model.safetensors", "tokenizer.json"],
            "model.safetensors",
        )
    };
    for f in files {
        if !dir.join(f).is_file() {
            return Err(corrupt(format!("{f} is missing")));
        }
    }
    let bytes = std::fs::read(dir.join(weights)).map_err(|e| io(dir, e))?;
    candle_core::safetensors::load_buffer(&bytes, &Device::Cpu)
        .map_err(|e| corrupt(format!("{weights}: {e}")))?;
    let op = dir.join("optimizer.safetensors");
    let optimizer = if op.is_file() {
        let bytes = std::fs::read(&op).map_err(|e| io(&op, e))?;
        candle_core::safetensors::load_buffer(&bytes, device)
            .map_err(|e| corrupt(format!("optimizer.safetensors: {e}")))?
    } else {
        HashMap::new()
    };
    let rp = dir.join(REFERENCE_WEIGHTS);
    let reference = if rp.is_file() {
        let bytes = std::fs::read(&rp).map_err(|e| io(&rp, e))?;
        Some(
            candle_core::safetensors::load_buffer(&bytes, device)
                .map_err(|e| corrupt(format!("{REFERENCE_WEIGHTS}: {e}")))?,
        )
    } else {
        None
    };
    Ok(Loaded {
        dir: dir.to_path_buf(),
        state,
        optimizer,
        reference,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn saved_tensors_are_as_readable_as_the_files_beside_them() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        let t = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let tensors = HashMap::from([("w".to_string(), t)]);
        save_tensors(&dir, "model.safetensors", &tensors).unwrap();
        let mode = |f: &str| std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode("model.safetensors"), mode("config.json"));
        let back =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        assert_eq!(back["w"].dims(), &[2, 3]);
        // A file that cannot be written: the error names it.
        let missing = root.path().join("missing").join("model.safetensors");
        let err = save_tensors(&root.path().join("missing"), "model.safetensors", &tensors)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with(&missing.display().to_string()), "{err}");
    }
}
