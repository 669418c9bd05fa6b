"""Environments: load-time checks of a user's class, episodes played against scripted model turns, and their metrics.

The fake model writes scripted texts, one token per character (the token id is the character's code point), each
with log-prob -0.5, turn k sampled by policy version 3 + k. The fake chat template renders a reply as the
characters of its messages' contents, so every token count below is a string length.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import REPO

from reinforge.agents.environment import load_environment
from reinforge.agents.episode import (
    STOP_REASONS,
    Episode,
    EpisodeLimits,
    EpisodeResult,
    EpisodeStats,
    GeneratedTurn,
)
from reinforge.errors import ConfigError

EXAMPLE = REPO / "examples" / "guess_number_env.py"


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


class Scripted:
    """generate: the scripted texts in order; `truncated_at` marks that turn (0-based) as cut by the generator."""

    def __init__(self, *texts: str, truncated_at: int | None = None) -> None:
        self.texts, self.truncated_at, self.seen = texts, truncated_at, []

    def __call__(self, messages: list[dict]) -> GeneratedTurn:
        k = len(self.seen)
        self.seen.append(messages)
        text = self.texts[k]
        return GeneratedTurn(text=text, token_ids=torch.tensor(ids(text)),
                             sampler_logprobs=torch.full((len(text),), -0.5), version=3 + k,
                             truncated=k == self.truncated_at)


def encode(before: list[dict], after: list[dict]) -> torch.Tensor:
    return torch.tensor(ids("".join(m["content"] for m in after[len(before):])), dtype=torch.long)


def encode_prompt(messages: list[dict]) -> list[int]:
    return ids("".join(m["content"] for m in messages))


def play(env: object, *texts: str, row: dict | None = None, truncated_at: int | None = None,
         **options: object) -> EpisodeResult:
    episode = Episode(generate=Scripted(*texts, truncated_at=truncated_at), encode=encode, encode_prompt=encode_prompt,
                      **options)
    return episode.run(env, row if row is not None else {"target": 7})


class Guess:
    """The protocol's plain form: find row['target']; 'up'/'dn' and -0.25 for a miss, 'yes' and 1.0 for a hit."""

    def reset(self, row: dict) -> list[dict]:
        self.target = row["target"]
        return [{"role": "user", "content": "guess"}]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        if int(text) == self.target:
            return [{"role": "user", "content": "yes"}], 1.0, True
        return [{"role": "user", "content": "up" if int(text) < self.target else "dn"}], -0.25, False


def test_a_game_to_done_alternates_model_and_environment_segments() -> None:
    result = play(Guess, "5", "8", "7")
    # '5' -> 'up', '8' -> 'dn', '7' -> done: the final 'yes' is in the messages but not in the trajectory (no model
    # turn reads it), so the trajectory ends on the last model token, where the return goes.
    t = result.trajectory
    assert t.prompt_ids == tuple(ids("guess"))
    assert [s.role for s in t.segments] == ["model", "environment", "model", "environment", "model"]
    assert t.tokens().tolist() == [53, 117, 112, 56, 100, 110, 55]
    assert t.loss_mask().tolist() == [1, 0, 0, 1, 0, 0, 1]
    assert t.versions().tolist() == [3, -1, -1, 4, -1, -1, 5]
    assert t.sampler_logprobs().tolist() == [-0.5, 0, 0, -0.5, 0, 0, -0.5]
    assert (result.stop_reason, result.error, result.trainable, t.truncated) == ("done", None, True, False)
    assert (result.turns, result.model_tokens, result.environment_tokens) == (3, 3, 4)
    assert result.turn_rewards == (-0.25, -0.25, 1.0)
    assert result.reward == 0.5
    assert result.token_rewards().tolist() == [0, 0, 0, 0, 0, 0, 0.5]
    assert [m["content"] for m in result.messages] == ["guess", "5", "up", "8", "dn", "7", "yes"]
    assert [m["role"] for m in result.messages] == ["user", "assistant"] * 3 + ["user"]


def test_turn_mode_keeps_each_turns_reward_on_its_last_token() -> None:
    result = play(Guess, "5", "8", "7", reward_mode="turn")
    assert result.token_rewards().tolist() == [-0.25, 0, 0, -0.25, 0, 0, 1.0]
    assert result.reward == 0.5
    two_token_turns = play(Guess, "15", "7", reward_mode="turn")   # '15' -> 'dn' (2 tokens), '7' -> done
    assert two_token_turns.token_rewards().tolist() == [0, -0.25, 0, 0, 1.0]


