//! Device buffers and pinned host buffers.
//!
//! `DeviceBuf<T>` is a plain `cuMemAlloc` allocation of `len` values of a
//! plain-old-data `T`; copies go through a stream of the device that owns it.
//! A paged one ([`DeviceBuf::alloc_paged`]) reserves the addresses of all
//! `len` values but backs only a prefix with physical pages
//! ([`DeviceBuf::back`]): a KV cache that takes memory as its sequence grows,
//! at an address that never moves (captured graphs keep working).
//! `PinnedBuf<T>` is page-locked host memory allocated with flags 0 (cached,
//! not write-combined: the CPU lane reads it at full speed).

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use crate::error::{shape, CudaError};

/// Value types a buffer may hold: plain bytes with no invalid bit patterns.
///
/// # Safety
/// Implementors must be `Copy`, have no padding and accept every bit pattern.
pub unsafe trait Pod: Copy + Default + Send + Sync + 'static {}
// SAFETY: primitive numbers accept every bit pattern.
unsafe impl Pod for u8 {}
unsafe impl Pod for i8 {}
unsafe impl Pod for u16 {}
unsafe impl Pod for u32 {}
unsafe impl Pod for i32 {}
unsafe impl Pod for u64 {}
unsafe impl Pod for f32 {}
// SAFETY: transparent wrappers of u8 / u16.
unsafe impl Pod for crate::ops::KvQ4 {}
unsafe impl Pod for crate::ops::KvBf16 {}
unsafe impl Pod for crate::ops::KvFp8 {}

/// `len` values of `T` in device memory.
pub struct DeviceBuf<T: Pod> {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
    /// Reserved addresses with physical pages mapped on demand (None: cuMemAlloc).
    paged: Option<Box<Pages>>,
    _t: PhantomData<T>,
}

/// A paged buffer's reservation and its mapped pages, in address order.
struct Pages {
    reserved: usize,
    page: usize,
    prop: sys::CUmemAllocationProp,
    mapped: Vec<sys::CUmemGenericAllocationHandle>,
}

/// The physical page size paged buffers map (the device's allocation
/// granularity: 2 MiB on current GPUs).
pub fn page_bytes(ctx: &Arc<CudaContext>) -> Result<usize, CudaError> {
    let prop = page_prop(ctx);
    let mut g = 0usize;
    ctx.bind_to_thread()?;
    // SAFETY: prop describes pinned device memory of this context's device.
    unsafe { sys::cuMemGetAllocationGranularity(&mut g, &prop, sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) }.result()?;
    Ok(g.max(1))
}

fn page_prop(ctx: &Arc<CudaContext>) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; zero is every field's "none".
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ctx.ordinal() as i32;
    prop
}

impl<T: Pod> std::fmt::Debug for DeviceBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuf<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

// SAFETY: the allocation is owned; access goes through the driver.
unsafe impl<T: Pod> Send for DeviceBuf<T> {}
unsafe impl<T: Pod> Sync for DeviceBuf<T> {}

