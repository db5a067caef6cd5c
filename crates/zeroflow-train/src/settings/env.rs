//! The `ZEROFLOW_*` variables that override the config's `zeroflow` section (and that the flags
//! override in turn), as their values say ([`from_lookup`]: the binary reads the environment),
//! each value checked, a bad one refused naming the variable and what it accepts. Unset or
//! blank: no request.

use zeroflow_core::env;
use zeroflow_device::cuda::HostWaits;
use zeroflow_optim::Stores;

use super::{Requested, names};

/// The model's attention: `auto`, `gemm` or `flash` ([`super::Attention`]).
pub const ATTENTION_VAR: &str = "ZEROFLOW_ATTENTION";
/// Activation checkpointing: `on` or `off`.
pub const ACTIVATION_CHECKPOINTING_VAR: &str = "ZEROFLOW_ACTIVATION_CHECKPOINTING";
/// How host threads wait for the GPU: `auto`, `block` or `spin` ([`HostWaits`]).
pub const CUDA_WAIT_VAR: &str = "ZEROFLOW_CUDA_WAIT";
/// Whether the CPU optimizer is bound to the CPUs near its GPU: `auto`, `on` or `off`.
pub const CPU_BIND_VAR: &str = "ZEROFLOW_CPU_BIND";
/// The chunk of the offload stream, in MiB of the parameter dtype: a positive number, fractions
/// allowed.
pub const STREAM_CHUNK_VAR: &str = "ZEROFLOW_STREAM_CHUNK_MIB";
/// How the CPU AdamW writes the weights' bf16 copy: `normal` or `non-temporal`.
pub const COPY_STORES_VAR: &str = "ZEROFLOW_COPY_STORES";
/// When the streaming step gathers the updated partitions: `pieces` or `after-step`.
pub const GATHER_VAR: &str = "ZEROFLOW_STREAM_GATHER";
/// Threads of the CPU optimizer: a positive whole number.
pub const CPU_THREADS_VAR: &str = "ZEROFLOW_CPU_THREADS";
/// The exact offload step's speculation budget, in MiB of host memory: a non-negative number,
/// fractions allowed (0: no speculation).
pub const SPECULATION_BUDGET_VAR: &str = "ZEROFLOW_SPECULATION_BUDGET_MIB";
/// MiB of pinned host memory a rank's device may hold: a non-negative number, fractions allowed
/// (0: pin nothing).
pub const PINNED_BUDGET_VAR: &str = "ZEROFLOW_PINNED_BUDGET_MIB";
/// Where ZeRO-2 with gradient accumulation sums a window: `auto`, `device` or `host`.
pub const ACCUMULATE_ON_VAR: &str = "ZEROFLOW_ACCUMULATE_ON";
/// The exact offload step's CPU work overlapped with the next forward (`on`, `off`).
pub const OVERLAP_FORWARD_VAR: &str = "ZEROFLOW_OVERLAP_FORWARD";
/// The share of the optimizer's partition stepped on the device: a fraction at least 0 and
/// below 1.
pub const DEVICE_SHARE_VAR: &str = "ZEROFLOW_DEVICE_SHARE";
/// Where the device share keeps its state: `device` or `host`.
pub const DEVICE_SHARE_STATE_VAR: &str = "ZEROFLOW_DEVICE_SHARE_STATE";
/// Where ZenFlow sets its window aside for the CPU step: `device` or `host`.
pub const ZENFLOW_ASIDE_VAR: &str = "ZEROFLOW_ZENFLOW_ASIDE";
/// Sequence packing (`on`, `off`).
pub const PACK_VAR: &str = "ZEROFLOW_PACK";
/// The folder compiled CUDA kernels are cached in (default: the user's cache folder).
pub const KERNEL_CACHE_VAR: &str = "ZEROFLOW_KERNEL_CACHE";

