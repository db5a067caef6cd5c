//! Finding the CUDA libraries at run time, without panicking.
//!
//! cudarc (with `dynamic-loading`) opens each library the first time one of its functions is
//! called, and panics if none of its candidate file names loads, or if a symbol is missing. So
//! before anything of cudarc is called, this module opens the library itself with `libloading`,
//! under the same candidate names, and turns a failure into [`DeviceError::Library`] naming the
//! library, the names tried and the fix. It also checks that the driver is new enough for the
//! CUDA 13.0 bindings, so that no symbol of those bindings is missing.

use std::sync::OnceLock;

use cudarc::driver::{result as cu, sys as cu_sys};

use crate::error::{DeviceError, Result};

/// What to do when a library is not found.
pub const LIBRARY_PATH_FIX: &str = "export \
     LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH";

/// How a [`DeviceError::Library`] reason starts when no file of the library loads.
pub(crate) const NOT_FOUND: &str = "not found on the library path";

/// How the reason starts when the driver sees fewer GPUs than asked for.
pub(crate) const NO_DEVICE: &str = "no CUDA device";

/// The oldest driver API version the bindings are generated for (CUDA 13.0).
const REQUIRED_DRIVER_VERSION: i32 = 13000;

/// A CUDA library zeroflow uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// `libcuda`, the driver: GPUs, memory, streams, events, copies.
    Driver,
    /// `libnvrtc`, the run-time compiler of the kernels.
    Nvrtc,
    /// `libcublasLt`, the matrix multiplications.
    CublasLt,
    /// `libnccl`, the collectives between GPUs.
    Nccl,
}

impl CudaLibrary {
    pub const ALL: [CudaLibrary; 4] =
        [CudaLibrary::Driver, CudaLibrary::Nvrtc, CudaLibrary::CublasLt, CudaLibrary::Nccl];

    /// The name reports use ("libcuda", "libnccl", …).
    pub const fn name(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "libcuda",
            CudaLibrary::Nvrtc => "libnvrtc",
            CudaLibrary::CublasLt => "libcublasLt",
            CudaLibrary::Nccl => "libnccl",
        }
    }

    /// The stem cudarc builds its candidate file names from.
    const fn stem(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "cuda",
            CudaLibrary::Nvrtc => "nvrtc",
            CudaLibrary::CublasLt => "cublasLt",
            CudaLibrary::Nccl => "nccl",
        }
    }

    /// The file names cudarc tries, in its order.
    pub fn candidates(self) -> Vec<String> {
        cudarc::get_lib_name_candidates(self.stem())
    }

    /// Checks (once per process) that cudarc will be able to open the library, and returns the
    /// file name it will open.
    pub fn ensure_loadable(self) -> Result<&'static str> {
        static FOUND: [OnceLock<Result<String>>; 4] =
            [OnceLock::new(), OnceLock::new(), OnceLock::new(), OnceLock::new()];
        FOUND[self as usize].get_or_init(|| probe(self)).as_deref().map_err(Clone::clone)
    }

    /// The library's version, loading it if needed (a short string such as "13.0" or "2.28.3").
    pub fn version(self) -> Result<String> {
        self.ensure_loadable()?;
        match self {
            CudaLibrary::Driver => {
                driver_version().map(|v| format!("{}.{}", v / 1000, v % 1000 / 10))
            }
            CudaLibrary::Nvrtc => nvrtc_version(),
            CudaLibrary::CublasLt => Ok(cublaslt_version()),
            CudaLibrary::Nccl => nccl_version(),
        }
    }
}

