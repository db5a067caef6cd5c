//! Chat templates: a model's Jinja `chat_template` rendered with `minijinja` the way transformers'
//! `apply_chat_template` renders it (`trim_blocks`, `lstrip_blocks`, Python's string methods,
//! `raise_exception`, `strftime_now` (Llama-3.2's date; in UTC), a Python-style `tojson`,
//! `True`/`False`/`None` printed as Python prints them, the variables `messages`,
//! `add_generation_prompt` and the special tokens, and the `**kwargs` given
//! ([`ChatTemplate::with_variables`])), and the loss mask that covers only the assistant's tokens.
//!
//! The assistant's text is found in one of two ways:
//! - templates with `{% generation %}…{% endgeneration %}` (transformers' marker for
//!   `return_assistant_tokens_mask`): minijinja has no such tag, so the tags are rewritten to raw
//!   blocks that print two private-use characters, which are then cut out of the rendered text
//!   with the byte ranges they enclosed;
//! - other templates, by rendering prefixes: for the assistant message `i`, the text it adds is
//!   what `messages[..=i]` renders beyond `messages[..i]` with the generation prompt, less trailing
//!   whitespace (generation stops at the end-of-turn token; the newline after it is not trained).
//!   A template that renders a turn differently once later messages follow (Qwen3's drops the
//!   reasoning of turns before the last question) makes one document per assistant turn: the
//!   conversation through that turn, trained on that turn alone — the text the model reads and
//!   writes when it is asked for that turn.
//!
//! A span becomes tokens as in transformers: from the token holding its first byte through the
//! token holding its last.

use std::ops::Range;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error as JinjaError, ErrorKind as JinjaErrorKind};
use serde_json::Value as Json;
use thiserror::Error;

use crate::tokenizer::{Tokenizer, TokenizerConfig};

const GENERATION_START: char = '\u{E000}';
const GENERATION_END: char = '\u{E001}';
const TEMPLATE_NAME: &str = "chat_template";

/// A chat template error, naming the template's file.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{}: {message}", path.display())]
pub struct ChatTemplateError {
    pub path: PathBuf,
    pub message: String,
}

/// A conversation that could not be rendered or tokenized.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ConversationError {
    /// The template failed (including its own `raise_exception`).
    #[error("chat template: {0}")]
    Render(String),
    /// The `messages` are not a list of objects with a string `role`.
    #[error("{0}")]
    Messages(String),
    /// Without generation markers, the conversation before assistant message `index` with the
    /// generation prompt does not render as a prefix of the conversation through it, so the
    /// assistant's tokens cannot be found.
    #[error(
        "the chat template does not render the conversation before message {index} (with the \
         generation prompt) as the start of the conversation through it, so the assistant's \
         tokens cannot be found by rendering prefixes (Mistral's template, for one, writes a \
         system prompt only before a user message that ends the conversation: put it in the \
         first user message); use a template with {{% generation %}} markers (--chat-template)"
    )]
    NotPrefixStable { index: usize },
    /// The tokenizer failed on the rendered text.
    #[error("tokenizer: {0}")]
    Tokenize(String),
    /// The content contains the characters that stand for the generation markers.
    #[error("the conversation contains U+E000 or U+E001, which mark the assistant's text")]
    MarkerInContent,
}

/// A conversation as it is trained: one document (its text and the byte ranges of the assistant's
/// text in it), or, where its template renders a turn differently once later messages follow, one
/// per assistant turn ([`Conversation::turn_by_turn`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conversation<T> {
    pub documents: Vec<T>,
    pub turn_by_turn: bool,
}

impl<T> Conversation<T> {
    /// A conversation trained as the one document `document`.
    pub fn whole(document: T) -> Conversation<T> {
        Conversation { documents: vec![document], turn_by_turn: false }
    }
}

/// A rendered document: its text and the byte ranges of the assistant's text in it.
pub type Rendered = (String, Vec<Range<usize>>);

/// An encoded document: its token ids and loss mask (1 on the assistant's tokens).
pub type Encoded = (Vec<u32>, Vec<u8>);

/// Variables for the chat template (`--chat-template-kwargs`).
pub type TemplateVariables = serde_json::Map<String, serde_json::Value>;

