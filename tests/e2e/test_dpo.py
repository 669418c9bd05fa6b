"""The DPO loop: loss and gradient at the start by hand, the verifier pair builder, learning on
fixed pairs, the dataset source, the NaN guard, and exact resume."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from reinforge.config import build_config
from reinforge.curation.batches import PromptStream
from reinforge.data import DatasetError
from reinforge.errors import ConfigError
from reinforge.jobs.rl import run_dpo
from reinforge.jobs.start import preference_spec
from reinforge.learner import (
    ForwardPlan,
    Reference,
    build_optimizer,
    completion_token_stats,
    warmup_constant,
)
from reinforge.loops.dpo import (
    OnPolicyPairs,
    PreferencePair,
    dpo_update,
    preference_backward,
    preference_pairs,
    tokenized_pairs,
    verifier_pairs,
)
from reinforge.models import build_tiny_qwen2
from reinforge.objectives.spec import PreferenceSpec
from reinforge.rollout import Rollout, SamplingParams, build_engine
from reinforge.tasks import Example
from reinforge.tasks.arithmetic import ArithmeticTask

PAIRS = [
    PreferencePair("05+34=", "039", "040"),
    PreferencePair("12+19=", "031", "021"),
    PreferencePair("70+08=", "078", "0078"),
    PreferencePair("99+99=", "198", "189"),
]


def _policy(micro_overrides, *extra: str):
    cfg = build_config([*micro_overrides, "recipe=dpo", *extra])
    return cfg, build_tiny_qwen2(cfg.model, seed=0)


def _ref_logprobs(model, seq):
    return Reference(model).logprobs(seq, 1.0, ForwardPlan()).sum(dim=1)


def _grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


# ------------------------------------------------------------------ loss and gradient by hand

@pytest.mark.parametrize("plan", [ForwardPlan(), ForwardPlan(micro_batch_size=2, chunk_size=3, shared_prefix=True)],
                         ids=["plain", "micro2_chunked_shared"])
def test_start_loss_is_log2_and_gradient_is_minus_beta_half_grad_margin(micro_overrides, plan) -> None:
    # With policy == reference every h = logp - ref is 0, so z = 0 and l = -log sigmoid(0) = log 2 per pair.
    # dl/dz = -beta sigmoid(-beta z) = -beta / 2 at z = 0; the loss is the mean over P pairs, so
    #   grad = -(beta / 2P) sum_p grad [logp(y_w,p) - logp(y_l,p)]   (ref has no gradient).
    # The right side is computed with the plain full-logits forward, whatever `plan` the update used.
    _, policy = _policy(micro_overrides)
    model, spec = policy.model, PreferenceSpec(beta=0.3)
    seq = tokenized_pairs(policy, PAIRS, "auto")
    ref = _ref_logprobs(model, seq)
    model.zero_grad(set_to_none=True)
    out = preference_backward(model, seq, ref, spec, plan)
    logprobs, finite = out.logprobs, out.finite
    got = _grads(model)
    num = len(PAIRS)
    torch.testing.assert_close(logprobs, ref, rtol=0, atol=2e-5)
    loss = -torch.nn.functional.logsigmoid(
        spec.beta * ((logprobs[:num] - ref[:num]) - (logprobs[num:] - ref[num:]))
    ).mean()
    assert finite and loss.item() == pytest.approx(math.log(2), abs=1e-5)

    model.zero_grad(set_to_none=True)
    summed = completion_token_stats(model, seq).logprobs.sum(dim=1)
    (-(spec.beta / (2 * num)) * (summed[:num].sum() - summed[num:].sum())).backward()
    for g, expected in zip(got, _grads(model), strict=True):
        torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-7)
    assert sum(float(g.abs().sum()) for g in got) > 0


def _fixed_pairs(micro_overrides, lr: float):
    """The micro policy's model, PAIRS as sequences, their reference log-probs, and an optimizer of rate `lr`."""
    _, policy = _policy(micro_overrides)
    seq = tokenized_pairs(policy, PAIRS, "auto")
    return policy.model, seq, _ref_logprobs(policy.model, seq), build_optimizer(policy.model, lr)


