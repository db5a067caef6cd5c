//! Data tokenized at start-up with the model's tokenizer (that of `--init-from`'s directory, or of
//! the run a resumed run continues): `--data FILE.jsonl`, conversations (and documents) with the
//! chat template and their loss masks, and text files where the model comes from a directory, so
//! that a pretrained model is never fed bytes as token ids. They go into token shards in the run
//! directory (`<out>/tokens/rank-N`, `<out>/tokens/eval-rank-N` for `--eval-data`), which the
//! run then trains on as it does on `zeroflow tokenize`'s output. The output depends on the files,
//! the tokenizer's files, a `--chat-template` file and `--chat-template-kwargs`, and the code
//! alone: a start whose sources are unchanged (each file by path, size and modification time, the
//! zeroflow binary among them, and the variables: `Made`) reads the tokens the last start wrote,
//! so that a resume does not tokenize a large corpus again; any other start replaces them, saying
//! what differs. A resumed run reads the same tokens either way.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use zeroflow_data::{
    ChatOptions, TemplateVariables, TokenizeOptions, Tokenizer, count, tokenize_corpus,
};

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

/// Which rank of a job this is, and which of its host's ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankOnHost {
    pub rank: usize,
    pub local_rank: usize,
}

impl RankOnHost {
    /// The rank of its host's local rank 0 (ranks numbered host by host, as launchers number
    /// them).
    fn host_first(&self) -> usize {
        self.rank - self.local_rank.min(self.rank)
    }
}

/// `spec` as the run reads it: a `.jsonl`, and text files where the model comes from the Hugging
/// Face directory `model_dir`, tokenized with that directory's tokenizer (and chat template) into
/// shards under `out`, said in the log; text without a model directory stays bytes (a model
/// trained from scratch), and shards and the synthetic corpus are read as they are.
///
/// The ranks of one host share one tokenization: the host's local rank 0 writes it (into the
/// folder of its rank, `rank-N`: ranks numbered host by host, as launchers number them), and the
/// others wait for its record (`Made`) and read the same shards, instead of each tokenizing the
/// whole corpus on the same cores. Where the sources cannot be described, each rank tokenizes
/// into a folder of its own.
///
/// Conversations are rendered as `chat` says: the model's template or another file, with
/// variables as `apply_chat_template(..., **kwargs)` passes them. The record holds both (the
/// file among the sources), so tokens made otherwise are not reused.
///
/// With `hold_out` (tokens), documents spread over the data (`.jsonl` records, text files read
/// in one piece) are held out for evaluation ([`zeroflow_data::HoldOut`]) into shards of their
/// own under `<tokens>/held-out`, never trained on; where none is (a few long documents), the
/// run holds out a tail as it does of shards. The record holds the tokens asked for.
pub fn tokenized_at_start(
    spec: Spec,
    role: DataRole,
    model_dir: Option<&Path>,
    out: &Path,
    at: RankOnHost,
    chat: &ChatOptions,
    hold_out: Option<u64>,
) -> Result<Tokenized> {
    let flag = role.flag();
    let hold_out = hold_out.filter(|_| matches!(spec, Spec::Jsonl(_) | Spec::Text(_)));
    let recipe = Recipe { variables: &chat.variables, hold_out };
    let (files, dir) = match at_start(spec, model_dir, flag)? {
        AtStart::Tokenize(files, dir) => (files, dir),
        AtStart::AsItIs(spec) => return Ok(Tokenized { spec, held_out: None }),
    };
    let shown = files[0].display();
    let tokenizer = Tokenizer::from_dir(dir).map_err(|e| input(format!("{flag} {shown}: {e}")))?;
    let template = chat.template(&tokenizer).map_err(|e| input(format!("{flag} {shown}: {e}")))?;
    let sources = sources(&files, dir, chat.template.as_deref());
    let writer = if sources.is_some() { at.host_first() } else { at.rank };
    let tokens = out.join("tokens").join(role.folder(writer));
    if let (Some(sources), true) = (&sources, writer != at.rank) {
        return wait_for(&tokens, sources, &recipe, flag, at);
    }
    if let Some(made) = read_again_or_clear(&tokens, sources.as_deref(), &recipe, flag)? {
        return Ok(made);
    }
    let mut options = TokenizeOptions::new(tokens.clone(), template.as_ref());
    options.hold_out = hold_out.map(|tokens_wanted| zeroflow_data::HoldOut {
        out_dir: held_out_dir(&tokens),
        tokens: tokens_wanted,
    });
    let progress = Progress::new(&files, PROGRESS_INTERVAL);
    let said = |bytes| {
        if let Some(line) = progress.advance(bytes) {
            tracing::info!("{flag}: tokenizing with {}'s tokenizer: {line}", dir.display());
        }
    };
    let summary = match tokenize_corpus(&tokenizer, &files, &options, &said) {
        Ok(summary) => summary,
        Err(error) => {
            let message = failure(error, flag, dir, &files[0]);
            // Said to the host's other ranks, which wait for these tokens.
            if let Some(sources) = sources {
                let failed = Failed { sources, error: message.clone() };
                let _ = failed.write(&tokens);
            }
            return Err(input(message));
        }
    };
    tracing::info!("{}", summary.describe(&tokens));
    if let Some(sources) = sources {
        // Written last: a start cut short while tokenizing leaves no record, and the next one
        // tokenizes again. A record that cannot be written only costs the next start the time.
        if let Err(error) = Made::of(sources, &recipe, &summary).write(&tokens) {
            tracing::warn!(
                "cannot record what {} was tokenized from ({error}): the next start tokenizes again",
                tokens.display()
            );
        }
    }
    Ok(Tokenized::of(summary.shards, summary.held_out.map(|held| held.shards)))
}

