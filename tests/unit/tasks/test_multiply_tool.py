"""The built-in agentic task: its calculator, its teacher conversations, its config preset."""

from __future__ import annotations

import pytest

from reinforge.agents.render import Renderer, trace_tokens
from reinforge.agents.rollout import turn_decoder
from reinforge.agents.tools import parse_hermes
from reinforge.config import build_config
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.tasks import build_task
from reinforge.tasks.multiply_tool import TAGS, calculator, tool_call


def test_calculator_reads_integer_expressions_and_refuses_the_rest() -> None:
    assert calculator("012*345") == "4140" and calculator("(1+2)*-3") == "-9" and calculator("7 - 10") == "-3"
    for bad, reason in (("2**3", "expected a number"), ("(1+2", "missing ')'"), ("1/2", "unexpected '/'"),
                        ("9" * 41, "more than 40 digits")):
        with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            calculator(bad)


def test_teacher_conversations_call_the_tool_and_copy_its_result() -> None:
    task = build_task("multiply_tool", seed=3)
    task.use_tools = True
    examples = task.sft_examples(400, corrupt_fraction=0.25, seed=0)
    right = [e for e in examples if e.correct]
    assert 0.68 < len(right) / len(examples) < 0.82
    for e in right[:50]:
        call, result, answer = e.turns
        parsed = parse_hermes(call["content"])
        assert parsed.malformed == 0 and parsed.calls[0].name == "calculator"
        assert parsed.calls[0].arguments == {"expression": e.prompt.removesuffix("=")}
        assert result == {"role": "tool", "name": "calculator", "content": calculator(e.prompt.removesuffix("="))}
        assert answer["content"] == e.completion == result["content"]
    examples_by_prompt = {x.prompt: x for x in task.train_split(2000)}
    for e in examples:            # every trace's last turn is right iff the trace is marked correct
        assert task.reward(examples_by_prompt[e.prompt], e.completion) == float(e.correct)
    kinds = {len(e.turns) for e in examples if not e.correct}
    assert kinds == {1, 3}        # a guess without the tool, and wrong conversations with it


def test_without_tools_the_traces_answer_directly() -> None:
    task = build_task("multiply_tool")
    examples = task.sft_examples(20, corrupt_fraction=0.0, seed=0)
    assert all(not e.turns and e.completion.isdigit() for e in examples)


def test_the_task_preset_sits_under_the_recipe_and_the_user() -> None:
    cfg = build_config(["task.name=multiply_tool"])
    assert (cfg.rollout.max_new_tokens, cfg.model.max_positions, cfg.sft.lr, cfg.train.lr) == (96, 160, 1e-3, 1e-4)
    assert cfg.model.added_tokens == list(TAGS)
    assert build_config(["task.name=multiply_tool", "rollout.max_new_tokens=50"]).rollout.max_new_tokens == 50
    assert build_config(["task.name=multiply_tool", "recipe=areal"]).train.mode == "async"
    assert build_config([]).rollout.max_new_tokens == 8          # other tasks keep the defaults


def test_tool_call_is_compact_hermes() -> None:
    assert tool_call("1*2") == '<tool_call>{"arguments":{"expression":"1*2"},"name":"calculator"}</tool_call>'


@pytest.mark.parametrize("tags, call_tokens, reply_tokens", [((), 61 + 21, 7 + 29), (TAGS, 61, 7)])
def test_a_trace_with_the_tags_as_tokens_is_50_tokens_shorter_and_its_call_still_parses(tags, call_tokens,
                                                                                         reply_tokens) -> None:
    tok = build_char_tokenizer(tags)
    task = build_task("multiply_tool")
    task.use_tools = True
    example = next(e for e in task.sft_examples(50, corrupt_fraction=0.0, seed=0) if e.completion != "0")
    prompt, completion, trained = trace_tokens(Renderer(tok, "none"), [{"role": "user", "content": example.prompt}],
                                               list(example.turns), tok.eos_token_id)
    # "123*456=" is 8 characters; the call turn is the 58-character JSON, its two tags and eos; the reply is the
    # result (here 5 or 6 digits) in its tags; the answer is the result and eos.
    digits = len(example.completion)
    assert len(prompt) == 8
    assert trained.count(0.0) == reply_tokens - 5 + digits
    assert len(completion) == call_tokens + (reply_tokens - 5 + digits) + digits + 1
    call = completion[:call_tokens]
    assert call[-1] == tok.eos_token_id and trained[:call_tokens] == [1.0] * call_tokens
    parsed = parse_hermes(turn_decoder(tok, ())(call))      # what the rollout hands the parser
    assert parsed.malformed == 0 and parsed.calls[0].arguments == {"expression": example.prompt.removesuffix("=")}
