//! A Llama-family model with a key/value cache on the GPU ([`CudaLlamaDecoder`]): zeroflow-nn's
//! [`CachedDecoder`] of the family's step ([`CudaLlamaStep`]), a [`Decoder`] in bf16, the twin
//! of the CPU's [`LlamaDecoder`](crate::LlamaDecoder). A step runs only its token rows: the
//! embedding of those rows gathered on the host from an f32 copy of the (bf16-rounded)
//! embedding and uploaded; per layer the family's kernels (RMSNorm, Qwen3's q/k norm over rows
//! of `head_dim`, RoPE, SwiGLU; zeroflow-nn's residual) and cuBLASLt matmuls with `M = rows`
//! (the `[out, in]` weights, a bias in the epilogue where the architecture has one); RoPE reads
//! a table made on the host for the step, one entry per row at that row's own position (the
//! kernel's `t` is the step's row count, so row `r` takes entry `r`); attention over the cache
//! ([`CudaKvCache`]); the final norm and the LM head only on the rows whose logits are asked
//! for, and those logits to the host (f32) for sampling.

use std::ops::Range;
use std::sync::Arc;

use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{Float, bf16};
use zeroflow_device::cuda::blas::{Blas, Epilogue, Matmul, MatmulOperands, Operand};
use zeroflow_device::cuda::{CudaBuffer, CudaFunction, CudaStream, KernelParams};
use zeroflow_device::{CudaDevice, Device, DeviceBuffer, HostBuffer, HostMemory, StreamKind};
use zeroflow_nn::cuda::cached::{CachedDecoder, CachedForward};
use zeroflow_nn::cuda::decode::CudaKvCache;
use zeroflow_nn::cuda::kernels::{NnKernels, ROWS_PER_BLOCK, THREADS, blocks_for};
#[cfg(doc)]
use zeroflow_nn::infer::Decoder;
use zeroflow_nn::infer::decode_attention::DeviceCacheLayout;
use zeroflow_nn::infer::{CachedAttention, StepRows};

use super::kernels::sources;
use crate::config::LlamaConfig;
use crate::error::{LlamaConfigError, LlamaError};
use crate::ranges::{LayerParams, ParamRanges};
use crate::rope::RopeFreqs;

/// The family's kernels a decode step runs.
#[derive(Debug)]
struct Kernels {
    rmsnorm_forward: CudaFunction,
    rope_forward: CudaFunction,
    swiglu_forward: CudaFunction,
    residual_forward: CudaFunction,
}

/// The GPU buffers of one batch, for steps of at most `max_rows` rows ([`CudaLlamaStep`]'s
/// [`CachedForward::Batch`]).
#[derive(Debug)]
pub struct Batch {
    max_rows: usize,
    cache: CudaKvCache,
    /// `[max_rows, d]`: the residual stream in, between the halves of a layer, the normalised
    /// rows, the projections' outputs.
    hidden: CudaBuffer<bf16>,
    mid: CudaBuffer<bf16>,
    normed: CudaBuffer<bf16>,
    projected: CudaBuffer<bf16>,
    /// `[max_rows, q_dim]` and `[max_rows, kv_dim]`: q, k, v before RoPE; the attention's output.
    q: CudaBuffer<bf16>,
    k: CudaBuffer<bf16>,
    v: CudaBuffer<bf16>,
    atty: CudaBuffer<bf16>,
    /// `[max_rows, qkv_width]`: RoPE's packed rows, which the cache reads.
    qkv: CudaBuffer<bf16>,
    /// `[max_rows, ffn]`: gate, up, SwiGLU.
    gate: CudaBuffer<bf16>,
    up: CudaBuffer<bf16>,
    swiglu: CudaBuffer<bf16>,
    /// RMSNorm's statistics (`max_rows · n_head` rows at most: the q norm's), not read.
    rstd: CudaBuffer<f32>,
    /// The step's rotary table, `[cos rows · hd/2 | sin rows · hd/2]`.
    table: CudaBuffer<f32>,
    /// `[batch, vocab]`: the logits of a step's asked-for rows.
    logits: CudaBuffer<bf16>,
    embedding: HostBuffer<bf16>,
    table_host: HostBuffer<f32>,
    logits_host: HostBuffer<bf16>,
}

