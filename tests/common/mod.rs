//! Helpers shared by the integration test crates that load the SmolLM2 fixture: one place that
//! names the fixture's path and fails with what to run when it is missing, and one tensor
//! comparison. Each crate compiles this module on its own and uses part of it.

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
