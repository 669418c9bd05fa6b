"""The rollout's activations replayed by the learner's first backward (models/replay.py, train.reuse_activations).

The native engine's one-call decoding keeps every layer's activations at the tokens it reads; where they are the
learner's own (the same fp32 weights, unchanged) the learner's completion passes take their forward from them.
Checked here: the log-probs and every parameter's gradient equal the learner's own forward's to float rounding
(rows of different lengths, a reordered subset of rows, two models); the record is refused wherever it is not the
model's as it is now (after an optimizer step, for another model, once the engine has decoded into the buffer
again); the learner takes the decoding's fused weights while they hold its weights; the engine keeps none where its
log-probs are not the learner's (top-p, greedy) or when not asked; and a GRPO learner step with two mini-batches
replays the first one only and moves the weights as without it.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from unit.loops.test_old_logprobs import grpo_learner_step
from unit.rollout.test_native_engine import MODELS, PROMPTS

from reinforge.config import build_config
from reinforge.learner import build_sequences
from reinforge.learner.shared_prefix import completion_token_stats_shared
from reinforge.models import build_tiny_qwen2, replay
from reinforge.models.decoder import DecoderWeights
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.settings import ModelConfig
from reinforge.tasks import build_task

# The record is written by the CPU kernels' one-call decoding and read back by their fused learner layers. The
# kernels are optional: on a machine without a C++ compiler the engine keeps nothing and the learner runs its
# forward, so there is no replay to check. With a compiler (CI's machines) these tests run, and fail if the kernels
# do not build, as tests/unit/kernels/test_cpu_kernels.py's fixture does.
pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler on this machine: the CPU kernels, which keep the record, "
                                       "do not build")


def sampled(policy, prompts: int = 4, group: int = 4, max_new: int = 12, seed: int = 1, keep: bool = True,
            **params):
    engine = NativeEngine(policy, cpu_kernels=True)
    engine.keep_activations = keep
    examples = build_task("arithmetic").train_split(prompts)
    rollout = engine.generate([e.prompt for e in examples], group,
                              SamplingParams(max_new_tokens=max_new, temperature=params.pop("temperature", 1.0),
                                             **params),
                              generator=torch.Generator().manual_seed(seed))
    return engine, examples, rollout


def sequences_of(policy, rollout):
    return build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                           policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)


def stats_and_grads(model, seq, activations):
    model.zero_grad(set_to_none=True)
    stats = completion_token_stats_shared(model, seq, seq.group_ids, activations=activations)
    mask = seq.completion_mask
    ((stats.logprobs * mask).sum() + 0.1 * (stats.entropy * mask).sum()).backward()
    return stats.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def count_replays(monkeypatch) -> list[int]:
    """[completion passes replayed, prompt passes replayed], counted as the learner runs."""
    calls = [0, 0]
    original, original_prompts = replay.ActivationRecord.layers, replay.ActivationRecord.prompt_layers

    def layers(self, rows, positions):
        calls[0] += 1
        return original(self, rows, positions)

    def prompt_layers(self, ids, lengths, span):
        found = original_prompts(self, ids, lengths, span)
        calls[1] += found is not None
        return found

    monkeypatch.setattr(replay.ActivationRecord, "layers", layers)
    monkeypatch.setattr(replay.ActivationRecord, "prompt_layers", prompt_layers)
    return calls


@pytest.mark.parametrize("config", [ModelConfig(max_positions=128),
                                    ModelConfig(max_positions=128, num_heads=8, num_kv_heads=2)])
def test_replayed_forward_gives_the_learners_log_probs_and_gradients(config, monkeypatch) -> None:
    policy = build_tiny_qwen2(config, seed=0)
    _, _, rollout = sampled(policy)
    lengths = rollout.lengths
    assert rollout.activations is not None and rollout.logprobs_exact
    assert len(set(lengths.tolist())) > 1      # rows that ended early: positions past them are padding
    calls = count_replays(monkeypatch)
    seq = sequences_of(policy, rollout)
    own, own_grads = stats_and_grads(policy.model, seq, None)
    assert calls == [0, 0]
    kept, kept_grads = stats_and_grads(policy.model, seq, rollout.activations)
    assert calls == [1, 1]       # the completions from the decoding, the prompts from the prefill
    assert float((own - kept).abs().max()) < 1e-5
    for name, grad in own_grads.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        assert float((kept_grads[name] - grad).abs().max()) < 1e-4 * scale, name
    # a reordered subset of the rows (a mini-batch) takes its own rows of the record
    rows = torch.tensor([7, 0, 5, 12, 3])
    sub = seq.rows(rows)
    mine, mine_grads = stats_and_grads(policy.model, sub, rollout.activations.select(rows))
    assert calls == [2, 2]       # its prompts too: three of the four, reordered
    assert float((mine - own[rows, : mine.shape[1]]).abs().max()) < 1e-5
    _, sub_grads = stats_and_grads(policy.model, sub, None)
    for name, grad in sub_grads.items():
        assert float((mine_grads[name] - grad).abs().max()) < 1e-4 * float(grad.abs().max()), name


def test_the_prefill_is_replayed_only_for_prompts_it_ran_token_for_token() -> None:
    policy = build_tiny_qwen2(ModelConfig(max_positions=128), seed=0)
    engine = NativeEngine(policy, cpu_kernels=True)
    engine.keep_activations = True
    rollout = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6), generator=torch.Generator().manual_seed(0))
    record = rollout.activations.prompts
    seq = sequences_of(policy, rollout)
    firsts = torch.arange(0, 2 * len(PROMPTS), 2)                # one row of each prompt, in order
    ids, lengths = seq.input_ids[firsts], seq.starts[firsts]
    span = int(lengths.max())
    assert len(set(lengths.tolist())) > 1 and record.width == span
    assert record.select(ids, lengths, span) is record.layers    # all of them, in order: no copy
    one = record.select(ids[2:3], lengths[2:3], span)
    assert torch.equal(one[1].x_mid, record.layers[1].x_mid.view(len(PROMPTS), span, -1)[2])
    assert torch.equal(one[1].q[0], record.layers[1].q[2])
    changed = ids.clone()
    changed[1, int(lengths[1]) - 1] += 1                         # a prompt the prefill did not run
    assert record.select(changed, lengths, span) is None
    assert record.select(ids, lengths, span + 1) is None         # wider than the prefill
    # past a shorter prompt the learner's row holds its completion, where the prefill ran padding: the same prompts
    assert not torch.equal(ids[:, :span], torch.where(torch.arange(span) < lengths[:, None], ids[:, :span], 0))
    assert record.select(ids, lengths, span) is record.layers


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_engine_keeps_activations_only_for_layers_the_learner_replays(name: str) -> None:
    """Llama's layers (no biases) replay as Qwen2's do; Qwen3's per-head q/k norms are outside the learner's fused
    layers, which alone replay, so its decoding keeps nothing."""
    policy = MODELS[name]()
    engine = NativeEngine(policy, cpu_kernels=True)
    engine.keep_activations = True
    rollout = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=8), generator=torch.Generator().manual_seed(0))
    assert rollout.logprobs_exact
    if name == "qwen3":
        assert rollout.activations is None
        return
    seq = sequences_of(policy, rollout)
    own, own_grads = stats_and_grads(policy.model, seq, None)
    kept, kept_grads = stats_and_grads(policy.model, seq, rollout.activations)
    assert float((own - kept).abs().max()) < 1e-5
    for name_, grad in own_grads.items():
        assert float((kept_grads[name_] - grad).abs().max()) <= 1e-4 * float(grad.abs().max()), name_


def test_a_record_is_replayed_only_for_the_model_as_it_sampled(monkeypatch) -> None:
    policy = build_tiny_qwen2(ModelConfig(max_positions=128), seed=0)
    engine, examples, rollout = sampled(policy)
    record = rollout.activations
    assert record.matches(policy.model)
    assert not record.matches(copy.deepcopy(policy.model))          # a reference's own copy
    calls = count_replays(monkeypatch)
    seq = sequences_of(policy, rollout)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3, fused=True)   # bumps no version counter
    stats_and_grads(policy.model, seq, record)
    optimizer.step()                                                 # in place: the versions move on
    assert not record.matches(policy.model)
    replays = calls[0]
    after, _ = stats_and_grads(policy.model, seq, record)            # runs its own forward
    own, _ = stats_and_grads(policy.model, seq, None)
    assert calls[0] == replays and torch.equal(after, own)
    # the engine decodes into the same buffer again: the earlier record is gone
    fresh = engine.generate([e.prompt for e in examples], 4, SamplingParams(max_new_tokens=12),
                            generator=torch.Generator().manual_seed(2))
    assert fresh.activations.matches(policy.model) and not rollout.activations.matches(policy.model)



def test_the_learner_takes_the_engines_fused_projections_while_they_hold_its_weights() -> None:
    """The learner's fused q/k/v (with biases) and gate/up are the decoding's own tensors, no copy, with the same
    gradient reaching the model's projections as through its own copies; once the engine takes new weights, which
    write into that memory, the record lends nothing."""
    policy = build_tiny_qwen2(ModelConfig(max_positions=128), seed=0)
    engine, examples, rollout = sampled(policy)
    lent = rollout.activations.decoded_with
    assert lent is not None and lent.weights is not None
    model = policy.model
    grads = []
    for fused_from in (None, lent.weights):
        model.zero_grad(set_to_none=True)
        w = DecoderWeights.of(model, logits=False, fused_from=fused_from)
        weights = [t for lw in w.layers for t in (lw.qkv, lw.qkv_bias, lw.gate_up)]
        assert len(weights) == 12 and all(t.requires_grad for t in weights)
        mixing = torch.Generator().manual_seed(3)
        sum((t * torch.randn(t.shape, generator=mixing)).sum() for t in weights).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if fused_from is not None:
            for mine, theirs in zip(w.layers, fused_from.layers, strict=True):
                assert mine.qkv.data_ptr() == theirs.qkv.data_ptr()
                assert mine.gate_up.data_ptr() == theirs.gate_up.data_ptr()
    own, taken = grads
    assert len(own) == 4 * 8        # q, k, v weights and biases, gate, up of each layer
    assert own.keys() == taken.keys() and all(torch.equal(own[n], taken[n]) for n in own)
    engine.generate([e.prompt for e in examples], 4, SamplingParams(max_new_tokens=12),
                    generator=torch.Generator().manual_seed(2))
    assert lent.weights is None


def test_a_backward_refuses_a_record_the_engine_decoded_over_after_the_forward() -> None:
    # The backward reads gate|up in the engine's buffer itself (not copied out at the forward): a generation
    # between the forward and the backward would hand it another decoding's numbers.
    policy = build_tiny_qwen2(ModelConfig(max_positions=128), seed=0)
    engine, examples, rollout = sampled(policy)
    seq = sequences_of(policy, rollout)
    stats = completion_token_stats_shared(policy.model, seq, seq.group_ids, activations=rollout.activations)
    assert stats.metrics["learner/replayed_forward"] == 1.0
    engine.generate([e.prompt for e in examples], 4, SamplingParams(max_new_tokens=12),
                    generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="decoded into the activation record"):
        (stats.logprobs * seq.completion_mask).sum().backward()

@pytest.mark.parametrize("params", [{"top_p": 0.9}, {"greedy": True}])
def test_no_record_where_the_samplers_log_probs_are_not_the_learners(params) -> None:
    policy = build_tiny_qwen2(ModelConfig(max_positions=128), seed=0)
    _, _, rollout = sampled(policy, **params)
    assert rollout.activations is None
    _, _, plain = sampled(policy, keep=False)
    assert plain.activations is None and plain.logprobs_exact


def test_a_learner_step_replays_its_first_mini_batch_only_and_moves_the_weights_alike(micro_overrides,
                                                                                     monkeypatch) -> None:
    """Two mini-batches: the first one's forward is the record; the second comes after an optimizer step and runs
    its own. The weights move as with the record off, to the rounding Adam's first step lifts (as in
    tests/unit/loops/test_old_logprobs.py)."""
    verdicts: list[bool] = []
    original = replay.ActivationRecord.matches
    monkeypatch.setattr(replay.ActivationRecord, "matches",
                        lambda self, model: verdicts.append(original(self, model)) or verdicts[-1])
    moved = {}
    for reuse in (False, True):
        cfg = build_config([*micro_overrides, "train.group_size=4", "train.mini_batches=2",
                            f"train.reuse_activations={str(reuse).lower()}"])
        policy = build_tiny_qwen2(cfg.model, seed=0)
        _, examples, rollout = sampled(policy)
        verdicts.clear()
        metrics, moved[reuse] = grpo_learner_step(cfg, policy, examples, rollout, (torch.arange(16) % 3 == 0).float())
        # the first mini-batch's micro-batches take the record, the second's (after the optimizer step) refuse it
        if reuse:
            first = verdicts.index(False)
            assert first > 0 and all(verdicts[:first]) and not any(verdicts[first:])
            assert metrics["learner/replayed_forward"] == pytest.approx(first / len(verdicts))
        else:
            assert verdicts == [] and "learner/replayed_forward" not in metrics
    size = float(moved[False].abs().max())
    gap = (moved[True] - moved[False]).abs()
    assert size > 1e-5 and float(gap.max()) < 0.1 * size and float(gap.mean()) < 1e-3 * float(moved[False].abs().mean())

