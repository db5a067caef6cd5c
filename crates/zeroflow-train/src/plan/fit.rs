//! The optimizer's device share that fits (`--device-share fit`, `ZEROFLOW_DEVICE_SHARE=fit`,
//! `zeroflow.offload.device_share: "fit"`, and the default where one rank asks for no share):
//! chosen from the memory plan before anything is allocated, as the largest share of the
//! partition's optimizer state the GPU has room for.

use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::config::DeviceShare;
use zeroflow_engine::{AccumulateOn, ShareState};

use super::{Knob, MemoryPlan, PlanInputs, gib};
use crate::DeviceKind;
use crate::error::{Result, input};
use crate::settings::Requested;

/// The part of the GPU's memory `fit` leaves free beside its plan: a tenth (the plan's totals are
/// within 5 % of the measured peaks, BENCHMARKS.md; the rest is for the allocator's rounding and
/// what no plan line holds).
const FIT_HEADROOM: f64 = 0.1;

/// Memory held on the GPU by other processes that `fit`'s reason names (below it, the context
/// estimate's own error).
pub(super) const SAID_ELSEWHERE: u64 = 1 << 30;

/// The largest share `fit` chooses: the engine takes shares below 1.
const FIT_MAX_HUNDREDTHS: u32 = 99;

/// The share a device share staged from host memory takes where none is asked for
/// (`device_share_state: host` alone): where the host-memory bandwidths measured for the CPU's
/// AdamW and the GPU's copies balance (BENCHMARKS.md); on an H100 0.25 and 0.4 ran alike.
pub const DEFAULT_STAGED_SHARE: f64 = 0.4;

/// What `fit` chose for a run, and why, in words for the run's log.
#[derive(Clone, Debug, PartialEq)]
pub struct FitShare {
    /// A fraction at least 0 and below 1, in hundredths.
    pub share: f64,
    pub why: String,
}

/// The device share `fit` chooses for the run of `inputs` (whatever share its options hold): the
/// largest, in hundredths below 1, whose plan, beside the `elsewhere` bytes other processes hold
/// on the GPU, leaves `FIT_HEADROOM` of the GPU's memory free; 0 where the share cannot act on
/// this run (no offload, the CPU device, ZenFlow or the delayed update, 16-bit moments, a window
/// summed on the host, or on the device with several ranks sharing the weights) or the plan
/// leaves no room.
pub fn fit_device_share(inputs: &PlanInputs, elsewhere: u64) -> Result<FitShare> {
    let none = |why: &str| Ok(FitShare { share: 0.0, why: why.to_owned() });
    let Some(offload) = inputs.options.offload() else {
        return none("the optimizer is on the GPU already (no CPU offload)");
    };
    let (DeviceKind::Cuda, Some(gpu)) = (inputs.device, inputs.gpu_memory) else {
        return none("no GPU's memory to fill (the CPU device, or a GPU that does not say)");
    };
    if offload.moments != OptimizerStateDtype::Fp32 {
        return none("the share needs fp32 moments (zeroflow.optimizer_state_dtype)");
    }
    let at = |hundredths: u32| -> Result<MemoryPlan> {
        let mut inputs = inputs.clone();
        if let Some(offload) = inputs.options.offload_mut() {
            offload.stream.device_share = f64::from(hundredths) / 100.0;
        }
        MemoryPlan::new(inputs)
    };
    let without = at(0)?.gpu_total;
    // The plan counts the share's 16 B per element only where the engine lets it act.
    let per_hundredth = at(50)?.gpu_total.saturating_sub(without) as f64 / 50.0;
    if per_hundredth == 0.0 {
        return none(
            "the share acts on the exact offload step: with one micro-step per step, or with \
             the window summed on the GPU where one rank holds every weight",
        );
    }
    let limit = ((gpu as f64 * (1.0 - FIT_HEADROOM)) as u64).saturating_sub(elsewhere);
    let room = limit.saturating_sub(without) as f64;
    let mut hundredths = ((room / per_hundredth).floor() as u32).min(FIT_MAX_HUNDREDTHS);
    // The share is rounded to whole packs of eight elements: the plan at the guess says.
    let planned = loop {
        let planned = at(hundredths)?.gpu_total;
        if hundredths == 0 || planned <= limit {
            break planned;
        }
        hundredths -= 1;
    };
    let share = f64::from(hundredths) / 100.0;
    let mut why = match hundredths {
        0 => format!(
            "the plan without a share ({}) leaves under a tenth of the GPU's {} free",
            gib(without),
            gib(gpu)
        ),
        _ => format!(
            "the plan then holds {} of the GPU's {} (a tenth left free)",
            gib(planned),
            gib(gpu)
        ),
    };
    if elsewhere >= SAID_ELSEWHERE {
        why += &format!(", beside {} that other processes hold", gib(elsewhere));
    }
    // At the cap the offload keeps the optimizer on the GPU and in host memory both: where it
    // fits the GPU alone, the run without offload holds less of either.
    if hundredths == FIT_MAX_HUNDREDTHS
        && let Some(on_gpu) = Knob::OptimizerOnGpu.apply(inputs)
        && let Ok(on_gpu) = MemoryPlan::new(on_gpu)
        && on_gpu.gpu_total <= limit
    {
        why += &format!(
            "; the whole optimizer fits on the GPU: with {} the run would hold {} of it and no \
             optimizer state in host memory, at the same speed",
            Knob::OptimizerOnGpu.flag(inputs.caller),
            gib(on_gpu.gpu_total)
        );
    }
    Ok(FitShare { share, why })
}

