//! Checkpoints (DESIGN.md §7): a directory written atomically — a temporary directory beside
//! it, every file fsynced, then one rename — holding
//!
//! - `state.json`: format and version, counters, the loss scaler, the layout, and whatever the
//!   trainer adds (`extra`: config, data position, RNG, schedule);
//! - `model.safetensors`: the weights as named tensors (Hugging Face names for the GPT model);
//! - `optim/rank-R.safetensors`: `master` (F32), `exp_avg`, `exp_avg_sq` (F32, or BF16 for a run
//!   with bf16 moments; `state.json` names the dtype too) of one flat range, with the
//!   range in the metadata, so a checkpoint saved at one world size resumes at another; for a
//!   ZenFlow run also `zenflow.window_grads` (the window's gradient sums of the same range)
//!   and, as JSON in the metadata key `zenflow`, the selection and the window's position.
//!
//! A checkpoint is never written over an existing directory, and a truncated or foreign one is a
//! typed error naming the file.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::{DType, Element, Float, bf16, f16};
use zeroflow_hf::direct::{self, FileOut};
use zeroflow_hf::{HfError, SafetensorsFile};

use crate::{LossScaler, OptimizerPart, ZenFlowSnapshot};

pub const FORMAT: &str = "zeroflow-checkpoint";
pub const VERSION: u32 = 1;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}: already exists; a checkpoint is never written over another")]
    AlreadyExists(PathBuf),
    #[error("{path}: not a zeroflow checkpoint ({reason})")]
    Foreign { path: PathBuf, reason: String },
    #[error("{path}: damaged ({reason}); use an earlier checkpoint")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}: does not fit this run ({reason})")]
    Mismatch { path: PathBuf, reason: String },
    /// What a checkpoint was being written from failed (a device's download, say).
    #[error("{path}: cannot read what it is written from: {reason}")]
    Source { path: PathBuf, reason: String },
    /// The checkpoint would not fit the free space of its file system: nothing was written.
    #[error(
        "{path}: not enough disk space for this checkpoint: it takes {} (the weights, the fp32 \
         master weights and the optimizer moments), and {} are free there; free some space or \
         start the run with --out on a larger disk (nothing was written; the run's metrics and \
         earlier checkpoints are kept)",
        disk_size(*needed),
        disk_size(*free)
    )]
    NoSpace { path: PathBuf, needed: u64, free: u64 },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

/// A tensor of the model: a name, a shape, and where its elements are in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub flat: Range<usize>,
}

/// One parameter of the saved layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

/// The contents of `state.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub format: String,
    pub version: u32,
    pub optimizer_steps: u64,
    pub micro_steps: u64,
    pub world_size: usize,
    pub scaler: LossScaler,
    /// The delayed update's optimizer weights are newer than the saved model weights.
    #[serde(default)]
    pub upload_pending: bool,
    /// The element type of `model.safetensors` (`F32`, `BF16`, `F16`).
    pub weights_dtype: String,
    /// The element type of the optimizer parts' moments, `fp32` or `bf16` (absent in older
    /// checkpoints, which are fp32).
    #[serde(default = "fp32_name")]
    pub optimizer_state_dtype: String,
    pub params: Vec<ParamEntry>,
    /// The trainer's own state.
    pub extra: serde_json::Value,
}

fn fp32_name() -> String {
    OptimizerStateDtype::Fp32.name().to_string()
}

/// Element types that checkpoints store bit for bit.
pub trait Stored: Element + bytemuck::Pod {
    const SAFETENSORS: Dtype;
    fn put(self, out: &mut Vec<u8>);
    fn get(bytes: &[u8]) -> Self;
}

/// `values` as the little-endian bytes a safetensors file holds: borrowed where the host's byte
/// order is the file's, so that writing a tensor copies nothing.
fn le_bytes<T: Stored>(values: &[T]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(values))
    } else {
        Cow::Owned(to_bytes(values))
    }
}

/// `values` widened to f32 (exact for every [`Stored`] type), as little-endian bytes.
fn widened_bytes<T: Stored>(values: &[T]) -> Cow<'_, [u8]> {
    if T::SAFETENSORS == Dtype::F32 {
        return le_bytes(values);
    }
    let mut out = Vec::with_capacity(values.len() * 4);
    values.iter().for_each(|v| (v.to_f64() as f32).put(&mut out));
    Cow::Owned(out)
}

impl Stored for f32 {
    const SAFETENSORS: Dtype = Dtype::F32;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        f32::from_le_bytes(bytes.try_into().expect("4 bytes"))
    }
}

impl Stored for bf16 {
    const SAFETENSORS: Dtype = Dtype::BF16;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        bf16::from_bits(u16::from_le_bytes(bytes.try_into().expect("2 bytes")))
    }
}

impl Stored for f16 {
    const SAFETENSORS: Dtype = Dtype::F16;
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_bits().to_le_bytes());
    }
    fn get(bytes: &[u8]) -> Self {
        f16::from_bits(u16::from_le_bytes(bytes.try_into().expect("2 bytes")))
    }
}

fn to_bytes<T: Stored>(values: &[T]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * T::DTYPE.size());
    values.iter().for_each(|v| v.put(&mut out));
    out
}

fn from_bytes<T: Stored>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(T::DTYPE.size()).map(T::get).collect()
}

/// Writes a checkpoint into the new directory `dir`, atomically.
pub fn save<P: Stored>(
    dir: &Path,
    meta: &Meta,
    weights: &[P],
    tensors: &[NamedTensor],
    parts: &[OptimizerPart],
) -> Result<(), CheckpointError> {
    save_with_zenflow(dir, meta, weights, tensors, parts, &[])
}

/// [`save`] for a ZenFlow run: `zenflow[r]` is saved with `parts[r]` (empty: no ZenFlow state).
pub fn save_with_zenflow<P: Stored>(
    dir: &Path,
    meta: &Meta,
    weights: &[P],
    tensors: &[NamedTensor],
    parts: &[OptimizerPart],
    zenflow: &[ZenFlowSnapshot],
) -> Result<(), CheckpointError> {
    let views: Vec<PartView<'_>> =
        parts.iter().enumerate().map(|(rank, part)| part.view(zenflow.get(rank))).collect();
    save_views(dir, meta, &Elements::Lent(Cow::Borrowed(weights)), tensors, &views)
}

/// [`save_with_zenflow`] of state lent or fetched from where it lives ([`Elements`]): every
/// file is written a piece at a time, so saving holds at most one piece of
/// [`WRITE_CHUNK_BYTES`] beside what it is lent. `weights` are stored as `meta.weights_dtype`
/// says: as they are, or widened to F32.
pub fn save_views<P: Stored>(
    dir: &Path,
    meta: &Meta,
    weights: &Elements<'_, P>,
    tensors: &[NamedTensor],
    parts: &[PartView<'_>],
) -> Result<(), CheckpointError> {
    if dir.exists() {
        return Err(CheckpointError::AlreadyExists(dir.to_path_buf()));
    }
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("checkpoint");
    let temp = dir.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    if temp.exists() {
        fs::remove_dir_all(&temp).map_err(io(&temp))?;
    }
    let parent = dir.parent().unwrap_or(Path::new("."));
    let needed = model_bytes::<P>(meta, tensors) + parts.iter().map(PartView::bytes).sum::<u64>();
    space_for(dir, needed)?;
    let written = (|| {
        fs::create_dir_all(temp.join("optim")).map_err(io(&temp))?;
        write_state(&temp.join("state.json"), meta)?;
        write_model(&temp.join("model.safetensors"), meta, weights, tensors)?;
        for (rank, part) in parts.iter().enumerate() {
            write_part(&temp, rank, part)?;
        }
        sync_dir(&temp.join("optim"))?;
        sync_dir(&temp)
    })();
    if written.is_err() {
        // A half-written checkpoint only takes space: the error says what went wrong.
        let _ = fs::remove_dir_all(&temp);
    }
    written?;
    fs::rename(&temp, dir).map_err(io(dir))?;
    sync_dir(parent)
}

/// Refuses a checkpoint of `needed` bytes at `dir` (not made yet) where the file system of its
/// parent has fewer bytes free ([`CheckpointError::NoSpace`]); allowed where that cannot be asked.
pub fn space_for(dir: &Path, needed: u64) -> Result<(), CheckpointError> {
    check_space(dir, needed, free_bytes(dir))
}

/// Refuses a checkpoint of `needed` bytes at `dir` where its file system has `free` bytes free
/// and they are fewer (`None`: unknown, so not refused).
fn check_space(dir: &Path, needed: u64, free: Option<u64>) -> Result<(), CheckpointError> {
    match free {
        Some(free) if free < needed => {
            Err(CheckpointError::NoSpace { path: dir.to_path_buf(), needed, free })
        }
        _ => Ok(()),
    }
}

/// The bytes of the tensors [`write_model`] writes (headers not counted).
pub fn model_bytes<P: Stored>(meta: &Meta, tensors: &[NamedTensor]) -> u64 {
    let size = if meta.weights_dtype == "F32" { 4 } else { size_of::<P>() as u64 };
    tensors.iter().map(|t| t.flat.len() as u64 * size).sum()
}

/// Bytes of disk as people read them: `128.5 GB`, `6.6 MB`, `900 B` (powers of 1000, as disks
/// are sold and `df -H` prints).
pub fn disk_size(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000 => format!("{bytes} B"),
        1_000..1_000_000 => format!("{:.1} kB", b / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.1} GB", b / 1e9),
    }
}