/// A Llama-family model on a GPU with the key/value cache of the current batch: a [`Decoder`]
/// (make one with `CachedDecoder::new(CudaLlamaStep::new(…)?)`).
pub type CudaLlamaDecoder = CachedDecoder<CudaLlamaStep>;

/// A Llama-family model's forward over a step's rows on the GPU: the weights, the kernels and
/// the buffers of a batch, which [`CudaLlamaDecoder`] runs.
#[derive(Debug)]
pub struct CudaLlamaStep {
    device: CudaDevice,
    blas: Arc<Blas>,
    config: LlamaConfig,
    params: ParamRanges,
    weights: CudaBuffer<bf16>,
    /// The embedding as the GPU holds it (bf16), for a step's rows on the host.
    embed: Vec<bf16>,
    /// RoPE's inverse frequencies, one per pair.
    inv_freq: Vec<f64>,
    kernels: Kernels,
}

impl CudaLlamaStep {
    /// Uploads `weights` (the flat parameters of `layout`, f32 or bf16) to the GPU in bf16 and
    /// loads the kernels; `blas` is shared with the compute stream's other users.
    pub fn new<W: Float>(
        device: &CudaDevice,
        blas: Arc<Blas>,
        config: &LlamaConfig,
        layout: &FlatLayout,
        weights: &[W],
    ) -> Result<Self, LlamaError> {
        if weights.len() != layout.padded_len() {
            let (expected, found) = (layout.padded_len(), weights.len());
            return Err(LlamaError::Length { what: "parameter buffer", expected, found });
        }
        let weights = device.upload_rounded(weights)?;
        CudaLlamaStep::on_device(device, blas, config, layout, weights)
    }

    /// [`CudaLlamaStep::new`] of weights already on the GPU (the flat parameters of `layout`
    /// in bf16): the embedding's rows the host reads are downloaded from them.
    pub fn on_device(
        device: &CudaDevice,
        blas: Arc<Blas>,
        config: &LlamaConfig,
        layout: &FlatLayout,
        weights: CudaBuffer<bf16>,
    ) -> Result<Self, LlamaError> {
        let params = ParamRanges::new(config, layout)?;
        if weights.len() != layout.padded_len() {
            let (expected, found) = (layout.padded_len(), weights.len());
            return Err(LlamaError::Length { what: "parameter buffer", expected, found });
        }
        if !config.head_dim.is_multiple_of(2) {
            return Err(LlamaError::Config(LlamaConfigError::Invalid {
                field: "head_dim".into(),
                reason: format!("{} is odd; rotary embeddings rotate pairs", config.head_dim),
            }));
        }
        // The host's embedding: the GPU's bf16 values.
        let embed = device.download_range(&weights, params.embed.clone())?;
        let freqs = RopeFreqs {
            head_dim: config.head_dim,
            theta: config.rope_theta,
            scaling: config.rope_scaling.clone(),
        };
        let [rmsnorm, rope, pointwise] =
            sources().map(|(name, source)| device.load_module(name, &source));
        let (rmsnorm, rope, pointwise) = (rmsnorm?, rope?, pointwise?);
        let kernels = Kernels {
            rmsnorm_forward: rmsnorm.function("rmsnorm_forward")?,
            rope_forward: rope.function("rope_forward")?,
            swiglu_forward: pointwise.function("swiglu_forward")?,
            residual_forward: NnKernels::load(device)?.residual_forward,
        };
        Ok(CudaLlamaStep {
            device: device.clone(),
            blas,
            config: config.clone(),
            weights,
            params,
            embed,
            inv_freq: freqs.inv_freq(),
            kernels,
        })
    }

