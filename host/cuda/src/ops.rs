//! One function per op. Each takes the stream it is queued on, checks every
//! size against the buffers it is given (an error, never a panic or an
//! out-of-bounds launch), and allocates nothing: callers pass preallocated
//! buffers, so a decode step can run with no allocation at all.

use std::ffi::c_void;

use cudarc::driver::{result, CudaFunction, CudaStream};
use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::{Activation, AttnParams, RopeKind, RopeParams};
use pulsar_kernels::ActFormat;

use crate::buf::{DeviceBuf, Pod};
use crate::device::CudaDevice;
use crate::error::{shape, CudaError};
use crate::kernels::{
    attn_decode_smem, attn_prefill_smem, float_index, gemm_entry, gemm_mma_entry, gemm_mma_grouped_entry, gemv_entry, quant_index, Family,
    ACT_GATHER_ROWS, ACT_SCATTER_ROWS, att_decode_at, att_decode_rows_at, att_prefill_at, ATT_COMBINE, ATT_DECODE_HEADS, ATT_DECODE_THREADS, ATT_PARTIAL_AT, ATT_PREFILL_DIMS, ATT_ROWS_AT, KV_WRITE_AT, KV_WRITE_ROWS_AT, ATT_PREFILL_ROWS, ATT_PREFILL_THREADS, GEMV_STAGED,
    MMA_GROUPED_SMEM_BYTES, MMA_SMEM_BYTES, MOE_COMBINE, MOE_COMBINE_ADD, LANE_FILL_ROWS, MOE_FLOAT, MOE_GATHER_PTRS, QUANTIZE_Q8_0,
    QUANTIZE_Q8_K, ROUTE_WARP,
};

/// Pointers to the kernel's parameters, in order (each must outlive the launch call).
macro_rules! params {
    ($($v:expr),* $(,)?) => { [$( (&$v) as *const _ as *mut c_void ),*] };
}

// The router and expert-FFN ops (a second `impl CudaDevice`).
mod moe;
// The step graph's primitives (a third `impl CudaDevice`).
mod prim;
// The KV write and attention (a fourth).
mod attention;
mod kv;
pub use kv::{kv_bytes, kv_elems, KvBf16, KvElem, KvFp8, KvQ4};
pub use prim::{lanes, strides, PrimShape, PRIM_RANK};
#[cfg(test)]
pub(crate) use prim::DELTA_NET_COLS;

const GEMV_ROWS_PER_BLOCK: usize = 4; // FG_WARPS / MOE_WARPS of the float kernels
const GEMM_TOKENS: usize = 8; // FG_TT
const QGEMM_ROWS_PER_BLOCK: usize = 16; // QV_WARPS * QM_R
const QGEMM_TOKENS: usize = 8; // QM_T
const MMA_ROWS_PER_BLOCK: usize = 64; // MM_ROWS
const MMA_TOKENS: usize = 64; // MM_TOK
const ATT_CHUNK: usize = 256;
// attn_prefill's AP_CHUNK (its score slots are key mod 256).
const _: () = assert!(ATT_CHUNK == 256);
// CudaDevice::attention takes the tiled kernel from this many queries and
// blocks (fewer blocks than about half the SMs run faster as one per query).
const ATT_TILED_MIN_Q: usize = 16;
const ATT_TILED_MIN_BLOCKS: usize = 64;
// Below this many cached keys a layer's cache stays in L2, where the
// per-query kernel's re-reads of it (one per head) cost little and its many
// blocks fill the device; from here the grouped kernel reads it once.
const ATT_GROUPED_MIN_CTX: usize = 2048;
// The grouped kernel pays for quads of heads: it takes groups of 4 or more.
const ATT_GROUPED_MIN_GROUP: usize = 4;

/// Which kernel runs a quantized GEMM. Both sum every dot in the canonical
/// order of the GEMV (quant_units.cuh, block_value), so they give the GEMV's
/// bits: a decoded token equals a fresh prefill's, whichever ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKernel {
    /// Four weight rows x eight tokens per warp on dp4a (any GPU with dp4a).
    Dp4a,
    /// int8 tensor cores (mma.sync m16n8k16), tiles of 64 rows x 64 tokens
    /// staged through shared memory by cp.async; sm_80+.
    TensorCore,
}

impl GemmKernel {
    /// The kernel [`CudaDevice::gemm`] uses on a device of compute capability `cc`.
    pub fn default_for(cc: (i32, i32)) -> GemmKernel {
        if cc.0 < 8 {
            GemmKernel::Dp4a
        } else {
            GemmKernel::TensorCore
        }
    }
}
const ATT_THREADS: u32 = 128;
/// Most tokens of one GEMM launch (the prefill chunk).
pub const MAX_GEMM_TOKENS: usize = 512 * 64;
/// Most experts a route_topk launch selects per token.
pub const MAX_TOP_K: usize = 64;
/// Most experts a router scores (two floats each in shared memory).
pub const MAX_EXPERTS: usize = 4096;

/// Most experts route_topk_warp scores (eight a lane: ROUTE_WARP_MAX).
pub const ROUTE_WARP_MAX_EXPERTS: usize = 256;
const ROUTE_WARP_TOKENS: usize = 4; // ROUTE_WARPS

/// Gating function of a MoE router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// A top-k router: `k` experts per token by (score + bias); weights are the
/// unbiased scores, renormalised over the k when asked, then times `scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterSpec {
    pub k: usize,
    pub gating: Gating,
    pub renormalize: bool,
    pub scale: f32,
}

/// Which kernel forms attention's per-split partials. attn_combine merges
/// either's, and both give the same bits (the CPU twin's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKernel {
    /// attn_partial: one block per (head, query, split); decode's.
    PerQuery,
    /// attn_prefill: one block per (kv head, 64 (query, head) rows, split),
    /// each k / v row staged in shared memory once for all of them. Needs
    /// d_k = d_v in 64 / 128 / 256 and the shared memory of sm_80 / sm_90
    /// (d 256: sm_90).
    Tiled,
    /// attn_decode: one block per (kv head, up to 16 of its heads, query,
    /// split), each k / v row read once for all of them. Needs d_k = d_v in
    /// 64 / 128 / 256.
    Grouped,
}

