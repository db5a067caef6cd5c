//! Shards of both widths, document indexes and loss masks: round trips and their errors.

use zeroflow_data::{
    DataErrorKind, DataLoader, IGNORE_TARGET, SHARD_MAGIC, SHARD_MAGIC_U32, ShardTokens, Source,
    TokenWidth, read_document_index, read_loss_mask, read_shard, write_document_index,
    write_loss_mask, write_shard_as,
};

use crate::fixtures::scratch;

fn magic(path: &std::path::Path) -> i32 {
    let bytes = std::fs::read(path).unwrap();
    i32::from_le_bytes(bytes[..4].try_into().unwrap())
}

#[test]
fn the_token_width_follows_the_vocabulary() {
    assert_eq!(TokenWidth::for_vocab(50257), TokenWidth::U16);
    assert_eq!(TokenWidth::for_vocab(65536), TokenWidth::U16);
    assert_eq!(TokenWidth::for_vocab(65537), TokenWidth::U32);
    assert_eq!(TokenWidth::for_vocab(128256), TokenWidth::U32);
}

/// Both widths read back exactly (u32 ids above 65535 included), with llm.c's magic numbers, and
/// the loader reads a u32 shard; a u16 shard refuses an id that does not fit.
#[test]
fn u16_and_u32_shards_round_trip() {
    let dir = scratch("widths");
    let narrow: Vec<u32> = (0..1000).map(|i| i * 65 % 65536).collect();
    let wide: Vec<u32> = (0..1000).map(|i| 60000 + i * 97).collect();
    let (u16_path, u32_path) = (dir.join("narrow.bin"), dir.join("wide.bin"));
    write_shard_as(&u16_path, TokenWidth::U16, &narrow).unwrap();
    write_shard_as(&u32_path, TokenWidth::U32, &wide).unwrap();
    assert_eq!((magic(&u16_path), magic(&u32_path)), (SHARD_MAGIC, SHARD_MAGIC_U32));
    assert_eq!(std::fs::metadata(&u32_path).unwrap().len(), 1024 + 4 * 1000);
    let expected_u16 = ShardTokens::U16(narrow.iter().map(|&t| t as u16).collect());
    assert_eq!(read_shard(&u16_path, 65536).unwrap(), expected_u16);
    assert_eq!(read_shard(&u32_path, 200_000).unwrap(), ShardTokens::U32(wide.clone()));

    let mut loader =
        DataLoader::new(Source::Shards(vec![u32_path.clone()]), 200_000, 2, 8, 0, 1).unwrap();
    assert_eq!(loader.next_batch().unwrap().inputs, wide[..16]);

    let error = read_shard(&u32_path, 100_000).unwrap_err();
    assert!(matches!(error.kind, DataErrorKind::TokenOutOfRange { vocab: 100_000, .. }), "{error}");
    assert!(write_shard_as(&dir.join("no.bin"), TokenWidth::U16, &[1, 70000]).is_err());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn document_indexes_and_loss_masks_round_trip_and_are_checked() {
    let dir = scratch("sidecars");
    let index = dir.join("a.idx");
    write_document_index(&index, &[0, 5, 5, 12]).unwrap();
    assert_eq!(read_document_index(&index).unwrap(), [0, 5, 5, 12]);
    write_document_index(&index, &[0, 7, 3]).unwrap();
    let error = read_document_index(&index).unwrap_err();
    assert!(matches!(error.kind, DataErrorKind::Corrupt(_)), "{error}");

    let mask = dir.join("a.mask");
    write_loss_mask(&mask, &[0, 0, 1, 1, 0]).unwrap();
    assert_eq!(read_loss_mask(&mask).unwrap(), [0, 0, 1, 1, 0]);
    write_loss_mask(&mask, &[0, 2]).unwrap();
    let error = read_loss_mask(&mask).unwrap_err();
    assert!(matches!(error.kind, DataErrorKind::Corrupt(_)), "{error}");
    // A mask is not a shard.
    let error = read_shard(&mask, 10).unwrap_err();
    assert!(matches!(error.kind, DataErrorKind::WrongMagic { .. }), "{error}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A shard with a loss mask beside it: the loader's targets are [`IGNORE_TARGET`] exactly where
/// the mask byte of the target token is 0, the inputs are untouched; and a held-out tail is never
/// read, the stream wrapping before it.
#[test]
fn the_loader_ignores_masked_targets_and_never_reads_the_held_out_tail() {
    let dir = scratch("masked_loader");
    let tokens: Vec<u16> = (0..200).collect();
    let mask: Vec<u8> = (0..200).map(|i| u8::from(i % 5 >= 2)).collect();
    let shard = dir.join("tokens_000000.bin");
    zeroflow_data::write_shard(&shard, &tokens).unwrap();
    write_loss_mask(&dir.join("tokens_000000.mask"), &mask).unwrap();
    let source = Source::Shards(vec![shard]);
    let mut loader = DataLoader::new(source, 256, 2, 8, 0, 1).unwrap().hold_out_tail(50).unwrap();
    assert!(loader.masked());
    let mut largest = 0;
    for _ in 0..40 {
        let batch = loader.next_batch().unwrap();
        for (&input, &target) in batch.inputs.iter().zip(&batch.targets) {
            let next = input as usize + 1;
            if mask[next] == 0 {
                assert_eq!(target, IGNORE_TARGET, "token {next} is masked out");
            } else {
                assert_eq!(target as usize, next);
            }
            largest = largest.max(next);
        }
    }
    assert!(largest < 150, "read token {largest} of the held-out tail 150..200");
    assert!(largest >= 140, "the stream reaches the end of the training part: {largest}");
}

/// A packing loader cuts the same rows as a plain one (the same inputs, targets and data
/// positions, across shards and with two ranks), and gives each token its position in its
/// document: 0 at every document start of the `.idx` and at every row start, one more after.
#[test]
fn the_packing_loader_restarts_positions_at_each_document_and_cuts_the_same_rows() {
    let dir = scratch("packing_loader");
    let mut shards = Vec::new();
    // Documents of lengths 1 to 9 in turn (the index's starts), in two shards.
    for (index, len) in [(0, 120u64), (1, 90)] {
        let shard = dir.join(format!("tokens_{index:06}.bin"));
        let tokens: Vec<u16> = (0..len as u16).map(|i| i % 200).collect();
        zeroflow_data::write_shard(&shard, &tokens).unwrap();
        let mut starts = vec![0u64];
        while let Some(&last) = starts.last() {
            let next = last + 1 + starts.len() as u64 % 9;
            if next >= len {
                break;
            }
            starts.push(next);
        }
        starts.push(len);
        write_document_index(&dir.join(format!("tokens_{index:06}.idx")), &starts).unwrap();
        shards.push((shard, starts));
    }
    let source = Source::Shards(shards.iter().map(|(path, _)| path.clone()).collect());
    let (batch, seq, world) = (2, 7, 2);
    for rank in 0..world {
        let plain = DataLoader::new(source.clone(), 256, batch, seq, rank, world).unwrap();
        let packing = DataLoader::new(source.clone(), 256, batch, seq, rank, world).unwrap();
        let (mut plain, mut packing) = (plain, packing.packed().unwrap());
        assert!(packing.is_packed() && !plain.is_packed());
        for _ in 0..20 {
            let (expected, packed) = (plain.next_batch().unwrap(), packing.next_batch().unwrap());
            assert_eq!(packed.inputs, expected.inputs);
            assert_eq!(packed.targets, expected.targets);
            assert_eq!(packing.position(), plain.position());
            assert!(expected.positions().is_none());
            // The step just read began `world × batch × seq` tokens before the next one.
            let at = packing.position();
            let first = at.offset - world * batch * seq + rank * batch * seq;
            let starts = &shards[at.shard].1;
            for (i, &position) in packed.positions().unwrap().iter().enumerate() {
                let token = (first + i) as u64;
                let row_start = (first + i / seq * seq) as u64;
                let document = starts.iter().copied().filter(|&s| s <= token).max().unwrap();
                assert_eq!(u64::from(position), token - document.max(row_start), "token {token}");
            }
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Packing needs every shard's document index: a shard without one is an error naming it and
/// saying how to make one; text files have none either.
#[test]
fn packing_shards_without_a_document_index_is_an_error_naming_the_shard() {
    let dir = scratch("packing_without_index");
    let tokens: Vec<u16> = (0..100).collect();
    let (first, second) = (dir.join("tokens_000000.bin"), dir.join("tokens_000001.bin"));
    zeroflow_data::write_shard(&first, &tokens).unwrap();
    zeroflow_data::write_shard(&second, &tokens).unwrap();
    write_document_index(&dir.join("tokens_000000.idx"), &[0, 40, 100]).unwrap();
    let source = Source::Shards(vec![first, second.clone()]);
    let error = DataLoader::new(source, 256, 1, 8, 0, 1).unwrap().packed().unwrap_err();
    assert_eq!(error.kind, DataErrorKind::NoDocumentIndex);
    assert_eq!(error.path, second);
    assert!(error.to_string().contains("zeroflow tokenize"), "{error}");

    let text = dir.join("plain.txt");
    std::fs::write(&text, "some text without documents, long enough").unwrap();
    let error =
        DataLoader::new(Source::Text(vec![text]), 256, 1, 8, 0, 1).unwrap().packed().unwrap_err();
    assert_eq!(error.kind, DataErrorKind::NoDocumentIndex);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A shuffling loader reads, in each epoch, every row a plain one reads (`seq + 1` tokens from
/// every `seq`-th, the ranks' disjoint), each once, in another order, and another again in the
/// next epoch; its loss masks and document positions follow the rows; the same seed gives the
/// same order, two ranks read what one with twice the micro-batch reads, and a saved position
/// resumes it.
#[test]
fn the_shuffling_loader_reads_every_row_once_an_epoch_in_its_own_order_and_resumes_it() {
    let dir = scratch("shuffling_loader");
    // Two shards of distinct tokens (a token names its place), masked where the value is a
    // multiple of 3, with documents every 5 tokens.
    let mut paths = Vec::new();
    for (index, base, len) in [(0, 0u32, 203u32), (1, 1000, 141)] {
        let path = dir.join(format!("tokens_{index:06}.bin"));
        let tokens: Vec<u32> = (base..base + len).collect();
        write_shard_as(&path, TokenWidth::U32, &tokens).unwrap();
        let mask: Vec<u8> = tokens.iter().map(|t| u8::from(t % 3 != 0)).collect();
        write_loss_mask(&path.with_extension("mask"), &mask).unwrap();
        let mut starts: Vec<u64> = (0..u64::from(len)).step_by(5).collect();
        starts.push(u64::from(len));
        write_document_index(&path.with_extension("idx"), &starts).unwrap();
        paths.push(path);
    }
    let source = Source::Shards(paths);
    let (vocab, batch, seq, world) = (5000, 2, 8, 2);
    // Rows per shard (203 − 1) / 8 = 25 and (141 − 1) / 8 = 17; steps of 4 rows: 6 + 4 a epoch.
    let steps_per_epoch = 10;
    let loader = |rank: usize, seed: Option<u64>| {
        let plain = DataLoader::new(source.clone(), vocab, batch, seq, rank, world).unwrap();
        let plain = plain.packed().unwrap();
        match seed {
            Some(seed) => plain.shuffled(seed).unwrap(),
            None => plain,
        }
    };
    // The first token of each row read, in order, by every rank together, for `steps` steps.
    let read = |seed: Option<u64>, steps: usize| -> Vec<u32> {
        let mut loaders: Vec<DataLoader> = (0..world).map(|rank| loader(rank, seed)).collect();
        let mut rows = Vec::new();
        for _ in 0..steps {
            for loader in &mut loaders {
                let got = loader.next_batch().unwrap();
                let positions = got.positions().unwrap();
                for row in 0..batch {
                    let inputs = &got.inputs[row * seq..(row + 1) * seq];
                    let first = inputs[0];
                    assert_eq!(first % 1000 % seq as u32, 0, "a row starts at a multiple of seq");
                    for (i, &input) in inputs.iter().enumerate() {
                        assert_eq!(input, first + i as u32, "a row's tokens are consecutive");
                        let target = got.targets[row * seq + i];
                        let next = input + 1;
                        let expected = if next % 3 == 0 { IGNORE_TARGET } else { next };
                        assert_eq!(target, expected, "the mask of token {next}");
                        let in_document = (input % 1000) % 5;
                        let expected = in_document.min(i as u32);
                        assert_eq!(positions[row * seq + i], expected, "the position of {input}");
                    }
                    rows.push(first);
                }
            }
        }
        rows
    };
    for (rank, seed) in [(0, None), (1, Some(7))] {
        let mut one = loader(rank, seed);
        assert_eq!(one.epoch_steps().unwrap(), Some(steps_per_epoch as u64));
        for _ in 0..steps_per_epoch {
            assert_eq!(one.position().epoch, 0);
            one.next_batch().unwrap();
        }
        one.next_batch().unwrap();
        assert_eq!(one.position().epoch, 1, "the epoch's steps, as epoch_steps counts them");
    }
    let plain = read(None, steps_per_epoch);
    let shuffled = read(Some(7), 2 * steps_per_epoch);
    let (first_epoch, second_epoch) = shuffled.split_at(plain.len());
    let sorted = |rows: &[u32]| {
        let mut rows = rows.to_vec();
        rows.sort_unstable();
        rows
    };
    // Every row once an epoch; the rows a plain loader reads are the first of each shard.
    let all_rows: Vec<u32> = (0..25).map(|r| r * 8).chain((0..17).map(|r| 1000 + r * 8)).collect();
    for epoch in [first_epoch, second_epoch] {
        let mut unique = sorted(epoch);
        unique.dedup();
        assert_eq!(unique.len(), epoch.len(), "no row twice in an epoch");
        assert!(unique.iter().all(|row| all_rows.contains(row)), "{unique:?}");
        assert_eq!(epoch.iter().filter(|&&r| r < 1000).count(), 24, "6 steps of shard 0");
    }
    assert_ne!(first_epoch, &plain[..], "shuffled");
    assert_ne!(first_epoch, second_epoch, "another order in the next epoch");
    assert_eq!(read(Some(7), 2 * steps_per_epoch), shuffled, "the same seed, the same order");
    assert_ne!(read(Some(8), steps_per_epoch), first_epoch, "another seed, another order");

    // Two ranks read together what one process with twice the micro-batch reads.
    let one = DataLoader::new(source.clone(), vocab, 2 * batch, seq, 0, 1).unwrap();
    let mut one = one.packed().unwrap().shuffled(7).unwrap();
    let mut ranks: Vec<DataLoader> = (0..world).map(|rank| loader(rank, Some(7))).collect();
    for _ in 0..2 * steps_per_epoch {
        let together = one.next_batch().unwrap();
        let parts: Vec<u32> =
            ranks.iter_mut().flat_map(|rank| rank.next_batch().unwrap().inputs).collect();
        assert_eq!(together.inputs, parts);
    }

    // A position saved mid-epoch resumes the same batches, for both ranks.
    for rank in 0..world {
        let mut straight = loader(rank, Some(7));
        for _ in 0..13 {
            straight.next_batch().unwrap();
        }
        let saved = straight.position();
        let mut resumed = loader(rank, Some(7));
        resumed.seek(saved).unwrap();
        for _ in 0..12 {
            assert_eq!(resumed.next_batch().unwrap(), straight.next_batch().unwrap());
            assert_eq!(resumed.position(), straight.position());
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}
