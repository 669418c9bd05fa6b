"""Multi-turn continuation in the native engine (`DecodeSession.extend`): a row goes on after an
observation from its stored keys/values, with the numbers of a full re-prefill, of a plain forward of
the whole sequence, of the row decoded alone, and with its sampling stream continuing across turns."""

from __future__ import annotations

import pytest
import torch
from unit.rollout.test_native_engine import PROMPTS, eos_prone

from reinforge.models import Policy, build_tiny_qwen2
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.rows import FinishedRow
from reinforge.rollout.sampling import keyed_uniforms, row_keys, sample_tokens
from reinforge.settings import ModelConfig

OBSERVATIONS = ["obs: 12\n", "tool said: nothing useful, try 7*6=\n"]   # written by the environment
PARAMS = SamplingParams(temperature=0.8, max_new_tokens=9)


def qwen2(num_kv_heads: int = 4) -> Policy:
    """A tiny Qwen2 whose <eos> is likely enough that turns end at different lengths, in every turn
    (at test_native_engine's factor, 40, most turns after an observation were <eos> alone)."""
    sizes = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads, intermediate_size=128)
    return eos_prone(build_tiny_qwen2(sizes, seed=0), scale=15.0)


def encode(policy: Policy, text: str) -> list[int]:
    return policy.tokenizer.encode(text, add_special_tokens=False)


def play(policy: Policy, prompts: list[str], observations: list[list[list[int]]], params: SamplingParams,
         keys: list[int], continuation: bool = True, cpu_kernels: bool = True, slots: int | None = None,
         delay: int = 0, together: bool = False) -> dict[int, list[FinishedRow]]:
    """Each prompt's trajectory: a model turn, then for each of its observations the observation and
    another turn. The driver extends a row `delay` steps after its turn ended (a tool running), while
    the other rows decode; `together`: once no row decodes, every row waiting, in one `extend_many`.
    Returns each row's turns, in order."""
    session = NativeEngine(policy, cpu_kernels=cpu_kernels).session(params, slots=slots or len(prompts),
                                                                    keep_context=True)
    session.continuation = continuation
    session.add(encode_prompts(policy.tokenizer, prompts, "auto"), 1, tags=range(len(prompts)),
                group_keys=torch.tensor(keys))
    turns: dict[int, list[FinishedRow]] = {r: [] for r in range(len(prompts))}
    tools: list[list] = []      # [steps left, row]
    while session.busy or tools:
        if together and not session.busy:
            session.extend_many([(row.context, observations[row.tag][len(turns[row.tag]) - 1], row.tag)
                                 for _, row in tools])
            tools.clear()
        for tool in [t for t in tools if t[0] == 0 and not together]:
            tools.remove(tool)
            row = tool[1]
            session.extend(row.context, observations[row.tag][len(turns[row.tag]) - 1], tag=row.tag)
        for tool in tools:
            tool[0] -= 1
        for row in session.step() if session.busy else []:
            turns[row.tag].append(row)
            if len(turns[row.tag]) <= len(observations[row.tag]):
                tools.append([delay, row])
    return turns


def whole_sequence(prompt_ids: list[int], turns: list[FinishedRow], observations: list[list[int]]):
    """The trajectory as one sequence and the positions of its model tokens."""
    ids, model_positions = list(prompt_ids), []
    for turn, obs in zip(turns, [*observations, []], strict=True):
        model_positions += range(len(ids), len(ids) + len(turn.tokens))
        ids += turn.tokens.tolist() + obs
    return ids, model_positions


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_continuation_equals_full_reprefill(cpu_kernels: bool, kv_heads: int) -> None:
    policy = qwen2(kv_heads)
    observations = [[encode(policy, text) for text in OBSERVATIONS]] * 3
    keys = [11, 22, 33]
    runs = {}
    for continuation in (True, False):
        runs[continuation] = play(policy, PROMPTS[:3], observations, PARAMS, keys, continuation, cpu_kernels)
    lengths = set()
    for r in range(3):
        assert len(runs[True][r]) == 3
        for cont, full in zip(runs[True][r][1:], runs[False][r][1:], strict=True):
            assert cont.tokens.tolist() == full.tokens.tolist()
            assert cont.truncated == full.truncated
            torch.testing.assert_close(cont.logprobs, full.logprobs, atol=1e-5, rtol=0)
            assert cont.context.ids == full.context.ids and cont.context.drawn == full.context.drawn
            for k_cont, k_full in zip(cont.context.keys, full.context.keys, strict=True):
                torch.testing.assert_close(k_cont, k_full, atol=1e-5, rtol=0)
            lengths.add(len(cont.tokens))
    assert len(lengths) > 2     # turns ended on <eos> at different lengths, some at max_new_tokens


