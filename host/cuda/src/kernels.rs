//! The kernel sources (one file per family, embedded at build time) and the
//! table of their entry points. Entry names are fixed strings, looked up by
//! index: nothing is built from strings at run time.

use pulsar_gguf::GgmlType;

macro_rules! cuda_src {
    ($($file:literal),*) => {
        concat!($(include_str!(concat!("../../../kernels/cuda/", $file)), "\n"),*)
    };
}

/// One kernel source file and the module it compiles to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    GemvQuant,
    GemvFloat,
    NormRope,
    Act,
    Embed,
    Attention,
    Moe,
    Prim,
}

impl Family {
    pub const ALL: [Family; 8] = [
        Family::GemvQuant,
        Family::GemvFloat,
        Family::NormRope,
        Family::Act,
        Family::Embed,
        Family::Attention,
        Family::Moe,
        Family::Prim,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The `.cu` file under `kernels/cuda/`.
    pub fn file(self) -> &'static str {
        match self {
            Family::GemvQuant => "gemv_quant.cu",
            Family::GemvFloat => "gemv_float.cu",
            Family::NormRope => "norm_rope.cu",
            Family::Act => "act.cu",
            Family::Embed => "embed.cu",
            Family::Attention => "attention.cu",
            Family::Moe => "moe.cu",
            Family::Prim => "prim.cu",
        }
    }

    /// The full translation unit NVRTC compiles: the shared prelude(s) then the file.
    pub fn source(self) -> &'static str {
        match self {
            Family::GemvQuant => cuda_src!("common.cuh", "quant_units.cuh", "decode_dot.cuh", "gemv_quant.cu"),
            Family::GemvFloat => cuda_src!("common.cuh", "gemv_float.cu"),
            Family::NormRope => cuda_src!("common.cuh", "norm_rope.cu"),
            Family::Act => cuda_src!("common.cuh", "act.cu"),
            Family::Embed => cuda_src!("common.cuh", "quant_units.cuh", "embed.cu"),
            Family::Attention => cuda_src!("common.cuh", "attention.cu"),
            Family::Moe => cuda_src!("common.cuh", "quant_units.cuh", "decode_dot.cuh", "moe.cu"),
            Family::Prim => cuda_src!("common.cuh", "prim.cu"),
        }
    }

    /// Every `extern "C"` entry point of the module, in a fixed order.
    pub fn entries(self) -> &'static [&'static str] {
        match self {
            Family::GemvQuant => GEMV_QUANT,
            Family::GemvFloat => GEMV_FLOAT,
            Family::NormRope => &["rms_norm", "rope", "norm_rope"],
            Family::Act => &["glu", "add_f32", "mul_f32", "scale_f32", "gather_rows_u8", "scatter_rows_f32"],
            Family::Embed => EMBED,
            Family::Attention => ATTENTION,
            Family::Moe => MOE,
            Family::Prim => PRIM,
        }
    }
}

/// The step graph's primitives (prim.cu), indexed by [`Prim`].
const PRIM: &[&str] = &[
    "prim_copy",
    "prim_unary",
    "prim_binary",
    "prim_softmax",
    "prim_reduce",
    "prim_cumsum",
    "prim_topk",
    "prim_take_along",
    "prim_gather",
    "prim_matmul",
    "prim_mask",
    "prim_ids",
    "prim_scan",
    "prim_rows_write",
    "prim_rope_freq",
    "prim_block_select",
    "prim_short_conv",
    "prim_delta_net",
    "prim_delta_net_chunked",
    "prim_to_f32",
    "prim_ngram_hash",
    "prim_conv_rows",
    "prim_pool_keys",
    "prim_pooled_select",
];

/// Entries of [`Family::Prim`], in the order of its table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Prim {
    Copy,
    Unary,
    Binary,
    Softmax,
    Reduce,
    Cumsum,
    TopK,
    TakeAlong,
    Gather,
    Matmul,
    Mask,
    Ids,
    Scan,
    RowsWrite,
    RopeFreq,
    BlockSelect,
    ShortConv,
    DeltaNet,
    DeltaNetChunked,
    ToF32,
    NgramHash,
    ConvRows,
    PoolKeys,
    PooledSelect,
}

