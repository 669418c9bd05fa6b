"""The asynchronous loop (loops/async_rl.py): bounded staleness, eta = 0 equals the synchronous
loop, the staleness gate's arithmetic, and in-order taking under random completion order."""

from __future__ import annotations

import json
import random

import pytest
import torch

from reinforge.config import build_config
from reinforge.curation.batches import PromptStream
from reinforge.jobs.rl import run_rl
from reinforge.jobs.start import objective_spec
from reinforge.loops.async_rl import StalenessGate, StreamSource, staleness
from reinforge.models import load_policy
from reinforge.rollout import SamplingParams, build_engine
from reinforge.rollout.rows import FinishedRow
from reinforge.rollout.stream import (
    FinishedGroup,
    GroupRequest,
    LocalSampler,
    WorkerTimes,
    finished_group,
)
from reinforge.tasks import Example, build_task
from reinforge.telemetry.recorder import TIMING_KEYS


def _run(overrides: list[str], mode: str):
    cfg = build_config(overrides)
    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.model, cfg.seed)
    task = build_task(cfg.task.name, **cfg.task.options)
    spec = objective_spec(cfg)
    engine = build_engine(cfg.rollout, policy)
    records = []
    assert cfg.train.mode == mode
    run_rl(cfg, policy, engine, task, spec, lambda record, state: records.append(record))
    return policy, records


def _numbers(metrics: dict) -> dict:
    """The metrics that do not measure time or the async machinery itself (NaN as None, to compare)."""
    return {k: None if v != v else v for k, v in metrics.items()
            if k not in TIMING_KEYS and not k.startswith("async/") and not k.endswith("_per_s")
            and k not in ("generation_seconds", "step_seconds")}


