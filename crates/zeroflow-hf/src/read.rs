//! Reading a Hugging Face model directory: `config.json` and the weights, from one
//! `model.safetensors` or from the shards that `model.safetensors.index.json` lists.
//!
//! Opening reads only the safetensors headers (names, dtypes, shapes, where each tensor's bytes
//! are); a tensor's elements are read, and converted to f32, when asked for, so that a model of
//! many gigabytes is never held twice.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use safetensors::Dtype;
use safetensors::tensor::Metadata;
use serde_json::Value;
use zeroflow_core::Float;

use crate::direct::{FileIn, READ_BUFFER_BYTES};
use crate::error::{HfError, io};
use crate::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE};

/// The largest safetensors header read (the format's own limit is 100 MB).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor of the directory: its shape and dtype as stored, and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    shard: usize,
    /// Byte range in the shard file (absolute, header included).
    bytes: Range<u64>,
}

impl TensorEntry {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A Hugging Face model directory, opened: its `config.json` (if there is one) and the index of
/// its weights by name.
#[derive(Debug)]
pub struct HfCheckpoint {
    dir: PathBuf,
    config: Option<Value>,
    /// The weight files, in the order the index first names them.
    shards: Vec<PathBuf>,
    tensors: BTreeMap<String, TensorEntry>,
}

/// The weights files of `transformers`' older format (PyTorch's pickle), which zeroflow does not
/// read, by name.
const OTHER_WEIGHTS: [&str; 2] = ["pytorch_model.bin", "pytorch_model.bin.index.json"];

/// The first of [`OTHER_WEIGHTS`] in `dir`, if any.
fn other_weights(dir: &Path) -> Option<String> {
    OTHER_WEIGHTS.iter().find(|name| dir.join(name).is_file()).map(|name| name.to_string())
}

impl HfCheckpoint {
    /// Opens `dir`: `config.json` where present, and the weights of `model.safetensors.index.json`
    /// (every shard it names must be there and hold the tensors it lists) or else of
    /// `model.safetensors`.
    pub fn open(dir: &Path) -> Result<HfCheckpoint, HfError> {
        let config = read_config(dir)?;
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let (shards, tensors) = if index.is_file() {
            open_sharded(dir, &index)?
        } else if single.is_file() {
            open_single(&single)?
        } else {
            return Err(HfError::NoWeights { dir: dir.to_path_buf(), other: other_weights(dir) });
        };
        Ok(HfCheckpoint { dir: dir.to_path_buf(), config, shards, tensors })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `config.json`, as JSON, for the family to read; `None` where the directory has none.
    pub fn config(&self) -> Option<&Value> {
        self.config.as_ref()
    }

    /// The tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The file that holds `entry`.
    pub fn file_of(&self, entry: &TensorEntry) -> &Path {
        &self.shards[entry.shard]
    }

    /// Checks the tensors against the model's: every `expected` name is there with its shape
    /// and a dtype zeroflow reads, and every other name is `ignored` (buffers that
    /// `transformers` skips too, such as old files' `rotary_emb.inv_freq`). The error lists all
    /// missing and unexpected names at once.
    pub fn check<'a>(
        &self,
        expected: impl IntoIterator<Item = (&'a str, &'a [usize])>,
        ignored: impl Fn(&str) -> bool,
    ) -> Result<(), HfError> {
        let expected: BTreeMap<&str, &[usize]> = expected.into_iter().collect();
        let missing: Vec<String> = expected
            .keys()
            .filter(|name| !self.tensors.contains_key(**name))
            .map(|name| name.to_string())
            .collect();
        let unexpected: Vec<String> = self
            .names()
            .filter(|name| !expected.contains_key(name) && !ignored(name))
            .map(str::to_string)
            .collect();
        if !missing.is_empty() || !unexpected.is_empty() {
            return Err(HfError::Names { dir: self.dir.clone(), missing, unexpected });
        }
        for (name, shape) in expected {
            let entry = &self.tensors[name];
            self.check_entry(name, entry, shape)?;
        }
        Ok(())
    }

    fn check_entry(&self, name: &str, entry: &TensorEntry, shape: &[usize]) -> Result<(), HfError> {
        if entry.shape != shape {
            return Err(HfError::ShapeMismatch {
                path: self.file_of(entry).to_path_buf(),
                tensor: name.to_string(),
                expected: shape.to_vec(),
                found: entry.shape.clone(),
            });
        }
        if !matches!(entry.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(HfError::UnsupportedDtype {
                path: self.file_of(entry).to_path_buf(),
                tensor: name.to_string(),
                dtype: format!("{:?}", entry.dtype),
            });
        }
        Ok(())
    }

