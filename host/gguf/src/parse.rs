//! The GGUF header parser: magic, version, metadata, tensor directory.
//!
//! Hostile input is the design case. Every length and count read from the
//! file is checked against the bytes that remain *before* anything is
//! allocated or looped over, so the work and memory spent on a file are
//! bounded by a small multiple of its size, and every loop consumes input.
//! All offset arithmetic is checked; nothing here can panic on any input.

use std::collections::HashSet;

use crate::error::{GgufError, Result};
use crate::metadata::Metadata;
use crate::source::ByteSource;
use crate::tensor::{tensor_bytes, TensorInfo, MAX_DIMS};
use crate::value::{Array, Value, ValueType};
use crate::GgmlType;

/// `GGUF` as it appears on disk.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// The version [`crate::GgufWriter`] writes.
pub const VERSION: u32 = 3;
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides the data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Deepest nesting of arrays inside arrays that is accepted (bounds recursion).
pub const MAX_ARRAY_DEPTH: usize = 16;

// Smallest possible encodings, used to bound counts by the remaining bytes:
// a KV is a non-empty key (8 + 1) + type (4) + a 1-byte value; a tensor info is
// a non-empty name (8 + 1) + n_dims (4) + one dim (8) + type (4) + offset (8).
const MIN_KV_BYTES: u64 = 14;
const MIN_TENSOR_INFO_BYTES: u64 = 33;
/// Most elements reserved up front for entries that take more memory than
/// their minimum encoding (tensor infos, strings, nested arrays): beyond this
/// vectors grow as entries actually parse, so a 40 GB file whose header
/// claims a billion tensors fails at the first bad entry, not in the allocator.
const PREALLOC_MAX: usize = 4096;

/// Everything in one GGUF file before its data section.
#[derive(Clone, Debug)]
pub struct Header {
    /// 2 or 3.
    pub version: u32,
    /// Data alignment (from `general.alignment`, else 32).
    pub alignment: u64,
    /// Metadata in file order.
    pub metadata: Metadata,
    /// Tensor directory in file order, offsets absolute in this file.
    pub tensors: Vec<TensorInfo>,
    /// Where each tensor's directory entry starts (for error messages).
    pub info_offsets: Vec<u64>,
    /// End of the tensor directory (the header bytes are `0..header_len`).
    pub header_len: u64,
    /// Start of the data section (`header_len` rounded up to `alignment`).
    pub data_offset: u64,
    /// Length of the parsed source.
    pub file_len: u64,
}

