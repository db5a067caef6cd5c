//! `zeroflow train --init-from DIR --data FILE.txt`: a model that comes from a directory reads
//! text as its tokenizer's tokens, tokenized at start-up into the run directory (`--eval-data`
//! too), exactly as training on `zeroflow tokenize`'s shards of the same files; never bytes as
//! token ids (which is what text means for a model trained from scratch). A directory without a
//! tokenizer.json is an input error before training.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::chat_model::{byte_tokenizer_json, write_model_dir};
use super::{read_lines, scratch, text, train};

/// `zeroflow tokenize --tokenizer DIR FILE --out OUT`.
fn tokenize(model: &Path, file: &Path, out: &Path) {
    tokenize_with(model, file, out, &[]);
}

/// `zeroflow tokenize --tokenizer DIR FILE --out OUT` with `more` arguments; its output.
fn tokenize_with(model: &Path, file: &Path, out: &Path, more: &[&str]) -> String {
    let tokenized = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["tokenize", "--tokenizer", model.to_str().unwrap(), file.to_str().unwrap()])
        .args(["--out", out.to_str().unwrap()])
        .args(more)
        .output()
        .unwrap();
    assert!(tokenized.status.success(), "{}", text(&tokenized.stderr));
    text(&tokenized.stdout)
}

/// A metrics line: step, loss, gradient norm, eval loss.
type Line = (u64, Option<f64>, Option<f64>, Option<f64>);

/// The run's steps and evaluations, as logged.
fn record(run: &Path) -> Vec<Line> {
    read_lines(&run.join("metrics.jsonl"))
        .iter()
        .map(|l| {
            let number = |key: &str| l.get(key).and_then(Value::as_f64);
            (l["step"].as_u64().unwrap(), number("loss"), number("grad_norm"), number("eval_loss"))
        })
        .collect()
}

/// A scratch directory `name` with the chat model's directory (`model`) and `corpus.txt`
/// holding `text`.
fn model_and_corpus(name: &str, text: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = scratch(name);
    let (model, corpus) = (dir.join("model"), dir.join("corpus.txt"));
    write_model_dir(&model);
    std::fs::write(&corpus, text).unwrap();
    (dir, model, corpus)
}

/// A model directory in `dir` whose tokenizer maps byte `b` to token `255 - b`: a run that read
/// text as bytes, or encoded a prompt as bytes, would see other ids than the directory's.
fn reversed_model_dir(dir: &Path) -> std::path::PathBuf {
    let model = dir.join("model");
    write_model_dir(&model);
    let reversed = byte_tokenizer_json(|b| 255 - u32::from(b));
    std::fs::write(model.join("tokenizer.json"), reversed.to_string()).unwrap();
    model
}

#[test]
fn text_beside_a_model_directory_is_its_tokens_as_zeroflow_tokenize_writes_them() {
    let dir = scratch("text_data_tokenized");
    let model = reversed_model_dir(&dir);
    let (corpus, held_out) = (dir.join("corpus.txt"), dir.join("held-out.txt"));
    let sentence = |i: usize| format!("line {i}: the quick brown fox jumps over the lazy dog.\n");
    std::fs::write(&corpus, (0..80).map(sentence).collect::<String>()).unwrap();
    std::fs::write(&held_out, (80..100).map(sentence).collect::<String>()).unwrap();
    let run = |data: &Path, eval: &Path, out: &Path| {
        let args = [
            "--init-from",
            model.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--eval-data",
            eval.to_str().unwrap(),
            "--steps",
            "4",
            "--micro-batch",
            "2",
            "--seq",
            "32",
            "--lr",
            "1e-2",
            "--eval-every",
            "2",
            "--out",
            out.to_str().unwrap(),
        ];
        let trained = train(&args);
        assert!(trained.status.success(), "{}", text(&trained.stderr));
    };
    let (from_text, from_shards) = (dir.join("run-text"), dir.join("run-shards"));
    run(&corpus, &held_out, &from_text);
    for folder in ["rank-0", "eval-rank-0"] {
        let shard = from_text.join("tokens").join(folder).join("tokens_000000.bin");
        assert!(shard.is_file(), "{} was written", shard.display());
    }
    let (shards, eval_shards) = (dir.join("shards"), dir.join("eval-shards"));
    tokenize(&model, &corpus, &shards);
    tokenize(&model, &held_out, &eval_shards);
    run(&shards, &eval_shards, &from_shards);
    let (text_run, shard_run) = (record(&from_text), record(&from_shards));
    let evals = text_run.iter().filter(|r| r.3.is_some()).count();
    assert!(text_run.iter().filter(|r| r.1.is_some()).count() == 4 && evals >= 2, "{text_run:?}");
    assert_eq!(text_run, shard_run, "the same tokens, the same run, bit for bit");
}

