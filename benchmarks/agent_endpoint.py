"""Episodes through the OpenAI-compatible endpoint (task.agent) against the in-process multi-turn rollout
(task.environment): wall seconds and model tokens/s of the same batch of three-turn episodes.

    .venv/bin/python benchmarks/agent_endpoint.py [--prompts 16] [--group 8] [--turn-tokens 32] [--rounds 3]

Both play, for each prompt, `--group` episodes of three model turns, the user answering "And then?"
after each of the first two. In-process: an environment class played by `AgentEngine` (the native
engine's continuous batching, each reply appended to the row's cached keys/values). Endpoint: an agent
function making three chat calls through an `openai` client, `AgentFunctions` running the episodes in
threads and the endpoint's sampler batching their calls in one decoding session (a call that continues
its episode's conversation continues that row's cached keys/values). Model: a random-init
Qwen2-shaped decoder (hidden 256, 4 layers), char vocabulary, plain-text conversations, fp32; the
median over rounds after one warm-up. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from reinforge.agents.render import Renderer
from reinforge.agents.rollout import AgentEngine
from reinforge.models import build_tiny_qwen2
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.serve.agent import AgentFunctions
from reinforge.settings import ModelConfig


class Again:
    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text: str) -> tuple[list[dict], float, bool]:
        self.turns += 1
        return [{"role": "user", "content": "And then?"}], 0.0, self.turns == 3


def agent(client, row: dict) -> float:
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        message = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        messages += [message, {"role": "user", "content": "And then?"}]
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy = build_tiny_qwen2(ModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                          intermediate_size=512, max_positions=512), seed=0)
    engine = NativeEngine(policy)
    rows = lambda prompt: {"prompt": prompt}   # noqa: E731
    params = SamplingParams(max_new_tokens=args.turn_tokens)
    prompts = [f"{i}*{i + 7}=" for i in range(args.prompts)]
    modes = {
        "in_process": AgentEngine(engine, Renderer(policy.tokenizer, "never", None, policy.eos_token_ids), rows,
                                  environment=Again),
        "endpoint": AgentFunctions(engine, agent, rows, chat_template="never"),
    }
    figures: dict[str, list[float]] = {name: [] for name in modes}
    tokens: dict[str, list[float]] = {name: [] for name in modes}
    for round_ in range(args.rounds + 1):
        for name, mode in modes.items():
            start = time.perf_counter()
            rollout = mode.generate(prompts, args.group, params, generator=torch.Generator().manual_seed(round_))
            seconds = time.perf_counter() - start
            bad = [(e.result.turns, e.result.error) for e in rollout.episodes if e.result.error or e.result.turns != 3]
            assert not bad, (name, bad[:3])
            if round_:
                figures[name].append(seconds)
                tokens[name].append(float(rollout.trained_mask.sum()))
    out = {name: {"seconds": statistics.median(figures[name]),
                  "model_tokens_per_s": statistics.median(t / s for t, s in zip(tokens[name], figures[name],
                                                                                   strict=True))}
           for name in modes}
    out["endpoint_over_in_process_seconds"] = out["endpoint"]["seconds"] / out["in_process"]["seconds"]
    out["episodes"] = args.prompts * args.group
    print(json.dumps(out))


if __name__ == "__main__":
    main()
