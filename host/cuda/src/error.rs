use pulsar_gguf::GgmlType;

/// Everything the CUDA layer can fail with. No path panics on bad input or on
/// a missing driver: the caller gets one of these.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable CUDA driver, NVRTC library or device.
    #[error("CUDA unavailable: {0}")]
    Unavailable(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC: {0:?}")]
    Nvrtc(cudarc::nvrtc::result::NvrtcError),
    /// A kernel source failed to compile; `log` is NVRTC's program log.
    #[error("NVRTC failed to compile {source_name} for {arch}:\n{log}")]
    Compile {
        source_name: &'static str,
        arch: String,
        log: String,
    },
    /// The compiled module lacks an entry point the kernel table names.
    #[error("kernel entry {0} missing from its module")]
    MissingEntry(&'static str),
    /// Sizes or shapes that do not fit together.
    #[error("{op}: {what}")]
    Shape { op: &'static str, what: String },
    #[error("{op} has no CUDA kernel for {ty}")]
    Unsupported { op: &'static str, ty: GgmlType },
    #[error(transparent)]
    Quant(#[from] pulsar_kernels::QuantError),
}

impl From<cudarc::nvrtc::result::NvrtcError> for CudaError {
    fn from(e: cudarc::nvrtc::result::NvrtcError) -> Self {
        CudaError::Nvrtc(e)
    }
}

pub(crate) fn shape(op: &'static str, what: impl Into<String>) -> CudaError {
    CudaError::Shape {
        op,
        what: what.into(),
    }
}
