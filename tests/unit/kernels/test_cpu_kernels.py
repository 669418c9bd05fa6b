"""The fused CPU kernels (reinforge/kernels/csrc): the numbers of the PyTorch
path they replace, in the attention and the sampler alone and through whole rollouts, and the
fallback when they cannot be built."""

from __future__ import annotations

import logging
import shutil
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import MistralConfig, MistralForCausalLM
from unit.rollout.test_native_engine import MODELS, PROMPTS, eos_prone, qwen2

from reinforge.kernels import load_cpu_kernels, rms_norm, swiglu
from reinforge.learner import build_sequences
from reinforge.learner.shared_prefix import completion_token_stats_shared
from reinforge.models import Policy
from reinforge.models.attention import additive_mask, attention
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout import HFEngine, NativeEngine, SamplingParams
from reinforge.rollout.sampling import filter_logits, keyed_uniforms, sample_tokens
from reinforge.rollout.session import DecodeSession


@pytest.fixture(scope="module")
def kernels():
    ops = load_cpu_kernels()
    # The kernels are optional: without a compiler every caller runs its PyTorch path, which the rest
    # of the suite covers. With one, the kernels must build: a failed build fails here, not skips.
    if ops is None and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the engine runs its PyTorch path")
    assert ops is not None, "a C++ compiler is here, so the kernels must build (see the logged reason)"
    return ops


def mistral_window(window: int = 4) -> Policy:
    tok = build_char_tokenizer()
    config = MistralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=True, sliding_window=window,
    )
    torch.manual_seed(0)
    return eos_prone(Policy(model=MistralForCausalLM(config), tokenizer=tok))


@pytest.mark.parametrize("head_dim,heads,kv_heads,window", [(16, 8, 8, 0), (64, 8, 2, 0), (80, 4, 1, 0), (32, 4, 2, 5)])
def test_decode_attention_is_the_masked_softmax_of_the_cache(kernels, head_dim: int, heads: int, kv_heads: int,
                                                             window: int) -> None:
    rows, capacity = 13, 21
    gen = torch.Generator().manual_seed(head_dim + window)
    k_cache = torch.randn(rows + 2, kv_heads, head_dim, capacity, generator=gen)    # keys transposed, two spare slots
    v_cache = torch.randn(rows + 2, kv_heads, capacity, head_dim, generator=gen)
    q = torch.randn(rows, heads, head_dim, generator=gen)
    k_new = torch.randn(rows, kv_heads, head_dim, generator=gen)
    v_new = torch.randn(rows, kv_heads, head_dim, generator=gen)
    positions = torch.randint(0, capacity, (rows,), generator=gen)
    positions[:2] = torch.tensor([0, capacity - 1])

    # The PyTorch path: write, then attend over the whole capacity with a mask.
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    slots = torch.arange(rows)
    ref_k[slots, :, :, positions] = k_new
    ref_v[slots, :, positions] = v_new
    key_pos = torch.arange(capacity)
    allowed = key_pos[None, :] <= positions[:, None]
    if window:
        allowed &= positions[:, None] - key_pos[None, :] < window
    expected = attention(
        q[:, :, None], ref_k[:rows], ref_v[:rows], additive_mask(allowed, torch.float32)[:, None, None], keys_last=True
    )[:, :, 0]

    out = torch.empty(rows, heads, head_dim)
    kernels.decode_attention(out, q, k_new, v_new, k_cache, v_cache, positions, head_dim ** -0.5, window)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)     # the spare slots untouched too


def test_decode_attention_refuses_a_position_outside_the_cache(kernels) -> None:
    k_cache, v_cache = torch.zeros(2, 1, 16, 8), torch.zeros(2, 1, 8, 16)
    q = k = torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.decode_attention(torch.empty(2, 1, 16), q, k, k, k_cache, v_cache, torch.tensor([0, 8]), 0.25, 0)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
def test_sample_draws_the_tokens_of_keyed_inverse_cdf_sampling(kernels, temperature: float) -> None:
    rows, vocab = 300, 1000
    gen = torch.Generator().manual_seed(int(temperature * 10))
    logits = torch.randn(rows, vocab, generator=gen) * 3
    keys = torch.randint(2**62, (rows,), generator=gen)
    counters = torch.randint(0, 50, (rows,), generator=gen)
    params = SamplingParams(temperature=temperature or 1.0, greedy=temperature == 0.0)
    expected_tokens, expected_logprobs = sample_tokens(logits, params, uniforms=keyed_uniforms(keys, counters))
    tokens, logprobs = torch.empty(rows, dtype=torch.long), torch.empty(rows)
    kernels.sample(tokens, logprobs, logits, temperature, keys, counters)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=2e-6, rtol=0)
    if temperature:
        assert len(set(tokens.tolist())) > 100        # really sampled, not the argmax