    /// Each row's embedding into `hidden`, and the step's rotary table (row `r` at its position).
    fn upload_step(
        &self,
        b: &mut Batch,
        tokens: &[u32],
        positions: &[usize],
    ) -> Result<(), LlamaError> {
        let (d, vocab, stream) = (self.config.hidden_size, self.config.vocab_size, self.stream());
        if let Some(token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            let reason = format!("token {token} is outside the vocabulary ({vocab})");
            return Err(LlamaError::Kernel { kernel: "embedding_forward", reason });
        }
        for (row, &token) in b.embedding.chunks_mut(d).zip(tokens) {
            row.copy_from_slice(&self.embed[token as usize * d..][..d]);
        }
        let n = tokens.len();
        self.device.copy_h2d(stream, &b.embedding, 0..n * d, &b.hidden, 0)?.wait()?;
        // As `rope_table` makes the training table: f32(inv_freq) · f32(position), in f32.
        let half = self.inv_freq.len();
        let (cosines, sines) = b.table_host[..2 * n * half].split_at_mut(n * half);
        for (r, &pos) in positions.iter().enumerate() {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let angle = f as f32 * pos as f32;
                (cosines[r * half + i], sines[r * half + i]) = (angle.cos(), angle.sin());
            }
        }
        self.device.copy_h2d(stream, &b.table_host, 0..2 * n * half, &b.table, 0)?.wait()?;
        Ok(())
    }

    /// Layer `index` on `n` rows: `hidden` in, `hidden` out (through `mid`).
    fn layer(&self, b: &Batch, index: usize, p: &LayerParams, n: usize) -> Result<(), LlamaError> {
        let c = &self.config;
        let (d, ffn, hd, stream) = (c.hidden_size, c.intermediate_size, c.head_dim, self.stream());
        let (q_dim, kv_dim, width) = (c.q_dim(), c.kv_dim(), attention(c).qkv_width());
        self.rmsnorm((&b.hidden, &b.normed, &b.rstd), &p.input_norm, (n, d))?;
        self.linear(&b.normed, (&p.q_weight, p.q_bias.as_ref()), &b.q, (n, d, q_dim))?;
        self.linear(&b.normed, (&p.k_weight, p.k_bias.as_ref()), &b.k, (n, d, kv_dim))?;
        self.linear(&b.normed, (&p.v_weight, p.v_bias.as_ref()), &b.v, (n, d, kv_dim))?;
        if let Some((q_norm, k_norm)) = &p.qk_norm {
            // In place: each warp reads its row before it writes it.
            self.rmsnorm((&b.q, &b.q, &b.rstd), q_norm, (n * c.num_attention_heads, hd))?;
            self.rmsnorm((&b.k, &b.k, &b.rstd), k_norm, (n * c.num_key_value_heads, hd))?;
        }
        self.rope(b, n)?;
        b.cache.write(stream, index, b.qkv.slice(0..n * width), width)?;
        let atty = b.atty.slice_mut(0..n * q_dim);
        b.cache.attend(stream, index, b.qkv.slice(0..n * width), width, atty, q_dim)?;
        self.linear(&b.atty, (&p.o_weight, p.o_bias.as_ref()), &b.projected, (n, q_dim, d))?;
        self.pointwise(&self.kernels.residual_forward, &b.mid, [&b.hidden, &b.projected], n * d)?;
        self.rmsnorm((&b.mid, &b.normed, &b.rstd), &p.post_norm, (n, d))?;
        self.linear(&b.normed, (&p.gate, None), &b.gate, (n, d, ffn))?;
        self.linear(&b.normed, (&p.up, None), &b.up, (n, d, ffn))?;
        self.pointwise(&self.kernels.swiglu_forward, &b.swiglu, [&b.gate, &b.up], n * ffn)?;
        self.linear(&b.swiglu, (&p.down, None), &b.projected, (n, ffn, d))?;
        self.pointwise(&self.kernels.residual_forward, &b.hidden, [&b.mid, &b.projected], n * d)
    }

    /// `out[rows, oc] = inp[rows, c] · weight[oc, c]ᵀ (+ bias)`.
    fn linear(
        &self,
        inp: &CudaBuffer<bf16>,
        (weight, bias): (&Range<usize>, Option<&Range<usize>>),
        out: &CudaBuffer<bf16>,
        (rows, c, oc): (usize, usize, usize),
    ) -> Result<(), LlamaError> {
        let w = &self.weights;
        let x = Operand::of(inp, 0);
        let operands =
            MatmulOperands::row_major(x, Operand::of(w, weight.start), Operand::of(out, 0));
        let problem = Matmul::linear_forward(rows, c, oc);
        let (problem, operands) = match bias {
            Some(bias) => (
                problem.with_epilogue(Epilogue::Bias),
                operands.with_bias(Operand::of(w, bias.start)),
            ),
            None => (problem, operands),
        };
        Ok(self.blas.matmul(self.stream(), &problem, operands)?)
    }

    /// RMSNorm of `rows` rows of `c` of `inp` into `out` (which may be `inp`).
    fn rmsnorm(
        &self,
        (inp, out, rstd): (&CudaBuffer<bf16>, &CudaBuffer<bf16>, &CudaBuffer<f32>),
        weight: &Range<usize>,
        (rows, c): (usize, usize),
    ) -> Result<(), LlamaError> {
        let w = &self.weights;
        let addresses = [out.address(0), inp.address(0), w.address(weight.start)];
        let vec = c.is_multiple_of(8) && addresses.iter().all(|a| a.is_multiple_of(16));
        let params = KernelParams::new()
            .ptr(out, 0)
            .ptr(rstd, 0)
            .ptr(inp, 0)
            .ptr(w, weight.start)
            .u32(rows as u32)
            .u32(c as u32)
            .u32(u32::from(vec))
            .f32(self.config.rms_norm_eps as f32);
        let grid = rows.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        // SAFETY: the parameters match `rmsnorm_forward(bf16_t* out, float* rstd, const bf16_t*
        // inp, const bf16_t* weight, u32 rows, u32 c, u32 vec, float eps)`; each warp normalises
        // one of `rows` rows of `c` of inp into the same row of out (`rows · c` is at most the
        // step's rows times a buffer's width: the hidden rows, or q's and k's rows of head_dim),
        // writing its rstd (`max_rows · n_head` entries, the most rows a norm has) and reading
        // `c` of the weight; the whole row is read into registers before it is written, so out
        // may be inp; `vec` only where `c` is a multiple of 8 and the pointers 16-byte aligned.
        unsafe {
            let function = &self.kernels.rmsnorm_forward;
            Ok(self.device.launch(self.stream(), function, grid, THREADS, 0, &params)?)
        }
    }

    /// RoPE of the step's `n` rows of q and k at their positions, packed with v into `qkv`.
    fn rope(&self, b: &Batch, n: usize) -> Result<(), LlamaError> {
        let c = &self.config;
        let (half, kv_width) = (c.head_dim / 2, c.kv_dim());
        let per_row = (c.num_attention_heads + c.num_key_value_heads) * half + kv_width;
        let params = KernelParams::new()
            .ptr(&b.qkv, 0)
            .ptr(&b.q, 0)
            .ptr(&b.k, 0)
            .ptr(&b.v, 0)
            .ptr(&b.table, 0)
            .u32(n as u32)
            .u32(n as u32)
            .u32(c.num_attention_heads as u32)
            .u32(c.num_key_value_heads as u32)
            .u32(c.head_dim as u32);
        // SAFETY: the parameters match `rope_forward(bf16_t* qkv, const bf16_t* q, const bf16_t*
        // k, const bf16_t* v, const float* table, u32 rows, u32 t, u32 n_head, u32 n_kv_head,
        // u32 head_dim)`; it writes `n` rows of the qkv width of qkv and reads `n` rows of q (of
        // q_dim), k and v (of kv_dim), all buffers of `max_rows ≥ n` rows of those widths, and
        // with `t = n` row `r` reads entries `r · hd/2 ..` of the cosines and the sines, the
        // `2 · n · hd/2` entries `upload_step` wrote into the table (of `max_rows · hd`).
        unsafe {
            let (function, grid) = (&self.kernels.rope_forward, blocks_for(n * per_row));
            Ok(self.device.launch(self.stream(), function, grid, THREADS, 0, &params)?)
        }
    }

    /// The element-wise `function(out, a, b, n, vec)` over the first `n` elements.
    fn pointwise(
        &self,
        function: &CudaFunction,
        out: &CudaBuffer<bf16>,
        [a, b]: [&CudaBuffer<bf16>; 2],
        n: usize,
    ) -> Result<(), LlamaError> {
        let vec = [out, a, b].iter().all(|buf| buf.address(0).is_multiple_of(16));
        let params = KernelParams::new().ptr(out, 0).ptr(a, 0).ptr(b, 0);
        let params = params.u64(n as u64).u32(u32::from(vec));
        let work = if vec { n / 8 + n % 8 } else { n };
        // SAFETY: the parameters match `residual_forward(bf16_t* out, const bf16_t* a, const
        // bf16_t* b, u64 n, u32 vec)` and `swiglu_forward(bf16_t* out, const bf16_t* gate, const
        // bf16_t* up, u64 n, u32 vec)`, the two this is called with; the grid-stride loop touches
        // elements `0..n` of each buffer, all of at least `n` (`n` is the step's rows times the
        // width of buffers of `max_rows` rows); `vec` only where every pointer is 16-byte
        // aligned.
        unsafe {
            Ok(self.device.launch(
                self.stream(),
                function,
                blocks_for(work),
                THREADS,
                0,
                &params,
            )?)
        }
    }
}