/// Opens the library under cudarc's candidate names, first to last, and returns the first that
/// loads: the one cudarc will open.
fn probe(library: CudaLibrary) -> Result<String> {
    let candidates = library.candidates();
    // Errors other than "no such file" say something (a wrong architecture, a missing dependency).
    let mut errors = Vec::new();
    for name in &candidates {
        // SAFETY: loading a CUDA library runs its initialisers, which have no preconditions; no
        // symbol of it is called here.
        match unsafe { libloading::Library::new(name) } {
            Ok(handle) => {
                // Kept loaded for the life of the process: cudarc opens it again by the same
                // name, and some CUDA libraries do not like being unloaded and loaded again.
                std::mem::forget(handle);
                return Ok(name.clone());
            }
            Err(e) => {
                let detail = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                if !detail.contains("No such file") {
                    errors.push(detail);
                }
            }
        }
    }
    let unique: Vec<&str> = dedup(&candidates);
    let mut reason = format!(
        "{NOT_FOUND} (tried {}{}); if it is installed, {LIBRARY_PATH_FIX}",
        unique.join(", "),
        if errors.is_empty() { String::new() } else { format!("; errors: {}", errors.join("; ")) }
    );
    if library == CudaLibrary::Nccl {
        // NCCL packages ship `libnccl.so.2`; the unversioned name comes with the -dev package.
        // cudarc opens libraries by name only, so `libnccl.so.2` alone cannot be used: say how
        // to provide the name it looks for.
        // SAFETY: as above.
        if unsafe { libloading::Library::new("libnccl.so.2") }.is_ok() {
            reason = format!(
                "libnccl.so.2 is installed but cudarc opens `libnccl.so`, which is not: link it \
                 under that name into a folder on the library path (`mkdir -p ~/.local/lib && ln \
                 -sf /usr/lib/x86_64-linux-gnu/libnccl.so.2 ~/.local/lib/libnccl.so`, adjusting \
                 the path to where libnccl.so.2 is) and `export \
                 LD_LIBRARY_PATH=~/.local/lib:$LD_LIBRARY_PATH`; tried {}",
                unique.join(", ")
            );
        }
    }
    Err(DeviceError::Library { library: library.name(), reason })
}

fn dedup(names: &[String]) -> Vec<&str> {
    let mut unique: Vec<&str> = Vec::with_capacity(names.len());
    for name in names {
        if !unique.contains(&name.as_str()) {
            unique.push(name);
        }
    }
    unique
}

/// Loads the driver, checks that it is new enough for the bindings and initialises it.
pub(crate) fn init_driver() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        CudaLibrary::Driver.ensure_loadable()?;
        let version = driver_version()?;
        if version < REQUIRED_DRIVER_VERSION {
            return Err(DeviceError::Library {
                library: CudaLibrary::Driver.name(),
                reason: format!(
                    "the driver supports CUDA {}.{}, zeroflow needs 13.0 or newer: update the \
                     NVIDIA driver",
                    version / 1000,
                    version % 1000 / 10
                ),
            });
        }
        cu::init().map_err(|e| driver_error("cuInit", e))
    })
    .clone()
}

/// The driver's CUDA version as 1000 × major + 10 × minor. `cuDriverGetVersion` exists in every
/// driver and may be called before `cuInit`.
fn driver_version() -> Result<i32> {
    let mut version = 0;
    // SAFETY: the library is loadable (checked by the callers); the pointer is valid for a write.
    let status = unsafe { cu_sys::cuDriverGetVersion(&mut version) };
    status.result().map_err(|e| driver_error("cuDriverGetVersion", e))?;
    Ok(version)
}

fn nvrtc_version() -> Result<String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loadable; both pointers are valid for a write.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(DeviceError::Library {
            library: CudaLibrary::Nvrtc.name(),
            reason: format!("nvrtcVersion failed: {status:?}"),
        });
    }
    Ok(format!("{major}.{minor}"))
}

fn cublaslt_version() -> String {
    // SAFETY: libcublasLt is loadable; the call has no arguments and no preconditions.
    let version = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
    format!("{}.{}.{}", version / 10000, version % 10000 / 100, version % 100)
}

fn nccl_version() -> Result<String> {
    let mut version = 0;
    // SAFETY: libnccl is loadable; the pointer is valid for a write.
    let status = unsafe { cudarc::nccl::sys::ncclGetVersion(&mut version) };
    if status != cudarc::nccl::sys::ncclResult_t::ncclSuccess {
        return Err(DeviceError::Library {
            library: CudaLibrary::Nccl.name(),
            reason: format!("ncclGetVersion failed: {status:?}"),
        });
    }
    Ok(format!("{}.{}.{}", version / 10000, version % 10000 / 100, version % 100))
}

/// A driver call's failure as a device error. Out-of-memory keeps its own variant.
pub(crate) fn driver_error(call: &'static str, error: cu::DriverError) -> DeviceError {
    let name = error.error_name().map(|s| s.to_string_lossy().into_owned());
    let text = error.error_string().map(|s| s.to_string_lossy().into_owned());
    let reason = match (name, text) {
        (Ok(name), Ok(text)) => format!("{call} failed: {name} ({text})"),
        _ => format!("{call} failed: {:?}", error.0),
    };
    DeviceError::Library { library: CudaLibrary::Driver.name(), reason }
}
