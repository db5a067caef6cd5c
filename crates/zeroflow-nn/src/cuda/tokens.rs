//! The token ids of the current micro-batch on the GPU, and the host-side sort that makes the
//! token-embedding gradient deterministic.
//!
//! One u32 device buffer holds, in order: inputs `[n]`, targets `[n]`, with packed rows each
//! token's position in its document (`positions [n]`), then for the embedding backward the rows
//! sorted by input token (`order [n]`), the token of each bucket of equal tokens (`bucket_token
//! [n]`, the first `buckets` used) and where each bucket starts in `order` (`bucket_start [n +
//! 1]`), and with packed rows the same three sorted by position (the position embedding's
//! backward, GPT-2's `wpe`, sums the rows of each position as the token embedding's sums those of
//! each token). A batch is written into one of two pinned staging buffers and copied on the
//! compute stream, so the copy is ordered before the next forward and after the last backward
//! that read the previous batch.

use std::ops::Range;

use zeroflow_device::cuda::{CudaBuffer, CudaStream};
use zeroflow_device::{CudaDevice, Device, HostBuffer, HostMemory};

use crate::error::NnError;
use crate::kernels::encoder::check_tokens;
use crate::kernels::loss::check_targets;

#[derive(Debug)]
pub struct Tokens {
    n: usize,
    /// Whether the batches are packed rows, which carry positions.
    packed: bool,
    device_tokens: CudaBuffer<u32>,
    /// Two staging buffers, used in turn.
    staging: [HostBuffer<u32>; 2],
    next: usize,
    buckets: usize,
    position_buckets: usize,
}

impl Tokens {
    /// The buffers of micro-batches of `n` tokens, `packed` rows (with positions) or not.
    pub fn new(device: &CudaDevice, n: usize, packed: bool) -> Result<Self, NnError> {
        let len = Self::len_for(n, packed);
        Ok(Tokens {
            n,
            packed,
            device_tokens: device.alloc(len)?,
            staging: [
                device.alloc_host(len, HostMemory::Pinned)?,
                device.alloc_host(len, HostMemory::Pinned)?,
            ],
            next: 0,
            buckets: 0,
            position_buckets: 0,
        })
    }

    fn len_for(n: usize, packed: bool) -> usize {
        if packed { 9 * n + 2 } else { 5 * n + 1 }
    }

    /// Bytes of the device buffer for micro-batches of `n` tokens, `packed` rows or not.
    pub fn bytes_for(n: usize, packed: bool) -> usize {
        Self::len_for(n, packed) * size_of::<u32>()
    }

    /// The device buffer (inputs at 0, targets at n, packed rows' positions at 2n).
    pub fn buffer(&self) -> &CudaBuffer<u32> {
        &self.device_tokens
    }

    pub fn bytes(&self) -> usize {
        Self::bytes_for(self.n, self.packed)
    }

    /// Where the ids the batch's set-up writes end and the buckets sorted from them start.
    fn sorted_start(&self) -> usize {
        sorted_start(self.n, self.packed)
    }

    /// Tokens per micro-batch (of the inputs, and of the targets).
    pub fn tokens(&self) -> usize {
        self.n
    }

    /// The number of distinct input tokens of the last batch.
    pub fn buckets(&self) -> usize {
        self.buckets
    }

    /// The buckets of equal input tokens of the last batch.
    pub fn token_buckets(&self) -> Buckets {
        Buckets::at(self.sorted_start(), self.n, self.buckets)
    }

    /// The buckets of equal positions of the last batch (of packed rows).
    pub fn position_buckets(&self) -> Option<Buckets> {
        let start = self.sorted_start() + Buckets::len_for(self.n);
        self.packed.then(|| Buckets::at(start, self.n, self.position_buckets))
    }

