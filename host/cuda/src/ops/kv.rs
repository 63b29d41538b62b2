//! The element types of a KV cache as the attention kernels take it (one per
//! `KvType`), the dispatch from a format to its type, and byte conversions.

use crate::buf::Pod;

/// Element types of a KV cache the attention kernels read.
pub trait KvElem: Pod {
    #[doc(hidden)]
    const ENTRY: usize;
    /// The cache format.
    const KV_TYPE: pulsar_kernels::ops::KvType;
    /// Elements of one row of `w` values.
    fn row_len(w: usize) -> usize {
        Self::KV_TYPE.row_bytes(w) / std::mem::size_of::<Self>()
    }
}
impl KvElem for f32 {
    const ENTRY: usize = 0;
    const KV_TYPE: pulsar_kernels::ops::KvType = pulsar_kernels::ops::KvType::F32;
}
/// f16 KV caches hold raw f16 bits.
impl KvElem for u16 {
    const ENTRY: usize = 1;
    const KV_TYPE: pulsar_kernels::ops::KvType = pulsar_kernels::ops::KvType::F16;
}
/// q8_0 KV caches hold rows of bytes (`KvType::Q8_0.row_bytes`): the quants,
/// then the f16 scales.
impl KvElem for u8 {
    const ENTRY: usize = 2;
    const KV_TYPE: pulsar_kernels::ops::KvType = pulsar_kernels::ops::KvType::Q8_0;
}
/// A byte of a q4_0 KV cache's rows (`KvType::Q4_0.row_bytes`: the nibbles,
/// then the f16 scales); its own type because q8_0 rows are `u8`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct KvQ4(pub u8);
impl KvElem for KvQ4 {
    const ENTRY: usize = 3;
    const KV_TYPE: pulsar_kernels::ops::KvType = pulsar_kernels::ops::KvType::Q4_0;
}
/// bf16 bits of a bf16 KV cache; its own type because f16 caches are `u16`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct KvBf16(pub u16);
impl KvElem for KvBf16 {
    const ENTRY: usize = 4;
    const KV_TYPE: pulsar_kernels::ops::KvType = pulsar_kernels::ops::KvType::Bf16;
}
/// An e4m3 byte of an fp8 KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct KvFp8(pub u8);
impl KvElem for KvFp8 {
    const ENTRY: usize = 5;
    const KV_TYPE: pulsar_kernels::ops::KvType = pulsar_kernels::ops::KvType::Fp8;
}

/// `$body` with the type `$K` the element type of KV format `$ty` (a
/// `pulsar_kernels::ops::KvType`): one monomorphised call per format, and a
/// new format cannot be missed.
#[macro_export]
macro_rules! with_kv_elem {
    ($ty:expr, $K:ident => $body:expr) => {
        match $ty {
            pulsar_kernels::ops::KvType::F32 => {
                type $K = f32;
                $body
            }
            pulsar_kernels::ops::KvType::F16 => {
                type $K = u16;
                $body
            }
            pulsar_kernels::ops::KvType::Bf16 => {
                type $K = $crate::KvBf16;
                $body
            }
            pulsar_kernels::ops::KvType::Q8_0 => {
                type $K = u8;
                $body
            }
            pulsar_kernels::ops::KvType::Q4_0 => {
                type $K = $crate::KvQ4;
                $body
            }
            pulsar_kernels::ops::KvType::Fp8 => {
                type $K = $crate::KvFp8;
                $body
            }
        }
    };
}

/// Little-endian bytes (`KvType::put_row`'s) as the cache's elements.
pub fn kv_elems<K: KvElem>(bytes: &[u8]) -> Vec<K> {
    let n = bytes.len() / std::mem::size_of::<K>();
    let mut v: Vec<K> = Vec::with_capacity(n);
    // SAFETY: K is Pod (every bit pattern is a value; the x86-64 and CUDA
    // hosts are little-endian) and v has room for n of them.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, n * std::mem::size_of::<K>());
        v.set_len(n);
    }
    v
}

/// A cache's elements as little-endian bytes (what `KvType::put_row` writes).
pub fn kv_bytes<K: KvElem>(elems: &[K]) -> Vec<u8> {
    let n = std::mem::size_of_val(elems);
    // SAFETY: K is Pod, so its bytes are plain data.
    unsafe { std::slice::from_raw_parts(elems.as_ptr() as *const u8, n) }.to_vec()
}
