//! Tuning the CPU-offload stream from the environment, for measurements (docs/multi-gpu.md,
//! "Tuning the offload stream"): [`STREAM_CHUNK_VAR`] sets the chunk the gradients go to the host
//! and the weights come back in ([`StreamOptions::chunk`]), [`COPY_STORES_VAR`] how the CPU
//! AdamW writes the weights' bf16 copy ([`StreamOptions::copy_stores`]), [`CPU_THREADS_VAR`] how
//! many threads the CPU optimizer runs on ([`Offload::cpu_threads`]; by default the host's cores
//! shared between its ranks, or the CPUs a rank is bound to), [`GATHER_VAR`] whether the
//! streaming step gathers the ranks' weights piece by piece while it steps or after it
//! ([`StreamOptions::gather_in_pieces`]). Unset or blank: the
//! defaults. The results are bit-identical whatever the values; only the speed changes.

use zeroflow_core::{DType, Element, env};
use zeroflow_engine::EngineOptions;
#[cfg(doc)]
use zeroflow_engine::{Offload, StreamOptions};
use zeroflow_optim::Stores;

use crate::InputError;

/// The chunk of the offload stream, in MiB of the parameter dtype: a positive number, fractions
/// allowed.
pub const STREAM_CHUNK_VAR: &str = "ZEROFLOW_STREAM_CHUNK_MIB";

/// How the CPU AdamW writes the weights' bf16 copy: `normal` or `non-temporal`.
pub const COPY_STORES_VAR: &str = "ZEROFLOW_COPY_STORES";

/// Threads of the CPU optimizer: a positive whole number.
pub const CPU_THREADS_VAR: &str = "ZEROFLOW_CPU_THREADS";

/// When the streaming step gathers the updated partitions: `pieces` or `after-step`.
pub const GATHER_VAR: &str = "ZEROFLOW_STREAM_GATHER";

const MIB: f64 = (1 << 20) as f64;

/// What the two variables ask for; `None` keeps the engine's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct StreamTuning {
    /// Elements of the parameter dtype per chunk (at least one).
    pub stream_chunk: Option<usize>,
    pub copy_stores: Option<Stores>,
    pub cpu_threads: Option<usize>,
    pub gather_in_pieces: Option<bool>,
}

impl StreamTuning {
    /// The tuning that the variables' values ask for (`None` or blank: the default; spaces and
    /// case ignored) with parameters of `dtype`, or why a value is refused.
    pub fn parse(
        chunk_mib: Option<&str>,
        copy_stores: Option<&str>,
        dtype: DType,
    ) -> Result<StreamTuning, String> {
        let chunk_mib = chunk_mib.map(str::trim).unwrap_or_default();
        let stream_chunk = if chunk_mib.is_empty() {
            None
        } else {
            let mib = chunk_mib.parse::<f64>().ok().filter(|mib| mib.is_finite() && *mib > 0.0);
            let mib = mib.ok_or_else(|| {
                format!("{STREAM_CHUNK_VAR}={chunk_mib:?} is not a positive number of MiB")
            })?;
            // Whole elements, rounded down (`as` saturates for the absurdly large).
            let elements = (mib * MIB / dtype.size() as f64) as usize;
            if elements == 0 {
                return Err(format!(
                    "{STREAM_CHUNK_VAR}={chunk_mib:?} is less than one {dtype} element ({} bytes)",
                    dtype.size()
                ));
            }
            Some(elements)
        };
        let stores = [("normal", Stores::Normal), ("non-temporal", Stores::NonTemporal)];
        let copy_stores = env::choice(copy_stores, &stores).map_err(|value| {
            format!("{COPY_STORES_VAR}={value:?} is not normal or non-temporal")
        })?;
        Ok(StreamTuning { stream_chunk, copy_stores, cpu_threads: None, gather_in_pieces: None })
    }

    /// The CPU optimizer's thread count that `value` asks for (`None` or blank: the default), or
    /// why it is refused.
    pub fn parse_threads(value: Option<&str>) -> Result<Option<usize>, String> {
        let value = value.map(str::trim).unwrap_or_default();
        if value.is_empty() {
            return Ok(None);
        }
        match value.parse::<usize>() {
            Ok(threads) if threads > 0 => Ok(Some(threads)),
            _ => Err(format!("{CPU_THREADS_VAR}={value:?} is not a positive whole number")),
        }
    }

