//! GPT-2 with a key/value cache on the GPU ([`CudaGptDecoder`]): zeroflow-nn's
//! [`CachedDecoder`] of GPT-2's step ([`CudaGptStep`]), a [`Decoder`] in bf16, the twin of the
//! CPU's [`GptDecoder`](crate::GptDecoder). A step runs only its token rows (a prefill every
//! prompt position, a decode step one row per sequence): the embedding of those few rows summed
//! on the host from f32 copies of `wte` and `wpe` (each row at its own position) and uploaded,
//! then per block the training kernels (LayerNorm, GELU, the residual) and cuBLASLt matmuls with
//! `M = rows` (the Conv1D weights `[in, out]`, the bias in the epilogue), and attention over the
//! cache ([`CudaKvCache`]: `kv_write`, then `decode_attention`); the final LayerNorm and the LM
//! head run only on the rows whose logits are asked for (copied together first), and those
//! logits come to the host (f32) for sampling.

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

use super::kernels::GptKernels;
use crate::GptConfig;
use crate::error::GptError;
use crate::params::{BlockParams, ParamRanges};

/// The GPU buffers of one batch: every activation for steps of at most `max_rows` rows, the
/// host staging of the embedding and of the logits, and the cache ([`CudaGptStep`]'s
/// [`CachedForward::Batch`]).
#[derive(Debug)]
pub struct Batch {
    max_rows: usize,
    cache: CudaKvCache,
    /// `[max_rows, C]` each: the residual stream in and between the halves of a block, the
    /// normalised rows, the attention's output and the projections' outputs.
    residual: CudaBuffer<bf16>,
    residual2: CudaBuffer<bf16>,
    normed: CudaBuffer<bf16>,
    atty: CudaBuffer<bf16>,
    projected: CudaBuffer<bf16>,
    /// `[max_rows, 3C]`.
    qkv: CudaBuffer<bf16>,
    /// `[max_rows, 4C]`: the MLP's hidden rows before and after GELU.
    fch: CudaBuffer<bf16>,
    fch_gelu: CudaBuffer<bf16>,
    /// LayerNorm's statistics, `[max_rows]` (not read: inference has no backward).
    mean: CudaBuffer<f32>,
    rstd: CudaBuffer<f32>,
    /// `[batch, padded_vocab]`: the logits of a step's asked-for rows.
    logits: CudaBuffer<bf16>,
    embedding: HostBuffer<bf16>,
    logits_host: HostBuffer<bf16>,
}

/// GPT-2 on a GPU with the key/value cache of the current batch: a [`Decoder`] (make one with
/// `CachedDecoder::new(CudaGptStep::new(…)?)`).
pub type CudaGptDecoder = CachedDecoder<CudaGptStep>;

/// GPT-2's forward over a step's rows on the GPU: the weights, the kernels and the buffers of a
/// batch, which [`CudaGptDecoder`] runs.
#[derive(Debug)]
pub struct CudaGptStep {
    device: CudaDevice,
    blas: Arc<Blas>,
    config: GptConfig,
    params: ParamRanges,
    weights: CudaBuffer<bf16>,
    /// `wte` and `wpe` as the GPU holds them (bf16), for the embedding of a step's rows on the
    /// host.
    wte: Vec<bf16>,
    wpe: Vec<bf16>,
    gpt: GptKernels,
    nn: NnKernels,
}

impl CudaGptStep {
    /// Uploads `weights` (the flat parameters of `layout`, f32 or bf16) to the GPU in bf16 and
    /// loads the kernels; `blas` is shared with the compute stream's other users.
    pub fn new<W: Float>(
        device: &CudaDevice,
        blas: Arc<Blas>,
        config: &GptConfig,
        layout: &FlatLayout,
        weights: &[W],
    ) -> Result<Self, GptError> {
        if weights.len() != layout.padded_len() {
            let (expected, found) = (layout.padded_len(), weights.len());
            return Err(GptError::Length { what: "parameter buffer", expected, found });
        }
        let weights = device.upload_rounded(weights)?;
        CudaGptStep::on_device(device, blas, config, layout, weights)
    }