thread_local! {
    /// What [`free_bytes`] says on this thread instead of asking the file system ([`pretend_free`]).
    static PRETENDED_FREE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Tests: from now on [`free_bytes`] says `bytes` on this thread (`None`: asks the file system
/// again), so that a run's saves can be refused for want of space without filling a disk.
#[doc(hidden)]
pub fn pretend_free(bytes: Option<u64>) {
    PRETENDED_FREE.with(|free| free.set(bytes));
}

/// The bytes free for this process (`statvfs`'s available blocks) on the file system that holds
/// `path`, or would hold it once made (its nearest existing ancestor's), or `None` where that
/// cannot be asked.
pub fn free_bytes(path: &Path) -> Option<u64> {
    if let Some(bytes) = PRETENDED_FREE.with(std::cell::Cell::get) {
        return Some(bytes);
    }
    let path = path.ancestors().find(|dir| dir.exists())?;
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
        let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `path` is a NUL-terminated string and `stat` a buffer of the type statvfs fills.
        let status = unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) };
        if status != 0 {
            return None;
        }
        // SAFETY: statvfs returned 0, so it filled `stat`.
        let stat = unsafe { stat.assume_init() };
        #[allow(clippy::unnecessary_cast)] // the fields' types differ between platforms
        Some(stat.f_bavail as u64 * stat.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        None
    }
}

/// Whether `a` and `b` (either may not exist yet: their nearest existing ancestors are asked) are
/// on one file system, so that what is written to one takes the other's free space; `false`
/// where that cannot be asked.
pub fn same_file_system(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let device = |path: &Path| {
            let path = std::path::absolute(path).ok()?;
            let existing = path.ancestors().find(|dir| dir.exists())?;
            existing.metadata().ok().map(|meta| meta.dev())
        };
        matches!((device(a), device(b)), (Some(a), Some(b)) if a == b)
    }
    #[cfg(not(unix))]
    {
        let _ = (a, b);
        false
    }
}

/// Writes `weights` as the named `tensors` into a safetensors file at `path` (fsynced), in the
/// element type `meta.weights_dtype` names: `P`'s own, or F32 (narrower types widen exactly).
pub fn write_model<P: Stored>(
    path: &Path,
    meta: &Meta,
    weights: &Elements<'_, P>,
    tensors: &[NamedTensor],
) -> Result<(), CheckpointError> {
    let widen = match meta.weights_dtype.as_str() {
        own if own == P::DTYPE.name() => false,
        "F32" => true,
        other => {
            let reason = format!("weights of {} cannot be stored as {other}", P::DTYPE);
            return Err(CheckpointError::Mismatch { path: path.into(), reason });
        }
    };
    write_tensors(path, tensor_outs(path, weights, tensors, widen)?, None)
}

/// Writes `weights` as the named `tensors` into a safetensors file at `path` (fsynced) in `P`'s
/// own type, fetched a piece at a time as they are written, with `"format": "pt"` in its
/// metadata: a weight file of a Hugging Face directory.
pub fn write_hf_weights<P: Stored>(
    path: &Path,
    weights: &Elements<'_, P>,
    tensors: &[NamedTensor],
) -> Result<(), CheckpointError> {
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_tensors(path, tensor_outs(path, weights, tensors, false)?, Some(metadata))
}

/// The tensors of a file that [`write_tensors`] writes from `weights`: each as `P`, or widened
/// to F32.
fn tensor_outs<'a, P: Stored>(
    path: &Path,
    weights: &'a Elements<'_, P>,
    tensors: &'a [NamedTensor],
    widen: bool,
) -> Result<Vec<Out<'a>>, CheckpointError> {
    tensors
        .iter()
        .map(|t| {
            if t.flat.end > weights.len() || t.flat.start > t.flat.end {
                let reason = format!("{} lies outside the flat weights", t.name);
                return Err(CheckpointError::Mismatch { path: path.into(), reason });
            }
            let at = t.flat.start;
            Ok(match widen {
                false => Out::of(&t.name, t.shape.clone(), weights, at),
                true => Out::new(&t.name, Dtype::F32, 4, t.shape.clone(), move |range| {
                    let values = weights.get(at + range.start..at + range.end)?;
                    Ok(PieceBytes::Bytes(Cow::Owned(widened_bytes(&values).into_owned())))
                }),
            })
        })
        .collect()
}

/// Writes `state.json` at `path` (fsynced): rank 0's share of a checkpoint that several
/// processes write together, with [`write_model`]; each rank adds its part with [`write_part`].
pub fn write_state(path: &Path, meta: &Meta) -> Result<(), CheckpointError> {
    write_synced(path, &serde_json::to_vec_pretty(meta).expect("serializable"))
}

/// Writes `rank`'s optimizer part (with its ZenFlow state, if it has one) as
/// `optim/rank-R.safetensors` into the checkpoint directory being written, `dir` (fsynced;
/// `dir/optim` must exist).
pub fn write_part(dir: &Path, rank: usize, part: &PartView<'_>) -> Result<(), CheckpointError> {
    let path = dir.join(format!("optim/rank-{rank}.safetensors"));
    let (tensors, metadata) = part_tensors(part, &path)?;
    write_tensors(&path, tensors, Some(metadata))
}

/// The most [`save_views`] writes of a tensor at once (and so the most it fetches or converts).
pub const WRITE_CHUNK_BYTES: usize = 64 << 20;

/// The buffers through which a file is written ([`FileOut`]: one filled while the others are
/// written).
pub const WRITE_BUFFERS_BYTES: usize = direct::BUFFERS * direct::BUFFER_BYTES;

/// Elements a checkpoint writes: lent as they lie, or fetched a range at a time while they are
/// written (downloaded from a device, or merged with ZenFlow's device columns), so that saving
/// never holds a whole second copy of them.
pub enum Elements<'a, T: Clone> {
    Lent(Cow<'a, [T]>),
    Fetched {
        len: usize,
        #[allow(clippy::type_complexity, reason = "one fetch function")]
        fetch: Box<dyn Fn(Range<usize>) -> Result<Vec<T>, String> + 'a>,
    },
    /// Lent a range at a time from a buffer of the source's own, which holds it until the loan
    /// is dropped (a device's elements, downloaded into page-locked staging: written from there).
    Loaned(Box<dyn Lender<T> + 'a>),
    /// Lent elements followed by others (a host optimizer's part of a partition, then the
    /// device share's, downloaded a range at a time).
    Joined {
        head: &'a [T],
        tail: Box<Elements<'a, T>>,
    },
}

/// Elements held elsewhere, lent a range at a time ([`Elements::Loaned`]).
pub trait Lender<T> {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Elements `range`, lent from the lender's own buffer until the loan is dropped (one loan
    /// at a time).
    fn lend(&self, range: Range<usize>) -> Result<Loan<'_, T>, String>;
}

/// A range of a [`Lender`]'s elements.
pub type Loan<'a, T> = Box<dyn std::ops::Deref<Target = [T]> + 'a>;

/// A device buffer's first `len` elements, downloaded a range at a time into one staging buffer
/// (page-locked where the budget has room) and lent from there ([`Elements::downloaded`]).
struct Download<'a, D: zeroflow_device::Device, T: Element> {
    device: &'a D,
    buffer: &'a D::Buffer<T>,
    len: usize,
    staging: std::sync::Mutex<Option<zeroflow_device::HostBuffer<T>>>,
}

