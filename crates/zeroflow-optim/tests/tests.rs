//! The integration tests of zeroflow-optim, compiled as one binary.

mod accuracy;
mod api;
mod bf16_moments;
mod bf16_output;
mod determinism;
mod roofline;
mod saving;
mod support;
