//! The CPU lane's stagings in the expert pool: the layer input it reads,
//! the page-locked output it writes, the host flag the compute stream waits
//! on, and the copies that land its rows.

use std::sync::Arc;

use pulsar_cuda::{CudaDevice, DeviceBuf, HostFlag};

use super::super::CudaBackendError;
use super::ExpertPool;

impl ExpertPool {
    /// Queue a copy of `x` (a decode layer's input) to the host on the
    /// compute stream; after the next sync [`lane_input`](Self::lane_input)
    /// has it.
    pub fn stage_lane_input(&mut self, dev: &CudaDevice, x: &DeviceBuf<f32>) -> Result<(), CudaBackendError> {
        if self.lane_input.as_ref().is_none_or(|b| b.len() != x.len()) {
            self.lane_input = Some(dev.alloc_pinned::<f32>(x.len())?);
        }
        x.download_async(dev.compute(), self.lane_input.as_mut().expect("allocated above"))?;
        Ok(())
    }

    /// The input [`stage_lane_input`](Self::stage_lane_input) copied out
    /// (read after the compute stream's sync).
    pub fn lane_input(&self) -> &[f32] {
        self.lane_input.as_ref().map_or(&[], |b| b.as_slice())
    }

    /// Copy `lo` (each pair's first device row) into `dst` on the compute
    /// stream without waiting, through page-locked staging (reused after the
    /// next layer's routing sync).
    pub fn stage_row_lo(&mut self, dev: &CudaDevice, lo: &[i32], dst: &mut DeviceBuf<i32>) -> Result<(), CudaBackendError> {
        if dst.len() != lo.len() {
            return Err(CudaBackendError::Other(format!("{} first rows for a buffer of {}", lo.len(), dst.len())));
        }
        if self.row_lo_stage.as_ref().is_none_or(|b| b.len() < lo.len()) {
            // The old staging may still feed a copy.
            dev.compute().synchronize().map_err(pulsar_cuda::CudaError::from)?;
            self.row_lo_stage = Some(dev.alloc_pinned::<i32>(lo.len().max(64))?);
        }
        let stage = self.row_lo_stage.as_mut().expect("allocated above");
        stage.as_mut_slice()[..lo.len()].copy_from_slice(lo);
        let s = &stage.as_slice()[..lo.len()];
        // SAFETY: i32 has no padding; the view covers exactly `s`.
        let bytes = unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) };
        // SAFETY: `dst` holds `lo.len()` values (checked); the staging is
        // page-locked and not rewritten before the next layer's sync.
        unsafe { pulsar_cuda::copy_to_device_async(dev.compute(), dst.device_ptr(), bytes) }?;
        Ok(())
    }

    /// Let lane jobs run beside the host thread, the compute stream waiting
    /// for their output on a host flag; false where the device cannot wait
    /// on one (jobs then block the host).
    pub fn enable_async_lane(&mut self, dev: &CudaDevice) -> bool {
        if self.lane_flag.is_none() && dev.flag_waits_work() {
            self.lane_flag = dev.new_flag().ok().map(Arc::new);
        }
        self.lane_flag.is_some()
    }

    pub fn async_lane(&self) -> bool {
        self.lane_flag.is_some()
    }

    /// Room for one asynchronous lane job's `len` output values, and the flag
    /// value its end must raise. Call only once the job before has finished
    /// and after this layer's routing sync (the staging's copies are done).
    pub fn reserve_lane_output(&mut self, dev: &CudaDevice, len: usize) -> Result<LaneOutput, CudaBackendError> {
        let flag = self.lane_flag.clone().ok_or_else(|| CudaBackendError::Other("no asynchronous lane".into()))?;
        if self.lane_async_stage.as_ref().is_none_or(|b| b.0.len() < len) {
            dev.compute().synchronize().map_err(pulsar_cuda::CudaError::from)?;
            let b = dev.alloc_pinned::<f32>((2 * len).max(1 << 16))?;
            let addr = b.device_addr()?;
            self.lane_async_stage = Some((b, addr));
        }
        self.lane_seq = self.lane_seq.wrapping_add(1);
        let ptr = self.lane_async_stage.as_ref().expect("allocated above").0.as_ptr();
        Ok(LaneOutput { flag, seq: self.lane_seq, ptr, len })
    }

    /// Queue, on the compute stream, a wait for the lane job that raises the
    /// flag to `seq`, then one kernel that reads its output (reserved with
    /// [`reserve_lane_output`](Self::reserve_lane_output)) in place over the
    /// bus and writes it, cut into `segs` (offset in `out`, length) in order,
    /// into `out`. One launch, not a copy per pair: each small copy on the
    /// compute stream costs the GPU microseconds.
    pub fn queue_lane_output(&mut self, dev: &CudaDevice, seq: u32, segs: &[(usize, usize)], out: &mut DeviceBuf<f32>) -> Result<(), CudaBackendError> {
        let flag = self.lane_flag.as_ref().ok_or_else(|| CudaBackendError::Other("no asynchronous lane".into()))?;
        let (stage, stage_addr) = self.lane_async_stage.as_ref().ok_or_else(|| CudaBackendError::Other("no lane output reserved".into()))?;
        let mut trip = Vec::with_capacity(segs.len());
        let mut at = 0usize;
        for &(off, len) in segs {
            let v = [off, at, len].map(i32::try_from);
            match v {
                [Ok(d), Ok(s), Ok(l)] => trip.push([d, s, l]),
                _ => return Err(CudaBackendError::Other(format!("lane segment ({off}, {len}) past i32"))),
            }
            at += len;
        }
        if self.lane_seg_stage.as_ref().is_none_or(|b| b.0.len() < 3 * trip.len()) {
            // The layer before's launch read the old one before this layer's sync.
            let b = dev.alloc_pinned::<i32>((3 * trip.len()).max(192))?;
            let addr = b.device_addr()?;
            self.lane_seg_stage = Some((b, addr));
        }
        let (seg, seg_addr) = self.lane_seg_stage.as_mut().expect("allocated above");
        for (d, t) in seg.as_mut_slice().chunks_exact_mut(3).zip(&trip) {
            d.copy_from_slice(t);
        }
        flag.wait_on(dev.compute(), seq)?;
        // SAFETY: both stagings are page-locked, owned by the pool and not
        // rewritten before the next layer's sync; the lane writes the values
        // before it raises the flag the launch waits behind.
        unsafe { dev.lane_fill_rows(dev.compute(), *stage_addr, stage.len(), *seg_addr, &trip, out) }?;
        Ok(())
    }

    /// Copy the CPU lane's output rows (`y`: `[rows.len(), d_model]`) into
    /// rows `rows` of `out` on the compute stream, through a page-locked
    /// staging buffer (reused at the next layer, after its routing sync).
    pub fn upload_lane_rows(&mut self, dev: &CudaDevice, y: &[f32], rows: &[usize], d_model: usize, out: &mut DeviceBuf<f32>) -> Result<(), CudaBackendError> {
        let segs: Vec<(usize, usize)> = rows.iter().map(|&r| (r * d_model, d_model)).collect();
        self.upload_lane_segments(dev, y, &segs, out)
    }

    /// Copy `y`, cut into `segs` (offset in `out`, length) in order, into
    /// `out` on the compute stream, through the page-locked staging buffer.
    pub fn upload_lane_segments(&mut self, dev: &CudaDevice, y: &[f32], segs: &[(usize, usize)], out: &mut DeviceBuf<f32>) -> Result<(), CudaBackendError> {
        let total: usize = segs.iter().map(|s| s.1).sum();
        if total != y.len() {
            return Err(CudaBackendError::Other(format!("lane output of {} values for segments of {total}", y.len())));
        }
        // Each call of a layer stages after the last one's (their copies may
        // still be in flight); the layer's routing sync frees it all.
        let mut at0 = self.lane_stage_used;
        if self.lane_stage.as_ref().is_none_or(|b| b.len() < at0 + y.len()) {
            // The old buffer may still feed copies: let them finish first.
            dev.compute().synchronize().map_err(pulsar_cuda::CudaError::from)?;
            self.lane_stage = Some(dev.alloc_pinned::<f32>((2 * (at0 + y.len())).max(1 << 16))?);
            at0 = 0;
        }
        let stage = self.lane_stage.as_mut().expect("allocated above");
        stage.as_mut_slice()[at0..at0 + y.len()].copy_from_slice(y);
        self.lane_stage_used = at0 + y.len();
        let bytes: &[u8] = {
            let s = &stage.as_slice()[at0..at0 + y.len()];
            // SAFETY: f32 has no padding; the view covers exactly `s`.
            unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, std::mem::size_of_val(s)) }
        };
        copy_segments(dev, bytes, segs, out)
    }
}

