//! What a resumed run keeps of the run it continues: its total of steps and its learning-rate
//! schedule (unless `--extend-schedule` re-plans it), and its data, whichever way the path is
//! spelled and from whichever directory, provided the files have not changed.

use std::path::Path;

use zeroflow_core::config::Config;

use crate::data_files::{self, DataFile};
use crate::error::{Result, input};
use crate::resume_point::ResumePoint;
use crate::schedule::LrSchedule;
use crate::setup::{DEFAULT_STEPS, DeviceKind};

/// The run's total of optimizer steps: `--steps`, else the checkpoint's run's own total when
/// resuming, else [`DEFAULT_STEPS`].
pub fn total_steps(flag: Option<u64>, resume: Option<&ResumePoint>) -> u64 {
    flag.or(resume.map(|point| point.extra.run.steps)).unwrap_or(DEFAULT_STEPS)
}

/// A run trained on a GPU computes in bf16, which the CPU device does not: resumed without
/// `--device`, it would continue on the CPU in fp32 (its config re-resolved for the CPU), far
/// slower, where the user most likely left the flag out. Refused, saying to add it; a
/// `--device cpu` given on purpose goes on (the config's differences are warned about).
pub fn check_device(point: &ResumePoint, device: DeviceKind, given: bool) -> Result<()> {
    let Some(precision) = half_precision(point) else { return Ok(()) };
    if device == DeviceKind::Cpu && !given {
        return Err(input(format!(
            "--resume {}: the checkpoint's run trained on a GPU (in {precision}); add --device \
             cuda to continue it there (--device cpu continues it on the CPU)",
            point.dir.display()
        )));
    }
    Ok(())
}

/// The 16-bit precision of the checkpoint's config (`bf16` or `fp16`), if any.
fn half_precision(point: &ResumePoint) -> Option<&'static str> {
    let saved = &point.extra.config;
    let enabled = |key: &str| saved.pointer(&format!("/{key}/enabled")) == Some(&true.into());
    ["bf16", "fp16"].into_iter().find(|key| enabled(key))
}

/// The device the checkpoint's run trained on, by its config's precision: the CUDA model
/// computes in bf16, the CPU model in fp32 only.
pub fn trained_on(point: &ResumePoint) -> DeviceKind {
    match half_precision(point) {
        Some(_) => DeviceKind::Cuda,
        None => DeviceKind::Cpu,
    }
}

/// A checkpoint from before the 1-D parameters were left out of weight decay, of a run with
/// weight decay: from its next step on, the norms' weights and biases take none, so the run no
/// longer continues exactly as the one that saved it would have. Said, not refused (the new rule
/// is the one `transformers`' `Trainer` follows); the message, where there is one.
pub fn weight_decay_rule_change(point: &ResumePoint, config: &Config) -> Option<String> {
    let decay = config.optimizer.weight_decay;
    if point.extra.decay_skips_1d || decay <= 0.0 {
        return None;
    }
    Some(format!(
        "--resume {}: the checkpoint was saved by a zeroflow whose weight decay ({decay}) also \
         took the 1-D parameters (norms' weights, biases); from step {} on they take none, as in \
         transformers' Trainer, so the run is no longer the exact continuation of the one that \
         saved it",
        point.dir.display(),
        point.extra.step + 1
    ))
}

