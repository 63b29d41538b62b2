//! Tier 4: reading slabs from the shard files.
//!
//! Each slab's byte range is widened to the file's direct-I/O alignment, read
//! in pieces of at most `max_read_bytes` (so one large slab still fills the
//! queue), and handed back as the exact sub-slice through a callback the
//! moment its last piece lands, while other reads are still in flight.
//! Short reads are resubmitted from the last aligned position, EINTR/EAGAIN
//! retried; any other failure names the slab, file and offset. Nothing is
//! ever returned for a read that did not complete.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::buffer::{page_size, AlignedBuf, HostAllocator};
use crate::catalog::{Catalog, SlabId, SlabLoc};
use crate::error::{Result, StoreError};
use crate::io::{dio_alignment, is_transient, BufRegion, Completion, IoBackend, PreadBackend, ReadOp, UringBackend};

/// Consecutive short reads without progress (or transient errors) tolerated
/// on one piece before it is an error: a file shrinking under us must not hang.
const MAX_STALLS: u32 = 8;
const MAX_TRANSIENT_RETRIES: u32 = 64;

/// Logs a warning at most once across every reader sharing it.
#[derive(Clone, Debug, Default)]
pub struct WarnOnce(Arc<AtomicBool>);

impl WarnOnce {
    pub fn new() -> WarnOnce {
        WarnOnce::default()
    }
    /// Whether the warning has been emitted.
    pub fn fired(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
    fn warn(&self, msg: &str) {
        if !self.0.swap(true, Ordering::Relaxed) {
            tracing::warn!("{msg}");
        }
    }
}

/// Disk reader configuration.
#[derive(Clone, Debug)]
pub struct ReaderOptions {
    /// Reads in flight at once (per backend).
    pub queue_depth: usize,
    /// Largest single read; slabs are split into pieces of this size.
    pub max_read_bytes: usize,
    /// Try O_DIRECT. `false` reads through the page cache by choice (no warning).
    pub direct: bool,
    /// Try io_uring. `false` uses pread by choice (no warning).
    pub io_uring: bool,
    /// Try registered buffers with io_uring.
    pub fixed_buffers: bool,
    /// Shared by readers of one store so the fallback warning fires once.
    pub warn_once: WarnOnce,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions { queue_depth: 32, max_read_bytes: 1 << 20, direct: true, io_uring: true, fixed_buffers: true, warn_once: WarnOnce::new() }
    }
}

/// Counters of one reader, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ReadCounters {
    pub slabs: u64,
    /// Slab bytes delivered.
    pub bytes: u64,
    /// Bytes the device transferred, alignment padding and re-reads included.
    pub transferred: u64,
    pub ops: u64,
    pub short_reads: u64,
    pub retries: u64,
    /// Wall time inside `read`.
    pub seconds: f64,
}

/// One slab to read into a caller-supplied buffer of at least
/// [`DiskReader::buffer_len`] bytes aligned to [`DiskReader::buffer_align`].
#[derive(Debug)]
pub struct SlabRead {
    pub id: SlabId,
    pub loc: SlabLoc,
    pub buf: AlignedBuf,
}

/// A slab's bytes: the exact range inside its (aligned, larger) buffer.
#[derive(Debug)]
pub struct SlabData {
    id: SlabId,
    buf: AlignedBuf,
    range: Range<usize>,
}

impl SlabData {
    /// `range` must lie within `buf`.
    pub fn new(id: SlabId, buf: AlignedBuf, range: Range<usize>) -> Option<SlabData> {
        (range.start <= range.end && range.end <= buf.len()).then_some(SlabData { id, buf, range })
    }
    pub fn id(&self) -> SlabId {
        self.id
    }
    pub fn bytes(&self) -> &[u8] {
        &self.buf.as_slice()[self.range.clone()]
    }
    /// The whole buffer (what counts against a memory budget).
    pub fn buffer(&self) -> &AlignedBuf {
        &self.buf
    }
    pub fn into_buffer(self) -> AlignedBuf {
        self.buf
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Main,
    Fallback,
}

struct Shard {
    path: PathBuf,
    file: File,
    len: u64,
    direct: bool,
    /// Offset/length alignment of reads (1 when buffered).
    align: u64,
    route: Route,
}

#[derive(Clone, Copy, Debug)]
struct Piece {
    slab: usize,
    pos: u64,
    len: u32,
    stalls: u32,
    retries: u32,
    /// Last submitted on an O_DIRECT descriptor.
    direct: bool,
}

struct SlabState {
    req: SlabRead,
    /// File position of byte 0 of the buffer.
    base: u64,
    pending: usize,
}

/// Reads slabs from shard files (tier 4).
pub struct DiskReader {
    shards: Vec<Shard>,
    main: Option<Box<dyn IoBackend>>,
    fallback: PreadBackend,
    /// Main is a test/caller-supplied backend: it gets buffered shards too.
    injected: bool,
    max_read: u64,
    buf_align: usize,
    span_align: u64,
    warn: WarnOnce,
    fallback_reason: Option<String>,
    counters: ReadCounters,
    next_tag: u64,
    /// Files replaced while reads on them may still be in flight.
    retired: Vec<File>,
}

type Opener<'a> = &'a dyn Fn(&Path, bool) -> io::Result<File>;

fn open_file(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true).custom_flags(if direct { libc::O_DIRECT } else { 0 });
    o.open(path)
}

