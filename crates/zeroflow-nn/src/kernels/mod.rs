//! The shared layer math, llm.c style: every kernel a pure function over slices, forward and
//! backward side by side, generic over [`Float`] so that the device runs it in f32 and the tests in
//! f64.
//!
//! A [`Kernel`] names one launch of one of these functions with its sizes, or of a model family's
//! own kernel ([`Kernel::Layer`], a [`LayerKernel`]); [`run`] calls it with the launch's arguments
//! ([`ArgSlices`]). The order of the arguments of each kernel is fixed here and in the family's
//! plan, which builds the launches.

pub mod attention;
pub mod encoder;
#[cfg(target_arch = "x86_64")]
mod few_rows_avx2;
pub mod loss;
pub mod matmul;
pub mod pointwise;

use std::fmt::Debug;

pub use attention::AttentionShape;
pub use matmul::WeightLayout;

use crate::float::Float;

/// A kernel of a model family (its norm or activation, say), beside the shared ones of
/// [`Kernel`]: what the plan IR and the host executors need of it.
pub trait LayerKernel: Clone + Debug + PartialEq + Send + Sync + 'static {
    /// The kernel's name, for launches and error messages.
    fn name(&self) -> &'static str;

    /// Runs the kernel on `args` (in the order the family's plan gives them). The only failures
    /// are bad data.
    fn run<F: Float>(&self, args: &mut ArgSlices<'_, F>) -> Result<(), String>;

    /// Whether the CUDA executor may fuse this kernel into the matmul before it (or after it,
    /// backward) as a cuBLASLt epilogue, and as which.
    fn fusable(&self) -> Option<Fusable> {
        None
    }
}

/// An activation a cuBLASLt epilogue computes, so that the CUDA executor can fuse a family's
/// kernel that computes it into the neighbouring matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fusable {
    /// `out = gelu(inp)` (tanh approximation), arguments W out, R inp (cuBLASLt's `BiasGelu`).
    Gelu,
    /// `dinp (+)= gelu'(inp) · dout`, arguments W dinp, R inp, R dout (cuBLASLt's `DGelu`).
    GeluBackward,
}

/// The kernel of a family without kernels of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoLayers {}

impl LayerKernel for NoLayers {
    fn name(&self) -> &'static str {
        match *self {}
    }

    fn run<F: Float>(&self, _: &mut ArgSlices<'_, F>) -> Result<(), String> {
        match *self {}
    }
}

/// One kernel launch's sizes. The comment lists the arguments in order (W: written or updated,
/// R: read, T: tokens). An argument in brackets is optional: `[T positions]`, each token's
/// position in its document ([`crate::plan::Buf::Positions`]), is last where the plan is packed
/// and absent otherwise.
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel<X> {
    /// W out (`ranges` arguments, each zeroed).
    Zero { ranges: usize },
    /// W out, T tokens, R wte, R wpe, [T positions] (packed rows: `wpe` at each token's
    /// position in its document, not at its index in the row).
    Encoder { t: usize, c: usize, vocab: usize },
    /// W dwte, W dwpe, R dout, T tokens, [T positions].
    EncoderBackward { t: usize, c: usize },
    /// W out, R inp, R weight, [R bias].
    Matmul { c: usize, oc: usize, layout: WeightLayout, bias: bool },
    /// W dinp, W dweight, [W dbias], R dout, R inp, R weight.
    MatmulBackward { c: usize, oc: usize, layout: WeightLayout, bias: bool },
    /// W out, W att, R qkv, [T positions] (packed rows: no attention across documents,
    /// [`attention::attention_forward_packed`]).
    Attention(AttentionShape),
    /// W dqkv, W dscores (scratch), R dout, R qkv, R att, [T positions].
    AttentionBackward(AttentionShape),
    /// W out, W lse, R qkv, [T positions]: [`Kernel::Attention`] keeping only the log-sum-exp of
    /// each query row.
    FlashAttention(AttentionShape),
    /// W dqkv, R dout, R qkv, R out, R lse, [T positions].
    FlashAttentionBackward(AttentionShape),
    /// W out, R a, R b.
    Residual,
    /// W da, W db, R dout.
    ResidualBackward,
    /// W probs, W losses, R logits, T targets.
    SoftmaxXent { vocab: usize, padded_vocab: usize },
    /// W loss (one element), R losses, T targets: the mean over the targets that are not
    /// [`loss::IGNORE`].
    MeanLoss,
    /// W dlogits, R probs, T targets: the gradient of `dloss × Σ losses` (a plan's `dloss` is
    /// `1 / positions`: the mean over every position, the ignored ones losing 0, which is the
    /// mean loss where none is ignored; the trainer reweights by the counted targets).
    SoftmaxXentBackward { vocab: usize, padded_vocab: usize, dloss: f64 },
    /// A kernel of the model family, its arguments in the order it documents.
    Layer(X),
}