/// A range downloaded into a [`Download`]'s staging, the staging's lock held while it is lent.
struct Staged<'a, T: Element> {
    staging: std::sync::MutexGuard<'a, Option<zeroflow_device::HostBuffer<T>>>,
    n: usize,
}

impl<T: Element> std::ops::Deref for Staged<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.staging.as_deref().map_or(&[], |staging| &staging[..self.n])
    }
}

impl<D: zeroflow_device::Device, T: Element> Lender<T> for Download<'_, D, T> {
    fn len(&self) -> usize {
        self.len
    }

    fn lend(&self, range: Range<usize>) -> Result<Loan<'_, T>, String> {
        if range.start > range.end || range.end > self.len {
            return Err(format!("elements {range:?} of {}", self.len));
        }
        let n = range.len();
        let mut staging = self.staging.lock().map_err(|_| "a download panicked".to_string())?;
        let download = self.device.download_staged(self.buffer, range, &mut staging);
        download.map_err(|e| e.to_string())?;
        Ok(Box::new(Staged { staging, n }))
    }
}

impl<T: Clone> std::fmt::Debug for Elements<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Elements::Lent(values) => write!(f, "Lent({} elements)", values.len()),
            Elements::Fetched { len, .. } => write!(f, "Fetched({len} elements)"),
            Elements::Loaned(lender) => write!(f, "Loaned({} elements)", lender.len()),
            Elements::Joined { head, tail } => {
                write!(f, "Joined({} elements, {tail:?})", head.len())
            }
        }
    }
}

impl<'a, T: Element> Elements<'a, T> {
    /// The first `len` elements of a device buffer, downloaded a range at a time as they are
    /// written, into one staging buffer for every range (page-locked where the budget has room),
    /// and written from there.
    pub fn downloaded<D: zeroflow_device::Device>(
        device: &'a D,
        buffer: &'a D::Buffer<T>,
        len: usize,
    ) -> Self {
        let staging = std::sync::Mutex::new(None);
        Elements::Loaned(Box::new(Download { device, buffer, len, staging }))
    }
}

impl<'a, T: Clone> Elements<'a, T> {
    /// Lent elements.
    pub fn lent(values: &'a [T]) -> Self {
        Elements::Lent(Cow::Borrowed(values))
    }

    /// Elements fetched by `fetch`, a range at a time.
    pub fn fetched(
        len: usize,
        fetch: impl Fn(Range<usize>) -> Result<Vec<T>, String> + 'a,
    ) -> Self {
        Elements::Fetched { len, fetch: Box::new(fetch) }
    }

    pub fn len(&self) -> usize {
        match self {
            Elements::Lent(values) => values.len(),
            Elements::Fetched { len, .. } => *len,
            Elements::Loaned(lender) => lender.len(),
            Elements::Joined { head, tail } => head.len() + tail.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `range`: borrowed where they are lent, fetched otherwise.
    pub fn get(&self, range: Range<usize>) -> Result<Cow<'_, [T]>, String> {
        match self {
            Elements::Lent(values) => values
                .get(range.clone())
                .map(Cow::Borrowed)
                .ok_or_else(|| format!("elements {range:?} of {}", values.len())),
            Elements::Fetched { len, fetch } => {
                if range.end > *len {
                    return Err(format!("elements {range:?} of {len}"));
                }
                let values = fetch(range.clone())?;
                if values.len() != range.len() {
                    return Err(format!("{} elements fetched for {range:?}", values.len()));
                }
                Ok(Cow::Owned(values))
            }
            Elements::Loaned(lender) => Ok(Cow::Owned(lender.lend(range)?.to_vec())),
            Elements::Joined { head, tail } => {
                let split = head.len();
                if range.end <= split {
                    return Ok(Cow::Borrowed(&head[range]));
                }
                let end = range.end - split;
                if range.start >= split {
                    return tail.get(range.start - split..end);
                }
                let mut values = head[range.start..].to_vec();
                values.extend_from_slice(&tail.get(0..end)?);
                Ok(Cow::Owned(values))
            }
        }
    }
}

/// One rank's optimizer state as a checkpoint writes it, lent from where it lives (the engine's
/// host optimizer, see [`crate::Engine::checkpoint_state`], or an [`OptimizerPart`]) or fetched
/// in pieces: saving a large model's state holds no second copy of it.
#[derive(Debug)]
pub struct PartView<'a> {
    pub flat: Range<usize>,
    pub master: Elements<'a, f32>,
    pub exp_avg: MomentView<'a>,
    pub exp_avg_sq: MomentView<'a>,
    /// A ZenFlow run's state besides its window's sums (the snapshot's `window_grads` unused),
    /// and those sums.
    pub zenflow: Option<(ZenFlowSnapshot, Elements<'a, f32>)>,
}

/// One Adam moment of a [`PartView`], in the element type its run keeps it in.
#[derive(Debug)]
pub enum MomentView<'a> {
    F32(Elements<'a, f32>),
    Bf16(Elements<'a, bf16>),
    /// bf16 moments held as f32 (exactly): stored as bf16, narrowed as they are written.
    Bf16AsF32(Elements<'a, f32>),
}

impl PartView<'_> {
    /// The bytes of the tensors [`write_part`] writes for this part (headers not counted).
    pub fn bytes(&self) -> u64 {
        let window = self.zenflow.as_ref().map_or(0, |(_, window)| window.len() as u64 * 4);
        self.master.len() as u64 * 4 + self.exp_avg.bytes() + self.exp_avg_sq.bytes() + window
    }
}

impl MomentView<'_> {
    /// The bytes it is stored in.
    fn bytes(&self) -> u64 {
        match self {
            MomentView::F32(values) => values.len() as u64 * 4,
            MomentView::Bf16(values) => values.len() as u64 * 2,
            MomentView::Bf16AsF32(values) => values.len() as u64 * 2,
        }
    }

    fn len(&self) -> usize {
        match self {
            MomentView::F32(v) | MomentView::Bf16AsF32(v) => v.len(),
            MomentView::Bf16(v) => v.len(),
        }
    }

    fn out(&self, name: &str, shape: Vec<usize>) -> Out<'_> {
        match self {
            MomentView::F32(values) => Out::of(name, shape, values, 0),
            MomentView::Bf16(values) => Out::of(name, shape, values, 0),
            MomentView::Bf16AsF32(values) => Out::new(name, Dtype::BF16, 2, shape, move |range| {
                let values = values.get(range)?;
                let mut out = Vec::with_capacity(values.len() * 2);
                values.iter().for_each(|&v| bf16::from_f32(v).put(&mut out));
                Ok(PieceBytes::Bytes(Cow::Owned(out)))
            }),
        }
    }
}

impl OptimizerPart {
    /// This part (with the rank's ZenFlow state, if any) as a checkpoint writes it: lent, the
    /// moments of a bf16 run narrowed as they are written.
    pub fn view<'a>(&'a self, zenflow: Option<&'a ZenFlowSnapshot>) -> PartView<'a> {
        fn moment(values: &[f32], dtype: OptimizerStateDtype) -> MomentView<'_> {
            match dtype {
                OptimizerStateDtype::Fp32 => MomentView::F32(Elements::lent(values)),
                OptimizerStateDtype::Bf16 => MomentView::Bf16AsF32(Elements::lent(values)),
            }
        }
        PartView {
            flat: self.flat.clone(),
            master: Elements::lent(&self.master),
            exp_avg: moment(&self.exp_avg, self.moments),
            exp_avg_sq: moment(&self.exp_avg_sq, self.moments),
            zenflow: zenflow.map(|z| {
                let meta = ZenFlowSnapshot { window_grads: Vec::new(), ..z.clone() };
                (meta, Elements::lent(&z.window_grads))
            }),
        }
    }
}

/// A rank's ZenFlow state besides the window's gradients, as the JSON of the metadata key
/// `zenflow`.
#[derive(Serialize, Deserialize)]
struct ZenFlowMeta {
    selection: Vec<(usize, Vec<u32>)>,
    steps_in_window: u64,
    since_selection: Option<u64>,
    /// Epochs reported since the last selection (absent in older checkpoints: 0).
    #[serde(default)]
    epochs_since_selection: u64,
    cpu_steps: u64,
    window_start: usize,
    window_end: usize,
    /// Zen-auto's window state (absent in checkpoints without it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    auto: Vec<f64>,
}

