//! Every load error names the file and the field or tensor. One fixture (a broken copy of a
//! tiny checkpoint) per error.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::path::Path;

use candle_core::Device;
use envace::runtime::LocalModel;
use envace::runtime::config::Family;
use envace::runtime::fixture::write_tiny_checkpoint;
use serde_json::Value;

fn broken(f: impl FnOnce(&Path)) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_checkpoint(dir.path(), Family::Qwen2, 1).unwrap();
    f(dir.path());
    let err = LocalModel::load_on(dir.path(), &Device::Cpu, None)
        .unwrap_err()
        .to_string();
    (dir, err)
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn missing_config_is_named() {
    let (_d, e) = broken(|d| std::fs::remove_file(d.join("config.json")).unwrap());
    assert!(e.contains("config.json") && e.contains("missing"), "{e}");
}

#[test]
fn missing_weights_are_named() {
    let (_d, e) = broken(|d| std::fs::remove_file(d.join("model.safetensors")).unwrap());
    assert!(
        e.contains("model.safetensors") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn missing_tokenizer_is_named() {
    let (_d, e) = broken(|d| std::fs::remove_file(d.join("tokenizer.json")).unwrap());
    assert!(e.contains("tokenizer.json") && e.contains("missing"), "{e}");
}

#[test]
fn missing_shard_of_a_sharded_checkpoint_is_named() {
    let (_d, e) = broken(|d| {
        std::fs::rename(
            d.join("model.safetensors"),
            d.join("model-00001-of-00002.safetensors"),
        )
        .unwrap();
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
    });
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn unsupported_architecture_lists_the_supported_ones() {
    let (_d, e) = broken(|d| {
        edit_json(&d.join("config.json"), |v| {
            v["architectures"] = serde_json::json!(["GPT2LMHeadModel"])
        })
    });
    assert!(
        e.contains("config.json") && e.contains("GPT2LMHeadModel"),
        "{e}"
    );
    assert!(
        e.contains("LlamaForCausalLM")
            && e.contains("Qwen2ForCausalLM")
            && e.contains("Qwen3ForCausalLM"),
        "{e}"
    );
}

#[test]
fn bad_config_field_is_named() {
    let (_d, e) = broken(|d| {
        edit_json(&d.join("config.json"), |v| {
            v["hidden_size"] = serde_json::json!("big")
        })
    });
    assert!(
        e.contains("config.json") && e.contains("`hidden_size`"),
        "{e}"
    );
}

#[test]
fn tensor_shape_mismatch_reports_expected_and_got() {
    let (_d, e) = broken(|d| {
        edit_json(&d.join("config.json"), |v| {
            v["intermediate_size"] = serde_json::json!(96)
        })
    });
    assert!(
        e.contains("model.safetensors") && e.contains("mlp.gate_proj.weight"),
        "{e}"
    );
    assert!(e.contains("expected [96, 64], got [128, 64]"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let (_d, e) = broken(|d| {
        edit_json(&d.join("config.json"), |v| {
            v["num_hidden_layers"] = serde_json::json!(3)
        })
    });
    assert!(
        e.contains("model.layers.2.") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn truncated_safetensors_is_reported() {
    let (_d, e) = broken(|d| {
        let p = d.join("model.safetensors");
        let bytes = std::fs::read(&p).unwrap();
        std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    });
    assert!(
        e.contains("model.safetensors") && e.contains("truncated or corrupt"),
        "{e}"
    );
}

#[test]
fn tokenizer_vocab_check_names_the_tokenizer_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = envace::runtime::fixture::tiny_config(Family::Llama);
    cfg.vocab_size = 200;
    let w = envace::runtime::fixture::random_weights(&cfg, 1, 0.1).unwrap();
    envace::runtime::fixture::write_checkpoint(
        dir.path(),
        &cfg,
        &w,
        &envace::runtime::fixture::byte_level_tokenizer_json(&[]),
    )
    .unwrap();
    let e = LocalModel::load_on(dir.path(), &Device::Cpu, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tokenizer.json") && e.contains("259 tokens") && e.contains("200 rows"),
        "{e}"
    );
}

#[test]
fn corrupt_gguf_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.gguf");
    std::fs::write(&p, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let e = LocalModel::load_on(&p, &Device::Cpu, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad.gguf") && e.contains("not a valid GGUF"),
        "{e}"
    );
}

#[test]
fn truncated_gguf_is_reported() {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        src.is_file(),
        "fixture {} is missing: run scripts/fetch-fixtures",
        src.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("trunc.gguf");
    let mut f = std::fs::File::open(&src).unwrap();
    let mut buf = vec![0u8; 4 << 20];
    std::io::Read::read_exact(&mut f, &mut buf).unwrap();
    std::fs::write(&p, &buf).unwrap();
    let e = LocalModel::load_on(&p, &Device::Cpu, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("trunc.gguf"), "{e}");
}

#[test]
fn missing_model_path_is_named() {
    let e = LocalModel::load_on(Path::new("/nonexistent/model"), &Device::Cpu, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nonexistent/model") && e.contains("no such file"),
        "{e}"
    );
}
