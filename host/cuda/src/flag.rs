//! A host-written counter a stream can wait on.
//!
//! The CPU lane computes part of a decode layer while the host goes on
//! queueing the layer's kernels: the compute stream waits, on the device,
//! for the lane to raise this counter (`cuStreamWaitValue32`), so the host
//! never blocks on the lane. The counter lives in page-locked host memory
//! mapped into the device's address space.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use crate::CudaError;

/// One `u32` in mapped page-locked memory: the host stores to it, a stream
/// waits until it reaches a value. Values compare with wrap-around (the
/// driver's GEQ is `(int32)(flag - value) >= 0`), so a counter that only
/// goes up never stalls a waiter after 2^32 steps.
pub struct HostFlag {
    ptr: *mut u32,
    dev: u64,
    ctx: Arc<CudaContext>,
}

// SAFETY: the flag is only touched through atomics (host) and by the driver.
unsafe impl Send for HostFlag {}
unsafe impl Sync for HostFlag {}

impl HostFlag {
    /// A flag at 0 in `ctx`.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<HostFlag, CudaError> {
        ctx.bind_to_thread()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // A whole cache line, so nothing else shares the line the device polls.
        // SAFETY: a plain allocation; freed in Drop.
        let p = unsafe { result::malloc_host(64, flags) }? as *mut u32;
        if p.is_null() || !p.is_aligned() {
            return Err(CudaError::Unavailable("cuMemHostAlloc returned an unusable pointer".into()));
        }
        // SAFETY: 64 bytes were just allocated at `p`.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, 64) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `p` was allocated with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, p as *mut std::ffi::c_void, 0) }.result();
        if let Err(e) = r {
            // SAFETY: allocated above, freed once.
            unsafe {
                let _ = result::free_host(p as *mut std::ffi::c_void);
            }
            return Err(e.into());
        }
        Ok(HostFlag { ptr: p, dev, ctx: ctx.clone() })
    }

    fn atomic(&self) -> &AtomicU32 {
        // SAFETY: `ptr` is aligned, live for `self`, and only accessed atomically.
        unsafe { AtomicU32::from_ptr(self.ptr) }
    }

    /// Store `v`; everything this thread wrote before is visible to a device
    /// that sees `v` (x86 keeps stores in order; Release keeps the compiler
    /// from moving them past this one).
    pub fn set(&self, v: u32) {
        self.atomic().store(v, Ordering::Release);
    }

    pub fn get(&self) -> u32 {
        self.atomic().load(Ordering::Acquire)
    }

    /// Make `stream`'s later work wait until the flag reaches `v`. Nothing
    /// times this out: whoever hands out `v` must store it, error or not.
    pub fn wait_on(&self, stream: &CudaStream, v: u32) -> Result<(), CudaError> {
        stream.context().bind_to_thread()?;
        let geq = sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: `dev` is the device address of this live mapped allocation.
        unsafe { sys::cuStreamWaitValue32_v2(stream.cu_stream(), self.dev, v, geq) }.result()?;
        Ok(())
    }
}

impl Drop for HostFlag {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host, freed once.
            unsafe {
                let _ = result::free_host(self.ptr as *mut std::ffi::c_void);
            }
        }
    }
}
