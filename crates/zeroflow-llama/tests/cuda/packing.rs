//! `CudaLlama` on packed rows (several documents per row, `CudaLlamaOptions::packed`): every tiny
//! model of the CPU tests with gemm attention (grouped-query 3:1 and multi-query, `head_dim` ≠
//! hidden / heads, biases, Qwen3's q/k norm, llama3 rope scaling, tied and untied heads) at rows of
//! 7 tokens, and the models at head sizes 64 and 128 with flash and gemm attention at rows of 70
//! and 65 (documents crossing and ending on a 64-row tile's edge); documents of uneven lengths,
//! one token among them.
//!
//! - The packed batch's loss is the token-weighted mean of its documents' losses, each run alone
//!   on the GPU by a plain model as a batch of one sequence of its length, within 1e-2 relative
//!   (the bound of the GPU loss checks in `model.rs`: both sides are bf16 runs).
//! - The packed batch's loss, logits and every parameter gradient match the f64 host model's on
//!   the same packed rows: the loss within 1e-2 relative, the logits within 2e-2, each gradient
//!   within 2e-2 or twice its bf16 floor (`model.rs`'s bounds), run twice (loss scales 1 and 3)
//!   so that leftovers in the activation gradients show.

use std::sync::Arc;

use serde_json::json;
use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::{CudaDevice, Device};
use zeroflow_llama::cuda::CudaLlamaOptions;
use zeroflow_llama::{AttentionKind, CudaLlama, LlamaConfig};

use crate::gpu;
use crate::model::{
    FLOOR_FACTOR, MAX_FLOOR, TOLERANCE, bf16_floors, flash_models, host_grads, to_bf16,
};
use crate::support::{models, perturbed_params, random_batch, relative_error, tiny};

/// The largest relative error of a loss on the GPU (bf16 activations) against another.
const LOSS_TOLERANCE: f64 = 1e-2;

/// Rows of 7 tokens for the tiny models: documents of 1 and 6, of 3, 1 and 3, and one of 7.
const TINY_ROWS: &[&[usize]] = &[&[1, 6], &[3, 1, 3], &[7]];

/// One packed case: a model, its rows of documents, and the attention.
struct Case {
    what: String,
    config: LlamaConfig,
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
        let (attention, batch, seq) = (self.attention, self.rows.len(), self.seq());
        format!("{} {attention:?} B{batch} T{seq}", self.what).replace(' ', "_")
    }
}

/// Every tiny model with gemm attention, and the head-size 64 and 128 models with either.
fn cases() -> Vec<Case> {
    let tiny = models().into_iter().map(|(what, config)| Case {
        what: what.to_string(),
        config,
        rows: TINY_ROWS,
        attention: AttentionKind::Gemm,
    });
    // Rows of 70 (a second tile of 6) and of 65 (a second tile of one row).
    let rows_of = |seq: usize| -> &'static [&'static [usize]] {
        match seq {
            70 => &[&[1, 63, 6], &[35, 1, 34]],
            65 => &[&[64, 1], &[1, 1, 63]],
            _ => unreachable!("the flash models' sequences"),
        }
    };
    let wide = flash_models().into_iter().flat_map(|(what, config, (_, seq))| {
        [AttentionKind::Flash, AttentionKind::Gemm].map(|attention| Case {
            what: what.to_string(),
            config: config.clone(),
            rows: rows_of(seq),
            attention,
        })
    });
    tiny.chain(wide).collect()
}

/// A model of `case`'s config and attention, packed or not, for `batch` rows of `seq`.
fn model(
    device: &CudaDevice,
    case: &Case,
    (batch, seq): (usize, usize),
    packed: bool,
) -> CudaLlama {
    let layout = zeroflow_llama::flat_layout(&case.config, 1).unwrap();
    let blas = Arc::new(Blas::new(device).unwrap());
    let options =
        CudaLlamaOptions { attention: case.attention, packed, ..CudaLlamaOptions::default() };
    CudaLlama::with_options(device, blas, &case.config, &layout, (batch, seq), options).unwrap()
}

