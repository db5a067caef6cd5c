//! Writing a checkpoint: into a temporary directory beside it, every file fsynced, then one
//! rename; each tensor a piece at a time, so that no whole second copy of it is held.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Write;
use std::ops::Range;
use std::path::Path;

use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use zeroflow_hf::direct::{self, FileOut};

use super::{
    CheckpointError, Elements, Loan, Meta, NamedTensor, PartView, Stored, ZenFlowMeta, io,
    le_bytes, space_for, to_bytes, widened_bytes,
};
use crate::{OptimizerPart, ZenFlowSnapshot};

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

/// The bytes of the tensors [`write_model`] writes (headers not counted).
pub fn model_bytes<P: Stored>(meta: &Meta, tensors: &[NamedTensor]) -> u64 {
    let size = if meta.weights_dtype == "F32" { 4 } else { size_of::<P>() as u64 };
    tensors.iter().map(|t| t.flat.len() as u64 * size).sum()
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
pub(super) enum PieceBytes<'a> {
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
pub(super) struct Out<'a> {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Elements, and bytes per element.
    len: usize,
    size: usize,
    bytes: Piece<'a>,
}

impl<'a> Out<'a> {
    pub(super) fn new(
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
    pub(super) fn of<T: Stored>(
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
        Err(CheckpointError::Io { source, .. })
            if source.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) =>
        {
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