    /// Whether the streaming step gathers in pieces, as `value` asks (`None` or blank: the
    /// default; case ignored), or why it is refused.
    pub fn parse_gather(value: Option<&str>) -> Result<Option<bool>, String> {
        env::choice(value, &[("pieces", true), ("after-step", false)])
            .map_err(|value| format!("{GATHER_VAR}={value:?} is not pieces or after-step"))
    }

    /// The tuning the environment asks for, with parameters of `dtype`; an [`InputError`] for a
    /// value that is refused.
    pub fn from_env(dtype: DType) -> anyhow::Result<StreamTuning> {
        let (chunk_mib, copy_stores) = (env::var(STREAM_CHUNK_VAR), env::var(COPY_STORES_VAR));
        let (threads, gather) = (env::var(CPU_THREADS_VAR), env::var(GATHER_VAR));
        let tuning = StreamTuning::parse(chunk_mib.as_deref(), copy_stores.as_deref(), dtype)
            .and_then(|tuning| {
                let cpu_threads = StreamTuning::parse_threads(threads.as_deref())?;
                let gather_in_pieces = StreamTuning::parse_gather(gather.as_deref())?;
                Ok(StreamTuning { cpu_threads, gather_in_pieces, ..tuning })
            });
        tuning.map_err(InputError::from_display)
    }
}

