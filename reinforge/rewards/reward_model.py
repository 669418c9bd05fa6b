"""A learned reward: a Bradley-Terry reward model trained on preference pairs, from Python.

Owns the reward model's loss, its construction from a causal LM, its training and held-out
pair accuracy, saving it as a plain Hugging Face folder, and its use as a reward source of a run
(`reward.model.path`, `RewardModelSource`).

The model (InstructGPT, arXiv 2203.02155, section 3.5 and eq. 1) maps a prompt x and a
completion y to a scalar r(x, y) and is trained so that, for a human (or verifier) preference
y_w > y_l, P(y_w > y_l) = sigmoid(r(x, y_w) - r(x, y_l)) is high:

    loss = -E_(x, y_w, y_l) log sigmoid(r(x, y_w) - r(x, y_l))

It is a `transformers` sequence-classification model with num_labels=1: the causal LM's
backbone plus a linear `score` head read at the last real token of `prompt + completion + eos`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from reinforge.models import Policy, model_device
from reinforge.models.lora import merged
from reinforge.models.tokenizer import load_tokenizer
from reinforge.objectives.preference import sigmoid as dpo_sigmoid_loss
from reinforge.records import PreferencePair
from reinforge.rewards.sources import SourceContext, SourceScores, micro_batches
from reinforge.rollout.base import Rollout
from reinforge.rollout.prompts import encode_prompts
from reinforge.tasks.base import Example

T = TypeVar("T")

# ------------------------------------------------------------------ loss


@dataclass
class BTLoss:
    """What `bradley_terry_loss` returns."""

    losses: Tensor          # [P] per-pair -log sigmoid(r_chosen - r_rejected), not reduced
    loss: Tensor            # [] mean of `losses` over pairs: the one reduction, differentiable
    accuracy: float         # fraction of pairs with r_chosen > r_rejected (a tie counts as wrong)
    margin_mean: float      # mean of r_chosen - r_rejected


def bradley_terry_loss(chosen: Tensor, rejected: Tensor) -> BTLoss:
    """InstructGPT's reward-model loss (arXiv 2203.02155, eq. 1) of rewards `chosen` [P] and `rejected` [P].

    With margin z = r_chosen - r_rejected, the per-pair term is -log sigmoid(z): DPO's sigmoid loss
    at beta = 1 with no label smoothing (objectives/preference.py, imported rather than pasted), since
    both are the Bradley-Terry likelihood of the preference. d loss / d r_chosen = -sigmoid(-z) / P.
    The mean over pairs is taken here and nowhere else (InstructGPT's 1 / C(K, 2) with K = 2).
    """
    if chosen.shape != rejected.shape or chosen.dim() != 1 or chosen.numel() == 0:
        raise ValueError(f"chosen and rejected must both be [P] with P > 0, got {tuple(chosen.shape)} "
                         f"and {tuple(rejected.shape)}")
    margin = chosen - rejected                                                  # [P] z
    losses = dpo_sigmoid_loss(margin=margin, beta=1.0)                          # [P]
    with torch.no_grad():
        accuracy = (margin > 0).float().mean().item()
        margin_mean = margin.mean().item()
    return BTLoss(losses=losses, loss=losses.mean(), accuracy=accuracy, margin_mean=margin_mean)


# ------------------------------------------------------------------ model


@dataclass
class RewardModel:
    """A sequence-classification model with one output (the reward) and the tokenizer it reads."""

    model: PreTrainedModel                  # AutoModelForSequenceClassification, config.num_labels == 1
    tokenizer: PreTrainedTokenizerBase


def build_reward_model(source: Policy | str | Path, seed: int = 0) -> RewardModel:
    """A reward model whose backbone is a copy of a causal LM's (`source`: a Policy, e.g. the built-in
    tiny Qwen2 from `build_tiny_qwen2`, or a local Hugging Face causal-LM folder) and whose score head
    starts at zero, so every reward starts at 0 and the first loss is exactly log 2.

    InstructGPT starts its reward model from the SFT policy with the unembedding replaced by a scalar
    head (arXiv 2203.02155, section 3.5). The head is built with `from_config` (for Qwen2:
    `Qwen2ForSequenceClassification`); see `with_scalar_head`.
    """
    # The sequence-classification forward pools at the rightmost token that is not the pad id (transformers
    # GenericForSequenceClassification); without a pad id it cannot batch at all.
    model, tokenizer = with_scalar_head(source, AutoModelForSequenceClassification, seed, problem_type="regression")
    return RewardModel(model=model, tokenizer=tokenizer)


def with_scalar_head(source: Policy | str | Path, auto_class: type, seed: int = 0,
                     **config_updates: object) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(`auto_class` model, tokenizer): the causal LM `source`'s architecture with a one-output head
    (num_labels=1) in place of its unembedding, its backbone weights, and the head at zero.

    Shared by the reward model (a sequence-classification head) and the process reward model (a
    token-classification head, rewards/process_model.py). The head is built with `from_config` under a
    `seed`ed RNG (zeroed after, so the seed only matters to architectures with other new parts); the
    LM's base-model weights are loaded into it strictly: a missing or unexpected key is an error, not a
    silently random layer. The config gets the tokenizer's pad id (padding is found by it) and
    `config_updates`.
    """
    if isinstance(source, Policy):
        lm, tokenizer = merged(source.model), source.tokenizer
    else:
        lm = AutoModelForCausalLM.from_pretrained(str(source))
        tokenizer = load_tokenizer(source)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token: the reward model finds the last real token by it")
    config = lm.config.__class__.from_dict(lm.config.to_dict())
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    for key, value in config_updates.items():
        setattr(config, key, value)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=lm.dtype)
    model.base_model.load_state_dict(lm.base_model.state_dict(), strict=True)
    with torch.no_grad():
        model.score.weight.zero_()
        if model.score.bias is not None:
            model.score.bias.zero_()
    return model.to(model_device(lm)), tokenizer