/// What start-up does with a data spec ([`at_start`]).
enum AtStart<'a> {
    /// Tokenizes these files with the tokenizer of this model directory.
    Tokenize(Vec<PathBuf>, &'a Path),
    /// Reads the spec as it is: shards, the synthetic corpus, or text as bytes for a model
    /// trained from scratch.
    AsItIs(Spec),
}

/// Whether `spec` (given as `flag`) is tokenized at start-up: a `.jsonl`, and text where the
/// model comes from the directory `model_dir`; an error that says what to do where a `.jsonl`
/// has no model directory, or text's model directory has no tokenizer.
fn at_start<'a>(spec: Spec, model_dir: Option<&'a Path>, flag: &str) -> Result<AtStart<'a>> {
    match (spec, model_dir) {
        (Spec::Jsonl(jsonl), Some(dir)) => Ok(AtStart::Tokenize(jsonl, dir)),
        (Spec::Jsonl(jsonl), None) => Err(input(format!(
            "{flag} {}: a .jsonl is tokenized with the model's tokenizer and chat template; give \
             --init-from a Hugging Face directory that has a tokenizer.json (or tokenize it first \
             with `zeroflow tokenize` and train on the directory)",
            jsonl[0].display()
        ))),
        (Spec::Text(paths), Some(dir)) if !dir.join("tokenizer.json").is_file() => {
            Err(input(format!(
                "{flag} {} is text and the model comes from {}, which has no tokenizer.json: a \
                 pretrained model reads its own tokens, not bytes; put the model's tokenizer.json \
                 in that directory, or tokenize the text first (`zeroflow tokenize --tokenizer T \
                 FILE... --out DIR`) and give {flag} DIR",
                paths[0].display(),
                dir.display()
            )))
        }
        (Spec::Text(paths), Some(dir)) => Ok(AtStart::Tokenize(paths, dir)),
        (spec, _) => Ok(AtStart::AsItIs(spec)),
    }
}

