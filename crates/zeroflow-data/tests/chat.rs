//! Chat templates: rendering as transformers does, the assistant's spans from generation markers
//! and from prefix rendering, and the loss mask on tokens.

use serde_json::{Value, json};
use zeroflow_data::{
    ChatOptions, ChatTemplate, ConversationError, TemplateVariables, Tokenizer, TokenizerConfig,
};

use crate::fixtures::{
    CHATML_TEMPLATE, LLAMA3_TEMPLATE, byte_level_bpe, model_dir, one, scratch, three_turns,
    without_markers,
};

fn config() -> TokenizerConfig {
    TokenizerConfig {
        bos_token: Some("<|begin_of_text|>".into()),
        eos_token: Some("<|eot_id|>".into()),
        ..TokenizerConfig::default()
    }
}

fn content(message: &Value) -> &str {
    message["content"].as_str().unwrap()
}

/// What the Llama-3-style template renders, and the assistant's parts of it.
fn llama3_expected(messages: &[Value]) -> (String, Vec<String>) {
    let mut text = "<|begin_of_text|>".to_string();
    let mut spans = Vec::new();
    for m in messages {
        let role = m["role"].as_str().unwrap();
        text += &format!("<|start_header_id|>{role}<|end_header_id|>\n\n");
        let turn = format!("{}<|eot_id|>", content(m).trim());
        if role == "assistant" {
            spans.push(turn.clone());
        }
        text += &turn;
    }
    (text, spans)
}

/// What the ChatML template renders, and the assistant's parts of it.
fn chatml_expected(messages: &[Value]) -> (String, Vec<String>) {
    let mut text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n".to_string();
    let mut spans = Vec::new();
    for m in messages {
        let role = m["role"].as_str().unwrap();
        if role == "assistant" {
            let turn = format!("{}<|im_end|>", content(m).trim());
            text += &format!("<|im_start|>assistant\n{turn}\n");
            spans.push(turn);
        } else {
            text += &format!("<|im_start|>{role}\n{}<|im_end|>\n", content(m));
        }
    }
    (text, spans)
}

fn span_texts(text: &str, spans: &[std::ops::Range<usize>]) -> Vec<String> {
    spans.iter().map(|s| text[s.clone()].to_string()).collect()
}

/// With generation markers, the rendered text is the template's (markers cut out) and the spans
/// are exactly the assistant's turns; the prefix-rendering fallback, on the same templates with
/// the markers removed, finds the same spans.
#[test]
fn markers_and_the_prefix_fallback_find_the_assistant_turns_of_a_three_turn_chat() {
    let messages = three_turns();
    let cases = [
        ("llama3", LLAMA3_TEMPLATE, llama3_expected(&messages)),
        ("chatml", CHATML_TEMPLATE, chatml_expected(&messages)),
    ];
    for (name, source, (expected_text, expected_spans)) in cases {
        let marked = ChatTemplate::new(source, name).unwrap();
        assert!(marked.has_generation_markers(), "{name}");
        let (text, spans) = one(marked.assistant_spans(&messages, &config()).unwrap());
        assert_eq!(text, expected_text, "{name}");
        assert_eq!(span_texts(&text, &spans), expected_spans, "{name}");

        let plain = ChatTemplate::new(&without_markers(source), name).unwrap();
        assert!(!plain.has_generation_markers(), "{name}");
        let (plain_text, plain_spans) = one(plain.assistant_spans(&messages, &config()).unwrap());
        assert_eq!((plain_text, plain_spans), (text, spans), "{name}: fallback");
    }
}

