//! Runs one operation of the schedule: resolves its places to device addresses and queues the
//! kernel, the cuBLASLt call or the attention on the compute stream.
//!
//! Every launch below relies on the same facts, established once in [`Schedule::new`] (every
//! place lies inside its buffer, tested in `schedule`'s tests) and [`CudaGpt::new`] /
//! `check_flat` (the buffers have the lengths the schedule assumes): each kernel indexes only
//! `[offset, offset + len)` of each place it is given, for the sizes passed with it, which are
//! those of the plan's launch. All work is queued on the one compute stream, in order, so no other
//! stream touches these buffers meanwhile unless the caller orders it with events (the contract).

use cudarc::driver::sys::CUdeviceptr;
use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::{Epilogue, Matmul, MatmulOperands, Operand};
use zeroflow_device::cuda::{CudaBuffer, CudaFunction, Dim3, KernelParams};
use zeroflow_device::{Device, DeviceBuffer};

use super::CudaGpt;
use super::kernels::{ROWS_PER_BLOCK, ROWS_PER_CHUNK, THREADS, blocks_for, chunks_for};
use super::schedule::{Op, OpKind, Place, Space};
use crate::error::GptError;
use crate::kernels::{Kernel, WeightLayout};

/// The buffers of one call: the model's own and the engine's parameters and gradients.
struct View<'a> {
    gpt: &'a CudaGpt,
    params: &'a CudaBuffer<bf16>,
    grads: Option<&'a CudaBuffer<bf16>>,
}

impl<'a> View<'a> {
    fn bf16_buffer(&self, space: Space) -> &'a CudaBuffer<bf16> {
        match space {
            Space::Params => self.params,
            Space::Grads => self.grads.expect("only backward has gradient places"),
            Space::Acts => &self.gpt.acts,
            Space::ActGrads => &self.gpt.act_grads,
            Space::Stats | Space::Tokens => unreachable!("{space:?} is not a bf16 buffer"),
        }
    }

    /// The device address of a place.
    fn addr(&self, place: &Place) -> CUdeviceptr {
        match place.space {
            Space::Stats => self.gpt.stats.address(place.offset),
            Space::Tokens => self.gpt.tokens.buffer().address(place.offset),
            space => self.bf16_buffer(space).address(place.offset),
        }
    }

    /// A bf16 place as a cuBLASLt operand.
    fn operand(&self, place: &Place) -> Operand<'a> {
        Operand::of(self.bf16_buffer(place.space), place.offset)
    }
}

/// Whether every address is 16-byte aligned (the kernels' vector paths).
fn aligned(addresses: &[CUdeviceptr]) -> bool {
    addresses.iter().all(|address| address % 16 == 0)
}

fn flag(value: bool) -> u32 {
    u32::from(value)
}

impl CudaGpt {
    /// Queues `op`; `loss_scale` scales the gradient of the loss (backward only).
    pub(super) fn run(
        &self,
        op: &Op,
        params: &CudaBuffer<bf16>,
        grads: Option<&CudaBuffer<bf16>>,
        loss_scale: f64,
    ) -> Result<(), GptError> {
        let v = View { gpt: self, params, grads };
        let a = &op.args;
        match &op.kind {
            OpKind::Kernel(kernel) => self.run_kernel(&v, kernel, a, loss_scale),
            &OpKind::MatmulBiasGelu { c, oc, layout } => {
                // [out after GELU, pre-GELU, inp, weight, bias]
                let layer = Linear { inp: &a[2], weight: &a[3], c, oc, layout };
                self.matmul_forward(&v, &layer, &a[0], Some(&a[4]), Some(&a[1]))
            }
            &OpKind::MatmulBackwardDGelu { c, oc, layout, bias } => {
                // [d pre-GELU, dweight, (dbias), dout, inp, weight, pre-GELU]
                let (dbias, rest) = if bias { (Some(&a[2]), &a[3..]) } else { (None, &a[2..]) };
                let grads = MatmulGrads { dinp: &a[0], dweight: &a[1], dbias };
                let layer = Linear { inp: &rest[1], weight: &rest[2], c, oc, layout };
                self.matmul_backward(&v, &layer, grads, &rest[0], Some(&rest[3]))
            }
        }
    }