def encode_pairs(tokenizer: PreTrainedTokenizerBase, prompts: list[str], completions: list[str],
                 chat_template: str = "auto") -> tuple[Tensor, Tensor]:
    """(input_ids [N, T], attention_mask [N, T]) of prompt + completion + eos, right-padded.

    The prompt is encoded as rollouts encode it (`encode_prompts`, chat template included) and the
    completion with eos as SFT and DPO do, so the reward model reads the text the policy writes.
    The eos makes the score read a token that says "the answer ends here": without it, "12" could
    not be told from a prefix of "123". Right padding: the last real token is then the rightmost
    non-pad token, which is where the sequence-classification head reads the score.
    """
    prompt_ids = encode_prompts(tokenizer, prompts, chat_template)
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"]
    rows = [p + c + [tokenizer.eos_token_id] for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)   # [N, T]
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)                   # [N, T]
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        attention_mask[i, : len(r)] = 1
    return input_ids, attention_mask


def score(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
          completions: list[str], chat_template: str = "auto") -> Tensor:
    """Rewards [N] of each (prompt, completion), with gradients when the caller has them on."""
    input_ids, attention_mask = encode_pairs(tokenizer, prompts, completions, chat_template)
    device = model_device(model)
    logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits   # [N, 1]
    return logits.squeeze(-1).float()


def pair_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair],
                chat_template: str = "auto") -> tuple[Tensor, Tensor]:
    """(r_chosen [P], r_rejected [P]), both sides of all pairs in one forward."""
    prompts = [p.prompt for p in pairs]
    rewards = score(model, tokenizer, prompts + prompts, [p.chosen for p in pairs] + [p.rejected for p in pairs],
                    chat_template)
    return rewards[: len(pairs)], rewards[len(pairs):]


# ------------------------------------------------------------------ training


@dataclass
class RewardModelResult:
    """What `train_reward_model` returns (the model is trained in place)."""

    first_loss: float           # Bradley-Terry loss of the first batch, before any update (log 2 from a zero head)
    final_loss: float           # loss of the last batch, before its update
    train_accuracy: float       # `pair_accuracy` over all training pairs after training
    steps: int


def train_reward_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair],
                       steps: int, batch_size: int, lr: float, seed: int = 0,
                       chat_template: str = "auto",
                       on_step: Callable[[int, float], None] | None = None) -> RewardModelResult:
    """`steps` AdamW steps on the Bradley-Terry loss, each over `batch_size` pairs drawn without replacement
    in a `seed`ed order reshuffled every epoch. Both completions of a pair sit in the same batch, as
    InstructGPT trains all comparisons of a prompt together (arXiv 2203.02155, section 3.5).
    `on_step(step, loss)` is called after each step."""
    batches = training_batches(pairs, steps, batch_size, seed, "train_reward_model")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses: list[float] = []
    model.train()
    for batch in batches:
        chosen, rejected = pair_scores(model, tokenizer, batch, chat_template)
        out = bradley_terry_loss(chosen, rejected)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
        if on_step is not None:
            on_step(len(losses), losses[-1])
    model.eval()
    return RewardModelResult(first_loss=losses[0], final_loss=losses[-1],
                             train_accuracy=pair_accuracy(model, tokenizer, pairs, chat_template=chat_template),
                             steps=steps)


def training_batches(items: list[T], steps: int, batch_size: int, seed: int, what: str) -> Iterator[list[T]]:
    """`steps` batches of min(batch_size, len(items)) items, drawn without replacement in a `seed`ed order
    reshuffled every epoch (a batch may span two epochs). ValueError now, before any model work, for no
    items or a step count or batch size below 1 (`what` names the caller in the message)."""
    if not items:
        raise ValueError(f"{what} needs at least one training example")
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {steps} and {batch_size}")
    return _batches(items, steps, batch_size, random.Random(seed))


