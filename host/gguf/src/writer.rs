//! [`GgufWriter`]: streams a GGUF v3 file (or a split shard set) to disk.
//!
//! Two phases, because the header (with every tensor's offset) precedes the
//! data: first declare metadata and tensors, then [`GgufWriter::create`]
//! writes the headers and returns a [`TensorDataWriter`] that takes each
//! tensor's bytes, from a slice or chunk by chunk from a callback, in any
//! order. Memory use is the header plus one chunk, whatever the file size.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::metadata::Metadata;
use crate::parse::{align_up, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, VERSION};
use crate::split::{shard_path, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT};
use crate::tensor::{tensor_bytes, TensorInfo, MAX_DIMS};
use crate::value::{Array, Value};
use crate::GgmlType;

/// Somewhere a shard can be written at arbitrary offsets.
pub trait WriteAt {
    /// Writes all of `buf` at `offset`, growing the output as needed.
    fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()>;
    /// Sets the final length (zero-filling any gap).
    fn set_len(&mut self, len: u64) -> io::Result<()>;
}

impl WriteAt for File {
    fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        FileExt::write_all_at(self, buf, offset)
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        File::set_len(self, len)
    }
}

impl WriteAt for Vec<u8> {
    fn write_all_at(&mut self, offset: u64, buf: &[u8]) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::OutOfMemory)?;
        let end = start.checked_add(buf.len()).ok_or(io::ErrorKind::OutOfMemory)?;
        if self.len() < end {
            self.resize(end, 0);
        }
        self[start..end].copy_from_slice(buf);
        Ok(())
    }
    fn set_len(&mut self, len: u64) -> io::Result<()> {
        self.resize(usize::try_from(len).map_err(|_| io::ErrorKind::OutOfMemory)?, 0);
        Ok(())
    }
}

/// Declares the contents of a GGUF file. The data alignment is the
/// `general.alignment` key when one is added (a power of two), else 32.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Metadata,
    tensors: Vec<(String, Vec<u64>, GgmlType, u64)>,
    names: HashMap<String, usize>,
    alignment: Option<u64>,
    max_shard_bytes: Option<u64>,
    chunk_bytes: Option<usize>,
}

const DEFAULT_CHUNK: usize = 8 << 20;

fn werr(msg: impl Into<String>) -> GgufError {
    GgufError::Writer(msg.into())
}

