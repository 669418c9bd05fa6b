"""Environments: the protocol of multi-turn RL for everything that is not a tool call (games,
simulated users, multi-step tasks), and the episode that plays one trajectory against one.

An environment is a plain class, named with `task.environment=module:Class` (or
`path/to/file.py:Class`), that needs nothing from reinforge:

    class MyEnv:
        def reset(self, row: dict) -> list[dict]: ...          # the opening messages for this dataset row
        def step(self, text: str) -> tuple[list[dict], float, bool]: ...   # reply messages, this turn's reward, done

It is constructed with no arguments, one instance per trajectory. This module owns checking such
a class when it is named (`load_environment`, before any model loads), driving one trajectory
against an instance (`Episode.run`, with the caller's generate and encode callables, so it holds
no tokenizer or engine), and the metrics of a batch of episodes (`EpisodeStats`). Whatever the
user's class does wrong at run time (raising, returning the wrong types) ends that episode with
the error recorded and no gradient from it; it never stops the run. The multi-turn rollout that
calls `Episode.run` for a batch, and training on its trajectories, are not built yet.
"""

from __future__ import annotations

import inspect
import math
import reprlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch

from reinforge.errors import ConfigError
from reinforge.objectives.common import resolve, unknown_name_error
from reinforge.rewards.conventions import import_user_function, module_from_file
from reinforge.rollout.trajectory import Segment, Trajectory

KEY = "task.environment"
PROTOCOL = "reset(self, row: dict) -> list[dict] and step(self, text: str) -> tuple[list[dict], float, bool]"

StopReason = Literal["done", "max_turns", "max_model_tokens", "max_environment_tokens", "error", "model_truncated"]
STOP_REASONS: tuple[StopReason, ...] = (
    "done",                    # step returned done=True
    "max_turns",               # the model had its max_turns turns and the environment was not done
    "max_model_tokens",        # the model's tokens reached the trajectory's budget (the last turn cut to fit)
    "max_environment_tokens",  # the next reply would have passed the environment's budget (it is left out)
    "error",                   # the class raised, or returned something outside the protocol (see `error`)
    "model_truncated",         # the model's turn hit the generator's per-turn limit without a stop
)
RewardMode = Literal["trajectory", "turn"]
Message = dict[str, Any]


# ----------------------------------------------------------------------------------------------------------------
# Naming a class: checked at load time, before anything runs
# ----------------------------------------------------------------------------------------------------------------


def load_environment(name: str) -> type:
    """The class named by `name` ('module:Class' or 'path/to/file.py:Class'), checked against the protocol:
    a class, constructible with no arguments, with callable `reset(row)` and `step(text)`. ConfigError (one
    line naming task.environment, the class and what to change) for anything else. Nothing is constructed."""
    found = _import(name)
    where = f"{KEY}={name!r}"
    if not inspect.isclass(found):
        raise ConfigError(f"{where} is not a class (its type is {type(found).__name__}): name a class with {PROTOCOL}")
    required = _required_parameters(found)
    if required:
        raise ConfigError(
            f"{where}: {found.__name__}() requires {', '.join(required)}, but an environment is constructed with "
            "no arguments (one instance per trajectory): give each a default, or read per-row values from the row "
            "reset(row) receives")
    for method, argument in (("reset", "row"), ("step", "text")):
        problem = _method_problem(found, method)
        if problem:
            raise ConfigError(f"{where}: {found.__name__}.{method} {problem}; the protocol calls {method}({argument}) "
                              f"with one argument: {PROTOCOL}")
    return found


def _import(name: str) -> object:
    """What `name` names, through the importer reward functions use (a file is loaded once per process)."""
    module_name, _, attr = name.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"{KEY}={name!r} is not 'module:Class' or 'path/to/file.py:Class': "
                          "name the module or file, a colon, and the class")
    if module_name.endswith(".py") and not Path(module_name).expanduser().is_file():
        raise ConfigError(f"{KEY}={name!r}: file '{module_name}' does not exist (relative paths start at the "
                          f"working directory, {Path.cwd()})")
    try:
        if module_name.endswith(".py"):
            module = module_from_file(Path(module_name).expanduser().resolve(), "environment file")
            return getattr(module, attr) if hasattr(module, attr) else _missing(name, module, attr)
        return import_user_function(name) or resolve({}, name, "environment")
    except ConfigError:
        raise
    except ValueError as err:  # the importer's one-line reasons: no such module, no such name, a file that fails
        module = sys.modules.get(module_name)
        if module is None:
            reason = str(err.__cause__ or err)   # resolve() wraps the ImportError
            raise ConfigError(f"{KEY}={name!r} cannot be imported: {reason} (name a module on the Python path or in "
                              "the working directory, or a file as 'path/to/file.py:Class')") from None
        return getattr(module, attr) if hasattr(module, attr) else _missing(name, module, attr)
    except Exception as err:  # the user's module raised while importing
        raise ConfigError(f"{KEY}={name!r}: importing '{module_name}' raised {type(err).__name__}: {err}") from None


