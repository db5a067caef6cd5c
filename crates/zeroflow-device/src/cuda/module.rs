//! Kernel modules: CUDA C compiled by NVRTC for the GPU's architecture, cached on disk, loaded into
//! the device's context, and launched on its streams.
//!
//! Every source is compiled after [`PRELUDE`] (zeroflow's own bf16/f16 conversions: the kernels
//! include no CUDA header, so no toolkit include folder is needed at run time). The cubin is cached
//! under the device's cache folder ([`super::CudaDeviceOptions::kernel_cache`], by default
//! [`default_cache_dir`]) in a file named by a hash of everything that changes the result — the
//! prelude, the source, the options, the architecture, and the NVRTC and driver versions — and
//! whose first line spells that key out again, so that a collision or a truncated file is a miss,
//! never a wrong module. A cache that cannot be read or written is a warning, not an error.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::driver::{self as driver, sys as cu_sys};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use zeroflow_core::Element;

use super::library::{CudaLibrary, driver_error};
use super::{CudaBuffer, CudaDevice, CudaStream, DeviceSlice, DeviceSliceMut};
use crate::error::{DeviceError, Result};

/// The source every module is compiled after.
pub const PRELUDE: &str = include_str!("../../kernels/prelude.cuh");

/// The options every module is compiled with (besides `-arch`).
const BASE_OPTIONS: [&str; 3] = ["--std=c++17", "-default-device", "-lineinfo"];

/// Where compiled kernels are cached unless the device's options say otherwise (the binary's
/// `ZEROFLOW_KERNEL_CACHE`): `$XDG_CACHE_HOME/zeroflow/kernels`, else `~/.cache/zeroflow/kernels`.
/// `None` when neither can be named (no home): kernels are then compiled every run.
pub fn default_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache")))?;
    Some(base.join("zeroflow").join("kernels"))
}

/// Whether `cubin`'s symbol table holds `name` (as a whole NUL-terminated string).
pub fn exports(cubin: &[u8], name: &str) -> bool {
    let needle: Vec<u8> = name.bytes().chain([0]).collect();
    cubin.windows(needle.len()).any(|window| window == needle)
}

/// The architectures a module was compiled for by [`compile_for_tests`], each with its cubin's
/// size in bytes.
pub type CompiledSizes = Vec<((i32, i32), usize)>;

/// For the compile tests, which run without a GPU: compiles `source` as module `name` for sm_80
/// and sm_90 and checks that each cubin exports every name of `kernels`, and not `absent` (a name
/// that does not exist, the check's own check; empty: not checked). Returns each architecture with
/// its cubin's size, `Ok(None)` where libnvrtc does not load (after printing `skipped: libnvrtc
/// not found`), or what failed.
pub fn compile_for_tests(
    name: &str,
    source: &str,
    kernels: &[String],
    absent: &str,
) -> std::result::Result<Option<CompiledSizes>, String> {
    let mut compiled = Vec::new();
    for arch in [(8, 0), (9, 0)] {
        let cubin = match compile(name, source, arch, &[]) {
            Ok(cubin) => cubin,
            Err(DeviceError::Library { library, reason })
                if library == CudaLibrary::Nvrtc.name() =>
            {
                println!("skipped: libnvrtc not found ({reason})");
                return Ok(None);
            }
            Err(error) => return Err(format!("{name} for sm_{}{}: {error}", arch.0, arch.1)),
        };
        let missing: Vec<&String> = kernels.iter().filter(|k| !exports(&cubin, k)).collect();
        if !missing.is_empty() {
            return Err(format!("sm_{}{}: {name} does not export {missing:?}", arch.0, arch.1));
        }
        if !absent.is_empty() && exports(&cubin, absent) {
            return Err(format!("the symbol check finds {absent:?}, which does not exist"));
        }
        compiled.push((arch, cubin.len()));
    }
    Ok(Some(compiled))
}

