//! One CUDA device: its context, a compute and a copy stream, the lazily
//! compiled kernel modules and the IQ grid tables.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use pulsar_gguf::GgmlType;

use crate::buf::{DeviceBuf, PinnedBuf, Pod};
use crate::compile::{
    arch_name, compile_and_store, cubin_cached, default_cache_dir, nvrtc_available,
};
use crate::error::CudaError;
use crate::kernels::Family;

/// A compiled module and its entry points, in the family's table order.
struct Loaded {
    _module: Arc<CudaModule>,
    funcs: Vec<CudaFunction>,
    /// The dynamic shared memory each entry was opted in to (0: the default 48 KiB).
    smem: Vec<u32>,
}

/// An open CUDA device. Cheap to share by reference across threads; each op
/// takes the stream it runs on (or uses [`CudaDevice::compute`]).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    name: String,
    cc: (i32, i32),
    /// The most shared memory (static + dynamic) a block may opt in to.
    smem_optin: u32,
    /// Streaming multiprocessors: how many blocks fill the device.
    sm_count: usize,
    arch: String,
    cache_dir: Option<PathBuf>,
    modules: [OnceLock<Loaded>; Family::ALL.len()],
    iq_tables: DeviceBuf<u64>,
    /// Launch kernels with programmatic dependent launch (sm_90+): each may
    /// start while its predecessor on the stream finishes, and waits for it
    /// on the device (every kernel begins with `pdl_begin`, common.cuh).
    pdl: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaDevice({} {}, {})",
            self.ordinal(),
            self.name,
            self.arch
        )
    }
}

fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the candidate library names.
    unsafe { sys::is_culib_present() }
}

impl CudaDevice {
    /// Whether a driver, NVRTC and at least one device are there (no context is created).
    pub fn available() -> bool {
        driver_present()
            && nvrtc_available()
            && cudarc::driver::result::init().is_ok()
            && CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
    }

    /// Open device `ordinal`: its primary context, a compute and a copy stream.
    /// Kernels compile on first use into `~/.cache/pulsar/kernels`.
    pub fn open(ordinal: usize) -> Result<CudaDevice, CudaError> {
        Self::open_with_cache(ordinal, default_cache_dir())
    }