/// An asynchronous lane job's output: `len` values of page-locked staging at
/// `ptr`, and the flag value to raise when they are written.
pub struct LaneOutput {
    pub flag: Arc<HostFlag>,
    pub seq: u32,
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the staging is written by one job at a time (the pool hands out a
// region only after the job before has finished) and outlives it.
unsafe impl Send for LaneOutput {}

impl LaneOutput {
    /// The staging to write the output into.
    ///
    /// # Safety
    /// Only the job the region was reserved for may call this, once, before
    /// it raises the flag, while the pool that reserved it is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn values(&self) -> &mut [f32] {
        // SAFETY: per the contract; `len` values were reserved at `ptr`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Let the stream's waiters go (error or not: nothing else would).
    pub fn raise(&self) {
        self.flag.set(self.seq);
    }
}

/// Copy `bytes` (f32 values), cut into `segs` (offset in `out`, length) in
/// order, into `out` on the compute stream. `bytes` must be page-locked and
/// unchanged until the stream's next sync.
fn copy_segments(dev: &CudaDevice, bytes: &[u8], segs: &[(usize, usize)], out: &mut DeviceBuf<f32>) -> Result<(), CudaBackendError> {
    let mut at = 0;
    for &(off, len) in segs {
        if off + len > out.len() {
            return Err(CudaBackendError::Other(format!("lane values {off}..{} outside a buffer of {}", off + len, out.len())));
        }
        if len > 0 {
            let dst = out.device_ptr_at(off)?;
            let src = bytes.get(at * 4..(at + len) * 4).ok_or_else(|| CudaBackendError::Other(format!("lane segments past {} staged values", bytes.len() / 4)))?;
            // SAFETY: `dst` has `len` floats (checked); the caller keeps the
            // page-locked source unchanged until the stream's next sync.
            unsafe { pulsar_cuda::copy_to_device_async(dev.compute(), dst, src) }?;
        }
        at += len;
    }
    Ok(())
}