def test_update_metrics_at_the_start(micro_overrides) -> None:
    model, seq, ref, optimizer = _fixed_pairs(micro_overrides, 1e-3)
    out = dpo_update(
        model, optimizer, warmup_constant(optimizer, 0), seq, ref, PreferenceSpec(), ForwardPlan(), grad_clip=1.0
    )
    assert out.stepped
    assert out.metrics["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert out.metrics["dpo/margin"] == pytest.approx(0.0, abs=1e-5)
    assert out.metrics["dpo/chosen_logp"] == pytest.approx(float(ref[:4].mean()), abs=1e-4)
    assert out.metrics["dpo/rejected_logp"] == pytest.approx(float(ref[4:].mean()), abs=1e-4)


def test_reward_accuracy_and_margin_rise_on_fixed_pairs(micro_overrides) -> None:
    model, seq, ref, optimizer = _fixed_pairs(micro_overrides, 3e-3)
    spec = PreferenceSpec(beta=0.1)
    scheduler = warmup_constant(optimizer, 0)
    history = [
        dpo_update(model, optimizer, scheduler, seq, ref, spec, ForwardPlan(), grad_clip=1.0).metrics for _ in range(8)
    ]
    after = dpo_update(model, optimizer, scheduler, seq, ref, spec, ForwardPlan(), grad_clip=1.0).metrics
    # Step 0: every pair is a tie (h_w = h_l = 0), which counts as wrong.
    assert history[0]["dpo/reward_accuracy"] == 0.0
    assert after["dpo/reward_accuracy"] == 1.0
    # Measured with the policy's seed 0 / 1 / 2: margin 0.317 / 0.330 / 0.303, loss 0.549 / 0.545 / 0.555 (the
    # bounds: 0.1 and 0.643), margins rising at every step on all three; seed 0 runs here.
    assert after["dpo/margin"] > 0.1 and after["dpo/loss"] < math.log(2) - 0.05, after
    margins = [m["dpo/margin"] for m in history] + [after["dpo/margin"]]
    assert margins == sorted(margins), margins


def test_nonfinite_update_moves_nothing(micro_overrides) -> None:
    model, seq, ref, optimizer = _fixed_pairs(micro_overrides, 1e-2)
    scheduler = warmup_constant(optimizer, 2)
    # Adam has moments now
    dpo_update(model, optimizer, scheduler, seq, ref, PreferenceSpec(), ForwardPlan(), grad_clip=1.0)
    weights, moments = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    ref[1] = float("nan")
    out = dpo_update(model, optimizer, scheduler, seq, ref, PreferenceSpec(), ForwardPlan(), grad_clip=1.0)
    assert not out.stepped and math.isnan(out.metrics["grad_norm"])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    state = optimizer.state_dict()["state"]
    assert all(torch.equal(moments["state"][i]["exp_avg"], state[i]["exp_avg"]) for i in state)
    assert scheduler.last_epoch == 1 and all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ on-policy pairs

def test_verifier_pairs_by_hand() -> None:
    correct = torch.tensor([[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    # prompt 0: right rows 0, 2, wrong 1, 3 -> k < min(3, 2): (0, 1), (2, 3); prompts 1 and 2: one kind only;
    # prompt 3: right 12, wrong 13, 14, 15 -> k < min(3, 3): (12, 13), (12, 14), (12, 15).
    assert verifier_pairs(correct, 3) == [(0, 1), (2, 3), (12, 13), (12, 14), (12, 15)]
    assert verifier_pairs(correct, 1) == [(0, 1), (12, 13)]
    valid = torch.ones_like(correct)
    valid[0, 1] = valid[3, 0] = False      # their episodes' environments failed: in no pair
    # prompt 0: right 0, 2, wrong 3 alone -> (0, 3), (2, 3); prompt 3: its one right sample failed -> none.
    assert verifier_pairs(correct, 3, valid) == [(0, 3), (2, 3)]
    assert verifier_pairs(correct[1:3], 4) == []


class ScriptedEngine:
    """Returns the scripted completions of each prompt (group_size of them), tokenized with eos."""

    def __init__(self, tokenizer, script: dict[str, list[str]]):
        self.tokenizer, self.script = tokenizer, script

    def generate(self, prompts, group_size, params, policy_version=0) -> Rollout:
        texts = [t for p in prompts for t in self.script[p][:group_size]]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id] for t in texts]
        width = max(map(len, ids))
        completion_ids = torch.full((len(ids), width), self.tokenizer.pad_token_id)
        mask = torch.zeros(len(ids), width)
        for i, row in enumerate(ids):
            completion_ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1.0
        prompt_ids = [
            self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(group_size)
        ]
        return Rollout(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            pad_id=self.tokenizer.pad_token_id,
            completion_mask=mask,
            sampler_logprobs=torch.zeros(len(ids), width),
            truncated=torch.zeros(len(ids), dtype=torch.bool),
            group_ids=torch.arange(len(prompts)).repeat_interleave(group_size),
            policy_version=policy_version,
            texts=texts,
        )


def test_on_policy_source_pairs_correct_with_incorrect_samples(micro_overrides) -> None:
    _, policy = _policy(micro_overrides)
    examples = [Example("05+34=", "39", {}), Example("12+19=", "31", {}), Example("20+20=", "40", {})]
    script = {"05+34=": ["039", "040", "39", "38"],     # right, wrong, right, wrong
              "12+19=": ["031", "031", "031", "031"],   # all right: no pair
              "20+20=": ["41", "040", "4", "0"]}        # one right (row 1)
    source = OnPolicyPairs(PromptStream(examples, seed=0), ScriptedEngine(policy.tokenizer, script), ArithmeticTask(),
                           SamplingParams(), prompts_per_step=3, group_size=4, pairs_per_prompt=2,
                           pad_id=policy.tokenizer.pad_token_id)
    pairs = source.draw(version=0)
    seq, tok = pairs.sequences, policy.tokenizer

    def text(row: int) -> tuple[str, str]:
        ids = seq.input_ids[row, : int(seq.attention_mask[row].sum())]
        start = int(seq.starts[row])
        return tok.decode(ids[:start]), tok.decode(ids[start:], skip_special_tokens=True)

    num = seq.input_ids.shape[0] // 2
    got = {(text(p)[0], text(p)[1], text(p + num)[1]) for p in range(num)}
    assert got == {("05+34=", "039", "040"), ("05+34=", "39", "38"), ("20+20=", "040", "41"), ("20+20=", "040", "4")}
    assert torch.equal(seq.group_ids, torch.arange(2 * num) % num)
    # Verifier reward of all 12 samples: 2 + 4 + 1 correct.
    assert pairs.metrics["dpo/pairs"] == 4 and pairs.metrics["reward_mean"] == pytest.approx(7 / 12)


# ------------------------------------------------------------------ dataset pairs and config

def test_dataset_pairs_read_and_bad_rows_named(tmp_path) -> None:
    good = tmp_path / "pairs.jsonl"
    good.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "05+34=", "good": "039", "rejected": "040", "id": 1},
        {"prompt": "12+19=", "good": "031", "rejected": "021"},
    ]) + "\n")
    assert preference_pairs(str(good), {"chosen": "good"}) == [
        PreferencePair("05+34=", "039", "040"),
        PreferencePair("12+19=", "031", "021"),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "1", "rejected": "2"}\n\n{"prompt": "b", "chosen": 3, "rejected": "2"}\n')
    with pytest.raises(DatasetError, match=r"line 3: field 'chosen' must be str, got int"):
        preference_pairs(str(bad))
    bad.write_text('{"prompt": "a", "chosen": "1", "rejected": "2"}\n{"prompt": "b", "chosen": "1"}\n')
    with pytest.raises(DatasetError, match=r"line 2: field 'rejected' is missing"):
        preference_pairs(str(bad))
    bad.write_text('{"prompt": "a", "chosen": "1", "rejected": "1"}\n')
    with pytest.raises(DatasetError, match=r"line 1: chosen and rejected are the same text"):
        preference_pairs(str(bad))


