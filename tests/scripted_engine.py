"""A rollout engine whose model is a script, for the endpoint's tests: every token it writes is known by hand."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout.base import Rollout
from reinforge.rollout.trajectory import Segment, Trajectory, collate


class Scripted:
    """An engine whose model writes `script(context text)` (no `session`: requests are sampled in batches)."""

    chat_template = "never"

    def __init__(self, script):
        self.script = script
        tokenizer = build_char_tokenizer()
        self.policy = SimpleNamespace(tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id],
                                      model=SimpleNamespace(config=None))

    def generate_ids(self, contexts, group_size, params, policy_version=0, generator=None) -> Rollout:
        tok = self.policy.tokenizer
        trajectories = []
        for g, ids in enumerate(contexts):
            out = tok(self.script(tok.decode(ids)), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            trajectories.append(Trajectory(tuple(ids), (Segment.sampled(torch.tensor(out), torch.full(
                (len(out),), -0.5), policy_version),), False, g))
        return collate(trajectories, tok.pad_token_id, policy_version, lambda _: [""] * len(contexts))
