//! The embeddings' launches: GPT-2's encoder (token and position embedding) forward and
//! backward, plain and on packed rows, and the deterministic bucketed sum that is the token
//! embedding's gradient (GPT-2's, or a family's) and, on packed rows, the position embedding's.

use super::{LayerCtx, flag};
use crate::cuda::kernels::{THREADS, blocks_for};
use crate::cuda::schedule::Place;
use crate::cuda::tokens::Buckets;
use crate::error::NnError;

impl LayerCtx<'_> {
    /// [out, tokens, wte, wpe, (positions)]
    pub(super) fn encoder_forward(&self, a: &[Place], t: usize, c: usize) -> Result<(), NnError> {
        let rows = a[0].len / c;
        let vec = c.is_multiple_of(8) && self.aligned(&[&a[0], &a[2], &a[3]]);
        let work = if vec { rows * c / 8 } else { rows * c };
        if let Some(positions) = a.get(4) {
            let params = self
                .places(&[&a[0]], &[&a[1], &a[2], &a[3], positions])
                .u32(rows as u32)
                .u32(c as u32)
                .u32(flag(vec));
            let function = &self.kernels.encoder_forward_packed;
            // SAFETY: the parameters match `encoder_forward_packed(bf16_t* out, const u32*
            // tokens, const bf16_t* wte, const bf16_t* wpe, const u32* positions, u32 rows, u32 c,
            // u32 vec)`; it writes the `rows` rows of `c` of out and reads as many token ids and
            // positions (places of the token ids) and rows of wte and wpe: the token ids were
            // checked against the vocabulary on upload, and the positions by the plan
            // (`check_positions`: each at most its index in its row, so below `t`, the rows of
            // wpe the plain kernel reads).
            return unsafe { self.launch(function, blocks_for(work), THREADS, params) };
        }
        let params = self
            .places(&[&a[0]], &[&a[1], &a[2], &a[3]])
            .u32(rows as u32)
            .u32(t as u32)
            .u32(c as u32)
            .u32(flag(vec));
        // SAFETY: the parameters match `encoder_forward(bf16_t* out, const u32* tokens, const
        // bf16_t* wte, const bf16_t* wpe, u32 rows, u32 t, u32 c, u32 vec)`; it writes the `rows`
        // rows of `c` of out and reads as many token ids and rows of wte and wpe (the token ids
        // were checked against the vocabulary on upload).
        unsafe { self.launch(&self.kernels.encoder_forward, blocks_for(work), THREADS, params) }
    }

    /// [dwte, dwpe, dout, tokens, (positions)]
    pub(super) fn encoder_backward(&self, a: &[Place], t: usize, c: usize) -> Result<(), NnError> {
        let (dwte, dwpe, dout) = (&a[0], &a[1], &a[2]);
        self.token_embedding_backward(dwte, dout, c)?;
        if a.len() > 4 {
            // Packed rows: `dwpe[p] += Σ dout[row]` over the rows at position p, the buckets of
            // equal positions `set_packed_batch` sorted on the host.
            let buckets = self.tokens.position_buckets().ok_or_else(|| NnError::Kernel {
                kernel: "encoder_backward",
                reason: "a packed launch, but the batch's token buffer has no positions".into(),
            })?;
            return self.bucketed_embedding_backward(dwpe, dout, c, &buckets);
        }
        let batch = a[2].len / c / t;
        let params = self.places(&[dwpe], &[dout]).u32(batch as u32).u32(t as u32).u32(c as u32);
        let grid = blocks_for(t * c);
        // SAFETY: the parameters match `encoder_backward_wpe(bf16_t* dwpe, const bf16_t* dout,
        // u32 batch, u32 t, u32 c)`: one thread per element of the `t` rows of dwpe, summing the
        // `batch` rows of dout at that position.
        unsafe { self.launch(&self.kernels.encoder_backward_wpe, grid, THREADS, params) }
    }

    /// `dwte[token] += Σ dout[row]` over the rows whose input token is `token`, for rows of `c`
    /// (`dout` holds one per input token of the batch), deterministically: the rows of each token
    /// are summed in order by one thread per column (the buckets `set_batch` sorted on the host).
    /// A token embedding's backward, GPT-2's (with its position embedding's) or a family's.
    pub fn token_embedding_backward(
        &self,
        dwte: &Place,
        dout: &Place,
        c: usize,
    ) -> Result<(), NnError> {
        self.bucketed_embedding_backward(dwte, dout, c, &self.tokens.token_buckets())
    }

    /// `dw[id] += Σ dout[row]` over the rows of each of `buckets` (the rows of the batch sorted
    /// by input token, or by position), one thread per column of a bucket.
    fn bucketed_embedding_backward(
        &self,
        dw: &Place,
        dout: &Place,
        c: usize,
        buckets: &Buckets,
    ) -> Result<(), NnError> {
        if dout.len != self.tokens.tokens() * c {
            return Err(NnError::Kernel {
                kernel: "token_embedding_backward",
                reason: format!(
                    "dout holds {} elements, not {} tokens × {c}",
                    dout.len,
                    self.tokens.tokens()
                ),
            });
        }
        let tokens = self.tokens.buffer();
        let params = self
            .places(&[dw], &[dout])
            .ptr(tokens, buckets.order.start)
            .ptr(tokens, buckets.id.start)
            .ptr(tokens, buckets.start.start)
            .u32(c as u32);
        let grid = (buckets.count as u32, c.div_ceil(THREADS as usize) as u32);
        // SAFETY: the parameters match `encoder_backward_wte(bf16_t* dwte, const bf16_t* dout,
        // const u32* order, const u32* bucket_token, const u32* bucket_start, u32 c)`; block
        // (bucket, ·) adds the rows of dout of its bucket (rows below the batch's tokens, which
        // dout holds, checked above) to its id's row of dw: a token of the batch's inputs
        // (checked against the vocabulary on upload, and dw the token embedding's gradient place)
        // or a position (checked by the plan: below `t`, and dw the position embedding's
        // gradient, `t` rows at least), the buckets being the ones `Tokens::set` sorted for this
        // batch.
        unsafe { self.launch(&self.kernels.encoder_backward_wte, grid, THREADS, params) }
    }
}
