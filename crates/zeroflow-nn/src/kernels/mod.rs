//! The layer math, llm.c style: every kernel a pure function over slices, forward and backward
//! side by side, generic over [`Float`] so that the device runs it in f32 and the tests in f64.
//!
//! A [`Kernel`] names one launch of one of these functions with its sizes; [`run`] calls it with
//! the launch's arguments ([`ArgSlices`]). The order of the arguments of each kernel is fixed here
//! and in [`crate::plan`], which builds the launches.

pub mod attention;
pub mod encoder;
pub mod layernorm;
pub mod loss;
pub mod matmul;
pub mod pointwise;

pub use matmul::WeightLayout;

use crate::float::Float;

/// One kernel launch's sizes. The comment lists the arguments in order (W: written or updated,
/// R: read, T: tokens).
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// W out (`ranges` arguments, each zeroed).
    Zero { ranges: usize },
    /// W out, T tokens, R wte, R wpe.
    Encoder { t: usize, c: usize, vocab: usize },
    /// W dwte, W dwpe, R dout, T tokens.
    EncoderBackward { t: usize, c: usize },
    /// W out, W mean, W rstd, R inp, R weight, R bias.
    LayerNorm { c: usize },
    /// W dinp, W dweight, W dbias, R dout, R inp, R weight, R mean, R rstd.
    LayerNormBackward { c: usize },
    /// W out, R inp, R weight, [R bias].
    Matmul { c: usize, oc: usize, layout: WeightLayout, bias: bool },
    /// W dinp, W dweight, [W dbias], R dout, R inp, R weight.
    MatmulBackward { c: usize, oc: usize, layout: WeightLayout, bias: bool },
    /// W out, W att, R qkv.
    Attention { t: usize, c: usize, n_head: usize },
    /// W dqkv, W dscores (scratch), R dout, R qkv, R att.
    AttentionBackward { t: usize, c: usize, n_head: usize },
    /// W out, W lse, R qkv: [`Kernel::Attention`] keeping only the log-sum-exp of each query row.
    FlashAttention { t: usize, c: usize, n_head: usize },
    /// W dqkv, R dout, R qkv, R out, R lse.
    FlashAttentionBackward { t: usize, c: usize, n_head: usize },
    /// W out, R inp.
    Gelu,
    /// W dinp, R inp, R dout.
    GeluBackward,
    /// W out, R a, R b.
    Residual,
    /// W da, W db, R dout.
    ResidualBackward,
    /// W probs, W losses, R logits, T targets.
    SoftmaxXent { vocab: usize, padded_vocab: usize },
    /// W loss (one element), R losses.
    MeanLoss,
    /// W dlogits, R probs, T targets.
    SoftmaxXentBackward { vocab: usize, padded_vocab: usize, dloss: f64 },
}

impl Kernel {
    /// The kernel's name, for launches and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Kernel::Zero { .. } => "zero",
            Kernel::Encoder { .. } => "encoder_forward",
            Kernel::EncoderBackward { .. } => "encoder_backward",
            Kernel::LayerNorm { .. } => "layernorm_forward",
            Kernel::LayerNormBackward { .. } => "layernorm_backward",
            Kernel::Matmul { .. } => "matmul_forward",
            Kernel::MatmulBackward { .. } => "matmul_backward",
            Kernel::Attention { .. } => "attention_forward",
            Kernel::AttentionBackward { .. } => "attention_backward",
            Kernel::FlashAttention { .. } => "flash_attention_forward",
            Kernel::FlashAttentionBackward { .. } => "flash_attention_backward",
            Kernel::Gelu => "gelu_forward",
            Kernel::GeluBackward => "gelu_backward",
            Kernel::Residual => "residual_forward",
            Kernel::ResidualBackward => "residual_backward",
            Kernel::SoftmaxXent { .. } => "softmax_xent_forward",
            Kernel::MeanLoss => "mean_loss",
            Kernel::SoftmaxXentBackward { .. } => "softmax_xent_backward",
        }
    }

    /// This launch's kernel for an objective `loss_scale` × mean loss (the plan's backward is for
    /// `loss_scale` 1).
    pub fn with_loss_scale(&self, loss_scale: f64) -> Kernel {
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
    fn read(&self, i: usize) -> &'a [F] {
        match self.slots[i] {
            Slot::Read(slice) => slice,
            _ => panic!("argument {i} is not a read argument"),
        }
    }

    /// Argument `i`, writable.
    ///
    /// # Panics
    /// If argument `i` is not a written argument or was taken already (a bug in the plan).
    fn write(&mut self, i: usize) -> &'a mut [F] {
        match &mut self.slots[i] {
            Slot::Write(slice) => slice.take().expect("a written argument is taken once"),
            _ => panic!("argument {i} is not a written argument"),
        }
    }

    /// Argument `i`, token ids.
    ///
    /// # Panics
    /// If argument `i` is not a token argument (a bug in the plan).
    fn tokens(&self, i: usize) -> &'a [u32] {
        match self.slots[i] {
            Slot::Tokens(slice) => slice,
            _ => panic!("argument {i} is not a token argument"),
        }
    }
}