/// The per-(token, slot) expert pointers of one MoE launch: device addresses
/// of each pair's gate, up and down matrices, 0 for a pair this launch skips.
/// Pair `p = t * n_slot + s`.
/// One expert's share of a grouped MoE product: the device addresses of its
/// gate, up and down matrices (the caller's contract, as for [`MoePairs`])
/// and its run of rows in the expert-sorted order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertRun {
    pub gate: u64,
    pub up: u64,
    pub down: u64,
    pub start: usize,
    pub len: usize,
}

/// Work buffers of [`CudaDevice::moe_ffn_grouped`] for `n` sorted rows:
/// `xs` the gathered activations, `hg`/`hu`/`h` `[n, ff]`, `hq` `h`
/// quantized, `outs` `[n, d_model]`; `items` room for the work list of the
/// tensor-core kernel (4 values per item; at most `n / 32 + runs` items:
/// [`grouped_items_len`]).
pub struct GroupedScratch<'a> {
    pub items: &'a mut DeviceBuf<u64>,
    pub xs: &'a mut DeviceBuf<u8>,
    pub hg: &'a mut DeviceBuf<f32>,
    pub hu: &'a mut DeviceBuf<f32>,
    pub h: &'a mut DeviceBuf<f32>,
    pub hq: &'a mut DeviceBuf<u8>,
    pub outs: &'a mut DeviceBuf<f32>,
}

pub struct MoePairs<'a> {
    pub gate: &'a DeviceBuf<u64>,
    pub up: &'a DeviceBuf<u64>,
    pub down: &'a DeviceBuf<u64>,
    pub n_tok: usize,
    pub n_slot: usize,
}

/// The pair count of an expert-FFN launch, its pointer tables and `h`
/// (`[n_pairs, ff]`) / `out` (`[n_pairs, d_model]`) lengths checked.
fn check_pairs(op: &'static str, pairs: &MoePairs<'_>, h_len: usize, ff: usize, out_len: usize, d_model: usize) -> Result<usize, CudaError> {
    let n_pairs = pairs.n_tok * pairs.n_slot;
    want(op, "gate pointers", pairs.gate.len(), n_pairs)?;
    want(op, "up pointers", pairs.up.len(), n_pairs)?;
    want(op, "down pointers", pairs.down.len(), n_pairs)?;
    want(op, "h", h_len, n_pairs * ff)?;
    want(op, "out", out_len, n_pairs * d_model)?;
    if n_pairs > 65535 {
        return Err(shape(op, format!("{n_pairs} pairs in one launch (at most 65535)")));
    }
    Ok(n_pairs)
}

/// Most warps a block of the decode kernels (gemv_*, moe_up_*, moe_down_*): DD_WARPS.
const DECODE_WARPS: usize = 8;
/// Warps a block when a launch has fewer warps than an SM-wide wave: more,
/// smaller blocks spread a small matrix over more SMs.
const DECODE_WARPS_SMALL: usize = 4;
/// Rows of one group of a decode warp, all matrices together (DD_MAX_ROWS).
const DECODE_MAX_ROWS: usize = 4;
/// Ring slots of a decode warp (DD_SLOTS).
const DECODE_SLOTS: usize = 3;
/// A warp's ring of staged row chunks is kept to this: enough for two q8_0
/// rows (or four q2_K rows) a step, whose per-step costs (the activation
/// units, the waits, the ordered sum) the rows then share; three blocks of
/// eight warps still fit an SM's shared memory.
const DECODE_RING_BUDGET: usize = 9 * 1024;
/// Warps worth keeping busy: about one wave of ~32 resident warps on each of
/// ~130 SMs. Past it a group takes more rows, then a warp more groups (on
/// the H200, two-row groups from 2048 warps made the 4096x8192 q8_0 GEMV
/// slower, 21.1 against 19.0 us: fewer warps hide less latency).
const DECODE_WARPS_WANTED: usize = 4096;

/// The launch shape of one decode kernel: rows a group (per matrix), groups a
/// warp, the activation row's staging bytes (0: read from global memory) and
/// the block's dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct DecodePlan {
    rpw: usize,
    groups: usize,
    warps: usize,
    xsb: usize,
    smem: usize,
}

impl DecodePlan {
    /// Blocks along x for `rows` rows a matrix (and pair).
    fn blocks(&self, rows: usize) -> u32 {
        rows.div_ceil(self.warps * self.rpw * self.groups) as u32
    }
    fn threads(&self) -> u32 {
        (self.warps * 32) as u32
    }
}

/// Bytes of one warp's ring for groups of `nrows` rows (decode_dot.cuh's
/// dd_ring_bytes): a slot holds a chunk (8 superblocks or 32 blocks) of
/// each row plus a granule, so it keeps its phase.
fn decode_ring_bytes(ty: GgmlType, nrows: usize) -> usize {
    let (be, bb) = (ty.block_elems() as usize, ty.block_bytes() as usize);
    let bps = if be == 256 { 8 } else { 32 };
    DECODE_SLOTS * nrows * (bps * bb + 16)
}