def _missing(name: str, module: Any, attr: str) -> NoReturn:
    classes = [k for k, v in vars(module).items()
               if inspect.isclass(v) and v.__module__ == module.__name__ and not k.startswith("_")]
    module_name = name.rpartition(":")[0]
    if not classes:
        raise ConfigError(f"{KEY}={name!r}: '{module_name}' defines no class; write one with {PROTOCOL}")
    raise ConfigError(f"{KEY}={name!r}: in '{module_name}', {unknown_name_error('class', attr, classes)}")


def _required_parameters(cls: type) -> list[str]:
    """The parameters `cls()` would be missing."""
    try:
        parameters = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # a class on a builtin base without a readable signature: nothing to check
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in parameters if p.default is inspect.Parameter.empty and p.kind not in variadic]


def _method_problem(cls: type, method: str) -> str | None:
    """Why `cls().<method>(x)` cannot be called as the protocol calls it; None if it can."""
    attribute = getattr(cls, method, None)
    if attribute is None:
        return "is missing"
    if not callable(attribute):
        return f"is a {type(attribute).__name__}, not a method"
    if inspect.iscoroutinefunction(attribute):
        return "is async; the protocol's methods are plain functions"
    try:
        signature = inspect.signature(attribute)
    except (TypeError, ValueError):  # a builtin without a readable signature: its call will tell
        return None
    # A plain function on the class is bound to the instance (self first); a static or class method is not.
    bound = (None, None) if inspect.isfunction(inspect.getattr_static(cls, method, None)) else (None,)
    try:
        signature.bind(*bound)
    except TypeError:
        return f"takes {signature}"
    return None


# ----------------------------------------------------------------------------------------------------------------
# One episode: reset, then model turn / environment reply until done or a limit
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GeneratedTurn:
    """What the caller's `generate` returns for one model turn."""

    text: str                        # the decoded turn, as `step` receives it
    token_ids: torch.Tensor          # [L] long, L >= 1: the sampled tokens (the end-of-turn token included)
    sampler_logprobs: torch.Tensor   # [L] float: log-prob of each token under the distribution it was drawn from
    version: int                     # the policy version that sampled the turn
    truncated: bool                  # the turn hit the generator's per-turn token limit without a stop


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-trajectory limits; the per-turn token limit is the generator's (`GeneratedTurn.truncated`).
    None: no limit. Tool-call limits belong to the tools (reinforge.agents.tools), not to environments."""

    max_turns: int = 8                          # model turns
    max_model_tokens: int | None = None         # the model's tokens, all turns together (the last turn is cut)
    max_environment_tokens: int | None = None   # reply tokens, all turns together (a reply that would pass it ends)

    def __post_init__(self) -> None:
        for key, least in (("max_turns", 1), ("max_model_tokens", 1), ("max_environment_tokens", 0)):
            value = getattr(self, key)
            if (value is not None or key == "max_turns") and (not isinstance(value, int) or value < least):
                raise ValueError(f"episode limit {key} must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True)
class EpisodeResult:
    """One played trajectory, with what the environment said about it."""

    trajectory: Trajectory           # prompt_ids = the opening messages encoded; segments model/environment alternating
    messages: tuple[Message, ...]    # the conversation: opening, each model turn's text (whole), each reply
    turn_rewards: tuple[float, ...]  # step's reward for each turn it scored (a turn cut or truncated has none)
    reward_mode: RewardMode          # 'trajectory': their sum on the last model token; 'turn': each on its turn's last
    turns: int                       # model turns generated
    stop_reason: StopReason
    error: str | None                # 'step raised KeyError: ...', 'reset returned ...': set iff stop_reason == 'error'

    @property
    def reward(self) -> float:
        """The trajectory's return: the sum of its turn rewards (both modes)."""
        return float(sum(self.turn_rewards))

    @property
    def trainable(self) -> bool:
        """False when the environment failed: no gradient from a trajectory its environment did not finish."""
        return self.error is None

    @property
    def model_tokens(self) -> int:
        return self.trajectory.model_tokens

    @property
    def environment_tokens(self) -> int:
        return self.trajectory.environment_tokens

    def token_rewards(self) -> torch.Tensor:
        """[L] float over `trajectory.tokens()`: zero except at the last token of model turns, which carries the
        return ('trajectory' mode, last turn only) or that turn's reward ('turn' mode)."""
        out = torch.zeros(self.model_tokens + self.environment_tokens)
        ends, at = [], 0
        for s in self.trajectory.segments:
            at += len(s.token_ids)
            if s.trained:
                ends.append(at - 1)
        if ends and self.reward_mode == "trajectory":
            out[ends[-1]] = self.reward
        elif self.reward_mode == "turn":
            for end, reward in zip(ends, self.turn_rewards, strict=False):  # a last turn never scored has no reward
                out[end] = reward
        return out