/// The weights the run would have after its pending delayed update: the fp32 master weights of
/// the optimizer parts (read a piece at a time), rounded to `P`, as named tensors in the layout of
/// `model.safetensors`.
pub fn weights_from_master<P: Stored + zeroflow_core::Float>(
    opened: &Opened,
) -> Result<(Vec<P>, Vec<NamedTensor>), CheckpointError> {
    let end = opened.parts.iter().map(|p| p.flat.end).max().unwrap_or(0);
    let mut flat = vec![P::default(); end];
    let mut piece = vec![0.0f32; (1 << 20).min(end)];
    for part in &opened.parts {
        let mut start = 0;
        while start < part.flat.len() {
            let n = piece.len().min(part.flat.len() - start);
            part.read(0, start..start + n, &mut piece[..n])?;
            let at = part.flat.start + start;
            for (w, m) in flat[at..at + n].iter_mut().zip(&piece[..n]) {
                *w = P::from_f32(*m);
            }
            start += n;
        }
    }
    let mut tensors = Vec::new();
    for (name, entry) in opened.model.tensors() {
        let param = opened.meta.params.iter().find(|p| p.name == name).ok_or_else(|| {
            CheckpointError::Corrupt {
                path: PathBuf::from("state.json"),
                reason: format!("no layout entry for tensor {name}"),
            }
        })?;
        // The header was checked against the file's length, so its product does not overflow.
        let numel: usize = entry.shape.iter().product();
        let flat_range = param.offset..param.offset.saturating_add(numel);
        if flat_range.end > end {
            let reason = format!("the optimizer state does not cover {name}");
            return Err(CheckpointError::Corrupt { path: PathBuf::from("optim"), reason });
        }
        let shape = entry.shape.clone();
        tensors.push(NamedTensor { name: name.to_string(), shape, flat: flat_range });
    }
    tensors.sort_by_key(|t| t.flat.start);
    Ok((flat, tensors))
}

fn part_tensors<'a>(
    part: &'a PartView<'_>,
    path: &Path,
) -> Result<(Vec<Out<'a>>, HashMap<String, String>), CheckpointError> {
    let n = part.flat.len();
    if [part.master.len(), part.exp_avg.len(), part.exp_avg_sq.len()] != [n; 3] {
        let reason = "an optimizer part's arrays differ from its range".to_string();
        return Err(CheckpointError::Mismatch { path: path.into(), reason });
    }
    let mut tensors = vec![
        Out::of("master", vec![n], &part.master, 0),
        part.exp_avg.out("exp_avg", vec![n]),
        part.exp_avg_sq.out("exp_avg_sq", vec![n]),
    ];
    let mut metadata = HashMap::from([
        ("flat_start".to_string(), part.flat.start.to_string()),
        ("flat_end".to_string(), part.flat.end.to_string()),
    ]);
    if let Some((z, window)) = &part.zenflow {
        let len = window.len();
        tensors.push(Out::of("zenflow.window_grads", vec![len], window, 0));
        let meta = ZenFlowMeta {
            selection: z.selection.clone(),
            steps_in_window: z.steps_in_window,
            since_selection: z.since_selection,
            epochs_since_selection: z.epochs_since_selection,
            cpu_steps: z.cpu_steps,
            window_start: z.window_flat.start,
            window_end: z.window_flat.end,
            auto: z.auto.clone(),
        };
        let json = serde_json::to_string(&meta).expect("serializable");
        metadata.insert("zenflow".to_string(), json);
    }
    Ok((tensors, metadata))
}

/// A range of a tensor's elements as the bytes to write, or why they could not be had.
type Piece<'a> = Box<dyn Fn(Range<usize>) -> Result<PieceBytes<'a>, String> + 'a>;

/// A piece of a tensor's bytes, as written: borrowed or made for the file, or fetched elements
/// whose memory already holds the file's bytes (no copy made of them).
enum PieceBytes<'a> {
    Bytes(Cow<'a, [u8]>),
    Elements(Box<dyn AsRef<[u8]> + 'a>),
}

impl std::ops::Deref for PieceBytes<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            PieceBytes::Bytes(bytes) => bytes,
            PieceBytes::Elements(elements) => (**elements).as_ref(),
        }
    }
}

/// Elements viewed as their bytes: the file's where the host is little-endian.
struct ElementBytes<T>(Vec<T>);

impl<T: Stored> AsRef<[u8]> for ElementBytes<T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// A tensor to write: its name, type, shape and element size, and its bytes, a range of
/// elements at a time, borrowed or made only while they are written.
struct Out<'a> {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Elements, and bytes per element.
    len: usize,
    size: usize,
    bytes: Piece<'a>,
}

impl<'a> Out<'a> {
    fn new(
        name: &str,
        dtype: Dtype,
        size: usize,
        shape: Vec<usize>,
        bytes: impl Fn(Range<usize>) -> Result<PieceBytes<'a>, String> + 'a,
    ) -> Self {
        let len = shape.iter().product();
        Out { name: name.to_string(), dtype, shape, len, size, bytes: Box::new(bytes) }
    }

    /// Elements `at..` of `values` as they are.
    fn of<T: Stored>(
        name: &str,
        shape: Vec<usize>,
        values: &'a Elements<'a, T>,
        at: usize,
    ) -> Self {
        let (dtype, size) = (T::SAFETENSORS, T::DTYPE.size());
        Out::new(name, dtype, size, shape, move |r| piece_bytes(values, at + r.start..at + r.end))
    }
}

/// Elements `range` of `values` as the file's bytes: borrowed where they are lent, written from
/// the lender's buffer where they are loaned, from where they were fetched into otherwise.
fn piece_bytes<'a, T: Stored>(
    values: &'a Elements<'a, T>,
    range: Range<usize>,
) -> Result<PieceBytes<'a>, String> {
    let little = cfg!(target_endian = "little");
    Ok(match values {
        // Lent for the file's life: borrowed, not copied.
        Elements::Lent(lent) => {
            let lent = lent.get(range.clone()).ok_or_else(|| format!("elements {range:?}"))?;
            PieceBytes::Bytes(le_bytes(lent))
        }
        Elements::Joined { head, .. } if range.end <= head.len() => {
            PieceBytes::Bytes(le_bytes(&head[range]))
        }
        Elements::Joined { head, tail } if range.start >= head.len() => {
            let split = head.len();
            return piece_bytes(tail, range.start - split..range.end - split);
        }
        Elements::Loaned(lender) if little => {
            PieceBytes::Elements(Box::new(LoanBytes(lender.lend(range)?)))
        }
        // Fetched: written from where they were fetched into.
        _ if little => {
            PieceBytes::Elements(Box::new(ElementBytes(values.get(range)?.into_owned())))
        }
        _ => PieceBytes::Bytes(Cow::Owned(to_bytes(&values.get(range)?))),
    })
}

/// Loaned elements viewed as their bytes: the file's where the host is little-endian.
struct LoanBytes<'a, T>(Loan<'a, T>);

impl<T: Stored> AsRef<[u8]> for LoanBytes<'_, T> {
    fn as_ref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

