//! Binding a rank's CPU optimizer to the CPUs near its GPU. With several ranks on a host and the
//! optimizer offloaded, each rank's CPU threads run on the CPUs local to its GPU (the GPU's NUMA
//! node, as sysfs says), and the pinned host buffers it allocates afterwards come from that node's
//! memory: the kernel places a page on the node of the CPU that first touches it, and the thread
//! that allocates them is bound. What `numactl --cpunodebind` and DeepSpeed's
//! `--bind_cores_to_rank` do.
//!
//! [`BindMode`] switches it (`--cpu-bind`, `ZEROFLOW_CPU_BIND`, `zeroflow.cpu_bind`:
//! [`crate::settings`]): `auto` (the default: bind when the host runs several ranks), `on` (a rank
//! alone on its host too), `off`. Binding is best effort: whatever fails leaves the
//! process as it was, with a debug message saying why.
//!
//! The binding holds for the calling thread and the threads it starts afterwards, so
//! [`bind_for_gpu`] must run before any thread pool exists (rayon's global pool, which sizes
//! itself from the CPUs the process may use, and the optimizer's).

// Only Linux binds; elsewhere the planning is compiled but unused.
#![cfg_attr(not(target_os = "linux"), allow(dead_code))]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use super::DistEnv;

/// The largest CPU number a CPU list may name: far beyond any host, small enough that a mask of
/// that many bits is cheap.
const MAX_CPU: usize = 1 << 16;

/// When to bind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindMode {
    /// Bind when the host runs several ranks (the default).
    Auto,
    /// Bind, even a rank alone on its host.
    On,
    /// Never bind.
    Off,
}

impl BindMode {
    /// Whether a rank of a host that runs `local_world_size` ranks binds.
    pub fn binds(self, local_world_size: usize) -> bool {
        match self {
            BindMode::Auto => local_world_size > 1,
            BindMode::On => true,
            BindMode::Off => false,
        }
    }
}

impl fmt::Display for BindMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BindMode::Auto => "auto",
            BindMode::On => "on",
            BindMode::Off => "off",
        })
    }
}

/// Where this rank's threads were bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The NUMA node of the rank's GPU, where sysfs knows it.
    pub node: Option<i64>,
    /// The CPUs the rank's threads run on, ascending.
    pub cpus: Vec<usize>,
}

/// What sysfs says about a PCI device's place on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Locality {
    /// Its NUMA node; `None` where sysfs says -1 (one node, or unknown) or nothing.
    pub node: Option<i64>,
    /// The CPUs local to it, ascending.
    pub cpus: Vec<usize>,
}

/// The CPUs of a Linux CPU list ("0-3,8,10-11\n", as sysfs and `taskset -c` write them),
/// ascending and without repeats; an empty list is empty. `None` if `text` is not such a list.
pub fn parse_cpulist(text: &str) -> Option<Vec<usize>> {
    let text = text.trim();
    let mut cpus = Vec::new();
    if text.is_empty() {
        return Some(cpus);
    }
    for item in text.split(',') {
        let (first, last) = match item.split_once('-') {
            Some((first, last)) => (cpu_number(first)?, cpu_number(last)?),
            None => (cpu_number(item)?, cpu_number(item)?),
        };
        if first > last || last > MAX_CPU {
            return None;
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Some(cpus)
}

/// One CPU number: decimal digits only (no sign), spaces around them ignored.
fn cpu_number(text: &str) -> Option<usize> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// `cpus` as a Linux CPU list, "0-3,8,10-11" (ascending, ranges merged).
pub fn format_cpulist(cpus: &[usize]) -> String {
    let cpus: BTreeSet<usize> = cpus.iter().copied().collect();
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for cpu in cpus {
        match ranges.last_mut() {
            Some((_, last)) if *last + 1 == cpu => *last = cpu,
            _ => ranges.push((cpu, cpu)),
        }
    }
    let texts: Vec<String> = ranges
        .into_iter()
        .map(
            |(first, last)| {
                if first == last { first.to_string() } else { format!("{first}-{last}") }
            },
        )
        .collect();
    texts.join(",")
}

/// `bus_id` as `/sys/bus/pci/devices/` names it: lower case, with a domain of 4 hex digits (a
/// driver may write 8: "00000000:1B:00.0").
pub fn sysfs_bus_id(bus_id: &str) -> String {
    let id = bus_id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => match u32::from_str_radix(domain, 16) {
            Ok(domain) => format!("{domain:04x}:{rest}"),
            Err(_) => id,
        },
        _ => id,
    }
}

/// The sysfs directory of PCI device `bus_id` under `root` ("/sys" on a real host).
fn pci_dir(root: &Path, bus_id: &str) -> PathBuf {
    root.join("bus/pci/devices").join(sysfs_bus_id(bus_id))
}

/// The local CPUs (`local_cpulist`, needed) and NUMA node (`numa_node`, optional) of PCI device
/// `bus_id`, from sysfs under `root`; why not where the CPU list is missing or malformed.
pub fn locality(root: &Path, bus_id: &str) -> Result<Locality, String> {
    let dir = pci_dir(root, bus_id);
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))
    };
    let text = read("local_cpulist")?;
    let cpus = parse_cpulist(&text).ok_or_else(|| {
        format!("{}: {:?} is not a CPU list", dir.join("local_cpulist").display(), text.trim())
    })?;
    let node = read("numa_node").ok().and_then(|text| text.trim().parse::<i64>().ok());
    Ok(Locality { node: node.filter(|&node| node >= 0), cpus })
}

