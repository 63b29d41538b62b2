//! The link and kernel rates of the cold-path cost model, measured at load:
//! host-to-device copies from pinned and from pageable memory, and the expert
//! kernels reading their weights from VRAM and in place from page-locked
//! host memory (zero-copy), on one decode step's worth of the model's own
//! expert shape.

use pulsar_cuda::{CudaDevice, DeviceBuf, MoePairs};
use pulsar_gguf::GgmlType;
use pulsar_kernels::ops::Activation;
use pulsar_kernels::ActFormat;

use super::CudaBackendError;

/// Bytes each copy measurement moves.
const COPY_BYTES: usize = 64 << 20;
/// Experts one kernel measurement reads (one decode step's top-k).
const READ_EXPERTS: usize = 8;

fn gbs(bytes: f64, secs: f64) -> f64 {
    bytes / secs.max(1e-9) / 1e9
}

/// Pinned host-to-device copy rate on the copy stream: 64 MiB, three times
/// (the cost model's link rate, and the bench's).
pub fn measure_h2d(dev: &CudaDevice) -> Result<f64, CudaBackendError> {
    let n = COPY_BYTES / 4;
    let src = dev.alloc_pinned::<u32>(n)?;
    let mut dst = dev.alloc::<u32>(n)?;
    dst.upload_async(dev.copy(), &src)?;
    dev.copy().synchronize().map_err(pulsar_cuda::CudaError::from)?;
    let t = std::time::Instant::now();
    for _ in 0..3 {
        dst.upload_async(dev.copy(), &src)?;
    }
    dev.copy().synchronize().map_err(pulsar_cuda::CudaError::from)?;
    Ok(gbs(3.0 * COPY_BYTES as f64, t.elapsed().as_secs_f64()))
}

/// Host-to-device copies from ordinary (pageable) memory, which the driver
/// stages through its own pinned buffers.
pub fn measure_h2d_pageable(dev: &CudaDevice) -> Result<f64, CudaBackendError> {
    let n = COPY_BYTES / 4;
    let src = vec![1u32; n];
    let mut dst = dev.alloc::<u32>(n)?;
    let s = dev.compute();
    dst.upload(s, &src)?;
    let t = std::time::Instant::now();
    for _ in 0..2 {
        dst.upload(s, &src)?;
    }
    Ok(gbs(2.0 * COPY_BYTES as f64, t.elapsed().as_secs_f64()))
}

/// The expert FFN kernels' weight-read rate, GB/s of weight bytes: one
/// token through [`READ_EXPERTS`] experts of `[ff, d_model]` gate/up and
/// `[d_model, ff]` down, with the weights in VRAM (`in_place` false) or read
/// over the link from page-locked host memory (`in_place` true).
pub fn measure_expert_read(dev: &CudaDevice, gate_up: GgmlType, down: GgmlType, d_model: usize, ff: usize, in_place: bool) -> Result<f64, CudaBackendError> {
    let other = |e: String| CudaBackendError::Other(e);
    let slab = |ty: GgmlType, rows: usize, cols: usize| pulsar_kernels::quant::row_bytes(ty, cols).map(|r| r * rows).map_err(|e| other(e.to_string()));
    let (gu, dn) = (slab(gate_up, ff, d_model)?, slab(down, d_model, ff)?);
    let expert = 2 * gu + dn;
    let total = expert * READ_EXPERTS;
    // All-zero blocks: valid in every format (zero scales), and the kernels'
    // reads do not depend on the values.
    let host = vec![0u8; total];
    let vram;
    let registration;
    let base = if in_place {
        // SAFETY: `host` outlives the registration (dropped first, below).
        registration = unsafe { dev.register_host(host.as_ptr(), total, true) }?;
        registration.device_addr(&host).ok_or_else(|| other("zero-copy probe: no device address".into()))?
    } else {
        vram = dev.upload(&host)?;
        vram.device_ptr()
    };
    let ptrs = |off: usize| -> Vec<u64> { (0..READ_EXPERTS).map(|e| base + (e * expert + off) as u64).collect() };
    let (gp, up, dp) = (dev.upload(&ptrs(0))?, dev.upload(&ptrs(gu))?, dev.upload(&ptrs(2 * gu))?);
    let pairs = MoePairs { gate: &gp, up: &up, down: &dp, n_tok: 1, n_slot: READ_EXPERTS };
    let (gfmt, dfmt) = (
        ActFormat::for_weight(gate_up).ok_or_else(|| other(format!("no activation format for {gate_up}")))?,
        ActFormat::for_weight(down).ok_or_else(|| other(format!("no activation format for {down}")))?,
    );
    let x: DeviceBuf<u8> = dev.alloc(pulsar_cuda::act_bytes(gfmt, 1, d_model)?)?;
    let mut h = dev.alloc::<f32>(READ_EXPERTS * ff)?;
    let mut hq = dev.alloc::<u8>(pulsar_cuda::act_bytes(dfmt, READ_EXPERTS, ff)?)?;
    let mut out = dev.alloc::<f32>(READ_EXPERTS * d_model)?;
    let s = dev.compute();
    let mut run = || dev.moe_ffn(s, gate_up, down, &pairs, &x, d_model, ff, Activation::Silu, &mut h, &mut hq, &mut out);
    run()?;
    let (e0, e1) = (dev.new_event(true)?, dev.new_event(true)?);
    let reps = 5;
    e0.record(s).map_err(pulsar_cuda::CudaError::from)?;
    for _ in 0..reps {
        run()?;
    }
    e1.record(s).map_err(pulsar_cuda::CudaError::from)?;
    e1.synchronize().map_err(pulsar_cuda::CudaError::from)?;
    let ms = e0.elapsed_ms(&e1).map_err(pulsar_cuda::CudaError::from)? as f64;
    Ok(gbs((reps * total) as f64, ms / 1e3))
}
