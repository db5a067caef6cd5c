//! Which SIMD instruction set the kernels use, detected at run time.

use std::fmt;
use std::str::FromStr;

/// The instruction set a kernel is written for. Levels are ordered: a higher level is wider.
///
/// Within one level every element is computed by the same instruction sequence, so results are
/// bit-identical whatever the chunking. `Avx2` and `Avx512` both use fused multiply-adds and give
/// the same bits as each other; `Scalar` rounds products separately and so differs from them in
/// the last bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable Rust (the compiler may still vectorize it with the target's baseline, e.g. SSE2).
    Scalar,
    /// AVX2 with FMA: 8 lanes.
    Avx2,
    /// AVX-512F: 16 lanes.
    Avx512,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];

    /// The widest level this CPU supports.
    pub fn detect() -> SimdLevel {
        Self::ALL.into_iter().rev().find(|level| level.is_available()).unwrap_or(SimdLevel::Scalar)
    }

    /// Whether this CPU can run this level's kernels.
    pub fn is_available(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            SimdLevel::Avx2 | SimdLevel::Avx512 => false,
        }
    }

    /// The levels this CPU supports, lowest first.
    pub fn available() -> impl Iterator<Item = SimdLevel> {
        Self::ALL.into_iter().filter(|level| level.is_available())
    }

    /// f32 lanes per vector.
    pub const fn lanes(self) -> usize {
        match self {
            SimdLevel::Scalar => 1,
            SimdLevel::Avx2 => 8,
            SimdLevel::Avx512 => 16,
        }
    }

    /// The short name used on the command line and in JSON: `scalar`, `avx2`, `avx512`.
    pub const fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }
}

impl fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The name was not one of `scalar`, `avx2`, `avx512`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown SIMD level {0:?}: expected scalar, avx2 or avx512")]
pub struct UnknownSimdLevel(pub String);

impl FromStr for SimdLevel {
    type Err = UnknownSimdLevel;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "scalar" => Ok(SimdLevel::Scalar),
            "avx2" => Ok(SimdLevel::Avx2),
            "avx512" | "avx-512" | "avx512f" => Ok(SimdLevel::Avx512),
            _ => Err(UnknownSimdLevel(s.to_owned())),
        }
    }
}
