//! Integration tests of the ZeRO engine on CPU devices, compiled as one test binary.

mod harness;

mod chaos;
mod checkpoint;
mod delayed;
mod device_accumulation;
mod equivalence;
mod errors;
mod fuzz_checkpoint;
mod overlap;
mod pinned;
mod precision;
mod share;
mod speculation;
mod state_dtype;
mod stream_tuning;
mod zenflow;
