"""The chunked LM-head log-probs and entropies equal the naive full-vocabulary computation, in
values and gradients, for the bare function and through a model (tied embeddings included)."""

from __future__ import annotations

import pytest
import torch

from reinforge.config import build_config
from reinforge.learner import build_sequences, completion_token_stats
from reinforge.learner.logprobs import (
    chunked_token_logprobs_and_entropy,
    completion_token_stats_chunked,
)
from reinforge.models import build_tiny_qwen2


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one torch thread, else OpenMP hand-offs dominate (10x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def naive_stats(hidden, weight, bias, targets, temperature=1.0):
    """Reference: the whole [M, V] log-softmax, as `completion_token_stats` computes it."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    # [M, V], .float() but fp64 stays fp64
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    logprobs = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logprobs, entropy


def assert_close(got, ref, name="", tol=1e-6):
    """|got - ref| <= tol * max(1, max |ref|): fp32 numbers of size ~5-10 have an ulp of 5e-7 to
    1e-6, so a bare absolute 1e-6 would demand bit-equal summation orders; this is 1e-6 absolute
    below scale 1 and 1e-6 relative above."""
    bound = tol * max(1.0, ref.abs().max().item())
    err = (got - ref).abs().max().item()
    assert err <= bound, f"{name}: max abs diff {err:.3g} > {bound:.3g}"


def make_inputs(m, h, v, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=dtype) * 0.3).requires_grad_()
    b = (torch.randn(v, generator=g, dtype=dtype) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (m,), generator=g)
    return hidden, weight, b, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck_fp64_both_outputs(temperature):
    hidden, weight, bias, targets = make_inputs(5, 3, 7, torch.float64, seed=0)

    def fn(h, w, b):
        return chunked_token_logprobs_and_entropy(h, w, b, targets, temperature=temperature, chunk_size=2)

    # Checks d logprobs and d entropy against finite differences, each output separately.
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias), eps=1e-6, atol=1e-8)


def test_entropy_gradient_formula_by_hand():
    # dH/dz_k = -p_k (z_k - sum_j p_j z_j): for z = (0, log 2) (tau = 1, W = I, h = z),
    # p = (1/3, 2/3), E[z] = (2/3) log 2, so dH/dz = (-(1/3)(-(2/3) log 2), -(2/3)(log 2 / 3))
    # = ((2/9) log 2, -(2/9) log 2), and H = log 3 - (2/3) log 2.
    ln2 = torch.log(torch.tensor(2.0, dtype=torch.float64))
    z = torch.stack([torch.zeros((), dtype=torch.float64), ln2]).unsqueeze(0).requires_grad_()
    eye = torch.eye(2, dtype=torch.float64)
    logp, entropy = chunked_token_logprobs_and_entropy(z, eye, None, torch.tensor([1]))
    assert torch.allclose(entropy, torch.log(torch.tensor(3.0, dtype=torch.float64)) - 2 * ln2 / 3)
    assert torch.allclose(logp, torch.log(torch.tensor(2 / 3, dtype=torch.float64)))
    entropy.sum().backward()
    assert torch.allclose(z.grad, torch.stack([2 * ln2 / 9, -2 * ln2 / 9]).unsqueeze(0))


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_naive(chunk_size, temperature, dtype):
    # Values and gradients of (logprobs * a + entropy * b).sum() and of entropy.sum() alone (the
    # entropy bonus), for M = 37 tokens: chunks of 1, of 7 (a ragged last chunk), and one chunk.
    m, v = 37, 501
    hidden, weight, bias, targets = make_inputs(m, 16, v, dtype, seed=1)
    a = torch.randn(m, generator=torch.Generator().manual_seed(2), dtype=dtype)
    b = torch.randn(m, generator=torch.Generator().manual_seed(3), dtype=dtype)
    # fp64 shows the identity (to rounding of fp64); fp32 the precision the learner gets.
    tol = 1e-12 if dtype == torch.float64 else 1e-6

    def run(fn, a, b, **kw):
        for t in (hidden, weight, bias):
            t.grad = None
        logprobs, entropy = fn(hidden, weight, bias, targets, temperature=temperature, **kw)
        (logprobs * a + entropy * b).sum().backward()
        return logprobs.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()

    names = ["logprobs", "entropy", "d hidden", "d weight", "d bias"]
    for wa, wb in [(a, b), (torch.zeros_like(a), torch.ones_like(b))]:
        expected = run(naive_stats, wa, wb)
        got = run(chunked_token_logprobs_and_entropy, wa, wb, chunk_size=chunk_size)
        for name, e, g in zip(names, expected, got, strict=True):
            assert_close(g, e, name, tol)
        assert expected[2].abs().max().item() > 1e-2  # a non-trivial gradient


def test_bf16_params_fp32_head():
    hidden, weight, _, targets = make_inputs(64, 32, 300, torch.float32, seed=4, bias=False)
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    exact, _ = naive_stats(h16.double(), w16.double(), None, targets)
    fp32_head, ent = chunked_token_logprobs_and_entropy(h16, w16, None, targets, chunk_size=16, fp32_head=True)
    bf16_head, _ = chunked_token_logprobs_and_entropy(h16, w16, None, targets, chunk_size=16, fp32_head=False)
    assert fp32_head.dtype == bf16_head.dtype == torch.float32
    # The fp32 head of bf16 inputs is the naive fp32 computation on the same (rounded) inputs;
    # the bf16 head is off by bf16 rounding of the logits (8 bits of mantissa).
    ref, ref_ent = naive_stats(h16.float(), w16.float(), None, targets)
    assert_close(fp32_head, ref, "fp32 head")
    assert (bf16_head - exact).abs().mean() > 10 * (fp32_head - exact).abs().mean()
    # Gradients come back in the parameter dtype and equal the fp32 ones up to the final bf16 rounding.
    (fp32_head + ent).sum().backward()
    h32 = h16.detach().float().requires_grad_()
    w32 = w16.detach().float().requires_grad_()
    sum(naive_stats(h32, w32, None, targets)).sum().backward()
    assert h16.grad.dtype == w16.grad.dtype == torch.bfloat16
    assert_close(h16.grad.float(), h32.grad, "d hidden", tol=1e-2)
    assert_close(w16.grad.float(), w32.grad, "d weight", tol=1e-2)


@pytest.fixture
def tiny_policy(micro_overrides):
    cfg = build_config(micro_overrides)
    return build_tiny_qwen2(cfg.model, seed=0)


def test_model_level_matches_completion_token_stats(tiny_policy):
    model = tiny_policy.model
    pad = tiny_policy.tokenizer.pad_token_id
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [[3, 4, 5], [6], [7, 8], [9, 10, 11, 12]]
    completion_ids = torch.randint(1, vocab, (4, 5), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]).float()
    completion_ids = completion_ids * completion_mask.long()
    seq = build_sequences(prompts, completion_ids, completion_mask, pad)
    a = torch.randn(4, 5, generator=g)
    b = torch.randn(4, 5, generator=g)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied

    def run(fn, **kw):
        model.zero_grad(set_to_none=True)
        stats = fn(model, seq, 0.7, **kw)
        (stats.logprobs * a + stats.entropy * b).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return stats.logprobs.detach(), stats.entropy.detach(), grads

    lp_ref, ent_ref, grads_ref = run(completion_token_stats)
    lp, ent, grads = run(completion_token_stats_chunked, chunk_size=3)
    assert torch.equal(lp == 0, lp_ref == 0) and bool((lp[completion_mask == 0] == 0).all())
    assert_close(lp, lp_ref, "logprobs")
    assert_close(ent, ent_ref, "entropy")
    assert grads.keys() == grads_ref.keys()
    for name, ref in grads_ref.items():
        assert_close(grads[name], ref, name)
    # The tied matrix (one parameter, so the equality above covers it) gets both paths: its
    # gradient is not the head's part alone, which is what a detached body would give.
    model.zero_grad(set_to_none=True)
    positions = seq.starts.unsqueeze(1) - 1 + torch.arange(5).unsqueeze(0)
    rows, cols = (completion_mask > 0).nonzero(as_tuple=True)
    with torch.no_grad():
        body = model.model(input_ids=seq.input_ids, attention_mask=seq.attention_mask).last_hidden_state
    head = model.get_output_embeddings().weight
    lp_m, ent_m = chunked_token_logprobs_and_entropy(
        body[rows, positions[rows, cols]], head, None, completion_ids[rows, cols], temperature=0.7
    )
    (lp_m * a[rows, cols] + ent_m * b[rows, cols]).sum().backward()
    embedding_part = grads["model.embed_tokens.weight"] - head.grad
    assert embedding_part.abs().max().item() > 1e-4
    unused = torch.ones(vocab, dtype=torch.bool)
    unused[seq.input_ids.flatten()] = False
    assert embedding_part[unused].abs().max().item() < 1e-7  # ids in no input row: head part only


def test_no_valid_tokens_gives_zeros_and_zero_grad(tiny_policy):
    model = tiny_policy.model
    seq = build_sequences([[3, 4], [5]], torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), 0)
    stats = completion_token_stats_chunked(model, seq)
    assert stats.logprobs.shape == (2, 3) and bool((stats.logprobs == 0).all()) and bool((stats.entropy == 0).all())
    (stats.logprobs + stats.entropy).sum().backward()
    assert all(p.grad is None or bool((p.grad == 0).all()) for p in model.parameters())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_chunk_order_matches_naive(monkeypatch, temperature, dtype):
    """The chunk loops' fused order (CUDA's: entropy normalised on [C] numbers, log p = z - lse in one pass,
    the entropy term in one addcmul, 1 / tau on the per-token coefficients), turned on here on the CPU:
    the naive numbers, with and without the entropy in the loss, and finite differences in fp64."""
    from reinforge.learner import logprobs as lp

    monkeypatch.setitem(lp._FUSED, "cpu", True)
    m, v = 37, 501
    hidden, weight, bias, targets = make_inputs(m, 16, v, dtype, seed=5)
    a = torch.randn(m, generator=torch.Generator().manual_seed(6), dtype=dtype)
    b = torch.randn(m, generator=torch.Generator().manual_seed(7), dtype=dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-6

    def run(fn, with_entropy: bool):
        logprobs, entropy = fn(hidden, weight, bias, targets, temperature=temperature,
                               **({"chunk_size": 7} if fn is chunked_token_logprobs_and_entropy else {}))
        loss = (logprobs * a).sum() + ((entropy * b).sum() if with_entropy else 0.0)
        return (logprobs.detach(), entropy.detach(), *torch.autograd.grad(loss, (hidden, weight, bias)))

    names = ["logprobs", "entropy", "d hidden", "d weight", "d bias"]
    for with_entropy in (True, False):
        expected, got = run(naive_stats, with_entropy), run(chunked_token_logprobs_and_entropy, with_entropy)
        for name, e, g in zip(names, expected, got, strict=True):
            assert_close(g, e, f"{name} (entropy in the loss: {with_entropy})", tol)
    if dtype == torch.float64:
        h, w, bb, t = make_inputs(5, 3, 7, torch.float64, seed=0)
        assert torch.autograd.gradcheck(
            lambda h, w, bb: chunked_token_logprobs_and_entropy(h, w, bb, t, temperature=temperature, chunk_size=2),
            (h, w, bb), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_loss_without_the_entropy_gets_the_same_gradient_bits(temperature):
    """Without the entropy in the loss its gradient is None and the backward skips its terms; the
    gradients are the bits the full form gives with a zero entropy gradient (e (log p + H) = 0 exactly)."""
    hidden, weight, bias, targets = make_inputs(9, 6, 23, torch.float32, seed=3)
    g = torch.randn(9, generator=torch.Generator().manual_seed(4))

    def grads(with_zero_entropy: bool):
        logp, ent = chunked_token_logprobs_and_entropy(hidden, weight, bias, targets, temperature=temperature,
                                                       chunk_size=4)
        loss = (logp * g).sum() + (0.0 * ent.sum() if with_zero_entropy else 0.0)
        return torch.autograd.grad(loss, (hidden, weight, bias))

    for got, ref in zip(grads(False), grads(True), strict=True):
        assert torch.equal(got, ref)