/// Writes `tensors` (with `metadata`) as a safetensors file at `path`, a piece of at most
/// [`WRITE_CHUNK_BYTES`] at a time through [`WRITE_BUFFERS_BYTES`] of buffers, past the page
/// cache where the file system allows, and fsyncs it: the file is never whole in memory. The
/// tensors are laid out as safetensors' own serializer lays them out (by alignment, then name).
fn write_tensors(
    path: &Path,
    mut tensors: Vec<Out<'_>>,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.into(), reason };
    tensors.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));
    let mut offset = 0;
    let mut infos = Vec::with_capacity(tensors.len());
    for t in &tensors {
        let data_offsets = (offset, offset + t.len * t.size);
        let (dtype, shape) = (t.dtype, t.shape.clone());
        infos.push((t.name.clone(), TensorInfo { dtype, shape, data_offsets }));
        offset += t.len * t.size;
    }
    let metadata = Metadata::new(metadata, infos).map_err(|e| corrupt(e.to_string()))?;
    // The metadata's keys sorted: its map iterates in an order of its own per process, and a
    // checkpoint of the same state is the same bytes (checksums, deduplication).
    let mut header = serde_json::to_value(&metadata).map_err(|e| corrupt(e.to_string()))?;
    if let Some(serde_json::Value::Object(keys)) = header.get_mut("__metadata__") {
        keys.sort_keys();
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| corrupt(e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    match write_file(path, &header, &tensors, true) {
        // A file system that takes O_DIRECT files but not their writes: buffered, from the start.
        Err(CheckpointError::Io { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
            write_file(path, &header, &tensors, false)
        }
        written => written,
    }
}

/// [`write_tensors`]'s file: the header's length, the header, then every tensor a piece at a
/// time, past the page cache where `direct` and the file system allow ([`FileOut`]), fsynced.
fn write_file(
    path: &Path,
    header: &[u8],
    tensors: &[Out<'_>],
    direct: bool,
) -> Result<(), CheckpointError> {
    let corrupt = |reason: String| CheckpointError::Corrupt { path: path.into(), reason };
    let len = 8 + header.len() + tensors.iter().map(|t| t.len * t.size).sum::<usize>();
    let mut file = FileOut::create(path, direct, len as u64).map_err(io(path))?;
    file.write_all(&(header.len() as u64).to_le_bytes()).map_err(io(path))?;
    file.write_all(header).map_err(io(path))?;
    for t in tensors {
        let chunk = (WRITE_CHUNK_BYTES / t.size).max(1);
        for start in (0..t.len).step_by(chunk) {
            let range = start..(start + chunk).min(t.len);
            let expected = range.len() * t.size;
            let bytes = (t.bytes)(range).map_err(|reason| CheckpointError::Source {
                path: path.into(),
                reason: format!("{}: {reason}", t.name),
            })?;
            if bytes.len() != expected {
                let reason = format!("{}: {} bytes, expected {expected}", t.name, bytes.len());
                return Err(corrupt(reason));
            }
            file.write_all(&bytes).map_err(io(path))?;
        }
    }
    file.finish().map_err(io(path))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = File::create(path).map_err(io(path))?;
    file.write_all(bytes).map_err(io(path))?;
    file.sync_all().map_err(io(path))
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Named tensors as read: shape and elements by name.
pub type Tensors<P> = HashMap<String, (Vec<usize>, Vec<P>)>;

/// A checkpoint read back.
#[derive(Debug)]
pub struct Loaded<P> {
    pub meta: Meta,
    /// The named weight tensors: shape and elements.
    pub tensors: Tensors<P>,
    pub parts: Vec<OptimizerPart>,
    /// Every rank's ZenFlow state, in rank order (empty if the run had none).
    pub zenflow: Vec<ZenFlowSnapshot>,
}

/// Reads the checkpoint in `dir` whole, checking everything it can without knowing the run: what
/// [`open`] checks, with every tensor's elements in memory.
pub fn load<P: Stored>(dir: &Path) -> Result<Loaded<P>, CheckpointError> {
    let opened = open(dir)?;
    if opened.meta.weights_dtype != P::DTYPE.name() {
        let reason =
            format!("weights are {}, this run trains in {}", opened.meta.weights_dtype, P::DTYPE);
        return Err(CheckpointError::Mismatch { path: dir.join("state.json"), reason });
    }
    let model_path = opened.model.path();
    let model = fs::read(model_path).map_err(io(model_path))?;
    let tensors = read_tensors::<P>(&model, model_path)?;
    let parts = opened.parts.iter().map(PartFile::to_part).collect::<Result<_, _>>()?;
    let mut zenflow = opened.zenflow;
    for (snapshot, part) in zenflow.iter_mut().zip(&opened.parts) {
        snapshot.window_grads = vec![0.0; part.flat.len()];
        part.read_window(0..part.flat.len(), &mut snapshot.window_grads)?;
    }
    Ok(Loaded { meta: opened.meta, tensors, parts, zenflow })
}

/// A checkpoint opened: its `state.json`, and the headers of its files checked against it and
/// against their lengths (every model tensor of the run's element type, each rank's range and
/// arrays, ZenFlow's state in the metadata). The weights, the optimizer state and ZenFlow's
/// window sums are read a range at a time ([`Opened::flat_weights`], [`PartFile::read`],
/// [`PartFile::read_window`]), so that resuming a model of many gigabytes never holds a file in
/// memory beside what it is read into.
#[derive(Debug)]
pub struct Opened {
    pub meta: Meta,
    /// The element type of the weights (`meta.weights_dtype`, checked against every tensor).
    pub weights_dtype: DType,
    pub model: SafetensorsFile,
    /// Each rank's optimizer part, in rank order: they tile the flat buffer from 0.
    pub parts: Vec<PartFile>,
    /// Every rank's ZenFlow state, in rank order (empty if the run had none), its window sums
    /// not read (`window_grads` empty: [`PartFile::read_window`] reads them).
    pub zenflow: Vec<ZenFlowSnapshot>,
}

/// Opens the checkpoint in `dir` ([`Opened`]). Its weights may be of any element type a run
/// trains in (`F32`, `BF16`, `F16`: `state.json`'s `weights_dtype`, which every tensor of
/// `model.safetensors` must have); [`Opened::flat_weights`] reads them as f32 (exactly) or as the
/// run's type. Whether a run may start from them is the caller's to say
/// ([`weights_convert_exactly`]).
pub fn open(dir: &Path) -> Result<Opened, CheckpointError> {
    let state_path = dir.join("state.json");
    let state = fs::read(&state_path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::Foreign {
            path: dir.to_path_buf(),
            reason: "it has no state.json".into(),
        },
        _ => CheckpointError::Io { path: state_path.clone(), source },
    })?;
    let meta: Meta = serde_json::from_slice(&state).map_err(|e| CheckpointError::Corrupt {
        path: state_path.clone(),
        reason: e.to_string(),
    })?;
    if meta.format != FORMAT || meta.version != VERSION {
        let reason = format!(
            "format {:?} version {}, expected {FORMAT:?} version {VERSION}",
            meta.format, meta.version
        );
        return Err(CheckpointError::Foreign { path: state_path, reason });
    }
    let Some(weights_dtype) = weights_dtype_named(&meta.weights_dtype) else {
        let reason =
            format!("weights_dtype {:?} is none of \"F32\", \"BF16\", \"F16\"", meta.weights_dtype);
        return Err(CheckpointError::Corrupt { path: state_path, reason });
    };
    let Some(moments) = OptimizerStateDtype::from_name(&meta.optimizer_state_dtype) else {
        let reason = format!(
            "optimizer_state_dtype {:?} is neither \"fp32\" nor \"bf16\"",
            meta.optimizer_state_dtype
        );
        return Err(CheckpointError::Corrupt { path: state_path, reason });
    };
    let model_path = dir.join("model.safetensors");
    let model = open_file(&model_path)?;
    for (name, entry) in model.tensors() {
        if entry.dtype != safetensors_dtype(weights_dtype) {
            let reason = format!(
                "tensor {name} is {:?}, and state.json says the weights are {}",
                entry.dtype, meta.weights_dtype
            );
            return Err(CheckpointError::Corrupt { path: model_path, reason });
        }
    }
    if let Err(reason) = meta.scaler.check() {
        return Err(CheckpointError::Corrupt { path: state_path, reason });
    }
    // Never sized from `world_size`: a damaged count fails at the first missing file instead.
    let mut parts: Vec<PartFile> = Vec::new();
    let mut zenflow = Vec::new();
    for rank in 0..meta.world_size {
        let path = dir.join(format!("optim/rank-{rank}.safetensors"));
        let (part, rank_zenflow) = open_part(&path)?;
        if rank > 0 && rank_zenflow.is_some() != (zenflow.len() == rank) {
            let reason = "some ranks saved ZenFlow state and others did not".to_string();
            return Err(CheckpointError::Corrupt { path, reason });
        }
        zenflow.extend(rank_zenflow);
        if part.moments != moments {
            let reason = format!(
                "its moments are {}, state.json says {}",
                part.moments, meta.optimizer_state_dtype
            );
            return Err(CheckpointError::Corrupt { path, reason });
        }
        // Rank r saved partition r, so the parts tile the flat buffer from 0 in rank order; what
        // reads them (`weights_from_master`, `Engine::restore`) relies on that.
        let expected_start = parts.last().map_or(0, |previous| previous.flat.end);
        if part.flat.start != expected_start {
            let reason = format!(
                "its flat range {:?} does not start where the previous rank's ends ({})",
                part.flat, expected_start
            );
            return Err(CheckpointError::Corrupt { path, reason });
        }
        parts.push(part);
    }
    Ok(Opened { meta, weights_dtype, model, parts, zenflow })
}

/// The element type a checkpoint's weights may be stored in, by its `weights_dtype`.
fn weights_dtype_named(name: &str) -> Option<DType> {
    [DType::F32, DType::Bf16, DType::F16].into_iter().find(|dtype| dtype.name() == name)
}

/// The safetensors element type of weights of `dtype` (one [`weights_dtype_named`] gives).
fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::Bf16 => bf16::SAFETENSORS,
        DType::F16 => f16::SAFETENSORS,
        _ => f32::SAFETENSORS,
    }
}

/// Whether weights stored as `stored` (a checkpoint's `weights_dtype`) become `P` exactly through
/// f32, as a run starting from them reads them: stored as `P` itself, or as f32 (a widened
/// narrower type: what zeroflow wrote for every run before its checkpoints kept the run's own
/// type), or read by an f32 run (every stored type widens exactly). An f16 run cannot start from
/// bf16 weights, nor a bf16 run from f16 ones.
pub fn weights_convert_exactly<P: Stored>(stored: DType) -> bool {
    stored == P::DTYPE || stored == DType::F32 || P::DTYPE == DType::F32
}

impl Opened {
    /// Checks that `model.safetensors` holds every tensor of `tensors` with the same shape (what
    /// [`Opened::flat_weights`] reads).
    pub fn check_tensors(&self, tensors: &[NamedTensor]) -> Result<(), CheckpointError> {
        let path = self.model.path();
        let mismatch = |reason: String| CheckpointError::Mismatch { path: path.into(), reason };
        for tensor in tensors {
            let entry = self
                .model
                .tensor(&tensor.name)
                .ok_or_else(|| mismatch(format!("it has no tensor {}", tensor.name)))?;
            if entry.shape != tensor.shape {
                return Err(mismatch(format!(
                    "{} has shape {:?}, this model {:?}",
                    tensor.name, entry.shape, tensor.shape
                )));
            }
        }
        Ok(())
    }

    /// The flat weights as `P` (padding zero; widened or rounded through f32) of a run whose
    /// tensors are `tensors`, read from `model.safetensors` in one pass, each straight into its
    /// range: every tensor must be there with the same shape ([`Opened::check_tensors`]).
    pub fn flat_weights<P: Float>(
        &self,
        tensors: &[NamedTensor],
        padded_len: usize,
    ) -> Result<Vec<P>, CheckpointError> {
        self.check_tensors(tensors)?;
        let path = self.model.path();
        let mismatch = |reason: String| CheckpointError::Mismatch { path: path.into(), reason };
        let mut flat = vec![P::default(); padded_len];
        let ranges: Vec<Range<usize>> = tensors.iter().map(|t| t.flat.clone()).collect();
        let outs = zeroflow_core::layout::ranges_mut(&mut flat, &ranges).ok_or_else(|| {
            mismatch("the model's tensors overlap or pass its flat weights".into())
        })?;
        let wanted = tensors.iter().map(|t| t.name.as_str()).zip(outs).collect();
        self.model.read_tensors(wanted).map_err(read_error(path))?;
        Ok(flat)
    }
}

/// The arrays of an optimizer part, in the order [`PartFile::read`] numbers them.
pub const PART_ARRAYS: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// One rank's optimizer part in a checkpoint, opened ([`open`]): its flat range and moments'
/// dtype, its arrays read a range at a time.
#[derive(Debug)]
pub struct PartFile {
    pub flat: Range<usize>,
    pub moments: OptimizerStateDtype,
    file: SafetensorsFile,
}

impl PartFile {
    /// Elements `range` (counted from the part's start) of [`PART_ARRAYS`]`[array]` as f32 (bf16
    /// moments widened exactly) into `out`, which holds as many.
    pub fn read(
        &self,
        array: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), CheckpointError> {
        let path = self.file.path();
        self.file.read_range(PART_ARRAYS[array], range, out).map_err(read_error(path))
    }

    /// The part's file's length in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.file.file_bytes()
    }

    /// Elements `range` (counted from the part's start) of a ZenFlow run's window sums
    /// (`zenflow.window_grads`) into `out`.
    pub fn read_window(&self, range: Range<usize>, out: &mut [f32]) -> Result<(), CheckpointError> {
        let path = self.file.path();
        self.file.read_range("zenflow.window_grads", range, out).map_err(read_error(path))
    }

    /// The whole part in memory.
    pub fn to_part(&self) -> Result<OptimizerPart, CheckpointError> {
        let array = |at: usize| -> Result<Vec<f32>, CheckpointError> {
            let mut values = vec![0.0; self.flat.len()];
            self.read(at, 0..values.len(), &mut values)?;
            Ok(values)
        };
        Ok(OptimizerPart {
            flat: self.flat.clone(),
            master: array(0)?,
            exp_avg: array(1)?,
            exp_avg_sq: array(2)?,
            moments: self.moments,
        })
    }
}

