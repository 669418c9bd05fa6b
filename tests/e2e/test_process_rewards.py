"""Process rewards (rewards/process.py, process_model.py, shepherd.py): step segmentation on the rollout's
tokens, the aggregations and DeepSeekMath's token advantages by hand, the PRM loss by hand, Math-Shepherd
labels on a scripted engine, a PRM trained on the chain_sum task with its held-out step accuracy, its saved
folder in transformers, and the PRM as a reward source in a composer (signal for all-wrong groups)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from transformers import AutoModelForTokenClassification

from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.loops.rl import with_token_terms
from reinforge.loops.sft import run_sft
from reinforge.models import build_tiny_qwen2
from reinforge.models.tokenizer import build_char_tokenizer, load_tokenizer
from reinforge.objectives.advantages import grpo
from reinforge.rewards.compose import RewardComposer
from reinforge.rewards.process import (
    AGGREGATES,
    completion_steps,
    process_token_advantages,
    rollout_steps,
    split_steps,
)
from reinforge.rewards.process_model import (
    StepLabels,
    build_process_reward_model,
    encode_steps,
    save_process_reward_model,
    step_accuracy,
    step_bce,
    step_logits,
    step_probabilities,
    train_process_reward_model,
)
from reinforge.rewards.shepherd import shepherd_dataset, shepherd_labels
from reinforge.rewards.source_builders import build_sources
from reinforge.rewards.sources import SourceContext
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.rollout.base import Rollout
from reinforge.rollout.prompts import encode_prompts
from reinforge.settings import RewardConfig
from reinforge.tasks import Example
from reinforge.tasks.chain_sum import ChainSumTask

NAN = math.nan


def rollout_of(tokenizer, prompts: list[str], texts: list[str], group_size: int) -> Rollout:
    """Row r: prompts[r // group_size] answered by texts[r] + eos, tokenized one way (the tokenizer's)."""
    completions = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(len(c) for c in completions)
    ids = torch.full((len(texts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(texts), width)
    for r, c in enumerate(completions):
        ids[r, : len(c)] = torch.tensor(c)
        mask[r, : len(c)] = 1.0
    prompt_ids = encode_prompts(tokenizer, prompts, "auto")
    return Rollout(prompt_ids=[prompt_ids[r // group_size] for r in range(len(texts))], completion_ids=ids,
                   pad_id=tokenizer.pad_token_id, completion_mask=mask, sampler_logprobs=torch.zeros(len(texts), width),
                   truncated=torch.zeros(len(texts), dtype=torch.bool),
                   group_ids=torch.arange(len(texts)) // group_size, policy_version=0, texts=list(texts))


# ------------------------------------------------------------------ the chain_sum task


def test_chain_sum_writes_steps_and_verifies_only_the_final_answer():
    task = ChainSumTask(seed=0)                               # four 1-digit terms, partial sums 2 digits wide
    example = Example("3+5+7+2=", "17", {"numbers": [3, 5, 7, 2]})
    assert task.teacher_completion(example, random.Random(0)) == "3+5=08\n08+7=15\n15+2=17\n"
    assert ChainSumTask(terms=3, digits=2).teacher_completion(
        Example("12+34+07=", "53", {"numbers": [12, 34, 7]}), random.Random(0)) == "12+34=046\n046+07=053\n"
    # the verifier reads the integer after the last "=": wrong steps before a right answer still pass
    assert task.reward(example, "3+5=09\n09+7=15\n15+2=17\n") == 1.0
    assert task.reward(example, "17") == 0.0 and task.reward(example, "3+5=08\n08+7=15\n15+2=18") == 0.0
    # ground truth per step: a step is right when it and every step before it are
    assert task.step_correct(example, ["3+5=08\n", "08+7=16\n", "16+2=18\n"]) == [True, False, False]
    assert task.step_correct(example, ["3+5=09\n", "09+7=16\n", "16+2=18\n"]) == [False, False, False]
    assert task.step_correct(example, ["3+5=08\n", "08+7=15\n", "15+2=17\n", "17+0=17\n"]) == [True] * 3 + [False]
    # a corrupted solution: exactly one step miscalculated, the later steps carry its error to a wrong answer
    rng = random.Random(0)
    for e in task.train_split(200):
        steps = split_steps(task.corrupt_completion(e, rng), "\n")
        right = task.step_correct(e, steps)
        first_wrong = right.index(False)
        assert right == [True] * first_wrong + [False] * (len(steps) - first_wrong)
        later = [int(m) for s in steps for m in s.strip().replace("=", "+").split("+")]
        assert all(later[3 * k + 2] == later[3 * k] + later[3 * k + 1] for k in range(first_wrong + 1, len(steps)))


# ------------------------------------------------------------------ segmentation


def test_split_steps_by_hand():
    assert split_steps("12+34=46\n46+7=53\n", "\n") == ["12+34=46\n", "46+7=53\n"]
    assert split_steps("12+34=46\n46+7=53", "\n") == ["12+34=46\n", "46+7=53"]          # the last needs no marker
    # whitespace-only pieces join the step before them (the one after them, at the start)
    assert split_steps("\n a\n\nb\n \n", "\n") == ["\n a\n\n", "b\n \n"]
    assert split_steps("a\n\nb\nc\n\n", "\n\n") == ["a\n\n", "b\nc\n\n"]
    # a marker with text starts a step
    assert split_steps("Let me see. Step 1: 3. Step 2: 5.", "Step") == ["Let me see. ", "Step 1: 3. ", "Step 2: 5."]
    assert split_steps("Step 1: 3.", "Step") == ["Step 1: 3."]
    assert split_steps("", "\n") == [] and split_steps("53", "\n") == ["53"]
    with pytest.raises(ValueError, match="empty"):
        split_steps("a", "")


def test_step_ends_on_the_character_tokenizer():
    tok = build_char_tokenizer()
    text = "12+34=046\n046+07=053\n"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    steps = completion_steps(ids, tok, "\n")
    # one token per character: "12+34=046\n" is characters 0..9, "046+07=053\n" 10..20; the eos (21) ends no step
    assert steps.texts == ("12+34=046\n", "046+07=053\n")
    assert steps.token_ends == (9, 20)
    assert completion_steps(ids[:-1], tok, "\n").token_ends == (9, 20)     # truncated: no eos, same steps
    assert completion_steps([tok.eos_token_id], tok, "\n").token_ends == ()  # an empty completion has no step


def test_step_ends_on_a_byte_level_bpe_are_exact(llama_dir):
    tok = load_tokenizer(llama_dir)

    def ids(*tokens: str) -> list[int]:
        out = tok.convert_tokens_to_ids(list(tokens))
        assert None not in out and tok.unk_token_id not in out, tokens
        return out

    eos = tok.eos_token_id
    # "→" is three bytes, three byte-level tokens (â Ĩ Ĵ): the last step ends at its LAST byte's token, 8, not at
    # 6, where the text so far decodes to "...brief\ufffd"
    sampled = ids("Ġ1", "2", ".", "Ċ", "Be", "Ġbrief", "â", "Ĩ", "Ĵ") + [eos]
    assert tok.decode(sampled[:7]).endswith("brief\ufffd")
    steps = completion_steps(sampled, tok, "\n")
    assert steps.texts == (" 12.\n", "Be brief→") and steps.token_ends == (3, 8)
    # the same text sampled as other tokens (" 1" "2" vs " 12"... here "Ġ" "1" "2"): the ends follow the tokens
    other = ids("Ġ", "1", "2", ".", "Ċ", "B", "e", "Ġbrief", "â", "Ĩ", "Ĵ") + [eos]
    assert completion_steps(other, tok, "\n").token_ends == (4, 10)
    # a marker with text starts a step: "Ġis" holds the space that ends step 1 and the "is" that starts step 2,
    # so step 1 ends at it (3)
    sampled = ids("Th", "e", "Ġanswer", "Ġis", "Ġ1", "2", ".") + [eos]
    steps = completion_steps(sampled, tok, "is")
    assert steps.texts == ("The answer ", "is 12.") and steps.token_ends == (3, 6)
    # two steps completed by the same token are one ("Ġanswer" holds " an" and "swer")
    steps = completion_steps(ids("Ġanswer") + [eos], tok, "s")
    assert steps.texts == (" answer",) and steps.token_ends == (0,)
    # the canonical encoding: every end is the first token whose prefix decodes to the whole step
    text = "What is 3 + 4?\nThe answer is 7.\n\nBe brief, think→.\n"
    canonical = tok(text, add_special_tokens=False)["input_ids"] + [eos]
    steps = completion_steps(canonical, tok, "\n")
    done = ""
    for step, end in zip(steps.texts, steps.token_ends, strict=True):
        done += step
        assert tok.decode(canonical[: end + 1]).startswith(done) and not tok.decode(canonical[:end]).startswith(done)
    assert "".join(steps.texts) == text and len(steps.texts) == 3


def test_rollout_steps_refuse_multi_turn_rows():
    tok = build_char_tokenizer()
    rollout = rollout_of(tok, ["1+2+3="], ["1+2=3\n3+3=6\n"], 1)
    assert rollout_steps(rollout, tok, "\n")[0].token_ends == (5, 11)
    multi = Rollout(**{**rollout.__dict__, "loss_mask": rollout.completion_mask})
    with pytest.raises(NotImplementedError, match="multi-turn"):
        rollout_steps(multi, tok, "\n")


# ------------------------------------------------------------------ aggregation


def test_aggregates_by_hand():
    scores = torch.tensor([[0.9, 0.2, 0.6], [0.5, 0.8, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    expected = {
        "min": [0.2, 0.5, NAN],
        "mean": [(0.9 + 0.2 + 0.6) / 3, (0.5 + 0.8) / 2, NAN],     # 0.566667, 0.65
        "last": [0.6, 0.8, NAN],
        "product": [0.9 * 0.2 * 0.6, 0.5 * 0.8, NAN],             # 0.108, 0.4
    }
    assert set(AGGREGATES) == set(expected)
    for name, values in expected.items():
        torch.testing.assert_close(AGGREGATES[name](scores, mask), torch.tensor(values), equal_nan=True)
    # what a padded step holds never matters
    padded = scores.masked_fill(~mask, 7.0)
    for name in expected:
        torch.testing.assert_close(AGGREGATES[name](padded, mask), AGGREGATES[name](scores, mask), equal_nan=True)


def test_token_advantages_by_hand_with_the_group_normalisation():
    # Group 0: row 0 steps [0.8, 0.4] ending at tokens [1, 3]; row 1 steps [0.2, 0.6] ending at [0, 2].
    # All four step rewards R = {0.8, 0.4, 0.2, 0.6}: mean 0.5, Bessel std sqrt((.09+.01+.09+.01)/3) = 0.258199,
    # normalised 0.8 -> 1.161895, 0.4 -> -0.387298, 0.2 -> -1.161895, 0.6 -> 0.387298.
    # A_t = sum of the row's normalised rewards of steps ending at or after t:
    #   row 0: t0, t1: 1.161895 - 0.387298 = 0.774597; t2, t3: -0.387298; t4 (eos): 0
    #   row 1: t0: -1.161895 + 0.387298 = -0.774597; t1, t2: 0.387298; t3, t4: 0
    # Group 1: row 2 steps [0.5, 0.5] (all equal: std 0, normalised 0), row 3 no steps: zeros.
    rewards = torch.tensor([[0.8, 0.4], [0.2, 0.6], [0.5, 0.5], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, True], [True, True], [False, False]])
    ends = torch.tensor([[1, 3], [0, 2], [0, 1], [0, 0]])
    groups = torch.tensor([0, 0, 1, 1])
    a, b = 1.161895 - 0.387298, 0.387298
    expected = torch.tensor([[a, a, -b, -b, 0.0], [-a, b, b, 0.0, 0.0], [0.0] * 5, [0.0] * 5])
    out = process_token_advantages(rewards, mask, ends, groups, width=5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    # each group is normalised alone: a third group changes nothing in the others
    more = process_token_advantages(torch.cat([rewards, torch.tensor([[0.1, 0.9]])]),
                                    torch.cat([mask, torch.tensor([[True, True]])]),
                                    torch.cat([ends, torch.tensor([[2, 4]])]), torch.tensor([0, 0, 1, 1, 2]), width=5)
    torch.testing.assert_close(more[:4], expected, atol=1e-5, rtol=0)
    # normalised within the group: a shift or a positive scale of every step reward changes nothing
    torch.testing.assert_close(process_token_advantages(3.0 * rewards - 1.0, mask, ends, groups, 5), out,
                               atol=1e-4, rtol=0)


def test_step_bce_by_hand():
    # z = [0, 2 | -1, pad], y = [1, 0 | 1, -]; per step softplus(z) - y z:
    # log 2 = 0.693147, log(1 + e^2) = 2.126928, log(1 + e) = 1.313262; mean over the 3 steps = 1.377779
    logits = torch.tensor([[0.0, 2.0], [-1.0, 5.0]], requires_grad=True)
    labels = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    mask = torch.tensor([[True, True], [True, False]])
    out = step_bce(logits, labels, mask)
    expected = [math.log(2.0), math.log1p(math.exp(2.0)), math.log1p(math.exp(1.0))]
    torch.testing.assert_close(out.losses, torch.tensor([[expected[0], expected[1]], [expected[2], 0.0]]))
    assert out.loss.item() == pytest.approx(sum(expected) / 3, abs=1e-6)
    assert out.accuracy == pytest.approx(0.0)      # z=0 says "wrong" for a right step; z=2 and z=-1 disagree too
    # d loss / d z = (sigmoid(z) - y) / 3 on the steps, 0 on padding
    out.loss.backward()
    by_hand = [[(0.5 - 1) / 3, (1 / (1 + math.exp(-2)) - 0) / 3], [(1 / (1 + math.e) - 1) / 3, 0.0]]
    torch.testing.assert_close(logits.grad, torch.tensor(by_hand))


def test_encode_steps_reads_each_step_at_its_last_token():
    tok = build_char_tokenizer()
    batch = encode_steps(tok, ["1+2+3=", "9+9+9="], [["1+2=3\n", "3+3=6\n"], ["9+9=18\n"]])
    # prompt 6 characters, then "1+2=3\n" (6: ends at 11) and "3+3=6\n" (ends at 17); row 1: "9+9=18\n" ends at 12
    assert batch.step_ends.tolist() == [[11, 17], [12, 0]]
    assert batch.step_mask.tolist() == [[True, True], [True, False]]
    assert tok.decode(batch.input_ids[0, : 18]) == "1+2+3=1+2=3\n3+3=6\n"
    assert batch.attention_mask.sum(1).tolist() == [18, 13]


# ------------------------------------------------------------------ Math-Shepherd labels


class ScriptedEngine:
    """Continuations looked up by the decoded context: what a policy would write after each step prefix."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tokenizer, self.script, self.contexts = tokenizer, script, []

    def generate_ids(self, prompt_ids, group_size, params, policy_version=0, generator=None) -> Rollout:
        self.contexts += [list(p) for p in prompt_ids]
        texts = [t for p in prompt_ids for t in self.script[self.tokenizer.decode(p)][:group_size]]
        rollout = rollout_of(self.tokenizer, ["x"], texts, len(texts))
        return Rollout(**{**rollout.__dict__, "prompt_ids": [list(p) for p in prompt_ids for _ in range(group_size)]})


def test_shepherd_labels_on_a_scripted_engine():
    tok = build_char_tokenizer()
    task = ChainSumTask(terms=3, zero_pad=False)
    example = Example("1+2+3=", "6", {"numbers": [1, 2, 3]})
    solutions = ["1+2=3\n3+3=6\n",      # right
                 "1+2=4\n4+3=7\n",      # wrong from step 1 on
                 "1+2=9\n9+3=12\n"]     # wrong from step 1 on
    engine = ScriptedEngine(tok, {
        "1+2+3=1+2=3\n": ["3+3=6\n", "3+3=7\n", "3+3=6\n", "3+3=5\n"],     # 2 of 4 reach 6
        "1+2+3=1+2=4\n": ["4+3=7\n", "4+2=6\n", "4+3=7\n", "4+3=8\n"],     # 1 of 4 (by luck)
        "1+2+3=1+2=9\n": ["9+3=12\n", "9+3=11\n", "9+3=12\n", "9+3=13\n"],  # none
    })
    rollout = rollout_of(tok, [example.prompt], solutions, group_size=3)
    labels = shepherd_labels(engine, task, [example], rollout, tok, marker="\n", continuations=4,
                             params=SamplingParams())
    # hard: any continuation reached "6"; soft: the fraction; the last step is the verifier on the solution itself
    assert [(lab.steps, lab.hard, lab.soft) for lab in labels] == [
        (("1+2=3\n", "3+3=6\n"), (1.0, 1.0), (0.5, 1.0)),
        (("1+2=4\n", "4+3=7\n"), (1.0, 0.0), (0.25, 0.0)),
        (("1+2=9\n", "9+3=12\n"), (0.0, 0.0), (0.0, 0.0)),
    ]
    assert all(lab.prompt == "1+2+3=" for lab in labels)
    # continued from the sampled tokens themselves: the prompt's ids, then the solution's up to the step's "\n"
    prompt_ids = tok("1+2+3=", add_special_tokens=False)["input_ids"]
    assert engine.contexts == [prompt_ids + tok(s[:6], add_special_tokens=False)["input_ids"] for s in solutions]


# ------------------------------------------------------------------ a PRM trained on chain_sum

WIDTH64 = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
           "model.intermediate_size=128", "sft.steps=600", "sft.batch_size=64", "sft.lr=3e-3", "sft.warmup_steps=10"]


def exact_labels(task: ChainSumTask, examples: list[Example], seed: int) -> list[StepLabels]:
    """One solution per problem, right (p 0.4) or with one miscalculated step, labelled by `step_correct`."""
    rng = random.Random(seed)
    out = []
    for e in examples:
        text = task.teacher_completion(e, rng) if rng.random() < 0.4 else task.corrupt_completion(e, rng)
        steps = split_steps(text, "\n")
        right = tuple(float(ok) for ok in task.step_correct(e, steps))
        out.append(StepLabels(e.prompt, tuple(steps), right, right))
    return out


def train_prm(seed: int, folder) -> dict:
    """A width-64 policy after a brief SFT on 1-digit chain sums ("3+5+7=" -> "3+5=08\\n08+7=15\\n"), and a PRM
    from its backbone trained on exactly labelled solutions of the train problems, everything drawn from
    `seed` (the held-out solutions stay those of seed 1). ~70 s on one CPU thread.

    2000 PRM steps, not 1000: after 1000, one seed in three (2) still gave the right and the wrong first step
    of ALL_WRONG the same score (0.73), so the all-wrong-group test below failed; after 2000 all five runs
    measured (seeds 0 / 1 / 2, and 0 / 2 with another float rounding, see the next test) rank them right."""
    torch.manual_seed(seed)
    cfg = build_config(WIDTH64)
    task = ChainSumTask(terms=3)
    policy = build_tiny_qwen2(cfg.model, seed=seed)
    run_sft(policy, task.sft_examples(cfg.sft.steps * cfg.sft.batch_size, 0.0, seed=seed), cfg.sft,
            chat_template="auto", seed=seed)
    problems = task.train_split(780)
    train = exact_labels(task, problems, seed=10 * seed) + exact_labels(task, problems, seed=10 * seed + 2)
    held_out = exact_labels(task, task.eval_split(150), seed=1)
    prm = build_process_reward_model(policy)
    before = step_accuracy(prm.model, prm.tokenizer, held_out)
    fit = train_process_reward_model(prm.model, prm.tokenizer, train, steps=2000, batch_size=32, lr=1e-3, seed=seed)
    path = save_process_reward_model(prm.model, prm.tokenizer, folder / "prm", marker="\n")
    return {"task": task, "policy": policy, "prm": prm, "before": before, "fit": fit, "path": path,
            "after": step_accuracy(prm.model, prm.tokenizer, held_out), "auc": step_auc(prm, held_out)}


def step_auc(prm, data: list[StepLabels]) -> float:
    """The probability that a right step of `data` scores above a wrong one (ties count 1/2): the PRM's ranking,
    whatever its threshold."""
    with torch.no_grad():
        probs, mask = step_probabilities(prm.model, prm.tokenizer, [d.prompt for d in data],
                                         [list(d.steps) for d in data])
    scored = list(zip(probs[mask.bool()].tolist(), [h for d in data for h in d.hard], strict=True))
    right, wrong = [p for p, h in scored if h == 1.0], [p for p, h in scored if h == 0.0]
    return sum((r > w) + 0.5 * (r == w) for r in right for w in wrong) / (len(right) * len(wrong))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # two threads on a busy two-core machine took ten times longer
    yield train_prm(0, tmp_path_factory.mktemp("prm"))
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_prm_learns_which_steps_of_unseen_chain_sums_are_right(trained):
    before, after, fit = trained["before"], trained["after"], trained["fit"]
    assert fit.first_loss == pytest.approx(math.log(2), abs=1e-6)     # the zero head: every step at 1/2
    assert before.accuracy == pytest.approx(1 - before.positive_rate)   # 1/2 is not > 1/2: "wrong" everywhere
    assert after.steps == 300 and after.positive_rate == pytest.approx(0.55)
    # Held-out problems (eval split), never trained on: a constant guess scores max(0.55, 0.45), a random
    # ranking an AUC of 0.5.
    #
    # These figures hang on the CPU's float rounding, not only on the seed. The thread count is fixed (1, above),
    # but the fused training kernels (reinforge/kernels, built with -march=native -ffast-math) sum with `omp simd`
    # in an order set by the CPU's vector width, and torch's own CPU kernels take an AVX2 or AVX-512 path; the
    # last-bit differences grow over 2600 SFT and PRM steps into another end point. Seed 0 with torch held to
    # AVX2 and the fused kernels off (ATEN_CPU_CAPABILITY=avx2 REINFORGE_CPU_KERNELS=0, as on another CPU) gave
    # 0.767 instead of 0.880 after 1000 steps, the spread of the seeds (0.880 / 0.793 / 0.717) and of the
    # 0.703 an Intel Xeon gave. So the bounds are set below the worst of five runs, 2000 steps each:
    #     seed                        0       1       2       0, other rounding   2, other rounding
    #     accuracy                    0.943   0.803   0.723   0.903               0.787
    #     AUC                         0.983   0.887   0.795   0.947               0.846
    #     last-step accuracy          0.907   0.693   0.613   0.853               0.727
    # The last-step accuracy is not asserted: a constant guess scores 0.62 there, and seed 2 did not beat it.
    assert after.accuracy >= 0.65
    assert trained["auc"] >= 0.72


@pytest.mark.slow
def test_the_saved_prm_loads_with_transformers_and_gives_the_same_scores(trained):
    prm, path = trained["prm"], trained["path"]
    loaded = AutoModelForTokenClassification.from_pretrained(path)
    assert type(loaded).__name__ == "Qwen2ForTokenClassification"
    assert loaded.config.num_labels == 1 and loaded.config.step_marker == "\n"
    tokenizer = load_tokenizer(path)
    assert tokenizer.get_vocab() == prm.tokenizer.get_vocab()
    prompts, steps = ["3+5+7=", "1+1+1="], [["3+5=08\n", "08+7=15\n"], ["1+1=03\n"]]
    with torch.no_grad():
        original = step_logits(prm.model, encode_steps(prm.tokenizer, prompts, steps))
        reloaded = step_logits(loaded, encode_steps(tokenizer, prompts, steps))
    assert original.abs().max() > 0.5
    torch.testing.assert_close(reloaded, original, atol=1e-5, rtol=0)


# Four wrong solutions of 3+5+7 = 15: the verifier gives all 0, so without a PRM the group's advantages are 0.
# (Errors of several units: the PRM above may mistake near misses by 1.) The PRM's step scores, seeds 0 / 1 / 2:
ALL_WRONG = ["3+5=08\n08+7=16\n",   # step 1 right:      0.992 0.728 / 0.979 0.392 / 0.885 0.518
             "3+5=13\n13+7=20\n",   # wrong from step 1: 0.001 0.001 / 0.004 0.005 / 0.057 0.014
             "3+5=08\n08+7=11\n",   # step 1 right:      0.992 0.001 / 0.979 0.845 / 0.885 0.518
             "3+5=04\n04+7=11\n"]   # wrong from step 1: 0.001 0.001 / 0.004 0.006 / 0.008 0.007
WRONG_EXAMPLE = Example("3+5+7=", "15", {"numbers": [3, 5, 7]})


def composed(trained, aggregate: str | None) -> tuple[torch.Tensor, Rollout]:
    """Advantages [4, T] of ALL_WRONG under the verifier alone (aggregate None) or with the PRM as a source."""
    policy, task = trained["policy"], trained["task"]
    reward = RewardConfig(functions=["verifier"], **({"process": {"path": str(trained["path"]), "aggregate": aggregate,
                                                                  "weight": 1.0}} if aggregate else {}))
    context = SourceContext(task=task, device="cpu", chat_template="auto", policy=policy)
    composer = RewardComposer(reward, task, 32, build_sources(reward, context))
    rollout = rollout_of(policy.tokenizer, [WRONG_EXAMPLE.prompt], ALL_WRONG, group_size=4)
    scored = composer.score([WRONG_EXAMPLE], rollout, group_size=4)
    assert scored.parts["verifier"].tolist() == [0.0] * 4
    return with_token_terms(grpo(scored.total, rollout.group_ids), scored.token_advantages,
                            rollout.completion_mask), rollout


@pytest.mark.slow
def test_a_prm_source_gives_an_all_wrong_group_a_signal(trained):
    alone, _ = composed(trained, None)
    assert alone.abs().max() == 0.0                                     # GRPO: an all-wrong group has no signal
    # mean of the step scores: the solutions whose first step is right score higher. (Not each of them above the
    # group's mean: on an Intel Xeon the PRM scored the second step of "3+5=13\n13+7=20\n", right from its wrong
    # premise, high enough to lift that solution over the mean: advantages 0.61, 0.27, 0.60, -1.48.)
    mean, _ = composed(trained, "mean")
    assert mean.dim() == 1 and mean[[0, 2]].min() > mean[[1, 3]].max() and mean[[0, 2]].min() > 0
    # token: each step's score normalised in the group, credited to the tokens up to its end
    tokens, rollout = composed(trained, "token")
    first_step = slice(0, 7)                                            # "3+5=08\n": tokens 0..6
    # (Again by order: on the Intel Xeon the PRM gave "3+5=13" a step advantage of +0.39 against 0.88-0.90 for
    # "3+5=08" and -2.17 for "3+5=04".)
    right, wrong = tokens[[0, 2], first_step], tokens[[1, 3], first_step]
    assert right.min() > wrong.max() and (right > 0).all()
    eos = rollout.completion_mask.sum(1).long() - 1
    assert tokens[torch.arange(4), eos].abs().max() == 0                # no step ends after the eos


@pytest.mark.slow
def test_a_prm_source_scores_by_its_own_steps(trained):
    prm, policy = trained["prm"], trained["policy"]
    reward = RewardConfig(functions=[], process={"path": str(trained["path"]), "aggregate": "min"})
    source = build_sources(reward, SourceContext(task=trained["task"], device="cpu", chat_template="auto",
                                                 policy=policy))[0]
    assert source.marker == "\n"                                        # from the PRM's config
    rollout = rollout_of(policy.tokenizer, [WRONG_EXAMPLE.prompt], [*ALL_WRONG[:2], ""], group_size=3)
    out = source.score([WRONG_EXAMPLE] * 3, rollout)
    probs, mask = step_probabilities(prm.model, prm.tokenizer, ["3+5+7="] * 2,
                                     [split_steps(t, "\n") for t in ALL_WRONG[:2]])
    torch.testing.assert_close(out.values[:2], probs.min(dim=1).values)
    assert math.isnan(out.values[2]) and out.unscored == 1             # an empty completion has no step to score


def test_process_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="reward.process.aggregate"):
        build_config(["reward.process.path=x", "reward.process.aggregate=median"])
    reward = RewardConfig(process={"path": str(tmp_path)})
    policy = build_tiny_qwen2(build_config(WIDTH64).model, seed=0)
    with pytest.raises(ConfigError, match=r"reward.process.path .* \(no config.json\)"):
        build_sources(reward, SourceContext(task=ChainSumTask(), device="cpu", chat_template="auto", policy=policy))


# ------------------------------------------------------------------ Math-Shepherd with a real engine


@pytest.mark.slow
def test_generate_ids_samples_what_generate_samples(trained):
    engine = NativeEngine(trained["policy"])
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    prompts = ["3+5+7=", "1+2+3="]
    by_text = engine.generate(prompts, 3, params, generator=torch.Generator().manual_seed(5))
    by_ids = engine.generate_ids(encode_prompts(trained["policy"].tokenizer, prompts), 3, params,
                                 generator=torch.Generator().manual_seed(5))
    assert torch.equal(by_ids.completion_ids, by_text.completion_ids) and by_ids.texts == by_text.texts


@pytest.mark.slow
def test_shepherd_dataset_from_the_sft_policy(trained):
    task, policy = trained["task"], trained["policy"]
    examples = task.eval_split(6)
    labels = shepherd_dataset(NativeEngine(policy), task, examples, policy.tokenizer, samples=2, continuations=4,
                              params=SamplingParams(temperature=1.0, max_new_tokens=16),
                              generator=torch.Generator().manual_seed(0))
    assert len(labels) == 12
    for lab in labels:
        assert all(s in (0.0, 0.25, 0.5, 0.75, 1.0) for s in lab.soft)
        assert all((h == 1.0) == (s > 0) for h, s in zip(lab.hard, lab.soft, strict=True))
        assert lab.hard[-1] == lab.soft[-1]                               # the last step: the verifier itself
        example = next(e for e in examples if e.prompt == lab.prompt)
        assert lab.hard[-1] == task.reward(example, "".join(lab.steps))


@pytest.mark.slow
def test_process_reward_model_job_labels_trains_and_saves(trained, tmp_path):
    from reinforge.jobs.process_reward_model import run_process_reward_model_job
    from reinforge.models import save_policy

    save_policy(trained["policy"], tmp_path / "policy")
    cfg = build_config([f"model.path={tmp_path / 'policy'}", "task.name=chain_sum", "task.options.terms=3",
                        "sft.enabled=false", "prm.num_prompts=16", "prm.samples_per_prompt=2", "prm.continuations=4",
                        "prm.heldout_prompts=8", "prm.steps=20", "prm.batch_size=8", "threads=1"])
    result = run_process_reward_model_job(cfg, tmp_path / "prm")
    assert (result.train_solutions, result.heldout_solutions) == (32, 16)
    assert result.first_loss == pytest.approx(math.log(2), abs=1e-6)
    # Math-Shepherd's labels from the SFT policy against each step's true correctness (step_correct)
    # measured 0.917 / 0.927 / 0.917 with the SFT policy of seeds 0 / 1 / 2 (88, 89, 88 of 96 steps)
    assert result.label_exact_agreement >= 0.8
    lines = (tmp_path / "prm" / "step_labels.jsonl").read_text().splitlines()
    assert len(lines) == 48 and json.loads(lines[-1])["split"] == "heldout"
    assert json.loads((tmp_path / "prm" / "prm_summary.json").read_text())["train_steps"] == result.train_steps
    assert AutoModelForTokenClassification.from_pretrained(tmp_path / "prm").config.step_marker == "\n"
    with pytest.raises(FileExistsError):
        run_process_reward_model_job(cfg, tmp_path / "prm")