/// Parses and validates a GGUF header from `src`; tensors are tagged with
/// `shard`. Tensor data is bounds-checked against `src.len()` but not read.
pub fn parse_header<S: ByteSource + ?Sized>(src: &S, shard: usize) -> Result<Header> {
    let mut r = Reader::new(src);

    r.what.push_str("magic");
    let mut magic = [0u8; 4];
    r.read_into(&mut magic)?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    r.set_what(|| "version".into());
    let version = r.u32()?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    r.set_what(|| "tensor count".into());
    let count_off = r.pos;
    let n_tensors = r.u64()?;
    r.set_what(|| "metadata count".into());
    let n_kv = r.u64()?;
    let min_needed = n_kv
        .checked_mul(MIN_KV_BYTES)
        .zip(n_tensors.checked_mul(MIN_TENSOR_INFO_BYTES))
        .and_then(|(a, b)| a.checked_add(b));
    if min_needed.is_none_or(|n| n > r.remaining()) {
        return Err(GgufError::malformed(
            "header counts",
            count_off,
            format!(
                "{n_tensors} tensors and {n_kv} metadata keys cannot fit in the {} bytes that remain",
                r.remaining()
            ),
        ));
    }

    let mut metadata = Metadata::new();
    let mut alignment_at = None;
    for i in 0..n_kv {
        let key_off = r.pos;
        r.set_what(|| format!("metadata key #{i}"));
        let key = r.string()?;
        if key.is_empty() {
            return Err(GgufError::malformed(format!("metadata key #{i}"), key_off, "empty key"));
        }
        r.set_what(|| format!("metadata key '{key}' value type"));
        let ty_off = r.pos;
        let ty = r.u32()?;
        let ty = ValueType::from_id(ty).ok_or_else(|| {
            GgufError::malformed(format!("metadata key '{key}'"), ty_off, format!("unknown value type id {ty}"))
        })?;
        r.set_what(|| format!("metadata key '{key}'"));
        let value = r.value(ty, 0)?;
        if key == ALIGNMENT_KEY {
            alignment_at = Some(key_off);
        }
        if !metadata.contains_key(&key) {
            metadata.insert(key, value);
        } else {
            return Err(GgufError::DuplicateKey { key, offset: key_off });
        }
    }

    let alignment = match metadata.get_u32(ALIGNMENT_KEY) {
        Ok(None) => DEFAULT_ALIGNMENT,
        Ok(Some(a)) if a.is_power_of_two() => u64::from(a),
        Ok(Some(a)) => {
            return Err(GgufError::malformed(
                format!("metadata key '{ALIGNMENT_KEY}'"),
                alignment_at.unwrap_or(0),
                format!("alignment {a} is not a power of two"),
            ))
        }
        Err(e) => {
            return Err(GgufError::malformed(
                format!("metadata key '{ALIGNMENT_KEY}'"),
                alignment_at.unwrap_or(0),
                e.to_string(),
            ))
        }
    };

    // Directory first (offsets relative to the data section), then bounds.
    let reserve = (n_tensors as usize).min(PREALLOC_MAX);
    let mut infos: Vec<(TensorInfo, u64)> = Vec::with_capacity(reserve);
    let mut names = HashSet::with_capacity(reserve);
    for i in 0..n_tensors {
        let info_off = r.pos;
        r.set_what(|| format!("tensor info #{i} name"));
        let name = r.string()?;
        if name.is_empty() {
            return Err(GgufError::malformed(format!("tensor info #{i}"), info_off, "empty tensor name"));
        }
        let what = format!("tensor '{name}'");
        r.set_what(|| format!("{what} dimension count"));
        let n_dims_off = r.pos;
        let n_dims = r.u32()?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(GgufError::malformed(
                &what,
                n_dims_off,
                format!("{n_dims} dimensions (must be 1..={MAX_DIMS})"),
            ));
        }
        r.set_what(|| format!("{what} dimensions"));
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d_off = r.pos;
            let d = r.u64()?;
            if d == 0 {
                return Err(GgufError::malformed(&what, d_off, "a dimension is 0"));
            }
            dims.push(d);
        }
        r.set_what(|| format!("{what} type"));
        let ty_off = r.pos;
        let ty_id = r.u32()?;
        let ty = GgmlType::from_id(ty_id).ok_or_else(|| GgufError::UnknownTensorType {
            tensor: name.clone(),
            id: ty_id,
            offset: ty_off,
        })?;
        let n_bytes = tensor_bytes(ty, &dims).map_err(|e| GgufError::malformed(&what, info_off, e))?;
        r.set_what(|| format!("{what} data offset"));
        let rel_off_at = r.pos;
        let rel = r.u64()?;
        if rel % alignment != 0 {
            return Err(GgufError::malformed(
                &what,
                rel_off_at,
                format!("data offset {rel} is not a multiple of the alignment {alignment}"),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor { name, shard, offset: info_off });
        }
        let info = TensorInfo { name, dims, ty, shard, offset: rel, n_bytes };
        infos.push((info, info_off));
    }

    let header_len = r.pos;
    let file_len = r.len;
    let data_offset = align_up(header_len, alignment).ok_or_else(|| {
        GgufError::malformed("data section", header_len, "data offset overflows when aligned")
    })?;
    let mut tensors = Vec::with_capacity(infos.len());
    let mut info_offsets = Vec::with_capacity(infos.len());
    for (mut t, info_off) in infos {
        info_offsets.push(info_off);
        let abs = data_offset.checked_add(t.offset);
        let end = abs.and_then(|a| a.checked_add(t.n_bytes));
        match (abs, end) {
            (Some(abs), Some(end)) if end <= file_len => t.offset = abs,
            _ => {
                return Err(GgufError::malformed(
                    format!("tensor '{}'", t.name),
                    info_off,
                    format!(
                        "data ({} bytes at data offset {} + {}) extends past the end of the file ({file_len} bytes)",
                        t.n_bytes, data_offset, t.offset
                    ),
                ))
            }
        }
        tensors.push(t);
    }

    Ok(Header { version, alignment, metadata, tensors, info_offsets, header_len, data_offset, file_len })
}

/// `x` rounded up to a multiple of `align` (a power of two), or `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

/// Bytes read through a small window, so a pread source costs one syscall per
/// 64 KiB and a memory source is never copied whole.
struct Reader<'a, S: ?Sized> {
    src: &'a S,
    len: u64,
    pos: u64,
    win: Vec<u8>,
    win_start: u64,
    /// What is being read, for error messages (set per item, not per element).
    what: String,
}

const WINDOW: usize = 64 * 1024;

impl<'a, S: ByteSource + ?Sized> Reader<'a, S> {
    fn new(src: &'a S) -> Self {
        Reader { len: src.len(), src, pos: 0, win: Vec::new(), win_start: 0, what: String::new() }
    }

    fn set_what(&mut self, f: impl FnOnce() -> String) {
        self.what = f();
    }

    fn remaining(&self) -> u64 {
        self.len - self.pos
    }

