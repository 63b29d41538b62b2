//! Page-aligned host buffers and the allocator seam.
//!
//! O_DIRECT needs aligned destinations, and a GPU backend wants to pin or
//! register the host cache's memory, so every slab buffer comes from a
//! [`HostAllocator`]; the CUDA backend can supply one that returns pinned
//! memory.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

use crate::error::{Result, StoreError};

/// How a buffer's memory is given back.
type Release = Box<dyn FnOnce(NonNull<u8>, usize) + Send + Sync>;

/// An owned, aligned, initialised byte buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
    release: Option<Release>,
    /// Identity for caches of kernel registrations: a registration made for a
    /// buffer must never be used for a later buffer at the same address.
    token: Arc<()>,
}

// SAFETY: the buffer exclusively owns its memory; access goes through &/&mut.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Wrap memory supplied by an allocator.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, initialised,
    /// aligned to `align`, and exclusively owned by the returned buffer until
    /// `release(ptr, len)` is called (from `Drop`).
    pub unsafe fn from_raw_parts(ptr: NonNull<u8>, len: usize, align: usize, release: Release) -> AlignedBuf {
        AlignedBuf { ptr, len, align, release: Some(release), token: Arc::new(()) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The alignment the allocator promised for the base address.
    pub fn align(&self) -> usize {
        self.align
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: from_raw_parts' contract.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: from_raw_parts' contract; &mut self gives exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// A handle alive exactly as long as this buffer: key caches of kernel
    /// registrations on it, never on the address alone.
    pub fn identity(&self) -> Weak<()> {
        Arc::downgrade(&self.token)
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release(self.ptr, self.len);
        }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("ptr", &self.ptr).field("len", &self.len).field("align", &self.align).finish()
    }
}

/// Supplies host memory for slabs.
pub trait HostAllocator: Send + Sync {
    /// At least `len` bytes whose base is aligned to `align` (a power of two)
    /// and to the page size. The contents are initialised (zero is fine).
    fn allocate(&self, len: usize, align: usize) -> Result<AlignedBuf>;
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 && (p as usize).is_power_of_two() { p as usize } else { 4096 }
}

/// Page-aligned memory from the global allocator (zeroed, so large buffers
/// come straight from fresh kernel pages).
#[derive(Debug, Clone, Copy, Default)]
pub struct PageAllocator;

impl HostAllocator for PageAllocator {
    fn allocate(&self, len: usize, align: usize) -> Result<AlignedBuf> {
        if !align.is_power_of_two() {
            return Err(StoreError::Alloc { bytes: len, align });
        }
        let align = align.max(page_size());
        let size = len.max(1).checked_next_multiple_of(align).ok_or(StoreError::Alloc { bytes: len, align })?;
        let layout = Layout::from_size_align(size, align).map_err(|_| StoreError::Alloc { bytes: len, align })?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or(StoreError::Alloc { bytes: len, align })?;
        let release: Release = Box::new(move |p, _| {
            // SAFETY: allocated above with this layout.
            unsafe { std::alloc::dealloc(p.as_ptr(), layout) }
        });
        // SAFETY: fresh zeroed allocation of `size >= len` bytes.
        Ok(unsafe { AlignedBuf::from_raw_parts(ptr, len, align, release) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_allocator_aligns_and_zeroes() {
        let a = PageAllocator;
        for (len, align) in [(1usize, 1usize), (4097, 512), (10_000, 8192), (3 << 20, 4096)] {
            let mut b = a.allocate(len, align).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % align.max(page_size()), 0);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice()[len - 1] = 7;
            assert_eq!(b.as_slice()[len - 1], 7);
        }
        assert!(matches!(a.allocate(10, 3), Err(StoreError::Alloc { .. })));
    }

    #[test]
    fn identity_dies_with_the_buffer() {
        let b = PageAllocator.allocate(10, 4096).unwrap();
        let id = b.identity();
        assert!(id.upgrade().is_some());
        drop(b);
        assert!(id.upgrade().is_none());
    }
}
