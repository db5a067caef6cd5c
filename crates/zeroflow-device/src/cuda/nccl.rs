//! `NcclComm`: the [`Comm`] contract between GPUs, through NCCL.
//!
//! Each rank owns one communicator on one [`CudaDevice`]; a collective is queued on the stream the
//! caller passes (normally the comm stream) and is ordered against the other streams by the
//! caller's events, like any other operation of the device. Counts follow NCCL: every rank passes
//! the same ranges' lengths, and a rank that calls a different collective, or the same one with a
//! different length, makes the others hang or read garbage. That cannot be checked locally; the
//! engine calls the same collectives in the same order on every rank.
//!
//! Creation:
//! - one process per GPU: rank 0 makes an [`NcclId`], sends its bytes ([`NcclId::to_bytes`]) to
//!   the other processes, and every rank calls [`NcclComm::new`] with it (the call blocks until all
//!   ranks have joined);
//! - one process driving several GPUs: [`NcclComm::group`] (`ncclCommInitAll`). A collective must
//!   then be called on every rank's communicator from inside one [`group`] call (or from one
//!   thread per rank), or the first call waits forever for the others.
//!
//! **Keep `NCCL_NVLS_ENABLE=0` in the environment on the lent H200 machines**: NVLink multicast
//! (NVLS) must stay off there. NCCL reads the variable when a communicator is created, so it has
//! to be set before the process starts (`scripts/gpu-run.sh` does); creating a communicator without
//! it logs a warning.
//!
//! libnccl is opened at run time: a missing library is a [`DeviceError::Library`] naming it and the
//! fix, never a panic. NCCL failures name the NCCL call and `ncclGetErrorString`'s text, plus
//! NCCL's own last error message where it has one.

use std::ffi::{CStr, c_int, c_void};
use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::nccl::sys;
use zeroflow_core::{DType, Element};

use super::library::CudaLibrary;
use super::{CudaBuffer, CudaDevice, CudaStream};
use crate::comm::{
    ALL_GATHER_IN_PLACE, Comm, REDUCE_IN_PLACE, REDUCE_SCATTER_IN_PLACE, ReduceOp, check_placement,
};
use crate::error::{DeviceError, Result};
use crate::host::ErrorSink;
use crate::{DeviceBuffer, check_range};

/// The environment variable that must stay `0` on the lent machines (NVLink multicast off).
pub const NVLS_ENV: &str = "NCCL_NVLS_ENABLE";

/// The rendezvous of one group of ranks (`ncclUniqueId`): made once by one rank and given to all.
#[derive(Clone, Copy)]
pub struct NcclId {
    id: sys::ncclUniqueId,
}

impl NcclId {
    /// Its size in bytes ([`NcclId::to_bytes`]).
    pub const BYTES: usize = 128;

    /// A new id (`ncclGetUniqueId`). It names a socket on this host that the ranks meet at.
    pub fn new() -> Result<Self> {
        ensure_loaded()?;
        let mut id = sys::ncclUniqueId { internal: [0; Self::BYTES] };
        // SAFETY: libnccl is loaded (checked above); the pointer is valid for one write.
        let status = unsafe { sys::ncclGetUniqueId(&mut id) };
        check(status, "ncclGetUniqueId").map_err(library_error)?;
        Ok(NcclId { id })
    }

    /// The id as bytes, to send to the other ranks' processes.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        self.id.internal.map(|c| c as u8)
    }

    /// The id from the bytes [`NcclId::to_bytes`] gave (on any rank).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let bytes: &[u8; Self::BYTES] =
            bytes.try_into().map_err(|_| DeviceError::LengthMismatch {
                what: "NcclId::from_bytes: an NCCL id has 128 bytes",
                left: bytes.len(),
                right: Self::BYTES,
            })?;
        Ok(NcclId { id: sys::ncclUniqueId { internal: bytes.map(|b| b as std::ffi::c_char) } })
    }
}

impl fmt::Debug for NcclId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head: String = self.to_bytes()[..8].iter().map(|b| format!("{b:02x}")).collect();
        write!(f, "NcclId({head}…)")
    }
}

/// One rank's NCCL communicator on one GPU. Destroyed (`ncclCommDestroy`) when dropped.
///
/// Not `Sync`: NCCL communicators must not be used from two threads at once. It may move to the
/// thread that drives its GPU.
pub struct NcclComm {
    comm: NonNull<sys::ncclComm>,
    rank: usize,
    world: usize,
    /// Keeps the GPU's context alive for as long as the communicator, and binds it for each call.
    device: CudaDevice,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (NCCL's rule); `&mut`
// is not needed for calls, but `NcclComm` is not `Sync`, so no two threads can share one.
unsafe impl Send for NcclComm {}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("gpu", &self.device.ordinal())
            .finish_non_exhaustive()
    }
}