    fn run_kernel(
        &self,
        v: &View<'_>,
        kernel: &Kernel,
        a: &[Place],
        loss_scale: f64,
    ) -> Result<(), GptError> {
        match *kernel {
            Kernel::Zero { .. } => {
                for place in a {
                    let buffer = v.bf16_buffer(place.space);
                    let range = place.offset..place.end();
                    self.device.fill(self.compute(), buffer, range, bf16::ZERO)?;
                }
                Ok(())
            }
            Kernel::Encoder { t, c, .. } => self.encoder_forward(v, a, t, c),
            Kernel::EncoderBackward { t, c } => self.encoder_backward(v, a, t, c),
            Kernel::LayerNorm { c } => self.layernorm_forward(v, a, c),
            Kernel::LayerNormBackward { c } => self.layernorm_backward(v, a, c),
            Kernel::Matmul { c, oc, layout, bias } => {
                // [out, inp, weight, (bias)]
                let layer = Linear { inp: &a[1], weight: &a[2], c, oc, layout };
                self.matmul_forward(v, &layer, &a[0], bias.then(|| &a[3]), None)
            }
            Kernel::MatmulBackward { c, oc, layout, bias } => {
                // [dinp, dweight, (dbias), dout, inp, weight]
                let (dbias, rest) = if bias { (Some(&a[2]), &a[3..]) } else { (None, &a[2..]) };
                let grads = MatmulGrads { dinp: &a[0], dweight: &a[1], dbias };
                let layer = Linear { inp: &rest[1], weight: &rest[2], c, oc, layout };
                self.matmul_backward(v, &layer, grads, &rest[0], None)
            }
            Kernel::Attention { .. } => {
                let (out, att, qkv) = (v.addr(&a[0]), v.addr(&a[1]), v.addr(&a[2]));
                Ok(self.gemm_attention().forward(self.compute(), qkv, out, att)?)
            }
            Kernel::AttentionBackward { .. } => {
                let (dqkv, dscores) = (v.addr(&a[0]), v.addr(&a[1]));
                let (dout, qkv, att) = (v.addr(&a[2]), v.addr(&a[3]), v.addr(&a[4]));
                let attention = self.gemm_attention();
                Ok(attention.backward(self.compute(), dout, qkv, att, dqkv, dscores)?)
            }
            Kernel::FlashAttention { .. } => {
                // [out, lse (f32, in Stats), qkv]
                let (out, lse, qkv) = (v.addr(&a[0]), v.addr(&a[1]), v.addr(&a[2]));
                Ok(self.flash_attention().forward(self.compute(), qkv, out, lse)?)
            }
            Kernel::FlashAttentionBackward { .. } => {
                // [dqkv (overwritten: the schedule checks it is its first write), dout, qkv, out,
                // lse]
                let [dqkv, dout, qkv, out, lse] = [0, 1, 2, 3, 4].map(|i| v.addr(&a[i]));
                let flash = self.flash_attention();
                Ok(flash.backward(self.compute(), qkv, out, dout, lse, dqkv)?)
            }
            Kernel::Gelu => self.elementwise(&self.kernels.gelu_forward, v, a, &[]),
            Kernel::GeluBackward => {
                self.elementwise(&self.kernels.gelu_backward, v, a, &[a[0].accumulate])
            }
            Kernel::Residual => self.elementwise(&self.kernels.residual_forward, v, a, &[]),
            Kernel::ResidualBackward => {
                let flags = [a[0].accumulate, a[1].accumulate];
                self.elementwise(&self.kernels.residual_backward, v, a, &flags)
            }
            Kernel::SoftmaxXent { vocab, padded_vocab } => {
                self.softmax_xent_forward(v, a, vocab, padded_vocab)
            }
            Kernel::MeanLoss => {
                let (loss, losses) = (v.addr(&a[0]), v.addr(&a[1]));
                let params = KernelParams::new().raw_ptr(loss).raw_ptr(losses).u32(a[1].len as u32);
                self.launch(&self.kernels.mean_loss, 1, 1024, params)
            }
            Kernel::SoftmaxXentBackward { .. } => {
                let Kernel::SoftmaxXentBackward { vocab, padded_vocab, dloss } =
                    kernel.with_loss_scale(loss_scale)
                else {
                    unreachable!("with_loss_scale keeps the kernel")
                };
                self.softmax_xent_backward(v, a, vocab, padded_vocab, dloss as f32)
            }
        }
    }