    /// [`CudaGptStep::new`] of weights already on the GPU (the flat parameters of `layout`
    /// in bf16): the embedding's rows the host reads are downloaded from them.
    pub fn on_device(
        device: &CudaDevice,
        blas: Arc<Blas>,
        config: &GptConfig,
        layout: &FlatLayout,
        weights: CudaBuffer<bf16>,
    ) -> Result<Self, GptError> {
        let params = ParamRanges::new(config, layout)?;
        if weights.len() != layout.padded_len() {
            let (expected, found) = (layout.padded_len(), weights.len());
            return Err(GptError::Length { what: "parameter buffer", expected, found });
        }
        // The host's embedding: the GPU's bf16 values.
        let held = |range: &Range<usize>| device.download_range(&weights, range.clone());
        Ok(CudaGptStep {
            device: device.clone(),
            blas,
            config: *config,
            wte: held(&params.wte)?,
            wpe: held(&params.wpe)?,
            weights,
            params,
            gpt: GptKernels::load(device)?,
            nn: NnKernels::load(device)?,
        })
    }

    /// `wte[token] + wpe[pos]` of each row (f32 on the host, rounded to bf16) into `residual`.
    fn embed(
        &self,
        b: &mut Batch,
        tokens: &[u32],
        positions: impl Iterator<Item = usize>,
    ) -> Result<(), GptError> {
        let (c, vocab) = (self.config.d_model, self.config.vocab_size);
        if let Some(token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            let reason = format!("token {token} is outside the vocabulary ({vocab})");
            return Err(GptError::Kernel { kernel: "encoder_forward", reason });
        }
        for ((row, &token), pos) in b.embedding.chunks_mut(c).zip(tokens).zip(positions) {
            let (wte, wpe) = (&self.wte[token as usize * c..][..c], &self.wpe[pos * c..][..c]);
            row.iter_mut()
                .zip(wte.iter().zip(wpe))
                .for_each(|(x, (&t, &p))| *x = bf16::from_f32(t.to_f32() + p.to_f32()));
        }
        let n = tokens.len();
        self.device.copy_h2d(self.stream(), &b.embedding, 0..n * c, &b.residual, 0)?.wait()?;
        Ok(())
    }

    /// Block `layer` on `n` rows: `residual` in, `residual` out (through `residual2`).
    fn block(&self, b: &Batch, layer: usize, p: &BlockParams, n: usize) -> Result<(), GptError> {
        let (c, stream) = (self.config.d_model, self.stream());
        self.layernorm(b, (&b.residual, &b.normed), (&p.ln_1_weight, &p.ln_1_bias), n)?;
        self.conv1d(&b.normed, (&p.c_attn_weight, &p.c_attn_bias), &b.qkv, (n, c, 3 * c))?;
        b.cache.write(stream, layer, b.qkv.slice(0..n * 3 * c), 3 * c)?;
        b.cache.attend(
            stream,
            layer,
            b.qkv.slice(0..n * 3 * c),
            3 * c,
            b.atty.slice_mut(0..n * c),
            c,
        )?;
        self.conv1d(
            &b.atty,
            (&p.attn_c_proj_weight, &p.attn_c_proj_bias),
            &b.projected,
            (n, c, c),
        )?;
        self.pointwise(
            &self.nn.residual_forward,
            &b.residual2,
            &[&b.residual, &b.projected],
            n * c,
        )?;
        self.layernorm(b, (&b.residual2, &b.normed), (&p.ln_2_weight, &p.ln_2_bias), n)?;
        self.conv1d(&b.normed, (&p.c_fc_weight, &p.c_fc_bias), &b.fch, (n, c, 4 * c))?;
        self.pointwise(&self.gpt.gelu_forward, &b.fch_gelu, &[&b.fch], n * 4 * c)?;
        self.conv1d(
            &b.fch_gelu,
            (&p.mlp_c_proj_weight, &p.mlp_c_proj_bias),
            &b.projected,
            (n, 4 * c, c),
        )?;
        self.pointwise(&self.nn.residual_forward, &b.residual, &[&b.residual2, &b.projected], n * c)
    }