/// A safetensors file's header, read and checked against the file's length.
fn open_file(path: &Path) -> Result<SafetensorsFile, CheckpointError> {
    SafetensorsFile::open_with(path, true).map_err(read_error(path))
}

/// An error reading `path`: the file system's as it is, anything else the file's damage.
fn read_error(path: &Path) -> impl Fn(HfError) -> CheckpointError + '_ {
    move |e| match e {
        HfError::Io { path, source } => CheckpointError::Io { path, source },
        HfError::BadSafetensors { reason, .. } => {
            CheckpointError::Corrupt { path: path.to_path_buf(), reason }
        }
        other => CheckpointError::Corrupt { path: path.to_path_buf(), reason: other.to_string() },
    }
}

fn corrupt(path: &Path) -> impl Fn(safetensors::SafeTensorError) -> CheckpointError + '_ {
    move |e| CheckpointError::Corrupt { path: path.to_path_buf(), reason: e.to_string() }
}

/// The tensors of a safetensors file's `bytes` (read from `path`), all of type `P`.
pub fn read_tensors<P: Stored>(bytes: &[u8], path: &Path) -> Result<Tensors<P>, CheckpointError> {
    let file = SafeTensors::deserialize(bytes).map_err(corrupt(path))?;
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            if view.dtype() != P::SAFETENSORS {
                let reason =
                    format!("tensor {name} is {:?}, expected {:?}", view.dtype(), P::SAFETENSORS);
                return Err(CheckpointError::Mismatch { path: path.into(), reason });
            }
            Ok((name, (view.shape().to_vec(), from_bytes(view.data()))))
        })
        .collect()
}

