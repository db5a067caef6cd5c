#!/usr/bin/env python3
"""Overlays the loss curves of several `zeroflow train` runs in one SVG and prints a markdown
table comparing them.

    python3 scripts/plot-loss.py LABEL=PATH [LABEL=PATH ...] --svg OUT.svg \\
        [--title "..."] [--baseline LABEL] [--smooth N]

    python3 scripts/plot-loss.py adamw=runs/adamw/metrics.jsonl muon=runs/muon/metrics.jsonl \\
        --svg docs/bench/loss.svg --title "GPT-2 124M, 300 steps" --baseline adamw

Each positional argument is a label and a run's metrics.jsonl, split at the first '=' (a run
directory stands for its metrics.jsonl). The file's JSON lines with "loss" are training-loss points
and those with "eval_loss" evaluation points, each at its "step"; other keys are ignored, and
blank or unparsable lines are skipped with a warning on stderr. When a step is logged twice (a
resumed run), the later line wins.

The SVG shows, per run and in its own colour, the training loss as a thin polyline smoothed by a
trailing moving average over --smooth steps (1 = raw) and the eval loss as a thicker polyline with
markers. The table on stdout has per run: the last step logged, the last eval loss, the final
training loss (the mean over the last --smooth steps, i.e. the last point of the smoothed curve),
and the last eval loss divided by the baseline run's (--baseline, by default the first run); a
missing figure is a dash.

Exit status 0 on success, 2 on bad arguments or an unreadable input or unwritable output.
Standard library only; Python 3.8+."""

import argparse
import html
import json
import math
import pathlib
import sys