/// Applies the environment's tuning (if any) to `options` for rank `rank`'s parameters of type
/// `P`, saying once what it chose; an [`InputError`] for a value that is refused.
pub fn apply_env<P: Element>(options: &mut EngineOptions, rank: usize) -> anyhow::Result<()> {
    let dtype = P::DTYPE;
    let tuning = StreamTuning::from_env(dtype)?;
    if tuning == StreamTuning::default() {
        return Ok(());
    }
    let Some(offload) = options.offload_mut() else {
        tracing::warn!(
            "rank {rank}: {STREAM_CHUNK_VAR}, {COPY_STORES_VAR}, {CPU_THREADS_VAR} and \
             {GATHER_VAR} tune the CPU optimizer offload, which this config does not use: they \
             change nothing"
        );
        return Ok(());
    };
    let stream = &mut offload.stream;
    stream.chunk = tuning.stream_chunk.unwrap_or(stream.chunk);
    stream.copy_stores = tuning.copy_stores.or(stream.copy_stores);
    stream.gather_in_pieces = tuning.gather_in_pieces.unwrap_or(stream.gather_in_pieces);
    offload.cpu_threads = tuning.cpu_threads.unwrap_or(offload.cpu_threads);
    let stream = offload.stream;
    let mib = stream.chunk as f64 * dtype.size() as f64 / MIB;
    let default = |set: bool| if set { "" } else { " (the default)" };
    tracing::info!(
        "rank {rank}: offload tuned by {STREAM_CHUNK_VAR}/{COPY_STORES_VAR}/{CPU_THREADS_VAR}/\
         {GATHER_VAR}: chunks of {} elements ({mib} MiB of {dtype}){}, {} stores of the weight \
         copy{}, the CPU optimizer on {} threads{}, the ranks' weights gathered {}{}",
        stream.chunk,
        default(tuning.stream_chunk.is_some()),
        stream.copy_stores.map_or("per-path (normal where the step streams)", Stores::name),
        default(tuning.copy_stores.is_some()),
        offload.cpu_threads,
        default(tuning.cpu_threads.is_some()),
        if stream.gather_in_pieces { "in pieces while stepping" } else { "after the step" },
        default(tuning.gather_in_pieces.is_some()),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(chunk_mib: Option<&str>, copy_stores: Option<&str>) -> Result<StreamTuning, String> {
        StreamTuning::parse(chunk_mib, copy_stores, DType::Bf16)
    }

    #[test]
    fn unset_or_blank_variables_keep_the_defaults() {
        let default = Ok(StreamTuning::default());
        assert_eq!(parse(None, None), default);
        assert_eq!(parse(Some(""), Some("")), default);
        assert_eq!(parse(Some(" \n"), Some("  ")), default);
    }

    /// MiB of the parameter dtype become whole elements: bf16 and f16 have 2 bytes, f32 4.
    #[test]
    fn a_chunk_in_mib_becomes_elements_of_the_parameter_dtype() {
        let chunk = |mib, dtype| StreamTuning::parse(Some(mib), None, dtype).unwrap().stream_chunk;
        assert_eq!(chunk("32", DType::Bf16), Some(1 << 24));
        assert_eq!(chunk(" 4\n", DType::F16), Some(1 << 21));
        assert_eq!(chunk("4", DType::F32), Some(1 << 20));
        assert_eq!(chunk("0.5", DType::Bf16), Some(1 << 18));
        // 104.86 bytes: 52 whole bf16 elements.
        assert_eq!(chunk("1e-4", DType::Bf16), Some(52));
        assert_eq!(parse(Some("2"), None).unwrap().copy_stores, None);
    }

    #[test]
    fn cpu_threads_take_a_positive_whole_number() {
        assert_eq!(StreamTuning::parse_threads(None), Ok(None));
        assert_eq!(StreamTuning::parse_threads(Some(" ")), Ok(None));
        assert_eq!(StreamTuning::parse_threads(Some("15\n")), Ok(Some(15)));
    }

    #[test]
    fn the_gather_is_in_pieces_or_after_the_step() {
        assert_eq!(StreamTuning::parse_gather(None), Ok(None));
        assert_eq!(StreamTuning::parse_gather(Some("")), Ok(None));
        assert_eq!(StreamTuning::parse_gather(Some("Pieces")), Ok(Some(true)));
        assert_eq!(StreamTuning::parse_gather(Some(" after-step\n")), Ok(Some(false)));
        for bad in ["after", "end", "1"] {
            let reason = StreamTuning::parse_gather(Some(bad)).unwrap_err();
            assert!(reason.contains(GATHER_VAR) && reason.contains("pieces or after-step"));
        }
    }

    #[test]
    fn copy_stores_accept_normal_and_non_temporal_in_any_case() {
        let stores = |value| parse(None, Some(value)).unwrap().copy_stores;
        assert_eq!(stores("normal"), Some(Stores::Normal));
        assert_eq!(stores(" Normal\n"), Some(Stores::Normal));
        assert_eq!(stores("non-temporal"), Some(Stores::NonTemporal));
        assert_eq!(stores("NON-TEMPORAL"), Some(Stores::NonTemporal));
        assert_eq!(parse(None, Some("normal")).unwrap().stream_chunk, None);
    }

    #[test]
    fn bad_values_are_refused_naming_the_variable_and_what_it_accepts() {
        for bad in ["0", "-1", "abc", "1MiB", "inf", "NaN", "0x10"] {
            let reason = parse(Some(bad), None).unwrap_err();
            assert!(reason.contains(STREAM_CHUNK_VAR), "{reason}");
            assert!(reason.contains(&format!("{bad:?}")), "{reason}");
            assert!(reason.contains("positive number of MiB"), "{reason}");
        }
        // Less than one 4-byte element.
        let reason = StreamTuning::parse(Some("1e-7"), None, DType::F32).unwrap_err();
        assert!(reason.contains(STREAM_CHUNK_VAR) && reason.contains("less than one"), "{reason}");
        for bad in ["nt", "streaming", "non_temporal", "1"] {
            let reason = parse(None, Some(bad)).unwrap_err();
            assert!(reason.contains(COPY_STORES_VAR), "{reason}");
            assert!(reason.contains(&format!("{bad:?}")), "{reason}");
            assert!(reason.contains("normal or non-temporal"), "{reason}");
        }
        for bad in ["0", "-2", "1.5", "eight"] {
            let reason = StreamTuning::parse_threads(Some(bad)).unwrap_err();
            assert!(reason.contains(CPU_THREADS_VAR), "{reason}");
            assert!(reason.contains("positive whole number"), "{reason}");
        }
        // A good value does not excuse a bad one in the other variable.
        assert!(parse(Some("4"), Some("fast")).is_err());
        assert!(parse(Some("fast"), Some("normal")).is_err());
    }
}
