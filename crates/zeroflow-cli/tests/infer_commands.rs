//! `zeroflow generate` and `zeroflow eval` on a Hugging Face GPT-2 directory (the checkpoint
//! fixture, exported): their JSON is the library's `HostModel` answer, and bad input exits 2.

#[path = "support/chat_model.rs"]
mod chat_model;
mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use zeroflow_train::infer::{Completion, EvalStream, HostModel, Sampling};

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
    let expected = HostModel::open(&dir).unwrap().eval(EvalStream::of(&stream), 8).unwrap();
    assert_eq!(json["tokens"], 49);
    assert_eq!(json["loss"].as_f64(), Some(expected.loss));
    let plain = text(&zeroflow(&args).stdout);
    assert!(plain.starts_with("loss ") && plain.contains("over 49 tokens"), "{plain}");
    // A Hugging Face directory has no evaluation set of its own.
    let without = zeroflow(&["eval", dir.to_str().unwrap()]);
    assert_eq!(without.status.code(), Some(2));
    assert!(text(&without.stderr).contains("give --data"), "{}", text(&without.stderr));
    assert!(plain.contains("(windows of "), "{plain}");
}

/// A tokenizer.json of three letters within the fixture's 64 ids: `a` 3, `b` 17, `c` 40.
fn letters_tokenizer() -> Value {
    let ids = [("a", 3u32), ("b", 17), ("c", 40)];
    let vocab: serde_json::Map<String, Value> =
        ids.iter().map(|(piece, id)| (piece.to_string(), Value::from(*id))).collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
}

/// `eval --data TEXT` on a directory with a tokenizer.json reads the text as that tokenizer's
/// tokens (not bytes: the fixture's 64 ids hold no byte of it), and `--tokenizer` names another.
#[test]
fn eval_of_text_uses_the_models_tokenizer() {
    let dir = hf_dir("eval_text");
    let file = dir.with_file_name("tokenizer.json");
    std::fs::write(&file, letters_tokenizer().to_string()).unwrap();
    let data = dir.with_file_name("text.txt");
    std::fs::write(&data, "abcacbba".repeat(4)).unwrap();
    let stream: Vec<u32> = "abcacbba"
        .repeat(4)
        .chars()
        .map(|c| match c {
            'a' => 3,
            'b' => 17,
            _ => 40,
        })
        .collect();
    let expected = HostModel::open(&dir).unwrap().eval(EvalStream::of(&stream), 8).unwrap();
    let args = ["eval", dir.to_str().unwrap(), "--data", data.to_str().unwrap(), "--window", "8"];
    let named = json_of(&zeroflow(
        &[&args[..], &["--tokenizer", file.to_str().unwrap(), "--json"]].concat(),
    ));
    assert_eq!(named["loss"].as_f64(), Some(expected.loss));
    // As bytes the text is outside the vocabulary: refused, naming the ids.
    let as_bytes = zeroflow(&args);
    assert_eq!(as_bytes.status.code(), Some(2), "{}", text(&as_bytes.stdout));
    std::fs::copy(&file, dir.join("tokenizer.json")).unwrap();
    let own = json_of(&zeroflow(&[&args[..], &["--json"]].concat()));
    assert_eq!(own["loss"].as_f64(), Some(expected.loss));
    assert_eq!(own["tokens"], 31);
}