/// `fit` resolved for a run before anything is allocated, where `requested` asks for it or asks
/// for no share on one rank (the default): the share chosen into `requested` and into `inputs`'
/// options (with gradient accumulation the window is then summed on the device, as the plan
/// found room for), said in the log; `None` where a fraction is asked for, or where the default
/// finds nothing to share. `elsewhere` says what other processes hold on the GPU (asked only
/// where a share can act; `None` counts as nothing).
///
/// Why `fit` is the default on one rank: the share changes no number (the step is the CPU's bit
/// for bit), and the exact offload step is bound by the host's memory, which moves only what is
/// not shared (llama-8b on an H200: 1.86× the tokens/s of share 0, BENCHMARKS.md). With several
/// ranks the default stays 0 and the run says what `fit` would choose: a share per rank is not
/// yet measured on several GPUs.
pub fn resolve_fit(
    requested: &mut Requested,
    inputs: &mut PlanInputs,
    elsewhere: impl FnOnce() -> Option<u64>,
) -> Result<Option<FitShare>> {
    if requested.device_share_state == Some(ShareState::Host) {
        // `fit` finds room for the state on the device; a share staged from host memory holds
        // a few pieces there whatever its size, and is a trade of the host's bandwidth.
        match requested.device_share {
            Some(DeviceShare::Fraction(_)) => {}
            Some(DeviceShare::Fit) => {
                return Err(input(format!(
                    "--device-share fit chooses the share whose state the GPU has room for; with \
                     the share's state in host memory (device_share_state \"host\") the GPU \
                     holds a few pieces of it whatever the share: give a fraction instead \
                     (--device-share {DEFAULT_STAGED_SHARE}, the default with a host state)"
                )));
            }
            None => {
                let share = DEFAULT_STAGED_SHARE;
                if inputs.rank == 0 {
                    tracing::info!(
                        "device share {share} (the default with its state in host memory): \
                         stepped on the GPU, staged from host memory a piece at a time"
                    );
                }
                hold_asked_share(requested, inputs, share);
                return Ok(None);
            }
        }
    }
    let by_default = match requested.device_share {
        Some(DeviceShare::Fraction(_)) => return Ok(None),
        Some(DeviceShare::Fit) => false,
        None if inputs.world_size > 1 => {
            if inputs.rank == 0
                && let Some(hint) = fit_hint(inputs)?
            {
                tracing::info!("{hint}");
            }
            return Ok(None);
        }
        None => true,
    };
    // The default chooses (and speaks) only where a share can act and the GPU alone has room.
    if by_default && fit_device_share(inputs, 0)?.share == 0.0 {
        return Ok(None);
    }
    let fit = fit_device_share(inputs, elsewhere().unwrap_or(0))?;
    hold_asked_share(requested, inputs, fit.share);
    if inputs.rank == 0 {
        let asked = if by_default { "fit (the default on one GPU; 0 turns it off)" } else { "fit" };
        tracing::info!(
            "device share {asked}: {} of the optimizer's partition held and stepped on the GPU: {}",
            fit.share,
            fit.why
        );
    }
    Ok(Some(fit))
}

