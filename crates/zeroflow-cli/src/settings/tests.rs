use clap::Parser;
use zeroflow_core::config::DeviceShare;
use zeroflow_device::cuda::HostWaits;
use zeroflow_engine::AccumulateOn;

use super::*;

#[derive(Debug, clap::Parser)]
struct Command {
    #[command(flatten)]
    gpu: GpuFlags,
    #[command(flatten)]
    host: HostFlags,
}

#[test]
fn the_flags_take_the_names_the_variables_take() {
    let command = Command::try_parse_from([
        "x",
        "--attention",
        "Gemm",
        "--activation-checkpointing",
        "--cuda-wait",
        "spin",
        "--cpu-bind",
        "off",
        "--stream-chunk-mib",
        "0.25",
        "--copy-stores",
        "non-temporal",
        "--gather",
        "after-step",
        "--cpu-threads",
        "9",
        "--speculation-budget-mib",
        "0",
        "--accumulate-on",
        "Host",
        "--pinned-budget-mib",
        "0",
        "--overlap-forward",
        "off",
        "--device-share",
        "0.75",
        "--device-share-state",
        "Host",
        "--zenflow-aside",
        "HOST",
    ])
    .unwrap();
    assert_eq!(
        from_flags(command.gpu, command.host),
        Requested {
            attention: Some(Attention::Gemm),
            activation_checkpointing: Some(true),
            cuda_wait: Some(HostWaits::Spin),
            cpu_bind: Some(BindMode::Off),
            stream_chunk_mib: Some(0.25),
            copy_stores: Some(Stores::NonTemporal),
            gather_in_pieces: Some(false),
            cpu_threads: Some(9),
            speculation_budget_mib: Some(0.0),
            accumulate_on: Some(AccumulateOn::Host),
            pinned_budget_mib: Some(0.0),
            overlap_forward: Some(false),
            device_share: Some(DeviceShare::Fraction(0.75)),
            device_share_state: Some(ShareState::Host),
            zenflow_aside: Some(ZenFlowAside::Host),
            pack: None,
        }
    );
    for bad in [
        ["--attention", "flash2"],
        ["--cuda-wait", "yield"],
        ["--cpu-bind", "of"],
        ["--stream-chunk-mib", "0"],
        ["--copy-stores", "nt"],
        ["--gather", "later"],
        ["--cpu-threads", "0"],
        ["--speculation-budget-mib", "none"],
        ["--speculation-budget-mib", "4GiB"],
        ["--accumulate-on", "gpu"],
        ["--device-share-state", "pinned"],
        ["--pinned-budget-mib", "half"],
        ["--device-share", "1"],
        ["--device-share", "half"],
        ["--zenflow-aside", "cpu"],
    ] {
        let error = Command::try_parse_from(["x", bad[0], bad[1]]).unwrap_err().to_string();
        assert!(error.contains(bad[0]) && error.contains(bad[1]), "{error}");
    }
    // A negative budget (after `=`: alone, `-1` reads as a flag).
    let error = Command::try_parse_from(["x", "--speculation-budget-mib=-1"]).unwrap_err();
    let error = error.to_string();
    assert!(error.contains("-1") && error.contains("non-negative"), "{error}");
    // A switch takes its value after `=` only (`--activation-checkpointing model.json` is not it).
    let error = Command::try_parse_from(["x", "--activation-checkpointing=yes"]).unwrap_err();
    let error = error.to_string();
    assert!(error.contains("--activation-checkpointing") && error.contains("yes"), "{error}");
    let off = Command::try_parse_from(["x", "--activation-checkpointing=off"]).unwrap();
    assert_eq!(off.gpu.activation_checkpointing, Some(false));
}