@pytest.mark.parametrize("top_p,scale,vocab", [(0.9, 3.0, 1000), (0.5, 1.0, 1000), (0.95, 0.02, 151_936),
                                               (0.3, 8.0, 151_936)])
def test_sample_with_top_p_draws_from_the_nucleus_of_filter_logits(kernels, top_p: float, scale: float,
                                                                   vocab: int) -> None:
    # From nearly flat rows (0.02: the nucleus is most of Qwen's vocabulary) to peaked ones (8.0: a few tokens)
    rows = 300 if vocab < 10_000 else 16
    gen = torch.Generator().manual_seed(vocab + int(top_p * 100))
    logits = torch.randn(rows, vocab, generator=gen) * scale
    keys = torch.randint(2**62, (rows,), generator=gen)
    counters = torch.randint(0, 50, (rows,), generator=gen)
    params = SamplingParams(temperature=0.8, top_p=top_p)
    expected_tokens, expected_logprobs = sample_tokens(logits, params, uniforms=keyed_uniforms(keys, counters))
    tokens, logprobs = torch.empty(rows, dtype=torch.long), torch.empty(rows)
    kernels.sample(tokens, logprobs, logits, 0.8, keys, counters, top_p)
    same = tokens == expected_tokens
    if vocab < 10_000:
        assert bool(same.all())
    else:   # a CDF summed in float over 10^5 kept tokens: rounding may move a boundary across one row's uniform
        assert int((~same).sum()) <= 1 and int((tokens - expected_tokens).abs().max()) <= 1
    torch.testing.assert_close(logprobs[same], expected_logprobs[same], atol=2e-5, rtol=0)
    # each log-prob is under the renormalised nucleus: the full softmax's minus log of filter_logits' kept mass
    scores = logits / 0.8
    kept = torch.isfinite(filter_logits(scores, 0, top_p))
    log_kept = scores.masked_fill(~kept, float("-inf")).logsumexp(dim=-1) - scores.logsumexp(dim=-1)
    full = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, full - log_kept, atol=2e-5, rtol=0)
    assert float(log_kept.mean()) < -0.01         # the nucleus really leaves mass out


def test_sample_with_top_p_keeps_every_token_tied_at_the_edge_of_the_nucleus(kernels) -> None:
    # p = (0.4, 0.3, 0.3) at top-p 0.5: 0.4 alone holds less than 0.5, so a token of 0.3 is needed and both
    # tie (a sort keeps one of them, whichever it puts first); 0.4 alone at top-p 0.35. Uniform u picks token 0
    # below 0.4 / 1.0 of the nucleus's CDF, token 1 up to 0.7, else 2.
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.3]])).expand(2000, 3).contiguous()
    keys, counters = torch.arange(2000), torch.zeros(2000, dtype=torch.long)
    tokens, logprobs = torch.empty(2000, dtype=torch.long), torch.empty(2000)
    kernels.sample(tokens, logprobs, logits, 1.0, keys, counters, 0.5)
    u = keyed_uniforms(keys, counters)
    assert torch.equal(tokens, (u >= 0.4).long() + (u >= 0.7).long())
    torch.testing.assert_close(logprobs, torch.log(torch.tensor([0.4, 0.3, 0.3]))[tokens], atol=1e-6, rtol=0)
    kernels.sample(tokens, logprobs, logits, 1.0, keys, counters, 0.35)
    assert bool((tokens == 0).all()) and float(logprobs.abs().max()) < 1e-6


