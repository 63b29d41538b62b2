//! The tensor element types of GGUF (`ggml_type` ids) and their block geometry.
//!
//! This is the single table of "how many bytes does a run of N weights of type T
//! take": the reader uses it to size tensors, the kernels crate keys its
//! per-format modules on it, the expert store uses it to size slabs.

use std::fmt;

macro_rules! ggml_types {
    ($( $variant:ident = $id:literal, $name:literal, $block:literal, $bytes:literal; )*) => {
        /// A GGUF tensor type. The discriminant is the on-disk `ggml_type` id.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u32)]
        #[allow(non_camel_case_types)]
        pub enum GgmlType { $( $variant = $id, )* }

        impl GgmlType {
            /// Every type this table knows, in id order.
            pub const ALL: &'static [GgmlType] = &[ $( GgmlType::$variant, )* ];

            /// The type for an on-disk id, or `None` for an unknown id.
            pub fn from_id(id: u32) -> Option<GgmlType> {
                match id { $( $id => Some(GgmlType::$variant), )* _ => None }
            }
            /// The on-disk id.
            pub fn id(self) -> u32 { self as u32 }
            /// The name llama.cpp prints (`q4_K`, `f16`, ...).
            pub fn name(self) -> &'static str {
                match self { $( GgmlType::$variant => $name, )* }
            }
            /// Weights per block.
            pub fn block_elems(self) -> u64 {
                match self { $( GgmlType::$variant => $block, )* }
            }
            /// Bytes per block.
            pub fn block_bytes(self) -> u64 {
                match self { $( GgmlType::$variant => $bytes, )* }
            }
        }
    };
}

ggml_types! {
    F32 = 0, "f32", 1, 4;
    F16 = 1, "f16", 1, 2;
    Q4_0 = 2, "q4_0", 32, 18;
    Q4_1 = 3, "q4_1", 32, 20;
    Q5_0 = 6, "q5_0", 32, 22;
    Q5_1 = 7, "q5_1", 32, 24;
    Q8_0 = 8, "q8_0", 32, 34;
    Q8_1 = 9, "q8_1", 32, 36;
    Q2_K = 10, "q2_K", 256, 84;
    Q3_K = 11, "q3_K", 256, 110;
    Q4_K = 12, "q4_K", 256, 144;
    Q5_K = 13, "q5_K", 256, 176;
    Q6_K = 14, "q6_K", 256, 210;
    Q8_K = 15, "q8_K", 256, 292;
    IQ2_XXS = 16, "iq2_xxs", 256, 66;
    IQ2_XS = 17, "iq2_xs", 256, 74;
    IQ3_XXS = 18, "iq3_xxs", 256, 98;
    IQ1_S = 19, "iq1_s", 256, 50;
    IQ4_NL = 20, "iq4_nl", 32, 18;
    IQ3_S = 21, "iq3_s", 256, 110;
    IQ2_S = 22, "iq2_s", 256, 82;
    IQ4_XS = 23, "iq4_xs", 256, 136;
    I8 = 24, "i8", 1, 1;
    I16 = 25, "i16", 1, 2;
    I32 = 26, "i32", 1, 4;
    I64 = 27, "i64", 1, 8;
    F64 = 28, "f64", 1, 8;
    IQ1_M = 29, "iq1_m", 256, 56;
    BF16 = 30, "bf16", 1, 2;
    TQ1_0 = 34, "tq1_0", 256, 54;
    TQ2_0 = 35, "tq2_0", 256, 66;
    MXFP4 = 39, "mxfp4", 32, 17;
}

impl GgmlType {
    /// Bytes taken by one row of `n` weights, or `None` when `n` is not a whole
    /// number of blocks (such a tensor is malformed) or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let b = self.block_elems();
        if n % b != 0 {
            return None;
        }
        (n / b).checked_mul(self.block_bytes())
    }

    /// Parse a name as printed by [`GgmlType::name`], case-insensitively.
    pub fn from_name(s: &str) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.name().eq_ignore_ascii_case(s))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_design_sizes_hold() {
        for &t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None);
        // Bytes per 256 weights, from DESIGN.md.
        let per256 = |t: GgmlType| t.row_bytes(256).unwrap();
        for (t, b) in [
            (GgmlType::Q2_K, 84), (GgmlType::Q3_K, 110), (GgmlType::Q4_K, 144),
            (GgmlType::Q5_K, 176), (GgmlType::Q6_K, 210), (GgmlType::Q8_0, 272),
            (GgmlType::Q4_0, 144), (GgmlType::Q5_0, 176), (GgmlType::Q5_1, 192),
            (GgmlType::IQ2_XXS, 66), (GgmlType::IQ2_XS, 74), (GgmlType::IQ3_XXS, 98),
        ] {
            assert_eq!(per256(t), b, "{t}");
        }
        assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
    }
}
