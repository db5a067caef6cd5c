//! `zeroflow train`: train a GPT model through the ZeRO engine.
//!
//! With no arguments it trains the `tiny` model on the built-in synthetic corpus on the CPU and
//! ends by printing the final evaluation loss next to the corpus' entropy floor. Everything the
//! flags and files say is checked before anything is written; a problem with them is an
//! [`crate::InputError`] (exit code 2).

use std::num::NonZeroU64;
use std::path::PathBuf;

use zeroflow_train::dist::DistEnv;
use zeroflow_train::plan::PlanMode;
use zeroflow_train::setup::{AutoValues, TrainOptions};

use crate::InputError;
use crate::cmd::bench_train::ModeFlag;
use crate::settings;
use crate::train;

pub use zeroflow_train::setup::DEFAULT_STEPS;

/// `train --help`'s headings over its own options (the flattened groups carry theirs).
const MODEL_AND_DATA: &str = "Model and data";
const LENGTH_AND_EVALUATION: &str = "Length, evaluation and samples";
const RUN_DIRECTORY: &str = "Run directory and checkpoints";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// DeepSpeed JSON config: batch sizes, optimizer, scheduler, gradient clipping, ZeRO stage,
    /// offload, precision. Its "auto" values are filled from the flags below.
    #[arg(help_heading = MODEL_AND_DATA, long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A named shape (tiny, gpt2-124m, …, gpt-1.3b, llama-1b, llama-3b, llama-8b), a JSON object
    /// such as '{"n_layer":2,"n_head":4,"d_model":128,"vocab_size":64,"context":64}', or a
    /// Hugging Face config.json (a file or its JSON). Default: tiny, with the data's vocabulary.
    #[arg(help_heading = MODEL_AND_DATA, long, value_name = "NAME|JSON|FILE")]
    pub model: Option<String>,
    /// `synthetic` (the built-in corpus with a known entropy floor), a directory or glob of llm.c
    /// `.bin` token shards, a `.jsonl` of conversations or documents (or a directory or glob of
    /// them), or text files. With
    /// --init-from, text and `.jsonl` are tokenized at start-up with the directory's tokenizer;
    /// without it text is read as bytes. Default: synthetic (with --resume: the checkpoint's).
    #[arg(help_heading = MODEL_AND_DATA, long, value_name = "synthetic|PATH")]
    pub data: Option<String>,
    /// Where the model runs (`gpu` is accepted for cuda). Default: cpu (a resume of a run
    /// trained on a GPU asks for --device cuda).
    #[arg(help_heading = MODEL_AND_DATA, long, value_enum)]
    pub device: Option<train::DeviceFlag>,
    /// With --device cuda in one process: the GPU to train on, counted among the GPUs
    /// CUDA_VISIBLE_DEVICES leaves visible. Default: 0 (under a launcher: LOCAL_RANK).
    #[arg(help_heading = MODEL_AND_DATA, long, value_name = "N")]
    pub gpu: Option<usize>,
    /// Optimizer steps in all (or --epochs). Default: 1000 (with --resume: the checkpoint's run's
    /// own total, so a resumed run ends where it was planned to; a different total that would
    /// change the learning-rate schedule needs --extend-schedule).
    #[arg(help_heading = LENGTH_AND_EVALUATION, long, value_name = "N")]
    pub steps: Option<NonZeroU64>,
    /// Train for this many passes over the training data instead of --steps (a fraction will
    /// do, as transformers' num_train_epochs): the steps are its count times the steps of one
    /// epoch, counted once the data is tokenized, and the learning-rate schedule is sized from
    /// them. Files only (the synthetic corpus has no epochs); not with --resume, which continues
    /// to the run's planned total.
    #[arg(help_heading = LENGTH_AND_EVALUATION, long, value_name = "N", conflicts_with_all = ["steps", "resume"])]
    pub epochs: Option<f64>,
    /// With --resume and a --steps other than the checkpoint's total: re-plan the learning-rate
    /// schedule (its "auto" warm-up and total) over the new total, on purpose. The learning rate
    /// of the next step then differs from the one the checkpoint's run planned.
    #[arg(help_heading = LENGTH_AND_EVALUATION, long, requires = "resume")]
    pub extend_schedule: bool,
    /// Evaluate on the held-out set every N optimizer steps (0: only at the end). Default: every
    /// 100 steps, but not sooner after an evaluation that took a second or more than 20 times as
    /// long as it took, so that a large model's evaluations take at most about 5 % of the run (a
    /// given N is kept exactly). With --resume: the run's.
    #[arg(help_heading = LENGTH_AND_EVALUATION, long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Tokens each evaluation reads, whatever the micro-batch. Default: 1,048,576, at most a
    /// tenth of the data, never trained on: whole documents spread over data tokenized at
    /// start-up (`.jsonl` records, small text files), else the end of the last file; 16,384 for
    /// synthetic.
    #[arg(help_heading = LENGTH_AND_EVALUATION, long, value_name = "N")]
    pub eval_tokens: Option<NonZeroU64>,
    /// Evaluate on the start of these files (a file, directory or glob, as --data) instead of a
    /// part held out of --data.
    #[arg(help_heading = LENGTH_AND_EVALUATION, long, value_name = "FILE|DIR|GLOB")]
    pub eval_data: Option<String>,
    /// A Jinja chat template for a `.jsonl` tokenized at start-up, instead of the model's own (one
    /// with `{% generation %}` markers, say). A resumed run's default: its checkpoint's.
    #[arg(help_heading = MODEL_AND_DATA, long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Variables for the chat template of a `.jsonl` tokenized at start-up, a JSON object, as
    /// `apply_chat_template(..., **kwargs)` passes them: `'{"enable_thinking": false}'` trains
    /// Qwen3 without its reasoning block. A resumed run's default: its checkpoint's.
    #[arg(help_heading = MODEL_AND_DATA, long, value_name = "JSON", value_parser = super::template_kwargs)]
    pub chat_template_kwargs: Option<zeroflow_data::TemplateVariables>,
    /// Tokens per training sequence, at most the model's context. Default: GPT-2's context, the
    /// Llama family's 2048.
    #[arg(help_heading = MODEL_AND_DATA, long, value_name = "N")]
    pub seq: Option<NonZeroU64>,
    /// Without a terminal (no progress bar), print a progress line every N steps, and at least
    /// every 30 s (ZEROFLOW_PROGRESS_SECS sets the interval) while a step, an evaluation or a
    /// checkpoint runs long. Default: 50 (with --resume: the run's).
    #[arg(help_heading = LENGTH_AND_EVALUATION, long, value_name = "N")]
    pub log_every: Option<NonZeroU64>,
    /// Directory for metrics.jsonl, loss.svg and summary.json. Default: runs/<UTC time>, made
    /// for this run alone (runs/<UTC time>-2, ... when that name is taken).
    #[arg(help_heading = RUN_DIRECTORY, long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Save a checkpoint into <out>/checkpoints/step-NNNNNNNN every N optimizer steps, and always
    /// at the end or on SIGINT/SIGTERM (0: only then). Default: every 200 steps, but not sooner
    /// after a save that took a second or more than 20 times as long as it took, so that saving a
    /// large model's checkpoint takes at most about 5 % of the run (a given N is kept exactly;
    /// with --resume: the run's). A signal stops the run after its current step (an evaluation
    /// is abandoned), saves, and exits with 130 (SIGINT) or 143 (SIGTERM); another signal a second
    /// or more later exits at once without saving (one within the second is the same request).
    #[arg(help_heading = RUN_DIRECTORY, long, value_name = "N")]
    pub save_every: Option<u64>,
    /// Keep the newest K checkpoints; older ones are deleted once a newer one is complete.
    /// Default: 3 (with --resume: the run's).
    #[arg(help_heading = RUN_DIRECTORY, long, value_name = "K")]
    pub keep: Option<NonZeroU64>,
    /// Continue a run exactly from a checkpoint directory, or from the newest complete checkpoint
    /// under --out (`latest`), in that checkpoint's run directory, with its config, data (from
    /// any directory; a changed file is an error) and seed, to its planned total (or --steps).
    #[arg(help_heading = RUN_DIRECTORY, long, value_name = "DIR|latest")]
    pub resume: Option<String>,
    /// Start from the weights of a Hugging Face directory: its config.json's architectures says
    /// the family (GPT2LMHeadModel, or Llama/Qwen2/Qwen3/Mistral ForCausalLM), e.g. one
    /// `zeroflow export` wrote.
    #[arg(help_heading = MODEL_AND_DATA, long, value_name = "DIR", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    /// At the end of the run, write its final weights as a Hugging Face directory DIR (new or
    /// empty) that `transformers` loads: config.json, the weights in the run's type (bf16 on a
    /// GPU, 2 bytes per parameter; sharded above 5 GB) and the --init-from directory's tokenizer
    /// files (at a signal too where the checkpoint of that step was refused for want of disk
    /// space). A refused checkpoint only warns and the run goes on; without --export the one at
    /// the end (or at a signal) refused ends the run with an error. With --resume: the run's
    /// (unless that directory holds files by then)
    #[arg(help_heading = RUN_DIRECTORY, long, value_name = "DIR")]
    pub export: Option<PathBuf>,
    /// Write into --out even if it is not empty (files of the same names are replaced).
    #[arg(help_heading = RUN_DIRECTORY, long)]
    pub force: bool,
    /// Seed of the initial weights and of the data streams. Default: 0 (with --resume: the
    /// checkpoint's).
    #[arg(help_heading = RUN_DIRECTORY, long, value_name = "N")]
    pub seed: Option<u64>,
    /// Every N optimizer steps and at the end, log a greedy continuation of --sample-prompt by
    /// the current weights (on the CPU) and append it to <out>/samples.jsonl. With --resume: the
    /// run's, with its prompt.
    #[arg(
        help_heading = LENGTH_AND_EVALUATION,
        long,
        value_name = "N",
        requires = "sample_prompt"
    )]
    pub sample_every: Option<u64>,
    /// The text the samples continue (token ids `1,2,3` for a vocabulary under 256); where the
    /// run trains on conversations, a user message in the chat template, the sample ending at
    /// the end of the assistant's turn.
    #[arg(
        help_heading = LENGTH_AND_EVALUATION,
        long,
        value_name = "TEXT",
        requires = "sample_every"
    )]
    pub sample_prompt: Option<String>,
    /// Start even where the memory plan (`zeroflow plan`) does not fit this machine.
    #[arg(help_heading = RUN_DIRECTORY, long)]
    pub no_plan_check: bool,
    /// Sequence packing: each sequence holds several documents with no attention across their
    /// boundaries, positions restarting at each (from the document index, .idx, that `zeroflow
    /// tokenize` writes beside each shard); the rows are cut as without it. On the CPU and CUDA
    /// devices; changes the numbers. `--pack` alone is `=on`. Over ZEROFLOW_PACK and
    /// zeroflow.pack (and a resumed run's checkpoint).
    #[arg(
        long,
        help_heading = MODEL_AND_DATA,
        value_name = "on|off",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "on",
        value_parser = settings::flag(&settings::names::SWITCH)
    )]
    pub pack: Option<bool>,
    /// Read the training rows of files in an order shuffled each epoch from --seed (every row
    /// once an epoch; a resume continues the order), as transformers' Trainer shuffles its
    /// dataset; `off` reads them in file order. `--shuffle` alone is `=on`. Default: on (with
    /// --resume: as the checkpoint's run; the synthetic corpus is never shuffled).
    #[arg(
        long,
        help_heading = MODEL_AND_DATA,
        value_name = "on|off",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "on",
        value_parser = settings::flag(&settings::names::SWITCH)
    )]
    pub shuffle: Option<bool>,
    /// Not a flag of train or plan (`bench step`'s): hidden, so that giving it says where their
    /// mode comes from, where clap would suggest --model.
    #[arg(long, hide = true, value_name = "MODE")]
    pub mode: Option<String>,
    #[command(flatten)]
    pub auto: AutoFlags,
    #[command(flatten)]
    pub gpu_flags: settings::GpuFlags,
    #[command(flatten)]
    pub host_flags: settings::HostFlags,
}

