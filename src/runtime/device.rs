//! Device and dtype choice: `auto` picks CUDA or Metal when the binary was built with that
//! feature and a device is present, else the CPU. bf16 weights run as f32 on the CPU.

use std::str::FromStr;

use candle_core::{DType, Device};

use super::backend::RuntimeError;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Auto,
    Cpu,
    Cuda,
    Metal,
}

impl FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            "metal" => Ok(Self::Metal),
            other => Err(format!("unknown device `{other}` (auto, cpu, cuda, metal)")),
        }
    }
}

impl DeviceChoice {
    pub fn open(self) -> Result<Device, RuntimeError> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(RuntimeError::Device(
                        "CUDA requested but this build has no CUDA support or no GPU is visible (build with --features cuda)".into(),
                    ));
                }
                Device::new_cuda(0).map_err(|e| RuntimeError::Device(e.to_string()))
            }
            Self::Metal => {
                if !candle_core::utils::metal_is_available() {
                    return Err(RuntimeError::Device(
                        "Metal requested but this build has no Metal support (build with --features metal)".into(),
                    ));
                }
                Device::new_metal(0).map_err(|e| RuntimeError::Device(e.to_string()))
            }
            Self::Auto => {
                if candle_core::utils::cuda_is_available() {
                    Self::Cuda.open()
                } else if candle_core::utils::metal_is_available() {
                    Self::Metal.open()
                } else {
                    Ok(Device::Cpu)
                }
            }
        }
    }
}

/// The compute dtype for a device: f32 on the CPU, bf16 on CUDA, f16 on Metal.
pub fn default_dtype(device: &Device) -> DType {
    match device {
        Device::Cpu => DType::F32,
        Device::Cuda(_) => DType::BF16,
        Device::Metal(_) => DType::F16,
    }
}

pub fn describe(device: &Device) -> String {
    match device {
        Device::Cpu => format!("cpu ({} threads)", candle_core::utils::get_num_threads()),
        Device::Cuda(_) => "cuda:0".into(),
        Device::Metal(_) => "metal:0".into(),
    }
}
