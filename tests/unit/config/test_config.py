"""Config: defaults, presets, overrides, and errors that say what to type instead."""

from __future__ import annotations

import pytest

from reinforge.config import build_config, parse_overrides
from reinforge.errors import ConfigError


def test_defaults_are_the_documented_pipeline() -> None:
    cfg = build_config([])
    assert (cfg.recipe, cfg.task.name, cfg.model.path, cfg.sft.enabled) == ("grpo", "arithmetic", "builtin", True)


def test_overrides_parse_as_yaml_scalars() -> None:
    tree = parse_overrides(
        ["train.lr=3e-4", "sft.enabled=false", "task.options={digits: 3}", "seed=7", "output_dir=runs/x"]
    )
    assert tree == {
        "train": {"lr": 3e-4},
        "sft": {"enabled": False},
        "task": {"options": {"digits": 3}},
        "seed": 7,
        "output_dir": "runs/x",
    }


def test_override_values_reach_the_config() -> None:
    cfg = build_config(["train.lr=3e-4", "recipe=dr_grpo", "task.name=countdown", "task.options.num_numbers=4"])
    assert cfg.train.lr == 3e-4 and cfg.recipe == "dr_grpo"
    assert cfg.task.name == "countdown" and cfg.task.options == {"num_numbers": 4}


def test_model_shorthand_sets_the_path() -> None:
    assert build_config(["model=/some/dir"]).model.path == "/some/dir"


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("trian.lr=1", "'train'"),
        ("train.learning_rate=1", "'train.lr'"),
        ("rollout.temprature=0.5", "'temperature'"),
        ("task.options.digit=3", "'digits'"),
        ("recipe=grop", "'grpo'"),
        ("task.name=arithmetc", "'arithmetic'"),
    ],
)
def test_unknown_names_suggest_the_closest(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}"):
        build_config([override])


def test_invalid_values_are_rejected_with_their_key() -> None:
    with pytest.raises(ConfigError, match="train.group_size"):
        build_config(["train.group_size=1"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        build_config(["train.steps"])


def test_yaml_file_then_overrides(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("recipe: dr_grpo\ntrain:\n  steps: 5\n  lr: 0.01\n")
    cfg = build_config(["train.steps=7"], str(path))
    assert (cfg.recipe, cfg.train.steps, cfg.train.lr) == ("dr_grpo", 7, 0.01)
    path.write_text("train:\n  stpes: 5\n")
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        build_config([], str(path))


def test_the_objective_section_is_the_spec_s_fields_and_lists_what_the_registries_hold() -> None:
    """One override per ObjectiveSpec field, in its order (plus the eps_low / eps_high shortcuts of
    policy_params after policy_params), each None (keep the recipe's); the names a doc lists are
    the registry's keys, so a new estimator shows up in `reinforge config objective` unasked."""
    from dataclasses import fields

    from reinforge.objectives import (
        ADVANTAGE_TRANSFORMS,
        ADVANTAGES,
        AGGREGATIONS,
        CORRECTIONS,
        KL_ESTIMATORS,
        POLICY_LOSSES,
    )
    from reinforge.objectives.spec import ObjectiveSpec
    from reinforge.settings.objective import ObjectiveConfig, TransformConfig

    spec = [f.name for f in fields(ObjectiveSpec)]
    at = spec.index("policy_params") + 1
    assert list(ObjectiveConfig.model_fields) == [*spec[:at], "eps_low", "eps_high", *spec[at:]]
    assert set(ObjectiveConfig().model_dump().values()) == {None}
    docs = {key: f.description for key, f in ObjectiveConfig.model_fields.items()}
    for key, table in (("advantage", ADVANTAGES), ("policy_loss", POLICY_LOSSES), ("correction", CORRECTIONS),
                       ("aggregation", AGGREGATIONS), ("kl_estimator", KL_ESTIMATORS)):
        assert f"{', '.join(table)}" in docs[key], key
    assert ", ".join(ADVANTAGE_TRANSFORMS) in TransformConfig.model_fields["name"].description
    with pytest.raises(ConfigError, match="objective.kl_coef"):
        build_config(["objective.kl_coef=-1"])       # the spec's bounds hold for an override
    with pytest.raises(ConfigError, match="objective.reference_ema"):
        build_config(["objective.reference_ema=1.5"])
