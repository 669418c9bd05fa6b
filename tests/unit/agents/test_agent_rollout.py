"""The multi-turn rollout (reinforge/agents/rollout.py): episodes against tools and environments, in
the batch view the learner trains on, with what went wrong in them handled and counted.

The mechanics run on a scripted engine (the model's text is a function of its context), so every
count below is known by hand; the native engine's continuation is checked on a real tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from repo_paths import TESTS

from reinforge.agents.episode import EpisodeLimits
from reinforge.agents.render import Renderer, trace_tokens
from reinforge.agents.rollout import AgentEngine, agent_metrics
from reinforge.agents.tools import ToolBox
from reinforge.learner import build_sequences, completion_token_stats
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout.base import Rollout, SamplingParams, environment_returns
from reinforge.rollout.trajectory import Segment, Trajectory, collate
from reinforge.tasks.multiply_tool import tool_call

CALC = "reinforge.tasks.multiply_tool:calculator"


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


class Scripted:
    """An engine whose model writes `script(context_text)`; lockstep (it has no `session`)."""

    chat_template = "never"

    def __init__(self, script):
        self.script = script
        tokenizer = build_char_tokenizer()
        self.policy = SimpleNamespace(tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id])

    def generate_ids(self, contexts, group_size, params, policy_version=0, generator=None) -> Rollout:
        tok = self.policy.tokenizer
        trajectories = []
        for g, ids in enumerate(contexts):
            text = self.script(tok.decode(ids))
            out = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            segment = Segment.sampled(torch.tensor(out), torch.full((len(out),), -0.5), policy_version)
            trajectories.append(Trajectory(tuple(ids), (segment,), False, g))
        texts = [self.script(tok.decode(ids)) for ids in contexts]
        return collate(trajectories, tok.pad_token_id, policy_version, lambda _: texts)


def agent(script, tools=None, environment=None, **kw) -> AgentEngine:
    engine = Scripted(script)
    box = ToolBox(tools, timeout_s=1.0, max_chars=200, max_workers=2) if tools else None
    renderer = Renderer(engine.policy.tokenizer, "never", None, engine.policy.eos_token_ids)
    return AgentEngine(engine, renderer, lambda p: {"prompt": p}, environment=environment, tools=box, **kw)


PARAMS = SamplingParams(max_new_tokens=120)


def calls_then_answers(context: str) -> str:
    """Call the calculator on the prompt's expression, then copy its result."""
    if "<tool_response>" not in context:
        return tool_call(context.removesuffix("="))
    return context.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]


def test_a_tool_episode_is_call_result_answer_with_the_result_out_of_the_loss() -> None:
    rollout = agent(calls_then_answers, tools=[CALC]).generate(["12*34=", "5*6="], 2, PARAMS)
    tok = build_char_tokenizer()
    assert rollout.texts == ["408", "408", "30", "30"]          # the last turn: what the verifier scores
    call = tool_call("12*34")
    # Row 0: the call and its eos (trained), the result (context), the answer and its eos (trained).
    expected = call + "<eos><tool_response>408</tool_response>408<eos>"
    n = int(rollout.completion_mask[0].sum())
    assert tok.decode(rollout.completion_ids[0, :n]) == expected
    trained = rollout.loss_mask[0, :n]
    observation = len("<tool_response>408</tool_response>")
    assert trained.tolist() == [1.0] * (len(call) + 1) + [0.0] * observation + [1.0] * 4
    assert rollout.lengths.tolist() == [len(call) + 1 + 4] * 2 + [len(tool_call("5*6")) + 1 + 3] * 2
    assert environment_returns(rollout) is None                 # tools: the reward functions score the answer
    metrics = agent_metrics(rollout.episodes)
    assert metrics["env/turns_mean"] == 2.0
    assert metrics["tools/calls_per_trajectory"] == 1.0
    assert metrics["tools/error_rate"] == 0.0
    assert metrics["env/environment_token_share"] == pytest.approx(
        (2 * observation + 2 * len("<tool_response>30</tool_response>"))
        / float(rollout.completion_mask.sum()))
    roles = [m["role"] for m in rollout.episodes[0].transcript()]
    assert roles == ["user", "assistant", "tool", "assistant"]