    fn truncated(&self, needed: u64) -> GgufError {
        GgufError::Truncated {
            what: self.what.clone(),
            offset: self.pos,
            needed,
            available: self.remaining(),
        }
    }

    /// Makes `n` (≤ WINDOW) bytes at `pos` available and returns them.
    fn window(&mut self, n: usize) -> Result<&[u8]> {
        if (n as u64) > self.remaining() {
            return Err(self.truncated(n as u64));
        }
        let in_win = self.pos >= self.win_start
            && self.pos - self.win_start + n as u64 <= self.win.len() as u64;
        if !in_win {
            // remaining() >= n, so this is at least n and at most WINDOW bytes.
            let take = self.remaining().min(WINDOW as u64) as usize;
            self.win.resize(take, 0);
            self.src
                .read_exact_at(self.pos, &mut self.win)
                .map_err(|e| GgufError::io(format!("reading {} at offset {}", self.what, self.pos), e))?;
            self.win_start = self.pos;
        }
        let at = (self.pos - self.win_start) as usize;
        Ok(&self.win[at..at + n])
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.window(N)?);
        self.pos += N as u64;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.fixed::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        self.fixed().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Result<u32> {
        self.fixed().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64> {
        self.fixed().map(u64::from_le_bytes)
    }

    /// Reads `out.len()` bytes, which the caller has bounds-checked or will be.
    fn read_into(&mut self, out: &mut [u8]) -> Result<()> {
        if out.len() as u64 > self.remaining() {
            return Err(self.truncated(out.len() as u64));
        }
        for chunk in out.chunks_mut(WINDOW) {
            chunk.copy_from_slice(self.window(chunk.len())?);
            self.pos += chunk.len() as u64;
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String> {
        let len_at = self.pos;
        let len = self.u64()?;
        if len > self.remaining() {
            self.pos = len_at;
            return Err(GgufError::Truncated {
                what: format!("{} (string of length {len})", self.what),
                offset: len_at,
                needed: len.saturating_add(8),
                available: self.remaining(),
            });
        }
        // len <= remaining <= file size: the allocation is justified by the file.
        let mut bytes = vec![0u8; len as usize];
        self.read_into(&mut bytes)?;
        String::from_utf8(bytes)
            .map_err(|e| GgufError::malformed(&self.what, len_at, format!("string is not valid UTF-8 ({e})")))
    }

    fn bool(&mut self) -> Result<bool> {
        let at = self.pos;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(GgufError::malformed(&self.what, at, format!("bool byte is {b}, not 0 or 1"))),
        }
    }

    fn value(&mut self, ty: ValueType, depth: usize) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8()?),
            ValueType::I8 => Value::I8(self.u8()? as i8),
            ValueType::U16 => Value::U16(self.u16()?),
            ValueType::I16 => Value::I16(self.u16()? as i16),
            ValueType::U32 => Value::U32(self.u32()?),
            ValueType::I32 => Value::I32(self.u32()? as i32),
            ValueType::U64 => Value::U64(self.u64()?),
            ValueType::I64 => Value::I64(self.u64()? as i64),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32()?)),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64()?)),
            ValueType::Bool => Value::Bool(self.bool()?),
            ValueType::String => Value::String(self.string()?),
            ValueType::Array => Value::Array(self.array(depth)?),
        })
    }

    fn array(&mut self, depth: usize) -> Result<Array> {
        let start = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::malformed(
                &self.what,
                start,
                format!("arrays nested more than {MAX_ARRAY_DEPTH} deep"),
            ));
        }
        let ty_id = self.u32()?;
        let ty = ValueType::from_id(ty_id).ok_or_else(|| {
            GgufError::malformed(&self.what, start, format!("unknown array element type id {ty_id}"))
        })?;
        let n = self.u64()?;
        let fits = n.checked_mul(ty.min_size()).is_some_and(|b| b <= self.remaining());
        if !fits {
            return Err(GgufError::Truncated {
                what: format!("{} (array of {n} x {ty})", self.what),
                offset: start,
                needed: n.saturating_mul(ty.min_size()).saturating_add(12),
                available: self.remaining().saturating_add(12),
            });
        }
        // n * min_size <= remaining bytes, so n fits in usize. Fixed-size
        // elements take exactly their encoded size in memory, so reserving
        // all n is safe; strings and arrays take more and reserve a bounded
        // amount (see PREALLOC_MAX).
        let n = n as usize;
        let cap = if ty.fixed_size().is_some() { n } else { n.min(PREALLOC_MAX) };
        macro_rules! fixed {
            ($variant:ident, $read:ident, $conv:expr) => {{
                let mut v = Vec::with_capacity(cap);
                for _ in 0..n {
                    v.push($conv(self.$read()?));
                }
                Array::$variant(v)
            }};
        }
        Ok(match ty {
            ValueType::U8 => {
                let mut v = vec![0u8; n];
                self.read_into(&mut v)?;
                Array::U8(v)
            }
            ValueType::I8 => fixed!(I8, u8, |x: u8| x as i8),
            ValueType::U16 => fixed!(U16, u16, |x| x),
            ValueType::I16 => fixed!(I16, u16, |x: u16| x as i16),
            ValueType::U32 => fixed!(U32, u32, |x| x),
            ValueType::I32 => fixed!(I32, u32, |x: u32| x as i32),
            ValueType::U64 => fixed!(U64, u64, |x| x),
            ValueType::I64 => fixed!(I64, u64, |x: u64| x as i64),
            ValueType::F32 => fixed!(F32, u32, f32::from_bits),
            ValueType::F64 => fixed!(F64, u64, f64::from_bits),
            ValueType::Bool => fixed!(Bool, bool, |x| x),
            ValueType::String => fixed!(String, string, |x| x),
            ValueType::Array => {
                let mut v = Vec::with_capacity(cap);
                for _ in 0..n {
                    v.push(self.array(depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hand-assembled minimal files, independent of the writer.
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend(n_tensors.to_le_bytes());
        b.extend(n_kv.to_le_bytes());
        b
    }
    fn string(b: &mut Vec<u8>, s: &str) {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    }

    #[test]
    fn parses_a_hand_built_file_with_one_tensor() {
        let mut b = header(3, 1, 2);
        string(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        string(&mut b, "llama");
        string(&mut b, "x.arr");
        b.extend(9u32.to_le_bytes());
        b.extend(5u32.to_le_bytes()); // i32
        b.extend(2u64.to_le_bytes());
        b.extend((-7i32).to_le_bytes());
        b.extend(9i32.to_le_bytes());
        string(&mut b, "w");
        b.extend(2u32.to_le_bytes());
        b.extend(4u64.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(0u32.to_le_bytes()); // f32
        b.extend(0u64.to_le_bytes());
        let header_len = b.len() as u64;
        b.resize(header_len.next_multiple_of(32) as usize, 0);
        b.extend([0u8; 32]);
        let h = parse_header(&b[..], 0).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.header_len, header_len);
        assert_eq!(h.data_offset, header_len.next_multiple_of(32));
        assert_eq!(h.metadata.require_str("general.architecture").unwrap(), "llama");
        assert_eq!(h.metadata.require_i32_array("x.arr").unwrap(), [-7, 9]);
        assert_eq!(h.tensors[0].dims, [4, 2]);
        assert_eq!(h.tensors[0].n_bytes, 32);
        assert_eq!(h.tensors[0].offset, h.data_offset);
        // One byte short of the data: the tensor no longer fits.
        let e = parse_header(&b[..b.len() - 1], 0).unwrap_err().to_string();
        assert!(e.contains("tensor 'w'") && e.contains("past the end"), "{e}");
    }

    #[test]
    fn versions() {
        let e = parse_header(&header(1, 0, 0)[..], 0).unwrap_err().to_string();
        assert!(e.contains("version 1 is not supported"), "{e}");
        let e = parse_header(&header(3u32.swap_bytes(), 0, 0)[..], 0).unwrap_err().to_string();
        assert!(e.contains("big-endian"), "{e}");
        assert!(parse_header(&header(2, 0, 0)[..], 0).is_ok());
        assert!(parse_header(&header(4, 0, 0)[..], 0).is_err());
    }

    #[test]
    fn absurd_counts_fail_before_allocating() {
        let e = parse_header(&header(3, u64::MAX, 1)[..], 0).unwrap_err().to_string();
        assert!(e.contains("cannot fit"), "{e}");
        let mut b = header(3, 0, 1);
        string(&mut b, "k");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend((1u64 << 62).to_le_bytes());
        let e = parse_header(&b[..], 0).unwrap_err().to_string();
        assert!(e.contains("'k'") && e.contains("array of 4611686018427387904 x string"), "{e}");
    }

    #[test]
    fn deep_nesting_is_refused_not_a_stack_overflow() {
        let mut b = header(3, 0, 1);
        string(&mut b, "deep");
        b.extend(9u32.to_le_bytes());
        for _ in 0..10_000 {
            b.extend(9u32.to_le_bytes());
            b.extend(1u64.to_le_bytes());
        }
        let e = parse_header(&b[..], 0).unwrap_err().to_string();
        assert!(e.contains("nested more than"), "{e}");
    }

    #[test]
    fn align_up_overflow() {
        assert_eq!(align_up(33, 32), Some(64));
        assert_eq!(align_up(64, 32), Some(64));
        assert_eq!(align_up(u64::MAX - 3, 32), None);
    }
}
