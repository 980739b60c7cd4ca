//! Helpers for the runtime's unit tests (compiled only for `cargo test`). The integration tests
//! keep their own copy in tests/common/mod.rs: a test crate cannot see `cfg(test)` items.

// Tests may unwrap: a panic is the failure report.
#![allow(clippy::unwrap_used)]

use candle_core::Tensor;

/// The largest absolute difference between two tensors of one shape (f32).
pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
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