/// How conversations are rendered: the tokenizer's chat template or `--chat-template`'s file,
/// with `--chat-template-kwargs`' variables.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatOptions {
    pub template: Option<PathBuf>,
    pub variables: TemplateVariables,
}

impl ChatOptions {
    /// The template for `tokenizer`'s conversations (none where it has none and no file is
    /// given), with the variables; variables for a tokenizer without a template are an error.
    pub fn template(&self, tokenizer: &Tokenizer) -> Result<Option<ChatTemplate>, String> {
        let template = match &self.template {
            Some(path) => Some(ChatTemplate::from_file(path)),
            None => ChatTemplate::from_config(tokenizer.config()),
        };
        match template {
            Some(template) => template
                .and_then(|t| t.with_variables(self.variables.clone()))
                .map(Some)
                .map_err(|e| e.to_string()),
            None if !self.variables.is_empty() => Err(format!(
                "--chat-template-kwargs: the tokenizer {} has no chat template (give \
                 --chat-template)",
                tokenizer.name()
            )),
            None => Ok(None),
        }
    }
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    path: PathBuf,
    has_generation_markers: bool,
    variables: TemplateVariables,
}

/// The variables the renderer sets itself, which [`ChatTemplate::with_variables`] may not.
const RENDERER_VARIABLES: [&str; 6] =
    ["messages", "add_generation_prompt", "bos_token", "eos_token", "unk_token", "pad_token"];

impl ChatTemplate {
    /// Compiles `source`; `path` names where it came from in errors.
    pub fn new(source: &str, path: impl Into<PathBuf>) -> Result<ChatTemplate, ChatTemplateError> {
        let path = path.into();
        let (rewritten, has_generation_markers) = rewrite_generation_tags(source);
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .expect("the default delimiters are valid"),
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", python_tojson);
        env.set_formatter(python_formatter);
        env.add_template_owned(TEMPLATE_NAME, rewritten)
            .map_err(|e| ChatTemplateError { path: path.clone(), message: describe(&e) })?;
        Ok(ChatTemplate { env, path, has_generation_markers, variables: Default::default() })
    }

    /// The template with more variables for it, as `apply_chat_template(..., **kwargs)` passes
    /// them (Qwen3's `enable_thinking`, Llama-3's `date_string`); a name the renderer sets itself
    /// (`messages`, `add_generation_prompt`, the special tokens) is an error.
    pub fn with_variables(
        mut self,
        variables: TemplateVariables,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        if let Some(name) = variables.keys().find(|k| RENDERER_VARIABLES.contains(&k.as_str())) {
            let message = format!("the variable {name:?} is set by the renderer, not by kwargs");
            return Err(ChatTemplateError { path: self.path, message });
        }
        self.variables = variables;
        Ok(self)
    }

    /// Reads and compiles a template file.
    pub fn from_file(path: &Path) -> Result<ChatTemplate, ChatTemplateError> {
        let source = std::fs::read_to_string(path)
            .map_err(|e| ChatTemplateError { path: path.into(), message: e.to_string() })?;
        ChatTemplate::new(&source, path)
    }

    /// The tokenizer's own template (from `tokenizer_config.json` or `chat_template.jinja`).
    pub fn from_config(
        config: &TokenizerConfig,
    ) -> Option<Result<ChatTemplate, ChatTemplateError>> {
        let (source, path) = config.chat_template.as_ref()?;
        Some(ChatTemplate::new(source, path))
    }

    /// Where the template came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the template marks the assistant's text with `{% generation %}`.
    pub fn has_generation_markers(&self) -> bool {
        self.has_generation_markers
    }

