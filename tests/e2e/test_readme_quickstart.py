"""The README's quickstart runs as written, on the shipped data and the shipped example reward.

Both blocks (the command line and the Python one) are read out of README.md, so the test breaks
when the README stops being true. Only the run's size is made small (a few steps, few held-out
prompts) and its output directory put under tmp_path; everything the user types is kept.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

ROOT = REPO
SMALL = {"train.steps": 2, "train.prompts_per_step": 4, "train.group_size": 4,
         "eval.num_prompts": 4, "eval.num_samples": 2, "rollout.max_new_tokens": 8}


def _quickstart_block(language: str) -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"```{language}\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, f"the quickstart should hold one {language} block, found {len(blocks)}"
    return blocks[0]


def _rl_steps(run_dir: Path) -> list[int]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [rec["step"] for rec in lines if rec.get("stage") == "rl"]


def test_the_quickstart_command_trains_on_the_shipped_data(tmp_path: Path) -> None:
    text = _quickstart_block("bash")
    command = " ".join(line for line in text.replace("\\\n", " ").splitlines() if not line.lstrip().startswith("#"))
    argv = shlex.split(command)
    assert argv[:2] == [".venv/bin/reinforge", "train"]
    run_dir = tmp_path / "run"
    small = [f"{key}={value}" for key, value in SMALL.items()]
    done = subprocess.run([sys.executable, "-m", "reinforge.cli", *argv[1:], *small, f"output_dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _rl_steps(run_dir) == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == 2 and 0.0 <= summary["eval"]["final"]["pass@1"] <= 1.0
    # The example reward is the one configured.
    assert "examples/my_reward.py:correct" in (run_dir / "config.yaml").read_text()


def test_the_quickstart_python_trains_on_the_shipped_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import reinforge

    code = _quickstart_block("python")
    real_train, results = reinforge.train, []

    def small_train(*args, **kwargs):
        result = real_train(*args, **{**kwargs, **SMALL, "output_dir": str(tmp_path / "run")})
        results.append(result)
        return result

    monkeypatch.setattr(reinforge, "train", small_train)
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md quickstart", "exec"), {"__name__": "__quickstart__"})
    (result,) = results
    assert Path(result.run_dir) == tmp_path / "run"
    assert _rl_steps(Path(result.run_dir)) == [1, 2]
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed == f"{result.run_dir} {result.eval['final']['pass@1']}"


def test_the_quickstart_is_a_short_run_that_says_it_is_a_template_and_how_long_it_takes() -> None:
    # Run as written it must end in minutes: a few steps, not the 150 default, on a reward that stays near 0
    # with the untrained built-in model, and the text says so and gives the time it was measured to take.
    argv = shlex.split(_quickstart_block("bash").replace("\\\n", " ").splitlines()[-1])
    settings = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("'"))
    assert int(settings["train.steps"]) <= 10 and int(settings["eval.num_prompts"]) <= 20
    text = " ".join((ROOT / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0].split())
    assert "This is a template" in text and re.search(r"\(\d+( to \d+)? s measured", text)


def test_the_example_reward_file_shows_the_three_forms() -> None:
    from reinforge.rewards.conventions import import_user_function, reward_form

    forms = {name: reward_form(import_user_function(f"examples/my_reward.py:{name}"), name)
             for name in ("correct", "compute_score", "short")}
    assert forms == {"correct": "trl", "compute_score": "verl", "short": "sample"}
    example = import_user_function("examples/my_reward.py:correct")
    chat = [[{"role": "assistant", "content": "so \\boxed{7/48}"}], [{"role": "assistant", "content": "12"}]]
    assert example(prompts=["a", "b"], completions=chat, answer=["7/48", "13"]) == [1.0, 0.0]
    assert import_user_function("examples/my_reward.py:compute_score")("math", "it is \\boxed{40}", "40") == 1.0
    assert import_user_function("examples/my_reward.py:short")(completion="abcd") == -0.04
