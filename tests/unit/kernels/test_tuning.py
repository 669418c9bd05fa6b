"""The kernels' row block and the learner's products (packed or ATen's), chosen per machine by timing
(reinforge/kernels/tuning.py): every row block gives the same products bit for bit, and so the same
rollout, and both backends the same products to float rounding; the choice is timed once, cached next to
the library, read back, and can be forced; the rollout engine keeps the packed products."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from unit.kernels.test_cpu_kernels import kernels  # noqa: F401  (fixture)
from unit.rollout.test_native_engine import MODELS, PROMPTS

from reinforge.kernels import tuning
from reinforge.rollout import NativeEngine, SamplingParams


# (33, 300, 70): a wide product (K > 256, tuning.WIDE_K), whose panels are fetched a share per block of rows
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (13, 40, 70), (64, 128, 384), (131, 96, 33), (33, 300, 70)])
def test_every_row_block_gives_the_same_product_bit_for_bit(kernels, m: int, k: int, n: int) -> None:  # noqa: F811
    gen = torch.Generator().manual_seed(m + k + n)
    a, w, bias = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    packed = kernels.pack_weight(w)
    products = {r: kernels.packed_matmul(a, packed, bias, n, r) for r in tuning.ROW_BLOCKS}
    for r, c in products.items():
        assert torch.equal(c, products[tuning.DEFAULT_ROW_BLOCK]), f"row block {r}"
    # and it is the product itself (float rounding apart)
    torch.testing.assert_close(products[6], torch.addmm(bias, a, w.T), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("m,k,n,transposed", [(1, 7, 5, False), (13, 40, 70, True), (64, 128, 384, False),
                                               (131, 96, 33, True), (960, 128, 1024, True)])
def test_plain_products_through_aten_equal_the_packed_ones(kernels, m: int, k: int, n: int,  # noqa: F811
                                                           transposed: bool) -> None:
    gen = torch.Generator().manual_seed(m + k + n)
    a, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    # the forward's products take w [n, k] (a w^T); the backward's take w [k, n] (a w), plain as the view w^T
    w = torch.randn(k, n, generator=gen) if transposed else torch.randn(n, k, generator=gen)
    exact = torch.addmm(bias.double(), a.double(), (w if transposed else w.T).double()).float()
    packed = kernels.packed_matmul(a, kernels.pack_weight(w, transposed), bias, n, 0)
    plain = kernels.packed_matmul(a, w.T if transposed else w, bias, n, 0)
    torch.testing.assert_close(packed, exact, atol=2e-5 * k ** 0.5, rtol=1e-5)
    torch.testing.assert_close(plain, exact, atol=2e-5 * k ** 0.5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="plain weight must be a float32"):
        kernels.packed_matmul(a, w if transposed else w.T, bias, n, 0)       # the other orientation


def test_the_rollout_is_the_same_under_every_row_block(kernels) -> None:  # noqa: F811
    policy = MODELS["qwen2"]()
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    chosen, chosen_wide = kernels.row_block(), kernels.row_block(True)
    try:
        runs = {}
        for r in (2, 6, 12):
            kernels.set_row_block(r)
            kernels.set_row_block(r, True)
            runs[r] = NativeEngine(policy, cpu_kernels=True).generate(PROMPTS, 3, params,
                                                                       generator=torch.Generator().manual_seed(3))
    finally:
        kernels.set_row_block(chosen)
        kernels.set_row_block(chosen_wide, True)
    for r in (2, 12):
        assert torch.equal(runs[r].completion_ids, runs[6].completion_ids)
        assert torch.equal(runs[r].sampler_logprobs, runs[6].sampler_logprobs)


class FakeOps:
    """Records the row blocks it is given (the timings are set by the test, without a timer's noise)."""

    row = row_wide = None

    def set_row_block(self, rows, wide=False):
        if wide:
            self.row_wide = rows
        else:
            self.row = rows


def products_timings(aten_faster: float = 0.0) -> dict[str, dict[str, list[float]]]:
    """Seconds per use, backend and shape: packed 1.5 ms per shape, ATen `aten_faster` (a fraction) less."""
    return {use: {"packed": [1.5e-3] * 2, "aten": [1.5e-3 * (1 - aten_faster)] * 2} for use in tuning.USES}


def timings(fastest: int | None, ms: float = 3.0) -> dict[int, float]:
    """Seconds per candidate: all `ms`, `fastest` 10% faster (None: all equal)."""
    return {r: (0.9 if r == fastest else 1.0) * ms / 1e3 for r in tuning.ROW_BLOCKS}


def test_the_choice_is_timed_once_then_read_back(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.delenv(tuning.PRODUCTS_ENV, raising=False)
    calls = []
    narrow_or_wide = {tuning.SHAPES: 8, tuning.WIDE_SHAPES: 12}        # the fastest row block of each
    monkeypatch.setattr(tuning, "time_row_blocks",
                        lambda ops, shapes=tuning.SHAPES: calls.append(1) or timings(narrow_or_wide[shapes]))
    monkeypatch.setattr(tuning, "time_products", lambda ops: calls.append(2) or products_timings(0.3))
    library = tmp_path / "reinforge_kernels-abc.so"
    ops = FakeOps()
    with caplog.at_level(logging.INFO, logger="reinforge.kernels.tuning"):
        first = tuning.choose(ops, library)
    assert first["row_block"] == 8 and first["source"] == "timed" and ops.row == 8
    assert first["row_block_wide"] == 12 and ops.row_wide == 12       # wide products timed apart
    assert first["products"] == {"learner": "aten"}
    assert sum("row block 8" in r.getMessage() and "12 of wide" in r.getMessage() for r in caplog.records) == 1
    cached = json.loads((tmp_path / "reinforge_kernels-abc.tuning.json").read_text())
    assert cached["row_block"] == 8 and cached["ms"]["8"] == 2.7 and cached["ms"]["6"] == 3.0
    assert cached["row_block_wide"] == 12 and cached["ms_wide"]["12"] == 2.7
    assert cached["products"] == first["products"] and cached["products_ms"]["learner"] == {"packed": 3.0, "aten": 2.1}
    assert cached["aten_over_packed"] == {"learner": 0.7}

    caplog.clear()
    ops = FakeOps()
    with caplog.at_level(logging.INFO, logger="reinforge.kernels.tuning"):
        again = tuning.choose(ops, library)
    assert again["row_block"] == 8 and again["source"] == "cached" and ops.row == 8 and ops.row_wide == 12
    assert again["products"] == {"learner": "aten"}
    assert calls == [1, 1, 2] and not caplog.records


@pytest.mark.parametrize("old", [{"row_block": 4, "ms": {}},                        # before the products' choice
                                 {"row_block": 4, "ms": {}, "products": {"learner": "aten"}}])   # before wide
def test_a_cache_from_before_a_choice_is_timed_again(tmp_path, monkeypatch, old: dict) -> None:
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.delenv(tuning.PRODUCTS_ENV, raising=False)
    (tmp_path / "k.tuning.json").write_text(json.dumps(old))
    monkeypatch.setattr(tuning, "time_row_blocks", lambda ops, shapes=tuning.SHAPES: timings(None))
    monkeypatch.setattr(tuning, "time_products", lambda ops: products_timings(0.02))   # 2%: noise
    got = tuning.choose(FakeOps(), tmp_path / "k.so")
    assert got["source"] == "timed" and got["row_block"] == 6 and got["row_block_wide"] == 6
    assert got["products"] == {"learner": "packed"}


@pytest.mark.parametrize("faster,chosen", [(None, 6), (12, 12)])
def test_the_default_stays_unless_another_is_clearly_faster(tmp_path, monkeypatch, faster, chosen) -> None:
    monkeypatch.delenv(tuning.ENV, raising=False)
    seconds = timings(faster)
    seconds[4] *= 0.99                          # 1% faster than the default: noise, not a reason to change
    monkeypatch.setattr(tuning, "time_row_blocks", lambda ops, shapes=tuning.SHAPES: seconds)
    monkeypatch.setattr(tuning, "time_products", lambda ops: products_timings())
    got = tuning.choose(FakeOps(), tmp_path / "k.so")
    assert got["row_block"] == chosen and got["row_block_wide"] == chosen


def test_timing_takes_turns_and_keeps_each_candidates_fastest_pass(kernels, monkeypatch) -> None:  # noqa: F811
    seconds = tuning.time_row_blocks(kernels, shapes=((8, 16, 32),), rounds=2)
    assert set(seconds) == set(tuning.ROW_BLOCKS) and all(0 < s < 1 for s in seconds.values())
    uses = {"a": ((8, 16, 32, False),), "b": ((9, 16, 33, True), (4, 8, 8, False))}
    per_use = tuning.time_products(kernels, uses=uses, rounds=2)
    assert set(per_use) == {"a", "b"} and all(set(s) == set(tuning.BACKENDS) for s in per_use.values())
    assert [len(per_use[u]["aten"]) for u in "ab"] == [1, 2]
    assert all(0 < t < 1 for s in per_use.values() for times in s.values() for t in times)


def test_each_shape_counts_alike_in_the_products_choice() -> None:
    # ATen 4x slower on a small shape, 2x faster on one 100x larger: a total of times would pick ATen (5.4 against
    # 10.1 ms), the geometric mean of the ratios, sqrt(4 x 0.5), keeps the packed products; 2x slower: even
    assert tuning.aten_over_packed({"packed": [1e-4, 1e-2], "aten": [4e-4, 5e-3]}) == pytest.approx(2 ** 0.5)
    assert tuning.aten_over_packed({"packed": [1e-4, 1e-2], "aten": [2e-4, 5e-3]}) == pytest.approx(1.0)


def test_the_environment_forces_a_row_block_and_refuses_others(tmp_path, monkeypatch) -> None:
    ops = FakeOps()
    monkeypatch.delenv(tuning.PRODUCTS_ENV, raising=False)
    monkeypatch.setenv(tuning.ENV, "3")
    assert tuning.choose(ops, tmp_path / "k.so") == {"row_block": 3, "row_block_wide": 3, "source": tuning.ENV,
                                                     "products": {"learner": "packed"}}
    assert ops.row == 3 and ops.row_wide == 3 and not (tmp_path / "k.tuning.json").exists()
    monkeypatch.setenv(tuning.PRODUCTS_ENV, "aten")
    assert tuning.choose(ops, tmp_path / "k.so")["products"] == {"learner": "aten"}
    monkeypatch.setenv(tuning.PRODUCTS_ENV, "mkl")
    with pytest.raises(ValueError, match="one of packed, aten"):
        tuning.choose(ops, tmp_path / "k.so")
    monkeypatch.setenv(tuning.ENV, "7")
    with pytest.raises(ValueError, match="one of 2, 3, 4, 6, 8, 10, 12"):
        tuning.choose(ops, tmp_path / "k.so")


def test_a_cache_that_cannot_be_written_keeps_the_choice_for_the_process(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.delenv(tuning.ENV, raising=False)
    monkeypatch.setattr(tuning, "time_row_blocks", lambda ops, shapes=tuning.SHAPES: timings(4))
    monkeypatch.setattr(tuning, "time_products", lambda ops: products_timings())
    ops = FakeOps()
    with caplog.at_level(logging.WARNING, logger="reinforge.kernels.tuning"):
        got = tuning.choose(ops, tmp_path / "missing-folder" / "k.so")
    assert got["row_block"] == 4 and got["source"] == "timed" and ops.row == 4
    assert any("could not cache" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("products", ["packed", "aten"])
def test_decoder_weights_give_each_projection_both_ways(kernels, monkeypatch, products: str) -> None:  # noqa: F811
    from reinforge.kernels import TUNING
    from reinforge.models.decoder import DecoderWeights

    monkeypatch.setitem(TUNING, "products", {"learner": products})
    model = MODELS["qwen2"]().model
    w = DecoderWeights.of(model)
    forward, backward = w.packed(kernels), w.packed(kernels, transposed=True)
    engine = w.packed(kernels, use="engine")
    gen = torch.Generator().manual_seed(0)
    for layer, fwd, bwd, eng in zip(w.layers, forward, backward, engine, strict=True):
        for n in ("qkv", "o", "gate_up", "down"):      # o and down: the model's own tensors; qkv, gate_up: fused
            weight = getattr(layer, n).detach()
            a, d = torch.randn(5, weight.shape[1], generator=gen), torch.randn(5, weight.shape[0], generator=gen)
            rows, cols = weight.shape
            for got, want in ((kernels.packed_matmul(a, getattr(fwd, n), None, rows, 0), a @ weight.T),
                              (kernels.packed_matmul(d, getattr(bwd, n), None, cols, 0), d @ weight),
                              (kernels.packed_matmul(a, getattr(eng, n), None, rows, 0), a @ weight.T)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            if products == "aten":      # no copy: the weight itself, and its transposed view
                assert getattr(fwd, n).data_ptr() == getattr(bwd, n).data_ptr() == weight.data_ptr()
            else:
                assert getattr(fwd, n).dim() == 3 and getattr(bwd, n).dim() == 3
            assert getattr(eng, n).dim() == 3          # the engine's products stay packed: batch-invariant sums
    assert w.packed(kernels) is forward                 # made once per DecoderWeights