/// The weight formats with dp4a kernels, in the order of the entry tables below.
pub const QUANT_TYPES: [GgmlType; 13] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ3_XXS,
];
/// Float weight formats (f32 activations).
pub const FLOAT_TYPES: [GgmlType; 3] = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];

pub(crate) fn quant_index(ty: GgmlType) -> Option<usize> {
    QUANT_TYPES.iter().position(|&t| t == ty)
}
pub(crate) fn float_index(ty: GgmlType) -> Option<usize> {
    FLOAT_TYPES.iter().position(|&t| t == ty)
}

// Per format i: gemv_<fmt> at 4i, gemm_<fmt> (dp4a) at 4i + 1, gemm_mma_<fmt>
// (int8 tensor cores) at 4i + 2, gemm_mma_grouped_<fmt> (the prefill experts'
// work list) at 4i + 3; then the two activation quantizers.
const GEMV_QUANT: &[&str] = &[
    "gemv_q8_0",
    "gemm_q8_0",
    "gemm_mma_q8_0",
    "gemm_mma_grouped_q8_0",
    "gemv_q4_0",
    "gemm_q4_0",
    "gemm_mma_q4_0",
    "gemm_mma_grouped_q4_0",
    "gemv_q4_1",
    "gemm_q4_1",
    "gemm_mma_q4_1",
    "gemm_mma_grouped_q4_1",
    "gemv_q5_0",
    "gemm_q5_0",
    "gemm_mma_q5_0",
    "gemm_mma_grouped_q5_0",
    "gemv_q5_1",
    "gemm_q5_1",
    "gemm_mma_q5_1",
    "gemm_mma_grouped_q5_1",
    "gemv_q2_k",
    "gemm_q2_k",
    "gemm_mma_q2_k",
    "gemm_mma_grouped_q2_k",
    "gemv_q3_k",
    "gemm_q3_k",
    "gemm_mma_q3_k",
    "gemm_mma_grouped_q3_k",
    "gemv_q4_k",
    "gemm_q4_k",
    "gemm_mma_q4_k",
    "gemm_mma_grouped_q4_k",
    "gemv_q5_k",
    "gemm_q5_k",
    "gemm_mma_q5_k",
    "gemm_mma_grouped_q5_k",
    "gemv_q6_k",
    "gemm_q6_k",
    "gemm_mma_q6_k",
    "gemm_mma_grouped_q6_k",
    "gemv_iq2_xxs",
    "gemm_iq2_xxs",
    "gemm_mma_iq2_xxs",
    "gemm_mma_grouped_iq2_xxs",
    "gemv_iq2_xs",
    "gemm_iq2_xs",
    "gemm_mma_iq2_xs",
    "gemm_mma_grouped_iq2_xs",
    "gemv_iq3_xxs",
    "gemm_iq3_xxs",
    "gemm_mma_iq3_xxs",
    "gemm_mma_grouped_iq3_xxs",
    "quantize_q8_0",
    "quantize_q8_k",
];
pub(crate) const QUANTIZE_Q8_0: usize = 52;
pub(crate) const QUANTIZE_Q8_K: usize = 53;
/// Entry of the quantized GEMV / dp4a GEMM / tensor-core GEMM / grouped
/// tensor-core GEMM of format `i`.
pub(crate) const fn gemv_entry(i: usize) -> usize {
    4 * i
}
pub(crate) const fn gemm_entry(i: usize) -> usize {
    4 * i + 1
}
pub(crate) const fn gemm_mma_entry(i: usize) -> usize {
    4 * i + 2
}
pub(crate) const fn gemm_mma_grouped_entry(i: usize) -> usize {
    4 * i + 3
}
/// Dynamic shared memory of gemm_mma_* (two stages of 64 weight rows at 304
/// bytes and 64 tokens at 336 bytes: MM_STAGE_BYTES(8) in gemv_quant.cu).
pub(crate) const MMA_SMEM_BYTES: u32 = 2 * (64 * 304 + 64 * 336);
/// The same for gemm_mma_grouped_* (32-token tiles: MM_STAGE_BYTES(4)).
pub(crate) const MMA_GROUPED_SMEM_BYTES: u32 = 2 * (64 * 304 + 32 * 336);