/// Plan a decode launch over `total_rows` rows (all pairs together) of
/// `mats` matrices read side by side (moe_up: gate and up), against
/// activation rows of `x_bytes`. A group takes more rows while enough warps
/// remain and the ring stays in budget; then a warp takes more groups (one
/// warp streams its groups back to back, two steps ahead) until about
/// DECODE_WARPS_WANTED warps remain.
fn decode_plan(ty: GgmlType, total_rows: usize, mats: usize, x_bytes: usize) -> DecodePlan {
    let mut rpw = 1;
    while mats * rpw * 2 <= DECODE_MAX_ROWS
        && decode_ring_bytes(ty, mats * rpw * 2) <= DECODE_RING_BUDGET
        && total_rows / (rpw * 2) >= DECODE_WARPS_WANTED
    {
        rpw *= 2;
    }
    let groups = (total_rows / rpw / DECODE_WARPS_WANTED).max(1);
    let warps = if total_rows / (rpw * groups) < DECODE_WARPS_WANTED / 2 { DECODE_WARPS_SMALL } else { DECODE_WARPS };
    let rings = warps * decode_ring_bytes(ty, mats * rpw);
    let staged = (x_bytes + 32).next_multiple_of(16);
    let xsb = if staged + rings <= crate::kernels::DECODE_SMEM_MAX as usize { staged } else { 0 };
    DecodePlan { rpw, groups, warps, xsb, smem: xsb + rings }
}

/// Most rows a float GEMV runs on the staged kernel (one row a block): up to
/// here four rows a block leave too few loads in flight to fill the GPU.
pub const FLOAT_STAGED_MAX_ROWS: usize = 1024;
/// Values of one staged chunk of gemv_staged_* (a multiple of 32); two chunks
/// are in flight at once.
const FLOAT_STAGE_CHUNK: usize = 2048;

/// Chunk length and dynamic shared memory of gemv_staged_* for rows of `cols`
/// values of `wb` bytes: one buffer (`ch` weights and `ch` activations, each
/// with 32 bytes of granule slack: fgs_buf_bytes) a chunk, at most two.
fn float_stage_plan(cols: usize, wb: usize) -> (usize, u32) {
    let ch = cols.next_multiple_of(32).clamp(32, FLOAT_STAGE_CHUNK);
    let bufs = cols.div_ceil(ch).min(2);
    (ch, (bufs * (ch * wb + 32 + ch * 4 + 32)) as u32)
}

#[allow(clippy::too_many_arguments)]
fn check_float_mm(
    op: &'static str,
    ty: GgmlType,
    w: &DeviceBuf<u8>,
    rows: usize,
    cols: usize,
    x: &DeviceBuf<f32>,
    n_tok: usize,
    y: &DeviceBuf<f32>,
) -> Result<usize, CudaError> {
    let fi = float_index(ty).ok_or(CudaError::Unsupported { op, ty })?;
    want(op, "weight bytes", w.len(), weight_bytes(ty, rows, cols)?)?;
    want(op, "x", x.len(), n_tok * cols)?;
    want(op, "y", y.len(), n_tok * rows)?;
    to_i32(op, "rows", rows)?;
    to_i32(op, "cols", cols)?;
    Ok(fi)
}

/// One matrix of a [`CudaDevice::gemv_multi`]: `rows` rows of weights `w`
/// into `y`.
pub struct GemvPart<'a> {
    pub w: &'a DeviceBuf<u8>,
    pub rows: usize,
    pub y: &'a mut DeviceBuf<f32>,
}

/// One tensor of a [`CudaDevice::norm_rope`]: `x` rows of `width` values
/// (heads of `head_dim`), normed per head with `weight` and `eps`.
pub struct NormRopePart<'a> {
    pub x: &'a DeviceBuf<f32>,
    pub weight: Option<&'a DeviceBuf<f32>>,
    pub eps: f32,
    pub width: usize,
    pub normed: &'a mut DeviceBuf<f32>,
    pub roped: &'a mut DeviceBuf<f32>,
}

/// Work-list values [`GroupedScratch::items`] needs for `n` sorted rows in `runs` runs.
pub fn grouped_items_len(n: usize, runs: usize) -> usize {
    4 * (n / GROUPED_TILE + runs)
}
const GROUPED_TILE: usize = 32; // 8 * 4 tokens of gemm_mma_grouped

fn act_code(a: Activation) -> Result<i32, CudaError> {
    match a {
        Activation::Silu => Ok(0),
        Activation::GeluTanh => Ok(1),
        Activation::Gelu => Err(shape(
            "activation",
            "exact GELU has no CUDA kernel yet (use gelu_tanh)",
        )),
        // unit_f's code in common.cuh (the gated unit reads gate and up together).
        Activation::SwigluOai => Ok(3),
    }
}

fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| shape(op, format!("{what} = {v} exceeds i32")))
}

fn want(op: &'static str, what: &str, got: usize, expected: usize) -> Result<(), CudaError> {
    if got != expected {
        return Err(shape(
            op,
            format!("{what}: {got} values, expected {expected}"),
        ));
    }
    Ok(())
}

fn ptr_or_null<T: Pod>(b: Option<&DeviceBuf<T>>) -> u64 {
    b.map(|b| b.device_ptr()).unwrap_or(0)
}

/// Bytes of `rows` activation rows of `cols` values in `fmt` (q8_0: 34 per 32, q8_K: 292 per 256).
pub fn act_bytes(fmt: ActFormat, rows: usize, cols: usize) -> Result<usize, CudaError> {
    let ty = fmt.ggml_type();
    let be = ty.block_elems() as usize;
    if cols == 0 || cols % be != 0 {
        return Err(shape(
            "activations",
            format!("{cols} columns are not whole {ty} blocks"),
        ));
    }
    Ok(rows * cols / be * ty.block_bytes() as usize)
}

/// Bytes of a `[rows, cols]` weight matrix of `ty`.
pub fn weight_bytes(ty: GgmlType, rows: usize, cols: usize) -> Result<usize, CudaError> {
    let be = ty.block_elems() as usize;
    if cols == 0 || cols % be != 0 {
        return Err(shape(
            "weights",
            format!("{cols} columns are not whole {ty} blocks"),
        ));
    }
    Ok(rows * (cols / be) * ty.block_bytes() as usize)
}

