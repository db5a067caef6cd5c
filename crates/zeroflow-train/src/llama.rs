//! The Llama family ([`zeroflow_llama`]) as a [`Model`](crate::Model) (its CPU model in f32 and
//! its CUDA model in bf16), and [`LlamaSpec`], the model a checkpoint holds (`{"family": "llama",
//! …}` with the fields of its `config.json` beside the tag), as a [`Family`].
//!
//! The impls live here, not in `zeroflow-llama`, so that the family crate does not depend on the
//! trainer (docs/DESIGN.md §2); each method is the model's own of the same name.

use std::sync::Arc;
use std::time::Duration;

use zeroflow_core::bf16;
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_nn::cuda::ActivationMemory;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use zeroflow_core::Float;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::cpu::CpuComm;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::nccl::NcclComm;
use zeroflow_device::{CpuDevice, CudaDevice};
use zeroflow_engine::checkpoint::NamedTensor;
use zeroflow_llama::{
    ActLayout, CpuLlama, CudaLlama, CudaLlamaOptions, LlamaConfig, LlamaError, hf_params,
};
use zeroflow_nn::{AttentionKind, PlanOptions};

use crate::error::input;
use crate::family::of_f32;
use crate::model::{cuda_memory_in_use, model_impl};
use crate::{Family, ModelSpec, TrainError};

/// The sequence length a Llama-family run trains on unless `--seq` says (its context where
/// shorter): the benchmarks' 2048, not the 128k context of Llama 3.x.
pub const DEFAULT_SEQ: usize = 2048;

/// A Llama-family model as a checkpoint records it: its configuration, serialized as the
/// `config.json` that [`LlamaConfig::to_hf_config`] writes and read back by
/// [`LlamaConfig::from_hf_config`] (so a field zeroflow does not implement is an error naming it).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaSpec(pub LlamaConfig);

impl Serialize for LlamaSpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.to_hf_config().serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for LlamaSpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let json = serde_json::Value::deserialize(deserializer)?;
        LlamaConfig::from_hf_config(&json).map(LlamaSpec).map_err(serde::de::Error::custom)
    }
}

model_impl!(CpuLlama, CpuDevice, CpuComm, f32, LlamaError);
model_impl!(CudaLlama, CudaDevice, NcclComm, bf16, LlamaError, memory_in_use: cuda_memory_in_use);

impl From<LlamaError> for TrainError {
    fn from(error: LlamaError) -> TrainError {
        TrainError::model(error)
    }
}

impl Family for LlamaSpec {
    type Cpu = CpuLlama;
    type Cuda = CudaLlama;

    fn spec(&self) -> ModelSpec {
        ModelSpec::Llama(self.clone())
    }

