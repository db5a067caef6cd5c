//! zeroflow's trainer library (docs/DESIGN.md §2): the [`Model`] trait every family implements
//! for the trainer (GPT-2's in [`gpt2`], the Llama family's in [`llama`]), the model a checkpoint
//! holds ([`ModelSpec`]), the learning-rate schedule ([`schedule`]), and the distributed runtime
//! ([`dist`]): where a process stands in a multi-process job, how the processes meet, the side
//! channel beside NCCL, the CPU binding of each rank's optimizer and the step watchdog. Above them
//! the trainer: a run's set-up from its options ([`setup`]: data, config, resume point, initial
//! weights), its loop ([`run`], [`trainer`]), what it writes ([`metrics`], [`checkpoints`]) and
//! tells its caller ([`observer`]); `bench step`'s timed engine steps ([`bench_step`]) and
//! `bench gpt`'s forward + backward ([`bench_gpt`]). Which family a [`ModelSpec`] holds is
//! decided in one place ([`with_family!`], [`family`]).

pub mod bench_cpu_adam;
pub mod bench_gpt;
pub mod bench_step;
pub mod checkpoints;
pub mod data;
pub mod data_files;
pub mod dist;
pub mod error;
pub mod export;
pub mod family;
pub mod gpt2;
pub mod infer;
pub mod init_from;
pub mod limits;
pub mod llama;
pub mod machine;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod model_spec;
pub mod observer;
pub mod open;
pub mod plan;
pub mod resume;
pub mod resume_point;
pub mod run;
pub mod run_config;
pub mod run_dir;
pub mod sample;
pub mod schedule;
pub mod settings;
pub mod setup;
pub mod startup_tokens;
pub mod tensorboard;
pub mod trainer;
mod weight_files;

pub use error::TrainError;
pub use family::Family;
pub use model::{Buffer, Model, Opened};
pub use model_spec::ModelSpec;
pub use setup::{DeviceKind, Setup, TrainOptions};