    /// As [`CudaDevice::open`] with an explicit kernel cache folder (`None`: no disk cache).
    pub fn open_with_cache(
        ordinal: usize,
        cache_dir: Option<PathBuf>,
    ) -> Result<CudaDevice, CudaError> {
        if !driver_present() {
            return Err(CudaError::Unavailable(
                "libcuda (the NVIDIA driver) not found".into(),
            ));
        }
        if !nvrtc_available() {
            return Err(CudaError::Unavailable("libnvrtc not found".into()));
        }
        cudarc::driver::result::init()
            .map_err(|e| CudaError::Unavailable(format!("cuInit failed: {e}")))?;
        let n = CudaContext::device_count()?;
        if ordinal >= n.max(0) as usize {
            return Err(CudaError::Unavailable(format!(
                "no CUDA device {ordinal} ({n} present)"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let compute = ctx.new_stream()?;
        let copy = ctx.new_stream()?;
        let name = ctx.name()?;
        let cc = ctx.compute_capability()?;
        let smem_optin = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as u32;
        let sm_count = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize;
        let tables = iq_tables()?;
        let mut iq = DeviceBuf::<u64>::alloc(&ctx, tables.len())?;
        iq.upload(&compute, &tables)?;
        Ok(CudaDevice {
            arch: arch_name(cc),
            ctx,
            compute,
            copy,
            name,
            cc,
            smem_optin,
            sm_count,
            cache_dir,
            modules: std::array::from_fn(|_| OnceLock::new()),
            iq_tables: iq,
            pdl: std::sync::atomic::AtomicBool::new(cc.0 >= 9),
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Streaming multiprocessors (132 on an H100 SXM / H200).
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }
    /// (major, minor), e.g. (9, 0) on an H100/H200.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }
    /// Turn programmatic dependent launch on or off (it is on by default
    /// where the device has it, sm_90+; off elsewhere whatever is asked).
    pub fn set_programmatic_launch(&self, on: bool) {
        self.pdl.store(on && self.cc.0 >= 9, std::sync::atomic::Ordering::Relaxed);
    }
    /// Whether kernels launch with programmatic dependent launch.
    pub fn programmatic_launch(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }
    /// The NVRTC target, e.g. `sm_90`.
    pub fn arch(&self) -> &str {
        &self.arch
    }
    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.bind_to_thread()?;
        Ok(self.ctx.mem_get_info()?)
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream ops use by default.
    pub fn compute(&self) -> &Arc<CudaStream> {
        &self.compute
    }
    /// A second stream for uploads that overlap compute.
    pub fn copy(&self) -> &Arc<CudaStream> {
        &self.copy
    }
    /// A new stream of this device.
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        Ok(self.ctx.new_stream()?)
    }
    /// A new event; `timing` enables elapsed-time queries.
    pub fn new_event(&self, timing: bool) -> Result<CudaEvent, CudaError> {
        let flags = if timing {
            Some(sys::CUevent_flags::CU_EVENT_DEFAULT)
        } else {
            None
        };
        Ok(self.ctx.new_event(flags)?)
    }
    /// Wait for all work on the compute stream.
    pub fn sync(&self) -> Result<(), CudaError> {
        Ok(self.compute.synchronize()?)
    }

    /// Uninitialised device memory for `len` values.
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<DeviceBuf<T>, CudaError> {
        DeviceBuf::alloc(&self.ctx, len)
    }
    /// Addresses for `len` values, backed by pages only as [`DeviceBuf::back`] maps them.
    pub fn alloc_paged<T: Pod>(&self, len: usize) -> Result<DeviceBuf<T>, CudaError> {
        DeviceBuf::alloc_paged(&self.ctx, len)
    }
    /// The page size of paged buffers.
    pub fn page_bytes(&self) -> Result<usize, CudaError> {
        crate::buf::page_bytes(&self.ctx)
    }
    /// A device copy of `src` (through the compute stream).
    pub fn upload<T: Pod>(&self, src: &[T]) -> Result<DeviceBuf<T>, CudaError> {
        let mut b = DeviceBuf::alloc(&self.ctx, src.len())?;
        b.upload(&self.compute, src)?;
        Ok(b)
    }
    /// A host copy of `buf` (through the compute stream, after the work queued there).
    pub fn download<T: Pod>(&self, buf: &DeviceBuf<T>) -> Result<Vec<T>, CudaError> {
        let mut v = vec![T::default(); buf.len()];
        buf.download(&self.compute, &mut v)?;
        Ok(v)
    }
    /// Page-locked host memory (flags 0, CPU-readable at full speed).
    pub fn alloc_pinned<T: Pod>(&self, len: usize) -> Result<PinnedBuf<T>, CudaError> {
        PinnedBuf::alloc(&self.ctx, len)
    }

    /// A host-written counter streams can wait on (see [`crate::HostFlag`]).
    pub fn new_flag(&self) -> Result<crate::HostFlag, CudaError> {
        crate::HostFlag::new(&self.ctx)
    }

    /// Whether streams can wait on host flags here: a wait for a value the
    /// flag already holds must pass through at once.
    pub fn flag_waits_work(&self) -> bool {
        let probe = || -> Result<(), CudaError> {
            let f = self.new_flag()?;
            f.set(1);
            f.wait_on(self.compute(), 1)?;
            self.compute().synchronize()?;
            Ok(())
        };
        probe().is_ok()
    }

    /// Page-lock host memory owned elsewhere in place (see [`HostRegistration`]).
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay mapped until the registration is dropped.
    pub unsafe fn register_host(
        &self,
        ptr: *const u8,
        len: usize,
        read_only: bool,
    ) -> Result<crate::buf::HostRegistration, CudaError> {
        // SAFETY: forwarded contract.
        unsafe { crate::buf::HostRegistration::new(&self.ctx, ptr, len, read_only) }
    }

    pub(crate) fn iq_tables(&self) -> &DeviceBuf<u64> {
        &self.iq_tables
    }

    /// Compile (or load from the cache) and load every module now, instead of
    /// at each family's first use.
    pub fn warm_up(&self) -> Result<(), CudaError> {
        for f in Family::ALL {
            self.loaded(f)?;
        }
        Ok(())
    }

    fn loaded(&self, family: Family) -> Result<&Loaded, CudaError> {
        let cell = &self.modules[family.index()];
        if let Some(l) = cell.get() {
            return Ok(l);
        }
        let bin = cubin_cached(family, &self.arch, self.cache_dir.as_deref())?;
        let module = match self.ctx.load_module(Ptx::from_binary(bin)) {
            Ok(m) => m,
            // A damaged cache entry: compile again, replace it, load that.
            Err(_) => {
                let bin = compile_and_store(family, &self.arch, self.cache_dir.as_deref())?;
                self.ctx.load_module(Ptx::from_binary(bin))?
            }
        };
        let mut funcs = Vec::with_capacity(family.entries().len());
        for e in family.entries() {
            funcs.push(
                module
                    .load_function(e)
                    .map_err(|_| CudaError::MissingEntry(e))?,
            );
        }
        let mut smem = vec![0u32; funcs.len()];
        for (i, f) in funcs.iter().enumerate() {
            if let Some(bytes) = crate::kernels::large_smem(family, i) {
                // An entry needing more than this device has stays at the
                // default (its op checks `func_smem` and uses another kernel).
                if bytes as u64 + f.shared_size_bytes()?.max(0) as u64 > self.smem_optin as u64 {
                    continue;
                }
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )?;
                smem[i] = bytes;
            }
        }
        // A racing thread may have set it first; either value is the same module.
        let _ = cell.set(Loaded {
            _module: module,
            funcs,
            smem,
        });
        Ok(cell.get().expect("set above"))
    }

    /// The dynamic shared memory above 48 KiB entry `index` of `family` may
    /// launch with on this device (0 when it was not opted in).
    pub(crate) fn func_smem(&self, family: Family, index: usize) -> Result<u32, CudaError> {
        Ok(self.loaded(family)?.smem.get(index).copied().unwrap_or(0))
    }

    /// Entry `index` of `family`'s table.
    pub(crate) fn func(&self, family: Family, index: usize) -> Result<&CudaFunction, CudaError> {
        self.loaded(family)?
            .funcs
            .get(index)
            .ok_or(CudaError::MissingEntry("entry index out of range"))
    }
}

/// The IQ grids the kernels look up, recovered from the CPU dequantizers (so
/// the two backends share one definition): iq2_xxs (256 u64), iq2_xs (512 u64),
/// iq3_xxs (256 u32, two per u64), laid out as quant_units.cuh expects.
fn iq_tables() -> Result<Vec<u64>, CudaError> {
    use pulsar_kernels::dequantize;
    let one = half::f16::from_f32(1.0).to_bits().to_le_bytes();
    let mut out = Vec::with_capacity(768 + 128);

    // iq2_xxs: run ib, group g holds grid index a.byte(g); ls = 0, signs 0: value = grid / 8.
    let mut blocks = vec![0u8; 8 * 66];
    for (bi, b) in blocks.chunks_exact_mut(66).enumerate() {
        b[..2].copy_from_slice(&one);
        for ib in 0..8 {
            for g in 0..4 {
                b[2 + 8 * ib + g] = (bi * 32 + ib * 4 + g) as u8;
            }
        }
    }
    let mut v = vec![0f32; 8 * 256];
    dequantize(GgmlType::IQ2_XXS, &blocks, &mut v)?;
    out.extend(v.chunks_exact(8).map(|c| pack_u64(c, 8.0)));

    // iq2_xs: qs[g] = grid index (sign index 0), scales 0: value = grid / 8.
    let mut blocks = vec![0u8; 16 * 74];
    for (bi, b) in blocks.chunks_exact_mut(74).enumerate() {
        b[..2].copy_from_slice(&one);
        for g in 0..32 {
            let idx = (bi * 32 + g) as u16;
            b[2 + 2 * g..4 + 2 * g].copy_from_slice(&idx.to_le_bytes());
        }
    }
    let mut v = vec![0f32; 16 * 256];
    dequantize(GgmlType::IQ2_XS, &blocks, &mut v)?;
    out.extend(v.chunks_exact(8).map(|c| pack_u64(c, 8.0)));

    // iq3_xxs: qs bytes are grid indices (four values each), ls = 0: value = grid / 4.
    let mut blocks = vec![0u8; 4 * 98];
    for (bi, b) in blocks.chunks_exact_mut(98).enumerate() {
        b[..2].copy_from_slice(&one);
        for i in 0..64 {
            b[2 + i] = (bi * 64 + i) as u8;
        }
    }
    let mut v = vec![0f32; 4 * 256];
    dequantize(GgmlType::IQ3_XXS, &blocks, &mut v)?;
    out.extend(v.chunks_exact(8).map(|c| pack_u64(c, 4.0)));
    Ok(out)
}

fn pack_u64(vals: &[f32], mul: f32) -> u64 {
    vals.iter().enumerate().fold(0u64, |acc, (i, &x)| {
        acc | (((x * mul).round() as u64) & 0xff) << (8 * i)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iq_tables_have_the_known_first_entries() {
        let t = iq_tables().unwrap();
        assert_eq!(t.len(), 256 + 512 + 128);
        assert_eq!(t[0], 0x0808080808080808);
        assert_eq!(t[1], 0x080808080808082b);
        assert_eq!(t[256], 0x0808080808080808);
        assert_eq!(t[257], 0x080808080808082b);
        assert_eq!(t[256 + 7], 0x080808080819192b);
        // iq3_xxs entries 0 and 1, packed two per u64.
        assert_eq!(t[768], 0x04040414_04040404);
    }

    #[test]
    fn open_without_a_gpu_is_an_error_not_a_panic() {
        if CudaDevice::available() {
            return; // a real device: covered by the self-test instead
        }
        match CudaDevice::open(0) {
            Err(CudaError::Unavailable(_)) | Err(CudaError::Driver(_)) => {}
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}