/// Grouped-query attention over `n_head · head_dim` query channels.
fn attention(config: &LlamaConfig) -> CachedAttention {
    CachedAttention {
        n_head: config.num_attention_heads,
        n_kv_head: config.num_key_value_heads,
        head_dim: config.head_dim,
    }
}

impl CachedForward for CudaLlamaStep {
    type Batch = Batch;
    type Error = LlamaError;

    fn attention(&self) -> CachedAttention {
        attention(&self.config)
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// As the CPU decoder's: `max_position_embeddings`, or the sliding window where shorter.
    fn max_positions(&self) -> usize {
        let max = self.config.max_position_embeddings;
        self.config.sliding_window.map_or(max, |window| window.min(max))
    }

    fn stream(&self) -> &CudaStream {
        self.device.stream(StreamKind::Compute)
    }

    fn batch_error(reason: String) -> LlamaError {
        LlamaError::Batch(reason)
    }

    fn allocate(
        &self,
        batch: usize,
        capacity: usize,
        max_rows: usize,
    ) -> Result<Batch, LlamaError> {
        let c = &self.config;
        let shape = attention(c);
        let layout = DeviceCacheLayout { shape, batch, capacity };
        let cache = CudaKvCache::new(&self.device, c.num_hidden_layers, layout, max_rows)?;
        let d = &self.device;
        let rows = |width: usize| d.alloc::<bf16>(max_rows * width);
        let (hidden, ffn) = (c.hidden_size, c.intermediate_size);
        Ok(Batch {
            max_rows,
            cache,
            hidden: rows(hidden)?,
            mid: rows(hidden)?,
            normed: rows(hidden)?,
            projected: rows(hidden)?,
            q: rows(c.q_dim())?,
            k: rows(c.kv_dim())?,
            v: rows(c.kv_dim())?,
            atty: rows(c.q_dim())?,
            qkv: rows(shape.qkv_width())?,
            gate: rows(ffn)?,
            up: rows(ffn)?,
            swiglu: rows(ffn)?,
            rstd: d.alloc::<f32>(max_rows * c.num_attention_heads.max(1))?,
            table: d.alloc::<f32>(max_rows * c.head_dim)?,
            logits: d.alloc::<bf16>(batch * c.vocab_size)?,
            embedding: d.alloc_host::<bf16>(max_rows * hidden, HostMemory::Pageable)?,
            table_host: d.alloc_host::<f32>(max_rows * c.head_dim, HostMemory::Pageable)?,
            logits_host: d.alloc_host::<bf16>(batch * c.vocab_size, HostMemory::Pageable)?,
        })
    }

    fn cache(batch: &Batch) -> (&CudaKvCache, usize) {
        (&batch.cache, batch.max_rows)
    }

    fn run(&self, b: &mut Batch, step: &StepRows) -> Result<Vec<f32>, LlamaError> {
        let StepRows { tokens, rows, logits_of } = step;
        let (n, d, vocab, stream) =
            (rows.len(), self.config.hidden_size, self.config.vocab_size, self.stream());
        if n > b.max_rows || logits_of.len() * vocab > b.logits.len() {
            return Err(LlamaError::Batch(format!("{n} rows pass the batch's {}", b.max_rows)));
        }
        let positions: Vec<usize> = rows.iter().map(|r| r.pos).collect();
        self.upload_step(b, tokens, &positions)?;
        b.cache.set_rows(stream, rows)?;
        for (index, layer) in self.params.layers.iter().enumerate() {
            self.layer(b, index, layer, n)?;
        }
        for (k, &row) in logits_of.iter().enumerate() {
            self.device.copy_d2d(stream, &b.hidden, row * d..(row + 1) * d, &b.mid, k * d)?;
        }
        let m = logits_of.len();
        self.rmsnorm((&b.mid, &b.normed, &b.rstd), &self.params.norm, (m, d))?;
        self.linear(&b.normed, (self.params.head(), None), &b.logits, (m, d, vocab))?;
        let filled =
            self.device.copy_d2h(stream, &b.logits, 0..m * vocab, &mut b.logits_host, 0)?;
        let logits = filled.wait()?;
        Ok(logits[..m * vocab].iter().map(|x| x.to_f32()).collect())
    }
}
