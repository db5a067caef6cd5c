//! What kind of input a data file is ([`input_kind`]): JSON Lines (`.jsonl`, or a `.json` whose
//! first line is a JSON object, as `datasets`' `to_json` writes them), or text. Files that are
//! neither — Parquet and Arrow (the Hugging Face Hub's datasets), a JSON array, compressed or
//! other binary files — are refused with what to do, rather than trained on as text.

use std::io::{BufRead, Read};
use std::path::Path;

/// How a data file is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// Plain text: the file is one document.
    Text,
    /// JSON Lines: one `{"text": …}`, `{"messages": […]}` (or another chat form) per line.
    JsonLines,
}

/// The bytes looked at for a binary file's signs.
const SNIFF_BYTES: u64 = 64 << 10;

/// The most bytes of a `.json` file's first line read to see whether it is a JSON object.
const FIRST_LINE_BYTES: u64 = 256 << 20;

/// How to turn a dataset of records into JSON Lines, with Python's `datasets`.
const CONVERT: &str = "convert it to JSON Lines, e.g. `python -c \"import datasets; \
                       datasets.Dataset.from_{format}('IN').to_json('OUT.jsonl')\"`";

/// The kind of input `path` is, or why zeroflow cannot read it (a sentence that says what to do).
pub fn input_kind(path: &Path) -> Result<InputKind, String> {
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
    let extension = extension.to_ascii_lowercase();
    let mut head = Vec::new();
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    file.take(SNIFF_BYTES).read_to_end(&mut head).map_err(|e| e.to_string())?;
    if let Some(refused) = refused(&extension, &head) {
        return Err(refused);
    }
    match extension.as_str() {
        "jsonl" | "ndjson" => Ok(InputKind::JsonLines),
        "json" => json_kind(path, &head),
        _ => Ok(InputKind::Text),
    }
}

/// The JSON Lines files of the directory `dir`, in name order ([`json_lines_of`] its files).
pub fn json_lines_in(dir: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        files.push(entry?.path());
    }
    files.sort();
    Ok(json_lines_of(&files))
}

/// The JSON Lines files of `files` (a directory's), in their order: the `.jsonl` and `.ndjson`
/// files, and the `.json` files that are JSON Lines (others, such as the `dataset_info.json` of
/// a saved dataset, are metadata: left out).
pub fn json_lines_of(files: &[std::path::PathBuf]) -> Vec<std::path::PathBuf> {
    let lines = |path: &&std::path::PathBuf| {
        let extension = path.extension().and_then(|e| e.to_str()).unwrap_or_default();
        let lines = match extension.to_ascii_lowercase().as_str() {
            "jsonl" | "ndjson" => true,
            "json" => input_kind(path) == Ok(InputKind::JsonLines),
            _ => false,
        };
        lines && path.is_file()
    };
    files.iter().filter(lines).cloned().collect()
}

/// Why the directory `dir`, whose files are `files`, is not read whole, where it mixes a
/// training split with held-out ones (`held_out_splits`): a sentence that names them and ends
/// with the glob of the training files to give instead (for the caller to go on from).
pub fn held_out_refusal(dir: &Path, files: &[std::path::PathBuf]) -> Option<String> {
    let held_out = held_out_splits(files);
    let first = held_out.first()?;
    let names: Vec<String> = held_out
        .iter()
        .take(3)
        .map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned())
        .collect();
    let more = match held_out.len() {
        n if n > 3 => format!(" and {} more", n - 3),
        _ => String::new(),
    };
    let extension = first.extension().and_then(|e| e.to_str()).unwrap_or("jsonl");
    Some(format!(
        "the directory holds held-out splits beside the training data ({}{more}), which it \
         would train on; give the training files (a glob such as {})",
        names.join(", "),
        dir.join(format!("*train*.{extension}")).display()
    ))
}

/// The files of `files` (a directory's) named as a held-out split — a word of the name `test`,
/// `val`, `valid`, `validation`, `eval` or `dev` (`test.jsonl`, `fineweb_val_000000.bin`) —
/// where others beside them are not: a directory that mixes a training split with held-out
/// ones, which read whole would train on the held-out data. Empty otherwise.
fn held_out_splits(files: &[std::path::PathBuf]) -> Vec<&std::path::PathBuf> {
    const HELD_OUT: [&str; 6] = ["test", "val", "valid", "validation", "eval", "dev"];
    let held_out = |path: &std::path::PathBuf| {
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let stem = stem.to_ascii_lowercase();
        stem.split(|c: char| !c.is_ascii_alphanumeric()).any(|word| HELD_OUT.contains(&word))
    };
    let named: Vec<_> = files.iter().filter(|path| held_out(path)).collect();
    if named.len() == files.len() { Vec::new() } else { named }
}

/// Why a file of this extension and first bytes is not read, where it is not.
fn refused(extension: &str, head: &[u8]) -> Option<String> {
    let signature = |magic: &[u8]| head.starts_with(magic);
    let format = if extension == "parquet" || signature(b"PAR1") {
        Some(("a Parquet file", "parquet"))
    } else if extension == "arrow" || signature(b"ARROW1") || signature(b"\xff\xff\xff\xff") {
        Some(("an Arrow file", "file"))
    } else {
        None
    };
    if let Some((what, format)) = format {
        let convert = CONVERT.replace("{format}", format);
        return Some(format!("{what}; zeroflow reads text and JSON Lines: {convert}"));
    }
    let compressed = [
        (&b"\x1f\x8b"[..], "gzip"),
        (b"\x28\xb5\x2f\xfd", "zstd"),
        (b"BZh", "bzip2"),
        (b"\xfd7zXZ\x00", "xz"),
        (b"PK\x03\x04", "zip"),
        (b"7z\xbc\xaf\x27\x1c", "7z"),
    ];
    if let Some((_, name)) = compressed.iter().find(|(magic, _)| signature(magic)) {
        return Some(format!(
            "{name}-compressed; zeroflow reads text and JSON Lines as they are: decompress it \
             first"
        ));
    }
    head.iter().position(|&b| b == 0).map(|at| {
        format!(
            "a binary file (a zero byte at offset {at}), not text; zeroflow reads text, JSON \
             Lines (.jsonl), and llm.c token shards (.bin)"
        )
    })
}

