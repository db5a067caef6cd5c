//! `zeroflow train --pack` (sequence packing): on shards that `zeroflow tokenize` wrote (with
//! their document indexes) it trains, says so, records the setting in the summary and every
//! checkpoint (a resume packs as its checkpoint did), and computes other numbers than the
//! unpacked run; on shards without an index it is an input error (exit 2) before training. (The
//! CUDA device packs too: the families' GPU tests.)

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::{read_lines, scratch, text, train};

/// A byte-level GPT-2 (vocabulary 256, the `bytes` tokenizer's).
const BYTES_MODEL: &str = r#"{"n_layer":1,"n_head":2,"d_model":16,"vocab_size":256,"context":16}"#;

/// Short documents of different lengths, tokenized as bytes into `dir/tokens` (shards and
/// their document indexes).
fn tokenized(dir: &Path) -> PathBuf {
    let lines: Vec<String> = (0..300)
        .map(|i| serde_json::json!({"text": format!("doc {i}: {}", "ab ".repeat(i % 7 + 1))}))
        .map(|line| line.to_string())
        .collect();
    let input = dir.join("docs.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.join("tokens");
    let tokenize = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["tokenize", "--tokenizer", "bytes", input.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(tokenize.status.success(), "{}", text(&tokenize.stderr));
    assert!(out.join("tokens_000000.idx").is_file(), "tokenize writes the document index");
    out
}

fn json_of(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The run's arguments on `data`, into `out`.
fn args<'a>(data: &'a Path, out: &'a Path) -> Vec<&'a str> {
    let data = data.to_str().unwrap();
    let out = out.to_str().unwrap();
    vec![
        "--model",
        BYTES_MODEL,
        "--data",
        data,
        "--steps",
        "4",
        "--micro-batch",
        "2",
        "--seq",
        "16",
        "--eval-every",
        "0",
        "--save-every",
        "2",
        "--out",
        out,
    ]
}

#[test]
fn train_pack_trains_on_tokenized_shards_and_records_the_setting() {
    let dir = scratch("pack");
    let tokens = tokenized(&dir);
    let (packed, plain) = (dir.join("packed"), dir.join("plain"));
    let run = train(&[&args(&tokens, &packed)[..], &["--pack"]].concat());
    assert!(run.status.success(), "{}", text(&run.stderr));
    let stdout = text(&run.stdout);
    assert!(stdout.contains("final eval loss"), "{stdout}");
    let summary = json_of(&packed.join("summary.json"));
    assert_eq!(summary["settings"]["pack"], true, "{summary}");
    let state = json_of(&packed.join("checkpoints/step-00000002/state.json"));
    assert_eq!(state["extra"]["settings"]["pack"], true, "{state}");

    let run = train(&args(&tokens, &plain));
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(json_of(&plain.join("summary.json"))["settings"]["pack"], false);
    // The same rows, but attention bounded by documents: other losses from the first step on.
    let first_loss = |out: &Path| read_lines(&out.join("metrics.jsonl"))[0]["loss"].as_f64();
    let (packed_loss, plain_loss) = (first_loss(&packed), first_loss(&plain));
    assert!(packed_loss.is_some() && packed_loss != plain_loss, "{packed_loss:?} {plain_loss:?}");
    // `eval RUN` without --data evaluates as each run did: the packed run's set packed
    // (regression: it read it unpacked, attending across documents, and gave another loss).
    for out in [&packed, &plain] {
        let eval = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .args(["eval", out.to_str().unwrap(), "--json"])
            .env("ZEROFLOW_LOG", "warn")
            .output()
            .unwrap();
        assert!(eval.status.success(), "{}", text(&eval.stderr));
        let said: Value = serde_json::from_slice(&eval.stdout).unwrap();
        assert_eq!(said["packed"], out == &packed, "{said}");
        let loss = said["loss"].as_f64();
        let lines = read_lines(&out.join("metrics.jsonl"));
        let logged = lines.iter().rev().find_map(|line| line["eval_loss"].as_f64());
        let (loss, logged) = (loss.unwrap(), logged.expect("an evaluation logged"));
        assert!(
            (loss - logged).abs() <= 1e-5 * logged,
            "{}: {loss} against {logged}",
            out.display()
        );
    }
    // `eval RUN --data D` reads D as the run read its data by default; --pack says otherwise.
    let eval = |out: &Path, more: &[&str]| {
        let args = ["eval", out.to_str().unwrap(), "--data", tokens.to_str().unwrap(), "--json"];
        let eval = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .args(args)
            .args(more)
            .env("ZEROFLOW_LOG", "warn")
            .output()
            .unwrap();
        assert!(eval.status.success(), "{}", text(&eval.stderr));
        serde_json::from_slice::<Value>(&eval.stdout).unwrap()["loss"].as_f64().unwrap()
    };
    let on = eval(&packed, &["--pack"]);
    assert_eq!(eval(&packed, &[]), on, "a packed run's data read packed");
    assert_ne!(on, eval(&packed, &["--pack=off"]));
    let off = eval(&plain, &["--pack=off"]);
    assert_eq!(eval(&plain, &[]), off, "a plain run's unpacked");
    assert_ne!(off, eval(&plain, &["--pack"]));

    // Resumed with `--resume latest` alone, the run packs as its checkpoint did (regression: it
    // went on unpacked, warning that the numbers would differ): the weights of its last step
    // are the uninterrupted run's bit for bit.
    let split = dir.join("split");
    let run = train(&[&args(&tokens, &split)[..], &["--pack"]].concat());
    assert!(run.status.success(), "{}", text(&run.stderr));
    std::fs::remove_dir_all(split.join("checkpoints/step-00000004")).unwrap();
    let resumed = train(&["--resume", "latest", "--out", split.to_str().unwrap()]);
    let stderr = text(&resumed.stderr);
    assert!(resumed.status.success(), "{stderr}");
    assert!(!stderr.contains("pack"), "{stderr}");
    let weights =
        |out: &Path| std::fs::read(out.join("checkpoints/step-00000004/model.safetensors"));
    assert!(weights(&split).unwrap() == weights(&packed).unwrap(), "step 4's weights");
}

#[test]
fn train_pack_on_shards_without_an_index_is_an_input_error() {
    let dir = scratch("pack_refused");
    let tokens = tokenized(&dir);
    let bare = dir.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(tokens.join("tokens_000000.bin"), bare.join("tokens_000000.bin")).unwrap();
    let run = train(&[&args(&bare, &dir.join("bare-run"))[..], &["--pack"]].concat());
    assert_eq!(run.status.code(), Some(2), "{}", text(&run.stderr));
    let stderr = text(&run.stderr);
    assert!(
        stderr.contains("tokens_000000.bin") && stderr.contains("zeroflow tokenize"),
        "{stderr}"
    );
    // `eval --pack` likewise, naming the flag.
    let model = dir.join("model");
    let run = train(&args(&tokens, &model));
    assert!(run.status.success(), "{}", text(&run.stderr));
    let eval = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["eval", model.to_str().unwrap(), "--data", bare.to_str().unwrap(), "--pack"])
        .output()
        .unwrap();
    let stderr = text(&eval.stderr);
    assert_eq!(eval.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--pack: ") && stderr.contains("zeroflow tokenize"), "{stderr}");
}
