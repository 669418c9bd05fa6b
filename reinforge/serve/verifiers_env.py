"""verifiers environments (the `verifiers` package, 0.4.0), trained through the endpoint:
`task.agent=verifiers:ENV_ID`.

In verifiers 0.4.0 an environment id is a taskset id: an importable package (`my-env` imports as `my_env`)
exporting its `vf.Taskset` subclass (the rows, as typed `vf.Task`s whose `@vf.reward` methods and judges
are the rubric), optionally an `vf.Env` subclass (how one task becomes an episode: one agent, several, a
simulated user) and a `vf.Harness` (the agent's program). Each episode here runs exactly as verifiers'
own training server runs one (`verifiers/v1/serve/server.py`, `EnvServer._build_task` then
`Env.run_slot`), in process: the row's task data is validated into the taskset's `TaskData` and wrapped
in its `Task`; `Env.run_episode(task, ctx)` plays it, the harness's model calls going through verifiers'
interception server (aiohttp on 127.0.0.1) to this episode's endpoint URL
(`http://127.0.0.1:PORT/e/KEY/v1`, so every token is recorded against the episode); `Task.score` runs
the rubric on the finished trace; the trace's reward (its weighted rewards summed) is the episode's.

What reinforge sets, and why:

- every role runs in verifiers' `subprocess` runtime (its default is a Prime sandbox: remote, through a
  tunnel): the run stays on this machine, with no network;
- a role whose harness neither the environment nor its taskset pins plays verifiers' `null` harness (its
  chat loop without tools of its own), not its `bash` default: `bash` runs the model's shell commands,
  which here would run on this machine outside any sandbox. A harness that executes code, or needs a
  container, is refused when named;
- verifiers starts its built-in chat loop (the `null`/`bash` program, a PEP 723 script) with `uv`, which
  installs the script's dependencies in an environment of its own. Those dependencies are verifiers' own
  (openai, mcp, httpx, ...), so they are installed here: `use_this_interpreter` checks each against the
  installed versions and enters the script in verifiers' shared interpreter cache
  (`SubprocessRuntime._interpreters`) with this Python, so it runs without uv and without a download. A
  harness whose `launch` runs its loop in process (verifiers allows it: `Harness.launch`'s docstring)
  starts no program at all.

An episode fails alone (reinforge/serve/agent.py) when verifiers reports it failed (the trace's errors,
e.g. a harness that exited non-zero or a reward function that raised), or it holds more than one
trainable trace (one episode trains one trajectory).
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import math
import re
import sys
import uuid
from collections.abc import Callable
from numbers import Real
from pathlib import Path
from typing import Any

from reinforge.errors import ConfigError
from reinforge.tasks.verifiers_taskset import PREFIX, verifiers_module

KEY = "task.agent"
MODEL_NAME = "policy"
_NO_KEY_VARIABLE = "REINFORGE_VERIFIERS_NO_API_KEY"   # unset: the episode is named by its URL, not a key


def load_env(env_id: str) -> Any:
    """The environment `env_id` names, configured to run here (see the module docstring); ConfigError
    naming task.agent for an id that does not load or a harness that cannot run on this machine."""
    vf = verifiers_module()
    where = f"{KEY}='{PREFIX}{env_id}'"
    try:
        config_cls = vf.env_config_type(env_id)
        bundled = vf.default_harness_id(env_id) != "bash"
        roles = {}
        for role, field in config_cls.model_fields.items():
            if isinstance(field.default, vf.AgentConfig):
                unpinned = field.default.harness is None and not bundled
                roles[role] = {"runtime": {"type": "subprocess"}, **({"harness": {"id": "null"}} if unpinned else {})}
        config = vf.resolve_env_config({"taskset": {"id": env_id}, **roles})
        env = vf.load_environment(config)
        harnesses = {role: vf.load_harness(cfg) for role, cfg in config.agent_harnesses().items()}
    except ConfigError:
        raise
    except Exception as err:  # the user's package or verifiers' loaders: one line with verifiers' own reason
        raise ConfigError(f"{where}: verifiers cannot load it: {type(err).__name__}: {err}") from None
    task_cls = type(env.taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        raise ConfigError(f"{where}: its tasks ({task_cls.__name__}) need a container runtime (NEEDS_CONTAINER); "
                          "reinforge runs verifiers environments on this machine (verifiers' subprocess runtime)")
    for role, harness in harnesses.items():
        name = harness.config.id
        if harness.NEEDS_CONTAINER or harness.EXECUTES_CODE:
            why = "needs a container runtime" if harness.NEEDS_CONTAINER else "runs the model's code"
            raise ConfigError(f"{where}: its agent {role!r} plays the harness {name!r}, which {why}; reinforge runs "
                              "verifiers environments on this machine, outside any sandbox: give the role a harness "
                              "that runs no code (verifiers' 'null', or the taskset's own harness that runs its loop "
                              "in process)")
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    use_this_interpreter(CHAT_PROGRAM_SOURCE, where)
    return env


def use_this_interpreter(script: str, where: str) -> Path:
    """Make verifiers' subprocess runtime run the PEP 723 `script` with this Python instead of preparing it
    with uv: its declared dependencies must all be installed here (ConfigError naming the first that is not);
    the script is written where verifiers would write it and its interpreter entered in verifiers' cache."""
    from packaging.requirements import Requirement
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    block = re.search(r"^# /// script\n(.*?)^# ///$", script, re.S | re.M)
    listed = re.search(r"dependencies = (\[.*?\])", block.group(1), re.S) if block else None
    for spec in re.findall(r'"([^"]+)"', listed.group(1)) if listed else []:
        requirement = Requirement(spec)
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            raise ConfigError(f"{where}: verifiers' chat program needs {spec}, and this Python has "
                              f"{installed or 'none'}: pip install '{spec}'")
    data = script.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{uuid.uuid4().hex}.tmp")     # processes may write it at once
        temporary.write_bytes(data)
        temporary.replace(path)
    SubprocessRuntime._interpreters[str(path)] = sys.executable
    return path