impl<X: LayerKernel> Kernel<X> {
    /// The kernel's name, for launches and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Zero { .. } => "zero",
            Kernel::Encoder { .. } => "encoder_forward",
            Kernel::EncoderBackward { .. } => "encoder_backward",
            Kernel::Matmul { .. } => "matmul_forward",
            Kernel::MatmulBackward { .. } => "matmul_backward",
            Kernel::Attention { .. } => "attention_forward",
            Kernel::AttentionBackward { .. } => "attention_backward",
            Kernel::FlashAttention { .. } => "flash_attention_forward",
            Kernel::FlashAttentionBackward { .. } => "flash_attention_backward",
            Kernel::Residual => "residual_forward",
            Kernel::ResidualBackward => "residual_backward",
            Kernel::SoftmaxXent { .. } => "softmax_xent_forward",
            Kernel::MeanLoss => "mean_loss",
            Kernel::SoftmaxXentBackward { .. } => "softmax_xent_backward",
            Kernel::Layer(kernel) => kernel.name(),
        }
    }

    /// What a cuBLASLt epilogue may fuse of this kernel ([`LayerKernel::fusable`]).
    pub fn fusable(&self) -> Option<Fusable> {
        match self {
            Kernel::Layer(kernel) => kernel.fusable(),
            _ => None,
        }
    }

    /// This launch's kernel for an objective `loss_scale` × mean loss (the plan's backward is for
    /// `loss_scale` 1).
    pub fn with_loss_scale(&self, loss_scale: f64) -> Kernel<X> {
        match *self {
            Kernel::SoftmaxXentBackward { vocab, padded_vocab, dloss } => {
                Kernel::SoftmaxXentBackward { vocab, padded_vocab, dloss: dloss * loss_scale }
            }
            ref other => other.clone(),
        }
    }
}

/// One argument of a running kernel.
#[derive(Debug)]
pub enum Slot<'a, F> {
    Read(&'a [F]),
    /// Written (or updated in place); taken once.
    Write(Option<&'a mut [F]>),
    Tokens(&'a [u32]),
}

/// The arguments of a running kernel, in the order its [`Kernel`] variant lists.
#[derive(Debug)]
pub struct ArgSlices<'a, F> {
    slots: Vec<Slot<'a, F>>,
}

impl<'a, F: Float> ArgSlices<'a, F> {
    pub fn new(slots: Vec<Slot<'a, F>>) -> Self {
        ArgSlices { slots }
    }

    /// Argument `i`, read-only.
    ///
    /// # Panics
    /// If argument `i` is not a read argument (a bug in the plan).
    pub fn read(&self, i: usize) -> &'a [F] {
        match self.slots[i] {
            Slot::Read(slice) => slice,
            _ => panic!("argument {i} is not a read argument"),
        }
    }

    /// Argument `i`, writable.
    ///
    /// # Panics
    /// If argument `i` is not a written argument or was taken already (a bug in the plan).
    pub fn write(&mut self, i: usize) -> &'a mut [F] {
        match &mut self.slots[i] {
            Slot::Write(slice) => slice.take().expect("a written argument is taken once"),
            _ => panic!("argument {i} is not a written argument"),
        }
    }

    /// Argument `i` if the launch has it: the optional token ids that come last (a packed plan's
    /// positions).
    ///
    /// # Panics
    /// If argument `i` is there but not a token argument (a bug in the plan).
    pub fn optional_tokens(&self, i: usize) -> Option<&'a [u32]> {
        (i < self.slots.len()).then(|| self.tokens(i))
    }

    /// Argument `i`, token ids.
    ///
    /// # Panics
    /// If argument `i` is not a token argument (a bug in the plan).
    pub fn tokens(&self, i: usize) -> &'a [u32] {
        match self.slots[i] {
            Slot::Tokens(slice) => slice,
            _ => panic!("argument {i} is not a token argument"),
        }
    }
}

