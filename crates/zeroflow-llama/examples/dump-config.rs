//! Prints the `config.json` zeroflow writes back for a `config.json` it reads (or for a named
//! shape), for `scripts/hf-check.py` to compare through `transformers.AutoConfig`.
//!
//! `cargo run -p zeroflow-llama --example dump-config -- FILE|llama-1b|llama-3b|llama-8b`

use std::process::ExitCode;

use zeroflow_llama::{LlamaConfig, named_shape};

fn main() -> ExitCode {
    let Some(arg) = std::env::args().nth(1) else {
        eprintln!("usage: dump-config CONFIG.json|llama-1b|llama-3b|llama-8b");
        return ExitCode::from(2);
    };
    let config = match named_shape(&arg) {
        Some(config) => Ok(config),
        None => read(&arg),
    };
    match config {
        Ok(config) => {
            println!("{}", serde_json::to_string_pretty(&config.to_hf_config()).expect("JSON"));
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("{arg}: {message}");
            ExitCode::from(2)
        }
    }
}

fn read(path: &str) -> Result<LlamaConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let json = serde_json::from_str(&text).map_err(|e| format!("not JSON ({e})"))?;
    LlamaConfig::from_hf_config(&json).map_err(|e| e.to_string())
}
