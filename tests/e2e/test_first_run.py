"""A new user's first run that cannot work says so before it spends their time: lengths past the
model's positions, a prompt-only data file with SFT left on by default, through the CLI and
`reinforge.train` alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import reinforge
from reinforge.cli import app
from reinforge.config import build_config
from reinforge.errors import ConfigError

RUN = ["train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=8",
       "rollout.cpu_kernels=false", "eval.num_prompts=2", "eval.num_samples=2", "log.progress=false", "threads=1"]


def _data(path: Path, prompts: list[str], **columns: list[str]) -> Path:
    rows = [{"prompt": p, "answer": "3", **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_line(output: str) -> str:
    (line,) = [x for x in output.splitlines() if x.startswith("error:")]
    return line


@pytest.mark.parametrize(("model", "positions", "source"), [
    ("llama", 128, "max_position_embeddings in its config.json"),
    ("builtin", 64, "model.max_positions"),
])
def test_max_new_tokens_past_the_models_positions_is_refused_with_the_config(llama_dir: Path, tmp_path: Path,
                                                                             model: str, positions: int,
                                                                             source: str) -> None:
    path = str(llama_dir) if model == "llama" else "builtin"
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", f"model={path}", f"rollout.max_new_tokens={positions + 272}",
                                      f"output_dir={out}"], env={"COLUMNS": "1000"})
    assert result.exit_code == 2 and not out.exists()
    assert _one_line(result.output) == (
        f"error: rollout.max_new_tokens={positions + 272} does not fit the model's {positions} positions ({source}) "
        f"with any prompt: set rollout.max_new_tokens below {positions} less the longest prompt's tokens (e.g. "
        f"rollout.max_new_tokens={positions // 2})")


def test_a_prompt_longer_than_the_models_positions_names_the_rows_and_the_key(llama_dir: Path,
                                                                              tmp_path: Path) -> None:
    # A rotary model (no table of learned positions) would generate past its context with no word.
    long = "What is 1 + 2? " * 40
    data = _data(tmp_path / "d.jsonl", ["What is 1 + 2?", long, "What is 2 + 1?", "What is 0 + 3?"])
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", f"model={llama_dir}", *RUN, "sft.enabled=false", "task.name=dataset",
                                      f"task.options.path={data}", f"task.options.eval_path={data}",
                                      "task.options.verifier=exact", "rollout.max_new_tokens=16", f"output_dir={out}"],
                                env={"COLUMNS": "1000"})
    assert result.exit_code == 2, result.output
    line = _one_line(result.output)
    # the long row, in the 4 train prompts and the 2 eval prompts (eval_path is the same file)
    assert line.startswith("error: 2 of 6 prompts are longer than 112 tokens, the model's 128 positions "
                           "(max_position_embeddings in its config.json) less rollout.max_new_tokens=16 (the longest: ")
    assert line.endswith("tokens, 'What is 1 + 2? What is 1 + 2? What is 1 + 2? What is 1 + ...'): remove or "
                         "shorten those rows of the data; prompts are never truncated")
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_a_prompt_only_file_runs_rl_without_sft_and_says_so(llama_dir: Path, tmp_path: Path) -> None:
    # TRL's GRPO does no SFT: a prompt-only file with sft.enabled left unset runs RL from the model as it is.
    data = _data(tmp_path / "d.jsonl", [f"What is {a} + 1?" for a in range(4)])
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", f"model={llama_dir}", *RUN, "rollout.max_new_tokens=4",
                                      "task.name=dataset", f"task.options.path={data}",
                                      f"task.options.eval_path={data}", "task.options.verifier=exact",
                                      f"output_dir={out}"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    notice = [x for x in result.output.splitlines() if x.startswith("sft: off")]
    assert notice == [f"sft: off: the data file '{data}' has no 'completion' column to imitate before RL (RL starts "
                      "from the model as it is, as TRL's GRPO does); map one with "
                      "task.options.fields.completion=COLUMN, or set sft.enabled=false to say so"]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r.get("stage") in ("sft", "sft_step")]
    assert [r["step"] for r in records if r.get("stage") == "rl"] == [1]


def test_a_file_with_completions_keeps_sft_without_corrupting_them(tmp_path: Path) -> None:
    data = _data(tmp_path / "d.jsonl", [f"What is {a} + 1?" for a in range(4)],
                 completion=[str(a + 1) for a in range(4)])
    cfg = build_config(["task.name=dataset", f"task.options.path={data}"])
    assert cfg.sft.enabled and cfg.sft.corrupt_fraction == 0.0     # a file holds no wrong completions


def test_sft_asked_for_on_a_prompt_only_file_is_a_config_error_from_python_too(tmp_path: Path) -> None:
    data = _data(tmp_path / "d.jsonl", [f"What is {a} + 1?" for a in range(4)])
    message = (f"dataset '{data}' has no reference completions (no 'completion' field): set sft.enabled=false, or "
               "map a column with task.options.fields.completion=COLUMN")
    with pytest.raises(ConfigError) as err:       # docs/python-api.md: input to fix is a ConfigError
        reinforge.train(dataset=str(data), sft={"enabled": True}, task={"options": {"eval_path": str(data)}},
                        output_dir=str(tmp_path / "run"))
    assert str(err.value) == message
    result = CliRunner().invoke(app, ["train", "task.name=dataset", f"task.options.path={data}", "sft.enabled=true",
                                      f"task.options.eval_path={data}", f"output_dir={tmp_path / 'run'}"],
                                env={"COLUMNS": "1000"})
    assert result.exit_code == 2 and _one_line(result.output) == f"error: {message}"
