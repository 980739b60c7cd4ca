//! AdamW with decoupled weight decay, global-norm gradient clipping and a warmup + cosine
//! schedule. Our own (not candle_nn's) so that its moments can be checkpointed and restored
//! bit-for-bit. f32 CPU parameters are updated by one fused pass each (`runtime::fused`),
//! their moments kept as flat vectors; otherwise (or with `ENVACE_SLOW_OPS=1`) by tensor ops.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::runtime::fused::{self, AdamWStep, Kernels};
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

/// One parameter's first and second moments: tensors (the tensor-op path) or flat vectors that
/// the fused kernel updates in place. Converted on demand when the path changes.
#[derive(Debug)]
enum Moments {
    Tensors { m: Tensor, v: Tensor },
    Host { m: Vec<f32>, v: Vec<f32> },
}

impl Moments {
    fn zeros(p: &Tensor) -> Result<Self> {
        if Kernels::current() == Kernels::Fused && p.dtype() == DType::F32 && p.device().is_cpu() {
            let n = p.elem_count();
            return Ok(Self::Host {
                m: vec![0.0; n],
                v: vec![0.0; n],
            });
        }
        Ok(Self::Tensors {
            m: p.zeros_like()?,
            v: p.zeros_like()?,
        })
    }

    /// As tensors shaped like `p` (copies of host moments).
    fn to_tensors(&self, p: &Tensor) -> Result<(Tensor, Tensor)> {
        match self {
            Self::Tensors { m, v } => Ok((m.clone(), v.clone())),
            Self::Host { m, v } => Ok((
                Tensor::from_slice(m, p.shape(), p.device())?,
                Tensor::from_slice(v, p.shape(), p.device())?,
            )),
        }
    }

    fn make_tensors(&mut self, p: &Tensor) -> Result<()> {
        if let Self::Host { .. } = self {
            let (m, v) = self.to_tensors(p)?;
            *self = Self::Tensors { m, v };
        }
        Ok(())
    }

    fn make_host(&mut self) -> Result<()> {
        if let Self::Tensors { m, v } = self {
            let flat = |t: &Tensor| t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>();
            *self = Self::Host {
                m: flat(m)?,
                v: flat(v)?,
            };
        }
        Ok(())
    }
}

/// The optimizer over named variables.
#[derive(Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    params: Vec<(String, Var)>,
    moments: Vec<Moments>,
    pub step: usize,
}

impl AdamW {
    /// Parameters are sorted by name so that state files line up across runs.
    pub fn new(mut params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        params.sort_by(|a, b| a.0.cmp(&b.0));
        let moments = params
            .iter()
            .map(|(_, p)| Moments::zeros(p.as_tensor()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg,
            params,
            moments,
            step: 0,
        })
    }

    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Global L2 norm of the gradients of our parameters.
    pub fn grad_norm(&self, grads: &GradStore) -> Result<f64> {
        fused::grad_norm(grads, self.params.iter().map(|(_, p)| p.as_tensor()))
    }

    /// One update at learning rate `lr`; gradients are scaled by `grad_scale` first (clipping,
    /// accumulation). Parameters without a gradient are left alone.
    pub fn step(&mut self, grads: &GradStore, lr: f64, grad_scale: f64) -> Result<()> {
        self.step += 1;
        let (b1, b2) = (self.cfg.beta1, self.cfg.beta2);
        let bc1 = 1.0 - b1.powi(self.step as i32);
        let bc2 = 1.0 - b2.powi(self.step as i32);
        let fused_step = AdamWStep {
            lr: lr as f32,
            beta1: b1 as f32,
            beta2: b2 as f32,
            eps: self.cfg.eps as f32,
            weight_decay: self.cfg.weight_decay as f32,
            bc1: bc1 as f32,
            bc2: bc2 as f32,
            grad_scale: grad_scale as f32,
        };
        for (i, (_, p)) in self.params.iter().enumerate() {
            let Some(g) = grads.get(p.as_tensor()) else {
                continue;
            };
            let moments = &mut self.moments[i];
            if fused::fused_adamw_for(p.as_tensor(), g) {
                moments.make_host()?;
                if let Moments::Host { m, v } = moments {
                    fused::adamw_update(p.as_tensor(), g, m, v, fused_step)?;
                }
                continue;
            }
            moments.make_tensors(p.as_tensor())?;
            let Moments::Tensors {
                m: m_prev,
                v: v_prev,
            } = moments
            else {
                continue;
            };
            let g = if grad_scale != 1.0 {
                (g * grad_scale)?
            } else {
                g.clone()
            };
            let m = ((&*m_prev * b1)? + (&g * (1.0 - b1))?)?;
            let v = ((&*v_prev * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let m_hat = (&m / bc1)?;
            let v_hat = (&v / bc2)?;
            let update = (m_hat / (v_hat.sqrt()? + self.cfg.eps)?)?;
            let decayed = (p.as_tensor() * (1.0 - lr * self.cfg.weight_decay))?;
            p.set(&(decayed - (update * lr)?)?)?;
            *m_prev = m;
            *v_prev = v;
        }
        Ok(())
    }

    /// Moments by parameter name (`m.NAME`, `v.NAME`) for checkpoints.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for ((name, p), moments) in self.params.iter().zip(&self.moments) {
            // Host moments are copied into tensors; a failure there (out of memory) leaves the
            // entry out, which `load_state` reports by name.
            if let Ok((m, v)) = moments.to_tensors(p.as_tensor()) {
                out.insert(format!("m.{name}"), m);
                out.insert(format!("v.{name}"), v);
            }
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
            self.moments[i] = Moments::Tensors {
                m: m.to_device(p.as_tensor().device())
                    .map_err(|e| e.to_string())?,
                v: v.to_device(p.as_tensor().device())
                    .map_err(|e| e.to_string())?,
            };
        }
        self.step = step;
        Ok(())
    }
}
