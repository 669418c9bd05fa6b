"""The native rollout engine: the tokens transformers `generate` gives, the learner's log-probs,
every row exactly once under continuous batching, and exact sampling/filtering rules."""

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

from reinforge.errors import ConfigError
from reinforge.learner import build_sequences, completion_token_stats
from reinforge.models import Policy, build_tiny_qwen2
from reinforge.models.decoder import DecoderShape, check_native_model_type
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout import HFEngine, NativeEngine, SamplingParams
from reinforge.rollout.kv_cache import KVCache
from reinforge.rollout.sampling import _draw, filter_logits, keyed_uniforms, mix64
from reinforge.rollout.stopping import stop_string_end
from reinforge.settings import ModelConfig

PROMPTS = ["12+34=", "7+8=", "999+1=", "3 5 7>22:", "1+1="]


def eos_prone(policy: Policy, scale: float = 40.0) -> Policy:
    """Make <eos> likely in some contexts (tied embeddings: its output row grows), so completions
    end at different lengths and the engines' stopping and row-dropping paths are exercised."""
    with torch.no_grad():
        policy.model.get_output_embeddings().weight[policy.tokenizer.eos_token_id] *= scale
    return policy


def qwen2(**overrides) -> Policy:
    sizes = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128)
    cfg = ModelConfig(**{**sizes, **overrides})
    return eos_prone(build_tiny_qwen2(cfg, seed=0))


def from_config(model_cls, config_cls, **extra) -> Policy:
    tok = build_char_tokenizer()
    config = config_cls(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, tie_word_embeddings=True, **extra,
    )
    torch.manual_seed(0)
    return eos_prone(Policy(model=model_cls(config), tokenizer=tok))


MODELS = {
    "qwen2": lambda: qwen2(),
    "qwen2_gqa": lambda: qwen2(num_kv_heads=1),
    "llama": lambda: from_config(LlamaForCausalLM, LlamaConfig),
    "qwen3": lambda: from_config(Qwen3ForCausalLM, Qwen3Config, head_dim=16),
}


def _rows(rollout) -> list[tuple[list[int], bool]]:
    return [(rollout.completion_ids[r][rollout.completion_mask[r].bool()].tolist(), bool(rollout.truncated[r]))
            for r in range(rollout.num_rows)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_equal_transformers_generate(name: str) -> None:
    policy = MODELS[name]()
    params = SamplingParams(max_new_tokens=10, greedy=True)
    hf = HFEngine(policy).generate(PROMPTS, 1, params)
    native = NativeEngine(policy).generate(PROMPTS, 1, params)
    assert _rows(native) == _rows(hf)
    assert native.texts == hf.texts
    lengths = native.lengths.tolist()
    assert len(set(lengths)) > 1 and min(lengths) < 10    # rows really ended at different steps
    torch.testing.assert_close(native.sampler_logprobs, hf.sampler_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("name", ["qwen2", "qwen2_gqa", "llama"])
def test_sampler_logprobs_equal_learner_logprobs(name: str, temperature: float) -> None:
    policy = MODELS[name]()
    torch.manual_seed(0)
    rollout = NativeEngine(policy).generate(PROMPTS, 4, SamplingParams(temperature=temperature, max_new_tokens=8))
    seq = build_sequences(
        rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, policy.tokenizer.pad_token_id
    )
    with torch.no_grad():
        learner = completion_token_stats(policy.model, seq, temperature).logprobs
    assert rollout.completion_mask.sum() > 40
    assert rollout.logprobs_exact     # what the engine claims, and train.old_logprobs=auto relies on
    torch.testing.assert_close(learner, rollout.sampler_logprobs, atol=1e-4, rtol=0)
    for row, text in enumerate(rollout.texts):
        kept = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        assert policy.tokenizer.decode(kept, skip_special_tokens=True) == text
        # A truncated row ran to the limit without <eos>; an ended row ends on <eos>.
        assert bool(rollout.truncated[row]) == (kept[-1] != policy.tokenizer.eos_token_id)
        assert not rollout.truncated[row] or len(kept) == 8


def test_logprobs_are_called_exact_only_where_they_are_of_the_learners_distribution() -> None:
    """train.old_logprobs=auto takes pi_old from the sampler only where `logprobs_exact`: a filtered or greedy
    draw's log-probs are of another distribution than the learner's tempered softmax, int8 weights and bf16
    arithmetic move them off it by far more than float rounding."""
    policy = qwen2()
    assert NativeEngine(policy).generate(PROMPTS[:2], 2, SamplingParams(temperature=0.7)).logprobs_exact
    for params in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.05),
                   SamplingParams(greedy=True)):
        rollout = NativeEngine(policy).generate(PROMPTS[:2], 2, params)
        assert not rollout.logprobs_exact, params
    params = SamplingParams(max_new_tokens=6)
    int8 = NativeEngine(policy, quantization="int8").generate(PROMPTS, 2, params)
    assert not int8.logprobs_exact
    seq = build_sequences(int8.prompt_ids, int8.completion_ids, int8.completion_mask, policy.tokenizer.pad_token_id)
    with torch.no_grad():
        learner = completion_token_stats(policy.model, seq, 1.0).logprobs
    assert float((learner - int8.sampler_logprobs).abs().max()) > 1e-3    # not rounding: the flag is needed
    assert not NativeEngine(qwen2(dtype="bfloat16")).generate(PROMPTS[:2], 2, params).logprobs_exact


