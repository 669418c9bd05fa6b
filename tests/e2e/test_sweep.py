"""`reinforge sweep`: the grid, the per-group statistics (hand-derived), and real micro sweeps."""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.jobs.sweep import _sweep_settings, expand_grid, run_names, run_sweep, split_values
from reinforge.jobs.sweep_table import Stat, SweepRun, separation_note, summarise, table

runner = CliRunner()


# ---------------------------------------------------------------------------
# The grid


def test_grid_is_the_product_with_the_first_axis_slowest() -> None:
    assert expand_grid(["a=1,2", "b=x,y,z", "c=5"]) == [
        ["a=1", "b=x", "c=5"], ["a=1", "b=y", "c=5"], ["a=1", "b=z", "c=5"],
        ["a=2", "b=x", "c=5"], ["a=2", "b=y", "c=5"], ["a=2", "b=z", "c=5"],
    ]
    assert expand_grid([]) == [[]]
    assert expand_grid(["seed=3"]) == [["seed=3"]]


@pytest.mark.parametrize(("raw", "values"), [
    ("[a,b]", ["[a,b]"]),
    ("{eps_low: 0.2, eps_high: 0.28}", ["{eps_low: 0.2, eps_high: 0.28}"]),
    ("[a,b],[c]", ["[a,b]", "[c]"]),
    ("[[1,2],[3]],{x: [4,5]}", ["[[1,2],[3]]", "{x: [4,5]}"]),
    ('"a,b",c', ['"a,b"', "c"]),
    ("'x,[',y", ["'x,['", "y"]),
    ("f(1,2),g", ["f(1,2)", "g"]),
])
def test_only_top_level_commas_split(raw: str, values: list[str]) -> None:
    assert split_values(raw) == values


def test_bracketed_values_reach_the_config_whole() -> None:
    grid = expand_grid(["rollout.stop=[a,b]", "objective.policy_params={eps_low: 0.2, eps_high: 0.28},{eps_low: 0.1}"])
    assert len(grid) == 2
    first, second = (build_config(combo) for combo in grid)
    assert first.rollout.stop == ["a", "b"]
    assert first.objective.policy_params == {"eps_low": 0.2, "eps_high": 0.28}
    assert second.objective.policy_params["eps_low"] == 0.1


@pytest.mark.parametrize(("overrides", "message"), [
    (["seed=0,1", "train.lr=1e-5", "seed=2"], "'seed' is given twice"),
    (["recipe"], "not of the form key=value"),
    (["seed=0,,1"], "empty value"),
])
def test_bad_grids_are_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        expand_grid(overrides)


def test_run_names_join_the_swept_values_and_stay_distinct() -> None:
    combos = expand_grid(["recipe=grpo,dr_grpo", "seed=0,1", "train.steps=3"])
    assert run_names(combos, ["recipe", "seed"]) == [
        "recipe-grpo_seed-0", "recipe-grpo_seed-1", "recipe-dr-grpo_seed-0", "recipe-dr-grpo_seed-1"]
    assert run_names([["model=/models/qwen 0.5b"]], ["model"]) == ["model-models-qwen-0.5b"]
    assert run_names([["seed=0"]], []) == ["run"]
    clash = run_names(expand_grid(["rollout.stop=[a,b],(a,b)"]), ["rollout.stop"])
    assert clash[0] != clash[1] and all(n.startswith("rollout.stop-a-b-") for n in clash)
    assert clash == run_names(expand_grid(["rollout.stop=[a,b],(a,b)"]), ["rollout.stop"])   # stable: resumable


# ---------------------------------------------------------------------------
# The table, on hand-made summaries


def _run(recipe: str, seed: int, start: float, final: float, greedy: float, pass4: float) -> SweepRun:
    summary = {"eval": {"start": {"pass@1": start}, "final": {
        "pass@1": final, "greedy_accuracy": greedy, "pass@k": {"1": final, "4": pass4}}}}
    return SweepRun(name=f"{recipe}-{seed}", path=Path("x"), overrides=[], axes={"recipe": recipe, "seed": str(seed)},
                    status="skipped", summary=summary)


