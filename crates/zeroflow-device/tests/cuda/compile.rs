//! The engine's kernels compile with NVRTC, without a GPU: this runs in CI wherever libnvrtc
//! loads (and prints `skipped: libnvrtc not found` elsewhere).

use zeroflow_device::cuda::kernels::{ENGINE_SOURCE, kernel_names};
use zeroflow_device::cuda::module::compile_for_tests;

#[test]
fn engine_kernels_compile_for_sm80_and_sm90_and_export_every_kernel_the_device_loads() {
    let names = kernel_names();
    let compiled = compile_for_tests("engine", ENGINE_SOURCE, &names, "cast_f32_f64");
    for ((major, minor), bytes) in compiled.unwrap_or_else(|e| panic!("{e}")).unwrap_or_default() {
        println!(
            "engine.cu: {bytes} bytes of cubin for sm_{major}{minor}, {} kernels",
            names.len()
        );
    }
}
