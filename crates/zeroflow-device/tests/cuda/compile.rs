//! The engine's kernels compile with NVRTC, without a GPU: this runs in CI wherever libnvrtc
//! loads (and prints `skipped: libnvrtc not found` elsewhere).

use zeroflow_device::DeviceError;
use zeroflow_device::cuda::CudaLibrary;
use zeroflow_device::cuda::kernels::{ENGINE_SOURCE, kernel_names};
use zeroflow_device::cuda::module::compile;

/// Whether the cubin's symbol table holds `name` (as a whole NUL-terminated string).
fn exports(cubin: &[u8], name: &str) -> bool {
    let needle: Vec<u8> = name.bytes().chain([0]).collect();
    cubin.windows(needle.len()).any(|window| window == needle)
}

#[test]
fn engine_kernels_compile_for_sm80_and_sm90_and_export_every_kernel_the_device_loads() {
    for arch in [(8, 0), (9, 0)] {
        let cubin = match compile("engine", ENGINE_SOURCE, arch, &[]) {
            Ok(cubin) => cubin,
            Err(DeviceError::Library { library, reason })
                if library == CudaLibrary::Nvrtc.name() =>
            {
                println!("skipped: libnvrtc not found ({reason})");
                return;
            }
            Err(error) => panic!("{error}"),
        };
        let names = kernel_names();
        let missing: Vec<&String> = names.iter().filter(|name| !exports(&cubin, name)).collect();
        assert!(
            missing.is_empty(),
            "sm_{}{}: engine.cu does not export {missing:?}",
            arch.0,
            arch.1
        );
        assert!(!exports(&cubin, "cast_f32_f64"), "the symbol check finds names that do not exist");
        println!(
            "engine.cu: {} bytes of cubin for sm_{}{}, {} kernels",
            cubin.len(),
            arch.0,
            arch.1,
            names.len()
        );
    }
}
