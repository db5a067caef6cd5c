#!/usr/bin/env python3
"""Turns the JSON lines of scripts/bench-vs-deepspeed.sh and scripts/largest-model.sh into
BENCHMARKS.md's tables (markdown, on stdout or --markdown FILE) and two SVG plots:

    python3 scripts/bench-report.py docs/bench/2026-11-30-h200-gpt-1.3b.jsonl \
        --svg-dir docs/bench --prefix 2026-11-30-h200

writes docs/bench/2026-11-30-h200-tokens.svg (training tokens/s by mode and model, zeroflow
against DeepSpeed, one panel per model) and docs/bench/2026-11-30-h200-breakdown.svg (zeroflow's
step split into forward + backward and the exposed optimizer, stacked, one panel per model).

Standard library only. Where a file repeats a (system, mode, model) row, the later one counts.
Numbers are printed as measured; nothing is estimated or filled in: a missing row is a dash.
"""

import argparse
import json
import sys
from html import escape
from pathlib import Path

GIB = 2**30
# (zeroflow mode, DeepSpeed mode, row label): the training comparisons, like for like.
PAIRS = [
    ("gpu", "gpu", "optimizer on the GPU (`gpu`)"),
    ("offload", "offload", "CPU optimizer offload (`offload`)"),
    ("offload-delayed", "offload",
     "offload + delayed update (`offload-delayed`) vs DeepSpeed offload"),
    ("offload-delayed", "zenflow",
     "offload + delayed update vs DeepSpeed ZenFlow (topk 0.05, interval 4, overlap)"),
    ("zenflow", "zenflow", "ZenFlow, same settings (topk 0.05, interval 4, overlap)"),
]
ZF_MODES = ["gpu", "offload", "offload-delayed", "zenflow"]
DS_NAMES = {"gpu": "DeepSpeed `gpu`", "offload": "DeepSpeed `offload`", "zenflow": "DeepSpeed ZenFlow"}
MODEL_ORDER = ["tiny", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt-1.3b", "gpt2-1.5b"]
# (layers, width) of the named sizes, for the model FLOPs of rows that do not carry their shape.
MODEL_SHAPES = {"gpt2-124m": (12, 768), "gpt2-350m": (24, 1024), "gpt2-774m": (36, 1280),
                "gpt-1.3b": (24, 2048), "gpt2-1.5b": (48, 1600)}
COLORS = {"zeroflow": "#1f6fb4", "deepspeed": "#e07b28", "fwd_bwd": "#1f6fb4", "optimizer": "#9ecae9"}


def load(paths):
    """The rows of all files, keyed by (system, mode, model); later rows replace earlier ones."""
    rows, ladder = {}, []
    for path in paths:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                sys.exit(f"{path}:{number}: not JSON: {err}")
            if row.get("bench") == "largest-model":
                ladder.append(row)
                continue
            system = row.get("system")
            mode = row.get("mode") or ("fwd-bwd" if system == "pytorch" else None)
            key = (system, mode, row.get("model") if mode != "cpu-adam" else row.get("optimizer"))
            rows[key] = row
    return rows, ladder


def model_key(name):
    return (MODEL_ORDER.index(name) if name in MODEL_ORDER else len(MODEL_ORDER), name)


def s_per_step(row):
    return row.get("s_per_step_mean") or row.get("s_per_step_median")


def fmt(value, spec, suffix=""):
    return "—" if value is None else f"{value:{spec}}{suffix}"


def gpu_gib(row):
    """zeroflow: all memory in use on the device; the PyTorch-based peers: the allocator's peak."""
    if row.get("device_memory_in_use_bytes"):
        return row["device_memory_in_use_bytes"] / GIB
    return row.get("peak_gib") or row.get("device_used_gib")


def model_tflops(row, model, params=None):
    """Model TFLOP/s from the measured tokens/s: 6 N + 12 L d T FLOPs per trained token (the
    weights' matmuls forward and backward, and attention's two batched matmuls over T positions;
    PaLM's accounting, the causal mask not discounted). The row's own figure where it has one;
    `params`: the model's parameter count where the row lacks it."""
    if row.get("model_tflops"):
        return row["model_tflops"]
    layers, width = row.get("n_layer"), row.get("d_model")
    if not (layers and width) and model in MODEL_SHAPES:
        layers, width = MODEL_SHAPES[model]
    params = row.get("parameters") or params
    seq, tokens = row.get("seq"), row.get("tokens_per_s")
    if not (layers and width and params and seq and tokens):
        return None
    return tokens * (6 * params + 12 * layers * width * seq) / 1e12


def describe_model(rows, model):
    any_row = next((r for (_, _, m), r in rows.items() if m == model and "parameters" in r), None)
    if any_row is None:
        return f"Model `{model}`."
    batch, seq = any_row.get("micro_batch"), any_row.get("seq")
    text = f"Model `{model}` ({any_row['parameters'] / 1e9:.2f} B parameters)"
    if batch and seq:
        text += f", micro-batch {batch}, context {seq} ({batch * seq:,} tokens per step)"
    return text + "."


def training_table(rows, model):
    out = ["| mode | zeroflow s/step | zeroflow tokens/s | DeepSpeed (PyTorch) s/step | DeepSpeed (PyTorch) tokens/s | **ratio** |",
           "| --- | --- | --- | --- | --- | --- |"]
    for ours, theirs, label in PAIRS:
        a, b = rows.get(("zeroflow", ours, model)), rows.get(("deepspeed", theirs, model))
        if not a and not b:
            continue
        out.append(row_line(label, a, b))
    a, b = rows.get(("zeroflow", "fwd-bwd", model)), rows.get(("pytorch", "fwd-bwd", model))
    if a or b:
        out.append(row_line("forward + backward only, no optimizer (`bench gpt`) vs PyTorch "
                            "(the compute floor)", a, b, median=True))
    return out


def row_line(label, a, b, median=False):
    def cells(row):
        if not row:
            return ["—", "—"]
        seconds = row.get("s_per_step_median") if median else s_per_step(row)
        return [fmt(seconds, ".4f"), fmt(row.get("tokens_per_s"), ",.0f")]
    ratio = "—"
    if a and b and a.get("tokens_per_s") and b.get("tokens_per_s"):
        ratio = f"**{a['tokens_per_s'] / b['tokens_per_s']:.2f}×**"
    return "| " + " | ".join([label, *cells(a), *cells(b), ratio]) + " |"


def breakdown_table(rows, model):
    """Per system and mode: the step's parts, the model FLOP rate and memory. The forward and
    backward columns appear where a row has them (`bench step` before they were added did not)."""
    split = any(r.get("forward_s_mean") for (_, _, m), r in rows.items() if m == model)
    head = ["system, mode", *(["forward", "backward"] if split else []), "forward + backward",
            "exposed optimizer / offload", "model TFLOP/s", "host RSS per parameter", "GPU memory"]
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    params = next((r["parameters"] for (_, _, m), r in rows.items()
                   if m == model and r.get("parameters")), None)

    def seconds(row, key):
        return fmt(row.get(key), ".4f", " s")

    def line(name, row, total):
        cells = [name]
        if split:
            cells += [seconds(row, "forward_s_mean"), seconds(row, "backward_s_mean")]
        cells += [total, seconds(row, "exposed_optimizer_s_mean"),
                  fmt(model_tflops(row, model, params), ".0f"),
                  fmt(row.get("peak_rss_bytes_per_param"), ".1f", " B"),
                  fmt(gpu_gib(row), ".1f", " GiB")]
        return "| " + " | ".join(cells) + " |"
    for mode in ZF_MODES:
        row = rows.get(("zeroflow", mode, model))
        if row:
            out.append(line(f"zeroflow `{mode}`", row, seconds(row, "forward_backward_s_mean")))
    for mode, name in DS_NAMES.items():
        row = rows.get(("deepspeed", mode, model))
        if row:
            out.append(line(name, row, "—"))
    for system in ("zeroflow", "pytorch"):
        row = rows.get((system, "fwd-bwd", model))
        if row:
            name = "zeroflow `bench gpt`" if system == "zeroflow" else "PyTorch forward + backward"
            out.append(line(name, row, fmt(s_per_step(row), ".4f", " s")))
    return out


def cpu_adam_table(rows):
    found = {key[2]: row for key, row in rows.items() if key[1] == "cpu-adam"}
    if not found:
        return []
    reference = found.get("deepspeed", {}).get("gparams_per_s")
    out = ["| optimizer | Gparam/s | GB/s | fraction of roofline | vs DeepSpeedCPUAdam |",
           "| --- | --- | --- | --- | --- |"]
    names = {"zeroflow": "zeroflow", "deepspeed": "DeepSpeedCPUAdam (AdamW mode)",
             "torch-fused": "torch `AdamW(fused=True)`", "torch-foreach": "torch `AdamW(foreach=True)`"}
    for optimizer in ["zeroflow", "deepspeed", "torch-fused", "torch-foreach"]:
        row = found.get(optimizer)
        if not row:
            continue
        if row.get("skipped"):
            out.append(f"| {names[optimizer]} | skipped: {row['skipped']} | | | |")
            continue
        rate = row.get("gparams_per_s")
        ratio = f"{rate / reference:.2f}×" if rate and reference else "—"
        if optimizer == "zeroflow" and rate and reference:
            ratio = f"**{ratio}**"
        fraction = row.get("roofline_fraction")
        out.append(f"| {names[optimizer]} | {fmt(rate, '.2f')} | {fmt(row.get('gb_per_s'), '.1f')} "
                   f"| {fmt(fraction * 100 if fraction else None, '.1f', ' %')} | {ratio} |")
    first = found.get("zeroflow") or next(iter(found.values()))
    out.append("")
    out.append(f"{first.get('params', 0):,} parameters, {first.get('threads')} threads, median of "
               f"{first.get('iters')} passes, fp32 gradients (28 B per parameter moved).")
    return out


def ladder_table(ladder):
    """Per (system, mode): the largest size that trained and the first that did not."""
    if not ladder:
        return []
    groups = {}
    for row in ladder:
        groups.setdefault((row["system"], row["mode"]), []).append(row)
    out = ["| system | mode | largest that trains | its host RSS / GPU memory | first that fails | why |",
           "| --- | --- | --- | --- | --- | --- |"]

    def shape(row):
        return (f"{row['parameters'] / 1e9:.2f} B ({row['n_layer']} × d {row['d_model']}, "
                f"{row['n_head']} heads)")
    for (system, mode), attempts in groups.items():
        ok = [r for r in attempts if r.get("status") == "ok"]
        failed = [r for r in attempts if r.get("status") != "ok"]
        best = max(ok, key=lambda r: r["parameters"]) if ok else None
        above = [r for r in failed if not best or r["parameters"] > best["parameters"]]
        first = min(above, key=lambda r: r["parameters"]) if above else None
        memory = "—"
        if best:
            rss = best.get("peak_rss_bytes")
            gpu = best.get("device_memory_bytes")
            memory = (f"{fmt(rss / GIB if rss else None, '.1f', ' GiB')} / "
                      f"{fmt(gpu / GIB if gpu else None, '.1f', ' GiB')}")
        why = "—"
        if first:
            why = first.get("status", "?") + (f": {first['error']}" if first.get("error") else "")
            why = why.replace("|", "\\|")[:160]
        out.append(f"| {system} | `{mode}` | {shape(best) if best else 'none'} | {memory} "
                   f"| {shape(first) if first else 'none tried'} | {why} |")
    micro = {r.get("micro_batch") for r in ladder}
    out.append("")
    out.append(f"Micro-batch {', '.join(str(m) for m in sorted(micro, key=str))}, context 1024, "
               f"{sorted({r.get('steps') for r in ladder}, key=str)[0]} timed steps after "
               f"{sorted({r.get('warmup') for r in ladder}, key=str)[0]} warm-up per attempt.")
    return out


def markdown(rows, ladder, svgs):
    models = sorted({m for (_, mode, m) in rows if mode != "cpu-adam" and m}, key=model_key)
    dates = sorted({r.get("run_date") for r in rows.values() if r.get("run_date")}
                   | {r.get("run_date") for r in ladder if r.get("run_date")})
    devices = sorted({r["device"] for r in rows.values() if r.get("device")})
    out = []
    if dates or devices:
        out += [f"Run date(s): {', '.join(dates) or 'not recorded'}; device: "
                f"{', '.join(devices) or 'not recorded'}.", ""]
    for model in models:
        out += [f"### `{model}`", "", describe_model(rows, model), ""]
        out += training_table(rows, model) + [""]
        out += ["Step breakdown and memory:", ""] + breakdown_table(rows, model) + [""]
    table = cpu_adam_table(rows)
    if table:
        out += ["### CPU AdamW", ""] + table + [""]
    table = ladder_table(ladder)
    if table:
        out += ["### Largest model that trains", ""] + table + [""]
    if svgs:
        out += ["Plots: " + ", ".join(f"![{name}]({path})" for name, path in svgs), ""]
    return "\n".join(out)


# --- SVG -----------------------------------------------------------------------------------------

def nice_max(value):
    """The smallest 1, 2, 4, 6 or 8 × 10^k at or above value: the top of an axis whose quarter
    ticks are round numbers."""
    if value <= 0:
        return 1.0
    scale = 1.0
    while scale * 10 < value:
        scale *= 10
    while scale >= value:
        scale /= 10
    for step in (1, 2, 4, 6, 8, 10):
        if step * scale >= value:
            return step * scale
    return 10 * scale


def svg_document(width, height, body, title):
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14" '
        f'font-weight="bold">{escape(title)}</text>',
        *body, "</svg>", ""])