def test_a_hanging_tool_a_malformed_call_and_a_10mb_result_are_observations_and_counted() -> None:
    def script(context: str) -> str:
        turn = context.count("<tool_response>")
        return ['<tool_call>{"name":"hang","arguments":{"seconds":30}}</tool_call>',
                '<tool_call>{"name": oops</tool_call>',
                '<tool_call>{"name":"huge","arguments":{"megabytes":10}}</tool_call>',
                "done"][turn]

    rollout = agent(script, tools=["tool_fixtures:hang", "tool_fixtures:huge"], max_tool_calls=5).generate(
        ["go"], 1, PARAMS)
    episode = rollout.episodes[0]
    contents = [m["content"] for m in episode.result.messages if m["role"] == "tool"]
    assert contents[0] == "Error: timed out after 1 s; the call was stopped"
    assert contents[1].startswith("Error: tool call 1: invalid JSON")
    assert len(contents[2]) <= 200                               # 10 MB cut to max_chars
    assert episode.tools.timeouts == 1 and episode.tools.malformed == 1 and episode.tools.truncated == 1
    assert episode.result.turns == 4 and episode.result.stop_reason == "done"
    metrics = agent_metrics(rollout.episodes)
    assert metrics["tools/malformed_rate"] == pytest.approx(1 / 3)   # 1 unreadable of 3 attempted calls
    assert metrics["tools/error_rate"] == pytest.approx(1 / 2)       # the timeout, of 2 executed calls


class Raises:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        if "boom" in text:
            raise KeyError("no such state")
        return [{"role": "user", "content": "again"}], 0.5, False


def test_an_environment_that_raises_ends_its_episode_with_no_reward_and_the_others_go_on() -> None:
    rollout = agent(lambda c: "boom" if c.startswith("a") else "fine", environment=Raises,
                    limits=EpisodeLimits(max_turns=3)).generate(["a", "b"], 2, PARAMS)
    returns = environment_returns(rollout)
    assert torch.isnan(returns[:2]).all() and returns[2:].tolist() == [1.5, 1.5]   # 3 turns of 0.5
    assert [e.result.error for e in rollout.episodes[:2]] == ["step raised KeyError: 'no such state'"] * 2
    assert [e.result.stop_reason for e in rollout.episodes] == ["error"] * 2 + ["max_turns"] * 2
    assert agent_metrics(rollout.episodes)["env/error_rate"] == 0.5


def test_the_tool_call_limit_ends_the_trajectory() -> None:
    rollout = agent(lambda c: tool_call("1*1"), tools=[CALC], max_tool_calls=2).generate(["x"], 1, PARAMS)
    episode = rollout.episodes[0]
    assert episode.tools.calls == 2 and episode.tool_limit_hit and episode.result.turns == 3
    assert agent_metrics(rollout.episodes)["tools/limit_rate"] == 1.0


def test_a_teacher_trace_tokenizes_as_the_rollout_holds_it() -> None:
    tok = build_char_tokenizer()
    renderer = Renderer(tok, "never", None, [tok.eos_token_id])
    turns = [{"role": "assistant", "content": tool_call("2*3")}, {"role": "tool", "content": "6"},
             {"role": "assistant", "content": "6"}]
    prompt, completion, trained = trace_tokens(renderer, [{"role": "user", "content": "2*3="}], turns,
                                               tok.eos_token_id)
    assert tok.decode(prompt) == "2*3="
    assert tok.decode(completion) == tool_call("2*3") + "<eos><tool_response>6</tool_response>6<eos>"
    assert sum(trained) == len(tool_call("2*3")) + 1 + 2


