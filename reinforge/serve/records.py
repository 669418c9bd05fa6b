"""What the endpoint records of an episode, and the trajectory the learner trains on, built from it.

Every choice the endpoint returns is a `Call`: the exact prompt tokens it was sampled from, the sampled
tokens, their sampler log-probs and policy versions. The text an agent sends back is never tokenised
again: a chat request that continues an earlier call's conversation gets as its prompt that call's
prompt and sampled tokens followed by the chat template's tokens for the new messages (the endpoint
does this, reinforge/serve/chat.py), so the calls of one conversation form a chain in which each
prompt starts with the whole context of the call before it.

`trajectory` turns an episode's calls into one `Trajectory`: the longest chain (by the model's tokens),
its first prompt as the prompt, each call's tokens as a model segment (trained on, with their log-probs
and versions) and the tokens between one call's end and the next call's prompt end as an environment
segment (tool results, user turns: context only). Calls outside that chain (a sub-agent's own
conversation, a restarted context) are kept in the episode's record and counted, not trained on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from reinforge.rollout.trajectory import Segment, Trajectory


@dataclass(frozen=True)
class Call:
    """One choice the endpoint returned to an episode."""

    prompt_ids: tuple[int, ...]      # the tokens it was sampled from
    token_ids: torch.Tensor          # [L] long: the tokens returned (cut at the request's stop or max_tokens)
    sampler_logprobs: torch.Tensor   # [L] float: their log-probs under the sampling distribution
    versions: torch.Tensor           # [L] long: the policy version that sampled each
    truncated: bool                  # it ended at a length limit, not with a stop
    route: str                       # 'chat', 'completions' or 'generate'
    latency_s: float                 # from the request's arrival to its response
    messages: tuple[dict, ...] = ()  # chat: the conversation it answered and its answer (the turn's text)

    @property
    def context(self) -> tuple[int, ...]:
        """Every token of this call: its prompt, then what it sampled."""
        return self.prompt_ids + tuple(self.token_ids.tolist())


@dataclass
class EpisodeLog:
    """An episode's record on the endpoint, written by the request threads."""

    token: str                        # the API key that names the episode
    key: int                          # its sampling stream: call i draws from key + i
    max_calls: int | None = None      # calls allowed (None: any number)
    calls: list[Call] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)   # requests refused, and why (a changed sampling setting)
    requests: int = 0                 # requests accepted for sampling
    closed: bool = False              # the episode ended: later requests are refused
    limit: str | None = None          # the stop reason of the limit a refused request hit: 'max_turns' (max_calls),
                                      # 'max_model_tokens' (the model's positions); the episode ends there
    threads: list[Any] = field(default_factory=list)    # its chat conversations (reinforge/serve/chat.py)
    texts: list[tuple[str, list[int]]] = field(default_factory=list)   # completions: (text, tokens) so far
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_key(self) -> int:
        with self.lock:
            self.requests += 1
            return self.key + self.requests - 1

    def record(self, calls: list[Call]) -> None:
        with self.lock:
            self.calls.extend(calls)

    def end(self, limit: str) -> None:
        with self.lock:
            self.limit = self.limit or limit

    def refuse(self, reason: str) -> None:
        with self.lock:
            self.refusals.append(reason)


def chains(calls: list[Call]) -> list[list[Call]]:
    """The calls grouped into conversations: a call joins the chain whose last call's whole context
    its prompt starts with (the longest such context), else it starts a chain."""
    out: list[list[Call]] = []
    for call in calls:
        best, best_len = None, -1
        for chain in out:
            context = chain[-1].context
            if len(context) > best_len and call.prompt_ids[: len(context)] == context:
                best, best_len = chain, len(context)
        if best is None:
            out.append([call])
        else:
            best.append(call)
    return out


def trajectory(calls: list[Call], group: int) -> tuple[Trajectory, list[Call]]:
    """The episode's trajectory (see the module docstring) and the chain it is built from. No calls:
    an empty trajectory."""
    if not calls:
        return Trajectory(prompt_ids=(), segments=(), truncated=False, group=group), []
    chain = max(reversed(chains(calls)), key=lambda c: sum(len(x.token_ids) for x in c))
    segments: list[Segment] = []
    for i, call in enumerate(chain):
        if i:
            between = call.prompt_ids[len(chain[i - 1].context):]
            if between:
                segments.append(Segment.observed(torch.tensor(between, dtype=torch.long)))
        segments.append(Segment.sampled(call.token_ids, call.sampler_logprobs, call.versions))
    truncated = any(c.truncated for c in chain)
    return Trajectory(prompt_ids=chain[0].prompt_ids, segments=tuple(segments), truncated=truncated,
                      group=group), chain


def share_prompt(trajectories: list[Trajectory]) -> list[Trajectory]:
    """One group's trajectories with one prompt: the longest prefix all their prompts share, each one's
    rest of its prompt moved to the front of its completion as context (out of the loss). The learner
    runs a group's prompt once (learner/shared_prefix.py); an agent may open its episodes differently (a
    sampled system prompt), and an episode that failed before its first call has no prompt at all."""
    prompts = [t.prompt_ids for t in trajectories if t.segments]
    if not prompts:
        return trajectories
    common = 0
    while common < min(map(len, prompts)) and len({p[common] for p in prompts}) == 1:
        common += 1
    out = []
    for t in trajectories:
        rest = t.prompt_ids[common:]
        segments = ((Segment.observed(torch.tensor(rest, dtype=torch.long)),) if rest else ()) + t.segments
        out.append(replace(t, prompt_ids=prompts[0][:common], segments=segments))
    return out


def transcript(chain: list[Call], tokenizer: Any) -> list[dict[str, str]]:
    """The conversation of a chain, for samples.jsonl: the last chat call's messages and answer, or the
    text of the whole context for completions."""
    if not chain:
        return []
    last = chain[-1]
    if last.messages:
        return [{"role": str(m.get("role")), "content": str(m.get("content") or "")} for m in last.messages]
    return [{"role": "context", "content": tokenizer.decode(list(last.context), skip_special_tokens=False)}]