def _batches(items: list[T], steps: int, batch_size: int, rng: random.Random) -> Iterator[list[T]]:
    order: list[int] = []
    for _ in range(steps):
        batch = []
        while len(batch) < min(batch_size, len(items)):
            if not order:
                order = list(range(len(items)))
                rng.shuffle(order)
            batch.append(items[order.pop()])
        yield batch


@torch.no_grad()
def pair_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair],
                  batch_size: int = 64, chat_template: str = "auto") -> float:
    """Fraction of `pairs` whose chosen completion gets the higher reward (a tie counts as wrong)."""
    if not pairs:
        raise ValueError("pair_accuracy needs at least one preference pair")
    was_training = model.training
    model.eval()
    right = 0
    for start in range(0, len(pairs), batch_size):
        chosen, rejected = pair_scores(model, tokenizer, pairs[start: start + batch_size], chat_template)
        right += int((chosen > rejected).sum())
    model.train(was_training)
    return right / len(pairs)


# ------------------------------------------------------------------ saving


def save_reward_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path) -> Path:
    """A plain Hugging Face folder: safetensors weights and config (num_labels 1, pad_token_id, the
    sequence-classification architecture) and the tokenizer. `AutoModelForSequenceClassification
    .from_pretrained(path)` loads it; load the tokenizer with reinforge's `load_tokenizer(path)`, since
    `AutoTokenizer` would swap the built-in character tokenizer for Qwen2's (models/tokenizer.py)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


def reward_statistics(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: list[PreferencePair],
                      batch_size: int = 64, chat_template: str = "auto") -> tuple[float, float]:
    """(mean, std) of the rewards of both sides of `pairs`: what `normalize` subtracts and divides by
    (OpenRLHF normalises its reward model's output by such statistics of its training data)."""
    values: list[Tensor] = []
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chosen, rejected = pair_scores(model, tokenizer, pairs[start: start + batch_size], chat_template)
            values += [chosen, rejected]
    every = torch.cat(values)
    return float(every.mean()), float(every.std(unbiased=False).clamp_min(1e-6))


# ------------------------------------------------------------------ as a reward source


class RewardModelSource:
    """A saved reward model scoring rollouts: batched, in micro-batches, on its own device.

    Reads prompt + completion text (re-encoded with the reward model's own tokenizer, so it need not
    share the policy's), and gives r(x, y), or (r - mean) / std with `normalize` (the statistics its
    folder's config.json holds), clipped to [-clip, clip] when `clip` is set.
    """

    key = "reward_model"

    def __init__(self, path: str | Path, *, weight: float = 1.0, device: str = "cpu", micro_batch_size: int = 32,
                 normalize: bool = False, clip: float | None = None, chat_template: str = "auto"):
        from reinforge.errors import ConfigError
        from reinforge.models.factory import resolve_device

        path = Path(path)
        if not (path / "config.json").exists():
            raise ConfigError(f"reward.model.path '{path}' is not a model folder (no config.json): train one with "
                              "`reinforge reward-model`, or give a sequence-classification folder")
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).to(resolve_device(device)).eval()
        if self.model.config.num_labels != 1:
            raise ConfigError(f"reward.model.path '{path}' has num_labels={self.model.config.num_labels}: a reward "
                              "model gives one score (num_labels=1)")
        self.tokenizer = load_tokenizer(path)
        self.weight, self.micro_batch_size, self.clip = weight, micro_batch_size, clip
        self.chat_template = chat_template
        self.shift, self.scale = 0.0, 1.0
        if normalize:
            mean, std = getattr(self.model.config, "reward_mean", None), getattr(self.model.config, "reward_std", None)
            if mean is None or std is None:
                raise ConfigError(f"reward.model.normalize=true needs reward_mean and reward_std in "
                                  f"'{path}/config.json' (written by `reinforge reward-model`): add them, or set "
                                  "reward.model.normalize=false")
            self.shift, self.scale = float(mean), float(std)

    @torch.no_grad()
    def score(self, rows: list[Example], rollout: Rollout) -> SourceScores:
        prompts = [e.prompt for e in rows]
        raw = torch.cat([score(self.model, self.tokenizer, [prompts[i] for i in part],
                               [rollout.texts[i] for i in part], self.chat_template).cpu()
                         for part in micro_batches(len(rows), self.micro_batch_size)])
        values = (raw - self.shift) / self.scale
        if self.clip is not None:
            values = values.clamp(-self.clip, self.clip)
        return SourceScores(values=values, metrics={"raw_mean": float(raw.mean()), "raw_std": float(raw.std())
                                                    if len(raw) > 1 else 0.0})


def build_source(section, context: SourceContext) -> RewardModelSource:
    """The source section `reward.model` configures (rewards/source_builders.py)."""
    return RewardModelSource(section.path, weight=section.weight, device=section.device or context.device,
                             micro_batch_size=section.micro_batch_size, normalize=section.normalize,
                             clip=section.clip, chat_template=context.chat_template)