    /// `out[rows, oc] = inp[rows, c] · weight[c, oc] + bias` (a Conv1D weight, `[in, out]`).
    fn conv1d(
        &self,
        inp: &CudaBuffer<bf16>,
        (weight, bias): (&Range<usize>, &Range<usize>),
        out: &CudaBuffer<bf16>,
        (rows, c, oc): (usize, usize, usize),
    ) -> Result<(), GptError> {
        let problem = Matmul::row_major(rows, oc, c, false, false).with_epilogue(Epilogue::Bias);
        let w = &self.weights;
        let operands = MatmulOperands::row_major(
            Operand::of(inp, 0),
            Operand::of(w, weight.start),
            Operand::of(out, 0),
        )
        .with_bias(Operand::of(w, bias.start));
        Ok(self.blas.matmul(self.stream(), &problem, operands)?)
    }

    /// LayerNorm of `rows` rows of `inp` into `out` with the weight and bias of those ranges.
    fn layernorm(
        &self,
        b: &Batch,
        (inp, out): (&CudaBuffer<bf16>, &CudaBuffer<bf16>),
        (weight, bias): (&Range<usize>, &Range<usize>),
        rows: usize,
    ) -> Result<(), GptError> {
        let (c, w) = (self.config.d_model, &self.weights);
        let addresses =
            [out.address(0), inp.address(0), w.address(weight.start), w.address(bias.start)];
        let vec = c.is_multiple_of(8) && addresses.iter().all(|a| a.is_multiple_of(16));
        let params = KernelParams::new()
            .ptr(out, 0)
            .ptr(&b.mean, 0)
            .ptr(&b.rstd, 0)
            .ptr(inp, 0)
            .ptr(w, weight.start)
            .ptr(w, bias.start)
            .u32(rows as u32)
            .u32(c as u32)
            .u32(u32::from(vec));
        let grid = rows.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        // SAFETY: the parameters match `layernorm_forward(bf16_t* out, float* mean, float* rstd,
        // const bf16_t* inp, const bf16_t* weight, const bf16_t* bias, u32 rows, u32 c, u32
        // vec)`; each warp normalises one of `rows` rows of `c` of inp (a buffer of `max_rows ·
        // C`, `rows ≤ max_rows` checked by `run`) into out (as large), writes the row's mean and
        // rstd (`max_rows` each) and reads `c` of the weight and the bias (parameters of `c`);
        // `vec` only where `c` is a multiple of 8 and every bf16 pointer 16-byte aligned.
        unsafe {
            Ok(self.device.launch(
                self.stream(),
                &self.gpt.layernorm_forward,
                grid,
                THREADS,
                0,
                &params,
            )?)
        }
    }

