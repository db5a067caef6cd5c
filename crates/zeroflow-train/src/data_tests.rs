//! The evaluation set of files is held out: the training stream never reads a token of it, over
//! several epochs; and its size in tokens does not depend on the micro-batch.

use std::path::PathBuf;

use zeroflow_data::IGNORE_TARGET;

use super::{Data, EVAL_TOKENS, EvalSet, Shape, Spec};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zeroflow-heldout-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn shape(batch: u64, seq: usize, eval_tokens: Option<usize>) -> Shape {
    let (packed, shuffled) = (false, false);
    Shape { batch, micro_steps: 100, rank: 0, world_size: 1, seq, eval_tokens, packed, shuffled }
}

/// The tokens (inputs and counted targets) of `steps` training micro-batches and of the whole
/// evaluation set.
fn tokens_read(data: &mut Data, steps: usize) -> (Vec<u32>, Vec<u32>) {
    let mut train = Vec::new();
    for _ in 0..steps {
        let batch = data.train.next_batch().unwrap();
        train.extend(&batch.inputs);
        train.extend(batch.targets.iter().filter(|&&t| t != IGNORE_TARGET));
    }
    let mut eval = Vec::new();
    for batch in &data.eval {
        for (&input, &target) in batch.inputs.iter().zip(&batch.targets) {
            if target != IGNORE_TARGET {
                eval.extend([input, target]);
            }
        }
    }
    (train, eval)
}

/// One shard whose token `i` is `i`: every token the training stream reads (over several epochs)
/// comes before every token the evaluation reads, which are the last tenth of the shard.
#[test]
fn one_shard_never_trains_on_its_evaluation_windows() {
    let dir = scratch("shard");
    let path = dir.join("tokens.bin");
    let tokens: Vec<u16> = (0..20_000).collect();
    zeroflow_data::write_shard(&path, &tokens).unwrap();
    let spec = Spec::Shards(vec![path]);
    let mut data = Data::open(&spec, EvalSet::Tail, 65536, shape(3, 32, None), 0).unwrap();
    assert_eq!(data.eval_tokens, 2000, "a tenth of the file (less than {EVAL_TOKENS})");
    assert!(data.eval_description.contains("held out from the end"), "{}", data.eval_description);
    let (train, eval) = tokens_read(&mut data, 1000);
    let (last_trained, first_evaluated) =
        (*train.iter().max().unwrap(), *eval.iter().min().unwrap());
    assert!(last_trained < 18_000, "trained on token {last_trained}");
    assert!(last_trained > 17_900, "the stream reaches the end of the training part");
    assert_eq!(first_evaluated, 18_000);
    // 62 windows of 32 in the 2,000 held-out tokens (the last 15 make no window).
    assert_eq!(*eval.iter().max().unwrap(), 18_000 + 62 * 32);
}

/// A text file read as bytes whose last tenth is written in other letters: the training stream
/// never reads one of them; the held-out set (--eval-tokens 1000) is that many tokens, whatever
/// the micro-batch, and every micro-batch size evaluates the same counted targets.
#[test]
fn one_text_file_holds_out_its_end_the_same_for_every_micro_batch() {
    let dir = scratch("text");
    let path = dir.join("data.txt");
    let mut text: Vec<u8> = (0..9000).map(|i| b'a' + (i % 13) as u8).collect();
    text.extend((0..1000).map(|i| b'n' + (i % 13) as u8));
    std::fs::write(&path, &text).unwrap();
    let spec = Spec::parse(path.to_str().unwrap()).unwrap();
    let mut sizes = Vec::new();
    for batch in [1, 2, 5] {
        let mut data =
            Data::open(&spec, EvalSet::Tail, 256, shape(batch, 16, Some(1000)), 0).unwrap();
        let (train, eval) = tokens_read(&mut data, 2000);
        assert!(train.iter().all(|&t| t < u32::from(b'n')), "micro-batch {batch}");
        assert!(eval.iter().all(|&t| t >= u32::from(b'n')), "micro-batch {batch}");
        let counted: usize = data.eval.iter().map(|b| b.counted()).sum();
        sizes.push((data.eval_tokens, counted));
    }
    assert_eq!(sizes[0], (1000, 999 / 16 * 16));
    assert!(sizes.iter().all(|&s| s == sizes[0]), "{sizes:?}");
}