/// Runs `kernel` on `args`. The only failures are bad data (a token id out of range).
pub fn run<F: Float>(kernel: &Kernel, a: &mut ArgSlices<'_, F>) -> Result<(), String> {
    match *kernel {
        Kernel::Zero { ranges } => (0..ranges).for_each(|i| pointwise::zero(a.write(i))),
        Kernel::Encoder { t, c, vocab } => {
            let out = a.write(0);
            encoder::encoder_forward(out, a.tokens(1), a.read(2), a.read(3), t, c, vocab)?;
        }
        Kernel::EncoderBackward { t, c } => {
            let (dwte, dwpe) = (a.write(0), a.write(1));
            encoder::encoder_backward(dwte, dwpe, a.read(2), a.tokens(3), t, c);
        }
        Kernel::LayerNorm { c } => {
            let (out, mean, rstd) = (a.write(0), a.write(1), a.write(2));
            layernorm::layernorm_forward(out, mean, rstd, a.read(3), a.read(4), a.read(5), c);
        }
        Kernel::LayerNormBackward { c } => {
            let (dinp, dweight, dbias) = (a.write(0), a.write(1), a.write(2));
            let (dout, inp, weight, mean, rstd) =
                (a.read(3), a.read(4), a.read(5), a.read(6), a.read(7));
            layernorm::layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, c);
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
        Kernel::Attention { t, c, n_head } => {
            let (out, att) = (a.write(0), a.write(1));
            attention::attention_forward(out, att, a.read(2), t, c, n_head);
        }
        Kernel::AttentionBackward { t, c, n_head } => {
            let (dqkv, dscores) = (a.write(0), a.write(1));
            let (dout, qkv, att) = (a.read(2), a.read(3), a.read(4));
            attention::attention_backward(dqkv, dscores, dout, qkv, att, t, c, n_head);
        }
        Kernel::FlashAttention { t, c, n_head } => {
            let (out, lse) = (a.write(0), a.write(1));
            attention::flash_attention_forward(out, lse, a.read(2), t, c, n_head);
        }
        Kernel::FlashAttentionBackward { t, c, n_head } => {
            let dqkv = a.write(0);
            let (dout, qkv, out, lse) = (a.read(1), a.read(2), a.read(3), a.read(4));
            attention::flash_attention_backward(dqkv, dout, qkv, out, lse, t, c, n_head);
        }
        Kernel::Gelu => pointwise::gelu_forward(a.write(0), a.read(1)),
        Kernel::GeluBackward => pointwise::gelu_backward(a.write(0), a.read(1), a.read(2)),
        Kernel::Residual => pointwise::residual_forward(a.write(0), a.read(1), a.read(2)),
        Kernel::ResidualBackward => {
            let (da, db) = (a.write(0), a.write(1));
            pointwise::residual_backward(da, db, a.read(2));
        }
        Kernel::SoftmaxXent { vocab, padded_vocab } => {
            let (probs, losses) = (a.write(0), a.write(1));
            loss::softmax_xent_forward(probs, losses, a.read(2), a.tokens(3), vocab, padded_vocab)?;
        }
        Kernel::MeanLoss => loss::mean_loss(a.write(0), a.read(1)),
        Kernel::SoftmaxXentBackward { vocab, padded_vocab, dloss } => {
            let dlogits = a.write(0);
            let (probs, targets) = (a.read(1), a.tokens(2));
            loss::softmax_xent_backward(dlogits, probs, targets, F::of(dloss), vocab, padded_vocab);
        }
    }
    Ok(())
}
