"""A verifiers 0.4.0 environment whose taskset bundles its own harness, one that runs its chat loop in
process (verifiers' `Harness.launch` contract allows it: every model call still goes through the
interception `endpoint` with its `secret`): the repeat tasks of vf_repeat_env, two turns each, the second
asking the model to say the word again."""

from __future__ import annotations

import verifiers.v1 as vf
from openai import AsyncOpenAI
from vf_repeat_env import WORDS, RepeatData, RepeatTask


class InProcessChat(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for follow_up in ("Again.", None):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


class InProcessTaskset(vf.Taskset[RepeatTask, vf.TasksetConfig]):
    def load(self):
        for word in WORDS:
            yield RepeatTask(RepeatData(prompt=f"Repeat: {word}", word=word), self.config.task)


__all__ = ["InProcessChat", "InProcessTaskset"]