def test_groups_are_summarised_with_sample_std() -> None:
    runs = [
        _run("grpo", 0, 0.4, 0.5, 0.50, 0.7),
        _run("grpo", 1, 0.4, 0.6, 0.60, 0.8),
        _run("grpo", 2, 0.5, 0.7, 0.55, 0.9),
        _run("dr_grpo", 0, 0.3, 0.2, 0.2, 0.4),
        _run("dr_grpo", 1, 0.3, 0.3, 0.3, 0.5),
        SweepRun(
            name="dr_grpo-2", path=Path("x"), overrides=[], axes={"recipe": "dr_grpo", "seed": "2"}, status="failed",
            error="boom",
        ),
    ]
    grpo, dr = summarise(runs, ["recipe", "seed"])
    assert grpo.group == {"recipe": "grpo"} and grpo.n == 3 and grpo.failed == 0
    # mean(0.5, 0.6, 0.7) = 0.6; sample std = sqrt((0.01 + 0 + 0.01) / 2) = 0.1
    assert grpo.final_pass1.mean == pytest.approx(0.6) and grpo.final_pass1.std == pytest.approx(0.1)
    # deltas 0.1, 0.2, 0.2: mean 1/6; sample std = sqrt((1/15^2... ) )
    # = sqrt(((0.1-1/6)^2 + 2 (0.2-1/6)^2) / 2) = 0.0577
    assert grpo.delta_pass1.mean == pytest.approx(1 / 6) and grpo.delta_pass1.std == pytest.approx(0.0577350, abs=1e-6)
    assert grpo.greedy.mean == pytest.approx(0.55) and grpo.greedy.std == pytest.approx(0.05)
    assert grpo.pass_at_k["4"].mean == pytest.approx(0.8) and grpo.pass_at_k["4"].std == pytest.approx(0.1)
    assert dr.n == 2 and dr.failed == 1
    assert dr.final_pass1.mean == pytest.approx(0.25) and dr.final_pass1.std == pytest.approx(0.0707107, abs=1e-6)
    assert dr.delta_pass1.mean == pytest.approx(-0.05)

    header, cells = table([grpo, dr], ["recipe", "seed"])
    assert header == [
        "recipe", "n", "final pass@1", "Δ pass@1 (final − start)", "greedy accuracy", "pass@4", "failed"
    ]
    assert cells[0] == ["grpo", "3", "0.600 ± 0.100", "+0.167 ± 0.058", "0.550 ± 0.050", "0.800 ± 0.100", "0"]
    assert cells[1][:4] == ["dr_grpo", "2", "0.250 ± 0.071", "-0.050 ± 0.071"]
    # gap 0.35 > 0.1 + 0.0707
    assert "separated" in separation_note([grpo, dr]) and "within seed noise" not in separation_note([grpo, dr])


def test_train_seed_is_a_seed_axis_too() -> None:
    # seed=0 train.seed=0,1: one SFT model, two RL seeds per recipe; groups are the recipes.
    runs = [SweepRun(name=f"{r}-{s}", path=Path("x"), overrides=[], axes={"recipe": r, "train.seed": str(s)},
                     status="skipped", summary=_run(r, s, 0.4, final, 0.5, 0.7).summary)
            for r, s, final in (("grpo", 0, 0.5), ("grpo", 1, 0.7), ("dapo", 0, 0.6), ("dapo", 1, 0.6))]
    grpo, dapo = summarise(runs, ["recipe", "train.seed"])
    assert (grpo.group, grpo.n, dapo.group, dapo.n) == ({"recipe": "grpo"}, 2, {"recipe": "dapo"}, 2)
    assert grpo.final_pass1.mean == pytest.approx(0.6) and dapo.final_pass1.std == pytest.approx(0.0)
    assert table([grpo, dapo], ["recipe", "train.seed"])[0][0] == "recipe"


