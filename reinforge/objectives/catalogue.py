"""The catalogue of methods and parts, generated from the registries.

`reinforge recipes` prints it; `python -m reinforge.objectives.catalogue` writes
docs/algorithms.md and the preset files reinforge/recipes/*.yaml from it, and
a test fails when the committed files differ from what this module
generates. Nothing here is written by hand twice: formulas come from the
docstrings of the registered functions, defaults from their signatures,
compositions from objectives.recipes.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from reinforge.objectives import (
    ADVANTAGE_TRANSFORMS,
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    RECIPES,
    ObjectiveSpec,
    PreferenceSpec,
    Recipe,
)
from reinforge.objectives.spec import ValueSpec

ROOT = Path(__file__).resolve().parent.parent
GENERATED_NOTE = ("Generated from reinforge/objectives by `python -m reinforge.objectives.catalogue`; "
                  "edit the code, not this file.")


@dataclass(frozen=True)
class RecipeRow:
    """One line of the recipe table."""

    method: str
    advantage: str
    objective: str
    aggregation: str
    kl: str
    extras: str


def _params(params: Mapping[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _with_params(name: str, params: Mapping[str, object]) -> str:
    return f"{name} ({_params(params)})" if params else name


def recipe_row(recipe: Recipe) -> RecipeRow:
    spec = recipe.objective
    extras = "; ".join(recipe.extras)
    if isinstance(spec, PreferenceSpec):
        return RecipeRow(
            recipe.name, "-", f"{spec.loss_type} (beta={spec.beta})", "mean over pairs", "-", extras
        )
    advantage = _with_params(spec.advantage, spec.advantage_params)
    if spec.value is not None:
        advantage += f" (lambda actor {spec.value.lam_actor}, critic {spec.value.lam_critic}"
        advantage += (
            f", length-adaptive alpha {spec.value.length_adaptive_alpha})" if spec.value.length_adaptive_alpha else ")"
        )
    objective = _with_params(spec.policy_loss, spec.policy_params)
    if spec.ratio_anchor != "old":
        objective += f" vs {spec.ratio_anchor}"
    if spec.correction:
        objective += " + " + _with_params(spec.correction, spec.correction_params)
    if spec.kl_estimator is None or spec.kl_coef == 0:
        kl = "none"
    else:
        kl = f"{spec.kl_estimator} {spec.kl_placement}, beta {spec.kl_coef}"
        if spec.kl_normalization != "none":
            kl += f", {spec.kl_normalization} normalised"
        if spec.reference == "ema":
            kl += f", EMA reference {spec.reference_ema}"
    return RecipeRow(recipe.name, advantage, objective, spec.aggregation, kl, extras)


def recipe_rows() -> list[RecipeRow]:
    return [recipe_row(recipe) for recipe in RECIPES.values()]


# ------------------------------------------------------------------ presets

def preset(recipe: Recipe) -> dict:
    """The preset of a recipe as config keys: its composition (objective.*) and settings."""
    out: dict = {"recipe": recipe.name}
    spec = recipe.objective
    if isinstance(spec, ObjectiveSpec):
        out["objective"] = objective_section(spec)
    for section, values in recipe.settings.items():
        out[section] = dict(values)
    return out


def objective_section(spec: ObjectiveSpec) -> dict:
    """`spec` as objective.* config keys: the parts always, the optional terms when used."""
    section: dict = {"advantage": spec.advantage}
    if spec.advantage_params:
        section["advantage_params"] = dict(spec.advantage_params)
    if spec.advantage_transforms:
        section["advantage_transforms"] = [
            {"name": t.name, "params": dict(t.params)} for t in spec.advantage_transforms
        ]
    section["policy_loss"] = spec.policy_loss
    if spec.policy_params:
        section["policy_params"] = dict(spec.policy_params)
    if spec.ratio_anchor != "old":
        section["ratio_anchor"] = spec.ratio_anchor
    section["correction"] = spec.correction or "none"
    if spec.correction_params:
        section["correction_params"] = dict(spec.correction_params)
    section["aggregation"] = spec.aggregation
    section["kl_estimator"] = spec.kl_estimator or "none"
    section["kl_coef"] = spec.kl_coef
    if spec.kl_estimator is not None:
        section["kl_placement"] = spec.kl_placement
        if spec.kl_normalization != "none":
            section["kl_normalization"] = spec.kl_normalization
        section["reference"] = spec.reference
        if spec.reference == "ema":
            section["reference_ema"] = spec.reference_ema
        if spec.kl_clamp is not None:
            section["kl_clamp"] = spec.kl_clamp
    section["entropy_coef"] = spec.entropy_coef
    if spec.entropy_advantage:
        section["entropy_advantage"] = spec.entropy_advantage
        section["entropy_advantage_kappa"] = spec.entropy_advantage_kappa
    if spec.whiten_advantages:
        section["whiten_advantages"] = True
    if spec.nll_coef:
        section["nll_coef"] = spec.nll_coef
    if spec.value is not None:
        section["value"] = {f.name: getattr(spec.value, f.name) for f in fields(ValueSpec)}
    return section


def preset_yaml(recipe: Recipe) -> str:
    """The text of reinforge/recipes/<name>.yaml."""
    lines = [f"# {recipe.name}: {recipe.summary}.", f"# Source: {recipe.paper}."]
    if recipe.extras:
        lines.append(f"# Beyond the loss: {'; '.join(recipe.extras)}.")
    if isinstance(recipe.objective, PreferenceSpec):
        spec = recipe.objective
        lines.append(f"# Preference objective: loss_type={spec.loss_type}, beta={spec.beta}, "
                     f"label_smoothing={spec.label_smoothing}.")
    lines.append(f"# {GENERATED_NOTE}")
    lines.append("# A variant of your own: copy this file, change parts, run `reinforge train --config FILE`.")
    return "\n".join(lines) + "\n" + yaml.safe_dump(preset(recipe), sort_keys=False, default_flow_style=False)


# ------------------------------------------------------------------ docs

def _formula(fn: Callable) -> str:
    """The first paragraph of a function's docstring, on one line (it states the formula)."""
    doc = inspect.getdoc(fn) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def _defaults(fn: Callable) -> str:
    items = [f"{p.name}={p.default}" for p in inspect.signature(fn).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
             and p.name not in ("sampler_logprobs", "selected", "top_logprobs", "sampler_top_logprobs", "group_ids",
                                "max_length", "reduce", "generator", "state", "token_penalty")]
    return ", ".join(items) or "-"


