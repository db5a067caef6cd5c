//! README's "Fine-tune a Hugging Face model on chat data", step by step on the CPU: a tiny random
//! Llama directory with a byte-level tokenizer.json and a ChatML template with generation markers
//! (`support/chat_model.rs`), `train --init-from DIR --data chat.jsonl` (tokenized at start-up
//! into the run directory, with the assistant-only loss mask, and an evaluation set of
//! conversations held out across it), `export` of the last checkpoint, and `generate --chat` of the export.

use std::path::Path;

use serde_json::json;

use super::chat_model::{write_conversations, write_model_dir};
use super::{read_lines, scratch, text, train};

#[test]
fn readme_fine_tune_on_chat_data_trains_and_exports() {
    let dir = scratch("chat_fine_tune");
    let (model, chat, run, exported) =
        (dir.join("model"), dir.join("chat.jsonl"), dir.join("run"), dir.join("exported"));
    write_model_dir(&model);
    write_conversations(&chat, 60);
    let args = [
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        chat.to_str().unwrap(),
        "--steps",
        "20",
        "--micro-batch",
        "4",
        "--seq",
        "32",
        "--lr",
        "1e-2",
        "--eval-every",
        "0",
        "--out",
        run.to_str().unwrap(),
        "--export",
        exported.to_str().unwrap(),
        "--sample-every",
        "10",
        "--sample-prompt",
        "question number 7?",
    ];
    let trained = train(&args);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    assert!(run.join("tokens/rank-0/tokens_000000.mask").is_file(), "the loss mask was written");
    let lines = read_lines(&run.join("metrics.jsonl"));
    let losses: Vec<f64> = lines.iter().filter_map(|l| l.get("loss")?.as_f64()).collect();
    assert_eq!(losses.len(), 20);
    assert!(losses[19] < losses[0] - 1.0, "the assistant's reply is learned: {losses:?}");
    let evals: Vec<f64> = lines.iter().filter_map(|l| l.get("eval_loss")?.as_f64()).collect();
    // Evaluated at the start (--init-from) and at the end, on the held-out conversations.
    assert_eq!(evals.len(), 2, "{lines:?}");
    assert!(evals[1] < evals[0], "{evals:?}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    let eval_data = summary["eval_data"].as_str().unwrap();
    assert!(eval_data.contains("documents held out across --data"), "{eval_data}");
    assert!(eval_data.contains("never trained"), "{eval_data}");
    let events = std::fs::read_dir(&run)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("events.out.tfevents."))
        .count();
    assert_eq!(events, 1, "one TensorBoard event file");

    // The samples of a run on conversations: the prompt as a user message in the template, the
    // reply ending at the template's end of a turn, <|im_end|> (257), as `generate --chat` does.
    let samples = read_lines(&run.join("samples.jsonl"));
    assert_eq!(samples.len(), 2, "{samples:?}");
    assert!(samples.iter().all(|s| s["chat"] == true), "{samples:?}");
    let tokenizer = zeroflow_data::Tokenizer::of_dir(&model).unwrap().unwrap();
    let template = zeroflow_data::ChatTemplate::from_config(tokenizer.config()).unwrap().unwrap();
    let prompt = zeroflow_train::infer::Prompt::Text("question number 7?".into());
    let prompt = prompt.chat_tokens(&tokenizer, &template).unwrap();
    let mut last =
        zeroflow_train::infer::HostModel::open(&run.join("checkpoints/step-00000020")).unwrap();
    last.also_stop_at(257);
    let greedy = zeroflow_train::infer::Completion {
        max_new_tokens: 32,
        sampling: zeroflow_train::infer::Sampling::GREEDY,
        seed: 0,
        stop: true,
    };
    let expected = last.complete(&prompt, &greedy).unwrap();
    assert_eq!(samples[1]["tokens"], json!(expected));

    for file in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        assert!(exported.join(file).is_file(), "{file} exported");
    }
    // The template ends a reply with <|im_end|> (257): the exported generation config stops
    // there, made from config.json's ids (the source has none).
    let generation = std::fs::read_to_string(exported.join("generation_config.json")).unwrap();
    let generation: serde_json::Value = serde_json::from_str(&generation).unwrap();
    let stops = generation["eos_token_id"].as_array().unwrap();
    assert!(stops.contains(&json!(257)), "{generation}");
    let generate = std::process::Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["generate", exported.to_str().unwrap(), "--chat", "--prompt", "question number 7?"])
        .args(["--max-new-tokens", "40", "--json"])
        .output()
        .unwrap();
    assert!(generate.status.success(), "{}", text(&generate.stderr));
    // The exported directory's own tokenizer and template: a reply as ids and decoded text.
    let reply: serde_json::Value = serde_json::from_slice(&generate.stdout).unwrap();
    assert!(!reply["tokens"].as_array().unwrap().is_empty(), "{reply}");
    assert!(reply["text"].is_string(), "{reply}");
}