impl NcclComm {
    /// Joins the group `id` as `rank` of `world_size` on `device` (`ncclCommInitRank`). Blocks
    /// until every rank of the group has called it, so in one process each rank needs its own
    /// thread (or use [`NcclComm::group`]).
    pub fn new(device: &CudaDevice, id: &NcclId, rank: usize, world_size: usize) -> Result<Self> {
        ensure_loaded()?;
        if world_size == 0 || rank >= world_size {
            return Err(DeviceError::Collective {
                op: "init",
                rank,
                reason: format!("rank {rank} is not a rank of a world of {world_size}"),
            });
        }
        let nranks = to_c_int(world_size, "world size")?;
        warn_if_nvls_on();
        device.inner.bind()?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: libnccl is loaded; the device's context is current, so NCCL uses this GPU; the
        // out-pointer is valid for one write; `rank < world_size` (checked).
        let status = unsafe { sys::ncclCommInitRank(&mut comm, nranks, id.id, rank as c_int) };
        check(status, "ncclCommInitRank").map_err(library_error)?;
        Self::own(comm, rank, world_size, device.clone())
    }

    /// One communicator per GPU of `devices`, rank `i` on `devices[i]`, all in this process
    /// (`ncclCommInitAll`). The GPUs must be distinct.
    pub fn group(devices: &[CudaDevice]) -> Result<Vec<NcclComm>> {
        ensure_loaded()?;
        if devices.is_empty() {
            return Ok(Vec::new());
        }
        let ordinals = devices
            .iter()
            .map(|device| to_c_int(device.ordinal(), "GPU ordinal"))
            .collect::<Result<Vec<c_int>>>()?;
        let world = devices.len();
        warn_if_nvls_on();
        devices[0].inner.bind()?;
        let mut comms = vec![std::ptr::null_mut(); world];
        // SAFETY: libnccl is loaded; `comms` has room for `world` handles and `ordinals` holds
        // `world` device numbers; NCCL sets the current device itself for each.
        let status = unsafe {
            sys::ncclCommInitAll(
                comms.as_mut_ptr(),
                to_c_int(world, "world size")?,
                ordinals.as_ptr(),
            )
        };
        check(status, "ncclCommInitAll").map_err(library_error)?;
        let mut owned = Vec::with_capacity(world);
        for (rank, (comm, device)) in comms.into_iter().zip(devices).enumerate() {
            owned.push(Self::own(comm, rank, world, device.clone())?);
        }
        Ok(owned)
    }

    fn own(comm: sys::ncclComm_t, rank: usize, world: usize, device: CudaDevice) -> Result<Self> {
        let comm = NonNull::new(comm).ok_or_else(|| DeviceError::Library {
            library: CudaLibrary::Nccl.name(),
            reason: "NCCL reported success but returned no communicator".into(),
        })?;
        Ok(NcclComm { comm, rank, world, device })
    }

    /// The GPU this rank runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The error NCCL found asynchronously (a peer gone, a network failure), if any
    /// (`ncclCommGetAsyncError`). A collective that hangs is usually explained here.
    pub fn async_error(&self) -> Result<()> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: the communicator is alive (owned); the pointer is valid for one write.
        let status = unsafe { sys::ncclCommGetAsyncError(self.comm.as_ptr(), &mut state) };
        check(status, "ncclCommGetAsyncError")
            .and_then(|()| check(state, "an earlier collective (asynchronous error)"))
            .map_err(|reason| self.collective_error("async_error", reason))
    }

    fn collective_error(&self, op: &'static str, reason: String) -> DeviceError {
        DeviceError::Collective { op, rank: self.rank, reason }
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<c_int> {
        if root < self.world {
            return Ok(root as c_int);
        }
        let reason = format!("root {root} is not a rank of a world of {}", self.world);
        Err(self.collective_error(op, reason))
    }

    /// Checks where a collective from `src[src_range]` into `dst[dst_range]` writes (see
    /// [`check_placement`]) and gives NCCL's element type.
    fn placed<T: Element>(
        &self,
        op: &'static str,
        (src, dst): (&CudaBuffer<T>, &CudaBuffer<T>),
        ranges: (&Range<usize>, &Range<usize>),
        in_place: bool,
        rule: &str,
    ) -> Result<sys::ncclDataType_t> {
        check_placement(op, self.rank, std::ptr::eq(src, dst), ranges, in_place, rule)?;
        data_type(op, self.rank, T::DTYPE)
    }

    /// Refuses a stream or buffer of another GPU than the communicator's.
    fn check_device<T: Element>(
        &self,
        op: &'static str,
        stream: &CudaStream,
        buffers: [&CudaBuffer<T>; 2],
    ) -> Result<()> {
        let ours = &self.device.inner;
        let stream_ok = Arc::ptr_eq(stream.raw().context(), &ours.ctx);
        if stream_ok && buffers.iter().all(|buffer| Arc::ptr_eq(buffer.device(), ours)) {
            return Ok(());
        }
        let what = if stream_ok { "a buffer" } else { "the stream" };
        let reason = format!(
            "{what} belongs to another GPU than this rank's (GPU {})",
            self.device.ordinal()
        );
        Err(self.collective_error(op, reason))
    }

    /// Makes the GPU's context current and runs one NCCL call, naming it in the error.
    fn call(
        &self,
        op: &'static str,
        nccl_call: &'static str,
        enqueue: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        self.device.inner.bind()?;
        check(enqueue(self.comm.as_ptr()), nccl_call)
            .map_err(|reason| self.collective_error(op, reason))
    }
}