def test_continuation_prefills_only_the_new_tokens(monkeypatch) -> None:
    """With continuation the decoder runs over the turn's last token and the observation alone."""
    from reinforge.rollout import continuation, native

    policy = qwen2()
    widths: list[int] = []
    run_pass = native.run_pass
    # The engine's prefill (native) and the session's continuation passes (continuation) each call it.
    for module in (native, continuation):
        monkeypatch.setattr(module, "run_pass", lambda shape, w, ids, *a, **k: widths.append(ids.shape[1])
                            or run_pass(shape, w, ids, *a, **k))
    obs = [encode(policy, text) for text in OBSERVATIONS]
    turns = play(policy, PROMPTS[:1], [obs], PARAMS, [5])[0]
    prompt = encode_prompts(policy.tokenizer, PROMPTS[:1], "auto")[0]
    assert widths == [len(prompt), 1 + len(obs[0]), 1 + len(obs[1])]
    assert [t.context.cached for t in turns] == [len(t.context.ids) - 1 for t in turns]


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_sampler_logprobs_equal_a_full_forward_of_the_trajectory(temperature: float) -> None:
    policy = qwen2()
    observations = [encode(policy, text) for text in OBSERVATIONS]
    params = SamplingParams(temperature=temperature, max_new_tokens=9)
    prompt_ids = encode_prompts(policy.tokenizer, PROMPTS, "auto")
    trajectories = play(policy, PROMPTS, [observations] * len(PROMPTS), params, list(range(len(PROMPTS))))
    for r, turns in trajectories.items():
        ids, positions = whole_sequence(prompt_ids[r], turns, observations)
        assert turns[-1].context.ids == ids
        with torch.no_grad():
            logits = policy.model(torch.tensor([ids])).logits[0].float()
        at = torch.tensor(positions)
        expected = torch.log_softmax(logits / temperature, dim=-1)[at - 1, torch.tensor(ids)[at]]
        torch.testing.assert_close(torch.cat([t.logprobs for t in turns]), expected, atol=1e-4, rtol=0)


def test_rows_extended_while_others_decode_equal_rows_run_alone() -> None:
    policy = qwen2()
    tok = [encode(policy, text) for text in OBSERVATIONS]
    # Turns of different lengths and observations of different lengths (one longer than the cache's
    # first capacity), rows waiting for a slot, each row extended 2 steps after its turn ended.
    observations = [[tok[0], tok[1]], [tok[1] * 3], [tok[0][:1], tok[0], tok[1]], [], [tok[1]]]
    keys = [101, 202, 303, 404, 505]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    together = play(policy, PROMPTS, observations, params, keys, slots=3, delay=2)
    for r in range(len(PROMPTS)):
        alone = play(policy, PROMPTS[r : r + 1], observations[r : r + 1], params, keys[r : r + 1])[0]
        assert len(together[r]) == len(alone) == len(observations[r]) + 1
        for a, b in zip(together[r], alone, strict=True):
            assert a.tokens.tolist() == b.tokens.tolist()
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert len({len(t.tokens) for turns in together.values() for t in turns}) > 2


