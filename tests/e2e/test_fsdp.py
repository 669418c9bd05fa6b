"""FSDP2 learner ranks (reinforge.distributed.fsdp): two gloo ranks, each holding its `rank_rows` of a
rollout batch, take the gradient and the optimizer step of one process that holds the whole batch.

The ranks hold uneven shares (5 prompt groups: 8 and 12 rows, so 3 and 4 micro-batches of 3 rows, and
in one case 0 and 4 rows), so the busier rank's extra micro-batch is matched by a zero-loss pass on
the other. FSDP sums the ranks' gradients (`shard_model`); their loss weights use the global counts
(DistributedReduce). Traffic stays on loopback (env:// rendezvous on 127.0.0.1, gloo on lo).
"""

import copy
import dataclasses
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reinforge.curation.batches import PoolExhausted
from reinforge.distributed import (
    full_state_dict,
    init_learner_group,
    leave_learner_group,
    load_full_state_dict,
    rank_rows,
    shard_model,
)
from reinforge.distributed.data_parallel import RankShare, SplitAcrossRanks, from_rank_0
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    UpdateSettings,
    build_optimizer,
    build_sequences,
    completion_token_stats,
    policy_update,
    token_logprobs,
    warmup_constant,
)
from reinforge.models import build_tiny_qwen2
from reinforge.objectives import LOCAL, resolve_spec
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.settings import ModelConfig

GROUPS, GROUP_SIZE, T = 5, 4, 6
MODEL = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=64)
# (aggregation, LM-head chunk size (0: the full-logits forward), rows: all 20, or group 0 alone)
CASES = [("token_mean", 0, "all"), ("seq_mean_token_mean", 0, "all"), ("seq_mean_token_mean", 5, "all"),
         ("prompt_mean", 0, "all"), ("token_mean", 5, "group 0")]


def _batch(policy) -> LearnerBatch:
    """A rollout-like batch: 5 prompts x 4 completions of 1..6 tokens, pi_old and the reference off the policy."""
    g = torch.Generator().manual_seed(0)
    n, vocab = GROUPS * GROUP_SIZE, len(policy.tokenizer)
    group_ids = torch.arange(GROUPS).repeat_interleave(GROUP_SIZE)                       # [N]
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
               for _ in range(GROUPS)]
    mask = (torch.arange(T) < torch.randint(1, T + 1, (n,), generator=g)[:, None]).float()  # [N, T]
    completions = torch.randint(3, vocab, (n, T), generator=g) * mask.long()                  # pad id 0 after the end
    seq = build_sequences([prompts[i] for i in group_ids.tolist()], completions, mask, policy.tokenizer.pad_token_id,
                          group_ids=group_ids)
    with torch.no_grad():
        logprobs = completion_token_stats(policy.model, seq).logprobs
    old = logprobs + 0.1 * torch.randn(n, T, generator=g) * mask      # ratios off 1: some tokens clipped
    return LearnerBatch(sequences=seq, advantages=torch.randn(n, generator=g), old_logprobs=old, sampler_logprobs=old,
                        group_ids=group_ids, ref_logprobs=logprobs - 0.2 * torch.randn(n, T, generator=g) * mask)


def _update(model, batch, aggregation, chunk, *, lr, grad_clip):
    """One optimizer step (ppo_epochs = mini_batches = 1) in micro-batches of 3 rows; lr 0 keeps the
    weights, so the gradient stays readable after."""
    optimizer = build_optimizer(model, lr=lr)
    settings = UpdateSettings(
        grad_clip=grad_clip, forward=ForwardPlan(micro_batch_size=3, chunk_size=chunk), max_length=T
    )
    return policy_update(
        model,
        optimizer,
        warmup_constant(optimizer, 0),
        batch,
        resolve_spec("grpo", aggregation=aggregation),
        settings,
        torch.Generator().manual_seed(0),
    )


def _rank_part(batch, mine, reduce):
    """This rank's rows `mine` [N] (bool) of `batch`, as the learner gets them (DataParallel.share)."""
    return dataclasses.replace(
        batch.select(mine), share=RankShare(reduce, rows=mine.nonzero().squeeze(1), total=len(mine))
    )


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _join(rank: int, port: int):
    """This spawned process as rank `rank` of two gloo ranks on loopback, one torch thread."""
    os.environ.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    return init_learner_group()


