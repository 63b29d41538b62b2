//! Run-time choice of the SIMD path. `Kernels` is the proof that the CPU has the
//! instructions of its `Isa`: the only way to reach a SIMD kernel is through a
//! `Kernels` built by `detect()` or a successful `with_isa()`.

use std::fmt;

use crate::error::QuantError;

/// An instruction-set level the kernels have a path for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust, the reference every SIMD path is tested against.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 plus AVX-512 F/BW/VL/VNNI: `vpdpbusd` replaces the
    /// `vpmaddubsw`+`vpmaddwd` pair in the 32-block formats, and
    /// `Kernels::dot_rows` has multi-row 512-bit kernels; other single-row
    /// dots use their AVX2 kernel.
    Avx512Vnni,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: &'static [Isa] = &[Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni];

    /// Whether this CPU can run this level.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.is_available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best level this CPU runs.
    pub fn detect() -> Isa {
        Isa::ALL
            .iter()
            .rev()
            .copied()
            .find(|i| i.is_available())
            .unwrap_or(Isa::Scalar)
    }

    /// Short name for logs and benchmark labels.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The CPU kernels at one instruction-set level. Cheap to copy; build it once
/// (`Kernels::detect()`) and pass it around. Tests force the reference path with
/// `Kernels::scalar()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    isa: Isa,
}

impl Kernels {
    /// The best path this CPU runs.
    pub fn detect() -> Kernels {
        Kernels { isa: Isa::detect() }
    }

    /// The portable reference path.
    pub fn scalar() -> Kernels {
        Kernels { isa: Isa::Scalar }
    }

    /// A given level, or an error when this CPU lacks it.
    pub fn with_isa(isa: Isa) -> Result<Kernels, QuantError> {
        if isa.is_available() {
            Ok(Kernels { isa })
        } else {
            Err(QuantError::IsaUnavailable(isa))
        }
    }

    /// The level these kernels run at.
    pub fn isa(&self) -> Isa {
        self.isa
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_is_always_there_and_detect_is_available() {
        assert!(Isa::Scalar.is_available());
        assert!(Isa::detect().is_available());
        assert_eq!(Kernels::scalar().isa(), Isa::Scalar);
        assert_eq!(Kernels::detect().isa(), Isa::detect());
        for &i in Isa::ALL {
            assert_eq!(Kernels::with_isa(i).is_ok(), i.is_available(), "{i}");
        }
    }
}
