//! `tokenize_corpus`: documents and conversations into shards with their index and loss mask,
//! shard sizes, u32 shards, and bad lines.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::json;
use zeroflow_data::{
    ChatTemplate, SHARD_MAGIC_U32, ShardTokens, TokenizeError, TokenizeOptions, TokenizeSummary,
    Tokenizer, describe_setup, encode_text_file, read_document_index, read_loss_mask, read_shard,
    tokenize_corpus,
};

use crate::fixtures::{
    LLAMA3_TEMPLATE, Sentencepiece, byte_level_bpe, llama3_split_bpe, model_dir, one, scratch,
    sentencepiece_bpe, special_id, three_turns, without_markers, word_level_big,
};

fn options(out_dir: &Path, shard_tokens: usize) -> TokenizeOptions<'static> {
    TokenizeOptions { shard_tokens, ..TokenizeOptions::new(out_dir.into(), None) }
}

fn run(
    tokenizer: &Tokenizer,
    inputs: &[PathBuf],
    options: &TokenizeOptions<'_>,
) -> Result<TokenizeSummary, TokenizeError> {
    let consumed = AtomicU64::new(0);
    let summary = tokenize_corpus(tokenizer, inputs, options, &|n| {
        consumed.fetch_add(n, Ordering::Relaxed);
    })?;
    assert_eq!(consumed.into_inner(), summary.input_bytes, "progress counts every input byte");
    Ok(summary)
}

fn bpe_tokenizer(dir: &Path) -> Tokenizer {
    model_dir(dir, &byte_level_bpe(), None);
    Tokenizer::load(dir.to_str().unwrap()).unwrap()
}

fn tokens(path: &Path) -> Vec<u32> {
    read_shard(path, usize::MAX).unwrap().to_u32()
}

/// A text file and `.jsonl` documents become one shard: each document preceded by the
/// end-of-text token, blank lines skipped, the index at each document's start, no loss mask.
#[test]
fn documents_are_written_in_order_with_end_of_text_between_them() {
    let dir = scratch("corpus-docs");
    let tokenizer = bpe_tokenizer(&dir.join("model"));
    let (text, jsonl) = (dir.join("a.txt"), dir.join("b.jsonl"));
    std::fs::write(&text, "hello world").unwrap();
    std::fs::write(&jsonl, "{\"text\": \"hello\"}\n\n{\"text\": \"world hello\"}\n").unwrap();
    let out = dir.join("out");
    let summary = run(&tokenizer, &[text, jsonl], &options(&out, 1000)).unwrap();

    let eot = special_id("<|endoftext|>");
    let encode = |t: &str| tokenizer.encode(t).unwrap();
    let expected = [
        vec![eot],
        encode("hello world"),
        vec![eot],
        encode("hello"),
        vec![eot],
        encode("world hello"),
    ]
    .concat();
    assert_eq!(summary.shards, [out.join("tokens_000000.bin")]);
    assert_eq!(tokens(&summary.shards[0]), expected);
    assert!(matches!(read_shard(&summary.shards[0], 272).unwrap(), ShardTokens::U16(_)));
    let starts = [0, 3, 5, expected.len() as u64];
    assert_eq!(read_document_index(&out.join("tokens_000000.idx")).unwrap(), starts);
    assert!(!out.join("tokens_000000.mask").exists());
    assert_eq!(
        (summary.documents, summary.tokens, summary.bad_lines),
        (3, expected.len() as u64, 0)
    );
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["shards"][0]["document_count"], 3);
    assert_eq!(manifest["token_width"], "u16");

    // The directory now holds shards: a second run there is refused.
    let error = run(&tokenizer, &[dir.join("a.txt")], &options(&out, 1000)).unwrap_err();
    assert!(matches!(error, TokenizeError::Output { .. }), "{error}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A shard is closed before a document that would take it past `shard_tokens`; a longer
/// document gets a shard of its own; documents are never split.
#[test]
fn shards_end_at_document_boundaries() {
    let dir = scratch("corpus-sizes");
    let tokenizer = bpe_tokenizer(&dir.join("model"));
    let jsonl = dir.join("docs.jsonl");
    // Documents of 3, 2, 2 and 9 tokens with their end-of-text token.
    let lines = ["hello world", "hello", "hello", "abcdefgh"];
    let text: String = lines.iter().map(|t| format!("{}\n", json!({"text": t}))).collect();
    std::fs::write(&jsonl, text).unwrap();
    let out = dir.join("out");
    let summary = run(&tokenizer, &[jsonl], &options(&out, 5)).unwrap();
    let lengths: Vec<usize> = summary.shards.iter().map(|s| tokens(s).len()).collect();
    assert_eq!(lengths, [5, 2, 9]);
    for (i, shard) in summary.shards.iter().enumerate() {
        let index = read_document_index(&shard.with_extension("idx")).unwrap();
        let eot = special_id("<|endoftext|>");
        let shard_tokens = tokens(shard);
        assert!(
            index[..index.len() - 1].iter().all(|&s| shard_tokens[s as usize] == eot),
            "shard {i}"
        );
        assert_eq!(*index.last().unwrap(), shard_tokens.len() as u64);
    }
    assert_eq!(summary.documents, 4);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A chat `.jsonl` writes a loss mask beside the shard: 0 on the end-of-text tokens and on all
/// but the assistant's tokens of a conversation, 1 on a text document's tokens.
#[test]
fn conversations_write_a_loss_mask_on_the_assistant_tokens() {
    let dir = scratch("corpus-chat");
    let config = json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>",
                        "chat_template": LLAMA3_TEMPLATE});
    model_dir(&dir.join("model"), &byte_level_bpe(), Some(&config));
    let tokenizer = Tokenizer::load(dir.join("model").to_str().unwrap()).unwrap();
    let template = ChatTemplate::from_config(tokenizer.config()).unwrap().unwrap();
    let jsonl = dir.join("chat.jsonl");
    let lines = [json!({"messages": three_turns()}), json!({"text": "hello"})];
    std::fs::write(&jsonl, lines.map(|l| l.to_string() + "\n").concat()).unwrap();
    let out = dir.join("out");
    let options = TokenizeOptions { chat_template: Some(&template), ..options(&out, 1 << 20) };
    let summary = run(&tokenizer, &[jsonl], &options).unwrap();

    let shard_tokens = tokens(&summary.shards[0]);
    let mask = read_loss_mask(&out.join("tokens_000000.mask")).unwrap();
    let (conversation, conversation_mask) =
        one(template.encode(&tokenizer, &three_turns()).unwrap());
    let eot = tokenizer.eot().unwrap();
    let hello = tokenizer.encode("hello").unwrap();
    assert_eq!(shard_tokens, [vec![eot], conversation.clone(), vec![eot], hello.clone()].concat());
    assert_eq!(mask, [vec![0], conversation_mask.clone(), vec![0], vec![1; hello.len()]].concat());
    let assistant: u64 = conversation_mask.iter().map(|&m| u64::from(m)).sum();
    assert!(assistant > 0 && (assistant as usize) < conversation.len());
    assert_eq!((summary.conversations, summary.assistant_tokens), (1, assistant));
    std::fs::remove_dir_all(dir).unwrap();
}

