//! `bench cpu-adam`'s measurement: the CPU AdamW step over one partition-sized buffer set, timed,
//! against the host's streaming bandwidth measured with the same access pattern, threads and
//! chunking (the roofline). The optimizer is memory-bound, so the fraction of the roofline it
//! reaches is what tuning can still win.

use serde::Serialize;
use zeroflow_optim::{
    CpuAdam, GradDtype, OptimizerStateDtype, SimdLevel, Stores, Workload, measure,
};

use crate::error::{Result, TrainError};
use crate::limits::available_host_memory;

/// What to measure: `iters` timed passes of each kind (the median is reported) after `warmup`
/// untimed ones, over `params` parameters.
#[derive(Clone, Copy, Debug)]
pub struct CpuAdamOptions {
    pub params: usize,
    pub threads: usize,
    pub simd: SimdLevel,
    pub grad: GradDtype,
    pub moments: OptimizerStateDtype,
    /// Also write the bf16 copy of the updated weights in the same pass.
    pub bf16_copy: bool,
    /// How the bf16 copy is written [default: the optimizer's].
    pub copy_stores: Option<Stores>,
    /// Chunks each pass is cut into per thread [default: the optimizer's].
    pub tasks_per_thread: Option<usize>,
    pub warmup: u32,
    pub iters: u32,
    /// Compare the buffers' size with MemAvailable first.
    pub check_memory: bool,
    /// Also time the step that saves the state it overwrites (a speculative step's backup):
    /// in the step's pass, and as a copy before the step.
    pub saving: bool,
}

/// Bytes per parameter of the f32 copy of the state a saving step writes.
const SAVED_BYTES: usize = 12;

/// What [`run`] measured, as `bench cpu-adam --json` prints it.
#[derive(Clone, Debug, Serialize)]
pub struct CpuAdamReport {
    pub bench: &'static str,
    pub params: usize,
    pub threads: usize,
    pub simd: &'static str,
    pub roofline_simd: &'static str,
    pub grad_dtype: &'static str,
    pub state_dtype: &'static str,
    pub bf16_copy: bool,
    pub copy_stores: &'static str,
    pub tasks_per_thread: usize,
    /// Bytes one parameter's step reads and writes.
    pub bytes_per_param: usize,
    pub iters: u32,
    /// Seconds of the median AdamW pass.
    pub median_s: f64,
    pub gparams_per_s: f64,
    pub gb_per_s: f64,
    pub roofline_gparams_per_s: f64,
    pub roofline_gb_per_s: f64,
    /// Seconds of the fastest roofline variant's median pass.
    pub roofline_s: f64,
    pub roofline_variant: String,
    /// Every roofline variant's rate, Gparam/s.
    pub roofline_variants_gparams_per_s: serde_json::Map<String, serde_json::Value>,
    pub roofline_fraction: f64,
    /// With `--saving`: the median pass of the step saving the state in its own pass, and its
    /// traffic (the step's and the saved copy written).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saving_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saving_bytes_per_param: Option<usize>,
    /// With `--saving`: the median of a copy of the state followed by the step, and its
    /// traffic (the state read and written once more).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy_then_step_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy_then_step_bytes_per_param: Option<usize>,
}

/// Checks the size against the host's memory, then times the AdamW and the roofline.
pub fn run(options: &CpuAdamOptions) -> Result<CpuAdamReport> {
    let CpuAdamOptions { params, grad, moments, bf16_copy, .. } = *options;
    if params == 0 {
        return Err(TrainError::Input("--params must be at least 1".into()));
    }
    if options.threads == 0 {
        return Err(TrainError::Input("--threads must be at least 1".into()));
    }
    if options.check_memory {
        let saved = if options.saving { SAVED_BYTES } else { 0 };
        let bytes = Workload::bytes_allocated_per_param(grad, moments, bf16_copy) + saved;
        check_memory(params, bytes)?;
    }
    // The one failure here is a SIMD level this CPU lacks: the user's to change.
    let mut adam = CpuAdam::new(options.threads, options.simd)
        .map_err(|e| TrainError::Input(e.to_string()))?;
    if let Some(tasks) = options.tasks_per_thread {
        adam = adam.with_tasks_per_thread(tasks);
    }
    if let Some(stores) = options.copy_stores {
        adam = adam.with_copy_stores(stores);
    }
    let mut workload = Workload::new(&adam, params, grad, moments, bf16_copy, 0x5EED);
    let mut save = options.saving.then(|| workload.save_buffers(&adam));
    let timings = measure(&adam, &mut workload, save.as_mut(), options.warmup, options.iters)
        .map_err(|e| TrainError::Engine(e.into()).context("measuring the CPU AdamW"))?;
    let bytes_per_param = Workload::bytes_moved_per_param(grad, moments, bf16_copy);
    let gparams = |seconds: f64| params as f64 / seconds / 1e9;
    let (roofline_variant, roofline_s) = timings.best_roofline();
    let (gparams_per_s, roofline_gparams_per_s) = (gparams(timings.adamw), gparams(roofline_s));
    Ok(CpuAdamReport {
        bench: "cpu-adam",
        params,
        threads: adam.threads(),
        simd: adam.simd_level().name(),
        roofline_simd: SimdLevel::detect().name(),
        grad_dtype: grad.name(),
        state_dtype: moments.name(),
        bf16_copy,
        copy_stores: adam.copy_stores().name(),
        tasks_per_thread: adam.tasks_per_thread(),
        bytes_per_param,
        iters: options.iters,
        median_s: timings.adamw,
        gparams_per_s,
        gb_per_s: gparams_per_s * bytes_per_param as f64,
        roofline_gparams_per_s,
        roofline_gb_per_s: roofline_gparams_per_s * bytes_per_param as f64,
        roofline_s,
        roofline_variant: roofline_variant.name(),
        roofline_variants_gparams_per_s: timings
            .roofline
            .iter()
            .map(|(variant, s)| (variant.name(), serde_json::json!(gparams(*s))))
            .collect(),
        roofline_fraction: gparams_per_s / roofline_gparams_per_s,
        saving_s: timings.saving.map(|[saving, _]| saving),
        saving_bytes_per_param: options.saving.then_some(bytes_per_param + SAVED_BYTES),
        copy_then_step_s: timings.saving.map(|[_, copy_first]| copy_first),
        copy_then_step_bytes_per_param: options
            .saving
            .then_some(bytes_per_param + moments.state_bytes_per_param() + SAVED_BYTES),
    })
}

