//! `zeroflow tokenize`'s library part: text files, `.jsonl` documents (`{"text": ...}`) and
//! `.jsonl` conversations (`{"messages": [...]}`) into llm.c token shards, each with a document
//! index and, where it holds a conversation, a loss mask (formats in docs/data-formats.md).
//!
//! Inputs are read in order, in batches of about [`BATCH_BYTES`]; the units of a batch (lines of
//! a `.jsonl`, pieces of text files) are tokenized on all cores and written in input order, so the
//! shards do not depend on the number of threads. A plain text file is one document, read and
//! encoded in pieces of about [`TEXT_PIECE_BYTES`] that end at a line break (`read_text`): a
//! file of one piece is encoded whole, as the tokenizer encodes the string; a longer one piece by
//! piece (special tokens such as a BOS only before the first), its tokens differing from the whole
//! string's at most where two pieces meet. Encoding a file whole holds about 200 bytes per byte of
//! text (the tokenizer's per-token strings and offsets): 21 GB for a 94 MiB file, on one core.

use std::borrow::Cow;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde_json::Value as Json;
use thiserror::Error;

use crate::chat::{ChatTemplate, Conversation, Encoded};
use crate::input::{InputKind, input_kind};
use crate::shard::{TokenWidth, write_document_index, write_loss_mask, write_shard_as};
use crate::tokenizer::Tokenizer;

/// About how many input bytes are tokenized at once. Each batch ends by waiting for its longest
/// document, which one thread encodes alone while the others idle; with 16 threads a batch of
/// 4 MiB is a fifth of a second of work, which one long document can nearly double, so batches
/// are larger (the batch and its tokens are what the process holds at a time).
pub const BATCH_BYTES: usize = 32 << 20;

/// About how many bytes of a text file are encoded at once ([`TokenizeOptions::text_piece_bytes`]'s
/// default): a piece ends at a line break at or after this many bytes, or, where a line runs on
/// for four times as many more, before a space or at a character boundary there (`piece_end`).
/// Each piece's encoding holds about 200 bytes per byte of text while it runs (one a thread).
pub const TEXT_PIECE_BYTES: usize = 1 << 20;

/// The tokens a shard takes before it is closed, where nothing says otherwise.
pub const DEFAULT_SHARD_TOKENS: usize = 100_000_000;

/// How to tokenize a corpus.
#[derive(Debug)]
pub struct TokenizeOptions<'a> {
    /// The directory the shards go to (created; it must not hold shards already).
    pub out_dir: PathBuf,
    /// A shard is closed before a document that would take it past this many tokens (a longer
    /// document gets a shard of its own; only a text file's goes on into the next shards, a
    /// piece at a time, each shard's index starting it anew).
    pub shard_tokens: usize,
    /// Go on past a bad `.jsonl` line (and count it) instead of stopping.
    pub skip_bad_lines: bool,
    /// The chat template for conversations.
    pub chat_template: Option<&'a ChatTemplate>,
    /// The size of the pieces a text file is encoded in ([`TEXT_PIECE_BYTES`]).
    pub text_piece_bytes: usize,
    /// Documents held out of the shards for evaluation, into shards of their own.
    pub hold_out: Option<HoldOut>,
}

/// The folder of a tokenized directory that holds its held-out documents' shards
/// ([`HoldOut`]): `zeroflow tokenize --hold-out`'s, and the run directory's tokens'.
pub const HELD_OUT_DIR: &str = "held-out";

/// Documents written apart from the training shards, as an evaluation set: about `tokens`
/// tokens, at most a tenth of the input's, in documents spread evenly over the input, each whole
/// on one side (no conversation is in both): `.jsonl` records, and text files read in one piece
/// ([`TEXT_PIECE_BYTES`]); a longer text file is one document, none of which is held out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HoldOut {
    /// The directory their shards go to (created; it must not hold shards already).
    pub out_dir: PathBuf,
    pub tokens: u64,
}

impl<'a> TokenizeOptions<'a> {
    /// Into `out_dir`, conversations through `chat_template`: shards of [`DEFAULT_SHARD_TOKENS`],
    /// no bad line skipped, text in pieces of [`TEXT_PIECE_BYTES`].
    pub fn new(out_dir: PathBuf, chat_template: Option<&'a ChatTemplate>) -> Self {
        TokenizeOptions {
            out_dir,
            shard_tokens: DEFAULT_SHARD_TOKENS,
            skip_bad_lines: false,
            chat_template,
            text_piece_bytes: TEXT_PIECE_BYTES,
            hold_out: None,
        }
    }
}

/// What a tokenize run wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenizeSummary {
    pub documents: u64,
    pub conversations: u64,
    /// Conversations written as a document per assistant turn (their template renders a turn
    /// differently once later messages follow: [`crate::ChatTemplate::assistant_spans`]).
    #[serde(default)]
    pub turn_by_turn: u64,
    /// Tokens written, end-of-text tokens included.
    pub tokens: u64,
    /// Tokens of conversations that the loss mask keeps (the assistant's).
    pub assistant_tokens: u64,
    pub bad_lines: u64,
    pub input_bytes: u64,
    pub shards: Vec<PathBuf>,
    /// What went to the held-out shards ([`TokenizeOptions::hold_out`]), where asked for (its
    /// `input_bytes` 0: the input's are all counted above).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_out: Option<Box<TokenizeSummary>>,
}

