//! Integration tests of the model and the data loaders, compiled as one binary.

mod support;

mod data;
mod device;
mod flash_plan;
mod gradcheck;
mod grads_ready;
mod init_loss;
mod params;
mod train;
