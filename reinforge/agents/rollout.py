"""The multi-turn rollout: a batch of episodes played against environments or tools, returned as the
same `Rollout` a single-turn engine returns, so the loop, curation, rewards, evaluation and the
learner take it unchanged (the environment's tokens are in the context and out of the loss:
`Rollout.loss_mask`).

`AgentEngine` wraps the run's engine. For each prompt it plays `group_size` episodes (reinforge/agents/
episode.py): an instance of the user's environment class (`task.environment`) or, with `rollout.tools`,
a `ToolEnvironment`. How the turns are decoded depends on the engine:

- native: one decoding session for the whole batch (continuous batching). When a row's turn ends, its
  environment runs in a worker thread while the other rows keep decoding; the reply's tokens are then
  appended to the row's cached keys/values (`DecodeSession.extend`), so the prompt and earlier turns
  are never recomputed.
- hf (or any engine with `generate_ids`): in lockstep, each turn of every live episode generated from
  its whole context (re-prefilled), then every environment stepped.

The reward of an environment episode is its return (the sum of its turn rewards, `AgentRow.reward`);
a tool episode's final answer is scored by the run's reward functions, which see the text of the
model's last turn as the completion.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from reinforge.agents.episode import EpisodeLimits, EpisodeResult, EpisodeStats, GeneratedTurn, Play, RewardMode
from reinforge.agents.render import Renderer
from reinforge.agents.tool_env import ToolEnvironment
from reinforge.agents.tools import ToolBox, ToolStats
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.sampling import draw_group_keys
from reinforge.rollout.trajectory import collate

# Environments run in worker threads: user code and tool calls (whose own workers are processes) wait there
# while the engine decodes. More threads than this only queue.
_THREADS = 16
# With no row decoding, how long replies may take after the first one to join its continuation pass: one
# shared pass costs less than a pass per row (64 rows of 7-token replies: 37-52 ms against 69-70 ms, BENCHMARKS.md).
_GATHER_S = 0.005


@dataclass(frozen=True)
class AgentRow:
    """One row of an agent rollout: how its episode went."""

    result: EpisodeResult
    tools: ToolStats | None     # this trajectory's tool calls (None: an environment, not tools)
    tool_limit_hit: bool        # it asked for a call past rollout.max_tool_calls
    reward: float | None        # the environment's return (NaN: it failed); None: the reward functions score it

    def transcript(self) -> list[dict[str, str]]:
        """The whole conversation with roles, for samples.jsonl."""
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in self.result.messages]


class AgentEngine:
    """A rollout engine whose samples are episodes (see the module docstring).

    `rows(prompt)` gives the dataset row a prompt came from (what `reset` receives); `environment` is the
    user's class, or None to play `tools` (a ToolBox, shared by every episode)."""

    def __init__(self, engine: Any, renderer: Renderer, rows: Callable[[str], Mapping[str, Any]],
                 environment: type | None = None, tools: ToolBox | None = None, limits: EpisodeLimits | None = None,
                 max_tool_calls: int = 4, continuation: bool = True, reward_mode: RewardMode = "trajectory"):
        if (environment is None) == (tools is None):
            raise ValueError("an agent rollout plays either an environment class or a tool box")
        self.engine, self.renderer, self.rows = engine, renderer, rows
        self.environment, self.tools = environment, tools
        self.limits = limits or EpisodeLimits()
        self.max_tool_calls = max_tool_calls
        self.continuation = continuation
        self.reward_mode = reward_mode
        self.policy = engine.policy
        self.chat_template = engine.chat_template
        # A turn's text as its tool parser reads it: the parser's markers kept when they are special tokens.
        self.decode = turn_decoder(self.policy.tokenizer, tools.markers if tools is not None else ())

    def over(self, engine: Any) -> AgentEngine:
        """This agent rollout over another engine (an asynchronous worker's, on its own copy of the weights)."""
        return AgentEngine(engine, self.renderer, self.rows, self.environment, self.tools, self.limits,
                           self.max_tool_calls, self.continuation, self.reward_mode)

    @torch.no_grad()
    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None, group_keys: torch.Tensor | None = None) -> Rollout:
        """`group_size` episodes of each prompt's row; each prompt's episodes draw from a stream keyed by one
        int64 (`group_keys` [P], default one draw per prompt from `generator`, else torch's global one), as
        single-turn sampling does."""
        if group_keys is None:
            group_keys = draw_group_keys(len(prompts), generator)
        plays, environments = [], []
        for g, prompt in enumerate(prompts):
            row = self.rows(prompt)
            for _ in range(group_size):
                play = Play(group=g, limits=self.limits, reward_mode=self.reward_mode)
                environment = self.environment or ToolEnvironment(self.tools, self.max_tool_calls)
                opening = play.open(environment, row)
                if opening is not None:
                    play.prompt_ids = tuple(self.renderer.prompt(opening))
                plays.append(play)
                environments.append(environment)
        with ThreadPoolExecutor(max_workers=min(_THREADS, len(plays))) as pool:
            if hasattr(self.engine, "session"):
                self._decode_continuing(plays, group_size, group_keys, params, policy_version, generator, pool)
            else:
                self._decode_lockstep(plays, params, policy_version, generator, pool)
        rollout = self._rollout(plays, environments, policy_version)
        # Every model turn was sampled with the whole episode so far as its context, the tokens the learner reads.
        rollout.logprobs_exact = hasattr(self.engine, "exact_logprobs") and self.engine.exact_logprobs(params)
        return rollout

    # ---------------------------------------------------------------- decoding

    def _decode_continuing(self, plays: list[Play], group_size: int, group_keys: torch.Tensor,
                           params: SamplingParams, version: int, generator, pool: ThreadPoolExecutor) -> None:
        """The native engine: one session, environments in threads, replies appended to the cache."""
        slots = len(plays) if self.engine.max_batch_rows is None else min(len(plays), self.engine.max_batch_rows)
        session = self.engine.session(params, slots=slots, generator=generator, version=version, keep_context=True)
        session.continuation = self.continuation     # off: each turn re-prefills its whole context (the baseline)
        # A group's episodes usually open alike: those prefill once and draw the samples a single-turn call would.
        for g, key in enumerate(group_keys.tolist()):
            openings: dict[tuple[int, ...], list[int]] = {}
            for i in range(g * group_size, (g + 1) * group_size):
                if plays[i].result is None:
                    openings.setdefault(plays[i].prompt_ids, []).append(i)
            for n, (ids, tags) in enumerate(openings.items()):
                session.add([list(ids)], len(tags), tags=tags, group_keys=torch.tensor([key + n]))
        pending: dict[Future, Any] = {}
        while session.busy or pending:
            if session.busy:
                for row in session.step():
                    pending[pool.submit(plays[row.tag].turn, self._turn(row, version))] = row
                done = [f for f in pending if f.done()]
            else:
                done = wait(pending, return_when=FIRST_COMPLETED).done
                # Nothing decodes meanwhile: replies that follow within a moment join this continuation pass.
                done |= wait(set(pending) - done, timeout=_GATHER_S).done
            continuing = []      # the replies that came back together continue in shared passes
            for future in done:
                row = pending.pop(future)
                play = plays[row.tag]
                if future.result() is not None:
                    ids = self.renderer.reply(play.before, play.messages, row.tokens.tolist())
                    if play.observe(ids):
                        continuing.append((row.context, ids, row.tag))
            session.extend_many(continuing)
        self.engine.release(session)

    def _decode_lockstep(self, plays: list[Play], params: SamplingParams, version: int, generator,
                         pool: ThreadPoolExecutor) -> None:
        """Any engine with `generate_ids`: every live episode's next turn from its whole context, then its step."""
        contexts = {i: list(p.prompt_ids) for i, p in enumerate(plays) if p.result is None}
        while contexts:
            live = list(contexts)
            out = self.engine.generate_ids([contexts[i] for i in live], 1, params, version, generator)
            lengths = out.completion_mask.sum(dim=1).long().tolist()
            turns = [GeneratedTurn(text=self.decode(out.completion_ids[r, :n]), token_ids=out.completion_ids[r, :n],
                                   sampler_logprobs=out.sampler_logprobs[r, :n], version=version,
                                   truncated=bool(out.truncated[r]),
                                   top_ids=None if out.sampler_top_ids is None else out.sampler_top_ids[r, :n],
                                   top_logprobs=(None if out.sampler_top_logprobs is None
                                                 else out.sampler_top_logprobs[r, :n]))
                     for r, n in enumerate(lengths)]
            replies = list(pool.map(lambda i, t: plays[i].turn(t), live, turns))
            for i, turn, reply in zip(live, turns, replies, strict=True):
                play = plays[i]
                ids = None if reply is None else self.renderer.reply(play.before, play.messages,
                                                                     turn.token_ids.tolist())
                if ids is not None and play.observe(ids):
                    contexts[i] += turn.token_ids.tolist() + list(ids)
                else:
                    del contexts[i]

    def _turn(self, row: Any, version: int) -> GeneratedTurn:
        text = self.decode(row.tokens)
        return GeneratedTurn(text=text, token_ids=row.tokens, sampler_logprobs=row.logprobs,
                             version=int(row.versions[0]) if len(row.versions) else version, truncated=row.truncated,
                             top_ids=row.top_ids, top_logprobs=row.top_logprobs)

    # ---------------------------------------------------------------- the batch view

    def _rollout(self, plays: list[Play], environments: list[Any], version: int) -> Rollout:
        results = [p.result for p in plays]
        agent_rows = []
        for result, environment in zip(results, environments, strict=True):
            tool = isinstance(environment, ToolEnvironment)
            reward = None if tool else (result.reward if result.trainable else float("nan"))
            agent_rows.append(AgentRow(result, environment.stats if tool else None,
                                       tool and environment.limit_hit, reward))
        # The completion text the reward functions score: the model's last turn.
        texts = [_last_turn(r) for r in results]
        tokenizer = self.policy.tokenizer
        rollout = collate([r.trajectory for r in results], tokenizer.pad_token_id or 0, version, lambda _: texts)
        rollout.episodes = agent_rows
        return rollout