// attn_prefill_<kv>_d<dim> at att_prefill_at(kv, i) for dim
// ATT_PREFILL_DIMS[i]; the q8_0 entries follow the f32 / f16 ones' table.
const ATTENTION: &[&str] = &[
    "attn_partial_f32",
    "attn_partial_f16",
    "attn_combine",
    "kv_write",
    "attn_prefill_f32_d64",
    "attn_prefill_f16_d64",
    "attn_prefill_f32_d128",
    "attn_prefill_f16_d128",
    "attn_prefill_f32_d256",
    "attn_prefill_f16_d256",
    "attn_partial_rows_f32",
    "kv_write_rows",
    "attn_decode_f32_d64",
    "attn_decode_f16_d64",
    "attn_decode_f32_d128",
    "attn_decode_f16_d128",
    "attn_decode_f32_d256",
    "attn_decode_f16_d256",
    "attn_decode_rows_f32_d64",
    "attn_decode_rows_f16_d64",
    "attn_decode_rows_f32_d128",
    "attn_decode_rows_f16_d128",
    "attn_decode_rows_f32_d256",
    "attn_decode_rows_f16_d256",
    "kv_write_f16",
    "attn_partial_rows_f16",
    "kv_write_rows_f16",
    "attn_partial_q8_0",
    "kv_write_q8_0",
    "attn_partial_rows_q8_0",
    "kv_write_rows_q8_0",
    "attn_prefill_q8_0_d64",
    "attn_prefill_q8_0_d128",
    "attn_prefill_q8_0_d256",
    "attn_decode_q8_0_d64",
    "attn_decode_q8_0_d128",
    "attn_decode_q8_0_d256",
    "attn_decode_rows_q8_0_d64",
    "attn_decode_rows_q8_0_d128",
    "attn_decode_rows_q8_0_d256",
    "attn_partial_q4_0",
    "kv_write_q4_0",
    "attn_partial_rows_q4_0",
    "kv_write_rows_q4_0",
    "attn_prefill_q4_0_d64",
    "attn_prefill_q4_0_d128",
    "attn_prefill_q4_0_d256",
    "attn_decode_q4_0_d64",
    "attn_decode_q4_0_d128",
    "attn_decode_q4_0_d256",
    "attn_decode_rows_q4_0_d64",
    "attn_decode_rows_q4_0_d128",
    "attn_decode_rows_q4_0_d256",
    "attn_partial_bf16",
    "kv_write_bf16",
    "attn_partial_rows_bf16",
    "kv_write_rows_bf16",
    "attn_prefill_bf16_d64",
    "attn_prefill_bf16_d128",
    "attn_prefill_bf16_d256",
    "attn_decode_bf16_d64",
    "attn_decode_bf16_d128",
    "attn_decode_bf16_d256",
    "attn_decode_rows_bf16_d64",
    "attn_decode_rows_bf16_d128",
    "attn_decode_rows_bf16_d256",
    "attn_partial_fp8",
    "kv_write_fp8",
    "attn_partial_rows_fp8",
    "kv_write_rows_fp8",
    "attn_prefill_fp8_d64",
    "attn_prefill_fp8_d128",
    "attn_prefill_fp8_d256",
    "attn_decode_fp8_d64",
    "attn_decode_fp8_d128",
    "attn_decode_fp8_d256",
    "attn_decode_rows_fp8_d64",
    "attn_decode_rows_fp8_d128",
    "attn_decode_rows_fp8_d256",
];
/// attn_combine: every format's.
pub(crate) const ATT_COMBINE: usize = 2;
const ATT_PREFILL: usize = 4;
/// attn_partial_rows_f32 and kv_write_rows: rows of several sequences' caches.
const ATT_ROWS: usize = ATT_PREFILL + 2 * ATT_PREFILL_DIMS.len();
const KV_WRITE_ROWS: usize = ATT_ROWS + 1;
const ATT_DECODE: usize = KV_WRITE_ROWS + 1;
const ATT_DECODE_ROWS: usize = ATT_DECODE + 2 * ATT_PREFILL_DIMS.len();
/// The f16 caches' kv_write, attn_partial_rows and kv_write_rows.
const KV_WRITE_F16: usize = ATT_DECODE_ROWS + 2 * ATT_PREFILL_DIMS.len();
const ATT_ROWS_F16: usize = KV_WRITE_F16 + 1;
const KV_WRITE_ROWS_F16: usize = ATT_ROWS_F16 + 1;
/// The later formats' entries (q8_0, q4_0, bf16, then fp8: KvElem::ENTRY
/// 2 to 5, 13 each): attn_partial, kv_write, attn_partial_rows,
/// kv_write_rows, then attn_prefill, attn_decode and attn_decode_rows by dim.
const ATT_Q8: usize = KV_WRITE_ROWS_F16 + 1;
const ATT_LATE: usize = 4 + 3 * ATT_PREFILL_DIMS.len();
const fn att_late(kv: usize) -> usize {
    ATT_Q8 + (kv - 2) * ATT_LATE
}
/// attn_partial, kv_write, attn_partial_rows and kv_write_rows by cache
/// format (KvElem::ENTRY: 0 f32, 1 f16, 2 q8_0, 3 q4_0, 4 bf16, 5 fp8).
pub(crate) const ATT_PARTIAL_AT: [usize; 6] = [0, 1, att_late(2), att_late(3), att_late(4), att_late(5)];
pub(crate) const KV_WRITE_AT: [usize; 6] = [3, KV_WRITE_F16, att_late(2) + 1, att_late(3) + 1, att_late(4) + 1, att_late(5) + 1];
pub(crate) const ATT_ROWS_AT: [usize; 6] = [ATT_ROWS, ATT_ROWS_F16, att_late(2) + 2, att_late(3) + 2, att_late(4) + 2, att_late(5) + 2];
pub(crate) const KV_WRITE_ROWS_AT: [usize; 6] = [KV_WRITE_ROWS, KV_WRITE_ROWS_F16, att_late(2) + 3, att_late(3) + 3, att_late(4) + 3, att_late(5) + 3];
/// attn_prefill_<kv>_d<dim>, attn_decode_<kv>_d<dim> and
/// attn_decode_rows_<kv>_d<dim> for cache format kv and dim ATT_PREFILL_DIMS[i].
pub(crate) const fn att_prefill_at(kv: usize, i: usize) -> usize {
    if kv < 2 { ATT_PREFILL + 2 * i + kv } else { att_late(kv) + 4 + i }
}
pub(crate) const fn att_decode_at(kv: usize, i: usize) -> usize {
    if kv < 2 { ATT_DECODE + 2 * i + kv } else { att_late(kv) + 4 + ATT_PREFILL_DIMS.len() + i }
}
pub(crate) const fn att_decode_rows_at(kv: usize, i: usize) -> usize {
    if kv < 2 { ATT_DECODE_ROWS + 2 * i + kv } else { att_late(kv) + 4 + 2 * ATT_PREFILL_DIMS.len() + i }
}
/// Cache formats the attention kernels are built for, by KvElem::ENTRY.
pub(crate) const ATT_FORMATS: [&str; 6] = ["f32", "f16", "q8_0", "q4_0", "bf16", "fp8"];
/// Threads of an attn_decode block (AD_THREADS) and the most heads it takes (AD_HEADS).
pub(crate) const ATT_DECODE_THREADS: u32 = 128;
pub(crate) const ATT_DECODE_HEADS: usize = 16;
/// The head dims (d_k = d_v) attn_prefill_* is built for.
pub(crate) const ATT_PREFILL_DIMS: [usize; 3] = [64, 128, 256];
/// Threads and (query, head) rows of an attn_prefill block (AP_THREADS, AP_ROWS).
pub(crate) const ATT_PREFILL_THREADS: u32 = 256;
pub(crate) const ATT_PREFILL_ROWS: usize = 64;

