//! io_uring backend, normally driving O_DIRECT shard files.
//!
//! Fixed (registered) buffers save the kernel pinning the destination's pages
//! on every read. The table is sparse and filled lazily: a buffer is
//! registered the first time a read targets it and reused while it lives
//! (the host cache recycles slab buffers, so this hits). Registration counts
//! against RLIMIT_MEMLOCK (8 MiB for unprivileged users); when it fails we
//! unpin slots of dead buffers and try once more, then stop registering and
//! issue plain reads.

use std::collections::HashMap;
use std::io;
use std::sync::Weak;

use io_uring::{opcode, types, IoUring};

use super::{BufRegion, Completion, IoBackend, ReadOp};

struct Slot {
    identity: Weak<()>,
    base: usize,
    len: usize,
    busy: u32,
    last_use: u64,
}

impl Slot {
    fn empty() -> Slot {
        Slot { identity: Weak::new(), base: 0, len: 0, busy: 0, last_use: 0 }
    }
    fn holds(&self, r: &BufRegion) -> bool {
        self.base == r.base as usize && self.len == r.len && Weak::ptr_eq(&self.identity, &r.identity) && self.identity.strong_count() > 0
    }
}

struct Fixed {
    slots: Vec<Slot>,
    /// Registration failed even after unpinning dead slots: plain reads from now on.
    gave_up: bool,
    clock: u64,
}

/// io_uring read backend.
pub struct UringBackend {
    ring: IoUring,
    depth: usize,
    in_flight: usize,
    /// tag -> fixed slot used (if any), for in-flight reads.
    ops: HashMap<u64, Option<u16>>,
    fixed: Option<Fixed>,
    fixed_reads: u64,
}

impl UringBackend {
    /// A ring of `depth` entries; with `fixed_buffers`, a sparse registered
    /// buffer table of `depth` slots (silently absent if the kernel refuses).
    pub fn new(depth: usize, fixed_buffers: bool) -> io::Result<UringBackend> {
        let depth = depth.clamp(1, 4096);
        let ring = IoUring::new(depth.next_power_of_two() as u32)?;
        let fixed = if fixed_buffers && ring.submitter().register_buffers_sparse(depth as u32).is_ok() {
            Some(Fixed { slots: (0..depth).map(|_| Slot::empty()).collect(), gave_up: false, clock: 0 })
        } else {
            None
        };
        Ok(UringBackend { ring, depth, in_flight: 0, ops: HashMap::new(), fixed, fixed_reads: 0 })
    }

    /// Whether registered buffers are still being used for new buffers.
    pub fn fixed_buffers_active(&self) -> bool {
        self.fixed.as_ref().is_some_and(|f| !f.gave_up)
    }

    /// Reads issued as READ_FIXED so far.
    pub fn fixed_reads(&self) -> u64 {
        self.fixed_reads
    }

    fn slot_for(&mut self, r: &BufRegion) -> Option<u16> {
        let fixed = self.fixed.as_mut()?;
        fixed.clock += 1;
        let now = fixed.clock;
        if let Some(i) = fixed.slots.iter().position(|s| s.holds(r)) {
            fixed.slots[i].last_use = now;
            return Some(i as u16);
        }
        if fixed.gave_up || r.len > (1 << 30) {
            return None;
        }
        // A slot nobody reads into: dead buffers first, then least recently used.
        let i = fixed
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.busy == 0)
            .min_by_key(|(_, s)| (s.identity.strong_count() > 0, s.last_use))
            .map(|(i, _)| i)?;
        let iov = libc::iovec { iov_base: r.base.cast(), iov_len: r.len };
        let submitter = self.ring.submitter();
        // SAFETY: the region is valid while its identity lives; we only ever
        // issue READ_FIXED into this slot while that identity is alive.
        let mut ok = unsafe { submitter.register_buffers_update(i as u32, &[iov], None) }.is_ok();
        if !ok {
            // Probably RLIMIT_MEMLOCK: unpin what dead buffers still hold, retry once.
            let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
            for (j, s) in fixed.slots.iter_mut().enumerate() {
                if s.busy == 0 && s.len != 0 && s.identity.strong_count() == 0 {
                    // SAFETY: clearing a slot registers nothing.
                    if unsafe { submitter.register_buffers_update(j as u32, &[empty], None) }.is_ok() {
                        *s = Slot::empty();
                    }
                }
            }
            ok = unsafe { submitter.register_buffers_update(i as u32, &[iov], None) }.is_ok();
        }
        if !ok {
            fixed.gave_up = true;
            tracing::debug!("io_uring buffer registration refused (memlock limit?); using plain reads for new buffers");
            return None;
        }
        fixed.slots[i] = Slot { identity: r.identity.clone(), base: r.base as usize, len: r.len, busy: 0, last_use: now };
        Some(i as u16)
    }

    fn enter(&mut self, want: usize) -> io::Result<()> {
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // CQ overflow pending or kernel short of memory: drain completions first.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY) | Some(libc::EAGAIN)) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    }

    fn drain_cq(&mut self, out: &mut Vec<Completion>) {
        for cqe in self.ring.completion() {
            let tag = cqe.user_data();
            if let Some(slot) = self.ops.remove(&tag) {
                self.in_flight -= 1;
                if let (Some(s), Some(f)) = (slot, self.fixed.as_mut()) {
                    f.slots[usize::from(s)].busy -= 1;
                }
                let res = cqe.result();
                let result = if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) };
                out.push(Completion { tag, result });
            }
        }
    }
}

impl IoBackend for UringBackend {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()> {
        if self.ops.contains_key(&op.tag) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "duplicate in-flight read tag"));
        }
        let slot = self.slot_for(&op.region);
        let entry = match slot {
            Some(s) => opcode::ReadFixed::new(types::Fd(op.fd), op.buf, op.len, s).offset(op.offset).build(),
            None => opcode::Read::new(types::Fd(op.fd), op.buf, op.len).offset(op.offset).build(),
        }
        .user_data(op.tag);
        // SAFETY: the caller keeps the memory valid until completion (trait contract).
        while unsafe { self.ring.submission().push(&entry) }.is_err() {
            self.enter(0)?;
        }
        if let (Some(s), Some(f)) = (slot, self.fixed.as_mut()) {
            f.slots[usize::from(s)].busy += 1;
            self.fixed_reads += 1;
        }
        self.ops.insert(op.tag, slot);
        self.in_flight += 1;
        Ok(())
    }

    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> io::Result<()> {
        let before = out.len();
        let want = usize::from(wait && self.in_flight > 0 && self.ring.completion().is_empty());
        self.enter(want)?;
        self.drain_cq(out);
        // EBUSY/EAGAIN above can return without a completion; keep waiting.
        while wait && self.in_flight > 0 && out.len() == before {
            self.enter(1)?;
            self.drain_cq(out);
        }
        Ok(())
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        // The kernel may still write into caller memory: wait it out.
        let mut sink = Vec::new();
        while self.in_flight > 0 {
            if self.reap(true, &mut sink).is_err() {
                break;
            }
            sink.clear();
        }
    }
}
