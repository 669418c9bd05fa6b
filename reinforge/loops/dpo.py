"""DPO (recipe dpo) in the one loop (loops/loop.py): a pair source and a preference learner step.

DPO (arXiv 2305.18290) trains on (prompt, chosen, rejected) triples against a
frozen reference, here the policy as DPO starts. Pairs come from one of two
sources (`dpo.pairs`, a table below, never a branch in the loop):

- `on_policy` (default): every step samples G completions of a batch of train
  prompts from the current policy, scores them with the task's verifier and
  pairs a correct sample (chosen) with an incorrect one (rejected) of the same
  prompt: iterative reasoning preference optimisation (arXiv 2404.19733) with
  fresh pairs every step as in online DPO (arXiv 2402.04792), but one fixed
  reference for the whole stage. A prompt whose samples are all correct or all
  wrong gives no pair; a step without any pair takes no update.
- `dataset`: pairs read from a JSONL / Parquet file (`preference_pairs`),
  drawn in a seeded order reshuffled every epoch.

It runs the same loop as RL (`train_rl`): the same start and resume, step
range, guard against NaN/inf updates, result and checkpointed state
(`LoopState`). Its batch source is a `PairSource` and its step a
`PreferenceLearner`, which departs from RL's: no advantage and no pi_old;
one optimizer step per step over all of its pairs; log-probs at temperature
1 (the implicit reward beta (log pi - log ref) is of the model's own
distribution, whatever temperature the sampler drew at).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from reinforge.curation.batches import Groups, PromptStream, rollout_metrics
from reinforge.data import DatasetError, read_records
from reinforge.learner import (
    ForwardPlan,
    Reference,
    SequenceBatch,
    build_optimizer,
    build_sequences,
    token_stats,
    warmup_constant,
)
from reinforge.learner.batching import plan_micro_batches
from reinforge.loops.loop import LoopState, Timed
from reinforge.loops.sft import tokenize_pairs
from reinforge.models import Policy
from reinforge.objectives.preference import preference_loss
from reinforge.objectives.spec import PreferenceSpec
from reinforge.records import PreferencePair
from reinforge.rollout import RolloutEngine, SamplingParams
from reinforge.rollout.base import Rollout, environment_returns
from reinforge.settings import TrainConfig
from reinforge.tasks import SFTExample, Task

# Log-probs of the DPO loss are of the untempered model (see the module docstring).
TEMPERATURE = 1.0


# ------------------------------------------------------------------ pairs


def preference_pairs(path: str, fields: dict[str, str] | None = None) -> list[PreferencePair]:
    """The pairs of a JSONL / Parquet / datasets file with prompt, chosen and rejected text fields
    (`fields` maps our names to the file's columns). A bad row raises DatasetError naming its row."""
    loaded = read_records(path, fields, required=("prompt", "chosen", "rejected"))
    pairs = []
    for record, location in zip(loaded.records, loaded.locations, strict=True):
        for name in ("chosen", "rejected"):
            if not isinstance(record[name], str):
                raise DatasetError(f"{location}: field '{name}' must be str, got {type(record[name]).__name__}")
        if record["chosen"] == record["rejected"]:
            raise DatasetError(f"{location}: chosen and rejected are the same text (the pair states no preference)")
        pairs.append(PreferencePair(record["prompt"], record["chosen"], record["rejected"]))
    if not pairs:
        raise DatasetError(f"'{path}' holds no preference pairs")
    return pairs


def verifier_pairs(correct: torch.Tensor, pairs_per_prompt: int,
                   valid: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """(chosen row, rejected row) pairs of a rollout whose row r is sample r % G of prompt r // G.

    correct [P, G] bool; valid [P, G] bool (default all): a sample that is not valid (its environment
    failed) is in no pair. Per prompt with c > 0 correct and i > 0 incorrect samples (in sample
    order), pair k = 0 .. min(pairs_per_prompt, max(c, i)) - 1 takes correct sample k mod c and
    incorrect sample k mod i: distinct pairs, each sample of the larger side used once before any
    repeats. Samples of a group are exchangeable draws, so sample order is as good as a shuffle.
    """
    group = correct.shape[1]
    usable = torch.ones_like(correct) if valid is None else valid
    pairs = []
    for p, (row, keep) in enumerate(zip(correct.tolist(), usable.tolist(), strict=True)):
        right = [p * group + g for g, (ok, k) in enumerate(zip(row, keep, strict=True)) if ok and k]
        wrong = [p * group + g for g, (ok, k) in enumerate(zip(row, keep, strict=True)) if not ok and k]
        if right and wrong:
            pairs += [
                (right[k % len(right)], wrong[k % len(wrong)])
                for k in range(min(pairs_per_prompt, max(len(right), len(wrong))))
            ]
    return pairs


def pair_sequences(
    prompt_ids: list[list[int]], completion_ids: torch.Tensor, completion_mask: torch.Tensor, pad_id: int,
    loss_mask: torch.Tensor | None = None,
) -> SequenceBatch:
    """Rows 0..P-1 chosen, rows P..2P-1 rejected (row P + p is pair p's); group id p for both rows of
    pair p, so that they share a micro-batch (and, with a shared prefix, the prompt pass). `loss_mask`:
    the model's tokens of multi-turn rows (a tool's results are context, not part of a response's
    log-probability); None: every completion token."""
    num_pairs = len(prompt_ids) // 2
    return build_sequences(prompt_ids, completion_ids, completion_mask, pad_id,
                           group_ids=torch.arange(2 * num_pairs) % num_pairs, loss_mask=loss_mask)


def rollout_pairs(rollout: Rollout, pairs: list[tuple[int, int]], pad_id: int) -> SequenceBatch:
    """`pair_sequences` rows of (chosen row, rejected row) pairs of a rollout's samples, as sampled
    (their tokens, not a re-tokenization of their text)."""
    rows = [c for c, _ in pairs] + [r for _, r in pairs]
    index = torch.tensor(rows)
    return pair_sequences(
        [rollout.prompt_ids[r] for r in rows],
        rollout.completion_ids[index],
        rollout.completion_mask[index],
        pad_id,
        None if rollout.loss_mask is None else rollout.loss_mask[index],
    )


def tokenized_pairs(policy: Policy, pairs: list[PreferencePair], chat_template: str) -> SequenceBatch:
    """Text pairs as `pair_sequences` rows, tokenized as SFT does (prompt template, eos after the completion)."""
    texts = [SFTExample(p.prompt, p.chosen, True) for p in pairs] + [
        SFTExample(p.prompt, p.rejected, False) for p in pairs
    ]
    prompts, completions = tokenize_pairs(policy, texts, chat_template)
    lengths = torch.tensor([len(c) for c in completions])
    ids = torch.full((len(completions), int(lengths.max())), policy.tokenizer.pad_token_id, dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = torch.tensor(c)
    mask = (torch.arange(ids.shape[1]) < lengths.unsqueeze(1)).float()
    return pair_sequences(prompts, ids, mask, policy.tokenizer.pad_token_id)


@dataclass
class Pairs:
    """One step's pairs as model rows (`pair_sequences`), and what the source saw."""

    sequences: SequenceBatch | None     # [2P rows]; None: no pair was formed
    metrics: dict[str, float]           # verifier reward and lengths of every sample (on-policy), pairs formed
    tokens: int                         # completion tokens sampled (on-policy) or read (dataset)


class PairSource:
    """The loop's batch source over a `draw(version) -> Pairs`: timings, and nothing pending."""

    clock: Timed

    def draw(self, version: int) -> Pairs:
        raise NotImplementedError

    def collect(self, version: int) -> Pairs:
        self.clock.start()
        pairs = self.draw(version)
        self.clock.collected()
        return pairs

    def pending(self) -> list[int]:
        return []

    def step_metrics(self, batch: Pairs) -> dict[str, float]:
        return self.clock.timings(batch.tokens if batch.sequences is not None else None)


class OnPolicyPairs(PairSource):
    """Pairs from the current policy's samples and the task's verifier (dpo.pairs=on_policy)."""

    def __init__(
        self, pool: PromptStream, engine: RolloutEngine, task: Task, sampling: SamplingParams, prompts_per_step: int,
        group_size: int, pairs_per_prompt: int, pad_id: int,
    ):
        self.clock = Timed()
        self.pool, self.engine, self.task, self.sampling = pool, engine, task, sampling
        self.prompts, self.group, self.per_prompt, self.pad_id = prompts_per_step, group_size, pairs_per_prompt, pad_id

    def draw(self, version: int) -> Pairs:
        examples = self.pool.next(self.prompts)
        rollout = self.engine.generate([e.prompt for e in examples], self.group, self.sampling, policy_version=version)
        returns = environment_returns(rollout)         # episodes of an environment: scored by it
        rewards = returns if returns is not None else torch.tensor(
            [self.task.reward(examples[r // self.group], text) for r, text in enumerate(rollout.texts)]
        )
        shape = (len(examples), self.group)
        # the verifier's "correct", as in evaluation (an environment's: a positive return)
        correct = (rewards > 0 if returns is not None else rewards >= 1.0).view(shape)
        groups = Groups(rewards=rewards.view(shape), valid=~rewards.isnan().view(shape), correct=correct,
                        truncated=rollout.truncated.view(shape))
        pairs = verifier_pairs(correct, self.per_prompt, groups.valid)
        metrics = {**rollout_metrics(rollout, groups), "dpo/pairs": float(len(pairs))}
        tokens = int(rollout.lengths.sum())
        return Pairs(rollout_pairs(rollout, pairs, self.pad_id) if pairs else None, metrics, tokens)


class DatasetPairs(PairSource):
    """Pairs from a file (dpo.pairs=dataset), train.prompts_per_step per step."""

    def __init__(self, pool: PromptStream, policy: Policy, pairs_per_step: int, chat_template: str):
        self.clock = Timed()
        self.pool, self.policy, self.per_step, self.chat_template = pool, policy, pairs_per_step, chat_template

    def draw(self, version: int) -> Pairs:
        drawn: list[PreferencePair] = self.pool.next(self.per_step)  # type: ignore[assignment]
        seq = tokenized_pairs(self.policy, drawn, self.chat_template)
        tokens = float(seq.completion_mask.sum())
        return Pairs(
            seq, {"dpo/pairs": float(len(drawn)), "response_length_mean": tokens / (2 * len(drawn))}, int(tokens)
        )


# ------------------------------------------------------------------ update


@dataclass
class PairForward:
    """What the policy's forward over the pair rows gave, detached."""

    logprobs: torch.Tensor      # [2P] log pi(y | x) of each row, summed over its completion tokens
    entropy: torch.Tensor       # [2P] next-token entropy, summed over the row's completion tokens
    finite: bool                # every micro-batch's loss was finite


def preference_backward(model: torch.nn.Module, seq: SequenceBatch, ref_logprobs: torch.Tensor, spec: PreferenceSpec,
                        forward: ForwardPlan) -> PairForward:
    """Accumulate the gradient of the mean preference loss over the batch's P pairs into `.grad`.

    seq: `pair_sequences` rows; ref_logprobs [2P]: the reference's summed log-probs of the rows.
    Both rows of a pair share each micro-batch (grouped by pair), and each micro-batch adds its pairs'
    losses / P, so the gradient does not depend on the micro-batch settings.
    """
    num_pairs = len(ref_logprobs) // 2
    logprobs, entropy, finite = torch.zeros(2 * num_pairs), torch.zeros(2 * num_pairs), True
    lengths = seq.attention_mask.sum(dim=1)
    for rows in plan_micro_batches(
        lengths, max(forward.micro_batch_size, 2), forward.micro_batch_tokens, groups=seq.group_ids
    ):
        stats = token_stats(model, seq.rows(rows), TEMPERATURE, forward)   # on the model's device
        row_logprobs = stats.logprobs.sum(dim=1)                    # [M] log pi(y | x), summed over the completion
        logprobs[rows], entropy[rows] = row_logprobs.detach().cpu(), stats.entropy.detach().sum(dim=1).cpu()
        ref = ref_logprobs.to(row_logprobs.device)
        local = {int(r): i for i, r in enumerate(rows)}
        # [M/2] pairs of this micro-batch
        pairs = torch.tensor(sorted(r for r in local if r < num_pairs), dtype=torch.long)
        chosen = torch.tensor([local[int(p)] for p in pairs], dtype=torch.long)
        rejected = torch.tensor([local[int(p) + num_pairs] for p in pairs], dtype=torch.long)
        out = preference_loss(chosen_logprobs=row_logprobs[chosen], rejected_logprobs=row_logprobs[rejected],
                              ref_chosen_logprobs=ref[pairs], ref_rejected_logprobs=ref[pairs + num_pairs],
                              beta=spec.beta, loss_type=spec.loss_type, label_smoothing=spec.label_smoothing)
        loss = out.losses.sum() / num_pairs  # the mean over the step's pairs (the dpo recipe's aggregation)
        finite &= bool(torch.isfinite(loss.detach()))
        loss.backward()
    return PairForward(logprobs, entropy, finite)


@dataclass
class DPOUpdate:
    stepped: bool                   # False: the loss or gradient norm was NaN/inf; nothing moved
    metrics: dict[str, float]       # dpo/* of the policy before the step, grad_norm, entropy


def dpo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    seq: SequenceBatch,
    ref_logprobs: torch.Tensor,
    spec: PreferenceSpec,
    forward: ForwardPlan,
    grad_clip: float,
) -> DPOUpdate:
    """One optimizer step on all pairs of `seq`; with a NaN/inf loss or gradient norm no step is taken and neither
    the weights, Adam's moments nor the scheduler move (the guard of learner/update.py)."""
    num_pairs = len(ref_logprobs) // 2
    optimizer.zero_grad(set_to_none=True)
    out = preference_backward(model, seq, ref_logprobs, spec, forward)
    logprobs = out.logprobs
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    stepped = out.finite and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
        scheduler.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    # Batch figures from the detached log-probs: the same whatever the micro-batches were.
    whole = preference_loss(
        chosen_logprobs=logprobs[:num_pairs],
        rejected_logprobs=logprobs[num_pairs:],
        ref_chosen_logprobs=ref_logprobs[:num_pairs],
        ref_rejected_logprobs=ref_logprobs[num_pairs:],
        **dataclasses.asdict(spec),
    )
    return DPOUpdate(stepped, {
        "dpo/loss": float(whole.losses.mean()),
        "dpo/reward_accuracy": whole.metrics["reward_accuracy"],        # beta h_w > beta h_l (a tie is wrong)
        "dpo/margin": whole.metrics["reward_margin"],                   # mean beta (h_w - h_l)
        "dpo/reward_chosen": whole.metrics["reward_chosen"],
        "dpo/reward_rejected": whole.metrics["reward_rejected"],
        "dpo/chosen_logp": float(logprobs[:num_pairs].mean()),
        "dpo/rejected_logp": float(logprobs[num_pairs:].mean()),
        "entropy": float(out.entropy.sum() / seq.completion_mask.sum()),       # token mean over the pair rows
        "grad_norm": grad_norm if stepped else float("nan"),
    })


# ------------------------------------------------------------------ loop


@dataclass(kw_only=True)
class DPOState(LoopState):
    """Everything DPO carries from one step to the next: what a checkpoint saves and resume restores.

    No generator of its own: the only randomness is the sampler's (torch's global generator, saved with
    the other global RNGs) and the pool's order (its own RNG).
    """

    reference: Reference                        # frozen: the policy as DPO started (adapters only with LoRA)
    pool: PromptStream                          # prompts (on_policy) or pairs (dataset): order, epoch

    @classmethod
    def start(cls, train: TrainConfig, model: torch.nn.Module, pool: PromptStream) -> DPOState:
        optimizer = build_optimizer(model, train.lr, train.weight_decay)
        return cls(
            optimizer=optimizer,
            scheduler=warmup_constant(optimizer, train.warmup_steps),
            reference=Reference.of(model),
            pool=pool,
        )

    def extra_state(self) -> dict:
        return {"reference": self.reference.state_dict(), "pool": self.pool.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.reference.load_state_dict(state["reference"])          # the start of DPO, not the resumed weights
        self.pool.load_state_dict(state["pool"])


class PreferenceLearner:
    """A DPO step of the loop: the frozen reference's summed log-probs of every row, then one optimizer
    step on all pairs (none on a NaN/inf loss or gradient)."""

    def __init__(
        self, policy: Policy, spec: PreferenceSpec, forward: ForwardPlan, grad_clip: float, max_nonfinite_steps: int
    ):
        self.model, self.spec, self.forward, self.grad_clip = policy.model, spec, forward, grad_clip
        self.max_nonfinite_steps = max_nonfinite_steps
        self.samples = None                     # DPO writes no samples.jsonl

    def step(self, state: DPOState, pairs: Pairs) -> dict[str, float]:
        if pairs.sequences is None:     # no prompt had both a correct and an incorrect sample
            return {**pairs.metrics, "policy_version": state.version}
        ref_logprobs = state.reference.logprobs(pairs.sequences, TEMPERATURE, self.forward).sum(dim=1)     # [2P]
        update = dpo_update(self.model, state.optimizer, state.scheduler, pairs.sequences, ref_logprobs, self.spec,
                            self.forward, self.grad_clip)
        state.record_update(int(update.stepped), int(not update.stepped))
        return {
            **update.metrics,
            **pairs.metrics,
            "guard/skipped_steps": float(not update.stepped),
            "guard/skipped_total": float(state.skipped_total),
            "lr": state.scheduler.get_last_lr()[0],
            "policy_version": state.version,
        }

    def check_finite(self, state: DPOState) -> None:
        state.check_finite(self.max_nonfinite_steps, "DPO", "the data")
