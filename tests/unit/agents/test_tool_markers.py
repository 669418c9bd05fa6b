"""Tool calls of a model whose call markers are special tokens (Qwen2.5's <tool_call>) reach the
parser, and a chat template that never shows the model its tools is a warning at start."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import byte_bpe
from repo_paths import TESTS

from reinforge.agents.render import Renderer, trace_tokens_many
from reinforge.agents.rollout import AgentEngine, agent_metrics, turn_decoder
from reinforge.agents.setup import build_agent
from reinforge.agents.tools import ToolBox
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.trajectory import Segment, Trajectory, collate
from reinforge.settings import RolloutConfig
from reinforge.tasks.arithmetic import ArithmeticTask

SPECIALS = ["<pad>", "<|im_end|>", "<tool_call>", "</tool_call>"]
ADD = "tool_fixtures:add"
# A Qwen2.5-like template that renders the tools' schemas in the system turn.
TOOLS_TEMPLATE = ("{% if tools %}<|system|>{{ tools | tojson }}<|im_end|>{% endif %}{% for m in messages %}"
                  "<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
IGNORES_TOOLS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import PreTrainedTokenizerFast

    corpus = ['<tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call> The answer is 42.'] * 20
    tok = PreTrainedTokenizerFast(tokenizer_object=byte_bpe(corpus, SPECIALS), pad_token="<pad>",
                                  eos_token="<|im_end|>", additional_special_tokens=SPECIALS[2:])
    assert len(tok("<tool_call>", add_special_tokens=False)["input_ids"]) == 1     # one special token
    assert "<tool_call>" not in tok.decode(tok("<tool_call>x")["input_ids"], skip_special_tokens=True)
    return tok


def _call(a: int, b: int) -> str:
    return "<tool_call>" + json.dumps({"name": "add", "arguments": {"a": a, "b": b}}) + "</tool_call>"


class Scripted:
    """An engine whose model writes `script(context_text)`, its texts decoded as the real engines decode
    a completion (special tokens skipped)."""

    chat_template = "auto"

    def __init__(self, script, tokenizer):
        self.script = script
        self.policy = SimpleNamespace(tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id])

    def generate_ids(self, contexts, group_size, params, policy_version=0, generator=None) -> Rollout:
        tok = self.policy.tokenizer
        trajectories, texts = [], []
        for g, ids in enumerate(contexts):
            out = tok(self.script(tok.decode(ids)), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            segment = Segment.sampled(torch.tensor(out), torch.full((len(out),), -0.5), policy_version)
            trajectories.append(Trajectory(tuple(ids), (segment,), False, g))
            texts.append(tok.decode(out, skip_special_tokens=True))
        return collate(trajectories, tok.pad_token_id, policy_version, lambda _: texts)


def calls_then_answers(context: str) -> str:
    return _call(12, 30) if "42" not in context.split("<|assistant|>", 1)[-1] else "The answer is 42."


def test_a_turn_keeps_the_parsers_special_markers_and_drops_eos_and_pad(tokenizer) -> None:
    ids = tokenizer(_call(1, 2), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id,
                                                                          tokenizer.pad_token_id]
    assert turn_decoder(tokenizer, ("<tool_call>", "</tool_call>"))(torch.tensor(ids)) == _call(1, 2)
    # Without markers to keep (an environment), a turn is decoded as every completion is.
    assert turn_decoder(tokenizer, ())(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_calls_written_with_special_token_markers_are_parsed_and_executed(tokenizer) -> None:
    tokenizer.chat_template = TOOLS_TEMPLATE
    box = ToolBox([ADD], parser="hermes", timeout_s=5.0, max_chars=200, max_workers=1)
    engine = Scripted(calls_then_answers, tokenizer)
    renderer = Renderer(tokenizer, "auto", box.schemas(), engine.policy.eos_token_ids)
    rollout = AgentEngine(engine, renderer, lambda p: {"prompt": p}, tools=box).generate(
        ["What is 12 + 30?"], 2, SamplingParams(max_new_tokens=64))
    metrics = agent_metrics(rollout.episodes)
    assert metrics["tools/calls_per_trajectory"] == 1.0 and metrics["tools/malformed_rate"] == 0.0
    assert [m["content"] for m in rollout.episodes[0].transcript()][2] == "42"      # the tool's result
    assert rollout.texts == ["The answer is 42."] * 2


@pytest.mark.parametrize(("template", "warned"), [(IGNORES_TOOLS, True), (TOOLS_TEMPLATE, False)])
def test_a_template_that_ignores_tools_is_a_warning_at_start(tokenizer, capsys, template: str, warned: bool) -> None:
    tokenizer.chat_template = template
    engine = Scripted(calls_then_answers, tokenizer)
    agent = build_agent(RolloutConfig(tools=[ADD], tool_parser="hermes"), None, "auto", engine, ArithmeticTask())
    assert agent is not None and agent.tools.parser == "hermes"
    agent.tools.close()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:")]
    assert lines == ([
        "warning: the model's chat template ignores `tools` (it renders the same prompt with and without the schemas "
        "of rollout.tools), so the model is never shown its tools; rollout.tool_parser=hermes will find only the "
        "calls it makes unprompted: use a model whose chat template renders tools, or describe the tools and their "
        "call format in prompt.system"] if warned else [])


@pytest.mark.parametrize("template", [TOOLS_TEMPLATE, None])
def test_teacher_traces_tokenized_together_are_the_renderers_turns_and_replies(tokenizer, template) -> None:
    """trace_tokens_many (every text of every trace in one tokenizer call) gives each trace as the rollout holds
    it: the renderer's prompt, each model turn's tokens and eos (trained on), the renderer's reply after it."""
    tokenizer.chat_template = template
    renderer = Renderer(tokenizer, "auto", [{"name": "add"}], [tokenizer.eos_token_id])
    eos = tokenizer.eos_token_id
    conversations = [
        ([{"role": "user", "content": f"What is {a} + {b}?"}],
         [{"role": "assistant", "content": _call(a, b)}, {"role": "tool", "content": str(a + b)},
          {"role": "assistant", "content": f"The answer is {a + b}."}][:turns])
        for a, b, turns in [(12, 30, 3), (1, 2, 1), (7, 8, 2), (40, 2, 3)]]
    traces = trace_tokens_many(renderer, conversations, eos)
    for (opening, turns), (prompt, completion, trained) in zip(conversations, traces, strict=True):
        expected, mask, messages = [], [], list(opening)
        for m in turns:
            if m["role"] == "assistant":
                part, on = renderer.encode(m["content"]) + [eos], 1.0
            else:
                part, on = renderer.reply(messages, [*messages, m], [eos]), 0.0
            expected, mask, messages = expected + part, mask + [on] * len(part), [*messages, m]
        assert prompt == renderer.prompt(opening)
        assert completion == expected and trained == mask
    # the templated trace's reply renders the tool's turn and opens the assistant's next one
    if template:
        assert tokenizer.decode(traces[0][1]).count("<|tool|>42<|im_end|><|assistant|>") == 1
