"""The plots of `reinforge report`: one PNG per PlotSpec (every run overlaid), the pass@k
curves of the start and final model, and the SFT loss curve.

Plots are drawn with matplotlib's object API on an Agg canvas (no pyplot),
so making a report never touches the global backend of the caller.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

from reinforge.telemetry.run_data import RunData, finite

FIGSIZE = (7.0, 4.0)   # inches: readable on a laptop screen without zooming
DPI = 110
SMOOTH_MIN_POINTS = 20  # shorter series are drawn raw; smoothing a handful of points only hides them


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
    PlotSpec("reflection", "Reflection words in the samples", "fraction of samples with one",
             (("reasoning/reflection_rate/correct", "correct", "-"),
              ("reasoning/reflection_rate/incorrect", "incorrect", "--")),
             "no run logged reasoning/reflection_rate (analytics.reflection_words=[])", zero_based=True,
             note="Samples containing any word of analytics.reflection_words ('wait', 'verify', ...), among those "
                  "the verifier accepted and those it rejected; per-word counts per 1k tokens are in metrics.jsonl."),
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


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{'a': {'b': 1}} -> {'a.b': 1}: config keys as overrides spell them."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# ---------------------------------------------------------------------------
# Plots


PASS_AT_BUDGET_CAPTION = (
    "Held-out pass@1 when generation is cut at each budget of eval.token_budgets (the same samples, each "
    "cut at B tokens). Dashed: the model at the start of RL; solid: after RL. A final curve that rises "
    "later than the start's means RL made the model need more tokens to be right."
)

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


def plot_series(spec: PlotSpec, runs: list[RunData], path: Path) -> str | None:
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
        limits = sorted({float(v) for r in runs if finite(v := flatten(r.config).get(spec.ceiling))})
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
    keys = ", ".join(
        f"<code>{html.escape(k)}</code>" for k, _, _ in spec.keys if any(data[(i, k)] for i in range(len(runs)))
    )
    smoothing = (f" Bold lines are a centred moving average over {window} steps; the faint lines are the raw values."
                 if window > 1 else "")
    return f"Metric: {keys}.{smoothing} {html.escape(spec.note)}".rstrip()


def plot_pass_at_k(runs: list[RunData], path: Path) -> bool:
    return _plot_start_final(runs, path, "pass@k", "k (samples per held-out prompt)", "pass@k",
                             "pass@k of the start and final model")


def plot_pass_at_budget(runs: list[RunData], path: Path) -> bool:
    """Held-out pass@1 against the token budget (eval.token_budgets); False (and no file) when no run has it."""
    return _plot_start_final(runs, path, "pass_at_budget", "token budget (new tokens, log scale)",
                             "pass@1 within the budget", "pass@1 within a token budget (test-time scaling)")


def _plot_start_final(runs: list[RunData], path: Path, field: str, xlabel: str, ylabel: str, title: str) -> bool:
    """A curve {x: value} of each finished run's summary (eval.start/final.<field>), the start dashed and
    the final solid, on a log2 x axis; False (and no file) when no finished run has one."""
    finished = [(i, r) for i, r in enumerate(runs) if r.summary is not None and "eval" in r.summary
                and any(r.summary["eval"].get(stage, {}).get(field) for stage in ("start", "final"))]
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
            curve = sorted(
                (int(k), v) for k, v in r.summary["eval"].get(stage, {}).get(field, {}).items() if finite(v)
            )
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
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(ax, handles)
    fig.savefig(path, bbox_inches="tight")
    return True


def _legend(ax, handles: list) -> None:
    # Outside the axes, on the right: a legend never covers a curve (bbox_inches="tight" widens the image).
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


SFT_CAPTION = ("Token-mean negative log-likelihood of the teacher traces at each SFT step (metrics.jsonl lines "
               "of stage sft_step), before RL starts; its own step axis.")


def plot_sft_loss(runs: list[RunData], path: Path) -> bool:
    """The SFT loss of every run that logged one per step; False (and no file) when none did."""
    curves = [(i, [(int(r["sft_step"]), float(r["loss"])) for r in run.records
                   if r.get("stage") == "sft_step" and finite(r.get("loss"))]) for i, run in enumerate(runs)]
    curves = [(i, points) for i, points in curves if points]
    if not curves:
        return False
    from matplotlib.lines import Line2D

    fig, ax = _figure()
    colors, widths = _colors(len(runs)), _widths(len(runs))
    for i, points in curves:
        ax.plot([s for s, _ in points], [v for _, v in points], color=colors[i], linewidth=widths[i])
    ax.set_xlabel("SFT step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("SFT loss")
    _legend(ax, [Line2D([], [], color=colors[i], linewidth=2, label=runs[i].label) for i, _ in curves])
    fig.savefig(path, bbox_inches="tight")
    return True