impl<T: Pod> DeviceBuf<T> {
    /// Uninitialised device memory for `len` values (at least one byte is allocated).
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| shape("alloc", format!("{len} values overflow")))?;
        ctx.bind_to_thread()?;
        // SAFETY: the context is current; a 0-byte request is rounded up.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }?;
        Ok(DeviceBuf {
            ptr,
            len,
            ctx: ctx.clone(),
            paged: None,
            _t: PhantomData,
        })
    }

    /// Addresses for `len` values with no memory behind them yet: [`DeviceBuf::back`]
    /// maps pages for a prefix. Reading or writing past the backed prefix faults.
    pub(crate) fn alloc_paged(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        let page = page_bytes(ctx)?;
        let reserved = len
            .checked_mul(std::mem::size_of::<T>())
            .and_then(|b| b.max(1).checked_next_multiple_of(page))
            .ok_or_else(|| shape("alloc_paged", format!("{len} values overflow")))?;
        let mut ptr = 0;
        ctx.bind_to_thread()?;
        // SAFETY: reserves addresses only; freed in Drop.
        unsafe { sys::cuMemAddressReserve(&mut ptr, reserved, page, 0, 0) }.result()?;
        let pages = Pages { reserved, page, prop: page_prop(ctx), mapped: Vec::new() };
        Ok(DeviceBuf { ptr, len, ctx: ctx.clone(), paged: Some(Box::new(pages)), _t: PhantomData })
    }

    /// Whether only a prefix of this buffer has memory ([`DeviceBuf::alloc_paged`]).
    pub fn is_paged(&self) -> bool {
        self.paged.is_some()
    }

    /// Bytes with memory behind them: all of a plain buffer, the mapped
    /// pages of a paged one.
    pub fn backed_bytes(&self) -> usize {
        self.paged.as_ref().map_or(self.bytes(), |p| (p.mapped.len() * p.page).min(self.bytes()))
    }

    /// Back exactly the pages the first `n` values touch (a paged buffer;
    /// a plain one is always backed): map new pages past the end, or unmap
    /// those past it. Unmapping waits for the context's work first, so no
    /// kernel still reads a page that goes.
    pub fn back(&mut self, n: usize) -> Result<(), CudaError> {
        let n = n.min(self.len);
        let Some(p) = self.paged.as_deref_mut() else { return Ok(()) };
        let want = (n * std::mem::size_of::<T>()).div_ceil(p.page);
        if want == p.mapped.len() {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        if want < p.mapped.len() {
            self.ctx.synchronize()?;
        }
        while p.mapped.len() > want {
            let at = self.ptr + ((p.mapped.len() - 1) * p.page) as u64;
            // SAFETY: the last mapped page, idle (synchronised above).
            unsafe { sys::cuMemUnmap(at, p.page) }.result()?;
            if let Some(h) = p.mapped.pop() {
                // SAFETY: unmapped above; released once.
                unsafe { sys::cuMemRelease(h) }.result()?;
            }
        }
        while p.mapped.len() < want {
            let at = self.ptr + (p.mapped.len() * p.page) as u64;
            let mut h = 0;
            // SAFETY: one page of pinned device memory, mapped into this
            // buffer's reservation past its mapped prefix.
            unsafe { sys::cuMemCreate(&mut h, p.page, &p.prop, 0) }.result()?;
            if let Err(e) = unsafe { sys::cuMemMap(at, p.page, 0, h, 0) }.result() {
                // SAFETY: created above, never mapped.
                let _ = unsafe { sys::cuMemRelease(h) };
                return Err(e.into());
            }
            p.mapped.push(h);
            let access = sys::CUmemAccessDesc { location: p.prop.location, flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
            // SAFETY: the page mapped above.
            unsafe { sys::cuMemSetAccess(at, p.page, &access, 1) }.result()?;
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
    /// The device address (for kernels taking pointer tables, e.g. MoE slabs).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
    /// The device address of value `i` (may be one past the end).
    pub fn device_ptr_at(&self, i: usize) -> Result<u64, CudaError> {
        if i > self.len {
            return Err(shape(
                "device_ptr_at",
                format!("index {i} beyond {} values", self.len),
            ));
        }
        Ok(self.ptr + (i * std::mem::size_of::<T>()) as u64)
    }

    /// Copy `src` (exactly `len` values) in on `stream`, then wait for it.
    pub fn upload(&mut self, stream: &CudaStream, src: &[T]) -> Result<(), CudaError> {
        self.check_len("upload", src.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: sizes checked; the stream is synchronised before `src` can move.
        unsafe {
            result::memcpy_htod_async(self.ptr, src, stream.cu_stream())?;
        }
        stream.synchronize()?;
        Ok(())
    }

    /// Copy `src` into the first `src.len()` values (at most `len`) on `stream`, then wait for it.
    pub fn upload_prefix(&mut self, stream: &CudaStream, src: &[T]) -> Result<(), CudaError> {
        if src.len() > self.len {
            return Err(shape("upload", format!("{} values into a buffer of {}", src.len(), self.len)));
        }
        if std::mem::size_of_val(src) > self.backed_bytes() {
            return Err(shape("upload", format!("{} values into a paged buffer backed for {} bytes", src.len(), self.backed_bytes())));
        }
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: src fits the allocation; the stream is synchronised before `src` can move.
        unsafe {
            result::memcpy_htod_async(self.ptr, src, stream.cu_stream())?;
        }
        stream.synchronize()?;
        Ok(())
    }

    /// Copy out into `dst` (exactly `len` values) on `stream`, then wait for it.
    pub fn download(&self, stream: &CudaStream, dst: &mut [T]) -> Result<(), CudaError> {
        self.check_len("download", dst.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: sizes checked; synchronised before returning.
        unsafe {
            result::memcpy_dtoh_async(dst, self.ptr, stream.cu_stream())?;
        }
        stream.synchronize()?;
        Ok(())
    }

    /// Asynchronous copy in from pinned memory: `src` must stay alive and
    /// unchanged until the stream reaches this point (record an event).
    pub fn upload_async(
        &mut self,
        stream: &CudaStream,
        src: &PinnedBuf<T>,
    ) -> Result<(), CudaError> {
        self.check_len("upload_async", src.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: sizes checked; pinned memory outlives the copy per the contract above.
        unsafe { result::memcpy_htod_async(self.ptr, src.as_slice(), stream.cu_stream()) }?;
        Ok(())
    }

    /// Asynchronous copy out into pinned memory (read it after syncing the stream).
    pub fn download_async(
        &self,
        stream: &CudaStream,
        dst: &mut PinnedBuf<T>,
    ) -> Result<(), CudaError> {
        self.check_len("download_async", dst.len())?;
        self.ctx.bind_to_thread()?;
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_async(dst.as_mut_slice(), self.ptr, stream.cu_stream()) }?;
        Ok(())
    }

    /// Fill every byte with `byte` (0xff makes f32 NaN), asynchronously on `stream`.
    pub fn fill_bytes(&mut self, stream: &CudaStream, byte: u8) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: the range is this allocation.
        unsafe { result::memset_d8_async(self.ptr, byte, self.backed_bytes(), stream.cu_stream()) }?;
        Ok(())
    }

    /// Fill every 4-byte word with `word` (`1f32.to_bits()` makes ones), on
    /// `stream`: a device-side fill, so it can be captured in a graph where a
    /// host upload could not.
    pub fn fill_words(&mut self, stream: &CudaStream, word: u32) -> Result<(), CudaError> {
        if self.bytes() % 4 != 0 {
            return Err(shape("fill_words", format!("{} bytes are not whole words", self.bytes())));
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the range is this allocation.
        unsafe { cudarc::driver::sys::cuMemsetD32Async(self.ptr, word, self.backed_bytes() / 4, stream.cu_stream()) }.result()?;
        Ok(())
    }

    fn check_len(&self, op: &'static str, n: usize) -> Result<(), CudaError> {
        if n * std::mem::size_of::<T>() > self.backed_bytes() && n <= self.len {
            return Err(shape(op, format!("{n} values of a paged buffer backed for {} bytes", self.backed_bytes())));
        }
        if n != self.len {
            return Err(shape(
                op,
                format!("{n} host values for a buffer of {}", self.len),
            ));
        }
        Ok(())
    }
}

impl<T: Pod> Drop for DeviceBuf<T> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            match self.paged.take() {
                // SAFETY: allocated by malloc_sync in this context, freed once.
                None => unsafe {
                    let _ = result::free_sync(self.ptr);
                },
                Some(p) => {
                    // Kernels may still read the pages: wait, then unmap,
                    // release and free the reservation, each once.
                    let _ = self.ctx.synchronize();
                    for (i, &h) in p.mapped.iter().enumerate() {
                        // SAFETY: page i is mapped at this offset; idle.
                        unsafe {
                            let _ = sys::cuMemUnmap(self.ptr + (i * p.page) as u64, p.page);
                            let _ = sys::cuMemRelease(h);
                        }
                    }
                    // SAFETY: reserved by alloc_paged with this size.
                    unsafe {
                        let _ = sys::cuMemAddressFree(self.ptr, p.reserved);
                    }
                }
            }
        }
    }
}

/// Page-locked host memory (cuMemHostAlloc, flags 0), zero-initialised.
pub struct PinnedBuf<T: Pod> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: owned allocation.
unsafe impl<T: Pod> Send for PinnedBuf<T> {}
unsafe impl<T: Pod> Sync for PinnedBuf<T> {}

impl<T: Pod> PinnedBuf<T> {
    /// `len` zeroed values of page-locked memory in `ctx` (usable from any
    /// thread; freed on drop).
    pub fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, CudaError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|b| *b < isize::MAX as usize)
            .ok_or_else(|| shape("pinned alloc", format!("{len} values overflow")))?;
        ctx.bind_to_thread()?;
        // SAFETY: flags 0 = plain cached page-locked memory.
        let p = unsafe { result::malloc_host(bytes.max(1), 0) }? as *mut T;
        if p.is_null() || !p.is_aligned() {
            return Err(CudaError::Unavailable(
                "cuMemHostAlloc returned an unusable pointer".into(),
            ));
        }
        // SAFETY: `bytes` bytes were just allocated at `p`.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
        Ok(PinnedBuf {
            ptr: p,
            len,
            ctx: ctx.clone(),
        })
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialised values live at `ptr` (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, with unique access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    /// The allocation's address, for memory another thread (or the device)
    /// uses while no slice of it may exist.
    pub fn as_ptr(&self) -> *mut T {
        self.ptr
    }
    /// The address kernels read this memory at over the bus (with unified
    /// addressing every page-locked allocation is mapped).
    pub fn device_addr(&self) -> Result<u64, CudaError> {
        self.ctx.bind_to_thread()?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a live cuMemHostAlloc allocation of this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, self.ptr as *mut std::ffi::c_void, 0) }.result()?;
        Ok(d)
    }
}