    fn family_name(&self) -> &'static str {
        "llama"
    }

    fn num_params(&self) -> usize {
        zeroflow_llama::param_count(&self.0) as usize
    }

    fn n_layer(&self) -> usize {
        self.0.num_hidden_layers
    }

    fn n_head(&self) -> usize {
        self.0.num_attention_heads
    }

    fn hidden_size(&self) -> usize {
        self.0.hidden_size
    }

    fn vocab_size(&self) -> usize {
        self.0.vocab_size
    }

    fn context(&self) -> usize {
        self.0.max_position_embeddings
    }

    fn default_seq(&self) -> usize {
        DEFAULT_SEQ.min(self.context())
    }

    fn check_seq(&self, seq: usize) -> Result<(), TrainError> {
        self.0.check_sequence_len(seq).map_err(|e| input(format!("--seq {seq}: {e}")))
    }

    fn flat_layout(&self, world_size: usize) -> Result<FlatLayout, TrainError> {
        zeroflow_llama::flat_layout(&self.0, world_size)
            .map_err(|e| TrainError::model(e).context("cannot lay out the model"))
    }

    fn tensors(&self, layout: &FlatLayout) -> Result<Vec<NamedTensor>, TrainError> {
        hf_params(&self.0)
            .into_iter()
            .map(|p| {
                let flat =
                    layout.param(&p.name).map(|view| view.flat_range()).ok_or_else(|| {
                        TrainError::Input(format!("the flat layout has no parameter {}", p.name))
                    })?;
                Ok(NamedTensor { name: p.name, shape: p.shape, flat })
            })
            .collect()
    }

    fn init<P: Float>(
        &self,
        layout: &FlatLayout,
        seed: u64,
        weights: &mut [P],
    ) -> Result<(), TrainError> {
        Ok(zeroflow_llama::init_params_as(&self.0, layout, seed, weights, of_f32)?)
    }

    fn cpu_activations(&self, batch: usize, seq: usize) -> usize {
        ActLayout::new(&self.0, batch, seq, AttentionKind::Gemm).len
    }

    fn cuda_attention(&self, asked: Option<AttentionKind>) -> AttentionKind {
        CudaLlamaOptions::for_model(&self.0, asked).attention
    }

    fn cpu_model(
        &self,
        device: &CpuDevice,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        packed: bool,
    ) -> Result<CpuLlama, TrainError> {
        let options = PlanOptions { packed, ..PlanOptions::default() };
        Ok(CpuLlama::with_options(device, &self.0, layout, batch, seq, options)?)
    }

    fn cuda_model(
        &self,
        device: &CudaDevice,
        blas: Arc<Blas>,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        plan: PlanOptions,
    ) -> Result<CudaLlama, TrainError> {
        let options = cuda_options(plan);
        Ok(CudaLlama::with_options(device, blas, &self.0, layout, (batch, seq), options)?)
    }

    fn cuda_planned_activations(
        &self,
        layout: &FlatLayout,
        batch_seq: (usize, usize),
        plan: PlanOptions,
    ) -> Result<ActivationMemory, TrainError> {
        let options = cuda_options(plan);
        Ok(zeroflow_llama::cuda::planned_memory(&self.0, layout, batch_seq, options)?)
    }

    fn hf_config(&self) -> serde_json::Value {
        self.0.to_hf_config()
    }

    fn cuda_activation_memory(model: &CudaLlama) -> ActivationMemory {
        model.activation_memory()
    }

    fn cuda_profile(
        model: &mut CudaLlama,
        params: &CudaBuffer<bf16>,
        grads: &CudaBuffer<bf16>,
    ) -> Result<Vec<(String, Duration)>, TrainError> {
        Ok(model.profile(params, grads)?)
    }
}

