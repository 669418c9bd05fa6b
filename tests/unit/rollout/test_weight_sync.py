"""Weight-sync verification (rollout/weight_sync.py): after every publication the sampler scores a fixed
probe as the learner does. A normal run passes every step with a difference at float rounding; a run whose
sampler keeps old weights (a skipped publication, a load that changes nothing, a LoRA adapter the engine
ignores) stops at the first step with a weight_sync alert naming what did not sync."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reinforge.config import build_config
from reinforge.errors import RunStopped
from reinforge.jobs.train import run
from reinforge.models import decoder, load_policy
from reinforge.rollout import SamplingParams
from reinforge.rollout.probe import UNPUBLISHED
from reinforge.rollout.stream import LocalSampler
from reinforge.rollout.weight_sync import (
    SamplerProbe,
    compare,
    default_tolerance,
    learner_logprobs,
    probe_ids,
    total_variation,
)

# Rewards that differ within a group from the first step on, so that every step updates the weights.
VARIED = ["reward.functions=[{name: verifier}, {name: format, params: {pattern: '1', mode: search}}]",
          "curation.filters=[]", "rollout.max_new_tokens=6"]


def _run(micro, tmp_path, *extra):
    cfg = build_config([*micro, "sft.steps=0", *VARIED, *extra, f"output_dir={tmp_path}"])
    return run(cfg)


def _lines(path: Path, name: str) -> list[dict]:
    file = path / name
    return [json.loads(x) for x in file.read_text().splitlines()] if file.exists() else []


def test_compare_hand_numbers():
    # Two probe positions over a 3-token vocabulary: the learner's next-token distributions.
    learner = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]).log()
    # TV at position 1: 1/2 (|0.1 - 0.1004| + |0.1 - 0.0996| + 0) = 4e-4; position 0 equal: the max is 4e-4.
    near = SamplerProbe("engine", torch.tensor([[0.5, 0.3, 0.2], [0.1004, 0.0996, 0.8]]).log())
    # TV at position 0: 1/2 (0.2 + 0.1 + 0.1) = 0.2.
    far = SamplerProbe("ray worker 1", torch.tensor([[0.3, 0.4, 0.3], [0.1, 0.1, 0.8]]).log(), version=3)
    worst, alert = compare(3, 3, learner, [near], 1e-3)
    assert worst == pytest.approx(4e-4, abs=1e-7) and alert is None
    worst, alert = compare(3, 3, learner, [near, far], 1e-3)
    assert worst == pytest.approx(0.2, abs=1e-6) and alert.name == "weight_sync"
    assert "ray worker 1's next-token distributions on the probe differ from the learner's by total variation 0.2" \
        in alert.message
    _, alert = compare(4, 4, learner, [far], 1.0)       # within tolerance but one version behind
    assert "ray worker 1 holds weight version 3, not the published 4" in alert.message
    # A very unlikely token's log-prob off by 1e-3 (the size fp32 rounding reaches on a confident model's
    # probe tokens) is a TV of ~1e-12: not a failed sync.
    confident = torch.tensor([[1.0 - 2e-9, 1e-9, 1e-9]]).log()
    rounded = confident.clone()
    rounded[0, 1] += 1e-3
    assert compare(1, 1, confident, [SamplerProbe("engine", rounded)], 1e-3)[1] is None
    nan = SamplerProbe("engine", torch.tensor([[float("nan"), 0.3, 0.2], [0.1, 0.1, 0.8]]).log())
    assert compare(1, 1, learner, [nan], 1.0)[1] is not None
    other_vocab = SamplerProbe("engine", torch.tensor([[0.5, 0.5], [0.5, 0.5]]).log())
    assert compare(1, 1, learner, [other_vocab], 1.0)[1] is not None
    assert probe_ids(300).tolist() == [[(7919 * i + 3) % 300 for i in range(8)]]


# The async sampler thread is probed after every publication by default; an engine reading the trained
# tensors in one process only every 10th, unless train.weight_sync.every says otherwise (next test).
@pytest.mark.parametrize("extra", [["train.mode=sync", "train.weight_sync.every=1"], ["recipe=areal"],
                                   ["train.mode=sync", "model.lora.r=4", "train.weight_sync.every=1"]],
                         ids=["sync", "async-thread", "lora"])
def test_normal_runs_pass_the_check_every_step(micro_overrides, tmp_path, extra):
    _run(micro_overrides, tmp_path, *extra, "train.lr=1e-2")
    rl = [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]
    assert [x["step"] for x in rl] == [1, 2, 3]
    assert all(0 <= x["sync/probe_tv"] < 1e-5 for x in rl)
    assert all(x["grad_norm"] > 0 for x in rl)      # the weights moved: the check compared new weights
    assert not [a for a in _lines(tmp_path, "alerts.jsonl") if a["alert"] == "weight_sync"]


@pytest.mark.parametrize("every,probed", [(None, [1]), (2, [1, 2]), (1, [1, 2, 3])])
def test_an_engine_reading_the_trained_tensors_is_probed_after_the_first_update_and_every_nth(
        micro_overrides, tmp_path, every, probed):
    _run(micro_overrides, tmp_path, "train.mode=sync", "train.lr=1e-2",
         *([f"train.weight_sync.every={every}"] if every else []))
    rl = [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]
    assert [x["step"] for x in rl] == [1, 2, 3]
    assert [x["step"] for x in rl if "sync/probe_tv" in x] == probed
    assert all(x["sync/probe_tv"] < 1e-5 for x in rl if "sync/probe_tv" in x)


def _stops(micro, tmp_path, match: str, *extra):
    with pytest.raises(RunStopped, match=match):
        _run(micro, tmp_path, *extra, "train.lr=1e-2")
    alerts = [a for a in _lines(tmp_path, "alerts.jsonl") if a["alert"] == "weight_sync"]
    assert len(alerts) == 1 and alerts[0]["step"] == 1 and match in alerts[0]["message"]
    failed = [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "failed"]
    assert len(failed) == 1 and match in failed[0]["reason"]
    assert not [x for x in _lines(tmp_path, "metrics.jsonl") if x.get("stage") == "rl"]   # no step logged past it


def test_skipped_publication_to_the_sampler_thread_stops_the_run(micro_overrides, tmp_path, monkeypatch):
    publish = LocalSampler.publish

    def first_only(self, model, version):      # the initial weights go out; no update ever does
        if version == 0:
            publish(self, model, version)

    monkeypatch.setattr(LocalSampler, "publish", first_only)
    _stops(micro_overrides, tmp_path, "sampler thread holds weight version 0, not the published 1",
           "recipe=areal", "train.weight_sync.timeout_s=0.5")


def test_sampler_thread_that_loads_nothing_stops_the_run(micro_overrides, tmp_path, monkeypatch):
    """The version arrives, the weights do not: only the probe can tell."""
    load = LocalSampler._load

    def label_only(self, weights, version):
        load(self, {k: v for k, v in self.model.state_dict().items()}, version)

    monkeypatch.setattr(LocalSampler, "_load", label_only)
    _stops(micro_overrides, tmp_path, "sampler thread's next-token distributions on the probe differ", "recipe=areal")


def test_engine_without_the_lora_adapter_stops_the_run(micro_overrides, tmp_path, monkeypatch):
    """The native engine reads every projection through linear_weight; one that drops the adapter (W alone)
    samples from the base model. At step 0 B = 0, so the first update is where it shows."""
    def base_only(module):
        base = getattr(module, "get_base_layer", lambda: module)()
        return base.weight, base.bias

    monkeypatch.setattr(decoder, "linear_weight", base_only)
    _stops(micro_overrides, tmp_path, "native engine's next-token distributions on the probe differ", "train.mode=sync",
           "model.lora.r=4", "train.shared_prefix=false")


def test_the_check_can_be_turned_off(micro_overrides, tmp_path, monkeypatch):
    monkeypatch.setattr(LocalSampler, "publish", lambda self, model, version: None)
    _run(micro_overrides, tmp_path, "recipe=areal", "train.weight_sync.verify=false", "train.max_staleness=4",
         "train.steps=1")
    assert not any("sync/probe_tv" in x for x in _lines(tmp_path, "metrics.jsonl"))


def test_default_tolerance_follows_the_precision_of_the_weights():
    fp32, bf16 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert default_tolerance(fp32) == 1e-3 and default_tolerance(bf16) == 5e-2


def test_a_sampler_thread_passes_a_fresh_runs_first_probe_only_with_the_published_weights(micro_overrides):
    # A fresh run publishes version 0 (its step) and probes it at once. A sampler built with version 0 as
    # "held" passed that probe without waiting, scoring its built weights if its thread had not yet
    # applied the publication (seen under load: TV 0.148 on a Ray worker). Built weights are UNPUBLISHED.
    policy = load_policy(build_config(micro_overrides).model, seed=0)
    ids = probe_ids(policy.model.config.vocab_size)
    sampler = LocalSampler(policy, SamplingParams(temperature=1.0, max_new_tokens=4), group_size=2, slots=2)
    try:
        with torch.no_grad():            # the learner's weights, which only a publication can bring
            for p in policy.model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        learner = learner_logprobs(policy.model, ids)
        (built,) = sampler.probe(0, ids, timeout=0.05)      # nothing published: it waits, then says so
        assert built.version == UNPUBLISHED
        assert total_variation(built.logprobs, learner) > 0.01
        _, alert = compare(0, 0, learner, [built], 1.0)
        assert "sampler thread holds weight version -1, not the published 0" in alert.message
        sampler.publish(policy.model, 0)
        (published,) = sampler.probe(0, ids, timeout=30.0)
        assert published.version == 0
        assert total_variation(published.logprobs, learner) < 1e-5
    finally:
        sampler.close()
