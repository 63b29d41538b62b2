//! The one error type of the kernels crate: bad input is an error, never a panic.

use pulsar_gguf::GgmlType;

use crate::isa::Isa;
use crate::quant::ActFormat;

/// What went wrong in a kernel call. Every variant is a caller mistake (wrong
/// length, wrong type, unsupported operation): the kernels never fail on their own.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The tensor type has no implementation of this operation.
    #[error("{op} is not implemented for tensor type {ty}")]
    Unsupported { ty: GgmlType, op: &'static str },
    /// A buffer is not a whole number of blocks of its type.
    #[error("{ty}: {len} {unit} is not a whole number of {block}-{unit} blocks")]
    NotWholeBlocks {
        ty: GgmlType,
        len: usize,
        block: usize,
        unit: &'static str,
    },
    /// Two buffers that must describe the same number of values do not.
    #[error("{what}: expected {expected}, got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// The activations were quantized to a format this weight type does not dot against.
    #[error("tensor type {ty} dots against {expected} activations, got {got}")]
    WrongActivationFormat {
        ty: GgmlType,
        expected: ActFormat,
        got: ActFormat,
    },
    /// The requested instruction set is not available on this CPU.
    #[error("instruction set {0} is not available on this CPU")]
    IsaUnavailable(Isa),
}
