"""The shared-prompt learner forward gives the plain Hugging Face path's per-token log-probs,
entropies and parameter gradients, for Qwen2 (MHA and GQA), Llama and Qwen3, on batches with
ragged prompts and completions, split and reordered groups, and refuses what it cannot share."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from reinforge import kernels
from reinforge.config import build_config
from reinforge.learner import SequenceBatch, build_sequences, completion_token_stats, shared_prefix
from reinforge.learner.shared_prefix import completion_token_stats_shared, length_buckets
from reinforge.models import build_tiny_qwen2
from reinforge.models.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
PAD = TOKENIZER.pad_token_id
# Groups of different prompt lengths (1 included: token 0 is then predicted from position 0).
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]
GROUP_SIZE = 3
# Completion lengths per row: ragged, one single-token row and one fully masked row.
LENGTHS = [6, 2, 4, 1, 5, 6, 3, 0, 6, 2, 6, 4]
# (row, t) of completion tokens equal to the pad id, which some tokenizers use as a real token
# (Qwen's <|endoftext|>): HF's embedding gives its pad row no gradient (padding_idx); so must we.
PAD_TOKENS = [(0, 2), (4, 1), (9, 0)]


def sharpen(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw the weights larger. The HF init (std 0.02) gives a near-uniform next-token
    distribution (entropy 4.47 of log 89 = 4.49) and near-uniform attention, so a key seen or
    hidden by mistake would move a log-prob by less than the tolerance. Here log-probs reach
    -7 to -15 and entropies spread over 0.3-4.1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:   # embeddings std 0.3; projections std 1 / sqrt(fan_in)
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "embed" in name else p.shape[1] ** -0.5))
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:              # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def qwen2(micro: list[str], **sizes) -> torch.nn.Module:
    overrides = micro + [f"model.{k}={v}" for k, v in {"num_layers": 2, **sizes}.items()]
    return sharpen(build_tiny_qwen2(build_config(overrides).model, seed=0).model)


def from_config(model_cls, config_cls, **extra) -> torch.nn.Module:
    config = config_cls(
        vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=TOKENIZER.eos_token_id,
        bos_token_id=None, **extra,
    )
    torch.manual_seed(0)
    return sharpen(model_cls(config))


MODELS = {
    "qwen2": lambda micro: qwen2(micro, num_heads=2, num_kv_heads=2),
    "qwen2_gqa": lambda micro: qwen2(micro, num_heads=4, num_kv_heads=2),
    # Widths that are not multiples of the fused layer's 32-column weight panels (qkv 120, o and
    # down 40, gate_up 176), forward and backward.
    "qwen2_odd_widths": lambda micro: qwen2(micro, hidden_size=40, num_heads=5, num_kv_heads=5, intermediate_size=88),
    # The fused attention's blocks with a head dim of one 16-float vector (the built-in model's), with GQA; qwen2
    # and qwen2_gqa give it four and two vectors (64, 32), qwen2_odd_widths its per-query path (8).
    "qwen2_head_dim_16": lambda micro: qwen2(micro, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96),
    # Untied head: the head and the embedding get separate gradients.
    "llama": lambda micro: from_config(LlamaForCausalLM, LlamaConfig, tie_word_embeddings=False),
    "qwen3": lambda micro: from_config(Qwen3ForCausalLM, Qwen3Config, head_dim=16, tie_word_embeddings=True),
}


def grouped_batch(vocab: int, seed: int = 0) -> tuple[SequenceBatch, torch.Tensor]:
    """GROUP_SIZE rows per prompt of PROMPTS, completions of LENGTHS (pad past the end)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [p for p in PROMPTS for _ in range(GROUP_SIZE)]
    width = max(LENGTHS)
    completion_mask = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    completion_ids = torch.randint(3, vocab, (len(prompt_ids), width), generator=g).masked_fill(
        completion_mask == 0, PAD
    )
    for row, t in PAD_TOKENS:
        completion_ids[row, t] = PAD
    group_ids = torch.arange(len(PROMPTS)).repeat_interleave(GROUP_SIZE)
    return build_sequences(prompt_ids, completion_ids, completion_mask, PAD), group_ids