    /// The text of `messages` (markers cut out) and the byte ranges the markers enclosed.
    fn render_marked(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
        config: &TokenizerConfig,
    ) -> Result<(String, Vec<Range<usize>>), ConversationError> {
        let context = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => config.bos_token.as_deref().unwrap_or(""),
            eos_token => config.eos_token.as_deref().unwrap_or(""),
            unk_token => config.unk_token.as_deref(),
            pad_token => config.pad_token.as_deref(),
            ..Value::from(minijinja::value::Serde(&self.variables))
        };
        let template = self.env.get_template(TEMPLATE_NAME).expect("added in new");
        let rendered =
            template.render(context).map_err(|e| ConversationError::Render(describe(&e)))?;
        cut_markers(&rendered)
    }

    /// The text of a conversation as `apply_chat_template(messages, tokenize=False)` renders it.
    pub fn render(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
        config: &TokenizerConfig,
    ) -> Result<String, ConversationError> {
        Ok(self.render_marked(messages, add_generation_prompt, config)?.0)
    }

    /// The text of a conversation and the byte ranges of the assistant's text in it: the
    /// generation markers' ranges, or, without markers, the ranges found by rendering prefixes —
    /// one document, or one per assistant turn where the template renders a turn differently
    /// once later messages follow. A turn that its own conversation so far does not render as a
    /// prefix of is an error.
    pub fn assistant_spans(
        &self,
        messages: &[Json],
        config: &TokenizerConfig,
    ) -> Result<Conversation<Rendered>, ConversationError> {
        self.assistant_spans_from(messages, 0, config)
    }

    /// [`ChatTemplate::assistant_spans`] of the assistant messages from `messages[from]` on:
    /// those before are context (a prompt's few-shot answers), not trained. With generation
    /// markers, the template must mark one span per assistant message.
    pub fn assistant_spans_from(
        &self,
        messages: &[Json],
        from: usize,
        config: &TokenizerConfig,
    ) -> Result<Conversation<Rendered>, ConversationError> {
        check_messages(messages)?;
        if messages.iter().any(|m| m.to_string().contains([GENERATION_START, GENERATION_END])) {
            return Err(ConversationError::MarkerInContent);
        }
        let assistant = |m: &&Json| m["role"] == "assistant";
        let (text, mut spans) = self.render_marked(messages, false, config)?;
        if self.has_generation_markers {
            let before = messages[..from.min(messages.len())].iter().filter(assistant).count();
            let all = messages.iter().filter(assistant).count();
            if before > 0 && spans.len() != all {
                return Err(ConversationError::Messages(format!(
                    "the chat template marks {} spans for {all} assistant messages, so which are \
                     the completion's cannot be told",
                    spans.len()
                )));
            }
            spans.drain(..before.min(spans.len()));
            return Ok(Conversation::whole((text, spans)));
        }
        // Each assistant turn: the conversation through it, and the turn's range in that text.
        let mut turns = Vec::new();
        for (index, message) in messages.iter().enumerate().skip(from) {
            if message["role"] != "assistant" {
                continue;
            }
            let before = self.render(&messages[..index], true, config)?;
            let through = self.render(&messages[..=index], false, config)?;
            if !through.starts_with(&before) {
                return Err(ConversationError::NotPrefixStable { index });
            }
            let end = through.trim_end().len().max(before.len());
            turns.push((through, before.len()..end));
        }
        if turns.iter().all(|(through, _)| text.starts_with(through)) {
            let spans = turns.into_iter().map(|(_, span)| span).collect();
            return Ok(Conversation::whole((text, spans)));
        }
        let documents = turns.into_iter().map(|(through, span)| (through, vec![span])).collect();
        Ok(Conversation { documents, turn_by_turn: true })
    }

    /// The token ids of a conversation's documents ([`ChatTemplate::assistant_spans`]) and their
    /// loss masks (1 on the assistant's tokens).
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Json],
    ) -> Result<Conversation<Encoded>, ConversationError> {
        self.encode_from(tokenizer, messages, 0)
    }

    /// [`ChatTemplate::encode`] trained on the assistant messages from `messages[from]` on
    /// ([`ChatTemplate::assistant_spans_from`]).
    pub fn encode_from(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Json],
        from: usize,
    ) -> Result<Conversation<Encoded>, ConversationError> {
        let rendered = self.assistant_spans_from(messages, from, tokenizer.config())?;
        let mut documents = Vec::with_capacity(rendered.documents.len());
        for (text, spans) in rendered.documents {
            let tokens =
                tokenizer.encode_with_offsets(&text).map_err(ConversationError::Tokenize)?;
            let mut mask = vec![0u8; tokens.ids.len()];
            for span in spans.iter().filter(|s| !s.is_empty()) {
                // As transformers: a span whose first byte no token holds ends the marking.
                let Some(first) = tokens.token_at(span.start) else { break };
                let last = tokens.token_at(span.end - 1).unwrap_or(mask.len() - 1);
                mask[first..=last.max(first)].fill(1);
            }
            documents.push((tokens.ids, mask));
        }
        Ok(Conversation { documents, turn_by_turn: rendered.turn_by_turn })
    }

    /// The special token that ends the assistant's turn in this template (`<|eot_id|>` in
    /// Llama-3's, `<|im_end|>` in ChatML, `</s>` in Mistral's): the first special token among a
    /// reply's trained tokens, in a one-question conversation. `None` where the template ends a
    /// turn with no special token, or does not render such a conversation. A model trained on
    /// the template's conversations ends its replies with it, so generation stops there.
    pub fn turn_end(&self, tokenizer: &Tokenizer) -> Option<u32> {
        let messages = [
            serde_json::json!({"role": "user", "content": "What is two and two?"}),
            serde_json::json!({"role": "assistant", "content": "Four."}),
        ];
        let conversation = self.encode(tokenizer, &messages).ok()?;
        let (ids, mask) = conversation.documents.last()?;
        ids.iter()
            .zip(mask)
            .find(|&(&id, &m)| m == 1 && tokenizer.is_special(id))
            .map(|(&id, _)| id)
    }
}

