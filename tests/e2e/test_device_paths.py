"""The GPU path, checked against the CPU in fp32 and bf16: the native engine against transformers, the
sampler's log-probs against the learner's, LoRA, the chunked LM head, an update's gradient, and the
weight-sync probe. Every test takes the device as a parameter: the `cpu` cases run in the default suite
(so the checks cannot rot), the `cuda` cases are marked `cuda` and skip without a CUDA device
(`pytest -m cuda` on a GPU machine; benchmarks/gpu_check.py runs them).

Tolerances for bf16 are bounds on bf16 rounding (8 bits of mantissa: a relative error of 2^-9 = 2e-3 per
rounding, accumulated over a few layers), not fitted numbers; the CPU's bf16 cases sit well inside them.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from unit.rollout.test_native_engine import PROMPTS, eos_prone

from reinforge.config import build_config
from reinforge.jobs.train import run
from reinforge.learner import (
    ForwardPlan,
    LearnerBatch,
    UpdateSettings,
    build_optimizer,
    build_sequences,
    completion_token_stats,
    policy_update,
    token_logprobs,
    token_stats,
    warmup_constant,
)
from reinforge.learner.logprobs import chunked_token_logprobs_and_entropy
from reinforge.models import Policy, build_tiny_qwen2, load_policy
from reinforge.objectives import compute_advantages, resolve_spec
from reinforge.rollout import HFEngine, NativeEngine, SamplingParams
from reinforge.rollout.weight_sync import default_tolerance
from reinforge.settings import ModelConfig

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, NO_CUDA])]
CUDA_ONLY = [pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, NO_CUDA])]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# Log-probs of two fp32 computations of the same tokens (other kernels, other summation orders): logits reach
# 49 here (<eos>'s, boosted), where fp32 rounding through a few layers is ~1e-5; a wrong weight or mask is >1e-2.
FP32_TOL = 3e-4


def tiny(device: str, dtype: torch.dtype, **sizes) -> Policy:
    """test_native_engine's Qwen2 (hidden 64, two layers, <eos> made likely so that rows end at different
    lengths), initialised on the CPU in fp32 and moved: the same weights, rounded, on every device."""
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, **sizes)
    policy = eos_prone(build_tiny_qwen2(ModelConfig(**shape), seed=0))
    return Policy(policy.model.to(device=device, dtype=dtype), policy.tokenizer)


def _rows(rollout) -> list[list[int]]:
    return [rollout.completion_ids[r][rollout.completion_mask[r].bool()].tolist() for r in range(rollout.num_rows)]


def _teacher_forced(policy: Policy, rollout) -> torch.Tensor:
    """[N, T, V] fp32 log-softmax of transformers' own forward at each completion position (CPU)."""
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id)
    device = policy.model.device
    with torch.no_grad():
        logits = policy.model(input_ids=seq.input_ids.to(device), attention_mask=seq.attention_mask.to(device)).logits
    t = seq.completion_ids.shape[1]
    rows = torch.arange(seq.input_ids.shape[0])[:, None]
    at = seq.starts[:, None] - 1 + torch.arange(t)[None, :]          # the position predicting each completion token
    return torch.log_softmax(logits.float().cpu()[rows, at.clamp(max=logits.shape[1] - 1)], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_native_greedy_decoding_is_transformers_argmax(device: str, dtype: torch.dtype) -> None:
    """Greedy tokens and their log-probs: in fp32 the native engine's are `generate`'s exactly; in bf16 each
    native token is transformers' argmax up to bf16 rounding (near-ties may flip, nothing else)."""
    policy = tiny(device, dtype)
    params = SamplingParams(max_new_tokens=10, greedy=True)
    native = NativeEngine(policy).generate(PROMPTS, 1, params)
    assert len(set(native.lengths.tolist())) > 1          # rows really ended at different steps
    logp = _teacher_forced(policy, native)
    mask = native.completion_mask.bool()
    chosen = logp.gather(2, native.completion_ids[..., None]).squeeze(2)
    gap = (logp.max(dim=2).values - chosen)[mask]          # 0 where native's token is transformers' argmax
    if dtype == torch.float32:
        hf = HFEngine(policy).generate(PROMPTS, 1, params)
        assert _rows(native) == _rows(hf)
        torch.testing.assert_close(native.sampler_logprobs, hf.sampler_logprobs, atol=FP32_TOL, rtol=0)
        assert float(gap.max()) == 0.0
    else:
        # A flip needs the top two logits within rounding: bf16's spacing is 1/16 at 8-16 and 1/4 at 32-64,
        # where <eos>'s logit reaches (eos_prone); a token that is not transformers' argmax by more shows a bug.
        assert float(gap.max()) < 0.3
        assert float((gap == 0).float().mean()) > 0.9
    # The engine's recorded log-probs are transformers' log-softmax of the same tokens.
    tol = FP32_TOL if dtype == torch.float32 else 0.15
    assert float((native.sampler_logprobs - chosen)[mask].abs().max()) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_follow_the_key_on_any_device(device: str, dtype: torch.dtype) -> None:
    """Each prompt's samples are drawn by inverse CDF from uniforms keyed on the CPU: the same key gives the
    CPU-fp32 tokens on this device, every row in fp32; in bf16 a row departs where rounding moves a CDF
    boundary across one of its 12 uniforms (5-25% of the rows on the CPU over ten key sets; a sampler whose
    draws were not the keyed ones would keep almost no row of 12 tokens over this vocabulary)."""
    keys = torch.tensor([11, 22, 33, 44, 55])
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    reference = NativeEngine(tiny("cpu", torch.float32)).generate(PROMPTS, 8, params, group_keys=keys)
    here = NativeEngine(tiny(device, dtype)).generate(PROMPTS, 8, params, group_keys=keys)
    same = [a == b for a, b in zip(_rows(reference), _rows(here), strict=True)]
    assert reference.lengths.float().std() > 0
    if dtype == torch.float32:
        assert all(same)
        torch.testing.assert_close(here.sampler_logprobs, reference.sampler_logprobs, atol=FP32_TOL, rtol=0)
    else:
        assert sum(same) >= 0.6 * len(same)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_sampler_and_learner_logprobs_agree(device: str, dtype: torch.dtype) -> None:
    """The importance ratio's two sides: the engine's recorded log-probs and the learner's (the RL loop's
    forward plan: shared prompt, chunked fp32 head) on the same tokens. In bf16 the engine and the learner
    round differently; the mismatch stays at bf16 rounding."""
    policy = tiny(device, dtype)
    torch.manual_seed(0)
    rollout = NativeEngine(policy).generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=8))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
    mask = rollout.completion_mask.bool()
    assert int(mask.sum()) > 40
    for plan in (ForwardPlan(shared_prefix=True, chunk_size=16), ForwardPlan(chunk_size=0)):
        learner = token_logprobs(policy.model, seq, 1.0, plan).cpu()
        diff = (learner - rollout.sampler_logprobs)[mask].abs()
        if dtype == torch.float32:
            assert float(diff.max()) < FP32_TOL
        else:
            assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.15


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_chunked_head_equals_the_naive_log_softmax(device: str, dtype: torch.dtype) -> None:
    """Log-probs, entropies and their gradients through the chunked fp32 head equal the full [M, V]
    log-softmax in fp32 of the same (rounded) inputs: the fp32 head makes bf16 inputs exact here too."""
    g = torch.Generator().manual_seed(1)
    m, h, v = 37, 16, 501
    hidden = torch.randn(m, h, generator=g).to(device=device, dtype=dtype).requires_grad_()
    weight = (0.3 * torch.randn(v, h, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    targets = torch.randint(0, v, (m,), generator=g).to(device)
    a, b = torch.randn(m, generator=g).to(device), torch.randn(m, generator=g).to(device)

    def grads(logprobs, entropy):
        hidden.grad = weight.grad = None
        (logprobs * a + entropy * b).sum().backward()
        return logprobs.detach(), entropy.detach(), hidden.grad.float(), weight.grad.float()

    logp_all = torch.log_softmax(hidden.float() @ weight.float().t() / 0.7, dim=-1)
    naive = grads(logp_all.gather(1, targets[:, None]).squeeze(1), -(logp_all.exp() * logp_all).sum(dim=-1))
    chunked = grads(*chunked_token_logprobs_and_entropy(hidden, weight, None, targets, temperature=0.7, chunk_size=7,
                                                        fp32_head=True))
    # Gradients are returned in the inputs' dtype: bf16 rounds them once more.
    for name, n, c in zip(["logprobs", "entropy", "d hidden", "d weight"], naive, chunked, strict=True):
        rounding = 1e-5 if dtype == torch.float32 or name in ("logprobs", "entropy") else 1e-2
        err = float((c - n).abs().max()) / max(1.0, float(n.abs().max()))
        assert err < rounding, f"{name}: {err:.3g}"


def test_a_head_without_the_fp32_output_gemm_falls_back_to_the_upcast_head(monkeypatch, caplog) -> None:
    """The 16-bit GEMM with fp32 output (CUDA only) refused, here by the CPU: logged, then the upcast fp32 head's
    logits, and the fast path stays off."""
    from reinforge.learner import logprobs as lp

    monkeypatch.setitem(lp._FP32_OUT_MM, "on", True)
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(5, 16, generator=g).bfloat16(), torch.randn(33, 16, generator=g).bfloat16()
    with caplog.at_level("WARNING", logger="reinforge.learner.logprobs"):
        z = lp._chunk_logits(hidden, weight, None, 0.5, fp32_out=True)
    assert lp._FP32_OUT_MM["on"] is False
    assert "the 16-bit GEMM with fp32 output is unavailable (NotImplementedError: Could not run" in caplog.text
    assert z.dtype == torch.float32
    assert torch.equal(z, lp._chunk_logits(hidden, weight.float(), None, 0.5))


def test_the_split_bf16_logit_gradient_gives_the_fp32_heads_gradients() -> None:
    """The bf16 head's backward on CUDA (`_split_grads`: the fp32 logit gradient as two bf16 parts), here through
    the upcast products: dz W and dz^T h within ~2^-16 of the fp32 products, far inside bf16's 2^-9."""
    from reinforge.learner.head_gemms import split_grads

    g = torch.Generator().manual_seed(4)
    dz = torch.randn(40, 301, generator=g) * torch.rand(40, 301, generator=g).pow(8)   # entries spanning decades
    hidden, weight = torch.randn(40, 24, generator=g).bfloat16(), torch.randn(301, 24, generator=g).bfloat16()
    exact_h, exact_w = dz.double() @ weight.double(), dz.double().t() @ hidden.double()
    start = torch.randn(301, 24, generator=g)                 # the weight gradient so far: added to
    grad_w = start.clone()
    grad_h = split_grads(dz.clone(), hidden, weight, True, grad_w)
    for got, exact in ((grad_h, exact_h), (grad_w.double() - start.double(), exact_w)):
        assert grad_h.dtype == grad_w.dtype == torch.float32
        assert float((got.double() - exact).abs().max()) < 2e-5 * float(exact.abs().max())
    assert float((dz.bfloat16().double() @ weight.double() - exact_h).abs().max()) > 1e-3 * float(exact_h.abs().max())


def test_the_split_gradients_hand_back_the_logit_gradient_when_a_gemm_fails(monkeypatch) -> None:
    """A GEMM of `split_grads` failing (as the 16-bit one with fp32 output would) leaves the caller's logit
    gradient as it was, bit for bit, for its upcast fallback: hi + (dz - hi) is dz exactly."""
    from reinforge.learner import head_gemms as hg

    def refuse(a, b):
        raise RuntimeError("no GEMM")

    monkeypatch.setattr(hg, "mm32", refuse)
    g = torch.Generator().manual_seed(5)
    dz = torch.randn(12, 77, generator=g) * torch.rand(12, 77, generator=g).pow(8)
    hidden, weight = torch.randn(12, 8, generator=g).bfloat16(), torch.randn(77, 8, generator=g).bfloat16()
    kept = dz.clone()
    with pytest.raises(RuntimeError, match="no GEMM"):
        hg.split_grads(dz, hidden, weight, True, None)
    assert torch.equal(dz, kept)


@pytest.mark.parametrize("device", DEVICES)
def test_the_weight_gradient_accumulates_the_16_bit_products_in_fp32(device: str, monkeypatch, caplog) -> None:
    """`accumulate_mm32`: acc += a @ b in fp32 for bf16 a, b; on CUDA cuBLAS adds into acc where this torch
    takes an fp32 accumulator with 16-bit factors (checked once; else, logged, the product and the add; the
    gpu check's `fast_paths` says which), on the CPU the upcast product and the add, bit for bit."""
    from reinforge.learner import head_gemms as hg

    monkeypatch.setitem(hg._ADDMM32, "on", None)
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(64, 300, generator=g).bfloat16(), torch.randn(300, 48, generator=g).bfloat16()
    start = torch.randn(64, 48, generator=g)
    acc = start.clone().to(device)
    hg.accumulate_mm32(acc, a.to(device), b.to(device))
    want = start + a.float() @ b.float()
    if device == "cpu":
        assert torch.equal(acc, want) and hg._ADDMM32["on"] is None
        with caplog.at_level("WARNING", logger="reinforge.learner.logprobs"):   # the check itself, refused here
            assert hg.addmm32_works(torch.device("cpu"), torch.bfloat16) is False
        assert "adding into an fp32 gradient is unavailable (NotImplementedError: Could not run" in caplog.text
    else:
        assert hg._ADDMM32["on"] in (True, False)
        assert float((acc.cpu() - want).abs().max()) < 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("entropy_coef", [0.5, None])
@pytest.mark.parametrize("device", CUDA_ONLY)
def test_the_fp32_output_head_gives_the_upcast_heads_numbers(device: str, entropy_coef: float | None,
                                                             monkeypatch) -> None:
    """bf16 head on CUDA through the 16-bit GEMM with fp32 output (and the fused chunk order, the split bf16
    gradient, cuBLAS adding into the weight gradient) against the upcast fp32 GEMM: the same products, so
    log-probs, entropies and gradients equal up to fp32 summation order, with and without the entropy in the
    loss."""
    from reinforge.learner import logprobs as lp

    g = torch.Generator().manual_seed(3)
    m, h, v = 300, 64, 5003
    hidden = torch.randn(m, h, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_()
    weight = (0.3 * torch.randn(v, h, generator=g)).to(device=device, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (m,), generator=g).to(device)

    def run(on: bool):
        monkeypatch.setitem(lp._FP32_OUT_MM, "on", on)
        hidden.grad = weight.grad = None
        logp, ent = chunked_token_logprobs_and_entropy(hidden, weight, None, targets, temperature=0.7, chunk_size=64)
        (logp.sum() + (0.0 if entropy_coef is None else entropy_coef * ent.sum())).backward()
        out = (logp.detach(), ent.detach(), hidden.grad.float(), weight.grad.float())
        assert lp._FP32_OUT_MM["on"] is on, "the fp32-output GEMM failed on this device (see the log)"
        return out

    fast, upcast = run(True), run(False)
    for name, f, u in zip(["logprobs", "entropy", "d hidden", "d weight"], fast, upcast, strict=True):
        rounding = 1e-4 if name in ("logprobs", "entropy") else 1e-2     # gradients come back in bf16
        err = float((f - u).abs().max()) / max(1.0, float(u.abs().max()))
        assert err < rounding, f"{name}: {err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", CUDA_ONLY)
def test_compiled_learner_layers_give_the_eager_logprobs_and_gradient(device: str, dtype: torch.dtype) -> None:
    """train.compile (models/compiled_layers.py): the shared-prompt forward with its layers through
    torch.compile against the same forward run eagerly, on the same device and dtype: log-probs within
    rounding (fused kernels keep intermediates in fp32 where eager rounds them to bf16), and the gradient
    of a fixed function of log-probs and entropies within the same bounds as a bf16 update's."""
    from reinforge.models.compiled_layers import compiled_layers_on

    policy = tiny(device, dtype)
    torch.manual_seed(0)
    rollout = NativeEngine(policy).generate(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=8))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
    mask = rollout.completion_mask.bool().to(device)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)).to(device)

    def run(compile: bool) -> tuple[torch.Tensor, torch.Tensor]:
        policy.model.zero_grad(set_to_none=True)
        stats = token_stats(policy.model, seq, 1.0, ForwardPlan(shared_prefix=True, chunk_size=16, compile=compile))
        ((stats.logprobs * weights)[mask].sum() + 0.1 * stats.entropy[mask].sum()).backward()
        return stats.logprobs.detach()[mask], torch.cat([p.grad.float().flatten() for p in policy.model.parameters()])

    eager_logprobs, eager_grad = run(False)
    logprobs, grad = run(True)
    assert compiled_layers_on()                  # the layers were compiled, not run eagerly after a failure
    diff = (logprobs - eager_logprobs).abs()
    if dtype == torch.float32:
        assert float(diff.max()) < FP32_TOL
    else:
        assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.15
    relative = float((grad - eager_grad).norm() / eager_grad.norm())
    assert float(eager_grad.norm()) > 1e-3
    assert relative < (1e-4 if dtype == torch.float32 else 0.1), relative


