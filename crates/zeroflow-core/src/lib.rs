//! The pure core of zeroflow: the DeepSpeed-compatible configuration, element types, and the flat
//! parameter layout with its partition math. Nothing here touches a device, a thread or a file
//! except to read a config.

pub mod config;
pub mod dtype;
pub mod layout;

pub use dtype::{DType, Element, Float, bf16, f16};
