//! zeroflow's trainer library (docs/DESIGN.md §2): the [`Model`] trait every family implements
//! for the trainer (GPT-2's impls in [`gpt2`]), the model a checkpoint holds ([`ModelSpec`]), the
//! learning-rate schedule ([`schedule`]), and the distributed runtime ([`dist`]): where a process
//! stands in a multi-process job, how the processes meet, the side channel beside NCCL, the CPU
//! binding of each rank's optimizer and the step watchdog. The trainer itself and checkpoint
//! orchestration are still in the binary (`zeroflow-cli/src/train`).

pub mod checkpoints;
pub mod dist;
pub mod gpt2;
pub mod llama;
pub mod model;
pub mod model_spec;
pub mod schedule;

pub use model::{Buffer, Model, Opened};
pub use model_spec::ModelSpec;