    /// The element-wise `function(out, inputs…, n, vec)` over the first `n` elements.
    fn pointwise(
        &self,
        function: &CudaFunction,
        out: &CudaBuffer<bf16>,
        inputs: &[&CudaBuffer<bf16>],
        n: usize,
    ) -> Result<(), GptError> {
        let vec = std::iter::once(out)
            .chain(inputs.iter().copied())
            .all(|buf| buf.address(0).is_multiple_of(16));
        let params = inputs.iter().fold(KernelParams::new().ptr(out, 0), |p, inp| p.ptr(inp, 0));
        let params = params.u64(n as u64).u32(u32::from(vec));
        let work = if vec { n / 8 + n % 8 } else { n };
        // SAFETY: the parameters match `residual_forward(bf16_t* out, const bf16_t* a, const
        // bf16_t* b, u64 n, u32 vec)` and `gelu_forward(bf16_t* out, const bf16_t* inp, u64 n,
        // u32 vec)` (the two this is called with, with two inputs and one); the grid-stride loop
        // touches elements `0..n` of each buffer, all of at least `n` (`n` is `rows · width` of
        // buffers of `max_rows · width`); `vec` only where every pointer is 16-byte aligned.
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

/// GPT-2's attention: multi-head.
fn attention(config: &GptConfig) -> CachedAttention {
    CachedAttention { n_head: config.n_head, n_kv_head: config.n_head, head_dim: config.head_dim() }
}

impl CachedForward for CudaGptStep {
    type Batch = Batch;
    type Error = GptError;

    fn attention(&self) -> CachedAttention {
        attention(&self.config)
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn max_positions(&self) -> usize {
        self.config.context
    }

    fn stream(&self) -> &CudaStream {
        self.device.stream(StreamKind::Compute)
    }

    fn batch_error(reason: String) -> GptError {
        GptError::Batch(reason)
    }

    fn allocate(&self, batch: usize, capacity: usize, max_rows: usize) -> Result<Batch, GptError> {
        let (c, padded) = (self.config.d_model, self.config.padded_vocab_size());
        let layout = DeviceCacheLayout { shape: attention(&self.config), batch, capacity };
        let cache = CudaKvCache::new(&self.device, self.config.n_layer, layout, max_rows)?;
        let d = &self.device;
        let rows = |width: usize| d.alloc::<bf16>(max_rows * width);
        Ok(Batch {
            max_rows,
            cache,
            residual: rows(c)?,
            residual2: rows(c)?,
            normed: rows(c)?,
            atty: rows(c)?,
            projected: rows(c)?,
            qkv: rows(3 * c)?,
            fch: rows(4 * c)?,
            fch_gelu: rows(4 * c)?,
            mean: d.alloc::<f32>(max_rows)?,
            rstd: d.alloc::<f32>(max_rows)?,
            logits: d.alloc::<bf16>(batch * padded)?,
            embedding: d.alloc_host::<bf16>(max_rows * c, HostMemory::Pageable)?,
            logits_host: d.alloc_host::<bf16>(batch * padded, HostMemory::Pageable)?,
        })
    }

    fn cache(batch: &Batch) -> (&CudaKvCache, usize) {
        (&batch.cache, batch.max_rows)
    }

    fn run(&self, b: &mut Batch, step: &StepRows) -> Result<Vec<f32>, GptError> {
        let StepRows { tokens, rows, logits_of } = step;
        let (n, c, stream) = (rows.len(), self.config.d_model, self.stream());
        if n > b.max_rows || logits_of.len() * self.config.padded_vocab_size() > b.logits.len() {
            return Err(GptError::Batch(format!("{n} rows pass the batch's {}", b.max_rows)));
        }
        self.embed(b, tokens, rows.iter().map(|r| r.pos))?;
        b.cache.set_rows(stream, rows)?;
        for (layer, block) in self.params.blocks.iter().enumerate() {
            self.block(b, layer, block, n)?;
        }
        // The asked-for rows together at the start of `residual2`, then the head on them.
        for (k, &row) in logits_of.iter().enumerate() {
            self.device.copy_d2d(
                stream,
                &b.residual,
                row * c..(row + 1) * c,
                &b.residual2,
                k * c,
            )?;
        }
        let m = logits_of.len();
        let p = &self.params;
        self.layernorm(b, (&b.residual2, &b.normed), (&p.ln_f_weight, &p.ln_f_bias), m)?;
        let padded = self.config.padded_vocab_size();
        let problem = Matmul::linear_forward(m, c, padded);
        let operands = MatmulOperands::row_major(
            Operand::of(&b.normed, 0),
            Operand::of(&self.weights, p.wte.start),
            Operand::of(&b.logits, 0),
        );
        self.blas.matmul(stream, &problem, operands)?;
        let filled =
            self.device.copy_d2h(stream, &b.logits, 0..m * padded, &mut b.logits_host, 0)?;
        let logits = filled.wait()?;
        let vocab = self.config.vocab_size;
        Ok(logits[..m * padded]
            .chunks(padded)
            .flat_map(|row| row[..vocab].iter().map(|x| x.to_f32()))
            .collect())
    }
}
