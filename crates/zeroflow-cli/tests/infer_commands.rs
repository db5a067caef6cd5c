//! `zeroflow generate` and `zeroflow eval` on a Hugging Face GPT-2 directory (the checkpoint
//! fixture, exported): their JSON is the library's `HostModel` answer, and bad input exits 2.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use zeroflow_train::infer::{Completion, HostModel, Sampling};

const FIXTURE: &str = "tests/fixtures/checkpoint-before-family/checkpoints/step-00000004";

fn zeroflow(args: &[&str]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_zeroflow"));
    command.args(args).env("ZEROFLOW_LOG", "warn").output().expect("run zeroflow")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The fixture (vocabulary 64, context 16) exported as a Hugging Face directory under `name`.
fn hf_dir(name: &str) -> PathBuf {
    let dir = support::scratch_in("infer_commands", name);
    let out = dir.join("hf");
    let checkpoint = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE);
    let export =
        zeroflow(&["export", checkpoint.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(export.status.success(), "{}", text(&export.stderr));
    out
}

fn json_of(output: &Output) -> Value {
    assert!(output.status.success(), "{}", text(&output.stderr));
    serde_json::from_slice(&output.stdout).expect("one JSON object")
}

/// Greedy `generate --json` prints the library's greedy completion; a prompt given as text
/// through a tokenizer is that text's ids, and the output comes back as text too.
#[test]
fn generate_prints_the_librarys_greedy_tokens_as_json() {
    let dir = hf_dir("generate");
    let model_dir = dir.to_str().unwrap();
    let model = HostModel::open(&dir).unwrap();
    let completion =
        Completion { max_new_tokens: 8, sampling: Sampling::GREEDY, seed: 0, stop: false };
    let expected = model.complete(&[40, 33, 48], &completion).unwrap();
    let by_ids = ["generate", model_dir, "--prompt-tokens", "40,33,48", "--max-new-tokens", "8"];
    let json = json_of(&zeroflow(&[&by_ids[..], &["--no-stop", "--json"]].concat()));
    assert_eq!(json["tokens"], serde_json::json!(expected));
    assert_eq!(json["text"], Value::Null, "no tokenizer, no text");

    let by_text = ["generate", model_dir, "--prompt", "(!0", "--tokenizer", "bytes"];
    let tail = ["--max-new-tokens", "8", "--no-stop", "--json"];
    let json = json_of(&zeroflow(&[&by_text[..], &tail].concat()));
    assert_eq!(json["tokens"], serde_json::json!(expected));
    let bytes: Vec<u8> = expected.iter().map(|&t| t as u8).collect();
    assert_eq!(json["text"], String::from_utf8(bytes).unwrap());

    // Without --json: the ids, comma-separated.
    let plain = zeroflow(&[&by_ids[..], &["--no-stop"]].concat());
    let ids: Vec<String> = expected.iter().map(u32::to_string).collect();
    assert_eq!(text(&plain.stdout).trim(), ids.join(","));
}

/// `eval --json` prints the library's loss over the shard's windows.
#[test]
fn eval_prints_the_librarys_loss_as_json() {
    let dir = hf_dir("eval");
    let tokens: Vec<u16> = (0..50).map(|i| (i * 7 % 64) as u16).collect();
    let shard = dir.with_file_name("data.bin");
    zeroflow_data::write_shard(&shard, &tokens).unwrap();
    let args = ["eval", dir.to_str().unwrap(), "--data", shard.to_str().unwrap()];
    let json = json_of(&zeroflow(&[&args[..], &["--window", "8", "--json"]].concat()));
    let stream: Vec<u32> = tokens.iter().map(|&t| u32::from(t)).collect();
    let expected = HostModel::open(&dir).unwrap().eval(&stream, 8).unwrap();
    assert_eq!(json["tokens"], 49);
    assert_eq!(json["loss"].as_f64(), Some(expected.loss));
    let plain = text(&zeroflow(&args).stdout);
    assert!(plain.starts_with("loss ") && plain.contains("over 49 tokens"), "{plain}");
}

/// A prompt outside the vocabulary, a bad id list, a window past the context and text without
/// a tokenizer each exit 2 naming what is wrong.
#[test]
fn bad_input_exits_2_naming_it() {
    let dir = hf_dir("bad");
    let model_dir = dir.to_str().unwrap();
    let shard = dir.with_file_name("data.bin");
    zeroflow_data::write_shard(&shard, &[1, 2, 3, 4]).unwrap();
    let generate = |extra: &[&'static str]| -> Vec<&str> {
        [&["generate", model_dir, "--max-new-tokens", "2"], extra].concat()
    };
    let cases: [(Vec<&str>, &str); 5] = [
        (generate(&["--prompt-tokens", "1,64"]), "token 64 is outside the vocabulary (64)"),
        (generate(&["--prompt-tokens", "1;2"]), "--prompt-tokens"),
        (generate(&["--prompt", "hi"]), "--tokenizer"),
        (generate(&["--prompt-tokens", "1", "--temperature=-1"]), "--temperature"),
        (
            vec!["eval", model_dir, "--data", shard.to_str().unwrap(), "--window", "17"],
            "--window 17",
        ),
    ];
    for (args, named) in cases {
        let run = zeroflow(&args);
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
    }
}
