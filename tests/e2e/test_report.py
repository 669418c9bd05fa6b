"""`reinforge report`: the HTML page and its plots, on real micro runs and on hand-written run directories."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.jobs.train import run
from reinforge.telemetry.report import fmt, load_runs, write_report

runner = CliRunner()


def _micro_run(path: Path, overrides: list[str], *extra: str) -> Path:
    run(build_config([*overrides, *extra, f"output_dir={path}"]))
    return path


def _images(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page)


def _check_images(page: str, out: Path) -> list[str]:
    """Every PNG in out is on the page and every image on the page is a real PNG in out."""
    referenced = _images(page)
    assert sorted(referenced) == sorted(p.name for p in out.glob("*.png"))
    for name in referenced:
        assert (out / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name
    return referenced


def _row(page: str, label: str) -> list[str]:
    """The cells of the run table's row of `label`."""
    runs_table = page.split("<h2>Runs</h2>")[1].split("</table>")[0]
    for row in re.findall(r"<tr>(.*?)</tr>", runs_table):
        cells = [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        if cells and cells[0] == label:
            return cells
    raise AssertionError(f"no row for {label}")


def _write_run(path: Path, lines: list[dict], recipe: str = "grpo", seed: int = 0, summary: dict | None = None,
               alerts: list[dict] | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(
        yaml.safe_dump({"recipe": recipe, "seed": seed, "rollout": {"max_new_tokens": 16}})
    )
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    if alerts is not None:
        (path / "alerts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in alerts))
    return path


def _summary(start: float, final: float, rl_steps: int = 3) -> dict:
    def ev(p: float) -> dict:
        return {"pass@1": p, "greedy_accuracy": p / 2, "pass@k": {"1": p, "2": min(1.0, 2 * p), "4": min(1.0, 3 * p)}}
    return {"recipe": "grpo", "seed": 0, "rl_steps": rl_steps, "eval": {"start": ev(start), "final": ev(final)}}


@pytest.mark.slow
def test_report_of_a_real_run_shows_its_numbers_plots_and_alerts(tmp_path: Path, micro_overrides) -> None:
    out = _micro_run(tmp_path / "run", micro_overrides)
    page_path = write_report([out], out)
    assert page_path == out / "report.html"
    page = page_path.read_text()
    images = _check_images(page, out)
    for name in (
        "report-reward.png",
        "report-entropy.png",
        "report-pass_at_k.png",
        "report-kl.png",
        "report-heldout.png",
    ):
        assert name in images
    summary = json.loads((out / "summary.json").read_text())
    start, final = summary["eval"]["start"], summary["eval"]["final"]
    assert _row(page, "grpo seed 0") == [
        "grpo seed 0", "grpo", "0", "3", "done", fmt(start["pass@1"]), fmt(final["pass@1"]),
        fmt(start["greedy_accuracy"]), fmt(final["greedy_accuracy"]), fmt(final["pass@k"]["2"]),
        fmt(final["pass@k"]["4"]),
    ]
    alerts = (
        [json.loads(x) for x in (out / "alerts.jsonl").read_text().splitlines()]
        if (out / "alerts.jsonl").exists()
        else []
    )
    alerts_section = page.split("<h2>Alerts</h2>")[1]
    if alerts:
        for alert in alerts:
            assert (
                f"<td>{alert['step']}</td><td>{html.escape(alert['alert'])}</td>"
                f"<td>{html.escape(alert['message'])}</td>"
                in alerts_section
            )
    else:
        assert "no alerts" in alerts_section


@pytest.mark.slow
def test_report_of_two_runs_overlays_both(tmp_path: Path, micro_overrides) -> None:
    a = _micro_run(tmp_path / "a", micro_overrides)
    b = _micro_run(tmp_path / "b", micro_overrides, "recipe=dr_grpo", "seed=1")
    page = write_report([a, b], tmp_path / "report").read_text()
    _check_images(page, tmp_path / "report")
    assert _row(page, "grpo seed 0")[4] == "done" and _row(page, "dr_grpo seed 1")[4] == "done"
    differ = page.split("<h2>Settings that differ</h2>")[1].split("</table>")[0]
    # One row per setting, one column per run.
    assert "<th>grpo seed 0</th><th>dr_grpo seed 1</th>" in differ and "output_dir" not in differ
    assert "<tr><td>recipe</td><td>grpo</td><td>dr_grpo</td></tr>" in differ
    assert "<tr><td>seed</td><td>0</td><td>1</td></tr>" in differ
    assert "report-kl.png" in _images(page)  # grpo has a KL term; dr_grpo has none, and the plot still shows grpo's


def test_missing_metrics_are_skipped_and_the_page_says_why(tmp_path: Path) -> None:
    rl = [{"stage": "rl", "step": s, "reward_mean": 0.1 * s, "entropy": 1.0 / s, "response_length_mean": 10.0 + s,
           "clip_frac": 0.0, "mismatch_kl": 1e-6} for s in range(1, 26)]
    rl[1]["reward_mean"] = None                                   # a non-finite value, written as null
    evals = [{"stage": "eval", "step": 0, "eval/pass@1": 0.2, "eval/greedy_accuracy": 0.25},
             {"stage": "eval", "step": 25, "eval/pass@1": 0.4, "eval/greedy_accuracy": 0.5}]
    running = _write_run(
        tmp_path / "running",
        [{"stage": "sft", "steps": 3}, *rl, *evals],
        alerts=[{"step": 7, "alert": "entropy_collapse", "message": "entropy 0.01 < 0.1 x baseline", "values": {}}],
    )
    with (running / "metrics.jsonl").open("a") as f:
        f.write('{"stage": "rl", "ste')                          # the line a live run is writing right now
    sft_only = _write_run(tmp_path / "sft_only", [{"stage": "sft", "steps": 3}], recipe="dr_grpo", seed=1)

    page = write_report([running, sft_only], tmp_path / "out").read_text()
    images = _check_images(page, tmp_path / "out")
    assert set(images) == {
        f"report-{n}.png" for n in ("reward", "heldout", "entropy", "length", "clip_frac", "mismatch")
    }
    skipped = page.split("<h3>Skipped plots</h3>")[1].split("</ul>")[0]
    assert "KL to the reference model</b>: skipped, no run logged kl" in skipped
    assert "pass@k of the start and final model</b>: skipped, no run has finished" in skipped
    assert _row(page, "grpo seed 0")[3:] == ["25", "running", *["running"] * 4]
    assert _row(page, "dr_grpo seed 1")[3:] == ["0", "running (SFT)", *["running"] * 4]
    assert "moving average over 3 steps" in page                 # 25 points: smoothed, raw shown faintly
    alerts = page.split("<h2>Alerts</h2>")[1]
    assert "<td>7</td><td>entropy_collapse</td><td>entropy 0.01 &lt; 0.1 x baseline</td>" in alerts
    assert alerts.split("dr_grpo seed 1")[1].startswith("</h3>\n<p>no alerts</p>")


def test_series_skips_nulls_prefers_eval_lines_and_falls_back_to_the_summary(tmp_path: Path) -> None:
    lines = [{"stage": "rl", "step": 1, "reward_mean": 0.5, "eval/pass@1": 0.30},
             {"stage": "rl", "step": 2, "reward_mean": None},
             {"stage": "eval", "step": 1, "eval/pass@1": 0.35},
             {"stage": "rl", "step": 3, "reward_mean": 0.7}]
    live = _write_run(tmp_path / "live", lines)
    done = _write_run(
        tmp_path / "done", [{"stage": "rl", "step": 1, "reward_mean": 0.1}], summary=_summary(0.2, 0.6, rl_steps=1)
    )
    live_run, done_run = load_runs([live, done])
    assert live_run.series("reward_mean") == [(1, 0.5), (3, 0.7)]
    assert live_run.series("eval/pass@1") == [(1, 0.35)]
    assert live_run.series("kl") == []
    assert done_run.series("eval/pass@1") == [(0, 0.2), (1, 0.6)]        # start and final from summary.json
    assert done_run.series("eval/greedy_accuracy") == [(0, 0.1), (1, 0.3)]


def test_colliding_labels_fall_back_to_folder_names(tmp_path: Path) -> None:
    rl = [{"stage": "rl", "step": 1, "reward_mean": 0.1}]
    a = _write_run(tmp_path / "lr-1e-5", rl, summary=_summary(0.1, 0.2))
    b = _write_run(tmp_path / "lr-3e-5", rl, summary=_summary(0.1, 0.3))
    c = _write_run(tmp_path / "dr", rl, recipe="dr_grpo")
    assert [r.label for r in load_runs([a, b, c])] == ["lr-1e-5", "lr-3e-5", "dr_grpo seed 0"]
    page = write_report([a, b, c], tmp_path / "out").read_text()
    assert _row(page, "lr-3e-5")[5:8] == ["0.100", "0.300", "0.050"]
    assert "report-pass_at_k.png" in _check_images(page, tmp_path / "out")


def test_a_second_report_removes_plots_that_no_longer_apply(tmp_path: Path) -> None:
    run_dir = _write_run(tmp_path / "run", [{"stage": "rl", "step": 1, "reward_mean": 0.1, "kl": 0.01}])
    write_report([run_dir], run_dir)
    assert (run_dir / "report-kl.png").exists()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"stage": "rl", "step": 1, "reward_mean": 0.1}) + "\n")
    page = write_report([run_dir], run_dir).read_text()
    assert not (run_dir / "report-kl.png").exists()
    _check_images(page, run_dir)


