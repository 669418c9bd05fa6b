"""The named methods as compositions of objective parts (ALGORITHMS.md, "Recipes").

This table is the single source of what a recipe name means: `recipe_loss`
uses it, `reinforge recipes` prints it, and docs/algorithms.md and the
preset files reinforge/recipes/*.yaml are generated from it
(`python -m reinforge.objectives.catalogue`). A recipe also names the trainer systems it
needs beyond the loss (a critic, dynamic sampling, asynchronous rollout...):
the trainer refuses a recipe whose systems it does not have yet, rather than
silently running something else under its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from reinforge.objectives.spec import ObjectiveSpec, Part, PreferenceSpec, ValueSpec

# Trainer systems a recipe may need, with the words used in error messages and the catalogue.
SYSTEMS: dict[str, str] = {
    "critic": "a value model (critic) trained alongside the policy",
    "value_pretraining": "value pre-training on the initial policy's returns",
    "dynamic_sampling": "dynamic sampling (resample until groups have reward variance)",
    "overlong_shaping": "overlong reward shaping",
    "zero_variance_filter": "the zero-variance group filter",
    "active_refill": "active refill of filtered groups",
    "positive_resampling_filter": "no-positive-resampling (prompts with pass rate >= 0.9 leave the pool)",
    "fp32_lm_head": "an fp32 LM head in low-precision training",
    "async": "asynchronous rollout and training with bounded staleness",
    "preference_loop": "the preference (DPO) training loop over chosen/rejected pairs",
    "greedy_baseline": "a greedy completion of each prompt (not trained on), scored as the baseline (ReMax)",
}


@dataclass(frozen=True)
class Recipe:
    """A named method: its objective, where it comes from, and what it needs."""

    name: str
    objective: ObjectiveSpec | PreferenceSpec
    paper: str                                  # "arXiv 2503.14476" (the primary source)
    summary: str                                # one line: what the method changes
    extras: tuple[str, ...] = ()                # curation and other settings beyond the loss (catalogue column)
    requires: tuple[str, ...] = ()  # keys of SYSTEMS the trainer must provide
    claim: str = ""                             # what its paper claims it does (docs/algorithms.md), if stated
    # config defaults (section -> key -> value)
    settings: Mapping[str, Mapping[str, object]] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        unknown = set(self.requires) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"recipe {self.name!r} requires unknown systems {sorted(unknown)}")
        object.__setattr__(
            self, "settings", MappingProxyType({k: MappingProxyType(dict(v)) for k, v in self.settings.items()})
        )


_PPO_CLIP = {"eps_low": 0.2, "eps_high": 0.2}
_CLIP_HIGHER = {"eps_low": 0.2, "eps_high": 0.28}
# Methods without a ratio (REINFORCE-style terms) are only unbiased on-policy:
# one optimizer step per rollout batch (ALGORITHMS.md: "one update per batch").
_ON_POLICY = {"train": {"ppo_epochs": 1, "mini_batches": 1}}
# Batch curation (curation/batches.py). DAPO samples up to 3 generation batches per step
# (its num_gen_batches; the paper gives no fixed limit); ScaleRL filters without refill and
# retires prompts at pass rate 0.9; Olmo 3 refills just the missing prompts.
_DYNAMIC_SAMPLING = {"filters": ["zero_variance"], "refill": "dynamic", "max_rounds": 3}
_SCALERL_CURATION = {"filters": ["zero_variance"], "refill": "none", "retire_pass_rate": 0.9}
_ACTIVE_REFILL = {"filters": ["zero_variance"], "refill": "active", "max_rounds": 3}


def _rl(advantage: str, policy_loss: str, aggregation: str, policy_params: Mapping[str, object] | None = None,
        **parts: object) -> ObjectiveSpec:
    """An ObjectiveSpec with no KL term unless `parts` sets one (most methods after DAPO drop it)."""
    parts = {"kl_estimator": None, "kl_coef": 0.0, **parts}
    return ObjectiveSpec(advantage=advantage, policy_loss=policy_loss, aggregation=aggregation,
                         policy_params=policy_params or {}, **parts)


_RECIPES = [
    Recipe("ppo", _rl("gae", "ppo_clip", "token_mean", _PPO_CLIP, kl_estimator="k1", kl_placement="in_reward",
                      kl_coef=0.05, value=ValueSpec(lam_actor=0.95, lam_critic=0.95, value_clip=0.2)),
           "arXiv 1707.06347", "clipped surrogate with a learned critic and GAE; KL to the reference in the reward",
           extras=("value clip 0.2", "critic loss 0.5 (V - R)^2 clipped"), requires=("critic",)),
    Recipe("reinforce", _rl("reinforce", "reinforce", "seq_mean_token_sum", advantage_params={"baseline": "ema"}),
           "Williams 1992", "A logp with a baseline: an EMA of past batch mean rewards",
           extras=("one update per batch",), settings=_ON_POLICY),
    Recipe("rloo", _rl("rloo", "reinforce", "seq_mean_token_sum"),
           "arXiv 2402.14740", "REINFORCE with the leave-one-out mean of the group as baseline",
           extras=("one update per batch",), settings=_ON_POLICY),
    Recipe("grpo", _rl("grpo", "ppo_clip", "seq_mean_token_mean", _PPO_CLIP, kl_estimator="k3", kl_coef=0.04),
           "arXiv 2402.03300", "group z-score advantage, PPO clip, k3 KL to the reference in the loss"),
    Recipe("dr_grpo", _rl("dr_grpo", "ppo_clip", "seq_mean_token_sum_norm", _PPO_CLIP),
           "arXiv 2503.20783", "GRPO without the std division and with a constant length normaliser"),
    Recipe("dapo", _rl("grpo", "ppo_clip", "token_mean", _CLIP_HIGHER),
           "arXiv 2503.14476", "clip-higher, token-level loss, dynamic sampling, overlong shaping",
           extras=("dynamic sampling", "overlong shaping"), requires=("dynamic_sampling", "overlong_shaping"),
           settings={"curation": _DYNAMIC_SAMPLING, "reward": {"overlong": {"coef": 1.0}}}),
    Recipe("gspo", _rl("grpo", "gspo", "seq_mean_token_mean", {"eps_low": 3e-4, "eps_high": 4e-4}),
           "arXiv 2507.18071", "sequence-level ratio (length-normalised), one clipped term per sequence"),
    Recipe("gmpo", _rl("grpo", "gmpo", "seq_mean_token_mean", {"eps": 0.4}),
           "arXiv 2507.20673", "geometric mean of clipped token ratios per sequence"),
    Recipe("cispo", _rl("grpo", "cispo", "token_mean", {"r_max": 5.0}),
           "arXiv 2506.13585", "clip the IS weight (stop-gradient), never the gradient of a token"),
    Recipe("sapo", _rl("grpo", "sapo", "seq_mean_token_mean", {"tau_pos": 1.0, "tau_neg": 1.05}),
           "arXiv 2511.20347", "a smooth sigmoid gate instead of the hard clip"),
    Recipe("dppo", _rl("grpo", "dppo_tv", "seq_mean_token_mean", {"delta": 0.15}),
           "arXiv 2602.04879", "trust region on the probability divergence from the sampler, not the ratio",
           extras=("ratio anchored on the sampler",)),
    # Cui et al. run both on DAPO's token-level loss with GRPO advantages and no KL to a reference;
    # r = 2e-4 in [1, 5] and k = 2e-3 (their Qwen2.5-7B value), penalty coefficient 1. KL-Cov's |logp - logp_old|
    # has zero gradient at pi_old: it acts from a batch's second optimizer step (train.mini_batches, default 2).
    # The top-K form of DPPO's TV (arXiv 2602.04879): the sampler records its 20 most likely ids per
    # position (K = 20 is a choice: the paper reports that top-K works, with no K given).
    Recipe("dppo_topk", _rl("grpo", "dppo_topk_tv", "seq_mean_token_mean", {"delta": 0.15}),
           "arXiv 2602.04879", "DPPO with the TV over the sampler's top-K tokens and the rest, not the sampled one",
           extras=("ratio anchored on the sampler", "rollout.record_top_k 20"),
           settings={"rollout": {"record_top_k": 20}}),
    Recipe("clip_cov", _rl("grpo", "clip_cov", "token_mean",
                           {"clip_ratio": 2e-4, "cov_low": 1.0, "cov_high": 5.0, **_PPO_CLIP}),
           "arXiv 2505.22617", "PPO clip; a random 2e-4 of the tokens with covariance in [1, 5] leave the gradient",
           extras=("selection over the whole mini-batch",)),
    Recipe("kl_cov", _rl("grpo", "kl_cov", "token_mean", {"k_ratio": 2e-3, "penalty_coef": 1.0}),
           "arXiv 2505.22617", "vanilla PG; |logp - logp_old| penalty on the top 2e-3 tokens by covariance",
           extras=("selection over the whole mini-batch",)),
    Recipe("maxrl", _rl("maxrl", "reinforce", "seq_mean_token_mean"),
           "arXiv 2602.02710", "advantage (R - r)/r with r the group pass rate: weight on hard prompts",
           extras=("one update per batch",), settings=_ON_POLICY),
    Recipe("gpg", _rl("gpg", "gpg", "token_mean"),
           "arXiv 2504.02546", "plain policy gradient with a group baseline rescaled for degenerate groups",
           extras=("no reference model loaded", "one update per batch"), settings=_ON_POLICY),
    Recipe("lite_ppo", _rl("lite_ppo", "ppo_clip", "token_mean", _PPO_CLIP),
           "arXiv 2508.08221", "group mean, batch std, token-level loss"),
    Recipe("scalerl", _rl("scalerl", "cispo", "prompt_mean", {"r_max": 5.0}, ratio_anchor="sampler"),
           "arXiv 2510.13786", "batch-normalised advantage, CISPO against the sampler, prompt-level mean",
           extras=("zero-variance filter (no refill)", "no positive resampling", "fp32 LM head", "async"),
           requires=("zero_variance_filter", "positive_resampling_filter", "fp32_lm_head", "async"),
           # PipelineRL with at most 8 steps of off-policyness, the paper's choice (sec. 3.1)
           settings={"curation": _SCALERL_CURATION, "train": {"mode": "async", "max_staleness": 8}}),
    Recipe("olmo3", _rl("dr_grpo", "ppo_clip", "token_mean", _CLIP_HIGHER, correction="tis",
                        correction_params={"cap": 2.0}),
           "arXiv 2512.13961", "Dr.GRPO advantage, clip-higher, truncated importance sampling",
           extras=("zero-variance filter with active refill",), requires=("zero_variance_filter", "active_refill"),
           settings={"curation": _ACTIVE_REFILL}),
    Recipe("vapo", _rl("gae", "ppo_clip", "token_mean", _CLIP_HIGHER, nll_coef=0.1,
                       # 20 pre-training steps: a choice sized for the built-in task (VC-PPO fits until
                       # explained variance levels off; raise objective.value.pretrain_steps for real models).
                       value=ValueSpec(lam_actor=0.95, lam_critic=1.0, length_adaptive_alpha=0.05, pretrain_steps=20)),
           "arXiv 2504.05118", "value-based: decoupled and length-adaptive GAE, clip-higher, NLL on correct samples",
           extras=("value pre-training", "positive NLL 0.1", "dynamic sampling"),
           requires=("critic", "value_pretraining", "dynamic_sampling"), settings={"curation": _DYNAMIC_SAMPLING}),
    # T1 gives no numbers for the EMA rate or the entropy coefficient: 0.99 and 1e-3 are choices.
    # The KL sits in the reward, centred on the batch mean after the advantage (on-policy KL normalisation).
    Recipe("t1", _rl("grpo", "ppo_clip", "token_mean", _PPO_CLIP, kl_estimator="k3", kl_coef=0.04,
                     kl_placement="in_reward", kl_normalization="on_policy",
                     reference="ema", reference_ema=0.99, entropy_coef=1e-3),
           "arXiv 2501.11651", "k3 KL to an EMA of the policy, centred on its on-policy mean; entropy bonus",
           extras=("entropy bonus 1e-3",)),
    Recipe("areal", _rl("grpo", "decoupled_ppo", "token_mean", {"eps": 0.2, "w_max": 5.0}),
           "arXiv 2505.24298", "decoupled PPO: proximal policy for the clip, behaviour weight for staleness",
           extras=("async, max staleness 4",), requires=("async",),
           settings={"train": {"mode": "async", "max_staleness": 4}}),
    Recipe("dpo", PreferenceSpec(loss_type="sigmoid", beta=0.1),
           "arXiv 2305.18290", "-log sigmoid(beta (h_w - h_l)) over chosen/rejected pairs; ipo and label smoothing",
           extras=("beta 0.1", "ipo: (h_w - h_l - 1/(2 beta))^2", "label smoothing s"), requires=("preference_loop",)),
]

# REINFORCE++ (OpenRLHF's defaults: k1 KL in the reward with beta 0.01; the baseline variant puts a k2 KL,
# beta 1e-3, in the loss, whose on-policy gradient is that of k1 in the reward) and ReMax (no KL, one update).
_RECIPES += [
    Recipe("reinforce_pp", _rl("reinforce_pp", "ppo_clip", "token_mean", _PPO_CLIP, kl_estimator="k1",
                               kl_placement="in_reward", kl_coef=0.01),
           "arXiv 2501.03262", "per-token returns with a k1 KL in the reward, whitened over the whole batch"),
    Recipe("reinforce_pp_baseline", _rl("reinforce_pp_baseline", "ppo_clip", "token_mean", _PPO_CLIP,
                                        kl_estimator="k2", kl_coef=1e-3),
           "arXiv 2501.03262", "group-mean baseline, then whitened by the batch (not the group) std; k2 KL loss"),
    Recipe("remax", _rl("remax", "reinforce", "seq_mean_token_sum"),
           "arXiv 2310.10505", "REINFORCE with the reward of the prompt's greedy completion as baseline",
           extras=("greedy baseline rollout", "one update per batch"), requires=("greedy_baseline",),
           settings=_ON_POLICY),
]

# Methods that aim to keep or widen pass@k coverage (objectives/coverage.py). Each claim is the paper's,
# not a measurement of reinforge's (docs/results.md has those).
_RECIPES += [
    # k = 4 with groups of 8 (train.group_size) is a choice; the paper varies k and the group size.
    Recipe("passk", _rl("passk", "ppo_clip", "token_mean", _PPO_CLIP, advantage_params={"k": 4}),
           "arXiv 2508.10751", "the advantage of the pass@k reward over every k-subset of the group, in closed form",
           claim="training on pass@k instead of pass@1 keeps exploring: pass@k rises, and pass@1 need not fall"),
    # The paper's W-REINFORCE is plain REINFORCE (no ratio, no baseline) on +1/-1 rewards: on-policy.
    Recipe("w_reinforce", _rl("w_reinforce", "reinforce", "token_mean", advantage_params={"positive_weight": 0.1}),
           "arXiv 2506.01347", "REINFORCE with weight 0.1 on correct samples and 1 on wrong ones (mostly negative)",
           extras=("one update per batch",), settings=_ON_POLICY,
           claim="negative samples alone keep pass@k at large k; down-weighting positives keeps it while pass@1 "
                 "rises"),
    Recipe("opo", _rl("opo", "ppo_clip", "token_mean", _PPO_CLIP),
           "arXiv 2505.23585", "exact on-policy updates with the length-weighted optimal baseline of the group",
           extras=("one update per batch",), settings=_ON_POLICY,
           claim="a lower-variance gradient that keeps entropy higher and outputs more diverse than GRPO's"),
    # OPO's update with a k3 KL to the start model in the loss, at GRPO's beta 0.04 (DeepSeekMath). ProRL keeps a
    # KL to a (periodically reset) reference so that prolonged RL keeps exploring; here it answers what
    # docs/results.md ("Widening") measured: the prompts RL breaks are ones the start model solved with margin.
    Recipe("opo_kl", _rl("opo", "ppo_clip", "token_mean", _PPO_CLIP, kl_estimator="k3", kl_coef=0.04),
           "arXiv 2505.23585, 2505.24864", "OPO (exact on-policy, length-weighted baseline) with a k3 KL to the "
           "start model in the loss", extras=("one update per batch",), settings=_ON_POLICY,
           claim="a KL anchor to the reference keeps prolonged RL from narrowing: pass@k at large k rises with "
                 "pass@1 (ProRL)"),
    # alpha 0.4 and kappa 2 as we read them in the paper; it shapes GRPO's and PPO's advantages alike.
    Recipe("entropy_adv", _rl("grpo", "ppo_clip", "token_mean", _PPO_CLIP, entropy_advantage=0.4,
                              entropy_advantage_kappa=2.0),
           "arXiv 2506.14758", "GRPO with an entropy bonus in each token's advantage, capped at |A| / 2",
           extras=("entropy advantage shaping alpha 0.4, kappa 2",),
           claim="a clipped entropy term in the advantage favours exploratory reasoning (longer chains, "
                 "reflection) and raises pass@k at large k over GRPO and PPO"),
]

RECIPES: dict[str, Recipe] = {recipe.name: recipe for recipe in _RECIPES}

# The RL recipes' objective specs by name (every recipe but the preference ones).
RECIPE_OBJECTIVES: dict[str, ObjectiveSpec] = {
    name: recipe.objective for name, recipe in RECIPES.items() if isinstance(recipe.objective, ObjectiveSpec)
}

__all__ = ["RECIPES", "RECIPE_OBJECTIVES", "SYSTEMS", "Part", "Recipe"]