def verifiers_agent(env_id: str) -> Callable[[Any, dict], Any]:
    """The async agent function (reinforge/serve/agent.py) that plays one episode of `env_id` per row."""
    vf = verifiers_module()
    env = load_env(env_id)
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()

    async def agent(client: Any, row: dict) -> dict[str, float]:
        data = row.get("vf_task")
        if not isinstance(data, dict):      # a row of the user's data: the task's fields
            data = {k: v for k, v in row.items() if k in data_cls.model_fields}
        task = task_cls(data_cls.model_validate(data), env.config.taskset.task)
        ctx = vf.ModelContext(model=MODEL_NAME, client=vf.EvalClientConfig(
            base_url=episode_url(client), api_key_var=_NO_KEY_VARIABLE))
        playing = copy.copy(env)            # serving() keeps the episode's interception on the env: one each
        async with playing.serving():
            episode = await playing.run_episode(task, ctx)
        return episode_reward(episode)

    agent.__name__ = f"verifiers_{env_id}"
    return agent


def episode_url(client: Any) -> str:
    """The base_url naming the client's episode in its path (`/e/KEY/v1`): verifiers' client reads its key
    from an environment variable, shared by every episode, so the URL carries it instead."""
    root = str(client.base_url).rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    return f"{root}/e/{client.api_key}/v1"


def episode_reward(episode: Any) -> dict[str, float]:
    """The finished episode's reward and figures as an agent returns them: its one trainable trace's reward
    (the rubric's weighted rewards summed), each reward's score under `reward/<name>` and each numeric
    metric under `metric/<name>`. RuntimeError saying what verifiers recorded for an episode that failed."""
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if errors or not episode.ok:
        last = errors[-1] if errors else None
        raise RuntimeError(f"verifiers recorded the episode as failed: {last.type}: {last.message}" if last
                           else "verifiers recorded the episode as failed")
    trained = [t for t in episode.traces if t.agent is None or t.agent.trainable]
    if len(trained) != 1:
        raise RuntimeError(f"the episode has {len(trained)} trainable traces; reinforge trains one trajectory per "
                           "episode (mark the other agents untrainable in the env's setup)")
    trace = trained[0]
    out = {"reward": float(trace.reward)}
    out.update({f"reward/{k}": float(r.score) for k, r in trace.rewards.items() if r is not None})
    out.update({f"metric/{k}": float(v) for k, v in trace.metrics.items()
                if isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v)})
    return out