/// `train --data chat.jsonl --pack`: the conversations tokenized at start-up come with their
/// document index, so the Llama model trains on packed rows (each conversation attending only
/// to itself, the loss still the assistant's only) and evaluates on packed windows.
#[test]
fn chat_data_trains_packed() {
    let dir = scratch("chat_packed");
    let (model, chat, run) = (dir.join("model"), dir.join("chat.jsonl"), dir.join("run"));
    write_model_dir(&model);
    write_conversations(&chat, 60);
    let args = [
        "--init-from",
        model.to_str().unwrap(),
        "--data",
        chat.to_str().unwrap(),
        "--pack",
        "--steps",
        "10",
        "--micro-batch",
        "4",
        "--seq",
        "64",
        "--lr",
        "1e-2",
        "--eval-every",
        "0",
        "--out",
        run.to_str().unwrap(),
    ];
    let trained = train(&args);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    assert!(run.join("tokens/rank-0/tokens_000000.idx").is_file(), "the document index");
    let lines = read_lines(&run.join("metrics.jsonl"));
    let losses: Vec<f64> = lines.iter().filter_map(|l| l.get("loss")?.as_f64()).collect();
    assert_eq!(losses.len(), 10);
    assert!(losses[9] < losses[0], "it learns: {losses:?}");
    let evals = lines.iter().filter(|l| l.get("eval_loss").is_some()).count();
    assert_eq!(evals, 2, "{lines:?}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["settings"]["pack"], true, "{summary}");
}

/// `--chat-template FILE` and `--chat-template-kwargs` render the data tokenized at start-up (a
/// template that writes a system prompt where `system_prompt` is given: more tokens, none of
/// them trained); the file is among the tokens' sources, both are in the checkpoint, a resume
/// without the flags keeps them (it reads the same tokens again rather than tokenizing
/// otherwise), and the run's exports carry the template.
#[test]
fn a_chat_template_and_its_kwargs_are_kept_with_the_tokens_and_across_a_resume() {
    let dir = scratch("chat_template_kwargs");
    let (model, chat) = (dir.join("model"), dir.join("chat.jsonl"));
    write_model_dir(&model);
    write_conversations(&chat, 60);
    // The model's ChatML template, with a system prompt where the variable is given, in a file.
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model.join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let own = config["chat_template"].as_str().unwrap();
    let template = dir.join("with_system.jinja");
    std::fs::write(
        &template,
        format!(
            "{{%- if system_prompt is defined %}}{{{{- '<|im_start|>system\\n' + system_prompt + \
             '<|im_end|>\\n' }}}}{{%- endif %}}{own}"
        ),
    )
    .unwrap();
    let run_with = |out: &Path, extra: &[&str]| {
        let mut args = vec!["--init-from", model.to_str().unwrap(), "--data"];
        args.extend([chat.to_str().unwrap(), "--steps", "2", "--save-every", "1"]);
        args.extend(["--micro-batch", "2", "--seq", "32", "--eval-every", "0"]);
        args.extend(["--out", out.to_str().unwrap()]);
        let trained = train(&[&args[..], extra].concat());
        assert!(trained.status.success(), "{}", text(&trained.stderr));
    };
    let made = |out: &Path| -> serde_json::Value {
        let record = std::fs::read_to_string(out.join("tokens/rank-0/made-from.json")).unwrap();
        serde_json::from_str(&record).unwrap()
    };
    let (plain, with) = (dir.join("plain"), dir.join("with"));
    run_with(&plain, &[]);
    let kwargs = r#"{"system_prompt": "Answer the same way."}"#;
    let flags = ["--chat-template", template.to_str().unwrap(), "--chat-template-kwargs", kwargs];
    run_with(&with, &flags);
    let (plain_made, with_made) = (made(&plain), made(&with));
    assert_eq!(with_made["chat_template_kwargs"], json!({"system_prompt": "Answer the same way."}));
    let sources = with_made["sources"].as_array().unwrap();
    assert!(sources.iter().any(|s| s["path"] == json!(template)), "{with_made}");
    let count = |m: &serde_json::Value, what: &str| m["summary"][what].as_u64().unwrap();
    assert!(count(&with_made, "tokens") > count(&plain_made, "tokens"), "{with_made}");
    assert_eq!(count(&with_made, "assistant_tokens"), count(&plain_made, "assistant_tokens"));
    let extra = |step: &str| -> serde_json::Value {
        let path = with.join("checkpoints").join(step).join("state.json");
        let state: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        json!([state["extra"]["chat_template"], state["extra"]["chat_template_kwargs"]])
    };
    let want = json!([template, with_made["chat_template_kwargs"]]);
    assert_eq!(extra("step-00000002"), want);
    // Resumed from step 1 without the flags: the checkpoint's template and variables, the tokens
    // read again.
    std::fs::remove_dir_all(with.join("checkpoints").join("step-00000002")).unwrap();
    let shard = with.join("tokens/rank-0/tokens_000000.bin");
    let written = std::fs::metadata(&shard).unwrap().modified().unwrap();
    let trained_export = dir.join("trained-export");
    let resumed = train(&[
        "--resume",
        "latest",
        "--out",
        with.to_str().unwrap(),
        "--export",
        trained_export.to_str().unwrap(),
    ]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    assert_eq!(std::fs::metadata(&shard).unwrap().modified().unwrap(), written, "tokenized again");
    assert_eq!(extra("step-00000002"), want);
    // Its exports carry the template it trained with: as chat_template.jinja, and in the
    // tokenizer_config.json copied from the model, whichever a reader takes.
    let trained_with = std::fs::read_to_string(&template).unwrap();
    let exported_template = |exported: &Path| {
        let config = std::fs::read_to_string(exported.join("tokenizer_config.json")).unwrap();
        let config: serde_json::Value = serde_json::from_str(&config).unwrap();
        let jinja = std::fs::read_to_string(exported.join("chat_template.jinja")).ok();
        (jinja, config["chat_template"].as_str().unwrap().to_owned(), config["eos_token"].clone())
    };
    let with_template = (Some(trained_with.clone()), trained_with, json!("<|im_end|>"));
    assert_eq!(exported_template(&trained_export), with_template);
    let export = |to: &Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .args(["export", with.to_str().unwrap(), "--out", to.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let exported = dir.join("exported");
    let output = export(&exported);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert_eq!(exported_template(&exported), with_template);
    // With the template file gone, the export says so and keeps the model's own.
    std::fs::rename(&template, dir.join("moved.jinja")).unwrap();
    let without = dir.join("exported-without");
    let output = export(&without);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let said = text(&output.stderr);
    assert!(said.contains("not the one the run trained with"), "{said}");
    assert_eq!(exported_template(&without), (None, own.to_owned(), json!("<|im_end|>")));
    std::fs::rename(dir.join("moved.jinja"), &template).unwrap();
    // A template file that is not there is refused by its flag, before anything is tokenized.
    let missing = dir.join("missing.jinja");
    let mut args = vec!["--init-from", model.to_str().unwrap(), "--data", chat.to_str().unwrap()];
    let out = dir.join("refused");
    args.extend(["--out", out.to_str().unwrap(), "--chat-template", missing.to_str().unwrap()]);
    let refused = train(&args);
    assert!(!refused.status.success());
    let said = text(&refused.stderr);
    assert!(
        said.contains(&format!("--chat-template {}: no such file", missing.display())),
        "{said}"
    );
}

/// A run's `--chat-template-kwargs` decide the turn end its exports stop at: a template that ends
/// the assistant's turn with `<|endoftext|>` (258) where `eot_end` is set, `<|im_end|>` (257)
/// otherwise, trained with it set, exports 258 among the generation config's end-of-text ids,
/// at the end of the run and by `zeroflow export` (regression: the turn end was found without the
/// variables, 257).
#[test]
fn the_exported_turn_end_is_the_one_of_the_runs_template_variables() {
    let dir = scratch("turn_end_kwargs");
    let (model, chat, run) = (dir.join("model"), dir.join("chat.jsonl"), dir.join("run"));
    write_model_dir(&model);
    write_conversations(&chat, 60);
    let template = dir.join("ends.jinja");
    let end = "('<|endoftext|>' if eot_end is defined else '<|im_end|>')";
    std::fs::write(
        &template,
        format!(
            "{{%- for message in messages %}}{{{{- '<|im_start|>' + message.role + '\\n' }}}}\
             {{%- if message.role == 'assistant' %}}{{% generation %}}{{{{- message.content + \
             {end} }}}}{{% endgeneration %}}{{{{- '\\n' }}}}{{%- else %}}{{{{- message.content + \
             '<|im_end|>\\n' }}}}{{%- endif %}}{{%- endfor %}}{{%- if add_generation_prompt %}}\
             {{{{- '<|im_start|>assistant\\n' }}}}{{%- endif %}}"
        ),
    )
    .unwrap();
    let at_end = dir.join("at-end");
    let mut args = vec!["--init-from", model.to_str().unwrap(), "--data", chat.to_str().unwrap()];
    args.extend(["--chat-template", template.to_str().unwrap()]);
    args.extend(["--chat-template-kwargs", r#"{"eot_end": true}"#, "--steps", "1"]);
    args.extend(["--micro-batch", "2", "--seq", "32", "--eval-every", "0"]);
    args.extend(["--out", run.to_str().unwrap(), "--export", at_end.to_str().unwrap()]);
    let trained = train(&args);
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    let exported = dir.join("exported");
    let export = std::process::Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["export", run.to_str().unwrap(), "--out", exported.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(export.status.success(), "{}", text(&export.stderr));
    for dir in [&at_end, &exported] {
        let generation = std::fs::read_to_string(dir.join("generation_config.json")).unwrap();
        let generation: serde_json::Value = serde_json::from_str(&generation).unwrap();
        let stops = generation["eos_token_id"].as_array().unwrap();
        assert!(stops.contains(&json!(258)) && !stops.contains(&json!(257)), "{generation}");
    }
}

/// Without `--eval-data`, a `.jsonl`'s evaluation set is records held out across it, not its
/// tail: conversations sorted by their number give held-out ones from the start, the middle and
/// the end, none of them in the training shards. The checkpoint records it, and a checkpoint
/// from before (no record) resumes holding out the tail, as its run did, tokenizing again.
#[test]
fn documents_held_out_for_evaluation_are_spread_over_the_data() {
    let dir = scratch("chat_held_out");
    let (model, chat, run) = (dir.join("model"), dir.join("chat.jsonl"), dir.join("run"));
    write_model_dir(&model);
    write_conversations(&chat, 200);
    let mut args = vec!["--init-from", model.to_str().unwrap(), "--data", chat.to_str().unwrap()];
    args.extend(["--steps", "4", "--save-every", "2", "--micro-batch", "2", "--seq", "32"]);
    args.extend(["--eval-every", "0", "--out", run.to_str().unwrap()]);
    let trained = train(&args);
    assert!(trained.status.success(), "{}", text(&trained.stderr));

    let tokenizer = zeroflow_data::Tokenizer::of_dir(&model).unwrap().unwrap();
    let numbers = |folder: &Path| -> Vec<usize> {
        let mut shards: Vec<_> = std::fs::read_dir(folder)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "bin"))
            .collect();
        shards.sort();
        let tokens: Vec<u32> = shards
            .iter()
            .flat_map(|s| zeroflow_data::read_shard(s, usize::MAX).unwrap().to_u32())
            .collect();
        let decoded = tokenizer.decode(&tokens).unwrap();
        let after = decoded.split("question number ").skip(1);
        after.map(|rest| rest.split('?').next().unwrap().parse().unwrap()).collect()
    };
    let tokens = run.join("tokens/rank-0");
    let (held, trained_on) = (numbers(&tokens.join("held-out")), numbers(&tokens));
    assert_eq!(held.len() + trained_on.len(), 200, "{held:?}");
    assert!(held.iter().all(|n| !trained_on.contains(n)), "{held:?}");
    assert!(held.len() >= 3, "{held:?}");
    let (first, last) = (held[0], held[held.len() - 1]);
    assert!(first < 50 && last >= 150, "held out from the whole file: {held:?}");
    let summary = |run: &Path| -> String {
        let summary = std::fs::read_to_string(run.join("summary.json")).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
        summary["eval_data"].as_str().unwrap().to_owned()
    };
    assert!(summary(&run).contains("documents held out across --data"), "{}", summary(&run));
    // `eval` of the run without --data: its evaluation set in its windows, the loss its last
    // evaluation logged (the CPU's f32 both, a window at a time here, two there).
    let run_eval = || {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .args(["eval", run.to_str().unwrap(), "--json"])
            .env("ZEROFLOW_LOG", "warn")
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output.stderr));
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        assert_eq!(json["window"], 32, "{json}");
        let lines = read_lines(&run.join("metrics.jsonl"));
        let logged = lines.iter().rev().find_map(|l| l.get("eval_loss")?.as_f64()).unwrap();
        let loss = json["loss"].as_f64().unwrap();
        assert!((loss - logged).abs() <= 1e-5 * logged, "eval {loss} against the run's {logged}");
    };
    run_eval();
    let state = run.join("checkpoints/step-00000002/state.json");
    let mut saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(saved["extra"]["documents_held_out"], json!(true));

    // A checkpoint from before the record: resumed, its run's tail again.
    saved["extra"].as_object_mut().unwrap().remove("documents_held_out");
    std::fs::write(&state, saved.to_string()).unwrap();
    std::fs::remove_dir_all(run.join("checkpoints/step-00000004")).unwrap();
    let resumed = train(&["--resume", "latest", "--out", run.to_str().unwrap()]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    let said = text(&resumed.stderr);
    assert!(said.contains("another evaluation set"), "{said}");
    assert!(summary(&run).contains("held out from the end"), "{}", summary(&run));
    assert!(!tokens.join("held-out").exists());
    assert_eq!(numbers(&tokens).len(), 200);
    // A run that held out a tail: eval without --data cuts the same tail.
    run_eval();
    // The tokens the run made gone, its evaluation set cannot be made again: said.
    std::fs::remove_dir_all(&tokens).unwrap();
    let gone = std::process::Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["eval", run.to_str().unwrap()])
        .env("ZEROFLOW_LOG", "warn")
        .output()
        .unwrap();
    assert_eq!(gone.status.code(), Some(2));
    let said = text(&gone.stderr);
    assert!(said.contains("which are no longer in") && said.contains("give --data"), "{said}");
}