    /// Queues `function` on the compute stream.
    fn launch(
        &self,
        function: &CudaFunction,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        params: KernelParams,
    ) -> Result<(), GptError> {
        // SAFETY: every caller passes the parameters its kernel declares, in order and type, and
        // device addresses of places the schedule checked against their buffers (the module
        // documentation); the kernels touch only the elements the sizes passed with them cover.
        unsafe { self.device.launch(self.compute(), function, grid, block, 0, &params) }?;
        Ok(())
    }

    /// An element-wise kernel over `a` (the output first, all of one length), with `flags` after
    /// the length and the vector flag.
    fn elementwise(
        &self,
        function: &CudaFunction,
        v: &View<'_>,
        a: &[Place],
        flags: &[bool],
    ) -> Result<(), GptError> {
        let n = a[0].len;
        debug_assert!(a.iter().all(|place| place.len == n));
        // No allocation per launch: the addresses go straight into the parameters.
        let vec = a.iter().all(|place| v.addr(place).is_multiple_of(16));
        let mut params = KernelParams::new();
        for place in a {
            params = params.raw_ptr(v.addr(place));
        }
        params = params.u64(n as u64).u32(flag(vec));
        for &f in flags {
            params = params.u32(flag(f));
        }
        let work = if vec { n / 8 + n % 8 } else { n };
        self.launch(function, blocks_for(work), THREADS, params)
    }

    /// [out, tokens, wte, wpe]
    fn encoder_forward(
        &self,
        v: &View<'_>,
        a: &[Place],
        t: usize,
        c: usize,
    ) -> Result<(), GptError> {
        let rows = a[0].len / c;
        let (out, tokens, wte, wpe) = (v.addr(&a[0]), v.addr(&a[1]), v.addr(&a[2]), v.addr(&a[3]));
        let vec = c.is_multiple_of(8) && aligned(&[out, wte, wpe]);
        let params = KernelParams::new()
            .raw_ptr(out)
            .raw_ptr(tokens)
            .raw_ptr(wte)
            .raw_ptr(wpe)
            .u32(rows as u32)
            .u32(t as u32)
            .u32(c as u32)
            .u32(flag(vec));
        let work = if vec { rows * c / 8 } else { rows * c };
        self.launch(&self.kernels.encoder_forward, blocks_for(work), THREADS, params)
    }

    /// [dwte, dwpe, dout, tokens]
    fn encoder_backward(
        &self,
        v: &View<'_>,
        a: &[Place],
        t: usize,
        c: usize,
    ) -> Result<(), GptError> {
        let (dwte, dwpe, dout) = (v.addr(&a[0]), v.addr(&a[1]), v.addr(&a[2]));
        let tokens = self.tokens.buffer();
        let params = KernelParams::new()
            .raw_ptr(dwte)
            .raw_ptr(dout)
            .ptr(tokens, self.tokens.order().start)
            .ptr(tokens, self.tokens.bucket_token().start)
            .ptr(tokens, self.tokens.bucket_start().start)
            .u32(c as u32);
        let grid = (self.tokens.buckets() as u32, c.div_ceil(THREADS as usize) as u32);
        self.launch(&self.kernels.encoder_backward_wte, grid, THREADS, params)?;
        let batch = a[2].len / c / t;
        let params = KernelParams::new()
            .raw_ptr(dwpe)
            .raw_ptr(dout)
            .u32(batch as u32)
            .u32(t as u32)
            .u32(c as u32);
        self.launch(&self.kernels.encoder_backward_wpe, blocks_for(t * c), THREADS, params)
    }

