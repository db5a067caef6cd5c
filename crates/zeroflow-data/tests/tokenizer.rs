//! The `Tokenizer` type: loading from a file, a directory, `gpt2` and `bytes`; vocabulary size and
//! end-of-text token; errors naming the file.

use serde_json::json;
use zeroflow_data::{GPT2_EOT, GPT2_VOCAB, Tokenizer, TokenizerErrorKind};

use crate::fixtures::{byte_level_bpe, model_dir, scratch, special_id, word_level_big};

/// A directory's tokenizer.json applies its merges ("hello" and " world" are single tokens), its
/// vocabulary size counts the added tokens (one more than the largest id), and the end-of-text
/// token is the config's eos_token, given as an AddedToken object.
#[test]
fn a_model_directory_gives_ids_vocabulary_and_end_of_text() {
    let dir = scratch("tok-dir");
    let config = json!({"eos_token": {"content": "<|eot_id|>", "special": true}});
    model_dir(&dir, &byte_level_bpe(), Some(&config));
    let tokenizer = Tokenizer::load(dir.to_str().unwrap()).unwrap();
    assert_eq!(tokenizer.vocab_size(), 272);
    assert_eq!(tokenizer.eot(), Some(special_id("<|eot_id|>")));
    assert_eq!(tokenizer.encode("hello world").unwrap(), [259, 264]);
    // Bytes without merges are their own ids; added tokens in the text are recognised.
    assert_eq!(tokenizer.encode("hi<|im_end|>").unwrap(), [104, 105, special_id("<|im_end|>")]);
    let text = "naïve café ✓ 123\n\n  x";
    assert_eq!(tokenizer.decode(&tokenizer.encode(text).unwrap()).unwrap(), text);

    // Offsets are byte ranges of the text; "Ġworld" covers " world" less its space (the
    // ByteLevel post-processor trims offsets), as in Python.
    let tokens = tokenizer.encode_with_offsets("hello world").unwrap();
    assert_eq!(tokens.ids, [259, 264]);
    assert_eq!(tokens.offsets, [(0, 5), (6, 11)]);
    assert_eq!(
        (tokens.token_at(0), tokens.token_at(5), tokens.token_at(10)),
        (Some(0), None, Some(1))
    );

    // A tokenizer.json alone: no config, so the end-of-text token is the first known name.
    let file = Tokenizer::load(dir.join("tokenizer.json").to_str().unwrap()).unwrap();
    assert_eq!(file.eot(), Some(special_id("<|endoftext|>")));
    assert!(file.config().chat_template.is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn gpt2_and_bytes_are_built_in() {
    let gpt2 = Tokenizer::load("gpt2").unwrap();
    assert_eq!((gpt2.vocab_size(), gpt2.eot()), (GPT2_VOCAB, Some(GPT2_EOT)));
    assert_eq!(gpt2.encode("Hello world").unwrap(), [15496, 995]);
    // In a rendered chat, <|endoftext|> is the special token.
    let chat = gpt2.encode_with_offsets("Hi<|endoftext|>").unwrap();
    assert_eq!(chat.ids, [17250, GPT2_EOT]);
    assert_eq!(chat.offsets, [(0, 2), (2, 15)]);

    let bytes = Tokenizer::load("bytes").unwrap();
    assert_eq!((bytes.vocab_size(), bytes.eot()), (256, None));
    assert_eq!(bytes.encode("hé").unwrap(), [104, 0xc3, 0xa9]);
}

#[test]
fn a_vocabulary_past_u16_is_counted_to_its_largest_id() {
    let dir = scratch("tok-big");
    model_dir(&dir, &word_level_big(), None);
    let tokenizer = Tokenizer::load(dir.to_str().unwrap()).unwrap();
    assert_eq!(tokenizer.vocab_size(), 70001);
    assert_eq!(tokenizer.eot(), Some(70000));
    assert_eq!(tokenizer.encode("hello big unknown").unwrap(), [1, 69999, 0]);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A directory without tokenizer.json, a file that is not one, and an eos_token that the
/// vocabulary lacks are typed errors naming the file at fault.
#[test]
fn tokenizer_errors_name_the_file() {
    let dir = scratch("tok-errors");
    let error = Tokenizer::load(dir.to_str().unwrap()).unwrap_err();
    assert_eq!(
        (error.path.as_path(), &error.kind),
        (dir.as_path(), &TokenizerErrorKind::NoTokenizerJson)
    );

    let broken = dir.join("broken.json");
    std::fs::write(&broken, r#"{"model": {"type": "BPE""#).unwrap();
    let error = Tokenizer::load(broken.to_str().unwrap()).unwrap_err();
    assert!(matches!(error.kind, TokenizerErrorKind::Load(_)), "{error}");
    assert!(error.to_string().starts_with(&broken.display().to_string()), "{error}");

    let missing = dir.join("missing.json");
    let error = Tokenizer::load(missing.to_str().unwrap()).unwrap_err();
    assert_eq!((error.path, error.kind), (missing, TokenizerErrorKind::NotFound));
    let error = Tokenizer::load("gtp2").unwrap_err();
    assert!(error.to_string().starts_with("gtp2: no such file"), "{error}");

    let model = dir.join("model");
    model_dir(&model, &byte_level_bpe(), Some(&json!({"eos_token": "<nope>"})));
    let error = Tokenizer::load(model.to_str().unwrap()).unwrap_err();
    assert_eq!(error.path, model.join("tokenizer_config.json"));
    let expected =
        TokenizerErrorKind::UnknownToken { field: "eos_token".into(), token: "<nope>".into() };
    assert_eq!(error.kind, expected);

    model_dir(&model, &byte_level_bpe(), Some(&json!({"eos_token": 7})));
    let error = Tokenizer::load(model.to_str().unwrap()).unwrap_err();
    assert!(matches!(&error.kind, TokenizerErrorKind::Field { field, .. } if field == "eos_token"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// The chat template comes from tokenizer_config.json (a string, or the "default" of a list),
/// and chat_template.jinja beside it takes precedence, as in transformers.
#[test]
fn the_chat_template_comes_from_the_config_or_chat_template_jinja() {
    let dir = scratch("tok-template");
    let listed = json!({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT"},
    ]});
    model_dir(&dir, &byte_level_bpe(), Some(&listed));
    let tokenizer = Tokenizer::load(dir.to_str().unwrap()).unwrap();
    let (template, path) = tokenizer.config().chat_template.clone().unwrap();
    assert_eq!((template.as_str(), path), ("DEFAULT", dir.join("tokenizer_config.json")));

    std::fs::write(dir.join("chat_template.jinja"), "JINJA").unwrap();
    let tokenizer = Tokenizer::load(dir.to_str().unwrap()).unwrap();
    let (template, path) = tokenizer.config().chat_template.clone().unwrap();
    assert_eq!((template.as_str(), path), ("JINJA", dir.join("chat_template.jinja")));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A text's ids and each token's byte range.
type Encoded = (Vec<u32>, Vec<(usize, usize)>);

/// A `ByteLevel` pre-tokenizer that splits by GPT-2's pattern is run as a `Split` of the same
/// pattern and `ByteLevel` without it (each copy of the tokenizer then has its own compiled
/// pattern): ids and offsets are the `tokenizers` crate's on the file as written, by the
/// tokenizer and by its copies for the pool's threads alike.
#[test]
fn a_byte_level_split_gives_the_crates_ids_on_every_thread() {
    use rayon::prelude::*;
    let dir = scratch("tok-split");
    model_dir(&dir, &byte_level_bpe(), None);
    let path = dir.join("tokenizer.json");
    let ours = Tokenizer::load(path.to_str().unwrap()).unwrap();
    let theirs = tokenizers::Tokenizer::from_file(&path).unwrap();
    let texts: Vec<String> = [
        "hello world",
        // Runs of spaces before a word: the pattern leaves the last space to the word (" world",
        // one merged token), which splitting by `\s+` alone would not.
        "hello   world\n world\t  world",
        "don't  you've I'll we'd",
        "  leading and trailing   ",
        "tabs\tand\nnew\n\nlines\r\n",
        "digits 1234567 and 3.14",
        "naïve café ✓ 中文 emoji 🙂",
        "fn main() { let x = 1; }  // code\n    indented",
        "<|im_end|>hi<|im_end|>",
        "",
    ]
    .iter()
    .cycle()
    .take(90)
    .enumerate()
    .map(|(i, t)| format!("{t} {i}"))
    .collect();
    let expected: Vec<Encoded> = texts
        .iter()
        .map(|t| {
            let plain = theirs.encode_fast(t.as_str(), true).unwrap().get_ids().to_vec();
            let chat = theirs.encode(t.as_str(), false).unwrap();
            assert_eq!(chat.get_ids(), plain, "{t:?}: the post-processor adds nothing here");
            (plain, chat.get_offsets().to_vec())
        })
        .collect();
    let here: Vec<_> = texts
        .iter()
        .map(|t| {
            let offsets = ours.encode_with_offsets(t).unwrap();
            (ours.encode(t).unwrap(), offsets.offsets)
        })
        .collect();
    assert_eq!(here, expected);
    let copies = ours.per_thread();
    assert_eq!(copies.len(), rayon::current_num_threads());
    let pooled: Vec<_> = texts
        .par_iter()
        .map(|t| {
            let copy = &copies[rayon::current_thread_index().unwrap() % copies.len()];
            let offsets = copy.encode_with_offsets(t).unwrap();
            (copy.encode(t).unwrap(), offsets.offsets)
        })
        .collect();
    assert_eq!(pooled, expected);
    std::fs::remove_dir_all(dir).unwrap();
}
