//! `zeroflow generate`: what a model (a Hugging Face directory or a zeroflow checkpoint) writes
//! after a prompt or a file of prompts, on the CPU or a GPU (`zeroflow_train::infer`).

use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use zeroflow_train::infer::{
    Completion, InferDevice, ModelDir, Prompt, Sampling, parse_ids, read_prompts, reply_stops,
};

use crate::InputError;

/// Continue a prompt with a model (GPT-2 or the Llama family). To a terminal, one prompt's
/// completion (and each reply of a conversation) is shown as it is written.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A Hugging Face directory, a checkpoint (`state.json`) or a run directory (its newest).
    model: PathBuf,
    /// The prompt as token ids (`1,2,3`). One of --prompt, --prompt-tokens and --prompts is
    /// needed, but with --chat, which without them is a conversation read from the terminal.
    #[arg(long, value_name = "IDS", conflicts_with_all = ["prompt", "prompts"])]
    prompt_tokens: Option<String>,
    /// A file of prompts generated as one batch: a prompt per line (text, encoded by the
    /// tokenizer; ids where there is none), or `.jsonl` lines with "prompt", "prompt_tokens" or,
    /// with --chat, "messages" (a conversation so far); one output line each.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    prompts: Option<PathBuf>,
    /// `cpu` (f32), `cuda` or `cuda:N` (bf16 on that GPU).
    #[arg(long, default_value = "cpu")]
    device: InferDevice,
    /// The prompt as text, encoded by the tokenizer (--tokenizer, or MODEL's own).
    #[arg(long)]
    prompt: Option<String>,
    /// `gpt2`, `bytes`, a `tokenizer.json` or a model directory: encodes --prompt, decodes the
    /// output. Default: MODEL's own tokenizer.json where MODEL is a directory that has one, the
    /// tokenizer its run trained with where MODEL is a checkpoint or run directory (its
    /// --init-from directory's).
    #[arg(long)]
    tokenizer: Option<String>,
    /// A chat model: each text prompt becomes one user message, rendered by the tokenizer's chat
    /// template with the assistant's turn opened (as transformers' `apply_chat_template(...,
    /// add_generation_prompt=True)`), and the completion also ends at the tokenizer's
    /// `eos_token` (the end of a turn). A checkpoint or run directory's prompts are rendered by
    /// the template its run trained with (its --chat-template, where it gave one). Without
    /// --prompt or --prompts, a conversation: each line read is the user's next message, each
    /// reply printed and kept, until the end of the input (Ctrl-D). At a terminal, Ctrl-C stops a
    /// reply (the conversation keeps what it wrote) and, at the prompt, ends the program.
    #[arg(long, conflicts_with = "prompt_tokens")]
    chat: bool,
    /// A system message before the user's (with --chat: for --prompt, and a conversation's
    /// first; a --prompts file's conversations hold their own).
    #[arg(long, value_name = "TEXT", requires = "chat", conflicts_with = "prompts")]
    system: Option<String>,
    /// Variables for the chat template, a JSON object, as `apply_chat_template(..., **kwargs)`
    /// passes them: `'{"enable_thinking": false}'` opens Qwen3's turn without its reasoning.
    /// Default: none (for a checkpoint or run directory: its run's).
    #[arg(long, value_name = "JSON", requires = "chat", value_parser = super::template_kwargs)]
    chat_template_kwargs: Option<zeroflow_data::TemplateVariables>,
    /// The most tokens a completion (a reply) adds.
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_new_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    #[arg(long, value_name = "P")]
    top_p: Option<f64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Go on past the model's end-of-text token.
    #[arg(long)]
    no_stop: bool,
    /// Print `{"tokens": [the new ids], "text": the new text or null}` (with "index", from 0, per
    /// prompt of --prompts).
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // MODEL first: its tokenizer is looked for in it.
    let source = ModelDir::find(&args.model)?;
    let text = source.defaults()?;
    let tokenizer = super::model_tokenizer(args.tokenizer.as_deref(), &text, &args.model)?;
    let conversation = args.chat && args.prompts.is_none() && args.prompt.is_none();
    let prompts =
        if conversation { Vec::new() } else { given_prompts(&args, tokenizer.is_some())? };
    let chat = match (args.chat, &tokenizer) {
        (false, _) => None,
        (true, None) => {
            return Err(InputError::from_display(format!(
                "--chat renders prompts with the tokenizer's chat template, and {} has no \
                 tokenizer.json: give --tokenizer a model directory with one",
                args.model.display()
            )));
        }
        (true, Some(tokenizer)) => Some((tokenizer, chat_template(&args, tokenizer, &text)?)),
    };
    let prompts = prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let tokens = match &chat {
                Some((tokenizer, template)) => prompt.chat_tokens(tokenizer, template),
                None => prompt.tokens(tokenizer.as_ref()),
            };
            let what = if args.prompts.is_some() {
                format!("prompt {}", i + 1)
            } else {
                "the prompt".into()
            };
            tokens.map_err(|e| InputError(format!("{what}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut model = source.open_for(args.device)?;
    if let Some((tokenizer, template)) = &chat {
        reply_stops(tokenizer, Some(template)).into_iter().for_each(|t| model.also_stop_at(t));
    }
    let sampling = Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p };
    let completion = Completion {
        max_new_tokens: args.max_new_tokens,
        sampling,
        seed: args.seed,
        stop: !args.no_stop,
    };
    if let (true, Some((tokenizer, template))) = (conversation, &chat) {
        return converse(&args, &model, tokenizer, template, &completion);
    }
    // One prompt to a terminal: shown as it is written.
    let shown = !args.json && prompts.len() == 1 && std::io::stdout().is_terminal();
    if let (true, Some(tokenizer)) = (shown, &tokenizer) {
        let mut session = model.session(args.device)?;
        let mut streamed = Streamed::new(tokenizer, &[]);
        let tokens = session.complete_with(&prompts[0], &completion, |t| {
            streamed.token(t);
            ControlFlow::Continue(())
        })?;
        return streamed.finish(&tokenizer.decode(&tokens).map_err(InputError)?);
    }
    let generated = model.complete_batch_on(&prompts, &completion, args.device)?;
    print_generated(&args, tokenizer.as_ref(), &generated)
}

/// The prompts `--prompts`, `--prompt-tokens` or `--prompt` give (text needs the model's
/// tokenizer, `has_tokenizer`; with `--system`, a conversation of that and the prompt).
fn given_prompts(args: &Args, has_tokenizer: bool) -> anyhow::Result<Vec<Prompt>> {
    Ok(match (&args.prompts, &args.prompt_tokens, &args.prompt) {
        (Some(file), ..) => read_prompts(file)?,
        (None, Some(ids), _) => {
            let ids = parse_ids(ids).map_err(|e| InputError(format!("--prompt-tokens {e}")))?;
            vec![Prompt::Tokens(ids)]
        }
        (None, None, Some(text)) => {
            if !has_tokenizer {
                return Err(InputError::from_display(format!(
                    "--prompt is text and {} has no tokenizer.json: give --tokenizer (gpt2, \
                     bytes, a tokenizer.json or a model directory), or the prompt as \
                     --prompt-tokens",
                    args.model.display()
                )));
            }
            match &args.system {
                Some(system) => {
                    vec![Prompt::Messages(vec![message("system", system), message("user", text)])]
                }
                None => vec![Prompt::Text(text.clone())],
            }
        }
        (None, None, None) => {
            return Err(InputError::from_display(
                "give the prompt: --prompt TEXT, --prompt-tokens IDS or --prompts FILE (or --chat \
                 alone for a conversation)",
            ));
        }
    })
}

/// `--chat`'s template: the tokenizer's (`tokenizer_config.json`'s `chat_template` or
/// `chat_template.jinja`), rendered with `--chat-template-kwargs` or the model's defaults.
fn chat_template(
    args: &Args,
    tokenizer: &zeroflow_data::Tokenizer,
    text: &zeroflow_train::infer::ModelDefaults,
) -> anyhow::Result<zeroflow_data::ChatTemplate> {
    let options = super::chat_options(None, args.chat_template_kwargs.clone(), text);
    let template = options.template(tokenizer).map_err(InputError::from_display)?;
    template.ok_or_else(|| {
        InputError::from_display(format!(
            "--chat: the tokenizer {} has no chat template (tokenizer_config.json's \
             chat_template or chat_template.jinja)",
            tokenizer.name()
        ))
    })
}

/// Prints each prompt's new tokens: their text (the ids where there is no tokenizer), or with
/// `--json` a line of the ids and the text (and the prompt's index, with `--prompts`).
fn print_generated(
    args: &Args,
    tokenizer: Option<&zeroflow_data::Tokenizer>,
    generated: &[Vec<u32>],
) -> anyhow::Result<()> {
    for (index, tokens) in generated.iter().enumerate() {
        let text = tokenizer.map(|t| t.decode(tokens)).transpose().map_err(InputError)?;
        if args.json {
            let mut line = serde_json::json!({ "tokens": tokens, "text": text });
            if args.prompts.is_some() {
                line["index"] = index.into();
            }
            println!("{line}");
        } else {
            let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
            println!("{}", text.unwrap_or_else(|| ids.join(",")));
        }
    }
    Ok(())
}

/// `generate --chat` without a prompt: a conversation with `model`. Each line of standard input
/// (blank ones skipped) is the user's next message; the whole conversation so far is rendered by
/// `template` and continued (only the tokens after what the session's key/value cache holds of
/// the earlier turns run: [`zeroflow_train::infer::Session`]), the reply printed (to a
/// terminal, as it is written; `--json`: `{"turn", "tokens", "text"}`) and kept as the
/// assistant's message, without the token that ended it; past the model's context, without its
/// oldest exchanges ([`fit_conversation`]). The end of the input ends it; so does a message that
/// alone does not fit, but at a terminal, where it is said and left out. At a terminal Ctrl-C
/// stops a reply ([`CtrlC`]).
fn converse(
    args: &Args,
    model: &zeroflow_train::infer::HostModel,
    tokenizer: &zeroflow_data::Tokenizer,
    template: &zeroflow_data::ChatTemplate,
    completion: &Completion,
) -> anyhow::Result<()> {
    use std::io::{BufRead, Write};
    let (terminal, shown) = (std::io::stdin().is_terminal(), std::io::stdout().is_terminal());
    let ctrl_c = terminal.then(CtrlC::catch).transpose()?;
    if terminal {
        eprintln!(
            "a conversation with {}: type a message; Ctrl-C stops a reply, Ctrl-D ends",
            args.model.display()
        );
    }
    // One decoder for the conversation: on a GPU the weights are uploaded once, not each turn.
    let mut session = model.session(args.device)?;
    // A system message stays at the start, however long the conversation grows.
    let mut messages: Vec<serde_json::Value> =
        args.system.iter().map(|s| message("system", s)).collect();
    let kept = messages.len();
    let mut lines = std::io::stdin().lock().lines();
    let mut turn = 0u64;
    loop {
        if terminal {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| InputError(format!("standard input: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        messages.push(message("user", &line));
        let render = |messages: &[serde_json::Value]| {
            Prompt::Messages(messages.to_vec()).chat_tokens(tokenizer, template)
        };
        let (context, room) = (model.context(), completion.max_new_tokens);
        let (tokens, dropped) = match fit_conversation(&mut messages, kept, (context, room), render)
        {
            Ok(fitted) => fitted,
            // At a terminal the conversation goes on without the message; piped, it ends.
            Err(e) if terminal => {
                eprintln!("error: {e}");
                messages.pop();
                continue;
            }
            Err(e) => return Err(e),
        };
        if dropped > 0 {
            tracing::warn!(
                "the conversation's oldest {} left out: with the reply's --max-new-tokens {room} \
                 it must fit the model's context of {context} tokens",
                zeroflow_data::count(dropped as u64, "exchange"),
            );
        }
        // Each turn its own draw where sampling.
        let turn_completion =
            Completion { seed: completion.seed.wrapping_add(turn), ..*completion };
        // At a terminal the reply is shown as it is written.
        let mut streamed =
            (!args.json && shown).then(|| Streamed::new(tokenizer, model.end_of_text()));
        let stopped = || ctrl_c.as_ref().is_some_and(CtrlC::pressed);
        ctrl_c.iter().for_each(|c| c.replying(true));
        let reply = session.complete_with(&tokens, &turn_completion, |token| {
            streamed.iter_mut().for_each(|s| s.token(token));
            if stopped() { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
        });
        ctrl_c.iter().for_each(|c| c.replying(false));
        let reply = reply?;
        tracing::debug!(
            "turn {turn}: {} of the conversation's {} tokens run, the rest held from earlier turns",
            session.last_ran(),
            tokens.len()
        );
        let ended = reply.last().is_some_and(|t| model.end_of_text().contains(t));
        let said = &reply[..reply.len() - usize::from(ended)];
        let text = tokenizer.decode(said).map_err(InputError)?;
        match streamed {
            Some(mut streamed) => streamed.finish(&text)?,
            None if args.json => {
                println!("{}", serde_json::json!({"turn": turn, "tokens": reply, "text": text}));
            }
            None => println!("{text}"),
        }
        if stopped() {
            eprintln!(
                "(reply stopped: the conversation goes on with what it wrote; Ctrl-C at the prompt \
                 or Ctrl-D ends it)"
            );
        }
        messages.push(serde_json::json!({"role": "assistant", "content": text}));
        turn += 1;
    }
    Ok(())
}

/// Ctrl-C in a conversation at a terminal: during a reply it stops the reply, which the
/// conversation keeps as far as it was written; at the prompt it ends the program, as by default.
struct CtrlC {
    /// Whether SIGINT takes its default action (between replies).
    at_prompt: Arc<AtomicBool>,
    /// Whether SIGINT came during the reply (cleared as each starts).
    pressed: Arc<AtomicBool>,
}

impl CtrlC {
    fn catch() -> anyhow::Result<CtrlC> {
        use signal_hook::{consts::SIGINT, flag};
        let (at_prompt, pressed) =
            (Arc::new(AtomicBool::new(true)), Arc::new(AtomicBool::new(false)));
        flag::register_conditional_default(SIGINT, Arc::clone(&at_prompt))?;
        flag::register(SIGINT, Arc::clone(&pressed))?;
        Ok(CtrlC { at_prompt, pressed })
    }

    /// A reply starts (Ctrl-C stops it) or ends (Ctrl-C ends the program).
    fn replying(&self, replying: bool) {
        if replying {
            self.pressed.store(false, Ordering::SeqCst);
        }
        self.at_prompt.store(!replying, Ordering::SeqCst);
    }

    /// Whether Ctrl-C stopped the reply.
    fn pressed(&self) -> bool {
        self.pressed.load(Ordering::SeqCst)
    }
}

/// Token ids to text (a tokenizer's decode).
type Decode<'a> = Box<dyn Fn(&[u32]) -> Result<String, String> + 'a>;

/// A completion shown at a terminal as it is written: after each token, the text of the tokens
/// so far (but `hidden` ones, the tokens that end a reply) as far as it is known for good, not
/// a character whose bytes are still to come (a trailing U+FFFD); the rest at the end.
struct Streamed<'a, W: std::io::Write = std::io::Stdout> {
    decode: Decode<'a>,
    hidden: &'a [u32],
    tokens: Vec<u32>,
    /// The text printed so far.
    printed: String,
    out: W,
}

impl<'a> Streamed<'a> {
    fn new(tokenizer: &'a zeroflow_data::Tokenizer, hidden: &'a [u32]) -> Self {
        Streamed::to(std::io::stdout(), Box::new(|ids| tokenizer.decode(ids)), hidden)
    }
}

impl<'a, W: std::io::Write> Streamed<'a, W> {
    fn to(out: W, decode: Decode<'a>, hidden: &'a [u32]) -> Self {
        Streamed { decode, hidden, tokens: Vec::new(), printed: String::new(), out }
    }

    /// Prints what `token` adds (a failure to decode or to print shows nothing more, and the end
    /// prints the rest).
    fn token(&mut self, token: u32) {
        if self.hidden.contains(&token) {
            return;
        }
        self.tokens.push(token);
        let Ok(text) = (self.decode)(&self.tokens) else { return };
        let known = text.trim_end_matches(char::REPLACEMENT_CHARACTER);
        let Some(new) = known.strip_prefix(self.printed.as_str()) else { return };
        if !new.is_empty() && write!(self.out, "{new}").and_then(|()| self.out.flush()).is_ok() {
            self.printed.push_str(new);
        }
    }

    /// Ends the completion whose text is `text`: prints what of it is not yet printed (from
    /// where the printed text and it part, where a decoder did not keep its earlier text) and
    /// a newline.
    fn finish(&mut self, text: &str) -> anyhow::Result<()> {
        let shared = text
            .char_indices()
            .zip(self.printed.chars())
            .find(|((_, a), b)| a != b)
            .map_or(text.len().min(self.printed.len()), |((at, _), _)| at);
        writeln!(self.out, "{}", &text[shared..])?;
        Ok(self.out.flush()?)
    }
}

/// `{"role": role, "content": text}`.
fn message(role: &str, text: &str) -> serde_json::Value {
    serde_json::json!({"role": role, "content": text})
}

/// The conversation `messages` (`kept` messages that stay, a system message, then a user's
/// message, the reply, ..., a user's message) rendered by `render`, its oldest exchanges (a
/// user's message and the reply to it) left out of it until it and `room` more tokens fit
/// `context`, as chat front ends drop the start of a long conversation; and how many were left
/// out. An input error, the conversation left as it was, where the last message alone (with
/// those kept) does not fit.
fn fit_conversation(
    messages: &mut Vec<serde_json::Value>,
    kept: usize,
    (context, room): (usize, usize),
    render: impl Fn(&[serde_json::Value]) -> Result<Vec<u32>, String>,
) -> anyhow::Result<(Vec<u32>, usize)> {
    let alone: Vec<_> = messages[..kept].iter().chain(messages.last()).cloned().collect();
    let least = render(&alone).map_err(InputError)?.len();
    if least + room > context {
        return Err(InputError::from_display(format!(
            "the message is {least} tokens, and with --max-new-tokens {room} more than the \
             model's context of {context}: write a shorter one, or give a smaller \
             --max-new-tokens"
        )));
    }
    let mut dropped = 0;
    loop {
        let tokens = render(messages).map_err(InputError)?;
        // With every earlier exchange left out, the message alone: it fits.
        if tokens.len() + room <= context || messages.len() <= kept + 1 {
            return Ok((tokens, dropped));
        }
        messages.drain(kept..kept + 2);
        dropped += 1;
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::{Streamed, fit_conversation};

    /// A render of 10 tokens a message.
    fn ten_each(messages: &[Value]) -> Result<Vec<u32>, String> {
        Ok(vec![0; 10 * messages.len()])
    }

    fn conversation(messages: usize) -> Vec<Value> {
        let role = |i: usize| if i.is_multiple_of(2) { "user" } else { "assistant" };
        (0..messages).map(|i| json!({"role": role(i), "content": i.to_string()})).collect()
    }

    #[test]
    fn the_oldest_exchanges_are_left_out_until_the_conversation_fits() {
        let mut messages = conversation(7);
        let (tokens, dropped) = fit_conversation(&mut messages, 0, (100, 30), ten_each).unwrap();
        assert_eq!((tokens.len(), dropped), (70, 0), "fits as it is");
        let (tokens, dropped) = fit_conversation(&mut messages, 0, (60, 15), ten_each).unwrap();
        assert_eq!((tokens.len(), dropped), (30, 2), "70 + 15 > 60, 50 + 15 > 60, 30 + 15 fits");
        let contents: Vec<&str> = messages.iter().map(|m| m["content"].as_str().unwrap()).collect();
        assert_eq!(contents, ["4", "5", "6"], "the newest exchange and the message kept");
        assert_eq!(messages[0]["role"], "user", "it starts with a user's message");
        // A system message first stays.
        let mut messages = [vec![super::message("system", "be brief")], conversation(5)].concat();
        let (tokens, dropped) = fit_conversation(&mut messages, 1, (45, 15), ten_each).unwrap();
        assert_eq!((tokens.len(), dropped), (20, 2), "60, 40, then 20 with 15 more in 45");
        let contents: Vec<&str> = messages.iter().map(|m| m["content"].as_str().unwrap()).collect();
        assert_eq!(contents, ["be brief", "4"]);
    }

    #[test]
    fn a_message_that_alone_does_not_fit_is_an_error_naming_the_knobs() {
        let mut messages = conversation(3);
        let fitted = fit_conversation(&mut messages, 0, (15, 10), ten_each);
        let error = fitted.unwrap_err().to_string();
        assert!(error.contains("the message is 10 tokens"), "{error}");
        assert!(
            error.contains("--max-new-tokens 10") && error.contains("context of 15"),
            "{error}"
        );
        assert_eq!(messages.len(), 3, "the conversation as it was");
    }

    /// Ids as bytes, decoded as UTF-8 with U+FFFD for what is not (yet) a character.
    fn bytes(ids: &[u32]) -> Result<String, String> {
        let bytes: Vec<u8> = ids.iter().map(|&t| t as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    #[test]
    fn a_streamed_completion_shows_whole_characters_as_they_come_and_the_rest_at_the_end() {
        let mut out = Vec::new();
        let mut streamed = Streamed::to(&mut out, Box::new(bytes), &[300]);
        let mut shown = Vec::new();
        // "né!", its é in two tokens, then a hidden token that ends the reply.
        for token in [u32::from(b'n'), 0xC3, 0xA9, u32::from(b'!'), 300] {
            streamed.token(token);
            shown.push(String::from_utf8(streamed.out.to_vec()).unwrap());
        }
        assert_eq!(shown, ["n", "n", "né", "né!", "né!"]);
        streamed.finish("né!").unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "né!\n");
    }

    #[test]
    fn a_streamed_completion_ends_with_the_final_text_from_where_it_parts_from_the_shown() {
        // A decoder that rewrites earlier text ("a " then "ab"): nothing more is shown until the
        // end, which prints the final text from where it differs.
        let rewrites =
            |ids: &[u32]| Ok(if ids.len() < 2 { "a ".to_owned() } else { "ab".to_owned() });
        let mut out = Vec::new();
        let mut streamed = Streamed::to(&mut out, Box::new(rewrites), &[]);
        streamed.token(1);
        streamed.token(2);
        assert_eq!(streamed.out.as_slice(), b"a ");
        streamed.finish("ab").unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "a b\n");
        // Nothing shown (the text not yet a character): the final text whole.
        let mut out = Vec::new();
        let mut streamed = Streamed::to(&mut out, Box::new(bytes), &[]);
        streamed.token(0xE2);
        streamed.finish("\u{FFFD}").unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "\u{FFFD}\n");
    }
}