/// `generate --prompt TEXT` on a directory with a tokenizer.json encodes the prompt with it and
/// decodes what it writes, as `--prompt-tokens` of the same ids with `--tokenizer` does.
#[test]
fn generate_uses_the_models_own_tokenizer() {
    let dir = hf_dir("generate_text");
    std::fs::write(dir.join("tokenizer.json"), letters_tokenizer().to_string()).unwrap();
    let model_dir = dir.to_str().unwrap();
    let tail = ["--max-new-tokens", "6", "--no-stop", "--json"];
    let by_text =
        json_of(&zeroflow(&[&["generate", model_dir, "--prompt", "abca"][..], &tail].concat()));
    let by_ids = ["generate", model_dir, "--prompt-tokens", "3,17,40,3"];
    let expected = json_of(&zeroflow(&[&by_ids[..], &tail].concat()));
    assert_eq!(by_text, expected);
    let model = HostModel::open(&dir).unwrap();
    let completion =
        Completion { max_new_tokens: 6, sampling: Sampling::GREEDY, seed: 0, stop: false };
    let tokens = model.complete(&[3, 17, 40, 3], &completion).unwrap();
    assert_eq!(expected["tokens"], serde_json::json!(tokens));
    // The new ids outside the three letters decode to nothing; the letters to themselves.
    let letters: String = tokens
        .iter()
        .filter_map(|t| match t {
            3 => Some('a'),
            17 => Some('b'),
            40 => Some('c'),
            _ => None,
        })
        .collect();
    assert_eq!(expected["text"], letters, "{expected}");
}