/// Checks everything the flags and files say (with the launcher's and `ZEROFLOW_*` variables),
/// then trains.
pub fn run(args: Args) -> anyhow::Result<()> {
    args.check_mode()?;
    let dist =
        DistEnv::from_lookup(|name| std::env::var(name).ok()).map_err(InputError::from_display)?;
    let env = settings::env::from_process()?;
    let setup = zeroflow_train::Setup::from_options(args.options(), dist, env)?;
    train::run(setup)
}

impl Args {
    /// An error for `--mode`, `bench step`'s flag: train and plan take the mode from the config,
    /// and the error names the example config of that mode for the device asked for.
    pub fn check_mode(&self) -> anyhow::Result<()> {
        let Some(mode) = &self.mode else { return Ok(()) };
        let cpu = !matches!(self.device, Some(train::DeviceFlag::Cuda));
        let config = |kind: &str| match cpu {
            true => format!("--config examples/configs/cpu-zero2{kind}.json"),
            false => format!("--config examples/configs/zero2{kind}-bf16.json"),
        };
        // `bench step`'s own names (and aliases) for its modes.
        let suggestion = match <ModeFlag as clap::ValueEnum>::from_str(mode, false) {
            Ok(ModeFlag::Gpu) => config(""),
            Ok(ModeFlag::Offload) => config("-offload"),
            Ok(ModeFlag::Zenflow) => config("-zenflow"),
            Ok(ModeFlag::OffloadDelayed) => format!(
                "{} with \"zeroflow\": {{\"delayed_update\": {{\"enabled\": true}}}} added",
                config("-offload")
            ),
            Ok(ModeFlag::ZenflowInline) | Err(_) => {
                "a DeepSpeed JSON config in --config (examples/configs has one for each mode)"
                    .to_owned()
            }
        };
        Err(InputError::from_display(format!(
            "--mode {mode}: `train` and `plan` take the mode from the DeepSpeed config \
             (zero_optimization.offload_optimizer and .zenflow), not from --mode (a flag of \
             `bench step`): use {suggestion}"
        )))
    }

