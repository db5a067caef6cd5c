//! `CudaGpt` on packed rows (several documents per row, `CudaGptOptions::packed`): the model with
//! tails everywhere (width 200 in 4 heads of 50, vocabulary 301 padded to 320) with gemm
//! attention at rows of 37, and the head-size 64 (3 heads) and 128 models with flash and gemm
//! attention at rows of 70 and 65 (documents crossing and ending on a 64-row tile's edge);
//! documents of uneven lengths, one token among them.
//!
//! - The packed batch's loss is the token-weighted mean of its documents' losses, each run alone
//!   on the GPU by a plain model as a batch of one sequence of its length, within 1e-2 relative
//!   (the bound of the GPU loss checks in `model.rs`: both sides are bf16 runs).
//! - The packed batch's loss, logits and every parameter gradient match the f64 host model's on
//!   the same packed rows: the loss within 1e-2 relative, the logits and each gradient within
//!   2e-2 (`model.rs`'s bounds), run twice (loss scales 1 and 3) so that leftovers in the
//!   activation gradients show and the position embedding's bucketed gradient adds up.

use zeroflow_core::bf16;
use zeroflow_device::{CudaDevice, Device};
use zeroflow_gpt::cuda::CudaGptOptions;
use zeroflow_gpt::{AttentionKind, CudaGpt, GptConfig, HostGpt, PlanOptions, flat_layout};

use crate::gpu;
use crate::model::{
    FLASH_64, FLASH_128, TAILS, TOLERANCE, model_with, random_params, random_tokens, relative_error,
};

/// The largest relative error of a loss on the GPU (bf16 activations) against another.
const LOSS_TOLERANCE: f64 = 1e-2;

/// One packed case: a model, its rows of documents, and the attention.
struct Case {
    config: GptConfig,
    rows: &'static [&'static [usize]],
    attention: AttentionKind,
}

impl Case {
    fn seq(&self) -> usize {
        self.rows[0].iter().sum()
    }

    fn tokens(&self) -> usize {
        self.rows.len() * self.seq()
    }

    /// Each token's position in its document, row by row.
    fn positions(&self) -> Vec<u32> {
        let seq = self.seq();
        assert!(self.rows.iter().all(|lengths| lengths.iter().sum::<usize>() == seq));
        let documents = self.rows.iter().flat_map(|lengths| lengths.iter());
        documents.flat_map(|&len| 0..len as u32).collect()
    }

    /// The documents as (first token in the batch, length).
    fn documents(&self) -> Vec<(usize, usize)> {
        let mut documents = Vec::new();
        for (b, lengths) in self.rows.iter().enumerate() {
            let mut start = b * self.seq();
            for &len in lengths.iter() {
                documents.push((start, len));
                start += len;
            }
        }
        documents
    }

    fn label(&self) -> String {
        let (d, attention, batch, seq) =
            (self.config.d_model, self.attention, self.rows.len(), self.seq());
        format!("d{d}_{attention:?}_B{batch}_T{seq}")
    }

    /// A model of the case's config and attention, packed or not, for `batch` rows of `seq`.
    fn model(&self, device: &CudaDevice, (batch, seq): (usize, usize), packed: bool) -> CudaGpt {
        let options = CudaGptOptions { packed, ..CudaGptOptions::default() };
        model_with(device, &self.config, (batch, seq), options, self.attention)
    }
}

/// The model with tails with gemm attention, and the head-size 64 and 128 models with either.
fn cases() -> Vec<Case> {
    let mut cases = vec![Case {
        config: TAILS,
        rows: &[&[1, 20, 16], &[37], &[5, 1, 1, 30]],
        attention: AttentionKind::Gemm,
    }];
    for attention in [AttentionKind::Flash, AttentionKind::Gemm] {
        cases.push(Case { config: FLASH_64, rows: &[&[1, 63, 6], &[35, 1, 34], &[70]], attention });
        cases.push(Case { config: FLASH_128, rows: &[&[64, 1], &[1, 1, 63]], attention });
    }
    cases
}