WIDTH, HEIGHT = 960, 420
# The legend sits in the right margin, clear of the curves.
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 66, 220, 44, 52
PALETTE = ["#1f6fb4", "#e07b28", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
MAX_POLYLINE_POINTS = 2000  # longer training curves are thinned (evenly, keeping the last point)
DASH = "—"  # as in scripts/bench-report.py


class Run:
    """One run: its label, the file it came from, and its training and eval points, each a list of
    (step, loss) sorted by step."""

    def __init__(self, label, path, train, evals):
        self.label = label
        self.path = path
        self.train = train
        self.evals = evals

    def last_step(self):
        steps = [points[-1][0] for points in (self.train, self.evals) if points]
        return max(steps) if steps else None

    def final_eval(self):
        return self.evals[-1][1] if self.evals else None


# --- input ---------------------------------------------------------------------------------------

def fail(message):
    print(f"plot-loss: {message}", file=sys.stderr)
    sys.exit(2)


def warn(message):
    print(f"plot-loss: warning: {message}", file=sys.stderr)


def parse_run_arg(arg):
    """'LABEL=PATH' → (label, path); a directory stands for its metrics.jsonl."""
    label, sep, path = arg.partition("=")
    if not sep or not label or not path:
        fail(f"expected LABEL=PATH, got {arg!r}")
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return label, path


def as_number(value):
    """value as a finite float, or None (bools, strings, null, NaN and infinities are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def read_points(path):
    """The (step → loss) maps of a metrics.jsonl: training loss and eval loss."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        fail(f"cannot read {path}: {err.strerror or err}")
    except UnicodeDecodeError as err:
        fail(f"cannot read {path}: not UTF-8 text ({err})")
    train, evals = {}, {}
    duplicates = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            warn(f"{path}:{number}: skipping unparsable line ({err})")
            continue
        if not isinstance(row, dict):
            warn(f"{path}:{number}: skipping a line that is not a JSON object")
            continue
        step = as_number(row.get("step"))
        if step is None:
            warn(f"{path}:{number}: skipping a line without a numeric step")
            continue
        for key, points in (("loss", train), ("eval_loss", evals)):
            if key not in row:
                continue
            value = as_number(row[key])
            if value is None:
                warn(f"{path}:{number}: skipping {key}={row[key]!r} (not a finite number)")
                continue
            duplicates += step in points
            points[step] = value
    if duplicates:
        warn(f"{path}: {duplicates} step(s) logged more than once; the later lines win")
    if not train and not evals:
        warn(f"{path}: no loss or eval_loss points")
    return train, evals


def load_run(label, path):
    train, evals = read_points(path)
    return Run(label, path, sorted(train.items()), sorted(evals.items()))


# --- numbers -------------------------------------------------------------------------------------

def smooth(points, window):
    """Trailing moving average: each point's value becomes the mean of the points whose step lies
    in (step - window, step]. window 1 leaves the points as they are."""
    out = []
    total, start = 0.0, 0
    for i, (step, value) in enumerate(points):
        total += value
        while points[start][0] <= step - window:
            total -= points[start][1]
            start += 1
        out.append((step, total / (i + 1 - start)))
    return out


def fmt(value, decimals):
    return DASH if value is None else f"{value:.{decimals}f}"


def fmt_step(step):
    if step is None:
        return DASH
    return str(int(step)) if step == int(step) else f"{step:g}"


def markdown_cell(text):
    return text.replace("|", "\\|")


def table(runs, baseline, window):
    """The markdown comparison table, one row per run in the order given."""
    base_eval = baseline.final_eval()
    last = "last step" if window == 1 else f"mean of last {window} steps"
    lines = [
        f"| run | steps | final eval loss | final train loss ({last}) "
        f"| eval ÷ baseline ({markdown_cell(baseline.label)}) |",
        "|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        final_train = smooth(run.train, window)[-1][1] if run.train else None
        final_eval = run.final_eval()
        ratio = final_eval / base_eval if final_eval is not None and base_eval else None
        lines.append(f"| {markdown_cell(run.label)} | {fmt_step(run.last_step())} "
                     f"| {fmt(final_eval, 4)} | {fmt(final_train, 4)} | {fmt(ratio, 3)} |")
    return "\n".join(lines)


# --- axes ----------------------------------------------------------------------------------------

def nice_step(span, target=5):
    """A round tick spacing (1, 2, 2.5 or 5 × 10^k) giving about `target` ticks over span."""
    raw = span / target
    magnitude = 10.0 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 2.5, 5, 10):
        if multiple * magnitude >= raw * 0.999:
            return multiple * magnitude
    return 10 * magnitude


def ticks(lo, hi, step):
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [i * step for i in range(first, last + 1)]


def tick_decimals(step):
    """Decimals enough to print multiples of step exactly (0.25 → 2, 5 → 0)."""
    for decimals in range(10):
        if abs(round(step, decimals) - step) <= 1e-9 * step:
            return decimals
    return 10


def padded_range(values, fraction, minimum=None):
    """(lo, hi) of values widened by fraction of their span on each side (never below minimum);
    a single value gets a range around it."""
    lo, hi = min(values), max(values)
    span = hi - lo
    if span == 0:
        span = abs(hi) * 0.1 or 1.0
        lo, hi = lo - span / 2, hi + span / 2
        span = hi - lo
    lo, hi = lo - span * fraction, hi + span * fraction
    if minimum is not None:
        lo = max(lo, minimum)
    return lo, hi


class Panel:
    """Maps (step, loss) to SVG coordinates inside the plot area."""

    def __init__(self, x_range, y_range):
        self.x_lo, self.x_hi = x_range
        self.y_lo, self.y_hi = y_range
        self.left, self.right = MARGIN_LEFT, WIDTH - MARGIN_RIGHT
        self.top, self.bottom = MARGIN_TOP, HEIGHT - MARGIN_BOTTOM

    def x(self, step):
        return self.left + (step - self.x_lo) / (self.x_hi - self.x_lo) * (self.right - self.left)

    def y(self, loss):
        return self.bottom - (loss - self.y_lo) / (self.y_hi - self.y_lo) * (self.bottom - self.top)


def panel_for(series):
    """A panel whose ranges cover every plotted point, with a little padding."""
    steps = [step for points in series for step, _ in points]
    losses = [loss for points in series for _, loss in points]
    if not steps:
        return Panel((0.0, 1.0), (0.0, 1.0))
    return Panel(padded_range(steps, 0.02, minimum=min(0.0, min(steps))),
                 padded_range(losses, 0.06))


# --- SVG -----------------------------------------------------------------------------------------

def text(x, y, content, anchor="middle", size=12, **attrs):
    extra = "".join(f' {key.replace("_", "-")}="{html.escape(str(value))}"'
                    for key, value in attrs.items())
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}"{extra}>'
            f"{html.escape(content)}</text>")


