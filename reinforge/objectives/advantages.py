"""Outcome advantages: estimators from group statistics of scalar rewards,
the optional transforms after them, and the pipeline that keeps their state.

Every estimator has the signature

    fn(rewards: Tensor [N] float, group_ids: Tensor [N] long, **params) -> Tensor [N]

and sits in `ADVANTAGES`; a new estimator is one function and one entry.
Group ids are arbitrary integers (not necessarily contiguous), groups may
differ in size, and nothing loops over groups in Python. An estimator that
keeps state across batches (reinforce's EMA baseline) declares a keyword
`state: dict[str, Tensor] | None`, which `AdvantagePipeline` passes.

Transforms run after the estimator, in order (ALGORITHMS.md, "Advantage
transforms"), with the signature

    fn(advantages [N], *, rewards [N], group_ids [N], state: dict[str, Tensor],
       generator: torch.Generator | None, **params) -> AdvantageResult

and sit in `ADVANTAGE_TRANSFORMS`. Critic-based advantages (GAE) need values
and per-token rewards and live in `reinforge.objectives.value`.

An estimator may also declare inputs beyond rewards and group ids (`EXTRA_INPUTS`), which
the caller supplies and `AdvantagePipeline` passes to it alone: `baselines` [N] (ReMax's
reward of a greedy completion of the same prompt), `mask` [N, T] and `token_penalty` [N, T]
(the per-token KL in the reward, for REINFORCE++'s per-token returns, which give [N, T]
advantages; `token_advantages`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from reinforge.objectives.common import Groups, check_params, resolve
from reinforge.objectives.coverage import max_loo, opo, passk, w_reinforce
from reinforge.objectives.token_advantages import reinforce_pp, reinforce_pp_baseline
from reinforge.objectives.value import CRITIC_ADVANTAGES

# Inputs an estimator may declare that the caller supplies (see the module docstring).
EXTRA_INPUTS = ("baselines", "mask", "token_penalty")
# The inputs an estimator / a transform receives from its caller; their other
# keyword arguments are settable parameters (ObjectiveSpec.advantage_params, Part.params).
ADVANTAGE_INPUTS = ("rewards", "group_ids", "state", *EXTRA_INPUTS)
TRANSFORM_INPUTS = ("advantages", "rewards", "group_ids", "state", "generator")


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each sample's own group, broadcast back to the samples."""

    mean: Tensor   # [N] mean_g of the rewards in the sample's group
    std: Tensor    # [N] std_g with Bessel's correction; 0 for a group of one
    size: Tensor   # [N] long, number of samples in the group


def group_stats(rewards: Tensor, group_ids: Tensor) -> GroupStats:
    """Per-group mean and unbiased std, computed with index_add (no loop over groups).

    std_g = sqrt( sum_{j in g} (R_j - mean_g)^2 / (|g| - 1) ), Bessel's correction
    as verl and TRL (ALGORITHMS.md, "choice"); a group of one has std 0 (not NaN).
    """
    _check_inputs(rewards, group_ids)
    rewards = _as_float(rewards)
    groups = Groups.of(group_ids)
    sizes = groups.sizes.to(rewards.dtype)                                   # [G]
    mean = (groups.sum(rewards) / sizes)[groups.index]                       # [N]
    squares = groups.sum((rewards - mean) ** 2)                              # [G]
    std = (squares / (sizes - 1).clamp(min=1)).sqrt()[groups.index]          # [N]
    return GroupStats(mean=mean, std=std, size=groups.sizes[groups.index])


def _check_inputs(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be [N], got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )


def _as_float(rewards: Tensor) -> Tensor:
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def batch_std(values: Tensor) -> Tensor:
    """std over the whole batch with Bessel's correction (as group_stats); 0 for N <= 1, not NaN."""
    if values.numel() < 2:
        return values.new_zeros(())
    return values.std(correction=1)


def ema_baseline(state: dict[str, Tensor], batch_mean: Tensor, decay: float, key: str = "reward_ema") -> Tensor:
    """The EMA baseline b for this batch, and the update of `state[key]` (0-dim) after it.

        b_t = state[key] (the EMA of the batch means of batches < t); on the first batch b_1 = batch mean
        state[key] <- decay * b_t + (1 - decay) * batch_mean_t

    The baseline of batch t never contains batch t itself except on the first
    batch (choice: it stays independent of the samples it centres).
    """
    batch_mean = batch_mean.detach()
    baseline = state.get(key)
    baseline = batch_mean if baseline is None else baseline.to(batch_mean)
    state[key] = decay * baseline + (1.0 - decay) * batch_mean
    return baseline