impl<T: Pod> Drop for PinnedBuf<T> {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_host, freed once.
            unsafe {
                let _ = result::free_host(self.ptr as *mut std::ffi::c_void);
            }
        }
    }
}

/// Host memory someone else owns (a file mapping, a cache arena), page-locked
/// in place with `cuMemHostRegister`: copies from it run at pinned speed on
/// any stream without a staging copy, and kernels can read it over the bus
/// (zero-copy) through [`HostRegistration::device_addr`]. Unregistered on drop.
pub struct HostRegistration {
    base: usize,
    len: usize,
    dev_base: u64,
    ctx: Arc<CudaContext>,
}

// SAFETY: the registration only records addresses; the memory is the owner's.
unsafe impl Send for HostRegistration {}
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Page-lock `len` bytes at `ptr` (`read_only` for mappings that must not
    /// be written, such as a read-only file map).
    ///
    /// # Safety
    /// The range must stay mapped until the registration is dropped.
    pub(crate) unsafe fn new(
        ctx: &Arc<CudaContext>,
        ptr: *const u8,
        len: usize,
        read_only: bool,
    ) -> Result<Self, CudaError> {
        if len == 0 {
            return Err(shape("host register", "an empty range".to_string()));
        }
        ctx.bind_to_thread()?;
        let mut flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        // SAFETY: the caller keeps the range mapped; flags as documented.
        unsafe { sys::cuMemHostRegister_v2(ptr as *mut std::ffi::c_void, len, flags) }.result()?;
        let mut dev_base: sys::CUdeviceptr = 0;
        // SAFETY: the range was registered with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_base, ptr as *mut std::ffi::c_void, 0) }.result();
        if let Err(e) = r {
            // SAFETY: registered above, unregistered once.
            unsafe {
                let _ = sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void);
            }
            return Err(e.into());
        }
        Ok(HostRegistration {
            base: ptr as usize,
            len,
            dev_base,
            ctx: ctx.clone(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `bytes` lie wholly inside the registered range.
    pub fn contains(&self, bytes: &[u8]) -> bool {
        let p = bytes.as_ptr() as usize;
        p >= self.base && p.saturating_add(bytes.len()) <= self.base + self.len
    }

    /// The address a kernel reads `bytes` at (zero-copy), if they are registered here.
    pub fn device_addr(&self, bytes: &[u8]) -> Option<u64> {
        self.contains(bytes)
            .then(|| self.dev_base + (bytes.as_ptr() as usize - self.base) as u64)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered in `new`, unregistered once.
            unsafe {
                let _ = sys::cuMemHostUnregister(self.base as *mut std::ffi::c_void);
            }
        }
    }
}

/// Copy host `src` into device memory at `dst` on `stream` without waiting.
///
/// # Safety
/// `dst` must address at least `src.len()` bytes of live device memory, and
/// `src` must stay alive and unchanged until the stream passes this copy. It
/// is asynchronous only when `src` is page-locked (else the driver stages it
/// and returns when the host side is read).
pub unsafe fn copy_to_device_async(
    stream: &CudaStream,
    dst: u64,
    src: &[u8],
) -> Result<(), CudaError> {
    stream.context().bind_to_thread()?;
    // SAFETY: per the contract above.
    unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }?;
    Ok(())
}