/// Every message is an object with a string `role`.
fn check_messages(messages: &[Json]) -> Result<(), ConversationError> {
    for (index, message) in messages.iter().enumerate() {
        if !message.get("role").is_some_and(Json::is_string) {
            let what = format!("messages[{index}] is not an object with a string \"role\"");
            return Err(ConversationError::Messages(what));
        }
    }
    Ok(())
}

/// The template with `{% generation %}` / `{% endgeneration %}` (any whitespace control) turned
/// into raw blocks printing the marker characters, which keeps the tags' whitespace behaviour
/// (`lstrip_blocks` before the tag, `trim_blocks` after it); and whether there were any.
fn rewrite_generation_tags(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut found = false;
    while let Some(open) = rest.find("{%") {
        out.push_str(&rest[..open]);
        let tag = &rest[open..];
        match parse_generation_tag(tag) {
            Some((len, left, right, is_end)) => {
                let marker = if is_end { GENERATION_END } else { GENERATION_START };
                out.push_str(&format!("{{%{left} raw %}}{marker}{{% endraw {right}%}}"));
                rest = &tag[len..];
                found = true;
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    (out, found)
}

/// `{%[-+]? (end)?generation [-+]?%}` at the start of `tag`: its length, the whitespace-control
/// characters on each side, and whether it is the end tag.
fn parse_generation_tag(tag: &str) -> Option<(usize, &str, &str, bool)> {
    let body_start = 2;
    fn control(s: &str) -> &str {
        if s.starts_with(['-', '+']) { &s[..1] } else { "" }
    }
    let left = control(&tag[body_start..]);
    let inner = tag[body_start + left.len()..].trim_start();
    let (is_end, after_word) = if let Some(r) = inner.strip_prefix("endgeneration") {
        (true, r)
    } else {
        (false, inner.strip_prefix("generation")?)
    };
    let after_space = after_word.trim_start();
    if after_space.len() == after_word.len() && !after_word.starts_with(['-', '+', '%']) {
        return None; // `{% generations %}` or the like.
    }
    let right = control(after_space);
    let close = after_space[right.len()..].strip_prefix("%}")?;
    Some((tag.len() - close.len(), left, right, is_end))
}

/// The rendered text without the marker characters, and the byte ranges they enclosed.
fn cut_markers(rendered: &str) -> Result<(String, Vec<Range<usize>>), ConversationError> {
    let mut text = String::with_capacity(rendered.len());
    let mut spans = Vec::new();
    let mut open = None;
    for c in rendered.chars() {
        match c {
            GENERATION_START if open.is_none() => open = Some(text.len()),
            GENERATION_END if open.is_some() => spans.push(open.take().expect("open")..text.len()),
            GENERATION_START | GENERATION_END => {
                let what = "{% generation %} blocks are nested or unbalanced";
                return Err(ConversationError::Render(what.into()));
            }
            c => text.push(c),
        }
    }
    if open.is_some() {
        return Err(ConversationError::Render("{% generation %} without its end".into()));
    }
    Ok((text, spans))
}

/// Prints values as Jinja2 (Python) does where minijinja differs: `True`, `False`, `None`.
fn python_formatter(
    out: &mut minijinja::Output<'_>,
    state: &mut minijinja::State<'_, '_>,
    value: &Value,
) -> Result<(), JinjaError> {
    use minijinja::value::ValueKind;
    let python = match value.kind() {
        ValueKind::Bool if value.is_true() => "True",
        ValueKind::Bool => "False",
        ValueKind::None => "None",
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(python).map_err(JinjaError::from)
}

fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(JinjaError::new(JinjaErrorKind::InvalidOperation, message))
}

/// transformers' `strftime_now(format)`: the time now as Python's `datetime.now().strftime`
/// writes it, in UTC (Llama-3.2's template puts the day's date in its system header).
fn strftime_now(format: String) -> Result<Value, JinjaError> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let seconds = now.map_or(0, |d| d.as_secs() as i64);
    strftime(&format, seconds)
        .map(Value::from)
        .map_err(|e| JinjaError::new(JinjaErrorKind::InvalidOperation, e))
}

/// `format` with Python's `strftime` directives (the C locale's English names) replaced by those
/// of the UTC time `seconds` after 1970; a directive outside the common set is an error.
fn strftime(format: &str, seconds: i64) -> Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] =
        ["Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"];
    let (days, second_of_day) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400));
    // The civil date of a day count (Howard Hinnant's `civil_from_days`).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year_march = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_march = (5 * day_of_year_march + 2) / 153;
    let day = day_of_year_march - (153 * month_march + 2) / 5 + 1;
    let month = if month_march < 10 { month_march + 3 } else { month_march - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let before_month = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let day_of_year = before_month + day + i64::from(leap && month > 2);
    let weekday = (days + 4).rem_euclid(7) as usize;
    let (hour, minute, second) =
        (second_of_day / 3600, second_of_day / 60 % 60, second_of_day % 60);
    let month_name = MONTHS[month as usize - 1];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let directive = chars.next().ok_or("strftime_now: a format ends with '%'")?;
        let text = match directive {
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'm' => format!("{month:02}"),
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'b' | 'h' => month_name[..3].to_string(),
            'B' => month_name.to_string(),
            'a' => DAYS[weekday][..3].to_string(),
            'A' => DAYS[weekday].to_string(),
            'w' => weekday.to_string(),
            'j' => format!("{day_of_year:03}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{:02}", (hour + 11) % 12 + 1),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            '%' => "%".to_string(),
            other => return Err(format!("strftime_now: the directive %{other} is not supported")),
        };
        out.push_str(&text);
    }
    Ok(out)
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=indent)`, whose
/// separators are `", "` and `": "` (minijinja's own is compact and escapes HTML characters).
fn python_tojson(value: Value, kwargs: Kwargs) -> Result<Value, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(JinjaErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = Vec::new();
    let result = match indent {
        Some(n) => {
            let indent = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&indent);
            serde::Serialize::serialize(
                &json,
                &mut serde_json::Serializer::with_formatter(&mut out, formatter),
            )
        }
        None => serde::Serialize::serialize(
            &json,
            &mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter),
        ),
    };
    result.map_err(|e| JinjaError::new(JinjaErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
}

/// serde_json's compact output with Python's default separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// A minijinja error (which names the template's line) and the errors that caused it.
fn describe(error: &JinjaError) -> String {
    let mut message = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::strftime;

    /// What Python's `time.strftime(format, time.gmtime(seconds))` wrote for these times.
    #[test]
    fn strftime_writes_what_python_writes() {
        let late_july = 1_722_038_399; // 2024-07-26 23:59:59 UTC
        assert_eq!(strftime("%d %b %Y", late_july).unwrap(), "26 Jul 2024");
        assert_eq!(strftime("%Y-%m-%d", late_july).unwrap(), "2024-07-26");
        assert_eq!(
            strftime("%A %a %B %b %j %y %H:%M:%S %I %p %e %%", late_july).unwrap(),
            "Friday Fri July Jul 208 24 23:59:59 11 PM 26 %"
        );
        let leap_day = 951_782_400; // 2000-02-29
        assert_eq!(strftime("%d %B %Y %A %j", leap_day).unwrap(), "29 February 2000 Tuesday 060");
        assert_eq!(strftime("%d %b %Y %a %I %p", 0).unwrap(), "01 Jan 1970 Thu 12 AM");
        assert!(strftime("%Q", 0).unwrap_err().contains("%Q"));
        assert!(strftime("100%", 0).is_err());
    }
}