impl TokenizeSummary {
    /// What was written to `out`, as `zeroflow tokenize` says it: one line, and a second where
    /// bad lines were skipped.
    pub fn describe(&self, out: &Path) -> String {
        let mut text = format!(
            "wrote {} ({}, {}), {} in {} to {}",
            count(self.documents, "document"),
            count(self.conversations, "conversation"),
            count(self.assistant_tokens, "assistant token"),
            count(self.tokens, "token"),
            count(self.shards.len() as u64, "shard"),
            out.display()
        );
        if self.turn_by_turn > 0 {
            text.push_str(&format!(
                "\n{} of {} written as a document per assistant turn, the conversation \
                 through that turn: the chat template renders a turn differently once later \
                 messages follow (as Qwen3's drops earlier turns' reasoning)",
                self.turn_by_turn,
                count(self.conversations, "conversation"),
            ));
        }
        if self.bad_lines > 0 {
            text.push_str(&format!("\nskipped {}", count(self.bad_lines, "bad line")));
        }
        match self.held_out.as_deref() {
            Some(held) if held.documents == 0 => text.push_str(
                "\nheld out for evaluation: no document (each is longer than its share of the \
                 tokens to hold out; a run holds out the end of the data instead)",
            ),
            Some(held) => {
                let dir = held.shards.first().and_then(|shard| shard.parent());
                text.push_str(&format!(
                    "\nheld out for evaluation, spread over the input and never trained on: {} \
                     ({}, {}), {}{}",
                    count(held.documents, "document"),
                    count(held.conversations, "conversation"),
                    count(held.assistant_tokens, "assistant token"),
                    count(held.tokens, "token"),
                    dir.map(|dir| format!(" in {}", dir.display())).unwrap_or_default()
                ));
            }
            None => {}
        }
        text
    }
}

/// `n` and `what`, plural but for one: "1 document", "3 documents".
pub fn count(n: u64, what: &str) -> String {
    match n {
        1 => format!("1 {what}"),
        _ => format!("{n} {what}s"),
    }
}

/// What [`tokenize_corpus`] will do with `tokenizer` and `template`, as `zeroflow tokenize` says
/// before it starts: the tokenizer, its vocabulary and end-of-text token, the shards' token
/// width, and how the conversations' assistant tokens are found.
pub fn describe_setup(tokenizer: &Tokenizer, template: Option<&ChatTemplate>) -> String {
    let eot = match tokenizer.eot() {
        Some(id) => format!("end-of-text {id}"),
        None => "no end-of-text token".into(),
    };
    let width = match TokenWidth::for_vocab(tokenizer.vocab_size()) {
        TokenWidth::U16 => "u16",
        TokenWidth::U32 => "u32",
    };
    let (name, vocab) = (tokenizer.name(), tokenizer.vocab_size());
    let mut text = format!("tokenizer {name} (vocabulary {vocab}, {eot}): {width} shards");
    if let Some(template) = template {
        let how = if template.has_generation_markers() {
            "assistant tokens from its {% generation %} markers"
        } else {
            "assistant tokens by rendering prefixes (no {% generation %} markers)"
        };
        text.push_str(&format!("\nchat template {}: {how}", template.path().display()));
        match template.turn_end(tokenizer) {
            Some(id) => {
                let token = tokenizer.decode(&[id]).unwrap_or_default();
                text.push_str(&format!("; a reply ends with {token} ({id})"));
            }
            None => text.push_str("; a reply ends with no special token"),
        }
    }
    text
}

/// Why a corpus could not be tokenized.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum TokenizeError {
    /// A `.jsonl` line that is not a document or conversation (file and 1-based line number).
    #[error("{}:{line}: {message}{}", path.display(), skip_advice(*.line))]
    BadLine { path: PathBuf, line: u64, message: String },
    /// An input file that cannot be read or tokenized.
    #[error("{}: {message}", path.display())]
    Input { path: PathBuf, message: String },
    /// The output cannot be written.
    #[error("{}: {message}", path.display())]
    Output { path: PathBuf, message: String },
    /// A tokenizer without an end-of-text token to put between documents.
    #[error(
        "the tokenizer {0} has no end-of-text token to put between documents (tokenizer_config.json's \
         eos_token names it)"
    )]
    NoEndOfText(String),
}

/// What a bad line's error adds: that `--skip-bad-lines` skips it, unless it is the first line,
/// which more likely says the whole file is of another format than that one line is bad.
fn skip_advice(line: u64) -> &'static str {
    match line {
        1 => "",
        _ => " (--skip-bad-lines skips such lines)",
    }
}

/// One unit of input: a `.jsonl` line or a piece of a text file.
struct Unit {
    input: usize,
    place: Place,
    bytes: Vec<u8>,
}

