//! The loss and logits of a Llama-family Hugging Face directory on token ids, for
//! `scripts/llama-oracle.py` to compare with `transformers`:
//!
//! `llama-loss DIR IDS.json [--attention gemm|flash] [--logits OUT.f32]`
//!
//! `IDS.json` holds `[[id, …], …]`: `batch` sequences of `seq + 1` token ids each. Like
//! `transformers`' `model(ids, labels=ids)`, the model reads `ids[:, :-1]` and predicts
//! `ids[:, 1:]`; the loss is the mean over the `batch · seq` predictions. The weights are read
//! into the flat buffer (f32) and the loss computed by `CpuLlama` on the `CpuDevice`; the logits
//! `[batch, seq, vocab]` come from `HostLlama<f32>` (the same kernels in f32 on host vectors, whose
//! loss is printed beside as `host_loss`). Prints one JSON object: `loss`, `host_loss`, `batch`,
//! `seq`, `vocab`, `architecture`, and the logits' `sum`, `abs_sum` and `max_abs`; with
//! `--logits`, the logits are also written there as little-endian f32, row-major.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use zeroflow_device::{CpuDevice, Device};
use zeroflow_llama::{AttentionKind, CpuLlama, HfLlama, HostLlama, flat_layout};

struct Args {
    dir: PathBuf,
    ids: PathBuf,
    attention: AttentionKind,
    logits: Option<PathBuf>,
}

fn main() -> ExitCode {
    match parse(std::env::args().skip(1).collect()).and_then(|args| run(&args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::from(2)
        }
    }
}

fn parse(args: Vec<String>) -> Result<Args, String> {
    const USAGE: &str = "usage: llama-loss DIR IDS.json [--attention gemm|flash] [--logits OUT]";
    let mut positional = Vec::new();
    let (mut attention, mut logits) = (AttentionKind::Gemm, None);
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--attention" => {
                attention = match args.next().as_deref() {
                    Some("gemm") => AttentionKind::Gemm,
                    Some("flash") => AttentionKind::Flash,
                    _ => return Err(format!("--attention takes gemm or flash\n{USAGE}")),
                }
            }
            "--logits" => logits = Some(PathBuf::from(args.next().ok_or(USAGE)?)),
            flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}\n{USAGE}")),
            _ => positional.push(PathBuf::from(arg)),
        }
    }
    match <[PathBuf; 2]>::try_from(positional) {
        Ok([dir, ids]) => Ok(Args { dir, ids, attention, logits }),
        Err(_) => Err(USAGE.into()),
    }
}

/// The sequences of `path`: `[[id, …], …]`, all of one length of at least 2.
fn read_ids(path: &Path) -> Result<Vec<Vec<u32>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let ids: Vec<Vec<u32>> =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let len = ids.first().map_or(0, Vec::len);
    if ids.is_empty() || len < 2 || ids.iter().any(|s| s.len() != len) {
        return Err(format!("{}: sequences of one length ≥ 2 expected", path.display()));
    }
    Ok(ids)
}

fn run(args: &Args) -> Result<(), String> {
    let text = |e: &dyn std::fmt::Display| e.to_string();
    let model = HfLlama::open(&args.dir).map_err(|e| text(&e))?;
    let config = &model.config;
    let layout = flat_layout(config, 1).map_err(|e| text(&e))?;
    let mut params = vec![0.0f32; layout.padded_len()];
    model.read_params(&layout, &mut params).map_err(|e| text(&e))?;
    let ids = read_ids(&args.ids)?;
    let (batch, seq) = (ids.len(), ids[0].len() - 1);
    let inputs: Vec<u32> = ids.iter().flat_map(|s| s[..seq].iter().copied()).collect();
    let targets: Vec<u32> = ids.iter().flat_map(|s| s[1..].iter().copied()).collect();

    let device = CpuDevice::new().map_err(|e| text(&e))?;
    let weights = device.upload(&params).map_err(|e| text(&e))?;
    let mut cpu = CpuLlama::new(&device, config, &layout, batch, seq, args.attention)
        .map_err(|e| text(&e))?;
    cpu.set_batch(&inputs, &targets).map_err(|e| text(&e))?;
    cpu.forward(&weights).map_err(|e| text(&e))?;
    let loss = cpu.loss().map_err(|e| text(&e))?;

    let mut host =
        HostLlama::<f32>::new(config, &layout, batch, seq, args.attention).map_err(|e| text(&e))?;
    let host_loss = host.forward(&params, &inputs, &targets).map_err(|e| text(&e))?;
    let logits = host.logits();
    if let Some(path) = &args.logits {
        let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(path, bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let summary = serde_json::json!({
        "architecture": config.architecture.hf_class(),
        "loss": loss,
        "host_loss": host_loss,
        "batch": batch,
        "seq": seq,
        "vocab": config.vocab_size,
        "sum": logits.iter().map(|&x| f64::from(x)).sum::<f64>(),
        "abs_sum": logits.iter().map(|&x| f64::from(x).abs()).sum::<f64>(),
        "max_abs": logits.iter().fold(0.0f32, |m, x| m.max(x.abs())),
    });
    println!("{summary}");
    Ok(())
}