def test_continuous_batching_returns_every_sample_once() -> None:
    policy = qwen2()
    params = SamplingParams(max_new_tokens=9, greedy=True)
    whole = NativeEngine(policy).generate(PROMPTS, 3, params)
    for slots in (1, 2, 4, 7):
        # Fewer slots than rows: finished rows' slots are refilled with waiting rows.
        part = NativeEngine(policy, max_batch_rows=slots).generate(PROMPTS, 3, params)
        assert _rows(part) == _rows(whole)
        assert part.group_ids.tolist() == [p for p in range(len(PROMPTS)) for _ in range(3)]
        torch.testing.assert_close(part.sampler_logprobs, whole.sampler_logprobs, atol=1e-5, rtol=0)
    # Under sampling each row is its own draw, decoded against its own prompt: its sampler
    # log-probs are the learner's for that prompt and completion.
    torch.manual_seed(3)
    sampled = NativeEngine(policy, max_batch_rows=4).generate(PROMPTS, 6, SamplingParams(max_new_tokens=9))
    seq = build_sequences(
        sampled.prompt_ids, sampled.completion_ids, sampled.completion_mask, policy.tokenizer.pad_token_id
    )
    with torch.no_grad():
        learner = completion_token_stats(policy.model, seq).logprobs
    torch.testing.assert_close(learner, sampled.sampler_logprobs, atol=1e-4, rtol=0)
    assert len(set(sampled.lengths.tolist())) > 2


def test_a_reused_cache_gives_the_numbers_of_a_fresh_one() -> None:
    # The engine keeps its cache's memory between calls on CPU; stale keys/values of an earlier,
    # larger call sit in the masked positions of the next and must change nothing.
    policy = qwen2(max_positions=160)
    engine = NativeEngine(policy)
    engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=100))       # grows the cache
    for prompts, group in ((PROMPTS[1:3], 2), (PROMPTS, 5)):                # fewer rows, then more
        params = SamplingParams(max_new_tokens=12)
        torch.manual_seed(5)
        reused = engine.generate(prompts, group, params)
        torch.manual_seed(5)
        fresh = NativeEngine(policy).generate(prompts, group, params)
        assert _rows(reused) == _rows(fresh)
        torch.testing.assert_close(reused.sampler_logprobs, fresh.sampler_logprobs, atol=0, rtol=0)


def test_engine_sees_weight_updates_without_sync() -> None:
    policy = qwen2()
    engine, params = NativeEngine(policy), SamplingParams(max_new_tokens=8, greedy=True)
    before = engine.generate(PROMPTS, 1, params)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    after = engine.generate(PROMPTS, 1, params)
    assert _rows(after) == _rows(HFEngine(policy).generate(PROMPTS, 1, params))
    assert _rows(after) != _rows(before)


