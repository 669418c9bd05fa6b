"""One configured reward function (`Term`) called on a batch's rows in its convention: the inputs each
convention receives (`sample_inputs`, `verl_inputs`, `trl_inputs`), the call (`call_term`: values,
the rows it raised on, verl's extra keys), what went wrong (`Failure`) and the hints that explain it.
The composer (reinforge.rewards.compose) sums the terms' values; the conventions themselves
(signatures, converting results) are reinforge.rewards.conventions.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from reinforge.data.chat import Conversation
from reinforge.rewards.conventions import (
    TRL_INPUTS,
    VERL_INPUTS,
    RewardForm,
    call_all,
    keywords,
    run_trl,
    sample_value,
    trl_values,
    verl_extras,
    verl_value,
)
from reinforge.rollout.base import Rollout
from reinforge.tasks.base import Example, Task


@dataclass(frozen=True)
class Term:
    key: str                     # name in parts and metrics: the function part of the name, made unique
    label: str                   # the configured name as a dotted path, for messages: "my_mod.f"
    fn: Callable[..., Any]
    form: RewardForm             # the calling convention (reinforge.rewards.conventions)
    weight: float
    params: dict[str, Any]
    accepts: set[str] | None     # keywords the function declares; None if it takes **kwargs
    domains: frozenset[str] | None = None   # the domains it scores (reward.functions[].domains); None: all


@dataclass
class Failure:
    term: Term
    row: int | None              # None: a batched call failed as a whole
    error: BaseException


def call_term(
    t: Term, rows: list[Example], rollout: Rollout, index: list[int], task: Task
) -> tuple[list[float | None], dict[int, BaseException], dict[tuple[str, int], float]]:
    """Term `t` on the rows `index`: their values in that order (None: declined), the rows it raised
    on, and the numeric extra keys of verl dict results, by (name, row)."""
    if not index:
        return [], {}, {}
    if t.form == "trl":
        try:
            inputs = trl_inputs(t, rows, rollout, index)
            return trl_values(run_trl(t.fn, keywords(t.accepts, inputs)), len(index)), {}, {}
        except Exception as err:     # the batch call failed as a whole: every row is lost
            return [None] * len(index), dict.fromkeys(index, err), {}
    facts = row_facts(rollout)
    inputs = [
        sample_inputs(rows[r], rollout, r, task, facts) if t.form == "sample" else verl_inputs(rows[r], rollout, r)
        for r in index
    ]
    results = call_all(t.fn, [keywords(t.accepts, {**kw, **t.params}) for kw in inputs])
    convert = sample_value if t.form == "sample" else verl_value
    values: list[float | None] = []
    failed: dict[int, BaseException] = {}
    extras: dict[tuple[str, int], float] = {}
    for r, result in zip(index, results, strict=True):
        if isinstance(result, BaseException):      # raised inside the function: its own traceback
            failed[r] = result
            values.append(None)
            continue
        try:
            values.append(convert(result))
        except Exception as err:                    # returned something that is not a reward
            failed[r] = err
            values.append(None)
            continue
        if t.form == "verl":
            extras.update({(name, r): value for name, value in verl_extras(result).items()})
    return values, failed, extras


def scores_nothing(t: Term, examples: list[Example], rollout: Rollout, index: list[int], task: Task) -> bool:
    """Whether per-sample function `t`, which declined every probe sample, declines their gold answers
    too (given as the completion): a function that never returns a number (a forgotten `return`),
    told apart from one that declines the untrained model's unreadable samples."""
    golden = [r for r in index if examples[r].answer]
    if not golden:
        return False
    facts = row_facts(rollout)
    inputs = [{**sample_inputs(examples[r], rollout, r, task, facts), "completion": str(examples[r].answer)}
              for r in golden]
    results = call_all(t.fn, [keywords(t.accepts, {**kw, **t.params}) for kw in inputs])
    return all(result is None for result in results)


