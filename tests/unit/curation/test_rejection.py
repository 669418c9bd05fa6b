"""Rejection-sampling SFT data (kept set, dedup, cap, acceptance rate by hand) and distillation traces."""

from __future__ import annotations

import json

import pytest
import torch

from reinforge.config import build_config
from reinforge.curation.rejection import distillation_examples, rejection_sample
from reinforge.data import DatasetError
from reinforge.loops.sft import run_sft
from reinforge.models import build_tiny_qwen2
from reinforge.rollout import Rollout, SamplingParams, build_engine
from reinforge.tasks import Example, SFTExample
from reinforge.tasks.arithmetic import ArithmeticTask


class ScriptedEngine:
    """Each prompt's scripted (text, truncated) samples; only the fields rejection sampling reads are real."""

    def __init__(self, script: dict[str, list[tuple[str, bool]]]):
        self.script, self.calls = script, []

    def generate(self, prompts, group_size, params, policy_version=0) -> Rollout:
        self.calls.append(len(prompts))
        rows = [s for p in prompts for s in self.script[p][:group_size]]
        n = len(rows)
        return Rollout(
            prompt_ids=[[0]] * n,
            completion_ids=torch.zeros(n, 1, dtype=torch.long),
            pad_id=0,
            completion_mask=torch.ones(n, 1),
            sampler_logprobs=torch.zeros(n, 1),
            truncated=torch.tensor([t for _, t in rows]),
            group_ids=torch.arange(len(prompts)).repeat_interleave(group_size),
            policy_version=0,
            texts=[text for text, _ in rows],
        )


EXAMPLES = [Example("05+34=", "39", {}), Example("12+19=", "31", {}), Example("20+20=", "40", {})]
SCRIPT = {
    # verified: 039, 039, 39, 0039 (the verifier compares values); 0039 never ended (truncated): not kept;
    # ended and verified: 039, 039, 39 -> distinct 039, 39 (one duplicate) -> both kept (cap 2).
    "05+34=": [("039", False), ("039", False), ("40", False), ("39", False), ("0039", True), ("1", False)],
    # verified: 031, 31, 0031, 031, 031 (5) -> distinct 031, 31, 0031 (two duplicates) ->
    # cap keeps 031, 31 (one capped).
    "12+19=": [("031", False), ("31", False), ("0031", False), ("031", False), ("30", False), ("031", False)],
    # nothing right
    "20+20=": [("41", False)] * 6,
}


def test_kept_set_dedup_cap_and_acceptance_by_hand() -> None:
    engine = ScriptedEngine(SCRIPT)
    out = rejection_sample(engine, ArithmeticTask(), EXAMPLES, samples_per_prompt=6, sampling=SamplingParams(),
                           max_per_prompt=2, seed=0, batch_prompts=2)
    assert out.examples == [SFTExample("05+34=", "039", True), SFTExample("05+34=", "39", True),
                            SFTExample("12+19=", "031", True), SFTExample("12+19=", "31", True)]
    assert out.kept == [2, 2, 0] and out.accepted == [3, 5, 0]
    assert (out.samples, out.duplicates_removed, out.capped, out.truncated_rejected) == (18, 3, 1, 1)
    assert out.acceptance_rate == pytest.approx(8 / 18)
    assert out.metrics()["rejection/prompts_covered"] == pytest.approx(2 / 3)
    assert engine.calls == [2, 1]     # prompts in chunks of batch_prompts

    wide = rejection_sample(ScriptedEngine(SCRIPT), ArithmeticTask(), EXAMPLES, samples_per_prompt=6,
                            sampling=SamplingParams(), max_per_prompt=5, seed=0)
    assert [e.completion for e in wide.examples] == ["039", "39", "031", "31", "0031"] and wide.capped == 0


class ParityTask(ArithmeticTask):
    """A verifier an untrained model passes about half the time: the completion has an even length."""

    def reward(self, example, completion):
        return float(len(completion) % 2 == 0)


def test_real_engine_is_seeded_leaves_the_rng_alone_and_feeds_sft(micro_overrides) -> None:
    cfg = build_config(micro_overrides)
    policy = build_tiny_qwen2(cfg.model, seed=0)
    engine, task = build_engine(cfg.rollout, policy), ParityTask(digits=2)
    examples = task.train_split(6)
    before = torch.get_rng_state()
    runs = [
        rejection_sample(engine, task, examples, 4, SamplingParams(max_new_tokens=4), max_per_prompt=2, seed=3)
        for _ in range(2)
    ]
    assert torch.equal(before, torch.get_rng_state())
    assert runs[0] == runs[1] and runs[0].examples
    assert all(task.reward(None, e.completion) == 1.0 and e.correct for e in runs[0].examples)
    result = run_sft(policy, runs[0].examples, cfg.sft, chat_template="auto", seed=0)
    assert result.steps == cfg.sft.steps and torch.isfinite(torch.tensor(result.final_loss))


def test_distillation_examples_from_jsonl_and_parquet(tmp_path) -> None:
    rows = [{"question": "05+34=", "response": "039"}, {"question": "12+19=", "response": "031", "extra": 1}]
    path = tmp_path / "teacher.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [SFTExample("05+34=", "039", True), SFTExample("12+19=", "031", True)]
    fields = {"prompt": "question", "completion": "response"}
    assert distillation_examples(str(path), fields) == expected

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "teacher.parquet")
    assert distillation_examples(str(tmp_path / "teacher.parquet"), fields) == expected

    path.write_text('{"prompt": "a", "completion": "1"}\n{"prompt": "b"}\n')
    with pytest.raises(DatasetError, match=r"line 2: field 'completion' is missing"):
        distillation_examples(str(path))
