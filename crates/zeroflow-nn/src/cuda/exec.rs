//! Runs one operation of the schedule: resolves its places to slices of the GPU's buffers and
//! queues the kernel, the cuBLASLt call or the attention on the compute stream. A family's own
//! kernels get the same view of the buffers, [`LayerCtx`], through [`super::CudaLayers`].
//!
//! Every launch below relies on the same facts, established once in
//! [`Schedule::new`](super::schedule::Schedule::new) (every place lies inside its buffer, tested
//! with GPT-2's plans) and [`CudaRunner::new`] /
//! `check_flat` (the buffers have the lengths the schedule assumes): each kernel indexes only
//! `[offset, offset + len)` of each place it is given, for the sizes passed with it, which are
//! those of the plan's launch. All work is queued on the one compute stream, in order, so no other
//! stream touches these buffers meanwhile unless the caller orders it with events (the contract).

use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::{Blas, Epilogue, Matmul, MatmulOperands, Operand};
use zeroflow_device::cuda::{
    CudaBuffer, CudaFunction, CudaStream, DeviceSlice, DeviceSliceMut, Dim3, KernelParams,
};
use zeroflow_device::{CudaDevice, Device, DeviceBuffer};

use super::kernels::{NnKernels, ROWS_PER_CHUNK, THREADS, blocks_for, chunks_for};
use super::schedule::{Op, OpKind, Place, Space};
use super::tokens::Tokens;
use super::{CudaLayerKernel, CudaLayers, CudaRunner};
use crate::error::NnError;
use crate::kernels::{Kernel, WeightLayout};

mod embedding;

/// What one operation runs with: the executor's buffers and the engine's parameters and
/// gradients, the device, its compute stream and the shared kernels. The places of an operation
/// (from the schedule) become slices of these buffers here.
#[derive(Debug)]
pub struct LayerCtx<'a> {
    device: &'a CudaDevice,
    stream: &'a CudaStream,
    kernels: &'a NnKernels,
    blas: &'a Blas,
    tokens: &'a Tokens,
    acts: &'a CudaBuffer<bf16>,
    act_grads: &'a CudaBuffer<bf16>,
    stats: &'a CudaBuffer<f32>,
    column_partials: &'a CudaBuffer<f32>,
    params: &'a CudaBuffer<bf16>,
    grads: Option<&'a CudaBuffer<bf16>>,
}

impl<'a> LayerCtx<'a> {
    fn bf16_buffer(&self, space: Space) -> &'a CudaBuffer<bf16> {
        match space {
            Space::Params => self.params,
            Space::Grads => self.grads.expect("only backward has gradient places"),
            Space::Acts => self.acts,
            Space::ActGrads => self.act_grads,
            Space::Stats | Space::Tokens => unreachable!("{space:?} is not a bf16 buffer"),
        }
    }

    /// A bf16 place, read.
    pub fn bf16(&self, place: &Place) -> DeviceSlice<'a, bf16> {
        self.bf16_buffer(place.space).slice(place.offset..place.end())
    }

    /// A bf16 place, written.
    pub fn bf16_mut(&self, place: &Place) -> DeviceSliceMut<'a, bf16> {
        self.bf16_buffer(place.space).slice_mut(place.offset..place.end())
    }

    /// A place of the token ids (inputs, targets or a packed plan's positions), read.
    pub fn tokens(&self, place: &Place) -> DeviceSlice<'a, u32> {
        debug_assert_eq!(place.space, Space::Tokens);
        self.tokens.buffer().slice(place.offset..place.end())
    }

    /// An f32 place (in the statistics), read.
    pub fn f32(&self, place: &Place) -> DeviceSlice<'a, f32> {
        debug_assert_eq!(place.space, Space::Stats);
        self.stats.slice(place.offset..place.end())
    }

    /// An f32 place (in the statistics), written.
    pub fn f32_mut(&self, place: &Place) -> DeviceSliceMut<'a, f32> {
        debug_assert_eq!(place.space, Space::Stats);
        self.stats.slice_mut(place.offset..place.end())
    }

    /// `params` with a place the kernel reads, of whichever element type its space holds.
    pub fn read(&self, params: KernelParams, place: &Place) -> KernelParams {
        match place.space {
            Space::Stats => params.slice(self.f32(place)),
            Space::Tokens => params.slice(self.tokens(place)),
            _ => params.slice(self.bf16(place)),
        }
    }

    /// `params` with a place the kernel writes, of whichever element type its space holds.
    pub fn write(&self, params: KernelParams, place: &Place) -> KernelParams {
        match place.space {
            Space::Stats => params.slice_mut(self.f32_mut(place)),
            Space::Tokens => unreachable!("no kernel writes the token ids"),
            _ => params.slice_mut(self.bf16_mut(place)),
        }
    }

    /// `params` with the places the kernel writes (`written`) and then those it reads.
    pub fn places(&self, written: &[&Place], read: &[&Place]) -> KernelParams {
        let params = written.iter().fold(KernelParams::new(), |p, place| self.write(p, place));
        read.iter().fold(params, |p, place| self.read(p, place))
    }

    /// Whether every place starts 16-byte aligned (the kernels' vector paths).
    pub fn aligned(&self, places: &[&Place]) -> bool {
        places.iter().all(|place| match place.space {
            Space::Stats => self.f32(place).is_aligned(16),
            Space::Tokens => self.tokens(place).is_aligned(16),
            _ => self.bf16(place).is_aligned(16),
        })
    }

    /// The f32 scratch of column sums (`column_partials_len` of the schedule's widest).
    pub fn column_partials(&self) -> DeviceSliceMut<'a, f32> {
        self.column_partials.as_slice_mut()
    }

    /// A bf16 place as a cuBLASLt operand.
    fn operand(&self, place: &Place) -> Operand<'a> {
        Operand::of(self.bf16_buffer(place.space), place.offset)
    }
}

