//! Data tokenized at start-up with the model's tokenizer (that of `--init-from`'s directory, or of
//! the run a resumed run continues): `--data FILE.jsonl`, conversations (and documents) with the
//! chat template and their loss masks, and text files where the model comes from a directory, so
//! that a pretrained model is never fed bytes as token ids. They go into token shards in the run
//! directory (`<out>/tokens/rank-N`, `<out>/tokens/eval-rank-N` for `--eval-data`, replaced at
//! every start: the output depends on the files and the tokenizer alone, so a resumed run reads
//! the same tokens), which the run then trains on as it does on `zeroflow tokenize`'s output.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use zeroflow_data::{ChatTemplate, TokenizeOptions, Tokenizer, tokenize_corpus};

use crate::data::Spec;
use crate::error::{Result, input};

/// Which of the run's data a [`Spec`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataRole {
    /// `--data`: tokenized into `<out>/tokens/rank-N`.
    Train,
    /// `--eval-data`: tokenized into `<out>/tokens/eval-rank-N`.
    Eval,
}

impl DataRole {
    fn flag(self) -> &'static str {
        match self {
            DataRole::Train => "--data",
            DataRole::Eval => "--eval-data",
        }
    }

    fn folder(self, rank: usize) -> String {
        match self {
            DataRole::Train => format!("rank-{rank}"),
            DataRole::Eval => format!("eval-rank-{rank}"),
        }
    }
}

/// `spec` as the run reads it: a `.jsonl`, and text files where the model comes from the Hugging
/// Face directory `model_dir`, tokenized with that directory's tokenizer (and chat template) into
/// shards under `out` for `rank`, said in the log; text without a model directory stays bytes (a
/// model trained from scratch), and shards and the synthetic corpus are read as they are.
pub fn tokenized_at_start(
    spec: Spec,
    role: DataRole,
    model_dir: Option<&Path>,
    out: &Path,
    rank: usize,
) -> Result<Spec> {
    let flag = role.flag();
    let (files, dir) = match (spec, model_dir) {
        (Spec::Jsonl(jsonl), Some(dir)) => (vec![jsonl], dir),
        (Spec::Jsonl(jsonl), None) => {
            return Err(input(format!(
                "{flag} {}: a .jsonl is tokenized with the model's tokenizer and chat template; \
                 give --init-from a Hugging Face directory that has a tokenizer.json (or \
                 tokenize it first with `zeroflow tokenize` and train on the directory)",
                jsonl.display()
            )));
        }
        (Spec::Text(paths), Some(dir)) if !dir.join("tokenizer.json").is_file() => {
            return Err(input(format!(
                "{flag} {} is text and the model comes from {}, which has no tokenizer.json: a \
                 pretrained model reads its own tokens, not bytes; put the model's tokenizer.json \
                 in that directory, or tokenize the text first (`zeroflow tokenize --tokenizer T \
                 FILE... --out DIR`) and give {flag} DIR",
                paths[0].display(),
                dir.display()
            )));
        }
        (Spec::Text(paths), Some(dir)) => (paths, dir),
        (spec, _) => return Ok(spec),
    };
    let shown = files[0].display();
    let tokenizer = Tokenizer::from_dir(dir).map_err(|e| input(format!("{flag} {shown}: {e}")))?;
    let template = ChatTemplate::from_config(tokenizer.config())
        .transpose()
        .map_err(|e| input(format!("{flag} {shown}: {e}")))?;
    let tokens = out.join("tokens").join(role.folder(rank));
    if tokens.exists() {
        std::fs::remove_dir_all(&tokens)
            .map_err(|e| input(format!("cannot clear {}: {e}", tokens.display())))?;
    }
    let options = TokenizeOptions {
        out_dir: tokens.clone(),
        shard_tokens: 100_000_000,
        skip_bad_lines: false,
        chat_template: template.as_ref(),
    };
    let progress = Progress::new(&files, PROGRESS_INTERVAL);
    let said = |bytes| {
        if let Some(line) = progress.advance(bytes) {
            tracing::info!("{flag}: tokenizing with {}'s tokenizer: {line}", dir.display());
        }
    };
    let summary = tokenize_corpus(&tokenizer, &files, &options, &said)
        .map_err(|e| input(format!("{flag} {shown}: {e}")))?;
    tracing::info!("{}", summary.describe(&tokens));
    Ok(Spec::Shards(summary.shards))
}

/// How often a long tokenization at start-up says how far it is.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(30);

/// The input bytes tokenized so far of all there are, said at most once an interval.
struct Progress {
    total: u64,
    interval: Duration,
    /// Bytes done, and when it last said so.
    state: Mutex<(u64, Instant)>,
}

impl Progress {
    fn new(files: &[PathBuf], interval: Duration) -> Progress {
        let total = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
        Progress { total, interval, state: Mutex::new((0, Instant::now())) }
    }

    /// `bytes` more are done: the line to say, where an interval has passed since the last one.
    fn advance(&self, bytes: u64) -> Option<String> {
        let mut state = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.0 += bytes;
        if state.1.elapsed() < self.interval {
            return None;
        }
        state.1 = Instant::now();
        let mb = |bytes: u64| bytes as f64 / 1e6;
        let percent = 100.0 * state.0 as f64 / self.total.max(1) as f64;
        Some(format!("{:.1} of {:.1} MB ({percent:.0} %)", mb(state.0), mb(self.total)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each advance adds its bytes; a line comes once the interval has passed, with the bytes
    /// done of the files' sizes, and not again within it.
    #[test]
    fn progress_says_the_bytes_done_of_the_total_once_an_interval() {
        let dir = std::env::temp_dir().join(format!("zeroflow-progress-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = [dir.join("a.txt"), dir.join("b.txt")];
        std::fs::write(&files[0], vec![b'a'; 3_000_000]).unwrap();
        std::fs::write(&files[1], vec![b'b'; 1_000_000]).unwrap();
        let every_time = Progress::new(&files, Duration::ZERO);
        assert_eq!(every_time.advance(1_000_000).as_deref(), Some("1.0 of 4.0 MB (25 %)"));
        assert_eq!(every_time.advance(2_000_000).as_deref(), Some("3.0 of 4.0 MB (75 %)"));
        let hourly = Progress::new(&files, Duration::from_secs(3600));
        assert_eq!(hourly.advance(4_000_000), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