/// Where a unit is in its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// A `.jsonl` line, counted from 1.
    Line(u64),
    /// A piece of a text file, from this byte on (0: the first, which starts its document).
    Text(u64),
}

/// A tokenized document: its tokens, and for a conversation its loss mask.
struct Document {
    tokens: Vec<u32>,
    mask: Option<Vec<u8>>,
}

/// Tokenizes `inputs` into shards in `options.out_dir`; `progress` is called with the input
/// bytes each batch consumed.
pub fn tokenize_corpus(
    tokenizer: &Tokenizer,
    inputs: &[PathBuf],
    options: &TokenizeOptions<'_>,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<TokenizeSummary, TokenizeError> {
    if tokenizer.eot().is_none() && !tokenizer.is_bytes() {
        return Err(TokenizeError::NoEndOfText(tokenizer.name().into()));
    }
    // Every input's kind before any is read: a file that cannot be read is refused at once.
    let kinds = inputs
        .iter()
        .map(|path| {
            input_kind(path).map_err(|message| TokenizeError::Input { path: path.clone(), message })
        })
        .collect::<Result<Vec<_>, _>>()?;
    prepare_out_dir(&options.out_dir)?;
    let per_thread = tokenizer.per_thread();
    let mut writers = Writers {
        train: ShardWriter::new(tokenizer, &options.out_dir, options.shard_tokens),
        held_out: match &options.hold_out {
            Some(hold_out) => {
                prepare_out_dir(&hold_out.out_dir)?;
                let writer = ShardWriter::new(tokenizer, &hold_out.out_dir, options.shard_tokens);
                let sizes = inputs
                    .iter()
                    .map(|path| std::fs::metadata(path).map_err(|e| input_error(path, e)))
                    .map(|meta| meta.map(|meta| meta.len()))
                    .collect::<Result<Vec<u64>, _>>()?;
                Some((writer, Split::new(hold_out.tokens, sizes)))
            }
            None => None,
        },
    };
    let mut batch = Batch::default();
    for (input, (path, kind)) in inputs.iter().zip(kinds).enumerate() {
        let mut flush = |unit: Unit, writers: &mut Writers<'_>| {
            writers.train.summary.input_bytes += unit.bytes.len() as u64;
            let Some((units, consumed)) = batch.push(unit) else { return Ok(()) };
            process_batch(&per_thread, inputs, units, options, writers)?;
            progress(consumed as u64);
            Ok(())
        };
        if kind == InputKind::JsonLines {
            read_lines(path, input, &mut |unit| flush(unit, &mut writers))?;
        } else {
            let piece = options.text_piece_bytes.max(1);
            read_text(path, input, piece, &mut |unit| flush(unit, &mut writers))?;
        }
    }
    let (units, consumed) = batch.take();
    process_batch(&per_thread, inputs, units, options, &mut writers)?;
    progress(consumed as u64);
    let mut summary = writers.train.finish()?;
    if let Some((writer, _)) = writers.held_out {
        summary.held_out = Some(Box::new(writer.finish()?));
    }
    Ok(summary)
}

/// Where a corpus's documents are written: the training shards, and the held-out ones with
/// the rule that chooses them, where asked for.
struct Writers<'a> {
    train: ShardWriter<'a>,
    held_out: Option<(ShardWriter<'a>, Split)>,
}

/// Which documents are held out ([`HoldOut`]): a `.jsonl` record or a text file read in one
/// piece is, where the tokens held out so far, with half of its own, stay below the goal times
/// the fraction of the input read through it. The goal is [`HoldOut::tokens`], at most a tenth
/// of the input's tokens as estimated from the tokens per byte of the units tokenized so far
/// (all of them, for an input of one batch). The documents held out are so spread evenly over
/// the input, and the same for any number of threads (batches end at the same bytes).
#[derive(Debug)]
struct Split {
    wanted: u64,
    /// Each input's bytes, and all of them.
    sizes: Vec<u64>,
    input_bytes: u64,
    /// Bytes and tokens of the units decided, and of those held out.
    bytes: u64,
    tokens: u64,
    held: u64,
}

impl Split {
    fn new(wanted: u64, sizes: Vec<u64>) -> Split {
        let input_bytes = sizes.iter().sum();
        Split { wanted, sizes, input_bytes, bytes: 0, tokens: 0, held: 0 }
    }

    /// Whether `unit` is a whole document: a `.jsonl` record, or a text file of one piece (a
    /// piece of a longer one is not held out of it).
    fn whole(&self, unit: &Unit) -> bool {
        match unit.place {
            Place::Line(_) => true,
            Place::Text(offset) => offset == 0 && unit.bytes.len() as u64 == self.sizes[unit.input],
        }
    }

    /// The tokens to hold out of the whole input, by the units decided and a batch of
    /// `batch_bytes` and `batch_tokens` about to be.
    fn goal(&self, batch_bytes: u64, batch_tokens: u64) -> f64 {
        let (bytes, tokens) = (self.bytes + batch_bytes, self.tokens + batch_tokens);
        let input_bytes = self.input_bytes.max(bytes).max(1);
        let estimate = tokens as f64 * input_bytes as f64 / bytes.max(1) as f64;
        (self.wanted as f64).min(estimate / 10.0)
    }

