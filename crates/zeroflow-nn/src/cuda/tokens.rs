//! The token ids of the current micro-batch on the GPU, and the host-side sort that makes the
//! token-embedding gradient deterministic.
//!
//! One u32 device buffer holds, in order: inputs `[n]`, targets `[n]`, then for the embedding
//! backward the rows sorted by input token (`order [n]`), the token of each bucket of equal
//! tokens (`bucket_token [n]`, the first `buckets` used) and where each bucket starts in `order`
//! (`bucket_start [n + 1]`). A batch is written into one of two pinned staging buffers and copied
//! on the compute stream, so the copy is ordered before the next forward and after the last
//! backward that read the previous batch.

use std::ops::Range;

use zeroflow_device::cuda::{CudaBuffer, CudaStream};
use zeroflow_device::{CudaDevice, Device, HostBuffer, HostMemory};

use crate::error::NnError;
use crate::kernels::encoder::check_tokens;
use crate::kernels::loss::check_targets;

#[derive(Debug)]
pub struct Tokens {
    n: usize,
    device_tokens: CudaBuffer<u32>,
    /// Two staging buffers, used in turn.
    staging: [HostBuffer<u32>; 2],
    next: usize,
    buckets: usize,
}

impl Tokens {
    pub fn new(device: &CudaDevice, n: usize) -> Result<Self, NnError> {
        let len = Self::len_for(n);
        Ok(Tokens {
            n,
            device_tokens: device.alloc(len)?,
            staging: [
                device.alloc_host(len, HostMemory::Pinned)?,
                device.alloc_host(len, HostMemory::Pinned)?,
            ],
            next: 0,
            buckets: 0,
        })
    }

    fn len_for(n: usize) -> usize {
        5 * n + 1
    }

    /// Bytes of the device buffer for micro-batches of `n` tokens.
    pub fn bytes_for(n: usize) -> usize {
        Self::len_for(n) * size_of::<u32>()
    }

    /// The device buffer (inputs at 0, targets at n).
    pub fn buffer(&self) -> &CudaBuffer<u32> {
        &self.device_tokens
    }

    pub fn bytes(&self) -> usize {
        Self::bytes_for(self.n)
    }

    /// Tokens per micro-batch (of the inputs, and of the targets).
    pub fn tokens(&self) -> usize {
        self.n
    }

    /// The number of distinct input tokens of the last batch.
    pub fn buckets(&self) -> usize {
        self.buckets
    }

    pub fn order(&self) -> Range<usize> {
        2 * self.n..3 * self.n
    }

    pub fn bucket_token(&self) -> Range<usize> {
        3 * self.n..4 * self.n
    }

    pub fn bucket_start(&self) -> Range<usize> {
        4 * self.n..5 * self.n + 1
    }

    /// Checks the ids against the vocabulary, sorts the rows by input token, and queues the upload
    /// on `stream`.
    pub fn set(
        &mut self,
        device: &CudaDevice,
        stream: &CudaStream,
        inputs: &[u32],
        targets: &[u32],
        vocab: usize,
    ) -> Result<(), NnError> {
        let n = self.n;
        for (what, tokens) in [("inputs", inputs), ("targets", targets)] {
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
        let staging = &mut self.staging[self.next];
        let (head, sorted) = staging.split_at_mut(2 * n);
        head[..n].copy_from_slice(inputs);
        head[n..].copy_from_slice(targets);
        self.buckets = sort_into_buckets(inputs, sorted);
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

/// Fills `out` (`[order n | bucket_token n | bucket_start n + 1]`) with the rows sorted by input
/// token (rows in order within a token), the token of each bucket of equal tokens and where each
/// bucket starts in `order` (the last entry is n); returns the number of buckets.
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
    use super::sort_into_buckets;

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