/// Bytes that hold the `align`-aligned superset of any `bytes`-long range.
pub fn aligned_buffer_len(bytes: u64, align: u64) -> u64 {
    if align <= 1 { bytes } else { round_up(bytes, align) + align }
}

fn round_down(v: u64, a: u64) -> u64 {
    v - v % a
}

fn round_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl DiskReader {
    /// Open every shard of the catalogue: io_uring + O_DIRECT where possible,
    /// with one warning if anything falls back to buffered pread.
    pub fn open(catalog: &Catalog, opts: &ReaderOptions) -> Result<DiskReader> {
        let mut reasons = Vec::new();
        let main: Option<Box<dyn IoBackend>> = if opts.io_uring {
            match UringBackend::new(opts.queue_depth, opts.fixed_buffers) {
                Ok(b) => Some(Box::new(b)),
                Err(e) => {
                    reasons.push(format!("io_uring unavailable ({e})"));
                    None
                }
            }
        } else {
            None
        };
        Self::build(catalog, opts, main, false, &open_file, reasons)
    }

    /// Like [`DiskReader::open`] with a supplied backend for every shard
    /// (tests inject short reads and errors this way).
    pub fn with_backend(catalog: &Catalog, opts: &ReaderOptions, backend: Box<dyn IoBackend>) -> Result<DiskReader> {
        Self::build(catalog, opts, Some(backend), true, &open_file, Vec::new())
    }

    fn build(catalog: &Catalog, opts: &ReaderOptions, main: Option<Box<dyn IoBackend>>, injected: bool, opener: Opener<'_>, mut reasons: Vec<String>) -> Result<DiskReader> {
        let mut shards = Vec::with_capacity(catalog.files().len());
        let mut refused = Vec::new();
        let mut buf_align = page_size();
        let mut span_align = 1u64;
        for path in catalog.files() {
            let open_err = |source| StoreError::Open { file: path.clone(), source };
            let mut direct_file = None;
            if opts.direct {
                match opener(path, true) {
                    Ok(f) => match dio_alignment(f.as_raw_fd()) {
                        Some(a) => direct_file = Some((f, a)),
                        None => refused.push(format!("{}: filesystem reports no direct I/O", path.display())),
                    },
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => refused.push(format!("{}: {e}", path.display())),
                    Err(e) => return Err(open_err(e)),
                }
            }
            let (file, direct, align) = match direct_file {
                Some((f, a)) => {
                    buf_align = buf_align.max(a.mem).max(a.offset);
                    (f, true, a.offset as u64)
                }
                None => (opener(path, false).map_err(open_err)?, false, 1),
            };
            span_align = span_align.max(align);
            let len = file.metadata().map_err(open_err)?.len();
            let route = if main.is_some() && (direct || injected) { Route::Main } else { Route::Fallback };
            shards.push(Shard { path: path.clone(), file, len, direct, align, route });
        }
        for (id, loc) in catalog.slabs() {
            let s = &shards[usize::from(loc.file)];
            let end = loc.offset + loc.bytes;
            if end > s.len {
                return Err(StoreError::SlabPastEof { slab: *id, file: s.path.clone(), end, file_len: s.len });
            }
        }
        if !refused.is_empty() {
            reasons.push(format!("O_DIRECT refused for {} of {} shard(s) ({})", refused.len(), shards.len(), refused[0]));
        }
        let fallback_reason = (!reasons.is_empty()).then(|| reasons.join("; "));
        if let Some(r) = &fallback_reason {
            opts.warn_once.warn(&format!("expert store: using buffered pread fallback: {r}"));
        }
        let max_read = (opts.max_read_bytes.clamp(4096, 1 << 30) as u64).max(span_align);
        Ok(DiskReader {
            shards,
            main,
            fallback: PreadBackend::new(opts.queue_depth),
            injected,
            max_read,
            buf_align,
            span_align,
            warn: opts.warn_once.clone(),
            fallback_reason,
            counters: ReadCounters::default(),
            next_tag: 0,
            retired: Vec::new(),
        })
    }

    /// Buffer bytes needed to read a slab of `bytes` bytes at any offset.
    pub fn buffer_len(&self, bytes: u64) -> usize {
        aligned_buffer_len(bytes, self.span_align) as usize
    }

    /// The largest offset alignment of any shard (1 if all are buffered).
    pub fn span_align(&self) -> u64 {
        self.span_align
    }

    /// Alignment destination buffers must have.
    pub fn buffer_align(&self) -> usize {
        self.buf_align
    }

    /// Why (if at all) some reads use the buffered pread fallback.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Whether shard `file` is read with O_DIRECT.
    pub fn is_direct(&self, file: u16) -> bool {
        self.shards.get(usize::from(file)).is_some_and(|s| s.direct)
    }

    /// Name of the backend serving O_DIRECT shards ("io_uring", "pread", ...).
    pub fn backend_name(&self) -> &'static str {
        self.main.as_ref().map_or("pread", |b| b.name())
    }

    pub fn counters(&self) -> ReadCounters {
        self.counters
    }

    /// Read slabs into their buffers; `on_slab` gets each one as soon as it is
    /// complete. The first error (a read, or one `on_slab` returns) stops new
    /// submissions, waits for reads in flight, and is returned.
    pub fn read(&mut self, reqs: Vec<SlabRead>, on_slab: &mut dyn FnMut(SlabData) -> Result<()>) -> Result<()> {
        let t0 = Instant::now();
        let mut flight = Flight { states: Vec::with_capacity(reqs.len()), reader: self, tags: HashMap::new() };
        let res = flight.run(reqs, on_slab);
        let drained = flight.drain();
        drop(flight);
        self.retired.clear();
        self.counters.seconds += t0.elapsed().as_secs_f64();
        match (res, drained) {
            (Err(e), _) => Err(e),
            (Ok(()), Err(e)) => Err(e),
            (Ok(()), Ok(())) => Ok(()),
        }
    }

    /// Read catalogue slabs into fresh buffers from `alloc`.
    pub fn read_alloc(&mut self, catalog: &Catalog, ids: &[SlabId], alloc: &dyn HostAllocator, on_slab: &mut dyn FnMut(SlabData) -> Result<()>) -> Result<()> {
        let mut reqs = Vec::with_capacity(ids.len());
        for &id in ids {
            let loc = *catalog.loc(id)?;
            let buf = alloc.allocate(self.buffer_len(loc.bytes), self.buf_align)?;
            reqs.push(SlabRead { id, loc, buf });
        }
        self.read(reqs, on_slab)
    }

    fn backend(&mut self, r: Route) -> &mut dyn IoBackend {
        match r {
            Route::Main => self.main.as_deref_mut().expect("main route only assigned with a main backend"),
            Route::Fallback => &mut self.fallback,
        }
    }

    fn in_flight(&self) -> usize {
        self.fallback.in_flight() + self.main.as_ref().map_or(0, |m| m.in_flight())
    }

    /// A direct shard whose reads fail with EINVAL (alignment we could not
    /// detect): reopen it buffered and move its reads to the pread path.
    fn demote(&mut self, file: usize, err: &io::Error) -> Result<()> {
        let s = &self.shards[file];
        if !s.direct {
            return Ok(());
        }
        let f = open_file(&s.path, false).map_err(|source| StoreError::Open { file: s.path.clone(), source })?;
        let msg = format!("expert store: using buffered pread fallback: O_DIRECT read of {} failed ({err})", s.path.display());
        let s = &mut self.shards[file];
        self.retired.push(std::mem::replace(&mut s.file, f));
        s.direct = false;
        s.align = 1;
        if !self.injected {
            s.route = Route::Fallback;
        }
        self.fallback_reason.get_or_insert_with(|| msg.clone());
        self.warn.warn(&msg);
        Ok(())
    }
}

