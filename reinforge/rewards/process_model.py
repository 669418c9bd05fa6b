"""A process reward model (PRM): a score at the end of every step of a solution, trained from step labels.

Owns the PRM's training data record (`StepLabels`), its loss, its construction from a causal LM, its
input encoding (prompt + steps, each step end a scored position), its training and held-out step
accuracy, saving it as a plain Hugging Face folder, and loading it back.

The model (Lightman et al., arXiv 2305.20050; Math-Shepherd, arXiv 2312.08935, section 3.3) reads
a prompt x and steps s_1..s_K and gives, at the last token of each step k, a logit z_k whose sigmoid
is the probability that the solution so far can still reach the right answer. It is a `transformers`
token-classification model with num_labels=1: the causal LM's backbone and a linear `score` head read
at every position, of which only the step ends are used. The backbone is causal, so the score of
step k sees the prompt and steps 1..k and nothing after them. Trained with binary cross-entropy
against the step labels (Math-Shepherd's eq. 3):

    loss = -mean over steps of [ y_k log sigmoid(z_k) + (1 - y_k) log(1 - sigmoid(z_k)) ]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForTokenClassification, PreTrainedModel, PreTrainedTokenizerBase

from reinforge.models import Policy, model_device
from reinforge.models.tokenizer import load_tokenizer
from reinforge.rewards.reward_model import training_batches, with_scalar_head
from reinforge.rollout.prompts import encode_prompts

Target = Literal["hard", "soft"]


@dataclass(frozen=True)
class StepLabels:
    """One solution split into steps, with a label per step: what a PRM trains and is measured on."""

    prompt: str
    steps: tuple[str, ...]     # [K] the step texts in order; their concatenation is the solution
    hard: tuple[float, ...]    # [K] 1.0 if the solution so far can reach the right answer, else 0.0
    soft: tuple[float, ...]    # [K] in [0, 1]: the estimated probability that it does (= hard for exact labels)

    def __post_init__(self) -> None:
        if not (len(self.steps) == len(self.hard) == len(self.soft)) or not self.steps:
            raise ValueError(f"a labelled solution needs K >= 1 steps and K hard and soft labels, got "
                             f"{len(self.steps)}, {len(self.hard)} and {len(self.soft)}")

    def labels(self, target: Target) -> tuple[float, ...]:
        return self.hard if target == "hard" else self.soft


# ------------------------------------------------------------------ loss


@dataclass
class PRMLoss:
    """What `step_bce` returns."""

    losses: Tensor      # [N, K] per-step binary cross-entropy, 0 where there is no step
    loss: Tensor        # [] the mean over the steps present: the one reduction, differentiable
    accuracy: float     # fraction of steps whose sigmoid(z) > 0.5 agrees with label > 0.5


def step_bce(logits: Tensor, labels: Tensor, step_mask: Tensor) -> PRMLoss:
    """Math-Shepherd's PRM loss (arXiv 2312.08935, eq. 3) of step logits z [N, K] against labels y [N, K]
    in [0, 1] (hard or soft), on the steps present (`step_mask` [N, K] bool).

    Per step: -[y log sigmoid(z) + (1 - y) log sigmoid(-z)] = softplus(z) - y z, whose gradient in z is
    sigmoid(z) - y; the loss is the mean over every step of the batch (all steps weigh the same, however
    many a solution has), divided by their count here and nowhere else.
    """
    if logits.shape != labels.shape or logits.shape != step_mask.shape or logits.dim() != 2:
        raise ValueError(f"logits, labels and step_mask must all be [N, K], got {tuple(logits.shape)}, "
                         f"{tuple(labels.shape)} and {tuple(step_mask.shape)}")
    count = int(step_mask.sum())
    if count == 0:
        raise ValueError("step_bce needs at least one step")
    mask = step_mask.to(logits.dtype)
    losses = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none") * mask
    with torch.no_grad():
        agree = ((logits > 0) == (labels > 0.5)) & step_mask
        accuracy = float(agree.sum()) / count
    return PRMLoss(losses=losses, loss=losses.sum() / count, accuracy=accuracy)


# ------------------------------------------------------------------ model


@dataclass
class ProcessRewardModel:
    """A token-classification model with one output (a step logit at each step end) and its tokenizer."""

    model: PreTrainedModel                  # AutoModelForTokenClassification, config.num_labels == 1
    tokenizer: PreTrainedTokenizerBase


def build_process_reward_model(source: Policy | str | Path, seed: int = 0) -> ProcessRewardModel:
    """A PRM whose backbone is a copy of a causal LM's (`source`: a Policy, e.g. the SFT policy whose
    solutions it will judge, or a local causal-LM folder) and whose score head starts at zero: every
    step starts at probability 1/2 and the first loss is exactly log 2 (`with_scalar_head`: strict
    backbone load). Math-Shepherd initialises its PRM from the base LM likewise (section 4.1).
    The head reads the backbone's output without dropout, so the scores of training are those of use."""
    model, tokenizer = with_scalar_head(source, AutoModelForTokenClassification, seed, classifier_dropout=0.0)
    return ProcessRewardModel(model=model, tokenizer=tokenizer)