/// The core of `cpu`: the first of its SMT siblings (`thread_siblings_list` under `root`), or
/// `cpu` itself where sysfs does not say.
fn core_of(root: &Path, cpu: usize) -> usize {
    let path = root.join(format!("devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"));
    let siblings = std::fs::read_to_string(path).ok().and_then(|text| parse_cpulist(&text));
    siblings.and_then(|siblings| siblings.first().copied()).unwrap_or(cpu)
}

/// The CPUs of local rank `local_rank`, where `gpu_cpus[r]` are the CPUs local to the GPU of local
/// rank `r` (every rank of the host), `allowed` the CPUs this process may run on, and `core_of`
/// the core of a CPU (the first of its SMT siblings; the CPU itself where unknown).
///
/// The ranks whose GPUs have the same local CPUs share them. The CPUs outside `allowed` are
/// dropped first; the rest, grouped by core, are split into contiguous equal slices of whole cores,
/// one per sharing rank in rank order, so that two ranks never share a core through its SMT
/// siblings. The cores left over (fewer than the sharing ranks) go to none, as DeepSpeed's
/// `--bind_cores_to_rank` leaves them. With fewer cores than sharing ranks the CPUs themselves are
/// split. `None` (no binding) where fewer CPUs than sharing ranks are left, including none at all,
/// rather than ranks on top of each other; also where `local_rank` has no entry.
pub fn plan(
    gpu_cpus: &[Vec<usize>],
    local_rank: usize,
    allowed: &[usize],
    core_of: impl Fn(usize) -> usize,
) -> Option<Vec<usize>> {
    let sets: Vec<BTreeSet<usize>> =
        gpu_cpus.iter().map(|cpus| cpus.iter().copied().collect()).collect();
    let mine = sets.get(local_rank)?;
    let sharing: Vec<usize> = (0..sets.len()).filter(|&rank| sets[rank] == *mine).collect();
    let position = sharing.iter().position(|&rank| rank == local_rank)?;
    let allowed: BTreeSet<usize> = allowed.iter().copied().collect();
    let usable: Vec<usize> = mine.intersection(&allowed).copied().collect();
    let mut cores: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for &cpu in &usable {
        cores.entry(core_of(cpu)).or_default().push(cpu);
    }
    let units: Vec<Vec<usize>> = if cores.len() >= sharing.len() {
        cores.into_values().collect()
    } else {
        usable.iter().map(|&cpu| vec![cpu]).collect()
    };
    let per_rank = units.len() / sharing.len();
    if per_rank == 0 {
        return None;
    }
    let mut cpus = units[position * per_rank..(position + 1) * per_rank].concat();
    cpus.sort_unstable();
    Some(cpus)
}