/// The reads of one `read` call. Dropping it waits for everything in flight
/// (also on unwind), and leaks the buffers if the kernel could not be waited
/// for, so freed memory is never written.
struct Flight<'a> {
    reader: &'a mut DiskReader,
    states: Vec<Option<SlabState>>,
    tags: HashMap<u64, (Route, Piece)>,
}

impl Flight<'_> {
    fn run(&mut self, reqs: Vec<SlabRead>, on_slab: &mut dyn FnMut(SlabData) -> Result<()>) -> Result<()> {
        let mut queues: [VecDeque<Piece>; 2] = [VecDeque::new(), VecDeque::new()];
        for req in reqs {
            let shard = self.reader.shards.get(usize::from(req.loc.file)).ok_or(StoreError::BadFileIndex {
                slab: req.id,
                file: req.loc.file,
                n_files: self.reader.shards.len(),
            })?;
            let end = req.loc.offset.checked_add(req.loc.bytes).ok_or(StoreError::RangeOverflow { slab: req.id, offset: req.loc.offset, bytes: req.loc.bytes })?;
            if end > shard.len {
                return Err(StoreError::SlabPastEof { slab: req.id, file: shard.path.clone(), end, file_len: shard.len });
            }
            let a = shard.align;
            let (start, stop) = (round_down(req.loc.offset, a), round_up(end, a));
            let need = (stop - start) as usize;
            let align = self.reader.buf_align;
            if req.buf.len() < need || !(req.buf.as_ptr() as usize).is_multiple_of(align) {
                return Err(StoreError::BadBuffer { slab: req.id, have: req.buf.len(), need, align });
            }
            let piece_max = round_down(self.reader.max_read, a).max(a);
            let slab = self.states.len();
            let mut pos = start;
            let mut pending = 0;
            while pos < stop {
                let len = (stop - pos).min(piece_max);
                queues[shard.route as usize].push_back(Piece { slab, pos, len: len as u32, stalls: 0, retries: 0, direct: false });
                pos += len;
                pending += 1;
            }
            self.states.push(Some(SlabState { req, base: start, pending }));
        }

        let mut done = Vec::new();
        loop {
            for route in [Route::Main, Route::Fallback] {
                while let Some(p) = queues[route as usize].front().copied() {
                    let backend = self.reader.backend(route);
                    if backend.in_flight() >= backend.depth() {
                        break;
                    }
                    queues[route as usize].pop_front();
                    self.submit(route, p)?;
                }
            }
            if self.reader.in_flight() == 0 {
                return Ok(());
            }
            done.clear();
            self.reap(&mut done)?;
            for c in done.drain(..) {
                self.complete(c, &mut queues, on_slab)?;
            }
        }
    }

    fn submit(&mut self, route: Route, mut p: Piece) -> Result<()> {
        let state = self.states[p.slab].as_mut().expect("pieces only exist for pending slabs");
        let shard = &self.reader.shards[usize::from(state.req.loc.file)];
        let fd = shard.file.as_raw_fd();
        p.direct = shard.direct;
        let buf_off = (p.pos - state.base) as usize;
        let region = BufRegion { base: state.req.buf.as_mut_ptr(), len: state.req.buf.len(), identity: state.req.buf.identity() };
        // SAFETY: buf_off + len <= need <= buf.len() (checked when queued).
        let ptr = unsafe { region.base.add(buf_off) };
        let tag = self.reader.next_tag;
        self.reader.next_tag += 1;
        let op = ReadOp { tag, fd, offset: p.pos, buf: ptr, len: p.len, region };
        let id = state.req.id;
        let path = shard.path.clone();
        // SAFETY: the buffer lives in self.states until this Flight is
        // drained (Drop), and nothing else touches it while in flight.
        let backend = self.reader.backend(route);
        let name = backend.name();
        unsafe { backend.submit(op) }.map_err(|source| match source.raw_os_error() {
            Some(_) => StoreError::Read { slab: id, file: path, offset: p.pos, source },
            None => StoreError::Backend { backend: name, source },
        })?;
        self.tags.insert(tag, (route, p));
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        // pread completions are ready at once; only block on the async backend
        // when there is nothing else to process.
        self.reader.fallback.reap(false, out).map_err(|source| StoreError::Backend { backend: "pread", source })?;
        if let Some(m) = self.reader.main.as_deref_mut() {
            let wait = out.is_empty();
            m.reap(wait, out).map_err(|source| StoreError::Backend { backend: m.name(), source })?;
        }
        Ok(())
    }

    fn complete(&mut self, c: Completion, queues: &mut [VecDeque<Piece>; 2], on_slab: &mut dyn FnMut(SlabData) -> Result<()>) -> Result<()> {
        let Some((route, mut p)) = self.tags.remove(&c.tag) else {
            return Ok(()); // not ours (a backend bug); nothing to account
        };
        let state = self.states[p.slab].as_ref().expect("completion for a pending slab");
        let loc = state.req.loc;
        let id = state.req.id;
        let file = usize::from(loc.file);
        let need_end = loc.offset + loc.bytes;
        let counters = &mut self.reader.counters;
        match c.result {
            Ok(n) => {
                counters.ops += 1;
                counters.transferred += n as u64;
                let got = p.pos + n as u64;
                if n < p.len as usize && got < need_end {
                    if n == 0 {
                        return Err(StoreError::UnexpectedEof { slab: id, file: self.reader.shards[file].path.clone(), offset: p.pos, missing: need_end - p.pos });
                    }
                    counters.short_reads += 1;
                    let a = self.reader.shards[file].align;
                    let resume = round_down(got, a).max(p.pos);
                    if resume == p.pos {
                        p.stalls += 1;
                        if p.stalls > MAX_STALLS {
                            return Err(StoreError::UnexpectedEof { slab: id, file: self.reader.shards[file].path.clone(), offset: got, missing: need_end - got });
                        }
                    } else {
                        p.stalls = 0;
                    }
                    p.len -= (resume - p.pos) as u32;
                    p.pos = resume;
                    queues[route as usize].push_front(p);
                    return Ok(());
                }
            }
            Err(e) if is_transient(&e) && p.retries < MAX_TRANSIENT_RETRIES => {
                counters.retries += 1;
                p.retries += 1;
                queues[route as usize].push_front(p);
                return Ok(());
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && p.direct => {
                // Reads already in flight on the old descriptor fail the same
                // way; only the first demotes, all are resubmitted.
                self.reader.demote(file, &e)?;
                let new_route = self.reader.shards[file].route;
                if new_route != route {
                    // Move this shard's queued pieces to the pread path.
                    let states = &self.states;
                    let (moved, kept): (Vec<Piece>, Vec<Piece>) = queues[route as usize]
                        .drain(..)
                        .partition(|q| states[q.slab].as_ref().is_some_and(|s| usize::from(s.req.loc.file) == file));
                    queues[route as usize].extend(kept);
                    queues[new_route as usize].extend(moved);
                }
                queues[new_route as usize].push_front(p);
                return Ok(());
            }
            Err(source) => {
                return Err(StoreError::Read { slab: id, file: self.reader.shards[file].path.clone(), offset: p.pos, source });
            }
        }
        let state = self.states[p.slab].as_mut().expect("pending");
        state.pending -= 1;
        if state.pending == 0 {
            let s = self.states[p.slab].take().expect("pending");
            let start = (s.req.loc.offset - s.base) as usize;
            let data = SlabData { id: s.req.id, buf: s.req.buf, range: start..start + s.req.loc.bytes as usize };
            self.reader.counters.slabs += 1;
            self.reader.counters.bytes += s.req.loc.bytes;
            on_slab(data)?;
        }
        Ok(())
    }

    /// Wait for every read in flight, discarding results.
    fn drain(&mut self) -> Result<()> {
        let mut sink = Vec::new();
        while self.reader.in_flight() > 0 {
            sink.clear();
            self.reap(&mut sink)?;
            for c in sink.drain(..) {
                self.tags.remove(&c.tag);
            }
        }
        Ok(())
    }
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        if self.drain().is_err() {
            // The kernel may still write into these buffers: never free them.
            for s in self.states.drain(..).flatten() {
                std::mem::forget(s.req.buf);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::PageAllocator;
    use crate::catalog::SlabKind;
    use pulsar_gguf::GgmlType;
    use std::io::Write;

    fn one_slab_file(dir: &Path) -> (Catalog, Vec<u8>) {
        let path = dir.join("m.bin");
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        File::create(&path).unwrap().write_all(&data).unwrap();
        let loc = SlabLoc { file: 0, offset: 1000, bytes: 4 * 34 * 10, ty: GgmlType::Q8_0, rows: 4, cols: 320 };
        let mut e = Vec::new();
        for (i, k) in [SlabKind::Gate, SlabKind::Up, SlabKind::Down].into_iter().enumerate() {
            e.push((SlabId::new(0, k, 0), SlabLoc { offset: 1000 + i as u64 * 3001, ..loc }));
        }
        (Catalog::new(vec![path], e).unwrap(), data)
    }

    #[test]
    fn open_time_direct_refusal_falls_back_with_one_reason() {
        let dir = tempfile::tempdir().unwrap();
        let (cat, data) = one_slab_file(dir.path());
        let refuse: Opener<'_> = &|p, direct| if direct { Err(io::Error::from_raw_os_error(libc::EINVAL)) } else { open_file(p, false) };
        let opts = ReaderOptions::default();
        let mut r = DiskReader::build(&cat, &opts, Some(Box::new(UringBackend::new(8, true).unwrap())), false, refuse, Vec::new()).unwrap();
        assert!(opts.warn_once.fired());
        assert!(r.fallback_reason().unwrap().contains("O_DIRECT refused for 1 of 1"), "{:?}", r.fallback_reason());
        assert!(!r.is_direct(0));
        let ids: Vec<_> = cat.slabs().iter().map(|e| e.0).collect();
        let mut got = 0;
        r.read_alloc(&cat, &ids, &PageAllocator, &mut |d| {
            let loc = cat.get(d.id()).unwrap();
            assert_eq!(d.bytes(), &data[loc.offset as usize..(loc.offset + loc.bytes) as usize]);
            got += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(got, 3);
    }

    #[test]
    fn no_io_uring_means_pread_for_everything_with_the_reason_warned() {
        let dir = tempfile::tempdir().unwrap();
        let (cat, data) = one_slab_file(dir.path());
        let opts = ReaderOptions::default();
        let mut r = DiskReader::build(&cat, &opts, None, false, &open_file, vec!["io_uring unavailable (simulated)".into()]).unwrap();
        assert!(opts.warn_once.fired());
        assert_eq!(r.backend_name(), "pread");
        assert!(r.fallback_reason().unwrap().contains("io_uring unavailable"));
        let ids: Vec<_> = cat.slabs().iter().map(|e| e.0).collect();
        r.read_alloc(&cat, &ids, &PageAllocator, &mut |d| {
            let loc = cat.get(d.id()).unwrap();
            assert_eq!(d.bytes(), &data[loc.offset as usize..(loc.offset + loc.bytes) as usize]);
            Ok(())
        })
        .unwrap();
        assert_eq!(r.counters().slabs, 3);
        // Chosen, not forced: no warning.
        let quiet = ReaderOptions { io_uring: false, ..Default::default() };
        DiskReader::open(&cat, &quiet).unwrap();
        assert!(!quiet.warn_once.fired());
    }

    #[test]
    fn open_errors_other_than_einval_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let (cat, _) = one_slab_file(dir.path());
        let deny: Opener<'_> = &|_, _| Err(io::Error::from_raw_os_error(libc::EACCES));
        let err = DiskReader::build(&cat, &ReaderOptions::default(), None, false, deny, Vec::new()).err().unwrap();
        assert!(matches!(err, StoreError::Open { .. }));
        assert!(err.to_string().contains("m.bin"), "{err}");
    }

    #[test]
    fn slab_past_end_of_file_is_caught_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let (cat, _) = one_slab_file(dir.path());
        let mut e = cat.slabs().to_vec();
        e[0].1.offset = 19_900;
        let cat = Catalog::new(cat.files().to_vec(), e).unwrap();
        let err = DiskReader::open(&cat, &ReaderOptions::default()).err().unwrap();
        assert!(matches!(err, StoreError::SlabPastEof { end, .. } if end == 19_900 + 1360), "{err}");
    }

    #[test]
    fn buffer_too_small_is_an_error_not_a_write_past_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let (cat, _) = one_slab_file(dir.path());
        let mut r = DiskReader::open(&cat, &ReaderOptions::default()).unwrap();
        let (id, loc) = cat.slabs()[0];
        let buf = PageAllocator.allocate(100, 4096).unwrap();
        let err = r.read(vec![SlabRead { id, loc, buf }], &mut |_| Ok(())).unwrap_err();
        assert!(matches!(err, StoreError::BadBuffer { .. }), "{err}");
    }
}
