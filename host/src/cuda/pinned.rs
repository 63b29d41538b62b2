//! Page-locked host memory for the expert store's host cache (tier 3), so
//! slabs it holds upload to VRAM by DMA on the copy stream with no staging
//! copy. The allocator records each live allocation's range; the VRAM pool
//! asks those ranges whether a slab's bytes may be copied asynchronously.

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use pulsar_cuda::PinnedBuf;
use pulsar_store::{AlignedBuf, HostAllocator, StoreError};

/// The live page-locked allocations, by start address.
#[derive(Clone, Default)]
pub struct PinnedRanges(Arc<Mutex<BTreeMap<usize, usize>>>);

impl PinnedRanges {
    /// Whether `bytes` lie wholly inside one live allocation.
    pub fn contains(&self, bytes: &[u8]) -> bool {
        let p = bytes.as_ptr() as usize;
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.range(..=p).next_back().is_some_and(|(&start, &len)| p + bytes.len() <= start + len)
    }

    fn insert(&self, start: usize, len: usize) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).insert(start, len);
    }

    fn remove(&self, start: usize) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&start);
    }
}

/// Host-cache memory from `cuMemHostAlloc` (cached, CPU-readable at full speed).
pub struct PinnedAllocator {
    ctx: Arc<CudaContext>,
    ranges: PinnedRanges,
}

impl PinnedAllocator {
    pub fn new(ctx: Arc<CudaContext>) -> PinnedAllocator {
        PinnedAllocator { ctx, ranges: PinnedRanges::default() }
    }

    pub fn ranges(&self) -> PinnedRanges {
        self.ranges.clone()
    }
}

impl HostAllocator for PinnedAllocator {
    fn allocate(&self, len: usize, align: usize) -> pulsar_store::Result<AlignedBuf> {
        let fail = || StoreError::Alloc { bytes: len, align };
        if !align.is_power_of_two() {
            return Err(fail());
        }
        // Over-allocate so any alignment can be met inside the page-locked
        // block: the driver sub-allocates small requests, which need not
        // start on a page.
        let extra = align.max(pulsar_store::page_size());
        let mut buf = PinnedBuf::<u8>::alloc(&self.ctx, len.max(1) + extra).map_err(|e| {
            tracing::warn!("page-locked host allocation of {len} bytes failed: {e}");
            fail()
        })?;
        let base = buf.as_mut_slice().as_mut_ptr();
        let off = base.align_offset(align.max(1));
        if off > extra {
            return Err(fail());
        }
        // SAFETY: `off + len <= len + extra` bytes of the allocation.
        let ptr = NonNull::new(unsafe { base.add(off) }).ok_or_else(fail)?;
        let start = ptr.as_ptr() as usize;
        self.ranges.insert(start, len);
        let ranges = self.ranges.clone();
        let release = Box::new(move |_p: NonNull<u8>, _len: usize| {
            ranges.remove(start);
            drop(buf);
        });
        // SAFETY: `ptr` addresses `len` zeroed (PinnedBuf zeroes) bytes aligned
        // to `align`, owned by `buf`, which the release closure frees.
        Ok(unsafe { AlignedBuf::from_raw_parts(ptr, len, align, release) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_answer_only_for_whole_slices_inside_one_allocation() {
        let r = PinnedRanges::default();
        let a = vec![0u8; 4096];
        let b = vec![0u8; 4096];
        r.insert(a.as_ptr() as usize, a.len());
        assert!(r.contains(&a));
        assert!(r.contains(&a[100..200]));
        assert!(!r.contains(&b), "another allocation");
        // A slice running past the end of the range.
        let start = a.as_ptr() as usize;
        r.remove(start);
        r.insert(start, 1000);
        assert!(r.contains(&a[..1000]));
        assert!(!r.contains(&a[900..1100]));
        r.remove(start);
        assert!(!r.contains(&a[..10]));
    }
}
