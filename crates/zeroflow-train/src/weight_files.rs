//! A model's flat parameters left in their safetensors files (a Hugging Face directory's shards,
//! or a checkpoint's `model.safetensors`), read a range at a time ([`FileParams::read`]): what a
//! GPU's inference uploads, and what `zeroflow export` writes out, with no copy of the weights in
//! host memory.

use std::ops::Range;
use std::path::Path;

use zeroflow_core::Float;
use zeroflow_hf::{HfCheckpoint, SafetensorsFile, StoredRange};

use crate::error::{Result, TrainError, input};

/// The files of a model's parameters, and where each tensor lies in them and in the flat buffer.
#[derive(Debug)]
pub(crate) struct FileParams {
    files: Vec<SafetensorsFile>,
    /// By where they start in the flat buffer.
    tensors: Vec<FileTensor>,
    /// The flat buffer's length (padded); what no tensor covers reads as zero.
    len: usize,
}

#[derive(Debug)]
struct FileTensor {
    /// Which of the files holds it, under which name.
    file: usize,
    name: String,
    flat: Range<usize>,
}

impl FileParams {
    /// The tensors `stored` (each: its name in the directory's files, its shape, its range of a
    /// flat buffer of `len`) of the Hugging Face directory `hf`, each shard opened once; a
    /// tensor missing or of another shape is an input error naming it.
    pub(crate) fn of_hf(
        hf: &HfCheckpoint,
        stored: Vec<StoredRange>,
        len: usize,
    ) -> Result<FileParams> {
        let mut paths: Vec<&Path> = Vec::new();
        let mut tensors = Vec::with_capacity(stored.len());
        for (name, shape, flat) in stored {
            let entry = hf
                .tensor(&name)
                .ok_or_else(|| input(format!("{}: it has no tensor {name}", hf.dir().display())))?;
            check_shape(hf.file_of(entry), &name, &entry.shape, &shape)?;
            let path = hf.file_of(entry);
            let file = match paths.iter().position(|p| *p == path) {
                Some(file) => file,
                None => {
                    paths.push(path);
                    paths.len() - 1
                }
            };
            tensors.push(FileTensor { file, name, flat });
        }
        let files = paths.iter().map(|path| SafetensorsFile::open(path));
        let files = files.collect::<std::result::Result<Vec<_>, _>>().map_err(TrainError::model)?;
        Ok(FileParams::new(files, tensors, len))
    }

    /// The tensors `stored` (name and range of a flat buffer of `len`) of one safetensors file
    /// whose names and shapes were checked (a checkpoint's `model.safetensors`:
    /// `checkpoint::Opened::check_tensors`).
    pub(crate) fn of_file(
        file: SafetensorsFile,
        stored: Vec<(String, Range<usize>)>,
        len: usize,
    ) -> FileParams {
        let tensors = stored.into_iter().map(|(name, flat)| FileTensor { file: 0, name, flat });
        FileParams::new(vec![file], tensors.collect(), len)
    }

    fn new(files: Vec<SafetensorsFile>, mut tensors: Vec<FileTensor>, len: usize) -> FileParams {
        tensors.sort_by_key(|t| t.flat.start);
        FileParams { files, tensors, len }
    }

    /// The flat buffer's length.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Elements `range` of the flat buffer into `out` (as many), converted to `T` through f32:
    /// each tensor's part of the range read from its file, the rest zero.
    pub(crate) fn read<T: Float>(&self, range: Range<usize>, out: &mut [T]) -> Result<()> {
        debug_assert_eq!(range.len(), out.len());
        out.fill(T::default());
        let first = self.tensors.partition_point(|t| t.flat.end <= range.start);
        for tensor in self.tensors[first..].iter().take_while(|t| t.flat.start < range.end) {
            let (start, end) = (tensor.flat.start.max(range.start), tensor.flat.end.min(range.end));
            if start >= end {
                continue;
            }
            let file = &self.files[tensor.file];
            let elements = start - tensor.flat.start..end - tensor.flat.start;
            let into = &mut out[start - range.start..end - range.start];
            file.read_range(&tensor.name, elements, into).map_err(TrainError::model)?;
        }
        Ok(())
    }
}

/// A stored tensor's shape against the model's, an input error naming both where they differ.
fn check_shape(path: &Path, name: &str, stored: &[usize], model: &[usize]) -> Result<()> {
    if stored != model {
        return Err(input(format!(
            "{}: {name} has shape {stored:?}, the model's config.json asks for {model:?}",
            path.display()
        )));
    }
    Ok(())
}
