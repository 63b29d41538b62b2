//! The raw backends: io_uring with and without registered buffers, pread.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use pulsar_store::io::{BufRegion, Completion, IoBackend, PreadBackend, ReadOp, UringBackend};
use pulsar_store::{AlignedBuf, HostAllocator, PageAllocator};

fn data_file(len: usize) -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.bin");
    let data: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4096) as u8).collect();
    std::fs::File::create(&p).unwrap().write_all(&data).unwrap();
    (dir, p, data)
}

/// Read `len` bytes at `offset` into the start of `buf`, synchronously.
fn read_one(b: &mut dyn IoBackend, fd: i32, buf: &mut AlignedBuf, offset: u64, len: u32) -> std::io::Result<usize> {
    let region = BufRegion { base: buf.as_mut_ptr(), len: buf.len(), identity: std::sync::Weak::new() };
    read_region(b, fd, region, offset, len)
}

fn read_region(b: &mut dyn IoBackend, fd: i32, region: BufRegion, offset: u64, len: u32) -> std::io::Result<usize> {
    let op = ReadOp { tag: 7, fd, offset, buf: region.base, len, region };
    unsafe { b.submit(op)? };
    let mut out: Vec<Completion> = Vec::new();
    while out.is_empty() {
        b.reap(true, &mut out)?;
    }
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].tag, 7);
    out.pop().unwrap().result
}

#[test]
fn pread_backend_reads_and_reports_eof() {
    let (_d, p, data) = data_file(10_000);
    let f = std::fs::File::open(&p).unwrap();
    let mut b = PreadBackend::new(4);
    let mut buf = PageAllocator.allocate(8192, 4096).unwrap();
    assert_eq!(read_one(&mut b, f.as_raw_fd(), &mut buf, 123, 5000).unwrap(), 5000);
    assert_eq!(&buf.as_slice()[..5000], &data[123..5123]);
    assert_eq!(read_one(&mut b, f.as_raw_fd(), &mut buf, 9000, 4096).unwrap(), 1000);
    assert_eq!(read_one(&mut b, f.as_raw_fd(), &mut buf, 20_000, 4096).unwrap(), 0);
    assert_eq!(read_one(&mut b, -1, &mut buf, 0, 10).unwrap_err().raw_os_error(), Some(libc::EBADF));
}

#[test]
fn uring_direct_reads_with_registered_buffers_and_no_stale_registrations() {
    let Ok(mut b) = UringBackend::new(4, true) else {
        eprintln!("io_uring unavailable here; skipped");
        return;
    };
    let (_d, p, data) = data_file(1 << 20);
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&p).unwrap();
    let fd = f.as_raw_fd();
    let mut buf = PageAllocator.allocate(64 << 10, 4096).unwrap();
    let region = |buf: &mut AlignedBuf| BufRegion { base: buf.as_mut_ptr(), len: buf.len(), identity: identity_of(buf) };
    for (off, len) in [(0u64, 65536u32), (4096 * 7, 8192), (1 << 19, 4096)] {
        let r = region(&mut buf);
        assert_eq!(read_region(&mut b, fd, r, off, len).unwrap(), len as usize);
        assert_eq!(&buf.as_slice()[..len as usize], &data[off as usize..off as usize + len as usize]);
    }
    eprintln!("fixed reads {} active {}", b.fixed_reads(), b.fixed_buffers_active());
    let fixed_before = b.fixed_reads();
    // A new buffer (possibly at the same address) must read correctly, never
    // through the dead buffer's registration.
    drop(buf);
    let mut buf2 = PageAllocator.allocate(64 << 10, 4096).unwrap();
    let r = region(&mut buf2);
    assert_eq!(read_region(&mut b, fd, r, 4096 * 3, 65536).unwrap(), 65536);
    assert_eq!(buf2.as_slice(), &data[4096 * 3..4096 * 3 + 65536]);
    if b.fixed_buffers_active() {
        assert!(b.fixed_reads() > fixed_before);
    }
    // Misaligned offset on O_DIRECT fails in the completion with EINVAL.
    let r = region(&mut buf2);
    assert_eq!(read_region(&mut b, fd, r, 100, 4096).unwrap_err().raw_os_error(), Some(libc::EINVAL));
}

#[test]
fn uring_buffer_over_the_memlock_limit_still_reads() {
    let Ok(mut b) = UringBackend::new(2, true) else { return };
    let (_d, p, data) = data_file(24 << 20);
    let f = std::fs::File::open(&p).unwrap();
    // 20 MiB: above the default 8 MiB RLIMIT_MEMLOCK of unprivileged users.
    let mut buf = PageAllocator.allocate(20 << 20, 4096).unwrap();
    let region = BufRegion { base: buf.as_mut_ptr(), len: buf.len(), identity: identity_of(&buf) };
    assert_eq!(read_region(&mut b, f.as_raw_fd(), region, 4096, 1 << 20).unwrap(), 1 << 20);
    assert_eq!(&buf.as_slice()[..1 << 20], &data[4096..4096 + (1 << 20)]);
    eprintln!("large buffer: fixed reads {} active {}", b.fixed_reads(), b.fixed_buffers_active());
}

fn identity_of(buf: &AlignedBuf) -> std::sync::Weak<()> {
    buf.identity()
}
