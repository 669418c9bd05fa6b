"""`reinforge report`: one self-contained HTML page (plus PNGs) that explains
one or several run directories side by side.

It reads only what a run directory holds (config.yaml, metrics.jsonl,
summary.json, alerts.jsonl, samples.jsonl), so it works on a run that is
still going (no summary.json yet) and on a run that stopped after SFT. Every
plot overlays all runs (telemetry/report_plots.py); a metric no run logged
gets no plot, and the page says why. The last samples each run logged show
what its model writes.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path

from reinforge.telemetry.report_plots import (
    PASS_AT_BUDGET_CAPTION,
    PASS_AT_K_CAPTION,
    PLOTS,
    SFT_CAPTION,
    flatten,
    plot_pass_at_budget,
    plot_pass_at_k,
    plot_series,
    plot_sft_loss,
)
from reinforge.telemetry.run_data import RunData, load_runs
from reinforge.telemetry.run_data import finite as _finite


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
        caption = plot_series(spec, runs, out_dir / f"report-{spec.name}.png")
        if caption is None:
            skipped.append((spec.title, spec.missing))
        else:
            figures.append((f"report-{spec.name}.png", spec.title, caption))
    if plot_sft_loss(runs, out_dir / "report-sft_loss.png"):
        figures.append(("report-sft_loss.png", "SFT loss", SFT_CAPTION))
    else:
        skipped.append(("SFT loss", "no run logged a per-step SFT loss (SFT off, or a run from before it was logged)"))
    if plot_pass_at_k(runs, out_dir / "report-pass_at_k.png"):
        figures.append(("report-pass_at_k.png", "pass@k of the start and final model", PASS_AT_K_CAPTION))
    else:
        skipped.append(("pass@k of the start and final model",
                        "no run has finished: summary.json holds the start and final pass@k"))
    if plot_pass_at_budget(runs, out_dir / "report-pass_at_budget.png"):
        figures.append(("report-pass_at_budget.png", "pass@1 within a token budget", PASS_AT_BUDGET_CAPTION))
    path = out_dir / "report.html"
    path.write_text(_html(runs, figures, skipped))
    return path


# ---------------------------------------------------------------------------
# HTML


def _completion(sample: dict) -> str:
    """A sample's completion; for a multi-turn episode its conversation after the opening, each turn with
    its role ("[assistant] ... [tool] ... [assistant] ...")."""
    trajectory = sample.get("trajectory")
    if not trajectory:
        return str(sample.get("completion", ""))
    opening = next((i for i, m in enumerate(trajectory) if m.get("role") == "assistant"), len(trajectory))
    return " ".join(f"[{m.get('role')}] {m.get('content')}" for m in trajectory[opening:])


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
table.settings td { max-width: 28em; overflow-wrap: anywhere; }
"""


def _table(header: list[str], rows: list[list[str]], numeric_from: int = 99) -> str:
    """Cells are escaped here, so callers pass plain text."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=num' if j >= numeric_from else ''}>{html.escape(c)}</td>" for j, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def run_table(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the table of runs (plain strings, numbers via fmt)."""
    ks = sorted(
        {int(k) for r in runs if r.summary for k in r.summary.get("eval", {}).get("final", {}).get("pass@k", {})} - {1}
    )
    header = ["run", "recipe", "seed", "RL steps", "status", "start pass@1", "final pass@1",
              "start greedy", "final greedy", *(f"final pass@{k}" for k in ks)]
    rows = []
    for r in runs:
        cells = [r.label, str(r.recipe or "?"), str(r.seed if r.seed is not None else "?"), str(r.rl_steps)]
        if r.summary is None:
            cells += [run_status(r), *["running"] * (4 + len(ks))]
        else:
            ev = r.summary.get("eval", {})
            start, final = ev.get("start", {}), ev.get("final", {})
            done = "done" if not r.summary.get("rl_stopped") else f"done (RL ended early, at step {r.rl_steps})"
            cells += [done, fmt(start.get("pass@1")), fmt(final.get("pass@1")), fmt(start.get("greedy_accuracy")),
                      fmt(final.get("greedy_accuracy")), *(fmt(final.get("pass@k", {}).get(str(k))) for k in ks)]
        rows.append(cells)
    return header, rows


def run_status(r: RunData) -> str:
    """The status of a run without summary.json: running, or why it ended (metrics.jsonl's last word on it)."""
    status = "running" if r.rl_steps > 0 or not r.records else "running (SFT)"
    for x in r.records:
        stage = x.get("stage")
        if stage == "stopped":          # a guard ended it, or RL could not train a step
            status = f"stopped: {x.get('reason')}"
        elif stage == "failed":         # a reward function raised (RUN_DIR/error.log), the watchdog, weight sync
            status = f"failed in step {r.rl_steps + 1}"
        elif stage == "interrupted":    # SIGINT / SIGTERM: saved, resumable
            status = f"interrupted at step {x.get('step')}"
    return status


