"""Recipes: every named method resolves to the composition of the formula sheet, runs (or
says exactly what it still needs), and the catalogue, presets and docs come from one table."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from repo_paths import REPO
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import build_config
from reinforge.jobs.start import objective_spec
from reinforge.objectives import (
    RECIPE_OBJECTIVES,
    RECIPES,
    ObjectiveSpec,
    objective_loss,
    resolve_spec,
)
from reinforge.objectives.catalogue import generated_files, recipe_rows

runner = CliRunner()


def test_the_table_has_every_row_of_the_formula_sheet():
    assert set(RECIPES) == {
        "ppo", "reinforce", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "gmpo", "cispo", "sapo", "dppo",
        "maxrl", "gpg", "lite_ppo", "scalerl", "olmo3", "vapo", "t1", "areal", "dpo",
        "clip_cov", "kl_cov", "dppo_topk",
        "reinforce_pp", "reinforce_pp_baseline", "remax",
        "passk", "w_reinforce", "opo", "opo_kl", "entropy_adv",
    }


def _spec(name):
    return RECIPE_OBJECTIVES[name]


def test_compositions_match_the_formula_sheet():
    # (advantage, policy loss, policy params, aggregation, KL estimator or None) per ALGORITHMS.md.
    sheet = {
        "ppo": ("gae", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "token_mean", "k1"),
        "reinforce": ("reinforce", "reinforce", {}, "seq_mean_token_sum", None),
        "rloo": ("rloo", "reinforce", {}, "seq_mean_token_sum", None),
        "grpo": ("grpo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "seq_mean_token_mean", "k3"),
        "dr_grpo": ("dr_grpo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "seq_mean_token_sum_norm", None),
        "dapo": ("grpo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.28}, "token_mean", None),
        "gspo": ("grpo", "gspo", {"eps_low": 3e-4, "eps_high": 4e-4}, "seq_mean_token_mean", None),
        "gmpo": ("grpo", "gmpo", {"eps": 0.4}, "seq_mean_token_mean", None),
        "cispo": ("grpo", "cispo", {"r_max": 5.0}, "token_mean", None),
        "sapo": ("grpo", "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, "seq_mean_token_mean", None),
        "dppo": ("grpo", "dppo_tv", {"delta": 0.15}, "seq_mean_token_mean", None),
        "maxrl": ("maxrl", "reinforce", {}, "seq_mean_token_mean", None),
        "clip_cov": ("grpo", "clip_cov", {"clip_ratio": 2e-4, "cov_low": 1.0, "cov_high": 5.0, "eps_low": 0.2,
                                          "eps_high": 0.2}, "token_mean", None),
        "kl_cov": ("grpo", "kl_cov", {"k_ratio": 2e-3, "penalty_coef": 1.0}, "token_mean", None),
        "dppo_topk": ("grpo", "dppo_topk_tv", {"delta": 0.15}, "seq_mean_token_mean", None),
        "gpg": ("gpg", "gpg", {}, "token_mean", None),
        "lite_ppo": ("lite_ppo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "token_mean", None),
        "scalerl": ("scalerl", "cispo", {"r_max": 5.0}, "prompt_mean", None),
        "olmo3": ("dr_grpo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.28}, "token_mean", None),
        "vapo": ("gae", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.28}, "token_mean", None),
        "t1": ("grpo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "token_mean", "k3"),
        "areal": ("grpo", "decoupled_ppo", {"eps": 0.2, "w_max": 5.0}, "token_mean", None),
        "reinforce_pp": ("reinforce_pp", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "token_mean", "k1"),
        "reinforce_pp_baseline": ("reinforce_pp_baseline", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2},
                                  "token_mean", "k2"),
        "remax": ("remax", "reinforce", {}, "seq_mean_token_sum", None),
        "passk": ("passk", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "token_mean", None),
        "w_reinforce": ("w_reinforce", "reinforce", {}, "token_mean", None),
        "opo": ("opo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "token_mean", None),
        "opo_kl": ("opo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "token_mean", "k3"),
        "entropy_adv": ("grpo", "ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}, "token_mean", None),
    }
    assert set(sheet) == set(RECIPE_OBJECTIVES)
    for name, (advantage, policy_loss, params, aggregation, kl) in sheet.items():
        spec = _spec(name)
        got = (spec.advantage, spec.policy_loss, dict(spec.policy_params), spec.aggregation, spec.kl_estimator)
        assert got == (advantage, policy_loss, params, aggregation, kl), name
    assert (_spec("grpo").kl_coef, _spec("ppo").kl_coef, _spec("ppo").kl_placement) == (0.04, 0.05, "in_reward")
    assert _spec("ppo").value.value_clip == 0.2 and _spec("ppo").needs_critic
    assert (_spec("vapo").value.lam_critic, _spec("vapo").value.length_adaptive_alpha, _spec("vapo").nll_coef) == (
        1.0,
        0.05,
        0.1,
    )
    assert (_spec("olmo3").correction, dict(_spec("olmo3").correction_params)) == ("tis", {"cap": 2.0})
    assert _spec("scalerl").ratio_anchor == "sampler"
    assert (_spec("t1").reference, _spec("t1").entropy_coef) == ("ema", 1e-3)
    assert (_spec("t1").kl_placement, _spec("t1").kl_normalization) == ("in_reward", "on_policy")
    assert (_spec("reinforce_pp").kl_placement, _spec("reinforce_pp").kl_coef) == ("in_reward", 0.01)
    assert RECIPES["remax"].requires == ("greedy_baseline",)
    assert not _spec("gpg").needs_reference                       # "no reference model loaded"
    assert dict(_spec("reinforce").advantage_params) == {"baseline": "ema"}
    assert (RECIPES["dpo"].objective.beta, RECIPES["dpo"].objective.loss_type) == (0.1, "sigmoid")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_preset_yaml_resolves_to_the_recipe(name):
    # The generated preset is real config: loading recipe=NAME gives back the table's objective.
    cfg = build_config([f"recipe={name}"])
    if name in RECIPE_OBJECTIVES:
        assert objective_spec(cfg) == RECIPE_OBJECTIVES[name]
    for section, values in RECIPES[name].settings.items():
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            if isinstance(value, dict):   # a nested section: the preset sets some of its keys
                assert {k: getattr(got, k) for k in value} == value
            else:
                assert got == value


def test_generated_files_are_committed_and_current():
    # docs/algorithms.md and reinforge/recipes/*.yaml are generated:
    # regenerate with python -m reinforge.objectives.catalogue.
    for path, text in generated_files().items():
        assert path.is_file(), f"{path} is missing: run python -m reinforge.objectives.catalogue"
        assert path.read_text() == text, f"{path} is stale: run python -m reinforge.objectives.catalogue"


def test_catalogue_rows_come_from_the_registry():
    rows = {row.method: row for row in recipe_rows()}
    assert rows["dapo"].objective == "ppo_clip (eps_low=0.2, eps_high=0.28)"
    assert rows["olmo3"].objective == "ppo_clip (eps_low=0.2, eps_high=0.28) + tis (cap=2.0)"
    assert rows["grpo"].kl == "k3 in_loss, beta 0.04" and rows["dr_grpo"].kl == "none"


def test_recipes_command_prints_the_catalogue_and_a_preset():
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    for name in RECIPES:
        assert name in result.output
    result = runner.invoke(app, ["recipes", "dapo"])
    assert result.exit_code == 0 and "eps_high: 0.28" in result.output
    result = runner.invoke(app, ["recipes", "dapoo"])
    assert result.exit_code == 2 and "did you mean 'dapo'" in result.output


def _finite(record: dict) -> bool:
    return all(not isinstance(v, float) or math.isfinite(v) for v in record.values())


def _rl_lines(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["stage"] == "rl"]


@pytest.mark.parametrize("name", [n for n in RECIPES if isinstance(RECIPES[n].objective, ObjectiveSpec)])
def test_every_runnable_rl_recipe_trains_three_steps(tmp_path, micro_overrides, name):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, "sft.steps=1", "eval.num_prompts=2",
                                 f"recipe={name}", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = _rl_lines(out)
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert all(_finite(r) for r in rl)
    # A step whose groups curation filtered out (all rewards equal) has no update; the rest do.
    trained = [r for r in rl if r["curation/prompts_kept"] > 0]
    assert all("policy_loss" in r and "grad_norm" in r for r in trained)
    assert all("policy_loss" not in r for r in rl if r["curation/prompts_kept"] == 0)
    if trained:
        assert ("kl" in trained[0]) == RECIPE_OBJECTIVES[name].needs_reference
    # One optimizer step per batch for the ratio-free methods, mini_batches (2) for the rest.
    steps_per_batch = RECIPES[name].settings.get("train", {}).get("mini_batches", 2)
    assert rl[-1]["policy_version"] == len(trained) * steps_per_batch
    if not RECIPES[name].settings.get("curation"):
        assert len(trained) == 3


def test_an_async_recipe_run_synchronously_is_refused(tmp_path, micro_overrides):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, "recipe=scalerl", "train.mode=sync", f"output_dir={out}"])
    assert result.exit_code == 2 and "recipe 'scalerl' is asynchronous" in result.output
    assert not out.exists()


def test_a_composed_critic_advantage_trains_a_critic(tmp_path, micro_overrides):
    # Any recipe with advantage=gae gets the critic, whatever the recipe is called.
    result = runner.invoke(app, ["train", *micro_overrides, "objective.advantage=gae",
                                 "objective.value={lam_actor: 0.9}", f"output_dir={tmp_path / 'r'}"])
    assert result.exit_code == 0, result.output
    assert all("critic/value_loss" in r for r in _rl_lines(tmp_path / "r"))
    shared = runner.invoke(app, ["train", *micro_overrides, "recipe=ppo", "critic.shared_body=true",
                                 f"output_dir={tmp_path / 's'}"])
    assert shared.exit_code == 0, shared.output
    assert all("critic/value_loss" in r for r in _rl_lines(tmp_path / "s"))


def test_user_yaml_composes_parts(tmp_path, micro_overrides):
    # A method of one's own: RLOO advantages, CISPO's objective, TIS, token mean, noisy advantages.
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent("""
        recipe: grpo
        objective:
          advantage: rloo
          policy_loss: cispo
          policy_params: {r_max: 3.0}
          correction: tis
          correction_params: {cap: 1.5}
          aggregation: token_mean
          kl_estimator: none
          advantage_transforms:
            - {name: gaussian_noise, params: {sigma: 0.05}}
    """))
    cfg = build_config([*micro_overrides, f"output_dir={tmp_path / 'run'}"], str(path))
    spec = objective_spec(cfg)
    assert (spec.advantage, spec.policy_loss, dict(spec.policy_params)) == ("rloo", "cispo", {"r_max": 3.0})
    assert (spec.correction, spec.aggregation, spec.needs_reference) == ("tis", "token_mean", False)
    assert [(t.name, dict(t.params)) for t in spec.advantage_transforms] == [("gaussian_noise", {"sigma": 0.05})]
    result = runner.invoke(app, ["train", *micro_overrides, f"output_dir={tmp_path / 'run'}", "--config", str(path)])
    assert result.exit_code == 0, result.output
    rl = _rl_lines(tmp_path / "run")
    assert all(_finite(r) for r in rl) and "is_weight" in rl[0]


def test_replacing_a_part_drops_its_params_but_keeps_the_rest():
    # dapo's preset sets ppo_clip's eps; cispo takes r_max: the eps must not follow it.
    spec = objective_spec(build_config(["recipe=dapo", "objective.policy_loss=cispo"]))
    assert (spec.policy_loss, dict(spec.policy_params)) == ("cispo", {})
    spec = objective_spec(build_config(["recipe=dapo", "objective.policy_params.eps_high=0.3"]))
    assert dict(spec.policy_params) == {"eps_low": 0.2, "eps_high": 0.3}
    spec = objective_spec(build_config(["recipe=dapo", "objective.policy_loss=ppo_clip"]))
    assert dict(spec.policy_params) == {"eps_low": 0.2, "eps_high": 0.28}   # same part: params kept


def test_bad_compositions_are_config_errors(tmp_path, micro_overrides):
    for override, hint in [("objective.policy_loss=cispoo", "did you mean 'cispo'"),
                           ("objective.correction=tiss", "did you mean 'tis'"),
                           ("objective.policy_params.r_maxx=2", "unknown parameter"),
                           ("objective.ratio_anchor=sampler_typo", "ratio_anchor")]:
        result = runner.invoke(app, ["train", *micro_overrides, override, f"output_dir={tmp_path / 'r'}"])
        assert result.exit_code == 2 and hint in result.output, (override, result.output)
        assert not (tmp_path / "r").exists()


CALLS: list[float] = []


def my_policy_loss(*, logprobs, old_logprobs, advantages, mask, sampler_logprobs=None, scale=1.0):
    """A user's objective, plugged in by import path: J = scale * A * logp."""
    from reinforge.objectives import PolicyTerms

    CALLS.append(scale)
    return PolicyTerms(loss=-(scale * advantages * logprobs) * mask)


def test_user_objective_by_import_path(tmp_path, micro_overrides):
    CALLS.clear()
    result = runner.invoke(app, ["train", *micro_overrides, "sft.steps=1",
                                 "objective.policy_loss=test_recipes:my_policy_loss",
                                 "objective.policy_params={scale: 2.0}", f"output_dir={tmp_path / 'run'}"])
    assert result.exit_code == 0, result.output
    assert CALLS and set(CALLS) == {2.0}
    # The same function through recipe_loss: J = 2 A logp, token-summed per sequence -> loss = -2 * 0.5 * (-1).
    spec = resolve_spec("rloo", policy_loss="test_recipes:my_policy_loss", scale=2.0)
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    out = objective_loss(spec, logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=torch.tensor([0.5]),
                         mask=torch.ones(1, 1), weights=torch.ones(1, 1))
    assert out.loss.item() == pytest.approx(1.0)


def test_preset_files_are_valid_yaml_with_the_recipe_name():
    for name in RECIPES:
        data = yaml.safe_load((REPO / "reinforge" / "recipes" / f"{name}.yaml").read_text())
        assert data["recipe"] == name