    /// The elements of tensor `name` as f32 (row-major, as stored).
    pub fn read_f32(&self, name: &str) -> Result<Vec<f32>, HfError> {
        let entry = self.entry(name)?;
        let mut out = vec![0.0; entry.numel()];
        self.read_tensors_into(vec![(name, &entry.shape, &mut out)])?;
        Ok(out)
    }

    /// Reads tensor `name`, which must have `shape`, into `out` (as many elements as the shape).
    pub fn read_into<T: Float>(
        &self,
        name: &str,
        shape: &[usize],
        out: &mut [T],
    ) -> Result<(), HfError> {
        self.read_tensors_into(vec![(name, shape, out)])
    }

    /// Reads every tensor of `wanted` (its name, the shape it must have, and where its elements
    /// go, in the type `T` they are converted to through f32: exact where `T` is the stored type
    /// or wider), each shard in one pass over its file (`read_entries`): what a model's
    /// weights are read with.
    pub fn read_tensors_into<T: Float>(
        &self,
        wanted: Vec<(&str, &[usize], &mut [T])>,
    ) -> Result<(), HfError> {
        let mut by_shard: Vec<Vec<(&str, &TensorEntry, &mut [T])>> =
            (0..self.shards.len()).map(|_| Vec::new()).collect();
        for (name, shape, out) in wanted {
            let entry = self.entry(name)?;
            self.check_entry(name, entry, shape)?;
            by_shard[entry.shard].push((name, entry, out));
        }
        for (shard, entries) in by_shard.into_iter().enumerate() {
            if entries.is_empty() {
                continue;
            }
            let path = &self.shards[shard];
            // Buffered: a model directory may well be in the page cache (just downloaded or read).
            let file = FileIn::open(path, false).map_err(io(path))?;
            read_entries(&file, path, entries)?;
        }
        Ok(())
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, HfError> {
        self.tensors
            .get(name)
            .ok_or_else(|| HfError::NoSuchTensor { dir: self.dir.clone(), tensor: name.into() })
    }
}

/// One safetensors file, opened: its header read and checked against the file's length, its
/// tensors read a range of elements at a time (converted to f32), so that a file of many
/// gigabytes is never held in memory. zeroflow's own checkpoints are read through it.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    file: FileIn,
    /// The file's length in bytes.
    bytes: u64,
    metadata: HashMap<String, String>,
    tensors: BTreeMap<String, TensorEntry>,
}

impl SafetensorsFile {
    /// Opens `path`, to be read through the page cache.
    pub fn open(path: &Path) -> Result<SafetensorsFile, HfError> {
        Self::open_with(path, false)
    }

    /// Opens `path`, to be read past the page cache where `direct` and the file system allow it
    /// ([`FileIn`]): what a checkpoint that was written so is read with.
    pub fn open_with(path: &Path, direct: bool) -> Result<SafetensorsFile, HfError> {
        let file = FileIn::open(path, direct).map_err(io(path))?;
        let bytes = file.file().metadata().map_err(io(path))?.len();
        let (data_start, metadata) = read_header(file.file(), path)?;
        let tensors = metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| (name, entry(info, 0, data_start)))
            .collect();
        let metadata = metadata.metadata().clone().unwrap_or_default();
        Ok(SafetensorsFile { path: path.to_path_buf(), file, bytes, metadata, tensors })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's length in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.bytes
    }

    /// The value of `key` in the header's `__metadata__`.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The tensors by name, sorted.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &TensorEntry)> {
        self.tensors.iter().map(|(name, entry)| (name.as_str(), entry))
    }

    /// Elements `elements` of tensor `name` (row-major, as stored; BF16, F16 or F32) into `out`
    /// (converted through f32), which holds as many.
    pub fn read_range<T: Float>(
        &self,
        name: &str,
        elements: Range<usize>,
        out: &mut [T],
    ) -> Result<(), HfError> {
        let entry = self
            .tensors
            .get(name)
            .ok_or_else(|| HfError::NoSuchTensor { dir: self.path.clone(), tensor: name.into() })?;
        if elements.end > entry.numel()
            || elements.start > elements.end
            || out.len() != elements.len()
        {
            return Err(HfError::DataLength {
                tensor: name.to_string(),
                shape: entry.shape.clone(),
                expected: elements.len(),
                found: out.len(),
            });
        }
        read_elements(&self.file, &self.path, name, entry, elements, out)
    }

    /// Whole tensors, each into its `out` (converted through f32; it holds as many elements),
    /// read in one pass over the file in the order they are stored (`read_entries`).
    pub fn read_tensors<T: Float>(&self, wanted: Vec<(&str, &mut [T])>) -> Result<(), HfError> {
        let mut entries = Vec::with_capacity(wanted.len());
        for (name, out) in wanted {
            let entry = self.tensors.get(name).ok_or_else(|| HfError::NoSuchTensor {
                dir: self.path.clone(),
                tensor: name.to_string(),
            })?;
            entries.push((name, entry, out));
        }
        read_entries(&self.file, &self.path, entries)
    }
}