def test_generate_sees_the_conversation_so_far() -> None:
    generate = Scripted("5", "7")
    Episode(generate=generate, encode=encode, encode_prompt=encode_prompt).run(Guess(), {"target": 7})
    assert [[m["content"] for m in seen] for seen in generate.seen] == [["guess"], ["guess", "5", "up"]]


def test_max_turns_stops_after_the_last_turn_is_scored() -> None:
    result = play(Guess, "5", "8", "7", limits=EpisodeLimits(max_turns=2))
    assert (result.stop_reason, result.turns, result.turn_rewards) == ("max_turns", 2, (-0.25, -0.25))
    assert result.trajectory.tokens().tolist() == [53, 117, 112, 56]   # the reply to turn 2 is never read
    assert result.trajectory.truncated and result.trainable
    assert result.token_rewards().tolist() == [0, 0, 0, -0.5]


def test_max_model_tokens_cuts_the_last_turn_and_does_not_score_it() -> None:
    # '50' (2 tokens) -> 'up'; '80' has room for 1 token: cut to '8', never stepped.
    result = play(Guess, "50", "80", "70", row={"target": 70}, limits=EpisodeLimits(max_model_tokens=3))
    assert (result.stop_reason, result.turns, result.turn_rewards, result.model_tokens) == (
        "max_model_tokens", 2, (-0.25,), 3)
    assert result.trajectory.tokens().tolist() == [53, 48, 117, 112, 56]
    assert result.trajectory.versions().tolist() == [3, 3, -1, -1, 4]
    assert result.trajectory.truncated
    # A budget met exactly: the turn is scored, and the episode stops before a turn with no room.
    exact = play(Guess, "50", "80", "70", row={"target": 70}, limits=EpisodeLimits(max_model_tokens=4))
    assert (exact.stop_reason, exact.turn_rewards, exact.model_tokens) == ("max_model_tokens", (-0.25, -0.25), 4)
    assert exact.trajectory.tokens().tolist() == [53, 48, 117, 112, 56, 48]


def test_max_environment_tokens_leaves_out_the_reply_that_would_pass_it() -> None:
    result = play(Guess, "5", "8", "7", limits=EpisodeLimits(max_environment_tokens=3))
    # 'up' (2) fits; 'dn' would make 4 > 3.
    assert (result.stop_reason, result.turns, result.environment_tokens) == ("max_environment_tokens", 2, 2)
    assert result.trajectory.tokens().tolist() == [53, 117, 112, 56]
    assert result.trajectory.truncated


def test_a_turn_truncated_by_the_generator_is_still_judged_and_marks_the_trajectory() -> None:
    result = play(Guess, "5", "8", "7", truncated_at=1)
    assert (result.stop_reason, result.turns, result.turn_rewards) == ("done", 3, (-0.25, -0.25, 1.0))
    assert result.trajectory.truncated and result.trainable


class FailsOnSecondStep(Guess):
    def step(self, text: str) -> tuple[list[dict], float, bool]:
        if text == "8":
            raise KeyError("no guess")
        return super().step(text)


def test_a_step_that_raises_ends_the_trajectory_untrainable_with_the_error() -> None:
    result = play(FailsOnSecondStep, "5", "8", "7")
    assert (result.stop_reason, result.error) == ("error", "step raised KeyError: 'no guess'")
    assert not result.trainable and not result.trajectory.truncated
    assert (result.turns, result.turn_rewards) == (2, (-0.25,))
    assert result.trajectory.tokens().tolist() == [53, 117, 112, 56]   # kept for inspection, not for training


def returning(reset: object = None, step: object = None) -> type:
    """An environment whose reset or step returns `reset` / `step` (the other one well-formed)."""

    class Env(Guess):
        def reset(self, row: dict) -> list[dict]:
            return super().reset(row) if reset is None else reset

        def step(self, text: str) -> tuple[list[dict], float, bool]:
            return super().step(text) if step is None else step

    return Env


OK_REPLY = [{"role": "user", "content": "up"}]


