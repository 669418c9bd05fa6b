"""Tools an agent may call: their schemas, the parsing of calls from model text, and bounded execution.

Owns the tool conventions of multi-turn agentic RL (docs/agents.md); the
multi-turn rollout that will use them is not built yet.

* A tool is a plain Python function with type hints and a Google-style
  docstring, the transformers chat-template convention: its schema is
  `transformers.utils.get_json_schema(fn)`, the dict that
  `apply_chat_template(..., tools=[...])` renders into the prompt. A config
  names tools as `"module:function"`, `"path/to/file.py:function"` (the
  reward functions' resolver, reinforge/rewards/conventions.py) or the
  built-in `"python"`.
* Calls are parsed from the model's text in its family's own format, one
  parser per format in `TOOL_CALL_PARSERS`; `parser_for` picks one from the
  chat template.
* Nothing the model or a tool does raises out of `ToolBox.call`: an unknown
  tool, arguments that do not fit, an exception, a hang, a result that is
  not a string or is huge all end as a `ToolResult` whose `message()` is the
  observation the model sees. `ToolStats` counts them for the metrics.

Bounds. A Python function cannot be stopped from a thread, so function
tools run in worker processes of a `BoundedPool` (reinforge/verifiers/bounded.py),
killed at `timeout_s` and replaced. Workers find a tool again by its name,
not by pickling the function: a function loaded from a file lives in a
module no other process can import by name. The built-in `python` runs the
model's program in the code sandbox (reinforge/verifiers/code.py,
docs/security.md), which has its own wall-clock bound. Every result is cut
to `max_chars` before it crosses back.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reinforge.objectives.common import lookup, resolve, unknown_name_error
from reinforge.rewards.conventions import import_user_function
from reinforge.verifiers.bounded import BoundedPool
from reinforge.verifiers.code import MAX_ERROR_CHARS, run_tests

# ---- records


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for."""

    name: str             # the function's name, as in its schema
    arguments: dict       # keyword arguments, decoded from the model's JSON


@dataclass(frozen=True)
class ParsedTurn:
    """What a parser read from one assistant turn."""

    text_before: str        # the text before the first call (all of it when there is none), whitespace stripped
    calls: list[ToolCall]   # the well-formed calls, in order
    malformed: int          # calls that could not be read; each has a reason in `errors`
    errors: list[str]       # one line per malformed call, "tool call N: <reason>" (N counts from 1)


@dataclass(frozen=True)
class ToolResult:
    """How one call ended; `message()` is what the model sees of it."""

    name: str
    content: str             # the tool's output as text, at most the ToolBox's max_chars (marker included)
    error: str | None        # one line saying what went wrong (timeouts included), None on success
    timed_out: bool          # stopped at the ToolBox's timeout_s
    truncated: bool          # `content` was cut to max_chars

    def message(self) -> dict[str, str]:
        """The chat message of this result: its content, then an "Error: ..." line when the call failed."""
        text = self.content
        if self.error is not None:
            text = f"{text.rstrip()}\nError: {self.error}" if text.strip() else f"Error: {self.error}"
        return {"role": "tool", "name": self.name, "content": text}


@dataclass
class ToolStats:
    """Counters of one ToolBox, for the metrics (`as_metrics`). Updated by `ToolBox.parse` and `ToolBox.call`."""

    calls: int = 0          # calls executed (or refused: unknown tool, wrong arguments), any outcome
    errors: int = 0         # calls whose result has an error, timeouts included
    timeouts: int = 0       # calls stopped at timeout_s
    truncated: int = 0      # results cut to max_chars
    malformed: int = 0      # calls the parser could not read (never executed, not in `calls`)

    def record(self, result: ToolResult) -> None:
        self.calls += 1
        self.errors += result.error is not None
        self.timeouts += result.timed_out
        self.truncated += result.truncated

    def as_metrics(self) -> dict[str, float]:
        """`tools/calls`, `tools/errors`, `tools/error_rate` (errors / calls, 0 without calls), `tools/timeouts`,
        `tools/truncated`, `tools/malformed`: counts since the ToolBox was built."""
        return {
            "tools/calls": float(self.calls),
            "tools/errors": float(self.errors),
            "tools/error_rate": self.errors / self.calls if self.calls else 0.0,
            "tools/timeouts": float(self.timeouts),
            "tools/truncated": float(self.truncated),
            "tools/malformed": float(self.malformed),
        }