def _worker(rank: int, port: int) -> None:
    group = _join(rank, port)
    try:
        assert (group.rank, group.world_size, group.device.type) == (rank, 2, "cpu")
        policy = build_tiny_qwen2(MODEL, seed=0)
        whole = _batch(policy)
        for aggregation, chunk, rows in CASES:
            batch = whole if rows == "all" else whole.select(whole.group_ids == 0)
            mine = rank_rows(batch.group_ids, group.rank, group.world_size)
            assert int(mine.sum()) == {"all": [8, 12], "group 0": [0, 4]}[rows][rank]
            single = copy.deepcopy(policy.model)
            single_stats = _update(single, batch, aggregation, chunk, lr=0.0, grad_clip=1e9)
            sharded = shard_model(copy.deepcopy(policy.model))
            stats = _update(sharded, _rank_part(batch, mine, group.reduce), aggregation, chunk, lr=0.0, grad_clip=1e9)
            grads = {name: p.grad.full_tensor() for name, p in sharded.named_parameters()}
            expected = {name: p.grad for name, p in single.named_parameters()}
            assert sum(float(g.abs().sum()) for g in expected.values()) > 1e-2      # not vacuous
            assert _max_diff(grads, expected) <= 1e-6, (aggregation, chunk, rows)
            assert stats.optimizer_steps == single_stats.optimizer_steps == 1
            assert stats.metrics["grad_norm"] == pytest.approx(single_stats.metrics["grad_norm"], rel=1e-6)

        # One AdamW step with the gradient clipped by the global norm (about 10x the clip): the same weights,
        # up to Adam's first step lr g / (|g| + eps), which turns the rounding of gradients near eps into
        # up to a fraction of lr (measured 5e-7 with lr 1e-3).
        single = copy.deepcopy(policy.model)
        single_stats = _update(single, whole, "seq_mean_token_mean", 0, lr=1e-3, grad_clip=0.1)
        sharded = shard_model(copy.deepcopy(policy.model))
        _update(
            sharded,
            _rank_part(whole, rank_rows(whole.group_ids, group.rank, 2), group.reduce),
            "seq_mean_token_mean",
            0,
            lr=1e-3,
            grad_clip=0.1,
        )
        assert single_stats.metrics["grad_norm"] > 0.5
        state = full_state_dict(sharded)
        if rank == 0:
            assert _max_diff(state, single.state_dict()) <= 1e-5
            assert _max_diff(single.state_dict(), policy.model.state_dict()) > 1e-4      # the step moved the weights

        # A non-finite loss on rank 1 alone: both ranks skip the step, and the weights stay.
        sharded = shard_model(copy.deepcopy(policy.model))
        local = _rank_part(whole, rank_rows(whole.group_ids, group.rank, 2), group.reduce)
        if rank == 1:
            local = dataclasses.replace(
                local, advantages=local.advantages.index_fill(0, torch.tensor([0]), float("nan"))
            )
        stats = _update(sharded, local, "token_mean", 0, lr=1e-3, grad_clip=1.0)
        assert (stats.optimizer_steps, stats.skipped_steps) == (0, 1)
        state = full_state_dict(sharded)
        if rank == 0:
            assert all(torch.equal(state[k], v) for k, v in policy.model.state_dict().items())

        # Gathered state: exactly the unsharded model's, on rank 0. A state loaded after a forward
        # without gradient (which leaves the root's parameters gathered) is the one the model uses, and
        # comes back exactly.
        sharded = shard_model(copy.deepcopy(policy.model))
        state = full_state_dict(sharded)
        if rank == 0:
            assert state.keys() == policy.model.state_dict().keys()
            assert all(torch.equal(state[k], v) for k, v in policy.model.state_dict().items())
        else:
            assert state == {}
        other = build_tiny_qwen2(MODEL, seed=1).model
        for plan in (ForwardPlan(), ForwardPlan(chunk_size=5)):
            with torch.no_grad():
                token_logprobs(sharded, whole.sequences, 1.0, plan)
            load_full_state_dict(sharded, other.state_dict() if rank == 0 else {})
            with torch.no_grad():
                torch.testing.assert_close(token_logprobs(sharded, whole.sequences, 1.0, plan),
                                           token_logprobs(other, whole.sequences, 1.0, plan), atol=1e-6, rtol=0)
            state = full_state_dict(sharded)
            if rank == 0:
                assert all(torch.equal(state[k], v) for k, v in other.state_dict().items())
            load_full_state_dict(sharded, policy.model.state_dict() if rank == 0 else {})

        with pytest.raises(NotImplementedError, match="train.shared_prefix=false"):
            policy_update(sharded, build_optimizer(sharded, lr=0.0), None, whole, resolve_spec("grpo"),
                          UpdateSettings(forward=ForwardPlan(shared_prefix=True)), torch.Generator())
    except BaseException:
        leave_learner_group(finished=False)
        raise
    leave_learner_group(finished=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process():
    mp.spawn(_worker, args=(_free_port(),), nprocs=2, join=True)


def _broadcast_worker(rank: int, port: int) -> None:
    group = _join(rank, port)
    try:
        calls = []

        def make():
            calls.append(rank)
            return {"rank": rank, "x": torch.arange(3) + 10 * rank}

        got = from_rank_0(group, make)
        # Only rank 0 computed; both hold its object.
        assert calls == ([0] if rank == 0 else [])
        assert got["rank"] == 0 and got["x"].tolist() == [0, 1, 2]

        def fail():
            raise PoolExhausted("no prompts left")

        with pytest.raises(PoolExhausted, match="no prompts left"):
            from_rank_0(group, fail)
    except BaseException:
        leave_learner_group(finished=False)
        raise
    leave_learner_group(finished=True)


def _split_worker(rank: int, port: int) -> None:
    group = _join(rank, port)
    try:
        policy = build_tiny_qwen2(MODEL, seed=0)
        with torch.no_grad():   # <eos> likely in some contexts: rows of different lengths
            policy.model.get_output_embeddings().weight[policy.tokenizer.eos_token_id] *= 40
        engine = NativeEngine(policy)
        asked = []

        class Recording:
            def generate(self, prompts, *args, **kwargs):
                asked.append(len(prompts))
                return engine.generate(prompts, *args, **kwargs)

        prompts = ["12+34=", "7+8=", "999+1=", "3 5 7>22:", "1+1="]
        params = SamplingParams(temperature=1.0, max_new_tokens=10)
        split, alone = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        got = SplitAcrossRanks(Recording(), group).generate(prompts, 3, params, 7, generator=split)
        want = engine.generate(prompts, 3, params, 7, generator=alone)
        # Rank 0 decoded prompts 0-1, rank 1 prompts 2-4; both hold the one-process rollout.
        assert asked == [[2], [3]][rank]
        assert torch.equal(got.completion_ids, want.completion_ids) and want.lengths.float().std() > 0
        assert torch.equal(got.completion_mask, want.completion_mask) and torch.equal(got.group_ids, want.group_ids)
        torch.testing.assert_close(got.sampler_logprobs, want.sampler_logprobs, atol=1e-5, rtol=0)
        assert got.texts == want.texts and got.prompt_ids == want.prompt_ids and got.policy_version == 7
        assert torch.equal(split.get_state(), alone.get_state())     # the generator advanced alike
    except BaseException:
        leave_learner_group(finished=False)
        raise
    leave_learner_group(finished=True)


@pytest.mark.slow
def test_generation_split_across_ranks_gives_the_one_process_rollout():
    mp.spawn(_split_worker, args=(_free_port(),), nprocs=2, join=True)


@pytest.mark.slow
def test_rank_0s_batch_reaches_every_rank_and_so_do_its_errors():
    mp.spawn(_broadcast_worker, args=(_free_port(),), nprocs=2, join=True)


def test_rank_rows_split_whole_groups_by_their_middle_row():
    # 5 groups of 4 (N = 20, shares [0, 10) and [10, 20)): middles 2, 6, 10, 14, 18 -> ranks 0, 0, 1, 1, 1.
    ids = torch.arange(5).repeat_interleave(4)
    assert rank_rows(ids, 0, 2).nonzero().squeeze(1).tolist() == list(range(8))
    assert rank_rows(ids, 1, 2).nonzero().squeeze(1).tolist() == list(range(8, 20))
    # Sizes 6, 1, 1 (shares [0, 4), [4, 8)): middles 3, 6.5, 7.5 -> 6 rows and 2.
    ids = torch.tensor([0] * 6 + [1, 2])
    assert rank_rows(ids, 0, 2).tolist() == [True] * 6 + [False] * 2
    # Groups in id order, wherever their rows sit: group 3 (3 rows, middle 1.5) before group 7 (middle 4),
    # shares of 2.5.
    ids = torch.tensor([7, 3, 7, 3, 3])
    assert rank_rows(ids, 0, 2).tolist() == [False, True, False, True, True]
    # Three ranks, six groups of 2 (shares of 4): two groups each.
    ids = torch.arange(6).repeat_interleave(2)
    assert [rank_rows(ids, r, 3).nonzero().squeeze(1).tolist() for r in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]
    # Fewer groups than ranks: one rank holds nothing. The ranks always partition the rows.
    ids = torch.tensor([4, 4, 4])
    assert [int(rank_rows(ids, r, 2).sum()) for r in range(2)] == [0, 3]
    assert rank_rows(torch.zeros(0, dtype=torch.long), 0, 2).tolist() == []
    with pytest.raises(ValueError, match="rank"):
        rank_rows(ids, 2, 2)


def test_world_of_one_initialises_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    group = init_learner_group()
    assert (group.rank, group.world_size, group.reduce) == (0, 1, LOCAL)
    assert not dist.is_initialized()
    # The state-dict helpers work on a plain model in one process.
    model, other = build_tiny_qwen2(MODEL, seed=0).model, build_tiny_qwen2(MODEL, seed=1).model
    state = full_state_dict(model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    load_full_state_dict(model, other.state_dict())
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in model.state_dict().items())
