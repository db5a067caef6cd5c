//! Compiles a CUDA C file with NVRTC (after zeroflow's prelude) for sm_90, without a GPU:
//! `cargo run -p zeroflow-device --example compile_check -- FILE.cu [sm_XY]`.

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(path) = args.next() else {
        eprintln!("usage: compile_check FILE.cu [sm_XY]");
        std::process::exit(2);
    };
    let arch = args.next().unwrap_or_else(|| "sm_90".into());
    let digits = arch.trim_start_matches("sm_");
    let (major, minor) = digits.split_at(digits.len() - 1);
    let arch = (major.parse().unwrap_or(9), minor.parse().unwrap_or(0));
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        eprintln!("error: {path}: {e}");
        std::process::exit(2);
    });
    let name =
        std::path::Path::new(&path).file_stem().map_or("module".into(), |s| s.to_string_lossy());
    match zeroflow_device::cuda::module::compile(&name, &source, arch, &[]) {
        Ok(cubin) => println!("{path}: {} bytes of cubin for sm_{}{}", cubin.len(), arch.0, arch.1),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