    /// The flags as the library's options.
    pub fn options(&self) -> TrainOptions {
        let auto = &self.auto;
        TrainOptions {
            config: self.config.clone(),
            model: self.model.clone(),
            data: self.data.clone(),
            device: self.device.unwrap_or(train::DeviceFlag::Cpu).into(),
            device_given: self.device.is_some(),
            gpu: self.gpu,
            steps: self.steps,
            extend_schedule: self.extend_schedule,
            eval_every: self.eval_every,
            eval_tokens: self.eval_tokens,
            eval_data: self.eval_data.clone(),
            chat_template: self.chat_template.clone(),
            chat_template_kwargs: self.chat_template_kwargs.clone(),
            seq: self.seq,
            log_every: self.log_every,
            out: self.out.clone(),
            save_every: self.save_every,
            keep: self.keep,
            resume: self.resume.clone(),
            init_from: self.init_from.clone(),
            export: self.export.clone(),
            force: self.force,
            seed: self.seed,
            sample: self
                .sample_every
                .zip(self.sample_prompt.clone())
                .map(|(every, prompt)| zeroflow_train::sample::SampleOptions { every, prompt }),
            shuffle: self.shuffle,
            epochs: self.epochs,
            auto: auto.values(),
            settings: settings::Requested {
                pack: self.pack,
                ..settings::from_flags(self.gpu_flags, self.host_flags)
            },
            plan: if self.no_plan_check { PlanMode::NoCheck } else { PlanMode::Check },
        }
    }
}