/// The packed batch's GPU loss against the token-weighted mean of its documents' GPU losses, each
/// document run alone by a plain model.
#[test]
fn a_packed_batch_has_the_token_weighted_loss_of_its_documents_run_alone() {
    let Some(device) = gpu() else { return };
    for (index, case) in cases().iter().enumerate() {
        let (_, params64) = perturbed_params(&case.config, 40 + index as u64);
        let params = device.upload(&to_bf16(&params64)).unwrap();
        let (inputs, targets) = random_batch(case.config.vocab_size, case.tokens(), 50);
        let mut packed = model(&device, case, (case.rows.len(), case.seq()), true);
        packed.set_packed_batch(&inputs, &targets, &case.positions()).unwrap();
        packed.forward(&params).unwrap();
        let loss = f64::from(packed.loss().unwrap());

        let mut alone = 0.0;
        for (start, len) in case.documents() {
            let mut model = model(&device, case, (1, len), false);
            let cells = start..start + len;
            model.set_batch(&inputs[cells.clone()], &targets[cells]).unwrap();
            model.forward(&params).unwrap();
            alone += len as f64 / case.tokens() as f64 * f64::from(model.loss().unwrap());
        }
        let error = (loss - alone).abs() / alone;
        let label = case.label();
        println!(
            "RESULT llama_packed_loss {label} packed={loss:.5} alone={alone:.5} rel={error:.3e}"
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
        let (layout, params64) = perturbed_params(&case.config, 5 + index as u64);
        let params = to_bf16(&params64);
        let params64: Vec<f64> = params.iter().map(|x| x.to_f64()).collect();
        let (inputs, targets) = random_batch(case.config.vocab_size, case.tokens(), 70);
        let positions = case.positions();
        let (batch, seq) = (case.rows.len(), case.seq());
        let tokens = (&inputs[..], &targets[..], batch, seq);
        let packed = (case.attention, Some(&positions[..]));
        let (loss_ref, logits_ref, grads_ref, _) =
            host_grads(&case.config, &params64, tokens, case.attention, packed.1);
        let floors = bf16_floors(&case.config, &params64, tokens, packed, &grads_ref);

        let params_gpu = device.upload(&params).unwrap();
        let grads_gpu = device.alloc::<bf16>(layout.padded_len()).unwrap();
        let mut model = model(&device, case, (batch, seq), true);
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
            "RESULT llama_packed {label} loss gpu={loss:.5} cpu={loss_ref:.5} rel={loss_error:.3e}"
        );
        assert!(loss_error <= LOSS_TOLERANCE, "{label}: loss {loss} vs {loss_ref}");
        let logits_error = relative_error(&logits, &logits_ref);
        println!("RESULT llama_packed {label} logits rel={logits_error:.3e}");
        assert!(logits_error <= TOLERANCE, "{label}: logits off by {logits_error:.3e}");
        let mut failures = Vec::new();
        for (view, &floor) in layout.params().iter().zip(&floors) {
            let range = view.flat_range();
            let rel = relative_error(&grads[range.clone()], &grads_ref[range]);
            let bound = TOLERANCE.max(FLOOR_FACTOR * floor);
            println!(
                "RESULT llama_packed_grad {label} {} rel={rel:.3e} bf16_floor={floor:.3e} \
                 bound={bound:.3e}",
                view.name
            );
            assert!(floor <= MAX_FLOOR, "{label}: {} has a bf16 floor of {floor:.3e}", view.name);
            // A NaN fails too.
            if rel.is_nan() || rel > bound {
                failures.push(format!("{} {rel:.3e} (bound {bound:.3e})", view.name));
            }
        }
        assert!(failures.is_empty(), "{label}: gradients off: {failures:?}");
    }
}

/// A plain batch given to a packed model, and positions given to a plain one, are refused (no GPU
/// work is queued for either).
#[test]
fn a_packed_model_takes_packed_batches_only() {
    let Some(device) = gpu() else { return };
    let config = tiny("LlamaForCausalLM", json!({}));
    let case =
        Case { what: "tiny".into(), config, rows: TINY_ROWS, attention: AttentionKind::Gemm };
    let (inputs, targets) = random_batch(case.config.vocab_size, case.tokens(), 80);
    let shape = (case.rows.len(), case.seq());
    let error = model(&device, &case, shape, true).set_batch(&inputs, &targets).unwrap_err();
    assert!(error.to_string().contains("packed"), "{error}");
    let mut plain = model(&device, &case, shape, false);
    let error = plain.set_packed_batch(&inputs, &targets, &case.positions()).unwrap_err();
    assert!(error.to_string().contains("without packing"), "{error}");
    let mut packed = model(&device, &case, shape, true);
    let mut bad = case.positions();
    bad[3] = 5;
    let error = packed.set_packed_batch(&inputs, &targets, &bad).unwrap_err();
    assert!(error.to_string().contains("position 5 of token 3 of row 0"), "{error}");
}