Generate = Callable[[list[Message]], GeneratedTurn]
Encode = Callable[[list[Message], list[Message]], torch.Tensor]
EncodePrompt = Callable[[list[Message]], Sequence[int]]


class _Failed(Exception):
    """The user's class raised, or returned something outside the protocol: the episode ends with it recorded."""


@dataclass
class _Play:
    """The state of one episode as it is played."""

    group: int
    prompt_ids: tuple[int, ...] = ()
    messages: list[Message] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    model_tokens: int = 0
    environment_tokens: int = 0

    def result(self, stop_reason: StopReason, error: str | None, reward_mode: RewardMode) -> EpisodeResult:
        trajectory = Trajectory(prompt_ids=self.prompt_ids, segments=tuple(self.segments), group=self.group,
                                truncated=stop_reason not in ("done", "error"))
        return EpisodeResult(trajectory=trajectory, messages=tuple(self.messages), turn_rewards=tuple(self.rewards),
                             reward_mode=reward_mode, turns=self.turns, stop_reason=stop_reason, error=error)


@dataclass(frozen=True)
class Episode:
    """Plays trajectories against environments with the caller's model and chat template.

    `generate(messages)` samples the model's next turn for the conversation so far. `encode(before, after)`
    gives the tokens that follow the model's turn when the environment's reply extends the conversation
    from `before` to `after`: the chat template's rendering of the reply messages and of the next turn's
    generation prompt, i.e. render(after)[len(render(before)):]. `encode_prompt(messages)` renders the
    opening messages with the generation prompt.
    """

    generate: Generate
    encode: Encode
    encode_prompt: EncodePrompt
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    reward_mode: RewardMode = "trajectory"

    def __post_init__(self) -> None:
        if self.reward_mode not in ("trajectory", "turn"):
            raise ValueError(f"reward_mode must be 'trajectory' or 'turn', got {self.reward_mode!r}")

    def run(self, environment: type | object, row: Mapping[str, Any], group: int = 0) -> EpisodeResult:
        """One trajectory for dataset `row` against `environment`: a class (constructed here with no arguments)
        or a fresh instance of one. `group` is the row's index in the batch (`Trajectory.group`)."""
        play = _Play(group=group)
        try:
            stop = self._play(environment, dict(row), play)
        except _Failed as failure:
            return play.result("error", str(failure), self.reward_mode)
        return play.result(stop, None, self.reward_mode)

    def _play(self, environment: type | object, row: dict[str, Any], play: _Play) -> StopReason:
        if inspect.isclass(environment):
            environment = _user_call(f"{environment.__name__}()", environment)
        play.messages = _checked_messages("reset", _user_call("reset", environment.reset, row), opening=True)
        play.prompt_ids = tuple(int(t) for t in self.encode_prompt(list(play.messages)))
        limits = self.limits
        while True:
            turn = self.generate(list(play.messages))
            if turn.token_ids.dim() != 1 or len(turn.token_ids) == 0:
                raise ValueError(f"generate returned token_ids of shape {tuple(turn.token_ids.shape)}: "
                                 "a turn is [L] with L >= 1")
            play.turns += 1
            play.messages.append({"role": "assistant", "content": turn.text})
            room = None if limits.max_model_tokens is None else limits.max_model_tokens - play.model_tokens
            keep = len(turn.token_ids) if room is None else min(room, len(turn.token_ids))
            play.segments.append(Segment.sampled(turn.token_ids[:keep], turn.sampler_logprobs[:keep], turn.version))
            play.model_tokens += keep
            if keep < len(turn.token_ids):
                return "max_model_tokens"   # the turn was cut: its text is not what step would judge
            if turn.truncated:
                return "model_truncated"
            reply, reward, done = _checked_step(_user_call("step", environment.step, turn.text))
            play.rewards.append(reward)
            before = list(play.messages)
            play.messages.extend(reply)
            if done:
                return "done"
            if play.turns >= limits.max_turns:
                return "max_turns"
            if room is not None and play.model_tokens >= limits.max_model_tokens:
                return "max_model_tokens"
            reply_ids = torch.as_tensor(self.encode(before, list(play.messages)), dtype=torch.long)
            if limits.max_environment_tokens is not None \
                    and play.environment_tokens + len(reply_ids) > limits.max_environment_tokens:
                return "max_environment_tokens"
            play.segments.append(Segment.observed(reply_ids))
            play.environment_tokens += len(reply_ids)


