"""Supervised fine-tuning on (prompt, completion) pairs: the cold start.

The loss is the token-mean negative log-likelihood of the completion tokens
(eos included); prompt tokens are context only, and so are the tools' results
inside a multi-turn trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from reinforge.agents.render import Renderer, trace_tokens_many
from reinforge.data.chat import Conversation
from reinforge.learner import (
    build_optimizer,
    build_sequences,
    warmup_cosine,
)
from reinforge.learner.forward import ForwardPlan, token_stats
from reinforge.models import Policy, model_device
from reinforge.objectives import loss_weights
from reinforge.rollout import encode_prompts
from reinforge.rollout.prompts import encode_texts
from reinforge.settings import SFTConfig
from reinforge.tasks import SFTExample


@dataclass
class SFTResult:
    steps: int
    first_loss: float
    final_loss: float   # mean of the last 10% of steps


def tokenize_pairs(
    policy: Policy, examples: list[SFTExample], chat_template: str
) -> tuple[list[list[int]], list[list[int]]]:
    tokenizer = policy.tokenizer
    prompts = encode_prompts(tokenizer, [e.prompt for e in examples], chat_template)
    eos = tokenizer.eos_token_id
    completions = [ids + [eos] for ids in encode_texts(tokenizer, [e.completion for e in examples])]
    return prompts, completions


def tokenize_traces(policy: Policy, examples: list[SFTExample], chat_template: str,
                    renderer: Renderer | None) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """(prompt ids, completion ids, loss mask) of each trace: a multi-turn one (`turns`) as the agent
    rollout holds it (the tools' results in the context, out of the loss), a plain one as a pair."""
    prompts, completions = tokenize_pairs(policy, examples, chat_template)
    masks = [[1.0] * len(c) for c in completions]
    multi = [i for i, e in enumerate(examples) if e.turns]
    if multi and renderer is None:
        raise ValueError("a multi-turn SFT trace needs the agent renderer (rollout.tools or task.environment)")
    conversations = [(e.prompt.as_list() if isinstance(e.prompt, Conversation)
                      else [{"role": "user", "content": str(e.prompt)}], list(e.turns))
                     for e in (examples[i] for i in multi)]
    traces = trace_tokens_many(renderer, conversations, policy.tokenizer.eos_token_id) if multi else []
    for i, (prompt, completion, mask) in zip(multi, traces, strict=True):
        prompts[i], completions[i], masks[i] = prompt, completion, mask
    return prompts, completions, masks


def run_sft(
    policy: Policy,
    examples: list[SFTExample],
    cfg: SFTConfig,
    *,
    chat_template: str,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
    forward: ForwardPlan | None = None,
    renderer: Renderer | None = None,
) -> SFTResult:
    """`cfg.steps` AdamW steps of `cfg.batch_size` traces each, one forward per step. `forward`
    chooses the learner's forward path as in RL (ForwardPlan.from_config(train): the pipeline runs
    SFT through the shared-prompt forward, each trace its own group, whose fused CPU kernels make it
    the fastest; default the model's own forward)."""
    forward = forward or ForwardPlan()
    prompts, completions, trained = tokenize_traces(policy, examples, chat_template, renderer)
    # right-padded [traces, width], filled from the traces' tokens laid end to end (one tensor each, not one per
    # trace: `make run` has 150,000 traces)
    lengths = torch.tensor([len(c) for c in completions])
    completion_mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).float()
    completion_ids = torch.full(completion_mask.shape, policy.tokenizer.pad_token_id, dtype=torch.long)
    completion_ids[completion_mask > 0] = torch.tensor([t for c in completions for t in c], dtype=torch.long)
    loss_mask = torch.zeros(completion_mask.shape)
    loss_mask[completion_mask > 0] = torch.tensor([w for m in trained for w in m], dtype=torch.float)
    data = build_sequences(prompts, completion_ids, completion_mask, policy.tokenizer.pad_token_id,
                           group_ids=torch.arange(len(completions)),     # each trace its own group
                           loss_mask=None if bool((loss_mask == completion_mask).all()) else loss_mask)

    model = policy.model
    device = model_device(model)
    model.train()
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = warmup_cosine(optimizer, cfg.warmup_steps, cfg.steps)
    generator = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    for step in range(cfg.steps):
        rows = torch.randint(len(examples), (cfg.batch_size,), generator=generator)
        batch = data.rows(rows).to(device)   # the data stays on the CPU; each batch goes to the model
        stats = token_stats(model, batch, 1.0, forward)
        weights = loss_weights("token_mean", batch.completion_mask)
        loss = -(weights * stats.logprobs).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if on_step:
            on_step(step, losses[-1])
    tail = losses[-max(1, len(losses) // 10):] if losses else [float("nan")]
    return SFTResult(
        steps=cfg.steps, first_loss=losses[0] if losses else float("nan"), final_loss=sum(tail) / len(tail)
    )