# ---- parsing calls out of model text

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes / Qwen2.5 / Qwen3 calls: blocks `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

    Malformed, each with its reason: a block without `</tool_call>` (a block
    opened inside another one closes the first), JSON that does not parse or
    is not an object, a missing or non-string "name", a missing or non-object
    "arguments" (vLLM's hermes parser refuses those too). Text between and
    after the blocks is ignored.
    """
    before, *blocks = text.split(_HERMES_OPEN)
    calls: list[ToolCall] = []
    errors: list[str] = []
    for number, block in enumerate(blocks, start=1):
        body, closed, _ = block.partition(_HERMES_CLOSE)
        reason = _hermes_reason(body) if closed else f"no {_HERMES_CLOSE} closes the block"
        if reason is None:
            decoded = json.loads(body)
            calls.append(ToolCall(decoded["name"], decoded["arguments"]))
        else:
            errors.append(f"tool call {number}: {reason}")
    return ParsedTurn(before.strip(), calls, len(errors), errors)


def _hermes_reason(body: str) -> str | None:
    """Why a closed block's body is not a call, or None when it is one."""
    try:
        decoded = json.loads(body.strip())   # positions in the error count from the object's first character
    except ValueError as err:
        return f"invalid JSON ({err})"
    if not isinstance(decoded, dict):
        return f"the JSON is a {type(decoded).__name__}, not an object"
    if not isinstance(decoded.get("name"), str):
        return "no string 'name'" if "name" not in decoded else f"'name' is a {type(decoded['name']).__name__}"
    if not isinstance(decoded.get("arguments"), dict):
        got = "missing" if "arguments" not in decoded else f"a {type(decoded['arguments']).__name__}"
        return f"'arguments' must be a JSON object, it is {got}"
    return None


# A format's parser turns one assistant turn into calls; add an entry for another model family.
TOOL_CALL_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
}

# The parser "auto" picks, by a marker its chat template renders tool calls with.
_TEMPLATE_MARKERS = {"hermes": _HERMES_OPEN}

# The text each parser reads calls by: a model may have them as special tokens (Qwen2.5's <tool_call>),
# which the decoding of a turn for its parser must keep (agents/rollout.py: turn_decoder).
TOOL_CALL_MARKERS: dict[str, tuple[str, ...]] = {"hermes": (_HERMES_OPEN, _HERMES_CLOSE)}


def parser_for(chat_template: str | None, name: str = "auto") -> str:
    """The key in TOOL_CALL_PARSERS for a model: `name` itself unless "auto", else the format its chat template
    writes calls in. ValueError naming the registry's keys for an unknown name, or when auto finds none."""
    if name != "auto":
        lookup(TOOL_CALL_PARSERS, name, "tool-call parser")
        return name
    for key, marker in _TEMPLATE_MARKERS.items():
        if chat_template is not None and marker in chat_template:
            return key
    what = "the model has no chat template" if chat_template is None else "its chat template marks no format known here"
    raise ValueError(f"cannot tell how this model writes tool calls ({what}); name a parser, one of: "
                     f"{', '.join(sorted(TOOL_CALL_PARSERS))}")


# ---- the built-in python tool

# run_tests needs a test; this one always holds, so the verdict is the program's own success.
_NO_TESTS = "assert True"
DEFAULT_TIMEOUT_S = 10.0   # one call's wall-clock bound, for the python tool called directly and ToolBox's default


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it prints (stdout and stderr).

    Args:
        code: The whole program; only the standard library is available, with no network, threads or subprocesses.
    """
    result = run_tests(code, _NO_TESTS, DEFAULT_TIMEOUT_S)
    if result.error is not None:
        raise RuntimeError(f"{result.output}{result.error}")
    return result.output


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"python": python}


# ---- resolving and running a tool (in the caller and in the workers)


@functools.cache
def tool_function(spec: str) -> Callable[..., Any]:
    """The function a tool name names: a built-in, `path/to/file.py:function` or `module:function`."""
    return import_user_function(spec, kind="tool") or resolve(BUILTIN_TOOLS, spec, "tool")


def _load_tools(specs: tuple[str, ...]) -> None:
    # A worker's warm-up: imports happen before the first timed call.
    for spec in specs:
        tool_function(spec)


def _run_tool(spec: str, arguments: dict, max_chars: int) -> tuple[str, bool]:
    # In a worker: the call, its result as text, cut here so that a huge result never crosses the pipe.
    value = tool_function(spec)(**arguments)
    if inspect.iscoroutine(value):
        value = asyncio.run(value)
    return clip(render(value), max_chars)


def render(value: object) -> str:
    """A tool's return value as the text the model reads: str as is, JSON for dict and list, else str()."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def clip(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` cut to at most `max_chars` characters, a marker line included, and whether it was cut."""
    if len(text) <= max_chars:
        return text, False
    marker = f"\n[truncated: {len(text)} characters, the first {{}} shown]"
    keep = max_chars - len(marker.format(max_chars))
    return text[:keep] + marker.format(keep), True


def _one_line(text: str) -> str:
    return " ".join(text.split())[:MAX_ERROR_CHARS]


def tool_schema(fn: Callable[..., Any], spec: str) -> dict:
    """The chat-template schema of `fn`; ValueError naming the tool and what it lacks."""
    # transformers is imported here, not at the top: the worker processes import this module and never need it.
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        return get_json_schema(fn)
    except (DocstringParsingException, TypeHintParsingException) as err:
        raise ValueError(f"tool {spec!r}: {err} (a tool needs a type hint on every argument and a docstring "
                         f"with an 'Args:' line for each, the transformers chat-template convention)") from None


def _bare_signature(fn: Callable[..., Any]) -> inspect.Signature:
    signature = inspect.signature(fn)
    empty = inspect.Parameter.empty
    parameters = [p.replace(annotation=empty) for p in signature.parameters.values()]
    return signature.replace(parameters=parameters, return_annotation=empty)


# ---- the tool box


@dataclass(frozen=True)
class _Tool:
    spec: str                      # the configured name: "python", "module:function", "file.py:function"
    fn: Callable[..., Any]
    schema: dict
    signature: inspect.Signature   # fn's, without annotations: what an error shows the model (the schema has types)


@dataclass(eq=False)   # two boxes are never the same box: each owns its workers
class ToolBox:
    """The tools of a run: their schemas for the prompt, and calls parsed and executed within bounds.

    Function tools run in worker processes of this box (started on the first call, one per concurrent call up to
    `max_workers`); `close()` stops them, as does interpreter exit.
    """

    specs: Sequence[str]            # "python", "module:function", "path/to/file.py:function"
    parser: str = "hermes"          # a key of TOOL_CALL_PARSERS (see parser_for)
    timeout_s: float = DEFAULT_TIMEOUT_S   # wall-clock bound of one call, from when its worker receives it
    max_chars: int = 4096           # a result's text is cut to this many characters, the marker included
    max_workers: int = 2            # function calls running at once; more wait for a worker
    stats: ToolStats = field(default_factory=ToolStats)

    def __post_init__(self) -> None:
        if isinstance(self.specs, str):
            raise ValueError(f"specs is a list of tool names, got the string {self.specs!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.max_chars < 100:
            raise ValueError(f"max_chars must be at least 100 (room for the truncation marker), got {self.max_chars}")
        self._parse = lookup(TOOL_CALL_PARSERS, self.parser, "tool-call parser")
        self.tools: dict[str, _Tool] = {}
        for spec in self.specs:
            fn = tool_function(spec)
            tool = _Tool(spec, fn, tool_schema(fn, spec), _bare_signature(fn))
            name = tool.schema["function"]["name"]
            if name in self.tools:
                raise ValueError(f"tools {self.tools[name].spec!r} and {spec!r} are both named {name!r}")
            self.tools[name] = tool
        workers = tuple(t.spec for t in self.tools.values() if t.spec not in BUILTIN_TOOLS)
        self._pool = BoundedPool(warmup=functools.partial(_load_tools, workers), max_workers=self.max_workers)
        self._lock = threading.Lock()

    @property
    def markers(self) -> tuple[str, ...]:
        """The text its parser finds calls by (TOOL_CALL_MARKERS); () for a parser that names none."""
        return TOOL_CALL_MARKERS.get(self.parser, ())

    def schemas(self) -> list[dict]:
        """The list to pass as `tokenizer.apply_chat_template(messages, tools=...)`."""
        return [tool.schema for tool in self.tools.values()]

    def parse(self, text: str) -> ParsedTurn:
        """The calls in one assistant turn, by this box's parser; malformed ones are counted."""
        turn = self._parse(text)
        with self._lock:
            self.stats.malformed += turn.malformed
        return turn

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call within the bounds; never raises for what the model or the tool does."""
        result = self._result(call)
        with self._lock:
            self.stats.record(result)
        return result

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        self._pool.close()

    def __enter__(self) -> ToolBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _result(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return self._failed(call.name, str(unknown_name_error("tool", call.name, self.tools)))
        try:
            tool.signature.bind(**call.arguments)
        except TypeError as err:
            return self._failed(call.name, f"arguments do not fit {call.name}{tool.signature}: {err}")
        if tool.spec in BUILTIN_TOOLS:
            return self._python(call.arguments["code"])
        try:
            outcome = self._pool.call(_run_tool, (tool.spec, call.arguments, self.max_chars), self.timeout_s)
        except RuntimeError as err:   # no worker process could be started
            return self._failed(call.name, f"the tool could not run: {err}")
        if outcome.status == "timed_out":
            return self._failed(call.name, self._timeout_error(), timed_out=True)
        if outcome.status == "crashed":
            return self._failed(call.name, "the tool's process died before answering (exit, crash or out of memory)")
        if outcome.status == "raised":
            return self._failed(call.name, f"the tool raised {outcome.error}")
        content, truncated = outcome.value
        return ToolResult(call.name, content, None, False, truncated)

    def _python(self, code: object) -> ToolResult:
        if not isinstance(code, str):
            return self._failed("python", f"argument 'code' must be a string, got {type(code).__name__}")
        result = run_tests(code, _NO_TESTS, self.timeout_s)
        content, truncated = clip(result.output, self.max_chars)
        error = self._timeout_error() if result.timed_out else result.error
        return ToolResult("python", content, None if error is None else _one_line(error), result.timed_out, truncated)

    def _timeout_error(self) -> str:
        return f"timed out after {self.timeout_s:g} s; the call was stopped"

    def _failed(self, name: str, error: str, timed_out: bool = False) -> ToolResult:
        return ToolResult(name, "", _one_line(error), timed_out, False)


__all__ = [
    "BUILTIN_TOOLS",
    "TOOL_CALL_MARKERS",
    "TOOL_CALL_PARSERS",
    "ParsedTurn",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "ToolStats",
    "clip",
    "parse_hermes",
    "parser_for",
    "python",
    "render",
    "tool_function",
    "tool_schema",
]
