//! Shared by the hostile-input tests: a hand assembler for GGUF bytes (so
//! broken files can be built field by field, independent of the writer) and
//! the corpus of broken files with what their error must mention.
#![allow(dead_code)]

use pulsar_gguf::{GgmlType, GgufWriter, Value};

/// Little-endian GGUF byte assembler.
#[derive(Default, Clone)]
pub struct Asm(pub Vec<u8>);

impl Asm {
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Asm {
        let mut a = Asm(b"GGUF".to_vec());
        a.u32(version).u64(n_tensors).u64(n_kv);
        a
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend(b);
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    /// A KV whose value is a u32.
    pub fn kv_u32(&mut self, k: &str, v: u32) -> &mut Self {
        self.str(k).u32(4).u32(v)
    }
    /// A tensor info.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, off: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(off)
    }
    /// Pads to 32 and appends `n` data bytes.
    pub fn data(&mut self, n: usize) -> &mut Self {
        let pad = self.0.len().next_multiple_of(32);
        self.0.resize(pad + n, 0xAB);
        self
    }
    pub fn done(&self) -> Vec<u8> {
        self.0.clone()
    }
}

/// A small valid file exercising every structure: scalar KVs, strings,
/// string and numeric arrays, a nested array, and three tensors.
pub fn small_valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "test").unwrap();
    w.add_kv("test.block_count", 2u32).unwrap();
    w.add_kv("test.eps", 1e-6f32).unwrap();
    w.add_kv("test.flag", true).unwrap();
    w.add_kv("test.big", u64::MAX).unwrap();
    w.add_kv("tokenizer.ggml.tokens", vec!["<pad>", "<eos>", "hello", "wörld"]).unwrap();
    w.add_kv("tokenizer.ggml.scores", vec![0.0f32, -1.0, -2.5, 3.0]).unwrap();
    w.add_kv("test.nested", vec![pulsar_gguf::Array::I16(vec![1, -2]), pulsar_gguf::Array::Bool(vec![true])]).unwrap();
    w.add_kv("test.f64", Value::F64(2.5)).unwrap();
    w.add_tensor("norm.weight", &[8], GgmlType::F32).unwrap();
    w.add_tensor("blk.0.ffn_up_exps.weight", &[32, 2, 2], GgmlType::Q8_0).unwrap();
    w.add_tensor("blk.0.attn_q.weight", &[256, 1], GgmlType::Q4_K).unwrap();
    let mut d = w.in_memory().unwrap();
    d.write_tensor("norm.weight", &[1; 32]).unwrap();
    d.write_tensor("blk.0.ffn_up_exps.weight", &[2; 34 * 4]).unwrap();
    d.write_tensor("blk.0.attn_q.weight", &[3; 144]).unwrap();
    d.finish().unwrap().remove(0)
}