fn depth_ok(a: &Array, depth: usize) -> bool {
    match a {
        Array::Array(v) => depth + 1 < MAX_ARRAY_DEPTH && v.iter().all(|x| depth_ok(x, depth + 1)),
        _ => true,
    }
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata key (in order). Duplicate and empty keys are errors;
    /// `general.alignment` must be an integer power of two and sets the
    /// alignment of every shard.
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Result<()> {
        let key = key.into();
        let value = value.into();
        if key.is_empty() {
            return Err(werr("empty metadata key"));
        }
        if let Value::Array(a) = &value {
            if !depth_ok(a, 0) {
                return Err(werr(format!("key '{key}': arrays nested more than {MAX_ARRAY_DEPTH} deep")));
            }
        }
        if key == ALIGNMENT_KEY {
            let a = value
                .as_i128()
                .and_then(|a| u32::try_from(a).ok())
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| werr(format!("'{ALIGNMENT_KEY}' must be a u32 power of two, got {value:?}")))?;
            self.alignment = Some(a.into());
        }
        if !self.metadata.insert(key.clone(), value) {
            return Err(werr(format!("duplicate metadata key '{key}'")));
        }
        Ok(())
    }

    /// Declares a tensor; `dims` in ggml order (`dims[0]` = row length).
    pub fn add_tensor(&mut self, name: impl Into<String>, dims: &[u64], ty: GgmlType) -> Result<()> {
        let name = name.into();
        if name.is_empty() {
            return Err(werr("empty tensor name"));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS || dims.contains(&0) {
            return Err(werr(format!("tensor '{name}': shape {dims:?} must have 1..={MAX_DIMS} dims, all >= 1")));
        }
        let n_bytes = tensor_bytes(ty, dims).map_err(|e| werr(format!("tensor '{name}': {e}")))?;
        if self.names.contains_key(&name) {
            return Err(werr(format!("duplicate tensor name '{name}'")));
        }
        self.names.insert(name.clone(), self.tensors.len());
        self.tensors.push((name, dims.to_vec(), ty, n_bytes));
        Ok(())
    }

    /// Splits the output into shards of at most `n` data bytes each (a single
    /// tensor larger than `n` gets a shard of its own). When this yields more
    /// than one shard the files are named `<stem>-NNNNN-of-NNNNN.gguf` and
    /// carry the `split.*` keys; with one shard the plain path is used.
    pub fn set_max_shard_bytes(&mut self, n: u64) {
        self.max_shard_bytes = Some(n);
    }

    /// Size of the buffer handed to [`TensorDataWriter::write_tensor_with`]
    /// callbacks (default 8 MiB; rounded to whole rows).
    pub fn set_chunk_bytes(&mut self, n: usize) {
        self.chunk_bytes = Some(n.max(1));
    }

    fn alignment(&self) -> u64 {
        self.alignment.unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Which tensors go in which shard.
    fn plan(&self) -> Vec<Vec<usize>> {
        let align = self.alignment();
        let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
        let mut used = 0u64;
        for (i, t) in self.tensors.iter().enumerate() {
            let size = align_up(t.3, align).unwrap_or(u64::MAX);
            if let Some(max) = self.max_shard_bytes {
                let cur = shards.last_mut().expect("never empty");
                if !cur.is_empty() && used.saturating_add(size) > max {
                    shards.push(Vec::new());
                    used = 0;
                }
            }
            used = used.saturating_add(size);
            shards.last_mut().expect("never empty").push(i);
        }
        shards
    }

    /// Creates the file(s) at `path` (the base path when split), writes the
    /// headers and returns the writer for the tensor data.
    pub fn create(self, path: impl AsRef<Path>) -> Result<TensorDataWriter<File>> {
        self.create_with(path.as_ref(), false)
    }

    /// Like [`GgufWriter::create`], but every file is created new: an
    /// existing file or symlink at a path is an error, never truncated or
    /// followed (for temporary files beside user data).
    pub fn create_new(self, path: impl AsRef<Path>) -> Result<TensorDataWriter<File>> {
        self.create_with(path.as_ref(), true)
    }

    fn create_with(self, path: &Path, exclusive: bool) -> Result<TensorDataWriter<File>> {
        let plan = self.plan();
        let n = plan.len();
        let paths: Vec<PathBuf> =
            if n == 1 { vec![path.to_path_buf()] } else { (0..n).map(|i| shard_path(path, i, n)).collect() };
        let mut sinks = Vec::with_capacity(n);
        for p in &paths {
            let f = if exclusive { crate::tempfile::create_exclusive(p) } else { File::create(p) };
            let f = f.map_err(|e| GgufError::io(format!("creating {}", p.display()), e))?;
            sinks.push(f);
        }
        self.start(plan, sinks, paths)
    }

    /// Like [`GgufWriter::create`], into memory (one `Vec<u8>` per shard).
    pub fn in_memory(self) -> Result<TensorDataWriter<Vec<u8>>> {
        let plan = self.plan();
        let sinks = vec![Vec::new(); plan.len()];
        self.start(plan, sinks, Vec::new())
    }

    fn start<S: WriteAt>(self, plan: Vec<Vec<usize>>, mut sinks: Vec<S>, paths: Vec<PathBuf>) -> Result<TensorDataWriter<S>> {
        let n = plan.len();
        let align = self.alignment();
        let split = n > 1;
        if split && self.metadata.keys().any(|k| k.starts_with("split.")) {
            return Err(werr("'split.*' keys are written by the writer itself when splitting"));
        }
        let count = u16::try_from(n).map_err(|_| werr(format!("{n} shards is more than split.count (u16) allows")))?;
        let total = i32::try_from(self.tensors.len()).map_err(|_| werr("too many tensors for split.tensors.count"))?;
        let mut infos = Vec::with_capacity(self.tensors.len());
        let mut ends = Vec::with_capacity(n);
        for (s, members) in plan.iter().enumerate() {
            let mut md = if s == 0 { self.metadata.clone() } else { Metadata::new() };
            if s > 0 && align != DEFAULT_ALIGNMENT {
                md.insert(ALIGNMENT_KEY, Value::U32(align as u32));
            }
            if split {
                md.insert(SPLIT_NO, Value::U16(s as u16));
                md.insert(SPLIT_COUNT, Value::U16(count));
                md.insert(SPLIT_TENSORS_COUNT, Value::I32(total));
            }
            let mut rel = 0u64;
            let mut dir = Vec::with_capacity(members.len());
            for &i in members {
                let (name, dims, ty, n_bytes) = &self.tensors[i];
                dir.push((name.as_str(), dims.as_slice(), *ty, rel));
                rel = rel
                    .checked_add(*n_bytes)
                    .and_then(|e| align_up(e, align))
                    .ok_or_else(|| werr("shard data size overflows"))?;
            }
            let header = encode_header(&md, &dir);
            let data_offset = align_up(header.len() as u64, align).ok_or_else(|| werr("header too large"))?;
            for &(name, dims, ty, r) in &dir {
                let n_bytes = self.tensors[self.names[name]].3;
                infos.push(TensorInfo { name: name.to_string(), dims: dims.to_vec(), ty, shard: s, offset: data_offset + r, n_bytes });
            }
            sinks[s].write_all_at(0, &header).map_err(|e| GgufError::io(format!("writing the header of shard {s}"), e))?;
            ends.push(data_offset.checked_add(rel).ok_or_else(|| werr("shard size overflows"))?);
        }
        Ok(TensorDataWriter {
            sinks,
            paths,
            index: self.names,
            written: vec![false; infos.len()],
            tensors: infos,
            ends,
            chunk_bytes: self.chunk_bytes.unwrap_or(DEFAULT_CHUNK),
        })
    }
}

/// Takes the tensor data after the headers are written.
pub struct TensorDataWriter<S: WriteAt> {
    sinks: Vec<S>,
    paths: Vec<PathBuf>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    written: Vec<bool>,
    ends: Vec<u64>,
    chunk_bytes: usize,
}

impl<S: WriteAt> TensorDataWriter<S> {
    /// Where every tensor goes (shard, absolute offset, size), in declaration order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The shard files (empty when writing to memory).
    pub fn shard_paths(&self) -> &[PathBuf] {
        &self.paths
    }

    fn slot(&self, name: &str) -> Result<usize> {
        let &i = self.index.get(name).ok_or_else(|| werr(format!("tensor '{name}' was not declared")))?;
        if self.written[i] {
            return Err(werr(format!("tensor '{name}' written twice")));
        }
        Ok(i)
    }

    fn put(&mut self, i: usize, at: u64, buf: &[u8]) -> Result<()> {
        let t = &self.tensors[i];
        let (shard, off) = (t.shard, t.offset + at);
        self.sinks[shard]
            .write_all_at(off, buf)
            .map_err(|e| GgufError::io(format!("writing tensor '{}' at offset {off} of shard {shard}", t.name), e))
    }

    /// Writes a tensor's data from a slice of exactly its size.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let i = self.slot(name)?;
        let want = self.tensors[i].n_bytes;
        if data.len() as u64 != want {
            return Err(werr(format!("tensor '{name}' needs {want} bytes, got {}", data.len())));
        }
        self.put(i, 0, data)?;
        self.written[i] = true;
        Ok(())
    }

    /// Writes a tensor's data chunk by chunk: `fill(offset, buf)` must fill
    /// `buf` with the bytes at `offset` within the tensor. Every chunk is a
    /// whole number of rows (`dims[0]` elements) unless one row is larger
    /// than the chunk size, in which case chunks are one row each.
    pub fn write_tensor_with(
        &mut self,
        name: &str,
        mut fill: impl FnMut(u64, &mut [u8]) -> io::Result<()>,
    ) -> Result<()> {
        let i = self.slot(name)?;
        let (n_bytes, row) = (self.tensors[i].n_bytes, self.tensors[i].row_bytes().max(1));
        let rows_per_chunk = (self.chunk_bytes as u64 / row).max(1);
        let chunk = (rows_per_chunk.saturating_mul(row)).min(n_bytes);
        let mut buf = vec![0u8; usize::try_from(chunk).map_err(|_| werr("chunk too large"))?];
        let mut at = 0u64;
        while at < n_bytes {
            let len = chunk.min(n_bytes - at) as usize;
            let b = &mut buf[..len];
            fill(at, b).map_err(|e| GgufError::io(format!("producing data of tensor '{name}' at {at}"), e))?;
            self.put(i, at, b)?;
            at += len as u64;
        }
        self.written[i] = true;
        Ok(())
    }

    /// Checks every tensor was written, sets the final lengths (padding the
    /// last tensor to the alignment) and returns the outputs.
    pub fn finish(mut self) -> Result<Vec<S>> {
        if let Some(i) = self.written.iter().position(|w| !w) {
            return Err(werr(format!("tensor '{}' was declared but never written", self.tensors[i].name)));
        }
        for (s, (sink, &end)) in self.sinks.iter_mut().zip(&self.ends).enumerate() {
            sink.set_len(end).map_err(|e| GgufError::io(format!("finishing shard {s}"), e))?;
        }
        Ok(self.sinks)
    }
}

