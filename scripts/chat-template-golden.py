#!/usr/bin/env python3
"""Writes the golden files of zeroflow-data's model-template test (`tests/chat.rs`): for each
model's own chat template in crates/zeroflow-data/tests/fixtures/templates/NAME.jinja, a few
conversations and what transformers' renderer (`render_jinja_template`) makes of them, as
zeroflow's prefix rendering must find it: the documents (the conversation whole, or, where the
template renders a turn differently once later messages follow, the conversation through each
assistant turn) with the text of each assistant span, or that the conversation is refused (the
template raises, or a turn does not follow its conversation so far); for Qwen3 and Llama-3.1 also
with variables passed as `apply_chat_template(..., **kwargs)` (`enable_thinking`, `date_string`).

    python3 scripts/chat-template-golden.py      # needs transformers (>= 4.45); no network

Llama-3.2's template dates its system header with `strftime_now` (today's date): its golden file
holds DATE there, which the test reads as any date.
"""

import json
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "crates/zeroflow-data/tests/fixtures/templates"
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}

CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich", "days": 2}}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": " Paris. "},
     {"role": "user", "content": "And of Italy?"}, {"role": "assistant", "content": "Rome."}],
    [{"role": "user", "content": "Think first: 3 * 7?"},
     {"role": "assistant", "content": "<think>\nThree sevens.\n</think>\n\n21"},
     {"role": "user", "content": "And 3 * 8?"},
     {"role": "assistant", "content": "<think>\nOne more three.\n</think>\n\n24"}],
    [{"role": "user", "content": "Weather in Zürich?"},
     {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "content": "{\"sunny\": true}"},
     {"role": "assistant", "content": "Sunny for two days."}],
]


# Variables passed to a template as `apply_chat_template(..., **kwargs)`, per template: each set
# with every conversation.
KWARGS = {"qwen3": [{}, {"enable_thinking": False}], "llama-3.1": [{}, {"date_string": "01 Jan 2026"}]}


def render(template, messages, generation_prompt, kwargs):
    return render_jinja_template(conversations=[messages], chat_template=template,
                                 add_generation_prompt=generation_prompt, **TOKENS, **kwargs)[0][0]


def documents(template, messages, kwargs):
    """[(text, [assistant span texts])], or None where refused."""
    try:
        whole = render(template, messages, False, kwargs)
        turns = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = render(template, messages[:i], True, kwargs)
            through = render(template, messages[:i + 1], False, kwargs)
            if not through.startswith(before):
                return None
            turns.append((through, through[len(before):max(len(through.rstrip()), len(before))]))
    except Exception:  # the template's raise_exception
        return None
    if all(whole.startswith(through) for through, _ in turns):
        return [(whole, [span for _, span in turns])]
    return [(through, [span]) for through, span in turns]


def main():
    import datetime
    today = datetime.datetime.now().strftime("%d %b %Y")
    for path in sorted(FOLDER.glob("*.jinja")):
        template = path.read_text()
        cases = []
        for kwargs in KWARGS.get(path.stem, [{}]):
            for messages in CONVERSATIONS:
                docs = documents(template, messages, kwargs)
                if docs is not None:
                    docs = [{"text": t.replace(today, "DATE"), "spans": s} for t, s in docs]
                cases.append({"messages": messages, "kwargs": kwargs, "documents": docs})
        out = path.with_suffix(".golden.json")
        out.write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
        summary = ["refused" if c["documents"] is None else len(c["documents"]) for c in cases]
        print(f"{out.relative_to(ROOT)}: documents per conversation {summary}")


if __name__ == "__main__":
    main()