def _user_call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as err:  # the user's code: recorded on the episode; KeyboardInterrupt still stops the run
        raise _Failed(f"{what} raised {type(err).__name__}: {err}") from err


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _checked_messages(method: str, value: Any, opening: bool) -> list[Message]:
    """`value` as a list of message dicts (copies), or _Failed naming `method` and what came back."""
    expected = "a list of {'role': str, 'content': str} dicts"
    if not isinstance(value, list):
        raise _Failed(f"{method} returned {_shown(value)}{' as its reply' if not opening else ''}, expected {expected}")
    if opening and not value:
        raise _Failed(f"{method} returned an empty list, expected {expected} (at least one: the model's prompt)")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            raise _Failed(f"{method} returned {_shown(message)} as message {i}, expected {expected}")
    return [dict(m) for m in value]


def _checked_step(value: Any) -> tuple[list[Message], float, bool]:
    if not isinstance(value, tuple) or len(value) != 3:
        raise _Failed(f"step returned {_shown(value)}, expected a tuple (reply messages, reward, done)")
    reply, reward, done = value
    messages = _checked_messages("step", reply, opening=False)
    # bool is an int: refused, so that (reply, done, reward) in the wrong order is caught, not scored as 0/1.
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(reward):
        raise _Failed(f"step returned reward {_shown(reward)}, expected a finite real number")
    if not isinstance(done, bool):
        raise _Failed(f"step returned done {_shown(done)}, expected a bool (wrap it in bool(...))")
    return messages, float(reward), done


# ----------------------------------------------------------------------------------------------------------------
# Metrics of a batch of episodes
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeStats:
    """What a batch of episodes did. Rewards are over trainable episodes only (a failed one's is partial)."""

    episodes: int
    turns_mean: float
    model_tokens_mean: float
    environment_tokens_mean: float
    environment_token_share: float          # environment / (environment + model) tokens, over all episodes
    error_rate: float                       # fraction that ended with stop_reason 'error'
    stop_rates: dict[str, float]            # fraction per stop reason, every reason present
    reward_mean: float | None               # None when no episode is trainable
    reward_by_turns: dict[int, float]       # mean reward of the trainable episodes that took n turns

    @classmethod
    def of(cls, results: Sequence[EpisodeResult]) -> EpisodeStats:
        if not results:
            raise ValueError("EpisodeStats.of needs at least one episode")
        n = len(results)
        model = sum(r.model_tokens for r in results)
        environment = sum(r.environment_tokens for r in results)
        trainable = [r for r in results if r.trainable]
        by_turns: dict[int, list[float]] = {}
        for r in trainable:
            by_turns.setdefault(r.turns, []).append(r.reward)
        return cls(
            episodes=n,
            turns_mean=sum(r.turns for r in results) / n,
            model_tokens_mean=model / n,
            environment_tokens_mean=environment / n,
            environment_token_share=environment / (model + environment) if model + environment else 0.0,
            error_rate=sum(not r.trainable for r in results) / n,
            stop_rates={s: sum(r.stop_reason == s for r in results) / n for s in STOP_REASONS},
            reward_mean=sum(r.reward for r in trainable) / len(trainable) if trainable else None,
            reward_by_turns={t: sum(v) / len(v) for t, v in sorted(by_turns.items())},
        )

    def metrics(self) -> dict[str, float]:
        """Flat names for the recorder: env/episodes, env/turns_mean, env/model_tokens_mean,
        env/environment_tokens_mean, env/environment_token_share, env/error_rate, env/stop/<reason> (each of
        STOP_REASONS), env/reward_mean (absent when no episode is trainable), env/reward_by_turns/<n>."""
        out = {
            "env/episodes": float(self.episodes),
            "env/turns_mean": self.turns_mean,
            "env/model_tokens_mean": self.model_tokens_mean,
            "env/environment_tokens_mean": self.environment_tokens_mean,
            "env/environment_token_share": self.environment_token_share,
            "env/error_rate": self.error_rate,
        }
        out.update({f"env/stop/{reason}": rate for reason, rate in self.stop_rates.items()})
        if self.reward_mean is not None:
            out["env/reward_mean"] = self.reward_mean
        out.update({f"env/reward_by_turns/{turns}": reward for turns, reward in self.reward_by_turns.items()})
        return out


__all__ = [
    "KEY",
    "PROTOCOL",
    "STOP_REASONS",
    "Episode",
    "EpisodeLimits",
    "EpisodeResult",
    "EpisodeStats",
    "GeneratedTurn",
    "RewardMode",
    "StopReason",
    "load_environment",
]