    /// Whether the next unit, of `bytes` and `tokens` (`whole`: a document, [`Split::whole`]),
    /// is held out, with the batch's `goal`.
    fn hold(&mut self, goal: f64, bytes: u64, tokens: u64, whole: bool) -> bool {
        self.bytes += bytes;
        self.tokens += tokens;
        let through = goal * self.bytes as f64 / self.input_bytes.max(self.bytes).max(1) as f64;
        let hold = whole && tokens > 0 && (self.held as f64 + tokens as f64 / 2.0) < through;
        if hold {
            self.held += tokens;
        }
        hold
    }
}

/// Units gathered until they hold [`BATCH_BYTES`] of input, then tokenized on all cores at once.
#[derive(Default)]
struct Batch {
    units: Vec<Unit>,
    bytes: usize,
}

impl Batch {
    /// Adds `unit`; where the batch is now full, its units and their bytes, taken.
    fn push(&mut self, unit: Unit) -> Option<(Vec<Unit>, usize)> {
        self.bytes += unit.bytes.len();
        self.units.push(unit);
        (self.bytes >= BATCH_BYTES).then(|| self.take())
    }

    /// The units gathered and their bytes, leaving the batch empty.
    fn take(&mut self) -> (Vec<Unit>, usize) {
        (std::mem::take(&mut self.units), std::mem::take(&mut self.bytes))
    }
}

/// The tokens of a text file as [`tokenize_corpus`] encodes it with the same `piece` bytes
/// ([`TEXT_PIECE_BYTES`]: in pieces on all cores), without the end-of-text token it puts before a
/// document: what `eval` reads a text file as.
pub fn encode_text_file(
    tokenizer: &Tokenizer,
    path: &Path,
    piece: usize,
) -> Result<Vec<u32>, TokenizeError> {
    let per_thread = tokenizer.per_thread();
    let (mut tokens, mut batch) = (Vec::new(), Batch::default());
    let mut encode = |batch: Vec<Unit>| -> Result<(), TokenizeError> {
        let pieces: Vec<_> = batch
            .par_iter()
            .map(|unit| {
                let Place::Text(offset) = unit.place else { unreachable!("text pieces only") };
                text_piece(thread_copy(&per_thread), &unit.bytes, offset)
            })
            .collect();
        for piece in pieces {
            tokens.extend(piece.map_err(|message| input_error(path, message))?.tokens);
        }
        Ok(())
    };
    read_text(path, 0, piece.max(1), &mut |unit| match batch.push(unit) {
        Some((units, _)) => encode(units),
        None => Ok(()),
    })?;
    encode(batch.take().0)?;
    Ok(tokens)
}

fn input_error(path: &Path, e: impl ToString) -> TokenizeError {
    TokenizeError::Input { path: path.into(), message: e.to_string() }
}

fn output_error(path: &Path, e: impl ToString) -> TokenizeError {
    TokenizeError::Output { path: path.into(), message: e.to_string() }
}

/// Creates the output directory; refuses one that holds shards or a manifest already.
fn prepare_out_dir(dir: &Path) -> Result<(), TokenizeError> {
    std::fs::create_dir_all(dir).map_err(|e| output_error(dir, e))?;
    let entries = std::fs::read_dir(dir).map_err(|e| output_error(dir, e))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(SHARD_PREFIX) || name == MANIFEST {
            let message = format!("already holds {name}; give an empty or new directory");
            return Err(output_error(dir, message));
        }
    }
    Ok(())
}

/// Calls `each` with every line of a `.jsonl` file (its number counted from 1).
fn read_lines(
    path: &Path,
    input: usize,
    each: &mut dyn FnMut(Unit) -> Result<(), TokenizeError>,
) -> Result<(), TokenizeError> {
    let file = std::fs::File::open(path).map_err(|e| input_error(path, e))?;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let mut line = 0;
    loop {
        let mut bytes = Vec::new();
        if reader.read_until(b'\n', &mut bytes).map_err(|e| input_error(path, e))? == 0 {
            return Ok(());
        }
        line += 1;
        each(Unit { input, place: Place::Line(line), bytes })?;
    }
}

/// Calls `each` with the pieces of a text file in order ([`pieces`]).
fn read_text(
    path: &Path,
    input: usize,
    piece: usize,
    each: &mut dyn FnMut(Unit) -> Result<(), TokenizeError>,
) -> Result<(), TokenizeError> {
    let file = std::fs::File::open(path).map_err(|e| input_error(path, e))?;
    let read_error = |e| input_error(path, e);
    pieces(file, piece, read_error, &mut |offset, bytes| {
        each(Unit { input, place: Place::Text(offset), bytes })
    })
}