def turn_decoder(tokenizer: Any, keep: tuple[str, ...]) -> Callable[[Any], str]:
    """ids -> the text of a model turn: special tokens removed (pad, eos, the template's markers) except
    those whose text is one of `keep`, a tool parser's markers. A model whose `<tool_call>` is a special
    token (Qwen2.5) writes its calls with it, and skip_special_tokens=True would hand the parser text
    with no call in it: every call dropped, in silence."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    kept = {i for i, token in added.items() if str(token) in keep or getattr(token, "content", None) in keep}
    if not kept:
        return lambda ids: tokenizer.decode(_ids(ids), skip_special_tokens=True)
    special = {i for i, token in added.items() if getattr(token, "special", False)} | set(tokenizer.all_special_ids)
    drop = special - kept
    return lambda ids: tokenizer.decode([i for i in _ids(ids) if i not in drop], skip_special_tokens=False)


def _ids(ids: Any) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


def _last_turn(result: EpisodeResult) -> str:
    turns = [m["content"] for m in result.messages if m["role"] == "assistant"]
    return turns[-1] if turns else ""


def agent_metrics(rows: list[AgentRow], rewards: torch.Tensor | None = None) -> dict[str, float]:
    """The env/* metrics of the episodes (EpisodeStats) and, for tool episodes, per-trajectory tool figures:
    tools/calls_per_trajectory, tools/error_rate (failed calls / calls), tools/malformed_rate (unreadable calls
    / calls attempted), tools/timeouts, tools/truncated, tools/limit_rate (trajectories stopped at max_tool_calls).
    `rewards` [N]: the rows' rewards as scored (NaN: none); env/reward_by_turns/<n> is then their mean by number
    of turns, whoever scored them (the environment's returns, or the reward functions on a tool episode's answer)."""
    out = EpisodeStats.of([r.result for r in rows]).metrics()
    if rewards is not None:
        out = {k: v for k, v in out.items() if not k.startswith(("env/reward_by_turns/", "env/reward_mean"))}
        turns = torch.tensor([r.result.turns for r in rows])
        for n in sorted(set(turns.tolist())):
            scored = rewards[(turns == n) & ~rewards.isnan()]
            if len(scored):
                out[f"env/reward_by_turns/{n}"] = float(scored.mean())
    figures: dict[str, list[float]] = {}     # rows' own figures (an agent's metrics, its endpoint's): their means
    for r in rows:
        for key, value in getattr(r, "metrics", {}).items():
            figures.setdefault(key, []).append(value)
    out.update({key: sum(values) / len(values) for key, values in figures.items()})
    tools = [r.tools for r in rows if r.tools is not None]
    if tools:
        calls = sum(t.calls for t in tools)
        malformed = sum(t.malformed for t in tools)
        out.update({
            "tools/calls_per_trajectory": calls / len(tools),
            "tools/error_rate": sum(t.errors for t in tools) / calls if calls else 0.0,
            "tools/malformed_rate": malformed / (calls + malformed) if calls + malformed else 0.0,
            "tools/timeouts": float(sum(t.timeouts for t in tools)),
            "tools/truncated": float(sum(t.truncated for t in tools)),
            "tools/limit_rate": sum(r.tool_limit_hit for r in rows if r.tools is not None) / len(tools),
        })
    return out
