"""Which trainer systems exist today, and the check that a recipe's needs are met.

Recipes name the systems they need beyond the loss (objectives.recipes.SYSTEMS).
The trainer refuses a recipe whose systems are missing, before anything is
written, with a message that says what is missing: running DAPO without
dynamic sampling under the name "dapo" would be a silent fallback.
A system joins BUILT when the code that provides it lands.
"""

from __future__ import annotations

from reinforge.objectives.recipes import RECIPES, SYSTEMS
from reinforge.objectives.spec import ObjectiveSpec

BUILT: frozenset[str] = frozenset({
    "dynamic_sampling",            # loops/curation.py
    "zero_variance_filter",
    "active_refill",
    "positive_resampling_filter",
    "overlong_shaping",            # rewards/compose.py (reward.overlong)
    "fp32_lm_head",                # learner/logprobs.py: the LM head runs in fp32 (ForwardPlan.fp32_head)
    "critic",                      # learner/critic.py, loops/credit.py: a value model and GAE
    "value_pretraining",           # loops/credit.py CriticCredit.pretrain (objective.value.pretrain_steps)
    "preference_loop",             # loops/dpo.py: DPO / IPO on on-policy or dataset pairs
    "greedy_baseline",             # loops/baselines.py: ReMax's greedy rollout per prompt (train.mode=sync)
    "async",                       # loops/async_rl.py: train.mode=async, bounded staleness (recipe presets set it)
})


def missing_systems(recipe: str, spec: ObjectiveSpec | None = None) -> list[str]:
    """The systems that recipe `recipe` (run with objective `spec`) needs and the trainer lacks.

    A user's composition can need a system its base recipe does not: a critic
    advantage (gae) needs the critic whatever the recipe is called.
    """
    needed = list(RECIPES[recipe].requires)
    if getattr(spec, "needs_critic", False) and "critic" not in needed:
        needed.append("critic")
    return [name for name in needed if name not in BUILT]


def check_runnable(recipe: str, spec: ObjectiveSpec | None = None) -> None:
    """Raise NotImplementedError naming every missing system of `recipe` / `spec`."""
    missing = missing_systems(recipe, spec)
    if missing:
        needs = "; ".join(SYSTEMS[name] for name in missing)
        raise NotImplementedError(
            f"recipe {recipe!r} needs {needs}: not built yet in reinforge. "
            f"Its objective alone is available: recipe_loss({recipe!r}, ...), "
            "or compose it with another recipe's systems through objective.* overrides."
        )
