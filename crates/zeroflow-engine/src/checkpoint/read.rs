//! Reading a checkpoint back: opening it (its `state.json` and the headers of its files), its
//! weights and optimizer parts, whole or a piece at a time.

use std::collections::HashMap;
use std::fs;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::{DType, Float, bf16, f16};
use zeroflow_hf::{HfError, SafetensorsFile};

use super::{
    CheckpointError, FORMAT, Meta, NamedTensor, Stored, VERSION, ZenFlowMeta, from_bytes, io,
};
use crate::{OptimizerPart, ZenFlowSnapshot};

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
pub(super) fn open_part(
    path: &Path,
) -> Result<(PartFile, Option<ZenFlowSnapshot>), CheckpointError> {
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
