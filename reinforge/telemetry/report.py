"""`reinforge report`: one self-contained HTML page (plus PNGs) that explains
one or several run directories side by side.

It reads only what a run directory holds (config.yaml, metrics.jsonl,
summary.json, alerts.jsonl), so it works on a run that is still going (no
summary.json yet) and on a run that stopped after SFT. Every plot overlays
all runs; a metric no run logged gets no plot, and the page says why.

Plots are drawn with matplotlib's object API on an Agg canvas (no pyplot),
so making a report never touches the global backend of the caller.
"""

from __future__ import annotations

import html
import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

FIGSIZE = (7.0, 4.0)   # inches: readable on a laptop screen without zooming
DPI = 110
SMOOTH_MIN_POINTS = 20  # shorter series are drawn raw; smoothing a handful of points only hides them


@dataclass
class RunData:
    """What the report reads from one run directory."""

    path: Path
    label: str                      # unique among the runs of one report
    recipe: str | None
    seed: int | None
    config: dict                    # config.yaml, {} when absent
    records: list[dict]             # metrics.jsonl lines (a torn last line is dropped)
    summary: dict | None            # summary.json; None while the run is going or after it failed
    alerts: list[dict] = field(default_factory=list)

    @property
    def rl_steps(self) -> int:
        if self.summary is not None:
            return int(self.summary.get("rl_steps", 0))
        return max((r["step"] for r in self.records if r.get("stage") == "rl" and "step" in r), default=0)

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of `key` over the RL and eval lines, in step order; nulls skipped.

        Held-out keys (eval/...) fall back to the summary's start (step 0) and
        final (last step) evaluation when no line carries them.
        """
        by_step: dict[int, float] = {}
        for stage in ("rl", "eval"):          # an eval line wins over an RL line of the same step
            for r in self.records:
                if r.get("stage") == stage and "step" in r and _finite(r.get(key)):
                    by_step[int(r["step"])] = float(r[key])
        if not by_step and key.startswith("eval/") and self.summary is not None:
            name = key.removeprefix("eval/")
            ends = self.summary.get("eval", {})
            for step, stage in ((0, "start"), (self.rl_steps, "final")):
                if _finite(ends.get(stage, {}).get(name)):
                    by_step[step] = float(ends[stage][name])
        return sorted(by_step.items())


@dataclass(frozen=True)
class PlotSpec:
    """One plot: the metric keys drawn on it, each with its legend name and line style."""

    name: str
    title: str
    ylabel: str
    keys: tuple[tuple[str, str, str], ...]   # (metric key, legend name, line style)
    missing: str                             # why the plot can be absent, for the page
    smooth: bool = True
    logy: bool = False
    zero_based: bool = False
    ceiling: str | None = None               # config key of a limit drawn as a dotted line (rollout.max_new_tokens)
    note: str = ""                           # what a reader should know to read the plot, for the caption


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Train reward", "mean reward of the step's samples", (("reward_mean", "", "-"),),
             "no run logged reward_mean (no RL step has finished)", zero_based=True),
    PlotSpec("heldout", "Held-out accuracy", "accuracy on held-out prompts",
             (("eval/pass@1", "pass@1", "-"), ("eval/greedy_accuracy", "greedy", "--")),
             "no run has a held-out evaluation yet", smooth=False, zero_based=True,
             note="Step 0 is the start-of-RL evaluation and the last step the final one (from summary.json when "
                  "metrics.jsonl has no eval lines); points between come from eval.every, on the first "
                  "eval.every_prompts prompts when that is set, so they can be on fewer prompts than the ends."),
    PlotSpec("entropy", "Token entropy of the samples", "mean entropy (nats)", (("entropy", "", "-"),),
             "no run logged entropy"),
    PlotSpec("length", "Response length", "tokens",
             (("response_length_mean", "all", "-"), ("response_length_correct_mean", "correct", "--"),
              ("response_length_incorrect_mean", "incorrect", ":")),
             "no run logged response_length_mean", zero_based=True, ceiling="rollout.max_new_tokens"),
    PlotSpec("clip_frac", "Clipped fraction of tokens", "fraction", (("clip_frac", "", "-"),),
             "no run logged clip_frac", zero_based=True),
    PlotSpec("kl", "KL to the reference model", "KL estimate", (("kl", "", "-"),),
             "no run logged kl: the recipes of these runs have no KL term"),
    PlotSpec("mismatch", "Sampler-learner mismatch", "KL(sampler || learner), per token", (("mismatch_kl", "", "-"),),
             "no run logged mismatch_kl", logy=True,
             note="How far the sampler's token probabilities are from the learner's for the same weights: "
                  "float noise (1e-10 and below) when both are the same engine and precision; large values are "
                  "what importance-sampling corrections are for."),
)


def write_report(run_dirs: list[Path], out_dir: Path) -> Path:
    """Write out_dir/report.html and its PNGs (out_dir/report-*.png); return the HTML path."""
    if not run_dirs:
        raise ValueError("write_report needs at least one run directory")
    runs = load_runs(run_dirs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("report-*.png"):   # a plot skipped this time must not linger from the last report
        old.unlink()
    figures: list[tuple[str, str, str]] = []     # (file name, title, caption)
    skipped: list[tuple[str, str]] = []          # (title, reason)
    for spec in PLOTS:
        caption = _plot_series(spec, runs, out_dir / f"report-{spec.name}.png")
        if caption is None:
            skipped.append((spec.title, spec.missing))
        else:
            figures.append((f"report-{spec.name}.png", spec.title, caption))
    if _plot_pass_at_k(runs, out_dir / "report-pass_at_k.png"):
        figures.append(("report-pass_at_k.png", "pass@k of the start and final model", PASS_AT_K_CAPTION))
    else:
        skipped.append(("pass@k of the start and final model",
                        "no run has finished: summary.json holds the start and final pass@k"))
    path = out_dir / "report.html"
    path.write_text(_html(runs, figures, skipped))
    return path


# ---------------------------------------------------------------------------
# Reading run directories


def load_runs(run_dirs: Iterable[Path]) -> list[RunData]:
    runs = [_load_run(Path(p)) for p in run_dirs]
    _unique_labels(runs)
    return runs


def _load_run(path: Path) -> RunData:
    config_path = path / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) or {}) if config_path.is_file() else {}
    summary_path = path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    recipe = config.get("recipe", (summary or {}).get("recipe"))
    seed = config.get("seed", (summary or {}).get("seed"))
    label = f"{recipe} seed {seed}" if recipe is not None and seed is not None else path.name
    return RunData(path=path, label=label, recipe=recipe, seed=seed, config=config,
                   records=_read_jsonl(path / "metrics.jsonl"), summary=summary,
                   alerts=_read_jsonl(path / "alerts.jsonl"))


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:   # the line a live run is writing right now
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _unique_labels(runs: list[RunData]) -> None:
    """`<recipe> seed <seed>` where that names one run; else the folder name (then its parent, then a number)."""
    def clashing() -> set[str]:
        labels = [r.label for r in runs]
        return {x for x in labels if labels.count(x) > 1}

    for rename in (lambda r: r.path.name, lambda r: f"{r.path.parent.name}/{r.path.name}"):
        same = clashing()
        for r in runs:
            if r.label in same:
                r.label = rename(r)
    same = clashing()
    for i, r in enumerate(runs):
        if r.label in same:
            r.label = f"{r.label} #{i + 1}"


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------
# Plots


PASS_AT_K_CAPTION = (
    "Dashed: the model at the start of RL; solid: after RL (same held-out prompts and samples). "
    "RL that only sharpens the distribution raises pass@1 but can lower pass@k at large k, so the "
    "curves cross (Yue et al. 2025, arXiv:2504.13837); a final curve above the start at every k "
    "means RL found answers the start model did not sample."
)


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    return fig, ax


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _widths(n: int) -> list[float]:
    """Line widths from thick (first run) to thin (last), so a run whose curve equals another's still shows."""
    return [1.6 + 1.6 * (n - 1 - i) / (n - 1) if n > 1 else 1.8 for i in range(n)]