@pytest.mark.parametrize(("env", "error"), [
    (returning(reset="hello"), "reset returned str 'hello', expected a list of"),
    (returning(reset=[]), "reset returned an empty list"),
    (returning(reset=[{"role": "user"}]), "reset returned dict {'role': 'user'} as message 0"),
    (returning(reset=[{"role": "user", "content": 3}]), "reset returned dict {'content': 3, 'role': 'user'} as messa"),
    (returning(step=[OK_REPLY, 0.0]), "step returned list"),
    (returning(step=(OK_REPLY, 0.0)), "step returned tuple"),
    (returning(step=("up", 0.0, False)), "step returned str 'up' as its reply"),
    (returning(step=(OK_REPLY, True, 1.0)), "step returned reward bool True, expected a finite real number"),
    (returning(step=(OK_REPLY, math.nan, False)), "step returned reward float nan"),
    (returning(step=(OK_REPLY, "1", False)), "step returned reward str '1'"),
    (returning(step=(OK_REPLY, 1.0, 1)), "step returned done int 1, expected a bool"),
    (returning(step=None), None),
])
def test_wrong_return_types_are_recorded_naming_the_method(env: type, error: str | None) -> None:
    result = play(env, "5", "7")
    if error is None:
        assert (result.stop_reason, result.error) == ("done", None)
        return
    assert result.stop_reason == "error" and not result.trainable
    assert result.error.startswith(error), result.error


def test_a_constructor_or_reset_that_raises_is_recorded() -> None:
    class Broken(Guess):
        def __init__(self) -> None:
            raise RuntimeError("no board")

    result = play(Broken, "5")
    assert (result.stop_reason, result.error, result.turns) == ("error", "Broken() raised RuntimeError: no board", 0)
    assert result.trajectory.segments == () and result.token_rewards().tolist() == []
    missing_column = play(Guess, "5", row={})
    assert missing_column.error == "reset raised KeyError: 'target'"


def test_limits_and_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match="max_model_tokens"):
        EpisodeLimits(max_model_tokens=0)
    assert EpisodeLimits(max_environment_tokens=0).max_environment_tokens == 0
    with pytest.raises(ValueError, match="reward_mode"):
        Episode(generate=Scripted(), encode=encode, encode_prompt=encode_prompt, reward_mode="token")


def test_stats_aggregate_episodes_into_named_metrics() -> None:
    done = play(Guess, "5", "8", "7")                                     # 3 turns, 3 + 4 tokens, reward 0.5
    capped = play(Guess, "5", "8", limits=EpisodeLimits(max_turns=2))     # 2 turns, 2 + 2 tokens, reward -0.5
    quick = play(Guess, "7")                                              # 1 turn, 1 + 0 tokens, reward 1.0
    failed = play(FailsOnSecondStep, "5", "8")                            # 2 turns, 2 + 2 tokens, error
    metrics = EpisodeStats.of([done, capped, quick, failed]).metrics()
    assert metrics == {
        "env/episodes": 4.0,
        "env/turns_mean": 2.0,                           # (3 + 2 + 1 + 2) / 4
        "env/model_tokens_mean": 2.0,                    # (3 + 2 + 1 + 2) / 4
        "env/environment_tokens_mean": 2.0,              # (4 + 2 + 0 + 2) / 4
        "env/environment_token_share": 0.5,              # 8 / (8 + 8)
        "env/error_rate": 0.25,
        "env/stop/done": 0.5,
        "env/stop/max_turns": 0.25,
        "env/stop/max_model_tokens": 0.0,
        "env/stop/max_environment_tokens": 0.0,
        "env/stop/error": 0.25,
        "env/reward_mean": (0.5 - 0.5 + 1.0) / 3,       # the failed episode's partial reward is left out
        "env/reward_by_turns/1": 1.0,
        "env/reward_by_turns/2": -0.5,
        "env/reward_by_turns/3": 0.5,
    }
    assert set(STOP_REASONS) == {k.removeprefix("env/stop/") for k in metrics if k.startswith("env/stop/")}
    assert "env/reward_mean" not in EpisodeStats.of([failed]).metrics()


# ----------------------------------------------------------------------------------------------------------------
# load_environment
# ----------------------------------------------------------------------------------------------------------------

