//! `zeroflow models`: the named model shapes, their parameter counts, and the memory each
//! optimizer mode needs for them, from the bytes per parameter the engine keeps.

use serde_json::json;
use zeroflow_train::ModelSpec;
use zeroflow_train::memory::{ASSUMPTIONS, ModeMemory, modes, per_rank};

/// List the named model shapes with parameter counts and memory per mode.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Ranks the ZeRO partitions are split over (ZeRO-2: optimizer state and gradients).
    #[arg(long, value_name = "N", default_value_t = 1)]
    world_size: u32,
    /// ZenFlow's topk_ratio: the share of columns whose optimizer state stays on the GPU.
    #[arg(long, value_name = "RATIO", default_value_t = 0.05)]
    topk_ratio: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// One named model and the (GPU, host) bytes per rank of each mode of [`modes`].
struct Row {
    name: &'static str,
    model: ModelSpec,
    memory: Vec<(f64, f64)>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.world_size == 0 {
        return Err(crate::InputError::from_display("--world-size must be at least 1"));
    }
    if !(0.0..=1.0).contains(&args.topk_ratio) {
        return Err(crate::InputError::from_display("--topk-ratio must be between 0 and 1"));
    }
    let modes = modes(args.topk_ratio);
    let rows: Vec<Row> = ModelSpec::named_shapes()
        .into_iter()
        .map(|(name, model)| -> Result<Row, zeroflow_train::TrainError> {
            let memory = modes.iter().map(|m| per_rank(m, &model, args.world_size));
            Ok(Row { name, memory: memory.collect::<Result<_, _>>()?, model })
        })
        .collect::<Result<_, _>>()?;
    if args.json {
        print_json(&args, &modes, &rows)
    } else {
        print_table(&args, &rows);
        Ok(())
    }
}

fn print_json(args: &Args, modes: &[ModeMemory], rows: &[Row]) -> anyhow::Result<()> {
    let models: Vec<_> = rows
        .iter()
        .map(|row| {
            let memory: serde_json::Map<String, serde_json::Value> = modes
                .iter()
                .zip(&row.memory)
                .map(|(m, (gpu, host))| {
                    let bytes = json!({ "gpu_bytes": gpu.round(), "host_bytes": host.round() });
                    (m.mode.to_owned(), bytes)
                })
                .collect();
            json!({
                "name": row.name,
                "family": row.model.family(),
                "shape": row.model.shape_json(),
                "parameters": row.model.num_params(),
                "memory": memory,
            })
        })
        .collect();
    let out = json!({
        "world_size": args.world_size,
        "topk_ratio": args.topk_ratio,
        "assumptions": ASSUMPTIONS,
        "models": models,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn print_table(args: &Args, rows: &[Row]) {
    println!(
        "{:<10} {:>6} {:>5} {:>7} {:>7} {:>13}   {:>21}   {:>21}   {:>21}",
        "model",
        "layers",
        "heads",
        "d_model",
        "context",
        "parameters",
        "gpu: GPU / host",
        "offload: GPU / host",
        "zenflow: GPU / host"
    );
    for row in rows {
        let memory: Vec<String> = row
            .memory
            .iter()
            .map(|(gpu, host)| format!("{:>9} / {:>9}", human(*gpu), human(*host)))
            .collect();
        let model = &row.model;
        println!(
            "{:<10} {:>6} {:>5} {:>7} {:>7} {:>13}   {}",
            row.name,
            model.n_layer(),
            model.n_head(),
            model.hidden_size(),
            model.context(),
            model.num_params(),
            memory.join("   ")
        );
    }
    println!();
    println!("world size {}, ZenFlow topk_ratio {}.", args.world_size, args.topk_ratio);
    println!("{ASSUMPTIONS}");
}

/// Bytes in MiB below 1 GiB, in GiB above.
fn human(bytes: f64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes < 1024.0 * MIB {
        format!("{:.1} MiB", bytes / MIB)
    } else {
        format!("{:.2} GiB", bytes / (1024.0 * MIB))
    }
}