def assert_close(got: torch.Tensor, ref: torch.Tensor, name: str, atol: float = 1e-5, rtol: float = 0.0) -> None:
    err = (got - ref).abs().max().item()
    assert torch.allclose(got, ref, atol=atol, rtol=rtol), f"{name}: max abs diff {err:.3g}"


@pytest.fixture(params=["fused", "fused_aten", "pytorch"])
def layers(request, monkeypatch) -> str:
    """The decoder layers as the fused CPU op (kernels.train_layer, where the kernels build and the
    model's layers qualify: not Qwen3's q/k norm) with its products against packed weights ("fused") or
    through ATen on the plain weights ("fused_aten"), whichever this machine's tuning chose (kernels/tuning.py),
    or as PyTorch ops with the geometry as a mask."""
    calls = []
    if request.param == "pytorch":
        monkeypatch.setattr(kernels, "fused_layer_ok", lambda *a: False)
    else:
        kernels.load_cpu_kernels()      # its tuning first; then this test's choice of products
        backend = "aten" if request.param == "fused_aten" else "packed"
        monkeypatch.setitem(kernels.TUNING, "products", {"learner": backend})
        fused = kernels.train_layer
        monkeypatch.setattr(kernels, "train_layer", lambda *a: calls.append(1) or fused(*a))
    yield request.param
    if (
        request.param != "pytorch"
        and kernels.load_cpu_kernels() is not None
        and request.node.callspec.params.get("name") != "qwen3"
    ):
        assert calls, "the fused layers did not run"


@pytest.fixture(params=["one_pass", "pass_per_length"])
def buckets(request, monkeypatch) -> str:
    """The completion passes as one padded pass, or one per length class (LENGTHS: 4 passes)."""
    monkeypatch.setattr(shared_prefix, "PASS_COST_POSITIONS", 10**9 if request.param == "one_pass" else 0)
    return request.param


