//! Integration tests of the shared layers, compiled as one binary.

mod gqa;
mod loss;
mod packed;
