//! The data of a run: `--data` parsed into a training source and a held-out evaluation source.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zeroflow_data::{
    Batch, DataLoader, IGNORE_TARGET, Source, SyntheticCorpus, Tokenizer, Unit,
    read_document_starts, read_unit,
};

use crate::error::{Result, input};

/// The models' ignored target is the data's.
const _: () = assert!(IGNORE_TARGET == zeroflow_nn::kernels::loss::IGNORE);

/// Tokens of the evaluation set of files unless `--eval-tokens` says otherwise (held out from the
/// end of the data: at most a tenth of its last file).
pub const EVAL_TOKENS: usize = 1 << 20;
/// Tokens of the synthetic corpus' evaluation stream unless `--eval-tokens` says otherwise (the
/// demo's 16 batches of 16 × 64: enough that its eval loss against the floor is not noise).
pub const SYNTHETIC_EVAL_TOKENS: usize = 16_384;

/// What `--data` names.
#[derive(Debug, PartialEq, Eq)]
pub enum Spec {
    Synthetic,
    /// llm.c token shards, in order.
    Shards(Vec<PathBuf>),
    /// Text files, in order: read as bytes (a model trained from scratch), or tokenized at
    /// start-up with the model's tokenizer where the model comes from a directory
    /// ([`crate::startup_tokens`]).
    Text(Vec<PathBuf>),
    /// JSON Lines files (`.jsonl`, or `.json` ones) of conversations (or documents), in order
    /// (text files among them, from a glob, as text), tokenized at start-up with the model's tokenizer and chat template
    /// ([`crate::startup_tokens`]).
    Jsonl(Vec<PathBuf>),
}

impl Spec {
    /// Token shards written by `zeroflow tokenize` with another tokenizer than the model's
    /// (`tokenizer`, of the model directory `dir`) are an input error naming both: their ids mean
    /// other text to this model (GPT-2's shards fed to a Qwen model train on garbage, silently,
    /// where every id is below its vocabulary). The tokenizer a shard directory was made with is
    /// its `manifest.json`'s; shards without one (llm.c's own) are not checked.
    pub fn check_tokenized_with(
        &self,
        tokenizer: &Tokenizer,
        dir: &Path,
        flag: &str,
    ) -> Result<()> {
        let Spec::Shards(shards) = self else { return Ok(()) };
        let mut folders: Vec<&Path> = shards.iter().filter_map(|shard| shard.parent()).collect();
        folders.dedup();
        for folder in folders {
            let Some((name, vocab, manifest)) = zeroflow_data::manifest_tokenizer(folder) else {
                continue;
            };
            // The vocabulary's size, not the end of text: a base model's tokenizer and its
            // instruct model's differ in the latter alone (Llama-3's), and read the same ids.
            let ours = tokenizer.vocab_size() as u64;
            if vocab == ours {
                continue;
            }
            return Err(input(format!(
                "{flag} {}: tokenized with {name} (a vocabulary of {vocab}; {}), not with the \
                 tokenizer of the model directory {} (a vocabulary of {ours}): its ids would be \
                 other text to this model; tokenize the data with `zeroflow tokenize --tokenizer \
                 {} ...`, or give the text or .jsonl itself",
                folder.display(),
                manifest.display(),
                dir.display(),
                dir.display()
            )));
        }
        Ok(())
    }

    /// Whether the data is conversations: JSON Lines whose first record has `messages` (or
    /// ShareGPT's `conversations`), which the chat template renders for training.
    pub fn holds_conversations(&self) -> bool {
        let Spec::Jsonl(files) = self else { return false };
        files.first().is_some_and(|file| zeroflow_data::first_record_is_conversation(file))
    }

