"""One episode of multi-turn RL, played a step at a time, and the metrics of a batch of them.

An episode is a dataset row played against one environment instance (reinforge/agents/environment.py:
the protocol and the checks of a user's class): `reset(row)` gives the opening messages, then each
model turn goes to `step(text)`, whose reply messages are encoded into the context for the next
turn, until the environment is done or a limit is reached. `Play` holds one episode's state and
advances it one call at a time, so a rollout driver can keep many episodes in flight (the native
engine decodes the others while one waits on its environment: reinforge/agents/rollout.py);
`Episode.run` plays one to its end with the caller's generate and encode callables. Whatever the
user's class does wrong at run time (raising, returning the wrong types) ends that episode with the
error recorded and no gradient from it; it never stops the run.
"""

from __future__ import annotations

import inspect
import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, Literal

import torch

from reinforge.rollout.trajectory import Segment, Trajectory

StopReason = Literal["done", "max_turns", "max_model_tokens", "max_environment_tokens", "error"]
STOP_REASONS: tuple[StopReason, ...] = (
    "done",                    # step returned done=True
    "max_turns",               # the model had its max_turns turns and the environment was not done
    "max_model_tokens",        # the model's tokens reached the trajectory's budget (the last turn cut to fit)
    "max_environment_tokens",  # the next reply would have passed the environment's budget (it is left out)
    "error",                   # the class raised, or returned something outside the protocol (see `error`)
)
RewardMode = Literal["trajectory", "turn"]
Message = dict[str, Any]


@dataclass(frozen=True)
class GeneratedTurn:
    """What the caller's `generate` returns for one model turn."""

    text: str                        # the decoded turn, as `step` receives it
    token_ids: torch.Tensor          # [L] long, L >= 1: the sampled tokens (the end-of-turn token included)
    sampler_logprobs: torch.Tensor   # [L] float: log-prob of each token under the distribution it was drawn from
    version: int                     # the policy version that sampled the turn
    truncated: bool                  # the turn hit the generator's per-turn token limit without a stop
    top_ids: torch.Tensor | None = None       # [L, K] the sampler's top-K ids per position (record_top_k), or None
    top_logprobs: torch.Tensor | None = None  # [L, K] their log-probs


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
    turn_rewards: tuple[float, ...]  # step's reward for each turn it scored (a turn cut to the budget has none)
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
class Play:
    """One episode as it is played: `open`, then per model turn `turn` (the environment's step) and,
    when it goes on, `observe` with the reply's tokens. `result` is set once it has ended; `open` and
    `turn` run the user's code and may be called from a worker thread (one call at a time per play)."""

    group: int
    limits: EpisodeLimits
    reward_mode: RewardMode = "trajectory"
    environment: Any = None
    prompt_ids: tuple[int, ...] = ()
    messages: list[Message] = field(default_factory=list)
    before: list[Message] = field(default_factory=list)   # the conversation before the pending reply
    segments: list[Segment] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    cut_turns: int = 0          # turns the generator cut at its per-turn limit
    model_tokens: int = 0
    environment_tokens: int = 0
    result: EpisodeResult | None = None

    def open(self, environment: type | object, row: Mapping[str, Any]) -> list[Message] | None:
        """Construct `environment` (a class; an instance is used as it is) and reset it with `row`:
        the opening messages, or None when that failed (the episode has ended)."""
        try:
            if inspect.isclass(environment):
                environment = _user_call(f"{environment.__name__}()", environment)
            self.environment = environment
            self.messages = _checked_messages("reset", _user_call("reset", environment.reset, dict(row)), opening=True)
        except _Failed as failure:
            self._end("error", str(failure))
            return None
        return list(self.messages)

    def turn(self, turn: GeneratedTurn) -> list[Message] | None:
        """Record the model's turn and, unless a limit ends the episode first, give its text to `step`:
        the reply messages to encode and `observe`, or None when the episode has ended."""
        try:
            return self._turn(turn)
        except _Failed as failure:
            self._end("error", str(failure))
            return None

    def _turn(self, turn: GeneratedTurn) -> list[Message] | None:
        if turn.token_ids.dim() != 1 or len(turn.token_ids) == 0:
            raise ValueError(f"generate returned token_ids of shape {tuple(turn.token_ids.shape)}: "
                             "a turn is [L] with L >= 1")
        limits = self.limits
        self.turns += 1
        self.messages.append({"role": "assistant", "content": turn.text})
        room = None if limits.max_model_tokens is None else limits.max_model_tokens - self.model_tokens
        keep = len(turn.token_ids) if room is None else min(room, len(turn.token_ids))
        top = (None, None) if turn.top_ids is None else (turn.top_ids[:keep], turn.top_logprobs[:keep])
        self.segments.append(Segment.sampled(turn.token_ids[:keep], turn.sampler_logprobs[:keep], turn.version, *top))
        self.model_tokens += keep
        if keep < len(turn.token_ids):
            return self._end("max_model_tokens")   # the turn was cut: its text is not what step would judge
        # A turn the generator cut (per-turn limit, no stop) still goes to step: the environment judges what
        # the model wrote, as a tool box reads an unclosed call as malformed. The trajectory is marked truncated.
        self.cut_turns += int(turn.truncated)
        reply, reward, done = _checked_step(_user_call("step", self.environment.step, turn.text))
        self.rewards.append(reward)
        self.before = list(self.messages)
        self.messages.extend(reply)
        if done:
            return self._end("done")
        if self.turns >= limits.max_turns:
            return self._end("max_turns")
        if room is not None and self.model_tokens >= limits.max_model_tokens:
            return self._end("max_model_tokens")
        return reply

    def observe(self, reply_ids: Sequence[int] | torch.Tensor) -> bool:
        """The reply's tokens join the context; False when they would pass the environment's token
        budget (the episode ends without them)."""
        reply_ids = torch.as_tensor(reply_ids, dtype=torch.long)
        budget = self.limits.max_environment_tokens
        if budget is not None and self.environment_tokens + len(reply_ids) > budget:
            self._end("max_environment_tokens")
            return False
        self.segments.append(Segment.observed(reply_ids))
        self.environment_tokens += len(reply_ids)
        return True

    def _end(self, stop_reason: StopReason, error: str | None = None) -> None:
        trajectory = Trajectory(prompt_ids=self.prompt_ids, segments=tuple(self.segments), group=self.group,
                                truncated=stop_reason not in ("done", "error") or self.cut_turns > 0)
        self.result = EpisodeResult(trajectory=trajectory, messages=tuple(self.messages),
                                    turn_rewards=tuple(self.rewards), reward_mode=self.reward_mode, turns=self.turns,
                                    stop_reason=stop_reason, error=error)