/// Magic, version, counts, metadata and directory (relative offsets).
fn encode_header(md: &Metadata, dir: &[(&str, &[u64], GgmlType, u64)]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4096);
    b.extend(MAGIC);
    b.extend(VERSION.to_le_bytes());
    b.extend((dir.len() as u64).to_le_bytes());
    b.extend((md.len() as u64).to_le_bytes());
    for (k, v) in md.iter() {
        put_str(&mut b, k);
        b.extend(v.ty().id().to_le_bytes());
        put_value(&mut b, v);
    }
    for &(name, dims, ty, rel) in dir {
        put_str(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.id().to_le_bytes());
        b.extend(rel.to_le_bytes());
    }
    b
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn put_value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => b.push(*x),
        Value::I8(x) => b.extend(x.to_le_bytes()),
        Value::U16(x) => b.extend(x.to_le_bytes()),
        Value::I16(x) => b.extend(x.to_le_bytes()),
        Value::U32(x) => b.extend(x.to_le_bytes()),
        Value::I32(x) => b.extend(x.to_le_bytes()),
        Value::U64(x) => b.extend(x.to_le_bytes()),
        Value::I64(x) => b.extend(x.to_le_bytes()),
        Value::F32(x) => b.extend(x.to_le_bytes()),
        Value::F64(x) => b.extend(x.to_le_bytes()),
        Value::Bool(x) => b.push(u8::from(*x)),
        Value::String(s) => put_str(b, s),
        Value::Array(a) => put_array(b, a),
    }
}