/// Dynamic shared memory of attn_prefill_* for head dim `d` (ApGeo::SMEM in
/// attention.cu): 64 q rows and KT = 8192 / d k or v rows of d + 4 floats,
/// and 256 score slots of 64 + 8 rows.
pub(crate) const fn attn_prefill_smem(d: usize) -> u32 {
    ((ATT_PREFILL_ROWS * (d + 4) + (8192 / d) * (d + 4) + 256 * (ATT_PREFILL_ROWS + 8)) * 4) as u32
}

/// Dynamic shared memory of attn_decode_* for head dim `d` (AdGeo::SMEM):
/// 16 q rows and KT (64, or 32 from d 256) k rows of d + 4 floats, and 256
/// keys' scores of 16 heads.
pub(crate) const fn attn_decode_smem(d: usize) -> u32 {
    let kt = if d >= 256 { 32 } else { 64 };
    ((ATT_DECODE_HEADS * (d + 4) + kt * (d + 4) + 256 * ATT_DECODE_HEADS) * 4) as u32
}

/// The dynamic shared memory above the default 48 KiB that entry `index` of
/// `family` needs opted in at load.
pub(crate) fn large_smem(family: Family, index: usize) -> Option<u32> {
    match family {
        Family::Attention => (0..ATT_FORMATS.len()).flat_map(|kv| ATT_PREFILL_DIMS.iter().enumerate().map(move |(i, &d)| (kv, i, d))).find_map(|(kv, i, d)| {
            if index == att_prefill_at(kv, i) {
                Some(attn_prefill_smem(d))
            } else if index == att_decode_at(kv, i) || index == att_decode_rows_at(kv, i) {
                Some(attn_decode_smem(d))
            } else {
                None
            }
        }),
        Family::GemvQuant if index < QUANTIZE_Q8_0 => match index % 4 {
            0 => Some(DECODE_SMEM_MAX),
            2 => Some(MMA_SMEM_BYTES),
            3 => Some(MMA_GROUPED_SMEM_BYTES),
            _ => None,
        },
        // The quantized moe_up / moe_down entries.
        Family::Moe if (1..MOE_GATHER_PTRS).contains(&index) => Some(DECODE_SMEM_MAX),
        _ => None,
    }
}