def test_the_separation_note_is_honest_about_noise_and_single_seeds() -> None:
    close = summarise([_run("a", 0, 0, 0.50, 0, 0), _run("a", 1, 0, 0.60, 0, 0),
                       _run("b", 0, 0, 0.45, 0, 0), _run("b", 1, 0, 0.55, 0, 0)], ["recipe", "seed"])
    # gap 0.05 < 0.0707 + 0.0707
    assert "within seed noise" in separation_note(close)
    single = summarise([_run("a", 0, 0, 0.9, 0, 0), _run("b", 0, 0, 0.1, 0, 0)], ["recipe", "seed"])
    assert single[0].final_pass1.text() == "0.900 ± n/a"
    assert "seed noise is unknown" in separation_note(single)
    assert separation_note(single[:1]) == ""


def test_stat_text() -> None:
    assert Stat.of([0.5, 0.7]).text() == "0.600 ± 0.141"
    assert Stat.of([0.1]).text(signed=True) == "+0.100 ± n/a"
    assert Stat.of([]).text() == "n/a"


def test_parallel_runs_split_the_cores_unless_threads_is_set() -> None:
    cores = len(os.sched_getaffinity(0))
    assert _sweep_settings(["seed"], jobs=1, config_file=None) == []
    assert _sweep_settings(["seed"], jobs=2, config_file=None) == [
        "log.progress=false",
        f"threads={max(1, cores // 2)}",
    ]
    assert _sweep_settings(["seed", "threads", "log.progress"], jobs=4, config_file=None) == []


# ---------------------------------------------------------------------------
# Real sweeps


@pytest.mark.slow
def test_sweep_runs_the_grid_tabulates_over_seeds_and_resumes(tmp_path: Path, micro_overrides) -> None:
    out = tmp_path / "sweep"
    result = run_sweep(["recipe=grpo,dr_grpo", "seed=0,1", *micro_overrides], out)   # jobs=1: in this process
    names = ["recipe-grpo_seed-0", "recipe-grpo_seed-1", "recipe-dr-grpo_seed-0", "recipe-dr-grpo_seed-1"]
    assert [r.name for r in result.runs] == names and [r.status for r in result.runs] == ["done"] * 4
    assert [r.group for r in result.rows] == [{"recipe": "grpo"}, {"recipe": "dr_grpo"}]

    csv_rows = list(csv.DictReader(result.csv.open()))
    saved = json.loads(result.json.read_text())
    markdown = result.markdown.read_text()
    for i, (row, recipe) in enumerate(zip(result.rows, ("grpo", "dr-grpo"), strict=True)):
        evals = [json.loads((out / f"recipe-{recipe}_seed-{s}" / "summary.json").read_text())["eval"] for s in (0, 1)]
        final = [e["final"]["pass@1"] for e in evals]
        delta = [e["final"]["pass@1"] - e["start"]["pass@1"] for e in evals]
        greedy = [e["final"]["greedy_accuracy"] for e in evals]
        assert row.n == 2 and row.runs == [f"recipe-{recipe}_seed-0", f"recipe-{recipe}_seed-1"]
        assert row.final_pass1.mean == pytest.approx(statistics.fmean(final))
        assert row.final_pass1.std == pytest.approx(statistics.stdev(final))
        assert row.delta_pass1.mean == pytest.approx(statistics.fmean(delta))
        assert row.delta_pass1.std == pytest.approx(statistics.stdev(delta))
        assert row.greedy.mean == pytest.approx(statistics.fmean(greedy))
        for k in ("1", "2", "4"):
            assert row.pass_at_k[k].values == [e["final"]["pass@k"][k] for e in evals]
        assert saved["rows"][i]["final_pass1"]["std"] == pytest.approx(statistics.stdev(final))
        assert float(csv_rows[i]["final_pass@1_mean"]) == pytest.approx(statistics.fmean(final))
        assert f"| {row.final_pass1.text()} | {row.delta_pass1.text(signed=True)} | {row.greedy.text()} |" in markdown
    page = result.report.read_text()
    assert result.report == out / "report.html"
    for label in ("grpo seed 0", "grpo seed 1", "dr_grpo seed 0", "dr_grpo seed 1"):
        assert f"<td>{label}</td>" in page

    # Re-running resumes: finished runs are not touched; a run that stopped (no summary.json) is set aside and redone.
    (out / names[3] / "summary.json").unlink()
    stamps = {p: p.stat().st_mtime_ns for name in names[:3] for p in (out / name).glob("*.json*")}
    again = run_sweep(["recipe=grpo,dr_grpo", "seed=0,1", *micro_overrides], out)
    assert [r.status for r in again.runs] == ["skipped"] * 3 + ["done"]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert (out / f"{names[3]}.incomplete-1" / "metrics.jsonl").is_file() and (
        out / names[3] / "summary.json"
    ).is_file()
    assert [r.final_pass1.mean for r in again.rows] == [r.final_pass1.mean for r in result.rows]
    # A finished run is reused only with the settings asked for now: else the table would mix settings.
    with pytest.raises(
        ConfigError, match=r"holds a finished run with other settings \(train.warmup_steps: 0 there, 1 now"
    ):
        run_sweep(["recipe=grpo,dr_grpo", "seed=0,1", *micro_overrides, "train.warmup_steps=1"], out)


