"""Whether a run's samples are agent episodes through the endpoint (`task.agent`), read from its config.

The run's job calls `check_agent_functions` before anything loads (the agent is imported and checked,
and the options it cannot be combined with are refused) and `build_agent_functions` where it builds
its engine: the returned `AgentFunctions` replaces the engine for training and evaluation alike.
"""

from __future__ import annotations

from typing import Any

from reinforge.agents.render import Renderer
from reinforge.agents.setup import ExampleRows
from reinforge.agents.tools import parser_for, tool_function, tool_schema
from reinforge.errors import ConfigError
from reinforge.serve.agent import KEY, AgentFunctions, load_agent, openai_module
from reinforge.settings import RolloutConfig
from reinforge.tasks import Task


def check_agent_functions(agent: str | None, environment: str | None, rollout: RolloutConfig, mode: str,
                          backend: str) -> None:
    """ConfigError for a `task.agent` that cannot run, or runs with options it cannot be combined with."""
    if agent is None:
        return
    if environment is not None:
        raise ConfigError(f"{KEY}={agent!r} and task.environment={environment!r} cannot be combined: an agent "
                          "plays its own episodes (wrap the environment's reset/step in the agent's loop)")
    if rollout.tools:
        raise ConfigError(f"{KEY}={agent!r} and rollout.tools={rollout.tools} cannot be combined: the agent gives "
                          "the model its tools itself (`tools=` in its chat requests)")
    if mode != "sync" or backend != "local":
        raise ConfigError(f"{KEY} runs its episodes through the endpoint of the synchronous loop in one process: "
                          "set train.mode=sync and backend=local")
    openai_module()
    load_agent(agent)


def build_agent_functions(agent: str | None, timeout_s: float, concurrency: int | None, rollout: RolloutConfig,
                          chat_template: str, engine: Any, task: Task) -> AgentFunctions | None:
    """The agent rollout over `engine` when the run names `task.agent`, else None."""
    if agent is None:
        return None
    functions = AgentFunctions(engine, load_agent(agent), ExampleRows(task), timeout_s=timeout_s,
                               concurrency=concurrency, max_calls=rollout.max_turns, chat_template=chat_template,
                               tool_parser=tool_parser(engine.policy, rollout))
    functions.chat_template = engine.chat_template
    # A task with tools (multiply_tool) cold-starts on tool conversations: rendered as the endpoint renders a
    # chat request that offers those tools.
    schemas = [tool_schema(tool_function(spec), spec) for spec in task.tools] if task.use_tools else None
    functions.renderer = Renderer(engine.policy.tokenizer, chat_template, schemas, engine.policy.eos_token_ids)
    return functions


def tool_parser(policy: Any, rollout: RolloutConfig) -> str:
    """The parser of the model family's tool calls (rollout.tool_parser; auto: by its chat template), Hermes
    (the form of the built-in tools) when auto finds none."""
    template = policy.tokenizer.chat_template
    try:
        return parser_for(template if isinstance(template, str) else None, rollout.tool_parser)
    except ValueError as err:
        if rollout.tool_parser != "auto":
            raise ConfigError(f"rollout.tool_parser={rollout.tool_parser}: {err}") from None
        return "hermes"