def x_axis(panel):
    step = max(nice_step(panel.x_hi - panel.x_lo), 1.0)  # steps are whole numbers
    decimals = tick_decimals(step)
    parts = []
    for value in ticks(panel.x_lo, panel.x_hi, step):
        x = panel.x(value)
        parts.append(f'<line x1="{x:.1f}" y1="{panel.top}" x2="{x:.1f}" y2="{panel.bottom}" '
                     f'stroke="#e3e3e3"/>')
        parts.append(f'<line x1="{x:.1f}" y1="{panel.bottom}" x2="{x:.1f}" '
                     f'y2="{panel.bottom + 4}" stroke="black"/>')
        parts.append(text(x, panel.bottom + 17, f"{value:.{decimals}f}", size=10))
    parts.append(text((panel.left + panel.right) / 2, HEIGHT - 12, "step", size=12))
    return parts


def y_axis(panel):
    step = nice_step(panel.y_hi - panel.y_lo)
    decimals = tick_decimals(step)
    parts = []
    for value in ticks(panel.y_lo, panel.y_hi, step):
        y = panel.y(value)
        parts.append(f'<line x1="{panel.left}" y1="{y:.1f}" x2="{panel.right}" y2="{y:.1f}" '
                     f'stroke="#e3e3e3"/>')
        parts.append(f'<line x1="{panel.left - 4}" y1="{y:.1f}" x2="{panel.left}" y2="{y:.1f}" '
                     f'stroke="black"/>')
        parts.append(text(panel.left - 7, y + 3.5, f"{value:.{decimals}f}", anchor="end",
                          size=10))
    middle = (panel.top + panel.bottom) / 2
    parts.append(text(18, middle, "loss", size=12, transform=f"rotate(-90 18 {middle})"))
    return parts


def frame(panel):
    return [f'<rect x="{panel.left}" y="{panel.top}" width="{panel.right - panel.left}" '
            f'height="{panel.bottom - panel.top}" fill="none" stroke="black"/>']


def thin(points, limit=MAX_POLYLINE_POINTS):
    """At most about `limit` evenly spaced points, always keeping the last."""
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    kept = points[::stride]
    return kept if kept[-1] == points[-1] else kept + [points[-1]]


def polyline(panel, points, color, width, opacity):
    coords = " ".join(f"{panel.x(step):.1f},{panel.y(loss):.1f}" for step, loss in points)
    return (f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="{width}" '
            f'stroke-opacity="{opacity}" stroke-linejoin="round"/>')


def train_curve(panel, points, color):
    return [polyline(panel, thin(points), color, 1.2, 0.6)]


def eval_curve(panel, points, color):
    parts = [polyline(panel, points, color, 2.2, 1)]
    parts += [f'<circle cx="{panel.x(step):.1f}" cy="{panel.y(loss):.1f}" r="3.2" fill="{color}" '
              f'stroke="white" stroke-width="0.8"/>' for step, loss in points]
    return parts


