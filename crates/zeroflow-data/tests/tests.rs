//! Integration tests of the data loaders (typed errors naming the file, the synthetic corpus'
//! entropy, resume, ranks), and in the modules the shard formats, tokenizers, chat templates and
//! `tokenize_corpus`.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use zeroflow_data::{
    DataErrorKind, DataLoader, SHARD_MAGIC, SHARD_MAGIC_U32, ShardTokens, Source, SyntheticCorpus,
    read_shard, write_shard,
};

mod chat;
mod corpus;
mod fixtures;
mod shards;
mod tokenizer;

/// A scratch directory for this test, emptied first.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zeroflow-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn header(magic: i32, version: i32, count: i32) -> Vec<u8> {
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[magic, version, count]);
    header.iter().flat_map(|h| h.to_le_bytes()).collect()
}

fn expect_error(path: &Path, vocab: usize, check: impl Fn(&DataErrorKind) -> bool) {
    let error = read_shard(path, vocab).unwrap_err();
    assert!(check(&error.kind), "{error}");
    assert_eq!(error.path, path);
    assert!(error.to_string().contains(&path.display().to_string()), "{error} names the file");
    // The loader reports the same error.
    let loader_error =
        DataLoader::new(Source::Shards(vec![path.into()]), vocab, 1, 4, 0, 1).unwrap_err();
    assert_eq!(loader_error, error);
}