/// Calls `each` with the pieces of the text `reader` reads, in order, and the byte each starts
/// at (one, empty, for an empty text): each ends where [`piece_end`] says, read a window of five
/// pieces at a time.
fn pieces<E>(
    mut reader: impl std::io::Read,
    piece: usize,
    read_error: impl Fn(std::io::Error) -> E,
    each: &mut dyn FnMut(u64, Vec<u8>) -> Result<(), E>,
) -> Result<(), E> {
    let window = 5 * piece;
    let (mut carry, mut offset) = (Vec::new(), 0u64);
    loop {
        let mut bytes = std::mem::take(&mut carry);
        let missing = window.saturating_sub(bytes.len()) as u64;
        let mut more = std::io::Read::take(&mut reader, missing);
        std::io::Read::read_to_end(&mut more, &mut bytes).map_err(&read_error)?;
        let end_of_text = bytes.len() < window;
        carry = bytes.split_off(piece_end(&bytes, piece, end_of_text));
        let len = bytes.len() as u64;
        each(offset, bytes)?;
        offset += len;
        if end_of_text && carry.is_empty() {
            return Ok(());
        }
    }
}

/// Where the piece that starts `window` (at most five pieces of text) ends: after the first line
/// break from `piece` bytes to twice as many between two characters that are not white space
/// (where GPT-2's and Llama-3's splits both cut, so that the pieces' tokens are the text's), else
/// after the first line break from `piece` bytes on; where there is none, at the window's end if
/// it is the end of the text (`last`), else before the first space from `piece` bytes on (a word
/// keeps the space before it, as byte-level splits keep it), else before a character that starts
/// within its last four bytes (a UTF-8 character is at most four), which the next piece begins
/// with.
fn piece_end(window: &[u8], piece: usize, last: bool) -> usize {
    let after = |byte: u8, from: usize| {
        window.get(from..).and_then(|tail| tail.iter().position(|&b| b == byte)).map(|at| from + at)
    };
    let white = |at: usize| window.get(at).is_none_or(u8::is_ascii_whitespace);
    // Looked for within a second piece's length: code, whose lines start with white space, has
    // few, and a longer piece holds more memory while it is encoded.
    let clean_break = (piece.max(2) - 1..(2 * piece).min(window.len().saturating_sub(1)))
        .find(|&at| window[at] == b'\n' && !white(at - 1) && !white(at + 1));
    match clean_break.or_else(|| after(b'\n', piece - 1)) {
        _ if last && window.len() <= piece => window.len(),
        Some(line_break) => line_break + 1,
        None if last => window.len(),
        None if let Some(space) = after(b' ', piece) => space,
        None => (window.len().saturating_sub(3)..window.len())
            .rev()
            .find(|&at| at > 0 && (window[at] & 0xC0) != 0x80)
            .unwrap_or(window.len()),
    }
}

/// `text` encoded in the pieces a text file of it would be read in ([`pieces`], [`text_piece`]).
/// A text of one piece is encoded whole.
fn encode_in_pieces(tokenizer: &Tokenizer, text: &str, piece: usize) -> Result<Vec<u32>, String> {
    let mut tokens = Vec::new();
    pieces(text.as_bytes(), piece, |e| e.to_string(), &mut |offset, bytes| {
        tokens.extend(text_piece(tokenizer, &bytes, offset)?.tokens);
        Ok(())
    })?;
    Ok(tokens)
}

/// This rayon thread's copy of the tokenizer ([`Tokenizer::per_thread`]).
fn thread_copy(per_thread: &[Tokenizer]) -> &Tokenizer {
    &per_thread[rayon::current_thread_index().unwrap_or(0) % per_thread.len()]
}

/// Tokenizes a batch on all cores, each thread with its copy of the tokenizer
/// ([`Tokenizer::per_thread`]), then writes its documents in order.
fn process_batch(
    per_thread: &[Tokenizer],
    inputs: &[PathBuf],
    units: Vec<Unit>,
    options: &TokenizeOptions<'_>,
    writers: &mut Writers<'_>,
) -> Result<(), TokenizeError> {
    let template = options.chat_template;
    let documents: Vec<_> = units
        .par_iter()
        .map(|unit| {
            let tokenizer = thread_copy(per_thread);
            match unit.place {
                Place::Line(_) => {
                    json_line(tokenizer, template, &unit.bytes, options.text_piece_bytes.max(1))
                }
                Place::Text(offset) => text_piece(tokenizer, &unit.bytes, offset).map(Line::Text),
            }
        })
        .collect();
    let tokens = |document: &Result<Line, String>| match document {
        Ok(Line::Text(document)) => document.tokens.len() as u64,
        Ok(Line::Conversation(conversation)) => {
            conversation.documents.iter().map(|(tokens, _)| tokens.len() as u64).sum()
        }
        Ok(Line::Blank) | Err(_) => 0,
    };
    let goal = writers.held_out.as_ref().map(|(_, split)| {
        let bytes = units.iter().map(|unit| unit.bytes.len() as u64).sum();
        split.goal(bytes, documents.iter().map(tokens).sum())
    });
    for (unit, document) in units.iter().zip(documents) {
        let path = &inputs[unit.input];
        let writer = match (&mut writers.held_out, goal) {
            (Some((held_out, split)), Some(goal)) => {
                let (bytes, whole) = (unit.bytes.len() as u64, split.whole(unit));
                match split.hold(goal, bytes, tokens(&document), whole) {
                    true => held_out,
                    false => &mut writers.train,
                }
            }
            _ => &mut writers.train,
        };
        match (document, unit.place) {
            (Ok(Line::Text(document)), Place::Text(offset)) if offset > 0 => {
                writer.go_on(document)?
            }
            (Ok(Line::Text(document)), _) => writer.push(document)?,
            (Ok(Line::Conversation(conversation)), _) => {
                writer.summary.conversations += 1;
                writer.summary.turn_by_turn += u64::from(conversation.turn_by_turn);
                for (tokens, mask) in conversation.documents {
                    writer.push(Document { tokens, mask: Some(mask) })?;
                }
            }
            (Ok(Line::Blank), _) => {}
            (Err(_), Place::Line(_)) if options.skip_bad_lines => writer.summary.bad_lines += 1,
            (Err(message), Place::Line(line)) => {
                return Err(TokenizeError::BadLine { path: path.clone(), line, message });
            }
            (Err(message), Place::Text(_)) => return Err(input_error(path, message)),
        }
    }
    Ok(())
}

