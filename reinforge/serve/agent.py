"""Agents as plain functions, trained through the endpoint: `task.agent=module:function` (or
`path/to/file.py:function`).

    def my_agent(client: openai.OpenAI, row: dict) -> float | dict:
        reply = client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...                                   # any number of calls, tools, sub-agents, its own loop
        return reward                         # or {"reward": reward, "any_metric": value}

An `async def` agent gets an `openai.AsyncOpenAI` client instead. The client is bound to the run's
endpoint (reinforge/serve/endpoint.py) with the episode's own API key, so every token the agent is
given is recorded against its episode; the trajectory the learner trains on is built from those
records (reinforge/serve/records.py), never from the text the agent holds.

`AgentFunctions` is a rollout engine: for each prompt it runs `group_size` episodes of the agent on the
prompt's dataset row, many at once (threads; the engine batches their calls), and returns the same
`Rollout` an environment's episodes give (reinforge/agents/rollout.py: `AgentRow`), the agent's reward
as the episode's return. An episode fails alone, with its reason recorded (env/error_rate, samples.jsonl)
and no gradient from it, when its agent raises, returns something that is not a number, runs past
`task.agent_timeout_s` (its thread is abandoned: Python cannot stop a thread; its later requests are
refused), makes no call, or asks for other sampling settings than the run's.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from numbers import Real
from typing import Any

import torch

from reinforge.agents.environment import split_import_name
from reinforge.agents.episode import EpisodeResult
from reinforge.agents.rollout import AgentRow
from reinforge.data.chat import Conversation
from reinforge.errors import ConfigError
from reinforge.rewards.conventions import import_user_function
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.sampling import draw_group_keys, row_keys
from reinforge.rollout.trajectory import collate
from reinforge.serve.endpoint import Endpoint
from reinforge.serve.records import EpisodeLog, share_prompt, trajectory, transcript

KEY = "task.agent"
PROTOCOL = "def agent(client, row) -> float | dict (an OpenAI client bound to the policy, the dataset row)"
MODEL_NAME = "policy"


@dataclass(frozen=True)
class EndpointRow(AgentRow):
    """An agent episode's row: AgentRow, plus the agent's own metrics and the endpoint's figures."""

    metrics: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# Naming an agent
# ----------------------------------------------------------------------------------------------------------------


def load_agent(name: str) -> Callable[[Any, dict], Any]:
    """The agent `name` names, ready to call as agent(client, row): a function ('module:function',
    'path/to/file.py:function'), a TRL environment_factory class ('module:Class', reinforge/serve/trl_env.py) or a
    verifiers environment ('verifiers:ENV_ID', reinforge/serve/verifiers_env.py). ConfigError naming task.agent
    otherwise; no episode runs."""
    if name.startswith("verifiers:"):
        from reinforge.serve.verifiers_env import verifiers_agent

        env_id = name.split(":", 1)[1]
        if not env_id:
            raise ConfigError(f"{KEY}={name!r} names no environment: 'verifiers:ENV_ID', the id of an installed "
                              "verifiers taskset package")
        return verifiers_agent(env_id)
    found = _import(name)
    if inspect.isclass(found):
        from reinforge.serve.trl_env import trl_agent

        return trl_agent(found, name)
    if not callable(found):
        raise ConfigError(f"{KEY}={name!r} is a {type(found).__name__}, not a function: {PROTOCOL}")
    try:
        inspect.signature(found).bind(None, {})
    except TypeError:
        raise ConfigError(f"{KEY}={name!r}: {getattr(found, '__name__', name)}{inspect.signature(found)} cannot be "
                          f"called with (client, row): {PROTOCOL}") from None
    except ValueError:   # a builtin without a readable signature: its call will tell
        pass
    return found


def _import(name: str) -> Any:
    module_name, attr = split_import_name(KEY, name, "'module:function', 'path/to/file.py:function' or "
                                                     "'verifiers:ENV_ID'")
    try:
        found = import_user_function(name, "agent")
        if found is None:
            import importlib

            found = getattr(importlib.import_module(module_name), attr)
        return found
    except AttributeError:
        raise ConfigError(f"{KEY}={name!r}: '{module_name}' has no '{attr}'") from None
    except ImportError as err:
        raise ConfigError(f"{KEY}={name!r} cannot be imported: {err}") from None
    except ValueError as err:
        raise ConfigError(f"{KEY}={name!r}: {err}") from None


