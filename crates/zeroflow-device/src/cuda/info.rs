//! What the machine has: GPUs, driver, CUDA libraries and their versions (`zeroflow env`).

use std::fmt;

use cudarc::driver::{result as cu, sys as cu_sys};

use super::library::{self, CudaLibrary, driver_error};
use crate::error::{DeviceError, Result};

/// One GPU as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor), for example (9, 0) for sm_90.
    pub compute_capability: (i32, i32),
    pub memory_bytes: usize,
}

impl fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.compute_capability;
        let gib = self.memory_bytes as f64 / f64::from(1u32 << 30);
        write!(f, "{} (sm_{major}{minor}, {gib:.1} GiB)", self.name)
    }
}

/// The GPUs the driver sees, in ordinal order. Needs no context.
pub fn list_gpus() -> Result<Vec<GpuInfo>> {
    (0..super::CudaDevice::count()?).map(gpu).collect()
}

impl super::CudaDevice {
    /// How many GPUs the driver sees (those `CUDA_VISIBLE_DEVICES` leaves). Needs no context.
    pub fn count() -> Result<usize> {
        library::init_driver()?;
        let count = cu::device::get_count().map_err(|e| driver_error("cuDeviceGetCount", e))?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    /// The PCI address of GPU `ordinal` in lower case, "0000:1b:00.0" (domain:bus:device.function,
    /// as the driver writes it), where `/sys/bus/pci/devices/` names it. Needs no context: nothing
    /// is opened on the GPU.
    pub fn pci_bus_id(ordinal: usize) -> Result<String> {
        library::init_driver()?;
        let ordinal = i32::try_from(ordinal).map_err(|_| DeviceError::Library {
            library: CudaLibrary::Driver.name(),
            reason: format!("{} {ordinal}: not a CUDA device ordinal", library::NO_DEVICE),
        })?;
        let device = cu::device::get(ordinal).map_err(|e| driver_error("cuDeviceGet", e))?;
        // "dddd:bb:dd.f" needs 13 bytes with its NUL; the driver truncates to the length given.
        let mut text = [0u8; 64];
        let len = text.len() as i32;
        // SAFETY: `device` is a valid device handle of the initialised driver; the buffer is valid
        // for writes of `len` bytes.
        let status = unsafe { cu_sys::cuDeviceGetPCIBusId(text.as_mut_ptr().cast(), len, device) };
        status.result().map_err(|e| driver_error("cuDeviceGetPCIBusId", e))?;
        Ok(bus_id_text(&text))
    }
}

/// The NUL-terminated text `cuDeviceGetPCIBusId` wrote, trimmed and in lower case.
fn bus_id_text(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).trim().to_ascii_lowercase()
}

/// GPU `ordinal`'s free and total memory now, in bytes (`cuMemGetInfo`, every process's
/// allocations counted), read from this process's primary context, retained for the reading and
/// released after it (so the free memory excludes that context's own, which the memory plan
/// estimates). Taken before anything of the run is on the GPU, it says what other processes
/// hold.
pub fn memory_now(ordinal: usize) -> Result<(usize, usize)> {
    library::init_driver()?;
    let read = || -> Result<(usize, usize)> {
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
        ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        cu::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))
    };
    // cudarc panics on a symbol it cannot find: an error instead, as `CudaDevice::new` does.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)).unwrap_or_else(|_| {
        Err(DeviceError::Library {
            library: CudaLibrary::Driver.name(),
            reason: format!("cudarc panicked reading GPU {ordinal}'s free memory"),
        })
    })
}

fn gpu(ordinal: usize) -> Result<GpuInfo> {
    let device = cu::device::get(ordinal as i32).map_err(|e| driver_error("cuDeviceGet", e))?;
    let name = cu::device::get_name(device).map_err(|e| driver_error("cuDeviceGetName", e))?;
    let attribute = |attribute| {
        // SAFETY: `device` is a valid device handle of the initialised driver.
        unsafe { cu::device::get_attribute(device, attribute) }
            .map_err(|e| driver_error("cuDeviceGetAttribute", e))
    };
    use cu_sys::CUdevice_attribute as Attr;
    let major = attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    // SAFETY: as above.
    let memory_bytes = unsafe { cu::device::total_mem(device) }
        .map_err(|e| driver_error("cuDeviceTotalMem", e))?;
    Ok(GpuInfo { ordinal, name, compute_capability: (major, minor), memory_bytes })
}

/// One library: the file it loads from and its version, or why it does not load.
#[derive(Clone, Debug, PartialEq)]
pub struct LibraryReport {
    pub library: CudaLibrary,
    pub outcome: Result<LoadedLibrary>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadedLibrary {
    /// The file name it was opened under ("libnccl.so").
    pub file: &'static str,
    pub version: Option<String>,
}

/// Everything `zeroflow env` says about CUDA.
#[derive(Clone, Debug, PartialEq)]
pub struct CudaReport {
    /// The NVIDIA kernel driver's version ("580.82.07"), where /proc says it.
    pub kernel_driver: Option<String>,
    /// The CUDA version the driver supports ("13.0"), or why the driver cannot be used.
    pub driver: Result<String>,
    pub gpus: Result<Vec<GpuInfo>>,
    pub libraries: Vec<LibraryReport>,
}

impl CudaReport {
    /// Probes the driver and the libraries. Never panics; loads nothing that is not there.
    pub fn collect() -> Self {
        let driver = library::init_driver().and_then(|()| CudaLibrary::Driver.version());
        let gpus = match &driver {
            Ok(_) => list_gpus(),
            Err(e) => Err(e.clone()),
        };
        let libraries = CudaLibrary::ALL
            .into_iter()
            .filter(|&library| library != CudaLibrary::Driver)
            .map(|library| LibraryReport {
                library,
                outcome: library
                    .ensure_loadable()
                    .map(|file| LoadedLibrary { file, version: library.version().ok() }),
            })
            .collect();
        CudaReport { kernel_driver: kernel_driver_version(), driver, gpus, libraries }
    }