/// `generate --chat`: the prompt becomes one user message in the tokenizer's chat template with
/// the assistant's turn opened (ChatML here, so its ids are known: `<|im_start|>` 256, the bytes,
/// `<|im_end|>` 257), after a system message where `--system` gives one, and the completion
/// ends at the tokenizer's `eos_token`.
#[test]
fn generate_chat_renders_the_template_and_stops_at_the_end_of_a_turn() {
    let dir = support::scratch_in("infer_commands", "chat");
    chat_model::write_model_dir(&dir);
    let model_dir = dir.to_str().unwrap();
    let tail = ["--max-new-tokens", "8", "--json"];
    let mut rendered = vec![256];
    rendered.extend(b"user\nhi".map(u32::from));
    rendered.extend([257, u32::from(b'\n'), 256]);
    rendered.extend(b"assistant\n".map(u32::from));
    let ids: Vec<String> = rendered.iter().map(u32::to_string).collect();
    let by_ids = ["generate", model_dir, "--prompt-tokens", &ids.join(","), "--no-stop"];
    let free = json_of(&zeroflow(&[&by_ids[..], &tail].concat()));
    let chat = ["generate", model_dir, "--chat", "--prompt", "hi", "--no-stop"];
    assert_eq!(json_of(&zeroflow(&[&chat[..], &tail].concat()))["tokens"], free["tokens"]);
    // --system: a system message before the user's.
    let mut with_system = vec![256];
    with_system.extend(b"system\nbe brief".map(u32::from));
    with_system.extend([257, u32::from(b'\n')]);
    with_system.extend(&rendered);
    let ids: Vec<String> = with_system.iter().map(u32::to_string).collect();
    let by_ids = ["generate", model_dir, "--prompt-tokens", &ids.join(","), "--no-stop"];
    let system = json_of(&zeroflow(&[&chat[..], &["--system", "be brief"], &tail].concat()));
    assert_eq!(system["tokens"], json_of(&zeroflow(&[&by_ids[..], &tail].concat()))["tokens"]);

    // The end of a turn: the tokenizer's eos_token made a token the completion writes.
    let tokens: Vec<u64> =
        free["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let at = tokens.iter().position(|&t| t < 256).expect("a byte");
    let turn_end = tokens[at];
    let eos = chat_model::byte_char(turn_end as u8).to_string();
    let config = serde_json::json!({"eos_token": eos, "chat_template": read_template(&dir)});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let stopped = json_of(&zeroflow(&[&chat[..5], &tail].concat()));
    assert_eq!(stopped["tokens"], serde_json::json!(tokens[..=at]), "{free}");
    let without_chat = ["generate", model_dir, "--prompt-tokens", &ids.join(",")];
    assert_eq!(json_of(&zeroflow(&[&without_chat[..], &tail].concat()))["tokens"], free["tokens"]);
}

/// The chat template of the directory's tokenizer_config.json.
fn read_template(dir: &Path) -> String {
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    config["chat_template"].as_str().unwrap().to_owned()
}

/// A prompt outside the vocabulary, a bad id list, a window past the context, text without a
/// tokenizer, no prompt at all, `--chat` without a tokenizer, and a MODEL that is missing or holds
/// no model (for `generate` and `eval`; it was
/// "has no tokenizer.json" and an internal error) each exit 2 naming what is wrong.
#[test]
fn bad_input_exits_2_naming_it() {
    let dir = hf_dir("bad");
    let model_dir = dir.to_str().unwrap();
    let shard = dir.with_file_name("data.bin");
    zeroflow_data::write_shard(&shard, &[1, 2, 3, 4]).unwrap();
    let (missing, empty) = (dir.with_file_name("missing"), dir.with_file_name("empty"));
    std::fs::create_dir_all(&empty).unwrap();
    let (missing, empty) = (missing.to_str().unwrap(), empty.to_str().unwrap());
    let generate = |extra: &[&'static str]| -> Vec<&str> {
        [&["generate", model_dir, "--max-new-tokens", "2"], extra].concat()
    };
    let eval = |model| vec!["eval", model, "--data", shard.to_str().unwrap()];
    let cases: [(Vec<&str>, &str); 11] = [
        (generate(&["--prompt-tokens", "1,64"]), "token 64 is outside the vocabulary (64)"),
        (generate(&["--prompt-tokens", "1;2"]), "--prompt-tokens"),
        (generate(&["--prompt", "hi"]), "--tokenizer"),
        (generate(&[]), "give the prompt: --prompt TEXT"),
        (generate(&["--chat"]), "--chat renders prompts with the tokenizer's chat template"),
        (generate(&["--prompt-tokens", "1", "--temperature=-1"]), "--temperature"),
        ([&eval(model_dir)[..], &["--window", "17"]].concat(), "--window 17"),
        (vec!["generate", missing, "--prompt", "hi", "--max-new-tokens", "2"], "no such directory"),
        (vec!["generate", empty, "--prompt", "hi", "--max-new-tokens", "2"], "holds no model"),
        (eval(missing), "no such directory; give a Hugging Face model directory"),
        (eval(empty), "holds no model"),
    ];
    for (args, named) in cases {
        let run = zeroflow(&args);
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
    }
}

/// The checkpoint itself (and its run directory) as MODEL: `generate` and `eval` print what its
/// Hugging Face export gives.
#[test]
fn a_checkpoint_or_its_run_directory_serves_as_the_model() {
    let exported = hf_dir("checkpoint");
    let checkpoint = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE);
    let run_dir = checkpoint.parent().unwrap().parent().unwrap();
    let generate = |model: &Path| {
        let args = ["generate", model.to_str().unwrap(), "--prompt-tokens", "40,33,48"];
        json_of(&zeroflow(&[&args[..], &["--max-new-tokens", "6", "--no-stop", "--json"]].concat()))
    };
    let expected = generate(&exported);
    assert_eq!(expected["tokens"].as_array().map(Vec::len), Some(6));
    assert_eq!(generate(&checkpoint), expected);
    assert_eq!(generate(run_dir), expected);
    let shard = exported.with_file_name("data.bin");
    zeroflow_data::write_shard(&shard, &(0..40).map(|i| (i * 5 % 64) as u16).collect::<Vec<_>>())
        .unwrap();
    let eval = |model: &Path| {
        let args = ["eval", model.to_str().unwrap(), "--data", shard.to_str().unwrap(), "--json"];
        json_of(&zeroflow(&args))
    };
    assert_eq!(eval(&checkpoint), eval(&exported));
}