def openai_module() -> Any:
    try:
        import openai
    except ImportError:
        raise ConfigError(f"{KEY} gives agents an OpenAI client: pip install 'reinforge[extras]' (openai)") from None
    return openai


# ----------------------------------------------------------------------------------------------------------------
# Running episodes
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """One episode's agent call as it runs in its thread."""

    log: EpisodeLog
    row: dict
    group: int                      # its prompt's index in the batch
    state: str = "waiting"          # waiting -> running -> done | timed_out
    started: float = 0.0
    value: Any = None
    error: str | None = None


class AgentFunctions:
    """A rollout engine whose samples are episodes of an agent function (see the module docstring).

    `rows(prompt)` gives the dataset row a prompt came from; `agent(client, row)` is the loaded agent."""

    def __init__(self, engine: Any, agent: Callable[[Any, dict], Any], rows: Callable[[str], Mapping[str, Any]],
                 timeout_s: float = 60.0, concurrency: int | None = None, max_calls: int | None = None,
                 chat_template: str = "auto", tool_parser: str = "hermes"):
        self.engine, self.agent, self.rows = engine, agent, rows
        self.timeout_s, self.concurrency, self.max_calls = timeout_s, concurrency, max_calls
        self.chat_template, self.tool_parser = chat_template, tool_parser
        self.policy = engine.policy
        self.openai = openai_module()
        self.is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(
            type(agent).__call__)

    @torch.no_grad()
    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None, group_keys: torch.Tensor | None = None) -> Rollout:
        """`group_size` episodes of each prompt's row, the endpoint up for as long as they run."""
        if group_keys is None:
            group_keys = draw_group_keys(len(prompts), generator)
        keys = row_keys(group_keys.to(torch.long), group_size).tolist()
        n = len(prompts) * group_size
        concurrency = min(self.concurrency or n, n)
        endpoint = Endpoint(self.engine, MODEL_NAME, self.chat_template, self.tool_parser, slots=concurrency)
        with endpoint, endpoint.serving(params, policy_version, generator) as sampler:
            runs = []
            for g, prompt in enumerate(prompts):
                row = _plain_row(self.rows(prompt))
                for j in range(group_size):
                    log = endpoint.open_episode((keys[g * group_size + j] * 1_000_003) % 2**62, self.max_calls)
                    runs.append(_Run(log, dict(row), g))
            self._play(runs, endpoint, concurrency)
            concurrency, continued = sampler.busy_max, sampler.continued
        return self._rollout(runs, policy_version, concurrency, continued)

    def _play(self, runs: list[_Run], endpoint: Endpoint, concurrency: int) -> None:
        import httpx

        # One connection pool for the batch's clients (each client is cheap then; the pool outlives a hung agent).
        http = httpx.Client(verify=False, timeout=self.timeout_s,
                            limits=httpx.Limits(max_connections=concurrency + 8))
        slots = threading.Semaphore(concurrency)
        lock = threading.Lock()

        def play(run: _Run) -> None:
            slots.acquire()
            with lock:
                run.state, run.started = "running", time.monotonic()
            try:
                value = self._call(run, endpoint, http)
                error = None
            except Exception as err:  # the user's agent: its episode fails with the reason, the run goes on
                value, error = None, f"the agent raised {type(err).__name__}: {err}"
            with lock:
                if run.state != "running":      # it timed out: its slot was already given back
                    return
                run.state, run.value, run.error = "done", value, error
            endpoint.close_episode(run.log)
            slots.release()

        for run in runs:
            threading.Thread(target=play, args=(run,), name="reinforge-agent", daemon=True).start()
        while True:
            with lock:
                now = time.monotonic()
                for run in runs:
                    if run.state == "running" and now - run.started > self.timeout_s:
                        run.state = "timed_out"
                        run.error = (f"the agent did not return within {self.timeout_s:g} s (task.agent_timeout_s); "
                                     "its later requests are refused")
                        endpoint.close_episode(run.log)
                        slots.release()
                if all(r.state in ("done", "timed_out") for r in runs):
                    break
            time.sleep(0.01)
        http.close()       # a timed-out agent still running gets a closed client: its episode has ended

    def _call(self, run: _Run, endpoint: Endpoint, http: Any) -> Any:
        options = {"base_url": endpoint.url, "api_key": run.log.token, "max_retries": 0, "timeout": self.timeout_s}
        if self.is_async:
            async def main() -> Any:
                import httpx

                # Plain HTTP to loopback: no TLS context (loading CA certificates costs ~20 ms a client).
                async with httpx.AsyncClient(verify=False, timeout=self.timeout_s) as transport, \
                        self.openai.AsyncOpenAI(**options, http_client=transport) as client:
                    return await self.agent(client, run.row)

            return asyncio.run(main())
        return self.agent(self.openai.OpenAI(**options, http_client=http), run.row)

    # ---------------------------------------------------------------- the batch view

    def _rollout(self, runs: list[_Run], version: int, concurrency: int, continued: int) -> Rollout:
        tokenizer = self.policy.tokenizer
        trajectories, rows, texts = [], [], []
        for run in runs:
            log = run.log
            traj, chain = trajectory(list(log.calls), group=run.group)
            reward, metrics, error = math.nan, {}, run.error
            if error is None:
                try:
                    reward, metrics = checked_result(run.value)
                except ValueError as err:
                    error = str(err)
            if error is None and log.refusals:
                error = f"the endpoint refused a request of the agent: {log.refusals[0]}"
            if error is None and not chain:
                error = "the agent made no call to the endpoint: the episode has no tokens to train on"
            stop = "error" if error else (log.limit or "done")
            result = EpisodeResult(trajectory=traj, messages=tuple(transcript(chain, tokenizer)),
                                   turn_rewards=() if error else (reward,), reward_mode="trajectory",
                                   turns=len(chain), stop_reason=stop, error=error)
            calls = list(log.calls)
            total = sum(len(r.log.calls) for r in runs)
            figures = {"endpoint/calls_per_episode": float(len(calls)),
                       "endpoint/continued_frac": continued / total if total else 0.0,
                       "endpoint/untrained_calls": float(len(calls) - len(chain)),
                       "endpoint/concurrency_max": float(concurrency)}
            if calls:
                figures["endpoint/latency_s"] = sum(c.latency_s for c in calls) / len(calls)
            figures.update({f"agent/{k}": v for k, v in metrics.items()})
            rows.append(EndpointRow(result, None, False, math.nan if error else reward, figures))
            trajectories.append(traj)
            texts.append(_last_text(chain, tokenizer))
        groups: dict[int, list[int]] = {}
        for i, run in enumerate(runs):
            groups.setdefault(run.group, []).append(i)
        for rows_of_group in groups.values():
            shared = share_prompt([trajectories[i] for i in rows_of_group])
            for i, traj in zip(rows_of_group, shared, strict=True):
                trajectories[i] = traj
                rows[i] = replace(rows[i], result=replace(rows[i].result, trajectory=traj))
        rollout = collate(trajectories, tokenizer.pad_token_id or 0, version, lambda _: texts)
        rollout.episodes = rows
        return rollout