def grpo(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """GRPO (arXiv 2402.03300, sec. 4.1.2): A_i = (R_i - mean_g) / (std_g + eps).

    A group of one has R_i = mean_g, hence A_i = 0; so has a group whose
    rewards are all equal (no learning signal, the "zero-variance" group).
    """
    stats = group_stats(rewards, group_ids)
    return (rewards - stats.mean) / (stats.std + eps)


def dr_grpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO (arXiv 2503.20783): A_i = R_i - mean_g.

    Dropping GRPO's division by std_g removes its question-level difficulty bias.
    """
    return rewards - group_stats(rewards, group_ids).mean


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO (arXiv 2402.14740): leave-one-out baseline within the group,

        A_i = R_i - mean_{j in g, j != i} R_j = G / (G - 1) (R_i - mean_g),   G = |g|.

    A group of one has no other sample to compare with: A = 0. Group sums are 0.
    """
    stats = group_stats(rewards, group_ids)
    size = stats.size.to(stats.mean.dtype)
    return size / (size - 1).clamp(min=1) * (rewards - stats.mean)


def lite_ppo(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """LitePPO (arXiv 2508.08221, "Tricks or Traps"): group mean, batch std,

        A_i = (R_i - mean_g) / (std_batch(R) + eps),

    std_batch over all N rewards with Bessel's correction (choice, as grpo's std_g).
    """
    rewards = _as_float(rewards)
    return (rewards - group_stats(rewards, group_ids).mean) / (batch_std(rewards) + eps)


def scalerl(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6) -> Tensor:
    """ScaleRL (arXiv 2510.13786): batch-level normalisation of group-centred rewards,

        B_i = R_i - mean_g,   A_i = B_i / (std_batch(B) + eps),

    std_batch with Bessel's correction over all N samples (choice). Unlike
    lite_ppo the std is that of B, so zero-variance groups do not inflate it.
    """
    centred = dr_grpo(_as_float(rewards), group_ids)
    return centred / (batch_std(centred) + eps)


def reinforce(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    baseline: float | str | None = None,
    ema_decay: float = 0.9,
    state: dict[str, Tensor] | None = None,
) -> Tensor:
    """REINFORCE with a baseline (Williams 1992; the REINFORCE of arXiv 2402.14740):

        A_i = R_i - b

    baseline None: b = batch mean; a number: b = that value; "ema": b = the EMA
    of past batch means (`ema_baseline`, decay `ema_decay`), kept in
    `state["reward_ema"]`, which `AdvantagePipeline` owns and passes. Groups are ignored.
    """
    _check_inputs(rewards, group_ids)
    rewards = _as_float(rewards)
    batch_mean = rewards.mean()
    if baseline is None:
        b = batch_mean
    elif baseline == "ema":
        if state is None:
            raise ValueError(
                "reinforce with baseline='ema' keeps state across batches: "
                "use reinforge.objectives.advantages.AdvantagePipeline"
            )
        b = ema_baseline(state, batch_mean, ema_decay)
    elif isinstance(baseline, str):
        raise ValueError(f"reinforce baseline must be None, a number or 'ema', got {baseline!r}")
    else:
        b = float(baseline)
    return rewards - b


def maxrl(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """MaxRL (arXiv 2602.02710): A_i = (R_i - rhat) / rhat, rhat = mean_g(R), binary rewards.

    The 1/rhat weight turns the pass@1 gradient into that of log(pass rate),
    which concentrates the signal on hard prompts. A group with rhat = 0 (no
    correct sample) gets A = 0, not NaN; so does rhat < 0, which binary rewards
    never produce and where the formula would flip signs (choice). Group sums are 0.
    """
    rewards = _as_float(rewards)
    rhat = group_stats(rewards, group_ids).mean                              # [N]
    solved = rhat > 0
    advantages = (rewards - rhat) / torch.where(solved, rhat, torch.ones_like(rhat))
    return torch.where(solved, advantages, torch.zeros_like(advantages))


def gpg(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """GPG (arXiv 2504.02546): A_i = alpha (R_i - mean_g), alpha = B / (B - M).

    B = N samples in the batch; M = samples in groups whose rewards are all
    equal (groups of one included), which carry no signal: alpha rescales the
    gradient to the informative samples (the paper's choice, not verl's). If
    every group is degenerate (M = B) all advantages are 0 and alpha = 1.
    """
    rewards = _as_float(rewards)
    groups = Groups.of(group_ids)
    highest = rewards.new_full((groups.num_groups,), -torch.inf).scatter_reduce_(0, groups.index, rewards, "amax")
    lowest = rewards.new_full((groups.num_groups,), torch.inf).scatter_reduce_(0, groups.index, rewards, "amin")
    degenerate = (highest == lowest)[groups.index]                           # [N] exact, no rounding
    total = rewards.new_tensor(float(rewards.numel()))
    informative = total - degenerate.sum()
    alpha = torch.where(informative > 0, total / informative.clamp(min=1), torch.ones_like(total))
    return alpha * dr_grpo(rewards, group_ids)


def remax(rewards: Tensor, group_ids: Tensor, *, baselines: Tensor) -> Tensor:
    """ReMax (arXiv 2310.10505): A_i = R_i - R(ybar_i), ybar_i the greedy completion of sample i's prompt.

    It is decoded greedily (argmax) with the same weights and scored by the same reward;
    `baselines` [N] holds R(ybar_i) for every sample (the trainer system "greedy_baseline"
    generates it, loops/baselines.py). The greedy completion is not trained on. Groups are ignored.
    """
    _check_inputs(rewards, group_ids)
    if baselines.shape != rewards.shape:
        raise ValueError(f"baselines must be [N] like rewards, got {tuple(baselines.shape)} and {tuple(rewards.shape)}")
    return _as_float(rewards) - baselines.to(_as_float(rewards).dtype)


ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "lite_ppo": lite_ppo,
    "scalerl": scalerl,
    "reinforce": reinforce,
    "maxrl": maxrl,
    "gpg": gpg,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
    "remax": remax,
    "passk": passk,
    "max_loo": max_loo,
    "w_reinforce": w_reinforce,
    "opo": opo,
}


# ---------------------------------------------------------------- transforms


@dataclass
class AdvantageResult:
    """Advantages after the estimator and transforms, and which samples stay in the batch."""

    advantages: Tensor   # [N] per-sequence advantages ([N, T] from a per-token estimator: REINFORCE++)
    keep: Tensor         # [N] bool; False = drop the sample from the batch (e.g. filter_small)


def _keep_all(advantages: Tensor) -> Tensor:
    return torch.ones_like(advantages, dtype=torch.bool)


def gaussian_noise(
    advantages: Tensor,
    *,
    rewards: Tensor,
    group_ids: Tensor,
    state: dict[str, Tensor],
    generator: torch.Generator | None,
    sigma: float = 0.1,
) -> AdvantageResult:
    """A' = A + e, e ~ N(0, sigma^2) i.i.d. per sample, drawn from `generator`.

    Meant for normalised advantages (ALGORITHMS.md), where sigma is in units of
    the group std. Reproducible under a seeded generator; the noise is drawn on
    the generator's device and moved to the advantages'.
    """
    device = generator.device if generator is not None else advantages.device
    noise = torch.randn(advantages.shape, generator=generator, device=device, dtype=advantages.dtype)
    return AdvantageResult(advantages + sigma * noise.to(advantages.device), _keep_all(advantages))


def filter_small(
    advantages: Tensor,
    *,
    rewards: Tensor,
    group_ids: Tensor,
    state: dict[str, Tensor],
    generator: torch.Generator | None,
    tau: float = 1e-6,
) -> AdvantageResult:
    """keep_i = |A_i| >= tau: samples with |A_i| < tau leave the batch.

    Default tau = 1e-6 (choice): it drops the samples that carry no signal
    (zero-variance groups, groups of one, up to rounding) and no informative
    one, so that they stop diluting token-mean denominators. Raise it for a
    stricter filter, in the units of the estimator's advantages.
    """
    return AdvantageResult(advantages, advantages.abs() >= tau)


def ema_baseline_mix(
    advantages: Tensor,
    *,
    rewards: Tensor,
    group_ids: Tensor,
    state: dict[str, Tensor],
    generator: torch.Generator | None,
    weight: float = 0.5,
    decay: float = 0.9,
) -> AdvantageResult:
    """Mix a cross-prompt EMA baseline into the group baseline:

        baseline = (1 - w) mean_g + w b_ema   =>   A' = A + w (mean_g - b_ema)

    b_ema is the EMA of past batch mean rewards (`ema_baseline`, state
    "reward_ema"): on the first batch, this batch's mean. Exact for estimators
    centred on the group mean without scaling (dr_grpo: A' = R - baseline);
    for normalised ones (grpo, lite_ppo, ...) the shift is in reward units,
    not divided by the std. For reinforce (centred on the batch mean) use its
    own baseline="ema" instead.
    """
    rewards = _as_float(rewards)
    b_ema = ema_baseline(state, rewards.mean(), decay)
    group_mean = group_stats(rewards, group_ids).mean
    return AdvantageResult(advantages + weight * (group_mean - b_ema), _keep_all(advantages))


ADVANTAGE_TRANSFORMS: dict[str, Callable[..., AdvantageResult]] = {
    "gaussian_noise": gaussian_noise,
    "filter_small": filter_small,
    "ema_baseline_mix": ema_baseline_mix,
}


# ------------------------------------------------------------------ look-up


def resolve_advantage(name: str) -> Callable[..., Tensor]:
    """The estimator `name` (or "module:function"); a critic-based name is a ValueError saying where it lives."""
    if name in CRITIC_ADVANTAGES:
        raise ValueError(
            f"advantage {name!r} needs a critic's values and per-token rewards, not only rewards "
            f"and group ids: use {CRITIC_ADVANTAGES[name]}"
        )
    return resolve(ADVANTAGES, name, "advantage estimator")


def compute_advantages(name: str, rewards: Tensor, group_ids: Tensor, **params: object) -> Tensor:
    """Advantages [N] by estimator name (or "module:function" import path); stateless.

    For state across batches (reinforce's EMA baseline) or transforms, use
    `AdvantagePipeline`.
    """
    return resolve_advantage(name)(rewards, group_ids, **params)


class AdvantagePipeline:
    """The estimator, then the transforms in order; owns their state across batches.

    Each stage gets its own state dict, so that two stages never share a key
    (reinforce's EMA and ema_baseline_mix's are separate): the estimator's is
    passed only if it declares `state`, every transform's always.
    `state_dict()` names them "estimator.KEY" and "transforms.I.KEY".
    """

    def __init__(
        self,
        estimator: str = "grpo",
        params: Mapping[str, Any] | None = None,
        transforms: Sequence[tuple[str, Mapping[str, Any]] | Any] = (),   # (name, params) pairs or spec.Part
    ) -> None:
        self.estimator = resolve_advantage(estimator)
        self.params = dict(params or {})
        check_params(self.estimator, self.params, f"advantage {estimator!r}", reserved=ADVANTAGE_INPUTS)
        self.transforms: list[tuple[Callable[..., AdvantageResult], dict[str, Any]]] = []
        for part in transforms:
            name, transform_params = part if isinstance(part, tuple) else (part.name, part.params)
            fn = resolve(ADVANTAGE_TRANSFORMS, name, "advantage transform")
            check_params(fn, transform_params, f"advantage transform {name!r}", reserved=TRANSFORM_INPUTS)
            self.transforms.append((fn, dict(transform_params)))
        self.states: dict[str, dict[str, Tensor]] = {"estimator": {}}
        self.states.update({f"transforms.{i}": {} for i in range(len(self.transforms))})
        self.name = estimator
        signature = inspect.signature(self.estimator).parameters
        self._estimator_takes_state = "state" in signature
        # the caller-supplied inputs it declares, and those it cannot go without (no default)
        self.inputs = {name for name in EXTRA_INPUTS if name in signature}
        self._required = {name for name in self.inputs if signature[name].default is inspect.Parameter.empty}

    def __call__(self, rewards: Tensor, group_ids: Tensor, generator: torch.Generator | None = None,
                 **inputs: Tensor | None) -> AdvantageResult:
        """Advantages ([N], or [N, T] from a per-token estimator) and keep [N] of one batch; updates the state.

        `inputs`: the caller's EXTRA_INPUTS (None = not available); each goes to the estimator only if it
        declares it, and one it declares without a default must be given."""
        unknown = set(inputs) - set(EXTRA_INPUTS)
        if unknown:
            raise ValueError(f"unknown advantage inputs {sorted(unknown)}; known: {', '.join(EXTRA_INPUTS)}")
        missing = sorted(name for name in self._required if inputs.get(name) is None)
        if missing:
            raise ValueError(f"advantage {self.name!r} needs {', '.join(missing)}, which this batch does not have")
        extra = {name: inputs[name] for name in self.inputs if inputs.get(name) is not None}
        if self._estimator_takes_state:
            extra["state"] = self.states["estimator"]
        advantages = self.estimator(rewards, group_ids, **self.params, **extra)
        if advantages.dim() != 1 and self.transforms:
            raise ValueError(f"advantage {self.name!r} gives per-token advantages: the advantage transforms take [N]")
        result = AdvantageResult(advantages, torch.ones(advantages.shape[0], dtype=torch.bool,
                                                        device=advantages.device))
        for i, (fn, params) in enumerate(self.transforms):
            step = fn(result.advantages, rewards=rewards, group_ids=group_ids,
                      state=self.states[f"transforms.{i}"], generator=generator, **params)
            result = AdvantageResult(step.advantages, result.keep & step.keep)
        return result

    def state_dict(self) -> dict[str, Tensor]:
        """Every stage's state as detached copies, keyed "estimator.KEY" / "transforms.I.KEY"."""
        return {f"{stage}.{key}": value.detach().clone()
                for stage, state in self.states.items() for key, value in state.items()}

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Replace all state by `state_dict` (from `state_dict()` of a pipeline with the same stages)."""
        loaded: dict[str, dict[str, Tensor]] = {stage: {} for stage in self.states}
        for name, value in state_dict.items():
            stage, _, key = name.rpartition(".")
            if stage not in loaded or not key:
                raise ValueError(f"unexpected advantage state {name!r} (stages: {', '.join(loaded)})")
            loaded[stage][key] = value.detach().clone()
        for stage, state in self.states.items():
            state.clear()
            state.update(loaded[stage])