/// Puts `share` in `requested` and in `inputs`' options ([`hold_share`]), with the window summed
/// on the device where that says so.
fn hold_asked_share(requested: &mut Requested, inputs: &mut PlanInputs, share: f64) {
    requested.device_share = Some(DeviceShare::Fraction(share));
    if hold_share(inputs, share) {
        requested.accumulate_on = Some(AccumulateOn::Device);
    }
}

/// Puts `share` of the partition's optimizer on the device in `inputs`' options, as a run takes
/// it: with gradient accumulation a share above 0 has the window summed on the device (true
/// then).
pub(super) fn hold_share(inputs: &mut PlanInputs, share: f64) -> bool {
    let summed = share > 0.0 && inputs.options.grad_accum > 1;
    if let Some(offload) = inputs.options.offload_mut() {
        offload.stream.device_share = share;
        if summed {
            offload.stream.accumulate_on = AccumulateOn::Device;
        }
    }
    summed
}

/// Where several ranks ask for no share (0 for them) and `fit` would find room for one on this
/// rank's GPU, the line that says so: the exact offload step is bound by the host's memory, and
/// the share is the part of it the host then does not move. `None` where `fit` would choose 0.
fn fit_hint(inputs: &PlanInputs) -> Result<Option<String>> {
    let fit = fit_device_share(inputs, 0)?;
    Ok((fit.share > 0.0).then(|| {
        format!(
            "the GPU has room for part of the optimizer: `--device-share fit` would hold and step \
             {} of each rank's partition there ({}), so that the exact step moves only the rest \
             through the host's memory, which bounds it; with several ranks the default is 0 (the \
             host moves all of it)",
            fit.share, fit.why
        )
    }))
}

#[cfg(test)]
mod tests {
    use zeroflow_engine::Stage;

    use super::super::tests::{GIB, inputs, machine};
    use super::*;

    fn with_gpu(mut inputs: PlanInputs, gib: u64) -> PlanInputs {
        inputs.gpu_memory = Some(gib * GIB);
        inputs
    }

    fn planned(inputs: &PlanInputs, share: f64) -> u64 {
        let mut inputs = inputs.clone();
        inputs.options.offload_mut().expect("offload").stream.device_share = share;
        MemoryPlan::new(inputs).expect("a plan").gpu_total
    }