/// A Qwen3-style template: an assistant turn after the last question keeps its reasoning in a
/// `<think>` block; earlier turns lose it.
const REASONING_TEMPLATE: &str = r#"{%- set ns = namespace(last_query=0) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
{%- set reasoning = message.content.split('</think>')[0].split('<think>')[-1].strip('\n') if '</think>' in message.content else '' %}
{%- if loop.index0 > ns.last_query %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;

/// A template that renders an earlier turn differently once a later question follows (Qwen3's
/// drops its reasoning) makes a document per assistant turn, the conversation through it, with
/// that turn's text alone trained on; one turn, or a template that renders each turn the same
/// whatever follows, makes one document.
#[test]
fn a_template_that_rewrites_earlier_turns_makes_a_document_per_turn() {
    let template = ChatTemplate::new(REASONING_TEMPLATE, "reasoning.jinja").unwrap();
    let messages = [
        json!({"role": "user", "content": "q1"}),
        json!({"role": "assistant", "content": "<think>r1</think>a1"}),
        json!({"role": "user", "content": "q2"}),
        json!({"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"}),
    ];
    let conversation = template.assistant_spans(&messages, &config()).unwrap();
    assert!(conversation.turn_by_turn);
    let documents: Vec<_> = conversation
        .documents
        .iter()
        .map(|(text, spans)| (text.as_str(), span_texts(text, spans)))
        .collect();
    let first = "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n";
    let second = "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n\
                  <|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n";
    let turn = |r: &str, a: &str| format!("<think>\n{r}\n</think>\n\n{a}<|im_end|>");
    assert_eq!(
        documents,
        [
            (format!("{first}{}\n", turn("r1", "a1")).as_str(), vec![turn("r1", "a1")]),
            (format!("{second}{}\n", turn("r2", "a2")).as_str(), vec![turn("r2", "a2")]),
        ]
    );
    // One turn: one document, as the template renders it whole.
    let (text, spans) = one(template.assistant_spans(&messages[..2], &config()).unwrap());
    assert_eq!(
        (text.as_str(), span_texts(&text, &spans)),
        (documents[0].0, documents[0].1.clone())
    );
    // Tokens: a mask per document, on that document's turn.
    let dir = scratch("chat-turn-by-turn");
    model_dir(&dir, &byte_level_bpe(), Some(&json!({"eos_token": "<|im_end|>"})));
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    let encoded = template.encode(&tokenizer, &messages).unwrap();
    assert!(encoded.turn_by_turn);
    for ((ids, mask), (_, spans)) in encoded.documents.iter().zip(&documents) {
        let trained: Vec<u32> =
            ids.iter().zip(mask).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
        assert_eq!(tokenizer.decode(&trained).unwrap(), spans[0]);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Rewriting `{% generation %}` keeps the tags' whitespace rules: the text equals that of the
/// template with the tags replaced by `{% if true %}` / `{% endif %}` (block tags too).
#[test]
fn rewriting_generation_tags_keeps_the_whitespace_of_block_tags() {
    let as_if = |t: &str| {
        t.replace("{% generation %}", "{% if true %}")
            .replace("{%- generation %}", "{%- if true %}")
            .replace("{% endgeneration %}", "{% endif %}")
            .replace("{%- endgeneration %}", "{%- endif %}")
    };
    let messages = three_turns();
    for source in [LLAMA3_TEMPLATE, CHATML_TEMPLATE] {
        let marked = ChatTemplate::new(source, "marked").unwrap();
        let reference = ChatTemplate::new(&as_if(source), "if").unwrap();
        for prompt in [false, true] {
            assert_eq!(
                marked.render(&messages, prompt, &config()).unwrap(),
                reference.render(&messages, prompt, &config()).unwrap()
            );
        }
    }
    let prompt = ChatTemplate::new(CHATML_TEMPLATE, "chatml").unwrap();
    let text = prompt.render(&messages[..1], true, &config()).unwrap();
    assert!(text.ends_with("<|im_end|>\n<|im_start|>assistant\n"), "{text:?}");
}

/// On tokens, the mask keeps exactly the assistant's turns: the masked tokens decode to the
/// turns, the others to the rest of the text, for both templates.
#[test]
fn the_loss_mask_covers_exactly_the_assistant_tokens() {
    let dir = scratch("chat-mask");
    let config = json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"});
    model_dir(&dir, &byte_level_bpe(), Some(&config));
    let tokenizer = Tokenizer::load(dir.to_str().unwrap()).unwrap();
    let messages = three_turns();
    for (source, (text, spans)) in [
        (LLAMA3_TEMPLATE, llama3_expected(&messages)),
        (CHATML_TEMPLATE, chatml_expected(&messages)),
    ] {
        let template = ChatTemplate::new(source, "t").unwrap();
        let (ids, mask) = one(template.encode(&tokenizer, &messages).unwrap());
        assert_eq!(ids.len(), mask.len());
        assert_eq!(tokenizer.decode(&ids).unwrap(), text);
        let kept: Vec<u32> =
            ids.iter().zip(&mask).filter(|(_, m)| **m == 1).map(|(t, _)| *t).collect();
        assert_eq!(tokenizer.decode(&kept).unwrap(), spans.concat());
        // Three separate runs of ones, one per assistant turn.
        let runs = mask.windows(2).filter(|w| w == &[0, 1]).count();
        assert_eq!(runs, 3);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The token that ends a reply: the first special token the reply is trained on (Llama-3's
/// `<|eot_id|>`, ChatML's `<|im_end|>`, not a special token of the header before it); none
/// where a turn ends with text, or with a token that is not special.
#[test]
fn a_templates_turn_end_is_the_first_special_token_of_a_reply() {
    let dir = scratch("chat-turn-end");
    let config = json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|endoftext|>"});
    model_dir(&dir, &byte_level_bpe(), Some(&config));
    let tokenizer = Tokenizer::load(dir.to_str().unwrap()).unwrap();
    let id = |token: &str| tokenizer.encode_with_offsets(token).unwrap().ids[0];
    let turn_end = |source: &str| ChatTemplate::new(source, "t").unwrap().turn_end(&tokenizer);
    assert_eq!(turn_end(LLAMA3_TEMPLATE), Some(id("<|eot_id|>")));
    assert_eq!(turn_end(CHATML_TEMPLATE), Some(id("<|im_end|>")));
    assert!(tokenizer.is_special(id("<|im_end|>")) && !tokenizer.is_special(id("a")));
    let plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
    assert_eq!(turn_end(plain), None);
    // With the bytes tokenizer, nothing is special.
    let bytes = Tokenizer::load("bytes").unwrap();
    assert_eq!(ChatTemplate::new(CHATML_TEMPLATE, "t").unwrap().turn_end(&bytes), None);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn raise_exception_python_methods_and_tojson_work_as_in_transformers() {
    let template = ChatTemplate::new(CHATML_TEMPLATE, "chatml.jinja").unwrap();
    let tool = [json!({"role": "tool", "content": "x"})];
    let error = template.assistant_spans(&tool, &config()).unwrap_err();
    assert!(
        matches!(&error, ConversationError::Render(m) if m.contains("Unknown role: tool")),
        "{error}"
    );

    let source = "{{ messages[0] | tojson }}|{{ messages[0].content.upper().startswith('A<') }}|{{ none }}|\
                  {{ messages[0]['content'].split('<') | tojson }}|{{ {'k': [1, 2]} | tojson(indent=2) }}";
    let template = ChatTemplate::new(source, "t").unwrap();
    let messages = [json!({"role": "user", "content": "a<b é"})];
    let text = template.render(&messages, false, &config()).unwrap();
    assert_eq!(
        text,
        "{\"role\": \"user\", \"content\": \"a<b é\"}|True|None|[\"a\", \"b é\"]|{\n  \"k\": [\n    1,\n    2\n  ]\n}"
    );
}

#[test]
fn templates_that_cannot_work_are_errors() {
    let error = ChatTemplate::new("{% if %}", "broken.jinja").unwrap_err();
    assert_eq!(error.path, std::path::Path::new("broken.jinja"));
    // A template that renders a turn differently once more turns follow cannot use prefixes.
    let last_aware =
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m.content }}{% endfor %}";
    let template = ChatTemplate::new(last_aware, "t").unwrap();
    let messages = [
        json!({"role": "user", "content": "a"}),
        json!({"role": "assistant", "content": "b"}),
        json!({"role": "user", "content": "c"}),
    ];
    let error = template.assistant_spans(&messages, &config()).unwrap_err();
    assert_eq!(error, ConversationError::NotPrefixStable { index: 1 });
    let error = template.assistant_spans(&[json!({"content": "no role"})], &config()).unwrap_err();
    assert!(matches!(error, ConversationError::Messages(_)), "{error}");
}

/// Models' own templates (Llama-3.1, Llama-3.2, Qwen2.5, Qwen3, Mistral-v0.3, as they ship them;
/// `tests/fixtures/templates`): the documents and assistant spans of a few conversations (tool
/// calls and reasoning among them), or their refusal, as transformers' renderer makes them, with
/// variables too (Qwen3's `enable_thinking`, Llama-3.1's `date_string`;
/// `scripts/chat-template-golden.py` wrote the golden files). A variable the renderer sets is
/// refused.
#[test]
fn models_own_templates_render_as_transformers_renders_them() {
    let folder = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    let config = TokenizerConfig {
        bos_token: Some("<s>".into()),
        eos_token: Some("</s>".into()),
        ..TokenizerConfig::default()
    };
    let names = ["llama-3.1", "llama-3.2", "mistral-v0.3", "qwen2.5", "qwen3"];
    for name in names {
        let path = folder.join(format!("{name}.jinja"));
        let golden = std::fs::read_to_string(folder.join(format!("{name}.golden.json"))).unwrap();
        let cases: Vec<Value> = serde_json::from_str(&golden).unwrap();
        for (i, case) in cases.iter().enumerate() {
            let kwargs = case["kwargs"].as_object().unwrap().clone();
            let template = ChatTemplate::from_file(&path).unwrap().with_variables(kwargs).unwrap();
            let messages = case["messages"].as_array().unwrap();
            let ours = template.assistant_spans(messages, &config);
            let Some(expected) = case["documents"].as_array() else {
                assert!(
                    ours.is_err(),
                    "{name} conversation {i}: refused by transformers: {ours:?}"
                );
                continue;
            };
            let ours = ours.unwrap_or_else(|e| panic!("{name} conversation {i}: {e}"));
            assert_eq!(ours.turn_by_turn, expected.len() > 1, "{name} conversation {i}");
            assert_eq!(ours.documents.len(), expected.len(), "{name} conversation {i}");
            for ((text, spans), want) in ours.documents.iter().zip(expected) {
                assert_same_but_date(text, want["text"].as_str().unwrap(), name, i);
                let spans = span_texts(text, spans);
                assert_eq!(spans, want["spans"].as_array().unwrap().clone(), "{name} {i}");
            }
        }
    }
}

#[test]
fn variables_the_renderer_sets_are_refused() {
    let mut variables = serde_json::Map::new();
    variables.insert("add_generation_prompt".into(), json!(true));
    let template = ChatTemplate::new("{{ messages }}", "t.jinja").unwrap();
    let error = template.with_variables(variables).unwrap_err();
    assert!(error.message.contains("add_generation_prompt"), "{error}");
}

/// `ours == want`, where `want` may hold `DATE` for a date within a year of the clock's year
/// written `%d %b %Y`: not a template's fixed default ("26 Jul 2024", two years back).
fn assert_same_but_date(ours: &str, want: &str, name: &str, i: usize) {
    let Some((before, after)) = want.split_once("DATE") else {
        return assert_eq!(ours, want, "{name} conversation {i}");
    };
    let date = ours
        .strip_prefix(before)
        .and_then(|rest| rest.strip_suffix(after))
        .unwrap_or_else(|| panic!("{name} conversation {i}: {ours:?} against {want:?}"));
    let parts: Vec<&str> = date.split(' ').collect();
    let looks_like_a_date = parts.len() == 3
        && parts[0].len() == 2
        && parts[1].len() == 3
        && parts[2].len() == 4
        && [parts[0], parts[2]].iter().all(|p| p.bytes().all(|b| b.is_ascii_digit()));
    assert!(looks_like_a_date, "{name} conversation {i}: {date:?} for DATE");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let year = 1970 + (now.as_secs() as f64 / (365.2425 * 86_400.0)) as u64;
    let written: u64 = parts[2].parse().unwrap();
    assert!(
        (year - 1..=year + 1).contains(&written),
        "{name} conversation {i}: {date:?} in {year}"
    );
}

/// Variables for a tokenizer without a chat template (and no template file) are an error
/// that names the flags; without variables there is simply no template.
#[test]
fn variables_without_a_template_are_an_error() {
    let tokenizer = Tokenizer::bytes();
    assert!(ChatOptions::default().template(&tokenizer).unwrap().is_none());
    let mut variables = TemplateVariables::new();
    variables.insert("enable_thinking".into(), json!(false));
    let chat = ChatOptions { template: None, variables };
    let error = chat.template(&tokenizer).unwrap_err();
    assert!(error.contains("--chat-template-kwargs") && error.contains("--chat-template)"));
}