/// A `.json` file: JSON Lines where its first line is a JSON object, else refused.
fn json_kind(path: &Path, head: &[u8]) -> Result<InputKind, String> {
    let first = head.iter().find(|b| !b.is_ascii_whitespace());
    if first == Some(&b'[') {
        return Err("a JSON array; zeroflow reads JSON Lines (one object per line): convert it, \
                    e.g. `jq -c '.[]' IN.json > OUT.jsonl` or `python -c \"import datasets; \
                    datasets.Dataset.from_json('IN.json').to_json('OUT.jsonl')\"`"
            .into());
    }
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut line = Vec::new();
    std::io::BufReader::new(file.take(FIRST_LINE_BYTES))
        .read_until(b'\n', &mut line)
        .map_err(|e| e.to_string())?;
    match serde_json::from_slice::<serde_json::Value>(&line) {
        Ok(serde_json::Value::Object(_)) => Ok(InputKind::JsonLines),
        _ => Err("not JSON Lines (its first line is not a JSON object); zeroflow reads a .json \
                  file of one {\"text\": …} or {\"messages\": […]} object per line, as \
                  `datasets`' to_json writes it"
            .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind_of(name: &str, bytes: &[u8]) -> Result<InputKind, String> {
        let dir = std::env::temp_dir().join(format!("zeroflow-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let kind = input_kind(&path);
        std::fs::remove_file(&path).unwrap();
        kind
    }

    #[test]
    fn text_and_json_lines_are_read_by_their_kind() {
        assert_eq!(kind_of("a.txt", b"some text\n"), Ok(InputKind::Text));
        assert_eq!(kind_of("notes", "héllo".as_bytes()), Ok(InputKind::Text));
        assert_eq!(kind_of("a.csv", b"prompt,reply\nhi,there\n"), Ok(InputKind::Text));
        assert_eq!(kind_of("a.jsonl", b"{\"text\": \"x\"}\n"), Ok(InputKind::JsonLines));
        assert_eq!(kind_of("a.JSONL", b"{\"text\": \"x\"}\n"), Ok(InputKind::JsonLines));
        assert_eq!(kind_of("a.ndjson", b"{\"text\": \"x\"}\n"), Ok(InputKind::JsonLines));
        // datasets' to_json: JSON Lines named .json, CRLF or not, the last line unended.
        let lines = b"  {\"messages\": []}\r\n{\"text\": \"y\"}";
        assert_eq!(kind_of("train.json", lines), Ok(InputKind::JsonLines));
        assert_eq!(kind_of("empty.jsonl", b""), Ok(InputKind::JsonLines));
        assert_eq!(kind_of("empty.txt", b""), Ok(InputKind::Text));
    }

    #[test]
    fn held_out_splits_beside_a_training_split_are_found_by_name() {
        let paths = |names: &[&str]| names.iter().map(std::path::PathBuf::from).collect::<Vec<_>>();
        let found = |names: &[&str]| -> Vec<String> {
            let files = paths(names);
            held_out_splits(&files).iter().map(|p| p.display().to_string()).collect()
        };
        let llm_c = ["fineweb_train_000001.bin", "fineweb_val_000000.bin"];
        assert_eq!(found(&llm_c), ["fineweb_val_000000.bin"]);
        let splits = ["d/train.jsonl", "d/test.jsonl", "d/Validation-00000.json", "d/dev.jsonl"];
        assert_eq!(found(&splits), ["d/test.jsonl", "d/Validation-00000.json", "d/dev.jsonl"]);
        // Words, not parts of words; and a directory of held-out files alone is what was asked.
        assert!(found(&["latest.jsonl", "contest.jsonl", "evaluate_me.jsonl"]).is_empty());
        assert!(found(&["test-0.jsonl", "test-1.jsonl"]).is_empty());
    }

    #[test]
    fn files_that_are_not_text_or_json_lines_are_refused_saying_what_to_do() {
        let refused = |name: &str, bytes: &[u8], says: &str| {
            let error = kind_of(name, bytes).unwrap_err();
            assert!(error.contains(says), "{name}: {error}");
        };
        refused("a.json", b"[{\"text\": \"x\"}]", "jq -c '.[]'");
        refused("a.json", b"\n  [\n", "a JSON array");
        refused("a.json", b"{\n  \"data\": []\n}\n", "its first line is not a JSON object");
        refused("a.json", b"\"text\"\n", "not JSON Lines");
        refused("train.parquet", b"PAR1\x15\x04", "from_parquet('IN').to_json");
        refused("train-00000", b"PAR1\x15\x04", "a Parquet file");
        refused("data-00000-of-00001.arrow", b"\xff\xff\xff\xff\x10\x00", "an Arrow file");
        refused("a.txt.gz", b"\x1f\x8b\x08\x00", "gzip-compressed");
        refused("a.jsonl.zst", b"\x28\xb5\x2f\xfd\x04", "zstd-compressed");
        refused("a.zip", b"PK\x03\x04", "decompress it first");
        refused("a.jsonl", b"PK\x03\x04", "zip-compressed");
        refused("model.pt", b"\x80\x02\x8a\x0alo\x00\x00", "a zero byte at offset 6");
    }
}
