"""A verifiers 0.4.0 environment that pins the `bash` harness, which reinforge refuses to run outside a sandbox."""

from __future__ import annotations

import verifiers.v1 as vf
from vf_repeat_env import RepeatTask


class BashTaskset(vf.Taskset[RepeatTask, vf.TasksetConfig]):
    def load(self):
        yield from ()


class BashEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "bash"})


class BashEnv(vf.Env[BashEnvConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)


__all__ = ["BashEnv", "BashTaskset"]