/// The most dynamic shared memory a decode kernel (gemv_*, moe_up_*,
/// moe_down_*) is launched with: its staged activation row and eight warps'
/// rings (decode_dot.cuh). With the kernels' 4.1 KiB of static `vals` it
/// stays within the 99 KiB a block may have on sm_86 / sm_89.
pub(crate) const DECODE_SMEM_MAX: u32 = 88 * 1024;

// Per float format i (FLOAT_TYPES order): gemv_<fmt> at 2i, gemm_<fmt> at
// 2i + 1; then the one-row-a-block staged GEMVs at GEMV_STAGED + i.
const GEMV_FLOAT: &[&str] = &[
    "gemv_f32",
    "gemm_f32",
    "gemv_f16",
    "gemm_f16",
    "gemv_bf16",
    "gemm_bf16",
    "gemv_staged_f32",
    "gemv_staged_f16",
    "gemv_staged_bf16",
];
pub(crate) const GEMV_STAGED: usize = 6;

// Float formats first (FLOAT_TYPES order), then QUANT_TYPES order.
const EMBED: &[&str] = &[
    "embed_f32",
    "embed_f16",
    "embed_bf16",
    "embed_q8_0",
    "embed_q4_0",
    "embed_q4_1",
    "embed_q5_0",
    "embed_q5_1",
    "embed_q2_k",
    "embed_q3_k",
    "embed_q4_k",
    "embed_q5_k",
    "embed_q6_k",
    "embed_iq2_xxs",
    "embed_iq2_xs",
    "embed_iq3_xxs",
];