def _update_gradient(policy: Policy, batch: LearnerBatch) -> torch.Tensor:
    """The flat fp32 gradient (on the CPU) of one dr_grpo update of `policy` on `batch` (lr 0: weights kept)."""
    model = copy.deepcopy(policy.model)
    opt = build_optimizer(model, lr=1e-3)
    for group in opt.param_groups:
        group["lr"] = 0.0
    settings = UpdateSettings(ppo_epochs=1, mini_batches=1, grad_clip=1e9, temperature=1.0,
                              forward=ForwardPlan(shared_prefix=True, chunk_size=16), max_length=8)
    policy_update(model, opt, warmup_constant(opt, 0), batch, resolve_spec("dr_grpo"), settings,
                  torch.Generator().manual_seed(0))
    return torch.cat([p.grad.float().flatten().cpu() for p in model.parameters()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_update_gradient_on_the_device_is_the_cpu_fp32_one(device: str, dtype: torch.dtype) -> None:
    """One policy update's gradient on this device and dtype against the same update in fp32 on the CPU:
    within fp32 rounding in fp32; in bf16 (weights, activations and gradients rounded to 8 bits) the whole
    vector's relative error was 0.037 on the CPU, and a wrong term or scale moves it by far more than 0.1."""
    reference = tiny("cpu", torch.float32)
    torch.manual_seed(1)
    rollout = NativeEngine(reference).generate(PROMPTS[:4], 4, SamplingParams(max_new_tokens=8))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          reference.tokenizer.pad_token_id, group_ids=rollout.group_ids)
    with torch.no_grad():
        old = completion_token_stats(reference.model, seq).logprobs
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1])
    batch = LearnerBatch(sequences=seq, advantages=compute_advantages("dr_grpo", rewards, rollout.group_ids),
                         old_logprobs=old, sampler_logprobs=old, group_ids=rollout.group_ids)
    expected = _update_gradient(reference, batch)
    got = _update_gradient(Policy(copy.deepcopy(reference.model).to(device=device, dtype=dtype), reference.tokenizer),
                           batch)
    relative = float((got - expected).norm() / expected.norm())
    assert float(expected.norm()) > 1e-3
    assert relative < (1e-4 if dtype == torch.float32 else 0.1), relative


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_lora_sampler_equals_learner_and_only_adapters_move(micro_overrides, device: str, dtype: torch.dtype) -> None:
    """LoRA on the device: the native engine computes with W + (alpha / r) B A as the learner's peft forward
    does, and an update moves the adapters and nothing else."""
    cfg = build_config([*micro_overrides, "model.lora.r=4", f"model.device={device}",
                        f"model.dtype={DTYPE_NAMES[dtype]}"])
    policy = load_policy(cfg.model, seed=0)
    g = torch.Generator().manual_seed(100)
    with torch.no_grad():                  # non-zero B, so that an engine ignoring the adapters would show
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    assert policy.model.device.type == device
    torch.manual_seed(0)
    rollout = NativeEngine(policy).generate(PROMPTS[:4], 4, SamplingParams(temperature=1.0, max_new_tokens=8))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids)
    learner = token_logprobs(policy.model, seq, 1.0, ForwardPlan(chunk_size=0)).cpu()
    mask = rollout.completion_mask.bool()
    diff = (learner - rollout.sampler_logprobs)[mask].abs()
    assert float(diff.max()) < (FP32_TOL if dtype == torch.float32 else 0.15)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    batch = LearnerBatch(sequences=seq, advantages=torch.randn(seq.input_ids.shape[0], generator=g),
                         old_logprobs=None, sampler_logprobs=rollout.sampler_logprobs, group_ids=rollout.group_ids)
    opt = build_optimizer(policy.model, lr=1e-2)
    policy_update(policy.model, opt, warmup_constant(opt, 0), batch, resolve_spec("dr_grpo"),
                  UpdateSettings(forward=ForwardPlan(shared_prefix=True, chunk_size=16), max_length=8),
                  torch.Generator().manual_seed(0))
    moved = {n for n, p in policy.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved and all("lora_" in n for n in moved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_weight_sync_probe_passes_every_step_of_a_run_on_the_device(micro_overrides, tmp_path, device: str,
                                                                     dtype: torch.dtype) -> None:
    """A micro run on the device: the learner's and the engine's next-token distributions on the probe
    agree after every update (well inside the dtype's default tolerance), and the weights moved."""
    cfg = build_config([*micro_overrides, "sft.steps=0", f"model.device={device}", f"model.dtype={DTYPE_NAMES[dtype]}",
                        "reward.functions=[{name: verifier}, {name: format, params: {pattern: '1', mode: search}}]",
                        "curation.filters=[]", "rollout.max_new_tokens=6", "train.lr=1e-2", "train.weight_sync.every=1",
                        f"output_dir={tmp_path}"])
    run(cfg)
    rl = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [x for x in rl if x.get("stage") == "rl"]
    assert [x["step"] for x in rl] == [1, 2, 3]
    tolerance = default_tolerance(torch.nn.Linear(1, 1).to(device=device, dtype=dtype))
    assert all(0 <= x["sync/probe_tv"] < tolerance / 10 for x in rl), [x["sync/probe_tv"] for x in rl]
    assert all(x["grad_norm"] > 0 for x in rl)



@pytest.mark.parametrize("params", [
    pytest.param(SamplingParams(temperature=1.0, max_new_tokens=16), id="plain"),
    pytest.param(SamplingParams(temperature=0.8, top_k=12, top_p=0.9, max_new_tokens=16), id="filtered"),
])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", CUDA_ONLY)
def test_decode_graphs_give_the_eager_steps_rows(device: str, dtype: torch.dtype, params: SamplingParams,
                                                monkeypatch) -> None:
    """The native engine's CUDA graphs (rollout/graphs.py, every bucket captured on its first step here) against
    the same engine decoding eagerly, same keys. 40 rows ending at different steps run as 40, 32, 16, ... rows
    (padded). fp32: every row's tokens, and log-probs equal up to the fp32 rounding of other GEMM shapes (a
    graph reading a stale buffer is off by far more); bf16: the same kernels but for the padded shapes, so a
    row departs only where rounding moves a CDF boundary across one of its uniforms."""
    from reinforge.rollout import graphs

    monkeypatch.setattr(graphs, "CAPTURE_AFTER", 1)
    captured: list[int] = []
    real_capture = graphs.DecodeGraphs._capture

    def capture(self, bucket) -> None:
        captured.append(bucket.rows)
        real_capture(self, bucket)

    monkeypatch.setattr(graphs.DecodeGraphs, "_capture", capture)
    policy = tiny(device, dtype)
    keys = torch.tensor([11, 22, 33, 44, 55])
    eager = NativeEngine(policy, cuda_graphs=False).generate(PROMPTS, 8, params, group_keys=keys)
    engine = NativeEngine(policy)
    assert engine.graph_mode == "capture"
    graphed = engine.generate(PROMPTS, 8, params, group_keys=keys)
    assert engine.graph_mode == "capture", "a graph failed or disagreed with its eager step (see the log)"
    assert len(captured) > 1   # several buckets (rows that end free theirs); the first may be below 40
    same = [a == b for a, b in zip(_rows(eager), _rows(graphed), strict=True)]
    assert eager.lengths.float().std() > 0
    if dtype == torch.float32:
        assert all(same)
        torch.testing.assert_close(graphed.sampler_logprobs, eager.sampler_logprobs, atol=FP32_TOL, rtol=0)
    else:
        assert sum(same) >= 0.8 * len(same)
        rows = torch.tensor(same)
        torch.testing.assert_close(graphed.sampler_logprobs[rows], eager.sampler_logprobs[rows], atol=0.15, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_decoder_logits_of_a_bf16_head_are_its_fp32_products(device: str, monkeypatch, caplog) -> None:
    """The native engine's logits of a bf16 model (`DecoderWeights.logits`): on CUDA the bf16 GEMM with fp32
    output, on the CPU (which lacks it) the logged fallback to the fp32 product; either way the exact products
    of the bf16 numbers, summed in fp32."""
    from dataclasses import replace

    from reinforge.models import decoder

    monkeypatch.setitem(decoder._FP32_OUT_MM, "on", True)
    policy = tiny(device, torch.bfloat16)
    w = decoder.DecoderWeights.of(policy.model)
    if device == "cpu":
        assert w.head16 is None
        w = replace(w, head16=policy.model.get_output_embeddings().weight)
    assert w.head16 is not None and w.head16.dtype == torch.bfloat16
    hidden = torch.randn(7, 64, generator=torch.Generator().manual_seed(5)).to(device=device, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="reinforge.models.decoder"), torch.no_grad():
        got = w.logits(hidden)
    exact = hidden.double() @ w.head.detach().double().t()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert float((got.double() - exact).abs().max()) < 1e-5 * float(exact.abs().max())
    assert decoder._FP32_OUT_MM["on"] is (device == "cuda")
    assert ("16-bit GEMM with fp32 output is unavailable" in caplog.text) is (device == "cpu")


@pytest.mark.parametrize("keys_last", [False, True])
def test_grouped_decode_attention_is_the_attention_of_one_query(keys_last: bool) -> None:
    """The decode step's attention on a GPU (`grouped_decode_attention`: each key/value head's query heads as
    its queries, no GQA expansion), run here through the CPU's SDPA, against `attention`'s CPU path: 14 heads
    over 2 key/value heads and 3 rows of different lengths, fp32."""
    from reinforge.models.attention import additive_mask, attention, grouped_decode_attention

    g = torch.Generator().manual_seed(6)
    b, h, kv, length, d = 3, 14, 2, 11, 16
    q = torch.randn(b, h, 1, d, generator=g)
    k, v = torch.randn(b, kv, length, d, generator=g), torch.randn(b, kv, length, d, generator=g)
    allowed = torch.arange(length)[None, :] <= torch.tensor([2, 10, 6])[:, None]
    bias = additive_mask(allowed, torch.float32)[:, None, None, :]
    reference = attention(q, k.transpose(-1, -2) if keys_last else k, v, bias, keys_last=keys_last)
    torch.testing.assert_close(grouped_decode_attention(q, k, v, bias), reference, atol=1e-5, rtol=1e-5)
    # Masked keys are unseen: changing them changes nothing.
    k2 = k.clone()
    k2[0, :, 3:] = 1e3
    torch.testing.assert_close(grouped_decode_attention(q, k2, v, bias), reference, atol=1e-5, rtol=1e-5)


def test_expanded_attention_is_the_grouped_query_attention_of_a_pass() -> None:
    """A learner or prefill pass's attention on a GPU (`expanded_attention`: keys and values repeated to every
    query head, so that SDPA's fused kernels take the mask), run here through the CPU's SDPA, against
    `attention`'s CPU path: 6 query positions of 3 rows over 9 keys, a causal mask after a 3-key prefix, fp32,
    forward and gradients."""
    from reinforge.models.attention import additive_mask, attention, expanded_attention

    g = torch.Generator().manual_seed(7)
    b, h, kv, s, length, d = 3, 14, 2, 6, 9, 16
    q = torch.randn(b, h, s, d, generator=g, requires_grad=True)
    k = torch.randn(b, kv, length, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv, length, d, generator=g, requires_grad=True)
    allowed = torch.arange(length)[None, :] <= torch.arange(s)[:, None] + 3
    bias = additive_mask(allowed[None, None].expand(b, 1, s, length), torch.float32)
    out = [f(q, k, v, bias) for f in (expanded_attention, attention)]
    grads = [torch.autograd.grad(o.mul(torch.arange(d) / d).sum(), (q, k, v)) for o in out]
    torch.testing.assert_close(out[0], out[1], atol=1e-5, rtol=1e-5)
    for a, r in zip(*grads, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("device", DEVICES)
def test_blocked_sampling_draws_the_inverse_cdf_tokens(device: str, temperature: float) -> None:
    """Unfiltered sampling on CUDA (`sampling.sample_blocked`: the CDF in blocks of 1,024 tokens, then
    inside the draw's block) against the CPU's full-vocabulary inverse CDF at the same keyed uniforms,
    over 20,000 tokens (19 blocks and a tail) with some that underflow to p = 0. On the CPU the
    function itself gives every token; on CUDA `sample_tokens`, which takes it there, may depart only
    where rounding moves a CDF boundary across a uniform; log-probs within fp32 rounding."""
    from reinforge.rollout.sampling import keyed_uniforms, sample_blocked, sample_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(128, 20000, generator=g) * 3
    logits[:, 1000:1100] -= 300
    uniforms = keyed_uniforms(torch.arange(128) * 7919, torch.zeros(128, dtype=torch.long))
    params = SamplingParams(temperature=temperature, max_new_tokens=1)
    tokens, logprobs = sample_tokens(logits, params, uniforms=uniforms)
    if device == "cpu":
        got, got_lp = sample_blocked(logits / temperature, uniforms=uniforms)
        assert torch.equal(got, tokens)
    else:
        got, got_lp = (t.cpu() for t in sample_tokens(logits.to(device), params, uniforms=uniforms.to(device)))
        assert (got == tokens).float().mean() >= 0.95
    same = got == tokens
    torch.testing.assert_close(got_lp[same], logprobs[same], atol=1e-5, rtol=0)
    assert bool(torch.isfinite(got_lp).all())


@pytest.mark.parametrize("max_batch_rows", [None, 16])
@pytest.mark.parametrize("device", CUDA_ONLY)
def test_decoding_ahead_of_the_stop_flags_on_the_device_gives_the_synchronous_rows(device: str,
                                                                                   max_batch_rows) -> None:
    """With decode graphs each step decodes before it reads the previous step's stop flags, which come
    through pinned memory behind that step (`DecodeSession._step_ahead`); 40 rows in all slots, or 16 slots
    refilled as rows end. fp32: every row's tokens and stop flag are the synchronous engine's (no graphs,
    no look-ahead), log-probs within the fp32 rounding of other GEMM shapes."""
    policy = tiny(device, torch.float32)
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    keys = torch.tensor([11, 22, 33, 44, 55])
    sync = NativeEngine(policy, cuda_graphs=False, max_batch_rows=max_batch_rows).generate(PROMPTS, 8, params,
                                                                                          group_keys=keys)
    engine = NativeEngine(policy, max_batch_rows=max_batch_rows)
    ahead = engine.generate(PROMPTS, 8, params, group_keys=keys)
    assert engine.graph_mode == "capture", "a graph failed or disagreed with its eager step (see the log)"
    assert sync.lengths.float().std() > 0
    assert _rows(sync) == _rows(ahead)
    assert torch.equal(sync.truncated, ahead.truncated)
    torch.testing.assert_close(ahead.sampler_logprobs, sync.sampler_logprobs, atol=FP32_TOL, rtol=0)