class Again:
    """Answers every turn with the same reply for three turns; the return is the last turn's length."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turns += 1
        return [{"role": "user", "content": "more?"}], float(len(text)), self.turns == 3


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_native_continuation_gives_the_rollout_of_re_prefilling_each_turn(cpu_kernels: bool) -> None:
    from reinforge.models import build_tiny_qwen2
    from reinforge.rollout import NativeEngine
    from reinforge.settings import ModelConfig

    policy = build_tiny_qwen2(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                          intermediate_size=128, max_positions=256), seed=0)
    with torch.no_grad():       # turns that end at different lengths (a random model's would all run to the limit)
        policy.model.get_output_embeddings().weight[policy.tokenizer.eos_token_id] *= 15.0
    engine = NativeEngine(policy, max_batch_rows=5, cpu_kernels=cpu_kernels)
    renderer = Renderer(policy.tokenizer, "auto", None, policy.eos_token_ids)
    out = {}
    for continuation in (True, False):
        agent = AgentEngine(engine, renderer, lambda p: {"prompt": p}, environment=Again, continuation=continuation)
        out[continuation] = agent.generate(["12+3=", "7*8=", "1-1="], 3, SamplingParams(max_new_tokens=12),
                                           generator=torch.Generator().manual_seed(0))
    fast, slow = out[True], out[False]
    assert torch.equal(fast.completion_ids, slow.completion_ids) and torch.equal(fast.loss_mask, slow.loss_mask)
    torch.testing.assert_close(fast.sampler_logprobs, slow.sampler_logprobs, atol=1e-5, rtol=0)
    assert [e.result.turns for e in fast.episodes] == [3] * 9
    assert float(fast.loss_mask.sum()) < float(fast.completion_mask.sum())   # replies in, out of the loss
    # Each turn's log-probs are the learner's over the whole episode (train.old_logprobs=auto relies on it)
    seq = build_sequences(fast.prompt_ids, fast.completion_ids, fast.completion_mask, policy.tokenizer.pad_token_id,
                          loss_mask=fast.loss_mask)
    with torch.no_grad():
        learner = completion_token_stats(policy.model, seq, 1.0).logprobs
    assert fast.logprobs_exact and slow.logprobs_exact
    torch.testing.assert_close(learner * fast.loss_mask, fast.sampler_logprobs, atol=1e-4, rtol=0)


def test_reward_by_turns_reads_the_rewards_as_scored() -> None:
    def script(context: str) -> str:       # the first prompt answers at once, the second calls the tool first
        return "7" if context.startswith("a") else calls_then_answers(context)

    rollout = agent(script, tools=[CALC]).generate(["a", "2*3="], 2, PARAMS)
    metrics = agent_metrics(rollout.episodes, torch.tensor([0.0, float("nan"), 1.0, 0.5]))
    assert metrics["env/reward_by_turns/1"] == 0.0 and metrics["env/reward_by_turns/2"] == 0.75
    assert "env/reward_mean" not in metrics           # the step's reward_mean is the one to read


def test_the_hf_engine_plays_episodes_turn_by_turn() -> None:
    from reinforge.models import build_tiny_qwen2
    from reinforge.rollout import HFEngine
    from reinforge.settings import ModelConfig

    policy = build_tiny_qwen2(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                          intermediate_size=64, max_positions=256), seed=0)
    agent = AgentEngine(HFEngine(policy), Renderer(policy.tokenizer, "auto", None, policy.eos_token_ids),
                        lambda p: {"prompt": p}, environment=Again)
    rollout = agent.generate(["1+1=", "2+2="], 2, SamplingParams(max_new_tokens=5),
                             generator=torch.Generator().manual_seed(0))
    assert [e.result.turns for e in rollout.episodes] == [3] * 4 and all(n <= 15 for n in rollout.lengths.tolist())
    reply = len(policy.tokenizer("more?", add_special_tokens=False)["input_ids"]) + 1     # content and newline
    environment = rollout.completion_mask.sum(dim=1) - rollout.loss_mask.sum(dim=1)
    assert environment.tolist() == [2.0 * reply] * 4                # two replies in each context