/// Runs `kernel` on `args`. The only failures are bad data (a token id out of range).
pub fn run<F: Float, X: LayerKernel>(
    kernel: &Kernel<X>,
    a: &mut ArgSlices<'_, F>,
) -> Result<(), String> {
    match *kernel {
        Kernel::Zero { ranges } => (0..ranges).for_each(|i| pointwise::zero(a.write(i))),
        Kernel::Encoder { t, c, vocab } => {
            let out = a.write(0);
            let (tokens, wte, wpe) = (a.tokens(1), a.read(2), a.read(3));
            match a.optional_tokens(4) {
                None => encoder::encoder_forward(out, tokens, wte, wpe, t, c, vocab)?,
                Some(positions) => {
                    let position = |row: usize| positions[row] as usize;
                    encoder::encoder_forward_at(out, tokens, wte, wpe, c, vocab, position)?;
                }
            }
        }
        Kernel::EncoderBackward { t, c } => {
            let (dwte, dwpe) = (a.write(0), a.write(1));
            let (dout, tokens) = (a.read(2), a.tokens(3));
            match a.optional_tokens(4) {
                None => encoder::encoder_backward(dwte, dwpe, dout, tokens, t, c),
                Some(positions) => {
                    let position = |row: usize| positions[row] as usize;
                    encoder::encoder_backward_at(dwte, dwpe, dout, tokens, c, position);
                }
            }
        }
        Kernel::Matmul { c, oc, layout, bias } => {
            let out = a.write(0);
            let bias = bias.then(|| a.read(3));
            matmul::matmul_forward(out, a.read(1), a.read(2), bias, c, oc, layout);
        }
        Kernel::MatmulBackward { c, oc, layout, bias } => {
            let (dinp, dweight) = (a.write(0), a.write(1));
            let dbias = bias.then(|| a.write(2));
            let first = if bias { 3 } else { 2 };
            let (dout, inp, weight) = (a.read(first), a.read(first + 1), a.read(first + 2));
            matmul::matmul_backward(dinp, dweight, dbias, dout, inp, weight, c, oc, layout);
        }
        Kernel::Attention(shape) => {
            let (out, att) = (a.write(0), a.write(1));
            match a.optional_tokens(3) {
                None => attention::attention_forward(out, att, a.read(2), shape),
                Some(positions) => {
                    attention::attention_forward_packed(out, att, a.read(2), positions, shape);
                }
            }
        }
        Kernel::AttentionBackward(shape) => {
            let (dqkv, dscores) = (a.write(0), a.write(1));
            let (dout, qkv, att) = (a.read(2), a.read(3), a.read(4));
            match a.optional_tokens(5) {
                None => attention::attention_backward(dqkv, dscores, dout, qkv, att, shape),
                Some(positions) => attention::attention_backward_packed(
                    dqkv, dscores, dout, qkv, att, positions, shape,
                ),
            }
        }
        Kernel::FlashAttention(shape) => {
            let (out, lse) = (a.write(0), a.write(1));
            match a.optional_tokens(3) {
                None => attention::flash_attention_forward(out, lse, a.read(2), shape),
                Some(positions) => {
                    attention::flash_attention_forward_packed(
                        out,
                        lse,
                        a.read(2),
                        positions,
                        shape,
                    );
                }
            }
        }
        Kernel::FlashAttentionBackward(shape) => {
            let dqkv = a.write(0);
            let (dout, qkv, out, lse) = (a.read(1), a.read(2), a.read(3), a.read(4));
            match a.optional_tokens(5) {
                None => attention::flash_attention_backward(dqkv, dout, qkv, out, lse, shape),
                Some(positions) => attention::flash_attention_backward_packed(
                    dqkv, dout, qkv, out, lse, positions, shape,
                ),
            }
        }
        Kernel::Residual => pointwise::residual_forward(a.write(0), a.read(1), a.read(2)),
        Kernel::ResidualBackward => {
            let (da, db) = (a.write(0), a.write(1));
            pointwise::residual_backward(da, db, a.read(2));
        }
        Kernel::SoftmaxXent { vocab, padded_vocab } => {
            let (probs, losses) = (a.write(0), a.write(1));
            loss::softmax_xent_forward(probs, losses, a.read(2), a.tokens(3), vocab, padded_vocab)?;
        }
        Kernel::MeanLoss => loss::mean_loss(a.write(0), a.read(1), a.tokens(2)),
        Kernel::SoftmaxXentBackward { vocab, padded_vocab, dloss } => {
            let dlogits = a.write(0);
            let (probs, targets) = (a.read(1), a.tokens(2));
            loss::softmax_xent_backward(dlogits, probs, targets, F::of(dloss), vocab, padded_vocab);
        }
        Kernel::Layer(ref kernel) => kernel.run(a)?,
    }
    Ok(())
}
