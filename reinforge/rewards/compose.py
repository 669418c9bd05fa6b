"""Reward composition: the scalar reward of each completion, from several reward functions.

This module owns the step between a rollout and its advantages: it calls each
configured reward function on the completions, sums them with their weights,
adds DAPO's overlong shaping, and reports what went wrong per function (raised,
or declined to score) so that such samples can be dropped instead of trained on
with a made-up reward. How one function is called on the rows in its convention, and
what its failures say, is reinforge.rewards.terms.

A reward function is a plain callable in one of three conventions, told apart
by its signature when the config is checked (`reinforge.rewards.conventions`):
reinforge's per-sample form, TRL's batched form
`f(prompts, completions, **kwargs) -> list[float]`, and verl's
`compute_score(data_source, solution_str, ground_truth, extra_info=None)`.
The per-sample form is called once per completion with keyword arguments and
returns a float, or None for "do not score this sample". It receives only the
keywords it declares (all of them if it takes **kwargs):

    prompt, completion, answer   the example's prompt and gold answer, the decoded completion
    length, truncated            completion tokens (eos included) and whether max_new_tokens cut it
    example, task                the `Example` record and the `Task` (its verifier: task.reward)
    <meta fields>                each key of example.meta not named above, e.g. target, numbers
    <params>                     the function's `params` from the config (they win over meta)

A function may be restricted to some domains of a mix (`reward.functions[].domains`,
reinforge.tasks.mix): it is then called only on those rows, and on the others it is
not applicable (left out of the sum; the row is not skipped for it).

Built-ins are in `REWARD_FUNCTIONS` (reinforge.rewards.functions, with the check of a
configured name and its params); anything else is given as 'module:function'
(a module importable, or in the working directory) or 'path/to/file.py:function'.
A function that raises costs its sample its gradient; past `max_error_rate` of a
batch, `score` raises `RewardError`, whose message is one line naming the
function, the sample and the exception (the full traceback is its `.details`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from reinforge.errors import ConfigError
from reinforge.objectives.common import accepted_params
from reinforge.rewards.conventions import NotARewardError, reward_form, unfilled_parameters
from reinforge.rewards.functions import (
    FORM_INPUTS,
    REWARD_FUNCTIONS,
    REWARD_INPUTS,
    check_reward_domains,
    format_match,
    length_penalty,
    resolve_reward_function,
    think_answer,
    verifier,
)
from reinforge.rewards.sources import RewardSource, check_values
from reinforge.rewards.terms import Failure, Term, call_term, failure_traceback, form_hint, return_hint, scores_nothing
from reinforge.rollout.base import Rollout
from reinforge.settings import RewardConfig
from reinforge.tasks.base import Example, Task


def check_reward_inputs(reward: RewardConfig, example: Example, domain: str | None = None) -> None:
    """ConfigError for a reward function with a required parameter nothing fills (a TRL function's
    `trainer_state`, a column the data lacks), judged on `example`, a row of the data (of `domain`: only
    the functions that score that domain are judged): caught before anything is written, rather than
    as a TypeError on every call after the model has loaded."""
    for f in reward.functions:
        if domain is not None and f.domains is not None and domain not in f.domains:
            continue
        fn = resolve_reward_function(f.name, f.params)
        form = reward_form(fn, f.name)
        columns = {*example.meta, "prompt", "answer"} if form != "verl" else set()
        missing = unfilled_parameters(fn, form, {*f.params, *columns})
        if missing:
            note = ("; TRL's trainer_state is not passed (there is no transformers Trainer): give it a default, "
                    "trainer_state=None" if "trainer_state" in missing else "")
            where = f", nor a column of the data ({', '.join(sorted(columns))})" if columns else ""
            raise ConfigError(
                f"reward function '{f.name}' needs {', '.join(map(repr, missing))}, which nothing passes: not "
                f"an input of its form ({', '.join(FORM_INPUTS[form])}){where}, nor one of its params"
                f"{note or ': give the parameter a default, add the column, or set it in params'}"
            )


# ------------------------------------------------------------------ overlong shaping


def overlong_shaping(lengths: Tensor, max_length: int, cache: int) -> Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, eq. 13), [N] -> [N]:

        0                                   |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
        -1                                  |y| > L_max

    Continuous: 0 at the start of the cache window, -1 at L_max.
    """
    if not 0 < cache <= max_length:
        raise ValueError(f"overlong shaping needs 0 < cache <= max_length, got cache={cache}, max_length={max_length}")
    lengths = lengths.float()
    start = max_length - cache
    ramp = (start - lengths) / cache
    return torch.where(
        lengths <= start, torch.zeros_like(ramp), torch.where(lengths <= max_length, ramp, -torch.ones_like(ramp))
    )