/// Compiles `source` (after the prelude) with NVRTC into a cubin for `sm_{major}{minor}`.
/// `name` names the module in errors. Needs only libnvrtc, not a GPU.
pub fn compile(name: &str, source: &str, arch: (i32, i32), options: &[&str]) -> Result<Vec<u8>> {
    CudaLibrary::Nvrtc.ensure_loadable()?;
    let arch_name = format!("sm_{}{}", arch.0, arch.1);
    let full = format!("{PRELUDE}\n#line 1 \"{name}\"\n{source}");
    let nul = |what: &str| DeviceError::Compile {
        module: name.into(),
        arch: arch_name.clone(),
        log: format!("the {what} contains a NUL byte"),
    };
    let c_source = CString::new(full).map_err(|_| nul("source"))?;
    let c_name = CString::new(format!("{name}.cu")).map_err(|_| nul("name"))?;
    let mut all_options: Vec<String> = vec![format!("-arch={arch_name}")];
    all_options.extend(BASE_OPTIONS.iter().map(|o| (*o).to_string()));
    all_options.extend(options.iter().map(|o| (*o).to_string()));
    let nvrtc_failed = |call: &str, e: nvrtc::NvrtcError| DeviceError::Library {
        library: CudaLibrary::Nvrtc.name(),
        reason: format!("{call} failed: {e:?}"),
    };
    let program = nvrtc::create_program(&c_source, Some(&c_name))
        .map_err(|e| nvrtc_failed("nvrtcCreateProgram", e))?;
    let program = Program(program);
    // SAFETY: the program is alive; the options are plain strings.
    let compiled = unsafe { nvrtc::compile_program(program.0, &all_options) };
    if compiled.is_err() {
        // SAFETY: the program is alive.
        let log = unsafe { nvrtc::get_program_log(program.0) }
            .map(|chars| {
                let bytes: Vec<u8> =
                    chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_else(|e| format!("(no log: {e:?})"));
        return Err(DeviceError::Compile { module: name.into(), arch: arch_name, log });
    }
    let mut size = 0usize;
    // SAFETY: the program compiled; the pointer is valid for a write.
    let status = unsafe { nvrtc_sys::nvrtcGetCUBINSize(program.0, &mut size) };
    nvrtc_ok(status, "nvrtcGetCUBINSize")?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the size NVRTC asked for.
    let status = unsafe { nvrtc_sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast()) };
    nvrtc_ok(status, "nvrtcGetCUBIN")?;
    Ok(cubin)
}

/// An NVRTC program, destroyed on drop.
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once, here.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn nvrtc_ok(status: nvrtc_sys::nvrtcResult, call: &str) -> Result<()> {
    if status == nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Library {
            library: CudaLibrary::Nvrtc.name(),
            reason: format!("{call} failed: {status:?}"),
        })
    }
}

/// The NVRTC and driver versions, part of every cache key (asked once per process).
fn versions() -> Result<&'static str> {
    static VERSIONS: std::sync::OnceLock<Result<String>> = std::sync::OnceLock::new();
    VERSIONS
        .get_or_init(|| {
            let (nvrtc, driver) = (CudaLibrary::Nvrtc.version()?, CudaLibrary::Driver.version()?);
            Ok(format!("nvrtc {nvrtc} driver {driver}"))
        })
        .as_deref()
        .map_err(Clone::clone)
}

/// What decides a compiled module: the text on the first line of its cache file.
fn cache_key(source: &str, arch: (i32, i32), options: &[&str], versions: &str) -> String {
    let mut hash = Fnv::default();
    for part in [PRELUDE, source] {
        hash.write(part.as_bytes());
        hash.write(&[0xff]);
    }
    format!(
        "zeroflow-kernel v1 sm_{}{} [{}] [{}] {versions} source {:016x}{:016x}",
        arch.0,
        arch.1,
        BASE_OPTIONS.join(" "),
        options.join(" "),
        hash.a,
        hash.b
    )
}

/// Two independent 64-bit FNV-1a hashes (a cache name, not a security boundary: the key line in
/// the file is compared in full).
struct Fnv {
    a: u64,
    b: u64,
}