/// Opens one rank's optimizer file at `path`: its part (checked: the range in the metadata, each
/// array of the range's length and a dtype it may have), and its ZenFlow state if it has one.
fn open_part(path: &Path) -> Result<(PartFile, Option<ZenFlowSnapshot>), CheckpointError> {
    let file = open_file(path)?;
    let bound = |key: &str| -> Result<usize, CheckpointError> {
        file.metadata(key).and_then(|v| v.parse().ok()).ok_or_else(|| CheckpointError::Corrupt {
            path: path.into(),
            reason: format!("no {key} in the metadata"),
        })
    };
    let flat = bound("flat_start")?..bound("flat_end")?;
    if flat.start > flat.end {
        let reason = format!("flat_start {} is after flat_end {}", flat.start, flat.end);
        return Err(CheckpointError::Corrupt { path: path.into(), reason });
    }
    // An array of the part's length, if it is one of `dtypes`: its dtype.
    let array = |name: &str, dtypes: &[Dtype]| -> Result<Dtype, CheckpointError> {
        let entry = file.tensor(name).ok_or_else(|| CheckpointError::Corrupt {
            path: path.into(),
            reason: format!("it has no tensor {name}"),
        })?;
        if !dtypes.contains(&entry.dtype) || entry.shape != [flat.len()] {
            let reason = format!(
                "{name} is {:?} {:?}, expected {} [{}]",
                entry.dtype,
                entry.shape,
                dtypes.iter().map(|d| format!("{d:?}")).collect::<Vec<_>>().join(" or "),
                flat.len()
            );
            return Err(CheckpointError::Mismatch { path: path.into(), reason });
        }
        Ok(entry.dtype)
    };
    let moment_dtypes = [Dtype::F32, Dtype::BF16];
    let exp_avg_dtype = array("exp_avg", &moment_dtypes)?;
    let exp_avg_sq_dtype = array("exp_avg_sq", &moment_dtypes)?;
    if exp_avg_dtype != exp_avg_sq_dtype {
        let reason = format!("exp_avg is {exp_avg_dtype:?} but exp_avg_sq {exp_avg_sq_dtype:?}");
        return Err(CheckpointError::Corrupt { path: path.into(), reason });
    }
    let moments = match exp_avg_dtype {
        Dtype::BF16 => OptimizerStateDtype::Bf16,
        _ => OptimizerStateDtype::Fp32,
    };
    array("master", &[Dtype::F32])?;
    let Some(json) = file.metadata("zenflow").map(str::to_owned) else {
        return Ok((PartFile { flat, moments, file }, None));
    };
    array("zenflow.window_grads", &[Dtype::F32])?;
    let part = PartFile { flat: flat.clone(), moments, file };
    let z: ZenFlowMeta = serde_json::from_str(&json).map_err(|e| CheckpointError::Corrupt {
        path: path.into(),
        reason: format!("its ZenFlow state: {e}"),
    })?;
    if (z.window_start..z.window_end) != flat {
        let reason = "the ZenFlow window's range differs from the optimizer part's".to_string();
        return Err(CheckpointError::Corrupt { path: path.into(), reason });
    }
    let zenflow = ZenFlowSnapshot {
        selection: z.selection,
        steps_in_window: z.steps_in_window,
        since_selection: z.since_selection,
        epochs_since_selection: z.epochs_since_selection,
        cpu_steps: z.cpu_steps,
        window_flat: flat,
        window_grads: Vec::new(),
        auto: z.auto,
    };
    Ok((part, Some(zenflow)))
}

/// The flat weights of a run whose tensors are `tensors` (padding zero), from a checkpoint's
/// named tensors: every tensor must be there with the same shape.
pub fn flat_weights<P: Stored>(
    loaded: &Loaded<P>,
    tensors: &[NamedTensor],
    padded_len: usize,
    dir: &Path,
) -> Result<Vec<P>, CheckpointError> {
    let mut flat = vec![P::default(); padded_len];
    for tensor in tensors {
        let mismatch = |reason: String| CheckpointError::Mismatch {
            path: dir.join("model.safetensors"),
            reason,
        };
        let (shape, values) = loaded
            .tensors
            .get(&tensor.name)
            .ok_or_else(|| mismatch(format!("it has no tensor {}", tensor.name)))?;
        if *shape != tensor.shape {
            return Err(mismatch(format!(
                "{} has shape {shape:?}, this model {:?}",
                tensor.name, tensor.shape
            )));
        }
        flat[tensor.flat.clone()].copy_from_slice(values);
    }
    Ok(flat)
}

#[cfg(test)]
mod tests {
    use zeroflow_core::adamw::OptimizerStateDtype;
    use zeroflow_core::bf16;

    use zeroflow_core::{DType, Float, f16};

    use super::{
        CheckpointError, Elements, Meta, MomentView, NamedTensor, OptimizerPart, PartView, Stored,
        check_space, free_bytes, load, open, save, save_views, weights_convert_exactly, write_part,
    };

    /// The `state.json` of a one-rank checkpoint of weights of type `weights_dtype` (tensors'
    /// layout not recorded).
    fn meta(weights_dtype: &str) -> Meta {
        Meta {
            format: super::FORMAT.into(),
            version: super::VERSION,
            optimizer_steps: 1,
            micro_steps: 1,
            world_size: 1,
            scaler: crate::LossScaler::None,
            upload_pending: false,
            weights_dtype: weights_dtype.into(),
            optimizer_state_dtype: OptimizerStateDtype::Fp32.name().into(),
            params: Vec::new(),
            extra: serde_json::Value::Null,
        }
    }

