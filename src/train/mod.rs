//! Training: the bundled model's tokenizer and supervised pretraining, role-wise GRPO on
//! world-rehearsal rollouts, SFT on collected sessions, full fine-tuning or LoRA, checkpoints
//! and the metrics seam. Headless by design: the TUI's training tab drives the same code
//! through [`metrics::MetricsSink`].

pub mod bench;
pub mod checkpoint;
pub mod copymask;
pub mod data;
pub mod grpo;
pub mod lora;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod pretrain;
pub mod sft;
pub mod tokenizer;

/// Tool drills are part of the pretraining corpus; `train::tool_drill` stays their public path.
pub use pretrain::corpus::tool_drill;

/// Training failures.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("data: {0}")]
    Data(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error(transparent)]
    CheckpointIo(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
