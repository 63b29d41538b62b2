//! The CUDA backend: executes a plugin's ops on the GPU with the kernels of
//! `pulsar-cuda`, the same op semantics as the CPU backend (each kernel has a
//! CPU twin there).
//!
//! Memory: every resident weight (everything but routed experts) is uploaded
//! once at load. Routed experts are uploaded whole when they fit the VRAM
//! budget; otherwise they stream through a fixed pool of expert slots in VRAM
//! (the hot set: least recently used slot out, the step's own slabs pinned),
//! uploaded from host memory on a miss. Activations come from a pool reused
//! across steps, so after the first step a decode allocates nothing.

mod pool;
mod step;

use std::collections::HashMap;
use std::sync::Mutex;

use pulsar_cuda::{CudaDevice, DeviceBuf};
use pulsar_gguf::GgmlType;
use pulsar_plugin_api::Role;

use crate::model::Model;

pub use pool::{ExpertPool, PoolStats};
pub use step::CudaEngine;

#[derive(Debug, thiserror::Error)]
pub enum CudaBackendError {
    #[error("CUDA: {0}")]
    Cuda(#[from] pulsar_cuda::CudaError),
    #[error("{0}")]
    Other(String),
}

/// A weight on the device.
pub struct DevWeight {
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    /// Raw bytes (None for streamed routed experts).
    pub raw: Option<DeviceBuf<u8>>,
    /// Dequantized f32 values for small vectors (norm weights).
    pub f32: Option<DeviceBuf<f32>>,
}

/// A model's weights on one GPU.
pub struct CudaModel {
    pub dev: CudaDevice,
    pub weights: Vec<DevWeight>,
    /// Some: routed experts stream through this pool.
    pub experts: Option<Mutex<ExpertPool>>,
    pub resident_bytes: u64,
}

/// Free device memory minus a reserve for activations, KV and the driver.
pub fn default_vram_budget(dev: &CudaDevice) -> Result<u64, CudaBackendError> {
    let (free, _total) = dev.memory()?;
    Ok((free as u64).saturating_sub(2 << 30))
}

impl CudaModel {
    /// Upload `model`'s weights. `vram_budget` caps what weights may occupy
    /// (emulating a smaller card); experts beyond it stream.
    pub fn load(dev: CudaDevice, model: &Model, vram_budget: Option<u64>, kv_bytes: u64) -> Result<CudaModel, CudaBackendError> {
        let budget = match vram_budget {
            Some(b) => b,
            None => default_vram_budget(&dev)?,
        };
        let mem = model.memory_plan();
        let fixed = mem.resident_bytes + kv_bytes;
        if fixed > budget {
            return Err(CudaBackendError::Other(format!(
                "the resident weights and KV cache need {:.2} GiB, more than the VRAM budget of {:.2} GiB",
                fixed as f64 / GIB,
                budget as f64 / GIB
            )));
        }
        let stream_experts = mem.expert_bytes > budget - fixed;
        let stream = dev.compute().clone();
        let mut weights = Vec::with_capacity(model.weights.len());
        let mut resident = 0u64;
        for w in &model.weights {
            let expert = w.role == Role::RoutedExpert;
            let raw = if expert && stream_experts {
                None
            } else {
                let bytes = model.data(w);
                let mut b = dev.alloc::<u8>(bytes.len())?;
                b.upload(&stream, bytes)?;
                resident += bytes.len() as u64;
                Some(b)
            };
            let f32 = if w.dims.len() == 1 {
                let mut v = vec![0f32; w.dims[0] as usize];
                pulsar_kernels::dequantize(w.ty, model.data(w), &mut v).map_err(|e| CudaBackendError::Other(format!("{}: {e}", w.name)))?;
                Some(dev.upload(&v)?)
            } else {
                None
            };
            weights.push(DevWeight { ty: w.ty, dims: w.dims.clone(), raw, f32 });
        }
        let experts = if stream_experts {
            let slot_bytes = model
                .weights
                .iter()
                .filter(|w| w.role == Role::RoutedExpert)
                .map(|w| w.bytes / w.dims.get(2).copied().unwrap_or(1).max(1))
                .max()
                .unwrap_or(0);
            let room = budget - fixed;
            let n_slots = (room / slot_bytes.max(1)) as usize;
            Some(Mutex::new(ExpertPool::new(&dev, slot_bytes as usize, n_slots)?))
        } else {
            None
        };
        Ok(CudaModel { dev, weights, experts, resident_bytes: resident })
    }

    pub fn pool_stats(&self) -> Option<PoolStats> {
        self.experts.as_ref().map(|p| p.lock().unwrap_or_else(|e| e.into_inner()).stats.clone())
    }
}

pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// The KV cache on the device: f32 rows, one key and one value buffer per layer.
pub struct CudaKv {
    pub n_ctx: usize,
    pub layers: HashMap<usize, (usize, usize, DeviceBuf<f32>, DeviceBuf<f32>)>,
}

impl CudaKv {
    pub fn new(dev: &CudaDevice, model: &Model, n_ctx: usize) -> Result<CudaKv, CudaBackendError> {
        let mut layers = HashMap::new();
        for k in model.plan.kv.iter() {
            let kw = (k.n_kv_head * k.head_dim_k) as usize;
            let vw = (k.n_kv_head * k.head_dim_v) as usize;
            layers.insert(k.layer as usize, (kw, vw, dev.alloc::<f32>(kw * n_ctx)?, dev.alloc::<f32>(vw * n_ctx)?));
        }
        Ok(CudaKv { n_ctx, layers })
    }

    pub fn bytes_for(model: &Model, n_ctx: usize) -> u64 {
        model.memory_plan().kv_bytes_per_token * n_ctx as u64
    }
}