/// `--prompts` runs every prompt of the file as one batch and prints a JSON line per prompt, in
/// order, each the tokens that prompt gets alone (greedy), from a `.jsonl` or a `.json` of JSON
/// lines; text prompts need a tokenizer.
#[test]
fn a_prompts_file_prints_one_json_line_per_prompt() {
    let dir = hf_dir("prompts");
    let model_dir = dir.to_str().unwrap();
    let alone = |prompt: &str| {
        let args = ["generate", model_dir, "--prompt-tokens", prompt, "--max-new-tokens", "5"];
        json_of(&zeroflow(&[&args[..], &["--no-stop", "--json"]].concat()))["tokens"].clone()
    };
    let jsonl = dir.with_file_name("prompts.jsonl");
    let lines =
        "{\"prompt_tokens\": [40, 33, 48]}\n\n{\"prompt\": \"1\"}\n{\"prompt_tokens\": [7]}\n";
    std::fs::write(&jsonl, lines).unwrap();
    let args = ["generate", model_dir, "--prompts", jsonl.to_str().unwrap(), "--json"];
    let run = zeroflow(
        &[&args[..], &["--max-new-tokens", "5", "--no-stop", "--tokenizer", "bytes"]].concat(),
    );
    assert!(run.status.success(), "{}", text(&run.stderr));
    let out: Vec<Value> =
        text(&run.stdout).lines().map(|line| serde_json::from_str(line).unwrap()).collect();
    assert_eq!(out.len(), 3, "blank lines are skipped");
    // The text prompt "1" through the byte tokenizer is the id 49.
    for (index, (line, prompt)) in out.iter().zip(["40,33,48", "49", "7"]).enumerate() {
        assert_eq!(line["index"], index);
        assert_eq!(line["tokens"], alone(prompt), "prompt {index}");
    }
    // The same lines in a .json (JSON Lines under that name) are read as JSON, not as text.
    let json = dir.with_file_name("prompts.json");
    std::fs::write(&json, lines).unwrap();
    let args = ["generate", model_dir, "--prompts", json.to_str().unwrap(), "--json"];
    let from_json = zeroflow(
        &[&args[..], &["--max-new-tokens", "5", "--no-stop", "--tokenizer", "bytes"]].concat(),
    );
    assert!(from_json.status.success(), "{}", text(&from_json.stderr));
    assert_eq!(text(&from_json.stdout), text(&run.stdout));
    let plain = dir.with_file_name("prompts.txt");
    std::fs::write(&plain, "40,33,48\nnot ids\n").unwrap();
    let args =
        ["generate", model_dir, "--prompts", plain.to_str().unwrap(), "--max-new-tokens", "2"];
    let refused = zeroflow(&args);
    assert_eq!(refused.status.code(), Some(2));
    assert!(text(&refused.stderr).contains("prompt 2"), "{}", text(&refused.stderr));
}

