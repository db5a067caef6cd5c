use clap::Parser;
use zeroflow_device::cuda::HostWaits;

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
    ])
    .unwrap();
    assert_eq!(
        from_flags(command.gpu, command.host),
        Requested {
            attention: Some(Attention::Gemm),
            cuda_wait: Some(HostWaits::Spin),
            cpu_bind: Some(BindMode::Off),
            stream_chunk_mib: Some(0.25),
            copy_stores: Some(Stores::NonTemporal),
            gather_in_pieces: Some(false),
            cpu_threads: Some(9),
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
    ] {
        let error = Command::try_parse_from(["x", bad[0], bad[1]]).unwrap_err().to_string();
        assert!(error.contains(bad[0]) && error.contains(bad[1]), "{error}");
    }
}