/// A piece of a text file from its byte `offset` on: the start of its document (offset 0,
/// encoded with the tokenizer's special tokens) or more of it (without them). It must be UTF-8
/// unless the tokens are its bytes.
fn text_piece(tokenizer: &Tokenizer, bytes: &[u8], offset: u64) -> Result<Document, String> {
    if tokenizer.is_bytes() {
        return Ok(Document { tokens: bytes.iter().map(|&b| u32::from(b)).collect(), mask: None });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| {
        format!("not UTF-8 (invalid bytes at offset {})", offset + e.valid_up_to() as u64)
    })?;
    let tokens = match offset {
        0 => tokenizer.encode(text)?,
        _ => tokenizer.encode_more(text)?,
    };
    Ok(Document { tokens, mask: None })
}

/// What a unit of input is: a document of text (or more of one), a conversation (its documents
/// and masks), or a blank line.
enum Line {
    Blank,
    Text(Document),
    Conversation(Conversation<Encoded>),
}

/// A `.jsonl` line: nothing (blank), a document (encoded in pieces of `piece` bytes, as a text
/// file), a conversation, or what is wrong with it.
fn json_line(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    bytes: &[u8],
    piece: usize,
) -> Result<Line, String> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Line::Blank);
    }
    let json: Json = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if let Some(text) = json.get("text") {
        let text = text.as_str().ok_or("\"text\" is not a string")?;
        // A long document (a book) in pieces, as a text file of it: bounded memory per thread.
        let tokens = encode_in_pieces(tokenizer, text, piece)?;
        return Ok(Line::Text(Document { tokens, mask: None }));
    }
    if let (Some(prompt), Some(completion)) = (json.get("prompt"), json.get("completion")) {
        return prompt_completion(tokenizer, template, prompt, completion);
    }
    let messages: Cow<'_, [Json]> = match (json.get("messages"), json.get("conversations")) {
        (Some(messages), _) => {
            Cow::Borrowed(messages.as_array().ok_or("\"messages\" is not a list")?)
        }
        (None, Some(turns)) => Cow::Owned(sharegpt_messages(turns)?),
        (None, None) if json.get("instruction").is_some() && json.get("output").is_some() => {
            return Err(ALPACA.into());
        }
        (None, None) => {
            return Err("expected a JSON object with \"text\" (a string), \"messages\" (a list \
                        of {\"role\", \"content\"}), \"conversations\" (ShareGPT's list of \
                        {\"from\", \"value\"}), or \"prompt\" and \"completion\""
                .into());
        }
    };
    let conversation = chat(template)?.encode(tokenizer, &messages).map_err(|e| e.to_string())?;
    Ok(Line::Conversation(conversation))
}

/// What an Alpaca record (`instruction`, `input`, `output`) is said to need: a conversion into
/// conversations, the instruction and input as the user's message.
const ALPACA: &str = "an Alpaca record (\"instruction\", \"input\", \"output\"), which is not \
                      read as it is: convert the file into conversations, e.g. `jq -c \
                      '{messages: [{role: \"user\", content: ([.instruction, .input] | \
                      map(select(. != null and . != \"\")) | join(\"\\n\\n\"))}, {role: \
                      \"assistant\", content: .output}]}' IN.jsonl > OUT.jsonl`";

/// The template that a conversation needs, or what to do without one.
fn chat(template: Option<&ChatTemplate>) -> Result<&ChatTemplate, String> {
    template.ok_or_else(|| {
        "a conversation, but the tokenizer has no chat_template (give --chat-template FILE)".into()
    })
}

