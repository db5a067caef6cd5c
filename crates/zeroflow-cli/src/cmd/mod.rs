//! One module per subcommand.

pub mod bench;
pub mod bench_copy;
pub mod bench_gemm;
pub mod bench_gpt;
pub mod bench_train;
pub mod config;
pub mod dist_check;
pub mod env;
pub mod eval;
pub mod export;
pub mod generate;
pub mod launch;
pub mod models;
pub mod plan;
pub mod stress;
pub mod tokenize;
pub mod train;