def _plain_row(row: Mapping[str, Any]) -> dict:
    """The row an agent receives: a chat prompt as its list of messages, everything else as it is."""
    out = dict(row)
    if isinstance(out.get("prompt"), Conversation):
        out["prompt"] = out["prompt"].as_list()
    elif isinstance(out.get("prompt"), str):
        out["prompt"] = str(out["prompt"])
    return out


def _last_text(chain: list, tokenizer: Any) -> str:
    if not chain:
        return ""
    last = chain[-1]
    if last.messages:
        return str(last.messages[-1].get("content") or "")
    return tokenizer.decode(last.token_ids.tolist(), skip_special_tokens=True)


def checked_result(value: Any) -> tuple[float, dict[str, float]]:
    """An agent's return as (reward, metrics): a finite real number, or a dict with one under 'reward' and
    numbers under its other keys. ValueError saying what came back otherwise."""
    if type(value).__module__.split(".")[0] in ("numpy", "torch") and getattr(value, "ndim", None) == 0:
        value = value.item()
    metrics: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise ValueError(f"the agent returned a dict without 'reward' (keys {sorted(map(str, value))}): "
                             "return a number, or {'reward': number, ...metrics}")
        for key, metric in value.items():
            if key != "reward":
                if isinstance(metric, bool) or not isinstance(metric, Real) or not math.isfinite(metric):
                    raise ValueError(f"the agent returned metric {key!r} = {metric!r}: metrics are finite numbers")
                metrics[str(key)] = float(metric)
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"the agent returned {type(value).__name__} {value!r} as its reward: return a finite "
                         "number (bool: wrap it in float(...))")
    return float(value), metrics
