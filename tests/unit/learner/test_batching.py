"""Micro-batches by length: every row once, the budgets kept, longest rows first."""

import pytest
import torch

from reinforge.learner.batching import plan_micro_batches


def test_rows_budget_and_order_by_hand():
    lengths = torch.tensor([3, 9, 5, 9, 2, 4])
    # Sorted longest first (stable): rows 1 (9), 3 (9), 2 (5), 5 (4), 0 (3), 4 (2).
    # Budget 18 tokens: [1, 3] = 2 x 9 = 18; then 5 x 3 = 15 <= 18 for [2, 5, 0]; adding row 4 would
    # make 5 x 4 = 20 > 18, so row 4 starts its own micro-batch.
    plan = plan_micro_batches(lengths, max_rows=4, max_tokens=18)
    assert [p.tolist() for p in plan] == [[1, 3], [2, 5, 0], [4]]
    # Rows only: groups of at most 4 in the same order.
    assert [p.tolist() for p in plan_micro_batches(lengths, max_rows=4)] == [[1, 3, 2, 5], [0, 4]]


@pytest.mark.parametrize(("max_rows", "max_tokens"), [(1, None), (3, None), (64, 10), (2, 1)])
def test_every_row_exactly_once_and_within_budget(max_rows, max_tokens):
    lengths = torch.randint(1, 12, (37,), generator=torch.Generator().manual_seed(0))
    plan = plan_micro_batches(lengths, max_rows, max_tokens)
    assert sorted(torch.cat(plan).tolist()) == list(range(37))
    for rows in plan:
        assert len(rows) <= max_rows
        if max_tokens is not None and len(rows) > 1:      # a single over-long row stands alone
            assert len(rows) * int(lengths[rows].max()) <= max_tokens


def test_padding_is_lower_than_in_arrival_order():
    lengths = torch.tensor([2, 30, 3, 28, 2, 29, 4, 31])
    padded = sum(len(rows) * int(lengths[rows].max()) for rows in plan_micro_batches(lengths, max_rows=2))
    arrival = sum(2 * int(lengths[i:i + 2].max()) for i in range(0, 8, 2))
    # Sorted pairs (31, 30), (29, 28), (4, 3), (2, 2) pad to 2 x 31 + 2 x 29 + 2 x 4 + 2 x 2 = 132 tokens;
    # arrival pairs (2, 30), (3, 28), (2, 29), (4, 31) pad to 2 x (30 + 28 + 29 + 31) = 236.
    assert (padded, arrival) == (132, 236)
    assert padded < arrival


def test_bad_budgets_are_errors():
    with pytest.raises(ValueError):
        plan_micro_batches(torch.tensor([1, 2]), max_rows=0)
    with pytest.raises(ValueError):
        plan_micro_batches(torch.tensor([1, 2]), max_rows=2, max_tokens=0)


def test_groups_stay_together_unless_larger_than_a_micro_batch() -> None:
    # Groups 0 and 1 (3 rows each) and group 2 (5 rows); longest rows first.
    groups = torch.tensor([0, 1, 0, 2, 1, 2, 2, 0, 2, 2, 1])
    lengths = torch.tensor([5, 9, 6, 3, 9, 4, 3, 5, 3, 3, 8])
    plan = [p.tolist() for p in plan_micro_batches(lengths, max_rows=6, groups=groups)]
    # Group 1 (longest row 9) and group 0 (6) fill one micro-batch; group 2 has its own.
    assert plan == [[1, 4, 10, 0, 2, 7], [3, 5, 6, 8, 9]]
    # max_rows 4: group 2 is split into 4 + 1 rows; the token budget (width x rows) still holds.
    plan = [p.tolist() for p in plan_micro_batches(lengths, max_rows=4, max_tokens=30, groups=groups)]
    assert plan == [[1, 4, 10], [0, 2, 7], [3, 5, 6, 8], [9]]
    assert sorted(r for p in plan for r in p) == list(range(11))


def test_shared_prompt_budget_counts_each_prompt_once() -> None:
    # Three groups of two rows; prompts of 10, 10 and 4 tokens, completions (lengths - prompt) 5 and 1,
    # 6 and 2, 3 and 3. The shared-prompt forward runs 10 + 5 + 1 = 16, 10 + 6 + 2 = 18 and 4 + 3 + 3 = 10
    # positions; rows x longest row would count 2 x 15 = 30, 2 x 16 = 32 and 2 x 7 = 14.
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    prompts = torch.tensor([10, 10, 10, 10, 4, 4])
    lengths = prompts + torch.tensor([5, 1, 6, 2, 3, 3])
    plan = [p.tolist() for p in plan_micro_batches(lengths, 8, 34, groups=groups, prompt_lengths=prompts)]
    # Longest first: group 1 (16), group 0 (15), group 2 (7): 18 + 16 = 34 fits, + 10 does not.
    assert plan == [[2, 3, 0, 1], [4, 5]]
    assert [p.tolist() for p in plan_micro_batches(lengths, 8, 34, groups=groups)] == [[2, 3], [0, 1], [4, 5]]
    assert [p.tolist() for p in plan_micro_batches(lengths, 8, 44, groups=groups, prompt_lengths=prompts)] == [
        [2, 3, 0, 1, 4, 5]]
    with pytest.raises(ValueError, match="pass groups"):
        plan_micro_batches(lengths, 8, 34, prompt_lengths=prompts)


def test_the_forward_plan_counts_shared_positions_on_cuda_only() -> None:
    from reinforge.learner import ForwardPlan, build_sequences

    prompts = [[5] * 40, [6] * 40]
    mask = torch.zeros(4, 8)
    mask[:, :4] = 1
    batch = build_sequences([p for p in prompts for _ in range(2)], torch.full((4, 8), 7), mask, 0,
                            group_ids=torch.tensor([0, 0, 1, 1]))
    plan = ForwardPlan(micro_batch_size=8, micro_batch_tokens=100, shared_prefix=True)
    # Rows of 44 tokens: 2 x 44 = 88 per group by rows x longest; 40 + 4 + 4 = 48 positions run.
    assert [p.tolist() for p in plan.micro_batches(batch)] == [[0, 1], [2, 3]]
    assert [p.tolist() for p in plan.micro_batches(batch, device="cpu")] == [[0, 1], [2, 3]]
    assert [p.tolist() for p in plan.micro_batches(batch, device="cuda")] == [[0, 1, 2, 3]]