#[test]
fn each_kind_of_bad_shard_is_a_typed_error_naming_the_file() {
    let dir = scratch("bad");
    let tokens: Vec<u8> =
        [1u16, 2, 3, 4, 5, 6, 7, 8, 9].iter().flat_map(|t| t.to_le_bytes()).collect();

    let empty = dir.join("empty.bin");
    std::fs::write(&empty, b"").unwrap();
    expect_error(&empty, 50257, |k| *k == DataErrorKind::Empty);

    let no_tokens = dir.join("no_tokens.bin");
    std::fs::write(&no_tokens, header(SHARD_MAGIC, 1, 0)).unwrap();
    expect_error(&no_tokens, 50257, |k| *k == DataErrorKind::Empty);

    let magic = dir.join("magic.bin");
    std::fs::write(&magic, [header(20240522, 1, 9), tokens.clone()].concat()).unwrap();
    expect_error(&magic, 50257, |k| *k == DataErrorKind::WrongMagic { found: 20240522 });

    let version = dir.join("version.bin");
    std::fs::write(&version, [header(SHARD_MAGIC, 2, 9), tokens.clone()].concat()).unwrap();
    expect_error(&version, 50257, |k| *k == DataErrorKind::WrongVersion { found: 2, expected: 1 });
    // llm.c's u32 format goes with version 7.
    let version_u32 = dir.join("version_u32.bin");
    std::fs::write(&version_u32, [header(SHARD_MAGIC_U32, 1, 9), tokens.clone()].concat()).unwrap();
    expect_error(&version_u32, 50257, |k| {
        *k == DataErrorKind::WrongVersion { found: 1, expected: 7 }
    });

    let truncated = dir.join("truncated.bin");
    std::fs::write(&truncated, [header(SHARD_MAGIC, 1, 10), tokens.clone()].concat()).unwrap();
    expect_error(&truncated, 50257, |k| {
        matches!(k, DataErrorKind::Truncated { expected_bytes: 1044, found_bytes: 1042 })
    });

    let short_header = dir.join("short_header.bin");
    std::fs::write(&short_header, &header(SHARD_MAGIC, 1, 9)[..100]).unwrap();
    expect_error(&short_header, 50257, |k| matches!(k, DataErrorKind::Truncated { .. }));

    let trailing = dir.join("trailing.bin");
    std::fs::write(&trailing, [header(SHARD_MAGIC, 1, 8), tokens.clone()].concat()).unwrap();
    expect_error(&trailing, 50257, |k| matches!(k, DataErrorKind::TrailingBytes { .. }));

    let out_of_range = dir.join("out_of_range.bin");
    write_shard(&out_of_range, &[1, 2, 3, 64, 5]).unwrap();
    expect_error(&out_of_range, 64, |k| {
        *k == DataErrorKind::TokenOutOfRange { token: 64, index: 3, vocab: 64 }
    });

    let missing = dir.join("missing.bin");
    expect_error(&missing, 64, |k| matches!(k, DataErrorKind::Io(_)));

    // A shard too short for one step of all ranks.
    let short = dir.join("short.bin");
    write_shard(&short, &[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
    let error = DataLoader::new(Source::Shards(vec![short.clone()]), 64, 2, 4, 0, 1).unwrap_err();
    assert_eq!(error.kind, DataErrorKind::TooShort { tokens: 8, needed: 9 });
    assert_eq!(error.path, short);

    // Text: bytes above a byte-level model's vocabulary, and an empty file.
    let text = dir.join("text.txt");
    std::fs::write(&text, "plain ascii then \u{e9}").unwrap();
    let error = DataLoader::new(Source::Text(vec![text.clone()]), 128, 1, 4, 0, 1).unwrap_err();
    assert!(matches!(error.kind, DataErrorKind::TokenOutOfRange { token: 0xc3, .. }), "{error}");
    assert_eq!(error.path, text);
    let empty_text = dir.join("empty.txt");
    std::fs::write(&empty_text, "").unwrap();
    let error =
        DataLoader::new(Source::Text(vec![empty_text.clone()]), 256, 1, 4, 0, 1).unwrap_err();
    assert_eq!((error.kind, error.path), (DataErrorKind::Empty, empty_text));
    // The synthetic corpus for a model whose vocabulary is too small.
    let corpus = Arc::new(SyntheticCorpus::default());
    let source = Source::Synthetic { corpus, stream_seed: 0, len: 1000 };
    let error = DataLoader::new(source, 32, 1, 4, 0, 1).unwrap_err();
    assert!(matches!(error.kind, DataErrorKind::TokenOutOfRange { vocab: 32, .. }), "{error}");
    assert_eq!(error.path, Path::new("<synthetic>"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_written_shard_reads_back() {
    let dir = scratch("roundtrip");
    let path = dir.join("ok.bin");
    let tokens: Vec<u16> = (0..1000).map(|i| (i * 37 % 50257) as u16).collect();
    write_shard(&path, &tokens).unwrap();
    assert_eq!(read_shard(&path, 50257).unwrap(), ShardTokens::U16(tokens));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Plug-in conditional entropy of the next token given the previous `order` tokens.
fn empirical_conditional_entropy(tokens: &[u32], order: usize) -> f64 {
    let mut joint: HashMap<&[u32], usize> = HashMap::new();
    let mut context: HashMap<&[u32], usize> = HashMap::new();
    for window in tokens.windows(order + 1) {
        *joint.entry(window).or_default() += 1;
        *context.entry(&window[..order]).or_default() += 1;
    }
    let n = (tokens.len() - order) as f64;
    let h = |counts: HashMap<&[u32], usize>| -> f64 {
        counts.values().map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
    };
    h(joint) - h(context)
}

/// A long sample's empirical conditional entropy (full context) matches the computed entropy rate
/// to 1%, and with one token of context it matches the computed first-position floor to 1%.
#[test]
fn the_synthetic_corpus_empirical_entropy_matches_its_computed_floor() {
    let corpus = SyntheticCorpus::default();
    assert!((corpus.entropy_rate() - 1.088_900).abs() < 1e-6, "{}", corpus.entropy_rate());
    let sample = corpus.sample(9, 2_000_000);
    assert!(sample.iter().all(|&t| (t as usize) < corpus.vocab));
    let full = empirical_conditional_entropy(&sample, 2);
    assert!((full - corpus.entropy_rate()).abs() / corpus.entropy_rate() < 0.01, "{full}");
    let one_token = empirical_conditional_entropy(&sample, 1);
    let floor_first = corpus.loss_floor(1);
    assert!((one_token - floor_first).abs() / floor_first < 0.01, "{one_token} vs {floor_first}");
    // A window's floor is the average over its positions.
    let seq = 64;
    let expected = (floor_first + (seq - 1) as f64 * corpus.entropy_rate()) / seq as f64;
    assert!((corpus.loss_floor(seq) - expected).abs() < 1e-12);
    // The mean log-loss of the true model on the sample is the entropy rate too.
    let log_loss: f64 = sample
        .windows(3)
        .map(|w| -corpus.next_distribution(&w[..2]).find(|&(s, _)| s == w[2]).unwrap().1.ln())
        .sum::<f64>()
        / (sample.len() - 2) as f64;
    assert!((log_loss - corpus.entropy_rate()).abs() < 0.005, "{log_loss}");
}

#[test]
fn the_synthetic_stream_is_deterministic_by_seed() {
    let corpus = SyntheticCorpus::default();
    assert_eq!(corpus.sample(3, 1000), SyntheticCorpus::default().sample(3, 1000));
    assert_ne!(corpus.sample(3, 1000), corpus.sample(4, 1000));
}

fn two_shards(dir: &Path) -> Vec<PathBuf> {
    // Token value = its index in the whole stream, so every token says where it came from.
    let paths = vec![dir.join("a.bin"), dir.join("b.bin")];
    write_shard(&paths[0], &(0..1000).collect::<Vec<u16>>()).unwrap();
    write_shard(&paths[1], &(1000..1700).collect::<Vec<u16>>()).unwrap();
    paths
}

/// Saving the position after some steps and seeking a fresh loader to it continues the exact
/// stream, across a shard boundary and an epoch boundary.
#[test]
fn resuming_from_a_saved_position_continues_the_exact_stream() {
    let dir = scratch("resume");
    let source = Source::Shards(two_shards(&dir));
    let mut first = DataLoader::new(source.clone(), 65536, 4, 16, 1, 2).unwrap();
    for _ in 0..5 {
        first.next_batch().unwrap();
    }
    let saved = first.position();
    let json = serde_json::to_string(&saved).unwrap();
    let expected: Vec<_> = (0..20).map(|_| first.next_batch().unwrap()).collect();
    assert!(first.position().epoch >= 1, "the test crosses an epoch");

    let mut resumed = DataLoader::new(source, 65536, 4, 16, 1, 2).unwrap();
    resumed.seek(serde_json::from_str(&json).unwrap()).unwrap();
    let got: Vec<_> = (0..20).map(|_| resumed.next_batch().unwrap()).collect();
    assert_eq!(got, expected);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Within a step the ranks' inputs are disjoint and together cover one contiguous span; targets
/// are inputs shifted by one.
#[test]
fn ranks_get_disjoint_data() {
    let dir = scratch("ranks");
    let source = Source::Shards(two_shards(&dir));
    let world = 3;
    let mut loaders: Vec<_> = (0..world)
        .map(|rank| DataLoader::new(source.clone(), 65536, 2, 8, rank, world).unwrap())
        .collect();
    for _ in 0..30 {
        let batches: Vec<_> = loaders.iter_mut().map(|l| l.next_batch().unwrap()).collect();
        let mut seen = HashSet::new();
        for batch in &batches {
            assert!(batch.inputs.iter().all(|t| seen.insert(*t)), "ranks overlap");
            for (input, target) in batch.inputs.iter().zip(&batch.targets) {
                assert_eq!(*target, input + 1);
            }
        }
        let (min, max) = (*seen.iter().min().unwrap(), *seen.iter().max().unwrap());
        assert_eq!((max - min + 1) as usize, seen.len(), "one contiguous span per step");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn the_synthetic_source_and_text_source_make_batches() {
    let corpus = Arc::new(SyntheticCorpus::default());
    let source = Source::Synthetic { corpus, stream_seed: 0, len: 10_000 };
    let mut loader = DataLoader::new(source, 64, 4, 32, 0, 1).unwrap();
    let batch = loader.next_batch().unwrap();
    assert_eq!((batch.inputs.len(), batch.targets.len()), (128, 128));
    assert_eq!(batch.inputs[1..], batch.targets[..127]);

    let dir = scratch("text");
    let text = dir.join("t.txt");
    std::fs::write(&text, "hello, world! ".repeat(10)).unwrap();
    let mut loader = DataLoader::new(Source::Text(vec![text]), 256, 2, 8, 0, 1).unwrap();
    let batch = loader.next_batch().unwrap();
    assert_eq!(&batch.inputs[..5], b"hello".map(u32::from).as_slice());
    std::fs::remove_dir_all(dir).unwrap();
}

/// GPT-2 BPE works offline and gives GPT-2's ids ("Hello world" is 15496, 995), and decodes them
/// back.
#[test]
fn gpt2_bpe_gives_gpt2_ids() {
    use zeroflow_data::{gpt2_decode, gpt2_encode};
    assert_eq!(gpt2_encode("Hello world").unwrap(), [15496, 995]);
    let text = "Language models are unsupervised multitask learners. ".repeat(20);
    assert_eq!(gpt2_decode(&gpt2_encode(&text).unwrap()).unwrap(), text);
}