impl Drop for NcclComm {
    /// `ncclCommDestroy`: waits for this communicator's queued work, then frees it. In NCCL 2.28
    /// that wait is local (no rendezvous with the other ranks), so the communicators of
    /// [`NcclComm::group`] can be dropped one after the other from one thread; a collective still
    /// waiting for a rank that never joins it would block here.
    fn drop(&mut self) {
        let destroyed = self.device.inner.bind().and_then(|()| {
            // SAFETY: the communicator is alive and destroyed once, here; nothing uses it after.
            let status = unsafe { sys::ncclCommDestroy(self.comm.as_ptr()) };
            check(status, "ncclCommDestroy")
                .map_err(|reason| self.collective_error("destroy", reason))
        });
        if let Err(error) = destroyed {
            self.device.inner.errors.park(error);
        }
    }
}

/// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd`, so that collectives on several
/// communicators (one process driving several GPUs) are launched together. The group is ended even
/// when `calls` fails; the first error is returned. The collectives enqueued before the failure
/// are still launched and wait on the GPU for the ranks that never joined them, so a failure here
/// is fatal to the job: call the same collective, with the same lengths, on every rank.
pub fn group<R>(calls: impl FnOnce() -> Result<R>) -> Result<R> {
    ensure_loaded()?;
    // SAFETY: libnccl is loaded; the call has no arguments.
    check(unsafe { sys::ncclGroupStart() }, "ncclGroupStart").map_err(library_error)?;
    let result = calls();
    // SAFETY: as above; it closes the group opened above.
    let ended = check(unsafe { sys::ncclGroupEnd() }, "ncclGroupEnd").map_err(library_error);
    let value = result?;
    ended?;
    Ok(value)
}

impl Comm for NcclComm {
    type Device = CudaDevice;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce<T: Element>(
        &self,
        stream: &CudaStream,
        buf: &CudaBuffer<T>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "all_reduce";
        self.check_device(OP, stream, [buf, buf])?;
        check_range(OP, &range, buf.len())?;
        let dtype = data_type(OP, self.rank, T::DTYPE)?;
        if range.is_empty() {
            return Ok(());
        }
        let at = buf.address(range.start);
        self.call(OP, "ncclAllReduce", |comm| {
            // SAFETY: the range was bounds-checked and lies in a live allocation (a buffer's drop
            // waits for every stream); in place (send == receive) is allowed; the stream belongs
            // to the communicator's GPU; ordering against other streams is the caller's events'.
            unsafe {
                sys::ncclAllReduce(
                    at as *const c_void,
                    at as *mut c_void,
                    range.len(),
                    dtype,
                    red_op(op),
                    comm,
                    stream.cu().cast(),
                )
            }
        })
    }