/// The tokens the last start wrote into `tokens` from the same `sources` and `recipe`, said in
/// the log; else none, the folder cleared (with a warning where an earlier start's record says
/// what they were made from).
fn read_again_or_clear(
    tokens: &Path,
    sources: Option<&[Source]>,
    recipe: &Recipe<'_>,
    flag: &str,
) -> Result<Option<Tokenized>> {
    if let Some(made) = sources.and_then(|sources| Made::read_if(tokens, sources, recipe)) {
        tracing::info!(
            "{flag}: {} of {} in {} in {}, tokenized at the last start from the same files and \
             tokenizer: read again, not tokenized again",
            count(made.summary.tokens, "token"),
            count(made.summary.documents, "document"),
            count(made.summary.shards.len() as u64, "shard"),
            tokens.display()
        );
        return Ok(Some(made.tokenized(tokens)));
    }
    if tokens.exists() {
        let earlier = read_json::<Made>(&tokens.join(MADE_FILE));
        if let (Some(earlier), Some(sources)) = (earlier, sources) {
            tracing::warn!(
                "{flag}: the tokens in {} were made from other sources ({}): tokenizing again; a \
                 run resumed from a checkpoint of those tokens goes on in these",
                tokens.display(),
                earlier.differs_from(sources, recipe)
            );
        }
        std::fs::remove_dir_all(tokens)
            .map_err(|e| input(format!("cannot clear {}: {e}", tokens.display())))?;
    }
    Ok(None)
}

/// What a failed tokenizing of `flag`'s files (the first `first`) with `dir`'s tokenizer says.
fn failure(error: zeroflow_data::TokenizeError, flag: &str, dir: &Path, first: &Path) -> String {
    match error {
        // The first line bad: more likely a file of another format than a bad line.
        zeroflow_data::TokenizeError::BadLine { path, line: 1, message } => {
            format!("{flag} {}:1: {message}", path.display())
        }
        // `train` has no --skip-bad-lines, which the error names for `zeroflow tokenize`.
        zeroflow_data::TokenizeError::BadLine { path, line, message } => format!(
            "{flag} {}:{line}: {message}; fix or remove the line, or tokenize the file with \
             `zeroflow tokenize --tokenizer {} {} --out DIR --skip-bad-lines` (which skips such \
             lines) and give {flag} DIR",
            path.display(),
            dir.display(),
            path.display()
        ),
        error => format!("{flag} {}: {error}", first.display()),
    }
}

/// Data as a run reads it ([`tokenized_at_start`]).
#[derive(Debug)]
pub struct Tokenized {
    pub spec: Spec,
    /// The documents held out of it for evaluation, where asked for and some were.
    pub held_out: Option<Spec>,
}

impl Tokenized {
    fn of(shards: Vec<PathBuf>, held_out: Option<Vec<PathBuf>>) -> Tokenized {
        let held_out = held_out.filter(|shards| !shards.is_empty()).map(Spec::Shards);
        Tokenized { spec: Spec::Shards(shards), held_out }
    }
}

/// The folder of a tokens folder that holds its held-out documents' shards.
fn held_out_dir(tokens: &Path) -> PathBuf {
    tokens.join(zeroflow_data::HELD_OUT_DIR)
}

/// What a tokenizing depends on besides its sources: the chat template's variables, and the
/// tokens held out for evaluation.
#[derive(Clone, Copy, Debug)]
struct Recipe<'a> {
    variables: &'a TemplateVariables,
    hold_out: Option<u64>,
}

/// The file under a tokens folder that records what its tokens were made from.
const MADE_FILE: &str = "made-from.json";

/// The file under a tokens folder that says its tokenizing failed, and why.
const FAILED_FILE: &str = "failed.json";

/// How often a rank that waits for its host's tokens says so.
const WAIT_SAID_EVERY: Duration = Duration::from_secs(30);