def text(x, y, content, anchor="middle", size=12, **attrs):
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{extra}>'
            f"{escape(content)}</text>")


def axis(x0, y0, height, top, label, unit_format, width):
    """A y axis at x0 from y0 (bottom) up `height`, ticks at quarters of `top`, gridlines across
    `width`."""
    parts = [f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 - height}" stroke="black"/>']
    for i in range(5):
        value = top * i / 4
        y = y0 - height * i / 4
        parts.append(f'<line x1="{x0 - 4}" y1="{y:.1f}" x2="{x0}" y2="{y:.1f}" stroke="black"/>')
        if i:
            parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + width}" y2="{y:.1f}" '
                         f'stroke="#ddd"/>')
        parts.append(text(x0 - 6, y + 4, unit_format(value), anchor="end", size=10))
    parts.append(text(x0 - 46, y0 - height / 2, label, size=11,
                      transform=f"rotate(-90 {x0 - 46} {y0 - height / 2})"))
    return parts


def legend(x, y, entries):
    parts = []
    for i, (name, color) in enumerate(entries):
        parts.append(f'<rect x="{x}" y="{y + 18 * i}" width="12" height="12" fill="{color}"/>')
        parts.append(text(x + 18, y + 18 * i + 10, name, anchor="start", size=11))
    return parts