    pub fn parse(data: &str) -> Result<Spec> {
        if data == "synthetic" {
            return Ok(Spec::Synthetic);
        }
        let path = Path::new(data);
        let what_to_do = "pass `synthetic`, a directory or glob of llm.c .bin token shards, a \
                          text file or a directory (.txt, .md) or glob of text files, or a .jsonl \
                          (or JSON Lines .json) or a directory or glob of them";
        let is_shard = |p: &Path| p.extension().is_some_and(|ext| ext == "bin");
        let shards = if data.contains(['*', '?']) {
            let paths = glob(path)?;
            if !paths.is_empty() && !paths.iter().any(|p| is_shard(p)) {
                return records(paths);
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
            let mut files: Vec<PathBuf> =
                entries.filter_map(|entry| entry.ok().map(|e| e.path())).collect();
            files.sort();
            let has = |p: &Path, extensions: &[&str]| {
                p.extension().and_then(|e| e.to_str()).is_some_and(|e| extensions.contains(&e))
            };
            let shards: Vec<PathBuf> = files.iter().filter(|p| is_shard(p)).cloned().collect();
            // A dataset as `datasets` saves or the Hub holds it (its .json files are metadata).
            let tables = files.iter().find(|p| has(p, &["parquet", "arrow"]));
            if let Some(table) = tables.filter(|_| shards.is_empty()) {
                records(vec![table.clone()])?;
            }
            // A directory of JSON Lines files (a dataset in several) and no shards; else of text
            // files (`.txt`, `.text`, `.md`: other files, a README or a licence, are not data).
            if shards.is_empty() {
                let lines = zeroflow_data::json_lines_of(&files);
                if !lines.is_empty() {
                    refuse_held_out(data, &lines)?;
                    return records(lines);
                }
                let texts: Vec<PathBuf> =
                    files.iter().filter(|p| has(p, &["txt", "text", "md"])).cloned().collect();
                if !texts.is_empty() {
                    refuse_held_out(data, &texts)?;
                    return records(texts);
                }
            }
            refuse_held_out(data, &shards)?;
            shards
        } else if path.is_file() && path.metadata().is_ok_and(|m| m.len() == 0) {
            return Err(input(format!("--data {data}: the file is empty; {what_to_do}")));
        } else if path.is_file() {
            if is_shard(path) {
                vec![path.to_owned()]
            } else {
                return records(vec![path.to_owned()]);
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

    /// The shards `zeroflow tokenize --hold-out` held out of the directory `data`
    /// (`data/held-out`, [`zeroflow_data::HELD_OUT_DIR`]), where it is such a directory and some
    /// were.
    pub fn held_out_beside(data: &str) -> Result<Option<Spec>> {
        let held_out = Path::new(data).join(zeroflow_data::HELD_OUT_DIR);
        // None held out (too few or too long documents): the run holds out a tail instead.
        if !Path::new(data).is_dir() || !holds_shards(&held_out) {
            return Ok(None);
        }
        Spec::parse(&held_out.to_string_lossy()).map(Some)
    }

    /// The files the data is read from (none for the synthetic corpus).
    pub fn files(&self) -> &[PathBuf] {
        match self {
            Spec::Synthetic => &[],
            Spec::Shards(paths) | Spec::Text(paths) => paths,
            Spec::Jsonl(paths) => paths,
        }
    }

    /// The vocabulary of the default model for this data.
    pub fn default_vocab(&self) -> usize {
        match self {
            Spec::Synthetic => SyntheticCorpus::default().vocab,
            Spec::Shards(_) | Spec::Jsonl(_) => zeroflow_data::GPT2_VOCAB,
            Spec::Text(_) => 256,
        }
    }
}

/// Whether the directory `dir` holds a `.bin` token shard (`false` where it is not there).
pub fn holds_shards(dir: &Path) -> bool {
    let entries = std::fs::read_dir(dir).into_iter().flatten().flatten();
    entries.map(|entry| entry.path()).any(|path| path.extension().is_some_and(|x| x == "bin"))
}

/// An input error where the files of the directory `data` mix a training split with held-out
/// ones ([`zeroflow_data::held_out_refusal`]): read whole, it would train on them.
fn refuse_held_out(data: &str, files: &[PathBuf]) -> Result<()> {
    match zeroflow_data::held_out_refusal(Path::new(data), files) {
        Some(reason) => {
            Err(input(format!("--data {data}: {reason} and the held-out ones as --eval-data")))
        }
        None => Ok(()),
    }
}

/// Files of text or JSON Lines, in order, each by its [`zeroflow_data::input_kind`]: JSON Lines
/// where any is (its text files read as text), else text; an input error naming a file that is
/// neither.
fn records(paths: Vec<PathBuf>) -> Result<Spec> {
    let mut lines = false;
    for path in &paths {
        let kind = zeroflow_data::input_kind(path)
            .map_err(|reason| input(format!("--data {}: {reason}", path.display())))?;
        lines |= kind == zeroflow_data::InputKind::JsonLines;
    }
    Ok(if lines { Spec::Jsonl(paths) } else { Spec::Text(paths) })
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
    /// Tokens of the evaluation set (`--eval-tokens`; default [`EVAL_TOKENS`], or
    /// [`SYNTHETIC_EVAL_TOKENS`] for the synthetic corpus).
    pub eval_tokens: Option<usize>,
    /// Whether rows are packed (`--pack`): the training batches and the evaluation set carry
    /// each token's position in its document, from the shards' document indexes.
    pub packed: bool,
    /// Whether the training rows of files are read in an order shuffled each epoch from the seed
    /// (`--shuffle`, [`DataLoader::shuffled`]); the synthetic corpus is a random stream already.
    pub shuffled: bool,
}

/// Where a run's evaluation set comes from.
#[derive(Clone, Copy, Debug)]
pub enum EvalSet<'a> {
    /// `--eval-data`: the start of these files.
    Given(&'a Spec),
    /// The documents held out of the training data, spread over it, when it was tokenized at
    /// start-up ([`crate::startup_tokens::Tokenized::held_out`]): all of them.
    HeldOut(&'a Spec),
    /// Files: a tail of the last, which the training stream never reads; the synthetic corpus:
    /// another stream of the same chain.
    Tail,
}

impl<'a> EvalSet<'a> {
    /// The evaluation set of a run: `--eval-data` where given (`given`), else the documents held
    /// out of its data where there are some (`held_out`), else a tail.
    pub fn of(given: Option<&'a Spec>, held_out: Option<&'a Spec>) -> EvalSet<'a> {
        match (given, held_out) {
            (Some(given), _) => EvalSet::Given(given),
            (None, Some(held_out)) => EvalSet::HeldOut(held_out),
            (None, None) => EvalSet::Tail,
        }
    }
}

/// The training and evaluation data of a run.
#[derive(Debug)]
pub struct Data {
    pub train: DataLoader,
    /// This rank's part of the evaluation set, the same at every evaluation: its windows in
    /// micro-batches, the last padded with ignored targets ([`zeroflow_data::eval_batches`]).
    pub eval: Vec<Batch>,
    /// The tokens of the evaluation set (all ranks'), whatever the micro-batch.
    pub eval_tokens: usize,
    /// The lowest loss a model can reach, where known (the synthetic corpus).
    pub floor: Option<f64>,
    /// What the data is, for the log and the summary.
    pub description: String,
    /// Where the evaluation set comes from, for the run header.
    pub eval_description: String,
    /// The micro-steps one pass over the training data takes ([`DataLoader::epoch_steps`]);
    /// `None` for the synthetic corpus.
    pub epoch_micro_steps: Option<u64>,
}

impl Data {
    /// The optimizer steps of `accum` micro-steps one pass over the training data takes (not a
    /// whole number where `accum` does not divide its micro-steps); `None` for the synthetic
    /// corpus.
    pub fn epoch_steps(&self, accum: u64) -> Option<f64> {
        self.epoch_micro_steps.map(|micro| micro as f64 / accum.max(1) as f64)
    }
}

impl Data {
    /// Opens the data for `shape.micro_steps` micro-batches of `shape.batch` sequences of
    /// `shape.seq` tokens of a model of `vocab` symbols: this rank's slices of the training stream
    /// and of the evaluation set (the ranks read disjoint sequences of each step, together what
    /// one process with `world_size` times the micro-batch reads).
    ///
    /// The evaluation set is the start of `eval`'s files where given (`--eval-data`), the
    /// documents held out of data tokenized at start-up where they were; else the synthetic corpus evaluates on
    /// another stream of the same chain, and files on the last `shape.eval_tokens` tokens (at
    /// most a tenth) of their last file, which the training stream never reads. Packed
    /// (`shape.packed`), both carry each token's position in its document
    /// ([`DataLoader::packed`]); every file, the evaluation set's included, needs its document
    /// index.
    pub fn open(
        spec: &Spec,
        eval: EvalSet<'_>,
        vocab: usize,
        shape: Shape,
        seed: u64,
    ) -> Result<Data> {
        let (batch, seq) = (shape.batch as usize, shape.seq);
        let (rank, world) = (shape.rank, shape.world_size);
        let data_error = |e: zeroflow_data::DataError| input(format!("--data: {e}"));
        let (train, floor, description) = match spec {
            Spec::Synthetic => synthetic(vocab, shape, seed)?,
            other => (source(other, vocab)?, None, describe(other)),
        };
        let mut train =
            DataLoader::new(train, vocab, batch, seq, rank, world).map_err(data_error)?;
        let description = match shape.packed {
            true => {
                train = train.packed().map_err(data_error)?;
                format!("{description}, packed (no attention across documents)")
            }
            false => description,
        };
        let description = match shape.shuffled && !matches!(spec, Spec::Synthetic) {
            true => {
                train = train.shuffled(seed).map_err(data_error)?;
                format!("{description}, rows shuffled each epoch")
            }
            false => description,
        };
        let EvalSetTokens { tokens, description: eval_description, tail, wanted } =
            eval_set(spec, eval, vocab, shape, seed)?;
        if let Some(held) = tail {
            train = train.hold_out_tail(held).map_err(data_error)?;
        }
        let counted = match &tokens.mask {
            Some(mask) => mask.iter().skip(1).filter(|&&m| m != 0).count(),
            None => tokens.tokens.len().saturating_sub(1),
        };
        if zeroflow_data::eval_windows(tokens.tokens.len(), seq) == 0 || counted == 0 {
            // A larger --eval-tokens helps only where the set holds all it asked for (not
            // where the data is short: a run holds out at most a tenth of its data).
            let advice = match eval {
                _ if tokens.tokens.len() >= wanted => {
                    "a larger --eval-tokens, a smaller --seq or --eval-data"
                }
                EvalSet::Given(_) => "more --eval-data or a smaller --seq",
                _ => {
                    "more data (a run holds out at most a tenth of it), a smaller --seq or \
                      --eval-data"
                }
            };
            return Err(input(format!(
                "the evaluation set ({eval_description}) holds no window of --seq {seq} tokens \
                 whose loss counts; give {advice}"
            )));
        }
        let (mask, documents) = (tokens.mask.as_deref(), tokens.documents.as_deref());
        let eval =
            zeroflow_data::eval_batches(&tokens.tokens, mask, documents, seq, batch, rank, world);
        let eval_tokens = tokens.tokens.len();
        let epoch_micro_steps = train.epoch_steps().map_err(data_error)?;
        Ok(Data {
            train,
            eval,
            eval_tokens,
            floor,
            description,
            eval_description,
            epoch_micro_steps,
        })
    }
}

/// A run's evaluation set: its tokens (with their loss mask and, packed, where its documents
/// start), what it is, for a tail of the training data how many tokens the training stream
/// leaves out, and how many tokens it asked for (`--eval-tokens` or its default).
struct EvalSetTokens {
    tokens: EvalTokens,
    description: String,
    tail: Option<usize>,
    wanted: usize,
}

/// The evaluation set [`Data::open`] evaluates on (see there), for a model of `vocab` symbols.
fn eval_set(
    spec: &Spec,
    eval: EvalSet<'_>,
    vocab: usize,
    shape: Shape,
    seed: u64,
) -> Result<EvalSetTokens> {
    let data_error = |e: zeroflow_data::DataError| input(format!("--data: {e}"));
    let wanted = match (eval, spec) {
        (EvalSet::Tail, Spec::Synthetic) => shape.eval_tokens.unwrap_or(SYNTHETIC_EVAL_TOKENS),
        _ => shape.eval_tokens.unwrap_or(EVAL_TOKENS),
    };
    let (tokens, description, tail) = match (eval, spec) {
        (EvalSet::Given(eval_spec), _) => {
            let eval = source(eval_spec, vocab)?;
            let tokens = leading_tokens(&eval, vocab, wanted, shape.packed, "--eval-data")?;
            let what =
                format!("the first {} tokens of --eval-data", thousands(tokens.tokens.len()));
            (tokens, what, None)
        }
        (EvalSet::HeldOut(held), _) => {
            let eval = source(held, vocab)?;
            let flag = "--data (its held-out documents)";
            let tokens = leading_tokens(&eval, vocab, usize::MAX, shape.packed, flag)?;
            let what = format!(
                "{} tokens of documents held out across --data, never trained on",
                thousands(tokens.tokens.len())
            );
            (tokens, what, None)
        }
        (EvalSet::Tail, Spec::Synthetic) => {
            let corpus = Arc::new(SyntheticCorpus::default());
            let eval = Source::Synthetic { corpus, stream_seed: 2 * seed + 1, len: wanted };
            let tokens = read_unit(&eval, 0, vocab).map_err(data_error)?;
            let what = format!("{} tokens of a held-out stream", thousands(wanted));
            let all = 0..tokens.tokens.len();
            (EvalTokens::of(tokens, None, all), what, None)
        }
        (EvalSet::Tail, _) => {
            let source = source(spec, vocab)?;
            let files = spec.files();
            let last = read_unit(&source, files.len() - 1, vocab).map_err(data_error)?;
            let documents = match shape.packed {
                true => Some(read_document_starts(&source, files.len() - 1).map_err(data_error)?),
                false => None,
            };
            let len = last.tokens.len();
            let held = wanted.min(len / 10);
            let what = format!(
                "{} tokens held out from the end of {}, never trained on",
                thousands(held),
                files[files.len() - 1].display()
            );
            (EvalTokens::of(last, documents, len - held..len), what, Some(held))
        }
    };
    Ok(EvalSetTokens { tokens, description, tail, wanted })
}

/// The evaluation set of a run as its trainer evaluates on it ([`Data::open`]): its tokens,
/// their loss mask (chat data's), where its documents start where the run `packed` its rows, and
/// what it is, cut to the windows of `seq` inputs the trainer reads (a last shorter one left
/// out). `zeroflow eval` of a run without `--data`.
pub fn run_eval_stream(
    spec: &Spec,
    eval: EvalSet<'_>,
    vocab: usize,
    seq: usize,
    eval_tokens: Option<usize>,
    packed: bool,
    seed: u64,
) -> Result<(EvalTokens, String)> {
    let shape = Shape {
        batch: 1,
        micro_steps: 1,
        rank: 0,
        world_size: 1,
        seq,
        eval_tokens,
        packed,
        shuffled: false,
    };
    let EvalSetTokens { mut tokens, description, .. } = eval_set(spec, eval, vocab, shape, seed)?;
    let len = 1 + zeroflow_data::eval_windows(tokens.tokens.len(), seq) * seq;
    let len = len.min(tokens.tokens.len());
    tokens.tokens.truncate(len);
    if let Some(mask) = &mut tokens.mask {
        mask.truncate(len);
    }
    if let Some(documents) = &mut tokens.documents {
        documents.retain(|&start| start < len as u64);
    }
    Ok((tokens, description))
}

/// The tokens of an evaluation set, their loss mask, and where packed, where its documents
/// start.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalTokens {
    pub tokens: Vec<u32>,
    /// A byte per token (chat data's loss mask), where there is one.
    pub mask: Option<Vec<u8>>,
    /// Where its documents start (token offsets, ascending), where its rows are packed.
    pub documents: Option<Vec<u64>>,
}

impl EvalTokens {
    /// The tokens `range` of `unit` (where its `documents` start, given, counted from the range's
    /// start: a document that began before it starts again there), widened to u32 alone: a text
    /// file's bytes or a shard's u16 tokens stay as narrow as they are outside it.
    fn of(unit: Unit, documents: Option<Vec<u64>>, range: Range<usize>) -> EvalTokens {
        let mut tokens = vec![0; range.len()];
        unit.tokens.copy_to(range.start, &mut tokens);
        let mask = unit.mask.map(|mask| mask[range.clone()].to_vec());
        let (start, end) = (range.start as u64, range.end as u64);
        let documents = documents.map(|starts| {
            starts.into_iter().filter(|s| (start..end).contains(s)).map(|s| s - start).collect()
        });
        EvalTokens { tokens, mask, documents }
    }
}

/// The first `wanted` tokens of `source`'s files in order (fewer where they hold fewer), with
/// where their documents start where `packed`.
fn leading_tokens(
    source: &Source,
    vocab: usize,
    wanted: usize,
    packed: bool,
    flag: &str,
) -> Result<EvalTokens> {
    let mut out = EvalTokens { tokens: Vec::new(), mask: None, documents: packed.then(Vec::new) };
    let (Source::Shards(paths) | Source::Text(paths)) = source else {
        unreachable!("--eval-data is files")
    };
    for index in 0..paths.len() {
        if out.tokens.len() >= wanted {
            break;
        }
        let unit = read_unit(source, index, vocab).map_err(|e| input(format!("{flag}: {e}")))?;
        let take = unit.tokens.len().min(wanted - out.tokens.len());
        let had = out.tokens.len();
        if let Some(documents) = &mut out.documents {
            let starts =
                read_document_starts(source, index).map_err(|e| input(format!("{flag}: {e}")))?;
            let starts = starts.into_iter().filter(|&s| s < take as u64);
            documents.extend(starts.map(|s| s + had as u64));
        }
        let mut unit = EvalTokens::of(unit, None, 0..take);
        if let Some(mask) = unit.mask.take() {
            out.mask.get_or_insert_with(|| vec![1; had]).extend_from_slice(&mask);
        } else if let Some(mask) = &mut out.mask {
            mask.extend(std::iter::repeat_n(1, take));
        }
        out.tokens.extend_from_slice(&unit.tokens);
    }
    Ok(out)
}

/// The data source of files.
fn source(spec: &Spec, vocab: usize) -> Result<Source> {
    match spec {
        Spec::Shards(paths) => Ok(Source::Shards(paths.clone())),
        Spec::Text(paths) if vocab < 256 => Err(input(format!(
            "--data {} is read as bytes (256 symbols) but the model's vocab_size is {vocab}; \
             drop --model, or give one with vocab_size of at least 256",
            paths[0].display()
        ))),
        Spec::Text(paths) => Ok(Source::Text(paths.clone())),
        Spec::Synthetic => Err(input("--eval-data: give files, not `synthetic`")),
        Spec::Jsonl(paths) => Err(input(format!(
            "{}: a .jsonl is tokenized into shards before the data is opened",
            paths[0].display()
        ))),
    }
}

fn describe(spec: &Spec) -> String {
    match spec {
        Spec::Shards(paths) if paths.len() == 1 => paths[0].display().to_string(),
        Spec::Shards(paths) => format!("{} token shards", paths.len()),
        Spec::Text(paths) if paths.len() == 1 => format!("{} as bytes", paths[0].display()),
        Spec::Text(paths) => format!("{} text files as bytes", paths.len()),
        Spec::Synthetic | Spec::Jsonl(_) => unreachable!("described elsewhere"),
    }
}

/// `n` with commas between groups of three digits.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The synthetic corpus' training source for `shape.micro_steps` micro-batches.
fn synthetic(vocab: usize, shape: Shape, seed: u64) -> Result<(Source, Option<f64>, String)> {
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
    let train = Source::Synthetic { corpus, stream_seed: 2 * seed, len: train_len.min(1 << 26) };
    Ok((train, Some(floor), "the synthetic corpus".into()))
}

#[cfg(test)]
#[path = "data_tests.rs"]
mod held_out_tests;

#[cfg(test)]
mod tests {
    use super::{thousands, wildcard_match};

    #[test]
    fn thousands_are_grouped_by_three() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_048_576), "1,048,576");
    }