/// The binding of local rank `local_rank`, whose host's GPUs (in local-rank order) have `bus_ids`,
/// for a process allowed on `allowed`, from sysfs under `root`; why not where it cannot be planned.
fn plan_from_sysfs(
    root: &Path,
    bus_ids: &[String],
    local_rank: usize,
    allowed: &[usize],
) -> Result<Binding, String> {
    let mut gpu_cpus = Vec::with_capacity(bus_ids.len());
    let mut node = None;
    for (rank, bus_id) in bus_ids.iter().enumerate() {
        let gpu = locality(root, bus_id).map_err(|e| format!("GPU {rank} ({bus_id}): {e}"))?;
        if rank == local_rank {
            node = gpu.node;
        }
        gpu_cpus.push(gpu.cpus);
    }
    let cpus = plan(&gpu_cpus, local_rank, allowed, |cpu| core_of(root, cpu)).ok_or_else(|| {
        let theirs = gpu_cpus.get(local_rank).map_or_else(String::new, |cpus| format_cpulist(cpus));
        format!(
            "too few CPUs for the ranks whose GPUs are local to CPUs {theirs:?} (this process may \
             run on {})",
            format_cpulist(allowed)
        )
    })?;
    Ok(Binding { node, cpus })
}

/// The CPU optimizer's threads: the binding's CPUs, else the host's cores (those this process may
/// use) shared evenly between the host's ranks ([`DistEnv::cpu_threads`]).
pub fn optimizer_threads(binding: Option<&Binding>, dist: &DistEnv) -> usize {
    match binding {
        Some(binding) => binding.cpus.len().max(1),
        None => dist.cpu_threads(std::thread::available_parallelism().map_or(1, |n| n.get())),
    }
}

/// Binds the calling thread, and so the threads it starts afterwards, to the CPUs of this rank's
/// GPU (GPU `dist.local_rank`) as `mode` says: the ranks whose GPUs are local to the
/// same CPUs split them ([`plan`]), within the CPUs this process may use. Call it before anything
/// starts a thread. `None` where it does not bind, with a debug message saying why; never an
/// error. A no-op except on Linux.
pub fn bind_for_gpu(dist: &DistEnv, mode: BindMode) -> Option<Binding> {
    if !mode.binds(dist.local_world_size) {
        tracing::debug!(
            "rank {}: not binding the CPU optimizer (cpu bind {mode}, {} rank(s) on this host)",
            dist.rank,
            dist.local_world_size
        );
        return None;
    }
    match bind(dist) {
        Ok(binding) => {
            let node = binding.node.map_or_else(|| "unknown".to_owned(), |node| node.to_string());
            tracing::info!(
                "rank {}: GPU {} is on NUMA node {node}; CPU optimizer bound to CPUs {} ({} cores)",
                dist.rank,
                dist.local_rank,
                format_cpulist(&binding.cpus),
                binding.cpus.len()
            );
            Some(binding)
        }
        Err(reason) => {
            tracing::debug!(
                "rank {}: not binding the CPU optimizer to GPU {}'s CPUs: {reason}",
                dist.rank,
                dist.local_rank
            );
            None
        }
    }
}