/// A prompt-completion pair (TRL's form), trained on the completion only:
/// - strings, as TRL's `SFTTrainer` makes them: the ids of `prompt + completion` (the
///   tokenizer's special tokens added) and the end-of-text token where they do not end with it,
///   the completion's those after as many as `prompt` alone has (the end-of-text token trained
///   too);
/// - lists of messages: the conversation `prompt + completion` through the chat template,
///   trained on the completion's assistant messages only.
fn prompt_completion(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    prompt: &Json,
    completion: &Json,
) -> Result<Line, String> {
    match (prompt, completion) {
        (Json::String(prompt), Json::String(completion)) => {
            let before = tokenizer.encode(prompt)?.len();
            let mut tokens = tokenizer.encode(&format!("{prompt}{completion}"))?;
            if let Some(eot) = tokenizer.eot()
                && tokens.last() != Some(&eot)
            {
                tokens.push(eot);
            }
            let before = before.min(tokens.len());
            let mask = [vec![0; before], vec![1; tokens.len() - before]].concat();
            Ok(Line::Conversation(Conversation::whole((tokens, mask))))
        }
        (Json::Array(prompt), Json::Array(completion)) => {
            let messages = [&prompt[..], &completion[..]].concat();
            let conversation = chat(template)?
                .encode_from(tokenizer, &messages, prompt.len())
                .map_err(|e| e.to_string())?;
            Ok(Line::Conversation(conversation))
        }
        _ => Err("\"prompt\" and \"completion\" are both strings or both lists of messages".into()),
    }
}

/// ShareGPT's `"conversations": [{"from": "human", "value": "..."}, ...]` as `messages`: `human`
/// and `user` are the user, `gpt` and `assistant` the assistant, `system` the system prompt.
fn sharegpt_messages(turns: &Json) -> Result<Vec<Json>, String> {
    let turns = turns.as_array().ok_or("\"conversations\" is not a list")?;
    let message = |(i, turn): (usize, &Json)| {
        let field = |name: &str| turn.get(name).and_then(Json::as_str);
        let (Some(from), Some(value)) = (field("from"), field("value")) else {
            return Err(format!("conversations[{i}] is not {{\"from\": ..., \"value\": ...}}"));
        };
        let role = match from {
            "human" | "user" => "user",
            "gpt" | "assistant" => "assistant",
            "system" => "system",
            other => {
                return Err(format!(
                    "conversations[{i}]: \"from\": {other:?} is not human, gpt or system (write \
                     such turns as \"messages\" with the roles the chat template knows)"
                ));
            }
        };
        Ok(serde_json::json!({"role": role, "content": value}))
    };
    turns.iter().enumerate().map(message).collect()
}

const SHARD_PREFIX: &str = "tokens_";
const MANIFEST: &str = "manifest.json";

/// The tokenizer a directory of `zeroflow tokenize`'s shards was made with, as its
/// `manifest.json` names it: its name and vocabulary size, and the manifest's path; `None` where
/// the directory has no such manifest (llm.c's own shards).
pub fn manifest_tokenizer(dir: &Path) -> Option<(String, u64, PathBuf)> {
    let path = dir.join(MANIFEST);
    let manifest: Json = serde_json::from_str(&std::fs::read_to_string(&path).ok()?).ok()?;
    let vocab = manifest["vocab_size"].as_u64()?;
    let name = manifest["tokenizer"].as_str().unwrap_or("another tokenizer").to_owned();
    Some((name, vocab, path))
}

/// Whether a JSON Lines file's first record is a conversation (`messages`, or ShareGPT's
/// `conversations`), which the chat template renders; its first line alone is read.
pub fn first_record_is_conversation(path: &Path) -> bool {
    let Ok(file) = std::fs::File::open(path) else { return false };
    let mut lines = std::io::BufReader::new(file).lines().map_while(std::result::Result::ok);
    let first = lines.find(|line| !line.trim().is_empty());
    let record = first.and_then(|line| serde_json::from_str::<Json>(&line).ok());
    record.is_some_and(|r| r.get("messages").or(r.get("conversations")).is_some())
}

/// Collects documents into shards and writes each with its index and mask.
struct ShardWriter<'a> {
    tokenizer: &'a Tokenizer,
    out_dir: &'a Path,
    shard_tokens: usize,
    width: TokenWidth,
    tokens: Vec<u32>,
    mask: Vec<u8>,
    has_conversation: bool,
    document_starts: Vec<u64>,
    manifest_shards: Vec<Json>,
    summary: TokenizeSummary,
}

impl<'a> ShardWriter<'a> {
    fn new(tokenizer: &'a Tokenizer, out_dir: &'a Path, shard_tokens: usize) -> Self {
        ShardWriter {
            tokenizer,
            out_dir,
            shard_tokens,
            width: TokenWidth::for_vocab(tokenizer.vocab_size()),
            tokens: Vec::new(),
            mask: Vec::new(),
            has_conversation: false,
            document_starts: Vec::new(),
            manifest_shards: Vec::new(),
            summary: TokenizeSummary::default(),
        }
    }

    /// Appends a document, preceded by the end-of-text token (as llm.c's data scripts do).
    fn push(&mut self, document: Document) -> Result<(), TokenizeError> {
        let eot: Vec<u32> = self.tokenizer.eot().into_iter().collect();
        let len = eot.len() + document.tokens.len();
        if !self.tokens.is_empty() && self.tokens.len() + len > self.shard_tokens {
            self.write_shard()?;
        }
        self.document_starts.push(self.tokens.len() as u64);
        self.tokens.extend_from_slice(&eot);
        self.tokens.extend_from_slice(&document.tokens);
        self.mask.extend(eot.iter().map(|_| 0));
        self.summary.documents += 1;
        self.summary.tokens += len as u64;
        match document.mask {
            Some(mask) => {
                self.has_conversation = true;
                self.summary.assistant_tokens += mask.iter().map(|&m| u64::from(m)).sum::<u64>();
                self.mask.extend_from_slice(&mask);
            }
            None => self.mask.extend(document.tokens.iter().map(|_| 1)),
        }
        Ok(())
    }

