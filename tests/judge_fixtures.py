"""Test doubles for judges and self-play: rollouts of given texts, an engine that writes given texts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.prompts import encode_prompts


def text_rollout(tokenizer, prompts: list[str], texts: list[str], group_size: int) -> Rollout:
    """A rollout whose row r is `texts[r]` + eos, sampled for prompts[r // group_size] (log-probs 0)."""
    prompt_ids = encode_prompts(tokenizer, prompts, "never")
    rows = [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1.0
    return Rollout(prompt_ids=[prompt_ids[r // group_size] for r in range(len(rows))], completion_ids=ids,
                   pad_id=tokenizer.pad_token_id, completion_mask=mask, sampler_logprobs=torch.zeros(ids.shape),
                   truncated=torch.zeros(len(rows), dtype=torch.bool),
                   group_ids=torch.arange(len(rows)) // group_size, policy_version=0, texts=list(texts))


class ScriptedEngine:
    """A rollout engine whose completion of a prompt is `write(prompt, k)` (k: the sample's index in
    its group); it records each call's prompts and sampling."""

    def __init__(self, tokenizer, write: Callable[[str, int], str]):
        self.tokenizer, self.write = tokenizer, write
        self.calls: list[tuple[list[str], int, SamplingParams]] = []

    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None) -> Rollout:
        self.calls.append((list(prompts), group_size, params))
        texts = [self.write(p, k) for p in prompts for k in range(group_size)]
        return text_rollout(self.tokenizer, prompts, texts, group_size)