    /// [out, mean, rstd, inp, weight, bias]
    fn layernorm_forward(&self, v: &View<'_>, a: &[Place], c: usize) -> Result<(), GptError> {
        let rows = a[0].len / c;
        let [out, mean, rstd, inp, weight, bias] = [0, 1, 2, 3, 4, 5].map(|i| v.addr(&a[i]));
        let vec = c.is_multiple_of(8) && aligned(&[out, inp, weight, bias]);
        let params = KernelParams::new()
            .raw_ptr(out)
            .raw_ptr(mean)
            .raw_ptr(rstd)
            .raw_ptr(inp)
            .raw_ptr(weight)
            .raw_ptr(bias)
            .u32(rows as u32)
            .u32(c as u32)
            .u32(flag(vec));
        let grid = rows.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        self.launch(&self.kernels.layernorm_forward, grid, THREADS, params)
    }

    /// [dinp, dweight, dbias, dout, inp, weight, mean, rstd]
    fn layernorm_backward(&self, v: &View<'_>, a: &[Place], c: usize) -> Result<(), GptError> {
        let rows = a[0].len / c;
        let [dinp, dweight, dbias, dout, inp, weight, mean, rstd] =
            [0, 1, 2, 3, 4, 5, 6, 7].map(|i| v.addr(&a[i]));
        let vec = c.is_multiple_of(8) && aligned(&[dinp, dout, inp, weight]);
        let params = KernelParams::new()
            .raw_ptr(dinp)
            .raw_ptr(dout)
            .raw_ptr(inp)
            .raw_ptr(weight)
            .raw_ptr(mean)
            .raw_ptr(rstd)
            .u32(rows as u32)
            .u32(c as u32)
            .u32(flag(vec))
            .u32(flag(a[0].accumulate));
        let grid = rows.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        self.launch(&self.kernels.layernorm_backward_input, grid, THREADS, params)?;
        let chunks = chunks_for(rows);
        debug_assert!(chunks * 2 * c <= self.column_partials.len());
        let params = KernelParams::new()
            .ptr(&self.column_partials, 0)
            .raw_ptr(dout)
            .raw_ptr(inp)
            .raw_ptr(mean)
            .raw_ptr(rstd)
            .u32(rows as u32)
            .u32(c as u32)
            .u32(ROWS_PER_CHUNK as u32);
        let grid = (c.div_ceil(32) as u32, chunks as u32);
        self.launch(&self.kernels.layernorm_param_grads_partial, grid, (32, 8), params)?;
        self.column_sum_finish(dweight, 0, chunks, 2 * c, c)?;
        self.column_sum_finish(dbias, c, chunks, 2 * c, c)
    }

    /// `out[j] += Σ_chunk partials[first + chunk · stride + j]` for `j < cols`.
    fn column_sum_finish(
        &self,
        out: CUdeviceptr,
        first: usize,
        chunks: usize,
        stride: usize,
        cols: usize,
    ) -> Result<(), GptError> {
        let params = KernelParams::new()
            .raw_ptr(out)
            .ptr(&self.column_partials, first)
            .u32(chunks as u32)
            .u32(stride as u32)
            .u32(cols as u32);
        self.launch(&self.kernels.column_sum_finish, blocks_for(cols), THREADS, params)
    }