/// The bytes per element of `dtype` (BF16, F16 or F32), else the error that names it.
fn element_width(dtype: Dtype, path: &Path, name: &str) -> Result<usize, HfError> {
    match dtype {
        Dtype::BF16 | Dtype::F16 => Ok(2),
        Dtype::F32 => Ok(4),
        other => Err(HfError::UnsupportedDtype {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            dtype: format!("{other:?}"),
        }),
    }
}

/// Whole tensors of `file` (at `path`), each `(name, entry, out)` into its `out` (which must
/// hold as many elements), read in one pass over the file in the order they are stored
/// ([`read_pieces`]): a file of many tensors, each smaller than a read's piece, keeps several
/// reads in flight (one read per tensor waited for each).
fn read_entries<T: Float>(
    file: &FileIn,
    path: &Path,
    mut entries: Vec<(&str, &TensorEntry, &mut [T])>,
) -> Result<(), HfError> {
    let mut reads = Vec::with_capacity(entries.len());
    for (name, entry, out) in entries.iter_mut() {
        if out.len() != entry.numel() {
            return Err(HfError::DataLength {
                tensor: name.to_string(),
                shape: entry.shape.clone(),
                expected: entry.numel(),
                found: out.len(),
            });
        }
        let width = element_width(entry.dtype, path, name)?;
        reads.push((entry.bytes.clone(), width, entry.dtype, std::mem::take(out)));
    }
    reads.sort_by_key(|(bytes, ..)| bytes.start);
    read_pieces(file, path, reads)
}

/// Elements `elements` of the tensor `entry` of `file` (at `path`) into `out`, converted in
/// pieces as they are read ([`read_pieces`]), so that a large tensor's bytes are never all in
/// memory beside it.
fn read_elements<T: Float>(
    file: &FileIn,
    path: &Path,
    name: &str,
    entry: &TensorEntry,
    elements: Range<usize>,
    out: &mut [T],
) -> Result<(), HfError> {
    let width = element_width(entry.dtype, path, name)?;
    let start = entry.bytes.start + (elements.start * width) as u64;
    let bytes = start..start + (out.len() * width) as u64;
    read_pieces(file, path, vec![(bytes, width, entry.dtype, out)])
}

/// Each `(bytes, width, dtype, out)`: the file's `bytes`, elements of `dtype` `width` bytes wide,
/// into `out` (as many elements, converted through f32), each piece converted on the thread that read it
/// ([`FileIn::read_ranges`]) into its own part of `out`.
fn read_pieces<T: Float>(
    file: &FileIn,
    path: &Path,
    reads: Vec<(Range<u64>, usize, Dtype, &mut [T])>,
) -> Result<(), HfError> {
    let mut ranges = Vec::with_capacity(reads.len());
    // Each range's outputs, a piece's elements each, lent to whichever thread reads that piece.
    let mut pieces: Vec<(Dtype, Vec<Mutex<&mut [T]>>)> = Vec::with_capacity(reads.len());
    for (bytes, width, dtype, out) in reads {
        ranges.push((bytes, width));
        let per_piece = READ_BUFFER_BYTES / width;
        pieces.push((dtype, out.chunks_mut(per_piece).map(Mutex::new).collect()));
    }
    let read = file.read_ranges(&ranges, |which, k, bytes| {
        let (dtype, outs) = &pieces[which];
        let mut out = outs[k].lock().expect("one piece is converted once");
        decode(*dtype, bytes, &mut out);
        Ok(())
    });
    read.map_err(io(path))
}

