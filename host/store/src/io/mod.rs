//! Raw read backends under the disk reader.
//!
//! A backend only moves bytes: it takes reads into caller memory and reports
//! how many bytes each one got. Alignment, splitting, short reads, retries and
//! errors naming slabs live in [`crate::reader`], so a test can inject short
//! reads or EIO through a wrapper backend and exercise the real logic.

mod align;
mod pread;
mod uring;

use std::io;
use std::os::fd::RawFd;
use std::sync::Weak;

pub use align::{dio_alignment, DioAlign};
pub use pread::PreadBackend;
pub use uring::UringBackend;

/// The whole buffer a read writes into, for backends that register memory
/// with the kernel once and reuse the registration.
#[derive(Clone, Debug)]
pub struct BufRegion {
    pub base: *mut u8,
    pub len: usize,
    /// Alive exactly as long as the buffer; a registration keyed on it can
    /// never be used for a later buffer at the same address.
    pub identity: Weak<()>,
}

/// One read of `len` bytes at `offset` of `fd` into `buf`.
#[derive(Clone, Debug)]
pub struct ReadOp {
    /// Returned unchanged in the completion.
    pub tag: u64,
    pub fd: RawFd,
    pub offset: u64,
    pub buf: *mut u8,
    pub len: u32,
    /// The buffer `buf..buf+len` lies in.
    pub region: BufRegion,
}

// SAFETY: the pointers are only dereferenced under `IoBackend::submit`'s
// contract, which hands the memory to the backend until completion.
unsafe impl Send for ReadOp {}

/// The outcome of one [`ReadOp`]: bytes read (0 means end of file), or the
/// OS error. A short count is not an error; the reader resubmits the rest.
#[derive(Debug)]
pub struct Completion {
    pub tag: u64,
    pub result: io::Result<usize>,
}

/// Something that performs reads, possibly asynchronously.
pub trait IoBackend: Send {
    /// For logs and errors.
    fn name(&self) -> &'static str;

    /// The most reads that may be in flight at once.
    fn depth(&self) -> usize;

    /// Reads submitted and not yet returned by [`IoBackend::reap`].
    fn in_flight(&self) -> usize;

    /// Queue a read. Never called with `in_flight() >= depth()`.
    ///
    /// # Safety
    /// `op.buf..op.buf+op.len` must lie in `op.region`, stay valid, and not be
    /// accessed by anyone else until this op's completion has been returned by
    /// `reap` or the backend has been dropped (drop waits for in-flight reads).
    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()>;

    /// Start queued reads and append finished ones to `out`. With `wait`, block
    /// until at least one completion is available if anything is in flight.
    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> io::Result<()>;
}

/// Whether an errno means "try the same read again".
pub(crate) fn is_transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN))
}