# A setting's value longer than this is cut in the table (the whole value shows on hover).
SETTING_CHARS = 80


def setting_text(key: str, value: object) -> str:
    """A config value as the table of differing settings shows it: reward functions by name or import path
    (with their weight and parameters), other lists and mappings as JSON, None as null."""
    if key == "reward.functions" and isinstance(value, list):
        return ", ".join(_reward_text(f) for f in value) or "none"
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def _reward_text(function: object) -> str:
    if not isinstance(function, dict):
        return str(function)
    text = str(function.get("name")).removeprefix("reinforge.rewards.user:")     # a notebook's function: its name
    params = function.get("params") or {}
    if params:
        text += "(" + ", ".join(f"{k}={json.dumps(v, default=str)}" for k, v in params.items()) + ")"
    if function.get("weight", 1.0) != 1.0:
        text = f"{function['weight']:g} × {text}"
    if function.get("domains"):
        text += f" on {', '.join(map(str, function['domains']))}"
    return text


def _differing_settings(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    """One row per setting that differs, one column per run (a few runs side by side, however many settings)."""
    flat = [flatten(r.config) for r in runs]
    keys = sorted({k for f in flat for k in f} - {"output_dir"})
    differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1]
    rows = [[k, *(setting_text(k, f[k]) if k in f else "-" for f in flat)] for k in differ]
    return ["setting", *(r.label for r in runs)], rows


def _settings_table(header: list[str], rows: list[list[str]]) -> str:
    """The differing settings: long values cut to SETTING_CHARS (whole in the cell's tooltip) and wrapped."""
    def cell(text: str) -> str:
        shown = text if len(text) <= SETTING_CHARS else text[: SETTING_CHARS - 1] + "…"
        title = f' title="{html.escape(text)}"' if shown != text else ""
        return f"<td{title}>{html.escape(shown)}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in rows)
    return f'<table class="settings"><tr>{head}</tr>{body}</table>'


def _html(runs: list[RunData], figures: list[tuple[str, str, str]], skipped: list[tuple[str, str]]) -> str:
    header, rows = run_table(runs)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>reinforge report: {html.escape(', '.join(r.label for r in runs))}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>reinforge report</h1>",
        f"<p>{len(runs)} run{'s' if len(runs) != 1 else ''}, written {time.strftime('%Y-%m-%d %H:%M:%S')}. "
        "Held-out numbers are from summary.json (the start and final evaluation); "
        '"running": the run has no summary.json yet.</p>',
        "<h2>Runs</h2>",
        _table(header, rows, numeric_from=5),
        "<p>Run directories: "
        + ", ".join(f"<code>{html.escape(r.label)}</code>: {html.escape(str(r.path))}" for r in runs)
        + "</p>",
    ]
    if len(runs) > 1:
        diff_header, diff_rows = _differing_settings(runs)
        parts.append("<h2>Settings that differ</h2>")
        parts.append(
            _settings_table(diff_header, diff_rows) if diff_rows else "<p>none: the runs share every setting</p>"
        )
    parts.append("<h2>Plots</h2>")
    for name, title, caption in figures:
        parts.append(f'<figure><img src="{html.escape(name)}" alt="{html.escape(title)}">'
                     f"<figcaption>{caption}</figcaption></figure>")
    if skipped:
        parts.append("<h3>Skipped plots</h3><ul>")
        parts += [f"<li><b>{html.escape(title)}</b>: skipped, {html.escape(reason)}.</li>" for title, reason in skipped]
        parts.append("</ul>")
    parts.append("<h2>Samples</h2>")
    parts.append("<p>What the model wrote at the last step that logged samples (RUN_DIR/samples.jsonl, every "
                 "<code>log.samples_every</code> steps and at the last step): each reward function's value, the total "
                 "reward and the advantage (null: a reward function raised or declined the sample).</p>")
    for r in runs:
        parts.append(f"<h3>{html.escape(r.label)}</h3>")
        if r.samples:
            parts.append(f"<p>RL step {r.samples[0].get('step')}</p>" + _table(
                ["prompt", "completion", "rewards", "reward", "advantage"],
                [[str(x.get("prompt", "")), _completion(x),
                  ", ".join(f"{k}: {fmt(v)}" for k, v in (x.get("rewards") or {}).items()),
                  fmt(x.get("reward")), fmt(x.get("advantage"))] for x in r.samples], numeric_from=3))
        else:
            parts.append("<p>no samples logged (log.samples_every=0, a DPO run, or no RL step has reached "
                         "log.samples_every or the last step yet)</p>")
    parts.append("<h2>Alerts</h2>")
    for r in runs:
        parts.append(f"<h3>{html.escape(r.label)}</h3>")
        if r.alerts:
            parts.append(
                _table(
                    ["step", "alert", "message"],
                    [[str(a.get("step", "?")), str(a.get("alert", "?")), str(a.get("message", ""))] for a in r.alerts],
                )
            )
        else:
            parts.append("<p>no alerts</p>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
