//! The activation buffer pool: device buffers by exact length, taken and
//! given back within a step so a steady run allocates nothing. A separate
//! concern from the expert slots beside it (it only shares the pool's
//! "reuse device memory" idea), so it lives in its own file.

use std::collections::HashMap;

use pulsar_cuda::{CudaDevice, DeviceBuf, Pod};

use super::super::CudaBackendError;

/// Device buffers by length, handed out during a step and returned after it.
pub struct BufPool<T: Pod> {
    free: HashMap<usize, Vec<DeviceBuf<T>>>,
    pub allocations: u64,
    /// Bytes of every buffer this pool allocated (in use or free): its share
    /// of device memory.
    pub held_bytes: u64,
    /// Set when an allocation freed the idle buffers to make room: a captured
    /// graph may hold their addresses (see [`BufPool::take_trimmed`]).
    trimmed: bool,
}

impl<T: Pod> Default for BufPool<T> {
    fn default() -> Self {
        BufPool { free: HashMap::new(), allocations: 0, held_bytes: 0, trimmed: false }
    }
}

impl<T: Pod> BufPool<T> {
    pub fn take(&mut self, dev: &CudaDevice, len: usize) -> Result<DeviceBuf<T>, CudaBackendError> {
        if let Some(b) = self.free.get_mut(&len).and_then(Vec::pop) {
            return Ok(b);
        }
        let b = match dev.alloc::<T>(len) {
            Ok(b) => b,
            // Buffers are kept by exact length, and a long prefill's attention
            // scratch grows with every chunk: out of memory with idle buffers
            // of other lengths, free them and try again.
            Err(e) if is_oom(&e) && self.free.values().any(|v| !v.is_empty()) => {
                // Queued kernels may still read a buffer given back this step.
                dev.sync()?;
                self.trim();
                dev.alloc::<T>(len)?
            }
            Err(e) => return Err(e.into()),
        };
        self.allocations += 1;
        self.held_bytes += (len * std::mem::size_of::<T>()) as u64;
        Ok(b)
    }
    pub fn give(&mut self, b: DeviceBuf<T>) {
        self.free.entry(b.len()).or_default().push(b);
    }
    /// Free every idle buffer.
    fn trim(&mut self) {
        for (len, v) in self.free.drain() {
            self.held_bytes -= (len * std::mem::size_of::<T>() * v.len()) as u64;
        }
        self.trimmed = true;
    }
    /// Whether idle buffers were freed since the last call (then a captured
    /// graph must not replay: some of its addresses are gone).
    pub fn take_trimmed(&mut self) -> bool {
        std::mem::take(&mut self.trimmed)
    }
}

fn is_oom(e: &pulsar_cuda::CudaError) -> bool {
    matches!(e, pulsar_cuda::CudaError::Driver(d) if d.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)
}
