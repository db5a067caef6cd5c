//! What this machine is and what zeroflow finds on it (`zeroflow env`): the host's CPU, cores,
//! memory and SIMD level, the CUDA driver, each GPU with its NUMA node and local CPUs, and the
//! CUDA libraries.

use std::path::Path;
use std::time::Duration;

use serde_json::json;
use zeroflow_device::CudaDevice;
use zeroflow_device::cuda::{CudaReport, GpuInfo, is_absent, short_reason};

use crate::dist::affinity;

/// The machine as one JSON object, for the binary of `version` built from `commit`:
/// `zeroflow env --json` prints it and `zeroflow stress` embeds it; `bench step` rows embed its
/// host part ([`host`]).
pub fn describe(version: &str, commit: &str) -> serde_json::Value {
    let cuda = CudaReport::collect();
    let mut out = serde_json::Map::new();
    out.insert("zeroflow_version".into(), json!(version));
    out.insert("git_commit".into(), json!(commit));
    out.insert("os".into(), json!(std::env::consts::OS));
    out.insert("arch".into(), json!(std::env::consts::ARCH));
    out.extend(host());
    out.insert("cuda_driver".into(), json!(cuda_driver(&cuda)));
    out.insert("cuda".into(), cuda_details(&cuda));
    out.into()
}

/// The host as the CPU optimizer sees it: the CPU's model, its cores, the memory, and the SIMD
/// level the CPU AdamW's kernels run at (`scalar` where the CPU, or a virtual machine's view of
/// it, shows neither AVX2 with FMA nor AVX-512F).
pub fn host() -> serde_json::Map<String, serde_json::Value> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let mut host = serde_json::Map::new();
    host.insert("cpu_model".into(), json!(field(&cpuinfo, "model name")));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    host.insert("host_cores".into(), json!(cores));
    host.insert("host_memory_gib".into(), json!(kib_field(&meminfo, "MemTotal").map(gib)));
    let available = kib_field(&meminfo, "MemAvailable").map(gib);
    host.insert("host_memory_available_gib".into(), json!(available));
    host.insert("simd".into(), json!(zeroflow_optim::SimdLevel::detect().name()));
    host
}

/// CPU time the hypervisor has taken from this machine since it booted, summed over its CPUs:
/// the `steal` column of `/proc/stat`, time a virtual CPU was ready to run while the host ran
/// something else (another machine on it). A CPU optimizer on every core slows by what is taken
/// (bench step reports it). `None` where the kernel does not say (not Linux).
pub fn cpu_steal() -> Option<CpuSteal> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    steal_of(&stat, rustix::param::clock_ticks_per_second())
}

/// A reading of [`cpu_steal`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuSteal {
    /// Taken since boot, summed over the CPUs.
    pub taken: Duration,
    /// The CPUs it is summed over (the machine's, whatever this process may use).
    pub cpus: usize,
}

impl CpuSteal {
    /// The share of the machine's CPU time worth a word (a warning, a clause in a summary):
    /// above it a CPU optimizer on every core has slowed by far more than the share.
    pub const WORTH_SAYING: f64 = 0.01;

    /// What was taken since `earlier` (a reading before this one).
    pub fn since(&self, earlier: &CpuSteal) -> Duration {
        self.taken.saturating_sub(earlier.taken)
    }

    /// `taken` as a share of the machine's CPU time over `wall` seconds.
    pub fn share(&self, taken: f64, wall: f64) -> f64 {
        taken / (wall * self.cpus as f64).max(f64::MIN_POSITIVE)
    }
}