/// Workspace values [`CudaDevice::attention`] needs for `n_q` queries over `n_ctx` cached rows.
pub fn attention_workspace_len(p: &AttnParams, n_q: usize, n_ctx: usize) -> usize {
    n_q * p.n_head * attention_splits(p, n_ctx) * (p.head_dim_v + 2)
}

/// The context length a captured decode graph sizes attention for: the split
/// count rounded up to a power of two (at most the cache's `cap` rows), so one
/// graph serves many tokens. The extra splits are empty and change no bit.
pub fn attention_graph_ctx(n_ctx: usize, cap: usize) -> usize {
    (n_ctx.div_ceil(ATT_CHUNK).max(1).next_power_of_two() * ATT_CHUNK).min(cap).max(n_ctx)
}

fn attention_splits(p: &AttnParams, n_ctx: usize) -> usize {
    let span = if p.window > 0 {
        p.window.min(n_ctx)
    } else {
        n_ctx
    };
    span.div_ceil(ATT_CHUNK).max(1)
}

impl CudaDevice {
    /// # Safety
    /// `args` must match the kernel's parameter list in number, order and type,
    /// and every pointer in it must address enough device memory for the grid.
    unsafe fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        stream: &CudaStream,
        args: &mut [*mut c_void],
    ) -> Result<(), CudaError> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        if grid.1 > 65535 || grid.2 > 65535 {
            return Err(shape(
                "launch",
                format!("grid {grid:?} exceeds 65535 in y or z"),
            ));
        }
        self.context().bind_to_thread()?;
        if self.programmatic_launch() {
            use cudarc::driver::sys;
            // SAFETY: a zeroed attribute is a valid "ignore"; the id and the
            // union field set below are the documented pair.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: smem,
                hStream: stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: the caller's contract on `args`; `cfg` and `attr` outlive the call.
            unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }.result()?;
        } else {
            unsafe {
                result::launch_kernel(
                    f.cu_function(),
                    grid,
                    (block, 1, 1),
                    smem,
                    stream.cu_stream(),
                    args,
                )
            }?;
        }
        Ok(())
    }

    /// Quantize `rows` rows of `cols` f32 values to `fmt` blocks, bit-identical
    /// to the CPU's `Activations::quantize`.
    pub fn quantize_act(
        &self,
        stream: &CudaStream,
        fmt: ActFormat,
        x: &DeviceBuf<f32>,
        rows: usize,
        cols: usize,
        out: &mut DeviceBuf<u8>,
    ) -> Result<(), CudaError> {
        const OP: &str = "quantize_act";
        want(OP, "x", x.len(), rows * cols)?;
        want(OP, "out bytes", out.len(), act_bytes(fmt, rows, cols)?)?;
        let (entry, be) = match fmt {
            ActFormat::Q8_0 => (QUANTIZE_Q8_0, 32),
            ActFormat::Q8K => (QUANTIZE_Q8_K, 256),
            ActFormat::F32 => return Err(shape(OP, "f32 activations need no quantization")),
        };
        let n_blocks = to_i32(OP, "blocks", rows * cols / be)?;
        let f = self.func(Family::GemvQuant, entry)?;
        let (xp, op) = (x.device_ptr(), out.device_ptr());
        let grid = (n_blocks as u32).div_ceil(8);
        // SAFETY: (const float*, u8*, int) as in gemv_quant.cu; sizes checked above.
        unsafe {
            self.launch(
                f,
                (grid, 1, 1),
                256,
                0,
                stream,
                &mut params![xp, op, n_blocks],
            )
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn check_quant_mm(
        &self,
        op: &'static str,
        ty: GgmlType,
        w: &DeviceBuf<u8>,
        rows: usize,
        cols: usize,
        x: &DeviceBuf<u8>,
        n_tok: usize,
        y: &DeviceBuf<f32>,
    ) -> Result<usize, CudaError> {
        let qi = quant_index(ty).ok_or(CudaError::Unsupported { op, ty })?;
        let fmt = ActFormat::for_weight(ty).ok_or(CudaError::Unsupported { op, ty })?;
        want(op, "weight bytes", w.len(), weight_bytes(ty, rows, cols)?)?;
        want(
            op,
            "activation bytes",
            x.len(),
            act_bytes(fmt, n_tok, cols)?,
        )?;
        want(op, "y", y.len(), rows * n_tok)?;
        to_i32(op, "rows", rows)?;
        to_i32(op, "cols", cols)?;
        Ok(qi)
    }

    /// `y = W x` for one q8 activation row (`x`: q8_0 blocks for the 32-value
    /// formats, q8_K for the K and IQ formats). Twin: `Kernels::matvec`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        stream: &CudaStream,
        ty: GgmlType,
        w: &DeviceBuf<u8>,
        rows: usize,
        cols: usize,
        x: &DeviceBuf<u8>,
        y: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        self.gemv_multi(stream, ty, &mut [GemvPart { w, rows, y }], cols, x)
    }

    /// [`gemv`](Self::gemv) of up to three matrices of `ty` on the same
    /// activation row in one launch (decode's q, k and v projections): the
    /// small ones ride along with the large one instead of each filling only
    /// part of the GPU. Every output is bit for bit its own GEMV's.
    pub fn gemv_multi(
        &self,
        stream: &CudaStream,
        ty: GgmlType,
        parts: &mut [GemvPart<'_>],
        cols: usize,
        x: &DeviceBuf<u8>,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemv";
        if parts.is_empty() || parts.len() > 3 {
            return Err(shape(OP, format!("{} matrices in one launch (1 to 3)", parts.len())));
        }
        let mut qi = 0;
        for p in parts.iter() {
            qi = self.check_quant_mm(OP, ty, p.w, p.rows, cols, x, 1, p.y)?;
        }
        let total: usize = parts.iter().map(|p| p.rows).sum();
        let plan = decode_plan(ty, total, 1, x.len());
        let f = self.func(Family::GemvQuant, gemv_entry(qi))?;
        // Three (weights, output, rows, blocks) slots; unused ones take no blocks.
        let slot = |i: usize| parts.get(i).map_or((0u64, 0u64, 0i32, 0u32), |p| (p.w.device_ptr(), p.y.device_ptr(), p.rows as i32, plan.blocks(p.rows)));
        let ((w0, y0, r0, n0), (w1, y1, r1, n1), (w2, y2, r2, n2)) = (slot(0), slot(1), slot(2));
        let (b1, b2) = (n0 as i32, (n0 + n1) as i32);
        let (xp, tab) = (x.device_ptr(), self.iq_tables().device_ptr());
        let (c, rw, ng, xsb) = (cols as i32, plan.rpw as i32, plan.groups as i32, plan.xsb as i32);
        to_i32(OP, "blocks", (n0 + n1 + n2) as usize)?;
        // SAFETY: parameters as GEMV_ENTRY; every part's sizes checked above;
        // plan.smem bytes of dynamic shared memory (opted in at load).
        unsafe {
            self.launch(
                f,
                (n0 + n1 + n2, 1, 1),
                plan.threads(),
                plan.smem as u32,
                stream,
                &mut params![w0, w1, w2, y0, y1, y2, r0, r1, r2, b1, b2, xp, c, rw, ng, xsb, tab],
            )
        }
    }

    /// `Y[t] = W X[t]` for `n_tok` q8 activation rows; `y` is `[n_tok, rows]`.
    /// Twin: `Kernels::matmul`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        stream: &CudaStream,
        ty: GgmlType,
        w: &DeviceBuf<u8>,
        rows: usize,
        cols: usize,
        x: &DeviceBuf<u8>,
        n_tok: usize,
        y: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        // A few tokens (a decode step of a few served sequences) fill the
        // dp4a kernel's 8-token tiles; the tensor cores' 64-token tiles would
        // mostly multiply padding. Both give the GEMV's bits.
        let kernel = if n_tok <= QGEMM_TOKENS { GemmKernel::Dp4a } else { GemmKernel::default_for(self.compute_capability()) };
        self.gemm_with(
            stream,
            kernel,
            ty,
            w,
            rows,
            cols,
            x,
            n_tok,
            y,
        )
    }

    /// [`CudaDevice::gemm`] with an explicit kernel choice.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_with(
        &self,
        stream: &CudaStream,
        kernel: GemmKernel,
        ty: GgmlType,
        w: &DeviceBuf<u8>,
        rows: usize,
        cols: usize,
        x: &DeviceBuf<u8>,
        n_tok: usize,
        y: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        if n_tok > MAX_GEMM_TOKENS {
            return Err(shape(
                "gemm",
                format!("{n_tok} tokens in one launch (at most {MAX_GEMM_TOKENS})"),
            ));
        }
        let qi = self.check_quant_mm("gemm", ty, w, rows, cols, x, n_tok, y)?;
        let tab = self.iq_tables().device_ptr();
        // SAFETY: W, X and Y hold rows x cols weights, n_tok activation rows and n_tok x rows outputs (checked).
        unsafe { self.launch_quant_gemm(stream, kernel, ty, qi, w.device_ptr(), x.device_ptr(), y.device_ptr(), rows, cols, n_tok, tab) }
    }

    /// Queue the quantized GEMM `kernel` of format index `qi` on raw device
    /// addresses (the grouped MoE multiplies sub-ranges of its scratch).
    ///
    /// # Safety
    /// `w` must address `rows` weight rows of `cols` values of `ty`, `x` `n_tok`
    /// activation rows for `ty`, `y` `n_tok * rows` floats.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_quant_gemm(
        &self,
        stream: &CudaStream,
        kernel: GemmKernel,
        ty: GgmlType,
        qi: usize,
        w: u64,
        x: u64,
        y: u64,
        rows: usize,
        cols: usize,
        n_tok: usize,
        tab: u64,
    ) -> Result<(), CudaError> {
        let (entry, grid, smem) = match kernel {
            GemmKernel::Dp4a => (
                gemm_entry(qi),
                (
                    rows.div_ceil(QGEMM_ROWS_PER_BLOCK) as u32,
                    n_tok.div_ceil(QGEMM_TOKENS) as u32,
                    1,
                ),
                0,
            ),
            GemmKernel::TensorCore => {
                if self.compute_capability().0 < 8 {
                    return Err(CudaError::Unsupported {
                        op: "gemm (int8 tensor cores need sm_80+)",
                        ty,
                    });
                }
                (
                    gemm_mma_entry(qi),
                    (
                        rows.div_ceil(MMA_ROWS_PER_BLOCK) as u32,
                        n_tok.div_ceil(MMA_TOKENS) as u32,
                        1,
                    ),
                    MMA_SMEM_BYTES,
                )
            }
        };
        let f = self.func(Family::GemvQuant, entry)?;
        let (r, c, n) = (rows as i32, cols as i32, n_tok as i32);
        // SAFETY: (W, X, Y, rows, cols, n_tok, tab) as GEMV_ENTRY; the caller vouches for the sizes.
        unsafe { self.launch(f, grid, 128, smem, stream, &mut params![w, x, y, r, c, n, tab]) }
    }

    /// Float-weight (f32/f16/bf16) product on f32 activations: `y` is
    /// `[n_tok, rows]`; `n_tok == 1` runs a GEMV kernel: the staged one for up
    /// to [`FLOAT_STAGED_MAX_ROWS`] rows, else four rows a block.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_float(
        &self,
        stream: &CudaStream,
        ty: GgmlType,
        w: &DeviceBuf<u8>,
        rows: usize,
        cols: usize,
        x: &DeviceBuf<f32>,
        n_tok: usize,
        y: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "gemm_float";
        if n_tok == 1 {
            return self.gemv_float_with(stream, rows <= FLOAT_STAGED_MAX_ROWS, ty, w, rows, cols, x, y);
        }
        let fi = check_float_mm(OP, ty, w, rows, cols, x, n_tok, y)?;
        if n_tok > MAX_GEMM_TOKENS {
            return Err(shape(OP, format!("{n_tok} tokens in one launch")));
        }
        let (r, c, n) = (rows as i32, cols as i32, n_tok as i32);
        let (wp, xp, yp) = (w.device_ptr(), x.device_ptr(), y.device_ptr());
        let f = self.func(Family::GemvFloat, 2 * fi + 1)?;
        let grid = (rows.div_ceil(GEMV_ROWS_PER_BLOCK) as u32, n_tok.div_ceil(GEMM_TOKENS) as u32, 1);
        // SAFETY: (W, X, Y, rows, cols, n_tok) as FGEMV_ENTRY; sizes checked.
        unsafe { self.launch(f, grid, 128, 0, stream, &mut params![wp, xp, yp, r, c, n]) }
    }

    /// The float GEMV (`y = W x`, one token) on the kernel chosen: `staged`,
    /// one row a one-warp block with the row and `x` copied to shared memory
    /// (gemv_staged_*), or four rows a block reading global memory (gemv_*).
    /// Both give the same bits; [`CudaDevice::gemm_float`] picks by row count.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_float_with(
        &self,
        stream: &CudaStream,
        staged: bool,
        ty: GgmlType,
        w: &DeviceBuf<u8>,
        rows: usize,
        cols: usize,
        x: &DeviceBuf<f32>,
        y: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        let fi = check_float_mm("gemv_float", ty, w, rows, cols, x, 1, y)?;
        let (r, c) = (rows as i32, cols as i32);
        let (wp, xp, yp) = (w.device_ptr(), x.device_ptr(), y.device_ptr());
        if staged {
            let f = self.func(Family::GemvFloat, GEMV_STAGED + fi)?;
            let (ch, smem) = float_stage_plan(cols, if fi == 0 { 4 } else { 2 });
            let chi = ch as i32;
            // SAFETY: (W, x, y, rows, cols, ch) as gemv_staged_*; sizes checked;
            // smem bytes as the kernel's min(2, chunks) * fgs_buf_bytes(ch).
            unsafe { self.launch(f, (rows as u32, 1, 1), 32, smem, stream, &mut params![wp, xp, yp, r, c, chi]) }
        } else {
            let f = self.func(Family::GemvFloat, 2 * fi)?;
            let grid = rows.div_ceil(GEMV_ROWS_PER_BLOCK) as u32;
            // SAFETY: (W, x, y, rows, cols) as FGEMV_ENTRY; sizes checked.
            unsafe { self.launch(f, (grid, 1, 1), 128, 0, stream, &mut params![wp, xp, yp, r, c]) }
        }
    }

    /// RMS norm of each `group`-wide slice of `x` into `y`, times `weight` when
    /// given. Twin: `ops::rms_norm_rows`.
    pub fn rms_norm(
        &self,
        stream: &CudaStream,
        x: &DeviceBuf<f32>,
        y: &mut DeviceBuf<f32>,
        weight: Option<&DeviceBuf<f32>>,
        group: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        want("rms_norm", "y", y.len(), x.len())?;
        self.rms_norm_ptrs(stream, x, y.device_ptr(), weight, group, eps)
    }

    /// [`CudaDevice::rms_norm`] in place.
    pub fn rms_norm_in_place(
        &self,
        stream: &CudaStream,
        x: &mut DeviceBuf<f32>,
        weight: Option<&DeviceBuf<f32>>,
        group: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let yp = x.device_ptr();
        self.rms_norm_ptrs(stream, x, yp, weight, group, eps)
    }

    fn rms_norm_ptrs(
        &self,
        stream: &CudaStream,
        x: &DeviceBuf<f32>,
        yp: u64,
        weight: Option<&DeviceBuf<f32>>,
        group: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        const OP: &str = "rms_norm";
        if group == 0 || x.len() % group != 0 {
            return Err(shape(
                OP,
                format!("group {group} does not divide {} values", x.len()),
            ));
        }
        if let Some(w) = weight {
            want(OP, "weight", w.len(), group)?;
        }
        let n_groups = to_i32(OP, "groups", x.len() / group)?;
        let g = to_i32(OP, "group", group)?;
        let f = self.func(Family::NormRope, 0)?;
        let (xp, wp) = (x.device_ptr(), ptr_or_null(weight));
        // SAFETY: (x, y, w, group, n_groups, eps) as rms_norm; sizes checked.
        unsafe {
            self.launch(
                f,
                (n_groups as u32, 1, 1),
                256,
                0,
                stream,
                &mut params![xp, yp, wp, g, n_groups, eps],
            )
        }
    }

    /// Rotate every head of every row of `x` (`[positions.len(), width]`) into
    /// `y`, the dims past `n_rot` copied. Twin: `ops::rope_rows`.
    pub fn rope(
        &self,
        stream: &CudaStream,
        x: &DeviceBuf<f32>,
        y: &mut DeviceBuf<f32>,
        width: usize,
        positions: &DeviceBuf<u32>,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        want("rope", "y", y.len(), x.len())?;
        self.rope_ptrs(stream, x, y.device_ptr(), width, positions, p)
    }

    /// [`CudaDevice::rope`] in place.
    pub fn rope_in_place(
        &self,
        stream: &CudaStream,
        x: &mut DeviceBuf<f32>,
        width: usize,
        positions: &DeviceBuf<u32>,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        let yp = x.device_ptr();
        self.rope_ptrs(stream, x, yp, width, positions, p)
    }

    fn rope_ptrs(
        &self,
        stream: &CudaStream,
        x: &DeviceBuf<f32>,
        yp: u64,
        width: usize,
        positions: &DeviceBuf<u32>,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        const OP: &str = "rope";
        if p.head_dim == 0 || width % p.head_dim != 0 || p.n_rot > p.head_dim || p.n_rot % 2 != 0 {
            return Err(shape(
                OP,
                format!("width {width}, head_dim {}, n_rot {}", p.head_dim, p.n_rot),
            ));
        }
        want(OP, "x", x.len(), width * positions.len())?;
        let xp = x.device_ptr();
        // Threads a head, as the kernel counts them: out of place, the tail too.
        let per = p.n_rot / 2 + if xp == yp { 0 } else { p.head_dim - p.n_rot };
        let total = positions.len() * (width / p.head_dim) * per;
        to_i32(OP, "threads", total)?;
        let f = self.func(Family::NormRope, 1)?;
        let pp = positions.device_ptr();
        let (w, n, hd, nr) = (
            width as i32,
            positions.len() as i32,
            p.head_dim as i32,
            p.n_rot as i32,
        );
        let kind: i32 = match p.kind {
            RopeKind::Neox => 0,
            RopeKind::Interleaved => 1,
        };
        let (base, lf) = (p.base, p.linear_factor);
        let grid = total.div_ceil(256) as u32;
        // SAFETY: (x, y, width, positions, n_rows, head_dim, n_rot, base, lf, kind) as rope.
        unsafe {
            self.launch(
                f,
                (grid, 1, 1),
                256,
                0,
                stream,
                &mut params![xp, yp, w, pp, n, hd, nr, base, lf, kind],
            )
        }
    }

    /// Per-head RMS norm then rope of one or two tensors in one launch
    /// (decode's q and k): each part's `normed` gets [`CudaDevice::rms_norm`]'s
    /// bits (group = `p.head_dim`) and `roped` gets [`CudaDevice::rope`]'s of
    /// that, at the rows' positions.
    pub fn norm_rope(
        &self,
        stream: &CudaStream,
        parts: &mut [NormRopePart<'_>],
        positions: &DeviceBuf<u32>,
        p: &RopeParams,
    ) -> Result<(), CudaError> {
        const OP: &str = "norm_rope";
        if parts.is_empty() || parts.len() > 2 {
            return Err(shape(OP, format!("{} parts (1 or 2)", parts.len())));
        }
        if p.head_dim == 0 || p.n_rot > p.head_dim || p.n_rot % 2 != 0 {
            return Err(shape(OP, format!("head_dim {}, n_rot {}", p.head_dim, p.n_rot)));
        }
        let mut groups = [0usize; 2];
        for (i, part) in parts.iter().enumerate() {
            if part.width == 0 || part.width % p.head_dim != 0 {
                return Err(shape(OP, format!("width {} is not whole heads of {}", part.width, p.head_dim)));
            }
            want(OP, "x", part.x.len(), part.width * positions.len())?;
            want(OP, "normed", part.normed.len(), part.x.len())?;
            want(OP, "roped", part.roped.len(), part.x.len())?;
            if let Some(w) = part.weight {
                want(OP, "weight", w.len(), p.head_dim)?;
            }
            groups[i] = part.x.len() / p.head_dim;
        }
        let total = to_i32(OP, "groups", groups[0] + groups[1])?;
        let f = self.func(Family::NormRope, 2)?;
        let ptrs = |i: usize| {
            let q = &parts[i.min(parts.len() - 1)];
            (q.x.device_ptr(), ptr_or_null(q.weight), q.normed.device_ptr(), q.roped.device_ptr(), q.width as i32, q.eps)
        };
        let (x0, w0, n0, r0, wd0, e0) = ptrs(0);
        let (x1, w1, n1, r1, wd1, e1) = ptrs(1);
        let g0 = groups[0] as i32;
        let (pp, hd, nr) = (positions.device_ptr(), p.head_dim as i32, p.n_rot as i32);
        let kind: i32 = match p.kind {
            RopeKind::Neox => 0,
            RopeKind::Interleaved => 1,
        };
        let (base, lf) = (p.base, p.linear_factor);
        // SAFETY: the argument list of norm_rope; every size checked above.
        unsafe {
            self.launch(
                f,
                (total as u32, 1, 1),
                256,
                0,
                stream,
                &mut params![x0, w0, n0, r0, wd0, g0, e0, x1, w1, n1, r1, wd1, e1, total, pp, hd, nr, base, lf, kind],
            )
        }
    }

    /// `out = act(gate) * up`. Twin: `ops::glu_rows`.
    pub fn glu(
        &self,
        stream: &CudaStream,
        gate: &DeviceBuf<f32>,
        up: &DeviceBuf<f32>,
        out: &mut DeviceBuf<f32>,
        act: Activation,
    ) -> Result<(), CudaError> {
        want("glu", "up", up.len(), gate.len())?;
        want("glu", "out", out.len(), gate.len())?;
        let n = to_i32("glu", "n", gate.len())?;
        let a = act_code(act)?;
        let f = self.func(Family::Act, 0)?;
        let (g, u, o) = (gate.device_ptr(), up.device_ptr(), out.device_ptr());
        // SAFETY: (gate, up, out, n, act) as glu.
        unsafe {
            self.launch(
                f,
                ((n as u32).div_ceil(256), 1, 1),
                256,
                0,
                stream,
                &mut params![g, u, o, n, a],
            )
        }
    }

    fn binary(
        &self,
        stream: &CudaStream,
        entry: usize,
        a: &DeviceBuf<f32>,
        b: &DeviceBuf<f32>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        want("elementwise", "b", b.len(), a.len())?;
        want("elementwise", "out", out.len(), a.len())?;
        let n = to_i32("elementwise", "n", a.len())?;
        let f = self.func(Family::Act, entry)?;
        let (ap, bp, op) = (a.device_ptr(), b.device_ptr(), out.device_ptr());
        // SAFETY: (a, b, out, n) as add_f32 / mul_f32.
        unsafe {
            self.launch(
                f,
                ((n as u32).div_ceil(256), 1, 1),
                256,
                0,
                stream,
                &mut params![ap, bp, op, n],
            )
        }
    }
    /// `out = a + b`.
    pub fn add(
        &self,
        stream: &CudaStream,
        a: &DeviceBuf<f32>,
        b: &DeviceBuf<f32>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        self.binary(stream, 1, a, b, out)
    }
    /// `out = a * b`.
    pub fn mul(
        &self,
        stream: &CudaStream,
        a: &DeviceBuf<f32>,
        b: &DeviceBuf<f32>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        self.binary(stream, 2, a, b, out)
    }
    /// `out = a * s`.
    pub fn scale(
        &self,
        stream: &CudaStream,
        a: &DeviceBuf<f32>,
        s: f32,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        want("scale", "out", out.len(), a.len())?;
        let n = to_i32("scale", "n", a.len())?;
        let f = self.func(Family::Act, 3)?;
        let (ap, op) = (a.device_ptr(), out.device_ptr());
        // SAFETY: (a, s, out, n) as scale_f32.
        unsafe {
            self.launch(
                f,
                ((n as u32).div_ceil(256), 1, 1),
                256,
                0,
                stream,
                &mut params![ap, s, op, n],
            )
        }
    }

    /// Gather and dequantize rows `ids` of a `[n_vocab, cols]` table of `ty`
    /// into `out` (`[ids.len(), cols]`); an id out of range gives a NaN row.
    /// Twin: `pulsar_kernels::dequantize` of those rows.
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        stream: &CudaStream,
        ty: GgmlType,
        table: &DeviceBuf<u8>,
        n_vocab: usize,
        cols: usize,
        ids: &DeviceBuf<u32>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "embed";
        let entry = match (float_index(ty), quant_index(ty)) {
            (Some(i), _) => i,
            (None, Some(i)) => 3 + i,
            _ => return Err(CudaError::Unsupported { op: OP, ty }),
        };
        want(
            OP,
            "table bytes",
            table.len(),
            weight_bytes(ty, n_vocab, cols)?,
        )?;
        want(OP, "out", out.len(), ids.len() * cols)?;
        if ids.len() > 65535 {
            return Err(shape(
                OP,
                format!("{} ids in one launch (at most 65535)", ids.len()),
            ));
        }
        let (n, c, nv) = (
            ids.len() as i32,
            to_i32(OP, "cols", cols)?,
            to_i32(OP, "n_vocab", n_vocab)?,
        );
        let f = self.func(Family::Embed, entry)?;
        let (tp, ip, op, tab) = (
            table.device_ptr(),
            ids.device_ptr(),
            out.device_ptr(),
            self.iq_tables().device_ptr(),
        );
        let grid = (cols.div_ceil(256) as u32, ids.len() as u32, 1);
        // SAFETY: (table, ids, out, n, cols, n_vocab, tab) as EMBED_*.
        unsafe {
            self.launch(
                f,
                grid,
                256,
                0,
                stream,
                &mut params![tp, ip, op, n, c, nv, tab],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_plans_fit_their_budgets() {
        for ty in [GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::IQ3_XXS, GgmlType::Q4_0] {
            for total_rows in [1usize, 64, 512, 4096, 8192, 32768, 151_936] {
                for mats in [1usize, 2] {
                    for x_bytes in [34usize, 4672, 8704, 60_000] {
                        let p = decode_plan(ty, total_rows, mats, x_bytes);
                        assert!(p.rpw >= 1 && p.groups >= 1 && mats * p.rpw <= DECODE_MAX_ROWS, "{ty} {total_rows} {mats}: {p:?}");
                        // Every row is some warp's.
                        assert!(p.blocks(total_rows) as usize * p.warps * p.rpw * p.groups >= total_rows);
                        assert!(p.warps == DECODE_WARPS || p.warps == DECODE_WARPS_SMALL);
                        assert!(p.smem <= crate::kernels::DECODE_SMEM_MAX as usize, "{ty}: {p:?}");
                        assert!(p.xsb == 0 || p.xsb >= x_bytes + 32, "{ty}: {p:?}");
                        assert_eq!(p.xsb % 16, 0);
                    }
                }
            }
        }
    }

    #[test]
    fn decode_plans_of_the_benchmark_shapes() {
        // attn_q of qwen3-235b (8192 x 4096 q8_0): 4096 warps of one two-row group.
        let q = decode_plan(GgmlType::Q8_0, 8192, 1, 4352);
        assert_eq!((q.rpw, q.groups, q.xsb), (2, 1, (4352 + 32usize).next_multiple_of(16)));
        assert_eq!(q.blocks(8192), 512);
        // attn_output (4096 x 8192): one-row groups, 4096 warps.
        assert_eq!(decode_plan(GgmlType::Q8_0, 4096, 1, 8704).rpw, 1);
        // Eight experts' gate + up (1536 rows each, q2_K): two rows of each a group.
        let up = decode_plan(GgmlType::Q2_K, 8 * 1536, 2, 16 * 292);
        assert_eq!((up.rpw, up.groups), (2, 1));
        assert_eq!(up.blocks(1536), 96);
        // Their down rows (4096 each): four a group, two groups a warp.
        let down = decode_plan(GgmlType::Q2_K, 8 * 4096, 1, 6 * 292);
        assert_eq!((down.rpw, down.groups), (4, 2));
        // A small matrix keeps one row a warp.
        let kv = decode_plan(GgmlType::Q8_0, 512, 1, 4352);
        assert_eq!((kv.rpw, kv.groups, kv.warps), (1, 1, DECODE_WARPS_SMALL));
        assert_eq!(kv.blocks(512), 128);
        // An activation row too large to stage is read from global memory.
        assert_eq!(decode_plan(GgmlType::Q8_0, 512, 1, 200_000).xsb, 0);
    }
}
