"""The built-in tool task played by its agent function (examples/multiply_agent.py) through the endpoint:
the same episodes as the in-process tool rollout, and an episode whose context fills the model's positions
ends (trained on, reward 0) instead of failing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from repo_paths import REPO
from scripted_engine import Scripted

from reinforge.agents.episode import EpisodeLimits
from reinforge.agents.render import Renderer
from reinforge.agents.rollout import AgentEngine
from reinforge.agents.tools import ToolBox
from reinforge.rollout.base import SamplingParams
from reinforge.serve.agent import AgentFunctions, load_agent
from reinforge.tasks.multiply_tool import TOOL, tool_call

PARAMS = SamplingParams(max_new_tokens=96)
ROWS = {"112*345=": {"prompt": "112*345=", "answer": "38640"}}


def engine(first_turn: str, positions: int | None = None) -> Scripted:
    """A model that writes `first_turn`, then copies the tool's answer out."""
    def script(context: str) -> str:
        if "<tool_response>" not in context:
            return first_turn
        return context.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]

    scripted = Scripted(script)
    scripted.policy.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=positions))
    return scripted


def agent_rollout(scripted: Scripted, agent: str = "examples/multiply_agent.py:solve"):
    functions = AgentFunctions(scripted, load_agent(str(REPO / agent)), ROWS.__getitem__, chat_template="never",
                               max_calls=2)
    return functions.generate(["112*345="], 1, PARAMS, generator=torch.Generator().manual_seed(0))


def segments(rollout, scripted: Scripted) -> list[tuple[str, str]]:
    trajectory = rollout.episodes[0].result.trajectory
    decode = scripted.policy.tokenizer.decode
    return [("prompt", decode(list(trajectory.prompt_ids)))] + [(s.role, decode(s.token_ids))
                                                                 for s in trajectory.segments]


@pytest.mark.parametrize(("first_turn", "answer"), [(tool_call("112*345"), "38640"), ("38640", "38640"),
                                                    (tool_call("112*345*2"), "77280")])
def test_the_agents_episode_is_the_in_process_tool_episode(first_turn: str, answer: str) -> None:
    scripted = engine(first_turn)
    box = ToolBox([TOOL], parser="hermes", timeout_s=10, max_chars=4096)
    in_process = AgentEngine(scripted, Renderer(scripted.policy.tokenizer, "never", box.schemas(), [0]),
                             ROWS.__getitem__, tools=box, limits=EpisodeLimits(max_turns=2)).generate(
        ["112*345="], 1, PARAMS, generator=torch.Generator().manual_seed(0))
    agent = agent_rollout(scripted)
    # Same prompt, same turns, same tool reply between them, same tokens trained on.
    assert segments(agent, scripted) == segments(in_process, scripted)
    assert torch.equal(agent.trained_mask, in_process.trained_mask)
    # The in-process episode is scored by the task's verifier on its last turn's text, the agent's by itself.
    assert in_process.texts == agent.texts == [answer]
    assert agent.episodes[0].reward == float(answer == "38640") and agent.episodes[0].result.error is None


def test_a_call_that_would_fill_the_models_positions_ends_the_episode_without_failing_it() -> None:
    # A miscopied expression: the calculator's error message after a long call leaves no room for the answer.
    scripted = engine(tool_call("112*345x999999"), positions=160)
    rollout = agent_rollout(scripted)
    episode = rollout.episodes[0]
    assert (episode.reward, episode.result.error, episode.result.stop_reason, episode.result.turns) == (
        0.0, None, "max_model_tokens", 1)
    # The call it made is trained on (the reward 0 pushes against it), exactly as sampled.
    assert segments(rollout, scripted) == [
        ("prompt", "112*345="),
        ("model", '<tool_call>{"arguments":{"expression":"112*345x999999"},"name":"calculator"}</tool_call><eos>')]
    assert rollout.trained_mask.sum().item() == len(tool_call("112*345x999999")) + 1


def test_an_agent_that_lets_the_context_refusal_raise_fails_its_episode_with_the_reason(tmp_path) -> None:
    agent = tmp_path / "naive.py"
    agent.write_text(
        "from examples.multiply_agent import TOOLS, calculator\nimport json\n\n"
        "def solve(client, row):\n"
        "    messages = [{'role': 'user', 'content': row['prompt']}]\n"
        "    m = client.chat.completions.create(model='policy', messages=messages, tools=TOOLS).choices[0].message\n"
        "    call = m.tool_calls[0]\n"
        "    messages += [m, {'role': 'tool', 'tool_call_id': call.id, 'content': 'Error: ' + 'x' * 80}]\n"
        "    client.chat.completions.create(model='policy', messages=messages, tools=TOOLS)\n"
        "    return 1.0\n")
    episode = agent_rollout(engine(tool_call("112*345"), positions=160), f"{agent}:solve").episodes[0]
    assert episode.result.stop_reason == "error" and episode.reward != episode.reward   # NaN: no gradient
    assert episode.result.error.startswith("the agent raised BadRequestError: Error code: 400")
    assert "the prompt has 208 tokens" in episode.result.error and "'code': 'context_length_exceeded'" in \
        episode.result.error
