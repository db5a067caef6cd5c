//! The messages of the mistakes a new user makes first (issue 24, item 9): one clean sentence
//! and exit code 2, never a backtrace, a raw library list or a path printed twice.

use super::*;

fn fails_cleanly(args: &[&str]) -> String {
    let run = zeroflow(args);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(!stderr.contains("stack backtrace") && !stderr.contains("panicked"), "{stderr}");
    stderr
}

/// Regression: `--micro-batch 1099511627776` aborted on a failed allocation (exit 134).
#[test]
fn a_huge_micro_batch_is_a_clean_error_naming_the_flag_and_the_limit() {
    let out = scratch("huge_micro_batch").join("run");
    let stderr = fails_cleanly(&[
        "train",
        "--micro-batch",
        "1099511627776",
        "--steps",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(
        stderr.contains("--micro-batch 1099511627776") && stderr.contains("2147483648"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing is written for a refused run");
}

/// Below the token limit, a micro-batch whose activations cannot fit the host's memory says to
/// lower --micro-batch (tiny at 2^24 sequences of 64 tokens needs terabytes).
#[test]
fn a_micro_batch_too_large_for_the_host_says_which_flag_to_lower() {
    let out = scratch("host_oom").join("run");
    let stderr = fails_cleanly(&[
        "train",
        "--micro-batch",
        "16777216",
        "--steps",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(stderr.contains("host memory") && stderr.contains("lower --micro-batch"), "{stderr}");
}

/// Regression: without a GPU, `train --device cuda` printed the 15 library names the loader
/// tried, and `bench step --device cuda` did too, after drawing the model's weights on the host
/// (minutes at llama-8b). (Skipped where a GPU is present.)
#[test]
fn cuda_without_a_gpu_says_no_gpu_was_found_and_what_to_check() {
    let run = zeroflow(&["env", "--json"]);
    let env: serde_json::Value = serde_json::from_slice(&run.stdout).expect("JSON");
    if env["cuda"]["gpus"].as_array().is_some_and(|gpus| !gpus.is_empty()) {
        eprintln!("skipped: this machine has a GPU");
        return;
    }
    for device in ["cuda", "gpu"] {
        let stderr = fails_cleanly(&["train", "--device", device, "--steps", "2"]);
        assert!(stderr.contains("no CUDA GPU found"), "{stderr}");
        assert!(stderr.contains("zeroflow env") && stderr.contains("--device cpu"), "{stderr}");
        assert!(!stderr.contains("libcuda64_12.so"), "no list of library names: {stderr}");
    }
    let bench = ["bench", "step", "--device", "cuda", "--model", "gpt2-124m", "--steps", "1"];
    let stderr = fails_cleanly(&bench);
    assert!(stderr.contains("no CUDA GPU found"), "{stderr}");
    assert!(stderr.contains("zeroflow env") && stderr.contains("--device cpu"), "{stderr}");
    assert!(!stderr.contains("memory plan"), "checked before the plan and the weights: {stderr}");
}

/// Regression: `/dev/null` as data was "no such file or directory".
#[test]
fn empty_or_special_data_files_are_not_called_missing() {
    let dir = scratch("empty_data");
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let out = dir.join("run");
    for (data, says) in [("/dev/null", "not a regular file"), (empty.to_str().unwrap(), "is empty")]
    {
        let stderr = fails_cleanly(&[
            "train",
            "--data",
            data,
            "--steps",
            "2",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(stderr.contains(says) && !stderr.contains("no such file"), "{data}: {stderr}");
    }
}

/// Regression: a dataset from the Hugging Face Hub (Parquet) or a JSON array was trained on as
/// text (its bytes, from scratch); `tokenize` read it as text too. Both refuse it now, with the
/// conversion to do.
#[test]
fn a_parquet_file_or_a_json_array_is_refused_not_trained_on_as_text() {
    let dir = scratch("table_data");
    let (parquet, array) = (dir.join("train-00000-of-00001.parquet"), dir.join("alpaca.json"));
    std::fs::write(&parquet, b"PAR1\x15\x04\x15\x10\x15\x14L\x15\x02\x15\x00").unwrap();
    std::fs::write(&array, r#"[{"instruction": "a", "output": "b"}]"#).unwrap();
    let out = dir.join("run");
    for (data, says) in [(&parquet, "from_parquet('IN').to_json"), (&array, "jq -c '.[]'")] {
        let data = data.to_str().unwrap();
        let args = ["train", "--data", data, "--steps", "2", "--out", out.to_str().unwrap()];
        let stderr = fails_cleanly(&args);
        assert!(stderr.contains(data) && stderr.contains(says), "{stderr}");
        let shards = dir.join("shards");
        let args = ["tokenize", "--tokenizer", "bytes", data, "--out", shards.to_str().unwrap()];
        let stderr = fails_cleanly(&args);
        assert!(stderr.contains(data) && stderr.contains(says), "{stderr}");
        assert!(!shards.exists(), "refused before anything is written");
    }
}

/// `tokenize DIR` reads the directory's JSON Lines files in name order (it was "Is a directory";
/// a `.json` of metadata is left out), the same shards as the files listed; a directory without
/// any, or with a held-out split beside them, is refused saying so.
#[test]
fn tokenize_reads_a_directory_as_its_json_lines_files() {
    let dir = scratch("tokenize_directory");
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("b.jsonl"), "{\"text\": \"second file\"}\n").unwrap();
    std::fs::write(data.join("a.json"), "{\"text\": \"first file\"}\n").unwrap();
    std::fs::write(data.join("notes.md"), "not data").unwrap();
    std::fs::write(data.join("dataset_info.json"), "{\n  \"features\": {}\n}\n").unwrap();
    let tokenize = |inputs: &[&Path], out: &Path| {
        let mut args = vec!["tokenize", "--tokenizer", "bytes", "--out", out.to_str().unwrap()];
        args.extend(inputs.iter().map(|p| p.to_str().unwrap()));
        let run = zeroflow(&args);
        assert!(run.status.success(), "{}", text(&run.stderr));
        std::fs::read(out.join("tokens_000000.bin")).unwrap()
    };
    let (listed, whole) = (dir.join("listed"), dir.join("whole"));
    let files = tokenize(&[&data.join("a.json"), &data.join("b.jsonl")], &listed);
    assert_eq!(tokenize(&[&data], &whole), files);
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let out = dir.join("none");
    let args = ["tokenize", "--tokenizer", "bytes", empty.to_str().unwrap(), "--out"];
    let stderr = fails_cleanly(&[&args[..], &[out.to_str().unwrap()]].concat());
    assert!(stderr.contains("a directory without JSON Lines files"), "{stderr}");
    // A training split beside a held-out one: refused, not tokenized together.
    std::fs::write(data.join("test.jsonl"), "{\"text\": \"held out\"}\n").unwrap();
    let args = ["tokenize", "--tokenizer", "bytes", data.to_str().unwrap(), "--out"];
    let stderr = fails_cleanly(&[&args[..], &[out.to_str().unwrap()]].concat());
    assert!(stderr.contains("held-out splits") && stderr.contains("test.jsonl"), "{stderr}");
}

/// Regression: an unreadable `--config` printed its path twice (`config X: X: cannot read`).
#[test]
fn an_unreadable_config_names_its_path_once() {
    let missing = scratch("unreadable_config").join("missing.json");
    let path = missing.to_str().unwrap();
    let stderr = fails_cleanly(&["train", "--config", path, "--steps", "2"]);
    assert_eq!(stderr.matches(path).count(), 1, "{stderr}");
}

/// Regression: the errors of a launched rank had runs of spaces in the middle of a sentence.
#[test]
fn the_errors_of_a_launched_rank_have_no_stray_spaces() {
    let run = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["train", "--steps", "2"])
        .envs([
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29400"),
        ])
        .output()
        .expect("run zeroflow");
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--device cuda") && !stderr.contains("  "), "{stderr:?}");
}

/// Regression: the top-level help called `bench` "CPU AdamW" although it has five subcommands.
#[test]
fn the_help_describes_every_bench_subcommand() {
    let run = zeroflow(&["--help"]);
    let help = text(&run.stdout);
    let bench = help.lines().find(|line| line.trim_start().starts_with("bench")).expect("bench");
    for sub in ["cpu-adam", "copy", "step", "gemm", "gpt"] {
        assert!(bench.contains(sub), "{sub} in {bench}");
    }
    assert!(help.contains("models"), "{help}");
}
