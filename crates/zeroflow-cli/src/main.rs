//! `zeroflow`: data-parallel ZeRO training with CPU optimizer offload, in one binary.

// The flags' doc comments are clap's help text, which writes placeholders as `<out>`.
#![allow(rustdoc::invalid_html_tags)]

mod cmd;
mod error;
mod log;
mod settings;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub use error::InputError;

#[derive(Debug, Parser)]
#[command(name = "zeroflow", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train a model of the GPT-2 or Llama family (default: a tiny GPT on the synthetic corpus,
    /// on the CPU).
    Train(Box<cmd::train::Args>),
    /// The memory plan of a `train` command (the same arguments): GPU and host bytes by kind, the
    /// totals against this machine's, and the knobs that make it fit where it does not.
    Plan(Box<cmd::plan::PlanArgs>),
    /// Tokenize text and chat files (.txt, .jsonl with "text" or "messages") into llm.c token
    /// shards, with a document index and, for chat, a loss mask on the assistant's tokens.
    Tokenize(cmd::tokenize::Args),
    /// The loss and perplexity of a Hugging Face model or a checkpoint over token shards, text or
    /// a .jsonl (chat data: the assistant's tokens, as in training), on the CPU or a GPU.
    Eval(cmd::eval::Args),
    /// Continue a prompt with a Hugging Face model or a checkpoint (GPT-2 or the Llama family) on
    /// the CPU or a GPU.
    Generate(cmd::generate::Args),
    /// Write a checkpoint as a Hugging Face directory of its model's family (GPT-2 or Llama:
    /// config.json, the weights in the run's dtype, the tokenizer files of its --init-from).
    Export(cmd::export::Args),
    /// Start one process per GPU of this host running the zeroflow command after `--` (like
    /// torchrun), each with its rank's environment; stop all when one fails.
    Launch(cmd::launch::Args),
    /// Validate a DeepSpeed JSON config and print its fully resolved values.
    Config(cmd::config::Args),
    /// List the named model sizes with parameter counts and the memory each mode needs.
    Models(cmd::models::Args),
    /// Print versions, devices, libraries, host cores and memory.
    Env(cmd::env::Args),
    /// Measure this machine: CPU AdamW, host-GPU copies, training steps, GEMMs, the GPT model
    /// (cpu-adam, copy, step, gemm, gpt).
    #[command(subcommand)]
    Bench(cmd::bench::Bench),
    /// Repeat the offload + gradient-accumulation race check and report counts and environment.
    Stress(cmd::stress::Args),
    /// A stand-in rank for the tests of `launch` and of the rendezvous (no GPU needed).
    #[command(hide = true)]
    DistCheck(cmd::dist_check::Args),
}

fn main() -> ExitCode {
    log::init();
    cmd::launch::follow_launcher();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Config(args) => cmd::config::run(args),
        Command::Bench(bench) => cmd::bench::run(bench),
        Command::Env(args) => cmd::env::run(args),
        Command::Models(args) => cmd::models::run(args),
        Command::Stress(args) => cmd::stress::run(args),
        Command::Tokenize(args) => cmd::tokenize::run(args),
        Command::Generate(args) => cmd::generate::run(args),
        Command::Eval(args) => cmd::eval::run(args),
        Command::Export(args) => cmd::export::run(args),
        Command::Plan(args) => cmd::plan::run(*args),
        Command::Train(args) => cmd::train::run(*args),
        Command::Launch(args) => cmd::launch::run(args),
        Command::DistCheck(args) => cmd::dist_check::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            if let Some(hint) = error::out_of_memory_hint(&err) {
                eprintln!("hint: {hint}");
            }
            if let Some(exit) = err.downcast_ref::<error::Exit>() {
                ExitCode::from(exit.code)
            } else if err.downcast_ref::<InputError>().is_some()
                || err.downcast_ref::<zeroflow_train::TrainError>().is_some_and(|e| e.is_input())
            {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
