"""The critic of PPO / VAPO: value alignment, GAE wiring with hand numbers, value pre-training,
and exact resume with a critic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from reinforge.config import build_config
from reinforge.jobs.train import run
from reinforge.learner import ForwardPlan, build_sequences
from reinforge.learner.critic import Critic, ValueModel, explained_variance
from reinforge.loops.credit import CriticCredit
from reinforge.models import build_tiny_qwen2
from reinforge.objectives import resolve_spec
from reinforge.telemetry.checkpoint import CheckpointStore
from reinforge.telemetry.recorder import TIMING_KEYS


@pytest.fixture
def policy(micro_overrides):
    return build_tiny_qwen2(build_config(micro_overrides).model, seed=0)


def _sequences(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, 20, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]
    completion = torch.randint(3, 20, (n, 3), generator=g)
    mask = torch.ones(n, 3)
    mask[0, 2] = 0.0                                   # one shorter completion
    return prompts, build_sequences(prompts, completion, mask, pad_id=0)


def test_value_model_reads_the_state_before_each_completion_token(policy) -> None:
    _, seq = _sequences(3, 0)
    critic = ValueModel(policy.model)
    assert torch.equal(critic(seq), torch.zeros(3, 3))                  # the head starts at V = 0
    with torch.no_grad():
        critic.head.weight.zero_()
        critic.head.weight[0, 0] = 1.0                                   # V = first hidden feature
        hidden = critic.body(input_ids=seq.input_ids, attention_mask=seq.attention_mask).last_hidden_state
        values = critic(seq)
    for i in range(3):
        for t in range(3):
            expected = float(hidden[i, seq.starts[i] - 1 + t, 0]) * float(seq.completion_mask[i, t])
            assert float(values[i, t]) == pytest.approx(expected, abs=1e-6)
    # A copy: training the critic leaves the policy's body alone.
    assert critic.body is not policy.model.get_decoder()


def test_a_shared_body_value_head_trains_the_head_only(policy) -> None:
    critic = Critic(policy.model, lr=1e-2, shared_body=True)
    assert [name for name, _ in critic.model.named_parameters()] == ["head.weight", "head.bias"]
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    prompts, seq = _sequences(8, 4)
    returns = torch.tensor([float(p[0] % 2 == 0) for p in prompts]).unsqueeze(1) * seq.completion_mask
    old = critic.values(seq, ForwardPlan(micro_batch_size=8))
    critic.update(seq, old, returns, clip=None, epochs=3, mini_batches=1, grad_clip=1.0,
                  generator=torch.Generator().manual_seed(0), plan=ForwardPlan(micro_batch_size=8))
    assert all(torch.equal(before[k], v) for k, v in policy.model.state_dict().items())   # the policy is untouched
    assert float(critic.model.head.weight.detach().abs().sum()) > 0                          # the head learned
    with torch.no_grad():
        hidden = policy.model.get_decoder()(
            input_ids=seq.input_ids, attention_mask=seq.attention_mask
        ).last_hidden_state
        v = critic.model(seq)
        expected = critic.model.head(hidden[0, seq.starts[0] - 1]).squeeze()
    assert float(v[0, 0]) == pytest.approx(float(expected), abs=1e-6)                    # V reads the policy's features


def test_ppo_credit_is_gae_of_the_outcome_and_the_k1_penalty_by_hand(policy, monkeypatch) -> None:
    spec = resolve_spec("ppo")                      # k1 in the reward, beta 0.05, gamma 1, lambda 0.95 / 0.95
    credit = CriticCredit(spec, Critic(policy.model, lr=1e-3), ForwardPlan(micro_batch_size=8), epochs=1,
                          mini_batches=1, grad_clip=1.0)
    _, seq = _sequences(2, 1)
    seq.completion_mask[0] = torch.tensor([1.0, 1.0, 1.0])
    values = torch.tensor([[0.5, 0.25, 0.0], [0.3, 0.3, 0.3]])
    monkeypatch.setattr(credit.critic, "values", lambda batch, plan: values)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    ref = old - torch.tensor([[0.1, 0.0, 0.2], [0.0, 0.0, 0.0]])          # k1 = old - ref = 0.1, 0, 0.2
    out = credit.assign(seq, torch.tensor([1.0, float("nan")]), torch.tensor([True, False]), torch.tensor([0, 0]),
                        old, ref, torch.Generator())
    # r = [-0.05*0.1, 0, 1 - 0.05*0.2] = [-0.005, 0, 0.99]; delta_2 = 0.99, delta_1 = -0.25, delta_0 = -0.255;
    # A_2 = 0.99, A_1 = -0.25 + 0.95*0.99 = 0.6905, A_0 = -0.255 + 0.95*0.6905 = 0.400975.
    torch.testing.assert_close(out.advantages[0], torch.tensor([0.400975, 0.6905, 0.99]))
    assert out.keep.tolist() == [True, False]       # the sample without a reward leaves the batch
    sequences, old_values, returns, kl_metrics = credit._pending
    torch.testing.assert_close(returns[0], torch.tensor([0.900975, 0.9405, 0.99]))   # A + V (lambda_critic 0.95)
    assert torch.equal(old_values, values)
    assert kl_metrics == pytest.approx({"kl_in_reward": 0.3, "kl_coef": 0.05})     # sum_t k1 of the valid row


def test_turn_rewards_on_their_tokens_are_credited_by_gae_by_hand(policy, monkeypatch) -> None:
    """An environment crediting turn by turn (task.environment_reward=turn): 0.5 on the first turn's last
    token, 1.0 on the second's, instead of the 1.5 sum on the last token."""
    credit = CriticCredit(resolve_spec("ppo"), Critic(policy.model, lr=1e-3), ForwardPlan(micro_batch_size=8),
                          epochs=1, mini_batches=1, grad_clip=1.0)
    _, seq = _sequences(2, 1)
    seq.completion_mask[0] = torch.tensor([1.0, 1.0, 1.0])
    monkeypatch.setattr(credit.critic, "values", lambda batch, plan: torch.tensor([[0.5, 0.25, 0.0], [0.3] * 3]))
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
    ref = old - torch.tensor([[0.1, 0.0, 0.2], [0.0, 0.0, 0.0]])          # k1 = 0.1, 0, 0.2 (beta 0.05)
    placed = torch.tensor([[0.5, 0.0, 1.0], [float("nan")] * 3])        # the second row's episode failed
    out = credit.assign(seq, torch.tensor([1.5, float("nan")]), torch.tensor([True, False]), torch.tensor([0, 0]),
                        old, ref, torch.Generator(), token_rewards=placed)
    # r = [0.5 - 0.005, 0, 1 - 0.01]; delta_2 = 0.99, delta_1 = -0.25, delta_0 = 0.495 + 0.25 - 0.5 = 0.245;
    # A_1 = -0.25 + 0.95 * 0.99 = 0.6905, A_0 = 0.245 + 0.95 * 0.6905 = 0.900975.
    torch.testing.assert_close(out.advantages[0], torch.tensor([0.900975, 0.6905, 0.99]))
    assert out.keep.tolist() == [True, False]


