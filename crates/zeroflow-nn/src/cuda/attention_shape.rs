//! The shape both CUDA attentions take ([`CudaAttention`](super::attention::CudaAttention),
//! [`FlashAttention`](super::flash::FlashAttention)), its sizes, and the checks of the caller's
//! tensors they share.

use zeroflow_device::DeviceError;

use crate::kernels::AttentionShape;

/// The shape of one attention: `batch` sequences of `seq` tokens, `c` channels in `n_head` query
/// heads of `head_size`, and `n_kv_head` key/value heads (a divisor of `n_head`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    pub(super) batch: usize,
    pub(super) seq: usize,
    pub(super) c: usize,
    pub(super) n_head: usize,
    pub(super) n_kv_head: usize,
    pub(super) head_size: usize,
}

impl Shape {
    /// The shape, or an error (made by `invalid`) unless every size is positive, the channels a
    /// multiple of the heads and the key/value heads a divisor of the query heads.
    pub(super) fn new(
        batch: usize,
        attention: AttentionShape,
        invalid: fn(String) -> DeviceError,
    ) -> Result<Self, DeviceError> {
        let AttentionShape { t: seq, c, n_head, n_kv_head } = attention;
        if batch == 0 || seq == 0 || n_head == 0 || c == 0 || !c.is_multiple_of(n_head) {
            return Err(invalid(format!(
                "batch {batch}, seq {seq}, channels {c}, heads {n_head}: every size must be \
                 positive and the channels a multiple of the heads"
            )));
        }
        if n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) {
            return Err(invalid(format!(
                "{n_kv_head} key/value heads for {n_head} query heads: the key/value heads must \
                 divide the query heads"
            )));
        }
        Ok(Shape { batch, seq, c, n_head, n_kv_head, head_size: c / n_head })
    }

    /// Query heads per key/value head.
    pub(super) fn group(&self) -> usize {
        self.n_head / self.n_kv_head
    }

    /// Channels of the keys (and of the values): `n_kv_head · head_size`.
    pub(super) fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_size
    }

    /// The width of a `qkv` row: `c + 2 · kv_width`.
    pub(super) fn qkv_width(&self) -> usize {
        self.c + 2 * self.kv_width()
    }

    /// An error (made by `invalid`) unless batch · seq and the qkv width fit the kernels' 32-bit
    /// sizes (they index with 32-bit sizes and 64-bit offsets).
    pub(super) fn check_32_bit_sizes(
        &self,
        invalid: fn(String) -> DeviceError,
    ) -> Result<(), DeviceError> {
        to_u32(self.batch * self.seq, "batch · seq", invalid)?;
        to_u32(self.qkv_width(), "the qkv width", invalid)?;
        Ok(())
    }

    /// Elements of `[B, T, C]`: of the head-major query tensors `[batch, n_head, seq, head_size]`
    /// and of `out`.
    pub(super) fn heads_len(&self) -> usize {
        self.batch * self.seq * self.c
    }

    /// Elements of the head-major key/value tensors `[batch, n_kv_head, seq, head_size]`.
    pub(super) fn kv_heads_len(&self) -> usize {
        self.batch * self.seq * self.kv_width()
    }

    /// Elements of `qkv [B, T, W]`.
    pub(super) fn qkv_len(&self) -> usize {
        self.batch * self.seq * self.qkv_width()
    }

    /// Elements of `att [batch, n_head, seq, seq]`.
    pub(super) fn att_len(&self) -> usize {
        self.batch * self.n_head * self.seq * self.seq
    }

    /// One per (sequence, head, query): the rows of `att`, the elements of flash's `lse` and
    /// `delta`, `[B, NH, T]`.
    pub(super) fn query_rows(&self) -> usize {
        self.batch * self.n_head * self.seq
    }

    /// `1 / sqrt(head_size)`, the scale of the scores.
    pub(super) fn scale(&self) -> f32 {
        1.0 / (self.head_size as f32).sqrt()
    }
}

/// An error (made by `invalid`) unless a caller's tensor `what`, of `len` elements, holds at least
/// `needed` and lies on the attention's GPU (`on_device`).
pub(super) fn check_tensor(
    (what, len, on_device): (&str, usize, bool),
    needed: usize,
    invalid: fn(String) -> DeviceError,
) -> Result<(), DeviceError> {
    if !on_device {
        return Err(invalid(format!("{what} is memory of another GPU than the attention's")));
    }
    if len < needed {
        return Err(invalid(format!(
            "{what} holds {len} elements, fewer than the {needed} of this shape"
        )));
    }
    Ok(())
}

/// `value` as a kernel's `u32` argument, or an error (made by `invalid`) naming what is too large.
pub(super) fn to_u32(
    value: usize,
    what: &str,
    invalid: fn(String) -> DeviceError,
) -> Result<u32, DeviceError> {
    u32::try_from(value)
        .map_err(|_| invalid(format!("{what} = {value} does not fit the kernels' 32-bit sizes")))
}