/// The CUDA model's options of a family-neutral [`PlanOptions`].
fn cuda_options(plan: PlanOptions) -> CudaLlamaOptions {
    CudaLlamaOptions {
        attention: plan.attention,
        activation_checkpointing: plan.activation_checkpointing,
        packed: plan.packed,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use zeroflow_device::{Device, DeviceBuffer};
    use zeroflow_llama::{AttentionKind, flat_layout, init_params};
    use zeroflow_nn::GradGroup;

    use crate::Model;

    use super::*;

    /// `steps` of plain gradient descent through the [`Model`] trait only, returning each step's
    /// loss and the groups backward reported on the last step.
    fn descend<M: Model<Device = CpuDevice, P = f32>>(
        device: &CpuDevice,
        model: &mut M,
        params: &mut [f32],
        batch: (&[u32], &[u32]),
        steps: usize,
    ) -> (Vec<f32>, Vec<GradGroup>) {
        let (mut losses, mut groups) = (Vec::new(), Vec::new());
        for _ in 0..steps {
            let weights = device.upload(params).unwrap();
            let grads = device.alloc::<f32>(weights.len()).unwrap();
            model.set_batch(batch.0, batch.1, None).unwrap();
            model.forward(&weights).unwrap();
            losses.push(model.loss().unwrap());
            groups.clear();
            model.backward(&weights, &grads, 1.0, &mut |ready| groups.push(ready.group)).unwrap();
            let grads = device.download(&grads).unwrap();
            params.iter_mut().zip(&grads).for_each(|(p, g)| *p -= 0.5 * g);
        }
        (losses, groups)
    }

    /// A tiny Qwen3 (GQA, q/k norm, head_dim ≠ hidden / heads) driven through the trait learns a
    /// fixed batch: the loss falls by more than half in 30 steps, and backward reports the final
    /// norm, the layers last to first, then the embedding.
    #[test]
    fn cpu_llama_trains_through_the_model_trait() {
        let config = LlamaConfig::from_hf_config(&json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 13, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 6, "tie_word_embeddings": true,
        }))
        .unwrap();
        let layout = flat_layout(&config, 1).unwrap();
        let mut params = vec![0.0f32; layout.padded_len()];
        init_params(&config, &layout, 3, &mut params).unwrap();
        let device = CpuDevice::new().unwrap();
        let (batch, seq) = (2, 6);
        let mut model =
            CpuLlama::new(&device, &config, &layout, batch, seq, AttentionKind::Gemm).unwrap();
        let inputs: Vec<u32> = (0..12).map(|i| (i * 5 % 13) as u32).collect();
        let targets: Vec<u32> = (0..12).map(|i| (i * 7 % 13) as u32).collect();
        let (losses, groups) = descend(&device, &mut model, &mut params, (&inputs, &targets), 30);
        assert!(losses[29] < 0.5 * losses[0], "losses {losses:?}");
        let expected =
            [GradGroup::FinalNorm, GradGroup::Block(1), GradGroup::Block(0), GradGroup::Embeddings];
        assert_eq!(groups, expected);
    }

    /// The family's checkpoint tensors are `transformers`' parameters in the flat layout's order,
    /// covering every parameter once; the named shapes train on 2048 tokens unless told; a
    /// sliding window shorter than the sequence is an input error naming the field.
    #[test]
    fn the_llama_family_lays_out_its_hf_tensors() {
        let spec = LlamaSpec(zeroflow_llama::named_shape("llama-1b").unwrap());
        assert_eq!(
            (spec.num_params(), spec.default_seq(), spec.context()),
            (1_235_814_400, 2048, 131_072)
        );
        let tiny = LlamaSpec(
            LlamaConfig::from_hf_config(&json!({
                "architectures": ["MistralForCausalLM"], "vocab_size": 32, "hidden_size": 16,
                "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 1, "max_position_embeddings": 64, "sliding_window": 16,
                "tie_word_embeddings": false,
            }))
            .unwrap(),
        );
        let layout = tiny.flat_layout(3).unwrap();
        let tensors = tiny.tensors(&layout).unwrap();
        let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        let expected: Vec<String> = hf_params(&tiny.0).into_iter().map(|p| p.name).collect();
        assert_eq!(names, expected);
        assert_eq!(names.last(), Some(&"lm_head.weight"));
        assert!(tensors.windows(2).all(|w| w[0].flat.end <= w[1].flat.start));
        let numel: usize = tensors.iter().map(|t| t.flat.len()).sum();
        assert_eq!(numel, tiny.num_params());
        assert_eq!(tiny.default_seq(), 64);
        tiny.check_seq(16).unwrap();
        let error = tiny.check_seq(17).unwrap_err();
        assert!(error.is_input() && error.to_string().contains("sliding_window"), "{error}");
    }

    /// A spec is its `config.json`'s fields; written and read back it is the same configuration,
    /// and a field zeroflow does not implement is an error naming it.
    #[test]
    fn a_llama_spec_is_its_config_json() {
        let config = json!({
            "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
            "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, "initializer_range": 0.01,
        });
        let spec = LlamaSpec(LlamaConfig::from_hf_config(&config).unwrap());
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["architectures"], json!(["LlamaForCausalLM"]));
        assert_eq!(json["initializer_range"], json!(0.01));
        assert_eq!(serde_json::from_value::<LlamaSpec>(json.clone()).unwrap(), spec);
        let mut moe = json;
        moe["num_local_experts"] = 8.into();
        let error = serde_json::from_value::<LlamaSpec>(moe).unwrap_err().to_string();
        assert!(error.contains("num_local_experts"), "{error}");
    }
}
