"""LoRA through peft: only the adapters train, the native engine and the learner's shared-prompt and
chunked forwards compute with W + (alpha / r) B A, and the KL reference is the policy's own base
weights (or a snapshot of adapters), never a copy of the model."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.jobs.start import prepare
from reinforge.jobs.train import run
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    Reference,
    UpdateSettings,
    build_optimizer,
    build_sequences,
    completion_token_stats,
    completion_token_stats_chunked,
    completion_token_stats_shared,
    policy_update,
    token_logprobs,
    warmup_constant,
)
from reinforge.learner.reference import AdapterReference
from reinforge.loops.sft import run_sft
from reinforge.models import Policy, build_tiny_qwen2, load_policy, save_policy
from reinforge.objectives import resolve_spec
from reinforge.rollout import HFEngine, NativeEngine, SamplingParams
from reinforge.tasks import build_task
from reinforge.telemetry.checkpoint import CheckpointStore

PROMPTS = ["12+34=", "7+8=", "999+1=", "3 5 7>22:"]
PLAN = ForwardPlan(micro_batch_size=64, chunk_size=5, shared_prefix=True)


def lora_policy(micro: list[str], *extra: str, seed: int = 0, b_scale: float = 0.3) -> Policy:
    """A micro LoRA policy (r = 4) whose B matrices are drawn non-zero (peft starts them at 0, when the
    adapters change nothing), so that every path that ignored an adapter would show."""
    policy = load_policy(build_config([*micro, "model.lora.r=4", *extra]).model, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name and b_scale:
                p.copy_(b_scale * torch.randn(p.shape, generator=g))
    return policy


@pytest.fixture
def untied_micro(micro_overrides, tmp_path) -> list[str]:
    """Overrides of a micro Qwen2 with untied input and output embeddings (an adapter may sit on lm_head)."""
    policy = build_tiny_qwen2(build_config(micro_overrides).model, seed=0)
    config = Qwen2Config(**{**policy.model.config.to_dict(), "tie_word_embeddings": False})
    torch.manual_seed(0)
    save_policy(Policy(model=Qwen2ForCausalLM(config), tokenizer=policy.tokenizer), tmp_path / "untied")
    return [*micro_overrides, f"model.path={tmp_path / 'untied'}"]


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def sampled_batch(policy: Policy, seed: int = 0, group_size: int = 4, max_new_tokens: int = 8):
    torch.manual_seed(seed)
    rollout = NativeEngine(policy).generate(
        PROMPTS, group_size, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    )
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
    return rollout, seq


def test_model_lora_r_turns_lora_on_and_keys_are_checked() -> None:
    lora = build_config(["model.lora.r=8"]).model.lora
    assert (lora.r, lora.alpha, lora.dropout) == (8, 16.0, 0.0)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert build_config([]).model.lora is None
    assert build_config(["model.lora.r=8", "model.lora=null"]).model.lora is None
    with pytest.raises(ConfigError, match="did you mean 'model.lora.alpha'"):
        build_config(["model.lora.r=8", "model.lora.lora_alpha=32"])
    with pytest.raises(ConfigError, match="model.lora.r"):
        build_config(["model.lora.alpha=32"])


def test_only_the_adapters_are_trainable_with_the_hand_counted_size(micro_overrides) -> None:
    policy = load_policy(build_config([*micro_overrides, "model.lora.r=4"]).model, seed=0)
    # Micro decoder: E = 32, 2 heads of 16, 1 key/value head, MLP 64, one layer. An adapter on
    # W [out, in] has A [r, in] and B [out, r]: r (in + out) parameters.
    shapes = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
              "gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}
    expected = sum(4 * (i + o) for i, o in shapes.values())
    assert expected == 2048
    trainable = {n: p for n, p in policy.model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == expected
    assert all("lora_A" in n or "lora_B" in n for n in trainable)
    optimizer = build_optimizer(policy.model, lr=1e-3)
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == expected
    # peft's init: B = 0, so the wrapped model is its base model; A is drawn under the seed.
    assert all(not p.any() for n, p in trainable.items() if "lora_B" in n)
    again, other = (load_policy(build_config([*micro_overrides, "model.lora.r=4"]).model, seed=s) for s in (0, 1))
    assert all(
        torch.equal(a, b) for a, b in zip(adapters(policy.model).values(), adapters(again.model).values(), strict=True)
    )
    a_key = next(n for n in trainable if "lora_A" in n)
    assert not torch.equal(adapters(policy.model)[a_key], adapters(other.model)[a_key])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_native_and_hf_sampler_logprobs_equal_the_learners_with_lora(micro_overrides, temperature: float) -> None:
    policy = lora_policy(micro_overrides)
    for engine in (NativeEngine(policy), HFEngine(policy)):
        torch.manual_seed(0)
        rollout = engine.generate(PROMPTS, 4, SamplingParams(temperature=temperature, max_new_tokens=8))
        seq = build_sequences(
            rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, policy.tokenizer.pad_token_id
        )
        with torch.no_grad():
            learner = completion_token_stats(policy.model, seq, temperature).logprobs   # peft's own forward
            with policy.model.disable_adapter():
                base = completion_token_stats(policy.model, seq, temperature).logprobs
        assert rollout.completion_mask.sum() > 40
        torch.testing.assert_close(rollout.sampler_logprobs, learner, atol=1e-4, rtol=0)
        assert (base - learner).abs().max() > 0.1     # the adapters matter: ignoring them would show


@pytest.mark.parametrize("head", [False, True])
def test_shared_prefix_and_chunked_forwards_equal_peft_forward(micro_overrides, untied_micro, head: bool) -> None:
    # With head: adapters on some projections and on an (untied) LM head, which the chunked head reads too.
    policy = (lora_policy(untied_micro, "model.lora.target_modules=[q_proj,v_proj,down_proj,lm_head]") if head
              else lora_policy(micro_overrides))
    model = policy.model
    _, seq = sampled_batch(policy)
    tokens = seq.completion_mask.sum()
    weights = torch.randn(seq.completion_mask.shape, generator=torch.Generator().manual_seed(1)) / tokens

    def run_path(stats_fn):
        model.zero_grad(set_to_none=True)
        stats = stats_fn()
        ((weights * stats.logprobs).sum() + 0.3 / tokens * stats.entropy.sum()).backward()
        return stats, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref, ref_grads = run_path(lambda: completion_token_stats(model, seq, 0.7))
    paths = {"shared": lambda: completion_token_stats_shared(model, seq, seq.group_ids, 0.7, chunk_size=5),
             "chunked": lambda: completion_token_stats_chunked(model, seq, 0.7, chunk_size=5)}
    for name, fn in paths.items():
        got, grads = run_path(fn)
        torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(got.entropy, ref.entropy, atol=1e-5, rtol=0, msg=name)
        assert grads.keys() == ref_grads.keys()
        for n in ref_grads:
            assert ref_grads[n].abs().max() > 0, n
            torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-4, msg=f"{name} {n}")


def test_sft_and_rl_updates_move_only_the_adapters(micro_overrides) -> None:
    cfg = build_config([*micro_overrides, "model.lora.r=4"])
    policy = lora_policy(micro_overrides, b_scale=0.0)   # as peft starts: B = 0
    base, start = base_weights(policy.model), adapters(policy.model)
    task = build_task(cfg.task.name, **cfg.task.options)
    run_sft(policy, task.sft_examples(32, 0.0, seed=0), cfg.sft, chat_template="auto", seed=0)
    after_sft = adapters(policy.model)
    assert all(not torch.equal(after_sft[n], start[n]) for n in start)     # B left 0, so A gets gradients too
    # One RL update (grpo: clip + KL to a fixed reference) through the shared-prompt forward.
    rollout, seq = sampled_batch(policy)
    spec = resolve_spec("grpo")
    reference = Reference.build(policy.model, spec)
    optimizer = build_optimizer(policy.model, lr=1e-2)
    batch = LearnerBatch(
        sequences=seq,
        advantages=torch.randn(len(rollout.group_ids), generator=torch.Generator().manual_seed(2)),
        old_logprobs=None,
        sampler_logprobs=rollout.sampler_logprobs,
        group_ids=rollout.group_ids,
        ref_logprobs=reference.logprobs(seq, 1.0, PLAN),
    )
    stats = policy_update(
        policy.model, optimizer, warmup_constant(optimizer, 0), batch, spec, UpdateSettings(forward=PLAN),
        torch.Generator().manual_seed(0),
    )
    assert stats.optimizer_steps == 1
    after_rl = adapters(policy.model)
    assert all(not torch.equal(after_rl[n], after_sft[n]) for n in start)
    assert all(torch.equal(p, base[n]) for n, p in base_weights(policy.model).items())   # bit for bit


def test_fixed_reference_is_the_base_model_with_adapters_disabled(micro_overrides) -> None:
    policy = lora_policy(micro_overrides, b_scale=0.0)
    _, seq = sampled_batch(policy)
    before = token_logprobs(policy.model, seq, 1.0, PLAN)           # the model as RL starts
    reference = Reference.build(policy.model, resolve_spec("grpo"))
    # No copy: the reference runs the policy's own model and holds no tensor of its own.
    assert isinstance(reference, AdapterReference) and reference.model is policy.model and reference.adapters is None
    with torch.no_grad():                                           # "training" moves the adapters
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.3 * torch.randn_like(p))
    trained = adapters(policy.model)
    policy.model.train()
    moved = token_logprobs(policy.model, seq, 1.0, PLAN)
    assert (moved - before).abs().max() > 0.1
    for plan in (PLAN, ForwardPlan(shared_prefix=False, chunk_size=0)):
        torch.testing.assert_close(reference.logprobs(seq, 1.0, plan), before, atol=1e-6, rtol=0)
    # The policy is itself again: adapters on, values unchanged, training mode kept.
    assert policy.model.training
    assert all(torch.equal(p, trained[n]) for n, p in adapters(policy.model).items())
    torch.testing.assert_close(token_logprobs(policy.model, seq, 1.0, PLAN), moved, atol=0, rtol=0)
    assert reference.state_dict() == {"adapters": None}


def test_reference_after_lora_sft_keeps_the_adapters_of_the_start_of_rl(micro_overrides) -> None:
    policy = lora_policy(micro_overrides)                           # adapters already trained (B != 0)
    _, seq = sampled_batch(policy)
    before = token_logprobs(policy.model, seq, 1.0, PLAN)
    reference = Reference.build(policy.model, resolve_spec("grpo"))
    held = sum(t.numel() for t in reference.adapters.values())
    assert held == sum(p.numel() for p in policy.model.parameters() if p.requires_grad) == 2048
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn_like(p))
    trained = adapters(policy.model)
    torch.testing.assert_close(reference.logprobs(seq, 1.0, PLAN), before, atol=0, rtol=0)
    assert all(torch.equal(p, trained[n]) for n, p in adapters(policy.model).items())


def test_ema_reference_averages_the_adapters_only(micro_overrides) -> None:
    policy = lora_policy(micro_overrides, b_scale=0.0)
    spec = resolve_spec("t1", reference_ema=0.75)
    reference = Reference.build(policy.model, spec)
    start = adapters(policy.model)
    assert reference.adapters.keys() == start.keys()
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p))
    theta = adapters(policy.model)
    reference.after_update(policy.model)
    for name, ref in reference.adapters.items():   # ref <- 0.75 ref + 0.25 theta
        torch.testing.assert_close(ref, 0.75 * start[name] + 0.25 * theta[name], atol=1e-7, rtol=0)
        assert not ref.requires_grad
    # Its log-probs are those of the policy with the averaged adapters.
    _, seq = sampled_batch(policy)
    got = reference.logprobs(seq, 1.0, PLAN)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if name in reference.adapters:
                p.copy_(reference.adapters[name])
    torch.testing.assert_close(got, token_logprobs(policy.model, seq, 1.0, PLAN), atol=0, rtol=0)


def test_state_dict_round_trips_through_a_fresh_lora_model(micro_overrides) -> None:
    policy = lora_policy(micro_overrides, seed=0)
    fresh = load_policy(build_config([*micro_overrides, "model.lora.r=4"]).model, seed=5)   # other init
    fresh.model.load_state_dict(policy.model.state_dict())
    state, loaded = policy.model.state_dict(), fresh.model.state_dict()
    assert state.keys() == loaded.keys() and any("lora_B" in k for k in state)
    assert all(torch.equal(state[k], loaded[k]) for k in state)
    _, seq = sampled_batch(policy)
    torch.testing.assert_close(
        token_logprobs(fresh.model, seq, 1.0, PLAN), token_logprobs(policy.model, seq, 1.0, PLAN), atol=0, rtol=0
    )


def test_adapters_that_cannot_run_are_refused(micro_overrides, untied_micro) -> None:
    policy = lora_policy(untied_micro, "model.lora.target_modules=[q_proj,embed_tokens]")
    with pytest.raises(NotImplementedError, match="rollout.engine=hf"):
        NativeEngine(policy)
    # Tied embeddings: merging an lm_head adapter would change the embedding too.
    for target in ("lm_head", "embed_tokens"):
        with pytest.raises(ConfigError, match="ties"):
            lora_policy(micro_overrides, f"model.lora.target_modules=[{target}]")
    with pytest.raises(ConfigError, match="model.lora.target_modules"):
        lora_policy(micro_overrides, "model.lora.target_modules=[no_such_proj]")


def test_lora_dropout_with_the_shared_prompt_forward_is_refused(micro_overrides) -> None:
    with pytest.raises(ConfigError, match="train.shared_prefix=false"):
        prepare(build_config([*micro_overrides, "model.lora.r=4", "model.lora.dropout=0.1"]))
    prepare(build_config([*micro_overrides, "model.lora.r=4", "model.lora.dropout=0.1", "train.shared_prefix=false"]))


def test_micro_lora_run_trains_adapters_only_and_its_checkpoint_reloads(micro_overrides, tmp_path) -> None:
    cfg = build_config([*micro_overrides, "model.lora.r=4", f"output_dir={tmp_path / 'run'}"])
    run(cfg)
    checkpoint = CheckpointStore(tmp_path / "run" / "checkpoints", keep_last=2).latest()
    assert checkpoint is not None and checkpoint.step == cfg.train.steps
    state = checkpoint.tensors()["model"]
    untrained = load_policy(cfg.model, cfg.seed).model.state_dict()     # the run's start, rebuilt under its seed
    assert state.keys() == untrained.keys()
    for key, value in state.items():
        if "lora_" in key:
            assert not torch.equal(value, untrained[key]), key
        else:
            assert torch.equal(value, untrained[key]), key
    resumed = load_policy(cfg.model, cfg.seed)
    resumed.model.load_state_dict(state)
    assert all(torch.equal(v, state[k]) for k, v in resumed.model.state_dict().items())
    # SFT trained the adapters before RL, so grpo's fixed reference holds their snapshot, not a model.
    reference = checkpoint.tensors()["rl"]["reference"]
    assert reference["adapters"].keys() == {k for k in state if "lora_" in k}
