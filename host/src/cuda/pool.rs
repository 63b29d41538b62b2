//! VRAM pools: reusable activation buffers, and the expert-slot hot set.

use std::collections::HashMap;

use pulsar_cuda::{CudaDevice, DeviceBuf, Pod};

use super::CudaBackendError;

/// Device buffers by length, handed out during a step and returned after it.
pub struct BufPool<T: Pod> {
    free: HashMap<usize, Vec<DeviceBuf<T>>>,
    pub allocations: u64,
}

impl<T: Pod> Default for BufPool<T> {
    fn default() -> Self {
        BufPool { free: HashMap::new(), allocations: 0 }
    }
}

impl<T: Pod> BufPool<T> {
    pub fn take(&mut self, dev: &CudaDevice, len: usize) -> Result<DeviceBuf<T>, CudaBackendError> {
        if let Some(b) = self.free.get_mut(&len).and_then(Vec::pop) {
            return Ok(b);
        }
        self.allocations += 1;
        Ok(dev.alloc::<T>(len)?)
    }
    pub fn give(&mut self, b: DeviceBuf<T>) {
        self.free.entry(b.len()).or_default().push(b);
    }
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct PoolStats {
    pub slots: usize,
    pub slot_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    pub uploaded_bytes: u64,
    pub upload_seconds: f64,
}

/// A fixed pool of expert slabs in VRAM. A slab keeps its slot until a miss
/// needs room; the victim is the least recently used slot not needed by the
/// step in progress.
pub struct ExpertPool {
    slots: DeviceBuf<u8>,
    slot_bytes: usize,
    map: HashMap<(usize, u32), usize>,
    owner: Vec<Option<(usize, u32)>>,
    last_use: Vec<u64>,
    /// The step a slot was last used by: never evicted within that step.
    step_of: Vec<u64>,
    clock: u64,
    step: u64,
    pub stats: PoolStats,
}

impl ExpertPool {
    pub fn new(dev: &CudaDevice, slot_bytes: usize, n_slots: usize) -> Result<ExpertPool, CudaBackendError> {
        if n_slots == 0 {
            return Err(CudaBackendError::Other("the VRAM budget leaves no room for a single expert slab".into()));
        }
        Ok(ExpertPool {
            slots: dev.alloc::<u8>(slot_bytes * n_slots)?,
            slot_bytes,
            map: HashMap::new(),
            owner: vec![None; n_slots],
            last_use: vec![0; n_slots],
            step_of: vec![u64::MAX; n_slots],
            clock: 0,
            step: 0,
            stats: PoolStats { slots: n_slots, slot_bytes, ..Default::default() },
        })
    }

    /// Start a step: slots used from now on are pinned until the next call.
    pub fn begin_step(&mut self) {
        self.step += 1;
    }

    /// The device address of `(tensor, expert)`'s slab, uploading `bytes` on a miss.
    pub fn get(&mut self, dev: &CudaDevice, key: (usize, u32), bytes: &[u8]) -> Result<u64, CudaBackendError> {
        self.clock += 1;
        if let Some(&s) = self.map.get(&key) {
            self.stats.hits += 1;
            self.last_use[s] = self.clock;
            self.step_of[s] = self.step;
            return self.slots.device_ptr_at(s * self.slot_bytes).map_err(Into::into);
        }
        if bytes.len() > self.slot_bytes {
            return Err(CudaBackendError::Other(format!("expert slab of {} bytes exceeds the slot size {}", bytes.len(), self.slot_bytes)));
        }
        let victim = (0..self.owner.len())
            .filter(|&s| self.step_of[s] != self.step)
            .min_by_key(|&s| (self.owner[s].is_some(), self.last_use[s]))
            .ok_or_else(|| {
                CudaBackendError::Other(format!(
                    "the VRAM expert pool ({} slots) cannot hold one step's experts; raise --vram-budget or lower --ubatch",
                    self.owner.len()
                ))
            })?;
        if let Some(old) = self.owner[victim].take() {
            self.map.remove(&old);
        }
        let ptr = self.slots.device_ptr_at(victim * self.slot_bytes)?;
        let t = std::time::Instant::now();
        dev.context().bind_to_thread().map_err(pulsar_cuda::CudaError::from)?;
        // SAFETY: the slot holds `slot_bytes >= bytes.len()` bytes; a pageable
        // copy completes before the call returns, so `bytes` may go away after.
        unsafe { cudarc::driver::result::memcpy_htod_sync(ptr, bytes) }.map_err(pulsar_cuda::CudaError::from)?;
        self.stats.upload_seconds += t.elapsed().as_secs_f64();
        self.stats.misses += 1;
        self.stats.uploaded_bytes += bytes.len() as u64;
        self.owner[victim] = Some(key);
        self.map.insert(key, victim);
        self.last_use[victim] = self.clock;
        self.step_of[victim] = self.step;
        Ok(ptr)
    }
}