def test_fused_rms_norm_and_swiglu_match_pytorch_values_and_gradients(kernels) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(301, 96, generator=gen) * 3).requires_grad_()
    weight = (torch.rand(96, generator=gen) + 0.5).requires_grad_()
    dy = torch.randn(301, 96, generator=gen)
    fused = rms_norm(x, weight, 1e-6)
    fused_dx, fused_dw = torch.autograd.grad(fused, (x, weight), dy)
    plain = F.rms_norm(x, (96,), weight, 1e-6)
    plain_dx, plain_dw = torch.autograd.grad(plain, (x, weight), dy)
    assert fused.grad_fn.name() == "_RMSNormBackward"          # the kernel really ran
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_dx, plain_dx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_dw, plain_dw, atol=1e-4, rtol=1e-5)      # a sum over 301 rows

    gate_up = (torch.randn(301, 2 * 80, generator=gen) * 4).requires_grad_()  # silu's tails included
    da = torch.randn(301, 80, generator=gen)
    fused = swiglu(gate_up, None)
    (fused_grad,) = torch.autograd.grad(fused, gate_up, da)
    gate, up = gate_up.chunk(2, dim=-1)
    plain = F.silu(gate) * up
    (plain_grad,) = torch.autograd.grad(plain, gate_up, da)
    assert fused.grad_fn.name() == "_SwiGLUBackward"
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_grad, plain_grad, atol=1e-5, rtol=1e-5)


CASES = {
    **MODELS,
    "mistral_window": mistral_window,
    # Widths that are not multiples of the packed projections' 32-column panels (qkv 120, o and
    # down 40, gate_up 176): the last panel of each is short.
    "qwen2_odd_widths": lambda: qwen2(hidden_size=40, num_heads=5, num_kv_heads=5, intermediate_size=88),
}


