//! The seam between the trainer and whoever watches it: the TUI's training tab, a JSONL file,
//! a progress line on stderr. The trainer only calls [`MetricsSink::record`]; it never knows
//! which one listens.

use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

/// One step's numbers (free-form keys so that SFT and GRPO share the seam).
#[derive(Debug, Clone, Serialize)]
pub struct StepMetrics {
    pub phase: String,
    pub step: usize,
    pub values: serde_json::Map<String, Value>,
}

impl StepMetrics {
    pub fn new(phase: &str, step: usize) -> Self {
        Self {
            phase: phase.to_string(),
            step,
            values: serde_json::Map::new(),
        }
    }
    pub fn with(mut self, key: &str, v: impl Into<Value>) -> Self {
        self.values.insert(key.to_string(), v.into());
        self
    }
    pub fn get(&self, key: &str) -> Option<f64> {
        self.values.get(key).and_then(Value::as_f64)
    }
}

/// Receives metrics as training runs.
pub trait MetricsSink: Send {
    fn record(&mut self, m: &StepMetrics);
    /// A human-readable log line.
    fn log(&mut self, _line: &str) {}
}

/// Discards everything.
#[derive(Debug, Default)]
pub struct NullSink;

impl MetricsSink for NullSink {
    fn record(&mut self, _m: &StepMetrics) {}
}

/// Appends one JSON object per step to a file and prints a progress line to stderr.
#[derive(Debug)]
pub struct JsonlSink {
    file: std::fs::File,
    quiet: bool,
}

impl JsonlSink {
    pub fn create(path: &Path, quiet: bool) -> std::io::Result<Self> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self { file, quiet })
    }
}

impl MetricsSink for JsonlSink {
    fn record(&mut self, m: &StepMetrics) {
        if let Ok(line) = serde_json::to_string(m) {
            let _ = writeln!(self.file, "{line}");
            let _ = self.file.flush();
        }
        if !self.quiet {
            let parts: Vec<String> = m
                .values
                .iter()
                .map(|(k, v)| match v.as_f64() {
                    Some(x) if x.fract() != 0.0 => format!("{k}={x:.4}"),
                    _ => format!("{k}={v}"),
                })
                .collect();
            eprintln!("[{} {}] {}", m.phase, m.step, parts.join(" "));
        }
    }
    fn log(&mut self, line: &str) {
        if !self.quiet {
            eprintln!("{line}");
        }
    }
}

/// Collects metrics in memory (tests, the TUI's charts).
#[derive(Debug, Default)]
pub struct MemorySink {
    pub steps: Vec<StepMetrics>,
    pub lines: Vec<String>,
}

impl MetricsSink for MemorySink {
    fn record(&mut self, m: &StepMetrics) {
        self.steps.push(m.clone());
    }
    fn log(&mut self, line: &str) {
        self.lines.push(line.to_string());
    }
}
