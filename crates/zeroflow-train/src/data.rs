//! The data of a run: `--data` parsed into a training source and a held-out evaluation source.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use zeroflow_data::{DataLoader, Source, SyntheticCorpus};

use crate::error::{Result, input};

/// Micro-batches in the evaluation set unless `--eval-batches` says otherwise.
pub const EVAL_BATCHES: usize = 16;

/// What `--data` names.
#[derive(Debug)]
pub enum Spec {
    Synthetic,
    /// llm.c token shards, in order.
    Shards(Vec<PathBuf>),
    /// Text files, read as bytes, in order (a glob of several: the last for eval).
    Text(Vec<PathBuf>),
}

impl Spec {
    pub fn parse(data: &str) -> Result<Spec> {
        if data == "synthetic" {
            return Ok(Spec::Synthetic);
        }
        let path = Path::new(data);
        let what_to_do = "pass `synthetic`, a directory or glob of llm.c .bin token shards, or a \
                          text file or glob of text files";
        let is_shard = |p: &Path| p.extension().is_some_and(|ext| ext == "bin");
        let shards = if data.contains(['*', '?']) {
            let paths = glob(path)?;
            if !paths.is_empty() && !paths.iter().any(|p| is_shard(p)) {
                return Ok(Spec::Text(paths));
            }
            if !paths.iter().all(|p| is_shard(p)) {
                return Err(input(format!(
                    "--data {data}: matches both .bin token shards and other files; give a glob \
                     of one kind"
                )));
            }
            paths
        } else if path.is_dir() {
            let entries = std::fs::read_dir(path)
                .map_err(|e| input(format!("--data {data}: cannot read the directory: {e}")))?;
            let mut shards: Vec<PathBuf> = entries
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|ext| ext == "bin"))
                .collect();
            shards.sort();
            shards
        } else if path.is_file() && path.metadata().is_ok_and(|m| m.len() == 0) {
            return Err(input(format!("--data {data}: the file is empty; {what_to_do}")));
        } else if path.is_file() {
            if is_shard(path) {
                vec![path.to_owned()]
            } else {
                return Ok(Spec::Text(vec![path.to_owned()]));
            }
        } else if path.exists() {
            // /dev/null, a FIFO, a device: nothing a run can read tokens from twice.
            return Err(input(format!(
                "--data {data}: not a regular file or directory (a device, pipe or socket, read \
                 as empty); {what_to_do}"
            )));
        } else {
            return Err(input(format!("--data {data}: no such file or directory; {what_to_do}")));
        };
        if shards.is_empty() {
            return Err(input(format!("--data {data}: no .bin token shards found; {what_to_do}")));
        }
        Ok(Spec::Shards(shards))
    }

    /// The files the data is read from (none for the synthetic corpus).
    pub fn files(&self) -> &[PathBuf] {
        match self {
            Spec::Synthetic => &[],
            Spec::Shards(paths) | Spec::Text(paths) => paths,
        }
    }

    /// The vocabulary of the default model for this data.
    pub fn default_vocab(&self) -> usize {
        match self {
            Spec::Synthetic => SyntheticCorpus::default().vocab,
            Spec::Shards(_) => zeroflow_data::GPT2_VOCAB,
            Spec::Text(_) => 256,
        }
    }
}

/// The files matching a glob whose wildcards (`*`, `?`) are in the file name only.
fn glob(pattern: &Path) -> Result<Vec<PathBuf>> {
    let shown = pattern.display();
    let dir = match pattern.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let name = pattern.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    if dir.to_string_lossy().contains(['*', '?']) {
        return Err(input(format!(
            "--data {shown}: wildcards are supported in the file name only"
        )));
    }
    let entries = std::fs::read_dir(dir)
        .map_err(|e| input(format!("--data {shown}: cannot read {}: {e}", dir.display())))?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| wildcard_match(name, n)))
        .map(|e| e.path())
        .collect();
    paths.sort();
    Ok(paths)
}

/// Whether `name` matches `pattern` with `*` (any run) and `?` (any one character).
fn wildcard_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // Dynamic programming over (pattern prefix, name prefix).
    let mut matches = vec![false; n.len() + 1];
    matches[0] = true;
    for &pc in &p {
        let mut next = vec![false; n.len() + 1];
        next[0] = matches[0] && pc == '*';
        for j in 1..=n.len() {
            next[j] = match pc {
                '*' => next[j - 1] || matches[j],
                '?' => matches[j - 1],
                c => matches[j - 1] && n[j - 1] == c,
            };
        }
        matches = next;
    }
    matches[n.len()]
}

/// How the training stream is cut: `batch` sequences per micro-step for `micro_steps` micro-steps,
/// this rank's slice of each step's `world_size × batch` sequences.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub batch: u64,
    pub micro_steps: u64,
    pub rank: usize,
    pub world_size: usize,
    /// Tokens per sequence (`--seq`, at most the model's context).
    pub seq: usize,
    /// Micro-batches of the evaluation set (`--eval-batches`).
    pub eval_batches: usize,
}