def test_cli_report_defaults_and_errors(tmp_path: Path, monkeypatch) -> None:
    rl = [{"stage": "rl", "step": 1, "reward_mean": 0.1}]
    a = _write_run(tmp_path / "a", rl, summary=_summary(0.1, 0.2))
    b = _write_run(tmp_path / "b", rl, recipe="dr_grpo")
    result = runner.invoke(app, ["report", str(a)])
    assert result.exit_code == 0, result.output
    assert str(a / "report.html") in result.output and (a / "report.html").is_file()
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["report", str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert "dr_grpo seed 0" in (tmp_path / "report" / "report.html").read_text()

    for bad, message in ((tmp_path / "nope", "does not exist"), (tmp_path / "empty", "has no metrics.jsonl")):
        (tmp_path / "empty").mkdir(exist_ok=True)
        result = runner.invoke(app, ["report", str(a), str(bad), "--out", str(tmp_path / "x")])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
        assert not (tmp_path / "x").exists()


def test_a_multi_turn_sample_shows_its_conversation_with_roles() -> None:
    from reinforge.telemetry.report import _completion

    sample = {"completion": "42", "trajectory": [
        {"role": "user", "content": "6*7="}, {"role": "assistant", "content": "<tool_call>...</tool_call>"},
        {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]}
    assert _completion(sample) == "[assistant] <tool_call>...</tool_call> [tool] 42 [assistant] 42"
    assert _completion({"completion": "39"}) == "39"
