"""On-policy distillation: a teacher model scores every token the policy sampled (`reward.teacher`).

The student (the policy) samples as in RL; a teacher with the same tokenizer reads the same token
ids and gives each sampled token its log-prob. The per-token reverse KL estimate

    k_t = log pi_student(y_t | x, y_<t) - log pi_teacher(y_t | x, y_<t)

is a single-sample estimate of KL(pi_student || pi_teacher) at position t, and -k_t is each token's
advantage (Thinking Machines, "On-Policy Distillation", 2025; GKD, arXiv 2306.13649, eq. 4 with
lambda = 1 and the reverse KL; Qwen3, arXiv 2505.09388, sec. 4.5). The student's log-prob is the
sampler's (`Rollout.sampler_logprobs`), as Thinking Machines take it: the distribution the token was
drawn from. Mode-seeking: the student is pushed off the tokens the teacher finds unlikely, and the
signal is dense (every token), unlike a verifier's one bit per sample.

Each token's term stands alone (discount 0, as Thinking Machines): E_{y_t ~ pi}[-k_t grad log pi(y_t)]
= -grad KL(pi(. | prefix) || pi_teacher(. | prefix)) exactly, for the distribution at each position
(tests/e2e/test_distillation.py checks it by enumeration); the effect of y_t on later positions' KL is
not credited to it.

As a reward source it returns token terms only (`SourceScores.token_values` = -k_t); the composer
multiplies them by `reward.teacher.weight` and the learner adds them to each token's advantage
(loops/rl.py `with_token_terms`), on top of the group advantage of the sequence reward: alone with
`reward.functions=[]` (every sequence reward 0, so the group advantage is 0), or beside a verifier.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from reinforge.errors import ConfigError
from reinforge.learner import ForwardPlan, build_sequences, token_logprobs
from reinforge.models.factory import check_model_path, resolve_device
from reinforge.models.tokenizer import build_char_tokenizer, load_tokenizer
from reinforge.rewards.sources import SourceContext, SourceScores
from reinforge.rollout.base import Rollout
from reinforge.tasks.base import Example


def reverse_kl_terms(sampler_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[N, T] k_t = log pi_student(y_t) - log pi_teacher(y_t) on the tokens of `mask` [N, T], 0 elsewhere.

    Its mean over a token's draws y_t ~ pi_student is KL(pi_student || pi_teacher) at that position
    (the k1 estimator of Schulman's "Approximating KL divergence": unbiased, of either sign per token).
    """
    return (sampler_logprobs - teacher_logprobs) * mask


def check_same_vocabulary(teacher: PreTrainedTokenizerBase, student: PreTrainedTokenizerBase, where: str) -> None:
    """ConfigError unless both tokenizers map every token to the same id: the teacher reads the
    student's token ids, so one id must mean one token to both."""
    t_vocab, s_vocab = teacher.get_vocab(), student.get_vocab()
    if t_vocab == s_vocab:
        return
    differ = sorted(set(t_vocab.items()) ^ set(s_vocab.items()), key=lambda kv: kv[1])
    token, index = differ[0]
    side = "teacher" if t_vocab.get(token) == index else "policy"
    raise ConfigError(
        f"{where}: the teacher's tokenizer is not the policy's ({len(t_vocab)} vs {len(s_vocab)} tokens; "
        f"id {index} is {token!r} only in the {side}'s): on-policy distillation scores the policy's token ids "
        "with the teacher, so both need one tokenizer; pick a teacher of the policy's family, or distill offline "
        "(sft.source=rejection with sft.teacher_path)"
    )


def teacher_folder(path: str | Path, student: PreTrainedTokenizerBase, where: str = "reward.teacher.path") -> Path:
    """`path` as a model folder (config, weights, tokenizer files) whose tokenizer is `student`'s; a
    ConfigError naming `where` otherwise."""
    try:
        folder = check_model_path(str(path))
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    check_same_vocabulary(load_tokenizer(folder), student, f"{where} '{path}'")
    return folder


def load_teacher(path: str | Path, student: PreTrainedTokenizerBase, device: str) -> PreTrainedModel:
    """The teacher's causal LM from its checked folder (`teacher_folder`), in eval mode on `device`."""
    model = AutoModelForCausalLM.from_pretrained(str(teacher_folder(path, student)), dtype="auto")  # bf16 stays bf16
    return model.to(resolve_device(device)).eval()


def check_teacher(path: str, student_model_path: str, added_tokens: Sequence[str] = ()) -> None:
    """Before anything loads or is written: `teacher_folder` against the tokenizer of model.path
    (`student_model_path`; 'builtin': the built-in model's character tokenizer with `added_tokens`)."""
    student = (build_char_tokenizer(added_tokens) if student_model_path == "builtin"
               else load_tokenizer(student_model_path))
    teacher_folder(path, student)


class TeacherSource:
    """A teacher scoring the policy's samples token by token: token values -k_t, no sequence value."""

    key = "teacher"

    def __init__(self, model: PreTrainedModel, *, weight: float = 1.0, temperature: float = 1.0,
                 micro_batch_size: int = 64):
        self.model, self.weight, self.temperature = model, weight, temperature
        # The LM head in chunks, in fp32 (as the learner's log-probs): a large vocabulary's logits are never
        # held whole; micro-batches by rows only, so that a teacher bigger than the policy fits.
        self.plan = ForwardPlan(micro_batch_size=micro_batch_size, micro_batch_tokens=None, chunk_size=1024)

    def teacher_logprobs(self, rollout: Rollout) -> Tensor:
        """[N, T] the teacher's log-probs of the rollout's tokens at `temperature`, aligned with
        `rollout.sampler_logprobs` (the same prompt + completion sequences the learner builds); 0 off the
        trained tokens (environment tokens are read as context only)."""
        sequences = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, rollout.pad_id,
                                    group_ids=rollout.group_ids, loss_mask=rollout.loss_mask)
        return token_logprobs(self.model, sequences, self.temperature, self.plan).float().cpu()

    @torch.no_grad()
    def score(self, rows: list[Example], rollout: Rollout) -> SourceScores:
        mask = rollout.trained_mask.float()                                      # [N, T]
        kl = reverse_kl_terms(rollout.sampler_logprobs.float(), self.teacher_logprobs(rollout), mask)   # [N, T]
        tokens = mask.sum().clamp_min(1.0)
        teacher_lp = (rollout.sampler_logprobs.float() - kl) * mask                # [N, T]
        return SourceScores(values=None, token_values=-kl, metrics={
            "reverse_kl": float(kl.sum() / tokens),                 # per token
            "reverse_kl_seq": float(kl.sum(dim=1).mean()),          # per sample, summed over its tokens
            "teacher_logprob": float(teacher_lp.sum() / tokens),    # per token
        })


def build_source(section, context: SourceContext) -> TeacherSource:
    """The source section `reward.teacher` configures (rewards/source_builders.py)."""
    if context.policy is None:
        raise ValueError("reward.teacher needs the run's policy (its tokenizer) in the SourceContext")
    tokenizer = context.policy.tokenizer
    model = load_teacher(section.path, tokenizer, section.device or context.device)
    temperature = section.temperature if section.temperature is not None else context.temperature
    return TeacherSource(model, weight=section.weight, temperature=temperature,
                         micro_batch_size=section.micro_batch_size)


__all__ = ["TeacherSource", "check_same_vocabulary", "check_teacher", "load_teacher", "reverse_kl_terms",
           "teacher_folder"]