/// The training and evaluation data of a run.
#[derive(Debug)]
pub struct Data {
    pub train: DataLoader,
    /// This rank's part of the evaluation set: `--eval-batches` micro-batches, the same at every
    /// evaluation.
    pub eval: Vec<zeroflow_data::Batch>,
    /// The lowest loss a model can reach, where known (the synthetic corpus).
    pub floor: Option<f64>,
    /// What the data is, for the log and the summary.
    pub description: String,
}

impl Data {
    /// Opens the data for `shape.micro_steps` micro-batches of `shape.batch` sequences of
    /// `shape.seq` tokens of a model of `vocab` symbols: this rank's slices of the training stream and of the evaluation set (the
    /// ranks read disjoint sequences of each step, together what one process with `world_size`
    /// times the micro-batch reads).
    ///
    /// The synthetic corpus evaluates on another stream of the same chain. Files evaluate on the
    /// last shard when there are several (it is then not trained on) and on the start of the only
    /// one otherwise (not held out: the log says so).
    pub fn open(spec: &Spec, vocab: usize, shape: Shape, seed: u64) -> Result<Data> {
        let (batch, seq) = (shape.batch as usize, shape.seq);
        let (rank, world) = (shape.rank, shape.world_size);
        let loader = |source, rank, world| {
            DataLoader::new(source, vocab, batch, seq, rank, world)
                .map_err(|e| input(format!("--data: {e}")))
        };
        let (train, eval_source, floor, description) = match spec {
            Spec::Synthetic => synthetic(vocab, shape, seed)?,
            Spec::Shards(paths) if paths.len() > 1 => {
                let (last, rest) = paths.split_last().expect("more than one");
                let description =
                    format!("{} token shards; the last, {}, for eval", paths.len(), last.display());
                (
                    Source::Shards(rest.to_vec()),
                    Source::Shards(vec![last.clone()]),
                    None,
                    description,
                )
            }
            Spec::Shards(paths) => {
                tracing::warn!(
                    "one token shard: evaluating on its start, which is also trained on"
                );
                let description =
                    format!("{} (eval on its start, not held out)", paths[0].display());
                (Source::Shards(paths.clone()), Source::Shards(paths.clone()), None, description)
            }
            Spec::Text(paths) if vocab < 256 => {
                return Err(input(format!(
                    "--data {} is read as bytes (256 symbols) but the model's vocab_size is \
                     {vocab}; drop --model, or give one with vocab_size of at least 256",
                    paths[0].display()
                )));
            }
            Spec::Text(paths) if paths.len() > 1 => {
                let (last, rest) = paths.split_last().expect("more than one");
                let description = format!(
                    "{} text files as bytes; the last, {}, for eval",
                    paths.len(),
                    last.display()
                );
                (Source::Text(rest.to_vec()), Source::Text(vec![last.clone()]), None, description)
            }
            Spec::Text(paths) => {
                tracing::warn!(
                    "one text file: evaluating on its start, which is also trained on (a glob of \
                     several holds the last out for eval)"
                );
                let description =
                    format!("{} as bytes (eval on its start, not held out)", paths[0].display());
                (Source::Text(paths.clone()), Source::Text(paths.clone()), None, description)
            }
        };
        let train = loader(train, rank, world)?;
        let mut eval_loader = loader(eval_source, rank, world)?;
        let eval = (0..shape.eval_batches)
            .map(|_| eval_loader.next_batch().map_err(|e| input(format!("--data: {e}"))))
            .collect::<Result<_>>()?;
        Ok(Data { train, eval, floor, description })
    }
}

/// The training and evaluation sources of a run, its entropy floor where known, and what the
/// data is (for the log and the summary).
type Sources = (Source, Source, Option<f64>, String);

/// The synthetic corpus' sources: two streams of the same chain, for `shape.micro_steps`
/// micro-batches and the evaluation set.
fn synthetic(vocab: usize, shape: Shape, seed: u64) -> Result<Sources> {
    let (batch, seq, world) = (shape.batch as usize, shape.seq, shape.world_size);
    let corpus = Arc::new(SyntheticCorpus::default());
    if corpus.vocab > vocab {
        return Err(input(format!(
            "the synthetic corpus has {} symbols but the model's vocab_size is {vocab}; use a \
             model with vocab_size of at least {}",
            corpus.vocab, corpus.vocab
        )));
    }
    let floor = corpus.loss_floor(seq);
    let train_len = (shape.micro_steps as usize).saturating_mul(world * batch * seq) + 1;
    let train = Source::Synthetic {
        corpus: corpus.clone(),
        stream_seed: 2 * seed,
        len: train_len.min(1 << 26),
    };
    let eval_len = shape.eval_batches * world * batch * seq + 1;
    let eval = Source::Synthetic { corpus, stream_seed: 2 * seed + 1, len: eval_len };
    Ok((train, eval, Some(floor), "the synthetic corpus (held-out stream for eval)".into()))
}

#[cfg(test)]
mod tests {
    use super::wildcard_match;

    #[test]
    fn wildcards_match_runs_and_single_characters() {
        assert!(wildcard_match("*.bin", "fineweb_train_000001.bin"));
        assert!(wildcard_match("train_??.bin", "train_01.bin"));
        assert!(!wildcard_match("train_??.bin", "train_1.bin"));
        assert!(!wildcard_match("*.bin", "notes.txt"));
        assert!(wildcard_match("*", ""));
    }
}