/// A rank other than its host's first: the shards the first writes into `tokens` from
/// `sources`, once its record says they are there; its error where it failed. Waits without
/// limit, saying so every [`WAIT_SAID_EVERY`]: a launcher stops every rank when one fails.
fn wait_for(
    tokens: &Path,
    sources: &[Source],
    recipe: &Recipe<'_>,
    flag: &str,
    at: RankOnHost,
) -> Result<Tokenized> {
    let (started, mut said) = (Instant::now(), Instant::now());
    loop {
        if let Some(made) = Made::read_if(tokens, sources, recipe) {
            tracing::debug!("rank {}: {flag}: the tokens in {}", at.rank, tokens.display());
            return Ok(made.tokenized(tokens));
        }
        if let Some(failed) = Failed::read_if(tokens, sources) {
            return Err(input(format!(
                "{} (as rank {} found, which tokenizes for this host)",
                failed.error,
                at.host_first()
            )));
        }
        if said.elapsed() >= WAIT_SAID_EVERY {
            tracing::info!(
                "rank {}: waiting for rank {} to tokenize {flag} into {} ({:.0} s)",
                at.rank,
                at.host_first(),
                tokens.display(),
                started.elapsed().as_secs_f64()
            );
            said = Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What a failed tokenizing leaves for the ranks that wait for it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Failed {
    sources: Vec<Source>,
    error: String,
}

impl Failed {
    fn write(&self, tokens: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(tokens)?;
        write_json(&tokens.join(FAILED_FILE), self)
    }

    /// The failure under `tokens` of a tokenizing from `sources` (not an earlier start's).
    fn read_if(tokens: &Path, sources: &[Source]) -> Option<Failed> {
        read_json::<Failed>(&tokens.join(FAILED_FILE)).filter(|failed| failed.sources == sources)
    }
}

/// Writes `value` as JSON to `path`.
fn write_json(path: &Path, value: &impl serde::Serialize) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(std::io::Error::other)?;
    std::fs::write(path, text)
}

/// The JSON of `path` as a `T`, where it is there and reads as one.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// One file the tokens depend on, as the file system describes it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Source {
    path: PathBuf,
    bytes: u64,
    modified_ns: u128,
}

impl Source {
    fn of(path: &Path) -> Option<Source> {
        let path = std::path::absolute(path).ok()?;
        let meta = std::fs::metadata(&path).ok()?;
        let modified = meta.modified().ok()?.duration_since(std::time::UNIX_EPOCH).ok()?;
        Some(Source { path, bytes: meta.len(), modified_ns: modified.as_nanos() })
    }
}

/// What tokenizing the `files` with the tokenizer of the model directory `dir` depends on: the
/// files, the tokenizer's own (`tokenizer.json`, and `tokenizer_config.json` and
/// `chat_template.jinja` where there) and the running binary, whose code does the tokenizing.
/// `None` where one of them cannot be described (nothing is then reused or recorded).
fn sources(files: &[PathBuf], dir: &Path, template: Option<&Path>) -> Option<Vec<Source>> {
    let mut all: Vec<Source> = files.iter().map(|file| Source::of(file)).collect::<Option<_>>()?;
    if let Some(template) = template {
        all.push(Source::of(template)?);
    }
    all.push(Source::of(&dir.join("tokenizer.json"))?);
    for optional in ["tokenizer_config.json", "chat_template.jinja"] {
        if dir.join(optional).exists() {
            all.push(Source::of(&dir.join(optional))?);
        }
    }
    all.push(Source::of(&std::env::current_exe().ok()?)?);
    Some(all)
}

/// The record of a tokens folder: what its tokens were made from (the files, the chat
/// template's variables and the tokens held out), and what tokenizing wrote (its shards by
/// their names in the folder, and the held-out ones' in theirs).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Made {
    sources: Vec<Source>,
    #[serde(default)]
    chat_template_kwargs: TemplateVariables,
    #[serde(default)]
    hold_out: Option<u64>,
    summary: zeroflow_data::TokenizeSummary,
}