# ------------------------------------------------------------------ composition


class RewardError(RuntimeError):
    """Reward functions raised on more of a batch than `reward.max_error_rate` allows.

    str(err) is one line: the first failing function (as configured, ':' written '.'), the
    exception, the sample (row of the batch, prompt and completion clipped) and the counts.
    `details` holds the full traceback of that first exception, for a log file.
    """

    def __init__(self, message: str, details: str):
        super().__init__(message)
        self.details = details


def _clip(text: str, limit: int = 60) -> str:
    """`text` shortened to `limit` characters, quoted on one line (repr escapes newlines)."""
    text = str(text)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


@dataclass(frozen=True)
class RewardBatch:
    """Rewards of one rollout batch, row r for examples[r // group_size].

    Invariant: valid == ~(raised | skipped), and total is finite exactly where valid.
    """

    total: Tensor  # [N] float, sum_k weight_k * parts[k] + coef * parts["overlong"]; NaN where not valid
    parts: dict[
        str, Tensor
    ]  # function key -> [N] float raw values (before weights); NaN where it raised or returned None
    valid: Tensor  # [N] bool, False where any function raised or returned None: give such rows no gradient
    raised: Tensor               # [N] bool, some function raised on this row
    skipped: Tensor              # [N] bool, some function returned None for this row
    errors: dict[str, int]       # function key -> rows on which it raised (every function listed, 0 included)
    first_traceback: str | None  # the first exception of the batch, with the function and row it came from
    # [N, T] per-token terms of the reward sources (times their weights), added to the advantage of
    # every model token by the learner; None when no source gives any
    token_advantages: Tensor | None = None
    source_metrics: dict[str, float] | None = None   # reward/<source>/<name> figures of the reward sources
    # "<function key>/<name>" -> [N] float: the numeric extra keys of verl dict results ({"score": 1, "acc": 1});
    # NaN on the rows that did not return one
    extras: dict[str, Tensor] | None = None

    def metrics(self) -> dict[str, float]:
        """reward/<key>_mean over the rows the function scored (NaN if none), reward/<key>_errors,
        the total's mean over valid rows, and the fractions of rows skipped, failed and valid."""
        out = {f"reward/{key}_mean": _nanmean(values) for key, values in self.parts.items()}
        out.update({f"reward/{key}_errors": float(count) for key, count in self.errors.items()})
        out["reward/total_mean"] = _nanmean(self.total)
        out["reward/skip_frac"] = _mean(self.skipped)
        out["reward/error_frac"] = _mean(self.raised)
        out["reward/valid_frac"] = _mean(self.valid)
        out.update(self.source_metrics or {})
        out.update({f"reward/{key}": _nanmean(values) for key, values in (self.extras or {}).items()})
        return out


def _mean(flags: Tensor) -> float:
    return float(flags.float().mean()) if flags.numel() else 0.0


def _nanmean(values: Tensor) -> float:
    scored = values[~values.isnan()]
    return float(scored.mean()) if scored.numel() else math.nan