fn flag(value: bool) -> u32 {
    u32::from(value)
}

impl<X: CudaLayerKernel, L: CudaLayers<X>> CudaRunner<X, L> {
    /// The buffers of one call.
    fn ctx<'a>(
        &'a self,
        params: &'a CudaBuffer<bf16>,
        grads: Option<&'a CudaBuffer<bf16>>,
    ) -> LayerCtx<'a> {
        LayerCtx {
            device: &self.device,
            stream: self.compute(),
            kernels: &self.kernels,
            blas: &self.blas,
            tokens: &self.tokens,
            acts: &self.acts,
            act_grads: &self.act_grads,
            stats: &self.stats,
            column_partials: &self.column_partials,
            params,
            grads,
        }
    }

    /// Queues `op`; `loss_scale` scales the gradient of the loss (backward only).
    pub(super) fn run(
        &self,
        op: &Op<X>,
        params: &CudaBuffer<bf16>,
        grads: Option<&CudaBuffer<bf16>>,
        loss_scale: f64,
    ) -> Result<(), NnError> {
        let v = self.ctx(params, grads);
        let a = &op.args;
        match &op.kind {
            OpKind::Kernel(kernel) => self.run_kernel(&v, kernel, a, loss_scale),
            &OpKind::MatmulBiasGelu { c, oc, layout } => {
                // [out after GELU, pre-GELU, inp, weight, bias]
                let layer = Linear { inp: &a[2], weight: &a[3], c, oc, layout };
                v.matmul_forward(&layer, &a[0], Some(&a[4]), Some(&a[1]))
            }
            &OpKind::MatmulBackwardDGelu { c, oc, layout, bias } => {
                // [d pre-GELU, dweight, (dbias), dout, inp, weight, pre-GELU]
                let (dbias, rest) = if bias { (Some(&a[2]), &a[3..]) } else { (None, &a[2..]) };
                let grads = MatmulGrads { dinp: &a[0], dweight: &a[1], dbias };
                let layer = Linear { inp: &rest[1], weight: &rest[2], c, oc, layout };
                v.matmul_backward(&layer, grads, &rest[0], Some(&rest[3]))
            }
        }
    }

    fn run_kernel(
        &self,
        v: &LayerCtx<'_>,
        kernel: &Kernel<X>,
        a: &[Place],
        loss_scale: f64,
    ) -> Result<(), NnError> {
        match *kernel {
            Kernel::Zero { .. } => {
                for place in a {
                    let buffer = v.bf16_buffer(place.space);
                    let range = place.offset..place.end();
                    self.device.fill(self.compute(), buffer, range, bf16::ZERO)?;
                }
                Ok(())
            }
            Kernel::Encoder { t, c, .. } => v.encoder_forward(a, t, c),
            Kernel::EncoderBackward { t, c } => v.encoder_backward(a, t, c),
            Kernel::Matmul { c, oc, layout, bias } => {
                // [out, inp, weight, (bias)]
                let layer = Linear { inp: &a[1], weight: &a[2], c, oc, layout };
                v.matmul_forward(&layer, &a[0], bias.then(|| &a[3]), None)
            }
            Kernel::MatmulBackward { c, oc, layout, bias } => {
                // [dinp, dweight, (dbias), dout, inp, weight]
                let (dbias, rest) = if bias { (Some(&a[2]), &a[3..]) } else { (None, &a[2..]) };
                let grads = MatmulGrads { dinp: &a[0], dweight: &a[1], dbias };
                let layer = Linear { inp: &rest[1], weight: &rest[2], c, oc, layout };
                v.matmul_backward(&layer, grads, &rest[0], None)
            }
            Kernel::Attention(_) => {
                // [out, att, qkv, (positions)]
                let (out, att, qkv) = (v.bf16_mut(&a[0]), v.bf16_mut(&a[1]), v.bf16(&a[2]));
                let (attention, stream) = (self.gemm_attention(), self.compute());
                let queued = match a.get(3) {
                    None => attention.forward(stream, qkv, out, att),
                    Some(positions) => {
                        attention.forward_packed(stream, qkv, v.tokens(positions), out, att)
                    }
                };
                Ok(queued?)
            }
            Kernel::AttentionBackward(_) => {
                // [dqkv, dscores (scratch), dout, qkv, att, (positions)]
                let (dqkv, dscores) = (v.bf16_mut(&a[0]), v.bf16_mut(&a[1]));
                let (dout, qkv, att) = (v.bf16(&a[2]), v.bf16(&a[3]), v.bf16(&a[4]));
                let (attention, stream) = (self.gemm_attention(), self.compute());
                let queued = match a.get(5) {
                    None => attention.backward(stream, dout, qkv, att, dqkv, dscores),
                    Some(positions) => {
                        let positions = v.tokens(positions);
                        attention.backward_packed(stream, dout, qkv, att, positions, dqkv)
                    }
                };
                Ok(queued?)
            }
            Kernel::FlashAttention(_) => {
                // [out, lse (f32, in Stats), qkv, (positions)]
                let (out, lse, qkv) = (v.bf16_mut(&a[0]), v.f32_mut(&a[1]), v.bf16(&a[2]));
                let (flash, stream) = (self.flash_attention(), self.compute());
                let queued = match a.get(3) {
                    None => flash.forward(stream, qkv, out, lse),
                    Some(positions) => {
                        flash.forward_packed(stream, qkv, v.tokens(positions), out, lse)
                    }
                };
                Ok(queued?)
            }
            Kernel::FlashAttentionBackward(_) => {
                // [dqkv (overwritten: the schedule checks it is its first write), dout, qkv, out,
                // lse, (positions)]
                let dqkv = v.bf16_mut(&a[0]);
                let (dout, qkv, out, lse) =
                    (v.bf16(&a[1]), v.bf16(&a[2]), v.bf16(&a[3]), v.f32(&a[4]));
                let (flash, stream) = (self.flash_attention(), self.compute());
                let queued = match a.get(5) {
                    None => flash.backward(stream, qkv, out, dout, lse, dqkv),
                    Some(positions) => {
                        let positions = v.tokens(positions);
                        flash.backward_packed(stream, qkv, out, dout, lse, positions, dqkv)
                    }
                };
                Ok(queued?)
            }
            Kernel::Residual => {
                // SAFETY: `residual_forward(bf16_t* out, const bf16_t* a, const bf16_t* b, u64 n,
                // u32 vec)` is an element-wise kernel of the form `elementwise` asks for.
                unsafe { v.elementwise(&self.kernels.residual_forward, a, 1, &[]) }
            }
            Kernel::ResidualBackward => {
                let flags = [a[0].accumulate, a[1].accumulate];
                // SAFETY: `residual_backward(bf16_t* da, bf16_t* db, const bf16_t* dout, u64 n,
                // u32 vec, u32 accumulate_a, u32 accumulate_b)`: element-wise, two outputs first.
                unsafe { v.elementwise(&self.kernels.residual_backward, a, 2, &flags) }
            }
            Kernel::SoftmaxXent { vocab, padded_vocab } => {
                v.softmax_xent_forward(a, vocab, padded_vocab)
            }
            Kernel::MeanLoss => {
                // [loss, losses, targets]
                let params = v.places(&[&a[0]], &[&a[1], &a[2]]).u32(a[1].len as u32);
                // SAFETY: the parameters match `mean_loss(float* loss, const float* losses, const
                // u32* targets, u32 n)`, the first two f32 statistics of the schedule and the
                // third the `n` targets; one block of 1024 threads reads the `n` losses and
                // targets and writes the one loss.
                unsafe { v.launch(&self.kernels.mean_loss, 1, 1024, params) }
            }
            Kernel::SoftmaxXentBackward { .. } => {
                let Kernel::SoftmaxXentBackward { vocab, padded_vocab, dloss } =
                    kernel.with_loss_scale(loss_scale)
                else {
                    unreachable!("with_loss_scale keeps the kernel")
                };
                v.softmax_xent_backward(a, vocab, padded_vocab, dloss as f32)
            }
            Kernel::Layer(ref kernel) => self.layers.run(v, kernel, a),
        }
    }
}