impl Made {
    fn of(
        sources: Vec<Source>,
        recipe: &Recipe<'_>,
        summary: &zeroflow_data::TokenizeSummary,
    ) -> Made {
        let names = |shards: &[PathBuf]| -> Vec<PathBuf> {
            shards.iter().filter_map(|shard| shard.file_name()).map(PathBuf::from).collect()
        };
        let mut summary = summary.clone();
        summary.shards = names(&summary.shards);
        if let Some(held) = summary.held_out.as_deref_mut() {
            held.shards = names(&held.shards);
        }
        let chat_template_kwargs = recipe.variables.clone();
        Made { sources, chat_template_kwargs, hold_out: recipe.hold_out, summary }
    }

    fn write(&self, tokens: &Path) -> std::io::Result<()> {
        write_json(&tokens.join(MADE_FILE), self)
    }

    /// The record under `tokens` where it was made from `sources` by `recipe` and every shard
    /// it names is there.
    fn read_if(tokens: &Path, sources: &[Source], recipe: &Recipe<'_>) -> Option<Made> {
        let made = read_json::<Made>(&tokens.join(MADE_FILE))?;
        let tokenized = made.tokenized(tokens);
        let held_out = tokenized.held_out.as_ref().map(Spec::files).unwrap_or_default();
        let shards = tokenized.spec.files();
        let whole = !shards.is_empty() && shards.iter().chain(held_out).all(|s| s.is_file());
        let same = made.sources == sources
            && &made.chat_template_kwargs == recipe.variables
            && made.hold_out == recipe.hold_out;
        (same && whole).then_some(made)
    }

    /// How this record's sources differ from `sources` and `recipe`: the first difference, said
    /// for a user (a file changed, new or no longer used; other variables; another evaluation
    /// set; else a shard gone).
    fn differs_from(&self, sources: &[Source], recipe: &Recipe<'_>) -> String {
        let variables = recipe.variables;
        let old = |path: &Path| self.sources.iter().find(|s| s.path == path);
        for source in sources {
            match old(&source.path) {
                None => return format!("{} is new", source.path.display()),
                Some(old) if old != source => {
                    return format!("{} changed", source.path.display());
                }
                Some(_) => {}
            }
        }
        if let Some(gone) = self.sources.iter().find(|s| !sources.iter().any(|n| n.path == s.path))
        {
            return format!("{} is no longer read", gone.path.display());
        }
        if &self.chat_template_kwargs != variables {
            return "other --chat-template-kwargs".into();
        }
        if self.hold_out != recipe.hold_out {
            return "another evaluation set (--eval-data, --eval-tokens)".into();
        }
        "a shard of them is missing".into()
    }

    /// The data it records, under `tokens`.
    fn tokenized(&self, tokens: &Path) -> Tokenized {
        let under = |dir: &Path, shards: &[PathBuf]| shards.iter().map(|s| dir.join(s)).collect();
        let held_out = self.summary.held_out.as_deref();
        let held_out = held_out.map(|held| under(&held_out_dir(tokens), &held.shards));
        Tokenized::of(under(tokens, &self.summary.shards), held_out)
    }
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

