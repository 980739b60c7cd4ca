//! Writes small seeded checkpoints in HF format (config.json, model.safetensors, tokenizer.json,
//! tokenizer_config.json, generation_config.json) for every supported family. Tests load them
//! next to candle-transformers' stock models; the pretrainer starts from the same layout.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use super::backend::RuntimeError;
use super::chat_template::CHATML_TOOLS_TEMPLATE;
use super::config::{DecoderConfig, Family};

/// Special tokens every model this project makes carries (ChatML).
pub const SPECIAL_TOKENS: &[&str] = &["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// GPT-2's byte → printable-char map used by byte-level BPE.
pub fn byte_to_char() -> Vec<char> {
    let mut bs: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = vec![' '; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        out[b as usize] = char::from_u32(c).unwrap_or(' ');
    }
    out
}

/// A byte-level BPE `tokenizer.json` value: the 256 byte tokens, then `merges` (each adds the
/// concatenated token), then the special tokens.
pub fn byte_level_tokenizer_json(merges: &[(String, String)]) -> Value {
    let mut vocab = serde_json::Map::new();
    let b2c = byte_to_char();
    for c in &b2c {
        let id = vocab.len();
        vocab.insert(c.to_string(), json!(id));
    }
    for (a, b) in merges {
        let t = format!("{a}{b}");
        if !vocab.contains_key(&t) {
            let id = vocab.len();
            vocab.insert(t, json!(id));
        }
    }
    let base = vocab.len();
    let added: Vec<Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": base + i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let merges: Vec<Value> = merges.iter().map(|(a, b)| json!([a, b])).collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges}
    })
}

/// `tokenizer_config.json` with the ChatML tools template.
pub fn tokenizer_config_json() -> Value {
    tokenizer_config_with(CHATML_TOOLS_TEMPLATE)
}

/// `tokenizer_config.json` with a given chat template.
pub fn tokenizer_config_with(template: &str) -> Value {
    json!({
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": template,
    })
}

/// A small config of a family (vocab = 256 bytes + 3 specials, rounded up).
pub fn tiny_config(family: Family) -> DecoderConfig {
    DecoderConfig {
        family,
        vocab_size: 264,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 1024,
        tie_word_embeddings: family == Family::Qwen3,
        qkv_bias: family == Family::Qwen2,
        qk_norm: family == Family::Qwen3,
        rope_interleaved: false,
        bos_token_id: None,
        eos_token_ids: vec![258],
    }
}

/// Seeded random weights with HF names for `cfg`.
pub fn random_weights(
    cfg: &DecoderConfig,
    seed: u64,
    std: f32,
) -> Result<HashMap<String, Tensor>, RuntimeError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = HashMap::new();
    let mut put =
        |name: String, shape: &[usize], center: f32, scale: f32| -> Result<(), RuntimeError> {
            let n: usize = shape.iter().product();
            // Uniform with the requested standard deviation.
            let a = scale * 3f32.sqrt();
            let data: Vec<f32> = (0..n).map(|_| center + rng.random_range(-a..a)).collect();
            out.insert(name, Tensor::from_vec(data, shape, &Device::Cpu)?);
            Ok(())
        };
    let h = cfg.hidden_size;
    let (q, kv, im) = (
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
        cfg.intermediate_size,
    );
    put(
        "model.embed_tokens.weight".into(),
        &[cfg.vocab_size, h],
        0.0,
        std * 4.0,
    )?;
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        put(format!("{p}.input_layernorm.weight"), &[h], 1.0, 0.1)?;
        put(
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            1.0,
            0.1,
        )?;
        put(format!("{p}.self_attn.q_proj.weight"), &[q, h], 0.0, std)?;
        put(format!("{p}.self_attn.k_proj.weight"), &[kv, h], 0.0, std)?;
        put(format!("{p}.self_attn.v_proj.weight"), &[kv, h], 0.0, std)?;
        put(format!("{p}.self_attn.o_proj.weight"), &[h, q], 0.0, std)?;
        if cfg.qkv_bias {
            put(format!("{p}.self_attn.q_proj.bias"), &[q], 0.0, std)?;
            put(format!("{p}.self_attn.k_proj.bias"), &[kv], 0.0, std)?;
            put(format!("{p}.self_attn.v_proj.bias"), &[kv], 0.0, std)?;
        }
        if cfg.qk_norm {
            put(
                format!("{p}.self_attn.q_norm.weight"),
                &[cfg.head_dim],
                1.0,
                0.1,
            )?;
            put(
                format!("{p}.self_attn.k_norm.weight"),
                &[cfg.head_dim],
                1.0,
                0.1,
            )?;
        }
        put(format!("{p}.mlp.gate_proj.weight"), &[im, h], 0.0, std)?;
        put(format!("{p}.mlp.up_proj.weight"), &[im, h], 0.0, std)?;
        put(format!("{p}.mlp.down_proj.weight"), &[h, im], 0.0, std)?;
    }
    put("model.norm.weight".into(), &[h], 1.0, 0.1)?;
    if !cfg.tie_word_embeddings {
        put("lm_head.weight".into(), &[cfg.vocab_size, h], 0.0, std)?;
    }
    Ok(out)
}