    /// Checks the ids against the vocabulary, sorts the rows by input token (and by position,
    /// with packed rows), and queues the upload on `stream`. `positions` must be given with
    /// packed rows only, and have been checked by the plan ([`crate::Plan::check_positions`]):
    /// the kernels read the position embedding at them.
    pub fn set(
        &mut self,
        device: &CudaDevice,
        stream: &CudaStream,
        (inputs, targets): (&[u32], &[u32]),
        positions: Option<&[u32]>,
        vocab: usize,
    ) -> Result<(), NnError> {
        let n = self.n;
        let given: &[(&'static str, &[u32])] = match positions {
            Some(positions) if self.packed => {
                &[("inputs", inputs), ("targets", targets), ("positions", positions)]
            }
            None if !self.packed => &[("inputs", inputs), ("targets", targets)],
            Some(_) => {
                return Err(NnError::Batch(
                    "positions were given for rows that are not packed".into(),
                ));
            }
            None => {
                return Err(NnError::Batch("packed rows need their tokens' positions".into()));
            }
        };
        for &(what, tokens) in given {
            if tokens.len() != n {
                return Err(NnError::Length { what, expected: n, found: tokens.len() });
            }
        }
        check_tokens(inputs, vocab)
            .map_err(|reason| NnError::Kernel { kernel: "encoder_forward", reason })?;
        check_targets(targets, vocab)
            .map_err(|reason| NnError::Kernel { kernel: "softmax_xent_forward", reason })?;
        // Writing the staging buffer first waits for the copy that last read it (two batches
        // ago; see below), so the host never overwrites a buffer a copy is still reading.
        let sorted_start = self.sorted_start();
        let staging = &mut self.staging[self.next];
        let (head, sorted) = staging.split_at_mut(sorted_start);
        for (slot, (_, ids)) in head.chunks_mut(n).zip(given) {
            slot.copy_from_slice(ids);
        }
        let (by_token, by_position) = sorted.split_at_mut(Buckets::len_for(n));
        self.buckets = sort_into_buckets(inputs, by_token);
        if let Some(positions) = positions {
            self.position_buckets = sort_into_buckets(positions, by_position);
        }
        let staging = &self.staging[self.next];
        let copy = device.copy_h2d(stream, staging, 0..staging.len(), &self.device_tokens, 0)?;
        // The token is let go without waiting (that would wait for all the work queued before the
        // copy on the compute stream). The buffer remembers the copy, and the next write into it,
        // two batches from now, waits for it first: the device contract's rule for a token that
        // is not waited on.
        std::mem::forget(copy);
        self.next = 1 - self.next;
        Ok(())
    }
}

/// Where the buckets sorted from a batch start in the token buffer: after the inputs, the targets
/// and (packed rows) the positions.
fn sorted_start(n: usize, packed: bool) -> usize {
    if packed { 3 * n } else { 2 * n }
}

/// Where the rows of a batch sorted into buckets of equal ids (input tokens, or positions) lie in
/// the token buffer, and how many buckets there are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Buckets {
    /// The rows, sorted by id (rows in order within an id).
    pub order: Range<usize>,
    /// The id of each bucket (the first `count` used).
    pub id: Range<usize>,
    /// Where each bucket starts in `order` (the first `count + 1` used; the last is n).
    pub start: Range<usize>,
    pub count: usize,
}

impl Buckets {
    fn at(offset: usize, n: usize, count: usize) -> Self {
        Buckets {
            order: offset..offset + n,
            id: offset + n..offset + 2 * n,
            start: offset + 2 * n..offset + 3 * n + 1,
            count,
        }
    }

    /// Elements of the buckets of `n` rows.
    fn len_for(n: usize) -> usize {
        3 * n + 1
    }
}

/// Fills `out` (`[order n | bucket_token n | bucket_start n + 1]`) with the rows sorted by input
/// token (rows in order within a token), the token of each bucket of equal tokens and where each
/// bucket starts in `order` (the last entry is n); returns the number of buckets. The same for any
/// ids (a packed batch's positions).
fn sort_into_buckets(inputs: &[u32], out: &mut [u32]) -> usize {
    let n = inputs.len();
    let (order, rest) = out.split_at_mut(n);
    let (bucket_token, bucket_start) = rest.split_at_mut(n);
    for (row, slot) in order.iter_mut().enumerate() {
        *slot = row as u32;
    }
    order.sort_unstable_by_key(|&row| (inputs[row as usize], row));
    let mut buckets = 0;
    for (k, &row) in order.iter().enumerate() {
        let token = inputs[row as usize];
        if buckets == 0 || bucket_token[buckets - 1] != token {
            bucket_token[buckets] = token;
            bucket_start[buckets] = k as u32;
            buckets += 1;
        }
    }
    bucket_start[buckets] = n as u32;
    buckets
}

#[cfg(test)]
mod tests {
    use super::{Buckets, Tokens, sort_into_buckets, sorted_start};

    /// The parts of the token buffer follow each other without gaps or overlaps and end at its
    /// length: inputs, targets, (positions), the token buckets, (the position buckets).
    #[test]
    fn the_token_buffer_holds_its_parts_end_to_end() {
        let n = 12;
        for packed in [false, true] {
            let tokens = Buckets::at(sorted_start(n, packed), n, 0);
            assert_eq!(tokens.order.start, if packed { 3 * n } else { 2 * n });
            assert_eq!((tokens.order.end, tokens.id.end), (tokens.id.start, tokens.start.start));
            let end = if packed {
                let positions = Buckets::at(tokens.start.end, n, 0);
                assert_eq!(positions.order.start, tokens.start.end);
                assert_eq!(positions.start.len(), n + 1);
                positions.start.end
            } else {
                tokens.start.end
            };
            assert_eq!(end, Tokens::len_for(n, packed));
        }
    }

    /// Every row lands in the bucket of its token, once, in row order within the bucket.
    #[test]
    fn rows_are_bucketed_by_token_in_row_order() {
        let inputs = [5, 1, 5, 3, 1, 5, 0];
        let n = inputs.len();
        let mut out = vec![u32::MAX; 3 * n + 1];
        let buckets = sort_into_buckets(&inputs, &mut out);
        let (order, rest) = out.split_at(n);
        let (tokens, starts) = rest.split_at(n);
        assert_eq!(buckets, 4);
        assert_eq!(&tokens[..buckets], &[0, 1, 3, 5]);
        assert_eq!(&starts[..=buckets], &[0, 1, 3, 4, 7]);
        assert_eq!(order, &[6, 1, 4, 3, 0, 2, 5]);
    }
}
