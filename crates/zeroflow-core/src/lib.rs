//! The pure core of zeroflow: the DeepSpeed-compatible configuration, element types, the flat
//! parameter layout with its partition math, and the reading of the environment variables that
//! pick named settings. Nothing here touches a device, a thread or a file except to read a
//! config.

pub mod adamw;
pub mod config;
pub mod dtype;
pub mod env;
pub mod layout;

pub use dtype::{DType, Element, Float, FloatSlice, FloatSliceMut, bf16, f16};