    /// Appends more of the last document (the next piece of a text file): no end-of-text token
    /// before it, no new document. Where it would take the shard past its limit, the shard is
    /// written and the document goes on in the next, whose index starts there.
    fn go_on(&mut self, more: Document) -> Result<(), TokenizeError> {
        if !self.tokens.is_empty() && self.tokens.len() + more.tokens.len() > self.shard_tokens {
            self.write_shard()?;
            self.document_starts.push(0);
        }
        self.summary.tokens += more.tokens.len() as u64;
        self.mask.extend(more.tokens.iter().map(|_| 1));
        self.tokens.extend_from_slice(&more.tokens);
        Ok(())
    }

    fn write_shard(&mut self) -> Result<(), TokenizeError> {
        let stem = format!("{SHARD_PREFIX}{:06}", self.summary.shards.len());
        let dir = self.out_dir;
        let (bin, idx, mask) = (
            dir.join(format!("{stem}.bin")),
            dir.join(format!("{stem}.idx")),
            dir.join(format!("{stem}.mask")),
        );
        write_shard_as(&bin, self.width, &self.tokens).map_err(|e| output_error(&bin, e))?;
        self.document_starts.push(self.tokens.len() as u64);
        write_document_index(&idx, &self.document_starts).map_err(|e| output_error(&idx, e))?;
        let file_name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
        let mask_name = if self.has_conversation {
            write_loss_mask(&mask, &self.mask).map_err(|e| output_error(&mask, e))?;
            file_name(&mask)
        } else {
            None
        };
        self.manifest_shards.push(serde_json::json!({
            "tokens": file_name(&bin),
            "documents": file_name(&idx),
            "loss_mask": mask_name,
            "token_count": self.tokens.len(),
            "document_count": self.document_starts.len() - 1,
        }));
        self.summary.shards.push(bin);
        self.tokens.clear();
        self.mask.clear();
        self.document_starts.clear();
        self.has_conversation = false;
        Ok(())
    }

    /// Writes the last shard and `manifest.json`.
    fn finish(mut self) -> Result<TokenizeSummary, TokenizeError> {
        if !self.tokens.is_empty() {
            self.write_shard()?;
        }
        let summary = &self.summary;
        let manifest = serde_json::json!({
            "tokenizer": self.tokenizer.name(),
            "vocab_size": self.tokenizer.vocab_size(),
            "end_of_text": self.tokenizer.eot(),
            "token_width": match self.width { TokenWidth::U16 => "u16", TokenWidth::U32 => "u32" },
            "documents": summary.documents,
            "conversations": summary.conversations,
            "tokens": summary.tokens,
            "assistant_tokens": summary.assistant_tokens,
            "bad_lines": summary.bad_lines,
            "shards": self.manifest_shards,
        });
        let path = self.out_dir.join(MANIFEST);
        let text = serde_json::to_string_pretty(&manifest).expect("JSON values serialize");
        std::fs::write(&path, text + "\n").map_err(|e| output_error(&path, e))?;
        Ok(self.summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `.jsonl` line and a text file read in one piece are whole documents, which may be held
    /// out; a piece of a longer text file, its first included, is not (the rest of its document
    /// would go on after another's).
    #[test]
    fn only_whole_documents_are_held_out() {
        let split = Split::new(100, vec![10, 500, 40]);
        let unit = |input, place, len| Unit { input, place, bytes: vec![b'a'; len] };
        assert!(split.whole(&unit(0, Place::Text(0), 10)), "a text file of one piece");
        assert!(!split.whole(&unit(1, Place::Text(0), 100)), "the first piece of a longer one");
        assert!(!split.whole(&unit(1, Place::Text(100), 400)), "its last piece");
        assert!(split.whole(&unit(2, Place::Line(3), 12)), "a record");
    }

    /// Held out where the tokens held out, with half of the unit's, stay below the goal times
    /// the input read through the unit: none of a unit larger than twice that share.
    #[test]
    fn a_unit_is_held_out_where_the_held_out_tokens_lag_their_share() {
        let mut split = Split::new(1000, vec![1000]);
        // The goal of 10 tokens: at 400 of the 1,000 bytes, 4 are due; a unit of 10 is not held.
        assert!(!split.hold(10.0, 400, 10, true));
        // At 1,000 bytes, 10 are due and none held: a unit of 10 (half of it, 5, below) is.
        assert!(split.hold(10.0, 600, 10, true));
        assert_eq!(split.held, 10);
        assert!(!split.hold(10.0, 0, 2, true), "none due past the goal");
        assert!(!split.hold(100.0, 0, 2, false), "a piece of a document never");
    }
}