class RewardComposer:
    """The configured reward functions of a run, called on each batch, summed with their weights,
    then the reward sources (reinforge.rewards.sources: reward models, judges, teachers), each a
    batched call whose sequence values add to the sum and whose token terms add to the advantage."""

    def __init__(self, cfg: RewardConfig, task: Task, max_new_tokens: int,
                 sources: Sequence[RewardSource] = (), *, check_domains: bool = True) -> None:
        """`check_domains=False`: a composer of the functions alone (the reward probe), whose sources
        were left out, so a domain only a source scores is not refused."""
        self.task = task
        self.sources = list(sources)
        self.max_error_rate = cfg.max_error_rate
        self.terms: list[Term] = []
        taken = {"overlong"} if cfg.overlong is not None else set()
        for f in cfg.functions:
            fn = resolve_reward_function(f.name, f.params)
            key = base = f.name.rpartition(":")[2]
            i = 1
            while key in taken:
                i += 1
                key = f"{base}_{i}"
            taken.add(key)
            form = reward_form(fn, f.name)
            label = f.name if f.name.rpartition(":")[0].endswith(".py") else f.name.replace(":", ".")
            self.terms.append(Term(key, label, fn, form, f.weight, dict(f.params), accepted_params(fn),
                                    frozenset(f.domains) if f.domains is not None else None))
        if check_domains:
            check_reward_domains(cfg.functions, task.domains, has_source=bool(self.sources))
        for source in self.sources:
            if source.key in taken:
                raise ValueError(f"reward source {source.key!r} has the name of a reward function: rename the function")
            taken.add(source.key)
        if not self.terms and not self.sources:
            raise ValueError("reward.functions is empty and no reward source is set: give at least one reward "
                             "function, e.g. [{name: verifier}], or a reward model (reward.model.path)")
        self.overlong = cfg.overlong
        self.overlong_max_length = (cfg.overlong.max_length or max_new_tokens) if cfg.overlong is not None else None
        # DAPO's window is a fifth of the limit (4096 of 20480 tokens): the default when none is given.
        self.overlong_cache = (
            (cfg.overlong.cache or max(1, self.overlong_max_length // 5)) if cfg.overlong is not None else None
        )
        if cfg.overlong is not None:
            overlong_shaping(torch.zeros(0), self.overlong_max_length, self.overlong_cache)   # validates the window now

    def score(self, examples: list[Example], rollout: Rollout, group_size: int) -> RewardBatch:
        """Rewards of every row of `rollout`; row r belongs to examples[r // group_size].

        Raises RewardError when the fraction of rows on which some function raised exceeds max_error_rate.
        """
        n = len(rollout.texts)
        if n != len(examples) * group_size:
            raise ValueError(f"rollout has {n} rows, expected {len(examples)} examples x group_size {group_size}")
        rows = [examples[r // group_size] for r in range(n)]
        lengths = rollout.lengths     # [N] the model's tokens: environment replies do not make a row overlong
        parts = {t.key: torch.full((n,), math.nan) for t in self.terms}
        errors = {t.key: 0 for t in self.terms}
        raised = torch.zeros(n, dtype=torch.bool)
        skipped = torch.zeros(n, dtype=torch.bool)
        declined = torch.zeros(n, dtype=torch.long)     # functions that returned None, per row
        applicable = torch.zeros(n, dtype=torch.long)   # functions that score the row's domain, per row
        domains = [self.task.domain_of(e) for e in rows]
        failures: list[Failure] = []
        extras: dict[str, Tensor] = {}
        for t in self.terms:
            # A function restricted to domains is not called on other rows: not applicable, left out of
            # the sum (NaN in its part), which is not a skip.
            index = [r for r in range(n) if t.domains is None or domains[r] in t.domains]
            applicable[index] += 1
            values, failed, found = call_term(t, rows, rollout, index, self.task)
            for (name, r), value in found.items():
                extras.setdefault(f"{t.key}/{name}", torch.full((n,), math.nan))[r] = value
            for r, err in failed.items():
                failures.append(Failure(t, r, err))
                errors[t.key] += 1
                raised[r] = True
            # One indexed store per kind, not one per row (64 stores a step at 64 rows).
            answered = [(r, v) for r, v in zip(index, values, strict=True) if r not in failed]
            none = [r for r, v in answered if v is None]
            scored = [(r, v) for r, v in answered if v is not None]
            if none:
                declined[none] += 1
                skipped[none] |= t.form != "trl"   # TRL's None is "not applicable": left out of the sum
            if scored:
                parts[t.key][[r for r, _ in scored]] = torch.tensor([v for _, v in scored], dtype=torch.float)
        # no function that applies to the row scored it: nothing to train on
        skipped |= (applicable > 0) & (declined == applicable)
        if _mean(raised) > self.max_error_rate:
            raise self._error(failures, rows, rollout, raised, errors)
        total = torch.zeros(n)
        for t in self.terms:
            total += torch.nan_to_num(t.weight * parts[t.key], nan=0.0)
        token_advantages, source_metrics = self._sources(rows, rollout, parts, total, skipped)
        if self.overlong is not None:
            parts["overlong"] = overlong_shaping(lengths, self.overlong_max_length, self.overlong_cache)
            total += self.overlong.coef * parts["overlong"]
        valid = ~(raised | skipped)
        total = torch.where(valid, total, torch.full_like(total, math.nan))
        first = failures[0] if failures else None
        return RewardBatch(total=total, parts=parts, valid=valid, raised=raised, skipped=skipped, errors=errors,
                           first_traceback=failure_traceback(first) if first else None,
                           token_advantages=token_advantages, source_metrics=source_metrics, extras=extras)

    def _sources(self, rows: list[Example], rollout: Rollout, parts: dict[str, Tensor], total: Tensor,
                 skipped: Tensor) -> tuple[Tensor | None, dict[str, float]]:
        """Each reward source on the batch: its values into `parts` and `total` (in place; a row it could
        not score is `skipped`), its token terms summed with their weights; and its metrics."""
        n, width = rollout.completion_ids.shape
        token_advantages: Tensor | None = None
        metrics: dict[str, float] = {}
        for source in self.sources:
            out = source.score(rows, rollout)
            check_values(source, out, n, width)
            if out.values is not None:
                values = out.values.detach().float().cpu()
                parts[source.key] = values
                skipped |= values.isnan()
                total += torch.nan_to_num(source.weight * values, nan=0.0)
            if out.token_values is not None:
                terms = source.weight * out.token_values.detach().float().cpu() * rollout.trained_mask
                token_advantages = terms if token_advantages is None else token_advantages + terms
            metrics.update({f"reward/{source.key}/{k}": float(v) for k, v in out.metrics.items()})
            metrics[f"reward/{source.key}/unscored"] = float(out.unscored)
        return token_advantages, metrics

    def probe(self, examples: list[Example], rollout: Rollout) -> list[str]:
        """Each reward function called once on `rollout` (one completion per example): ConfigError at
        once, naming the function and what it returned, for a result that is not a reward (a str, a
        list of the wrong length, a dict without 'score'), rather than after the start-of-RL
        evaluation. Exceptions raised inside a function are left to the run (max_error_rate): the
        probe's completions come from a model not yet trained. Returns one warning per function that
        declined (None) every probe sample."""
        n = len(rollout.texts)
        domains = [self.task.domain_of(e) for e in examples]
        warnings: list[str] = []
        for t in self.terms:
            index = [r for r in range(n) if t.domains is None or domains[r] in t.domains]
            values, failed, _ = call_term(t, examples, rollout, index, self.task)
            wrong = next((err for err in failed.values() if isinstance(err, NotARewardError)), None)
            if wrong is not None:
                raise ConfigError(f"reward function {t.label} {wrong} (probed on {len(index)} samples before "
                                  f"training){return_hint(t)}")
            if index and not failed and all(v is None for v in values) and t.form == "sample":
                if scores_nothing(t, examples, rollout, index, self.task):
                    raise ConfigError(f"reward function {t.label} returned None on all {len(index)} probe samples and "
                                      "on their gold answers: None leaves a sample unscored, so it would score nothing "
                                      f"(probed before training){return_hint(t)}")
                if not any(examples[r].answer for r in index):
                    warnings.append(f"reward function {t.label} returned None (do not score) on all {len(index)} "
                                    "probe samples: if it should score them, make it return a float")
        return warnings

    # -------------------------------------------------------------- errors

    def _error(self, failures: list[Failure], rows: list[Example], rollout: Rollout, raised: Tensor,
               errors: dict[str, int]) -> RewardError:
        first = failures[0]
        r = first.row if first.row is not None else 0
        counts = ", ".join(f"{k}: {c}" for k, c in errors.items() if c)
        message = (
            f"reward function {first.term.label} raised {first.error!r} on sample {r} "
            f"(prompt {_clip(rows[r].prompt)}, completion {_clip(rollout.texts[r])}); reward functions raised on "
            f"{int(raised.sum())} of {len(rows)} samples ({counts}), more than reward.max_error_rate="
            f"{self.max_error_rate}{form_hint(first)}"
        )
        err = RewardError(message.replace("\n", " "), failure_traceback(first))
        err.__cause__ = first.error
        return err


__all__ = [
    "REWARD_FUNCTIONS", "REWARD_INPUTS", "RewardBatch", "RewardComposer", "RewardError", "format_match",
    "length_penalty", "overlong_shaping", "resolve_reward_function", "think_answer", "verifier",
]