    /// `dbias += Σ_rows dout` for `dout [rows, cols]`.
    fn bias_grad(
        &self,
        dbias: CUdeviceptr,
        dout: CUdeviceptr,
        rows: usize,
        cols: usize,
    ) -> Result<(), GptError> {
        let chunks = chunks_for(rows);
        debug_assert!(chunks * cols <= self.column_partials.len());
        let params = KernelParams::new()
            .ptr(&self.column_partials, 0)
            .raw_ptr(dout)
            .u32(rows as u32)
            .u32(cols as u32)
            .u32(ROWS_PER_CHUNK as u32);
        let grid = (cols.div_ceil(32) as u32, chunks as u32);
        self.launch(&self.kernels.column_sum_partial, grid, (32, 8), params)?;
        self.column_sum_finish(dbias, 0, chunks, cols, cols)
    }

    /// [probs, losses, logits, targets]
    fn softmax_xent_forward(
        &self,
        v: &View<'_>,
        a: &[Place],
        vocab: usize,
        padded_vocab: usize,
    ) -> Result<(), GptError> {
        let rows = a[0].len / padded_vocab;
        let [probs, losses, logits, targets] = [0, 1, 2, 3].map(|i| v.addr(&a[i]));
        check_rows_vectorised("softmax_xent_forward", padded_vocab, &[probs, logits])?;
        let params = KernelParams::new()
            .raw_ptr(probs)
            .raw_ptr(losses)
            .raw_ptr(logits)
            .raw_ptr(targets)
            .u32(vocab as u32)
            .u32(padded_vocab as u32);
        let threads = (padded_vocab / 8).next_multiple_of(32).clamp(32, 1024) as u32;
        self.launch(&self.kernels.softmax_xent_forward, rows as u32, threads, params)
    }

    /// [dlogits, probs, targets]
    fn softmax_xent_backward(
        &self,
        v: &View<'_>,
        a: &[Place],
        vocab: usize,
        padded_vocab: usize,
        dloss: f32,
    ) -> Result<(), GptError> {
        let rows = a[0].len / padded_vocab;
        let [dlogits, probs, targets] = [0, 1, 2].map(|i| v.addr(&a[i]));
        check_rows_vectorised("softmax_xent_backward", padded_vocab, &[dlogits, probs])?;
        let params = KernelParams::new()
            .raw_ptr(dlogits)
            .raw_ptr(probs)
            .raw_ptr(targets)
            .u32(rows as u32)
            .u32(vocab as u32)
            .u32(padded_vocab as u32)
            .f32(dloss)
            .u32(flag(a[0].accumulate));
        let work = rows * padded_vocab / 8;
        self.launch(&self.kernels.softmax_xent_backward, blocks_for(work), THREADS, params)
    }

    /// `out = inp · W (+ bias)`, or with `pre_gelu`, `pre_gelu = inp · W + bias; out =
    /// gelu(pre_gelu)` (cuBLASLt's `BiasGelu` epilogue).
    fn matmul_forward(
        &self,
        v: &View<'_>,
        layer: &Linear<'_>,
        out: &Place,
        bias: Option<&Place>,
        pre_gelu: Option<&Place>,
    ) -> Result<(), GptError> {
        let Linear { inp, weight, c, oc, layout } = *layer;
        let rows = inp.len / c;
        let problem = match layout {
            // out[rows, oc] = inp[rows, c] · weight[c, oc]
            WeightLayout::InOut => Matmul::row_major(rows, oc, c, false, false),
            // out[rows, oc] = inp[rows, c] · weight[oc, c]ᵀ
            WeightLayout::OutIn => Matmul::linear_forward(rows, c, oc),
        };
        let mut operands =
            MatmulOperands::row_major(v.operand(inp), v.operand(weight), v.operand(out));
        let epilogue = match (bias, pre_gelu) {
            (Some(bias), Some(pre_gelu)) => {
                operands = operands.with_bias(v.operand(bias)).with_aux(v.operand(pre_gelu));
                Epilogue::BiasGelu
            }
            (Some(bias), None) => {
                operands = operands.with_bias(v.operand(bias));
                Epilogue::Bias
            }
            (None, None) => Epilogue::None,
            (None, Some(_)) => unreachable!("the schedule fuses GELU only after a bias"),
        };
        let problem = problem.with_epilogue(epilogue);
        Ok(self.blas.matmul(self.compute(), &problem, operands)?)
    }

