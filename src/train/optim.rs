//! AdamW with decoupled weight decay, global-norm gradient clipping and a warmup + cosine
//! schedule. Our own (not candle_nn's) so that its moments can be checkpointed and restored
//! bit-for-bit.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

type Result<T> = candle_core::Result<T>;

/// Hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Learning rate at `step` (0-based): linear warmup, then cosine decay to `min_ratio · lr`.
pub fn schedule(lr: f64, step: usize, warmup: usize, total: usize, min_ratio: f64) -> f64 {
    if warmup > 0 && step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1);
    let t = ((step.saturating_sub(warmup)) as f64 / span as f64).min(1.0);
    let cos = 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
    lr * (min_ratio + (1.0 - min_ratio) * cos)
}

/// The optimizer over named variables.
#[derive(Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    params: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    pub step: usize,
}

impl AdamW {
    /// Parameters are sorted by name so that state files line up across runs.
    pub fn new(mut params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let m = params
            .iter()
            .map(|(_, p)| p.as_tensor().zeros_like())
            .collect::<Result<Vec<_>>>()?;
        let v = params
            .iter()
            .map(|(_, p)| p.as_tensor().zeros_like())
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg,
            params,
            m,
            v,
            step: 0,
        })
    }

    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Global L2 norm of the gradients of our parameters.
    pub fn grad_norm(&self, grads: &GradStore) -> Result<f64> {
        let mut sq = 0f64;
        for (_, p) in &self.params {
            if let Some(g) = grads.get(p.as_tensor()) {
                sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
            }
        }
        Ok(sq.sqrt())
    }

    /// One update at learning rate `lr`; gradients are scaled by `grad_scale` first (clipping,
    /// accumulation). Parameters without a gradient are left alone.
    pub fn step(&mut self, grads: &GradStore, lr: f64, grad_scale: f64) -> Result<()> {
        self.step += 1;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let bc1 = 1.0 - b1.powi(self.step as i32);
        let bc2 = 1.0 - b2.powi(self.step as i32);
        for (i, (_, p)) in self.params.iter().enumerate() {
            let Some(g) = grads.get(p.as_tensor()) else {
                continue;
            };
            let g = if grad_scale != 1.0 {
                (g * grad_scale)?
            } else {
                g.clone()
            };
            let m = ((&self.m[i] * b1)? + (&g * (1.0 - b1))?)?;
            let v = ((&self.v[i] * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let m_hat = (&m / bc1)?;
            let v_hat = (&v / bc2)?;
            let update = (m_hat / (v_hat.sqrt()? + self.cfg.eps)?)?;
            let decayed = (p.as_tensor() * (1.0 - lr * self.cfg.weight_decay))?;
            p.set(&(decayed - (update * lr)?)?)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(())
    }

    /// Moments by parameter name (`m.NAME`, `v.NAME`) for checkpoints.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.params.iter().enumerate() {
            out.insert(format!("m.{name}"), self.m[i].clone());
            out.insert(format!("v.{name}"), self.v[i].clone());
        }
        out
    }

    /// Restore moments saved by [`AdamW::state_tensors`].
    pub fn load_state(
        &mut self,
        state: &HashMap<String, Tensor>,
        step: usize,
    ) -> std::result::Result<(), String> {
        for (i, (name, p)) in self.params.iter().enumerate() {
            let m = state
                .get(&format!("m.{name}"))
                .ok_or_else(|| format!("optimizer state lacks m.{name}"))?;
            let v = state
                .get(&format!("v.{name}"))
                .ok_or_else(|| format!("optimizer state lacks v.{name}"))?;
            if m.dims() != p.as_tensor().dims() || v.dims() != p.as_tensor().dims() {
                return Err(format!("optimizer state for {name} has the wrong shape"));
            }
            self.m[i] = m
                .to_device(p.as_tensor().device())
                .map_err(|e| e.to_string())?;
            self.v[i] = v
                .to_device(p.as_tensor().device())
                .map_err(|e| e.to_string())?;
        }
        self.step = step;
        Ok(())
    }
}