GAME_FILE = '''
class Game:
    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        return [], 1.0, True


class Sized(Game):
    def __init__(self, size, seed=0):
        self.size = size


class Stepless:
    def reset(self, row):
        return []

    def step(self):
        return [], 0.0, True


def game():
    return Game()
'''


@pytest.fixture
def game_file(tmp_path: Path) -> Path:
    path = tmp_path / "games.py"
    path.write_text(GAME_FILE)
    return path


def test_load_environment_from_a_file_and_a_module(game_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = load_environment(f"{game_file}:Game")
    assert cls.__name__ == "Game" and play(cls, "x").stop_reason == "done"
    # 'module:Class' of a module in the working directory (which the importer puts on sys.path: restored after).
    monkeypatch.chdir(game_file.parent)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (game_file.parent / "envgames_cwd.py").write_text(GAME_FILE)
    assert load_environment("envgames_cwd:Game").__name__ == "Game"


@pytest.mark.parametrize(("target", "message"), [
    ("{file}:Sized", r"task.environment='.*games.py:Sized': Sized\(\) requires size, but an environment is "
                     r"constructed with no arguments"),
    ("{file}:game", r"is not a class \(its type is function\)"),
    ("{file}:Gam", r"in '.*games.py', unknown class 'Gam'; did you mean 'Game'\?"),
    ("{file}:Stepless", r"Stepless.step takes \(self\); the protocol calls step\(text\) with one argument"),
    ("{dir}/nothere.py:Game", "file '.*nothere.py' does not exist"),
    ("Game", "is not 'module:Class' or 'path/to/file.py:Class'"),
    ("reinforge_no_such_module:Game", "cannot be imported: No module named 'reinforge_no_such_module'"),
    ("reinforge.agents.episode:EpisodeLimits", "EpisodeLimits.reset is missing"),
])
def test_load_environment_refuses_what_the_protocol_cannot_run(game_file: Path, target: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        load_environment(target.format(file=game_file, dir=game_file.parent))
    assert str(raised.value).startswith("task.environment=") and "\n" not in str(raised.value)


# ----------------------------------------------------------------------------------------------------------------
# The documented example
# ----------------------------------------------------------------------------------------------------------------


def test_the_example_game_plays_to_the_answer() -> None:
    cls = load_environment(f"{EXAMPLE}:GuessNumber")
    result = play(cls, "50", "I'd say 25", "hmm", "37", row={"target": 37})
    replies = [m["content"] for m in result.messages if m["role"] == "user"][1:]
    assert replies == ["No, it is lower. 6 guesses left.", "No, it is higher. 5 guesses left.",
                       "Please answer with one whole number.", "Correct, it is 37!"]
    assert (result.stop_reason, result.turns, result.turn_rewards) == ("done", 4, (0.0, 0.0, -0.1, 1.0))
    assert result.reward == pytest.approx(0.9)
    assert (result.model_tokens, result.environment_tokens) == (2 + 10 + 3 + 2, 32 + 33 + 36)
    assert result.trajectory.prompt_ids[:8] == tuple(ids("You are "))


def test_the_example_game_ends_when_the_guesses_run_out() -> None:
    result = play(load_environment(f"{EXAMPLE}:GuessNumber"), *"1234567", row={"target": 9})
    assert (result.stop_reason, result.turns, result.reward) == ("done", 7, 0.0)
    assert result.messages[-1]["content"] == "Out of guesses: it was 9."


def test_the_documented_example_is_the_example_file() -> None:
    docs = (EXAMPLE.parents[1] / "docs" / "agents.md").read_text()
    block = next(b for b in docs.split("```python\n")[1:] if b.startswith("class GuessNumber")).split("```")[0]
    assert block in EXAMPLE.read_text()


class NumpyScored(Guess):
    """Returns numpy scalars, as an environment computing with numpy does, and lists instead of tuples."""

    def step(self, text: str):
        import numpy as np

        reply, reward, done = super().step(text)
        return [tuple(reply), np.float32(reward), np.int64(int(text)) == np.int64(self.target)]


def test_numpy_scalars_and_lists_from_step_are_read_as_python_values() -> None:
    result = play(NumpyScored, "5", "7")
    assert (result.stop_reason, result.turn_rewards, result.error) == ("done", (-0.25, 1.0), None)