impl Default for Fnv {
    fn default() -> Self {
        Fnv { a: 0xcbf2_9ce4_8422_2325, b: 0x6c62_272e_07bb_0142 }
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.a = (self.a ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
            self.b = (self.b ^ u64::from(byte.rotate_left(3))).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    fn hex(key: &str) -> String {
        let mut hash = Fnv::default();
        hash.write(key.as_bytes());
        format!("{:016x}{:016x}", hash.a, hash.b)
    }
}

/// Reads a cached cubin whose key line is `key`.
fn read_cached(path: &Path, key: &str) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    let newline = bytes.iter().position(|&b| b == b'\n')?;
    (bytes[..newline] == *key.as_bytes() && newline + 1 < bytes.len())
        .then(|| bytes[newline + 1..].to_vec())
}

/// Writes a cache file atomically (a temporary file renamed into place).
fn write_cached(dir: &Path, path: &Path, key: &str, cubin: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let temporary = path.with_extension(format!("tmp{}", std::process::id()));
    let mut contents = Vec::with_capacity(key.len() + 1 + cubin.len());
    contents.extend_from_slice(key.as_bytes());
    contents.push(b'\n');
    contents.extend_from_slice(cubin);
    std::fs::write(&temporary, contents)?;
    std::fs::rename(&temporary, path)
}

/// A compiled module loaded into a device's context.
pub struct CudaModule {
    name: String,
    module: Arc<driver::CudaModule>,
}

impl fmt::Debug for CudaModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaModule({})", self.name)
    }
}

impl CudaModule {
    /// The kernel `name` (declared `extern "C" __global__` in the source).
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        let function = self.module.load_function(name).map_err(|e| DeviceError::Kernel {
            kernel: "module",
            reason: format!("module `{}` has no kernel `{name}`: {e}", self.name),
        })?;
        Ok(CudaFunction { name: format!("{}::{name}", self.name), function })
    }
}

/// A kernel of a loaded module.
#[derive(Clone)]
pub struct CudaFunction {
    name: String,
    function: driver::CudaFunction,
}

impl fmt::Debug for CudaFunction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaFunction({})", self.name)
    }
}

impl CudaFunction {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many blocks of `block_threads` threads, each with `shared_bytes` of dynamic shared
    /// memory, one SM runs at once (the size of a grid that fills the GPU in one wave is this
    /// times the SM count). The device's context must be current.
    pub fn max_active_blocks_per_sm(&self, block_threads: u32, shared_bytes: usize) -> Result<u32> {
        self.function
            .occupancy_max_active_blocks_per_multiprocessor(block_threads, shared_bytes, None)
            .map_err(|e| driver_error("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))
    }

    /// Allows the kernel up to `bytes` of dynamic shared memory (needed above 48 KiB).
    pub fn set_max_dynamic_shared(&self, bytes: u32) -> Result<()> {
        let attribute =
            cu_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: the function is alive (owned by a live module).
        unsafe {
            cu_sys::cuFuncSetAttribute(self.function.cu_function(), attribute, bytes as i32)
                .result()
                .map_err(|e| driver_error("cuFuncSetAttribute", e))
        }
    }
}

/// Grid or block dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dim3 {
    pub x: u32,
    pub y: u32,
    pub z: u32,
}

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Dim3 { x, y: 1, z: 1 }
    }
}

impl From<(u32, u32)> for Dim3 {
    fn from((x, y): (u32, u32)) -> Self {
        Dim3 { x, y, z: 1 }
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Dim3 { x, y, z }
    }
}

/// The most parameters one kernel takes.
const MAX_PARAMS: usize = 32;

/// The arguments of one launch, in the kernel's parameter order. Each is stored in an 8-byte slot
/// (every parameter type zeroflow's kernels take fits one), inline: building and launching them
/// allocates nothing, so launches in the training loop stay allocation-free.
#[derive(Clone, Debug, Default)]
pub struct KernelParams {
    slots: [u64; MAX_PARAMS],
    len: usize,
    /// More than [`MAX_PARAMS`] were pushed: the launch refuses.
    overflow: bool,
}

impl KernelParams {
    pub fn new() -> Self {
        KernelParams::default()
    }