fn put_array(b: &mut Vec<u8>, a: &Array) {
    b.extend(a.elem_type().id().to_le_bytes());
    b.extend((a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                b.extend(x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => b.extend(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Bool(v) => b.extend(v.iter().map(|&x| u8::from(x))),
        Array::String(v) => v.iter().for_each(|s| put_str(b, s)),
        Array::Array(v) => v.iter().for_each(|x| put_array(b, x)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgufFile;

    #[test]
    fn misuse_is_reported() {
        let mut w = GgufWriter::new();
        w.add_kv("a", 1u32).unwrap();
        assert!(w.add_kv("a", 2u32).unwrap_err().to_string().contains("duplicate metadata key 'a'"));
        assert!(w.add_kv(ALIGNMENT_KEY, 48u32).is_err());
        assert!(w.add_tensor("t", &[100], GgmlType::Q4_K).unwrap_err().to_string().contains("block size"));
        assert!(w.add_tensor("t", &[1, 2, 3, 4, 5], GgmlType::F32).is_err());
        w.add_tensor("t", &[8], GgmlType::F32).unwrap();
        assert!(w.add_tensor("t", &[8], GgmlType::F32).is_err());
        w.add_tensor("u", &[8], GgmlType::F32).unwrap();
        let mut d = w.in_memory().unwrap();
        assert!(d.write_tensor("t", &[0; 31]).unwrap_err().to_string().contains("needs 32 bytes"));
        d.write_tensor("t", &[1; 32]).unwrap();
        assert!(d.write_tensor("t", &[1; 32]).unwrap_err().to_string().contains("twice"));
        assert!(d.write_tensor("nope", &[]).unwrap_err().to_string().contains("not declared"));
        let e = match d.finish() { Err(e) => e.to_string(), Ok(_) => panic!("finish must fail") };
        assert!(e.contains("'u'") && e.contains("never written"), "{e}");
    }

    #[test]
    fn callback_chunks_are_whole_rows_and_alignment_is_honoured() {
        let mut w = GgufWriter::new();
        w.add_kv(ALIGNMENT_KEY, 64u32).unwrap();
        w.add_tensor("a", &[3], GgmlType::F32).unwrap();
        w.add_tensor("b", &[64, 5], GgmlType::Q8_0).unwrap(); // rows of 68 bytes
        w.set_chunk_bytes(150);
        let mut d = w.in_memory().unwrap();
        d.write_tensor("a", &[7; 12]).unwrap();
        let mut seen = Vec::new();
        d.write_tensor_with("b", |at, buf| {
            seen.push((at, buf.len()));
            buf.iter_mut().enumerate().for_each(|(i, x)| *x = (at as usize + i) as u8);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, [(0, 136), (136, 136), (272, 68)]);
        let bytes = d.finish().unwrap().remove(0);
        assert_eq!(bytes.len() % 64, 0);
        let f = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(f.alignment(), 64);
        let b = f.tensor("b").unwrap();
        assert_eq!(b.offset % 64, 0);
        assert!(f.data(b).iter().enumerate().all(|(i, &x)| x == i as u8));
        assert_eq!(f.data(f.tensor("a").unwrap()), [7; 12]);
    }
}
