//! One module per subcommand.

pub mod bench;
pub mod config;
pub mod env;
pub mod export;
pub mod stress;
pub mod train;