def test_stop_strings_end_completions_as_in_transformers() -> None:
    policy = qwen2()
    params = SamplingParams(max_new_tokens=10, greedy=True, stop=("7", "=="))
    native = NativeEngine(policy).generate(PROMPTS, 1, params)
    hf = HFEngine(policy).generate(PROMPTS, 1, params)
    assert _rows(native) == _rows(hf)
    ended_by_string = 0
    for (ids, truncated), text in zip(_rows(native), native.texts, strict=True):
        if not truncated and ids[-1] != policy.tokenizer.eos_token_id:
            assert text.endswith("7") or text.endswith("==")
            assert "7" not in text[:-1] and "==" not in text[:-1]
            ended_by_string += 1
    assert ended_by_string >= 1


def test_stop_string_end_is_the_shortest_prefix() -> None:
    tok = build_char_tokenizer()
    ids = tok("12+345=9", add_special_tokens=False)["input_ids"]
    assert stop_string_end(tok, ids, ("34",)) == 5
    assert stop_string_end(tok, ids, ("=", "+")) == 3
    assert stop_string_end(tok, ids, ("x",)) is None


def test_filter_logits_top_k_and_top_p() -> None:
    scores = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    inf = float("-inf")
    assert filter_logits(scores, 2, 1.0).isinf().tolist() == [[True, False, False, True]]
    # Top-p 0.6: 0.4 (mass before 0) and 0.3 (mass before 0.4 < 0.6) stay; 0.2 has 0.7 before it.
    assert filter_logits(scores, 0, 0.6).isinf().tolist() == [[True, False, False, True]]
    # Exactly reaching p: 0.4 + 0.3 = 0.7, so p = 0.7 keeps two tokens, p = 0.71 three.
    assert int((filter_logits(scores, 0, 0.71) == inf).sum()) == 1
    assert filter_logits(scores, 0, 0.05).isinf().tolist() == [[True, False, True, True]]   # the top token stays
    assert filter_logits(scores, 3, 0.5).isinf().tolist() == [[True, False, False, True]]


def test_draw_follows_the_distribution() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.2, 0.7, 0.0]]).expand(40000, 4)
    counts = torch.bincount(_draw(probs), minlength=4).float() / 40000
    assert counts[3] == 0
    torch.testing.assert_close(counts, torch.tensor([0.1, 0.2, 0.7, 0.0]), atol=0.01, rtol=0)


def test_mix64_is_splitmix64s_finaliser() -> None:
    def reference(x: int) -> int:   # splitmix64 in plain Python integers, mod 2^64
        m = 2**64
        z = x % m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
        return z ^ (z >> 31)

    xs = [0, 1, 12345, 2**62 - 1, 2**63 - 1, -1, -(2**63)]
    assert [int(v) % 2**64 for v in mix64(torch.tensor(xs))] == [reference(x) for x in xs]


def test_keyed_uniforms_are_uniform_and_independent_of_their_neighbours() -> None:
    keys = torch.randint(2**62, (64,), generator=torch.Generator().manual_seed(0))
    u = keyed_uniforms(keys.repeat_interleave(4000), torch.arange(4000).repeat(64))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    counts = torch.histc(u, 16, 0, 1)
    chi2 = float(((counts - len(u) / 16) ** 2 / (len(u) / 16)).sum())
    assert chi2 < 37.7          # chi-square, 15 degrees of freedom: p = 0.001
    # Successive draws of one stream are uncorrelated; a draw depends on its key and counter alone.
    pairs = u.view(64, 4000)
    assert abs(float(torch.corrcoef(torch.stack([pairs[:, :-1].flatten(), pairs[:, 1:].flatten()]))[0, 1])) < 0.01
    assert torch.equal(keyed_uniforms(keys[5:6], torch.tensor([7])), u.view(64, 4000)[5, 7:8])