// route_topk, then moe_up_<fmt> at 1 + 2i and moe_down_<fmt> at 2 + 2i, then
// the pointer gather and the slot combine, then the float experts (FLOAT_TYPES
// order): moe_up_<fmt> at MOE_FLOAT + 2i, moe_down_<fmt> at MOE_FLOAT + 2i + 1;
// then the one-warp-a-token router (ROUTE_WARP).
const MOE: &[&str] = &[
    "route_topk",
    "moe_up_q8_0",
    "moe_down_q8_0",
    "moe_up_q4_0",
    "moe_down_q4_0",
    "moe_up_q4_1",
    "moe_down_q4_1",
    "moe_up_q5_0",
    "moe_down_q5_0",
    "moe_up_q5_1",
    "moe_down_q5_1",
    "moe_up_q2_k",
    "moe_down_q2_k",
    "moe_up_q3_k",
    "moe_down_q3_k",
    "moe_up_q4_k",
    "moe_down_q4_k",
    "moe_up_q5_k",
    "moe_down_q5_k",
    "moe_up_q6_k",
    "moe_down_q6_k",
    "moe_up_iq2_xxs",
    "moe_down_iq2_xxs",
    "moe_up_iq2_xs",
    "moe_down_iq2_xs",
    "moe_up_iq3_xxs",
    "moe_down_iq3_xxs",
    "moe_gather_ptrs",
    "moe_combine",
    "moe_up_f32",
    "moe_down_f32",
    "moe_up_f16",
    "moe_down_f16",
    "moe_up_bf16",
    "moe_down_bf16",
    "route_topk_warp",
    "moe_combine_add",
    "lane_fill_rows",
];
pub(crate) const ACT_GATHER_ROWS: usize = 4;
pub(crate) const ACT_SCATTER_ROWS: usize = 5;
pub(crate) const MOE_GATHER_PTRS: usize = 27;
pub(crate) const MOE_COMBINE: usize = 28;
pub(crate) const MOE_FLOAT: usize = 29;
pub(crate) const ROUTE_WARP: usize = 35;
pub(crate) const MOE_COMBINE_ADD: usize = 36;
pub(crate) const LANE_FILL_ROWS: usize = 37;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_tables_follow_the_format_order() {
        for (i, ty) in QUANT_TYPES.iter().enumerate() {
            let n = ty.name().to_ascii_lowercase();
            assert_eq!(GEMV_QUANT[gemv_entry(i)], format!("gemv_{n}"));
            assert_eq!(GEMV_QUANT[gemm_entry(i)], format!("gemm_{n}"));
            assert_eq!(GEMV_QUANT[gemm_mma_entry(i)], format!("gemm_mma_{n}"));
            assert_eq!(GEMV_QUANT[gemm_mma_grouped_entry(i)], format!("gemm_mma_grouped_{n}"));
            assert_eq!(large_smem(Family::GemvQuant, gemm_mma_entry(i)), Some(MMA_SMEM_BYTES));
            assert_eq!(large_smem(Family::GemvQuant, gemm_mma_grouped_entry(i)), Some(MMA_GROUPED_SMEM_BYTES));
            assert_eq!(large_smem(Family::GemvQuant, gemv_entry(i)), Some(DECODE_SMEM_MAX));
            assert_eq!(large_smem(Family::Moe, 1 + 2 * i), Some(DECODE_SMEM_MAX));
            assert_eq!(large_smem(Family::Moe, 2 + 2 * i), Some(DECODE_SMEM_MAX));
            assert_eq!(large_smem(Family::GemvQuant, gemm_entry(i)), None);
            assert_eq!(EMBED[3 + i], format!("embed_{n}"));
            assert_eq!(MOE[1 + 2 * i], format!("moe_up_{n}"));
            assert_eq!(MOE[2 + 2 * i], format!("moe_down_{n}"));
        }
        for (i, ty) in FLOAT_TYPES.iter().enumerate() {
            let n = ty.name().to_ascii_lowercase();
            assert_eq!(GEMV_FLOAT[2 * i], format!("gemv_{n}"));
            assert_eq!(GEMV_FLOAT[2 * i + 1], format!("gemm_{n}"));
            assert_eq!(GEMV_FLOAT[GEMV_STAGED + i], format!("gemv_staged_{n}"));
            assert_eq!(EMBED[i], format!("embed_{n}"));
            assert_eq!(MOE[MOE_FLOAT + 2 * i], format!("moe_up_{n}"));
            assert_eq!(MOE[MOE_FLOAT + 2 * i + 1], format!("moe_down_{n}"));
        }
        assert_eq!(GEMV_QUANT[QUANTIZE_Q8_0], "quantize_q8_0");
        assert_eq!(GEMV_QUANT[QUANTIZE_Q8_K], "quantize_q8_k");
        assert_eq!(MOE[MOE_GATHER_PTRS], "moe_gather_ptrs");
        assert_eq!(MOE[MOE_COMBINE], "moe_combine");
        assert_eq!(MOE[MOE_COMBINE_ADD], "moe_combine_add");
        assert_eq!(MOE[LANE_FILL_ROWS], "lane_fill_rows");
        assert_eq!(MOE[ROUTE_WARP], "route_topk_warp");
        assert_eq!(GEMV_FLOAT.len(), GEMV_STAGED + FLOAT_TYPES.len());
        for (i, d) in ATT_PREFILL_DIMS.iter().enumerate() {
            for (kv, name) in ATT_FORMATS.iter().enumerate() {
                let e = att_prefill_at(kv, i);
                assert_eq!(ATTENTION[e], format!("attn_prefill_{name}_d{d}"));
                assert_eq!(large_smem(Family::Attention, e), Some(attn_prefill_smem(*d)));
                let e = att_decode_at(kv, i);
                assert_eq!(ATTENTION[e], format!("attn_decode_{name}_d{d}"));
                assert_eq!(large_smem(Family::Attention, e), Some(attn_decode_smem(*d)));
                let e = att_decode_rows_at(kv, i);
                assert_eq!(ATTENTION[e], format!("attn_decode_rows_{name}_d{d}"));
                assert_eq!(large_smem(Family::Attention, e), Some(attn_decode_smem(*d)));
            }
        }
        for (kv, name) in ATT_FORMATS.iter().enumerate() {
            let suffix = if kv == 0 { String::new() } else { format!("_{name}") };
            assert_eq!(ATTENTION[ATT_PARTIAL_AT[kv]], format!("attn_partial_{name}"));
            assert_eq!(ATTENTION[KV_WRITE_AT[kv]], format!("kv_write{suffix}"));
            assert_eq!(ATTENTION[KV_WRITE_ROWS_AT[kv]], format!("kv_write_rows{suffix}"));
            assert_eq!(ATTENTION[ATT_ROWS_AT[kv]], format!("attn_partial_rows_{name}"));
            for e in [ATT_PARTIAL_AT[kv], KV_WRITE_AT[kv], KV_WRITE_ROWS_AT[kv], ATT_ROWS_AT[kv]] {
                assert_eq!(large_smem(Family::Attention, e), None);
            }
        }
        assert_eq!(ATTENTION[ATT_COMBINE], "attn_combine");
        assert_eq!(ATTENTION.len(), att_decode_rows_at(ATT_FORMATS.len() - 1, ATT_PREFILL_DIMS.len() - 1) + 1);
        assert_eq!(large_smem(Family::Attention, 0), None);
        // The kernel's geometry (attention.cu), which the sizes above restate.
        let src = Family::Attention.source();
        for def in ["#define AP_THREADS 256", "#define AP_ROWS 64", "#define AP_CHUNK 256", "#define AP_SCS (AP_ROWS + 8)", "#define AD_THREADS 128", "#define AD_HEADS 16", "#define AD_CHUNK 256"] {
            assert!(src.contains(def), "attention.cu lacks {def}");
        }
        assert_eq!(attn_prefill_smem(128), (64 * 132 + 64 * 132 + 256 * 72) * 4);
        assert_eq!(attn_decode_smem(128), (16 * 132 + 64 * 132 + 256 * 16) * 4);
        assert_eq!(attn_decode_smem(256), (16 * 260 + 32 * 260 + 256 * 16) * 4);
        assert_eq!(MOE.len(), LANE_FILL_ROWS + 1);
        // The chunked delta rule's geometry (prim.cu), which its launcher's shared size restates.
        let src = Family::Prim.source();
        for def in [format!("#define DN_CHUNK {}", pulsar_kernels::ops::DELTA_NET_CHUNK), format!("#define DN_COLS {}", crate::ops::DELTA_NET_COLS)] {
            assert!(src.contains(&def), "prim.cu lacks {def}");
        }
    }

    #[test]
    fn every_entry_is_defined_in_its_source() {
        for f in Family::ALL {
            let src = f.source();
            for e in f.entries() {
                // Either written out or generated by an ENTRY macro.
                assert!(
                    src.contains(&format!(" {e}(")) || macro_defines(src, e),
                    "{}: no definition of {e}",
                    f.file()
                );
            }
        }
    }

    /// Kernels are launched with programmatic dependent launch on sm_90+, so
    /// one that touched memory before `pdl_begin` would race its predecessor.
    #[test]
    fn every_kernel_waits_for_its_predecessor_first() {
        for f in Family::ALL {
            let src = f.source();
            let mut defs = 0;
            for (at, _) in src.match_indices("extern \"C\" __global__") {
                let body = &src[at..];
                let open = body.find('{').expect("a kernel body");
                let first = body[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
                assert!(first.starts_with("pdl_begin();"), "{}: a kernel does not start with pdl_begin: {}", f.file(), &body[..open]);
                defs += 1;
            }
            assert!(defs > 0, "{}: no kernels found", f.file());
        }
    }

    /// `gemv_q4_k` is defined by `GEMV_ENTRY(q4_k, ...)` (prefix `gemv_##NAME`).
    fn macro_defines(src: &str, entry: &str) -> bool {
        src.lines().filter_map(|l| l.strip_suffix(')')).any(|l| {
            let Some((mac, args)) = l.split_once('(') else {
                return false;
            };
            let name = args.split(',').next().unwrap_or("").trim();
            let prefixes: &[&str] = match mac.trim() {
                "GEMV_ENTRY" => &["gemv_", "gemm_", "gemm_mma_", "gemm_mma_grouped_"],
                "FGEMV_ENTRY" => &["gemv_", "gemm_", "gemv_staged_"],
                "EMBED_Q" | "EMBED_F" => &["embed_"],
                "ATT_ENTRY" => &["attn_partial_"],
                "AP_ENTRY" => &["attn_prefill_"],
                "AD_ENTRY" => &["attn_decode_"],
                "AD_ROWS_ENTRY" => &["attn_decode_rows_"],
                "ATT_ROWS_ENTRY" => &["attn_partial_rows_"],
                "KV_WRITE_ENTRY" => &["kv_write"],
                "KV_WRITE_ROWS_ENTRY" => &["kv_write_rows"],
                "MOE_ENTRY" | "MOE_FENTRY" => &["moe_up_", "moe_down_"],
                _ => &[],
            };
            prefixes.iter().any(|p| format!("{p}{name}") == entry)
        })
    }
}
