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
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::{Element, bf16, f16};

use crate::{LossScaler, OptimizerPart, ZenFlowSnapshot};

mod disk;
mod read;
mod write;

#[cfg(test)]
use self::disk::check_space;
pub use self::disk::{disk_size, free_bytes, pretend_free, same_file_system, space_for};
#[cfg(test)]
use self::read::open_part;
pub use self::read::{
    Loaded, Opened, PART_ARRAYS, PartFile, Tensors, flat_weights, load, open, read_tensors,
    weights_convert_exactly, weights_from_master,
};
use self::write::{Out, PieceBytes};
pub use self::write::{
    WRITE_BUFFERS_BYTES, WRITE_CHUNK_BYTES, model_bytes, save, save_views, save_with_zenflow,
    write_hf_weights, write_model, write_part, write_state,
};

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
