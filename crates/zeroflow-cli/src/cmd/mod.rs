//! One module per subcommand.

pub mod bench;
pub mod config;
pub mod env;
pub mod stress;