    fn push(mut self, value: u64) -> Self {
        match self.slots.get_mut(self.len) {
            Some(slot) => {
                *slot = value;
                self.len += 1;
            }
            None => self.overflow = true,
        }
        self
    }

    /// A pointer to element `index` of `buffer` (`T*` in the kernel).
    #[must_use]
    pub fn ptr<T: Element>(self, buffer: &CudaBuffer<T>, index: usize) -> Self {
        self.raw_ptr(buffer.address(index))
    }

    /// A slice the kernel reads (`const T*` in the kernel, pointing at the slice's first element).
    #[must_use]
    pub fn slice<T: Element>(self, slice: DeviceSlice<'_, T>) -> Self {
        self.raw_ptr(slice.address())
    }

    /// A slice the kernel writes (`T*` in the kernel, pointing at the slice's first element).
    #[must_use]
    pub fn slice_mut<T: Element>(self, slice: DeviceSliceMut<'_, T>) -> Self {
        self.raw_ptr(slice.address())
    }

    /// A raw device address.
    #[must_use]
    pub fn raw_ptr(self, address: cu_sys::CUdeviceptr) -> Self {
        self.push(address)
    }

    #[must_use]
    pub fn u32(self, value: u32) -> Self {
        self.push(u64::from(value))
    }

    #[must_use]
    pub fn i32(self, value: i32) -> Self {
        self.push(u64::from(value as u32))
    }

    #[must_use]
    pub fn u64(self, value: u64) -> Self {
        self.push(value)
    }

    #[must_use]
    pub fn i64(self, value: i64) -> Self {
        self.push(value as u64)
    }

    #[must_use]
    pub fn f32(self, value: f32) -> Self {
        self.push(u64::from(value.to_bits()))
    }

    #[must_use]
    pub fn f64(self, value: f64) -> Self {
        self.push(value.to_bits())
    }
}

/// The modules a device has loaded, by name and key.
#[derive(Default)]
pub(super) struct ModuleCache(Mutex<HashMap<String, Arc<CudaModule>>>);

impl fmt::Debug for ModuleCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ModuleCache")
    }
}

impl CudaDevice {
    /// Compiles `source` for this GPU (or takes it from the disk cache), loads it into the
    /// device's context and returns it. Loading the same source twice returns the same module.
    pub fn load_module(&self, name: &str, source: &str) -> Result<Arc<CudaModule>> {
        self.load_module_with(name, source, &[])
    }