def tokens_svg(rows, models, machine):
    """Grouped bars: per model a panel; per mode a group; zeroflow and DeepSpeed side by side."""
    groups = [("gpu", "gpu", "gpu"), ("offload", "offload", "offload"),
              ("offload-delayed", "zenflow", "delayed / ZenFlow")]
    panel_w, panel_h, left, top_margin = 330, 260, 70, 60
    content = left + len(models) * (panel_w + left) + 10
    width = max(content, 620)
    shift = (width - content) / 2  # centres a lone panel under the title
    height = top_margin + panel_h + 90
    body = []
    for index, model in enumerate(models):
        x0 = shift + left + index * (panel_w + left)
        y0 = top_margin + panel_h
        values = [(rows.get(("zeroflow", ours, model)) or {}).get("tokens_per_s") for ours, _, _ in groups]
        values += [(rows.get(("deepspeed", theirs, model)) or {}).get("tokens_per_s")
                   for _, theirs, _ in groups]
        top = nice_max(max([v for v in values if v] or [1]))
        body += axis(x0, y0, panel_h, top, "tokens / s", lambda v: f"{v / 1000:g}k" if v else "0", panel_w)
        body.append(f'<line x1="{x0}" y1="{y0}" x2="{x0 + panel_w}" y2="{y0}" stroke="black"/>')
        body.append(text(x0 + panel_w / 2, top_margin - 12, model, size=13, font_weight="bold"))
        slot = panel_w / len(groups)
        bar = slot * 0.34
        for g, (ours, theirs, label) in enumerate(groups):
            cx = x0 + slot * (g + 0.5)
            a = (rows.get(("zeroflow", ours, model)) or {}).get("tokens_per_s")
            b = (rows.get(("deepspeed", theirs, model)) or {}).get("tokens_per_s")
            for offset, value, color in ((-bar, a, COLORS["zeroflow"]), (0, b, COLORS["deepspeed"])):
                if not value:
                    continue
                h = panel_h * value / top
                body.append(f'<rect x="{cx + offset:.1f}" y="{y0 - h:.1f}" width="{bar:.1f}" '
                            f'height="{h:.1f}" fill="{color}"><title>{value:,.0f} tokens/s'
                            f'</title></rect>')
                body.append(text(cx + offset + bar / 2, y0 - h - 4, f"{value:,.0f}", size=9))
            body.append(text(cx, y0 + 16, label, size=11))
            if a and b:
                body.append(text(cx, y0 + 32, f"{a / b:.2f}×", size=11, font_weight="bold"))
    body += legend(left + 10, height - 40, [("zeroflow", COLORS["zeroflow"]),
                                             ("DeepSpeed (last group: ZenFlow)", COLORS["deepspeed"])])
    return svg_document(width, height, body,
                        f"Training throughput, {machine}: zeroflow vs DeepSpeed (ratio below)")


