//! A file of prompts for `zeroflow generate --prompts`: one prompt per line (text, or token ids
//! `1,2,3` where no tokenizer is given), or JSON lines (a `.jsonl` file) each with `"prompt"`
//! (text), `"prompt_tokens"` (ids) or, for `--chat`, `"messages"` (a conversation so far, the
//! assistant's turn to come). Blank lines are skipped.

use std::path::Path;

use zeroflow_data::{ChatTemplate, Tokenizer};

use super::parse_ids;
use crate::error::{Result, TrainError, input};

/// The tokens a reply ends at: the tokenizer's end of text, and the special token that ends a
/// turn in the chat `template` where one is given (a base model's tokenizer ends text with
/// another: Llama-3's `<|end_of_text|>` where the template ends a turn with `<|eot_id|>`).
pub fn reply_stops(tokenizer: &Tokenizer, template: Option<&ChatTemplate>) -> Vec<u32> {
    let turn_end = template.and_then(|template| template.turn_end(tokenizer));
    let mut stops: Vec<u32> = tokenizer.eot().into_iter().chain(turn_end).collect();
    stops.dedup();
    stops
}

/// One prompt as the file gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    /// A conversation so far (`--chat` only).
    Messages(Vec<serde_json::Value>),
}

impl Prompt {
    /// The prompt's token ids: text encoded by `tokenizer`; without one, text must be ids
    /// (`1,2,3`). An error says why not.
    pub fn tokens(&self, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>, String> {
        match (self, tokenizer) {
            (Prompt::Tokens(ids), _) => Ok(ids.clone()),
            (Prompt::Text(text), Some(tokenizer)) => tokenizer.encode(text),
            (Prompt::Text(text), None) => {
                parse_ids(text).map_err(|e| format!("{e}; give --tokenizer to encode text prompts"))
            }
            (Prompt::Messages(_), _) => {
                Err("\"messages\" is a conversation, which --chat renders with the chat template"
                    .into())
            }
        }
    }

    /// The prompt's token ids for a chat model: text as one user message (or the messages given)
    /// rendered by `template` with the assistant's turn opened, tokenized as
    /// `apply_chat_template(messages, add_generation_prompt=True)` does (no special tokens added:
    /// the template writes them); ids as they are.
    pub fn chat_tokens(
        &self,
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
    ) -> Result<Vec<u32>, String> {
        match self {
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::Text(text) => {
                let messages = [serde_json::json!({"role": "user", "content": text})];
                render(tokenizer, template, &messages)
            }
            Prompt::Messages(messages) => render(tokenizer, template, messages),
        }
    }
}

/// `messages` rendered by `template` with the assistant's turn opened, tokenized.
fn render(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &[serde_json::Value],
) -> Result<Vec<u32>, String> {
    let rendered = template
        .render(messages, true, tokenizer.config())
        .map_err(|e| format!("the chat template: {e}"))?;
    Ok(tokenizer.encode_with_offsets(&rendered)?.ids)
}

/// The prompts of `path`: JSON lines where it is JSON Lines ([`zeroflow_data::input_kind`]: a
/// `.jsonl`, or a `.json` of one object per line), else lines of text ([`parse_prompts`]); an
/// input error names the file and the line, or says why the file is neither.
pub fn read_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let kind = zeroflow_data::input_kind(path)
        .map_err(|reason| input(format!("--prompts {}: {reason}", path.display())))?;
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
        what: format!("read {} (the prompts file)", path.display()),
        source,
    })?;
    let jsonl = kind == zeroflow_data::InputKind::JsonLines;
    let prompts = parse_prompts(&text, jsonl)
        .map_err(|e| input(format!("--prompts {}: {e}", path.display())))?;
    if prompts.is_empty() {
        return Err(input(format!("--prompts {}: no prompts in the file", path.display())));
    }
    Ok(prompts)
}

