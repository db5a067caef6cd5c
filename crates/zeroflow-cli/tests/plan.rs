//! `zeroflow plan` and `bench step --plan-only` from the outside, without a GPU: the plan is
//! computed before anything is allocated, so a CUDA configuration plans on this machine too.

use std::process::Command;

fn zeroflow_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_zeroflow")).args(args).output().expect("runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn line_bytes(plan: &serde_json::Value, memory: &str, kind: &str) -> u64 {
    let lines = plan["lines"].as_array().expect("lines");
    let of = |l: &&serde_json::Value| l["memory"] == memory && l["kind"] == kind;
    lines.iter().filter(of).map(|l| l["bytes"].as_u64().expect("bytes")).sum()
}

/// `bench step --plan-only --json` for gpt2-124m with offload on a GPU: 12 B per padded
/// parameter of host state, six 16 MiB bf16 staging buffers, the bf16 weights and gradients on
/// the GPU, and totals at least the sum of those.
#[test]
fn bench_step_plan_only_gives_the_offload_plan() {
    let args = ["bench", "step", "--device", "cuda", "--model", "gpt2-124m", "--mode", "offload"];
    let more = ["--micro-batch", "2", "--seq", "256", "--plan-only", "--json"];
    let plan = zeroflow_json(&[&args[..], &more[..]].concat());
    let gpu_weights = line_bytes(&plan, "gpu", "weights");
    let padded = gpu_weights / 2;
    assert!(padded >= 124_439_808, "{plan}");
    assert_eq!(line_bytes(&plan, "gpu", "gradients"), 2 * padded);
    assert_eq!(line_bytes(&plan, "host", "master weights and moments"), 12 * padded);
    assert_eq!(line_bytes(&plan, "host", "staging and upload buffers"), 6 * (16 << 20));
    let gpu = plan["gpu_total_bytes"].as_u64().expect("gpu_total_bytes");
    let host = plan["host_total_bytes"].as_u64().expect("host_total_bytes");
    assert!(gpu > 4 * padded, "{plan}");
    assert!(host > 12 * padded + 6 * (16 << 20), "{plan}");
    assert_eq!((plan["micro_batch"].as_u64(), plan["seq"].as_u64()), (Some(2), Some(256)));
    // On the disk: the checkpoint's bf16 weights and fp32 optimizer state (14 B per padded
    // parameter), the weights alone in bf16 (`--export`: 2 B per parameter, no padding).
    let parameters = plan["parameters"].as_u64().expect("parameters");
    assert_eq!(plan["checkpoint_disk_bytes"].as_u64(), Some(14 * padded), "{plan}");
    assert_eq!(plan["weights_disk_bytes"].as_u64(), Some(2 * parameters), "{plan}");
}

/// `zeroflow plan --json` takes `train`'s arguments: on the CPU device everything is host
/// memory, and checkpointing (a GPU matter) is off.
#[test]
fn plan_takes_trains_arguments() {
    let plan = zeroflow_json(&["plan", "--json", "--model", "tiny", "--micro-batch", "4"]);
    assert_eq!(plan["gpu_total_bytes"].as_u64(), Some(0), "{plan}");
    let host = plan["host_total_bytes"].as_u64().expect("host_total_bytes");
    let lines = plan["lines"].as_array().expect("lines");
    assert!(lines.iter().all(|l| l["memory"] == "host"), "{plan}");
    let run: u64 =
        lines.iter().filter(|l| l["phase"] == "Run").map(|l| l["bytes"].as_u64().unwrap()).sum();
    assert!(host >= run && run > 0, "{plan}");
    assert_eq!(plan["micro_batch"].as_u64(), Some(4));
    assert_eq!(plan["fits"], true, "{plan}");
}
