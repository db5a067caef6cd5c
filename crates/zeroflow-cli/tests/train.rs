//! `zeroflow train` run as a user runs it. The binary is a debug build, so the runs use a model far
//! smaller than `tiny` (`MINI`); what they check is the command's behaviour, not the learning.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "train/chat.rs"]
mod chat;
#[path = "train/checkpoint_fixture.rs"]
mod checkpoint_fixture;
#[path = "train/checkpoints.rs"]
mod checkpoints;
#[path = "train/llama.rs"]
mod llama;
#[path = "train/packing.rs"]
mod packing;
#[path = "train/run_control.rs"]
mod run_control;
#[path = "train/settings.rs"]
mod settings;
#[path = "train/stream_tuning.rs"]
mod stream_tuning;
#[path = "train/text_data.rs"]
mod text_data;

mod support;
use support::MINI;
#[path = "support/chat_model.rs"]
mod chat_model;

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> PathBuf {
    support::scratch_in("train", name)
}

fn train(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .arg("train")
        .args(args)
        .env("ZEROFLOW_LOG", "warn")
        .output()
        .expect("run zeroflow")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .expect("metrics.jsonl exists")
        .lines()
        .map(|line| serde_json::from_str(line).expect("every line is JSON"))
        .collect()
}

#[test]
fn short_run_writes_decreasing_metrics_a_plot_and_a_summary() {
    let out = scratch("short_run").join("run");
    let out_arg = out.to_str().unwrap();
    let args = ["--model", MINI, "--steps", "30", "--micro-batch", "4", "--lr", "1e-2"];
    let run = train(&[&args[..], &["--eval-every", "10", "--out", out_arg]].concat());
    assert!(run.status.success(), "stderr: {}", text(&run.stderr));
    let stdout = text(&run.stdout);
    assert!(stdout.contains("final eval loss") && stdout.contains("entropy floor"), "{stdout}");

    let lines = read_lines(&out.join("metrics.jsonl"));
    let steps: Vec<_> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 30);
    for (i, line) in steps.iter().enumerate() {
        assert_eq!(line["step"], i as u64 + 1);
        for field in ["loss", "lr", "grad_norm", "loss_scale", "tokens_per_s"] {
            assert!(line[field].is_number(), "step {}: {field} in {line}", i + 1);
        }
    }
    let loss = |range: std::ops::Range<usize>| {
        steps[range.clone()].iter().map(|l| l["loss"].as_f64().unwrap()).sum::<f64>()
            / range.len() as f64
    };
    assert!(
        loss(20..30) < loss(0..10) - 0.1,
        "first 10: {}, last 10: {}",
        loss(0..10),
        loss(20..30)
    );
    let evals: Vec<u64> = lines
        .iter()
        .filter(|l| l.get("eval_loss").is_some())
        .map(|l| l["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [10, 20, 30]);

    let svg = std::fs::read_to_string(out.join("loss.svg")).expect("loss.svg exists");
    assert!(svg.starts_with("<svg") && svg.contains("<polyline") && svg.contains("entropy floor"));

    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for field in ["final_eval_loss", "entropy_floor", "tokens_per_s", "wall_s"] {
        assert!(summary[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {summary}");
    }
    assert_eq!(summary["steps"], 30);
    assert_eq!(summary["config"]["train_micro_batch_size_per_gpu"], 4);
    assert_eq!(summary["config"]["optimizer"]["params"]["lr"], 1e-2);
}

#[test]
fn config_file_runs_with_offload_accumulation_and_a_schedule() {
    let dir = scratch("config_run");
    let config = dir.join("ds.json");
    std::fs::write(
        &config,
        r#"{
          "train_batch_size": 8,
          "train_micro_batch_size_per_gpu": 4,
          "gradient_clipping": 0.5,
          "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "weight_decay": 0.01}},
          "scheduler": {"type": "WarmupDecayLR",
                        "params": {"warmup_num_steps": 2, "warmup_max_lr": "auto",
                                   "total_num_steps": "auto", "warmup_type": "linear"}},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        }"#,
    )
    .unwrap();
    let out = dir.join("run");
    let run = train(&[
        "--config",
        config.to_str().unwrap(),
        "--model",
        MINI,
        "--steps",
        "6",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "stderr: {}", text(&run.stderr));
    let lrs: Vec<f64> = read_lines(&out.join("metrics.jsonl"))
        .iter()
        .filter_map(|l| l.get("lr").and_then(|lr| lr.as_f64()))
        .collect();
    // WarmupDecayLR: linear warm-up from 0 over 2 steps to 5e-3, then down to 0 at step 6.
    let expected = [0.0, 2.5e-3, 5e-3, 3.75e-3, 2.5e-3, 1.25e-3];
    assert_eq!(lrs.len(), 6);
    for (lr, want) in lrs.iter().zip(expected) {
        assert!((lr - want).abs() <= 0.01 * want + 1e-12, "lrs {lrs:?}, expected {expected:?}");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["config"]["gradient_accumulation_steps"], 2);
    assert_eq!(summary["config"]["zero_optimization"]["stage"], 2);
    // No speculation budget: no speculation counts.
    let lines = read_lines(&out.join("metrics.jsonl"));
    assert!(lines.iter().all(|l| l.get("redone_steps").is_none()), "{lines:?}");
}

/// With a speculation budget the exact offload step's counts are in every step's line: without
/// clipping nothing speculated is redone and nothing is sat out (how many steps have pieces
/// stepped depends on how many reach the host before the device is past the backward, which the
/// CPU device's timing decides); with a clip that fires on every step, what is redone or sat out
/// adds up.
#[test]
fn a_speculating_run_records_its_counts_per_step() {
    let dir = scratch("speculation_counts");
    for (name, clip) in [("unclipped", None), ("clipped", Some(1e-3))] {
        let config = dir.join(format!("{name}.json"));
        let clip = clip.map_or(String::new(), |c: f64| format!(r#""gradient_clipping": {c},"#));
        let json = format!(
            r#"{{ {clip} "train_micro_batch_size_per_gpu": 4,
                 "zero_optimization": {{"stage": 2, "offload_optimizer": {{"device": "cpu"}}}} }}"#
        );
        std::fs::write(&config, json).unwrap();
        let out = dir.join(name);
        let (config, out_arg) = (config.to_str().unwrap(), out.to_str().unwrap());
        let args = ["--config", config, "--model", MINI, "--steps", "5", "--out", out_arg];
        let run = train(&[&args[..], &["--speculation-budget-mib", "16"]].concat());
        assert!(run.status.success(), "stderr: {}", text(&run.stderr));
        let lines = read_lines(&out.join("metrics.jsonl"));
        let steps: Vec<_> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
        assert_eq!(steps.len(), 5);
        for line in &steps {
            let count = |field: &str| line[field].as_u64().unwrap_or_else(|| panic!("{line}"));
            let (step, speculated) = (count("step"), count("speculated_steps"));
            let (redone, paused) = (count("redone_steps"), count("paused_steps"));
            if name == "unclipped" {
                assert!(speculated <= step && (redone, paused) == (0, 0), "{line}");
            } else {
                assert!(redone <= speculated && speculated + paused <= step, "{line}");
            }
        }
    }
}

#[test]
fn out_directory_that_is_not_empty_is_refused_and_left_untouched() {
    let out = scratch("not_empty");
    std::fs::write(out.join("keep.txt"), "precious").unwrap();
    let run = train(&["--model", MINI, "--steps", "2", "--out", out.to_str().unwrap()]);
    assert_eq!(run.status.code(), Some(2), "stderr: {}", text(&run.stderr));
    let stderr = text(&run.stderr);
    assert!(stderr.contains("not empty") && stderr.contains("--force"), "{stderr}");
    let entries: Vec<_> =
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(entries, ["keep.txt"]);
    assert_eq!(std::fs::read_to_string(out.join("keep.txt")).unwrap(), "precious");
}

/// `eval` of a run on the synthetic corpus without --data: the run's other stream of the chain,
/// in its windows, the loss of its last evaluation.
#[test]
fn eval_of_a_synthetic_run_reads_its_evaluation_stream() {
    let out = scratch("eval_synthetic_run");
    let out_arg = out.to_str().unwrap();
    let trained = train(&["--model", MINI, "--steps", "3", "--seed", "5", "--out", out_arg]);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    let eval = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["eval", out_arg, "--json"])
        .env("ZEROFLOW_LOG", "warn")
        .output()
        .unwrap();
    assert!(eval.status.success(), "{}", text(&eval.stderr));
    let json: serde_json::Value = serde_json::from_slice(&eval.stdout).unwrap();
    let lines = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let logged = lines
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["eval_loss"].as_f64())
        .unwrap();
    let loss = json["loss"].as_f64().unwrap();
    assert!((loss - logged).abs() <= 1e-5 * logged, "eval {loss} against the run's {logged}");
}

/// `--force` writes into a directory that holds files, but not over an earlier run's
/// checkpoints (a new run's beside them would make `--resume latest` take the newest of either):
/// the error says so, and how to start again there.
#[test]
fn force_does_not_start_over_an_earlier_runs_checkpoints() {
    let out = scratch("force_over_a_run");
    let out_arg = out.to_str().unwrap();
    let first = train(&["--model", MINI, "--steps", "1", "--out", out_arg]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let again = train(&["--model", MINI, "--steps", "1", "--out", out_arg, "--force"]);
    assert_eq!(again.status.code(), Some(2), "{}", text(&again.stderr));
    let said = text(&again.stderr);
    assert!(said.contains("(--force replaces files, not an earlier run's checkpoints)"), "{said}");
    assert!(said.contains(&format!("remove {}", out.join("checkpoints").display())), "{said}");
    std::fs::remove_dir_all(out.join("checkpoints")).unwrap();
    let fresh = train(&["--model", MINI, "--steps", "1", "--out", out_arg, "--force"]);
    assert!(fresh.status.success(), "{}", text(&fresh.stderr));
}

/// Text read as bytes by a model trained from scratch whose vocabulary is larger than 256 is
/// said to leave the rest of it untrained, naming `zeroflow tokenize` with the tokenizer.json
/// beside the --model config.json; a vocabulary of 256 says nothing.
#[test]
fn text_read_as_bytes_by_a_larger_vocabulary_names_tokenize() {
    let dir = scratch("bytes_warning");
    let (config, corpus) = (dir.join("config.json"), dir.join("corpus.txt"));
    std::fs::write(&corpus, "some text to read as bytes. ".repeat(400)).unwrap();
    let shape = |vocab: u32| {
        serde_json::json!({"n_layer": 1, "n_head": 2, "d_model": 16, "vocab_size": vocab,
                           "context": 32})
        .to_string()
    };
    std::fs::write(&config, shape(512)).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{}").unwrap();
    let run = |model: &str, out: &str| {
        let out = dir.join(out);
        let args = ["--model", model, "--data", corpus.to_str().unwrap(), "--steps", "1"];
        let trained = train(&[&args[..], &["--out", out.to_str().unwrap()]].concat());
        assert!(trained.status.success(), "{}", text(&trained.stderr));
        text(&trained.stderr)
    };
    let said = run(config.to_str().unwrap(), "wide");
    assert!(said.contains("read as bytes (ids 0 to 255) by a model of 512 tokens"), "{said}");
    let tokenizer = dir.join("tokenizer.json");
    assert!(said.contains(&format!("--tokenizer {} ", tokenizer.display())), "{said}");
    let said = run(&shape(256), "bytes");
    assert!(!said.contains("read as bytes"), "{said}");
}

/// A bad input: its flags, an optional config file, and what the error must say.
struct BadInput {
    name: &'static str,
    args: &'static [&'static str],
    config: Option<&'static str>,
    message: &'static str,
}

const BAD_INPUTS: &[BadInput] = &[
    BadInput {
        name: "missing_data",
        args: &["--data", "/nonexistent/zeroflow/shards"],
        config: None,
        message: "--data /nonexistent/zeroflow/shards: no such file or directory",
    },
    BadInput {
        name: "malformed_config",
        args: &[],
        config: Some(r#"{"train_micro_batch_size_per_gpu": "four"}"#),
        message: "train_micro_batch_size_per_gpu",
    },
    BadInput {
        name: "export_into_a_full_directory",
        args: &["--export", "/"],
        config: None,
        message: "--export /: exists and is not empty; choose a new directory",
    },
    BadInput {
        name: "unknown_model",
        args: &["--model", "gpt5"],
        config: None,
        message: "unknown model size `gpt5`",
    },
    BadInput {
        name: "conflicting_flags",
        args: &["--micro-batch", "4"],
        config: Some(r#"{"train_micro_batch_size_per_gpu": 8}"#),
        message: "--micro-batch 4 conflicts with",
    },
    BadInput {
        name: "zenflow_with_accumulation",
        args: &[],
        config: Some(
            r#"{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                "zenflow": {"update_interval": 4}}}"#,
        ),
        message: "ZenFlow needs gradient_accumulation_steps 1",
    },
    BadInput {
        name: "fp16_on_cuda",
        args: &["--device", "cuda"],
        config: Some(r#"{"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": true}}"#),
        message: "the CUDA model computes in bf16",
    },
    BadInput {
        name: "bf16_on_cpu",
        args: &[],
        config: Some(r#"{"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true}}"#),
        message: "only fp32 works on the CPU",
    },
];

/// Without a GPU (CI), `--device cuda` fails before writing anything, naming what is missing.
#[test]
fn cuda_without_a_gpu_says_what_is_missing_and_writes_nothing() {
    let dir = scratch("cuda_without_gpu");
    let out = dir.join("run");
    let run = train(&["--device", "cuda", "--steps", "2", "--out", out.to_str().unwrap()]);
    if run.status.success() {
        println!("skipped: this machine has a GPU (the run trained)");
        return;
    }
    let stderr = text(&run.stderr);
    assert!(
        stderr.contains("libcuda") || stderr.contains("no CUDA device"),
        "expected the missing driver or GPU to be named: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!out.exists(), "nothing may be written when the device cannot open");
}

#[test]
fn bad_inputs_exit_2_with_a_message_and_write_nothing() {
    for case in BAD_INPUTS {
        let dir = scratch(case.name);
        let out = dir.join("run");
        let mut args: Vec<String> = case.args.iter().map(|a| a.to_string()).collect();
        if let Some(json) = case.config {
            let file = dir.join("ds.json");
            std::fs::write(&file, json).unwrap();
            args.extend(["--config".into(), file.to_str().unwrap().into()]);
        }
        args.extend(["--out".into(), out.to_str().unwrap().into()]);
        let run = train(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{}: {stderr}", case.name);
        assert!(
            stderr.contains(case.message),
            "{}: expected `{}` in: {stderr}",
            case.name,
            case.message
        );
        assert!(!out.exists(), "{}: the output directory was created", case.name);
    }
}

#[test]
fn text_data_for_a_model_with_fewer_than_256_symbols_is_refused() {
    let dir = scratch("text_vocab");
    let text_file = dir.join("corpus.txt");
    std::fs::write(&text_file, "hello zeroflow ".repeat(200)).unwrap();
    let out = dir.join("run");
    let data = text_file.to_str().unwrap();
    let run = train(&["--data", data, "--model", MINI, "--out", out.to_str().unwrap()]);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("read as bytes (256 symbols)") && stderr.contains("vocab_size is 64"));
    assert!(!out.exists());
}

/// A glob of text files trains on all of them but the end of the last, which it evaluates on
/// (held out: a tenth of c.txt), and says so in the summary; a glob that mixes token shards and
/// text is refused.
#[test]
fn a_glob_of_text_files_holds_out_the_end_of_the_last_for_eval() {
    let dir = scratch("text_glob");
    let corpus = dir.join("corpus");
    std::fs::create_dir_all(&corpus).unwrap();
    for (name, words) in [("a.txt", "hello zeroflow "), ("b.txt", "train me "), ("c.txt", "eval ")]
    {
        std::fs::write(corpus.join(name), words.repeat(400)).unwrap();
    }
    let model = r#"{"n_layer":1,"n_head":2,"d_model":16,"vocab_size":256,"context":16}"#;
    let out = dir.join("run");
    let data = corpus.join("*.txt");
    let args = ["--model", model, "--steps", "2", "--micro-batch", "2", "--eval-every", "2"];
    let paths = ["--data", data.to_str().unwrap(), "--out", out.to_str().unwrap()];
    let run = train(&[&args[..], &paths[..]].concat());
    let stderr = text(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let summary = std::fs::read_to_string(out.join("summary.json")).unwrap();
    let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
    let described = summary["data"].as_str().unwrap_or_default();
    assert!(described.contains("3 text files"), "{described}");
    let eval = summary["eval_data"].as_str().unwrap_or_default();
    assert!(
        eval.contains("200 tokens held out from the end of") && eval.contains("c.txt"),
        "{eval}"
    );
    assert_eq!(summary["eval_tokens"], 200, "a tenth of c.txt's 2,000 bytes");
    std::fs::write(corpus.join("d.bin"), [0u8; 8]).unwrap();
    let mixed = corpus.join("*");
    let out = dir.join("mixed");
    let mixed = ["--data", mixed.to_str().unwrap(), "--out", out.to_str().unwrap()];
    let run = train(&[&["--model", model][..], &mixed[..]].concat());
    assert_eq!(run.status.code(), Some(2), "{}", text(&run.stderr));
    assert!(text(&run.stderr).contains("both .bin token shards and other files"));
}

/// `zeroflow train` tells ZenFlow where its data's epochs end: with `select_strategy` "epoch" and
/// `select_interval` 2 the columns are selected again after every second pass over the text, which
/// the checkpoint's ZenFlow state shows (steps since the last selection); without epochs ending
/// within the run they stay from the first step.
#[test]
fn zenflow_epoch_selection_follows_the_data() {
    let dir = scratch("zenflow_epochs");
    // 3 steps of 2 × 16 bytes per pass, the first byte of the next pass as the last target.
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, &"abcdefghijklmnopqrstuvwxyz0123456789".repeat(3).as_bytes()[..97])
        .unwrap();
    let config = dir.join("ds.json");
    std::fs::write(
        &config,
        r#"{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2,
            "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 0.5,
            "select_strategy": "epoch", "select_interval": 2, "update_interval": 1}}}"#,
    )
    .unwrap();
    let model = r#"{"n_layer":1,"n_head":2,"d_model":16,"vocab_size":256,"context":16}"#;
    let since_selection = |steps: &str, name: &str| {
        let out = dir.join(name);
        let args = ["--model", model, "--steps", steps, "--eval-every", "0", "--save-every", "0"];
        // The whole file trains (the passes above), so the evaluation reads it too, on purpose.
        let paths = [
            "--data",
            corpus.to_str().unwrap(),
            "--eval-data",
            corpus.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        let run = train(&[&args[..], &paths[..]].concat());
        assert!(run.status.success(), "{}", text(&run.stderr));
        let checkpoint =
            std::fs::read_dir(out.join("checkpoints")).unwrap().next().unwrap().unwrap();
        let part =
            std::fs::read(checkpoint.path().join("optim").join("rank-0.safetensors")).unwrap();
        let header_len = u64::from_le_bytes(part[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&part[8..8 + header_len]).unwrap();
        let zenflow =
            header["__metadata__"]["zenflow"].as_str().expect("ZenFlow state").to_string();
        let zenflow: serde_json::Value = serde_json::from_str(&zenflow).unwrap();
        zenflow["since_selection"].as_u64().expect("selected")
    };
    // A pass is 3 steps; the loader wraps (an epoch ends) as steps 4 and 7 read their batches,
    // so the second epoch's end is reported after step 7 and step 8 selects again.
    assert_eq!(since_selection("8", "eight"), 1);
    // Within the first two passes the first selection stays.
    assert_eq!(since_selection("5", "five"), 5);
}

/// `--sample-every 2 --sample-prompt IDS` (the synthetic vocabulary is under 256: the prompt is
/// ids) appends a sample at steps 2, 4 and the last to `samples.jsonl`; the last is the greedy
/// continuation by the final checkpoint's weights. A prompt outside the vocabulary exits 2.
#[test]
fn samples_during_training_continue_the_prompt_with_the_current_weights() {
    use zeroflow_train::infer::{Completion, HostModel, Sampling};
    let out = scratch("samples").join("run");
    let args = ["--model", MINI, "--steps", "5", "--micro-batch", "2", "--eval-every", "0"];
    let sample = ["--sample-every", "2", "--sample-prompt", "1,2,3"];
    let run = train(&[&args[..], &sample, &["--out", out.to_str().unwrap()]].concat());
    assert!(run.status.success(), "stderr: {}", text(&run.stderr));
    let samples = read_lines(&out.join("samples.jsonl"));
    let steps: Vec<u64> = samples.iter().map(|s| s["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [2, 4, 5]);
    assert!(samples.iter().all(|s| s["prompt"] == "1,2,3" && s["text"].is_null()));
    let model = HostModel::open(&out.join("checkpoints/step-00000005")).unwrap();
    let greedy =
        Completion { max_new_tokens: 32, sampling: Sampling::GREEDY, seed: 0, stop: false };
    let expected = model.complete(&[1, 2, 3], &greedy).unwrap();
    assert_eq!(samples[2]["tokens"], serde_json::json!(expected));

    let refused =
        train(&[&args[..], &["--sample-every", "2", "--sample-prompt", "1,9999"]].concat());
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused.stderr));
    assert!(text(&refused.stderr).contains("outside the vocabulary"), "{}", text(&refused.stderr));
}