/// The prompts of `text`, one per non-blank line: JSON objects with `"prompt"` (a string),
/// `"prompt_tokens"` (a list of ids) or `"messages"` (a list) where `jsonl`, else each line's
/// text (its line ending dropped). An error names the line (from 1).
pub fn parse_prompts(text: &str, jsonl: bool) -> Result<Vec<Prompt>, String> {
    let lines = text.lines().enumerate().filter(|(_, line)| !line.trim().is_empty());
    if !jsonl {
        return Ok(lines.map(|(_, line)| Prompt::Text(line.to_string())).collect());
    }
    lines
        .map(|(i, line)| {
            let at = |reason: String| format!("line {}: {reason}", i + 1);
            let value: serde_json::Value =
                serde_json::from_str(line).map_err(|e| at(format!("not JSON: {e}")))?;
            if let Some(text) = value.get("prompt").and_then(|p| p.as_str()) {
                return Ok(Prompt::Text(text.to_string()));
            }
            if let Some(messages) = value.get("messages").and_then(|m| m.as_array()) {
                return Ok(Prompt::Messages(messages.clone()));
            }
            let ids = value.get("prompt_tokens").and_then(|p| p.as_array()).ok_or_else(|| {
                let what = r#"an object with "prompt" (a string), "prompt_tokens" (ids) or "messages" (a list)"#;
                at(what.into())
            })?;
            let id = |v: &serde_json::Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
            let ids: Option<Vec<u32>> = ids.iter().map(id).collect();
            ids.map(Prompt::Tokens).ok_or_else(|| at("prompt_tokens are not token ids".into()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lines_are_prompts_and_blank_lines_are_skipped() {
        let prompts = parse_prompts("Hello there\n\n  \n1,2,3\r\nlast", false).unwrap();
        let texts = ["Hello there", "1,2,3", "last"].map(|t| Prompt::Text(t.into()));
        assert_eq!(prompts, texts);
        assert_eq!(prompts[1].tokens(None), Ok(vec![1, 2, 3]), "ids without a tokenizer");
        let refused = prompts[0].tokens(None).unwrap_err();
        assert!(refused.contains("--tokenizer"), "{refused}");
        let bytes = Tokenizer::load("bytes").unwrap();
        assert_eq!(prompts[2].tokens(Some(&bytes)), Ok(b"last".map(u32::from).to_vec()));
    }

    #[test]
    fn json_lines_give_text_or_token_prompts_and_errors_name_the_line() {
        let text = "{\"prompt\": \"a\\nb\"}\n\n{\"prompt_tokens\": [5, 0, 7], \"id\": 3}\n";
        let prompts = parse_prompts(text, true).unwrap();
        assert_eq!(prompts, [Prompt::Text("a\nb".into()), Prompt::Tokens(vec![5, 0, 7])]);
        let error = |text| parse_prompts(text, true).unwrap_err();
        assert!(error("{\"prompt\": \"x\"}\nnot json").starts_with("line 2: not JSON"));
        assert!(error("{\"text\": \"x\"}").contains("line 1: an object with \"prompt\""));
        assert!(error("{\"prompt_tokens\": [1, -2]}").contains("line 1: prompt_tokens are not"));
    }

    /// A conversation so far is a prompt for `--chat`: rendered with the assistant's turn opened
    /// (a system prompt and earlier turns kept); without `--chat` it is refused.
    #[test]
    fn messages_are_a_chat_prompt() {
        let text = r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}"#;
        let prompts = parse_prompts(text, true).unwrap();
        let Prompt::Messages(messages) = &prompts[0] else { panic!("{prompts:?}") };
        assert_eq!(messages.len(), 2);
        let bytes = Tokenizer::load("bytes").unwrap();
        assert!(prompts[0].tokens(Some(&bytes)).unwrap_err().contains("--chat"));
        let template = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\
             {% if add_generation_prompt %}<assistant>{% endif %}",
            "t.jinja",
        )
        .unwrap();
        let ids = prompts[0].chat_tokens(&bytes, &template).unwrap();
        assert_eq!(ids, b"<system>s<user>u<assistant>".map(u32::from).to_vec());
    }
}