/// `--eval-data`: the evaluation set is the start of the other file, and all of --data trains.
#[test]
fn eval_data_evaluates_on_the_start_of_other_files() {
    let dir = scratch("eval_data");
    let (train_path, eval_path) = (dir.join("train.txt"), dir.join("eval.txt"));
    std::fs::write(&train_path, vec![b'a'; 4000]).unwrap();
    std::fs::write(&eval_path, vec![b'z'; 3000]).unwrap();
    let spec = Spec::parse(train_path.to_str().unwrap()).unwrap();
    let eval = Spec::parse(eval_path.to_str().unwrap()).unwrap();
    let mut data =
        Data::open(&spec, EvalSet::Given(&eval), 256, shape(2, 16, Some(1000)), 0).unwrap();
    assert_eq!(data.eval_tokens, 1000);
    let (train, evaluated) = tokens_read(&mut data, 500);
    assert!(train.iter().all(|&t| t == u32::from(b'a')));
    assert!(evaluated.iter().all(|&t| t == u32::from(b'z')));
}

/// `--eval-data` beside the synthetic corpus takes the default --eval-tokens of files, not the
/// synthetic stream's (regression: it took 16,384).
#[test]
fn eval_data_beside_the_synthetic_corpus_takes_the_files_default() {
    let dir = scratch("synthetic_eval_data");
    let eval_path = dir.join("eval.txt");
    std::fs::write(&eval_path, vec![b'z'; 20_000]).unwrap();
    let eval = Spec::parse(eval_path.to_str().unwrap()).unwrap();
    let data =
        Data::open(&Spec::Synthetic, EvalSet::Given(&eval), 256, shape(2, 16, None), 0).unwrap();
    assert_eq!(data.eval_tokens, 20_000, "all of the file, less than {EVAL_TOKENS}");
}

/// An evaluation set without a window names what gives it one: --eval-tokens only where the set
/// holds all it asked for, more data where a tenth of the data is all a run holds out, more
/// --eval-data where that is short.
#[test]
fn an_evaluation_set_without_a_window_says_what_gives_it_one() {
    let dir = scratch("no_window");
    let (train_path, eval_path) = (dir.join("train.txt"), dir.join("eval.txt"));
    std::fs::write(&train_path, vec![b'a'; 500]).unwrap();
    std::fs::write(&eval_path, vec![b'z'; 40]).unwrap();
    let spec = Spec::parse(train_path.to_str().unwrap()).unwrap();
    let eval = Spec::parse(eval_path.to_str().unwrap()).unwrap();
    let refusal = |eval: EvalSet<'_>, eval_tokens: Option<usize>| match Data::open(
        &spec,
        eval,
        256,
        shape(2, 64, eval_tokens),
        0,
    ) {
        Ok(_) => panic!("no window of 64"),
        Err(e) => e.to_string(),
    };
    // 50 tokens held out (a tenth of 500) of the 1,048,576 asked for by default.
    let short_data = refusal(EvalSet::Tail, None);
    assert!(short_data.contains("more data (a run holds out at most a tenth"), "{short_data}");
    assert!(!short_data.contains("--eval-tokens"), "{short_data}");
    // 30 asked for, and held out: a larger --eval-tokens would give a window.
    let asked = refusal(EvalSet::Tail, Some(30));
    assert!(asked.contains("a larger --eval-tokens"), "{asked}");
    let short_eval = refusal(EvalSet::Given(&eval), None);
    assert!(short_eval.contains("more --eval-data or a smaller --seq"), "{short_eval}");
}