def test_adaptive_kl_coefficient_by_hand(policy) -> None:
    from reinforge.objectives.kl import adaptive_kl_coef

    # e = clip(KL / target - 1, -0.2, 0.2); beta' = beta (1 + 0.1 e)
    assert adaptive_kl_coef(0.05, observed_kl=0.55, target=0.5) == pytest.approx(0.05 * 1.01)    # e = 0.1
    assert adaptive_kl_coef(0.05, observed_kl=5.0, target=0.5) == pytest.approx(0.05 * 1.02)     # clipped at +0.2
    assert adaptive_kl_coef(0.05, observed_kl=0.0, target=0.5) == pytest.approx(0.05 * 0.98)     # clipped at -0.2
    spec = resolve_spec("ppo")
    credit = CriticCredit(spec, Critic(policy.model, lr=1e-3), ForwardPlan(micro_batch_size=8), epochs=1,
                          mini_batches=1, grad_clip=1.0, kl_target=0.2)
    _, seq = _sequences(2, 3)
    old, ref = torch.zeros(2, 3), torch.full((2, 3), -0.1)  # k1 = 0.1 per token
    credit.assign(
        seq, torch.ones(2), torch.ones(2, dtype=torch.bool), torch.tensor([0, 0]), old, ref, torch.Generator()
    )
    # Sequence KLs 0.2 (2 tokens) and 0.3: mean 0.25 > 0.2: e = 0.25, clipped 0.2: beta 0.05 -> 0.051.
    assert credit.reward_kl.coef == pytest.approx(0.051)
    assert credit.state_dict()["kl_coef"] == pytest.approx(0.051)