@dataclass(frozen=True)
class Episode:
    """Plays trajectories against environments one at a time with the caller's model and chat template.

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
        play = Play(group=group, limits=self.limits, reward_mode=self.reward_mode)
        opening = play.open(environment, row)
        if opening is not None:
            play.prompt_ids = tuple(int(t) for t in self.encode_prompt(opening))
        while play.result is None:
            reply = play.turn(self.generate(list(play.messages)))
            if reply is not None:
                play.observe(self.encode(play.before, list(play.messages)))
        return play.result


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
    if not isinstance(value, list | tuple):
        raise _Failed(f"{method} returned {_shown(value)}{' as its reply' if not opening else ''}, expected {expected}")
    if opening and not value:
        raise _Failed(f"{method} returned an empty list, expected {expected} (at least one: the model's prompt)")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            raise _Failed(f"{method} returned {_shown(message)} as message {i}, expected {expected}")
    return [dict(m) for m in value]


def _checked_step(value: Any) -> tuple[list[Message], float, bool]:
    if not isinstance(value, tuple | list) or len(value) != 3:
        raise _Failed(f"step returned {_shown(value)}, expected a tuple (reply messages, reward, done)")
    reply, reward, done = (_scalar(v) for v in value)
    messages = _checked_messages("step", reply, opening=False)
    # bool is an int: refused, so that (reply, done, reward) in the wrong order is caught, not scored as 0/1.
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(reward):
        raise _Failed(f"step returned reward {_shown(reward)}, expected a finite real number")
    if not isinstance(done, bool):
        raise _Failed(f"step returned done {_shown(done)}, expected a bool (wrap it in bool(...))")
    return messages, float(reward), done


def _scalar(value: Any) -> Any:
    """A numpy or torch scalar (`reward = np.float32(...)`, `done = guess == target` on numpy ints) as the
    Python number or bool it holds; anything else as it is."""
    if type(value).__module__.split(".")[0] in ("numpy", "torch") and getattr(value, "ndim", None) == 0:
        return value.item()
    return value


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
    "STOP_REASONS",
    "Episode",
    "EpisodeLimits",
    "EpisodeResult",
    "EpisodeStats",
    "GeneratedTurn",
    "Play",
    "RewardMode",
    "StopReason",
]