/// The `steal` column (the eighth number) of the `cpu` line of a `/proc/stat` text, whose
/// counts are `ticks_per_second` a second, and its `cpuN` lines' count.
fn steal_of(stat: &str, ticks_per_second: u64) -> Option<CpuSteal> {
    fn first(line: &str) -> &str {
        line.split_whitespace().next().unwrap_or_default()
    }
    let line = stat.lines().find(|&line| first(line) == "cpu")?;
    let ticks: u64 = line.split_whitespace().nth(8)?.parse().ok()?;
    let cpus = stat.lines().filter(|line| first(line).starts_with("cpu")).count() - 1;
    (ticks_per_second > 0 && cpus > 0).then(|| CpuSteal {
        taken: Duration::from_secs_f64(ticks as f64 / ticks_per_second as f64),
        cpus,
    })
}

/// The environment as `zeroflow env` prints it: one line per part, GPUs and libraries indented.
pub fn text_lines(env: &serde_json::Value) -> Vec<String> {
    let mut lines = Vec::new();
    let show = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "unknown".into(),
        other => other.to_string(),
    };
    lines.push(format!(
        "zeroflow {} (commit {})",
        show(&env["zeroflow_version"]),
        show(&env["git_commit"])
    ));
    lines.push(format!(
        "host      {} {}, {}",
        show(&env["os"]),
        show(&env["arch"]),
        show(&env["cpu_model"])
    ));
    lines.push(format!("cores     {}", show(&env["host_cores"])));
    lines.push(format!(
        "memory    {} GiB total, {} GiB available",
        show(&env["host_memory_gib"]),
        show(&env["host_memory_available_gib"])
    ));
    lines.push(format!("simd      {}", show(&env["simd"])));
    lines.push(format!("gpu       {}", show(&env["cuda_driver"])));
    for gpu in env["cuda"]["gpus"].as_array().into_iter().flatten() {
        let node = gpu["numa_node"].as_i64().map(|node| format!("; NUMA node {node}"));
        let cpus = gpu["local_cpus"].as_str().filter(|cpus| !cpus.is_empty());
        let cpus = cpus.map(|cpus| format!("; local CPUs {cpus}"));
        lines.push(format!(
            "  gpu {}   {}{}{}",
            show(&gpu["ordinal"]),
            show(&gpu["description"]),
            node.unwrap_or_default(),
            cpus.unwrap_or_default()
        ));
    }
    for (name, library) in env["cuda"]["libraries"].as_object().into_iter().flatten() {
        lines.push(format!("  {name:<12} {}", show(&library["summary"])));
    }
    lines
}

/// One line about the GPUs: what the driver sees, or why there is none.
fn cuda_driver(report: &CudaReport) -> String {
    let driver = match &report.driver {
        Ok(cuda) => cuda,
        Err(error) if error.to_string().contains("CUDA_ERROR_NO_DEVICE") => {
            return "no GPU found (the CUDA driver sees none); zeroflow runs on the CPU".into();
        }
        Err(error) if is_absent(error) => {
            return format!(
                "no GPU found (no CUDA driver: {}); zeroflow runs on the CPU",
                short_reason(error)
            );
        }
        Err(error) => {
            return format!(
                "no GPU usable (the CUDA driver fails: {error}); zeroflow runs on the CPU"
            );
        }
    };
    let kernel =
        report.kernel_driver.as_deref().map(|v| format!("driver {v}, ")).unwrap_or_default();
    match &report.gpus {
        Ok(gpus) if gpus.is_empty() => {
            format!(
                "no GPU found ({kernel}CUDA {driver}, but no GPU visible: check \
                 CUDA_VISIBLE_DEVICES); zeroflow runs on the CPU"
            )
        }
        Ok(gpus) => {
            let names: Vec<String> = gpus.iter().map(GpuInfo::to_string).collect();
            format!("{} GPU(s): {}; {kernel}CUDA {driver}", gpus.len(), names.join(", "))
        }
        Err(error) => format!("{kernel}CUDA {driver}, but listing the GPUs failed: {error}"),
    }
}