    #[test]
    fn wildcards_match_runs_and_single_characters() {
        assert!(wildcard_match("*.bin", "fineweb_train_000001.bin"));
        assert!(wildcard_match("train_??.bin", "train_01.bin"));
        assert!(!wildcard_match("train_??.bin", "train_1.bin"));
        assert!(!wildcard_match("*.bin", "notes.txt"));
        assert!(wildcard_match("*", ""));
    }

    /// `.jsonl` files by glob or in a directory (without shards) are one `Jsonl` spec, in order;
    /// a glob of other files is text; a directory's shards win over its `.jsonl` files; a
    /// directory of neither is refused.
    #[test]
    fn jsonl_files_by_glob_or_directory_are_one_spec() {
        use super::Spec;
        let dir = std::env::temp_dir().join(format!("zeroflow-spec-jsonl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (chats, texts, both) = (dir.join("chats"), dir.join("texts"), dir.join("both"));
        for (folder, names) in [
            (&chats, &["b.jsonl", "a.jsonl", "notes.md"][..]),
            (&texts, &["a.txt", "b.txt"][..]),
            (&both, &["a.jsonl", "s_000.bin"][..]),
        ] {
            std::fs::create_dir_all(folder).unwrap();
            for name in names {
                std::fs::write(folder.join(name), "x").unwrap();
            }
        }
        let parse = |data: &std::path::Path| Spec::parse(data.to_str().unwrap());
        let jsonl = vec![chats.join("a.jsonl"), chats.join("b.jsonl")];
        assert_eq!(parse(&chats).unwrap(), Spec::Jsonl(jsonl.clone()));
        assert_eq!(parse(&chats.join("*.jsonl")).unwrap(), Spec::Jsonl(jsonl));
        let text = vec![texts.join("a.txt"), texts.join("b.txt")];
        assert_eq!(parse(&texts.join("*.txt")).unwrap(), Spec::Text(text.clone()));
        assert_eq!(parse(&both).unwrap(), Spec::Shards(vec![both.join("s_000.bin")]));
        // A directory of text files: its .txt, .text and .md files, in name order.
        std::fs::write(texts.join("c.md"), "x").unwrap();
        std::fs::write(texts.join("LICENSE"), "x").unwrap();
        let markdown = [&text[..], &[texts.join("c.md")]].concat();
        assert_eq!(parse(&texts).unwrap(), Spec::Text(markdown));
        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        std::fs::write(empty.join("LICENSE"), "x").unwrap();
        let error = parse(&empty).unwrap_err().to_string();
        assert!(
            error.contains("no .bin token shards found") && error.contains(".jsonl"),
            "{error}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// JSON Lines named `.json` (as `datasets`' `to_json` writes them) are read as JSON Lines,
    /// alone or in a directory (where other `.json` files are metadata, left out); a directory
    /// that holds held-out splits beside the training one, a dataset of Parquet or Arrow files, a JSON array and a
    /// compressed file are refused naming the file and what to do, never read as text.
    #[test]
    fn json_lines_named_json_are_read_and_tables_arrays_and_archives_refused() {
        use super::Spec;
        let dir =
            std::env::temp_dir().join(format!("zeroflow-spec-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (lines, hub) = (dir.join("lines"), dir.join("hub"));
        let files: [(&std::path::Path, &str, &[u8]); 7] = [
            (&lines, "train.json", b"{\"text\": \"a\"}\n{\"text\": \"b\"}\n"),
            (&lines, "dataset_info.json", b"{\n  \"features\": {}\n}\n"),
            (&lines, "more.jsonl", b"{\"text\": \"c\"}\n"),
            (&hub, "data-00000-of-00001.arrow", b"\xff\xff\xff\xff\x08\x01\x00\x00"),
            (&hub, "dataset_info.json", b"{\n  \"features\": {}\n}\n"),
            (&dir, "alpaca.json", b"[{\"instruction\": \"a\", \"output\": \"b\"}]"),
            (&dir, "train.txt.gz", b"\x1f\x8b\x08\x00\x00"),
        ];
        for (folder, name, bytes) in files {
            std::fs::create_dir_all(folder).unwrap();
            std::fs::write(folder.join(name), bytes).unwrap();
        }
        let parse = |data: &std::path::Path| Spec::parse(data.to_str().unwrap());
        let json = lines.join("train.json");
        assert_eq!(parse(&json).unwrap(), Spec::Jsonl(vec![json.clone()]));
        assert_eq!(parse(&lines).unwrap(), Spec::Jsonl(vec![lines.join("more.jsonl"), json]));
        let refused = |data: &std::path::Path, names: &str, says: &str| {
            let error = parse(data).unwrap_err().to_string();
            assert!(error.contains(names) && error.contains(says), "{error}");
        };
        refused(&hub, "data-00000-of-00001.arrow", "an Arrow file; zeroflow reads text and JSON");
        refused(&hub.join("*.arrow"), "data-00000-of-00001.arrow", "from_file('IN').to_json");
        refused(&dir.join("alpaca.json"), "alpaca.json", "a JSON array");
        refused(&dir.join("train.txt.gz"), "train.txt.gz", "gzip-compressed");
        // Splits side by side (datasets' to_json per split, llm.c's fineweb_train_/fineweb_val_
        // shards): the directory is refused, a glob of the training files is not.
        let (splits, llm_c) = (dir.join("splits"), dir.join("llm_c"));
        for (folder, name) in [
            (&splits, "train.jsonl"),
            (&splits, "test.jsonl"),
            (&llm_c, "fineweb_train_000001.bin"),
            (&llm_c, "fineweb_val_000000.bin"),
        ] {
            std::fs::create_dir_all(folder).unwrap();
            std::fs::write(folder.join(name), "{\"text\": \"x\"}\n").unwrap();
        }
        refused(&splits, "test.jsonl", "*train*.jsonl");
        refused(&llm_c, "fineweb_val_000000.bin", "as --eval-data");
        let train = vec![splits.join("train.jsonl")];
        assert_eq!(parse(&splits.join("*train*.jsonl")).unwrap(), Spec::Jsonl(train));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A range of a unit is widened alone, its mask cut with it, and its documents counted from
    /// its start (one that began before it is not listed: it starts again there).
    #[test]
    fn eval_tokens_are_a_range_of_the_unit() {
        use zeroflow_data::{ShardTokens, Unit};
        let bytes = Unit { tokens: ShardTokens::U8((0..12).collect()), mask: None };
        let tokens = super::EvalTokens::of(bytes, None, 4..10);
        assert_eq!((tokens.tokens, tokens.mask, tokens.documents), ((4..10).collect(), None, None));
        let mask = Some((0..12).map(|i| (i % 3 != 0) as u8).collect::<Vec<_>>());
        let shard = Unit { tokens: ShardTokens::U16((100..112).collect()), mask };
        let tokens = super::EvalTokens::of(shard, Some(vec![0, 5, 9, 10]), 4..10);
        assert_eq!(tokens.tokens, (104..110).collect::<Vec<u32>>());
        assert_eq!(tokens.mask, Some(vec![1, 1, 0, 1, 1, 0]));
        assert_eq!(tokens.documents, Some(vec![1, 5]));
    }
}
