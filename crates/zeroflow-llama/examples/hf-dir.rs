//! Hugging Face directories of the Llama family through `zeroflow-hf`, for `scripts/hf-check.py`
//! to check against `transformers` on a machine that has it:
//!
//! - `hf-dir write CONFIG.json OUT [--f32] [--max-shard-bytes N]`: a directory with random
//!   weights (deterministic) for the model of `CONFIG.json`, as zeroflow writes it;
//! - `hf-dir stats DIR`: reads `DIR` (its `config.json` and weights, checked against the family's
//!   names and shapes) and prints each tensor's element sum and absolute sum as JSON;
//! - `hf-dir copy DIR OUT [--f32] [--max-shard-bytes N]`: reads `DIR` as `stats` does and writes
//!   it again as `OUT` (config, weights, tokenizer files), the way `zeroflow export` will.

use std::path::Path;
use std::process::ExitCode;

use zeroflow_hf::{HfCheckpoint, OutTensor, SaveDtype, SaveOptions};
use zeroflow_llama::{HfParam, LlamaConfig, hf_params};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("write") if args.len() >= 3 => write(&args[1], &args[2], &args[3..]),
        Some("stats") if args.len() == 2 => stats(Path::new(&args[1])),
        Some("copy") if args.len() >= 3 => copy(Path::new(&args[1]), &args[2], &args[3..]),
        _ => Err("usage: hf-dir write CONFIG.json OUT [--f32] [--max-shard-bytes N] | \
                  hf-dir stats DIR | hf-dir copy DIR OUT [--f32] [--max-shard-bytes N]"
            .into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::from(2)
        }
    }
}

fn write(config: &str, out: &str, flags: &[String]) -> Result<(), String> {
    let text = std::fs::read_to_string(config).map_err(|e| format!("{config}: {e}"))?;
    let json = serde_json::from_str(&text).map_err(|e| format!("{config}: {e}"))?;
    let config = LlamaConfig::from_hf_config(&json).map_err(|e| format!("{config}: {e}"))?;
    let options = save_options(flags)?;
    let params = hf_params(&config);
    let values: Vec<Vec<f32>> = params
        .iter()
        .enumerate()
        .map(|(i, p)| (0..p.numel()).map(|j| pseudo_random(i, j)).collect())
        .collect();
    save(&config, &params, &values, out, &options)
}

fn save_options(flags: &[String]) -> Result<SaveOptions, String> {
    let mut options = SaveOptions::default();
    let mut flags = flags.iter();
    while let Some(flag) = flags.next() {
        match flag.as_str() {
            "--f32" => options.dtype = SaveDtype::F32,
            "--max-shard-bytes" => {
                let n = flags.next().and_then(|n| n.parse().ok());
                options.max_shard_bytes = n.ok_or("--max-shard-bytes needs a number")?;
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(options)
}

fn save(
    config: &LlamaConfig,
    params: &[HfParam],
    values: &[Vec<f32>],
    out: &str,
    options: &SaveOptions,
) -> Result<(), String> {
    let tensors: Vec<OutTensor<'_>> = params
        .iter()
        .zip(values)
        .map(|(p, v)| OutTensor { name: &p.name, shape: &p.shape, values: v })
        .collect();
    let saved = zeroflow_hf::save(Path::new(out), &config.to_hf_config(), &tensors, options)
        .map_err(|e| e.to_string())?;
    println!("wrote {out}: {:?}", saved.weight_files);
    Ok(())
}

/// A deterministic value in (-0.05, 0.05) for element `j` of tensor `i`.
fn pseudo_random(i: usize, j: usize) -> f32 {
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (j as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 29;
    ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
}

/// `dir` opened, its config read, and its tensors checked against the family's.
fn open(dir: &Path) -> Result<(HfCheckpoint, LlamaConfig, Vec<HfParam>), String> {
    let read = HfCheckpoint::open(dir).map_err(|e| e.to_string())?;
    let json = read.config().ok_or(format!("{}: no config.json", dir.display()))?;
    let config = LlamaConfig::from_hf_config(json).map_err(|e| format!("config.json: {e}"))?;
    let params = hf_params(&config);
    let expected = params.iter().map(|p| (p.name.as_str(), p.shape.as_slice()));
    read.check(expected, |name| name.ends_with("rotary_emb.inv_freq"))
        .map_err(|e| e.to_string())?;
    Ok((read, config, params))
}

fn copy(dir: &Path, out: &str, flags: &[String]) -> Result<(), String> {
    let (read, config, params) = open(dir)?;
    let mut options = save_options(flags)?;
    options.tokenizer_from = Some(dir.to_path_buf());
    let values = params
        .iter()
        .map(|p| read.read_f32(&p.name).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    save(&config, &params, &values, out, &options)
}

fn stats(dir: &Path) -> Result<(), String> {
    let (read, _, params) = open(dir)?;
    let mut out = serde_json::Map::new();
    for p in &params {
        let values = read.read_f32(&p.name).map_err(|e| e.to_string())?;
        let sum: f64 = values.iter().map(|&v| f64::from(v)).sum();
        let abs: f64 = values.iter().map(|&v| f64::from(v).abs()).sum();
        out.insert(
            p.name.clone(),
            serde_json::json!({"shape": p.shape, "sum": sum, "abs_sum": abs}),
        );
    }
    println!("{}", serde_json::to_string_pretty(&out).expect("JSON"));
    Ok(())
}
