//! The evaluation set: a range of tokens cut into windows of `seq` inputs (each window's targets
//! the next `seq` tokens, so consecutive windows share one token, as the training stream's do),
//! dealt to the ranks in turn and packed into micro-batches, the last padded with
//! [`IGNORE_TARGET`]: how much is evaluated is the range, whatever the micro-batch. Packed
//! (where the range's document starts are given), each window's tokens carry their positions in
//! their documents as the training stream's do ([`crate::DataLoader::packed`]).

use crate::loader::{Batch, IGNORE_TARGET, apply_mask, document_positions};

/// The windows of `seq` inputs a range of `len` tokens holds.
pub fn eval_windows(len: usize, seq: usize) -> usize {
    len.saturating_sub(1) / seq
}

/// This rank's micro-batches of `batch` sequences of the windows of `tokens` (masked by `mask`,
/// one byte per token, where given): windows `rank`, `rank + world`, ...; every rank gets the
/// same number of micro-batches, the rows past its windows padding (inputs 0, targets ignored).
/// With `documents` (where each document of `tokens` starts, ascending) the rows are packed:
/// each carries its tokens' positions in their documents (a padding row is one document).
pub fn eval_batches(
    tokens: &[u32],
    mask: Option<&[u8]>,
    documents: Option<&[u64]>,
    seq: usize,
    batch: usize,
    rank: usize,
    world: usize,
) -> Vec<Batch> {
    let windows = eval_windows(tokens.len(), seq);
    let per_rank = windows.div_ceil(world);
    let mut rows = (0..per_rank).map(|i| rank + i * world).filter(|&w| w < windows);
    let mut batches = Vec::new();
    for _ in 0..per_rank.div_ceil(batch) {
        let mut out = Batch {
            inputs: vec![0; batch * seq],
            targets: vec![IGNORE_TARGET; batch * seq],
            positions: Vec::new(),
        };
        let mut padding_from = batch;
        for row in 0..batch {
            let Some(window) = rows.next() else {
                padding_from = row;
                break;
            };
            let start = window * seq;
            if let Some(documents) = documents {
                document_positions(documents, start, seq, seq, &mut out.positions);
            }
            let cells = row * seq..(row + 1) * seq;
            out.inputs[cells.clone()].copy_from_slice(&tokens[start..start + seq]);
            let targets = &mut out.targets[cells];
            targets.copy_from_slice(&tokens[start + 1..start + 1 + seq]);
            if let Some(mask) = mask {
                apply_mask(targets, &mask[start + 1..start + 1 + seq]);
            }
        }
        if documents.is_some() {
            for _ in padding_from..batch {
                out.positions.extend(0..seq as u32);
            }
        }
        batches.push(out);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every window of the range is evaluated exactly once, by one rank, whatever the micro-batch
    /// and the number of ranks; the padding counts for nothing.
    #[test]
    fn every_window_is_dealt_once_and_padding_is_ignored() {
        let tokens: Vec<u32> = (0..101).collect();
        let seq = 7;
        let windows = eval_windows(tokens.len(), seq);
        assert_eq!(windows, 14);
        for (batch, world) in [(1, 1), (3, 1), (4, 2), (5, 3), (32, 4)] {
            let mut seen: Vec<u32> = Vec::new();
            for rank in 0..world {
                let batches = eval_batches(&tokens, None, None, seq, batch, rank, world);
                assert_eq!(batches.len(), windows.div_ceil(world).div_ceil(batch));
                for b in &batches {
                    for (input, target) in b.inputs.chunks(seq).zip(b.targets.chunks(seq)) {
                        if target[0] == IGNORE_TARGET {
                            assert!(target.iter().all(|&t| t == IGNORE_TARGET));
                            continue;
                        }
                        assert_eq!(target[0], input[0] + 1);
                        seen.push(input[0]);
                    }
                }
            }
            seen.sort();
            let starts: Vec<u32> = (0..windows as u32).map(|w| w * seq as u32).collect();
            assert_eq!(seen, starts, "batch {batch}, world {world}");
            let counted: usize = (0..world)
                .flat_map(|rank| eval_batches(&tokens, None, None, seq, batch, rank, world))
                .map(|b| b.counted())
                .sum();
            assert_eq!(counted, windows * seq, "batch {batch}, world {world}");
        }
    }

    /// Packed, each window's positions restart at its start and at every document start in it;
    /// the padding row is one document; unpacked, no positions.
    #[test]
    fn packed_windows_restart_their_positions_at_each_document() {
        let tokens: Vec<u32> = (0..13).collect();
        let documents = [0, 2, 5, 6, 11];
        let batches = eval_batches(&tokens, None, Some(&documents), 4, 2, 0, 1);
        assert_eq!(batches.len(), 2);
        // Windows 0..4, 4..8 | 8..12 and a padding row.
        assert_eq!(batches[0].positions, vec![0, 1, 0, 1, 0, 0, 0, 1]);
        assert_eq!(batches[1].positions, vec![0, 1, 2, 0, 0, 1, 2, 3]);
        let unpacked = eval_batches(&tokens, None, None, 4, 2, 0, 1);
        assert!(unpacked.iter().all(|b| b.positions().is_none()));
        assert_eq!(unpacked[0].inputs, batches[0].inputs);
    }

    #[test]
    fn the_mask_ignores_its_zero_targets() {
        let tokens: Vec<u32> = (0..9).collect();
        let mask = [1, 1, 0, 0, 1, 1, 1, 0, 1];
        let batches = eval_batches(&tokens, Some(&mask), None, 4, 2, 0, 1);
        assert_eq!(batches.len(), 1);
        let i = IGNORE_TARGET;
        assert_eq!(batches[0].targets, vec![1, i, i, 4, 5, 6, i, 8]);
    }
}