def test_a_prompts_samples_do_not_depend_on_the_rest_of_the_batch() -> None:
    # Each prompt's samples draw from its own key: alone, in a batch of five, or decoded 3 rows at a
    # time (continuous batching moves rows between slots), it gets the same tokens.
    policy = qwen2()
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    keys = torch.tensor([11, 22, 33, 44, 55])
    full = NativeEngine(policy).generate(PROMPTS, 3, params, group_keys=keys)
    squeezed = NativeEngine(policy, max_batch_rows=3).generate(PROMPTS, 3, params, group_keys=keys)
    alone = NativeEngine(policy).generate(PROMPTS[2:3], 3, params, group_keys=keys[2:3])
    assert full.lengths.float().std() > 0            # rows end at different lengths
    assert torch.equal(full.completion_ids, squeezed.completion_ids)
    assert torch.equal(full.completion_ids[6:9, : alone.completion_ids.shape[1]], alone.completion_ids)
    torch.testing.assert_close(full.sampler_logprobs[6:9, : alone.completion_ids.shape[1]], alone.sampler_logprobs,
                               atol=1e-5, rtol=0)
    other = NativeEngine(policy).generate(PROMPTS, 3, params, group_keys=keys + 1)
    assert not torch.equal(full.completion_ids, other.completion_ids)


def test_unsupported_models_are_refused_with_the_way_out(tmp_path) -> None:
    tok = build_char_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=32))
    with pytest.raises(NotImplementedError, match="rollout.engine=hf"):
        NativeEngine(Policy(model=gpt2, tokenizer=tok))
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="rollout.engine=hf"):
        check_native_model_type(tmp_path)


@pytest.mark.parametrize("keys_last", [True, False])
def test_cache_write_puts_each_slots_key_and_value_at_its_position(keys_last: bool) -> None:
    shape = DecoderShape(num_heads=4, num_kv_heads=2, head_dim=64, sliding_window=None)
    cache = KVCache(num_layers=2, slots=5, shape=shape, initial=6, limit=8, dtype=torch.float32, device="cpu",
                    keys_last=keys_last)
    positions = torch.tensor([3, 0, 5])              # slots 0..2 are live
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    cache.write(1, k, v, torch.arange(3), positions)
    expected_k, expected_v = torch.zeros(5, 2, 8, 64), torch.zeros(5, 2, 8, 64)
    expected_k[torch.arange(3), :, positions] = k
    expected_v[torch.arange(3), :, positions] = v
    assert torch.equal(cache.keys(1), expected_k) and torch.equal(cache.v[1], expected_v)
    assert cache.keys(0).abs().sum() == 0 and cache.v[0].abs().sum() == 0   # other layers untouched


def test_cache_holds_enough_keys_for_blas_attention() -> None:
    # ATen's CPU bmm takes a slow loop below D x group x keys = 400: D 16, one query head per
    # key/value head -> 25 keys, rounded up to 32; D 64 with groups of 2 -> 4, rounded up to 8.
    small = KVCache(1, 2, DecoderShape(8, 8, 16, None), initial=10, limit=24, dtype=torch.float32, device="cpu")
    assert small.capacity == 32 and small.limit == 32
    grouped = KVCache(1, 2, DecoderShape(4, 2, 64, None), initial=3, limit=100, dtype=torch.float32, device="cpu")
    assert grouped.capacity == 8


@pytest.mark.parametrize("keys_last", [True, False])
def test_cache_growth_keeps_entries_and_long_rows_match_generate(keys_last: bool) -> None:
    shape = DecoderShape(num_heads=2, num_kv_heads=1, head_dim=64, sliding_window=None)
    cache = KVCache(num_layers=1, slots=2, shape=shape, initial=8, limit=20, dtype=torch.float32, device="cpu",
                    keys_last=keys_last)
    cache.keys(0).normal_()
    cache.v[0].normal_()
    before_k, before_v = cache.keys(0).clone(), cache.v[0].clone()
    cache.reserve(9)                                   # doubles to 16
    assert cache.capacity == 16
    for grown, before in ((cache.keys(0), before_k), (cache.v[0], before_v)):
        assert grown.shape == (2, 1, 16, 64)
        assert torch.equal(grown[:, :, :8], before) and grown[:, :, 8:].abs().sum() == 0
    cache.reserve(30)                                  # never past the limit
    assert cache.capacity == 20
    # Rows longer than the first allocation (prompt + 64 positions): the cache grows mid-decode.
    policy = qwen2(max_positions=160)
    params = SamplingParams(max_new_tokens=90, greedy=True)
    with torch.no_grad():   # undo eos_prone's boost so rows run long
        policy.model.get_output_embeddings().weight[policy.tokenizer.eos_token_id] /= 40.0
    native = NativeEngine(policy).generate(PROMPTS[:2], 1, params)
    assert int(native.lengths.max()) > 70
    assert _rows(native) == _rows(HFEngine(policy).generate(PROMPTS[:2], 1, params))


