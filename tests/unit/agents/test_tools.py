"""The tool layer (reinforge/agents/tools.py): parsing calls, schemas, bounded execution, counters."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from repo_paths import TESTS

from reinforge.agents.tools import (
    TOOL_CALL_PARSERS,
    ParsedTurn,
    ToolBox,
    ToolCall,
    ToolResult,
    ToolStats,
    clip,
    parse_hermes,
    parser_for,
)

FIXTURES = TESTS / "tool_fixtures.py"
TIMEOUT_S = 2.0

# The part of Qwen2.5-Instruct's chat template that tells the model how to call tools.
QWEN_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}# Tools\\n\\nYou may call one or more functions to assist with "
    "the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
    "{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}</tools>\\n\\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n{%- endif %}'
)


@pytest.fixture(scope="module")
def box():
    # One worker: the calls here run one at a time, and the machine has two cores for everything.
    with ToolBox(["tool_fixtures:add", "tool_fixtures:lookup", "tool_fixtures:fail", "tool_fixtures:hang",
                  "tool_fixtures:huge", "tool_fixtures:die", "python"], timeout_s=TIMEOUT_S, max_workers=1) as box:
        yield box


# ---- parsing


def test_hermes_one_call_and_the_text_before_it() -> None:
    text = 'Let me add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert parse_hermes(text) == ParsedTurn("Let me add them.", [ToolCall("add", {"a": 1, "b": 2})], 0, [])


def test_hermes_two_calls_in_order_and_no_call() -> None:
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo", "fields": []}}\n</tool_call>')
    assert parse_hermes(text) == ParsedTurn(
        "", [ToolCall("add", {"a": 1}), ToolCall("lookup", {"city": "Oslo", "fields": []})], 0, [])
    assert parse_hermes("  The answer is 3.\n") == ParsedTurn("The answer is 3.", [], 0, [])


def test_hermes_each_malformed_kind_is_counted_with_its_reason() -> None:
    blocks = [
        '{"name": "add", "arguments": {"a": 1}',            # 1: JSON cut short: 37 characters, '}' due at char 37
        '["add", {"a": 1}]',                                # 2: not an object
        '{"arguments": {"a": 1}}',                          # 3: no name
        '{"name": 7, "arguments": {"a": 1}}',               # 4: name not a string
        '{"name": "add", "arguments": "{\\"a\\": 1}"}',     # 5: arguments as a JSON string
        '{"name": "add"}',                                  # 6: no arguments
        '{"name": "add", "arguments": {"a": 5}}',           # 7: fine
    ]
    text = "".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks) + '<tool_call>\n{"name": "add", "argu'
    turn = parse_hermes(text)
    assert turn.calls == [ToolCall("add", {"a": 5})]
    assert turn.malformed == 7
    assert turn.errors == [
        "tool call 1: invalid JSON (Expecting ',' delimiter: line 1 column 38 (char 37))",
        "tool call 2: the JSON is a list, not an object",
        "tool call 3: no string 'name'",
        "tool call 4: 'name' is a int",
        "tool call 5: 'arguments' must be a JSON object, it is a str",
        "tool call 6: 'arguments' must be a JSON object, it is missing",
        "tool call 8: no </tool_call> closes the block",
    ]


def test_a_block_opened_inside_another_closes_the_first() -> None:
    text = '<tool_call>\n{"name": "add", <tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    turn = parse_hermes(text)
    assert (turn.calls, turn.errors) == ([ToolCall("add", {"a": 2})], ["tool call 1: no </tool_call> closes the block"])


def test_parser_for_reads_the_chat_template() -> None:
    assert parser_for(QWEN_TEMPLATE) == "hermes"
    assert parser_for(None, "hermes") == "hermes"
    assert TOOL_CALL_PARSERS["hermes"] is parse_hermes
    with pytest.raises(ValueError, match=r"^unknown tool-call parser 'hermez'; did you mean 'hermes'\? "
                                         r"\(known: hermes\)$"):
        parser_for(QWEN_TEMPLATE, "hermez")
    with pytest.raises(ValueError, match=r"its chat template marks no format known here\); name a parser, one of: "
                                         r"hermes$"):
        parser_for("{{ messages[0]['content'] }}")
    with pytest.raises(ValueError, match=r"\(the model has no chat template\)"):
        parser_for(None)


# ---- schemas and names


def test_schema_of_a_typed_documented_function() -> None:
    # Hand-written from tool_fixtures.add: int -> "integer", the docstring's summary and Args lines,
    # `a` required because it has no default.
    with ToolBox([f"{FIXTURES}:add"]) as box:
        assert box.schemas() == [{
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "a": {"type": "integer", "description": "The first integer."},
                        "b": {"type": "integer", "description": "The second integer."},
                    },
                    "required": ["a"],
                },
                "return": {"type": "integer"},
            },
        }]


def test_functions_without_hints_or_docstring_args_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^tool 'tool_fixtures:untyped': Argument a is missing a type hint in "
                                         r"function untyped \(a tool needs a type hint on every argument"):
        ToolBox(["tool_fixtures:untyped"])
    with pytest.raises(ValueError, match=r"^tool 'tool_fixtures:undocumented': Cannot generate JSON schema for "
                                         r"undocumented because the docstring has no description for the argument 'a'"):
        ToolBox(["tool_fixtures:undocumented"])


def test_bad_tool_names() -> None:
    with pytest.raises(ValueError, match=r"^unknown tool 'pyhton'; did you mean 'python'\? \(known: python\)$"):
        ToolBox(["pyhton"])
    with pytest.raises(ValueError, match=r"^tool 'missing.py:f': file 'missing.py' does not exist$"):
        ToolBox(["missing.py:f"])
    with pytest.raises(ValueError, match=r"^tools 'tool_fixtures:add' and '.*tool_fixtures.py:add' are both named"):
        ToolBox(["tool_fixtures:add", f"{FIXTURES}:add"])


# ---- execution


def test_a_call_and_a_structured_result(box: ToolBox) -> None:
    assert box.call(ToolCall("add", {"a": 2, "b": 3})) == ToolResult("add", "5", None, False, False)
    result = box.call(ToolCall("lookup", {"city": "Oslo", "fields": ["rain"]}))
    assert result.message() == {
        "role": "tool", "name": "lookup", "content": '{"city": "Oslo", "fields": ["rain"], "temperature": 21.5}'}


def test_an_async_tool_is_awaited() -> None:
    with ToolBox([f"{FIXTURES}:shout"], max_workers=1) as box:
        assert box.call(ToolCall("shout", {"text": "hi"})) == ToolResult("shout", "HI", None, False, False)


def test_what_goes_wrong_becomes_an_observation(box: ToolBox) -> None:
    cases = [
        (ToolCall("fail", {"message": "no such\ncity"}), "Error: the tool raised ValueError: no such city"),
        (ToolCall("ad", {"a": 1}),
         "Error: unknown tool 'ad'; did you mean 'add'? (known: add, die, fail, hang, huge, lookup, python)"),
        (ToolCall("add", {"x": 1}),
         "Error: arguments do not fit add(a, b=0): missing a required argument: 'a'"),
        (ToolCall("add", {"a": 1, "c": 2}),
         "Error: arguments do not fit add(a, b=0): got an unexpected keyword argument 'c'"),
        (ToolCall("die", {}), "Error: the tool's process died before answering (exit, crash or out of memory)"),
        (ToolCall("python", {"code": 7}), "Error: argument 'code' must be a string, got int"),
    ]
    for call, content in cases:
        assert box.call(call).message() == {"role": "tool", "name": call.name, "content": content}


def test_a_hanging_tool_times_out_and_the_next_call_works(box: ToolBox) -> None:
    box.call(ToolCall("add", {"a": 0}))   # a worker is up: the time below is the bound and the kill alone
    start = time.monotonic()
    result = box.call(ToolCall("hang", {"seconds": 3600}))
    elapsed = time.monotonic() - start
    assert result == ToolResult("hang", "", "timed out after 2 s; the call was stopped", True, False)
    assert result.message()["content"] == "Error: timed out after 2 s; the call was stopped"
    assert elapsed < TIMEOUT_S + 2.0
    assert box.call(ToolCall("add", {"a": 1})) == ToolResult("add", "1", None, False, False)   # on a fresh worker


def test_a_program_that_loops_forever_times_out_in_the_sandbox(box: ToolBox) -> None:
    start = time.monotonic()
    result = box.call(ToolCall("python", {"code": "while True:\n    pass"}))
    assert time.monotonic() - start < TIMEOUT_S + 2.0
    assert result == ToolResult("python", "", "timed out after 2 s; the call was stopped", True, False)


def test_a_10_mb_result_is_cut_to_max_chars(box: ToolBox) -> None:
    result = box.call(ToolCall("huge", {"megabytes": 10}))
    # The marker "\n[truncated: 10000000 characters, the first 4041 shown]" is 55 characters: 4096 - 55 = 4041 kept.
    marker = "\n[truncated: 10000000 characters, the first 4041 shown]"
    assert len(marker) == 55
    assert result == ToolResult("huge", "x" * 4041 + marker, None, False, True)
    assert len(result.content) == box.max_chars == 4096
    assert clip("short", 100) == ("short", False)


def test_the_python_tool_runs_in_the_sandbox(box: ToolBox) -> None:
    assert box.call(ToolCall("python", {"code": "print(2*3)"})) == ToolResult("python", "6\n", None, False, False)
    failed = box.call(ToolCall("python", {"code": "print(1)\nraise KeyError('k')"}))
    assert failed.message()["content"] == "1\nError: program raised: KeyError: 'k'"


def test_no_state_carries_from_one_python_call_to_the_next(box: ToolBox) -> None:
    # Files in the work directory, in /tmp or /dev/shm: each call starts from nothing, and the
    # host keeps nothing (the hook refuses the shared places; private tmpfs and Landlock too).
    plant = ("import os\nopen('state.txt', 'w').write('1')\n"
             "for p in ('/tmp/rf-tool-state', '/dev/shm/rf-tool-state'):\n"
             "    try:\n        open(p, 'w').write('1')\n    except OSError:\n        pass\n"
             "print(sorted(os.listdir('.')))")
    assert box.call(ToolCall("python", {"code": plant})).content == "['state.txt']\n"
    look = ("import os\nprint(sorted(os.listdir('.')), [os.path.exists(p) for p in "
            "('/tmp/rf-tool-state', '/dev/shm/rf-tool-state')])")
    assert box.call(ToolCall("python", {"code": look})).content == "[] [False, False]\n"
    assert not Path("/tmp/rf-tool-state").exists() and not Path("/dev/shm/rf-tool-state").exists()


def test_stats_count_every_outcome() -> None:
    with ToolBox(["tool_fixtures:add", "tool_fixtures:hang", "tool_fixtures:huge"], timeout_s=TIMEOUT_S,
                 max_chars=100, max_workers=1) as box:
        turn = box.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><tool_call>\n{"name"')
        assert turn.malformed == 1
        for call in [*turn.calls, ToolCall("nope", {}), ToolCall("huge", {"megabytes": 1}),
                     ToolCall("hang", {"seconds": 3600})]:
            box.call(call)
        assert box.stats == ToolStats(calls=4, errors=2, timeouts=1, truncated=1, malformed=1)
        assert box.stats.as_metrics() == {
            "tools/calls": 4.0, "tools/errors": 2.0, "tools/error_rate": 0.5, "tools/timeouts": 1.0,
            "tools/truncated": 1.0, "tools/malformed": 1.0,
        }
    assert ToolStats().as_metrics()["tools/error_rate"] == 0.0
