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

    /// `x` itself where `Self` is f32 (for the kernels written for f32 alone), else `None`.
    fn as_f32(x: &[Self]) -> Option<&[f32]>;

    /// [`Float::as_f32`], borrowed uniquely.
    fn as_f32_mut(x: &mut [Self]) -> Option<&mut [f32]>;
}

impl Float for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn as_f32(x: &[Self]) -> Option<&[f32]> {
        Some(x)
    }
    fn as_f32_mut(x: &mut [Self]) -> Option<&mut [f32]> {
        Some(x)
    }
}

impl Float for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}