/// Finds the host's GPUs, plans this rank's CPUs and binds the calling thread to them.
#[cfg(target_os = "linux")]
fn bind(dist: &DistEnv) -> Result<Binding, String> {
    use zeroflow_device::CudaDevice;
    let count = CudaDevice::count().map_err(|e| e.to_string())?;
    if count < dist.local_world_size {
        return Err(format!(
            "the CUDA driver sees {count} GPU(s), fewer than the {} ranks on this host (check \
             CUDA_VISIBLE_DEVICES)",
            dist.local_world_size
        ));
    }
    let bus_ids = (0..dist.local_world_size)
        .map(|ordinal| CudaDevice::pci_bus_id(ordinal).map_err(|e| e.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let allowed = sys::allowed_cpus()?;
    let binding = plan_from_sysfs(Path::new("/sys"), &bus_ids, dist.local_rank, &allowed)?;
    sys::bind_to(&binding.cpus)?;
    Ok(binding)
}

#[cfg(not(target_os = "linux"))]
fn bind(_dist: &DistEnv) -> Result<Binding, String> {
    Err("binding to CPUs is implemented on Linux only".into())
}

/// The affinity calls, through rustix (no unsafe code in the binary). Its masks hold
/// `CpuSet::MAX_CPU` CPUs (1024); a CPU beyond that cannot be bound.
#[cfg(target_os = "linux")]
mod sys {
    use rustix::thread::{CpuSet, sched_getaffinity, sched_setaffinity};

    /// The CPUs the calling thread may run on (`sched_getaffinity`).
    pub(super) fn allowed_cpus() -> Result<Vec<usize>, String> {
        let mask = sched_getaffinity(None).map_err(|e| format!("sched_getaffinity failed: {e}"))?;
        Ok(cpus_of(&mask))
    }

    /// Binds the calling thread to `cpus` (`sched_setaffinity`).
    pub(super) fn bind_to(cpus: &[usize]) -> Result<(), String> {
        let failed = |reason: String| {
            format!("sched_setaffinity to CPUs {} failed: {reason}", super::format_cpulist(cpus))
        };
        let mask =
            mask_of(cpus).ok_or_else(|| failed(format!("beyond CPU {}", CpuSet::MAX_CPU)))?;
        sched_setaffinity(None, &mask).map_err(|e| failed(e.to_string()))
    }

    /// The CPUs whose bits `mask` sets.
    pub(super) fn cpus_of(mask: &CpuSet) -> Vec<usize> {
        (0..CpuSet::MAX_CPU).filter(|&cpu| mask.is_set(cpu)).collect()
    }

    /// The mask of `cpus`, or `None` if one is beyond what a mask holds.
    pub(super) fn mask_of(cpus: &[usize]) -> Option<CpuSet> {
        let mut mask = CpuSet::new();
        for &cpu in cpus {
            if cpu >= CpuSet::MAX_CPU {
                return None;
            }
            mask.set(cpu);
        }
        Some(mask)
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::{
        BindMode, Binding, Locality, format_cpulist, locality, optimizer_threads, parse_cpulist,
        plan, plan_from_sysfs, sysfs_bus_id,
    };
    use crate::dist::DistEnv;

    fn range(first: usize, last: usize) -> Vec<usize> {
        (first..=last).collect()
    }

    fn list(text: &str) -> Vec<usize> {
        parse_cpulist(text).unwrap()
    }

    /// A CPU is its own core (no SMT siblings known).
    fn alone(cpu: usize) -> usize {
        cpu
    }

    #[test]
    fn cpulists_parse_ranges_singles_and_sysfs_newlines() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpulist(" 0-1 , 4 \n"), Some(vec![0, 1, 4]));
        assert_eq!(parse_cpulist("7"), Some(vec![7]));
        assert_eq!(parse_cpulist("3-3"), Some(vec![3]));
        // Out of order and overlapping: ascending, once each.
        assert_eq!(parse_cpulist("8-9,0,8"), Some(vec![0, 8, 9]));
        // A device local to no CPU (or a memory-only node) has an empty list.
        assert_eq!(parse_cpulist("\n"), Some(vec![]));
        assert_eq!(parse_cpulist(""), Some(vec![]));
    }

    #[test]
    fn malformed_cpulists_are_refused() {
        for bad in
            ["x", "0-", "-3", "3-1", "0,,1", "1,", "0-3:2", "+1", "0x1", "1 2", "0-99999999", "ff"]
        {
            assert_eq!(parse_cpulist(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn cpulists_format_with_merged_ranges() {
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpulist(&[5, 4]), "4-5");
        assert_eq!(format_cpulist(&[]), "");
        let text = "0-15,32-47";
        assert_eq!(format_cpulist(&list(text)), text);
    }

    #[test]
    fn two_gpus_on_two_nodes_each_get_their_node() {
        let gpus = [list("0-15,32-47"), list("16-31,48-63")];
        let all = range(0, 63);
        assert_eq!(plan(&gpus, 0, &all, alone), Some(list("0-15,32-47")));
        assert_eq!(plan(&gpus, 1, &all, alone), Some(list("16-31,48-63")));
    }

    #[test]
    fn two_gpus_on_one_node_split_it_in_halves() {
        let gpus = [range(0, 31), range(0, 31)];
        let all = range(0, 31);
        assert_eq!(plan(&gpus, 0, &all, alone), Some(range(0, 15)));
        assert_eq!(plan(&gpus, 1, &all, alone), Some(range(16, 31)));
    }

    #[test]
    fn four_gpus_two_per_node_split_their_node() {
        let (a, b) = (list("0-7"), list("8-15"));
        let gpus = [a.clone(), a, b.clone(), b];
        let all = range(0, 15);
        let mine: Vec<_> = (0..4).map(|rank| plan(&gpus, rank, &all, alone).unwrap()).collect();
        assert_eq!(mine, [range(0, 3), range(4, 7), range(8, 11), range(12, 15)]);
    }

    #[test]
    fn smt_siblings_stay_with_one_rank() {
        // 16 cores, 2 threads each: CPU c and c + 16 share core c.
        let gpus = [range(0, 31), range(0, 31)];
        let core = |cpu: usize| cpu % 16;
        assert_eq!(plan(&gpus, 0, &range(0, 31), core), Some(list("0-7,16-23")));
        assert_eq!(plan(&gpus, 1, &range(0, 31), core), Some(list("8-15,24-31")));
        // Fewer cores than ranks: the threads are split.
        let gpus = vec![list("0-1"); 2];
        assert_eq!(plan(&gpus, 1, &range(0, 1), |_| 0), Some(vec![1]));
    }

    #[test]
    fn cpus_outside_the_allowed_mask_are_dropped_first() {
        let gpus = [range(0, 31), range(0, 31)];
        // 24 allowed CPUs: 12 each.
        let allowed = range(8, 31);
        assert_eq!(plan(&gpus, 0, &allowed, alone), Some(range(8, 19)));
        assert_eq!(plan(&gpus, 1, &allowed, alone), Some(range(20, 31)));
        // A rank alone on its node keeps the part of it it may use.
        let gpus = [list("0-15"), list("16-31")];
        assert_eq!(plan(&gpus, 1, &list("0-3,20-23"), alone), Some(range(20, 23)));
        // None of its node's CPUs allowed: no binding.
        assert_eq!(plan(&gpus, 0, &range(16, 31), alone), None);
    }

    #[test]
    fn more_ranks_than_cpus_do_not_bind_and_leftovers_go_to_none() {
        let gpus = vec![range(0, 2); 4];
        for rank in 0..4 {
            assert_eq!(plan(&gpus, rank, &range(0, 2), alone), None);
        }
        // 8 CPUs for 3 ranks: 2 each, CPUs 6 and 7 unused.
        let gpus = vec![range(0, 7); 3];
        let mine: Vec<_> = (0..3).map(|rank| plan(&gpus, rank, &range(0, 7), alone)).collect();
        assert_eq!(mine, [Some(vec![0, 1]), Some(vec![2, 3]), Some(vec![4, 5])]);
        // Exactly one CPU each.
        let gpus = vec![range(0, 3); 4];
        assert_eq!(plan(&gpus, 3, &range(0, 3), alone), Some(vec![3]));
    }

    #[test]
    fn an_unknown_rank_or_empty_lists_do_not_bind() {
        let gpus = [range(0, 7)];
        assert_eq!(plan(&gpus, 1, &range(0, 7), alone), None);
        assert_eq!(plan(&[vec![], vec![]], 0, &range(0, 7), alone), None);
    }

    /// (Its spellings are checked with the other settings', in `settings::env`.)
    #[test]
    fn auto_binds_with_several_ranks_on_a_host_on_always_off_never() {
        assert!(!BindMode::Auto.binds(1));
        assert!(BindMode::Auto.binds(2));
        assert!(BindMode::On.binds(1));
        assert!(!BindMode::Off.binds(8));
    }

    #[test]
    fn bus_ids_take_sysfs_form() {
        assert_eq!(sysfs_bus_id("0000:1B:00.0"), "0000:1b:00.0");
        assert_eq!(sysfs_bus_id("00000000:1B:00.0\n"), "0000:1b:00.0");
        assert_eq!(sysfs_bus_id("00010000:1b:00.0"), "10000:1b:00.0");
    }

    /// A fresh directory standing for `/sys`.
    fn fake_sysfs(name: &str) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("zeroflow-sysfs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        root
    }

    /// Writes a PCI device's sysfs files (`None`: the file is absent).
    fn device(root: &Path, bus_id: &str, cpulist: Option<&str>, node: Option<&str>) {
        let dir = root.join("bus/pci/devices").join(bus_id);
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(text) = cpulist {
            std::fs::write(dir.join("local_cpulist"), text).unwrap();
        }
        if let Some(text) = node {
            std::fs::write(dir.join("numa_node"), text).unwrap();
        }
    }

    #[test]
    fn sysfs_gives_a_gpus_node_and_cpus() {
        let root = fake_sysfs("locality");
        device(&root, "0000:1b:00.0", Some("0-15,32-47\n"), Some("0\n"));
        device(&root, "0000:9a:00.0", Some("16-31\n"), Some("-1\n"));
        device(&root, "0000:c1:00.0", Some("16-31\n"), None);
        device(&root, "0000:d1:00.0", None, Some("1\n"));
        device(&root, "0000:e1:00.0", Some("lots\n"), Some("1\n"));
        // The driver's upper case and long domain find the sysfs directory.
        let gpu = locality(&root, "00000000:1B:00.0").unwrap();
        assert_eq!(gpu, Locality { node: Some(0), cpus: list("0-15,32-47") });
        // -1 or no numa_node: no node, the CPUs still count.
        assert_eq!(locality(&root, "0000:9a:00.0").unwrap().node, None);
        assert_eq!(locality(&root, "0000:c1:00.0").unwrap().node, None);
        let missing = locality(&root, "0000:d1:00.0").unwrap_err();
        assert!(missing.contains("local_cpulist"), "{missing}");
        let malformed = locality(&root, "0000:e1:00.0").unwrap_err();
        assert!(malformed.contains("not a CPU list"), "{malformed}");
        assert!(locality(&root, "0000:00:00.0").is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn sysfs_plans_each_ranks_binding() {
        let root = fake_sysfs("plan");
        device(&root, "0000:1b:00.0", Some("0-7\n"), Some("0\n"));
        device(&root, "0000:9a:00.0", Some("0-7\n"), Some("0\n"));
        device(&root, "0000:c1:00.0", Some("8-15\n"), Some("1\n"));
        // CPU c and c + 4 are siblings on node 0; node 1 says nothing about its cores.
        for cpu in 0..8 {
            let dir = root.join(format!("devices/system/cpu/cpu{cpu}/topology"));
            std::fs::create_dir_all(&dir).unwrap();
            let core = cpu % 4;
            std::fs::write(dir.join("thread_siblings_list"), format!("{core},{}\n", core + 4))
                .unwrap();
        }
        let ids: Vec<String> =
            ["0000:1B:00.0", "0000:9A:00.0", "0000:C1:00.0"].map(str::to_owned).to_vec();
        let all = range(0, 15);
        let binding = |rank| plan_from_sysfs(&root, &ids, rank, &all);
        assert_eq!(binding(0), Ok(Binding { node: Some(0), cpus: list("0-1,4-5") }));
        assert_eq!(binding(1), Ok(Binding { node: Some(0), cpus: list("2-3,6-7") }));
        assert_eq!(binding(2), Ok(Binding { node: Some(1), cpus: range(8, 15) }));
        // A GPU without its sysfs files: no binding, for every rank, naming the GPU.
        let more: Vec<String> = ids.iter().cloned().chain(["0000:ff:00.0".to_owned()]).collect();
        let error = plan_from_sysfs(&root, &more, 0, &all).unwrap_err();
        assert!(error.starts_with("GPU 3 (0000:ff:00.0)"), "{error}");
        // Nothing allowed on the GPU's CPUs: no binding.
        let error = plan_from_sysfs(&root, &ids, 2, &range(0, 7)).unwrap_err();
        assert!(error.contains("too few CPUs"), "{error}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_optimizer_takes_the_bound_cpus_or_an_even_share() {
        let binding = Binding { node: Some(1), cpus: range(16, 31) };
        let two = DistEnv { local_world_size: 2, world_size: 2, ..DistEnv::single() };
        assert_eq!(optimizer_threads(Some(&binding), &two), 16);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(optimizer_threads(None, &two), two.cpu_threads(cores));
        assert_eq!(optimizer_threads(None, &DistEnv::single()), cores);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn affinity_masks_round_trip() {
        use super::sys::{cpus_of, mask_of};
        for cpus in [vec![0], vec![0, 1, 2, 63, 64, 130], range(0, 1000), vec![]] {
            assert_eq!(cpus_of(&mask_of(&cpus).expect("within a mask")), cpus);
        }
        assert!(mask_of(&[1 << 20]).is_none());
    }

    /// The calling thread's mask is readable, and binding a thread to what it may already use
    /// changes nothing (done on a thread of its own, which ends with the test).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_reads_and_sets_its_own_affinity() {
        std::thread::spawn(|| {
            let allowed = super::sys::allowed_cpus().unwrap();
            assert!(!allowed.is_empty());
            let first = vec![allowed[0]];
            super::sys::bind_to(&first).unwrap();
            assert_eq!(super::sys::allowed_cpus().unwrap(), first);
            assert!(super::sys::bind_to(&[super::MAX_CPU * 4]).is_err());
        })
        .join()
        .unwrap();
    }
}
