//! Helpers shared by integration test crates: the SmolLM2 fixture's and the bundled model's
//! paths (failing with what to run when missing), reading a safetensors file, one tensor
//! comparison, and running the release binary. Each crate
//! compiles this module on its own and uses part of it. (The library's unit tests have their
//! own `max_abs_diff` in src/runtime/test_util.rs: a test crate cannot see `cfg(test)` items.)

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used, dead_code)]

use std::path::PathBuf;

use candle_core::Tensor;

/// The SmolLM2-135M-Instruct Q4_1 GGUF that scripts/fetch-fixtures puts in .cache/models/.
pub fn smollm2_gguf() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "fixture {} is missing: run scripts/fetch-fixtures (scripts/test does)",
        p.display()
    );
    p
}

/// The bundled tiny model (models/envace-tiny, committed).
pub fn bundled() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/envace-tiny");
    assert!(
        p.join("model.safetensors").is_file(),
        "the bundled model is missing"
    );
    p
}

/// A safetensors file's tensors by name, on the CPU.
pub fn file_tensors(path: &std::path::Path) -> std::collections::HashMap<String, Tensor> {
    let bytes = std::fs::read(path).unwrap();
    candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu).unwrap()
}

/// A tensor's values, flattened (f32).
pub fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

/// The largest absolute difference between two tensors of one shape (f32).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Run the envace binary from the repository root (one thread); its output, whatever the exit
/// status.
pub fn envace(args: &[&std::ffi::OsStr]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_envace"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap()
}

/// A command's stdout as JSON, after asserting that it succeeded.
pub fn ok_json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
