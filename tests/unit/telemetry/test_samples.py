"""samples.jsonl, its TensorBoard text and W&B table, and the SFT loss curve: what the model wrote, read back."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from unit.telemetry.test_sinks import offline_run_files, wandb_history, wandb_offline  # noqa: F401 (fixture)

from reinforge.config import build_config
from reinforge.jobs.train import run
from reinforge.rollout.base import Rollout
from reinforge.settings import LogConfig
from reinforge.tasks.base import Example
from reinforge.telemetry.samples import (
    StepSamples,
    pick_samples,
    samples_markdown,
    truncate_samples,
)
from reinforge.telemetry.sinks import build_sinks
from reinforge.verifiers.arithmetic import verify_integer

FUNCTIONS = 'reward.functions=[{name: verifier}, {name: format, weight: 0.5, params: {pattern: "[0-9]"}}]'


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    from conftest import MICRO

    out = tmp_path_factory.mktemp("samples") / "run"
    cfg = build_config([*MICRO, "train.steps=4", "log.samples_every=2", "log.samples_per_step=3",
                        "log.tensorboard=true", FUNCTIONS, f"output_dir={out}"])
    run(cfg)
    return out


def test_samples_hold_what_the_model_wrote_with_each_rewards_value(sampled_run) -> None:
    from transformers import AutoTokenizer

    records = [json.loads(x) for x in (sampled_run / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 2, 2, 4, 4, 4]
    tokenizer = AutoTokenizer.from_pretrained(sampled_run / "model")
    for r in records:
        assert set(r) == {"step", "prompt", "answer", "completion", "completion_tokens", "rewards", "reward",
                          "advantage", "trained", "truncated"}
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", r["prompt"]).groups()
        assert str(int(a) + int(b)) == r["answer"]
        # The text is the decode of the tokens that were sampled (eos, when there is one, decodes to nothing).
        assert tokenizer.decode(r["completion_tokens"], skip_special_tokens=True) == r["completion"]
        assert 1 <= len(r["completion_tokens"]) <= 4 and r["truncated"] == (
            len(r["completion_tokens"]) == 4 and r["completion_tokens"][-1] != tokenizer.eos_token_id
        )
        # Each function's value, recomputed from the completion, and the weighted total.
        assert r["rewards"] == {"verifier": verify_integer(r["completion"], r["answer"]),
                                "format": 1.0 if re.search("[0-9]", r["completion"]) else 0.0}
        assert r["reward"] == pytest.approx(r["rewards"]["verifier"] + 0.5 * r["rewards"]["format"])
        assert math.isfinite(r["advantage"]) and r["trained"] is True
    # Rows i * N // 3 of N = 16: rows 0, 5, 10 are samples of prompts 0, 1 and 2: three different prompts.
    assert len({r["prompt"] for r in records[:3]}) == 3


def test_tensorboard_has_the_samples_text_and_the_sft_loss_curve(sampled_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [json.loads(x) for x in (sampled_run / "samples.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(sampled_run / "tensorboard"))
    acc.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")}
    assert sorted(texts) == [2, 4]
    for r in records:
        assert samples_markdown([r]).splitlines()[-1] in texts[r["step"]]
    sft = [json.loads(x) for x in (sampled_run / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in sft if x["stage"] == "sft_step"]
    assert [x["sft_step"] for x in sft if x["stage"] == "sft_step"] == [0, 1, 2]
    assert [(e.step, e.value) for e in acc.Scalars("sft/loss")] == [
        (k, pytest.approx(v, rel=1e-6)) for k, v in enumerate(losses)
    ]
    summary = next(x for x in sft if x["stage"] == "sft")
    assert summary["first_loss"] == losses[0] and summary["steps"] == 3


def _batch(advantages: torch.Tensor) -> StepSamples:
    """Two prompts x two samples; hand-set tokens (pad 0), rewards and advantages."""
    rollout = Rollout(
        prompt_ids=[[1], [1], [2], [2]],
        completion_ids=torch.tensor([[5, 6, 0], [7, 0, 0], [8, 9, 4], [3, 0, 0]]), pad_id=0,
        completion_mask=torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]),
        sampler_logprobs=torch.zeros(4, 3), truncated=torch.tensor([False, False, True, False]),
        group_ids=torch.tensor([0, 0, 1, 1]), policy_version=0, texts=["ab", "c", "def", "g"])
    return StepSamples(
        examples=[Example("p0", "a0", {}), Example("p1", "a1", {})], rollout=rollout,
        rewards=torch.tensor([1.0, 0.0, math.nan, 0.5]),
        parts={"verifier": torch.tensor([1.0, 0.0, math.nan, 0.5])},
        advantages=advantages, trained=torch.tensor([True, True, False, True]))


def test_pick_samples_spreads_rows_and_averages_per_token_advantages() -> None:
    per_row = pick_samples(7, _batch(torch.tensor([0.5, -0.5, 0.0, 0.25])), k=2)      # rows 0 and 2
    assert per_row == [
        {"step": 7, "prompt": "p0", "answer": "a0", "completion": "ab", "completion_tokens": [5, 6],
         "rewards": {"verifier": 1.0}, "reward": 1.0, "advantage": 0.5, "trained": True, "truncated": False},
        {"step": 7, "prompt": "p1", "answer": "a1", "completion": "def", "completion_tokens": [8, 9, 4],
         "rewards": {"verifier": None}, "reward": None, "advantage": 0.0, "trained": False, "truncated": True},
    ]
    # Per-token (GAE) advantages: the mean over the row's completion tokens, padding left out:
    # row 0 (1 + 3) / 2 = 2, row 2 (1 + 2 + 6) / 3 = 3.
    tokens = torch.tensor([[1.0, 3, 100], [0, 0, 0], [1, 2, 6], [0, 0, 0]])
    assert [r["advantage"] for r in pick_samples(1, _batch(tokens), k=2)] == [2.0, 3.0]
    assert [r["completion"] for r in pick_samples(1, _batch(tokens), k=10)] == [
        "ab",
        "c",
        "def",
        "g",
    ]  # k > N: all rows


def test_truncate_samples_keeps_the_steps_up_to_the_checkpoint(tmp_path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text(
        "".join(json.dumps({"step": s, "completion": f"c{s}"}) + "\n" for s in (2, 4, 6)) + '{"step": 8, "comp'
    )
    truncate_samples(path, 4)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2, 4]
    truncate_samples(tmp_path / "absent.jsonl", 4)          # a run that logged no sample yet: nothing to do
    assert not (tmp_path / "absent.jsonl").exists()


def test_wandb_gets_the_samples_as_a_table(tmp_path, wandb_offline) -> None:  # noqa: F811
    records = pick_samples(3, _batch(torch.tensor([0.5, -0.5, 0.0, 0.25])), k=2)
    (sink,) = build_sinks(LogConfig(wandb=True, wandb_project="test"), tmp_path, {}, start_step=0, wandb_id=None)
    run_id = sink.id
    sink.log_samples(3, records)
    sink.log_sft(1, {"sft/loss": 2.0})      # W&B has one step axis, owned by RL: SFT stays out of it
    sink.close()
    (run_file,) = offline_run_files(tmp_path / "wandb", run_id, sessions=1)
    history = wandb_history(run_file)
    assert list(history) == [3] and history[3]["samples/_type"] == "table-file"
    assert (history[3]["samples/nrows"], history[3]["samples/ncols"]) == (2, 7)
    table = json.loads((run_file.parent / "files" / history[3]["samples/path"]).read_text())
    assert table["columns"] == ["step", "prompt", "completion", "rewards", "reward", "advantage", "trained"]
    assert table["data"] == [[3, "p0", "ab", '{"verifier": 1.0}', 1.0, 0.5, True],
                             [3, "p1", "def", '{"verifier": null}', None, 0.0, False]]


def test_report_shows_the_sft_loss_curve_and_the_last_samples(sampled_run, tmp_path) -> None:
    import html

    from reinforge.telemetry.report import load_runs, write_report

    page = write_report([sampled_run], tmp_path).read_text()
    assert (tmp_path / "report-sft_loss.png").is_file() and 'src="report-sft_loss.png"' in page
    (run_data,) = load_runs([sampled_run])
    records = [json.loads(x) for x in (sampled_run / "samples.jsonl").read_text().splitlines()]
    assert run_data.samples == [r for r in records if r["step"] == 4]            # the last logged step only
    samples = page[page.index("<h2>Samples</h2>"):page.index("<h2>Alerts</h2>")]
    assert "<p>RL step 4</p>" in samples
    for r in run_data.samples:
        assert f"<td>{html.escape(r['completion'])}</td>" in samples
        assert f"verifier: {r['rewards']['verifier']:.3f}, format: {r['rewards']['format']:.3f}" in samples


def test_resume_rewrites_the_samples_after_its_checkpoint(tmp_path) -> None:
    """An interrupted run (its step-4 checkpoint lost, samples of steps 3-4 already written) resumed
    from step 2 ends with the samples.jsonl of an uninterrupted run: nothing twice, nothing lost."""
    import shutil

    from conftest import MICRO

    from reinforge.config.load import resume_config

    def config(name: str):
        return build_config([*MICRO, "train.steps=4", "log.samples_every=1", "log.samples_per_step=2",
                             "checkpoint.every=2", "checkpoint.keep_last=2", f"output_dir={tmp_path / name}"])

    run(config("whole"))
    run(config("cut"))
    cut = tmp_path / "cut"
    (newest,) = [p for p in (cut / "checkpoints").iterdir() if p.name.endswith("4")]
    shutil.rmtree(newest)
    (cut / "samples.jsonl").write_text((cut / "samples.jsonl").read_text() + '{"step": 5, "torn')
    run(resume_config(cut), resume=True)
    whole = (tmp_path / "whole" / "samples.jsonl").read_text()
    assert [json.loads(x)["step"] for x in whole.splitlines()] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert (cut / "samples.jsonl").read_text() == whole
