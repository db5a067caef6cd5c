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

/// `zeroflow plan --gpu-memory --host-memory` plans for another machine than this one (which has
/// no GPU): llama-8b's full fine-tune with offload on the H200's 139.8 GiB keeps the share of the
/// optimizer that fits on the GPU and fits 125 GiB of host; on an 80 GiB GPU with 64 GiB of host
/// it does not fit, and 16-bit moments are named as what brings it under. A GPU's memory needs a
/// GPU to plan.
#[test]
fn plan_for_a_machine_given_by_its_memory() {
    let run = ["plan", "--json", "--device", "cuda", "--model", "llama-8b", "--micro-batch", "4"];
    let config =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/configs/zero2-offload-bf16.json");
    let more = ["--config", config, "--activation-checkpointing"];
    let gib = 1u64 << 30;
    let h200 = ["--gpu-memory", "139.8", "--host-memory", "125GiB"];
    let plan = zeroflow_json(&[&run[..], &more, &h200].concat());
    assert_eq!(plan["machine_given"], true, "{plan}");
    assert_eq!(plan["machine_gpu_bytes"].as_u64(), Some((139.8 * gib as f64) as u64));
    assert_eq!(plan["machine_host_available_bytes"].as_u64(), Some(125 * gib));
    assert_eq!(plan["fits"], true, "{plan}");
    let share = plan["device_share"].as_f64().expect("device_share");
    assert!(share > 0.5 && share < 1.0, "{plan}");
    let gpu = plan["gpu_total_bytes"].as_u64().unwrap();
    assert!(gpu as f64 <= 0.9 * 139.8 * gib as f64, "a tenth of the GPU left free: {plan}");
    let host = plan["host_total_bytes"].as_u64().unwrap();
    assert!(host < 32 * gib, "the share's state off the host: {plan}");

    let smaller = ["--gpu-memory", "80", "--host-memory", "64"];
    let plan = zeroflow_json(&[&run[..], &more, &smaller].concat());
    assert_eq!(
        (plan["fits_gpu"].as_bool(), plan["fits_host"].as_bool()),
        (Some(true), Some(false))
    );
    let knobs = plan["knobs_that_fit"].as_array().expect("knobs_that_fit");
    assert!(knobs.iter().any(|knob| knob.as_str().unwrap().contains("bf16")), "{plan}");

    let cpu = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["plan", "--model", "tiny", "--gpu-memory", "80"])
        .output()
        .expect("runs");
    assert_eq!(cpu.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&cpu.stderr).contains("add --device cuda"));
}

/// `zeroflow plan --nproc-per-node N [--nnodes M]` plans rank 0 of a launched job: the
/// optimizer's state partitioned over N × M ranks, the host's memory shared by N of them. Two
/// ranks of llama-8b offloaded on one host of 64 GiB do not fit (each holds half the optimizer,
/// twice over on the host); on two hosts of two they do.
#[test]
fn plan_for_a_job_of_several_processes() {
    let run = ["plan", "--json", "--device", "cuda", "--model", "llama-8b", "--micro-batch", "1"];
    let config =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/configs/zero2-offload-bf16.json");
    // Share 0 for both: one rank alone would keep part of its state on the GPU by default.
    let machine =
        ["--config", config, "--gpu-memory", "80", "--host-memory", "64", "--device-share", "0"];
    let one = zeroflow_json(&[&run[..], &machine].concat());
    let two = zeroflow_json(&[&run[..], &machine, &["--nproc-per-node", "2"]].concat());
    assert_eq!((one["world_size"].as_u64(), two["world_size"].as_u64()), (Some(1), Some(2)));
    assert_eq!(two["machine_host_ranks"].as_u64(), Some(2), "{two}");
    let state = |plan: &serde_json::Value| line_bytes(plan, "host", "master weights and moments");
    assert_eq!(state(&two), state(&one) / 2, "{two}");
    assert_eq!(two["fits_host"], false, "{two}");
    let four = ["--nproc-per-node", "2", "--nnodes", "2"];
    let four = zeroflow_json(&[&run[..], &machine, &four].concat());
    assert_eq!((four["world_size"].as_u64(), four["fits_host"].as_bool()), (Some(4), Some(true)));
}