    fn reduce_scatter<T: Element>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<T>,
        src_range: Range<usize>,
        dst: &CudaBuffer<T>,
        dst_offset: usize,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatter";
        self.check_device(OP, stream, [src, dst])?;
        check_range(OP, &src_range, src.len())?;
        if !src_range.len().is_multiple_of(self.world) {
            return Err(DeviceError::LengthMismatch {
                what: "reduce_scatter: input length is not a multiple of the world size",
                left: src_range.len(),
                right: self.world,
            });
        }
        let n = src_range.len() / self.world;
        let dst_range = dst_offset..dst_offset + n;
        check_range(OP, &dst_range, dst.len())?;
        let in_place = dst_offset == src_range.start + self.rank * n;
        let ranges = (&src_range, &dst_range);
        let dtype = self.placed(OP, (src, dst), ranges, in_place, REDUCE_SCATTER_IN_PLACE)?;
        if n == 0 {
            return Ok(());
        }
        let (from, to) = (src.address(src_range.start), dst.address(dst_offset));
        self.call(OP, "ncclReduceScatter", |comm| {
            // SAFETY: both ranges were bounds-checked and lie in live allocations; they do not
            // overlap, or the output is this rank's chunk of the input (NCCL's in-place case);
            // `n` is the per-rank count NCCL expects; the stream belongs to this GPU.
            unsafe {
                sys::ncclReduceScatter(
                    from as *const c_void,
                    to as *mut c_void,
                    n,
                    dtype,
                    red_op(op),
                    comm,
                    stream.cu().cast(),
                )
            }
        })
    }

    fn reduce<T: Element>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<T>,
        src_range: Range<usize>,
        dst: &CudaBuffer<T>,
        dst_offset: usize,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce";
        let root_rank = self.check_root(OP, root)?;
        self.check_device(OP, stream, [src, dst])?;
        check_range(OP, &src_range, src.len())?;
        // Only the root writes (NCCL ignores the output elsewhere), so only the root's output
        // range must fit; the others' is empty, as in `CpuComm`.
        let len = if self.rank == root { src_range.len() } else { 0 };
        let dst_range = dst_offset..dst_offset + len;
        check_range(OP, &dst_range, dst.len())?;
        let in_place = dst_offset == src_range.start;
        let ranges = (&src_range, &dst_range);
        let dtype = self.placed(OP, (src, dst), ranges, in_place, REDUCE_IN_PLACE)?;
        if src_range.is_empty() {
            return Ok(());
        }
        let (from, to) = (src.address(src_range.start), dst.address(dst_offset));
        self.call(OP, "ncclReduce", |comm| {
            // SAFETY: the input was bounds-checked; on the root so was the output, which does not
            // overlap the input or is exactly it (in place); elsewhere NCCL does not touch the
            // output pointer (an address within or one past the buffer); the stream is this GPU's.
            unsafe {
                sys::ncclReduce(
                    from as *const c_void,
                    to as *mut c_void,
                    src_range.len(),
                    dtype,
                    red_op(op),
                    root_rank,
                    comm,
                    stream.cu().cast(),
                )
            }
        })
    }

    fn all_gather<T: Element>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<T>,
        src_range: Range<usize>,
        dst: &CudaBuffer<T>,
        dst_range: Range<usize>,
    ) -> Result<()> {
        const OP: &str = "all_gather";
        self.check_device(OP, stream, [src, dst])?;
        check_range(OP, &src_range, src.len())?;
        check_range(OP, &dst_range, dst.len())?;
        let n = src_range.len();
        if dst_range.len() != n * self.world {
            return Err(DeviceError::LengthMismatch {
                what: "all_gather: output length is not world size × input length",
                left: dst_range.len(),
                right: n * self.world,
            });
        }
        // ZeRO gathers the partitions in place: each rank's input is its own chunk of the output,
        // so the send pointer is `recvbuff + rank × n`, which is what NCCL's in-place form needs.
        let in_place = src_range.start == dst_range.start + self.rank * n;
        let ranges = (&src_range, &dst_range);
        let dtype = self.placed(OP, (src, dst), ranges, in_place, ALL_GATHER_IN_PLACE)?;
        if n == 0 {
            return Ok(());
        }
        let (from, to) = (src.address(src_range.start), dst.address(dst_range.start));
        self.call(OP, "ncclAllGather", |comm| {
            // SAFETY: both ranges were bounds-checked and lie in live allocations; they do not
            // overlap, or the input is this rank's chunk of the output (NCCL's in-place case);
            // `n` is the per-rank send count NCCL expects; the stream is this GPU's.
            unsafe {
                sys::ncclAllGather(
                    from as *const c_void,
                    to as *mut c_void,
                    n,
                    dtype,
                    comm,
                    stream.cu().cast(),
                )
            }
        })
    }

    fn broadcast<T: Element>(
        &self,
        stream: &CudaStream,
        buf: &CudaBuffer<T>,
        range: Range<usize>,
        root: usize,
    ) -> Result<()> {
        const OP: &str = "broadcast";
        let root_rank = self.check_root(OP, root)?;
        self.check_device(OP, stream, [buf, buf])?;
        check_range(OP, &range, buf.len())?;
        let dtype = data_type(OP, self.rank, T::DTYPE)?;
        if range.is_empty() {
            return Ok(());
        }
        let at = buf.address(range.start);
        self.call(OP, "ncclBroadcast", |comm| {
            // SAFETY: the range was bounds-checked and lies in a live allocation; in place (send
            // == receive) is allowed; the stream is this GPU's.
            unsafe {
                sys::ncclBroadcast(
                    at as *const c_void,
                    at as *mut c_void,
                    range.len(),
                    dtype,
                    root_rank,
                    comm,
                    stream.cu().cast(),
                )
            }
        })
    }
}