    /// A run's weights are stored in its own type: a checkpoint of bf16 weights holds 2 bytes
    /// per weight, opens and reads back widened exactly (the padding zero), loads as bf16 only;
    /// one whose tensors are not the type `state.json` names, or that names a type weights are
    /// never stored in, is damaged.
    #[test]
    fn bf16_weights_are_stored_as_bf16_and_read_back_exactly() {
        let n = 999;
        let weights: Vec<bf16> =
            (0..n).map(|i| bf16::from_f32((i as f32 * 0.37).sin() * 3.0)).collect();
        let widened: Vec<f32> = weights.iter().map(|w| w.to_f32()).collect();
        let tensors = [
            NamedTensor { name: "w".into(), shape: vec![10, 99], flat: 0..990 },
            NamedTensor { name: "b".into(), shape: vec![9], flat: 990..n },
        ];
        let part = OptimizerPart {
            flat: 0..n,
            master: widened.clone(),
            exp_avg: vec![0.0; n],
            exp_avg_sq: vec![0.0; n],
            moments: OptimizerStateDtype::Fp32,
        };
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("step-00000001");
        save(&dir, &meta("BF16"), &weights, &tensors, std::slice::from_ref(&part)).unwrap();
        let file = std::fs::read(dir.join("model.safetensors")).unwrap();
        let header = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        assert_eq!(file.len() - 8 - header, 2 * n, "2 bytes per weight");
        let opened = open(&dir).unwrap();
        let flat = opened.flat_weights::<f32>(&tensors, n + 5).unwrap();
        assert_eq!(flat[..n], widened[..]);
        assert_eq!(flat[n..], [0.0; 5]);
        // Read as the run's own type (what a bf16 run resumes with): the stored bits.
        let own = opened.flat_weights::<bf16>(&tensors, n + 5).unwrap();
        let bits = |values: &[bf16]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&own[..n]), bits(&weights));
        assert_eq!(bits(&own[n..]), [0; 5]);
        assert!(matches!(load::<f32>(&dir), Err(CheckpointError::Mismatch { .. })));
        let loaded = load::<bf16>(&dir).unwrap();
        assert_eq!(loaded.tensors["b"], (vec![9], weights[990..].to_vec()));
        for (said, why) in [("F32", "is BF16, and state.json says"), ("I32", "none of")] {
            let copy = root.path().join(format!("says-{said}"));
            std::fs::create_dir_all(copy.join("optim")).unwrap();
            for file in ["model.safetensors", "optim/rank-0.safetensors"] {
                std::fs::copy(dir.join(file), copy.join(file)).unwrap();
            }
            let state = serde_json::to_vec(&meta(said)).unwrap();
            std::fs::write(copy.join("state.json"), state).unwrap();
            let error = open(&copy).unwrap_err();
            assert!(matches!(error, CheckpointError::Corrupt { .. }), "{said}: {error}");
            assert!(error.to_string().contains(why), "{said}: {error}");
        }
    }

    /// A run may start from stored weights exactly where every value of the stored type comes
    /// through f32 into the run's type unchanged (every bit pattern tried), and from f32 weights
    /// (narrower weights widened, as checkpoints of every run held them before they kept the
    /// run's type).
    #[test]
    fn a_run_starts_from_stored_weights_that_convert_without_rounding() {
        fn survives<S: Stored + Float, P: Float>(bits: impl Fn(u16) -> S) -> bool {
            (0..=u16::MAX).map(bits).filter(|s| s.to_f32().is_finite()).all(|s| {
                let back = P::from_f32(s.to_f32()).to_f32();
                back == s.to_f32()
            })
        }
        fn check<P: Stored + Float>() {
            let cases = [
                (DType::Bf16, survives::<bf16, P>(bf16::from_bits)),
                (DType::F16, survives::<f16, P>(f16::from_bits)),
                (DType::F32, true),
            ];
            for (stored, exact) in cases {
                assert_eq!(
                    weights_convert_exactly::<P>(stored),
                    exact,
                    "{stored} into {}",
                    P::DTYPE
                );
            }
        }
        check::<f32>();
        check::<bf16>();
        check::<f16>();
    }

    /// A save is refused, before anything is written, where the file system has less free space
    /// than the checkpoint's tensors take, with a message that says what to do; allowed where it
    /// has enough or cannot tell.
    #[test]
    fn a_checkpoint_larger_than_the_free_space_is_refused_before_writing() {
        let dir = std::path::Path::new("runs/r/checkpoints/step-00000100");
        let error = check_space(dir, 112_000_000_000, Some(60_000_000_000)).unwrap_err();
        assert!(matches!(error, CheckpointError::NoSpace { needed: 112_000_000_000, .. }));
        let message = error.to_string();
        for said in ["not enough disk space", "112.0 GB", "60.0 GB", "--out", "step-00000100"] {
            assert!(message.contains(said), "{said:?} not in: {message}");
        }
        check_space(dir, 100, Some(100)).unwrap();
        let small = check_space(dir, 6_600_000, Some(1_900_000)).unwrap_err().to_string();
        assert!(small.contains("6.6 MB") && small.contains("1.9 MB"), "{small}");
        check_space(dir, 100, None).unwrap();
        let here = tempfile::tempdir().unwrap();
        assert!(free_bytes(here.path()).is_some_and(|free| free > 0));
    }

    /// A directory and a path not made yet inside it are on one file system; on Linux, `/proc`
    /// is on another than a temporary directory.
    #[test]
    fn the_file_system_of_paths_made_or_not() {
        let here = tempfile::tempdir().unwrap();
        let unmade = here.path().join("not/yet/made");
        assert!(super::same_file_system(here.path(), &unmade));
        #[cfg(target_os = "linux")]
        assert!(!super::same_file_system(here.path(), std::path::Path::new("/proc/self")));
    }

    /// What a part's tensors take is what the file holds beyond its header, for fp32 and bf16
    /// moments: the figure the free-space check compares.
    #[test]
    fn a_parts_bytes_are_its_files_tensor_bytes() {
        let n = 777;
        let master: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let m: Vec<bf16> = (0..n).map(|i| bf16::from_f32(i as f32)).collect();
        let views = [
            PartView {
                flat: 0..n,
                master: Elements::lent(&master),
                exp_avg: MomentView::F32(Elements::lent(&master)),
                exp_avg_sq: MomentView::F32(Elements::lent(&master)),
                zenflow: None,
            },
            PartView {
                flat: 0..n,
                master: Elements::lent(&master),
                exp_avg: MomentView::Bf16(Elements::lent(&m)),
                exp_avg_sq: MomentView::Bf16(Elements::lent(&m)),
                zenflow: None,
            },
        ];
        for view in views {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir(dir.path().join("optim")).unwrap();
            write_part(dir.path(), 0, &view).unwrap();
            let file = std::fs::read(dir.path().join("optim/rank-0.safetensors")).unwrap();
            let header = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
            assert_eq!(view.bytes(), (file.len() - 8 - header) as u64);
        }
    }

    /// A save whose source fails on the way leaves no checkpoint and no partial directory
    /// behind (it would only take the disk's space), and says what failed.
    #[test]
    fn a_failed_save_leaves_nothing_behind() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("step-00000001");
        let n = 1000;
        // state.json is written (the partial directory exists) before the weights fail.
        let weights =
            Elements::<f32>::fetched(n, |_| Err("the device stopped answering".to_string()));
        let meta = meta("F32");
        let tensors = [NamedTensor { name: "w".into(), shape: vec![n], flat: 0..n }];
        let error = save_views(&dir, &meta, &weights, &tensors, &[]).unwrap_err();
        assert!(error.to_string().contains("the device stopped answering"), "{error}");
        let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().collect();
        assert!(left.is_empty(), "left behind: {left:?}");
    }

    /// Joined elements read as one array: a range within the lent head borrowed from it, one
    /// within the tail fetched (or downloaded from a device) from it, one across both made of
    /// both; past the end an error. A device's elements downloaded alone read as the buffer.
    #[test]
    fn joined_elements_read_as_one_array() {
        let all: Vec<f32> = (100..125).map(|i| i as f32).collect();
        let device = zeroflow_device::CpuDevice::new().unwrap();
        let buffer = zeroflow_device::Device::upload(&device, &all[10..]).unwrap();
        let tail = all[10..].to_vec();
        let tails = [
            Elements::fetched(15, move |r| Ok(tail[r].to_vec())),
            Elements::downloaded(&device, &buffer, 15),
        ];
        for tail in tails {
            let what = format!("{tail:?}");
            let joined = Elements::Joined { head: &all[..10], tail: Box::new(tail) };
            assert_eq!(joined.len(), 25);
            for start in 0..=25 {
                for end in start..=25 {
                    let got = joined.get(start..end).unwrap();
                    assert_eq!(&*got, &all[start..end], "{what}: {start}..{end}");
                    let borrowed = matches!(got, std::borrow::Cow::Borrowed(_));
                    assert_eq!(borrowed, end <= 10, "{what}: {start}..{end}: borrowed {borrowed}");
                }
            }
            for range in [20..26, 0..26, 26..27] {
                assert!(joined.get(range.clone()).is_err(), "{what}: {range:?}");
            }
        }
        let downloaded = Elements::downloaded(&device, &buffer, 15);
        assert_eq!(&*downloaded.get(3..15).unwrap(), &all[13..]);
        assert!(downloaded.get(3..16).is_err());
    }

    /// A part written from moments lent as bf16 is the file written from the same moments
    /// widened to f32 (an [`OptimizerPart`] of a bf16 run), byte for byte, and fp32 moments lent
    /// are the part's own; a part written again is the same bytes; the file reads back as the
    /// part.
    #[test]
    fn lent_and_copied_parts_write_the_same_file() {
        let n = 1000;
        let master: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let m: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i as f32 * 0.11).cos() * 1e-3)).collect();
        let v: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i as f32).sqrt() * 1e-7)).collect();
        let widen = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
        let device = zeroflow_device::CpuDevice::new().unwrap();
        let exp_avg_sq = zeroflow_device::Device::upload(&device, &widen(&v)).unwrap();
        for moments in [OptimizerStateDtype::Bf16, OptimizerStateDtype::Fp32] {
            let part = OptimizerPart {
                flat: 24..24 + n,
                master: master.clone(),
                exp_avg: widen(&m),
                exp_avg_sq: widen(&v),
                moments,
            };
            // Lent as they lie, or fetched in pieces (as from a device).
            let fetched = |values: &[f32]| {
                let values = values.to_vec();
                Elements::fetched(values.len(), move |r| Ok(values[r].to_vec()))
            };
            let lent = match moments {
                OptimizerStateDtype::Bf16 => PartView {
                    flat: part.flat.clone(),
                    master: fetched(&master),
                    exp_avg: MomentView::Bf16(Elements::lent(&m)),
                    exp_avg_sq: MomentView::Bf16(Elements::lent(&v)),
                    zenflow: None,
                },
                // Lent, then fetched after them (a host optimizer's part, a device share's);
                // downloaded from a device.
                OptimizerStateDtype::Fp32 => PartView {
                    flat: part.flat.clone(),
                    master: Elements::Joined {
                        head: &master[..n / 3],
                        tail: Box::new(fetched(&master[n / 3..])),
                    },
                    exp_avg: MomentView::F32(fetched(&part.exp_avg)),
                    exp_avg_sq: MomentView::F32(Elements::downloaded(&device, &exp_avg_sq, n)),
                    zenflow: None,
                },
            };
            let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
            for (dir, view) in dirs.iter().zip([lent, part.view(None)]) {
                std::fs::create_dir(dir.path().join("optim")).unwrap();
                write_part(dir.path(), 3, &view).unwrap();
            }
            let read = |dir: &tempfile::TempDir| {
                std::fs::read(dir.path().join("optim/rank-3.safetensors")).unwrap()
            };
            let (a, b) = (read(&dirs[0]), read(&dirs[1]));
            assert!(a == b, "{moments:?}: the files differ");
            // Written again and again, the same bytes: the header's metadata (a map of its
            // own order per process) is written with its keys sorted.
            for _ in 0..8 {
                write_part(dirs[1].path(), 3, &part.view(None)).unwrap();
                assert!(read(&dirs[1]) == a, "{moments:?}: a part written again differs");
            }
            for dir in &dirs {
                let path = dir.path().join("optim/rank-3.safetensors");
                let (back, zenflow) = super::open_part(&path).unwrap();
                let back = back.to_part().unwrap();
                assert!((back, zenflow) == (part.clone(), None), "{moments:?}: read back differs");
            }
        }
    }
}
