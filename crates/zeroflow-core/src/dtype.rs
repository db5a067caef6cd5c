//! Element types that live in device and host buffers.

use std::fmt;

pub use half::{bf16, f16};

/// The element type of a buffer, known at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    Bf16,
    F16,
    I32,
    U32,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    /// The name `transformers` gives it (`config.json`'s `torch_dtype`), for the floating-point
    /// types.
    pub const fn torch_name(self) -> Option<&'static str> {
        match self {
            DType::F32 => Some("float32"),
            DType::Bf16 => Some("bfloat16"),
            DType::F16 => Some("float16"),
            DType::I32 | DType::U32 => None,
        }
    }

    /// The name used in safetensors headers and configs.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::Bf16 => "BF16",
            DType::F16 => "F16",
            DType::I32 => "I32",
            DType::U32 => "U32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A plain-old-data element type that buffers can hold.
///
/// Every bit pattern of an `Element` is a valid value and its all-zero pattern is zero, so buffers
/// can be allocated zero-filled and copied byte for byte.
pub trait Element: Copy + Default + Send + Sync + PartialEq + fmt::Debug + 'static {
    const DTYPE: DType;

    /// The value as an `f64` (exact for every type here).
    fn to_f64(self) -> f64;

    /// The nearest value to `x` (round to nearest even for floats; saturating for integers).
    fn from_f64(x: f64) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}
impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f64(self) -> f64 {
        self.to_f64()
    }
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(x: f64) -> Self {
        x as i32
    }
}
impl Element for u32 {
    const DTYPE: DType = DType::U32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn from_f64(x: f64) -> Self {
        x as u32
    }
}

/// A floating-point element type that kernels compute with in `f32`.
pub trait Float: Element {
    fn to_f32(self) -> f32;
    /// Rounds to nearest even.
    fn from_f32(x: f32) -> Self;
    /// `x` as the slice of its own type, for code that reads one of them directly.
    fn slice(x: &[Self]) -> FloatSlice<'_>;
    /// [`Float::slice`], borrowed uniquely.
    fn slice_mut(x: &mut [Self]) -> FloatSliceMut<'_>;
}

/// A slice of one of the [`Float`] types, as its own type.
#[derive(Debug)]
pub enum FloatSlice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

/// [`FloatSlice`], borrowed uniquely.
#[derive(Debug)]
pub enum FloatSliceMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

impl Float for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn slice(x: &[Self]) -> FloatSlice<'_> {
        FloatSlice::F32(x)
    }
    fn slice_mut(x: &mut [Self]) -> FloatSliceMut<'_> {
        FloatSliceMut::F32(x)
    }
}

impl Float for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn slice(x: &[Self]) -> FloatSlice<'_> {
        FloatSlice::Bf16(x)
    }
    fn slice_mut(x: &mut [Self]) -> FloatSliceMut<'_> {
        FloatSliceMut::Bf16(x)
    }
}

impl Float for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn slice(x: &[Self]) -> FloatSlice<'_> {
        FloatSlice::F16(x)
    }
    fn slice_mut(x: &mut [Self]) -> FloatSliceMut<'_> {
        FloatSliceMut::F16(x)
    }
}