@pytest.mark.parametrize("greedy,top_p", [(True, 1.0), (False, 1.0), (False, 0.8)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layers_give_the_pytorch_paths_rollout(kernels, name: str, greedy: bool, top_p: float) -> None:
    policy = CASES[name]()
    params = SamplingParams(max_new_tokens=12, greedy=greedy, temperature=1.0, top_p=top_p)
    fused_engine, plain_engine = NativeEngine(policy, cpu_kernels=True), NativeEngine(policy, cpu_kernels=False)
    assert fused_engine.kernels is not None and plain_engine.kernels is None
    fused = fused_engine.generate(PROMPTS, 4, params, generator=torch.Generator().manual_seed(1))
    plain = plain_engine.generate(PROMPTS, 4, params, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fused.completion_ids, plain.completion_ids)
    assert len(set(fused.lengths.tolist())) > 1          # rows ended at different steps
    assert torch.isfinite(fused.sampler_logprobs).all()
    torch.testing.assert_close(fused.sampler_logprobs, plain.sampler_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("vocab", [89, 1007])
def test_the_packed_head_gives_the_heads_logits(kernels, vocab: int) -> None:
    # 1007 tokens: the last of the head's 32-column panels holds 15; the head is packed once and reused
    gen = torch.Generator().manual_seed(0)
    policy = qwen2()
    weights = NativeEngine(policy).decoder_weights()
    weights.head = torch.randn(vocab, weights.head.shape[1], generator=gen)
    for rows in (1, 7, 32):
        hidden = torch.randn(rows, weights.head.shape[1], generator=gen)
        packed = weights.packed_logits(kernels, hidden)
        torch.testing.assert_close(packed, hidden @ weights.head.t(), atol=1e-5, rtol=1e-5)
        assert packed.shape == (rows, vocab)


def test_a_sliding_window_model_decodes_each_prompt_as_generate_does() -> None:
    """Prompts of different lengths, padded past the window in the prefill: every row still gets
    the tokens and log-probs `generate` gives that prompt alone (a padded query that saw no key
    used to turn the keys to NaN)."""
    policy = mistral_window()
    params = SamplingParams(max_new_tokens=10, greedy=True)
    batch = NativeEngine(policy).generate(PROMPTS, 1, params)
    for row, prompt in enumerate(PROMPTS):
        alone = HFEngine(policy).generate([prompt], 1, params)
        n = alone.completion_ids.shape[1]
        assert torch.equal(batch.completion_ids[row, :n], alone.completion_ids[0])
        torch.testing.assert_close(batch.sampler_logprobs[row, :n], alone.sampler_logprobs[0], atol=1e-5, rtol=0)


def test_without_kernels_the_engine_falls_back_to_pytorch(monkeypatch, caplog, tmp_path) -> None:
    policy = MODELS["qwen2"]()
    try:
        monkeypatch.setenv("REINFORGE_CPU_KERNELS", "0")
        load_cpu_kernels.cache_clear()
        assert load_cpu_kernels() is None and NativeEngine(policy).kernels is None

        monkeypatch.setenv("REINFORGE_CPU_KERNELS", "1")
        monkeypatch.setenv("CXX", "false")  # a "compiler" that fails: the build fails, the engine warns and goes on
        monkeypatch.setenv("REINFORGE_CACHE", str(tmp_path))
        load_cpu_kernels.cache_clear()
        with caplog.at_level(logging.WARNING, logger="reinforge.kernels"):
            engine = NativeEngine(policy)
        assert engine.kernels is None
        assert "PyTorch path" in caplog.text
        rollout = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=6, greedy=True))
        assert rollout.completion_mask.sum() > 0
    finally:
        monkeypatch.undo()
        load_cpu_kernels.cache_clear()


class _SplitRows:
    """The kernels with the split_rows of decode_layer, decode_step and decode_loop forced to `mode` (1: each
    thread runs the whole layer, or step, for its rows; 0: the threads split each part's work); `calls` counts
    the ops called."""

    def __init__(self, ops, mode: int):
        self.ops, self.mode, self.calls = ops, mode, Counter()

    def __getattr__(self, name: str):
        self.calls[name] += 1
        if name in ("decode_layer", "decode_step", "decode_loop"):
            return lambda *args, **kwargs: getattr(self.ops, name)(*args, self.mode, **kwargs)
        return getattr(self.ops, name)


# How the native engine's CPU kernels run a generation: each step op by op (`decode_layer` per layer, the packed
# head, `sample`), each step in one call (`decode_step`), or the rows to their ends in one call (`decode_loop`).
WAYS = {"op_by_op": "decode_layer", "step": "decode_step", "loop": "decode_loop"}


def _rollouts(policy: Policy, ops, params: SamplingParams, way: str, monkeypatch) -> list:
    """The rollout of PROMPTS x 4 on two threads with split_rows 0 and 1, the kernels run `way` (WAYS)."""
    if way == "op_by_op":
        monkeypatch.setattr(DecodeSession, "_one_call", lambda self: False)
    if way == "step":
        monkeypatch.setattr(DecodeSession, "_loops", lambda self: False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rollouts = []
        for mode in (0, 1):
            engine = NativeEngine(policy, cpu_kernels=True)
            engine.kernels = _SplitRows(ops, mode)
            rollouts.append(engine.generate(PROMPTS, 4, params, generator=torch.Generator().manual_seed(3)))
            assert {op for op in WAYS.values() if engine.kernels.calls[op]} == {WAYS[way]}
    finally:
        torch.set_num_threads(threads)
        monkeypatch.undo()
    return rollouts


@pytest.mark.parametrize("name", sorted(CASES))
def test_decoding_splits_rows_or_work_between_threads_with_identical_numbers(kernels, name: str, monkeypatch) -> None:
    """The two ways decode_layer, decode_step and decode_loop use their threads run every row's sums in the same
    order: the same tokens and log-probs bit for bit, on two threads (on one, both run the layer once over all
    rows)."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    for way in WAYS:
        by_work, by_rows = _rollouts(CASES[name](), kernels, params, way, monkeypatch)
        assert len(set(by_rows.lengths.tolist())) > 1          # rows ended at different steps: the batch shrank
        assert torch.equal(by_rows.completion_ids, by_work.completion_ids)
        assert torch.equal(by_rows.sampler_logprobs, by_work.sampler_logprobs)


@pytest.mark.parametrize("greedy,temperature,top_p", [(True, 1.0, 1.0), (False, 1.0, 1.0), (False, 0.7, 0.8)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_step_and_the_generation_in_one_call_sample_what_the_step_op_by_op_samples(
        kernels, name: str, greedy: bool, temperature: float, top_p: float, monkeypatch) -> None:
    """decode_step (the embedding, every layer, the final norm, the head and the sampler in one call) and
    decode_loop (every step to the rows' ends, and the session's records, in one call) give the tokens, log-probs
    and ends of the step op by op, bit for bit, with rows split and with work split."""
    policy = CASES[name]()
    params = SamplingParams(max_new_tokens=12, greedy=greedy, temperature=temperature, top_p=top_p)
    op_by_op = _rollouts(policy, kernels, params, "op_by_op", monkeypatch)
    assert len(set(op_by_op[0].lengths.tolist())) > 1
    for way in ("step", "loop"):
        for a, b in zip(_rollouts(policy, kernels, params, way, monkeypatch), op_by_op, strict=True):
            assert torch.equal(a.completion_ids, b.completion_ids)
            assert torch.equal(a.sampler_logprobs, b.sampler_logprobs)
            assert torch.equal(a.truncated, b.truncated) and a.texts == b.texts


@pytest.mark.parametrize("slots", [12, 5])
def test_a_session_run_in_one_call_records_what_its_steps_record(kernels, slots: int) -> None:
    """`DecodeSession.run` decodes the live rows to their ends in one call (decode_loop) once no row waits for a
    slot: every row's tokens, log-probs, weight versions, end and kept context (ids, draws, keys and values) are
    those of the session stepped to its end. With 5 slots for 12 rows, the rows that wait are stepped first."""
    policy = CASES["qwen2"]()
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    ids = [policy.tokenizer(p)["input_ids"] for p in PROMPTS]

    def finished(run: bool) -> tuple[list, int]:
        engine = NativeEngine(policy, cpu_kernels=True)
        engine.kernels = _SplitRows(kernels, -1)
        session = engine.session(params, slots, torch.Generator().manual_seed(1), version=5, keep_context=True)
        session.add(ids, 12 // len(ids), tags=range(12))
        rows = []
        while session.busy:
            rows += session.run() if run else session.step()
        return sorted(rows, key=lambda row: row.tag), engine.kernels.calls["decode_loop"]

    (looped, loops), (stepped, none) = finished(True), finished(False)
    assert loops == 1 and none == 0 and len({len(row.tokens) for row in looped}) > 1
    for a, b in zip(looped, stepped, strict=True):
        assert a.tag == b.tag and a.truncated == b.truncated
        for field in ("tokens", "logprobs", "versions"):
            assert torch.equal(getattr(a, field), getattr(b, field))
        assert set(a.versions.tolist()) == {5}
        ca, cb = a.context, b.context
        assert (ca.ids, ca.cached, ca.key, ca.drawn) == (cb.ids, cb.cached, cb.key, cb.drawn)
        assert all(torch.equal(x, y) for x, y in zip(ca.keys + ca.values, cb.keys + cb.values, strict=True))


def test_a_learner_layer_split_by_rows_between_threads_gives_the_numbers_of_one_thread(kernels) -> None:
    """train_layer_forward runs the whole layer per thread for its rows where every thread has rows, else each
    part over all rows: the engine's prefill (packed products, whose rows sum alike) gives the same keys, values
    and logits bit for bit on two threads (5 rows split) as on one; the learner's forward and gradients (ATen's
    products where this machine chose them) agree to float rounding."""
    policy = CASES["qwen2"]()
    engine = NativeEngine(policy, cpu_kernels=True)
    ids = [policy.tokenizer(p)["input_ids"] for p in PROMPTS]

    def passes(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        session = engine.session(SamplingParams(max_new_tokens=4), slots=len(ids))
        session._make_room(max(map(len, ids)))
        block, logits = session._prefill(ids)
        policy.model.zero_grad(set_to_none=True)
        batch = build_sequences(ids, torch.tensor([[5, 6, 7]] * len(ids)), torch.ones(len(ids), 3), 0)
        stats = completion_token_stats_shared(policy.model, batch, torch.arange(len(ids)))
        stats.logprobs.sum().backward()
        grads = [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]
        return [*block.keys, *block.values, logits], [stats.logprobs.detach(), *grads]

    threads = torch.get_num_threads()
    try:
        (engine_one, learner_one), (engine_two, learner_two) = passes(1), passes(2)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(engine_one, engine_two, strict=True))
    assert len(learner_one) > 10
    for a, b in zip(learner_one, learner_two, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_new_generation_packs_into_the_last_ones_memory_and_samples_the_new_weights(kernels) -> None:
    """The engine packs a call's weights into the panels and fused projections of the call before: after a
    change to the weights, the next call samples what a fresh engine samples, bit for bit (nothing of the old
    weights is left), and it used the old call's memory."""
    policy = CASES["qwen2"]()
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    engine = NativeEngine(policy, cpu_kernels=True)
    engine.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(0))
    reused = {t.data_ptr() for ts in engine._spare_panels.values() for t in ts}
    assert len(reused) >= 4 * len(policy.model.model.layers)   # four panels and two fused weights a layer
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.5)
    again = engine.generate(PROMPTS, 2, params, generator=torch.Generator().manual_seed(1))
    assert reused == {t.data_ptr() for ts in engine._spare_panels.values() for t in ts}
    fresh = NativeEngine(policy, cpu_kernels=True).generate(PROMPTS, 2, params,
                                                            generator=torch.Generator().manual_seed(1))
    assert torch.equal(again.completion_ids, fresh.completion_ids)
    assert torch.equal(again.sampler_logprobs, fresh.sampler_logprobs)
