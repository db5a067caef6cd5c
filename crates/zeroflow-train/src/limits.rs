//! What a run's batch shape may be, checked before anything is allocated, so that a micro-batch
//! too large for the machine is an error naming the flag to lower, not an allocation failure that
//! aborts the process.

use crate::{DeviceKind, ModelSpec};

/// The most tokens one micro-batch may hold (`--micro-batch` × `--seq`): 2^31, so that every
/// index into the activations and the logits stays far inside the address space.
pub const MAX_MICRO_BATCH_TOKENS: u64 = 1 << 31;

/// Refuses a micro-batch of more than [`MAX_MICRO_BATCH_TOKENS`] tokens, and on the CPU one whose
/// activations and their gradients (f32, allocated once) need more than `available_host` bytes.
pub fn check_micro_batch(
    model: &ModelSpec,
    micro_batch: u64,
    seq: usize,
    device: DeviceKind,
    available_host: Option<u64>,
) -> Result<(), String> {
    let tokens = u128::from(micro_batch) * seq as u128;
    if tokens > u128::from(MAX_MICRO_BATCH_TOKENS) {
        return Err(format!(
            "--micro-batch {micro_batch}: {tokens} tokens per micro-batch (× --seq {seq}) is more \
             than the limit of {MAX_MICRO_BATCH_TOKENS} (2^31); lower --micro-batch (or --seq)"
        ));
    }
    let (DeviceKind::Cpu, Some(available)) = (device, available_host) else { return Ok(()) };
    let acts = model.cpu_activations(micro_batch as usize, seq);
    // Activations and their gradients, f32 each.
    let needed = acts as u128 * 2 * 4;
    if needed > u128::from(available) {
        let gib = |bytes: u128| bytes as f64 / f64::from(1u32 << 30);
        return Err(format!(
            "--micro-batch {micro_batch}: the model's activations need {:.1} GiB of host memory \
             but {:.1} GiB is available; lower --micro-batch (or --seq, or use a smaller --model)",
            gib(needed),
            gib(u128::from(available))
        ));
    }
    Ok(())
}

/// The host memory the kernel says is available (`MemAvailable`), where it says.
pub fn available_host_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|line| line.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use zeroflow_gpt::GptConfig;

    use super::*;

    const TINY: ModelSpec = ModelSpec::Gpt2(GptConfig::TINY);

    #[test]
    fn a_micro_batch_past_the_token_limit_names_the_flag_and_the_limit() {
        let error = check_micro_batch(&TINY, 1 << 40, 64, DeviceKind::Cuda, None)
            .expect_err("2^46 tokens are refused");
        assert!(error.starts_with("--micro-batch 1099511627776:"), "{error}");
        assert!(error.contains("2147483648"), "{error}");
    }

    #[test]
    fn on_the_cpu_activations_larger_than_the_memory_are_refused_and_smaller_ones_pass() {
        let check = |batch, available| {
            check_micro_batch(&TINY, batch, 64, DeviceKind::Cpu, Some(available))
        };
        let error = check(4096, 1 << 30).expect_err("4096 × 64 tokens of tiny need over 1 GiB");
        assert!(error.contains("lower --micro-batch"), "{error}");
        assert_eq!(check(16, 1 << 30), Ok(()));
    }
}