def breakdown_svg(rows, models, machine):
    """Stacked bars: per model a panel; per zeroflow mode, forward + backward under the exposed
    optimizer, in seconds per step."""
    panel_w, panel_h, left, top_margin = 300, 260, 70, 60
    content = left + len(models) * (panel_w + left) + 10
    width = max(content, 620)
    shift = (width - content) / 2  # centres a lone panel under the title
    height = top_margin + panel_h + 80
    body = []
    for index, model in enumerate(models):
        x0 = shift + left + index * (panel_w + left)
        y0 = top_margin + panel_h
        present = [(mode, rows[("zeroflow", mode, model)]) for mode in ZF_MODES
                   if ("zeroflow", mode, model) in rows]
        totals = [(r.get("forward_backward_s_mean") or 0) + max(r.get("exposed_optimizer_s_mean") or 0, 0)
                  for _, r in present]
        top = nice_max(max(totals or [1]))
        body += axis(x0, y0, panel_h, top, "seconds per step", lambda v: f"{v:.2f}", panel_w)
        body.append(f'<line x1="{x0}" y1="{y0}" x2="{x0 + panel_w}" y2="{y0}" stroke="black"/>')
        body.append(text(x0 + panel_w / 2, top_margin - 12, model, size=13, font_weight="bold"))
        slot = panel_w / max(len(ZF_MODES), 1)
        bar = slot * 0.5
        for g, mode in enumerate(ZF_MODES):
            row = rows.get(("zeroflow", mode, model))
            cx = x0 + slot * (g + 0.5)
            body.append(text(cx, y0 + 16, mode, size=11))
            if not row:
                continue
            y = y0
            for part, key in (("fwd_bwd", "forward_backward_s_mean"),
                              ("optimizer", "exposed_optimizer_s_mean")):
                value = max(row.get(key) or 0, 0)
                h = panel_h * value / top
                y -= h
                body.append(f'<rect x="{cx - bar / 2:.1f}" y="{y:.1f}" width="{bar:.1f}" '
                            f'height="{h:.1f}" fill="{COLORS[part]}" stroke="white">'
                            f'<title>{value:.4f} s</title></rect>')
                if h > 14:
                    body.append(text(cx, y + h / 2 + 4, f"{value:.3f}",
                                     size=10, fill="white" if part == "fwd_bwd" else "black"))
            total = s_per_step(row)
            body.append(text(cx, y - 5, f"{total:.3f} s", size=10, font_weight="bold"))
    body += legend(left + 10, height - 40, [("forward + backward", COLORS["fwd_bwd"]),
                                             ("exposed optimizer / offload", COLORS["optimizer"])])
    return svg_document(width, height, body, f"zeroflow step breakdown, {machine} (mean s/step)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", nargs="+", help="result files (JSON lines)")
    parser.add_argument("--markdown", help="write the tables here instead of stdout")
    parser.add_argument("--svg-dir", help="write the plots into this folder")
    parser.add_argument("--prefix", default="bench", help="file name prefix of the plots")
    parser.add_argument("--machine", default="one H200", help="the machine, for the plots' titles")
    args = parser.parse_args()
    rows, ladder = load(args.jsonl)
    models = sorted({m for (s, mode, m) in rows
                     if mode in ZF_MODES + list(DS_NAMES) and m}, key=model_key)
    svgs = []
    if args.svg_dir and models:
        folder = Path(args.svg_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for name, document in (("tokens", tokens_svg(rows, models, args.machine)),
                               ("breakdown", breakdown_svg(rows, models, args.machine))):
            path = folder / f"{args.prefix}-{name}.svg"
            path.write_text(document)
            svgs.append((name, str(path)))
            print(f"wrote {path}", file=sys.stderr)
    report = markdown(rows, ladder, svgs)
    if args.markdown:
        Path(args.markdown).write_text(report + "\n")
        print(f"wrote {args.markdown}", file=sys.stderr)
    else:
        print(report)


if __name__ == "__main__":
    main()