impl std::fmt::Display for CpuAdamReport {
    /// The table `bench cpu-adam` prints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let copy = if self.bf16_copy {
            format!(" + bf16 copy ({} stores)", self.copy_stores)
        } else {
            String::new()
        };
        writeln!(
            f,
            "cpu-adam: {} params ({:.2e}), {} threads × {} chunks, {} kernel, {} gradients, {} \
             moments{copy}, median of {} passes",
            self.params,
            self.params as f64,
            self.threads,
            self.tasks_per_thread,
            self.simd,
            self.grad_dtype,
            self.state_dtype,
            self.iters,
        )?;
        writeln!(
            f,
            "  adamw      {:6.3} Gparam/s  {:7.1} GB/s  {:8.4} s/pass  ({} B/param)",
            self.gparams_per_s, self.gb_per_s, self.median_s, self.bytes_per_param
        )?;
        let variants: Vec<String> = (self.roofline_variants_gparams_per_s.iter())
            .map(|(name, rate)| format!("{name} {:.3}", rate.as_f64().unwrap_or(0.0)))
            .collect();
        writeln!(
            f,
            "  roofline   {:6.3} Gparam/s  {:7.1} GB/s  {:8.4} s/pass  (best: {}; all in \
             Gparam/s: {})",
            self.roofline_gparams_per_s,
            self.roofline_gb_per_s,
            self.roofline_s,
            self.roofline_variant,
            variants.join(", "),
        )?;
        writeln!(f, "  fraction   {:6.1} % of the roofline", self.roofline_fraction * 100.0)?;
        let rows = [
            ("saving", self.saving_s, self.saving_bytes_per_param),
            ("copy+step", self.copy_then_step_s, self.copy_then_step_bytes_per_param),
        ];
        for (name, seconds, bytes) in rows {
            let (Some(seconds), Some(bytes)) = (seconds, bytes) else { continue };
            let rate = self.params as f64 / seconds / 1e9;
            writeln!(
                f,
                "  {name:<10} {rate:6.3} Gparam/s  {:7.1} GB/s  {seconds:8.4} s/pass  ({bytes} \
                 B/param)",
                rate * bytes as f64
            )?;
        }
        Ok(())
    }
}

/// Refuses sizes that do not fit in the memory the kernel says is available.
fn check_memory(params: usize, bytes_per_param: usize) -> Result<()> {
    const GIB: f64 = (1u64 << 30) as f64;
    let Some(available) = available_host_memory() else {
        return Ok(()); // Not Linux, or no MemAvailable: nothing to check against.
    };
    let needed = params as u128 * bytes_per_param as u128;
    if needed <= u128::from(available) {
        return Ok(());
    }
    let fit = available / bytes_per_param as u64;
    Err(TrainError::Input(format!(
        "{params} parameters need {:.1} GiB ({bytes_per_param} bytes each) but only {:.1} GiB is \
         available (MemAvailable in /proc/meminfo); at most {fit} parameters ({fit:.2e}) fit: pass \
         a smaller --params, or --skip-memory-check where memory grows on demand",
        needed as f64 / GIB,
        available as f64 / GIB,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(saving: bool, moments: OptimizerStateDtype) -> CpuAdamOptions {
        CpuAdamOptions {
            params: 70_001,
            threads: 2,
            simd: SimdLevel::detect(),
            grad: GradDtype::Bf16,
            moments,
            bf16_copy: true,
            copy_stores: None,
            tasks_per_thread: None,
            warmup: 0,
            iters: 1,
            check_memory: true,
            saving,
        }
    }

    /// `--saving` times both ways of saving the state and counts their traffic: the step's 28
    /// bytes (20 with bf16 moments) and the saved f32 copy written, and for the copy taken apart
    /// the state read once more; without it the report has neither.
    #[test]
    fn the_saving_rows_count_the_saved_copy_and_are_absent_unless_asked() {
        let report = run(&options(true, OptimizerStateDtype::Fp32)).unwrap();
        assert_eq!(report.bytes_per_param, 28);
        assert_eq!(report.saving_bytes_per_param, Some(40));
        assert_eq!(report.copy_then_step_bytes_per_param, Some(52));
        assert!(report.saving_s.is_some_and(|s| s > 0.0), "{report:?}");
        assert!(report.copy_then_step_s.is_some_and(|s| s > 0.0), "{report:?}");
        let table = report.to_string();
        assert!(table.contains("saving") && table.contains("copy+step"), "{table}");

        let bf16 = run(&options(true, OptimizerStateDtype::Bf16)).unwrap();
        assert_eq!(bf16.saving_bytes_per_param, Some(32));
        assert_eq!(bf16.copy_then_step_bytes_per_param, Some(40));

        let plain = run(&options(false, OptimizerStateDtype::Fp32)).unwrap();
        assert!(plain.saving_s.is_none() && plain.copy_then_step_s.is_none());
        assert!(!plain.to_string().contains("saving"));
        let json = serde_json::to_value(&plain).unwrap();
        assert!(json.get("saving_s").is_none(), "{json}");
    }
}