    /// True if the driver loads (GPUs may still be absent).
    pub fn has_driver(&self) -> bool {
        self.driver.is_ok()
    }
}

/// "580.82.07" from `/proc/driver/nvidia/version` (`NVRM version: NVIDIA UNIX [Open] Kernel
/// Module [for x86_64]  580.82.07  Release Build …`): the first word made of digits and dots.
fn kernel_driver_version() -> Option<String> {
    let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = text.lines().next()?;
    line.split_whitespace()
        .find(|word| word.contains('.') && word.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .map(str::to_string)
}

impl LibraryReport {
    /// One line: the file and version, or why it does not load (without the list of file names
    /// tried, which the error itself has).
    pub fn summary(&self) -> String {
        match &self.outcome {
            Ok(LoadedLibrary { file, version: Some(version) }) => format!("{file} ({version})"),
            Ok(LoadedLibrary { file, version: None }) => file.to_string(),
            Err(error) => short_reason(error),
        }
    }
}

/// A library error in one line: "not found on the library path; if it is installed, export …"
/// instead of the full list of file names tried.
pub fn short_reason(error: &DeviceError) -> String {
    match error {
        DeviceError::Library { library, reason } if reason.starts_with(library::NOT_FOUND) => {
            format!(
                "{library} {}; if it is installed, {}",
                library::NOT_FOUND,
                library::LIBRARY_PATH_FIX
            )
        }
        other => other.to_string(),
    }
}

/// True if `error` says that this machine has no CUDA driver or no GPU (as opposed to a GPU that
/// failed): CPU-only machines skip GPU work on such errors.
pub fn is_absent(error: &DeviceError) -> bool {
    match error {
        DeviceError::Library { library, reason } if *library == CudaLibrary::Driver.name() => {
            reason.starts_with(library::NOT_FOUND)
                || reason.starts_with(library::NO_DEVICE)
                || reason.contains("CUDA_ERROR_NO_DEVICE")
        }
        _ => false,
    }
}

/// True if `error` says that a CUDA library (the driver, NCCL, cuBLAS, …) is not on this
/// machine's library path, as opposed to one that loaded and failed.
pub fn is_library_missing(error: &DeviceError) -> bool {
    matches!(error, DeviceError::Library { reason, .. } if reason.starts_with(library::NOT_FOUND))
}

/// For tests and tools that need a GPU: GPU `ordinal`, or `None` after printing
/// `skipped: no CUDA device (<reason>)` where this machine has no driver or no GPU — unless
/// `ZEROFLOW_REQUIRE_GPU` is set (as on the GPU machine), which makes a missing GPU a panic.
///
/// # Panics
/// If the GPU exists but does not open, or if it is missing while `ZEROFLOW_REQUIRE_GPU` is set.
pub fn gpu_or_skip(ordinal: usize) -> Option<super::CudaDevice> {
    match super::CudaDevice::new(ordinal) {
        Ok(device) => Some(device),
        Err(error) if std::env::var_os("ZEROFLOW_REQUIRE_GPU").is_none() && is_absent(&error) => {
            println!("skipped: no CUDA device ({})", short_reason(&error));
            None
        }
        Err(error) => panic!("opening GPU {ordinal} failed: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::{bus_id_text, is_absent};
    use crate::CudaDevice;

    #[test]
    fn bus_ids_are_read_up_to_the_nul_in_lower_case() {
        let mut bytes = [0u8; 64];
        bytes[..12].copy_from_slice(b"0000:1B:00.0");
        assert_eq!(bus_id_text(&bytes), "0000:1b:00.0");
        assert_eq!(bus_id_text(b"0000:AB:01.1"), "0000:ab:01.1");
        assert_eq!(bus_id_text(&[0u8; 4]), "");
    }

    /// On a GPU machine, every GPU has a bus id of the sysfs form; elsewhere the driver is absent.
    #[test]
    fn every_gpu_has_a_pci_bus_id() {
        let count = match CudaDevice::count() {
            Ok(count) => count,
            Err(error)
                if std::env::var_os("ZEROFLOW_REQUIRE_GPU").is_none() && is_absent(&error) =>
            {
                println!("skipped: no CUDA device ({error})");
                return;
            }
            Err(error) => panic!("cuDeviceGetCount: {error}"),
        };
        for ordinal in 0..count {
            let id = CudaDevice::pci_bus_id(ordinal).unwrap();
            let parts: Vec<&str> = id.split([':', '.']).collect();
            assert_eq!(parts.len(), 4, "{id}");
            assert!(id.chars().all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.'), "{id}");
            assert_eq!(id, id.to_ascii_lowercase());
        }
        assert!(CudaDevice::pci_bus_id(count).is_err());
    }
}