/// What the variables that `lookup` gives ask for, or why a value is refused.
pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Requested, String> {
    let value = |name: &str| lookup(name);
    Ok(Requested {
        attention: named(ATTENTION_VAR, value(ATTENTION_VAR), &names::ATTENTION)?,
        activation_checkpointing: named(
            ACTIVATION_CHECKPOINTING_VAR,
            value(ACTIVATION_CHECKPOINTING_VAR),
            &names::SWITCH,
        )?,
        cuda_wait: named(CUDA_WAIT_VAR, value(CUDA_WAIT_VAR), &HostWaits::NAMES)?,
        cpu_bind: named(CPU_BIND_VAR, value(CPU_BIND_VAR), &names::CPU_BIND)?,
        stream_chunk_mib: number(
            STREAM_CHUNK_VAR,
            value(STREAM_CHUNK_VAR),
            super::parse_chunk_mib,
        )?,
        copy_stores: named::<Stores>(COPY_STORES_VAR, value(COPY_STORES_VAR), &names::STORES)?,
        gather_in_pieces: named(GATHER_VAR, value(GATHER_VAR), &names::GATHER)?,
        cpu_threads: number(CPU_THREADS_VAR, value(CPU_THREADS_VAR), super::parse_threads)?,
        speculation_budget_mib: number(
            SPECULATION_BUDGET_VAR,
            value(SPECULATION_BUDGET_VAR),
            super::parse_budget_mib,
        )?,
        accumulate_on: named(ACCUMULATE_ON_VAR, value(ACCUMULATE_ON_VAR), &names::ACCUMULATE_ON)?,
        pinned_budget_mib: number(
            PINNED_BUDGET_VAR,
            value(PINNED_BUDGET_VAR),
            super::parse_budget_mib,
        )?,
        overlap_forward: named(OVERLAP_FORWARD_VAR, value(OVERLAP_FORWARD_VAR), &names::SWITCH)?,
        device_share: number(DEVICE_SHARE_VAR, value(DEVICE_SHARE_VAR), super::parse_device_share)?,
        device_share_state: named(
            DEVICE_SHARE_STATE_VAR,
            value(DEVICE_SHARE_STATE_VAR),
            &names::SHARE_STATE,
        )?,
        zenflow_aside: named(ZENFLOW_ASIDE_VAR, value(ZENFLOW_ASIDE_VAR), &names::ZENFLOW_ASIDE)?,
        pack: named(PACK_VAR, value(PACK_VAR), &names::SWITCH)?,
    })
}