    /// [`load_module`](Self::load_module) with extra NVRTC options (for example
    /// `-DBLOCK=256` or `--use_fast_math`).
    pub fn load_module_with(
        &self,
        name: &str,
        source: &str,
        options: &[&str],
    ) -> Result<Arc<CudaModule>> {
        let arch = self.compute_capability();
        let key = cache_key(source, arch, options, versions()?);
        let memo = format!("{name}\n{key}");
        let loaded = &self.inner.modules;
        if let Some(module) = loaded.0.lock().unwrap_or_else(|e| e.into_inner()).get(&memo) {
            return Ok(module.clone());
        }
        let cubin = self.cubin(name, source, arch, options, &key)?;
        self.inner.bind()?;
        let module = self
            .inner
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| driver_error("cuModuleLoadData", e))?;
        let module = Arc::new(CudaModule { name: name.into(), module });
        loaded.0.lock().unwrap_or_else(|e| e.into_inner()).insert(memo, module.clone());
        Ok(module)
    }

    /// The cubin of a module: from the disk cache, or compiled and then cached.
    fn cubin(
        &self,
        name: &str,
        source: &str,
        arch: (i32, i32),
        options: &[&str],
        key: &str,
    ) -> Result<Vec<u8>> {
        let Some(dir) = self.inner.kernel_cache.as_deref() else {
            return compile(name, source, arch, options);
        };
        let path = dir.join(format!("{name}-{}.cubin", Fnv::hex(key)));
        if let Some(cubin) = read_cached(&path, key) {
            tracing::debug!(module = name, path = %path.display(), "kernel cache hit");
            return Ok(cubin);
        }
        let started = std::time::Instant::now();
        let cubin = compile(name, source, arch, options)?;
        tracing::debug!(module = name, seconds = started.elapsed().as_secs_f64(), "compiled");
        if let Err(e) = write_cached(dir, &path, key, &cubin) {
            tracing::warn!(
                module = name,
                path = %path.display(),
                error = %e,
                "could not write the kernel cache (kernels will be compiled again next run; set \
                 ZEROFLOW_KERNEL_CACHE to a writable folder)"
            );
        }
        Ok(cubin)
    }

    /// Queues `function` on `stream`.
    ///
    /// # Safety
    /// `params` must match the kernel's parameters in number, order and type; every pointer
    /// must address memory the kernel may access for every index it will touch with this grid;
    /// and the memory must be ordered against other streams by the caller's events.
    pub unsafe fn launch(
        &self,
        stream: &CudaStream,
        function: &CudaFunction,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_bytes: u32,
        params: &KernelParams,
    ) -> Result<()> {
        let (grid, block) = (grid.into(), block.into());
        if grid.x == 0 || grid.y == 0 || grid.z == 0 {
            return Ok(());
        }
        if params.overflow {
            return Err(DeviceError::Kernel {
                kernel: "launch",
                reason: format!("{} takes more than {MAX_PARAMS} parameters", function.name),
            });
        }
        self.inner.bind()?;
        let mut slots = params.slots;
        let mut pointers = [std::ptr::null_mut::<c_void>(); MAX_PARAMS];
        for (pointer, slot) in pointers.iter_mut().zip(&mut slots[..params.len]) {
            *pointer = std::ptr::from_mut(slot).cast();
        }
        // SAFETY: the context is current; the caller vouches for the parameters (see above); the
        // parameter storage outlives the call, which copies it.
        unsafe {
            driver::result::launch_kernel(
                function.function.cu_function(),
                (grid.x, grid.y, grid.z),
                (block.x, block.y, block.z),
                shared_bytes,
                stream.cu(),
                &mut pointers[..params.len],
            )
        }
        .map_err(|e| DeviceError::Kernel {
            kernel: "launch",
            reason: format!("{} failed to launch: {e}", function.name),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_params_fill_slots_in_order_and_flag_too_many() {
        let params = KernelParams::new().u32(7).i32(-1).f32(1.5).u64(u64::MAX);
        assert_eq!(params.len, 4);
        assert_eq!(
            params.slots[..4],
            [7, u64::from(u32::MAX), u64::from(1.5f32.to_bits()), u64::MAX]
        );
        assert!(!params.overflow);
        let full = (0..MAX_PARAMS as u64).fold(KernelParams::new(), KernelParams::u64);
        assert!(!full.overflow);
        assert!(full.u64(0).overflow, "one more than the slots is refused at launch");
    }

    #[test]
    fn cache_key_changes_with_everything_that_changes_the_cubin() {
        let base = cache_key("a", (9, 0), &[], "nvrtc 13.0 driver 13.0");
        assert_ne!(base, cache_key("b", (9, 0), &[], "nvrtc 13.0 driver 13.0"));
        assert_ne!(base, cache_key("a", (8, 0), &[], "nvrtc 13.0 driver 13.0"));
        assert_ne!(base, cache_key("a", (9, 0), &["-DX"], "nvrtc 13.0 driver 13.0"));
        assert_ne!(base, cache_key("a", (9, 0), &[], "nvrtc 13.1 driver 13.0"));
        assert_eq!(base, cache_key("a", (9, 0), &[], "nvrtc 13.0 driver 13.0"));
    }

    #[test]
    fn cache_file_with_another_key_or_truncated_is_a_miss() {
        let dir = std::env::temp_dir().join(format!("zeroflow-kcache-{}", std::process::id()));
        let path = dir.join("m.cubin");
        write_cached(&dir, &path, "key one", b"\x7fELF cubin").unwrap();
        assert_eq!(read_cached(&path, "key one").as_deref(), Some(&b"\x7fELF cubin"[..]));
        assert_eq!(read_cached(&path, "key two"), None);
        std::fs::write(&path, b"key one\n").unwrap();
        assert_eq!(read_cached(&path, "key one"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