@dataclass(frozen=True)
class EncodedSteps:
    """Prompts and their steps as one right-padded batch, with where each step ends."""

    input_ids: Tensor        # [N, T] long: prompt tokens, then each step's tokens; pad_token_id after
    attention_mask: Tensor   # [N, T] long, 1 on real tokens
    step_ends: Tensor        # [N, K] long: position of the last token of each step; 0 where there is none
    step_mask: Tensor        # [N, K] bool, True on the steps present


def encode_steps(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], steps: Sequence[Sequence[str]],
                 chat_template: str = "auto") -> EncodedSteps:
    """The PRM's input: the prompt as rollouts encode it (`encode_prompts`, chat template included),
    then each step encoded on its own and appended, so that every step ends at a token boundary
    whatever the tokenizer (a byte-level BPE would otherwise merge a step's last characters with the
    next step's first). Training and scoring both encode this way, so the PRM never depends on how
    the policy happened to tokenize a solution. A row may have no steps (all of its mask False)."""
    prompt_ids = encode_prompts(tokenizer, list(prompts), chat_template)
    rows: list[list[int]] = []
    ends: list[list[int]] = []
    for ids, row_steps in zip(prompt_ids, steps, strict=True):
        row, row_ends = list(ids), []
        for step in row_steps:
            step_ids = tokenizer(step, add_special_tokens=False)["input_ids"]
            if not step_ids:
                raise ValueError(f"the step {step!r} encodes to no tokens: a step must have text")
            row += step_ids
            row_ends.append(len(row) - 1)
        rows.append(row)
        ends.append(row_ends)
    width, most = max(len(r) for r in rows), max((len(e) for e in ends), default=0)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)   # [N, T]
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)                   # [N, T]
    step_ends = torch.zeros((len(rows), max(most, 1)), dtype=torch.long)                 # [N, K]
    step_mask = torch.zeros((len(rows), max(most, 1)), dtype=torch.bool)                 # [N, K]
    for i, (r, e) in enumerate(zip(rows, ends, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        attention_mask[i, : len(r)] = 1
        step_ends[i, : len(e)] = torch.tensor(e, dtype=torch.long)
        step_mask[i, : len(e)] = True
    return EncodedSteps(input_ids, attention_mask, step_ends, step_mask)


def step_logits(model: PreTrainedModel, batch: EncodedSteps) -> Tensor:
    """Logits z [N, K] at each step's last token (0 where there is no step), with gradients when the caller
    has them on. Right padding leaves every real token's logit as without it (causal attention)."""
    device = model_device(model)
    logits = model(input_ids=batch.input_ids.to(device),
                   attention_mask=batch.attention_mask.to(device)).logits.squeeze(-1).float()   # [N, T]
    return logits.gather(1, batch.step_ends.to(device)) * batch.step_mask.to(device)          # [N, K]


@torch.no_grad()
def step_probabilities(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
                       steps: Sequence[Sequence[str]], chat_template: str = "auto",
                       micro_batch_size: int = 32) -> tuple[Tensor, Tensor]:
    """(sigmoid(z) [N, K] on the CPU, 0 where there is no step; step_mask [N, K] bool), in micro-batches
    of rows: each row's probability that its solution is still on a right track, step by step."""
    width = max((len(s) for s in steps), default=0)
    probs = torch.zeros(len(prompts), max(width, 1))
    mask = torch.zeros(len(prompts), max(width, 1), dtype=torch.bool)
    for start in range(0, len(prompts), micro_batch_size):
        part = slice(start, start + micro_batch_size)
        batch = encode_steps(tokenizer, prompts[part], steps[part], chat_template)
        k = batch.step_mask.shape[1]
        probs[part, :k] = torch.sigmoid(step_logits(model, batch)).cpu() * batch.step_mask
        mask[part, :k] = batch.step_mask
    return probs, mask


# ------------------------------------------------------------------ training


@dataclass
class PRMTrainResult:
    """What `train_process_reward_model` returns (the model is trained in place)."""

    first_loss: float       # loss of the first batch, before any update (log 2 from a zero head)
    final_loss: float       # loss of the last batch, before its update
    steps: int


def train_process_reward_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, data: list[StepLabels],
                               steps: int, batch_size: int, lr: float, target: Target = "hard", seed: int = 0,
                               chat_template: str = "auto") -> PRMTrainResult:
    """`steps` AdamW steps on `step_bce`, each over `batch_size` solutions drawn without replacement in a
    `seed`ed order reshuffled every epoch, against their `target` labels (Math-Shepherd trains on the hard
    estimate; the soft one is the fraction of continuations that reached the answer)."""
    batches = training_batches(data, steps, batch_size, seed, "train_process_reward_model")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses: list[float] = []
    model.train()
    for batch in batches:
        encoded = encode_steps(tokenizer, [d.prompt for d in batch], [d.steps for d in batch], chat_template)
        out = step_bce(step_logits(model, encoded), _labels(batch, target, encoded.step_mask.shape[1]).to(
            model_device(model)), encoded.step_mask.to(model_device(model)))
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    model.eval()
    return PRMTrainResult(first_loss=losses[0], final_loss=losses[-1], steps=steps)


def _labels(data: Sequence[StepLabels], target: Target, width: int) -> Tensor:
    out = torch.zeros(len(data), width)                    # [N, K]
    for i, d in enumerate(data):
        out[i, : len(d.steps)] = torch.tensor(d.labels(target))
    return out


@dataclass(frozen=True)
class StepAccuracy:
    """How often the PRM's step verdicts agree with the labels."""

    accuracy: float         # fraction of steps with (sigmoid(z) > 0.5) == (hard label == 1)
    positive_rate: float    # fraction of steps labelled 1: a constant guess scores max(p, 1 - p)
    final_accuracy: float   # the same on each solution's last step only (does it judge the final answer?)
    steps: int              # steps measured


@torch.no_grad()
def step_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, data: list[StepLabels],
                  micro_batch_size: int = 64, chat_template: str = "auto") -> StepAccuracy:
    """The PRM's agreement with the hard labels of `data` (held-out solutions), over all steps and over
    last steps."""
    if not data:
        raise ValueError("step_accuracy needs at least one labelled solution")
    was_training = model.training
    model.eval()
    probs, mask = step_probabilities(model, tokenizer, [d.prompt for d in data], [d.steps for d in data],
                                     chat_template, micro_batch_size)
    model.train(was_training)
    labels = _labels(data, "hard", mask.shape[1]) > 0.5
    agree = ((probs > 0.5) == labels) & mask
    last = mask.sum(1) - 1                                                     # [N] index of each last step
    rows = torch.arange(len(data))
    count = mask.sum()
    return StepAccuracy(accuracy=float(agree.sum() / count), positive_rate=float((labels & mask).sum() / count),
                        final_accuracy=float(agree[rows, last].float().mean()), steps=int(mask.sum()))