def _moving_average(values: list[float], window: int) -> list[float]:
    """Centred mean over `window` points, the window shrinking at both ends."""
    half = window // 2
    return [sum(values[max(0, i - half):i + half + 1]) / len(values[max(0, i - half):i + half + 1])
            for i in range(len(values))]


def _plot_series(spec: PlotSpec, runs: list[RunData], path: Path) -> str | None:
    """Draw one PlotSpec; None (and no file) when no run has any of its keys."""
    data = {(i, key): runs[i].series(key) for i in range(len(runs)) for key, _, _ in spec.keys}
    if not any(data.values()):
        return None
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    longest = max(len(s) for s in data.values())
    window = max(3, longest // 10) | 1 if spec.smooth and longest >= SMOOTH_MIN_POINTS else 1
    fig, ax = _figure()
    colors, widths = _colors(len(runs)), _widths(len(runs))
    for (i, key), points in data.items():
        if not points:
            continue
        style = next(ls for k, _, ls in spec.keys if k == key)
        steps, ys = [s for s, _ in points], [v for _, v in points]
        if window > 1 and len(points) >= SMOOTH_MIN_POINTS:
            ax.plot(steps, ys, color=colors[i], linestyle=style, linewidth=0.8, alpha=0.3)
            ax.plot(steps, _moving_average(ys, window), color=colors[i], linestyle=style, linewidth=widths[i])
        else:
            ax.plot(steps, ys, color=colors[i], linestyle=style, linewidth=widths[i], marker="o", markersize=3)
    handles = [Line2D([], [], color=colors[i], linewidth=2, label=r.label)
               for i, r in enumerate(runs) if any(data[(i, k)] for k, _, _ in spec.keys)]
    present = [(name, ls) for key, name, ls in spec.keys if any(data[(i, key)] for i in range(len(runs)))]
    if len(present) > 1:
        handles += [Line2D([], [], color="0.35", linestyle=ls, linewidth=1.6, label=name) for name, ls in present]
    values = [v for s in data.values() for _, v in s]
    if spec.ceiling is not None:
        limits = sorted({float(v) for r in runs if _finite(v := flatten(r.config).get(spec.ceiling))})
        for limit in limits:
            ax.axhline(limit, color="0.5", linestyle=(0, (1, 3)), linewidth=1.0)
        if limits:
            handles.append(Line2D([], [], color="0.5", linestyle=(0, (1, 3)), label=spec.ceiling))
            values += limits
    if spec.logy and all(v > 0 for v in values):
        ax.set_yscale("log")
    elif spec.zero_based and all(v >= 0 for v in values):
        ax.set_ylim(0, max(values) * 1.08 or 1.0)   # headroom above the highest point (or a flat zero line)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("RL step")
    ax.set_ylabel(spec.ylabel)
    ax.set_title(spec.title)
    _legend(ax, handles)
    fig.savefig(path, bbox_inches="tight")
    keys = ", ".join(f"<code>{html.escape(k)}</code>" for k, _, _ in spec.keys if any(data[(i, k)] for i in range(len(runs))))
    smoothing = (f" Bold lines are a centred moving average over {window} steps; the faint lines are the raw values."
                 if window > 1 else "")
    return f"Metric: {keys}.{smoothing} {html.escape(spec.note)}".rstrip()


def _plot_pass_at_k(runs: list[RunData], path: Path) -> bool:
    finished = [(i, r) for i, r in enumerate(runs) if r.summary is not None and "eval" in r.summary]
    if not finished:
        return False
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator

    fig, ax = _figure()
    colors, widths = _colors(len(runs)), _widths(len(runs))
    ks: set[int] = set()
    handles = []
    for i, r in finished:
        for stage, style, marker in (("start", "--", "o"), ("final", "-", "s")):
            curve = sorted((int(k), v) for k, v in r.summary["eval"].get(stage, {}).get("pass@k", {}).items() if _finite(v))
            ks.update(k for k, _ in curve)
            ax.plot([k for k, _ in curve], [v for _, v in curve], color=colors[i], linestyle=style,
                    marker=marker, markersize=4, linewidth=widths[i], fillstyle="none" if stage == "start" else "full")
        handles.append(Line2D([], [], color=colors[i], linewidth=2, label=r.label))
    handles += [Line2D([], [], color="0.35", linestyle="--", marker="o", fillstyle="none", label="start of RL"),
                Line2D([], [], color="0.35", linestyle="-", marker="s", label="after RL")]
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(ks)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(k) for k in sorted(ks)])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("k (samples per held-out prompt)")
    ax.set_ylabel("pass@k")
    ax.set_title("pass@k of the start and final model")
    _legend(ax, handles)
    fig.savefig(path, bbox_inches="tight")
    return True


