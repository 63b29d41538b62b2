//! Shared helpers for the integration tests: synthetic shard files with
//! deliberately misaligned slabs, backend wrappers that inject faults, and a
//! tracing capture to count warnings.
#![allow(dead_code)]

use std::collections::HashSet;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use pulsar_gguf::GgmlType;
use pulsar_store::io::{Completion, IoBackend, PreadBackend, ReadOp};
use pulsar_store::{Catalog, SlabId, SlabKind, SlabLoc};

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A generated model: shard files and their exact contents.
pub struct Model {
    pub catalog: Catalog,
    pub contents: Vec<Vec<u8>>,
}

impl Model {
    pub fn bytes(&self, id: SlabId) -> &[u8] {
        let l = self.catalog.get(id).unwrap();
        &self.contents[l.file as usize][l.offset as usize..(l.offset + l.bytes) as usize]
    }
}

/// `layers` x `experts` triples of q8_0 slabs spread over `shards` files.
/// Slab sizes are multiples of 34 bytes and offsets are padded by odd
/// amounts, so nothing is a multiple of 512 or 4096. Layer 1 (if present)
/// uses fused gate_up.
pub fn write_model(dir: &Path, layers: u32, experts: u32, rows: u64, shards: u16, seed: u64) -> Model {
    let mut rng = Rng(seed | 1);
    let paths: Vec<PathBuf> = (0..shards).map(|i| dir.join(format!("model-{i:05}.gguf"))).collect();
    let mut contents: Vec<Vec<u8>> = (0..shards).map(|_| Vec::new()).collect();
    let mut entries = Vec::new();
    for layer in 0..layers {
        let kinds: &[SlabKind] = if layer == 1 { &[SlabKind::GateUp, SlabKind::Down] } else { &[SlabKind::Gate, SlabKind::Up, SlabKind::Down] };
        for &kind in kinds {
            for expert in 0..experts {
                let file = ((layer + expert) % shards as u32) as u16;
                let buf = &mut contents[file as usize];
                let pad = 1 + rng.below(700) as usize;
                buf.extend((0..pad).map(|_| rng.next() as u8));
                let r = if kind == SlabKind::GateUp { 2 * rows } else { rows };
                let cols = 64;
                let bytes = r * GgmlType::Q8_0.row_bytes(cols).unwrap();
                let offset = buf.len() as u64;
                buf.extend((0..bytes).map(|_| rng.next() as u8));
                entries.push((SlabId::new(layer, kind, expert), SlabLoc { file, offset, bytes, ty: GgmlType::Q8_0, rows: r, cols }));
            }
        }
    }
    for (p, c) in paths.iter().zip(&contents) {
        std::fs::File::create(p).unwrap().write_all(c).unwrap();
    }
    Model { catalog: Catalog::new(paths, entries).unwrap(), contents }
}

/// What a [`FaultyBackend`] does to reads.
#[derive(Clone, Default)]
pub struct Faults {
    /// Truncate each read (by file offset) the first time it is seen.
    pub short_once: bool,
    /// Fail reads covering this file offset of this fd-file index with EIO.
    pub eio_at: Option<u64>,
    /// Report end of file for reads covering this offset.
    pub eof_at: Option<u64>,
    /// EAGAIN on the first attempt of each read.
    pub eagain_once: bool,
    /// EINVAL for reads on O_DIRECT descriptors (undetected alignment).
    pub einval_on_direct: bool,
}

/// pread underneath, with injected faults.
pub struct FaultyBackend {
    inner: PreadBackend,
    faults: Faults,
    seen: HashSet<(i32, u64)>,
    overrides: Vec<(u64, io::Result<usize>)>,
    pub log: Arc<Mutex<Vec<(i32, u64, u32)>>>,
}

impl FaultyBackend {
    pub fn new(depth: usize, faults: Faults) -> FaultyBackend {
        FaultyBackend { inner: PreadBackend::new(depth), faults, seen: HashSet::new(), overrides: Vec::new(), log: Arc::default() }
    }
}

fn is_direct(fd: i32) -> bool {
    // SAFETY: F_GETFL on a descriptor we were handed.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_DIRECT != 0
}

impl IoBackend for FaultyBackend {
    fn name(&self) -> &'static str {
        "faulty"
    }
    fn depth(&self) -> usize {
        self.inner.depth()
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.overrides.len()
    }
    unsafe fn submit(&mut self, op: ReadOp) -> io::Result<()> {
        self.log.lock().unwrap().push((op.fd, op.offset, op.len));
        let covers = |x: u64| op.offset <= x && x < op.offset + op.len as u64;
        let first = self.seen.insert((op.fd, op.offset));
        let forced = if self.faults.einval_on_direct && is_direct(op.fd) {
            Some(Err(io::Error::from_raw_os_error(libc::EINVAL)))
        } else if self.faults.eio_at.is_some_and(covers) {
            Some(Err(io::Error::from_raw_os_error(libc::EIO)))
        } else if self.faults.eof_at.is_some_and(covers) {
            Some(Ok(0))
        } else if self.faults.eagain_once && first {
            Some(Err(io::Error::from_raw_os_error(libc::EAGAIN)))
        } else {
            None
        };
        if let Some(r) = forced {
            self.overrides.push((op.tag, r));
            return Ok(());
        }
        let tag = op.tag;
        let len = op.len as usize;
        unsafe { self.inner.submit(op)? };
        if self.faults.short_once && first && len > 1 {
            // Complete now so the count can be cut: an odd, unaligned length.
            let mut v = Vec::new();
            self.inner.reap(false, &mut v)?;
            for c in v {
                let r = c.result.map(|n| if c.tag == tag { (n / 2) | 1 } else { n });
                self.overrides.push((c.tag, r));
            }
        }
        Ok(())
    }
    fn reap(&mut self, wait: bool, out: &mut Vec<Completion>) -> io::Result<()> {
        out.extend(self.overrides.drain(..).map(|(tag, result)| Completion { tag, result }));
        self.inner.reap(wait, out)
    }
}

/// Collects formatted tracing output so tests can count warnings.
#[derive(Clone, Default)]
pub struct Captured(pub Arc<Mutex<Vec<u8>>>);

impl Captured {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
    pub fn count(&self, needle: &str) -> usize {
        self.text().matches(needle).count()
    }
}

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Run `f` with warnings captured (this thread only).
pub fn with_captured_logs<R>(f: impl FnOnce() -> R) -> (R, Captured) {
    let cap = Captured::default();
    let c2 = cap.clone();
    let sub = tracing_subscriber::fmt().with_writer(move || c2.clone()).with_ansi(false).with_max_level(tracing::Level::WARN).finish();
    let r = tracing::subscriber::with_default(sub, f);
    (r, cap)
}
