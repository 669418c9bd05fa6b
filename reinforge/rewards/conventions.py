"""The three calling conventions a reward function may follow, told apart by its signature.

Users bring reward functions written for other frameworks; each is called the
way it was written to be called, decided once, at config-check time (before
any model loads), from the parameter names:

* per-sample (reinforge): `f(prompt, completion, answer, **row) -> float | None`,
  called once per completion with the keywords it declares (see
  `reinforge.rewards.compose`). Recognised by declaring one of `SAMPLE_INPUTS`
  (or only **kwargs). None: do not score this sample (no gradient).
* TRL batched: `f(prompts, completions, **kwargs) -> list[float | None]`,
  called once per batch, as TRL's GRPOTrainer calls it: `prompts` and
  `completions` are lists (for a conversational prompt, `prompts[i]` is its
  list of messages and `completions[i]` is `[{"role": "assistant", "content": ...}]`),
  `completion_ids` the sampled token ids (eos included, as a list per row),
  `answer` and every other dataset column a list with one entry per
  completion, and the config's params as given. TRL's `trainer_state` is not
  passed (there is no transformers Trainer). Recognised by `prompts` or
  `completions`. A None entry means "not applicable" and, as in TRL, is left
  out of the weighted sum (TRL's nansum over functions); a row on which every
  function returns None is skipped (TRL would train it on a reward of 0).
* verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None)
  -> float | dict`, called once per completion with keywords as verl's reward
  manager does: `data_source` and `extra_info` are the row's columns of those
  names (None when absent), `ground_truth` is the row's
  `reward_model.ground_truth` when it has one, else its answer; params go in
  as verl's `reward_kwargs`. A dict result gives its "score" (verl's rule).
  Recognised by `solution_str`, or `data_source` with `ground_truth`.

`async def` functions are awaited: per-sample and verl ones for all rows of a
batch at once (asyncio.gather), TRL ones once per batch.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

RewardForm = Literal["sample", "trl", "verl"]

# Keywords of the per-sample form besides the example's meta fields and the function's params.
SAMPLE_INPUTS = ("prompt", "completion", "answer", "length", "truncated", "example", "task")
TRL_INPUTS = ("prompts", "completions", "completion_ids")
VERL_INPUTS = ("data_source", "solution_str", "ground_truth", "extra_info")

FORMS_HELP = (
    "per-sample f(prompt, completion, answer, **row) -> float | None; "
    "TRL batched f(prompts, completions, **kwargs) -> list[float | None]; "
    "verl compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict with 'score'"
)


def import_user_function(name: str, kind: str = "reward function") -> Callable[..., Any] | None:
    """The function of a 'path/to/file.py:function' name (verl's custom_reward_function.path form),
    or of a 'module:function' whose module lies in the working directory; None for any other name
    (the registry's resolver handles those, and its errors). `kind` names what is imported in the
    errors (reward functions, tools)."""
    module_name, sep, attr = name.rpartition(":")
    if not sep or not module_name:
        return None
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"{kind} {name!r}: file '{module_name}' does not exist")
        module = module_from_file(path, f"{kind.removesuffix(' function')} file")   # 'reward file', 'tool file'
    else:
        # `reinforge` is a console script: unlike `python -m`, it does not put the working directory on
        # sys.path, so my_rewards.py next to the user's data would not import.
        root = module_name.split(".")[0]
        if importlib.util.find_spec(root) is not None or not (Path.cwd() / f"{root}.py").is_file() \
                and not (Path.cwd() / root / "__init__.py").is_file():
            return None
        sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__
                         and not k.startswith("_"))
        close = difflib.get_close_matches(attr, defined, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ValueError(f"{kind} {name!r}: '{module_name}' has no function '{attr}'{hint} "
                         f"(its functions: {', '.join(defined) or 'none'})")
    return fn


def module_from_file(path: Path, label: str = "reward file") -> Any:
    """The module of a file, loaded once per process (the composer resolves names again after the config check).
    A file that fails to load is one ValueError line starting with `label` and the path."""
    key = f"reinforge_user_rewards_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if key not in sys.modules:
        # As `python file.py` would: the file's folder is importable, so `from my_utils import ...` next to it works
        # (kept on sys.path: a function may import lazily, at its first call).
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # the user's file: one line naming it and where it failed
            del sys.modules[key]
            what = err.msg if isinstance(err, SyntaxError) else err  # its str() repeats the file and line
            raise ValueError(
                f"{label} '{path}' failed to load: {_where(err, path)}{type(err).__name__}: {what}"
            ) from None
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]


def _where(err: Exception, path: Path) -> str:
    """'line N: ' of the user's file where `err` was raised (a SyntaxError carries its own line)."""
    if isinstance(err, SyntaxError) and err.lineno is not None:
        return f"line {err.lineno}: "
    lines = [f.lineno for f in traceback.extract_tb(err.__traceback__) if Path(f.filename) == path]
    return f"line {lines[-1]}: " if lines else ""


def reward_form(fn: Callable[..., Any], kind: str) -> RewardForm:
    """The convention `fn` follows, from its parameter names; ValueError naming the three forms when none fits."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as err:   # a builtin or extension callable without a readable signature
        raise ValueError(f"{kind}: cannot read its signature ({err}); accepted forms: {FORMS_HELP}") from None
    positional_only = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_ONLY
                       and p.default is inspect.Parameter.empty]
    if positional_only:
        raise ValueError(f"{kind} takes positional-only parameters ({', '.join(positional_only)}): reward functions "
                         f"are called with keywords; accepted forms: {FORMS_HELP}")
    names = {
        p.name for p in parameters if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    forms = []
    if "solution_str" in names or {"data_source", "ground_truth"} <= names:
        forms.append("verl")
    if names & {"prompts", "completions"}:
        forms.append("trl")
    # prompt and answer are also TRL column names (TRL passes `answer=[...]`): only these mark the per-sample form
    # next to another form's names.
    if names & (set(SAMPLE_INPUTS) - {"prompt", "answer"}) or (not forms and (names & set(SAMPLE_INPUTS)
                                                                                or (not names and var_keyword))):
        forms.append("sample")
    if len(forms) == 1:
        return forms[0]
    shown = ", ".join(sorted(names)) + (", **kwargs" if var_keyword else "")
    if not forms:
        raise ValueError(f"{kind} ({shown}) fits none of the accepted forms: {FORMS_HELP}")
    raise ValueError(f"{kind} ({shown}) mixes the parameters of several forms ({' and '.join(forms)}): "
                     f"use the names of one; accepted forms: {FORMS_HELP}")


def unfilled_parameters(fn: Callable[..., Any], form: RewardForm, given: set[str]) -> list[str]:
    """The required parameters of `fn` that nothing passes: not an input of its form, nor in `given`
    (its params and, for the per-sample and TRL forms, the data's columns)."""
    passed = set(given) | set({"sample": SAMPLE_INPUTS, "trl": (*TRL_INPUTS, "answer"), "verl": VERL_INPUTS}[form])
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in keyword and p.default is inspect.Parameter.empty and p.name not in passed]


def keywords(accepts: set[str] | None, available: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of `available` the function declares (all of it if it takes **kwargs)."""
    return dict(available) if accepts is None else {k: v for k, v in available.items() if k in accepts}


def call_all(fn: Callable[..., Any], calls: Sequence[dict[str, Any]]) -> list[Any | BaseException]:
    """fn(**kw) for each kw; an exception becomes the entry instead of propagating. Coroutine
    functions run concurrently in one event loop."""
    if inspect.iscoroutinefunction(fn):
        async def gather() -> list[Any]:
            return await asyncio.gather(*(fn(**kw) for kw in calls), return_exceptions=True)

        return list(asyncio.run(gather()))
    out: list[Any | BaseException] = []
    for kw in calls:
        try:
            out.append(fn(**kw))
        except Exception as err:     # counted per row by the composer; KeyboardInterrupt still stops the run
            out.append(err)
    return out


class NotARewardError(ValueError):
    """A reward function returned something that is not a reward (a str, a list of the wrong length,
    a dict without 'score'): a bug in the function, never in one sample, so the run stops on it."""


def _shown(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(value: Any, what: str) -> float:
    """`value` as a float; NotARewardError naming its type for anything that is not a number. A string
    ("1.0", "good") is refused as TRL refuses it, never parsed: a function that returns text has a bug."""
    if isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        raise NotARewardError(f"{what} a {type(value).__name__} ({_shown(value)}), expected a float")
    try:
        out = float(value)
    except (TypeError, ValueError) as err:     # a tensor of several values, an object whose __float__ fails
        raise NotARewardError(f"{what} a {type(value).__name__} ({_shown(value)}) that is not one float: "
                              f"{err}") from None
    if math.isinf(out):
        raise ValueError(f"reward is not finite: {out}")
    return out


def sample_value(value: Any) -> float | None:
    """A per-sample result as a float (None stays None); ValueError for anything that is not a finite number."""
    if value is None:
        return None
    out = _number(value, "returned")
    if not math.isfinite(out):
        raise ValueError(f"reward is not finite: {out}")
    return out


def verl_value(value: Any) -> float | None:
    """verl's rule: a dict result's reward is its 'score' (the other keys are extra info verl logs,
    `verl_extras`); None is not a reward in verl, so it is refused rather than read as "do not score"."""
    if value is None:      # verl has no "do not score": its reward manager fails on it
        raise NotARewardError("returned None, expected a float or a dict with a 'score'")
    if isinstance(value, Mapping):
        if "score" not in value:
            raise NotARewardError(f"returned a dict without a 'score' key (keys: {', '.join(map(str, value))})")
        value = value["score"]
    return sample_value(value)


def verl_extras(value: Any) -> dict[str, float]:
    """The numeric extra keys of a verl dict result (`acc`, `pred` when numeric): verl logs them, so do we."""
    if not isinstance(value, Mapping):
        return {}
    out = {}
    for key, extra in value.items():
        if key == "score" or isinstance(extra, str | bytes) or not hasattr(extra, "__float__"):
            continue
        try:
            out[str(key)] = float(extra)
        except (TypeError, ValueError):
            continue
    return out


def trl_values(result: Any, n: int) -> list[float | None]:
    """A TRL batched result as n values: None (and NaN, which is what TRL turns None into) is
    "not applicable"; NotARewardError for a result that is not a list of n numbers, ValueError for
    an infinite value."""
    if isinstance(result, str | bytes | Mapping) or not hasattr(result, "__len__"):
        raise NotARewardError(f"returned {'None' if result is None else 'a ' + type(result).__name__}, expected a "
                              f"list of {n} floats (one per completion)")
    values = list(result)
    if len(values) != n:
        raise NotARewardError(f"returned {len(values)} values for {n} completions, expected one per completion")
    out: list[float | None] = []
    for i, v in enumerate(values):
        f = None if v is None else _number(v, f"returned a list holding at {i}")
        out.append(None if f is None or math.isnan(f) else f)
    return out


def run_trl(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """One batched call, awaited if `fn` is a coroutine function."""
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(**kwargs))
    return fn(**kwargs)


__all__ = [
    "unfilled_parameters",
    "FORMS_HELP",
    "import_user_function",
    "module_from_file",
    "SAMPLE_INPUTS", "TRL_INPUTS", "VERL_INPUTS", "RewardForm", "call_all", "keywords", "reward_form", "run_trl",
    "sample_value", "trl_values", "verl_value", "verl_extras", "NotARewardError",
]