    /// gpt-1.3b offloaded on GPUs of 32, 40 and 80 GiB: the share chosen is the largest whose
    /// plan leaves a tenth free, the next hundredth's would not, and a larger GPU gets more.
    #[test]
    fn fit_is_the_largest_share_that_leaves_a_tenth_free() {
        let mut shares = Vec::new();
        for gpu in [32, 40, 80] {
            let inputs = with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), gpu);
            let fit = fit_device_share(&inputs, 0).unwrap();
            let limit = (gpu * GIB) as f64 * 0.9;
            assert!(fit.share > 0.0 && fit.share < 1.0, "{gpu} GiB: {fit:?}");
            assert!(planned(&inputs, fit.share) as f64 <= limit, "{gpu} GiB: {fit:?}");
            if fit.share < 0.99 {
                let next = (fit.share * 100.0 + 1.0) / 100.0;
                assert!(planned(&inputs, next) as f64 > limit, "{gpu} GiB: {fit:?}");
            }
            assert!(fit.why.contains("a tenth left free"), "{}", fit.why);
            shares.push(fit.share);
        }
        assert!(shares[0] < shares[1] && shares[1] < shares[2], "{shares:?}");
        // 80 GiB holds all of gpt-1.3b's 16 B per parameter beside the rest: the cap, and the
        // reason names the run without offload, which fits too; below the cap it does not.
        assert_eq!(shares[2], 0.99);
        let capped = fit_device_share(&with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 80), 0);
        let why = capped.unwrap().why;
        assert!(why.contains("the whole optimizer fits on the GPU: with --mode gpu"), "{why}");
        let below = fit_device_share(&with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 40), 0);
        assert!(!below.unwrap().why.contains("the whole optimizer fits"));
    }

    /// Memory other processes hold on the GPU leaves `fit` less room: on 48 GiB, where gpt-1.3b
    /// alone gets the cap, the share chosen beside 8 GiB of theirs is the largest whose plan and
    /// those 8 GiB leave a tenth free, the reason names them, and where they take all the room
    /// the share is 0.
    #[test]
    fn other_processes_on_the_gpu_leave_fit_less_room() {
        let inputs = with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 48);
        let alone = fit_device_share(&inputs, 0).unwrap();
        let beside = fit_device_share(&inputs, 8 * GIB).unwrap();
        assert!(0.0 < beside.share && beside.share < alone.share, "{alone:?} {beside:?}");
        let limit = (48 * GIB) as f64 * 0.9;
        assert!((planned(&inputs, beside.share) + 8 * GIB) as f64 <= limit, "{beside:?}");
        let next = (beside.share * 100.0 + 1.0) / 100.0;
        assert!((planned(&inputs, next) + 8 * GIB) as f64 > limit, "{beside:?}");
        assert!(beside.why.contains("beside 8.00 GiB that other processes hold"), "{beside:?}");
        assert!(!alone.why.contains("other processes"), "{alone:?}");
        let crowded = fit_device_share(&inputs, 24 * GIB).unwrap();
        assert_eq!(crowded.share, 0.0, "{crowded:?}");
    }

    /// `resolve_fit` resolves `fit`, asked for or (on one rank) the default, and reads what
    /// other processes hold only where a share can act: not for a fraction asked for (0 too),
    /// not for the default where the share cannot act (ZenFlow) or with several ranks.
    #[test]
    fn resolve_fit_takes_fit_by_default_on_one_rank() {
        let inputs = with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 48);
        let read = std::cell::Cell::new(0);
        let elsewhere = |bytes| {
            let read = &read;
            move || {
                read.set(read.get() + 1);
                Some(bytes)
            }
        };
        let mut two_ranks = inputs.clone();
        two_ranks.world_size = 2;
        let zenflow = with_gpu(super::super::tests::inputs("gpt-1.3b", "zenflow", (8, 1024)), 48);
        let untouched = [
            (Some(DeviceShare::Fraction(0.2)), &inputs),
            (Some(DeviceShare::Fraction(0.0)), &inputs),
            (None, &two_ranks),
            (None, &zenflow),
        ];
        for (asked, inputs) in untouched {
            let mut requested = Requested { device_share: asked, ..Requested::default() };
            let mut resolved_inputs = inputs.clone();
            let resolved = resolve_fit(&mut requested, &mut resolved_inputs, elsewhere(0));
            assert_eq!(resolved.unwrap(), None, "{asked:?}");
            assert_eq!(requested.device_share, asked);
            let share = resolved_inputs.options.offload().map(|o| o.stream.device_share);
            assert_eq!(share, inputs.options.offload().map(|o| o.stream.device_share));
        }
        assert_eq!(read.get(), 0, "no reading where no share can be chosen");
        let expected = fit_device_share(&inputs, 8 * GIB).unwrap();
        assert!(expected.share < fit_device_share(&inputs, 0).unwrap().share);
        for (reads, asked) in [(1, Some(DeviceShare::Fit)), (2, None)] {
            let mut requested = Requested { device_share: asked, ..Requested::default() };
            let mut resolved_inputs = inputs.clone();
            let chosen = resolve_fit(&mut requested, &mut resolved_inputs, elsewhere(8 * GIB));
            assert_eq!(read.get(), reads, "{asked:?}");
            assert_eq!(chosen.unwrap(), Some(expected.clone()), "{asked:?}");
            assert_eq!(requested.device_share, Some(DeviceShare::Fraction(expected.share)));
            let share = resolved_inputs.options.offload().unwrap().stream.device_share;
            assert_eq!(share, expected.share, "{asked:?}");
        }
    }

    /// A GPU the plan without a share already nearly fills: 0, and the plan's figures say why.
    #[test]
    fn no_room_is_a_share_of_0() {
        let inputs = with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 22);
        let fit = fit_device_share(&inputs, 0).unwrap();
        assert_eq!(fit.share, 0.0);
        assert!(fit.why.contains("leaves under a tenth"), "{}", fit.why);
    }

    /// Where the share cannot act, `fit` is 0 with the reason, whatever the GPU's memory: the
    /// optimizer on the GPU, ZenFlow, the CPU device, two ranks of ZeRO-2 summing a window on
    /// the device, 16-bit moments.
    #[test]
    fn fit_is_0_where_the_share_cannot_act() {
        let base = || with_gpu(inputs("gpt2-124m", "offload", (4, 256)), 140);
        let mut cases = vec![
            ("gpu", with_gpu(inputs("gpt2-124m", "gpu", (4, 256)), 140), "on the GPU already"),
            ("zenflow", with_gpu(inputs("gpt2-124m", "zenflow", (4, 256)), 140), "exact offload"),
        ];
        let mut cpu = base();
        cpu.device = DeviceKind::Cpu;
        cases.push(("cpu", cpu, "no GPU's memory"));
        let mut ranks = base();
        ranks.world_size = 2;
        ranks.options.grad_accum = 2;
        ranks.options.offload_mut().unwrap().stream.accumulate_on = AccumulateOn::Device;
        assert_eq!(ranks.options.stage, Stage::Zero2);
        cases.push(("two ranks summing", ranks, "one rank holds every weight"));
        let mut bf16 = base();
        bf16.options.offload_mut().unwrap().moments = OptimizerStateDtype::Bf16;
        cases.push(("bf16 moments", bf16, "fp32 moments"));
        for (name, inputs, why) in cases {
            let fit = fit_device_share(&inputs, 0).unwrap();
            assert_eq!(fit.share, 0.0, "{name}");
            assert!(fit.why.contains(why), "{name}: {}", fit.why);
        }
        // And where it can, the same model on the same GPU gets a share: one rank (speculating
        // or not, with one micro-step per step or a window summed on the device), or each of
        // two ranks of ZeRO-2 with one micro-step per step.
        assert!(fit_device_share(&base(), 0).unwrap().share > 0.0);
        let mut speculating = base();
        speculating.options.offload_mut().unwrap().stream.speculation_budget = 64 << 20;
        assert!(fit_device_share(&speculating, 0).unwrap().share > 0.0);
        speculating.options.grad_accum = 2;
        speculating.options.offload_mut().unwrap().stream.accumulate_on = AccumulateOn::Device;
        assert!(fit_device_share(&speculating, 0).unwrap().share > 0.0);
        let mut two = base();
        two.world_size = 2;
        assert!(fit_device_share(&two, 0).unwrap().share > 0.0);
    }

    /// Several ranks asking for no share keep 0, and on a GPU with room rank 0 says what `fit`
    /// would choose; a run where the share cannot act (ZenFlow) and a GPU without room say
    /// nothing.
    #[test]
    fn several_ranks_are_told_what_fit_would_choose() {
        let ranks = |mut inputs: PlanInputs| {
            inputs.world_size = 2;
            inputs
        };
        let roomy = ranks(with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 40));
        let chosen = fit_device_share(&roomy, 0).unwrap();
        assert!(chosen.share > 0.0, "{chosen:?}");
        let hint = fit_hint(&roomy).unwrap().expect("a hint");
        assert!(hint.contains(&format!("would hold and step {} of each rank", chosen.share)));
        assert!(hint.contains(&chosen.why), "{hint}");
        let zenflow = ranks(with_gpu(inputs("gpt-1.3b", "zenflow", (8, 1024)), 40));
        let full = ranks(with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 22));
        for quiet in [zenflow, full] {
            assert_eq!(fit_hint(&quiet).unwrap(), None);
        }
    }

    /// A share the GPU has no room for is refused before anything is allocated, naming the
    /// share that fits as the knob that brings the plan under.
    #[test]
    fn a_share_too_large_is_refused_naming_the_share_that_fits() {
        let mut inputs = with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 32);
        let fits = fit_device_share(&inputs, 0).unwrap().share;
        inputs.options.offload_mut().unwrap().stream.device_share = 0.9;
        let plan = MemoryPlan::new(inputs).unwrap();
        let machine = machine(32 * GIB, 1024 * GIB, 1024 * GIB);
        let error = plan.check(&machine).expect_err("does not fit").to_string();
        assert!(error.contains(&format!("--device-share {fits} (or fit)")), "{error}");
    }

    /// Where the host is short for the optimizer and the GPU has room for part of it, the share
    /// that fits is named as a knob: llama-8b's exact offload at share 0 needs about 91 GiB of
    /// host memory, at the share `fit` chooses about half, which a 64 GiB host has room for.
    #[test]
    fn a_host_too_small_names_the_share_that_fits() {
        let mut inputs = with_gpu(inputs("llama-8b", "offload", (4, 2048)), 140);
        inputs.model_options.activation_checkpointing = true;
        let fits = fit_device_share(&inputs, 0).unwrap().share;
        assert!(fits > 0.5, "{fits}");
        inputs.options.offload_mut().unwrap().stream.device_share = 0.0;
        let plan = MemoryPlan::new(inputs).unwrap();
        let small = machine(140 * GIB, 64 * GIB, 62 * GIB);
        let error = plan.check(&small).expect_err("does not fit").to_string();
        assert!(error.contains(&format!("--device-share {fits} (or fit)")), "{error}");
        let roomy = machine(140 * GIB, 128 * GIB, 124 * GIB);
        assert!(plan.fit(&roomy).fits(), "{}", plan.summary(&roomy));
    }

    /// With accumulation the share acts on the window summed on the GPU: where the GPU has room
    /// for the sum (`accumulate_on` auto) the share fits beside it, and where the window is
    /// summed on the host it cannot act.
    #[test]
    fn with_accumulation_the_share_needs_the_sum_on_the_gpu() {
        let mut summed = with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 40);
        summed.options.grad_accum = 4;
        let on_gpu = fit_device_share(&summed, 0).unwrap();
        assert!(on_gpu.share > 0.0, "{on_gpu:?}");
        // The sum's 4 B per parameter leave less room than one micro-step per step does.
        let single = fit_device_share(&with_gpu(inputs("gpt-1.3b", "offload", (8, 1024)), 40), 0);
        assert!(on_gpu.share < single.unwrap().share);
        let mut on_host = summed.clone();
        on_host.options.offload_mut().unwrap().stream.accumulate_on =
            zeroflow_engine::AccumulateOn::Host;
        let fit = fit_device_share(&on_host, 0).unwrap();
        assert_eq!(fit.share, 0.0, "{fit:?}");
    }
}