@pytest.mark.parametrize(("overrides", "message"), [
    (["recipe=grpo,grpo_x"], "recipe-grpo-x: .*unknown recipe.*did you mean 'grpo'"),
    (["task.options.digits=2,0"], "task.options.digits-0: digits must be"),     # only the second combination is bad
    (["output_dir=/tmp/x"], "names each run's output_dir"),
])
def test_a_bad_combination_fails_before_anything_is_written(
    tmp_path: Path, micro_overrides, overrides, message
) -> None:
    out = tmp_path / "sweep"
    with pytest.raises(ConfigError, match=message):
        run_sweep([*micro_overrides, *overrides], out)
    assert not out.exists()


@pytest.mark.slow
def test_cli_sweep_reports_a_failed_run_and_finishes_the_others(
    tmp_path: Path, micro_overrides, tiny_model_dir: str
) -> None:
    broken = tmp_path / "broken_model"
    broken.mkdir()
    for f in Path(tiny_model_dir).iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")   # passes validation, fails on load
    out = tmp_path / "sweep"
    result = runner.invoke(
        app, ["sweep", *micro_overrides, f"model={tiny_model_dir},{broken}", "--out", str(out), "--jobs", "2"]
    )
    assert result.exit_code == 1, result.output
    assert "failed:" in result.output and "Traceback" not in result.output
    # the table, unwrapped: one seed, no std
    assert re.search(r"│ 1 │ +0\.000 ± n/a │", result.output), result.output
    assert str(out / "sweep.md") in result.output and str(out / "report.html") in result.output
    good, bad = json.loads((out / "sweep.json").read_text())["runs"]
    assert good["status"] == "done" and (Path(good["path"]) / "summary.json").is_file()
    assert bad["status"] == "failed" and "broken" in bad["name"] and not (Path(bad["path"]) / "summary.json").exists()
    assert (
        "SafetensorError" in bad["error"].splitlines()[-1]
        and bad["error"] in (out / "logs" / f"{bad['name']}.log").read_text()
    )
    markdown = (out / "sweep.md").read_text()
    assert "## Failed runs" in markdown and bad["name"] in markdown
    assert "± n/a" in markdown                                     # one seed per group: no std
    assert "<td>grpo seed 0</td>" in (out / "report.html").read_text()

    result = runner.invoke(app, ["sweep", "seed=0,1", "train.stepz=3", "--out", str(tmp_path / "never")])
    assert result.exit_code == 2 and "did you mean 'steps'" in result.output
    assert not (tmp_path / "never").exists()
