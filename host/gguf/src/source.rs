//! Where the parser's bytes come from: a memory slice (an mmap, a fuzzer's
//! input, a test's buffer) or a file read with positional reads (pread).
//!
//! The parser only ever asks for a bounded window at a known offset, so a
//! source never has to be read whole.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// A random-access, fixed-length byte source.
pub trait ByteSource {
    /// Total length in bytes.
    fn len(&self) -> u64;

    /// True when the source has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fills `buf` with the bytes at `offset..offset + buf.len()`.
    /// Callers keep the range inside `len()`; a source may still fail (I/O).
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

impl ByteSource for [u8] {
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let src = start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl<T: ByteSource + ?Sized> ByteSource for &T {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        (**self).read_exact_at(offset, buf)
    }
}

/// A file read with `pread`; its length is taken once, when opened.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    len: u64,
}

impl FileSource {
    /// Wraps an open file, recording its current length.
    pub fn new(file: File) -> io::Result<Self> {
        let len = file.metadata()?.len();
        Ok(FileSource { file, len })
    }

    /// The underlying file.
    pub fn file(&self) -> &File {
        &self.file
    }
}

impl ByteSource for FileSource {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_exact_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        // FileExt::read_exact_at retries on EINTR and short reads, and reports
        // UnexpectedEof if the file shrank underneath us.
        FileExt::read_exact_at(&self.file, buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn slice_and_file_sources_agree_and_refuse_out_of_range() {
        let data: Vec<u8> = (0..=255u8).collect();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&data).unwrap();
        let fs = FileSource::new(f).unwrap();
        let s: &[u8] = &data;
        assert_eq!(ByteSource::len(s), 256);
        assert_eq!(fs.len(), 256);
        let (mut a, mut b) = ([0u8; 7], [0u8; 7]);
        s.read_exact_at(100, &mut a).unwrap();
        fs.read_exact_at(100, &mut b).unwrap();
        assert_eq!(a, b);
        assert_eq!(a[0], 100);
        assert!(s.read_exact_at(250, &mut a).is_err());
        assert!(fs.read_exact_at(250, &mut b).is_err());
        assert!(s.read_exact_at(u64::MAX, &mut a).is_err());
    }
}