def _parts_table(title: str, table: Mapping[str, Callable], note: str) -> list[str]:
    lines = [f"## {title}", "", note, "", "| name | formula and source | parameters (defaults) |", "|---|---|---|"]
    lines += [f"| `{name}` | {_formula(fn)} | {_defaults(fn)} |" for name, fn in table.items()]
    return lines + [""]


def algorithms_markdown() -> str:
    header = ["method", "advantage", "objective", "aggregation", "KL", "curation and extras"]
    lines = [
        "# Algorithms",
        "",
        f"<!-- {GENERATED_NOTE} -->",
        "",
        "Every method is a composition of a few parts: an advantage estimator (and optional transforms), "
        "a policy objective with its ratio anchor, an optional sampler-learner correction, an aggregation, "
        "a KL term and an entropy bonus. Pick a method with `reinforge train recipe=NAME`; compose your own "
        "with `objective.*` overrides or a YAML file (`reinforge recipes NAME` prints a preset to start from); "
        "plug in your own function with an import path, e.g. `objective.policy_loss=mypkg.losses:my_loss`.",
        "",
        "## Recipes",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in recipe_rows():
        lines.append("| " + " | ".join(getattr(row, f.name).replace("|", "\\|") for f in fields(RecipeRow)) + " |")
    lines += ["", "Sources: " + "; ".join(f"{r.name}: {r.paper}" for r in RECIPES.values()) + ".", ""]
    lines += ["What each paper claims for its method (the paper's claim, not a measurement of reinforge's):", ""]
    lines += [f"- `{r.name}` ({r.paper}): {r.claim}." for r in RECIPES.values() if r.claim] + [""]
    lines += _parts_table("Advantage estimators", ADVANTAGES,
                          "`fn(rewards [N], group_ids [N], **params) -> [N]`, in `objectives/advantages.py`.")
    lines += _parts_table("Advantage transforms", ADVANTAGE_TRANSFORMS,
                          "Applied in order after the estimator; may drop samples.")
    lines += _parts_table(
        "Policy objectives",
        POLICY_LOSSES,
        "Per-token terms l = -J, `fn(*, logprobs, old_logprobs, advantages, mask, sampler_logprobs, **params)`.",
    )
    lines += _parts_table("Sampler-learner corrections", CORRECTIONS,
                          "Detached per-token weights from rho = exp(old - mu) that multiply the policy terms.")
    lines += _parts_table("Aggregations", AGGREGATIONS,
                          "Per-token weights over the whole optimizer batch (all micro-batches and ranks).")
    lines += _parts_table("KL estimators", KL_ESTIMATORS, "delta = logp - ref, clamped to [-20, 20].")
    lines += _parts_table("Preference losses", PREFERENCE_LOSSES, "Per pair, over summed sequence log-probs.")
    return "\n".join(lines).rstrip() + "\n"


def generated_files(root: Path | None = None) -> dict[Path, str]:
    """Every generated file (path -> text), relative to the repository `root`."""
    root = root or ROOT.parent
    files = {root / "docs" / "algorithms.md": algorithms_markdown()}
    for recipe in RECIPES.values():
        files[ROOT / "recipes" / f"{recipe.name}.yaml"] = preset_yaml(recipe)
    return files


def main() -> None:
    for path, text in generated_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
