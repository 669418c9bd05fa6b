"""Whether a run is multi-turn, and its agent rollout: read from the rollout and task sections.

A run plays episodes when it names an environment (`task.environment`) or has tools (`rollout.tools`,
or the task's own when that is not given); otherwise it stays single-turn and nothing here runs.
"""

from __future__ import annotations

from typing import Any

from reinforge.agents.environment import load_environment
from reinforge.agents.episode import EpisodeLimits, RewardMode
from reinforge.agents.render import Renderer
from reinforge.agents.rollout import AgentEngine
from reinforge.agents.tools import ToolBox, parser_for
from reinforge.errors import ConfigError
from reinforge.settings import RolloutConfig
from reinforge.tasks import Example, Task


def run_tools(rollout: RolloutConfig, environment: str | None, task: Task) -> list[str]:
    """The tools this run gives the model: rollout.tools, else the task's own; none with an environment."""
    tools = list(task.tools) if rollout.tools is None else list(rollout.tools)
    if environment is not None and rollout.tools:
        raise ConfigError(f"task.environment={environment!r} and rollout.tools={rollout.tools} cannot be combined: an "
                          "environment answers every model turn itself (call your tools from its step)")
    return [] if environment is not None else tools


def check_agent(rollout: RolloutConfig, environment: str | None, task: Task) -> type | None:
    """Before anything loads: the environment class (None without one), its protocol checked, and the
    tools' names; ConfigError naming the key otherwise. Marks `task.use_tools` for its SFT traces."""
    tools = run_tools(rollout, environment, task)
    task.use_tools = bool(tools)
    if tools:
        try:
            ToolBox(tools, timeout_s=rollout.tool_timeout_s, max_chars=rollout.tool_max_chars).close()
        except ValueError as err:
            raise ConfigError(f"rollout.tools: {err}") from None
    return load_environment(environment) if environment is not None else None


def build_agent(rollout: RolloutConfig, environment: str | None, chat_template: str, engine: Any,
                task: Task, environment_reward: RewardMode = "trajectory") -> AgentEngine | None:
    """The agent rollout over `engine` when the run is multi-turn, else None."""
    environment_class = check_agent(rollout, environment, task)
    tools = run_tools(rollout, environment, task)
    if environment_class is None and not tools:
        return None
    tokenizer = engine.policy.tokenizer
    box = None
    if tools:
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        # Without a chat template the conversation is plain text with Hermes-form calls (agents/render.py).
        name = "hermes" if template is None and rollout.tool_parser == "auto" else rollout.tool_parser
        try:
            parser = parser_for(template, name)
        except ValueError as err:
            raise ConfigError(f"rollout.tool_parser={rollout.tool_parser}: {err}") from None
        box = ToolBox(tools, parser=parser, timeout_s=rollout.tool_timeout_s, max_chars=rollout.tool_max_chars)
    renderer = Renderer(tokenizer, chat_template, box.schemas() if box is not None else None,
                        engine.policy.eos_token_ids)
    if box is not None and renderer.ignores_tools():
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True).print(escape(
            f"warning: the model's chat template ignores `tools` (it renders the same prompt with and without the "
            f"schemas of rollout.tools), so the model is never shown its tools; rollout.tool_parser={box.parser} "
            "will find only the calls it makes unprompted: use a model whose chat template renders tools, or describe "
            "the tools and their call format in prompt.system"), soft_wrap=True, highlight=False)
    limits = EpisodeLimits(max_turns=rollout.max_turns, max_model_tokens=rollout.max_model_tokens,
                           max_environment_tokens=rollout.max_environment_tokens)
    return AgentEngine(engine, renderer, ExampleRows(task), environment=environment_class, tools=box, limits=limits,
                       max_tool_calls=rollout.max_tool_calls, continuation=rollout.continuation,
                       reward_mode=environment_reward)


class ExampleRows:
    """A prompt's dataset row, what an environment's reset receives: the example's prompt, answer and
    fields (`meta`). The engines take prompts, and a task's prompts are unique within it (its splits
    drop duplicates), so the prompt finds its example."""

    def __init__(self, task: Task):
        self.task = task
        self.by_prompt: dict[str, Example] = {}

    def __call__(self, prompt: str) -> dict[str, Any]:
        example = self.by_prompt.get(prompt)
        if example is None:
            for e in self.task.drawn():
                self.by_prompt.setdefault(e.prompt, e)
            example = self.by_prompt.get(prompt)
        if example is None:
            return {"prompt": prompt}
        return {**example.meta, "prompt": example.prompt, "answer": example.answer}
