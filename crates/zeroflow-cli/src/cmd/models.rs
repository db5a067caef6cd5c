//! `zeroflow models`: the named model shapes, their parameter counts, and the memory each
//! optimizer mode needs for them, from the bytes per parameter the engine keeps.

use serde_json::json;
use zeroflow_gpt::{GptConfig, NAMED_SIZES};

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

/// Bytes per parameter of one optimizer mode, on the GPU and in host memory, split into what
/// every rank holds whole (bf16 weights) and what ZeRO-2 partitions over the ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BytesPerParam {
    pub mode: &'static str,
    /// On every GPU whole: bf16 weights (2 B).
    pub gpu_whole: f64,
    /// On each GPU, its partition's share: bf16 gradients (2 B), plus fp32 master weights and
    /// Adam moments (12 B) without offload, or ZenFlow's fp32 window (4 B) and the selected
    /// columns' state.
    pub gpu_partitioned: f64,
    /// In host memory, its partition's share: fp32 master weights and moments (12 B) when
    /// offloaded, and ZenFlow's pinned window accumulator (4 B).
    pub host_partitioned: f64,
}

/// The three modes of `zeroflow bench step`, from the engine's buffers (DESIGN.md §4, §7).
pub fn modes(topk_ratio: f64) -> [BytesPerParam; 3] {
    const WEIGHTS: f64 = 2.0; // bf16
    const GRADS: f64 = 2.0; // bf16
    const OPTIMIZER: f64 = 12.0; // fp32 master + exp_avg + exp_avg_sq
    const WINDOW: f64 = 4.0; // ZenFlow's fp32 gradient window
    [
        BytesPerParam {
            mode: "gpu",
            gpu_whole: WEIGHTS,
            gpu_partitioned: GRADS + OPTIMIZER,
            host_partitioned: 0.0,
        },
        BytesPerParam {
            mode: "offload",
            gpu_whole: WEIGHTS,
            gpu_partitioned: GRADS,
            host_partitioned: OPTIMIZER,
        },
        BytesPerParam {
            mode: "zenflow",
            gpu_whole: WEIGHTS,
            // The selected columns' master, moments and compact gradient on the device.
            gpu_partitioned: GRADS + WINDOW + topk_ratio * (OPTIMIZER + 4.0),
            host_partitioned: OPTIMIZER + WINDOW,
        },
    ]
}

const ASSUMPTIONS: &str = "Memory per rank for the parameters, gradients and optimizer state \
    only (activations, which grow with --micro-batch × sequence length, the CUDA context and \
    bounded staging buffers come on top). Per parameter: bf16 weights 2 B on every GPU; bf16 \
    gradients 2 B; fp32 master weights + Adam moments 12 B (gpu: on the GPU; offload and zenflow: \
    in pinned host memory); zenflow adds an fp32 gradient window of 4 B on the GPU and 4 B of host \
    accumulator, and keeps the selected columns' state (topk_ratio × 16 B) on the GPU. Everything \
    but the weights is divided by the world size (ZeRO-2). MiB/GiB = 2^20/2^30 bytes.";

/// One named model and the (GPU, host) bytes per rank of each mode of [`modes`].
struct Row {
    name: &'static str,
    model: GptConfig,
    memory: Vec<(f64, f64)>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.world_size == 0 {
        return Err(crate::InputError::from_display("--world-size must be at least 1"));
    }
    if !(0.0..=1.0).contains(&args.topk_ratio) {
        return Err(crate::InputError::from_display("--topk-ratio must be between 0 and 1"));
    }
    let world = f64::from(args.world_size);
    let modes = modes(args.topk_ratio);
    let rows: Vec<Row> = NAMED_SIZES
        .iter()
        .map(|&name| {
            let model = GptConfig::named(name).expect("a named size");
            let params = model.num_params() as f64;
            let memory = modes
                .iter()
                .map(|m| {
                    let gpu = params * (m.gpu_whole + m.gpu_partitioned / world);
                    (gpu, params * m.host_partitioned / world)
                })
                .collect();
            Row { name, model, memory }
        })
        .collect();
    if args.json {
        print_json(&args, &modes, &rows)
    } else {
        print_table(&args, &rows);
        Ok(())
    }
}

fn print_json(args: &Args, modes: &[BytesPerParam], rows: &[Row]) -> anyhow::Result<()> {
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
                "shape": row.model,
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
            model.n_layer,
            model.n_head,
            model.d_model,
            model.context,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The modes' bytes per parameter are the engine's buffers: 16 B on the GPU without offload,
    /// 4 B on the GPU and 12 B on the host with it, and ZenFlow in between on the GPU.
    #[test]
    fn bytes_per_parameter_follow_the_engines_buffers() {
        let [gpu, offload, zenflow] = modes(0.1);
        assert_eq!((gpu.gpu_whole + gpu.gpu_partitioned, gpu.host_partitioned), (16.0, 0.0));
        assert_eq!(
            (offload.gpu_whole + offload.gpu_partitioned, offload.host_partitioned),
            (4.0, 12.0)
        );
        let zenflow_gpu = zenflow.gpu_whole + zenflow.gpu_partitioned;
        assert!(zenflow_gpu > 4.0 && zenflow_gpu < 16.0, "{zenflow_gpu}");
        assert_eq!(zenflow.host_partitioned, 16.0);
    }
}
