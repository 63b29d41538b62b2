//! Direct-I/O alignment of an open file.

use std::ffi::CStr;
use std::os::fd::RawFd;

/// Where an alignment came from, for logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlignSource {
    /// `statx(STATX_DIOALIGN)`.
    Statx,
    /// The underlying block device's logical block size (sysfs).
    LogicalBlock,
    /// Nothing known: 4096 covers every common device.
    Default,
}

/// Required alignment of buffer addresses and of file offsets/lengths for
/// O_DIRECT reads of one file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DioAlign {
    pub mem: usize,
    pub offset: usize,
    pub source: AlignSource,
}

const FALLBACK: usize = 4096;
/// Anything larger is not a believable block size.
const MAX_ALIGN: usize = 1 << 20;

fn sane(v: u64) -> Option<usize> {
    let v = usize::try_from(v).ok()?;
    (v.is_power_of_two() && v <= MAX_ALIGN).then_some(v)
}

/// The file's direct-I/O alignment: `statx` STATX_DIOALIGN where the kernel
/// and filesystem report it, else the device's logical block size, else 4096.
/// `None` when statx says this file does not support direct I/O at all.
pub fn dio_alignment(fd: RawFd) -> Option<DioAlign> {
    // SAFETY: statx writes into the zeroed struct; an empty path with
    // AT_EMPTY_PATH means "fd itself".
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    let empty: &CStr = c"";
    let rc = unsafe { libc::statx(fd, empty.as_ptr(), libc::AT_EMPTY_PATH, libc::STATX_DIOALIGN, &mut stx) };
    if rc == 0 && stx.stx_mask & libc::STATX_DIOALIGN != 0 {
        if stx.stx_dio_offset_align == 0 {
            return None;
        }
        if let (Some(mem), Some(offset)) = (sane(stx.stx_dio_mem_align.into()), sane(stx.stx_dio_offset_align.into())) {
            return Some(DioAlign { mem, offset, source: AlignSource::Statx });
        }
    }
    if let Some(lbs) = logical_block_size(fd) {
        return Some(DioAlign { mem: lbs, offset: lbs, source: AlignSource::LogicalBlock });
    }
    Some(DioAlign { mem: FALLBACK, offset: FALLBACK, source: AlignSource::Default })
}

fn logical_block_size(fd: RawFd) -> Option<usize> {
    // SAFETY: fstat into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    let (major, minor) = (libc::major(st.st_dev), libc::minor(st.st_dev));
    // A partition's sysfs node has no queue/; its parent disk's does.
    for rel in ["queue/logical_block_size", "../queue/logical_block_size"] {
        let p = format!("/sys/dev/block/{major}:{minor}/{rel}");
        if let Ok(s) = std::fs::read_to_string(&p) {
            if let Some(v) = s.trim().parse::<u64>().ok().and_then(sane) {
                return Some(v);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn alignment_is_a_power_of_two_for_a_real_file() {
        let f = tempfile::tempfile().unwrap();
        if let Some(a) = dio_alignment(f.as_raw_fd()) {
            assert!(a.mem.is_power_of_two() && a.offset.is_power_of_two(), "{a:?}");
            eprintln!("temp file dio alignment: {a:?}");
        }
    }

    #[test]
    fn sane_rejects_odd_values() {
        assert_eq!(sane(512), Some(512));
        assert_eq!(sane(0), None);
        assert_eq!(sane(600), None);
        assert_eq!(sane(1 << 30), None);
    }
}