def test_config_and_spec(micro_overrides) -> None:
    with pytest.raises(ConfigError, match="dpo.pairs=dataset needs dpo.pairs_path"):
        build_config([*micro_overrides, "recipe=dpo", "dpo.pairs=dataset"])
    cfg = build_config([*micro_overrides, "recipe=dpo", "dpo.beta=0.5", "dpo.loss_type=ipo"])
    assert preference_spec(cfg) == PreferenceSpec(loss_type="ipo", beta=0.5, label_smoothing=0.0)
    assert preference_spec(build_config(["recipe=dpo"])) == PreferenceSpec(loss_type="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="ipo' takes no label_smoothing"):
        preference_spec(build_config(["recipe=dpo", "dpo.loss_type=ipo", "dpo.label_smoothing=0.1"]))
    with pytest.raises(ValueError, match="did you mean 'sigmoid'"):
        preference_spec(build_config(["recipe=dpo", "dpo.loss_type=sigmoi"]))
    with pytest.raises(ValueError, match="objective.kl_coef sets a part of an RL objective"):
        preference_spec(build_config(["recipe=dpo", "objective.kl_coef=0.1"]))


# ------------------------------------------------------------------ the loop: resume

class ParityTask(ArithmeticTask):
    """A verifier an untrained model passes about half the time: the completion has an even length."""

    def reward(self, example, completion):
        return float(len(completion) % 2 == 0)


@pytest.mark.parametrize("mode", ["on_policy", "dataset"])
def test_resume_after_step_k_equals_an_uninterrupted_run(micro_overrides, tmp_path, mode) -> None:
    torch.set_num_threads(1)
    extra = ["train.steps=4", "train.lr=1e-3", "train.prompts_per_step=4"]   # enough groups that steps 1-2 form pairs
    if mode == "dataset":
        path = tmp_path / "pairs.jsonl"
        path.write_text(
            "".join(json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}) + "\n" for p in PAIRS)
        )
        extra += ["dpo.pairs=dataset", f"dpo.pairs_path={path}"]

    def run(saved=None, weights=None, stop_at=None):
        torch.manual_seed(0)
        cfg, policy = _policy(micro_overrides, *extra)
        if weights is not None:
            policy.model.load_state_dict(weights)
        kept, records = {}, []

        def on_step(record, state):
            records.append(record)
            if record.step == stop_at:
                kept["state"] = copy.deepcopy(state.state_dict())
                kept["weights"] = copy.deepcopy(policy.model.state_dict())

        engine = build_engine(cfg.rollout, policy)
        result = run_dpo(cfg, policy, engine, ParityTask(), preference_spec(cfg), on_step, saved=saved)
        return policy.model.state_dict(), kept, records, result

    straight, kept, records, result = run(stop_at=2)
    assert result.policy_version >= 2 and all(r.metrics["dpo/pairs"] > 0 for r in records[:2]), [
        r.metrics for r in records
    ]
    resumed, _, later, _ = run(saved=kept["state"], weights=kept["weights"])
    assert [r.step for r in later] == [3, 4]
    assert all(torch.equal(v, resumed[k]) for k, v in straight.items())
    untimed = [
        {k: v for k, v in r.metrics.items() if "seconds" not in k and k != "tokens_per_s"}
        for r in (*records[2:], *later)
    ]
    assert json.dumps(untimed[:2], sort_keys=True) == json.dumps(untimed[2:], sort_keys=True)   # NaN-safe