/// NCCL's name for an element type. Every [`Element`] type has one today; a type added later
/// without one is refused here rather than sent as the wrong type.
pub fn data_type(op: &'static str, rank: usize, dtype: DType) -> Result<sys::ncclDataType_t> {
    use sys::ncclDataType_t as Nccl;
    #[allow(unreachable_patterns, reason = "a guard for element types added later")]
    Ok(match dtype {
        DType::F32 => Nccl::ncclFloat32,
        DType::Bf16 => Nccl::ncclBfloat16,
        DType::F16 => Nccl::ncclFloat16,
        DType::I32 => Nccl::ncclInt32,
        DType::U32 => Nccl::ncclUint32,
        _ => {
            let reason = format!("NCCL has no {dtype} element type");
            return Err(DeviceError::Collective { op, rank, reason });
        }
    })
}

fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// Checks that libnccl loads before any of cudarc's NCCL functions is called (they panic
/// otherwise).
fn ensure_loaded() -> Result<()> {
    CudaLibrary::Nccl.ensure_loadable().map(drop)
}

/// `Ok` for `ncclSuccess`; otherwise `CALL failed: <ncclGetErrorString> (<code>); NCCL says:
/// <ncclGetLastError>`.
fn check(status: sys::ncclResult_t, call: &str) -> std::result::Result<(), String> {
    if status == sys::ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: libnccl is loaded (every caller made an NCCL call before); both functions return
    // NULL or a pointer to a static, NUL-terminated string.
    let (text, last) = unsafe {
        (
            c_text(sys::ncclGetErrorString(status)),
            c_text(sys::ncclGetLastError(std::ptr::null_mut())),
        )
    };
    let mut reason = format!("{call} failed: {} ({status:?})", text.as_deref().unwrap_or("?"));
    if let Some(last) = last.filter(|s| !s.is_empty()) {
        reason.push_str("; NCCL says: ");
        reason.push_str(&last);
    }
    Err(reason)
}

/// # Safety
/// `text` must be NULL or point to a NUL-terminated string that stays alive during the call.
unsafe fn c_text(text: *const std::ffi::c_char) -> Option<String> {
    // SAFETY: guaranteed by the caller.
    (!text.is_null()).then(|| unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned())
}

fn library_error(reason: String) -> DeviceError {
    DeviceError::Library { library: CudaLibrary::Nccl.name(), reason }
}

fn to_c_int(value: usize, what: &str) -> Result<c_int> {
    c_int::try_from(value).map_err(|_| DeviceError::Library {
        library: CudaLibrary::Nccl.name(),
        reason: format!("{what} {value} does not fit NCCL's int"),
    })
}

fn warn_if_nvls_on() {
    if std::env::var(NVLS_ENV).as_deref() != Ok("0") {
        tracing::warn!(
            "{NVLS_ENV} is not 0: NVLink multicast must stay off on the lent H200 machines \
             (export {NVLS_ENV}=0 before starting)"
        );
    }
}

#[cfg(test)]
mod tests {
    use zeroflow_core::DType;

    use super::{NcclId, data_type, sys};
    use crate::error::DeviceError;

    #[test]
    fn an_id_survives_its_bytes_and_wrong_lengths_are_refused() {
        let bytes: Vec<u8> = (0..NcclId::BYTES).map(|i| (i * 7 + 3) as u8).collect();
        let id = NcclId::from_bytes(&bytes).unwrap();
        assert_eq!(id.to_bytes().to_vec(), bytes);
        let refused = NcclId::from_bytes(&bytes[1..]);
        assert!(
            matches!(refused, Err(DeviceError::LengthMismatch { left: 127, .. })),
            "{refused:?}"
        );
    }

    #[test]
    fn every_element_type_has_its_nccl_type() {
        use sys::ncclDataType_t as Nccl;
        let types = [DType::F32, DType::Bf16, DType::F16, DType::I32, DType::U32]
            .map(|dtype| data_type("test", 0, dtype).unwrap());
        let expected = [
            Nccl::ncclFloat32,
            Nccl::ncclBfloat16,
            Nccl::ncclFloat16,
            Nccl::ncclInt32,
            Nccl::ncclUint32,
        ];
        assert_eq!(types, expected);
    }
}