    /// `dinp (+)= dout · Wᵀ` (times `gelu'(pre_gelu)` with `pre_gelu`, cuBLASLt's `DGelu`),
    /// `dweight += inpᵀ · dout` in the weight's layout, `dbias += Σ_rows dout`.
    fn matmul_backward(
        &self,
        v: &View<'_>,
        layer: &Linear<'_>,
        grads: MatmulGrads<'_>,
        dout: &Place,
        pre_gelu: Option<&Place>,
    ) -> Result<(), GptError> {
        let Linear { inp, weight, c, oc, layout } = *layer;
        let rows = dout.len / oc;
        let beta = if grads.dinp.accumulate { 1.0 } else { 0.0 };
        let problem = match layout {
            // dinp[rows, c] = dout[rows, oc] · weight[c, oc]ᵀ
            WeightLayout::InOut => Matmul::row_major(rows, c, oc, false, true),
            // dinp[rows, c] = dout[rows, oc] · weight[oc, c]
            WeightLayout::OutIn => Matmul::linear_backward_input(rows, c, oc),
        };
        let mut operands =
            MatmulOperands::row_major(v.operand(dout), v.operand(weight), v.operand(grads.dinp));
        let mut problem = problem.with_beta(beta);
        if let Some(pre_gelu) = pre_gelu {
            debug_assert!(!grads.dinp.accumulate, "DGelu overwrites");
            operands = operands.with_aux(v.operand(pre_gelu));
            problem = problem.with_epilogue(Epilogue::DGelu);
        }
        self.blas.matmul(self.compute(), &problem, operands)?;
        let (problem, x, y) = match layout {
            // dweight[c, oc] += inp[rows, c]ᵀ · dout[rows, oc]
            WeightLayout::InOut => (Matmul::row_major(c, oc, rows, true, false), inp, dout),
            // dweight[oc, c] += dout[rows, oc]ᵀ · inp[rows, c]
            WeightLayout::OutIn => (Matmul::linear_backward_weight(rows, c, oc), dout, inp),
        };
        let operands =
            MatmulOperands::row_major(v.operand(x), v.operand(y), v.operand(grads.dweight));
        self.blas.matmul(self.compute(), &problem.with_beta(1.0), operands)?;
        match grads.dbias {
            Some(dbias) => self.bias_grad(v.addr(dbias), v.addr(dout), rows, oc),
            None => Ok(()),
        }
    }
}

/// A linear layer: its input `[rows, c]` and its weight, `[c, oc]` or `[oc, c]` by layout.
#[derive(Clone, Copy)]
struct Linear<'a> {
    inp: &'a Place,
    weight: &'a Place,
    c: usize,
    oc: usize,
    layout: WeightLayout,
}

/// The gradients a matmul backward writes.
struct MatmulGrads<'a> {
    dinp: &'a Place,
    dweight: &'a Place,
    dbias: Option<&'a Place>,
}

/// The loss kernels move whole rows of `width` in 16-byte vectors.
fn check_rows_vectorised(
    kernel: &'static str,
    width: usize,
    addresses: &[CUdeviceptr],
) -> Result<(), GptError> {
    if width.is_multiple_of(8) && aligned(addresses) {
        Ok(())
    } else {
        Err(GptError::Kernel {
            kernel,
            reason: format!("rows of {width} elements must be whole 16-byte vectors"),
        })
    }
}