def test_reinforge_train_recipe_dpo_end_to_end(tmp_path, micro_overrides) -> None:
    """`reinforge train recipe=dpo` through the pipeline: SFT, evaluation, DPO steps on pairs from a file,
    evaluation, a checkpoint; and on-policy pairs, which the micro model (never correct) cannot form."""
    import json

    from typer.testing import CliRunner

    from reinforge.cli import app

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}) + "\n"
            for a in range(10, 14)
            for b in range(20, 23)
        )
    )
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", *micro_overrides, "recipe=dpo", "dpo.pairs=dataset",
                                      f"dpo.pairs_path={pairs}", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3] and [r["policy_version"] for r in rl] == [1, 2, 3]
    assert all(r["dpo/pairs"] > 0 and r["dpo/loss"] > 0 for r in rl)
    assert rl[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)        # policy == reference at step 1
    assert (out / "checkpoints" / "step-000003").is_dir() and (out / "model" / "model.safetensors").is_file()
    # With LoRA the reference is the base model with the adapters off (no copy): the loss still starts at log 2.
    lora = CliRunner().invoke(app, ["train", *micro_overrides, "recipe=dpo", "model.lora.r=4", "dpo.pairs=dataset",
                                    f"dpo.pairs_path={pairs}", f"output_dir={tmp_path / 'lora'}"])
    assert lora.exit_code == 0, lora.output
    lora_rl = [
        r for r in map(json.loads, (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"
    ]
    assert lora_rl[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5) and lora_rl[-1]["policy_version"] == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n" + json.dumps({"prompt": "2+2="}) + "\n"
    )
    refused = CliRunner().invoke(
        app,
        [
            "train", *micro_overrides, "recipe=dpo", "dpo.pairs=dataset", f"dpo.pairs_path={bad}",
            f"output_dir={tmp_path / 'bad'}",
        ],
    )
    assert (
        refused.exit_code == 2
        and "line 2: field 'chosen' is missing" in refused.output
        and not (tmp_path / "bad").exists()
    )
    on_policy = CliRunner().invoke(app, ["train", *micro_overrides, "recipe=dpo", f"output_dir={tmp_path / 'op'}"])
    assert on_policy.exit_code == 0, on_policy.output
    lines = [
        r for r in map(json.loads, (tmp_path / "op" / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "rl"
    ]
    assert [r["dpo/pairs"] for r in lines] == [0.0, 0.0, 0.0] and lines[-1]["policy_version"] == 0