/// A resumed run may change its total of steps, but not silently the learning-rate schedule the
/// checkpoint was trained on: where the new total re-plans it (the default config sizes its
/// warm-up and decay from `--steps`), that takes `--extend-schedule`, and is then said. A
/// schedule that does not depend on the total (a constant one, or one whose config file or
/// resolved checkpoint config gives `total_num_steps`) is kept.
pub fn check_schedule(
    point: &ResumePoint,
    config: &Config,
    steps: u64,
    extend_schedule: bool,
) -> Result<()> {
    let (at, planned) = (point.extra.step, point.extra.run.steps);
    let dir = point.dir.display();
    if steps <= at {
        let hint = if steps == planned {
            format!("the checkpoint is at step {at}, the end of its run of {planned} steps")
        } else {
            format!("the checkpoint is at step {at}, --steps is {steps}")
        };
        let hint = format!(
            "{hint}; to train further, pass a larger --steps (the new total, counting the \
             checkpoint's steps)"
        );
        return Err(input(format!("--resume {dir}: {hint}")));
    }
    let saved = point.extra.config.get("scheduler");
    let now = config.to_json();
    if saved == now.get("scheduler") {
        if steps != planned {
            tracing::info!(
                "continuing to step {steps} (the checkpoint's run planned {planned}) on the \
                 learning-rate schedule it was trained on, unchanged"
            );
        }
        return Ok(());
    }
    if steps == planned {
        // The config itself changed the schedule: the warning about changed keys says so.
        return Ok(());
    }
    let (next, planned_next) =
        (LrSchedule::from_config(config).lr(at), point.extra.lr_schedule.next_lr);
    let change = format!(
        "the learning rate of step {} would be {next:.3e} instead of the {planned_next:.3e} its run \
         planned",
        at + 1
    );
    if !extend_schedule {
        return Err(input(format!(
            "--resume {dir} --steps {steps}: the checkpoint's run planned {planned} steps, and its \
             learning-rate schedule is sized from that total; re-planning it over {steps} steps \
             changes it ({change}). Drop --steps to finish the run as planned, or add \
             --extend-schedule to re-plan the schedule over {steps} steps on purpose"
        )));
    }
    tracing::warn!(
        "--extend-schedule: the learning-rate schedule is re-planned over {steps} steps (the \
         checkpoint's run planned {planned}): {change}"
    );
    Ok(())
}

/// The `--data` of a resumed run: the checkpoint's, which `--data` may name in any spelling (a
/// relative path from another directory, an absolute one, through a link); another file is an
/// error. Checkpoints before paths were resolved hold `--data` as given, which resolves from the
/// directory their run started in.
pub fn data_arg(given: Option<String>, point: &ResumePoint) -> Result<String> {
    let saved = &point.extra.data;
    let saved_resolved = data_files::resolve(saved);
    let Some(given) = given else {
        if saved_resolved.is_err() && Path::new(saved).is_relative() {
            return Err(input(format!(
                "--resume {}: the checkpoint records --data {saved} relative to the directory its \
                 run was started in, and it does not resolve from here; resume from that \
                 directory, or pass --data with the file's path",
                point.dir.display()
            )));
        }
        return Ok(saved.clone());
    };
    if &given == saved {
        return Ok(given);
    }
    if let (Ok(a), Ok(b)) = (data_files::resolve(&given), &saved_resolved)
        && &a == b
    {
        return Ok(a);
    }
    let state = point.dir.join("state.json");
    let saved_note = match saved_resolved {
        Ok(resolved) if &resolved != saved => format!("{saved} ({resolved})"),
        Ok(_) => saved.clone(),
        Err(_) if Path::new(saved).is_relative() => format!(
            "{saved}, relative to the directory its run started in, which does not resolve from \
             here"
        ),
        Err(_) => format!("{saved}, which no longer exists"),
    };
    Err(input(format!(
        "--data {given} differs from the checkpoint's {saved_note} ({}); drop --data to continue \
         the run on its data, or pass the path of the same file",
        state.display()
    )))
}

/// The data files now against those the checkpoint recorded (none in checkpoints that predate
/// fingerprints): a file that is missing, added, or changed in size or contents is an error that
/// says which and how.
pub fn check_data_unchanged(point: &ResumePoint, now: &[DataFile]) -> Result<()> {
    let saved = &point.extra.data_files;
    if saved.is_empty() {
        return Ok(());
    }
    match data_files::difference(saved, now) {
        None => Ok(()),
        Some(what) => Err(input(format!(
            "--resume {}: the data changed since the checkpoint was saved: {what}; resume with \
             the data the run was trained on, or start a new run",
            point.dir.display()
        ))),
    }
}