#[test]
fn text_beside_a_model_directory_without_a_tokenizer_is_refused() {
    let words = "some text to train on\n".repeat(40);
    let (dir, model, corpus) = model_and_corpus("text_data_no_tokenizer", &words);
    std::fs::remove_file(model.join("tokenizer.json")).unwrap();
    let out = dir.join("run");
    let args = [
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        corpus.to_str().unwrap(),
        "--steps",
        "2",
        "--micro-batch",
        "2",
        "--seq",
        "16",
        "--out",
        out.to_str().unwrap(),
    ];
    let refused = train(&args);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    let stderr = text(&refused.stderr);
    assert!(stderr.contains("has no tokenizer.json"), "{stderr}");
    assert!(stderr.contains("zeroflow tokenize --tokenizer"), "{stderr}");
    assert!(!out.join("metrics.jsonl").exists(), "nothing trained");
}

/// Shards that `zeroflow tokenize` wrote with another tokenizer than the model directory's (bytes
/// here: ids all inside the model's vocabulary, so nothing else would notice) are refused by
/// `train --init-from` and by `eval`, naming both tokenizers and the command that tokenizes
/// with the model's; shards of the model's own tokenizer train.
#[test]
fn shards_of_another_tokenizer_are_refused_naming_both() {
    let words = "some text to train on\n".repeat(60);
    let (dir, model, corpus) = model_and_corpus("text_data_other_tokenizer", &words);
    let (bytes_shards, own_shards) = (dir.join("bytes-tokens"), dir.join("own-tokens"));
    let tokenize = |tokenizer: &str, out: &Path| {
        let tokenized = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .args(["tokenize", "--tokenizer", tokenizer, corpus.to_str().unwrap()])
            .args(["--out", out.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(tokenized.status.success(), "{}", text(&tokenized.stderr));
    };
    tokenize("bytes", &bytes_shards);
    tokenize(model.to_str().unwrap(), &own_shards);
    let run = |shards: &Path, name: &str| {
        let out = dir.join(name);
        let args = ["--init-from", model.to_str().unwrap(), "--data", shards.to_str().unwrap()];
        let more = ["--steps", "1", "--micro-batch", "2", "--seq", "16"];
        train(&[&args[..], &more, &["--out", out.to_str().unwrap()]].concat())
    };
    let refused = run(&bytes_shards, "bytes-run");
    let stderr = text(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("tokenized with bytes (a vocabulary of 256;"), "{stderr}");
    let said = format!("zeroflow tokenize --tokenizer {}", model.display());
    assert!(stderr.contains(&said), "{stderr}");
    assert!(!dir.join("bytes-run").exists(), "nothing written");
    let eval = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["eval", model.to_str().unwrap(), "--data", bytes_shards.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(eval.status.code(), Some(2), "{}", text(&eval.stderr));
    assert!(text(&eval.stderr).contains("tokenized with bytes"), "{}", text(&eval.stderr));
    let trained = run(&own_shards, "own-run");
    assert!(trained.status.success(), "{}", text(&trained.stderr));
}

/// A model from a directory is fine-tuned at 2e-5 unless told otherwise (the from-scratch
/// default, 3e-3, would undo what it learned), and the run says so; `--lr` still sets it.
#[test]
fn a_model_from_a_directory_fine_tunes_at_a_fine_tuning_rate_by_default() {
    let words = "a few words to fine-tune on\n".repeat(40);
    let (dir, model, corpus) = model_and_corpus("text_data_fine_tune_lr", &words);
    let lr_of = |lr: Option<&str>, name: &str| {
        let out = dir.join(name);
        let mut args =
            vec!["--init-from", model.to_str().unwrap(), "--data", corpus.to_str().unwrap()];
        args.extend(["--steps", "2", "--micro-batch", "2", "--seq", "16", "--eval-every", "0"]);
        args.extend(["--out", out.to_str().unwrap()]);
        if let Some(lr) = lr {
            args.extend(["--lr", lr]);
        }
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .arg("train")
            .args(&args)
            .env("ZEROFLOW_LOG", "info")
            .output()
            .unwrap();
        assert!(run.status.success(), "{}", text(&run.stderr));
        let summary: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        (summary["config"]["optimizer"]["params"]["lr"].as_f64().unwrap(), text(&run.stderr))
    };
    let (default, said) = lr_of(None, "default");
    assert_eq!(default, 2e-5);
    assert!(said.contains("the default for a model from --init-from"), "{said}");
    let (given, said) = lr_of(Some("1e-3"), "given");
    assert_eq!(given, 1e-3);
    assert!(!said.contains("the default for a model from --init-from"), "{said}");
}

/// A fine-tune of a model directory stopped and resumed continues as the uninterrupted run,
/// though the resume names no `--init-from`: the same learning rates (the fine-tune's, not the
/// from-scratch default) and losses, and samples encoded and decoded by the directory's
/// tokenizer (regression: they fell back to bytes, other ids than the directory's).
#[test]
fn a_resumed_fine_tune_continues_as_the_uninterrupted_run() {
    let dir = scratch("text_data_resumed_fine_tune");
    let model = reversed_model_dir(&dir);
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, "the cat sat on the mat.\n".repeat(60)).unwrap();
    let sample = ["--sample-every", "2", "--sample-prompt", "the cat"];
    let (straight, split) = (dir.join("straight"), dir.join("split"));
    for out in [&straight, &split] {
        let mut args =
            vec!["--init-from", model.to_str().unwrap(), "--data", corpus.to_str().unwrap()];
        args.extend(["--steps", "4", "--save-every", "2", "--micro-batch", "2", "--seq", "16"]);
        args.extend(["--eval-every", "0", "--out", out.to_str().unwrap()]);
        let run = train(&[&args[..], &sample].concat());
        assert!(run.status.success(), "{}", text(&run.stderr));
    }
    // As if the run had stopped after its checkpoint at step 2.
    std::fs::remove_dir_all(split.join("checkpoints").join("step-00000004")).unwrap();
    std::fs::remove_file(split.join("samples.jsonl")).unwrap();
    // The resume reads the tokens the first start wrote (the same files and tokenizer), not
    // tokenized again: the shard is the same file, written once.
    let shard = split.join("tokens/rank-0/tokens_000000.bin");
    let written = || std::fs::metadata(&shard).unwrap().modified().unwrap();
    let first = written();
    assert!(split.join("tokens/rank-0/made-from.json").is_file());
    let resumed = train(
        &[&["--resume", "latest", "--out", split.to_str().unwrap()][..], &sample[..]].concat(),
    );
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    assert_eq!(written(), first, "the resume tokenized the corpus again");
    let steps = |run: &Path| {
        let lines = read_lines(&run.join("metrics.jsonl"));
        let step = |l: &Value| (l["step"].clone(), l["lr"].clone(), l["loss"].clone());
        lines.iter().filter(|l| l.get("loss").is_some()).map(step).collect::<Vec<_>>()
    };
    let want = steps(&straight);
    assert_eq!(want.len(), 4, "{want:?}");
    assert!(want.iter().all(|s| s.1.as_f64().is_some_and(|lr| lr <= 2e-5)), "{want:?}");
    assert_eq!(steps(&split), want);
    let last = |run: &Path| read_lines(&run.join("samples.jsonl")).pop().expect("a sample");
    let (want, got) = (last(&straight), last(&split));
    assert_eq!(want["step"], 4);
    assert!(want["text"].as_str().is_some_and(|t| !t.is_empty()), "{want}");
    assert_eq!(got, want);
}

/// Without --eval-data, documents spread over a `.jsonl` are held out at start-up; `zeroflow
/// tokenize --hold-out N` holds out the same ones into OUT/held-out, which `train --data OUT`
/// evaluates on: the two runs are the same, bit for bit.
#[test]
fn documents_held_out_at_start_up_are_those_tokenize_hold_out_writes() {
    let dir = scratch("text_data_held_out");
    let model = reversed_model_dir(&dir);
    let docs = dir.join("docs.jsonl");
    let sentence = |i: usize| format!("document {i}: the {} fox jumps.", ["quick", "lazy"][i / 30]);
    let lines: String =
        (0..60).map(|i| serde_json::json!({"text": sentence(i)}).to_string() + "\n").collect();
    std::fs::write(&docs, lines).unwrap();
    let run = |data: &Path, out: &Path| {
        let mut args =
            vec!["--init-from", model.to_str().unwrap(), "--data", data.to_str().unwrap()];
        args.extend(["--steps", "4", "--micro-batch", "2", "--seq", "32", "--lr", "1e-2"]);
        args.extend(["--eval-every", "2", "--out", out.to_str().unwrap()]);
        let trained = train(&args);
        assert!(trained.status.success(), "{}", text(&trained.stderr));
        let summary = std::fs::read_to_string(out.join("summary.json")).unwrap();
        let summary: Value = serde_json::from_str(&summary).unwrap();
        summary["eval_data"].as_str().unwrap().to_owned()
    };
    let (from_jsonl, from_shards) = (dir.join("run-jsonl"), dir.join("run-shards"));
    let said = run(&docs, &from_jsonl);
    assert!(from_jsonl.join("tokens/rank-0/held-out/tokens_000000.bin").is_file());
    assert!(said.contains("documents held out across --data"), "{said}");
    let shards = dir.join("shards");
    let printed = tokenize_with(&model, &docs, &shards, &["--hold-out", "1048576"]);
    assert!(printed.contains("held out for evaluation"), "{printed}");
    let said = run(&shards, &from_shards);
    assert!(said.contains("documents held out across --data"), "{said}");
    let (jsonl_run, shard_run) = (record(&from_jsonl), record(&from_shards));
    assert!(jsonl_run.iter().filter(|r| r.3.is_some()).count() >= 2, "{jsonl_run:?}");
    assert_eq!(jsonl_run, shard_run, "the same held-out documents, the same run, bit for bit");
    // `eval` of the run on the shards without --data: the documents beside them, its last loss.
    let eval = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["eval", from_shards.to_str().unwrap(), "--json"])
        .env("ZEROFLOW_LOG", "warn")
        .output()
        .unwrap();
    assert!(eval.status.success(), "{}", text(&eval.stderr));
    let loss = serde_json::from_slice::<Value>(&eval.stdout).unwrap()["loss"].as_f64().unwrap();
    let logged = shard_run.iter().rev().find_map(|r| r.3).unwrap();
    assert!((loss - logged).abs() <= 1e-5 * logged, "eval {loss} against the run's {logged}");
    // Shards without documents held out evaluate on their end, and the run says how to hold
    // documents out instead; shards with them say nothing of it.
    let plain = dir.join("plain-shards");
    let printed = tokenize_with(&model, &docs, &plain, &[]);
    assert!(!printed.contains("held out"), "{printed}");
    let hint = |shards: &Path, out: &str| {
        let trained = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .args(["train", "--init-from", model.to_str().unwrap()])
            .args(["--data", shards.to_str().unwrap(), "--steps", "1", "--micro-batch", "2"])
            .args(["--seq", "32", "--out", dir.join(out).to_str().unwrap()])
            .env("ZEROFLOW_LOG", "info")
            .output()
            .unwrap();
        let stderr = text(&trained.stderr);
        assert!(trained.status.success(), "{stderr}");
        stderr.contains("`zeroflow tokenize --hold-out N` holds out documents spread")
    };
    assert!(hint(&plain, "run-plain"), "the end of the data, said");
    assert!(!hint(&shards, "run-held"), "documents held out: nothing to say");
}

/// Two ranks of one host, started together: the first tokenizes, the second waits and reads
/// the same shards (no folder of its own), the held-out documents' too; where tokenizing fails,
/// both fail with its error.
#[test]
fn the_ranks_of_a_host_share_one_tokenizing() {
    use zeroflow_train::TrainError;
    use zeroflow_train::data::Spec;
    use zeroflow_train::startup_tokens::{DataRole, RankOnHost, tokenized_at_start};

    let words = "hello world\n".repeat(1000);
    let (dir, model, corpus) = model_and_corpus("text_data_host_tokens", &words);
    let (out, bad) = (dir.join("run"), dir.join("bad.jsonl"));
    std::fs::write(&bad, "{\"text\": \"fine\"}\nnot json\n").unwrap();
    let both = |spec: &dyn Fn() -> Spec| -> Vec<Result<(Spec, Option<Spec>), TrainError>> {
        std::thread::scope(|scope| {
            let ranks: Vec<_> = [1, 0]
                .into_iter()
                .map(|rank| {
                    let (spec, model, out) = (spec(), &model, &out);
                    scope.spawn(move || {
                        let at = RankOnHost { rank, local_rank: rank };
                        tokenized_at_start(
                            spec,
                            DataRole::Train,
                            Some(model),
                            out,
                            at,
                            &Default::default(),
                            Some(1 << 20),
                        )
                        .map(|tokenized| (tokenized.spec, tokenized.held_out))
                    })
                })
                .collect();
            ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
        })
    };
    let read = both(&|| Spec::Text(vec![corpus.clone()]));
    let shards = |spec: &Result<(Spec, Option<Spec>), TrainError>| match spec {
        Ok((Spec::Shards(shards), held_out)) => {
            (shards.clone(), held_out.as_ref().map(|held| held.files().to_vec()))
        }
        other => panic!("{other:?}"),
    };
    let want = (vec![out.join("tokens/rank-0/tokens_000000.bin")], None);
    assert_eq!((shards(&read[0]), shards(&read[1])), (want.clone(), want));
    assert!(!out.join("tokens/rank-1").exists());
    // Records of a .jsonl held out: both ranks read the same ones.
    let records = dir.join("records.jsonl");
    let lines: String = (0..100).map(|i| format!("{{\"text\": \"record {i}\"}}\n")).collect();
    std::fs::write(&records, lines).unwrap();
    let held = both(&|| Spec::Jsonl(vec![records.clone()]));
    let held_out = Some(vec![out.join("tokens/rank-0/held-out/tokens_000000.bin")]);
    assert_eq!(shards(&held[0]).1, held_out);
    assert_eq!(shards(&held[0]), shards(&held[1]));
    let failed = both(&|| Spec::Jsonl(vec![bad.clone()]));
    for (rank, result) in [1, 0].into_iter().zip(failed) {
        let error = format!("{:#}", result.expect_err("a bad line"));
        assert!(error.contains("bad.jsonl:2: not JSON"), "rank {rank}: {error}");
        assert!(error.contains("--skip-bad-lines` (which skips such lines) and give --data DIR"));
        assert_eq!(error.contains("as rank 0 found"), rank == 1, "rank {rank}: {error}");
    }
}
