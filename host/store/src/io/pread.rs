//! Synchronous `pread` backend: the fallback where io_uring is unavailable
//! and the path for shards opened without O_DIRECT.

use std::collections::VecDeque;
use std::io;

use super::{is_transient, Completion, IoBackend, ReadOp};

/// Performs each read at submit time; completions are handed out by `reap`.
#[derive(Debug)]
pub struct PreadBackend {
    depth: usize,
    done: VecDeque<Completion>,
}

impl PreadBackend {
    pub fn new(depth: usize) -> PreadBackend {
        PreadBackend { depth: depth.max(1), done: VecDeque::new() }
    }
}

impl IoBackend for PreadBackend {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()> {
        let result = loop {
            // SAFETY: the caller guarantees the destination per the trait contract.
            let n = unsafe { libc::pread(op.fd, op.buf.cast(), op.len as usize, op.offset as libc::off_t) };
            if n >= 0 {
                break Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            // EINTR/EAGAIN: the same read again, here, so callers see only real outcomes.
            if !is_transient(&e) {
                break Err(e);
            }
        };
        self.done.push_back(Completion { tag: op.tag, result });
        Ok(())
    }

    fn reap(&mut self, _wait: bool, out: &mut Vec<Completion>) -> io::Result<()> {
        out.extend(self.done.drain(..));
        Ok(())
    }
}