/// The tokenizer of a model directory under `dir`: the byte-level BPE, `<|endoftext|>` its end of
/// text, the Llama-3-style template with generation markers.
fn llama3_chat_model(dir: &Path) -> Tokenizer {
    let config = json!({"eos_token": "<|endoftext|>", "chat_template": LLAMA3_TEMPLATE});
    model_dir(&dir.join("model"), &byte_level_bpe(), Some(&config));
    Tokenizer::load(dir.join("model").to_str().unwrap()).unwrap()
}

/// ShareGPT's `conversations` (`from`: human, gpt, system) is the conversation of the same
/// `messages`: the same tokens and mask; a `from` of another kind is a bad line naming it.
#[test]
fn sharegpt_conversations_are_messages() {
    let dir = scratch("corpus-sharegpt");
    let tokenizer = llama3_chat_model(&dir);
    let template = ChatTemplate::from_config(tokenizer.config()).unwrap().unwrap();
    let messages =
        [&[json!({"role": "system", "content": "be brief"})][..], &three_turns()].concat();
    let from = |role: &str| {
        match role {
            "user" => "human",
            "assistant" => "gpt",
            other => other,
        }
        .to_string()
    };
    let sharegpt: Vec<_> = messages
        .iter()
        .map(|m| json!({"from": from(m["role"].as_str().unwrap()), "value": m["content"]}))
        .collect();
    let lines = [json!({"messages": messages}), json!({"conversations": sharegpt})];
    let written = |name: &str, lines: &[serde_json::Value]| {
        let jsonl = dir.join(format!("{name}.jsonl"));
        std::fs::write(&jsonl, lines.iter().map(|l| l.to_string() + "\n").collect::<String>())
            .unwrap();
        let out = dir.join(name);
        let options = TokenizeOptions { chat_template: Some(&template), ..options(&out, 1 << 20) };
        run(&tokenizer, &[jsonl], &options)
    };
    let both = written("both", &lines).unwrap();
    let shard = tokens(&both.shards[0]);
    let (eot, half) = (tokenizer.eot().unwrap(), shard.len() / 2);
    assert_eq!(shard[0], eot);
    assert_eq!(shard[..half], shard[half..], "the two conversations are the same tokens");
    let mask = read_loss_mask(&dir.join("both/tokens_000000.mask")).unwrap();
    assert_eq!(mask[..half], mask[half..]);
    assert!(mask.contains(&1), "{mask:?}");
    let tool = json!({"conversations": [{"from": "function_call", "value": "{}"}]});
    let error = written("tool", &[tool]).unwrap_err();
    assert!(error.to_string().contains("\"function_call\""), "{error}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A prompt-completion pair trains on the completion only, as TRL's `SFTTrainer` does: strings
/// are the ids of prompt + completion and the end-of-text token, masked for as many ids as the
/// prompt alone has; lists of messages are the conversation through the chat template, trained on
/// the completion's assistant turns only (not the prompt's few-shot answer).
#[test]
fn prompt_completion_pairs_train_on_the_completion() {
    let dir = scratch("corpus-prompt-completion");
    let tokenizer = llama3_chat_model(&dir);
    let turn = |role: &str, content: &str| json!({"role": role, "content": content});
    let prompt = [turn("user", "hello"), turn("assistant", "world"), turn("user", "hello?")];
    let completion = [turn("assistant", "hello world")];
    let lines = [
        json!({"prompt": "hello wor", "completion": "ld hello"}),
        json!({"prompt": prompt, "completion": completion}),
    ];
    let jsonl = dir.join("pairs.jsonl");
    std::fs::write(&jsonl, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
    let eot = tokenizer.eot().unwrap();
    let whole = tokenizer.encode("hello world hello").unwrap();
    let before = tokenizer.encode("hello wor").unwrap().len();
    let pair = [whole.clone(), vec![eot]].concat();
    // The template with generation markers, and without (prefix rendering).
    for (name, source) in
        [("marked", LLAMA3_TEMPLATE.to_string()), ("plain", without_markers(LLAMA3_TEMPLATE))]
    {
        let template = ChatTemplate::new(&source, name).unwrap();
        let out = dir.join(name);
        let options = TokenizeOptions { chat_template: Some(&template), ..options(&out, 1 << 20) };
        let summary = run(&tokenizer, std::slice::from_ref(&jsonl), &options).unwrap();
        let (shard, mask) =
            (tokens(&summary.shards[0]), read_loss_mask(&out.join("tokens_000000.mask")).unwrap());
        assert_eq!(shard[..1 + pair.len()], [vec![eot], pair.clone()].concat());
        let pair_mask = [vec![0; 1 + before], vec![1; pair.len() - before]].concat();
        assert_eq!(mask[..1 + pair.len()], pair_mask, "{name}");
        // The conversation: the same tokens as `messages`, trained on its last answer alone.
        let rest = 1 + pair.len();
        let messages = [&prompt[..], &completion[..]].concat();
        let (ids, _) = one(template.encode(&tokenizer, &messages).unwrap());
        assert_eq!(shard[rest + 1..], ids, "{name}");
        let trained: Vec<u32> =
            ids.iter().zip(&mask[rest + 1..]).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
        assert_eq!(tokenizer.decode(&trained).unwrap(), "hello world<|eot_id|>", "{name}");
        assert_eq!(summary.conversations, 2);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A bad line stops the run with its file and line number; with `skip_bad_lines` the run goes
/// on and counts it. A conversation without a chat template is a bad line too.
#[test]
fn a_bad_line_names_its_file_and_line_unless_skipped() {
    let dir = scratch("corpus-bad");
    let tokenizer = bpe_tokenizer(&dir.join("model"));
    let jsonl = dir.join("mixed.jsonl");
    let lines = [
        "{\"text\": \"hello\"}",
        "not json",
        "{\"foo\": 1}",
        "{\"text\": 5}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}",
        "{\"text\": \"world\"}",
    ];
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    let error =
        run(&tokenizer, std::slice::from_ref(&jsonl), &options(&dir.join("out"), 100)).unwrap_err();
    let TokenizeError::BadLine { path, line, message } = &error else { panic!("{error}") };
    assert_eq!((path, *line), (&jsonl, 2), "{message}");
    assert!(error.to_string().starts_with(&format!("{}:2: not JSON", jsonl.display())), "{error}");
    assert!(error.to_string().ends_with("(--skip-bad-lines skips such lines)"), "{error}");

    // An Alpaca file: the error says what it is and how to convert it; a first line that is bad
    // says nothing of skipping it (the whole file is likely of the same format).
    let alpaca = dir.join("alpaca.jsonl");
    let record = json!({"instruction": "Name a colour.", "input": "", "output": "Blue."});
    std::fs::write(&alpaca, format!("{record}\n{record}\n")).unwrap();
    let error = run(&tokenizer, std::slice::from_ref(&alpaca), &options(&dir.join("alpaca"), 100))
        .unwrap_err();
    let said = error.to_string();
    assert!(said.starts_with(&format!("{}:1: an Alpaca record", alpaca.display())), "{said}");
    assert!(said.contains("jq -c '{messages: [{role: \"user\"") && said.ends_with("OUT.jsonl`"));

    let skip = TokenizeOptions { skip_bad_lines: true, ..options(&dir.join("skipped"), 100) };
    let summary = run(&tokenizer, std::slice::from_ref(&jsonl), &skip).unwrap();
    assert_eq!((summary.documents, summary.bad_lines), (2, 4));

    // The conversation's message, alone.
    std::fs::write(&jsonl, format!("{}\n{}\n", lines[0], lines[4])).unwrap();
    let error = run(&tokenizer, std::slice::from_ref(&jsonl), &options(&dir.join("chat"), 100))
        .unwrap_err();
    assert!(
        matches!(&error, TokenizeError::BadLine { line: 2, message, .. } if message.contains("--chat-template"))
    );

    let latin1 = dir.join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9").unwrap();
    let error = run(&tokenizer, std::slice::from_ref(&latin1), &options(&dir.join("latin"), 100))
        .unwrap_err();
    assert_eq!(
        error,
        TokenizeError::Input {
            path: latin1,
            message: "not UTF-8 (invalid bytes at offset 3)".into()
        }
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// What `zeroflow tokenize` prints: the tokenizer's vocabulary, end-of-text token and shard width
/// before, the counts after, and the skipped lines only where there were some.
#[test]
fn the_setup_and_the_summary_describe_themselves() {
    assert_eq!(
        describe_setup(&Tokenizer::bytes(), None),
        "tokenizer bytes (vocabulary 256, no end-of-text token): u16 shards"
    );
    let mut summary = TokenizeSummary {
        documents: 3,
        conversations: 1,
        tokens: 40,
        assistant_tokens: 7,
        shards: vec![PathBuf::from("a"), PathBuf::from("b")],
        ..TokenizeSummary::default()
    };
    let out = Path::new("out");
    let line =
        "wrote 3 documents (1 conversation, 7 assistant tokens), 40 tokens in 2 shards to out";
    assert_eq!(summary.describe(out), line);
    summary.bad_lines = 5;
    assert_eq!(summary.describe(out), format!("{line}\nskipped 5 bad lines"));
    // One of each is said in the singular.
    let one = TokenizeSummary {
        documents: 1,
        conversations: 0,
        tokens: 1,
        assistant_tokens: 1,
        bad_lines: 1,
        shards: vec![PathBuf::from("a")],
        ..TokenizeSummary::default()
    };
    let said = "wrote 1 document (0 conversations, 1 assistant token), 1 token in 1 shard to out\n\
                skipped 1 bad line";
    assert_eq!(one.describe(out), said);
    // What was held out for evaluation, and that nothing was.
    summary.bad_lines = 0;
    let held = TokenizeSummary {
        documents: 1,
        conversations: 1,
        tokens: 9,
        assistant_tokens: 2,
        shards: vec![PathBuf::from("out/held-out/tokens_000000.bin")],
        ..TokenizeSummary::default()
    };
    summary.held_out = Some(Box::new(held));
    let held_line = "held out for evaluation, spread over the input and never trained on: 1 \
                     document (1 conversation, 2 assistant tokens), 9 tokens in out/held-out";
    assert_eq!(summary.describe(out), format!("{line}\n{held_line}"));
    summary.held_out = Some(Box::default());
    let none = "held out for evaluation: no document (each is longer than its share of the \
                tokens to hold out; a run holds out the end of the data instead)";
    assert_eq!(summary.describe(out), format!("{line}\n{none}"));
}

/// A vocabulary past 65536 ids gives llm.c's u32 shards, which read back.
#[test]
fn a_large_vocabulary_writes_u32_shards() {
    let dir = scratch("corpus-u32");
    model_dir(&dir.join("model"), &word_level_big(), None);
    let tokenizer = Tokenizer::load(dir.join("model").to_str().unwrap()).unwrap();
    let text = dir.join("t.txt");
    std::fs::write(&text, "hello big world").unwrap();
    let summary = run(&tokenizer, &[text], &options(&dir.join("out"), 100)).unwrap();
    let bytes = std::fs::read(&summary.shards[0]).unwrap();
    assert_eq!(i32::from_le_bytes(bytes[..4].try_into().unwrap()), SHARD_MAGIC_U32);
    let read = read_shard(&summary.shards[0], tokenizer.vocab_size()).unwrap();
    assert_eq!(read, ShardTokens::U32(vec![70000, 1, 69999, 2]));
    std::fs::remove_dir_all(dir).unwrap();
}

/// The bytes tokenizer has no end-of-text token: documents follow each other directly and the
/// index alone says where each starts; any other tokenizer without one is refused.
#[test]
fn without_an_end_of_text_token_only_bytes_may_tokenize() {
    let dir = scratch("corpus-no-eot");
    let jsonl = dir.join("d.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"ab\"}\n{\"text\": \"c\"}\n").unwrap();
    let summary =
        run(&Tokenizer::bytes(), std::slice::from_ref(&jsonl), &options(&dir.join("b"), 100))
            .unwrap();
    assert_eq!(tokens(&summary.shards[0]), [97, 98, 99]);
    assert_eq!(read_document_index(&summary.shards[0].with_extension("idx")).unwrap(), [0, 2, 3]);
    // Bytes take any file, UTF-8 or not.
    let latin1 = dir.join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9").unwrap();
    let summary = run(&Tokenizer::bytes(), &[latin1], &options(&dir.join("l"), 100)).unwrap();
    assert_eq!(tokens(&summary.shards[0]), [99, 97, 102, 0xe9]);

    let mut json = word_level_big();
    json["added_tokens"] = json!([]);
    json["model"]["vocab"].as_object_mut().unwrap().remove("</s>");
    model_dir(&dir.join("model"), &json, None);
    let tokenizer = Tokenizer::load(dir.join("model").to_str().unwrap()).unwrap();
    assert_eq!(tokenizer.eot(), None);
    let error = run(&tokenizer, &[jsonl], &options(&dir.join("w"), 100)).unwrap_err();
    assert!(matches!(error, TokenizeError::NoEndOfText(_)), "{error}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `got == want`, or where they first differ (the lists are long).
fn assert_same(got: &[u32], want: &[u32], what: &str) {
    if let Some(at) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
        let near = |list: &[u32]| list[at.saturating_sub(4)..(at + 4).min(list.len())].to_vec();
        panic!("{what}: token {at} differs: {:?} against {:?}", near(got), near(want));
    }
}

/// Options whose text files are encoded in pieces of `piece` bytes.
fn in_pieces(out_dir: &Path, shard_tokens: usize, piece: usize) -> TokenizeOptions<'static> {
    TokenizeOptions { text_piece_bytes: piece, ..options(out_dir, shard_tokens) }
}

/// A text file read and encoded in pieces that end at line breaks is still one document: one
/// end-of-text token before it, one index entry, and, for lines that end without spaces before
/// the break (where the byte-level pre-tokenizer splits the same either way), the very tokens of
/// the file encoded whole, in every number of pieces.
#[test]
fn a_text_file_in_pieces_is_the_file_encoded_whole() {
    let lines: String = (0..400).map(|i| format!("line {i} of the file: hello world\n")).collect();
    // From 7 bytes on, a piece ends with a line (of at most 34 bytes, within five pieces).
    for piece in [7, 64, 1000, lines.len() - 1, lines.len(), 1 << 20] {
        check_in_pieces("lines", &lines, piece);
    }
    // Paragraphs, blank lines, punctuation before a break and lines ending in spaces: the cut
    // falls at a break between two characters that are not white space.
    let paragraphs: String = (0..100)
        .map(|i| format!("Paragraph {i} ends here.\n\nIt goes on,  \n\tindented;\nlast line!\n"))
        .collect();
    // (A clean break is looked for within a second piece's length: these paragraphs have one
    // every 63 bytes.)
    for piece in [64, 200, 1000] {
        check_in_pieces("paragraphs", &paragraphs, piece);
        check_in_pieces("paragraphs-llama3", &paragraphs, piece);
    }
}

/// A sentencepiece-style tokenizer marks the start of a text with `"▁"` (Llama-2's `Prepend`
/// normalizer, Mistral's `Metaspace` pre-tokenizer): the pieces after the first are encoded
/// without it, and give the tokens of the text encoded whole, cut at a line break or, in a long
/// line, before a space.
#[test]
fn sentencepiece_pieces_are_the_file_encoded_whole() {
    let lines: String =
        (0..200).map(|i| format!("line {i} of the file: hello world, linger\n")).collect();
    let one_line = lines.replace('\n', " ");
    for name in ["lines-llama2", "lines-mistral"] {
        for piece in [16, 100, 1000] {
            check_in_pieces(name, &lines, piece);
            check_in_pieces(&name.replace("lines", "one-line"), &one_line, piece);
        }
    }
}

/// `text` as a file tokenized in pieces of `piece` bytes, and read as `eval` reads it: the tokens
/// of the text encoded whole, one document.
fn check_in_pieces(name: &str, text: &str, piece: usize) {
    let dir = scratch(&format!("corpus-text-pieces-{name}-{piece}"));
    // GPT-2's split (the byte-level pre-tokenizer's own), Llama-3's, or sentencepiece's.
    let tokenizer_json = match name.rsplit('-').next() {
        Some("llama3") => Some(llama3_split_bpe()),
        Some("llama2") => Some(sentencepiece_bpe(Sentencepiece::Llama2)),
        Some("mistral") => Some(sentencepiece_bpe(Sentencepiece::Mistral)),
        _ => None,
    };
    let tokenizer = match tokenizer_json {
        Some(json) => {
            let config = json!({"eos_token": "</s>"});
            let with_config = name.ends_with("llama2") || name.ends_with("mistral");
            model_dir(&dir.join("model"), &json, with_config.then_some(&config));
            Tokenizer::load(dir.join("model").to_str().unwrap()).unwrap()
        }
        None => bpe_tokenizer(&dir.join("model")),
    };
    let path = dir.join("a.txt");
    std::fs::write(&path, text).unwrap();
    let eot = tokenizer.eot().expect("an end-of-text token");
    let whole = [vec![eot], tokenizer.encode(text).unwrap()].concat();
    let out = dir.join("out");
    let inputs = std::slice::from_ref(&path);
    let summary = run(&tokenizer, inputs, &in_pieces(&out, 1 << 20, piece)).unwrap();
    let what = format!("{name} in pieces of {piece} bytes");
    assert_same(&tokens(&summary.shards[0]), &whole, &what);
    assert_eq!((summary.documents, summary.tokens), (1, whole.len() as u64), "{what}");
    let starts = read_document_index(&out.join("tokens_000000.idx")).unwrap();
    assert_eq!(starts, [0, whole.len() as u64], "{what}");
    // What `eval` reads the file as: the same tokens, without the end-of-text token.
    let read = encode_text_file(&tokenizer, &path, piece).unwrap();
    assert_same(&read, &whole[1..], &format!("encode_text_file, {what}"));
}

/// A `.jsonl` document longer than a piece is encoded in the pieces a text file of it would be:
/// the same tokens as that file's, long lines and multi-byte characters included, and every
/// byte there once.
#[test]
fn a_long_jsonl_document_is_encoded_as_a_text_file_of_it() {
    let dir = scratch("corpus-jsonl-pieces");
    let tokenizer = bpe_tokenizer(&dir.join("model"));
    let lines: String = (0..200).map(|i| format!("line {i}: hello world\n")).collect();
    let text = lines + &"héllo wörld ∑ 😀 ".repeat(40);
    let (txt, jsonl) = (dir.join("doc.txt"), dir.join("doc.jsonl"));
    std::fs::write(&txt, &text).unwrap();
    std::fs::write(&jsonl, json!({ "text": text }).to_string() + "\n").unwrap();
    for piece in [16, 64, 1 << 20] {
        let written = |input: &Path, name: &str| {
            let out = dir.join(format!("{name}-{piece}"));
            let inputs = [input.to_path_buf()];
            let summary = run(&tokenizer, &inputs, &in_pieces(&out, 1 << 20, piece)).unwrap();
            tokens(&summary.shards[0])
        };
        let (from_file, from_line) = (written(&txt, "txt"), written(&jsonl, "jsonl"));
        assert_same(&from_line, &from_file, &format!("pieces of {piece} bytes"));
        assert_eq!(tokenizer.decode(&from_line[1..]).unwrap(), text);
    }
}

/// A line longer than four pieces is cut before a space (the tokens of the line encoded whole, for
/// a byte-level split), or, without one, at a character boundary: multi-byte characters are never
/// split (the pieces are UTF-8), and every byte is there once (the byte-level tokens decode to the
/// file). A file that is not UTF-8 is refused with the offset of its first bad byte in the
/// file, not in a piece.
#[test]
fn a_long_line_is_cut_between_characters_and_bad_bytes_are_found_in_the_file() {
    let dir = scratch("corpus-long-line");
    let tokenizer = bpe_tokenizer(&dir.join("model"));
    let text = "héllo wörld ∑ 😀 ".repeat(300);
    let path = dir.join("long.txt");
    std::fs::write(&path, &text).unwrap();
    for piece in [5, 16, 61] {
        let out = dir.join(format!("out-{piece}"));
        let inputs = std::slice::from_ref(&path);
        let summary = run(&tokenizer, inputs, &in_pieces(&out, 1 << 20, piece)).unwrap();
        let written = tokens(&summary.shards[0]);
        assert_eq!(written[0], special_id("<|endoftext|>"));
        assert_eq!(tokenizer.decode(&written[1..]).unwrap(), text, "pieces of {piece} bytes");
        // Cut before a space, where a byte-level split cuts too: the tokens of the whole line.
        let whole = tokenizer.encode(&text).unwrap();
        assert_same(&written[1..], &whole, &format!("pieces of {piece} bytes"));
    }
    // A line without a space is cut between characters.
    let unbroken = "héllowörld∑😀".repeat(300);
    std::fs::write(&path, &unbroken).unwrap();
    let out = dir.join("unbroken");
    let inputs = std::slice::from_ref(&path);
    let summary = run(&tokenizer, inputs, &in_pieces(&out, 1 << 20, 16)).unwrap();
    let written = tokens(&summary.shards[0]);
    assert_eq!(tokenizer.decode(&written[1..]).unwrap(), unbroken);
    let mut bad = b"good line\n".repeat(100);
    bad[1000 - 3] = 0xFF;
    let bad_path = dir.join("bad.txt");
    std::fs::write(&bad_path, &bad).unwrap();
    let error = run(&tokenizer, &[bad_path], &in_pieces(&dir.join("bad"), 1 << 20, 64));
    let error = error.expect_err("not UTF-8").to_string();
    assert!(error.contains("invalid bytes at offset 997"), "{error}");
}

/// A text file of more tokens than a shard holds goes on into the next shards, each of which
/// starts it anew in its index; the shards together hold the file encoded whole.
#[test]
fn a_text_file_longer_than_a_shard_goes_on_in_the_next() {
    let dir = scratch("corpus-text-shards");
    let tokenizer = bpe_tokenizer(&dir.join("model"));
    let text: String = (0..60).map(|i| format!("line {i}: hello world\n")).collect();
    let (path, short) = (dir.join("a.txt"), dir.join("b.txt"));
    std::fs::write(&path, &text).unwrap();
    std::fs::write(&short, "hello\n").unwrap();
    let eot = special_id("<|endoftext|>");
    let whole = [vec![eot], tokenizer.encode(&text).unwrap()].concat();
    let out = dir.join("out");
    let summary = run(&tokenizer, &[path, short], &in_pieces(&out, 100, 40)).unwrap();
    assert!(summary.shards.len() >= 3, "{:?}", summary.shards);
    let all: Vec<u32> = summary.shards.iter().flat_map(|shard| tokens(shard)).collect();
    let second = [vec![eot], tokenizer.encode("hello\n").unwrap()].concat();
    assert_eq!(all, [whole.clone(), second].concat());
    assert_eq!(summary.documents, 2);
    for (k, shard) in summary.shards.iter().enumerate() {
        let starts = read_document_index(&shard.with_extension("idx")).unwrap();
        assert_eq!(starts[0], 0, "shard {k}");
        assert!(tokens(shard).len() <= 100, "shard {k}");
    }
}

/// The documents of `summary`'s shards, each with its end-of-text token, in order.
fn documents_of(shards: &[PathBuf]) -> Vec<Vec<u32>> {
    let mut documents = Vec::new();
    for shard in shards {
        let (tokens, starts) = (tokens(shard), read_document_index(&shard.with_extension("idx")));
        let starts = starts.unwrap();
        documents.extend(starts.windows(2).map(|w| tokens[w[0] as usize..w[1] as usize].to_vec()));
    }
    documents
}

/// Documents held out for evaluation are spread over the input (every part of a sorted corpus
/// gives some), each whole on one side: the two sides are the corpus's documents, each once, in
/// order. About the tokens asked for are held out, at most a tenth. Text files read in one piece
/// are held out whole; a longer one, one document, is not held out of.
#[test]
fn documents_held_out_are_spread_over_the_input_and_never_in_the_training_shards() {
    let dir = scratch("corpus-hold-out");
    let tokenizer = bpe_tokenizer(&dir.join("model"));
    // Four topics, one after the other (as a mix of datasets concatenated is), records of
    // different lengths.
    let topics = ["hello", "world", "abcdefgh", "hello world"];
    let (a, b) = (dir.join("a.jsonl"), dir.join("b.jsonl"));
    let record = |t: usize, i: usize| json!({"text": topics[t].repeat(1 + i % 5)}).to_string();
    let lines = |range: std::ops::Range<usize>| -> String {
        range.flat_map(|t| (0..50).map(move |i| record(t, i) + "\n")).collect()
    };
    std::fs::write(&a, lines(0..2)).unwrap();
    std::fs::write(&b, lines(2..4)).unwrap();
    let inputs = [a, b];
    let whole = run(&tokenizer, &inputs, &options(&dir.join("whole"), 1000)).unwrap();
    let all = documents_of(&whole.shards);
    assert_eq!(all.len(), 200);
    let longest = all.iter().map(Vec::len).max().unwrap() as u64;

    for (name, wanted) in [("capped", 1 << 20), ("asked", 60)] {
        let (train_dir, held_dir) = (dir.join(name).join("train"), dir.join(name).join("held"));
        let hold_out = zeroflow_data::HoldOut { out_dir: held_dir.clone(), tokens: wanted };
        let options = TokenizeOptions { hold_out: Some(hold_out), ..options(&train_dir, 1000) };
        let summary = run(&tokenizer, &inputs, &options).unwrap();
        let held = summary.held_out.as_deref().expect("a held-out summary");
        assert!(held.shards.iter().all(|s| s.starts_with(&held_dir)), "{:?}", held.shards);
        let (train, held_docs) = (documents_of(&summary.shards), documents_of(&held.shards));
        assert_eq!(train.len() as u64 + held.documents, 200, "{name}");
        assert_eq!(summary.tokens + held.tokens, whole.tokens, "{name}");
        assert_eq!(summary.input_bytes, whole.input_bytes, "{name}: every input byte counted");
        // Each document on exactly one side, both sides in the corpus's order.
        let (mut t, mut h) = (train.iter().peekable(), held_docs.iter().peekable());
        let mut held_at = Vec::new();
        for (k, document) in all.iter().enumerate() {
            if t.peek() == Some(&document) {
                t.next();
            } else {
                assert_eq!(h.next(), Some(document), "{name}: document {k} on neither side");
                held_at.push(k);
            }
        }
        assert!(t.next().is_none() && h.next().is_none(), "{name}");
        let goal = (wanted as f64).min(whole.tokens as f64 / 10.0);
        let off = (held.tokens as f64 - goal).abs();
        assert!(off <= longest as f64, "{name}: {} tokens held out for {goal:.0}", held.tokens);
        if name == "capped" {
            for topic in 0..4 {
                let of_topic = held_at.iter().filter(|&&k| k / 50 == topic).count();
                assert!(of_topic >= 3, "{name}: {of_topic} documents of topic {topic} held out");
            }
        }
    }

    // Text files read in one piece are documents too: whole files are held out, spread over
    // them. A longer text file, read in pieces, is one document: nothing is held out of it.
    let files: Vec<PathBuf> = (0..40)
        .map(|i| {
            let path = dir.join(format!("text-{i:02}.txt"));
            std::fs::write(&path, format!("{} {i}\n", topics[i / 10]).repeat(3)).unwrap();
            path
        })
        .collect();
    let text_options = |name: &str, piece: usize| {
        let hold_out =
            zeroflow_data::HoldOut { out_dir: dir.join(name).join("held"), tokens: 1 << 20 };
        let options = in_pieces(&dir.join(name).join("train"), 1000, piece);
        TokenizeOptions { hold_out: Some(hold_out), ..options }
    };
    let summary = run(&tokenizer, &files, &text_options("texts", 1 << 20)).unwrap();
    let held = summary.held_out.as_deref().unwrap();
    assert_eq!(summary.documents + held.documents, 40);
    let held_docs = documents_of(&held.shards);
    let eot = special_id("<|endoftext|>");
    let whole_files: Vec<Vec<u32>> = files
        .iter()
        .map(|f| {
            [vec![eot], tokenizer.encode(&std::fs::read_to_string(f).unwrap()).unwrap()].concat()
        })
        .collect();
    let held_files: Vec<usize> =
        held_docs.iter().map(|d| whole_files.iter().position(|f| f == d).unwrap()).collect();
    assert!(held_files.len() >= 3, "{held_files:?}");
    assert!(held_files[0] < 10 && held_files[held_files.len() - 1] >= 30, "{held_files:?}");
    let long = dir.join("long.txt");
    std::fs::write(&long, "hello world\n".repeat(200)).unwrap();
    let summary = run(&tokenizer, &[long], &text_options("long", 100)).unwrap();
    assert_eq!((summary.documents, summary.held_out.unwrap().documents), (1, 0));
    std::fs::remove_dir_all(dir).unwrap();
}