/// The flags that fill a config's `"auto"` values, the same for `train` and `zeroflow config`
/// (which previews what `train` resolves).
#[derive(Clone, Debug, Default, clap::Args)]
#[command(next_help_heading = "Batch and optimizer")]
pub struct AutoFlags {
    /// Sequences per micro-step (fills an "auto" train_micro_batch_size_per_gpu). Default: 16.
    #[arg(long, value_name = "N")]
    pub micro_batch: Option<NonZeroU64>,
    /// Micro-steps per optimizer step (fills an "auto" gradient_accumulation_steps). Default: 1.
    #[arg(long, value_name = "N")]
    pub accum: Option<NonZeroU64>,
    /// Peak learning rate (fills an "auto" optimizer lr). Default: 3e-3 from scratch, 2e-5 for
    /// a trained model (--init-from).
    #[arg(long, value_name = "LR")]
    pub lr: Option<f64>,
    /// Warm-up steps of the learning rate (fills an "auto" scheduler warmup_num_steps).
    /// Default: 5% of --steps (at least 2).
    #[arg(long, value_name = "N")]
    pub warmup: Option<NonZeroU64>,
    /// AdamW weight decay (fills an "auto" optimizer weight_decay). Default: 0. The 1-D
    /// parameters (norms' weights, biases) take none, as in transformers' Trainer and nanoGPT.
    #[arg(long, value_name = "X")]
    pub weight_decay: Option<f64>,
}

impl AutoFlags {
    pub fn values(&self) -> AutoValues {
        AutoValues {
            micro_batch: self.micro_batch,
            accum: self.accum,
            lr: self.lr,
            warmup: self.warmup,
            weight_decay: self.weight_decay,
        }
    }
}

#[cfg(test)]
mod gpu_flag_tests {
    use clap::Parser;
    use zeroflow_train::setup::job;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    /// `--gpu N` is the GPU a one-process run opens (the ordinal `CudaDevice::new` gets, among
    /// the GPUs CUDA_VISIBLE_DEVICES leaves), instead of GPU 0.
    #[test]
    fn gpu_is_the_ordinal_of_a_one_process_run() {
        let parse = |argv: &[&str]| Cli::try_parse_from(argv).expect("valid flags").args.options();
        let one = DistEnv::single;
        let dist = job(&parse(&["train", "--device", "cuda", "--gpu", "3"]), one()).expect("one");
        assert_eq!((dist.world_size, dist.local_rank), (1, 3));
        let dist = job(&parse(&["train", "--device", "cuda"]), one()).expect("one process");
        assert_eq!(dist.local_rank, 0);
    }
}