def row_facts(rollout: Rollout) -> tuple[list[int], list[bool]]:
    """Every row's length (the model's tokens) and truncation as Python values: read once per call, not
    once per row (a row's tensor lookups were ~4 small ops each, 256 a step at 64 rows)."""
    return rollout.lengths.long().tolist(), rollout.truncated.tolist()


def sample_inputs(example: Example, rollout: Rollout, r: int, task: Task,
                  facts: tuple[list[int], list[bool]] | None = None) -> dict[str, Any]:
    """The per-sample form's inputs for row `r` (of `example`); `facts`: `row_facts(rollout)`, when the
    caller has them."""
    lengths, truncated = facts or row_facts(rollout)
    return {**example.meta, "prompt": example.prompt, "completion": rollout.texts[r], "answer": example.answer,
            "length": lengths[r], "truncated": truncated[r], "example": example, "task": task}


def verl_inputs(example: Example, rollout: Rollout, r: int) -> dict[str, Any]:
    """verl's `compute_score` inputs for row `r` (of `example`)."""
    reward_model = example.meta.get("reward_model")
    ground_truth = (
        reward_model["ground_truth"]
        if isinstance(reward_model, Mapping) and "ground_truth" in reward_model
        else example.answer
    )
    return {"data_source": example.meta.get("data_source"), "solution_str": rollout.texts[r],
            "ground_truth": ground_truth, "extra_info": example.meta.get("extra_info")}


def trl_inputs(t: Term, rows: list[Example], rollout: Rollout, index: list[int]) -> dict[str, Any]:
    """TRL's batched inputs of the rows `index` (all rows, unless the function is restricted to domains)."""
    mask = rollout.completion_mask > 0      # every token of the completion, as in its text
    batch = [rows[r] for r in index]
    columns = dict.fromkeys(k for e in batch for k in e.meta)      # every column of the batch, in first-seen order
    chat = [isinstance(e.prompt, Conversation) for e in batch]
    return {
        **{k: [e.meta.get(k) for e in batch] for k in columns},
        "answer": [e.answer for e in batch],
        "prompts": [e.prompt.as_list() if c else str(e.prompt) for e, c in zip(batch, chat, strict=True)],
        "completions": [[{"role": "assistant", "content": rollout.texts[r]}] if c else rollout.texts[r]
                        for r, c in zip(index, chat, strict=True)],
        "completion_ids": [rollout.completion_ids[r][mask[r]].tolist() for r in index],
        **t.params,
    }


def failure_traceback(failure: Failure) -> str:
    """The failure's full traceback, headed by the function and the row it came from."""
    where = "a batch call" if failure.row is None else f"row {failure.row}"
    text = "".join(traceback.format_exception(type(failure.error), failure.error, failure.error.__traceback__))
    return f"reward function {failure.term.key!r} on {where}:\n{text}"


def return_hint(t: Term) -> str:
    """What the function's convention must return."""
    return {"trl": ": return a list of floats, one per completion (None where it does not apply)",
            "verl": ": return a float, or a dict with a float 'score'",
            "sample": ": return a float (None to leave the sample unscored)"}[t.form]


def form_hint(failure: Failure) -> str:
    """When a function that takes only **kwargs (called per sample) looked up another form's input
    (kwargs["completions"]), the form it was called in, and how to get the one it expects."""
    key = failure.error.args[0] if isinstance(failure.error, KeyError) and failure.error.args else None
    if failure.term.form != "sample" or key not in (*TRL_INPUTS, *VERL_INPUTS):
        return ""
    form, params = ("TRL's batched form", "completions, **kwargs") if key in TRL_INPUTS else \
        ("verl's form", "data_source, solution_str, ground_truth, extra_info=None")
    return (f"; a function of only **kwargs is called once per sample with completion, prompt, answer and the row's "
            f"fields: to be called in {form}, name its parameters ({params})")