/// `eval` of chat data counts the assistant's tokens only, as training does: a `.jsonl` of
/// conversations is tokenized with the model's template (its loss mask kept) and gives the loss
/// of `zeroflow tokenize`'s shards of it, over as many tokens as the mask keeps; the same shards
/// without their mask file give another loss, over every token.
#[test]
fn eval_of_chat_data_counts_the_assistants_tokens() {
    let dir = support::scratch_in("infer_commands", "eval_chat");
    let model = dir.join("model");
    chat_model::write_model_dir(&model);
    let chat = dir.join("chat.jsonl");
    chat_model::write_conversations(&chat, 12);
    let (model_arg, shards) = (model.to_str().unwrap(), dir.join("shards"));
    let eval = |data: &Path| {
        let args = ["eval", model_arg, "--data", data.to_str().unwrap(), "--window", "32"];
        json_of(&zeroflow(&[&args[..], &["--json"]].concat()))
    };
    let from_jsonl = eval(&chat);
    let tokenize = ["tokenize", "--tokenizer", model_arg, chat.to_str().unwrap()];
    let tokenized = zeroflow(&[&tokenize[..], &["--out", shards.to_str().unwrap()]].concat());
    assert!(tokenized.status.success(), "{}", text(&tokenized.stderr));
    let from_shards = eval(&shards);
    assert_eq!(from_jsonl, from_shards, "the .jsonl is evaluated as its shards");
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(shards.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(from_shards["tokens"], manifest["assistant_tokens"], "{from_shards}");
    std::fs::remove_file(shards.join("tokens_000000.mask")).unwrap();
    let unmasked = eval(&shards);
    assert_eq!(unmasked["tokens"], manifest["tokens"].as_u64().unwrap() - 1, "{unmasked}");
    assert_ne!(unmasked["loss"], from_shards["loss"]);
}

/// A run fine-tuned from a model directory on conversations, given as MODEL (its run directory),
/// encodes text as its run did: `eval` and `generate --chat` take the tokenizer of the run's
/// `--init-from` directory and the run's `--chat-template` and `--chat-template-kwargs`, the
/// same as naming them (regression: both refused the run directory for want of a
/// tokenizer.json); the flags override what they name, and the model's own template gives
/// another loss.
#[test]
fn a_run_directory_encodes_text_as_its_run_did() {
    let dir = support::scratch_in("infer_commands", "run_text");
    let (model, chat, run) = (dir.join("model"), dir.join("chat.jsonl"), dir.join("run"));
    chat_model::write_model_dir(&model);
    chat_model::write_conversations(&chat, 30);
    let template = dir.join("with_system.jinja");
    let own = read_template(&model);
    let system = "{%- if system_prompt is defined %}{{- '<|im_start|>system\\n' + system_prompt + \
                  '<|im_end|>\\n' }}{%- endif %}";
    std::fs::write(&template, format!("{system}{own}")).unwrap();
    let kwargs = r#"{"system_prompt": "Be brief."}"#;
    let (model_arg, chat_arg, run_arg) =
        (model.to_str().unwrap(), chat.to_str().unwrap(), run.to_str().unwrap());
    let template_arg = template.to_str().unwrap();
    let mut train = vec!["train", "--init-from", model_arg, "--data", chat_arg, "--steps", "2"];
    train.extend(["--micro-batch", "2", "--seq", "32", "--eval-every", "0", "--out", run_arg]);
    train.extend(["--chat-template", template_arg, "--chat-template-kwargs", kwargs]);
    let trained = zeroflow(&train);
    assert!(trained.status.success(), "{}", text(&trained.stderr));

    let eval = |extra: &[&str]| {
        let args = ["eval", run_arg, "--data", chat_arg, "--window", "32", "--json"];
        json_of(&zeroflow(&[&args[..], extra].concat()))
    };
    let as_run = eval(&[]);
    assert_eq!(as_run["window"], 32);
    // Without --window, the run's own windows (its --seq, 32), not the model's context (64).
    let by_default = json_of(&zeroflow(&["eval", run_arg, "--data", chat_arg, "--json"]));
    assert_eq!(by_default, as_run);
    let of_model = ["eval", model_arg, "--data", chat_arg, "--json"];
    assert_eq!(json_of(&zeroflow(&of_model))["window"], 64, "a directory: the context");
    let named = ["--tokenizer", model_arg, "--chat-template", template_arg];
    assert_eq!(as_run, eval(&[&named[..], &["--chat-template-kwargs", kwargs]].concat()));
    let own_file = dir.join("own.jinja");
    std::fs::write(&own_file, &own).unwrap();
    let own_flags = ["--chat-template", own_file.to_str().unwrap(), "--chat-template-kwargs", "{}"];
    assert_ne!(as_run["loss"], eval(&own_flags)["loss"], "the model's own template");

    let generate = |extra: &[&str]| {
        let args = ["generate", run_arg, "--chat", "--prompt", "question number 3?"];
        json_of(&zeroflow(&[&args[..], &["--max-new-tokens", "6", "--json"], extra].concat()))
    };
    let reply = generate(&[]);
    assert!(!reply["tokens"].as_array().unwrap().is_empty(), "{reply}");
    // Named the same way (generate has no --chat-template: the run's template by its path
    // through the checkpoint, the kwargs given).
    assert_eq!(generate(&["--tokenizer", model_arg, "--chat-template-kwargs", kwargs]), reply);
}

/// `generate --chat` without a prompt is a conversation read from standard input: each line a
/// user message (blank ones skipped), each reply printed and kept. Of a run trained to reply
/// and end its turn, the second reply is the one `--prompts` gives for the conversation so far
/// (the first reply as the assistant's message, without the token that ended it); without any
/// prompt or --chat, the error names them all. A conversation longer than the context goes on
/// without its oldest exchanges.
#[test]
fn a_chat_without_a_prompt_is_a_conversation_from_standard_input() {
    use std::io::Write;
    let dir = support::scratch_in("infer_commands", "conversation");
    let (model, chat, run) = (dir.join("model"), dir.join("chat.jsonl"), dir.join("run"));
    chat_model::write_model_dir(&model);
    // A context long enough for two turns, and a run that learns to reply and end its turn.
    let config = model.join("config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["max_position_embeddings"] = 256.into();
    std::fs::write(&config, json.to_string()).unwrap();
    chat_model::write_conversations(&chat, 60);
    let mut train = vec!["train", "--init-from", model.to_str().unwrap(), "--data"];
    train.extend([chat.to_str().unwrap(), "--steps", "100", "--micro-batch", "4", "--seq", "64"]);
    train.extend(["--lr", "1e-2", "--eval-every", "0", "--out", run.to_str().unwrap()]);
    let trained = zeroflow(&train);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    let model_arg = run.to_str().unwrap();
    // `generate --chat` of the run, replying at most `most` tokens, fed `input`.
    let converse = |most: &str, input: &[u8]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .args(["generate", model_arg, "--chat", "--max-new-tokens", most, "--json"])
            .env("ZEROFLOW_LOG", "warn")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(input).unwrap();
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", text(&output.stderr));
        output
    };
    let output = converse("40", b"3?\n\n4?\n");
    let replies: Vec<Value> =
        text(&output.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert_eq!((replies[0]["turn"].clone(), replies[1]["turn"].clone()), (0.into(), 1.into()));
    // The reply ended its turn with <|im_end|> (257), which its message leaves out.
    assert_eq!(replies[0]["tokens"].as_array().unwrap().last(), Some(&257.into()), "{replies:?}");
    let first = replies[0]["text"].as_str().unwrap();
    assert!(!first.contains("<|im_end|>"), "{first}");
    let so_far = serde_json::json!({"messages": [
        {"role": "user", "content": "3?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "4?"},
    ]});
    let prompts = dir.join("so-far.jsonl");
    std::fs::write(&prompts, format!("{so_far}\n")).unwrap();
    let args = ["generate", model_arg, "--chat", "--prompts", prompts.to_str().unwrap()];
    let batch = json_of(&zeroflow(&[&args[..], &["--max-new-tokens", "40", "--json"]].concat()));
    assert_eq!(batch["tokens"], replies[1]["tokens"], "{batch} against {}", replies[1]);

    // A conversation longer than the context goes on without its oldest exchanges (it ended
    // with an error at the turn that passed the context).
    let questions: String = (1..=12).map(|i| format!("{i}?\n")).collect();
    let output = converse("150", questions.as_bytes());
    let stderr = text(&output.stderr);
    assert_eq!(text(&output.stdout).lines().count(), 12, "a reply to every message");
    assert!(stderr.contains("the conversation's oldest"), "{stderr}");

    let none = zeroflow(&["generate", model_arg]);
    assert_eq!(none.status.code(), Some(2));
    let said = text(&none.stderr);
    assert!(said.contains("--prompt TEXT, --prompt-tokens IDS or --prompts FILE"), "{said}");
}
