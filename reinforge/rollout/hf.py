"""Rollouts with transformers `generate`: the reference engine."""

from __future__ import annotations

import torch

from reinforge.models import Policy, model_device
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.stopping import apply_stop_strings, completion_mask
from reinforge.rollout.trajectory import Segment, Trajectory, collate


class HFEngine:
    """Batched sampling through `model.generate`, keeping the sampler's log-probs.

    `output_scores` are the logits after the processors that shape sampling
    (temperature, top-k, top-p), so their log-softmax is the distribution the
    tokens were actually drawn from: what TIS-style corrections need.
    """

    def __init__(self, policy: Policy, chat_template: str = "auto"):
        self.policy = policy
        self.chat_template = chat_template

    @torch.no_grad()
    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None) -> Rollout:
        """`group_size` samples of each prompt. `generate` draws from torch's global generator: with
        `generator` given, it is seeded from it first, so the draws follow `generator`'s state."""
        prompt_ids = encode_prompts(self.policy.tokenizer, prompts, self.chat_template)
        return self.generate_ids(prompt_ids, group_size, params, policy_version, generator)

    @torch.no_grad()
    def generate_ids(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                     policy_version: int = 0, generator: torch.Generator | None = None) -> Rollout:
        """`generate` of prompts given as token ids (a multi-turn rollout's contexts)."""
        if generator is not None:
            torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
        model, tokenizer = self.policy.model, self.policy.tokenizer
        pad_id = tokenizer.pad_token_id
        width = max(len(p) for p in prompt_ids)
        # Left padding: every prompt ends at the same column, where decoding starts.
        input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompt_ids):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        eos_ids = self.policy.eos_token_ids
        kwargs = dict(
            max_new_tokens=params.max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=eos_ids,
            output_scores=True,
            return_dict_in_generate=True,
            num_return_sequences=group_size,
        )
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p if params.top_p < 1.0 else None,
                top_k=params.top_k if params.top_k > 0 else None,
                min_p=params.min_p if params.min_p > 0 else None,
            )
        was_training = model.training
        model.eval()
        device = model_device(model)
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs)
        model.train(was_training)

        completion_ids = out.sequences[:, width:]                                   # [N, T]
        scores = torch.stack(out.scores, dim=1).float()                              # [N, T, V]
        sampler_logprobs = torch.log_softmax(scores, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        # The rollout lives on the CPU, whatever device sampled it.
        completion_ids, sampler_logprobs = completion_ids.cpu(), sampler_logprobs.cpu()
        mask, truncated = completion_mask(completion_ids, eos_ids)
        # Stop strings are matched in the completion's text only (as vLLM does), after generation:
        # generate's own stop_strings also match text that straddles the prompt's end.
        mask, truncated = apply_stop_strings(tokenizer, completion_ids, mask, truncated, params.stop)
        # The rows as single-turn trajectories (each completion a prefix of the generated ids), collated
        # into the batch view as the native engine's are.
        trajectories = [
            Trajectory(prompt_ids=tuple(prompt_ids[r // group_size]), truncated=bool(truncated[r]),
                       group=r // group_size,
                       segments=(Segment.sampled(completion_ids[r, :n], sampler_logprobs[r, :n], policy_version),))
            for r, n in enumerate(mask.sum(dim=1).long().tolist())
        ]
        return collate(trajectories, pad_id, policy_version,
                       lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True))