def legend(panel, entries):
    """A box right of the panel's top: (name, colour, kind) with kind 'train' or 'eval'."""
    if not entries:
        return []
    row, sample = 17, 26
    width = sample + 16 + max(len(name) for name, _, _ in entries) * 6.4
    height = row * len(entries) + 8
    x0, y0 = panel.right + 12, panel.top
    parts = [f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{width:.1f}" height="{height}" '
             f'fill="white" fill-opacity="0.85" stroke="#bbb"/>']
    for i, (name, color, kind) in enumerate(entries):
        y = y0 + 4 + row * i + row / 2
        x1, x2 = x0 + 8, x0 + 8 + sample
        if kind == "train":
            parts.append(f'<line x1="{x1:.1f}" y1="{y:.1f}" x2="{x2:.1f}" y2="{y:.1f}" '
                         f'stroke="{color}" stroke-width="1.2" stroke-opacity="0.6"/>')
        else:
            parts.append(f'<line x1="{x1:.1f}" y1="{y:.1f}" x2="{x2:.1f}" y2="{y:.1f}" '
                         f'stroke="{color}" stroke-width="2.2"/>')
            parts.append(f'<circle cx="{(x1 + x2) / 2:.1f}" cy="{y:.1f}" r="3.2" '
                         f'fill="{color}" stroke="white" stroke-width="0.8"/>')
        parts.append(text(x2 + 6, y + 4, name, anchor="start", size=11))
    return parts


def svg(runs, window, title):
    """The whole SVG document: axes, one smoothed training curve and one eval curve per run."""
    colors = [PALETTE[i % len(PALETTE)] for i in range(len(runs))]
    smoothed = [smooth(run.train, window) for run in runs]
    panel = panel_for(smoothed + [run.evals for run in runs])
    raw_or_smoothed = "raw" if window == 1 else "smoothed"
    curves, entries = [], []
    for run, color, train in zip(runs, colors, smoothed):
        if train:
            curves += train_curve(panel, train, color)
            entries.append((f"{run.label} train ({raw_or_smoothed})", color, "train"))
        if run.evals:
            curves += eval_curve(panel, run.evals, color)
            entries.append((f"{run.label} eval", color, "eval"))
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f"<title>{html.escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        text(WIDTH / 2, 26, title, size=14, font_weight="bold"),
        *x_axis(panel), *y_axis(panel), *frame(panel), *curves, *legend(panel, entries),
        "</svg>", ""])


# --- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="plot-loss.py",
        description="Overlay the loss curves of zeroflow train runs in one SVG and print a "
                    "markdown comparison table.")
    parser.add_argument("runs", nargs="+", metavar="LABEL=PATH",
                        help="a run's label and its metrics.jsonl (or run directory)")
    parser.add_argument("--svg", required=True, metavar="OUT.svg", help="write the plot here")
    parser.add_argument("--title", help="the plot's title (default: the labels)")
    parser.add_argument("--baseline", metavar="LABEL",
                        help="the run the eval ratios are against (default: the first run)")
    parser.add_argument("--smooth", type=int, default=20, metavar="N",
                        help="moving-average window of the training loss, in steps "
                             "(default 20; 1 = raw)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.smooth < 1:
        fail(f"--smooth must be at least 1, got {args.smooth}")
    specs = [parse_run_arg(arg) for arg in args.runs]
    labels = [label for label, _ in specs]
    for label in labels:
        if labels.count(label) > 1:
            fail(f"label {label!r} is given more than once")
    baseline_label = args.baseline if args.baseline is not None else labels[0]
    if baseline_label not in labels:
        fail(f"--baseline {baseline_label!r} is not one of the labels: {', '.join(labels)}")
    runs = [load_run(label, path) for label, path in specs]
    baseline = runs[labels.index(baseline_label)]
    if baseline.final_eval() is None:
        warn(f"baseline {baseline_label!r} has no eval points; the ratios are dashes")

    title = args.title if args.title is not None else "loss: " + ", ".join(labels)
    out = pathlib.Path(args.svg)
    try:
        out.write_text(svg(runs, args.smooth, title), encoding="utf-8")
    except OSError as err:
        fail(f"cannot write {out}: {err.strerror or err}")
    print(table(runs, baseline, args.smooth))


if __name__ == "__main__":
    main()
