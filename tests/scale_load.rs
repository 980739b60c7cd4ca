//! The load-back side of docs/SCALE.md: what verl / the EnvACE reference save after training on a
//! GPU node (an HF checkpoint: bf16 weights split over safetensors shards with
//! `model.safetensors.index.json`, `torch_dtype: bfloat16`) loads into the workbench like any
//! local model. The test writes such a checkpoint from a tiny seeded model and checks that its
//! logits equal those of the same weights rounded to bf16 and stored whole in f32 (the loader
//! upcasts on CPU), and that the CLI generates from it.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use envace::runtime::LocalModel;
use envace::runtime::config::Family;
use envace::runtime::decoder::{LogitsAt, Pass};
use envace::runtime::fixture::{
    byte_level_tokenizer_json, random_weights, tiny_config, write_checkpoint,
};
use serde_json::json;

/// Split `weights` (as bf16) over two shards the way `save_pretrained` does: an index naming
/// each tensor's shard, `metadata.total_size` in bytes.
fn write_sharded_bf16(dir: &Path, weights: &HashMap<String, Tensor>) {
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let mut shards: [HashMap<String, Tensor>; 2] = [HashMap::new(), HashMap::new()];
    let mut map = serde_json::Map::new();
    let mut total = 0usize;
    for (i, name) in names.iter().enumerate() {
        let t = weights[*name].to_dtype(DType::BF16).unwrap();
        total += t.elem_count() * 2;
        let k = usize::from(i >= names.len() / 2);
        map.insert(
            (*name).clone(),
            json!(format!("model-{:05}-of-00002.safetensors", k + 1)),
        );
        shards[k].insert((*name).clone(), t);
    }
    for (k, shard) in shards.iter().enumerate() {
        candle_core::safetensors::save(
            shard,
            dir.join(format!("model-{:05}-of-00002.safetensors", k + 1)),
        )
        .unwrap();
    }
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string_pretty(
            &json!({"metadata": {"total_size": total}, "weight_map": map}),
        )
        .unwrap(),
    )
    .unwrap();
}

fn last_logits(m: &LocalModel, ids: &[u32]) -> Vec<f32> {
    let t = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
    let mut cache = m.decoder.new_cache();
    m.decoder
        .forward(&t, &mut cache, Pass::Infer, LogitsAt::Last)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn a_sharded_bf16_checkpoint_loads_back_and_matches_its_weights() {
    for family in [Family::Llama, Family::Qwen2, Family::Qwen3] {
        let cfg = tiny_config(family);
        let w = random_weights(&cfg, 7, 0.15).unwrap();
        let tok = byte_level_tokenizer_json(&[]);
        let root = tempfile::tempdir().unwrap();
        // The reference: the same weights rounded to bf16, stored whole in f32.
        let rounded: HashMap<String, Tensor> = w
            .iter()
            .map(|(k, v)| {
                let r = v
                    .to_dtype(DType::BF16)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                (k.clone(), r)
            })
            .collect();
        let whole = root.path().join("whole");
        write_checkpoint(&whole, &cfg, &rounded, &tok).unwrap();
        // What a GPU run saves: bf16 shards + index, torch_dtype bfloat16.
        let sharded = root.path().join("sharded");
        write_checkpoint(&sharded, &cfg, &rounded, &tok).unwrap();
        std::fs::remove_file(sharded.join("model.safetensors")).unwrap();
        write_sharded_bf16(&sharded, &w);
        let cfg_path = sharded.join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
        c["torch_dtype"] = json!("bfloat16");
        std::fs::write(&cfg_path, c.to_string()).unwrap();

        let a = LocalModel::load_on(&whole, &Device::Cpu, None).unwrap();
        let b = LocalModel::load_on(&sharded, &Device::Cpu, None).unwrap();
        let ids: Vec<u32> = (0..19u32).map(|i| (i * 41 + 3) % 256).collect();
        let (la, lb) = (last_logits(&a, &ids), last_logits(&b, &ids));
        assert_eq!(la.len(), lb.len());
        let d = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(d < 1e-5, "{family:?}: max abs logit diff {d}");

        // The CLI path: generate from the sharded checkpoint.
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_envace"))
            .args(["generate", "--model"])
            .arg(&sharded)
            .args(["--prompt", "hi", "--max-tokens", "4", "--json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(v["tokens"].as_u64().unwrap() > 0, "{v}");
    }
}