    /// The record of a tokens folder is reused only for the same sources and where its shards
    /// are there: a data file rewritten (its time or size changed), a tokenizer file added, or a
    /// shard gone, and it is not.
    #[test]
    fn tokens_are_reused_only_from_the_same_sources() {
        let dir = std::env::temp_dir().join(format!("zeroflow-made-{}", std::process::id()));
        let (model, tokens) = (dir.join("model"), dir.join("tokens"));
        std::fs::create_dir_all(&model).unwrap();
        std::fs::create_dir_all(&tokens).unwrap();
        let corpus = dir.join("corpus.txt");
        std::fs::write(&corpus, "some text\n").unwrap();
        std::fs::write(model.join("tokenizer.json"), "{}").unwrap();
        std::fs::write(tokens.join("tokens_000000.bin"), [0u8; 8]).unwrap();
        let files = [corpus.clone()];
        let made_from = sources(&files, &model, None).expect("every source is there");
        assert_eq!(made_from.len(), 3, "the corpus, tokenizer.json and this binary: {made_from:?}");
        let summary = zeroflow_data::TokenizeSummary {
            documents: 1,
            conversations: 0,
            turn_by_turn: 0,
            tokens: 4,
            assistant_tokens: 0,
            bad_lines: 0,
            input_bytes: 10,
            shards: vec![tokens.join("tokens_000000.bin")],
            held_out: None,
        };
        let no_variables = TemplateVariables::new();
        let none = Recipe { variables: &no_variables, hold_out: None };
        assert_eq!(Made::read_if(&tokens, &made_from, &none), None, "nothing recorded yet");
        Made::of(made_from.clone(), &none, &summary).write(&tokens).unwrap();
        let made = Made::read_if(&tokens, &made_from, &none).expect("the same sources");
        assert_eq!(made.tokenized(&tokens).spec.files(), summary.shards);
        assert_eq!(made.summary.tokens, 4);
        // Other variables for the chat template make other tokens.
        let mut thinking = TemplateVariables::new();
        thinking.insert("enable_thinking".into(), serde_json::json!(false));
        let variables = Recipe { variables: &thinking, hold_out: None };
        assert_eq!(Made::read_if(&tokens, &made_from, &variables), None);
        // Records held out for evaluation, or another number of their tokens, make other shards.
        let held_out = Recipe { variables: &no_variables, hold_out: Some(1000) };
        assert_eq!(Made::read_if(&tokens, &made_from, &held_out), None);
        // The corpus written again, a second later: its time differs.
        let later = std::time::SystemTime::now() + Duration::from_secs(1);
        std::fs::File::options().write(true).open(&corpus).unwrap().set_modified(later).unwrap();
        assert_eq!(Made::read_if(&tokens, &sources(&files, &model, None).unwrap(), &none), None);
        let made_from = sources(&files, &model, None).unwrap();
        Made::of(made_from.clone(), &none, &summary).write(&tokens).unwrap();
        assert!(Made::read_if(&tokens, &made_from, &none).is_some());
        // A template file given (`--chat-template`) is a source too.
        let given = dir.join("given.jinja");
        std::fs::write(&given, "{{ messages }}").unwrap();
        let with_file = sources(&files, &model, Some(&given)).unwrap();
        assert_eq!(with_file.len(), made_from.len() + 1, "{with_file:?}");
        assert_eq!(Made::read_if(&tokens, &with_file, &none), None);
        // What differs, said: the first source that is new, changed or gone, else the variables,
        // else a shard.
        let made = Made::read_if(&tokens, &made_from, &none).unwrap();
        assert_eq!(made.differs_from(&with_file, &none), format!("{} is new", given.display()));
        assert_eq!(
            made.differs_from(&made_from[1..], &none),
            format!("{} is no longer read", made_from[0].path.display())
        );
        let mut touched = made_from.clone();
        touched[0].bytes += 1;
        let changed = format!("{} changed", made_from[0].path.display());
        assert_eq!(made.differs_from(&touched, &none), changed);
        assert_eq!(made.differs_from(&made_from, &variables), "other --chat-template-kwargs");
        let other_eval = "another evaluation set (--eval-data, --eval-tokens)";
        assert_eq!(made.differs_from(&made_from, &held_out), other_eval);
        assert_eq!(made.differs_from(&made_from, &none), "a shard of them is missing");
        // A chat template beside the tokenizer changes what a conversation becomes.
        std::fs::write(model.join("chat_template.jinja"), "{{ messages }}").unwrap();
        assert_eq!(Made::read_if(&tokens, &sources(&files, &model, None).unwrap(), &none), None);
        std::fs::remove_file(tokens.join("tokens_000000.bin")).unwrap();
        assert_eq!(Made::read_if(&tokens, &made_from, &none), None, "a shard is gone");
        std::fs::remove_dir_all(&dir).unwrap();
    }

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