def test_value_pretraining_raises_explained_variance(policy) -> None:
    # The return is decided by the prompt (its first token even or odd), so V can learn it from the state.
    spec = resolve_spec("vapo")
    credit = CriticCredit(spec, Critic(policy.model, lr=3e-3), ForwardPlan(micro_batch_size=16), epochs=1,
                          mini_batches=1, grad_clip=1.0)
    prompts, seq = _sequences(16, 2)
    rewards = torch.tensor([float(p[0] % 2 == 0) for p in prompts])
    assert 0 < rewards.mean() < 1
    valid = torch.ones(16, dtype=torch.bool)
    history = [credit.pretrain(seq, rewards, valid, torch.Generator().manual_seed(0))["critic/explained_variance"]
               for _ in range(40)]
    assert history[0] == pytest.approx(0.0, abs=1e-9)           # V = 0: explains nothing
    # Measured 0.997 / 0.997 / 0.998 after 40 steps (0.37 / 0.57 / 0.59 after 10) with the policy's seed and the
    # generator's 0 / 1 / 2 (and the sequences' seed 2 / 12 / 22): one seed runs here, the margin is 0.2.
    assert history[-1] > 0.8 and history[-1] > history[10] > history[0]


def test_pretraining_stops_when_explained_variance_has_converged() -> None:
    from reinforge.loops.rl import explained_variance_converged

    # patience 2, tolerance 0.01: the best of the last two steps must beat the best before by 0.01.
    assert not explained_variance_converged([0.1, 0.3], 2, 0.01)                   # too few steps to tell
    assert not explained_variance_converged([0.1, 0.3, 0.5, 0.55], 2, 0.01)        # still rising
    assert explained_variance_converged([0.1, 0.5, 0.505, 0.49], 2, 0.01)          # +0.005 over two steps
    assert explained_variance_converged([0.2, float("nan"), float("nan")], 2, 0.01)  # returns stopped varying
    assert not explained_variance_converged([float("nan"), float("nan"), 0.1], 2, 0.01)


def test_explained_variance_by_hand() -> None:
    returns, mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # valid R = 1, 0, 1 (var 2/9); V = 0.5, 0.5, 0.5: R - V = 0.5, -0.5, 0.5 (var 2/9): EV = 0
    assert explained_variance(torch.full((2, 2), 0.5), returns, mask) == pytest.approx(0.0)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)


def _stop_after_checkpoint(step: int, monkeypatch) -> None:
    real = CheckpointStore.save

    def save(self, at, tensors, meta):
        out = real(self, at, tensors, meta)
        if at == step:
            raise KeyboardInterrupt     # the process dies right after this checkpoint
        return out

    monkeypatch.setattr(CheckpointStore, "save", save)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["ppo", "vapo"])
def test_a_critic_run_resumes_exactly(tmp_path: Path, micro_overrides, monkeypatch, recipe: str) -> None:
    # seed 1: the micro model's samples vary in length in both pre-training steps (vapo's dynamic
    # sampling drops groups whose rewards are all equal, and a step with none left logs nothing).
    args = [
        *micro_overrides, "seed=1", f"recipe={recipe}", "train.steps=4", "checkpoint.every=1",
        "objective.value={pretrain_steps: 2}", "train.lr=1e-3",
        "reward.functions=[{name: verifier}, {name: length_penalty, params: {target: 2}}]",
    ]
    whole = run(build_config([*args, f"output_dir={tmp_path / 'whole'}"]))
    with monkeypatch.context() as patch:
        _stop_after_checkpoint(2, patch)
        with pytest.raises(KeyboardInterrupt):
            run(build_config([*args, f"output_dir={tmp_path / 'cut'}"]))
    resumed = run(build_config([*args, f"output_dir={tmp_path / 'cut'}"]), resume=True)
    assert resumed.summary["resumed_from_step"] == 2 and resumed.summary["eval"] == whole.summary["eval"]
    a, b = (load_file(tmp_path / name / "model" / "model.safetensors") for name in ("whole", "cut"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    def lines(name: str) -> list[dict]:
        text = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in TIMING_KEYS} for x in text]

    assert lines("cut") == lines("whole")
    rl = [r for r in lines("whole") if r["stage"] == "rl"]
    assert [r["stage"] for r in lines("whole")].count("value_pretrain") == 2
    trained = [r for r in rl if r["curation/prompts_kept"] > 0]      # dynamic sampling may leave a step nothing
    assert trained and all(r["critic/value_loss"] > 0 for r in trained)   # the critic trains on real returns
