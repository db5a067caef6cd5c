//! The element type of the layer math: `f32` on the device, `f64` in the finite-difference tests.

use std::fmt::Debug;
use std::iter::Sum;
use std::ops::{AddAssign, MulAssign, SubAssign};

/// A floating-point type the kernels are generic over.
pub trait Float:
    num_traits::Float
    + ndarray::LinalgScalar
    + AddAssign
    + SubAssign
    + MulAssign
    + Sum
    + Default
    + Debug
    + Send
    + Sync
    + 'static
{
    /// The nearest value to `x`.
    fn of(x: f64) -> Self;

    /// The value as an `f64` (exact).
    fn to_f64(self) -> f64;
}

impl Float for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl Float for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
}