fn write_json(path: &Path, v: &Value) -> Result<(), RuntimeError> {
    let text = serde_json::to_string_pretty(v).map_err(|e| RuntimeError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    std::fs::write(path, text).map_err(|e| RuntimeError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// Write a complete HF checkpoint directory (weights given).
pub fn write_checkpoint(
    dir: &Path,
    cfg: &DecoderConfig,
    weights: &HashMap<String, Tensor>,
    tokenizer_json: &Value,
) -> Result<(), RuntimeError> {
    std::fs::create_dir_all(dir).map_err(|e| RuntimeError::File {
        path: dir.display().to_string(),
        message: e.to_string(),
    })?;
    write_json(&dir.join("config.json"), &cfg.to_hf_json())?;
    write_json(&dir.join("tokenizer.json"), tokenizer_json)?;
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config_json())?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({"eos_token_id": cfg.eos_token_ids, "do_sample": false}),
    )?;
    let path = dir.join("model.safetensors");
    let tmp = dir.join("model.safetensors.tmp");
    save_safetensors(dir, &tmp, weights)?;
    std::fs::rename(&tmp, &path).map_err(|e| RuntimeError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// Save `tensors` to `path` (a file in `dir`) as safetensors, as readable as the files beside
/// it. The safetensors crate writes through a private temporary file (mode 0600), so a saved
/// checkpoint was readable by its owner only, unlike the JSON files next to it; the file gets
/// the mode a new file in `dir` gets: the directory's (`0777 & !umask`) without execute bits.
/// Every safetensors file envace writes goes through here.
pub fn save_safetensors(
    dir: &Path,
    path: &Path,
    tensors: &HashMap<String, Tensor>,
) -> Result<(), RuntimeError> {
    let file_error = |path: &Path, e: &dyn std::fmt::Display| RuntimeError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    candle_core::safetensors::save(tensors, path).map_err(|e| file_error(path, &e))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir)
            .map_err(|e| file_error(dir, &e))?
            .permissions()
            .mode()
            & 0o666;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| file_error(path, &e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// A tiny seeded checkpoint of `family` (byte-level tokenizer, ChatML template).
pub fn write_tiny_checkpoint(
    dir: &Path,
    family: Family,
    seed: u64,
) -> Result<DecoderConfig, RuntimeError> {
    let cfg = tiny_config(family);
    let w = random_weights(&cfg, seed, 0.15)?;
    write_checkpoint(dir, &cfg, &w, &byte_level_tokenizer_json(&[]))?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn a_written_checkpoints_weights_are_as_readable_as_its_json_files() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("tiny");
        write_tiny_checkpoint(&dir, Family::Llama, 0).unwrap();
        let mode = |f: &str| std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode("model.safetensors"), mode("config.json"));
        assert!(!dir.join("model.safetensors.tmp").exists());
    }
}
