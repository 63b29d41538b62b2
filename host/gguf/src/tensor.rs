//! Tensor directory entries and the byte arithmetic on them (expert slabs).

use crate::error::{GgufError, Result};
use crate::GgmlType;

/// GGML_MAX_DIMS: no ggml tensor has more dimensions.
pub const MAX_DIMS: usize = 4;

/// One tensor of the (possibly multi-shard) file.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct TensorInfo {
    /// Name as stored (e.g. `blk.0.ffn_up_exps.weight`).
    pub name: String,
    /// Shape in ggml order: `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    /// Element type.
    #[serde(serialize_with = "ser_type")]
    pub ty: GgmlType,
    /// Index of the shard that holds the data (0 for unsplit files).
    pub shard: usize,
    /// Absolute byte offset of the data in that shard's file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

fn ser_type<S: serde::Serializer>(t: &GgmlType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(t.name())
}

/// A contiguous byte range in one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct ByteRange {
    pub shard: usize,
    pub offset: u64,
    pub len: u64,
}

/// Bytes of a tensor of type `ty` with `dims` (ggml order), or why not:
/// the row length must be a whole number of blocks and nothing may overflow.
/// The element count is also kept within `i64` (ggml's `int64_t ne`).
pub fn tensor_bytes(ty: GgmlType, dims: &[u64]) -> std::result::Result<u64, String> {
    let Some(&cols) = dims.first() else {
        return Err("tensor has no dimensions".into());
    };
    let mut elems: u64 = 1;
    for &d in dims {
        elems = elems
            .checked_mul(d)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or_else(|| format!("element count of shape {dims:?} overflows"))?;
    }
    if cols % ty.block_elems() != 0 {
        return Err(format!(
            "row length {cols} is not a multiple of the {} block size {}",
            ty.name(),
            ty.block_elems()
        ));
    }
    let row = ty.row_bytes(cols).ok_or_else(|| format!("byte size of shape {dims:?} overflows"))?;
    dims[1..]
        .iter()
        .try_fold(row, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("byte size of shape {dims:?} overflows"))
}

impl TensorInfo {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of one row (`dims[0]` elements).
    pub fn row_bytes(&self) -> u64 {
        // Validated when the directory was built: cannot fail for a parsed tensor.
        self.ty.row_bytes(self.dims[0]).unwrap_or(0)
    }

    /// The tensor's whole data range.
    pub fn byte_range(&self) -> ByteRange {
        ByteRange {
            shard: self.shard,
            offset: self.offset,
            len: self.n_bytes,
        }
    }

    /// For a 3-D expert tensor `[cols, rows, n_expert]`, the number of experts.
    pub fn n_experts(&self) -> Option<u64> {
        (self.dims.len() == 3).then(|| self.dims[2])
    }

    /// One expert's contiguous bytes in a 3-D `[cols, rows, n_expert]` tensor:
    /// `rows` rows of `cols` weights (for a fused gate_up tensor `rows` is
    /// `2 * ff`, and the slab holds both halves). `cols` need only be a whole
    /// number of blocks, not a multiple of 256.
    pub fn expert_slab(&self, expert: u64) -> Result<ByteRange> {
        let err = |reason: String| GgufError::Tensor {
            tensor: self.name.clone(),
            reason,
        };
        if self.dims.len() != 3 {
            return Err(err(format!(
                "expert slabs need a 3-D [cols, rows, n_expert] tensor, this one has shape {:?}",
                self.dims
            )));
        }
        let n_expert = self.dims[2];
        if expert >= n_expert {
            return Err(err(format!("expert {expert} out of range (tensor has {n_expert} experts)")));
        }
        // n_bytes = row_bytes * rows * n_expert was checked without overflow,
        // so every product below is at most n_bytes.
        let len = self.n_bytes / n_expert;
        Ok(ByteRange {
            shard: self.shard,
            offset: self.offset + expert * len,
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(dims: &[u64], ty: GgmlType) -> TensorInfo {
        TensorInfo {
            name: "x".into(),
            dims: dims.to_vec(),
            ty,
            shard: 1,
            offset: 4096,
            n_bytes: tensor_bytes(ty, dims).unwrap(),
        }
    }

    #[test]
    fn sizes_follow_the_block_table() {
        assert_eq!(tensor_bytes(GgmlType::Q8_0, &[96, 5, 3]), Ok(3 * 34 * 5 * 3));
        assert_eq!(tensor_bytes(GgmlType::F32, &[7]), Ok(28));
        assert!(tensor_bytes(GgmlType::Q4_K, &[96, 2]).unwrap_err().contains("block size 256"));
        assert!(tensor_bytes(GgmlType::F32, &[1 << 32, 1 << 32]).unwrap_err().contains("overflows"));
        assert!(tensor_bytes(GgmlType::F32, &[1 << 62]).unwrap_err().contains("overflows"), "byte overflow");
        assert!(tensor_bytes(GgmlType::F32, &[]).is_err());
    }

    #[test]
    fn expert_slab_arithmetic() {
        let x = t(&[96, 10, 4], GgmlType::Q8_0);
        let per = 3 * 34 * 10;
        assert_eq!(x.expert_slab(0).unwrap(), ByteRange { shard: 1, offset: 4096, len: per });
        assert_eq!(x.expert_slab(3).unwrap().offset, 4096 + 3 * per);
        let e = x.expert_slab(4).unwrap_err().to_string();
        assert!(e.contains("'x'") && e.contains("out of range"), "{e}");
        let e = t(&[96, 10], GgmlType::Q8_0).expert_slab(0).unwrap_err().to_string();
        assert!(e.contains("3-D"), "{e}");
    }
}
