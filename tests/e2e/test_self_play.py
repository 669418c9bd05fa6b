"""Pairs the model makes itself: self-rewarding (dpo.pairs=self_judged) and SPIN (dpo.pairs=spin)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from repo_paths import REPO
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.curation.batches import PromptStream
from reinforge.jobs.multistage import PipelineSpec, run_pipeline, stage_configs
from reinforge.loops.self_play import SelfJudgedPairs, SpinPairs, judged_pairs
from reinforge.models import load_policy
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rewards.judge import Judge
from reinforge.rollout import SamplingParams
from reinforge.settings.judge import JudgeConfig
from reinforge.tasks import Example, SFTExample, build_task
from tests.judge_fixtures import ScriptedEngine

NAN = math.nan


def test_judged_pairs_by_hand() -> None:
    scores = torch.tensor([
        [1.0, 0.0, 1.0, 0.0],     # best: sample 0 (first of the 1s), worst: sample 1 -> rows (0, 1)
        [1.0, 1.0, 1.0, 1.0],     # all tie: no pair
        [NAN, 0.0, NAN, 1.0],     # unscored samples take no part -> rows (11, 9)
        [NAN, NAN, 2.0, NAN],     # one scored sample: no pair
        [0.5, NAN, -1.0, 3.0],    # -> rows (19, 18)
        [NAN, NAN, NAN, NAN],
    ])
    assert judged_pairs(scores) == [(0, 1), (11, 9), (19, 18)]


def _sum_judge(prompt: str, k: int) -> str:
    """The judge's engine: "judge: a+b=c\\n" -> score 1 when c = a + b, 0 when not, no score for "7"."""
    problem, completion = prompt.removeprefix("judge: ").strip().split("=")
    a, b = map(int, problem.split("+"))
    return "hmm" if completion == "7" else f"{a + b} score: {int(completion == str(a + b))}"


def _decoded(tokenizer, seq) -> list[str]:
    return [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            for ids, mask in zip(seq.input_ids, seq.attention_mask, strict=True)]


def test_self_judged_pairs_the_best_and_worst_judged_sample_of_each_prompt() -> None:
    tokenizer = build_char_tokenizer()
    samples = {"1+1=": ["3", "2", "2", "7"], "2+2=": ["4", "4", "4", "4"], "3+3=": ["7", "5", "6", "8"]}
    engine = ScriptedEngine(tokenizer, lambda p, k: samples[p][k])
    judge_engine = ScriptedEngine(tokenizer, _sum_judge)
    examples = [Example(p, str(eval(p[:-1])), {}) for p in samples]
    source = SelfJudgedPairs(PromptStream(examples, seed=0), engine, Judge(judge_engine, JudgeConfig()),
                             build_task("arithmetic"), SamplingParams(max_new_tokens=4), prompts_per_step=3,
                             group_size=4, pad_id=tokenizer.pad_token_id)
    pairs = source.draw(version=0)
    drawn = engine.calls[0][0]
    # Per prompt, as drawn: 1+1= -> chosen "2" (sample 1), rejected "3" (sample 0); 2+2= ties; 3+3= -> "6" over "5".
    expected = {"1+1=": ("1+1=2", "1+1=3"), "3+3=": ("3+3=6", "3+3=5")}
    order = [p for p in drawn if p in expected]
    texts = _decoded(tokenizer, pairs.sequences)
    assert texts == [expected[p][0] for p in order] + [expected[p][1] for p in order]
    assert len(judge_engine.calls[0][0]) == 12 and "judge: 3+3=7\n" in judge_engine.calls[0][0]
    m = pairs.metrics
    assert (m["dpo/pairs"], m["judge/unscored"], m["judge/tied_prompts"]) == (2.0, 2.0, 1.0)
    assert (m["dpo/chosen_correct"], m["dpo/rejected_correct"]) == (1.0, 0.0)
    assert m["reward_mean"] == pytest.approx(7 / 12)       # the verifier reports only: 2, 2, 4 x4, 6 right


def test_spin_pairs_sft_completions_against_the_policys_samples() -> None:
    cfg = build_config(["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
                        "model.intermediate_size=64"])
    policy = load_policy(cfg.model, 0)
    tokenizer = policy.tokenizer
    data = [SFTExample("1+1=", "2", True), SFTExample("2+2=", "4", True), SFTExample("3+3=", "7", False)]
    sampled = {"1+1=": "3", "2+2=": "4", "3+3=": "6"}        # 2+2= samples its SFT completion: no pair
    engine = ScriptedEngine(tokenizer, lambda p, k: sampled[p])
    source = SpinPairs(PromptStream(data, seed=0), policy, engine, SamplingParams(max_new_tokens=4),
                       prompts_per_step=3, chat_template="auto")
    pairs = source.draw(version=0)
    order = [p for p in engine.calls[0][0] if p != "2+2="]
    chosen = {"1+1=": "1+1=2", "3+3=": "3+3=7"}                  # the SFT data, right or not
    assert _decoded(tokenizer, pairs.sequences) == [chosen[p] for p in order] + [p + sampled[p] for p in order]
    # Both sides end with eos: the SFT completion is written as SFT trains it, the sample as it was drawn.
    assert pairs.sequences.completion_mask.sum(dim=1).tolist() == [2.0] * 4
    assert engine.calls[0][1] == 1
    assert (pairs.metrics["dpo/pairs"], pairs.metrics["spin/identical"]) == (2.0, 1.0)