/// The packed batch's GPU loss against the token-weighted mean of its documents' GPU losses, each
/// document run alone by a plain model.
#[test]
fn a_packed_batch_has_the_token_weighted_loss_of_its_documents_run_alone() {
    let Some(device) = gpu() else { return };
    for (index, case) in cases().iter().enumerate() {
        let params = device.upload(&random_params(&case.config, 20 + index as u64)).unwrap();
        let (inputs, targets) = random_tokens(case.config.vocab_size, case.tokens(), 30);
        let mut packed = case.model(&device, (case.rows.len(), case.seq()), true);
        packed.set_packed_batch(&inputs, &targets, &case.positions()).unwrap();
        packed.forward(&params).unwrap();
        let loss = f64::from(packed.loss().unwrap());

        let mut alone = 0.0;
        for (start, len) in case.documents() {
            let mut model = case.model(&device, (1, len), false);
            let cells = start..start + len;
            model.set_batch(&inputs[cells.clone()], &targets[cells]).unwrap();
            model.forward(&params).unwrap();
            alone += len as f64 / case.tokens() as f64 * f64::from(model.loss().unwrap());
        }
        let error = (loss - alone).abs() / alone;
        let label = case.label();
        println!(
            "RESULT gpt_packed_loss {label} packed={loss:.5} alone={alone:.5} rel={error:.3e}"
        );
        assert!(error <= LOSS_TOLERANCE, "{label}: packed loss {loss} vs documents' {alone}");
    }
}

/// The packed batch's loss, logits and gradients against the f64 host model's on the same packed
/// rows, forward and backward run twice (loss scales 1 and 3: the gradients end at 4 times).
#[test]
fn packed_loss_logits_and_gradients_match_the_host_packed_model() {
    let Some(device) = gpu() else { return };
    for (index, case) in cases().iter().enumerate() {
        let config = &case.config;
        let layout = flat_layout(config, 1).unwrap();
        let params = random_params(config, 40 + index as u64);
        let params64: Vec<f64> = params.iter().map(|x| x.to_f64()).collect();
        let (inputs, targets) = random_tokens(config.vocab_size, case.tokens(), 50);
        let positions = case.positions();
        let (batch, seq) = (case.rows.len(), case.seq());

        let options =
            PlanOptions { attention: case.attention, packed: true, ..PlanOptions::default() };
        let mut host = HostGpt::<f64>::with_options(config, &layout, batch, seq, options).unwrap();
        let loss_ref = host.forward_packed(&params64, &inputs, &targets, &positions).unwrap();
        let logits_ref = host.activations()[host.acts().logits.clone()].to_vec();
        let mut grads_ref = vec![0.0; layout.padded_len()];
        host.backward(&params64, &mut grads_ref, 1.0, |_, _| {}).unwrap();

        let params_gpu = device.upload(&params).unwrap();
        let grads_gpu = device.alloc::<bf16>(layout.padded_len()).unwrap();
        let mut model = case.model(&device, (batch, seq), true);
        model.set_packed_batch(&inputs, &targets, &positions).unwrap();
        for loss_scale in [1.0, 3.0] {
            model.forward(&params_gpu).unwrap();
            model.backward(&params_gpu, &grads_gpu, loss_scale, |_| {}).unwrap();
        }
        let loss = f64::from(model.loss().unwrap());
        let logits: Vec<f64> = model.logits().unwrap().into_iter().map(f64::from).collect();
        let grads: Vec<f64> =
            device.download(&grads_gpu).unwrap().iter().map(|g| g.to_f64() / 4.0).collect();

        let label = case.label();
        let loss_error = (loss - loss_ref).abs() / loss_ref;
        println!(
            "RESULT gpt_packed {label} loss gpu={loss:.5} cpu={loss_ref:.5} rel={loss_error:.3e}"
        );
        assert!(loss_error <= LOSS_TOLERANCE, "{label}: loss {loss} vs {loss_ref}");
        let logits_error = relative_error(&logits, &logits_ref);
        println!("RESULT gpt_packed {label} logits rel={logits_error:.3e}");
        assert!(logits_error <= TOLERANCE, "{label}: logits off by {logits_error:.3e}");
        let mut failures = Vec::new();
        for view in layout.params() {
            let range = view.flat_range();
            let rel = relative_error(&grads[range.clone()], &grads_ref[range]);
            println!("RESULT gpt_packed_grad {label} {} rel={rel:.3e}", view.name);
            // A NaN fails too.
            if rel.is_nan() || rel > TOLERANCE {
                failures.push(format!("{} {rel:.3e}", view.name));
            }
        }
        assert!(failures.is_empty(), "{label}: gradients off: {failures:?}");
    }
}