# ------------------------------------------------------------------ saving and loading


def save_process_reward_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path,
                              marker: str) -> Path:
    """A plain Hugging Face folder: safetensors weights, config (num_labels 1, the token-classification
    architecture, and `step_marker`: how the steps it was trained on were split) and the tokenizer.
    `AutoModelForTokenClassification.from_pretrained(path)` loads it; load the tokenizer with
    reinforge's `load_tokenizer(path)` (`AutoTokenizer` would swap the built-in character tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.step_marker = marker
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path


def load_process_reward_model(path: str | Path, device: str | torch.device = "cpu") -> ProcessRewardModel:
    """A saved PRM in eval mode on `device`; ConfigError (naming reward.process.path) for a folder that is
    not one."""
    from reinforge.errors import ConfigError

    path = Path(path)
    if not (path / "config.json").exists():
        raise ConfigError(f"reward.process.path '{path}' is not a model folder (no config.json): train one with "
                          "reinforge.rewards.process_model (docs/process-rewards.md)")
    model = AutoModelForTokenClassification.from_pretrained(str(path)).to(device).eval()
    if model.config.num_labels != 1:
        raise ConfigError(f"reward.process.path '{path}' has num_labels={model.config.num_labels}: a process reward "
                          "model gives one score per step (num_labels=1)")
    return ProcessRewardModel(model=model, tokenizer=load_tokenizer(path))


__all__ = ["EncodedSteps", "PRMLoss", "PRMTrainResult", "ProcessRewardModel", "StepAccuracy", "StepLabels",
           "build_process_reward_model", "encode_steps", "load_process_reward_model", "save_process_reward_model",
           "step_accuracy", "step_bce", "step_logits", "step_probabilities", "train_process_reward_model"]