def _legend(ax, handles: list) -> None:
    # Outside the axes, on the right: a legend never covers a curve (bbox_inches="tight" widens the image).
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


# ---------------------------------------------------------------------------
# HTML


def fmt(value: object) -> str:
    """A number as the report and the sweep table print it."""
    return f"{value:.3f}" if _finite(value) else "n/a"


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; }
figcaption { font-size: 0.85em; color: #555; max-width: 800px; }
code { font-size: 0.9em; }
"""


def _table(header: list[str], rows: list[list[str]], numeric_from: int = 99) -> str:
    """Cells are escaped here, so callers pass plain text."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td{' class=num' if j >= numeric_from else ''}>{html.escape(c)}</td>" for j, c in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def run_table(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the table of runs (plain strings, numbers via fmt)."""
    ks = sorted({int(k) for r in runs if r.summary for k in r.summary.get("eval", {}).get("final", {}).get("pass@k", {})} - {1})
    header = ["run", "recipe", "seed", "RL steps", "status", "start pass@1", "final pass@1",
              "start greedy", "final greedy", *(f"final pass@{k}" for k in ks)]
    rows = []
    for r in runs:
        cells = [r.label, str(r.recipe or "?"), str(r.seed if r.seed is not None else "?"), str(r.rl_steps)]
        stopped = next((x for x in r.records if x.get("stage") == "stopped"), None)
        if r.summary is None:
            status = "running" if r.rl_steps > 0 or not r.records else "running (SFT)"
            if stopped is not None:     # a guard ended it (the reason is in metrics.jsonl)
                status = f"stopped at step {stopped.get('step')}"
            cells += [status, *["running"] * (4 + len(ks))]
        else:
            ev = r.summary.get("eval", {})
            start, final = ev.get("start", {}), ev.get("final", {})
            cells += ["done", fmt(start.get("pass@1")), fmt(final.get("pass@1")), fmt(start.get("greedy_accuracy")),
                      fmt(final.get("greedy_accuracy")), *(fmt(final.get("pass@k", {}).get(str(k))) for k in ks)]
        rows.append(cells)
    return header, rows


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{'a': {'b': 1}} -> {'a.b': 1}: config keys as overrides spell them."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _differing_settings(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    flat = [flatten(r.config) for r in runs]
    keys = sorted({k for f in flat for k in f} - {"output_dir"})
    differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1]
    rows = [[r.label, *(str(f.get(k, "-")) for k in differ)] for r, f in zip(runs, flat, strict=True)]
    return ["run", *differ], rows


def _html(runs: list[RunData], figures: list[tuple[str, str, str]], skipped: list[tuple[str, str]]) -> str:
    header, rows = run_table(runs)
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>reinforge report: {html.escape(', '.join(r.label for r in runs))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>reinforge report</h1>",
        f"<p>{len(runs)} run{'s' if len(runs) != 1 else ''}, written {time.strftime('%Y-%m-%d %H:%M:%S')}. "
        "Held-out numbers are from summary.json (the start and final evaluation); "
        "\"running\": the run has no summary.json yet.</p>",
        "<h2>Runs</h2>", _table(header, rows, numeric_from=5),
        "<p>Run directories: " + ", ".join(f"<code>{html.escape(r.label)}</code>: {html.escape(str(r.path))}" for r in runs) + "</p>",
    ]
    if len(runs) > 1:
        diff_header, diff_rows = _differing_settings(runs)
        parts.append("<h2>Settings that differ</h2>")
        parts.append(_table(diff_header, diff_rows) if len(diff_header) > 1 else "<p>none: the runs share every setting</p>")
    parts.append("<h2>Plots</h2>")
    for name, title, caption in figures:
        parts.append(f'<figure><img src="{html.escape(name)}" alt="{html.escape(title)}">'
                     f"<figcaption>{caption}</figcaption></figure>")
    if skipped:
        parts.append("<h3>Skipped plots</h3><ul>")
        parts += [f"<li><b>{html.escape(title)}</b>: skipped, {html.escape(reason)}.</li>" for title, reason in skipped]
        parts.append("</ul>")
    parts.append("<h2>Alerts</h2>")
    for r in runs:
        parts.append(f"<h3>{html.escape(r.label)}</h3>")
        if r.alerts:
            parts.append(_table(["step", "alert", "message"],
                                [[str(a.get("step", "?")), str(a.get("alert", "?")), str(a.get("message", ""))] for a in r.alerts]))
        else:
            parts.append("<p>no alerts</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