/// Little-endian `bytes` of `dtype` (BF16, F16 or F32) into `out`, through f32 (so that a
/// narrower `T` rounds as a value read as f32 and then converted would).
fn decode<T: Float>(dtype: Dtype, bytes: &[u8], out: &mut [T]) {
    match dtype {
        Dtype::F32 => {
            for (value, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *value = T::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        Dtype::BF16 => {
            for (value, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                let x = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                *value = T::from_f32(x.to_f32());
            }
        }
        Dtype::F16 => {
            for (value, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                let x = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
                *value = T::from_f32(x.to_f32());
            }
        }
        other => unreachable!("decode is called for BF16, F16 and F32 only, not {other:?}"),
    }
}

/// `dir/config.json` as JSON, if the file exists.
pub fn read_config(dir: &Path) -> Result<Option<Value>, HfError> {
    let path = dir.join(CONFIG_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(HfError::Io { path, source: e }),
    };
    serde_json::from_str(&text).map(Some).map_err(|e| HfError::Json { path, reason: e.to_string() })
}

type Opened = (Vec<PathBuf>, BTreeMap<String, TensorEntry>);

fn open_single(path: &Path) -> Result<Opened, HfError> {
    let file = SafetensorsFile::open(path)?;
    Ok((vec![file.path], file.tensors))
}

fn open_sharded(dir: &Path, index: &Path) -> Result<Opened, HfError> {
    let weight_map = read_weight_map(index)?;
    let mut shards: Vec<PathBuf> = Vec::new();
    let mut headers: Vec<(u64, Metadata)> = Vec::new();
    let mut shard_of: BTreeMap<&str, usize> = BTreeMap::new();
    let mut tensors = BTreeMap::new();
    for (tensor, shard) in &weight_map {
        let at = match shard_of.get(shard.as_str()) {
            Some(&at) => at,
            None => {
                let path = dir.join(shard);
                let file = File::open(&path).map_err(|source| HfError::MissingShard {
                    index: index.to_path_buf(),
                    shard: shard.clone(),
                    source,
                })?;
                headers.push(read_header(&file, &path)?);
                shards.push(path);
                shard_of.insert(shard, shards.len() - 1);
                shards.len() - 1
            }
        };
        let (data_start, metadata) = &headers[at];
        let info = metadata.info(tensor).ok_or_else(|| HfError::TensorNotInShard {
            index: index.to_path_buf(),
            shard: shard.clone(),
            tensor: tensor.clone(),
        })?;
        tensors.insert(tensor.clone(), entry(info, at, *data_start));
    }
    Ok((shards, tensors))
}

/// The `weight_map` of an index file: tensor name to shard file name (a plain file name in the
/// same directory).
fn read_weight_map(index: &Path) -> Result<BTreeMap<String, String>, HfError> {
    let bad = |reason: String| HfError::BadIndex { index: index.to_path_buf(), reason };
    let text = std::fs::read_to_string(index).map_err(io(index))?;
    let json: Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no \"weight_map\" object".into()))?;
    map.iter()
        .map(|(tensor, shard)| {
            let shard = shard
                .as_str()
                .filter(|s| !s.is_empty() && Path::new(s).file_name() == Some(s.as_ref()))
                .ok_or_else(|| bad(format!("weight_map.{tensor} is not a file name: {shard}")))?;
            Ok((tensor.clone(), shard.to_string()))
        })
        .collect()
}

fn entry(info: &safetensors::tensor::TensorInfo, shard: usize, data_start: u64) -> TensorEntry {
    let (start, end) = info.data_offsets;
    TensorEntry {
        shape: info.shape.clone(),
        dtype: info.dtype,
        shard,
        bytes: data_start + start as u64..data_start + end as u64,
    }
}

/// The header of the safetensors file `file` (at `path`): where the data starts and the
/// tensors' metadata, checked against the file's length.
fn read_header(file: &File, path: &Path) -> Result<(u64, Metadata), HfError> {
    let bad = |reason: String| HfError::BadSafetensors { path: path.to_path_buf(), reason };
    let len = file.metadata().map_err(io(path))?.len();
    let mut size = [0u8; 8];
    file.read_exact_at(&mut size, 0).map_err(|e| bad(format!("no header ({e})")))?;
    let header_len = u64::from_le_bytes(size);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > len {
        return Err(bad(format!("header length {header_len} for a file of {len} bytes")));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact_at(&mut header, 8).map_err(io(path))?;
    let metadata: Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("bad header ({e})")))?;
    let data_start = 8 + header_len;
    let data_len = metadata.data_len() as u64;
    if data_start + data_len != len {
        return Err(bad(format!(
            "the header describes {data_len} bytes of data, the file has {}",
            len - data_start
        )));
    }
    Ok((data_start, metadata))
}