def test_length_buckets_split_long_tails_and_merge_cheap_neighbours() -> None:
    # need 1, 2, 3 are classes (0, 1], (1, 2], (2, 4]; 5 is (4, 8], 9 (8, 16], 40 (32, 64].
    need = torch.tensor([0, 1, 2, 3, 5, 9, 40])
    as_lists = lambda cost: [b.tolist() for b in length_buckets(need, cost)]   # noqa: E731
    assert as_lists(0) == [[1], [2], [3], [4], [5], [6]]
    # Cost 3: padding row 1 to 2 costs 1, rows 1-2 to 3 costs 2; rows 1-3 to 5 would cost 6 > 3.
    assert as_lists(3) == [[1, 2, 3], [4], [5], [6]]
    assert as_lists(10**9) == [[1, 2, 3, 4, 5, 6]]
    assert length_buckets(torch.zeros(4, dtype=torch.long)) == []


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_values_equal_the_plain_forward(name: str, temperature: float, micro_overrides, buckets, layers) -> None:
    model = MODELS[name](micro_overrides)
    batch, group_ids = grouped_batch(model.config.vocab_size)
    with torch.no_grad():
        ref = completion_token_stats(model, batch, temperature)
        got = completion_token_stats_shared(model, batch, group_ids, temperature, chunk_size=5)
    # A model far from uniform (log 89 = 4.49): the comparison below can see a misplaced key.
    assert ref.logprobs.abs().max() > 6.0 and ref.entropy[batch.completion_mask > 0].min() < 4.0
    assert_close(got.logprobs, ref.logprobs, "logprobs")
    assert_close(got.entropy, ref.entropy, "entropy")
    assert (got.logprobs[batch.completion_mask == 0] == 0).all() and (
        got.entropy[batch.completion_mask == 0] == 0
    ).all()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_equal_the_plain_forward(name: str, micro_overrides, buckets, layers) -> None:
    # L = sum_it w_it logp_it + c sum_it H_it with random w: every token's log-prob and entropy
    # carry their own weight, so a gradient routed to the wrong row or token would show. w and c
    # are divided by the token count M, as a token-mean loss weighs them: the gradients are then
    # of the size training sees (~1), where fp32 rounding is ~1e-7. (With unit weights they reach
    # ~50, and both paths sit ~5e-5 from an fp64 reference, which atol 1e-6 cannot absorb.)
    model = MODELS[name](micro_overrides)
    batch, group_ids = grouped_batch(model.config.vocab_size)
    tokens = batch.completion_mask.sum()
    weights = torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(1)) / tokens
    c = 0.3 / tokens

    def grads(stats_fn) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        stats = stats_fn()
        ((weights * stats.logprobs).sum() + c * stats.entropy.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = grads(lambda: completion_token_stats(model, batch, 0.7))
    got = grads(lambda: completion_token_stats_shared(model, batch, group_ids, 0.7, chunk_size=5))
    assert got.keys() == ref.keys()
    for n in ref:
        assert ref[n].abs().max() > 0, n   # every parameter is exercised
        assert_close(got[n], ref[n], n, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rows_that_share_no_prompt_run_in_one_pass_with_the_plain_numbers(
    name: str, micro_overrides, monkeypatch, layers
) -> None:
    # Each row its own group (SFT): one pass over whole rows, no prompt or completion pass.
    model = MODELS[name](micro_overrides)
    batch, _ = grouped_batch(model.config.vocab_size)
    singletons = torch.arange(batch.input_ids.shape[0])
    monkeypatch.setattr(shared_prefix, "_prompt_slots", lambda *a: pytest.fail("a prompt pass ran"))
    weights = (
        torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(1))
        / batch.completion_mask.sum()
    )

    def run(stats_fn):
        model.zero_grad(set_to_none=True)
        stats = stats_fn()
        ((weights * stats.logprobs).sum() + 0.1 * stats.entropy.sum() / batch.completion_mask.sum()).backward()
        return stats, {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, ref_grads = run(lambda: completion_token_stats(model, batch, 0.7))
    got, got_grads = run(lambda: completion_token_stats_shared(model, batch, singletons, 0.7, chunk_size=5))
    assert_close(got.logprobs, ref.logprobs, "logprobs")
    assert_close(got.entropy, ref.entropy, "entropy")
    for n in ref_grads:
        assert ref_grads[n].abs().max() > 0, n
        assert_close(got_grads[n], ref_grads[n], n, atol=1e-6, rtol=1e-4)


def test_split_and_reordered_groups_give_the_same_rows(micro_overrides, buckets, layers) -> None:
    # A micro-batch holds any rows of any groups in any order (`SequenceBatch.rows` also trims it):
    # each row's numbers depend on that row alone.
    model = MODELS["qwen2_gqa"](micro_overrides)
    batch, group_ids = grouped_batch(model.config.vocab_size)
    with torch.no_grad():
        full = completion_token_stats_shared(model, batch, group_ids)
        index = torch.tensor([10, 1, 4, 0, 8, 11, 5])   # groups 3, 0, 1, 0, 2, 3, 1
        part = batch.rows(index)
        sub = completion_token_stats_shared(model, part, group_ids[index])
    width = part.completion_ids.shape[1]
    assert_close(sub.logprobs, full.logprobs[index, :width], "logprobs")
    assert_close(sub.entropy, full.entropy[index, :width], "entropy")


def test_single_token_completions_need_no_completion_pass(micro_overrides) -> None:
    # Every token is then predicted by its prompt's last position, from the prompt pass alone.
    model = MODELS["qwen3"](micro_overrides)
    prompt_ids = [p for p in PROMPTS for _ in range(2)]
    completion_ids = torch.arange(3, 3 + len(prompt_ids))[:, None]
    batch = build_sequences(prompt_ids, completion_ids, torch.ones(len(prompt_ids), 1), PAD)
    with torch.no_grad():
        ref = completion_token_stats(model, batch)
        got = completion_token_stats_shared(model, batch, torch.arange(len(PROMPTS)).repeat_interleave(2))
    assert_close(got.logprobs, ref.logprobs, "logprobs")
    assert_close(got.entropy, ref.entropy, "entropy")


def test_the_shared_forward_takes_the_heads_own_weight_not_an_fp32_copy(micro_overrides) -> None:
    """The learner's layers take no logits from the decoder weights (the head runs apart, chunked): a bf16
    head is not copied to fp32 for them (545 MB for Qwen's), while the engine's weights keep the fp32 copy."""
    from reinforge.models.decoder import DecoderWeights

    model = qwen2(micro_overrides).to(torch.bfloat16)
    head = model.get_output_embeddings().weight
    _, weights = shared_prefix._native_decoder(model)
    assert weights.head is head
    engine = DecoderWeights.of(model)
    assert engine.head.dtype == torch.float32 and torch.equal(engine.head, head.float())


def test_the_longest_prompt_with_the_shortest_completion_shares_a_pass(micro_overrides, layers) -> None:
    # One pass runs every row to the longest need from its own start, so the latest start plus the
    # longest need (here 10 + 5, past any one row's start + need) must have a rotary position.
    model = MODELS["qwen2"](micro_overrides)
    prompt_ids = [list(range(5, 15)), list(range(5, 15)), [15], [16, 17]]
    lengths = torch.tensor([2, 1, 6, 6])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    completion_ids = torch.randint(3, model.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(0))
    batch = build_sequences(prompt_ids, completion_ids.masked_fill(mask == 0, PAD), mask, PAD)
    with torch.no_grad():
        ref = completion_token_stats(model, batch)
        got = completion_token_stats_shared(model, batch, torch.tensor([0, 0, 1, 2]))
    assert_close(got.logprobs, ref.logprobs, "logprobs")
    assert_close(got.entropy, ref.entropy, "entropy")


def test_rows_that_are_not_right_padded_are_refused(micro_overrides) -> None:
    # The passes take each row's valid keys as a prefix of its positions (attention_mask 1 then 0).
    model = MODELS["qwen2"](micro_overrides)
    batch, group_ids = grouped_batch(model.config.vocab_size)
    batch.attention_mask[2, 0] = 0
    with pytest.raises(ValueError, match="right-padded"):
        completion_token_stats_shared(model, batch, group_ids)


@pytest.mark.parametrize("other", [[5, 6, 8], [5, 6]], ids=["token", "length"])
def test_a_group_with_two_prompts_is_refused(other: list[int], micro_overrides) -> None:
    model = MODELS["qwen2"](micro_overrides)
    prompt_ids = [[5, 6, 7], [1, 2], [5, 6, 7], other]
    batch = build_sequences(prompt_ids, torch.full((4, 2), 9), torch.ones(4, 2), PAD)
    with pytest.raises(ValueError, match="row 3 has group id 0"):
        completion_token_stats_shared(model, batch, torch.tensor([0, 1, 0, 0]))


def test_an_unsupported_model_names_the_option() -> None:
    config = GPT2Config(vocab_size=len(TOKENIZER), n_embd=16, n_layer=1, n_head=2, n_positions=32)
    batch = build_sequences([[5, 6]], torch.full((1, 2), 9), torch.ones(1, 2), PAD)
    with pytest.raises(NotImplementedError, match="train.shared_prefix=false"):
        completion_token_stats_shared(GPT2LMHeadModel(config), batch, torch.tensor([0]))


def test_train_compile_does_nothing_on_a_cpu(micro_overrides, monkeypatch) -> None:
    """train.compile reaches the forward plan, and on a CPU the shared forward runs its usual layers: the
    same numbers, bit for bit, and nothing compiled (building the compiled layers would raise here)."""
    from dataclasses import replace

    from reinforge.learner import ForwardPlan, token_stats
    from reinforge.models import decoder

    plan = ForwardPlan.from_config(build_config([*micro_overrides, "train.compile=true"]).train)
    assert plan.compile and plan.shared_prefix

    def refuse(*args):
        raise AssertionError("compiled layers built on a CPU")

    monkeypatch.setattr(decoder, "layer_steps", refuse)
    model = MODELS["qwen2_gqa"](micro_overrides)
    batch, group_ids = grouped_batch(model.config.vocab_size)
    batch = replace(batch, group_ids=group_ids)
    got = token_stats(model, batch, 1.0, plan)
    ref = token_stats(model, batch, 1.0, ForwardPlan(shared_prefix=True, chunk_size=plan.chunk_size))
    assert torch.equal(got.logprobs, ref.logprobs) and torch.equal(got.entropy, ref.entropy)
    assert float(got.logprobs.abs().sum()) > 1.0
