"""Sampler-learner corrections and mismatch metrics: hand-derived values."""

import math

import pytest
import torch

from reinforge.objectives.aggregation import masked_mean
from reinforge.objectives.corrections import (
    CORRECTIONS,
    apply_correction,
    mis,
    mis_sequence,
    mismatch_metrics,
    tis,
    tis_sequence,
)

F64 = torch.float64


def _tensor(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def _from_ratios(rows, dtype=F64):
    """(old_logprobs, sampler_logprobs) with rho = exp(old - mu) = rows; mu = -1 everywhere."""
    sampler_logprobs = torch.full((len(rows), len(rows[0])), -1.0, dtype=dtype)
    return sampler_logprobs + torch.log(_tensor(rows, dtype)), sampler_logprobs


# ---------------------------------------------------------------- tis

def test_tis_caps_each_token_ratio():
    # rho = [0.5, 1, 1.5, 3, 10], the last token padded; w = min(rho, 2) = [0.5, 1, 1.5, 2, 0]:
    # only 3 is capped (10 is padding, weight and flag 0).
    old_logprobs, sampler_logprobs = _from_ratios([[0.5, 1.0, 1.5, 3.0, 10.0]])
    mask = _tensor([[1, 1, 1, 1, 0]])
    out = tis(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    torch.testing.assert_close(out.weights, _tensor([[0.5, 1.0, 1.5, 2.0, 0.0]]))
    torch.testing.assert_close(out.metrics["is_weight"], out.weights)
    torch.testing.assert_close(out.metrics["is_clipped"], _tensor([[0, 0, 0, 1, 0]]))
    # the caller's mean over valid tokens: clipped fraction 1/4, mean weight (0.5+1+1.5+2)/4 = 1.25
    assert masked_mean(out.metrics["is_clipped"], mask).item() == pytest.approx(0.25)
    assert masked_mean(out.metrics["is_weight"], mask).item() == pytest.approx(1.25)


def test_tis_cap_parameter():
    # cap 4: rho 3 passes (w = 3), rho 10 is capped to 4.
    old_logprobs, sampler_logprobs = _from_ratios([[3.0, 10.0]])
    out = tis(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs,
              mask=torch.ones(1, 2, dtype=F64), cap=4.0)
    torch.testing.assert_close(out.weights, _tensor([[3.0, 4.0]]))
    torch.testing.assert_close(out.metrics["is_clipped"], _tensor([[0, 1]]))


# ---------------------------------------------------------------- tis_sequence

def test_tis_sequence_product_capped_and_broadcast():
    # row 0: 0.5 * 1.5 * 2 = 1.5 (< 2), at each of its 3 tokens.
    # row 1: 3 * 2 * 1 = 6 -> capped at 2, flagged clipped.
    # row 2: 0.5 * 1.5 (* 100 at a padded position, ignored) = 0.75; padding weight 0.
    old_logprobs, sampler_logprobs = _from_ratios([[0.5, 1.5, 2.0], [3.0, 2.0, 1.0], [0.5, 1.5, 100.0]])
    mask = _tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    out = tis_sequence(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    torch.testing.assert_close(out.weights, _tensor([[1.5, 1.5, 1.5], [2.0, 2.0, 2.0], [0.75, 0.75, 0.0]]))
    torch.testing.assert_close(out.metrics["is_clipped"], _tensor([[0, 0, 0], [1, 1, 1], [0, 0, 0]]))


def test_tis_sequence_in_log_space_survives_an_fp32_overflowing_product():
    # Five tokens with log rho = +20, five with -20 and one with rho = 1.5: the true product is
    # e^100 e^-100 1.5 = 1.5 < 2. The first five alone already overflow fp32 (e^100 ~ 2.7e43 >
    # 3.4e38), so a naive product is inf (or NaN); the log-space sum 100 - 100 + ln 1.5 is exact.
    log_rho = [20.0] * 5 + [-20.0] * 5 + [math.log(1.5)]
    assert torch.isinf(torch.exp(_tensor(log_rho[:5], torch.float32)).prod())
    sampler_logprobs = torch.full((1, 11), -30.0)
    old_logprobs = sampler_logprobs + _tensor([log_rho], torch.float32)
    mask = torch.ones(1, 11)
    out = tis_sequence(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    assert out.weights.dtype == torch.float32
    torch.testing.assert_close(out.weights, torch.full((1, 11), 1.5))
    # All +20: the product e^220 is capped to exactly 2, not inf.
    out = tis_sequence(old_logprobs=sampler_logprobs + 20.0, sampler_logprobs=sampler_logprobs, mask=mask)
    torch.testing.assert_close(out.weights, torch.full((1, 11), 2.0))
    # All -20: the product e^-220 underflows to 0, a finite weight.
    out = tis_sequence(old_logprobs=sampler_logprobs - 20.0, sampler_logprobs=sampler_logprobs, mask=mask)
    assert torch.all(out.weights == 0)


# ---------------------------------------------------------------- mis

def test_mis_keeps_tokens_inside_the_band():
    # band [0.5, 2]: rho = [0.4, 0.6, 1, 1.9, 2.5, 1 (padding)] -> w = [0, 1, 1, 1, 0, 0].
    old_logprobs, sampler_logprobs = _from_ratios([[0.4, 0.6, 1.0, 1.9, 2.5, 1.0]])
    mask = _tensor([[1, 1, 1, 1, 1, 0]])
    out = mis(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    torch.testing.assert_close(out.weights, _tensor([[0, 1, 1, 1, 0, 0]]))
    torch.testing.assert_close(out.metrics["is_masked"], _tensor([[1, 0, 0, 0, 1, 0]]))
    # a wider band keeps all valid tokens
    out = mis(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask, low=0.1, high=5.0)
    torch.testing.assert_close(out.weights, _tensor([[1, 1, 1, 1, 1, 0]]))


def test_mis_band_is_inclusive():
    # mu = 0, old = ln 0.5 and ln 2: rho is exactly 0.5 and 2 in fp64, both on the band edge.
    sampler_logprobs = torch.zeros(1, 2, dtype=F64)
    old_logprobs = _tensor([[math.log(0.5), math.log(2.0)]])
    out = mis(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=torch.ones(1, 2, dtype=F64))
    torch.testing.assert_close(out.weights, _tensor([[1.0, 1.0]]))


# ---------------------------------------------------------------- mis_sequence

def test_mis_sequence_rejects_whole_sequences_by_their_product():
    # band [0.5, 2] on the product of token ratios:
    # row 0: 0.6 * 1.25 = 0.75         -> kept, w = 1 at both tokens
    # row 1: 3 * 0.9 = 2.7             -> rejected (and so is its in-band token 0.9)
    # row 2: 0.6 * 0.6 = 0.36          -> rejected, though each token is inside the band
    # row 3: empty                     -> w 0, is_masked 0 (nothing to reject)
    rows = [[0.6, 1.25], [3.0, 0.9], [0.6, 0.6], [5.0, 5.0]]
    old_logprobs, sampler_logprobs = _from_ratios(rows)
    mask = _tensor([[1, 1], [1, 1], [1, 1], [0, 0]])
    out = mis_sequence(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    torch.testing.assert_close(out.weights, _tensor([[1, 1], [0, 0], [0, 0], [0, 0]]))
    torch.testing.assert_close(out.metrics["is_masked"], _tensor([[0, 0], [1, 1], [1, 1], [0, 0]]))
    # the token-level mis keeps row 2 (0.6 is in the band) and row 1's second token
    token = mis(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    torch.testing.assert_close(token.weights, _tensor([[1, 1], [0, 1], [1, 1], [0, 0]]))


def test_mis_sequence_product_that_overflows_fp32_is_compared_in_log_space():
    # +20 x 5, -20 x 5, ln 1.5: product 1.5 (in band, kept) although e^100 overflows fp32.
    log_rho = [20.0] * 5 + [-20.0] * 5 + [math.log(1.5)]
    sampler_logprobs = torch.full((2, 11), -30.0)
    old_logprobs = sampler_logprobs + torch.stack([torch.tensor(log_rho), torch.full((11,), 20.0)])
    out = mis_sequence(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=torch.ones(2, 11))
    torch.testing.assert_close(out.weights, torch.stack([torch.ones(11), torch.zeros(11)]))


# ---------------------------------------------------------------- shared invariants

def _inputs():
    old_logprobs, sampler_logprobs = _from_ratios([[0.4, 1.0, 3.0, 1.2], [1.1, 0.9, 0.8, 50.0]])
    return old_logprobs, sampler_logprobs, _tensor([[1, 1, 1, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_weights_carry_no_gradient_and_are_zero_on_padding(name):
    old_logprobs, sampler_logprobs, mask = _inputs()
    old_logprobs.requires_grad_()
    sampler_logprobs.requires_grad_()
    out = CORRECTIONS[name](old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    assert not out.weights.requires_grad
    assert out.weights[0, 3] == 0
    for values in out.metrics.values():
        assert not values.requires_grad and values[0, 3] == 0
    # As a loss multiplier it scales the gradient of the loss terms by w and nothing else.
    logprobs = torch.zeros_like(mask, requires_grad=True)
    (out.weights * logprobs).sum().backward()
    torch.testing.assert_close(logprobs.grad, out.weights)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_padding_with_nan_or_inf_does_not_leak(name):
    old_logprobs, sampler_logprobs, mask = _inputs()
    reference = CORRECTIONS[name](old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    old_logprobs[0, 3] = float("nan")
    sampler_logprobs[0, 3] = float("-inf")
    out = CORRECTIONS[name](old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs, mask=mask)
    torch.testing.assert_close(out.weights, reference.weights)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_identical_old_and_sampler_give_weight_one(name):
    logprobs = torch.log(_tensor([[0.3, 0.9, 0.5], [0.01, 0.7, 0.2]]))
    mask = _tensor([[1, 1, 1], [1, 1, 0]])
    out = CORRECTIONS[name](old_logprobs=logprobs, sampler_logprobs=logprobs.clone(), mask=mask)
    torch.testing.assert_close(out.weights, mask)
    flag = "is_clipped" if name.startswith("tis") else "is_masked"
    assert torch.all(out.metrics[flag] == 0)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_all_masked_gives_zero_weights_no_nan(name):
    old_logprobs, sampler_logprobs, mask = _inputs()
    out = CORRECTIONS[name](old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs,
                            mask=torch.zeros_like(mask))
    assert torch.all(out.weights == 0)
    for values in out.metrics.values():
        assert torch.all(values == 0)
        assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_invalid_parameters_raise():
    old_logprobs, sampler_logprobs, mask = _inputs()
    kwargs = {"old_logprobs": old_logprobs, "sampler_logprobs": sampler_logprobs, "mask": mask}
    with pytest.raises(ValueError, match="cap"):
        tis(**kwargs, cap=0.0)
    with pytest.raises(ValueError, match="low"):
        mis(**kwargs, low=2.0, high=0.5)


# ---------------------------------------------------------------- apply_correction

def test_apply_correction_by_name_and_import_path():
    old_logprobs, sampler_logprobs, mask = _inputs()
    kwargs = {"old_logprobs": old_logprobs, "sampler_logprobs": sampler_logprobs, "mask": mask}
    direct = tis(**kwargs, cap=1.5)
    for name in ("tis", "reinforge.objectives.corrections:tis"):
        torch.testing.assert_close(apply_correction(name, **kwargs, cap=1.5).weights, direct.weights)


def test_apply_correction_rejects_unknown_names_and_params():
    old_logprobs, sampler_logprobs, mask = _inputs()
    kwargs = {"old_logprobs": old_logprobs, "sampler_logprobs": sampler_logprobs, "mask": mask}
    with pytest.raises(ValueError, match="did you mean 'tis_sequence'"):
        apply_correction("tis_sequenc", **kwargs)
    with pytest.raises(ValueError, match="did you mean 'cap'"):
        apply_correction("tis", **kwargs, capp=2.0)
    with pytest.raises(ValueError, match="high"):
        apply_correction("mis", **kwargs, cap=2.0)


# ---------------------------------------------------------------- mismatch_metrics

def test_mismatch_metrics_by_hand():
    # (p_old, p_mu) per token, delta = ln(p_old / p_mu), k3 = (r - 1) - ln r with r = p_old / p_mu:
    #   0.5, 0.25   |diff| 0.25   delta  ln 2     k3 = 1 - ln 2          = 0.3068528
    #   0.2, 0.4    |diff| 0.2    delta -ln 2     k3 = -0.5 + ln 2       = 0.1931472
    #   0.9, 0.6    |diff| 0.3    delta  ln 1.5   k3 = 0.5 - ln 1.5      = 0.0945349
    #   0.01, 0.99  padding (its |diff| 0.98 would be the max)
    # abs mean (0.25 + 0.2 + 0.3) / 3 = 0.25, max 0.3, log-ratio mean ln 1.5 / 3 = 0.1351550,
    # kl (1 - ln 1.5) / 3 = 0.1981783; IS weights r = 2, 0.5, 1.5: mean 4/3, max 2 (padding's 0.0101 left out).
    old_logprobs = torch.log(_tensor([[0.5, 0.2], [0.9, 0.01]]))
    sampler_logprobs = torch.log(_tensor([[0.25, 0.4], [0.6, 0.99]]))
    metrics = mismatch_metrics(old_logprobs, sampler_logprobs, _tensor([[1, 1], [1, 0]]))
    assert metrics == pytest.approx({
        "mismatch_abs_diff_mean": 0.25,
        "mismatch_abs_diff_max": 0.3,
        "mismatch_log_ratio_mean": math.log(1.5) / 3,
        "mismatch_kl": (1 - math.log(1.5)) / 3,
        "is_weight_mean": 4 / 3,
        "is_weight_max": 2.0,
    })
    assert all(isinstance(value, float) for value in metrics.values())


def test_mismatch_kl_is_kl_of_sampler_from_old_under_sampler_tokens():
    # Tokens drawn in proportion to mu = [0.5, 0.25, 0.25] (y0 twice, y1, y2) over a 3-token
    # vocabulary with p_old = [0.2, 0.3, 0.5]: the mean of k3 is exactly E_mu[k3] =
    # E_mu[r] - 1 - E_mu[ln r] = 0 + KL(mu || old)
    #   = 0.5 ln 2.5 + 0.25 ln(0.25/0.3) + 0.25 ln 0.5 = 0.2392782   (KL(old || mu) = 0.2180119).
    mu, old = [0.5, 0.25, 0.25], [0.2, 0.3, 0.5]
    tokens = [0, 0, 1, 2]
    old_logprobs = torch.log(_tensor([[old[y] for y in tokens]]))
    sampler_logprobs = torch.log(_tensor([[mu[y] for y in tokens]]))
    metrics = mismatch_metrics(old_logprobs, sampler_logprobs, torch.ones(1, 4, dtype=F64))
    assert metrics["mismatch_kl"] == pytest.approx(0.2392781815986)


def test_mismatch_metrics_identical_and_empty():
    logprobs = torch.log(_tensor([[0.3, 0.9], [0.5, 0.1]]))
    mask = _tensor([[1, 1], [1, 0]])
    assert mismatch_metrics(logprobs, logprobs.clone(), mask) == {
        "mismatch_abs_diff_mean": 0.0, "mismatch_abs_diff_max": 0.0,
        "mismatch_log_ratio_mean": 0.0, "mismatch_kl": 0.0, "is_weight_mean": 1.0, "is_weight_max": 1.0,
    }
    other = logprobs.clone()
    other[1, 1] = float("nan")
    for empty in (torch.zeros_like(mask), torch.zeros(0, 0, dtype=F64)):
        rows = empty.shape
        metrics = mismatch_metrics(logprobs[: rows[0], : rows[1]], other[: rows[0], : rows[1]], empty)
        assert (
            metrics == {**dict.fromkeys(metrics, 0.0), "is_weight_mean": 1.0, "is_weight_max": 1.0}
            and len(metrics) == 6
        )
