"""The built-in reward functions, their table, and the check of a configured name and params
against the function it names (run when the config is validated, and again when a composer is
built): what `reward.functions` may hold. Composing them on a batch is reinforge.rewards.compose.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from reinforge.errors import ConfigError
from reinforge.objectives.common import check_params, resolve
from reinforge.rewards.conventions import (
    SAMPLE_INPUTS,
    TRL_INPUTS,
    VERL_INPUTS,
    RewardForm,
    import_user_function,
    reward_form,
)
from reinforge.tasks.base import Example, Task

# The keywords a per-sample reward function may receive besides the example's meta fields and its params.
REWARD_INPUTS = SAMPLE_INPUTS
# What each convention's caller passes itself: a param of the same name would be shadowed.
FORM_INPUTS: dict[RewardForm, tuple[str, ...]] = {"sample": SAMPLE_INPUTS, "trl": TRL_INPUTS, "verl": VERL_INPUTS}


def verifier(*, completion: str, example: Example, task: Task) -> float:
    """The task's own verifier (1.0 correct, 0.0 otherwise): the reward before composition existed."""
    return task.reward(example, completion)


def format_match(*, completion: str, pattern: str, mode: str = "search") -> float:
    """1.0 if the regex `pattern` matches the completion (re.search, or re.fullmatch for mode='fullmatch'), else 0.0.

    The generic format reward of TRL / open-r1 (`format_reward`); DOTALL, so '.' spans lines.
    """
    if mode not in ("search", "fullmatch"):
        raise ValueError(f"format mode must be 'search' or 'fullmatch', got {mode!r}")
    match = re.search if mode == "search" else re.fullmatch
    return 1.0 if match(pattern, completion, flags=re.DOTALL) else 0.0


# One <think> block, then one <answer> block, nothing else but whitespace around them; neither body
# may hold another think/answer tag (so "<think>a</think>b</think><answer>..." does not pass).
_BODY = r"(?:(?!</?think>|</?answer>).)*"
_THINK_ANSWER = re.compile(rf"\s*<think>{_BODY}</think>\s*<answer>{_BODY}</answer>\s*", re.DOTALL)


def think_answer(*, completion: str, think_prefilled: bool = False) -> float:
    """DeepSeek-R1 format reward (arXiv 2501.12948, sec. 2.2.2): 1.0 for '<think>...</think>
    <answer>...</answer>' and nothing else, 0.0 otherwise.

    think_prefilled: the prompt already ends with '<think>' (R1-Zero's template), so the
    completion starts inside the think block.
    """
    return 1.0 if _THINK_ANSWER.fullmatch(("<think>" if think_prefilled else "") + completion) else 0.0


def length_penalty(*, length: int, target: int, coef: float = 1.0) -> float:
    """-coef * max(0, |y| - target) / target: 0 up to `target` tokens, then linear, -coef at 2 x target.

    A one-sided, target-normalised form of L1's length term (LCPO, arXiv 2503.04697, eq. 1:
    -alpha |n_gold - n_y|); one-sided so short completions are never punished (choice).
    """
    if target <= 0:
        raise ValueError(f"length_penalty target must be > 0, got {target!r}")
    return -coef * max(0, length - target) / target


REWARD_FUNCTIONS: dict[str, Callable[..., float | None]] = {
    "verifier": verifier,
    "format": format_match,
    "think_answer": think_answer,
    "length_penalty": length_penalty,
}


def resolve_reward_function(name: str, params: Mapping[str, Any]) -> Callable[..., Any]:
    """The function named `name` (built-in or 'module:function'), after checking it and `params` against it.

    Raises ValueError for an unknown name, a signature that fits none of the three conventions
    (the message shows them), a parameter the function does not take, a parameter that shadows
    an input of its convention, or a built-in's missing required parameter.
    """
    from reinforge.tasks.dataset import VERIFIERS

    if name in VERIFIERS and name not in REWARD_FUNCTIONS:    # "math" is a verifier; people reach for it as a reward
        raise ValueError(f"'{name}' is a verifier, not a reward function: the reward function 'verifier' scores with "
                         f"the task's verifier, set with task.options.verifier={name} (task.name=dataset)")
    if Path(name).is_dir() and (Path(name) / "config.json").exists():   # TRL's reward_funcs takes a model folder
        raise ValueError(f"'{name}' is a model folder, not a reward function: a reward model is a reward source, "
                         f"reward.model.path={name} (with reward.functions=[] to make it the whole reward)")
    fn = import_user_function(name) or resolve(REWARD_FUNCTIONS, name, "reward function")
    kind = f"reward function {name!r}"
    form = reward_form(fn, kind)
    inputs = FORM_INPUTS[form]
    for key in params:
        if key in inputs:
            raise ValueError(f"{kind}: parameter {key!r} is an input the composer passes itself ({', '.join(inputs)})")
    check_params(fn, params, kind, reserved=inputs)
    if name in REWARD_FUNCTIONS:   # a user function's required keywords may be meta fields, unknown here
        for p in inspect.signature(fn).parameters.values():
            if p.default is inspect.Parameter.empty and p.name not in REWARD_INPUTS and p.name not in params:
                raise ValueError(f"{kind} needs parameter {p.name!r}, e.g. params: {{{p.name}: ...}}")
    return fn


def check_reward_section(reward: Any, resolve: bool = True) -> Any:
    """`reward` (the RewardConfig) once each of its functions resolves (ValueError with a suggestion for an
    unknown name or parameter; not with `resolve` False: `reinforge export` of a run whose reward was a
    notebook function computes no reward) and something scores (ConfigError)."""
    from reinforge.rewards.source_builders import configured_sources

    for f in reward.functions if resolve else []:
        resolve_reward_function(f.name, f.params)
    if not reward.functions and not configured_sources(reward):
        raise ConfigError("reward.functions is empty and no reward source is set: give a reward function "
                          "(reward.functions=[verifier]) or a reward model (reward.model.path=DIR)")
    return reward


def check_reward_domains(functions: Sequence[Any], domains: Sequence[str], has_source: bool) -> None:
    """ConfigError for a function restricted to a domain the run does not have (`domains`: the task's,
    a mix's names), and for a domain no function scores (unless a reward source scores every row):
    its rows would have no reward at all. `functions`: reward.functions (RewardFunctionConfig)."""
    for i, f in enumerate(functions):
        if f.domains is None:
            continue
        key = f"reward.functions[{i}].domains"
        if not f.domains:
            raise ConfigError(f"{key} is empty: list the domains '{f.name}' scores, or drop the key to score every row")
        for d in f.domains:
            if d not in domains:
                close = difflib.get_close_matches(d, domains, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise ConfigError(f"{key}: '{d}' is not a domain of this run; {hint}its domains: {', '.join(domains)} "
                                  "(a mix's are named in task.options.domains)")
    if has_source or not functions:
        return
    for d in domains:
        if not any(f.domains is None or d in f.domains for f in functions):
            raise ConfigError(f"domain '{d}' has no reward function (each of reward.functions lists other domains): "
                              f"add it to one's domains, or add a function without domains, e.g. {{name: verifier}}")