impl LayerCtx<'_> {
    /// Queues `function` on the compute stream.
    ///
    /// # Safety
    /// `params` must be the parameters `function` declares, in order and type, made of places of
    /// this operation (which the schedule checked against their buffers), and the kernel must
    /// touch only the elements the sizes passed with them cover.
    pub unsafe fn launch(
        &self,
        function: &CudaFunction,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        params: KernelParams,
    ) -> Result<(), NnError> {
        // SAFETY: the caller's obligations above are the launch's.
        unsafe { self.device.launch(self.stream, function, grid, block, 0, &params) }?;
        Ok(())
    }

    /// An element-wise kernel over `a` (the `outputs` first, all of one length), with `flags`
    /// after the length and the vector flag.
    ///
    /// # Safety
    /// `function` must take `(T* outputs…, const T* inputs…, u64 n, u32 vec, u32 flags…)`, bf16
    /// pointers, as many as `a` has places, and touch elements `0..n` of each (16-byte vectors
    /// where `vec` is 1, which needs every pointer 16-byte aligned).
    pub unsafe fn elementwise(
        &self,
        function: &CudaFunction,
        a: &[Place],
        outputs: usize,
        flags: &[bool],
    ) -> Result<(), NnError> {
        let n = a[0].len;
        debug_assert!(a.iter().all(|place| place.len == n));
        // No allocation per launch: the slices go straight into the parameters.
        let vec = a.iter().all(|place| self.aligned(&[place]));
        let (written, read) = a.split_at(outputs);
        let params = written.iter().fold(KernelParams::new(), |p, place| self.write(p, place));
        let mut params = read.iter().fold(params, |p, place| self.read(p, place));
        params = params.u64(n as u64).u32(flag(vec));
        for &f in flags {
            params = params.u32(flag(f));
        }
        let work = if vec { n / 8 + n % 8 } else { n };
        // SAFETY: the caller vouches for the kernel's form; the places are this operation's.
        unsafe { self.launch(function, blocks_for(work), THREADS, params) }
    }

    /// `out[j] += Σ_chunk partials[first + chunk · stride + j]` for `j < cols`: the second step
    /// of a column sum whose first wrote [`column_partials`](Self::column_partials).
    pub fn column_sum_finish(
        &self,
        out: DeviceSliceMut<'_, bf16>,
        first: usize,
        chunks: usize,
        stride: usize,
        cols: usize,
    ) -> Result<(), NnError> {
        let read_end = first + chunks.saturating_sub(1) * stride + cols;
        if out.len() < cols || (chunks > 0 && read_end > self.column_partials.len()) {
            return Err(NnError::Kernel {
                kernel: "column_sum_finish",
                reason: format!(
                    "{cols} columns of {chunks} chunks (stride {stride}, from {first}) do not fit \
                     {} output elements and {} partials",
                    out.len(),
                    self.column_partials.len()
                ),
            });
        }
        let params = KernelParams::new()
            .slice_mut(out)
            .ptr(self.column_partials, first)
            .u32(chunks as u32)
            .u32(stride as u32)
            .u32(cols as u32);
        // SAFETY: the parameters match `column_sum_finish(bf16_t* out, const float* partial, u32
        // chunks, u32 chunk_stride, u32 cols)`; it reads `partial[first + chunk · stride + j]`
        // and updates `out[j]` for `j < cols`, both inside their buffers (checked above).
        unsafe { self.launch(&self.kernels.column_sum_finish, blocks_for(cols), THREADS, params) }
    }

    /// `dbias += Σ_rows dout` for `dout [rows, cols]`.
    fn bias_grad(
        &self,
        dbias: DeviceSliceMut<'_, bf16>,
        dout: DeviceSlice<'_, bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), NnError> {
        let chunks = chunks_for(rows);
        debug_assert!(chunks * cols <= self.column_partials.len());
        let params = KernelParams::new()
            .ptr(self.column_partials, 0)
            .slice(dout)
            .u32(rows as u32)
            .u32(cols as u32)
            .u32(ROWS_PER_CHUNK as u32);
        let grid = (cols.div_ceil(32) as u32, chunks as u32);
        // SAFETY: the parameters match `column_sum_partial(float* partial, const bf16_t* dout, u32
        // rows, u32 cols, u32 rows_per_chunk)`; block (x, y) reads rows of chunk y of columns 32x
        // .. 32x + 31 of dout (`rows · cols`, its place) and writes `partial[y · cols + column]`,
        // inside the partials (`column_partials_len` covers the widest bias).
        unsafe { self.launch(&self.kernels.column_sum_partial, grid, (32, 8), params) }?;
        self.column_sum_finish(dbias, 0, chunks, cols, cols)
    }

    /// [probs, losses, logits, targets]
    fn softmax_xent_forward(
        &self,
        a: &[Place],
        vocab: usize,
        padded_vocab: usize,
    ) -> Result<(), NnError> {
        let rows = a[0].len / padded_vocab;
        let [probs, losses, logits, targets] = [0, 1, 2, 3].map(|i| &a[i]);
        let vec = padded_vocab.is_multiple_of(8) && self.aligned(&[probs, logits]);
        let params = self
            .places(&[probs, losses], &[logits, targets])
            .u32(vocab as u32)
            .u32(padded_vocab as u32)
            .u32(flag(vec));
        let width = if vec { 8 } else { 1 };
        let threads = (padded_vocab / width).next_multiple_of(32).clamp(32, 1024) as u32;
        // SAFETY: the parameters match `softmax_xent_forward(bf16_t* probs, float* losses, const
        // bf16_t* logits, const u32* targets, u32 vocab, u32 padded_vocab, u32 vec)`; block `r`
        // reads row `r` of logits and target `r` and writes row `r` of probs and loss `r` (in
        // 16-byte vectors only where `vec`: rows of whole aligned vectors).
        unsafe { self.launch(&self.kernels.softmax_xent_forward, rows as u32, threads, params) }
    }

    /// [dlogits, probs, targets]
    fn softmax_xent_backward(
        &self,
        a: &[Place],
        vocab: usize,
        padded_vocab: usize,
        dloss: f32,
    ) -> Result<(), NnError> {
        let rows = a[0].len / padded_vocab;
        let [dlogits, probs, targets] = [0, 1, 2].map(|i| &a[i]);
        let vec = padded_vocab.is_multiple_of(8) && self.aligned(&[dlogits, probs]);
        let params = self
            .places(&[dlogits], &[probs, targets])
            .u32(rows as u32)
            .u32(vocab as u32)
            .u32(padded_vocab as u32)
            .f32(dloss)
            .u32(flag(a[0].accumulate))
            .u32(flag(vec));
        let work = rows * padded_vocab / if vec { 8 } else { 1 };
        let function = &self.kernels.softmax_xent_backward;
        // SAFETY: the parameters match `softmax_xent_backward(bf16_t* dlogits, const bf16_t*
        // probs, const u32* targets, u32 rows, u32 vocab, u32 padded_vocab, float dloss, u32
        // accumulate, u32 vec)`; a grid-stride loop over the `rows · padded_vocab` elements of
        // dlogits and probs (in 16-byte vectors only where `vec`: rows of whole aligned vectors).
        unsafe { self.launch(function, blocks_for(work), THREADS, params) }
    }

    /// `out = inp · W (+ bias)`, or with `pre_gelu`, `pre_gelu = inp · W + bias; out =
    /// gelu(pre_gelu)` (cuBLASLt's `BiasGelu` epilogue).
    fn matmul_forward(
        &self,
        layer: &Linear<'_>,
        out: &Place,
        bias: Option<&Place>,
        pre_gelu: Option<&Place>,
    ) -> Result<(), NnError> {
        let Linear { inp, weight, c, oc, layout } = *layer;
        let rows = inp.len / c;
        let problem = match layout {
            // out[rows, oc] = inp[rows, c] · weight[c, oc]
            WeightLayout::InOut => Matmul::row_major(rows, oc, c, false, false),
            // out[rows, oc] = inp[rows, c] · weight[oc, c]ᵀ
            WeightLayout::OutIn => Matmul::linear_forward(rows, c, oc),
        };
        let mut operands =
            MatmulOperands::row_major(self.operand(inp), self.operand(weight), self.operand(out));
        let epilogue = match (bias, pre_gelu) {
            (Some(bias), Some(pre_gelu)) => {
                operands = operands.with_bias(self.operand(bias)).with_aux(self.operand(pre_gelu));
                Epilogue::BiasGelu
            }
            (Some(bias), None) => {
                operands = operands.with_bias(self.operand(bias));
                Epilogue::Bias
            }
            (None, None) => Epilogue::None,
            (None, Some(_)) => unreachable!("the schedule fuses GELU only after a bias"),
        };
        let problem = problem.with_epilogue(epilogue);
        Ok(self.blas.matmul(self.stream, &problem, operands)?)
    }

    /// `dinp (+)= dout · Wᵀ` (times `gelu'(pre_gelu)` with `pre_gelu`, cuBLASLt's `DGelu`),
    /// `dweight += inpᵀ · dout` in the weight's layout, `dbias += Σ_rows dout`.
    fn matmul_backward(
        &self,
        layer: &Linear<'_>,
        grads: MatmulGrads<'_>,
        dout: &Place,
        pre_gelu: Option<&Place>,
    ) -> Result<(), NnError> {
        let Linear { inp, weight, c, oc, layout } = *layer;
        let rows = dout.len / oc;
        let beta = if grads.dinp.accumulate { 1.0 } else { 0.0 };
        let problem = match layout {
            // dinp[rows, c] = dout[rows, oc] · weight[c, oc]ᵀ
            WeightLayout::InOut => Matmul::row_major(rows, c, oc, false, true),
            // dinp[rows, c] = dout[rows, oc] · weight[oc, c]
            WeightLayout::OutIn => Matmul::linear_backward_input(rows, c, oc),
        };
        let mut operands = MatmulOperands::row_major(
            self.operand(dout),
            self.operand(weight),
            self.operand(grads.dinp),
        );
        let mut problem = problem.with_beta(beta);
        if let Some(pre_gelu) = pre_gelu {
            debug_assert!(!grads.dinp.accumulate, "DGelu overwrites");
            operands = operands.with_aux(self.operand(pre_gelu));
            problem = problem.with_epilogue(Epilogue::DGelu);
        }
        self.blas.matmul(self.stream, &problem, operands)?;
        let (problem, x, y) = match layout {
            // dweight[c, oc] += inp[rows, c]ᵀ · dout[rows, oc]
            WeightLayout::InOut => (Matmul::row_major(c, oc, rows, true, false), inp, dout),
            // dweight[oc, c] += dout[rows, oc]ᵀ · inp[rows, c]
            WeightLayout::OutIn => (Matmul::linear_backward_weight(rows, c, oc), dout, inp),
        };
        let operands = MatmulOperands::row_major(
            self.operand(x),
            self.operand(y),
            self.operand(grads.dweight),
        );
        self.blas.matmul(self.stream, &problem.with_beta(1.0), operands)?;
        match grads.dbias {
            Some(dbias) => self.bias_grad(self.bf16_mut(dbias), self.bf16(dout), rows, oc),
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