/// The setting of `choices` that variable `name`'s `value` names (case and spaces ignored).
fn named<T: Copy>(
    name: &str,
    value: Option<String>,
    choices: &[(&'static str, T)],
) -> Result<Option<T>, String> {
    env::choice(value.as_deref(), choices)
        .map_err(|found| format!("{name}={found:?} is not {}", names::alternatives(choices)))
}

/// The number variable `name`'s `value` gives as `parse` reads it.
fn number<T>(
    name: &str,
    value: Option<String>,
    parse: fn(&str) -> Result<T, String>,
) -> Result<Option<T>, String> {
    let value = value.as_deref().map(str::trim).unwrap_or_default();
    if value.is_empty() {
        return Ok(None);
    }
    match parse(value) {
        Ok(number) => Ok(Some(number)),
        Err(reason) => Err(format!("{name}={value:?} {reason}")),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::dist::affinity::BindMode;
    use crate::settings::Attention;
    use zeroflow_core::config::DeviceShare;
    use zeroflow_engine::AccumulateOn;

    fn read(vars: &[(&str, &str)]) -> Result<Requested, String> {
        let vars: HashMap<String, String> =
            vars.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())).collect();
        from_lookup(|name| vars.get(name).cloned())
    }

    #[test]
    fn unset_or_blank_variables_ask_for_nothing() {
        assert_eq!(read(&[]), Ok(Requested::default()));
        let blank: Vec<(&str, &str)> = [
            ATTENTION_VAR,
            ACTIVATION_CHECKPOINTING_VAR,
            CUDA_WAIT_VAR,
            CPU_BIND_VAR,
            STREAM_CHUNK_VAR,
            COPY_STORES_VAR,
            GATHER_VAR,
            CPU_THREADS_VAR,
            SPECULATION_BUDGET_VAR,
            ACCUMULATE_ON_VAR,
            PINNED_BUDGET_VAR,
            DEVICE_SHARE_VAR,
            DEVICE_SHARE_STATE_VAR,
            ZENFLOW_ASIDE_VAR,
        ]
        .iter()
        .map(|&name| (name, " \n"))
        .collect();
        assert_eq!(read(&blank), Ok(Requested::default()));
    }

    #[test]
    fn each_variable_is_read_with_case_and_spaces_ignored() {
        let requested = read(&[
            (ATTENTION_VAR, " Flash"),
            (ACTIVATION_CHECKPOINTING_VAR, "On"),
            (CUDA_WAIT_VAR, "BLOCK"),
            (CPU_BIND_VAR, "off\n"),
            (STREAM_CHUNK_VAR, " 4\n"),
            (COPY_STORES_VAR, "NON-TEMPORAL"),
            (GATHER_VAR, " after-step\n"),
            (CPU_THREADS_VAR, "15\n"),
            (SPECULATION_BUDGET_VAR, " 0.5\n"),
            (ACCUMULATE_ON_VAR, "Device "),
            (PINNED_BUDGET_VAR, " 1024\n"),
            (PACK_VAR, " On\n"),
            (OVERLAP_FORWARD_VAR, "OFF "),
            (DEVICE_SHARE_VAR, " 0.6\n"),
            (DEVICE_SHARE_STATE_VAR, " HOST"),
            (ZENFLOW_ASIDE_VAR, "Host "),
        ])
        .unwrap();
        assert_eq!(
            requested,
            Requested {
                attention: Some(Attention::Flash),
                activation_checkpointing: Some(true),
                cuda_wait: Some(HostWaits::Block),
                cpu_bind: Some(BindMode::Off),
                stream_chunk_mib: Some(4.0),
                copy_stores: Some(Stores::NonTemporal),
                gather_in_pieces: Some(false),
                cpu_threads: Some(15),
                speculation_budget_mib: Some(0.5),
                accumulate_on: Some(AccumulateOn::Device),
                pinned_budget_mib: Some(1024.0),
                overlap_forward: Some(false),
                device_share: Some(DeviceShare::Fraction(0.6)),
                device_share_state: Some(zeroflow_engine::ShareState::Host),
                zenflow_aside: Some(zeroflow_engine::ZenFlowAside::Host),
                pack: Some(true),
            }
        );
        // 0 is a budget (pin nothing), not "unset".
        assert_eq!(read(&[(PINNED_BUDGET_VAR, "0")]).unwrap().pinned_budget_mib, Some(0.0));
        // 0 is a budget (speculation off), not "unset".
        let off = read(&[(SPECULATION_BUDGET_VAR, "0")]).unwrap();
        assert_eq!(off.speculation_budget_mib, Some(0.0));
        let host = read(&[(ACCUMULATE_ON_VAR, "HOST")]).unwrap();
        assert_eq!(host.accumulate_on, Some(AccumulateOn::Host));
        let auto = read(&[(ACCUMULATE_ON_VAR, "auto")]).unwrap();
        assert_eq!(auto.accumulate_on, Some(AccumulateOn::Auto));
        assert_eq!(read(&[(ATTENTION_VAR, "auto")]).unwrap().attention, Some(Attention::Auto));
        assert_eq!(read(&[(GATHER_VAR, "Pieces")]).unwrap().gather_in_pieces, Some(true));
        assert_eq!(
            read(&[(COPY_STORES_VAR, " Normal")]).unwrap().copy_stores,
            Some(Stores::Normal)
        );
    }

    /// A typo is an error naming the variable, the value and what it accepts; for
    /// `ZEROFLOW_CPU_BIND` too, which used to be ignored.
    #[test]
    fn bad_values_are_refused_naming_the_variable_and_what_it_accepts() {
        let cases: &[(&str, &[&str], &str)] = &[
            (ATTENTION_VAR, &["flash2", "fast"], "auto, gemm or flash"),
            (ACTIVATION_CHECKPOINTING_VAR, &["yes", "1", "auto"], "on or off"),
            (CUDA_WAIT_VAR, &["yield", "1"], "auto, block or spin"),
            (CPU_BIND_VAR, &["of", "yes", "true", "numa", "1"], "auto, on or off"),
            (
                STREAM_CHUNK_VAR,
                &["0", "-1", "abc", "1MiB", "inf", "NaN", "0x10"],
                "positive number",
            ),
            (COPY_STORES_VAR, &["nt", "streaming", "non_temporal", "1"], "normal or non-temporal"),
            (GATHER_VAR, &["after", "end", "1"], "pieces or after-step"),
            (CPU_THREADS_VAR, &["0", "-2", "1.5", "eight"], "positive whole number"),
            (
                SPECULATION_BUDGET_VAR,
                &["-1", "-0.5", "4GiB", "inf", "NaN", "off"],
                "non-negative number of MiB",
            ),
            (ACCUMULATE_ON_VAR, &["gpu", "cpu", "on", "1"], "auto, device or host"),
            (ZENFLOW_ASIDE_VAR, &["gpu", "cpu", "auto", "1"], "device or host"),
            (DEVICE_SHARE_STATE_VAR, &["gpu", "cpu", "pinned", "1"], "device or host"),
            (
                DEVICE_SHARE_VAR,
                &["1", "1.5", "-0.1", "half", "50%", "inf", "NaN"],
                "fraction at least 0 and below 1",
            ),
        ];
        for &(name, bad_values, accepted) in cases {
            for bad in bad_values {
                let reason = read(&[(name, bad)]).unwrap_err();
                assert!(reason.contains(&format!("{name}={bad:?}")), "{reason}");
                assert!(reason.contains(accepted), "{reason}");
            }
        }
        // A good value does not excuse a bad one in another variable.
        assert!(read(&[(STREAM_CHUNK_VAR, "4"), (COPY_STORES_VAR, "fast")]).is_err());
    }
}