GRAPH_PARAMS = [
    pytest.param(SamplingParams(temperature=1.0, max_new_tokens=14), id="plain"),
    pytest.param(SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.01, max_new_tokens=14), id="filtered"),
    pytest.param(SamplingParams(greedy=True, max_new_tokens=14, record_top_k=3), id="greedy_top"),
]


@pytest.mark.parametrize("params", GRAPH_PARAMS)
def test_bucketed_graph_step_gives_the_eager_steps_rows(params: SamplingParams) -> None:
    """The decode graphs' step (rollout/graphs.py), run eagerly on its static buffers: rows padded to a
    power of two, sampling inside the step. Rows end at different steps (eos_prone), so the batch shrinks
    through several buckets; every row's tokens, stop flag, log-probs and top-K are the eager engine's."""
    from reinforge.rollout import graphs

    policy = qwen2(num_kv_heads=2)
    eager = NativeEngine(policy, cpu_kernels=False)
    bucketed = NativeEngine(policy, cpu_kernels=False)
    bucketed.graph_mode = "eager"
    buckets = []
    real_step = graphs.DecodeGraphs.step

    def step(self, tokens, *args):
        buckets.append((len(tokens), graphs.bucket_of(len(tokens), len(self.cache.v[0]))))
        return real_step(self, tokens, *args)

    keys = torch.tensor([5, 6, 7, 8, 9])
    a = eager.generate(PROMPTS, 3, params, group_keys=keys)
    graphs.DecodeGraphs.step = step
    try:
        b = bucketed.generate(PROMPTS, 3, params, group_keys=keys)
    finally:
        graphs.DecodeGraphs.step = real_step
    assert bucketed.graph_mode == "eager"                  # no failure turned the graphs off
    if not params.greedy:   # (greedy: a prompt's 3 samples are one row 3 times, ending together)
        assert {rows for _, rows in buckets} >= {15, 8, 4}     # 15 slots: all of them, then powers of two
        assert any(live < rows for live, rows in buckets)
    assert _rows(a) == _rows(b)
    torch.testing.assert_close(b.sampler_logprobs, a.sampler_logprobs, atol=1e-5, rtol=0)
    if params.record_top_k:
        assert torch.equal(b.sampler_top_ids, a.sampler_top_ids)
        torch.testing.assert_close(b.sampler_top_logprobs, a.sampler_top_logprobs, atol=1e-5, rtol=0)