@pytest.mark.parametrize("recipe", ["grpo", "areal"])
def test_eta_zero_reproduces_the_synchronous_loop(micro_overrides, recipe):
    """Same seed, max_staleness 0: the same samples, metrics and weights, bit for bit."""
    # The probe after every update on both sides (the sync engine's default is every 10th): its figure compared too.
    # The synchronous loop's first backward would take the engine's activations (train.reuse_activations), equal to
    # the learner's forward to float rounding but not bit for bit; the sampler thread keeps none.
    base = [*micro_overrides, f"recipe={recipe}", "train.max_staleness=0", "rollout.max_new_tokens=6",
            "train.weight_sync.every=1", "train.reuse_activations=false"]
    sync_policy, sync_records = _run([*base, "train.mode=sync"], "sync") if recipe == "grpo" else (None, None)
    if recipe == "areal":    # areal's preset is async; its sync counterpart is the same loss under grpo's name
        sync_policy, sync_records = _run(
            [
                *base, "recipe=grpo", "objective.policy_loss=decoupled_ppo", "objective.kl_estimator=none",
                "objective.kl_coef=0", "objective.aggregation=token_mean", "train.mode=sync",
            ],
            "sync",
        )
    async_policy, async_records = _run([*base, "train.mode=async"], "async")
    assert len(sync_records) == len(async_records) == 3
    for s, a in zip(sync_records, async_records, strict=True):
        assert _numbers(s.metrics) == _numbers(a.metrics)
        assert a.metrics["async/staleness_max"] == 0
    for (name, p), (_, q) in zip(
        sync_policy.model.named_parameters(), async_policy.model.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("in_flight", ["interrupt", "finish"])
def test_staleness_never_exceeds_eta_with_random_lengths(micro_overrides, in_flight, monkeypatch):
    """A real run (the sampler thread) with long-tailed random lengths: every trained sample's
    staleness, measured from the versions recorded per token, is at most eta."""
    import reinforge.loops.async_rl as async_rl

    seen: list[torch.Tensor] = []
    original = async_rl.staleness

    def recording(version, group):
        out = original(version, group)
        seen.append(out)
        return out

    monkeypatch.setattr(async_rl, "staleness", recording)
    eta = 2
    _, records = _run(
        [
            *micro_overrides, "recipe=areal", f"train.max_staleness={eta}", f"train.in_flight={in_flight}",
            "train.steps=6", "rollout.max_new_tokens=16", "rollout.stop=['1','2','3']", "sft.steps=0",
        ],
        "async",
    )
    stale = torch.cat(seen)
    assert len(stale) == 6 * 4 * 4                 # every trained sample, once
    assert int(stale.max()) <= eta and int(stale.min()) >= 0
    assert int(stale.max()) >= 1                   # generation did run ahead of the learner
    lengths = [r.metrics["response_length_max"] - r.metrics["response_length_mean"] for r in records]
    assert max(lengths) > 2                        # the lengths did vary
    for r in records:
        assert r.metrics["async/too_stale_total"] == 0
        assert sum(r.metrics[f"async/staleness_{k}"] for k in range(eta + 1)) == pytest.approx(1.0)
    # train.old_logprobs=auto: pi_old is the sampler's (no sampler-learner mismatch at all) only in a batch sampled
    # wholly at the learner's weights; a stale row's sampler log-probs are an older policy's, and pi_old recomputed
    steps = [(r.metrics["async/staleness_max"], r.metrics["mismatch_abs_diff_mean"]) for r in records]
    assert {max_stale > 0 for max_stale, _ in steps} == {True, False}, steps
    assert all((gap == 0.0) == (max_stale == 0) for max_stale, gap in steps), steps


def test_filtered_groups_are_replaced_under_active_refill(micro_overrides):
    """olmo3 asynchronously: zero-variance groups are dropped, leave the gate's count, and new
    requests fill the batch; the staleness bound still holds."""
    _, records = _run(
        [
            *micro_overrides, "recipe=olmo3", "train.mode=async", "train.max_staleness=1", "sft.steps=0",
            "rollout.max_new_tokens=6",
            "reward.functions=[{name: verifier}, {name: format, params: {pattern: '1', mode: search}}]",
        ],
        "async",
    )
    assert len(records) == 3
    assert sum(r.metrics["curation/dropped_zero_variance"] for r in records) > 0    # some groups were filtered
    assert all(r.metrics["async/staleness_max"] <= 1 for r in records if "async/staleness_max" in r.metrics)
    assert records[-1].metrics["async/too_stale_total"] == 0


def test_gate_admits_exactly_the_areal_bound():
    """floor(N / B) <= eta + v: with B = 4, eta = 1 at v = 0, requests 0..7 may start, the 9th not."""
    gate = StalenessGate(batch_size=4, max_staleness=1)
    started = 0
    while gate.may_start(version=0):
        gate.start()
        started += 1
    assert started == 8
    assert gate.may_start(version=1)            # one learner step later: 4 more
    gate.release(3)                             # three dropped and replaced
    assert gate.counted == 5


class ShuffledWorkers:
    """Fake workers: finish requests in random order, each sample stamped with the version it started
    at; publish() moves the version. `get` returns one finished group at a time."""

    def __init__(self, group_size: int, seed: int):
        self.rng = random.Random(seed)
        self.g, self.version = group_size, 0
        self.running: list[tuple[int, int]] = []
        self.submitted: list[int] = []

    def submit(self, requests):
        self.running += [(r.seq, self.version) for r in requests]
        self.submitted += [r.seq for r in requests]

    def get(self, timeout):
        seq, version = self.running.pop(self.rng.randrange(len(self.running)))
        n = self.rng.randint(1, 5)
        rows = [FinishedRow(None, torch.ones(n, dtype=torch.long), torch.zeros(n), torch.full((n,), version), False)
                for _ in range(self.g)]
        return finished_group(seq, rows, [1, 2], Tokenizer())

    def publish(self, model, version):
        self.version = version

    def times(self):
        return WorkerTimes()

    def close(self):
        pass


class Tokenizer:
    pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x"] * len(ids)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_in_order_taking_bounds_staleness_under_random_completion_order(eta):
    pool = PromptStream([Example(prompt=str(i), answer="0", meta={}) for i in range(50)], seed=0)
    workers = ShuffledWorkers(group_size=2, seed=eta)
    b = 3
    source = StreamSource(pool, workers, StalenessGate(b, eta), version=0)
    order: list[int] = []
    for _ in range(20):
        examples, rollout = source.draw(b, 0)
        assert rollout.num_rows == b * 2
        stale = torch.cat([staleness(source.version, group) for group in source.taken])
        assert int(stale.max()) <= eta
        order += [g.seq for g in source.taken]
        source.step_metrics()
        source.publish(None)
    assert order == list(range(len(order)))          # taken in request order, none lost or twice
    assert source.too_stale == 0
    # the gate kept at most B (eta + 1) groups requested and untrained
    assert len(source.examples) <= b * (eta + 1)


def test_a_groups_samples_depend_on_its_key_not_on_the_worker_or_its_other_requests(micro_overrides):
    policy = load_policy(build_config(micro_overrides).model, seed=0)
    with torch.no_grad():   # <eos> likely in some contexts: rows of different lengths, slots reused
        policy.model.get_output_embeddings().weight[policy.tokenizer.eos_token_id] *= 30
    params = SamplingParams(temperature=1.0, max_new_tokens=8)

    def decode(requests: list[GroupRequest], slots: int) -> dict[int, FinishedGroup]:
        sampler = LocalSampler(policy, params, group_size=3, slots=slots)
        try:
            sampler.submit(requests)
            done: dict[int, FinishedGroup] = {}
            while len(done) < len(requests):
                group = sampler.get(30.0)
                assert group is not None
                done[group.seq] = group
            return done
        finally:
            sampler.close()

    together = decode(
        [GroupRequest(0, "12+34=", 111), GroupRequest(1, "7+8=", 222), GroupRequest(2, "1+1=", 333)], slots=4
    )
    alone = decode([GroupRequest(9, "7+8=", 222)], slots=3)
    assert torch.equal(together[1].rollout.completion_ids, alone[9].rollout.completion_ids)
    assert together[1].rollout.texts == alone[9].rollout.texts
    other_key = decode([GroupRequest(9, "7+8=", 223)], slots=3)
    assert other_key[9].rollout.texts != alone[9].rollout.texts


def test_finished_group_versions_and_staleness_per_sample():
    rows = [FinishedRow(None, torch.tensor([5, 6, 1]), torch.zeros(3), torch.tensor([2, 3, 3]), False),
            FinishedRow(None, torch.tensor([1]), torch.zeros(1), torch.tensor([4]), False)]
    group = finished_group(7, rows, [1, 2], Tokenizer())
    assert isinstance(group, FinishedGroup) and group.seq == 7
    assert group.oldest_version == 2
    assert group.versions.tolist() == [[2, 3, 3], [4, 0, 0]]
    assert staleness(5, group).tolist() == [3, 1]     # from each sample's oldest token


def test_a_resumed_async_run_trains_the_same_prompts_in_the_same_order(tmp_path, micro_overrides, monkeypatch):
    """The checkpoint holds the prompts requested and not yet trained on (RLState.pending): a resumed
    run requests them again first, so no prompt is lost or trained twice across the restart."""
    from reinforge.jobs.train import run
    from reinforge.telemetry.checkpoint import CheckpointStore

    trained: list[list[str]] = []
    real_draw = StreamSource.draw

    def draw(self, n, version):
        examples, rollout = real_draw(self, n, version)
        trained.append([e.prompt for e in examples])
        return examples, rollout

    monkeypatch.setattr(StreamSource, "draw", draw)
    args = [*micro_overrides, "recipe=areal", "train.max_staleness=1", "train.steps=4", "checkpoint.every=1"]
    run(build_config([*args, f"output_dir={tmp_path / 'whole'}"]))
    whole, trained[:] = list(trained), []
    real_save = CheckpointStore.save

    def save(self, at, tensors, meta):
        out = real_save(self, at, tensors, meta)
        if at == 2:
            assert len(tensors["rl"]["pending"]) > 0      # requests in flight at the checkpoint
            raise KeyboardInterrupt
        return out

    with monkeypatch.context() as patch:
        patch.setattr(CheckpointStore, "save", save)
        with pytest.raises(KeyboardInterrupt):
            run(build_config([*args, f"output_dir={tmp_path / 'cut'}"]))
    assert trained == whole[:2]
    trained[:] = []
    resumed = run(build_config([*args, f"output_dir={tmp_path / 'cut'}"]), resume=True)
    assert resumed.summary["resumed_from_step"] == 2
    assert trained == whole[2:]


def test_backend_ray_needs_async_or_learner_ranks(micro_overrides):
    from reinforge.errors import ConfigError
    from reinforge.jobs.start import prepare

    with pytest.raises(ConfigError, match="ray.learner_ranks >= 2"):
        prepare(build_config([*micro_overrides, "backend=ray"]))
    with pytest.raises(ConfigError, match="shared_prefix"):     # learner ranks' own refusals, before Ray starts
        prepare(build_config([*micro_overrides, "backend=ray", "ray.learner_ranks=2"]))
    prepare(build_config([*micro_overrides, "backend=ray", "ray.learner_ranks=2", "train.shared_prefix=false"]))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rl_ends_cleanly_when_every_prompt_has_retired(tmp_path, micro_overrides, mode):
    """No positive resampling with an easy reward: each prompt leaves the pool after its first
    group, so 8 prompts last two steps of 4; RL then ends (fewer prompts left than a step needs),
    and the run still evaluates and exports."""
    from reinforge.jobs.train import run

    out = tmp_path / "run"
    result = run(build_config([*micro_overrides, f"train.mode={mode}", "train.num_prompts=8", "train.steps=5",
                               "curation.retire_pass_rate=0.5", "train.max_staleness=0",
                               "reward.functions=[{name: format, params: {pattern: '.', mode: search}}]",
                               f"output_dir={out}"]))
    assert result.summary["rl_steps"] == 2 and "only 0 of the 8 train prompts are left" in result.summary["rl_stopped"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["stage"] == "rl"] == [1, 2]
    assert any(x["stage"] == "stopped" for x in lines) and (out / "model" / "model.safetensors").is_file()