def test_each_turn_continues_its_rows_sampling_stream() -> None:
    """Every model token is the inverse-CDF draw at uniform number `n` of its row's stream, n counting
    the row's tokens over all turns; restarting the count at each turn would draw other tokens."""
    policy = qwen2()
    observations = [encode(policy, text) for text in OBSERVATIONS]
    params = SamplingParams(temperature=1.0, max_new_tokens=9)
    prompt_ids = encode_prompts(policy.tokenizer, PROMPTS, "auto")
    group_keys = list(range(40, 40 + len(PROMPTS)))
    trajectories = play(policy, PROMPTS, [observations] * len(PROMPTS), params, group_keys)
    restarted_differs = False
    for r, turns in trajectories.items():
        assert [t.context.drawn for t in turns] == torch.tensor([len(t.tokens) for t in turns]).cumsum(0).tolist()
        key = int(row_keys(torch.tensor([group_keys[r]]), 1)[0])
        assert all(t.context.key == key for t in turns)
        ids, positions = whole_sequence(prompt_ids[r], turns, observations)
        with torch.no_grad():
            logits = policy.model(torch.tensor([ids])).logits[0, torch.tensor(positions) - 1].float()
        keys = torch.full((len(positions),), key)
        continued, _ = sample_tokens(logits, params, uniforms=keyed_uniforms(keys, torch.arange(len(positions))))
        assert continued.tolist() == [ids[p] for p in positions]
        restart = torch.cat([torch.arange(len(t.tokens)) for t in turns])
        restarted, _ = sample_tokens(logits, params, uniforms=keyed_uniforms(keys, restart))
        restarted_differs |= restarted.tolist() != continued.tolist()
    assert restarted_differs


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_rows_continued_in_one_pass_get_the_numbers_of_rows_continued_alone(cpu_kernels: bool) -> None:
    """`extend_many` runs the waiting rows' observations in shared passes, each row attending to its own
    stored keys/values at its own positions (contexts of different lengths): every token and log-prob is
    the one the row gets continued alone, and its trajectory is the one of a full re-prefill."""
    policy = qwen2()
    observations = [[encode(policy, text) for text in OBSERVATIONS]] * 4
    keys = [5, 6, 7, 8]
    runs = {mode: play(policy, PROMPTS[:4], observations, PARAMS, keys, cpu_kernels=cpu_kernels, together=mode)
            for mode in (True, False)}
    again = play(policy, PROMPTS[:4], observations, PARAMS, keys, continuation=False, cpu_kernels=cpu_kernels)
    contexts = set()
    for r in range(4):
        assert len(runs[True][r]) == 3
        for shared, alone, prefilled in zip(runs[True][r], runs[False][r], again[r], strict=True):
            assert shared.tokens.tolist() == alone.tokens.tolist() == prefilled.tokens.tolist()
            if cpu_kernels:      # the fused kernels' products sum in one order whatever the rows
                assert torch.equal(shared.logprobs, alone.logprobs)
            torch.testing.assert_close(shared.logprobs, alone.logprobs, atol=1e-5, rtol=0)
            contexts.add(len(shared.context.ids))
    assert len(contexts) >= 4       # the rows continued together had contexts of different lengths


def test_stale_weights_fall_back_to_a_full_prefill() -> None:
    """A context computed by older weights is prefilled again with the current ones: its next turn's
    log-probs are the new weights' over the whole sequence."""
    policy = qwen2()
    obs = encode(policy, OBSERVATIONS[0])
    session = NativeEngine(policy).session(PARAMS, slots=1, keep_context=True)
    session.add(encode_prompts(policy.tokenizer, PROMPTS[:1], "auto"), 1, tags=[0], group_keys=torch.tensor([9]))
    first = [row for _ in range(PARAMS.max_new_tokens + 1) for row in session.step()][0]
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.05)
    session.reload(version=1)
    session.extend(first.context, obs, tag=1)
    second = [row for _ in range(PARAMS.max_new_tokens + 1) for row in session.step()][0]
    assert second.context.version == 1 and second.versions.tolist() == [1] * len(second.tokens)
    ids = first.context.ids + obs + second.tokens.tolist()
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids])).logits[0].float()
    start = len(first.context.ids) + len(obs)
    expected = torch.log_softmax(logits / PARAMS.temperature, dim=-1)[
        torch.arange(start - 1, len(ids) - 1), torch.tensor(ids[start:])]
    torch.testing.assert_close(second.logprobs, expected, atol=1e-4, rtol=0)


def test_without_keep_context_rows_carry_no_context_and_the_same_numbers() -> None:
    policy = qwen2()
    prompt_ids = encode_prompts(policy.tokenizer, PROMPTS, "auto")
    rows = {}
    for keep in (False, True):
        session = NativeEngine(policy).session(PARAMS, slots=2, keep_context=keep)
        session.add(prompt_ids, 2, tags=range(2 * len(PROMPTS)), group_keys=torch.arange(len(PROMPTS)))
        rows[keep] = {row.tag: row for _ in range(60) for row in session.step()}
    assert len(rows[False]) == 2 * len(PROMPTS)
    assert all(row.context is None for row in rows[False].values())
    for tag, row in rows[False].items():
        kept = rows[True][tag]
        assert torch.equal(row.tokens, kept.tokens) and torch.equal(row.logprobs, kept.logprobs)
        assert kept.context.ids == prompt_ids[tag // 2] + row.tokens.tolist()
        config = policy.model.config
        head_dim = config.hidden_size // config.num_attention_heads
        assert kept.context.keys[0].shape == (config.num_key_value_heads, len(kept.context.ids) - 1, head_dim)