def test_a_failing_graph_step_falls_back_to_the_eager_step_with_a_logged_reason(caplog) -> None:
    from reinforge.rollout import graphs

    policy = qwen2()
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    keys = torch.tensor([1, 2, 3, 4, 5])
    eager = NativeEngine(policy, cpu_kernels=False).generate(PROMPTS, 2, params, group_keys=keys)
    engine = NativeEngine(policy, cpu_kernels=False)
    engine.graph_mode = "eager"
    real_body = graphs.step_body
    calls = []

    def broken(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real_body(*args)

    graphs.step_body = broken
    try:
        with caplog.at_level("WARNING", logger="reinforge.rollout.native"):
            out = engine.generate(PROMPTS, 2, params, group_keys=keys)
    finally:
        graphs.step_body = real_body
    assert engine.graph_mode is None
    assert len(calls) == 3                                  # off for good after the failure
    assert "CUDA graphs of the decode step are off, decoding eagerly: RuntimeError: operation not permitted" in (
        caplog.text)
    assert _rows(out) == _rows(eager)
    torch.testing.assert_close(out.sampler_logprobs, eager.sampler_logprobs, atol=1e-5, rtol=0)


def test_graph_buckets_are_powers_of_two_up_to_the_slots() -> None:
    from reinforge.rollout.graphs import bucket_of

    assert [bucket_of(n, 256) for n in (1, 2, 3, 5, 8, 9, 100, 129, 256)] == [1, 2, 4, 8, 8, 16, 128, 256, 256]
    assert [bucket_of(n, 12) for n in (1, 5, 9, 12)] == [1, 8, 12, 12]


def test_the_capture_path_with_an_emulated_graph_gives_the_eager_rows(monkeypatch) -> None:
    """The CUDA-graph path's plumbing (capture after CAPTURE_AFTER asks, the check against the eager step,
    replays, buckets shrinking with the rows) on the CPU, with torch.cuda's graph emulated: a capture
    records the step, a replay runs it again on the static buffers (what a CUDA graph does)."""
    import contextlib

    from reinforge.rollout import graphs

    class Stream:
        def wait_stream(self, other) -> None:
            pass

    class Graph:
        def replay(self) -> None:
            self.run()

        def pool(self):
            return id(self)

    captured: list[int] = []

    def capture_here(self, bucket) -> None:
        @contextlib.contextmanager
        def graph_context(graph, pool=None, capture_error_mode="global"):
            assert capture_error_mode == "thread_local"
            yield

            def run() -> None:
                for out, new in zip(bucket.out, self._body(bucket), strict=True):
                    out.copy_(new)
            graph.run = run
        monkeypatch.setattr(torch.cuda, "graph", graph_context)
        captured.append(bucket.rows)
        real_capture_here(self, bucket)

    real_capture_here = graphs.DecodeGraphs._capture_here
    monkeypatch.setattr(graphs.DecodeGraphs, "_capture_here", capture_here)
    monkeypatch.setattr(graphs, "CAPTURE_AFTER", 2)
    for name, value in (("CUDAGraph", Graph), ("Stream", Stream), ("current_stream", Stream),
                        ("stream", lambda s: contextlib.nullcontext()), ("device", lambda d: contextlib.nullcontext())):
        monkeypatch.setattr(torch.cuda, name, value)
    policy = qwen2(num_kv_heads=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=14)
    keys = torch.tensor([5, 6, 7, 8, 9])
    eager = NativeEngine(policy, cpu_kernels=False).generate(PROMPTS, 3, params, group_keys=keys)
    engine = NativeEngine(policy, cpu_kernels=False)
    engine.graph_mode = "capture"
    graphed = engine.generate(PROMPTS, 3, params, group_keys=keys)
    assert engine.graph_mode == "capture"
    assert captured[0] == 15 and len(captured) >= 3
    assert _rows(graphed) == _rows(eager)
    torch.testing.assert_close(graphed.sampler_logprobs, eager.sampler_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_batch_rows", [None, 6])
def test_decoding_ahead_of_the_stop_flags_gives_the_same_rows(max_batch_rows, monkeypatch) -> None:
    """With decode graphs a step decodes before it reads the previous step's stop flags
    (`DecodeSession._step_ahead`: no host wait for the step just launched): a row that ended is decoded
    once more and retired a step late, the live rows packed with their flags, waiting rows admitted
    into freed slots (6 slots for 15 rows). Every row's tokens, stop flag and log-probs are the
    synchronous engine's, and most steps ran ahead, retiring rows on some of them."""
    from reinforge.rollout import session as session_module

    policy = qwen2(num_kv_heads=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=14)
    keys = torch.tensor([5, 6, 7, 8, 9])
    eager = NativeEngine(policy, cpu_kernels=False, max_batch_rows=max_batch_rows)
    ahead = NativeEngine(policy, cpu_kernels=False, max_batch_rows=max_batch_rows)
    ahead.graph_mode = "eager"
    steps: list[int] = []
    real = session_module.DecodeSession._step_ahead

    def counted(self, flags):
        finished = real(self, flags)
        steps.append(len(finished))
        return finished

    monkeypatch.setattr(session_module.DecodeSession, "_step_ahead", counted)
    a = eager.generate(PROMPTS, 3, params, group_keys=keys)
    b = ahead.generate(PROMPTS, 3, params, group_keys=keys)
    assert ahead.graph_mode == "eager"
    assert a.lengths.float().std() > 0 and bool(a.truncated.any()) and not bool(a.truncated.all())
    assert _rows(a) == _rows(b)
    torch.testing.assert_close(b.sampler_logprobs, a.sampler_logprobs, atol=1e-5, rtol=0)
    assert len(steps) >= 8 and sum(1 for n in steps if n) >= 2
