//! The Llama family ([`zeroflow_llama`]) as a [`Model`]: its CPU model in f32 (it has no CUDA
//! model yet); and [`LlamaSpec`], the model a checkpoint holds, `{"family": "llama", …}` with
//! the fields of its `config.json` beside the tag.
//!
//! The impl lives here, not in `zeroflow-llama`, so that the family crate does not depend on the
//! trainer (docs/DESIGN.md §2); each method is the model's own of the same name.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use zeroflow_device::CpuDevice;
use zeroflow_device::cpu::CpuComm;
use zeroflow_llama::{CpuLlama, LlamaConfig, LlamaError};
use zeroflow_nn::GradsReady;

use crate::model::{Buffer, Model};

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

impl Model for CpuLlama {
    type Device = CpuDevice;
    type Comm = CpuComm;
    type P = f32;
    type Error = LlamaError;

    fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), LlamaError> {
        CpuLlama::set_batch(self, inputs, targets)
    }

    fn forward(&mut self, params: &Buffer<Self>) -> Result<(), LlamaError> {
        CpuLlama::forward(self, params)
    }

    fn loss(&mut self) -> Result<f32, LlamaError> {
        CpuLlama::loss(self)
    }

    fn backward(
        &mut self,
        params: &Buffer<Self>,
        grads: &Buffer<Self>,
        loss_scale: f64,
        on_ready: &mut dyn FnMut(&GradsReady),
    ) -> Result<(), LlamaError> {
        CpuLlama::backward(self, params, grads, loss_scale, on_ready)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use zeroflow_device::{Device, DeviceBuffer};
    use zeroflow_llama::{AttentionKind, flat_layout, init_params};
    use zeroflow_nn::GradGroup;

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
            model.set_batch(batch.0, batch.1).unwrap();
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
