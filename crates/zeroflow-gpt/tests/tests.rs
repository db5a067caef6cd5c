//! Integration tests of the model, compiled as one binary.

mod support;

mod checkpointing;
mod decode;
mod device;
mod flash_plan;
mod gradcheck;
mod grads_ready;
mod hf_dir;
mod init_loss;
mod packing;
mod params;
mod schedule;
mod train;