def _rl(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"]


def test_spin_end_to_end(tmp_path, micro_overrides) -> None:
    out = tmp_path / "spin"
    result = CliRunner().invoke(app, ["train", *micro_overrides, "recipe=dpo", "dpo.pairs=spin", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = _rl(out)
    assert [r["policy_version"] for r in rl] == [1, 2, 3] and all(r["dpo/pairs"] > 0 for r in rl)
    assert rl[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)        # the policy is its reference at step 1
    refused = CliRunner().invoke(app, ["train", *micro_overrides, "recipe=dpo", "dpo.pairs=spin",
                                       "sft.source=rejection", f"output_dir={tmp_path / 'no'}"])
    assert refused.exit_code != 0 and "sft.source=teacher or file" in refused.output


def test_self_judged_end_to_end(tmp_path, micro_overrides, monkeypatch) -> None:
    """The micro model cannot write a judgement: every sample is unscored, no pair forms, nothing moves.
    With a judge that scores by length (a scripted engine in place of the judge model), pairs form and DPO steps."""
    out = tmp_path / "unjudged"
    result = CliRunner().invoke(app, ["train", *micro_overrides, "recipe=dpo", "dpo.pairs=self_judged",
                                      f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = _rl(out)
    assert all(r["judge/unscored"] == 16 and r["dpo/pairs"] == 0 and r["policy_version"] == 0 for r in rl)

    import reinforge.jobs.rl

    def by_length(cfg, policy, device, chat_template):
        return Judge(ScriptedEngine(policy.tokenizer, lambda p, k: f"score: {len(p) / 1000}"), cfg)

    monkeypatch.setattr(reinforge.jobs.rl, "build_judge", by_length)
    out = tmp_path / "judged"
    result = CliRunner().invoke(app, ["train", *micro_overrides, "recipe=dpo", "dpo.pairs=self_judged",
                                      f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = _rl(out)
    assert all(r["judge/unscored"] == 0 for r in rl) and sum(r["dpo/pairs"] for r in rl) > 0
    stepped = [r for r in rl if r["dpo/pairs"] > 0]
    assert stepped[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5) and rl[-1]["policy_version"] == len(stepped)


@pytest.mark.parametrize("name", ["self_rewarding", "spin"])
def test_shipped_pipelines_run_end_to_end(name, tmp_path, micro_overrides) -> None:
    spec = PipelineSpec.load(name)
    configs = stage_configs(spec, [], tmp_path / "defaults")
    pairs = {"self_rewarding": "self_judged", "spin": "spin"}[name]
    assert [(c.recipe, c.dpo.pairs, c.sft.enabled) for c in configs[1:]] == [("dpo", pairs, False)] * 2
    assert configs[0].sft.judge_fraction == (0.5 if name == "self_rewarding" else 0.0)
    short = [f"{stage.name}:{key}" for stage in spec.stages[1:]
             for key in ("train.steps=2", "train.prompts_per_step=4", "train.group_size=4")]
    result = run_pipeline(name, [*micro_overrides, *short], tmp_path / "out")
    assert [(s.name, s.rl_steps) for s in result.stages] == [(spec.stages[0].name, 0), ("iteration_1", 2),
                                                             ("iteration_2", 2)]
    for before, after in zip(result.stages[:-1], result.stages[1:], strict=True):
        assert after.start == before.final       # each iteration starts from the model the previous one ended with
    sft = json.loads((tmp_path / "out" / f"1-{spec.stages[0].name}" / "summary.json").read_text())["sft"]
    assert sft.get("judge_examples") == (16 if name == "self_rewarding" else None)     # half of sft.num_examples=32


@pytest.mark.slow
def test_benchmark_script_runs_in_a_small_configuration() -> None:
    """benchmarks/learned_rewards_self.py (the numbers of docs/self-play.md), with a micro model."""
    import subprocess
    import sys

    small = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
             "model.intermediate_size=64", "sft.steps=3", "sft.batch_size=8", "sft.num_examples=64", "train.steps=2",
             "eval.num_prompts=8", "eval.num_samples=2"]
    script = REPO / "benchmarks" / "learned_rewards_self.py"
    for extra in ([], ["--spin"]):
        done = subprocess.run([sys.executable, str(script), *extra, *small], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        gain = "spin_gain" if extra else "self_rewarding_gain"
        assert out[gain] == pytest.approx(out["after_pass@1"] - out["start_pass@1"]) and out["seconds"] > 0
        if not extra:
            assert 0.0 <= out["judge_accuracy"] <= 1.0 and out["judge_unscored"] == 1.0   # the micro model never judges