/// Hand-built broken files, each with fragments its error message must contain.
pub fn broken_files() -> Vec<(&'static str, Vec<u8>, Vec<&'static str>)> {
    let big = 1u64 << 62;
    let mut v: Vec<(&'static str, Vec<u8>, Vec<&'static str>)> = Vec::new();
    let mut add = |name, bytes: Vec<u8>, want: &[&'static str]| v.push((name, bytes, want.to_vec()));

    add("empty", vec![], &["truncated", "magic"]);
    add("bad magic", Asm::header(3, 0, 0).raw(b"").done().into_iter().enumerate()
        .map(|(i, b)| if i == 3 { b'X' } else { b }).collect(), &["not a GGUF file"]);
    add("v1", Asm::header(1, 0, 0).done(), &["version 1 is not supported"]);
    add("v4", Asm::header(4, 0, 0).done(), &["unsupported GGUF version 4"]);
    add("big endian", Asm::header(3u32.swap_bytes(), 0, 0).done(), &["big-endian"]);
    add("short counts", b"GGUF\x03\0\0\0\x01\0".to_vec(), &["truncated", "tensor count"]);
    add("huge n_tensors", Asm::header(3, u64::MAX, 0).done(), &["cannot fit", "offset 8"]);
    add("huge n_kv", Asm::header(3, 0, big).done(), &["cannot fit"]);
    add("n_kv one too many", Asm::header(3, 0, 2).kv_u32("a.b", 1).done(), &["cannot fit"]);
    add("huge key length", Asm::header(3, 0, 1).u64(big).raw(&[0; 16]).done(), &["truncated", "metadata key #0"]);
    add("empty key", Asm::header(3, 0, 1).str("").u32(0).u8(0).raw(&[0; 8]).done(), &["empty key"]);
    add("key not utf-8", Asm::header(3, 0, 1).u64(2).raw(&[0xff, 0xfe]).u32(0).u8(0).raw(&[0; 8]).done(),
        &["UTF-8", "metadata key #0"]);
    add("unknown value type", Asm::header(3, 0, 1).str("k.t").u32(99).raw(&[0; 8]).done(),
        &["'k.t'", "unknown value type id 99"]);
    add("huge string value", Asm::header(3, 0, 1).str("k.s").u32(8).u64(big).raw(&[0; 16]).done(),
        &["'k.s'", "string of length 4611686018427387904"]);
    add("string value one byte short", Asm::header(3, 0, 1).str("k.s").u32(8).u64(5).raw(b"abcd").done(),
        &["'k.s'", "truncated"]);
    add("huge u8 array", Asm::header(3, 0, 1).str("k.a").u32(9).u32(0).u64(big).raw(&[0; 16]).done(),
        &["'k.a'", "array of 4611686018427387904 x u8"]);
    add("huge string array", Asm::header(3, 0, 1).str("k.a").u32(9).u32(8).u64(big).raw(&[0; 64]).done(),
        &["'k.a'", "x string"]);
    add("string array sized for bytes not strings", Asm::header(3, 0, 1).str("k.a").u32(9).u32(8).u64(16)
        .raw(&[0; 100]).done(), &["'k.a'", "16 x string"]);
    add("max u64 array", Asm::header(3, 0, 1).str("k.a").u32(9).u32(12).u64(u64::MAX).raw(&[0; 64]).done(),
        &["'k.a'", "x f64"]);
    add("huge nested array", Asm::header(3, 0, 1).str("k.n").u32(9).u32(9).u64(big).raw(&[0; 64]).done(),
        &["'k.n'", "x array"]);
    add("unknown array elem type", Asm::header(3, 0, 1).str("k.a").u32(9).u32(13).u64(0).done(),
        &["'k.a'", "unknown array element type id 13"]);
    add("bad bool", Asm::header(3, 0, 1).str("k.b").u32(7).u8(2).raw(&[0; 8]).done(), &["'k.b'", "bool byte is 2"]);
    add("bad bool in array", Asm::header(3, 0, 1).str("k.b").u32(9).u32(7).u64(2).u8(1).u8(7).raw(&[0; 8]).done(),
        &["'k.b'", "bool byte is 7"]);
    let mut deep = Asm::header(3, 0, 1);
    deep.str("k.deep").u32(9);
    for _ in 0..100 {
        deep.u32(9).u64(1);
    }
    add("deep nesting", deep.done(), &["'k.deep'", "nested more than"]);
    add("duplicate key", Asm::header(3, 0, 2).kv_u32("a.b", 1).kv_u32("a.b", 2).done(),
        &["duplicate metadata key 'a.b'"]);
    add("alignment 0", Asm::header(3, 0, 1).kv_u32("general.alignment", 0).done(), &["general.alignment", "power of two"]);
    add("alignment 48", Asm::header(3, 0, 1).kv_u32("general.alignment", 48).done(), &["general.alignment", "48"]);
    add("alignment string", Asm::header(3, 0, 1).str("general.alignment").u32(8).str("64").done(),
        &["general.alignment", "found string"]);
    add("alignment negative", Asm::header(3, 0, 1).str("general.alignment").u32(5).u32(-1i32 as u32).done(),
        &["general.alignment", "does not fit"]);

    let t = |dims: &[u64], ty: u32, off: u64| Asm::header(3, 1, 0).tensor("blk.0.w", dims, ty, off).data(4096).done();
    add("zero dims", t(&[], 0, 0), &["tensor 'blk.0.w'", "0 dimensions"]);
    add("five dims", t(&[1, 1, 1, 1, 1], 0, 0), &["tensor 'blk.0.w'", "5 dimensions"]);
    add("u32::MAX dims", Asm::header(3, 1, 0).str("blk.0.w").u32(u32::MAX).raw(&[0; 64]).done(),
        &["tensor 'blk.0.w'", "4294967295 dimensions"]);
    add("a zero dim", t(&[4, 0], 0, 0), &["tensor 'blk.0.w'", "dimension is 0"]);
    add("element overflow", t(&[1 << 32, 1 << 32, 1 << 32], 0, 0), &["tensor 'blk.0.w'", "overflows"]);
    add("byte overflow", t(&[1 << 31, 1 << 31], 0, 0), &["tensor 'blk.0.w'", "overflows"]);
    add("unknown type gap", t(&[4], 4, 0), &["tensor 'blk.0.w'", "unknown ggml type id 4"]);
    add("unknown type huge", t(&[4], 1000, 0), &["tensor 'blk.0.w'", "unknown ggml type id 1000"]);
    add("row not whole blocks", t(&[96, 2], GgmlType::Q4_K.id(), 0), &["tensor 'blk.0.w'", "block size 256"]);
    add("misaligned offset", t(&[4], 0, 1), &["tensor 'blk.0.w'", "not a multiple of the alignment 32"]);
    add("offset past end", t(&[4], 0, 1 << 20), &["tensor 'blk.0.w'", "past the end"]);
    add("offset overflows", t(&[4], 0, u64::MAX - 31), &["tensor 'blk.0.w'", "past the end"]);
    add("data one byte short", Asm::header(3, 1, 0).tensor("blk.0.w", &[4], 0, 0).data(15).done(),
        &["tensor 'blk.0.w'", "past the end"]);
    add("empty tensor name", Asm::header(3, 1, 0).tensor("", &[4], 0, 0).data(16).done(), &["empty tensor name"]);
    add("duplicate tensor", Asm::header(3, 2, 0).tensor("w", &[4], 0, 0).tensor("w", &[4], 0, 32).data(64).done(),
        &["duplicate tensor name 'w'"]);
    add("huge tensor name", Asm::header(3, 1, 0).u64(big).raw(&[0; 64]).done(), &["truncated", "tensor info #0 name"]);
    add("directory truncated", Asm::header(3, 1, 0).str("blk.0.w").u32(2).u64(4).u64(1).u32(0).raw(&[0; 7]).done(),
        &["truncated", "tensor 'blk.0.w'"]);
    v
}