/// The GPUs and CUDA libraries, for the JSON output.
fn cuda_details(report: &CudaReport) -> serde_json::Value {
    let gpus: Vec<serde_json::Value> = match &report.gpus {
        Ok(gpus) => gpus
            .iter()
            .map(|gpu| {
                // Where sysfs says (Linux): the GPU's NUMA node and the CPUs local to it.
                let bus_id = CudaDevice::pci_bus_id(gpu.ordinal).ok();
                let locality = bus_id
                    .as_deref()
                    .and_then(|id| affinity::locality(Path::new("/sys"), id).ok());
                json!({
                    "ordinal": gpu.ordinal,
                    "name": gpu.name,
                    "compute_capability": format!("{}.{}", gpu.compute_capability.0, gpu.compute_capability.1),
                    "memory_bytes": gpu.memory_bytes,
                    "description": gpu.to_string(),
                    "pci_bus_id": bus_id,
                    "numa_node": locality.as_ref().and_then(|l| l.node),
                    "local_cpus": locality.map(|l| affinity::format_cpulist(&l.cpus)),
                })
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    let libraries: serde_json::Map<String, serde_json::Value> = report
        .libraries
        .iter()
        .map(|library| {
            let entry = match &library.outcome {
                Ok(loaded) => json!({
                    "file": loaded.file,
                    "version": loaded.version,
                    "summary": library.summary(),
                }),
                Err(error) => json!({ "error": error.to_string(), "summary": library.summary() }),
            };
            (library.library.name().to_string(), entry)
        })
        .collect();
    json!({
        "kernel_driver": report.kernel_driver,
        "cuda_version": report.driver.as_ref().ok(),
        "error": report.driver.as_ref().err().map(ToString::to_string),
        "gpus": gpus,
        "libraries": libraries,
    })
}

fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find(|line| line.split(':').next().is_some_and(|k| k.trim() == key))
        .and_then(|line| line.split_once(':'))
        .map(|(_, value)| value.trim())
}

fn kib_field(text: &str, key: &str) -> Option<u64> {
    field(text, key)?.split_whitespace().next()?.parse().ok()
}

fn gib(kib: u64) -> f64 {
    (kib as f64 / (1024.0 * 1024.0) * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::steal_of;

    #[test]
    fn steal_is_the_cpu_lines_eighth_count_over_the_cpus_listed() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let stat = "cpu  4705 356 584 3699 23 23 0 1235 0 0\n\
                    cpu0 1393 151 198 1203 7 11 0 400 0 0\n\
                    cpu1 1393 151 198 1203 7 11 0 835 0 0\nintr 114930548 113 0\n";
        let taken = |ticks_per_second| steal_of(stat, ticks_per_second).map(|s| s.taken);
        assert_eq!(taken(100), Some(Duration::from_millis(12_350)));
        assert_eq!(taken(250), Some(Duration::from_millis(4_940)));
        assert_eq!(steal_of(stat, 100).map(|s| s.cpus), Some(2));
        // A kernel too old for the column, no `cpu` line, no CPU lines, or no clock: unknown.
        assert_eq!(steal_of("cpu  4705 356 584 3699 23 23 0\ncpu0 1 2 3 4 5 6 7\n", 100), None);
        assert_eq!(steal_of("cpu0 1 2 3 4 5 6 7 8\n", 100), None);
        assert_eq!(steal_of("cpu  1 2 3 4 5 6 7 8\n", 100), None);
        assert_eq!(steal_of(stat, 0), None);
    }

    #[test]
    fn this_machines_steal_is_read_where_linux_reports_it() {
        let steal = super::cpu_steal();
        if cfg!(target_os = "linux") {
            let first = steal.expect("Linux reports steal time in /proc/stat");
            let later = super::cpu_steal().expect("and again");
            assert!(later.taken >= first.taken, "steal went back: {first:?}, then {later:?}");
            // Every CPU of the machine, at least those this process may use.
            let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
            assert!(first.cpus >= usable, "{first:?} for {usable} usable CPUs");
        } else {
            assert_eq!(steal, None);
        }
    }
}
